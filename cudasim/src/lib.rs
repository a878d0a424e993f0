//! cudasim: a CUDA driver API and cuBLAS simulator for kiln's tests.
//!
//! Built as a shared library that exports the subset of `libcuda.so` and
//! `libcublas.so` that cudarc's dynamic loading resolves for kiln, so that
//! kiln's unchanged CUDA backend runs on the CPU when `scripts/cudasim.sh`
//! puts this library first on `LD_LIBRARY_PATH` (as `libcuda.so` and
//! `libcublas.so`) and sets `KILN_CUDASIM=1`. See README.md for what it
//! proves and what it cannot.
//!
//! Model: per-thread current context; one primary context per device; streams
//! run in order on worker threads, asynchronously to the host; events;
//! async copies happen when the stream reaches them; device memory is kept
//! apart from host memory, poisoned (0xFF bytes) on allocation and on free,
//! and every pointer a kernel, copy or gemm uses is checked against live
//! allocations of a device it may access; a fault is sticky for the context,
//! as on a GPU.
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

mod blas;
mod exec;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

pub type CUresult = c_uint;
pub type CUdeviceptr = u64;

pub const SUCCESS: CUresult = 0;
pub const INVALID_VALUE: CUresult = 1;
pub const OUT_OF_MEMORY: CUresult = 2;
pub const NOT_INITIALIZED: CUresult = 3;
pub const NO_DEVICE: CUresult = 100;
pub const INVALID_DEVICE: CUresult = 101;
pub const INVALID_IMAGE: CUresult = 200;
pub const INVALID_CONTEXT: CUresult = 201;
pub const PEER_ACCESS_UNSUPPORTED: CUresult = 217;
pub const INVALID_HANDLE: CUresult = 400;
pub const NOT_FOUND: CUresult = 500;
pub const NOT_READY: CUresult = 600;
pub const ILLEGAL_ADDRESS: CUresult = 700;
pub const LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
pub const PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
pub const PEER_ACCESS_NOT_ENABLED: CUresult = 705;
pub const LAUNCH_FAILED: CUresult = 719;
pub const NOT_SUPPORTED: CUresult = 801;

const POISON: u8 = 0xFF;
const ALIGN: usize = 256;
/// Freed device memory stays mapped (poisoned) up to this many bytes, so that
/// a stale pointer reads poison rather than another allocation.
const QUARANTINE: usize = 256 << 20;

fn log(msg: &str) {
    if std::env::var("KILN_CUDASIM_QUIET").map(|v| v != "1").unwrap_or(true) {
        eprintln!("cudasim: {msg}");
    }
}

fn env_bytes(name: &str, default: usize) -> usize {
    let Ok(v) = std::env::var(name) else { return default };
    let v = v.trim().to_ascii_lowercase();
    let (num, mul) = if let Some(n) = v.strip_suffix("gib").or_else(|| v.strip_suffix('g')) {
        (n, 1usize << 30)
    } else if let Some(n) = v.strip_suffix("mib").or_else(|| v.strip_suffix('m')) {
        (n, 1 << 20)
    } else if let Some(n) = v.strip_suffix("kib").or_else(|| v.strip_suffix('k')) {
        (n, 1 << 10)
    } else {
        (v.as_str(), 1)
    };
    match num.trim().parse::<usize>() {
        Ok(n) => n.saturating_mul(mul),
        Err(_) => {
            log(&format!("{name}={v} is not a size (e.g. 512MiB); using {default}"));
            default
        }
    }
}

// ---- fault injection and what tests may ask ------------------------------------

/// `KILN_CUDASIM_FAIL=name:N[,name:N...]`: the first N calls of each named
/// entry point fail (read once per process). Entry points that can be made
/// to fail: `cuMemAlloc_v2`, `cuMemFree_v2`, `cuMemAllocHost_v2`,
/// `cuEventCreate` and `cublasCreate_v2`.
pub(crate) fn injected_failure(name: &str) -> bool {
    static FAILS: OnceLock<Mutex<HashMap<String, u64>>> = OnceLock::new();
    let fails = FAILS.get_or_init(|| {
        let mut m = HashMap::new();
        for item in std::env::var("KILN_CUDASIM_FAIL").unwrap_or_default().split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match item.split_once(':').and_then(|(n, c)| c.trim().parse::<u64>().ok().map(|c| (n.trim().to_string(), c))) {
                Some((n, c)) => {
                    m.insert(n, c);
                }
                None => log(&format!("KILN_CUDASIM_FAIL: `{item}` is not name:count; ignored")),
            }
        }
        Mutex::new(m)
    });
    let mut fails = lock(fails);
    match fails.get_mut(name) {
        Some(left) if *left > 0 => {
            *left -= 1;
            log(&format!("{name}: failing as KILN_CUDASIM_FAIL asks"));
            true
        }
        _ => false,
    }
}

/// Per kernel name: (launches, grid of the last launch).
fn launches() -> &'static Mutex<HashMap<String, (u64, u32)>> {
    static L: OnceLock<Mutex<HashMap<String, (u64, u32)>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashMap::new()))
}

/// cuBLAS gemms queued so far.
pub(crate) static GEMMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What a test may ask the simulator (it finds this function with `dlsym`
/// in the loaded `libcuda.so`): `pinned_bytes` and `pinned_blocks` (live
/// page-locked host memory), `events` (live events), `gemms` (cuBLAS gemms
/// queued), `launches:NAME` and `grid:NAME` (launches of kernel NAME, and
/// the grid of the last one), `device_bytes:N` (device N's memory in use).
/// -1 for a question it does not know.
#[no_mangle]
pub unsafe extern "C" fn kiln_cudasim_stat(what: *const c_char) -> i64 {
    if what.is_null() {
        return -1;
    }
    let what = CStr::from_ptr(what).to_string_lossy();
    let Some(sim) = sim() else { return -1 };
    let mem = || lock(&sim.mem);
    match what.split_once(':') {
        None => match what.as_ref() {
            "pinned_bytes" => mem().host_bytes as i64,
            "pinned_blocks" => mem().host.len() as i64,
            "events" => registry().events.len() as i64,
            "gemms" => GEMMS.load(Ordering::SeqCst) as i64,
            _ => -1,
        },
        Some(("launches", name)) => lock(launches()).get(name).map(|l| l.0 as i64).unwrap_or(0),
        Some(("grid", name)) => lock(launches()).get(name).map(|l| l.1 as i64).unwrap_or(0),
        Some(("device_bytes", dev)) => dev.parse::<usize>().ok().and_then(|d| mem().used.get(d).copied()).map(|b| b as i64).unwrap_or(-1),
        _ => -1,
    }
}

// ---- devices and contexts ---------------------------------------------------

pub(crate) struct Ctx {
    pub dev: usize,
    /// The first fault of this context (sticky, as on a GPU).
    sticky: Mutex<Option<(CUresult, String)>>,
    default_stream: OnceLock<Arc<Stream>>,
}

impl Ctx {
    fn fault(&self, code: CUresult, msg: String) {
        let mut s = lock(&self.sticky);
        if s.is_none() {
            log(&format!("device {}: {msg} (the context is now unusable, as on a GPU)", self.dev));
            *s = Some((code, msg));
        }
    }
    fn sticky(&self) -> CUresult {
        lock(&self.sticky).as_ref().map(|(c, _)| *c).unwrap_or(SUCCESS)
    }
    fn default_stream(&'static self) -> Arc<Stream> {
        self.default_stream.get_or_init(|| Stream::new(self)).clone()
    }
}

struct Device {
    capacity: usize,
    /// Memory held outside this process (`KILN_CUDASIM_RESERVED`): counted
    /// as used by cuMemGetInfo and unavailable to cuMemAlloc.
    reserved: usize,
    ctx: &'static Ctx,
    /// peers[j]: this device's kernels and copies may touch device j's memory.
    peers: Mutex<Vec<bool>>,
}

struct Sim {
    devices: Vec<Device>,
    sms: i32,
    cc: (i32, i32),
    mem: Mutex<Mem>,
}

#[derive(Default)]
struct Mem {
    /// Live device allocations: base -> (len, device).
    dev: BTreeMap<u64, (usize, usize)>,
    used: Vec<usize>,
    /// Freed allocations still mapped: base -> (len, device).
    freed: BTreeMap<u64, (usize, usize)>,
    freed_order: VecDeque<u64>,
    freed_bytes: usize,
    /// Page-locked host allocations: base -> len.
    host: BTreeMap<u64, usize>,
    host_bytes: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn sim() -> Option<&'static Sim> {
    static SIM: OnceLock<Option<Sim>> = OnceLock::new();
    SIM.get_or_init(|| {
        if std::env::var("KILN_CUDASIM").map(|v| v != "1").unwrap_or(true) {
            return None;
        }
        let n = std::env::var("KILN_CUDASIM_DEVICES").ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(2);
        let capacity = env_bytes("KILN_CUDASIM_MEMORY", 1 << 30);
        let reserved = env_bytes("KILN_CUDASIM_RESERVED", 0).min(capacity);
        let sms = std::env::var("KILN_CUDASIM_SMS").ok().and_then(|v| v.trim().parse::<i32>().ok()).unwrap_or(2).max(1);
        let devices = (0..n)
            .map(|dev| Device {
                capacity,
                reserved,
                ctx: Box::leak(Box::new(Ctx { dev, sticky: Mutex::new(None), default_stream: OnceLock::new() })),
                peers: Mutex::new(vec![false; n]),
            })
            .collect();
        let mem = Mem { used: vec![0; n], ..Mem::default() };
        Some(Sim { devices, sms, cc: (9, 0), mem: Mutex::new(mem) })
    })
    .as_ref()
}

static INITIALIZED: AtomicU32 = AtomicU32::new(0);

fn initialized() -> Result<&'static Sim, CUresult> {
    if INITIALIZED.load(Ordering::Acquire) == 0 {
        return Err(NOT_INITIALIZED);
    }
    sim().ok_or(NOT_INITIALIZED)
}

thread_local! {
    static CURRENT: std::cell::Cell<Option<&'static Ctx>> = const { std::cell::Cell::new(None) };
}

fn current() -> Result<&'static Ctx, CUresult> {
    let sim = initialized()?;
    let ctx = CURRENT.with(|c| c.get()).ok_or(INVALID_CONTEXT)?;
    let _ = sim;
    match ctx.sticky() {
        SUCCESS => Ok(ctx),
        e => Err(e),
    }
}

fn ctx_from(h: *mut c_void) -> Option<&'static Ctx> {
    let sim = sim()?;
    sim.devices.iter().map(|d| d.ctx).find(|c| std::ptr::eq(*c as *const Ctx as *const c_void, h))
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

// ---- memory -------------------------------------------------------------------

/// Where a device address lies: (device, bytes from there to the end of its
/// allocation), or why it is not usable.
fn resolve(mem: &Mem, p: u64) -> Result<(usize, usize), String> {
    if let Some((&base, &(len, dev))) = mem.dev.range(..=p).next_back() {
        if p <= base + len as u64 {
            return Ok((dev, (base + len as u64 - p) as usize));
        }
    }
    if let Some((&base, &(len, dev))) = mem.freed.range(..=p).next_back() {
        if p < base + len.max(1) as u64 {
            return Err(format!("0x{p:x} is device {dev} memory that was freed (use after free)"));
        }
    }
    if let Some((&base, &len)) = mem.host.range(..=p).next_back() {
        if p < base + len as u64 {
            return Err(format!("0x{p:x} is page-locked host memory, not device memory"));
        }
    }
    Err(format!("0x{p:x} is not device memory (a host pointer or garbage)"))
}

/// Checks that `[p, p+len)` is live memory of a device that `dev` may access.
fn check_range(sim: &Sim, dev: usize, p: u64, len: usize, what: &str) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    let mem = lock(&sim.mem);
    let (owner, avail) = resolve(&mem, p).map_err(|e| format!("{what}: {e}"))?;
    drop(mem);
    if avail < len {
        return Err(format!("{what}: {len} bytes at 0x{p:x} run {} bytes past the end of its allocation", len - avail));
    }
    if owner != dev && !lock(&sim.devices[dev].peers)[owner] {
        return Err(format!(
            "{what}: 0x{p:x} is memory of device {owner}, used from device {dev} without peer access (cuCtxEnablePeerAccess)"
        ));
    }
    Ok(())
}

fn check_host(sim: &Sim, p: *const c_void, len: usize, what: &str) -> Result<(), String> {
    if len > 0 && p.is_null() {
        return Err(format!("{what}: null host pointer"));
    }
    let mem = lock(&sim.mem);
    if let Some((&base, &(alen, dev))) = mem.dev.range(..=(p as u64)).next_back() {
        if (p as u64) < base + alen as u64 {
            return Err(format!("{what}: 0x{:x} is device {dev} memory, passed where host memory is expected", p as u64));
        }
    }
    Ok(())
}

fn layout(len: usize) -> Option<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(len.max(1), ALIGN).ok()
}

// ---- streams --------------------------------------------------------------------

pub(crate) enum Op {
    Kernel { name: String, index: usize, grid: u32, block: u32, args: Vec<Vec<u64>>, ptrs: Vec<usize> },
    HtoD { dst: u64, src: usize, len: usize },
    DtoH { dst: usize, src: u64, len: usize },
    DtoD { dst: u64, dst_dev: usize, src: u64, src_dev: usize, len: usize },
    Memset { dst: u64, value: u8, len: usize },
    Wait { stream: Arc<Stream>, ticket: u64 },
    WaitValue { addr: usize, value: u32, flags: u32 },
    Gemm(blas::Gemm),
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    submitted: u64,
    done: u64,
    closing: bool,
}

pub(crate) struct Stream {
    pub ctx: &'static Ctx,
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Stream {
    fn new(ctx: &'static Ctx) -> Arc<Stream> {
        let s = Arc::new(Stream { ctx, q: Mutex::new(Queue::default()), cv: Condvar::new() });
        let worker = s.clone();
        let spawned = std::thread::Builder::new().name(format!("cudasim-dev{}", ctx.dev)).spawn(move || worker.serve());
        if let Err(e) = spawned {
            ctx.fault(LAUNCH_FAILED, format!("cannot start a stream worker thread: {e}"));
        }
        s
    }

    pub(crate) fn push(&self, op: Op) -> u64 {
        let mut q = lock(&self.q);
        q.ops.push_back(op);
        q.submitted += 1;
        self.cv.notify_all();
        q.submitted
    }

    /// The ticket of the last op submitted so far.
    fn ticket(&self) -> u64 {
        lock(&self.q).submitted
    }

    fn wait_for(&self, ticket: u64) {
        let mut q = lock(&self.q);
        while q.done < ticket {
            q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn reached(&self, ticket: u64) -> bool {
        lock(&self.q).done >= ticket
    }

    fn serve(self: Arc<Self>) {
        loop {
            let op = {
                let mut q = lock(&self.q);
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        break op;
                    }
                    if q.closing {
                        return;
                    }
                    q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            if self.ctx.sticky() == SUCCESS {
                if let Err((code, msg)) = self.run(op) {
                    self.ctx.fault(code, msg);
                }
            }
            let mut q = lock(&self.q);
            q.done += 1;
            self.cv.notify_all();
        }
    }

    fn run(&self, op: Op) -> Result<(), (CUresult, String)> {
        let sim = sim().ok_or((NOT_INITIALIZED, "no simulator".to_string()))?;
        let dev = self.ctx.dev;
        let bad = |m: String| (ILLEGAL_ADDRESS, m);
        match op {
            Op::Kernel { name, index, grid, block, mut args, ptrs } => {
                for &i in &ptrs {
                    let p = args[i][0];
                    if p != 0 {
                        check_range(sim, dev, p, 1, &format!("kernel {name}, argument {i}")).map_err(bad)?;
                    }
                }
                let params: Vec<*mut c_void> = args.iter_mut().map(|a| a.as_mut_ptr() as *mut c_void).collect();
                exec::run_grid(index, grid, block, &params).map_err(|e| (LAUNCH_OUT_OF_RESOURCES, format!("kernel {name}: {e}")))
            }
            Op::HtoD { dst, src, len } => {
                check_range(sim, dev, dst, len, "cuMemcpyHtoDAsync destination").map_err(bad)?;
                // SAFETY: the caller promised `len` readable host bytes at `src`
                // until the stream reaches this copy.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                Ok(())
            }
            Op::DtoH { dst, src, len } => {
                check_range(sim, dev, src, len, "cuMemcpyDtoHAsync source").map_err(bad)?;
                // SAFETY: as above, `len` writable host bytes at `dst`.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                Ok(())
            }
            Op::DtoD { dst, dst_dev, src, src_dev, len } => {
                check_range(sim, dst_dev, dst, len, "device copy destination").map_err(bad)?;
                check_range(sim, src_dev, src, len, "device copy source").map_err(bad)?;
                // SAFETY: both ranges checked live above.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                Ok(())
            }
            Op::Memset { dst, value, len } => {
                check_range(sim, dev, dst, len, "cuMemsetD8Async").map_err(bad)?;
                // SAFETY: checked live above.
                unsafe { std::ptr::write_bytes(dst as *mut u8, value, len) };
                Ok(())
            }
            Op::Wait { stream, ticket } => {
                stream.wait_for(ticket);
                Ok(())
            }
            Op::WaitValue { addr, value, flags } => {
                loop {
                    // SAFETY: page-locked host memory mapped for the device,
                    // checked at submission; read as the GPU would, volatile.
                    let v = unsafe { std::ptr::read_volatile(addr as *const u32) };
                    let ok = match flags & 3 {
                        0 => (v as i32).wrapping_sub(value as i32) >= 0,
                        1 => v == value,
                        2 => v & value != 0,
                        _ => !(v | value) != 0,
                    };
                    if ok {
                        return Ok(());
                    }
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
            }
            Op::Gemm(g) => g.run(sim, dev).map_err(bad),
        }
    }
}

struct Registry {
    streams: HashMap<usize, Arc<Stream>>,
    events: HashSet<usize>,
    modules: HashMap<usize, Module>,
    functions: HashMap<usize, Function>,
}

fn registry() -> MutexGuard<'static, Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    lock(R.get_or_init(|| {
        Mutex::new(Registry { streams: HashMap::new(), events: HashSet::new(), modules: HashMap::new(), functions: HashMap::new() })
    }))
}

/// The stream behind a handle (null: the context's default stream).
pub(crate) fn stream_of(h: *mut c_void, ctx: &'static Ctx) -> Result<Arc<Stream>, CUresult> {
    if h.is_null() || h as usize == 1 || h as usize == 2 {
        return Ok(ctx.default_stream());
    }
    registry().streams.get(&(h as usize)).cloned().ok_or(INVALID_HANDLE)
}

/// A stream of the current context, as every stream call requires.
fn stream_here(h: *mut c_void) -> Result<(&'static Ctx, Arc<Stream>), CUresult> {
    let ctx = current()?;
    let s = stream_of(h, ctx)?;
    if !std::ptr::eq(s.ctx, ctx) {
        log(&format!("a stream of device {} used while device {}'s context is current", s.ctx.dev, ctx.dev));
        return Err(INVALID_HANDLE);
    }
    Ok((ctx, s))
}

struct EventState {
    recorded: Option<(Arc<Stream>, u64)>,
}

struct Module {
    ctx: &'static Ctx,
    names: HashSet<String>,
}

struct Function {
    ctx: &'static Ctx,
    name: String,
}

// ---- the driver API -------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return INVALID_VALUE;
    }
    if sim().is_none() {
        // Never selected by accident: only with KILN_CUDASIM=1.
        return NO_DEVICE;
    }
    if exec::table().is_empty() {
        return NO_DEVICE;
    }
    INITIALIZED.store(1, Ordering::Release);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    if v.is_null() {
        return INVALID_VALUE;
    }
    *v = 12090;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    let sim = tri!(initialized());
    if n.is_null() {
        return INVALID_VALUE;
    }
    *n = sim.devices.len() as c_int;
    SUCCESS
}

fn device(ordinal: c_int) -> Result<(&'static Sim, &'static Device), CUresult> {
    let sim = initialized()?;
    let d = usize::try_from(ordinal).ok().and_then(|o| sim.devices.get(o)).ok_or(INVALID_DEVICE)?;
    Ok((sim, d))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CUresult {
    tri!(device(ordinal));
    if dev.is_null() {
        return INVALID_VALUE;
    }
    *dev = ordinal;
    SUCCESS
}

unsafe fn write_cstr(dst: *mut c_char, cap: c_int, s: &str) -> CUresult {
    if dst.is_null() || cap <= 0 {
        return INVALID_VALUE;
    }
    let bytes = s.as_bytes();
    let n = bytes.len().min(cap as usize - 1);
    std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, dst, n);
    *dst.add(n) = 0;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    let (sim, d) = tri!(device(dev));
    let gib = d.capacity as f64 / (1u64 << 30) as f64;
    write_cstr(name, len, &format!("kiln cudasim {dev} (simulated sm_{}{}, {gib:.2} GiB)", sim.cc.0, sim.cc.1))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CUresult {
    let (_, d) = tri!(device(dev));
    if bytes.is_null() {
        return INVALID_VALUE;
    }
    *bytes = d.capacity;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> CUresult {
    let (sim, _) = tri!(device(dev));
    if v.is_null() {
        return INVALID_VALUE;
    }
    *v = match attr {
        1 => 1024,      // max threads per block
        2..=4 => 65535, // max block dims
        5 => i32::MAX,  // max grid dim x
        6 | 7 => 65535, // max grid dims y, z
        8 => 48 * 1024, // shared memory per block
        10 => 32,       // warp size
        16 => sim.sms,  // multiprocessors
        41 => 1,        // unified addressing
        75 => sim.cc.0, // compute capability
        76 => sim.cc.1,
        92 => 1, // stream memory operations
        _ => 0,
    };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    tri!(device(dev));
    write_cstr(bus, len, &format!("0000:{:02x}:00.0", 0xc0 + dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: c_int, peer: c_int) -> CUresult {
    tri!(device(dev));
    tri!(device(peer));
    if can.is_null() {
        return INVALID_VALUE;
    }
    *can = (dev != peer) as c_int;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CUresult {
    let (_, d) = tri!(device(dev));
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    *ctx = d.ctx as *const Ctx as *mut c_void;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    tri!(device(dev));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CUresult {
    tri!(initialized());
    if ctx.is_null() {
        CURRENT.with(|c| c.set(None));
        return SUCCESS;
    }
    match ctx_from(ctx) {
        Some(c) => {
            CURRENT.with(|cur| cur.set(Some(c)));
            SUCCESS
        }
        None => INVALID_CONTEXT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CUresult {
    tri!(initialized());
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    *ctx = CURRENT.with(|c| c.get()).map(|c| c as *const Ctx as *mut c_void).unwrap_or(std::ptr::null_mut());
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CUresult {
    let ctx = tri!(current());
    if dev.is_null() {
        return INVALID_VALUE;
    }
    *dev = ctx.dev as c_int;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    let ctx = tri!(current());
    let streams: Vec<Arc<Stream>> = registry().streams.values().filter(|s| std::ptr::eq(s.ctx, ctx)).cloned().collect();
    for s in streams.iter().chain(std::iter::once(&ctx.default_stream())) {
        s.wait_for(s.ticket());
    }
    ctx.sticky()
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: *mut c_void, flags: c_uint) -> CUresult {
    let ctx = tri!(current());
    let sim = tri!(initialized());
    if flags != 0 {
        return INVALID_VALUE;
    }
    let Some(p) = ctx_from(peer) else { return INVALID_CONTEXT };
    if p.dev == ctx.dev {
        return PEER_ACCESS_UNSUPPORTED;
    }
    let mut peers = lock(&sim.devices[ctx.dev].peers);
    if peers[p.dev] {
        return PEER_ACCESS_ALREADY_ENABLED;
    }
    peers[p.dev] = true;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peer: *mut c_void) -> CUresult {
    let ctx = tri!(current());
    let sim = tri!(initialized());
    let Some(p) = ctx_from(peer) else { return INVALID_CONTEXT };
    let mut peers = lock(&sim.devices[ctx.dev].peers);
    if !peers[p.dev] {
        return PEER_ACCESS_NOT_ENABLED;
    }
    peers[p.dev] = false;
    SUCCESS
}

// ---- memory ---------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    let ctx = tri!(current());
    let sim = tri!(initialized());
    if ptr.is_null() || bytes == 0 {
        return INVALID_VALUE;
    }
    let d = &sim.devices[ctx.dev];
    let mut mem = lock(&sim.mem);
    if mem.used[ctx.dev].saturating_add(d.reserved).saturating_add(bytes) > d.capacity || injected_failure("cuMemAlloc_v2") {
        return OUT_OF_MEMORY;
    }
    let Some(l) = layout(bytes) else { return OUT_OF_MEMORY };
    let p = std::alloc::alloc(l);
    if p.is_null() {
        return OUT_OF_MEMORY;
    }
    std::ptr::write_bytes(p, POISON, bytes);
    mem.used[ctx.dev] += bytes;
    mem.dev.insert(p as u64, (bytes, ctx.dev));
    *ptr = p as u64;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    let ctx = tri!(current());
    let sim = tri!(initialized());
    if ptr == 0 {
        return SUCCESS;
    }
    let mut mem = lock(&sim.mem);
    let Some(&(len, dev)) = mem.dev.get(&ptr) else {
        let why = resolve(&mem, ptr).err().unwrap_or_else(|| format!("0x{ptr:x} is not the start of an allocation"));
        drop(mem);
        log(&format!("cuMemFree: {why}"));
        return INVALID_VALUE;
    };
    if dev != ctx.dev {
        drop(mem);
        log(&format!("cuMemFree of device {dev} memory while device {}'s context is current", ctx.dev));
        return INVALID_CONTEXT;
    }
    if injected_failure("cuMemFree_v2") {
        // The block stays allocated, as after a failed free on a GPU.
        return INVALID_VALUE;
    }
    mem.dev.remove(&ptr);
    mem.used[dev] -= len;
    // Poisoned and kept mapped for a while, so that work still queued on it
    // reads poison (and is reported) instead of another tensor's data.
    std::ptr::write_bytes(ptr as *mut u8, POISON, len);
    mem.freed.insert(ptr, (len, dev));
    mem.freed_order.push_back(ptr);
    mem.freed_bytes += len;
    while mem.freed_bytes > QUARANTINE {
        let Some(old) = mem.freed_order.pop_front() else { break };
        if let Some((l, _)) = mem.freed.remove(&old) {
            mem.freed_bytes -= l;
            if let Some(lay) = layout(l) {
                std::alloc::dealloc(old as *mut u8, lay);
            }
        }
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let ctx = tri!(current());
    let sim = tri!(initialized());
    if free.is_null() || total.is_null() {
        return INVALID_VALUE;
    }
    let d = &sim.devices[ctx.dev];
    *total = d.capacity;
    *free = d.capacity.saturating_sub(d.reserved).saturating_sub(lock(&sim.mem).used[ctx.dev]);
    SUCCESS
}

unsafe fn host_alloc(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    let _ = tri!(current());
    let sim = tri!(initialized());
    if pp.is_null() {
        return INVALID_VALUE;
    }
    let limit = env_bytes("KILN_CUDASIM_PINNED", usize::MAX);
    let mut mem = lock(&sim.mem);
    if mem.host_bytes.saturating_add(bytes) > limit {
        return OUT_OF_MEMORY;
    }
    let Some(l) = layout(bytes) else { return OUT_OF_MEMORY };
    let p = std::alloc::alloc(l);
    if p.is_null() {
        return OUT_OF_MEMORY;
    }
    std::ptr::write_bytes(p, POISON, bytes.max(1));
    mem.host.insert(p as u64, bytes.max(1));
    mem.host_bytes += bytes;
    *pp = p as *mut c_void;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    if injected_failure("cuMemAllocHost_v2") {
        return OUT_OF_MEMORY;
    }
    host_alloc(pp, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    host_alloc(pp, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(d: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) -> CUresult {
    let _ = tri!(current());
    let sim = tri!(initialized());
    if d.is_null() || flags != 0 {
        return INVALID_VALUE;
    }
    let mem = lock(&sim.mem);
    match mem.host.range(..=(p as u64)).next_back() {
        Some((&base, &len)) if (p as u64) < base + len as u64 => {
            *d = p as u64;
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    let sim = tri!(initialized());
    let mut mem = lock(&sim.mem);
    let Some(len) = mem.host.remove(&(p as u64)) else { return INVALID_VALUE };
    mem.host_bytes -= len;
    if let Some(l) = layout(len) {
        std::alloc::dealloc(p as *mut u8, l);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, len: usize, stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    if let Err(e) =
        check_range(sim, ctx.dev, dst, len, "cuMemcpyHtoDAsync destination").and(check_host(sim, src, len, "cuMemcpyHtoDAsync source"))
    {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        // The host bytes are read when the stream gets there, as a DMA from
        // page-locked memory would: reusing the buffer before then is a bug.
        s.push(Op::HtoD { dst, src: src as usize, len });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, len: usize, stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    if let Err(e) =
        check_range(sim, ctx.dev, src, len, "cuMemcpyDtoHAsync source").and(check_host(sim, dst, len, "cuMemcpyDtoHAsync destination"))
    {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        s.push(Op::DtoH { dst: dst as usize, src, len });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, len: usize) -> CUresult {
    let ctx = tri!(current());
    let r = cuMemcpyHtoDAsync_v2(dst, src, len, std::ptr::null_mut());
    if r != SUCCESS {
        return r;
    }
    let s = ctx.default_stream();
    s.wait_for(s.ticket());
    ctx.sticky()
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, len: usize) -> CUresult {
    let ctx = tri!(current());
    let r = cuMemcpyDtoHAsync_v2(dst, src, len, std::ptr::null_mut());
    if r != SUCCESS {
        return r;
    }
    let s = ctx.default_stream();
    s.wait_for(s.ticket());
    ctx.sticky()
}

fn owner(sim: &Sim, p: u64) -> Option<usize> {
    resolve(&lock(&sim.mem), p).ok().map(|(d, _)| d)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, len: usize, stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    // Unified addressing: either side may be another device's memory (the
    // driver copies between devices with or without peer access).
    let src_dev = owner(sim, src).unwrap_or(ctx.dev);
    let dst_dev = owner(sim, dst).unwrap_or(ctx.dev);
    let checked = check_range(sim, dst_dev, dst, len, "cuMemcpyDtoDAsync destination").and(check_range(
        sim,
        src_dev,
        src,
        len,
        "cuMemcpyDtoDAsync source",
    ));
    if let Err(e) = checked {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        s.push(Op::DtoD { dst, dst_dev, src, src_dev, len });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: CUdeviceptr,
    dst_ctx: *mut c_void,
    src: CUdeviceptr,
    src_ctx: *mut c_void,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    let (_, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    let (Some(dc), Some(sc)) = (ctx_from(dst_ctx), ctx_from(src_ctx)) else { return INVALID_CONTEXT };
    // Peer copies need no peer access: the driver stages them if it must.
    let checked = check_range(sim, dc.dev, dst, len, "cuMemcpyPeerAsync destination").and(check_range(
        sim,
        sc.dev,
        src,
        len,
        "cuMemcpyPeerAsync source",
    ));
    if let Err(e) = checked {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        // Run by the stream's worker; ranges re-checked against their own
        // devices when it gets there.
        s.push(Op::DtoD { dst, dst_dev: dc.dev, src, src_dev: sc.dev, len });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, value: u8, len: usize, stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    if let Err(e) = check_range(sim, ctx.dev, dst, len, "cuMemsetD8Async") {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        s.push(Op::Memset { dst, value, len });
    }
    SUCCESS
}

// ---- streams and events -------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut *mut c_void, flags: c_uint) -> CUresult {
    let ctx = tri!(current());
    if out.is_null() || flags > 1 {
        return INVALID_VALUE;
    }
    let s = Stream::new(ctx);
    let h = Arc::as_ptr(&s) as *mut c_void;
    registry().streams.insert(h as usize, s);
    *out = h;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    tri!(initialized());
    let Some(s) = registry().streams.remove(&(stream as usize)) else { return INVALID_HANDLE };
    let mut q = lock(&s.q);
    q.closing = true;
    s.cv.notify_all();
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    s.wait_for(s.ticket());
    ctx.sticky()
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    match ctx.sticky() {
        SUCCESS if s.reached(s.ticket()) => SUCCESS,
        SUCCESS => NOT_READY,
        e => e,
    }
}

fn event(h: *mut c_void) -> Result<&'static Mutex<EventState>, CUresult> {
    if h.is_null() || !registry().events.contains(&(h as usize)) {
        return Err(INVALID_HANDLE);
    }
    // SAFETY: registered handles are live boxes of Mutex<EventState>.
    Ok(unsafe { &*(h as *const Mutex<EventState>) })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut *mut c_void, _flags: c_uint) -> CUresult {
    let _ = tri!(current());
    if out.is_null() {
        return INVALID_VALUE;
    }
    if injected_failure("cuEventCreate") {
        return OUT_OF_MEMORY;
    }
    let h = Box::into_raw(Box::new(Mutex::new(EventState { recorded: None }))) as *mut c_void;
    registry().events.insert(h as usize);
    *out = h;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(ev: *mut c_void) -> CUresult {
    tri!(initialized());
    if !registry().events.remove(&(ev as usize)) {
        return INVALID_HANDLE;
    }
    drop(Box::from_raw(ev as *mut Mutex<EventState>));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(ev: *mut c_void, stream: *mut c_void) -> CUresult {
    let (_, s) = tri!(stream_here(stream));
    let e = tri!(event(ev));
    let ticket = s.ticket();
    lock(e).recorded = Some((s, ticket));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(ev: *mut c_void) -> CUresult {
    tri!(initialized());
    let e = tri!(event(ev));
    let rec = lock(e).recorded.clone();
    if let Some((s, t)) = rec {
        s.wait_for(t);
        return s.ctx.sticky();
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(ev: *mut c_void) -> CUresult {
    tri!(initialized());
    let e = tri!(event(ev));
    let rec = lock(e).recorded.clone();
    match rec {
        Some((s, t)) if !s.reached(t) => NOT_READY,
        Some((s, _)) => s.ctx.sticky(),
        None => SUCCESS,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(stream: *mut c_void, ev: *mut c_void, _flags: c_uint) -> CUresult {
    let (_, s) = tri!(stream_here(stream));
    let e = tri!(event(ev));
    let rec = lock(e).recorded.clone();
    if let Some((other, ticket)) = rec {
        if !Arc::ptr_eq(&other, &s) {
            s.push(Op::Wait { stream: other, ticket });
        }
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitValue32_v2(stream: *mut c_void, addr: CUdeviceptr, value: u32, flags: c_uint) -> CUresult {
    let (_, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    let mem = lock(&sim.mem);
    let ok = matches!(mem.host.range(..=addr).next_back(), Some((&b, &l)) if addr + 4 <= b + l as u64);
    drop(mem);
    if !ok || addr & 3 != 0 || flags > 3 {
        log(&format!("cuStreamWaitValue32: 0x{addr:x} is not 4 aligned bytes of mapped page-locked host memory"));
        return INVALID_VALUE;
    }
    s.push(Op::WaitValue { addr: addr as usize, value, flags });
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitValue32(stream: *mut c_void, addr: CUdeviceptr, value: u32, flags: c_uint) -> CUresult {
    cuStreamWaitValue32_v2(stream, addr, value, flags)
}

// ---- modules and launches -------------------------------------------------------------

/// The kernel names an image defines: `.entry` lines of PTX, or the symbols
/// of a cubin (ELF) that the host-compiled table knows.
fn image_kernels(image: &[u8]) -> Result<HashSet<String>, String> {
    let table = exec::table();
    if image.starts_with(b"\x7fELF") {
        let found: HashSet<String> = table
            .keys()
            .filter(|n| {
                let needle = [&b"\0"[..], n.as_bytes(), &b"\0"[..]].concat();
                image.windows(needle.len()).any(|w| w == needle.as_slice())
            })
            .cloned()
            .collect();
        return Ok(found);
    }
    let text = std::str::from_utf8(image).map_err(|_| "the image is neither a cubin (ELF) nor PTX text".to_string())?;
    if !text.contains(".version") || !text.contains(".target") {
        return Err("the image is neither a cubin (ELF) nor PTX (no .version/.target)".into());
    }
    let mut names = HashSet::new();
    for line in text.lines() {
        if let Some(at) = line.find(".entry ") {
            let name: String = line[at + 7..].trim().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    Ok(names)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> CUresult {
    let ctx = tri!(current());
    if module.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    let bytes: &[u8] = if std::slice::from_raw_parts(image as *const u8, 4) == b"\x7fELF" {
        // An ELF image: its size is e_shoff + e_shnum * e_shentsize.
        let hdr = std::slice::from_raw_parts(image as *const u8, 64);
        let shoff = u64::from_le_bytes(hdr[0x28..0x30].try_into().unwrap_or([0; 8])) as usize;
        let shentsize = u16::from_le_bytes([hdr[0x3A], hdr[0x3B]]) as usize;
        let shnum = u16::from_le_bytes([hdr[0x3C], hdr[0x3D]]) as usize;
        std::slice::from_raw_parts(image as *const u8, shoff + shentsize * shnum)
    } else {
        CStr::from_ptr(image as *const c_char).to_bytes()
    };
    let names = match image_kernels(bytes) {
        Ok(n) => n,
        Err(e) => {
            log(&format!("cuModuleLoadData: {e}"));
            return INVALID_IMAGE;
        }
    };
    if names.is_empty() {
        log("cuModuleLoadData: the image defines no kernel the simulator knows");
        return INVALID_IMAGE;
    }
    let h = Box::into_raw(Box::new(0u8)) as *mut c_void;
    registry().modules.insert(h as usize, Module { ctx, names });
    *module = h;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(module: *mut c_void) -> CUresult {
    tri!(initialized());
    let mut r = registry();
    if r.modules.remove(&(module as usize)).is_none() {
        return INVALID_HANDLE;
    }
    r.functions.retain(|_, _| true);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut *mut c_void, module: *mut c_void, name: *const c_char) -> CUresult {
    let ctx = tri!(current());
    if f.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    let name = CStr::from_ptr(name).to_string_lossy().into_owned();
    let mut r = registry();
    let Some(m) = r.modules.get(&(module as usize)) else { return INVALID_HANDLE };
    if !std::ptr::eq(m.ctx, ctx) {
        return INVALID_CONTEXT;
    }
    if !m.names.contains(&name) {
        return NOT_FOUND;
    }
    if !exec::table().contains_key(&name) {
        log(&format!("kernel {name} is in the module but not in the host-compiled kernels: rebuild cudasim"));
        return NOT_FOUND;
    }
    let h = Box::into_raw(Box::new(0u8)) as *mut c_void;
    r.functions.insert(h as usize, Function { ctx, name });
    *f = h;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let (fctx, name) = match registry().functions.get(&(f as usize)) {
        Some(func) => (func.ctx, func.name.clone()),
        None => return INVALID_HANDLE,
    };
    if !std::ptr::eq(fctx, ctx) {
        log(&format!("kernel {name} of device {} launched while device {}'s context is current", fctx.dev, ctx.dev));
        return INVALID_CONTEXT;
    }
    if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx > 1024 || shared > 48 * 1024 {
        return INVALID_VALUE;
    }
    if gy != 1 || gz != 1 || by != 1 || bz != 1 || !extra.is_null() {
        log("cuLaunchKernel: the simulator runs 1-D grids and blocks with kernelParams only");
        return NOT_SUPPORTED;
    }
    let Some(k) = exec::table().get(&name) else { return NOT_FOUND };
    if params.is_null() && !k.sizes.is_empty() {
        return INVALID_VALUE;
    }
    // The driver copies the argument values now: the caller's may go away.
    let mut args = Vec::with_capacity(k.sizes.len());
    for (i, &size) in k.sizes.iter().enumerate() {
        let p = *params.add(i);
        if p.is_null() {
            return INVALID_VALUE;
        }
        let mut words = vec![0u64; size.div_ceil(8).max(1)];
        std::ptr::copy_nonoverlapping(p as *const u8, words.as_mut_ptr() as *mut u8, size);
        args.push(words);
    }
    let ptrs = k.is_ptr.iter().enumerate().filter(|(_, &p)| p).map(|(i, _)| i).collect();
    {
        let mut l = lock(launches());
        let entry = l.entry(name.clone()).or_insert((0, 0));
        *entry = (entry.0 + 1, gx);
    }
    s.push(Op::Kernel { name, index: k.index, grid: gx, block: bx, args, ptrs });
    SUCCESS
}

// ---- errors ---------------------------------------------------------------------------

fn error_name(r: CUresult) -> Option<&'static CStr> {
    Some(match r {
        SUCCESS => c"CUDA_SUCCESS",
        INVALID_VALUE => c"CUDA_ERROR_INVALID_VALUE",
        OUT_OF_MEMORY => c"CUDA_ERROR_OUT_OF_MEMORY",
        NOT_INITIALIZED => c"CUDA_ERROR_NOT_INITIALIZED",
        NO_DEVICE => c"CUDA_ERROR_NO_DEVICE",
        INVALID_DEVICE => c"CUDA_ERROR_INVALID_DEVICE",
        INVALID_IMAGE => c"CUDA_ERROR_INVALID_IMAGE",
        INVALID_CONTEXT => c"CUDA_ERROR_INVALID_CONTEXT",
        PEER_ACCESS_UNSUPPORTED => c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        INVALID_HANDLE => c"CUDA_ERROR_INVALID_HANDLE",
        NOT_FOUND => c"CUDA_ERROR_NOT_FOUND",
        NOT_READY => c"CUDA_ERROR_NOT_READY",
        ILLEGAL_ADDRESS => c"CUDA_ERROR_ILLEGAL_ADDRESS",
        LAUNCH_OUT_OF_RESOURCES => c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        PEER_ACCESS_ALREADY_ENABLED => c"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        PEER_ACCESS_NOT_ENABLED => c"CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        LAUNCH_FAILED => c"CUDA_ERROR_LAUNCH_FAILED",
        NOT_SUPPORTED => c"CUDA_ERROR_NOT_SUPPORTED",
        _ => return None,
    })
}

fn error_text(r: CUresult) -> Option<&'static CStr> {
    Some(match r {
        SUCCESS => c"no error",
        INVALID_VALUE => c"invalid argument",
        OUT_OF_MEMORY => c"out of memory",
        NOT_INITIALIZED => c"initialization error",
        NO_DEVICE => c"no CUDA-capable device is detected (cudasim: set KILN_CUDASIM=1)",
        INVALID_DEVICE => c"invalid device ordinal",
        INVALID_IMAGE => c"device kernel image is invalid",
        INVALID_CONTEXT => c"invalid device context",
        INVALID_HANDLE => c"invalid resource handle",
        NOT_FOUND => c"named symbol not found",
        NOT_READY => c"device not ready",
        ILLEGAL_ADDRESS => c"an illegal memory access was encountered",
        LAUNCH_OUT_OF_RESOURCES => c"too many resources requested for launch",
        LAUNCH_FAILED => c"unspecified launch failure",
        NOT_SUPPORTED => c"operation not supported",
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(r: CUresult, out: *mut *const c_char) -> CUresult {
    if out.is_null() {
        return INVALID_VALUE;
    }
    match error_name(r) {
        Some(s) => {
            *out = s.as_ptr();
            SUCCESS
        }
        None => {
            *out = std::ptr::null();
            INVALID_VALUE
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(r: CUresult, out: *mut *const c_char) -> CUresult {
    if out.is_null() {
        return INVALID_VALUE;
    }
    match error_text(r) {
        Some(s) => {
            *out = s.as_ptr();
            SUCCESS
        }
        None => {
            *out = std::ptr::null();
            INVALID_VALUE
        }
    }
}
