//! Joining tensors: `cat` along an existing dimension (one copy per piece
//! into a view of the output) and `stack` along a new one.

use super::copy::CopyOp;
use crate::base::error::{Error, Result};
use crate::base::shape::{Layout, Shape};
use crate::kernel::{Kernel, OpRef};
use crate::tensor::{check_dim, check_same_device, Dim};
use crate::Tensor;

impl Tensor {
    /// Joins tensors along an existing dimension. Tensors of several dtypes
    /// are promoted as PyTorch does ([`Tensor::result_type`]), each piece
    /// converted as it is copied in; each gradient comes back in its
    /// piece's dtype.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let a = Tensor::new(&[[1f32, 2.]], &cpu())?;
    /// let b = Tensor::new(&[[3f32, 4.]], &cpu())?;
    /// assert_eq!(Tensor::cat(&[&a, &b], 0)?.dims(), &[2, 2]);
    /// assert_eq!(Tensor::cat(&[&a, &b], 1)?.to_vec::<f32>()?, vec![1., 2., 3., 4.]);
    /// let i = Tensor::new(&[[5u8, 6]], &cpu())?;
    /// assert_eq!(Tensor::cat(&[&i, &a], 0)?.to_vec::<f32>()?, vec![5., 6., 1., 2.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn cat(tensors: &[&Tensor], dim: impl Dim) -> Result<Tensor> {
        let first = *tensors.first().ok_or_else(|| Error::invalid("cat", "needs at least one tensor"))?;
        let dim = dim.index("cat", first.rank())?;
        check_dim("cat", dim, first.rank())?;
        let mut total = 0;
        for t in tensors {
            check_same_device("cat", first, t)?;
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
        // PyTorch's promotion: each piece is converted on its copy.
        let dtype = Tensor::result_type(tensors);
        let out = first.alloc_like(dtype, &shape)?;
        let full = Layout::contiguous(shape.clone());
        let mut start = 0;
        for t in tensors {
            let n = t.dims()[dim];
            let op = CopyOp { dst_layout: full.narrow(dim, start, n) };
            crate::backends::launch_into(&Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![t.src()] }, &out)?;
            start += n;
        }
        let t = Tensor::from_storage(out, shape);
        Ok(crate::autograd::record(t, tensors, false, || {
            Box::new(move |c| {
                let mut start = 0;
                let mut grads = smallvec::SmallVec::new();
                for x in c.inputs {
                    let n = x.dims()[dim];
                    // Back to the piece's own dtype.
                    grads.push(Some(c.g.narrow(dim, start, n)?.to_dtype(x.dtype())?));
                    start += n;
                }
                Ok(grads)
            })
        }))
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
