//! Ops composed of other ops, with their gradients for free: means,
//! clamping, softmax and log-softmax, the norm. A composite becomes a
//! primitive (a family member or an op of its own) only when that pays in
//! speed or exactness.

use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
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
        let dims = crate::ops::reduce::resolve_dims("mean", dims, self.rank())?;
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
}
