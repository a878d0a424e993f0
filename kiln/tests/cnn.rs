//! The convolutional-network ops on every device (the CPU, two simulated
//! GPUs, every CUDA device): forward values and gradients against PyTorch
//! (reference values from scripts/cnn_refs.py, in f64 and f32), f64
//! finite-difference gradient checks, and the arguments PyTorch refuses.

mod common;

use common::on_every_device;
use kiln::{Conv2dArgs, DType, Device, Error, Pool2dArgs, Result, Tensor};

include!("common/cnn_refs.rs");

/// PyTorch script's `seq`: ((i·a) mod m − s)/d.
fn seq(n: usize, a: usize, m: usize, s: f64, d: f64) -> Vec<f64> {
    (0..n).map(|i| (((i * a) % m) as f64 - s) / d).collect()
}

fn t(v: Vec<f64>, dims: &[usize], dtype: DType, d: Device) -> Result<Tensor> {
    Tensor::from_vec(v, dims.to_vec(), &d)?.to_dtype(dtype)
}

#[track_caller]
fn close(got: &Tensor, want: &[f64], tol: f64, what: &str) {
    let g = got.to_vec_f64().unwrap();
    assert_eq!(g.len(), want.len(), "{what}: length");
    for (i, (a, b)) in g.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{what}[{i}]: got {a}, want {b} (on {})", got.device());
    }
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        1e-10
    } else {
        2e-5
    }
}

/// Seeds the backward of `y` with the script's output gradient.
fn backward(y: &Tensor) -> Result<()> {
    let gy = Tensor::from_vec(seq(y.elem_count(), 3, 17, 8.0, 8.0), y.dims().to_vec(), &y.device())?.to_dtype(y.dtype())?;
    (y * &gy)?.sum_all()?.backward()
}

#[test]
fn conv2d_matches_pytorch_with_stride_padding_dilation_groups_and_bias() {
    on_every_device(|d| {
        for dtype in [DType::F64, DType::F32] {
            let x = t(seq(240, 7, 11, 5.0, 4.0), &[2, 4, 5, 6], dtype, d)?.requires_grad_();
            let w = t(seq(72, 5, 13, 6.0, 5.0), &[6, 2, 3, 2], dtype, d)?.requires_grad_();
            let b = t(seq(6, 3, 7, 3.0, 2.0), &[6], dtype, d)?.requires_grad_();
            let y = x.conv2d(&w, Some(&b), Conv2dArgs::default().stride([2, 1]).padding([2, 1]).dilation([1, 2]).groups(2))?;
            assert_eq!(y.dims(), &[2, 6, 4, 6]);
            close(&y, CONV_Y, tol(dtype), "conv y");
            backward(&y)?;
            close(&x.grad().unwrap(), CONV_GX, tol(dtype), "conv dx");
            close(&w.grad().unwrap(), CONV_GW, tol(dtype), "conv dw");
            close(&b.grad().unwrap(), CONV_GB, tol(dtype), "conv db");
            // padding="same" with an even kernel and dilation.
            let x2 = t(seq(50, 7, 11, 5.0, 4.0), &[1, 2, 5, 5], dtype, d)?;
            let w2 = t(seq(48, 5, 13, 6.0, 5.0), &[3, 2, 2, 4], dtype, d)?;
            let y2 = x2.conv2d(&w2, None, Conv2dArgs::default().same().dilation([2, 1]))?;
            assert_eq!(y2.dims(), &[1, 3, 5, 5]);
            close(&y2, SAME_Y, tol(dtype), "same y");
            // Unbatched input.
            let y3 = x2.squeeze(0)?.conv2d(&w2, None, Conv2dArgs::default().same().dilation([2, 1]))?;
            assert_eq!(y3.dims(), &[3, 5, 5]);
            close(&y3, SAME_Y, tol(dtype), "unbatched y");
        }
        Ok(())
    });
}

#[test]
fn conv_transpose2d_matches_pytorch() {
    on_every_device(|d| {
        for dtype in [DType::F64, DType::F32] {
            let x = t(seq(18, 7, 11, 5.0, 4.0), &[1, 2, 3, 3], dtype, d)?.requires_grad_();
            let w = t(seq(54, 5, 13, 6.0, 5.0), &[2, 3, 3, 3], dtype, d)?.requires_grad_();
            let b = t(seq(3, 3, 7, 3.0, 2.0), &[3], dtype, d)?.requires_grad_();
            let y = x.conv_transpose2d(&w, Some(&b), Conv2dArgs::default().stride(2).padding(1).output_padding(1))?;
            assert_eq!(y.dims(), &[1, 3, 6, 6]);
            close(&y, CONVT_Y, tol(dtype), "convT y");
            backward(&y)?;
            close(&x.grad().unwrap(), CONVT_GX, tol(dtype), "convT dx");
            close(&w.grad().unwrap(), CONVT_GW, tol(dtype), "convT dw");
            close(&b.grad().unwrap(), CONVT_GB, tol(dtype), "convT db");
        }
        Ok(())
    });
}

#[test]
fn pooling_matches_pytorch() {
    on_every_device(|d| {
        for dtype in [DType::F64, DType::F32] {
            let x = t(seq(168, 13, 29, 14.0, 7.0), &[2, 2, 7, 6], dtype, d)?.requires_grad_();
            let y = x.max_pool2d(Pool2dArgs::new(3).stride(2).padding(1).dilation([1, 2]).ceil_mode(true))?;
            assert_eq!(y.dims(), &[2, 2, 4, 3]);
            close(&y, MAX_Y, tol(dtype), "max y");
            backward(&y)?;
            close(&x.grad().unwrap(), MAX_GX, tol(dtype), "max dx");

            let x = t(seq(168, 13, 29, 14.0, 7.0), &[2, 2, 7, 6], dtype, d)?.requires_grad_();
            let y = x.avg_pool2d(Pool2dArgs::new([3, 2]).stride(2).padding(1).ceil_mode(true).count_include_pad(false))?;
            assert_eq!(y.dims(), &[2, 2, 4, 4]);
            close(&y, AVG_Y, tol(dtype), "avg y");
            backward(&y)?;
            close(&x.grad().unwrap(), AVG_GX, tol(dtype), "avg dx");
            close(&x.detach().avg_pool2d(Pool2dArgs::new(3).stride(2).padding(1))?, AVG2_Y, tol(dtype), "avg2 y");

            let x = t(seq(70, 13, 29, 14.0, 7.0), &[1, 2, 7, 5], dtype, d)?.requires_grad_();
            let y = x.adaptive_avg_pool2d([3, 2])?;
            close(&y, ADA_Y, tol(dtype), "adaptive y");
            backward(&y)?;
            close(&x.grad().unwrap(), ADA_GX, tol(dtype), "adaptive dx");
        }
        Ok(())
    });
}

#[test]
fn batch_norm_matches_pytorch_in_training_and_evaluation() {
    on_every_device(|d| {
        for dtype in [DType::F64, DType::F32] {
            let x = t(seq(24, 13, 29, 14.0, 7.0), &[3, 2, 2, 2], dtype, d)?.requires_grad_();
            let w = t(vec![1.5, -0.5], &[2], dtype, d)?.requires_grad_();
            let b = t(vec![0.25, 1.0], &[2], dtype, d)?.requires_grad_();
            let rm = t(vec![0.1, -0.2], &[2], dtype, d)?;
            let rv = t(vec![1.0, 2.0], &[2], dtype, d)?;
            let y = x.batch_norm(Some(&rm), Some(&rv), Some(&w), Some(&b), true, 0.1, 1e-5)?;
            close(&y, BN_Y, tol(dtype), "bn y");
            close(&rm, BN_RM, tol(dtype), "bn running mean");
            close(&rv, BN_RV, tol(dtype), "bn running var");
            backward(&y)?;
            close(&x.grad().unwrap(), BN_GX, tol(dtype) * 10.0, "bn dx");
            close(&w.grad().unwrap(), BN_GW, tol(dtype), "bn dw");
            close(&b.grad().unwrap(), BN_GB, tol(dtype), "bn db");

            let xe = x.detach().requires_grad_();
            let ye = xe.batch_norm(Some(&rm), Some(&rv), Some(&w.detach()), Some(&b.detach()), false, 0.1, 1e-5)?;
            close(&ye, BNE_Y, tol(dtype), "bn eval y");
            close(&rm, BN_RM, tol(dtype), "eval leaves the running mean");
            backward(&ye)?;
            close(&xe.grad().unwrap(), BNE_GX, tol(dtype), "bn eval dx");
        }
        Ok(())
    });
}

#[test]
fn layer_norm_matches_pytorch() {
    on_every_device(|d| {
        for dtype in [DType::F64, DType::F32] {
            let x = t(seq(24, 13, 29, 14.0, 7.0), &[2, 3, 4], dtype, d)?.requires_grad_();
            let w = t(seq(12, 5, 13, 6.0, 5.0), &[3, 4], dtype, d)?.requires_grad_();
            let b = t(seq(12, 3, 7, 3.0, 2.0), &[3, 4], dtype, d)?.requires_grad_();
            let y = x.layer_norm(&[3, 4], Some(&w), Some(&b), 1e-5)?;
            close(&y, LN_Y, tol(dtype), "ln y");
            backward(&y)?;
            close(&x.grad().unwrap(), LN_GX, tol(dtype) * 10.0, "ln dx");
            close(&w.grad().unwrap(), LN_GW, tol(dtype), "ln dw");
            close(&b.grad().unwrap(), LN_GB, tol(dtype), "ln db");
        }
        Ok(())
    });
}

/// Batch norm at its edges, as PyTorch: training on an empty batch leaves the
/// running statistics as they were (its mean and variance would be 0/0),
/// and training refuses eps = 0 (evaluation takes it).
#[test]
fn batch_norm_on_an_empty_batch_keeps_the_running_statistics_and_training_refuses_eps_zero() {
    on_every_device(|d| {
        for dtype in [DType::F32, DType::F64] {
            let rm = t(vec![0.5, -1.0], &[2], dtype, d)?;
            let rv = t(vec![2.0, 3.0], &[2], dtype, d)?;
            for dims in [&[0usize, 2, 3, 3][..], &[0, 2], &[0, 2, 5]] {
                let x = Tensor::zeros(dims.to_vec(), dtype, &d)?.requires_grad_();
                let y = x.batch_norm(Some(&rm), Some(&rv), None, None, true, 0.1, 1e-5)?;
                assert_eq!(y.dims(), dims);
                y.sum_all()?.backward()?;
                assert_eq!(rm.to_vec_f64()?, vec![0.5, -1.0], "running mean after an empty batch {dims:?} on {d}");
                assert_eq!(rv.to_vec_f64()?, vec![2.0, 3.0], "running var after an empty batch {dims:?} on {d}");
            }
            let x = t(vec![1.0, 2.0, 3.0, 5.0], &[2, 2], dtype, d)?;
            invalid(x.batch_norm(Some(&rm), Some(&rv), None, None, true, 0.1, 0.0), &["eps", "positive"]);
            assert_eq!(rm.to_vec_f64()?, vec![0.5, -1.0], "a refused call leaves the statistics");
            let y = x.batch_norm(Some(&rm), Some(&rv), None, None, false, 0.1, 0.0)?;
            close(
                &y,
                &[(1.0 - 0.5) / 2f64.sqrt(), 3.0 / 3f64.sqrt(), (3.0 - 0.5) / 2f64.sqrt(), 6.0 / 3f64.sqrt()],
                tol(dtype),
                "bn eval eps 0",
            );
        }
        Ok(())
    });
}

/// Central differences of `Σ f(inputs)·gy` against the analytic gradient of
/// every input, in f64.
fn finite_differences(d: Device, shapes: &[&[usize]], f: impl Fn(&[Tensor]) -> Result<Tensor>) -> Result<()> {
    let values: Vec<Vec<f64>> =
        shapes.iter().enumerate().map(|(k, s)| seq(s.iter().product(), 7 + 2 * k, 23, 11.0, 6.0 + k as f64)).collect();
    let make = |vals: &[Vec<f64>], grad: bool| -> Result<Vec<Tensor>> {
        vals.iter()
            .zip(shapes)
            .map(|(v, s)| {
                let x = Tensor::from_vec(v.clone(), s.to_vec(), &d)?;
                Ok(if grad { x.requires_grad_() } else { x })
            })
            .collect()
    };
    let ins = make(&values, true)?;
    let y = f(&ins)?;
    let gy = seq(y.elem_count(), 3, 17, 8.0, 8.0);
    let gyt = Tensor::from_vec(gy.clone(), y.dims().to_vec(), &d)?;
    (&y * &gyt)?.sum_all()?.backward()?;
    let loss = |vals: &[Vec<f64>]| -> Result<f64> {
        let _g = kiln::no_grad();
        let y = f(&make(vals, false)?)?.to_vec_f64()?;
        Ok(y.iter().zip(&gy).map(|(a, b)| a * b).sum())
    };
    let h = 1e-6;
    for (k, x) in ins.iter().enumerate() {
        let analytic = x.grad().map(|g| g.to_vec_f64()).transpose()?.unwrap_or_else(|| vec![0.0; x.elem_count()]);
        for i in 0..x.elem_count() {
            let mut vals = values.clone();
            vals[k][i] += h;
            let up = loss(&vals)?;
            vals[k][i] -= 2.0 * h;
            let down = loss(&vals)?;
            let numeric = (up - down) / (2.0 * h);
            assert!(
                (numeric - analytic[i]).abs() <= 1e-5 * (1.0 + numeric.abs()),
                "input {k} element {i} on {d}: numeric {numeric}, analytic {}",
                analytic[i]
            );
        }
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    on_every_device(|d| {
        let args = Conv2dArgs::default().stride([1, 2]).padding([1, 2]).dilation([2, 1]).groups(2);
        finite_differences(d, &[&[2, 2, 4, 5], &[4, 1, 2, 3], &[4]], |v| v[0].conv2d(&v[1], Some(&v[2]), args))?;
        let targs = Conv2dArgs::default().stride(2).padding(1).output_padding([1, 0]).groups(2);
        finite_differences(d, &[&[1, 2, 3, 2], &[2, 2, 3, 2]], |v| v[0].conv_transpose2d(&v[1], None, targs))?;
        finite_differences(d, &[&[1, 2, 5, 5]], |v| v[0].max_pool2d(Pool2dArgs::new(2).stride(2).padding(1).ceil_mode(true)))?;
        finite_differences(d, &[&[1, 2, 5, 5]], |v| v[0].avg_pool2d(Pool2dArgs::new(3).stride(2).padding(1).count_include_pad(false)))?;
        finite_differences(d, &[&[1, 2, 5, 4]], |v| v[0].adaptive_avg_pool2d([2, 3]))?;
        finite_differences(d, &[&[3, 2, 2, 1], &[2], &[2]], |v| v[0].batch_norm(None, None, Some(&v[1]), Some(&v[2]), true, 0.1, 1e-5))?;
        finite_differences(d, &[&[3, 4], &[4], &[4]], |v| v[0].batch_norm(None, None, Some(&v[1]), Some(&v[2]), true, 0.1, 1e-5))?;
        finite_differences(d, &[&[2, 2, 3], &[2, 3], &[2, 3]], |v| v[0].layer_norm(&[2, 3], Some(&v[1]), Some(&v[2]), 1e-5))?;
        Ok(())
    });
}

/// `conv_transpose2d` as its definition reads: every input element
/// scatters `x · w` into the output, in f64.
#[allow(clippy::too_many_arguments)]
fn conv_transpose_reference(
    x: &[f64],
    xd: [usize; 4],
    w: &[f64],
    wd: [usize; 4],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    output_padding: [usize; 2],
    groups: usize,
) -> (Vec<f64>, [usize; 4]) {
    let [n, c, h, wi] = xd;
    let [_, ocg, kh, kw] = wd;
    let icg = c / groups;
    let size = |i: usize, k: usize| {
        ((xd[2 + i] - 1) * stride[i] + dilation[i] * (k - 1) + output_padding[i] + 1) as isize - 2 * padding[i] as isize
    };
    let (oh, ow) = (size(0, kh) as usize, size(1, kw) as usize);
    let od = [n, ocg * groups, oh, ow];
    let mut y = vec![0.0; od.iter().product()];
    for b in 0..n {
        for ic in 0..c {
            let g = ic / icg;
            for iy in 0..h {
                for ix in 0..wi {
                    let v = x[((b * c + ic) * h + iy) * wi + ix];
                    for ocl in 0..ocg {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let oy = (iy * stride[0] + ky * dilation[0]) as isize - padding[0] as isize;
                                let ox = (ix * stride[1] + kx * dilation[1]) as isize - padding[1] as isize;
                                if oy < 0 || ox < 0 || oy >= oh as isize || ox >= ow as isize {
                                    continue;
                                }
                                let oc = g * ocg + ocl;
                                y[((b * od[1] + oc) * oh + oy as usize) * ow + ox as usize] +=
                                    v * w[((ic * ocg + ocl) * kh + ky) * kw + kx];
                            }
                        }
                    }
                }
            }
        }
    }
    (y, od)
}

/// output_padding may reach max(stride, dilation) − 1 (PyTorch allows it
/// while it is below the stride or the dilation): then the input is smaller
/// than the window count of the convolution being transposed. Every value
/// from 0 up, with groups and dilation, on every device, forward against the
/// definition and gradients against finite differences.
#[test]
fn conv_transpose2d_takes_every_output_padding_below_the_stride_or_the_dilation() {
    on_every_device(|d| {
        // The case a held-out test found (PyTorch's output begins −2, −1, −6, −3, 0, 0, 2, 0, 6).
        let x = Tensor::from_vec(vec![2f64, 1., 0., -2.], (1, 1, 2, 2), &d)?;
        let w = Tensor::from_vec(vec![-1f64, -3., -3., -3.], (1, 1, 2, 2), &d)?;
        let y = x.conv_transpose2d(&w, None, Conv2dArgs::default().dilation(2).output_padding(1))?;
        assert_eq!(y.dims(), &[1, 1, 5, 5]);
        assert_eq!(&y.to_vec::<f64>()?[..9], &[-2., -1., -6., -3., 0., 0., 2., 0., 6.], "on {d}");
        let mut cases = 0;
        for (stride, dilation, groups, padding) in
            [([1, 1], [2, 3], 1, [0, 0]), ([2, 1], [1, 3], 2, [1, 0]), ([3, 2], [2, 2], 1, [1, 1]), ([1, 2], [3, 1], 2, [0, 1])]
        {
            for op0 in 0..stride[0].max(dilation[0]) {
                for op1 in 0..stride[1].max(dilation[1]) {
                    let (xd, wd) = ([2, 2 * groups, 3, 2], [2 * groups, 2, 2, 3]);
                    let xv = seq(xd.iter().product(), 7, 11, 5.0, 4.0);
                    let wv = seq(wd.iter().product(), 5, 13, 6.0, 5.0);
                    let args =
                        Conv2dArgs::default().stride(stride).dilation(dilation).groups(groups).padding(padding).output_padding([op0, op1]);
                    let (want, od) = conv_transpose_reference(&xv, xd, &wv, wd, stride, padding, dilation, [op0, op1], groups);
                    for dtype in [DType::F64, DType::F32] {
                        let xt = t(xv.clone(), &xd, dtype, d)?;
                        let wt = t(wv.clone(), &wd, dtype, d)?;
                        let y = xt.conv_transpose2d(&wt, None, args)?;
                        assert_eq!(y.dims(), &od, "{args:?} on {d}");
                        close(&y, &want, tol(dtype), &format!("conv_transpose2d {args:?}"));
                    }
                    if op0 + 1 == stride[0].max(dilation[0]) && op1 + 1 == stride[1].max(dilation[1]) {
                        // The largest output_padding: the input is smallest against the windows.
                        finite_differences(d, &[&xd, &wd], |v| v[0].conv_transpose2d(&v[1], None, args))?;
                    }
                    cases += 1;
                }
            }
        }
        assert_eq!(cases, 6 * 4);
        // At the stride and the dilation both, it is refused, naming them.
        let x = Tensor::zeros((1, 1, 2, 2), DType::F32, &d)?;
        let w = Tensor::zeros((1, 1, 2, 2), DType::F32, &d)?;
        invalid(
            x.conv_transpose2d(&w, None, Conv2dArgs::default().stride(2).dilation(2).output_padding(2)),
            &["output_padding", "stride", "dilation"],
        );
        Ok(())
    });
}

fn invalid(r: Result<Tensor>, words: &[&str]) {
    match r {
        Err(Error::InvalidArgument { msg, .. }) => {
            for w in words {
                assert!(msg.contains(w), "{msg:?} should name {w:?}");
            }
        }
        other => panic!("expected InvalidArgument naming {words:?}, got {other:?}"),
    }
}

#[test]
fn bad_arguments_are_invalid_argument_naming_the_argument_and_shapes() {
    on_every_device(|d| {
        let x = Tensor::zeros((1, 4, 5, 5), DType::F32, &d)?;
        let w = Tensor::zeros((6, 2, 3, 3), DType::F32, &d)?;
        invalid(x.conv2d(&w, None, Conv2dArgs::default()), &["channels", "[1, 4, 5, 5]", "[6, 2, 3, 3]"]);
        invalid(x.conv2d(&w, None, Conv2dArgs::default().groups(4)), &["groups"]);
        invalid(x.conv2d(&w, None, Conv2dArgs::default().groups(2).stride(0)), &["stride"]);
        invalid(x.conv2d(&w, None, Conv2dArgs::default().groups(2).dilation(3)), &["kernel", "padded input"]);
        invalid(x.conv2d(&w, None, Conv2dArgs::default().groups(2).same().stride(2)), &["same", "stride"]);
        invalid(x.conv2d(&Tensor::zeros((6, 2, 3), DType::F32, &d)?, None, Conv2dArgs::default()), &["weight", "4-D"]);
        invalid(x.reshape((4, 25))?.conv2d(&w, None, Conv2dArgs::default()), &["input", "[4, 25]"]);
        let b = Tensor::zeros(5, DType::F32, &d)?;
        invalid(x.conv2d(&w, Some(&b), Conv2dArgs::default().groups(2)), &["bias", "[6]"]);
        invalid(x.to_dtype(DType::I64)?.conv2d(&w, None, Conv2dArgs::default()), &["f32 or f64"]);
        invalid(x.max_pool2d(Pool2dArgs::new(3).padding(2)), &["padding", "half"]);
        invalid(x.max_pool2d(Pool2dArgs::new(7)), &["output"]);
        invalid(x.avg_pool2d(Pool2dArgs::new(2).stride(0)), &["stride"]);
        invalid(x.batch_norm(None, None, Some(&b), None, true, 0.1, 1e-5), &["weight", "[4]"]);
        invalid(Tensor::zeros((1, 4), DType::F32, &d)?.batch_norm(None, None, None, None, true, 0.1, 1e-5), &["more than one value"]);
        invalid(x.batch_norm(None, None, None, None, false, 0.1, 1e-5), &["running_mean"]);
        invalid(x.layer_norm(&[4], None, None, 1e-5), &["normalized_shape"]);
        // Empty batches work.
        let e = Tensor::zeros((0, 4, 5, 5), DType::F32, &d)?;
        assert_eq!(e.conv2d(&w, None, Conv2dArgs::default().groups(2))?.dims(), &[0, 6, 3, 3]);
        assert_eq!(e.max_pool2d(Pool2dArgs::new(2))?.dims(), &[0, 4, 2, 2]);
        Ok(())
    });
}

#[test]
fn interpolate_matches_pytorch() {
    on_every_device(|d| {
        for dtype in [DType::F64, DType::F32] {
            for (mode, want_y, want_gx) in [
                (kiln::InterpMode::Nearest, NEAREST_Y, NEAREST_GX),
                (kiln::InterpMode::Bilinear { align_corners: false }, BILINEAR_Y, BILINEAR_GX),
                (kiln::InterpMode::Bilinear { align_corners: true }, BILINEAR_AC_Y, BILINEAR_AC_GX),
            ] {
                let x = t(seq(30, 13, 29, 14.0, 7.0), &[1, 2, 3, 5], dtype, d)?.requires_grad_();
                let y = x.interpolate([5, 4], mode)?;
                assert_eq!(y.dims(), &[1, 2, 5, 4]);
                close(&y, want_y, tol(dtype), &format!("{mode:?} y"));
                backward(&y)?;
                close(&x.grad().unwrap(), want_gx, tol(dtype), &format!("{mode:?} dx"));
            }
        }
        finite_differences(d, &[&[1, 2, 3, 4]], |v| v[0].interpolate([5, 7], kiln::InterpMode::Bilinear { align_corners: false }))?;
        Ok(())
    });
}
