//! `argsort`: the i64 positions that sort each line along one dimension,
//! stably, NaN as the largest value (PyTorch's `sort(stable=True)`); and
//! `sort` and `topk`, which gather the values at those positions (their
//! gradients flow through the gather: `scatter_add` of the output gradient).
//!
//! The host sorts each line with Rust's stable sort. The CUDA kernel is
//! simple, correctness first: one thread per line runs a bottom-up merge
//! sort of positions (stable: a tie takes the left run first), ping-ponging
//! between the output and a workspace of the same size. It is O(n log n)
//! per line but walks one line per thread: fine for many short lines (the
//! rows of a batch), slow for one long line.

use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{Layout, Shape};
use crate::kernel::cuda::{c_type, dtype_tag, lays, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::ops::gather::{base_view, ALL_DTYPES};
use crate::tensor::Dim;
use crate::Tensor;
use std::cmp::Ordering;
use std::sync::Arc;

crate::kernel_args! {
    /// argsort: per line t along dim, the values at `sl` (n of them, src_ds
    /// apart) and the output (and workspace) positions at `ol`, out_ds apart.
    SortArgs { src: u64, sl: Lay, out: u64, work: u64, ol: Lay, lines: u64, n: u64, src_ds: u64, out_ds: u64, descending: u64 }
}

/// out (i64, the input's shape) = the positions along `dim` that sort each
/// line of input 0.
#[derive(Clone, Copy, Debug)]
struct ArgSort {
    dim: usize,
    descending: bool,
}

/// The order of values with NaN above everything (PyTorch's sort and
/// topk); −0.0 and 0.0 are equal.
#[allow(clippy::eq_op)]
fn nan_last<T: PartialOrd>(a: &T, b: &T) -> Ordering {
    match (a != a, b != b) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (false, false) => a.partial_cmp(b).unwrap_or(Ordering::Equal),
    }
}

/// The lines of an argsort: views of the input and of the output with size
/// 1 along `dim`, and the strides along it.
fn lines(src: &Layout, dim: usize) -> (Layout, Layout, usize, usize) {
    let mut line_dims = src.dims().to_vec();
    line_dims[dim] = 1;
    let out = Layout::contiguous(src.shape().clone());
    (base_view(src, &line_dims, dim), base_view(&out, &line_dims, dim), src.strides()[dim], out.strides()[dim])
}

fn argsort_host<T: PartialOrd + Copy>(s: &[T], src: &Layout, dim: usize, descending: bool, out: &mut [i64]) {
    let n = src.dims()[dim];
    let (sl, ol, src_ds, out_ds) = lines(src, dim);
    let mut order: Vec<usize> = Vec::with_capacity(n);
    for (sb, ob) in sl.offsets().zip(ol.offsets()) {
        order.clear();
        order.extend(0..n);
        let at = |k: usize| s[sb + k * src_ds];
        // A stable sort: equal values keep their order, either way.
        if descending {
            order.sort_by(|&a, &b| nan_last(&at(b), &at(a)));
        } else {
            order.sort_by(|&a, &b| nan_last(&at(a), &at(b)));
        }
        for (k, &p) in order.iter().enumerate() {
            out[ob + k * out_ds] = p as i64;
        }
    }
}

impl CustomKernel for ArgSort {
    fn name(&self) -> &'static str {
        "argsort"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let (buf, l) = (inputs[0].buf, inputs[0].layout);
        let CpuBuffer::I64(o) = out else { return Err(crate::backends::host::unsupported_op("argsort")) };
        let (dim, desc) = (self.dim, self.descending);
        match buf {
            CpuBuffer::F32(s) => argsort_host(s, l, dim, desc, o),
            CpuBuffer::F64(s) => argsort_host(s, l, dim, desc, o),
            CpuBuffer::I64(s) => argsort_host(s, l, dim, desc, o),
            CpuBuffer::I32(s) => argsort_host(s, l, dim, desc, o),
            CpuBuffer::U8(s) => argsort_host(s, l, dim, desc, o),
            CpuBuffer::F16(s) => argsort_host(s, l, dim, desc, o),
            CpuBuffer::BF16(s) => argsort_host(s, l, dim, desc, o),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let src = &inputs[0];
        let (sl, ol, src_ds, out_ds) = lines(&src.layout, self.dim);
        let l = lays(dev, &[&sl, &ol])?;
        let work = dev.temp(src.layout.elem_count() * 8)?;
        let args = SortArgs {
            src: dev.ptr(&src.storage)?,
            sl: l[0],
            out: dev.ptr(out)?,
            work: work.ptr(),
            ol: l[1],
            lines: sl.elem_count() as u64,
            n: src.layout.dims()[self.dim] as u64,
            src_ds: src_ds as u64,
            out_ds: out_ds as u64,
            descending: u64::from(self.descending),
        };
        let name = format!("argsort_{}", dtype_tag(src.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(sl.elem_count()), BLOCK, &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("sort", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(SortArgs::C_DECL);
    s.push_str(
        r#"
// The sort key of a value: itself, or its f64 for the half types.
template <typename T> struct SortKey {
    typedef T type;
    static __device__ __forceinline__ T get(T x) { return x; }
};
template <> struct SortKey<f16_t> {
    typedef double type;
    static __device__ __forceinline__ double get(f16_t x) { return Cv<f16_t>::to(x); }
};
template <> struct SortKey<bf16_t> {
    typedef double type;
    static __device__ __forceinline__ double get(bf16_t x) { return Cv<bf16_t>::to(x); }
};

// a before b in ascending order, NaN above everything (x != x only for NaN).
template <typename K> __device__ __forceinline__ bool key_lt(K a, K b) { return a < b || (b != b && a == a); }

// One thread per line: a bottom-up merge sort of the positions 0..n,
// between the output and the workspace (same offsets); stable, since a tie
// takes the left run first.
template <typename T> __device__ void argsort_impl(const SortArgs& p) {
    typedef typename SortKey<T>::type K;
    const T* src = (const T*)p.src;
    GRID_LOOP(t, p.lines) {
        i64 sb = lay_off(p.sl, t), ob = lay_off(p.ol, t);
        i64* a = (i64*)p.out + ob;
        i64* b = (i64*)p.work + ob;
        i64 ds = (i64)p.out_ds;
        for (u64 k = 0; k < p.n; ++k) a[(i64)k * ds] = (i64)k;
        for (u64 width = 1; width < p.n; width *= 2) {
            for (u64 lo = 0; lo < p.n; lo += 2 * width) {
                u64 mid = lo + width < p.n ? lo + width : p.n;
                u64 hi = lo + 2 * width < p.n ? lo + 2 * width : p.n;
                u64 i = lo, j = mid;
                for (u64 k = lo; k < hi; ++k) {
                    bool right = false;
                    if (j < hi && i < mid) {
                        K l = SortKey<T>::get(src[sb + a[(i64)i * ds] * (i64)p.src_ds]);
                        K r = SortKey<T>::get(src[sb + a[(i64)j * ds] * (i64)p.src_ds]);
                        right = p.descending ? key_lt(l, r) : key_lt(r, l);
                    } else {
                        right = i >= mid;
                    }
                    b[(i64)k * ds] = right ? a[(i64)(j++) * ds] : a[(i64)(i++) * ds];
                }
            }
            i64* tmp = a;
            a = b;
            b = tmp;
        }
        if (a != (i64*)p.out + ob) {
            for (u64 k = 0; k < p.n; ++k) b[(i64)k * ds] = a[(i64)k * ds];
        }
    }
}
"#,
    );
    for dt in ALL_DTYPES {
        let (tag, ty) = (dtype_tag(dt), c_type(dt));
        s.push_str(&format!("extern \"C\" __global__ void argsort_{tag}(SortArgs p) {{ argsort_impl<{ty}>(p); }}\n"));
    }
    s
}

impl Tensor {
    /// The positions (i64) that sort `self` along `dim`, ascending or
    /// `descending` (PyTorch's `argsort(dim, descending, stable=True)`):
    /// stable (equal values keep their order, both ways), NaN sorted as the
    /// largest value, −0.0 equal to 0.0. Every dtype; no gradient (the
    /// result is an index). A 0-d tensor takes dim 0 or −1 and gives 0.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[3f32, 1., 2.], [f32::NAN, 0., 0.]], &cpu())?;
    /// assert_eq!(x.argsort(1, false)?.to_vec2::<i64>()?, vec![vec![1, 2, 0], vec![1, 2, 0]]);
    /// assert_eq!(x.argsort(-1, true)?.to_vec2::<i64>()?, vec![vec![0, 2, 1], vec![0, 1, 2]]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn argsort(&self, dim: impl Dim, descending: bool) -> Result<Tensor> {
        let dim = dim.index("argsort", self.rank().max(1))?;
        if self.rank() == 0 {
            return self.reshape(1)?.argsort(0, descending)?.reshape(());
        }
        let op = ArgSort { dim, descending };
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src()] };
        self.run_new(kernel, DType::I64, Shape::from(self.dims().to_vec()))
    }

    /// `self` sorted along `dim` and the positions (i64) the values came
    /// from: PyTorch's `sort(dim, descending, stable=True)`, stable, NaN
    /// sorted as the largest value. Every dtype. The gradient of the values
    /// goes back to the positions they came from.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[2f32, f32::NAN, -1., 2.], &cpu())?.requires_grad_();
    /// let (values, indices) = x.sort(0, false)?;
    /// assert_eq!(indices.to_vec::<i64>()?, vec![2, 0, 3, 1]);
    /// assert_eq!(values.to_vec::<f32>()?[..3], [-1., 2., 2.]);
    /// (&values.narrow(0, 0, 3)? * &Tensor::new(&[1f32, 10., 100.], &cpu())?)?.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![10., 0., 1., 100.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn sort(&self, dim: impl Dim, descending: bool) -> Result<(Tensor, Tensor)> {
        let dim = dim.index("sort", self.rank().max(1))?;
        let indices = self.argsort(dim, descending)?;
        Ok((self.gather_checked(dim, &indices)?, indices))
    }

    /// The `k` largest (or, with `largest = false`, smallest) values along
    /// `dim` and their positions (i64), as PyTorch's `topk`: NaN counts as
    /// the largest value, ties go to the lower position. The values are
    /// always sorted (largest first, or smallest first); `sorted = false`
    /// allows any order in PyTorch and gives the same sorted result here.
    /// `k` larger than the dimension is an error. Every dtype; the gradient
    /// of the values goes back to their positions.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 5., 3., 4.], [8., 6., 7., 6.]], &cpu())?;
    /// let (values, indices) = x.topk(2, 1, true, true)?;
    /// assert_eq!(values.to_vec2::<f32>()?, vec![vec![5., 4.], vec![8., 7.]]);
    /// assert_eq!(indices.to_vec2::<i64>()?, vec![vec![1, 3], vec![0, 2]]);
    /// let (values, _) = x.topk(1, -1, false, true)?;
    /// assert_eq!(values.to_vec2::<f32>()?, vec![vec![1.], vec![6.]]);
    /// assert!(x.topk(5, 1, true, true).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn topk(&self, k: usize, dim: impl Dim, largest: bool, sorted: bool) -> Result<(Tensor, Tensor)> {
        // Always sorted: a sorted result is one of the orders `sorted = false` allows.
        let _ = sorted;
        let dim = dim.index("topk", self.rank().max(1))?;
        let size = if self.rank() == 0 { 1 } else { self.dims()[dim] };
        if k > size {
            return Err(Error::invalid(
                "topk",
                format!("k ({k}) is larger than dimension {dim} of size {size} (shape {}); ask for at most {size}", self.shape()),
            ));
        }
        let all = self.argsort(dim, largest)?;
        let indices = match (self.rank(), k) {
            (0, 1) => all,
            (0, _) => all.reshape(1)?.narrow(0, 0, 0)?,
            _ => all.narrow(dim, 0, k)?.contiguous()?,
        };
        Ok((self.gather_checked(dim, &indices)?, indices))
    }
}
