//! Stride-1 convolutions in f32 as register-tiled kernels over the padded
//! band of [`super::band`] (the same layout: rows `wp = ow + (kw − 1)·dw`
//! wide, tap (ky, kx) at offset `ky·dh·wp + kx·dw`), with no unfolding and
//! no general-purpose product, for AVX-512 and for AVX2 with FMA
//! ([`crate::host_nn::vector`]):
//!
//! - forward (and the input gradient, which is the forward of the flipped
//!   geometry): a tile of `OB` output channels × `NV` vectors of output
//!   positions accumulates in registers over every (input channel, tap),
//!   each step loading `NV` input vectors and broadcasting `OB` weights; or,
//!   where rows are too narrow to fill vectors, a tile of `PB` positions ×
//!   `VB` vectors of output channels (channels along the lanes);
//! - weight gradient: a tile of output channels × (input channel, tap)
//!   pairs accumulates, along the output positions of a group of whole
//!   images, the products of the output gradient with the shifted input,
//!   summed across lanes once per group; or with channels along the lanes.
//!
//! Everything else (other strides, f64, CPUs with neither) takes the
//! portable paths.

use super::band::{band_rows, fill_band};
use super::geom::Geom;
use super::tiles::{channel_shape, forward_block, forward_vectors, Kernels};
use super::{TapWeights, Workspace};
use crate::host_nn::vector::Isa;
use crate::host_nn::work::{for_each_unit, SharedMut};
use crate::host_nn::{NnError, NnFloat, NnResult};

mod weight;

pub(crate) use weight::accumulate_weight;

/// Positions computed per real output position by the position-lane tiles
/// (rows `wp` wide, tiles of whole vectors) and by the channel-lane tiles
/// (channels in whole vectors, positions in whole tiles), for a band of `r`
/// rows.
fn waste<I: Isa>(g: &Geom, r: usize, wp: usize) -> (f64, f64) {
    let lanes = I::LANES;
    let ncols = (r - 1) * wp + g.ow;
    let ob = forward_block(g.ocg);
    let nv = forward_vectors::<I>(ob, ncols);
    let by_position = (ncols.div_ceil(nv * lanes) * nv * lanes * g.ocg.div_ceil(ob) * ob) as f64 / (r * g.ow * g.ocg) as f64;
    let (vb, pb) = channel_shape::<I>(g.ocg);
    let by_channel = ((r * g.ow).div_ceil(pb) * pb * g.ocg.div_ceil(vb * lanes) * vb * lanes) as f64 / (r * g.ow * g.ocg) as f64;
    (by_position, by_channel)
}

/// Whether channel-lane tiles waste clearly less than position-lane ones.
fn by_channel<I: Isa>(g: &Geom, r: usize, wp: usize) -> bool {
    let (by_position, by_channel) = waste::<I>(g, r, wp);
    g.ocg >= I::LANES && by_channel * 1.05 < by_position
}

fn internal(what: &str) -> NnError {
    NnError::invalid("conv2d", format!("internal: {what}"))
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

/// The weights of group `grp` packed for the channel-lane tiles: per block
/// of `lanes·vb` output channels, per (input channel, tap), the channels' weights
/// (zero past `ocg`).
fn pack_channels<T: NnFloat>(g: &Geom, tw: &TapWeights<'_, T>, grp: usize, vb: usize, lanes: usize, out: &mut [f32]) {
    let (taps, k_len, width) = (g.taps(), g.k_len(), vb * lanes);
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
pub(crate) fn forward<I: Kernels, T: NnFloat>(
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
    let rows = band_rows::<f32>(g, g.icg, blocks * ob, wp, g.n * g.groups, threads);
    let bands = g.oh.div_ceil(rows);
    let units = g.n * g.groups * bands;
    let by_channel = by_channel::<I>(g, rows.min(g.oh), wp);
    let (vb, pb) = channel_shape::<I>(g.ocg);
    // Packed weights of every group, made once.
    let group_len = if by_channel { g.ocg.div_ceil(vb * I::LANES) * vb * I::LANES * k_len } else { blocks * ob * k_len };
    let mut packed = crate::host_nn::work::zeroed::<f32>(OP, g.groups * group_len)?;
    for grp in 0..g.groups {
        let dst = &mut packed[grp * group_len..(grp + 1) * group_len];
        if by_channel {
            pack_channels(g, &tw, grp, vb, I::LANES, dst);
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
                let width = vb * I::LANES;
                let positions = r * g.ow;
                let ((band, tile), table) = ws.two_and_offsets(g.icg * plane, pb * width, k_len + positions)?;
                let _ = fill_band(g, &input[(n * g.c_in() + grp * g.icg) * ip..], g.icg, y0, rr, wp, plane, band, false);
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
                        // SAFETY: the caller checked the CPU has I; band reads addr[k] +
                        // base[j] < icg·plane; the block's packed weights hold
                        // k_len·width values; tile holds pb·width.
                        unsafe {
                            I::channel_tile(
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
            let nv = forward_vectors::<I>(ob, ncols);
            let span = nv * I::LANES;
            let tiles = ncols.div_ceil(span);
            let stride = tiles * span;
            // The last tile reads up to `span` past the last band row.
            let ((band, prod), addr) = ws.two_and_offsets(g.icg * plane + span, blocks * ob * stride, k_len)?;
            let _ = fill_band(g, &input[(n * g.c_in() + grp * g.icg) * ip..], g.icg, y0, rr, wp, plane, band, false);
            band[g.icg * plane..].fill(0.0);
            for (k, a) in addr.iter_mut().enumerate() {
                let (c, t) = (k / g.taps(), k % g.taps());
                *a = c * plane + (t / g.kw) * g.dh * wp + (t % g.kw) * g.dw;
            }
            for blk in 0..blocks {
                for tile in 0..tiles {
                    // SAFETY: the caller checked the CPU has I;
                    // band offsets addr[k] + tile·span + span ≤ icg·plane + span
                    // (addr[k] + ncols ≤ icg·plane and tile·span < ncols); the
                    // packed block holds k_len·ob weights; prod rows are `stride`
                    // long, ob rows per block.
                    unsafe {
                        I::forward_tile(
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
