//! The device vocabulary: `Device` (`cpu()`, `gpu(i)`), the kinds of
//! hardware, what `devices()` reports and why `try_gpu` may fall back.
//! Naming a device never touches a backend; which devices exist is the
//! registry's business (`registry.rs`).

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

impl Device {
    /// True for the CPU.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }
    /// True for a GPU (real or simulated).
    pub fn is_gpu(&self) -> bool {
        matches!(self, Device::Gpu(_))
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

/// What kind of hardware stands behind a device. New kinds may be added
/// (a backend is one folder of `kiln/src/backends`), so a `match` on it
/// needs a `_` arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
