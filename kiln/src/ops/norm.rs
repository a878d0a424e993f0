//! Batch normalisation (PyTorch's `F.batch_norm`: training with batch
//! statistics and the running statistics updated in place, evaluation with
//! the running statistics) and layer normalisation (`F.layer_norm`), with
//! gradients. Kernels: batch statistics, the normalisation itself, and the
//! input gradient; the weight and bias gradients are sums of tensors.
//! Host kernels call [`crate::host_nn`]. On CUDA, batch statistics and
//! the input gradient are block reductions of each channel (a workspace of
//! per-block partial sums in f64, folded per channel in a fixed order),
//! layer norm runs a block per row: no thread's loop grows with the batch.

use super::conv::{check_extents, check_float, dptr, host_dispatch, instantiate, HostFloat, HostNnKernel};
use crate::base::buffer::CpuBuffer;
use crate::base::error::{Error, Result};
use crate::base::shape::Shape;
use crate::host_nn::{self, BatchNormParams, LayerNormParams};
use crate::kernel::cuda::{dtype_tag, grid_for_blocks, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::runtime::memory::try_vec;
use crate::tensor::{check_same_device, check_same_dtype};
use crate::Tensor;
use std::sync::Arc;

#[derive(Clone, Copy, Debug)]
enum NormOp {
    /// [x] -> [3, C]: the batch mean, invstd = 1/√(var + eps) and biased var.
    BnStats(BatchNormParams),
    /// [x, stats ([≥2, C]: mean, invstd), weight?, bias?] -> y.
    BnApply { p: BatchNormParams, weight: bool, bias: bool },
    /// [x, dy, stats, weight?] -> dx (`training`: through the batch statistics).
    BnBackInput { p: BatchNormParams, training: bool, weight: bool },
    /// [x, weight?, bias?] -> y.
    LnForward { p: LayerNormParams, weight: bool, bias: bool },
    /// [x, dy, weight?] -> dx.
    LnBackInput { p: LayerNormParams, weight: bool },
}

fn bn_stats<T: HostFloat>(p: &BatchNormParams, x: &[T], out: &mut [T]) {
    let (c_all, count) = (p.channels, p.count());
    for c in 0..c_all {
        let runs = || (0..p.batch).flat_map(move |n| &x[(n * c_all + c) * p.spatial..][..p.spatial]);
        let mean = runs().map(|v| v.to_f64()).sum::<f64>() / count as f64;
        let var = runs().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / count as f64;
        out[c] = T::from_f64(mean);
        out[c_all + c] = T::from_f64(1.0 / (var + p.eps).sqrt());
        out[2 * c_all + c] = T::from_f64(var);
    }
}

impl HostNnKernel for NormOp {
    fn run<T: HostFloat>(&self, ins: &[&[T]], out: &mut [T], threads: usize) -> Result<()> {
        match *self {
            NormOp::BnStats(p) => bn_stats(&p, ins[0], out),
            NormOp::BnApply { p, weight, bias } => {
                let c_all = p.channels;
                let (mean, inv) = (&ins[1][..c_all], &ins[1][c_all..2 * c_all]);
                let mut k = 2;
                let w = weight.then(|| {
                    k += 1;
                    ins[k - 1]
                });
                let b = bias.then(|| ins[k]);
                for c in 0..c_all {
                    let alpha = inv[c] * w.map_or(T::ONE, |w| w[c]);
                    let beta = b.map_or(T::ZERO, |b| b[c]) - mean[c] * alpha;
                    for n in 0..p.batch {
                        let at = (n * c_all + c) * p.spatial;
                        for (y, &x) in out[at..at + p.spatial].iter_mut().zip(&ins[0][at..at + p.spatial]) {
                            *y = x * alpha + beta;
                        }
                    }
                }
            }
            NormOp::BnBackInput { p, training, weight } => {
                let c_all = p.channels;
                let (mean, inv) = (&ins[2][..c_all], &ins[2][c_all..2 * c_all]);
                let w = weight.then(|| ins[3]);
                host_nn::batch_norm_backward(&p, ins[0], ins[1], w, mean, inv, training, Some(out), None, None, threads)?;
            }
            NormOp::LnForward { p, weight, bias } => {
                let (mut mean, mut rstd): (Vec<T>, Vec<T>) = (try_vec(p.rows)?, try_vec(p.rows)?);
                mean.resize(p.rows, T::ZERO);
                rstd.resize(p.rows, T::ZERO);
                let w = weight.then(|| ins[1]);
                let b = bias.then(|| ins[1 + weight as usize]);
                host_nn::layer_norm_forward(&p, ins[0], w, b, out, &mut mean, &mut rstd, threads)?;
            }
            NormOp::LnBackInput { p, weight } => {
                host_nn::layer_norm_backward(&p, ins[0], ins[1], weight.then(|| ins[2]), Some(out), None, None, threads)?;
            }
        }
        Ok(())
    }
}

crate::kernel_args! {
    /// A normalisation kernel's argument: x as [batch, channels, spatial]
    /// (layer norm: [rows, 1, features]), the statistics [≥2, channels],
    /// optional weight and bias (0 when absent).
    NormArgs {
        x: u64, dy: u64, stats: u64, w: u64, b: u64, out: u64,
        batch: u64, channels: u64, spatial: u64, training: u64, eps: f64
    }
}

crate::kernel_args! {
    /// A stage of batch norm's statistics or backward (`bn_partial`,
    /// `bn_finish`, `bn_back_apply`): `ws` is the workspace of partial sums,
    /// `parts` blocks per channel.
    NormStageArgs {
        x: u64, dy: u64, stats: u64, w: u64, out: u64, ws: u64,
        batch: u64, channels: u64, spatial: u64, parts: u64, stage: u64, eps: f64
    }
}

/// Elements one thread of `bn_partial` folds at most (until a channel has
/// more than `1024 · BLOCK · BN_PER_THREAD` elements).
const BN_PER_THREAD: usize = 16;

/// Batch norm's statistics (`backward = None`) or input gradient on CUDA:
/// the staged kernels above over a workspace of partial sums.
fn bn_cuda(dev: &dyn CudaDevice, a: &NormArgs, backward: Option<bool>, out_dtype: crate::DType) -> Result<()> {
    let (c, total) = (a.channels as usize, (a.batch * a.spatial) as usize);
    if c == 0 {
        return Ok(());
    }
    let parts = total.div_ceil(BLOCK as usize * BN_PER_THREAD).clamp(1, 1024);
    // Evaluation's backward reads no statistics of the batch: no workspace.
    let ws = if backward == Some(false) { None } else { Some(dev.temp((c * parts * 3 + c * 2) * 8)?) };
    let mut st = NormStageArgs {
        x: a.x,
        dy: a.dy,
        stats: a.stats,
        w: a.w,
        out: a.out,
        ws: ws.as_ref().map_or(0, |w| w.ptr()),
        batch: a.batch,
        channels: a.channels,
        spatial: a.spatial,
        parts: parts as u64,
        stage: 0,
        eps: a.eps,
    };
    let tag = dtype_tag(out_dtype);
    let partial_blocks = grid_for_blocks(c * parts);
    let finish_blocks = grid_for_blocks(c);
    let stage = |k: &str, stage: u64, grid: u32, st: &mut NormStageArgs| {
        st.stage = stage;
        dev.launch(&MODULE, &format!("{k}_{tag}"), grid, BLOCK, st)
    };
    match backward {
        None => {
            for s in [0, 1] {
                stage("bn_partial", s, partial_blocks, &mut st)?;
                stage("bn_finish", s, finish_blocks, &mut st)?;
            }
        }
        Some(true) => {
            stage("bn_load_mean", 2, dev.grid_for(c), &mut st)?;
            stage("bn_partial", 2, partial_blocks, &mut st)?;
            stage("bn_finish", 2, finish_blocks, &mut st)?;
            let n = total * c;
            stage("bn_back_apply", 2, dev.grid_for(n), &mut st)?;
        }
        Some(false) => {
            let n = total * c;
            stage("bn_back_apply", 0, dev.grid_for(n), &mut st)?;
        }
    }
    Ok(())
}

impl CustomKernel for NormOp {
    fn name(&self) -> &'static str {
        match self {
            NormOp::BnStats(_) | NormOp::BnApply { .. } => "batch_norm",
            NormOp::BnBackInput { .. } => "batch_norm_backward",
            NormOp::LnForward { .. } => "layer_norm",
            NormOp::LnBackInput { .. } => "layer_norm_backward",
        }
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        host_dispatch(self, self.name(), inputs, out, threads)
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let ptr = |i: usize| dptr(dev, &inputs[i]);
        let mut a = NormArgs {
            x: ptr(0)?,
            dy: 0,
            stats: 0,
            w: 0,
            b: 0,
            out: dev.ptr(out)?,
            batch: 0,
            channels: 0,
            spatial: 0,
            training: 0,
            eps: 0.0,
        };
        let bn = |a: &mut NormArgs, p: &BatchNormParams| {
            (a.batch, a.channels, a.spatial, a.eps) = (p.batch as u64, p.channels as u64, p.spatial as u64, p.eps);
        };
        let (kernel, count) = match *self {
            NormOp::BnStats(p) => {
                bn(&mut a, &p);
                ("bn_stats", p.channels)
            }
            NormOp::BnApply { p, weight, bias } => {
                bn(&mut a, &p);
                a.stats = ptr(1)?;
                let mut k = 2;
                if weight {
                    a.w = ptr(k)?;
                    k += 1;
                }
                if bias {
                    a.b = ptr(k)?;
                }
                ("bn_apply", out.len)
            }
            NormOp::BnBackInput { p, training, weight } => {
                bn(&mut a, &p);
                (a.dy, a.stats, a.training) = (ptr(1)?, ptr(2)?, training as u64);
                if weight {
                    a.w = ptr(3)?;
                }
                ("bn_back_input", p.channels)
            }
            NormOp::LnForward { p, weight, bias } => {
                (a.batch, a.channels, a.spatial, a.eps) = (p.rows as u64, 1, p.features as u64, p.eps);
                if weight {
                    a.w = ptr(1)?;
                }
                if bias {
                    a.b = ptr(1 + weight as usize)?;
                }
                ("ln_forward", p.rows)
            }
            NormOp::LnBackInput { p, weight } => {
                (a.batch, a.channels, a.spatial, a.eps) = (p.rows as u64, 1, p.features as u64, p.eps);
                a.dy = ptr(1)?;
                if weight {
                    a.w = ptr(2)?;
                }
                ("ln_back_input", p.rows)
            }
        };
        // Check every allocation against what the kernel reaches before
        // launching (the batch statistics read are the mean and invstd rows).
        let (bn_len, c) = ((a.batch * a.channels * a.spatial) as usize, a.channels as usize);
        let mut needs: smallvec::SmallVec<[usize; 4]> = smallvec::smallvec![bn_len];
        let out_len = match *self {
            NormOp::BnStats(_) => 3 * c,
            NormOp::BnApply { weight, bias, .. } => {
                needs.push(2 * c);
                needs.extend(std::iter::repeat_n(c, weight as usize + bias as usize));
                bn_len
            }
            NormOp::BnBackInput { weight, .. } => {
                needs.extend([bn_len, 2 * c]);
                needs.extend(std::iter::repeat_n(c, weight as usize));
                bn_len
            }
            NormOp::LnForward { weight, bias, .. } => {
                needs.extend(std::iter::repeat_n(a.spatial as usize, weight as usize + bias as usize));
                bn_len
            }
            NormOp::LnBackInput { weight, .. } => {
                needs.push(bn_len);
                needs.extend(std::iter::repeat_n(a.spatial as usize, weight as usize));
                bn_len
            }
        };
        check_extents(self.name(), inputs, &needs, out, out_len)?;
        match *self {
            NormOp::BnStats(_) => return bn_cuda(dev, &a, None, out.dtype),
            NormOp::BnBackInput { training, .. } => {
                if out_len == 0 {
                    return Ok(());
                }
                return bn_cuda(dev, &a, Some(training), out.dtype);
            }
            NormOp::BnApply { .. } | NormOp::LnForward { .. } | NormOp::LnBackInput { .. } => {}
        }
        let name = format!("{kernel}_{}", dtype_tag(out.dtype));
        let grid = match *self {
            // One block per row.
            NormOp::LnForward { .. } | NormOp::LnBackInput { .. } => grid_for_blocks(count),
            NormOp::BnStats(_) | NormOp::BnApply { .. } | NormOp::BnBackInput { .. } => dev.grid_for(count),
        };
        dev.launch(&MODULE, &name, grid, BLOCK, &a)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("norm", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(NormArgs::C_DECL);
    s.push_str(NormStageArgs::C_DECL);
    s.push_str(
        r#"
#define NORM_RUN(n, c) ((n) * p.channels + (c)) * p.spatial

// A block's sum of one value per thread (a fixed-order tree over the
// block's 256 slots of `sh`); every thread gets the total.
__device__ double block_sum(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    double total = sh[0];
    __syncthreads();
    return total;
}

// Batch statistics in two passes over each channel's N·S elements, each
// pass split into `parts` blocks of BLOCK threads (every thread folds at
// most a few dozen elements, whatever the batch) whose block sums go to a
// workspace of doubles, then folded per channel by one block in a fixed
// order. `stage`: 0 sums x; 1 sums (x − mean)²; 2 sums dy and dy·(x − mean).
// ws holds [channels][parts][3] partial sums, then [channels][2] per-channel
// results (mean and the rest) after them.
template <typename T> __device__ void bn_partial_impl(const NormStageArgs& p) {
    const T* x = (const T*)p.x;
    const T* dy = (const T*)p.dy;
    double* ws = (double*)p.ws;
    const double* chan = ws + p.channels * p.parts * 3;
    __shared__ double sh[256];
    u64 total = p.batch * p.spatial, chunk = (total + p.parts - 1) / p.parts;
    for (u64 b = blockIdx.x; b < p.channels * p.parts; b += gridDim.x) {
        u64 c = b / p.parts, q = b % p.parts;
        u64 lo = q * chunk, hi = lo + chunk < total ? lo + chunk : total;
        double mean = p.stage == 0 ? 0.0 : chan[2 * c];
        double a0 = 0.0, a1 = 0.0, a2 = 0.0;
        for (u64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
            u64 at = ((j / p.spatial) * p.channels + c) * p.spatial + j % p.spatial;
            double v = Cv<T>::to(x[at]);
            if (p.stage == 0) a0 += v;
            else if (p.stage == 1) a0 += (v - mean) * (v - mean);
            else {
                double g = Cv<T>::to(dy[at]);
                a0 += g;
                a1 += g * (v - mean);
                a2 += v;
            }
        }
        double t0 = block_sum(a0, sh), t1 = block_sum(a1, sh), t2 = block_sum(a2, sh);
        if (threadIdx.x == 0) {
            ws[b * 3] = t0;
            ws[b * 3 + 1] = t1;
            ws[b * 3 + 2] = t2;
        }
    }
}

// Folds each channel's parts (one block per channel, a tree in a fixed
// order) and finishes the stage: 0 the mean; 1 the statistics rows (mean,
// invstd, biased variance) of `out`; 2 the backward's mean(dy) and
// dot·invstd²/count.
template <typename T> __device__ void bn_finish_impl(const NormStageArgs& p) {
    double* ws = (double*)p.ws;
    double* chan = ws + p.channels * p.parts * 3;
    const T* st = (const T*)p.stats;
    T* out = (T*)p.out;
    __shared__ double sh[256];
    double count = (double)(p.batch * p.spatial);
    for (u64 c = blockIdx.x; c < p.channels; c += gridDim.x) {
        double a0 = 0.0, a1 = 0.0, a2 = 0.0;
        for (u64 q = threadIdx.x; q < p.parts; q += blockDim.x) {
            a0 += ws[(c * p.parts + q) * 3];
            a1 += ws[(c * p.parts + q) * 3 + 1];
            a2 += ws[(c * p.parts + q) * 3 + 2];
        }
        double t0 = block_sum(a0, sh), t1 = block_sum(a1, sh), t2 = block_sum(a2, sh);
        if (threadIdx.x == 0) {
            if (p.stage == 0) {
                chan[2 * c] = t0 / count;
            } else if (p.stage == 1) {
                double var = t0 / count;
                out[c] = Cv<T>::from(chan[2 * c]);
                out[p.channels + c] = Cv<T>::from(1.0 / ::sqrt(var + p.eps));
                out[2 * p.channels + c] = Cv<T>::from(var);
            } else {
                // The saved mean is the batch mean rounded to T; invstd
                // would amplify that rounding where a channel is nearly
                // constant: Σ dy·(x − mean) = Σ dy·(x − m) + (m − Σx/N)·Σ dy
                // (as the host kernel corrects it).
                double inv = Cv<T>::to(st[p.channels + c]);
                double dot = t1 + (count > 0.0 ? (Cv<T>::to(st[c]) - t2 / count) * t0 : 0.0);
                chan[2 * c] = t0 / count;
                chan[2 * c + 1] = dot * inv * inv / count;
            }
        }
    }
}

// Puts the saved mean of each channel where stage 2 reads it.
template <typename T> __device__ void bn_load_mean_impl(const NormStageArgs& p) {
    const T* st = (const T*)p.stats;
    double* chan = (double*)p.ws + p.channels * p.parts * 3;
    GRID_LOOP(c, p.channels) chan[2 * c] = Cv<T>::to(st[c]);
}

template <typename T> __device__ void bn_apply_impl(const NormArgs& p) {
    const T* x = (const T*)p.x;
    const T* st = (const T*)p.stats;
    const T* w = (const T*)p.w;
    const T* b = (const T*)p.b;
    T* y = (T*)p.out;
    GRID_LOOP(t, p.batch * p.channels * p.spatial) {
        u64 c = (t / p.spatial) % p.channels;
        T alpha = st[p.channels + c] * (p.w ? w[c] : Cv<T>::from(1.0));
        T beta = (p.b ? b[c] : Cv<T>::from(0.0)) - st[c] * alpha;
        y[t] = x[t] * alpha + beta;
    }
}

// dx = (dy − mean(dy) − (x − mean)·k)·scale in training (k and mean(dy)
// from bn_finish's stage 2 in ws), dy·scale in evaluation; one thread per
// element.
template <typename T> __device__ void bn_back_apply_impl(const NormStageArgs& p) {
    const T* x = (const T*)p.x;
    const T* dy = (const T*)p.dy;
    const T* st = (const T*)p.stats;
    const T* w = (const T*)p.w;
    const double* chan = (const double*)p.ws + p.channels * p.parts * 3;
    T* dx = (T*)p.out;
    GRID_LOOP(t, p.batch * p.channels * p.spatial) {
        u64 c = (t / p.spatial) % p.channels;
        double inv = Cv<T>::to(st[p.channels + c]);
        double scale = inv * (p.w ? Cv<T>::to(w[c]) : 1.0);
        double g = Cv<T>::to(dy[t]);
        if (p.stage == 2) {
            double mean = Cv<T>::to(st[c]);
            dx[t] = Cv<T>::from((g - chan[2 * c] - (Cv<T>::to(x[t]) - mean) * chan[2 * c + 1]) * scale);
        } else {
            dx[t] = Cv<T>::from(g * scale);
        }
    }
}

// A row's mean and 1/sqrt(var + eps), the row's features split over the
// block's threads.
template <typename T> __device__ void ln_row_stats(const T* x, u64 f, double eps, double* sh, double* mean, double* rstd) {
    double sum = 0.0, sq = 0.0;
    for (u64 i = threadIdx.x; i < f; i += blockDim.x) sum += Cv<T>::to(x[i]);
    *mean = block_sum(sum, sh) / (double)f;
    for (u64 i = threadIdx.x; i < f; i += blockDim.x) {
        double d = Cv<T>::to(x[i]) - *mean;
        sq += d * d;
    }
    *rstd = 1.0 / ::sqrt(block_sum(sq, sh) / (double)f + eps);
}

// One block per row.
template <typename T> __device__ void ln_forward_impl(const NormArgs& p) {
    const T* w = (const T*)p.w;
    const T* b = (const T*)p.b;
    __shared__ double sh[256];
    for (u64 r = blockIdx.x; r < p.batch; r += gridDim.x) {
        const T* x = (const T*)p.x + r * p.spatial;
        T* y = (T*)p.out + r * p.spatial;
        double mean, rstd;
        ln_row_stats(x, p.spatial, p.eps, sh, &mean, &rstd);
        for (u64 i = threadIdx.x; i < p.spatial; i += blockDim.x) {
            double v = (Cv<T>::to(x[i]) - mean) * rstd;
            y[i] = Cv<T>::from(v * (p.w ? Cv<T>::to(w[i]) : 1.0) + (p.b ? Cv<T>::to(b[i]) : 0.0));
        }
    }
}

// dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)), g = dy · w; one block per row.
template <typename T> __device__ void ln_back_input_impl(const NormArgs& p) {
    const T* w = (const T*)p.w;
    __shared__ double sh[256];
    for (u64 r = blockIdx.x; r < p.batch; r += gridDim.x) {
        const T* x = (const T*)p.x + r * p.spatial;
        const T* dy = (const T*)p.dy + r * p.spatial;
        T* dx = (T*)p.out + r * p.spatial;
        double mean, rstd, sg = 0.0, sgx = 0.0, f = (double)p.spatial;
        ln_row_stats(x, p.spatial, p.eps, sh, &mean, &rstd);
        for (u64 i = threadIdx.x; i < p.spatial; i += blockDim.x) {
            double g = Cv<T>::to(dy[i]) * (p.w ? Cv<T>::to(w[i]) : 1.0);
            sg += g;
            sgx += g * (Cv<T>::to(x[i]) - mean) * rstd;
        }
        sg = block_sum(sg, sh);
        sgx = block_sum(sgx, sh);
        for (u64 i = threadIdx.x; i < p.spatial; i += blockDim.x) {
            double g = Cv<T>::to(dy[i]) * (p.w ? Cv<T>::to(w[i]) : 1.0);
            double xh = (Cv<T>::to(x[i]) - mean) * rstd;
            dx[i] = Cv<T>::from(rstd * (g - sg / f - xh * sgx / f));
        }
    }
}
"#,
    );
    for k in ["bn_apply", "ln_forward", "ln_back_input"] {
        instantiate(&mut s, k, "NormArgs");
    }
    for k in ["bn_partial", "bn_finish", "bn_load_mean", "bn_back_apply"] {
        instantiate(&mut s, k, "NormStageArgs");
    }
    s
}

fn run_norm(op: NormOp, inputs: &[&Tensor], dims: &[usize]) -> Result<Tensor> {
    let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: inputs.iter().map(|t| t.src()).collect() };
    inputs[0].run_new(kernel, inputs[0].dtype(), Shape::from(dims.to_vec()))
}

/// Checks that `t`, if given, is on `x`'s device and dtype with shape `dims`.
fn check_param(op: &str, what: &str, x: &Tensor, t: Option<&Tensor>, dims: &[usize]) -> Result<()> {
    if let Some(t) = t {
        check_same_device(op, x, t)?;
        check_same_dtype(op, x, t)?;
        if t.dims() != dims {
            return Err(Error::invalid(op, format!("{what} must have shape {dims:?}, got {} (input {})", t.shape(), x.shape())));
        }
    }
    Ok(())
}

impl Tensor {
    /// PyTorch's `F.batch_norm(self, running_mean, running_var, weight,
    /// bias, training, momentum, eps)` over `[N, C]`, `[N, C, L]` or `[N, C,
    /// H, W]`, statistics per channel `C`.
    ///
    /// Training normalises by the batch mean and biased variance and, when
    /// the running statistics are given, updates them in place:
    /// `running = (1 − momentum)·running + momentum·batch`, with the
    /// unbiased batch variance; an empty batch leaves them as they were.
    /// Training refuses `eps = 0`, as PyTorch does. Evaluation (`training =
    /// false`) normalises by the running statistics, which it then requires.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32], [3.]], &cpu())?;
    /// let (rm, rv) = (Tensor::new(&[0f32], &cpu())?, Tensor::new(&[1f32], &cpu())?);
    /// let y = x.batch_norm(Some(&rm), Some(&rv), None, None, true, 0.1, 1e-5)?;
    /// let y = y.to_vec::<f32>()?;
    /// assert!((y[0] + 1.0).abs() < 1e-5 && (y[1] - 1.0).abs() < 1e-5);
    /// assert_eq!(rm.to_vec::<f32>()?, vec![0.2]);
    /// assert_eq!(rv.to_vec::<f32>()?, vec![0.9 + 0.1 * 2.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm(
        &self,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<Tensor> {
        const OP: &str = "batch_norm";
        check_float(OP, "input", self)?;
        if self.rank() < 2 {
            return Err(Error::invalid(OP, format!("input must have at least 2 dimensions (N, C, ...), got shape {}", self.shape())));
        }
        let dims = self.dims().to_vec();
        let c = dims[1];
        for (what, t) in [("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)] {
            check_param(OP, what, self, t, &[c])?;
        }
        if running_mean.is_some() != running_var.is_some() {
            return Err(Error::invalid(OP, "running_mean and running_var must be given together"));
        }
        let p = BatchNormParams { batch: dims[0], channels: c, spatial: dims[2..].iter().product(), eps };
        p.validate(training).map_err(|e| with_shape(e, self))?;
        let x = self.contiguous()?;
        let stats = if training {
            let stats = run_norm(NormOp::BnStats(p), &[&x], &[3, c])?;
            // An empty batch has no statistics (its mean and variance are
            // 0/0): the running ones stay as they were, as in PyTorch.
            if let (Some(rm), Some(rv), true) = (running_mean, running_var, p.count() > 0) {
                let _g = crate::no_grad();
                let count = p.count() as f64;
                let (mean, var) = (stats.narrow(0, 0, 1)?.reshape(c)?, stats.narrow(0, 2, 1)?.reshape(c)?);
                rm.assign(&((rm * (1.0 - momentum))? + (mean * momentum)?)?)?;
                rv.assign(&((rv * (1.0 - momentum))? + (var * (momentum * count / (count - 1.0)))?)?)?;
            }
            stats
        } else {
            let (Some(rm), Some(rv)) = (running_mean, running_var) else {
                return Err(Error::invalid(OP, "evaluation (training = false) needs running_mean and running_var"));
            };
            let _g = crate::no_grad();
            Tensor::stack(&[&rm.detach(), &(rv + eps)?.sqrt()?.recip()?], 0)?.contiguous()?
        };
        let mut ins = vec![&x, &stats];
        let (wc, bc) = (weight.map(Tensor::contiguous).transpose()?, bias.map(Tensor::contiguous).transpose()?);
        ins.extend(wc.as_ref());
        ins.extend(bc.as_ref());
        let y = run_norm(NormOp::BnApply { p, weight: weight.is_some(), bias: bias.is_some() }, &ins, &dims)?;
        let mut rec = vec![self];
        rec.extend(weight);
        rec.extend(bias);
        let (has_w, has_b) = (weight.is_some(), bias.is_some());
        Ok(crate::autograd::record(y, &rec, false, || {
            Box::new(move |cx| {
                let g = cx.g.contiguous()?;
                let x = cx.inputs[0].contiguous()?;
                let w = has_w.then(|| cx.inputs[1].contiguous()).transpose()?;
                let mut ins = vec![&x, &g, &stats];
                ins.extend(w.as_ref());
                let mut grads = smallvec::smallvec![crate::ops::need(&cx.inputs[0], || run_norm(
                    NormOp::BnBackInput { p, training, weight: has_w },
                    &ins,
                    x.dims()
                ))?];
                let sum_dims: Vec<usize> = (0..x.rank()).filter(|&d| d != 1).collect();
                let mut shape = vec![1usize; x.rank()];
                shape[1] = p.channels;
                if has_w {
                    grads.push(crate::ops::need(&cx.inputs[1], || {
                        let mean = stats.narrow(0, 0, 1)?.reshape(shape.as_slice())?;
                        let inv = stats.narrow(0, 1, 1)?.reshape(shape.as_slice())?;
                        (&g * ((&x - &mean)? * &inv)?)?.sum_over(&sum_dims, false)
                    })?);
                }
                if has_b {
                    grads.push(crate::ops::need(&cx.inputs[1 + has_w as usize], || g.sum_over(&sum_dims, false))?);
                }
                Ok(grads)
            })
        }))
    }

    /// PyTorch's `F.layer_norm(self, normalized_shape, weight, bias, eps)`:
    /// normalises over the trailing dimensions `normalized_shape` (weight
    /// and bias have that shape).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 3.], [0., 4.]], &cpu())?;
    /// let y = x.layer_norm(&[2], None, None, 0.0)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![-1., 1., -1., 1.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn layer_norm(&self, normalized_shape: &[usize], weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        check_float(OP, "input", self)?;
        let dims = self.dims().to_vec();
        let k = normalized_shape.len();
        if k == 0 || k > dims.len() || dims[dims.len() - k..] != *normalized_shape {
            return Err(Error::invalid(
                OP,
                format!("normalized_shape {normalized_shape:?} must be a non-empty suffix of the input's shape {}", self.shape()),
            ));
        }
        check_param(OP, "weight", self, weight, normalized_shape)?;
        check_param(OP, "bias", self, bias, normalized_shape)?;
        let features: usize = normalized_shape.iter().product();
        let rows: usize = dims[..dims.len() - k].iter().product();
        let p = LayerNormParams { rows, features, eps };
        p.validate().map_err(|e| with_shape(e, self))?;
        let x = self.contiguous()?;
        let (wc, bc) = (weight.map(Tensor::contiguous).transpose()?, bias.map(Tensor::contiguous).transpose()?);
        let mut ins = vec![&x];
        ins.extend(wc.as_ref());
        ins.extend(bc.as_ref());
        let (has_w, has_b) = (weight.is_some(), bias.is_some());
        let y = run_norm(NormOp::LnForward { p, weight: has_w, bias: has_b }, &ins, &dims)?;
        let mut rec = vec![self];
        rec.extend(weight);
        rec.extend(bias);
        let lead: Vec<usize> = (0..dims.len() - k).collect();
        Ok(crate::autograd::record(y, &rec, false, || {
            Box::new(move |cx| {
                let g = cx.g.contiguous()?;
                let x = cx.inputs[0].contiguous()?;
                let w = has_w.then(|| cx.inputs[1].contiguous()).transpose()?;
                let mut ins = vec![&x, &g];
                ins.extend(w.as_ref());
                let mut grads = smallvec::smallvec![crate::ops::need(&cx.inputs[0], || run_norm(
                    NormOp::LnBackInput { p, weight: has_w },
                    &ins,
                    x.dims()
                ))?];
                if has_w {
                    grads.push(crate::ops::need(&cx.inputs[1], || {
                        let xhat = run_norm(NormOp::LnForward { p, weight: false, bias: false }, &[&x], x.dims())?;
                        (&g * &xhat)?.sum_over(&lead, false)
                    })?);
                }
                if has_b {
                    grads.push(crate::ops::need(&cx.inputs[1 + has_w as usize], || g.sum_over(&lead, false))?);
                }
                Ok(grads)
            })
        }))
    }
}

fn with_shape(e: host_nn::NnError, x: &Tensor) -> Error {
    match Error::from(e) {
        Error::InvalidArgument { op, msg } => Error::InvalidArgument { op, msg: format!("{msg} (input {})", x.shape()) },
        other => other,
    }
}
