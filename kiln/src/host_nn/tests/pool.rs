//! Max, average and adaptive average pooling.

use super::{close, fd_check, to, tol, Rng};
use crate::host_nn::reference;
use crate::host_nn::*;

fn random_max(r: &mut Rng) -> MaxPool2dParams {
    loop {
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
            return p;
        }
    }
}

fn random_avg(r: &mut Rng) -> AvgPool2dParams {
    loop {
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
            divisor_override: [None, None, None, Some(3), Some(-2)][r.below(5)],
        };
        if p.validate().is_ok() {
            return p;
        }
    }
}

/// Values with ties, −∞ and NaN now and then.
fn edgy(r: &mut Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| match r.below(20) {
            0 => f64::NAN,
            1 => f64::NEG_INFINITY,
            2..=7 => r.below(3) as f64,
            _ => r.unit() * 4.0 - 2.0,
        })
        .collect()
}

fn n4(s: [usize; 4]) -> usize {
    s.iter().product()
}

fn check_max<T: NnFloat>(p: &MaxPool2dParams, r: &mut Rng, threads: usize) {
    let out = p.validate().unwrap();
    let x = edgy(r, p.batch * p.channels * p.input[0] * p.input[1]);
    let x = to::<T>(&x).iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
    let (want, want_idx) = reference::max_pool2d(p, &x);
    let (mut y, mut idx) = (vec![T::ZERO; n4(out)], vec![-1i64; n4(out)]);
    max_pool2d_forward(p, &to::<T>(&x), &mut y, &mut idx, threads).unwrap();
    assert_eq!(idx, want_idx, "indices of {p:?}");
    for (i, (&g, &w)) in y.iter().zip(&want).enumerate() {
        assert!(g.to_f64() == w || (g.is_nan() && w.is_nan()), "{p:?}: output {i} is {g:?}, expected {w}");
    }
    let dy = r.vals(n4(out));
    let mut gx = vec![T::from_f64(f64::NAN); x.len()];
    max_pool2d_backward(p, &to::<T>(&dy), &idx, &mut gx, threads).unwrap();
    let mut want_gx = vec![0.0; x.len()];
    let plane = p.input[0] * p.input[1];
    for (o, &i) in want_idx.iter().enumerate() {
        if (i as usize) < plane {
            want_gx[o / (out[2] * out[3]) * plane + i as usize] += dy[o];
        }
    }
    close(&gx, &want_gx, tol::<T>(), &format!("max_pool2d backward of {p:?}"));
}

#[test]
fn max_pool2d_matches_the_definition() {
    let mut r = Rng(3);
    for case in 0..500 {
        let p = random_max(&mut r);
        check_max::<f64>(&p, &mut r, 1 + case % 3);
        check_max::<f32>(&p, &mut r, 1 + case % 3);
    }
}

#[test]
fn avg_pool2d_matches_the_definition() {
    let mut r = Rng(4);
    for case in 0..500 {
        let p = random_avg(&mut r);
        let out = p.validate().unwrap();
        let (x, dy) = (r.vals(p.batch * p.channels * p.input[0] * p.input[1]), r.vals(n4(out)));
        let (want, want_gx) = reference::avg_pool2d(&p, &x, &dy);
        let threads = 1 + case % 3;
        let mut y = vec![f64::NAN; n4(out)];
        avg_pool2d_forward(&p, &x, &mut y, threads).unwrap();
        close(&y, &want, tol::<f64>(), &format!("avg_pool2d of {p:?}"));
        let mut gx = vec![f64::NAN; x.len()];
        avg_pool2d_backward(&p, &dy, &mut gx, threads).unwrap();
        close(&gx, &want_gx, tol::<f64>(), &format!("avg_pool2d backward of {p:?}"));
        let mut y32 = vec![f32::NAN; n4(out)];
        avg_pool2d_forward(&p, &to::<f32>(&x), &mut y32, threads).unwrap();
        close(&y32, &want, tol::<f32>(), &format!("avg_pool2d f32 of {p:?}"));
    }
}

#[test]
fn adaptive_avg_pool2d_matches_the_definition() {
    let mut r = Rng(5);
    for case in 0..300 {
        let input = [r.range(1, 9), r.range(1, 9)];
        let p = AdaptivePool2dParams {
            batch: r.pick(&[0, 1, 2]),
            channels: r.pick(&[0, 1, 2, 3]),
            input,
            output: [r.range(0, input[0] + 3), r.range(1, input[1] + 3)],
        };
        let out = p.validate().unwrap();
        let (x, dy) = (r.vals(p.batch * p.channels * input[0] * input[1]), r.vals(n4(out)));
        let (want, want_gx) = reference::adaptive_avg_pool2d(&p, &x, &dy);
        let mut y = vec![f64::NAN; n4(out)];
        adaptive_avg_pool2d_forward(&p, &x, &mut y, 1 + case % 2).unwrap();
        close(&y, &want, tol::<f64>(), &format!("adaptive_avg_pool2d of {p:?}"));
        let mut gx = vec![f64::NAN; x.len()];
        adaptive_avg_pool2d_backward(&p, &dy, &mut gx, 1 + case % 2).unwrap();
        close(&gx, &want_gx, tol::<f64>(), &format!("adaptive_avg_pool2d backward of {p:?}"));
    }
}

#[test]
fn pooling_gradients_match_finite_differences() {
    let mut r = Rng(6);
    for _ in 0..60 {
        let p = random_max(&mut r);
        let out = p.validate().unwrap();
        // Distinct values: the maximum of each window is unique and stays so.
        let x: Vec<f64> = (0..p.batch * p.channels * p.input[0] * p.input[1]).map(|_| r.unit() * 4.0 - 2.0).collect();
        let m = r.vals(n4(out));
        let forward = |x: &[f64]| {
            let (mut y, mut i) = (vec![0.0; n4(out)], vec![0; n4(out)]);
            max_pool2d_forward(&p, x, &mut y, &mut i, 1).unwrap();
            (y, i)
        };
        let (_, idx) = forward(&x);
        let mut gx = vec![0.0; x.len()];
        max_pool2d_backward(&p, &m, &idx, &mut gx, 1).unwrap();
        // Empty windows are −∞ and carry no gradient: leave them out of the loss.
        let (y0, _) = forward(&x);
        let mut gx = vec![0.0; x.len()];
        let m: Vec<f64> = m.iter().zip(&y0).map(|(&m, y)| if y.is_finite() { m } else { 0.0 }).collect();
        max_pool2d_backward(&p, &m, &idx, &mut gx, 1).unwrap();
        fd_check(&x, &gx, |x| forward(x).0.iter().zip(&m).filter(|&(_, &m)| m != 0.0).map(|(a, b)| a * b).sum(), &format!("{p:?}"));

        let q = random_avg(&mut r);
        let out = q.validate().unwrap();
        let x = r.vals(q.batch * q.channels * q.input[0] * q.input[1]);
        let m = r.vals(n4(out));
        let mut gx = vec![0.0; x.len()];
        avg_pool2d_backward(&q, &m, &mut gx, 1).unwrap();
        fd_check(
            &x,
            &gx,
            |x| {
                let mut y = vec![0.0; n4(out)];
                avg_pool2d_forward(&q, x, &mut y, 1).unwrap();
                y.iter().zip(&m).map(|(a, b)| a * b).sum()
            },
            &format!("{q:?}"),
        );
    }
}

#[test]
fn pooling_refuses_what_pytorch_refuses() {
    let ok = MaxPool2dParams {
        batch: 1,
        channels: 3,
        input: [5, 5],
        kernel: [2, 2],
        stride: [2, 2],
        padding: [1, 1],
        dilation: [1, 1],
        ceil_mode: false,
    };
    assert_eq!(ok.validate().unwrap(), [1, 3, 3, 3]);
    let err = |p: MaxPool2dParams| p.validate().unwrap_err().to_string();
    assert!(err(MaxPool2dParams { kernel: [0, 2], ..ok }).contains("kernel_size must be positive"));
    assert!(err(MaxPool2dParams { stride: [0, 2], ..ok }).contains("stride must be positive"));
    assert!(err(MaxPool2dParams { dilation: [0, 1], ..ok }).contains("dilation must be positive"));
    assert!(err(MaxPool2dParams { padding: [2, 1], ..ok }).contains("at most half"));
    assert!(err(MaxPool2dParams { kernel: [3, 3], dilation: [2, 2], padding: [2, 2], ..ok }).contains("at most half"));
    assert!(err(MaxPool2dParams { input: [1, 5], kernel: [3, 3], padding: [0, 0], ..ok }).contains("smaller than 1"));
    assert!(err(MaxPool2dParams { channels: 0, ..ok }).contains("only the batch may be 0"));
    assert!(err(MaxPool2dParams { input: [0, 5], ..ok }).contains("only the batch may be 0"));
    assert!(err(MaxPool2dParams { batch: usize::MAX / 4, ..ok }).contains("too many"));
    assert_eq!(MaxPool2dParams { batch: 0, ..ok }.validate().unwrap(), [0, 3, 3, 3]);
    // PyTorch's ceil_mode: a last window must start inside the input or the left padding.
    assert_eq!(
        MaxPool2dParams { input: [5, 5], kernel: [2, 2], stride: [2, 2], padding: [0, 0], ceil_mode: true, ..ok }.validate().unwrap()[2],
        3
    );
    assert_eq!(
        MaxPool2dParams { input: [6, 6], kernel: [3, 3], stride: [2, 2], padding: [1, 1], ceil_mode: true, ..ok }.validate().unwrap()[2],
        4
    );
    let avg = AvgPool2dParams {
        batch: 1,
        channels: 1,
        input: [4, 4],
        kernel: [2, 2],
        stride: [2, 2],
        padding: [0, 0],
        ceil_mode: false,
        count_include_pad: true,
        divisor_override: Some(0),
    };
    assert!(avg.validate().unwrap_err().to_string().contains("divisor_override"));
    let ad = AdaptivePool2dParams { batch: 1, channels: 1, input: [0, 3], output: [2, 2] };
    assert!(ad.validate().is_err());
    // An index outside the plane adds nothing (and never writes out of bounds).
    let mut gx = [0f32; 75];
    max_pool2d_backward(&ok, &[1f32; 27], &[99i64; 27], &mut gx, 1).unwrap();
    assert!(gx.iter().all(|&g| g == 0.0));
}
