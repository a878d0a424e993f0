//! Layers, device moves, optimizers, the data loader, the Trainer,
//! checkpoints and IDX files. What involves a device runs on the CPU, the two
//! simulated GPUs and every CUDA device present (`KILN_REQUIRE_CUDA=1` makes
//! having none a failure), booking a `RAN-CUDA` line for each CUDA device.

mod common;

use kiln::data::{make_regression, permutation, read_idx, synthetic_classification, synthetic_regression, DataLoader, DataModule};
use kiln::nn::{
    accuracy, cross_entropy, init, log_softmax, mse_loss, Dropout, Flatten, LazyLinear, Linear, Loss, Module, ParamVisitor, ReLU,
    Sequential, Sigmoid, Tanh,
};
use kiln::optim::{Adam, Optimizer, OptimizerConfig, Sgd};
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{checkpoint, cpu, DType, Device, Direction, Error, Result, Tensor};
use std::io::Write;
use std::path::PathBuf;

fn sims() -> Vec<Device> {
    common::sims()
}

/// Every GPU: the two simulated ones, then every CUDA device.
fn gpus() -> Vec<Device> {
    let mut all = sims();
    all.extend(common::cuda_devices());
    all
}

/// Pairs of distinct GPUs for moves between GPUs: the two simulated GPUs,
/// then two CUDA devices (or the one CUDA device and a simulated GPU).
fn gpu_pairs() -> Vec<(Device, Device)> {
    let sims = sims();
    let cuda = common::cuda_devices();
    let mut pairs = vec![(sims[0], sims[1])];
    match cuda.len() {
        0 => {}
        1 => pairs.push((cuda[0], sims[0])),
        _ => pairs.push((cuda[0], cuda[1])),
    }
    pairs
}

/// Books the devices of a part of a test that succeeded (RAN-CUDA lines).
fn ran(devices: &[Device]) {
    for &d in devices {
        common::report_ran(d);
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-nn-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

// ---- layers ---------------------------------------------------------------

#[test]
fn linear_computes_x_wt_plus_b() -> Result<()> {
    let layer =
        Linear::from_tensors(&Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &cpu())?, Some(&Tensor::new(&[1f32, 0., -1.], &cpu())?))?;
    let x = Tensor::new(&[[1f32, 1.], [2., -1.]], &cpu())?;
    let y = layer.forward(&x)?;
    assert_eq!(y.dims(), &[2, 3]);
    assert_eq!(y.to_vec::<f32>()?, vec![4., 7., 10., 1., 2., 3.]);
    assert_eq!((layer.in_features(), layer.out_features()), (2, 3));
    assert!(layer.weight().requires_grad() && layer.weight().is_leaf());
    // A wrong input size is a shape error, not a panic.
    assert!(matches!(layer.forward(&Tensor::ones((2, 3), DType::F32, &cpu())?), Err(Error::ShapeMismatch { .. })));
    assert!(Linear::new(0, 3, &cpu()).is_err());
    Ok(())
}

#[test]
fn linear_init_is_seeded_and_bounded() -> Result<()> {
    kiln::manual_seed(11);
    let a = Linear::new(16, 4, &cpu())?;
    kiln::manual_seed(11);
    let b = Linear::new(16, 4, &cpu())?;
    assert_eq!(a.weight().to_vec::<f32>()?, b.weight().to_vec::<f32>()?);
    assert!(a.weight().to_vec::<f32>()?.iter().all(|w| w.abs() <= 0.25), "U[-1/sqrt(16), 1/sqrt(16)]");
    let w = Tensor::zeros((200, 300), DType::F32, &cpu())?;
    init::xavier_uniform_(&w, 1.0)?;
    let bound = (6.0f32 / 500.0).sqrt();
    let v = w.to_vec::<f32>()?;
    assert!(v.iter().all(|x| x.abs() <= bound) && v.iter().any(|x| x.abs() > 0.9 * bound));
    init::normal_(&w, 0.0, 0.01)?;
    let std = (w.sqr()?.mean_all()?.to_scalar::<f32>()?).sqrt();
    assert!((std - 0.01).abs() < 0.0005, "std {std}");
    init::xavier_normal_(&w, 1.0)?;
    let std = (w.sqr()?.mean_all()?.to_scalar::<f32>()?).sqrt();
    assert!((std - (2.0f32 / 500.0).sqrt()).abs() < 0.003, "std {std}");
    init::constant_(&w, 3.0)?;
    assert_eq!(w.sum_all()?.to_scalar::<f32>()?, 3.0 * 60000.0);
    Ok(())
}

#[test]
fn sequential_indexes_layers_and_names_parameters() -> Result<()> {
    let net = Sequential::new().add(Linear::new(4, 8, &cpu())?).add(ReLU).add(Linear::new(8, 2, &cpu())?).add(Sigmoid);
    assert_eq!(net.len(), 4);
    let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
    assert_eq!(net.num_parameters(), 4 * 8 + 8 + 8 * 2 + 2);
    // The chapter's net[0].weight.data.device
    assert_eq!(net[0].parameter("weight")?.device(), cpu());
    assert!(net[1].named_parameters().is_empty());
    assert!(net.get(9).is_none());
    // Parameters are shared, not copied: writing through one is seen by the net.
    init::zeros_(&net.parameter("2.bias")?)?;
    assert_eq!(net[2].parameter("bias")?.to_vec::<f32>()?, vec![0., 0.]);
    let y = net.forward(&Tensor::ones((3, 4), DType::F32, &cpu())?)?;
    assert_eq!(y.dims(), &[3, 2]);
    assert!(y.to_vec::<f32>()?.iter().all(|v| (0.0..=1.0).contains(v)));
    assert!(net.parameter("5.weight").is_err());
    Ok(())
}

#[test]
fn activations_flatten_and_dropout() -> Result<()> {
    let x = Tensor::new(&[-2f32, 0., 3.], &cpu())?;
    assert_eq!(ReLU.forward(&x)?.to_vec::<f32>()?, vec![0., 0., 3.]);
    assert_eq!(Sigmoid.forward(&x)?.to_vec::<f32>()?[1], 0.5);
    assert_eq!(Tanh.forward(&x)?.to_vec::<f32>()?[1], 0.0);
    assert_eq!(Flatten.forward(&Tensor::zeros((2, 3, 4), DType::F32, &cpu())?)?.dims(), &[2, 12]);
    assert!(Dropout::new(1.0).is_err());
    let mut d = Dropout::new(0.25)?;
    kiln::manual_seed(3);
    let ones = Tensor::ones((10000,), DType::F32, &cpu())?;
    let y = d.forward(&ones)?.to_vec::<f32>()?;
    let kept = y.iter().filter(|&&v| v != 0.0).count();
    assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
    assert!((7200..7800).contains(&kept), "kept {kept} of 10000 at p = 0.25");
    let mut net = Sequential::new().add(Dropout::new(0.5)?);
    net.eval();
    assert_eq!(net.forward(&ones)?.to_vec::<f32>()?, vec![1.0; 10000], "evaluation mode is the identity");
    d.eval();
    assert!(!d.is_training());
    Ok(())
}

#[test]
fn losses_have_exact_values_and_are_stable() -> Result<()> {
    let p = Tensor::new(&[[1f32], [2.], [3.]], &cpu())?;
    let y = Tensor::new(&[[1f32], [0.], [5.]], &cpu())?;
    assert_eq!(mse_loss(&p, &y)?.to_scalar::<f32>()?, 8.0 / 3.0);
    assert!(mse_loss(&p, &Tensor::zeros((4, 1), DType::F32, &cpu())?).is_err(), "never broadcast (3,1) against (4,1)");
    // Logits of 1000 would overflow exp without the max shift.
    let logits = Tensor::new(&[[1000f32, 0.], [0., 1000.]], &cpu())?;
    let labels = Tensor::new(&[0i64, 0], &cpu())?;
    let ce = cross_entropy(&logits, &labels)?.to_scalar::<f32>()?;
    assert!((ce - 500.0).abs() < 1e-3 && ce.is_finite(), "ce {ce}");
    let ls = log_softmax(&Tensor::new(&[[0f32, 0., 0., 0.]], &cpu())?, -1)?.to_vec::<f32>()?;
    assert!(ls.iter().all(|v| (v + 4f32.ln()).abs() < 1e-6));
    assert_eq!(accuracy(&logits, &labels)?.to_scalar::<f32>()?, 0.5);
    assert!(cross_entropy(&logits, &Tensor::new(&[0f32, 0.], &cpu())?).is_err(), "labels must be i64");
    assert!(cross_entropy(&logits, &Tensor::new(&[0i64], &cpu())?).is_err(), "one label per row");
    Ok(())
}

// ---- devices --------------------------------------------------------------

#[test]
fn to_moves_what_is_elsewhere_and_keeps_what_is_there() -> Result<()> {
    for (a, b) in gpu_pairs() {
        to_moves_between(a, b)?;
        ran(&[a, b]);
    }
    Ok(())
}

fn to_moves_between(a: Device, b: Device) -> Result<()> {
    let gpus = [a, b];
    let mut net = Sequential::new().add(Linear::new(2, 3, &cpu())?).add(Linear::new(3, 1, &gpus[0])?);
    let before: Vec<Tensor> = net.parameters();
    net.to(&gpus[0])?;
    let after = net.parameters();
    assert!(after.iter().all(|p| p.device() == gpus[0] && p.requires_grad() && p.is_leaf()));
    assert!(!after[0].same_storage(&before[0]), "moved from the CPU: a new tensor");
    assert!(after[2].same_storage(&before[2]) && after[3].same_storage(&before[3]), "already there: the very same tensor");
    assert_eq!(after[0].to_vec::<f32>()?, before[0].to_vec::<f32>()?);
    assert_eq!(net.devices(), vec![gpus[0]]);
    let y = net.forward(&Tensor::ones((4, 2), DType::F32, &gpus[0])?)?;
    assert_eq!(y.device(), gpus[0]);
    // Gradients land on the parameters' device.
    y.sum_all()?.backward()?;
    assert!(net.parameters().iter().all(|p| p.grad().map(|g| g.device()) == Some(gpus[0])));
    net.to(&gpus[1])?;
    assert_eq!(net.devices(), vec![gpus[1]]);
    Ok(())
}

#[test]
fn forward_with_input_elsewhere_names_the_parameter() -> Result<()> {
    for (a, b) in gpu_pairs() {
        forward_with_input_elsewhere_on(a, b)?;
        ran(&[a, b]);
    }
    Ok(())
}

fn forward_with_input_elsewhere_on(a: Device, b: Device) -> Result<()> {
    let gpus = [a, b];
    let mut net = Sequential::new().add(LazyLinear::new(1));
    // LazyLinear creates its parameters on the input's device.
    net.forward(&Tensor::ones((2, 3), DType::F32, &gpus[0])?)?;
    assert_eq!(net[0].parameter("weight")?.device(), gpus[0]);
    assert_eq!(net[0].parameter("weight")?.dims(), &[1, 3]);
    let err = net.forward(&Tensor::ones((2, 3), DType::F32, &cpu())?).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { lhs: Device::Cpu, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&format!("input is on cpu while layer 0 weight is on {}", gpus[0])), "{msg}");
    // Deeper layers are named by their index.
    let mut deep = Sequential::new().add(ReLU).add(Linear::new(3, 1, &gpus[1])?);
    let msg = deep.forward(&Tensor::ones((2, 3), DType::F32, &cpu())?).unwrap_err().to_string();
    assert!(msg.contains(&format!("input is on cpu while layer 1 weight is on {}", gpus[1])), "{msg}");
    // After moving the model, the same input works.
    deep.to(&cpu())?;
    assert_eq!(deep.forward(&Tensor::ones((2, 3), DType::F32, &cpu())?)?.device(), cpu());
    net.to(&cpu())?;
    assert_eq!(net.forward(&Tensor::ones((2, 3), DType::F32, &cpu())?)?.device(), cpu());
    Ok(())
}

/// The chapter's model "from scratch": plain tensors as parameters.
struct ScratchRegression {
    w: Tensor,
    b: Tensor,
}

impl Module for ScratchRegression {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.w)?.add(&self.b)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("w".into(), self.w.clone()), ("b".into(), self.b.clone())]
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("w", &mut self.w)?;
        f("b", &mut self.b)
    }
}

fn scratch() -> Result<ScratchRegression> {
    Ok(ScratchRegression {
        w: Tensor::randn_with(0.0, 0.01, (2, 1), DType::F32, &cpu())?.requires_grad_(),
        b: Tensor::zeros(1, DType::F32, &cpu())?.requires_grad_(),
    })
}

#[test]
fn scratch_models_move_to_a_device_too() -> Result<()> {
    for gpu in gpus() {
        let mut m = scratch()?;
        let w_before = m.w.to_vec::<f32>()?;
        m.to(&gpu)?;
        assert_eq!((m.w.device(), m.b.device()), (gpu, gpu));
        assert!(m.w.is_leaf() && m.b.is_leaf());
        assert_eq!(m.w.to_vec::<f32>()?, w_before);
        let kept = m.w.clone();
        m.to(&gpu)?;
        assert!(m.w.same_storage(&kept));
        ran(&[gpu]);
    }
    Ok(())
}

// ---- optimizers -----------------------------------------------------------

#[test]
fn sgd_updates_in_place_with_momentum_and_weight_decay() -> Result<()> {
    for device in std::iter::once(cpu()).chain(gpus()) {
        let w = Tensor::new(&[1f32, -2.], &device)?.requires_grad_();
        let alias = w.clone();
        let mut opt = Sgd::new(vec![w.clone()], 0.1);
        w.sqr()?.sum_all()?.backward()?; // g = 2w = [2, -4]
        opt.step()?;
        assert_eq!(w.to_vec::<f32>()?, vec![0.8, -1.6]);
        assert!(alias.same_storage(&w) && w.device() == device, "updated in place on {device}");
        assert!(!w.grad().map(|g| g.requires_grad()).unwrap_or(true), "the update records nothing");
        opt.zero_grad();
        assert!(w.grad().is_none());
        // No gradient: the step skips the parameter.
        opt.step()?;
        assert_eq!(w.to_vec::<f32>()?, vec![0.8, -1.6]);
        ran(&[device]);
    }
    // Momentum 0.9: v1 = g1, v2 = 0.9 v1 + g2, with a constant gradient 1.
    let p = Tensor::new(&[0f32], &cpu())?.requires_grad_();
    let mut opt = Sgd::new(vec![p.clone()], 0.5).momentum(0.9);
    for _ in 0..2 {
        opt.zero_grad();
        p.sum_all()?.backward()?;
        opt.step()?;
    }
    assert!((p.to_vec::<f32>()?[0] - (-0.5 - 0.5 * 1.9)).abs() < 1e-6);
    // Weight decay 0.1 on p = 2 with g = 1: p ← 2 − 0.5·(1 + 0.2) = 1.4.
    let p = Tensor::new(&[2f32], &cpu())?.requires_grad_();
    let mut opt = Sgd::new(vec![p.clone()], 0.5).weight_decay(0.1);
    p.sum_all()?.backward()?;
    opt.step()?;
    assert!((p.to_vec::<f32>()?[0] - 1.4).abs() < 1e-6);
    assert!(Sgd::checked(vec![Tensor::new(&[1f32], &cpu())?], 0.1).is_err(), "a non-parameter is refused");
    Ok(())
}

#[test]
fn adam_first_step_is_lr_times_sign_and_converges() -> Result<()> {
    for device in gpus() {
        adam_on(device)?;
        ran(&[device]);
    }
    Ok(())
}

fn adam_on(device: Device) -> Result<()> {
    let w = Tensor::new(&[3f32, -1.], &device)?.requires_grad_();
    let mut opt = Adam::new(vec![w.clone()], 0.1);
    w.sqr()?.sum_all()?.backward()?;
    opt.step()?;
    // m̂ = g, v̂ = g², so the first update is lr·g/|g| (up to ε).
    let v = w.to_vec::<f32>()?;
    assert!((v[0] - 2.9).abs() < 1e-5 && (v[1] + 0.9).abs() < 1e-5, "{v:?}");
    for _ in 0..300 {
        opt.zero_grad();
        w.sqr()?.sum_all()?.backward()?;
        opt.step()?;
    }
    assert!(w.to_vec::<f32>()?.iter().all(|x| x.abs() < 0.05));
    assert_eq!(w.device(), device);
    assert_eq!(opt.learning_rate(), 0.1);
    opt.set_learning_rate(0.01);
    assert_eq!(opt.learning_rate(), 0.01);
    Ok(())
}

// ---- data -----------------------------------------------------------------

#[test]
fn data_loader_batches_shuffles_and_drops_last() -> Result<()> {
    let x = Tensor::arange(0.0, 10.0, 1.0, &cpu())?.reshape((10, 1))?;
    let y = Tensor::arange_dtype(0.0, 10.0, 1.0, DType::I64, &cpu())?;
    let loader = DataLoader::new(vec![x.clone(), y.clone()], 4)?;
    assert_eq!(loader.len(), 3);
    let sizes: Vec<usize> = loader.iter()?.map(|b| b.unwrap()[0].dims()[0]).collect();
    assert_eq!(sizes, [4, 4, 2]);
    let first = loader.iter()?.next().unwrap()?;
    assert!(first[0].same_storage(&x), "unshuffled batches are views");
    assert_eq!(first[1].to_vec::<i64>()?, vec![0, 1, 2, 3]);
    let dl = DataLoader::new(vec![x.clone(), y.clone()], 4)?.drop_last(true);
    assert_eq!(dl.len(), 2);
    assert_eq!(dl.iter()?.count(), 2);

    let sh = DataLoader::new(vec![x.clone(), y.clone()], 3)?.shuffle(true);
    kiln::manual_seed(5);
    let epoch = |l: &DataLoader| -> Vec<i64> { l.iter().unwrap().flat_map(|b| b.unwrap()[1].to_vec::<i64>().unwrap()).collect() };
    let e1 = epoch(&sh);
    let e2 = epoch(&sh);
    let mut sorted = e1.clone();
    sorted.sort();
    assert_eq!(sorted, (0..10).collect::<Vec<i64>>(), "every row exactly once");
    assert_ne!(e1, e2, "a new order each epoch");
    assert_ne!(e1, (0..10).collect::<Vec<i64>>());
    // Features and labels stay paired.
    for b in sh.iter()? {
        let b = b?;
        let xs: Vec<i64> = b[0].to_vec::<f32>()?.iter().map(|&v| v as i64).collect();
        assert_eq!(xs, b[1].to_vec::<i64>()?);
    }
    kiln::manual_seed(5);
    assert_eq!(epoch(&sh), e1, "the global seed makes shuffles reproducible");
    kiln::manual_seed(9);
    let p = permutation(1000);
    assert_eq!(p.iter().collect::<std::collections::HashSet<_>>().len(), 1000);

    assert!(DataLoader::new(vec![x.clone(), Tensor::zeros(9, DType::F32, &cpu())?], 4).is_err(), "row counts differ");
    assert!(DataLoader::new(vec![x.clone()], 0).is_err());
    assert!(DataLoader::new(vec![x, y.to(&sims()[0])?], 4).is_err(), "devices differ");
    Ok(())
}

#[test]
fn synthetic_data_follows_the_book() -> Result<()> {
    kiln::manual_seed(0);
    let (x, y) = make_regression(&[2.0, -3.4], 4.2, 0.01, 2000, &cpu())?;
    assert_eq!((x.dims(), y.dims()), (&[2000usize, 2][..], &[2000usize, 1][..]));
    let xs = x.to_vec2::<f32>()?;
    let ys = y.to_vec::<f32>()?;
    let max_resid = xs.iter().zip(&ys).map(|(r, t)| (t - (2.0 * r[0] - 3.4 * r[1] + 4.2)).abs()).fold(0f32, f32::max);
    assert!(max_resid < 0.06, "noise is N(0, 0.01²): {max_resid}");
    let data = synthetic_regression(1000, 500, 32)?;
    assert_eq!(data.train.num_examples(), 1000);
    assert_eq!(data.val.as_ref().unwrap().num_examples(), 500);
    let cls = synthetic_classification(300, 100, 8, 4, 32)?;
    assert_eq!(cls.train.tensors()[1].dtype(), DType::I64);
    assert_eq!(cls.train.tensors()[0].dims(), &[300, 8]);
    Ok(())
}

// ---- trainer --------------------------------------------------------------

fn regression_model() -> Result<Learner<Linear>> {
    let net = Linear::new(2, 1, &cpu())?;
    init::normal_(&net.weight(), 0.0, 0.01)?;
    init::zeros_(&net.bias().unwrap())?;
    Ok(Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.03)))
}

fn assert_recovers(model: &Learner<Linear>) -> Result<()> {
    let w = model.net.weight().to_vec::<f32>()?;
    let b = model.net.bias().unwrap().to_vec::<f32>()?[0];
    assert!((w[0] - 2.0).abs() < 0.01 && (w[1] + 3.4).abs() < 0.01 && (b - 4.2).abs() < 0.01, "w = {w:?}, b = {b}");
    Ok(())
}

#[test]
fn trainer_recovers_the_linear_model_on_the_cpu() -> Result<()> {
    kiln::manual_seed(0);
    let data = synthetic_regression(1000, 1000, 32)?;
    let mut model = regression_model()?;
    let mut trainer = Trainer::builder().max_epochs(5).progress(Progress::Off).build()?;
    assert!(trainer.gpus().is_empty() && trainer.device() == cpu());
    let history = trainer.fit(&mut model, &data)?;
    assert_eq!(history.epochs.len(), 5);
    assert_eq!(history.device, cpu());
    let losses = history.train_losses();
    assert!(losses[4] < losses[0] && history.last().unwrap().val_loss.unwrap() < 1e-3, "{history:?}");
    assert!(history.last().unwrap().val_metric.is_none() && history.seconds_per_epoch() > 0.0);
    assert_recovers(&model)?;
    assert_eq!(model.net.weight().device(), cpu());
    Ok(())
}

#[test]
fn trainer_recovers_the_linear_model_on_each_gpu_reading_once_per_epoch() -> Result<()> {
    for gpu in gpus() {
        kiln::manual_seed(0);
        let data = synthetic_regression(1000, 1000, 32)?;
        let mut model = regression_model()?;
        let mut trainer = if gpu == kiln::gpu(0) {
            // num_gpus = 1 picks gpu(0), as in the chapter.
            Trainer::builder().max_epochs(5).num_gpus(1)
        } else {
            Trainer::builder().max_epochs(5).device(gpu)
        }
        .progress(Progress::Off)
        .build()?;
        assert_eq!(trainer.device(), gpu);
        let before = kiln::thread_transfer_stats();
        let history = trainer.fit(&mut model, &data)?;
        let moved = kiln::thread_transfer_stats().since(&before);
        // Losses stay on the device: exactly one read per epoch.
        assert_eq!(moved.direction(Direction::DeviceToHost).count, 5, "{}", moved.report(5));
        assert_eq!(history.device, gpu);
        assert!(model.net.parameters().iter().all(|p| p.device() == gpu));
        assert_recovers(&model)?;
        ran(&[gpu]);
    }
    Ok(())
}

#[test]
fn trainer_prepares_batches_and_models_like_the_chapter() -> Result<()> {
    let t = Trainer::builder().max_epochs(1).num_gpus(100).build()?;
    assert_eq!(t.gpus().len(), kiln::num_gpus(), "gpus = first min(num_gpus, num_gpus())");
    let batch = t.prepare_batch(vec![Tensor::ones((2, 2), DType::F32, &cpu())?])?;
    assert_eq!(batch[0].device(), kiln::gpu(0));
    let cpu_trainer = Trainer::builder().max_epochs(1).build()?;
    let x = Tensor::ones((2, 2), DType::F32, &cpu())?;
    assert!(cpu_trainer.prepare_batch(vec![x.clone()])?[0].same_storage(&x), "no GPU: nothing moves");
    for gpu in gpus() {
        let mut m = scratch()?;
        Trainer::builder().max_epochs(1).device(gpu).build()?.prepare_model(&mut m)?;
        assert_eq!((m.w.device(), m.b.device()), (gpu, gpu));
        ran(&[gpu]);
    }
    assert!(Trainer::builder().max_epochs(1).device(kiln::gpu(999)).build().is_err());
    Ok(())
}

#[test]
fn trainer_trains_an_mlp_classifier_to_90_percent_on_each_gpu() -> Result<()> {
    for gpu in gpus() {
        mlp_classifier_on(gpu)?;
        ran(&[gpu]);
    }
    Ok(())
}

fn mlp_classifier_on(gpu: Device) -> Result<()> {
    kiln::manual_seed(1);
    let data = synthetic_classification(2000, 500, 8, 4, 64)?;
    let net = Sequential::new().add(Linear::new(8, 32, &cpu())?).add(ReLU).add(Dropout::new(0.1)?).add(Linear::new(32, 4, &cpu())?);
    let mut model = Learner::new(net, Loss::CrossEntropy, OptimizerConfig::adam(0.01));
    let mut trainer = Trainer::builder().max_epochs(8).device(gpu).gradient_clip_val(1.0).progress(Progress::Off).build()?;
    let history = trainer.fit(&mut model, &data)?;
    let acc = history.last().unwrap().val_metric.unwrap();
    assert_eq!(history.metric_name.as_deref(), Some("accuracy"));
    assert!(acc >= 0.90, "validation accuracy {acc}: {history:?}");
    assert!(history.train_losses()[7] < history.train_losses()[0]);
    Ok(())
}

#[test]
fn gradient_clipping_bounds_each_step() -> Result<()> {
    kiln::manual_seed(0);
    let data = synthetic_regression(320, 0, 32)?;
    let mut model = regression_model()?;
    let before = model.net.weight().to_vec::<f32>()?;
    // Each step moves the parameters by at most lr · clip = 0.03 · 0.01.
    let mut trainer = Trainer::builder().max_epochs(1).gradient_clip_val(0.01).progress(Progress::Off).build()?;
    trainer.fit(&mut model, &data)?;
    let after = model.net.weight().to_vec::<f32>()?;
    let moved: f32 = before.iter().zip(&after).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt();
    assert!(moved <= 10.0 * 0.03 * 0.01 + 1e-6 && moved > 0.0, "moved {moved}");
    Ok(())
}

#[cfg(feature = "plot")]
#[test]
fn history_plots_to_png() -> Result<()> {
    let dir = temp_dir("plot");
    let path = dir.join("loss.png");
    kiln::manual_seed(0);
    let data = synthetic_regression(256, 64, 32)?;
    let mut model = regression_model()?;
    Trainer::builder().max_epochs(2).progress(Progress::Off).plot_to(&path).build()?.fit(&mut model, &data)?;
    let bytes = std::fs::read(&path).map_err(|e| Error::Io { path: path.display().to_string(), msg: e.to_string() })?;
    assert!(bytes.starts_with(&[0x89, b'P', b'N', b'G']));
    // A whole image that decodes, with the train-loss curve drawn in blue
    // on white, and nothing else left in the folder (the temporary file
    // the plot is written through is renamed over the path).
    let mut reader = png::Decoder::new(std::io::Cursor::new(&bytes)).read_info().expect("the plot decodes as a PNG");
    let mut rgb = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut rgb).expect("the plot's pixels decode");
    assert_eq!((info.width, info.height, info.color_type, info.bit_depth), (640, 420, png::ColorType::Rgb, png::BitDepth::Eight));
    let pixels: Vec<&[u8]> = rgb[..info.buffer_size()].chunks(3).collect();
    let white = pixels.iter().filter(|p| **p == [255, 255, 255]).count();
    let blue = pixels.iter().filter(|p| p[2] > 200 && p[0] < 60 && p[1] < 60).count();
    assert!(white > pixels.len() / 2, "a white background: {white} of {} pixels", pixels.len());
    assert!(blue > 100, "the train-loss curve is drawn: {blue} blue pixels");
    let files: Vec<_> = std::fs::read_dir(&dir).expect("read the plot's folder").map(|e| e.expect("entry").file_name()).collect();
    assert_eq!(files, [std::ffi::OsString::from("loss.png")]);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// ---- checkpoints ----------------------------------------------------------

fn two_layer(device: &Device) -> Result<Sequential> {
    Ok(Sequential::new().add(Linear::new(3, 4, device)?).add(Tanh).add(Linear::new(4, 2, device)?))
}

fn values(m: &dyn Module) -> Vec<Vec<f32>> {
    m.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
}

#[test]
fn checkpoints_round_trip_onto_a_chosen_device() -> Result<()> {
    for (a, b) in gpu_pairs() {
        checkpoints_round_trip_between(a, b)?;
        ran(&[a, b]);
    }
    Ok(())
}

fn checkpoints_round_trip_between(a: Device, b: Device) -> Result<()> {
    let gpus = [a, b];
    let dir = temp_dir("ckpt");
    let path = dir.join("net.safetensors");
    // Saved from a GPU: parameters are read and written.
    let net = two_layer(&gpus[0])?;
    checkpoint::save(&net, &path)?;
    assert!(!checkpoint::temp_path(&path).exists(), "the temporary file was renamed");
    // Loaded into a CPU model, straight onto gpu(1).
    let mut other = two_layer(&cpu())?;
    checkpoint::load(&mut other, &path, &gpus[1])?;
    assert_eq!(other.devices(), vec![gpus[1]]);
    assert!(other.parameters().iter().all(|p| p.is_leaf()));
    assert_eq!(values(&other), values(&net));
    // Loading where the parameters already are writes in place (same tensors).
    let mut same = two_layer(&cpu())?;
    let kept = same.parameters();
    checkpoint::load(&mut same, &path, &cpu())?;
    assert!(same.parameters().iter().zip(&kept).all(|(a, b)| a.same_storage(b)));
    assert_eq!(values(&same), values(&net));
    let all = checkpoint::load_tensors(&path, &cpu())?;
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), 4);
    assert!(names.contains(&"0.weight") && names.contains(&"2.bias"));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn an_interrupted_save_leaves_the_old_checkpoint() -> Result<()> {
    let dir = temp_dir("atomic");
    let path = dir.join("net.safetensors");
    let old = two_layer(&cpu())?;
    checkpoint::save(&old, &path)?;
    let old_bytes = std::fs::read(&path).unwrap();
    // Block the temporary file with a directory: the save fails before the rename.
    std::fs::create_dir_all(checkpoint::temp_path(&path)).unwrap();
    let err = checkpoint::save(&two_layer(&cpu())?, &path).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_eq!(std::fs::read(&path).unwrap(), old_bytes, "the previous checkpoint is intact");
    let mut m = two_layer(&cpu())?;
    checkpoint::load(&mut m, &path, &cpu())?;
    assert_eq!(values(&m), values(&old));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn bad_checkpoints_are_typed_errors_naming_the_tensor_and_change_nothing() -> Result<()> {
    let dir = temp_dir("bad");
    let good = dir.join("good.safetensors");
    checkpoint::save(&two_layer(&cpu())?, &good)?;
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, data: &[u8]| {
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().write_all(data).unwrap();
        p
    };
    let mut model = two_layer(&cpu())?;
    let snapshot = values(&model);
    let kept = model.parameters();
    let expect_format = |err: Error, needle: &str| match &err {
        Error::Format { msg, .. } => assert!(msg.contains(needle), "`{needle}` not in: {msg}"),
        other => panic!("expected a Format error, got {other:?}"),
    };
    // Corrupt: garbage bytes.
    let p = write("garbage.safetensors", b"this is not a checkpoint at all");
    expect_format(checkpoint::load(&mut model, &p, &cpu()).unwrap_err(), "safetensors");
    // Truncated: the header promises more data than the file has.
    let p = write("truncated.safetensors", &bytes[..bytes.len() - 10]);
    expect_format(checkpoint::load(&mut model, &p, &cpu()).unwrap_err(), "safetensors");
    // Missing tensor: a model without the second layer's bias.
    let partial: Vec<(String, Tensor)> = model.named_parameters().into_iter().filter(|(n, _)| n != "2.bias").collect();
    let p = dir.join("missing.safetensors");
    checkpoint::save_tensors(&partial, &p)?;
    expect_format(checkpoint::load(&mut model, &p, &cpu()).unwrap_err(), "`2.bias` is missing");
    // Wrong shape.
    let p = dir.join("shape.safetensors");
    checkpoint::save(&Sequential::new().add(Linear::new(3, 5, &cpu())?).add(Tanh).add(Linear::new(5, 2, &cpu())?), &p)?;
    expect_format(checkpoint::load(&mut model, &p, &cpu()).unwrap_err(), "`0.weight` has shape [5, 3]");
    // Wrong dtype.
    let f64_model = Sequential::new().add(Linear::with_options(3, 4, true, DType::F64, &cpu())?).add(Tanh).add(Linear::with_options(
        4,
        2,
        true,
        DType::F64,
        &cpu(),
    )?);
    let p = dir.join("dtype.safetensors");
    checkpoint::save(&f64_model, &p)?;
    expect_format(checkpoint::load(&mut model, &p, &cpu()).unwrap_err(), "`0.weight` has dtype F64");
    // An extra tensor.
    let mut extra = model.named_parameters();
    extra.push(("3.weight".into(), Tensor::zeros((1, 1), DType::F32, &cpu())?));
    let p = dir.join("extra.safetensors");
    checkpoint::save_tensors(&extra, &p)?;
    expect_format(checkpoint::load(&mut model, &p, &cpu()).unwrap_err(), "`3.weight`");
    // A missing file is an I/O error naming it.
    let err = checkpoint::load(&mut model, dir.join("nope.safetensors"), &cpu()).unwrap_err();
    assert!(matches!(&err, Error::Io { path, .. } if path.ends_with("nope.safetensors")), "{err:?}");
    // After all that, the model is untouched.
    assert_eq!(values(&model), snapshot);
    assert!(model.parameters().iter().zip(&kept).all(|(a, b)| a.same_storage(b)));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// ---- IDX files ------------------------------------------------------------

fn idx_bytes(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut v = vec![0u8, 0, 0x08, dims.len() as u8];
    for d in dims {
        v.extend(d.to_be_bytes());
    }
    v.extend(data);
    v
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

#[test]
fn fashion_mnist_reads_idx_files_gzipped_or_not() -> Result<()> {
    let dir = temp_dir("idx");
    let (n, h, w) = (3u32, 4u32, 5u32);
    let pixels: Vec<u8> = (0..n * h * w).map(|i| (i * 4 % 256) as u8).collect();
    let labels = [7u8, 0, 9];
    // Training files gzipped, test files raw.
    std::fs::write(dir.join("train-images-idx3-ubyte.gz"), gzip(&idx_bytes(&[n, h, w], &pixels))).unwrap();
    std::fs::write(dir.join("train-labels-idx1-ubyte.gz"), gzip(&idx_bytes(&[n], &labels))).unwrap();
    std::fs::write(dir.join("t10k-images-idx3-ubyte"), idx_bytes(&[1, h, w], &pixels[..20])).unwrap();
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), idx_bytes(&[1], &[4])).unwrap();

    let (x, y) = kiln::data::load_fashion_mnist(&dir, true, &cpu())?;
    assert_eq!(x.dims(), &[3, 1, 4, 5]);
    let xv = x.to_vec::<f32>()?;
    assert_eq!(xv[1], 4.0 / 255.0);
    assert_eq!(xv[59], 236.0 / 255.0); // (59 * 4) mod 256
    assert_eq!(y.to_vec::<i64>()?, vec![7, 0, 9]);
    for gpu in gpus() {
        let (xt, yt) = kiln::data::load_fashion_mnist(&dir, false, &gpu)?;
        assert_eq!((xt.dims(), xt.device(), yt.device()), (&[1usize, 1, 4, 5][..], gpu, gpu));
        assert_eq!(xt.to_vec::<f32>()?, pixels[..20].iter().map(|&p| p as f32 / 255.0).collect::<Vec<_>>());
        assert_eq!(yt.to_vec::<i64>()?, vec![4]);
        ran(&[gpu]);
    }
    let module: DataModule = kiln::data::fashion_mnist(&dir, 2)?;
    assert_eq!((module.train.len(), module.val.as_ref().unwrap().len()), (2, 1));
    assert_eq!(read_idx(dir.join("t10k-labels-idx1-ubyte"))?.dims, vec![1]);

    // A missing file is named.
    std::fs::remove_file(dir.join("t10k-labels-idx1-ubyte")).unwrap();
    let err = kiln::data::load_fashion_mnist(&dir, false, &cpu()).unwrap_err();
    assert!(matches!(&err, Error::Io { path, .. } if path.contains("t10k-labels-idx1-ubyte")), "{err:?}");
    assert!(err.to_string().contains("downloads nothing"), "{err}");
    // Truncated data, a bad magic number, and labels that do not match.
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), idx_bytes(&[5], &[1, 2])).unwrap();
    let err = kiln::data::load_fashion_mnist(&dir, false, &cpu()).unwrap_err();
    assert!(matches!(&err, Error::Format { msg, .. } if msg.contains("truncated")), "{err:?}");
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), b"\x01\x02\x08\x01").unwrap();
    assert!(matches!(read_idx(dir.join("t10k-labels-idx1-ubyte")), Err(Error::Format { .. })));
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), idx_bytes(&[2], &[1, 2])).unwrap();
    let err = kiln::data::load_fashion_mnist(&dir, false, &cpu()).unwrap_err();
    assert!(matches!(&err, Error::Format { msg, .. } if msg.contains("2 labels for 1 images")), "{err:?}");
    std::fs::write(dir.join("bad.gz"), [0x1f, 0x8b, 1, 2, 3]).unwrap();
    assert!(matches!(read_idx(dir.join("bad.gz")), Err(Error::Format { .. })));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// ---- lazy models: init_lazy, checkpoints, dtypes; apply and init_cnn -------

/// A model of lazy layers has no parameters before its first forward:
/// `checkpoint::load` into it names the first tensor of the file in sorted
/// order (the same on every run: the header's order is a hash map's) and
/// says what to do, and after `init_lazy` on a sample batch it loads.
#[test]
fn checkpoint_load_into_an_uninitialised_lazy_model_says_to_call_init_lazy() -> Result<()> {
    let lazy = || Sequential::new().add(LazyLinear::new(3)).add(ReLU).add(LazyLinear::new(1));
    let path = std::env::temp_dir().join(format!("kiln-nn-lazy-{}.safetensors", std::process::id()));
    let x = Tensor::ones((2, 4), DType::F32, &cpu())?;
    let mut trained = lazy();
    trained.init_lazy(&x)?;
    checkpoint::save(&trained, &path)?;
    for _ in 0..8 {
        let mut fresh = lazy();
        let msg = checkpoint::load(&mut fresh, &path, &cpu()).unwrap_err().to_string();
        assert!(msg.contains("tensor `0.bias`"), "{msg}");
        assert!(msg.contains("lazy layers") && msg.contains("init_lazy(&x)"), "{msg}");
        assert!(fresh.named_parameters().is_empty());
    }
    for d in common::devices() {
        let mut fresh = lazy();
        fresh.init_lazy(&x.to(&d)?)?;
        assert_eq!(fresh.devices(), vec![d]);
        checkpoint::load(&mut fresh, &path, &d)?;
        for ((n, a), (_, b)) in fresh.named_parameters().into_iter().zip(trained.named_parameters()) {
            assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?, "{n} on {d}");
        }
    }
    std::fs::remove_file(&path).ok();
    Ok(())
}

/// init_lazy runs without gradients, in evaluation mode (no dropout draw),
/// leaves a model without lazy layers untouched, and the Trainer's message
/// for a lazy model names it too.
#[test]
fn init_lazy_creates_parameters_without_a_graph_or_a_random_draw_beyond_the_weights() -> Result<()> {
    let x = Tensor::ones((5, 4), DType::F32, &cpu())?;
    let mut net = Sequential::new().add(Dropout::new(0.5)?).add(LazyLinear::new(2));
    assert!(net.has_lazy_parameters());
    net.init_lazy(&x)?;
    assert!(!net.has_lazy_parameters());
    let w = net.parameter("1.weight")?;
    assert!(w.requires_grad() && w.grad().is_none());
    assert_eq!(w.dims(), &[2, 4]);
    // No lazy layer: nothing runs (a wrong shape is not even seen).
    let mut plain = Linear::new(4, 2, &cpu())?;
    plain.init_lazy(&Tensor::ones((1, 9), DType::F32, &cpu())?)?;
    let mut model = Learner::new(Sequential::new().add(LazyLinear::new(2)), Loss::Mse, OptimizerConfig::sgd(0.1));
    let path = std::env::temp_dir().join(format!("kiln-nn-lazy-trainer-{}.safetensors", std::process::id()));
    let msg = Trainer::builder().max_epochs(1).build()?.load_checkpoint(&mut model, &path).unwrap_err().to_string();
    assert!(msg.contains("init_lazy(&x)"), "{msg}");
    Ok(())
}

/// Shape errors that have nothing to broadcast say what relation the
/// shapes must have, without the broadcasting hint; a broadcast keeps it.
#[test]
fn shape_errors_of_losses_and_the_loader_state_the_rule_without_a_broadcasting_hint() -> Result<()> {
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    let pred = Tensor::zeros((2, 3), DType::F32, &cpu())?;
    let m = msg(mse_loss(&pred, &Tensor::zeros(5, DType::F32, &cpu())?));
    assert!(m.starts_with("mse_loss") && m.contains("number of elements (6 and 5)") && !m.contains("broadcast"), "{m}");
    let m = msg(cross_entropy(&Tensor::zeros((4, 3), DType::F32, &cpu())?, &Tensor::zeros(3, DType::I64, &cpu())?));
    assert!(m.contains("one label per row of the logits (4 rows, 3 labels)") && !m.contains("broadcast"), "{m}");
    let loader = DataLoader::new(vec![Tensor::zeros((5, 2), DType::F32, &cpu())?, Tensor::zeros(4, DType::I64, &cpu())?], 2);
    let m = loader.unwrap_err().to_string();
    assert!(m.contains("same number of rows") && m.contains("tensor 1 has 4 rows") && !m.contains("broadcast"), "{m}");
    let linear = Linear::new(3, 1, &cpu())?;
    let m = msg(linear.forward(&Tensor::zeros((2, 4), DType::F32, &cpu())?));
    assert!(m.contains("last dimension must be 3") && !m.contains("broadcast"), "{m}");
    // Genuine broadcasts keep the hint.
    let m = msg(pred.add(&Tensor::zeros(4, DType::F32, &cpu())?));
    assert!(m.contains("broadcasting needs each trailing dimension to be equal or 1"), "{m}");
    let m = msg(pred.broadcast_to((4, 3)));
    assert!(m.contains("broadcasting needs"), "{m}");
    Ok(())
}

/// A lazy layer makes its weights in its input's dtype: an integer input is
/// refused by name, with the conversion to make, instead of failing in a
/// `rand` the user never called (PyTorch's convolution refuses a uint8
/// input too).
#[test]
fn a_lazy_layer_refuses_an_integer_input_naming_itself_and_the_conversion() -> Result<()> {
    let images = Tensor::zeros((2, 1, 28, 28), DType::U8, &cpu())?;
    let net = kiln::models::lenet(10);
    let m = net.forward(&images).unwrap_err().to_string();
    assert!(m.contains("LazyConv2d") && m.contains("u8") && m.contains(".to_dtype(kiln::DType::F32)") && !m.contains("rand"), "{m}");
    assert!(net.has_lazy_parameters());
    net.forward(&images.to_dtype(DType::F32)?)?;
    let m = LazyLinear::new(2).forward(&Tensor::zeros((2, 3), DType::I64, &cpu())?).unwrap_err().to_string();
    assert!(m.contains("LazyLinear") && m.contains("i64") && m.contains("to_dtype"), "{m}");
    let m = kiln::nn::LazyBatchNorm1d::new().forward(&Tensor::zeros((2, 3), DType::I32, &cpu())?).unwrap_err().to_string();
    assert!(m.contains("LazyBatchNorm") && m.contains("i32"), "{m}");
    Ok(())
}

/// `apply` visits every submodule, children before parents (PyTorch's
/// `nn.Module.apply`), and `init_cnn` gives Linear and Conv2d weights
/// Xavier-uniform values, U(±√(6 / (fan_in + fan_out))) with PyTorch's
/// fans, leaving biases as they were.
#[test]
fn apply_walks_every_layer_and_init_cnn_is_pytorchs_xavier_uniform() -> Result<()> {
    use kiln::nn::{init_cnn, Conv2d};
    kiln::manual_seed(5);
    let inner = Sequential::new().add(Linear::new(400, 120, &cpu())?).add(Sigmoid);
    let net = Sequential::new().add(Conv2d::new(3, 16, (5, 3), kiln::Conv2dArgs::default(), &cpu())?).add(inner).add(Flatten);
    let mut seen = Vec::new();
    net.apply(&mut |m| {
        seen.push(m.describe().split('(').next().unwrap_or("").to_string());
        Ok(())
    })?;
    assert_eq!(seen, ["Conv2d", "Linear", "Sigmoid", "Sequential", "Flatten", "Sequential"]);
    let biases: Vec<Vec<f32>> =
        [net.parameter("0.bias")?, net.parameter("1.0.bias")?].iter().map(|b| b.to_vec::<f32>()).collect::<Result<_>>()?;
    net.apply(&mut init_cnn)?;
    for (name, fan_in, fan_out) in [("0.weight", 3 * 15, 16 * 15), ("1.0.weight", 400, 120)] {
        let w = net.parameter(name)?.to_vec::<f32>()?;
        let a = (6.0 / (fan_in + fan_out) as f64).sqrt();
        let max = w.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        let var = w.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / w.len() as f64;
        assert!(max <= a && max > 0.95 * a, "{name}: max |w| {max}, bound {a}");
        assert!((var / (a * a / 3.0) - 1.0).abs() < 0.1, "{name}: variance {var}, U(±{a}) has {}", a * a / 3.0);
    }
    let after: Vec<Vec<f32>> =
        [net.parameter("0.bias")?, net.parameter("1.0.bias")?].iter().map(|b| b.to_vec::<f32>()).collect::<Result<_>>()?;
    assert_eq!(biases, after);
    // A lazy layer is visited through the layer it made; before, init_cnn says what to do.
    let mut lazy = Sequential::new().add(LazyLinear::new(3));
    let m = lazy.apply(&mut init_cnn).unwrap_err().to_string();
    assert!(m.contains("LazyLinear") && m.contains("init_lazy"), "{m}");
    lazy.init_lazy(&Tensor::ones((1, 5), DType::F32, &cpu())?)?;
    lazy.apply(&mut init_cnn)?;
    let a = (6.0f32 / 8.0).sqrt();
    assert!(lazy.parameter("0.weight")?.to_vec::<f32>()?.iter().all(|w| w.abs() <= a));
    let mut linears = 0;
    kiln::nn::apply(&lazy[0], &mut |m| {
        linears += usize::from(m.as_any().is_some_and(|a| a.is::<Linear>()));
        Ok(())
    })?;
    assert_eq!(linears, 1);
    Ok(())
}

/// A 10×100 parameter of `dtype` on `d` (spread values of both signs), and
/// a copy of it that a test updates with tensor ops.
fn parameter_and_reference(d: &Device, dtype: DType) -> Result<(Tensor, Tensor)> {
    let init: Vec<f64> = (0..1000).map(|i| ((i * 37 % 101) as f64 - 50.0) / 17.0).collect();
    let p = Tensor::from_vec(init.clone(), (10, 100), d)?.to_dtype(dtype)?.requires_grad_();
    Ok((p, Tensor::from_vec(init, (10, 100), d)?.to_dtype(dtype)?))
}

/// Backward of loss = Σ p³/3 + Σ step·p (grad = p² + step), and the
/// gradient an optimizer with weight decay `wd` steps by: g + λ·reference.
fn decayed_gradient(p: &Tensor, reference: &Tensor, step: i32, wd: f64, d: &Device) -> Result<Tensor> {
    p.powi(3)?.div_scalar(3.0)?.add(&p.mul_scalar(step as f64)?)?.sum_all()?.backward()?;
    let g = p.grad().expect("a gradient").copy_to(d)?;
    if wd != 0.0 {
        g.add(&reference.mul_scalar(wd)?)
    } else {
        Ok(g)
    }
}

/// Adam's step (three kernels per parameter) gives the bits of its formula
/// written with tensor ops (g' = g + λ·p, m = β₁·m + (1−β₁)·g',
/// v = β₂·v + (1−β₂)·g'², p − m / (√(v / c₂) + ε) · lr / c₁), over three
/// steps with and without weight decay, in f32 and f64, on every device; a
/// parameter listed twice steps once, and a view at an offset changes only
/// its own elements.
#[test]
fn adam_steps_give_the_bits_of_the_same_update_written_with_tensor_ops() -> Result<()> {
    for d in common::devices() {
        common::report_ran(d);
        for dtype in [DType::F32, DType::F64] {
            for (lr, (b1, b2), eps, wd) in [(0.1, (0.9, 0.999), 1e-8, 0.0), (0.03, (0.8, 0.99), 1e-3, 1e-2)] {
                let (p, mut want) = parameter_and_reference(&d, dtype)?;
                let mut opt = Adam::new(vec![p.clone()], lr).betas(b1, b2).eps(eps).weight_decay(wd);
                let (mut m, mut v): (Option<Tensor>, Option<Tensor>) = (None, None);
                for step in 0..3 {
                    opt.zero_grad();
                    let g = decayed_gradient(&p, &want, step, wd, &d)?;
                    let m1 = match &m {
                        Some(m) => m.mul_scalar(b1)?.add(&g.mul_scalar(1.0 - b1)?)?,
                        None => g.mul_scalar(1.0 - b1)?,
                    };
                    let v1 = match &v {
                        Some(v) => v.mul_scalar(b2)?.add(&g.sqr()?.mul_scalar(1.0 - b2)?)?,
                        None => g.sqr()?.mul_scalar(1.0 - b2)?,
                    };
                    let t = step + 1;
                    let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
                    let denom = v1.div_scalar(c2)?.sqrt()?.add_scalar(eps)?;
                    want = want.sub(&m1.div(&denom)?.mul_scalar(lr / c1)?)?;
                    opt.step()?;
                    let what = format!("{d} {dtype} lr {lr} betas {b1}/{b2} wd {wd}: step {step}");
                    assert_eq!(p.to_vec_f64()?, want.to_vec_f64()?, "{what}: the parameter differs from the tensor ops");
                    let (om, ov) = opt.moments(0);
                    assert_eq!(om.expect("m").to_vec_f64()?, m1.to_vec_f64()?, "{what}: the first moment");
                    assert_eq!(ov.expect("v").to_vec_f64()?, v1.to_vec_f64()?, "{what}: the second moment");
                    (m, v) = (Some(m1), Some(v1));
                }
            }
            let init: Vec<f64> = (0..60).map(|i| ((i * 7 % 13) as f64 - 6.0) / 4.0).collect();
            let fresh = || -> Result<Tensor> { Tensor::from_vec(init.clone(), (6, 10), &d)?.to_dtype(dtype) };
            // One step of Adam from nothing moves every element by about lr
            // (sign of its gradient, 2p): the reference is the composed path
            // of a parameter that is not fused (transposed).
            let t = fresh()?.t()?.requires_grad_();
            t.sqr()?.sum_all()?.backward()?;
            Adam::new(vec![t.clone()], 0.5).step()?;
            let stepped = t.t()?.to_vec_f64()?;
            // A view at an offset (rows 2..4): its rows change as the
            // transposed parameter's did, and the rest of the storage not.
            let base = fresh()?;
            let q = base.narrow(0, 2, 2)?.requires_grad_();
            q.sqr()?.sum_all()?.backward()?;
            Adam::new(vec![q.clone()], 0.5).step()?;
            let all = base.to_vec_f64()?;
            let before = fresh()?.to_vec_f64()?;
            assert_eq!(&all[20..40], &stepped[20..40], "{d} {dtype}: the view's new values");
            assert_eq!((&all[..20], &all[40..]), (&before[..20], &before[40..]), "{d} {dtype}: the rest of the storage");
            // Listed twice: one step, as listed once.
            let r = fresh()?.requires_grad_();
            r.sqr()?.sum_all()?.backward()?;
            Adam::new(vec![r.clone(), r.clone()], 0.5).step()?;
            assert_eq!(r.to_vec_f64()?, stepped, "{d} {dtype}: a parameter listed twice steps once");
        }
    }
    Ok(())
}

/// SGD updates a parameter in its own storage: a parameter that is a view
/// at an offset of a larger storage changes there and nowhere else, a
/// transposed one (not one contiguous run) takes the composed ops, and a
/// parameter listed twice (or two parameters sharing one storage) steps
/// once, from the values before the step, as when listed once; the bits are
/// those of the tensor ops on every device.
#[test]
fn sgd_updates_views_shared_and_strided_parameters_in_their_own_storage() -> Result<()> {
    for d in common::devices() {
        common::report_ran(d);
        for dtype in [DType::F32, DType::F64] {
            let init: Vec<f64> = (0..60).map(|i| ((i * 7 % 13) as f64 - 6.0) / 4.0).collect();
            let grad_of = |p: &Tensor| -> Result<Tensor> {
                p.sqr()?.sum_all()?.backward()?; // grad = 2p
                Ok(p.grad().expect("a gradient"))
            };
            // A view at an offset: rows 2..4 of a 6×10 storage.
            let base = Tensor::from_vec(init.clone(), (6, 10), &d)?.to_dtype(dtype)?;
            let p = base.narrow(0, 2, 2)?.requires_grad_();
            assert!(p.same_storage(&base));
            let g = grad_of(&p)?;
            let want_p = p.detach().sub(&g.mul_scalar(0.25)?)?.to_vec_f64()?;
            Sgd::new(vec![p.clone()], 0.25).weight_decay(0.0).step()?;
            assert_eq!(p.to_vec_f64()?, want_p, "{d} {dtype}: the view's new values");
            let all = base.to_vec_f64()?;
            let want_rest: Vec<f64> = Tensor::from_vec(init.clone(), (6, 10), &d)?.to_dtype(dtype)?.to_vec_f64()?;
            assert_eq!((&all[..20], &all[40..]), (&want_rest[..20], &want_rest[40..]), "{d} {dtype}: the rest of the storage is untouched");
            // A transposed parameter: composed ops, same bits.
            let t = Tensor::from_vec(init.clone(), (6, 10), &d)?.to_dtype(dtype)?.t()?.requires_grad_();
            let g = grad_of(&t)?;
            let want_t = t.detach().sub(&g.mul_scalar(0.25)?)?.to_vec_f64()?;
            Sgd::new(vec![t.clone()], 0.25).step()?;
            assert_eq!(t.to_vec_f64()?, want_t, "{d} {dtype}: a transposed parameter");
            // Listed twice, with momentum: one step from the old values.
            for momentum in [0.0, 0.5] {
                let q = Tensor::from_vec(init.clone(), (60,), &d)?.to_dtype(dtype)?.requires_grad_();
                let g = grad_of(&q)?;
                let want_q = q.detach().sub(&g.mul_scalar(0.25)?)?.to_vec_f64()?;
                Sgd::new(vec![q.clone(), q.clone()], 0.25).momentum(momentum).step()?;
                assert_eq!(q.to_vec_f64()?, want_q, "{d} {dtype} momentum {momentum}: a parameter listed twice steps once");
            }
        }
    }
    Ok(())
}

/// SGD's step (one kernel per parameter, two with momentum) gives the bits
/// of PyTorch's formulation written with tensor ops (g' = g + λ·p,
/// v = μ·v + g', p − lr·v, each rounded to the dtype), over three steps with
/// and without momentum and weight decay, in f32 and f64, on every device.
#[test]
fn sgd_steps_give_the_bits_of_the_same_update_written_with_tensor_ops() -> Result<()> {
    for d in common::devices() {
        common::report_ran(d);
        for dtype in [DType::F32, DType::F64] {
            for (lr, momentum, wd) in [(0.1, 0.0, 0.0), (0.05, 0.9, 0.0), (0.03, 0.0, 1e-2), (0.3, 0.7, 5e-3)] {
                let (p, mut want) = parameter_and_reference(&d, dtype)?;
                let mut opt = Sgd::new(vec![p.clone()], lr).momentum(momentum).weight_decay(wd);
                let mut v: Option<Tensor> = None;
                for step in 0..3 {
                    opt.zero_grad();
                    let mut g = decayed_gradient(&p, &want, step, wd, &d)?;
                    if momentum != 0.0 {
                        let next = match &v {
                            Some(v) => v.mul_scalar(momentum)?.add(&g)?,
                            None => g.clone(),
                        };
                        v = Some(next.clone());
                        g = next;
                    }
                    want = want.sub(&g.mul_scalar(lr)?)?;
                    opt.step()?;
                    let same = p.to_vec_f64()? == want.to_vec_f64()?;
                    assert!(same, "{d} {dtype} lr {lr} momentum {momentum} wd {wd}: step {step} differs from the tensor ops");
                    if momentum != 0.0 {
                        let same = opt.velocity(0).expect("a momentum buffer").to_vec_f64()? == v.as_ref().expect("v").to_vec_f64()?;
                        assert!(same, "{d} {dtype} momentum {momentum} wd {wd}: the momentum buffer at step {step}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// The parameters of [`a_step_over_many_parameters_gives_the_cpus_bits_on_every_device`]
/// on `d`: 62 of them, 52 f32 (more than one multi-tensor launch takes)
/// and 10 f64, of sizes from empty to several chunks, one (the last) a view
/// at an offset of a larger storage, made from the same values on every
/// device.
fn many_parameters(d: &Device) -> Result<(Vec<Tensor>, Tensor)> {
    let sizes = |i: usize| [0, 1, 7, 255, 256, 2049, 4096 + 3, 31][i % 8] + i;
    let mut ps = Vec::new();
    for i in 0..61 {
        let n = sizes(i);
        let init: Vec<f64> = (0..n).map(|j| (((i * 131 + j * 37) % 211) as f64 - 105.0) / 53.0).collect();
        let dtype = if (20..30).contains(&i) { DType::F64 } else { DType::F32 };
        ps.push(Tensor::from_vec(init, n, d)?.to_dtype(dtype)?.requires_grad_());
    }
    // A view of elements 5..505 of a larger storage: only those change.
    let whole = Tensor::from_vec((0..600).map(|j| j as f32 / 300.0).collect::<Vec<_>>(), 600, d)?;
    ps.push(whole.narrow(0, 5, 500)?.detach().requires_grad_());
    Ok((ps, whole))
}

/// The same three steps of SGD (momentum, weight decay) and of Adam over
/// [`many_parameters`] on every device give the CPU's bits: on CUDA the
/// step is one launch per 48 parameters of a dtype (the multi-tensor
/// kernels), elsewhere kernels per parameter. A parameter without a
/// gradient at a step (every seventh, at the second step) keeps its value
/// and state; the view's storage keeps its other elements.
#[test]
fn a_step_over_many_parameters_gives_the_cpus_bits_on_every_device() -> Result<()> {
    /// The parameters' values, the view's whole storage, the state's buffers.
    type Outcome = (Vec<Vec<f64>>, Vec<f64>, Vec<Vec<f64>>);
    fn run(d: &Device, adam: bool) -> Result<Outcome> {
        let (ps, whole) = many_parameters(d)?;
        let mut opt: Box<dyn Optimizer> = if adam {
            Box::new(Adam::new(ps.clone(), 0.05).betas(0.8, 0.99).weight_decay(1e-2))
        } else {
            Box::new(Sgd::new(ps.clone(), 0.05).momentum(0.9).weight_decay(1e-2))
        };
        for step in 0..3 {
            opt.zero_grad();
            for (i, p) in ps.iter().enumerate() {
                if step == 1 && i % 7 == 0 {
                    continue;
                }
                p.sqr()?.mul_scalar(0.5 + step as f64)?.sum_all()?.backward()?;
            }
            opt.step()?;
        }
        let state = opt.state_dict()?;
        let buffers = state.buffers.values().map(|t| t.to_vec_f64()).collect::<Result<Vec<_>>>()?;
        Ok((ps.iter().map(|p| p.to_vec_f64()).collect::<Result<_>>()?, whole.to_vec_f64()?, buffers))
    }
    let want = [run(&cpu(), false)?, run(&cpu(), true)?];
    for d in common::devices() {
        common::report_ran(d);
        for (adam, want) in [false, true].into_iter().zip(&want) {
            let got = run(&d, adam)?;
            let name = if adam { "Adam" } else { "SGD" };
            for (i, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
                let (g, w): (Vec<u64>, Vec<u64>) = (g.iter().map(|x| x.to_bits()).collect(), w.iter().map(|x| x.to_bits()).collect());
                assert_eq!(g, w, "{name} on {d}: parameter {i} differs from the CPU's");
            }
            assert_eq!(got.1, want.1, "{name} on {d}: the view's storage");
            assert_eq!(got.2.len(), want.2.len(), "{name} on {d}: the state's buffers");
            assert!(got.2 == want.2, "{name} on {d}: the state's buffers differ from the CPU's");
        }
    }
    Ok(())
}

/// A gradient that is another parameter's own storage (set by hand) is
/// read before any parameter of the step changes: p₀ steps by p₁'s old
/// value, on every device, with and without momentum.
#[test]
fn a_gradient_that_is_another_parameter_steps_from_its_old_value() -> Result<()> {
    for d in common::devices() {
        common::report_ran(d);
        for momentum in [0.0, 0.5] {
            let p0 = Tensor::new(&[1f32, 2., 3.], &d)?.requires_grad_();
            let p1 = Tensor::new(&[10f32, 20., 30.], &d)?.requires_grad_();
            p0.set_grad(Some(p1.clone()))?;
            p1.set_grad(Some(Tensor::new(&[1f32, 1., 1.], &d)?))?;
            Sgd::new(vec![p0.clone(), p1.clone()], 0.5).momentum(momentum).step()?;
            assert_eq!(p0.to_vec::<f32>()?, vec![-4., -8., -12.], "{d}, momentum {momentum}: p0 steps by p1's old value");
            assert_eq!(p1.to_vec::<f32>()?, vec![9.5, 19.5, 29.5], "{d}, momentum {momentum}");
        }
    }
    Ok(())
}

#[test]
fn cross_entropy_refuses_labels_outside_the_classes() {
    let logits = Tensor::zeros((1, 2), DType::F32, &cpu()).unwrap();
    let labels = Tensor::new(&[5i64], &cpu()).unwrap();
    let err = cross_entropy(&logits, &labels).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("label 5"), "{err}");
}

#[test]
fn a_frozen_parameter_stays_frozen_when_the_model_moves() {
    let gpus = common::sims();
    let mut lin = Linear::new(2, 1, &cpu()).unwrap();
    let frozen = lin.weight().detach();
    lin.visit_parameters_mut(&mut |name, p| {
        if name == "weight" {
            *p = frozen.clone();
        }
        Ok(())
    })
    .unwrap();
    lin.to(&gpus[0]).unwrap();
    let params = lin.named_parameters();
    let weight = &params.iter().find(|(n, _)| n == "weight").unwrap().1;
    let bias = &params.iter().find(|(n, _)| n == "bias").unwrap().1;
    assert_eq!(weight.device(), gpus[0]);
    assert!(!weight.requires_grad(), "a frozen weight became trainable");
    assert!(bias.requires_grad());
}

#[test]
fn a_lazy_layer_remembers_to_and_creates_its_parameters_there() -> Result<()> {
    let g = sims()[0];
    // net = nn.Sequential(nn.LazyLinear(1)); net = net.to(device=try_gpu())
    let mut net = Sequential::new().add(LazyLinear::new(1));
    net.to(&g)?;
    assert!(net.has_lazy_parameters());
    // An input elsewhere is a device mismatch naming the input, as in PyTorch.
    let err = net.forward(&Tensor::ones((2, 3), DType::F32, &cpu())?).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { lhs: Device::Cpu, rhs, .. } if rhs == g), "{err}");
    assert!(net.has_lazy_parameters(), "a failed forward creates nothing");
    let y = net.forward(&Tensor::ones((2, 3), DType::F32, &g)?)?;
    assert_eq!(y.device(), g);
    assert_eq!(net[0].parameter("weight")?.device(), g);
    assert!(!net.has_lazy_parameters());
    Ok(())
}

#[test]
fn optimizers_built_before_to_follow_the_parameters() -> Result<()> {
    let g = sims()[0];
    for adam in [false, true] {
        let mut net = Linear::new(2, 1, &cpu())?;
        let mut opt: Box<dyn Optimizer> =
            if adam { Box::new(Adam::new(net.parameters(), 0.1)) } else { Box::new(Sgd::new(net.parameters(), 0.1).momentum(0.9)) };
        // One step on the CPU (creates momentum state there), then move.
        net.forward(&Tensor::ones((1, 2), DType::F32, &cpu())?)?.sum_all()?.backward()?;
        opt.step()?;
        let handle = net.weight();
        net.to(&g)?;
        // Identity kept: the old handle names the same parameter.
        assert!(handle.same_parameter(&net.weight()) && handle.latest().device() == g);
        assert!(net.weight().grad().is_some_and(|gr| gr.device() == g), "the gradient moved along");
        opt.zero_grad();
        let before = net.weight().to_vec::<f32>()?;
        net.forward(&Tensor::ones((1, 2), DType::F32, &g)?)?.sum_all()?.backward()?;
        opt.step()?;
        let after = net.weight().to_vec::<f32>()?;
        assert_ne!(before, after, "adam={adam}: the optimizer built before `to` updated the moved parameter");
        assert!(opt.parameters().iter().all(|p| p.device() == g));
    }
    Ok(())
}
