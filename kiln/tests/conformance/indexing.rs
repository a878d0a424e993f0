//! Conformance: gather, scatter/scatter_add, sort/argsort/topk, range
//! indexing (`i`) and Embedding (issue 21), with values as PyTorch gives
//! them (`torch.gather`, `torch.scatter`, `torch.sort(stable=True)`, ...,
//! recomputed with numpy's `take_along_axis`/`add.at` and stable sorts).

use crate::common::{assert_f32, assert_values, f32s, on_every_device};
use crate::t2;
use half::{bf16, f16};
use kiln::nn::{Embedding, Module};
use kiln::{cpu, DType, Device, Error, Result, Selector, Tensor};

fn arange(n: usize, dims: &[usize], d: Device) -> Result<Tensor> {
    Tensor::arange(0.0, n as f64, 1.0, &d)?.reshape(dims)
}

fn i64s(v: &[i64], dims: &[usize], d: Device) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), dims, &d)
}

/// The error's message, when the result is `InvalidArgument`.
#[track_caller]
fn invalid(r: Result<Tensor>) -> String {
    match r {
        Err(e @ Error::InvalidArgument { .. }) => e.to_string(),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn gather_picks_along_a_dimension() {
    on_every_device(|d| {
        let x = t2(&[&[1., 2., 3.], &[4., 5., 6.]], d)?;
        assert_f32(&x.gather(1, &i64s(&[2, 0, 1, 1], &[2, 2], d)?)?, d, &[2, 2], &[3., 1., 5., 5.]);
        assert_f32(&x.gather(0, &i64s(&[1, 0, 1], &[1, 3], d)?)?, d, &[1, 3], &[4., 2., 6.]);
        assert_f32(&x.gather(-2, &i64s(&[1, 0, 1], &[1, 3], d)?)?, d, &[1, 3], &[4., 2., 6.]);
        // An index smaller than the input in the other dimension; i32 indices.
        let i32_index = Tensor::new(&[[0i32]], &d)?;
        assert_f32(&x.gather(1, &i32_index)?, d, &[1, 1], &[1.]);
        // Transposed and broadcast inputs are read in place.
        assert_f32(&x.t()?.gather(0, &i64s(&[2, 0, 0, 1], &[2, 2], d)?)?, d, &[2, 2], &[3., 4., 1., 5.]);
        let b = Tensor::new(&[1f32, 2., 3.], &d)?.broadcast_to((2, 3))?;
        assert_f32(&b.gather(1, &i64s(&[2, 0], &[2, 1], d)?)?, d, &[2, 1], &[3., 1.]);
        // A transposed index.
        let it = i64s(&[2, 1, 0, 1], &[2, 2], d)?.t()?;
        assert_f32(&x.gather(1, &it)?, d, &[2, 2], &[3., 1., 5., 5.]);
        // 3-D, dim 1 and dim 2 (numpy's take_along_axis).
        let x3 = arange(24, &[2, 3, 4], d)?;
        let i3 = i64s(&[2, 0, 1, 1, 1, 0, 0, 2, 2, 2, 1, 0], &[2, 2, 3], d)?;
        assert_f32(&x3.gather(1, &i3)?, d, &[2, 2, 3], &[8., 1., 6., 4., 5., 2., 12., 21., 22., 20., 17., 14.]);
        assert_f32(&x3.gather(2, &i64s(&[3, 0, 1, 1], &[1, 2, 2], d)?)?, d, &[1, 2, 2], &[3., 0., 5., 5.]);
        // 0-d, and an empty index (its shape, whatever the rank: PyTorch).
        let s = Tensor::new(&7f32, &d)?;
        assert_f32(&s.gather(0, &Tensor::new(&0i64, &d)?)?, d, &[], &[7.]);
        assert_f32(&s.gather(-1, &i64s(&[0, 0], &[2], d)?)?, d, &[2], &[7., 7.]);
        assert_f32(&x.gather(1, &Tensor::zeros((2, 0), DType::I64, &d)?)?, d, &[2, 0], &[]);
        assert_f32(&x.gather(0, &Tensor::zeros((0, 5, 1), DType::I64, &d)?)?, d, &[0, 5, 1], &[]);
        Ok(())
    });
}

#[test]
fn gather_and_scatter_take_every_dtype() {
    on_every_device(|d| {
        let index = i64s(&[2, 0, 0], &[3], d)?;
        let src_index = i64s(&[1, 2], &[2], d)?;
        for dtype in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16] {
            let x = Tensor::new(&[5f64, 6., 7.], &d)?.to_dtype(dtype)?;
            let g = x.gather(0, &index)?;
            assert_eq!(g.dtype(), dtype);
            assert_values(&g, d, &[3], &[7., 5., 5.]);
            let src = Tensor::new(&[1f64, 2.], &d)?.to_dtype(dtype)?;
            assert_values(&x.scatter(0, &src_index, &src)?, d, &[3], &[5., 1., 2.]);
            assert_values(&x.scatter_add(0, &i64s(&[1, 1], &[2], d)?, &src)?, d, &[3], &[5., 9., 7.]);
            let (v, i) = x.sort(0, true)?;
            assert_values(&v, d, &[3], &[7., 6., 5.]);
            assert_values(&i, d, &[3], &[2., 1., 0.]);
        }
        // Half types add in f32 and round once per addition: 2048 + 1 is
        // 2048 in f16 each time.
        let h = Tensor::new(&[f16::from_f32(2048.)], &d)?;
        let ones = Tensor::new(&[f16::ONE, f16::ONE], &d)?;
        assert_eq!(h.scatter_add(0, &i64s(&[0, 0], &[2], d)?, &ones)?.to_vec::<f16>()?, vec![f16::from_f32(2048.)]);
        let b = Tensor::new(&[bf16::from_f32(1.0)], &d)?;
        let quarter = Tensor::new(&[bf16::from_f32(0.25), bf16::from_f32(0.25)], &d)?;
        assert_eq!(b.scatter_add(0, &i64s(&[0, 0], &[2], d)?, &quarter)?.to_vec::<bf16>()?, vec![bf16::from_f32(1.5)]);
        // Integers wrap.
        let u = Tensor::new(&[250u8], &d)?;
        assert_eq!(u.scatter_add(0, &i64s(&[0], &[1], d)?, &Tensor::new(&[10u8], &d)?)?.to_vec::<u8>()?, vec![4]);
        Ok(())
    });
}

#[test]
fn scatter_writes_and_scatter_add_accumulates() {
    on_every_device(|d| {
        let z = Tensor::zeros((2, 3), DType::F32, &d)?;
        let index = i64s(&[2, 0, 1, 1], &[2, 2], d)?;
        let src = t2(&[&[1., 2.], &[3., 4.]], d)?;
        // Repeated indices: the last write along dim wins (row 1, column 1).
        assert_f32(&z.scatter(1, &index, &src)?, d, &[2, 3], &[2., 0., 1., 0., 4., 0.]);
        assert_f32(&z.scatter_add(1, &index, &src)?, d, &[2, 3], &[2., 0., 1., 0., 7., 0.]);
        // Along dim 0: out[index[i][j]][j] = src[i][j].
        let idx0 = i64s(&[1, 0, 1, 1, 1, 0], &[2, 3], d)?;
        let s6 = t2(&[&[1., 2., 3.], &[4., 5., 6.]], d)?;
        assert_f32(&z.scatter(0, &idx0, &s6)?, d, &[2, 3], &[0., 2., 6., 4., 5., 3.]);
        assert_f32(&z.scatter_add(-2, &idx0, &s6)?, d, &[2, 3], &[0., 2., 6., 5., 5., 3.]);
        // The input is not changed.
        assert_f32(&z, d, &[2, 3], &[0.; 6]);
        // src larger than the index: only its leading block is used.
        let big = t2(&[&[1., 2., 3.], &[4., 5., 6.], &[7., 8., 9.]], d)?;
        assert_f32(&z.scatter(1, &i64s(&[2, 1], &[2, 1], d)?, &big)?, d, &[2, 3], &[0., 0., 1., 0., 4., 0.]);
        // Transposed self, src and index.
        let zt = Tensor::full(-1.0, (3, 2), DType::F32, &d)?.t()?;
        let it = i64s(&[2, 1, 0, 1], &[2, 2], d)?.t()?;
        assert_f32(&zt.scatter(1, &it, &src.t()?)?, d, &[2, 3], &[3., -1., 1., -1., 4., -1.]);
        // 3-D (numpy's add.at and a row-major loop).
        let i3 = i64s(&[2, 0, 1, 1, 1, 0, 0, 2, 2, 2, 1, 0], &[2, 2, 3], d)?;
        let s3 = arange(12, &[2, 2, 3], d)?;
        assert_f32(
            &Tensor::zeros((2, 3, 4), DType::F32, &d)?.scatter_add(1, &i3, &s3)?,
            d,
            &[2, 3, 4],
            &[0., 1., 5., 0., 3., 4., 2., 0., 0., 0., 0., 0., 6., 0., 11., 0., 0., 10., 0., 0., 9., 7., 8., 0.],
        );
        assert_f32(
            &Tensor::full(-1.0, (2, 3, 4), DType::F32, &d)?.scatter(1, &i3, &s3)?,
            d,
            &[2, 3, 4],
            &[-1., 1., 5., -1., 3., 4., 2., -1., 0., -1., -1., -1., 6., -1., 11., -1., -1., 10., -1., -1., 9., 7., 8., -1.],
        );
        // i32 indices, 0-d tensors, empty indices.
        assert_f32(&z.scatter(1, &Tensor::new(&[[1i32], [2]], &d)?, &src)?, d, &[2, 3], &[0., 1., 0., 0., 0., 3.]);
        let s = Tensor::new(&1f32, &d)?;
        assert_f32(&s.scatter(0, &Tensor::new(&0i64, &d)?, &Tensor::new(&5f32, &d)?)?, d, &[], &[5.]);
        assert_f32(&s.scatter_add(0, &i64s(&[0, 0], &[2], d)?, &Tensor::new(&[2f32, 3.], &d)?)?, d, &[], &[6.]);
        let empty = Tensor::zeros((0, 7), DType::I64, &d)?;
        assert_f32(&s6.scatter_add(1, &empty, &src)?, d, &[2, 3], &[1., 2., 3., 4., 5., 6.]);
        Ok(())
    });
}

#[test]
fn gather_and_scatter_refuse_bad_arguments() {
    on_every_device(|d| {
        let x = t2(&[&[1., 2., 3.], &[4., 5., 6.]], d)?;
        let src = Tensor::ones((2, 3), DType::F32, &d)?;
        // The index's rank.
        assert!(matches!(x.gather(0, &i64s(&[0], &[1], d)?), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(x.scatter(0, &i64s(&[0], &[1], d)?, &src), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(x.scatter(0, &i64s(&[0], &[1, 1], d)?, &src.reshape(6)?), Err(Error::ShapeMismatch { .. })));
        // An index larger than the input in another dimension, or than src.
        let e = invalid(x.gather(0, &i64s(&[0; 4], &[1, 4], d)?));
        assert!(e.contains("gather") && e.contains("dimension 1"), "{e}");
        let e = invalid(x.scatter(1, &i64s(&[0; 4], &[1, 4], d)?, &src));
        assert!(e.contains("larger than src") && e.contains("dimension 1"), "{e}");
        assert!(x.scatter(1, &i64s(&[0; 6], &[3, 2], d)?, &Tensor::ones((3, 3), DType::F32, &d)?).is_err());
        // The index's dtype, src's dtype, and the dimension.
        let e = invalid(x.gather(0, &Tensor::zeros((1, 1), DType::F32, &d)?));
        assert!(e.contains("i64") && e.contains("to_dtype"), "{e}");
        assert!(x.gather(0, &Tensor::zeros((1, 1), DType::U8, &d)?).is_err());
        assert!(matches!(x.scatter(0, &i64s(&[0], &[1, 1], d)?, &src.to_dtype(DType::F64)?), Err(Error::DTypeMismatch { .. })));
        assert!(invalid(x.gather(2, &i64s(&[0], &[1, 1], d)?)).contains("dimension 2 is out of range"));
        assert!(invalid(x.scatter_add(-3, &i64s(&[0], &[1, 1], d)?, &src)).contains("dimension -3"));
        // Index values: checked on the CPU at the call; on a GPU the kernel
        // checks them and the next synchronising call reports a bad one
        // (below, in a child process: the report poisons the device).
        let bad = i64s(&[0, 3], &[1, 2], d)?;
        let neg = i64s(&[-1, 0], &[1, 2], d)?;
        if d == cpu() {
            let e = invalid(x.gather(1, &bad));
            assert!(e.contains("index 3 is out of bounds for dimension 1 with size 3"), "{e}");
            assert!(invalid(x.gather(1, &neg)).contains("index -1"));
            assert!(invalid(x.scatter(1, &bad, &src)).contains("index 3"));
            assert!(invalid(x.scatter_add(1, &neg, &src)).contains("index -1"));
        }
        Ok(())
    });
}

#[test]
fn sort_is_stable_with_nan_largest() {
    on_every_device(|d| {
        let nan = f32::NAN;
        let x = t2(&[&[3., 1., nan, 1., -2., 0.], &[5., 5., 5., -1., 7., 5.]], d)?;
        assert_values(&x.argsort(1, false)?, d, &[2, 6], &[4., 5., 1., 3., 0., 2., 3., 0., 1., 2., 5., 4.]);
        assert_values(&x.argsort(-1, true)?, d, &[2, 6], &[2., 0., 1., 3., 5., 4., 4., 0., 1., 2., 5., 3.]);
        assert_values(&x.argsort(0, false)?, d, &[2, 6], &[0., 0., 1., 1., 0., 0., 1., 1., 0., 0., 1., 1.]);
        let (v, i) = x.sort(1, false)?;
        assert_eq!(i.dtype(), DType::I64);
        let got = f32s(&v, d);
        assert_eq!(got[..5], [-2., 0., 1., 1., 3.]);
        assert!(got[5].is_nan());
        assert_eq!(got[6..], [-1., 5., 5., 5., 5., 7.]);
        let (v, _) = x.sort(1, true)?;
        assert!(f32s(&v, d)[0].is_nan());
        // Transposed input, sorted along its dim 0.
        let (v, i) = x.t()?.sort(0, true)?;
        assert_eq!(v.dims(), &[6, 2]);
        assert_eq!(i.to_vec::<i64>()?[..4], [2, 4, 0, 0]);
        // −0.0 and 0.0 are equal (stable); integers compare exactly.
        assert_values(&Tensor::new(&[0f64, -0.0, 0.0], &d)?.argsort(0, false)?, d, &[3], &[0., 1., 2.]);
        let big = Tensor::new(&[i64::MAX, i64::MAX - 1, -5], &d)?;
        assert_eq!(big.sort(0, false)?.0.to_vec::<i64>()?, vec![-5, i64::MAX - 1, i64::MAX]);
        assert_values(&Tensor::new(&[200u8, 3, 255, 3], &d)?.argsort(0, true)?, d, &[4], &[2., 0., 1., 3.]);
        let h = Tensor::new(&[1.5f64, -0.5, f64::NAN, 0.25], &d)?;
        for dt in [DType::F16, DType::BF16, DType::I32] {
            let want: &[f64] = if dt == DType::I32 { &[1., 2., 3., 0.] } else { &[1., 3., 0., 2.] };
            assert_values(&h.to_dtype(dt)?.argsort(0, false)?, d, &[4], want);
        }
        // 0-d, an empty dimension, a long line (the merge sort's passes).
        let s = Tensor::new(&2f32, &d)?;
        let (v, i) = s.sort(-1, false)?;
        assert_f32(&v, d, &[], &[2.]);
        assert_values(&i, d, &[], &[0.]);
        assert_values(&Tensor::zeros((2, 0), DType::F32, &d)?.argsort(1, false)?, d, &[2, 0], &[]);
        let long: Vec<f32> = (0..300).map(|k| ((k * 37) % 101) as f32).collect();
        let mut want: Vec<(f32, usize)> = long.iter().copied().zip(0..).collect();
        want.sort_by(|a, b| b.0.total_cmp(&a.0));
        let i = Tensor::new(long.as_slice(), &d)?.argsort(0, true)?;
        assert_eq!(i.to_vec::<i64>()?, want.iter().map(|p| p.1 as i64).collect::<Vec<_>>());
        assert!(invalid(x.argsort(2, false)).contains("argsort"));
        assert!(invalid(x.sort(-3, false).map(|p| p.0)).contains("sort"));
        Ok(())
    });
}

#[test]
fn topk_takes_the_largest_or_smallest() {
    on_every_device(|d| {
        let nan = f32::NAN;
        let x = t2(&[&[3., 1., nan, 1., -2., 0.], &[5., 5., 5., -1., 7., 5.]], d)?;
        let (v, i) = x.topk(3, 1, true, true)?;
        assert_values(&i, d, &[2, 3], &[2., 0., 1., 4., 0., 1.]);
        let got = f32s(&v, d);
        assert!(got[0].is_nan());
        assert_eq!(got[1..], [3., 1., 7., 5., 5.]);
        let (v, i) = x.topk(2, -1, false, false)?;
        assert_f32(&v, d, &[2, 2], &[-2., 0., -1., 5.]);
        assert_values(&i, d, &[2, 2], &[4., 5., 3., 0.]);
        let (v, i) = x.topk(1, 0, true, true)?;
        assert_eq!(v.dims(), &[1, 6]);
        assert_values(&i, d, &[1, 6], &[1., 1., 0., 0., 1., 1.]);
        // k = 0 and k = size; a transposed input; 0-d.
        assert_eq!(x.topk(0, 1, true, true)?.0.dims(), &[2, 0]);
        assert_values(&x.topk(6, 1, false, true)?.1, d, &[2, 6], &[4., 5., 1., 3., 0., 2., 3., 0., 1., 2., 5., 4.]);
        assert_f32(&x.t()?.narrow(0, 3, 3)?.topk(1, 0, true, true)?.0, d, &[1, 2], &[1., 7.]);
        assert_f32(&Tensor::new(&4f32, &d)?.topk(1, 0, true, true)?.0, d, &[], &[4.]);
        // k too large, a bad dimension.
        let e = invalid(x.topk(7, 1, true, true).map(|p| p.0));
        assert!(e.contains("k (7)") && e.contains("dimension 1 of size 6"), "{e}");
        assert!(invalid(x.topk(1, 2, true, true).map(|p| p.0)).contains("topk"));
        Ok(())
    });
}

#[test]
fn gradients_of_gather_scatter_sort_and_topk() {
    on_every_device(|d| {
        // gather: the gradient scatters back, summing repeated indices.
        let x = arange(24, &[2, 3, 4], d)?.requires_grad_();
        let i3 = i64s(&[2, 0, 1, 1, 1, 0, 0, 2, 2, 2, 1, 0], &[2, 2, 3], d)?;
        x.gather(1, &i3)?.sum_all()?.backward()?;
        let want = [0., 1., 1., 0., 1., 1., 1., 0., 1., 0., 0., 0., 1., 0., 1., 0., 0., 1., 0., 0., 1., 1., 1., 0.];
        assert_f32(&x.grad().expect("dx"), d, &[2, 3, 4], &want);
        let x = t2(&[&[1., 2.], &[3., 4.]], d)?.requires_grad_();
        x.gather(1, &i64s(&[0, 0, 1, 0], &[2, 2], d)?)?.mul(&t2(&[&[1., 10.], &[100., 1000.]], d)?)?.sum_all()?.backward()?;
        assert_f32(&x.grad().expect("dx"), d, &[2, 2], &[11., 0., 1000., 100.]);
        // scatter: self gets g with the written positions zeroed; src gets
        // g at the positions it was written to (both duplicates, as PyTorch).
        let w = t2(&[&[1., 2., 3.], &[4., 5., 6.]], d)?;
        let z = Tensor::zeros((2, 3), DType::F32, &d)?.requires_grad_();
        let src = t2(&[&[1., 2.], &[3., 4.]], d)?.requires_grad_();
        let index = i64s(&[2, 0, 1, 1], &[2, 2], d)?;
        z.scatter(1, &index, &src)?.mul(&w)?.sum_all()?.backward()?;
        assert_f32(&z.grad().expect("dz"), d, &[2, 3], &[0., 2., 0., 4., 0., 6.]);
        assert_f32(&src.grad().expect("dsrc"), d, &[2, 2], &[3., 1., 5., 5.]);
        let z = Tensor::zeros((2, 3), DType::F32, &d)?.requires_grad_();
        let src = t2(&[&[1., 2.], &[3., 4.]], d)?.requires_grad_();
        z.scatter_add(1, &index, &src)?.mul(&w)?.sum_all()?.backward()?;
        assert_f32(&z.grad().expect("dz"), d, &[2, 3], &[1., 2., 3., 4., 5., 6.]);
        assert_f32(&src.grad().expect("dsrc"), d, &[2, 2], &[3., 1., 5., 5.]);
        // A src larger than the index: zero gradient where it was not read.
        let big = Tensor::ones((2, 3), DType::F32, &d)?.requires_grad_();
        z.scatter(1, &i64s(&[1, 2], &[2, 1], d)?, &big)?.mul(&w)?.sum_all()?.backward()?;
        assert_f32(&big.grad().expect("dbig"), d, &[2, 3], &[2., 0., 0., 6., 0., 0.]);
        // sort and topk: each value's gradient goes to where it came from.
        let x = t2(&[&[3., 1., 2.], &[0., 5., 4.]], d)?.requires_grad_();
        let (v, _) = x.sort(1, true)?;
        v.mul(&t2(&[&[1., 10., 100.], &[1000., 10000., 100000.]], d)?)?.sum_all()?.backward()?;
        assert_f32(&x.grad().expect("dx"), d, &[2, 3], &[1., 100., 10., 100000., 1000., 10000.]);
        let x = t2(&[&[3., 1., 2.], &[0., 5., 4.]], d)?.requires_grad_();
        let (v, _) = x.topk(2, 1, false, true)?;
        v.mul(&t2(&[&[1., 10.], &[100., 1000.]], d)?)?.sum_all()?.backward()?;
        assert_f32(&x.grad().expect("dx"), d, &[2, 3], &[0., 1., 10., 100., 0., 1000.]);
        Ok(())
    });
}

/// A function of one tensor, to differentiate.
type OpOf<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;

/// ∂ sum(f(x) · w) / ∂x by central differences, in f64.
fn finite_difference(x: &[f64], dims: &[usize], d: Device, f: &OpOf<'_>) -> Result<Vec<f64>> {
    let eps = 1e-6;
    let at = |v: Vec<f64>| -> Result<f64> {
        let y = f(&Tensor::from_vec(v, dims, &d)?)?;
        let w = Tensor::arange_dtype(1.0, 1.0 + y.elem_count() as f64, 1.0, DType::F64, &d)?.reshape(y.dims())?;
        y.mul(&w)?.sum_all()?.to_scalar::<f64>()
    };
    (0..x.len())
        .map(|k| {
            let (mut hi, mut lo) = (x.to_vec(), x.to_vec());
            hi[k] += eps;
            lo[k] -= eps;
            Ok((at(hi)? - at(lo)?) / (2.0 * eps))
        })
        .collect()
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    on_every_device(|d| {
        let vals = [0.3, -1.2, 2.5, 0.7, -0.1, 1.9, 3.3, -2.2, 0.05, 1.1, -0.6, 0.4];
        let dims = [3, 4];
        let index = i64s(&[3, 0, 0, 1, 2, 2, 1, 3], &[2, 4], d)?;
        let rows = i64s(&[2, 0, 1, 2], &[1, 4], d)?;
        let index_t = i64s(&[1, 2, 0, 0, 2, 1], &[3, 2], d)?;
        let src = Tensor::new(&[[1.5f64, -0.5, 2.0, 0.25], [3.0, 1.0, -1.0, 0.5]], &d)?;
        let ops: Vec<(&str, Box<OpOf<'_>>)> = vec![
            ("gather", Box::new(|x| x.gather(1, &index))),
            ("gather of a transposed view", Box::new(|x| x.t()?.gather(0, &index_t.t()?.t()?))),
            ("scatter (self)", Box::new(|x| x.scatter(0, &index.narrow(1, 1, 1)?.t()?, &src))),
            ("scatter_add (self)", Box::new(|x| x.scatter_add(1, &index, &src.narrow(0, 0, 2)?))),
            ("scatter (src)", Box::new(|x| Tensor::zeros((3, 4), DType::F64, &x.device())?.scatter(0, &rows, x))),
            ("sort", Box::new(|x| Ok(x.sort(1, false)?.0))),
            ("topk", Box::new(|x| Ok(x.topk(2, 0, true, true)?.0))),
            ("range index", Box::new(|x| x.i((1.., -3..=-2)))),
        ];
        for (what, f) in &ops {
            let x = Tensor::from_vec(vals.to_vec(), dims, &d)?.requires_grad_();
            let y = f(&x)?;
            let w = Tensor::arange_dtype(1.0, 1.0 + y.elem_count() as f64, 1.0, DType::F64, &d)?.reshape(y.dims())?;
            y.mul(&w)?.sum_all()?.backward()?;
            let got = x.grad().expect("a gradient").to_vec::<f64>()?;
            let want = finite_difference(&vals, &dims, d, f.as_ref())?;
            for (k, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!((g - e).abs() < 1e-6, "{what} on {d}: element {k} is {g}, finite differences give {e}");
            }
        }
        Ok(())
    });
}

#[test]
fn range_indexing_makes_views() {
    on_every_device(|d| {
        let x = arange(24, &[2, 3, 4], d)?;
        let y = x.i((.., 1..3, -1))?;
        assert!(y.same_storage(&x));
        assert_f32(&y, d, &[2, 2], &[7., 11., 19., 23.]);
        assert_f32(&x.i((1, ..=1))?, d, &[2, 4], &[12., 13., 14., 15., 16., 17., 18., 19.]);
        assert_f32(&x.i((-2.., 0))?, d, &[2, 4], &[0., 1., 2., 3., 12., 13., 14., 15.]);
        assert_f32(&x.i((0, 2, 1..))?, d, &[3], &[9., 10., 11.]);
        assert_f32(&x.i((1, -1, -1))?, d, &[], &[23.]);
        assert_f32(&x.i((.., .., 1..1))?, d, &[2, 3, 0], &[]);
        assert_f32(&x.i((..1, ..-1, 2..=2))?, d, &[1, 2, 1], &[2., 6.]);
        assert_eq!(x.i(..)?.dims(), &[2, 3, 4]);
        assert_eq!(x.i(())?.dims(), &[2, 3, 4]);
        let (a, b): (usize, usize) = (1, 3);
        assert_f32(&x.i((0, a..b, 0))?, d, &[2], &[4., 8.]);
        let dynamic = vec![Selector::from(1), Selector::All, Selector::from(3)];
        assert_f32(&x.i(dynamic)?, d, &[3], &[15., 19., 23.]);
        // Views of views: a transposed tensor.
        let t = x.transpose(0, 2)?;
        assert_f32(&t.i((1.., 0, 1))?, d, &[3], &[13., 14., 15.]);
        assert!(t.i((1.., 0, 1))?.same_storage(&x));
        // Errors name the dimension, the selector and the size.
        let e = invalid(x.i((0..3,)));
        assert!(e.contains("range 0..3") && e.contains("dimension 0 of size 2"), "{e}");
        let e = invalid(x.i((.., 5)));
        assert!(e.contains("index 5") && e.contains("dimension 1 of size 3"), "{e}");
        assert!(invalid(x.i((.., -4))).contains("index -4"));
        assert!(invalid(x.i((.., .., -5..))).contains("range -5.."));
        let (two, one) = (2, 1);
        assert!(invalid(x.i((.., two..one))).contains("runs backwards"));
        assert!(invalid(x.i((0, 0, 0, 0))).contains("4 selectors for a tensor of rank 3"));
        assert!(invalid(Tensor::new(&1f32, &d)?.i(0)).contains("rank 0"));
        // An empty tensor with a dimension beyond i64 (found by the fuzzer).
        let huge = Tensor::zeros((0, usize::MAX), DType::F32, &d)?;
        assert_eq!(huge.i((.., 5..9))?.dims(), &[0, 4]);
        assert_eq!(huge.i((.., -1))?.dims(), &[0]);
        assert_eq!(huge.argsort(1, true)?.dims(), &[0, usize::MAX]);
        assert_eq!(huge.gather(1, &Tensor::zeros((0, 3), DType::I64, &d)?)?.dims(), &[0, 3]);
        // Gradients come from the views.
        let x = arange(24, &[2, 3, 4], d)?.requires_grad_();
        x.i((.., 1..3, -1))?.sum_all()?.backward()?;
        let g = x.grad().expect("dx").to_vec::<f32>()?;
        let ones: Vec<usize> = g.iter().enumerate().filter(|&(_, &v)| v == 1.0).map(|(k, _)| k).collect();
        assert_eq!(ones, vec![7, 11, 19, 23]);
        assert_eq!(g.iter().sum::<f32>(), 4.0);
        Ok(())
    });
}

#[test]
fn embedding_looks_up_rows_with_gradients() {
    on_every_device(|d| {
        let weight = t2(&[&[0., 1.], &[10., 11.], &[20., 21.]], d)?;
        let emb = Embedding::from_tensor(&weight)?;
        let ids = i64s(&[2, 0, 1, 1], &[2, 2], d)?;
        let out = emb.forward(&ids)?;
        assert_f32(&out, d, &[2, 2, 2], &[20., 21., 0., 1., 10., 11., 10., 11.]);
        out.mul(&arange(8, &[2, 2, 2], d)?)?.sum_all()?.backward()?;
        // Row 1 is used twice: its gradients add up.
        assert_f32(&emb.weight().grad().expect("dW"), d, &[3, 2], &[2., 3., 10., 12., 0., 1.]);
        assert_f32(&emb.forward(&Tensor::new(&[2i32], &d)?)?, d, &[1, 2], &[20., 21.]);
        assert_f32(&emb.forward(&Tensor::new(&0u8, &d)?)?, d, &[2], &[0., 1.]);
        assert_f32(&kiln::nn::embedding(&Tensor::zeros((0, 4), DType::I64, &d)?, &weight)?, d, &[0, 4, 2], &[]);
        assert_eq!(emb.named_parameters().len(), 1);
        // A new table: N(0, 1) on the device, f32, a parameter.
        let fresh = Embedding::new(1000, 4, &d)?;
        let w = fresh.weight();
        assert!((w.device(), w.dtype(), w.requires_grad()) == (d, DType::F32, true));
        let (mean, std) = (w.mean_all()?.to_scalar::<f32>()?, w.std_all()?.to_scalar::<f32>()?);
        assert!(mean.abs() < 0.1 && (std - 1.0).abs() < 0.1, "mean {mean}, std {std}");
        // Bad ids, float ids, an input elsewhere.
        assert!(matches!(emb.forward(&Tensor::new(&[1f32], &d)?), Err(Error::InvalidArgument { .. })));
        if d == cpu() {
            assert!(invalid(emb.forward(&Tensor::new(&[3i64], &d)?)).contains("embedding: index 3 is out of range"));
        } else {
            assert!(matches!(emb.forward(&Tensor::new(&[0i64], &cpu())?), Err(Error::DeviceMismatch { .. })));
            let e = kiln::nn::embedding(&Tensor::new(&[0i64], &cpu())?, &weight).unwrap_err();
            assert!(matches!(&e, Error::DeviceMismatch { op, .. } if op == "embedding"), "{e}");
        }
        Ok(())
    });
}

#[test]
fn embedding_moves_between_devices() {
    let devs = crate::common::devices();
    let mut emb = Embedding::new(5, 3, &cpu()).unwrap();
    let start = emb.weight().to_vec::<f32>().unwrap();
    for &d in &devs {
        emb.to(&d).unwrap();
        assert_eq!(emb.weight().device(), d);
        assert_eq!(emb.weight().to_vec::<f32>().unwrap(), start);
        let out = emb.forward(&Tensor::new(&[4i64, 0], &d).unwrap()).unwrap();
        assert_eq!(out.to_vec2::<f32>().unwrap(), vec![start[12..15].to_vec(), start[..3].to_vec()]);
        crate::common::report_ran(d);
    }
}

/// Runs `f` on another thread and waits at most 20 s for it: a call that
/// synchronised with a held queue would never return.
fn returns_without_waiting<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} waited for the held queue: a hidden synchronisation"))
}

/// Asserts that `r` is the report of a bad index or label: `KernelFailed`
/// on `d` naming `op` and `what`.
#[track_caller]
fn reported<T: std::fmt::Debug>(r: Result<T>, d: Device, op: &str, what: &str) {
    match r {
        Err(e @ Error::KernelFailed { .. }) => {
            let Error::KernelFailed { device, op: got, msg } = &e else { unreachable!() };
            assert_eq!((*device, got.as_str()), (d, op), "{e}");
            assert!(msg.contains(what), "{e}");
        }
        other => panic!("on {d}: expected {op} to report `{what}`, got {other:?}"),
    }
}

#[test]
fn bad_indices_and_labels_on_a_gpu_are_reported_by_the_next_synchronising_call() {
    // A fault poisons the device's queue for every thread until it is
    // reported (as CUDA's sticky errors): in a child process of its own, so
    // that the tests running beside it on the same devices never see it.
    if !crate::common::is_child() {
        crate::common::run_child(&[]);
        // The child ran on every device the parent has (CUDA ones counted here).
        crate::common::devices().into_iter().for_each(crate::common::report_ran);
        return;
    }
    on_every_device(|d| {
        let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &d)?;
        let logits = Tensor::new(&[[0f32, 1., 2.], [1., 1., 1.]], &d)?;
        let bad_labels = Tensor::new(&[1i64, 7], &d)?;
        if d.is_cpu() {
            // The CPU raises at the call, as PyTorch does.
            assert!(matches!(x.index_select(&Tensor::new(&[5i64], &d)?, 0), Err(Error::InvalidArgument { .. })));
            assert!(matches!(kiln::nn::cross_entropy(&logits, &bad_labels), Err(Error::InvalidArgument { .. })));
            return Ok(());
        }
        // The first use of a kernel loads it into the device's context, and
        // loading waits for the device to be idle (on a GPU as in the CUDA
        // simulator): each op runs once on good indices, with the index
        // dtypes used below, before any queue is held.
        let ones = Tensor::ones((1, 2), DType::F32, &d)?;
        kiln::nn::cross_entropy(&logits, &Tensor::new(&[1i64, 0], &d)?)?;
        kiln::nn::one_hot(&Tensor::new(&[0i32, 2], &d)?, 3, DType::F32)?;
        x.index_select(&Tensor::new(&[0i64, 2], &d)?, 0)?;
        x.index_select(&Tensor::new(&[1i32], &d)?, -1)?;
        x.index_add(&Tensor::new(&[2u8], &d)?, &ones, 0)?;
        x.gather(1, &Tensor::new(&[[0i64], [1], [1]], &d)?)?;
        x.scatter(0, &Tensor::new(&[[0i64, 2]], &d)?, &ones)?;
        x.scatter_add(-2, &Tensor::new(&[[2i32, 0]], &d)?, &ones)?;
        kiln::nn::embedding(&Tensor::new(&[[1i64, 2]], &d)?, &x)?;
        kiln::synchronize(&d)?;
        // cross_entropy with label 7 of 3 classes, called while the device's
        // queue is held: it returns at once (no read of the labels, no wait),
        // moves nothing to the host, and its failure comes with the next
        // synchronising call.
        let hold = kiln::hold_queue(&d)?;
        let (l, b) = (logits.clone(), bad_labels.clone());
        let (loss, transfers) = returns_without_waiting("cross_entropy", move || {
            let _guard = kiln::transfer_guard(kiln::GuardLevel::Disallow);
            let before = kiln::thread_transfer_stats();
            let loss = kiln::nn::cross_entropy(&l, &b);
            (loss, kiln::thread_transfer_stats().since(&before).total().count)
        });
        assert_eq!(transfers, 0, "cross_entropy on {d} moved data");
        let loss = loss?;
        drop(hold);
        reported(kiln::synchronize(&d), d, "cross_entropy", "label 7 is out of range for 3 classes");
        // Reported once; the device works again.
        kiln::synchronize(&d)?;
        assert_eq!(logits.sum_all()?.to_scalar::<f32>()?, 6.0);
        drop(loss);
        // A read reports it too, and block_until_ready. Each op is launched
        // while the queue is held: an op made of several kernels would
        // otherwise see its own earlier kernel's fault at its next launch
        // (launches fail fast on a poisoned device) when the device is quick.
        let launched = |f: &dyn Fn() -> Result<Tensor>| -> Result<Tensor> {
            let hold = kiln::hold_queue(&d)?;
            let out = f();
            drop(hold);
            out
        };
        let labels = Tensor::new(&[-1i64, 0], &d)?;
        let loss = launched(&|| kiln::nn::cross_entropy(&logits, &labels))?;
        reported(loss.to_scalar::<f32>(), d, "cross_entropy", "label -1 is out of range for 3 classes");
        let labels = Tensor::new(&[0i32, 3], &d)?;
        let hot = launched(&|| kiln::nn::one_hot(&labels, 3, DType::F32))?;
        reported(hot.block_until_ready().map(|_| ()), d, "one_hot", "label 3 is out of range for 3 classes");
        let ids = Tensor::new(&[0i64, 5], &d)?;
        let picked = launched(&|| x.index_select(&ids, 0))?;
        reported(picked.to_vec::<f32>(), d, "index_select", "index 5 is out of range for dimension 0 of size 3");
        let ids = Tensor::new(&[-1i32], &d)?;
        let picked = launched(&|| x.index_select(&ids, -1))?;
        reported(picked.to_vec::<f32>(), d, "index_select", "index -1 is out of range for dimension 1 of size 2");
        let (ids, src) = (Tensor::new(&[3u8], &d)?, Tensor::ones((1, 2), DType::F32, &d)?);
        let added = launched(&|| x.index_add(&ids, &src, 0))?;
        reported(added.to_vec::<f32>(), d, "index_add", "index 3 is out of range for dimension 0 of size 3");
        let ids = Tensor::new(&[[0i64], [2], [1]], &d)?;
        let got = launched(&|| x.gather(1, &ids))?;
        reported(got.to_vec::<f32>(), d, "gather", "index 2 is out of range for dimension 1 of size 2");
        let ids = Tensor::new(&[[0i64, 4]], &d)?;
        let put = launched(&|| x.scatter(0, &ids, &ones))?;
        reported(put.to_vec::<f32>(), d, "scatter", "index 4 is out of range for dimension 0 of size 3");
        let ids = Tensor::new(&[[-3i32, 0]], &d)?;
        let put = launched(&|| x.scatter_add(-2, &ids, &ones))?;
        reported(put.to_vec::<f32>(), d, "scatter_add", "index -3 is out of range for dimension 0 of size 3");
        let ids = Tensor::new(&[[1i64, 3]], &d)?;
        let rows = launched(&|| kiln::nn::embedding(&ids, &x))?;
        reported(rows.to_vec::<f32>(), d, "index_select", "index 3 is out of range for dimension 0 of size 3");
        // Good indices still work after each report.
        assert_eq!(x.index_select(&Tensor::new(&[2i64], &d)?, 0)?.to_vec::<f32>()?, vec![5., 6.]);
        assert_eq!(x.gather(1, &Tensor::new(&[[1i64]], &d)?)?.to_vec::<f32>()?, vec![2.]);
        Ok(())
    });
    println!("CHILD-OK");
}

/// Out-of-range and negative indices: an error on the CPU (as in PyTorch);
/// on a GPU they are not read back (no hidden transfer or sync): the kernel
/// checks them and the next synchronising call reports the first bad one
/// as `KernelFailed` naming the op, as PyTorch's device-side assert.
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
