//! Per-device memory accounting, with a hard capacity where the device has
//! one, and a cache of large host buffers so that repeated big operations
//! reuse warm pages instead of faulting in fresh ones.

use crate::base::buffer::CpuBuffer;
use crate::runtime::thread_slot;
use crate::{human_bytes, DType, Device, Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A snapshot of one device's memory as kiln sees it.
///
/// ```
/// let stats = kiln::memory_stats(&kiln::cpu())?;
/// assert!(stats.capacity.is_none());
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryStats {
    /// The device.
    pub device: Device,
    /// Bytes held by live tensors.
    pub in_use: usize,
    /// Highest `in_use` since the last [`reset_peak_memory`](crate::reset_peak_memory).
    /// On the CPU, where each thread books in a slot of its own, this is
    /// exact while one thread allocates; with several allocating at once it
    /// is the highest total an allocating thread saw.
    pub peak: usize,
    /// Live storages (a view shares its storage and is not counted again).
    pub live_tensors: usize,
    /// Bytes kept in kiln's cache for reuse, not held by any tensor.
    pub cached: usize,
    /// The device's capacity, where it has one.
    pub capacity: Option<usize>,
}

impl std::fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} in use in {} tensors, peak {}, cached {}",
            self.device,
            human_bytes(self.in_use),
            self.live_tensors,
            human_bytes(self.peak),
            human_bytes(self.cached)
        )?;
        if let Some(c) = self.capacity {
            write!(f, ", capacity {} ({:.1}% used)", human_bytes(c), 100.0 * self.in_use as f64 / c.max(1) as f64)?;
        }
        Ok(())
    }
}

/// Buffers at least this big go back to the CPU's cache when dropped.
const CACHE_MIN_BYTES: usize = 1 << 20;

/// The same for a device booked in one counter (a simulated GPU): its
/// buffers are allocated on the caller's thread but released on the queue's
/// thread, so the per-thread cache of medium buffers never gives them back;
/// from this size on they go to the device's own cache instead.
const SHARED_CACHE_MIN_BYTES: usize = 16 << 10;

/// Buffers a pool's cache keeps at most, whatever their bytes (a lookup
/// walks them).
const MAX_CACHED_BUFFERS: usize = 512;

/// The accounting of one device.
///
/// A device with a capacity (simulated GPUs, CUDA) books every allocation
/// in one atomic counter, checked against the capacity. The CPU has no
/// capacity, and its allocations are the hot path of small operations on
/// many threads: it books them in per-thread slots instead ([`CpuSlots`]),
/// which only their own thread writes, with plain loads and stores, so
/// that no allocation takes an atomic read-modify-write or contends for a
/// cache line. Totals are the sum of the slots.
pub(crate) struct MemoryPool {
    device: Device,
    capacity: Option<usize>,
    /// True for the CPU: booked in [`CpuSlots`], `in_use`/`live` hold only
    /// what threads without a slot booked.
    per_thread: bool,
    in_use: AtomicUsize,
    peak: AtomicUsize,
    live: AtomicUsize,
    cache_limit: usize,
    cache: Mutex<Vec<CpuBuffer>>,
    cached: AtomicUsize,
}

/// Host buffers the CPU keeps for reuse at most (see `MemoryPool::recycle`).
const CPU_CACHE_LIMIT: usize = 2 << 30;

/// The CPU's pool: a `static`, so that the front end and storages book and
/// release host memory without going through a backend.
pub(crate) static CPU_POOL: MemoryPool = MemoryPool::new(Device::Cpu, None, CPU_CACHE_LIMIT);

impl MemoryPool {
    pub(crate) const fn new(device: Device, capacity: Option<usize>, cache_limit: usize) -> Self {
        MemoryPool {
            device,
            capacity,
            per_thread: matches!(device, Device::Cpu) && capacity.is_none(),
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            cache_limit,
            cache: Mutex::new(Vec::new()),
            cached: AtomicUsize::new(0),
        }
    }

    pub(crate) fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// The smallest buffer this pool's cache keeps (smaller ones use the
    /// per-thread caches).
    #[inline]
    fn cache_min(&self) -> usize {
        if self.per_thread {
            CACHE_MIN_BYTES
        } else {
            SHARED_CACHE_MIN_BYTES
        }
    }

    /// Books `bytes`, or fails with OutOfMemory leaving nothing booked.
    #[inline]
    pub(crate) fn reserve(&self, bytes: usize) -> Result<()> {
        if self.per_thread {
            return self.reserve_per_thread(bytes);
        }
        let mut current = self.in_use.load(Ordering::Relaxed);
        loop {
            // No allocation can exceed isize::MAX bytes, and a sum that does
            // not fit is refused before anything is booked: a saturated
            // booking would leave the count wrong once the failure unbooks.
            let next = match current.checked_add(bytes) {
                Some(next) if bytes <= isize::MAX as usize => next,
                _ => return Err(self.out_of_memory(bytes, current)),
            };
            if let Some(cap) = self.capacity {
                // Cached buffers occupy the device too: give them back first.
                if next.saturating_add(self.cached.load(Ordering::Relaxed)) > cap {
                    self.empty_cache();
                }
                if next > cap {
                    return Err(Error::OutOfMemory { device: self.device, requested: bytes, in_use: current, capacity: cap, limit: None });
                }
            }
            match self.in_use.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => current = now,
            }
        }
        self.live.fetch_add(1, Ordering::Relaxed);
        // A plain load first: in steady state the peak is not moving, and
        // an atomic max on every allocation costs as much as the rest.
        if current + bytes > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(current + bytes, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The error [`reserve`](Self::reserve) would give for `bytes` now, if
    /// any, booking nothing: lets an upload refuse before it copies the
    /// host's elements (which may be most of the host's memory).
    pub(crate) fn check_fits(&self, bytes: usize) -> Result<()> {
        let current = self.in_use_now();
        match (current.checked_add(bytes), self.capacity) {
            (None, _) => Err(self.out_of_memory(bytes, current)),
            (Some(_), _) if bytes > isize::MAX as usize => Err(self.out_of_memory(bytes, current)),
            (Some(next), Some(cap)) if next > cap => Err(self.out_of_memory(bytes, current)),
            _ => Ok(()),
        }
    }

    /// [`reserve`](Self::reserve) on the CPU: in this thread's slot.
    #[inline]
    fn reserve_per_thread(&self, bytes: usize) -> Result<()> {
        // No host holds a single buffer this large; refusing it here keeps
        // the sum of all slots (at most `thread_slot::SLOTS` such requests in flight) from
        // wrapping around.
        if bytes > CPU_MAX_REQUEST {
            return Err(self.out_of_memory(bytes, self.in_use_now()));
        }
        match CpuSlots::mine() {
            Some(slot) => {
                let now = slot.add(bytes, 1);
                // The total can only reach a new peak when this slot does,
                // as long as the other threads do not allocate meanwhile:
                // skip the sum over all slots otherwise.
                let epoch = PEAK_EPOCH.load(Ordering::Relaxed);
                if now <= slot.high.load(Ordering::Relaxed) && slot.epoch.load(Ordering::Relaxed) == epoch {
                    return Ok(());
                }
                slot.high.store(now, Ordering::Relaxed);
                slot.epoch.store(epoch, Ordering::Relaxed);
            }
            None => {
                self.in_use.fetch_add(bytes, Ordering::Relaxed);
                self.live.fetch_add(1, Ordering::Relaxed);
            }
        }
        // A plain load first: in steady state the peak is not moving, and
        // an atomic max on every allocation costs as much as the rest.
        let total = self.in_use_now();
        if total > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(total, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Bytes in use now: the counter, plus every slot on the CPU.
    #[inline]
    fn in_use_now(&self) -> usize {
        let own = self.in_use.load(Ordering::Relaxed);
        if self.per_thread {
            own.wrapping_add(CpuSlots::sum(|s| s.in_use.load(Ordering::Relaxed)))
        } else {
            own
        }
    }

    fn out_of_memory(&self, requested: usize, in_use: usize) -> Error {
        match self.capacity {
            Some(capacity) => Error::OutOfMemory { device: self.device, requested, in_use, capacity, limit: None },
            None => crate::runtime::host::host_out_of_memory(self.device, requested, in_use),
        }
    }

    /// Unbooks what one successful [`reserve`](Self::reserve) booked.
    #[inline]
    pub(crate) fn unreserve(&self, bytes: usize) {
        if self.per_thread {
            // Possibly another thread's booking: this slot may go below
            // zero (wrapping); the sum of all slots stays exact.
            match CpuSlots::mine() {
                Some(slot) => {
                    slot.add(bytes.wrapping_neg(), usize::MAX);
                }
                None => {
                    self.in_use.fetch_sub(bytes, Ordering::Relaxed);
                    self.live.fetch_sub(1, Ordering::Relaxed);
                }
            }
            return;
        }
        let before = self.in_use.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(before >= bytes, "{}: unbooking {bytes} B with {before} B booked", self.device);
        self.live.fetch_sub(1, Ordering::Relaxed);
    }

    /// A host buffer of `len` elements: from the cache when one fits, else
    /// fresh and zeroed. The caller writes every element before reading.
    pub(crate) fn host_buffer(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
        let bytes = len.saturating_mul(dtype.size_in_bytes());
        if bytes >= self.cache_min() && self.cache_limit > 0 {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(pos) = cache.iter().rposition(|b| b.dtype() == dtype && b.len() == len) {
                let buf = cache.swap_remove(pos);
                self.cached.fetch_sub(bytes, Ordering::Relaxed);
                return Ok(buf);
            }
        }
        CpuBuffer::try_zeros(dtype, len).ok_or_else(|| {
            // The host refused: give back what is cached and say so.
            self.empty_cache();
            let stats = self.stats();
            // The caller has booked `bytes` already; report the use before it.
            // The host refused (not a capacity of kiln's): say which limit.
            crate::runtime::host::host_out_of_memory(self.device, bytes, stats.in_use.saturating_sub(bytes))
        })
    }

    /// Books and allocates a host buffer for `len` elements, booking nothing
    /// when the allocation fails. The CPU and the simulated GPUs allocate
    /// through this.
    #[inline]
    pub(crate) fn alloc_host(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
        let bytes = len.saturating_mul(dtype.size_in_bytes());
        self.reserve(bytes)?;
        if len <= SMALL_LEN {
            // Small buffers never fail to allocate (a failure aborts, as any
            // small allocation in Rust does) and come from this thread's cache.
            return Ok(small_take(dtype, len).unwrap_or_else(|| CpuBuffer::zeros(dtype, len)));
        }
        if bytes < self.cache_min()
            && let Some(buf) = medium_take(dtype, len)
        {
            return Ok(buf);
        }
        self.host_buffer(dtype, len).inspect_err(|_| self.unreserve(bytes))
    }

    /// Unbooks a dropped host buffer and keeps it for reuse when it is worth it.
    #[inline]
    pub(crate) fn release_host(&self, buf: CpuBuffer, bytes: usize) {
        self.unreserve(bytes);
        self.recycle(buf);
    }

    /// Takes back a host buffer whose storage was dropped.
    #[inline]
    pub(crate) fn recycle(&self, buf: CpuBuffer) {
        if buf.len() <= SMALL_LEN {
            small_put(buf);
        } else if buf.size_in_bytes() < self.cache_min() {
            medium_put(buf);
        } else {
            self.recycle_large(buf);
        }
    }

    fn recycle_large(&self, buf: CpuBuffer) {
        let bytes = buf.size_in_bytes();
        if bytes < self.cache_min() || bytes > self.cache_limit {
            return;
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = self.cached.load(Ordering::Relaxed) + bytes;
        while (total > self.cache_limit || cache.len() >= MAX_CACHED_BUFFERS) && !cache.is_empty() {
            let old = cache.remove(0);
            total -= old.size_in_bytes();
        }
        cache.push(buf);
        self.cached.store(total, Ordering::Relaxed);
    }

    /// Frees every cached buffer.
    pub(crate) fn empty_cache(&self) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.clear();
        self.cached.store(0, Ordering::Relaxed);
    }

    /// Sets the bytes a backend keeps for reuse outside this pool's host cache
    /// (the CUDA block cache), so that `stats().cached` reports them.
    pub(crate) fn set_cached(&self, bytes: usize) {
        self.cached.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn reset_peak(&self) {
        if self.per_thread {
            // Every slot measures its high-water mark afresh.
            PEAK_EPOCH.fetch_add(1, Ordering::Relaxed);
        }
        self.peak.store(self.in_use_now(), Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        let in_use = self.in_use_now();
        let mut live = self.live.load(Ordering::Relaxed);
        if self.per_thread {
            live = live.wrapping_add(CpuSlots::sum(|s| s.live.load(Ordering::Relaxed)));
        }
        MemoryStats {
            device: self.device,
            in_use,
            // Per-thread booking records the peak of the slots' sum as seen
            // by each allocating thread; never report less than in use now.
            peak: self.peak.load(Ordering::Relaxed).max(in_use),
            live_tensors: live,
            cached: self.cached.load(Ordering::Relaxed),
            capacity: self.capacity,
        }
    }
}

// ---- the CPU's per-thread booking ------------------------------------------
//
// Each thread that allocates on the CPU claims a slot (a cache line of its
// own) and books there with plain loads and stores; only that thread writes
// it. A thread freeing another thread's tensor unbooks in its own slot,
// which may go below zero (wrapping arithmetic); the sum over all slots is
// exact once the threads have stopped, and exact at every step while one
// thread allocates. When a thread exits its slot is released with its
// counts in it, and the next thread to claim it goes on from there: totals
// need no folding. Beyond `thread_slot::SLOTS` live threads, the pool's own atomic
// counters take the rest. With several threads allocating at once, `peak`
// is the highest sum an allocating thread saw, which may include a buffer
// that another thread was freeing at that instant.

/// A request above this is out of memory at once on the CPU (4 PiB).
const CPU_MAX_REQUEST: usize = 1 << 52;

#[repr(align(128))]
struct Slot {
    in_use: AtomicUsize,
    live: AtomicUsize,
    /// The highest `in_use` of this slot since the peak epoch `epoch`.
    high: AtomicUsize,
    epoch: std::sync::atomic::AtomicU64,
}

/// Bumped by `reset_peak_memory(&cpu())`: every slot's `high` is stale.
static PEAK_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Slot {
    const fn new() -> Self {
        Slot {
            in_use: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            high: AtomicUsize::new(0),
            epoch: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }
    /// Adds (wrapping) to this thread's own slot, no other thread writes
    /// it; returns the new `in_use`.
    #[inline]
    fn add(&self, bytes: usize, live: usize) -> usize {
        let now = self.in_use.load(Ordering::Relaxed).wrapping_add(bytes);
        self.in_use.store(now, Ordering::Relaxed);
        self.live.store(self.live.load(Ordering::Relaxed).wrapping_add(live), Ordering::Relaxed);
        now
    }
}

struct CpuSlots;

/// Indexed by the thread's `thread_slot` index.
static CPU_SLOTS: [Slot; thread_slot::SLOTS] = [const { Slot::new() }; thread_slot::SLOTS];

impl CpuSlots {
    /// This thread's slot; `None` while the thread is exiting or when every
    /// slot is taken.
    #[inline]
    fn mine() -> Option<&'static Slot> {
        // The first booking of the process (its first host allocation,
        // before any worker thread exists) installs the fork handlers, as
        // the first storage lock does (fork.rs): a child forked after that
        // knows it is one.
        crate::runtime::fork::install_handlers();
        thread_slot::mine().map(|i| &CPU_SLOTS[i])
    }
    /// The wrapping sum of `field` over every slot ever claimed.
    #[inline]
    fn sum(field: impl Fn(&Slot) -> usize) -> usize {
        CPU_SLOTS[..thread_slot::used()].iter().fold(0usize, |acc, s| acc.wrapping_add(field(s)))
    }
}

// ---- small host buffers, recycled per thread ------------------------------
//
// A small operation's output buffer costs a malloc and a free, as much as
// the rest of the operation. Buffers of at most `SMALL_LEN` elements are
// therefore kept on the thread that dropped them, by dtype and length, and
// handed to the next allocation of that dtype and length on that thread.
// Accounting is unaffected (bytes are booked and unbooked by the pool as
// before); a kept buffer is not in use and too small to report as cached.
// Their contents are stale, which the allocation contract allows: every
// kernel writes all of its output.

/// Buffers of at most this many elements are recycled per thread.
const SMALL_LEN: usize = 64;
/// Buffers kept per (dtype, length) and thread.
const SMALL_KEEP: usize = 8;
/// Dtypes, for the slot index.
const DTYPES: usize = 7;

thread_local! {
    static SMALL: std::cell::RefCell<Vec<Vec<CpuBuffer>>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[inline]
fn small_slot(dtype: DType, len: usize) -> usize {
    let d = match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::I64 => 2,
        DType::I32 => 3,
        DType::U8 => 4,
        DType::F16 => 5,
        DType::BF16 => 6,
    };
    d * (SMALL_LEN + 1) + len
}

/// A kept buffer of `dtype` and `len` elements (`len <= SMALL_LEN`), if any.
#[inline]
fn small_take(dtype: DType, len: usize) -> Option<CpuBuffer> {
    // `try_with`/`try_borrow_mut`: during thread exit, or if re-entered, the
    // allocator is used instead.
    SMALL.try_with(|s| s.try_borrow_mut().ok()?.get_mut(small_slot(dtype, len))?.pop()).ok().flatten()
}

/// Keeps a small buffer for reuse on this thread, or frees it when its slot is full.
#[inline]
fn small_put(buf: CpuBuffer) {
    let slot = small_slot(buf.dtype(), buf.len());
    let _ = SMALL.try_with(|s| {
        let Ok(mut slots) = s.try_borrow_mut() else { return };
        if slots.is_empty() {
            slots.resize_with(DTYPES * (SMALL_LEN + 1), Vec::new);
        }
        let kept = &mut slots[slot];
        if kept.len() < SMALL_KEEP {
            kept.push(buf);
        }
    });
}

// Medium buffers (above `SMALL_LEN` elements, below `CACHE_MIN_BYTES`) are
// kept per thread too, a few at a time: a loop of 100×100 matmuls would
// otherwise get each 40 KB output from `calloc`, which zeroes it (a fifth of
// W2's instructions). Their contents are stale, as the small ones'.

/// Medium buffers kept per thread, the most recently dropped first.
const MEDIUM_KEEP: usize = 4;

thread_local! {
    static MEDIUM: std::cell::RefCell<Vec<CpuBuffer>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A kept medium buffer of exactly `dtype` and `len`, if any.
#[inline]
fn medium_take(dtype: DType, len: usize) -> Option<CpuBuffer> {
    MEDIUM
        .try_with(|m| {
            let mut kept = m.try_borrow_mut().ok()?;
            let pos = kept.iter().rposition(|b| b.len() == len && b.dtype() == dtype)?;
            Some(kept.remove(pos))
        })
        .ok()
        .flatten()
}

/// Keeps a medium buffer on this thread, dropping the oldest kept one when
/// there are `MEDIUM_KEEP` already.
#[inline]
fn medium_put(buf: CpuBuffer) {
    let _ = MEDIUM.try_with(|m| {
        let Ok(mut kept) = m.try_borrow_mut() else { return };
        if kept.len() >= MEDIUM_KEEP {
            kept.remove(0);
        }
        kept.push(buf);
    });
}
/// Host memory refused for a kernel's temporary of `bytes`.
pub(crate) fn host_oom(bytes: usize) -> Error {
    let in_use = CPU_POOL.stats().in_use;
    crate::runtime::host::host_out_of_memory(crate::Device::Cpu, bytes, in_use)
}

/// `len` elements in a new vector, or `OutOfMemory` when the host refuses
/// (a `Vec` that grows infallibly would abort the process instead).
pub(crate) fn try_vec<T>(len: usize) -> Result<Vec<T>> {
    crate::base::buffer::try_with_capacity(len).ok_or_else(|| host_oom(len.saturating_mul(std::mem::size_of::<T>())))
}
