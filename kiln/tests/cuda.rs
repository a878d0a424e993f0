//! The CUDA backend, checked as far as the machine allows:
//! - without a driver library: GPUs are only the simulated ones, `try_gpu`
//!   falls back and says why, nothing panics;
//! - with NVRTC (and ptxas): every kernel family compiles for sm_90, exactly
//!   the sources the backend runs (`KILN_REQUIRE_NVRTC=1` makes a missing
//!   NVRTC or ptxas a failure instead of a skip);
//! - with a CUDA device: real operations agree with the CPU, memory is
//!   booked and returned, out-of-memory is an error, transfers are ledgered.
//!
//! This binary never creates simulated GPUs, so that the GPU count seen here
//! is the machine's (plus any `KILN_SIM_GPUS`).

#[macro_use]
mod common;

use common::{Ran, Skip};
use kiln::{cpu, DType, Device, DeviceKind, Error, FallbackReason, Result, Tensor};
use std::sync::RwLock;

fn main() -> std::process::ExitCode {
    common::run_suite(trials![
        gpu_count_is_cuda_devices_then_simulated_ones,
        without_a_driver_try_gpu_falls_back_and_says_why,
        with_a_driver_but_no_device_try_gpu_says_so,
        nvrtc_compiles_every_kernel_family_for_sm90,
        cuda_device_reports_itself,
        cuda_creation_and_random_match_the_cpu,
        cuda_elementwise_ops_match_the_cpu,
        cuda_reductions_match_the_cpu,
        cuda_matmul_matches_the_cpu,
        cuda_copies_casts_and_indexing_match_the_cpu,
        cuda_memory_is_booked_returned_and_bounded,
        cuda_transfers_are_ledgered_and_round_trip,
        cuda_negative_indices_select_nothing_like_the_other_devices,
        cuda_integer_argmax_is_exact_above_2_pow_53,
        cuda_full_reductions_over_many_blocks_match_the_cpu,
        cuda_cached_bytes_are_reported_and_empty_cache_returns_them_from_any_thread,
        cuda_empty_cache_waits_for_queued_kernels_that_used_cached_blocks,
        cuda_empty_cache_does_not_free_blocks_reused_while_it_waits,
        cuda_uploads_do_not_wait_for_earlier_work,
        cuda_staging_buffers_are_not_reused_before_their_copy_ran,
        cuda_an_upload_past_the_last_staging_chunk_waits_for_the_oldest_copy,
        no_cuda_device_is_listed_without_nvrtc,
        a_kiln_nvrtc_lib_that_cannot_be_loaded_leaves_no_cuda_device_and_is_named,
        cuda_to_cuda_copies_are_peer_copies_that_do_not_block_the_host,
        cuda_a_driver_out_of_memory_empties_the_cache_and_retries_before_failing,
        cuda_a_lone_pinned_staging_chunk_and_its_event_are_not_leaked,
        cuda_matmul_uses_cublas_again_after_a_failed_cublas_create,
        cuda_full_reductions_launch_many_blocks,
        cuda_empty_cache_reports_a_failed_cumemfree,
    ])
}

fn cuda_devices() -> Vec<Device> {
    kiln::devices().into_iter().filter(|d| d.kind == DeviceKind::Cuda).map(|d| d.device).collect()
}

// ---- without a GPU ---------------------------------------------------------

fn gpu_count_is_cuda_devices_then_simulated_ones() {
    let list = kiln::devices();
    let cuda = list.iter().filter(|d| d.kind == DeviceKind::Cuda).count();
    let sims = list.iter().filter(|d| d.kind == DeviceKind::Simulated).count();
    assert_eq!(kiln::num_gpus(), cuda + sims);
    // Real GPUs are numbered first.
    for (i, info) in list.iter().skip(1).enumerate() {
        assert_eq!(info.device, kiln::gpu(i));
        if i < cuda {
            assert_eq!(info.kind, DeviceKind::Cuda, "gpu({i}) should be a CUDA device");
        }
    }
}

fn without_a_driver_try_gpu_falls_back_and_says_why() -> Ran {
    if kiln::cuda_check::driver_present() {
        return Err(common::skip("a CUDA driver library is present on this machine"));
    }
    assert!(cuda_devices().is_empty());
    let sims = kiln::devices().iter().filter(|d| d.kind == DeviceKind::Simulated).count();
    assert_eq!(kiln::num_gpus(), sims, "without libcuda only simulated GPUs count");
    if sims == 0 {
        assert_eq!(kiln::try_gpu(0), cpu());
        assert_eq!(kiln::try_all_gpus(), vec![cpu()]);
        let why = kiln::why_not_gpu(0).expect("a reason to fall back");
        assert_eq!(why, FallbackReason::DriverNotFound);
        assert!(why.to_string().contains("no CUDA driver library found"), "{why}");
        assert!(matches!(Tensor::ones(2, DType::F32, &kiln::gpu(0)), Err(Error::NoSuchDevice { .. })));
    }
    // Work still runs, on the CPU.
    let x = Tensor::ones((2, 2), DType::F32, &kiln::try_gpu(sims)).and_then(|t| t.sum_all()).and_then(|s| s.to_scalar::<f32>());
    assert_eq!(x.ok(), Some(4.0));
    Ok(())
}

fn with_a_driver_but_no_device_try_gpu_says_so() -> Ran {
    if !kiln::cuda_check::driver_present() || !cuda_devices().is_empty() {
        return Err(common::skip("needs a CUDA driver library and no CUDA device (e.g. LD_LIBRARY_PATH to an unpacked libcuda1)"));
    }
    let sims = kiln::devices().iter().filter(|d| d.kind == DeviceKind::Simulated).count();
    assert_eq!(kiln::num_gpus(), sims);
    if sims == 0 {
        let why = kiln::why_not_gpu(0).expect("a reason to fall back");
        assert!(matches!(why, FallbackReason::NoDevice(_)), "{why:?}");
        assert!(why.to_string().contains("no usable device"), "{why}");
        println!("driver present, no device: {why}");
        assert_eq!(kiln::try_gpu(0), cpu());
    }
    Ok(())
}

fn nvrtc_compiles_every_kernel_family_for_sm90() -> Ran {
    let require = common::required("KILN_REQUIRE_NVRTC");
    let version = match kiln::cuda_check::nvrtc_version() {
        Ok(v) => v,
        Err(why) => {
            assert!(!require, "KILN_REQUIRE_NVRTC=1 but NVRTC cannot be loaded: {why}");
            return Err(common::skip(why));
        }
    };
    let archs: Vec<String> = std::env::var("KILN_CUDA_ARCHS")
        .unwrap_or_else(|_| "90".into())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let ptxas = std::env::var("KILN_PTXAS").ok().or_else(|| {
        let found = std::process::Command::new("ptxas").arg("--version").output().map(|o| o.status.success()).unwrap_or(false);
        found.then(|| "ptxas".to_string())
    });
    if ptxas.is_none() {
        assert!(!require, "KILN_REQUIRE_NVRTC=1 but no ptxas: set KILN_PTXAS to its path");
        println!("ptxas not found (set KILN_PTXAS): checking NVRTC compilation only");
    }
    let dir = std::env::temp_dir().join(format!("kiln-nvrtc-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sources = kiln::cuda_check::kernel_sources();
    assert!(sources.len() >= 6, "expected every kernel family, got {}", sources.len());
    let mut entries = 0;
    for arch in &archs {
        for (family, source) in &sources {
            let ptx = kiln::cuda_check::compile_ptx(family, source, &format!("compute_{arch}"))
                .unwrap_or_else(|log| panic!("NVRTC {}.{} failed on family `{family}` for compute_{arch}:\n{log}", version.0, version.1));
            entries += ptx.matches(".entry").count();
            if let Some(ptxas) = &ptxas {
                let ptx_path = dir.join(format!("{family}-{arch}.ptx"));
                std::fs::write(&ptx_path, &ptx).expect("write ptx");
                let out = std::process::Command::new(ptxas)
                    .arg(format!("-arch=sm_{arch}"))
                    .arg(&ptx_path)
                    .arg("-o")
                    .arg(dir.join(format!("{family}-{arch}.cubin")))
                    .output()
                    .unwrap_or_else(|e| panic!("cannot run {ptxas}: {e}"));
                assert!(
                    out.status.success(),
                    "ptxas failed on family `{family}` for sm_{arch}:\n{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Every kernel a module declares is an entry point of its PTX.
    let declared: usize = sources.iter().map(|(_, src)| src.matches("extern \"C\" __global__").count()).sum();
    assert!(declared > 350, "expected every op's kernels, found {declared}");
    assert_eq!(entries, archs.len() * declared, "kernel entry points per arch");
    println!(
        "NVRTC {}.{} compiled {} kernel families ({entries} kernels) for {archs:?}{}",
        version.0,
        version.1,
        sources.len(),
        if ptxas.is_some() { ", assembled by ptxas" } else { "" }
    );
    Ok(())
}

// ---- on a CUDA device --------------------------------------------------------

/// Tests that measure a device's memory exactly run alone (write lock);
/// the others share the devices (read lock).
static DEVICES: RwLock<()> = RwLock::new(());

/// Runs `f` on every CUDA device, or reports the test skipped (a failure
/// with KILN_REQUIRE_CUDA=1).
fn on_cuda(test: &str, f: impl Fn(Device) -> Result<()>) -> Ran {
    let _shared = DEVICES.read().unwrap_or_else(|e| e.into_inner());
    run_on_cuda(test, f)
}

/// Like `on_cuda`, with no other test of this binary using the devices.
fn on_cuda_alone(test: &str, f: impl Fn(Device) -> Result<()>) -> Ran {
    let _alone = DEVICES.write().unwrap_or_else(|e| e.into_inner());
    run_on_cuda(test, f)
}

fn no_cuda_device() -> Skip {
    common::skip_no_cuda(format!(
        "no CUDA device: {}; `scripts/cudasim.sh cargo test -p kiln --test cuda` runs these on the CUDA simulator",
        common::why_no_cuda()
    ))
}

fn run_on_cuda(test: &str, f: impl Fn(Device) -> Result<()>) -> Ran {
    let devs = cuda_devices();
    if devs.is_empty() {
        return Err(no_cuda_device());
    }
    for d in devs {
        if let Err(e) = f(d) {
            panic!("{test} on {d}: {e}");
        }
        common::report_ran(d);
    }
    Ok(())
}

fn same(gpu: &Tensor, host: &Tensor, what: &str) -> Result<()> {
    assert_eq!(gpu.dims(), host.dims(), "{what}: shapes");
    assert_eq!(gpu.dtype(), host.dtype(), "{what}: dtypes");
    let (g, h) = (gpu.to_vec_f64()?, host.to_vec_f64()?);
    for (i, (a, b)) in g.iter().zip(&h).enumerate() {
        assert!(a == b || (a.is_nan() && b.is_nan()), "{what}: element {i} is {a} on the GPU, {b} on the CPU");
    }
    Ok(())
}

fn close(gpu: &Tensor, host: &Tensor, tol: f64, what: &str) -> Result<()> {
    assert_eq!(gpu.dims(), host.dims(), "{what}: shapes");
    let (g, h) = (gpu.to_vec_f64()?, host.to_vec_f64()?);
    for (i, (a, b)) in g.iter().zip(&h).enumerate() {
        let ok = (a - b).abs() <= tol * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
        assert!(ok, "{what}: element {i} is {a} on the GPU, {b} on the CPU (tolerance {tol})");
    }
    Ok(())
}

fn sample(shape: &[usize], salt: u64) -> Result<Tensor> {
    kiln::manual_seed(salt);
    Tensor::randn(shape, &cpu())
}

fn cuda_device_reports_itself() -> Ran {
    on_cuda("cuda_device_reports_itself", |d| {
        let info = kiln::devices().into_iter().find(|i| i.device == d).expect("listed");
        assert_eq!(info.kind, DeviceKind::Cuda);
        assert!(info.memory_total.unwrap_or(0) > 0);
        assert!(info.memory_free.unwrap_or(0) > 0);
        assert!(info.details.iter().any(|(k, _)| k == "compute capability"), "{:?}", info.details);
        println!("{d}: {} {:?}", info.name, info.details);
        Ok(())
    })
}

fn cuda_creation_and_random_match_the_cpu() -> Ran {
    on_cuda("creation", |d| {
        for dtype in [DType::F32, DType::F64, DType::I64, DType::U8, DType::F16, DType::BF16] {
            same(&Tensor::full(3.75, (3, 5), dtype, &d)?, &Tensor::full(3.75, (3, 5), dtype, &cpu())?, "full")?;
            same(&Tensor::arange_dtype(-3.0, 40.0, 0.7, dtype, &d)?, &Tensor::arange_dtype(-3.0, 40.0, 0.7, dtype, &cpu())?, "arange")?;
            same(&Tensor::eye(4, dtype, &d)?, &Tensor::eye(4, dtype, &cpu())?, "eye")?;
        }
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            kiln::manual_seed(11);
            let g = Tensor::rand_uniform(-2.0, 3.0, (1000,), dtype, &d)?;
            kiln::manual_seed(11);
            let h = Tensor::rand_uniform(-2.0, 3.0, (1000,), dtype, &cpu())?;
            same(&g, &h, "uniform")?;
            kiln::manual_seed(12);
            let g = Tensor::randn_with(1.0, 2.0, (1000,), dtype, &d)?;
            kiln::manual_seed(12);
            let h = Tensor::randn_with(1.0, 2.0, (1000,), dtype, &cpu())?;
            // log/cos differ between CUDA's and the host's libm by an ulp.
            close(&g, &h, 1e-6, "normal")?;
        }
        Ok(())
    })
}

fn cuda_elementwise_ops_match_the_cpu() -> Ran {
    on_cuda("elementwise", |d| {
        let a = sample(&[4, 6], 1)?;
        let b = sample(&[6], 2)?;
        let (ga, gb) = (a.to(&d)?, b.to(&d)?);
        use kiln::{BinaryOp as B, UnaryOp as U};
        for op in [B::Add, B::Sub, B::Mul, B::Div, B::Maximum, B::Minimum, B::Lt, B::Ge, B::Eq] {
            let bb = b.broadcast_to((4, 6))?;
            same(&ga.binary(&gb.broadcast_to((4, 6))?, op)?, &a.binary(&bb, op)?, &format!("{op:?}"))?;
            // Transposed operands take the strided path.
            same(&ga.t()?.binary(&ga.t()?, op)?, &a.t()?.binary(&a.t()?, op)?, &format!("{op:?} transposed"))?;
        }
        for op in [
            U::Neg,
            U::Abs,
            U::Sqr,
            U::Relu,
            U::Powi(3),
            U::Powi(-2),
            U::AddScalar(0.5),
            U::RSubScalar(2.0),
            U::Affine(1.5, -0.25),
            U::MaxScalar(0.1),
        ] {
            same(&ga.t()?.unary(op)?, &a.t()?.unary(op)?, &format!("{op:?}"))?;
        }
        for op in [U::Exp, U::Tanh, U::Sigmoid, U::Sin, U::Cos, U::Powf(1.5), U::Recip] {
            close(&ga.unary(op)?, &a.unary(op)?, 1e-5, &format!("{op:?}"))?;
        }
        let pos = a.abs()?.add_scalar(0.1)?;
        close(&pos.to(&d)?.unary(U::Log)?, &pos.unary(U::Log)?, 1e-6, "log")?;
        close(&pos.to(&d)?.unary(U::Sqrt)?, &pos.unary(U::Sqrt)?, 1e-6, "sqrt")?;
        // Integers wrap and divide by zero to 0, as on the CPU.
        let i = Tensor::new(&[i64::MAX, -7, 9, 0], &cpu())?;
        let j = Tensor::new(&[1i64, 2, 0, -3], &cpu())?;
        for op in [B::Add, B::Mul, B::Div, B::Sub] {
            same(&i.to(&d)?.binary(&j.to(&d)?, op)?, &i.binary(&j, op)?, &format!("i64 {op:?}"))?;
        }
        let u = Tensor::new(&[250u8, 3, 7], &cpu())?;
        same(&u.to(&d)?.add_scalar(10.0)?, &u.add_scalar(10.0)?, "u8 wraps")?;
        Ok(())
    })
}

fn cuda_reductions_match_the_cpu() -> Ran {
    on_cuda("reductions", |d| {
        let a = sample(&[3, 50, 7], 3)?;
        let g = a.to(&d)?;
        for dims in [&[0usize][..], &[1], &[2], &[0, 2], &[0, 1, 2]] {
            close(&g.sum_dims(dims, true)?, &a.sum_dims(dims, true)?, 1e-5, &format!("sum {dims:?}"))?;
            same(&g.reduce(kiln::ReduceOp::Max, dims, false)?, &a.reduce(kiln::ReduceOp::Max, dims, false)?, "max")?;
            same(&g.reduce(kiln::ReduceOp::Min, dims, false)?, &a.reduce(kiln::ReduceOp::Min, dims, false)?, "min")?;
        }
        for dim in 0..3 {
            same(&g.argmax(dim)?, &a.argmax(dim)?, &format!("argmax {dim}"))?;
            same(&g.argmin(dim)?, &a.argmin(dim)?, &format!("argmin {dim}"))?;
            same(&g.transpose(0, 2)?.argmax(dim)?, &a.transpose(0, 2)?.argmax(dim)?, "argmax transposed")?;
        }
        // Ties pick the first index.
        let t = Tensor::new(&[[1f32, 5., 5.], [2., 2., 0.]], &cpu())?;
        same(&t.to(&d)?.argmax(1)?, &t.argmax(1)?, "ties")?;
        let big = Tensor::ones(3_000_000, DType::F32, &d)?;
        assert_eq!(big.sum_all()?.to_scalar::<f32>()?, 3_000_000.0);
        let i = Tensor::arange_dtype(0.0, 1000.0, 1.0, DType::I64, &d)?;
        assert_eq!(i.sum_all()?.to_scalar::<i64>()?, 499_500);
        Ok(())
    })
}

fn cuda_matmul_matches_the_cpu() -> Ran {
    on_cuda("matmul", |d| {
        let a = sample(&[2, 3, 33, 17], 5)?;
        let b = sample(&[3, 17, 9], 6)?;
        let (ga, gb) = (a.to(&d)?, b.to(&d)?);
        close(&ga.matmul(&gb)?, &a.matmul(&b)?, 1e-4, "batched, broadcast batch")?;
        close(&ga.transpose(2, 3)?.matmul(&ga)?, &a.transpose(2, 3)?.matmul(&a)?, 1e-4, "transposed lhs")?;
        let every_other = ga.narrow(3, 0, 16)?.reshape((2, 3, 33, 16))?;
        let cpu_eo = a.narrow(3, 0, 16)?.reshape((2, 3, 33, 16))?;
        close(&every_other.matmul(&every_other.transpose(2, 3)?)?, &cpu_eo.matmul(&cpu_eo.transpose(2, 3)?)?, 1e-4, "narrowed")?;
        let v = sample(&[17], 7)?;
        close(&ga.matmul(&v.to(&d)?)?, &a.matmul(&v)?, 1e-4, "matrix @ vector")?;
        let a64 = a.to_dtype(DType::F64)?;
        let b64 = b.to_dtype(DType::F64)?;
        close(&a64.to(&d)?.matmul(&b64.to(&d)?)?, &a64.matmul(&b64)?, 1e-10, "f64")?;
        let ai = Tensor::arange_dtype(0.0, 12.0, 1.0, DType::I64, &cpu())?.reshape((3, 4))?;
        same(&ai.to(&d)?.matmul(&ai.t()?.to(&d)?)?, &ai.matmul(&ai.t()?)?, "i64")?;
        let ah = a.to_dtype(DType::F16)?;
        let bh = b.to_dtype(DType::F16)?;
        close(&ah.to(&d)?.matmul(&bh.to(&d)?)?, &ah.matmul(&bh)?, 2e-2, "f16")?;
        let empty = Tensor::zeros((4, 0), DType::F32, &d)?.matmul(&Tensor::zeros((0, 3), DType::F32, &d)?)?;
        assert_eq!(empty.to_vec::<f32>()?, vec![0.0; 12]);
        Ok(())
    })
}

fn cuda_copies_casts_and_indexing_match_the_cpu() -> Ran {
    on_cuda("copies", |d| {
        let a = sample(&[5, 4], 8)?.mul_scalar(100.0)?;
        let all = [DType::F32, DType::F64, DType::I64, DType::U8, DType::F16, DType::BF16];
        for from in all {
            let x = a.to_dtype(from)?;
            let gx = x.to(&d)?;
            for to in all {
                same(&gx.t()?.to_dtype(to)?, &x.t()?.to_dtype(to)?, &format!("{from} -> {to}"))?;
            }
            same(&gx.t()?.contiguous()?, &x.t()?.contiguous()?, "contiguous")?;
            let ids = Tensor::new(&[3i64, 0, 3], &cpu())?;
            same(&gx.index_select(&ids.to(&d)?, 0)?, &x.index_select(&ids, 0)?, "index_select")?;
            let ids8 = Tensor::new(&[1u8, 1], &cpu())?;
            same(&gx.index_select(&ids8.to(&d)?, 1)?, &x.index_select(&ids8, 1)?, "index_select u8 ids")?;
        }
        let src = sample(&[3, 4], 9)?;
        let ids = Tensor::new(&[4i64, 0, 4], &cpu())?;
        let z = Tensor::zeros((5, 4), DType::F32, &cpu())?;
        same(&z.to(&d)?.index_add(&ids.to(&d)?, &src.to(&d)?, 0)?, &z.index_add(&ids, &src, 0)?, "index_add repeats")?;
        let c = Tensor::new(&[1u8, 0, 1, 0], &cpu())?;
        let (t, f) = (sample(&[4], 10)?, Tensor::new(&[-1f32], &cpu())?);
        same(&c.to(&d)?.where_cond(&t.to(&d)?, &f.to(&d)?.broadcast_to(4)?)?, &c.where_cond(&t, &f.broadcast_to(4)?)?, "where")?;
        // In-place assignment through a view.
        let w = Tensor::zeros((3, 3), DType::F32, &d)?;
        w.narrow(1, 1, 2)?.assign(&Tensor::ones((3, 2), DType::F32, &d)?)?;
        assert_eq!(w.to_vec::<f32>()?, vec![0., 1., 1., 0., 1., 1., 0., 1., 1.]);
        Ok(())
    })
}

fn cuda_memory_is_booked_returned_and_bounded() -> Ran {
    // Exact `in_use` figures: no other test may allocate meanwhile.
    on_cuda_alone("memory", |d| {
        kiln::synchronize(&d)?;
        let before = kiln::memory_stats(&d)?;
        {
            let t = Tensor::zeros((1024, 1024), DType::F32, &d)?;
            let during = kiln::memory_stats(&d)?;
            assert!(during.in_use >= before.in_use + (4 << 20));
            drop(t);
        }
        assert_eq!(kiln::memory_stats(&d)?.in_use, before.in_use, "memory back after drop");
        let capacity = before.capacity.expect("a CUDA device has a capacity");
        match Tensor::zeros(capacity / 4 + 1, DType::F64, &d) {
            Err(Error::OutOfMemory { device, .. }) => assert_eq!(device, d),
            Err(e) => panic!("expected OutOfMemory, got {e}"),
            Ok(_) => panic!("allocated more than the device has"),
        }
        // The device still works after the refusal.
        assert_eq!(Tensor::ones(3, DType::F32, &d)?.sum_all()?.to_scalar::<f32>()?, 3.0);
        Ok(())
    })
}

fn cuda_transfers_are_ledgered_and_round_trip() -> Ran {
    on_cuda("transfers", |d| {
        let before = kiln::thread_transfer_stats();
        let host: Vec<f32> = (0..3_000_000).map(|i| i as f32).collect();
        let x = Tensor::from_vec(host.clone(), (3_000_000,), &d)?;
        assert_eq!(x.to_vec::<f32>()?, host, "20 MB through the staging buffers and back");
        let s = kiln::thread_transfer_stats().since(&before);
        assert_eq!(s.direction(kiln::Direction::HostToDevice).count, 1);
        assert_eq!(s.direction(kiln::Direction::DeviceToHost).count, 1);
        assert_eq!(s.direction(kiln::Direction::HostToDevice).bytes, 12_000_000);
        let back = x.copy_to(&cpu())?;
        assert_eq!(back.device(), cpu());
        kiln::synchronize(&d)?;
        Ok(())
    })
}

// ---- defects the CUDA simulator found (issue 11) ---------------------------

/// Runs `f` on another thread and fails if it has not finished within
/// `secs` (instead of hanging the suite).
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
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

fn cuda_negative_indices_select_nothing_like_the_other_devices() -> Ran {
    on_cuda("negative indices", |d| {
        let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &d)?;
        let ids = Tensor::new(&[-1i64, 1, i64::MIN, 2], &d)?;
        // A negative index is out of range: zeros, as on a simulated GPU
        // (the CPU refuses it up front), never row 0.
        assert_eq!(x.index_select(&ids, 0)?.to_vec::<f32>()?, vec![0., 0., 3., 4., 0., 0., 5., 6.]);
        let dst = Tensor::zeros((3, 2), DType::F32, &d)?;
        let src = Tensor::ones((4, 2), DType::F32, &d)?;
        assert_eq!(dst.index_add(&ids, &src, 0)?.to_vec::<f32>()?, vec![0., 0., 1., 1., 1., 1.]);
        Ok(())
    })
}

fn cuda_integer_argmax_is_exact_above_2_pow_53() -> Ran {
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

fn cuda_full_reductions_over_many_blocks_match_the_cpu() -> Ran {
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

fn cuda_cached_bytes_are_reported_and_empty_cache_returns_them_from_any_thread() -> Ran {
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

fn cuda_empty_cache_waits_for_queued_kernels_that_used_cached_blocks() -> Ran {
    on_cuda_alone("free vs queue", |d| {
        let x = Tensor::full(1.5, 1 << 16, DType::F32, &d)?;
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

/// empty_cache takes the cached blocks before it waits for the stream: a
/// block that another thread takes from the cache, queues work on and gives
/// back while empty_cache waits must not be freed under that work.
fn cuda_empty_cache_does_not_free_blocks_reused_while_it_waits() -> Ran {
    on_cuda_alone("free vs reuse", |d| {
        let n = 1 << 16;
        let x = Tensor::full(1.5, n, DType::F32, &d)?;
        let z = Tensor::zeros(n, DType::F32, &d)?;
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
        // empty_cache returns once the work queued before it ran; the two
        // kernels still wait for the second hold.
        let emptied = rx.recv_timeout(std::time::Duration::from_secs(20));
        drop(second);
        emptied.expect("empty_cache did not return once the work queued before it had run")?;
        assert!(w.to_vec::<f32>()?.iter().all(|&v| v == 3.5), "a kernel used a block that empty_cache freed");
        Ok(())
    })
}

fn cuda_uploads_do_not_wait_for_earlier_work() -> Ran {
    on_cuda_alone("uploads overlap compute", |d| {
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

fn cuda_staging_buffers_are_not_reused_before_their_copy_ran() -> Ran {
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
fn cuda_an_upload_past_the_last_staging_chunk_waits_for_the_oldest_copy() -> Ran {
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

fn no_cuda_device_is_listed_without_nvrtc() -> Ran {
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
fn a_kiln_nvrtc_lib_that_cannot_be_loaded_leaves_no_cuda_device_and_is_named() -> Ran {
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

fn cuda_to_cuda_copies_are_peer_copies_that_do_not_block_the_host() -> Ran {
    let _alone = DEVICES.write().unwrap_or_else(|e| e.into_inner());
    let devs = cuda_devices();
    if devs.len() < 2 {
        return Err(common::skip_no_cuda(format!("needs two CUDA devices, has {}", devs.len())));
    }
    let (a, b) = (devs[0], devs[1]);
    let run = || -> Result<()> {
        let host = Tensor::from_vec((0..300_000).map(|i| i as f32 * 0.5).collect::<Vec<_>>(), (600, 500), &cpu())?;
        let x = host.to(&a)?;
        kiln::synchronize(&a)?;
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

// ---- fixed defects, checked with the CUDA simulator's fault injection -------

/// The CUDA simulator's answer to `what` (`kiln_cudasim_stat` in the loaded
/// `libcuda.so`; see cudasim/src/lib.rs), or None when the driver is not the
/// simulator.
fn sim_stat(what: &str) -> Option<i64> {
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
fn stat(what: &str) -> i64 {
    sim_stat(what).unwrap_or_else(|| panic!("the CUDA simulator does not answer `{what}`"))
}

/// The CUDA devices when they are the simulator's, else why the test cannot
/// run (no CUDA device, or real ones, on which faults cannot be injected).
fn simulated_cuda() -> std::result::Result<Vec<Device>, Skip> {
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
fn in_simulator_child(env: &[(&str, &str)], child: impl Fn(Device) -> Result<()>) -> Ran {
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

fn cublas_status(d: Device) -> String {
    let info = kiln::devices().into_iter().find(|i| i.device == d).expect("listed");
    info.details.into_iter().find(|(k, _)| k == "cublas").map(|(_, v)| v).unwrap_or_default()
}

const MIB: usize = 1 << 20;

/// When cuMemAlloc fails, kiln gives its cached blocks back to the driver and
/// tries again; only if that fails too is it `OutOfMemory`. The device has
/// 64 MiB of which 16 MiB are held by "another process"
/// (`KILN_CUDASIM_RESERVED`), so kiln's books have room where the driver has
/// none.
fn cuda_a_driver_out_of_memory_empties_the_cache_and_retries_before_failing() -> Ran {
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
            Err(Error::OutOfMemory { device, requested, in_use, capacity }) => {
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
fn cuda_a_lone_pinned_staging_chunk_and_its_event_are_not_leaked() -> Ran {
    let check = |d: Device| -> Result<()> {
        let events = stat("events");
        assert_eq!(stat("pinned_bytes"), 0, "pinned memory before the first transfer");
        for i in 0..3 {
            let host: Vec<f32> = (0..100_000).map(|j| (i * 100_000 + j) as f32).collect();
            let x = Tensor::from_vec(host.clone(), host.len(), &d)?;
            assert_eq!(x.to_vec::<f32>()?, host, "transfer {i} without staging");
        }
        kiln::synchronize(&d)?;
        assert_eq!((stat("pinned_bytes"), stat("pinned_blocks")), (0, 0), "a pinned staging chunk was leaked");
        assert_eq!(stat("events"), events, "a staging chunk's event was leaked");
        Ok(())
    };
    in_simulator_child(&[("KILN_CUDASIM_PINNED", "8MiB")], check)?;
    in_simulator_child(&[("KILN_CUDASIM_FAIL", "cuEventCreate:1")], check)
}

/// A failed cublasCreate (say, out of memory) is not remembered: the next
/// matmul creates cuBLAS and uses it.
fn cuda_matmul_uses_cublas_again_after_a_failed_cublas_create() -> Ran {
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

/// sum_all, mean_all, norm and a long argmax/argmin spread over the device:
/// a first pass over many blocks, then one over their partial results.
fn cuda_full_reductions_launch_many_blocks() -> Ran {
    simulated_cuda()?;
    on_cuda_alone("reduction grids", |d| {
        let n = 1_000_000usize;
        let x = Tensor::ones(n, DType::F32, &d)?;
        let peak = Tensor::arange(0.0, n as f64, 1.0, &d)?.sub_scalar(700_000.0)?.abs()?.neg()?;
        type Reduction<'a> = Box<dyn Fn() -> Result<f64> + 'a>;
        let cases: Vec<(&str, &str, Reduction)> = vec![
            ("sum_all", "reduce_sum_f32_partial", Box::new(|| Ok(x.sum_all()?.to_scalar::<f32>()? as f64))),
            ("mean_all", "reduce_sum_f32_partial", Box::new(|| Ok(x.mean_all()?.to_scalar::<f32>()? as f64))),
            ("norm", "reduce_sum_f32_partial", Box::new(|| Ok(x.norm()?.to_scalar::<f32>()? as f64))),
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
fn cuda_empty_cache_reports_a_failed_cumemfree() -> Ran {
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
