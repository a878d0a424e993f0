//! Conformance: autograd.

use crate::common::{assert_f32, devices, f32s, on_every_device};
use crate::t2;
use kiln::Tensor;

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
