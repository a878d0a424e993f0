//! # kiln
//!
//! Tensors that live on a device (the CPU, a CUDA GPU, or a simulated GPU),
//! where data moves between devices only when the program says so. kiln
//! implements, for Rust, the device model of the "GPUs" chapter of *Dive
//! into Deep Learning*.
//!
//! ```
//! use kiln::{Tensor, DType, cpu, try_gpu};
//!
//! let x = Tensor::new(&[1f32, 2., 3.], &cpu())?;
//! assert_eq!(x.device(), cpu());
//!
//! // On the first GPU if there is one, else on the CPU.
//! let dev = try_gpu(0);
//! let a = Tensor::ones((2, 3), DType::F32, &dev)?;
//! let b = Tensor::rand((2, 3), &dev)?;
//! let c = (&a + &b)?;
//! assert_eq!(c.device(), dev);
//!
//! // Operands on different devices are an error, never a silent copy.
//! if dev != cpu() {
//!     assert!(matches!(&a + &x, Err(kiln::Error::DeviceMismatch { .. })));
//! }
//! # Ok::<(), kiln::Error>(())
//! ```
#![warn(missing_docs)]

// The layers, bottom up (ARCHITECTURE.md; `tests/layers.rs` checks that no
// module imports one above it): base → runtime → kernel → backends →
// registry → tensor → autograd → ops → nn, data, comm → optim, dist,
// checkpoint, io → trainer.
mod autograd;
mod backends;
mod base;
pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod dist;
#[doc(hidden)]
pub mod host_nn;
pub mod io;
mod kernel;
pub mod models;
pub mod nn;
mod ops;
pub mod optim;
mod registry;
mod runtime;
pub mod sim;
mod tensor;
pub mod trainer;

pub use autograd::{is_grad_enabled, no_grad, NoGradGuard};
pub use backends::cuda::census::{census_table, LaunchRecord};
pub use backends::sim::{DEFAULT_SIM_GPU_MEMORY, MAX_SIM_GPUS};
pub use base::buffer::CpuBuffer;
pub use base::buffer::WithDType;
pub use base::device::{cpu, gpu, Device, DeviceInfo, DeviceKind, FallbackReason};
pub use base::dtype::DType;
pub use base::env::{env_flag, parse_bytes};
pub use base::error::{human_bytes, Direction, Error, HostLimit, Result};
pub use base::shape::{Layout, Shape};
pub use host_nn::InterpMode;
pub use kernel::QueueHold;
pub use ops::binary::BinaryOp;
pub use ops::conv::{Conv2dArgs, ConvPadding, Pair};
pub use ops::custom::{custom_op, CudaArg, CudaLaunch, CustomOp, HostInput, HostOutput, Operand};
pub use ops::pool::Pool2dArgs;
pub use ops::reduce::Reduction;
pub use ops::slicing::{Selector, TensorIndex};
pub use ops::unary::UnaryOp;
#[doc(hidden)]
pub use registry::hold_queue;
pub use registry::{
    add_simulated_gpus, default_device, default_device_scope, devices, empty_cache, ensure_simulated_gpus, memory_stats, num_gpus,
    reset_peak_memory, synchronize, take_launch_census, try_all_gpus, try_ensure_simulated_gpus, try_gpu, why_no_cuda_device, why_not_gpu,
    DefaultDeviceGuard,
};
#[doc(hidden)]
pub use runtime::faults::inject_kernel_failure;
#[doc(hidden)]
pub use runtime::fork::busy_threads;
#[doc(hidden)]
pub use runtime::ledger::{__site_scope, SiteScope};
pub use runtime::ledger::{
    reset_transfer_stats, thread_transfer_stats, transfer_guard, transfer_guard_for, transfer_stats, GuardLevel, TransferCount,
    TransferGuard, TransferStats,
};
pub use runtime::memory::MemoryStats;
pub use runtime::rng::{manual_seed, philox4x32};
pub use tensor::{Dim, HostData, Tensor};

/// `std::println!` whose tensor reads are booked in the transfer ledger at
/// the line of the macro call (plain `println!("{t}")` books them inside
/// kiln's `Display` implementation, which cannot see its caller).
///
/// ```
/// use kiln::{Tensor, DType, try_gpu};
/// let x = Tensor::ones((2,), DType::F32, &try_gpu(0))?;
/// kiln::println!("x = {x}");
/// # Ok::<(), kiln::Error>(())
/// ```
#[macro_export]
macro_rules! println {
    ($($arg:tt)*) => {{
        let _site = $crate::__site_scope();
        ::std::println!($($arg)*);
    }};
}

/// The README's examples, run as doctests so that they stay true.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The examples of docs/TRAINING.md, run as doctests.
#[doc = include_str!("../../docs/TRAINING.md")]
#[cfg(doctest)]
pub struct TrainingDoctests;

/// The examples of docs/MULTI_GPU.md, run as doctests.
#[doc = include_str!("../../docs/MULTI_GPU.md")]
#[cfg(doctest)]
pub struct MultiGpuDoctests;

/// The examples of docs/DISTRIBUTED.md, run as doctests.
#[doc = include_str!("../../docs/DISTRIBUTED.md")]
#[cfg(doctest)]
pub struct DistributedDoctests;

/// The examples of docs/CUSTOM_OPS.md, run as doctests.
#[doc = include_str!("../../docs/CUSTOM_OPS.md")]
#[cfg(doctest)]
pub struct CustomOpsDoctests;

/// The CUDA kernel sources and NVRTC access, for the compile check
/// (`tests/cuda/`, `.ci/cuda-check.sh`): every module the backend may
/// compile, exactly as it compiles it.
#[doc(hidden)]
pub mod cuda_check {
    pub use crate::backends::cuda::modules::check::{compile_ptx, driver_present, nvrtc_options, nvrtc_version};

    /// `(module, full CUDA C++ source)` of every module an op declares.
    pub fn kernel_sources() -> Vec<(String, String)> {
        crate::kernel::cuda::declared_modules()
            .into_iter()
            .map(|m| (m.name.to_string(), crate::backends::cuda::modules::check::module_source(m)))
            .collect()
    }
}
