//! Kernels over host memory, shared by the CPU and the simulated GPUs (which
//! run them on their own worker thread with `threads = 1`). Contiguous
//! operands take a dense loop the compiler vectorises; strided ones walk rows
//! of the last dimension. Above `PAR_MIN` elements the work is split over the
//! rayon pool when `threads > 1`. Besides the output, nothing is allocated.

use super::cpu::on_pool;
use crate::base::buffer::CpuBuffer;
use crate::base::shape::{Dims, Layout};
use crate::op::{BinaryOp, Distribution, Kernel, Out, ReduceOp, Src, UnaryOp};
use crate::runtime::rng;
use crate::storage::OperandLocks;
use crate::{map_buffer, Device, Error, Result, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;
use smallvec::SmallVec;

/// Elementwise work below this many elements stays on one thread.
const PAR_MIN: usize = 1 << 16;
/// Elements per parallel chunk.
const CHUNK: usize = 1 << 15;
/// Multiply-adds below which a matmul stays on one thread: on a 2-core
/// machine two threads make a 100×100 product slower, not faster.
const MATMUL_PAR_MIN: usize = 200 * 200 * 200;
/// Multiply-adds up to which a plain loop beats gemm's dispatch (a linear
/// regression's (32×2)@(2×1) takes 64).
const MATMUL_TINY: usize = 512;

/// Arithmetic every numeric dtype has.
pub(crate) trait Num: WithDType + Default {
    const ZERO: Self;
    const ONE: Self;
    const LOWEST: Self;
    const HIGHEST: Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self {
        if o > self {
            o
        } else {
            self
        }
    }
    fn min(self, o: Self) -> Self {
        if o < self {
            o
        } else {
            self
        }
    }
    fn abs(self) -> Self;
    fn neg(self) -> Self;
    fn pow(self, o: Self) -> Self;
}

/// Functions only floats have.
pub(crate) trait Float: Num {
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
}

macro_rules! float_num {
    ($t:ty) => {
        impl Num for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const LOWEST: Self = <$t>::NEG_INFINITY;
            const HIGHEST: Self = <$t>::INFINITY;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self - o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                self / o
            }
            // NaN propagates, as in PyTorch and numpy (`f32::max` drops it).
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() {
                    <$t>::NAN
                } else {
                    self.max(o)
                }
            }
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() {
                    <$t>::NAN
                } else {
                    self.min(o)
                }
            }
            #[inline(always)]
            fn abs(self) -> Self {
                self.abs()
            }
            #[inline(always)]
            fn neg(self) -> Self {
                -self
            }
            #[inline(always)]
            fn pow(self, o: Self) -> Self {
                self.powf(o)
            }
        }
        impl Float for $t {
            #[inline(always)]
            fn exp(self) -> Self {
                self.exp()
            }
            #[inline(always)]
            fn ln(self) -> Self {
                self.ln()
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                self.sqrt()
            }
            #[inline(always)]
            fn sin(self) -> Self {
                self.sin()
            }
            #[inline(always)]
            fn cos(self) -> Self {
                self.cos()
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                self.tanh()
            }
        }
    };
}
float_num!(f32);
float_num!(f64);

macro_rules! int_num {
    ($t:ty, $abs:expr, $neg:expr) => {
        impl Num for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            const LOWEST: Self = <$t>::MIN;
            const HIGHEST: Self = <$t>::MAX;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                // Integer division by zero gives 0 rather than a panic: kernels
                // may run on a device queue where nobody could catch it.
                if o == 0 {
                    0
                } else {
                    self.wrapping_div(o)
                }
            }
            #[inline(always)]
            fn abs(self) -> Self {
                $abs(self)
            }
            #[inline(always)]
            fn neg(self) -> Self {
                $neg(self)
            }
            #[inline(always)]
            fn pow(self, o: Self) -> Self {
                powi(self, o as i32)
            }
        }
    };
}
int_num!(i64, |x: i64| x.wrapping_abs(), |x: i64| x.wrapping_neg());
int_num!(i32, |x: i32| x.wrapping_abs(), |x: i32| x.wrapping_neg());
int_num!(u8, |x: u8| x, |x: u8| x.wrapping_neg());

/// x^n by squaring, so integer powers never go through powf.
#[inline(always)]
pub(crate) fn powi<T: Num>(x: T, n: i32) -> T {
    let mut base = x;
    let mut e = n.unsigned_abs();
    let mut acc = T::ONE;
    while e > 0 {
        if e & 1 == 1 {
            acc = acc.mul(base);
        }
        base = base.mul(base);
        e >>= 1;
    }
    if n < 0 {
        T::ONE.div(acc)
    } else {
        acc
    }
}

/// Runs one kernel to completion on this thread (and the rayon pool when
/// `threads > 1`). Every lock the kernel needs is taken at once, in the
/// global order of [`OperandLocks`], so kernels on different threads cannot
/// deadlock. A kernel whose output (or in-place source) has no elements does
/// nothing: it never walks the dimensions of an empty tensor, however large
/// the others are. Temporaries are allocated fallibly: host exhaustion is
/// `OutOfMemory`, never an abort.
pub(crate) fn run(kernel: &Kernel<'_>, out: Out<'_>, threads: usize, device: Device) -> Result<()> {
    if kernel.writes_nothing(out.len()) {
        return Ok(());
    }
    let _ = device;
    match kernel {
        Kernel::Fill { value } => {
            let mut locks = OperandLocks::new(&[], out)?;
            map_buffer!(locks.split().1, v => fill(v, *value, threads))
        }
        Kernel::Arange { start, step } => {
            let mut locks = OperandLocks::new(&[], out)?;
            map_buffer!(locks.split().1, v => arange(v, *start, *step))
        }
        Kernel::Random { seed, offset, dist } => {
            let mut locks = OperandLocks::new(&[], out)?;
            map_buffer!(locks.split().1, v => random(v, *seed, *offset, *dist, threads))
        }
        Kernel::Unary { op, src } => {
            let mut locks = OperandLocks::new(&[&src.storage], out)?;
            let (inputs, w) = locks.split();
            match (inputs.host(0), w) {
                (CpuBuffer::F32(s), CpuBuffer::F32(o)) => unary_float(*op, s, &src.layout, o, threads),
                (CpuBuffer::F64(s), CpuBuffer::F64(o)) => unary_float(*op, s, &src.layout, o, threads),
                (CpuBuffer::I64(s), CpuBuffer::I64(o)) => unary_num(*op, s, &src.layout, o, threads),
                (CpuBuffer::I32(s), CpuBuffer::I32(o)) => unary_num(*op, s, &src.layout, o, threads),
                (CpuBuffer::U8(s), CpuBuffer::U8(o)) => unary_num(*op, s, &src.layout, o, threads),
                _ => return Err(unsupported(kernel)),
            }
        }
        Kernel::Binary { op, lhs, rhs } => {
            let mut locks = OperandLocks::new(&[&lhs.storage, &rhs.storage], out)?;
            let (inputs, w) = locks.split();
            macro_rules! go {
                ($a:expr, $b:expr) => {
                    if op.is_comparison() {
                        let CpuBuffer::U8(o) = w else { return Err(unsupported(kernel)) };
                        compare(*op, $a, &lhs.layout, $b, &rhs.layout, o, threads)
                    } else {
                        binary_arith(*op, $a, &lhs.layout, $b, &rhs.layout, w, threads)
                    }
                };
            }
            match (inputs.host(0), inputs.host(1)) {
                (CpuBuffer::F32(a), CpuBuffer::F32(b)) => go!(a, b),
                (CpuBuffer::F64(a), CpuBuffer::F64(b)) => go!(a, b),
                (CpuBuffer::I64(a), CpuBuffer::I64(b)) => go!(a, b),
                (CpuBuffer::I32(a), CpuBuffer::I32(b)) => go!(a, b),
                (CpuBuffer::U8(a), CpuBuffer::U8(b)) => go!(a, b),
                _ => return Err(unsupported(kernel)),
            }
        }
        Kernel::Reduce { op, src, dims } => {
            let mut locks = OperandLocks::new(&[&src.storage], out)?;
            let (inputs, w) = locks.split();
            match (*op, inputs.host(0), w) {
                (ReduceOp::ArgMax | ReduceOp::ArgMin, s, CpuBuffer::I64(o)) => {
                    let max = *op == ReduceOp::ArgMax;
                    match s {
                        CpuBuffer::F32(s) => arg_reduce(s, &src.layout, dims[0], o, max),
                        CpuBuffer::F64(s) => arg_reduce(s, &src.layout, dims[0], o, max),
                        CpuBuffer::I64(s) => arg_reduce(s, &src.layout, dims[0], o, max),
                        CpuBuffer::I32(s) => arg_reduce(s, &src.layout, dims[0], o, max),
                        CpuBuffer::U8(s) => arg_reduce(s, &src.layout, dims[0], o, max),
                        _ => return Err(unsupported(kernel)),
                    }
                }
                (op, CpuBuffer::F32(s), CpuBuffer::F32(o)) => reduce(op, s, &src.layout, dims, o, threads),
                (op, CpuBuffer::F64(s), CpuBuffer::F64(o)) => reduce(op, s, &src.layout, dims, o, threads),
                (op, CpuBuffer::I64(s), CpuBuffer::I64(o)) => reduce(op, s, &src.layout, dims, o, threads),
                (op, CpuBuffer::I32(s), CpuBuffer::I32(o)) => reduce(op, s, &src.layout, dims, o, threads),
                (op, CpuBuffer::U8(s), CpuBuffer::U8(o)) => reduce(op, s, &src.layout, dims, o, threads),
                _ => return Err(unsupported(kernel)),
            }
        }
        Kernel::Matmul { lhs, rhs, m, n, k } => {
            let mut locks = OperandLocks::new(&[&lhs.storage, &rhs.storage], out)?;
            let (inputs, w) = locks.split();
            if *k == 0 {
                // A sum of nothing: zeros, without walking the operands'
                // (empty) layouts, whose strides may be meaningless.
                map_buffer!(w, v => fill(v, 0.0, threads));
                return Ok(());
            }
            let tiny = m.saturating_mul(*n).saturating_mul(*k) <= MATMUL_TINY;
            match (inputs.host(0), inputs.host(1), w) {
                (CpuBuffer::F32(a), CpuBuffer::F32(b), CpuBuffer::F32(o)) if tiny => {
                    matmul_naive(a, &lhs.layout, b, &rhs.layout, o, (*m, *n, *k))
                }
                (CpuBuffer::F64(a), CpuBuffer::F64(b), CpuBuffer::F64(o)) if tiny => {
                    matmul_naive(a, &lhs.layout, b, &rhs.layout, o, (*m, *n, *k))
                }
                (CpuBuffer::F32(a), CpuBuffer::F32(b), CpuBuffer::F32(o)) => {
                    matmul_gemm(a, &lhs.layout, b, &rhs.layout, o, (*m, *n, *k), threads)
                }
                (CpuBuffer::F64(a), CpuBuffer::F64(b), CpuBuffer::F64(o)) => {
                    matmul_gemm(a, &lhs.layout, b, &rhs.layout, o, (*m, *n, *k), threads)
                }
                (CpuBuffer::F16(a), CpuBuffer::F16(b), CpuBuffer::F16(o)) => {
                    matmul_gemm(a, &lhs.layout, b, &rhs.layout, o, (*m, *n, *k), threads)
                }
                (CpuBuffer::I64(a), CpuBuffer::I64(b), CpuBuffer::I64(o)) => matmul_naive(a, &lhs.layout, b, &rhs.layout, o, (*m, *n, *k)),
                (CpuBuffer::I32(a), CpuBuffer::I32(b), CpuBuffer::I32(o)) => matmul_naive(a, &lhs.layout, b, &rhs.layout, o, (*m, *n, *k)),
                (CpuBuffer::U8(a), CpuBuffer::U8(b), CpuBuffer::U8(o)) => matmul_naive(a, &lhs.layout, b, &rhs.layout, o, (*m, *n, *k)),
                _ => return Err(unsupported(kernel)),
            }
        }
        Kernel::Copy { src, dst_layout } => {
            if matches!(out, Out::Storage(dst) if std::ptr::eq(&**src.storage, dst)) {
                // In place within one storage: read the source out first, so
                // that no lock is held twice and overlapping views copy the
                // values they had before the call.
                let data = try_gather(src)?;
                let mut locks = OperandLocks::new(&[], out)?;
                copy_cast(&data, &Layout::contiguous(src.layout.shape.clone()), locks.split().1, dst_layout);
            } else {
                let mut locks = OperandLocks::new(&[&src.storage], out)?;
                let (inputs, w) = locks.split();
                copy_cast(inputs.host(0), &src.layout, w, dst_layout);
            }
        }
        Kernel::IndexSelect { src, ids, dim } => {
            let ids = index_list(ids)?;
            // A dense source is read in place; a strided one is gathered first.
            let gathered = if src.layout.is_contiguous() { None } else { Some(try_gather(src)?) };
            let mut locks = OperandLocks::new(&[&src.storage], out)?;
            let (inputs, w) = locks.split();
            let (data, start) = match &gathered {
                Some(g) => (g, 0),
                None => (inputs.host(0), src.layout.offset),
            };
            let (end, dims) = (start + src.layout.elem_count(), src.layout.dims());
            match (data, w) {
                (CpuBuffer::F32(s), CpuBuffer::F32(o)) => index_select(&s[start..end], dims, &ids, *dim, o),
                (CpuBuffer::F64(s), CpuBuffer::F64(o)) => index_select(&s[start..end], dims, &ids, *dim, o),
                (CpuBuffer::I64(s), CpuBuffer::I64(o)) => index_select(&s[start..end], dims, &ids, *dim, o),
                (CpuBuffer::I32(s), CpuBuffer::I32(o)) => index_select(&s[start..end], dims, &ids, *dim, o),
                (CpuBuffer::U8(s), CpuBuffer::U8(o)) => index_select(&s[start..end], dims, &ids, *dim, o),
                (CpuBuffer::F16(s), CpuBuffer::F16(o)) => index_select(&s[start..end], dims, &ids, *dim, o),
                (CpuBuffer::BF16(s), CpuBuffer::BF16(o)) => index_select(&s[start..end], dims, &ids, *dim, o),
                _ => return Err(unsupported(kernel)),
            }
        }
        Kernel::IndexAdd { src, ids, dim } => {
            let ids = index_list(ids)?;
            let data = try_gather(src)?;
            let mut locks = OperandLocks::new(&[], out)?;
            match (&data, locks.split().1) {
                (CpuBuffer::F32(s), CpuBuffer::F32(o)) => index_add(s, src.layout.dims(), &ids, *dim, o),
                (CpuBuffer::F64(s), CpuBuffer::F64(o)) => index_add(s, src.layout.dims(), &ids, *dim, o),
                (CpuBuffer::I64(s), CpuBuffer::I64(o)) => index_add(s, src.layout.dims(), &ids, *dim, o),
                (CpuBuffer::I32(s), CpuBuffer::I32(o)) => index_add(s, src.layout.dims(), &ids, *dim, o),
                (CpuBuffer::U8(s), CpuBuffer::U8(o)) => index_add(s, src.layout.dims(), &ids, *dim, o),
                // Half precision accumulates in f32 and rounds once per element.
                (CpuBuffer::F16(s), CpuBuffer::F16(o)) => index_add_half(s, src.layout.dims(), &ids, *dim, o),
                (CpuBuffer::BF16(s), CpuBuffer::BF16(o)) => index_add_half(s, src.layout.dims(), &ids, *dim, o),
                _ => return Err(unsupported(kernel)),
            }
        }
        Kernel::Where { cond, on_true, on_false } => {
            let c = try_gather(cond)?;
            let mut mask: Vec<bool> = Vec::new();
            mask.try_reserve_exact(c.len()).map_err(|_| host_oom(c.len()))?;
            mask.extend((0..c.len()).map(|i| c.get_f64(i) != 0.0));
            drop(c);
            let mut locks = OperandLocks::new(&[&on_true.storage, &on_false.storage], out)?;
            let (inputs, w) = locks.split();
            macro_rules! go {
                ($a:expr, $b:expr, $o:expr) => {
                    select(&mask, $a, &on_true.layout, $b, &on_false.layout, $o)
                };
            }
            match (inputs.host(0), inputs.host(1), w) {
                (CpuBuffer::F32(a), CpuBuffer::F32(b), CpuBuffer::F32(o)) => go!(a, b, o),
                (CpuBuffer::F64(a), CpuBuffer::F64(b), CpuBuffer::F64(o)) => go!(a, b, o),
                (CpuBuffer::I64(a), CpuBuffer::I64(b), CpuBuffer::I64(o)) => go!(a, b, o),
                (CpuBuffer::I32(a), CpuBuffer::I32(b), CpuBuffer::I32(o)) => go!(a, b, o),
                (CpuBuffer::U8(a), CpuBuffer::U8(b), CpuBuffer::U8(o)) => go!(a, b, o),
                (CpuBuffer::F16(a), CpuBuffer::F16(b), CpuBuffer::F16(o)) => go!(a, b, o),
                (CpuBuffer::BF16(a), CpuBuffer::BF16(b), CpuBuffer::BF16(o)) => go!(a, b, o),
                _ => return Err(unsupported(kernel)),
            }
        }
    }
    Ok(())
}

/// Elementwise kernels whose operands are dense runs of at most this many
/// elements take [`run_dense_small`] on the CPU: small models are made of
/// them, and for them the general path's dispatch costs more than the
/// arithmetic.
pub(crate) const DENSE_SMALL_MAX: usize = 1 << 12;

/// A `Unary` or `Binary` kernel over dense operands of at most
/// [`DENSE_SMALL_MAX`] elements into a fresh buffer: the same per-element
/// functions as [`run`], without its general dispatch (layout walks,
/// threading, lock sorting over any operand count). `None` when the kernel
/// is not such a kernel; the caller then runs it through [`run_caught`].
/// Cannot panic: every slice bound is checked against the storage first.
#[inline]
pub(crate) fn run_dense_small(kernel: &Kernel<'_>, out: &mut CpuBuffer) -> Option<()> {
    let len = out.len();
    if len > DENSE_SMALL_MAX || crate::runtime::faults::injected_failure_pending(Device::Cpu) {
        return None;
    }
    match kernel {
        Kernel::Binary { op, lhs, rhs } => {
            let (a0, b0) = (dense_start(&lhs.layout, len)?, dense_start(&rhs.layout, len)?);
            let (ga, gb) = crate::storage::read_two(&lhs.storage, &rhs.storage);
            let (a, b) = (ga.host(), gb.as_ref().map_or(ga.host(), |g| g.host()));
            macro_rules! go {
                ($a:expr, $b:expr) => {{
                    let (a, b) = ($a.get(a0..a0 + len)?, $b.get(b0..b0 + len)?);
                    match out {
                        CpuBuffer::U8(out) if op.is_comparison() => compare_with(*op, Dense2 { a, b, out }),
                        o if !op.is_comparison() => arith_with(*op, Dense2 { a, b, out: slice_of(o)? }),
                        _ => return None,
                    }
                }};
            }
            match (a, b) {
                (CpuBuffer::F32(a), CpuBuffer::F32(b)) => go!(a, b),
                (CpuBuffer::F64(a), CpuBuffer::F64(b)) => go!(a, b),
                (CpuBuffer::I64(a), CpuBuffer::I64(b)) => go!(a, b),
                (CpuBuffer::I32(a), CpuBuffer::I32(b)) => go!(a, b),
                (CpuBuffer::U8(a), CpuBuffer::U8(b)) => go!(a, b),
                _ => return None,
            }
            Some(())
        }
        Kernel::Unary { op, src } => {
            let s0 = dense_start(&src.layout, len)?;
            let g = src.storage.read();
            let flat = Layout::contiguous(crate::Shape::from(len));
            match (g.host(), out) {
                (CpuBuffer::F32(s), CpuBuffer::F32(o)) => unary_float(*op, s.get(s0..s0 + len)?, &flat, o, 1),
                (CpuBuffer::F64(s), CpuBuffer::F64(o)) => unary_float(*op, s.get(s0..s0 + len)?, &flat, o, 1),
                (CpuBuffer::I64(s), CpuBuffer::I64(o)) if !op.float_only() => unary_num(*op, s.get(s0..s0 + len)?, &flat, o, 1),
                (CpuBuffer::I32(s), CpuBuffer::I32(o)) if !op.float_only() => unary_num(*op, s.get(s0..s0 + len)?, &flat, o, 1),
                (CpuBuffer::U8(s), CpuBuffer::U8(o)) if !op.float_only() => unary_num(*op, s.get(s0..s0 + len)?, &flat, o, 1),
                _ => return None,
            }
            Some(())
        }
        _ => None,
    }
}

/// Where a view of `len` elements starts, when its elements are one dense run.
#[inline]
fn dense_start(layout: &Layout, len: usize) -> Option<usize> {
    (layout.is_contiguous() && layout.elem_count() == len).then_some(layout.offset)
}

/// A typed view of an output buffer, when its dtype is `T`.
#[inline]
fn slice_of<T: WithDType>(b: &mut CpuBuffer) -> Option<&mut [T]> {
    (b.dtype() == T::DTYPE).then(|| slice_mut(b))
}

/// [`run`], with any failure (an error, or a panic: a kiln bug) reported as
/// an error naming the kernel and `device`, so no panic crosses the API or
/// kills a device's worker.
pub(crate) fn run_caught(kernel: &Kernel<'_>, out: Out<'_>, threads: usize, device: Device) -> Result<()> {
    if crate::runtime::faults::take_injected_failure(device) {
        return Err(Error::KernelFailed { device, op: kernel.name().to_string(), msg: "a failure injected by a test".into() });
    }
    caught(|| kernel.name(), device, || run(kernel, out, threads, device))
}

/// [`try_gather`], with failures reported as [`run_caught`] does.
pub(crate) fn gather_caught(src: &Src<'_>, device: Device) -> Result<CpuBuffer> {
    caught(|| "read", device, || try_gather(src))
}

/// Runs `f`, turning a panic into `KernelFailed` naming the kernel (`op` is
/// only asked for on failure: naming costs time on every launch otherwise).
#[inline]
fn caught<T>(op: impl FnOnce() -> &'static str, device: Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(Error::KernelFailed { msg, .. })) => Err(Error::KernelFailed { device, op: op().to_string(), msg }),
        Ok(Err(err)) => Err(err),
        Err(panic) => {
            let op = op();
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::KernelFailed { device, op: op.to_string(), msg: format!("panicked: {msg} (a kiln bug: please report it)") })
        }
    }
}

/// A kernel given dtypes the front end should have refused: a kiln bug,
/// reported as an error rather than a panic on a device's queue.
fn unsupported(kernel: &Kernel) -> Error {
    Error::KernelFailed {
        device: Device::Cpu,
        op: kernel.name().to_string(),
        msg: "the host kernel has no implementation for these dtypes (a kiln bug: please report it)".into(),
    }
}

/// Host memory refused for a kernel's temporary of `bytes`.
fn host_oom(bytes: usize) -> Error {
    let in_use = crate::memory_stats(&Device::Cpu).map(|s| s.in_use).unwrap_or(0);
    Error::OutOfMemory { device: Device::Cpu, requested: bytes, in_use, capacity: crate::runtime::host::host_memory_total().unwrap_or(0) }
}

/// `len` elements in a new vector, or `OutOfMemory` when the host refuses
/// (a `Vec` that grows infallibly would abort the process instead).
pub(crate) fn try_vec<T>(len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| host_oom(len.saturating_mul(std::mem::size_of::<T>())))?;
    Ok(v)
}

/// The view's elements, contiguous, in a new host buffer; `OutOfMemory`
/// when the host cannot hold them.
pub(crate) fn try_gather(src: &Src) -> Result<CpuBuffer> {
    let r = src.storage.read();
    let buf = r.host();
    let len = src.layout.elem_count();
    if len == 0 {
        return Ok(CpuBuffer::zeros(src.storage.dtype, 0));
    }
    if let Some((a, b)) = src.layout.contiguous_range() {
        return Ok(map_buffer!(buf, v => {
            let mut out = try_vec(b - a)?;
            out.extend_from_slice(&v[a..b]);
            WithDType::into_buffer(out)
        }));
    }
    Ok(map_buffer!(buf, v => {
        let mut out = try_vec(len)?;
        out.extend(src.layout.offsets().map(|i| v[i]));
        WithDType::into_buffer(out)
    }))
}

/// The indices of an i64 or u8 index view. A negative index (only possible
/// on a GPU, see `index_list_len`) becomes usize::MAX: it selects nothing,
/// like one past the end.
pub(crate) fn index_list(ids: &Src) -> Result<Vec<usize>> {
    let r = ids.storage.read();
    let l = &ids.layout;
    let mut out = try_vec(l.elem_count())?;
    match r.host() {
        CpuBuffer::I64(v) => match l.contiguous_range() {
            Some((a, b)) => out.extend(v[a..b].iter().map(|&i| usize::try_from(i).unwrap_or(usize::MAX))),
            None => out.extend(l.offsets().map(|o| usize::try_from(v[o]).unwrap_or(usize::MAX))),
        },
        CpuBuffer::I32(v) => out.extend(l.offsets().map(|o| usize::try_from(v[o]).unwrap_or(usize::MAX))),
        CpuBuffer::U8(v) => out.extend(l.offsets().map(|o| v[o] as usize)),
        other => out.extend(l.offsets().map(|o| other.get_f64(o) as usize)),
    }
    Ok(out)
}

fn fill<T: WithDType>(v: &mut [T], value: f64, threads: usize) {
    let x = T::from_f64(value);
    if threads > 1 && v.len() >= PAR_MIN {
        on_pool(|| v.par_chunks_mut(CHUNK).for_each(|c| c.fill(x)));
    } else {
        v.fill(x);
    }
}

fn arange<T: WithDType>(v: &mut [T], start: f64, step: f64) {
    for (i, x) in v.iter_mut().enumerate() {
        *x = T::from_f64(start + i as f64 * step);
    }
}

fn random<T: WithDType>(v: &mut [T], seed: u64, offset: u64, dist: Distribution, threads: usize) {
    let fill_chunk = |start: usize, chunk: &mut [T]| {
        for (j, x) in chunk.iter_mut().enumerate() {
            let i = offset + (start + j) as u64;
            *x = match dist {
                Distribution::Uniform { lo, hi } => {
                    let v = T::from_f64(lo + (hi - lo) * rng::uniform(seed, i));
                    // Rounding to f32 (or narrower) can reach the excluded
                    // upper bound; a uniform draw never returns it.
                    if v.to_f64() >= hi {
                        T::from_f64(lo)
                    } else {
                        v
                    }
                }
                Distribution::Normal { mean, std } => T::from_f64(mean + std * rng::normal(seed, i)),
            };
        }
    };
    if threads > 1 && v.len() >= PAR_MIN {
        on_pool(|| v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| fill_chunk(c * CHUNK, chunk)));
    } else {
        fill_chunk(0, v);
    }
}

/// out[i] = f(src[layout(i)]), dense and parallel when it can be.
#[inline(always)]
fn map_unary<T: WithDType, U: WithDType, F: Fn(T) -> U + Sync>(src: &[T], layout: &Layout, out: &mut [U], threads: usize, f: F) {
    if let Some((a, b)) = layout.contiguous_range() {
        let src = &src[a..b];
        if threads > 1 && out.len() >= PAR_MIN {
            on_pool(|| {
                out.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(o, s)| {
                    for (o, &s) in o.iter_mut().zip(s) {
                        *o = f(s);
                    }
                })
            });
        } else {
            for (o, &s) in out.iter_mut().zip(src) {
                *o = f(s);
            }
        }
    } else {
        for (o, i) in out.iter_mut().zip(layout.offsets()) {
            *o = f(src[i]);
        }
    }
}

/// How a unary function is applied: from a view into a new buffer
/// ([`Mapped`]) or over a buffer in place ([`InPlace`]). The op tables
/// below are written once, for both.
trait Apply<T> {
    fn apply<F: Fn(T) -> T + Sync>(self, f: F);
}

struct Mapped<'a, T> {
    src: &'a [T],
    layout: &'a Layout,
    out: &'a mut [T],
    threads: usize,
}

impl<T: WithDType> Apply<T> for Mapped<'_, T> {
    #[inline(always)]
    fn apply<F: Fn(T) -> T + Sync>(self, f: F) {
        map_unary(self.src, self.layout, self.out, self.threads, f)
    }
}

/// A buffer rewritten element by element (numpy's temporary elision).
struct InPlace<'a, T> {
    buf: &'a mut [T],
    threads: usize,
}

impl<T: WithDType> Apply<T> for InPlace<'_, T> {
    #[inline(always)]
    fn apply<F: Fn(T) -> T + Sync>(self, f: F) {
        if self.threads > 1 && self.buf.len() >= PAR_MIN {
            on_pool(|| {
                self.buf.par_chunks_mut(CHUNK).for_each(|c| {
                    for x in c.iter_mut() {
                        *x = f(*x);
                    }
                })
            });
        } else {
            for x in self.buf.iter_mut() {
                *x = f(*x);
            }
        }
    }
}

fn unary_num<T: Num>(op: UnaryOp, s: &[T], l: &Layout, o: &mut [T], threads: usize) {
    unary_num_with(op, Mapped { src: s, layout: l, out: o, threads })
}

fn unary_float<T: Float>(op: UnaryOp, s: &[T], l: &Layout, o: &mut [T], threads: usize) {
    unary_float_with(op, Mapped { src: s, layout: l, out: o, threads })
}

#[inline(always)]
fn unary_num_with<T: Num, A: Apply<T>>(op: UnaryOp, a: A) {
    let c = |v: f64| T::from_f64(v);
    match op {
        UnaryOp::Neg => a.apply(|x: T| x.neg()),
        UnaryOp::Abs => a.apply(|x: T| x.abs()),
        UnaryOp::Sqr => a.apply(|x: T| x.mul(x)),
        UnaryOp::Relu => a.apply(|x: T| x.max(T::ZERO)),
        UnaryOp::Powi(2) => a.apply(|x: T| x.mul(x)),
        UnaryOp::Powi(3) => a.apply(|x: T| x.mul(x).mul(x)),
        UnaryOp::Powi(n) => a.apply(|x: T| powi(x, n)),
        UnaryOp::AddScalar(v) => a.apply(|x: T| x.add(c(v))),
        UnaryOp::SubScalar(v) => a.apply(|x: T| x.sub(c(v))),
        UnaryOp::RSubScalar(v) => a.apply(|x: T| c(v).sub(x)),
        UnaryOp::MulScalar(v) => a.apply(|x: T| x.mul(c(v))),
        UnaryOp::DivScalar(v) => a.apply(|x: T| x.div(c(v))),
        UnaryOp::MaxScalar(v) => a.apply(|x: T| x.max(c(v))),
        UnaryOp::MinScalar(v) => a.apply(|x: T| x.min(c(v))),
        UnaryOp::Affine(m, b) => a.apply(|x: T| x.mul(c(m)).add(c(b))),
        _ => unreachable!("float-only unary ops are refused for integers by the front end"),
    }
}

#[inline(always)]
fn unary_float_with<T: Float, A: Apply<T>>(op: UnaryOp, a: A) {
    let c = |v: f64| T::from_f64(v);
    match op {
        UnaryOp::Exp => a.apply(|x: T| x.exp()),
        UnaryOp::Log => a.apply(|x: T| x.ln()),
        UnaryOp::Sqrt => a.apply(|x: T| x.sqrt()),
        UnaryOp::Recip => a.apply(|x: T| T::ONE.div(x)),
        UnaryOp::Sin => a.apply(|x: T| x.sin()),
        UnaryOp::Cos => a.apply(|x: T| x.cos()),
        UnaryOp::Tanh => a.apply(|x: T| x.tanh()),
        UnaryOp::Sigmoid => a.apply(|x: T| T::ONE.div(T::ONE.add(x.neg().exp()))),
        UnaryOp::Powf(p) => a.apply(|x: T| x.pow(c(p))),
        UnaryOp::RDivScalar(v) => a.apply(|x: T| c(v).div(x)),
        // Scalars are applied in the operand's own precision, as PyTorch does.
        _ => unary_num_with(op, a),
    }
}

/// `op` applied to every element of `buf` in place, on the CPU (the
/// front end checked the dtype and that nothing else can see the buffer).
/// Returns false for dtypes the op has no kernel for.
pub(crate) fn unary_in_place(op: UnaryOp, buf: &mut CpuBuffer, threads: usize) -> bool {
    match buf {
        CpuBuffer::F32(v) => unary_float_with(op, InPlace { buf: v, threads }),
        CpuBuffer::F64(v) => unary_float_with(op, InPlace { buf: v, threads }),
        CpuBuffer::I64(v) if !op.float_only() => unary_num_with(op, InPlace { buf: v, threads }),
        CpuBuffer::I32(v) if !op.float_only() => unary_num_with(op, InPlace { buf: v, threads }),
        CpuBuffer::U8(v) if !op.float_only() => unary_num_with(op, InPlace { buf: v, threads }),
        _ => return false,
    }
    true
}

/// Row starts of a layout without its last dimension, in row-major order.
fn rows(layout: &Layout) -> (Layout, usize, usize) {
    let dims = layout.dims();
    if dims.is_empty() {
        return (Layout { shape: crate::Shape::from(()), strides: Dims::new(), offset: layout.offset }, 1, 1);
    }
    let r = dims.len() - 1;
    let outer = Layout { shape: crate::Shape::from(&dims[..r]), strides: Dims::from_slice(&layout.strides[..r]), offset: layout.offset };
    (outer, dims[r], layout.strides[r])
}

/// Two views of one shape, with size-1 dimensions dropped and neighbouring
/// dimensions merged wherever both views step through them evenly, so that
/// e.g. a (32, 1) + (1,) broadcast becomes one row of 32 instead of 32 rows
/// of one.
fn simplify_pair(la: &Layout, lb: &Layout) -> (Layout, Layout) {
    let dims = la.dims();
    let (mut d, mut sa, mut sb) = (Dims::new(), Dims::new(), Dims::new());
    for (i, &n) in dims.iter().enumerate() {
        if n == 1 {
            continue;
        }
        if let (Some(&pd), Some(&pa), Some(&pb)) = (d.last(), sa.last(), sb.last()) {
            if pa == la.strides[i] * n && pb == lb.strides[i] * n {
                let last = d.len() - 1;
                d[last] = pd * n;
                sa[last] = la.strides[i];
                sb[last] = lb.strides[i];
                continue;
            }
        }
        d.push(n);
        sa.push(la.strides[i]);
        sb.push(lb.strides[i]);
    }
    let shape = crate::Shape(d);
    (Layout { shape: shape.clone(), strides: sa, offset: la.offset }, Layout { shape, strides: sb, offset: lb.offset })
}

/// Offset of row `row` of an outer layout (index decomposition).
fn row_start(outer: &Layout, mut row: usize) -> usize {
    let mut off = outer.offset;
    for d in (0..outer.dims().len()).rev() {
        let n = outer.dims()[d];
        off += (row % n) * outer.strides[d];
        row /= n;
    }
    off
}

#[inline(always)]
fn map_binary<T: Copy + Send + Sync, U: Copy + Send + Sync, F: Fn(T, T) -> U + Sync>(
    a: &[T],
    la: &Layout,
    b: &[T],
    lb: &Layout,
    out: &mut [U],
    threads: usize,
    f: F,
) {
    if let (Some((a0, a1)), Some((b0, b1))) = (la.contiguous_range(), lb.contiguous_range()) {
        let (a, b) = (&a[a0..a1], &b[b0..b1]);
        if threads > 1 && out.len() >= PAR_MIN {
            on_pool(|| {
                out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK))).for_each(|(o, (a, b))| {
                    for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
                        *o = f(x, y);
                    }
                })
            });
        } else {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = f(x, y);
            }
        }
        return;
    }
    // Broadcast or strided: walk rows of the last dimension.
    let (la, lb) = simplify_pair(la, lb);
    let (oa, n, sa) = rows(&la);
    let (ob, _, sb) = rows(&lb);
    let row = |r: usize, o: &mut [U]| {
        let (pa, pb) = (row_start(&oa, r), row_start(&ob, r));
        match (sa, sb) {
            (1, 1) => {
                for ((o, &x), &y) in o.iter_mut().zip(&a[pa..pa + n]).zip(&b[pb..pb + n]) {
                    *o = f(x, y);
                }
            }
            (1, 0) => {
                let y = b[pb];
                for (o, &x) in o.iter_mut().zip(&a[pa..pa + n]) {
                    *o = f(x, y);
                }
            }
            (0, 1) => {
                let x = a[pa];
                for (o, &y) in o.iter_mut().zip(&b[pb..pb + n]) {
                    *o = f(x, y);
                }
            }
            _ => {
                for (j, o) in o.iter_mut().enumerate() {
                    *o = f(a[pa + j * sa], b[pb + j * sb]);
                }
            }
        }
    };
    if n == 0 {
        return;
    }
    if threads > 1 && out.len() >= PAR_MIN {
        let rows_per = (CHUNK / n).max(1);
        on_pool(|| {
            out.par_chunks_mut(rows_per * n).enumerate().for_each(|(c, chunk)| {
                for (i, o) in chunk.chunks_mut(n).enumerate() {
                    row(c * rows_per + i, o);
                }
            })
        });
    } else {
        for (r, o) in out.chunks_mut(n).enumerate() {
            row(r, o);
        }
    }
}

/// How a binary function is applied: over two views of one shape into a
/// new buffer ([`Mapped2`], any layouts) or over dense runs ([`Dense2`],
/// the CPU's path for small operands). The op tables below serve both.
trait Apply2<T, U> {
    fn apply<F: Fn(T, T) -> U + Sync>(self, f: F);
}

struct Mapped2<'a, T, U> {
    a: &'a [T],
    la: &'a Layout,
    b: &'a [T],
    lb: &'a Layout,
    out: &'a mut [U],
    threads: usize,
}

impl<T: Copy + Send + Sync, U: Copy + Send + Sync> Apply2<T, U> for Mapped2<'_, T, U> {
    #[inline(always)]
    fn apply<F: Fn(T, T) -> U + Sync>(self, f: F) {
        map_binary(self.a, self.la, self.b, self.lb, self.out, self.threads, f)
    }
}

/// Dense runs at least as long as `out`, on the calling thread.
struct Dense2<'a, T, U> {
    a: &'a [T],
    b: &'a [T],
    out: &'a mut [U],
}

impl<T: Copy, U> Apply2<T, U> for Dense2<'_, T, U> {
    #[inline(always)]
    fn apply<F: Fn(T, T) -> U + Sync>(self, f: F) {
        // Indexed, with the bounds checked once up front: a few elements
        // take a plain loop, longer runs a vectorised one.
        let n = self.out.len();
        let (a, b) = (&self.a[..n], &self.b[..n]);
        for i in 0..n {
            self.out[i] = f(a[i], b[i]);
        }
    }
}

fn binary_arith<T: Num>(op: BinaryOp, a: &[T], la: &Layout, b: &[T], lb: &Layout, out: &mut CpuBuffer, threads: usize) {
    arith_with(op, Mapped2 { a, la, b, lb, out: slice_mut(out), threads })
}

fn compare<T: Num>(op: BinaryOp, a: &[T], la: &Layout, b: &[T], lb: &Layout, out: &mut [u8], threads: usize) {
    compare_with(op, Mapped2 { a, la, b, lb, out, threads })
}

#[inline(always)]
fn arith_with<T: Num, A: Apply2<T, T>>(op: BinaryOp, a: A) {
    match op {
        BinaryOp::Add => a.apply(|x: T, y: T| x.add(y)),
        BinaryOp::Sub => a.apply(|x: T, y: T| x.sub(y)),
        BinaryOp::Mul => a.apply(|x: T, y: T| x.mul(y)),
        BinaryOp::Div => a.apply(|x: T, y: T| x.div(y)),
        BinaryOp::Pow => a.apply(|x: T, y: T| x.pow(y)),
        BinaryOp::Maximum => a.apply(|x: T, y: T| x.max(y)),
        BinaryOp::Minimum => a.apply(|x: T, y: T| x.min(y)),
        _ => unreachable!(),
    }
}

#[inline(always)]
fn compare_with<T: Num, A: Apply2<T, u8>>(op: BinaryOp, a: A) {
    match op {
        BinaryOp::Eq => a.apply(|x: T, y: T| (x == y) as u8),
        BinaryOp::Ne => a.apply(|x: T, y: T| (x != y) as u8),
        BinaryOp::Lt => a.apply(|x: T, y: T| (x < y) as u8),
        BinaryOp::Le => a.apply(|x: T, y: T| (x <= y) as u8),
        BinaryOp::Gt => a.apply(|x: T, y: T| (x > y) as u8),
        BinaryOp::Ge => a.apply(|x: T, y: T| (x >= y) as u8),
        _ => unreachable!(),
    }
}

/// The typed elements of a host buffer whose dtype the caller knows.
fn slice_mut<T: WithDType>(b: &mut CpuBuffer) -> &mut [T] {
    let len = b.len();
    assert_eq!(b.dtype(), T::DTYPE, "kernel dtype validated by the front end");
    let ptr = map_buffer!(b, v => v.as_mut_ptr() as *mut T);
    // SAFETY: the dtype check above guarantees the buffer holds `len` values of T.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}

/// Sum of a dense run, accumulated in f64 for floats so that the result
/// hardly depends on how the work was split.
#[inline(always)]
fn dense_sum<T: Num>(s: &[T]) -> f64 {
    if T::DTYPE == crate::DType::F32 {
        // SAFETY: the dtype check says T is f32.
        return dense_sum_f32(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len()) });
    }
    let mut acc = [0f64; 4];
    let chunks = s.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..4 {
            acc[j] += c[j].to_f64();
        }
    }
    let mut total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for &x in rest {
        total += x.to_f64();
    }
    total
}

/// f32 sum: 8 f64 lanes (every element widened once), so that 2^20 values
/// of 0.1 sum to 104857.6 as in numpy and PyTorch; f32 lanes drift by a few
/// ulps (104857.57), and memory bandwidth, not the adds, bounds the speed.
fn dense_sum_f32(s: &[f32]) -> f64 {
    const LANES: usize = 8;
    let mut acc = [0f64; LANES];
    let chunks = s.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] += c[j] as f64;
        }
    }
    let mut total = acc.iter().sum::<f64>();
    for &x in rest {
        total += x as f64;
    }
    total
}

fn reduce<T: Num>(op: ReduceOp, s: &[T], l: &Layout, dims: &[usize], out: &mut [T], threads: usize) {
    let rank = l.dims().len();
    let init = match op {
        ReduceOp::Sum => T::ZERO,
        ReduceOp::Max => T::LOWEST,
        _ => T::HIGHEST,
    };
    if l.elem_count() == 0 {
        // Nothing to combine, and an empty layout's strides may be
        // meaningless (saturated): never walk them.
        out.fill(init);
        return;
    }
    let combine = |a: T, b: T| match op {
        ReduceOp::Sum => a.add(b),
        ReduceOp::Max => a.max(b),
        _ => a.min(b),
    };
    // Everything, dense: one pass, parallel for big inputs.
    if out.len() == 1 {
        if let Some((a, b)) = l.contiguous_range() {
            let s = &s[a..b];
            // Integer sums wrap like every other integer op: through f64 a
            // u8 sum would saturate and an i64 one lose bits above 2^53.
            out[0] = if op == ReduceOp::Sum && T::DTYPE.is_float() {
                let total = if threads > 1 && s.len() >= PAR_MIN {
                    on_pool(|| s.par_chunks(CHUNK).map(dense_sum).sum::<f64>())
                } else {
                    dense_sum(s)
                };
                T::from_f64(total)
            } else if threads > 1 && s.len() >= PAR_MIN {
                on_pool(|| s.par_chunks(CHUNK).map(|c| c.iter().fold(init, |a, &b| combine(a, b))).reduce(|| init, combine))
            } else {
                s.iter().fold(init, |a, &b| combine(a, b))
            };
            return;
        }
    }
    out.fill(init);
    if rank == 0 {
        out[0] = combine(init, s[l.offset]);
        return;
    }
    // Where each source element lands: the output's strides with 0 on the
    // reduced dimensions.
    let out_dims: Dims = (0..rank).map(|d| if dims.contains(&d) { 1 } else { l.dims()[d] }).collect();
    let out_strides = crate::Shape(out_dims).strides();
    let bcast_strides: Dims = (0..rank).map(|d| if dims.contains(&d) { 0 } else { out_strides[d] }).collect();
    let out_layout = Layout { shape: l.shape.clone(), strides: bcast_strides, offset: 0 };
    let (l, out_layout) = simplify_pair(l, &out_layout);
    let (so, n, ss) = rows(&l);
    let (oo, _, os) = rows(&out_layout);
    let rows_count = l.elem_count() / n.max(1);
    let sum_in_f64 = op == ReduceOp::Sum && T::DTYPE.is_float();
    if sum_in_f64 && os != 0 {
        // A float sum over a non-last dimension: accumulate every output in
        // f64 (in f32, 2^20 rows of 0.1 drift to 105891.84).
        let mut acc = vec![0f64; out.len()];
        for r in 0..rows_count {
            let (ps, po) = (row_start(&so, r), row_start(&oo, r));
            for j in 0..n {
                acc[po + j * os] += s[ps + j * ss].to_f64();
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = T::from_f64(a);
        }
        return;
    }
    for r in 0..rows_count {
        let (ps, po) = (row_start(&so, r), row_start(&oo, r));
        if os == 0 {
            // The last dimension is reduced: fold the row into one value.
            let v = if ss == 1 {
                let row = &s[ps..ps + n];
                if sum_in_f64 {
                    T::from_f64(dense_sum(row))
                } else {
                    row.iter().fold(init, |a, &b| combine(a, b))
                }
            } else {
                (0..n).fold(init, |a, j| combine(a, s[ps + j * ss]))
            };
            out[po] = combine(out[po], v);
        } else {
            for j in 0..n {
                out[po + j] = combine(out[po + j], s[ps + j * ss]);
            }
        }
    }
}

fn arg_reduce<T: Num>(s: &[T], l: &Layout, dim: usize, out: &mut [i64], max: bool) {
    let n = l.dims()[dim];
    if n == 0 {
        // The front end refuses an arg-reduction over an empty dimension;
        // index 0 rather than a read out of bounds should one get here.
        out.fill(0);
        return;
    }
    let stride = l.strides[dim];
    let base = l.narrow(dim, 0, 1);
    for (o, b) in out.iter_mut().zip(base.offsets()) {
        let mut best = s[b];
        let mut idx = 0;
        // NaN wins, the first one (PyTorch and numpy): `v != v` only for NaN.
        #[allow(clippy::eq_op)]
        if best == best {
            for i in 1..n {
                let v = s[b + i * stride];
                #[allow(clippy::eq_op)]
                if v != v {
                    idx = i;
                    break;
                }
                if (max && v > best) || (!max && v < best) {
                    best = v;
                    idx = i;
                }
            }
        }
        *o = idx as i64;
    }
}

/// Offsets of each matrix of a batched operand.
fn batch_offsets(l: &Layout) -> SmallVec<[usize; 4]> {
    let r = l.dims().len();
    if r == 2 {
        return smallvec::smallvec![l.offset];
    }
    let batch = Layout { shape: crate::Shape::from(&l.dims()[..r - 2]), strides: Dims::from_slice(&l.strides[..r - 2]), offset: l.offset };
    batch.offsets().collect()
}

fn matmul_gemm<T: WithDType + 'static>(
    a: &[T],
    la: &Layout,
    b: &[T],
    lb: &Layout,
    out: &mut [T],
    (m, n, k): (usize, usize, usize),
    threads: usize,
) {
    let r = la.dims().len();
    let (a_rs, a_cs) = (la.strides[r - 2] as isize, la.strides[r - 1] as isize);
    let (b_rs, b_cs) = (lb.strides[r - 2] as isize, lb.strides[r - 1] as isize);
    let par = if threads > 1 && m * n * k >= MATMUL_PAR_MIN { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    let (zero, one) = (T::from_f64(0.0), T::from_f64(1.0));
    if k == 0 {
        out.fill(zero);
        return;
    }
    let mut products = || {
        for (bi, (oa, ob)) in batch_offsets(la).into_iter().zip(batch_offsets(lb)).enumerate() {
            let dst = &mut out[bi * m * n..(bi + 1) * m * n];
            // SAFETY: the front end checked that every index the strides reach
            // lies inside the operands' storages, and `dst` holds m·n elements.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    dst.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr().add(oa),
                    a_cs,
                    a_rs,
                    b.as_ptr().add(ob),
                    b_cs,
                    b_rs,
                    zero,
                    one,
                    false,
                    false,
                    false,
                    par,
                );
            }
        }
    };
    // gemm's threads are those of the pool it is called in: kiln's own.
    if matches!(par, gemm::Parallelism::None) {
        products()
    } else {
        on_pool(products)
    }
}

fn matmul_naive<T: Num>(a: &[T], la: &Layout, b: &[T], lb: &Layout, out: &mut [T], (m, n, k): (usize, usize, usize)) {
    let r = la.dims().len();
    let (a_rs, a_cs) = (la.strides[r - 2], la.strides[r - 1]);
    let (b_rs, b_cs) = (lb.strides[r - 2], lb.strides[r - 1]);
    for (bi, (oa, ob)) in batch_offsets(la).into_iter().zip(batch_offsets(lb)).enumerate() {
        for i in 0..m {
            for j in 0..n {
                let mut acc = T::ZERO;
                for p in 0..k {
                    acc = acc.add(a[oa + i * a_rs + p * a_cs].mul(b[ob + p * b_rs + j * b_cs]));
                }
                out[bi * m * n + i * n + j] = acc;
            }
        }
    }
}

/// Converts between element types; f16/bf16 go through f32, which is exact.
trait Convert<U> {
    fn convert(self) -> U;
}
macro_rules! convert_via_f64 {
    ($($from:ty),*) => { $(
        impl<U: WithDType> Convert<U> for $from {
            #[inline(always)]
            fn convert(self) -> U {
                U::from_f64(self.to_f64())
            }
        }
    )* };
}
convert_via_f64!(f32, f64, f16, bf16);
// Integers convert as numpy and PyTorch do: one rounding to a float (through
// f64 an i64 above 2^53 would round twice), wrapping to a narrower integer.
macro_rules! convert_via_i64 {
    ($($from:ty),*) => { $(
        impl<U: WithDType> Convert<U> for $from {
            #[inline(always)]
            fn convert(self) -> U {
                U::from_i64(self as i64)
            }
        }
    )* };
}
convert_via_i64!(i64, i32, u8);

fn copy_typed<T: WithDType + Convert<U>, U: WithDType>(s: &[T], ls: &Layout, d: &mut [U], ld: &Layout) {
    if T::DTYPE == U::DTYPE {
        // Same dtype: copy the values bit for bit (through f64 an i64 above
        // 2^53 would lose its low bits).
        // SAFETY: same dtype, so T and U are the same type.
        let s: &[U] = unsafe { std::slice::from_raw_parts(s.as_ptr() as *const U, s.len()) };
        if let (Some((a0, a1)), Some((b0, b1))) = (ls.contiguous_range(), ld.contiguous_range()) {
            d[b0..b1].copy_from_slice(&s[a0..a1]);
        } else {
            for (i, j) in ls.offsets().zip(ld.offsets()) {
                d[j] = s[i];
            }
        }
        return;
    }
    for (i, j) in ls.offsets().zip(ld.offsets()) {
        d[j] = s[i].convert();
    }
}

fn copy_cast(src: &CpuBuffer, ls: &Layout, dst: &mut CpuBuffer, ld: &Layout) {
    macro_rules! to {
        ($s:expr) => {
            match dst {
                CpuBuffer::F32(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::F64(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::I64(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::I32(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::U8(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::F16(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::BF16(d) => copy_typed($s, ls, d, ld),
            }
        };
    }
    match src {
        CpuBuffer::F32(s) => to!(s),
        CpuBuffer::F64(s) => to!(s),
        CpuBuffer::I64(s) => to!(s),
        CpuBuffer::I32(s) => to!(s),
        CpuBuffer::U8(s) => to!(s),
        CpuBuffer::F16(s) => to!(s),
        CpuBuffer::BF16(s) => to!(s),
    }
}

fn split_at_dim(dims: &[usize], dim: usize) -> (usize, usize, usize) {
    (dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product())
}

fn index_select<T: Copy + Default>(s: &[T], dims: &[usize], ids: &[usize], dim: usize, out: &mut [T]) {
    let (outer, d, inner) = split_at_dim(dims, dim);
    let mut o = 0;
    for i in 0..outer {
        for &id in ids {
            // Out-of-range indices (only possible for indices that live on a
            // GPU, which the front end does not read back) select nothing.
            if id < d {
                let start = (i * d + id) * inner;
                out[o..o + inner].copy_from_slice(&s[start..start + inner]);
            } else {
                out[o..o + inner].fill(T::default());
            }
            o += inner;
        }
    }
}

fn index_add<T: Num>(s: &[T], dims: &[usize], ids: &[usize], dim: usize, out: &mut [T]) {
    let (outer, n, inner) = split_at_dim(dims, dim);
    let d = out.len() / (outer * inner).max(1);
    for i in 0..outer {
        for (j, &id) in ids.iter().enumerate().take(n) {
            if id >= d {
                continue;
            }
            let src = (i * n + j) * inner;
            let dst = (i * d + id) * inner;
            for q in 0..inner {
                out[dst + q] = out[dst + q].add(s[src + q]);
            }
        }
    }
}

fn index_add_half<T: WithDType>(s: &[T], dims: &[usize], ids: &[usize], dim: usize, out: &mut [T]) {
    let (outer, n, inner) = split_at_dim(dims, dim);
    let d = out.len() / (outer * inner).max(1);
    for i in 0..outer {
        for (j, &id) in ids.iter().enumerate().take(n) {
            if id >= d {
                continue;
            }
            let src = (i * n + j) * inner;
            let dst = (i * d + id) * inner;
            for q in 0..inner {
                out[dst + q] = T::from_f64((out[dst + q].to_f64() as f32 + s[src + q].to_f64() as f32) as f64);
            }
        }
    }
}

fn select<T: Copy>(mask: &[bool], a: &[T], la: &Layout, b: &[T], lb: &Layout, out: &mut [T]) {
    for (((o, &m), i), j) in out.iter_mut().zip(mask).zip(la.offsets()).zip(lb.offsets()) {
        *o = if m { a[i] } else { b[j] };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_f32_never_returns_the_upper_bound() {
        // With the default seed, counter 28,064,142 draws u >= 1 - 2^-25,
        // which rounds to 1.0 in f32.
        let (seed, index) = (rng::DEFAULT_SEED, 28_064_142);
        assert!((rng::uniform(seed, index) as f32) >= 1.0, "the chosen counter must be a rounding case");
        let mut v = [0f32; 1];
        random(&mut v, seed, index, Distribution::Uniform { lo: 0.0, hi: 1.0 }, 1);
        assert!(v[0] < 1.0, "got {}", v[0]);
    }
}
