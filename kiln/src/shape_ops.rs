//! Views (reshape, transpose, permute, narrow, squeeze, broadcast) that copy
//! nothing, and the data-movement ops built on the copy kernel: contiguous,
//! cat, stack, index_select.

use crate::backprop::{self, BackOp};
use crate::base::shape::Layout;
use crate::op::Kernel;
use crate::tensor::{check_dim, check_same_device, check_same_dtype, Dim};
use crate::{DType, Error, Result, Shape, Tensor};
use std::borrow::Cow;

impl Tensor {
    fn view(&self, layout: Layout, op: impl FnOnce() -> BackOp) -> Tensor {
        let t = self.with_layout(layout);
        backprop::record(t, op, &[self])
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
        Ok(backprop::record(t, || BackOp::Reshape(self.clone()), &[self]))
    }

    /// A contiguous tensor with the same values (itself when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let t = self.force_copy()?;
        Ok(backprop::record(t, || BackOp::Reshape(self.clone()), &[self]))
    }

    /// Swaps two dimensions (a view).
    pub fn transpose(&self, a: impl Dim, b: impl Dim) -> Result<Tensor> {
        let (a, b) = (a.index("transpose", self.rank())?, b.index("transpose", self.rank())?);
        check_dim("transpose", a, self.rank())?;
        check_dim("transpose", b, self.rank())?;
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        Ok(self.view(self.layout.transpose(a, b), || BackOp::Permute(self.clone(), perm)))
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
        let perm = crate::ops::resolve_dims("permute", perm, self.rank())?;
        let perm = perm.as_slice();
        let mut seen = vec![false; self.rank()];
        if perm.len() != self.rank() || perm.iter().any(|&p| p >= self.rank() || std::mem::replace(&mut seen[p], true)) {
            return Err(Error::invalid("permute", format!("{perm:?} is not a permutation of the {} dimensions", self.rank())));
        }
        Ok(self.view(self.layout.permute(perm), || BackOp::Permute(self.clone(), perm.to_vec())))
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
        Ok(self.view(self.layout.narrow(dim, start, len), || BackOp::Narrow(self.clone(), dim, start)))
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

    /// Removes a dimension of size 1.
    pub fn squeeze(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("squeeze", self.rank())?;
        check_dim("squeeze", dim, self.rank())?;
        if self.dims()[dim] != 1 {
            return Err(Error::invalid("squeeze", format!("dimension {dim} has size {}, not 1", self.dims()[dim])));
        }
        let mut l = self.layout.clone();
        l.shape.0.remove(dim);
        l.strides.remove(dim);
        Ok(self.view(l, || BackOp::Reshape(self.clone())))
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
        Ok(self.view(l, || BackOp::Reshape(self.clone())))
    }

    /// Flattens everything into one dimension.
    pub fn flatten_all(&self) -> Result<Tensor> {
        self.reshape(self.elem_count())
    }

    /// Flattens dimensions `from..` into one (e.g. images to vectors).
    pub fn flatten_from(&self, from: impl Dim) -> Result<Tensor> {
        let from = from.index("flatten_from", self.rank() + 1)?;
        if from >= self.rank() {
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
        Ok(self.view(l, || BackOp::Broadcast(self.clone())))
    }

    /// Rows (entries along `dim`) picked by a 1-D i64, i32 or u8 index
    /// tensor on `self`'s device.
    ///
    /// **Out-of-range indices differ from PyTorch** (see the README's table
    /// "Where kiln differs from PyTorch"): an index below 0 or at least the
    /// size of `dim` is an `InvalidArgument` error on the CPU, as in PyTorch,
    /// but on a GPU (simulated or CUDA) the indices are not read back to the
    /// host, which would be a hidden transfer and a device sync: a bad index
    /// selects zeros instead (PyTorch raises a device-side assert).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &cpu())?;
    /// let ids = Tensor::new(&[2i64, 0], &cpu())?;
    /// assert_eq!(x.index_select(&ids, 0)?.to_vec::<f32>()?, vec![5., 6., 1., 2.]);
    /// assert_eq!(x.index_select(&Tensor::new(&[1, 1], &cpu())?, -1)?.to_vec::<f32>()?, vec![2., 2., 4., 4., 6., 6.]);
    /// // On the CPU a bad index is an error.
    /// assert!(x.index_select(&Tensor::new(&[3i64], &cpu())?, 0).is_err());
    /// assert!(x.index_select(&Tensor::new(&[-1i64], &cpu())?, 0).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn index_select(&self, ids: &Tensor, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("index_select", self.rank())?;
        check_same_device("index_select", self, ids)?;
        check_dim("index_select", dim, self.rank())?;
        let n = self.index_list_len(ids, dim, "index_select")?;
        let mut dims = self.dims().to_vec();
        dims[dim] = n;
        let shape = Shape::from(dims);
        let t = self.run_new(Kernel::IndexSelect { src: self.src(), ids: ids.src(), dim }, self.dtype(), shape)?;
        Ok(backprop::record(t, || BackOp::IndexSelect(self.clone(), ids.clone(), dim), &[self]))
    }

    /// Adds `src` into a copy of `self` at the entries of `dim` named by `ids`
    /// (a 1-D i64, i32 or u8 tensor on `self`'s device; repeated indices
    /// accumulate). The adjoint of `index_select`.
    ///
    /// **Out-of-range indices differ from PyTorch** (see the README's table
    /// "Where kiln differs from PyTorch"): an index below 0 or at least the
    /// size of `dim` is an `InvalidArgument` error on the CPU, as in PyTorch,
    /// but on a GPU (simulated or CUDA) the indices are not read back to the
    /// host: the rows of `src` at bad indices are ignored (PyTorch raises a
    /// device-side assert).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::zeros(3, kiln::DType::F32, &cpu())?;
    /// let ids = Tensor::new(&[2, 0, 2], &cpu())?;
    /// let src = Tensor::new(&[1f32, 2., 3.], &cpu())?;
    /// assert_eq!(x.index_add(&ids, &src, 0)?.to_vec::<f32>()?, vec![2., 0., 4.]);
    /// assert!(x.index_add(&Tensor::new(&[0, 3, 1], &cpu())?, &src, 0).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn index_add(&self, ids: &Tensor, src: &Tensor, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.index("index_add", self.rank())?;
        check_same_device("index_add", self, ids)?;
        check_same_device("index_add", self, src)?;
        check_same_dtype("index_add", self, src)?;
        check_dim("index_add", dim, self.rank())?;
        let n = self.index_list_len(ids, dim, "index_add")?;
        let mut expect = self.dims().to_vec();
        expect[dim] = n;
        if src.dims() != expect.as_slice() {
            return Err(Error::shape("index_add", src.dims(), &expect));
        }
        let out = self.force_copy()?;
        crate::backend::launch_into(&Kernel::IndexAdd { src: src.src(), ids: ids.src(), dim }, &out.storage)?;
        Ok(crate::backprop::record(out, || crate::backprop::BackOp::IndexAdd(self.clone(), ids.clone(), src.clone(), dim), &[self, src]))
    }

    /// Checks an index tensor; its values are checked against the size when
    /// the tensor is on the host (a GPU index is not read back: that would be
    /// a hidden transfer; kernels skip out-of-range indices). Returns the number of indices.
    fn index_list_len(&self, ids: &Tensor, dim: usize, op: &str) -> Result<usize> {
        if !matches!(ids.dtype(), DType::I64 | DType::I32 | DType::U8) || ids.rank() != 1 {
            return Err(Error::invalid(
                op,
                format!("indices must be a 1-D i64, i32 or u8 tensor, got {} of shape {}", ids.dtype(), ids.shape()),
            ));
        }
        if ids.device().is_cpu() {
            let size = self.dims()[dim];
            // Negative indices come back as usize::MAX, so one test covers both ends.
            if let Some(pos) = crate::backend::host_kernels::index_list(&ids.src())?.iter().position(|&i| i >= size) {
                let bad = ids.to_vec_f64()?[pos];
                return Err(Error::invalid(op, format!("index {bad} is out of range for dimension {dim} of size {size}")));
            }
        }
        Ok(ids.elem_count())
    }

    /// Joins tensors along an existing dimension.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let a = Tensor::new(&[[1f32, 2.]], &cpu())?;
    /// let b = Tensor::new(&[[3f32, 4.]], &cpu())?;
    /// assert_eq!(Tensor::cat(&[&a, &b], 0)?.dims(), &[2, 2]);
    /// assert_eq!(Tensor::cat(&[&a, &b], 1)?.to_vec::<f32>()?, vec![1., 2., 3., 4.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn cat(tensors: &[&Tensor], dim: impl Dim) -> Result<Tensor> {
        let first = *tensors.first().ok_or_else(|| Error::invalid("cat", "needs at least one tensor"))?;
        let dim = dim.index("cat", first.rank())?;
        check_dim("cat", dim, first.rank())?;
        let mut total = 0;
        for t in tensors {
            check_same_device("cat", first, t)?;
            check_same_dtype("cat", first, t)?;
            let same_rest = t.rank() == first.rank() && (0..t.rank()).all(|d| d == dim || t.dims()[d] == first.dims()[d]);
            if !same_rest {
                return Err(Error::shape("cat", first.dims(), t.dims()));
            }
            total = crate::base::shape::checked_sum("cat", total, t.dims()[dim], t.dims())?;
        }
        let mut dims = first.dims().to_vec();
        dims[dim] = total;
        let shape = Shape::from(dims);
        shape.checked_elem_count("cat")?;
        let out = first.alloc_like(first.dtype(), &shape)?;
        let full = Layout::contiguous(shape.clone());
        let mut start = 0;
        for t in tensors {
            let n = t.dims()[dim];
            crate::backend::launch_into(&Kernel::Copy { src: t.src(), dst_layout: Cow::Owned(full.narrow(dim, start, n)) }, &out)?;
            start += n;
        }
        let t = Tensor::from_storage(out, shape);
        let inputs: Vec<Tensor> = tensors.iter().map(|t| (*t).clone()).collect();
        Ok(backprop::record(t, || BackOp::Cat(inputs, dim), tensors))
    }

    /// Joins tensors of one shape along a new dimension.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let a = Tensor::new(&[1f32, 2.], &cpu())?;
    /// assert_eq!(Tensor::stack(&[&a, &a, &a], 0)?.dims(), &[3, 2]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn stack(tensors: &[&Tensor], dim: impl Dim) -> Result<Tensor> {
        let first = *tensors.first().ok_or_else(|| Error::invalid("stack", "needs at least one tensor"))?;
        let dim = dim.index("stack", first.rank() + 1)?;
        let expanded = tensors.iter().map(|t| t.unsqueeze(dim)).collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = expanded.iter().collect();
        Tensor::cat(&refs, dim)
    }
}
