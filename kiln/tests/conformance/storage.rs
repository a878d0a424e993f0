//! Conformance: storage and transfers.

use crate::common::{devices, f32s, on_every_device};
use kiln::{cpu, DType, Tensor};
use std::sync::mpsc;
use std::time::Duration;

#[test]
fn to_shares_storage_on_the_same_device_and_copy_to_never_does() {
    let all = devices();
    for &d in &all {
        let x = Tensor::new(&[1f32, 2., 3.], &d).unwrap();
        let same = x.to(&d).unwrap();
        assert!(same.same_storage(&x), "to({d}) of a tensor on {d} must share storage");
        let copy = x.copy_to(&d).unwrap();
        assert!(!copy.same_storage(&x), "copy_to({d}) must allocate");
        assert_eq!((copy.device(), f32s(&copy, d)), (d, vec![1., 2., 3.]));
        // The copy is independent of the original.
        x.assign(&Tensor::new(&[0f32], &d).unwrap()).unwrap();
        assert_eq!(f32s(&copy, d), vec![1., 2., 3.]);
        assert_eq!(f32s(&same, d), vec![0., 0., 0.]);
        for &e in &all {
            if e == d {
                continue;
            }
            let y = Tensor::arange(0.0, 6.0, 1.0, &d).unwrap().reshape((2, 3)).unwrap().t().unwrap();
            let moved = y.to(&e).unwrap();
            assert!(!moved.same_storage(&y));
            assert_eq!((moved.device(), moved.dims()), (e, &[3usize, 2][..]));
            assert_eq!(f32s(&moved, e), vec![0., 3., 1., 4., 2., 5.], "{d} -> {e}");
            let back = moved.to(&d).unwrap();
            assert_eq!(f32s(&back, d), vec![0., 3., 1., 4., 2., 5.], "{d} -> {e} -> {d}");
            let h = Tensor::new(&[1.5f32, -3.0], &d).unwrap().to_dtype(DType::BF16).unwrap().to(&e).unwrap();
            assert_eq!(h.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![1.5, -3.0]);
        }
        crate::common::report_ran(d);
    }
}

#[test]
fn display_prints_values_and_device() {
    on_every_device(|d| {
        let x = Tensor::ones((2, 3), DType::F32, &d)?;
        let suffix = if d.is_cpu() { String::new() } else { format!(", device={d}") };
        assert_eq!(x.to_string(), format!("tensor([[1., 1., 1.],\n        [1., 1., 1.]]{suffix})"));
        let y = Tensor::new(&[0.5f32, -1.25], &d)?;
        assert_eq!(y.to_string(), format!("tensor([ 0.5000, -1.2500]{suffix})"));
        let i = Tensor::new(&[3i64], &d)?;
        assert_eq!(i.to_string(), format!("tensor([3]{suffix})"));
        let big = Tensor::arange(0.0, 2000.0, 1.0, &d)?;
        let s = big.to_string();
        assert!(s.starts_with("tensor([   0.,    1.,    2., ..., 1997., 1998., 1999.]"), "{s}");
        assert_eq!(format!("{:?}", x), format!("Tensor[[2, 3], f32, {d}]"));
        Ok(())
    });
}

#[test]
fn a_host_allocation_refused_by_the_address_space_limit_names_the_limit() {
    if !crate::common::is_child() {
        crate::common::run_child(&[]);
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
            kiln::Error::OutOfMemory { limit: Some(kiln::HostLimit::AddressSpace { limit, mapped }), .. } => {
                assert_eq!(*limit, 4 << 30);
                assert!(*mapped > 0 && *mapped < 4 << 30, "{mapped}");
            }
            other => panic!("{other:?}"),
        }
        assert!(msg.contains("RLIMIT_AS") && msg.contains("4.0 GiB") && msg.contains("8.0 GiB"), "{msg}");
    }
    println!("CHILD-OK");
}

#[test]
fn an_op_on_one_storage_twice_does_not_deadlock_with_a_concurrent_assign() {
    // `&w * &w` reads w's storage twice; a writer waiting in between used to
    // block the second read forever.
    let w = Tensor::ones((256, 256), DType::F32, &cpu()).unwrap();
    let src = Tensor::full(2.0, (256, 256), DType::F32, &cpu()).unwrap();
    let (tx, rx) = mpsc::channel();
    let (w1, w2) = (w.clone(), w.clone());
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        for _ in 0..300 {
            let _ = (&w1 * &w1).unwrap();
            let _ = w1.matmul(&w1).unwrap();
            let c = w1.ge(&w1).unwrap();
            let _ = c.where_cond(&w1, &w1).unwrap();
        }
        tx.send(()).unwrap();
    });
    std::thread::spawn(move || {
        for _ in 0..300 {
            w2.assign(&src).unwrap();
        }
        tx2.send(()).unwrap();
    });
    for _ in 0..2 {
        rx.recv_timeout(Duration::from_secs(120)).expect("readers and a writer of one storage deadlocked");
    }
}
