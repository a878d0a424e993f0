//! Host kernels of the convolutional-network ops: convolution (and its
//! transpose), pooling, batch and layer normalisation, interpolation, each
//! forward and backward, over contiguous host slices in f32 or f64.
//!
//! This is not kiln's API: it is the compute layer that the ops' host
//! kernels (the CPU, and the simulated GPUs, which run host kernels on one
//! thread) call, and that the benchmarks call directly. Nothing here knows a
//! `Tensor`, a storage or a device.
//!
//! Conventions shared by every function:
//! - Layouts are contiguous: images NCHW, convolution weights OIHW
//!   (`[out_channels, in_channels / groups, kh, kw]`), transposed-convolution
//!   weights `[in_channels, out_channels / groups, kh, kw]` as PyTorch's.
//! - Arguments are plain structs whose `validate()` refuses what PyTorch
//!   refuses (with a message naming the argument and the sizes) and returns
//!   the output's shape; every kernel validates again and checks the length
//!   of every slice, so a bad call is an [`NnError`], never a panic.
//!   User-given sizes are combined with checked arithmetic only: a shape
//!   whose element count does not fit is an error, not an overflow.
//! - Outputs are `&mut [T]` that the kernel overwrites entirely (gradients
//!   are written, not accumulated).
//! - Workspace is allocated fallibly (`OutOfMemory`, never an abort) and
//!   bounded whatever the batch: a few MB per task (bands of rows, tiles of
//!   columns, groups of Winograd tiles), plus, for a convolution, one packed
//!   copy of the weight (16/9 of it for Winograd) and of a weight gradient.
//! - `threads`: 1 runs on the calling thread only; more splits the work into
//!   that many rayon tasks (in the pool the caller runs in), which take units
//!   of work from a shared counter. Nothing blocks or locks. Results do not
//!   depend on `threads` (every output is computed by one unit, and sums
//!   over the batch are split into a fixed number of parts), except the
//!   weight gradient of a convolution whose weight has more than 65,536
//!   elements: it is split over blocks of input channels whose size follows
//!   the thread count, so its last bits may differ.
//! - f32 runs SIMD kernels on x86-64 CPUs with AVX-512 or AVX2 and FMA
//!   (chosen at run time; `KILN_HOST_NN_ISA=avx2|portable` lowers the
//!   choice); f64, and f32 elsewhere, take portable paths over `gemm`.
//! - Empty batches (and whatever else PyTorch accepts as empty) work and
//!   write nothing.

mod conv;
mod error;
mod float;
mod interp;
pub(crate) mod matmul;
mod norm;
mod pool;
mod sums;
mod vector;
mod work;

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

pub use conv::{
    conv2d_backward, conv2d_backward_bias, conv2d_backward_input, conv2d_backward_weight, conv2d_forward, conv_transpose2d_backward,
    conv_transpose2d_forward, Conv2dParams, ConvTranspose2dParams, Padding2d,
};
pub(crate) use conv::{geom_backward_input, geom_backward_weight, geom_forward, Geom as ConvGeom};
pub use error::{NnError, NnResult};
pub use float::NnFloat;
pub use interp::{interpolate_backward, interpolate_forward, InterpMode, InterpParams};
pub use norm::{
    batch_norm_backward, batch_norm_eval_forward, batch_norm_invstd, batch_norm_train_forward, batch_norm_update_running,
    layer_norm_backward, layer_norm_forward, BatchNormParams, LayerNormParams,
};
pub use pool::{
    adaptive_avg_pool2d_backward, adaptive_avg_pool2d_forward, avg_pool2d_backward, avg_pool2d_forward, max_pool2d_backward,
    max_pool2d_forward, AdaptivePool2dParams, AvgPool2dParams, MaxPool2dParams,
};
