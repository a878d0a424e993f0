//! Pooling over NCHW images, PyTorch's `F.max_pool2d` (kernel, stride,
//! padding, dilation, ceil_mode), `F.avg_pool2d` (count_include_pad,
//! divisor_override) and `F.adaptive_avg_pool2d`, with gradients. Host
//! kernels call [`crate::host_nn`]; CUDA kernels are direct: one thread per
//! output element forward, one thread per input element backward (gathering
//! from the windows that cover it in the host's order, with no atomics).

use super::conv::{check_extents, check_float, dptr, host_dispatch, instantiate, HostFloat, HostNnKernel, Pair};
use crate::base::buffer::CpuBuffer;
use crate::base::error::{Error, Result};
use crate::base::shape::Shape;
use crate::host_nn::{self, AdaptivePool2dParams, AvgPool2dParams, MaxPool2dParams};
use crate::kernel::cuda::{dtype_tag, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::runtime::memory::try_vec;
use crate::Tensor;
use std::sync::Arc;

/// The arguments of [`Tensor::max_pool2d`] and [`Tensor::avg_pool2d`];
/// PyTorch's defaults except the kernel size (stride = kernel size, no
/// padding, dilation 1, floor mode, `count_include_pad`).
///
/// ```
/// let a = kiln::Pool2dArgs::new(3).stride(2).padding(1).ceil_mode(true);
/// assert_eq!((a.kernel, a.stride, a.padding), ([3, 3], Some([2, 2]), [1, 1]));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dArgs {
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Window step; `None` is the kernel size.
    pub stride: Option<[usize; 2]>,
    /// Padding on both sides (−∞ for max pooling, zeros for average).
    pub padding: [usize; 2],
    /// Spacing of the window's elements (max pooling only).
    pub dilation: [usize; 2],
    /// Count a last partial window.
    pub ceil_mode: bool,
    /// Average pooling: divide by the window including its padding.
    pub count_include_pad: bool,
    /// Average pooling: divide every window by this instead (nonzero).
    pub divisor_override: Option<i64>,
}

impl Pool2dArgs {
    /// A window of this size, with PyTorch's defaults for the rest.
    pub fn new(kernel: impl Into<Pair>) -> Pool2dArgs {
        Pool2dArgs {
            kernel: kernel.into().0,
            stride: None,
            padding: [0, 0],
            dilation: [1, 1],
            ceil_mode: false,
            count_include_pad: true,
            divisor_override: None,
        }
    }
    /// With this stride.
    pub fn stride(mut self, s: impl Into<Pair>) -> Self {
        self.stride = Some(s.into().0);
        self
    }
    /// With this padding.
    pub fn padding(mut self, p: impl Into<Pair>) -> Self {
        self.padding = p.into().0;
        self
    }
    /// With this dilation.
    pub fn dilation(mut self, d: impl Into<Pair>) -> Self {
        self.dilation = d.into().0;
        self
    }
    /// With or without ceil mode.
    pub fn ceil_mode(mut self, c: bool) -> Self {
        self.ceil_mode = c;
        self
    }
    /// With or without counting the padding in averages.
    pub fn count_include_pad(mut self, c: bool) -> Self {
        self.count_include_pad = c;
        self
    }
    /// With a fixed divisor for averages.
    pub fn divisor_override(mut self, d: Option<i64>) -> Self {
        self.divisor_override = d;
        self
    }
}

#[derive(Clone, Copy, Debug)]
enum PoolOp {
    /// [x] -> y.
    MaxForward(MaxPool2dParams),
    /// [x, dy] -> dx (the argmax is found again).
    MaxBackward(MaxPool2dParams),
    /// [x] -> y.
    AvgForward(AvgPool2dParams),
    /// [dy] -> dx.
    AvgBackward(AvgPool2dParams),
    /// [x] -> y.
    AdaptiveForward(AdaptivePool2dParams),
    /// [dy] -> dx.
    AdaptiveBackward(AdaptivePool2dParams),
}

impl HostNnKernel for PoolOp {
    fn run<T: HostFloat>(&self, ins: &[&[T]], out: &mut [T], threads: usize) -> Result<()> {
        match self {
            PoolOp::MaxForward(p) => {
                let mut idx: Vec<i64> = try_vec(out.len())?;
                idx.resize(out.len(), 0);
                host_nn::max_pool2d_forward(p, ins[0], out, &mut idx, threads)?;
            }
            PoolOp::MaxBackward(p) => {
                let n = ins[1].len();
                let (mut vals, mut idx): (Vec<T>, Vec<i64>) = (try_vec(n)?, try_vec(n)?);
                vals.resize(n, T::ZERO);
                idx.resize(n, 0);
                host_nn::max_pool2d_forward(p, ins[0], &mut vals, &mut idx, threads)?;
                host_nn::max_pool2d_backward(p, ins[1], &idx, out, threads)?;
            }
            PoolOp::AvgForward(p) => host_nn::avg_pool2d_forward(p, ins[0], out, threads)?,
            PoolOp::AvgBackward(p) => host_nn::avg_pool2d_backward(p, ins[0], out, threads)?,
            PoolOp::AdaptiveForward(p) => host_nn::adaptive_avg_pool2d_forward(p, ins[0], out, threads)?,
            PoolOp::AdaptiveBackward(p) => host_nn::adaptive_avg_pool2d_backward(p, ins[0], out, threads)?,
        }
        Ok(())
    }
}

crate::kernel_args! {
    /// A pooling kernel's argument: planes of h × w in, oh × ow out.
    /// `mode`: average pooling's divisor rule (0 count_include_pad,
    /// 1 valid elements only, 2 `divisor`).
    PoolArgs {
        x: u64, dy: u64, out: u64, planes: u64, h: u64, w: u64, oh: u64, ow: u64,
        kh: u64, kw: u64, sh: u64, sw: u64, ph: u64, pw: u64, dh: u64, dw: u64, mode: u64, divisor: f64
    }
}

impl CustomKernel for PoolOp {
    fn name(&self) -> &'static str {
        match self {
            PoolOp::MaxForward(_) => "max_pool2d",
            PoolOp::MaxBackward(_) => "max_pool2d_backward",
            PoolOp::AvgForward(_) => "avg_pool2d",
            PoolOp::AvgBackward(_) => "avg_pool2d_backward",
            PoolOp::AdaptiveForward(_) => "adaptive_avg_pool2d",
            PoolOp::AdaptiveBackward(_) => "adaptive_avg_pool2d_backward",
        }
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        host_dispatch(self, self.name(), inputs, out, threads)
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let mut a = PoolArgs {
            x: 0,
            dy: 0,
            out: dev.ptr(out)?,
            planes: 0,
            h: 0,
            w: 0,
            oh: 0,
            ow: 0,
            kh: 1,
            kw: 1,
            sh: 1,
            sw: 1,
            ph: 0,
            pw: 0,
            dh: 1,
            dw: 1,
            mode: 0,
            divisor: 1.0,
        };
        let mut geom = |[n, c, oh, ow]: [usize; 4], input: [usize; 2], kernel: [usize; 2], stride: [usize; 2], pad: [usize; 2]| {
            (a.planes, a.h, a.w, a.oh, a.ow) = ((n * c) as u64, input[0] as u64, input[1] as u64, oh as u64, ow as u64);
            (a.kh, a.kw, a.sh, a.sw, a.ph, a.pw) =
                (kernel[0] as u64, kernel[1] as u64, stride[0] as u64, stride[1] as u64, pad[0] as u64, pad[1] as u64);
            a
        };
        let (mut a, kernel, backward) = match self {
            PoolOp::MaxForward(p) | PoolOp::MaxBackward(p) => {
                let mut a = geom(p.validate()?, p.input, p.kernel, p.stride, p.padding);
                (a.dh, a.dw) = (p.dilation[0] as u64, p.dilation[1] as u64);
                (a, "max_pool", matches!(self, PoolOp::MaxBackward(_)))
            }
            PoolOp::AvgForward(p) | PoolOp::AvgBackward(p) => {
                let mut a = geom(p.validate()?, p.input, p.kernel, p.stride, p.padding);
                (a.mode, a.divisor) = match p.divisor_override {
                    Some(d) => (2, d as f64),
                    None => (u64::from(!p.count_include_pad), 1.0),
                };
                (a, "avg_pool", matches!(self, PoolOp::AvgBackward(_)))
            }
            PoolOp::AdaptiveForward(p) | PoolOp::AdaptiveBackward(p) => {
                (geom(p.validate()?, p.input, [1, 1], [1, 1], [0, 0]), "adaptive_pool", matches!(self, PoolOp::AdaptiveBackward(_)))
            }
        };
        // Check every allocation against the geometry before launching.
        let (image, pooled) = ((a.planes * a.h * a.w) as usize, (a.planes * a.oh * a.ow) as usize);
        let (needs, out_len): (&[usize], usize) = match (self, backward) {
            (PoolOp::MaxBackward(_), _) => (&[image, pooled], image),
            (_, true) => (&[pooled], image),
            (_, false) => (&[image], pooled),
        };
        check_extents(self.name(), inputs, needs, out, out_len)?;
        match (self, backward) {
            (PoolOp::MaxBackward(_), _) => (a.x, a.dy) = (dptr(dev, &inputs[0])?, dptr(dev, &inputs[1])?),
            (_, true) => a.dy = dptr(dev, &inputs[0])?,
            (_, false) => a.x = dptr(dev, &inputs[0])?,
        }
        let count = if backward { a.planes * a.h * a.w } else { a.planes * a.oh * a.ow } as usize;
        let name = format!("{kernel}_{}_{}", if backward { "bwd" } else { "fwd" }, dtype_tag(out.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(count), BLOCK, &a)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("pool2d", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(PoolArgs::C_DECL);
    s.push_str(
        r#"
// The argmax (y*w + x within the plane) of output (oy, ox): the first of
// equal maxima, a NaN over everything; an empty window gives -inf at the
// position -1 (no gradient).
template <typename T> __device__ i64 max_window(const PoolArgs& p, const T* src, u64 oy, u64 ox, T* best_out) {
    i64 y0 = (i64)(oy * p.sh) - (i64)p.ph, x0 = (i64)(ox * p.sw) - (i64)p.pw;
    T best = Ar<T>::lowest();
    i64 at = -1;
    for (u64 ky = 0; ky < p.kh; ++ky) {
        i64 y = y0 + (i64)(ky * p.dh);
        if (y < 0 || y >= (i64)p.h) continue;
        for (u64 kx = 0; kx < p.kw; ++kx) {
            i64 x = x0 + (i64)(kx * p.dw);
            if (x < 0 || x >= (i64)p.w) continue;
            T v = src[y * (i64)p.w + x];
            if (at < 0 || v > best || v != v) {
                best = v;
                at = y * (i64)p.w + x;
            }
        }
    }
    *best_out = best;
    return at;
}

template <typename T> __device__ void max_pool_fwd_impl(const PoolArgs& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.out;
    GRID_LOOP(t, p.planes * p.oh * p.ow) {
        u64 ox = t % p.ow, oy = (t / p.ow) % p.oh, pl = t / (p.ow * p.oh);
        T best;
        max_window(p, x + pl * p.h * p.w, oy, ox, &best);
        y[t] = best;
    }
}

// The output rows (or columns) whose windows may cover input row y: from
// the first whose last tap reaches y to the last whose first tap is at or
// before it (a window of k taps dilated by d, stride s, padding pad).
__device__ void covering(u64 y, u64 k, u64 d, u64 s, u64 pad, u64 out, u64* lo, u64* hi) {
    i64 last = (i64)y + (i64)pad, first = last - (i64)((k - 1) * d);
    *lo = first <= 0 ? 0 : (u64)((first + (i64)s - 1) / (i64)s);
    u64 h = last < 0 ? 0 : (u64)(last / (i64)s) + 1;
    *hi = h < out ? h : out;
}

// One thread per input element: the gradient of every window whose argmax
// it is, windows in row-major order (the order the CPU adds them in).
template <typename T> __device__ void max_pool_bwd_impl(const PoolArgs& p) {
    const T* x = (const T*)p.x;
    const T* dy = (const T*)p.dy;
    T* dx = (T*)p.out;
    GRID_LOOP(t, p.planes * p.h * p.w) {
        u64 xx = t % p.w, yy = (t / p.w) % p.h, pl = t / (p.w * p.h);
        u64 oy0, oy1, ox0, ox1;
        covering(yy, p.kh, p.dh, p.sh, p.ph, p.oh, &oy0, &oy1);
        covering(xx, p.kw, p.dw, p.sw, p.pw, p.ow, &ox0, &ox1);
        T acc = Cv<T>::from(0.0);
        i64 me = (i64)(yy * p.w + xx);
        for (u64 oy = oy0; oy < oy1; ++oy) {
            for (u64 ox = ox0; ox < ox1; ++ox) {
                T best;
                if (max_window(p, x + pl * p.h * p.w, oy, ox, &best) == me) acc = acc + dy[(pl * p.oh + oy) * p.ow + ox];
            }
        }
        dx[t] = acc;
    }
}

// Window (oy, ox) of average pooling: rows [y0, y1), columns [x0, x1)
// inside the image, and its divisor.
__device__ double avg_window(const PoolArgs& p, u64 oy, u64 ox, i64* y0, i64* y1, i64* x0, i64* x1) {
    i64 ys = (i64)(oy * p.sh) - (i64)p.ph, xs = (i64)(ox * p.sw) - (i64)p.pw;
    i64 ye = ys + (i64)p.kh, xe = xs + (i64)p.kw;
    if (ye > (i64)(p.h + p.ph)) ye = (i64)(p.h + p.ph);
    if (xe > (i64)(p.w + p.pw)) xe = (i64)(p.w + p.pw);
    double pooled = (double)((ye - ys) * (xe - xs));
    *y0 = ys < 0 ? 0 : ys;
    *x0 = xs < 0 ? 0 : xs;
    *y1 = ye > (i64)p.h ? (i64)p.h : ye;
    *x1 = xe > (i64)p.w ? (i64)p.w : xe;
    if (*y1 < *y0) *y1 = *y0;
    if (*x1 < *x0) *x1 = *x0;
    if (p.mode == 2) return p.divisor;
    if (p.mode == 1) return (double)((*y1 - *y0) * (*x1 - *x0));
    return pooled;
}

template <typename T> __device__ void avg_pool_fwd_impl(const PoolArgs& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.out;
    GRID_LOOP(t, p.planes * p.oh * p.ow) {
        u64 ox = t % p.ow, oy = (t / p.ow) % p.oh, pl = t / (p.ow * p.oh);
        i64 y0, y1, x0, x1;
        double div = avg_window(p, oy, ox, &y0, &y1, &x0, &x1);
        const T* src = x + pl * p.h * p.w;
        T sum = Cv<T>::from(0.0);
        for (i64 yy = y0; yy < y1; ++yy)
            for (i64 xx = x0; xx < x1; ++xx) sum = sum + src[yy * (i64)p.w + xx];
        y[t] = (y1 > y0 && x1 > x0) ? sum / Cv<T>::from(div) : Cv<T>::from(0.0);
    }
}

// One thread per input element: the share of every window that covers it.
template <typename T> __device__ void avg_pool_bwd_impl(const PoolArgs& p) {
    const T* dy = (const T*)p.dy;
    T* dx = (T*)p.out;
    GRID_LOOP(t, p.planes * p.h * p.w) {
        u64 xx = t % p.w, yy = (t / p.w) % p.h, pl = t / (p.w * p.h);
        u64 oy0, oy1, ox0, ox1;
        covering(yy, p.kh, 1, p.sh, p.ph, p.oh, &oy0, &oy1);
        covering(xx, p.kw, 1, p.sw, p.pw, p.ow, &ox0, &ox1);
        T acc = Cv<T>::from(0.0);
        for (u64 oy = oy0; oy < oy1; ++oy) {
            for (u64 ox = ox0; ox < ox1; ++ox) {
                i64 y0, y1, x0, x1;
                double div = avg_window(p, oy, ox, &y0, &y1, &x0, &x1);
                if ((i64)yy < y0 || (i64)yy >= y1 || (i64)xx < x0 || (i64)xx >= x1) continue;
                acc = acc + dy[(pl * p.oh + oy) * p.ow + ox] / Cv<T>::from(div);
            }
        }
        dx[t] = acc;
    }
}

// Adaptive pooling's window along one axis: [o*size/out, ceil((o+1)*size/out)).
__device__ void adaptive_range(u64 o, u64 out, u64 size, u64* a, u64* b) {
    *a = o * size / out;
    *b = ((o + 1) * size + out - 1) / out;
}

template <typename T> __device__ void adaptive_pool_fwd_impl(const PoolArgs& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.out;
    GRID_LOOP(t, p.planes * p.oh * p.ow) {
        u64 ox = t % p.ow, oy = (t / p.ow) % p.oh, pl = t / (p.ow * p.oh);
        u64 y0, y1, x0, x1;
        adaptive_range(oy, p.oh, p.h, &y0, &y1);
        adaptive_range(ox, p.ow, p.w, &x0, &x1);
        const T* src = x + pl * p.h * p.w;
        T sum = Cv<T>::from(0.0);
        for (u64 yy = y0; yy < y1; ++yy)
            for (u64 xx = x0; xx < x1; ++xx) sum = sum + src[yy * p.w + xx];
        y[t] = sum / Cv<T>::from((double)((y1 - y0) * (x1 - x0)));
    }
}

// One thread per input element: the share of every window that covers it
// (the windows of output o cover [o·size/out, ceil((o+1)·size/out)), so
// those covering i lie between o = i·out/size − 1 and (i+1)·out/size).
template <typename T> __device__ void adaptive_pool_bwd_impl(const PoolArgs& p) {
    const T* dy = (const T*)p.dy;
    T* dx = (T*)p.out;
    GRID_LOOP(t, p.planes * p.h * p.w) {
        u64 xx = t % p.w, yy = (t / p.w) % p.h, pl = t / (p.w * p.h);
        u64 oy0 = yy * p.oh / p.h, oy1 = ((yy + 1) * p.oh + p.h - 1) / p.h;
        u64 ox0 = xx * p.ow / p.w, ox1 = ((xx + 1) * p.ow + p.w - 1) / p.w;
        oy0 = oy0 > 0 ? oy0 - 1 : 0;
        ox0 = ox0 > 0 ? ox0 - 1 : 0;
        if (oy1 > p.oh) oy1 = p.oh;
        if (ox1 > p.ow) ox1 = p.ow;
        T acc = Cv<T>::from(0.0);
        for (u64 oy = oy0; oy < oy1; ++oy) {
            u64 y0, y1;
            adaptive_range(oy, p.oh, p.h, &y0, &y1);
            if (yy < y0 || yy >= y1) continue;
            for (u64 ox = ox0; ox < ox1; ++ox) {
                u64 x0, x1;
                adaptive_range(ox, p.ow, p.w, &x0, &x1);
                if (xx < x0 || xx >= x1) continue;
                acc = acc + dy[(pl * p.oh + oy) * p.ow + ox] / Cv<T>::from((double)((y1 - y0) * (x1 - x0)));
            }
        }
        dx[t] = acc;
    }
}
"#,
    );
    for k in ["max_pool_fwd", "max_pool_bwd", "avg_pool_fwd", "avg_pool_bwd", "adaptive_pool_fwd", "adaptive_pool_bwd"] {
        instantiate(&mut s, k, "PoolArgs");
    }
    s
}

/// Runs one pooling kernel into a new tensor of `dims`.
fn run_pool(op: PoolOp, inputs: &[&Tensor], dims: &[usize]) -> Result<Tensor> {
    let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: inputs.iter().map(|t| t.src()).collect() };
    inputs[0].run_new(kernel, inputs[0].dtype(), Shape::from(dims.to_vec()))
}

/// `[N, C, H, W]` of a 4-D input (a 3-D one is batched by the caller).
fn nchw(op: &str, x: &Tensor) -> Result<[usize; 4]> {
    check_float(op, "input", x)?;
    match *x.dims() {
        [n, c, h, w] => Ok([n, c, h, w]),
        _ => Err(Error::invalid(op, format!("input must be 3-D (C, H, W) or 4-D (N, C, H, W), got shape {}", x.shape()))),
    }
}

fn batched(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if x.rank() == 3 {
        f(&x.unsqueeze(0)?)?.squeeze(0)
    } else {
        f(x)
    }
}

/// A host_nn error with the input's shape added.
fn with_shape(e: host_nn::NnError, x: &Tensor) -> Error {
    match Error::from(e) {
        Error::InvalidArgument { op, msg } => Error::InvalidArgument { op, msg: format!("{msg} (input {})", x.shape()) },
        other => other,
    }
}

impl Tensor {
    /// PyTorch's `F.max_pool2d`: the largest element of each window
    /// (kernel, stride, padding with −∞, dilation, ceil_mode), over `[N, C,
    /// H, W]` or `[C, H, W]`; the gradient goes to the first maximum.
    ///
    /// ```
    /// use kiln::{Pool2dArgs, Tensor, cpu};
    /// let x = Tensor::arange(0.0, 16.0, 1.0, &cpu())?.reshape((1, 1, 4, 4))?;
    /// assert_eq!(x.max_pool2d(Pool2dArgs::new(2))?.to_vec::<f32>()?, vec![5., 7., 13., 15.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn max_pool2d(&self, args: Pool2dArgs) -> Result<Tensor> {
        batched(self, |x| {
            let [n, c, h, w] = nchw("max_pool2d", x)?;
            let p = MaxPool2dParams {
                batch: n,
                channels: c,
                input: [h, w],
                kernel: args.kernel,
                stride: args.stride.unwrap_or(args.kernel),
                padding: args.padding,
                dilation: args.dilation,
                ceil_mode: args.ceil_mode,
            };
            let out = p.validate().map_err(|e| with_shape(e, x))?;
            let xc = x.contiguous()?;
            let y = run_pool(PoolOp::MaxForward(p), &[&xc], &out)?;
            Ok(crate::autograd::record(y, &[x], false, || {
                Box::new(move |c| {
                    let x = c.inputs[0].contiguous()?;
                    Ok(smallvec::smallvec![Some(run_pool(PoolOp::MaxBackward(p), &[&x, &c.g.contiguous()?], x.dims())?)])
                })
            }))
        })
    }

    /// PyTorch's `F.avg_pool2d`: the mean of each window (kernel, stride,
    /// zero padding, ceil_mode, count_include_pad, divisor_override).
    ///
    /// ```
    /// use kiln::{Pool2dArgs, Tensor, cpu};
    /// let x = Tensor::arange(0.0, 16.0, 1.0, &cpu())?.reshape((1, 1, 4, 4))?;
    /// assert_eq!(x.avg_pool2d(Pool2dArgs::new(2))?.to_vec::<f32>()?, vec![2.5, 4.5, 10.5, 12.5]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn avg_pool2d(&self, args: Pool2dArgs) -> Result<Tensor> {
        batched(self, |x| {
            let [n, c, h, w] = nchw("avg_pool2d", x)?;
            if args.dilation != [1, 1] {
                return Err(Error::invalid("avg_pool2d", format!("dilation must be 1, got {:?}", args.dilation)));
            }
            let p = AvgPool2dParams {
                batch: n,
                channels: c,
                input: [h, w],
                kernel: args.kernel,
                stride: args.stride.unwrap_or(args.kernel),
                padding: args.padding,
                ceil_mode: args.ceil_mode,
                count_include_pad: args.count_include_pad,
                divisor_override: args.divisor_override,
            };
            let out = p.validate().map_err(|e| with_shape(e, x))?;
            let y = run_pool(PoolOp::AvgForward(p), &[&x.contiguous()?], &out)?;
            let in_dims = [n, c, h, w];
            Ok(crate::autograd::record(y, &[x], false, || {
                Box::new(move |c| Ok(smallvec::smallvec![Some(run_pool(PoolOp::AvgBackward(p), &[&c.g.contiguous()?], &in_dims)?)]))
            }))
        })
    }

    /// PyTorch's `F.adaptive_avg_pool2d`: averages over windows chosen so
    /// that the output is `output` (height, width) whatever the input size.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::arange(0.0, 16.0, 1.0, &cpu())?.reshape((1, 1, 4, 4))?;
    /// assert_eq!(x.adaptive_avg_pool2d(1)?.to_vec::<f32>()?, vec![7.5]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn adaptive_avg_pool2d(&self, output: impl Into<Pair>) -> Result<Tensor> {
        let output = output.into().0;
        batched(self, |x| {
            let [n, c, h, w] = nchw("adaptive_avg_pool2d", x)?;
            let p = AdaptivePool2dParams { batch: n, channels: c, input: [h, w], output };
            let out = p.validate().map_err(|e| with_shape(e, x))?;
            let y = run_pool(PoolOp::AdaptiveForward(p), &[&x.contiguous()?], &out)?;
            let in_dims = [n, c, h, w];
            Ok(crate::autograd::record(y, &[x], false, || {
                Box::new(move |c| Ok(smallvec::smallvec![Some(run_pool(PoolOp::AdaptiveBackward(p), &[&c.g.contiguous()?], &in_dims)?)]))
            }))
        })
    }
}
