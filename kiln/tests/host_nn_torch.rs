//! Differential test of the convolutional-network host kernels
//! (`kiln::host_nn`) against PyTorch, run on demand: PyTorch is several GB,
//! so normal CI does not install it.
//!
//! Seeded random cases of conv2d (asymmetric and "same" padding, stride,
//! dilation, groups, bias), conv_transpose2d (output_padding), max_pool2d
//! (dilation, ceil_mode, ties, NaN, −∞), avg_pool2d (ceil_mode,
//! count_include_pad, divisor_override), adaptive_avg_pool2d, batch norm
//! (training with running statistics, evaluation), layer norm and
//! interpolate (nearest, bilinear with and without align_corners, sizes and
//! scale factors), in f32 and f64, with empty batches, at 1 and 2 threads.
//! Each case writes its arguments, inputs, an output gradient and kiln's
//! forward and every gradient as one JSON line; `scripts/host_nn_torch.py`
//! recomputes them with PyTorch (autograd for the gradients) and reports
//! every difference beyond 1e-10 (f64) or 1e-5 (f32) of the output's scale.
//! Argument cases drawn from a wider range (many invalid) check that kiln
//! refuses exactly what PyTorch refuses and agrees on the output shape.
//!
//! Runs only when `KILN_TORCH_PYTHON` names a Python with torch (otherwise
//! the test is reported ignored, with the reason); `scripts/host-nn-torch.sh`
//! runs it with /tmp/kiln-torch. `KILN_TORCH_CASES` (default 200 per op),
//! `KILN_TORCH_SEED` (default 1), `KILN_TORCH_KEEP=path` keeps the cases.

#[macro_use]
mod common;

use common::rng::{Draw, XorShift as Rng};

use common::Ran;
use kiln::host_nn::*;
use std::fmt::Write as _;
use std::process::Command;

/// The case values this suite draws.
trait Cases: Draw {
    /// Values in [−2, 2]: half the time multiples of 1/256 (sums exact
    /// in either dtype, so any difference is one of semantics), else full
    /// precision (rounded to the case's dtype before use).
    fn vals(&mut self, n: usize) -> Vec<f64> {
        let dyadic = self.below(2) == 0;
        (0..n).map(|_| if dyadic { ((self.unit() * 4.0 - 2.0) * 256.0).round() / 256.0 } else { self.unit() * 4.0 - 2.0 }).collect()
    }
    /// Values with ties, −∞ and NaN now and then (for max pooling).
    fn edgy(&mut self, n: usize) -> Vec<f64> {
        (0..n)
            .map(|_| match self.below(25) {
                0 => f64::NAN,
                1 => f64::NEG_INFINITY,
                2..=8 => self.below(3) as f64,
                _ => ((self.unit() * 4.0 - 2.0) * 256.0).round() / 256.0,
            })
            .collect()
    }
}

impl<R: Draw> Cases for R {}

fn num(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        format!("{v:?}")
    }
}

fn arr<T: NnFloat>(v: &[T]) -> String {
    let mut s = String::from("[");
    for (i, x) in v.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&num(x.to_f64()));
    }
    s.push(']');
    s
}

fn ints(v: &[i64]) -> String {
    format!("{v:?}")
}

fn to<T: NnFloat>(v: &[f64]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x)).collect()
}

fn n(s: &[usize]) -> usize {
    s.iter().product()
}

/// One case: the JSON line, or the error kiln returned for valid arguments.
type Case = Result<String, NnError>;

fn conv_case<T: NnFloat>(r: &mut Rng, dtype: &str, threads: usize) -> Case {
    // One case in eight is a layer of 16–48 channels per group, 3×3 or 5×5:
    // the sizes where the fast kernels (f32 direct tiles and Winograd) run.
    if r.below(8) == 0 {
        let groups = r.pick(&[1, 1, 2]);
        let k = r.pick(&[3, 3, 3, 5]);
        let p = Conv2dParams {
            batch: r.range(1, 3),
            in_channels: groups * r.pick(&[16, 24, 32, 48]),
            out_channels: groups * r.pick(&[16, 32, 40]),
            input: [r.range(k, 18), r.range(k, 18)],
            kernel: [k, k],
            stride: [1, 1],
            padding: Padding2d { top: r.range(0, 2), bottom: r.range(0, 2), left: r.range(0, 2), right: r.range(0, 2) },
            dilation: [1, 1],
            groups,
        };
        if p.validate().is_ok() {
            return conv_case_of::<T>(r, p, false, dtype, threads);
        }
    }
    let p = loop {
        let groups = r.pick(&[1, 1, 1, 2, 3]);
        let same = r.below(6) == 0;
        let kernel = [r.range(1, 4), r.range(1, 4)];
        let dilation = [r.pick(&[1, 1, 2, 3]), r.pick(&[1, 1, 2, 3])];
        let stride = if same { [1, 1] } else { [r.pick(&[1, 1, 2, 3]), r.pick(&[1, 1, 2, 3])] };
        let padding = if same {
            Padding2d::same(kernel, dilation, stride)?
        } else if r.below(2) == 0 {
            Padding2d::symmetric([r.range(0, 4), r.range(0, 4)])
        } else {
            Padding2d { top: r.range(0, 5), bottom: r.range(0, 5), left: r.range(0, 5), right: r.range(0, 5) }
        };
        let p = Conv2dParams {
            batch: r.pick(&[0, 1, 2, 2, 3]),
            in_channels: groups * if r.below(20) == 0 { 0 } else { r.range(1, 3) },
            out_channels: groups * r.range(1, 3),
            input: [r.range(1, 10), r.range(1, 10)],
            kernel,
            stride,
            padding,
            dilation,
            groups,
        };
        if p.validate().is_ok() {
            break (p, same);
        }
    };
    let (p, same) = p;
    conv_case_of::<T>(r, p, same, dtype, threads)
}

fn conv_case_of<T: NnFloat>(r: &mut Rng, p: Conv2dParams, same: bool, dtype: &str, threads: usize) -> Case {
    let out = p.validate()?;
    let (x, w, b, dy) = (r.vals(n(&p.input_shape())), r.vals(n(&p.weight_shape())), r.vals(p.out_channels), r.vals(n(&out)));
    let bias = r.below(2) == 0;
    let (xt, wt, bt, dyt) = (to::<T>(&x), to::<T>(&w), to::<T>(&b), to::<T>(&dy));
    let mut y = vec![T::ZERO; n(&out)];
    conv2d_forward(&p, &xt, &wt, bias.then_some(&bt[..]), &mut y, threads)?;
    let (mut gx, mut gw, mut gb) = (vec![T::ZERO; x.len()], vec![T::ZERO; w.len()], vec![T::ZERO; b.len()]);
    conv2d_backward(&p, &xt, &wt, &dyt, Some(&mut gx), Some(&mut gw), Some(&mut gb), threads)?;
    let pd = p.padding;
    Ok(format!(
        "{{\"op\":\"conv2d\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"stride\":{:?},\"padding\":[{},{},{},{}],\"same\":{same},\"dilation\":{:?},\"groups\":{},\
         \"x_shape\":{:?},\"w_shape\":{:?},\"bias\":{bias},\"x\":{},\"w\":{},\"b\":{},\"dy\":{},\"y\":{},\"gx\":{},\"gw\":{},\"gb\":{}}}",
        p.stride,
        pd.top,
        pd.bottom,
        pd.left,
        pd.right,
        p.dilation,
        p.groups,
        p.input_shape(),
        p.weight_shape(),
        arr(&xt),
        arr(&wt),
        arr(&bt),
        arr(&dyt),
        arr(&y),
        arr(&gx),
        arr(&gw),
        arr(&gb)
    ))
}

fn transpose_case<T: NnFloat>(r: &mut Rng, dtype: &str, threads: usize) -> Case {
    let p = loop {
        let groups = r.pick(&[1, 1, 1, 2, 3]);
        let stride = [r.pick(&[1, 1, 2, 3]), r.pick(&[1, 1, 2, 3])];
        let dilation = [r.pick(&[1, 1, 2, 3]), r.pick(&[1, 1, 2, 3])];
        let p = ConvTranspose2dParams {
            batch: r.pick(&[0, 1, 2, 3]),
            in_channels: groups * r.range(1, 3),
            out_channels: groups * r.range(1, 3),
            input: [r.range(1, 7), r.range(1, 7)],
            kernel: [r.range(1, 4), r.range(1, 4)],
            stride,
            padding: [r.range(0, 3), r.range(0, 3)],
            output_padding: [r.below(stride[0].max(dilation[0])), r.below(stride[1].max(dilation[1]))],
            dilation,
            groups,
        };
        if p.validate().is_ok() {
            break p;
        }
    };
    let out = p.validate()?;
    let (x, w, b, dy) = (r.vals(n(&p.input_shape())), r.vals(n(&p.weight_shape())), r.vals(p.out_channels), r.vals(n(&out)));
    let bias = r.below(2) == 0;
    let (xt, wt, bt, dyt) = (to::<T>(&x), to::<T>(&w), to::<T>(&b), to::<T>(&dy));
    let mut y = vec![T::ZERO; n(&out)];
    conv_transpose2d_forward(&p, &xt, &wt, bias.then_some(&bt[..]), &mut y, threads)?;
    let (mut gx, mut gw, mut gb) = (vec![T::ZERO; x.len()], vec![T::ZERO; w.len()], vec![T::ZERO; b.len()]);
    conv_transpose2d_backward(&p, &xt, &wt, &dyt, Some(&mut gx), Some(&mut gw), Some(&mut gb), threads)?;
    Ok(format!(
        "{{\"op\":\"conv_transpose2d\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"stride\":{:?},\"padding\":{:?},\"output_padding\":{:?},\
         \"dilation\":{:?},\"groups\":{},\"x_shape\":{:?},\"w_shape\":{:?},\"bias\":{bias},\"x\":{},\"w\":{},\"b\":{},\"dy\":{},\"y\":{},\
         \"gx\":{},\"gw\":{},\"gb\":{}}}",
        p.stride,
        p.padding,
        p.output_padding,
        p.dilation,
        p.groups,
        p.input_shape(),
        p.weight_shape(),
        arr(&xt),
        arr(&wt),
        arr(&bt),
        arr(&dyt),
        arr(&y),
        arr(&gx),
        arr(&gw),
        arr(&gb)
    ))
}

fn max_pool_case<T: NnFloat>(r: &mut Rng, dtype: &str, threads: usize) -> Case {
    let p = loop {
        let kernel = [r.range(1, 4), r.range(1, 4)];
        let p = MaxPool2dParams {
            batch: r.pick(&[0, 1, 2, 3]),
            channels: r.range(1, 3),
            input: [r.range(1, 9), r.range(1, 9)],
            kernel,
            stride: [r.range(1, 3), r.range(1, 3)],
            padding: [r.range(0, kernel[0] / 2), r.range(0, kernel[1] / 2)],
            dilation: [r.pick(&[1, 1, 2, 3]), r.pick(&[1, 1, 2, 3])],
            ceil_mode: r.below(2) == 0,
        };
        if p.validate().is_ok() {
            break p;
        }
    };
    let out = p.validate()?;
    let (x, dy) = (r.edgy(p.batch * p.channels * p.input[0] * p.input[1]), r.vals(n(&out)));
    let (xt, dyt) = (to::<T>(&x), to::<T>(&dy));
    let (mut y, mut idx) = (vec![T::ZERO; n(&out)], vec![0i64; n(&out)]);
    max_pool2d_forward(&p, &xt, &mut y, &mut idx, threads)?;
    let mut gx = vec![T::ZERO; x.len()];
    max_pool2d_backward(&p, &dyt, &idx, &mut gx, threads)?;
    Ok(format!(
        "{{\"op\":\"max_pool2d\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"kernel\":{:?},\"stride\":{:?},\"padding\":{:?},\"dilation\":{:?},\
         \"ceil_mode\":{},\"x_shape\":[{},{},{},{}],\"x\":{},\"dy\":{},\"y\":{},\"indices\":{},\"gx\":{}}}",
        p.kernel,
        p.stride,
        p.padding,
        p.dilation,
        p.ceil_mode,
        p.batch,
        p.channels,
        p.input[0],
        p.input[1],
        arr(&xt),
        arr(&dyt),
        arr(&y),
        ints(&idx),
        arr(&gx)
    ))
}

fn avg_pool_case<T: NnFloat>(r: &mut Rng, dtype: &str, threads: usize) -> Case {
    let p = loop {
        let kernel = [r.range(1, 4), r.range(1, 4)];
        let p = AvgPool2dParams {
            batch: r.pick(&[0, 1, 2, 3]),
            channels: r.range(1, 3),
            input: [r.range(1, 9), r.range(1, 9)],
            kernel,
            stride: [r.range(1, 3), r.range(1, 3)],
            padding: [r.range(0, kernel[0] / 2), r.range(0, kernel[1] / 2)],
            ceil_mode: r.below(2) == 0,
            count_include_pad: r.below(2) == 0,
            divisor_override: [None, None, None, Some(3), Some(-2), Some(7)][r.below(6)],
        };
        if p.validate().is_ok() {
            break p;
        }
    };
    let out = p.validate()?;
    let (x, dy) = (r.vals(p.batch * p.channels * p.input[0] * p.input[1]), r.vals(n(&out)));
    let (xt, dyt) = (to::<T>(&x), to::<T>(&dy));
    let mut y = vec![T::ZERO; n(&out)];
    avg_pool2d_forward(&p, &xt, &mut y, threads)?;
    let mut gx = vec![T::ZERO; x.len()];
    avg_pool2d_backward(&p, &dyt, &mut gx, threads)?;
    Ok(format!(
        "{{\"op\":\"avg_pool2d\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"kernel\":{:?},\"stride\":{:?},\"padding\":{:?},\"ceil_mode\":{},\
         \"count_include_pad\":{},\"divisor_override\":{},\"x_shape\":[{},{},{},{}],\"x\":{},\"dy\":{},\"y\":{},\"gx\":{}}}",
        p.kernel,
        p.stride,
        p.padding,
        p.ceil_mode,
        p.count_include_pad,
        p.divisor_override.map_or("null".into(), |d| d.to_string()),
        p.batch,
        p.channels,
        p.input[0],
        p.input[1],
        arr(&xt),
        arr(&dyt),
        arr(&y),
        arr(&gx)
    ))
}

fn adaptive_case<T: NnFloat>(r: &mut Rng, dtype: &str, threads: usize) -> Case {
    let input = [r.range(1, 10), r.range(1, 10)];
    let p = AdaptivePool2dParams {
        batch: r.pick(&[0, 1, 2]),
        channels: r.pick(&[0, 1, 2, 3]),
        input,
        output: [r.range(1, input[0] + 3), r.range(1, input[1] + 3)],
    };
    let out = p.validate()?;
    let (x, dy) = (r.vals(p.batch * p.channels * input[0] * input[1]), r.vals(n(&out)));
    let (xt, dyt) = (to::<T>(&x), to::<T>(&dy));
    let mut y = vec![T::ZERO; n(&out)];
    adaptive_avg_pool2d_forward(&p, &xt, &mut y, threads)?;
    let mut gx = vec![T::ZERO; x.len()];
    adaptive_avg_pool2d_backward(&p, &dyt, &mut gx, threads)?;
    Ok(format!(
        "{{\"op\":\"adaptive_avg_pool2d\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"output\":{:?},\"x_shape\":[{},{},{},{}],\
         \"x\":{},\"dy\":{},\"y\":{},\"gx\":{}}}",
        p.output,
        p.batch,
        p.channels,
        input[0],
        input[1],
        arr(&xt),
        arr(&dyt),
        arr(&y),
        arr(&gx)
    ))
}

fn batch_norm_case<T: NnFloat>(r: &mut Rng, dtype: &str, threads: usize) -> Case {
    // [N, C], [N, C, L] or [N, C, H, W].
    let (shape, p) = loop {
        let (batch, channels) = (r.range(1, 4), r.range(1, 4));
        let rest: Vec<usize> = match r.below(3) {
            0 => vec![],
            1 => vec![r.range(1, 6)],
            _ => vec![r.range(1, 5), r.range(1, 5)],
        };
        let p = BatchNormParams { batch, channels, spatial: n(&rest), eps: r.pick(&[1e-5, 1e-3]) };
        if p.validate(true).is_ok() {
            let mut shape = vec![batch, channels];
            shape.extend(rest);
            break (shape, p);
        }
    };
    let len = p.validate(true)?;
    let c = p.channels;
    let (x, w, b, dy) = (r.vals(len), r.vals(c), r.vals(c), r.vals(len));
    let rm: Vec<f64> = r.vals(c);
    let rv: Vec<f64> = r.vals(c).iter().map(|v| v.abs() + 0.25).collect();
    let affine = r.below(4) != 0;
    let training = r.below(3) != 0;
    let momentum = r.pick(&[0.1, 0.3]);
    let (xt, wt, bt, dyt) = (to::<T>(&x), to::<T>(&w), to::<T>(&b), to::<T>(&dy));
    let (pw, pb) = if affine { (Some(&wt[..]), Some(&bt[..])) } else { (None, None) };
    let (mut rmt, mut rvt) = (to::<T>(&rm), to::<T>(&rv));
    let mut y = vec![T::ZERO; len];
    let (mut mean, mut invstd, mut var) = (vec![T::ZERO; c], vec![T::ZERO; c], vec![T::ZERO; c]);
    if training {
        batch_norm_train_forward(&p, &xt, pw, pb, &mut y, &mut mean, &mut invstd, Some(&mut var), threads)?;
        batch_norm_update_running(&p, &mean, &var, momentum, &mut rmt, &mut rvt)?;
    } else {
        batch_norm_eval_forward(&p, &xt, &rmt, &rvt, pw, pb, &mut y, threads)?;
        mean.clone_from(&rmt);
        batch_norm_invstd(&rvt, p.eps, &mut invstd)?;
    }
    let (mut gx, mut gw, mut gb) = (vec![T::ZERO; len], vec![T::ZERO; c], vec![T::ZERO; c]);
    batch_norm_backward(&p, &xt, &dyt, pw, &mean, &invstd, training, Some(&mut gx), Some(&mut gw), Some(&mut gb), threads)?;
    Ok(format!(
        "{{\"op\":\"batch_norm\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"training\":{training},\"affine\":{affine},\"momentum\":{momentum},\
         \"eps\":{},\"x_shape\":{shape:?},\"x\":{},\"w\":{},\"b\":{},\"rm\":{},\"rv\":{},\"dy\":{},\"y\":{},\"mean\":{},\"invstd\":{},\
         \"rm_after\":{},\"rv_after\":{},\"gx\":{},\"gw\":{},\"gb\":{}}}",
        p.eps,
        arr(&xt),
        arr(&wt),
        arr(&bt),
        arr(&to::<T>(&rm)),
        arr(&to::<T>(&rv)),
        arr(&dyt),
        arr(&y),
        arr(&mean),
        arr(&invstd),
        arr(&rmt),
        arr(&rvt),
        arr(&gx),
        arr(&gw),
        arr(&gb)
    ))
}

fn layer_norm_case<T: NnFloat>(r: &mut Rng, dtype: &str, threads: usize) -> Case {
    let lead: Vec<usize> = (0..r.range(0, 2)).map(|_| r.range(0, 4)).collect();
    let norm: Vec<usize> = (0..r.range(1, 2)).map(|_| r.range(1, 8)).collect();
    let p = LayerNormParams { rows: n(&lead), features: n(&norm), eps: r.pick(&[1e-5, 1e-3]) };
    let len = p.validate()?;
    let f = p.features;
    let (x, w, b, dy) = (r.vals(len), r.vals(f), r.vals(f), r.vals(len));
    let affine = r.below(4) != 0;
    let (xt, wt, bt, dyt) = (to::<T>(&x), to::<T>(&w), to::<T>(&b), to::<T>(&dy));
    let (pw, pb) = if affine { (Some(&wt[..]), Some(&bt[..])) } else { (None, None) };
    let (mut y, mut mean, mut rstd) = (vec![T::ZERO; len], vec![T::ZERO; p.rows], vec![T::ZERO; p.rows]);
    layer_norm_forward(&p, &xt, pw, pb, &mut y, &mut mean, &mut rstd, threads)?;
    let (mut gx, mut gw, mut gb) = (vec![T::ZERO; len], vec![T::ZERO; f], vec![T::ZERO; f]);
    layer_norm_backward(&p, &xt, &dyt, pw, Some(&mut gx), Some(&mut gw), Some(&mut gb), threads)?;
    let mut shape = lead.clone();
    shape.extend(&norm);
    Ok(format!(
        "{{\"op\":\"layer_norm\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"affine\":{affine},\"eps\":{},\"x_shape\":{shape:?},\
         \"normalized_shape\":{norm:?},\"x\":{},\"w\":{},\"b\":{},\"dy\":{},\"y\":{},\"mean\":{},\"rstd\":{},\"gx\":{},\"gw\":{},\"gb\":{}}}",
        p.eps,
        arr(&xt),
        arr(&wt),
        arr(&bt),
        arr(&dyt),
        arr(&y),
        arr(&mean),
        arr(&rstd),
        arr(&gx),
        arr(&gw),
        arr(&gb)
    ))
}

fn interp_case<T: NnFloat>(r: &mut Rng, dtype: &str, threads: usize) -> Case {
    let input = [r.range(2, 8), r.range(2, 8)];
    let (mode, name, align) = match r.below(3) {
        0 => (InterpMode::Nearest, "nearest", false),
        1 => (InterpMode::Bilinear { align_corners: false }, "bilinear", false),
        _ => (InterpMode::Bilinear { align_corners: true }, "bilinear", true),
    };
    let (output, scales) = if r.below(3) == 0 {
        let s = [r.pick(&[0.5, 1.5, 2.0, 2.7, 3.0, 0.75, 1.3]), r.pick(&[0.5, 1.5, 2.0, 1.3, 3.0, 0.6])];
        let o = [(input[0] as f64 * s[0]).floor() as usize, (input[1] as f64 * s[1]).floor() as usize];
        (o, [Some(s[0]), Some(s[1])])
    } else {
        ([r.range(1, 13), r.range(1, 13)], [None, None])
    };
    let p = InterpParams { batch: r.pick(&[0, 1, 2]), channels: r.range(1, 3), input, output, mode, scales };
    let out = p.validate()?;
    let (x, dy) = (r.vals(p.batch * p.channels * input[0] * input[1]), r.vals(n(&out)));
    let (xt, dyt) = (to::<T>(&x), to::<T>(&dy));
    let mut y = vec![T::ZERO; n(&out)];
    interpolate_forward(&p, &xt, &mut y, threads)?;
    let mut gx = vec![T::ZERO; x.len()];
    interpolate_backward(&p, &dyt, &mut gx, threads)?;
    let how = match scales[0] {
        Some(_) => format!("\"scale_factor\":[{},{}]", num(scales[0].unwrap_or(0.0)), num(scales[1].unwrap_or(0.0))),
        None => format!("\"size\":{output:?}"),
    };
    Ok(format!(
        "{{\"op\":\"interpolate\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"mode\":\"{name}\",\"align_corners\":{align},{how},\
         \"x_shape\":[{},{},{},{}],\"x\":{},\"dy\":{},\"y\":{},\"gx\":{}}}",
        p.batch,
        p.channels,
        input[0],
        input[1],
        arr(&xt),
        arr(&dyt),
        arr(&y),
        arr(&gx)
    ))
}

/// Argument cases from a wide range (many invalid): kiln's verdict and
/// output shape, for the script to compare with PyTorch's.
fn refusal_case(r: &mut Rng) -> String {
    let verdict = |res: NnResult<[usize; 4]>| match res {
        Ok(s) => format!("\"kiln_shape\":{s:?}"),
        Err(e) => format!("\"kiln_error\":{:?}", e.to_string()),
    };
    match r.below(5) {
        0 => {
            let p = Conv2dParams {
                batch: r.range(0, 2),
                in_channels: r.range(0, 4),
                out_channels: r.range(0, 4),
                input: [r.range(0, 5), r.range(0, 5)],
                kernel: [r.range(0, 4), r.range(1, 4)],
                stride: [r.range(0, 2), r.range(1, 2)],
                padding: Padding2d { top: r.range(0, 2), bottom: r.range(0, 2), left: r.range(0, 2), right: r.range(0, 2) },
                dilation: [r.range(0, 2), r.range(1, 2)],
                groups: r.range(0, 3),
            };
            let pd = p.padding;
            format!(
                "{{\"op\":\"conv2d_args\",\"x_shape\":{:?},\"w_shape\":[{},{},{},{}],\"stride\":{:?},\"padding\":[{},{},{},{}],\"dilation\":{:?},\
                 \"groups\":{},{}}}",
                p.input_shape(),
                p.out_channels,
                p.in_channels.checked_div(p.groups).unwrap_or(0),
                p.kernel[0],
                p.kernel[1],
                p.stride,
                pd.top,
                pd.bottom,
                pd.left,
                pd.right,
                p.dilation,
                p.groups,
                verdict(p.validate())
            )
        }
        1 => {
            // out_channels a multiple of groups: PyTorch's weight names out_channels / groups.
            let groups = r.range(0, 3);
            let p = ConvTranspose2dParams {
                batch: r.range(0, 2),
                in_channels: r.range(0, 4),
                out_channels: groups.max(1) * r.range(0, 2),
                input: [r.range(0, 4), r.range(1, 4)],
                kernel: [r.range(0, 3), r.range(1, 3)],
                stride: [r.range(0, 3), r.range(1, 3)],
                padding: [r.range(0, 3), r.range(0, 1)],
                output_padding: [r.range(0, 2), r.range(0, 1)],
                dilation: [r.range(0, 2), r.range(1, 2)],
                groups,
            };
            format!(
                "{{\"op\":\"conv_transpose2d_args\",\"x_shape\":{:?},\"w_shape\":[{},{},{},{}],\"stride\":{:?},\"padding\":{:?},\
                 \"output_padding\":{:?},\"dilation\":{:?},\"groups\":{},{}}}",
                p.input_shape(),
                p.in_channels,
                p.out_channels.checked_div(p.groups).unwrap_or(0),
                p.kernel[0],
                p.kernel[1],
                p.stride,
                p.padding,
                p.output_padding,
                p.dilation,
                p.groups,
                verdict(p.validate())
            )
        }
        2 => {
            let p = MaxPool2dParams {
                batch: r.range(0, 2),
                channels: r.range(0, 2),
                input: [r.range(0, 6), r.range(1, 6)],
                kernel: [r.range(0, 4), r.range(1, 4)],
                stride: [r.range(0, 3), r.range(1, 3)],
                padding: [r.range(0, 2), r.range(0, 2)],
                dilation: [r.range(0, 3), r.range(1, 3)],
                ceil_mode: r.below(2) == 0,
            };
            format!(
                "{{\"op\":\"max_pool2d_args\",\"x_shape\":[{},{},{},{}],\"kernel\":{:?},\"stride\":{:?},\"padding\":{:?},\"dilation\":{:?},\
                 \"ceil_mode\":{},{}}}",
                p.batch,
                p.channels,
                p.input[0],
                p.input[1],
                p.kernel,
                p.stride,
                p.padding,
                p.dilation,
                p.ceil_mode,
                verdict(p.validate())
            )
        }
        3 => {
            let p = AvgPool2dParams {
                batch: r.range(0, 2),
                channels: r.range(0, 2),
                input: [r.range(0, 6), r.range(1, 6)],
                kernel: [r.range(0, 4), r.range(1, 4)],
                stride: [r.range(0, 3), r.range(1, 3)],
                padding: [r.range(0, 2), r.range(0, 2)],
                ceil_mode: r.below(2) == 0,
                count_include_pad: r.below(2) == 0,
                divisor_override: [None, Some(0), Some(2)][r.below(3)],
            };
            format!(
                "{{\"op\":\"avg_pool2d_args\",\"x_shape\":[{},{},{},{}],\"kernel\":{:?},\"stride\":{:?},\"padding\":{:?},\"ceil_mode\":{},\
                 \"count_include_pad\":{},\"divisor_override\":{},{}}}",
                p.batch,
                p.channels,
                p.input[0],
                p.input[1],
                p.kernel,
                p.stride,
                p.padding,
                p.ceil_mode,
                p.count_include_pad,
                p.divisor_override.map_or("null".into(), |d| d.to_string()),
                verdict(p.validate())
            )
        }
        _ => {
            let p = InterpParams {
                batch: r.range(0, 2),
                channels: r.range(0, 2),
                input: [r.range(0, 4), r.range(1, 4)],
                output: [r.range(0, 4), r.range(1, 4)],
                mode: InterpMode::Bilinear { align_corners: false },
                scales: [None, None],
            };
            format!(
                "{{\"op\":\"interpolate_args\",\"x_shape\":[{},{},{},{}],\"size\":{:?},{}}}",
                p.batch,
                p.channels,
                p.input[0],
                p.input[1],
                p.output,
                verdict(p.validate())
            )
        }
    }
}

fn main() -> std::process::ExitCode {
    common::run_suite(trials![host_nn_agrees_with_pytorch])
}

fn host_nn_agrees_with_pytorch() -> Ran {
    let Ok(py) = std::env::var("KILN_TORCH_PYTHON") else {
        return Err(common::skip("KILN_TORCH_PYTHON is not set (a Python with torch; scripts/host-nn-torch.sh uses /tmp/kiln-torch)"));
    };
    match Command::new(&py).args(["-c", "import torch"]).output() {
        Ok(o) if o.status.success() => {}
        Ok(_) => return Err(common::skip(format!("{py} cannot import torch"))),
        Err(e) => return Err(common::skip(format!("cannot run {py}: {e}"))),
    }
    let per_op: usize = std::env::var("KILN_TORCH_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let seed: u64 = std::env::var("KILN_TORCH_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    type Gen = fn(&mut Rng, &str, usize) -> Case;
    let ops: [(Gen, Gen); 8] = [
        (conv_case::<f32>, conv_case::<f64>),
        (transpose_case::<f32>, transpose_case::<f64>),
        (max_pool_case::<f32>, max_pool_case::<f64>),
        (avg_pool_case::<f32>, avg_pool_case::<f64>),
        (adaptive_case::<f32>, adaptive_case::<f64>),
        (batch_norm_case::<f32>, batch_norm_case::<f64>),
        (layer_norm_case::<f32>, layer_norm_case::<f64>),
        (interp_case::<f32>, interp_case::<f64>),
    ];
    let mut lines = String::new();
    for (i, (f32_case, f64_case)) in ops.iter().enumerate() {
        for k in 0..per_op {
            let threads = 1 + k % 2;
            let line = if k % 2 == 0 { f32_case(&mut r, "f32", threads) } else { f64_case(&mut r, "f64", threads) };
            let line = line.unwrap_or_else(|e| panic!("op {i} case {k}: kiln refused valid arguments: {e}"));
            let _ = writeln!(lines, "{line}");
        }
    }
    for _ in 0..per_op * 3 {
        let _ = writeln!(lines, "{}", refusal_case(&mut r));
    }
    let keep = std::env::var("KILN_TORCH_KEEP").ok();
    let path = match &keep {
        Some(p) => std::path::PathBuf::from(p),
        None => std::env::temp_dir().join(format!("kiln-host-nn-torch-{}.jsonl", std::process::id())),
    };
    std::fs::write(&path, lines).expect("write the cases");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/host_nn_torch.py");
    let out = Command::new(&py).arg(script).arg(&path).output().expect("run the PyTorch comparer");
    if keep.is_none() {
        let _ = std::fs::remove_file(&path);
    }
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{report}");
    assert!(out.status.success(), "kiln's host_nn kernels and PyTorch differ:\n{report}");
    Ok(())
}
