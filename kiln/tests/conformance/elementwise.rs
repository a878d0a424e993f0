//! Conformance: elementwise.

use crate::common::{assert_close, assert_f32, assert_values, f32s, on_every_device};
use crate::same_f32_bits;
use crate::t2;
use kiln::{BinaryOp, DType, Error, Result, Tensor};

#[test]
fn binary_ops_with_broadcasting() {
    on_every_device(|d| {
        let a = t2(&[&[1., 2., 3.], &[4., 5., 6.]], d)?;
        let row = Tensor::new(&[10f32, 20., 30.], &d)?;
        let col = t2(&[&[1.], &[2.]], d)?;
        assert_f32(&(&a + &row)?, d, &[2, 3], &[11., 22., 33., 14., 25., 36.]);
        assert_f32(&(&row + &a)?, d, &[2, 3], &[11., 22., 33., 14., 25., 36.]);
        assert_f32(&(&a - &col)?, d, &[2, 3], &[0., 1., 2., 2., 3., 4.]);
        assert_f32(&(&col - &a)?, d, &[2, 3], &[0., -1., -2., -2., -3., -4.]);
        assert_f32(&(&a * &row)?, d, &[2, 3], &[10., 40., 90., 40., 100., 180.]);
        assert_f32(&(&row / &a)?, d, &[2, 3], &[10., 10., 10., 2.5, 4., 5.]);
        // (2, 1) with (3,) is an outer product shape.
        assert_f32(&(&col * &row)?, d, &[2, 3], &[10., 20., 30., 20., 40., 60.]);
        // A rank-3 broadcast: (2, 1, 3) + (4, 1) -> (2, 4, 3).
        let p = Tensor::from_vec(vec![0f32, 1., 2., 100., 101., 102.], (2, 1, 3), &d)?;
        let q = Tensor::from_vec(vec![0f32, 10., 20., 30.], (4, 1), &d)?;
        let s = (&p + &q)?;
        let expected: Vec<f32> =
            (0..2).flat_map(|i| (0..4).flat_map(move |j| (0..3).map(move |k| (100 * i + k) as f32 + 10.0 * j as f32))).collect();
        assert_f32(&s, d, &[2, 4, 3], &expected);
        // A 0-d tensor broadcasts against anything.
        let two = Tensor::new(&2f32, &d)?;
        assert_f32(&a.pow(&two)?, d, &[2, 3], &[1., 4., 9., 16., 25., 36.]);
        assert_f32(&a.maximum(&Tensor::new(&[3f32, 0., 7.], &d)?)?, d, &[2, 3], &[3., 2., 7., 4., 5., 7.]);
        assert_f32(&a.minimum(&col.mul_scalar(3.0)?)?, d, &[2, 3], &[1., 2., 3., 4., 5., 6.]);
        assert_f32(&a.minimum(&col.add_scalar(1.0)?)?, d, &[2, 3], &[1., 2., 2., 3., 3., 3.]);
        // Owned and mixed operator forms.
        assert_f32(&(a.clone() + row.clone())?, d, &[2, 3], &[11., 22., 33., 14., 25., 36.]);
        assert_f32(&(a.clone() - &row)?, d, &[2, 3], &[-9., -18., -27., -6., -15., -24.]);
        assert_f32(&(&a * row.clone())?, d, &[2, 3], &[10., 40., 90., 40., 100., 180.]);
        // f64, i64 (`/` is true division into f32, as in PyTorch) and u8.
        let x = Tensor::new(&[1.5f64, -2.0], &d)?;
        assert_values(&(&x * &x)?, d, &[2], &[2.25, 4.0]);
        let i = Tensor::new(&[7i64, -7, 9], &d)?;
        let j = Tensor::new(&[2i64, 2, -3], &d)?;
        assert_eq!((&i / &j)?.to_vec::<f32>()?, vec![3.5, -3.5, -3.]);
        assert_eq!((&i + &j)?.to_vec::<i64>()?, vec![9, -5, 6]);
        assert_eq!(i.maximum(&j)?.to_vec::<i64>()?, vec![7, 2, 9]);
        let b = Tensor::new(&[200u8, 3], &d)?;
        assert_eq!((&b + &Tensor::new(&[50u8, 4], &d)?)?.to_vec::<u8>()?, vec![250, 7]);
        Ok(())
    });
}

#[test]
fn binary_ops_on_strided_views() {
    on_every_device(|d| {
        let a = t2(&[&[1., 2., 3.], &[4., 5., 6.]], d)?;
        let at = a.t()?;
        assert!(!at.is_contiguous());
        assert_f32(&(&at + &at)?, d, &[3, 2], &[2., 8., 4., 10., 6., 12.]);
        let b = t2(&[&[1., 1.], &[2., 2.], &[3., 3.]], d)?;
        assert_f32(&(&at * &b)?, d, &[3, 2], &[1., 4., 4., 10., 9., 18.]);
        let mid = a.narrow(1, 1, 2)?;
        assert_f32(&(&mid - &Tensor::new(&[1f32], &d)?)?, d, &[2, 2], &[1., 2., 4., 5.]);
        assert_f32(&at.exp()?.log()?.round_trip_check()?, d, &[3, 2], &[1., 4., 2., 5., 3., 6.]);
        Ok(())
    });
}

/// exp then log is not exact: round the values back to integers on the host.
trait RoundTrip {
    fn round_trip_check(&self) -> Result<Tensor>;
}
impl RoundTrip for Tensor {
    fn round_trip_check(&self) -> Result<Tensor> {
        let v: Vec<f32> = self.to_vec::<f32>()?.into_iter().map(|x| x.round()).collect();
        Tensor::from_vec(v, self.shape().clone(), &self.device())
    }
}

#[test]
fn scalar_ops() {
    on_every_device(|d| {
        let a = Tensor::new(&[1f32, -2., 4.], &d)?;
        assert_f32(&(&a + 1.0)?, d, &[3], &[2., -1., 5.]);
        assert_f32(&(&a - 1.0)?, d, &[3], &[0., -3., 3.]);
        assert_f32(&(&a * 2.0)?, d, &[3], &[2., -4., 8.]);
        assert_f32(&(&a / 4.0)?, d, &[3], &[0.25, -0.5, 1.]);
        assert_f32(&(1.0 + &a)?, d, &[3], &[2., -1., 5.]);
        assert_f32(&(10.0 - &a)?, d, &[3], &[9., 12., 6.]);
        assert_f32(&(3.0 * &a)?, d, &[3], &[3., -6., 12.]);
        assert_f32(&(8.0 / &a)?, d, &[3], &[8., -4., 2.]);
        assert_f32(&(a.clone() * 0.5)?, d, &[3], &[0.5, -1., 2.]);
        assert_f32(&(-&a)?, d, &[3], &[-1., 2., -4.]);
        assert_f32(&a.add_scalar(0.5)?, d, &[3], &[1.5, -1.5, 4.5]);
        assert_f32(&a.sub_scalar(0.5)?, d, &[3], &[0.5, -2.5, 3.5]);
        assert_f32(&a.mul_scalar(-1.0)?, d, &[3], &[-1., 2., -4.]);
        assert_f32(&a.div_scalar(2.0)?, d, &[3], &[0.5, -1., 2.]);
        assert_f32(&a.maximum_scalar(0.0)?, d, &[3], &[1., 0., 4.]);
        assert_f32(&a.minimum_scalar(0.0)?, d, &[3], &[0., -2., 0.]);
        assert_f32(&a.clamp(-1.0, 2.0)?, d, &[3], &[1., -1., 2.]);
        assert_f32(&a.affine(2.0, 1.0)?, d, &[3], &[3., -3., 9.]);
        let i = Tensor::new(&[3i64, -4], &d)?;
        assert_eq!((&i * 3.0)?.to_vec::<i64>()?, vec![9, -12]);
        assert_eq!((&i + 1.0)?.to_vec::<i64>()?, vec![4, -3]);
        assert_eq!((10.0 - &i)?.to_vec::<i64>()?, vec![7, 14]);
        Ok(())
    });
}

#[test]
fn unary_ops() {
    on_every_device(|d| {
        let a = Tensor::new(&[-2f32, 0., 0.5, 3.], &d)?;
        assert_f32(&a.neg()?, d, &[4], &[2., -0., -0.5, -3.]);
        assert_f32(&a.abs()?, d, &[4], &[2., 0., 0.5, 3.]);
        assert_f32(&a.sqr()?, d, &[4], &[4., 0., 0.25, 9.]);
        assert_f32(&a.relu()?, d, &[4], &[0., 0., 0.5, 3.]);
        assert_f32(&a.powi(2)?, d, &[4], &[4., 0., 0.25, 9.]);
        assert_f32(&a.powi(3)?, d, &[4], &[-8., 0., 0.125, 27.]);
        assert_f32(&a.powi(5)?, d, &[4], &[-32., 0., 0.03125, 243.]);
        assert_f32(&a.powi(0)?, d, &[4], &[1., 1., 1., 1.]);
        assert_f32(&a.powi(1)?, d, &[4], &[-2., 0., 0.5, 3.]);
        let p = Tensor::new(&[1f32, 2., 4., 0.5], &d)?;
        assert_f32(&p.powi(-2)?, d, &[4], &[1., 0.25, 0.0625, 4.]);
        assert_f32(&p.recip()?, d, &[4], &[1., 0.5, 0.25, 2.]);
        assert_f32(&p.sqrt()?.narrow(0, 2, 1)?, d, &[1], &[2.]);
        assert_f32(&p.powf(2.0)?, d, &[4], &[1., 4., 16., 0.25]);
        assert_f32(&Tensor::new(&[4f32, 9.], &d)?.powf(1.5)?, d, &[2], &[8., 27.]);
        let x: Vec<f32> = vec![-1.5, -0.25, 0.0, 0.75, 2.0];
        let t = Tensor::new(&x[..], &d)?;
        let close = |got: Tensor, f: fn(f64) -> f64, what: &str| {
            let expected: Vec<f64> = x.iter().map(|&v| f(v as f64)).collect();
            assert_close(&f32s(&got, d), &expected, 2e-6, &format!("{what} on {d}"));
        };
        close(t.exp()?, f64::exp, "exp");
        close(t.sin()?, f64::sin, "sin");
        close(t.cos()?, f64::cos, "cos");
        close(t.tanh()?, f64::tanh, "tanh");
        close(t.sigmoid()?, |v| 1.0 / (1.0 + (-v).exp()), "sigmoid");
        close(t.abs()?.add_scalar(1.0)?.log()?, |v| (v.abs() + 1.0).ln(), "log");
        close(t.abs()?.sqrt()?, |v| v.abs().sqrt(), "sqrt");
        close(t.abs()?.add_scalar(0.5)?.powf(0.3)?, |v| (v.abs() + 0.5).powf(0.3), "powf");
        // f64 in f64 precision.
        let y = Tensor::new(&[0.5f64, 2.0], &d)?;
        // CUDA's exp may differ from glibc's by its documented ulps.
        crate::common::assert_ulps(
            &y.exp()?.to_vec::<f64>()?,
            &[0.5f64.exp(), 2f64.exp()],
            crate::common::transcendental_ulps(d),
            &format!("f64 exp on {d}"),
        );
        assert_eq!(y.sqrt()?.to_vec::<f64>()?, vec![0.5f64.sqrt(), 2f64.sqrt()]);
        // Integers: the ops that make sense, exactly.
        let i = Tensor::new(&[-3i64, 0, 5], &d)?;
        assert_eq!(i.neg()?.to_vec::<i64>()?, vec![3, 0, -5]);
        assert_eq!(i.abs()?.to_vec::<i64>()?, vec![3, 0, 5]);
        assert_eq!(i.relu()?.to_vec::<i64>()?, vec![0, 0, 5]);
        assert_eq!(i.powi(3)?.to_vec::<i64>()?, vec![-27, 0, 125]);
        assert_eq!(i.sqr()?.to_vec::<i64>()?, vec![9, 0, 25]);
        Ok(())
    });
}

/// The fused gradients of sigmoid and tanh: exactly g·(y·(1−y)) and
/// g·(1−y·y) rounded step by step (no fused multiply-add), on every device,
/// broadcasting, and as the gradients sigmoid and tanh give.
#[test]
fn sigmoid_and_tanh_backward_ops_round_step_by_step() {
    on_every_device(|d| {
        let gv = [0.3f32, -1.7, 2.5, 1e-3, -0.0, 7.25];
        let yv = [0.1f32, 0.5, 0.9, 0.999, 0.25, -0.6];
        let (g, y) = (Tensor::new(&gv[..], &d)?, Tensor::new(&yv[..], &d)?);
        let sig: Vec<f32> = gv.iter().zip(&yv).map(|(&g, &y)| g * (y * (1.0 - y))).collect();
        let tanh: Vec<f32> = gv.iter().zip(&yv).map(|(&g, &y)| g * (1.0 - y * y)).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&g.binary(&y, BinaryOp::SigmoidBackward)?.to_vec::<f32>()?), bits(&sig), "sigmoid_backward on {d}");
        assert_eq!(bits(&g.binary(&y, BinaryOp::TanhBackward)?.to_vec::<f32>()?), bits(&tanh), "tanh_backward on {d}");
        // A row of gradients against a column of outputs.
        let col = Tensor::new(&[0.2f64, 0.7], &d)?.reshape((2, 1))?;
        let row = Tensor::new(&[1.5f64, -2.0, 0.5], &d)?;
        let got = row.binary(&col, BinaryOp::SigmoidBackward)?;
        assert_eq!((got.dims(), got.device()), (&[2usize, 3][..], d));
        let want: Vec<f64> = [0.2f64, 0.7].iter().flat_map(|&y| [1.5f64, -2.0, 0.5].map(|g| g * (y * (1.0 - y)))).collect();
        assert_eq!(got.to_vec::<f64>()?, want, "broadcast sigmoid_backward on {d}");
        assert!(matches!(
            Tensor::new(&[1i64], &d)?.binary(&Tensor::new(&[1i64], &d)?, BinaryOp::TanhBackward),
            Err(Error::DTypeMismatch { .. } | Error::UnsupportedDType { .. })
        ));
        // sigmoid's and tanh's own gradients are these ops.
        let x = Tensor::new(&[-1.5f32, 0.25, 2.0], &d)?;
        for tanh in [false, true] {
            let leaf = x.requires_grad_();
            let out = if tanh { leaf.tanh()? } else { leaf.sigmoid()? };
            out.sum_all()?.backward()?;
            let grad = leaf.grad().expect("a gradient");
            assert_eq!(grad.device(), d);
            let op = if tanh { BinaryOp::TanhBackward } else { BinaryOp::SigmoidBackward };
            let want = out.detach().ones_like()?.binary(&out.detach(), op)?;
            assert_eq!(bits(&grad.to_vec::<f32>()?), bits(&want.to_vec::<f32>()?), "tanh {tanh} on {d}");
        }
        Ok(())
    });
}

#[test]
fn comparisons_give_u8() {
    on_every_device(|d| {
        let a = Tensor::new(&[1f32, 2., 3.], &d)?;
        let b = Tensor::new(&[2f32], &d)?;
        let check = |t: Tensor, expected: [u8; 3]| {
            assert_eq!((t.dtype(), t.device(), t.dims()), (DType::U8, d, &[3usize][..]));
            assert_eq!(t.to_vec::<u8>().unwrap(), expected, "on {d}");
        };
        check(a.eq(&b)?, [0, 1, 0]);
        check(a.ne(&b)?, [1, 0, 1]);
        check(a.lt(&b)?, [1, 0, 0]);
        check(a.le(&b)?, [1, 1, 0]);
        check(a.gt(&b)?, [0, 0, 1]);
        check(a.ge(&b)?, [0, 1, 1]);
        let i = Tensor::new(&[[1i64], [3]], &d)?;
        let j = Tensor::new(&[1i64, 2, 3], &d)?;
        assert_values(&i.le(&j)?, d, &[2, 3], &[1., 1., 1., 0., 0., 1.]);
        Ok(())
    });
}

#[test]
fn erf_values_and_gradient() {
    // erf at these points, from Python's math.erf (correctly rounded doubles).
    let xs = [0.0, 0.5, -1.0, 2.0, -3.5, 1e-8, f64::INFINITY, f64::NEG_INFINITY];
    let erf = [0.0, 0.5204998778130465, -0.8427007929497149, 0.9953222650189527, -0.9999992569016276, 1.1283791670955126e-8, 1.0, -1.0];
    on_every_device(|d| {
        for dtype in [DType::F32, DType::F64] {
            let x = Tensor::from_vec(xs.to_vec(), xs.len(), &d)?.to_dtype(dtype)?.requires_grad_();
            let y = x.erf()?;
            assert_eq!((y.dtype(), y.device()), (dtype, d));
            let tol = if dtype == DType::F32 { 2e-7 } else { 1e-15 };
            near(&y.to_vec_f64()?, &erf, tol, "erf");
            y.sum_all()?.backward()?;
            let g = x.grad().expect("erf has a gradient").to_vec_f64()?;
            let want: Vec<f64> = xs.iter().map(|x| std::f64::consts::FRAC_2_SQRT_PI * (-x * x).exp()).collect();
            near(&g, &want, tol * 4.0, "erf gradient");
        }
        assert!(Tensor::new(&[f32::NAN], &d)?.erf()?.to_vec::<f32>()?[0].is_nan());
        // Integers compute in f32, as the other float functions do.
        let i = Tensor::new(&[0i64, 1], &d)?.erf()?;
        assert_eq!(i.dtype(), DType::F32);
        near(&i.to_vec_f64()?, &[0.0, 0.8427007929497149], 2e-7, "erf of integers");
        Ok(())
    });
}

/// Relative closeness (absolute below 1) of f64 values, infinities equal.
fn near(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = if g == w { 0.0 } else { (g - w).abs() / w.abs().max(1.0) };
        assert!(err <= tol, "{what}: element {i} is {g}, expected {w} (relative error {err:e} > {tol:e})");
    }
}

#[test]
fn nan_propagates_through_relu_maximum_minimum_clamp_and_reductions() {
    on_every_device(|d| {
        let x = Tensor::new(&[f32::NAN, 1., -2., 3.], &d)?;
        same_f32_bits(&x.relu()?, &[f32::NAN, 1., 0., 3.]);
        let y = Tensor::new(&[0f32, f32::NAN, 5., -1.], &d)?;
        same_f32_bits(&x.maximum(&y)?, &[f32::NAN, f32::NAN, 5., 3.]);
        same_f32_bits(&x.minimum(&y)?, &[f32::NAN, f32::NAN, -2., -1.]);
        same_f32_bits(&x.maximum_scalar(0.0)?, &[f32::NAN, 1., 0., 3.]);
        same_f32_bits(&x.minimum_scalar(0.0)?, &[f32::NAN, 0., -2., 0.]);
        same_f32_bits(&x.clamp(-1.0, 2.0)?, &[f32::NAN, 1., -1., 2.]);
        let m = Tensor::new(&[1f32, f32::NAN, 3.], &d)?;
        same_f32_bits(&m.max_all()?, &[f32::NAN]);
        same_f32_bits(&m.min_all()?, &[f32::NAN]);
        assert_eq!(m.argmax(0)?.to_vec::<i64>()?, vec![1]);
        assert_eq!(m.argmin(0)?.to_vec::<i64>()?, vec![1]);
        // The first NaN wins, along any dimension.
        let two = Tensor::new(&[[1f32, f32::NAN, f32::NAN], [f32::NAN, 2., 3.]], &d)?;
        assert_eq!(two.argmax(-1)?.to_vec::<i64>()?, vec![1, 0]);
        assert_eq!(two.argmin(0)?.to_vec::<i64>()?, vec![1, 0, 0]);
        same_f32_bits(&two.max(0)?, &[f32::NAN, f32::NAN, f32::NAN]);
        same_f32_bits(&two.max(1)?, &[f32::NAN, f32::NAN]);
        Ok(())
    });
}
