//! PyTorch's numerics, each on the CPU and on two
//! simulated GPUs: NaN propagation, casts, gradients at the edges, empty
//! inputs, type promotion with scalars, negative dimensions.

use kiln::nn::{cross_entropy, mse_loss, one_hot};
use kiln::{cpu, DType, Device, Error, Result, Tensor};

fn devices() -> Vec<Device> {
    let mut d = vec![cpu()];
    d.extend(kiln::ensure_simulated_gpus(2, 512 << 20));
    d
}

fn each(f: impl Fn(Device) -> Result<()>) {
    for d in devices() {
        if let Err(e) = f(d) {
            panic!("on {d}: {e}");
        }
    }
}

/// f32 values compared bit for bit (so NaN equals NaN).
#[track_caller]
fn same(t: &Tensor, expected: &[f32]) {
    // NaN's sign is not specified (0/0 is −NaN on x86): compare NaN as NaN.
    let bits = |x: &f32| if x.is_nan() { u32::MAX } else { x.to_bits() };
    let got: Vec<u32> = t.to_vec::<f32>().unwrap().iter().map(bits).collect();
    let want: Vec<u32> = expected.iter().map(bits).collect();
    assert_eq!(got, want, "got {:?}, expected {expected:?} on {}", t.to_vec::<f32>().unwrap(), t.device());
}

const NAN: f32 = f32::NAN;

#[test]
fn nan_propagates_through_relu_maximum_minimum_clamp_and_reductions() {
    each(|d| {
        let x = Tensor::new(&[NAN, 1., -2., 3.], &d)?;
        same(&x.relu()?, &[NAN, 1., 0., 3.]);
        let y = Tensor::new(&[0f32, NAN, 5., -1.], &d)?;
        same(&x.maximum(&y)?, &[NAN, NAN, 5., 3.]);
        same(&x.minimum(&y)?, &[NAN, NAN, -2., -1.]);
        same(&x.maximum_scalar(0.0)?, &[NAN, 1., 0., 3.]);
        same(&x.minimum_scalar(0.0)?, &[NAN, 0., -2., 0.]);
        same(&x.clamp(-1.0, 2.0)?, &[NAN, 1., -1., 2.]);
        let m = Tensor::new(&[1f32, NAN, 3.], &d)?;
        same(&m.max_all()?, &[NAN]);
        same(&m.min_all()?, &[NAN]);
        assert_eq!(m.argmax(0)?.to_vec::<i64>()?, vec![1]);
        assert_eq!(m.argmin(0)?.to_vec::<i64>()?, vec![1]);
        // The first NaN wins, along any dimension.
        let two = Tensor::new(&[[1f32, NAN, NAN], [NAN, 2., 3.]], &d)?;
        assert_eq!(two.argmax(-1)?.to_vec::<i64>()?, vec![1, 0]);
        assert_eq!(two.argmin(0)?.to_vec::<i64>()?, vec![1, 0, 0]);
        same(&two.max(0)?, &[NAN, NAN, NAN]);
        same(&two.max(1)?, &[NAN, NAN]);
        Ok(())
    });
}

#[test]
fn gradients_of_minimum_maximum_at_nan_and_ties_match_pytorch() {
    each(|d| {
        // Ties split 0.5/0.5; where a NaN is involved, both get the gradient.
        let a = Tensor::new(&[1f32, 2., NAN, 4.], &d)?.requires_grad_();
        let b = Tensor::new(&[1f32, 3., 0., 0.], &d)?.requires_grad_();
        a.minimum(&b)?.sum_all()?.backward()?;
        same(&a.grad().unwrap(), &[0.5, 1., 1., 0.]);
        same(&b.grad().unwrap(), &[0.5, 0., 1., 1.]);
        let a = Tensor::new(&[1f32, 2., 5.], &d)?.requires_grad_();
        let b = Tensor::new(&[1f32, 3., 0.], &d)?.requires_grad_();
        a.maximum(&b)?.sum_all()?.backward()?;
        same(&a.grad().unwrap(), &[0.5, 0., 1.]);
        same(&b.grad().unwrap(), &[0.5, 1., 0.]);
        // A NaN gradient flowing into minimum stays NaN.
        let x = Tensor::new(&[1f32, 2.], &d)?.requires_grad_();
        let nan_scale = Tensor::new(&[NAN, 1.], &d)?;
        x.minimum(&Tensor::new(&[5f32, 5.], &d)?)?.mul(&nan_scale)?.sum_all()?.backward()?;
        same(&x.grad().unwrap(), &[NAN, 1.]);
        // clamp and the scalar max/min: PyTorch (2.15, measured by
        // scripts/diff-torch.sh) passes the gradient strictly inside
        // (min < x < max): 0 at the boundary and at NaN.
        let x = Tensor::new(&[-1f32, 0., 0.5, 1., 2., NAN], &d)?.requires_grad_();
        x.clamp(0.0, 1.0)?.sum_all()?.backward()?;
        same(&x.grad().unwrap(), &[0., 0., 1., 0., 0., 0.]);
        let x = Tensor::new(&[-1f32, 0., 1.], &d)?.requires_grad_();
        x.maximum_scalar(0.0)?.sum_all()?.backward()?;
        same(&x.grad().unwrap(), &[0., 0., 1.]);
        // pow: 0 where the exponent is 0 (base) and where the base is 0 with
        // an exponent >= 0 (exponent), as PyTorch's pow_backward.
        let a = Tensor::new(&[0f32, 0., 2.], &d)?.requires_grad_();
        let b = Tensor::new(&[0f32, 2., 0.], &d)?.requires_grad_();
        a.pow(&b)?.sum_all()?.backward()?;
        same(&a.grad().unwrap(), &[0., 0., 0.]);
        same(&b.grad().unwrap(), &[0., 0., 2f32.ln()]);
        // max of all with a NaN: the NaN gets the gradient.
        let x = Tensor::new(&[1f32, NAN, 3.], &d)?.requires_grad_();
        x.max_all()?.backward()?;
        same(&x.grad().unwrap(), &[0., 1., 0.]);
        // relu passes a NaN input's gradient (threshold_backward).
        let x = Tensor::new(&[NAN, -1., 2.], &d)?.requires_grad_();
        x.relu()?.sum_all()?.backward()?;
        same(&x.grad().unwrap(), &[1., 0., 1.]);
        Ok(())
    });
}

#[test]
fn casts_round_once_and_wrap_like_numpy() {
    each(|d| {
        let big = (1i64 << 60) + (1i64 << 36) + 1;
        let x = Tensor::new(&[big, -big], &d)?;
        assert_eq!(x.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![big as f32, -big as f32]);
        assert_eq!(big as f32, 2f32.powi(60) + 2f32.powi(37));
        let w = Tensor::new(&[300i64, -1, 256, 255], &d)?;
        assert_eq!(w.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![44, 255, 0, 255]);
        assert_eq!(Tensor::new(&[1i64 << 40, -3], &d)?.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![0, -3]);
        assert_eq!(Tensor::new(&[-1i32, 2], &d)?.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![255, 2]);
        Ok(())
    });
}

#[test]
fn index_add_is_differentiable_in_both_inputs() {
    each(|d| {
        let dst = Tensor::zeros((3, 2), DType::F32, &d)?.requires_grad_();
        let src = Tensor::new(&[[1f32, 2.], [3., 4.]], &d)?.requires_grad_();
        let ids = Tensor::new(&[2i64, 0], &d)?;
        let w = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &d)?;
        dst.index_add(&ids, &src, 0)?.mul(&w)?.sum_all()?.backward()?;
        same(&dst.grad().unwrap(), &[1., 2., 3., 4., 5., 6.]);
        same(&src.grad().unwrap(), &[5., 6., 1., 2.]);
        Ok(())
    });
}

#[test]
fn gradient_of_a_zeroth_power_is_zero_at_zero() {
    each(|d| {
        let x = Tensor::new(&[0f32, 2.], &d)?.requires_grad_();
        x.powi(0)?.sum_all()?.backward()?;
        same(&x.grad().unwrap(), &[0., 0.]);
        let x = Tensor::new(&[0f32, 2.], &d)?.requires_grad_();
        x.powf(0.0)?.sum_all()?.backward()?;
        same(&x.grad().unwrap(), &[0., 0.]);
        Ok(())
    });
}

#[test]
fn empty_means_and_losses_are_nan_and_empty_softmax_is_empty() {
    each(|d| {
        same(&Tensor::zeros((0, 3), DType::F32, &d)?.mean(0)?, &[NAN, NAN, NAN]);
        same(&Tensor::zeros((0,), DType::F32, &d)?.mean_all()?, &[NAN]);
        let e = Tensor::zeros((0, 1), DType::F32, &d)?;
        same(&mse_loss(&e, &e)?, &[NAN]);
        let logits = Tensor::zeros((0, 3), DType::F32, &d)?;
        let labels = Tensor::zeros((0,), DType::I64, &d)?;
        same(&cross_entropy(&logits, &labels)?, &[NAN]);
        let z = Tensor::zeros((2, 0), DType::F32, &d)?;
        assert_eq!(z.softmax(-1)?.dims(), &[2, 0]);
        assert_eq!(z.log_softmax(1)?.dims(), &[2, 0]);
        assert_eq!(kiln::nn::softmax(&z, -1)?.dims(), &[2, 0]);
        // softmax over any dimension, as a method.
        let x = Tensor::new(&[[0f32, 0.], [0., 0.]], &d)?;
        same(&x.softmax(0)?, &[0.5; 4]);
        Ok(())
    });
}

#[test]
fn one_hot_refuses_bad_labels() {
    let err = one_hot(&Tensor::new(&[0i64, 5, -1], &cpu()).unwrap(), 3, DType::F32).unwrap_err();
    assert!(matches!(&err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains("label 5 is out of range for 3 classes"), "{err}");
    assert_eq!(one_hot(&Tensor::new(&[2, 0], &cpu()).unwrap(), 3, DType::U8).unwrap().to_vec::<u8>().unwrap(), vec![0, 0, 1, 1, 0, 0]);
}

#[test]
fn integer_tensors_promote_with_fractional_or_out_of_range_scalars() {
    each(|d| {
        let x = Tensor::new(&[1i64, 2, 3], &d)?;
        let h = x.div_scalar(0.5)?;
        assert_eq!((h.dtype(), h.to_vec::<f32>()?), (DType::F32, vec![2., 4., 6.]));
        assert_eq!(x.div_scalar(2.0)?.to_vec::<f32>()?, vec![0.5, 1., 1.5], "true division, as PyTorch");
        assert_eq!(x.mul_scalar(0.5)?.to_vec::<f32>()?, vec![0.5, 1., 1.5]);
        assert_eq!(x.add_scalar(2.0)?.to_vec::<i64>()?, vec![3, 4, 5], "an integral scalar keeps the dtype");
        let b = Tensor::new(&[0u8, 5], &d)?;
        assert_eq!((&b + -1.0)?.to_vec::<f32>()?, vec![-1., 4.]);
        assert_eq!((&b + 300.0)?.to_vec::<f32>()?, vec![300., 305.]);
        assert_eq!(x.sqrt()?.dtype(), DType::F32);
        assert_eq!(x.div(&x)?.to_vec::<f32>()?, vec![1., 1., 1.]);
        let i = Tensor::new(&[7i32, -7], &d)?;
        assert_eq!((&i * 2.0)?.to_vec::<i32>()?, vec![14, -14]);
        assert_eq!(i.mul_scalar(1.5)?.to_vec::<f32>()?, vec![10.5, -10.5]);
        // Tensor-tensor ops of different dtypes promote, as PyTorch's.
        assert_eq!(x.add(&Tensor::new(&[1f32, 2., 3.], &d)?)?.to_vec::<f32>()?, vec![2., 4., 6.]);
        Ok(())
    });
}

#[test]
fn f32_sums_over_a_leading_dimension_are_accurate() {
    each(|d| {
        let x = Tensor::full(0.1, (1 << 20, 1), DType::F32, &d)?;
        assert_eq!(x.sum(0)?.to_vec::<f32>()?, vec![104857.6]);
        let x = Tensor::full(0.1, (1 << 20, 2), DType::F32, &d)?;
        assert_eq!(x.sum(0)?.to_vec::<f32>()?, vec![104857.6, 104857.6]);
        Ok(())
    });
}

#[test]
fn i32_works_across_ops() {
    each(|d| {
        let a = Tensor::new(&[[1, 2], [3, 4]], &d)?;
        assert_eq!(a.dtype(), DType::I32);
        assert_eq!(a.matmul(&a)?.to_vec::<i32>()?, vec![7, 10, 15, 22]);
        assert_eq!(a.sum(-1)?.to_vec::<i32>()?, vec![3, 7]);
        assert_eq!(a.max_all()?.to_vec::<i32>()?, vec![4]);
        assert_eq!(a.argmax(0)?.to_vec::<i64>()?, vec![1, 1]);
        assert_eq!(a.add(&a)?.to_vec::<i32>()?, vec![2, 4, 6, 8]);
        assert_eq!(a.lt(&a.t()?)?.to_vec::<u8>()?, vec![0, 1, 0, 0]);
        assert_eq!(a.to_dtype(DType::F64)?.to_vec::<f64>()?, vec![1., 2., 3., 4.]);
        let ids = Tensor::new(&[1, 0], &d)?;
        assert_eq!(a.index_select(&ids, 0)?.to_vec::<i32>()?, vec![3, 4, 1, 2]);
        assert_eq!(Tensor::cat(&[&a, &a], -1)?.dims(), &[2, 4]);
        assert_eq!(Tensor::full(3.0, 2, DType::I32, &d)?.to_vec::<i32>()?, vec![3, 3]);
        assert_eq!(Tensor::arange_dtype(0.0, 3.0, 1.0, DType::I32, &d)?.to_vec::<i32>()?, vec![0, 1, 2]);
        assert_eq!(a.neg()?.abs()?.to_vec::<i32>()?, vec![1, 2, 3, 4]);
        assert_eq!(a.to(&cpu())?.to_vec::<i32>()?, vec![1, 2, 3, 4]);
        assert_eq!(format!("{}", Tensor::new(&[1, 2], &cpu())?), "tensor([1, 2], dtype=i32)");
        Ok(())
    });
}

#[test]
fn negative_dimensions_count_from_the_end() {
    each(|d| {
        let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &d)?;
        assert_eq!(x.sum(-1)?.to_vec::<f32>()?, vec![6., 15.]);
        assert_eq!(x.sum(-2)?.to_vec::<f32>()?, vec![5., 7., 9.]);
        assert_eq!(x.max_keepdim(-1)?.dims(), &[2, 1]);
        assert_eq!(x.argmin(-1)?.to_vec::<i64>()?, vec![0, 0]);
        assert_eq!(x.transpose(-1, -2)?.dims(), &[3, 2]);
        assert_eq!(x.narrow(-1, 1, 2)?.to_vec::<f32>()?, vec![2., 3., 5., 6.]);
        assert_eq!(x.unsqueeze(-1)?.dims(), &[2, 3, 1]);
        assert_eq!(x.unsqueeze(-1)?.squeeze(-1)?.dims(), &[2, 3]);
        assert_eq!(Tensor::stack(&[&x, &x], -1)?.dims(), &[2, 3, 2]);
        assert_eq!(x.dim(-1)?, 3);
        assert!(matches!(x.sum(-3), Err(Error::InvalidArgument { .. })));
        assert!(matches!(x.sum(2), Err(Error::InvalidArgument { .. })));
        Ok(())
    });
}

#[test]
fn negative_dimensions_in_lists_of_dimensions() {
    each(|d| {
        let x = Tensor::new(&[[[1f32, 2.], [3., 4.], [5., 6.]]], &d)?; // (1, 3, 2)
        assert_eq!(x.sum_dims(&[-1], false)?.dims(), &[1, 3]);
        same(&x.sum_dims(&[-1], false)?, &[3., 7., 11.]);
        same(&x.sum_dims(&[0, -2], true)?, &[9., 12.]);
        assert_eq!(x.sum_dims(&[0, -2], true)?.dims(), &[1, 1, 2]);
        same(&x.mean_dims(&[-1, -2], false)?, &[3.5]);
        same(&x.reduce(kiln::Reduction::Max, &[-2], false)?, &[5., 6.]);
        assert_eq!(x.reduce(kiln::Reduction::ArgMax, &[-1i64], false)?.to_vec::<i64>()?, vec![1, 1, 1]);
        // usize lists (and Vec<usize>) still work.
        let dims: Vec<usize> = vec![1, 2];
        same(&x.sum_dims(&dims, false)?, &[21.]);
        // permute: -1 is the last dimension.
        let p = x.permute(&[-1, 0, 1])?;
        assert_eq!(p.dims(), &[2, 1, 3]);
        same(&p.contiguous()?, &[1., 3., 5., 2., 4., 6.]);
        let m = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &d)?;
        same(&m.permute(&[-1, 0])?.contiguous()?, &[1., 4., 2., 5., 3., 6.]);
        // Gradients flow through a negative-dimension reduction and permute.
        let w = Tensor::new(&[[1f32, 2.], [3., 4.]], &d)?.requires_grad_();
        w.permute(&[-1, -2])?.sqr()?.sum_dims(&[-1], false)?.sum_all()?.backward()?;
        same(&w.grad().expect("a gradient"), &[2., 4., 6., 8.]);

        // Out of range names the rank; a dimension named twice (once negative) is refused.
        for res in
            [x.sum_dims(&[-4], false), x.mean_dims(&[3], false), x.reduce(kiln::Reduction::Min, &[0, -4], false), x.permute(&[0, 1, 3])]
        {
            match res {
                Err(e @ Error::InvalidArgument { .. }) => assert!(e.to_string().contains("rank 3"), "{e}"),
                other => panic!("expected InvalidArgument naming the rank, got {other:?}"),
            }
        }
        assert!(matches!(x.sum_dims(&[2, -1], false), Err(Error::InvalidArgument { .. })));
        assert!(matches!(x.permute(&[0, 2, -1]), Err(Error::InvalidArgument { .. })));
        assert!(matches!(x.permute(&[0, -1]), Err(Error::InvalidArgument { .. })));
        Ok(())
    });
}

/// Out-of-range and negative indices: an error on the CPU (as in PyTorch);
/// on a GPU they are not read back (no hidden transfer or sync), so
/// `index_select` gives zeros and `index_add` ignores the row (PyTorch
/// device-asserts). Documented in the README's table and the ops' rustdoc.
#[test]
fn out_of_range_indices_are_an_error_on_the_cpu_and_reported_by_a_gpus_next_sync() {
    let x = |d: &Device| Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], d);
    for ids in [Tensor::new(&[-1i64, 1, i64::MIN, 3], &cpu()), Tensor::new(&[-1, 1, i32::MIN, 3], &cpu())] {
        let ids = ids.unwrap();
        // The CPU refuses them, naming the index and the size.
        match x(&cpu()).unwrap().index_select(&ids, 0) {
            Err(e @ Error::InvalidArgument { .. }) => {
                assert!(e.to_string().contains("index -1 is out of range for dimension 0 of size 3"), "{e}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        let src = Tensor::ones((4, 2), DType::F32, &cpu()).unwrap();
        match Tensor::zeros((3, 2), DType::F32, &cpu()).unwrap().index_add(&ids, &src, 0) {
            Err(e @ Error::InvalidArgument { .. }) => assert!(e.to_string().contains("out of range"), "{e}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        // A simulated GPU of this test's own: a reported fault poisons the
        // device's queue for every thread until it is reported, and the
        // other tests of this binary run beside this one on gpu(0) and gpu(1).
        {
            let d = kiln::ensure_simulated_gpus(3, 512 << 20)[2];
            let (ids, x) = (ids.to(&d).unwrap(), x(&d).unwrap());
            let (dst, ones) = (Tensor::zeros((3, 2), DType::F32, &d).unwrap(), Tensor::ones((4, 2), DType::F32, &d).unwrap());
            // Nothing is read back to check the indices (no transfer at all):
            // the kernel checks them and the next sync reports the first bad
            // one, as PyTorch's device-side assert (issue 18).
            let _none = kiln::transfer_guard(kiln::GuardLevel::Disallow);
            let _picked = x.index_select(&ids, 0).unwrap();
            match kiln::synchronize(&d) {
                Err(Error::KernelFailed { op, msg, .. }) => {
                    assert_eq!(op, "index_select");
                    assert!(msg.contains("index -1 is out of range for dimension 0 of size 3"), "{msg}");
                }
                other => panic!("expected KernelFailed, got {other:?}"),
            }
            let _added = dst.index_add(&ids, &ones, 0).unwrap();
            assert!(matches!(kiln::synchronize(&d), Err(Error::KernelFailed { op, .. }) if op == "index_add"));
            kiln::synchronize(&d).unwrap();
        }
    }
}
