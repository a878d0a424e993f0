//! The MPI engine (feature `mpi`): MPI through rsmpi's raw layer
//! (`mpi::ffi`), for processes started by `mpirun`, `mpiexec` or `srun`.
//!
//! One thread per process, `kiln-mpi`, initialises MPI
//! (`MPI_THREAD_FUNNELED`) and makes every MPI call; the ranks' threads
//! hand it calls over a channel. Errors return (`MPI_ERRORS_RETURN` on every
//! communicator) and every return code is checked. Each collective first
//! sends its fingerprint to every other rank on a communicator of its own
//! and waits, against a deadline, for theirs; so a rank that never arrives
//! is named, not waited on forever, and a different call is an error. Then
//! MPI's blocking collective runs (its tuned algorithms), on a contiguous
//! CPU tensor's own memory under the storage's lock (nothing copied; in
//! place for the in-place calls), else on a staged copy. Sends and
//! receives are non-blocking and polled against the deadline.
//! Float max and min are operations of kiln's own, so that a NaN wins as
//! everywhere else in kiln (MPI's built-in ones may let it lose).

use super::engine::{Engine, Pending};
use super::launch::Launch;
use super::wire::{dist_error, Call, CallKind, Fingerprint, HostBuf, Payload, Wire};
use crate::comm::ReduceOp;
use crate::{Error, Result};
use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use mpi::ffi;
use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const TAG_DATA: c_int = 0;
const TAG_FINGERPRINT: c_int = 1;

enum Msg {
    Run(Call, Sender<Result<HostBuf>>),
    Exit(Sender<()>),
}

pub(crate) struct MpiEngine {
    rank: usize,
    size: usize,
    jobs: Sender<Msg>,
    timeout_ms: Arc<AtomicU64>,
}

/// The communication thread's channel, for the exit handler.
static EXIT: OnceLock<Sender<Msg>> = OnceLock::new();

/// Why the MPI thread is stuck inside MPI (a collective every rank entered
/// that never returned), when it is: later calls fail at once, and the exit
/// handler ends the process instead of waiting for the thread.
static STUCK: Mutex<Option<String>> = Mutex::new(None);

/// Calls the MPI thread has finished: a wait behind a queue of calls is
/// stuck only when none of them finishes within the limit.
static FINISHED: AtomicU64 = AtomicU64::new(0);

fn stuck() -> Option<String> {
    STUCK.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

pub(crate) fn open(launch: &Launch, timeout: Duration) -> Option<Result<Box<dyn Engine>>> {
    (launch.launcher.is_mpi() && launch.size > 1).then(|| MpiEngine::start(launch, timeout).map(|e| Box::new(e) as Box<dyn Engine>))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl MpiEngine {
    fn start(launch: &Launch, timeout: Duration) -> Result<MpiEngine> {
        let timeout_ms = Arc::new(AtomicU64::new(millis(timeout)));
        let (jobs, rx) = unbounded::<Msg>();
        let (ready_tx, ready_rx) = bounded::<std::result::Result<(usize, usize), String>>(1);
        let t = timeout_ms.clone();
        std::thread::Builder::new()
            .name("kiln-mpi".into())
            .spawn(move || {
                let mut comm = match Comm::init(t) {
                    Ok(c) => c,
                    Err(msg) => {
                        let _ = ready_tx.send(Err(msg));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((comm.rank as usize, comm.size as usize)));
                loop {
                    match rx.recv_timeout(Duration::from_millis(10)) {
                        Ok(Msg::Run(call, reply)) => {
                            let out = comm.run(call);
                            FINISHED.fetch_add(1, Ordering::Release);
                            // The caller may have dropped its handle unwaited.
                            let _ = reply.send(out);
                        }
                        Ok(Msg::Exit(done)) => {
                            comm.exit();
                            let _ = done.send(());
                            return;
                        }
                        Err(RecvTimeoutError::Timeout) => {
                            if let Err(msg) = comm.poll_control() {
                                comm.break_with(msg);
                            }
                        }
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
            })
            .map_err(|e| dist_error(launch.rank, launch.size, "dist::init", format!("cannot start the MPI thread: {e}")))?;
        let (rank, size) = ready_rx
            .recv()
            .map_err(|_| dist_error(launch.rank, launch.size, "dist::init", "the MPI thread ended while starting"))?
            .map_err(|msg| dist_error(launch.rank, launch.size, "dist::init", msg))?;
        if (rank, size) != (launch.rank, launch.size) {
            return Err(dist_error(
                rank,
                size,
                "dist::init",
                format!(
                    "MPI says rank {rank} of {size}, the launcher's variables say {launch}; is this the MPI the program was launched with?"
                ),
            ));
        }
        if EXIT.set(jobs.clone()).is_ok() {
            // SAFETY: registers a plain extern "C" function with no arguments.
            unsafe { libc::atexit(finish_at_exit) };
        }
        Ok(MpiEngine { rank, size, jobs, timeout_ms })
    }
}

/// At process exit: MPI_Finalize when every rank is done, MPI_Abort when
/// the group broke or another rank still waits for this one.
extern "C" fn finish_at_exit() {
    if let Some(why) = stuck() {
        eprintln!("kiln::dist: ending this rank without MPI_Finalize: {why}");
        // SAFETY: ends the process at once; the launcher then ends the job.
        unsafe { libc::_exit(1) };
    }
    if let Some(jobs) = EXIT.get() {
        let (tx, rx) = bounded(1);
        if jobs.send(Msg::Exit(tx)).is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(600));
        }
    }
}

impl Engine for MpiEngine {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn submit(&self, call: Call) -> Result<Box<dyn Pending>> {
        let op = call.kind.name();
        if let Some(why) = stuck() {
            return Err(dist_error(self.rank, self.size, op, format!("the group is broken: {why}")));
        }
        // A call that writes the tensor in place and never returns leaves
        // it half-written: poisoned when the wait gives up.
        let written = match &call.data {
            Payload::InPlace(view) if view.write => Some(view.clone()),
            Payload::InPlace(_) | Payload::Staged(_) => None,
        };
        let (tx, rx) = bounded(1);
        self.jobs
            .send(Msg::Run(call, tx))
            .map_err(|_| dist_error(self.rank, self.size, op, "the MPI thread has ended (the process is exiting)"))?;
        Ok(Box::new(MpiPending {
            rx,
            result: Mutex::new(None),
            op,
            timeout_ms: self.timeout_ms.clone(),
            written,
            rank: self.rank,
            size: self.size,
        }))
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms.store(millis(timeout), Ordering::Relaxed);
    }
}

/// A call on the MPI thread's queue.
struct MpiPending {
    rx: Receiver<Result<HostBuf>>,
    /// The reply, once `is_done` has taken it off the channel.
    result: Mutex<Option<Result<HostBuf>>>,
    op: &'static str,
    /// The group's timeout, read at each wait (`set_timeout` may change it
    /// while the call is queued).
    timeout_ms: Arc<AtomicU64>,
    written: Option<super::wire::HostView>,
    rank: usize,
    size: usize,
}

impl MpiPending {
    fn ended(&self) -> Error {
        dist_error(self.rank, self.size, self.op, "the MPI thread has ended (the process is exiting)")
    }
}

impl Pending for MpiPending {
    fn is_done(&self) -> bool {
        let mut result = self.result.lock().unwrap_or_else(|e| e.into_inner());
        if result.is_some() {
            return true;
        }
        match self.rx.try_recv() {
            Ok(r) => {
                *result = Some(r);
                true
            }
            Err(TryRecvError::Empty) => false,
            // A wait would return at once, with that error.
            Err(TryRecvError::Disconnected) => {
                *result = Some(Err(self.ended()));
                true
            }
        }
    }

    fn wait(self: Box<Self>) -> Result<HostBuf> {
        let op = self.op;
        if let Some(r) = self.result.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return r;
        }
        let mut seen = FINISHED.load(Ordering::Acquire);
        loop {
            // The MPI thread names a silent rank within the timeout; past
            // twice that with no call of the queue finished, it is stuck
            // inside MPI.
            let timeout = Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed));
            let limit = timeout.saturating_mul(2).saturating_add(Duration::from_secs(1));
            match self.rx.recv_timeout(limit) {
                Ok(result) => return result,
                Err(RecvTimeoutError::Timeout) => {
                    // Calls queued before this one are still finishing.
                    let now = FINISHED.load(Ordering::Acquire);
                    if now != seen {
                        seen = now;
                        continue;
                    }
                    let why = format!(
                        "{op} did not return from MPI within {:.1} s although every rank had entered it (a network or MPI failure); \
                         the process ends at exit without MPI_Finalize, and the launcher ends the job",
                        limit.as_secs_f64()
                    );
                    *STUCK.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
                    let err = dist_error(self.rank, self.size, op, why);
                    if let Some(view) = &self.written {
                        view.poison(&err);
                    }
                    return Err(err);
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.ended()),
            }
        }
    }
}

/// What this rank knows of another.
struct Peer {
    buf: Box<[u64; 6]>,
    req: ffi::MPI_Request,
    last: Option<Fingerprint>,
    unchecked: VecDeque<Fingerprint>,
}

/// The state the MPI thread owns: every MPI handle lives and dies here.
struct Comm {
    rank: c_int,
    size: c_int,
    data: ffi::MPI_Comm,
    control: ffi::MPI_Comm,
    seq: u64,
    history: VecDeque<Fingerprint>,
    peers: Vec<Option<Peer>>,
    sends: Vec<(Box<[u64; 6]>, ffi::MPI_Request)>,
    nan_max: ffi::MPI_Op,
    nan_min: ffi::MPI_Op,
    broken: Option<String>,
    timeout_ms: Arc<AtomicU64>,
    /// This MPI's `MPI_IN_PLACE` (a C macro rsmpi does not export), for
    /// the implementations whose value is known; `None`: a second buffer.
    in_place: Option<*mut c_void>,
}

/// `MPI_IN_PLACE` of the MPI named by `version` (`MPI_Get_library_version`):
/// `(void *) 1` in Open MPI, `(void *) -1` in MPICH and its derivatives.
fn in_place_of(version: &str) -> Option<*mut c_void> {
    if version.contains("Open MPI") {
        Some(std::ptr::without_provenance_mut(1))
    } else if version.contains("MPICH") || version.contains("Intel(R) MPI") || version.contains("MVAPICH") {
        Some(std::ptr::without_provenance_mut(usize::MAX))
    } else {
        None
    }
}

fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // SAFETY: MPI writes at most MPI_MAX_ERROR_STRING (< 1024) bytes.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    if rc != 0 {
        return format!("MPI error {code}");
    }
    buf.truncate(len.max(0) as usize);
    format!("{} (MPI error {code})", String::from_utf8_lossy(&buf))
}

fn check(what: &str, rc: c_int) -> std::result::Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("{what} failed: {}", error_string(rc)))
    }
}

fn request_null() -> ffi::MPI_Request {
    // SAFETY: reads rsmpi's constant for MPI_REQUEST_NULL.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn datatype(w: Wire) -> ffi::MPI_Datatype {
    // SAFETY: reads rsmpi's constants for the MPI library's handles.
    unsafe {
        match w {
            Wire::F32 => ffi::RSMPI_FLOAT,
            Wire::F64 => ffi::RSMPI_DOUBLE,
            Wire::I32 => ffi::RSMPI_INT32_T,
            Wire::I64 => ffi::RSMPI_INT64_T,
            Wire::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

/// Elementwise max or min where a NaN wins, for f32 and f64 (integers never
/// get here).
unsafe fn nan_wins(inv: *mut c_void, inout: *mut c_void, len: *mut c_int, dt: *mut ffi::MPI_Datatype, max: bool) {
    unsafe {
        let n = (*len).max(0) as usize;
        let pick = |a: f64, b: f64| {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else if (a > b) == max {
                a
            } else {
                b
            }
        };
        if *dt == ffi::RSMPI_DOUBLE {
            let (a, b) = (std::slice::from_raw_parts(inv as *const f64, n), std::slice::from_raw_parts_mut(inout as *mut f64, n));
            for (x, y) in a.iter().zip(b.iter_mut()) {
                *y = pick(*x, *y);
            }
        } else {
            let (a, b) = (std::slice::from_raw_parts(inv as *const f32, n), std::slice::from_raw_parts_mut(inout as *mut f32, n));
            for (x, y) in a.iter().zip(b.iter_mut()) {
                *y = pick(*x as f64, *y as f64) as f32;
            }
        }
    }
}

unsafe extern "C" fn nan_max(inv: *mut c_void, inout: *mut c_void, len: *mut c_int, dt: *mut ffi::MPI_Datatype) {
    unsafe { nan_wins(inv, inout, len, dt, true) }
}

unsafe extern "C" fn nan_min(inv: *mut c_void, inout: *mut c_void, len: *mut c_int, dt: *mut ffi::MPI_Datatype) {
    unsafe { nan_wins(inv, inout, len, dt, false) }
}

impl Comm {
    fn init(timeout_ms: Arc<AtomicU64>) -> std::result::Result<Comm, String> {
        // SAFETY: plain MPI calls on handles this thread creates; every
        // return code is checked.
        unsafe {
            let mut flag: c_int = 0;
            check("MPI_Initialized", ffi::MPI_Initialized(&mut flag))?;
            if flag != 0 {
                return Err("MPI was initialised outside kiln; kiln's MPI thread must own MPI (let kiln::dist::init start it)".into());
            }
            let mut provided: c_int = 0;
            check(
                "MPI_Init_thread",
                ffi::MPI_Init_thread(std::ptr::null_mut(), std::ptr::null_mut(), ffi::RSMPI_THREAD_FUNNELED, &mut provided),
            )?;
            check("MPI_Comm_set_errhandler", ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN))?;
            let (mut rank, mut size) = (0, 0);
            check("MPI_Comm_rank", ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank))?;
            check("MPI_Comm_size", ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size))?;
            let mut data = ffi::RSMPI_COMM_NULL;
            let mut control = ffi::RSMPI_COMM_NULL;
            check("MPI_Comm_dup", ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut data))?;
            check("MPI_Comm_dup", ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut control))?;
            check("MPI_Comm_set_errhandler", ffi::MPI_Comm_set_errhandler(data, ffi::RSMPI_ERRORS_RETURN))?;
            check("MPI_Comm_set_errhandler", ffi::MPI_Comm_set_errhandler(control, ffi::RSMPI_ERRORS_RETURN))?;
            let mut version = vec![0u8; 8192];
            let mut len: c_int = 0;
            check("MPI_Get_library_version", ffi::MPI_Get_library_version(version.as_mut_ptr().cast(), &mut len))?;
            version.truncate(len.clamp(0, 8192) as usize);
            let in_place = in_place_of(&String::from_utf8_lossy(&version));
            let (mut max_op, mut min_op) = (std::mem::zeroed(), std::mem::zeroed());
            check("MPI_Op_create", ffi::MPI_Op_create(Some(nan_max), 1, &mut max_op))?;
            check("MPI_Op_create", ffi::MPI_Op_create(Some(nan_min), 1, &mut min_op))?;
            let mut comm = Comm {
                rank,
                size,
                data,
                control,
                seq: 0,
                history: VecDeque::new(),
                peers: Vec::new(),
                sends: Vec::new(),
                nan_max: max_op,
                nan_min: min_op,
                broken: None,
                timeout_ms,
                in_place,
            };
            for p in 0..size {
                if p == rank {
                    comm.peers.push(None);
                    continue;
                }
                let mut peer = Peer { buf: Box::new([0; 6]), req: ffi::RSMPI_REQUEST_NULL, last: None, unchecked: VecDeque::new() };
                comm.post_control_recv(&mut peer, p)?;
                comm.peers.push(Some(peer));
            }
            Ok(comm)
        }
    }

    fn post_control_recv(&self, peer: &mut Peer, from: c_int) -> std::result::Result<(), String> {
        // SAFETY: the buffer is boxed and lives in `peer` until the request
        // completes or is cancelled.
        unsafe {
            check(
                "MPI_Irecv",
                ffi::MPI_Irecv(peer.buf.as_mut_ptr().cast(), 6, ffi::RSMPI_UINT64_T, from, TAG_FINGERPRINT, self.control, &mut peer.req),
            )
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    fn break_with(&mut self, msg: String) {
        if self.broken.is_none() {
            self.broken = Some(msg);
        }
    }

    fn mine(&self, seq: u64) -> Option<&Fingerprint> {
        let first = self.history.front()?.seq;
        self.history.get(usize::try_from(seq.checked_sub(first)?).ok()?)
    }

    /// Receives the fingerprints that have arrived, and compares those of
    /// collectives this rank has made with its own.
    fn poll_control(&mut self) -> std::result::Result<(), String> {
        for p in 0..self.peers.len() {
            let Some(mut peer) = self.peers[p].take() else { continue };
            let mut result = Ok(());
            loop {
                let mut flag: c_int = 0;
                // SAFETY: tests this thread's own request.
                let rc = unsafe { ffi::MPI_Test(&mut peer.req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                if let Err(e) = check("MPI_Test", rc) {
                    result = Err(e);
                    break;
                }
                if flag == 0 {
                    break;
                }
                let fp = Fingerprint::from_words(*peer.buf);
                peer.last = Some(fp);
                peer.unchecked.push_back(fp);
                if let Err(e) = self.post_control_recv(&mut peer, p as c_int) {
                    result = Err(e);
                    break;
                }
            }
            while let Some(fp) = peer.unchecked.front().copied().filter(|fp| fp.seq <= self.seq) {
                peer.unchecked.pop_front();
                if let Some(mine) = self.mine(fp.seq)
                    && !mine.same_call(&fp)
                {
                    result = Err(format!(
                        "the ranks called different collectives: rank {} called {mine}, rank {p} called {fp}; \
                             every rank must make the same collective calls in the same order",
                        self.rank
                    ));
                }
            }
            self.peers[p] = Some(peer);
            result?;
        }
        // Sends that have completed free their buffers.
        let mut err = Ok(());
        self.sends.retain_mut(|(_, req)| {
            let mut flag: c_int = 0;
            // SAFETY: tests this thread's own request.
            let rc = unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            if rc != 0 {
                err = check("MPI_Test", rc);
            }
            flag == 0
        });
        err
    }

    /// The ranks that have not sent the fingerprint of collective `seq`.
    fn silent(&self, seq: u64) -> Vec<(usize, Option<Fingerprint>)> {
        self.peers
            .iter()
            .enumerate()
            .filter_map(|(r, p)| p.as_ref().filter(|p| p.last.map_or(0, |f| f.seq) < seq).map(|p| (r, p.last)))
            .collect()
    }

    fn timeout_message(&self, fp: &Fingerprint, waited: Duration) -> String {
        let silent = self.silent(fp.seq);
        let after = "The group is now broken: every later call fails at once, and the job is aborted (MPI_Abort) when this process exits. \
             If a rank legitimately works longer between collectives, raise KILN_DIST_TIMEOUT (seconds) or call Group::set_timeout";
        if silent.is_empty() {
            return format!("every rank reached {fp}, yet it did not complete within {:.1} s. {after}", waited.as_secs_f64());
        }
        let who: Vec<String> = silent
            .iter()
            .map(|(r, last)| match last {
                Some(l) => format!("rank {r} (its last collective: {l})"),
                None => format!("rank {r} (no collective yet)"),
            })
            .collect();
        format!(
            "{} did not reach {fp} within {:.1} s: dead, hung, or busy outside collectives. {after}",
            who.join(", "),
            waited.as_secs_f64()
        )
    }

    fn run(&mut self, call: Call) -> Result<HostBuf> {
        let op = call.kind.name();
        let (rank, size) = (self.rank as usize, self.size as usize);
        if let Some(b) = &self.broken {
            return Err(dist_error(rank, size, op, format!("the group is broken: {b}")));
        }
        match self.run_inner(call) {
            Ok(out) => Ok(out),
            Err(msg) => {
                self.break_with(msg.clone());
                Err(dist_error(rank, size, op, msg))
            }
        }
    }

    /// The MPI operation of `op` for this buffer's type.
    fn reduce_op(&self, op: ReduceOp, wire: Wire) -> ffi::MPI_Op {
        let float = matches!(wire, Wire::F32 | Wire::F64);
        // SAFETY: reads rsmpi's constants.
        unsafe {
            match op {
                ReduceOp::Sum | ReduceOp::Mean => ffi::RSMPI_SUM,
                ReduceOp::Max if float => self.nan_max,
                ReduceOp::Min if float => self.nan_min,
                ReduceOp::Max => ffi::RSMPI_MAX,
                ReduceOp::Min => ffi::RSMPI_MIN,
            }
        }
    }

    /// Runs a collective every rank has been seen to enter, with MPI's
    /// blocking call (its tuned algorithms; the non-blocking ones progress
    /// only when polled). Returns this rank's result: a new buffer, the
    /// staged one, or an empty one when the result was written into the
    /// tensor's own memory.
    fn collective(&self, kind: CallKind, data: Payload) -> std::result::Result<HostBuf, String> {
        let (n, wire) = (data.len(), data.wire());
        match data {
            Payload::Staged(mut buf) => {
                let at = buf.as_mut_ptr();
                // SAFETY: the buffer is owned here, holds `n` elements of
                // `wire`, and is not touched until MPI returns.
                Ok(unsafe { self.collective_at(kind, at, true, n, wire) }?.unwrap_or(buf))
            }
            Payload::InPlace(view) => {
                let write = view.write;
                let result = view.with_ptr(|at| {
                    // SAFETY: `at` holds `n` elements of `wire` under the
                    // storage's lock (its write lock when `write`) until
                    // this closure returns, after MPI has.
                    match unsafe { self.collective_at(kind, at, write, n, wire) }? {
                        Some(out) if write && out.len() != n => Err(format!(
                            "{} gave {} elements for a tensor of {n} written in place (a kiln bug: please report it)",
                            kind.name(),
                            out.len()
                        )),
                        Some(out) if write => {
                            // SAFETY: `out` holds `n` elements (checked
                            // above); a separate allocation.
                            unsafe { std::ptr::copy_nonoverlapping(out.as_ptr().cast::<u8>(), at.cast::<u8>(), n * wire.size()) };
                            Ok(HostBuf::U8(Vec::new()))
                        }
                        Some(out) => Ok(out),
                        None if write => Ok(HostBuf::U8(Vec::new())),
                        None => Err(format!("{} left its result in a read-only buffer (a kiln bug: please report it)", kind.name())),
                    }
                })?;
                if let (Err(msg), true) = (&result, write) {
                    // MPI may have written part of it.
                    view.poison(&dist_error(self.rank as usize, self.size as usize, kind.name(), msg.clone()));
                }
                result
            }
        }
    }

    /// Runs `kind` on the `n` elements of `wire` at `at`. Returns the result
    /// in a new buffer, or `None` when it is at `at` (only when `writable`;
    /// a reduce's non-root ranks keep their own elements).
    ///
    /// # Safety
    /// `at` holds `n` elements of `wire`, writable when `writable`, and
    /// nothing else touches them until this returns.
    unsafe fn collective_at(
        &self,
        kind: CallKind,
        at: *mut c_void,
        writable: bool,
        n: usize,
        wire: Wire,
    ) -> std::result::Result<Option<HostBuf>, String> {
        unsafe {
            if n == 0 {
                // Nothing to move, and Open MPI refuses some calls of no
                // elements (MPI_Reduce_scatter_block): every rank has seen the
                // others' fingerprints of this call, which is all it needs.
                return Ok(match kind {
                    CallKind::AllReduce(_) | CallKind::Broadcast { .. } if writable => None,
                    CallKind::Reduce { root, .. } if root != self.rank as usize => None,
                    CallKind::AllReduce(_)
                    | CallKind::Broadcast { .. }
                    | CallKind::Reduce { .. }
                    | CallKind::AllGather
                    | CallKind::ReduceScatter(_)
                    | CallKind::Barrier
                    | CallKind::Send { .. }
                    | CallKind::Recv { .. } => Some(HostBuf::zeros_of(wire, 0)),
                });
            }
            let count =
                c_int::try_from(n).map_err(|_| format!("{n} elements is more than MPI's {} per call; split the tensor", c_int::MAX))?;
            let dt = datatype(wire);
            let read_only = || format!("{} writes its buffer, which was given read-only (a kiln bug: please report it)", kind.name());
            match kind {
                CallKind::AllReduce(op) => {
                    let op = self.reduce_op(op, wire);
                    match self.in_place {
                        Some(in_place) if writable => {
                            check("MPI_Allreduce", ffi::MPI_Allreduce(in_place, at, count, dt, op, self.data))?;
                            Ok(None)
                        }
                        _ => {
                            let mut out = HostBuf::zeros_of(wire, n);
                            check("MPI_Allreduce", ffi::MPI_Allreduce(at, out.as_mut_ptr(), count, dt, op, self.data))?;
                            Ok(Some(out))
                        }
                    }
                }
                CallKind::Broadcast { root } => {
                    if !writable {
                        return Err(read_only());
                    }
                    check("MPI_Bcast", ffi::MPI_Bcast(at, count, dt, root as c_int, self.data))?;
                    Ok(None)
                }
                CallKind::Reduce { root, op } => {
                    let mut out = HostBuf::zeros_of(wire, n);
                    let mpi_op = self.reduce_op(op, wire);
                    check("MPI_Reduce", ffi::MPI_Reduce(at, out.as_mut_ptr(), count, dt, mpi_op, root as c_int, self.data))?;
                    Ok((root == self.rank as usize).then_some(out))
                }
                CallKind::AllGather => {
                    let total = n.checked_mul(self.size as usize).ok_or("all_gather: the result's size overflows")?;
                    let mut out = HostBuf::zeros_of(wire, total);
                    check("MPI_Allgather", ffi::MPI_Allgather(at, count, dt, out.as_mut_ptr(), count, dt, self.data))?;
                    Ok(Some(out))
                }
                CallKind::ReduceScatter(op) => {
                    let piece = n / self.size as usize;
                    let mut out = HostBuf::zeros_of(wire, piece);
                    let mpi_op = self.reduce_op(op, wire);
                    check(
                        "MPI_Reduce_scatter_block",
                        ffi::MPI_Reduce_scatter_block(at, out.as_mut_ptr(), piece as c_int, dt, mpi_op, self.data),
                    )?;
                    Ok(Some(out))
                }
                // Every rank's fingerprint of this barrier has arrived: that
                // is the barrier.
                CallKind::Barrier => Ok(Some(HostBuf::U8(Vec::new()))),
                CallKind::Send { .. } | CallKind::Recv { .. } => Err(format!("{} is not a collective", kind.name())),
            }
        }
    }

    /// Sends or receives `data` to or from `peer`, polled against `deadline`.
    fn point_to_point(
        &mut self,
        kind: CallKind,
        mut data: HostBuf,
        started: Instant,
        deadline: Instant,
    ) -> std::result::Result<HostBuf, String> {
        let n = data.len();
        let count = c_int::try_from(n).map_err(|_| format!("{n} elements is more than MPI's {} per call; split the tensor", c_int::MAX))?;
        let dt = datatype(data.wire());
        let mut req = request_null();
        let (peer, other_side) = match kind {
            // SAFETY: `data` lives in this frame until the request completes
            // (or is leaked below).
            CallKind::Send { peer } => {
                check("MPI_Isend", unsafe { ffi::MPI_Isend(data.as_ptr(), count, dt, peer as c_int, TAG_DATA, self.data, &mut req) })?;
                (peer, "recv")
            }
            CallKind::Recv { peer } => {
                check("MPI_Irecv", unsafe { ffi::MPI_Irecv(data.as_mut_ptr(), count, dt, peer as c_int, TAG_DATA, self.data, &mut req) })?;
                (peer, "send")
            }
            CallKind::AllReduce(_)
            | CallKind::Broadcast { .. }
            | CallKind::Reduce { .. }
            | CallKind::AllGather
            | CallKind::ReduceScatter(_)
            | CallKind::Barrier => return Err(format!("{} is not a point-to-point call", kind.name())),
        };
        loop {
            let mut flag: c_int = 0;
            // SAFETY: tests this thread's own request.
            check("MPI_Test", unsafe { ffi::MPI_Test(&mut req, &mut flag, ffi::RSMPI_STATUS_IGNORE) })?;
            if flag != 0 {
                break;
            }
            self.poll_control()?;
            if Instant::now() > deadline {
                // MPI may still write the buffer: it is leaked, and the job
                // is aborted at exit.
                std::mem::forget(data);
                return Err(format!(
                    "rank {peer} did not make the matching {other_side} of {n} elements within {:.1} s: dead, hung, or busy elsewhere. \
                     The group is now broken and the job is aborted (MPI_Abort) when this process exits",
                    started.elapsed().as_secs_f64()
                ));
            }
            std::thread::yield_now();
        }
        Ok(match kind {
            CallKind::Recv { .. } => data,
            _ => HostBuf::U8(Vec::new()),
        })
    }

    fn run_inner(&mut self, call: Call) -> std::result::Result<HostBuf, String> {
        let started = Instant::now();
        let deadline = started + self.timeout();
        let Call { kind, data } = call;
        if !kind.is_collective() {
            // Sent and received from staged buffers: a request past its
            // deadline keeps its buffer for good (leaked), which a view of
            // a tensor could not do without keeping the tensor locked.
            let data = match data {
                Payload::Staged(buf) => buf,
                Payload::InPlace(view) => view.staged()?,
            };
            return self.point_to_point(kind, data, started, deadline);
        }
        self.seq += 1;
        let fp = Fingerprint::of(self.seq, kind, &data);
        self.history.push_back(fp);
        if self.history.len() > 4096 {
            self.history.pop_front();
        }
        for p in 0..self.size {
            if p == self.rank {
                continue;
            }
            let words = Box::new(fp.to_words());
            let mut req = request_null();
            // SAFETY: the boxed words stay in `self.sends` until the send completes.
            check("MPI_Isend", unsafe {
                ffi::MPI_Isend(words.as_ptr().cast(), 6, ffi::RSMPI_UINT64_T, p, TAG_FINGERPRINT, self.control, &mut req)
            })?;
            self.sends.push((words, req));
        }
        // Every rank's fingerprint of this collective, compared with this
        // rank's, before the collective starts: a silent rank is named here,
        // and a different call is an error instead of a wrong result.
        loop {
            self.poll_control()?;
            if self.silent(fp.seq).is_empty() {
                break;
            }
            if Instant::now() > deadline {
                return Err(self.timeout_message(&fp, started.elapsed()));
            }
            std::thread::yield_now();
        }
        self.collective(kind, data)
    }

    /// At process exit: finalise when every other rank has made exactly
    /// this rank's collectives, else abort the job with the reason.
    fn exit(&mut self) {
        let deadline = Instant::now() + self.timeout();
        let reason = loop {
            if let Some(b) = &self.broken {
                break Some(b.clone());
            }
            if let Err(msg) = self.poll_control() {
                break Some(msg);
            }
            let ahead: Vec<String> = self
                .peers
                .iter()
                .enumerate()
                .filter_map(|(r, p)| p.as_ref()?.last.filter(|l| l.seq > self.seq).map(|l| format!("rank {r} waits in {l}")))
                .collect();
            if !ahead.is_empty() {
                break Some(format!("rank {} exits after {} collectives while {}", self.rank, self.seq, ahead.join(", ")));
            }
            let behind = self.silent(self.seq);
            if behind.is_empty() && self.sends.is_empty() {
                break None;
            }
            if Instant::now() > deadline {
                let who: Vec<String> = behind.iter().map(|(r, _)| format!("rank {r}")).collect();
                break Some(format!(
                    "rank {} exits after {} collectives; {} did not make them all within {:.0} s",
                    self.rank,
                    self.seq,
                    who.join(", "),
                    self.timeout().as_secs_f64()
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        // SAFETY: MPI calls on this thread's handles; nothing is used after.
        unsafe {
            if let Some(reason) = reason {
                eprintln!("kiln::dist: aborting the MPI job: {reason}");
                // The other ranks get a moment to report their own errors
                // before MPI_Abort ends them.
                std::thread::sleep(self.timeout().min(Duration::from_secs(2)));
                ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
                return;
            }
            for peer in self.peers.iter_mut().flatten() {
                ffi::MPI_Cancel(&mut peer.req);
                ffi::MPI_Wait(&mut peer.req, ffi::RSMPI_STATUS_IGNORE);
            }
            ffi::MPI_Op_free(&mut self.nan_max);
            ffi::MPI_Op_free(&mut self.nan_min);
            ffi::MPI_Comm_free(&mut self.data);
            ffi::MPI_Comm_free(&mut self.control);
            ffi::MPI_Finalize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::in_place_of;

    #[test]
    fn mpi_in_place_is_known_for_open_mpi_and_mpich_only() {
        assert_eq!(in_place_of("Open MPI v4.1.4, package: Debian OpenMPI"), Some(std::ptr::without_provenance_mut(1)));
        assert_eq!(in_place_of("MPICH Version: 4.0.2"), Some(std::ptr::without_provenance_mut(usize::MAX)));
        assert_eq!(in_place_of("Some other MPI 1.0"), None);
    }
}
