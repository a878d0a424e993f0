//! The instruction-set row kernels under the f32 convolutions: the
//! register tiles of [`super::direct`] (`body.rs`) and the transforms of
//! [`super::winograd`] (`winograd.rs`), each instantiated for AVX-512 and
//! AVX2 inside `#[target_feature]` functions ([`Kernels`]), and the tile
//! shapes both algorithms size their work by.

use crate::host_nn::vector::Isa;

mod body;
mod winograd;

/// One instruction set's kernels: the bodies of `body.rs` instantiated for the
/// tile shapes its registers allow, inside `#[target_feature]` functions.
///
/// # Safety
/// Every method requires the CPU to have the instruction set ([`level`]),
/// plus the body's own conditions.
pub(crate) trait Kernels: Isa {
    /// Output channels and (input channel, tap) pairs of a position-lane
    /// weight-gradient tile.
    const WEIGHT_TILE: (usize, usize);
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
    );
    unsafe fn channel_tile(vb: usize, k_len: usize, addr: *const usize, band: *const f32, base: &[usize], w: *const f32, out: *mut f32);
    #[allow(clippy::too_many_arguments)]
    unsafe fn weight_tile(
        images: usize,
        vectors: usize,
        d: *const f32,
        d_layout: (usize, usize),
        band: *const f32,
        band_image: usize,
        addr: &[usize],
        out: *mut f32,
    );
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
    );
    /// [`winograd::input_row`].
    unsafe fn wino_input_row(rows: [*const f32; 4], tw: usize, v: *mut f32, xi_stride: usize);
    /// [`winograd::output_row`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn wino_output_row(m: *const f32, xi_stride: usize, tw: usize, bias: f32, out: [*mut f32; 2], rows: usize, ow: usize);
    /// [`winograd::gradient_row`].
    unsafe fn wino_gradient_row(rows: [*const f32; 2], tw: usize, z: *mut f32, xi_stride: usize);
}

/// Implements [`Kernels`] for one instruction set: `$features` for its
/// `#[target_feature]`, the (channels, vectors) shapes of the position-lane
/// forward tile, the (vectors, positions) shapes of the channel-lane tiles,
/// and the weight tile.
macro_rules! kernels {
    ($isa:ty, $features:literal, forward: [$($ob:literal x $nv:literal),*], channels: [$($vb:literal x $pb:literal),*], weight: $wo:literal x $wk:literal) => {
        impl Kernels for $isa {
            const WEIGHT_TILE: (usize, usize) = ($wo, $wk);
            #[target_feature(enable = $features)]
            unsafe fn forward_tile(ob: usize, nv: usize, k_len: usize, addr: *const usize, band: *const f32, w: *const f32, out: *mut f32, stride: usize) {
                match (ob, nv) {
                    $(($ob, $nv) => unsafe { body::forward_tile::<$isa, $ob, $nv>(k_len, addr, band, w, out, stride) },)*
                    _ => unreachable!("no forward tile of {ob} x {nv}"),
                }
            }
            #[target_feature(enable = $features)]
            unsafe fn channel_tile(vb: usize, k_len: usize, addr: *const usize, band: *const f32, base: &[usize], w: *const f32, out: *mut f32) {
                match vb {
                    $($vb => {
                        let base: &[usize; $pb] = base.try_into().unwrap_or(&[0; $pb]);
                        unsafe { body::channel_tile::<$isa, $pb, $vb>(k_len, addr, band, base, w, out) }
                    })*
                    _ => unreachable!("no channel tile of {vb} vectors"),
                }
            }
            #[target_feature(enable = $features)]
            unsafe fn weight_tile(images: usize, vectors: usize, d: *const f32, d_layout: (usize, usize), band: *const f32, band_image: usize, addr: &[usize], out: *mut f32) {
                let addr: &[usize; $wk] = addr.try_into().unwrap_or(&[0; $wk]);
                unsafe { body::weight_tile::<$isa, $wo, $wk>(images, vectors, d, d_layout, band, band_image, addr, out) }
            }
            #[target_feature(enable = $features)]
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
                match vb {
                    $($vb => {
                        let addr: &[usize; $pb] = addr.try_into().unwrap_or(&[0; $pb]);
                        unsafe { body::weight_channel_tile::<$isa, $pb, $vb>(images, positions, dt, dt_layout, band, band_image, addr, base, out, out_stride) }
                    })*
                    _ => unreachable!("no channel weight tile of {vb} vectors"),
                }
            }
            #[target_feature(enable = $features)]
            unsafe fn wino_input_row(rows: [*const f32; 4], tw: usize, v: *mut f32, xi_stride: usize) {
                unsafe { winograd::input_row::<$isa>(rows, tw, v, xi_stride) }
            }
            #[target_feature(enable = $features)]
            unsafe fn wino_output_row(m: *const f32, xi_stride: usize, tw: usize, bias: f32, out: [*mut f32; 2], rows: usize, ow: usize) {
                unsafe { winograd::output_row::<$isa>(m, xi_stride, tw, bias, out, rows, ow) }
            }
            #[target_feature(enable = $features)]
            unsafe fn wino_gradient_row(rows: [*const f32; 2], tw: usize, z: *mut f32, xi_stride: usize) {
                unsafe { winograd::gradient_row::<$isa>(rows, tw, z, xi_stride) }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
kernels!(
    crate::host_nn::vector::Avx512,
    "avx512f",
    forward: [1 x 1, 1 x 2, 1 x 3, 1 x 4, 2 x 1, 2 x 2, 2 x 3, 2 x 4, 3 x 1, 3 x 2, 3 x 3, 3 x 4, 4 x 1, 4 x 2, 4 x 3, 4 x 4,
              5 x 1, 5 x 2, 5 x 3, 5 x 4, 6 x 1, 6 x 2, 6 x 3, 6 x 4, 7 x 1, 7 x 2, 7 x 3, 8 x 1, 8 x 2, 8 x 3],
    channels: [1 x 24, 2 x 12, 3 x 8, 4 x 6],
    weight: 4 x 4
);

#[cfg(target_arch = "x86_64")]
kernels!(
    crate::host_nn::vector::Avx2,
    "avx2,fma",
    forward: [1 x 1, 1 x 2, 1 x 3, 1 x 4, 2 x 1, 2 x 2, 2 x 3, 2 x 4, 3 x 1, 3 x 2, 3 x 3, 3 x 4, 4 x 1, 4 x 2, 4 x 3,
              5 x 1, 5 x 2, 6 x 1, 6 x 2, 7 x 1, 8 x 1],
    channels: [1 x 12, 2 x 6, 3 x 4, 4 x 3],
    weight: 2 x 4
);

/// Output channels per forward tile for `ocg` channels: blocks of at most
/// 8, as even as possible.
pub(crate) fn forward_block(ocg: usize) -> usize {
    ocg.div_ceil(ocg.div_ceil(8)).max(1)
}

/// Vectors of positions per forward tile for `ob` channels over `ncols`
/// positions: the accumulators the registers allow and at most 4, the count
/// that computes the fewest vectors past `ncols` (the widest of those).
pub(crate) fn forward_vectors<I: Isa>(ob: usize, ncols: usize) -> usize {
    let most = (I::ACCUMULATORS / ob).clamp(1, 4);
    let vectors = ncols.div_ceil(I::LANES);
    (1..=most).rev().min_by_key(|&nv| vectors.div_ceil(nv) * nv).unwrap_or(1)
}

/// Vectors of output channels per channel-lane tile, and positions (or
/// (input channel, tap) pairs) per tile.
pub(crate) fn channel_shape<I: Isa>(ocg: usize) -> (usize, usize) {
    let vb = ocg.div_ceil(I::LANES).clamp(1, 4);
    (vb, I::ACCUMULATORS / vb)
}
