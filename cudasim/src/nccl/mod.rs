//! NCCL: a single-process stand-in for `libnccl.so.2` over the simulated
//! devices, with the calls kiln makes (and their neighbours): versions and
//! error strings, `ncclCommInitAll` (every communicator of a clique in one
//! process), groups, and the five collectives kiln uses, on the streams
//! they are given, in stream order.
//!
//! A collective call is checked when it is made (communicator, type, op,
//! root, null buffers, a stream of the communicator's device) and queued on
//! its stream, at once or at the outer `ncclGroupEnd`; a call refused inside
//! a group makes `ncclGroupEnd` return that error and drop the whole group,
//! so nothing of it runs. When a stream reaches its rank's part, the worker
//! waits there until every rank's stream has reached the same collective
//! (the k-th queued on each rank, as NCCL matches them), as NCCL's kernels
//! wait for their peers; the last to arrive checks that the ranks called the
//! same collective, checks every buffer against live device memory of its
//! rank's device, and computes the result once for every rank, so the ranks
//! get the same bits. Reductions combine in rank order; half types in f32
//! with one rounding per step; max and min of floats are fmax and fmin (a
//! NaN loses), as NCCL's kernels compute them; integers wrap.
//!
//! A failure there (mismatched calls, a bad buffer, a rank whose context
//! faulted first, or ranks that do not all arrive within
//! `KILN_CUDASIM_NCCL_TIMEOUT` seconds, 120; on a GPU that hangs) faults
//! every waiting rank's context, as a failed kernel does, and is the
//! communicator's asynchronous error.
//!
//! Communicators across processes (`ncclGetUniqueId`, `ncclCommInitRank`)
//! meet through files instead (`world.rs`), with the same checks.

mod run;
mod world;

use crate::context::{cuInit, injected_failure, sim};
use crate::stream::{stream_of, Op, Stream};
use crate::{lock, log, SUCCESS};
use run::Meeting;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

pub type NcclResult = c_uint;
const OK: NcclResult = 0;
const UNHANDLED_CUDA_ERROR: NcclResult = 1;
const SYSTEM_ERROR: NcclResult = 2;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;
/// ncclRemoteError: a peer process exited or could not be reached.
const REMOTE_ERROR: NcclResult = 6;
/// ncclInProgress: a non-blocking communicator is still being made.
const IN_PROGRESS: NcclResult = 7;

/// The NCCL version this stands in for: 2.21.5.
const VERSION: c_int = 22105;

/// Collectives completed (each once, however many ranks), for
/// `kiln_cudasim_stat("nccl_collectives")`.
pub(crate) static COLLECTIVES: AtomicU64 = AtomicU64::new(0);

// ---- errors ---------------------------------------------------------------------

thread_local! {
    /// The last error message of this thread (`ncclGetLastError`).
    static LAST: RefCell<CString> = RefCell::new(CString::default());
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// Records `msg` as this thread's last error, logs it, and returns `code`.
fn fail(code: NcclResult, msg: String) -> NcclResult {
    log(&format!("NCCL: {msg}"));
    LAST.with(|l| *l.borrow_mut() = CString::new(msg.replace('\0', " ")).unwrap_or_default());
    code
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetErrorString(r: NcclResult) -> *const c_char {
    let s: &'static CStr = match r {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// The communicator's last failed collective, when `comm` names one that
/// failed (as NCCL keeps the message of an asynchronous error), else this
/// thread's last error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetLastError(comm: *mut c_void) -> *const c_char {
    if let Some(p) = lock(making()).get(&(comm as usize)) {
        let last = lock(&p.message);
        if !last.as_bytes().is_empty() {
            // Owned by the record, kept until the handle is aborted.
            return last.as_ptr();
        }
    }
    if let Some(c) = lock(comms()).get(&(comm as usize)) {
        let last = lock(&c.last_error);
        if !last.as_bytes().is_empty() {
            // Owned by the communicator, which outlives this read (kiln
            // copies the text at once, before it aborts the communicator).
            return last.as_ptr();
        }
    }
    LAST.with(|l| l.borrow().as_ptr())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> NcclResult {
    unsafe {
        if v.is_null() {
            return fail(INVALID_ARGUMENT, "ncclGetVersion: null pointer".into());
        }
        *v = VERSION;
        OK
    }
}

// ---- communicators --------------------------------------------------------------

/// The communicators one `ncclCommInitAll` made, and the collectives their
/// ranks are meeting at.
struct Clique {
    devs: Vec<usize>,
    meetings: Mutex<HashMap<u64, Meeting>>,
    cv: Condvar,
}

pub(crate) struct Comm {
    clique: Arc<Clique>,
    rank: usize,
    dev: usize,
    /// The sequence number of this rank's next collective.
    next: AtomicU64,
    /// The first asynchronous error (`ncclCommGetAsyncError`).
    async_error: Mutex<NcclResult>,
    /// The processes of a communicator across processes (`ncclCommInitRank`).
    world: Option<Arc<world::World>>,
    /// The message of the first failed collective (`ncclGetLastError`).
    last_error: Mutex<CString>,
}

impl Comm {
    /// The number of ranks.
    fn size(&self) -> usize {
        self.world.as_ref().map(|w| w.size).unwrap_or(self.clique.devs.len())
    }
}

/// Live communicators by handle.
fn comms() -> &'static Mutex<HashMap<usize, Arc<Comm>>> {
    static C: OnceLock<Mutex<HashMap<usize, Arc<Comm>>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Live communicators, for `kiln_cudasim_stat("nccl_comms")`.
pub(crate) fn live_comms() -> usize {
    lock(comms()).len()
}

fn comm(h: *mut c_void, what: &str) -> Result<Arc<Comm>, NcclResult> {
    lock(comms()).get(&(h as usize)).cloned().ok_or_else(|| fail(INVALID_ARGUMENT, format!("{what}: invalid communicator {h:?}")))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitAll(out: *mut *mut c_void, ndev: c_int, devlist: *const c_int) -> NcclResult {
    unsafe {
        if out.is_null() || ndev < 1 {
            return fail(INVALID_ARGUMENT, format!("ncclCommInitAll: comms {out:?}, ndev {ndev}"));
        }
        let Some(sim) = sim() else {
            return fail(UNHANDLED_CUDA_ERROR, "ncclCommInitAll: no CUDA device (cudasim: KILN_CUDASIM=1 is not set)".into());
        };
        // NCCL's runtime initialises the driver itself.
        let _ = cuInit(0);
        let devs: Vec<usize> =
            if devlist.is_null() { (0..ndev as usize).collect() } else { (0..ndev as usize).map(|i| *devlist.add(i) as usize).collect() };
        for (i, &d) in devs.iter().enumerate() {
            if d >= sim.devices.len() {
                return fail(INVALID_ARGUMENT, format!("ncclCommInitAll: device {d} does not exist ({} simulated)", sim.devices.len()));
            }
            if devs[..i].contains(&d) {
                return fail(INVALID_USAGE, format!("ncclCommInitAll: duplicate GPU detected: device {d} is listed twice"));
            }
            if sim.devices[d].ctx.sticky() != SUCCESS {
                return fail(UNHANDLED_CUDA_ERROR, format!("ncclCommInitAll: device {d}'s context has faulted"));
            }
        }
        if injected_failure("ncclCommInitAll") {
            return fail(UNHANDLED_CUDA_ERROR, "ncclCommInitAll: out of memory (KILN_CUDASIM_FAIL)".into());
        }
        let clique = Arc::new(Clique { devs: devs.clone(), meetings: Mutex::new(HashMap::new()), cv: Condvar::new() });
        let mut live = lock(comms());
        for (rank, &dev) in devs.iter().enumerate() {
            let c = Arc::new(Comm {
                clique: clique.clone(),
                rank,
                dev,
                next: AtomicU64::new(0),
                async_error: Mutex::new(OK),
                world: None,
                last_error: Mutex::new(CString::default()),
            });
            let h = Arc::as_ptr(&c) as *mut c_void;
            live.insert(h as usize, c);
            *out.add(rank) = h;
        }
        OK
    }
}

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
pub struct UniqueId {
    internal: [u8; world::ID_BYTES],
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    unsafe {
        if id.is_null() {
            return fail(INVALID_ARGUMENT, "ncclGetUniqueId: null pointer".into());
        }
        if injected_failure("ncclGetUniqueId") {
            return fail(SYSTEM_ERROR, "ncclGetUniqueId: failing as KILN_CUDASIM_FAIL asks".into());
        }
        (*id).internal = world::unique_id();
        OK
    }
}

/// Joins the communicator `id` names as `rank` of `nranks`, on the current
/// device; blocks until every rank has joined (or the timeout).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(out: *mut *mut c_void, nranks: c_int, id: UniqueId, rank: c_int) -> NcclResult {
    unsafe {
        if out.is_null() || nranks < 1 || !(0..nranks).contains(&rank) {
            return fail(INVALID_ARGUMENT, format!("ncclCommInitRank: comm {out:?}, nranks {nranks}, rank {rank}"));
        }
        if sim().is_none() {
            return fail(UNHANDLED_CUDA_ERROR, "ncclCommInitRank: no CUDA device (cudasim: KILN_CUDASIM=1 is not set)".into());
        }
        let _ = cuInit(0);
        let Some(dev) = crate::context::current_device() else {
            return fail(INVALID_USAGE, "ncclCommInitRank: no current device (call cudaSetDevice or make a context current first)".into());
        };
        if injected_failure("ncclCommInitRank") {
            return fail(SYSTEM_ERROR, "ncclCommInitRank: failing as KILN_CUDASIM_FAIL asks".into());
        }
        let world = match world::World::join(&id.internal, nranks as usize, rank as usize, &AtomicBool::new(false)) {
            Ok(w) => Arc::new(w),
            Err(msg) => return fail(SYSTEM_ERROR, msg),
        };
        let clique = Arc::new(Clique { devs: vec![dev], meetings: Mutex::new(HashMap::new()), cv: Condvar::new() });
        let c = Arc::new(Comm {
            clique,
            rank: rank as usize,
            dev,
            next: AtomicU64::new(0),
            async_error: Mutex::new(OK),
            world: Some(world),
            last_error: Mutex::new(CString::default()),
        });
        let h = Arc::as_ptr(&c) as *mut c_void;
        lock(comms()).insert(h as usize, c);
        *out = h;
        OK
    }
}

/// A non-blocking communicator being made (`ncclCommInitRankConfig` with
/// `blocking = 0`): its handle is returned at once, its state is
/// ncclInProgress until every rank has joined, then the communicator is
/// live under the same handle (or the state is the error).
struct Making {
    state: Mutex<NcclResult>,
    /// Why it failed (`ncclGetLastError`).
    message: Mutex<CString>,
    /// Set by `ncclCommAbort`: the wait for the other ranks ends.
    stop: Arc<AtomicBool>,
}

/// Communicators being made, by handle.
fn making() -> &'static Mutex<HashMap<usize, Arc<Making>>> {
    static M: OnceLock<Mutex<HashMap<usize, Arc<Making>>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `ncclConfig_t`'s `blocking` as NCCL reads it: the config's own size and
/// version say whether it has the field (NCCL 2.14 added it); none (or
/// undefined) is blocking.
///
/// # Safety
/// `config` is null or points to at least `size` readable bytes, `size`
/// being its first field.
unsafe fn blocking(config: *const u8) -> Result<bool, NcclResult> {
    unsafe {
        if config.is_null() {
            return Ok(true);
        }
        let size = std::ptr::read_unaligned(config as *const usize);
        let word = |at: usize| std::ptr::read_unaligned(config.add(at) as *const u32);
        if size < 16 || word(8) != 0xcafe_beef {
            return Err(fail(INVALID_ARGUMENT, "ncclCommInitRankConfig: the config was not made by NCCL_CONFIG_INITIALIZER".into()));
        }
        if word(12) < 21400 || size < 20 {
            return Ok(true);
        }
        Ok(std::ptr::read_unaligned(config.add(16) as *const c_int) != 0)
    }
}

/// `ncclCommInitRank` with a config: with `blocking = 0` the handle is
/// returned at once with ncclInProgress, and the ranks meet on a thread of
/// their own (`ncclCommGetAsyncError` says when it is done;
/// `ncclCommAbort` gives up).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    out: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *mut c_void,
) -> NcclResult {
    unsafe {
        match blocking(config as *const u8) {
            Err(e) => return e,
            Ok(true) => return ncclCommInitRank(out, nranks, id, rank),
            Ok(false) => {}
        }
        if out.is_null() || nranks < 1 || !(0..nranks).contains(&rank) {
            return fail(INVALID_ARGUMENT, format!("ncclCommInitRankConfig: comm {out:?}, nranks {nranks}, rank {rank}"));
        }
        if sim().is_none() {
            return fail(UNHANDLED_CUDA_ERROR, "ncclCommInitRankConfig: no CUDA device (cudasim: KILN_CUDASIM=1 is not set)".into());
        }
        let _ = cuInit(0);
        let Some(dev) = crate::context::current_device() else {
            return fail(
                INVALID_USAGE,
                "ncclCommInitRankConfig: no current device (call cudaSetDevice or make a context current first)".into(),
            );
        };
        if injected_failure("ncclCommInitRank") {
            return fail(SYSTEM_ERROR, "ncclCommInitRankConfig: failing as KILN_CUDASIM_FAIL asks".into());
        }
        let record = Arc::new(Making {
            state: Mutex::new(IN_PROGRESS),
            message: Mutex::new(CString::default()),
            stop: Arc::new(AtomicBool::new(false)),
        });
        // Odd numbers: never the address of a live communicator (an 8-aligned
        // `Arc`), so a handle is never reused while another is live.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let handle = ((NEXT.fetch_add(1, Ordering::Relaxed) as usize) << 4) | 1;
        lock(making()).insert(handle, record.clone());
        let (size, me) = (nranks as usize, rank as usize);
        let spawned = std::thread::Builder::new().name("cudasim-nccl-init".into()).spawn(move || {
            let joined = world::World::join(&id.internal, size, me, &record.stop);
            let mut all = lock(making());
            // Aborted meanwhile: the handle is gone, and so is the communicator.
            if !all.contains_key(&handle) {
                if let Ok(w) = joined {
                    w.leave();
                }
                return;
            }
            match joined {
                Ok(w) => {
                    let clique = Arc::new(Clique { devs: vec![dev], meetings: Mutex::new(HashMap::new()), cv: Condvar::new() });
                    let c = Arc::new(Comm {
                        clique,
                        rank: me,
                        dev,
                        next: AtomicU64::new(0),
                        async_error: Mutex::new(OK),
                        world: Some(Arc::new(w)),
                        last_error: Mutex::new(CString::default()),
                    });
                    lock(comms()).insert(handle, c);
                    all.remove(&handle);
                }
                Err(msg) => {
                    log(&format!("NCCL: {msg}"));
                    *lock(&record.message) = CString::new(msg.replace('\0', " ")).unwrap_or_default();
                    *lock(&record.state) = SYSTEM_ERROR;
                }
            }
        });
        if let Err(e) = spawned {
            lock(making()).remove(&handle);
            return fail(SYSTEM_ERROR, format!("ncclCommInitRankConfig: cannot start a thread: {e}"));
        }
        *out = handle as *mut c_void;
        IN_PROGRESS
    }
}

/// Destroys a communicator: its handle is refused from now on; collectives
/// already queued still run.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDestroy(c: *mut c_void) -> NcclResult {
    match lock(comms()).remove(&(c as usize)) {
        Some(comm) => {
            if let Some(w) = &comm.world {
                w.leave();
            }
            OK
        }
        None => fail(INVALID_ARGUMENT, format!("ncclCommDestroy: invalid communicator {c:?}")),
    }
}

/// Destroys a communicator; a collective of it waiting for other processes
/// gives up (its context faults).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommAbort(c: *mut c_void) -> NcclResult {
    // One still being made: its wait for the others ends, and the handle goes.
    if let Some(m) = lock(making()).remove(&(c as usize)) {
        m.stop.store(true, Ordering::SeqCst);
        return OK;
    }
    if let Some(w) = lock(comms()).get(&(c as usize)).and_then(|c| c.world.clone()) {
        w.aborted.store(true, Ordering::SeqCst);
    }
    unsafe { ncclCommDestroy(c) }
}

/// A communicator query: the handle is checked, then the out-pointer, then
/// `value` of the communicator is written there.
unsafe fn query<T>(c: *mut c_void, out: *mut T, what: &str, value: impl FnOnce(&Comm) -> T) -> NcclResult {
    unsafe {
        let c = match comm(c, what) {
            Ok(c) => c,
            Err(e) => return e,
        };
        if out.is_null() {
            return fail(INVALID_ARGUMENT, format!("{what}: null pointer"));
        }
        *out = value(&c);
        OK
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(c: *mut c_void, count: *mut c_int) -> NcclResult {
    unsafe { query(c, count, "ncclCommCount", |c| c.size() as c_int) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(c: *mut c_void, dev: *mut c_int) -> NcclResult {
    unsafe { query(c, dev, "ncclCommCuDevice", |c| c.dev as c_int) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(c: *mut c_void, rank: *mut c_int) -> NcclResult {
    unsafe { query(c, rank, "ncclCommUserRank", |c| c.rank as c_int) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(c: *mut c_void, err: *mut NcclResult) -> NcclResult {
    unsafe {
        if let Some(m) = lock(making()).get(&(c as usize)) {
            if err.is_null() {
                return fail(INVALID_ARGUMENT, "ncclCommGetAsyncError: null pointer".into());
            }
            *err = *lock(&m.state);
            return OK;
        }
        query(c, err, "ncclCommGetAsyncError", |c| *lock(&c.async_error))
    }
}

// ---- groups -----------------------------------------------------------------------

#[derive(Default)]
struct Group {
    depth: u32,
    /// Calls queued at the outer `ncclGroupEnd`, in call order.
    pending: Vec<(Arc<Stream>, Task)>,
    /// The first call refused inside the group.
    error: Option<(NcclResult, String)>,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupStart() -> NcclResult {
    GROUP.with(|g| g.borrow_mut().depth += 1);
    OK
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupEnd() -> NcclResult {
    let done = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Some((INVALID_USAGE, "ncclGroupEnd without ncclGroupStart".to_string())));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Err(None);
        }
        let pending = std::mem::take(&mut g.pending);
        match g.error.take() {
            Some(e) => Err(Some(e)),
            None => Ok(pending),
        }
    });
    match done {
        Ok(pending) => {
            for (stream, task) in pending {
                queue(&stream, task);
            }
            OK
        }
        Err(None) => OK,
        Err(Some((code, msg))) => fail(code, format!("ncclGroupEnd: {msg}; nothing of the group was queued")),
    }
}

// ---- collectives ------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "ncclAllReduce",
            Kind::Broadcast => "ncclBroadcast",
            Kind::Reduce => "ncclReduce",
            Kind::AllGather => "ncclAllGather",
            Kind::ReduceScatter => "ncclReduceScatter",
        }
    }
}

/// NCCL's data types, by their `ncclDataType_t` numbers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Ty {
    I8,
    U8,
    I32,
    U32,
    I64,
    U64,
    F16,
    F32,
    F64,
    BF16,
}

impl Ty {
    fn from_code(code: c_uint) -> Option<Ty> {
        Some(match code {
            0 => Ty::I8,
            1 => Ty::U8,
            2 => Ty::I32,
            3 => Ty::U32,
            4 => Ty::I64,
            5 => Ty::U64,
            6 => Ty::F16,
            7 => Ty::F32,
            8 => Ty::F64,
            9 => Ty::BF16,
            _ => return None,
        })
    }
    fn size(self) -> usize {
        match self {
            Ty::I8 | Ty::U8 => 1,
            Ty::F16 | Ty::BF16 => 2,
            Ty::I32 | Ty::U32 | Ty::F32 => 4,
            Ty::I64 | Ty::U64 | Ty::F64 => 8,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RedOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl RedOp {
    fn from_code(code: c_uint) -> Option<RedOp> {
        Some(match code {
            0 => RedOp::Sum,
            1 => RedOp::Prod,
            2 => RedOp::Max,
            3 => RedOp::Min,
            4 => RedOp::Avg,
            _ => return None,
        })
    }
}

/// What one rank called: ranks of one collective must agree on all but the
/// buffers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Call {
    kind: Kind,
    count: usize,
    ty: Ty,
    op: Option<RedOp>,
    root: usize,
}

/// One rank's part of a collective, queued on its stream.
pub(crate) struct Task {
    comm: Arc<Comm>,
    call: Call,
    send: u64,
    recv: u64,
    seq: u64,
}

/// Queues `task` on `stream`: it is this rank's next collective.
fn queue(stream: &Stream, mut task: Task) {
    task.seq = task.comm.next.fetch_add(1, Ordering::SeqCst);
    stream.push(Op::Nccl(Box::new(task)));
}

/// Checks a collective call and queues it (or keeps it for `ncclGroupEnd`).
#[allow(clippy::too_many_arguments)]
unsafe fn collective(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    ty: c_uint,
    op: Option<c_uint>,
    root: c_int,
    c: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let name = kind.name();
    let checked = (|| -> Result<(Arc<Stream>, Task), (NcclResult, String)> {
        let comm = lock(comms()).get(&(c as usize)).cloned().ok_or((INVALID_ARGUMENT, format!("{name}: invalid communicator {c:?}")))?;
        let n = comm.size();
        let ty = Ty::from_code(ty).ok_or((INVALID_ARGUMENT, format!("{name}: invalid data type {ty} (cudasim has no fp8)")))?;
        let op = match op {
            Some(code) => Some(RedOp::from_code(code).ok_or((INVALID_ARGUMENT, format!("{name}: invalid reduction operation {code}")))?),
            None => None,
        };
        let rooted = matches!(kind, Kind::Broadcast | Kind::Reduce);
        if rooted && !(0..n as c_int).contains(&root) {
            return Err((INVALID_ARGUMENT, format!("{name}: root {root} is not a rank of {n}")));
        }
        let root = if rooted { root as usize } else { 0 };
        // Broadcast reads the send buffer on the root only.
        let reads = !(kind == Kind::Broadcast && comm.rank != root);
        if count > 0 && ((reads && send.is_null()) || recv.is_null()) {
            return Err((INVALID_ARGUMENT, format!("{name}: a null buffer (send {send:?}, recv {recv:?}) for {count} elements")));
        }
        let sim = sim().ok_or((UNHANDLED_CUDA_ERROR, format!("{name}: no simulator")))?;
        let ctx = sim.devices[comm.dev].ctx;
        if ctx.sticky() != SUCCESS {
            return Err((UNHANDLED_CUDA_ERROR, format!("{name}: device {}'s context has faulted", comm.dev)));
        }
        let s = stream_of(stream, ctx).map_err(|_| (UNHANDLED_CUDA_ERROR, format!("{name}: invalid stream {stream:?}")))?;
        if s.ctx.dev != comm.dev {
            return Err((
                UNHANDLED_CUDA_ERROR,
                format!("{name}: a stream of device {} given to the communicator of device {} (rank {})", s.ctx.dev, comm.dev, comm.rank),
            ));
        }
        if injected_failure(name) {
            return Err((SYSTEM_ERROR, format!("{name}: failing as KILN_CUDASIM_FAIL asks")));
        }
        let call = Call { kind, count, ty, op, root };
        Ok((s, Task { comm, call, send: send as u64, recv: recv as u64, seq: 0 }))
    })();
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        match checked {
            Ok((s, task)) if g.depth > 0 => {
                g.pending.push((s, task));
                OK
            }
            Ok((s, task)) => {
                queue(&s, task);
                OK
            }
            Err((code, msg)) => {
                if g.depth > 0 && g.error.is_none() {
                    g.error = Some((code, msg.clone()));
                }
                fail(code, msg)
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    ty: c_uint,
    op: c_uint,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { collective(Kind::AllReduce, send, recv, count, ty, Some(op), 0, comm, stream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    ty: c_uint,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { collective(Kind::Broadcast, send, recv, count, ty, None, root, comm, stream) }
}

/// The in-place broadcast of NCCL's first API.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBcast(
    buf: *mut c_void,
    count: usize,
    ty: c_uint,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { collective(Kind::Broadcast, buf, buf, count, ty, None, root, comm, stream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    ty: c_uint,
    op: c_uint,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { collective(Kind::Reduce, send, recv, count, ty, Some(op), root, comm, stream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    ty: c_uint,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { collective(Kind::AllGather, send, recv, count, ty, None, 0, comm, stream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    ty: c_uint,
    op: c_uint,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { collective(Kind::ReduceScatter, send, recv, count, ty, Some(op), 0, comm, stream) }
}
