//! `interpolate` (PyTorch's `F.interpolate` to a given size, modes
//! `nearest` and `bilinear` with or without `align_corners`), with its
//! gradient: the book's `Resize`. Host kernels call [`crate::host_nn`];
//! CUDA kernels compute the same source indices and weights (one thread per
//! output element forward, per image plane backward).

use super::conv::{check_float, dptr, host_dispatch, instantiate, HostFloat, HostNnKernel, Pair};
use crate::base::buffer::CpuBuffer;
use crate::base::error::{Error, Result};
use crate::base::shape::Shape;
use crate::host_nn::{self, InterpMode, InterpParams};
use crate::kernel::cuda::{dtype_tag, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::Tensor;
use std::sync::Arc;

#[derive(Clone, Copy, Debug)]
struct InterpOp {
    p: InterpParams,
    backward: bool,
}

impl HostNnKernel for InterpOp {
    fn run<T: HostFloat>(&self, ins: &[&[T]], out: &mut [T], threads: usize) -> Result<()> {
        if self.backward {
            host_nn::interpolate_backward(&self.p, ins[0], out, threads)?;
        } else {
            host_nn::interpolate_forward(&self.p, ins[0], out, threads)?;
        }
        Ok(())
    }
}

crate::kernel_args! {
    /// An interpolation kernel's argument; `mode`: 0 nearest, 1 bilinear,
    /// 2 bilinear with aligned corners.
    InterpArgs { src: u64, out: u64, planes: u64, h: u64, w: u64, oh: u64, ow: u64, mode: u64 }
}

impl CustomKernel for InterpOp {
    fn name(&self) -> &'static str {
        if self.backward {
            "interpolate_backward"
        } else {
            "interpolate"
        }
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        host_dispatch(self, self.name(), inputs, out, threads)
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let p = &self.p;
        let [n, c, oh, ow] = p.validate()?;
        let mode = match p.mode {
            InterpMode::Nearest => 0,
            InterpMode::Bilinear { align_corners: false } => 1,
            InterpMode::Bilinear { align_corners: true } => 2,
        };
        let a = InterpArgs {
            src: dptr(dev, &inputs[0])?,
            out: dev.ptr(out)?,
            planes: (n * c) as u64,
            h: p.input[0] as u64,
            w: p.input[1] as u64,
            oh: oh as u64,
            ow: ow as u64,
            mode,
        };
        let (kernel, count) = if self.backward { ("interp_bwd", n * c) } else { ("interp_fwd", n * c * oh * ow) };
        dev.launch(&MODULE, &format!("{kernel}_{}", dtype_tag(out.dtype)), dev.grid_for(count), BLOCK, &a)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("interpolate", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(InterpArgs::C_DECL);
    s.push_str(
        r#"
// PyTorch's nearest source index (in f32).
__device__ u64 interp_nearest(u64 o, u64 in, u64 out) {
    if (out == in) return o;
    if (out == 2 * in) return o >> 1;
    float scale = (float)in / (float)out;
    u64 i = (u64)floorf((float)o * scale);
    return i < in - 1 ? i : in - 1;
}

// PyTorch's bilinear taps along one axis, computed in T.
template <typename T> __device__ void interp_taps(u64 o, u64 in, u64 out, bool align, u64* i0, u64* i1, T* l0, T* l1) {
    if (out == in) { *i0 = o; *i1 = o; *l0 = Cv<T>::from(1.0); *l1 = Cv<T>::from(0.0); return; }
    T ratio = align ? (out > 1 ? Cv<T>::from((double)(in - 1)) / Cv<T>::from((double)(out - 1)) : Cv<T>::from(0.0))
                    : Cv<T>::from((double)in) / Cv<T>::from((double)out);
    T real;
    if (align) {
        real = ratio * Cv<T>::from((double)o);
    } else {
        real = ratio * (Cv<T>::from((double)o) + Cv<T>::from(0.5)) - Cv<T>::from(0.5);
        if (real < Cv<T>::from(0.0)) real = Cv<T>::from(0.0);
    }
    u64 a = (u64)floorf((float)Cv<T>::to(real));
    if (a > in - 1) a = in - 1;
    T l = real - Cv<T>::from((double)a);
    if (l < Cv<T>::from(0.0)) l = Cv<T>::from(0.0);
    if (l > Cv<T>::from(1.0)) l = Cv<T>::from(1.0);
    *i0 = a;
    *i1 = a < in - 1 ? a + 1 : a;
    *l1 = l;
    *l0 = Cv<T>::from(1.0) - l;
}

template <typename T> __device__ void interp_fwd_impl(const InterpArgs& p) {
    const T* x = (const T*)p.src;
    T* y = (T*)p.out;
    GRID_LOOP(t, p.planes * p.oh * p.ow) {
        u64 ox = t % p.ow, oy = (t / p.ow) % p.oh, pl = t / (p.ow * p.oh);
        const T* src = x + pl * p.h * p.w;
        if (p.mode == 0) {
            y[t] = src[interp_nearest(oy, p.h, p.oh) * p.w + interp_nearest(ox, p.w, p.ow)];
        } else {
            u64 y0, y1, x0, x1;
            T ly0, ly1, lx0, lx1;
            interp_taps<T>(oy, p.h, p.oh, p.mode == 2, &y0, &y1, &ly0, &ly1);
            interp_taps<T>(ox, p.w, p.ow, p.mode == 2, &x0, &x1, &lx0, &lx1);
            T top = src[y0 * p.w + x0] * lx0 + src[y0 * p.w + x1] * lx1;
            T bottom = src[y1 * p.w + x0] * lx0 + src[y1 * p.w + x1] * lx1;
            y[t] = top * ly0 + bottom * ly1;
        }
    }
}

template <typename T> __device__ void interp_bwd_impl(const InterpArgs& p) {
    const T* dy = (const T*)p.src;
    T* dx = (T*)p.out;
    GRID_LOOP(pl, p.planes) {
        T* d = dx + pl * p.h * p.w;
        const T* g = dy + pl * p.oh * p.ow;
        for (u64 i = 0; i < p.h * p.w; ++i) d[i] = Cv<T>::from(0.0);
        for (u64 oy = 0; oy < p.oh; ++oy) {
            for (u64 ox = 0; ox < p.ow; ++ox) {
                T v = g[oy * p.ow + ox];
                if (p.mode == 0) {
                    u64 at = interp_nearest(oy, p.h, p.oh) * p.w + interp_nearest(ox, p.w, p.ow);
                    d[at] = d[at] + v;
                } else {
                    u64 y0, y1, x0, x1;
                    T ly0, ly1, lx0, lx1;
                    interp_taps<T>(oy, p.h, p.oh, p.mode == 2, &y0, &y1, &ly0, &ly1);
                    interp_taps<T>(ox, p.w, p.ow, p.mode == 2, &x0, &x1, &lx0, &lx1);
                    d[y0 * p.w + x0] = d[y0 * p.w + x0] + ly0 * lx0 * v;
                    d[y0 * p.w + x1] = d[y0 * p.w + x1] + ly0 * lx1 * v;
                    d[y1 * p.w + x0] = d[y1 * p.w + x0] + ly1 * lx0 * v;
                    d[y1 * p.w + x1] = d[y1 * p.w + x1] + ly1 * lx1 * v;
                }
            }
        }
    }
}
"#,
    );
    for k in ["interp_fwd", "interp_bwd"] {
        instantiate(&mut s, k, "InterpArgs");
    }
    s
}

fn run(op: InterpOp, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![x.src()] };
    x.run_new(kernel, x.dtype(), Shape::from(dims.to_vec()))
}

impl Tensor {
    /// PyTorch's `F.interpolate(self, size, mode)` over `[N, C, H, W]` (or
    /// `[C, H, W]`): `InterpMode::Nearest` or `InterpMode::Bilinear {
    /// align_corners }`, to the output size `size`.
    ///
    /// ```
    /// use kiln::{InterpMode, Tensor, cpu};
    /// let x = Tensor::from_vec(vec![1f32, 2., 3., 4.], (1, 1, 2, 2), &cpu())?;
    /// let y = x.interpolate(4, InterpMode::Nearest)?;
    /// assert_eq!(y.to_vec::<f32>()?[..4], [1., 1., 2., 2.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn interpolate(&self, size: impl Into<Pair>, mode: InterpMode) -> Result<Tensor> {
        const OP: &str = "interpolate";
        let size = size.into().0;
        if self.rank() == 3 {
            return self.unsqueeze(0)?.interpolate(size, mode)?.squeeze(0);
        }
        check_float(OP, "input", self)?;
        let [n, c, h, w] = *self.dims() else {
            return Err(Error::invalid(OP, format!("input must be 3-D (C, H, W) or 4-D (N, C, H, W), got shape {}", self.shape())));
        };
        let p = InterpParams { batch: n, channels: c, input: [h, w], output: size, mode, scales: [None, None] };
        let out = p.validate().map_err(|e| match Error::from(e) {
            Error::InvalidArgument { op, msg } => Error::InvalidArgument { op, msg: format!("{msg} (input {})", self.shape()) },
            other => other,
        })?;
        let y = run(InterpOp { p, backward: false }, &self.contiguous()?, &out)?;
        let in_dims = [n, c, h, w];
        Ok(crate::autograd::record(y, &[self], false, || {
            Box::new(move |cx| Ok(smallvec::smallvec![Some(run(InterpOp { p, backward: true }, &cx.g.contiguous()?, &in_dims)?)]))
        }))
    }
}
