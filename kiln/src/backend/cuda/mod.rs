//! Real NVIDIA GPUs through the CUDA driver API, found at run time.
//!
//! Nothing is linked: cudarc opens `libcuda.so` (and NVRTC, cuBLAS) with
//! `dlopen` when kiln first looks for GPUs, so one binary runs on machines
//! with and without a GPU. Each device gets a primary context, one
//! non-blocking stream on which everything runs in order, a caching
//! allocator booked in the device's [`MemoryPool`], pinned staging buffers
//! for host transfers, cuBLAS for float matmul and NVRTC-compiled kernels
//! (`kernels.cu`) for everything else.
//!
//! Any cudarc call may panic when a library or a symbol is missing; every
//! entry point contains that with `catch_unwind` and turns it into an error
//! (or, when probing, into a [`FallbackReason`]).

pub(crate) mod kernels;
mod launch;
mod nvrtc;

use super::{Backend, Event};
use crate::base::buffer::CpuBuffer;
use crate::op::{Kernel, Src};
use crate::registry::RealGpus;
use crate::runtime::memory::MemoryPool;
use crate::storage::{Buffer, Storage};
use crate::{map_buffer, DType, Device, DeviceKind, Error, FallbackReason, Result};
use cudarc::driver::sys as cu;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// A raw driver handle that may cross threads: the driver API is thread-safe
/// and kiln binds the context before every use.
#[derive(Clone, Copy)]
pub(crate) struct Raw<T>(pub(crate) T);
// SAFETY: CUDA driver handles are plain identifiers usable from any thread.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above; mutation goes through the driver, which synchronises.
unsafe impl<T> Sync for Raw<T> {}

/// Device memory owned by kiln: `cap` bytes at `ptr` (0 for empty buffers).
pub(crate) struct DevBuf {
    pub(crate) ptr: u64,
    pub(crate) cap: usize,
}

fn error_text(r: cu::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: the driver writes pointers to static strings, or leaves null.
    unsafe {
        let _ = cu::cuGetErrorName(r, &mut name);
        let _ = cu::cuGetErrorString(r, &mut text);
        let name = if name.is_null() { format!("{r:?}") } else { CStr::from_ptr(name).to_string_lossy().into_owned() };
        if text.is_null() {
            name
        } else {
            format!("{name} ({})", CStr::from_ptr(text).to_string_lossy())
        }
    }
}

/// Ok for CUDA_SUCCESS, else the driver's name and text of the error.
fn ck(r: cu::CUresult, what: &str) -> std::result::Result<(), String> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {}", error_text(r)))
    }
}

fn attr(dev: cu::CUdevice, a: cu::CUdevice_attribute) -> i32 {
    let mut v: c_int = 0;
    // SAFETY: out-pointer to a local.
    let r = unsafe { cu::cuDeviceGetAttribute(&mut v, a, dev) };
    if r == cu::CUresult::CUDA_SUCCESS {
        v
    } else {
        0
    }
}

/// Bytes rounded up to the allocator's size classes: 512 B below 1 MiB,
/// 2 MiB above, so that freed blocks fit later requests of similar size.
fn size_class(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 2 << 20;
    if bytes < (1 << 20) {
        bytes.div_ceil(SMALL) * SMALL
    } else {
        bytes.div_ceil(LARGE) * LARGE
    }
}

/// Freed device blocks by size class, reused before asking the driver.
#[derive(Default)]
struct BlockCache {
    free: HashMap<usize, Vec<u64>>,
    bytes: usize,
}

/// Pinned host memory for staging transfers: at least two chunks, so that the
/// CPU copy of one overlaps the DMA of the other, and up to
/// [`MAX_STAGING_CHUNKS`] so that an upload queued behind long-running work
/// takes a free chunk instead of waiting for that work (uploads overlap
/// compute).
struct Staging {
    chunks: Vec<StagingChunk>,
    /// Counts chunk uses, to pick the least recently used one to wait for.
    uses: u64,
}

struct StagingChunk {
    ptr: Raw<*mut u8>,
    size: usize,
    /// Recorded after the last DMA that used this chunk.
    event: Raw<cu::CUevent>,
    pending: bool,
    last_use: u64,
}

/// How a missing cuBLAS is described (and recognised: it is not retried).
const BLAS_MISSING: &str = "cuBLAS (libcublas.so) not found";

/// Bytes per staging chunk.
const STAGING_CHUNK: usize = 8 << 20;
/// Most staging chunks per device (64 MiB of pinned memory).
const MAX_STAGING_CHUNKS: usize = 8;

/// cuBLAS, created on first matmul.
pub(crate) struct Blas {
    pub(crate) handle: Raw<cudarc::cublas::sys::cublasHandle_t>,
}

pub(crate) struct CudaBackend {
    device: Device,
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    sm_count: i32,
    driver_version: i32,
    pci_bus: String,
    ctx: Raw<cu::CUcontext>,
    stream: Raw<cu::CUstream>,
    pool: MemoryPool,
    cache: Mutex<BlockCache>,
    /// None until first used; Some(None) when pinned memory could not be had.
    staging: Mutex<Option<Option<Staging>>>,
    /// Mapped pinned word the stream waits on while the queue is held
    /// (host pointer, device pointer), and the last hold's number.
    hold_flag: Mutex<Option<(Raw<*mut u32>, u64)>>,
    holds: std::sync::atomic::AtomicU32,
    blas_warned: std::sync::atomic::AtomicBool,
    /// Loaded module per kernel family (or why it could not be built).
    modules: Mutex<HashMap<&'static str, std::result::Result<Raw<cu::CUmodule>, String>>>,
    functions: Mutex<HashMap<String, Raw<cu::CUfunction>>>,
    blas: Mutex<Option<std::result::Result<Blas, String>>>,
    /// Whether this context may access a peer's memory, by peer ordinal
    /// (enabled on first ask).
    peers: Mutex<HashMap<usize, bool>>,
}

/// Finds the CUDA devices. Never panics and never aborts: a missing library
/// or symbol becomes the reason why there is no GPU.
pub(crate) fn probe() -> RealGpus {
    if crate::base::env::env_flag("KILN_DISABLE_CUDA").unwrap_or(false) {
        return RealGpus { backends: Vec::new(), absent: Some(FallbackReason::NoDevice("disabled by KILN_DISABLE_CUDA=1".into())) };
    }
    // SAFETY: only tries to dlopen the candidate library names.
    let present = catch_unwind(|| unsafe { cu::is_culib_present() }).unwrap_or(false);
    if !present {
        return RealGpus { backends: Vec::new(), absent: Some(FallbackReason::DriverNotFound) };
    }
    match catch_unwind(open_all) {
        Ok(Ok(backends)) if !backends.is_empty() => RealGpus { backends, absent: None },
        Ok(Ok(_)) => RealGpus { backends: Vec::new(), absent: Some(FallbackReason::NoDevice("the driver lists no CUDA device".into())) },
        Ok(Err(why)) => RealGpus { backends: Vec::new(), absent: Some(FallbackReason::NoDevice(why)) },
        Err(_) => RealGpus {
            backends: Vec::new(),
            absent: Some(FallbackReason::NoDevice("the CUDA driver library lacks a function kiln needs (driver too old?)".into())),
        },
    }
}

fn open_all() -> std::result::Result<Vec<&'static dyn Backend>, String> {
    // SAFETY: plain driver calls with out-pointers to locals.
    unsafe {
        ck(cu::cuInit(0), "cuInit")?;
        let mut count: c_int = 0;
        ck(cu::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
        if count > 0 {
            // Without NVRTC no kernel can be built, not even `zeros`: list no
            // device rather than one that fails at the first operation.
            if let Err(why) = nvrtc::version() {
                return Err(format!("{count} CUDA device(s) found but unusable: {why}"));
            }
        }
        let mut backends: Vec<&'static dyn Backend> = Vec::new();
        for ordinal in 0..count.max(0) as usize {
            match CudaBackend::open(ordinal, Device::Gpu(backends.len())) {
                Ok(b) => backends.push(Box::leak(Box::new(b))),
                Err(e) => eprintln!("kiln: skipping CUDA device {ordinal}: {e}"),
            }
        }
        Ok(backends)
    }
}

impl CudaBackend {
    fn open(ordinal: usize, device: Device) -> std::result::Result<CudaBackend, String> {
        use cu::CUdevice_attribute_enum as A;
        // SAFETY: driver calls with out-pointers to locals; the context and
        // stream live as long as the process (backends are never dropped).
        unsafe {
            let mut dev: cu::CUdevice = 0;
            ck(cu::cuDeviceGet(&mut dev, ordinal as c_int), "cuDeviceGet")?;
            let mut name = [0 as c_char; 256];
            ck(cu::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev), "cuDeviceGetName")?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let mut total = 0usize;
            ck(cu::cuDeviceTotalMem_v2(&mut total, dev), "cuDeviceTotalMem")?;
            let cc =
                (attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR));
            let sm_count = attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).max(1);
            let mut driver_version: c_int = 0;
            let _ = cu::cuDriverGetVersion(&mut driver_version);
            let mut bus = [0 as c_char; 32];
            let pci_bus = if cu::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, dev) == cu::CUresult::CUDA_SUCCESS {
                CStr::from_ptr(bus.as_ptr()).to_string_lossy().into_owned()
            } else {
                String::new()
            };
            let mut ctx: cu::CUcontext = std::ptr::null_mut();
            ck(cu::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            ck(cu::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut stream: cu::CUstream = std::ptr::null_mut();
            // 1 = CU_STREAM_NON_BLOCKING: no implicit sync with the legacy stream.
            ck(cu::cuStreamCreate(&mut stream, 1), "cuStreamCreate")?;
            Ok(CudaBackend {
                device,
                ordinal,
                name,
                cc,
                sm_count,
                driver_version,
                pci_bus,
                ctx: Raw(ctx),
                stream: Raw(stream),
                pool: MemoryPool::new(device, Some(total), 0),
                cache: Mutex::new(BlockCache::default()),
                staging: Mutex::new(None),
                hold_flag: Mutex::new(None),
                holds: std::sync::atomic::AtomicU32::new(0),
                blas_warned: std::sync::atomic::AtomicBool::new(false),
                modules: Mutex::new(HashMap::new()),
                functions: Mutex::new(HashMap::new()),
                blas: Mutex::new(None),
                peers: Mutex::new(HashMap::new()),
            })
        }
    }

    fn err(&self, msg: impl Into<String>) -> Error {
        Error::Backend { device: self.device, msg: msg.into() }
    }

    /// Makes this device's context current on the calling thread.
    fn bind(&self) -> Result<()> {
        // SAFETY: the context is alive for the life of the process.
        ck(unsafe { cu::cuCtxSetCurrent(self.ctx.0) }, "cuCtxSetCurrent").map_err(|e| self.err(e))
    }

    pub(crate) fn sm_count(&self) -> u32 {
        self.sm_count as u32
    }

    /// Runs `f` with the context bound, turning a cudarc panic (missing
    /// symbol) into an error instead of unwinding into the caller.
    fn guarded<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.bind()?;
        catch_unwind(AssertUnwindSafe(f))
            .unwrap_or_else(|_| Err(self.err(format!("{what}: a CUDA library call panicked (missing library or symbol)"))))
    }

    // ---- memory -----------------------------------------------------------

    /// Device memory of at least `bytes`, from the cache or the driver. On a
    /// driver OOM the cache is given back and the allocation retried once.
    /// `None` means out of memory.
    pub(crate) fn alloc_dev(&self, bytes: usize) -> Result<Option<DevBuf>> {
        if bytes == 0 {
            return Ok(Some(DevBuf { ptr: 0, cap: 0 }));
        }
        let cap = size_class(bytes);
        {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(ptr) = cache.free.get_mut(&cap).and_then(|v| v.pop()) {
                cache.bytes -= cap;
                self.pool.set_cached(cache.bytes);
                return Ok(Some(DevBuf { ptr, cap }));
            }
        }
        for attempt in 0..2 {
            let mut ptr: cu::CUdeviceptr = 0;
            // SAFETY: out-pointer to a local; the context is bound by the caller.
            let r = unsafe { cu::cuMemAlloc_v2(&mut ptr, cap) };
            match r {
                cu::CUresult::CUDA_SUCCESS => return Ok(Some(DevBuf { ptr, cap })),
                cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY if attempt == 0 => self.free_cache()?,
                cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => return Ok(None),
                other => return Err(self.err(format!("cuMemAlloc of {} failed: {}", crate::human_bytes(cap), error_text(other)))),
            }
        }
        Ok(None)
    }

    /// Returns a block to the cache. Safe at once: every later use of the
    /// block is queued on the same stream after the work that used it.
    pub(crate) fn free_dev(&self, buf: DevBuf) {
        if buf.cap == 0 {
            return;
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.free.entry(buf.cap).or_default().push(buf.ptr);
        cache.bytes += buf.cap;
        self.pool.set_cached(cache.bytes);
    }

    /// Gives every cached block back to the driver. The blocks are taken out
    /// of the cache first and the stream synchronised after: every kernel
    /// that used a taken block was queued before it returned to the cache,
    /// so before the sync (taking them after the sync would free a block
    /// that another thread reused and queued work on in between). Binds the
    /// context itself, so it works from any thread; a failed cuMemFree is an
    /// error naming the device and the bytes.
    fn free_cache(&self) -> Result<()> {
        self.bind()?;
        let blocks: Vec<(usize, u64)> = {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            let taken = cache.free.drain().flat_map(|(cap, ptrs)| ptrs.into_iter().map(move |p| (cap, p))).collect();
            cache.bytes = 0;
            self.pool.set_cached(0);
            taken
        };
        if blocks.is_empty() {
            return Ok(());
        }
        // SAFETY: the stream is alive; the blocks are in no cache and unused
        // once the work queued before this point has run.
        unsafe {
            ck(cu::cuStreamSynchronize(self.stream.0), "cuStreamSynchronize").map_err(|e| self.err(e))?;
            let mut failed = Vec::new();
            for &(cap, p) in &blocks {
                if let Err(e) = ck(cu::cuMemFree_v2(p), "cuMemFree") {
                    failed.push((cap, e));
                }
            }
            if let Some((_, first)) = failed.first() {
                let bytes: usize = failed.iter().map(|(c, _)| c).sum();
                return Err(self.err(format!(
                    "emptying the cache: {} of {} blocks ({}) could not be freed; first: {first}; the memory stays allocated \
                     until the process exits",
                    failed.len(),
                    blocks.len(),
                    crate::human_bytes(bytes)
                )));
            }
        }
        Ok(())
    }

    fn oom(&self, bytes: usize) -> Error {
        let stats = self.pool.stats();
        Error::OutOfMemory { device: self.device, requested: bytes, in_use: stats.in_use, capacity: stats.capacity.unwrap_or(0) }
    }

    // ---- transfers ----------------------------------------------------------

    /// One pinned chunk and its event, or None (and nothing leaked) when
    /// either cannot be had.
    fn new_chunk(&self) -> Option<StagingChunk> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let mut ev: cu::CUevent = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; 2 = CU_EVENT_DISABLE_TIMING. The
        // pinned block is freed again if the event cannot be made.
        unsafe {
            if cu::cuMemAllocHost_v2(&mut p, STAGING_CHUNK) != cu::CUresult::CUDA_SUCCESS {
                return None;
            }
            if cu::cuEventCreate(&mut ev, 2) != cu::CUresult::CUDA_SUCCESS {
                let _ = cu::cuMemFreeHost(p);
                return None;
            }
        }
        Some(StagingChunk { ptr: Raw(p as *mut u8), size: STAGING_CHUNK, event: Raw(ev), pending: false, last_use: 0 })
    }

    fn drop_chunk(c: StagingChunk) {
        // SAFETY: the chunk's DMA is finished or never started; freed once.
        unsafe {
            let _ = cu::cuEventDestroy_v2(c.event.0);
            let _ = cu::cuMemFreeHost(c.ptr.0 as *mut c_void);
        }
    }

    /// Runs `f` with the staging chunks, creating them on first use. `None`
    /// when pinned memory cannot be had (transfers then go synchronously).
    fn with_staging<T>(&self, f: impl FnOnce(Option<&mut Staging>) -> Result<T>) -> Result<T> {
        let mut guard = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let mut chunks = Vec::new();
            for _ in 0..2 {
                match self.new_chunk() {
                    Some(c) => chunks.push(c),
                    None => break,
                }
            }
            if chunks.len() < 2 {
                // One chunk is not enough for the double buffering: give it back.
                chunks.into_iter().for_each(Self::drop_chunk);
                *guard = Some(None);
            } else {
                *guard = Some(Some(Staging { chunks, uses: 0 }));
            }
        }
        f(guard.as_mut().and_then(|s| s.as_mut()))
    }

    /// A chunk the host may fill now: one whose last DMA has finished
    /// (asked without blocking), else a new one while fewer than
    /// MAX_STAGING_CHUNKS exist, else the least recently used one once its
    /// DMA is done.
    fn free_chunk(&self, st: &mut Staging) -> Result<usize> {
        st.uses += 1;
        let mut order: Vec<usize> = (0..st.chunks.len()).collect();
        order.sort_by_key(|&i| st.chunks[i].last_use);
        for &i in &order {
            let c = &mut st.chunks[i];
            if c.pending {
                // SAFETY: the event is alive.
                match unsafe { cu::cuEventQuery(c.event.0) } {
                    cu::CUresult::CUDA_SUCCESS => c.pending = false,
                    cu::CUresult::CUDA_ERROR_NOT_READY => continue,
                    other => return Err(self.err(format!("cuEventQuery failed: {}", error_text(other)))),
                }
            }
            c.last_use = st.uses;
            return Ok(i);
        }
        if st.chunks.len() < MAX_STAGING_CHUNKS {
            if let Some(mut c) = self.new_chunk() {
                c.last_use = st.uses;
                st.chunks.push(c);
                return Ok(st.chunks.len() - 1);
            }
        }
        let i = order[0];
        let c = &mut st.chunks[i];
        // SAFETY: the event is alive.
        ck(unsafe { cu::cuEventSynchronize(c.event.0) }, "cuEventSynchronize").map_err(|e| self.err(e))?;
        c.pending = false;
        c.last_use = st.uses;
        Ok(i)
    }

    /// Host bytes to device memory, queued on the stream. Returns once the
    /// host bytes have been copied out (to pinned staging or by the driver).
    fn write_device(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let stream = self.stream.0;
        self.with_staging(|staging| {
            // SAFETY: pointers to live host memory and device memory of at
            // least `src.len()` bytes; staging chunks are reused only after
            // their event says the previous DMA finished.
            unsafe {
                let Some(st) = staging else {
                    ck(cu::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), stream), "cuMemcpyHtoDAsync")
                        .map_err(|e| self.err(e))?;
                    return ck(cu::cuStreamSynchronize(stream), "cuStreamSynchronize").map_err(|e| self.err(e));
                };
                for (i, piece) in src.chunks(STAGING_CHUNK).enumerate() {
                    let k = self.free_chunk(st)?;
                    let c = &mut st.chunks[k];
                    std::ptr::copy_nonoverlapping(piece.as_ptr(), c.ptr.0, piece.len());
                    let at = dst + (i * STAGING_CHUNK) as u64;
                    ck(cu::cuMemcpyHtoDAsync_v2(at, c.ptr.0 as *const c_void, piece.len(), stream), "cuMemcpyHtoDAsync")
                        .map_err(|e| self.err(e))?;
                    ck(cu::cuEventRecord(c.event.0, stream), "cuEventRecord").map_err(|e| self.err(e))?;
                    c.pending = true;
                    debug_assert!(piece.len() <= c.size);
                }
                Ok(())
            }
        })
    }

    /// Device bytes to host memory, after all queued work; blocks until done.
    fn read_device(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let stream = self.stream.0;
        self.with_staging(|staging| {
            // SAFETY: as in write_device; a chunk is read on the host only
            // after its event completed.
            unsafe {
                let Some(st) = staging else {
                    ck(cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len(), stream), "cuMemcpyDtoHAsync")
                        .map_err(|e| self.err(e))?;
                    return ck(cu::cuStreamSynchronize(stream), "cuStreamSynchronize").map_err(|e| self.err(e));
                };
                let total = dst.len();
                let n = total.div_ceil(STAGING_CHUNK);
                let issue = |st: &mut Staging, i: usize| -> Result<()> {
                    let c = &mut st.chunks[i % 2];
                    if c.pending {
                        ck(cu::cuEventSynchronize(c.event.0), "cuEventSynchronize").map_err(|e| self.err(e))?;
                    }
                    let len = STAGING_CHUNK.min(total - i * STAGING_CHUNK);
                    let at = src + (i * STAGING_CHUNK) as u64;
                    ck(cu::cuMemcpyDtoHAsync_v2(c.ptr.0 as *mut c_void, at, len, stream), "cuMemcpyDtoHAsync").map_err(|e| self.err(e))?;
                    ck(cu::cuEventRecord(c.event.0, stream), "cuEventRecord").map_err(|e| self.err(e))?;
                    c.pending = true;
                    Ok(())
                };
                issue(st, 0)?;
                for i in 0..n {
                    if i + 1 < n {
                        issue(st, i + 1)?;
                    }
                    let c = &mut st.chunks[i % 2];
                    ck(cu::cuEventSynchronize(c.event.0), "cuEventSynchronize").map_err(|e| self.err(e))?;
                    c.pending = false;
                    let start = i * STAGING_CHUNK;
                    let len = STAGING_CHUNK.min(total - start);
                    std::ptr::copy_nonoverlapping(c.ptr.0, dst.as_mut_ptr().add(start), len);
                }
                Ok(())
            }
        })
    }

    // ---- kernels and libraries ---------------------------------------------

    /// The compiled kernel `name`, compiling its family on first use.
    pub(crate) fn function(&self, name: &str) -> Result<cu::CUfunction> {
        if let Some(f) = self.functions.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            return Ok(f.0);
        }
        let family = kernels::family_of(name);
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            if !modules.contains_key(family) {
                let built = self.build_family(family);
                modules.insert(family, built);
            }
            match &modules[family] {
                Ok(m) => m.0,
                Err(e) => return Err(self.err(e.clone())),
            }
        };
        let cname = std::ffi::CString::new(name).map_err(|_| self.err("bad kernel name"))?;
        let mut f: cu::CUfunction = std::ptr::null_mut();
        // SAFETY: the module is loaded and stays loaded; out-pointer to a local.
        ck(unsafe { cu::cuModuleGetFunction(&mut f, module, cname.as_ptr()) }, &format!("cuModuleGetFunction({name})"))
            .map_err(|e| self.err(e))?;
        self.functions.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), Raw(f));
        Ok(f)
    }

    /// Compiles one kernel family for this device and loads it: machine code
    /// when NVRTC knows the device's `sm_XY`, else PTX for the newest
    /// architecture it knows that the device can run (the driver JITs it).
    fn build_family(&self, family: &'static str) -> std::result::Result<Raw<cu::CUmodule>, String> {
        let source = kernels::families()
            .into_iter()
            .find(|(n, _)| *n == family)
            .map(|(_, s)| s)
            .ok_or_else(|| format!("no kernel family `{family}`"))?;
        let sm = self.cc.0 * 10 + self.cc.1;
        let archs = nvrtc::supported_archs()?;
        let base: Vec<String> = nvrtc::COMMON_OPTIONS.iter().map(|s| s.to_string()).collect();
        let with = |arch: String| -> Vec<String> {
            let mut o = base.clone();
            o.push(format!("--gpu-architecture={arch}"));
            o
        };
        let mut errors = Vec::new();
        // Machine code first when NVRTC knows the exact architecture.
        if archs.contains(&sm) {
            match nvrtc::compile_cached(family, &source, &with(format!("sm_{sm}")), true).and_then(|img| load_module(family, img.bytes())) {
                Ok(m) => return Ok(m),
                Err(e) => errors.push(e),
            }
        }
        // Else (or if the driver refused it) PTX for the newest architecture
        // NVRTC knows that the device can run; the driver JIT-compiles it.
        match archs.iter().copied().filter(|&a| a <= sm).max() {
            Some(best) => {
                let image = nvrtc::compile_cached(family, &source, &with(format!("compute_{best}")), false);
                match image.and_then(|img| {
                    let mut bytes = img.bytes().to_vec();
                    if bytes.last() != Some(&0) {
                        bytes.push(0);
                    }
                    load_module(family, &bytes)
                }) {
                    Ok(m) => return Ok(m),
                    Err(e) => errors.push(e),
                }
            }
            None => {
                errors.push(format!("this NVRTC knows sm {archs:?}, none of which compute capability {}.{} can run", self.cc.0, self.cc.1))
            }
        }
        let nv = nvrtc::version().map(|(a, b)| format!("{a}.{b}")).unwrap_or_default();
        Err(format!(
            "{}; NVRTC is {nv} and the driver supports CUDA {}.{}: an NVRTC newer than the driver produces code the driver \
             cannot load, so put an NVRTC no newer than the driver first on LD_LIBRARY_PATH (or set KILN_NVRTC_LIB)",
            errors.join("; "),
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        ))
    }

    /// Runs `f` with the cuBLAS handle, or returns None when cuBLAS cannot be
    /// had (matmul then uses kiln's own kernel, and says so once on stderr).
    /// Only a missing library is remembered; a failed `cublasCreate` (for
    /// example out of memory) is tried again at the next matmul.
    pub(crate) fn with_blas<T>(&self, f: impl FnOnce(&Blas) -> Result<T>) -> Result<Option<T>> {
        use cudarc::cublas::sys as cb;
        let mut guard = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(guard.as_ref(), Some(Ok(_))) && !self.blas_missing(guard.as_ref()) {
            // SAFETY: dlopen attempts, then handle creation on the bound context.
            let created = catch_unwind(|| unsafe {
                if !cb::is_culib_present() {
                    return Err(BLAS_MISSING.to_string());
                }
                let mut h: cb::cublasHandle_t = std::ptr::null_mut();
                let st = cb::cublasCreate_v2(&mut h);
                if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return Err(format!("cublasCreate failed: {st:?}"));
                }
                let st = cb::cublasSetStream_v2(h, self.stream.0 as cb::cudaStream_t);
                if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    let _ = cb::cublasDestroy_v2(h);
                    return Err(format!("cublasSetStream failed: {st:?}"));
                }
                if crate::base::env::env_flag("KILN_CUDA_TF32").unwrap_or(false) {
                    let _ = cb::cublasSetMathMode(h, cb::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH);
                }
                Ok(Blas { handle: Raw(h) })
            })
            .unwrap_or_else(|_| Err(format!("{BLAS_MISSING} (a function kiln needs is missing)")));
            if let Err(why) = &created {
                if !self.blas_warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    eprintln!("kiln: cuBLAS unavailable on {} ({why}); matmul uses kiln's own CUDA kernel", self.device);
                }
            }
            *guard = Some(created);
        }
        match guard.as_ref() {
            Some(Ok(blas)) => f(blas).map(Some),
            _ => Ok(None),
        }
    }

    fn blas_missing(&self, state: Option<&std::result::Result<Blas, String>>) -> bool {
        matches!(state, Some(Err(why)) if why.starts_with(BLAS_MISSING))
    }

    /// Whether cuBLAS is in use, for `devices()`.
    fn blas_status(&self) -> String {
        match self.blas.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            None => "not loaded yet".into(),
            Some(Ok(_)) => "yes".into(),
            Some(Err(why)) => format!("no: {why}"),
        }
    }

    /// Stops the stream at this point until the hold drops: the stream waits
    /// on a word of mapped pinned memory that a helper thread sets then.
    fn hold(&self) -> Result<super::QueueHold> {
        use std::sync::atomic::{AtomicU32, Ordering};
        let mut flag = self.hold_flag.lock().unwrap_or_else(|e| e.into_inner());
        if flag.is_none() {
            let mut host: *mut c_void = std::ptr::null_mut();
            let mut dev: cu::CUdeviceptr = 0;
            // SAFETY: out-pointers to locals; 2 = CU_MEMHOSTALLOC_DEVICEMAP.
            // The word lives as long as the process.
            unsafe {
                ck(cu::cuMemHostAlloc(&mut host, 4, 2), "cuMemHostAlloc").map_err(|e| self.err(e))?;
                (*(host as *const AtomicU32)).store(0, Ordering::SeqCst);
                if let Err(e) = ck(cu::cuMemHostGetDevicePointer_v2(&mut dev, host, 0), "cuMemHostGetDevicePointer") {
                    let _ = cu::cuMemFreeHost(host);
                    return Err(self.err(e));
                }
            }
            *flag = Some((Raw(host as *mut u32), dev));
        }
        let (host, dev) = flag.as_ref().map(|(h, d)| (h.0 as usize, *d)).unwrap_or((0, 0));
        let n = self.holds.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
        // SAFETY: a mapped pinned word; 0 = CU_STREAM_WAIT_VALUE_GEQ.
        ck(unsafe { cu::cuStreamWaitValue32_v2(self.stream.0, dev, n, 0) }, "cuStreamWaitValue32")
            .map_err(|e| self.err(format!("{e}: this device cannot hold its queue (stream memory operations unsupported)")))?;
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        std::thread::Builder::new()
            .name(format!("kiln-cuda-hold-{}", self.device))
            .spawn(move || {
                let _ = rx.recv();
                // SAFETY: the word lives as long as the process.
                unsafe { (*(host as *const AtomicU32)).fetch_max(n, Ordering::SeqCst) };
            })
            .map_err(|e| self.err(format!("cannot start the thread that releases the hold: {e}")))?;
        Ok(super::QueueHold { _release: tx })
    }

    /// Whether this device may access `peer`'s memory: asks the driver and
    /// enables peer access from this context on the first call per peer.
    fn peer_access(&self, peer: &CudaBackend) -> bool {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&ok) = peers.get(&peer.ordinal) {
            return ok;
        }
        let ok = self
            .guarded("enabling peer access", || {
                let (mut a, mut b, mut can): (cu::CUdevice, cu::CUdevice, c_int) = (0, 0, 0);
                // SAFETY: out-pointers to locals; this context is bound and
                // the peer's lives as long as the process.
                unsafe {
                    ck(cu::cuDeviceGet(&mut a, self.ordinal as c_int), "cuDeviceGet").map_err(|e| self.err(e))?;
                    ck(cu::cuDeviceGet(&mut b, peer.ordinal as c_int), "cuDeviceGet").map_err(|e| self.err(e))?;
                    ck(cu::cuDeviceCanAccessPeer(&mut can, a, b), "cuDeviceCanAccessPeer").map_err(|e| self.err(e))?;
                    Ok(can != 0
                        && matches!(
                            cu::cuCtxEnablePeerAccess(peer.ctx.0, 0),
                            cu::CUresult::CUDA_SUCCESS | cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                        ))
                }
            })
            .unwrap_or(false);
        peers.insert(peer.ordinal, ok);
        ok
    }

    /// Queues a copy of `src` into `dst` (device memory of `peer`) on this
    /// stream, and makes `peer`'s stream wait for it with an event.
    fn queue_peer_copy(&self, src: &Src, peer: &CudaBackend, dst: u64) -> Result<()> {
        let size = src.storage.dtype.size_in_bytes();
        let bytes = src.layout.elem_count() * size;
        let base = dev_ptr(self, &src.storage)?;
        let gathered;
        let from = match src.layout.contiguous_range() {
            Some((a, _)) => base + (a * size) as u64,
            None => {
                // Made contiguous here first; the block returns to this
                // device's cache, reused only by work queued after the copy.
                gathered = self.temp(bytes)?;
                launch::gather(self, src, gathered.ptr())?;
                gathered.ptr()
            }
        };
        let mut ev: cu::CUevent = std::ptr::null_mut();
        // SAFETY: both ranges are device memory of at least `bytes` bytes,
        // kept for the copy by stream order on both devices; the event is
        // destroyed once the wait on it is queued (the driver defers that).
        unsafe {
            if bytes > 0 {
                ck(cu::cuMemcpyPeerAsync(dst, peer.ctx.0, from, self.ctx.0, bytes, self.stream.0), "cuMemcpyPeerAsync")
                    .map_err(|e| self.err(e))?;
            }
            ck(cu::cuEventCreate(&mut ev, 2), "cuEventCreate").map_err(|e| self.err(e))?;
            let mut queued = ck(cu::cuEventRecord(ev, self.stream.0), "cuEventRecord").map_err(|e| self.err(e));
            if queued.is_ok() {
                queued = peer
                    .bind()
                    .and_then(|()| ck(cu::cuStreamWaitEvent(peer.stream.0, ev, 0), "cuStreamWaitEvent").map_err(|e| peer.err(e)));
            }
            let _ = cu::cuEventDestroy_v2(ev);
            queued
        }
    }

    /// Launches `name` with a 1-D grid.
    pub(crate) fn launch_raw(&self, name: &str, grid: u32, block: u32, args: &mut launch::Args) -> Result<()> {
        let f = self.function(name)?;
        let mut params = args.pointers();
        // SAFETY: `params` points at argument values that `args` keeps alive
        // for this call; the driver copies them before returning.
        let r =
            unsafe { cu::cuLaunchKernel(f, grid.max(1), 1, 1, block, 1, 1, 0, self.stream.0, params.as_mut_ptr(), std::ptr::null_mut()) };
        ck(r, &format!("launching {name}")).map_err(|e| self.err(e))
    }

    pub(crate) fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `ptr` addresses at least `bytes` bytes of device memory.
        ck(unsafe { cu::cuMemsetD8Async(ptr, 0, bytes, self.stream.0) }, "cuMemsetD8Async").map_err(|e| self.err(e))
    }

    pub(crate) fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are device memory of at least `bytes` bytes.
        ck(unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.0) }, "cuMemcpyDtoDAsync").map_err(|e| self.err(e))
    }

    /// A temporary device buffer, returned to the cache when dropped.
    pub(crate) fn temp(&self, bytes: usize) -> Result<TempBuf<'_>> {
        match self.alloc_dev(bytes)? {
            Some(buf) => Ok(TempBuf { backend: self, buf: Some(buf) }),
            None => Err(self.oom(bytes)),
        }
    }
}

/// Loads a cubin or NUL-terminated PTX image into the bound context.
fn load_module(family: &str, image: &[u8]) -> std::result::Result<Raw<cu::CUmodule>, String> {
    let mut module: cu::CUmodule = std::ptr::null_mut();
    // SAFETY: a complete image that outlives the call; the context is bound.
    ck(unsafe { cu::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) }, &format!("loading kernel family `{family}`"))?;
    Ok(Raw(module))
}

/// Scratch device memory for one operation.
pub(crate) struct TempBuf<'a> {
    backend: &'a CudaBackend,
    buf: Option<DevBuf>,
}

impl TempBuf<'_> {
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.as_ref().map(|b| b.ptr).unwrap_or(0)
    }
}

impl Drop for TempBuf<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.backend.free_dev(b);
        }
    }
}

/// An event recorded on a CUDA stream.
struct CudaEvent {
    event: Raw<cu::CUevent>,
}

impl Event for CudaEvent {
    fn wait(&self) {
        // SAFETY: the event is alive until drop.
        let _ = catch_unwind(|| unsafe { cu::cuEventSynchronize(self.event.0) });
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the driver defers it if still pending.
        let _ = catch_unwind(|| unsafe { cu::cuEventDestroy_v2(self.event.0) });
    }
}

/// An event that has already happened.
struct Done;
impl Event for Done {
    fn wait(&self) {}
}

/// The typed elements of a host buffer as bytes.
fn host_bytes(buf: &CpuBuffer) -> &[u8] {
    map_buffer!(buf, v => {
        // SAFETY: plain-old-data elements viewed as their bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(&v[..])) }
    })
}

fn host_bytes_mut(buf: &mut CpuBuffer) -> &mut [u8] {
    map_buffer!(buf, v => {
        // SAFETY: every bit pattern is a valid element of these types
        // (f16/bf16 are u16 newtypes), and the slice covers exactly the vector.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(&v[..])) }
    })
}

/// The device pointer of a storage that lives on a CUDA device.
pub(crate) fn dev_ptr(backend: &CudaBackend, storage: &crate::storage::Storage) -> Result<u64> {
    let r = storage.read();
    match r.buffer() {
        Buffer::Device(b) => match b.downcast_ref::<DevBuf>() {
            Some(d) => Ok(d.ptr),
            None => Err(backend.err("a kernel operand is not CUDA memory")),
        },
        Buffer::Host(_) => {
            Err(backend.err(format!("a kernel operand lives in host memory ({}), not on this GPU; this is a kiln bug", storage.device())))
        }
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        self.device
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }
    fn name(&self) -> String {
        self.name.clone()
    }
    fn pool(&self) -> &MemoryPool {
        &self.pool
    }
    fn is_async(&self) -> bool {
        true
    }
    fn driver_free_memory(&self) -> Option<usize> {
        self.guarded("cuMemGetInfo", || {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: out-pointers to locals, context bound.
            ck(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo").map_err(|e| self.err(e))?;
            Ok(free)
        })
        .ok()
    }
    fn details(&self) -> Vec<(String, String)> {
        let mut d = vec![
            ("compute capability".to_string(), format!("{}.{}", self.cc.0, self.cc.1)),
            ("driver".to_string(), format!("CUDA {}.{}", self.driver_version / 1000, (self.driver_version % 1000) / 10)),
            ("multiprocessors".to_string(), self.sm_count.to_string()),
            ("cuda ordinal".to_string(), self.ordinal.to_string()),
        ];
        if !self.pci_bus.is_empty() {
            d.push(("pci bus".to_string(), self.pci_bus.clone()));
        }
        d.push((
            "nvrtc".to_string(),
            match nvrtc::version() {
                Ok((a, b)) => format!("{a}.{b}"),
                Err(_) => "not found".to_string(),
            },
        ));
        let cached = self.cache.lock().map(|c| c.bytes).unwrap_or(0);
        d.push(("kiln cache".to_string(), crate::human_bytes(cached)));
        d.push(("cublas".to_string(), self.blas_status()));
        d
    }
    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<Buffer> {
        let bytes = len.saturating_mul(dtype.size_in_bytes());
        self.pool.reserve(bytes)?;
        let got = self.guarded("cuMemAlloc", || self.alloc_dev(bytes));
        match got {
            Ok(Some(buf)) => Ok(Buffer::Device(Box::new(buf))),
            Ok(None) => {
                self.pool.unreserve(bytes);
                Err(self.oom(bytes))
            }
            Err(e) => {
                self.pool.unreserve(bytes);
                Err(e)
            }
        }
    }
    fn release(&self, buffer: Buffer, bytes: usize) {
        self.pool.unreserve(bytes);
        if let Buffer::Device(b) = buffer {
            if let Ok(d) = b.downcast::<DevBuf>() {
                self.free_dev(*d);
            }
        }
    }
    fn launch(&self, kernel: &Kernel<'_>, out: &Arc<Storage>) -> Result<()> {
        self.guarded("kernel launch", || launch::run(self, kernel, out))
    }
    fn upload(&self, data: CpuBuffer) -> Result<Buffer> {
        let bytes = data.size_in_bytes();
        let buffer = self.alloc_buffer(data.dtype(), data.len())?;
        let ptr = match &buffer {
            Buffer::Device(b) => b.downcast_ref::<DevBuf>().map(|d| d.ptr).unwrap_or(0),
            Buffer::Host(_) => 0,
        };
        match self.guarded("host-to-device copy", || self.write_device(ptr, host_bytes(&data))) {
            Ok(()) => Ok(buffer),
            Err(e) => {
                self.release(buffer, bytes);
                Err(e)
            }
        }
    }
    fn download(&self, src: &Src<'_>) -> Result<CpuBuffer> {
        self.guarded("device-to-host copy", || {
            let dtype = src.storage.dtype;
            let n = src.layout.elem_count();
            let size = dtype.size_in_bytes();
            let mut out = CpuBuffer::try_zeros(dtype, n).ok_or_else(|| {
                self.err(format!("cannot allocate {} of host memory to read {} elements back", crate::human_bytes(n * size), n))
            })?;
            let base = dev_ptr(self, &src.storage)?;
            if let Some((a, _)) = src.layout.contiguous_range() {
                self.read_device(base + (a * size) as u64, host_bytes_mut(&mut out))?;
            } else {
                let tmp = self.temp(n * size)?;
                launch::gather(self, src, tmp.ptr())?;
                self.read_device(tmp.ptr(), host_bytes_mut(&mut out))?;
            }
            Ok(out)
        })
    }
    fn record_event(&self) -> Option<Arc<dyn Event>> {
        let made = self.guarded("cuEventRecord", || {
            let mut ev: cu::CUevent = std::ptr::null_mut();
            // SAFETY: out-pointer to a local; 2 = CU_EVENT_DISABLE_TIMING.
            unsafe {
                ck(cu::cuEventCreate(&mut ev, 2), "cuEventCreate").map_err(|e| self.err(e))?;
                if let Err(e) = ck(cu::cuEventRecord(ev, self.stream.0), "cuEventRecord") {
                    let _ = cu::cuEventDestroy_v2(ev);
                    return Err(self.err(e));
                }
            }
            Ok(Arc::new(CudaEvent { event: Raw(ev) }) as Arc<dyn Event>)
        });
        match made {
            Ok(e) => Some(e),
            Err(_) => {
                // No event to be had: make the point reached now instead.
                let _ = self.synchronize();
                Some(Arc::new(Done))
            }
        }
    }
    fn wait_event(&self, event: Arc<dyn Event>) -> Result<()> {
        // The event may come from any backend; waiting on the host is always
        // correct (the front end only orders host-memory devices this way).
        event.wait();
        Ok(())
    }
    fn host_memory(&self) -> bool {
        false
    }
    fn empty_cache(&self) -> Result<()> {
        self.guarded("emptying the cache", || self.free_cache())
    }
    fn as_cuda(&self) -> Option<&CudaBackend> {
        Some(self)
    }
    fn copy_to_peer(&self, src: &Src<'_>, dst: &'static dyn Backend) -> Result<Option<Arc<crate::storage::Storage>>> {
        let Some(peer) = dst.as_cuda() else { return Ok(None) };
        if peer.ordinal == self.ordinal || !self.peer_access(peer) {
            return Ok(None);
        }
        let out = super::alloc(dst, src.storage.dtype, src.layout.elem_count())?;
        let dst_ptr = dev_ptr(peer, &out)?;
        let queued = self.guarded("peer copy", || self.queue_peer_copy(src, peer, dst_ptr));
        if queued.is_err() {
            // The copy may be queued: `out` must not return to the cache before it ran.
            let _ = self.synchronize();
        }
        queued.map(|()| Some(out))
    }
    fn hold_queue(&self) -> Result<Option<super::QueueHold>> {
        self.guarded("holding the queue", || self.hold().map(Some))
    }
    fn synchronize(&self) -> Result<()> {
        self.guarded("cuStreamSynchronize", || {
            // SAFETY: the stream is alive.
            ck(unsafe { cu::cuStreamSynchronize(self.stream.0) }, "cuStreamSynchronize").map_err(|e| self.err(e))
        })
    }
}

/// Kernel sources and NVRTC access for the compile check (`tests/cuda.rs`
/// and `.ci/cuda-check.sh`), so that it compiles exactly what the backend runs.
pub mod check {
    /// `(family, CUDA C++ source)` of every kernel family the backend compiles.
    pub fn kernel_sources() -> Vec<(String, String)> {
        super::kernels::families().into_iter().map(|(n, s)| (n.to_string(), s)).collect()
    }

    /// The options the backend passes to NVRTC besides the architecture.
    pub fn nvrtc_options() -> Vec<String> {
        super::nvrtc::COMMON_OPTIONS.iter().map(|s| s.to_string()).collect()
    }

    /// Whether a CUDA driver library (libcuda.so) can be loaded here.
    pub fn driver_present() -> bool {
        // SAFETY: only tries to dlopen candidate library names.
        std::panic::catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false)
    }

    /// NVRTC's version, or why no NVRTC library could be loaded.
    pub fn nvrtc_version() -> Result<(i32, i32), String> {
        super::nvrtc::version()
    }

    /// Compiles one source to PTX for `arch` (e.g. `compute_90`), with the
    /// backend's options; returns the PTX text or NVRTC's log.
    pub fn compile_ptx(family: &str, source: &str, arch: &str) -> Result<String, String> {
        let mut options = nvrtc_options();
        options.push(format!("--gpu-architecture={arch}"));
        match super::nvrtc::compile(family, source, &options, false)? {
            super::nvrtc::Image::Ptx(b) | super::nvrtc::Image::Cubin(b) => {
                Ok(String::from_utf8_lossy(&b).trim_end_matches('\0').to_string())
            }
        }
    }
}
