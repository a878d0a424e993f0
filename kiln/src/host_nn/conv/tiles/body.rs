//! The generic kernel bodies, compiled inside each instruction set's
//! `#[target_feature]` entry points ([`super::Kernels`]).

use crate::host_nn::vector::Isa;

/// Position-lane tile: `out[o·stride + L·v + i] = Σ_k w[k·OB + o] ·
/// band[addr[k] + L·v + i]` for o < OB, v < NV, i < L (L lanes).
///
/// # Safety
/// The CPU has `I`; `band + addr[k] + L·NV` is readable for every
/// k < k_len, `w` holds `k_len·OB` values, and `out + o·stride + L·NV`
/// is writable for o < OB.
#[inline(always)]
pub unsafe fn forward_tile<I: Isa, const OB: usize, const NV: usize>(
    k_len: usize,
    addr: *const usize,
    band: *const f32,
    w: *const f32,
    out: *mut f32,
    stride: usize,
) {
    unsafe {
        let mut acc = [[I::zero(); NV]; OB];
        for k in 0..k_len {
            let src = band.add(*addr.add(k));
            let x: [I::V; NV] = std::array::from_fn(|v| I::load(src.add(I::LANES * v)));
            let wk = w.add(k * OB);
            for (o, row) in acc.iter_mut().enumerate() {
                let b = I::splat(*wk.add(o));
                for (a, &xv) in row.iter_mut().zip(&x) {
                    *a = I::fmadd(b, xv, *a);
                }
            }
        }
        for (o, row) in acc.iter().enumerate() {
            for (v, &a) in row.iter().enumerate() {
                I::store(out.add(o * stride + I::LANES * v), a);
            }
        }
    }
}

/// Channel-lane tile: `out[p·L·VB + L·v + i] = Σ_k band[addr[k] +
/// base[p]] · w[k·L·VB + L·v + i]` for p < PB, v < VB, i < L: output
/// channels along the lanes, `PB` output positions anywhere in the band.
///
/// # Safety
/// The CPU has `I`; `band + addr[k] + base[p]` is readable, `w` holds
/// `k_len·L·VB` values and `out` `PB·L·VB`.
#[inline(always)]
pub unsafe fn channel_tile<I: Isa, const PB: usize, const VB: usize>(
    k_len: usize,
    addr: *const usize,
    band: *const f32,
    base: &[usize; PB],
    w: *const f32,
    out: *mut f32,
) {
    unsafe {
        let src: [*const f32; PB] = std::array::from_fn(|p| band.add(base[p]));
        let mut acc = [[I::zero(); VB]; PB];
        for k in 0..k_len {
            let a = *addr.add(k);
            let wk = w.add(k * I::LANES * VB);
            let wv: [I::V; VB] = std::array::from_fn(|v| I::load(wk.add(I::LANES * v)));
            for (row, s) in acc.iter_mut().zip(&src) {
                let b = I::splat(*s.add(a));
                for (x, &wvv) in row.iter_mut().zip(&wv) {
                    *x = I::fmadd(b, wvv, *x);
                }
            }
        }
        for (p, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                I::store(out.add(p * I::LANES * VB + I::LANES * v), x);
            }
        }
    }
}

/// Position-lane weight-gradient tile: `out[WK·o + j] += Σ_m Σ_v Σ_i
/// d_m[o·dstride + L·v + i] · band_m[addr[j] + L·v + i]` for o < WO,
/// j < WK, over `vectors` vectors of each of `images` images (image m's
/// output gradient rows at `d + m·d_image`, its band at
/// `band + m·band_image`).
///
/// # Safety
/// The CPU has `I`; every row and shifted band read, `L·vectors` long,
/// lies inside its buffer; `out` holds `WO·WK` values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn weight_tile<I: Isa, const WO: usize, const WK: usize>(
    images: usize,
    vectors: usize,
    d: *const f32,
    (dstride, d_image): (usize, usize),
    band: *const f32,
    band_image: usize,
    addr: &[usize; WK],
    out: *mut f32,
) {
    unsafe {
        let mut acc = [[I::zero(); WK]; WO];
        for m in 0..images {
            let dm = d.add(m * d_image);
            let src: [*const f32; WK] = std::array::from_fn(|j| band.add(m * band_image + addr[j]));
            for v in 0..vectors {
                let dv: [I::V; WO] = std::array::from_fn(|o| I::load(dm.add(o * dstride + I::LANES * v)));
                for (j, s) in src.iter().enumerate() {
                    let b = I::load(s.add(I::LANES * v));
                    for (row, &dvo) in acc.iter_mut().zip(&dv) {
                        row[j] = I::fmadd(dvo, b, row[j]);
                    }
                }
            }
        }
        I::add_sums(acc.as_flattened(), out);
    }
}

/// Channel-lane weight-gradient tile: `out[j·out_stride + L·v + i] +=
/// Σ_m Σ_p band_m[addr[j] + base[p]] · dt_m[p·dt_stride + L·v + i]` for
/// j < KB, v < VB: output channels along the lanes, summed over
/// `positions` output positions of each of `images` images (image m's
/// transposed output gradient at `dt + m·dt_image`, its band at
/// `band + m·band_image`).
///
/// # Safety
/// The CPU has `I`; every read lies inside its buffer, and `out` rows
/// `out_stride` apart hold `L·VB` values each.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn weight_channel_tile<I: Isa, const KB: usize, const VB: usize>(
    images: usize,
    positions: usize,
    dt: *const f32,
    (dt_stride, dt_image): (usize, usize),
    band: *const f32,
    band_image: usize,
    addr: &[usize; KB],
    base: *const usize,
    out: *mut f32,
    out_stride: usize,
) {
    unsafe {
        let mut acc = [[I::zero(); VB]; KB];
        for m in 0..images {
            let dm = dt.add(m * dt_image);
            let src: [*const f32; KB] = std::array::from_fn(|j| band.add(m * band_image + addr[j]));
            for p in 0..positions {
                let bp = *base.add(p);
                let w: [I::V; VB] = std::array::from_fn(|v| I::load(dm.add(p * dt_stride + I::LANES * v)));
                for (row, s) in acc.iter_mut().zip(&src) {
                    let b = I::splat(*s.add(bp));
                    for (x, &wv) in row.iter_mut().zip(&w) {
                        *x = I::fmadd(b, wv, *x);
                    }
                }
            }
        }
        for (j, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                let o = out.add(j * out_stride + I::LANES * v);
                I::store(o, I::add(I::load(o), x));
            }
        }
    }
}
