//! The CUDA convolution through cuBLAS: the input unfolded (im2col) into a
//! workspace and multiplied by the weight in strided-batched gemm, as
//! PyTorch's and candle's non-cuDNN paths do, so that the multiply-adds run
//! in cuBLAS and every kernel of kiln's own gives each thread a bounded
//! amount of work (at most kh·kw terms).
//!
//! With `R = icg·kh·kw` rows of a group's unfolded input and `P = oh·ow`
//! output positions, for a chunk of `nb` images:
//! - forward: `Y[i, g] (ocg × P) = W[g] (ocg × R) · col[i, g] (R × P)`,
//!   batched over the images, one call per group; bias added after;
//! - input gradient: `dcol[i, g] = W[g]ᵀ · dY[i, g]`, then col2im (one
//!   thread per input element, summing the kh·kw columns that read it: no
//!   atomics, the same order every run);
//! - weight gradient: `dW[g] (ocg × R) += dYᵗ[g] (ocg × nb·P) · colᵗ[g]ᵀ`,
//!   where `dYᵗ` and `colᵗ` put the chunk's images side by side along the
//!   reduction (the batch is summed inside cuBLAS), batched over groups,
//!   accumulating over chunks.
//!
//! A 1×1 convolution with stride 1 and no padding needs no unfolding: its
//! input is already `col` (forward) and `dcol` is the input gradient.
//! Images are taken in chunks whose workspace stays under
//! [`WORKSPACE_BYTES`] (at least one image), allocated from the device's
//! caching allocator and booked in its ledger while the call runs; when the
//! device has no room the chunk is halved, down to one image, and without
//! room for one the direct kernels run instead. cuBLAS sums f32 in f32 (the
//! direct kernels sum in f64), as PyTorch's cuDNN and cuBLAS paths do;
//! `KILN_CUDA_TF32=1` lets it use TF32 here as in matmul.

use super::{dptr, instantiate, ConvKind};
use crate::base::error::{Error, Result};
use crate::host_nn::ConvGeom;
use crate::kernel::cuda::{dtype_tag, CudaDevice, CudaModule, GemmCall, TempBuffer, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::Src;

/// The most workspace one convolution call holds (one image's worth when a
/// single image needs more).
pub(crate) const WORKSPACE_BYTES: usize = crate::kernel::cuda::CONV_WORKSPACE_BYTES;

crate::kernel_args! {
    /// im2col / col2im over a chunk of `n` images: `img` is NCHW, `col`
    /// holds element (i, r, p) at `i·s_img + r·s_row + p`.
    UnfoldArgs {
        img: u64, col: u64, n: u64, c: u64, h: u64, w: u64, oh: u64, ow: u64,
        kh: u64, kw: u64, sh: u64, sw: u64, dh: u64, dw: u64, pt: i64, pl: i64,
        s_img: u64, s_row: u64
    }
}

crate::kernel_args! {
    /// Moves `src` (n, c, p) to `dst` (c, n, p), adding `bias[c]` when
    /// `has_bias` (the other direction when `back`).
    PlaneArgs { src: u64, dst: u64, bias: u64, has_bias: u64, n: u64, c: u64, p: u64 }
}

static MODULE: CudaModule = CudaModule::generated("conv2d_gemm", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(UnfoldArgs::C_DECL);
    s.push_str(PlaneArgs::C_DECL);
    s.push_str(
        r#"
// col[i, (ci·kh + ky)·kw + kx, oy·ow + ox] = x[i, ci, oy·sh − pt + ky·dh, ox·sw − pl + kx·dw] (0 outside).
template <typename T> __device__ void conv_im2col_impl(const UnfoldArgs& p) {
    const T* x = (const T*)p.img;
    T* col = (T*)p.col;
    u64 P = p.oh * p.ow, K = p.kh * p.kw, R = p.c * K;
    GRID_LOOP(t, p.n * R * P) {
        u64 q = t % P, r = (t / P) % R, i = t / (P * R);
        u64 kx = r % p.kw, ky = (r / p.kw) % p.kh, ci = r / K;
        i64 iy = (i64)((q / p.ow) * p.sh) - p.pt + (i64)(ky * p.dh);
        i64 ix = (i64)((q % p.ow) * p.sw) - p.pl + (i64)(kx * p.dw);
        T v = Cv<T>::from(0.0);
        if (iy >= 0 && iy < (i64)p.h && ix >= 0 && ix < (i64)p.w) v = x[((i * p.c + ci) * p.h + (u64)iy) * p.w + (u64)ix];
        col[i * p.s_img + r * p.s_row + q] = v;
    }
}

// dx[i, ci, y, x] = the sum of the kh·kw columns of dcol that read (y, x).
template <typename T> __device__ void conv_col2im_impl(const UnfoldArgs& p) {
    T* dx = (T*)p.img;
    const T* col = (const T*)p.col;
    GRID_LOOP(t, p.n * p.c * p.h * p.w) {
        u64 x = t % p.w, y = (t / p.w) % p.h, ci = (t / (p.w * p.h)) % p.c, i = t / (p.w * p.h * p.c);
        double acc = 0.0;
        for (u64 ky = 0; ky < p.kh; ++ky) {
            i64 ty = (i64)y + p.pt - (i64)(ky * p.dh);
            if (ty < 0 || ty % (i64)p.sh != 0) continue;
            u64 oy = (u64)ty / p.sh;
            if (oy >= p.oh) continue;
            for (u64 kx = 0; kx < p.kw; ++kx) {
                i64 tx = (i64)x + p.pl - (i64)(kx * p.dw);
                if (tx < 0 || tx % (i64)p.sw != 0) continue;
                u64 ox = (u64)tx / p.sw;
                if (ox >= p.ow) continue;
                u64 r = (ci * p.kh + ky) * p.kw + kx;
                acc += Cv<T>::to(col[i * p.s_img + r * p.s_row + oy * p.ow + ox]);
            }
        }
        dx[t] = Cv<T>::from(acc);
    }
}

// dst[ci, i, q] = src[i, ci, q]: a chunk's images side by side per channel.
template <typename T> __device__ void conv_planes_by_channel_impl(const PlaneArgs& p) {
    const T* src = (const T*)p.src;
    T* dst = (T*)p.dst;
    GRID_LOOP(t, p.n * p.c * p.p) {
        u64 q = t % p.p, ci = (t / p.p) % p.c, i = t / (p.p * p.c);
        dst[(ci * p.n + i) * p.p + q] = src[t];
    }
}

// y[i, c, q] += bias[c].
template <typename T> __device__ void conv_add_bias_impl(const PlaneArgs& p) {
    const T* b = (const T*)p.bias;
    T* y = (T*)p.dst;
    GRID_LOOP(t, p.n * p.c * p.p) {
        y[t] = Cv<T>::from(Cv<T>::to(y[t]) + Cv<T>::to(b[(t / p.p) % p.c]));
    }
}
"#,
    );
    for k in ["conv_im2col", "conv_col2im"] {
        instantiate(&mut s, k, "UnfoldArgs");
    }
    for k in ["conv_planes_by_channel", "conv_add_bias"] {
        instantiate(&mut s, k, "PlaneArgs");
    }
    s
}

/// Whether every size cuBLAS is given fits its 32-bit arguments.
pub(super) fn fits(g: &ConvGeom) -> bool {
    let i32_max = i32::MAX as usize;
    let rows = g.k_len();
    let p = g.out_plane();
    // The weight gradient's reduction spans a chunk's images: at most n·P.
    [rows, p, g.ocg, g.icg, g.n.saturating_mul(p), g.c_out().saturating_mul(p), g.groups].iter().all(|&v| v <= i32_max)
}

/// Whether the input is its own unfolding (1×1, stride 1, no padding).
fn pointwise(g: &ConvGeom) -> bool {
    g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.pt == 0 && g.pl == 0 && g.oh == g.h && g.ow == g.w
}

/// Whether im2col + cuBLAS is the better path for `g` when nothing forces
/// one: not for a depthwise convolution (one input channel a group: a gemm
/// per group of a single row), nor when one image's unfolded input exceeds
/// [`WORKSPACE_BYTES`] (a large kernel over a large image, where the direct
/// kernels need no workspace at all).
pub(super) fn preferred(g: &ConvGeom, elem_size: usize) -> bool {
    let depthwise = g.groups > 1 && g.icg == 1;
    let per_image = g.c_in().saturating_mul(g.taps()).saturating_mul(g.out_plane()).saturating_mul(elem_size);
    !depthwise && (pointwise(g) || per_image <= WORKSPACE_BYTES)
}

/// A workspace of `per_image` bytes for each of as many of `n` images as
/// fit: the chunk under [`WORKSPACE_BYTES`], halved while the device has no
/// room for it. None when not even one image's worth can be had.
fn workspace<'d>(dev: &'d dyn CudaDevice, n: usize, per_image: usize) -> Result<Option<(Box<dyn TempBuffer + 'd>, usize)>> {
    let mut nb = chunk(n, per_image);
    loop {
        match dev.temp(nb * per_image) {
            Ok(ws) => return Ok(Some((ws, nb))),
            Err(Error::OutOfMemory { .. }) if nb > 1 => nb /= 2,
            Err(Error::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
}

/// Images per chunk for `per_image` workspace bytes each.
fn chunk(n: usize, per_image: usize) -> usize {
    if per_image == 0 {
        return n.max(1);
    }
    (WORKSPACE_BYTES / per_image).clamp(1, n.max(1))
}

/// y[i, c, q] += bias[c] over a convolution's output (after a library
/// computed it without the bias).
pub(super) fn add_bias(g: &ConvGeom, dev: &dyn CudaDevice, dt: crate::base::dtype::DType, y: u64, bias: u64) -> Result<()> {
    let (c, p) = (g.c_out(), g.out_plane());
    let args = PlaneArgs { src: 0, dst: y, bias, has_bias: 1, n: g.n as u64, c: c as u64, p: p as u64 };
    dev.launch(&MODULE, &format!("conv_add_bias_{}", dtype_tag(dt)), dev.grid_for(g.n * c * p), BLOCK, &args)
}

/// The operands as device addresses, by role.
struct Ptrs {
    x: u64,
    w: u64,
    y: u64,
    bias: Option<u64>,
}

/// Runs `kind` of the convolution `g` through im2col and cuBLAS.
/// `Ok(false)`: cuBLAS refused (missing) or the device had no room for one
/// image's workspace; the output is then written by the direct kernels.
pub(super) fn run(g: &ConvGeom, kind: ConvKind, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<bool> {
    let dt = out.dtype;
    let size = dt.size_in_bytes();
    let ptrs = match kind {
        ConvKind::Forward { bias } => Ptrs {
            x: dptr(dev, &inputs[0])?,
            w: dptr(dev, &inputs[1])?,
            y: dev.ptr(out)?,
            bias: if bias { Some(dptr(dev, &inputs[2])?) } else { None },
        },
        ConvKind::BackwardInput => Ptrs { x: dev.ptr(out)?, w: dptr(dev, &inputs[0])?, y: dptr(dev, &inputs[1])?, bias: None },
        ConvKind::BackwardWeight => Ptrs { x: dptr(dev, &inputs[0])?, w: dev.ptr(out)?, y: dptr(dev, &inputs[1])?, bias: None },
    };
    let (rows, p, c_in, c_out) = (g.k_len(), g.out_plane(), g.c_in(), g.c_out());
    let col_per_image = c_in * g.taps() * p * size;
    let unfold = |img: u64, col: u64, n: usize, s_img: usize, s_row: usize| UnfoldArgs {
        img,
        col,
        n: n as u64,
        c: c_in as u64,
        h: g.h as u64,
        w: g.w as u64,
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
        s_img: s_img as u64,
        s_row: s_row as u64,
    };
    let launch = |kernel: &str, count: usize, args: &dyn crate::kernel::cuda::KernelArgs| {
        dev.launch(&MODULE, &format!("{kernel}_{}", dtype_tag(dt)), dev.grid_for(count), BLOCK, args)
    };
    let at = |base: u64, elems: usize| base + (elems * size) as u64;
    let in_image = c_in * g.in_plane();
    let out_image = c_out * p;
    match kind {
        ConvKind::Forward { .. } | ConvKind::BackwardInput => {
            let forward = matches!(kind, ConvKind::Forward { .. });
            let (ws, nb) = if pointwise(g) {
                (None, g.n.max(1))
            } else {
                match workspace(dev, g.n, col_per_image)? {
                    Some((ws, nb)) => (Some(ws), nb),
                    None => return Ok(false),
                }
            };
            let col_image = c_in * g.taps() * p;
            for i0 in (0..g.n).step_by(nb) {
                let cnt = nb.min(g.n - i0);
                let x = at(ptrs.x, i0 * in_image);
                let y = at(ptrs.y, i0 * out_image);
                // The unfolded input of this chunk, and its image stride.
                let (col, s_col) = match &ws {
                    None => (x, in_image),
                    Some(ws) => (ws.ptr(), col_image),
                };
                if forward && ws.is_some() {
                    launch("conv_im2col", cnt * col_image, &unfold(x, col, cnt, col_image, p))?;
                }
                for gi in 0..g.groups {
                    let w = at(ptrs.w, gi * g.ocg * rows);
                    let col_g = at(col, gi * rows * p);
                    let y_g = at(y, gi * g.ocg * p);
                    let call = if forward {
                        // Y[i, g] = W[g] · col[i, g].
                        GemmCall {
                            dtype: dt,
                            a: w,
                            b: col_g,
                            c: y_g,
                            m: g.ocg,
                            n: p,
                            k: rows,
                            a_form: (false, rows),
                            b_form: (false, p),
                            stride_a: 0,
                            stride_b: s_col,
                            ldc: p,
                            stride_c: out_image,
                            accumulate: false,
                            count: cnt,
                        }
                    } else {
                        // dcol[i, g] = W[g]ᵀ · dY[i, g].
                        GemmCall {
                            dtype: dt,
                            a: w,
                            b: y_g,
                            c: col_g,
                            m: rows,
                            n: p,
                            k: g.ocg,
                            a_form: (true, rows),
                            b_form: (false, p),
                            stride_a: 0,
                            stride_b: out_image,
                            ldc: p,
                            stride_c: s_col,
                            accumulate: false,
                            count: cnt,
                        }
                    };
                    if !dev.gemm(&call)? {
                        return Ok(false);
                    }
                }
                if !forward && ws.is_some() {
                    launch("conv_col2im", cnt * in_image, &unfold(x, col, cnt, col_image, p))?;
                }
            }
            if let Some(b) = ptrs.bias {
                add_bias(g, dev, dt, ptrs.y, b)?;
            }
        }
        ConvKind::BackwardWeight => {
            // colᵗ (c_in·kh·kw rows × nb·P) and dYᵗ (c_out × nb·P).
            let per_image = col_per_image + out_image * size;
            let Some((ws, nb)) = workspace(dev, g.n, per_image)? else { return Ok(false) };
            let col_t = ws.ptr();
            let dy_t = at(col_t, nb * c_in * g.taps() * p);
            for i0 in (0..g.n).step_by(nb) {
                let cnt = nb.min(g.n - i0);
                let span = cnt * p;
                let x = at(ptrs.x, i0 * in_image);
                launch("conv_im2col", cnt * c_in * g.taps() * p, &unfold(x, col_t, cnt, p, span))?;
                let planes = PlaneArgs {
                    src: at(ptrs.y, i0 * out_image),
                    dst: dy_t,
                    bias: 0,
                    has_bias: 0,
                    n: cnt as u64,
                    c: c_out as u64,
                    p: p as u64,
                };
                launch("conv_planes_by_channel", cnt * out_image, &planes)?;
                // dW[g] (+)= dYᵗ[g] · colᵗ[g]ᵀ, batched over the groups.
                let call = GemmCall {
                    dtype: dt,
                    a: dy_t,
                    b: col_t,
                    c: ptrs.w,
                    m: g.ocg,
                    n: rows,
                    k: span,
                    a_form: (false, span),
                    b_form: (true, span),
                    stride_a: g.ocg * span,
                    stride_b: rows * span,
                    ldc: rows,
                    stride_c: g.ocg * rows,
                    accumulate: i0 > 0,
                    count: g.groups,
                };
                if !dev.gemm(&call)? {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}
