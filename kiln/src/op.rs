//! The primitive kernels every backend implements. The front end
//! ([`Tensor`](crate::Tensor)) validates devices, dtypes and shapes, allocates
//! the output and hands one of these to the device's backend; a kernel never
//! has a user error to report, so an asynchronous queue can run it later.
//! Everything else (norms, softmax, losses, stacking...) is composed from these.

use crate::shape::Layout;
use crate::storage::Storage;
use std::sync::Arc;

/// A view of a storage: the operand of a kernel.
#[derive(Clone)]
pub(crate) struct Src {
    pub storage: Arc<Storage>,
    pub layout: Layout,
}

/// Elementwise functions of one operand (and maybe a scalar).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// -x
    Neg,
    /// |x|
    Abs,
    /// e^x
    Exp,
    /// ln x
    Log,
    /// √x
    Sqrt,
    /// x²
    Sqr,
    /// 1/x
    Recip,
    /// sin x
    Sin,
    /// cos x
    Cos,
    /// tanh x
    Tanh,
    /// 1/(1+e^-x)
    Sigmoid,
    /// max(x, 0)
    Relu,
    /// x^n by repeated multiplication, never through powf.
    Powi(i32),
    /// x^p
    Powf(f64),
    /// x + s
    AddScalar(f64),
    /// x − s
    SubScalar(f64),
    /// s − x
    RSubScalar(f64),
    /// x · s
    MulScalar(f64),
    /// x / s
    DivScalar(f64),
    /// s / x
    RDivScalar(f64),
    /// max(x, s)
    MaxScalar(f64),
    /// min(x, s)
    MinScalar(f64),
    /// x · a + b
    Affine(f64, f64),
}

impl UnaryOp {
    /// Ops that are only defined for floats.
    pub(crate) fn float_only(self) -> bool {
        matches!(
            self,
            UnaryOp::Exp
                | UnaryOp::Log
                | UnaryOp::Sqrt
                | UnaryOp::Recip
                | UnaryOp::Sin
                | UnaryOp::Cos
                | UnaryOp::Tanh
                | UnaryOp::Sigmoid
                | UnaryOp::Powf(_)
                | UnaryOp::RDivScalar(_)
        )
    }
    pub(crate) fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Sqr => "sqr",
            UnaryOp::Recip => "recip",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Relu => "relu",
            UnaryOp::Powi(_) => "powi",
            UnaryOp::Powf(_) => "powf",
            UnaryOp::AddScalar(_) => "add_scalar",
            UnaryOp::SubScalar(_) => "sub_scalar",
            UnaryOp::RSubScalar(_) => "rsub_scalar",
            UnaryOp::MulScalar(_) => "mul_scalar",
            UnaryOp::DivScalar(_) => "div_scalar",
            UnaryOp::RDivScalar(_) => "rdiv_scalar",
            UnaryOp::MaxScalar(_) => "maximum_scalar",
            UnaryOp::MinScalar(_) => "minimum_scalar",
            UnaryOp::Affine(..) => "affine",
        }
    }
}

/// Elementwise functions of two operands of one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// a + b
    Add,
    /// a − b
    Sub,
    /// a · b
    Mul,
    /// a / b
    Div,
    /// a^b (floats)
    Pow,
    /// max(a, b)
    Maximum,
    /// min(a, b)
    Minimum,
    /// a == b, as u8 0/1
    Eq,
    /// a != b
    Ne,
    /// a < b
    Lt,
    /// a <= b
    Le,
    /// a > b
    Gt,
    /// a >= b
    Ge,
}

impl BinaryOp {
    pub(crate) fn is_comparison(self) -> bool {
        matches!(self, BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge)
    }
    pub(crate) fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Eq => "eq",
            BinaryOp::Ne => "ne",
            BinaryOp::Lt => "lt",
            BinaryOp::Le => "le",
            BinaryOp::Gt => "gt",
            BinaryOp::Ge => "ge",
        }
    }
}

/// Reductions over some dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Index of the maximum (first one on ties), as i64; one dim only.
    ArgMax,
    /// Index of the minimum, as i64; one dim only.
    ArgMin,
}

/// Distribution of a random fill.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Distribution {
    /// Uniform in [lo, hi).
    Uniform { lo: f64, hi: f64 },
    /// Normal with mean and standard deviation.
    Normal { mean: f64, std: f64 },
}

/// One primitive kernel, with its operands and its output storage.
/// Outputs are contiguous and freshly allocated, except for `Copy` and
/// `IndexAdd`, which write into `dst` in place.
pub(crate) enum Kernel {
    /// out[i] = value
    Fill { out: Arc<Storage>, value: f64 },
    /// out[i] = start + i·step
    Arange { out: Arc<Storage>, start: f64, step: f64 },
    /// Counter-based random numbers: element i uses counter `offset + i`.
    Random { out: Arc<Storage>, seed: u64, offset: u64, dist: Distribution },
    /// out = op(src)
    Unary { op: UnaryOp, src: Src, out: Arc<Storage> },
    /// out = lhs op rhs; both layouts are already broadcast to the output shape.
    Binary { op: BinaryOp, lhs: Src, rhs: Src, out: Arc<Storage> },
    /// out has src's shape with the `dims` set to 1.
    Reduce { op: ReduceOp, src: Src, dims: Vec<usize>, out: Arc<Storage> },
    /// out[b] = lhs[b] @ rhs[b]; lhs is (batch.., m, k), rhs (batch.., k, n).
    Matmul { lhs: Src, rhs: Src, out: Arc<Storage>, m: usize, n: usize, k: usize },
    /// dst[dst_layout] = src (any dtypes: this is also the cast).
    Copy { src: Src, dst: Arc<Storage>, dst_layout: Layout },
    /// out = src.index_select(dim, ids)
    IndexSelect { src: Src, ids: Src, dim: usize, out: Arc<Storage> },
    /// dst (contiguous) .index_select(dim, ids) += src
    IndexAdd { src: Src, ids: Src, dim: usize, dst: Arc<Storage> },
    /// out = cond ? on_true : on_false (layouts broadcast to the output shape).
    Where { cond: Src, on_true: Src, on_false: Src, out: Arc<Storage> },
}

impl Kernel {
    /// The kernel's name, for errors reported after it ran.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Kernel::Fill { .. } => "fill",
            Kernel::Arange { .. } => "arange",
            Kernel::Random { .. } => "random",
            Kernel::Unary { op, .. } => op.name(),
            Kernel::Binary { op, .. } => op.name(),
            Kernel::Reduce { op, .. } => match op {
                ReduceOp::Sum => "sum",
                ReduceOp::Max => "max",
                ReduceOp::Min => "min",
                ReduceOp::ArgMax => "argmax",
                ReduceOp::ArgMin => "argmin",
            },
            Kernel::Matmul { .. } => "matmul",
            Kernel::Copy { .. } => "copy",
            Kernel::IndexSelect { .. } => "index_select",
            Kernel::IndexAdd { .. } => "index_add",
            Kernel::Where { .. } => "where_cond",
        }
    }

    /// True when the kernel writes no element: its output is empty, or it
    /// writes in place from an empty source. Such kernels are skipped, so no
    /// backend walks the dimensions of an empty tensor.
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            Kernel::Fill { out, .. }
            | Kernel::Arange { out, .. }
            | Kernel::Random { out, .. }
            | Kernel::Unary { out, .. }
            | Kernel::Binary { out, .. }
            | Kernel::Reduce { out, .. }
            | Kernel::Matmul { out, .. }
            | Kernel::IndexSelect { out, .. }
            | Kernel::Where { out, .. } => out.len == 0,
            Kernel::Copy { src, dst, dst_layout } => dst.len == 0 || src.layout.elem_count() == 0 || dst_layout.elem_count() == 0,
            Kernel::IndexAdd { src, dst, .. } => dst.len == 0 || src.layout.elem_count() == 0,
        }
    }
}
