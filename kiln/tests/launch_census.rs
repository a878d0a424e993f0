//! The launch census of one training step on simulated CUDA: every kernel
//! kiln launches in a step of LeNet and of ResNet-18 gives each thread a
//! bounded amount of serial work, and the convolutions' multiply-adds run
//! inside cuBLAS. The CUDA simulator counts each thread's work in basic
//! blocks (`KILN_CUDASIM_CENSUS=1`, see cudasim/README.md); the step runs in
//! a child process with the census on and a device of 132 multiprocessors
//! (an H100/H200's count), so that grid-stride loops get the threads a real
//! GPU gives them. Without the CUDA simulator the tests report a skip.

#[path = "common/mod.rs"]
#[macro_use]
mod common;

use common::Ran;
use kiln::models::{lenet, resnet18, synthetic_images};
use kiln::nn::{Loss, Module, Sequential};
use kiln::optim::{Optimizer, Sgd};
use kiln::{Device, LaunchRecord, Result};

/// The most basic blocks one thread of any kernel may run in a step: about
/// what a thread of an elementwise kernel runs over a few elements with a
/// strided index, or a reduction thread folding a few dozen values. A
/// kernel that loops over a batch, an image or a channel's N·H·W from one
/// thread runs thousands.
const WORK_BOUND: u64 = 400;

/// The direct convolution kernels, which must not run when cuBLAS is there.
const DIRECT_CONV: [&str; 3] = ["conv2d_fwd", "conv2d_bwd_input", "conv2d_bwd_weight"];

/// The settings of the child that takes the census.
const CENSUS_ENV: &[(&str, &str)] = &[("KILN_CUDASIM_CENSUS", "1"), ("KILN_CUDASIM_SMS", "132"), ("KILN_CUDASIM_DEVICES", "1")];

fn main() -> std::process::ExitCode {
    common::run_suite(trials![
        a_lenet_step_gives_every_thread_bounded_work_and_runs_convolutions_in_cublas_or_cudnn,
        a_resnet18_step_gives_every_thread_bounded_work_and_runs_convolutions_in_cublas_or_cudnn,
        contiguous_elementwise_kernels_move_16_bytes_per_access_with_the_cpus_bits,
        the_elementwise_families_have_a_16_byte_packed_path_in_their_source,
    ])
}

/// The CUDA device to take the census on, or a skip.
fn census_device() -> std::result::Result<Option<Device>, common::Skip> {
    let Some(&d) = common::cuda_devices().first() else {
        return Err(common::skip_no_cuda(format!(
            "the launch census needs the CUDA simulator (scripts/cudasim.sh): {}",
            common::why_no_cuda()
        )));
    };
    // A real GPU runs kernels without counting them: the census is the
    // simulator's (on a GPU machine, scripts/gpu-check.sh times instead).
    if !common::is_simulated_cuda(d) {
        return Err(common::skip(format!("the launch census is taken by the CUDA simulator (scripts/cudasim.sh); {d} is a real GPU")));
    }
    Ok(Some(d))
}

/// One SGD step of `net` on `batch` synthetic images of `size`×`size` on `d`,
/// after a first step (which loads modules and sizes lazy layers); the
/// census of the second step.
fn census_of_a_step(mut net: Sequential, batch: usize, size: usize, d: Device) -> Result<Census> {
    let (x, y) = synthetic_images(batch, 3, &d)?;
    let x = if size == 28 { x } else { x.interpolate([size, size], kiln::InterpMode::Nearest)? };
    let x = x.contiguous()?;
    net.init_lazy(&x.to(&kiln::cpu())?)?;
    net.to(&d)?;
    let mut opt = Sgd::new(net.parameters(), 0.01);
    let mut step = || -> Result<()> {
        opt.zero_grad();
        let loss = Loss::CrossEntropy.compute(&net.forward(&x)?, &y)?;
        loss.backward()?;
        opt.step()
    };
    step()?;
    kiln::take_launch_census()?;
    step()?;
    Ok(Census { records: kiln::take_launch_census()?, parameters: net.parameters().len() })
}

/// A step's launches, and the parameters its optimizer updated.
struct Census {
    records: Vec<LaunchRecord>,
    parameters: usize,
}

/// Checks a step's census: no thread above [`WORK_BOUND`], no direct
/// convolution kernel, at least `conv_macs` multiply-adds in cuBLAS or
/// cuDNN (whichever `KILN_CUDA_CONV` names), and the SGD step of every
/// parameter in one launch per 48 (the multi-tensor kernel).
fn check(census: &Census, conv_macs: u64) {
    let records = &census.records;
    let table = kiln::census_table(records);
    println!("{table}");
    assert!(!records.is_empty(), "the census recorded nothing");
    for r in records.iter().filter(|r| r.kind == "kernel") {
        assert!(
            r.work_max <= WORK_BOUND,
            "{} gives one thread {} basic blocks of serial work (bound {WORK_BOUND}, {} threads):\n{table}",
            r.name,
            r.work_max,
            r.threads
        );
        assert!(
            !DIRECT_CONV.iter().any(|k| r.name.starts_with(k)),
            "the direct convolution kernel {} ran although cuBLAS is there:\n{table}",
            r.name
        );
    }
    // The loss: one launch for the rows' losses and one for their gradient
    // (it was about ten each way, composed from log-softmax and one-hot).
    let launches = |prefix: &str| records.iter().filter(|r| r.kind == "kernel" && r.name.starts_with(prefix)).count();
    assert_eq!(
        (launches("cross_entropy_fwd_"), launches("cross_entropy_bwd_"), launches("one_hot")),
        (1, 1, 0),
        "the step's cross-entropy should be one fused launch each way:\n{table}"
    );
    let exactly = |name: &str| records.iter().filter(|r| r.kind == "kernel" && r.name == name).count();
    assert_eq!(
        (launches("sgd_foreach_"), exactly("sgd_f32")),
        (census.parameters.div_ceil(48), 0),
        "the optimizer step of {} parameters should be one launch per 48:\n{table}",
        census.parameters
    );
    let macs: u64 = records.iter().filter(|r| r.kind == "gemm" || r.kind == "dnn").map(|r| r.macs).sum();
    assert!(
        macs >= conv_macs,
        "{macs} multiply-adds ran in cuBLAS and cuDNN, fewer than the step's convolutions need ({conv_macs}):\n{table}"
    );
    // The path the child was given is the one that ran the convolutions.
    let dnn_calls = records.iter().filter(|r| r.kind == "dnn").count();
    match std::env::var("KILN_CUDA_CONV").as_deref() {
        Ok("cudnn") => assert!(dnn_calls > 0 && launches("conv_im2col") == 0, "KILN_CUDA_CONV=cudnn, but:\n{table}"),
        Ok("gemm") => assert!(dnn_calls == 0 && launches("conv_im2col") > 0, "KILN_CUDA_CONV=gemm, but:\n{table}"),
        _ => {}
    }
}

fn in_child(f: impl FnOnce(Device) -> Result<()>) -> Ran {
    in_children(&[&[]], f)
}

/// Runs `f` in a child with the census on, once for each of `settings`
/// (added to [`CENSUS_ENV`]).
fn in_children(settings: &[&[(&str, &str)]], f: impl FnOnce(Device) -> Result<()>) -> Ran {
    let Some(d) = census_device()? else { return Ok(()) };
    if common::is_child() {
        f(d).unwrap();
        println!("CHILD-OK");
    } else {
        for extra in settings {
            let env: Vec<(&str, &str)> = CENSUS_ENV.iter().chain(extra.iter()).copied().collect();
            let out = common::run_child(&env);
            print!("{out}");
        }
        common::report_ran(d);
    }
    Ok(())
}

/// The two library paths of a convolution, each in a child of its own.
/// (cuDNN's other settings pinned, so the caller's cannot change the path).
const CONV_PATHS: &[&[(&str, &str)]] = &[
    &[("KILN_CUDA_CONV", "cudnn"), ("KILN_DISABLE_CUDNN", "0"), ("KILN_CUDNN_LIB", ""), ("KILN_CUDNN_BENCHMARK", "0")],
    &[("KILN_CUDA_CONV", "gemm")],
];

fn a_lenet_step_gives_every_thread_bounded_work_and_runs_convolutions_in_cublas_or_cudnn() -> Ran {
    in_children(CONV_PATHS, |d| {
        let mut busiest = Vec::new();
        for batch in [8u64, 32] {
            let census = census_of_a_step(lenet(10), batch as usize, 28, d)?;
            // LeNet's convolutions per image: 1→6 channels, 5×5, 28×28 out;
            // 6→16 channels, 5×5, 10×10 out. Forward, input and weight
            // gradients (the first layer's input needs none).
            let conv1 = 6 * 25 * 28 * 28;
            let conv2 = 16 * 6 * 25 * 10 * 10;
            check(&census, batch * (2 * conv1 + 3 * conv2));
            busiest.push(census.records.iter().map(|r| r.work_max).max().unwrap_or(0));
        }
        // Four times the batch, the same serial work per thread (a few
        // blocks of slack for index arithmetic).
        assert!(busiest[1] <= busiest[0] + busiest[0] / 10, "the busiest thread's work grew with the batch: {busiest:?} at batch 8 and 32");
        Ok(())
    })
}

fn a_resnet18_step_gives_every_thread_bounded_work_and_runs_convolutions_in_cublas_or_cudnn() -> Ran {
    in_children(CONV_PATHS, |d| {
        let census = census_of_a_step(resnet18(10), 2, 96, d)?;
        // The stem alone: 3→64 channels, 7×7, 48×48 out, forward and weight
        // gradient, per image.
        check(&census, 2 * 2 * 64 * 3 * 49 * 48 * 48);
        Ok(())
    })
}

/// A contiguous f32/f64 add and exp run a thread per 16 bytes (4 floats or
/// 2 doubles, and the tail), the add with the CPU's bits, the exp within
/// the device's ulps of it.
fn contiguous_elementwise_kernels_move_16_bytes_per_access_with_the_cpus_bits() -> Ran {
    in_child(|d| {
        let n = (1usize << 16) + 3;
        for (dtype, per_thread) in [(kiln::DType::F32, 4usize), (kiln::DType::F64, 2)] {
            let x = kiln::Tensor::arange_dtype(0.0, n as f64, 1.0, dtype, &kiln::cpu())?.mul_scalar(1e-4)?;
            let xd = x.to(&d)?;
            kiln::take_launch_census()?;
            let (sum, exp) = (xd.add(&xd)?, xd.exp()?);
            let records = kiln::take_launch_census()?;
            let threads = (n.div_ceil(per_thread).div_ceil(256) * 256) as u64;
            for name in ["binary_add", "unary_exp"] {
                let r = records.iter().find(|r| r.name.starts_with(name)).unwrap_or_else(|| panic!("no {name} launch in the census"));
                assert_eq!(r.threads, threads, "{name} {dtype}: a thread per {per_thread} elements (16 bytes)");
            }
            assert_eq!(sum.to_vec_f64()?, x.add(&x)?.to_vec_f64()?, "{dtype}: add differs from the CPU");
            let ulps = common::transcendental_ulps(d);
            if dtype == kiln::DType::F32 {
                for (g, w) in exp.to_vec::<f32>()?.iter().zip(x.exp()?.to_vec::<f32>()?) {
                    assert!((g.to_bits() as i64 - w.to_bits() as i64).unsigned_abs() <= ulps, "f32 exp: {g:e} on {d}, {w:e} on the CPU");
                }
            } else {
                common::assert_ulps(&exp.to_vec_f64()?, &x.exp()?.to_vec_f64()?, ulps, "f64 exp");
            }
        }
        Ok(())
    })
}

/// The generated CUDA source of the unary and binary families loads and
/// stores 16-byte packs on contiguous operands.
fn the_elementwise_families_have_a_16_byte_packed_path_in_their_source() -> Ran {
    let sources = kiln::cuda_check::kernel_sources();
    for family in ["unary", "binary"] {
        let (_, src) = sources.iter().find(|(m, _)| m == family).unwrap_or_else(|| panic!("no {family} module"));
        assert!(src.contains("#define PACK_BYTES 16"), "{family}: the prelude's pack size");
        assert!(src.contains("Pack<T, N>") && src.contains("__restrict__"), "{family}: no packed path in its source");
    }
    Ok(())
}
