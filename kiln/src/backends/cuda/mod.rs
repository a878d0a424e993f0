//! Real NVIDIA GPUs through the CUDA driver API, found at run time.
//!
//! Nothing is linked: cudarc opens `libcuda.so` (and NVRTC, cuBLAS) with
//! `dlopen` when kiln first looks for GPUs, so one binary runs on machines
//! with and without a GPU. Each device gets a primary context, one
//! non-blocking stream on which everything runs in order, a caching
//! allocator booked in the device's [`MemoryPool`], pinned staging buffers
//! for host transfers, cuBLAS for float matmul, and NVRTC-compiled modules
//! (`prelude.cu` before each op family's or op's own source) for every op.
//! Collectives across CUDA devices run through NCCL when it loads
//! (`nccl.rs`), else through peer copies and kernels (`comm/`).
//!
//! Any cudarc call may panic when a library or a symbol is missing; every
//! entry point contains that with `catch_unwind` and turns it into an error
//! (or, when probing, into a [`FallbackReason`]).

mod blas;
pub(crate) mod census;
mod dnn;
mod launch;
mod memory;
pub(crate) mod modules;
mod nccl;
mod nvrtc;
mod peer;
mod written;

use super::Found;
use crate::base::buffer::CpuBuffer;
use crate::base::device::{Device, DeviceKind, FallbackReason};
use crate::base::dtype::DType;
use crate::base::error::{human_bytes, Error, Result};
use crate::kernel::index_check::FaultRecord;
use crate::kernel::storage::{Buffer, Storage};
use crate::kernel::{Backend, Event, MultiKernel, MultiPart, QueueHold};
use crate::kernel::{Kernel, Src};
use crate::runtime::memory::MemoryPool;
use blas::Blas;
use cudarc::driver::sys as cu;
use memory::{host_bytes, host_bytes_mut, BlockCache, Staging};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
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
    /// The fault record of index checks (mapped pinned memory: host
    /// pointer, device pointer), made on first use.
    fault: Mutex<Option<(Raw<*mut FaultRecord>, u64)>>,
    /// The record's host pointer once made (null before): read without a
    /// lock on every launch.
    fault_host: std::sync::atomic::AtomicPtr<FaultRecord>,
    blas_warned: std::sync::atomic::AtomicBool,
    /// Loaded module by name (or why it could not be built).
    modules: Mutex<HashMap<&'static str, std::result::Result<Raw<cu::CUmodule>, String>>>,
    /// Kernels looked up so far, by (module, kernel name).
    functions: Mutex<HashMap<(&'static str, String), Raw<cu::CUfunction>>>,
    blas: Mutex<Option<std::result::Result<Blas, String>>>,
    /// cuDNN's handle for this device, made on the first convolution.
    dnn: Mutex<Option<dnn::Dnn>>,
    dnn_warned: std::sync::atomic::AtomicBool,
    dnn_create_failures: std::sync::atomic::AtomicU32,
    /// Whether this context may access a peer's memory, by peer ordinal
    /// (enabled on first ask).
    peers: Mutex<HashMap<usize, bool>>,
    /// The storages written since the last synchronising call that found no
    /// fault: a fault found later poisons them (`written.rs`).
    written: written::Written,
}

/// Finds the CUDA devices, numbered from `gpu(first)`. Never panics and
/// never aborts: a missing library or symbol becomes the reason why there
/// is no GPU.
pub(crate) fn probe(first: usize) -> Found {
    if crate::base::env::env_flag("KILN_DISABLE_CUDA").unwrap_or(false) {
        return Found { backends: Vec::new(), absent: Some(FallbackReason::NoDevice("disabled by KILN_DISABLE_CUDA=1".into())) };
    }
    // SAFETY: only tries to dlopen the candidate library names.
    let present = catch_unwind(|| unsafe { cu::is_culib_present() }).unwrap_or(false);
    if !present {
        return Found { backends: Vec::new(), absent: Some(FallbackReason::DriverNotFound) };
    }
    match catch_unwind(|| open_all(first)) {
        Ok(Ok(backends)) if !backends.is_empty() => Found { backends, absent: None },
        Ok(Ok(_)) => Found { backends: Vec::new(), absent: Some(FallbackReason::NoDevice("the driver lists no CUDA device".into())) },
        Ok(Err(why)) => Found { backends: Vec::new(), absent: Some(FallbackReason::NoDevice(why)) },
        Err(_) => Found {
            backends: Vec::new(),
            absent: Some(FallbackReason::NoDevice("the CUDA driver library lacks a function kiln needs (driver too old?)".into())),
        },
    }
}

/// The CUDA devices opened, for a read that must see a peer's fault (a
/// peer copy written by another device's stream).
static OPENED: std::sync::OnceLock<Vec<&'static CudaBackend>> = std::sync::OnceLock::new();

fn open_all(first: usize) -> std::result::Result<Vec<&'static dyn Backend>, String> {
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
        let mut opened: Vec<&'static CudaBackend> = Vec::new();
        for ordinal in 0..count.max(0) as usize {
            match CudaBackend::open(ordinal, Device::Gpu(first + backends.len())) {
                Ok(b) => {
                    let b: &'static CudaBackend = Box::leak(Box::new(b));
                    opened.push(b);
                    backends.push(b);
                }
                Err(e) => eprintln!("kiln: skipping CUDA device {ordinal}: {e}"),
            }
        }
        let _ = OPENED.set(opened);
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
            let backend = CudaBackend {
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
                fault: Mutex::new(None),
                fault_host: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
                blas_warned: std::sync::atomic::AtomicBool::new(false),
                modules: Mutex::new(HashMap::new()),
                functions: Mutex::new(HashMap::new()),
                blas: Mutex::new(None),
                dnn: Mutex::new(None),
                dnn_warned: std::sync::atomic::AtomicBool::new(false),
                dnn_create_failures: std::sync::atomic::AtomicU32::new(0),
                peers: Mutex::new(HashMap::new()),
                written: written::Written::default(),
            };
            // The fault record is page-locked host memory, made now, while
            // nothing is queued: CUDA lists page-locked allocation among the
            // calls that may synchronise implicitly, and made at the first
            // index-checking op it could make that op wait for queued work.
            // Should it fail here, the first such op tries again.
            let _ = backend.fault_ptr();
            Ok(backend)
        }
    }

    /// The end of a synchronising call that started at `mark` (after the
    /// stream was waited for): takes this device's fault, if any, poisoning
    /// what was written since here and on the devices this one copied into
    /// (`written.rs`). Without one, a fault pending on a device that copied
    /// into this one since the last clean point poisons this device's work
    /// since, and that device's, and is left for it to report.
    fn settle(&self, mark: u64) -> Result<()> {
        let peers = || OPENED.get().into_iter().flatten().filter(|p| p.ordinal != self.ordinal);
        let sources = self.written.sources();
        if sources != 0 {
            for peer in peers().filter(|p| sources & written::bit(p.ordinal) != 0) {
                if let Some(err) = peer.fault(false) {
                    peer.written.poison_all(&err);
                    self.written.poison_all(&err);
                }
            }
        }
        match self.written.settle(mark, || self.fault(true)) {
            Ok(()) => Ok(()),
            Err((err, fed)) => {
                for peer in peers().filter(|p| fed & written::bit(p.ordinal) != 0) {
                    peer.written.poison_all(&err);
                }
                Err(err)
            }
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

    /// Runs `f` with the context bound, turning a cudarc panic (missing
    /// symbol) into an error instead of unwinding into the caller.
    fn guarded<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.bind()?;
        catch_unwind(AssertUnwindSafe(f))
            .unwrap_or_else(|_| Err(self.err(format!("{what}: a CUDA library call panicked (missing library or symbol)"))))
    }

    // ---- kernels and libraries ---------------------------------------------
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

/// The device pointer of a storage that lives on a CUDA device.
pub(crate) fn dev_ptr(backend: &CudaBackend, storage: &Storage) -> Result<u64> {
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
        d.push(("kiln cache".to_string(), human_bytes(cached)));
        d.push(("cublas".to_string(), self.blas_status()));
        let dnn = self.dnn_status();
        d.push(("cudnn".to_string(), dnn.clone().unwrap_or_else(|why| format!("no: {why}"))));
        let gemm_or_direct = || match self.blas_status().as_str() {
            "yes" => "im2col + cuBLAS".to_string(),
            "not loaded yet" => "im2col + cuBLAS once cuBLAS loads (direct kernels without it)".to_string(),
            why => format!("direct kernels (cuBLAS {why})"),
        };
        let how =
            if dnn::benchmark() { "algorithms timed once per shape (KILN_CUDNN_BENCHMARK=1)" } else { "algorithms by its heuristics" };
        let conv = match crate::kernel::cuda::conv_path() {
            crate::kernel::cuda::ConvPath::Direct => "direct kernels (KILN_CUDA_CONV=direct)".to_string(),
            crate::kernel::cuda::ConvPath::Gemm => "im2col + cuBLAS (KILN_CUDA_CONV=gemm)".to_string(),
            crate::kernel::cuda::ConvPath::Dnn => format!("cuDNN, {how} (KILN_CUDA_CONV=cudnn)"),
            crate::kernel::cuda::ConvPath::Auto => match &dnn {
                Ok(_) => format!("cuDNN, {how}; {} for what cuDNN declines", gemm_or_direct()),
                Err(why) => format!("{} (cuDNN: {why})", gemm_or_direct()),
            },
        };
        d.push(("convolution".to_string(), conv));
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
        if let Buffer::Device(b) = buffer
            && let Ok(d) = b.downcast::<DevBuf>()
        {
            self.free_dev(*d);
        }
    }
    fn launch(&self, kernel: &Kernel<'_>, out: &Arc<Storage>) -> Result<()> {
        // A poisoned input poisons the output: the kernel would compute
        // from untrusted values. Nothing is launched.
        if let Some(fault) = kernel.input_fault() {
            out.poison(&fault);
            return Ok(());
        }
        // A bad index recorded by a kernel (a read of pinned memory, no
        // sync) is reported by the next synchronising call, once; the
        // kernels queued meanwhile still launch, and that call poisons
        // their outputs (`written.rs`).
        match self.guarded("kernel launch", || launch::run(self, kernel, out)) {
            Ok(()) => {
                if kernel.overwrites(out.len) {
                    out.recomputed();
                }
                self.written.push(out);
                Ok(())
            }
            Err(err) => {
                // It may have written part of `out` (an in-place op).
                out.poison(&err);
                Err(err)
            }
        }
    }
    fn launch_multi(&self, kernel: &dyn MultiKernel, parts: &[MultiPart<'_>]) -> Result<bool> {
        // A part with a poisoned input poisons its outputs and is left out,
        // as `launch` does for one kernel; the others run.
        let mut clean: Vec<&MultiPart<'_>> = Vec::with_capacity(parts.len());
        for part in parts {
            match part.input_fault() {
                Some(fault) => part.outs.iter().for_each(|(s, _)| s.poison(&fault)),
                None => clean.push(part),
            }
        }
        let result = if clean.is_empty() { Ok(()) } else { self.guarded(kernel.name(), || kernel.cuda(self, &clean)) };
        for (s, _) in clean.iter().flat_map(|p| &p.outs) {
            match &result {
                Ok(()) => self.written.push(s),
                // It may have written part of any output (an in-place update).
                Err(err) => s.poison(err),
            }
        }
        result.map(|()| true)
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
        let mark = self.written.mark();
        self.guarded("device-to-host copy", || {
            let dtype = src.storage.dtype;
            let n = src.layout.elem_count();
            let size = dtype.size_in_bytes();
            // The front end hands over contiguous views (a strided one is
            // made contiguous on this device first, by the copy op).
            let Some((a, _)) = src.layout.contiguous_range() else {
                return Err(self.err("a strided view reached download (a kiln bug: please report it)"));
            };
            let mut out = CpuBuffer::try_zeros(dtype, n)
                .ok_or_else(|| self.err(format!("cannot allocate {} of host memory to read {} elements back", human_bytes(n * size), n)))?;
            let base = dev_ptr(self, &src.storage)?;
            self.read_device(base + (a * size) as u64, host_bytes_mut(&mut out))?;
            // The read waited for the queue: report a bad index it met
            // (poisoning what was written since), or a poisoned source.
            let own = self.settle(mark);
            match own.err().or_else(|| src.storage.fault()) {
                Some(err) => Err(err),
                None => Ok(out),
            }
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
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn copy_to_peer(&self, src: &Src<'_>, dst: &'static dyn Backend) -> Result<Option<Arc<Storage>>> {
        let Some(peer) = dst.as_any().downcast_ref::<CudaBackend>() else { return Ok(None) };
        if peer.ordinal == self.ordinal || !self.peer_access(peer) {
            return Ok(None);
        }
        let out = super::alloc(dst, src.storage.dtype, src.layout.elem_count())?;
        if let Some(fault) = src.storage.fault() {
            // A poisoned source: the copy carries its fault, not its bytes.
            out.poison(&fault);
            return Ok(Some(out));
        }
        // Written by this device's stream: a fault found here later poisons
        // it, and the peer's work since.
        self.written.push(&out);
        self.written.fed(written::bit(peer.ordinal));
        peer.written.fed_by(written::bit(self.ordinal));
        let dst_ptr = dev_ptr(peer, &out)?;
        let queued = self.guarded("peer copy", || self.queue_peer_copy(src, peer, dst_ptr));
        if queued.is_err() {
            // The copy may be queued: `out` must not return to the cache before it ran.
            let _ = self.synchronize();
        }
        queued.map(|()| Some(out))
    }
    fn hold_queue(&self) -> Result<Option<QueueHold>> {
        self.guarded("holding the queue", || self.hold().map(Some))
    }
    fn communicator(&self) -> Option<&'static dyn crate::kernel::comm::Communicator> {
        nccl::get().ok().map(|n| n as &'static dyn crate::kernel::comm::Communicator)
    }
    fn why_no_communicator(&self) -> Option<String> {
        nccl::get().err().map(str::to_string)
    }
    fn process_comms(&self) -> std::result::Result<&'static dyn crate::kernel::comm::ProcessComms, String> {
        nccl::get().map(|n| n as &'static dyn crate::kernel::comm::ProcessComms).map_err(str::to_string)
    }
    fn synchronize(&self) -> Result<()> {
        let mark = self.written.mark();
        self.guarded("cuStreamSynchronize", || {
            // SAFETY: the stream is alive.
            ck(unsafe { cu::cuStreamSynchronize(self.stream.0) }, "cuStreamSynchronize").map_err(|e| self.err(e))?;
            match self.settle(mark).err() {
                Some(err) => Err(err),
                None => Ok(()),
            }
        })
    }
}
