//! What the fused optimizer kernels (`sgd_kernel`, `adam_kernel`) share:
//! which parameters they take, and running a kernel into a new tensor or
//! into a parameter's own storage.

use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::{CustomKernel, Kernel, OpRef};
use crate::Tensor;

/// Whether `p` can take a fused step from `operands` (its gradient and
/// its state, on `p`'s device already): f32 or f64, every operand of `p`'s
/// dtype, shape and device and not sharing `p`'s storage, and `p` one
/// contiguous run of its storage, which the step then writes in place.
pub(super) fn takes_in_place<'a>(p: &Tensor, operands: impl IntoIterator<Item = &'a Tensor>) -> bool {
    matches!(p.dtype(), DType::F32 | DType::F64)
        && p.layout().contiguous_range().is_some()
        && operands.into_iter().all(|t| t.dtype() == p.dtype() && t.dims() == p.dims() && t.device() == p.device() && !p.same_storage(t))
}

/// Where `p`'s elements start in its storage (for a `p` that
/// [`takes_in_place`] accepts).
pub(super) fn offset(p: &Tensor) -> usize {
    p.layout().contiguous_range().map_or(0, |(a, _)| a)
}

/// Runs `k` over `inputs`, made contiguous, into a new tensor of the first
/// input's dtype and shape.
pub(super) fn new_tensor<'a>(k: &dyn CustomKernel, inputs: impl IntoIterator<Item = &'a Tensor>) -> Result<Tensor> {
    let contiguous: Vec<Tensor> = inputs.into_iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let kernel = Kernel::Custom { op: OpRef::Borrowed(k), inputs: contiguous.iter().map(|t| t.src()).collect() };
    contiguous[0].run_new(kernel, contiguous[0].dtype(), contiguous[0].shape().clone())
}

/// Runs `k` over `inputs` (contiguous already), writing `p`'s own storage.
pub(super) fn into_parameter(k: &dyn CustomKernel, p: &Tensor, inputs: &[&Tensor]) -> Result<()> {
    let kernel = Kernel::Custom { op: OpRef::Borrowed(k), inputs: inputs.iter().map(|t| t.src()).collect() };
    crate::backends::launch_into(&kernel, &p.storage)
}
