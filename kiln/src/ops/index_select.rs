//! `index_select`: the entries of one dimension picked by a 1-D index
//! tensor (i64, i32 or u8), and the index helpers `index_add` shares.

use crate::backends::host::{gather_view, try_vec};
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{Layout, Shape};
use crate::kernel::cuda::{c_type, dtype_tag, lay, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::tensor::{check_dim, check_same_device, Dim};
use crate::Tensor;
use std::sync::Arc;

/// The indices of an index view as positions. A negative index (only
/// possible on a GPU, where the front end does not read them back) becomes
/// usize::MAX: it selects nothing, like one past the end.
pub(crate) fn index_list(buf: &CpuBuffer, l: &Layout) -> Result<Vec<usize>> {
    let mut out = try_vec(l.elem_count())?;
    match buf {
        CpuBuffer::I64(v) => out.extend(l.offsets().map(|o| usize::try_from(v[o]).unwrap_or(usize::MAX))),
        CpuBuffer::I32(v) => out.extend(l.offsets().map(|o| usize::try_from(v[o]).unwrap_or(usize::MAX))),
        CpuBuffer::U8(v) => out.extend(l.offsets().map(|o| v[o] as usize)),
        other => return Err(Error::invalid("index", format!("indices of dtype {} reached a kernel (a kiln bug)", other.dtype()))),
    }
    Ok(out)
}

/// (outer, size, inner) of `dims` around `dim`.
pub(crate) fn split_at_dim(dims: &[usize], dim: usize) -> (usize, usize, usize) {
    (dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product())
}

crate::kernel_args! {
    /// An indexing kernel's argument: src (outer, d, inner), ids (n), out.
    IndexArgs { src: u64, sl: Lay, ids: u64, li: Lay, out: u64, outer: u64, d: u64, n: u64, inner: u64 }
}

/// The index dtypes kernels take, with their C types.
pub(crate) const INDEX_DTYPES: [DType; 3] = [DType::I64, DType::I32, DType::U8];

/// out (outer, n, inner) = input 0 (outer, d, inner) at the indices in input 1.
#[derive(Clone, Copy, Debug)]
struct IndexSelect {
    dim: usize,
}

fn select<T: Copy + Default>(s: &[T], dims: &[usize], ids: &[usize], dim: usize, out: &mut [T]) {
    let (outer, d, inner) = split_at_dim(dims, dim);
    let mut o = 0;
    for i in 0..outer {
        for &id in ids {
            // Out-of-range indices (only possible on a GPU) select zeros.
            if id < d {
                let start = (i * d + id) * inner;
                out[o..o + inner].copy_from_slice(&s[start..start + inner]);
            } else {
                out[o..o + inner].fill(T::default());
            }
            o += inner;
        }
    }
}

impl CustomKernel for IndexSelect {
    fn name(&self) -> &'static str {
        "index_select"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let (src, ids) = (&inputs[0], &inputs[1]);
        let ids = index_list(ids.buf, ids.layout)?;
        // A dense source is read in place; a strided one is gathered first.
        let gathered = if src.layout.is_contiguous() { None } else { Some(gather_view(src.buf, src.layout)?) };
        let (data, start) = match &gathered {
            Some(g) => (g, 0),
            None => (src.buf, src.layout.offset()),
        };
        let (end, dims) = (start + src.layout.elem_count(), src.layout.dims());
        let dim = self.dim;
        match (data, out) {
            (CpuBuffer::F32(s), CpuBuffer::F32(o)) => select(&s[start..end], dims, &ids, dim, o),
            (CpuBuffer::F64(s), CpuBuffer::F64(o)) => select(&s[start..end], dims, &ids, dim, o),
            (CpuBuffer::I64(s), CpuBuffer::I64(o)) => select(&s[start..end], dims, &ids, dim, o),
            (CpuBuffer::I32(s), CpuBuffer::I32(o)) => select(&s[start..end], dims, &ids, dim, o),
            (CpuBuffer::U8(s), CpuBuffer::U8(o)) => select(&s[start..end], dims, &ids, dim, o),
            (CpuBuffer::F16(s), CpuBuffer::F16(o)) => select(&s[start..end], dims, &ids, dim, o),
            (CpuBuffer::BF16(s), CpuBuffer::BF16(o)) => select(&s[start..end], dims, &ids, dim, o),
            _ => return Err(crate::backends::host::unsupported_op("index_select")),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (src, ids) = (&inputs[0], &inputs[1]);
        let (outer, d, inner) = split_at_dim(src.layout.dims(), self.dim);
        let n = ids.layout.elem_count();
        let args = IndexArgs {
            src: dev.ptr(&src.storage)?,
            sl: lay(dev, &src.layout)?,
            ids: dev.ptr(&ids.storage)?,
            li: lay(dev, &ids.layout)?,
            out: dev.ptr(out)?,
            outer: outer as u64,
            d: d as u64,
            n: n as u64,
            inner: inner as u64,
        };
        let name = format!("index_select_{}_{}", dtype_tag(src.storage.dtype), dtype_tag(ids.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(outer * n * inner), BLOCK, &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule { name: "index_select", source: cuda_source };
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(IndexArgs::C_DECL);
    s.push_str(
        r#"
// out (outer, n, inner) = src (outer, d, inner) at the ids; out-of-range ids
// give zeros.
template <typename T, typename I> __device__ void index_select_impl(const IndexArgs& p) {
    const T* src = (const T*)p.src;
    const I* ids = (const I*)p.ids;
    T* out = (T*)p.out;
    GRID_LOOP(t, p.outer * p.n * p.inner) {
        u64 q = t % p.inner;
        u64 j = (t / p.inner) % p.n;
        u64 i = t / (p.inner * p.n);
        u64 id = read_id(ids, p.li, j);
        out[t] = id < p.d ? src[lay_off(p.sl, (i * p.d + id) * p.inner + q)] : Cv<T>::from(0.0);
    }
}
"#,
    );
    for dt in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16] {
        for it in INDEX_DTYPES {
            let (tn, tt, in_, iy) = (dtype_tag(dt), c_type(dt), dtype_tag(it), c_type(it));
            s.push_str(&format!(
                "extern \"C\" __global__ void index_select_{tn}_{in_}(IndexArgs p) {{ index_select_impl<{tt}, {iy}>(p); }}\n"
            ));
        }
    }
    s
}

impl Tensor {
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
        let op = IndexSelect { dim };
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src(), ids.src()] };
        let t = self.run_new(kernel, self.dtype(), Shape::from(dims))?;
        Ok(crate::autograd::record(t, &[self, ids], false, || {
            Box::new(move |c| {
                let (x, ids) = (&c.inputs[0], &c.inputs[1]);
                Ok(smallvec::smallvec![Some(x.zeros_like()?.index_add(ids, &c.g.contiguous()?, dim)?), None])
            })
        }))
    }

    /// Checks an index tensor; its values are checked against the size when
    /// the tensor is on the host (a GPU index is not read back: that would be
    /// a hidden transfer; kernels skip out-of-range indices). Returns the
    /// number of indices.
    pub(crate) fn index_list_len(&self, ids: &Tensor, dim: usize, op: &str) -> Result<usize> {
        if !matches!(ids.dtype(), DType::I64 | DType::I32 | DType::U8) || ids.rank() != 1 {
            return Err(Error::invalid(
                op,
                format!("indices must be a 1-D i64, i32 or u8 tensor, got {} of shape {}", ids.dtype(), ids.shape()),
            ));
        }
        if ids.device().is_cpu() {
            let size = self.dims()[dim];
            let list = {
                let r = ids.storage.read();
                index_list(r.host(), &ids.layout)?
            };
            // Negative indices come back as usize::MAX, so one test covers both ends.
            if let Some(pos) = list.iter().position(|&i| i >= size) {
                let bad = ids.to_vec_f64()?[pos];
                return Err(Error::invalid(op, format!("index {bad} is out of range for dimension {dim} of size {size}")));
            }
        }
        Ok(ids.elem_count())
    }
}
