//! The chapter's device vocabulary: `cpu()`, `gpu(i)`, `num_gpus()`,
//! `try_gpu(i)`, `try_all_gpus()`, and the registry of backends behind them.
//! GPUs are numbered real ones first (CUDA), then simulated ones.

use crate::backend::cpu::CPU;
use crate::backend::sim::SimBackend;
use crate::backend::Backend;
use crate::memory::{parse_bytes, MemoryStats};
use crate::{Error, Result};
use std::sync::{OnceLock, RwLock};

/// Where a tensor lives: the CPU or the i-th GPU. Naming a device never
/// fails; using one that does not exist returns [`Error::NoSuchDevice`].
///
/// ```
/// use kiln::{cpu, gpu, Device};
/// assert_eq!(cpu().to_string(), "cpu");
/// assert_eq!(gpu(1).to_string(), "gpu(1)");
/// assert_eq!(gpu(0), Device::Gpu(0));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Device {
    /// Host memory and all CPU cores.
    #[default]
    Cpu,
    /// The i-th GPU (real ones first, then simulated ones).
    Gpu(usize),
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Gpu(i) => write!(f, "gpu({i})"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = Error;
    /// Parses `cpu`, `gpu`, `gpu(1)`, `gpu:1`, `cuda:1`, and TensorFlow's `/CPU:0`,
    /// `/GPU:1`, `/device:GPU:1`.
    fn from_str(s: &str) -> Result<Device> {
        let t = s.trim().to_ascii_lowercase();
        // TensorFlow's `/CPU:0`, `/GPU:1` and `/device:GPU:1` name the same devices.
        let t = t.strip_prefix('/').unwrap_or(&t);
        let t = t.strip_prefix("device:").unwrap_or(t);
        if matches!(t, "cpu" | "cpu:0" | "cpu(0)") {
            return Ok(Device::Cpu);
        }
        for prefix in ["gpu", "cuda"] {
            if let Some(rest) = t.strip_prefix(prefix) {
                let rest = rest.trim_start_matches([':', '(']).trim_end_matches(')');
                if rest.is_empty() {
                    return Ok(Device::Gpu(0));
                }
                if let Ok(i) = rest.parse() {
                    return Ok(Device::Gpu(i));
                }
            }
        }
        Err(Error::invalid("device", format!("`{s}` is not a device; write `cpu`, `gpu`, `gpu(1)` or `gpu:1`")))
    }
}

impl Device {
    /// True for the CPU.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }
    /// True for a GPU (real or simulated).
    pub fn is_gpu(&self) -> bool {
        matches!(self, Device::Gpu(_))
    }
    /// Whether the device exists on this machine.
    pub fn exists(&self) -> bool {
        backend(*self).is_ok()
    }
    /// Memory statistics of this device.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        Ok(backend(*self)?.pool().stats())
    }
}

/// The CPU device.
pub fn cpu() -> Device {
    Device::Cpu
}

/// The i-th GPU. This only names it: using it when it does not exist is an
/// error, see [`try_gpu`].
pub fn gpu(i: usize) -> Device {
    Device::Gpu(i)
}

/// What kind of hardware stands behind a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// The host CPU.
    Cpu,
    /// An NVIDIA GPU through CUDA.
    Cuda,
    /// A simulated GPU: host RAM with its own capacity and queue.
    Simulated,
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Simulated => "simulated",
        })
    }
}

/// One line of [`devices()`]: what a device is and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device.
    pub device: Device,
    /// Human-readable name (CPU model, GPU name).
    pub name: String,
    /// CPU, CUDA or simulated.
    pub kind: DeviceKind,
    /// Total memory, where known (host RAM for the CPU).
    pub memory_total: Option<usize>,
    /// Free memory as the driver or the OS reports it, where known.
    pub memory_free: Option<usize>,
    /// kiln's own use: bytes held by live tensors.
    pub memory_in_use: usize,
    /// Extra facts (compute capability, driver version), as key/value pairs.
    pub details: Vec<(String, String)>,
}

/// Why [`try_gpu`] fell back to the CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FallbackReason {
    /// kiln was built without any GPU backend.
    NoGpuBackendBuilt,
    /// No CUDA driver library (libcuda.so) could be loaded.
    DriverNotFound,
    /// The driver loaded but reported no device (or failed to start).
    NoDevice(String),
    /// There are GPUs, but fewer than asked for.
    IndexOutOfRange {
        /// The index asked for.
        index: usize,
        /// How many GPUs exist.
        count: usize,
    },
}

impl std::fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FallbackReason::NoGpuBackendBuilt => f.write_str("kiln was built without a GPU backend"),
            FallbackReason::DriverNotFound => {
                f.write_str("no CUDA driver library found (libcuda.so); set KILN_SIM_GPUS=2 to simulate GPUs")
            }
            FallbackReason::NoDevice(why) => write!(f, "the CUDA driver reports no usable device: {why}"),
            FallbackReason::IndexOutOfRange { index, count } => {
                write!(f, "gpu({index}) asked for, but this machine has {count} GPU(s)")
            }
        }
    }
}

/// The most simulated GPUs a process can have (`KILN_SIM_GPUS`,
/// `--sim-gpus`, [`ensure_simulated_gpus`]): each has a worker thread, and a
/// multi-GPU program on more than this many simulated devices tests nothing
/// that 64 do not.
pub const MAX_SIM_GPUS: usize = 64;

/// Reads a setting from the environment. A malformed value is ignored with
/// one line on stderr that names the variable, the value and what was
/// expected, the same way for every kiln setting (once per variable and
/// value in a process, however often it is read); unset or blank is `None`.
pub(crate) fn env_setting<T>(name: &str, expected: &str, parse: impl Fn(&str) -> Option<T>) -> Option<T> {
    let raw = std::env::var_os(name)?;
    let text = raw.to_string_lossy();
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return None;
    }
    let parsed = parse(trimmed);
    if parsed.is_none() {
        static WARNED: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());
        let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
        let key = (name.to_string(), text.to_string());
        if !warned.contains(&key) {
            eprintln!("kiln: ignoring {name}={text:?}: expected {expected}");
            warned.push(key);
        }
    }
    parsed
}

/// What a boolean setting accepts, as the warning for a malformed one says.
const FLAG_EXPECTED: &str = "1 or 0 (also true/false, yes/no, on/off)";

/// Parses a boolean setting: `1`, `true`, `yes`, `on` or `0`, `false`, `no`,
/// `off`, in any case.
fn parse_flag(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Reads a boolean setting from the environment, the way kiln reads all of
/// its flags (`KILN_DISABLE_CUDA`, `KILN_CUDA_TF32`, `KILN_NO_KERNEL_CACHE`,
/// and the `kiln` command's `KILN_BENCH_QUICK`): `1`/`true`/`yes`/`on` or
/// `0`/`false`/`no`/`off` in any case; unset or blank is `None`. Anything
/// else is ignored (`None`) with the one warning line every malformed kiln
/// setting gives, `kiln: ignoring NAME="value": expected ...`, printed once
/// per process.
///
/// ```
/// // Unset (and blank) settings are None.
/// assert_eq!(kiln::env_flag("KILN_DOCTEST_FLAG_THAT_IS_NEVER_SET"), None);
/// ```
pub fn env_flag(name: &str) -> Option<bool> {
    env_setting(name, FLAG_EXPECTED, parse_flag)
}

#[cfg(test)]
mod flag_tests {
    use super::parse_flag;

    #[test]
    fn flags_parse_in_every_accepted_spelling_and_nothing_else() {
        for v in ["1", "true", "TRUE", "Yes", "on"] {
            assert_eq!(parse_flag(v), Some(true), "{v}");
        }
        for v in ["0", "false", "False", "NO", "off"] {
            assert_eq!(parse_flag(v), Some(false), "{v}");
        }
        for v in ["2", "enable", "y", "t", "-1", "1.0", "tru"] {
            assert_eq!(parse_flag(v), None, "{v}");
        }
    }
}

/// Default capacity of a simulated GPU.
pub const DEFAULT_SIM_GPU_MEMORY: usize = 2 << 30;

/// The status of the real-GPU backend, decided once per process.
pub(crate) struct RealGpus {
    pub(crate) backends: Vec<&'static dyn Backend>,
    /// Why there are none, when there are none.
    pub(crate) absent: Option<FallbackReason>,
}

/// Backends are created once and never dropped: storages and kernels refer
/// to them as `&'static dyn Backend`, without reference counts.
struct Registry {
    cpu: &'static dyn Backend,
    real: RealGpus,
    gpus: RwLock<Vec<&'static dyn Backend>>,
}

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let real = crate::cuda_probe();
        let mut gpus = real.backends.clone();
        let count = env_setting("KILN_SIM_GPUS", &format!("a number of simulated GPUs from 0 to {MAX_SIM_GPUS}, e.g. 2"), |v| {
            v.parse::<usize>().ok().filter(|&n| n <= MAX_SIM_GPUS)
        })
        .unwrap_or(0);
        let capacity = env_setting("KILN_SIM_GPU_MEMORY", "a size such as 2GiB, 512MiB or 1000000", |v| parse_bytes(v).ok())
            .unwrap_or(DEFAULT_SIM_GPU_MEMORY);
        for s in 0..count {
            let index = gpus.len();
            gpus.push(Box::leak(Box::new(SimBackend::new(Device::Gpu(index), s, capacity))));
        }
        Registry { cpu: &CPU, real, gpus: RwLock::new(gpus) }
    })
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
    add_simulated_gpus(n.min(MAX_SIM_GPUS), capacity)
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
            format!("{n} simulated GPUs asked for, at most {MAX_SIM_GPUS} are supported; e.g. `kiln::ensure_simulated_gpus(2, kiln::DEFAULT_SIM_GPU_MEMORY)`"),
        ));
    }
    Ok(add_simulated_gpus(n, capacity))
}

fn add_simulated_gpus(n: usize, capacity: usize) -> Vec<Device> {
    let reg = registry();
    let mut gpus = reg.gpus.write().unwrap_or_else(|e| e.into_inner());
    let mut sims: Vec<Device> = gpus.iter().filter(|b| b.kind() == DeviceKind::Simulated).map(|b| b.device()).collect();
    while sims.len() < n {
        let index = gpus.len();
        let device = Device::Gpu(index);
        gpus.push(Box::leak(Box::new(SimBackend::new(device, sims.len(), capacity))));
        sims.push(device);
    }
    sims.truncate(n);
    sims
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
    Some(registry().real.absent.clone().unwrap_or(FallbackReason::IndexOutOfRange { index: i, count }))
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
    registry().real.absent.clone()
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
        details: b.details(),
    }
}

/// The host's RAM in bytes, where the OS reports it (`host_info.rs`).
pub(crate) fn host_memory_total() -> Option<usize> {
    crate::host_info::memory_total()
}

/// Host memory the OS could give without swapping.
pub(crate) fn host_memory_available() -> Option<usize> {
    crate::host_info::memory_available()
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
pub fn hold_queue(device: &Device) -> Result<Option<crate::backend::QueueHold>> {
    backend(*device)?.hold_queue()
}

/// Devices whose next kernel fails on purpose: bit 63 the CPU, bit i gpu(i).
static INJECTED_FAILURES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn failure_bit(device: Device) -> u64 {
    match device {
        Device::Cpu => 1 << 63,
        Device::Gpu(i) => 1 << i.min(62),
    }
}

/// Makes the next kernel that runs on `device` (the CPU or a simulated GPU)
/// fail, for tests of how failures are reported: at once on the CPU, at the
/// next synchronising call on an asynchronous device.
///
/// ```
/// use kiln::{cpu, Tensor, DType};
/// let x = Tensor::ones(3, DType::F32, &cpu())?;
/// kiln::inject_kernel_failure(&cpu());
/// assert!(matches!(x.exp(), Err(kiln::Error::KernelFailed { .. })));
/// assert!(x.exp().is_ok());
/// # Ok::<(), kiln::Error>(())
/// ```
#[doc(hidden)]
pub fn inject_kernel_failure(device: &Device) {
    INJECTED_FAILURES.fetch_or(failure_bit(*device), std::sync::atomic::Ordering::AcqRel);
}

/// True when a failure was injected for `device` and not yet taken (one
/// relaxed load: the CPU's dense path steps aside for the general one).
#[inline]
pub(crate) fn injected_failure_pending(device: Device) -> bool {
    INJECTED_FAILURES.load(std::sync::atomic::Ordering::Relaxed) & failure_bit(device) != 0
}

/// True (once) when a failure was injected for `device`.
pub(crate) fn take_injected_failure(device: Device) -> bool {
    use std::sync::atomic::Ordering;
    let bit = failure_bit(device);
    // One relaxed load on the hot path; the swap only when injected.
    INJECTED_FAILURES.load(Ordering::Relaxed) & bit != 0 && INJECTED_FAILURES.fetch_and(!bit, Ordering::AcqRel) & bit != 0
}
