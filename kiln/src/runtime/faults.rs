//! Failures injected by tests: the next kernel on a device fails on
//! purpose, to check how failures are reported on each kind of device.

use crate::base::device::Device;

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
