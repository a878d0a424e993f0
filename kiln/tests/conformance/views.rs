//! Conformance: views and data movement.

use crate::common::{assert_f32, assert_values, f32s, on_every_device};
use crate::t2;
use half::{bf16, f16};
use kiln::{DType, Device, Error, Tensor};

#[test]
fn views_reshape_transpose_permute() {
    on_every_device(|d| {
        let x = Tensor::arange(0.0, 6.0, 1.0, &d)?;
        let y = x.reshape((2, 3))?;
        assert!(y.same_storage(&x));
        assert_f32(&y, d, &[2, 3], &[0., 1., 2., 3., 4., 5.]);
        let yt = y.t()?;
        assert!(yt.same_storage(&x));
        assert_f32(&yt, d, &[3, 2], &[0., 3., 1., 4., 2., 5.]);
        assert_f32(&y.transpose(0, 1)?, d, &[3, 2], &[0., 3., 1., 4., 2., 5.]);
        // Reshaping a strided view copies, with the values in view order.
        let r = yt.reshape(6)?;
        assert!(!r.same_storage(&x));
        assert_f32(&r, d, &[6], &[0., 3., 1., 4., 2., 5.]);
        let c = yt.contiguous()?;
        assert!(c.is_contiguous() && !c.same_storage(&x));
        assert_f32(&c, d, &[3, 2], &[0., 3., 1., 4., 2., 5.]);
        assert!(y.contiguous()?.same_storage(&x));
        // permute (2, 3, 4) -> (4, 2, 3): out[k][i][j] = in[i][j][k].
        let z = Tensor::arange(0.0, 24.0, 1.0, &d)?.reshape((2, 3, 4))?;
        let p = z.permute(&[2, 0, 1])?;
        let expected: Vec<f32> = (0..4).flat_map(|k| (0..2).flat_map(move |i| (0..3).map(move |j| (12 * i + 4 * j + k) as f32))).collect();
        assert_f32(&p, d, &[4, 2, 3], &expected);
        assert_f32(&z.transpose(0, 2)?.contiguous()?.transpose(0, 2)?, d, &[2, 3, 4], &z.to_vec::<f32>()?);
        assert_f32(&z.flatten_all()?, d, &[24], &z.to_vec::<f32>()?);
        Ok(())
    });
}

/// Strided operands of rank 2 to 4 with odd extents and one past 2^16: the
/// element-to-offset walk of every device (on CUDA, 32-bit multiply-shift
/// division per dimension) against offsets computed here.
#[test]
fn strided_operands_with_odd_extents_read_every_element_where_it_is() {
    on_every_device(|d| {
        // z[a][b][c][e] = 1000·a + 100·b + 10·c + e over (5, 7, 3, 11), then
        // permuted to (e, a, c, b).
        let (n0, n1, n2, n3) = (5usize, 7, 3, 11);
        let values: Vec<f32> = (0..n0)
            .flat_map(|a| {
                (0..n1).flat_map(move |b| (0..n2).flat_map(move |c| (0..n3).map(move |e| (1000 * a + 100 * b + 10 * c + e) as f32)))
            })
            .collect();
        let z = Tensor::from_vec(values, (n0, n1, n2, n3), &d)?;
        let p = z.permute(&[3, 0, 2, 1])?;
        let expected: Vec<f32> = (0..n3)
            .flat_map(|e| {
                (0..n0).flat_map(move |a| (0..n2).flat_map(move |c| (0..n1).map(move |b| (1000 * a + 100 * b + 10 * c + e) as f32)))
            })
            .collect();
        assert_f32(&p.contiguous()?, d, &[n3, n0, n2, n1], &expected);
        // Two differently strided operands of one elementwise op.
        let q = z.permute(&[3, 0, 2, 1])?.contiguous()?;
        let doubled: Vec<f32> = expected.iter().map(|v| 2.0 * v).collect();
        assert_f32(&p.add(&q)?, d, &[n3, n0, n2, n1], &doubled);
        assert_f32(&p.neg()?.neg()?, d, &[n3, n0, n2, n1], &expected);
        // A (3, 65537) matrix transposed: a divisor past 16 bits.
        let (r, c) = (3usize, 65537usize);
        let m = Tensor::arange(0.0, (r * c) as f64, 1.0, &d)?.reshape((r, c))?;
        let t = m.t()?.affine(1.0, 0.0)?;
        let want: Vec<f32> = (0..c).flat_map(|j| (0..r).map(move |i| (i * c + j) as f32)).collect();
        assert_f32(&t, d, &[c, r], &want);
        Ok(())
    });
}

#[test]
fn views_narrow_slice_squeeze_broadcast() {
    on_every_device(|d| {
        let x = Tensor::arange(0.0, 12.0, 1.0, &d)?.reshape((3, 4))?;
        let n = x.narrow(1, 1, 2)?;
        assert!(n.same_storage(&x));
        assert_f32(&n, d, &[3, 2], &[1., 2., 5., 6., 9., 10.]);
        assert_f32(&x.narrow(0, 2, 1)?, d, &[1, 4], &[8., 9., 10., 11.]);
        assert_f32(&x.slice(0, 1..3)?, d, &[2, 4], &[4., 5., 6., 7., 8., 9., 10., 11.]);
        assert_f32(&x.slice(1, 2..2)?, d, &[3, 0], &[]);
        assert_f32(&x.get(1)?, d, &[4], &[4., 5., 6., 7.]);
        assert_f32(&n.narrow(0, 1, 2)?.t()?, d, &[2, 2], &[5., 9., 6., 10.]);
        let u = x.unsqueeze(1)?;
        assert_eq!(u.dims(), &[3, 1, 4]);
        assert_eq!(x.unsqueeze(0)?.dims(), &[1, 3, 4]);
        assert_eq!(x.unsqueeze(2)?.dims(), &[3, 4, 1]);
        assert_f32(&u.squeeze(1)?, d, &[3, 4], &x.to_vec::<f32>()?);
        assert!(u.squeeze(1)?.same_storage(&x));
        let b = Tensor::new(&[1f32, 2.], &d)?.broadcast_to((3, 2))?;
        assert_f32(&b, d, &[3, 2], &[1., 2., 1., 2., 1., 2.]);
        let col = Tensor::new(&[[1f32], [2.]], &d)?.broadcast_to((2, 2, 3))?;
        assert_f32(&col, d, &[2, 2, 3], &[1., 1., 1., 2., 2., 2., 1., 1., 1., 2., 2., 2.]);
        assert_f32(&(&b + &b)?, d, &[3, 2], &[2., 4., 2., 4., 2., 4.]);
        assert_f32(&b.sum(0)?, d, &[2], &[3., 6.]);
        assert_f32(&b.contiguous()?, d, &[3, 2], &[1., 2., 1., 2., 1., 2.]);
        Ok(())
    });
}

#[test]
fn index_select_and_index_add() {
    on_every_device(|d| {
        let x = t2(&[&[1., 2.], &[3., 4.], &[5., 6.]], d)?;
        let ids = Tensor::new(&[2i64, 0, 2], &d)?;
        assert_f32(&x.index_select(&ids, 0)?, d, &[3, 2], &[5., 6., 1., 2., 5., 6.]);
        assert_f32(&x.index_select(&Tensor::new(&[1i64, 1, 0], &d)?, 1)?, d, &[3, 3], &[2., 2., 1., 4., 4., 3., 6., 6., 5.]);
        assert_f32(&x.index_select(&Tensor::new(&[1u8], &d)?, 0)?, d, &[1, 2], &[3., 4.]);
        assert_f32(&x.t()?.index_select(&Tensor::new(&[2i64], &d)?, 1)?, d, &[2, 1], &[5., 6.]);
        assert_f32(&x.index_select(&Tensor::zeros(0, DType::I64, &d)?, 0)?, d, &[0, 2], &[]);
        // Repeated indices accumulate.
        let z = Tensor::zeros((3, 2), DType::F32, &d)?;
        let src = t2(&[&[1., 2.], &[10., 20.], &[100., 200.]], d)?;
        let out = z.index_add(&Tensor::new(&[0i64, 2, 0], &d)?, &src, 0)?;
        assert_f32(&out, d, &[3, 2], &[101., 202., 0., 0., 10., 20.]);
        assert_f32(&z, d, &[3, 2], &[0.; 6]);
        let out = x.index_add(&Tensor::new(&[1i64], &d)?, &Tensor::ones((3, 1), DType::F32, &d)?, 1)?;
        assert_f32(&out, d, &[3, 2], &[1., 3., 3., 5., 5., 7.]);
        Ok(())
    });
}

#[test]
fn cat_and_stack() {
    on_every_device(|d| {
        let a = t2(&[&[1., 2.]], d)?;
        let b = t2(&[&[3., 4.], &[5., 6.]], d)?;
        assert_f32(&Tensor::cat(&[&a, &b], 0)?, d, &[3, 2], &[1., 2., 3., 4., 5., 6.]);
        assert_f32(&Tensor::cat(&[&b, &a, &a], 0)?, d, &[4, 2], &[3., 4., 5., 6., 1., 2., 1., 2.]);
        let c = t2(&[&[7.], &[8.]], d)?;
        assert_f32(&Tensor::cat(&[&b, &c, &b.t()?], 1)?, d, &[2, 5], &[3., 4., 7., 3., 5., 5., 6., 8., 4., 6.]);
        assert_f32(&Tensor::cat(&[&b], 1)?, d, &[2, 2], &[3., 4., 5., 6.]);
        let v = Tensor::new(&[1f32, 2.], &d)?;
        let w = Tensor::new(&[3f32, 4.], &d)?;
        assert_f32(&Tensor::stack(&[&v, &w], 0)?, d, &[2, 2], &[1., 2., 3., 4.]);
        assert_f32(&Tensor::stack(&[&v, &w, &v], 1)?, d, &[2, 3], &[1., 3., 1., 2., 4., 2.]);
        let s = Tensor::stack(&[&b, &b.t()?], 2)?;
        assert_f32(&s, d, &[2, 2, 2], &[3., 3., 4., 5., 5., 4., 6., 6.]);
        let i = Tensor::stack(&[&Tensor::new(&[1i64], &d)?, &Tensor::new(&[2i64], &d)?], 0)?;
        assert_eq!((i.dims(), i.to_vec::<i64>()?), (&[2usize, 1][..], vec![1, 2]));
        Ok(())
    });
}

/// f32 values compared bit for bit, every NaN as one NaN.
#[track_caller]
fn same_nan(t: &Tensor, d: Device, expected: &[f32]) {
    let bits = |x: &f32| if x.is_nan() { u32::MAX } else { x.to_bits() };
    let got = f32s(t, d);
    assert_eq!(got.iter().map(bits).collect::<Vec<_>>(), expected.iter().map(bits).collect::<Vec<_>>(), "got {got:?} on {d}");
}

#[test]
fn nan_propagates_through_max_min_and_wins_argmax() {
    on_every_device(|d| {
        let nan = f32::NAN;
        let x = Tensor::new(&[nan, 1., -2., 3.], &d)?;
        same_nan(&x.relu()?, d, &[nan, 1., 0., 3.]);
        let y = Tensor::new(&[0f32, nan, 5., -1.], &d)?;
        same_nan(&x.maximum(&y)?, d, &[nan, nan, 5., 3.]);
        same_nan(&x.minimum(&y)?, d, &[nan, nan, -2., -1.]);
        same_nan(&x.maximum_scalar(0.0)?, d, &[nan, 1., 0., 3.]);
        same_nan(&x.minimum_scalar(0.0)?, d, &[nan, 0., -2., 0.]);
        same_nan(&x.clamp(-1.0, 2.0)?, d, &[nan, 1., -1., 2.]);
        let two = Tensor::new(&[[1f32, nan, nan], [nan, 2., 3.]], &d)?;
        assert_eq!(two.argmax(1)?.to_vec::<i64>()?, vec![1, 0], "on {d}");
        assert_eq!(two.argmin(0)?.to_vec::<i64>()?, vec![1, 0, 0], "on {d}");
        same_nan(&two.max(0)?, d, &[nan, nan, nan]);
        same_nan(&two.min(1)?, d, &[nan, nan]);
        // f64, and long rows (many blocks on CUDA): the first NaN wins.
        let mut long = (0..20_000).map(|i| (i % 977) as f64).collect::<Vec<_>>();
        long[14_001] = f64::NAN;
        long[18_000] = f64::NAN;
        let l = Tensor::new(long.as_slice(), &d)?;
        assert_eq!(l.argmax(0)?.to_vec::<i64>()?, vec![14_001], "on {d}");
        assert_eq!(l.argmin(0)?.to_vec::<i64>()?, vec![14_001], "on {d}");
        assert!(l.max_all()?.to_vec::<f64>()?[0].is_nan(), "max_all on {d}");
        assert!(l.to_dtype(DType::F32)?.min_all()?.to_vec::<f32>()?[0].is_nan(), "min_all on {d}");
        let clean = Tensor::new(&long[..14_000], &d)?;
        assert_eq!(clean.argmax(0)?.to_vec::<i64>()?, vec![976], "on {d}");
        assert_eq!(clean.max_all()?.to_vec::<f64>()?, vec![976.], "on {d}");
        Ok(())
    });
}

#[test]
fn integer_casts_round_once_and_wrap() {
    on_every_device(|d| {
        let big = (1i64 << 60) + (1i64 << 36) + 1;
        let x = Tensor::new(&[big, -big], &d)?;
        assert_eq!(x.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![big as f32, -big as f32], "on {d}");
        assert_eq!(x.to_dtype(DType::F64)?.to_vec::<f64>()?, vec![big as f64, -big as f64], "on {d}");
        let w = Tensor::new(&[300i64, -1, 256, 255], &d)?;
        assert_eq!(w.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![44, 255, 0, 255], "on {d}");
        assert_eq!(w.to_dtype(DType::I32)?.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![44, 255, 0, 255], "on {d}");
        let wide = Tensor::new(&[1i64 << 40, -3, (1i64 << 32) + 7, i64::MIN], &d)?;
        assert_eq!(wide.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![0, -3, 7, 0], "on {d}");
        let i = Tensor::new(&[-1i32, 2, i32::MAX, i32::MIN], &d)?;
        assert_eq!(i.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![255, 2, 255, 0], "on {d}");
        assert_eq!(i.to_dtype(DType::I64)?.to_vec::<i64>()?, vec![-1, 2, i32::MAX as i64, i32::MIN as i64], "on {d}");
        assert_eq!(i.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![-1., 2., i32::MAX as f32, i32::MIN as f32], "on {d}");
        assert_eq!(Tensor::new(&[200u8, 7], &d)?.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![200, 7], "on {d}");
        // From floats: truncation, saturation, NaN to 0 (Rust's `as`).
        let f = Tensor::new(&[1.9f64, -2.9, 3e10, -3e10, f64::NAN], &d)?;
        assert_eq!(f.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![1, -2, i32::MAX, i32::MIN, 0], "on {d}");
        assert_eq!(f.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![1, 0, 255, 0, 0], "on {d}");
        Ok(())
    });
}

#[test]
fn i32_tensors_on_every_device() {
    on_every_device(|d| {
        let a = Tensor::new(&[[1, 2], [3, 4]], &d)?;
        assert_eq!(a.dtype(), DType::I32);
        assert_eq!(a.matmul(&a)?.to_vec::<i32>()?, vec![7, 10, 15, 22], "on {d}");
        assert_eq!(a.sum(0)?.to_vec::<i32>()?, vec![4, 6], "on {d}");
        assert_eq!(a.sum(-1)?.to_vec::<i32>()?, vec![3, 7], "on {d}");
        assert_eq!(a.min_all()?.to_vec::<i32>()?, vec![1], "on {d}");
        assert_eq!(a.argmax(0)?.to_vec::<i64>()?, vec![1, 1], "on {d}");
        assert_eq!(a.argmin(1)?.to_vec::<i64>()?, vec![0, 0], "on {d}");
        assert_eq!(a.sub(&a.t()?)?.to_vec::<i32>()?, vec![0, -1, 1, 0], "on {d}");
        assert_eq!(a.div(&Tensor::new(&[[0, 2], [-1, 3]], &d)?)?.to_vec::<f32>()?, vec![f32::INFINITY, 1., -3., 4. / 3.], "on {d}");
        assert_eq!(a.le(&a.t()?)?.to_vec::<u8>()?, vec![1, 1, 0, 1], "on {d}");
        assert_eq!(a.neg()?.relu()?.to_vec::<i32>()?, vec![0, 0, 0, 0], "on {d}");
        assert_eq!(a.powi(3)?.to_vec::<i32>()?, vec![1, 8, 27, 64], "on {d}");
        assert_eq!(a.maximum_scalar(2.0)?.minimum_scalar(3.0)?.to_vec::<i32>()?, vec![2, 2, 3, 3], "on {d}");
        // Wrapping, as every integer op.
        let m = Tensor::new(&[i32::MAX, i32::MIN], &d)?;
        assert_eq!(m.add_scalar(1.0)?.to_vec::<i32>()?, vec![i32::MIN, i32::MIN + 1], "on {d}");
        assert_eq!(m.neg()?.to_vec::<i32>()?, vec![-i32::MAX, i32::MIN], "on {d}");
        assert_eq!(m.abs()?.to_vec::<i32>()?, vec![i32::MAX, i32::MIN], "on {d}");
        assert_eq!(m.mul(&m)?.to_vec::<i32>()?, vec![1, 0], "on {d}");
        assert_eq!(m.sum_all()?.to_vec::<i32>()?, vec![-1], "on {d}");
        // Long reductions (many blocks on CUDA) wrap and find the first extreme.
        let long: Vec<i32> = (0..20_000).map(|i| (i * 7919) % 100_003 - 50_000).collect();
        let l = Tensor::new(long.as_slice(), &d)?;
        let wrapped = long.iter().fold(0i32, |a, &b| a.wrapping_add(b));
        assert_eq!(l.sum_all()?.to_vec::<i32>()?, vec![wrapped], "on {d}");
        let arg = long.iter().enumerate().fold(0, |best, (i, &v)| if v > long[best] { i } else { best });
        assert_eq!(l.argmax(0)?.to_vec::<i64>()?, vec![arg as i64], "on {d}");
        assert_eq!(l.max_all()?.to_vec::<i32>()?, vec![long[arg]], "on {d}");
        // Creation, where, i32 indices, and indexing i32 data.
        assert_eq!(Tensor::full(-3.0, 2, DType::I32, &d)?.to_vec::<i32>()?, vec![-3, -3], "on {d}");
        assert_eq!(Tensor::arange_dtype(0.0, 3.0, 1.0, DType::I32, &d)?.to_vec::<i32>()?, vec![0, 1, 2], "on {d}");
        let c = Tensor::new(&[1u8, 0, 0, 1], &d)?.reshape((2, 2))?;
        assert_eq!(c.where_cond(&a, &a.neg()?)?.to_vec::<i32>()?, vec![1, -2, -3, 4], "on {d}");
        let ids = Tensor::new(&[1, 0, 1], &d)?;
        assert_eq!(a.index_select(&ids, 0)?.to_vec::<i32>()?, vec![3, 4, 1, 2, 3, 4], "on {d}");
        let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &d)?;
        assert_eq!(f32s(&x.index_select(&ids, 1)?, d), vec![2., 1., 2., 4., 3., 4.]);
        let src = Tensor::ones((2, 3), DType::I32, &d)?;
        assert_eq!(a.index_add(&ids, &src, 1)?.to_vec::<i32>()?, vec![2, 4, 4, 6], "on {d}");
        let i64_ids = Tensor::new(&[1i64], &d)?;
        assert_eq!(a.index_select(&i64_ids, 1)?.to_vec::<i32>()?, vec![2, 4], "on {d}");
        assert_eq!(a.t()?.contiguous()?.to_vec::<i32>()?, vec![1, 3, 2, 4], "on {d}");
        Ok(())
    });
}

#[test]
fn dtype_conversions_and_half_round_trips() {
    on_every_device(|d| {
        let x = Tensor::new(&[1.7f32, -2.2, 0.0, 300.0], &d)?;
        assert_eq!(x.to_dtype(DType::I64)?.to_vec::<i64>()?, vec![1, -2, 0, 300]);
        assert_eq!(x.to_dtype(DType::F64)?.to_vec::<f64>()?, vec![1.7f32 as f64, -2.2f32 as f64, 0.0, 300.0]);
        assert_eq!(x.to_dtype(DType::F64)?.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![1.7, -2.2, 0.0, 300.0]);
        assert!(x.to_dtype(DType::F32)?.same_storage(&x));
        let i = Tensor::new(&[3i64, -4], &d)?;
        assert_f32(&i.to_dtype(DType::F32)?, d, &[2], &[3., -4.]);
        let u = Tensor::new(&[0u8, 1, 255], &d)?;
        assert_values(&u.to_dtype(DType::F64)?, d, &[3], &[0., 1., 255.]);
        assert_eq!(Tensor::new(&[1f32, 2.], &d)?.gt(&Tensor::new(&[1.5f32], &d)?)?.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![0., 1.]);
        // Half precision: exactly representable values survive a round trip,
        // others round as the `half` crate does.
        let exact = [0.5f32, -2.0, 1024.0, 0.15625, -0.0, 3.0];
        let e = Tensor::new(&exact, &d)?;
        for dtype in [DType::F16, DType::BF16] {
            let h = e.to_dtype(dtype)?;
            assert_eq!((h.dtype(), h.device(), h.storage_bytes()), (dtype, d, 12));
            assert_f32(&h.to_dtype(DType::F32)?, d, &[6], &exact);
            assert_values(&h.to_dtype(DType::F64)?, d, &[6], &exact.map(|v| v as f64));
        }
        let third = Tensor::new(&[1.0f32 / 3.0, 65504.0, 1e-3], &d)?;
        let h = third.to_dtype(DType::F16)?;
        assert_eq!(h.to_vec::<f16>()?, vec![f16::from_f32(1.0 / 3.0), f16::from_f32(65504.0), f16::from_f32(1e-3)]);
        assert_eq!(
            h.to_dtype(DType::F32)?.to_vec::<f32>()?,
            vec![f16::from_f32(1.0 / 3.0).to_f32(), 65504.0, f16::from_f32(1e-3).to_f32()]
        );
        let b = third.to_dtype(DType::BF16)?;
        assert_eq!(b.to_vec::<bf16>()?, vec![bf16::from_f32(1.0 / 3.0), bf16::from_f32(65504.0), bf16::from_f32(1e-3)]);
        assert_eq!(
            b.to_dtype(DType::F16)?.to_vec::<f16>()?,
            vec![
                f16::from_f32(bf16::from_f32(1.0 / 3.0).to_f32()),
                f16::from_f32(bf16::from_f32(65504.0).to_f32()),
                f16::from_f32(bf16::from_f32(1e-3).to_f32())
            ]
        );
        // Half tensors from host data, and views of them.
        let hv = Tensor::new(&[f16::from_f32(1.5), f16::from_f32(-1.0)], &d)?;
        assert_f32(&hv.to_dtype(DType::F32)?, d, &[2], &[1.5, -1.0]);
        assert_f32(&hv.broadcast_to((2, 2))?.t()?.to_dtype(DType::F32)?, d, &[2, 2], &[1.5, 1.5, -1.0, -1.0]);
        Ok(())
    });
}

#[test]
fn where_cond_selects_and_broadcasts() {
    on_every_device(|d| {
        let a = Tensor::new(&[1f32, 2., 3., 4.], &d)?;
        let b = Tensor::new(&[-1f32], &d)?;
        let c = a.gt(&Tensor::new(&[2f32], &d)?)?;
        assert_f32(&c.where_cond(&a, &b)?, d, &[4], &[-1., -1., 3., 4.]);
        assert_f32(&c.where_cond(&b, &a)?, d, &[4], &[1., 2., -1., -1.]);
        // A float condition: non-zero is true; broadcast to (2, 4).
        let cond = Tensor::new(&[[0f32], [0.5]], &d)?;
        assert_f32(&cond.where_cond(&a, &b)?, d, &[2, 4], &[-1., -1., -1., -1., 1., 2., 3., 4.]);
        let i = Tensor::new(&[1u8, 0], &d)?.where_cond(&Tensor::new(&[10i64, 20], &d)?, &Tensor::new(&[0i64], &d)?)?;
        assert_eq!(i.to_vec::<i64>()?, vec![10, 0]);
        Ok(())
    });
}

#[test]
fn assign_writes_in_place_and_every_view_sees_it() {
    on_every_device(|d| {
        let w = Tensor::zeros((2, 3), DType::F32, &d)?;
        let alias = w.clone();
        w.assign(&Tensor::new(&[1f32, 2., 3.], &d)?)?;
        assert_f32(&alias, d, &[2, 3], &[1., 2., 3., 1., 2., 3.]);
        // Into a strided view: only its elements change.
        w.narrow(1, 1, 1)?.assign(&Tensor::new(&[[9f32], [8.]], &d)?)?;
        assert_f32(&w, d, &[2, 3], &[1., 9., 3., 1., 8., 3.]);
        // From an overlapping view of itself.
        w.assign(&w.t()?.t()?.mul_scalar(2.0)?)?;
        assert_f32(&w, d, &[2, 3], &[2., 18., 6., 2., 16., 6.]);
        let v = Tensor::arange(0.0, 4.0, 1.0, &d)?;
        v.narrow(0, 1, 3)?.assign(&v.narrow(0, 0, 3)?)?;
        assert_f32(&v, d, &[4], &[0., 0., 1., 2.]);
        assert!(matches!(w.assign(&Tensor::ones(4, DType::F32, &d)?), Err(Error::ShapeMismatch { .. })));
        // Another dtype converts, as PyTorch's copy_.
        w.assign(&Tensor::new(&[1.5f64, -2.5, 7.0], &d)?)?;
        assert_f32(&w, d, &[2, 3], &[1.5, -2.5, 7., 1.5, -2.5, 7.]);
        Ok(())
    });
}

#[test]
fn assigning_a_broadcast_view_to_itself_is_a_no_op() {
    on_every_device(|d| {
        let v = Tensor::new(&[1f32, 2.], &d)?;
        let b = v.broadcast_to((3, 2))?;
        b.assign(&b)?;
        assert_f32(&v, d, &[2], &[1., 2.]);
        // Another view of the same storage into a broadcast view stays refused.
        assert!(matches!(b.assign(&v.broadcast_to((3, 2))?.mul_scalar(2.0)?), Err(Error::InvalidArgument { .. })));
        Ok(())
    });
}
