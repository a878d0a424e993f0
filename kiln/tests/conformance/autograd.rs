//! Conformance: autograd.

use crate::common::{assert_f32, devices, f32s, on_every_device};
use crate::same_f32_bits;
use crate::t2;
use kiln::Tensor;
use kiln::{cpu, DType};

#[test]
fn autograd_on_every_device() {
    on_every_device(|d| {
        let x = Tensor::new(&[1f32, 2., 3.], &d)?.requires_grad_();
        let y = x.sqr()?.sum_all()?;
        y.backward()?;
        let g = x.grad().expect("a gradient");
        assert_f32(&g, d, &[3], &[2., 4., 6.]);
        // Gradients accumulate until zeroed.
        x.sqr()?.sum_all()?.backward()?;
        assert_f32(&x.grad().expect("a gradient"), d, &[3], &[4., 8., 12.]);
        x.zero_grad();
        assert!(x.grad().is_none());
        // Matmul and broadcasting: loss = sum(W @ v + b).
        let w = t2(&[&[1., 2.], &[3., 4.]], d)?.requires_grad_();
        let v = Tensor::new(&[5f32, 6.], &d)?.requires_grad_();
        let b = Tensor::new(&[1f32], &d)?.requires_grad_();
        let loss = (&w.matmul(&v)? + &b)?.sum_all()?;
        assert_f32(&loss, d, &[], &[17. + 39. + 2.]);
        loss.backward()?;
        assert_f32(&w.grad().expect("dW"), d, &[2, 2], &[5., 6., 5., 6.]);
        assert_f32(&v.grad().expect("dv"), d, &[2], &[4., 6.]);
        assert_f32(&b.grad().expect("db"), d, &[1], &[2.]);
        // Views, mean and relu.
        let z = Tensor::new(&[[-1f32, 2.], [3., -4.]], &d)?.requires_grad_();
        z.t()?.relu()?.narrow(0, 0, 1)?.mean_all()?.backward()?;
        assert_f32(&z.grad().expect("dz"), d, &[2, 2], &[0., 0., 0.5, 0.]);
        // no_grad and detach record nothing.
        {
            let _g = kiln::no_grad();
            assert!(!(&x * 2.0)?.requires_grad());
        }
        assert!(!x.detach().requires_grad());
        Ok(())
    });
}

#[test]
fn gradients_flow_back_across_devices() {
    let all = devices();
    for &d in &all {
        for &e in &all {
            if d == e {
                continue;
            }
            let x = Tensor::new(&[1f32, -2.], &d).unwrap().requires_grad_();
            let y = x.to(&e).unwrap();
            assert_eq!(y.device(), e);
            y.mul_scalar(3.0).unwrap().sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let g = x.grad().expect("a gradient");
            assert_eq!(g.device(), d, "the gradient of a leaf lives on the leaf's device");
            assert_eq!(f32s(&g, d), vec![18., -36.]);
        }
        crate::common::report_ran(d);
    }
}

#[test]
fn gradients_of_minimum_maximum_at_nan_and_ties_match_pytorch() {
    on_every_device(|d| {
        // Ties split 0.5/0.5; where a NaN is involved, both get the gradient.
        let a = Tensor::new(&[1f32, 2., f32::NAN, 4.], &d)?.requires_grad_();
        let b = Tensor::new(&[1f32, 3., 0., 0.], &d)?.requires_grad_();
        a.minimum(&b)?.sum_all()?.backward()?;
        same_f32_bits(&a.grad().unwrap(), &[0.5, 1., 1., 0.]);
        same_f32_bits(&b.grad().unwrap(), &[0.5, 0., 1., 1.]);
        let a = Tensor::new(&[1f32, 2., 5.], &d)?.requires_grad_();
        let b = Tensor::new(&[1f32, 3., 0.], &d)?.requires_grad_();
        a.maximum(&b)?.sum_all()?.backward()?;
        same_f32_bits(&a.grad().unwrap(), &[0.5, 0., 1.]);
        same_f32_bits(&b.grad().unwrap(), &[0.5, 1., 0.]);
        // A NaN gradient flowing into minimum stays NaN.
        let x = Tensor::new(&[1f32, 2.], &d)?.requires_grad_();
        let nan_scale = Tensor::new(&[f32::NAN, 1.], &d)?;
        x.minimum(&Tensor::new(&[5f32, 5.], &d)?)?.mul(&nan_scale)?.sum_all()?.backward()?;
        same_f32_bits(&x.grad().unwrap(), &[f32::NAN, 1.]);
        // clamp and the scalar max/min: PyTorch (2.15, measured by
        // scripts/diff-torch.sh) passes the gradient strictly inside
        // (min < x < max): 0 at the boundary and at NaN.
        let x = Tensor::new(&[-1f32, 0., 0.5, 1., 2., f32::NAN], &d)?.requires_grad_();
        x.clamp(0.0, 1.0)?.sum_all()?.backward()?;
        same_f32_bits(&x.grad().unwrap(), &[0., 0., 1., 0., 0., 0.]);
        let x = Tensor::new(&[-1f32, 0., 1.], &d)?.requires_grad_();
        x.maximum_scalar(0.0)?.sum_all()?.backward()?;
        same_f32_bits(&x.grad().unwrap(), &[0., 0., 1.]);
        // pow: 0 where the exponent is 0 (base) and where the base is 0 with
        // an exponent >= 0 (exponent), as PyTorch's pow_backward.
        let a = Tensor::new(&[0f32, 0., 2.], &d)?.requires_grad_();
        let b = Tensor::new(&[0f32, 2., 0.], &d)?.requires_grad_();
        a.pow(&b)?.sum_all()?.backward()?;
        same_f32_bits(&a.grad().unwrap(), &[0., 0., 0.]);
        same_f32_bits(&b.grad().unwrap(), &[0., 0., 2f32.ln()]);
        // max of all with a NaN: the NaN gets the gradient.
        let x = Tensor::new(&[1f32, f32::NAN, 3.], &d)?.requires_grad_();
        x.max_all()?.backward()?;
        same_f32_bits(&x.grad().unwrap(), &[0., 1., 0.]);
        // relu passes a NaN input's gradient (threshold_backward).
        let x = Tensor::new(&[f32::NAN, -1., 2.], &d)?.requires_grad_();
        x.relu()?.sum_all()?.backward()?;
        same_f32_bits(&x.grad().unwrap(), &[1., 0., 1.]);
        Ok(())
    });
}

#[test]
fn index_add_is_differentiable_in_both_inputs() {
    on_every_device(|d| {
        let dst = Tensor::zeros((3, 2), DType::F32, &d)?.requires_grad_();
        let src = Tensor::new(&[[1f32, 2.], [3., 4.]], &d)?.requires_grad_();
        let ids = Tensor::new(&[2i64, 0], &d)?;
        let w = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &d)?;
        dst.index_add(&ids, &src, 0)?.mul(&w)?.sum_all()?.backward()?;
        same_f32_bits(&dst.grad().unwrap(), &[1., 2., 3., 4., 5., 6.]);
        same_f32_bits(&src.grad().unwrap(), &[5., 6., 1., 2.]);
        Ok(())
    });
}

#[test]
fn gradient_of_a_zeroth_power_is_zero_at_zero() {
    on_every_device(|d| {
        let x = Tensor::new(&[0f32, 2.], &d)?.requires_grad_();
        x.powi(0)?.sum_all()?.backward()?;
        same_f32_bits(&x.grad().unwrap(), &[0., 0.]);
        let x = Tensor::new(&[0f32, 2.], &d)?.requires_grad_();
        x.powf(0.0)?.sum_all()?.backward()?;
        same_f32_bits(&x.grad().unwrap(), &[0., 0.]);
        Ok(())
    });
}

#[test]
fn the_gradient_of_a_tied_maximum_is_shared() {
    let x = Tensor::new(&[1f32, 3., 3.], &cpu()).unwrap().requires_grad_();
    x.max_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![0., 0.5, 0.5]);
}

#[test]
fn powi_of_the_smallest_exponent_differentiates_without_overflow() {
    let x = Tensor::new(&[1f64], &cpu()).unwrap().requires_grad_();
    x.powi(i32::MIN).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![i32::MIN as f64]);
}
