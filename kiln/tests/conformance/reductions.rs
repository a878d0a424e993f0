//! Conformance: reductions.

use crate::common::{assert_close, assert_f32, assert_values, devices, f32s, on_every_device};
use crate::same_f32_bits;
use crate::t2;
use kiln::nn::{cross_entropy, mse_loss};
use kiln::{cpu, DType, Reduction, Tensor};

#[test]
fn reductions_over_all_and_axes() {
    on_every_device(|d| {
        let x = t2(&[&[1., 5., 2.], &[7., 0., 7.]], d)?;
        assert_f32(&x.sum_all()?, d, &[], &[22.]);
        assert_f32(&x.sum(0)?, d, &[3], &[8., 5., 9.]);
        assert_f32(&x.sum(1)?, d, &[2], &[8., 14.]);
        assert_f32(&x.sum_keepdim(1)?, d, &[2, 1], &[8., 14.]);
        assert_f32(&x.sum_keepdim(0)?, d, &[1, 3], &[8., 5., 9.]);
        assert_f32(&x.sum_dims(&[0, 1], true)?, d, &[1, 1], &[22.]);
        assert_f32(&x.sum_dims(&[1, 0], false)?, d, &[], &[22.]);
        // An empty list reduces every dimension, as PyTorch's sum(x, dim=[]).
        assert_f32(&x.sum_dims(&[0usize; 0], false)?, d, &[], &[22.]);
        assert_f32(&x.sum_dims(&[0usize; 0], true)?, d, &[1, 1], &[22.]);
        assert_f32(&x.mean_dims(&[0usize; 0], false)?, d, &[], &[22. / 6.]);
        assert_f32(&x.reduce(Reduction::Max, &[0usize; 0], false)?, d, &[], &[7.]);
        assert!(x.reduce(Reduction::ArgMax, &[0usize; 0], false).is_err(), "argmax names one dimension");
        assert_f32(&x.mean_all()?, d, &[], &[22. / 6.]);
        assert_f32(&x.mean(0)?, d, &[3], &[4., 2.5, 4.5]);
        assert_f32(&x.mean_keepdim(1)?, d, &[2, 1], &[8. / 3., 14. / 3.]);
        assert_f32(&x.max_all()?, d, &[], &[7.]);
        assert_f32(&x.max(1)?, d, &[2], &[5., 7.]);
        assert_f32(&x.max_keepdim(0)?, d, &[1, 3], &[7., 5., 7.]);
        assert_f32(&x.min_all()?, d, &[], &[0.]);
        assert_f32(&x.min(0)?, d, &[3], &[1., 0., 2.]);
        assert_f32(&x.min_keepdim(1)?, d, &[2, 1], &[1., 0.]);
        // argmax: the first index on ties.
        assert_values(&x.argmax(1)?, d, &[2], &[1., 0.]);
        assert_eq!(x.argmax(1)?.dtype(), DType::I64);
        assert_values(&x.argmax(0)?, d, &[3], &[1., 0., 1.]);
        assert_values(&x.argmax_keepdim(1)?, d, &[2, 1], &[1., 0.]);
        assert_values(&x.argmin(1)?, d, &[2], &[0., 1.]);
        // Over a transposed (strided) view.
        let xt = x.t()?;
        assert_f32(&xt.sum(1)?, d, &[3], &[8., 5., 9.]);
        assert_f32(&xt.sum(0)?, d, &[2], &[8., 14.]);
        assert_f32(&xt.max(0)?, d, &[2], &[5., 7.]);
        assert_values(&xt.argmax(0)?, d, &[2], &[1., 0.]);
        // Rank 3 over the outer two axes.
        let c = Tensor::arange(0.0, 24.0, 1.0, &d)?.reshape((2, 3, 4))?;
        let expect: Vec<f32> = (0..3).map(|j| (0..2).flat_map(|i| (0..4).map(move |k| (12 * i + 4 * j + k) as f32)).sum()).collect();
        assert_f32(&c.sum_dims(&[0, 2], false)?, d, &[3], &expect);
        assert_f32(&c.sum_dims(&[0, 2], true)?, d, &[1, 3, 1], &expect);
        assert_f32(&c.max(2)?, d, &[2, 3], &[3., 7., 11., 15., 19., 23.]);
        // Integers reduce in their own dtype.
        let i = Tensor::new(&[[1i64, -4], [10, 3]], &d)?;
        assert_eq!(i.sum(0)?.to_vec::<i64>()?, vec![11, -1]);
        assert_eq!(i.max_all()?.to_vec::<i64>()?, vec![10]);
        assert_eq!(i.min(1)?.to_vec::<i64>()?, vec![-4, 3]);
        // An empty sum is 0.
        assert_f32(&Tensor::zeros((0, 2), DType::F32, &d)?.sum(0)?, d, &[2], &[0., 0.]);
        Ok(())
    });
}

#[test]
fn sums_of_many_elements_agree_across_devices() {
    kiln::manual_seed(99);
    let host = Tensor::rand((300, 257), &cpu()).unwrap();
    let reference: Vec<f64> = {
        let v = host.to_vec::<f32>().unwrap();
        (0..257).map(|j| (0..300).map(|i| v[i * 257 + j] as f64).sum()).collect()
    };
    let total: f64 = reference.iter().sum();
    for d in devices() {
        let x = host.to(&d).unwrap();
        assert_close(&f32s(&x.sum(0).unwrap(), d), &reference, 1e-6, &format!("column sums on {d}"));
        assert_close(&f32s(&x.sum_all().unwrap(), d), &[total], 1e-6, &format!("total on {d}"));
        assert_close(&f32s(&x.t().unwrap().sum(1).unwrap(), d), &reference, 1e-6, &format!("transposed sums on {d}"));
        crate::common::report_ran(d);
    }
}

#[test]
fn products_values_and_gradients() {
    on_every_device(|d| {
        let x = t2(&[&[1., -2., 3.], &[0.5, 4., -1.]], d)?;
        assert_f32(&x.prod_all()?, d, &[], &[12.]);
        assert_f32(&x.prod(0)?, d, &[3], &[0.5, -8., -3.]);
        assert_f32(&x.prod_keepdim(-1)?, d, &[2, 1], &[-6., -2.]);
        assert_f32(&x.t()?.prod(0)?, d, &[2], &[-6., -2.]);
        assert_f32(&x.prod_dims(&[0, 1], false)?, d, &[], &[12.]);
        // Empty products are 1; integers wrap in their dtype.
        assert_f32(&Tensor::zeros((0, 2), DType::F32, &d)?.prod(0)?, d, &[2], &[1., 1.]);
        assert_eq!(Tensor::new(&[[3i64, -4], [5, 6]], &d)?.prod(1)?.to_vec::<i64>()?, vec![-12, 30]);
        assert_eq!(Tensor::new(&[16u8, 17], &d)?.prod_all()?.to_vec::<u8>()?, vec![16]);
        assert_eq!(Tensor::new(&[1i64 << 62, 4], &d)?.prod_all()?.to_vec::<i64>()?, vec![0]);
        // Gradients: no zero (y/x), one zero (the product of the others at
        // it, 0 elsewhere), two zeros (0 everywhere); f64 for exactness.
        let x = Tensor::new(&[[2f64, 3., 4.], [0., 5., 6.], [0., 7., 0.]], &d)?.requires_grad_();
        let w = Tensor::new(&[1f64, 10., 100.], &d)?;
        x.prod(1)?.mul(&w)?.sum_all()?.backward()?;
        assert_values(&x.grad().expect("prod has a gradient"), d, &[3, 3], &[12., 8., 6., 300., 0., 0., 0., 0., 0.]);
        // A NaN makes the product NaN.
        let n = Tensor::new(&[f32::NAN, 2.], &d)?;
        assert!(n.prod_all()?.to_vec::<f32>()?[0].is_nan());
        Ok(())
    });
}

#[test]
fn sums_of_squares_and_the_norm_values_and_gradients() {
    on_every_device(|d| {
        let x = t2(&[&[1., -2., 3.], &[0.5, 4., -1.]], d)?;
        let sq = |t: &Tensor, dims: &[i64], keep: bool| t.reduce(Reduction::SumSquares, dims, keep);
        assert_f32(&sq(&x, &[0, 1], false)?, d, &[], &[31.25]);
        assert_f32(&sq(&x, &[0], false)?, d, &[3], &[1.25, 20., 10.]);
        assert_f32(&sq(&x, &[-1], true)?, d, &[2, 1], &[14., 17.25]);
        assert_f32(&sq(&x.t()?, &[0], false)?, d, &[2], &[14., 17.25]);
        // Empty: 0; integers square and sum in their dtype, wrapping.
        assert_f32(&sq(&Tensor::zeros((0, 2), DType::F32, &d)?, &[0], false)?, d, &[2], &[0., 0.]);
        assert_eq!(sq(&Tensor::new(&[[3i64, -4], [5, 6]], &d)?, &[1], false)?.to_vec::<i64>()?, vec![25, 61]);
        assert_eq!(sq(&Tensor::new(&[16u8, 3], &d)?, &[0], false)?.to_vec::<u8>()?, vec![9]);
        // Floats square in f64 and round once: 4097² + 1 = 16785410 exactly
        // (squaring in f32 first would round 4097² to 16785408, and the sum
        // to 16785408). A sum past f32's range is inf.
        assert_eq!(sq(&Tensor::new(&[4097f32, 1.], &d)?, &[0], false)?.to_vec::<f32>()?, vec![16785410.]);
        assert_eq!(sq(&Tensor::new(&[1e20f32, 1e20], &d)?, &[0], false)?.to_vec::<f32>()?, vec![f32::INFINITY]);
        // NaN and infinities propagate.
        assert!(sq(&Tensor::new(&[f32::NAN, 2.], &d)?, &[0], false)?.to_vec::<f32>()?[0].is_nan());
        assert_eq!(sq(&Tensor::new(&[f32::NEG_INFINITY, 2.], &d)?, &[0], false)?.to_vec::<f32>()?, vec![f32::INFINITY]);
        // The gradient is 2·x·g; the norm's is x/‖x‖ (f64 for exactness).
        let x = Tensor::new(&[[2f64, -3.], [0., 6.]], &d)?.requires_grad_();
        let w = Tensor::new(&[10f64, 100.], &d)?;
        sq(&x, &[0], false)?.mul(&w)?.sum_all()?.backward()?;
        assert_values(&x.grad().expect("sum_squares has a gradient"), d, &[2, 2], &[40., -600., 0., 1200.]);
        let x = Tensor::new(&[2f64, -2., 2., -2.], &d)?.requires_grad_();
        let n = x.norm()?;
        assert_values(&n, d, &[], &[4.]);
        n.backward()?;
        assert_values(&x.grad().expect("norm has a gradient"), d, &[4], &[0.5, -0.5, 0.5, -0.5]);
        Ok(())
    });
}

/// The norm at its extremes, as PyTorch's: its gradient at a zero tensor is
/// 0 (not NaN: weight decay through the norm of zero parameters), and in
/// f32 the squares sum and the root is taken in f64 before the one
/// rounding, so a norm whose squares overflow or underflow f32 is exact.
#[test]
fn the_norm_of_zeros_has_gradient_zero_and_f32_norms_neither_overflow_nor_underflow() {
    on_every_device(|d| {
        for dtype in [DType::F32, DType::F64] {
            let x = Tensor::zeros((2, 3), dtype, &d)?.requires_grad_();
            let n = x.norm()?;
            assert_eq!(n.to_vec_f64()?, vec![0.0]);
            n.mul_scalar(3.0)?.backward()?;
            assert_eq!(x.grad().expect("norm has a gradient").to_vec_f64()?, vec![0.0; 6], "{dtype} on {d}");
            // A zero tensor's gradient is 0 also through a sum with other terms.
            let p = Tensor::zeros(4, dtype, &d)?.requires_grad_();
            (p.norm()? + p.sum_all()?)?.backward()?;
            assert_eq!(p.grad().unwrap().to_vec_f64()?, vec![1.0; 4]);
        }
        let norm = |v: &[f32]| -> kiln::Result<f32> { Tensor::new(v, &d)?.norm()?.to_scalar::<f32>() };
        assert_eq!(norm(&[2e19])?, 2e19);
        assert_eq!(norm(&[-2e19, 0.0])?, 2e19);
        assert_eq!(norm(&[1e-25])?, 1e-25);
        assert_eq!(norm(&[3e-30, 4e-30])?, 5e-30);
        assert_eq!(norm(&[3e30, 4e30])?, 5e30);
        // Past f32's range the norm itself is inf; NaN propagates.
        assert_eq!(norm(&[3e38, 3e38])?, f32::INFINITY);
        assert!(norm(&[f32::NAN, 1.0])?.is_nan());
        // Many elements and over a strided view, with the gradient x/‖x‖.
        let big = Tensor::full(1e20, (64, 65), DType::F32, &d)?.t()?.requires_grad_();
        let n = big.norm()?;
        assert_eq!(n.to_scalar::<f32>()?, ((1e20f32 as f64).powi(2) * 4160.0).sqrt() as f32);
        n.backward()?;
        let g = big.grad().unwrap().to_vec::<f32>()?;
        let want = (1.0 / (64.0f64 * 65.0).sqrt()) as f32;
        assert!(g.iter().all(|&v| (v - want).abs() <= 1e-6 * want), "{} != {want}", g[0]);
        // var and std square deviations in f64 too.
        let x = Tensor::new(&[2e19f32, -2e19], &d)?;
        assert_eq!(x.std_dims(&[0], 0.0, false)?.to_scalar::<f32>()?, 2e19);
        assert_eq!(x.var_dims(&[0], 0.0, false)?.to_scalar::<f32>()?, f32::INFINITY);
        let x = Tensor::new(&[1e-25f32, -1e-25], &d)?;
        assert_eq!(x.std_dims(&[0], 0.0, false)?.to_scalar::<f32>()?, 1e-25);
        // Integers are refused through reduce too (their squares would wrap).
        assert!(matches!(Tensor::new(&[3i64, 4], &d)?.reduce(Reduction::Norm, &[0], false), Err(kiln::Error::UnsupportedDType { .. })));
        Ok(())
    });
}

/// Naming one dimension twice is refused (PyTorch: "dim 0 appears multiple
/// times in the list of dims"), also on a 0-d tensor through 0 and −1.
#[test]
fn a_dimension_named_twice_is_refused_also_on_a_scalar() {
    on_every_device(|d| {
        let s = Tensor::new(&5f32, &d)?;
        assert_f32(&s.sum_dims(&[0], false)?, d, &[], &[5.]);
        assert_f32(&s.sum_dims(&[0usize; 0], false)?, d, &[], &[5.]);
        for t in [s.clone(), Tensor::ones((2, 3), DType::F32, &d)?] {
            for dims in [&[0i64, -1][..], &[0, 0], &[-1, -1]] {
                if t.rank() == 2 && dims == [0, -1] {
                    continue;
                }
                let err = t.sum_dims(dims, false).expect_err("a dimension named twice");
                assert!(err.to_string().contains("appears multiple times"), "{err}");
                assert!(t.mean_dims(dims, false).is_err());
                assert!(t.var_dims(dims, 1.0, false).is_err());
                assert!(t.logsumexp(dims, false).is_err());
            }
        }
        Ok(())
    });
}

#[test]
fn running_sums_values_and_gradients() {
    on_every_device(|d| {
        let x = t2(&[&[1., 2., 3.], &[4., 5., 6.]], d)?;
        assert_f32(&x.cumsum(1)?, d, &[2, 3], &[1., 3., 6., 4., 9., 15.]);
        assert_f32(&x.cumsum(0)?, d, &[2, 3], &[1., 2., 3., 5., 7., 9.]);
        assert_f32(&x.cumsum(-1)?, d, &[2, 3], &[1., 3., 6., 4., 9., 15.]);
        // Over a transposed (strided) view and a rank-3 middle dimension.
        assert_f32(&x.t()?.cumsum(0)?, d, &[3, 2], &[1., 4., 3., 9., 6., 15.]);
        let c = Tensor::arange(0.0, 12.0, 1.0, &d)?.reshape((2, 3, 2))?;
        assert_f32(&c.cumsum(1)?, d, &[2, 3, 2], &[0., 1., 2., 4., 6., 9., 6., 7., 14., 16., 24., 27.]);
        // f32 accumulates in f64 and rounds each output (as PyTorch's CPU scan).
        let big = Tensor::new(&[16777216f32, 1., 1.], &d)?;
        assert_eq!(big.cumsum(0)?.to_vec::<f32>()?, vec![16777216., 16777216., 16777218.]);
        // Integers keep their dtype and wrap; a scalar is its own cumsum.
        assert_eq!(Tensor::new(&[1i64, -4, 10], &d)?.cumsum(0)?.to_vec::<i64>()?, vec![1, -3, 7]);
        assert_eq!(Tensor::new(&[200u8, 100], &d)?.cumsum(0)?.to_vec::<u8>()?, vec![200, 44]);
        assert_eq!(Tensor::new(&[7i32, 8], &d)?.cumsum(0)?.dtype(), DType::I32);
        assert_f32(&Tensor::new(&3f32, &d)?.cumsum(-1)?, d, &[], &[3.]);
        assert!(matches!(Tensor::new(&3f32, &d)?.cumsum(1), Err(kiln::Error::InvalidArgument { .. })));
        assert!(matches!(x.cumsum(2), Err(kiln::Error::InvalidArgument { .. })));
        assert_f32(&Tensor::zeros((0, 3), DType::F32, &d)?.cumsum(0)?, d, &[0, 3], &[]);
        assert_f32(&Tensor::zeros((2, 0), DType::F32, &d)?.cumsum(1)?, d, &[2, 0], &[]);
        // The gradient is the running sum of g from the end; through two
        // scans, the reversed scan twice.
        let x = Tensor::new(&[[1f64, 2., 3.], [4., 5., 6.]], &d)?.requires_grad_();
        let w = Tensor::new(&[[1f64, 10., 100.], [1000., 10000., 100000.]], &d)?;
        x.cumsum(1)?.mul(&w)?.sum_all()?.backward()?;
        assert_values(&x.grad().expect("cumsum has a gradient"), d, &[2, 3], &[111., 110., 100., 111000., 110000., 100000.]);
        let x = Tensor::new(&[1f64, 2., 3.], &d)?.requires_grad_();
        x.cumsum(0)?.cumsum(0)?.mul(&Tensor::new(&[0f64, 0., 1.], &d)?)?.sum_all()?.backward()?;
        assert_values(&x.grad().expect("gradient"), d, &[3], &[3., 2., 1.]);
        Ok(())
    });
}

#[test]
fn empty_means_and_losses_are_nan_and_empty_softmax_is_empty() {
    on_every_device(|d| {
        same_f32_bits(&Tensor::zeros((0, 3), DType::F32, &d)?.mean(0)?, &[f32::NAN, f32::NAN, f32::NAN]);
        same_f32_bits(&Tensor::zeros((0,), DType::F32, &d)?.mean_all()?, &[f32::NAN]);
        let e = Tensor::zeros((0, 1), DType::F32, &d)?;
        same_f32_bits(&mse_loss(&e, &e)?, &[f32::NAN]);
        let logits = Tensor::zeros((0, 3), DType::F32, &d)?;
        let labels = Tensor::zeros((0,), DType::I64, &d)?;
        same_f32_bits(&cross_entropy(&logits, &labels)?, &[f32::NAN]);
        let z = Tensor::zeros((2, 0), DType::F32, &d)?;
        assert_eq!(z.softmax(-1)?.dims(), &[2, 0]);
        assert_eq!(z.log_softmax(1)?.dims(), &[2, 0]);
        assert_eq!(kiln::nn::softmax(&z, -1)?.dims(), &[2, 0]);
        // softmax over any dimension, as a method.
        let x = Tensor::new(&[[0f32, 0.], [0., 0.]], &d)?;
        same_f32_bits(&x.softmax(0)?, &[0.5; 4]);
        Ok(())
    });
}

#[test]
fn f32_sums_over_a_leading_dimension_are_accurate() {
    on_every_device(|d| {
        let x = Tensor::full(0.1, (1 << 20, 1), DType::F32, &d)?;
        assert_eq!(x.sum(0)?.to_vec::<f32>()?, vec![104857.6]);
        let x = Tensor::full(0.1, (1 << 20, 2), DType::F32, &d)?;
        assert_eq!(x.sum(0)?.to_vec::<f32>()?, vec![104857.6, 104857.6]);
        Ok(())
    });
}

#[test]
fn integer_sums_wrap_the_same_way_whatever_the_layout() {
    let x = Tensor::new(&[200u8, 100], &cpu()).unwrap();
    assert_eq!(x.sum_all().unwrap().to_scalar::<u8>().unwrap(), 44); // 300 mod 256
    let rows = Tensor::new(&[[200u8, 100], [1, 1]], &cpu()).unwrap();
    assert_eq!(rows.sum(1).unwrap().to_vec::<u8>().unwrap(), vec![44, 2]);
    let big = Tensor::new(&[(1i64 << 53) + 1, 0], &cpu()).unwrap();
    assert_eq!(big.sum_all().unwrap().to_scalar::<i64>().unwrap(), (1i64 << 53) + 1);
}
