//! Ops composed of other ops, with their gradients for free: means,
//! variances and standard deviations, clamping, softmax, log-softmax and
//! logsumexp, GELU (exact and tanh) and SiLU, the norm. A composite becomes a
//! primitive (a family member or an op of its own) only when that pays in
//! speed or exactness.

use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::ops::binary::BinaryOp;
use crate::ops::reduce::{resolve_reduce_dims, Reduction};
use crate::tensor::Dim;
use crate::Tensor;

impl Tensor {
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
        let dims = crate::ops::reduce::resolve_reduce_dims("mean", dims, self.rank())?;
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
        self.mean_dims(&[dim], false)
    }
    /// Mean over one dimension, keeping it.
    pub fn mean_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        self.mean_dims(&[dim], true)
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
            // As PyTorch: a scalar's dims are 0 and −1 (its log-softmax is 0).
            dim.index("log_softmax", 1)?;
            return self.reshape(1)?.log_softmax(0)?.reshape(());
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
        // Resolved here so that an error names softmax, not log_softmax (a
        // 0-d tensor's dims are 0 and −1, as in PyTorch).
        let dim = dim.index("softmax", self.rank().max(1))?;
        self.log_softmax(dim)?.exp()
    }

    /// The Frobenius norm: √(Σ x²), a 0-d tensor on the same device, in one
    /// pass over `self` ([`Reduction::Norm`](crate::Reduction::Norm): floats
    /// square and sum in f64 and the root is taken there, then rounded once,
    /// so no intermediate overflows or underflows where the norm is
    /// representable). Its gradient at a zero tensor is 0, as in PyTorch.
    /// Floats only, as PyTorch's `linalg.vector_norm` ("Expected a floating
    /// point or complex tensor"): an integer tensor is `UnsupportedDType`
    /// (squaring and summing in its own dtype would wrap); convert it first.
    ///
    /// ```
    /// use kiln::{Tensor, DType, Error, cpu};
    /// let x = Tensor::new(&[[3f32, 0.], [0., 4.]], &cpu())?;
    /// assert_eq!(x.norm()?.to_scalar::<f32>()?, 5.0);
    /// let big = Tensor::new(&[2e19f32, 0.], &cpu())?;
    /// assert_eq!(big.norm()?.to_scalar::<f32>()?, 2e19);
    /// let b = Tensor::new(&[16u8], &cpu())?;
    /// assert!(matches!(b.norm(), Err(Error::UnsupportedDType { dtype: DType::U8, .. })));
    /// assert_eq!(b.to_dtype(DType::F32)?.norm()?.to_scalar::<f32>()?, 16.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn norm(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: "norm".into(), dtype: self.dtype() });
        }
        crate::tensor::check_compute("norm", self.dtype())?;
        self.reduce(crate::Reduction::Norm, &self.all_dims(), false)
    }
}

impl Tensor {
    /// Variance over `dims` with `correction` (Bessel's: 1, the default of
    /// [`var`](Self::var); 0 for the population variance):
    /// Σ(x − mean)² / (N − correction), as PyTorch's `var(dims, correction=,
    /// keepdim=)`. N − correction ≤ 0 divides by 0 (inf, or NaN for 0/0), as
    /// in PyTorch. Floats only, as PyTorch (`to_dtype` an integer tensor
    /// first); f32 computes in f64 and rounds once, as PyTorch's kernels do.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2., 3., 4.], [2., 2., 2., 2.]], &cpu())?;
    /// assert_eq!(x.var(1)?.to_vec::<f32>()?, vec![5. / 3., 0.]);
    /// assert_eq!(x.var_dims(&[-1], 0.0, true)?.to_vec::<f32>()?, vec![1.25, 0.]);
    /// assert_eq!(x.std_dims(&[0, 1], 1.0, false)?.dims(), &[] as &[usize]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn var_dims(&self, dims: &[impl Dim], correction: f64, keepdim: bool) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: "var".into(), dtype: self.dtype() });
        }
        if self.dtype() == DType::F32 {
            // Wide and rounded once, as PyTorch's Welford kernels accumulate
            // f32 in f64: squared deviations past f32's range (or below it)
            // would otherwise overflow (underflow) where the result does not.
            return self.to_dtype(DType::F64)?.var_dims(dims, correction, keepdim)?.to_dtype(DType::F32);
        }
        let dims = resolve_reduce_dims("var", dims, self.rank())?;
        let picked: Vec<usize> = dims.iter().filter_map(|&d| self.dims().get(d).copied()).collect();
        let n = crate::base::shape::checked_product("var", &picked)? as f64;
        // The mean's own gradient is Σ(x − mean)·(…) = 0: detached, the
        // gradient is PyTorch's 2(x − mean)/(N − correction), and an infinite
        // element does not spread NaN through the mean to its whole slice.
        let centred = self.sub(&self.detach().mean_dims(&dims, true)?)?;
        centred.sqr()?.sum_dims(&dims, keepdim)?.div_scalar((n - correction).max(0.0))
    }
    /// Variance of every element, with Bessel's correction (N − 1).
    pub fn var_all(&self) -> Result<Tensor> {
        self.var_dims(&self.all_dims(), 1.0, false)
    }
    /// Variance over one dimension, with Bessel's correction (N − 1).
    pub fn var(&self, dim: impl Dim) -> Result<Tensor> {
        self.var_dims(&[dim], 1.0, false)
    }
    /// Standard deviation: √[`var_dims`](Self::var_dims). Where the
    /// deviation is 0 its gradient is 0 (not 0/0), as in PyTorch.
    pub fn std_dims(&self, dims: &[impl Dim], correction: f64, keepdim: bool) -> Result<Tensor> {
        if self.dtype() == DType::F32 {
            // The root of the f64 variance, rounded once (see var_dims):
            // std([2e19, −2e19]) is 2.8e19 though its variance overflows f32.
            return self.to_dtype(DType::F64)?.std_dims(dims, correction, keepdim)?.to_dtype(DType::F32);
        }
        let v = self.var_dims(dims, correction, keepdim)?;
        // √ of the variance with its zeros read as ones, then zeroed: the
        // gradient of √ at those elements is then 0/2, not 0/0.
        let zero = v.binary(&v.scalar_like(0.0)?, BinaryOp::Eq)?;
        let s = zero.where_cond(&v.scalar_like(1.0)?, &v)?.sqrt()?;
        zero.where_cond(&v.scalar_like(0.0)?, &s)
    }
    /// Standard deviation of every element, with Bessel's correction.
    pub fn std_all(&self) -> Result<Tensor> {
        self.std_dims(&self.all_dims(), 1.0, false)
    }
    /// Standard deviation over one dimension, with Bessel's correction.
    pub fn std(&self, dim: impl Dim) -> Result<Tensor> {
        // Resolved here so that an error names std, not var.
        let dims = resolve_reduce_dims("std", &[dim], self.rank())?;
        self.std_dims(dims.as_slice(), 1.0, false)
    }

    /// log Σ exp(x) over `dims`, computed around the maximum so that it
    /// neither overflows nor underflows (PyTorch's `logsumexp`): a slice
    /// holding +inf gives +inf, an all −inf or empty slice −inf. Integers
    /// compute in f32. The gradient is softmax(x) over the slice.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1000f32, 1000.], [0., f32::NEG_INFINITY]], &cpu())?;
    /// let y = x.logsumexp(&[1], false)?.to_vec::<f32>()?;
    /// assert_eq!(y, vec![1000. + 2f32.ln(), 0.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn logsumexp(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return self.to_dtype(DType::F32)?.logsumexp(dims, keepdim);
        }
        let dims = resolve_reduce_dims("logsumexp", dims, self.rank())?;
        let empty = dims.iter().any(|&d| self.dims().get(d) == Some(&0));
        // The shift is a constant for the gradient; an infinite maximum
        // shifts by 0 (∞ − ∞ would be NaN), and an empty slice has none.
        let m = if empty {
            let kept: Vec<usize> = (0..self.rank()).map(|d| if dims.contains(&d) { 1 } else { self.dims()[d] }).collect();
            Tensor::zeros(kept, self.dtype(), &self.device())?
        } else {
            let m = self.detach().reduce(Reduction::Max, &dims, true)?;
            let infinite = m.abs()?.binary(&m.scalar_like(f64::INFINITY)?, BinaryOp::Eq)?;
            crate::ops::zero_where(&infinite, &m)?
        };
        let lse = self.sub(&m)?.exp()?.sum_dims(&dims, true)?.log()?.add(&m)?;
        if keepdim {
            return Ok(lse);
        }
        let squeezed: Vec<usize> = (0..self.rank()).filter(|d| !dims.contains(d)).map(|d| self.dims()[d]).collect();
        lse.reshape(squeezed)
    }

    /// GELU, exact: x · Φ(x) = x/2 · (1 + erf(x/√2)) (PyTorch's default
    /// `gelu`, its formula and its gradient Φ(x) + x·φ(x), through the
    /// primitives). Integers compute in f32. gelu(+∞) = +∞ (PyTorch's
    /// vectorised f32 CPU kernel gives NaN; the README's table).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let y = Tensor::new(&[-1f32, 0., 1.], &cpu())?.gelu()?.to_vec::<f32>()?;
    /// assert!((y[2] - 0.8413447).abs() < 1e-6 && y[1] == 0.0 && (y[0] + 0.15865526).abs() < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn gelu(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return self.to_dtype(DType::F32)?.gelu();
        }
        let cdf = self.mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?.erf()?.affine(0.5, 0.5)?;
        self.mul(&cdf)
    }
    /// GELU, tanh approximation: x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))
    /// (PyTorch's `gelu(approximate="tanh")`, the formula of GPT-2 and BERT).
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return self.to_dtype(DType::F32)?.gelu_tanh();
        }
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let inner = self.add(&self.powi(3)?.mul_scalar(0.044715)?)?.mul_scalar(k)?;
        self.mul(&inner.tanh()?.affine(0.5, 0.5)?)
    }
    /// SiLU (swish): x · σ(x). Integers compute in f32.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let y = Tensor::new(&[0f32, 1.], &cpu())?.silu()?.to_vec::<f32>()?;
    /// assert_eq!(y[0], 0.0);
    /// assert!((y[1] - 0.7310586).abs() < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn silu(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return self.to_dtype(DType::F32)?.silu();
        }
        self.mul(&self.sigmoid()?)
    }
}
