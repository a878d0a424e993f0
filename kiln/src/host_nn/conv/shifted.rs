//! Stride-1 convolutions without unfolding. A band of output rows reads a
//! band of the zero-padded input; laid out `wp = ow + (kw − 1)·dw` wide,
//! the input seen by kernel tap (ky, kx) for output (oy, ox) sits at
//! `(oy + ky·dh)·wp + ox + kx·dw`, so for every tap the band is a plain
//! strided matrix (channels × output positions, shifted by the tap) and the
//! convolution is the sum over taps of one product each. The output comes
//! out `wp` wide too; its last `wp − ow` columns of each row are dropped.

use super::geom::Geom;
use super::{TapWeights, Workspace, WORKSPACE_BYTES};
use crate::host_nn::matmul::{gemm, MatRef};
use crate::host_nn::vector::{level, Level};
use crate::host_nn::work::{for_each_unit, SharedMut};
use crate::host_nn::{NnFloat, NnResult};

/// Copies input rows `y0 − pt ..` of `channels` planes (`img`, h×w each)
/// into `band` (planes of `plane` elements, rows of `wp`), zero where the
/// padding is. With `check`, returns whether every value copied is finite
/// (else true).
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill_band<T: NnFloat>(
    g: &Geom,
    img: &[T],
    channels: usize,
    y0: usize,
    rr: usize,
    wp: usize,
    plane: usize,
    band: &mut [T],
    check: bool,
) -> bool {
    let ip = g.in_plane();
    // Band columns x read input column x − pl.
    let lo = g.pl.clamp(0, wp as isize) as usize;
    let hi = (g.pl + g.w as isize).clamp(lo as isize, wp as isize) as usize;
    // Input rows inside the image: band rows r0..r1.
    let r0 = (g.pt - y0 as isize).clamp(0, rr as isize) as usize;
    let r1 = (g.pt + g.h as isize - y0 as isize).clamp(r0 as isize, rr as isize) as usize;
    let interior = lo < hi && r0 < r1;
    // Zero everything but the interior in as few passes as the layout allows
    // (short rows make per-row fills cost more than the data).
    if !interior || wp - (hi - lo) > 0 {
        band[..channels * plane].fill(T::ZERO);
    } else {
        for c in 0..channels {
            let dst = &mut band[c * plane..(c + 1) * plane];
            dst[..r0 * wp].fill(T::ZERO);
            dst[r1 * wp..].fill(T::ZERO);
        }
    }
    if !interior {
        return true;
    }
    let mut finite = true;
    let first = (lo as isize - g.pl) as usize;
    for c in 0..channels {
        let src = &img[c * ip..(c + 1) * ip];
        let dst = &mut band[c * plane..(c + 1) * plane];
        for r in r0..r1 {
            let iy = (y0 + r) as isize - g.pt;
            let from = iy as usize * g.w + first;
            let part = &src[from..from + (hi - lo)];
            dst[r * wp + lo..r * wp + hi].copy_from_slice(part);
            if check {
                finite &= part.iter().fold(true, |ok, v| ok & v.is_finite());
            }
        }
    }
    finite
}

/// Output rows per band: the input band and the product within the
/// workspace budget, and bands enough for every thread.
pub(crate) fn band_rows<T>(g: &Geom, in_ch: usize, out_ch: usize, wp: usize, images: usize, threads: usize) -> usize {
    let size = std::mem::size_of::<T>();
    let per_row = (in_ch + out_ch).max(1).saturating_mul(wp).saturating_mul(size).max(1);
    let halo = ((g.kh - 1) * g.dh).saturating_mul(in_ch).saturating_mul(wp).saturating_mul(size);
    let mut rows = (WORKSPACE_BYTES.saturating_sub(halo) / per_row).clamp(1, g.oh.max(1));
    if images < threads {
        rows = rows.min(g.oh.saturating_mul(images).div_ceil(threads).max(1));
    }
    rows
}

/// `out = conv(input, weights) + bias` for a stride-1 geometry.
pub(crate) fn forward<T: NnFloat>(
    g: &Geom,
    input: &[T],
    tw: TapWeights<'_, T>,
    bias: Option<&[T]>,
    out: &mut [T],
    threads: usize,
) -> NnResult<()> {
    if let (Some(x), Some(o)) = (T::as_f32(input), T::as_f32_mut(out)) {
        #[cfg(target_arch = "x86_64")]
        match level() {
            Level::Avx512 => return forward_f32::<crate::host_nn::vector::Avx512, T>(g, x, tw, bias, o, threads),
            Level::Avx2 => return forward_f32::<crate::host_nn::vector::Avx2, T>(g, x, tw, bias, o, threads),
            Level::Portable => {}
        }
        let _ = (x, o);
    }
    let (ip, op) = (g.in_plane(), g.out_plane());
    let wp = g.ow + (g.kw - 1) * g.dw;
    let rows = band_rows::<T>(g, g.icg, g.ocg, wp, g.n * g.groups, threads);
    let bands = g.oh.div_ceil(rows);
    let units = g.n * g.groups * bands;
    let inner = if units < threads { threads } else { 1 };
    let dst = SharedMut::new(out);
    for_each_unit(
        threads,
        units,
        || Ok(Workspace::new()),
        |ws, u| {
            let (ng, b) = (u / bands, u % bands);
            let (n, grp) = (ng / g.groups, ng % g.groups);
            let y0 = b * rows;
            let r = rows.min(g.oh - y0);
            let rr = r + (g.kh - 1) * g.dh;
            let plane = rr * wp;
            let (band, prod) = ws.two(g.icg * plane, g.ocg * r * wp)?;
            // The dropped columns are never read back: a non-finite input there is harmless.
            let _ = fill_band(g, &input[(n * g.c_in() + grp * g.icg) * ip..], g.icg, y0, rr, wp, plane, band, false);
            let ncols = (r - 1) * wp + g.ow;
            for tap in 0..g.taps() {
                let off = (tap / g.kw) * g.dh * wp + (tap % g.kw) * g.dw;
                gemm(
                    (g.ocg, ncols, g.icg),
                    prod,
                    (r * wp, 1),
                    tw.matrix(grp, tap),
                    MatRef { data: &band[off..], rs: plane, cs: 1 },
                    tap > 0,
                    inner,
                );
            }
            for o in 0..g.ocg {
                let c = grp * g.ocg + o;
                let add = bias.map_or(T::ZERO, |b| b[c]);
                // SAFETY: unit (n, grp, b) alone writes rows y0..y0 + r of its
                // group's output channels of image n.
                let dst = unsafe { dst.slice((n * g.c_out() + c) * op + y0 * g.ow, r * g.ow) };
                for (y, line) in dst.chunks_mut(g.ow).enumerate() {
                    let src = &prod[o * r * wp + y * wp..][..g.ow];
                    if bias.is_some() {
                        for (d, &s) in line.iter_mut().zip(src) {
                            *d = s + add;
                        }
                    } else {
                        line.copy_from_slice(src);
                    }
                }
            }
            Ok(())
        },
    )
}

/// The f32 forward: Winograd where it applies and the input is finite,
/// else the direct tiles.
fn forward_f32<I: super::direct::Kernels, T: NnFloat>(
    g: &Geom,
    input: &[f32],
    tw: TapWeights<'_, T>,
    bias: Option<&[T]>,
    out: &mut [f32],
    threads: usize,
) -> NnResult<()> {
    if super::winograd::applies(g) && super::winograd::forward::<I, T>(g, input, tw, bias, out, threads)? {
        return Ok(());
    }
    super::direct::forward::<I, T>(g, input, tw, bias, out, threads)
}

/// The f32 weight gradient: Winograd where it applies and the values are
/// finite, else the direct tiles.
#[allow(clippy::too_many_arguments)]
fn accumulate_weight_f32<I: super::direct::Kernels, T: NnFloat>(
    g: &Geom,
    input: &[f32],
    dout: &[f32],
    n: (usize, usize),
    grp: usize,
    c: (usize, usize),
    acc: &mut [f32],
    ws: &mut Workspace<T>,
) -> NnResult<()> {
    if super::winograd::applies(g) && super::winograd::accumulate_weight::<I, T>(g, input, dout, n, grp, c, acc, ws)? {
        return Ok(());
    }
    super::direct::accumulate_weight::<I, T>(g, input, dout, n, grp, c, acc, ws)
}

/// Adds to `acc` (`[ocg, (c1 − c0)·taps]`) the weight gradient of group
/// `grp`'s input channels `c0..c1` over images `n0..n1`: per tap, the output
/// gradient (laid out `wp` wide, zero in the dropped columns) times the
/// shifted input band.
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
    if let (Some(x), Some(d), Some(a)) = (T::as_f32(input), T::as_f32(dout), T::as_f32_mut(acc)) {
        #[cfg(target_arch = "x86_64")]
        match level() {
            Level::Avx512 => return accumulate_weight_f32::<crate::host_nn::vector::Avx512, T>(g, x, d, (n0, n1), grp, (c0, c1), a, ws),
            Level::Avx2 => return accumulate_weight_f32::<crate::host_nn::vector::Avx2, T>(g, x, d, (n0, n1), grp, (c0, c1), a, ws),
            Level::Portable => {}
        }
        let _ = (x, d, a);
    }
    let (ip, op, taps) = (g.in_plane(), g.out_plane(), g.taps());
    let cb = c1 - c0;
    if cb == 0 {
        return Ok(());
    }
    let wp = g.ow + (g.kw - 1) * g.dw;
    let rows = band_rows::<T>(g, cb, g.ocg, wp, usize::MAX, 1);
    for n in n0..n1 {
        let mut y0 = 0;
        while y0 < g.oh {
            let r = rows.min(g.oh - y0);
            let rr = r + (g.kh - 1) * g.dh;
            let plane = rr * wp;
            let (band, dbuf) = ws.two(cb * plane, g.ocg * r * wp)?;
            let finite = fill_band(g, &input[(n * g.c_in() + grp * g.icg + c0) * ip..], cb, y0, rr, wp, plane, band, true);
            for o in 0..g.ocg {
                let src = &dout[(n * g.c_out() + grp * g.ocg + o) * op + y0 * g.ow..][..r * g.ow];
                let dst = &mut dbuf[o * r * wp..(o + 1) * r * wp];
                for (line, s) in dst.chunks_mut(wp).zip(src.chunks(g.ow)) {
                    line[..g.ow].copy_from_slice(s);
                    line[g.ow..].fill(T::ZERO);
                }
            }
            let ncols = (r - 1) * wp + g.ow;
            if !finite {
                accumulate_band_exact(g, (r, wp, plane), dbuf, band, cb, acc);
                y0 += r;
                continue;
            }
            for tap in 0..taps {
                let off = (tap / g.kw) * g.dh * wp + (tap % g.kw) * g.dw;
                gemm(
                    (g.ocg, cb, ncols),
                    &mut acc[tap..],
                    (cb * taps, taps),
                    MatRef { data: dbuf, rs: r * wp, cs: 1 },
                    MatRef { data: &band[off..], rs: 1, cs: plane },
                    true,
                    1,
                );
            }
            y0 += r;
        }
    }
    Ok(())
}

/// One band's weight gradient summed over the real output positions only,
/// for a band holding a non-finite input: the fast paths also multiply the
/// dropped columns (whose output gradient is zero) by input values, and
/// 0 · ∞ would make a NaN that the true gradient does not have.
pub(crate) fn accumulate_band_exact<T: NnFloat>(
    g: &Geom,
    (r, wp, plane): (usize, usize, usize),
    dbuf: &[T],
    band: &[T],
    cb: usize,
    acc: &mut [T],
) {
    accumulate_band_exact_strided(g, (r, wp, plane, r * wp), dbuf, band, cb, acc);
}

/// [`accumulate_band_exact`] with output-gradient rows `dstride` apart.
pub(crate) fn accumulate_band_exact_strided<T: NnFloat>(
    g: &Geom,
    (r, wp, plane, dstride): (usize, usize, usize, usize),
    dbuf: &[T],
    band: &[T],
    cb: usize,
    acc: &mut [T],
) {
    let taps = g.taps();
    for o in 0..g.ocg {
        for c in 0..cb {
            for tap in 0..taps {
                let off = c * plane + (tap / g.kw) * g.dh * wp + (tap % g.kw) * g.dw;
                let mut sum = T::ZERO;
                for y in 0..r {
                    for x in 0..g.ow {
                        sum += dbuf[o * dstride + y * wp + x] * band[off + y * wp + x];
                    }
                }
                acc[o * cb * taps + c * taps + tap] += sum;
            }
        }
    }
}
