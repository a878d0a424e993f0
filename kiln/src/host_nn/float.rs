//! The element types of the host kernels: f32 and f64.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// A float the host kernels compute in (f32 or f64). f16 and bf16 go through
/// f32 in the caller: their products and sums are rounded to f32 anyway on
/// a CPU without native half arithmetic, so converting at the edges loses
/// nothing against computing in halves.
pub trait NnFloat:
    Copy
    + Send
    + Sync
    + Default
    + Debug
    + PartialEq
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + 'static
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// −∞, where a max starts.
    const NEG_INFINITY: Self;
    /// Whether this is f32 (the type the SIMD kernels specialise).
    const IS_F32: bool;
    /// The nearest value to `v`.
    fn from_f64(v: f64) -> Self;
    /// The exact value as f64.
    fn to_f64(self) -> f64;
    /// `n` as this type (rounded when huge).
    fn from_usize(n: usize) -> Self {
        Self::from_f64(n as f64)
    }
    /// Square root.
    fn sqrt(self) -> Self;
    /// Largest integer not above.
    fn floor(self) -> Self;
    /// Whether this is NaN.
    #[allow(clippy::wrong_self_convention)]
    fn is_nan(self) -> bool;
    /// Whether this is neither infinite nor NaN.
    #[allow(clippy::wrong_self_convention)]
    fn is_finite(self) -> bool;
    /// The larger of the two (`other` when `self` is NaN, as `f32::max`).
    fn max(self, other: Self) -> Self;
    /// The smaller of the two.
    fn min(self, other: Self) -> Self;
    /// As f32 slices, when this is f32 (for the SIMD kernels).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// As mutable f32 slices, when this is f32.
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
}

macro_rules! nn_float {
    ($t:ty, $is_f32:expr, $as:expr, $as_mut:expr) => {
        impl NnFloat for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const IS_F32: bool = $is_f32;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn floor(self) -> Self {
                <$t>::floor(self)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            #[inline(always)]
            fn min(self, other: Self) -> Self {
                <$t>::min(self, other)
            }
            #[inline(always)]
            fn as_f32(s: &[Self]) -> Option<&[f32]> {
                let f: fn(&[$t]) -> Option<&[f32]> = $as;
                f(s)
            }
            #[inline(always)]
            fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
                let f: fn(&mut [$t]) -> Option<&mut [f32]> = $as_mut;
                f(s)
            }
        }
    };
}

nn_float!(f32, true, |s| Some(s), |s| Some(s));
nn_float!(f64, false, |_| None, |_| None);
