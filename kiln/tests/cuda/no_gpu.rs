//! Without a CUDA device: the GPU count, the fallback and its reason, and
//! NVRTC compiling every kernel family.

use super::*;

// ---- without a GPU ---------------------------------------------------------

pub(crate) fn gpu_count_is_cuda_devices_then_simulated_ones() {
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

pub(crate) fn without_a_driver_try_gpu_falls_back_and_says_why() -> Ran {
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

pub(crate) fn with_a_driver_but_no_device_try_gpu_says_so() -> Ran {
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

pub(crate) fn nvrtc_compiles_every_kernel_family_for_sm90() -> Ran {
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
    // One job per (arch, family), run on every core: NVRTC compiles separate
    // programs concurrently and ptxas is a process of its own, and the
    // check is most of a minute on one core.
    let jobs: Vec<(&String, &(String, String))> = archs.iter().flat_map(|a| sources.iter().map(move |s| (a, s))).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(jobs.len().max(1));
    let compile = |(arch, (family, source)): (&String, &(String, String))| -> usize {
        let ptx = kiln::cuda_check::compile_ptx(family, source, &format!("compute_{arch}"))
            .unwrap_or_else(|log| panic!("NVRTC {}.{} failed on family `{family}` for compute_{arch}:\n{log}", version.0, version.1));
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
        ptx.matches(".entry").count()
    };
    let entries: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut entries = 0;
                    while let Some(job) = jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                        entries += compile(*job);
                    }
                    entries
                })
            })
            .collect();
        // A worker's panic (a failed compile) is re-raised here with its message.
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).sum()
    });
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
