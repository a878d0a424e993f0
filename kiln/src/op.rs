//! The primitive kernels every backend implements. The front end
//! ([`Tensor`](crate::Tensor)) validates devices, dtypes and shapes, allocates
//! the output and hands one of these to the device's backend; a kernel never
//! has a user error to report, so an asynchronous queue can run it later.
//! Everything else (norms, softmax, losses, stacking...) is composed from these.

use crate::base::shape::{Dims, Layout};
use crate::storage::Storage;
use std::borrow::Cow;
use std::sync::Arc;

/// A storage as a kernel names it. On a synchronous device the kernel runs
/// before the call returns, so it borrows the caller's tensors (no reference
/// count is touched); a kernel that waits in a device's queue owns a
/// reference instead ([`Kernel::into_owned`]), so dropping the tensors
/// meanwhile is safe.
pub(crate) type StorageRef<'a> = Cow<'a, Arc<Storage>>;

/// A view of a storage: the operand of a kernel.
#[derive(Clone)]
pub(crate) struct Src<'a> {
    pub storage: StorageRef<'a>,
    pub layout: Cow<'a, Layout>,
}

impl<'a> Src<'a> {
    /// A view with a layout of its own (a broadcast, say) of a borrowed storage.
    pub(crate) fn with_layout(storage: &'a Arc<Storage>, layout: Layout) -> Src<'a> {
        Src { storage: Cow::Borrowed(storage), layout: Cow::Owned(layout) }
    }
    /// The same view, owning its storage reference and layout.
    pub(crate) fn to_owned(&self) -> Src<'static> {
        Src { storage: Cow::Owned(Arc::clone(&self.storage)), layout: Cow::Owned(Layout::clone(&self.layout)) }
    }
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

/// One primitive kernel: what to compute from which operands. Where the
/// result goes is given beside it ([`Out`], or the storage a backend's
/// `launch` gets): a new buffer for most kernels, an existing storage for
/// `Copy` into a view and `IndexAdd`, which write in place.
pub(crate) enum Kernel<'a> {
    /// out[i] = value
    Fill { value: f64 },
    /// out[i] = start + i·step
    Arange { start: f64, step: f64 },
    /// Counter-based random numbers: element i uses counter `offset + i`.
    Random { seed: u64, offset: u64, dist: Distribution },
    /// out = op(src)
    Unary { op: UnaryOp, src: Src<'a> },
    /// out = lhs op rhs; both layouts are already broadcast to the output shape.
    Binary { op: BinaryOp, lhs: Src<'a>, rhs: Src<'a> },
    /// out has src's shape with the `dims` set to 1.
    Reduce { op: ReduceOp, src: Src<'a>, dims: Dims },
    /// out[b] = lhs[b] @ rhs[b]; lhs is (batch.., m, k), rhs (batch.., k, n).
    Matmul { lhs: Src<'a>, rhs: Src<'a>, m: usize, n: usize, k: usize },
    /// out[dst_layout] = src (any dtypes: this is also the cast).
    Copy { src: Src<'a>, dst_layout: Cow<'a, Layout> },
    /// out = src.index_select(dim, ids)
    IndexSelect { src: Src<'a>, ids: Src<'a>, dim: usize },
    /// out (contiguous) .index_select(dim, ids) += src
    IndexAdd { src: Src<'a>, ids: Src<'a>, dim: usize },
    /// out = cond ? on_true : on_false (layouts broadcast to the output shape).
    Where { cond: Src<'a>, on_true: Src<'a>, on_false: Src<'a> },
}

/// Where a host kernel writes.
pub(crate) enum Out<'a> {
    /// A buffer nobody else can see yet: the new tensor of an operation on a
    /// synchronous device, computed before its storage exists. No lock.
    Fresh(&'a mut crate::base::buffer::CpuBuffer),
    /// A storage others may see (an in-place write, or a kernel that ran
    /// later on a device's queue): write-locked together with the inputs.
    Storage(&'a Storage),
}

impl Out<'_> {
    /// Elements of the output.
    pub(crate) fn len(&self) -> usize {
        match self {
            Out::Fresh(b) => b.len(),
            Out::Storage(s) => s.len,
        }
    }
}

impl Kernel<'_> {
    /// The kernel with owned operand references, to wait in a device's queue.
    pub(crate) fn to_owned(&self) -> Kernel<'static> {
        match self {
            Kernel::Fill { value } => Kernel::Fill { value: *value },
            Kernel::Arange { start, step } => Kernel::Arange { start: *start, step: *step },
            Kernel::Random { seed, offset, dist } => Kernel::Random { seed: *seed, offset: *offset, dist: *dist },
            Kernel::Unary { op, src } => Kernel::Unary { op: *op, src: src.to_owned() },
            Kernel::Binary { op, lhs, rhs } => Kernel::Binary { op: *op, lhs: lhs.to_owned(), rhs: rhs.to_owned() },
            Kernel::Reduce { op, src, dims } => Kernel::Reduce { op: *op, src: src.to_owned(), dims: dims.clone() },
            Kernel::Matmul { lhs, rhs, m, n, k } => Kernel::Matmul { lhs: lhs.to_owned(), rhs: rhs.to_owned(), m: *m, n: *n, k: *k },
            Kernel::Copy { src, dst_layout } => Kernel::Copy { src: src.to_owned(), dst_layout: Cow::Owned(Layout::clone(dst_layout)) },
            Kernel::IndexSelect { src, ids, dim } => Kernel::IndexSelect { src: src.to_owned(), ids: ids.to_owned(), dim: *dim },
            Kernel::IndexAdd { src, ids, dim } => Kernel::IndexAdd { src: src.to_owned(), ids: ids.to_owned(), dim: *dim },
            Kernel::Where { cond, on_true, on_false } => {
                Kernel::Where { cond: cond.to_owned(), on_true: on_true.to_owned(), on_false: on_false.to_owned() }
            }
        }
    }

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

    /// True when the kernel writes no element of an output of `out_len`
    /// elements: the output is empty, or it writes in place from an empty
    /// source. Such kernels are skipped, so no backend walks the dimensions
    /// of an empty tensor.
    #[inline]
    pub(crate) fn writes_nothing(&self, out_len: usize) -> bool {
        out_len == 0
            || match self {
                Kernel::Copy { src, dst_layout } => src.layout.elem_count() == 0 || dst_layout.elem_count() == 0,
                Kernel::IndexAdd { src, .. } => src.layout.elem_count() == 0,
                _ => false,
            }
    }
}
