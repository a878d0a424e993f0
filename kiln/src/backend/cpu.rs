//! The CPU: host memory, kernels run at once on the calling thread, big
//! ones spread over kiln's own rayon pool (all cores, or `RAYON_NUM_THREADS`).

use super::{host_kernels, Backend, Event};
use crate::base::buffer::CpuBuffer;
use crate::op::{Kernel, Out, Src};
use crate::runtime::memory::MemoryPool;
use crate::storage::{Buffer, Storage};
use crate::{DType, Device, DeviceKind, Result};
use std::sync::Arc;

/// Host buffers kept for reuse at most (see `MemoryPool::recycle`).
const CPU_CACHE_LIMIT: usize = 2 << 30;

pub(crate) struct CpuBackend {
    pool: MemoryPool,
}

/// The CPU backend. A `static` rather than an entry made at run time, so
/// that the front end calls it directly (`backend::alloc_on`, `launch`,
/// `Storage::drop`): the hot path of small operations is then inlined
/// instead of going through the `Backend` trait object.
pub(crate) static CPU: CpuBackend = CpuBackend { pool: MemoryPool::new(Device::Cpu, None, CPU_CACHE_LIMIT) };

impl CpuBackend {
    /// Allocates and books a host buffer (static dispatch of `alloc_buffer`).
    #[inline]
    pub(crate) fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        Ok(Buffer::Host(self.pool.alloc_host(dtype, len)?))
    }
    /// Runs a kernel at once (static dispatch of `launch`).
    #[inline]
    pub(crate) fn run(&self, kernel: &Kernel<'_>, out: Out<'_>) -> Result<()> {
        host_kernels::run_caught(kernel, out, threads(), Device::Cpu)
    }
    /// Runs a kernel into a new host buffer of `len` elements, booked in the
    /// pool; on failure nothing stays booked.
    #[inline]
    pub(crate) fn run_new(&self, kernel: &Kernel<'_>, dtype: DType, len: usize) -> Result<Buffer> {
        let mut buffer = self.pool.alloc_host(dtype, len)?;
        if host_kernels::run_dense_small(kernel, &mut buffer).is_some() {
            return Ok(Buffer::Host(buffer));
        }
        match self.run(kernel, Out::Fresh(&mut buffer)) {
            Ok(()) => Ok(Buffer::Host(buffer)),
            Err(err) => {
                let bytes = buffer.size_in_bytes();
                self.pool.release_host(buffer, bytes);
                Err(err)
            }
        }
    }
}

/// kiln's own thread pool for the CPU's kernels (all cores, or
/// `RAYON_NUM_THREADS`), apart from rayon's global pool.
///
/// Why a pool of its own: its threads only ever run pieces of kernels,
/// which take no lock and wait for nothing but each other. A thread that
/// holds a kernel's storage locks and waits for the pieces therefore always
/// sees them finish. In a shared pool, a worker waiting for its pieces
/// runs other queued jobs meanwhile; one that writes a storage it is
/// reading (a user's `par_iter` doing `a.assign(..)` beside `a.matmul(..)`)
/// would wait on its own lock forever, and every worker blocked on a lock
/// held by a thread waiting for the pool would stall it.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().thread_name(|i| format!("kiln-cpu-{i}")).build().ok()).as_ref()
}

/// Runs `f` on kiln's pool, where rayon's parallel iterators and gemm's
/// `Parallelism::Rayon` inside it spread their work; the calling thread
/// waits without running anything else. Kernels call it only with the
/// locks they need already taken, and with `threads() > 1`.
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match pool() {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// Threads a CPU kernel started on this thread may use: the pool's, or 1
/// on a thread that is itself a worker of some rayon pool (a user's
/// `par_iter` already spreads the work; PyTorch's `parallel_for` runs
/// serially inside a parallel region for the same reason, and a kernel
/// waiting there would let the worker run other jobs while it holds its
/// locks) and in a child process made by `fork`, where the pool's threads
/// do not exist.
#[inline]
pub(crate) fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if rayon::current_thread_index().is_some() || crate::runtime::fork::in_child() {
        return 1;
    }
    *THREADS.get_or_init(|| pool().map_or(1, |p| p.current_num_threads()))
}

pub(crate) fn cpu_name() -> String {
    let threads = pool().map_or(1, |p| p.current_num_threads());
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
        &self.pool
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
        host_kernels::gather_caught(src, Device::Cpu)
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
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
