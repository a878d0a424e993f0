//! Conformance: matmul and norm.

use crate::common::{assert_close, assert_f32, assert_values, f32s, on_every_device};
use crate::t2;
use kiln::{DType, Tensor};

/// Naive product of row-major matrices, in f64.
fn naive_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] as f64 * b[p * n + j] as f64).sum::<f64>() as f32;
        }
    }
    out
}

/// Small integers, so that every product and sum is exact in f32.
fn ints(len: usize, salt: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7 + salt * 3) % 9) as f32 - 4.0).collect()
}

#[test]
fn matmul_shapes_and_values() {
    on_every_device(|d| {
        let a = t2(&[&[1., 2.], &[3., 4.]], d)?;
        let b = t2(&[&[5., 6.], &[7., 8.]], d)?;
        assert_f32(&a.matmul(&b)?, d, &[2, 2], &[19., 22., 43., 50.]);
        let r = t2(&[&[1., 2., 3.], &[4., 5., 6.]], d)?;
        let s = t2(&[&[1., 0.], &[0., 1.], &[1., 1.]], d)?;
        assert_f32(&r.matmul(&s)?, d, &[2, 2], &[4., 5., 10., 11.]);
        assert_f32(&s.matmul(&r)?, d, &[3, 3], &[1., 2., 3., 4., 5., 6., 5., 7., 9.]);
        // Matrix-vector, vector-matrix, vector-vector.
        let v = Tensor::new(&[1f32, 0., -1.], &d)?;
        assert_f32(&r.matmul(&v)?, d, &[2], &[-2., -2.]);
        assert_f32(&Tensor::new(&[1f32, 1.], &d)?.matmul(&r)?, d, &[3], &[5., 7., 9.]);
        assert_f32(&v.matmul(&Tensor::new(&[3f32, 2., 1.], &d)?)?, d, &[], &[2.]);
        // Batched: (2, 2, 2) @ (2, 2, 2).
        let ba = Tensor::from_vec(vec![1f32, 2., 3., 4., 0., 1., 1., 0.], (2, 2, 2), &d)?;
        let bb = Tensor::from_vec(vec![5f32, 6., 7., 8., 1., 2., 3., 4.], (2, 2, 2), &d)?;
        assert_f32(&ba.matmul(&bb)?, d, &[2, 2, 2], &[19., 22., 43., 50., 3., 4., 1., 2.]);
        // Batch dims broadcast: (2, 2, 2) @ (2, 2).
        assert_f32(&ba.matmul(&b)?, d, &[2, 2, 2], &[19., 22., 43., 50., 7., 8., 5., 6.]);
        // (2, 2, 2) @ vector (2,).
        assert_f32(&ba.matmul(&Tensor::new(&[1f32, 1.], &d)?)?, d, &[2, 2], &[3., 7., 1., 1.]);
        // f64 and i64.
        let a64 = Tensor::new(&[[1f64, 2.], [3., 4.]], &d)?;
        assert_values(&a64.matmul(&a64)?, d, &[2, 2], &[7., 10., 15., 22.]);
        let ai = Tensor::new(&[[1i64, 2], [3, 4]], &d)?;
        assert_eq!(ai.matmul(&ai)?.to_vec::<i64>()?, vec![7, 10, 15, 22]);
        Ok(())
    });
}

#[test]
fn matmul_with_transposed_and_narrowed_operands() {
    on_every_device(|d| {
        let (m, k, n) = (37, 53, 29);
        let av = ints(m * k, 1);
        let bv = ints(k * n, 2);
        let expected = naive_matmul(&av, &bv, m, k, n);
        let a = Tensor::from_vec(av.clone(), (m, k), &d)?;
        let b = Tensor::from_vec(bv.clone(), (k, n), &d)?;
        assert_f32(&a.matmul(&b)?, d, &[m, n], &expected);
        // The same product from transposed storage: (Aᵀ)ᵀ @ (Bᵀ)ᵀ.
        let at = a.t()?.contiguous()?.t()?;
        let bt = b.t()?.contiguous()?.t()?;
        assert!(!at.is_contiguous() && !bt.is_contiguous());
        assert_f32(&at.matmul(&b)?, d, &[m, n], &expected);
        assert_f32(&a.matmul(&bt)?, d, &[m, n], &expected);
        assert_f32(&at.matmul(&bt)?, d, &[m, n], &expected);
        // (A @ B)ᵀ = Bᵀ @ Aᵀ with strided operands.
        let expected_t: Vec<f32> = (0..n).flat_map(|j| (0..m).map(|i| expected[i * n + j]).collect::<Vec<_>>()).collect();
        assert_f32(&b.t()?.matmul(&a.t()?)?, d, &[n, m], &expected_t);
        // A narrowed operand: an offset into storage and a row stride of k.
        let a_mid = a.narrow(1, 10, 20)?;
        let b_mid = b.narrow(0, 10, 20)?;
        let am: Vec<f32> = (0..m).flat_map(|i| av[i * k + 10..i * k + 30].to_vec()).collect();
        let bm: Vec<f32> = bv[10 * n..30 * n].to_vec();
        assert_f32(&a_mid.matmul(&b_mid)?, d, &[m, n], &naive_matmul(&am, &bm, m, 20, n));
        // Batched with a transposed rhs.
        let x = Tensor::from_vec(ints(3 * 4 * 5, 3), (3, 4, 5), &d)?;
        let y = Tensor::from_vec(ints(3 * 6 * 5, 4), (3, 6, 5), &d)?;
        let prod = x.matmul(&y.transpose(1, 2)?)?;
        let (xv, yv) = (x.to_vec::<f32>()?, y.to_vec::<f32>()?);
        let mut expect = Vec::new();
        for bi in 0..3 {
            let xb = &xv[bi * 20..(bi + 1) * 20];
            let yv = &yv;
            let ybt: Vec<f32> = (0..5).flat_map(|p| (0..6).map(move |j| yv[bi * 30 + j * 5 + p])).collect();
            expect.extend(naive_matmul(xb, &ybt, 4, 5, 6));
        }
        assert_f32(&prod, d, &[3, 4, 6], &expect);
        // Broadcast batch dims with n ≥ 16 and k ≥ 8 (the host's small-product
        // tile): (2, 1, 7, 9) @ (3, 9, 20) -> (2, 3, 7, 20).
        let (xv, yv) = (ints(2 * 7 * 9, 5), ints(3 * 9 * 20, 6));
        let x = Tensor::from_vec(xv.clone(), (2, 1, 7, 9), &d)?;
        let y = Tensor::from_vec(yv.clone(), (3, 9, 20), &d)?;
        let mut expect = Vec::new();
        for bx in 0..2 {
            for by in 0..3 {
                expect.extend(naive_matmul(&xv[bx * 63..(bx + 1) * 63], &yv[by * 180..(by + 1) * 180], 7, 9, 20));
            }
        }
        assert_f32(&x.matmul(&y)?, d, &[2, 3, 7, 20], &expect);
        Ok(())
    });
}

#[test]
fn norm_is_frobenius() {
    on_every_device(|d| {
        assert_f32(&t2(&[&[3., 0.], &[0., 4.]], d)?.norm()?, d, &[], &[5.]);
        assert_f32(&Tensor::ones((4, 4), DType::F32, &d)?.norm()?, d, &[], &[4.]);
        assert_values(&Tensor::new(&[[1f64, 2.], [2., 4.]], &d)?.norm()?, d, &[], &[5.]);
        let a = Tensor::from_vec(ints(100 * 100, 5), (100, 100), &d)?;
        let expected = ints(100 * 100, 5).iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        assert_close(&f32s(&a.norm()?, d), &[expected], 1e-6, "norm of 100x100");
        Ok(())
    });
}

#[test]
fn matmul_of_an_empty_output_with_a_huge_batch_is_valid() {
    on_every_device(|d| {
        // [usize::MAX, 0, 2] @ [2]: PyTorch gives [usize::MAX, 0].
        let a = Tensor::zeros((usize::MAX, 0, 2), DType::F32, &d)?;
        let v = Tensor::ones(2, DType::F32, &d)?;
        assert_eq!(a.matmul(&v)?.dims(), &[usize::MAX, 0]);
        // [4, usize::MAX - 1, 0, 7] @ [7, 3]: the inner dimensions agree.
        let b = Tensor::zeros(vec![4, usize::MAX - 1, 0, 7], DType::F32, &d)?;
        assert_eq!(b.matmul(&Tensor::ones((7, 3), DType::F32, &d)?)?.dims(), &[4, usize::MAX - 1, 0, 3]);
        // Inner dimensions that disagree say so; batch dimensions that do
        // not broadcast say that instead.
        let e = b.matmul(&Tensor::ones((6, 3), DType::F32, &d)?).unwrap_err().to_string();
        assert!(e.contains("inner dimensions must agree"), "{e}");
        let e = Tensor::ones((2, 1, 3), DType::F32, &d)?.matmul(&Tensor::ones((3, 3, 1), DType::F32, &d)?).unwrap_err();
        assert!(matches!(e, kiln::Error::ShapeMismatch { .. }) && e.to_string().contains("batch dimensions"), "{e}");
        assert!(!e.to_string().contains("inner dimensions must agree"), "{e}");
        // A non-empty output too large to count is named as such.
        let e = Tensor::ones((1, 2, 1), DType::F32, &d)?
            .broadcast_to((usize::MAX / 2, 2, 1))?
            .matmul(&Tensor::ones((1, 3), DType::F32, &d)?)
            .unwrap_err();
        assert!(matches!(e, kiln::Error::InvalidArgument { .. } | kiln::Error::OutOfMemory { .. }), "{e}");
        Ok(())
    });
}
