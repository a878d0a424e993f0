//! Simulated GPUs: discrete devices made of host RAM. Each has its own memory
//! pool with a hard capacity and an in-order queue served by its own worker
//! thread, which runs the host kernels single-threaded (one "GPU" = one
//! core). Operations validate and allocate on the caller's thread, enqueue
//! and return at once; reads wait for the work that produces them.

use super::host;
use super::Found;
use crate::base::buffer::CpuBuffer;
use crate::base::device::{Device, DeviceKind};
use crate::base::dtype::DType;
use crate::base::env::{env_setting, parse_bytes};
use crate::base::error::{human_bytes, Error, Result};
use crate::kernel::backend::{Backend, Event, QueueHold};
use crate::kernel::storage::{Buffer, Storage};
use crate::kernel::{Kernel, Out, Src};
use crate::runtime::memory::MemoryPool;
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// One entry of a simulated GPU's queue.
enum Job {
    /// A kernel: skipped while the queue is poisoned by an earlier failure.
    Kernel(Box<(Kernel<'static>, Arc<Storage>)>),
    /// A read to the host; answers with the elements, or with the failure
    /// that poisoned the queue (a read synchronises, so it reports it).
    Read(Src<'static>, Sender<Result<CpuBuffer>>),
    /// Queue bookkeeping that always runs (event waits, holds).
    Control(Box<dyn FnOnce() + Send>),
}

/// How far a queue has got: jobs submitted and jobs completed, and the
/// first failure of a kernel since the last synchronising call.
struct Progress {
    submitted: AtomicU64,
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
    holds: AtomicUsize,
}

impl Progress {
    fn wait_for(&self, seq: u64) {
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
    fn fail(&self, err: Error) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if failure.is_none() {
            *failure = Some(err);
        }
        self.poisoned.store(true, Ordering::Release);
    }
    /// The pending failure, cleared: the caller reports it.
    fn take_failure(&self) -> Option<Error> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        self.poisoned.store(false, Ordering::Release);
        failure.take()
    }
    /// The pending failure, left in place (launches fail fast until it is reported).
    fn peek_failure(&self) -> Option<Error> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

struct SimEvent {
    progress: Arc<Progress>,
    seq: u64,
}

impl Event for SimEvent {
    fn wait(&self) {
        self.progress.wait_for(self.seq);
    }
}

/// Kernels a simulated GPU's queue holds at most before the host blocks in
/// `launch`, like a real GPU's launch queue (`KILN_SIM_QUEUE_DEPTH`).
pub(crate) const DEFAULT_QUEUE_DEPTH: usize = 1024;

pub(crate) struct SimBackend {
    latency: std::time::Duration,
    device: Device,
    index: usize,
    pool: MemoryPool,
    sender: Mutex<Sender<Job>>,
    progress: Arc<Progress>,
    depth: usize,
}

impl SimBackend {
    pub(crate) fn new(device: Device, index: usize, capacity: usize) -> Self {
        let depth = queue_depth();
        let (sender, receiver) = crossbeam_channel::bounded::<Job>(depth);
        let progress = Arc::new(Progress {
            submitted: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            done: Condvar::new(),
            failure: Mutex::new(None),
            poisoned: AtomicBool::new(false),
            holds: AtomicUsize::new(0),
        });
        let worker_progress = progress.clone();
        std::thread::Builder::new()
            .name(format!("kiln-sim-gpu{index}"))
            .spawn(move || worker(device, receiver, worker_progress))
            .map(|_| ())
            .unwrap_or_else(|e| eprintln!("kiln: cannot start the worker of simulated {device}: {e}"));
        SimBackend {
            latency: transfer_latency(),
            device,
            index,
            pool: MemoryPool::new(device, Some(capacity), 0),
            sender: Mutex::new(sender),
            progress,
            depth,
        }
    }

    /// A host<->device copy pays the bus's round-trip latency, as on a real
    /// GPU: this is what makes per-step host reads slow (the chapter's
    /// exercise 3). A spin, since sleeping cannot wait for 10 µs.
    fn bus_latency(&self) {
        if self.latency.is_zero() {
            return;
        }
        let start = std::time::Instant::now();
        while start.elapsed() < self.latency {
            std::hint::spin_loop();
        }
    }

    /// Enqueues a job; blocks while the queue holds `depth` jobs.
    fn submit(&self, job: Job) -> Result<u64> {
        if crate::runtime::fork::in_child() {
            return Err(self.gone_after_fork());
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

    fn gone_after_fork(&self) -> Error {
        Error::Backend {
            device: self.device,
            msg: "this process is a child made by fork(), and the simulated GPU's queue worker stayed in the parent; \
                  use the CPU in the child, or create the child with std::process::Command instead of fork"
                .into(),
        }
    }

    /// Waits for all submitted work unless the queue is held (then waiting
    /// could never end).
    fn drain(&self) -> bool {
        if self.progress.holds.load(Ordering::Acquire) > 0 {
            return false;
        }
        self.progress.wait_for(self.progress.submitted.load(Ordering::Acquire));
        true
    }

    /// Books `bytes`; when they do not fit, waits for the queue's pending
    /// work (whose kernels hold the storages of dropped tensors) to finish
    /// and free them, and tries once more: stream-ordered memory.
    fn reserve(&self, bytes: usize) -> Result<()> {
        match self.pool.reserve(bytes) {
            Err(Error::OutOfMemory { .. }) if self.drain() => self.pool.reserve(bytes),
            other => other,
        }
    }
}

/// `KILN_SIM_QUEUE_DEPTH`: kernels queued per simulated GPU before the host waits.
fn queue_depth() -> usize {
    static DEPTH: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *DEPTH.get_or_init(|| {
        crate::base::env::env_setting("KILN_SIM_QUEUE_DEPTH", "a number of kernels from 1 to 1048576, e.g. 1024", |v| {
            v.parse::<usize>().ok().filter(|&d| (1..=1 << 20).contains(&d))
        })
        .unwrap_or(DEFAULT_QUEUE_DEPTH)
    })
}

/// Default latency of a host<->device copy on a simulated GPU, about a PCIe
/// round trip.
pub(crate) const DEFAULT_TRANSFER_LATENCY_US: u64 = 10;

/// `KILN_SIM_TRANSFER_LATENCY` in microseconds (`0` turns it off).
fn transfer_latency() -> std::time::Duration {
    static US: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let us = *US.get_or_init(|| {
        crate::base::env::env_setting("KILN_SIM_TRANSFER_LATENCY", "microseconds from 0 to 1000000, e.g. 10", |v| {
            v.trim_end_matches("us").trim().parse::<u64>().ok().filter(|&us| us <= 1_000_000)
        })
        .unwrap_or(DEFAULT_TRANSFER_LATENCY_US)
    });
    std::time::Duration::from_micros(us)
}

fn worker(device: Device, receiver: Receiver<Job>, progress: Arc<Progress>) {
    while let Ok(job) = receiver.recv() {
        match job {
            Job::Kernel(kernel) => {
                // After a failure the queue skips kernels until the failure
                // is reported: their inputs may be unwritten.
                if !progress.poisoned.load(Ordering::Acquire) {
                    let (kernel, out) = &*kernel;
                    if let Err(err) = host::run_caught(kernel, Out::Storage(out), 1, device) {
                        progress.fail(err);
                    }
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
        }
        progress.job_done();
    }
}

impl Backend for SimBackend {
    fn device(&self) -> Device {
        self.device
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Simulated
    }
    fn name(&self) -> String {
        format!("kiln simulated GPU {} ({} host RAM, 1 core)", self.index, human_bytes(self.pool.capacity().unwrap_or(0)))
    }
    fn details(&self) -> Vec<(String, String)> {
        vec![
            ("transfer latency".into(), format!("{} us", self.latency.as_micros())),
            ("queue depth".into(), format!("{} kernels", self.depth)),
        ]
    }
    fn pool(&self) -> &MemoryPool {
        &self.pool
    }
    fn is_async(&self) -> bool {
        true
    }
    fn driver_free_memory(&self) -> Option<usize> {
        let stats = self.pool.stats();
        stats.capacity.map(|c| c.saturating_sub(stats.in_use))
    }
    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<Buffer> {
        match self.pool.alloc_host(dtype, len) {
            Err(Error::OutOfMemory { .. }) if self.drain() => Ok(Buffer::Host(self.pool.alloc_host(dtype, len)?)),
            other => Ok(Buffer::Host(other?)),
        }
    }
    fn release(&self, buffer: Buffer, bytes: usize) {
        match buffer {
            Buffer::Host(b) => self.pool.release_host(b, bytes),
            Buffer::Device(_) => self.pool.unreserve(bytes),
        }
    }
    fn launch(&self, kernel: &Kernel<'_>, out: &Arc<Storage>) -> Result<()> {
        // A failed kernel poisons the queue until a synchronising call
        // reports it; launching meanwhile fails fast with that failure.
        if let Some(err) = self.progress.peek_failure() {
            return Err(err);
        }
        self.submit(Job::Kernel(Box::new((kernel.to_owned(), out.clone()))))?;
        Ok(())
    }
    fn upload(&self, data: CpuBuffer) -> Result<Buffer> {
        self.reserve(data.size_in_bytes())?;
        self.bus_latency();
        Ok(Buffer::Host(data))
    }
    fn download(&self, src: &Src<'_>) -> Result<CpuBuffer> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.submit(Job::Read(src.to_owned(), tx))?;
        let data = rx
            .recv()
            .map_err(|_| Error::Backend { device: self.device, msg: "a read from the simulated GPU did not complete".into() })??;
        self.bus_latency();
        Ok(data)
    }
    fn record_event(&self) -> Option<Arc<dyn Event>> {
        let seq = self.progress.submitted.load(Ordering::Acquire);
        Some(Arc::new(SimEvent { progress: self.progress.clone(), seq }))
    }
    fn wait_event(&self, event: Arc<dyn Event>) -> Result<()> {
        self.submit(Job::Control(Box::new(move || event.wait())))?;
        Ok(())
    }
    fn hold_queue(&self) -> Result<Option<QueueHold>> {
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        let progress = self.progress.clone();
        progress.holds.fetch_add(1, Ordering::AcqRel);
        // The worker blocks here until every sender is gone.
        let job = Job::Control(Box::new(move || {
            while rx.recv().is_ok() {}
            progress.holds.fetch_sub(1, Ordering::AcqRel);
        }));
        if let Err(err) = self.submit(job) {
            self.progress.holds.fetch_sub(1, Ordering::AcqRel);
            return Err(err);
        }
        Ok(Some(QueueHold { _release: tx }))
    }
    fn host_memory(&self) -> bool {
        true
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn stream_ordered_release(&self) -> bool {
        true
    }
    fn synchronize(&self) -> Result<()> {
        if crate::runtime::fork::in_child() {
            return Err(self.gone_after_fork());
        }
        let seq = self.progress.submitted.load(Ordering::Acquire);
        self.progress.wait_for(seq);
        match self.progress.take_failure() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}

// ---- how simulated GPUs come to exist ---------------------------------------

/// The most simulated GPUs a process can have (`KILN_SIM_GPUS`,
/// `--sim-gpus`, [`crate::ensure_simulated_gpus`]): each has a worker thread, and a
/// multi-GPU program on more than this many simulated devices tests nothing
/// that 64 do not.
pub const MAX_SIM_GPUS: usize = 64;

/// Default capacity of a simulated GPU.
pub const DEFAULT_SIM_GPU_MEMORY: usize = 2 << 30;

/// The simulated GPUs `KILN_SIM_GPUS` asks for (with
/// `KILN_SIM_GPU_MEMORY` each), numbered from `gpu(first)`: this backend's
/// line of the registry's probe list. Never absent: without the variable it
/// simply finds none (and gives no reason, so the real GPUs' reason stands).
pub(crate) fn probe(first: usize) -> Found {
    let count = env_setting("KILN_SIM_GPUS", &format!("a number of simulated GPUs from 0 to {MAX_SIM_GPUS}, e.g. 2"), |v| {
        v.parse::<usize>().ok().filter(|&n| n <= MAX_SIM_GPUS)
    })
    .unwrap_or(0);
    let capacity = env_setting("KILN_SIM_GPU_MEMORY", "a size such as 2GiB, 512MiB or 1000000", |v| parse_bytes(v).ok())
        .unwrap_or(DEFAULT_SIM_GPU_MEMORY);
    let backends =
        (0..count).map(|s| Box::leak(Box::new(SimBackend::new(Device::Gpu(first + s), s, capacity))) as &'static dyn Backend).collect();
    Found { backends, absent: None }
}

/// Adds simulated GPUs with `capacity` bytes each to `gpus` (the registry's
/// list, under its lock) until `n` exist, and returns the first `n`: how
/// [`crate::ensure_simulated_gpus`] adds devices on demand. The registry
/// calls this; the backend does not register itself.
pub(crate) fn add_simulated(gpus: &mut Vec<&'static dyn Backend>, n: usize, capacity: usize) -> Vec<Device> {
    let mut sims: Vec<Device> = gpus.iter().filter(|b| b.as_any().is::<SimBackend>()).map(|b| b.device()).collect();
    while sims.len() < n {
        let device = Device::Gpu(gpus.len());
        gpus.push(Box::leak(Box::new(SimBackend::new(device, sims.len(), capacity))));
        sims.push(device);
    }
    sims.truncate(n);
    sims
}
