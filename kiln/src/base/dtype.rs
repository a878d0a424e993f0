//! Element types. f32 is the default; f16 and bf16 are for storage and
//! conversion (compute in f32), u8 doubles as bool (comparisons return it).

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
