//! The zero-padded input band that every stride-1 convolution reads (laid
//! out `wp = ow + (kw − 1)·dw` wide, so that each kernel tap is a plain
//! strided matrix; see [`super::shifted`]), how many rows of it fit the
//! workspace, and the exact weight-gradient sum for a band that holds a
//! non-finite input.

use super::geom::Geom;
use super::WORKSPACE_BYTES;
use crate::host_nn::NnFloat;

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
