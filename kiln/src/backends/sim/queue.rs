//! A simulated GPU's in-order queue: jobs submitted by any thread, run one
//! at a time by the queue's own worker thread, with sequence numbers that
//! events wait for. A simulated GPU has a compute queue, and a second queue
//! for collectives (started by the first one), as a GPU has a stream for
//! NCCL beside its compute stream: communication then overlaps compute.

use super::super::host;
use crate::base::buffer::CpuBuffer;
use crate::base::device::Device;
use crate::base::error::{Error, Result};
use crate::kernel::backend::Event;
use crate::kernel::storage::Storage;
use crate::kernel::{Kernel, Out, Src};
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// One entry of a queue.
pub(super) enum Job {
    /// A kernel: skipped while the queue is poisoned by an earlier failure.
    Kernel(Box<(Kernel<'static>, Arc<Storage>)>),
    /// A read to the host; answers with the elements, or with the failure
    /// that poisoned the queue (a read synchronises, so it reports it).
    Read(Src<'static>, Sender<Result<CpuBuffer>>),
    /// Queue bookkeeping that always runs (event waits, holds).
    Control(Box<dyn FnOnce() + Send>),
    /// A wait for another queue's event, timed: what a compute queue spends
    /// waiting on communication (see [`QueueTimes`]).
    Wait(Arc<dyn Event>),
}

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
    /// Threads blocked in `wait_for`: the worker takes `lock` and wakes
    /// them only when there are some (a futex wake on every job costs more
    /// than a small kernel).
    waiters: AtomicUsize,
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
}

impl Progress {
    fn new() -> Progress {
        Progress {
            submitted: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            done: Condvar::new(),
            failure: Mutex::new(None),
            poisoned: AtomicBool::new(false),
            holds: AtomicUsize::new(0),
            timers: Timers::default(),
        }
    }

    pub fn wait_for(&self, seq: u64) {
        // In a forked child the worker does not exist: nothing more will
        // complete, and every later submission fails (`submit`).
        if self.completed.load(Ordering::Acquire) >= seq || crate::runtime::fork::in_child() {
            return;
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        // SeqCst with `job_done`: either the worker sees this waiter, or
        // this check sees the worker's new count (no lost wake-up).
        self.waiters.fetch_add(1, Ordering::SeqCst);
        while self.completed.load(Ordering::SeqCst) < seq {
            guard = self.done.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }
    /// Counts one job as done and wakes the threads waiting, if any.
    fn job_done(&self) {
        self.completed.fetch_add(1, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            // Taking the lock orders this wake-up after a waiter that saw
            // the old count has gone to sleep.
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
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
    /// The pending failure, left in place (launches fail fast until it is reported).
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

fn worker(device: Device, receiver: Receiver<Job>, progress: Arc<Progress>) {
    while let Ok(job) = receiver.recv() {
        match job {
            Job::Kernel(kernel) => {
                // After a failure the queue skips kernels until the failure
                // is reported: their inputs may be unwritten.
                if !progress.poisoned.load(Ordering::Acquire) {
                    let start = Instant::now();
                    let (kernel, out) = &*kernel;
                    if let Err(err) = host::run_caught(kernel, Out::Storage(out), 1, device) {
                        progress.fail(err);
                    }
                    progress.timers.kernels_ns.fetch_add(elapsed_ns(start), Ordering::Relaxed);
                }
                // The kernel's storages are released here, before the job
                // counts as done: a waiting allocation then finds them free.
                drop(kernel);
            }
            Job::Read(src, reply) => {
                let result = match progress.take_failure() {
                    Some(err) => Err(err),
                    None => host::gather_caught(&src, device),
                };
                drop(src);
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
            }
        }
        progress.job_done();
    }
}
