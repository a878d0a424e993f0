//! `conv2d` and `conv_transpose2d` (PyTorch's `F.conv2d` and
//! `F.conv_transpose2d`): NCHW images, OIHW weights, stride, padding
//! (explicit or `"same"`), dilation, groups and an optional bias, with
//! gradients. Three kernels serve both ops: the forward convolution, its
//! input gradient (which is the transposed convolution's forward) and its
//! weight gradient. Host kernels call [`crate::host_nn`]. On CUDA they run
//! through cuDNN when it loads and takes them (`backends/cuda/dnn.rs`, via
//! [`CudaDevice::conv_dnn`]), else through im2col and cuBLAS (`gemm.rs`) when
//! cuBLAS loads, else through the direct kernels below (one thread per
//! output element, f64 accumulation); `KILN_CUDA_CONV` forces one path.
//!
//! Also the helpers that the other convolutional-network ops (`pool.rs`,
//! `norm.rs`) share: the host dispatch over f32/f64 slices and the device
//! pointer of a contiguous operand.

use crate::backends::host::{gather_view, unsupported_op};
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::Shape;
use crate::host_nn::{self, Conv2dParams, ConvGeom, ConvTranspose2dParams, NnFloat, Padding2d};
use crate::kernel::cuda::{
    c_type, conv_path, dtype_tag, ConvDims, ConvPath, CudaDevice, CudaModule, DnnConvCall, DnnDirection, Offload, BLOCK,
};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::tensor::{check_same_device, check_same_dtype};
use crate::Tensor;
use std::sync::Arc;

mod gemm;

// ---- helpers shared by conv/, pool.rs and norm.rs -----------------------------

/// A float element type of the convolutional-network kernels.
pub(crate) trait HostFloat: NnFloat {
    fn slice(buf: &CpuBuffer) -> Option<&[Self]>;
}

impl HostFloat for f32 {
    fn slice(buf: &CpuBuffer) -> Option<&[f32]> {
        match buf {
            CpuBuffer::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl HostFloat for f64 {
    fn slice(buf: &CpuBuffer) -> Option<&[f64]> {
        match buf {
            CpuBuffer::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// A host kernel over contiguous float slices (its inputs in order).
pub(crate) trait HostNnKernel {
    fn run<T: HostFloat>(&self, ins: &[&[T]], out: &mut [T], threads: usize) -> Result<()>;
}

/// Runs `op` over its inputs as contiguous slices of the output's dtype.
pub(crate) fn host_dispatch(op: &impl HostNnKernel, name: &str, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
    let gathered: Vec<Option<CpuBuffer>> = inputs
        .iter()
        .map(|i| if i.layout.contiguous_range().is_some() { Ok(None) } else { gather_view(i.buf, i.layout).map(Some) })
        .collect::<Result<_>>()?;
    fn slices<'a, T: HostFloat>(name: &str, inputs: &'a [HostIn<'_>], gathered: &'a [Option<CpuBuffer>]) -> Result<Vec<&'a [T]>> {
        inputs
            .iter()
            .zip(gathered)
            .map(|(i, g)| match g {
                Some(g) => T::slice(g).ok_or_else(|| unsupported_op(name)),
                None => {
                    let (a, b) = i.layout.contiguous_range().unwrap_or((0, 0));
                    T::slice(i.buf).map(|v| &v[a..b]).ok_or_else(|| unsupported_op(name))
                }
            })
            .collect()
    }
    match out {
        CpuBuffer::F32(o) => op.run(&slices::<f32>(name, inputs, &gathered)?, o, threads),
        CpuBuffer::F64(o) => op.run(&slices::<f64>(name, inputs, &gathered)?, o, threads),
        _ => Err(unsupported_op(name)),
    }
}

/// The device address of a contiguous operand's first element.
pub(crate) fn dptr(dev: &dyn CudaDevice, s: &Src<'_>) -> Result<u64> {
    let off = s.layout.contiguous_range().map_or(s.layout.offset(), |(a, _)| a);
    Ok(dev.ptr(&s.storage)? + (off * s.storage.dtype.size_in_bytes()) as u64)
}

/// Refuses a CUDA launch whose geometry reaches past an operand: each
/// input must be a contiguous view of at least `needs[i]` elements inside
/// its allocation, and the output must hold `count`. The kernels index their
/// operands by the geometry alone, so without this a geometry that disagreed
/// with the tensors would read or write another allocation's memory.
pub(crate) fn check_extents(kernel: &str, inputs: &[Src<'_>], needs: &[usize], out: &Storage, count: usize) -> Result<()> {
    let refuse = |what: String, need: usize, have: String| {
        Err(Error::Backend {
            device: out.device,
            msg: format!(
                "{kernel}: the kernel's geometry reaches {need} elements of its {what}, which holds {have}; \
                 the launch was refused before anything was read or written (a kiln defect: please report it with the shapes)"
            ),
        })
    };
    if inputs.len() != needs.len() {
        return refuse("inputs".into(), needs.len(), format!("{} operands", inputs.len()));
    }
    for (i, (s, &need)) in inputs.iter().zip(needs).enumerate() {
        if need == 0 {
            // Nothing of it is read (an empty layout may have no range).
            continue;
        }
        let have = s.layout.contiguous_range().filter(|&(_, end)| end <= s.storage.len).map(|(start, end)| end - start);
        if have.is_none_or(|h| h < need) {
            let have = have.map_or_else(|| format!("a non-contiguous view of layout {:?}", s.layout), |h| format!("{h}"));
            return refuse(format!("input {i}"), need, have);
        }
    }
    if out.len < count {
        return refuse("output".into(), count, format!("{}", out.len));
    }
    Ok(())
}

/// Refuses dtypes other than f32 and f64 (the kernels' types).
pub(crate) fn check_float(op: &str, what: &str, t: &Tensor) -> Result<()> {
    if !matches!(t.dtype(), DType::F32 | DType::F64) {
        return Err(Error::invalid(op, format!("{what} must be f32 or f64, got {} of shape {}", t.dtype(), t.shape())));
    }
    Ok(())
}

/// The C kernels' f32 and f64 instantiations of `{name}_impl`.
pub(crate) fn instantiate(s: &mut String, name: &str, args: &str) {
    for dt in [DType::F32, DType::F64] {
        let (tn, tt) = (dtype_tag(dt), c_type(dt));
        s.push_str(&format!("extern \"C\" __global__ void {name}_{tn}({args} p) {{ {name}_impl<{tt}>(p); }}\n"));
    }
}

/// A pair of sizes: one value for both (`2`), or `[h, w]` / `(h, w)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair(pub [usize; 2]);

impl From<usize> for Pair {
    fn from(v: usize) -> Pair {
        Pair([v, v])
    }
}
impl From<[usize; 2]> for Pair {
    fn from(v: [usize; 2]) -> Pair {
        Pair(v)
    }
}
impl From<(usize, usize)> for Pair {
    fn from((a, b): (usize, usize)) -> Pair {
        Pair([a, b])
    }
}

// ---- the arguments ----------------------------------------------------------

/// A convolution's padding: explicit zero padding on each side, or
/// PyTorch's `"same"` (output as large as the input; stride 1 only) and
/// `"valid"` (none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConvPadding {
    /// `[ph, pw]` rows above and below, columns left and right.
    Explicit([usize; 2]),
    /// PyTorch's `padding="same"`.
    Same,
    /// PyTorch's `padding="valid"` (no padding).
    Valid,
}

/// The arguments of [`Tensor::conv2d`] beside the weight and bias; the
/// defaults are PyTorch's (stride 1, no padding, dilation 1, 1 group).
///
/// ```
/// let a = kiln::Conv2dArgs::default().stride(2).padding(1).groups(2);
/// assert_eq!((a.stride, a.groups), ([2, 2], 2));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dArgs {
    /// Vertical and horizontal stride.
    pub stride: [usize; 2],
    /// Padding.
    pub padding: ConvPadding,
    /// Vertical and horizontal dilation.
    pub dilation: [usize; 2],
    /// Channel groups.
    pub groups: usize,
    /// Extra rows/columns on the bottom/right of a transposed convolution's
    /// output (PyTorch's `output_padding`; ignored by `conv2d`).
    pub output_padding: [usize; 2],
}

impl Default for Conv2dArgs {
    fn default() -> Self {
        Conv2dArgs { stride: [1, 1], padding: ConvPadding::Explicit([0, 0]), dilation: [1, 1], groups: 1, output_padding: [0, 0] }
    }
}

impl Conv2dArgs {
    /// With this stride.
    pub fn stride(mut self, s: impl Into<Pair>) -> Self {
        self.stride = s.into().0;
        self
    }
    /// With this symmetric zero padding.
    pub fn padding(mut self, p: impl Into<Pair>) -> Self {
        self.padding = ConvPadding::Explicit(p.into().0);
        self
    }
    /// With PyTorch's `padding="same"`.
    pub fn same(mut self) -> Self {
        self.padding = ConvPadding::Same;
        self
    }
    /// With this dilation.
    pub fn dilation(mut self, d: impl Into<Pair>) -> Self {
        self.dilation = d.into().0;
        self
    }
    /// With this many groups.
    pub fn groups(mut self, g: usize) -> Self {
        self.groups = g;
        self
    }
    /// With this output padding (transposed convolution only).
    pub fn output_padding(mut self, p: impl Into<Pair>) -> Self {
        self.output_padding = p.into().0;
        self
    }
}

// ---- the kernels ------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConvKind {
    /// inputs [x, w, (bias)] -> y.
    Forward { bias: bool },
    /// inputs [w, dy] -> dx.
    BackwardInput,
    /// inputs [x, dy] -> dw.
    BackwardWeight,
}

/// One convolution kernel over its geometry. The geometry, not the
/// convolution's arguments: a transposed convolution's input (the
/// geometry's output) may have fewer rows and columns than the windows of
/// the convolution it transposes, when output_padding ≥ stride.
#[derive(Clone, Copy, Debug)]
struct ConvOp {
    g: ConvGeom,
    kind: ConvKind,
}

impl ConvOp {
    /// The elements of the kernel's output and of each input, in order.
    fn extents(&self) -> (usize, [usize; 3]) {
        let g = &self.g;
        match self.kind {
            ConvKind::Forward { .. } => (g.output_len(), [g.input_len(), g.weight_len(), g.c_out()]),
            ConvKind::BackwardInput => (g.input_len(), [g.weight_len(), g.output_len(), 0]),
            ConvKind::BackwardWeight => (g.weight_len(), [g.input_len(), g.output_len(), 0]),
        }
    }
}

impl HostNnKernel for ConvOp {
    fn run<T: HostFloat>(&self, ins: &[&[T]], out: &mut [T], threads: usize) -> Result<()> {
        let g = &self.g;
        match self.kind {
            ConvKind::Forward { bias } => host_nn::geom_forward(g, ins[0], ins[1], bias.then(|| ins[2]), out, threads)?,
            ConvKind::BackwardInput => host_nn::geom_backward_input(g, ins[0], ins[1], out, threads)?,
            ConvKind::BackwardWeight => host_nn::geom_backward_weight(g, ins[0], ins[1], out, threads)?,
        }
        Ok(())
    }
}

crate::kernel_args! {
    /// A direct convolution kernel's argument (NCHW input x, OIHW weight,
    /// NCHW output y; `icg`/`ocg` channels per group).
    ConvArgs {
        x: u64, wt: u64, b: u64, y: u64, has_bias: u64,
        n: u64, groups: u64, icg: u64, ocg: u64, h: u64, iw: u64, oh: u64, ow: u64,
        kh: u64, kw: u64, sh: u64, sw: u64, dh: u64, dw: u64, pt: i64, pl: i64
    }
}

impl CustomKernel for ConvOp {
    fn name(&self) -> &'static str {
        match self.kind {
            ConvKind::Forward { .. } => "conv2d",
            ConvKind::BackwardInput | ConvKind::BackwardWeight => "conv2d_backward",
        }
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        host_dispatch(self, self.name(), inputs, out, threads)
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let g = &self.g;
        // The kernels index every operand by the geometry: check each
        // allocation holds what the geometry reaches before launching.
        let (count, needs) = self.extents();
        check_extents(self.name(), inputs, &needs[..inputs.len()], out, count)?;
        let (x, wt, b, y, has_bias, name) = match self.kind {
            ConvKind::Forward { bias } => {
                let b = if bias { dptr(dev, &inputs[2])? } else { 0 };
                (dptr(dev, &inputs[0])?, dptr(dev, &inputs[1])?, b, dev.ptr(out)?, bias as u64, "conv2d_fwd")
            }
            ConvKind::BackwardInput => (dev.ptr(out)?, dptr(dev, &inputs[0])?, 0, dptr(dev, &inputs[1])?, 0, "conv2d_bwd_input"),
            ConvKind::BackwardWeight => (dptr(dev, &inputs[0])?, dev.ptr(out)?, 0, dptr(dev, &inputs[1])?, 0, "conv2d_bwd_weight"),
        };
        let args = ConvArgs {
            x,
            wt,
            b,
            y,
            has_bias,
            n: g.n as u64,
            groups: g.groups as u64,
            icg: g.icg as u64,
            ocg: g.ocg as u64,
            h: g.h as u64,
            iw: g.w as u64,
            oh: g.oh as u64,
            ow: g.ow as u64,
            kh: g.kh as u64,
            kw: g.kw as u64,
            sh: g.sh as u64,
            sw: g.sw as u64,
            dh: g.dh as u64,
            dw: g.dw as u64,
            pt: g.pt as i64,
            pl: g.pl as i64,
        };
        if count == 0 {
            return Ok(());
        }
        let empty = [g.n, g.k_len(), g.out_plane(), g.ocg, g.in_plane()].contains(&0);
        let path = conv_path();
        // An empty convolution (no images, channels, taps or outputs) writes
        // only zeros or the bias: the direct kernel does that on every path.
        let ran = if empty {
            false
        } else {
            match path {
                ConvPath::Dnn => match self.through_dnn(dev, &args, out)? {
                    Offload::Ran => true,
                    Offload::Declined(why) => {
                        return Err(dev.err(format!(
                            "{}: KILN_CUDA_CONV=cudnn asks for cuDNN, which cannot run it ({why}); \
                         unset KILN_CUDA_CONV to let kiln choose, or set it to gemm or direct",
                            self.name()
                        )));
                    }
                },
                ConvPath::Auto => {
                    self.through_dnn(dev, &args, out)? == Offload::Ran
                        || (gemm::fits(g)
                            && gemm::preferred(g, out.dtype.size_in_bytes())
                            && dev.has_gemm()?
                            && gemm::run(g, self.kind, dev, inputs, out)?)
                }
                ConvPath::Gemm => {
                    if !gemm::fits(g) {
                        false
                    } else if !dev.has_gemm()? {
                        return Err(dev.err(format!(
                            "{}: KILN_CUDA_CONV=gemm asks for im2col + cuBLAS, but cuBLAS does not load here; \
                         unset it (or set KILN_CUDA_CONV=direct) to use kiln's direct kernels",
                            self.name()
                        )));
                    } else if gemm::run(g, self.kind, dev, inputs, out)? {
                        true
                    } else {
                        return Err(dev.err(format!(
                        "{}: KILN_CUDA_CONV=gemm, but the device has no room for one image's im2col workspace ({} input channels × {}×{} kernel × {}×{} outputs); \
                         free memory or unset KILN_CUDA_CONV (the direct kernels need no workspace)",
                        self.name(),
                        g.c_in(),
                        g.kh,
                        g.kw,
                        g.oh,
                        g.ow
                    )));
                    }
                }
                ConvPath::Direct => false,
            }
        };
        if ran {
            return Ok(());
        }
        let name = format!("{name}_{}", dtype_tag(out.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(count), BLOCK, &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

impl ConvOp {
    /// Offers the convolution to cuDNN (through `dev`), adding the bias
    /// after it when cuDNN ran the forward.
    fn through_dnn(&self, dev: &dyn CudaDevice, a: &ConvArgs, out: &Storage) -> Result<Offload> {
        let direction = match self.kind {
            ConvKind::Forward { .. } => DnnDirection::Forward,
            ConvKind::BackwardInput => DnnDirection::BackwardData,
            ConvKind::BackwardWeight => DnnDirection::BackwardFilter,
        };
        let g = &self.g;
        let dims = ConvDims {
            n: g.n,
            c_in: g.c_in(),
            h: g.h,
            w: g.w,
            c_out: g.c_out(),
            oh: g.oh,
            ow: g.ow,
            kh: g.kh,
            kw: g.kw,
            stride: (g.sh, g.sw),
            dilation: (g.dh, g.dw),
            groups: g.groups,
            pad: (g.pt, g.pl),
        };
        let call = DnnConvCall { direction, dtype: out.dtype, dims, x: a.x, w: a.wt, y: a.y };
        let done = dev.conv_dnn(&call)?;
        if done == Offload::Ran && a.has_bias != 0 {
            gemm::add_bias(&self.g, dev, out.dtype, a.y, a.b)?;
        }
        Ok(done)
    }
}

static MODULE: CudaModule = CudaModule::generated("conv2d", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(ConvArgs::C_DECL);
    s.push_str(
        r#"
// y[n, oc, oy, ox] = bias[oc] + sum over the group's input channels and the
// kernel of x[n, ic, oy*sh - pt + ky*dh, ox*sw - pl + kx*dw] * w[oc, icl, ky, kx].
template <typename T> __device__ void conv2d_fwd_impl(const ConvArgs& p) {
    const T* x = (const T*)p.x;
    const T* w = (const T*)p.wt;
    const T* b = (const T*)p.b;
    T* y = (T*)p.y;
    u64 oc_all = p.groups * p.ocg, c_all = p.groups * p.icg;
    GRID_LOOP(t, p.n * oc_all * p.oh * p.ow) {
        u64 ox = t % p.ow;
        u64 oy = (t / p.ow) % p.oh;
        u64 oc = (t / (p.ow * p.oh)) % oc_all;
        u64 n = t / (p.ow * p.oh * oc_all);
        u64 g = oc / p.ocg;
        double acc = p.has_bias ? Cv<T>::to(b[oc]) : 0.0;
        for (u64 icl = 0; icl < p.icg; ++icl) {
            const T* xp = x + (n * c_all + g * p.icg + icl) * p.h * p.iw;
            const T* wp = w + (oc * p.icg + icl) * p.kh * p.kw;
            for (u64 ky = 0; ky < p.kh; ++ky) {
                i64 iy = (i64)(oy * p.sh) - p.pt + (i64)(ky * p.dh);
                if (iy < 0 || iy >= (i64)p.h) continue;
                for (u64 kx = 0; kx < p.kw; ++kx) {
                    i64 ix = (i64)(ox * p.sw) - p.pl + (i64)(kx * p.dw);
                    if (ix < 0 || ix >= (i64)p.iw) continue;
                    acc += Cv<T>::to(xp[iy * p.iw + ix]) * Cv<T>::to(wp[ky * p.kw + kx]);
                }
            }
        }
        y[t] = Cv<T>::from(acc);
    }
}

// dx[n, c, iy, ix] = sum over the group's output channels and the kernel
// positions that reach (iy, ix) of dy[n, oc, oy, ox] * w[oc, icl, ky, kx].
template <typename T> __device__ void conv2d_bwd_input_impl(const ConvArgs& p) {
    T* dx = (T*)p.x;
    const T* w = (const T*)p.wt;
    const T* dy = (const T*)p.y;
    u64 oc_all = p.groups * p.ocg, c_all = p.groups * p.icg;
    GRID_LOOP(t, p.n * c_all * p.h * p.iw) {
        u64 ix = t % p.iw;
        u64 iy = (t / p.iw) % p.h;
        u64 c = (t / (p.iw * p.h)) % c_all;
        u64 n = t / (p.iw * p.h * c_all);
        u64 g = c / p.icg, icl = c % p.icg;
        double acc = 0.0;
        for (u64 ocl = 0; ocl < p.ocg; ++ocl) {
            u64 oc = g * p.ocg + ocl;
            const T* dyp = dy + (n * oc_all + oc) * p.oh * p.ow;
            const T* wp = w + (oc * p.icg + icl) * p.kh * p.kw;
            for (u64 ky = 0; ky < p.kh; ++ky) {
                i64 ty = (i64)iy + p.pt - (i64)(ky * p.dh);
                if (ty < 0 || ty % (i64)p.sh != 0) continue;
                u64 oy = (u64)ty / p.sh;
                if (oy >= p.oh) continue;
                for (u64 kx = 0; kx < p.kw; ++kx) {
                    i64 tx = (i64)ix + p.pl - (i64)(kx * p.dw);
                    if (tx < 0 || tx % (i64)p.sw != 0) continue;
                    u64 ox = (u64)tx / p.sw;
                    if (ox >= p.ow) continue;
                    acc += Cv<T>::to(dyp[oy * p.ow + ox]) * Cv<T>::to(wp[ky * p.kw + kx]);
                }
            }
        }
        dx[t] = Cv<T>::from(acc);
    }
}

// dw[oc, icl, ky, kx] = sum over the batch and the output positions of
// dy[n, oc, oy, ox] * x[n, ic, oy*sh - pt + ky*dh, ox*sw - pl + kx*dw].
template <typename T> __device__ void conv2d_bwd_weight_impl(const ConvArgs& p) {
    const T* x = (const T*)p.x;
    T* dw = (T*)p.wt;
    const T* dy = (const T*)p.y;
    u64 oc_all = p.groups * p.ocg, c_all = p.groups * p.icg;
    GRID_LOOP(t, oc_all * p.icg * p.kh * p.kw) {
        u64 kx = t % p.kw;
        u64 ky = (t / p.kw) % p.kh;
        u64 icl = (t / (p.kw * p.kh)) % p.icg;
        u64 oc = t / (p.kw * p.kh * p.icg);
        u64 c = (oc / p.ocg) * p.icg + icl;
        double acc = 0.0;
        for (u64 n = 0; n < p.n; ++n) {
            const T* xp = x + (n * c_all + c) * p.h * p.iw;
            const T* dyp = dy + (n * oc_all + oc) * p.oh * p.ow;
            for (u64 oy = 0; oy < p.oh; ++oy) {
                i64 iy = (i64)(oy * p.sh) - p.pt + (i64)(ky * p.dh);
                if (iy < 0 || iy >= (i64)p.h) continue;
                for (u64 ox = 0; ox < p.ow; ++ox) {
                    i64 ix = (i64)(ox * p.sw) - p.pl + (i64)(kx * p.dw);
                    if (ix < 0 || ix >= (i64)p.iw) continue;
                    acc += Cv<T>::to(dyp[oy * p.ow + ox]) * Cv<T>::to(xp[iy * p.iw + ix]);
                }
            }
        }
        dw[t] = Cv<T>::from(acc);
    }
}
"#,
    );
    for k in ["conv2d_fwd", "conv2d_bwd_input", "conv2d_bwd_weight"] {
        instantiate(&mut s, k, "ConvArgs");
    }
    s
}

// ---- the front end ----------------------------------------------------------

/// Runs one convolution kernel into a new tensor of `dims`.
fn run_conv(g: ConvGeom, kind: ConvKind, inputs: &[&Tensor], dims: Vec<usize>) -> Result<Tensor> {
    let op = ConvOp { g, kind };
    let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: inputs.iter().map(|t| t.src()).collect() };
    inputs[0].run_new(kernel, inputs[0].dtype(), Shape::from(dims))
}

/// Checks the operands of a convolution: float dtypes, one device, 4-D
/// input and weight, a 1-D bias of `bias_len`.
fn check_operands(op: &str, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, bias_len: impl Fn(&Tensor) -> usize) -> Result<()> {
    check_float(op, "input", x)?;
    check_same_device(op, x, w)?;
    check_same_dtype(op, x, w)?;
    if x.rank() != 4 {
        return Err(Error::invalid(op, format!("input must be 3-D (C, H, W) or 4-D (N, C, H, W), got shape {}", x.shape())));
    }
    if w.rank() != 4 {
        return Err(Error::invalid(op, format!("weight must be 4-D, got shape {} (input {})", w.shape(), x.shape())));
    }
    if let Some(b) = bias {
        check_same_device(op, x, b)?;
        check_same_dtype(op, x, b)?;
        if b.dims() != [bias_len(w)] {
            return Err(Error::invalid(op, format!("bias must have shape [{}], got {} (weight {})", bias_len(w), b.shape(), w.shape())));
        }
    }
    Ok(())
}

/// A 3-D (unbatched) input as a batch of one, and back.
fn batched(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if x.rank() == 3 {
        f(&x.unsqueeze(0)?)?.squeeze(0)
    } else {
        f(x)
    }
}

impl Tensor {
    /// PyTorch's `F.conv2d(self, weight, bias, stride, padding, dilation,
    /// groups)`: `self` is `[N, C, H, W]` (or unbatched `[C, H, W]`), the
    /// weight `[out_channels, C / groups, kh, kw]`, the bias
    /// `[out_channels]`. f32 or f64, on every device, with gradients.
    ///
    /// ```
    /// use kiln::{Conv2dArgs, Tensor, cpu};
    /// let x = Tensor::arange(0.0, 9.0, 1.0, &cpu())?.reshape((1, 1, 3, 3))?;
    /// let w = Tensor::ones((1, 1, 2, 2), kiln::DType::F32, &cpu())?;
    /// let y = x.conv2d(&w, None, Conv2dArgs::default())?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![8., 12., 20., 24.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn conv2d(&self, weight: &Tensor, bias: Option<&Tensor>, args: Conv2dArgs) -> Result<Tensor> {
        const OP: &str = "conv2d";
        batched(self, |x| {
            check_operands(OP, x, weight, bias, |w| w.dims()[0])?;
            let (xd, wd) = (x.dims(), weight.dims());
            let groups = args.groups;
            if groups > 0 && xd[1] != wd[1].saturating_mul(groups) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "input of shape {} has {} channels but weight of shape {} with groups={groups} expects {} (weight.dims[1] · groups)",
                        x.shape(),
                        xd[1],
                        weight.shape(),
                        wd[1].saturating_mul(groups)
                    ),
                ));
            }
            let kernel = [wd[2], wd[3]];
            let padding = match args.padding {
                ConvPadding::Explicit(p) => Padding2d::symmetric(p),
                ConvPadding::Valid => Padding2d::default(),
                ConvPadding::Same => {
                    if kernel.contains(&0) || args.dilation.contains(&0) {
                        Padding2d::default() // validate() names the bad argument
                    } else {
                        Padding2d::same(kernel, args.dilation, args.stride)?
                    }
                }
            };
            let p = Conv2dParams {
                batch: xd[0],
                in_channels: xd[1],
                out_channels: wd[0],
                input: [xd[2], xd[3]],
                kernel,
                stride: args.stride,
                padding,
                dilation: args.dilation,
                groups,
            };
            let out = p.validate().map_err(|e| with_shapes(e, x, weight))?;
            let (xc, wc) = (x.contiguous()?, weight.contiguous()?);
            let bc = bias.map(Tensor::contiguous).transpose()?;
            let mut ins = vec![&xc, &wc];
            ins.extend(bc.as_ref());
            let geom = p.geom(out);
            let y = run_conv(geom, ConvKind::Forward { bias: bias.is_some() }, &ins, out.to_vec())?;
            let mut rec: Vec<&Tensor> = vec![x, weight];
            rec.extend(bias);
            Ok(crate::autograd::record(y, &rec, false, || {
                Box::new(move |c| {
                    let g = c.g.contiguous()?;
                    let (x, w) = (&c.inputs[0], &c.inputs[1]);
                    let mut grads = smallvec::smallvec![
                        crate::ops::need(x, || run_conv(geom, ConvKind::BackwardInput, &[&w.contiguous()?, &g], p.input_shape().to_vec()))?,
                        crate::ops::need(w, || run_conv(
                            geom,
                            ConvKind::BackwardWeight,
                            &[&x.contiguous()?, &g],
                            p.weight_shape().to_vec()
                        ))?,
                    ];
                    if let Some(b) = c.inputs.get(2) {
                        grads.push(crate::ops::need(b, || g.sum_dims(&[0, 2, 3], false))?);
                    }
                    Ok(grads)
                })
            }))
        })
    }

    /// PyTorch's `F.conv_transpose2d(self, weight, bias, stride, padding,
    /// output_padding, groups, dilation)`: the weight is `[C, out_channels
    /// / groups, kh, kw]` for an input `[N, C, H, W]`; explicit padding only.
    ///
    /// ```
    /// use kiln::{Conv2dArgs, Tensor, cpu};
    /// let x = Tensor::from_vec(vec![1f32, 2., 3., 4.], (1, 1, 2, 2), &cpu())?;
    /// let w = Tensor::ones((1, 1, 2, 2), kiln::DType::F32, &cpu())?;
    /// let y = x.conv_transpose2d(&w, None, Conv2dArgs::default())?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![1., 3., 2., 4., 10., 6., 3., 7., 4.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn conv_transpose2d(&self, weight: &Tensor, bias: Option<&Tensor>, args: Conv2dArgs) -> Result<Tensor> {
        const OP: &str = "conv_transpose2d";
        batched(self, |x| {
            let groups = args.groups;
            check_operands(OP, x, weight, bias, |w| w.dims()[1].saturating_mul(groups))?;
            let (xd, wd) = (x.dims(), weight.dims());
            if xd[1] != wd[0] {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "input of shape {} has {} channels but weight of shape {} expects {} (weight.dims[0])",
                        x.shape(),
                        xd[1],
                        weight.shape(),
                        wd[0]
                    ),
                ));
            }
            let ConvPadding::Explicit(padding) = args.padding else {
                return Err(Error::invalid(OP, "padding must be explicit (PyTorch has no \"same\" for a transposed convolution)"));
            };
            let tp = ConvTranspose2dParams {
                batch: xd[0],
                in_channels: xd[1],
                out_channels: wd[1].saturating_mul(groups),
                input: [xd[2], xd[3]],
                kernel: [wd[2], wd[3]],
                stride: args.stride,
                padding,
                output_padding: args.output_padding,
                dilation: args.dilation,
                groups,
            };
            let out = tp.validate().map_err(|e| with_shapes(e, x, weight))?;
            // The convolution this one transposes: its input is our output,
            // and its output (our input) may be smaller than its window count.
            let p = tp.geom(out);
            let (xc, wc) = (x.contiguous()?, weight.contiguous()?);
            let y = run_conv(p, ConvKind::BackwardInput, &[&wc, &xc], out.to_vec())?;
            let y = crate::autograd::record(y, &[x, weight], false, || {
                Box::new(move |c| {
                    let g = c.g.contiguous()?;
                    let (x, w) = (&c.inputs[0], &c.inputs[1]);
                    Ok(smallvec::smallvec![
                        crate::ops::need(x, || run_conv(p, ConvKind::Forward { bias: false }, &[&g, &w.contiguous()?], x.dims().to_vec()))?,
                        crate::ops::need(w, || run_conv(p, ConvKind::BackwardWeight, &[&g, &x.contiguous()?], w.dims().to_vec()))?,
                    ])
                })
            });
            match bias {
                Some(b) => y.add(&b.reshape((1, out[1], 1, 1))?),
                None => Ok(y),
            }
        })
    }
}

/// A host_nn error with the operands' shapes added.
fn with_shapes(e: host_nn::NnError, x: &Tensor, w: &Tensor) -> Error {
    match Error::from(e) {
        Error::InvalidArgument { op, msg } => {
            Error::InvalidArgument { op, msg: format!("{msg} (input {}, weight {})", x.shape(), w.shape()) }
        }
        other => other,
    }
}
