//! Batch normalisation (training and evaluation) and layer normalisation,
//! forward and backward, with PyTorch's formulas. Sums run over blocks in
//! the element type and add up in f64; batch norm splits the work over
//! channels and layer norm over rows (its parameter gradients in a fixed
//! number of partial sums), so no result depends on the thread count.

use super::sums::{block_sum, sum};
use super::work::{check_len, for_each_unit, part, product, zeroed, SharedMut};
use super::{NnError, NnFloat, NnResult};

/// The arguments of batch normalisation over `[batch, channels, spatial]`
/// (an NCHW tensor has `spatial = h·w`; BatchNorm1d's `[N, C]` has 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormParams {
    /// Images.
    pub batch: usize,
    /// Channels: the statistics are per channel.
    pub channels: usize,
    /// Elements per channel per image.
    pub spatial: usize,
    /// Added to the variance before the square root.
    pub eps: f64,
}

impl BatchNormParams {
    /// The element count, or why PyTorch's `F.batch_norm` would refuse
    /// these arguments (`training`: the batch statistics need more than one
    /// value per channel).
    pub fn validate(&self, training: bool) -> NnResult<usize> {
        const OP: &str = "batch_norm";
        let len = product(OP, "the input shape", &[self.batch, self.channels, self.spatial])?;
        if training && self.batch.checked_mul(self.spatial) == Some(1) {
            return Err(NnError::invalid(
                OP,
                format!("training needs more than one value per channel, got input [{}, {}, {}]", self.batch, self.channels, self.spatial),
            ));
        }
        if self.eps.is_nan() || self.eps < 0.0 {
            return Err(NnError::invalid(OP, format!("eps must be a non-negative number, got {}", self.eps)));
        }
        if training && self.eps == 0.0 {
            // As PyTorch: a channel whose values are all equal has variance
            // 0, and 1/√(0 + 0) would turn its outputs into NaN.
            return Err(NnError::invalid(
                OP,
                "eps must be positive when training, got 0 (a channel of equal values would divide by √0); the usual value is 1e-5",
            ));
        }
        Ok(len)
    }

    /// Values per channel: the count the statistics divide by (saturating:
    /// with no channels the product of the others may not fit).
    pub fn count(&self) -> usize {
        self.batch.saturating_mul(self.spatial)
    }
}

/// Channels per unit of work: enough elements per task to pay for it.
fn channel_units(p: &BatchNormParams, threads: usize) -> usize {
    if p.count().saturating_mul(p.channels) < 1 << 15 {
        1
    } else {
        threads
    }
}

/// Calls `f(x_chunk, y_chunk)` over channel `c`'s runs of `x` and `y`
/// (one per image).
#[inline]
fn each_run<T: NnFloat>(p: &BatchNormParams, c: usize, x: &[T], mut f: impl FnMut(&[T])) {
    for n in 0..p.batch {
        f(&x[(n * p.channels + c) * p.spatial..][..p.spatial]);
    }
}

/// Training forward: normalises each channel by its batch mean and biased
/// variance, `y = (x − mean)·invstd·weight + bias`, and writes the mean and
/// `invstd = 1/√(var + eps)` the backward uses, and the biased variance when
/// asked (for [`batch_norm_update_running`]). With no value per channel
/// the mean and invstd are NaN (the mean of nothing).
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_train_forward<T: NnFloat>(
    p: &BatchNormParams,
    input: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    output: &mut [T],
    save_mean: &mut [T],
    save_invstd: &mut [T],
    batch_var: Option<&mut [T]>,
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "batch_norm";
    let len = p.validate(true)?;
    check_len(OP, "input", input.len(), len)?;
    check_len(OP, "output", output.len(), len)?;
    check_params(OP, p.channels, weight, bias)?;
    check_len(OP, "save_mean", save_mean.len(), p.channels)?;
    check_len(OP, "save_invstd", save_invstd.len(), p.channels)?;
    if let Some(v) = &batch_var {
        check_len(OP, "batch_var", v.len(), p.channels)?;
    }
    let count = p.count();
    let (out, mean_out, inv_out) = (SharedMut::new(output), SharedMut::new(save_mean), SharedMut::new(save_invstd));
    let var_out = batch_var.map(SharedMut::new);
    for_each_unit(
        channel_units(p, threads),
        p.channels,
        || Ok(()),
        |_, c| {
            let (mean, var) = if count == 0 {
                (f64::NAN, f64::NAN)
            } else {
                let mut total = 0.0;
                each_run(p, c, input, |run| total += sum(run));
                let mean = total / count as f64;
                let m = T::from_f64(mean);
                let mut sq = 0.0;
                each_run(p, c, input, |run| {
                    for block in run.chunks(256) {
                        sq += block_sum(block, |v| (v - m) * (v - m));
                    }
                });
                (mean, sq / count as f64)
            };
            let invstd = 1.0 / (var + p.eps).sqrt();
            // SAFETY: unit c alone writes element c of the statistics.
            unsafe {
                mean_out.slice(c, 1)[0] = T::from_f64(mean);
                inv_out.slice(c, 1)[0] = T::from_f64(invstd);
                if let Some(v) = &var_out {
                    v.slice(c, 1)[0] = T::from_f64(var);
                }
            }
            let (alpha, beta) = affine(T::from_f64(mean), T::from_f64(invstd), weight.map(|w| w[c]), bias.map(|b| b[c]));
            for n in 0..p.batch {
                let at = (n * p.channels + c) * p.spatial;
                // SAFETY: unit c alone writes channel c's runs.
                let y = unsafe { out.slice(at, p.spatial) };
                for (y, &x) in y.iter_mut().zip(&input[at..at + p.spatial]) {
                    *y = x * alpha + beta;
                }
            }
            Ok(())
        },
    )
}

/// `y = x·alpha + beta` per channel, as PyTorch folds the normalisation.
#[inline]
fn affine<T: NnFloat>(mean: T, invstd: T, w: Option<T>, b: Option<T>) -> (T, T) {
    let alpha = invstd * w.unwrap_or(T::ONE);
    (alpha, b.unwrap_or(T::ZERO) - mean * alpha)
}

fn check_params<T>(op: &'static str, channels: usize, weight: Option<&[T]>, bias: Option<&[T]>) -> NnResult<()> {
    if let Some(w) = weight {
        check_len(op, "weight", w.len(), channels)?;
    }
    if let Some(b) = bias {
        check_len(op, "bias", b.len(), channels)?;
    }
    Ok(())
}

/// PyTorch's running-statistics update after a training forward:
/// `running = (1 − momentum)·running + momentum·batch`, with the batch
/// variance made unbiased (`var · count / (count − 1)`). An empty batch
/// leaves them as they are, as PyTorch's `F.batch_norm` does.
pub fn batch_norm_update_running<T: NnFloat>(
    p: &BatchNormParams,
    batch_mean: &[T],
    batch_var: &[T],
    momentum: f64,
    running_mean: &mut [T],
    running_var: &mut [T],
) -> NnResult<()> {
    const OP: &str = "batch_norm";
    p.validate(true)?;
    for (what, len) in [
        ("batch_mean", batch_mean.len()),
        ("batch_var", batch_var.len()),
        ("running_mean", running_mean.len()),
        ("running_var", running_var.len()),
    ] {
        check_len(OP, what, len, p.channels)?;
    }
    let count = p.count();
    if count == 0 {
        return Ok(());
    }
    let unbias = count as f64 / (count as f64 - 1.0);
    for c in 0..p.channels {
        running_mean[c] = T::from_f64((1.0 - momentum) * running_mean[c].to_f64() + momentum * batch_mean[c].to_f64());
        running_var[c] = T::from_f64((1.0 - momentum) * running_var[c].to_f64() + momentum * batch_var[c].to_f64() * unbias);
    }
    Ok(())
}

/// `1/√(var + eps)` per channel: the invstd of the running variance, for
/// [`batch_norm_backward`] in evaluation mode.
pub fn batch_norm_invstd<T: NnFloat>(running_var: &[T], eps: f64, invstd: &mut [T]) -> NnResult<()> {
    check_len("batch_norm", "invstd", invstd.len(), running_var.len())?;
    for (i, &v) in invstd.iter_mut().zip(running_var) {
        *i = T::from_f64(1.0 / (v.to_f64() + eps).sqrt());
    }
    Ok(())
}

/// Evaluation forward: `y = (x − running_mean)/√(running_var + eps)·weight + bias`.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_eval_forward<T: NnFloat>(
    p: &BatchNormParams,
    input: &[T],
    running_mean: &[T],
    running_var: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    output: &mut [T],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "batch_norm";
    let len = p.validate(false)?;
    check_len(OP, "input", input.len(), len)?;
    check_len(OP, "output", output.len(), len)?;
    check_len(OP, "running_mean", running_mean.len(), p.channels)?;
    check_len(OP, "running_var", running_var.len(), p.channels)?;
    check_params(OP, p.channels, weight, bias)?;
    let out = SharedMut::new(output);
    for_each_unit(
        channel_units(p, threads),
        p.channels,
        || Ok(()),
        |_, c| {
            let invstd = T::from_f64(1.0 / (running_var[c].to_f64() + p.eps).sqrt());
            let (alpha, beta) = affine(running_mean[c], invstd, weight.map(|w| w[c]), bias.map(|b| b[c]));
            for n in 0..p.batch {
                let at = (n * p.channels + c) * p.spatial;
                // SAFETY: unit c alone writes channel c's runs.
                let y = unsafe { out.slice(at, p.spatial) };
                for (y, &x) in y.iter_mut().zip(&input[at..at + p.spatial]) {
                    *y = x * alpha + beta;
                }
            }
            Ok(())
        },
    )
}

/// The gradients of batch normalisation. `mean` and `invstd` are what the
/// training forward saved, or in evaluation mode (`training = false`) the
/// running mean and [`batch_norm_invstd`] of the running variance (then the
/// statistics are constants). Each gradient asked for is written.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward<T: NnFloat>(
    p: &BatchNormParams,
    input: &[T],
    grad_output: &[T],
    weight: Option<&[T]>,
    mean: &[T],
    invstd: &[T],
    training: bool,
    grad_input: Option<&mut [T]>,
    grad_weight: Option<&mut [T]>,
    grad_bias: Option<&mut [T]>,
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "batch_norm_backward";
    let len = p.validate(training)?;
    check_len(OP, "input", input.len(), len)?;
    check_len(OP, "grad_output", grad_output.len(), len)?;
    check_params(OP, p.channels, weight, None)?;
    check_len(OP, "mean", mean.len(), p.channels)?;
    check_len(OP, "invstd", invstd.len(), p.channels)?;
    if let Some(g) = &grad_input {
        check_len(OP, "grad_input", g.len(), len)?;
    }
    if let Some(g) = &grad_weight {
        check_len(OP, "grad_weight", g.len(), p.channels)?;
    }
    if let Some(g) = &grad_bias {
        check_len(OP, "grad_bias", g.len(), p.channels)?;
    }
    let count = p.count();
    let gin = grad_input.map(SharedMut::new);
    let (gw, gb) = (grad_weight.map(SharedMut::new), grad_bias.map(SharedMut::new));
    for_each_unit(
        channel_units(p, threads),
        p.channels,
        || Ok(()),
        |_, c| {
            let (m, inv) = (mean[c], invstd[c]);
            // Σ dy, Σ dy·(x − mean) and Σ x over the channel.
            let (mut sum_dy, mut dotp, mut sum_x) = (0.0f64, 0.0f64, 0.0f64);
            for n in 0..p.batch {
                let at = (n * p.channels + c) * p.spatial;
                let (x, dy) = (&input[at..at + p.spatial], &grad_output[at..at + p.spatial]);
                sum_dy += sum(dy);
                if training {
                    sum_x += sum(x);
                }
                for (xb, db) in x.chunks(256).zip(dy.chunks(256)) {
                    let mut lanes = [T::ZERO; 16];
                    let (mut xc, mut dc) = (xb.chunks_exact(16), db.chunks_exact(16));
                    for (xs, ds) in (&mut xc).zip(&mut dc) {
                        for i in 0..16 {
                            lanes[i] += (xs[i] - m) * ds[i];
                        }
                    }
                    for (i, (&xv, &dv)) in xc.remainder().iter().zip(dc.remainder()).enumerate() {
                        lanes[i] += (xv - m) * dv;
                    }
                    dotp += lanes.iter().map(|v| v.to_f64()).sum::<f64>();
                }
            }
            // The saved mean is the batch mean rounded to T; its rounding, δ,
            // would be amplified by invstd where a channel is nearly constant.
            // Σ x gives the mean in f64, and Σ dy·(x − mean) = Σ dy·(x − m) + δ·Σ dy.
            let shift = if training && count > 0 { m.to_f64() - sum_x / count as f64 } else { 0.0 };
            dotp += shift * sum_dy;
            // SAFETY: unit c alone writes element c of the parameter gradients.
            unsafe {
                if let Some(gw) = &gw {
                    gw.slice(c, 1)[0] = T::from_f64(dotp * inv.to_f64());
                }
                if let Some(gb) = &gb {
                    gb.slice(c, 1)[0] = T::from_f64(sum_dy);
                }
            }
            let Some(gin) = &gin else { return Ok(()) };
            let w = weight.map_or(T::ONE, |w| w[c]);
            if training && count > 0 {
                // dx = (dy − Σdy/N − (x − mean)·invstd²·Σdy(x − mean)/N)·invstd·w
                let k = T::from_f64(dotp * inv.to_f64() * inv.to_f64() / count as f64);
                let grad_mean = T::from_f64(sum_dy / count as f64);
                let scale = inv * w;
                for n in 0..p.batch {
                    let at = (n * p.channels + c) * p.spatial;
                    // SAFETY: unit c alone writes channel c's runs.
                    let dx = unsafe { gin.slice(at, p.spatial) };
                    for ((dx, &x), &dy) in dx.iter_mut().zip(&input[at..at + p.spatial]).zip(&grad_output[at..at + p.spatial]) {
                        *dx = (dy - grad_mean - (x - m) * k) * scale;
                    }
                }
            } else {
                let scale = inv * w;
                for n in 0..p.batch {
                    let at = (n * p.channels + c) * p.spatial;
                    // SAFETY: unit c alone writes channel c's runs.
                    let dx = unsafe { gin.slice(at, p.spatial) };
                    for (dx, &dy) in dx.iter_mut().zip(&grad_output[at..at + p.spatial]) {
                        *dx = dy * scale;
                    }
                }
            }
            Ok(())
        },
    )
}

// ---- layer norm -------------------------------------------------------------

/// The arguments of layer normalisation: `rows` independent rows of
/// `features` elements (the normalised trailing dimensions, flattened).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNormParams {
    /// Rows: the product of the leading dimensions (0 is allowed).
    pub rows: usize,
    /// Elements normalised together: the product of `normalized_shape`.
    pub features: usize,
    /// Added to the variance before the square root.
    pub eps: f64,
}

impl LayerNormParams {
    /// The element count, or why these arguments are refused.
    pub fn validate(&self) -> NnResult<usize> {
        const OP: &str = "layer_norm";
        if self.eps.is_nan() || self.eps < 0.0 {
            return Err(NnError::invalid(OP, format!("eps must be a non-negative number, got {}", self.eps)));
        }
        product(OP, "the input shape", &[self.rows, self.features])
    }
}

/// Rows per unit of work.
fn rows_per_unit(features: usize) -> usize {
    ((1 << 14) / features.max(1)).max(1)
}

/// A row's mean and `1/√(var + eps)`, in f64 (a row of no features has
/// mean 0 and rstd NaN, as PyTorch's).
fn row_stats<T: NnFloat>(x: &[T], eps: f64) -> (f64, f64) {
    if x.is_empty() {
        return (0.0, f64::NAN);
    }
    let n = x.len() as f64;
    let mean = x.iter().map(|v| v.to_f64()).sum::<f64>() / n;
    let var = x.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Layer norm forward: each row normalised by its mean and biased variance,
/// then `·weight + bias` elementwise; writes each row's mean and
/// `rstd = 1/√(var + eps)` (PyTorch's saved statistics). Rows are
/// normalised in f64, rounded once.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<T: NnFloat>(
    p: &LayerNormParams,
    input: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    output: &mut [T],
    save_mean: &mut [T],
    save_rstd: &mut [T],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "layer_norm";
    let len = p.validate()?;
    check_len(OP, "input", input.len(), len)?;
    check_len(OP, "output", output.len(), len)?;
    check_params(OP, p.features, weight, bias)?;
    check_len(OP, "save_mean", save_mean.len(), p.rows)?;
    check_len(OP, "save_rstd", save_rstd.len(), p.rows)?;
    let f = p.features;
    let per = rows_per_unit(f);
    let (out, means, rstds) = (SharedMut::new(output), SharedMut::new(save_mean), SharedMut::new(save_rstd));
    for_each_unit(
        threads,
        p.rows.div_ceil(per),
        || Ok(()),
        |_, u| {
            let (a, b) = (u * per, ((u + 1) * per).min(p.rows));
            // SAFETY: unit u alone writes rows a..b.
            let (y, ms, rs) = unsafe { (out.slice(a * f, (b - a) * f), means.slice(a, b - a), rstds.slice(a, b - a)) };
            for r in a..b {
                let x = &input[r * f..(r + 1) * f];
                let (mean, rstd) = row_stats(x, p.eps);
                ms[r - a] = T::from_f64(mean);
                rs[r - a] = T::from_f64(rstd);
                for (i, (yv, &xv)) in y[(r - a) * f..(r - a + 1) * f].iter_mut().zip(x).enumerate() {
                    let v = (xv.to_f64() - mean) * rstd;
                    *yv = T::from_f64(v * weight.map_or(1.0, |w| w[i].to_f64()) + bias.map_or(0.0, |b| b[i].to_f64()));
                }
            }
            Ok(())
        },
    )
}

/// Partial sums of layer norm's parameter gradients (a constant, so the
/// order of the sums never depends on the thread count).
const ROW_PARTS: usize = 8;

/// The gradients of [`layer_norm_forward`]; each one asked for is written.
/// The rows' statistics are recomputed in f64 from the input rather than
/// taken from the forward's rounded ones: where a row is nearly constant
/// (a large rstd) the rounding of a saved f32 mean is amplified into the
/// gradient, and this way it is not.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<T: NnFloat>(
    p: &LayerNormParams,
    input: &[T],
    grad_output: &[T],
    weight: Option<&[T]>,
    grad_input: Option<&mut [T]>,
    grad_weight: Option<&mut [T]>,
    grad_bias: Option<&mut [T]>,
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "layer_norm_backward";
    let len = p.validate()?;
    let f = p.features;
    check_len(OP, "input", input.len(), len)?;
    check_len(OP, "grad_output", grad_output.len(), len)?;
    check_params(OP, f, weight, None)?;
    if let Some(g) = &grad_input {
        check_len(OP, "grad_input", g.len(), len)?;
    }
    if let Some(g) = &grad_weight {
        check_len(OP, "grad_weight", g.len(), f)?;
    }
    if let Some(g) = &grad_bias {
        check_len(OP, "grad_bias", g.len(), f)?;
    }
    let w = |i: usize| weight.map_or(1.0, |w| w[i].to_f64());
    if let Some(gin) = grad_input {
        let per = rows_per_unit(f);
        let out = SharedMut::new(gin);
        for_each_unit(
            threads,
            p.rows.div_ceil(per),
            || Ok(()),
            |_, u| {
                let (a, b) = (u * per, ((u + 1) * per).min(p.rows));
                // SAFETY: unit u alone writes rows a..b.
                let dx = unsafe { out.slice(a * f, (b - a) * f) };
                for r in a..b {
                    let (x, dy) = (&input[r * f..(r + 1) * f], &grad_output[r * f..(r + 1) * f]);
                    let (mean, rstd) = row_stats(x, p.eps);
                    // g = dy·w; dx = rstd·(g − mean(g) − x̂·mean(g·x̂))
                    let (mut sg, mut sgx) = (0.0f64, 0.0f64);
                    for (i, (&xv, &d)) in x.iter().zip(dy).enumerate() {
                        let g = d.to_f64() * w(i);
                        sg += g;
                        sgx += g * (xv.to_f64() - mean) * rstd;
                    }
                    let (mg, mgx) = (sg / f as f64, sgx / f as f64);
                    for (i, ((d, &xv), &dyv)) in dx[(r - a) * f..(r - a + 1) * f].iter_mut().zip(x).zip(dy).enumerate() {
                        *d = T::from_f64(rstd * (dyv.to_f64() * w(i) - mg - (xv.to_f64() - mean) * rstd * mgx));
                    }
                }
                Ok(())
            },
        )?;
    }
    if grad_weight.is_none() && grad_bias.is_none() {
        return Ok(());
    }
    // Parameter gradients: sums over rows, in ROW_PARTS fixed partial sums.
    let parts = ROW_PARTS.min(p.rows).max(1);
    let mut partials = zeroed::<f64>(OP, parts * 2 * f)?;
    let dst = SharedMut::new(&mut partials);
    for_each_unit(
        threads,
        parts,
        || Ok(()),
        |_, u| {
            // SAFETY: unit u alone writes partial sum u.
            let acc = unsafe { dst.slice(u * 2 * f, 2 * f) };
            let (aw, ab) = acc.split_at_mut(f);
            for r in part(p.rows, parts, u) {
                let (x, dy) = (&input[r * f..(r + 1) * f], &grad_output[r * f..(r + 1) * f]);
                let (mean, rstd) = row_stats(x, p.eps);
                for (((aw, ab), &xv), &d) in aw.iter_mut().zip(ab.iter_mut()).zip(x).zip(dy) {
                    *aw += d.to_f64() * (xv.to_f64() - mean) * rstd;
                    *ab += d.to_f64();
                }
            }
            Ok(())
        },
    )?;
    let total = |off: usize, i: usize| (0..parts).map(|u| partials[u * 2 * f + off + i]).sum::<f64>();
    if let Some(gw) = grad_weight {
        for (i, v) in gw.iter_mut().enumerate() {
            *v = T::from_f64(total(0, i));
        }
    }
    if let Some(gb) = grad_bias {
        for (i, v) in gb.iter_mut().enumerate() {
            *v = T::from_f64(total(f, i));
        }
    }
    Ok(())
}
