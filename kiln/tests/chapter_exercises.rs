//! The chapter's four exercises as behavioural tests (not timings), and the
//! cells that need two GPUs, on two simulated GPUs that this binary adds when
//! the environment has fewer (`ensure_simulated_gpus`): the devices are
//! `try_gpu(0)` and `try_gpu(1)`, real GPUs where the machine has them.

use kiln::nn::{LazyLinear, Linear, Module, ReLU, Sequential};
use kiln::trainer::Trainer;
use kiln::{checkpoint, cpu, gpu, thread_transfer_stats, try_gpu, DType, Device, Direction, Error, Result, Tensor, TransferStats};

/// gpu(0) and gpu(1): two GPUs at least.
fn two_gpus() -> (Device, Device) {
    kiln::ensure_simulated_gpus(2, 512 << 20);
    let (g0, g1) = (try_gpu(0), try_gpu(1));
    assert!(g0.is_gpu() && g1.is_gpu() && g0 != g1);
    (g0, g1)
}

fn d2h(mark: &TransferStats) -> u64 {
    thread_transfer_stats().since(mark).direction(Direction::DeviceToHost).count
}

#[track_caller]
fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "element {i}: {g} vs {w}");
    }
}

/// Exercise 1 (000 "Latihan" 1, 004 "exercise" 1): "Try a larger computation task, such as the
/// multiplication of large matrices, and see the difference in speed between the CPU and GPU.
/// What about a task with a small amount of calculations?" The GPU's product is the CPU's,
/// within rounding, and stays on the GPU; so does a small one.
#[test]
fn exercise_1_large_and_small_matmul_on_cpu_and_gpu_agree() -> Result<()> {
    let (g0, _) = two_gpus();
    for n in [512, 2] {
        kiln::manual_seed(1);
        let a = Tensor::randn((n, n), &cpu())?;
        let b = Tensor::randn((n, n), &cpu())?;
        let on_cpu = a.matmul(&b)?;
        let on_gpu = a.to(&g0)?.matmul(&b.to(&g0)?)?;
        on_gpu.block_until_ready()?;
        assert_eq!((on_cpu.device(), on_gpu.device(), on_gpu.dims()), (cpu(), g0, &[n, n][..]));
        // Sums of n products of N(0, 1) values: the rounding grows like sqrt(n).
        assert_close(&on_gpu.to_vec::<f32>()?, &on_cpu.to_vec::<f32>()?, 1e-4);
    }
    Ok(())
}

/// Exercise 2 (000 "Latihan" 2, 001 exercise 2, 004 "How should we read and write model
/// parameters on the GPU?"): parameters saved from a GPU load back bit for bit onto the CPU
/// and onto another GPU, and the loaded nets compute the same outputs.
#[test]
fn exercise_2_parameters_saved_from_a_gpu_load_exactly_on_cpu_and_gpu() -> Result<()> {
    let (g0, g1) = two_gpus();
    kiln::manual_seed(2);
    let build =
        |d: &Device| -> Result<Sequential> { Ok(Sequential::new().add(Linear::new(4, 8, d)?).add(ReLU).add(Linear::new(8, 1, d)?)) };
    let net = build(&g0)?;
    let dir = std::env::temp_dir().join(format!("kiln-chapter-ex2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("net.safetensors");
    checkpoint::save(&net, &path)?;
    let saved: Vec<(String, Vec<f32>)> = net.named_parameters().into_iter().map(|(n, p)| (n, p.to_vec::<f32>().unwrap())).collect();
    let x = Tensor::randn((3, 4), &cpu())?;
    let want = net.forward(&x.to(&g0)?)?.to_vec::<f32>()?;
    for d in [cpu(), g1, g0] {
        kiln::manual_seed(99);
        let mut other = build(&cpu())?;
        checkpoint::load(&mut other, &path, &d)?;
        let loaded: Vec<(String, Vec<f32>)> = other.named_parameters().into_iter().map(|(n, p)| (n, p.to_vec::<f32>().unwrap())).collect();
        assert_eq!(loaded, saved, "parameters loaded onto {d}");
        assert_eq!(other.devices(), vec![d]);
        let out = other.forward(&x.to(&d)?)?;
        assert_eq!(out.device(), d);
        assert_close(&out.to_vec::<f32>()?, &want, 1e-6);
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// Exercise 3 (000 "Latihan" 3): "Measure the time it takes to compute 1000 matrix–matrix
/// multiplications of 100 × 100 matrices and log the Frobenius norm of the output matrix one
/// result at a time vs. keeping a log on the GPU and transferring only the final result." The
/// per-step log reads the device once per step; the log kept on the device is read once.
/// (200 steps here; the count is what matters.)
#[test]
fn exercise_3_a_log_on_the_gpu_is_read_once_instead_of_once_per_step() -> Result<()> {
    let (g0, _) = two_gpus();
    let steps = 200;
    kiln::manual_seed(3);
    let a = Tensor::randn((100, 100), &g0)?.mul_scalar(0.1)?;
    let mark = thread_transfer_stats();
    let mut host_log = Vec::new();
    let mut m = a.clone();
    for _ in 0..steps {
        m = m.matmul(&a)?.add(&a)?;
        host_log.push(m.norm()?.to_scalar::<f32>()?);
    }
    assert_eq!(d2h(&mark), steps as u64, "one read per step");
    let mark = thread_transfer_stats();
    let mut norms = Vec::new();
    let mut m = a.clone();
    for _ in 0..steps {
        m = m.matmul(&a)?.add(&a)?;
        norms.push(m.norm()?);
    }
    let refs: Vec<&Tensor> = norms.iter().collect();
    let log = Tensor::stack(&refs, 0)?;
    assert_eq!(log.device(), g0);
    let device_log = log.to_vec::<f32>()?;
    let diff = thread_transfer_stats().since(&mark);
    assert_eq!(diff.direction(Direction::DeviceToHost).count, 1, "one read in all");
    assert_eq!(diff.direction(Direction::DeviceToHost).bytes, 4 * steps as u64);
    assert_eq!(device_log, host_log);
    Ok(())
}

/// Exercise 4 (000 "Latihan" 4): "Measure how much time it takes to perform two matrix–matrix
/// multiplications on two GPUs at the same time vs. in sequence on one GPU." Both are enqueued
/// before either is waited for; each stays on its GPU, and the results are those of the two
/// products in sequence on one GPU.
#[test]
fn exercise_4_two_matmuls_on_two_gpus_equal_the_sequence_on_one() -> Result<()> {
    let (g0, g1) = two_gpus();
    kiln::manual_seed(4);
    let a = Tensor::randn((256, 256), &cpu())?;
    let b = Tensor::randn((256, 256), &cpu())?;
    let (a0, b1) = (a.to(&g0)?, b.to(&g1)?);
    let mark = thread_transfer_stats();
    // Two GPUs at the same time: both products enqueued, then both awaited.
    let c0 = a0.matmul(&a0)?;
    let c1 = b1.matmul(&b1)?;
    c0.block_until_ready()?;
    c1.block_until_ready()?;
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 0, "no transfer between the two GPUs");
    assert_eq!((c0.device(), c1.device()), (g0, g1));
    // In sequence on one GPU.
    let b0 = b.to(&g0)?;
    let s0 = a0.matmul(&a0)?;
    let s1 = b0.matmul(&b0)?;
    kiln::synchronize(&g0)?;
    let tol = if kiln::devices().iter().filter(|i| [g0, g1].contains(&i.device)).all(|i| i.kind == kiln::DeviceKind::Simulated) {
        0.0
    } else {
        1e-4
    };
    assert_close(&c0.to_vec::<f32>()?, &s0.to_vec::<f32>()?, tol);
    assert_close(&c1.to_vec::<f32>()?, &s1.to_vec::<f32>()?, tol);
    Ok(())
}

/// 004 `(z + 2).exp() * y` with `z = x.as_in_context(mx.gpu())` and `y` on `mx.gpu(1)`, on two
/// GPUs: the error names the op and both GPUs, in operand order, and says how to move one.
#[test]
fn mxnet_z_on_gpu0_times_y_on_gpu1_is_a_mismatch_naming_both() -> Result<()> {
    let (g0, g1) = two_gpus();
    let z = Tensor::ones((2, 3), DType::F32, &g0)?;
    let y = Tensor::rand((2, 3), &g1)?;
    let err = z.add_scalar(2.0)?.exp()?.mul(&y).unwrap_err();
    let Error::DeviceMismatch { op, lhs, rhs } = &err else { panic!("{err:?}") };
    assert_eq!((op.as_str(), *lhs, *rhs), ("mul", g0, g1));
    let msg = err.to_string();
    assert!(msg.contains(&g0.to_string()) && msg.contains(&g1.to_string()) && msg.contains(".to("), "{msg}");
    // y.as_in_context(mx.gpu()) is y: false on two GPUs (a copy on gpu(0)); copyto likewise.
    let mark = thread_transfer_stats();
    let y0 = y.to(&g0)?;
    assert!(!y0.same_storage(&y) && y0.device() == g0);
    let diff = thread_transfer_stats().since(&mark);
    assert_eq!(diff.by_pair.get(&(Direction::DeviceToDevice, g1, g0)).map(|c| (c.count, c.bytes)), Some((1, 24)));
    Ok(())
}

/// 004 `net.initialize(ctx=mx.gpu())` then `net(y)` with `y` on gpu(1): a mismatch naming the
/// input's GPU and the layer's; the parameters are not created by the failed call.
#[test]
fn gluon_net_on_gpu0_fed_y_on_gpu1_names_both_gpus() -> Result<()> {
    let (g0, g1) = two_gpus();
    let mut net = Sequential::new().add(LazyLinear::new(1));
    net.to(&g0)?;
    let y = Tensor::rand((2, 3), &g1)?;
    let err = net.forward(&y).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { lhs, rhs, .. } if lhs == g1 && rhs == g0), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("input is on {g1} while layer 0 weight is on {g0}")), "{msg}");
    assert!(net.has_lazy_parameters());
    // An already created layer says the same.
    let dense = Sequential::new().add(Linear::new(3, 1, &g0)?);
    let err = dense.forward(&y).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { lhs, rhs, .. } if lhs == g1 && rhs == g0), "{err:?}");
    Ok(())
}

/// 000 (tab tensorflow) `with try_gpu(1):` / `Z = X` and `with try_gpu(1):` / `Z2 = Z`, and
/// (tab jax) `Z = jax.device_put(X, try_gpu(1))` / `Z2 = jax.device_put(Z, try_gpu(1))`, on two
/// GPUs: a scope moves nothing; device_put makes one gpu(0) -> gpu(1) copy, then none.
#[test]
fn tensorflow_scope_and_jax_device_put_on_two_gpus() -> Result<()> {
    let (g0, g1) = two_gpus();
    let x = Tensor::ones((2, 3), DType::F32, &g0)?;
    let mark = thread_transfer_stats();
    {
        let _scope = kiln::default_device_scope(g1)?;
        let z = x.clone();
        assert!(z.same_storage(&x) && z.device() == g0);
        assert_eq!(Tensor::ones((2, 3), DType::F32, &kiln::default_device())?.device(), g1);
        assert_eq!(Tensor::new_default(&[1f32])?.device(), g1);
    }
    // Only the new tensor from host data crossed a bus (an upload to gpu(1)); X did not move.
    let diff = thread_transfer_stats().since(&mark);
    assert_eq!(diff.by_pair.keys().copied().collect::<Vec<_>>(), vec![(Direction::HostToDevice, cpu(), g1)]);
    assert_eq!(diff.total().count, 1);
    let mark = thread_transfer_stats();
    let z = x.to(&g1)?;
    let z2 = z.to(&g1)?;
    let diff = thread_transfer_stats().since(&mark);
    assert_eq!(diff.total().count, 1);
    assert_eq!(diff.by_pair.get(&(Direction::DeviceToDevice, g0, g1)).map(|c| c.count), Some(1));
    assert!(z2.same_storage(&z));
    Ok(())
}

/// 000 `def __init__(self, max_epochs, num_gpus=0, gradient_clip_val=0):` with `num_gpus=2` on
/// two GPUs: both are the trainer's, and `prepare_batch`/`prepare_model` use the first.
#[test]
fn trainer_with_two_gpus_uses_the_first() -> Result<()> {
    let (g0, _) = two_gpus();
    let n = kiln::num_gpus();
    let t = Trainer::builder().max_epochs(1).num_gpus(2).build()?;
    assert_eq!(t.gpus(), &[gpu(0), gpu(1)][..]);
    assert_eq!(Trainer::builder().max_epochs(1).num_gpus(n + 3).build()?.gpus().len(), n);
    let batch = t.prepare_batch(vec![Tensor::ones((2, 2), DType::F32, &cpu())?, Tensor::ones(2, DType::F32, &cpu())?])?;
    assert!(batch.iter().all(|b| b.device() == g0));
    let mut net = Sequential::new().add(LazyLinear::new(1));
    t.prepare_model(&mut net)?;
    assert_eq!(net.forward(&batch[0])?.device(), g0);
    assert_eq!(net.devices(), vec![g0]);
    Ok(())
}
