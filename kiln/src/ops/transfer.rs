//! Moving tensors between devices: `to` (the same tensor when already
//! there) and `copy_to` (always new memory), every crossing booked in the
//! transfer ledger and checked by the transfer guard; and waiting for a
//! device's work.

use super::copy::CopyOp;
use crate::backends;
use crate::kernel::storage::Storage;
use crate::kernel::{Kernel, OpRef};
use crate::registry::backend as device_backend;
use crate::runtime::ledger;
use crate::{Device, Result, Tensor};
use std::panic::Location;

impl Tensor {
    /// This tensor on `device`: the very same tensor (sharing storage) when it
    /// is already there, a copy otherwise (the chapter's `Z.cuda(1) is Z`,
    /// MXNet's `as_in_context`).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[1f32, 2.], &cpu())?;
    /// assert!(x.to(&cpu())?.same_storage(&x));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn to(&self, device: &Device) -> Result<Tensor> {
        if self.device() == *device {
            return Ok(self.clone());
        }
        self.copy_to(device)
    }

    /// A copy on `device` in new memory, always (MXNet's `copyto`). Crossing
    /// between devices is booked in the transfer ledger and checked by the
    /// transfer guard.
    #[track_caller]
    pub fn copy_to(&self, device: &Device) -> Result<Tensor> {
        let site = Location::caller();
        let dst = device_backend(*device)?;
        let src_device = self.device();
        let bytes = self.elem_count().saturating_mul(self.dtype().size_in_bytes());
        let ticket = ledger::check(src_device, *device, bytes, site)?;
        let shape = self.shape().clone();
        let src_backend = self.backend();
        // Backends move contiguous views; a strided one is made contiguous
        // on its own device first.
        let this = if self.is_contiguous() { self.clone() } else { self.force_copy()? };
        let gpu_to_gpu_in_host_memory = src_backend.host_memory() && dst.host_memory() && src_backend.is_async() && dst.is_async();
        let out = if src_device == *device || gpu_to_gpu_in_host_memory {
            // Same device, or two simulated GPUs: the source's queue copies,
            // after the work that produces the source and before any write
            // to it enqueued later, and the destination's queue waits for
            // that copy (event order); the host does not wait. A
            // host-to-device copy is not done this way: the host may
            // overwrite its tensor right after the call, so it is copied
            // before returning.
            let out = backends::alloc(dst, self.dtype(), shape.elem_count())?;
            // On the source's backend: its queue runs the copy.
            let op = CopyOp::into_contiguous(self);
            src_backend.launch(&Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![this.src()] }, &out)?;
            if src_device != *device
                && let Some(event) = src_backend.record_event()
            {
                dst.wait_event(event)?;
            }
            out
        } else if let Some(out) = src_backend.copy_to_peer(&this.src(), dst)? {
            // Two CUDA devices with peer access: a device-to-device copy on
            // the source's stream that the destination's stream waits for;
            // the host does not wait.
            out
        } else {
            // Through the host: the source's backend reads (waiting for its
            // queue), the destination's takes the elements.
            let data = src_backend.download(&this.src())?;
            let len = data.len();
            let buffer = dst.upload(data)?;
            Storage::new(dst, buffer, self.dtype(), len)
        };
        // Booked once done: a copy that ran out of memory moved nothing.
        if let Some(ticket) = ticket {
            ticket.book();
        }
        let t = Tensor::from_storage(out, shape);
        Ok(crate::autograd::record(t, &[self], false, || Box::new(|c| Ok(smallvec::smallvec![Some(c.g.to(&c.inputs[0].device())?)]))))
    }

    /// Waits until the work producing this tensor has run (JAX's
    /// `block_until_ready`). Returns the tensor for chaining.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::ones((2,), kiln::DType::F32, &cpu())?;
    /// x.block_until_ready()?;
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn block_until_ready(&self) -> Result<&Tensor> {
        self.backend().synchronize()?;
        Ok(self)
    }
}
