//! Running kernels over host memory, shared by the CPU and the simulated
//! GPUs (which run them on their own worker thread with `threads = 1`):
//! lock the operands, call the op's host kernel, report a failure (or a
//! panic, a kiln bug) as an error naming the op. The ops' element loops are
//! in `loops.rs`, their arithmetic in `num.rs`.

mod dense;
pub(crate) mod loops;
pub(crate) mod num;
pub(crate) mod small_sgemm;

pub(crate) use dense::run_dense_small;

use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::base::device::Device;
use crate::base::error::{Error, Result};
use crate::base::shape::Layout;
use crate::kernel::storage::{OperandLocks, Storage};
use crate::kernel::{HostIn, Kernel, Out, Src};
use crate::map_buffer;
use crate::runtime::memory::try_vec;
use smallvec::SmallVec;

/// Runs one kernel to completion on this thread (and kiln's pool when
/// `threads > 1`). Every lock the kernel needs is taken at once, in the
/// global order of [`OperandLocks`], so kernels on different threads cannot
/// deadlock. A kernel whose output (or in-place source) has no elements does
/// nothing: it never walks the dimensions of an empty tensor, however large
/// the others are.
pub(crate) fn run(kernel: &Kernel<'_>, out: Out<'_>, threads: usize) -> Result<()> {
    if kernel.writes_nothing(out.len()) {
        return Ok(());
    }
    match kernel {
        Kernel::Unary { op, src } => {
            let mut locks = OperandLocks::new(&[&src.storage], out)?;
            let (inputs, w) = locks.split();
            if !op.host(inputs.host(0), &src.layout, w, threads) {
                return Err(unsupported(kernel));
            }
        }
        Kernel::Binary { op, lhs, rhs } => {
            let mut locks = OperandLocks::new(&[&lhs.storage, &rhs.storage], out)?;
            let (inputs, w) = locks.split();
            if !op.host(inputs.host(0), &lhs.layout, inputs.host(1), &rhs.layout, w, threads) {
                return Err(unsupported(kernel));
            }
        }
        Kernel::Reduce { op, src, dims } => {
            let mut locks = OperandLocks::new(&[&src.storage], out)?;
            let (inputs, w) = locks.split();
            if !op.host(inputs.host(0), &src.layout, dims, w, threads) {
                return Err(unsupported(kernel));
            }
        }
        Kernel::Custom { op, inputs } => {
            // An input that shares the output's storage (a copy between views
            // of one storage, `index_add` of itself) is read out first: no
            // lock is held twice, and overlapping views read the values they
            // had before the call.
            let aliased = |s: &Src<'_>| matches!(&out, Out::Storage(o) if std::ptr::eq(&**s.storage, *o));
            let mut gathered: SmallVec<[(usize, CpuBuffer, Layout); 1]> = SmallVec::new();
            let mut locked: SmallVec<[&Storage; 3]> = SmallVec::new();
            for (i, s) in inputs.iter().enumerate() {
                if aliased(s) {
                    gathered.push((i, try_gather(s)?, Layout::contiguous(s.layout.shape().clone())));
                } else {
                    locked.push(&**s.storage);
                }
            }
            let mut locks = OperandLocks::new(&locked, out)?;
            let (held, w) = locks.split();
            // Push loops: this is on every custom kernel's launch, and
            // `gathered` is empty in the common case.
            let mut ins: SmallVec<[HostIn<'_>; 3]> = SmallVec::new();
            let mut next = 0;
            for (i, s) in inputs.iter().enumerate() {
                match gathered.iter().find(|(j, ..)| *j == i) {
                    Some((_, buf, layout)) => ins.push(HostIn { buf, layout }),
                    None => {
                        ins.push(HostIn { buf: held.host(next), layout: &s.layout });
                        next += 1;
                    }
                }
            }
            op.host(&ins, w, threads)?;
        }
    }
    Ok(())
}

/// [`run`], with any failure (an error, or a panic: a kiln bug) reported as
/// an error naming the kernel and `device`, so no panic crosses the API or
/// kills a device's worker.
pub(crate) fn run_caught(kernel: &Kernel<'_>, out: Out<'_>, threads: usize, device: Device) -> Result<()> {
    if crate::runtime::faults::take_injected_failure(device) {
        return Err(Error::KernelFailed { device, op: kernel.name().to_string(), msg: "a failure injected by a test".into() });
    }
    caught(|| kernel.name(), device, || run(kernel, out, threads))
}

/// [`try_gather`], with failures reported as [`run_caught`] does.
pub(crate) fn gather_caught(src: &Src<'_>, device: Device) -> Result<CpuBuffer> {
    caught(|| "read", device, || try_gather(src))
}

/// Runs `f`, turning a panic into `KernelFailed` naming the kernel (`op` is
/// only asked for on failure: naming costs time on every launch otherwise).
#[inline]
fn caught<T>(op: impl FnOnce() -> &'static str, device: Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(Error::KernelFailed { msg, .. })) => Err(Error::KernelFailed { device, op: op().to_string(), msg }),
        Ok(Err(err)) => Err(err),
        Err(panic) => {
            let op = op();
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::KernelFailed { device, op: op.to_string(), msg: format!("panicked: {msg} (a kiln bug: please report it)") })
        }
    }
}

/// A kernel given dtypes the front end should have refused: a kiln bug,
/// reported as an error rather than a panic on a device's queue.
pub(crate) fn unsupported(kernel: &Kernel) -> Error {
    unsupported_op(kernel.name())
}

/// [`unsupported`] for an op by name.
pub(crate) fn unsupported_op(op: &str) -> Error {
    Error::KernelFailed {
        device: Device::Cpu,
        op: op.to_string(),
        msg: "the host kernel has no implementation for these dtypes (a kiln bug: please report it)".into(),
    }
}

/// The view's elements, contiguous, in a new host buffer (read under the
/// storage's read lock); `OutOfMemory` when the host cannot hold them.
pub(crate) fn try_gather(src: &Src) -> Result<CpuBuffer> {
    let r = src.storage.read();
    gather_view(r.host(), &src.layout)
}

/// The elements of `layout`'s view of `buf`, contiguous, in a new buffer.
pub(crate) fn gather_view(buf: &CpuBuffer, layout: &Layout) -> Result<CpuBuffer> {
    let len = layout.elem_count();
    if len == 0 {
        return Ok(CpuBuffer::zeros(buf.dtype(), 0));
    }
    if let Some((a, b)) = layout.contiguous_range() {
        return Ok(map_buffer!(buf, v => {
            let mut out = try_vec(b - a)?;
            out.extend_from_slice(&v[a..b]);
            WithDType::into_buffer(out)
        }));
    }
    Ok(map_buffer!(buf, v => {
        let mut out = try_vec(len)?;
        out.extend(layout.offsets().map(|i| v[i]));
        WithDType::into_buffer(out)
    }))
}
