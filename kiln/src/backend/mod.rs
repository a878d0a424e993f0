//! The seam between the front end and the devices. One trait, implemented by
//! the CPU (synchronous, all cores), the simulated GPUs (own memory pool and an
//! in-order queue on a worker thread) and, when present, CUDA.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod host_kernels;
pub(crate) mod sim;

use crate::memory::MemoryPool;
use crate::op::{Kernel, Src};
use crate::storage::{Buffer, CpuBuffer, Storage};
use crate::{DType, Device, DeviceKind, Result};
use std::sync::Arc;

/// Keeps a device's queue stopped while alive (see [`crate::hold_queue`]).
#[must_use = "the queue resumes when the hold is dropped"]
pub struct QueueHold {
    pub(crate) _release: crossbeam_channel::Sender<()>,
}

impl std::fmt::Debug for QueueHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QueueHold")
    }
}

/// A point in a device's queue: waiting on it waits for all work submitted
/// before it was recorded.
pub(crate) trait Event: Send + Sync {
    fn wait(&self);
}

/// What a device must provide. Validation is done before any of these is
/// called: a backend only fails on its own resources (memory, driver).
pub(crate) trait Backend: Send + Sync + 'static {
    fn device(&self) -> Device;
    fn kind(&self) -> DeviceKind;
    fn name(&self) -> String;
    fn pool(&self) -> &MemoryPool;
    /// True when operations return before their kernels have run.
    fn is_async(&self) -> bool;
    /// Memory the driver reports free, where it knows.
    fn driver_free_memory(&self) -> Option<usize> {
        None
    }
    /// Extra facts for `devices()` (compute capability, driver version).
    fn details(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// A buffer for `len` elements, booked in the pool. Its contents are
    /// unspecified: every kernel writes all of its output.
    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<Buffer>;
    /// Gives back the buffer of a dropped storage.
    fn release(&self, buffer: Buffer, bytes: usize);
    /// Runs (or enqueues) a kernel whose operands all live on this device,
    /// except for `Copy` sources that `can_read_host_buffers` allows.
    fn launch(&self, kernel: Kernel) -> Result<()>;
    /// Host to device: takes ownership of host elements.
    fn upload(&self, data: CpuBuffer) -> Result<Buffer>;
    /// Device to host: waits for the producing work, returns the view's
    /// elements in row-major order.
    fn download(&self, src: &Src) -> Result<CpuBuffer>;
    /// An event at the current end of the queue (None on synchronous devices).
    fn record_event(&self) -> Option<Arc<dyn Event>>;
    /// Makes later work on this device wait for `event` without blocking the host.
    fn wait_event(&self, event: Arc<dyn Event>) -> Result<()>;
    /// True when buffers are host memory that another host-memory device's
    /// kernels may read directly (CPU and simulated GPUs).
    fn host_memory(&self) -> bool;
    /// Blocks until all submitted work has run.
    fn synchronize(&self) -> Result<()>;
    /// Stops the device's queue after the work submitted so far, until the
    /// returned hold is dropped. `None` for synchronous devices.
    fn hold_queue(&self) -> Result<Option<QueueHold>> {
        Ok(None)
    }
    /// This backend as a CUDA device (for copies between two of them).
    fn as_cuda(&self) -> Option<&cuda::CudaBackend> {
        None
    }
    /// Copies the view `src` (on this device) into a new storage on `dst`
    /// without the host: after the work queued here so far, with `dst`'s later
    /// work waiting for it, returning before it has run. `Ok(None)` when the
    /// two devices cannot (the caller then goes through the host).
    fn copy_to_peer(&self, _src: &Src, _dst: &Arc<dyn Backend>) -> Result<Option<Arc<Storage>>> {
        Ok(None)
    }
    /// Frees memory kept for reuse (the pool's host cache by default).
    fn empty_cache(&self) -> Result<()> {
        self.pool().empty_cache();
        Ok(())
    }
}

/// Allocates a storage of `len` elements on `backend`.
pub(crate) fn alloc(backend: &Arc<dyn Backend>, dtype: DType, len: usize) -> Result<Arc<Storage>> {
    let buffer = backend.alloc_buffer(dtype, len)?;
    Ok(Storage::new(backend.clone(), buffer, dtype, len))
}
