//! Views: reshape, transpose, permute, narrow, squeeze, unsqueeze,
//! flatten, broadcast. They copy nothing (`reshape` of a strided tensor
//! copies first); each gradient maps the output gradient back through the
//! same view.

use crate::base::error::{Error, Result};
use crate::base::shape::{Layout, Shape};
use crate::tensor::{check_dim, Dim};
use crate::Tensor;

/// The permutation that undoes `perm`.
fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

/// The gradient of a narrow: `g` placed at `start` along `dim` of zeros of
/// `x`'s shape.
fn narrow_grad(g: &Tensor, x: &Tensor, dim: usize, start: usize) -> Result<Tensor> {
    let (size, len) = (x.dims()[dim], g.dims()[dim]);
    let piece = |n: usize| -> Result<Tensor> {
        let mut dims = x.dims().to_vec();
        dims[dim] = n;
        Tensor::zeros(dims, g.dtype(), &g.device())
    };
    let mut parts = Vec::new();
    if start > 0 {
        parts.push(piece(start)?);
    }
    parts.push(g.clone());
    if start + len < size {
        parts.push(piece(size - start - len)?);
    }
    let refs: Vec<&Tensor> = parts.iter().collect();
    Tensor::cat(&refs, dim)
}

impl Tensor {
    /// A view of this tensor's storage with `layout`, whose gradient is
    /// `back(g, x)`.
    fn view(&self, layout: Layout, back: impl Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static) -> Tensor {
        let t = self.with_layout(layout);
        crate::autograd::record(t, &[self], false, || Box::new(move |c| Ok(smallvec::smallvec![Some(back(c.g, &c.inputs[0])?)])))
    }

    /// The same elements with another shape (a view when contiguous, else a copy).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::arange(0.0, 6.0, 1.0, &cpu())?;
    /// let y = x.reshape((2, 3))?;
    /// assert!(y.same_storage(&x));
    /// assert!(x.reshape((4, 2)).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.checked_elem_count("reshape")? != self.elem_count() {
            return Err(Error::shape("reshape", self.dims(), shape.dims()));
        }
        let base = if self.is_contiguous() { self.clone() } else { self.contiguous()? };
        let mut layout = Layout::contiguous(shape);
        layout.offset = base.layout.offset;
        let t = base.with_layout(layout);
        Ok(crate::autograd::record(t, &[self], false, || Box::new(|c| Ok(smallvec::smallvec![Some(c.g.reshape(c.inputs[0].shape())?)]))))
    }

    /// Swaps two dimensions (a view). Negative dimensions count from the
    /// end; a 0-d tensor takes 0 and −1 and is its own transpose (PyTorch).
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::zeros((2, 3, 4), DType::F32, &cpu())?;
    /// assert_eq!(x.transpose(0, -1)?.dims(), &[4, 3, 2]);
    /// assert!(x.transpose(0, 3).is_err());
    /// assert_eq!(Tensor::new(&1f32, &cpu())?.transpose(0, -1)?.dims(), &[] as &[usize]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn transpose(&self, a: impl Dim, b: impl Dim) -> Result<Tensor> {
        if self.rank() == 0 {
            a.index("transpose", 1)?;
            b.index("transpose", 1)?;
            return Ok(self.view(self.layout.clone(), |g, _x| Ok(g.clone())));
        }
        let (a, b) = (a.index("transpose", self.rank())?, b.index("transpose", self.rank())?);
        check_dim("transpose", a, self.rank())?;
        check_dim("transpose", b, self.rank())?;
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        Ok(self.view(self.layout.transpose(a, b), move |g, _x| g.permute(&inverse(&perm))))
    }

    /// Transpose of the last two dimensions.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2., 3.]], &cpu())?;
    /// assert_eq!(x.t()?.dims(), &[3, 1]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::invalid("t", format!("needs rank 2 or more, got shape {}", self.shape())));
        }
        self.transpose(self.rank() - 2, self.rank() - 1)
    }

    /// Reorders the dimensions (a view): dimension `i` of the result is
    /// dimension `perm[i]` of `self`. Negative dimensions count from the end,
    /// as in PyTorch.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::zeros((2, 3, 4), kiln::DType::F32, &cpu())?;
    /// assert_eq!(x.permute(&[2, 0, 1])?.dims(), &[4, 2, 3]);
    /// assert_eq!(x.permute(&[-1, 0, 1])?.dims(), &[4, 2, 3]);
    /// assert!(x.permute(&[-1, 0, 2]).is_err()); // -1 and 2 are one dimension
    /// assert!(x.permute(&[3, 0, 1]).unwrap_err().to_string().contains("rank 3"));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn permute(&self, perm: &[impl Dim]) -> Result<Tensor> {
        let perm = crate::ops::reduce::resolve_dims("permute", perm, self.rank())?;
        let perm = perm.as_slice();
        let mut seen = vec![false; self.rank()];
        if perm.len() != self.rank() || perm.iter().any(|&p| p >= self.rank() || std::mem::replace(&mut seen[p], true)) {
            return Err(Error::invalid("permute", format!("{perm:?} is not a permutation of the {} dimensions", self.rank())));
        }
        let inv = inverse(perm);
        Ok(self.view(self.layout.permute(perm), move |g, _x| g.permute(&inv)))
    }

    /// Elements `start..start+len` of dimension `dim` (a view).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::arange(0.0, 5.0, 1.0, &cpu())?;
    /// assert_eq!(x.narrow(0, 1, 3)?.to_vec::<f32>()?, vec![1., 2., 3.]);
    /// assert!(x.narrow(0, 4, 3).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn narrow(&self, dim: impl Dim, start: usize, len: usize) -> Result<Tensor> {
        let dim = dim.index("narrow", self.rank())?;
        check_dim("narrow", dim, self.rank())?;
        let size = self.dims()[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::invalid(
                "narrow",
                format!("{start}..{} is out of range for dimension {dim} of size {size}", start.saturating_add(len)),
            ));
        }
        Ok(self.view(self.layout.narrow(dim, start, len), move |g, x| narrow_grad(g, x, dim, start)))
    }

    /// Python-style slice `start..end` of a dimension (a view).
    pub fn slice(&self, dim: impl Dim, range: std::ops::Range<usize>) -> Result<Tensor> {
        let dim = dim.index("slice", self.rank())?;
        if range.end < range.start {
            return Err(Error::invalid("slice", format!("range {range:?} runs backwards")));
        }
        self.narrow(dim, range.start, range.end - range.start)
    }

    /// The i-th entry along dimension 0, with that dimension removed.
    pub fn get(&self, i: usize) -> Result<Tensor> {
        self.narrow(0, i, 1)?.squeeze(0)
    }

    /// Removes a dimension of size 1, as PyTorch's `squeeze(dim)`: a
    /// dimension of another size stays (the same view back). Negative
    /// dimensions count from the end; a 0-d tensor takes 0 and −1 and stays
    /// as it is.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::zeros((2, 1), DType::F32, &cpu())?;
    /// assert_eq!(x.squeeze(-1)?.dims(), &[2]);
    /// assert_eq!(x.squeeze(0)?.dims(), &[2, 1]);
    /// assert!(x.squeeze(2).is_err());
    /// assert_eq!(Tensor::new(&1f32, &cpu())?.squeeze(0)?.dims(), &[] as &[usize]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn squeeze(&self, dim: impl Dim) -> Result<Tensor> {
        if self.rank() == 0 {
            dim.index("squeeze", 1)?;
            return Ok(self.view(self.layout.clone(), |g, _x| Ok(g.clone())));
        }
        let dim = dim.index("squeeze", self.rank())?;
        check_dim("squeeze", dim, self.rank())?;
        if self.dims()[dim] != 1 {
            return Ok(self.view(self.layout.clone(), |g, _x| Ok(g.clone())));
        }
        let mut l = self.layout.clone();
        l.shape.0.remove(dim);
        l.strides.remove(dim);
        Ok(self.view(l, |g, x| g.reshape(x.shape())))
    }

    /// Inserts a dimension of size 1 at `dim`.
    pub fn unsqueeze(&self, dim: impl Dim) -> Result<Tensor> {
        // −1 inserts a new last dimension, as in PyTorch.
        let dim = dim.index("unsqueeze", self.rank() + 1)?;
        if dim > self.rank() {
            return Err(Error::invalid("unsqueeze", format!("position {dim} is past the {} dimensions", self.rank())));
        }
        let mut l = self.layout.clone();
        // Saturating: the strides of an empty tensor are never used to read.
        let stride = if dim < self.rank() { l.strides[dim].saturating_mul(l.shape.0[dim]) } else { 1 };
        l.shape.0.insert(dim, 1);
        l.strides.insert(dim, stride);
        Ok(self.view(l, |g, x| g.reshape(x.shape())))
    }

    /// Flattens everything into one dimension.
    pub fn flatten_all(&self) -> Result<Tensor> {
        self.reshape(self.elem_count())
    }

    /// Flattens dimensions `from..` into one (e.g. images to vectors), as
    /// PyTorch's `flatten(start_dim)`: `from` counts from the end when
    /// negative, against the tensor's rank (−1 is the last dimension, so
    /// `flatten_from(-1)` changes nothing); a 0-d tensor takes 0 and −1 and
    /// becomes `[1]`.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::zeros((2, 3, 4), DType::F32, &cpu())?;
    /// assert_eq!(x.flatten_from(1)?.dims(), &[2, 12]);
    /// assert_eq!(x.flatten_from(-2)?.dims(), &[2, 12]);
    /// assert_eq!(x.flatten_from(-3)?.dims(), &[24]);
    /// assert!(x.flatten_from(3).unwrap_err().to_string().contains("rank 3"));
    /// assert_eq!(Tensor::new(&5f32, &cpu())?.flatten_from(0)?.dims(), &[1]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn flatten_from(&self, from: impl Dim) -> Result<Tensor> {
        if self.rank() == 0 {
            // PyTorch wraps the dimension of a 0-d tensor as if it had one.
            from.index("flatten_from", 1)?;
            return self.reshape(1);
        }
        let from = from.index("flatten_from", self.rank())?;
        if from + 1 == self.rank() {
            return Ok(self.clone());
        }
        let mut dims = self.dims()[..from].to_vec();
        dims.push(crate::base::shape::checked_product("flatten_from", &self.dims()[from..])?);
        self.reshape(dims)
    }

    /// Broadcasts to a larger shape (a view with stride 0).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let b = Tensor::new(&[1f32, 2.], &cpu())?.broadcast_to((3, 2))?;
    /// assert_eq!(b.to_vec::<f32>()?, vec![1., 2., 1., 2., 1., 2.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        let l = self.layout.broadcast_as(&shape)?;
        Ok(self.view(l, |g, x| crate::ops::sum_to(g, x.dims())))
    }
}
