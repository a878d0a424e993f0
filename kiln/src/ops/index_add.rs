//! `index_add`: adds the rows of a source into a copy of a tensor at the
//! entries of one dimension named by an index tensor (repeated indices
//! accumulate, in order); the adjoint of `index_select`.

use super::index_select::{index_list, split_at_dim, IndexArgs, INDEX_DTYPES};
use crate::backends::host::gather_view;
use crate::backends::host::num::Num;
use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::kernel::cuda::{c_type, dtype_tag, lay, CudaDevice, CudaModule, BLOCK};
use crate::kernel::index_check::IndexCheck;
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::tensor::{check_dim, check_same_device, check_same_dtype, Dim};
use crate::Tensor;
use std::sync::Arc;

/// out (outer, d, inner), in place, += input 0 (outer, n, inner) at the
/// indices of input 1.
#[derive(Clone, Copy, Debug)]
struct IndexAdd {
    dim: usize,
}

/// The index check of `index_add`.
const CHECK: IndexCheck = IndexCheck::index("index_add");

fn add_rows<T: Copy>(s: &[T], dims: &[usize], ids: &[usize], dim: usize, out: &mut [T], add: impl Fn(T, T) -> T) {
    let (outer, n, inner) = split_at_dim(dims, dim);
    let d = out.len() / (outer * inner).max(1);
    for i in 0..outer {
        for (j, &id) in ids.iter().enumerate().take(n) {
            // Checked by `index_list`; an empty destination has no rows.
            if id >= d {
                continue;
            }
            let (src, dst) = ((i * n + j) * inner, (i * d + id) * inner);
            for q in 0..inner {
                out[dst + q] = add(out[dst + q], s[src + q]);
            }
        }
    }
}

/// Half precision accumulates in f32 and rounds once per addition.
fn add_half<T: WithDType>(a: T, b: T) -> T {
    T::from_f64((a.to_f64() as f32 + b.to_f64() as f32) as f64)
}

impl CustomKernel for IndexAdd {
    fn name(&self) -> &'static str {
        "index_add"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let (src, ids) = (&inputs[0], &inputs[1]);
        let (dims, dim) = (src.layout.dims(), self.dim);
        let (outer, _, inner) = split_at_dim(dims, dim);
        let bound = out.len() / (outer * inner).max(1);
        let ids = index_list(ids.buf, ids.layout, CHECK, bound, dim)?;
        let data = gather_view(src.buf, src.layout)?;
        match (&data, out) {
            (CpuBuffer::F32(s), CpuBuffer::F32(o)) => add_rows(s, dims, &ids, dim, o, Num::add),
            (CpuBuffer::F64(s), CpuBuffer::F64(o)) => add_rows(s, dims, &ids, dim, o, Num::add),
            (CpuBuffer::I64(s), CpuBuffer::I64(o)) => add_rows(s, dims, &ids, dim, o, Num::add),
            (CpuBuffer::I32(s), CpuBuffer::I32(o)) => add_rows(s, dims, &ids, dim, o, Num::add),
            (CpuBuffer::U8(s), CpuBuffer::U8(o)) => add_rows(s, dims, &ids, dim, o, Num::add),
            (CpuBuffer::F16(s), CpuBuffer::F16(o)) => add_rows(s, dims, &ids, dim, o, add_half),
            (CpuBuffer::BF16(s), CpuBuffer::BF16(o)) => add_rows(s, dims, &ids, dim, o, add_half),
            _ => return Err(crate::backends::host::unsupported_op("index_add")),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (src, ids) = (&inputs[0], &inputs[1]);
        let (outer, n, inner) = split_at_dim(src.layout.dims(), self.dim);
        let n = n.min(ids.layout.elem_count());
        let d = out.len / (outer * inner).max(1);
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
        let name = format!("index_add_{}_{}", dtype_tag(src.storage.dtype), dtype_tag(ids.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(outer * inner), BLOCK, &args)
    }
    fn writes_nothing(&self, inputs: &[Src<'_>], out_len: usize) -> bool {
        out_len == 0 || inputs[0].layout.elem_count() == 0
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("index_add", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(IndexArgs::C_DECL);
    s.push_str(
        r#"
// dst (outer, d, inner) += src (outer, n, inner) at the ids. One thread per
// (outer, inner) position walks the ids in order: no atomics, and repeated
// indices accumulate in the CPU's order.
template <typename T, typename I> __device__ void index_add_impl(const IndexArgs& p) {
    const T* src = (const T*)p.src;
    const I* ids = (const I*)p.ids;
    T* dst = (T*)p.out;
    GRID_LOOP(t, p.outer * p.inner) {
        u64 q = t % p.inner;
        u64 i = t / p.inner;
        for (u64 j = 0; j < p.n; ++j) {
            i64 v = read_raw(ids, p.li, j);
            // A bad index is recorded (reported by the next synchronising
            // call) and its row skipped.
            if (!kiln_index_ok(p.fault, p.site, v, p.d, p.dim)) continue;
            u64 o = (i * p.d + (u64)v) * p.inner + q;
            dst[o] = Ar<T>::add(dst[o], src[lay_off(p.sl, (i * p.n + j) * p.inner + q)]);
        }
    }
}
"#,
    );
    for dt in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8] {
        for it in INDEX_DTYPES {
            let (tn, tt, in_, iy) = (dtype_tag(dt), c_type(dt), dtype_tag(it), c_type(it));
            s.push_str(&format!("extern \"C\" __global__ void index_add_{tn}_{in_}(IndexArgs p) {{ index_add_impl<{tt}, {iy}>(p); }}\n"));
        }
    }
    s
}

impl Tensor {
    /// Adds `src` into a copy of `self` at the entries of `dim` named by `ids`
    /// (a 1-D i64, i32 or u8 tensor on `self`'s device; repeated indices
    /// accumulate). The adjoint of `index_select`.
    ///
    /// An index below 0 or at least the size of `dim` is an error: on the
    /// CPU `InvalidArgument` at the call, as in PyTorch; on a GPU (simulated
    /// or CUDA) the kernel checks the indices (they are not read back to the
    /// host) and a bad one poisons the device's queue, so that the next
    /// synchronising call returns `KernelFailed` naming `index_add`, the
    /// index and the size (PyTorch's device-side assert). `src` must have
    /// `self`'s dtype, as in PyTorch.
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
        if self.rank() == 0 {
            // As PyTorch: a 0-d tensor takes dimension 0 or -1, one index (0)
            // and a 0-d source.
            dim.index("index_add", 1)?;
            if ids.elem_count() != 1 || src.rank() != 0 {
                return Err(Error::shape("index_add", src.dims(), &[]));
            }
            return self.reshape(1)?.index_add(ids, &src.reshape(1)?, 0)?.reshape(());
        }
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
        self.check_index_values(ids, dim, "index_add")?;
        let out = self.force_copy()?;
        let op = IndexAdd { dim };
        crate::backends::launch_into(
            &Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![src.src(), ids.src()] },
            &out.storage,
        )?;
        Ok(crate::autograd::record(out, &[self, src, ids], false, || {
            Box::new(move |c| {
                let (src, ids) = (&c.inputs[1], &c.inputs[2]);
                Ok(smallvec::smallvec![
                    crate::ops::need(&c.inputs[0], || Ok(c.g.clone()))?,
                    crate::ops::need(src, || c.g.index_select(ids, dim))?,
                    None
                ])
            })
        }))
    }
}
