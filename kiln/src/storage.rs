//! Storage: one allocation on one device, shared by every view of it.
//!
//! A storage is created by its device's backend, which accounts its bytes in
//! the device's [`MemoryPool`](crate::memory::MemoryPool) and gets them back
//! when the last view drops. The buffer sits behind a lock because on an
//! asynchronous device the kernel that fills it runs later, on the device's
//! queue, while the host already holds the tensor.

use crate::backend::Backend;
use crate::{DType, Device, WithDType};
use half::{bf16, f16};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Elements in host memory, one variant per dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuBuffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// i64 elements.
    I64(Vec<i64>),
    /// i32 elements.
    I32(Vec<i32>),
    /// u8 elements.
    U8(Vec<u8>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
}

/// Runs `$body` with `$v` bound to the typed vector inside a [`CpuBuffer`].
#[macro_export]
#[doc(hidden)]
macro_rules! map_buffer {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            $crate::CpuBuffer::F32($v) => $body,
            $crate::CpuBuffer::F64($v) => $body,
            $crate::CpuBuffer::I64($v) => $body,
            $crate::CpuBuffer::I32($v) => $body,
            $crate::CpuBuffer::U8($v) => $body,
            $crate::CpuBuffer::F16($v) => $body,
            $crate::CpuBuffer::BF16($v) => $body,
        }
    };
}

impl CpuBuffer {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuBuffer::F32(_) => DType::F32,
            CpuBuffer::F64(_) => DType::F64,
            CpuBuffer::I64(_) => DType::I64,
            CpuBuffer::I32(_) => DType::I32,
            CpuBuffer::U8(_) => DType::U8,
            CpuBuffer::F16(_) => DType::F16,
            CpuBuffer::BF16(_) => DType::BF16,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        map_buffer!(self, v => v.len())
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A zeroed buffer (large ones come straight from the OS as zero pages).
    pub(crate) fn zeros(dtype: DType, len: usize) -> CpuBuffer {
        if len <= 64 {
            // calloc costs more than malloc plus a short fill for tiny buffers,
            // which is what per-op overhead is made of.
            fn small<T: Copy>(x: T, len: usize) -> Vec<T> {
                let mut v = Vec::with_capacity(len);
                v.resize(len, x);
                v
            }
            return match dtype {
                DType::F32 => CpuBuffer::F32(small(0f32, len)),
                DType::F64 => CpuBuffer::F64(small(0f64, len)),
                DType::I64 => CpuBuffer::I64(small(0i64, len)),
                DType::I32 => CpuBuffer::I32(small(0i32, len)),
                DType::U8 => CpuBuffer::U8(small(0u8, len)),
                DType::F16 => CpuBuffer::F16(small(f16::ZERO, len)),
                DType::BF16 => CpuBuffer::BF16(small(bf16::ZERO, len)),
            };
        }
        CpuBuffer::try_zeros(dtype, len).unwrap_or_else(|| CpuBuffer::zeros(dtype, 0))
    }

    /// A zeroed buffer, or `None` when the allocator cannot provide it
    /// (instead of aborting the process as `vec!` would).
    pub(crate) fn try_zeros(dtype: DType, len: usize) -> Option<CpuBuffer> {
        let buf = match dtype {
            DType::F32 => CpuBuffer::F32(zeroed_vec(len)?),
            DType::F64 => CpuBuffer::F64(zeroed_vec(len)?),
            DType::I64 => CpuBuffer::I64(zeroed_vec(len)?),
            DType::I32 => CpuBuffer::I32(zeroed_vec(len)?),
            DType::U8 => CpuBuffer::U8(zeroed_vec(len)?),
            DType::F16 => CpuBuffer::F16(zeroed_vec(len)?),
            DType::BF16 => CpuBuffer::BF16(zeroed_vec(len)?),
        };
        buf.advise_huge_pages();
        Some(buf)
    }
    /// Asks the kernel for transparent huge pages on big buffers: a 400 MB
    /// output otherwise takes 100,000 page faults before the first write ends.
    fn advise_huge_pages(&self) {
        #[cfg(target_os = "linux")]
        {
            const HUGE: usize = 2 << 20;
            let (ptr, bytes) = map_buffer!(self, v => (v.as_ptr() as usize, std::mem::size_of_val(&v[..])));
            if bytes < 4 * HUGE {
                return;
            }
            let start = ptr.div_ceil(HUGE) * HUGE;
            let end = (ptr + bytes) / HUGE * HUGE;
            if end > start {
                // SAFETY: the range lies inside our own allocation; madvise only
                // changes how the kernel backs it, never its contents.
                unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
                }
            }
        }
    }
    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }
    /// Element `i` as f64.
    pub(crate) fn get_f64(&self, i: usize) -> f64 {
        map_buffer!(self, v => v[i].to_f64())
    }
    /// The elements as a typed vector, if the dtype matches.
    pub fn into_vec<T: WithDType>(self) -> Option<Vec<T>> {
        T::from_buffer(self)
    }
}

/// `len` zeroed elements straight from the allocator (large ones are fresh
/// zero pages, touched only when written), or `None` when it refuses.
fn zeroed_vec<T: WithDType>(len: usize) -> Option<Vec<T>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    // SAFETY: the layout has a non-zero size; every dtype of kiln is valid as
    // all-zero bits (0.0, 0, +0 half); the pointer comes from the global
    // allocator with T's layout, as Vec::from_raw_parts requires.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        if ptr.is_null() {
            return None;
        }
        Some(Vec::from_raw_parts(ptr, len, len))
    }
}

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
    pub(crate) backend: Arc<dyn Backend>,
    buffer: RwLock<Option<Buffer>>,
}

impl Storage {
    pub(crate) fn new(backend: Arc<dyn Backend>, buffer: Buffer, dtype: DType, len: usize) -> Arc<Storage> {
        Arc::new(Storage { dtype, len, backend, buffer: RwLock::new(Some(buffer)) })
    }
    pub(crate) fn device(&self) -> Device {
        self.backend.device()
    }
    pub(crate) fn bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }
    /// Read access to the buffer. Only kernels and transfers call this, in
    /// queue order, so a writer never holds it for long.
    pub(crate) fn read(&self) -> BufferRead<'_> {
        BufferRead(self.buffer.read().unwrap_or_else(|e| e.into_inner()))
    }
}

pub(crate) struct BufferRead<'a>(RwLockReadGuard<'a, Option<Buffer>>);

fn host_of(buffer: &Option<Buffer>) -> &CpuBuffer {
    match buffer.as_ref() {
        Some(Buffer::Host(b)) => b,
        _ => unreachable!("host kernel given a storage of another backend"),
    }
}

impl BufferRead<'_> {
    pub(crate) fn host(&self) -> &CpuBuffer {
        host_of(&self.0)
    }
    #[allow(dead_code)]
    pub(crate) fn buffer(&self) -> &Buffer {
        self.0.as_ref().expect("storage buffer present until drop")
    }
}

/// The locks of one kernel's operands: read locks on its inputs, a write lock
/// on its output.
///
/// Why one type for this: a kernel that holds one storage's lock while it
/// waits for another's can deadlock against a kernel on another thread that
/// takes the same two the other way round (`a.assign(&b)` beside
/// `b.assign(&a)`). Every kernel therefore takes all its locks here, in one
/// global order (the storages' addresses), and holds no other lock while
/// waiting: a cycle of waits is then impossible. An input that appears twice
/// is locked once (a second read lock can queue behind a waiting writer).
/// The output must not also be an input; callers that write in place copy a
/// source sharing the output's storage first.
pub(crate) struct OperandLocks<'a> {
    /// Read guards of the distinct inputs: a kernel reads at most two
    /// storages under lock (`Where`'s condition is gathered first).
    inputs: [Option<ReadGuard<'a>>; 2],
    /// True when input 1 is the same storage as input 0 (one guard serves both).
    shared: bool,
    output: RwLockWriteGuard<'a, Option<Buffer>>,
}

type ReadGuard<'a> = RwLockReadGuard<'a, Option<Buffer>>;

impl<'a> OperandLocks<'a> {
    /// Locks `inputs` (at most two) for reading and `output` for writing, in
    /// address order. An input that is also the output is refused (a kiln
    /// bug): locking it twice would deadlock the thread on itself.
    pub(crate) fn new(inputs: &[&'a Storage], output: &'a Storage) -> crate::Result<Self> {
        let bug = |msg: &str| crate::Error::KernelFailed {
            device: output.device(),
            op: "lock".into(),
            msg: format!("{msg} (a kiln bug: please report it)"),
        };
        if inputs.len() > 2 {
            return Err(bug("a kernel locks more than two inputs"));
        }
        if inputs.iter().any(|s| std::ptr::eq(*s, output)) {
            return Err(bug("a kernel's output storage is also one of its inputs"));
        }
        let first = inputs.first().copied();
        let second = inputs.get(1).copied().filter(|b| !first.is_some_and(|a| std::ptr::eq(a, *b)));
        let shared = inputs.len() == 2 && second.is_none();
        let read = |s: &'a Storage| s.buffer.read().unwrap_or_else(|e| e.into_inner());
        let write = || output.buffer.write().unwrap_or_else(|e| e.into_inner());
        let addr = |s: &Storage| s as *const Storage as usize;
        let (out_at, mut g1, mut g2, mut out) = (addr(output), None, None, None);
        match (first, second) {
            (None, _) => out = Some(write()),
            (Some(a), None) => {
                if addr(a) < out_at {
                    g1 = Some(read(a));
                    out = Some(write());
                } else {
                    out = Some(write());
                    g1 = Some(read(a));
                }
            }
            (Some(a), Some(b)) => {
                // Three storages: a three-compare sorting network, then lock in order.
                let mut keys = [(out_at, 0u8), (addr(a), 1), (addr(b), 2)];
                if keys[0] > keys[1] {
                    keys.swap(0, 1);
                }
                if keys[1] > keys[2] {
                    keys.swap(1, 2);
                }
                if keys[0] > keys[1] {
                    keys.swap(0, 1);
                }
                for (_, which) in keys {
                    match which {
                        0 => out = Some(write()),
                        1 => g1 = Some(read(a)),
                        _ => g2 = Some(read(b)),
                    }
                }
            }
        }
        let output = out.ok_or_else(|| bug("the output was not locked"))?;
        Ok(OperandLocks { inputs: [g1, g2], shared, output })
    }

    /// The inputs (by their position in `new`) and the output, borrowed together.
    pub(crate) fn split(&mut self) -> (LockedInputs<'_, 'a>, &mut CpuBuffer) {
        let out = match self.output.as_mut() {
            Some(Buffer::Host(b)) => b,
            _ => unreachable!("host kernel given a storage of another backend"),
        };
        (LockedInputs { inputs: &self.inputs, shared: self.shared }, out)
    }
}

/// The read-locked inputs of an [`OperandLocks`].
pub(crate) struct LockedInputs<'g, 'a> {
    inputs: &'g [Option<ReadGuard<'a>>; 2],
    shared: bool,
}

impl<'g> LockedInputs<'g, '_> {
    /// Input `i`'s host elements.
    pub(crate) fn host(&self, i: usize) -> &'g CpuBuffer {
        let slot = if i == 1 && self.shared { 0 } else { i };
        match &self.inputs[slot] {
            Some(guard) => host_of(guard),
            None => unreachable!("input {i} was not passed to OperandLocks::new"),
        }
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        let buffer = self.buffer.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(buffer) = buffer {
            self.backend.release(buffer, self.bytes());
        }
    }
}
