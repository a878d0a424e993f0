//! The CPU's path for small elementwise kernels: dense operands of at most
//! [`DENSE_SMALL_MAX`] elements into a fresh buffer, with the op's element
//! function and none of the general dispatch (layout walks, threading, lock
//! sorting over any operand count). Small models are made of such kernels,
//! and for them the dispatch costs more than the arithmetic.

use crate::base::buffer::CpuBuffer;
use crate::base::device::Device;
use crate::base::shape::{Layout, Shape};
use crate::kernel::storage::read_two;
use crate::kernel::Kernel;

/// Elementwise kernels whose operands are dense runs of at most this many
/// elements take [`run_dense_small`].
pub(crate) const DENSE_SMALL_MAX: usize = 1 << 12;

/// A `Unary` or `Binary` kernel over dense operands of at most
/// [`DENSE_SMALL_MAX`] elements into a fresh buffer. `None` when the kernel
/// is not such a kernel; the caller then runs it through `run_caught`.
/// Cannot panic: every slice bound is checked against the storage first.
#[inline]
pub(crate) fn run_dense_small(kernel: &Kernel<'_>, out: &mut CpuBuffer) -> Option<()> {
    let len = out.len();
    if len > DENSE_SMALL_MAX || crate::runtime::faults::injected_failure_pending(Device::Cpu) {
        return None;
    }
    match kernel {
        Kernel::Binary { op, lhs, rhs } => {
            let (a0, b0) = (dense_start(&lhs.layout, len)?, dense_start(&rhs.layout, len)?);
            let pair = read_two(&lhs.storage, &rhs.storage);
            let (a, b) = pair.hosts();
            op.host_dense(a, a0, b, b0, out).then_some(())
        }
        Kernel::Unary { op, src } => {
            let s0 = dense_start(&src.layout, len)?;
            let g = src.storage.read();
            if s0.checked_add(len)? > g.host().len() {
                return None;
            }
            let flat = Layout { shape: Shape::from(len), strides: smallvec_one(), offset: s0 };
            op.host(g.host(), &flat, out, 1).then_some(())
        }
        Kernel::Reduce { .. } | Kernel::Custom { .. } => None,
    }
}

fn smallvec_one() -> crate::base::shape::Dims {
    crate::base::shape::Dims::from_slice(&[1])
}

/// Where a view of `len` elements starts, when its elements are one dense run.
#[inline]
fn dense_start(layout: &Layout, len: usize) -> Option<usize> {
    (layout.is_contiguous() && layout.elem_count() == len).then_some(layout.offset)
}
