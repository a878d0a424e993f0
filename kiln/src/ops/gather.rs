//! `gather`: out[i][j][k] = input[i][index[i][j][k]][k] (for dim 1), the
//! output of the index's shape (PyTorch's `torch.gather`); and the checks
//! `scatter`/`scatter_add` share with it.
//!
//! The input is read through a view of the index's shape with the input's
//! strides and stride 0 along `dim`: element t of the output is that view's
//! element t plus `index[t]` times the input's stride along `dim`. So one
//! loop over the output serves every rank, and strided or broadcast inputs
//! are read in place.

use super::index_select::{index_list, raw_indices};
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{Dims, Layout, Shape};
use crate::kernel::cuda::{c_type, dtype_tag, lays, CudaDevice, CudaModule, BLOCK};
use crate::kernel::index_check::IndexCheck;
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::tensor::{check_same_device, Dim};
use crate::Tensor;
use std::sync::Arc;

/// The index dtypes `gather` and `scatter` take (PyTorch takes i64 only).
pub(crate) const GATHER_INDEX_DTYPES: [DType; 2] = [DType::I64, DType::I32];

/// Every dtype: gather and scatter move elements and never compute on them
/// (scatter_add adds half types in f32, as index_add does).
pub(crate) const ALL_DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16];

/// A view of `of` with the dims `dims` and stride 0 along `dim` (the base of
/// each position: the caller adds the position along `dim`).
pub(crate) fn base_view(of: &Layout, dims: &[usize], dim: usize) -> Layout {
    let mut strides: Dims = of.strides.clone();
    strides[dim] = 0;
    Layout { shape: Shape::from(dims.to_vec()), strides, offset: of.offset }
}

/// Checks `index` for `gather` (src = None) or `scatter` (src = Some) on
/// `input` along `dim`, as PyTorch's `gather_shape_check` and
/// `scatter_shape_check` do: an integer index of the same rank (0-d counts
/// as 1-d), index.size(d) ≤ input.size(d) for d ≠ dim and ≤ src.size(d) for
/// every d. An empty index is not checked further (PyTorch). The values of
/// an index on the CPU are checked against input.size(dim); a GPU index is
/// not read back (a hidden transfer and a sync): the kernels check each
/// index they read (`kernel::index_check`) and the next synchronising call
/// reports a bad one.
pub(crate) fn check_index(op: &str, input: &Tensor, dim: usize, index: &Tensor, src: Option<&Tensor>) -> Result<()> {
    check_same_device(op, input, index)?;
    if !GATHER_INDEX_DTYPES.contains(&index.dtype()) {
        return Err(Error::invalid(
            op,
            format!("the index must be an i64 or i32 tensor, got {}; convert it with `.to_dtype(kiln::DType::I64)?`", index.dtype()),
        ));
    }
    if index.elem_count() == 0 {
        return Ok(());
    }
    let rank = input.rank().max(1);
    let (ind, inp) = (padded(index.dims()), padded(input.dims()));
    if index.rank().max(1) != rank {
        return Err(Error::shape(op, index.dims(), input.dims()));
    }
    if let Some(d) = (0..rank).find(|&d| d != dim && ind[d] > inp[d]) {
        return Err(Error::invalid(
            op,
            format!(
                "the index's shape {:?} is larger than the input's {:?} at dimension {d} ({} > {}); \
                 index.size(d) <= input.size(d) is needed for every d != dim ({dim})",
                index.dims(),
                input.dims(),
                ind[d],
                inp[d]
            ),
        ));
    }
    if let Some(src) = src {
        let sd = padded(src.dims());
        if src.rank().max(1) != rank {
            return Err(Error::shape(op, index.dims(), src.dims()));
        }
        if let Some(d) = (0..rank).find(|&d| ind[d] > sd[d]) {
            return Err(Error::invalid(
                op,
                format!(
                    "the index's shape {:?} is larger than src's {:?} at dimension {d} ({} > {}); \
                     index.size(d) <= src.size(d) is needed for every d",
                    index.dims(),
                    src.dims(),
                    ind[d],
                    sd[d]
                ),
            ));
        }
    }
    if index.device().is_cpu() {
        let size = inp[dim];
        let list = {
            let r = index.storage.read();
            raw_indices(r.host(), &index.layout)?
        };
        if let Some(&bad) = list.iter().find(|&&i| usize::try_from(i).map_or(true, |i| i >= size)) {
            return Err(Error::invalid(op, format!("index {bad} is out of bounds for dimension {dim} with size {size}")));
        }
    }
    Ok(())
}

/// The dims of a tensor with a 0-d one as [1] (PyTorch's `ensure_nonempty`).
fn padded(dims: &[usize]) -> Vec<usize> {
    if dims.is_empty() {
        vec![1]
    } else {
        dims.to_vec()
    }
}

crate::kernel_args! {
    /// gather: out (n, contiguous) = src at view `sl` + ids (view `li`) · dstride.
    /// `fault`, `site` and `dim` for the index check (`kiln_index_ok`).
    GatherArgs { src: u64, sl: Lay, ids: u64, li: Lay, out: u64, n: u64, size: u64, dstride: u64, fault: u64, site: u64, dim: i64 }
}

/// The index check of `gather`.
const CHECK: IndexCheck = IndexCheck::index("gather");

/// out (the index's shape) = input 0 at the indices of input 1 along `dim`.
#[derive(Clone, Copy, Debug)]
struct Gather {
    dim: usize,
}

fn gather_host<T: Copy + Default>(s: &[T], view: &Layout, ids: &[usize], size: usize, dstride: usize, out: &mut [T]) {
    for ((o, base), &id) in out.iter_mut().zip(view.offsets()).zip(ids) {
        // `index_list` checked every index against `size` (a bad one on a
        // simulated GPU failed the kernel); the test only keeps the read in
        // bounds whatever the caller.
        *o = if id < size { s[base + id * dstride] } else { T::default() };
    }
}

impl CustomKernel for Gather {
    fn name(&self) -> &'static str {
        "gather"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let (src, ids) = (&inputs[0], &inputs[1]);
        let view = base_view(src.layout, ids.layout.dims(), self.dim);
        let (size, dstride) = (src.layout.dims()[self.dim], src.layout.strides()[self.dim]);
        let ids = index_list(ids.buf, ids.layout, CHECK, size, self.dim)?;
        match (src.buf, out) {
            (CpuBuffer::F32(s), CpuBuffer::F32(o)) => gather_host(s, &view, &ids, size, dstride, o),
            (CpuBuffer::F64(s), CpuBuffer::F64(o)) => gather_host(s, &view, &ids, size, dstride, o),
            (CpuBuffer::I64(s), CpuBuffer::I64(o)) => gather_host(s, &view, &ids, size, dstride, o),
            (CpuBuffer::I32(s), CpuBuffer::I32(o)) => gather_host(s, &view, &ids, size, dstride, o),
            (CpuBuffer::U8(s), CpuBuffer::U8(o)) => gather_host(s, &view, &ids, size, dstride, o),
            (CpuBuffer::F16(s), CpuBuffer::F16(o)) => gather_host(s, &view, &ids, size, dstride, o),
            (CpuBuffer::BF16(s), CpuBuffer::BF16(o)) => gather_host(s, &view, &ids, size, dstride, o),
            _ => return Err(crate::backends::host::unsupported_op("gather")),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (src, ids) = (&inputs[0], &inputs[1]);
        let view = base_view(&src.layout, ids.layout.dims(), self.dim);
        let l = lays(dev, &[&view, &ids.layout])?;
        let n = ids.layout.elem_count();
        let (fault, site) = CHECK.cuda(dev)?;
        let args = GatherArgs {
            src: dev.ptr(&src.storage)?,
            sl: l[0],
            ids: dev.ptr(&ids.storage)?,
            li: l[1],
            out: dev.ptr(out)?,
            n: n as u64,
            size: src.layout.dims()[self.dim] as u64,
            dstride: src.layout.strides()[self.dim] as u64,
            fault,
            site,
            dim: self.dim as i64,
        };
        let name = format!("gather_{}_{}", dtype_tag(src.storage.dtype), dtype_tag(ids.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(n), BLOCK, &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("gather", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(GatherArgs::C_DECL);
    s.push_str(
        r#"
// out[t] = src[base(t) + ids[t] * dstride], one thread per output element.
template <typename T, typename I> __device__ void gather_impl(const GatherArgs& p) {
    const T* src = (const T*)p.src;
    const I* ids = (const I*)p.ids;
    T* out = (T*)p.out;
    GRID_LOOP(t, p.n) {
        i64 id = read_raw(ids, p.li, t);
        // A bad index is recorded in the fault record (reported by the next
        // synchronising call) and reads a zero.
        out[t] = kiln_index_ok(p.fault, p.site, id, p.size, p.dim) ? src[lay_off(p.sl, t) + (i64)((u64)id * p.dstride)] : Cv<T>::from(0.0);
    }
}
"#,
    );
    for dt in ALL_DTYPES {
        for it in GATHER_INDEX_DTYPES {
            let (tn, tt, in_, iy) = (dtype_tag(dt), c_type(dt), dtype_tag(it), c_type(it));
            s.push_str(&format!("extern \"C\" __global__ void gather_{tn}_{in_}(GatherArgs p) {{ gather_impl<{tt}, {iy}>(p); }}\n"));
        }
    }
    s
}

impl Tensor {
    /// Values along `dim` picked by `index` (PyTorch's `torch.gather`): for
    /// a 3-D input and dim 1, `out[i][j][k] = self[i][index[i][j][k]][k]`.
    /// The index (i64, or i32) has the input's rank, `index.size(d) <=
    /// self.size(d)` for every other dimension, and gives the output its
    /// shape. Every dtype; the input may be any view (transposed,
    /// broadcast). The gradient scatters back, summing over repeated
    /// indices: `zeros.scatter_add(dim, index, g)`.
    ///
    /// An index below 0 or at least `self.size(dim)` is an
    /// `InvalidArgument` error on the CPU, as in PyTorch; on a GPU (simulated
    /// or CUDA) the indices are not read back to the host (a hidden transfer
    /// and a sync): the kernel checks them, and the next synchronising call
    /// (a read, `synchronize`) returns `KernelFailed` naming `gather`, the
    /// index and the size (see the README's table "Where kiln differs from
    /// PyTorch"). PyTorch takes i64 indices only; kiln takes i32 too.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?.requires_grad_();
    /// let index = Tensor::new(&[[0i64, 0], [1, 0]], &cpu())?;
    /// let y = x.gather(1, &index)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![1., 1., 4., 3.]);
    /// y.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2., 0., 1., 1.]);
    /// // On the CPU a bad index is an error.
    /// assert!(x.gather(-1, &Tensor::new(&[[2i64]], &cpu())?).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn gather(&self, dim: impl Dim, index: &Tensor) -> Result<Tensor> {
        let dim = dim.index("gather", self.rank().max(1))?;
        check_index("gather", self, dim, index, None)?;
        self.gather_checked(dim, index)
    }

    /// [`gather`](Self::gather) with an index known to fit (`sort`'s own).
    pub(crate) fn gather_checked(&self, dim: usize, index: &Tensor) -> Result<Tensor> {
        if self.rank() == 0 || index.rank() == 0 {
            // As 1-d tensors of one element (PyTorch's `ensure_nonempty`).
            let (x, i) = (self.reshape(padded(self.dims()))?, index.reshape(padded(index.dims()))?);
            return x.gather_checked(dim, &i)?.reshape(index.shape().clone());
        }
        // An empty index writes nothing (the kernel is skipped) but still
        // records, so that the input's gradient is zeros, not missing.
        let op = Gather { dim };
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src(), index.src()] };
        let t = self.run_new(kernel, self.dtype(), index.shape().clone())?;
        Ok(crate::autograd::record(t, &[self, index], false, || {
            Box::new(move |c| {
                let (x, index) = (&c.inputs[0], &c.inputs[1]);
                Ok(smallvec::smallvec![Some(x.zeros_like()?.scatter_add(dim, index, c.g)?), None])
            })
        }))
    }
}
