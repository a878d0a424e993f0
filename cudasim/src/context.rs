//! Devices, contexts and the handle registry: which devices exist (read
//! from the environment once), the per-thread current context, the table of
//! live streams, events, modules and functions that every handle is checked
//! against, fault injection (`KILN_CUDASIM_FAIL`), and `kiln_cudasim_stat`,
//! the simulator's answers to tests.

use crate::memory::Mem;
use crate::module::{Function, Module};
use crate::stream::Stream;
use crate::{env_bytes, lock, log, tri, CUresult};
use crate::{INVALID_CONTEXT, INVALID_DEVICE, INVALID_VALUE, NOT_INITIALIZED, NO_DEVICE, PEER_ACCESS_ALREADY_ENABLED};
use crate::{PEER_ACCESS_NOT_ENABLED, PEER_ACCESS_UNSUPPORTED, SUCCESS};
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

// ---- fault injection and what tests may ask ------------------------------------

/// `KILN_CUDASIM_FAIL=name:N[@S][,name:N[@S]...]`: N calls of each named
/// entry point fail, after S that succeed (0 unless given); read once per
/// process. Entry points that can be made to fail: `cuMemAlloc_v2`,
/// `cuMemFree_v2`, `cuMemAllocHost_v2`, `cuEventCreate`, `cublasCreate_v2`,
/// `ncclCommInitAll` and the NCCL collectives (`ncclAllReduce`,
/// `ncclBroadcast`, `ncclReduce`, `ncclAllGather`, `ncclReduceScatter`),
/// and the launches of one kernel, `cuLaunchKernel.NAME` (refused with
/// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`).
pub(crate) fn injected_failure(name: &str) -> bool {
    /// Per name: (calls still to succeed, calls then to fail).
    static FAILS: OnceLock<Mutex<HashMap<String, (u64, u64)>>> = OnceLock::new();
    let fails = FAILS.get_or_init(|| {
        let mut m = HashMap::new();
        for item in std::env::var("KILN_CUDASIM_FAIL").unwrap_or_default().split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let parsed = item.split_once(':').and_then(|(n, spec)| {
                let (count, skip) = spec.split_once('@').unwrap_or((spec, "0"));
                Some((n.trim().to_string(), (skip.trim().parse::<u64>().ok()?, count.trim().parse::<u64>().ok()?)))
            });
            match parsed {
                Some((n, c)) => {
                    m.insert(n, c);
                }
                None => log(&format!("KILN_CUDASIM_FAIL: `{item}` is not name:count or name:count@skip; ignored")),
            }
        }
        Mutex::new(m)
    });
    let mut fails = lock(fails);
    match fails.get_mut(name) {
        Some((skip, _)) if *skip > 0 => {
            *skip -= 1;
            false
        }
        Some((_, left)) if *left > 0 => {
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
pub(crate) static GEMMS: AtomicU64 = AtomicU64::new(0);

/// Counts a launch of kernel `name` for `launches:NAME` and `grid:NAME`.
pub(crate) fn record_launch(name: &str, grid: u32) {
    let mut l = lock(launches());
    let entry = l.entry(name.to_string()).or_insert((0, 0));
    *entry = (entry.0 + 1, grid);
}

/// What a test may ask the simulator (it finds this function with `dlsym`
/// in the loaded `libcuda.so`): `pinned_bytes` and `pinned_blocks` (live
/// page-locked host memory), `events` (live events), `gemms` (cuBLAS gemms
/// queued), `cudnn_convs` (cuDNN convolutions queued), `cudnn_last_algo`
/// (the algorithm of the last one a program ran), `launches:NAME` and `grid:NAME` (launches of kernel NAME, and
/// the grid of the last one), `device_bytes:N` (device N's memory in use),
/// `host_compiles` (kernel modules this process compiled with g++),
/// `host_cache_hits` (kernel modules it found compiled in the disk cache),
/// `nccl_collectives` (NCCL collectives completed, each once) and
/// `nccl_comms` (live NCCL communicators). -1 for a question it does not know.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kiln_cudasim_stat(what: *const c_char) -> i64 {
    unsafe {
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
                "cudnn_convs" => crate::dnn::CONVS.load(Ordering::SeqCst) as i64,
                "cudnn_last_algo" => crate::dnn::LAST_ALGO.load(Ordering::SeqCst),
                "host_compiles" => crate::hostcc::COMPILES.load(Ordering::SeqCst) as i64,
                "host_cache_hits" => crate::hostcc::CACHE_HITS.load(Ordering::SeqCst) as i64,
                "nccl_collectives" => crate::nccl::COLLECTIVES.load(Ordering::SeqCst) as i64,
                "nccl_comms" => crate::nccl::live_comms() as i64,
                _ => -1,
            },
            Some(("launches", name)) => lock(launches()).get(name).map(|l| l.0 as i64).unwrap_or(0),
            Some(("grid", name)) => lock(launches()).get(name).map(|l| l.1 as i64).unwrap_or(0),
            Some(("device_bytes", dev)) => {
                dev.parse::<usize>().ok().and_then(|d| mem().used.get(d).copied()).map(|b| b as i64).unwrap_or(-1)
            }
            _ => -1,
        }
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
    pub(crate) fn fault(&self, code: CUresult, msg: String) {
        let mut s = lock(&self.sticky);
        if s.is_none() {
            log(&format!("device {}: {msg} (the context is now unusable, as on a GPU)", self.dev));
            crate::remember_fault(code, self.dev, &msg);
            *s = Some((code, msg));
        }
    }
    pub(crate) fn sticky(&self) -> CUresult {
        lock(&self.sticky).as_ref().map(|(c, _)| *c).unwrap_or(SUCCESS)
    }
    pub(crate) fn default_stream(&'static self) -> Arc<Stream> {
        self.default_stream.get_or_init(|| Stream::new(self)).clone()
    }
}

pub(crate) struct Device {
    pub capacity: usize,
    /// Memory held outside this process (`KILN_CUDASIM_RESERVED`): counted
    /// as used by cuMemGetInfo and unavailable to cuMemAlloc.
    pub reserved: usize,
    pub ctx: &'static Ctx,
    /// peers[j]: this device's kernels and copies may touch device j's memory.
    pub peers: Mutex<Vec<bool>>,
}

pub(crate) struct Sim {
    pub devices: Vec<Device>,
    pub sms: i32,
    pub cc: (i32, i32),
    pub mem: Mutex<Mem>,
}

/// The simulated machine, or None without `KILN_CUDASIM=1` (so that nobody
/// gets the simulator by accident).
pub(crate) fn sim() -> Option<&'static Sim> {
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

pub(crate) fn initialized() -> Result<&'static Sim, CUresult> {
    if INITIALIZED.load(Ordering::Acquire) == 0 {
        return Err(NOT_INITIALIZED);
    }
    sim().ok_or(NOT_INITIALIZED)
}

thread_local! {
    static CURRENT: std::cell::Cell<Option<&'static Ctx>> = const { std::cell::Cell::new(None) };
}

pub(crate) fn current() -> Result<&'static Ctx, CUresult> {
    let sim = initialized()?;
    let ctx = CURRENT.with(|c| c.get()).ok_or(INVALID_CONTEXT)?;
    let _ = sim;
    match ctx.sticky() {
        SUCCESS => Ok(ctx),
        e => Err(e),
    }
}

/// The device of the calling thread's current context, faulted or not.
pub(crate) fn current_device() -> Option<usize> {
    CURRENT.with(|c| c.get()).map(|c| c.dev)
}

pub(crate) fn ctx_from(h: *mut c_void) -> Option<&'static Ctx> {
    let sim = sim()?;
    sim.devices.iter().map(|d| d.ctx).find(|c| std::ptr::eq(*c as *const Ctx as *const c_void, h))
}

/// Every live handle the application holds, so that a stale or foreign
/// handle is refused (`INVALID_HANDLE`) instead of dereferenced.
pub(crate) struct Registry {
    pub streams: HashMap<usize, Arc<Stream>>,
    pub events: HashSet<usize>,
    pub modules: HashMap<usize, Module>,
    pub functions: HashMap<usize, Function>,
}

pub(crate) fn registry() -> MutexGuard<'static, Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    lock(R.get_or_init(|| {
        Mutex::new(Registry { streams: HashMap::new(), events: HashSet::new(), modules: HashMap::new(), functions: HashMap::new() })
    }))
}

// ---- devices and contexts in the driver API ---------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return INVALID_VALUE;
    }
    if sim().is_none() {
        // Never selected by accident: only with KILN_CUDASIM=1.
        return NO_DEVICE;
    }
    INITIALIZED.store(1, Ordering::Release);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    unsafe {
        if v.is_null() {
            return INVALID_VALUE;
        }
        *v = 12090;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    unsafe {
        let sim = tri!(initialized());
        if n.is_null() {
            return INVALID_VALUE;
        }
        *n = sim.devices.len() as c_int;
        SUCCESS
    }
}

fn device(ordinal: c_int) -> Result<(&'static Sim, &'static Device), CUresult> {
    let sim = initialized()?;
    let d = usize::try_from(ordinal).ok().and_then(|o| sim.devices.get(o)).ok_or(INVALID_DEVICE)?;
    Ok((sim, d))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CUresult {
    unsafe {
        tri!(device(ordinal));
        if dev.is_null() {
            return INVALID_VALUE;
        }
        *dev = ordinal;
        SUCCESS
    }
}

unsafe fn write_cstr(dst: *mut c_char, cap: c_int, s: &str) -> CUresult {
    unsafe {
        if dst.is_null() || cap <= 0 {
            return INVALID_VALUE;
        }
        let bytes = s.as_bytes();
        let n = bytes.len().min(cap as usize - 1);
        std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, dst, n);
        *dst.add(n) = 0;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    unsafe {
        let (sim, d) = tri!(device(dev));
        let gib = d.capacity as f64 / (1u64 << 30) as f64;
        write_cstr(name, len, &format!("kiln cudasim {dev} (simulated sm_{}{}, {gib:.2} GiB)", sim.cc.0, sim.cc.1))
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CUresult {
    unsafe {
        let (_, d) = tri!(device(dev));
        if bytes.is_null() {
            return INVALID_VALUE;
        }
        *bytes = d.capacity;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> CUresult {
    unsafe {
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
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    unsafe {
        tri!(device(dev));
        write_cstr(bus, len, &format!("0000:{:02x}:00.0", 0xc0 + dev))
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: c_int, peer: c_int) -> CUresult {
    unsafe {
        tri!(device(dev));
        tri!(device(peer));
        if can.is_null() {
            return INVALID_VALUE;
        }
        *can = (dev != peer) as c_int;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CUresult {
    unsafe {
        let (_, d) = tri!(device(dev));
        if ctx.is_null() {
            return INVALID_VALUE;
        }
        *ctx = d.ctx as *const Ctx as *mut c_void;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    tri!(device(dev));
    SUCCESS
}

#[unsafe(no_mangle)]
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CUresult {
    unsafe {
        tri!(initialized());
        if ctx.is_null() {
            return INVALID_VALUE;
        }
        *ctx = CURRENT.with(|c| c.get()).map(|c| c as *const Ctx as *mut c_void).unwrap_or(std::ptr::null_mut());
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CUresult {
    unsafe {
        let ctx = tri!(current());
        if dev.is_null() {
            return INVALID_VALUE;
        }
        *dev = ctx.dev as c_int;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    let ctx = tri!(current());
    wait_for_every_stream(ctx);
    ctx.sticky()
}

/// Waits until the work queued so far on every stream of `ctx` has run
/// (what cuCtxSynchronize, and implicitly cuMemFree, wait for).
pub(crate) fn wait_for_every_stream(ctx: &'static Ctx) {
    let streams: Vec<Arc<Stream>> = registry().streams.values().filter(|s| std::ptr::eq(s.ctx, ctx)).cloned().collect();
    for s in streams.iter().chain(std::iter::once(&ctx.default_stream())) {
        s.wait_for(s.ticket());
    }
}

#[unsafe(no_mangle)]
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

#[unsafe(no_mangle)]
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
