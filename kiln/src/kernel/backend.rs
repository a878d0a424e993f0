//! The backend trait: what a device must provide (memory, kernel launches,
//! transfers, events). One implementation per folder of `backends/`.

use crate::base::buffer::CpuBuffer;
use crate::base::device::{Device, DeviceKind};
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::storage::{Buffer, Storage};
use crate::kernel::{Kernel, Src};
use crate::runtime::memory::MemoryPool;
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

/// Time a device's queues spent, in nanoseconds, since the device started
/// (simulated GPUs keep these; see [`Backend::queue_times`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct QueueTimes {
    /// Running kernels on the compute queue.
    pub compute_ns: u64,
    /// The compute queue blocked waiting for other queues (collectives,
    /// copies from other devices).
    pub wait_ns: u64,
    /// The collectives' queue busy (its kernels and its waits for peers).
    pub comm_ns: u64,
}

/// A point in a device's queue: waiting on it waits for all work submitted
/// before it was recorded.
pub(crate) trait Event: Send + Sync {
    fn wait(&self);
    /// Where the device keeps a modelled clock (simulated GPUs), its time
    /// in nanoseconds when the work before the event completed; `None`
    /// elsewhere, or when the event is no longer known.
    fn device_time_ns(&self) -> Option<u64> {
        None
    }
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
    /// Frees the buffer of a storage whose bytes were unbooked already
    /// (stream-ordered release on a simulated GPU).
    fn release_unbooked(&self, buffer: Buffer) {
        if let Buffer::Host(b) = buffer {
            self.pool().recycle(b);
        }
    }
    /// Runs (or enqueues) a kernel writing `out`; its operands and `out` all
    /// live on this device.
    fn launch(&self, kernel: &Kernel<'_>, out: &Arc<Storage>) -> Result<()>;
    /// Host to device: takes ownership of host elements.
    fn upload(&self, data: CpuBuffer) -> Result<Buffer>;
    /// Device to host: waits for the producing work, returns the view's
    /// elements in row-major order.
    fn download(&self, src: &Src<'_>) -> Result<CpuBuffer>;
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
    /// This backend, for a backend that recognises its own kind in
    /// [`copy_to_peer`](Self::copy_to_peer) (CUDA to CUDA).
    fn as_any(&self) -> &dyn std::any::Any;
    /// True when the bytes of a storage whose last tensor is gone may be
    /// booked again at once while kernels queued before still use it (a
    /// stream-ordered allocator: the simulated GPUs').
    fn stream_ordered_release(&self) -> bool {
        false
    }
    /// Copies the view `src` (on this device) into a new storage on `dst`
    /// without the host: after the work queued here so far, with `dst`'s later
    /// work waiting for it, returning before it has run. `Ok(None)` when the
    /// two devices cannot (the caller then goes through the host).
    fn copy_to_peer(&self, _src: &Src<'_>, _dst: &'static dyn Backend) -> Result<Option<Arc<Storage>>> {
        Ok(None)
    }
    /// The communicator that runs collectives natively across this
    /// backend's devices (a ring over simulated GPUs, NCCL over CUDA
    /// devices), or `None`: collectives then go through peer copies and
    /// ordinary kernels (`comm/`). Every device of one backend returns the
    /// same communicator.
    fn communicator(&self) -> Option<&'static dyn crate::kernel::comm::Communicator> {
        None
    }
    /// Where the device's queues spent their time, when it keeps count.
    fn queue_times(&self) -> Option<QueueTimes> {
        None
    }
    /// Why [`communicator`](Self::communicator) is `None` when the backend
    /// could have one (NCCL did not load), for `kiln devices`.
    fn why_no_communicator(&self) -> Option<String> {
        None
    }
    /// Frees memory kept for reuse (the pool's host cache by default).
    fn empty_cache(&self) -> Result<()> {
        self.pool().empty_cache();
        Ok(())
    }
}
