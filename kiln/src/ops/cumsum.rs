//! `cumsum`: running sums along one dimension, and the reversed running
//! sums (from the end) that are its gradient. A primitive of its own rather
//! than a composite: a scan is O(n) where the composites (a triangular
//! matmul, or `sum − cumsum + x` for the reverse) cost O(n²) or cancel.
//! Floats accumulate in f64, as PyTorch's CPU scan does, and round each
//! output once; integers wrap in their own dtype.

use crate::backends::host::gather_view;
use crate::backends::host::num::{Accumulate, Num};
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::base::shape::Shape;
use crate::kernel::cuda::{c_type, dtype_tag, lay, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::ops::index_select::split_at_dim;
use crate::tensor::{check_compute, Dim};
use crate::Tensor;
use std::sync::Arc;

crate::kernel_args! {
    /// A scan's argument: src viewed as (outer, d, inner), out contiguous.
    ScanArgs { src: u64, sl: Lay, out: u64, outer: u64, d: u64, inner: u64, reverse: u64 }
}

/// out (outer, d, inner) = running sums of input 0 along d, from the start
/// or (reverse) from the end.
#[derive(Clone, Copy, Debug)]
struct CumSum {
    dim: usize,
    reverse: bool,
}

/// Scans `src` (outer, d, inner) into `out`: one accumulator per inner
/// position, so both are read and written in order.
fn scan<T: Accumulate>(src: &[T], dims: &[usize], dim: usize, reverse: bool, out: &mut [T]) {
    let (outer, d, inner) = split_at_dim(dims, dim);
    let mut acc = vec![<T::Acc as Num>::ZERO; inner];
    for i in 0..outer {
        acc.iter_mut().for_each(|a| *a = <T::Acc as Num>::ZERO);
        for step in 0..d {
            let j = if reverse { d - 1 - step } else { step };
            let at = (i * d + j) * inner;
            for (k, a) in acc.iter_mut().enumerate() {
                *a = a.add(src[at + k].widen());
                out[at + k] = T::narrow(*a);
            }
        }
    }
}

impl CustomKernel for CumSum {
    fn name(&self) -> &'static str {
        "cumsum"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let src = &inputs[0];
        let gathered = if src.layout.is_contiguous() { None } else { Some(gather_view(src.buf, src.layout)?) };
        let (data, start) = match &gathered {
            Some(g) => (g, 0),
            None => (src.buf, src.layout.offset()),
        };
        let (end, dims) = (start + src.layout.elem_count(), src.layout.dims());
        let (dim, rev) = (self.dim, self.reverse);
        match (data, out) {
            (CpuBuffer::F32(s), CpuBuffer::F32(o)) => scan(&s[start..end], dims, dim, rev, o),
            (CpuBuffer::F64(s), CpuBuffer::F64(o)) => scan(&s[start..end], dims, dim, rev, o),
            (CpuBuffer::I64(s), CpuBuffer::I64(o)) => scan(&s[start..end], dims, dim, rev, o),
            (CpuBuffer::I32(s), CpuBuffer::I32(o)) => scan(&s[start..end], dims, dim, rev, o),
            (CpuBuffer::U8(s), CpuBuffer::U8(o)) => scan(&s[start..end], dims, dim, rev, o),
            // Half types are refused by the front end.
            _ => return Err(crate::backends::host::unsupported_op("cumsum")),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let src = &inputs[0];
        let (outer, d, inner) = split_at_dim(src.layout.dims(), self.dim);
        let args = ScanArgs {
            src: dev.ptr(&src.storage)?,
            sl: lay(dev, &src.layout)?,
            out: dev.ptr(out)?,
            outer: outer as u64,
            d: d as u64,
            inner: inner as u64,
            reverse: u64::from(self.reverse),
        };
        let name = format!("cumsum_{}", dtype_tag(src.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(outer * inner), BLOCK, &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("cumsum", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(ScanArgs::C_DECL);
    s.push_str(
        r#"
// One thread per (outer, inner) line, scanning its d elements in order.
template <typename T> __device__ void cumsum_impl(const ScanArgs& p) {
    typedef typename Acc<T>::type A;
    const T* src = (const T*)p.src;
    T* out = (T*)p.out;
    GRID_LOOP(t, p.outer * p.inner) {
        u64 i = t / p.inner, k = t % p.inner;
        A acc = Cv<A>::from(0.0);
        for (u64 step = 0; step < p.d; ++step) {
            u64 j = p.reverse ? p.d - 1 - step : step;
            u64 at = (i * p.d + j) * p.inner + k;
            acc = Ar<A>::add(acc, (A)src[lay_off(p.sl, at)]);
            out[at] = (T)acc;
        }
    }
}
"#,
    );
    for dt in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8] {
        let (tag, ty) = (dtype_tag(dt), c_type(dt));
        s.push_str(&format!("extern \"C\" __global__ void cumsum_{tag}(ScanArgs p) {{ cumsum_impl<{ty}>(p); }}\n"));
    }
    s
}

impl Tensor {
    /// Running sums along `dim`: element j is the sum of elements 0..=j
    /// (PyTorch's `cumsum`). Floats accumulate in f64 and round each output
    /// once; integers wrap and keep their dtype (PyTorch gives i64 for every
    /// integer input; see the README's table of differences). A 0-d tensor
    /// takes dim 0 or −1 and is its own cumsum. The gradient is the running
    /// sum of the output gradient from the end.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &cpu())?.requires_grad_();
    /// assert_eq!(x.cumsum(1)?.to_vec::<f32>()?, vec![1., 3., 6., 4., 9., 15.]);
    /// assert_eq!(x.cumsum(-2)?.to_vec::<f32>()?, vec![1., 2., 3., 5., 7., 9.]);
    /// x.cumsum(1)?.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![3., 2., 1., 3., 2., 1.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn cumsum(&self, dim: impl Dim) -> Result<Tensor> {
        check_compute("cumsum", self.dtype())?;
        if self.rank() == 0 {
            // As PyTorch: a scalar's dims are 0 and -1, and it is its own cumsum.
            dim.index("cumsum", 1)?;
            return self.reshape(1)?.cumsum(0)?.reshape(());
        }
        self.scan(dim.index("cumsum", self.rank())?, false)
    }

    /// A running sum along `dim`, from the end when `reverse`; each is the
    /// other's gradient.
    fn scan(&self, dim: usize, reverse: bool) -> Result<Tensor> {
        let op = CumSum { dim, reverse };
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src()] };
        let t = self.run_new(kernel, self.dtype(), Shape::from(self.dims().to_vec()))?;
        Ok(crate::autograd::record(t, &[self], false, || Box::new(move |c| Ok(smallvec::smallvec![Some(c.g.scan(dim, !reverse)?)]))))
    }
}
