//! Winograd's F(2×2, 3×3) for 3×3 stride-1 undilated convolutions in f32:
//! each 2×2 block of outputs is `Aᵀ [(G g Gᵀ) ⊙ (Bᵀ d B)] A` of its 4×4
//! input tile, so the channel sums become 16 products (one per element of
//! the transformed tile) of 4 multiply-adds per output instead of 9: 2.25×
//! fewer. The products run on the position-lane register tiles
//! ([`super::tiles`], those of [`super::direct`]) with tiles of outputs along the lanes; the input gradient is the forward
//! of the flipped geometry, and the weight gradient is
//! `Gᵀ [Σ_tiles (A dY Aᵀ) ⊙ (Bᵀ d B)] G`.
//!
//! The transforms add and subtract neighbours, which turns an infinite
//! value into NaN where the direct sum gives ±∞: a non-finite weight, input
//! or output gradient makes the call report it, and the caller computes
//! that convolution directly instead (rare, and exact).

use super::band::fill_band;
use super::geom::Geom;
use super::tiles::{channel_shape, forward_block, forward_vectors, Kernels};
use super::{TapWeights, Workspace};
use crate::host_nn::work::{for_each_unit, zeroed, SharedMut};
use crate::host_nn::{NnError, NnFloat, NnResult};
use std::sync::atomic::{AtomicBool, Ordering};

/// Elements of transformed inputs and outputs a unit of work aims for.
const BUDGET: usize = 1 << 20;

/// Whether a geometry takes Winograd: 3×3, stride 1, no dilation, enough
/// channels for the transforms to pay, outputs of at least 4×4.
pub(crate) fn applies(g: &Geom) -> bool {
    g.kh == 3 && g.kw == 3 && g.sh == 1 && g.sw == 1 && g.dh == 1 && g.dw == 1 && g.icg >= 16 && g.ocg >= 16 && g.oh >= 4 && g.ow >= 4
}

/// `G g Gᵀ` of a 3×3 kernel (row-major), in f64.
fn transform_weight(g: [f64; 9]) -> [f64; 16] {
    // G = [[1, 0, 0], [½, ½, ½], [½, −½, ½], [0, 0, 1]]
    let rows = |v: [f64; 3]| [v[0], 0.5 * (v[0] + v[1] + v[2]), 0.5 * (v[0] - v[1] + v[2]), v[2]];
    let cols: [[f64; 4]; 3] = std::array::from_fn(|c| rows([g[c], g[3 + c], g[6 + c]]));
    let mut u = [0f64; 16];
    for a in 0..4 {
        let t = rows([cols[0][a], cols[1][a], cols[2][a]]);
        u[4 * a..4 * a + 4].copy_from_slice(&t);
    }
    u
}

/// `Gᵀ w G` of a transformed 4×4 gradient: the 3×3 kernel's gradient.
fn untransform_gradient(w: [f64; 16]) -> [f64; 9] {
    // Gᵀ = [[1, ½, ½, 0], [0, ½, −½, 0], [0, ½, ½, 1]]
    let back = |v: [f64; 4]| [v[0] + 0.5 * (v[1] + v[2]), 0.5 * (v[1] - v[2]), 0.5 * (v[1] + v[2]) + v[3]];
    let rows: [[f64; 3]; 4] = std::array::from_fn(|a| back([w[4 * a], w[4 * a + 1], w[4 * a + 2], w[4 * a + 3]]));
    let mut out = [0f64; 9];
    for kx in 0..3 {
        let col = back([rows[0][kx], rows[1][kx], rows[2][kx], rows[3][kx]]);
        for ky in 0..3 {
            out[3 * ky + kx] = col[ky];
        }
    }
    out
}

/// How the tiles of a geometry are cut into units of work: images per unit
/// and tile rows per unit (one of them 1 unless all of an image is one).
fn split(g: &Geom, channels: usize, (n_count, threads): (usize, usize)) -> (usize, usize) {
    let (th, tw) = (g.oh.div_ceil(2), g.ow.div_ceil(2));
    let target = (BUDGET / (16 * channels.max(1))).clamp(32, 1024);
    let (mut images, mut rows) =
        if th * tw >= target { (1, (target / tw).clamp(1, th)) } else { ((target / (th * tw)).clamp(1, n_count.max(1)), th) };
    // Units enough for every thread.
    while n_count.div_ceil(images) * th.div_ceil(rows) < threads && (images > 1 || rows > 1) {
        if images > 1 {
            images = images.div_ceil(2);
        } else {
            rows = rows.div_ceil(2);
        }
    }
    (images, rows)
}

/// `out = conv(input, weights) + bias` by F(2×2, 3×3), or Ok(false) when a
/// non-finite input turned up (the output is then incomplete: compute it
/// another way).
pub(crate) fn forward<I: Kernels, T: NnFloat>(
    g: &Geom,
    input: &[f32],
    tw_weights: TapWeights<'_, T>,
    bias: Option<&[T]>,
    out: &mut [f32],
    threads: usize,
) -> NnResult<bool> {
    const OP: &str = "conv2d";
    let lanes = I::LANES;
    let (ip, op) = (g.in_plane(), g.out_plane());
    let (th, tw) = (g.oh.div_ceil(2), g.ow.div_ceil(2));
    let ob = forward_block(g.ocg);
    let blocks = g.ocg.div_ceil(ob);
    let o_pad = blocks * ob;
    // Transformed weights, per group and element: [block][input channel][ob].
    let per_xi = o_pad * g.icg;
    let mut packed = zeroed::<f32>(OP, g.groups * 16 * per_xi)?;
    for grp in 0..g.groups {
        for o in 0..g.ocg {
            for c in 0..g.icg {
                let k: [f64; 9] = std::array::from_fn(|t| {
                    let m = tw_weights.matrix(grp, t);
                    m.data[o * m.rs + c * m.cs].to_f64()
                });
                if k.iter().any(|v| !v.is_finite()) {
                    return Ok(false);
                }
                for (xi, u) in transform_weight(k).iter().enumerate() {
                    packed[(grp * 16 + xi) * per_xi + ((o / ob) * g.icg + c) * ob + o % ob] = *u as f32;
                }
            }
        }
    }
    let (images, rows) = split(g, g.icg + o_pad, (g.n, threads.div_ceil(g.groups)));
    let (image_units, row_units) = (g.n.div_ceil(images), th.div_ceil(rows));
    let units = g.groups * image_units * row_units;
    // Band rows: tile j reads columns 2j .. 2j + 4; a vector of tiles up to
    // 2·LANES + 2 past its first.
    let wb = 2 * tw + 2 * lanes + 2;
    let finite = AtomicBool::new(true);
    let dst = SharedMut::new(out);
    for_each_unit(
        threads,
        units,
        || Ok(Workspace::<f32>::new()),
        |ws, u| {
            if !finite.load(Ordering::Relaxed) {
                return Ok(());
            }
            let grp = u / (image_units * row_units);
            let (n0, i0) = ((u / row_units) % image_units * images, u % row_units * rows);
            let (m_count, r) = (images.min(g.n - n0), rows.min(th - i0));
            let rr = 2 * r + 2;
            let per_image = r * tw;
            let vecs = (m_count * per_image + lanes - 1).div_ceil(lanes);
            let nv = forward_vectors::<I>(ob, vecs * lanes);
            let tpad = vecs.div_ceil(nv) * nv * lanes;
            let band_image = g.icg * rr * wb;
            let ((band, vm), addr) = ws.two_and_offsets(m_count * band_image, 16 * (g.icg + o_pad) * tpad, g.icg)?;
            let (v, m) = vm.split_at_mut(16 * g.icg * tpad);
            for k in 0..m_count {
                let img = &input[((n0 + k) * g.c_in() + grp * g.icg) * ip..];
                if !fill_band(g, img, g.icg, 2 * i0, rr, wb, rr * wb, &mut band[k * band_image..(k + 1) * band_image], true) {
                    finite.store(false, Ordering::Relaxed);
                    return Ok(());
                }
            }
            // Bᵀ d B of every tile, into v[ξ][c][t] (past the tiles, stale finite
            // values: only products nobody reads come of them).
            for k in 0..m_count {
                for c in 0..g.icg {
                    for i in 0..r {
                        let base = (k * g.icg + c) * rr * wb + 2 * i * wb;
                        let rows_p: [*const f32; 4] = std::array::from_fn(|q| band[base + q * wb..].as_ptr());
                        // SAFETY: the CPU has I (the caller checked); each band row
                        // holds wb = 2·tw + 2·LANES + 2 values; v has tpad ≥
                        // m_count·r·tw + LANES − 1 tiles per (ξ, c).
                        unsafe { I::wino_input_row(rows_p, tw, v.as_mut_ptr().add(c * tpad + k * per_image + i * tw), g.icg * tpad) };
                    }
                }
            }
            for (k, a) in addr.iter_mut().enumerate() {
                *a = k * tpad;
            }
            // The 16 products: m[ξ][o][t] = Σ_c u[ξ][o][c] v[ξ][c][t].
            let span = nv * lanes;
            for xi in 0..16 {
                let w = &packed[(grp * 16 + xi) * per_xi..];
                for blk in 0..blocks {
                    for tile in 0..tpad / span {
                        // SAFETY: the CPU has I; v[ξ] rows read addr[c] + tile·span
                        // + span ≤ icg·tpad; the block's weights hold icg·ob
                        // values; m rows are tpad long, ob rows per block.
                        unsafe {
                            I::forward_tile(
                                ob,
                                nv,
                                g.icg,
                                addr.as_ptr(),
                                v.as_ptr().add(xi * g.icg * tpad + tile * span),
                                w.as_ptr().add(blk * g.icg * ob),
                                m.as_mut_ptr().add((xi * o_pad + blk * ob) * tpad + tile * span),
                                tpad,
                            );
                        }
                    }
                }
            }
            // Aᵀ m A + bias into the output rows 2·i0 ..
            for o in 0..g.ocg {
                let b = bias.map_or(0.0, |b| b[grp * g.ocg + o].to_f64() as f32);
                for k in 0..m_count {
                    let y0 = 2 * i0;
                    let y1 = (2 * (i0 + r)).min(g.oh);
                    // SAFETY: unit u alone writes rows y0..y1 of its group's
                    // channels of images n0..n0 + m_count.
                    let plane = unsafe { dst.slice(((n0 + k) * g.c_out() + grp * g.ocg + o) * op + y0 * g.ow, (y1 - y0) * g.ow) };
                    for i in 0..r {
                        let lines = if 2 * (i0 + i) + 1 < g.oh { 2 } else { 1 };
                        let out_rows: [*mut f32; 2] =
                            [plane[2 * i * g.ow..].as_mut_ptr(), plane[(2 * i + lines - 1) * g.ow..].as_mut_ptr()];
                        // SAFETY: the CPU has I; m[·][o] holds the tiles rounded
                        // up to whole vectors; the rows lie inside `plane`.
                        unsafe {
                            I::wino_output_row(
                                m.as_ptr().add(o * tpad + k * per_image + i * tw),
                                o_pad * tpad,
                                tw,
                                b,
                                out_rows,
                                lines,
                                g.ow,
                            )
                        };
                    }
                }
            }
            Ok(())
        },
    )?;
    Ok(finite.into_inner())
}

/// Adds to `acc` (`[ocg, (c1 − c0)·9]`) the weight gradient of group `grp`'s
/// input channels `c0..c1` over images `n0..n1` by F(2×2, 3×3), or returns
/// Ok(false), `acc` untouched, when a non-finite value turned up.
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate_weight<I: Kernels, T: NnFloat>(
    g: &Geom,
    input: &[f32],
    dout: &[f32],
    (n0, n1): (usize, usize),
    grp: usize,
    (c0, c1): (usize, usize),
    acc: &mut [f32],
    ws: &mut Workspace<T>,
) -> NnResult<bool> {
    const OP: &str = "conv2d";
    let lanes = I::LANES;
    let (ip, op) = (g.in_plane(), g.out_plane());
    let (th, tw) = (g.oh.div_ceil(2), g.ow.div_ceil(2));
    let cb = c1 - c0;
    if cb == 0 || n1 <= n0 {
        return Ok(true);
    }
    // The 16 products sum over tiles, in either of two ways. Long sums: tiles
    // along the lanes, 4×4 (AVX2 2×4) tiles of (output, input) channels
    // summed across lanes once per unit. Short ones (small images): input
    // channels along the lanes (the transformed input transposed,
    // [ξ][channel block][tile][channel]) and output channels broadcast, so no
    // sum across lanes at all.
    let (vb, pb) = channel_shape::<I>(cb);
    let width = vb * lanes;
    let cblocks = cb.div_ceil(width);
    let (wb_o, wb_k) = I::WEIGHT_TILE;
    let (o_rows, k_blocks) = (g.ocg.div_ceil(wb_o) * wb_o, cb.div_ceil(wb_k));
    let c_pad = (cblocks * width).max(k_blocks * wb_k);
    let (images, rows) = split(g, cb + o_rows + cblocks * width, (n1 - n0, 1));
    let first_tiles = images.min(n1 - n0) * rows.min(th) * tw;
    let by_tiles = first_tiles.div_ceil(lanes) >= 12;
    // Band rows as in the forward; gradient rows: tile j reads columns 2j, 2j + 1.
    let (wb, wg) = (2 * tw + 2 * lanes + 2, 2 * tw + 2 * lanes);
    // Σ over tiles of (A dY Aᵀ) ⊙ (Bᵀ d B): [ξ][o][c].
    let mut sums = zeroed::<f32>(OP, 16 * g.ocg * c_pad)?;
    let mut tile = [0f32; 24 * 16];
    let mut n = n0;
    while n < n1 {
        let m_count = images.min(n1 - n);
        let mut i0 = 0;
        while i0 < th {
            let r = rows.min(th - i0);
            let rr = 2 * r + 2;
            let per_image = r * tw;
            let used = m_count * per_image;
            let tpad = (used + lanes - 1).div_ceil(lanes) * lanes;
            let (band_image, grad_image) = (cb * rr * wb, g.ocg * 2 * r * wg);
            let vt_len = if by_tiles { 0 } else { 16 * cblocks * width * tpad };
            let ((band_t, vz_t), addr) =
                ws.two_and_offsets(m_count * (band_image + grad_image), 16 * (cb + o_rows) * tpad + vt_len, tpad.max(k_blocks * wb_k))?;
            let (Some(band), Some(vz)) = (T::as_f32_mut(band_t), T::as_f32_mut(vz_t)) else {
                return Err(NnError::invalid(OP, "internal: f32 kernels on another type"));
            };
            let (v, zt) = vz.split_at_mut(16 * cb * tpad);
            let (z, vt) = zt.split_at_mut(16 * o_rows * tpad);
            let (bands, grads) = band.split_at_mut(m_count * band_image);
            grads.fill(0.0);
            for k in 0..m_count {
                let img = &input[((n + k) * g.c_in() + grp * g.icg + c0) * ip..];
                if !fill_band(g, img, cb, 2 * i0, rr, wb, rr * wb, &mut bands[k * band_image..(k + 1) * band_image], true) {
                    return Ok(false);
                }
                // The gradient rows 2·i0 .., zero past the output.
                for o in 0..g.ocg {
                    for y in 0..(2 * r).min(g.oh - 2 * i0) {
                        let src = &dout[((n + k) * g.c_out() + grp * g.ocg + o) * op + (2 * i0 + y) * g.ow..][..g.ow];
                        if !src.iter().fold(true, |ok, d| ok & d.is_finite()) {
                            return Ok(false);
                        }
                        grads[k * grad_image + (o * 2 * r + y) * wg..][..g.ow].copy_from_slice(src);
                    }
                }
            }
            for k in 0..m_count {
                for i in 0..r {
                    let t0 = k * per_image + i * tw;
                    for c in 0..cb {
                        let base = (k * cb + c) * rr * wb + 2 * i * wb;
                        let rows_p: [*const f32; 4] = std::array::from_fn(|q| bands[base + q * wb..].as_ptr());
                        // SAFETY: as in the forward.
                        unsafe { I::wino_input_row(rows_p, tw, v.as_mut_ptr().add(c * tpad + t0), cb * tpad) };
                    }
                    for o in 0..g.ocg {
                        let base = k * grad_image + (o * 2 * r + 2 * i) * wg;
                        let rows_p: [*const f32; 2] = [grads[base..].as_ptr(), grads[base + wg..].as_ptr()];
                        // SAFETY: the CPU has I; gradient rows hold wg = 2·tw +
                        // 2·LANES values; z has tpad tiles per (ξ, o).
                        unsafe { I::wino_gradient_row(rows_p, tw, z.as_mut_ptr().add(o * tpad + t0), o_rows * tpad) };
                    }
                }
            }
            if by_tiles {
                // Tiles past the last and channels past ocg must not count.
                for (row, zr) in z.chunks_mut(tpad).enumerate() {
                    if row % o_rows >= g.ocg {
                        zr.fill(0.0);
                    } else {
                        zr[used..].fill(0.0);
                    }
                }
                for (j, a) in addr[..k_blocks * wb_k].iter_mut().enumerate() {
                    *a = j.min(cb - 1) * tpad;
                }
                for xi in 0..16 {
                    for ob in 0..o_rows / wb_o {
                        for kb in 0..k_blocks {
                            let mut part = [0f32; 16];
                            // SAFETY: the CPU has I; z[ξ] rows ob·wb_o.. and
                            // v[ξ] rows addr[j] hold tpad values; part holds
                            // wb_o·wb_k ≤ 16.
                            unsafe {
                                I::weight_tile(
                                    1,
                                    tpad / lanes,
                                    z.as_ptr().add((xi * o_rows + ob * wb_o) * tpad),
                                    (tpad, 0),
                                    v.as_ptr().add(xi * cb * tpad),
                                    0,
                                    &addr[kb * wb_k..(kb + 1) * wb_k],
                                    part.as_mut_ptr(),
                                );
                            }
                            for a in 0..wb_o {
                                let o = ob * wb_o + a;
                                if o >= g.ocg {
                                    break;
                                }
                                for b in 0..wb_k {
                                    sums[(xi * g.ocg + o) * c_pad + kb * wb_k + b] += part[a * wb_k + b];
                                }
                            }
                        }
                    }
                }
                i0 += r;
                continue;
            }
            // The transformed input, transposed: vt[ξ][block][t][width] over
            // the tiles in use (channels past cb zero).
            for xi in 0..16 {
                for blk in 0..cblocks {
                    let dst = &mut vt[(xi * cblocks + blk) * tpad * width..][..tpad * width];
                    for j in 0..width {
                        let c = blk * width + j;
                        if c >= cb {
                            for t in 0..used {
                                dst[t * width + j] = 0.0;
                            }
                            continue;
                        }
                        let src = &v[(xi * cb + c) * tpad..][..used];
                        for (t, &x) in src.iter().enumerate() {
                            dst[t * width + j] = x;
                        }
                    }
                }
            }
            for (t, a) in addr[..tpad].iter_mut().enumerate() {
                *a = t;
            }
            let mut base = [0usize; 24];
            for xi in 0..16 {
                for blk in 0..cblocks {
                    let mut o0 = 0;
                    while o0 < g.ocg {
                        let count = pb.min(g.ocg - o0);
                        for (p, b) in base[..pb].iter_mut().enumerate() {
                            *b = (xi * o_rows + o0 + p.min(count - 1)) * tpad;
                        }
                        // SAFETY: the CPU has I; z rows hold tpad values
                        // (read at addr[t] + base[p] < 16·o_rows·tpad), the
                        // block of vt holds tpad·width, tile pb·width ≤ 384.
                        unsafe {
                            I::channel_tile(
                                vb,
                                used,
                                addr.as_ptr(),
                                z.as_ptr(),
                                &base[..pb],
                                vt.as_ptr().add((xi * cblocks + blk) * tpad * width),
                                tile.as_mut_ptr(),
                            );
                        }
                        for p in 0..count {
                            let row = &mut sums[(xi * g.ocg + o0 + p) * c_pad + blk * width..][..width];
                            for (d, &x) in row.iter_mut().zip(&tile[p * width..(p + 1) * width]) {
                                *d += x;
                            }
                        }
                        o0 += count;
                    }
                }
            }
            i0 += r;
        }
        n += m_count;
    }
    for o in 0..g.ocg {
        for c in 0..cb {
            let w: [f64; 16] = std::array::from_fn(|xi| sums[(xi * g.ocg + o) * c_pad + c] as f64);
            for (t, d) in untransform_gradient(w).iter().enumerate() {
                acc[o * cb * 9 + c * 9 + t] += *d as f32;
            }
        }
    }
    Ok(true)
}
