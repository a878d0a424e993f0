//! Convolution and transposed convolution.

use super::{close, to, tol, Rng};
use crate::host_nn::reference;
use crate::host_nn::*;

fn random_conv(r: &mut Rng) -> Conv2dParams {
    loop {
        let groups = r.pick(&[1, 1, 1, 2, 3]);
        let icg = if r.below(15) == 0 { 0 } else { r.range(1, 3) };
        let ocg = r.range(1, 3);
        let kernel = [r.range(1, 4), r.range(1, 4)];
        let stride = [r.pick(&[1, 1, 1, 2, 3]), r.pick(&[1, 1, 1, 2, 3])];
        let dilation = [r.pick(&[1, 1, 1, 2, 3]), r.pick(&[1, 1, 1, 2, 3])];
        let padding = if r.below(2) == 0 {
            Padding2d::symmetric([r.range(0, 4), r.range(0, 4)])
        } else {
            Padding2d { top: r.range(0, 5), bottom: r.range(0, 5), left: r.range(0, 5), right: r.range(0, 5) }
        };
        let p = Conv2dParams {
            batch: r.pick(&[0, 1, 1, 2, 2, 3]),
            in_channels: groups * icg,
            out_channels: groups * ocg,
            input: [r.range(1, 9), r.range(1, 9)],
            kernel,
            stride,
            dilation,
            padding,
            groups,
        };
        if p.validate().is_ok() {
            return p;
        }
    }
}

fn random_transpose(r: &mut Rng) -> ConvTranspose2dParams {
    loop {
        let groups = r.pick(&[1, 1, 1, 2, 3]);
        let stride = [r.pick(&[1, 1, 2, 3]), r.pick(&[1, 1, 2, 3])];
        let dilation = [r.pick(&[1, 1, 2, 3]), r.pick(&[1, 1, 2, 3])];
        let p = ConvTranspose2dParams {
            batch: r.pick(&[0, 1, 1, 2, 3]),
            in_channels: groups * r.range(1, 3),
            out_channels: groups * if r.below(15) == 0 { 0 } else { r.range(1, 3) },
            input: [r.range(1, 7), r.range(1, 7)],
            kernel: [r.range(1, 4), r.range(1, 4)],
            stride,
            padding: [r.range(0, 3), r.range(0, 3)],
            output_padding: [r.below(stride[0].max(dilation[0])), r.below(stride[1].max(dilation[1]))],
            dilation,
            groups,
        };
        if p.validate().is_ok() {
            return p;
        }
    }
}

fn prod(s: [usize; 4]) -> usize {
    s.iter().product()
}

/// Forward and every gradient of `p` in `T` against the reference.
fn check_conv<T: NnFloat>(p: &Conv2dParams, r: &mut Rng, threads: usize) {
    let out = p.validate().unwrap();
    let (x, w, b, dy) = (r.vals(prod(p.input_shape())), r.vals(prod(p.weight_shape())), r.vals(p.out_channels), r.vals(prod(out)));
    let bias = (r.below(2) == 0).then_some(&b[..]);
    let what = format!("{p:?} threads {threads}");
    let mut y = vec![T::from_f64(f64::NAN); prod(out)];
    conv2d_forward(p, &to::<T>(&x), &to::<T>(&w), bias.map(to::<T>).as_deref(), &mut y, threads).unwrap();
    close(&y, &reference::conv2d(p, &x, &w, bias), tol::<T>(), &format!("forward of {what}"));
    let (gx, gw, gb) = reference::conv2d_backward(p, &x, &w, &dy);
    let (mut fx, mut fw, mut fb) =
        (vec![T::from_f64(f64::NAN); x.len()], vec![T::from_f64(f64::NAN); w.len()], vec![T::from_f64(f64::NAN); p.out_channels]);
    conv2d_backward(p, &to::<T>(&x), &to::<T>(&w), &to::<T>(&dy), Some(&mut fx), Some(&mut fw), Some(&mut fb), threads).unwrap();
    close(&fx, &gx, tol::<T>(), &format!("grad input of {what}"));
    close(&fw, &gw, tol::<T>(), &format!("grad weight of {what}"));
    close(&fb, &gb, tol::<T>(), &format!("grad bias of {what}"));
}

fn check_transpose<T: NnFloat>(p: &ConvTranspose2dParams, r: &mut Rng, threads: usize) {
    let out = p.validate().unwrap();
    let (x, w, b, dy) = (r.vals(prod(p.input_shape())), r.vals(prod(p.weight_shape())), r.vals(p.out_channels), r.vals(prod(out)));
    let bias = (r.below(2) == 0).then_some(&b[..]);
    let what = format!("{p:?} threads {threads}");
    let mut y = vec![T::from_f64(f64::NAN); prod(out)];
    conv_transpose2d_forward(p, &to::<T>(&x), &to::<T>(&w), bias.map(to::<T>).as_deref(), &mut y, threads).unwrap();
    close(&y, &reference::conv_transpose2d(p, &x, &w, bias), tol::<T>(), &format!("forward of {what}"));
    let (gx, gw, gb) = reference::conv_transpose2d_backward(p, &x, &w, &dy);
    let (mut fx, mut fw, mut fb) =
        (vec![T::from_f64(f64::NAN); x.len()], vec![T::from_f64(f64::NAN); w.len()], vec![T::from_f64(f64::NAN); p.out_channels]);
    conv_transpose2d_backward(p, &to::<T>(&x), &to::<T>(&w), &to::<T>(&dy), Some(&mut fx), Some(&mut fw), Some(&mut fb), threads).unwrap();
    close(&fx, &gx, tol::<T>(), &format!("grad input of {what}"));
    close(&fw, &gw, tol::<T>(), &format!("grad weight of {what}"));
    close(&fb, &gb, tol::<T>(), &format!("grad bias of {what}"));
}

#[test]
fn conv2d_matches_the_definition_on_random_arguments() {
    let mut r = Rng(0x5eed_c0de);
    for case in 0..400 {
        let p = random_conv(&mut r);
        let threads = [1, 3][case % 2];
        check_conv::<f64>(&p, &mut r, threads);
        check_conv::<f32>(&p, &mut r, threads);
    }
}

#[test]
fn conv_transpose2d_matches_the_definition_on_random_arguments() {
    let mut r = Rng(0x007a_110f_5eed);
    for case in 0..300 {
        let p = random_transpose(&mut r);
        let threads = [1, 3][case % 2];
        check_transpose::<f64>(&p, &mut r, threads);
        check_transpose::<f32>(&p, &mut r, threads);
    }
}

#[allow(clippy::too_many_arguments)]
fn conv(batch: usize, ic: usize, oc: usize, hw: [usize; 2], k: usize, stride: usize, pad: usize, groups: usize) -> Conv2dParams {
    Conv2dParams {
        batch,
        in_channels: ic,
        out_channels: oc,
        input: hw,
        kernel: [k, k],
        stride: [stride, stride],
        padding: Padding2d::symmetric([pad, pad]),
        dilation: [1, 1],
        groups,
    }
}

/// Shapes large enough to cut into several bands or tiles, and the
/// benchmark layers made small.
#[test]
fn conv2d_matches_the_definition_on_layer_shapes() {
    let mut r = Rng(42);
    for p in [
        conv(3, 1, 6, [28, 28], 5, 1, 2, 1),
        conv(2, 6, 16, [14, 14], 5, 1, 0, 1),
        conv(1, 24, 24, [72, 40], 3, 1, 1, 1),
        conv(2, 16, 8, [64, 64], 3, 2, 1, 1),
        conv(2, 16, 32, [9, 11], 1, 1, 0, 1),
        conv(2, 16, 32, [9, 11], 1, 2, 0, 2),
        conv(2, 3, 16, [40, 40], 3, 1, 0, 1),
        conv(1, 8, 8, [20, 20], 3, 1, 1, 8),
        conv(2, 8, 40, [7, 7], 3, 1, 1, 1),
        conv(1, 4, 80, [5, 6], 3, 1, 2, 2),
        conv(3, 32, 64, [14, 14], 3, 1, 1, 1),
    ] {
        for threads in [1, 2, 4] {
            check_conv::<f64>(&p, &mut r, threads);
            check_conv::<f32>(&p, &mut r, threads);
        }
    }
}

/// The AVX2 kernels and the portable paths, which this machine may not
/// pick by itself, on the layer shapes and random arguments (the level is
/// process-wide: tests running meanwhile take these paths too, correctly).
#[test]
fn conv2d_every_instruction_set_matches_the_definition() {
    use crate::host_nn::vector::{set_ceiling, Level};
    let mut r = Rng(43);
    for level in [Level::Avx2, Level::Portable] {
        set_ceiling(level);
        for p in [
            conv(3, 1, 6, [28, 28], 5, 1, 2, 1),
            conv(2, 6, 16, [14, 14], 5, 1, 0, 1),
            conv(2, 8, 40, [7, 7], 3, 1, 1, 1),
            conv(3, 32, 64, [14, 14], 3, 1, 1, 1),
            conv(1, 24, 24, [30, 20], 3, 1, 1, 1),
        ] {
            for threads in [1, 3] {
                check_conv::<f32>(&p, &mut r, threads);
            }
        }
        for case in 0..100 {
            let p = random_conv(&mut r);
            check_conv::<f32>(&p, &mut r, 1 + case % 2);
        }
    }
    set_ceiling(Level::Avx512);
}

/// The loss `Σ y·m` for a fixed mask m, from the fast forward.
fn loss(p: &Conv2dParams, x: &[f64], w: &[f64], b: &[f64], m: &[f64]) -> f64 {
    let mut y = vec![0.0; m.len()];
    conv2d_forward(p, x, w, Some(b), &mut y, 1).unwrap();
    y.iter().zip(m).map(|(a, b)| a * b).sum()
}

/// Every gradient of the fast backward against central differences of the
/// fast forward, in f64.
#[test]
fn conv2d_gradients_match_finite_differences() {
    let mut r = Rng(7);
    for _ in 0..40 {
        let mut p = random_conv(&mut r);
        p.batch = p.batch.max(1);
        if p.validate().is_err() {
            continue;
        }
        let out = p.validate().unwrap();
        let (mut x, mut w, mut b, m) =
            (r.vals(prod(p.input_shape())), r.vals(prod(p.weight_shape())), r.vals(p.out_channels), r.vals(prod(out)));
        let (mut gx, mut gw, mut gb) = (vec![0.0; x.len()], vec![0.0; w.len()], vec![0.0; b.len()]);
        conv2d_backward(&p, &x, &w, &m, Some(&mut gx), Some(&mut gw), Some(&mut gb), 2).unwrap();
        let h = 1e-3;
        for (which, grad) in [(0, &gx), (1, &gw), (2, &gb)] {
            let len = grad.len();
            for i in 0..len {
                let v = |x: &mut Vec<f64>, w: &mut Vec<f64>, b: &mut Vec<f64>| match which {
                    0 => &mut x[i] as *mut f64,
                    1 => &mut w[i] as *mut f64,
                    _ => &mut b[i] as *mut f64,
                };
                let ptr = v(&mut x, &mut w, &mut b);
                // SAFETY: `ptr` points into one of the three live vectors, which are not resized.
                let orig = unsafe { *ptr };
                unsafe { *ptr = orig + h };
                let up = loss(&p, &x, &w, &b, &m);
                unsafe { *ptr = orig - h };
                let down = loss(&p, &x, &w, &b, &m);
                unsafe { *ptr = orig };
                let fd = (up - down) / (2.0 * h);
                assert!(
                    (fd - grad[i]).abs() <= 1e-8 * (1.0 + fd.abs()),
                    "{p:?}: gradient {which} element {i}: {} vs finite difference {fd}",
                    grad[i]
                );
            }
        }
    }
}

#[test]
fn conv_results_do_not_depend_on_the_thread_count() {
    let mut r = Rng(11);
    for p in [conv(5, 3, 8, [23, 19], 3, 1, 1, 1), conv(4, 6, 6, [17, 17], 3, 2, 2, 3), conv(9, 1, 6, [28, 28], 5, 1, 2, 1)] {
        let out = p.validate().unwrap();
        let (x, w, dy) =
            (to::<f32>(&r.vals(prod(p.input_shape()))), to::<f32>(&r.vals(prod(p.weight_shape()))), to::<f32>(&r.vals(prod(out))));
        let run = |threads| {
            let mut y = vec![0f32; prod(out)];
            conv2d_forward(&p, &x, &w, None, &mut y, threads).unwrap();
            let (mut gx, mut gw) = (vec![0f32; x.len()], vec![0f32; w.len()]);
            conv2d_backward(&p, &x, &w, &dy, Some(&mut gx), Some(&mut gw), None, threads).unwrap();
            (y, gx, gw)
        };
        let one = run(1);
        for threads in [2, 3, 8] {
            assert!(run(threads) == one, "{p:?}: {threads} threads differ from 1");
        }
    }
}

fn err_of(p: &Conv2dParams) -> String {
    p.validate().unwrap_err().to_string()
}

#[test]
fn conv2d_refuses_what_pytorch_refuses() {
    let ok = conv(1, 4, 6, [5, 5], 3, 1, 0, 2);
    assert_eq!(ok.validate().unwrap(), [1, 6, 3, 3]);
    assert!(err_of(&Conv2dParams { kernel: [0, 3], ..ok }).contains("kernel_size must be positive"));
    assert!(err_of(&Conv2dParams { stride: [1, 0], ..ok }).contains("stride must be positive"));
    assert!(err_of(&Conv2dParams { dilation: [0, 1], ..ok }).contains("dilation must be positive"));
    assert!(err_of(&Conv2dParams { groups: 0, ..ok }).contains("groups must be positive"));
    assert!(err_of(&Conv2dParams { out_channels: 5, ..ok }).contains("out_channels (5) must be divisible by groups (2)"));
    assert!(err_of(&Conv2dParams { in_channels: 5, ..ok }).contains("in_channels (5) must be divisible by groups (2)"));
    assert!(err_of(&Conv2dParams { out_channels: 0, ..ok }).contains("must be at least groups"));
    assert!(err_of(&Conv2dParams { input: [2, 5], ..ok }).contains("kernel cannot be larger than the padded input"));
    assert!(err_of(&Conv2dParams { input: [0, 5], padding: Padding2d::symmetric([2, 0]), ..ok }).contains("empty"));
    assert!(err_of(&Conv2dParams { dilation: [usize::MAX, 1], ..ok }).contains("kernel cannot be larger"));
    assert!(
        err_of(&Conv2dParams { input: [usize::MAX, 5], ..ok }).contains("too large")
            || err_of(&Conv2dParams { input: [usize::MAX, 5], ..ok }).contains("overflow")
    );
    assert!(err_of(&Conv2dParams { batch: usize::MAX / 2, ..ok }).contains("too many elements"));
    assert!(err_of(&Conv2dParams { padding: Padding2d { top: usize::MAX, ..Padding2d::default() }, ..ok }).contains("overflows"));
    assert!(Padding2d::same([3, 3], [1, 1], [2, 1]).unwrap_err().to_string().contains("stride 1"));
    assert_eq!(Padding2d::same([4, 3], [1, 2], [1, 1]).unwrap(), Padding2d { top: 1, bottom: 2, left: 2, right: 2 });
    // Empty batches and channels are fine, as in PyTorch.
    assert_eq!(Conv2dParams { batch: 0, ..ok }.validate().unwrap(), [0, 6, 3, 3]);
    assert_eq!(Conv2dParams { in_channels: 0, ..ok }.validate().unwrap(), [1, 6, 3, 3]);
    // A slice of the wrong length is an error, not a panic.
    let e = conv2d_forward(&ok, &[0f32; 3], &[0f32; 108], None, &mut [0f32; 54], 1).unwrap_err();
    assert!(e.to_string().contains("input has 3 elements where the shape asks for 100"), "{e}");
    let e = conv2d_forward(&ok, &[0f32; 100], &[0f32; 108], Some(&[0f32; 2]), &mut [0f32; 54], 1).unwrap_err();
    assert!(e.to_string().contains("bias"), "{e}");
}

#[test]
fn conv_transpose2d_refuses_what_pytorch_refuses() {
    let ok = ConvTranspose2dParams {
        batch: 1,
        in_channels: 4,
        out_channels: 6,
        input: [5, 5],
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
        output_padding: [1, 1],
        dilation: [1, 1],
        groups: 2,
    };
    assert_eq!(ok.validate().unwrap(), [1, 6, 10, 10]);
    let err = |p: ConvTranspose2dParams| p.validate().unwrap_err().to_string();
    assert!(err(ConvTranspose2dParams { output_padding: [2, 0], ..ok }).contains("output_padding"));
    assert!(ConvTranspose2dParams { output_padding: [1, 1], stride: [1, 1], dilation: [2, 2], ..ok }.validate().is_ok());
    assert!(err(ConvTranspose2dParams { input: [1, 1], kernel: [1, 1], stride: [1, 1], output_padding: [0, 0], ..ok })
        .contains("smaller than 1"));
    assert!(err(ConvTranspose2dParams { in_channels: 3, ..ok }).contains("in_channels (3) must be divisible"));
    assert!(err(ConvTranspose2dParams { in_channels: 0, ..ok }).contains("at least groups"));
    assert!(err(ConvTranspose2dParams { out_channels: 0, ..ok }).contains("out_channels must be positive"));
    assert!(err(ConvTranspose2dParams { stride: [0, 1], ..ok }).contains("stride must be positive"));
    assert!(err(ConvTranspose2dParams { input: [usize::MAX, 1], ..ok }).contains("too large"));
    assert_eq!(ConvTranspose2dParams { batch: 0, ..ok }.validate().unwrap(), [0, 6, 10, 10]);
}

/// Huge sizes that validate are refused by the slice checks before any
/// workspace is asked for; sizes that do not fit are refused by validate.
#[test]
fn conv_huge_sizes_are_errors() {
    let p = conv(1 << 40, 1 << 20, 8, [1 << 20, 1 << 20], 3, 1, 1, 1);
    assert!(conv2d_forward(&p, &[0f32; 1], &[0f32; 1], None, &mut [0f32; 1], 1).is_err());
    let p = conv(2, 3, 4, [8, 8], 3, 1, 1, 1);
    assert!(conv2d_forward(&p, &[0f32; 1], &[0f32; 1], None, &mut [0f32; 1], 1).is_err());
    // A kernel dilated across an enormous padding: a 1x1 output whose band
    // rows would be 2^40 long. An error, not an overflow or an allocation.
    let p = Conv2dParams {
        dilation: [1 << 39, 1 << 39],
        padding: Padding2d::symmetric([1 << 39, 1 << 39]),
        ..conv(1, 1, 1, [1, 1], 3, 1, 0, 1)
    };
    assert_eq!(p.validate().unwrap(), [1, 1, 1, 1]);
    let e = conv2d_forward(&p, &[1f32], &[0f32; 9], None, &mut [0f32; 1], 1).unwrap_err();
    assert!(e.to_string().contains("spans more than"), "{e}");
    assert!(conv2d_backward(&p, &[1f32], &[0f32; 9], &[1f32], Some(&mut [0f32; 1]), Some(&mut [0f32; 9]), Some(&mut [0f32; 1]), 1).is_err());
}

/// An infinite input reaches exactly the gradients it touches: the fast
/// paths' padding columns (output gradient 0) must not turn it into NaN
/// elsewhere.
#[test]
fn conv_weight_gradient_of_an_infinite_input() {
    let mut r = Rng(21);
    for p in [
        conv(2, 3, 8, [9, 11], 3, 1, 1, 1),
        conv(2, 16, 32, [7, 7], 3, 1, 1, 1),
        conv(1, 2, 4, [6, 6], 3, 2, 1, 1),
        conv(3, 1, 6, [12, 12], 5, 1, 2, 1),
    ] {
        let out = p.validate().unwrap();
        let mut x = r.vals(prod(p.input_shape()));
        let len = x.len();
        x[len / 3] = f64::INFINITY;
        x[len / 2 + 1] = f64::NEG_INFINITY;
        let (w, dy) =
            (r.vals(prod(p.weight_shape())), r.vals(prod(out)).iter().map(|v| if *v == 0.0 { 0.5 } else { *v }).collect::<Vec<_>>());
        let (_, want, _) = reference::conv2d_backward(&p, &x, &w, &dy);
        for threads in [1, 2] {
            let mut gw = vec![0f32; w.len()];
            conv2d_backward_weight(&p, &to::<f32>(&x), &to::<f32>(&dy), &mut gw, threads).unwrap();
            for (i, (&g, &e)) in gw.iter().zip(&want).enumerate() {
                if e.is_finite() {
                    assert!((g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()), "{p:?}: element {i} is {g}, expected {e}");
                } else {
                    assert!(g.is_nan() == e.is_nan() && (e.is_nan() || g as f64 == e), "{p:?}: element {i} is {g}, expected {e}");
                }
            }
        }
    }
}

/// Winograd F(2×2, 3×3) (f32, 3×3, stride 1, 16+ channels): odd sizes,
/// asymmetric padding, padding beyond the kernel (the input gradient's
/// flipped padding is then negative), groups, images split into tile rows
/// and small images grouped, every thread count.
#[test]
fn conv2d_winograd_matches_the_definition() {
    let mut r = Rng(77);
    let asym = Conv2dParams { padding: Padding2d { top: 0, bottom: 2, left: 1, right: 3 }, ..conv(2, 16, 16, [10, 13], 3, 1, 0, 1) };
    for p in [
        conv(2, 16, 16, [9, 7], 3, 1, 1, 1),
        asym,
        conv(1, 16, 24, [8, 8], 3, 1, 3, 1),
        conv(2, 32, 32, [12, 12], 3, 1, 1, 2),
        conv(1, 16, 16, [100, 100], 3, 1, 1, 1),
        conv(5, 16, 32, [8, 8], 3, 1, 1, 1),
        conv(3, 64, 64, [14, 14], 3, 1, 1, 1),
    ] {
        for threads in [1, 2, 5] {
            check_conv::<f32>(&p, &mut r, threads);
        }
    }
}

/// A non-finite value makes Winograd's transforms give NaN where the direct
/// sum gives ±∞: those convolutions are computed directly instead. As in
/// PyTorch, padding takes part in the products as zeros (∞ · 0 is NaN
/// there), which the reference reproduces on an explicitly padded input.
#[test]
fn conv2d_with_infinite_values() {
    let mut r = Rng(78);
    for (case, p) in
        [conv(2, 16, 16, [8, 8], 3, 1, 1, 1), conv(2, 3, 5, [9, 8], 3, 1, 1, 1), conv(1, 4, 6, [9, 9], 3, 2, 1, 1)].into_iter().enumerate()
    {
        let out = p.validate().unwrap();
        let mut x = r.vals(prod(p.input_shape()));
        x[70] = f64::INFINITY;
        let mut w = r.vals(prod(p.weight_shape()));
        let mut dy: Vec<f64> = r.vals(prod(out)).iter().map(|v| if *v == 0.0 { 0.25 } else { *v }).collect();
        dy[5] = f64::NEG_INFINITY;
        if case == 1 {
            w[4] = f64::INFINITY;
        }
        // The same convolution on the input padded with zeros, unpadded.
        let [n, c, h, wd] = p.input_shape();
        let pad = p.padding;
        let (hp, wp) = (h + pad.top + pad.bottom, wd + pad.left + pad.right);
        let mut xp = vec![0.0; n * c * hp * wp];
        for i in 0..n * c {
            for y in 0..h {
                for z in 0..wd {
                    xp[(i * hp + y + pad.top) * wp + z + pad.left] = x[(i * h + y) * wd + z];
                }
            }
        }
        let q = Conv2dParams { input: [hp, wp], padding: Padding2d::default(), ..p };
        let same = |got: &[f32], want: &[f64], what: &str| {
            for (i, (&g, &e)) in got.iter().zip(want).enumerate() {
                let ok = if e.is_finite() {
                    (g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs())
                } else {
                    g.is_nan() == e.is_nan() && (e.is_nan() || g as f64 == e)
                };
                assert!(ok, "{p:?} {what}: element {i} is {g}, expected {e}");
            }
        };
        let mut y = vec![0f32; prod(out)];
        conv2d_forward(&p, &to::<f32>(&x), &to::<f32>(&w), None, &mut y, 2).unwrap();
        same(&y, &reference::conv2d(&q, &xp, &w, None), "forward");
        let (gxp, gw, _) = reference::conv2d_backward(&q, &xp, &w, &dy);
        let mut gx = vec![0.0; x.len()];
        for i in 0..n * c {
            for y in 0..h {
                for z in 0..wd {
                    gx[(i * h + y) * wd + z] = gxp[(i * hp + y + pad.top) * wp + z + pad.left];
                }
            }
        }
        let (mut fx, mut fw) = (vec![0f32; x.len()], vec![0f32; w.len()]);
        conv2d_backward(&p, &to::<f32>(&x), &to::<f32>(&w), &to::<f32>(&dy), Some(&mut fx), Some(&mut fw), None, 2).unwrap();
        same(&fx, &gx, "grad input");
        same(&fw, &gw, "grad weight");
    }
}
