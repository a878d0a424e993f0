//! The kernel contract: what the front end hands a backend, and what an op
//! implements so that every backend can run it.
//!
//! A [`Kernel`] names an op and its operands (borrowed views of storages).
//! The op itself is a trait object of one of four kinds:
//! - [`UnaryKernel`], [`BinaryKernel`], [`ReduceKernel`]: members of an
//!   elementwise family, each one line in its family's list
//!   (`ops/unary/mod.rs`, ...). The family shares the loops (dense and
//!   strided, parallel), the CPU's small-operand path and one CUDA module
//!   generated from its members' expressions;
//! - [`CustomKernel`]: an op with kernels of its own (matmul, copy,
//!   indexing, cumsum...), one file under `ops/`.
//!
//! Backends never name an op: they lock the operands and call the op's host
//! kernel, or launch its CUDA kernel through [`cuda::CudaDevice`]. Adding an
//! op therefore touches no backend, and a backend runs every op. The op's
//! front end (validation, dtype and shape rules) and its gradient live in
//! the same file as its kernels.

pub(crate) mod comm;
pub(crate) mod cuda;
pub(crate) mod index_check;
pub(crate) mod storage;

use crate::base::buffer::CpuBuffer;
use crate::base::device::{Device, DeviceKind};
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::base::shape::{Dims, Layout};
use crate::runtime::memory::MemoryPool;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::sync::Arc;
use storage::{Buffer, Storage};

/// A storage as a kernel names it. On a synchronous device the kernel runs
/// before the call returns, so it borrows the caller's tensors (no reference
/// count is touched); a kernel that waits in a device's queue owns a
/// reference instead ([`Kernel::to_owned`]), so dropping the tensors
/// meanwhile is safe.
pub(crate) type StorageRef<'a> = Cow<'a, Arc<Storage>>;

/// A view of a storage: the operand of a kernel.
#[derive(Clone)]
pub(crate) struct Src<'a> {
    pub storage: StorageRef<'a>,
    pub layout: Cow<'a, Layout>,
}

impl<'a> Src<'a> {
    /// A view with a layout of its own (a broadcast, say) of a borrowed storage.
    pub(crate) fn with_layout(storage: &'a Arc<Storage>, layout: Layout) -> Src<'a> {
        Src { storage: Cow::Borrowed(storage), layout: Cow::Owned(layout) }
    }
    /// The same view, owning its storage reference and layout.
    pub(crate) fn to_owned(&self) -> Src<'static> {
        Src { storage: Cow::Owned(Arc::clone(&self.storage)), layout: Cow::Owned(Layout::clone(&self.layout)) }
    }
}

/// An op as a kernel names it: borrowed for a kernel that runs at once,
/// shared when the kernel waits in a device's queue.
pub(crate) enum OpRef<'a, T: ?Sized> {
    Borrowed(&'a T),
    Shared(Arc<T>),
}

impl<T: ?Sized> std::ops::Deref for OpRef<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        match self {
            OpRef::Borrowed(t) => t,
            OpRef::Shared(t) => t,
        }
    }
}

/// One kernel: an op and the views it reads. Where the result goes is given
/// beside it ([`Out`], or the storage a backend's `launch` gets): a new
/// buffer for most kernels, an existing storage for ops that write in place
/// (a copy into a view, `index_add`).
pub(crate) enum Kernel<'a> {
    /// out = op(src), elementwise; out has src's shape.
    Unary { op: OpRef<'a, dyn UnaryKernel>, src: Src<'a> },
    /// out = lhs op rhs, elementwise; both layouts already broadcast to out's shape.
    Binary { op: OpRef<'a, dyn BinaryKernel>, lhs: Src<'a>, rhs: Src<'a> },
    /// out has src's shape with the `dims` set to 1.
    Reduce { op: OpRef<'a, dyn ReduceKernel>, src: Src<'a>, dims: Dims },
    /// An op with kernels of its own, reading `inputs`.
    Custom { op: OpRef<'a, dyn CustomKernel>, inputs: SmallVec<[Src<'a>; 3]> },
}

impl Kernel<'_> {
    /// The kernel with owned operand and op references, to wait in a queue.
    pub(crate) fn to_owned(&self) -> Kernel<'static> {
        match self {
            Kernel::Unary { op, src } => Kernel::Unary { op: OpRef::Shared(op.to_shared()), src: src.to_owned() },
            Kernel::Binary { op, lhs, rhs } => {
                Kernel::Binary { op: OpRef::Shared(op.to_shared()), lhs: lhs.to_owned(), rhs: rhs.to_owned() }
            }
            Kernel::Reduce { op, src, dims } => {
                Kernel::Reduce { op: OpRef::Shared(op.to_shared()), src: src.to_owned(), dims: dims.clone() }
            }
            Kernel::Custom { op, inputs } => {
                Kernel::Custom { op: OpRef::Shared(op.to_shared()), inputs: inputs.iter().map(Src::to_owned).collect() }
            }
        }
    }

    /// The op's name, for errors reported after it ran.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Kernel::Unary { op, .. } => op.name(),
            Kernel::Binary { op, .. } => op.name(),
            Kernel::Reduce { op, .. } => op.name(),
            Kernel::Custom { op, .. } => op.name(),
        }
    }

    /// The fault of the first input whose storage is poisoned
    /// ([`Storage::fault`]): the output of a kernel reading it is poisoned
    /// with the same fault. One atomic load per input when none is.
    #[inline]
    pub(crate) fn input_fault(&self) -> Option<crate::Error> {
        match self {
            Kernel::Unary { src, .. } | Kernel::Reduce { src, .. } => src.storage.fault(),
            Kernel::Binary { lhs, rhs, .. } => lhs.storage.fault().or_else(|| rhs.storage.fault()),
            Kernel::Custom { inputs, .. } => inputs.iter().find_map(|i| i.storage.fault()),
        }
    }

    /// True when the kernel, having succeeded, has written every element of
    /// an output of `out_len` elements without reading the output's old
    /// contents: a poisoned output is then recomputed (its mark cleared).
    #[inline]
    pub(crate) fn overwrites(&self, out_len: usize) -> bool {
        match self {
            Kernel::Custom { op, inputs } => op.overwrites(inputs, out_len),
            Kernel::Unary { .. } | Kernel::Binary { .. } | Kernel::Reduce { .. } => true,
        }
    }

    /// True when the kernel writes no element of an output of `out_len`
    /// elements. Such kernels are skipped, so no backend walks the
    /// dimensions of an empty tensor.
    #[inline]
    pub(crate) fn writes_nothing(&self, out_len: usize) -> bool {
        match self {
            Kernel::Custom { op, inputs } => op.writes_nothing(inputs, out_len),
            Kernel::Unary { .. } | Kernel::Binary { .. } | Kernel::Reduce { .. } => out_len == 0,
        }
    }
}

/// Where a host kernel writes.
pub(crate) enum Out<'a> {
    /// A buffer nobody else can see yet: the new tensor of an operation on a
    /// synchronous device, computed before its storage exists. No lock.
    Fresh(&'a mut CpuBuffer),
    /// A storage others may see (an in-place write, or a kernel that ran
    /// later on a device's queue): write-locked together with the inputs.
    Storage(&'a Storage),
}

impl Out<'_> {
    /// Elements of the output.
    pub(crate) fn len(&self) -> usize {
        match self {
            Out::Fresh(b) => b.len(),
            Out::Storage(s) => s.len,
        }
    }
}

/// An input of a host kernel: its elements (read-locked) and the view.
pub(crate) struct HostIn<'a> {
    pub buf: &'a CpuBuffer,
    pub layout: &'a Layout,
}

/// A member of the unary family: out = f(x) elementwise (`ops/unary`).
pub(crate) trait UnaryKernel: Send + Sync + 'static {
    /// The op's name: errors report it, and its CUDA kernels are
    /// `unary_{name}_{dtype}`.
    fn name(&self) -> &'static str;
    /// out[i] = f(src[layout(i)]) over host memory, spread over the pool when
    /// `threads > 1`. False when the op has no host kernel for these dtypes
    /// (the front end should have refused them: a kiln bug).
    fn host(&self, src: &CpuBuffer, layout: &Layout, out: &mut CpuBuffer, threads: usize) -> bool;
    /// buf[i] = f(buf[i]) (numpy's temporary elision); false as `host`.
    fn host_in_place(&self, buf: &mut CpuBuffer, threads: usize) -> bool;
    /// The family's CUDA module, this op's kernel for `dtype`, and its scalars.
    fn cuda(&self, dtype: DType) -> cuda::FamilyCall;
    /// The op as a shared reference, for a kernel that waits in a queue.
    fn to_shared(&self) -> Arc<dyn UnaryKernel>;
}

/// A member of the binary family: out = f(a, b) elementwise, of the
/// operands' dtype or u8 for comparisons (`ops/binary`).
pub(crate) trait BinaryKernel: Send + Sync + 'static {
    /// The op's name (CUDA kernels: `binary_{name}_{dtype}`).
    fn name(&self) -> &'static str;
    /// out[i] = f(a[la(i)], b[lb(i)]) over host memory; false as
    /// [`UnaryKernel::host`].
    fn host(&self, a: &CpuBuffer, la: &Layout, b: &CpuBuffer, lb: &Layout, out: &mut CpuBuffer, threads: usize) -> bool;
    /// The same over dense runs starting at `a0` and `b0`, one thread: the
    /// CPU's path for small operands. False when the dtypes do not match
    /// or a run does not fit (the caller then takes the general path).
    fn host_dense(&self, a: &CpuBuffer, a0: usize, b: &CpuBuffer, b0: usize, out: &mut CpuBuffer) -> bool;
    /// The family's CUDA module and this op's kernel for operands of `dtype`.
    fn cuda(&self, dtype: DType) -> cuda::FamilyCall;
    /// The op as a shared reference.
    fn to_shared(&self) -> Arc<dyn BinaryKernel>;
}

/// A member of the reduction family (`ops/reduce`).
pub(crate) trait ReduceKernel: Send + Sync + 'static {
    /// The op's name (CUDA kernels: `reduce_{name}_{shape}_{dtype}`).
    fn name(&self) -> &'static str;
    /// out = the reduction of src over `dims` (kept as size 1) on the host;
    /// false as [`UnaryKernel::host`].
    fn host(&self, src: &CpuBuffer, layout: &Layout, dims: &[usize], out: &mut CpuBuffer, threads: usize) -> bool;
    /// The family's CUDA module and the kernel prefix for `dtype` (the
    /// backend appends the launch shape: `block`, `thread`, `partial`, `final`).
    fn cuda(&self, dtype: DType) -> cuda::FamilyCall;
    /// The op as a shared reference.
    fn to_shared(&self) -> Arc<dyn ReduceKernel>;
}

/// An op with kernels of its own: one file under `ops/` holds its front end,
/// its gradient, and the two kernels below.
pub(crate) trait CustomKernel: Send + Sync + 'static {
    /// The op's name, as errors report it.
    fn name(&self) -> &'static str;
    /// Runs over host memory: `inputs` are read-locked (an input that shares
    /// the output's storage was read out first, contiguous), `out` is
    /// written, possibly in place. `threads > 1`: the pool may be used.
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()>;
    /// Runs on a CUDA device: launches its kernels through `dev`.
    fn cuda(&self, dev: &dyn cuda::CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()>;
    /// True when nothing would be written into an output of `out_len`
    /// elements (an empty output, or an in-place write from nothing).
    fn writes_nothing(&self, _inputs: &[Src<'_>], out_len: usize) -> bool {
        out_len == 0
    }
    /// True when the kernel writes every element of an output of `out_len`
    /// elements and never reads the output's old contents: a poisoned
    /// output (see [`Storage::fault`]) is then recomputed. False (the safe
    /// answer: the mark stays) unless the op says so; a kernel writing a
    /// new storage does not need it.
    fn overwrites(&self, _inputs: &[Src<'_>], _out_len: usize) -> bool {
        false
    }
    /// The op as a shared reference.
    fn to_shared(&self) -> Arc<dyn CustomKernel>;
}

/// One part of a [`MultiKernel`]: the views it reads and the storages it
/// writes, each from an element offset on (a parameter updated in place
/// starts where its view starts; a fresh output at 0).
pub(crate) struct MultiPart<'a> {
    /// The views read, `None` where an optional operand is absent (a
    /// moment before an optimizer's first step).
    pub inputs: SmallVec<[Option<Src<'a>>; 4]>,
    /// The storages written, with the element each write starts at.
    pub outs: SmallVec<[(&'a Arc<Storage>, usize); 3]>,
}

impl MultiPart<'_> {
    /// The fault of the first poisoned input, as [`Kernel::input_fault`].
    pub(crate) fn input_fault(&self) -> Option<crate::Error> {
        self.inputs.iter().flatten().find_map(|i| i.storage.fault())
    }
}

/// An op that writes several storages of one device, for many operands at
/// once: a multi-tensor optimizer step (PyTorch's `foreach`/fused
/// optimizers) updates every parameter, and makes its new state, in one
/// CUDA launch instead of one or more per parameter. A backend that has no
/// such launch declines ([`Backend::launch_multi`]), and the op runs its
/// single-output kernels part by part instead, with the same values.
pub(crate) trait MultiKernel: Send + Sync {
    /// The op's name, as errors report it.
    fn name(&self) -> &'static str;
    /// Launches the op over `parts` (all on `dev`, none with a poisoned
    /// input) through `dev`.
    fn cuda(&self, dev: &dyn cuda::CudaDevice, parts: &[&MultiPart<'_>]) -> Result<()>;
}

// ------------------------------------------------------------ the backend --
// What a device must provide (memory, kernel launches, transfers, events):
// one implementation per folder of `backends/`. It lives here, beside the
// kernel it launches, because storages and communicators name it and it
// names them.

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
    /// Runs `kernel` over `parts` (every operand on this device) in as few
    /// launches as it can, when this backend has a launch for it (CUDA):
    /// `Ok(true)` once queued. `Ok(false)`, having done nothing, where it
    /// has none (the CPU and the simulated GPUs run kernels one by one at
    /// no launch cost): the caller then runs the op part by part.
    fn launch_multi(&self, _kernel: &dyn MultiKernel, _parts: &[MultiPart<'_>]) -> Result<bool> {
        Ok(false)
    }
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
    /// Communicators across processes on this backend's devices (NCCL on
    /// CUDA), or why there are none; the engine `dist` uses for tensors on
    /// such a device, never staged through the host.
    fn process_comms(&self) -> std::result::Result<&'static dyn crate::kernel::comm::ProcessComms, String> {
        Err(format!("{} has no communicator across processes", self.kind()))
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
