//! Tensor <-> ndarray (feature `ndarray`) on every device: every dtype, any
//! layout of the source array, 0-d and empty arrays, the transfers booked at
//! the caller's line and refused under a guard. Run with
//! `cargo test -p kiln --features ndarray --test io_ndarray`.

#[macro_use]
mod common;

use half::{bf16, f16};
use kiln::{cpu, DType, Direction, Error, GuardLevel, Tensor};
use ndarray::{arr0, array, s, Array, Array2, ArrayD, IxDyn};

#[test]
fn arrays_of_every_layout_become_row_major_tensors_on_every_device() {
    common::on_every_device(|device| {
        let a = Array::from_shape_fn((2, 3, 4), |(i, j, k)| (i * 12 + j * 4 + k) as f32);
        let t = Tensor::from_ndarray(&a, &device)?;
        common::assert_f32(&t, device, &[2, 3, 4], &(0..24).map(|x| x as f32).collect::<Vec<_>>());
        // Not in standard layout: transposed, stepped, reversed. Each is
        // gathered in its logical order.
        let m = array![[1f64, 2., 3.], [4., 5., 6.]];
        assert_eq!(Tensor::from_ndarray(&m.t(), &device)?.to_vec2::<f64>()?, vec![vec![1., 4.], vec![2., 5.], vec![3., 6.]]);
        assert_eq!(Tensor::from_ndarray(&m.slice(s![.., ..;2]), &device)?.to_vec2::<f64>()?, vec![vec![1., 3.], vec![4., 6.]]);
        assert_eq!(Tensor::from_ndarray(&m.slice(s![..;-1, 1]), &device)?.to_vec::<f64>()?, vec![5., 2.]);
        // A 0-d array and empty ones.
        let scalar = Tensor::from_ndarray(&arr0(7i64), &device)?;
        assert_eq!((scalar.dims(), scalar.to_scalar::<i64>()?), (&[][..], 7));
        let empty = Tensor::from_ndarray(&Array2::<i32>::zeros((0, 3)), &device)?;
        assert_eq!((empty.dims(), empty.elem_count(), empty.device()), (&[0, 3][..], 0, device));
        // Every dtype, there and back.
        let u = Tensor::from_ndarray(&array![0u8, 255], &device)?;
        assert_eq!(u.to_ndarray::<u8>()?, ArrayD::from_shape_vec(IxDyn(&[2]), vec![0u8, 255]).unwrap());
        let h = Tensor::from_ndarray(&array![f16::from_f32(0.5)], &device)?;
        assert_eq!((h.dtype(), h.to_ndarray::<f16>()?[[0]]), (DType::F16, f16::from_f32(0.5)));
        let b = Tensor::from_ndarray(&array![[bf16::from_f32(-2.0)]], &device)?;
        assert_eq!(b.to_ndarray2::<bf16>()?, array![[bf16::from_f32(-2.0)]]);
        let i = Tensor::from_ndarray(&array![i32::MIN, i32::MAX], &device)?;
        assert_eq!(i.to_ndarray::<i32>()?.as_slice(), Some(&[i32::MIN, i32::MAX][..]));
        Ok(())
    });
}

#[test]
fn tensors_become_owned_arrays_on_every_device() {
    common::on_every_device(|device| {
        let t = Tensor::arange(0.0, 6.0, 1.0, &device)?.reshape((2, 3))?;
        let a = t.to_ndarray::<f32>()?;
        assert_eq!(a.shape(), &[2, 3]);
        assert_eq!(a[[1, 2]], 5.0);
        // A view (transposed) is read in its logical order.
        assert_eq!(t.t()?.to_ndarray2::<f32>()?, array![[0f32, 3.], [1., 4.], [2., 5.]]);
        // 0-d and empty tensors.
        assert_eq!(Tensor::full(2.5, (), DType::F64, &device)?.to_ndarray::<f64>()?, arr0(2.5).into_dyn());
        assert_eq!(Tensor::zeros((0, 4), DType::I64, &device)?.to_ndarray2::<i64>()?.dim(), (0, 4));
        // The TryFrom forms.
        assert_eq!(ArrayD::<f32>::try_from(&t)?.ndim(), 2);
        assert_eq!(Array2::<f32>::try_from(&t)?, array![[0f32, 1., 2.], [3., 4., 5.]]);
        Ok(())
    });
    let t = Tensor::try_from(&array![[1u8, 2], [3, 4]]).unwrap();
    assert_eq!((t.device(), t.to_vec2::<u8>().unwrap()), (cpu(), vec![vec![1, 2], vec![3, 4]]));
}

#[test]
fn a_tensor_does_not_share_the_arrays_memory() {
    let mut a = array![1f32, 2., 3.];
    let t = Tensor::from_ndarray(&a, &cpu()).unwrap();
    a[0] = 100.0;
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1., 2., 3.]);
    let mut back = t.to_ndarray::<f32>().unwrap();
    back[[1]] = -1.0;
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1., 2., 3.]);
}

#[test]
fn wrong_dtypes_and_ranks_are_errors() {
    let t = Tensor::ones((2, 2, 2), DType::F32, &cpu()).unwrap();
    match t.to_ndarray::<f64>() {
        Err(Error::DTypeMismatch { op, lhs, rhs }) => {
            assert_eq!((op.as_str(), lhs, rhs), ("to_ndarray::<f64>", DType::F64, DType::F32));
            let msg = t.to_ndarray::<f64>().unwrap_err().to_string();
            assert!(msg.contains(".to_dtype(DType::F64)"), "the hint converts the tensor to what was asked: {msg}");
        }
        other => panic!("{other:?}"),
    }
    match t.to_ndarray2::<f32>() {
        Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains("needs a 2-D tensor"), "{msg}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(Tensor::from_ndarray(&array![1f32], &kiln::gpu(999)), Err(Error::NoSuchDevice { .. })));
}

#[test]
fn transfers_are_booked_at_the_callers_line_and_guarded() {
    let gpu = common::sims()[0];
    let a = array![[1f32, 2.], [3., 4.]];
    let before = kiln::thread_transfer_stats();
    let (line, t) = at_line!(Tensor::from_ndarray(&a.t(), &gpu).unwrap());
    assert_eq!(common::booked_at(&before, file!(), line, Direction::HostToDevice), 1);
    let (line, back) = at_line!(t.to_ndarray2::<f32>().unwrap());
    assert_eq!((common::booked_at(&before, file!(), line, Direction::DeviceToHost), back), (1, a.t().to_owned()));
    let (line, _) = at_line!(ArrayD::<f32>::try_from(&t).unwrap());
    assert_eq!(common::booked_at(&before, file!(), line, Direction::DeviceToHost), 1);
    let quiet = kiln::thread_transfer_stats();
    let on_cpu = Tensor::from_ndarray(&a, &cpu()).unwrap();
    let _ = on_cpu.to_ndarray::<f32>().unwrap();
    assert_eq!(kiln::thread_transfer_stats().since(&quiet).total().count, 0, "the CPU needs no transfer");

    let _guard = kiln::transfer_guard(GuardLevel::Disallow);
    let (line, refused) = at_line!(Tensor::from_ndarray(&a, &gpu));
    match refused {
        Err(Error::TransferDisallowed { location, .. }) => assert!(location.starts_with(&format!("{}:{line}:", file!())), "{location}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(t.to_ndarray::<f32>(), Err(Error::TransferDisallowed { .. })));
}
