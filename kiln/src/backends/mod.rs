//! The devices' implementations of the kernel contract, one folder each:
//! `cpu/` (synchronous, kiln's own thread pool), `sim/` (simulated GPUs: a
//! memory pool with a capacity and an in-order queue on a worker thread),
//! `cuda/` (NVIDIA GPUs through cudarc, loaded at run time). `host/` holds
//! what the CPU and the simulated GPUs share: locking the operands and
//! running an op's host kernel.
//!
//! A backend that brings GPUs is one line of [`GPU_BACKENDS`]: the registry
//! asks each, in order, for its devices (real GPUs are numbered first).

pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod host;
pub(crate) mod sim;

use crate::base::device::{Device, FallbackReason};
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::storage::Storage;
use crate::kernel::Backend;
use crate::kernel::{Kernel, MultiKernel, MultiPart, Out};
use std::sync::Arc;

/// What a GPU backend found on this machine: its devices, numbered from
/// `first` (the next free GPU index), or why it has none.
pub(crate) struct Found {
    pub backends: Vec<&'static dyn Backend>,
    /// Why there are none, when there are none.
    pub absent: Option<FallbackReason>,
}

/// A GPU backend: `probe(first)` opens its devices as `gpu(first)`,
/// `gpu(first + 1)`, ...
pub(crate) struct GpuBackend {
    /// The backend's name, as `kiln devices` reports it.
    pub name: &'static str,
    pub probe: fn(first: usize) -> Found,
}

/// The GPU backends, probed in this order when the registry is first used
/// (real GPUs first). The simulated GPUs' probe reads `KILN_SIM_GPUS`; more
/// can be added later (`ensure_simulated_gpus`).
pub(crate) const GPU_BACKENDS: &[GpuBackend] =
    &[GpuBackend { name: "cuda", probe: cuda::probe }, GpuBackend { name: "simulated", probe: sim::probe }];

/// Allocates a storage of `len` elements on `backend`.
pub(crate) fn alloc(backend: &'static dyn Backend, dtype: DType, len: usize) -> Result<Arc<Storage>> {
    alloc_on(backend, backend.device(), dtype, len)
}

/// [`alloc`] when the caller knows the device: the CPU is called directly
/// (see [`cpu::CPU`]), other devices through their backend.
#[inline]
pub(crate) fn alloc_on(backend: &'static dyn Backend, device: Device, dtype: DType, len: usize) -> Result<Arc<Storage>> {
    let buffer = if device == Device::Cpu { cpu::CPU.alloc(dtype, len)? } else { backend.alloc_buffer(dtype, len)? };
    Ok(Storage::new_on(backend, device, buffer, dtype, len))
}

/// Runs `kernel` into a new storage of `len` elements of `dtype` on `device`.
///
/// The hot path of every operation that makes a new tensor. On the CPU the
/// kernel runs at once into a plain buffer that nobody else can see, so the
/// output takes no lock, and the storage is made around the finished
/// buffer; elsewhere the storage is allocated first and the kernel is
/// launched (or enqueued) to write it.
#[inline]
pub(crate) fn run_new(
    backend: &'static dyn Backend,
    device: Device,
    kernel: &Kernel<'_>,
    dtype: DType,
    len: usize,
) -> Result<Arc<Storage>> {
    if device == Device::Cpu {
        let buffer = cpu::CPU.run_new(kernel, dtype, len)?;
        return Ok(Storage::new_on(backend, device, buffer, dtype, len));
    }
    let out = alloc_on(backend, device, dtype, len)?;
    backend.launch(kernel, &out)?;
    Ok(out)
}

/// Runs (or enqueues) `kernel` writing into the existing storage `out`, on
/// `out`'s device (the CPU directly).
#[inline]
pub(crate) fn launch_into(kernel: &Kernel<'_>, out: &Arc<Storage>) -> Result<()> {
    if out.device == Device::Cpu {
        cpu::CPU.run(kernel, Out::Storage(out))
    } else {
        out.backend.launch(kernel, out)
    }
}

/// Runs `kernel` over `parts` in as few launches as their device allows
/// (see [`Backend::launch_multi`]): `Ok(false)`, having done nothing, when
/// it has no such launch (the CPU, simulated GPUs) or the operands are not
/// all on one device; the caller then runs the op part by part.
pub(crate) fn launch_multi(kernel: &dyn MultiKernel, parts: &[MultiPart<'_>]) -> Result<bool> {
    let Some(&(first, _)) = parts.iter().find_map(|p| p.outs.first()) else { return Ok(true) };
    let device = first.device;
    let one_device = parts
        .iter()
        .all(|p| p.outs.iter().all(|(s, _)| s.device == device) && p.inputs.iter().flatten().all(|i| i.storage.device == device));
    if device == Device::Cpu || !one_device {
        return Ok(false);
    }
    first.backend.launch_multi(kernel, parts)
}
