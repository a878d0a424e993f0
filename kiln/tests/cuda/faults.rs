//! Fixed defects, checked with the CUDA simulator's fault injection.

use super::*;

// ---- fixed defects, checked with the CUDA simulator's fault injection -------

/// The CUDA simulator's answer to `what` (`kiln_cudasim_stat` in the loaded
/// `libcuda.so`; see cudasim/src/lib.rs), or None when the driver is not the
/// simulator.
pub(crate) fn sim_stat(what: &str) -> Option<i64> {
    type Stat = unsafe extern "C" fn(*const std::ffi::c_char) -> i64;
    let what = std::ffi::CString::new(what).ok()?;
    // SAFETY: RTLD_NOLOAD only finds a library that is loaded already (the
    // driver kiln opened); the simulator's `kiln_cudasim_stat` has this
    // signature, and the library stays loaded (kiln holds it) after dlclose.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if lib.is_null() {
            return None;
        }
        let f = libc::dlsym(lib, c"kiln_cudasim_stat".as_ptr());
        libc::dlclose(lib);
        if f.is_null() {
            return None;
        }
        let f: Stat = std::mem::transmute::<*mut std::ffi::c_void, Stat>(f);
        Some(f(what.as_ptr()))
    }
}

#[track_caller]
pub(crate) fn stat(what: &str) -> i64 {
    sim_stat(what).unwrap_or_else(|| panic!("the CUDA simulator does not answer `{what}`"))
}

/// The CUDA devices when they are the simulator's, else why the test cannot
/// run (no CUDA device, or real ones, on which faults cannot be injected).
pub(crate) fn simulated_cuda() -> std::result::Result<Vec<Device>, Skip> {
    let devs = cuda_devices();
    if devs.is_empty() {
        return Err(no_cuda_device());
    }
    if sim_stat("events").is_none() {
        return Err(common::skip("needs the CUDA simulator (scripts/cudasim.sh): its fault injection and launch records"));
    }
    Ok(devs)
}

/// Runs `child` on gpu(0) in a child process of this test binary whose CUDA
/// simulator is set up by `env` (its settings are read once per process).
pub(crate) fn in_simulator_child(env: &[(&str, &str)], child: impl Fn(Device) -> Result<()>) -> Ran {
    if common::is_child() {
        let d = cuda_devices()[0];
        if let Err(e) = child(d) {
            panic!("on {d}: {e}");
        }
        println!("CHILD-OK");
        return Ok(());
    }
    let devs = simulated_cuda()?;
    common::run_child(env);
    common::report_ran(devs[0]);
    Ok(())
}

pub(crate) fn cublas_status(d: Device) -> String {
    let info = kiln::devices().into_iter().find(|i| i.device == d).expect("listed");
    info.details.into_iter().find(|(k, _)| k == "cublas").map(|(_, v)| v).unwrap_or_default()
}

pub(crate) const MIB: usize = 1 << 20;

/// When cuMemAlloc fails, kiln gives its cached blocks back to the driver and
/// tries again; only if that fails too is it `OutOfMemory`. The device has
/// 64 MiB of which 16 MiB are held by "another process"
/// (`KILN_CUDASIM_RESERVED`), so kiln's books have room where the driver has
/// none.
pub(crate) fn cuda_a_driver_out_of_memory_empties_the_cache_and_retries_before_failing() -> Ran {
    in_simulator_child(&[("KILN_CUDASIM_MEMORY", "64MiB"), ("KILN_CUDASIM_RESERVED", "16MiB")], |d| {
        let x = Tensor::zeros(30 * MIB / 4, DType::F32, &d)?;
        kiln::synchronize(&d)?;
        drop(x);
        assert_eq!(kiln::memory_stats(&d)?.cached, 30 * MIB, "the dropped block is cached");
        // 32 MiB: nothing is in use, but the driver has 48 - 30 MiB left
        // while the cache holds its block.
        let y = Tensor::full(2.0, 32 * MIB / 4, DType::F32, &d)?;
        let stats = kiln::memory_stats(&d)?;
        assert_eq!((stats.in_use, stats.cached), (32 * MIB, 0), "the cache was given back for the retry");
        assert_eq!(y.sum_all()?.to_scalar::<f32>()?, (16 * MIB) as f32);
        // 20 MiB: kiln's books have room (32 of 64 MiB in use), the driver
        // has not (16 reserved + 32), with or without the cache.
        match Tensor::zeros(20 * MIB / 4, DType::F32, &d) {
            Err(Error::OutOfMemory { device, requested, in_use, capacity, limit: None }) => {
                assert_eq!((device, requested, in_use, capacity), (d, 20 * MIB, 32 * MIB, 64 * MIB))
            }
            other => panic!("expected OutOfMemory from the driver, got {other:?}"),
        }
        assert_eq!(kiln::memory_stats(&d)?.in_use, 32 * MIB, "the refused allocation booked nothing");
        // Recoverable: with y gone (its block cached), 20 MiB fits again.
        drop(y);
        let z = Tensor::ones(20 * MIB / 4, DType::F32, &d)?;
        assert_eq!(z.sum_all()?.to_scalar::<f32>()?, (5 * MIB) as f32);
        Ok(())
    })
}

/// Staging needs two pinned chunks; when only one can be had (8 MiB of
/// pinned memory allowed), or its event cannot be made, what was allocated
/// is given back and transfers go without staging.
pub(crate) fn cuda_a_lone_pinned_staging_chunk_and_its_event_are_not_leaked() -> Ran {
    let check = |d: Device| -> Result<()> {
        let events = stat("events");
        // Before the first transfer only each CUDA device's fault record
        // (40 bytes, made with the device) is pinned.
        let pinned = (stat("pinned_bytes"), stat("pinned_blocks"));
        let devices = kiln::devices().iter().filter(|i| i.kind == kiln::DeviceKind::Cuda).count() as i64;
        assert_eq!(pinned, (40 * devices, devices), "pinned memory before the first transfer");
        for i in 0..3 {
            let host: Vec<f32> = (0..100_000).map(|j| (i * 100_000 + j) as f32).collect();
            let x = Tensor::from_vec(host.clone(), host.len(), &d)?;
            assert_eq!(x.to_vec::<f32>()?, host, "transfer {i} without staging");
        }
        kiln::synchronize(&d)?;
        assert_eq!((stat("pinned_bytes"), stat("pinned_blocks")), pinned, "a pinned staging chunk was leaked");
        assert_eq!(stat("events"), events, "a staging chunk's event was leaked");
        Ok(())
    };
    // One 8 MiB staging chunk fits beside the fault records, a second does not.
    in_simulator_child(&[("KILN_CUDASIM_PINNED", "8193KiB")], check)?;
    in_simulator_child(&[("KILN_CUDASIM_FAIL", "cuEventCreate:1")], check)
}

/// A failed cublasCreate (say, out of memory) is not remembered: the next
/// matmul creates cuBLAS and uses it.
pub(crate) fn cuda_matmul_uses_cublas_again_after_a_failed_cublas_create() -> Ran {
    in_simulator_child(&[("KILN_CUDASIM_FAIL", "cublasCreate_v2:1")], |d| {
        let a = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &d)?;
        let b = Tensor::new(&[[1f32, 0.], [0., 1.], [1., 1.]], &d)?;
        let expected = vec![4f32, 5., 10., 11.];
        assert_eq!(cublas_status(d), "not loaded yet");
        let (gemms, own) = (stat("gemms"), stat("launches:matmul_f32"));
        assert_eq!(a.matmul(&b)?.to_vec::<f32>()?, expected, "with kiln's own kernel");
        let status = cublas_status(d);
        assert!(status.starts_with("no: cublasCreate failed"), "{status}");
        assert_eq!((stat("gemms"), stat("launches:matmul_f32")), (gemms, own + 1), "the first matmul ran kiln's kernel");
        assert_eq!(a.matmul(&b)?.to_vec::<f32>()?, expected, "with cuBLAS");
        assert_eq!(cublas_status(d), "yes");
        assert_eq!((stat("gemms"), stat("launches:matmul_f32")), (gemms + 1, own + 1), "the second matmul ran a cuBLAS gemm");
        Ok(())
    })
}

/// Without cuDNN (KILN_DISABLE_CUDNN=1), convolutions go through im2col +
/// cuBLAS when cuBLAS loads and through kiln's direct kernels when it does not, with the same values as the CPU
/// either way, and `kiln devices` names the path; KILN_CUDA_CONV=gemm where
/// cuBLAS cannot be had is an error that says what to do, and the
/// workspace is back in the cache afterwards (nothing in use is left).
pub(crate) fn cuda_convolutions_fall_back_to_direct_kernels_without_cublas_and_say_why() -> Ran {
    in_simulator_child(&[("KILN_CUDASIM_FAIL", "cublasCreate_v2:2"), ("KILN_DISABLE_CUDNN", "1")], |d| {
        let conv_status = || {
            let info = kiln::devices().into_iter().find(|i| i.device == d).expect("listed");
            info.details.into_iter().find(|(k, _)| k == "convolution").map(|(_, v)| v).unwrap_or_default()
        };
        let x = Tensor::arange(0.0, 2.0 * 3.0 * 7.0 * 6.0, 1.0, &kiln::cpu())?.reshape((2, 3, 7, 6))?.mul_scalar(0.01)?;
        let w = Tensor::arange(0.0, 4.0 * 3.0 * 3.0 * 2.0, 1.0, &kiln::cpu())?.reshape((4, 3, 3, 2))?.sub_scalar(30.0)?.mul_scalar(0.02)?;
        let args = kiln::Conv2dArgs::default().stride((2, 1)).padding(1);
        let want = x.conv2d(&w, None, args)?.to_vec::<f32>()?;
        let (xd, wd) = (x.to(&d)?, w.to(&d)?);
        assert!(conv_status().starts_with("im2col + cuBLAS once cuBLAS loads"), "{}", conv_status());
        // KILN_CUDA_CONV=gemm with cuBLAS failing to load: an error, nothing run.
        // SAFETY: this child process runs this one test on this thread;
        // nothing else in it reads or writes the environment meanwhile (the
        // CPU pool and the simulator read their settings when they start,
        // which happened above).
        unsafe { std::env::set_var("KILN_CUDA_CONV", "gemm") };
        match xd.conv2d(&wd, None, args).and_then(|y| y.to_vec::<f32>()) {
            Err(e) => assert!(e.to_string().contains("KILN_CUDA_CONV=direct"), "{e}"),
            Ok(_) => panic!("KILN_CUDA_CONV=gemm ran without cuBLAS"),
        }
        // SAFETY: as for set_var above.
        unsafe { std::env::remove_var("KILN_CUDA_CONV") };
        let (gemms, direct) = (stat("gemms"), stat("launches:conv2d_fwd_f32"));
        let close = |got: &[f32]| got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0));
        let y = xd.conv2d(&wd, None, args)?.to_vec::<f32>()?;
        assert!(close(&y), "direct kernels: {y:?} against the CPU's {want:?}");
        assert_eq!((stat("gemms"), stat("launches:conv2d_fwd_f32")), (gemms, direct + 1), "the direct kernel ran");
        assert!(conv_status().starts_with("direct kernels (cuBLAS no: cublasCreate failed"), "{}", conv_status());
        // cuBLAS loads at the next convolution: im2col + gemm, the same values.
        let y = xd.conv2d(&wd, None, args)?.to_vec::<f32>()?;
        assert!(close(&y), "im2col + cuBLAS: {y:?} against the CPU's {want:?}");
        assert_eq!((stat("gemms"), stat("launches:conv2d_fwd_f32")), (gemms + 1, direct + 1), "one cuBLAS gemm, no direct kernel");
        assert_eq!(conv_status(), "im2col + cuBLAS (cuDNN: cuDNN disabled by KILN_DISABLE_CUDNN=1)");
        kiln::synchronize(&d)?;
        assert_eq!(
            kiln::memory_stats(&d)?.in_use,
            xd.storage_bytes() + wd.storage_bytes(),
            "the workspace is not held after the convolution"
        );
        Ok(())
    })
}

/// Without cuDNN, on a device of 8 MiB, a convolution whose im2col workspace does not fit
/// for the whole batch takes one image at a time, and one whose single
/// image does not fit runs the direct kernels: the CPU's values either way,
/// and nothing held afterwards.
pub(crate) fn cuda_a_convolution_without_room_for_its_workspace_takes_smaller_chunks_or_the_direct_kernels() -> Ran {
    in_simulator_child(&[("KILN_CUDASIM_MEMORY", "8MiB"), ("KILN_DISABLE_CUDNN", "1")], |d| {
        let x = Tensor::arange(0.0, (2 * 16 * 64 * 64) as f64, 1.0, &kiln::cpu())?.reshape((2, 16, 64, 64))?.mul_scalar(1e-5)?;
        for (k, gemms_expected, direct_expected) in [(4usize, 2i64, 0i64), (7, 0, 1)] {
            let w = Tensor::ones((16, 16, k, k), DType::F32, &kiln::cpu())?.mul_scalar(0.01)?;
            let args = kiln::Conv2dArgs::default().padding(k / 2);
            let want = x.conv2d(&w, None, args)?.to_vec::<f32>()?;
            let (xd, wd) = (x.to(&d)?, w.to(&d)?);
            let (gemms, direct) = (stat("gemms"), stat("launches:conv2d_fwd_f32"));
            let got = xd.conv2d(&wd, None, args)?.to_vec::<f32>()?;
            assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0)), "{k}×{k}: the CPU's values");
            assert_eq!(
                (stat("gemms") - gemms, stat("launches:conv2d_fwd_f32") - direct),
                (gemms_expected, direct_expected),
                "{k}×{k}: cuBLAS calls and direct launches"
            );
            kiln::synchronize(&d)?;
            assert_eq!(kiln::memory_stats(&d)?.in_use, xd.storage_bytes() + wd.storage_bytes(), "{k}×{k}: nothing held afterwards");
        }
        Ok(())
    })
}

/// sum_all, mean_all, norm and a long argmax/argmin spread over the device:
/// a first pass over many blocks, then one over their partial results.
pub(crate) fn cuda_full_reductions_launch_many_blocks() -> Ran {
    simulated_cuda()?;
    on_cuda_alone("reduction grids", |d| {
        let n = 1_000_000usize;
        let x = Tensor::ones(n, DType::F32, &d)?;
        let peak = Tensor::arange(0.0, n as f64, 1.0, &d)?.sub_scalar(700_000.0)?.abs()?.neg()?;
        type Reduction<'a> = Box<dyn Fn() -> Result<f64> + 'a>;
        let cases: Vec<(&str, &str, Reduction)> = vec![
            ("sum_all", "reduce_sum_f32_partial", Box::new(|| Ok(x.sum_all()?.to_scalar::<f32>()? as f64))),
            ("mean_all", "reduce_sum_f32_partial", Box::new(|| Ok(x.mean_all()?.to_scalar::<f32>()? as f64))),
            ("norm", "reduce_norm_f32_partial", Box::new(|| Ok(x.norm()?.to_scalar::<f32>()? as f64))),
            ("argmax", "arg_partial_f32", Box::new(|| Ok(peak.argmax(0)?.to_scalar::<i64>()? as f64))),
            ("argmin", "arg_partial_f32", Box::new(|| Ok(peak.neg()?.argmin(0)?.to_scalar::<i64>()? as f64))),
        ];
        let expected = [n as f64, 1.0, 1000.0, 700_000.0, 700_000.0];
        for ((what, kernel, run), want) in cases.iter().zip(expected) {
            let before = stat(&format!("launches:{kernel}"));
            assert_eq!(run()?, want, "{what} of {n} elements");
            assert_eq!(stat(&format!("launches:{kernel}")), before + 1, "{what}: one launch of {kernel}");
            let grid = stat(&format!("grid:{kernel}"));
            assert!(grid > 1, "{what} of {n} elements ran {kernel} on {grid} block(s)");
            println!("{what} of {n} elements on {d}: {kernel} over {grid} blocks");
        }
        Ok(())
    })
}

/// A cuMemFree that fails while emptying the cache is an error naming the
/// device and the bytes, not dropped on the floor.
pub(crate) fn cuda_empty_cache_reports_a_failed_cumemfree() -> Ran {
    in_simulator_child(&[("KILN_CUDASIM_FAIL", "cuMemFree_v2:1")], |d| {
        drop(Tensor::zeros(MIB, DType::F32, &d)?);
        kiln::synchronize(&d)?;
        assert_eq!(kiln::memory_stats(&d)?.cached, 4 * MIB);
        match kiln::empty_cache(&d) {
            Err(Error::Backend { device, msg }) => {
                assert_eq!(device, d);
                assert!(msg.contains("1 of 1 blocks (4.0 MiB) could not be freed") && msg.contains("cuMemFree"), "{msg}");
            }
            other => panic!("expected the failed cuMemFree as an error, got {other:?}"),
        }
        assert_eq!(kiln::memory_stats(&d)?.cached, 0, "the block left the cache");
        kiln::empty_cache(&d)?;
        assert_eq!(Tensor::ones(3, DType::F32, &d)?.sum_all()?.to_scalar::<f32>()?, 3.0, "the device still works");
        Ok(())
    })
}

/// A kernel that writes past the end of its allocation (on the simulator:
/// the fill kernel of a buffer the driver made 4 bytes short,
/// `KILN_CUDASIM_SHORT_ALLOC`) is a kiln error at the next synchronising
/// call that names the kernel and the allocation (the simulator's guard,
/// cudasim/src/memory.rs); the device stays faulted, as a GPU's context
/// does, while the process and the other device go on.
pub(crate) fn cuda_a_kernel_writing_past_its_allocation_is_an_error_naming_it() -> Ran {
    in_simulator_child(&[("KILN_CUDASIM_SHORT_ALLOC", "3584")], |d| {
        let x = Tensor::ones(3584 / 4, DType::F32, &d)?;
        // Synchronise before reading: a read enqueued while the fill still
        // runs is refused at enqueue time for its range (the driver gave 3580
        // bytes), which on a slow machine comes before the kernel's fault.
        let msg = match kiln::synchronize(&d) {
            Err(e) => e.to_string(),
            Ok(()) => panic!("the write past the end went unnoticed at synchronize"),
        };
        println!("reported: {msg}");
        for part in ["CUDA_ERROR_ILLEGAL_ADDRESS", "kernel fill_constant_f32 wrote outside its memory", "of 3580 bytes", "after its end"] {
            assert!(msg.contains(part), "`{part}` is not in: {msg}");
        }
        match x.to_vec::<f32>() {
            Err(e) => assert!(e.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "reading the faulted result: {e}"),
            Ok(v) => panic!("a result the faulted device never computed was read ({} values)", v.len()),
        }
        assert!(kiln::synchronize(&d).is_err(), "the device stays faulted");
        if let Some(&other) = cuda_devices().iter().find(|&&o| o != d) {
            let y = Tensor::ones(3, DType::F32, &other)?;
            assert_eq!(y.sum_all()?.to_scalar::<f32>()?, 3.0, "{other} still works");
        }
        Ok(())
    })
}

/// 97 f32 parameters on `d` (3 to 99 elements), with gradients.
fn optimizer_parameters(d: Device) -> Result<Vec<Tensor>> {
    let ps: Vec<Tensor> =
        (0..97).map(|i| Tensor::full(1.0 + i as f64, 3 + i, DType::F32, &d).map(|t| t.requires_grad_())).collect::<Result<_>>()?;
    for p in &ps {
        p.sqr()?.sum_all()?.backward()?;
    }
    Ok(ps)
}

/// SGD and Adam update 97 f32 parameters in three launches (48 a launch) of
/// their multi-tensor kernels.
pub(crate) fn cuda_optimizer_steps_are_one_launch_per_48_parameters() -> Ran {
    use kiln::optim::{Adam, Optimizer, Sgd};
    let params = optimizer_parameters;
    in_simulator_child(&[], |d| {
        for (kernel, adam) in [("sgd_foreach_f32", false), ("adam_foreach_f32", true)] {
            let ps = params(d)?;
            let mut opt: Box<dyn Optimizer> =
                if adam { Box::new(Adam::new(ps.clone(), 0.1)) } else { Box::new(Sgd::new(ps.clone(), 0.1).momentum(0.9)) };
            let before = stat(&format!("launches:{kernel}"));
            opt.step()?;
            kiln::synchronize(&d)?;
            assert_eq!(stat(&format!("launches:{kernel}")) - before, 3, "{kernel}: launches for 97 parameters");
        }
        Ok(())
    })
}

/// A refused launch of a multi-tensor step fails the step with an error
/// naming the kernel and poisons every parameter of the call (those of an
/// earlier launch were written, but their new state is dropped with the
/// failed step), while the state stays as it was.
pub(crate) fn cuda_a_refused_optimizer_launch_fails_the_step_and_poisons_its_parameters() -> Ran {
    use kiln::optim::{Optimizer, Sgd};
    let params = optimizer_parameters;
    // The second launch (parameters 48..96) is refused.
    in_simulator_child(&[("KILN_CUDASIM_FAIL", "cuLaunchKernel.sgd_foreach_f32:1@1")], |d| {
        let ps = params(d)?;
        let mut opt = Sgd::new(ps.clone(), 0.1).momentum(0.9);
        let err = opt.step().expect_err("a step whose launch was refused");
        assert!(matches!(&err, Error::Backend { device, msg } if device == &d && msg.contains("sgd_foreach_f32")), "{err}");
        // The first launch ran, but its parameters' new momentum is not
        // kept: every parameter of the call is poisoned, none silently
        // half-stepped.
        for (i, p) in ps.iter().enumerate() {
            let got = p.to_vec::<f32>();
            assert!(matches!(&got, Err(e) if e.to_string().contains("sgd_foreach_f32")), "parameter {i}: {got:?}");
        }
        assert!(opt.velocity(0).is_none(), "a failed step keeps the old (absent) momentum");
        Ok(())
    })
}

/// A step whose f64 group's launch is refused after its f32 group ran
/// fails, and poisons the f32 parameters it had already stepped too: their
/// new momentum is dropped with the step, so they must not read as stepped.
pub(crate) fn cuda_a_step_failing_in_a_later_group_poisons_the_groups_it_stepped() -> Ran {
    use kiln::optim::{Optimizer, Sgd};
    in_simulator_child(&[("KILN_CUDASIM_FAIL", "cuLaunchKernel.sgd_foreach_f64:1")], |d| {
        let mut ps = optimizer_parameters(d)?;
        let wide = Tensor::full(2.0, 5, DType::F64, &d)?.requires_grad_();
        wide.sqr()?.sum_all()?.backward()?;
        ps.push(wide);
        let mut opt = Sgd::new(ps.clone(), 0.1).momentum(0.9);
        let err = opt.step().expect_err("a step whose f64 launch was refused");
        assert!(err.to_string().contains("sgd_foreach_f64"), "{err}");
        for (i, p) in ps.iter().enumerate() {
            let got = p.to_vec_f64();
            assert!(matches!(&got, Err(e) if e.to_string().contains("sgd_foreach_f64")), "parameter {i}: {got:?}");
        }
        assert!(opt.velocity(0).is_none() && opt.velocity(97).is_none(), "a failed step keeps the old (absent) momentum");
        Ok(())
    })
}
