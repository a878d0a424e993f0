//! The arithmetic of host kernels, one trait per kind of dtype: [`Num`] for
//! every numeric dtype (integers wrap; integer division by zero is 0), and
//! [`Float`] for f32 and f64. Ops name the functions they compute through
//! these, so an op's host kernel is one expression for every dtype.

use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::map_buffer;
use half::{bf16, f16};

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
    /// √x: a reduction's `finish` (the norm's), which every accumulator
    /// type must have. Integers give the floor of the root of a non-negative
    /// value and 0 for a negative one (the norm refuses integers, so no op
    /// of kiln takes this path).
    fn square_root(self) -> Self;
}

/// Functions only floats have.
pub(crate) trait Float: Num {
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
    /// `f` for an f32, `g` for an f64: how an op names a function that has
    /// no method here (`x.via(libm::erff, libm::erf)`).
    #[allow(dead_code)]
    fn via(self, f: fn(f32) -> f32, g: fn(f64) -> f64) -> Self;
}

macro_rules! float_num {
    ($t:ty, $via:expr) => {
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
            #[inline(always)]
            fn square_root(self) -> Self {
                <$t>::sqrt(self)
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
            #[inline(always)]
            fn via(self, f: fn(f32) -> f32, g: fn(f64) -> f64) -> Self {
                let pick: fn(Self, fn(f32) -> f32, fn(f64) -> f64) -> Self = $via;
                pick(self, f, g)
            }
        }
    };
}
float_num!(f32, |x, f, _| f(x));
float_num!(f64, |x, _, g| g(x));

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
            #[inline(always)]
            fn square_root(self) -> Self {
                (self as f64).max(0.0).sqrt() as $t
            }
        }
    };
}
int_num!(i64, |x: i64| x.wrapping_abs(), |x: i64| x.wrapping_neg());
int_num!(i32, |x: i32| x.wrapping_abs(), |x: i32| x.wrapping_neg());
int_num!(u8, |x: u8| x, |x: u8| x.wrapping_neg());

/// The type a reduction accumulates in: f64 for floats (so that a sum
/// hardly depends on how the work was split), the dtype itself for
/// integers (they wrap like every integer op).
pub(crate) trait Accumulate: Num {
    type Acc: Num;
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
}

macro_rules! accumulate {
    ($t:ty => $a:ty) => {
        impl Accumulate for $t {
            type Acc = $a;
            #[inline(always)]
            fn widen(self) -> $a {
                self as $a
            }
            #[inline(always)]
            fn narrow(a: $a) -> $t {
                a as $t
            }
        }
    };
}
accumulate!(f32 => f64);
accumulate!(f64 => f64);
accumulate!(i64 => i64);
accumulate!(i32 => i32);
accumulate!(u8 => u8);

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

/// Converts between element types; f16/bf16 go through f32, which is exact.
pub(crate) trait Convert<U> {
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

/// The typed elements of a host buffer, when its dtype is `T`.
#[inline]
pub(crate) fn slice_of<T: WithDType>(b: &mut CpuBuffer) -> Option<&mut [T]> {
    if b.dtype() != T::DTYPE {
        return None;
    }
    let len = b.len();
    let ptr = map_buffer!(b, v => v.as_mut_ptr() as *mut T);
    // SAFETY: the dtype check above guarantees the buffer holds `len` values of T.
    Some(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}

/// The typed elements of a host buffer read-only, when its dtype is `T`.
#[inline]
pub(crate) fn elems<T: WithDType>(b: &CpuBuffer) -> Option<&[T]> {
    if b.dtype() != T::DTYPE {
        return None;
    }
    let len = b.len();
    let ptr = map_buffer!(b, v => v.as_ptr() as *const T);
    // SAFETY: as `slice_of`.
    Some(unsafe { std::slice::from_raw_parts(ptr, len) })
}
