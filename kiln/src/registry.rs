//! Which devices exist: the registry of backends behind `cpu()` and
//! `gpu(i)`, and the chapter's `num_gpus()`, `try_gpu(i)`, `try_all_gpus()`,
//! `devices()`, `synchronize`, memory statistics and the default device.
//! GPUs are numbered real ones first (CUDA), then simulated ones.

use crate::backends::cpu::CPU;
use crate::backends::sim::{self, MAX_SIM_GPUS};
use crate::backends::GPU_BACKENDS;
use crate::base::device::{Device, DeviceInfo, DeviceKind, FallbackReason};
use crate::base::error::{Error, Result};
use crate::kernel::{Backend, QueueHold};
use crate::runtime::host::host_memory_total;
use crate::runtime::memory::MemoryStats;
use std::sync::{OnceLock, RwLock};

impl Device {
    /// Whether the device exists on this machine.
    pub fn exists(&self) -> bool {
        backend(*self).is_ok()
    }
    /// Memory statistics of this device.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        Ok(backend(*self)?.pool().stats())
    }
}

/// What the registry holds: the CPU, and the GPUs the backends of
/// [`GPU_BACKENDS`] found (probed once, in order; simulated GPUs may be
/// added later). Backends are created once and never dropped: storages and
/// kernels refer to them as `&'static dyn Backend`, without reference counts.
struct Registry {
    cpu: &'static dyn Backend,
    /// Why each backend found no device, by backend name.
    absent: Vec<(&'static str, FallbackReason)>,
    gpus: RwLock<Vec<&'static dyn Backend>>,
}

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut gpus: Vec<&'static dyn Backend> = Vec::new();
        let mut absent = Vec::new();
        for b in GPU_BACKENDS {
            let found = (b.probe)(gpus.len());
            gpus.extend(found.backends);
            if let Some(why) = found.absent {
                absent.push((b.name, why));
            }
        }
        Registry { cpu: &CPU, absent, gpus: RwLock::new(gpus) }
    })
}

/// Adds GPUs made by `make(first_index, existing)` to the registry (under
/// its lock, so that indices stay dense), returning what `make` returns:
/// how devices added on demand (the simulated GPUs) come to exist.
fn add_gpus<R>(make: impl FnOnce(&mut Vec<&'static dyn Backend>) -> R) -> R {
    let mut gpus = registry().gpus.write().unwrap_or_else(|e| e.into_inner());
    make(&mut gpus)
}

/// Makes sure at least `n` simulated GPUs exist, adding them with `capacity`
/// bytes each when fewer do, and returns their devices. Independent of the
/// environment, so tests can call it; adding is permanent for the process.
/// At most [`MAX_SIM_GPUS`] simulated GPUs exist: a larger `n` gives that many
/// (see [`try_ensure_simulated_gpus`] for an error instead).
///
/// ```
/// let sims = kiln::ensure_simulated_gpus(2, 256 << 20);
/// assert_eq!(sims.len(), 2);
/// assert!(kiln::num_gpus() >= 2);
/// ```
pub fn ensure_simulated_gpus(n: usize, capacity: usize) -> Vec<Device> {
    add_gpus(|gpus| sim::add_simulated(gpus, n.min(MAX_SIM_GPUS), capacity))
}

/// Like [`ensure_simulated_gpus`], but asking for more than [`MAX_SIM_GPUS`]
/// is an error rather than capped.
///
/// ```
/// assert!(kiln::try_ensure_simulated_gpus(100_000, 1 << 20).is_err());
/// assert_eq!(kiln::try_ensure_simulated_gpus(1, 256 << 20)?.len(), 1);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn try_ensure_simulated_gpus(n: usize, capacity: usize) -> Result<Vec<Device>> {
    if n > MAX_SIM_GPUS {
        return Err(Error::invalid(
            "simulated GPUs",
            format!(
                "{n} simulated GPUs asked for, at most {MAX_SIM_GPUS} are supported; e.g. `kiln::ensure_simulated_gpus(2, kiln::DEFAULT_SIM_GPU_MEMORY)`"
            ),
        ));
    }
    Ok(add_gpus(|gpus| sim::add_simulated(gpus, n, capacity)))
}

/// Adds `n` new simulated GPUs of `capacity` bytes each, whatever exist
/// already, and returns them, reserved for the caller: no other call of
/// this function, and no call of [`ensure_simulated_gpus`], hands them out.
/// For a test that measures memory exactly while other threads use
/// simulated GPUs of their own (counting what exists, then asking
/// [`ensure_simulated_gpus`] for more, races with them). More than
/// [`MAX_SIM_GPUS`] simulated GPUs in all is an error, and adds none.
///
/// ```
/// let mine = kiln::add_simulated_gpus(1, 64 << 20)?;
/// assert_eq!(mine[0].memory_stats()?.capacity, Some(64 << 20));
/// assert!(!kiln::add_simulated_gpus(1, 64 << 20)?.contains(&mine[0]));
/// assert!(!kiln::ensure_simulated_gpus(4, 256 << 20).contains(&mine[0]));
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn add_simulated_gpus(n: usize, capacity: usize) -> Result<Vec<Device>> {
    add_gpus(|gpus| {
        let have = sim::simulated_count(gpus);
        if have.saturating_add(n) > MAX_SIM_GPUS {
            return Err(Error::invalid(
                "simulated GPUs",
                format!("{have} simulated GPUs exist and {n} more were asked for; at most {MAX_SIM_GPUS} are supported"),
            ));
        }
        Ok(sim::add_reserved(gpus, n, capacity))
    })
}

/// Why the GPU backend `name` found no device, if it found none.
fn why_absent(name: &str) -> Option<FallbackReason> {
    registry().absent.iter().find(|(n, _)| *n == name).map(|(_, why)| why.clone())
}

pub(crate) fn backend(device: Device) -> Result<&'static dyn Backend> {
    let reg = registry();
    match device {
        Device::Cpu => Ok(reg.cpu),
        Device::Gpu(i) => {
            let gpus = reg.gpus.read().unwrap_or_else(|e| e.into_inner());
            gpus.get(i).copied().ok_or_else(|| Error::NoSuchDevice { device, available: all_devices(&gpus) })
        }
    }
}

fn all_devices(gpus: &[&'static dyn Backend]) -> Vec<Device> {
    std::iter::once(Device::Cpu).chain((0..gpus.len()).map(Device::Gpu)).collect()
}

/// The number of GPUs: real ones plus simulated ones.
///
/// ```
/// // Without a GPU and without KILN_SIM_GPUS this is 0.
/// let n = kiln::num_gpus();
/// assert_eq!(kiln::try_all_gpus().len(), n.max(1));
/// ```
pub fn num_gpus() -> usize {
    registry().gpus.read().unwrap_or_else(|e| e.into_inner()).len()
}

/// `gpu(i)` if it exists, otherwise the CPU (the chapter's `try_gpu`).
/// [`why_not_gpu`] says why it fell back.
///
/// ```
/// let d = kiln::try_gpu(10);
/// if kiln::num_gpus() < 11 {
///     assert_eq!(d, kiln::cpu());
/// }
/// ```
pub fn try_gpu(i: usize) -> Device {
    if i < num_gpus() {
        Device::Gpu(i)
    } else {
        Device::Cpu
    }
}

/// Why `try_gpu(i)` falls back to the CPU, or `None` when `gpu(i)` exists.
///
/// ```
/// if kiln::num_gpus() == 0 {
///     println!("{}", kiln::why_not_gpu(0).unwrap());
/// }
/// ```
pub fn why_not_gpu(i: usize) -> Option<FallbackReason> {
    let count = num_gpus();
    if i < count {
        return None;
    }
    if count > 0 {
        return Some(FallbackReason::IndexOutOfRange { index: i, count });
    }
    // No GPU at all: the first backend's reason (a real GPU was looked for first).
    Some(registry().absent.first().map(|(_, why)| why.clone()).unwrap_or(FallbackReason::IndexOutOfRange { index: i, count }))
}

/// Why there is no CUDA device, or None when there is one. Unlike
/// [`why_not_gpu`], it answers also when simulated GPUs are present.
///
/// ```
/// if !kiln::devices().iter().any(|d| d.kind == kiln::DeviceKind::Cuda) {
///     assert!(kiln::why_no_cuda_device().is_some());
/// }
/// ```
pub fn why_no_cuda_device() -> Option<FallbackReason> {
    why_absent("cuda")
}

/// Every GPU, or `[cpu()]` when there is none (the chapter's documented
/// contract, so that code written for GPUs still runs).
pub fn try_all_gpus() -> Vec<Device> {
    let n = num_gpus();
    if n == 0 {
        vec![Device::Cpu]
    } else {
        (0..n).map(Device::Gpu).collect()
    }
}

/// One record per device: name, kind, memory total, free and in use by kiln.
///
/// ```
/// let list = kiln::devices();
/// assert_eq!(list[0].device, kiln::cpu());
/// ```
pub fn devices() -> Vec<DeviceInfo> {
    let reg = registry();
    let gpus = reg.gpus.read().unwrap_or_else(|e| e.into_inner()).clone();
    std::iter::once(reg.cpu).chain(gpus).map(info).collect()
}

fn info(b: &dyn Backend) -> DeviceInfo {
    let stats = b.pool().stats();
    let memory_total = match b.kind() {
        DeviceKind::Cpu => host_memory_total(),
        _ => stats.capacity,
    };
    DeviceInfo {
        device: b.device(),
        name: b.name(),
        kind: b.kind(),
        memory_total,
        memory_free: b.driver_free_memory(),
        memory_in_use: stats.in_use,
        details: with_collectives(b),
    }
}

/// The backend's facts, and how collectives run on its device: through its
/// communicator, or (GPUs without one) peer copies, with the reason.
fn with_collectives(b: &dyn Backend) -> Vec<(String, String)> {
    let mut details = b.details();
    if b.kind() != DeviceKind::Cpu {
        let how = match (b.communicator(), b.why_no_communicator()) {
            (Some(c), _) => c.name(),
            (None, Some(why)) => format!("peer copies and kernels ({why})"),
            (None, None) => "peer copies and kernels".into(),
        };
        details.push(("collectives".into(), how));
    }
    details
}

/// Memory statistics of a device: in use, peak, live tensors, capacity.
pub fn memory_stats(device: &Device) -> Result<MemoryStats> {
    device.memory_stats()
}

/// Restarts peak tracking of a device at its current use.
pub fn reset_peak_memory(device: &Device) -> Result<()> {
    backend(*device)?.pool().reset_peak();
    Ok(())
}

/// Frees the buffers kiln keeps for reuse on a device.
///
/// On a CUDA device with cached blocks this waits for all the device's
/// queued work, as `torch.cuda.empty_cache` does: freeing device memory
/// synchronises a CUDA device. Buffers given back to the cache while it
/// waits stay cached.
///
/// ```
/// let x = kiln::Tensor::zeros(1000, kiln::DType::F32, &kiln::cpu())?;
/// drop(x);
/// kiln::empty_cache(&kiln::cpu())?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn empty_cache(device: &Device) -> Result<()> {
    backend(*device)?.empty_cache()
}

/// Waits until all work submitted to `device` has run (the chapter's
/// `torch.cuda.synchronize`).
pub fn synchronize(device: &Device) -> Result<()> {
    backend(*device)?.synchronize()
}

thread_local! {
    static DEFAULT_DEVICE: std::cell::Cell<Device> = const { std::cell::Cell::new(Device::Cpu) };
}

/// The device that code which names none uses on this thread: the CPU unless
/// a [`default_device_scope`] is active.
pub fn default_device() -> Device {
    DEFAULT_DEVICE.with(|d| d.get())
}

/// Restores the previous default device when dropped.
#[must_use = "the scope ends when this guard is dropped"]
pub struct DefaultDeviceGuard {
    previous: Device,
}

impl Drop for DefaultDeviceGuard {
    fn drop(&mut self) {
        DEFAULT_DEVICE.with(|d| d.set(self.previous));
    }
}

/// Makes `device` the default for this thread until the guard drops (the
/// chapter's `with mx.Context(...)`, `jax.default_device(...)`). Fails with
/// `NoSuchDevice` when the device does not exist.
///
/// ```
/// use kiln::{cpu, default_device, default_device_scope};
/// {
///     let _scope = default_device_scope(cpu())?;
///     assert_eq!(default_device(), cpu());
/// }
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn default_device_scope(device: Device) -> Result<DefaultDeviceGuard> {
    backend(device)?;
    let previous = DEFAULT_DEVICE.with(|d| d.replace(device));
    Ok(DefaultDeviceGuard { previous })
}

/// Stops `device`'s queue after the work submitted so far until the hold is
/// dropped, so that tests can observe asynchronous execution without timing:
/// operations still return while the queue is held. `None` on a synchronous
/// device (the CPU).
///
/// ```
/// let hold = kiln::hold_queue(&kiln::cpu())?;
/// assert!(hold.is_none());
/// # Ok::<(), kiln::Error>(())
/// ```
#[doc(hidden)]
pub fn hold_queue(device: &Device) -> Result<Option<QueueHold>> {
    backend(*device)?.hold_queue()
}

/// Takes (and clears) the CUDA simulator's launch census: every kernel and
/// cuBLAS gemm that completed since the last call, in completion order,
/// each with its threads and the serial work of its busiest thread (see
/// [`LaunchRecord`](crate::LaunchRecord)). Synchronizes every CUDA device
/// first, so work already queued is included.
///
/// An error when the process does not run on the CUDA simulator with
/// `KILN_CUDASIM_CENSUS=1` (a real GPU has no census).
///
/// ```
/// // Without the simulator there is no census, and the error says how to get one.
/// if kiln::num_gpus() == 0 {
///     let e = kiln::take_launch_census().unwrap_err();
///     assert!(e.to_string().contains("KILN_CUDASIM_CENSUS=1"));
/// }
/// ```
pub fn take_launch_census() -> Result<Vec<crate::LaunchRecord>> {
    for d in devices() {
        if d.kind == DeviceKind::Cuda {
            synchronize(&d.device)?;
        }
    }
    crate::backends::cuda::census::take_records()
}
