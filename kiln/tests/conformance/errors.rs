//! Conformance: errors.

use crate::common::sims;
use crate::common::{assert_f32, devices, on_every_device};
use kiln::nn::{one_hot, Linear, Module, Sequential};
use kiln::Device;
use kiln::{cpu, gpu, DType, Error, Result, Tensor};

#[test]
fn device_mismatch_names_the_op_and_both_devices() {
    let all = devices();
    for (i, &l) in all.iter().enumerate() {
        for &r in &all[i + 1..] {
            let a = Tensor::ones((2, 2), DType::F32, &l).unwrap();
            let b = Tensor::ones((2, 2), DType::F32, &r).unwrap();
            let ids = Tensor::new(&[0i64], &r).unwrap();
            let cond = Tensor::new(&[1u8], &r).unwrap();
            let cases: Vec<(&str, Result<Tensor>)> = vec![
                ("add", &a + &b),
                ("sub", a.sub(&b)),
                ("mul", &a * &b),
                ("div", a.div(&b)),
                ("maximum", a.maximum(&b)),
                ("lt", a.lt(&b)),
                ("matmul", a.matmul(&b)),
                ("cat", Tensor::cat(&[&a, &b], 0)),
                ("cat", Tensor::stack(&[&a, &b], 0)),
                ("index_select", a.index_select(&ids, 0)),
                ("index_add", a.index_add(&ids, &b.narrow(0, 0, 1).unwrap(), 0)),
                ("where", cond.where_cond(&a, &a)),
            ];
            for (op, res) in cases {
                match res {
                    Err(e @ Error::DeviceMismatch { .. }) => {
                        let Error::DeviceMismatch { op: got_op, lhs, rhs } = &e else { unreachable!() };
                        assert_eq!(got_op, op);
                        assert!((*lhs, *rhs) == (l, r) || (*lhs, *rhs) == (r, l), "{op}: devices {lhs}, {rhs}");
                        let msg = e.to_string();
                        assert!(msg.contains(op) && msg.contains(&l.to_string()) && msg.contains(&r.to_string()), "{msg}");
                        assert!(msg.contains(".to("), "the message should say how to fix it: {msg}");
                    }
                    other => panic!("{op} of {l} and {r}: expected DeviceMismatch, got {other:?}"),
                }
            }
            assert!(matches!(a.assign(&b), Err(Error::DeviceMismatch { .. })));
            // Nothing was moved to make it work.
            assert_eq!((a.device(), b.device()), (l, r));
        }
        crate::common::report_ran(l);
    }
}

#[test]
fn shape_dtype_and_argument_errors() {
    on_every_device(|d| {
        let a = Tensor::ones((2, 3), DType::F32, &d)?;
        let b = Tensor::ones((4,), DType::F32, &d)?;
        match a.add(&b) {
            Err(Error::ShapeMismatch { op, lhs, rhs }) => assert_eq!((op.as_str(), lhs, rhs), ("add", vec![2, 3], vec![4])),
            other => panic!("{other:?}"),
        }
        match a.matmul(&a) {
            Err(e @ Error::ShapeMismatch { .. }) => assert!(e.to_string().contains("matmul"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(a.reshape((4, 2)), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(a.broadcast_to((3, 3)), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(a.broadcast_to(3), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(Tensor::cat(&[&a, &b], 0), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(Tensor::stack(&[&a, &a.t()?], 0), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(Tensor::from_vec(vec![1f32; 5], (2, 3), &d), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(a.index_add(&Tensor::new(&[0i64], &d)?, &a, 0), Err(Error::ShapeMismatch { .. })));
        // Dtypes.
        // Two dtypes promote as PyTorch does (arithmetic, cat, where); matmul
        // refuses them, as PyTorch's does, and its hint widens.
        let f64s = Tensor::ones((2, 3), DType::F64, &d)?;
        assert_eq!(a.add(&f64s)?.dtype(), DType::F64);
        match a.matmul(&f64s.t()?) {
            Err(e @ Error::DTypeMismatch { .. }) => {
                assert!(e.to_string().contains("convert the f32 operand to the wider dtype with `.to_dtype(DType::F64)?`"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(Tensor::cat(&[&a, &f64s], 0)?.dtype(), DType::F64);
        assert!(matches!(a.to_vec::<f64>(), Err(Error::DTypeMismatch { .. })));
        assert_eq!(a.gt(&a)?.where_cond(&a, &f64s)?.dtype(), DType::F64);
        // Unsupported dtypes.
        let h = a.to_dtype(DType::F16)?;
        assert!(matches!(h.add(&h), Err(Error::UnsupportedDType { dtype: DType::F16, .. })));
        assert!(matches!(h.sum_all(), Err(Error::UnsupportedDType { .. })));
        assert!(matches!(a.to_dtype(DType::BF16)?.exp(), Err(Error::UnsupportedDType { .. })));
        let i = Tensor::new(&[1i64, 2], &d)?;
        for res in [i.pow(&i), i.mean_all(), Tensor::randn_with(0.0, 1.0, 2, DType::I64, &d)] {
            assert!(matches!(res, Err(Error::UnsupportedDType { dtype: DType::I64, .. })), "{res:?}");
        }
        // Float functions of integers compute in f32, as in PyTorch.
        for res in [i.exp(), i.log(), i.sqrt(), i.sigmoid(), i.powf(2.0)] {
            assert_eq!(res?.dtype(), DType::F32);
        }
        assert!(matches!(a.to_dtype(DType::BF16)?.matmul(&a.to_dtype(DType::BF16)?.t()?), Err(Error::UnsupportedDType { .. })));
        // Invalid arguments.
        let invalid: Vec<Result<Tensor>> = vec![
            a.narrow(1, 2, 2),
            a.narrow(2, 0, 1),
            a.narrow(0, usize::MAX, 2),
            a.slice(1, std::ops::Range { start: 2, end: 1 }),
            a.squeeze(2),
            a.unsqueeze(3),
            a.transpose(0, 2),
            a.permute(&[0, 0]),
            a.permute(&[1]),
            a.sum(2),
            a.sum_dims(&[0, 0], false),
            a.argmax(5),
            a.argmax_keepdim(2),
            a.reduce(kiln::Reduction::ArgMax, &[0, 1], false),
            Tensor::zeros((0, 2), DType::F32, &d)?.max(0),
            Tensor::zeros((0, 2), DType::F32, &d)?.argmax(0),
            i.powi(-1),
            Tensor::new(&1f32, &d)?.matmul(&a),
            Tensor::cat(&[], 0),
            Tensor::cat(&[&a], 2),
            a.index_select(&Tensor::new(&[0f32], &d)?, 0),
            a.index_select(&Tensor::new(&[[0i64]], &d)?, 0),
            a.index_select(&Tensor::new(&[0i64], &d)?, 2),
            a.reshape(6)?.get(6),
            Tensor::new(&1f32, &d)?.t(),
        ];
        for (k, res) in invalid.into_iter().enumerate() {
            match res {
                Err(e @ Error::InvalidArgument { .. }) => assert!(!e.to_string().is_empty()),
                other => panic!("case {k} on {d}: expected InvalidArgument, got {other:?}"),
            }
        }
        assert!(matches!(a.to_scalar::<f32>(), Err(Error::InvalidArgument { .. })));
        assert!(matches!(a.item(), Err(Error::InvalidArgument { .. })));
        assert!(matches!(a.to_vec2::<f32>()?.len(), 2));
        assert!(matches!(b.to_vec2::<f32>(), Err(Error::InvalidArgument { .. })));
        assert!(matches!(a.dim(2), Err(Error::InvalidArgument { .. })));
        assert!(matches!(Tensor::new(&[1f32], &d)?.backward(), Err(Error::InvalidArgument { .. })));
        Ok(())
    });
}

#[test]
fn out_of_range_indices_on_the_host_are_errors() {
    // The simulated GPUs' part poisons their queues until reported: in a
    // child process, away from the tests running beside it.
    if !crate::common::is_child() {
        crate::common::run_child(&[]);
        return;
    }
    let x = Tensor::ones((3, 2), DType::F32, &cpu()).unwrap();
    for ids in [vec![3i64], vec![0, 7], vec![-1]] {
        match x.index_select(&Tensor::new(&ids[..], &cpu()).unwrap(), 0) {
            Err(e @ Error::InvalidArgument { .. }) => assert!(e.to_string().contains("out of range"), "{e}"),
            other => panic!("indices {ids:?}: expected InvalidArgument, got {other:?}"),
        }
    }
    let src = Tensor::ones((1, 2), DType::F32, &cpu()).unwrap();
    assert!(matches!(x.index_add(&Tensor::new(&[-2i64], &cpu()).unwrap(), &src, 0), Err(Error::InvalidArgument { .. })));
    assert!(matches!(x.index_add(&Tensor::new(&[3i64], &cpu()).unwrap(), &src, 0), Err(Error::InvalidArgument { .. })));
    // Indices on a simulated GPU are not read back (that would be a hidden
    // transfer): the kernel checks them, and the next synchronising call
    // reports the first bad one (`indexing.rs` has the rest).
    for d in crate::common::sims() {
        let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &d).unwrap();
        let ids = Tensor::new(&[-1i64, 1, 2], &d).unwrap();
        match x.index_select(&ids, 0).unwrap().to_vec::<f32>() {
            Err(Error::KernelFailed { op, msg, .. }) => {
                assert_eq!(op, "index_select");
                assert!(msg.contains("index -1 is out of range for dimension 0 of size 2"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
        let z = Tensor::zeros((2, 2), DType::F32, &d).unwrap();
        let added = z.index_add(&Tensor::new(&[1i64, 2], &d).unwrap(), &x, 0).unwrap();
        assert!(matches!(added.to_vec::<f32>(), Err(Error::KernelFailed { op, .. }) if op == "index_add"));
        // The device works again after the report.
        assert_f32(&x.index_select(&Tensor::new(&[1i64], &d).unwrap(), 0).unwrap(), d, &[1, 2], &[3., 4.]);
    }
    println!("CHILD-OK");
}

#[test]
fn no_such_device_lists_devices_and_suggests_try_gpu() {
    let bad = gpu(99);
    let check = |e: Error| match &e {
        Error::NoSuchDevice { device, available } => {
            assert_eq!(*device, bad);
            assert_eq!(available[0], cpu());
            assert!(available.len() == 1 + kiln::num_gpus(), "{available:?}");
            let msg = e.to_string();
            assert!(msg.contains("gpu(99)") && msg.contains("try_gpu(99)") && msg.contains("cpu, gpu(0)"), "{msg}");
        }
        other => panic!("expected NoSuchDevice, got {other:?}"),
    };
    devices(); // makes sure the simulated GPUs exist
    check(Tensor::zeros(2, DType::F32, &bad).unwrap_err());
    check(Tensor::new(&[1f32], &bad).unwrap_err());
    check(Tensor::rand(2, &bad).unwrap_err());
    check(Tensor::eye(2, DType::F32, &bad).unwrap_err());
    check(Tensor::arange(0.0, 2.0, 1.0, &bad).unwrap_err());
    for d in devices() {
        let x = Tensor::ones(2, DType::F32, &d).unwrap();
        check(x.to(&bad).unwrap_err());
        check(x.copy_to(&bad).unwrap_err());
        crate::common::report_ran(d);
    }
    check(kiln::memory_stats(&bad).unwrap_err());
    check(kiln::synchronize(&bad).unwrap_err());
    check(kiln::reset_peak_memory(&bad).unwrap_err());
    check(kiln::default_device_scope(bad).err().unwrap());
    assert!(!bad.exists());
    // Naming a device never fails.
    assert_eq!(bad.to_string(), "gpu(99)");
}

#[test]
fn read_and_softmax_errors_name_the_call_and_the_fix() {
    on_every_device(|d| {
        let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &d)?;
        let one = Tensor::new(&[5f32], &d)?;
        match one.to_scalar::<f64>() {
            Err(Error::DTypeMismatch { op, lhs, rhs }) => {
                assert_eq!((op.as_str(), lhs, rhs), ("to_scalar::<f64>", DType::F64, DType::F32));
            }
            other => panic!("to_scalar::<f64> of an f32 tensor gave {other:?}"),
        }
        let msg = one.to_scalar::<f64>().unwrap_err().to_string();
        assert!(msg.contains("to_dtype(DType::F64)"), "{msg}");
        assert!(x.to_vec2::<i64>().unwrap_err().to_string().starts_with("to_vec2::<i64>"));
        assert!(x.to_vec::<u8>().unwrap_err().to_string().starts_with("to_vec::<u8>"));
        // softmax names itself, with the rank, for a dimension out of range.
        let e = x.softmax(2).unwrap_err().to_string();
        assert!(e.starts_with("softmax") && e.contains("rank 2"), "{e}");
        assert!(kiln::nn::softmax(&x, -3).unwrap_err().to_string().starts_with("softmax"));
        assert!(x.log_softmax(5).unwrap_err().to_string().starts_with("log_softmax"));
        assert!(Tensor::new(&1f32, &d)?.softmax(1).unwrap_err().to_string().starts_with("softmax"));
        // A 0-d tensor takes 0 and -1, as in PyTorch.
        assert_eq!(Tensor::new(&1f32, &d)?.softmax(0)?.to_scalar::<f32>()?, 1.0);
        // nn's functions and the methods agree, any dimension.
        assert_eq!(kiln::nn::softmax(&x, 0)?.to_vec::<f32>()?, x.softmax(-2)?.to_vec::<f32>()?);
        assert_eq!(kiln::nn::log_softmax(&x, 1)?.to_vec::<f32>()?, x.log_softmax(-1)?.to_vec::<f32>()?);
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
fn absurd_sizes_are_errors_not_panics() {
    // Zero elements, but strides that would overflow.
    assert!(Tensor::zeros((0, 1 << 40, 1 << 40), DType::F32, &cpu()).is_ok());
    let huge = Tensor::ones((1,), DType::F32, &cpu()).unwrap().broadcast_to((1usize << 60, 4)).unwrap();
    assert!(matches!(huge.copy_to(&cpu()), Err(Error::OutOfMemory { .. })));
}

/// Error hints are Rust that compiles: `kiln::empty_cache` takes the device,
/// and a creation of random integers has nothing to convert.
#[test]
fn out_of_memory_and_dtype_hints_compile() {
    let dev = sims()[0];
    let err = Tensor::zeros(1usize << 40, DType::U8, &dev).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert!(err.to_string().contains(&format!("`kiln::empty_cache(&kiln::{dev})?`")), "{err}");
    // What the hint says compiles and runs.
    let hint = || -> kiln::Result<()> {
        kiln::empty_cache(&kiln::gpu(0))?;
        Ok(())
    };
    hint().unwrap();

    let err = Tensor::rand_uniform(0.0, 1.0, 3, DType::I32, &cpu()).unwrap_err();
    assert!(err.to_string().contains("random values are floats: ask for `kiln::DType::F32`"), "{err}");
    let two = Tensor::new(&[2i64], &cpu()).unwrap();
    let err = two.pow(&two).unwrap_err();
    // The hint widens: f64 holds the i64 values f32 would round (issue 18).
    assert!(matches!(err, Error::UnsupportedDType { .. }) && err.to_string().contains("`.to_dtype(kiln::DType::F64)?`"), "{err}");
    let hint = || -> kiln::Result<Tensor> { two.to_dtype(kiln::DType::F64)?.pow(&two.to_dtype(kiln::DType::F64)?) };
    assert_eq!(hint().unwrap().to_vec::<f64>().unwrap(), vec![4.0]);
}

#[test]
fn device_hints_are_rust_that_compiles() -> Result<()> {
    let g = sims()[0];
    let a = Tensor::ones((2,), DType::F32, &cpu())?;
    let b = Tensor::ones((2,), DType::F32, &g)?;
    let msg = a.add(&b).unwrap_err().to_string();
    assert!(msg.ends_with("move one operand first, e.g. `rhs.to(&kiln::cpu())?`"), "{msg}");
    let msg = b.add(&a).unwrap_err().to_string();
    assert!(msg.ends_with(&format!("e.g. `rhs.to(&kiln::{g:?})?`").replace("Gpu(", "gpu(")), "{msg}");
    // A forward whose input is elsewhere: the input moves.
    let net = Sequential::new().add(Linear::new(2, 1, &g)?);
    let msg = net.forward(&a).unwrap_err().to_string();
    let Device::Gpu(i) = g else { unreachable!() };
    assert_eq!(
        msg,
        format!(
            "input is on cpu while layer 0 weight is on {g}; kiln never copies silently: move the input first, e.g. `x.to(&kiln::gpu({i}))?`"
        )
    );
    Ok(())
}
