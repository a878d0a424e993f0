//! Host elements of one dtype: what host kernels read and write, and what
//! reads to the host return.

use crate::base::dtype::DType;
use half::{bf16, f16};

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

/// Whether this machine could ever hold `bytes` at once: its RAM and swap
/// together, read once. A larger request is refused here, before the
/// allocator is asked: under Linux's "always overcommit" policy the
/// allocator says yes to any size, and the first writes then wait on the
/// OOM killer instead of failing.
fn host_could_hold(bytes: usize) -> bool {
    // Below 1 GiB the allocator's answer is good enough, and no lookup runs.
    if bytes < 1 << 30 {
        return true;
    }
    bytes <= host_ceiling()
}

/// An empty vector with room for `len` elements, or `None` when the host
/// refuses them or could never hold them ([`host_could_hold`]): the one
/// fallible reservation that host kernels and workspaces go through.
pub(crate) fn try_with_capacity<T>(len: usize) -> Option<Vec<T>> {
    if !host_could_hold(len.saturating_mul(std::mem::size_of::<T>())) {
        return None;
    }
    let mut v = Vec::new();
    v.try_reserve_exact(len).ok()?;
    Some(v)
}

/// The machine's RAM and swap together, in bytes, read once; `usize::MAX`
/// where the OS does not tell.
fn host_ceiling() -> usize {
    static CEILING: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CEILING.get_or_init(|| {
        use sysinfo::{MemoryRefreshKind, System};
        let mut sys = System::new();
        sys.refresh_memory_specifics(MemoryRefreshKind::nothing().with_ram().with_swap());
        let total = sys.total_memory().saturating_add(sys.total_swap());
        // 0 where the OS does not tell: then only the allocator decides.
        if total == 0 {
            usize::MAX
        } else {
            usize::try_from(total).unwrap_or(usize::MAX)
        }
    })
}

/// `len` zeroed elements straight from the allocator (large ones are fresh
/// zero pages, touched only when written), or `None` when it refuses.
fn zeroed_vec<T: WithDType>(len: usize) -> Option<Vec<T>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    if !host_could_hold(layout.size()) {
        return None;
    }
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

/// A Rust type that can be an element of a tensor.
pub trait WithDType: Copy + Send + Sync + 'static + std::fmt::Debug + PartialOrd {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Lossy conversion from f64 (saturating for integers, NaN to 0).
    fn from_f64(v: f64) -> Self;
    /// Conversion from i64 as numpy and PyTorch cast: one rounding to a
    /// float type, wrapping (two's complement truncation) to a narrower
    /// integer type.
    fn from_i64(v: i64) -> Self;
    /// Conversion to f64.
    fn to_f64(self) -> f64;
    /// Wraps a vector into a host buffer.
    fn into_buffer(v: Vec<Self>) -> CpuBuffer;
    /// Borrows the elements if the buffer has this dtype.
    fn slice(b: &CpuBuffer) -> Option<&[Self]>;
    /// Takes the elements if the buffer has this dtype.
    fn from_buffer(b: CpuBuffer) -> Option<Vec<Self>>;
    /// Borrows the elements mutably if the buffer has this dtype.
    fn slice_mut(b: &mut CpuBuffer) -> Option<&mut [Self]>;
}

macro_rules! with_dtype {
    ($t:ty, $variant:ident, $from:expr, $to:expr, $from_i64:expr) => {
        impl WithDType for $t {
            const DTYPE: DType = DType::$variant;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $to(self)
            }
            #[inline(always)]
            fn from_i64(v: i64) -> Self {
                $from_i64(v)
            }
            fn into_buffer(v: Vec<Self>) -> CpuBuffer {
                CpuBuffer::$variant(v)
            }
            fn slice(b: &CpuBuffer) -> Option<&[Self]> {
                match b {
                    CpuBuffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn from_buffer(b: CpuBuffer) -> Option<Vec<Self>> {
                match b {
                    CpuBuffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(b: &mut CpuBuffer) -> Option<&mut [Self]> {
                match b {
                    CpuBuffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

with_dtype!(f32, F32, |v: f64| v as f32, |x: f32| x as f64, |v: i64| v as f32);
with_dtype!(f64, F64, |v: f64| v, |x: f64| x, |v: i64| v as f64);
with_dtype!(i64, I64, |v: f64| v as i64, |x: i64| x as f64, |v: i64| v);
with_dtype!(i32, I32, |v: f64| v as i32, |x: i32| x as f64, |v: i64| v as i32);
with_dtype!(u8, U8, |v: f64| v as u8, |x: u8| x as f64, |v: i64| v as u8);
with_dtype!(f16, F16, f16::from_f64, |x: f16| x.to_f64(), |v: i64| f16::from_f64(v as f64));
with_dtype!(bf16, BF16, bf16::from_f64, |x: bf16| x.to_f64(), |v: i64| bf16::from_f64(v as f64));

#[cfg(test)]
mod host_ceiling_tests {
    #[test]
    fn more_than_the_machine_holds_is_refused_before_the_allocator_is_asked() {
        assert!(super::host_could_hold(1 << 20));
        if super::host_ceiling() == usize::MAX {
            eprintln!("SKIPPED: the host ceiling: this OS reports no memory size, so only the allocator decides");
            return;
        }
        // 1 EiB: no machine has it, whatever the overcommit policy.
        assert!(!super::host_could_hold(1 << 60));
        assert!(super::CpuBuffer::try_zeros(crate::DType::F32, 1 << 58).is_none());
    }
}
