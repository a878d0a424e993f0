//! `where_cond`: out = cond ? on_true : on_false elementwise, the three
//! broadcast together; the condition may be of any dtype (non-zero is true).

use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::base::shape::{broadcast_shapes, Layout, Shape};
use crate::kernel::cuda::{c_type, dtype_tag, lays, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::tensor::check_same_device;
use crate::Tensor;
use std::sync::Arc;

/// out = input 0 ? input 1 : input 2, all three of the output's shape.
#[derive(Clone, Copy, Debug)]
struct Where;

crate::kernel_args! {
    /// A select kernel's argument.
    WhereArgs { c: u64, lc: Lay, a: u64, la: Lay, b: u64, lb: Lay, out: u64, n: u64 }
}

fn select<T: Copy>(cond: impl Iterator<Item = bool>, a: &[T], la: &Layout, b: &[T], lb: &Layout, out: &mut [T]) {
    for (((o, m), i), j) in out.iter_mut().zip(cond).zip(la.offsets()).zip(lb.offsets()) {
        *o = if m { a[i] } else { b[j] };
    }
}

impl CustomKernel for Where {
    fn name(&self) -> &'static str {
        "where_cond"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let (c, a, b) = (&inputs[0], &inputs[1], &inputs[2]);
        let mask = || c.layout.offsets().map(|o| c.buf.get_f64(o) != 0.0);
        macro_rules! go {
            ($a:expr, $b:expr, $o:expr) => {
                select(mask(), $a, a.layout, $b, b.layout, $o)
            };
        }
        match (a.buf, b.buf, out) {
            (CpuBuffer::F32(x), CpuBuffer::F32(y), CpuBuffer::F32(o)) => go!(x, y, o),
            (CpuBuffer::F64(x), CpuBuffer::F64(y), CpuBuffer::F64(o)) => go!(x, y, o),
            (CpuBuffer::I64(x), CpuBuffer::I64(y), CpuBuffer::I64(o)) => go!(x, y, o),
            (CpuBuffer::I32(x), CpuBuffer::I32(y), CpuBuffer::I32(o)) => go!(x, y, o),
            (CpuBuffer::U8(x), CpuBuffer::U8(y), CpuBuffer::U8(o)) => go!(x, y, o),
            (CpuBuffer::F16(x), CpuBuffer::F16(y), CpuBuffer::F16(o)) => go!(x, y, o),
            (CpuBuffer::BF16(x), CpuBuffer::BF16(y), CpuBuffer::BF16(o)) => go!(x, y, o),
            _ => return Err(crate::backends::host::unsupported_op("where_cond")),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (c, a, b) = (&inputs[0], &inputs[1], &inputs[2]);
        let ls = lays(dev, &[&c.layout, &a.layout, &b.layout])?;
        let args = WhereArgs {
            c: dev.ptr(&c.storage)?,
            lc: ls[0],
            a: dev.ptr(&a.storage)?,
            la: ls[1],
            b: dev.ptr(&b.storage)?,
            lb: ls[2],
            out: dev.ptr(out)?,
            n: out.len as u64,
        };
        let name = format!("where_{}_{}", dtype_tag(c.storage.dtype), dtype_tag(a.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(out.len), BLOCK, &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("where", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(WhereArgs::C_DECL);
    s.push_str(
        r#"
template <typename C, typename T> __device__ void where_impl(const WhereArgs& p) {
    const C* c = (const C*)p.c;
    const T* a = (const T*)p.a;
    const T* b = (const T*)p.b;
    T* out = (T*)p.out;
    GRID_LOOP(i, p.n) {
        bool m = Cv<C>::to(c[lay_off(p.lc, i)]) != 0.0;
        out[i] = m ? a[lay_off(p.la, i)] : b[lay_off(p.lb, i)];
    }
}
"#,
    );
    let all = [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16];
    for cd in all {
        for td in all {
            let (cn, ct, tn, tt) = (dtype_tag(cd), c_type(cd), dtype_tag(td), c_type(td));
            s.push_str(&format!("extern \"C\" __global__ void where_{cn}_{tn}(WhereArgs p) {{ where_impl<{ct}, {tt}>(p); }}\n"));
        }
    }
    s
}

impl Tensor {
    /// `self ? on_true : on_false` elementwise; `self` is the condition
    /// (non-zero is true); all three broadcast together. Branches of two
    /// dtypes are promoted as PyTorch does ([`Tensor::result_type`]).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let c = Tensor::new(&[1u8, 0, 1], &cpu())?;
    /// let a = Tensor::new(&[1f32, 2., 3.], &cpu())?;
    /// let b = Tensor::new(&[-1f32], &cpu())?;
    /// assert_eq!(c.where_cond(&a, &b)?.to_vec::<f32>()?, vec![1., -1., 3.]);
    /// let i = Tensor::new(&[7i64, 8, 9], &cpu())?;
    /// assert_eq!(c.where_cond(&i, &b)?.to_vec::<f32>()?, vec![7., -1., 9.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn where_cond(&self, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        check_same_device("where", self, on_true)?;
        check_same_device("where", self, on_false)?;
        let shape = broadcast_shapes("where", &broadcast_shapes("where", self.shape(), on_true.shape())?, on_false.shape())?;
        if on_true.dtype() != on_false.dtype() {
            // PyTorch's promotion of the two branches (the condition is apart).
            let dtype = Tensor::result_type(&[on_true, on_false]);
            return self.where_cond(&on_true.to_dtype(dtype)?, &on_false.to_dtype(dtype)?);
        }
        fn bc<'t>(t: &'t Tensor, shape: &Shape) -> Result<Src<'t>> {
            Ok(Src::with_layout(&t.storage, t.layout.broadcast_as(shape)?))
        }
        let kernel = Kernel::Custom {
            op: OpRef::Borrowed(&Where),
            inputs: smallvec::smallvec![bc(self, &shape)?, bc(on_true, &shape)?, bc(on_false, &shape)?],
        };
        let t = self.run_new(kernel, on_true.dtype(), shape)?;
        Ok(crate::autograd::record(t, &[self, on_true, on_false], false, || {
            Box::new(|c| {
                let (cond, a, b) = (&c.inputs[0], &c.inputs[1], &c.inputs[2]);
                let zero = c.g.scalar_like(0.0)?;
                Ok(smallvec::smallvec![
                    None,
                    crate::ops::need(a, || crate::ops::sum_to(&cond.where_cond(c.g, &zero)?, a.dims()))?,
                    crate::ops::need(b, || crate::ops::sum_to(&cond.where_cond(&zero, c.g)?, b.dims()))?
                ])
            })
        }))
    }
}
