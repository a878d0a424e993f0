//! The general convolution (any stride): the input unfolded (im2col) one
//! tile of output columns at a time, so the workspace stays a few MB however
//! large the batch, each tile multiplied by the weight with `gemm`.

use super::geom::Geom;
use super::{Workspace, WORKSPACE_BYTES};
use crate::host_nn::matmul::{gemm, MatRef};
use crate::host_nn::work::{for_each_unit, zeroed, SharedMut};
use crate::host_nn::{NnFloat, NnResult};

const OP: &str = "conv2d";

/// The range of output columns `ox` in `0..ow` whose input column
/// `ox·s + off` lies in `0..w` (`off` may be negative).
#[inline]
pub(crate) fn valid_range(ow: usize, s: usize, off: isize, w: usize) -> (usize, usize) {
    // ox·s + off ≥ 0  ⇔  ox ≥ ceil(−off / s)
    let lo = if off >= 0 { 0 } else { off.unsigned_abs().div_ceil(s) };
    // ox·s + off < w  ⇔  ox < ceil((w − off) / s)
    let hi = if off >= w as isize { 0 } else { (w as isize - off) as usize }.div_ceil(s);
    let lo = lo.min(ow);
    (lo, hi.clamp(lo, ow))
}

/// Walks the output columns `p0..p0 + cols` of an `ow`-wide output in runs
/// along one output row: `f(j, oy, ox0, run)` for the run starting at tile
/// column `j`.
#[inline]
fn runs(ow: usize, p0: usize, cols: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let (mut j, mut p) = (0, p0);
    while j < cols {
        let (oy, ox0) = (p / ow, p % ow);
        let run = (ow - ox0).min(cols - j);
        f(j, oy, ox0, run);
        j += run;
        p += run;
    }
}

/// Unfolds the output columns `p0..p0 + cols` of channels `c0..c1` of one
/// image's group (`img`: icg planes of h×w) into `col` (rows (c − c0, ky,
/// kx) of `cols`).
pub(crate) fn im2col<T: NnFloat>(g: &Geom, img: &[T], (c0, c1): (usize, usize), p0: usize, cols: usize, col: &mut [T]) {
    let plane = g.in_plane();
    for c in c0..c1 {
        let src = &img[c * plane..(c + 1) * plane];
        for ky in 0..g.kh {
            for kx in 0..g.kw {
                let row = ((c - c0) * g.kh + ky) * g.kw + kx;
                let dst = &mut col[row * cols..(row + 1) * cols];
                let x_off = (kx * g.dw) as isize - g.pl;
                let (lo, hi) = valid_range(g.ow, g.sw, x_off, g.w);
                runs(g.ow, p0, cols, |j, oy, ox0, run| {
                    let out = &mut dst[j..j + run];
                    let iy = (oy * g.sh + ky * g.dh) as isize - g.pt;
                    let (a, b) = (lo.clamp(ox0, ox0 + run), hi.clamp(ox0, ox0 + run));
                    if iy < 0 || iy >= g.h as isize || a >= b {
                        out.fill(T::ZERO);
                        return;
                    }
                    let line = &src[iy as usize * g.w..(iy as usize + 1) * g.w];
                    out[..a - ox0].fill(T::ZERO);
                    out[b - ox0..].fill(T::ZERO);
                    let first = (a * g.sw) as isize + x_off;
                    let mid = &mut out[a - ox0..b - ox0];
                    if g.sw == 1 {
                        mid.copy_from_slice(&line[first as usize..first as usize + mid.len()]);
                    } else {
                        for (i, o) in mid.iter_mut().enumerate() {
                            *o = line[first as usize + i * g.sw];
                        }
                    }
                });
            }
        }
    }
}

/// Adds the columns of `col` back where [`im2col`] took them from (the
/// input gradient of the unfolding).
pub(crate) fn col2im<T: NnFloat>(g: &Geom, col: &[T], p0: usize, cols: usize, img: &mut [T]) {
    let plane = g.in_plane();
    for c in 0..g.icg {
        let dst = &mut img[c * plane..(c + 1) * plane];
        for ky in 0..g.kh {
            for kx in 0..g.kw {
                let row = (c * g.kh + ky) * g.kw + kx;
                let src = &col[row * cols..(row + 1) * cols];
                let x_off = (kx * g.dw) as isize - g.pl;
                let (lo, hi) = valid_range(g.ow, g.sw, x_off, g.w);
                runs(g.ow, p0, cols, |j, oy, ox0, run| {
                    let iy = (oy * g.sh + ky * g.dh) as isize - g.pt;
                    let (a, b) = (lo.clamp(ox0, ox0 + run), hi.clamp(ox0, ox0 + run));
                    if iy < 0 || iy >= g.h as isize || a >= b {
                        return;
                    }
                    let line = &mut dst[iy as usize * g.w..(iy as usize + 1) * g.w];
                    let first = ((a * g.sw) as isize + x_off) as usize;
                    for (i, &v) in src[j + a - ox0..j + b - ox0].iter().enumerate() {
                        line[first + i * g.sw] += v;
                    }
                });
            }
        }
    }
}

/// Output columns per tile: the unfolded tile and its product within the
/// workspace budget, at least 16, at most `limit`.
fn tile_cols<T>(g: &Geom, limit: usize) -> usize {
    let per_col = (g.k_len() + g.ocg).max(1) * std::mem::size_of::<T>();
    (WORKSPACE_BYTES / per_col).max(16).min(limit).max(1)
}

/// `out = conv(input, weight)` (no bias) for any geometry.
pub(crate) fn forward<T: NnFloat>(g: &Geom, input: &[T], weight: &[T], out: &mut [T], threads: usize) -> NnResult<()> {
    let (op, k_len) = (g.out_plane(), g.k_len());
    let cols = tile_cols::<T>(g, op);
    let tiles = op.div_ceil(cols);
    let units = g.n * g.groups * tiles;
    let inner = if units < threads { threads } else { 1 };
    let dst = SharedMut::new(out);
    for_each_unit(
        threads,
        units,
        || Ok((zeroed::<T>(OP, k_len * cols)?, zeroed::<T>(OP, g.ocg * cols)?)),
        |(col, prod), u| {
            let (ng, t) = (u / tiles, u % tiles);
            let (n, grp) = (ng / g.groups, ng % g.groups);
            let p0 = t * cols;
            let c = cols.min(op - p0);
            let img = &input[(n * g.c_in() + grp * g.icg) * g.in_plane()..][..g.icg * g.in_plane()];
            im2col(g, img, (0, g.icg), p0, c, &mut col[..k_len * c]);
            let w = &weight[grp * g.ocg * k_len..][..g.ocg * k_len];
            gemm(
                (g.ocg, c, k_len),
                &mut prod[..g.ocg * c],
                (c, 1),
                MatRef { data: w, rs: k_len, cs: 1 },
                MatRef { data: &col[..k_len * c], rs: c, cs: 1 },
                false,
                inner,
            );
            for o in 0..g.ocg {
                let at = (n * g.c_out() + grp * g.ocg + o) * op + p0;
                // SAFETY: unit (n, grp, t) alone writes columns p0..p0 + c of
                // its group's output channels of image n.
                let row = unsafe { dst.slice(at, c) };
                row.copy_from_slice(&prod[o * c..(o + 1) * c]);
            }
            Ok(())
        },
    )
}

/// `grad_input` of the convolution for any geometry: each tile of the
/// output gradient times the transposed weight, folded back (col2im).
pub(crate) fn backward_input<T: NnFloat>(g: &Geom, weight: &[T], dout: &[T], gin: &mut [T], threads: usize) -> NnResult<()> {
    let (op, k_len, ip) = (g.out_plane(), g.k_len(), g.in_plane());
    let cols = tile_cols::<T>(g, op);
    let units = g.n * g.groups;
    let inner = if units < threads { threads } else { 1 };
    let dst = SharedMut::new(gin);
    for_each_unit(
        threads,
        units,
        || zeroed::<T>(OP, k_len * cols),
        |col, u| {
            let (n, grp) = (u / g.groups, u % g.groups);
            // SAFETY: unit (n, grp) alone writes its group's input channels of image n.
            let img = unsafe { dst.slice((n * g.c_in() + grp * g.icg) * ip, g.icg * ip) };
            img.fill(T::ZERO);
            let w = &weight[grp * g.ocg * k_len..][..g.ocg * k_len];
            let mut p0 = 0;
            while p0 < op {
                let c = cols.min(op - p0);
                let d = &dout[(n * g.c_out() + grp * g.ocg) * op + p0..];
                gemm(
                    (k_len, c, g.ocg),
                    &mut col[..k_len * c],
                    (c, 1),
                    MatRef { data: w, rs: 1, cs: k_len },
                    MatRef { data: &d[..(g.ocg - 1) * op + c], rs: op, cs: 1 },
                    false,
                    inner,
                );
                col2im(g, &col[..k_len * c], p0, c, img);
                p0 += c;
            }
            Ok(())
        },
    )
}

/// Adds to `acc` (`[ocg, (c1 − c0)·taps]`) the weight gradient of group
/// `grp`'s input channels `c0..c1` over images `n0..n1`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate_weight<T: NnFloat>(
    g: &Geom,
    input: &[T],
    dout: &[T],
    (n0, n1): (usize, usize),
    grp: usize,
    (c0, c1): (usize, usize),
    acc: &mut [T],
    ws: &mut Workspace<T>,
) -> NnResult<()> {
    let (op, ip) = (g.out_plane(), g.in_plane());
    let kb = (c1 - c0) * g.taps();
    if kb == 0 {
        return Ok(());
    }
    let cols = tile_cols::<T>(g, op);
    let (col, _) = ws.two(kb * cols, 0)?;
    for n in n0..n1 {
        let img = &input[(n * g.c_in() + grp * g.icg) * ip..][..g.icg * ip];
        let mut p0 = 0;
        while p0 < op {
            let c = cols.min(op - p0);
            im2col(g, img, (c0, c1), p0, c, &mut col[..kb * c]);
            let d = &dout[(n * g.c_out() + grp * g.ocg) * op + p0..];
            gemm(
                (g.ocg, kb, c),
                acc,
                (kb, 1),
                MatRef { data: &d[..(g.ocg - 1) * op + c], rs: op, cs: 1 },
                MatRef { data: &col[..kb * c], rs: 1, cs: c },
                true,
                1,
            );
            p0 += c;
        }
    }
    Ok(())
}
