//! The weight gradient's drivers: tiles of output channels × (input
//! channel, tap) pairs, or channels along the lanes, accumulated over groups
//! of whole images.

use super::super::band::{accumulate_band_exact_strided, band_rows, fill_band};
use super::super::geom::Geom;
use super::super::tiles::{channel_shape, Kernels};
use super::super::Workspace;
use super::{by_channel, internal};
use crate::host_nn::{NnFloat, NnResult};

/// Workspace the weight gradient aims for: bands of several whole images
/// when they fit, so that each tile's lanes are summed once per group.
const WEIGHT_WORKSPACE: usize = 3 << 19;

/// Adds to `acc` (`[ocg, (c1 − c0)·taps]`) the weight gradient of group
/// `grp`'s input channels `c0..c1` over images `n0..n1`, in f32 tiles.
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
) -> NnResult<()> {
    let (ip, op, taps) = (g.in_plane(), g.out_plane(), g.taps());
    let cb = c1 - c0;
    let kb = cb * taps;
    if kb == 0 || n1 <= n0 {
        return Ok(());
    }
    let wp = g.ow + (g.kw - 1) * g.dw;
    if by_channel::<I>(g, g.oh, wp) {
        return accumulate_weight_channels::<I, T>(g, input, dout, (n0, n1), grp, (c0, c1), acc, ws);
    }
    let (wb_o, wb_k) = I::WEIGHT_TILE;
    let o_rows = g.ocg.div_ceil(wb_o) * wb_o;
    let k_blocks = kb.div_ceil(wb_k);
    let rows = band_rows::<f32>(g, cb, o_rows, wp, usize::MAX, 1);
    // Whole images per band: group as many as the workspace holds.
    let per_image = |r: usize| {
        let plane = (r + (g.kh - 1) * g.dh) * wp;
        (cb * plane + I::LANES + o_rows * ((r - 1) * wp + g.ow).div_ceil(I::LANES) * I::LANES) * 4
    };
    let images = if rows >= g.oh { (WEIGHT_WORKSPACE / per_image(g.oh)).clamp(1, n1 - n0) } else { 1 };
    let mut n = n0;
    while n < n1 {
        let m_count = images.min(n1 - n);
        let mut y0 = 0;
        while y0 < g.oh {
            let r = rows.min(g.oh - y0);
            let rr = r + (g.kh - 1) * g.dh;
            let plane = rr * wp;
            let ncols = (r - 1) * wp + g.ow;
            let dstride = ncols.div_ceil(I::LANES) * I::LANES;
            let (band_image, d_image) = (cb * plane + I::LANES, o_rows * dstride);
            let ((band_t, dbuf_t), addr) = ws.two_and_offsets(m_count * band_image, m_count * d_image, k_blocks * wb_k)?;
            let (Some(band), Some(dbuf)) = (T::as_f32_mut(band_t), T::as_f32_mut(dbuf_t)) else {
                return Err(internal("f32 kernels on another type"));
            };
            let mut finite = true;
            for m in 0..m_count {
                let img = n + m;
                let bm = &mut band[m * band_image..(m + 1) * band_image];
                finite &= fill_band(g, &input[(img * g.c_in() + grp * g.icg + c0) * ip..], cb, y0, rr, wp, plane, bm, true);
                bm[cb * plane..].fill(0.0);
                let dm = &mut dbuf[m * d_image..(m + 1) * d_image];
                for o in 0..o_rows {
                    let dst = &mut dm[o * dstride..(o + 1) * dstride];
                    if o >= g.ocg {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &dout[(img * g.c_out() + grp * g.ocg + o) * op + y0 * g.ow..][..r * g.ow];
                    if wp > g.ow {
                        // One fill, then the rows: short rows make per-row fills cost more than the data.
                        dst.fill(0.0);
                    } else {
                        dst[ncols..].fill(0.0);
                    }
                    for (y, s) in src.chunks(g.ow).enumerate() {
                        dst[y * wp..y * wp + g.ow].copy_from_slice(s);
                    }
                }
            }
            if !finite {
                // A non-finite input: sum over the real positions only, image by image.
                for m in 0..m_count {
                    accumulate_band_exact_strided(
                        g,
                        (r, wp, plane, dstride),
                        &dbuf[m * d_image..(m + 1) * d_image],
                        &band[m * band_image..(m + 1) * band_image],
                        cb,
                        acc,
                    );
                }
                y0 += r;
                continue;
            }
            for (k, a) in addr.iter_mut().enumerate() {
                let k = k.min(kb - 1);
                let (c, t) = (k / taps, k % taps);
                *a = c * plane + (t / g.kw) * g.dh * wp + (t % g.kw) * g.dw;
            }
            for ob in 0..o_rows / wb_o {
                for kbk in 0..k_blocks {
                    let tile_addr = &addr[kbk * wb_k..(kbk + 1) * wb_k];
                    let mut sums = [0f32; 16];
                    // SAFETY: the caller checked the CPU has I; image m's
                    // output gradient rows ob·wb_o.. hold dstride values
                    // each, its band reads addr[j] + dstride ≤ cb·plane + L
                    // (addr[j] + ncols ≤ cb·plane, dstride − ncols < L);
                    // sums holds wb_o·wb_k ≤ 16.
                    unsafe {
                        I::weight_tile(
                            m_count,
                            dstride / I::LANES,
                            dbuf.as_ptr().add(ob * wb_o * dstride),
                            (dstride, d_image),
                            band.as_ptr(),
                            band_image,
                            tile_addr,
                            sums.as_mut_ptr(),
                        );
                    }
                    for i in 0..wb_o {
                        let o = ob * wb_o + i;
                        if o >= g.ocg {
                            break;
                        }
                        for j in 0..wb_k {
                            let k = kbk * wb_k + j;
                            if k < kb {
                                acc[o * kb + k] += sums[i * wb_k + j];
                            }
                        }
                    }
                }
            }
            y0 += r;
        }
        n += m_count;
    }
    Ok(())
}

/// [`accumulate_weight`] with output channels along the lanes: each tile
/// sums, over the real output positions of a group of images (no padding
/// columns, so no 0 · ∞ either), the input at (input channel, tap) pairs
/// times the transposed output gradient; the sums gather in a transposed
/// copy of the gradient, added to `acc` at the end.
#[allow(clippy::too_many_arguments)]
fn accumulate_weight_channels<I: Kernels, T: NnFloat>(
    g: &Geom,
    input: &[f32],
    dout: &[f32],
    (n0, n1): (usize, usize),
    grp: usize,
    (c0, c1): (usize, usize),
    acc: &mut [f32],
    ws: &mut Workspace<T>,
) -> NnResult<()> {
    const OP: &str = "conv2d";
    let (ip, op, taps) = (g.in_plane(), g.out_plane(), g.taps());
    let (cb, kb) = (c1 - c0, (c1 - c0) * g.taps());
    let wp = g.ow + (g.kw - 1) * g.dw;
    let (vb, kbw) = channel_shape::<I>(g.ocg);
    let width = vb * I::LANES;
    let o_pad = g.ocg.div_ceil(width) * width;
    let k_blocks = kb.div_ceil(kbw);
    let rows = band_rows::<f32>(g, cb, o_pad, wp, usize::MAX, 1);
    let per_image = |r: usize| (cb * (r + (g.kh - 1) * g.dh) * wp + r * g.ow * o_pad) * 4;
    let images = if rows >= g.oh { (WEIGHT_WORKSPACE / per_image(g.oh)).clamp(1, n1 - n0) } else { 1 };
    // The gradient, transposed: [k][o_pad].
    let mut acc_t = crate::host_nn::work::zeroed::<f32>(OP, k_blocks * kbw * o_pad)?;
    let mut n = n0;
    while n < n1 {
        let m_count = images.min(n1 - n);
        let mut y0 = 0;
        while y0 < g.oh {
            let r = rows.min(g.oh - y0);
            let rr = r + (g.kh - 1) * g.dh;
            let plane = rr * wp;
            let positions = r * g.ow;
            let (band_image, dt_image) = (cb * plane, positions * o_pad);
            let ((band_t, dt_t), table) = ws.two_and_offsets(m_count * band_image, m_count * dt_image, k_blocks * kbw + positions)?;
            let (Some(band), Some(dt)) = (T::as_f32_mut(band_t), T::as_f32_mut(dt_t)) else {
                return Err(internal("f32 kernels on another type"));
            };
            for m in 0..m_count {
                let img = n + m;
                let _ = fill_band(
                    g,
                    &input[(img * g.c_in() + grp * g.icg + c0) * ip..],
                    cb,
                    y0,
                    rr,
                    wp,
                    plane,
                    &mut band[m * band_image..],
                    false,
                );
                let dm = &mut dt[m * dt_image..(m + 1) * dt_image];
                for o in 0..o_pad {
                    if o >= g.ocg {
                        for p in 0..positions {
                            dm[p * o_pad + o] = 0.0;
                        }
                        continue;
                    }
                    let src = &dout[(img * g.c_out() + grp * g.ocg + o) * op + y0 * g.ow..][..positions];
                    for (p, &v) in src.iter().enumerate() {
                        dm[p * o_pad + o] = v;
                    }
                }
            }
            let (addr, base) = table.split_at_mut(k_blocks * kbw);
            for (k, a) in addr.iter_mut().enumerate() {
                let k = k.min(kb - 1);
                let (c, t) = (k / taps, k % taps);
                *a = c * plane + (t / g.kw) * g.dh * wp + (t % g.kw) * g.dw;
            }
            for (j, v) in base.iter_mut().enumerate() {
                *v = (j / g.ow) * wp + j % g.ow;
            }
            for ob in 0..o_pad / width {
                for kbk in 0..k_blocks {
                    // SAFETY: the caller checked the CPU has I; band reads addr[k] +
                    // base[p] < cb·plane per image, transposed gradient rows
                    // hold o_pad values; acc_t rows kbk·kbw.. hold o_pad.
                    unsafe {
                        I::weight_channel_tile(
                            vb,
                            m_count,
                            positions,
                            dt.as_ptr().add(ob * width),
                            (o_pad, dt_image),
                            band.as_ptr(),
                            band_image,
                            &addr[kbk * kbw..(kbk + 1) * kbw],
                            base.as_ptr(),
                            acc_t.as_mut_ptr().add(kbk * kbw * o_pad + ob * width),
                            o_pad,
                        );
                    }
                }
            }
            y0 += r;
        }
        n += m_count;
    }
    for o in 0..g.ocg {
        for k in 0..kb {
            acc[o * kb + k] += acc_t[k * o_pad + o];
        }
    }
    Ok(())
}
