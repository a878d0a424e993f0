//! `scatter` and `scatter_add`: a copy of a tensor with the elements of
//! `src` written (or added) along one dimension at the positions an index
//! names (PyTorch's out-of-place `torch.scatter` and `torch.scatter_add`);
//! the adjoint of `gather`.
//!
//! Deterministic on every device: one loop (one CUDA thread) per line of
//! the index along `dim` walks that line in order, and different lines
//! write disjoint elements, so there are no atomics and no races. Repeated
//! indices accumulate in index order (`scatter_add`), and the last one
//! along `dim` wins (`scatter`; PyTorch leaves which one unspecified).

use super::gather::{base_view, check_index, ALL_DTYPES, GATHER_INDEX_DTYPES};
use super::index_select::index_list;
use crate::backends::host::num::Num;
use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::base::error::Result;
use crate::base::shape::{Dims, Layout, Shape};
use crate::kernel::cuda::{c_type, dtype_tag, lays, CudaDevice, CudaModule, BLOCK};
use crate::kernel::index_check::IndexCheck;
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::tensor::{check_same_device, check_same_dtype, Dim};
use crate::Tensor;
use std::sync::Arc;

crate::kernel_args! {
    /// scatter: per line t of the index along dim, out at `ol`, src at `sl`
    /// and the ids at `il`; m ids per line, `*_ds` apart.
    ScatterArgs { out: u64, ol: Lay, src: u64, sl: Lay, ids: u64, il: Lay, lines: u64, m: u64, size: u64, out_ds: u64, src_ds: u64, ids_ds: u64, fault: u64, site: u64, dim: i64 }
}

/// The index checks of `scatter` and `scatter_add`.
const CHECK: IndexCheck = IndexCheck::index("scatter");
const CHECK_ADD: IndexCheck = IndexCheck::index("scatter_add");

/// out (a copy of the input, of `dims`), in place: input 0 written (or
/// added) at the indices of input 1 along `dim`.
#[derive(Clone, Debug)]
struct Scatter {
    dim: usize,
    add: bool,
    dims: Dims,
}

/// Where a scatter reads and writes: views of the index's shape with size 1
/// along `dim` (one element per line), and what is needed to walk a line.
struct Lines {
    out: Layout,
    src: Layout,
    ids: Layout,
    /// Entries of a line (the index's size along dim).
    m: usize,
    /// Elements of the index after dim (to find an entry in row-major order).
    inner: usize,
    /// The output's size along dim: the bound of an index.
    size: usize,
    out_ds: usize,
    src_ds: usize,
    ids_ds: usize,
}

impl Scatter {
    fn check(&self) -> IndexCheck {
        if self.add {
            CHECK_ADD
        } else {
            CHECK
        }
    }

    fn lines(&self, src: &Layout, ids: &Layout) -> Lines {
        let dim = self.dim;
        let mut line_dims = ids.dims().to_vec();
        line_dims[dim] = 1;
        let out = Layout::contiguous(Shape(self.dims.clone()));
        Lines {
            out: base_view(&out, &line_dims, dim),
            src: base_view(src, &line_dims, dim),
            ids: base_view(ids, &line_dims, dim),
            m: ids.dims()[dim],
            inner: ids.dims()[dim + 1..].iter().product(),
            size: self.dims[dim],
            out_ds: out.strides()[dim],
            src_ds: src.strides()[dim],
            ids_ds: ids.strides()[dim],
        }
    }
}

fn scatter_host<T: Copy>(out: &mut [T], src: &[T], g: &Lines, ids: &[usize], f: impl Fn(T, T) -> T) {
    for (line, (ob, sb)) in g.out.offsets().zip(g.src.offsets()).enumerate() {
        let (outer, q) = (line / g.inner.max(1), line % g.inner.max(1));
        for j in 0..g.m {
            let id = ids[(outer * g.m + j) * g.inner + q];
            // `index_list` checked every index (a bad one on a simulated GPU
            // failed the kernel); the test only keeps the write in bounds.
            if id >= g.size {
                continue;
            }
            let o = ob + id * g.out_ds;
            out[o] = f(out[o], src[sb + j * g.src_ds]);
        }
    }
}

/// Half precision adds in f32 and rounds once per addition (as `index_add`).
fn add_half<T: WithDType>(a: T, b: T) -> T {
    T::from_f64((a.to_f64() as f32 + b.to_f64() as f32) as f64)
}

fn replace<T>(_old: T, new: T) -> T {
    new
}

impl CustomKernel for Scatter {
    fn name(&self) -> &'static str {
        if self.add {
            "scatter_add"
        } else {
            "scatter"
        }
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let (src, ids) = (&inputs[0], &inputs[1]);
        let g = self.lines(src.layout, ids.layout);
        let ids = index_list(ids.buf, ids.layout, self.check(), g.size, self.dim)?;
        match (src.buf, out, self.add) {
            (CpuBuffer::F32(s), CpuBuffer::F32(o), false) => scatter_host(o, s, &g, &ids, replace),
            (CpuBuffer::F64(s), CpuBuffer::F64(o), false) => scatter_host(o, s, &g, &ids, replace),
            (CpuBuffer::I64(s), CpuBuffer::I64(o), false) => scatter_host(o, s, &g, &ids, replace),
            (CpuBuffer::I32(s), CpuBuffer::I32(o), false) => scatter_host(o, s, &g, &ids, replace),
            (CpuBuffer::U8(s), CpuBuffer::U8(o), false) => scatter_host(o, s, &g, &ids, replace),
            (CpuBuffer::F16(s), CpuBuffer::F16(o), false) => scatter_host(o, s, &g, &ids, replace),
            (CpuBuffer::BF16(s), CpuBuffer::BF16(o), false) => scatter_host(o, s, &g, &ids, replace),
            (CpuBuffer::F32(s), CpuBuffer::F32(o), true) => scatter_host(o, s, &g, &ids, Num::add),
            (CpuBuffer::F64(s), CpuBuffer::F64(o), true) => scatter_host(o, s, &g, &ids, Num::add),
            (CpuBuffer::I64(s), CpuBuffer::I64(o), true) => scatter_host(o, s, &g, &ids, Num::add),
            (CpuBuffer::I32(s), CpuBuffer::I32(o), true) => scatter_host(o, s, &g, &ids, Num::add),
            (CpuBuffer::U8(s), CpuBuffer::U8(o), true) => scatter_host(o, s, &g, &ids, Num::add),
            (CpuBuffer::F16(s), CpuBuffer::F16(o), true) => scatter_host(o, s, &g, &ids, add_half),
            (CpuBuffer::BF16(s), CpuBuffer::BF16(o), true) => scatter_host(o, s, &g, &ids, add_half),
            _ => return Err(crate::backends::host::unsupported_op(self.name())),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (src, ids) = (&inputs[0], &inputs[1]);
        let g = self.lines(&src.layout, &ids.layout);
        let l = lays(dev, &[&g.out, &g.src, &g.ids])?;
        let lines = g.out.elem_count();
        let (fault, site) = self.check().cuda(dev)?;
        let args = ScatterArgs {
            out: dev.ptr(out)?,
            ol: l[0],
            src: dev.ptr(&src.storage)?,
            sl: l[1],
            ids: dev.ptr(&ids.storage)?,
            il: l[2],
            lines: lines as u64,
            m: g.m as u64,
            size: g.size as u64,
            out_ds: g.out_ds as u64,
            src_ds: g.src_ds as u64,
            ids_ds: g.ids_ds as u64,
            fault,
            site,
            dim: self.dim as i64,
        };
        let name = format!("{}_{}_{}", self.name(), dtype_tag(src.storage.dtype), dtype_tag(ids.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(lines), BLOCK, &args)
    }
    fn writes_nothing(&self, inputs: &[Src<'_>], out_len: usize) -> bool {
        out_len == 0 || inputs[1].layout.elem_count() == 0
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(self.clone())
    }
}

static MODULE: CudaModule = CudaModule::generated("scatter", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(ScatterArgs::C_DECL);
    s.push_str(
        r#"
// scatter_add's addition: half types add in f32 and round once, as the CPU.
template <typename T> __device__ __forceinline__ T scatter_sum(T a, T b) { return Ar<T>::add(a, b); }
template <> __device__ __forceinline__ f16_t scatter_sum<f16_t>(f16_t a, f16_t b) {
    return Cv<f16_t>::from((double)((float)Cv<f16_t>::to(a) + (float)Cv<f16_t>::to(b)));
}
template <> __device__ __forceinline__ bf16_t scatter_sum<bf16_t>(bf16_t a, bf16_t b) {
    return Cv<bf16_t>::from((double)((float)Cv<bf16_t>::to(a) + (float)Cv<bf16_t>::to(b)));
}

// One thread per line of the index along dim walks its m entries in order:
// lines write disjoint elements, so no atomics, and repeated indices
// accumulate (or the last one wins) as on the CPU.
template <typename T, typename I, bool ADD> __device__ void scatter_impl(const ScatterArgs& p) {
    T* out = (T*)p.out;
    const T* src = (const T*)p.src;
    const I* ids = (const I*)p.ids;
    GRID_LOOP(t, p.lines) {
        i64 ob = lay_off(p.ol, t), sb = lay_off(p.sl, t);
        Lay line = {};
        line.rank = 1;
        line.off = lay_off(p.il, t);
        line.dims[0] = (i64)p.m;
        line.strides[0] = (i64)p.ids_ds;
        for (u64 j = 0; j < p.m; ++j) {
            i64 id = read_raw(ids, line, j);
            // A bad index is recorded in the fault record (reported by the
            // next synchronising call) and skipped.
            if (!kiln_index_ok(p.fault, p.site, id, p.size, p.dim)) continue;
            i64 o = ob + (i64)((u64)id * p.out_ds);
            T v = src[sb + (i64)(j * p.src_ds)];
            out[o] = ADD ? scatter_sum(out[o], v) : v;
        }
    }
}
"#,
    );
    for dt in ALL_DTYPES {
        for it in GATHER_INDEX_DTYPES {
            let (tn, tt, in_, iy) = (dtype_tag(dt), c_type(dt), dtype_tag(it), c_type(it));
            for (name, add) in [("scatter", false), ("scatter_add", true)] {
                s.push_str(&format!(
                    "extern \"C\" __global__ void {name}_{tn}_{in_}(ScatterArgs p) {{ scatter_impl<{tt}, {iy}, {add}>(p); }}\n"
                ));
            }
        }
    }
    s
}

/// `g` padded with zeros at the end of each dimension up to `dims` (the
/// gradient of a `src` larger than the index: its extra elements are unused).
fn pad_to(g: Tensor, dims: &[usize]) -> Result<Tensor> {
    let mut g = g;
    for (d, &want) in dims.iter().enumerate() {
        let have = g.dims()[d];
        if have < want {
            let mut zd = g.dims().to_vec();
            zd[d] = want - have;
            let z = Tensor::zeros(zd, g.dtype(), &g.device())?;
            g = Tensor::cat(&[&g, &z], d)?;
        }
    }
    Ok(g)
}

impl Tensor {
    /// A copy of `self` with `src`'s elements written along `dim` at the
    /// positions `index` names (PyTorch's out-of-place `torch.scatter`): for
    /// a 3-D tensor and dim 1, `out[i][index[i][j][k]][k] = src[i][j][k]`.
    /// The index (i64, or i32) has `self`'s rank, `index.size(d) <=
    /// src.size(d)` for every d and `<= self.size(d)` for d ≠ dim; only the
    /// first `index.size(d)` elements of `src` are used. Every dtype; `src`
    /// has `self`'s dtype.
    ///
    /// **Repeated indices**: the last one along `dim` wins, on every device
    /// (PyTorch leaves it unspecified). Gradients: to `self`, `g` with the
    /// written positions zeroed; to `src`, `g.gather(dim, index)` (zero for
    /// the elements of a larger `src` that are not read, where PyTorch's
    /// backward raises). An index below 0 or at least `self.size(dim)` is an
    /// `InvalidArgument` error on the CPU; on a GPU the indices are not read
    /// back: the kernel checks them, skips a bad one, and the next
    /// synchronising call returns `KernelFailed` naming the op, the index and
    /// the size (see the README's table of differences). PyTorch takes i64 indices only; kiln takes i32 too.
    ///
    /// ```
    /// use kiln::{Tensor, cpu, DType};
    /// let x = Tensor::zeros((2, 3), DType::F32, &cpu())?;
    /// let index = Tensor::new(&[[2i64, 0], [1, 1]], &cpu())?;
    /// let src = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// // Row 1 writes 3. then 4. at column 1: the last write wins.
    /// assert_eq!(x.scatter(1, &index, &src)?.to_vec2::<f32>()?, vec![vec![2., 0., 1.], vec![0., 4., 0.]]);
    /// assert!(x.scatter(1, &Tensor::new(&[[3i64]], &cpu())?, &src).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn scatter(&self, dim: impl Dim, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        self.scatter_op(dim, index, src, false)
    }

    /// A copy of `self` with `src`'s elements added along `dim` at the
    /// positions `index` names (PyTorch's out-of-place
    /// `torch.scatter_add`): for dim 1, `out[i][index[i][j][k]][k] +=
    /// src[i][j][k]`. Repeated indices accumulate, in index order, on every
    /// device (deterministic: no atomics). Shapes, dtypes and out-of-range
    /// indices as [`scatter`](Self::scatter); half types add in f32 and
    /// round once per addition. Gradients: `g` to `self`,
    /// `g.gather(dim, index)` to `src`.
    ///
    /// ```
    /// use kiln::{Tensor, cpu, DType};
    /// let x = Tensor::zeros(3, DType::F32, &cpu())?;
    /// let src = Tensor::new(&[1f32, 2., 3., 4.], &cpu())?.requires_grad_();
    /// let index = Tensor::new(&[0i64, 2, 0, 1], &cpu())?;
    /// let y = x.scatter_add(0, &index, &src)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![4., 4., 2.]);
    /// (&y * &Tensor::new(&[1f32, 10., 100.], &cpu())?)?.sum_all()?.backward()?;
    /// assert_eq!(src.grad().unwrap().to_vec::<f32>()?, vec![1., 100., 1., 10.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn scatter_add(&self, dim: impl Dim, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        self.scatter_op(dim, index, src, true)
    }

    fn scatter_op(&self, dim: impl Dim, index: &Tensor, src: &Tensor, add: bool) -> Result<Tensor> {
        let op_name = if add { "scatter_add" } else { "scatter" };
        let dim = dim.index(op_name, self.rank().max(1))?;
        check_same_device(op_name, self, src)?;
        check_same_dtype(op_name, self, src)?;
        check_index(op_name, self, dim, index, Some(src))?;
        if self.rank() == 0 || index.rank() == 0 || src.rank() == 0 {
            // As 1-d tensors of one element (PyTorch's `ensure_nonempty`).
            let one = |t: &Tensor| if t.rank() == 0 { t.reshape(1) } else { Ok(t.clone()) };
            return one(self)?.scatter_op(dim, &one(index)?, &one(src)?, add)?.reshape(self.shape().clone());
        }
        let out = self.force_copy()?;
        let op = Scatter { dim, add, dims: Dims::from_slice(self.dims()) };
        crate::backends::launch_into(
            &Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![src.src(), index.src()] },
            &out.storage,
        )?;
        Ok(crate::autograd::record(out, &[self, src, index], false, || {
            Box::new(move |c| {
                let (x, src, index) = (&c.inputs[0], &c.inputs[1], &c.inputs[2]);
                let to_self = || {
                    if add {
                        Ok(c.g.clone())
                    } else {
                        c.g.scatter(dim, index, &Tensor::zeros(index.shape().clone(), c.g.dtype(), &c.g.device())?)
                    }
                };
                Ok(smallvec::smallvec![
                    crate::ops::need(x, to_self)?,
                    crate::ops::need(src, || {
                        if index.elem_count() == 0 {
                            // No element of src was read (and the index may have any shape).
                            src.zeros_like()
                        } else {
                            pad_to(c.g.gather(dim, index)?, src.dims())
                        }
                    })?,
                    None
                ])
            })
        }))
    }
}
