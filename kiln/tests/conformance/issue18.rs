//! Conformance: the silent wrong answers of issue 18, one test per item
//! (the dtype items are in `dtypes.rs`), on every device. Expected values
//! and errors are PyTorch 2.x's.

use crate::common::{assert_f32, is_child, on_every_device, run_child};
use kiln::{DType, Device, Error, Result, Tensor};
use std::time::Duration;

#[test]
fn flatten_from_resolves_negative_dimensions_against_the_rank() {
    on_every_device(|d| {
        let x = Tensor::zeros((5, 3), DType::F32, &d)?;
        // torch.zeros(5, 3).flatten(-2) is [15]; flatten(-1) and flatten(1) change nothing.
        assert_eq!(x.flatten_from(-2)?.dims(), &[15]);
        assert_eq!(x.flatten_from(0)?.dims(), &[15]);
        assert_eq!(x.flatten_from(-1)?.dims(), &[5, 3]);
        assert_eq!(x.flatten_from(1)?.dims(), &[5, 3]);
        // IndexError in PyTorch: -3 and 2 are out of range for rank 2.
        for bad in [-3i64, 2, 3] {
            let e = x.flatten_from(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("rank 2"), "{bad}: {e}");
        }
        let y = Tensor::arange(0.0, 24.0, 1.0, &d)?.reshape((2, 3, 4))?;
        assert_eq!(y.flatten_from(-2)?.dims(), &[2, 12]);
        assert_eq!(y.flatten_from(-3)?.dims(), &[24]);
        assert_eq!(y.flatten_from(1)?.to_vec::<f32>()?, y.to_vec::<f32>()?);
        assert!(y.flatten_from(3).is_err() && y.flatten_from(-4).is_err());
        // A 0-d tensor: flatten(0) and flatten(-1) give [1]; 1 is out of
        // range "for a tensor of rank 1" (PyTorch wraps as if it had one).
        let s = Tensor::new(&7f32, &d)?;
        assert_f32(&s.flatten_from(0)?, d, &[1], &[7.]);
        assert_f32(&s.flatten_from(-1)?, d, &[1], &[7.]);
        let e = s.flatten_from(1).unwrap_err().to_string();
        assert!(e.contains("rank 1"), "{e}");
        assert!(s.flatten_from(-2).is_err());
        Ok(())
    });
}

/// Runs `f` on another thread and waits at most 20 s for it: a call that
/// synchronised with a held queue would never return.
fn returns_without_waiting<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| panic!("{what} waited for the held queue: a hidden synchronisation"))
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
    if !is_child() {
        run_child(&[]);
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
        assert!(matches!(e, Error::ShapeMismatch { .. }) && e.to_string().contains("batch dimensions"), "{e}");
        assert!(!e.to_string().contains("inner dimensions must agree"), "{e}");
        // A non-empty output too large to count is named as such.
        let e = Tensor::ones((1, 2, 1), DType::F32, &d)?
            .broadcast_to((usize::MAX / 2, 2, 1))?
            .matmul(&Tensor::ones((1, 3), DType::F32, &d)?)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. } | Error::OutOfMemory { .. }), "{e}");
        Ok(())
    });
}

#[test]
fn arange_with_a_step_of_the_wrong_sign_is_an_error() {
    on_every_device(|d| {
        // torch.arange(1.0, 20.0, -0.25): "upper bound and larger bound inconsistent with step sign".
        for (start, end, step) in [(1.0, 20.0, -0.25), (5.0, 0.0, 1.0)] {
            let e = Tensor::arange(start, end, step, &d).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("sign of the step"), "{e}");
        }
        assert_f32(&Tensor::arange(20.0, 19.0, -0.25, &d)?, d, &[4], &[20., 19.75, 19.5, 19.25]);
        assert_eq!(Tensor::arange(3.0, 3.0, -1.0, &d)?.dims(), &[0]);
        assert_eq!(Tensor::arange(3.0, 3.0, 1.0, &d)?.dims(), &[0]);
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

#[test]
fn a_host_allocation_refused_by_the_address_space_limit_names_the_limit() {
    if !is_child() {
        run_child(&[]);
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // 4 GiB of address space, then ask for 8 GiB.
        let limit = libc::rlimit { rlim_cur: 4 << 30, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: setrlimit reads the struct; lowering the soft limit is allowed.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
        let e = Tensor::zeros(1usize << 31, DType::F32, &kiln::cpu()).unwrap_err();
        let msg = e.to_string();
        match &e {
            Error::OutOfMemory { limit: Some(kiln::HostLimit::AddressSpace { limit, mapped }), .. } => {
                assert_eq!(*limit, 4 << 30);
                assert!(*mapped > 0 && *mapped < 4 << 30, "{mapped}");
            }
            other => panic!("{other:?}"),
        }
        assert!(msg.contains("RLIMIT_AS") && msg.contains("4.0 GiB") && msg.contains("8.0 GiB"), "{msg}");
    }
    println!("CHILD-OK");
}
