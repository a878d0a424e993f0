//! Collectives for any group of devices, through peer copies ([`Tensor::to`],
//! booked by it) and ordinary kernels on one device: what runs when the
//! devices share no communicator (the CPU with GPUs, CUDA devices without
//! NCCL, a single device). Results are computed once and copied, so every
//! device gets the same bits. Called under `no_grad` by the front end.

use crate::base::error::Result;
use crate::kernel::comm::Combine;
use crate::{DType, Tensor};

fn combine(a: &Tensor, b: &Tensor, op: Combine) -> Result<Tensor> {
    if let dtype @ (DType::F16 | DType::BF16) = a.dtype() {
        // Half types combine in f32, rounding each result once, as the
        // ring's kernels and NCCL do.
        return combine(&a.to_dtype(DType::F32)?, &b.to_dtype(DType::F32)?, op)?.to_dtype(dtype);
    }
    match op {
        Combine::Sum => a.add(b),
        Combine::Max => a.maximum(b),
        Combine::Min => a.minimum(b),
    }
}

/// The combination of every tensor on the device of `tensors[root]`,
/// combined in rank order.
pub(super) fn reduce(tensors: &[Tensor], root: usize, op: Combine) -> Result<Tensor> {
    let device = tensors[root].device();
    let mut acc: Option<Tensor> = None;
    for t in tensors {
        let t = t.to(&device)?;
        acc = Some(match acc {
            None => t,
            Some(a) => combine(&a, &t, op)?,
        });
    }
    let acc = acc.expect("check_group ensures one tensor at least");
    // A new tensor even for one device (the caller may write it).
    if tensors.len() == 1 {
        return acc.force_copy();
    }
    Ok(acc)
}

/// The combination on every device: reduced on the first, copied back.
pub(super) fn all_reduce(tensors: &[Tensor], op: Combine) -> Result<Vec<Tensor>> {
    let acc = reduce(tensors, 0, op)?;
    let mut out = vec![acc.clone()];
    for t in &tensors[1..] {
        out.push(acc.copy_to(&t.device())?);
    }
    Ok(out)
}

/// The concatenation on every device: made on the first, copied.
pub(super) fn all_gather(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    let device = tensors[0].device();
    let moved = tensors.iter().map(|t| t.to(&device)).collect::<Result<Vec<_>>>()?;
    let all = Tensor::cat(&moved.iter().collect::<Vec<_>>(), 0)?;
    let mut out = vec![all.clone()];
    for t in &tensors[1..] {
        out.push(all.copy_to(&t.device())?);
    }
    Ok(out)
}

/// Block i of the combination on device i: reduced on the first, cut,
/// copied.
pub(super) fn reduce_scatter(tensors: &[Tensor], op: Combine) -> Result<Vec<Tensor>> {
    let n = tensors.len();
    let acc = reduce(tensors, 0, op)?;
    let block = acc.dims()[0] / n;
    tensors.iter().enumerate().map(|(i, t)| acc.narrow(0, i * block, block)?.copy_to(&t.device())).collect()
}
