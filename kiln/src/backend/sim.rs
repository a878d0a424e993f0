//! Simulated GPUs: discrete devices made of host RAM. Each has its own memory
//! pool with a hard capacity and an in-order queue served by its own worker
//! thread, which runs the host kernels single-threaded (one "GPU" = one
//! core). Operations validate and allocate on the caller's thread, enqueue
//! and return at once; reads wait for the work that produces them.

use super::{host_kernels, Backend, Event};
use crate::memory::MemoryPool;
use crate::op::{Kernel, Src};
use crate::storage::{Buffer, CpuBuffer};
use crate::{human_bytes, DType, Device, DeviceKind, Error, Result};
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

type Job = Box<dyn FnOnce() + Send>;

/// How far a queue has got: jobs submitted and jobs completed.
struct Progress {
    submitted: AtomicU64,
    completed: Mutex<u64>,
    done: Condvar,
}

impl Progress {
    fn wait_for(&self, seq: u64) {
        let mut completed = self.completed.lock().unwrap_or_else(|e| e.into_inner());
        while *completed < seq {
            completed = self.done.wait(completed).unwrap_or_else(|e| e.into_inner());
        }
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

pub(crate) struct SimBackend {
    latency: std::time::Duration,
    device: Device,
    index: usize,
    pool: MemoryPool,
    sender: Mutex<Sender<Job>>,
    progress: Arc<Progress>,
}

impl SimBackend {
    pub(crate) fn new(device: Device, index: usize, capacity: usize) -> Self {
        let (sender, receiver) = crossbeam_channel::unbounded::<Job>();
        let progress = Arc::new(Progress { submitted: AtomicU64::new(0), completed: Mutex::new(0), done: Condvar::new() });
        let worker_progress = progress.clone();
        std::thread::Builder::new()
            .name(format!("kiln-sim-gpu{index}"))
            .spawn(move || worker(receiver, worker_progress))
            .map(|_| ())
            .unwrap_or_else(|e| eprintln!("kiln: cannot start the worker of simulated {device}: {e}"));
        SimBackend {
            latency: transfer_latency(),
            device,
            index,
            pool: MemoryPool::new(device, Some(capacity), 0),
            sender: Mutex::new(sender),
            progress,
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

    fn submit(&self, job: Job) -> Result<u64> {
        // Numbering and sending under one lock keeps sequence numbers in
        // queue order when several threads submit at once.
        let sender = self.sender.lock().unwrap_or_else(|e| e.into_inner());
        let seq = self.progress.submitted.fetch_add(1, Ordering::AcqRel) + 1;
        sender
            .send(job)
            .map_err(|_| Error::Backend { device: self.device, msg: "the simulated GPU's worker thread has stopped".into() })?;
        Ok(seq)
    }
}

/// Default latency of a host<->device copy on a simulated GPU, about a PCIe
/// round trip.
pub(crate) const DEFAULT_TRANSFER_LATENCY_US: u64 = 10;

/// `KILN_SIM_TRANSFER_LATENCY` in microseconds (`0` turns it off).
fn transfer_latency() -> std::time::Duration {
    let us = std::env::var("KILN_SIM_TRANSFER_LATENCY")
        .ok()
        .and_then(|v| {
            v.trim()
                .trim_end_matches("us")
                .parse::<u64>()
                .map_err(|_| eprintln!("kiln: ignoring KILN_SIM_TRANSFER_LATENCY={v}: write microseconds, e.g. 10"))
                .ok()
        })
        .unwrap_or(DEFAULT_TRANSFER_LATENCY_US);
    std::time::Duration::from_micros(us)
}

fn worker(receiver: Receiver<Job>, progress: Arc<Progress>) {
    while let Ok(job) = receiver.recv() {
        // A panicking kernel would be a kiln bug; keep the queue alive and
        // the waiters woken whatever happens.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        let mut completed = progress.completed.lock().unwrap_or_else(|e| e.into_inner());
        *completed += 1;
        progress.done.notify_all();
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
        vec![("transfer latency".into(), format!("{} us", self.latency.as_micros()))]
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
        Ok(Buffer::Host(self.pool.alloc_host(dtype, len)?))
    }
    fn release(&self, buffer: Buffer, bytes: usize) {
        match buffer {
            Buffer::Host(b) => self.pool.release_host(b, bytes),
            Buffer::Device(_) => self.pool.unreserve(bytes),
        }
    }
    fn launch(&self, kernel: Kernel) -> Result<()> {
        self.submit(Box::new(move || host_kernels::run(&kernel, 1)))?;
        Ok(())
    }
    fn upload(&self, data: CpuBuffer) -> Result<Buffer> {
        self.pool.reserve(data.size_in_bytes())?;
        self.bus_latency();
        Ok(Buffer::Host(data))
    }
    fn download(&self, src: &Src) -> Result<CpuBuffer> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let src = src.clone();
        self.submit(Box::new(move || {
            let _ = tx.send(host_kernels::gather(&src));
        }))?;
        let data =
            rx.recv().map_err(|_| Error::Backend { device: self.device, msg: "a read from the simulated GPU did not complete".into() })?;
        self.bus_latency();
        Ok(data)
    }
    fn record_event(&self) -> Option<Arc<dyn Event>> {
        let seq = self.progress.submitted.load(Ordering::Acquire);
        Some(Arc::new(SimEvent { progress: self.progress.clone(), seq }))
    }
    fn wait_event(&self, event: Arc<dyn Event>) -> Result<()> {
        self.submit(Box::new(move || event.wait()))?;
        Ok(())
    }
    fn hold_queue(&self) -> Result<Option<super::QueueHold>> {
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        // The worker blocks here until every sender is gone.
        self.submit(Box::new(move || while rx.recv().is_ok() {}))?;
        Ok(Some(super::QueueHold { _release: tx }))
    }
    fn host_memory(&self) -> bool {
        true
    }
    fn synchronize(&self) -> Result<()> {
        let seq = self.progress.submitted.load(Ordering::Acquire);
        self.progress.wait_for(seq);
        Ok(())
    }
}
