//! Arithmetic on tensors: elementwise (with numpy broadcasting), scalar
//! variants, reductions and matmul. Each checks devices first, then dtypes
//! and shapes, then launches one primitive kernel.

use crate::backprop::{self, BackOp};
use crate::base::shape::{broadcast_shapes, Layout};
use crate::op::{BinaryOp, Kernel, ReduceOp, UnaryOp};
use crate::tensor::{check_compute, check_same_device, check_same_dtype, Dim};
use crate::{DType, Error, Result, Shape, Tensor};
use std::borrow::Cow;

/// The dimensions `dims` as indices in `0..rank` (negative ones count from
/// the end), or an error naming `op` and the rank. Inline up to rank 4.
pub(crate) fn resolve_dims(op: &str, dims: &[impl Dim], rank: usize) -> Result<smallvec::SmallVec<[usize; 4]>> {
    dims.iter().map(|&d| d.index(op, rank)).collect()
}

/// Whether an integer tensor of `dtype` must compute `op` in f32.
fn promotes_integers(op: UnaryOp, dtype: DType) -> bool {
    let (lo, hi) = match dtype {
        DType::U8 => (0.0, 255.0),
        DType::I32 => (i32::MIN as f64, i32::MAX as f64),
        _ => (i64::MIN as f64, i64::MAX as f64),
    };
    let fits = |s: f64| s.is_finite() && s.fract() == 0.0 && s >= lo && s <= hi;
    match op {
        _ if op.float_only() => true,
        UnaryOp::DivScalar(_) => true,
        UnaryOp::AddScalar(s)
        | UnaryOp::SubScalar(s)
        | UnaryOp::RSubScalar(s)
        | UnaryOp::MulScalar(s)
        | UnaryOp::MaxScalar(s)
        | UnaryOp::MinScalar(s) => !fits(s),
        UnaryOp::Affine(a, b) => !fits(a) || !fits(b),
        _ => false,
    }
}

macro_rules! unary_fns {
    ($($(#[$doc:meta])* $name:ident => $op:expr;)*) => {
        $( $(#[$doc])* pub fn $name(&self) -> Result<Tensor> { self.unary($op) } )*
    };
}

macro_rules! binary_fns {
    ($($(#[$doc:meta])* $name:ident => $op:expr;)*) => {
        $( $(#[$doc])* pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> { self.binary(rhs, $op) } )*
    };
}

impl Tensor {
    /// Applies a primitive elementwise function.
    ///
    /// Type promotion follows PyTorch for a tensor and a Rust scalar: an
    /// integer tensor gives an f32 result for float functions (`exp`,
    /// `sqrt`...), for `div_scalar` (true division), and for a scalar that
    /// an integer of its dtype cannot hold (fractional, non-finite or out of
    /// range: `i64 · 0.5`, `u8 + (−1.0)`). An integral scalar in range keeps
    /// the integer dtype (Rust scalars are all f64, so kiln cannot tell
    /// `2` from `2.0` as Python does; see the README's table of differences).
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::new(&[1i64, 2, 3], &cpu())?;
    /// assert_eq!(x.div_scalar(0.5)?.to_vec::<f32>()?, vec![2., 4., 6.]);
    /// assert_eq!(x.add_scalar(1.0)?.dtype(), DType::I64);
    /// let b = Tensor::new(&[0u8, 5], &cpu())?;
    /// assert_eq!((&b + -1.0)?.to_vec::<f32>()?, vec![-1., 4.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        let dtype = self.dtype();
        check_compute(op.name(), dtype)?;
        if !dtype.is_float() && promotes_integers(op, dtype) {
            return self.to_dtype(DType::F32)?.unary(op);
        }
        let t = self.run_new(Kernel::Unary { op, src: self.src() }, dtype, self.shape().clone())?;
        Ok(backprop::record(t, || BackOp::Unary(op, self.clone()), &[self]))
    }

    /// [`unary`](Self::unary) of a tensor given by value, as in
    /// `(x.sqr()? - 0.5)?`: when nothing else can see its storage (no other
    /// tensor, view or autograd node holds it) and the op keeps its dtype,
    /// the result is written over it on the CPU, saving an allocation and a
    /// pass over memory (numpy's temporary elision). Otherwise as `unary`.
    pub(crate) fn unary_owned(mut self, op: UnaryOp) -> Result<Tensor> {
        let dtype = self.dtype();
        let keeps_dtype = !matches!(dtype, DType::F16 | DType::BF16) && (dtype.is_float() || !promotes_integers(op, dtype));
        let whole = self.layout.offset == 0 && self.layout.is_contiguous() && self.layout.elem_count() == self.storage.len;
        if keeps_dtype && whole && self.node.is_none() && self.storage.device == crate::Device::Cpu {
            if let Some(buf) = self.storage.get_mut().and_then(|s| s.host_mut()) {
                if crate::backend::host_kernels::unary_in_place(op, buf, crate::backend::cpu::threads()) {
                    return Ok(self);
                }
            }
        }
        self.unary(op)
    }

    unary_fns! {
        /// −x
        neg => UnaryOp::Neg;
        /// |x|
        abs => UnaryOp::Abs;
        /// eˣ
        exp => UnaryOp::Exp;
        /// Natural logarithm.
        log => UnaryOp::Log;
        /// Square root.
        sqrt => UnaryOp::Sqrt;
        /// x²
        sqr => UnaryOp::Sqr;
        /// 1/x
        recip => UnaryOp::Recip;
        /// Sine.
        sin => UnaryOp::Sin;
        /// Cosine.
        cos => UnaryOp::Cos;
        /// Hyperbolic tangent.
        tanh => UnaryOp::Tanh;
        /// Logistic sigmoid.
        sigmoid => UnaryOp::Sigmoid;
        /// max(x, 0)
        relu => UnaryOp::Relu;
    }

    /// xⁿ by repeated multiplication (never through `powf`).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[2f32, -3.], &cpu())?;
    /// assert_eq!(x.powi(3)?.to_vec::<f32>()?, vec![8., -27.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn powi(&self, n: i32) -> Result<Tensor> {
        if n < 0 && !self.dtype().is_float() {
            return Err(Error::invalid(
                "powi",
                format!("a negative power ({n}) of an integer tensor is not an integer; cast to a float dtype first"),
            ));
        }
        self.unary(UnaryOp::Powi(n))
    }
    /// xᵖ for a real p.
    pub fn powf(&self, p: f64) -> Result<Tensor> {
        self.unary(UnaryOp::Powf(p))
    }
    /// x·a + b in one pass.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        self.unary(UnaryOp::Affine(mul, add))
    }
    /// x + s
    pub fn add_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::AddScalar(s))
    }
    /// x − s
    pub fn sub_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::SubScalar(s))
    }
    /// x · s
    pub fn mul_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::MulScalar(s))
    }
    /// x / s
    pub fn div_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::DivScalar(s))
    }
    /// max(x, s). NaN propagates; the gradient is 1 where x > s and 0 at
    /// and below the boundary (PyTorch 2.x's `clamp_min` backward).
    pub fn maximum_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::MaxScalar(s))
    }
    /// min(x, s). NaN propagates; the gradient is 1 where x < s and 0 at
    /// and above the boundary.
    pub fn minimum_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::MinScalar(s))
    }
    /// Clamps into [lo, hi]. NaN stays NaN. The gradient passes strictly
    /// inside the range and is 0 at the bounds and outside (as PyTorch 2.15).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[-2f32, 0.5, 3.0, f32::NAN], &cpu())?;
    /// let y = x.clamp(0.0, 1.0)?.to_vec::<f32>()?;
    /// assert_eq!(&y[..3], &[0.0, 0.5, 1.0]);
    /// assert!(y[3].is_nan());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        self.maximum_scalar(lo)?.minimum_scalar(hi)
    }

    /// Applies a primitive binary function with numpy broadcasting.
    pub fn binary(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        let name = op.name();
        check_same_device(name, self, rhs)?;
        check_same_dtype(name, self, rhs)?;
        check_compute(name, self.dtype())?;
        if op == BinaryOp::Pow && !self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: name.into(), dtype: self.dtype() });
        }
        if op == BinaryOp::Div && !self.dtype().is_float() {
            // PyTorch: `/` of integer tensors is true division, in floats.
            return self.to_dtype(DType::F32)?.binary(&rhs.to_dtype(DType::F32)?, op);
        }
        let same_shape = self.shape() == rhs.shape();
        let shape = if same_shape { self.shape().clone() } else { broadcast_shapes(name, self.shape(), rhs.shape())? };
        let (l, r) = if same_shape {
            (self.src(), rhs.src())
        } else {
            let mut l = self.src();
            l.layout = Cow::Owned(self.layout.broadcast_as(&shape)?);
            let mut r = rhs.src();
            r.layout = Cow::Owned(rhs.layout.broadcast_as(&shape)?);
            (l, r)
        };
        let dtype = if op.is_comparison() { DType::U8 } else { self.dtype() };
        let t = self.run_new(Kernel::Binary { op, lhs: l, rhs: r }, dtype, shape)?;
        if op.is_comparison() {
            return Ok(t);
        }
        Ok(backprop::record(t, || BackOp::Binary(op, self.clone(), rhs.clone()), &[self, rhs]))
    }

    binary_fns! {
        /// a + b, broadcasting.
        add => BinaryOp::Add;
        /// a − b, broadcasting.
        sub => BinaryOp::Sub;
        /// a · b, broadcasting.
        mul => BinaryOp::Mul;
        /// a / b, broadcasting.
        div => BinaryOp::Div;
        /// aᵇ, broadcasting (floats).
        pow => BinaryOp::Pow;
        /// Elementwise maximum.
        maximum => BinaryOp::Maximum;
        /// Elementwise minimum.
        minimum => BinaryOp::Minimum;
        /// a == b as u8 0/1.
        eq => BinaryOp::Eq;
        /// a != b as u8 0/1.
        ne => BinaryOp::Ne;
        /// a < b as u8 0/1.
        lt => BinaryOp::Lt;
        /// a <= b as u8 0/1.
        le => BinaryOp::Le;
        /// a > b as u8 0/1.
        gt => BinaryOp::Gt;
        /// a >= b as u8 0/1.
        ge => BinaryOp::Ge;
    }

    // ---- reductions ----------------------------------------------------

    /// Reduces over `dims` (all distinct, in range); keeps them as size 1
    /// when `keepdim`. A dimension is a `usize` or, as in PyTorch, a signed
    /// integer counting from the end (`-1` is the last).
    ///
    /// ```
    /// use kiln::{Tensor, ReduceOp, cpu};
    /// let x = Tensor::new(&[[1f32, 5.], [3., 2.]], &cpu())?;
    /// assert_eq!(x.reduce(ReduceOp::Max, &[-1], false)?.to_vec::<f32>()?, vec![5., 3.]);
    /// assert_eq!(x.reduce(ReduceOp::Max, &[0usize], true)?.dims(), &[1, 2]);
    /// // Out of range names the rank; naming a dimension twice is an error.
    /// assert!(x.reduce(ReduceOp::Sum, &[-3], false).unwrap_err().to_string().contains("rank 2"));
    /// assert!(x.reduce(ReduceOp::Sum, &[1, -1], false).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn reduce(&self, op: ReduceOp, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        let name = match op {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        };
        check_compute(name, self.dtype())?;
        let dims = resolve_dims(name, dims, self.rank())?;
        let dims = dims.as_slice();
        for (i, &d) in dims.iter().enumerate() {
            if dims[..i].contains(&d) {
                return Err(Error::invalid(name, format!("dimension {d} is named twice")));
            }
        }
        let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
        if arg && dims.len() != 1 {
            return Err(Error::invalid(name, "reduces exactly one dimension; flatten first to search everything"));
        }
        if op != ReduceOp::Sum && dims.iter().any(|&d| self.dims()[d] == 0) {
            return Err(Error::invalid(name, format!("cannot reduce an empty dimension of shape {}", self.shape())));
        }
        let kept: Shape = Shape((0..self.rank()).map(|d| if dims.contains(&d) { 1 } else { self.dims()[d] }).collect());
        let dtype = if arg { DType::I64 } else { self.dtype() };
        let mut t = self.run_new(Kernel::Reduce { op, src: self.src(), dims: crate::base::shape::Dims::from_slice(dims) }, dtype, kept)?;
        if !arg {
            t = backprop::record(t, || BackOp::Reduce(op, self.clone(), dims.to_vec()), &[self]);
        }
        if keepdim {
            Ok(t)
        } else {
            let squeezed: Vec<usize> = (0..self.rank()).filter(|d| !dims.contains(d)).map(|d| self.dims()[d]).collect();
            t.reshape(squeezed)
        }
    }

    fn all_dims(&self) -> Vec<usize> {
        (0..self.rank()).collect()
    }

    /// Sum of every element, as a 0-d tensor.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// assert_eq!(x.sum_all()?.to_scalar::<f32>()?, 10.0);
    /// assert_eq!(x.sum(0)?.to_vec::<f32>()?, vec![4., 6.]);
    /// assert_eq!(x.sum_keepdim(1)?.dims(), &[2, 1]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn sum_all(&self) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, &self.all_dims(), false)
    }
    /// Sum over one dimension, dropping it.
    pub fn sum(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("sum", self.rank())?;
        self.reduce(ReduceOp::Sum, &[dim], false)
    }
    /// Sum over one dimension, keeping it as size 1.
    pub fn sum_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("sum", self.rank())?;
        self.reduce(ReduceOp::Sum, &[dim], true)
    }
    /// Sum over several dimensions; negative ones count from the end, as in
    /// PyTorch.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// assert_eq!(x.sum_dims(&[-1], false)?.to_vec::<f32>()?, vec![3., 7.]);
    /// assert_eq!(x.sum_dims(&[0, -1], true)?.dims(), &[1, 1]);
    /// let dims: Vec<usize> = vec![0];
    /// assert_eq!(x.sum_dims(&dims, false)?.to_vec::<f32>()?, vec![4., 6.]);
    /// assert!(x.sum_dims(&[2], false).unwrap_err().to_string().contains("rank 2"));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn sum_dims(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, dims, keepdim)
    }
    /// Mean over several dimensions (floats); negative ones count from the
    /// end, as in PyTorch.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// assert_eq!(x.mean_dims(&[-2], false)?.to_vec::<f32>()?, vec![2., 3.]);
    /// assert!(x.mean_dims(&[-3], false).unwrap_err().to_string().contains("rank 2"));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn mean_dims(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: "mean".into(), dtype: self.dtype() });
        }
        let dims = resolve_dims("mean", dims, self.rank())?;
        let dims = dims.as_slice();
        let picked: Vec<usize> = dims.iter().filter_map(|&d| self.dims().get(d).copied()).collect();
        let n = crate::base::shape::checked_product("mean", &picked)?;
        // The mean of nothing is 0/0 = NaN, as in PyTorch and numpy.
        self.sum_dims(dims, keepdim)?.div_scalar(n as f64)
    }
    /// Mean of every element.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean_dims(&self.all_dims(), false)
    }
    /// Mean over one dimension.
    pub fn mean(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("mean", self.rank())?;
        self.mean_dims(&[dim], false)
    }
    /// Mean over one dimension, keeping it.
    pub fn mean_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("mean", self.rank())?;
        self.mean_dims(&[dim], true)
    }
    /// Largest element.
    pub fn max_all(&self) -> Result<Tensor> {
        self.reduce(ReduceOp::Max, &self.all_dims(), false)
    }
    /// Maximum over one dimension.
    ///
    /// NaN propagates (the result is NaN where the slice holds one). The
    /// gradient of a slice that holds NaNs goes to its NaNs, shared, and 0 to
    /// the rest, where PyTorch's `amax`/`amin` give NaN to every element; ties
    /// share the gradient equally. See the README's "Where kiln differs from
    /// PyTorch".
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, f32::NAN], [3., 2.]], &cpu())?;
    /// let m = x.max(1)?.to_vec::<f32>()?;
    /// assert!(m[0].is_nan());
    /// assert_eq!(m[1], 3.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn max(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("max", self.rank())?;
        self.reduce(ReduceOp::Max, &[dim], false)
    }
    /// Maximum over one dimension, keeping it.
    pub fn max_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("max", self.rank())?;
        self.reduce(ReduceOp::Max, &[dim], true)
    }
    /// Smallest element.
    pub fn min_all(&self) -> Result<Tensor> {
        self.reduce(ReduceOp::Min, &self.all_dims(), false)
    }
    /// Minimum over one dimension.
    ///
    /// NaN propagates (the result is NaN where the slice holds one). The
    /// gradient of a slice that holds NaNs goes to its NaNs, shared, and 0 to
    /// the rest, where PyTorch's `amax`/`amin` give NaN to every element; ties
    /// share the gradient equally. See the README's "Where kiln differs from
    /// PyTorch".
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, f32::NAN], [3., 2.]], &cpu())?;
    /// let m = x.min(1)?.to_vec::<f32>()?;
    /// assert!(m[0].is_nan());
    /// assert_eq!(m[1], 2.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn min(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("min", self.rank())?;
        self.reduce(ReduceOp::Min, &[dim], false)
    }
    /// Minimum over one dimension, keeping it.
    pub fn min_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("min", self.rank())?;
        self.reduce(ReduceOp::Min, &[dim], true)
    }
    /// Index of the maximum along `dim` (first on ties), i64.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 5., 2.], [7., 0., 7.]], &cpu())?;
    /// assert_eq!(x.argmax(1)?.to_vec::<i64>()?, vec![1, 0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn argmax(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("argmax", self.rank())?;
        self.reduce(ReduceOp::ArgMax, &[dim], false)
    }
    /// Index of the maximum, keeping the dimension.
    pub fn argmax_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("argmax", self.rank())?;
        self.reduce(ReduceOp::ArgMax, &[dim], true)
    }
    /// Index of the minimum along `dim`, i64.
    pub fn argmin(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("argmin", self.rank())?;
        self.reduce(ReduceOp::ArgMin, &[dim], false)
    }
    /// log(softmax(x)) along `dim` (−1 is the last), computed stably as
    /// x − max − log Σ exp(x − max). An empty tensor gives an empty result.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::new(&[[1f32, 1.], [2., 2.]], &cpu())?;
    /// assert_eq!(x.softmax(0)?.to_vec::<f32>()?, vec![0.26894143, 0.26894143, 0.7310586, 0.7310586]);
    /// assert_eq!(x.softmax(-1)?.to_vec::<f32>()?, vec![0.5; 4]);
    /// assert_eq!(Tensor::zeros((2, 0), DType::F32, &cpu())?.log_softmax(-1)?.dims(), &[2, 0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn log_softmax(&self, dim: impl Dim) -> Result<Tensor> {
        if self.rank() == 0 {
            return Err(Error::invalid("log_softmax", "needs a tensor of rank 1 or more"));
        }
        let dim = dim.index("log_softmax", self.rank())?;
        if !self.dtype().is_float() {
            return self.to_dtype(DType::F32)?.log_softmax(dim);
        }
        if self.elem_count() == 0 {
            return self.mul_scalar(1.0);
        }
        let m = self.detach().max_keepdim(dim)?;
        let shifted = self.sub(&m)?;
        let lse = shifted.exp()?.sum_keepdim(dim)?.log()?;
        shifted.sub(&lse)
    }

    /// softmax(x) along `dim` (−1 is the last); see [`log_softmax`](Self::log_softmax).
    pub fn softmax(&self, dim: impl Dim) -> Result<Tensor> {
        self.log_softmax(dim)?.exp()
    }

    /// The Frobenius norm: √(Σ x²), a 0-d tensor on the same device.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[3f32, 0.], [0., 4.]], &cpu())?;
    /// assert_eq!(x.norm()?.to_scalar::<f32>()?, 5.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn norm(&self) -> Result<Tensor> {
        self.sqr()?.sum_all()?.sqrt()
    }

    // ---- matmul --------------------------------------------------------

    /// Matrix product: 2-D @ 2-D, batched (leading dims broadcast),
    /// matrix @ vector and vector @ vector.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// let v = Tensor::new(&[1f32, 1.], &cpu())?;
    /// assert_eq!(a.matmul(&a)?.to_vec::<f32>()?, vec![7., 10., 15., 22.]);
    /// assert_eq!(a.matmul(&v)?.to_vec::<f32>()?, vec![3., 7.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        check_same_device("matmul", self, rhs)?;
        check_same_dtype("matmul", self, rhs)?;
        if self.dtype() == DType::BF16 {
            return Err(Error::UnsupportedDType { op: "matmul".into(), dtype: self.dtype() });
        }
        if self.rank() == 0 || rhs.rank() == 0 {
            return Err(Error::invalid("matmul", "needs tensors of rank 1 or more; use `mul` for scalars"));
        }
        // Vectors become matrices and the added dimension is dropped after.
        let (a, drop_m) = if self.rank() == 1 { (self.unsqueeze(0)?, true) } else { (self.clone(), false) };
        let (b, drop_n) = if rhs.rank() == 1 { (rhs.unsqueeze(1)?, true) } else { (rhs.clone(), false) };
        let (ra, rb) = (a.rank(), b.rank());
        let (m, k) = (a.dims()[ra - 2], a.dims()[ra - 1]);
        let (k2, n) = (b.dims()[rb - 2], b.dims()[rb - 1]);
        if k != k2 {
            return Err(Error::shape("matmul", self.dims(), rhs.dims()));
        }
        let (sa, sb, out_shape) = if ra == 2 && rb == 2 {
            // The common case needs no batch broadcasting.
            (a.src(), b.src(), Shape::from((m, n)))
        } else {
            let batch = broadcast_shapes("matmul", &Shape::from(&a.dims()[..ra - 2]), &Shape::from(&b.dims()[..rb - 2]))
                .map_err(|_| Error::shape("matmul", self.dims(), rhs.dims()))?;
            let with = |tail: [usize; 2]| {
                let mut dims = batch.dims().to_vec();
                dims.extend(tail);
                Shape::from(dims)
            };
            let mut sa = a.src();
            sa.layout = Cow::Owned(a.layout.broadcast_as(&with([m, k]))?);
            let mut sb = b.src();
            sb.layout = Cow::Owned(b.layout.broadcast_as(&with([k, n]))?);
            (sa, sb, with([m, n]))
        };
        let mut t = self.run_new(Kernel::Matmul { lhs: sa, rhs: sb, m, n, k }, self.dtype(), out_shape)?;
        t = backprop::record(t, || BackOp::Matmul(a.clone(), b.clone()), &[&a, &b]);
        if drop_n {
            t = t.squeeze(t.rank() - 1)?;
        }
        if drop_m {
            t = t.squeeze(t.rank() - if drop_n { 1 } else { 2 })?;
        }
        Ok(t)
    }

    /// Converts to another dtype (a copy; the same tensor when already there).
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::new(&[1.7f32, -2.2], &cpu())?;
    /// assert_eq!(x.to_dtype(DType::I64)?.to_vec::<i64>()?, vec![1, -2]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let dst_layout = Cow::Owned(Layout::contiguous(self.shape().clone()));
        let t = self.run_new(Kernel::Copy { src: self.src(), dst_layout }, dtype, self.shape().clone())?;
        if !dtype.is_float() {
            return Ok(t);
        }
        Ok(backprop::record(t, || BackOp::Cast(self.clone()), &[self]))
    }

    /// `self ? on_true : on_false` elementwise; `self` is the condition
    /// (non-zero is true); all three broadcast together.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let c = Tensor::new(&[1u8, 0, 1], &cpu())?;
    /// let a = Tensor::new(&[1f32, 2., 3.], &cpu())?;
    /// let b = Tensor::new(&[-1f32], &cpu())?;
    /// assert_eq!(c.where_cond(&a, &b)?.to_vec::<f32>()?, vec![1., -1., 3.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn where_cond(&self, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        check_same_device("where", self, on_true)?;
        check_same_device("where", self, on_false)?;
        check_same_dtype("where", on_true, on_false)?;
        let shape = broadcast_shapes("where", &broadcast_shapes("where", self.shape(), on_true.shape())?, on_false.shape())?;
        fn bc<'t>(t: &'t Tensor, shape: &Shape) -> Result<crate::op::Src<'t>> {
            Ok(crate::op::Src::with_layout(&t.storage, t.layout.broadcast_as(shape)?))
        }
        let kernel = Kernel::Where { cond: bc(self, &shape)?, on_true: bc(on_true, &shape)?, on_false: bc(on_false, &shape)? };
        let t = self.run_new(kernel, on_true.dtype(), shape)?;
        Ok(backprop::record(t, || BackOp::Where(self.clone(), on_true.clone(), on_false.clone()), &[on_true, on_false]))
    }
}
