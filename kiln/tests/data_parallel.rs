//! Data-parallel training: the Trainer on several simulated GPUs against the
//! same training on one device (one step, and whole loss curves), replicas
//! bit-identical after every step, uneven and tiny batches, unused
//! parameters, batch normalisation, out of memory on one replica, and
//! `nn::DataParallel`.

#[path = "common/mod.rs"]
mod common;

use kiln::data::{DataLoader, DataModule};
use kiln::nn::{DataParallel, Linear, Loss, Module, ParamVisitor, ReLU, Sequential};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{History, Learner, Progress, Trainer};
use kiln::{DType, Device, Error, Result, Tensor};

/// Four simulated GPUs of this binary's own.
fn sims() -> &'static [Device] {
    common::own_sims(4, 512 << 20)
}

fn mlp(dtype: DType) -> Result<Sequential> {
    let cpu = kiln::cpu();
    let lin = |i, o| -> Result<Linear> {
        let l = Linear::new(i, o, &cpu)?;
        if dtype == DType::F32 {
            return Ok(l);
        }
        Linear::from_tensors(&l.weight().to_dtype(dtype)?, Some(&l.bias().unwrap().to_dtype(dtype)?))
    };
    Ok(Sequential::new().add(lin(5, 16)?).add(ReLU).add(lin(16, 3)?))
}

/// Seeded classification rows: `n` rows of 5 features, labels 0..3.
fn rows(n: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn((n, 5), &kiln::cpu())?.to_dtype(dtype)?;
    let y = Tensor::from_vec((0..n as i64).map(|i| (i * 7 + 3) % 3).collect::<Vec<_>>(), n, &kiln::cpu())?;
    Ok((x, y))
}

/// Trains a fresh seeded MLP on `devices` (one device: `Trainer::device`)
/// and returns the history and the parameters read back.
fn train(
    devices: &[Device],
    n: usize,
    batch: usize,
    epochs: usize,
    opt: OptimizerConfig,
    dtype: DType,
) -> Result<(History, Vec<Vec<f64>>)> {
    kiln::manual_seed(7);
    let net = mlp(dtype)?;
    let (x, y) = rows(n, dtype)?;
    let data = DataModule { train: DataLoader::new(vec![x, y], batch)?.shuffle(true), val: None };
    let mut model = Learner::new(net, Loss::CrossEntropy, opt);
    let builder = Trainer::builder().max_epochs(epochs).progress(Progress::Off).check_replicas(true);
    let mut trainer = if devices.len() == 1 { builder.device(devices[0]) } else { builder.devices(devices.to_vec()) }.build()?;
    let history = trainer.fit(&mut model, &data)?;
    let params = model.net.parameters().iter().map(|p| p.to_vec_f64()).collect::<Result<_>>()?;
    Ok((history, params))
}

#[track_caller]
fn assert_close(a: &[Vec<f64>], b: &[Vec<f64>], rel: f64, what: &str) {
    for (i, (pa, pb)) in a.iter().zip(b).enumerate() {
        for (j, (x, y)) in pa.iter().zip(pb).enumerate() {
            assert!((x - y).abs() <= rel * x.abs().max(y.abs()).max(1e-3), "{what}: parameter {i}[{j}]: {x} vs {y}");
        }
    }
}

#[test]
fn one_step_on_two_and_four_gpus_equals_one_step_on_one_device() -> Result<()> {
    let s = sims();
    for dtype in [DType::F32, DType::F64] {
        let (_, one) = train(&s[..1], 24, 24, 1, OptimizerConfig::sgd(0.5), dtype)?;
        for n in [2, 3, 4] {
            let (h, many) = train(&s[..n], 24, 24, 1, OptimizerConfig::sgd(0.5), dtype)?;
            let rel = if dtype == DType::F32 { 1e-6 } else { 1e-13 };
            assert_close(&one, &many, rel, &format!("{n} devices, {dtype}"));
            let stats = h.epochs[0].parallel.as_ref().expect("parallel stats");
            assert_eq!(stats.devices, n);
            assert!(stats.comm_bytes > 0 && stats.compute_seconds.is_some() && stats.comm_wait_seconds.is_some(), "{stats:?}");
        }
    }
    Ok(())
}

#[test]
fn loss_curves_match_one_device_with_uneven_and_tiny_last_batches() -> Result<()> {
    let s = sims();
    // 99 rows in batches of 32: the last batch of 3 rows leaves the fourth
    // device without rows (numpy's array_split: 1, 1, 1, 0).
    let (one, p1) = train(&s[..1], 99, 32, 3, OptimizerConfig::adam(0.01), DType::F32)?;
    for n in [2, 3, 4] {
        let (many, pn) = train(&s[..n], 99, 32, 3, OptimizerConfig::adam(0.01), DType::F32)?;
        for (a, b) in one.train_losses().iter().zip(many.train_losses()) {
            assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{n} devices: loss {b} vs {a}");
        }
        assert_close(&p1, &pn, 1e-4, &format!("{n} devices after 3 epochs"));
    }
    Ok(())
}

/// y = a·x with a second parameter the forward never uses.
#[derive(Clone)]
struct WithUnused {
    a: Tensor,
    unused: Tensor,
}

impl Module for WithUnused {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.a)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("a".into(), self.a.clone()), ("unused".into(), self.unused.clone())]
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("a", &mut self.a)?;
        f("unused", &mut self.unused)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(self.clone()))
    }
}

#[test]
fn a_parameter_no_replica_uses_keeps_no_gradient_and_its_value() -> Result<()> {
    let s = sims();
    kiln::manual_seed(1);
    let cpu = kiln::cpu();
    let net = WithUnused { a: Tensor::randn((5, 1), &cpu)?.requires_grad_(), unused: Tensor::ones(3, DType::F32, &cpu)?.requires_grad_() };
    let a0 = net.a.to_vec::<f32>()?;
    let (x, _) = rows(40, DType::F32)?;
    let y = x.sum_dims(&[1], true)?;
    let data = DataModule { train: DataLoader::new(vec![x, y], 8)?, val: None };
    let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, weight_decay: 0.0 });
    let mut trainer = Trainer::builder().max_epochs(2).devices(s[..3].to_vec()).progress(Progress::Off).check_replicas(true).build()?;
    trainer.fit(&mut model, &data)?;
    assert_eq!(model.net.unused.to_vec::<f32>()?, vec![1., 1., 1.]);
    assert!(model.net.unused.grad().is_none());
    assert_ne!(model.net.a.to_vec::<f32>()?, a0);
    Ok(())
}

#[test]
fn batch_normalised_lenet_replicas_stay_identical_and_the_first_keeps_its_statistics() -> Result<()> {
    let s = sims();
    kiln::manual_seed(2);
    let data = kiln::models::synthetic_image_task(48, 16, 16, 3)?;
    let mut model = Learner::new(kiln::models::bn_lenet(4), Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
    let mut trainer = Trainer::builder().max_epochs(1).devices(s[..2].to_vec()).progress(Progress::Off).check_replicas(true).build()?;
    let h = trainer.fit(&mut model, &data)?;
    assert!(h.epochs[0].val_metric.is_some());
    // The learner's running statistics moved from their start (0 and 1).
    let buffers = model.net.named_buffers();
    assert!(!buffers.is_empty());
    let mean = buffers.iter().find(|(n, _)| n.ends_with("running_mean")).unwrap().1.to_vec::<f32>()?;
    assert!(mean.iter().any(|&m| m != 0.0));
    assert_eq!(buffers[0].1.device(), s[0]);
    Ok(())
}

#[test]
fn out_of_memory_on_one_replica_leaves_the_learner_as_it_was() -> Result<()> {
    let s = &sims()[..2];
    kiln::manual_seed(4);
    let cpu = kiln::cpu();
    let net = Sequential::new().add(Linear::new(256, 2048, &cpu)?).add(ReLU).add(Linear::new(2048, 1, &cpu)?);
    let before: Vec<Vec<f32>> = net.parameters().iter().map(|p| p.to_vec::<f32>()).collect::<Result<_>>()?;
    let x = Tensor::randn((512, 256), &cpu)?;
    let y = Tensor::zeros((512, 1), DType::F32, &cpu)?;
    let data = DataModule { train: DataLoader::new(vec![x, y], 512)?, val: None };
    let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::Sgd { lr: 0.01, momentum: 0.9, weight_decay: 0.0 });
    // Fill the second device so that its replica fits but not its activations.
    kiln::synchronize(&s[1])?;
    let stats = s[1].memory_stats()?;
    let free = stats.capacity.unwrap() - stats.in_use;
    let ballast = Tensor::zeros((free - (4 << 20)) / 4, DType::F32, &s[1])?;
    let mut trainer = Trainer::builder().max_epochs(1).devices(s.to_vec()).progress(Progress::Off).build()?;
    let err = trainer.fit(&mut model, &data).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { device, .. } if device == s[1]), "{err}");
    let after: Vec<Vec<f32>> = model.net.parameters().iter().map(|p| p.to_vec::<f32>()).collect::<Result<_>>()?;
    assert_eq!(after, before);
    assert_eq!(model.steps_trained(), 0);
    drop(ballast);
    // With the memory back, the same learner trains.
    trainer.fit(&mut model, &data)?;
    assert_eq!(model.steps_trained(), 1);
    Ok(())
}

#[test]
fn data_parallel_splits_the_batch_and_sums_gradients_into_the_module() -> Result<()> {
    let s = sims();
    kiln::manual_seed(5);
    let net = mlp(DType::F32)?;
    let reference = mlp_copy(&net)?;
    let x = Tensor::randn((7, 5), &kiln::cpu())?;
    let dp = DataParallel::new(net, &s[..3])?;
    let y = dp.forward(&x)?;
    assert_eq!((y.dims(), y.device()), (&[7, 3][..], s[0]));
    let y1 = reference.forward(&x)?;
    let (a, b) = (y.to_vec::<f32>()?, y1.to_vec::<f32>()?);
    assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() < 1e-6), "{a:?} vs {b:?}");
    y.sqr()?.sum_all()?.backward()?;
    y1.sqr()?.sum_all()?.backward()?;
    for (p, q) in dp.parameters().iter().zip(reference.parameters()) {
        assert_eq!(p.device(), s[0]);
        let (g, h) = (p.grad().unwrap().to_vec::<f32>()?, q.grad().unwrap().to_vec::<f32>()?);
        assert!(g.iter().zip(&h).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0)), "{g:?} vs {h:?}");
    }
    // Two rows over three devices: two pieces (torch.chunk), still right.
    assert_eq!(dp.forward(&x.narrow(0, 0, 2)?)?.dims(), &[2, 3]);
    // A device that does not exist, twice the same, none.
    assert!(matches!(DataParallel::new(mlp(DType::F32)?, &[s[0], kiln::gpu(999)]), Err(Error::NoSuchDevice { .. })));
    assert!(DataParallel::new(mlp(DType::F32)?, &[s[0], s[0]]).is_err());
    assert!(DataParallel::new(mlp(DType::F32)?, &[]).is_err());
    // Lazy layers: the first piece's forward, on the module itself, makes
    // their parameters before the other replicas copy them.
    let lazy = DataParallel::new(Sequential::new().add(kiln::nn::LazyLinear::new(2)), &s[..2])?;
    let out = lazy.forward(&x)?;
    assert_eq!(lazy.module().parameter("0.weight")?.device(), s[0]);
    let direct = lazy.module().forward(&x.to(&s[0])?)?;
    let (a, b) = (out.to_vec::<f32>()?, direct.to_vec::<f32>()?);
    assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() < 1e-6), "{a:?} vs {b:?}");
    Ok(())
}

#[test]
fn a_trainer_given_a_device_that_does_not_exist_is_refused_before_training() -> Result<()> {
    let s = sims();
    let missing = kiln::gpu(999);
    let builder = || Trainer::builder().max_epochs(1).progress(Progress::Off);
    // In a list of GPUs, alone, and as the only device: NoSuchDevice naming
    // it and the devices that exist, at build time, before any data moves.
    for result in
        [builder().devices(vec![s[0], missing]).build(), builder().devices(vec![missing]).build(), builder().device(missing).build()]
    {
        match result {
            Err(Error::NoSuchDevice { device, available }) => {
                assert_eq!(device, missing);
                assert!(available.contains(&s[0]) && !available.contains(&missing), "{available:?}");
            }
            Err(other) => panic!("expected NoSuchDevice, got {other}"),
            Ok(_) => panic!("a trainer on {missing} was built"),
        }
    }
    // num_gpus asks for at most that many (PyTorch Lightning's `devices=n`
    // errs instead; kiln's book-style `num_gpus` takes what exists, as
    // d2l's `try_all_gpus()[:n]`): it never names a GPU beyond the last.
    let trainer = builder().num_gpus(kiln::num_gpus() + 5).build()?;
    assert_eq!(trainer.gpus().len(), kiln::num_gpus());
    assert!(trainer.gpus().iter().all(|d| d.memory_stats().is_ok()));
    // And a learner given to a refused trainer is untouched: nothing was built.
    let mut model = Learner::new(mlp(DType::F32)?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
    let before = model.net.parameters().iter().map(|p| p.to_vec_f64()).collect::<Result<Vec<_>>>()?;
    let (x, y) = rows(8, DType::F32)?;
    let data = DataModule { train: DataLoader::new(vec![x, y], 4)?, val: None };
    assert!(builder().devices(vec![s[0], missing]).build().and_then(|mut t| t.fit(&mut model, &data)).is_err());
    let after = model.net.parameters().iter().map(|p| p.to_vec_f64()).collect::<Result<Vec<_>>>()?;
    assert_eq!(before, after);
    assert!(model.net.parameters().iter().all(|p| p.device().is_cpu()));
    Ok(())
}

#[test]
fn a_data_parallel_fit_keeps_one_copy_of_the_examples_per_device_for_the_next_fits() -> Result<()> {
    let s = sims();
    kiln::manual_seed(3);
    let (x, y) = rows(64, DType::F32)?;
    let data_bytes = (x.elem_count() * 4 + y.elem_count() * 8) as u64;
    let data = DataModule { train: DataLoader::new(vec![x, y], 16)?.shuffle(true), val: None };
    let mut model = Learner::new(mlp(DType::F32)?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
    let trainer = || Trainer::builder().max_epochs(1).progress(Progress::Off).devices(s[..2].to_vec()).build();
    let h2d = |since: &kiln::TransferStats| kiln::thread_transfer_stats().since(since).direction(kiln::Direction::HostToDevice);
    let mark = kiln::thread_transfer_stats();
    trainer()?.fit(&mut model, &data)?;
    // The examples went to each device once (and the model, the orders).
    let first = h2d(&mark);
    assert!(first.bytes >= 2 * data_bytes, "{first:?}");
    assert_eq!(data.train.device_copies(), vec![s[0], s[1]]);
    // A second fit uses those copies: only the model and the epoch's order go up.
    let mark = kiln::thread_transfer_stats();
    trainer()?.fit(&mut model, &data)?;
    let second = h2d(&mark);
    assert!(second.bytes < data_bytes, "{second:?}: the examples were copied again");
    // A fit on one of them keeps that copy and drops the other's memory;
    // releasing drops every copy.
    Trainer::builder().max_epochs(1).progress(Progress::Off).device(s[1]).build()?.fit(&mut model, &data)?;
    assert_eq!(data.train.device_copies(), vec![s[1]]);
    data.train.release_device_copy();
    assert!(data.train.device_copies().is_empty());
    Ok(())
}

/// A copy of an MLP with parameters of its own on the CPU.
fn mlp_copy(net: &Sequential) -> Result<Sequential> {
    let mut copy = Sequential::new();
    for i in [0, 2] {
        let layer = &net[i];
        let w = layer.parameter("weight")?.detach().copy_to(&kiln::cpu())?;
        let b = layer.parameter("bias")?.detach().copy_to(&kiln::cpu())?;
        copy.push(Linear::from_tensors(&w, Some(&b))?);
        if i == 0 {
            copy.push(ReLU);
        }
    }
    Ok(copy)
}

#[test]
fn a_module_that_cannot_be_copied_is_refused_with_the_fix() -> Result<()> {
    struct NoClone(Linear);
    impl Module for NoClone {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.0.forward(x)
        }
        fn named_parameters(&self) -> Vec<(String, Tensor)> {
            self.0.named_parameters()
        }
        fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
            self.0.visit_parameters_mut(f)
        }
    }
    let s = sims();
    let x = Tensor::ones((4, 5), DType::F32, &kiln::cpu())?;
    let dp = DataParallel::new(NoClone(Linear::new(5, 1, &kiln::cpu())?), &s[..2])?;
    let e = dp.forward(&x).unwrap_err().to_string();
    assert!(e.contains("boxed_clone"), "{e}");
    let data = DataModule { train: DataLoader::new(vec![x.clone(), Tensor::ones((4, 1), DType::F32, &kiln::cpu())?], 4)?, val: None };
    let mut model = Learner::new(NoClone(Linear::new(5, 1, &kiln::cpu())?), Loss::Mse, OptimizerConfig::sgd(0.1));
    let mut trainer = Trainer::builder().max_epochs(1).devices(s[..2].to_vec()).progress(Progress::Off).build()?;
    let e = trainer.fit(&mut model, &data).unwrap_err().to_string();
    assert!(e.contains("boxed_clone"), "{e}");
    Ok(())
}
