//! A simulated GPU's in-order queue: jobs submitted by any thread, run one
//! at a time by the queue's own worker thread, with sequence numbers that
//! events wait for. A simulated GPU has a compute queue, and a second queue
//! for collectives (started by the first one), as a GPU has a stream for
//! NCCL beside its compute stream: communication then overlaps compute.
//!
//! Each queue also keeps a *device clock*: the time its work would take on
//! a GPU of its own, in nanoseconds on [`now_ns`]'s scale. A large kernel
//! advances it by the CPU time it ran for (not the time its thread waited
//! for one of the host's cores), a small one or a read by the wall time it
//! took; a transfer over the modelled link ([`Job::Transfer`],
//! [`Job::Arrive`]) by the link's modelled time, whatever the host's own
//! copy took; a wait on another queue's event moves it to that event's
//! device time. Waiting in wall time (a queue
//! whose host thread is late, a hold) does not advance it. So an interval
//! between two [`Job::Mark`]s is what the devices would take, free of this
//! host's core count: `sim::elapsed` reads it.

use super::super::host;
use crate::base::buffer::CpuBuffer;
use crate::base::device::Device;
use crate::base::error::{Error, Result};
use crate::kernel::storage::Storage;
use crate::kernel::Event;
use crate::kernel::{Kernel, Out, Src};
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// One entry of a queue.
pub(super) enum Job {
    /// A kernel: skipped while the queue is poisoned by an earlier failure,
    /// or when an input is poisoned; its output is then poisoned too.
    Kernel(Box<(Kernel<'static>, Arc<Storage>)>),
    /// A read to the host; answers with the elements, or with the failure
    /// that poisoned the queue (a read synchronises, so it reports it), or
    /// with the fault of a poisoned source storage.
    Read(Src<'static>, Sender<Result<CpuBuffer>>),
    /// Queue bookkeeping that always runs (event waits, holds).
    Control(Box<dyn FnOnce() + Send>),
    /// A wait for another queue's event, timed: what a compute queue spends
    /// waiting on communication (see [`QueueTimes`]).
    Wait(Arc<dyn Event>),
    /// A kernel that moves data over the modelled link (a ring step's send
    /// or combine, a collective's local copy): run as a kernel, but not
    /// charged to the device clock, which the link's modelled time
    /// ([`Job::Arrive`]) covers instead. A send carries a [`Stamp`] of when
    /// it started.
    Transfer(Box<(Kernel<'static>, Arc<Storage>)>, Option<Arc<Stamp>>),
    /// The end of a transfer, on its receiver: waits until the modelled
    /// transfer time (nanoseconds) since the send's [`Stamp`] has passed,
    /// on the wall clock and on the device clock. Nothing when the send did
    /// not run (a poisoned queue).
    Arrive(Arc<Stamp>, u64),
    /// Stores the device clock in the slot, after moving the clock up to
    /// `at` (a [`now_ns`] time) when given: the bounds of a timed interval.
    Mark(Option<u64>, Arc<AtomicU64>),
}

/// When a send started: on the wall clock ([`now_ns`]) and on its queue's
/// device clock; 0 until it runs.
#[derive(Default)]
pub(super) struct Stamp {
    wall_ns: AtomicU64,
    device_ns: AtomicU64,
}

/// Nanoseconds since the first call, at least 1: the scale of the device
/// clocks and of the modelled transfers' deadlines.
pub(crate) fn now_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    u64::try_from(EPOCH.get_or_init(Instant::now).elapsed().as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// Sleeps until `deadline_ns` (on the [`now_ns`] clock). The queues' threads
/// ask Linux for a timer slack of 1 ns so that the modelled transfer times
/// hold to a few microseconds.
fn sleep_until(deadline_ns: u64) {
    #[cfg(target_os = "linux")]
    {
        thread_local!(static SLACK_SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
        SLACK_SET.with(|s| {
            if !s.get() {
                // SAFETY: PR_SET_TIMERSLACK takes one integer argument and
                // only changes this thread's timer slack.
                unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
                s.set(true);
            }
        });
    }
    loop {
        let now = now_ns();
        if now >= deadline_ns {
            return;
        }
        std::thread::sleep(std::time::Duration::from_nanos(deadline_ns - now));
    }
}

/// How many completed jobs' device times a queue remembers for the events
/// that other queues wait on.
const CLOCK_HISTORY: usize = 1024;

/// Time a queue's worker spent, in nanoseconds, since it started.
#[derive(Default)]
pub(super) struct Timers {
    /// Running kernels.
    pub kernels_ns: AtomicU64,
    /// Blocked in [`Job::Wait`]s for other queues.
    pub waits_ns: AtomicU64,
}

/// How far a queue has got: jobs submitted and jobs completed, and the
/// first failure of a kernel since the last synchronising call.
pub(super) struct Progress {
    pub submitted: AtomicU64,
    /// Jobs completed; written by the worker only.
    completed: AtomicU64,
    /// The smallest job number a thread blocked in `wait_for` waits for
    /// (`u64::MAX`: none): the worker takes `lock` and wakes the waiters
    /// only once that job is done. A futex wake on every job costs more
    /// than a small kernel, and wakes a thread that waits for a later job
    /// onto a core another simulated GPU is computing on.
    wake_at: AtomicU64,
    lock: Mutex<()>,
    done: Condvar,
    /// Set by the worker when a kernel fails (CUDA's sticky error); taken,
    /// and so cleared, by the next synchronising call.
    failure: Mutex<Option<Error>>,
    /// Fast check of `failure` on the launch path.
    poisoned: AtomicBool,
    /// Live `hold_queue` holds: an allocation does not wait for a held queue.
    pub holds: AtomicUsize,
    pub timers: Timers,
    /// The device clock when job `seq` completed, at `seq % CLOCK_HISTORY`;
    /// written by the worker before it counts the job as done.
    clock_at: Box<[AtomicU64]>,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            submitted: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            wake_at: AtomicU64::new(u64::MAX),
            lock: Mutex::new(()),
            done: Condvar::new(),
            failure: Mutex::new(None),
            poisoned: AtomicBool::new(false),
            holds: AtomicUsize::new(0),
            timers: Timers::default(),
            clock_at: (0..CLOCK_HISTORY).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The device clock when job `seq` completed: `None` before it has, and
    /// once `CLOCK_HISTORY` later jobs have reused its slot.
    fn device_time(&self, seq: u64) -> Option<u64> {
        if seq == 0 {
            return None;
        }
        let t = self.clock_at[(seq % CLOCK_HISTORY as u64) as usize].load(Ordering::Acquire);
        // Read after `t`: had `t` come from job seq + CLOCK_HISTORY, the
        // worker would have counted seq + CLOCK_HISTORY − 1 jobs before it.
        let completed = self.completed.load(Ordering::SeqCst);
        (completed >= seq && completed < seq + CLOCK_HISTORY as u64 - 1).then_some(t)
    }

    pub fn wait_for(&self, seq: u64) {
        // In a forked child the worker does not exist: nothing more will
        // complete, and every later submission fails (`submit`).
        if self.completed.load(Ordering::Acquire) >= seq || crate::runtime::fork::in_child() {
            return;
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // SeqCst with `job_done`: either the worker sees this target
            // once it has counted job `seq`, or this check sees the count
            // (no lost wake-up). The worker resets the target only under
            // `lock` and wakes every waiter then, and each registers again.
            self.wake_at.fetch_min(seq, Ordering::SeqCst);
            if self.completed.load(Ordering::SeqCst) >= seq {
                return;
            }
            guard = self.done.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }
    /// Counts one job as done and wakes the waiting threads when one of
    /// them waits for it (or for an earlier job).
    fn job_done(&self) {
        let completed = self.completed.fetch_add(1, Ordering::SeqCst) + 1;
        if self.wake_at.load(Ordering::SeqCst) <= completed {
            // Taking the lock orders this wake-up after a waiter that saw
            // the old count has gone to sleep.
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake_at.store(u64::MAX, Ordering::SeqCst);
            self.done.notify_all();
        }
    }
    pub fn fail(&self, err: Error) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if failure.is_none() {
            *failure = Some(err);
        }
        self.poisoned.store(true, Ordering::Release);
    }
    /// The pending failure, cleared: the caller reports it.
    pub fn take_failure(&self) -> Option<Error> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        self.poisoned.store(false, Ordering::Release);
        failure.take()
    }
    /// The pending failure, left in place: the worker poisons the outputs of
    /// the kernels it skips with it until a synchronising call reports it.
    pub fn peek_failure(&self) -> Option<Error> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A point in a queue: waiting on it waits for every job submitted before.
pub(super) struct SimEvent {
    progress: Arc<Progress>,
    seq: u64,
}

impl Event for SimEvent {
    fn wait(&self) {
        self.progress.wait_for(self.seq);
    }
    fn device_time_ns(&self) -> Option<u64> {
        self.progress.device_time(self.seq)
    }
}

/// An in-order queue served by its own worker thread.
pub(super) struct Queue {
    device: Device,
    sender: Mutex<Sender<Job>>,
    pub progress: Arc<Progress>,
}

impl Queue {
    /// A queue of at most `depth` waiting jobs, served by a thread called `name`.
    pub fn start(device: Device, name: String, depth: usize) -> Queue {
        // The device clock counts from `now_ns`'s epoch: fix it before any
        // job runs, so that a clock never reads ahead of the wall.
        now_ns();
        // A child forked after this thread starts must know it is one (its
        // queue has no worker there): the handlers go in before the spawn.
        crate::runtime::fork::install_handlers();
        let (sender, receiver) = crossbeam_channel::bounded::<Job>(depth);
        let progress = Arc::new(Progress::new());
        let worker_progress = progress.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || worker(device, receiver, worker_progress))
            .map(|_| ())
            .unwrap_or_else(|e| eprintln!("kiln: cannot start the worker of simulated {device}: {e}"));
        Queue { device, sender: Mutex::new(sender), progress }
    }

    /// Enqueues a job; blocks while the queue is full.
    pub fn submit(&self, job: Job) -> Result<u64> {
        if crate::runtime::fork::in_child() {
            return Err(gone_after_fork(self.device));
        }
        // Numbering and sending under one lock keeps sequence numbers in
        // queue order when several threads submit at once.
        let sender = self.sender.lock().unwrap_or_else(|e| e.into_inner());
        let seq = self.progress.submitted.fetch_add(1, Ordering::AcqRel) + 1;
        let job = match sender.try_send(job) {
            Ok(()) => return Ok(seq),
            // A full queue: wait until half of it has run before sending
            // again. Sending as soon as one job leaves would wake this
            // thread once per job, onto a core a simulated GPU computes on.
            Err(crossbeam_channel::TrySendError::Full(job)) => {
                let depth = sender.capacity().unwrap_or(1) as u64;
                self.progress.wait_for(seq.saturating_sub(1 + depth / 2));
                job
            }
            Err(crossbeam_channel::TrySendError::Disconnected(job)) => job,
        };
        if sender.send(job).is_err() {
            // Nothing was queued: take the number back, or synchronize would
            // wait for it forever.
            self.progress.submitted.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Backend { device: self.device, msg: "the simulated GPU's worker thread has stopped".into() });
        }
        Ok(seq)
    }

    /// An event at the current end of the queue.
    pub fn record_event(&self) -> Arc<SimEvent> {
        let seq = self.progress.submitted.load(Ordering::Acquire);
        Arc::new(SimEvent { progress: self.progress.clone(), seq })
    }

    /// Later jobs of this queue wait for `event` (the host does not).
    pub fn wait_event(&self, event: Arc<dyn Event>) -> Result<()> {
        self.submit(Job::Wait(event))?;
        Ok(())
    }

    /// Waits for every job submitted so far.
    pub fn wait_all(&self) {
        self.progress.wait_for(self.progress.submitted.load(Ordering::Acquire));
    }
}

/// The error of a call made in a child of `fork()`, where the queue's worker
/// does not exist.
pub(super) fn gone_after_fork(device: Device) -> Error {
    Error::Backend {
        device,
        msg: "this process is a child made by fork(), and the simulated GPU's queue worker stayed in the parent; \
              use the CPU in the child, or create the child with std::process::Command instead of fork"
            .into(),
    }
}

fn elapsed_ns(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The CPU time this thread has used, in nanoseconds (Linux; elsewhere
/// `None`).
fn thread_cpu_ns() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes one timespec, which `ts` is.
        if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
            return Some((ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64));
        }
    }
    None
}

/// Kernels that read and write at least this many elements in all are
/// charged to the device clock by their CPU time; smaller ones by their wall
/// time. Reading a thread's CPU clock is a system call, a microsecond or
/// more on a virtual machine: more than a small kernel takes, and a small
/// kernel is rarely descheduled midway.
const CPU_TIMED_ELEMENTS: usize = 1 << 18;

/// Elements a kernel reads and writes, counted by whole storages.
fn elements_touched(kernel: &Kernel<'_>, out: &Storage) -> usize {
    let inputs = match kernel {
        Kernel::Unary { src, .. } | Kernel::Reduce { src, .. } => src.storage.len,
        Kernel::Binary { lhs, rhs, .. } => lhs.storage.len.saturating_add(rhs.storage.len),
        Kernel::Custom { inputs, .. } => inputs.iter().fold(0usize, |n, i| n.saturating_add(i.storage.len)),
    };
    inputs.saturating_add(out.len)
}

/// Runs a kernel job unless the queue is poisoned (after a failure the
/// queue skips kernels until the failure is reported: their inputs may be
/// unwritten) or one of its inputs is (its result could only be wrong); a
/// kernel skipped or failed leaves its output *poisoned* with the original
/// failure ([`Storage::poison`]), which every later read of it, or of what
/// is computed from it, returns; one that succeeds writing all of its
/// output clears that mark. Returns what it costs on the device clock: the
/// CPU time it ran for when it is large ([`CPU_TIMED_ELEMENTS`]), which
/// leaves out any wait for one of the host's cores while other simulated
/// GPUs held them, and its wall time otherwise.
fn run_kernel(device: Device, progress: &Progress, work: Box<(Kernel<'static>, Arc<Storage>)>) -> u64 {
    let mut took = 0;
    let (kernel, out) = &*work;
    let pending = if progress.poisoned.load(Ordering::Acquire) { progress.peek_failure() } else { None };
    let skipped = pending.or_else(|| kernel.input_fault());
    if let Some(fault) = skipped {
        out.poison(&fault);
    } else {
        let cpu = if elements_touched(kernel, out) >= CPU_TIMED_ELEMENTS { thread_cpu_ns() } else { None };
        let start = Instant::now();
        match host::run_caught(kernel, Out::Storage(out), 1, device) {
            Ok(()) if kernel.overwrites(out.len) => out.recomputed(),
            Ok(()) => {}
            Err(err) => {
                out.poison(&err);
                progress.fail(err);
            }
        }
        let wall = elapsed_ns(start);
        took = match (cpu, cpu.and_then(|_| thread_cpu_ns())) {
            (Some(before), Some(after)) => after.saturating_sub(before).min(wall),
            _ => wall,
        };
        progress.timers.kernels_ns.fetch_add(wall, Ordering::Relaxed);
    }
    // The kernel's storages are released here, before the job counts as
    // done: a waiting allocation then finds them free.
    drop(work);
    took
}

fn worker(device: Device, receiver: Receiver<Job>, progress: Arc<Progress>) {
    // The device clock (see the module's documentation) and the number of
    // jobs done.
    let mut clock: u64 = 0;
    let mut seq: u64 = 0;
    while let Ok(job) = receiver.recv() {
        match job {
            Job::Kernel(work) => clock = clock.saturating_add(run_kernel(device, &progress, work)),
            Job::Transfer(work, stamp) => {
                // A send that a poisoned queue skips leaves its stamp at 0,
                // and its arrival waits for nothing.
                if let Some(stamp) = stamp.as_ref().filter(|_| !progress.poisoned.load(Ordering::Acquire)) {
                    stamp.device_ns.store(clock, Ordering::Release);
                    stamp.wall_ns.store(now_ns(), Ordering::Release);
                }
                run_kernel(device, &progress, work);
            }
            Job::Arrive(stamp, modelled_ns) => {
                let start = stamp.wall_ns.load(Ordering::Acquire);
                if start > 0 {
                    sleep_until(start.saturating_add(modelled_ns));
                    clock = clock.max(stamp.device_ns.load(Ordering::Acquire).saturating_add(modelled_ns));
                }
            }
            Job::Mark(at, slot) => {
                clock = clock.max(at.unwrap_or(0));
                slot.store(clock, Ordering::Release);
            }
            Job::Read(src, reply) => {
                let start = Instant::now();
                // The first synchronising call reports the queue's failure,
                // whatever it reads; a poisoned storage's fault stays with it.
                let result = match progress.take_failure().or_else(|| src.storage.fault()) {
                    Some(err) => Err(err),
                    None => host::gather_caught(&src, device),
                };
                drop(src);
                clock = clock.saturating_add(elapsed_ns(start));
                let _ = reply.send(result);
            }
            Job::Control(f) => {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                    progress.fail(Error::KernelFailed {
                        device,
                        op: "queue control".into(),
                        msg: "an internal queue operation panicked (a kiln bug: please report it)".into(),
                    });
                }
            }
            Job::Wait(event) => {
                let start = Instant::now();
                event.wait();
                progress.timers.waits_ns.fetch_add(elapsed_ns(start), Ordering::Relaxed);
                clock = clock.max(event.device_time_ns().unwrap_or(0));
            }
        }
        seq += 1;
        progress.clock_at[(seq % CLOCK_HISTORY as u64) as usize].store(clock, Ordering::Release);
        progress.job_done();
    }
}
