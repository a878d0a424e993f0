//! Element types. f32 is the default; f16 and bf16 are for storage and
//! conversion (compute in f32), u8 doubles as bool (comparisons return it).

use half::{bf16, f16};

/// The element type of a tensor.
///
/// ```
/// use kiln::DType;
/// assert_eq!(DType::F32.size_in_bytes(), 4);
/// assert_eq!(DType::BF16.to_string(), "bf16");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// 32-bit float, the default.
    F32,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer (indices, labels).
    I64,
    /// 32-bit signed integer: Rust's default integer literal, so
    /// `Tensor::new(&[1, 2, 3], &cpu())` is an i32 tensor.
    I32,
    /// Unsigned byte; also the result of comparisons (0 or 1).
    U8,
    /// IEEE half precision (storage and conversion).
    F16,
    /// bfloat16 (storage and conversion).
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// True for f16, bf16, f32, f64.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I64 | DType::I32 | DType::U8)
    }
    /// The dtype arithmetic runs in: half types compute in f32.
    pub fn compute(self) -> DType {
        match self {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        }
    }
    /// PyTorch's category of a dtype: 0 integer (u8 included: kiln has no
    /// bool dtype), 1 floating point.
    fn category(self) -> u8 {
        u8::from(self.is_float())
    }

    /// The smallest dtype both `self` and `other` convert to without
    /// leaving their category, as `torch.promote_types`: integers widen
    /// (u8 with i32 is i32, with i64 i64; i32 with i64 i64), an integer
    /// with a float is the float, floats widen, and f16 with bf16 is f32
    /// (neither holds the other). Symmetric; `x.promote(x) == x`.
    ///
    /// | | u8 | i32 | i64 | f16 | bf16 | f32 | f64 |
    /// | --- | --- | --- | --- | --- | --- | --- | --- |
    /// | **u8** | u8 | i32 | i64 | f16 | bf16 | f32 | f64 |
    /// | **i32** | i32 | i32 | i64 | f16 | bf16 | f32 | f64 |
    /// | **i64** | i64 | i64 | i64 | f16 | bf16 | f32 | f64 |
    /// | **f16** | f16 | f16 | f16 | f16 | f32 | f32 | f64 |
    /// | **bf16** | bf16 | bf16 | bf16 | f32 | bf16 | f32 | f64 |
    /// | **f32** | f32 | f32 | f32 | f32 | f32 | f32 | f64 |
    /// | **f64** | f64 | f64 | f64 | f64 | f64 | f64 | f64 |
    ///
    /// ```
    /// use kiln::DType;
    /// assert_eq!(DType::U8.promote(DType::I32), DType::I32);
    /// assert_eq!(DType::I64.promote(DType::F16), DType::F16);
    /// assert_eq!(DType::F16.promote(DType::BF16), DType::F32);
    /// assert_eq!(DType::F32.promote(DType::F64), DType::F64);
    /// ```
    pub fn promote(self, other: DType) -> DType {
        use DType::*;
        match (self, other) {
            (a, b) if a == b => a,
            (F16, BF16) | (BF16, F16) => F32,
            (a, b) if a.category() != b.category() => {
                if a.is_float() {
                    a
                } else {
                    b
                }
            }
            // Same category: the wider (integers: u8 < i32 < i64; floats:
            // f16, bf16 < f32 < f64, the pair of halves handled above).
            (a, b) => {
                if a.rank_in_category() >= b.rank_in_category() {
                    a
                } else {
                    b
                }
            }
        }
    }

    /// Width order within a category (see [`promote`](Self::promote)).
    fn rank_in_category(self) -> u8 {
        match self {
            DType::U8 => 0,
            DType::I32 => 1,
            DType::I64 => 2,
            DType::F16 | DType::BF16 => 0,
            DType::F32 => 1,
            DType::F64 => 2,
        }
    }

    /// The dtype of an op between tensors of these dtypes and ranks, as
    /// `torch.result_type`: the dimensioned operands (rank ≥ 1) promote
    /// among themselves, the 0-d ones among themselves, and a 0-d operand
    /// only changes the result when it is of a higher category (a float
    /// 0-d tensor with integer tensors): a 0-d tensor counts as a scalar
    /// for dtype purposes, as in PyTorch. Every op with more than one
    /// tensor operand decides its dtype here (arithmetic, comparisons,
    /// `where_cond`, `cat`/`stack`, `maximum`/`minimum`, `pow`); the table
    /// of [`promote`](Self::promote) gives the pairs.
    ///
    /// | operands | result |
    /// | --- | --- |
    /// | u8 `[3]`, i32 `[3]` | i32 |
    /// | i64 `[3]`, f16 `[3]` | f16 |
    /// | f16 `[3]`, bf16 `[3]` | f32 |
    /// | f32 `[3]`, f64 `[]` (0-d) | f32: same category, the dimensioned one wins |
    /// | i32 `[3]`, f64 `[]` (0-d) | f64: the 0-d one is of a higher category |
    /// | u8 `[3]`, i64 `[]` (0-d) | u8 |
    /// | u8 `[]`, i32 `[]` (both 0-d) | i32 |
    ///
    /// Returns `None` for no operands.
    ///
    /// ```
    /// use kiln::DType;
    /// assert_eq!(DType::result_type(&[(DType::F32, 1), (DType::F64, 0)]), Some(DType::F32));
    /// assert_eq!(DType::result_type(&[(DType::I32, 2), (DType::F64, 0)]), Some(DType::F64));
    /// assert_eq!(DType::result_type(&[(DType::U8, 1), (DType::I64, 0)]), Some(DType::U8));
    /// ```
    pub fn result_type(operands: &[(DType, usize)]) -> Option<DType> {
        let fold = |zero_d: bool| operands.iter().filter(|(_, rank)| (*rank == 0) == zero_d).map(|(d, _)| *d).reduce(DType::promote);
        match (fold(false), fold(true)) {
            (Some(dim), Some(zero)) => Some(if zero.category() > dim.category() { dim.promote(zero) } else { dim }),
            (dim, zero) => dim.or(zero),
        }
    }

    /// The name used in safetensors files.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::U8 => "U8",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
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
    fn into_buffer(v: Vec<Self>) -> crate::base::buffer::CpuBuffer;
    /// Borrows the elements if the buffer has this dtype.
    fn slice(b: &crate::base::buffer::CpuBuffer) -> Option<&[Self]>;
    /// Takes the elements if the buffer has this dtype.
    fn from_buffer(b: crate::base::buffer::CpuBuffer) -> Option<Vec<Self>>;
    /// Borrows the elements mutably if the buffer has this dtype.
    fn slice_mut(b: &mut crate::base::buffer::CpuBuffer) -> Option<&mut [Self]>;
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
            fn into_buffer(v: Vec<Self>) -> crate::base::buffer::CpuBuffer {
                crate::base::buffer::CpuBuffer::$variant(v)
            }
            fn slice(b: &crate::base::buffer::CpuBuffer) -> Option<&[Self]> {
                match b {
                    crate::base::buffer::CpuBuffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn from_buffer(b: crate::base::buffer::CpuBuffer) -> Option<Vec<Self>> {
                match b {
                    crate::base::buffer::CpuBuffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(b: &mut crate::base::buffer::CpuBuffer) -> Option<&mut [Self]> {
                match b {
                    crate::base::buffer::CpuBuffer::$variant(v) => Some(v),
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
