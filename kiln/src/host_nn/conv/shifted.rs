//! Stride-1 convolutions without unfolding. A band of output rows reads a
//! band of the zero-padded input; laid out `wp = ow + (kw − 1)·dw` wide,
//! the input seen by kernel tap (ky, kx) for output (oy, ox) sits at
//! `(oy + ky·dh)·wp + ox + kx·dw`, so for every tap the band is a plain
//! strided matrix (channels × output positions, shifted by the tap) and the
//! convolution is the sum over taps of one product each. The output comes
//! out `wp` wide too; its last `wp − ow` columns of each row are dropped.

use super::band::{accumulate_band_exact, band_rows, fill_band};
use super::geom::Geom;
use super::{TapWeights, Workspace};
use crate::host_nn::matmul::{gemm, MatRef};
use crate::host_nn::work::{for_each_unit, SharedMut};
use crate::host_nn::{NnFloat, NnResult};

/// `out = conv(input, weights) + bias` for a stride-1 geometry, as per-tap
/// products (`gemm`) over the band.
pub(crate) fn forward<T: NnFloat>(
    g: &Geom,
    input: &[T],
    tw: TapWeights<'_, T>,
    bias: Option<&[T]>,
    out: &mut [T],
    threads: usize,
) -> NnResult<()> {
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
