//! The ops: every function on tensors, each in one place with its
//! validation, dtype and shape rules, gradient, host kernel and CUDA
//! kernel.
//!
//! - Families (`unary/`, `binary/`, `reduce/`): one list entry per member.
//! - Ops with kernels of their own, one file each: `argreduce.rs`,
//!   `matmul.rs`, `copy.rs` (casts and strided copies), `fill.rs`
//!   (constants, ranges, random numbers), `index_select.rs`,
//!   `index_add.rs`, `one_hot.rs`, `gather.rs`, `scatter.rs` (and scatter_add),
//!   `sort.rs` (argsort; sort and topk gather through it),
//!   `where_cond.rs`; the convolutional-network ops `conv/` (conv2d,
//!   conv_transpose2d, and the helpers the next share),
//!   `pool.rs`, `norm.rs` (batch and layer norm), `interp.rs`.
//! - Ops that move no element (`views.rs`, `slicing.rs`: `x.i((.., 0..2))`),
//!   or only through other ops:
//!   `cat.rs`, `transfer.rs` (between devices), `read.rs` (to the host),
//!   `create.rs` (the constructors), `composite.rs` (softmax, norms, means:
//!   compositions, whose gradients come for free).
//! - `operators.rs` (`+ − × ÷` on tensors and scalars), `display.rs`.

pub(crate) mod argreduce;
pub(crate) mod binary;
mod cat;
mod composite;
pub(crate) mod conv;
pub(crate) mod copy;
mod create;
mod cross_entropy;
mod cumsum;
pub(crate) mod custom;
mod display;
pub(crate) mod fill;
mod gather;
mod index_add;
mod index_select;
mod interp;
mod matmul;
mod norm;
mod one_hot;
mod operators;
pub(crate) mod pool;
mod read;
pub(crate) mod reduce;
mod scatter;
pub(crate) mod slicing;
mod sort;
mod transfer;
pub(crate) mod unary;
mod views;
mod where_cond;

use crate::base::error::Result;
use crate::Tensor;
use binary::BinaryOp;

/// `true` when given tokens, `false` when given none (for the families'
/// macros: whether an entry names an optional part).
macro_rules! present {
    () => {
        false
    };
    ($($t:tt)+) => {
        true
    };
}
pub(crate) use present;

/// The bracketed expression when there is one, else the default.
macro_rules! or_else {
    ([] $default:expr) => {
        $default
    };
    ([$e:expr] $default:expr) => {
        $e
    };
}
pub(crate) use or_else;

/// The gradient of `t` computed by `f` when `t` needs one (it is recorded),
/// else none: a batch or a target never does, and skipping it saves kernels.
pub(crate) fn need(t: &Tensor, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    if t.requires_grad() {
        f().map(Some)
    } else {
        Ok(None)
    }
}

/// 0/1 of `x`'s dtype where `cmp(x, s)` holds.
pub(crate) fn mask_scalar(x: &Tensor, op: BinaryOp, s: f64) -> Result<Tensor> {
    x.binary(&x.scalar_like(s)?, op)?.to_dtype(x.dtype())
}

/// `g` with zeros where the u8 `cond` is set (PyTorch's `masked_fill(cond,
/// 0)`: an infinite or NaN gradient there becomes 0, not NaN as `g · 0`).
pub(crate) fn zero_where(cond: &Tensor, g: &Tensor) -> Result<Tensor> {
    cond.where_cond(&g.scalar_like(0.0)?, g)
}

/// Sums a broadcast gradient back down to `shape`.
pub(crate) fn sum_to(g: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if g.dims() == shape {
        return Ok(g.clone());
    }
    let extra = g.rank() - shape.len();
    let mut dims: Vec<usize> = (0..extra).collect();
    for (i, &s) in shape.iter().enumerate() {
        if s == 1 && g.dims()[extra + i] != 1 {
            dims.push(extra + i);
        }
    }
    g.sum_over(&dims, true)?.reshape(shape)
}

impl Tensor {
    /// A 0-d tensor of this tensor's dtype and device holding `v`.
    pub(crate) fn scalar_like(&self, v: f64) -> Result<Tensor> {
        Tensor::full(v, (), self.dtype(), &self.device())
    }
}
