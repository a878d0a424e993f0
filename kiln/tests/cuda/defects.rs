//! Defects the CUDA simulator found (issue 11), checked on a CUDA device.

use super::*;

// ---- defects the CUDA simulator found (issue 11) ---------------------------

/// Runs `f` on another thread and fails if it has not finished within
/// `secs` (instead of hanging the suite).
pub(crate) fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(v) => Some(v),
        Err(_) => {
            eprintln!("{what} did not finish within {secs} s");
            None
        }
    }
}

pub(crate) fn cuda_negative_indices_are_reported_like_the_other_devices() -> Ran {
    // Alone: a reported bad index poisons the device for every thread until
    // the next synchronising call (issue 18).
    on_cuda_alone("negative indices", |d| {
        let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &d)?;
        let ids = Tensor::new(&[-1i64, 1, i64::MIN, 2], &d)?;
        // A negative index is out of range, never row 0: the kernel records
        // the first bad one and the read reports it, as on a simulated GPU
        // (the CPU refuses it up front).
        match x.index_select(&ids, 0)?.to_vec::<f32>() {
            Err(Error::KernelFailed { device, op, msg }) => {
                assert_eq!((device, op.as_str()), (d, "index_select"));
                assert!(msg.contains("is out of range for dimension 0 of size 3"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
        let dst = Tensor::zeros((3, 2), DType::F32, &d)?;
        let src = Tensor::ones((4, 2), DType::F32, &d)?;
        let added = dst.index_add(&ids, &src, 0)?;
        assert!(matches!(kiln::synchronize(&d), Err(Error::KernelFailed { op, .. }) if op == "index_add"));
        drop(added);
        // Reported once; the device works again, with good indices.
        kiln::synchronize(&d)?;
        let good = Tensor::new(&[2i64, 1], &d)?;
        assert_eq!(x.index_select(&good, 0)?.to_vec::<f32>()?, vec![5., 6., 3., 4.]);
        Ok(())
    })
}

pub(crate) fn cuda_integer_argmax_is_exact_above_2_pow_53() -> Ran {
    on_cuda("i64 argmax", |d| {
        let big = 1i64 << 60;
        let v = Tensor::new(&[big + 1, big + 2, big, big + 2], &d)?;
        assert_eq!(v.argmax(0)?.to_vec::<i64>()?, vec![1]);
        assert_eq!(v.argmin(0)?.to_vec::<i64>()?, vec![2]);
        // Long enough for the many-block path; the extremes lie late.
        let n = 300_000usize;
        let mut host: Vec<i64> = (0..n as i64).map(|i| big + (i % 1000)).collect();
        host[n - 7] = big + 5000;
        host[n - 3] = big - 1;
        let long = Tensor::from_vec(host, n, &d)?;
        assert_eq!(long.argmax(0)?.to_vec::<i64>()?, vec![(n - 7) as i64]);
        assert_eq!(long.argmin(0)?.to_vec::<i64>()?, vec![(n - 3) as i64]);
        Ok(())
    })
}

pub(crate) fn cuda_full_reductions_over_many_blocks_match_the_cpu() -> Ran {
    on_cuda("long reductions", |d| {
        for n in [4095usize, 100_000, 1_000_003] {
            let host = sample(&[n], n as u64)?;
            let x = host.to(&d)?;
            close(&x.sum_all()?, &host.sum_all()?, 1e-6, &format!("sum_all of {n}"))?;
            close(&x.mean_all()?, &host.mean_all()?, 1e-6, &format!("mean_all of {n}"))?;
            close(&x.norm()?, &host.norm()?, 1e-6, &format!("norm of {n}"))?;
            same(&x.argmax(0)?, &host.argmax(0)?, &format!("argmax of {n}"))?;
            same(&x.argmin(0)?, &host.argmin(0)?, &format!("argmin of {n}"))?;
            let i = host.to_dtype(DType::F64)?.affine(1000.0, 0.0)?.to_dtype(DType::I64)?;
            same(&i.to(&d)?.sum_all()?, &i.sum_all()?, &format!("i64 sum_all of {n}"))?;
            // Two long rows: two outputs, each over many blocks.
            let h2 = host.narrow(0, 0, n / 2 * 2)?.reshape((2, n / 2))?;
            close(&h2.to(&d)?.sum(1)?, &h2.sum(1)?, 1e-6, &format!("row sums of 2x{}", n / 2))?;
            same(&h2.to(&d)?.argmax(1)?, &h2.argmax(1)?, &format!("row argmax of 2x{}", n / 2))?;
        }
        Ok(())
    })
}

pub(crate) fn cuda_cached_bytes_are_reported_and_empty_cache_returns_them_from_any_thread() -> Ran {
    on_cuda_alone("cache", |d| {
        kiln::empty_cache(&d)?;
        assert_eq!(kiln::memory_stats(&d)?.cached, 0, "cached after empty_cache");
        drop(Tensor::zeros((1024, 1024), DType::F32, &d)?);
        let cached = kiln::memory_stats(&d)?.cached;
        assert!(cached >= 4 << 20, "a dropped 4 MiB tensor is kept for reuse: cached = {cached}");
        let free_before = kiln::devices().into_iter().find(|i| i.device == d).and_then(|i| i.memory_free).unwrap_or(0);
        // From a fresh thread, on which no CUDA context is current.
        let r = std::thread::spawn(move || kiln::empty_cache(&d)).join().expect("no panic");
        r?;
        assert_eq!(kiln::memory_stats(&d)?.cached, 0, "cached after empty_cache on another thread");
        let free_after = kiln::devices().into_iter().find(|i| i.device == d).and_then(|i| i.memory_free).unwrap_or(0);
        assert!(free_after >= free_before + (4 << 20), "the driver got the cached blocks back: free {free_before} -> {free_after}");
        Ok(())
    })
}

pub(crate) fn cuda_empty_cache_waits_for_queued_kernels_that_used_cached_blocks() -> Ran {
    on_cuda_alone("free vs queue", |d| {
        let x = Tensor::full(1.5, 1 << 16, DType::F32, &d)?;
        x.add_scalar(1.0)?; // loads the kernel: loading waits for an idle device
        kiln::synchronize(&d)?;
        let hold = kiln::hold_queue(&d)?.expect("a CUDA device has a queue to hold");
        let y = x.add_scalar(1.0)?; // queued behind the hold, reads x
        drop(x); // x's block goes to the cache while that kernel waits
        let emptied = std::thread::spawn(move || kiln::empty_cache(&d));
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(hold);
        emptied.join().expect("no panic")?;
        assert!(y.to_vec::<f32>()?.iter().all(|&v| v == 2.5), "the kernel read its input after it was freed");
        Ok(())
    })
}

/// empty_cache takes the cached blocks before it waits: a block that another
/// thread takes from the cache, queues work on and gives back while
/// empty_cache waits must not be freed under that work. Since a free waits
/// for the whole device (cuMemFree, on a GPU and in the simulator), the
/// test also checks that empty_cache returns only once the queue drained.
pub(crate) fn cuda_empty_cache_does_not_free_blocks_reused_while_it_waits() -> Ran {
    on_cuda_alone("free vs reuse", |d| {
        let n = 1 << 16;
        let x = Tensor::full(1.5, n, DType::F32, &d)?;
        let z = Tensor::zeros(n, DType::F32, &d)?;
        x.add_scalar(1.0)?; // loads the kernel: loading waits for an idle device
        kiln::synchronize(&d)?;
        let first = kiln::hold_queue(&d)?.expect("a CUDA device has a queue to hold");
        drop(z); // its block goes to the cache
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(kiln::empty_cache(&d));
        });
        std::thread::sleep(std::time::Duration::from_millis(200)); // empty_cache waits for the first hold
        let second = kiln::hold_queue(&d)?.expect("a CUDA device has a queue to hold");
        let y = x.add_scalar(1.0)?; // may take z's block from the cache; queued behind both holds
        let w = y.add_scalar(1.0)?; // reads y
        drop(y); // y's block returns to the cache while both kernels wait
        drop(first);
        // Freeing device memory synchronises a CUDA device (cuMemFree waits
        // for every stream, the simulator's as a GPU's): empty_cache returns
        // only once the second hold is released and both kernels have run.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(rx.try_recv().is_err(), "empty_cache returned while work was still queued: its frees did not synchronise");
        drop(second);
        let emptied = rx.recv_timeout(std::time::Duration::from_secs(20));
        emptied.expect("empty_cache did not return once the device's queue had drained")?;
        assert!(w.to_vec::<f32>()?.iter().all(|&v| v == 3.5), "a kernel used a block that empty_cache freed");
        Ok(())
    })
}

pub(crate) fn cuda_uploads_do_not_wait_for_earlier_work() -> Ran {
    on_cuda_alone("uploads overlap compute", |d| {
        Tensor::full(0.0, 1000, DType::F32, &d)?; // any kernel a fill uses is loaded before the hold
        kiln::synchronize(&d)?;
        let hold = kiln::hold_queue(&d)?.expect("a CUDA device has a queue to hold");
        // Three uploads while the queue is stopped: each must return once
        // its bytes are staged, not wait for the stream.
        let done = within(20, "uploads while the queue is held", move || -> Result<Vec<Tensor>> {
            (0..3).map(|i| Tensor::full(i as f64, 1000, DType::F32, &d)).collect()
        });
        drop(hold);
        let tensors = done.expect("an upload waited for the held queue (uploads do not overlap earlier work)")?;
        for (i, t) in tensors.iter().enumerate() {
            assert!(t.to_vec::<f32>()?.iter().all(|&v| v == i as f32), "upload {i}");
        }
        Ok(())
    })
}

pub(crate) fn cuda_staging_buffers_are_not_reused_before_their_copy_ran() -> Ran {
    on_cuda_alone("staging reuse", |d| {
        let n = 10_000_000usize; // 40 MB: five staging chunks
        let host: Vec<f32> = (0..n).map(|i| (i % 100_003) as f32).collect();
        let hold = kiln::hold_queue(&d)?.expect("a CUDA device has a queue to hold");
        let h2 = host.clone();
        let up = within(20, "a 40 MB upload while the queue is held", move || Tensor::from_vec(h2, n, &d));
        drop(hold);
        let x = up.expect("the upload waited for the held queue")?;
        assert!(x.to_vec::<f32>()? == host, "40 MB uploaded while the queue was held came back different");
        Ok(())
    })
}

/// More pieces than a device keeps staging chunks (8 of 8 MiB): the ninth
/// piece must wait for the copy of the first before refilling its chunk.
pub(crate) fn cuda_an_upload_past_the_last_staging_chunk_waits_for_the_oldest_copy() -> Ran {
    on_cuda_alone("staging reuse past the last chunk", |d| {
        let n = 20_000_000usize; // 80 MB: ten staging chunks' worth
        let host: Vec<f32> = (0..n).map(|i| (i % 100_003) as f32).collect();
        let hold = kiln::hold_queue(&d)?.expect("a CUDA device has a queue to hold");
        let h2 = host.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(Tensor::from_vec(h2, n, &d));
        });
        // While the queue is held no copy runs, so the upload cannot get a
        // chunk back: give it time to refill one too early, then release.
        let early = rx.recv_timeout(std::time::Duration::from_secs(2));
        drop(hold);
        let finished_early = early.is_ok();
        let x = match early {
            Ok(r) => r?,
            Err(_) => rx.recv_timeout(std::time::Duration::from_secs(120)).expect("the upload finished once the queue ran")?,
        };
        assert!(
            x.to_vec::<f32>()? == host,
            "80 MB uploaded while the queue was held came back different (the upload finished while held: {finished_early})"
        );
        Ok(())
    })
}

pub(crate) fn no_cuda_device_is_listed_without_nvrtc() -> Ran {
    if std::env::var("KILN_EXPECT_NO_NVRTC").map(|v| v != "1").unwrap_or(true) {
        return Err(common::skip("run by CI with the CUDA simulator and no NVRTC (KILN_EXPECT_NO_NVRTC=1)"));
    }
    assert!(kiln::cuda_check::driver_present(), "this check needs the CUDA (simulator) driver");
    assert!(cuda_devices().is_empty(), "a CUDA device is listed although NVRTC is missing");
    let why = kiln::why_not_gpu(0).expect("a reason").to_string();
    assert!(why.contains("NVRTC") && why.contains("unusable"), "{why}");
    println!("without NVRTC: {why}");
    Ok(())
}

/// A `KILN_NVRTC_LIB` that cannot be loaded must not fall back to another
/// NVRTC: no CUDA device is listed, and the reason names the path. Runs this
/// test binary again with the variable set (NVRTC is loaded once a process).
pub(crate) fn a_kiln_nvrtc_lib_that_cannot_be_loaded_leaves_no_cuda_device_and_is_named() -> Ran {
    const BOGUS: &str = "/nonexistent/kiln-test/libnvrtc.so.12";
    if std::env::var("KILN_NVRTC_LIB").ok().as_deref() == Some(BOGUS) {
        assert!(cuda_devices().is_empty(), "a CUDA device is listed although KILN_NVRTC_LIB={BOGUS} cannot be loaded");
        let why = kiln::why_not_gpu(0).expect("a reason").to_string();
        assert!(why.contains(BOGUS) && why.contains("unusable"), "{why}");
        let nvrtc = kiln::cuda_check::nvrtc_version().expect_err("another NVRTC was used");
        assert!(nvrtc.contains(BOGUS), "{nvrtc}");
        println!("CHILD-OK with a bogus KILN_NVRTC_LIB: {why}");
        return Ok(());
    }
    let devs = cuda_devices();
    if devs.is_empty() {
        return Err(common::skip_no_cuda("needs a CUDA device (and its NVRTC) to show that a bogus KILN_NVRTC_LIB takes it away"));
    }
    let name = common::test_name();
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", name.as_str(), "--nocapture", "--test-threads=1"])
        .env("KILN_NVRTC_LIB", BOGUS)
        .env_remove("KILN_TEST_REPORT")
        .output()
        .expect("the test binary runs again");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("CHILD-OK"), "with KILN_NVRTC_LIB={BOGUS}:\n{stdout}\n{stderr}");
    for d in devs {
        common::report_ran(d);
    }
    Ok(())
}

pub(crate) fn cuda_to_cuda_copies_are_peer_copies_that_do_not_block_the_host() -> Ran {
    let _alone = DEVICES.write().unwrap_or_else(|e| e.into_inner());
    let devs = cuda_devices();
    if devs.len() < 2 {
        return Err(common::skip_too_few_cuda(2, format!("needs two CUDA devices, has {}", devs.len())));
    }
    let (a, b) = (devs[0], devs[1]);
    let run = || -> Result<()> {
        let host = Tensor::from_vec((0..300_000).map(|i| i as f32 * 0.5).collect::<Vec<_>>(), (600, 500), &cpu())?;
        let x = host.to(&a)?;
        // The kernels of the held part, loaded first (loading waits for an
        // idle device).
        x.add_scalar(1.0)?.t()?.copy_to(&b)?;
        kiln::synchronize(&a)?;
        kiln::synchronize(&b)?;
        let hold = kiln::hold_queue(&a)?.expect("a CUDA device has a queue to hold");
        // Queued behind the hold: each copy must come after it, and return
        // without waiting for it.
        let y = x.add_scalar(1.0)?;
        let copies = within(20, "CUDA-to-CUDA copies while the source's queue is held", move || -> Result<_> {
            let before = kiln::thread_transfer_stats();
            let whole = y.copy_to(&b)?;
            let transposed = y.t()?.copy_to(&b)?; // not contiguous: gathered on the source first
            Ok((whole, transposed, kiln::thread_transfer_stats().since(&before)))
        });
        drop(hold);
        let (whole, transposed, stats) = copies.expect("a CUDA-to-CUDA copy waited for the source's held queue")?;
        let d2d = stats.direction(kiln::Direction::DeviceToDevice);
        assert_eq!((d2d.count, d2d.bytes), (2, 2 * 1_200_000), "two device-to-device copies booked once each");
        assert_eq!(stats.direction(kiln::Direction::HostToDevice).count, 0, "no host-to-device leg");
        assert_eq!(stats.direction(kiln::Direction::DeviceToHost).count, 0, "no device-to-host leg");
        assert_eq!((whole.device(), transposed.device()), (b, b));
        let expected = host.add_scalar(1.0)?;
        same(&whole, &expected, "copied to the other device")?;
        same(&transposed, &expected.t()?, "transposed, copied to the other device")?;
        // Work on the destination after the copy sees its values.
        same(&whole.mul_scalar(2.0)?, &expected.mul_scalar(2.0)?, "used on the other device")?;
        Ok(())
    };
    if let Err(e) = run() {
        panic!("CUDA-to-CUDA copy {a} -> {b}: {e}");
    }
    common::report_ran(a);
    common::report_ran(b);
    Ok(())
}
