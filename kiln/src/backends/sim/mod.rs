//! Simulated GPUs: discrete devices made of host RAM. Each has its own memory
//! pool with a hard capacity and an in-order queue served by its own worker
//! thread, which runs the host kernels single-threaded (one "GPU" = one
//! core). Operations validate and allocate on the caller's thread, enqueue
//! and return at once; reads wait for the work that produces them.

mod queue;
pub(crate) mod ring;

use super::Found;
use crate::base::buffer::CpuBuffer;
use crate::base::device::{Device, DeviceKind};
use crate::base::dtype::DType;
use crate::base::env::{env_setting, parse_bytes};
use crate::base::error::{human_bytes, Error, Result};
use crate::kernel::storage::{Buffer, Storage};
use crate::kernel::{Backend, Event, QueueHold};
use crate::kernel::{Kernel, Src};
use crate::runtime::memory::MemoryPool;
pub(crate) use queue::now_ns;
use queue::{gone_after_fork, Job, Queue};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Kernels a simulated GPU's queue holds at most before the host blocks in
/// `launch`, like a real GPU's launch queue (`KILN_SIM_QUEUE_DEPTH`).
pub(crate) const DEFAULT_QUEUE_DEPTH: usize = 1024;

pub(crate) struct SimBackend {
    latency: std::time::Duration,
    device: Device,
    index: usize,
    pool: MemoryPool,
    /// The queue every kernel, copy and read goes through.
    queue: Queue,
    /// The queue of collectives (`ring.rs`), started by the first one.
    comm: std::sync::OnceLock<Queue>,
    depth: usize,
    /// Made by [`crate::add_simulated_gpus`] for one caller: the shared
    /// pool of [`crate::ensure_simulated_gpus`] never hands it out.
    reserved: bool,
}

impl SimBackend {
    pub(crate) fn new(device: Device, index: usize, capacity: usize) -> Self {
        let depth = queue_depth();
        SimBackend {
            reserved: false,
            latency: transfer_latency(),
            device,
            index,
            // Freed buffers are kept for reuse (a quarter of the capacity, at
            // most 512 MiB), as a GPU's caching allocator keeps its blocks:
            // without it every activation of every step was fresh memory,
            // zeroed by the host thread and faulted in by the queue's.
            pool: MemoryPool::new(device, Some(capacity), (capacity / 4).min(512 << 20)),
            queue: Queue::start(device, format!("kiln-sim-gpu{index}"), depth),
            comm: std::sync::OnceLock::new(),
            depth,
        }
    }

    /// The queue of collectives, started on first use.
    fn comm_queue(&self) -> &Queue {
        self.comm.get_or_init(|| Queue::start(self.device, format!("kiln-sim-gpu{}-comm", self.index), self.depth))
    }

    /// The compute queue.
    fn compute_queue(&self) -> &Queue {
        &self.queue
    }

    /// Queues a mark of the device clock on each of the device's queues
    /// (the collective queue only once started), first moving the clock up
    /// to `at` when given; the slots hold the clocks once the marks ran.
    pub(crate) fn mark_clocks(&self, at: Option<u64>) -> Result<Vec<Arc<std::sync::atomic::AtomicU64>>> {
        let mut slots = Vec::with_capacity(2);
        for q in std::iter::once(&self.queue).chain(self.comm.get()) {
            let slot = Arc::new(std::sync::atomic::AtomicU64::new(0));
            q.submit(Job::Mark(at, slot.clone()))?;
            slots.push(slot);
        }
        Ok(slots)
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

    fn submit(&self, job: Job) -> Result<u64> {
        self.queue.submit(job)
    }

    /// Waits for all submitted work unless the queue is held (then waiting
    /// could never end).
    fn drain(&self) -> bool {
        if self.queue.progress.holds.load(Ordering::Acquire) > 0 {
            return false;
        }
        self.queue.wait_all();
        if let Some(comm) = self.comm.get() {
            comm.wait_all();
        }
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
        // reports it. Launching meanwhile succeeds: the worker skips the
        // kernel and poisons its output with that failure (`queue.rs`), so
        // the failure is reported once, by that call, and afterwards only
        // by the outputs that carry it.
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
        Some(self.queue.record_event())
    }
    fn wait_event(&self, event: Arc<dyn Event>) -> Result<()> {
        self.queue.wait_event(event)
    }
    fn hold_queue(&self) -> Result<Option<QueueHold>> {
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        let progress = self.queue.progress.clone();
        progress.holds.fetch_add(1, Ordering::AcqRel);
        // The worker blocks here until every sender is gone.
        let job = Job::Control(Box::new(move || {
            while rx.recv().is_ok() {}
            progress.holds.fetch_sub(1, Ordering::AcqRel);
        }));
        if let Err(err) = self.submit(job) {
            self.queue.progress.holds.fetch_sub(1, Ordering::AcqRel);
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
    fn communicator(&self) -> Option<&'static dyn crate::kernel::comm::Communicator> {
        Some(&ring::RING)
    }
    fn queue_times(&self) -> Option<crate::kernel::QueueTimes> {
        let t = &self.queue.progress.timers;
        let comm = self
            .comm
            .get()
            .map_or(0, |c| c.progress.timers.kernels_ns.load(Ordering::Relaxed) + c.progress.timers.waits_ns.load(Ordering::Relaxed));
        Some(crate::kernel::QueueTimes {
            compute_ns: t.kernels_ns.load(Ordering::Relaxed),
            wait_ns: t.waits_ns.load(Ordering::Relaxed),
            comm_ns: comm,
        })
    }
    fn synchronize(&self) -> Result<()> {
        if crate::runtime::fork::in_child() {
            return Err(gone_after_fork(self.device));
        }
        // The collectives' queue first: its last jobs may make the compute
        // queue wait (a join), never the other way round after this point.
        let comm_failure = self.comm.get().and_then(|comm| {
            comm.wait_all();
            comm.progress.take_failure()
        });
        self.queue.wait_all();
        match (self.queue.progress.take_failure(), comm_failure) {
            (Some(err), _) | (None, Some(err)) => Err(err),
            (None, None) => Ok(()),
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
    let mut sims: Vec<Device> =
        gpus.iter().filter(|b| b.as_any().downcast_ref::<SimBackend>().is_some_and(|s| !s.reserved)).map(|b| b.device()).collect();
    while sims.len() < n {
        let device = Device::Gpu(gpus.len());
        let index = simulated_count(gpus);
        gpus.push(Box::leak(Box::new(SimBackend::new(device, index, capacity))));
        sims.push(device);
    }
    sims.truncate(n);
    sims
}

/// Adds `n` simulated GPUs with `capacity` bytes each to `gpus`, reserved
/// for the caller ([`crate::add_simulated_gpus`]), and returns them.
pub(crate) fn add_reserved(gpus: &mut Vec<&'static dyn Backend>, n: usize, capacity: usize) -> Vec<Device> {
    (0..n)
        .map(|_| {
            let device = Device::Gpu(gpus.len());
            let index = simulated_count(gpus);
            gpus.push(Box::leak(Box::new(SimBackend { reserved: true, ..SimBackend::new(device, index, capacity) })));
            device
        })
        .collect()
}

/// How many simulated GPUs `gpus` holds, shared or reserved.
pub(crate) fn simulated_count(gpus: &[&'static dyn Backend]) -> usize {
    gpus.iter().filter(|b| b.as_any().is::<SimBackend>()).count()
}
