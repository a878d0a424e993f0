//! Every op on random arguments, valid or not, tiny or huge: an error or a
//! result, never a panic, an overflow or an impossible allocation.

use super::{to, Rng};
use crate::host_nn::*;

/// A size: usually small, sometimes 0, sometimes enormous.
fn size(r: &mut Rng) -> usize {
    match r.below(90) {
        0 => 0,
        1 => usize::MAX,
        2 => usize::MAX / 3,
        3 => 1 << 33,
        4 => 1 << 20,
        _ => r.range(1, 6),
    }
}

fn pair(r: &mut Rng) -> [usize; 2] {
    [size(r), size(r)]
}

/// Runs `f` with buffers of the lengths asked for when they are small, else
/// with one-element buffers (which the op must refuse).
fn buffers(lens: &[usize]) -> Vec<Vec<f32>> {
    let small = lens.iter().all(|&l| l <= 1 << 16);
    lens.iter().map(|&l| if small { vec![0.5; l] } else { vec![0.5; 1] }).collect()
}

#[test]
fn no_op_panics_on_random_arguments() {
    let mut r = Rng(99);
    let mut ran = [0usize; 7];
    for case in 0..20000 {
        let threads = 1 + case % 3;
        ran[case % 7] += 1;
        match case % 7 {
            0 => {
                let p = Conv2dParams {
                    batch: size(&mut r),
                    in_channels: size(&mut r),
                    out_channels: size(&mut r),
                    input: pair(&mut r),
                    kernel: pair(&mut r),
                    stride: pair(&mut r),
                    padding: Padding2d { top: size(&mut r), bottom: size(&mut r), left: size(&mut r), right: size(&mut r) },
                    dilation: pair(&mut r),
                    groups: size(&mut r),
                };
                let Ok(out) = p.validate() else {
                    {
                        ran[case % 7] -= 1;
                        continue;
                    }
                };
                let lens = [p.input_shape().iter().product(), p.weight_shape().iter().product(), out.iter().product(), p.out_channels];
                let mut b = buffers(&lens);
                let (x, w, mut y, bias) = (b[0].clone(), b[1].clone(), std::mem::take(&mut b[2]), b[3].clone());
                let ok = conv2d_forward(&p, &x, &w, Some(&bias), &mut y, threads).is_ok();
                let (mut gx, mut gw, mut gb) = (x.clone(), w.clone(), bias.clone());
                let _ = conv2d_backward(&p, &x, &w, &y, Some(&mut gx), Some(&mut gw), Some(&mut gb), threads);
                assert!(ok || lens.iter().any(|&l| l > 1 << 16) || p.dilation.iter().any(|&d| d > 1 << 20), "{p:?} refused");
            }
            1 => {
                let p = ConvTranspose2dParams {
                    batch: size(&mut r),
                    in_channels: size(&mut r),
                    out_channels: size(&mut r),
                    input: pair(&mut r),
                    kernel: pair(&mut r),
                    stride: pair(&mut r),
                    padding: pair(&mut r),
                    output_padding: pair(&mut r),
                    dilation: pair(&mut r),
                    groups: size(&mut r),
                };
                let Ok(out) = p.validate() else {
                    {
                        ran[case % 7] -= 1;
                        continue;
                    }
                };
                let lens = [p.input_shape().iter().product(), p.weight_shape().iter().product(), out.iter().product()];
                let b = buffers(&lens);
                let mut y = b[2].clone();
                let _ = conv_transpose2d_forward(&p, &b[0], &b[1], None, &mut y, threads);
                let (mut gx, mut gw) = (b[0].clone(), b[1].clone());
                let _ = conv_transpose2d_backward(&p, &b[0], &b[1], &y, Some(&mut gx), Some(&mut gw), None, threads);
            }
            2 => {
                let kernel = pair(&mut r);
                let p = MaxPool2dParams {
                    batch: size(&mut r),
                    channels: size(&mut r),
                    input: pair(&mut r),
                    kernel,
                    stride: pair(&mut r),
                    padding: [r.below(kernel[0].min(8) / 2 + 2), r.below(kernel[1].min(8) / 2 + 2)],
                    dilation: pair(&mut r),
                    ceil_mode: r.below(2) == 0,
                };
                let Ok(out) = p.validate() else {
                    {
                        ran[case % 7] -= 1;
                        continue;
                    }
                };
                let lens = [p.batch * p.channels * p.input[0] * p.input[1], out.iter().product()];
                let b = buffers(&lens);
                let (mut y, mut idx) = (b[1].clone(), vec![0i64; b[1].len()]);
                let _ = max_pool2d_forward(&p, &b[0], &mut y, &mut idx, threads);
                let mut gx = b[0].clone();
                let _ = max_pool2d_backward(&p, &y, &idx, &mut gx, threads);
            }
            3 => {
                let kernel = pair(&mut r);
                let p = AvgPool2dParams {
                    batch: size(&mut r),
                    channels: size(&mut r),
                    input: pair(&mut r),
                    kernel,
                    stride: pair(&mut r),
                    padding: [r.below(kernel[0].min(8) / 2 + 2), r.below(kernel[1].min(8) / 2 + 2)],
                    ceil_mode: r.below(2) == 0,
                    count_include_pad: r.below(2) == 0,
                    divisor_override: [None, Some(0), Some(-3), Some(i64::MIN)][r.below(4)],
                };
                let Ok(out) = p.validate() else {
                    {
                        ran[case % 7] -= 1;
                        continue;
                    }
                };
                let lens = [p.batch * p.channels * p.input[0] * p.input[1], out.iter().product()];
                let b = buffers(&lens);
                let mut y = b[1].clone();
                let _ = avg_pool2d_forward(&p, &b[0], &mut y, threads);
                let mut gx = b[0].clone();
                let _ = avg_pool2d_backward(&p, &y, &mut gx, threads);
                let q = AdaptivePool2dParams { batch: p.batch, channels: p.channels, input: p.input, output: p.kernel };
                if let Ok(out) = q.validate() {
                    let b = buffers(&[q.batch * q.channels * q.input[0] * q.input[1], out.iter().product()]);
                    let mut y = b[1].clone();
                    let _ = adaptive_avg_pool2d_forward(&q, &b[0], &mut y, threads);
                    let mut gx = b[0].clone();
                    let _ = adaptive_avg_pool2d_backward(&q, &y, &mut gx, threads);
                }
            }
            4 => {
                let p = InterpParams {
                    batch: size(&mut r),
                    channels: size(&mut r),
                    input: pair(&mut r),
                    output: pair(&mut r),
                    mode: [
                        InterpMode::Nearest,
                        InterpMode::Bilinear { align_corners: true },
                        InterpMode::Bilinear { align_corners: false },
                    ][r.below(3)],
                    scales: [[None, Some(0.0), Some(-1.0), Some(f64::NAN), Some(1e30)][r.below(5)], None],
                };
                let Ok(out) = p.validate() else {
                    {
                        ran[case % 7] -= 1;
                        continue;
                    }
                };
                let b = buffers(&[p.batch * p.channels * p.input[0] * p.input[1], out.iter().product()]);
                let mut y = b[1].clone();
                let _ = interpolate_forward(&p, &b[0], &mut y, threads);
                let mut gx = b[0].clone();
                let _ = interpolate_backward(&p, &y, &mut gx, threads);
            }
            5 => {
                let p = BatchNormParams {
                    batch: size(&mut r),
                    channels: size(&mut r),
                    spatial: size(&mut r),
                    eps: [1e-5, 0.0, -1.0, f64::NAN][r.below(4)],
                };
                let training = r.below(2) == 0;
                let Ok(len) = p.validate(training) else {
                    {
                        ran[case % 7] -= 1;
                        continue;
                    }
                };
                let b = buffers(&[len, p.channels]);
                let (x, c) = (&b[0], &b[1]);
                let (mut y, mut m, mut v, mut var) = (x.clone(), c.clone(), c.clone(), c.clone());
                let _ = batch_norm_train_forward(&p, x, Some(c), Some(c), &mut y, &mut m, &mut v, Some(&mut var), threads);
                let (mut rm, mut rv) = (c.clone(), c.clone());
                let _ = batch_norm_update_running(&p, &m, &var, 0.1, &mut rm, &mut rv);
                let _ = batch_norm_eval_forward(&p, x, &rm, &rv, None, None, &mut y, threads);
                let (mut gx, mut gw, mut gb) = (x.clone(), c.clone(), c.clone());
                let _ = batch_norm_backward(&p, x, &y, Some(c), &m, &v, training, Some(&mut gx), Some(&mut gw), Some(&mut gb), threads);
            }
            _ => {
                let p = LayerNormParams { rows: size(&mut r), features: size(&mut r), eps: 1e-5 };
                let Ok(len) = p.validate() else {
                    {
                        ran[case % 7] -= 1;
                        continue;
                    }
                };
                let b = buffers(&[len, p.features, p.rows]);
                let (mut y, mut m, mut s) = (b[0].clone(), b[2].clone(), b[2].clone());
                let _ = layer_norm_forward(&p, &b[0], Some(&b[1]), None, &mut y, &mut m, &mut s, threads);
                let (mut gx, mut gw, mut gb) = (b[0].clone(), b[1].clone(), b[1].clone());
                let _ = layer_norm_backward(&p, &b[0], &y, Some(&b[1]), Some(&mut gx), Some(&mut gw), Some(&mut gb), threads);
            }
        }
    }
    let _ = to::<f32>(&[]);
    // Enough of each op got past validation to have run.
    assert!(ran.iter().all(|&n| n >= 40), "ops run per kind: {ran:?}");
}
