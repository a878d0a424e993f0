//! Stride-1 convolutions in f32 on CPUs with AVX-512, as register-tiled
//! kernels over the padded band of [`super::shifted`] (the same layout:
//! rows `wp = ow + (kw − 1)·dw` wide, tap (ky, kx) at offset
//! `ky·dh·wp + kx·dw`), with no unfolding and no general-purpose product:
//!
//! - forward (and the input gradient, which is the forward of the flipped
//!   geometry): a tile of `OB` output channels × `NV` vectors of 16 output
//!   positions accumulates in registers over every (input channel, tap);
//!   each step loads `NV` input vectors and broadcasts `OB` weights;
//! - weight gradient: a tile of `OB` output channels × `KB` (input channel,
//!   tap) pairs accumulates, in vectors along the output positions, the
//!   products of the output gradient with the shifted input.
//!
//! Everything else (other strides, f64, CPUs without AVX-512) takes the
//! portable paths.

use super::geom::Geom;
use super::{TapWeights, Workspace};
use crate::host_nn::work::{for_each_unit, SharedMut};
use crate::host_nn::{NnFloat, NnResult};

/// Output positions per vector.
const LANES: usize = 16;

/// Whether this CPU runs the kernels here (std caches the answer).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Output channels per forward tile for `ocg` channels: blocks of at most
/// 8, as even as possible.
fn forward_block(ocg: usize) -> usize {
    ocg.div_ceil(ocg.div_ceil(8)).max(1)
}

/// Vectors of positions per forward tile for `ob` channels over `ncols`
/// positions: 24 accumulators at most (of 32 registers) and at most 4, the
/// count that computes the fewest vectors past `ncols` (the widest of
/// those).
fn forward_vectors(ob: usize, ncols: usize) -> usize {
    let most = (24 / ob).clamp(1, 4);
    let vectors = ncols.div_ceil(LANES);
    (1..=most).rev().min_by_key(|&nv| vectors.div_ceil(nv) * nv).unwrap_or(1)
}

/// The weights of group `grp` packed for the forward tiles: per block of
/// `ob` output channels, per (input channel, tap), the `ob` weights (zero
/// for the channels past `ocg`).
fn pack_forward<T: NnFloat>(g: &Geom, tw: &TapWeights<'_, T>, grp: usize, ob: usize, out: &mut [f32]) {
    let (taps, k_len) = (g.taps(), g.k_len());
    let blocks = g.ocg.div_ceil(ob);
    for b in 0..blocks {
        for c in 0..g.icg {
            for t in 0..taps {
                let k = c * taps + t;
                let m = tw.matrix(grp, t);
                for j in 0..ob {
                    let o = b * ob + j;
                    out[(b * k_len + k) * ob + j] = if o < g.ocg { m.data[o * m.rs + c * m.cs].to_f64() as f32 } else { 0.0 };
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The 16 sums of 16 vectors' lanes, as one vector: lane i holds the
    /// sum of `v[i]` (a transposing tree of 45 instructions instead of 16
    /// separate reductions of 8).
    #[inline(always)]
    unsafe fn sum16(v: [__m512; 16]) -> __m512 {
        unsafe {
            // Pairs: per 128-bit quarter, [a0+a2, b0+b2, a1+a3, b1+b3].
            let p: [__m512; 8] = std::array::from_fn(|j| {
                let (a, b) = (v[2 * j], v[2 * j + 1]);
                _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
            });
            // Quads: per quarter, the quarter's sum of a, b, c, d.
            let q: [__m512; 4] = std::array::from_fn(|j| {
                let (a, b) = (_mm512_castps_pd(p[2 * j]), _mm512_castps_pd(p[2 * j + 1]));
                _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)))
            });
            // q[j] quarter t holds vectors 4j..4j+4 over quarter t; add quarters.
            let h0 = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(q[0], q[1]), _mm512_shuffle_f32x4::<0b11_01_11_01>(q[0], q[1]));
            let h1 = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(q[2], q[3]), _mm512_shuffle_f32x4::<0b11_01_11_01>(q[2], q[3]));
            // Quarters: the totals of vectors 0-3, 4-7, 8-11, 12-15.
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(h0, h1), _mm512_shuffle_f32x4::<0b11_01_11_01>(h0, h1))
        }
    }

    /// `out[4·o + j] += Σ d[o][p] · band[addr[j] + p]` over `vectors`
    /// vectors of 16 positions of each of `images` images, for o < 4 and
    /// j < 4: image m's output gradient rows start at `d + m·d_image`
    /// (`dstride` apart), its band at `band + m·band_image`.
    ///
    /// # Safety
    /// AVX-512F is available; every row and shifted band read, 16·vectors
    /// long, lies inside its buffer; `out` holds 16 values.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn weight_tile(
        images: usize,
        vectors: usize,
        d: *const f32,
        (dstride, d_image): (usize, usize),
        band: *const f32,
        band_image: usize,
        addr: &[usize; 4],
        out: *mut f32,
    ) {
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 16];
            for m in 0..images {
                let dm = d.add(m * d_image);
                let src: [*const f32; 4] = std::array::from_fn(|j| band.add(m * band_image + addr[j]));
                for v in 0..vectors {
                    let dv: [__m512; 4] = std::array::from_fn(|o| _mm512_loadu_ps(dm.add(o * dstride + 16 * v)));
                    for (j, s) in src.iter().enumerate() {
                        let b = _mm512_loadu_ps(s.add(16 * v));
                        for (o, &dvo) in dv.iter().enumerate() {
                            acc[4 * o + j] = _mm512_fmadd_ps(dvo, b, acc[4 * o + j]);
                        }
                    }
                }
            }
            _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), sum16(acc)));
        }
    }

    /// Channel-lane weight-gradient tile: `out[j·out_stride + 16·v + i] +=
    /// Σ_m Σ_p band_m[addr[j] + base[p]] · dt_m[p·dt_stride + 16·v + i]` for
    /// j < KB, v < VB: output channels along the lanes, summed over
    /// `positions` output positions of each of `images` images (image m's
    /// transposed output gradient at `dt + m·dt_image`, its band at
    /// `band + m·band_image`).
    ///
    /// # Safety
    /// AVX-512F is available; every read lies inside its buffer, and `out`
    /// rows `out_stride` apart hold 16·VB values each.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn weight_channel_tile<const KB: usize, const VB: usize>(
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
            let mut acc = [[_mm512_setzero_ps(); VB]; KB];
            for m in 0..images {
                let dm = dt.add(m * dt_image);
                let src: [*const f32; KB] = std::array::from_fn(|j| band.add(m * band_image + addr[j]));
                for p in 0..positions {
                    let bp = *base.add(p);
                    let w: [__m512; VB] = std::array::from_fn(|v| _mm512_loadu_ps(dm.add(p * dt_stride + 16 * v)));
                    for (row, s) in acc.iter_mut().zip(&src) {
                        let b = _mm512_set1_ps(*s.add(bp));
                        for (x, &wv) in row.iter_mut().zip(&w) {
                            *x = _mm512_fmadd_ps(b, wv, *x);
                        }
                    }
                }
            }
            for (j, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    let o = out.add(j * out_stride + 16 * v);
                    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), x));
                }
            }
        }
    }

    /// Channel-lane tile: `out[p·16·VB + 16·v + i] = Σ_k band[addr[k] +
    /// base[p]] · w[k·16·VB + 16·v + i]` for p < PB, v < VB, i < 16: output
    /// channels along the lanes, `PB` output positions anywhere in the band.
    ///
    /// # Safety
    /// AVX-512F is available; `band + addr[k] + base[p]` is readable, `w`
    /// holds `k_len·16·VB` values and `out` `PB·16·VB`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn channel_tile<const PB: usize, const VB: usize>(
        k_len: usize,
        addr: *const usize,
        band: *const f32,
        base: &[usize; PB],
        w: *const f32,
        out: *mut f32,
    ) {
        unsafe {
            let src: [*const f32; PB] = std::array::from_fn(|p| band.add(base[p]));
            let mut acc = [[_mm512_setzero_ps(); VB]; PB];
            for k in 0..k_len {
                let a = *addr.add(k);
                let wk = w.add(k * 16 * VB);
                let wv: [__m512; VB] = std::array::from_fn(|v| _mm512_loadu_ps(wk.add(16 * v)));
                for (row, s) in acc.iter_mut().zip(&src) {
                    let b = _mm512_set1_ps(*s.add(a));
                    for (x, &wvv) in row.iter_mut().zip(&wv) {
                        *x = _mm512_fmadd_ps(b, wvv, *x);
                    }
                }
            }
            for (p, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    _mm512_storeu_ps(out.add(p * 16 * VB + 16 * v), x);
                }
            }
        }
    }

    /// `out[o][16·v + i] = Σ_k w[k·OB + o] · band[addr[k] + 16·v + i]` for
    /// o < OB, v < NV, i < 16.
    ///
    /// # Safety
    /// AVX-512F is available; `band + addr[k] + 16·NV` is readable for every
    /// k < k_len, `w` holds `k_len·OB` values, and `out + o·stride + 16·NV`
    /// is writable for o < OB.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn forward_tile<const OB: usize, const NV: usize>(
        k_len: usize,
        addr: *const usize,
        band: *const f32,
        w: *const f32,
        out: *mut f32,
        stride: usize,
    ) {
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NV]; OB];
            for k in 0..k_len {
                let src = band.add(*addr.add(k));
                let mut x = [_mm512_setzero_ps(); NV];
                for (v, xv) in x.iter_mut().enumerate() {
                    *xv = _mm512_loadu_ps(src.add(16 * v));
                }
                let wk = w.add(k * OB);
                for (o, row) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*wk.add(o));
                    for (a, &xv) in row.iter_mut().zip(&x) {
                        *a = _mm512_fmadd_ps(b, xv, *a);
                    }
                }
            }
            for (o, row) in acc.iter().enumerate() {
                for (v, &a) in row.iter().enumerate() {
                    _mm512_storeu_ps(out.add(o * stride + 16 * v), a);
                }
            }
        }
    }
}

/// Runs the forward tile for a block of `ob` channels and `nv` vectors.
///
/// # Safety
/// As [`x86::forward_tile`], with OB = `ob` ≤ 8 and NV = `nv` ≤ 4.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn forward_tile(
    ob: usize,
    nv: usize,
    k_len: usize,
    addr: *const usize,
    band: *const f32,
    w: *const f32,
    out: *mut f32,
    stride: usize,
) {
    macro_rules! go {
        ($($ob:literal => $nv:literal),*) => {
            match (ob, nv) {
                $(($ob, $nv) => unsafe { x86::forward_tile::<$ob, $nv>(k_len, addr, band, w, out, stride) },)*
                _ => unreachable!("no forward tile of {ob} x {nv}"),
            }
        };
    }
    go!(
        1 => 1, 1 => 2, 1 => 3, 1 => 4, 2 => 1, 2 => 2, 2 => 3, 2 => 4, 3 => 1, 3 => 2, 3 => 3, 3 => 4, 4 => 1, 4 => 2, 4 => 3, 4 => 4,
        5 => 1, 5 => 2, 5 => 3, 5 => 4, 6 => 1, 6 => 2, 6 => 3, 6 => 4, 7 => 1, 7 => 2, 7 => 3, 8 => 1, 8 => 2, 8 => 3
    )
}

/// Vectors of output channels per channel-lane tile, and positions per
/// tile (24 accumulators).
fn channel_shape(ocg: usize) -> (usize, usize) {
    let vb = ocg.div_ceil(LANES).clamp(1, 4);
    (vb, 24 / vb)
}

/// Runs the channel-lane tile for `vb` vectors of channels.
///
/// # Safety
/// As [`x86::channel_tile`], with PB = 24 / `vb` positions in `base`.
#[cfg(target_arch = "x86_64")]
unsafe fn channel_tile(vb: usize, k_len: usize, addr: *const usize, band: *const f32, base: &[usize], w: *const f32, out: *mut f32) {
    macro_rules! go {
        ($($vb:literal => $pb:literal),*) => {
            match vb {
                $($vb => {
                    let base: &[usize; $pb] = base.try_into().unwrap_or(&[0; $pb]);
                    unsafe { x86::channel_tile::<$pb, $vb>(k_len, addr, band, base, w, out) }
                })*
                _ => unreachable!("no channel tile of {vb} vectors"),
            }
        };
    }
    go!(1 => 24, 2 => 12, 3 => 8, 4 => 6)
}

/// Runs the channel-lane weight tile for `vb` vectors of channels (and
/// 24 / `vb` (input channel, tap) pairs, the length of `addr`).
///
/// # Safety
/// As [`x86::weight_channel_tile`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn weight_channel_tile(
    vb: usize,
    images: usize,
    positions: usize,
    dt: *const f32,
    dt_layout: (usize, usize),
    band: *const f32,
    band_image: usize,
    addr: &[usize],
    base: *const usize,
    out: *mut f32,
    out_stride: usize,
) {
    macro_rules! go {
        ($($vb:literal => $kb:literal),*) => {
            match vb {
                $($vb => {
                    let addr: &[usize; $kb] = addr.try_into().unwrap_or(&[0; $kb]);
                    unsafe { x86::weight_channel_tile::<$kb, $vb>(images, positions, dt, dt_layout, band, band_image, addr, base, out, out_stride) }
                })*
                _ => unreachable!("no channel weight tile of {vb} vectors"),
            }
        };
    }
    go!(1 => 24, 2 => 12, 3 => 8, 4 => 6)
}

/// Positions computed per real output position by the position-lane tiles
/// (rows `wp` wide, tiles of whole vectors) and by the channel-lane tiles
/// (channels in whole vectors, positions in whole tiles), for a band of `r`
/// rows.
fn waste(g: &Geom, r: usize, wp: usize) -> (f64, f64) {
    let ncols = (r - 1) * wp + g.ow;
    let ob = forward_block(g.ocg);
    let nv = forward_vectors(ob, ncols);
    let lanes = (ncols.div_ceil(nv * LANES) * nv * LANES * g.ocg.div_ceil(ob) * ob) as f64 / (r * g.ow * g.ocg) as f64;
    let (vb, pb) = channel_shape(g.ocg);
    let channels = ((r * g.ow).div_ceil(pb) * pb * g.ocg.div_ceil(vb * LANES) * vb * LANES) as f64 / (r * g.ow * g.ocg) as f64;
    (lanes, channels)
}

/// The weights of group `grp` packed for the channel-lane tiles: per block
/// of `16·vb` output channels, per (input channel, tap), the channels' weights
/// (zero past `ocg`).
fn pack_channels<T: NnFloat>(g: &Geom, tw: &TapWeights<'_, T>, grp: usize, vb: usize, out: &mut [f32]) {
    let (taps, k_len, width) = (g.taps(), g.k_len(), vb * LANES);
    for b in 0..g.ocg.div_ceil(width) {
        for c in 0..g.icg {
            for t in 0..taps {
                let m = tw.matrix(grp, t);
                let row = &mut out[(b * k_len + c * taps + t) * width..][..width];
                for (j, v) in row.iter_mut().enumerate() {
                    let o = b * width + j;
                    *v = if o < g.ocg { m.data[o * m.rs + c * m.cs].to_f64() as f32 } else { 0.0 };
                }
            }
        }
    }
}

/// `out = conv(input, weights) + bias` for a stride-1 geometry in f32:
/// position-lane tiles, or channel-lane tiles where rows are narrow enough
/// that padding them to whole vectors would waste more.
pub(crate) fn forward<T: NnFloat>(
    g: &Geom,
    input: &[f32],
    tw: TapWeights<'_, T>,
    bias: Option<&[T]>,
    out: &mut [f32],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "conv2d";
    let (ip, op, k_len) = (g.in_plane(), g.out_plane(), g.k_len());
    let ob = forward_block(g.ocg);
    let blocks = g.ocg.div_ceil(ob);
    let wp = g.ow + (g.kw - 1) * g.dw;
    let rows = super::shifted::band_rows::<f32>(g, g.icg, blocks * ob, wp, g.n * g.groups, threads);
    let bands = g.oh.div_ceil(rows);
    let units = g.n * g.groups * bands;
    let (lane_waste, channel_waste) = waste(g, rows.min(g.oh), wp);
    let by_channel = g.ocg >= LANES && channel_waste * 1.05 < lane_waste;
    let (vb, pb) = channel_shape(g.ocg);
    // Packed weights of every group, made once.
    let group_len = if by_channel { g.ocg.div_ceil(vb * LANES) * vb * LANES * k_len } else { blocks * ob * k_len };
    let mut packed = crate::host_nn::work::zeroed::<f32>(OP, g.groups * group_len)?;
    for grp in 0..g.groups {
        let dst = &mut packed[grp * group_len..(grp + 1) * group_len];
        if by_channel {
            pack_channels(g, &tw, grp, vb, dst);
        } else {
            pack_forward(g, &tw, grp, ob, dst);
        }
    }
    let dst = SharedMut::new(out);
    for_each_unit(
        threads,
        units,
        || Ok(Workspace::<f32>::new()),
        |ws, u| {
            let (ng, b) = (u / bands, u % bands);
            let (n, grp) = (ng / g.groups, ng % g.groups);
            let y0 = b * rows;
            let r = rows.min(g.oh - y0);
            let rr = r + (g.kh - 1) * g.dh;
            let plane = rr * wp;
            let ncols = (r - 1) * wp + g.ow;
            let w = &packed[grp * group_len..(grp + 1) * group_len];
            let add = |o: usize| bias.map_or(0.0, |b| b[grp * g.ocg + o].to_f64() as f32);
            if by_channel {
                let width = vb * LANES;
                let positions = r * g.ow;
                let ((band, tile), table) = ws.two_and_offsets(g.icg * plane, pb * width, k_len + positions)?;
                let _ = super::shifted::fill_band(g, &input[(n * g.c_in() + grp * g.icg) * ip..], g.icg, y0, rr, wp, plane, band);
                let (addr, base) = table.split_at_mut(k_len);
                for (k, a) in addr.iter_mut().enumerate() {
                    let (c, t) = (k / g.taps(), k % g.taps());
                    *a = c * plane + (t / g.kw) * g.dh * wp + (t % g.kw) * g.dw;
                }
                for (j, v) in base.iter_mut().enumerate() {
                    *v = (j / g.ow) * wp + j % g.ow;
                }
                let mut tile_base = [0usize; 24];
                let tile_base = &mut tile_base[..pb];
                for blk in 0..g.ocg.div_ceil(width) {
                    let mut j0 = 0;
                    while j0 < positions {
                        let count = pb.min(positions - j0);
                        for (p, tb) in tile_base.iter_mut().enumerate() {
                            *tb = base[j0 + p.min(count - 1)];
                        }
                        // SAFETY: AVX-512F was detected; band reads addr[k] +
                        // base[j] < icg·plane; the block's packed weights hold
                        // k_len·width values; tile holds pb·width.
                        #[cfg(target_arch = "x86_64")]
                        unsafe {
                            channel_tile(
                                vb,
                                k_len,
                                addr.as_ptr(),
                                band.as_ptr(),
                                tile_base,
                                w.as_ptr().add(blk * k_len * width),
                                tile.as_mut_ptr(),
                            );
                        }
                        for o in blk * width..((blk + 1) * width).min(g.ocg) {
                            // SAFETY: unit (n, grp, b) alone writes rows y0..y0 + r
                            // of its group's output channels of image n.
                            let d = unsafe { dst.slice((n * g.c_out() + grp * g.ocg + o) * op + y0 * g.ow + j0, count) };
                            let (col, bo) = (o - blk * width, add(o));
                            for (p, v) in d.iter_mut().enumerate() {
                                *v = tile[p * width + col] + bo;
                            }
                        }
                        j0 += count;
                    }
                }
                return Ok(());
            }
            let nv = forward_vectors(ob, ncols);
            let span = nv * LANES;
            let tiles = ncols.div_ceil(span);
            let stride = tiles * span;
            // The last tile reads up to `span` past the last band row.
            let ((band, prod), addr) = ws.two_and_offsets(g.icg * plane + span, blocks * ob * stride, k_len)?;
            let _ = super::shifted::fill_band(g, &input[(n * g.c_in() + grp * g.icg) * ip..], g.icg, y0, rr, wp, plane, band);
            band[g.icg * plane..].fill(0.0);
            for (k, a) in addr.iter_mut().enumerate() {
                let (c, t) = (k / g.taps(), k % g.taps());
                *a = c * plane + (t / g.kw) * g.dh * wp + (t % g.kw) * g.dw;
            }
            for blk in 0..blocks {
                for tile in 0..tiles {
                    // SAFETY: AVX-512F was detected (the caller checks `available`);
                    // band offsets addr[k] + tile·span + span ≤ icg·plane + span
                    // (addr[k] + ncols ≤ icg·plane and tile·span < ncols); the
                    // packed block holds k_len·ob weights; prod rows are `stride`
                    // long, ob rows per block.
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        forward_tile(
                            ob,
                            nv,
                            k_len,
                            addr.as_ptr(),
                            band.as_ptr().add(tile * span),
                            w.as_ptr().add(blk * k_len * ob),
                            prod.as_mut_ptr().add(blk * ob * stride + tile * span),
                            stride,
                        );
                    }
                }
            }
            for o in 0..g.ocg {
                let bo = add(o);
                // SAFETY: unit (n, grp, b) alone writes rows y0..y0 + r of its
                // group's output channels of image n.
                let dst = unsafe { dst.slice((n * g.c_out() + grp * g.ocg + o) * op + y0 * g.ow, r * g.ow) };
                for (y, line) in dst.chunks_mut(g.ow).enumerate() {
                    let src = &prod[o * stride + y * wp..][..g.ow];
                    for (d, &s) in line.iter_mut().zip(src) {
                        *d = s + bo;
                    }
                }
            }
            Ok(())
        },
    )
}

/// Output channels and (input channel, tap) pairs per weight-gradient tile.
const WB_O: usize = 4;
const WB_K: usize = 4;

/// Workspace the weight gradient aims for: bands of several whole images
/// when they fit, so that each tile's lanes are summed once per group.
const WEIGHT_WORKSPACE: usize = 3 << 19;

/// Adds to `acc` (`[ocg, (c1 − c0)·taps]`) the weight gradient of group
/// `grp`'s input channels `c0..c1` over images `n0..n1`, in f32 tiles.
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate_weight<T: NnFloat>(
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
    if g.ocg >= LANES {
        let (lane_waste, channel_waste) = waste(g, g.oh, wp);
        if channel_waste * 1.05 < lane_waste {
            return accumulate_weight_channels(g, input, dout, (n0, n1), grp, (c0, c1), acc, ws);
        }
    }
    let o_rows = g.ocg.div_ceil(WB_O) * WB_O;
    let k_blocks = kb.div_ceil(WB_K);
    let rows = super::shifted::band_rows::<f32>(g, cb, o_rows, wp, usize::MAX, 1);
    // Whole images per band: group as many as the workspace holds.
    let per_image = |r: usize| {
        let plane = (r + (g.kh - 1) * g.dh) * wp;
        (cb * plane + LANES + o_rows * ((r - 1) * wp + g.ow).div_ceil(LANES) * LANES) * 4
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
            let dstride = ncols.div_ceil(LANES) * LANES;
            let (band_image, d_image) = (cb * plane + LANES, o_rows * dstride);
            let ((band_t, dbuf_t), addr) = ws.two_and_offsets(m_count * band_image, m_count * d_image, k_blocks * WB_K)?;
            let (Some(band), Some(dbuf)) = (T::as_f32_mut(band_t), T::as_f32_mut(dbuf_t)) else {
                return Err(crate::host_nn::NnError::invalid("conv2d", "internal: f32 kernels on another type"));
            };
            let mut finite = true;
            for m in 0..m_count {
                let img = n + m;
                let bm = &mut band[m * band_image..(m + 1) * band_image];
                finite &= super::shifted::fill_band(g, &input[(img * g.c_in() + grp * g.icg + c0) * ip..], cb, y0, rr, wp, plane, bm);
                bm[cb * plane..].fill(0.0);
                let dm = &mut dbuf[m * d_image..(m + 1) * d_image];
                for o in 0..o_rows {
                    let dst = &mut dm[o * dstride..(o + 1) * dstride];
                    if o >= g.ocg {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &dout[(img * g.c_out() + grp * g.ocg + o) * op + y0 * g.ow..][..r * g.ow];
                    for (y, s) in src.chunks(g.ow).enumerate() {
                        dst[y * wp..y * wp + g.ow].copy_from_slice(s);
                        let end = ((y + 1) * wp).min(dstride);
                        dst[y * wp + g.ow..end].fill(0.0);
                    }
                    dst[ncols..].fill(0.0);
                }
            }
            if !finite {
                // A non-finite input: sum over the real positions only, image by image.
                for m in 0..m_count {
                    super::shifted::accumulate_band_exact_strided(
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
            for ob in 0..o_rows / WB_O {
                for kbk in 0..k_blocks {
                    let tile_addr: &[usize; WB_K] = addr[kbk * WB_K..(kbk + 1) * WB_K]
                        .try_into()
                        .map_err(|_| crate::host_nn::NnError::invalid("conv2d", "internal: weight tile offsets"))?;
                    let mut sums = [0f32; WB_O * WB_K];
                    // SAFETY: AVX-512F was detected; image m's output
                    // gradient rows ob·4.. hold dstride values each, its band
                    // reads addr[j] + dstride ≤ cb·plane + 16 (addr[j] +
                    // ncols ≤ cb·plane, dstride − ncols < 16); sums holds 16.
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        x86::weight_tile(
                            m_count,
                            dstride / LANES,
                            dbuf.as_ptr().add(ob * WB_O * dstride),
                            (dstride, d_image),
                            band.as_ptr(),
                            band_image,
                            tile_addr,
                            sums.as_mut_ptr(),
                        );
                    }
                    for i in 0..WB_O {
                        let o = ob * WB_O + i;
                        if o >= g.ocg {
                            break;
                        }
                        for j in 0..WB_K {
                            let k = kbk * WB_K + j;
                            if k < kb {
                                acc[o * kb + k] += sums[i * WB_K + j];
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
fn accumulate_weight_channels<T: NnFloat>(
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
    let (vb, kbw) = channel_shape(g.ocg);
    let width = vb * LANES;
    let o_pad = g.ocg.div_ceil(width) * width;
    let k_blocks = kb.div_ceil(kbw);
    let rows = super::shifted::band_rows::<f32>(g, cb, o_pad, wp, usize::MAX, 1);
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
                return Err(crate::host_nn::NnError::invalid(OP, "internal: f32 kernels on another type"));
            };
            for m in 0..m_count {
                let img = n + m;
                let _ = super::shifted::fill_band(
                    g,
                    &input[(img * g.c_in() + grp * g.icg + c0) * ip..],
                    cb,
                    y0,
                    rr,
                    wp,
                    plane,
                    &mut band[m * band_image..],
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
                    // SAFETY: AVX-512F was detected; band reads addr[k] +
                    // base[p] < cb·plane per image, transposed gradient rows
                    // hold o_pad values; acc_t rows kbk·kbw.. hold o_pad.
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        weight_channel_tile(
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
