//! Conformance: dtypes as PyTorch promotes them, and the ops
//! PyTorch refuses for integers. Reference values are PyTorch 2.x's
//! (`torch.result_type`, `torch.promote_types`), written as literals.

use crate::common::{assert_f32, assert_values, on_every_device};
use kiln::cpu;
use kiln::{DType, Error, Tensor};

const ALL: [DType; 7] = [DType::U8, DType::I32, DType::I64, DType::F16, DType::BF16, DType::F32, DType::F64];

#[test]
fn promote_types_is_pytorchs_table() {
    use DType::*;
    // torch.promote_types over (u8, i32, i64, f16, bf16, f32, f64), row by row.
    let table = [
        [U8, I32, I64, F16, BF16, F32, F64],
        [I32, I32, I64, F16, BF16, F32, F64],
        [I64, I64, I64, F16, BF16, F32, F64],
        [F16, F16, F16, F16, F32, F32, F64],
        [BF16, BF16, BF16, F32, BF16, F32, F64],
        [F32, F32, F32, F32, F32, F32, F64],
        [F64, F64, F64, F64, F64, F64, F64],
    ];
    for (i, a) in ALL.iter().enumerate() {
        for (j, b) in ALL.iter().enumerate() {
            assert_eq!(a.promote(*b), table[i][j], "promote({a}, {b})");
        }
    }
    // torch.result_type: 0-d tensors count as scalars for dtype purposes.
    let r = |ops: &[(DType, usize)]| DType::result_type(ops).unwrap();
    assert_eq!(r(&[(F32, 1), (F64, 0)]), F32);
    assert_eq!(r(&[(I32, 1), (F64, 0)]), F64);
    assert_eq!(r(&[(I64, 1), (F16, 0)]), F16);
    assert_eq!(r(&[(U8, 1), (I64, 0)]), U8);
    assert_eq!(r(&[(U8, 0), (I32, 0)]), I32);
    assert_eq!(r(&[(F16, 2), (BF16, 0)]), F16);
    assert_eq!(r(&[(U8, 1), (I32, 3), (F64, 0)]), F64);
    assert_eq!(DType::result_type(&[]), None);
}

#[test]
fn binary_ops_promote_mixed_dtypes() {
    on_every_device(|d| {
        // The program: u8 → f32 through a scalar, then back with its input.
        let v0 = Tensor::new(&[3u8, 250, 0], &d)?;
        let v1 = v0.sub_scalar(-2.0)?;
        assert_eq!(v1.dtype(), DType::F32);
        assert_f32(&v1.minimum(&v0)?, d, &[3], &[3., 250., 0.]);
        assert_f32(&v0.maximum(&v1)?, d, &[3], &[5., 252., 2.]);
        assert_values(&v1.gt(&v0)?, d, &[3], &[1., 1., 1.]);
        assert_eq!(v1.gt(&v0)?.dtype(), DType::U8);
        // Integers widen: u8 with i32 is i32 (no wrap at 256).
        let i = Tensor::new(&[10i32, -300, 7], &d)?;
        let s = v0.add(&i)?;
        assert_eq!(s.dtype(), DType::I32);
        assert_values(&s, d, &[3], &[13., -50., 7.]);
        assert_eq!(i.mul(&Tensor::new(&[2i64, 2, 2], &d)?)?.dtype(), DType::I64);
        // Integer true division is f32 whatever the integer dtypes.
        assert_f32(&i.div(&Tensor::new(&[4u8, 3, 2], &d)?)?, d, &[3], &[2.5, -100., 3.5]);
        // Floats widen; f16 with bf16 is f32.
        let h = Tensor::new(&[0.5f32, 1.5], &d)?.to_dtype(DType::F16)?;
        let b = Tensor::new(&[0.25f32, 2.0], &d)?.to_dtype(DType::BF16)?;
        assert_f32(&h.add(&b)?, d, &[2], &[0.75, 3.5]);
        let w = Tensor::new(&[1.0f64, 1e-10], &d)?;
        let sum = Tensor::new(&[1f32, 1.], &d)?.add(&w)?;
        assert_values(&sum, d, &[2], &[2.0, 1.0 + 1e-10]);
        assert_eq!(sum.dtype(), DType::F64);
        // A 0-d tensor counts as a scalar: f32 + f64 0-d stays f32; i32 +
        // f64 0-d is f64 (higher category); u8 + i64 0-d stays u8.
        let f = Tensor::new(&[1f32, 2.], &d)?;
        assert_eq!(f.add(&Tensor::new(&0.5f64, &d)?)?.dtype(), DType::F32);
        assert_eq!(i.add(&Tensor::new(&0.5f64, &d)?)?.dtype(), DType::F64);
        let wrapped = v0.add(&Tensor::new(&10i64, &d)?)?;
        assert_eq!(wrapped.dtype(), DType::U8);
        assert_values(&wrapped, d, &[3], &[13., 4., 10.]);
        // pow of an integer and a float is the float's; of two integers it stays refused.
        assert_f32(&i.pow(&Tensor::new(&[1f32, 1., 2.], &d)?)?, d, &[3], &[10., -300., 49.]);
        assert!(matches!(i.pow(&v0), Err(Error::UnsupportedDType { .. })));
        // Shapes are checked before any cast is launched.
        assert!(matches!(v0.add(&Tensor::new(&[1f32, 2.], &d)?), Err(Error::ShapeMismatch { .. })));
        Ok(())
    });
}

#[test]
fn gradients_flow_back_to_each_operand_in_its_own_dtype() {
    on_every_device(|d| {
        let a = Tensor::new(&[1f32, 2., 3.], &d)?.requires_grad_();
        let b = Tensor::new(&[0.5f64, -1.0, 2.0], &d)?.requires_grad_();
        let y = a.mul(&b)?;
        assert_eq!(y.dtype(), DType::F64);
        y.sum_all()?.backward()?;
        let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
        assert_eq!((ga.dtype(), gb.dtype()), (DType::F32, DType::F64));
        assert_f32(&ga, d, &[3], &[0.5, -1., 2.]);
        assert_values(&gb, d, &[3], &[1., 2., 3.]);
        // cat, where: the same.
        let p = Tensor::new(&[1f32, 2.], &d)?.requires_grad_();
        let q = Tensor::new(&[3f64], &d)?.requires_grad_();
        let c = Tensor::cat(&[&p, &q], 0)?;
        assert_eq!(c.dtype(), DType::F64);
        c.mul(&Tensor::new(&[1f64, 2., 3.], &d)?)?.sum_all()?.backward()?;
        assert_f32(&p.grad().unwrap(), d, &[2], &[1., 2.]);
        assert_values(&q.grad().unwrap(), d, &[1], &[3.]);
        let t = Tensor::new(&[1f32, 2.], &d)?.requires_grad_();
        let e = Tensor::new(&[10f64, 20.], &d)?.requires_grad_();
        let m = Tensor::new(&[1u8, 0], &d)?;
        m.where_cond(&t, &e)?.sum_all()?.backward()?;
        assert_f32(&t.grad().unwrap(), d, &[2], &[1., 0.]);
        assert_values(&e.grad().unwrap(), d, &[2], &[0., 1.]);
        Ok(())
    });
}

#[test]
fn where_cat_stack_and_assign_promote_or_cast() {
    on_every_device(|d| {
        let m = Tensor::new(&[1u8, 0, 1], &d)?;
        let i = Tensor::new(&[1i64, 2, 3], &d)?;
        let f = Tensor::new(&[0.5f32], &d)?;
        assert_f32(&m.where_cond(&i, &f)?, d, &[3], &[1., 0.5, 3.]);
        assert_eq!(m.where_cond(&Tensor::new(&[7u8], &d)?, &Tensor::new(&[300i32], &d)?)?.dtype(), DType::I32);
        let a = Tensor::new(&[[1u8, 2]], &d)?;
        let b = Tensor::new(&[[-3i32, 4]], &d)?;
        let c = Tensor::cat(&[&a, &b], -2)?;
        assert_eq!(c.dtype(), DType::I32);
        assert_values(&c, d, &[2, 2], &[1., 2., -3., 4.]);
        let s = Tensor::stack(&[&Tensor::new(&[1f32, 2.], &d)?, &Tensor::new(&[3f64, 4.], &d)?], 1)?;
        assert_values(&s, d, &[2, 2], &[1., 3., 2., 4.]);
        assert_eq!(s.dtype(), DType::F64);
        // assign converts as copy_: floats to integers truncate towards zero.
        let dst = Tensor::zeros(3, DType::I32, &d)?;
        dst.assign(&Tensor::new(&[1.9f32, -2.7, 300.0], &d)?)?;
        assert_values(&dst, d, &[3], &[1., -2., 300.]);
        let u = Tensor::zeros((2, 2), DType::U8, &d)?;
        u.assign(&Tensor::new(&[7i64, 9], &d)?)?;
        assert_values(&u, d, &[2, 2], &[7., 9., 7., 9.]);
        Ok(())
    });
}

#[test]
fn ops_pytorch_refuses_mixed_or_integer_dtypes_are_refused_with_a_widening_hint() {
    on_every_device(|d| {
        let a = Tensor::ones((2, 2), DType::F32, &d)?;
        let b = Tensor::ones((2, 2), DType::F64, &d)?;
        // torch.matmul: "expected m1 and m2 to have the same dtype".
        let e = a.matmul(&b).unwrap_err();
        assert!(matches!(e, Error::DTypeMismatch { lhs: DType::F32, rhs: DType::F64, .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(".to_dtype(DType::F64)") && !msg.contains("DType::F32)"), "{msg}");
        let e = Tensor::ones(2, DType::U8, &d)?.matmul(&Tensor::ones(2, DType::F32, &d)?).unwrap_err().to_string();
        assert!(e.contains("convert the u8 operand") && e.contains(".to_dtype(DType::F32)"), "{e}");
        let e = Tensor::ones(2, DType::F16, &d)?.matmul(&Tensor::ones(2, DType::BF16, &d)?).unwrap_err().to_string();
        assert!(e.contains("convert both operands") && e.contains(".to_dtype(DType::F32)"), "{e}");
        let e = b.index_add(&Tensor::new(&[0i64], &d)?, &Tensor::ones((1, 2), DType::F32, &d)?, 0).unwrap_err();
        assert!(matches!(e, Error::DTypeMismatch { .. }), "{e:?}");
        // The norm of integers (linalg.vector_norm refuses them): never a wrapped sum.
        for (t, dt) in [
            (Tensor::new(&[16u8], &d)?, DType::U8),
            (Tensor::new(&[50000i32], &d)?, DType::I32),
            (Tensor::new(&[4_000_000_000i64], &d)?, DType::I64),
        ] {
            match t.norm() {
                Err(e @ Error::UnsupportedDType { .. }) => {
                    assert!(matches!(&e, Error::UnsupportedDType { op, dtype } if op == "norm" && *dtype == dt), "{e:?}");
                    // The hint widens: f32 holds every u8, f64 every i32 (and i64 up to 2^53).
                    let to = if dt == DType::U8 { ".to_dtype(kiln::DType::F32)" } else { ".to_dtype(kiln::DType::F64)" };
                    assert!(e.to_string().contains(to), "{e}");
                }
                other => panic!("norm of {dt} gave {other:?}"),
            }
        }
        assert_eq!(Tensor::new(&[16u8], &d)?.to_dtype(DType::F32)?.norm()?.to_scalar::<f32>()?, 16.0);
        assert_eq!(Tensor::new(&[4_000_000_000i64], &d)?.to_dtype(DType::F64)?.norm()?.to_scalar::<f64>()?, 4e9);
        // mean, var and std of integers, as PyTorch.
        let i = Tensor::new(&[1i64, 2], &d)?;
        assert!(matches!(i.mean_all(), Err(Error::UnsupportedDType { .. })));
        assert!(matches!(i.var_all(), Err(Error::UnsupportedDType { .. })));
        assert!(matches!(i.std_all(), Err(Error::UnsupportedDType { .. })));
        Ok(())
    });
}

#[test]
fn casts_round_once_and_wrap_like_numpy() {
    on_every_device(|d| {
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
fn integer_tensors_promote_with_fractional_or_out_of_range_scalars() {
    on_every_device(|d| {
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
fn i32_works_across_ops() {
    on_every_device(|d| {
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
