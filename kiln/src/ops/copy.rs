//! Copying a view into a layout of another storage, converting dtypes on
//! the way: the kernel behind casts (`to_dtype`), `contiguous`, `assign`,
//! `cat`'s pieces and copies between simulated GPUs. Conversions follow
//! numpy and PyTorch: from floats through f64 (saturating to integers, NaN
//! to 0), from integers one rounding to a float and wrapping to a narrower
//! integer; the same dtype is copied bit for bit.

use crate::backends::host::num::Convert;
use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::Layout;
use crate::kernel::cuda::{c_type, dtype_tag, lays, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::tensor::check_same_device;
use crate::Tensor;
use std::sync::Arc;

/// out[dst_layout] = input 0, converted to the output's dtype.
#[derive(Clone, Debug)]
pub(crate) struct CopyOp {
    pub dst_layout: Layout,
}

crate::kernel_args! {
    /// A copy kernel's argument: dst[dl(i)] = convert(src[sl(i)]).
    CopyArgs { src: u64, sl: Lay, dst: u64, dl: Lay, n: u64 }
}

impl CopyOp {
    /// The kernel copying `src` into the whole of a new contiguous output.
    pub(crate) fn into_contiguous(src: &Tensor) -> CopyOp {
        CopyOp { dst_layout: Layout::contiguous(src.shape().clone()) }
    }
}

fn copy_typed<T: WithDType + Convert<U>, U: WithDType>(s: &[T], ls: &Layout, d: &mut [U], ld: &Layout) {
    if T::DTYPE == U::DTYPE {
        // Same dtype: the values bit for bit (through f64 an i64 above 2^53
        // would lose its low bits).
        // SAFETY: same dtype, so T and U are the same type.
        let s: &[U] = unsafe { std::slice::from_raw_parts(s.as_ptr() as *const U, s.len()) };
        if let (Some((a0, a1)), Some((b0, b1))) = (ls.contiguous_range(), ld.contiguous_range()) {
            d[b0..b1].copy_from_slice(&s[a0..a1]);
        } else {
            for (i, j) in ls.offsets().zip(ld.offsets()) {
                d[j] = s[i];
            }
        }
        return;
    }
    for (i, j) in ls.offsets().zip(ld.offsets()) {
        d[j] = s[i].convert();
    }
}

/// dst[ld] = src[ls], converting.
pub(crate) fn copy_cast(src: &CpuBuffer, ls: &Layout, dst: &mut CpuBuffer, ld: &Layout) {
    macro_rules! to {
        ($s:expr) => {
            match dst {
                CpuBuffer::F32(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::F64(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::I64(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::I32(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::U8(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::F16(d) => copy_typed($s, ls, d, ld),
                CpuBuffer::BF16(d) => copy_typed($s, ls, d, ld),
            }
        };
    }
    match src {
        CpuBuffer::F32(s) => to!(s),
        CpuBuffer::F64(s) => to!(s),
        CpuBuffer::I64(s) => to!(s),
        CpuBuffer::I32(s) => to!(s),
        CpuBuffer::U8(s) => to!(s),
        CpuBuffer::F16(s) => to!(s),
        CpuBuffer::BF16(s) => to!(s),
    }
}

impl CustomKernel for CopyOp {
    fn name(&self) -> &'static str {
        "copy"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        copy_cast(inputs[0].buf, inputs[0].layout, out, &self.dst_layout);
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let src = &inputs[0];
        let n = self.dst_layout.elem_count();
        let (sdt, ddt) = (src.storage.dtype, out.dtype);
        let (src_ptr, dst_ptr) = (dev.ptr(&src.storage)?, dev.ptr(out)?);
        if sdt == ddt
            && src_ptr != dst_ptr
            && let (Some((a, _)), Some((b, _))) = (src.layout.contiguous_range(), self.dst_layout.contiguous_range())
        {
            let size = sdt.size_in_bytes();
            return dev.copy_d2d(dst_ptr + (b * size) as u64, src_ptr + (a * size) as u64, n * size);
        }
        let ls = lays(dev, &[&src.layout, &self.dst_layout])?;
        let args = CopyArgs { src: src_ptr, sl: ls[0], dst: dst_ptr, dl: ls[1], n: n as u64 };
        dev.launch(&MODULE, &format!("copy_{}_{}", dtype_tag(sdt), dtype_tag(ddt)), dev.grid_for(n), BLOCK, &args)
    }
    fn writes_nothing(&self, inputs: &[Src<'_>], out_len: usize) -> bool {
        out_len == 0 || self.dst_layout.elem_count() == 0 || inputs[0].layout.elem_count() == 0
    }
    fn overwrites(&self, _inputs: &[Src<'_>], out_len: usize) -> bool {
        // Every element once, in order: the whole storage.
        self.dst_layout.offset == 0 && self.dst_layout.is_contiguous() && self.dst_layout.elem_count() == out_len
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(self.clone())
    }
}

static MODULE: CudaModule = CudaModule::generated("copy", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

const ALL: [DType; 7] = [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16];

fn cuda_source() -> String {
    let mut s = String::from(CopyArgs::C_DECL);
    s.push_str(COPY_CU);
    for from in ALL {
        for to in ALL {
            let (sn, st, dn, dt) = (dtype_tag(from), c_type(from), dtype_tag(to), c_type(to));
            s.push_str(&format!("extern \"C\" __global__ void copy_{sn}_{dn}(CopyArgs p) {{ copy_impl<{st}, {dt}>(p); }}\n"));
        }
    }
    s
}

const COPY_CU: &str = r#"
// From an integer, as the CPU's `from_i64` (numpy and PyTorch): one rounding
// to f32 or f64 (through f64 an i64 above 2^53 would round twice), two's
// complement truncation to a narrower integer; half types through f64.
template <typename D> struct FromInt {
    static __device__ __forceinline__ D go(i64 v) { return Cv<D>::from((double)v); }
};
template <> struct FromInt<float> {
    static __device__ __forceinline__ float go(i64 v) { return (float)v; }
};
template <> struct FromInt<i64> {
    static __device__ __forceinline__ i64 go(i64 v) { return v; }
};
template <> struct FromInt<i32> {
    static __device__ __forceinline__ i32 go(i64 v) { return (i32)(u32)(u64)v; }
};
template <> struct FromInt<u8> {
    static __device__ __forceinline__ u8 go(i64 v) { return (u8)(u64)v; }
};

// From a float: through f64 (saturating to integers), as the CPU's `from_f64`.
template <typename S> struct ConvFrom {
    template <typename D> static __device__ __forceinline__ D go(S x) { return Cv<D>::from(Cv<S>::to(x)); }
};
template <> struct ConvFrom<i64> {
    template <typename D> static __device__ __forceinline__ D go(i64 x) { return FromInt<D>::go(x); }
};
template <> struct ConvFrom<i32> {
    template <typename D> static __device__ __forceinline__ D go(i32 x) { return FromInt<D>::go((i64)x); }
};
template <> struct ConvFrom<u8> {
    template <typename D> static __device__ __forceinline__ D go(u8 x) { return FromInt<D>::go((i64)x); }
};

// Same dtype: the bits are copied.
template <typename S, typename D> struct Conv {
    static __device__ __forceinline__ D go(S x) { return ConvFrom<S>::template go<D>(x); }
};
template <typename S> struct Conv<S, S> {
    static __device__ __forceinline__ S go(S x) { return x; }
};

template <typename S, typename D> __device__ void copy_impl(const CopyArgs& p) {
    const S* src = (const S*)p.src;
    D* dst = (D*)p.dst;
    if (p.sl.rank == 1 && p.dl.rank == 1 && p.sl.strides[0] == 1 && p.dl.strides[0] == 1) {
        const S* s = src + p.sl.off;
        D* d = dst + p.dl.off;
        GRID_LOOP(i, p.n) d[i] = Conv<S, D>::go(s[i]);
    } else {
        GRID_LOOP(i, p.n) dst[lay_off(p.dl, i)] = Conv<S, D>::go(src[lay_off(p.sl, i)]);
    }
}
"#;

impl Tensor {
    /// Converts to another dtype (a copy; the same tensor when already there).
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::new(&[1.7f32, -2.2], &cpu())?;
    /// assert_eq!(x.to_dtype(DType::I64)?.to_vec::<i64>()?, vec![1, -2]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let op = CopyOp::into_contiguous(self);
        let t = self.run_new(
            Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src()] },
            dtype,
            self.shape().clone(),
        )?;
        if !dtype.is_float() {
            return Ok(t);
        }
        Ok(crate::autograd::record(t, &[self], false, || {
            Box::new(|c| {
                let x = &c.inputs[0];
                Ok(smallvec::smallvec![Some(c.g.to_dtype(x.dtype())?)])
            })
        }))
    }

    /// A contiguous tensor with the same values (itself when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let t = self.force_copy()?;
        Ok(crate::autograd::record(t, &[self], false, || Box::new(|c| Ok(smallvec::smallvec![Some(c.g.clone())]))))
    }

    /// A contiguous copy on the same device, whatever the layout (no gradient).
    pub(crate) fn force_copy(&self) -> Result<Tensor> {
        let op = CopyOp::into_contiguous(self);
        self.run_new(
            Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src()] },
            self.dtype(),
            self.shape().clone(),
        )
    }

    /// Overwrites this tensor's elements in place with `src` (broadcast to
    /// this shape), on this tensor's device. Every view of the storage sees
    /// the new values; this is how optimizers update parameters. A source
    /// of another dtype is converted on the way, as PyTorch's `copy_`
    /// (floats to integers saturate, NaN gives 0; see [`to_dtype`](Self::to_dtype)).
    /// Assigning a view to itself does nothing, even a broadcast one.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let w = Tensor::zeros((2,), DType::F32, &cpu())?;
    /// let alias = w.clone();
    /// w.assign(&Tensor::new(&[1f32, 2.], &cpu())?)?;
    /// assert_eq!(alias.to_vec::<f32>()?, vec![1., 2.]);
    /// w.assign(&Tensor::new(&[3i64, 4], &cpu())?)?; // converted, as `copy_`
    /// assert_eq!(w.to_vec::<f32>()?, vec![3., 4.]);
    /// let b = w.broadcast_to((3, 2))?;
    /// b.assign(&b)?; // a no-op
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn assign(&self, src: &Tensor) -> Result<()> {
        check_same_device("assign", self, src)?;
        if self.same_storage(src) && self.layout == src.layout {
            // The same elements in the same places: nothing to do, whatever
            // the view (PyTorch's `copy_` returns early here too, before it
            // looks for overlap).
            return Ok(());
        }
        if self.layout.has_internal_overlap() {
            // Several elements of a broadcast view are one memory location:
            // which written value wins would be arbitrary (PyTorch refuses too).
            return Err(Error::invalid(
                "assign",
                format!(
                    "the destination of shape {} is a broadcast view whose elements share memory; assign to the tensor it was broadcast from, or to `dst.contiguous()?`",
                    self.shape()
                ),
            ));
        }
        let layout = src.layout.broadcast_as(self.shape()).map_err(|_| Error::shape("assign", src.dims(), self.dims()))?;
        // From its own storage: read out first, so that overlapping views
        // copy the values they had before the call, on every device.
        let src = if src.same_storage(self) { src.force_copy()?.broadcast_to(self.shape())? } else { src.with_layout(layout) };
        let op = CopyOp { dst_layout: self.layout.clone() };
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![src.src()] };
        crate::backends::launch_into(&kernel, &self.storage)
    }
}
