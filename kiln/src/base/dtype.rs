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
