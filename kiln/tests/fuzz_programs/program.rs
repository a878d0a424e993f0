//! Random programs: the seeded generator, the steps a program is made of,
//! and the shapes, dtypes and ops it draws from.

use super::*;

/// SplitMix64: small, seedable, good enough to pick program steps.
pub(crate) use crate::common::rng::{Draw, SplitMix as Rng};

pub(crate) const DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16];
/// The dtypes an index tensor may have.
pub(crate) const INDEX_DTYPES: [DType; 3] = [DType::I64, DType::I32, DType::U8];
pub(crate) const HUGE: [usize; 5] = [1 << 33, 1 << 40, 1 << 62, 1 << 63, usize::MAX];

pub(crate) fn dim(rng: &mut Rng) -> usize {
    if rng.chance(6) {
        rng.pick(&HUGE)
    } else {
        rng.pick(&[0, 1, 1, 2, 2, 3, 3, 4, 5, 7])
    }
}

/// Elements of a shape, saturating (the fuzzer's own arithmetic must not
/// overflow on the huge dimensions it makes).
pub(crate) fn count(dims: &[usize]) -> usize {
    if dims.contains(&0) {
        0
    } else {
        dims.iter().fold(1usize, |a, &d| a.saturating_mul(d))
    }
}

pub(crate) fn shape(rng: &mut Rng) -> Vec<usize> {
    let rank = rng.pick(&[0, 1, 1, 2, 2, 2, 3, 3, 4]);
    let mut dims: Vec<usize> = (0..rank).map(|_| dim(rng)).collect();
    // A huge dimension mostly comes with a zero one: a valid empty tensor
    // whose strides would overflow. Otherwise the shape is made certainly too
    // large for any host (a 16 GiB tensor would be allocated lazily and then
    // really touched by later steps).
    if let Some(i) = dims.iter().position(|&d| d > 1 << 20) {
        if rng.chance(80) {
            let z = rng.below(dims.len());
            dims[z] = 0;
        } else if count(&dims) < 1 << 42 {
            dims[i] = 1 << 62;
        }
    }
    dims
}

/// One step of a program; operands name earlier values by index.
#[derive(Clone, Debug)]
pub(crate) enum Step {
    Create {
        dims: Vec<usize>,
        dtype: DType,
        how: u8,
        value: f64,
    },
    FromValues {
        dims: Vec<usize>,
        dtype: DType,
        values: Vec<f64>,
    },
    /// A use of a device that does not exist, `which` of three: an index
    /// far beyond the limit, `usize::MAX`, and the next unused index.
    NoSuchDevice {
        dims: Vec<usize>,
        dtype: DType,
        which: u8,
        how: u8,
    },
    /// `to`/`copy_to` of an operand onto a device that does not exist.
    ToMissing {
        a: usize,
        which: u8,
        copy: bool,
    },
    Unary {
        a: usize,
        op: UnaryOp,
    },
    Binary {
        a: usize,
        b: usize,
        op: BinaryOp,
    },
    Reduce {
        a: usize,
        op: Reduction,
        dim: i64,
        keepdim: bool,
    },
    ReduceAll {
        a: usize,
        which: u8,
    },
    Matmul {
        a: usize,
        b: usize,
    },
    /// `cumsum` along a dimension (signed, possibly out of range).
    CumSum {
        a: usize,
        dim: i64,
    },
    /// A composite, `which` of gelu, gelu_tanh, silu, logsumexp, var, std
    /// (the last three along `dim`).
    Composite {
        a: usize,
        which: u8,
        dim: i64,
    },
    Transpose {
        a: usize,
        d0: i64,
        d1: i64,
    },
    Narrow {
        a: usize,
        dim: i64,
        start: usize,
        len: usize,
    },
    Reshape {
        a: usize,
        dims: Vec<usize>,
    },
    Broadcast {
        a: usize,
        dims: Vec<usize>,
    },
    Unsqueeze {
        a: usize,
        dim: i64,
    },
    Squeeze {
        a: usize,
        dim: i64,
    },
    FlattenFrom {
        a: usize,
        from: i64,
    },
    Permute {
        a: usize,
        perm: Vec<i64>,
    },
    Cat {
        a: usize,
        b: usize,
        dim: i64,
    },
    Stack {
        a: usize,
        b: usize,
        dim: i64,
    },
    IndexSelect {
        a: usize,
        ids: Vec<i64>,
        ids_dtype: DType,
        dim: i64,
    },
    IndexAdd {
        a: usize,
        src: usize,
        ids: Vec<i64>,
        ids_dtype: DType,
        dim: i64,
    },
    /// An index or label out of range (`which`: index_select, index_add,
    /// one_hot, cross_entropy): the CPU raises at the call, a GPU reports it
    /// at the next synchronising call.
    BadIndex {
        a: usize,
        which: u8,
        value: i64,
        dim: i64,
    },
    /// gather (mode 0), scatter (1) or scatter_add (2) along `dim` with an
    /// index of `a`'s rank, `k` long along `dim`, made of `ids` (in range).
    Gather {
        a: usize,
        src: usize,
        dim: i64,
        ids: Vec<i64>,
        ids_dtype: DType,
        mode: u8,
        k: usize,
    },
    /// sort's values (which 0), argsort (1), topk's values (2) or indices (3).
    Sort {
        a: usize,
        dim: i64,
        descending: bool,
        which: u8,
        k: usize,
    },
    /// Range indexing `a.i(...)`: per selector (kind, start, end).
    Slice {
        a: usize,
        sels: Vec<(u8, i64, i64)>,
    },
    Where {
        c: usize,
        a: usize,
        b: usize,
    },
    Cast {
        a: usize,
        dtype: DType,
    },
    Contiguous {
        a: usize,
    },
    Assign {
        dst: usize,
        src: usize,
    },
    RoundTrip {
        a: usize,
    },
    Print {
        a: usize,
    },
    ToVec2 {
        a: usize,
    },
}

pub(crate) const UNARY: [UnaryOp; 23] = [
    UnaryOp::Erf,
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sqrt,
    UnaryOp::Sqr,
    UnaryOp::Recip,
    UnaryOp::Sin,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Relu,
    UnaryOp::Powi(3),
    UnaryOp::Powi(-2),
    UnaryOp::Powf(0.5),
    UnaryOp::AddScalar(-1.0),
    UnaryOp::SubScalar(2.5),
    UnaryOp::MulScalar(3.0),
    UnaryOp::DivScalar(0.0),
    UnaryOp::RDivScalar(1.0),
    UnaryOp::MaxScalar(0.5),
    UnaryOp::MinScalar(f64::NAN),
    UnaryOp::Affine(2.0, -1.0),
];
pub(crate) const BINARY: [BinaryOp; 15] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::SigmoidBackward,
    BinaryOp::TanhBackward,
    BinaryOp::Maximum,
    BinaryOp::Minimum,
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
];
pub(crate) const REDUCE: [Reduction; 8] = [
    Reduction::Sum,
    Reduction::Max,
    Reduction::Min,
    Reduction::Prod,
    Reduction::SumSquares,
    Reduction::Norm,
    Reduction::ArgMax,
    Reduction::ArgMin,
];

/// A dimension from −5 to 4: every valid one of ranks up to 4, counted from
/// either end, and the out-of-range ones on both sides.
pub(crate) fn signed_dim(rng: &mut Rng) -> i64 {
    rng.below(10) as i64 - 5
}

pub(crate) fn value(rng: &mut Rng) -> f64 {
    rng.pick(&[0.0, 1.0, -1.0, 2.5, -3.0, 0.1, 300.0, -7.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e30, 65504.0])
}

pub(crate) fn program(rng: &mut Rng) -> Vec<Step> {
    let len = 2 + rng.below(8);
    let mut steps = Vec::new();
    for i in 0..len {
        // Operands are earlier values; the first steps create some.
        let any = |rng: &mut Rng| rng.below(i.max(1));
        let step = if i < 2 || rng.chance(15) {
            if rng.chance(40) {
                let dims = shape(rng);
                let n: usize = count(&dims).min(64);

                let values = (0..n).map(|_| value(rng)).collect();
                Step::FromValues { dims, dtype: rng.pick(&DTYPES), values }
            } else if rng.chance(4) {
                Step::NoSuchDevice { dims: shape(rng), dtype: rng.pick(&DTYPES), which: rng.below(3) as u8, how: rng.below(14) as u8 }
            } else {
                Step::Create { dims: shape(rng), dtype: rng.pick(&DTYPES), how: rng.below(6) as u8, value: value(rng) }
            }
        } else {
            let a = any(rng);
            match rng.below(33) {
                0 | 1 => Step::Unary { a, op: rng.pick(&UNARY) },
                2..=4 => Step::Binary { a, b: any(rng), op: rng.pick(&BINARY) },
                5 => Step::Reduce { a, op: rng.pick(&REDUCE), dim: signed_dim(rng), keepdim: rng.chance(50) },
                6 => Step::ReduceAll { a, which: rng.below(5) as u8 },
                7 => Step::Matmul { a, b: any(rng) },
                8 => Step::Transpose { a, d0: signed_dim(rng), d1: signed_dim(rng) },
                9 => {
                    let start = if rng.chance(10) { rng.pick(&HUGE) } else { rng.below(5) };
                    Step::Narrow { a, dim: signed_dim(rng), start, len: rng.below(4) }
                }
                10 => Step::Reshape { a, dims: shape(rng) },
                11 => {
                    // A broadcast view of 2^62 elements is valid, but any
                    // reduction over it would run for years (as in PyTorch):
                    // views stay small unless empty.
                    let mut dims = shape(rng);
                    if count(&dims) > 1 << 20 {
                        let z = rng.below(dims.len());
                        dims[z] = 0;
                    }
                    Step::Broadcast { a, dims }
                }
                12 => Step::Unsqueeze { a, dim: signed_dim(rng) },
                13 => Step::Squeeze { a, dim: signed_dim(rng) },
                14 => Step::FlattenFrom { a, from: signed_dim(rng) },
                15 => {
                    let rank = rng.below(5);
                    let mut perm: Vec<i64> = (0..rank as i64).collect();
                    for k in (1..perm.len()).rev() {
                        let j = rng.below(k + 1);
                        perm.swap(k, j);
                    }
                    // Some dimensions named from the end, as PyTorch allows.
                    for p in perm.iter_mut() {
                        if rng.chance(30) {
                            *p -= rank as i64;
                        }
                    }
                    Step::Permute { a, perm }
                }
                16 => Step::Cat { a, b: any(rng), dim: signed_dim(rng) },
                17 => Step::Stack { a, b: any(rng), dim: signed_dim(rng) },
                18 => Step::IndexSelect {
                    a,
                    ids: (0..rng.below(5)).map(|_| rng.below(6) as i64 - 1).collect(),
                    ids_dtype: rng.pick(&INDEX_DTYPES),
                    dim: signed_dim(rng),
                },
                19 => Step::IndexAdd {
                    a,
                    src: any(rng),
                    ids: (0..rng.below(4)).map(|_| rng.below(5) as i64).collect(),
                    ids_dtype: rng.pick(&INDEX_DTYPES),
                    dim: signed_dim(rng),
                },
                29 => Step::BadIndex {
                    a,
                    which: rng.below(4) as u8,
                    value: rng.pick(&[-1, -7, 5, 7, 300, i64::MAX, i64::MIN]),
                    dim: signed_dim(rng),
                },
                20 => Step::Where { c: any(rng), a, b: any(rng) },
                21 => Step::Cast { a, dtype: rng.pick(&DTYPES) },
                22 => Step::Contiguous { a },
                23 => Step::Assign { dst: a, src: any(rng) },
                24 => Step::RoundTrip { a },
                25 => Step::ToMissing { a, which: rng.below(3) as u8, copy: rng.chance(50) },
                26 => Step::CumSum { a, dim: rng.below(7) as i64 - 3 },
                27 => Step::Composite { a, which: rng.below(6) as u8, dim: rng.below(7) as i64 - 3 },
                28 => Step::Gather {
                    a,
                    src: if rng.chance(50) { a } else { any(rng) },
                    dim: rng.below(7) as i64 - 3,
                    ids: (0..1 + rng.below(4)).map(|_| rng.below(6) as i64).collect(),
                    ids_dtype: rng.pick(&INDEX_DTYPES),
                    mode: rng.below(3) as u8,
                    k: rng.below(4),
                },
                31 => {
                    Step::Sort { a, dim: rng.below(7) as i64 - 3, descending: rng.chance(50), which: rng.below(4) as u8, k: rng.below(4) }
                }
                30 => Step::Slice {
                    a,
                    sels: (0..rng.below(5)).map(|_| (rng.below(6) as u8, rng.below(9) as i64 - 4, rng.below(9) as i64 - 4)).collect(),
                },
                _ => {
                    if rng.chance(50) {
                        Step::Print { a }
                    } else {
                        Step::ToVec2 { a }
                    }
                }
            }
        };
        steps.push(step);
    }
    steps
}

/// Whether a step names a dimension counted from the end.
pub(crate) fn has_negative_dim(step: &Step) -> bool {
    match step {
        Step::Reduce { dim, .. }
        | Step::Narrow { dim, .. }
        | Step::Unsqueeze { dim, .. }
        | Step::Squeeze { dim, .. }
        | Step::Cat { dim, .. }
        | Step::Stack { dim, .. }
        | Step::IndexSelect { dim, .. }
        | Step::IndexAdd { dim, .. }
        | Step::BadIndex { dim, .. }
        | Step::CumSum { dim, .. }
        | Step::Composite { dim, .. } => *dim < 0,
        Step::FlattenFrom { from, .. } => *from < 0,
        Step::Transpose { d0, d1, .. } => *d0 < 0 || *d1 < 0,
        Step::Permute { perm, .. } => perm.iter().any(|&p| p < 0),
        _ => false,
    }
}

/// The earlier values a step reads.
pub(crate) fn operands(step: &Step) -> Vec<usize> {
    match step {
        Step::Create { .. } | Step::FromValues { .. } | Step::NoSuchDevice { .. } => vec![],
        Step::Binary { a, b, .. } | Step::Matmul { a, b } | Step::Cat { a, b, .. } | Step::Stack { a, b, .. } => vec![*a, *b],
        Step::IndexAdd { a, src, .. } | Step::Gather { a, src, .. } => vec![*a, *src],
        Step::Where { c, a, b } => vec![*c, *a, *b],
        Step::Assign { dst, src } => vec![*dst, *src],
        Step::Unary { a, .. }
        | Step::Reduce { a, .. }
        | Step::ReduceAll { a, .. }
        | Step::CumSum { a, .. }
        | Step::Composite { a, .. }
        | Step::Transpose { a, .. }
        | Step::Narrow { a, .. }
        | Step::Reshape { a, .. }
        | Step::Broadcast { a, .. }
        | Step::Unsqueeze { a, .. }
        | Step::Squeeze { a, .. }
        | Step::FlattenFrom { a, .. }
        | Step::Permute { a, .. }
        | Step::IndexSelect { a, .. }
        | Step::Sort { a, .. }
        | Step::Slice { a, .. }
        | Step::BadIndex { a, .. }
        | Step::Cast { a, .. }
        | Step::Contiguous { a }
        | Step::RoundTrip { a }
        | Step::Print { a }
        | Step::ToVec2 { a }
        | Step::ToMissing { a, .. } => vec![*a],
    }
}
