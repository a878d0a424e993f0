//! Conformance: composites (ops built from primitives in the front end,
//! with their gradients for free), against values from PyTorch 2.15 in f64.

use crate::common::on_every_device;
use kiln::{DType, Device, Result, Tensor};

/// Relative closeness (absolute below 1), infinities and NaNs equal.
fn near(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = if g == w || (g.is_nan() && w.is_nan()) { 0.0 } else { (g - w).abs() / w.abs().max(1.0) };
        assert!(err <= tol, "{what}: element {i} is {g}, expected {w} (relative error {err:e} > {tol:e})");
    }
}

/// f(x) and d(Σ f(x))/dx for x = [-3, -1, -0.5, 0, 0.5, 1, 3] in f64.
fn value_and_grad(d: Device, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<(Vec<f64>, Vec<f64>)> {
    let x = Tensor::new(&[-3f64, -1., -0.5, 0., 0.5, 1., 3.], &d)?.requires_grad_();
    let y = f(&x)?;
    y.sum_all()?.backward()?;
    Ok((y.to_vec_f64()?, x.grad().expect("a gradient").to_vec_f64()?))
}

#[test]
fn gelu_exact_and_tanh_and_silu_with_gradients() {
    on_every_device(|d| {
        let (y, g) = value_and_grad(d, |x| x.gelu())?;
        near(
            &y,
            &[
                -0.00404969409489031,
                -0.15865525393145702,
                -0.15426876936299344,
                0.0,
                0.34573123063700656,
                0.841344746068543,
                2.99595030590511,
            ],
            1e-15,
            "gelu",
        );
        near(
            &g,
            &[
                -0.01194564720418392,
                -0.08331547058768635,
                0.13250487534383712,
                0.5,
                0.8674951246561629,
                1.0833154705876864,
                1.011945647204184,
            ],
            1e-14,
            "gelu gradient",
        );
        let (y, g) = value_and_grad(d, |x| x.gelu_tanh())?;
        near(
            &y,
            &[
                -0.0036373920817729943,
                -0.15880800939172324,
                -0.15428599017485606,
                0.0,
                0.34571400982514394,
                0.8411919906082768,
                2.996362607918227,
            ],
            1e-15,
            "gelu_tanh",
        );
        near(
            &g,
            &[
                -0.011584166630969648,
                -0.08296408384578252,
                0.13263009646535764,
                0.5,
                0.8673699035346424,
                1.0829640838457826,
                1.0115841666309695,
            ],
            1e-14,
            "gelu_tanh gradient",
        );
        let (y, g) = value_and_grad(d, |x| x.silu())?;
        near(
            &y,
            &[
                -0.14227761953270035,
                -0.2689414213699951,
                -0.1887703343990727,
                0.0,
                0.3112296656009273,
                0.7310585786300049,
                2.8577223804672998,
            ],
            1e-15,
            "silu",
        );
        near(
            &g,
            &[
                -0.08810410601516962,
                0.07232948812851325,
                0.2600388126973482,
                0.5,
                0.7399611873026519,
                0.9276705118714869,
                1.0881041060151693,
            ],
            1e-14,
            "silu gradient",
        );
        // f32 keeps its dtype; integers compute in f32.
        let x = Tensor::new(&[1f32, -1.], &d)?;
        assert_eq!((x.gelu()?.dtype(), x.gelu_tanh()?.device(), x.silu()?.dtype()), (DType::F32, d, DType::F32));
        near(&Tensor::new(&[1i64], &d)?.gelu()?.to_vec_f64()?, &[0.841344746068543], 1e-7, "gelu of an integer");
        assert_eq!(Tensor::zeros((0, 2), DType::F32, &d)?.gelu()?.dims(), &[0, 2]);
        Ok(())
    });
}

#[test]
fn variance_and_standard_deviation_with_gradients() {
    on_every_device(|d| {
        let a = Tensor::new(&[[1f64, 2., 3., 4.], [2., 2., 2., 2.], [-1., 5., 0.5, 7.]], &d)?.requires_grad_();
        let v = a.var(1)?;
        near(&v.to_vec_f64()?, &[1.6666666666666667, 0.0, 14.0625], 1e-15, "var");
        v.mul(&Tensor::new(&[1f64, 10., 100.], &d)?)?.sum_all()?.backward()?;
        near(
            &a.grad().expect("var has a gradient").to_vec_f64()?,
            &[
                -1.0,
                -1. / 3.,
                1. / 3.,
                1.0,
                0.,
                0.,
                0.,
                0.,
                -258.3333333333333,
                141.66666666666666,
                -158.33333333333331,
                274.99999999999994,
            ],
            1e-14,
            "var gradient",
        );
        near(
            &a.std_dims(&[0], 0.0, false)?.to_vec_f64()?,
            &[1.247219128924647, std::f64::consts::SQRT_2, 1.0274023338281628, 2.0548046676563256],
            1e-15,
            "std",
        );
        assert_eq!(a.var_dims(&[-1], 1.0, true)?.dims(), &[3, 1]);
        near(&a.var_all()?.to_vec_f64()?, &[4.429924242424242], 1e-15, "var_all");
        // N − correction ≤ 0 divides by zero, as PyTorch: inf or 0/0.
        let one = Tensor::new(&[[3f32], [4.]], &d)?;
        let v = one.var(1)?.to_vec::<f32>()?;
        assert!(v.iter().all(|x| x.is_nan()), "{v:?}");
        assert_eq!(Tensor::new(&[1f32, 2.], &d)?.var_dims(&[0], 2.0, false)?.to_vec::<f32>()?, vec![f32::INFINITY]);
        // A constant slice: the deviation's gradient is 0, not 0/0 (PyTorch);
        // an infinite element makes NaN only at itself (the mean is a constant).
        let c = Tensor::new(&[[2f64, 2.], [1., 3.]], &d)?.requires_grad_();
        c.std(1)?.sum_all()?.backward()?;
        near(
            &c.grad().expect("std has a gradient").to_vec_f64()?,
            &[0., 0., -std::f64::consts::FRAC_1_SQRT_2, std::f64::consts::FRAC_1_SQRT_2],
            1e-15,
            "std gradient",
        );
        let i = Tensor::new(&[1f64, f64::INFINITY, 3.], &d)?.requires_grad_();
        i.var(0)?.backward()?;
        let g = i.grad().expect("var has a gradient").to_vec_f64()?;
        assert!(g[0] == f64::NEG_INFINITY && g[1].is_nan() && g[2] == f64::NEG_INFINITY, "{g:?}");
        // Floats only, as PyTorch; out-of-range dims name the rank.
        assert!(matches!(Tensor::new(&[1i64, 2], &d)?.var(0), Err(kiln::Error::UnsupportedDType { .. })));
        assert!(a.std(2).unwrap_err().to_string().contains("rank 2"));
        Ok(())
    });
}

#[test]
fn logsumexp_is_stable_with_its_gradient() {
    on_every_device(|d| {
        let a = Tensor::new(&[[1f64, 2., 3., 4.], [2., 2., 2., 2.], [-1., 5., 0.5, 7.]], &d)?.requires_grad_();
        let l = a.logsumexp(&[1], false)?;
        near(&l.to_vec_f64()?, &[4.440189698561196, 3.386294361119891, 7.128546400095168], 1e-15, "logsumexp");
        l.sum_all()?.backward()?;
        near(
            &a.grad().expect("logsumexp has a gradient").to_vec_f64()?,
            &[
                0.032058603280084974,
                0.08714431874203253,
                0.23688281808991005,
                0.643914259887972,
                0.25,
                0.25,
                0.25,
                0.25,
                0.0002949966964696368,
                0.11901016134108817,
                0.0013220834703538068,
                0.8793727584920883,
            ],
            1e-15,
            "logsumexp gradient",
        );
        let big = Tensor::new(&[[1000f32, 1000.], [f32::INFINITY, 1.], [f32::NEG_INFINITY, f32::NEG_INFINITY]], &d)?;
        assert_eq!(big.logsumexp(&[-1], false)?.to_vec::<f32>()?, vec![1000. + 2f32.ln(), f32::INFINITY, f32::NEG_INFINITY]);
        assert_eq!(big.logsumexp(&[0, 1], true)?.dims(), &[1, 1]);
        let empty = Tensor::zeros((0, 3), DType::F32, &d)?;
        assert_eq!(empty.logsumexp(&[0], false)?.to_vec::<f32>()?, vec![f32::NEG_INFINITY; 3]);
        assert_eq!(Tensor::new(&[0i64, 0], &d)?.logsumexp(&[0], false)?.to_vec::<f32>()?, vec![2f32.ln()]);
        Ok(())
    });
}

/// The mean cross-entropy of `rows` (n rows of `c`) against `labels` and
/// its gradient, in f64 by the textbook formula: the reference for the
/// fused kernels.
fn cross_entropy_reference(x: &[f64], c: usize, labels: &[i64]) -> (f64, Vec<f64>) {
    let n = labels.len();
    let (mut loss, mut grad) = (0.0, vec![0.0; x.len()]);
    for (i, &y) in labels.iter().enumerate() {
        let row = &x[i * c..(i + 1) * c];
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v - m).exp()).sum();
        loss += sum.ln() - (row[y as usize] - m);
        for j in 0..c {
            grad[i * c + j] = ((row[j] - m).exp() / sum - f64::from(u8::from(j == y as usize))) / n as f64;
        }
    }
    (loss / n as f64, grad)
}

#[test]
fn cross_entropy_fuses_rows_and_gradient_in_both_float_dtypes_and_any_layout() {
    on_every_device(|d| {
        // Rows of small, large (softmax must shift), tied and negative logits.
        let x = [0.5, -1.0, 2.0, 0.0, 1000.0, 999.0, 998.0, -1000.0, 3.0, 3.0, 3.0, 3.0, -7.5, 0.25, -0.125, 4.0];
        let labels = [2i64, 0, 3, 1];
        let (want, want_grad) = cross_entropy_reference(&x, 4, &labels);
        let y = Tensor::new(&labels[..], &d)?;
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-14 } else { 1e-6 };
            // Contiguous, and the same logits read through a transpose.
            let contiguous = Tensor::new(&x[..], &d)?.reshape((4, 4))?.to_dtype(dtype)?;
            let transposed = contiguous.t()?.contiguous()?.t()?;
            assert!(!transposed.is_contiguous());
            for logits in [contiguous, transposed] {
                let leaf = logits.detach().requires_grad_();
                let view = if logits.is_contiguous() { leaf.clone() } else { leaf.t()?.contiguous()?.t()? };
                let loss = kiln::nn::cross_entropy(&view, &y)?;
                assert_eq!((loss.dtype(), loss.dims()), (dtype, &[][..]));
                near(&[loss.to_vec_f64()?[0]], &[want], tol, &format!("cross_entropy {dtype} on {d}"));
                loss.backward()?;
                near(
                    &leaf.grad().expect("logits get a gradient").to_vec_f64()?,
                    &want_grad,
                    tol,
                    &format!("cross_entropy gradient {dtype} on {d}"),
                );
            }
        }
        // Scaled upstream gradient: d(3·loss)/dx = 3·grad.
        let leaf = Tensor::new(&x[..], &d)?.reshape((4, 4))?.requires_grad_();
        kiln::nn::cross_entropy(&leaf, &y)?.mul_scalar(3.0)?.backward()?;
        let three: Vec<f64> = want_grad.iter().map(|g| 3.0 * g).collect();
        near(&leaf.grad().expect("a gradient").to_vec_f64()?, &three, 1e-14, "3 * cross_entropy gradient");
        // A NaN logit makes its row NaN, and only its row's gradient.
        let mut with_nan = x;
        with_nan[1] = f64::NAN;
        let leaf = Tensor::new(&with_nan[..], &d)?.reshape((4, 4))?.requires_grad_();
        let loss = kiln::nn::cross_entropy(&leaf, &y)?;
        assert!(loss.to_vec_f64()?[0].is_nan());
        loss.backward()?;
        let g = leaf.grad().expect("a gradient").to_vec_f64()?;
        assert!(g[..4].iter().all(|v| v.is_nan()) && g[4..].iter().all(|v| v.is_finite()), "{g:?}");
        // An empty batch: NaN (0/0), as PyTorch, with an empty gradient.
        let empty = Tensor::zeros((0, 4), DType::F32, &d)?.requires_grad_();
        let loss = kiln::nn::cross_entropy(&empty, &Tensor::zeros(0, DType::I64, &d)?)?;
        assert!(loss.to_vec_f64()?[0].is_nan());
        loss.backward()?;
        assert_eq!(empty.grad().map(|g| g.dims().to_vec()), Some(vec![0, 4]));
        Ok(())
    });
}

#[test]
fn cross_entropy_gradient_matches_finite_differences() {
    on_every_device(|d| {
        let x: Vec<f64> = (0..15).map(|i| ((i * 7 % 11) as f64 - 5.0) * 0.37).collect();
        let labels = Tensor::new(&[4i64, 0, 2], &d)?;
        let f =
            |v: &[f64]| -> Result<f64> { Ok(kiln::nn::cross_entropy(&Tensor::new(v, &d)?.reshape((3, 5))?, &labels)?.to_vec_f64()?[0]) };
        let leaf = Tensor::new(&x[..], &d)?.reshape((3, 5))?.requires_grad_();
        kiln::nn::cross_entropy(&leaf, &labels)?.backward()?;
        let g = leaf.grad().expect("a gradient").to_vec_f64()?;
        let h = 1e-6;
        for k in 0..x.len() {
            let (mut up, mut down) = (x.clone(), x.clone());
            up[k] += h;
            down[k] -= h;
            let numeric = (f(&up)? - f(&down)?) / (2.0 * h);
            assert!((numeric - g[k]).abs() < 1e-8, "element {k}: finite difference {numeric}, gradient {}", g[k]);
        }
        Ok(())
    });
}
