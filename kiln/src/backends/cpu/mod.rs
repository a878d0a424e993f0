//! The CPU: host memory, kernels run at once on the calling thread, big
//! ones spread over kiln's own rayon pool (all cores, or `RAYON_NUM_THREADS`).

use super::host;
use crate::base::buffer::CpuBuffer;
use crate::base::device::{Device, DeviceKind};
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::storage::{Buffer, Storage};
use crate::kernel::{Backend, Event};
use crate::kernel::{Kernel, Out, Src};
use crate::runtime::memory::{MemoryPool, CPU_POOL};
use crate::runtime::pool::threads;
use std::sync::Arc;

pub(crate) struct CpuBackend {
    pool: &'static MemoryPool,
}

/// The CPU backend. A `static` rather than an entry made at run time, so
/// that the front end calls it directly (`backend::alloc_on`, `launch`,
/// `Storage::drop`): the hot path of small operations is then inlined
/// instead of going through the `Backend` trait object.
pub(crate) static CPU: CpuBackend = CpuBackend { pool: &CPU_POOL };

impl CpuBackend {
    /// Allocates and books a host buffer (static dispatch of `alloc_buffer`).
    #[inline]
    pub(crate) fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        Ok(Buffer::Host(self.pool.alloc_host(dtype, len)?))
    }
    /// Runs a kernel at once (static dispatch of `launch`).
    #[inline]
    pub(crate) fn run(&self, kernel: &Kernel<'_>, out: Out<'_>) -> Result<()> {
        // A poisoned CPU storage (an in-place collective across processes
        // that failed part-way, or never returned and still holds its
        // lock: `dist`) is refused, read or written, before its lock is
        // asked for. One load per operand; the CPU itself never poisons.
        if let Some(fault) = kernel.input_fault() {
            return Err(fault);
        }
        if let Out::Storage(o) = &out
            && let Some(fault) = o.fault()
        {
            return Err(fault);
        }
        host::run_caught(kernel, out, threads(), Device::Cpu)
    }
    /// Runs a kernel into a new host buffer of `len` elements, booked in the
    /// pool; on failure nothing stays booked.
    #[inline]
    pub(crate) fn run_new(&self, kernel: &Kernel<'_>, dtype: DType, len: usize) -> Result<Buffer> {
        if let Some(fault) = kernel.input_fault() {
            return Err(fault);
        }
        let mut buffer = self.pool.alloc_host(dtype, len)?;
        if host::run_dense_small(kernel, &mut buffer).is_some() {
            return Ok(Buffer::Host(buffer));
        }
        // The inputs' faults were checked above; a fresh output has none.
        match host::run_caught(kernel, Out::Fresh(&mut buffer), threads(), Device::Cpu) {
            Ok(()) => Ok(Buffer::Host(buffer)),
            Err(err) => {
                let bytes = buffer.size_in_bytes();
                self.pool.release_host(buffer, bytes);
                Err(err)
            }
        }
    }
}

pub(crate) fn cpu_name() -> String {
    let threads = crate::runtime::pool::size();
    let model = crate::runtime::host::cpu_name().unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{model} ({threads} threads)")
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn name(&self) -> String {
        cpu_name()
    }
    fn pool(&self) -> &MemoryPool {
        self.pool
    }
    fn is_async(&self) -> bool {
        false
    }
    fn driver_free_memory(&self) -> Option<usize> {
        crate::runtime::host::host_memory_available()
    }
    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<Buffer> {
        self.alloc(dtype, len)
    }
    fn release(&self, buffer: Buffer, bytes: usize) {
        match buffer {
            Buffer::Host(b) => self.pool.release_host(b, bytes),
            Buffer::Device(_) => self.pool.unreserve(bytes),
        }
    }
    fn launch(&self, kernel: &Kernel<'_>, out: &Arc<Storage>) -> Result<()> {
        self.run(kernel, Out::Storage(out))
    }
    fn upload(&self, data: CpuBuffer) -> Result<Buffer> {
        self.pool.reserve(data.size_in_bytes())?;
        Ok(Buffer::Host(data))
    }
    fn download(&self, src: &Src<'_>) -> Result<CpuBuffer> {
        if let Some(fault) = src.storage.fault() {
            return Err(fault);
        }
        host::gather_caught(src, Device::Cpu)
    }
    fn record_event(&self) -> Option<Arc<dyn Event>> {
        None
    }
    fn wait_event(&self, event: Arc<dyn Event>) -> Result<()> {
        event.wait();
        Ok(())
    }
    fn host_memory(&self) -> bool {
        true
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
