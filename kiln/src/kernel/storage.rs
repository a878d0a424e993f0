//! Storage: one allocation on one device, shared by every view of it.
//!
//! A storage is created by its device's backend, which accounts its bytes in
//! the device's [`MemoryPool`](crate::runtime::memory::MemoryPool) and gets them back
//! when the last view drops. The buffer sits behind a lock because on an
//! asynchronous device the kernel that fills it runs later, on the device's
//! queue, while the host already holds the tensor.

use crate::base::buffer::CpuBuffer;
use crate::kernel::Backend;
use crate::kernel::Out;
use crate::runtime::fork::Busy;
use crate::runtime::memory::CPU_POOL;
use crate::{DType, Device};
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use smallvec::SmallVec;
use std::sync::Arc;

/// Where a storage's bytes are.
pub(crate) enum Buffer {
    /// Host memory: the CPU, and the simulated GPUs' separate pools.
    Host(CpuBuffer),
    /// Memory owned by a real GPU backend.
    #[allow(dead_code)]
    Device(Box<dyn std::any::Any + Send + Sync>),
}

/// One allocation on one device.
pub(crate) struct Storage {
    pub(crate) dtype: DType,
    pub(crate) len: usize,
    /// The device, kept beside the backend: every operation compares devices.
    pub(crate) device: Device,
    /// Backends live as long as the process (the registry never drops one),
    /// so a storage points at its backend without a reference count.
    pub(crate) backend: &'static dyn Backend,
    buffer: RwLock<Option<Buffer>>,
    /// True while the bytes are booked in the device's pool.
    booked: std::sync::atomic::AtomicBool,
    /// On a simulated GPU: the tensors' handles to this storage, apart from
    /// the references its queued kernels hold (see [`StorageHandle`]).
    handles: std::sync::atomic::AtomicUsize,
    /// Whether `handles` is counted: storages of simulated GPUs.
    stream_ordered: bool,
    /// Set while the storage holds the result of a kernel that failed, or
    /// that an asynchronous device skipped or could not trust after a
    /// fault (a *poisoned* result): `fault` then holds the original error,
    /// which every read of the storage, and every kernel reading it,
    /// returns or passes on until a kernel that succeeds overwrites all of
    /// it. One relaxed-cost load per operand when clear; the CPU (which
    /// reports a failure at its call) never sets it.
    poisoned: std::sync::atomic::AtomicBool,
    fault: parking_lot::Mutex<Option<Box<crate::Error>>>,
}

impl Storage {
    pub(crate) fn new(backend: &'static dyn Backend, buffer: Buffer, dtype: DType, len: usize) -> Arc<Storage> {
        Storage::new_on(backend, backend.device(), buffer, dtype, len)
    }
    /// A storage holding `buffer` on `device` (the backend's own device, or
    /// the CPU for the static CPU backend).
    #[inline]
    pub(crate) fn new_on(backend: &'static dyn Backend, device: Device, buffer: Buffer, dtype: DType, len: usize) -> Arc<Storage> {
        let stream_ordered = device != Device::Cpu && backend.stream_ordered_release();
        let storage = Storage {
            dtype,
            len,
            device,
            backend,
            buffer: RwLock::new(Some(buffer)),
            booked: std::sync::atomic::AtomicBool::new(true),
            handles: std::sync::atomic::AtomicUsize::new(0),
            stream_ordered,
            poisoned: std::sync::atomic::AtomicBool::new(false),
            fault: parking_lot::Mutex::new(None),
        };
        if device == Device::Cpu {
            reuse_shell(storage)
        } else {
            Arc::new(storage)
        }
    }
    #[inline]
    pub(crate) fn device(&self) -> Device {
        self.device
    }
    pub(crate) fn bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }
    /// The fault this storage's contents stand for, when they are the
    /// result of a failed, skipped or untrusted kernel (see [`poison`](Self::poison)).
    #[inline]
    pub(crate) fn fault(&self) -> Option<crate::Error> {
        if !self.poisoned.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        self.fault.lock().as_deref().cloned()
    }
    /// Marks the contents as poisoned by `err` (the original failure):
    /// reads and kernels reading this storage return `err` from now on. A
    /// storage already poisoned keeps its first fault.
    pub(crate) fn poison(&self, err: &crate::Error) {
        let mut fault = self.fault.lock();
        if fault.is_none() {
            *fault = Some(Box::new(err.clone()));
        }
        self.poisoned.store(true, std::sync::atomic::Ordering::Release);
    }
    /// Clears the mark: a kernel that succeeded has overwritten all of the
    /// storage without reading it.
    #[inline]
    pub(crate) fn recomputed(&self) {
        if self.poisoned.load(std::sync::atomic::Ordering::Acquire) {
            let mut fault = self.fault.lock();
            self.poisoned.store(false, std::sync::atomic::Ordering::Release);
            *fault = None;
        }
    }
    /// Read access to the buffer, under its read lock. Only kernels and
    /// transfers call this, in queue order, so a writer never holds it for long.
    #[inline]
    pub(crate) fn read(&self) -> BufferRead<'_> {
        let busy = Busy::enter();
        BufferRead { guard: self.buffer.read(), _busy: busy }
    }
}

/// A storage's buffer under its read lock. The lock is let go before the
/// thread's busy mark (field order), which a fork waits for (`fork.rs`).
pub(crate) struct BufferRead<'a> {
    guard: RwLockReadGuard<'a, Option<Buffer>>,
    _busy: Busy,
}

/// The two inputs of a kernel whose output is fresh, under read locks taken
/// in address order (one lock when the two are the same storage), as
/// [`OperandLocks`] takes them, and under one busy mark for both.
#[inline]
pub(crate) fn read_two<'a>(a: &'a Storage, b: &'a Storage) -> ReadPair<'a> {
    let busy = Busy::enter();
    let (first, second) = if std::ptr::eq(a, b) {
        (a.buffer.read(), None)
    } else if addr(a) < addr(b) {
        let ga = a.buffer.read();
        (ga, Some(b.buffer.read()))
    } else {
        let gb = b.buffer.read();
        (a.buffer.read(), Some(gb))
    };
    ReadPair { a: first, b: second, _busy: busy }
}

/// What [`read_two`] holds: `a`'s guard, and `b`'s unless `b` is `a`.
pub(crate) struct ReadPair<'a> {
    a: RwLockReadGuard<'a, Option<Buffer>>,
    b: Option<RwLockReadGuard<'a, Option<Buffer>>>,
    /// Dropped last, after both locks (field order): see `fork.rs`.
    _busy: Busy,
}

impl ReadPair<'_> {
    /// The two inputs' host elements, in the order `read_two` was given them.
    #[inline]
    pub(crate) fn hosts(&self) -> (&CpuBuffer, &CpuBuffer) {
        let a = host_of(&self.a);
        (a, self.b.as_ref().map_or(a, |g| host_of(g)))
    }
}

#[inline]
fn host_of(buffer: &Option<Buffer>) -> &CpuBuffer {
    match buffer.as_ref() {
        Some(Buffer::Host(b)) => b,
        _ => unreachable!("host kernel given a storage of another backend"),
    }
}

impl BufferRead<'_> {
    #[inline]
    pub(crate) fn host(&self) -> &CpuBuffer {
        host_of(&self.guard)
    }
    #[allow(dead_code)]
    pub(crate) fn buffer(&self) -> &Buffer {
        self.guard.as_ref().expect("storage buffer present until drop")
    }
}

/// The locks of one kernel's operands: read locks on its inputs, and a write
/// lock on its output when the output is a storage others may see.
///
/// Why one type for this: a kernel that holds one storage's lock while it
/// waits for another's can deadlock against a kernel on another thread that
/// takes the same two the other way round (`a.assign(&b)` beside
/// `b.assign(&a)`). Every kernel therefore takes all its locks here, in one
/// global order (the storages' addresses), and holds no other lock while
/// waiting: a cycle of waits is then impossible. An input that appears twice
/// is locked once (a second read lock can queue behind a waiting writer).
/// The output must not also be an input; callers that write in place read
/// an input sharing the output's storage out first. A fresh output
/// ([`Out::Fresh`]) is nobody else's yet and takes no lock at all: the hot
/// path of a small operation on the CPU locks its inputs only.
pub(crate) struct OperandLocks<'a> {
    /// One read lock per distinct input storage.
    guards: SmallVec<[RwLockReadGuard<'a, Option<Buffer>>; 3]>,
    /// For each input, the index of its guard.
    of_input: SmallVec<[u8; 3]>,
    output: OutputAccess<'a>,
    /// Dropped last, after every lock (field order): see `fork.rs`.
    _busy: Busy,
}

enum OutputAccess<'a> {
    Fresh(&'a mut CpuBuffer),
    Locked(RwLockWriteGuard<'a, Option<Buffer>>),
}

#[inline]
fn addr(s: &Storage) -> usize {
    s as *const Storage as usize
}

impl<'a> OperandLocks<'a> {
    /// Reads `inputs` under read locks and, when it is a storage, writes
    /// `out` under its write lock; all locks in address order. An input that
    /// is also the output is refused (a kiln bug): locking it twice would
    /// deadlock the thread on itself.
    #[inline]
    pub(crate) fn new(inputs: &[&'a Storage], out: Out<'a>) -> crate::Result<Self> {
        if inputs.len() > u8::MAX as usize {
            return Err(lock_bug(&out, "a kernel locks more than 255 inputs"));
        }
        if let Out::Storage(o) = &out
            && inputs.iter().any(|s| std::ptr::eq(*s, *o))
        {
            return Err(lock_bug(&out, "a kernel's output storage is also one of its inputs"));
        }
        // The distinct storages, in address order, and each input's place
        // among them. One or two inputs (nearly every kernel) without the
        // general loop: this runs once per kernel, and a small op costs
        // little more than its launch.
        let (distinct, of_input): (SmallVec<[&'a Storage; 3]>, SmallVec<[u8; 3]>) = match *inputs {
            [a] => (SmallVec::from_buf_and_len([a, a, a], 1), SmallVec::from_buf_and_len([0, 0, 0], 1)),
            [a, b] if std::ptr::eq(a, b) => (SmallVec::from_buf_and_len([a, a, a], 1), SmallVec::from_buf_and_len([0, 0, 0], 2)),
            [a, b] if addr(a) < addr(b) => (SmallVec::from_buf_and_len([a, b, a], 2), SmallVec::from_buf_and_len([0, 1, 0], 2)),
            [a, b] => (SmallVec::from_buf_and_len([b, a, a], 2), SmallVec::from_buf_and_len([1, 0, 0], 2)),
            _ => {
                let mut distinct: SmallVec<[&'a Storage; 3]> = SmallVec::new();
                for s in inputs {
                    if !distinct.iter().any(|d| std::ptr::eq(*d, *s)) {
                        distinct.push(s);
                    }
                }
                distinct.sort_unstable_by_key(|s| addr(s));
                let of_input = inputs.iter().map(|s| distinct.iter().position(|d| std::ptr::eq(*d, *s)).unwrap_or(0) as u8).collect();
                (distinct, of_input)
            }
        };
        // Marked busy before the first lock, for a fork that may be waiting;
        // the guards below are taken under this one mark (not one each).
        let busy = Busy::enter();
        let out_addr = match &out {
            Out::Storage(o) => Some(addr(o)),
            Out::Fresh(_) => None,
        };
        let mut guards = SmallVec::new();
        let mut w = None;
        for s in &distinct {
            if w.is_none()
                && out_addr.is_some_and(|o| o < addr(s))
                && let Out::Storage(o) = &out
            {
                w = Some(o.buffer.write());
            }
            guards.push(s.buffer.read());
        }
        let output = match out {
            Out::Fresh(buffer) => OutputAccess::Fresh(buffer),
            Out::Storage(o) => OutputAccess::Locked(match w {
                Some(guard) => guard,
                None => o.buffer.write(),
            }),
        };
        Ok(OperandLocks { guards, of_input, output, _busy: busy })
    }

    /// The inputs (by their position in `new`) and the output, borrowed together.
    #[inline]
    pub(crate) fn split(&mut self) -> (LockedInputs<'_, 'a>, &mut CpuBuffer) {
        let out = match &mut self.output {
            OutputAccess::Fresh(b) => &mut **b,
            OutputAccess::Locked(guard) => match guard.as_mut() {
                Some(Buffer::Host(b)) => b,
                _ => unreachable!("host kernel given a storage of another backend"),
            },
        };
        (LockedInputs { guards: &self.guards, of_input: &self.of_input }, out)
    }
}

fn lock_bug(out: &Out<'_>, msg: &str) -> crate::Error {
    let device = match out {
        Out::Storage(s) => s.device(),
        Out::Fresh(_) => Device::Cpu,
    };
    crate::Error::KernelFailed { device, op: "lock".into(), msg: format!("{msg} (a kiln bug: please report it)") }
}

/// The inputs of an [`OperandLocks`].
pub(crate) struct LockedInputs<'g, 'a> {
    guards: &'g [RwLockReadGuard<'a, Option<Buffer>>],
    of_input: &'g [u8],
}

impl<'g> LockedInputs<'g, '_> {
    /// Input `i`'s host elements.
    pub(crate) fn host(&self, i: usize) -> &'g CpuBuffer {
        host_of(&self.guards[self.of_input[i] as usize])
    }
}

/// A tensor's reference to its storage: an `Arc<Storage>` whose last drop
/// on the CPU keeps the emptied allocation on the thread, for the next
/// storage made there.
///
/// Why: a small operation allocates one storage and frees another (its
/// input of the step before); the two heap calls and the two atomic
/// decrements of an `Arc`'s last drop cost more than the operation. The
/// buffer itself is returned to the pool as usual, so memory accounting
/// does not change. Nothing takes a `Weak` of a CPU storage (the CUDA
/// backend keeps `Weak`s of its own storages only), so a strong count of 1
/// (seen behind an acquire fence) means the handle being dropped is the
/// only way to reach it.
pub(crate) struct StorageHandle(std::mem::ManuallyDrop<Arc<Storage>>);

impl StorageHandle {
    #[inline]
    pub(crate) fn new(storage: Arc<Storage>) -> Self {
        if storage.stream_ordered {
            storage.handles.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        StorageHandle(std::mem::ManuallyDrop::new(storage))
    }
}

impl std::ops::Deref for StorageHandle {
    type Target = Arc<Storage>;
    #[inline]
    fn deref(&self) -> &Arc<Storage> {
        &self.0
    }
}

impl StorageHandle {
    /// The storage, when this handle is the only reference to it (no other
    /// tensor, view, autograd node or queued kernel holds it).
    #[inline]
    pub(crate) fn get_mut(&mut self) -> Option<&mut Storage> {
        Arc::get_mut(&mut self.0)
    }
}

impl Storage {
    /// The host buffer, through exclusive access.
    #[inline]
    pub(crate) fn host_mut(&mut self) -> Option<&mut CpuBuffer> {
        match self.buffer.get_mut() {
            Some(Buffer::Host(b)) => Some(b),
            _ => None,
        }
    }
}

impl Clone for StorageHandle {
    #[inline]
    fn clone(&self) -> Self {
        StorageHandle::new(Arc::clone(&self.0))
    }
}

impl Storage {
    /// Unbooks the bytes now, once: the last tensor of a simulated GPU's
    /// storage is gone while kernels queued on it still hold it. Work
    /// submitted later runs after those kernels (one in-order queue), so
    /// the bytes may be booked again at once, as a GPU's stream-ordered
    /// allocator reuses a freed block for later work on its stream; the
    /// host buffer itself is freed when the kernels are done with it.
    fn unbook_early(&self) {
        if self.booked.swap(false, std::sync::atomic::Ordering::AcqRel) {
            self.backend.pool().unreserve(self.bytes());
        }
    }
}

impl Drop for StorageHandle {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the Arc is taken out once, here, and the field is never used again.
        let arc = unsafe { std::mem::ManuallyDrop::take(&mut self.0) };
        if arc.stream_ordered {
            // The last tensor handle, with queued kernels still holding the storage.
            if arc.handles.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 && Arc::strong_count(&arc) > 1 {
                arc.unbook_early();
            }
            return;
        }
        if arc.device == Device::Cpu && Arc::strong_count(&arc) == 1 && Arc::weak_count(&arc) == 0 {
            // Pairs with the release decrement of any other handle dropped
            // before: its accesses to the storage happen before ours.
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            keep_shell(arc);
        }
    }
}

/// Gives a CPU storage's buffer back to the CPU's pool (called directly: a
/// small operation drops a storage every time).
#[inline]
fn release_cpu(buffer: Buffer, bytes: usize) {
    match buffer {
        Buffer::Host(b) => CPU_POOL.release_host(b, bytes),
        Buffer::Device(_) => CPU_POOL.unreserve(bytes),
    }
}

/// Emptied storage allocations kept per thread (at most this many).
const SHELLS_KEPT: usize = 64;

thread_local! {
    static SHELLS: std::cell::RefCell<Vec<Arc<Storage>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Releases the buffer of the CPU storage `arc`, its only reference, and
/// keeps the allocation for reuse.
#[inline]
fn keep_shell(arc: Arc<Storage>) {
    // SAFETY: `arc` is the only reference to the storage (strong count 1,
    // no weak references, after an acquire fence): nothing else can read
    // or write it while we do.
    let storage = unsafe { &mut *(Arc::as_ptr(&arc) as *mut Storage) };
    let buffer = storage.buffer.get_mut().take();
    if let Some(buffer) = buffer {
        release_cpu(buffer, storage.bytes());
    }
    // Dropped normally (its buffer is gone) when the thread keeps enough.
    let _ = SHELLS.try_with(|shells| {
        if let Ok(mut shells) = shells.try_borrow_mut()
            && shells.len() < SHELLS_KEPT
        {
            shells.push(arc);
        }
    });
}

/// A kept allocation, refilled with `storage`, or a new one.
#[inline]
fn reuse_shell(storage: Storage) -> Arc<Storage> {
    let shell = SHELLS.try_with(|s| s.try_borrow_mut().ok()?.pop()).ok().flatten();
    match shell {
        Some(arc) => {
            // SAFETY: a kept shell is unique (it was kept as the only
            // reference and nobody else ever saw it since) and holds a
            // storage without a buffer, whose drop would do nothing: it is
            // overwritten without being dropped.
            unsafe { std::ptr::write(Arc::as_ptr(&arc) as *mut Storage, storage) };
            arc
        }
        None => Arc::new(storage),
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        let buffer = self.buffer.get_mut().take();
        if let Some(buffer) = buffer {
            if !*self.booked.get_mut() {
                // Unbooked already (`unbook_early`): only the memory goes.
                self.backend.release_unbooked(buffer);
            } else if self.device == Device::Cpu {
                release_cpu(buffer, self.bytes());
            } else {
                self.backend.release(buffer, self.bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{cpu, Tensor};

    fn first(b: &CpuBuffer) -> f32 {
        match b {
            CpuBuffer::F32(v) => v[0],
            other => panic!("expected f32, got {}", other.dtype()),
        }
    }

    /// Each input reads its own storage, whatever the order of the storages'
    /// addresses and however often one repeats: the one- and two-input
    /// paths of `OperandLocks::new` and the general one; with a fresh
    /// output, a locked one, and an output that is also an input (refused);
    /// and `read_two`, the dense path's pair.
    #[test]
    fn operand_locks_give_each_input_its_own_storage() {
        let ts: Vec<Tensor> = (0..4).map(|i| Tensor::new(&[i as f32], &cpu()).unwrap()).collect();
        let s: Vec<&Storage> = ts.iter().map(|t| &**t.storage).collect();
        let picks: [&[usize]; 11] =
            [&[0], &[1], &[0, 0], &[0, 1], &[1, 0], &[2, 2], &[0, 1, 2], &[2, 0, 1], &[1, 1, 0], &[2, 1, 2, 0], &[]];
        for pick in picks {
            let inputs: Vec<&Storage> = pick.iter().map(|&i| s[i]).collect();
            let mut fresh = CpuBuffer::zeros(DType::F32, 1);
            let mut locks = OperandLocks::new(&inputs, Out::Fresh(&mut fresh)).unwrap();
            let (held, _) = locks.split();
            for (k, &i) in pick.iter().enumerate() {
                assert_eq!(first(held.host(k)), i as f32, "inputs {pick:?}, fresh output");
            }
            drop(locks);
            // Storage 3 as the output, written under its lock beside the reads.
            let mut locks = OperandLocks::new(&inputs, Out::Storage(s[3])).unwrap();
            let (held, w) = locks.split();
            for (k, &i) in pick.iter().enumerate() {
                assert_eq!(first(held.host(k)), i as f32, "inputs {pick:?}, locked output");
            }
            assert_eq!(first(w), 3.0);
            drop(locks);
            if let [i, j] = *pick {
                let pair = read_two(s[i], s[j]);
                let (a, b) = pair.hosts();
                assert_eq!((first(a), first(b)), (i as f32, j as f32), "read_two of {pick:?}");
            }
            if let Some(&i) = pick.first() {
                let err = OperandLocks::new(&inputs, Out::Storage(s[i])).err().expect("an output that is an input is refused");
                assert!(err.to_string().contains("also one of its inputs"), "{err}");
            }
        }
    }
}
