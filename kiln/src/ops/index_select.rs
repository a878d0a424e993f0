//! `index_select`: the entries of one dimension picked by a 1-D index
//! tensor (i64, i32 or u8), and the index helpers `index_add` shares.

use crate::backends::host::gather_view;
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{Layout, Shape};
use crate::kernel::cuda::{c_type, dtype_tag, lay, CudaDevice, CudaModule, BLOCK};
use crate::kernel::index_check::IndexCheck;
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::runtime::memory::try_vec;
use crate::tensor::{check_dim, check_same_device, Dim};
use crate::Tensor;
use std::sync::Arc;

/// Calls `each` with the values of an index view (i64, i32 or u8) in
/// order, as they are, without a copy; stops at `each`'s first error.
fn for_each_index(buf: &CpuBuffer, l: &Layout, mut each: impl FnMut(i64) -> Result<()>) -> Result<()> {
    match (buf, l.contiguous_range()) {
        (CpuBuffer::I64(v), Some((a, b))) => v[a..b].iter().try_for_each(|&i| each(i)),
        (CpuBuffer::I32(v), Some((a, b))) => v[a..b].iter().try_for_each(|&i| each(i64::from(i))),
        (CpuBuffer::U8(v), Some((a, b))) => v[a..b].iter().try_for_each(|&i| each(i64::from(i))),
        (CpuBuffer::I64(v), None) => l.offsets().try_for_each(|o| each(v[o])),
        (CpuBuffer::I32(v), None) => l.offsets().try_for_each(|o| each(i64::from(v[o]))),
        (CpuBuffer::U8(v), None) => l.offsets().try_for_each(|o| each(i64::from(v[o]))),
        (other, _) => Err(Error::invalid("index", format!("indices of dtype {} reached a kernel (a kiln bug)", other.dtype()))),
    }
}

/// The values of an index view (i64, i32 or u8), as they are.
pub(crate) fn raw_indices(buf: &CpuBuffer, l: &Layout) -> Result<Vec<i64>> {
    let mut out = try_vec(l.elem_count())?;
    for_each_index(buf, l, |i| {
        out.push(i);
        Ok(())
    })?;
    Ok(out)
}

/// The indices of an index view as positions below `bound`, checked: the
/// first bad one is `check`'s error (see `kernel::index_check`: the CPU's
/// front end has raised it already; on a simulated GPU it poisons the queue).
pub(crate) fn index_list(buf: &CpuBuffer, l: &Layout, check: IndexCheck, bound: usize, dim: usize) -> Result<Vec<usize>> {
    let mut out = try_vec(l.elem_count())?;
    for_each_index(buf, l, |v| {
        out.push(check.check(v, bound, dim)?);
        Ok(())
    })?;
    Ok(out)
}

/// The first value of an index view outside `0..bound`, if any.
pub(crate) fn first_bad_index(buf: &CpuBuffer, l: &Layout, bound: usize) -> Result<Option<i64>> {
    let mut bad = None;
    // The "error" stops the walk at the first bad value.
    let walk = for_each_index(buf, l, |v| match usize::try_from(v) {
        Ok(i) if i < bound => Ok(()),
        _ => {
            bad = Some(v);
            Err(Error::invalid("index", "out of range"))
        }
    });
    match (walk, bad) {
        (_, Some(v)) => Ok(Some(v)),
        (Err(e), None) => Err(e),
        (Ok(()), None) => Ok(None),
    }
}

/// The index check of `index_select`.
const CHECK: IndexCheck = IndexCheck::index("index_select");

/// (outer, size, inner) of `dims` around `dim`.
pub(crate) fn split_at_dim(dims: &[usize], dim: usize) -> (usize, usize, usize) {
    (dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product())
}

crate::kernel_args! {
    /// An indexing kernel's argument: src (outer, d, inner), ids (n), out;
    /// `fault`, `site` and `dim` for the index check (`kiln_index_ok`).
    IndexArgs { src: u64, sl: Lay, ids: u64, li: Lay, out: u64, outer: u64, d: u64, n: u64, inner: u64, fault: u64, site: u64, dim: i64 }
}

/// The index dtypes kernels take, with their C types.
pub(crate) const INDEX_DTYPES: [DType; 3] = [DType::I64, DType::I32, DType::U8];

/// out (outer, n, inner) = input 0 (outer, d, inner) at the indices in input 1.
#[derive(Clone, Copy, Debug)]
struct IndexSelect {
    dim: usize,
}

fn select<T: Copy>(s: &[T], dims: &[usize], ids: &[usize], dim: usize, out: &mut [T]) {
    let (outer, d, inner) = split_at_dim(dims, dim);
    let mut o = 0;
    for i in 0..outer {
        for &id in ids {
            // Checked by `index_list`.
            debug_assert!(id < d);
            let start = (i * d + id) * inner;
            if inner == 1 {
                // Rows of one element (labels, a column): no copy call.
                out[o] = s[start];
            } else {
                out[o..o + inner].copy_from_slice(&s[start..start + inner]);
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
        let ids = index_list(ids.buf, ids.layout, CHECK, src.layout.dims()[self.dim], self.dim)?;
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
        let (fault, site) = CHECK.cuda(dev)?;
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
            fault,
            site,
            dim: self.dim as i64,
        };
        let name = format!("index_select_{}_{}", dtype_tag(src.storage.dtype), dtype_tag(ids.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(outer * n * inner), BLOCK, &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("index_select", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(IndexArgs::C_DECL);
    s.push_str(
        r#"
// out (outer, n, inner) = src (outer, d, inner) at the ids; an out-of-range
// id is recorded in the fault record (reported by the next synchronising
// call) and gives zeros.
template <typename T, typename I> __device__ void index_select_impl(const IndexArgs& p) {
    const T* src = (const T*)p.src;
    const I* ids = (const I*)p.ids;
    T* out = (T*)p.out;
    GRID_LOOP(t, p.outer * p.n * p.inner) {
        u64 q = t % p.inner;
        u64 j = (t / p.inner) % p.n;
        u64 i = t / (p.inner * p.n);
        i64 id = read_raw(ids, p.li, j);
        out[t] = kiln_index_ok(p.fault, p.site, id, p.d, p.dim) ? src[lay_off(p.sl, (i * p.d + (u64)id) * p.inner + q)] : Cv<T>::from(0.0);
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
    /// An index below 0 or at least the size of `dim` is an error. On the
    /// CPU it is `InvalidArgument` at the call, as in PyTorch. On a GPU
    /// (simulated or CUDA) the indices are not read back to the host, which
    /// would be a hidden transfer and a device sync: the kernel checks them,
    /// and a bad one poisons the device's queue, so that the next
    /// synchronising call (`synchronize`, `block_until_ready`, a read)
    /// returns `KernelFailed` naming `index_select`, the index and the size,
    /// as CUDA's device-side assert does in PyTorch.
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
    /// // A 0-d tensor is one element, as in PyTorch.
    /// assert_eq!(Tensor::new(&7f32, &cpu())?.index_select(&Tensor::new(&[0i64], &cpu())?, 0)?.to_vec::<f32>()?, vec![7.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn index_select(&self, ids: &Tensor, dim: impl Dim) -> Result<Tensor> {
        if self.rank() == 0 {
            // As PyTorch: a 0-d tensor takes dimension 0 or -1 and one index (0).
            dim.index("index_select", 1)?;
            if ids.elem_count() != 1 {
                return Err(Error::invalid("index_select", format!("a 0-d tensor takes one index, got {}", ids.elem_count())));
            }
            return self.reshape(1)?.index_select(ids, 0)?.reshape(());
        }
        let dim = dim.index("index_select", self.rank())?;
        check_same_device("index_select", self, ids)?;
        check_dim("index_select", dim, self.rank())?;
        let n = self.index_list_len(ids, dim, "index_select")?;
        self.check_index_values(ids, dim, "index_select")?;
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

    /// Checks an index tensor's dtype and rank; returns the number of indices.
    pub(crate) fn index_list_len(&self, ids: &Tensor, _dim: usize, op: &str) -> Result<usize> {
        if !matches!(ids.dtype(), DType::I64 | DType::I32 | DType::U8) || ids.rank() != 1 {
            return Err(Error::invalid(
                op,
                format!("indices must be a 1-D i64, i32 or u8 tensor, got {} of shape {}", ids.dtype(), ids.shape()),
            ));
        }
        Ok(ids.elem_count())
    }

    /// Checks the values of an index tensor against the size of `dim` when
    /// it is on the host, last of an op's checks (so that every other error
    /// is the same on every device). A GPU index is not read back: that
    /// would be a hidden transfer; the kernels check them
    /// (`kernel::index_check`).
    pub(crate) fn check_index_values(&self, ids: &Tensor, dim: usize, op: &str) -> Result<()> {
        if ids.device().is_cpu() {
            let size = self.dims()[dim];
            let bad = {
                let r = ids.storage.read();
                first_bad_index(r.host(), &ids.layout, size)?
            };
            if let Some(bad) = bad {
                return Err(Error::invalid(op, format!("index {bad} is out of range for dimension {dim} of size {size}")));
            }
        }
        Ok(())
    }
}
