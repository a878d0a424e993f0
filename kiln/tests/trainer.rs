//! The Trainer of issue 21: the builder, metrics weighted by examples,
//! optimizer state kept across fits and through checkpoints (resuming gives
//! the very same curve), evaluate and predict, learning-rate schedules,
//! callbacks, the model brought back to the CPU, `DataModule::from_tensors`
//! and its seeded split, the data held on the training device (counted in
//! the ledger) or streamed one batch ahead, and transfers booked at the
//! caller's line. What involves a GPU runs on the two simulated GPUs and
//! every CUDA device present.

mod common;

use kiln::data::{permutation_from_seed, synthetic_classification, synthetic_regression, DataLoader, DataModule, Placement};
use kiln::nn::LazyLinear;
use kiln::nn::{Dropout, Linear, Loss, Module, ParamVisitor, ReLU, Sequential};
use kiln::optim::{Adam, CosineLr, LinearWarmup, LrSchedule, Optimizer, OptimizerConfig, Sgd, StepLr};
use kiln::trainer::{
    BestCheckpoint, Callback, EarlyStopping, EpochEnd, EpochStats, FitStart, History, Learner, Monitor, Progress, Trainer,
};
use kiln::{checkpoint, cpu, thread_transfer_stats, DType, Device, Direction, Error, Result, Tensor, TransferStats};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The CPU, the two simulated GPUs and every CUDA device.
fn devices() -> Vec<Device> {
    common::devices()
}

/// The two simulated GPUs and every CUDA device.
fn gpus() -> Vec<Device> {
    let mut all = common::sims();
    all.extend(common::cuda_devices());
    all
}

fn ran(device: Device) {
    common::report_ran(device);
}

/// A file in the temporary folder, named for this process (no folder of
/// its own: nothing would know when the last test is done with it, and
/// every run used to leave an empty one behind).
fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kiln-trainer-{}-{name}", std::process::id()))
}

fn trainer(epochs: usize, device: Device) -> Result<Trainer> {
    Trainer::builder().max_epochs(epochs).device(device).progress(Progress::Off).build()
}

/// An MLP classifier with dropout (so resuming must restore the generator).
fn mlp(inputs: usize, classes: usize) -> Result<Sequential> {
    Ok(Sequential::new().add(Linear::new(inputs, 16, &cpu())?).add(ReLU).add(Dropout::new(0.2)?).add(Linear::new(16, classes, &cpu())?))
}

fn classifier(seed: u64, optimizer: OptimizerConfig) -> Result<Learner<Sequential>> {
    kiln::manual_seed(seed);
    Ok(Learner::new(mlp(6, 4)?, Loss::CrossEntropy, optimizer))
}

/// 300 training and 100 validation examples; batches of 64, so each
/// epoch ends with a short batch (300 = 4·64 + 44, 100 = 64 + 36).
fn classes() -> Result<DataModule> {
    kiln::manual_seed(7);
    synthetic_classification(300, 100, 6, 4, 64)
}

fn params(m: &dyn Module) -> Result<Vec<Vec<f32>>> {
    m.parameters().iter().map(|p| p.to_vec::<f32>()).collect()
}

/// Everything a fit reported but the time, for exact comparison.
fn curve(h: &History) -> Vec<EpochStats> {
    h.epochs.iter().map(|e| EpochStats { seconds: 0.0, ..e.clone() }).collect()
}

// ---- the builder ----------------------------------------------------------

#[test]
fn the_builder_names_every_setting_and_refuses_nonsense() -> Result<()> {
    let t = Trainer::builder().max_epochs(30).num_gpus(1).gradient_clip_val(0.5).progress(Progress::Off).build()?;
    assert_eq!((t.max_epochs(), t.num_gpus(), t.gradient_clip_val()), (30, kiln::num_gpus().min(1), 0.5));
    assert_eq!(t.device(), kiln::try_gpu(0));
    // Defaults: no GPU, no clipping.
    let t = Trainer::builder().max_epochs(2).build()?;
    assert_eq!((t.num_gpus(), t.gradient_clip_val(), t.device()), (0, 0.0, cpu()));
    let invalid = |r: Result<Trainer>, needle: &str| match r {
        Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains(needle), "{msg}"),
        other => panic!("expected InvalidArgument about {needle}, got {other:?}"),
    };
    invalid(Trainer::builder().num_gpus(1).build(), "max_epochs(10)");
    invalid(Trainer::builder().max_epochs(1).gradient_clip_val(-1.0).build(), "gradient_clip_val");
    invalid(Trainer::builder().max_epochs(1).gradient_clip_val(f64::NAN).build(), "gradient_clip_val");
    invalid(
        Trainer::builder()
            .max_epochs(1)
            .callback(EarlyStopping::new(Monitor::ValLoss, 2))
            .callback(EarlyStopping::new(Monitor::ValLoss, 5))
            .build(),
        "early_stopping_val_loss",
    );
    assert!(matches!(Trainer::builder().max_epochs(1).device(kiln::gpu(99)).build(), Err(Error::NoSuchDevice { .. })));
    // The last of num_gpus and device wins.
    let g = gpus()[0];
    assert_eq!(Trainer::builder().max_epochs(1).num_gpus(0).device(g).build()?.device(), g);
    assert_eq!(Trainer::builder().max_epochs(1).device(g).num_gpus(0).build()?.device(), cpu());
    Ok(())
}

// ---- metrics weighted by examples -----------------------------------------

#[test]
fn metrics_are_means_over_examples_with_a_short_last_batch() -> Result<()> {
    for device in devices() {
        let data = classes()?;
        // lr 0: the parameters do not move, so the epoch's numbers can be
        // recomputed from one pass over all the examples.
        let mut model = classifier(1, OptimizerConfig::sgd(0.0))?;
        let h = trainer(1, device)?.fit(&mut model, &data)?;
        let e = &h.epochs[0];
        let t = trainer(1, device)?;
        let val = data.val.as_ref().unwrap();
        let logits = t.predict(&mut model, val)?.to_vec2::<f32>()?;
        let labels = val.tensors()[1].to_vec::<i64>()?;
        let correct = logits
            .iter()
            .zip(&labels)
            .filter(|&(row, &l)| {
                let best = row.iter().enumerate().fold(0, |b, (i, v)| if *v > row[b] { i } else { b });
                best as i64 == l
            })
            .count();
        assert_eq!(e.val_metric, Some(correct as f64 / 100.0), "on {device}: exact accuracy with the short batch");
        let ev = t.evaluate(&mut model, val)?;
        assert_eq!((ev.correct, ev.examples, ev.metric), (Some(correct as u64), 100, e.val_metric));
        assert_eq!(Some(ev.loss), e.val_loss, "on {device}");
        // The validation loss is the mean over the 100 examples, not the
        // mean of the two batch means.
        let all = kiln::nn::cross_entropy(&Tensor::new(&logits.concat()[..], &cpu())?.reshape((100, 4))?, &val.tensors()[1])?;
        let all = all.to_scalar::<f32>()? as f64;
        assert!((e.val_loss.unwrap() - all).abs() < 1e-6, "on {device}: {} vs {all}", e.val_loss.unwrap());
        ran(device);
    }
    Ok(())
}

#[test]
fn training_loss_weights_each_batch_by_its_examples() -> Result<()> {
    // Rows 0..4 have target 0, row 4 target 10: with batches of 4 the last
    // batch holds one row. Prediction 0 (zero weights, lr 0): per-example
    // squared errors are 0, 0, 0, 0, 100, so the mean over examples is 20
    // (the mean of the batch means would be 50).
    let x = Tensor::zeros((5, 1), DType::F32, &cpu())?;
    let y = Tensor::new(&[[0f32], [0.], [0.], [0.], [10.]], &cpu())?;
    let data = DataModule { train: DataLoader::new(vec![x, y], 4)?, val: None };
    let net = Linear::new(1, 1, &cpu())?;
    kiln::nn::init::zeros_(&net.weight())?;
    kiln::nn::init::zeros_(&net.bias().unwrap())?;
    let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.0));
    let h = trainer(1, cpu())?.fit(&mut model, &data)?;
    assert_eq!(h.epochs[0].train_loss, 20.0);
    assert_eq!(h.epochs[0].train_metric, None);
    Ok(())
}

// ---- optimizer state across fits and checkpoints ---------------------------

#[test]
fn two_fits_train_exactly_as_one_with_adam_and_sgd_momentum() -> Result<()> {
    let configs = [OptimizerConfig::adam(0.01), OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, weight_decay: 1e-4 }];
    for device in devices() {
        for config in configs {
            let data = classes()?;
            let mut whole = classifier(3, config)?;
            let straight = trainer(6, device)?.fit(&mut whole, &data)?;
            let mut split = classifier(3, config)?;
            let mut t = trainer(3, device)?;
            let a = t.fit(&mut split, &data)?;
            let b = t.fit(&mut split, &data)?;
            assert_eq!([curve(&a), curve(&b)].concat(), curve(&straight), "on {device} with {config:?}");
            assert_eq!(params(&split.net)?, params(&whole.net)?);
            assert_eq!(split.epochs_trained(), 6);
            assert_eq!(b.epochs[0].epoch, 3, "epochs are counted over fits");
            if let OptimizerConfig::Adam { .. } = config {
                assert_eq!(split.live_optimizer().unwrap().state_dict()?.hyperparameters["step"], 6.0 * 5.0);
            }
        }
        ran(device);
    }
    Ok(())
}

#[test]
fn resuming_from_a_checkpoint_gives_the_uninterrupted_curve() -> Result<()> {
    for device in devices() {
        let data = classes()?;
        let schedule = || LinearWarmup::new(2, 0.5).unwrap().then(2, CosineLr::new(6, 0.1).unwrap());
        // Ten epochs in one go.
        let mut whole = classifier(5, OptimizerConfig::adam(0.02))?.lr_schedule(schedule());
        let straight = trainer(10, device)?.fit(&mut whole, &data)?;
        // Four epochs, a checkpoint; then a fresh learner (other initial
        // parameters, the generator elsewhere) resumes for six.
        let path = temp_path(&format!("resume-{}.safetensors", device).replace(['(', ')'], ""));
        let mut first = classifier(5, OptimizerConfig::adam(0.02))?.lr_schedule(schedule());
        let mut t = trainer(4, device)?;
        let a = t.fit(&mut first, &data)?;
        t.save_checkpoint(&first, &path)?;
        drop(first);
        let mut resumed = classifier(99, OptimizerConfig::adam(0.02))?.lr_schedule(schedule());
        kiln::manual_seed(12345);
        let mut t = trainer(6, device)?;
        t.load_checkpoint(&mut resumed, &path)?;
        assert_eq!(resumed.epochs_trained(), 4);
        let b = t.fit(&mut resumed, &data)?;
        assert_eq!([curve(&a), curve(&b)].concat(), curve(&straight), "on {device}");
        assert_eq!(params(&resumed.net)?, params(&whole.net)?, "on {device}");
        assert!(resumed.net.devices() == vec![device]);
        let _ = std::fs::remove_file(&path);
        ran(device);
    }
    Ok(())
}

#[test]
fn a_checkpoint_moves_between_devices_and_its_parameters_load_alone() -> Result<()> {
    let g = gpus()[0];
    let data = classes()?;
    let path = temp_path("across.safetensors");
    let mut model = classifier(2, OptimizerConfig::adam(0.01))?;
    let mut on_gpu = trainer(2, g)?;
    on_gpu.fit(&mut model, &data)?;
    on_gpu.save_checkpoint(&model, &path)?;
    assert!(checkpoint::is_trainer_checkpoint(&path)?);
    // Onto the CPU, optimizer state included.
    let mut back = classifier(8, OptimizerConfig::adam(0.01))?;
    trainer(1, cpu())?.load_checkpoint(&mut back, &path)?;
    assert_eq!(params(&back.net)?, params(&model.net)?);
    assert_eq!(back.net.devices(), vec![cpu()]);
    let state = back.live_optimizer().unwrap().state_dict()?;
    assert!(state.buffers.values().all(|t| t.device() == cpu()) && state.buffers.len() == 8);
    // checkpoint::load takes the parameters of a Trainer checkpoint.
    let mut net = mlp(6, 4)?;
    checkpoint::load(&mut net, &path, &cpu())?;
    assert_eq!(params(&net)?, params(&model.net)?);
    ran(g);
    let _ = std::fs::remove_file(&path);
    Ok(())
}

#[test]
fn a_checkpoint_that_does_not_fit_leaves_the_learner_as_it_was() -> Result<()> {
    let data = classes()?;
    let path = temp_path("mismatch.safetensors");
    let mut model = classifier(2, OptimizerConfig::adam(0.01))?;
    let mut t = trainer(1, cpu())?;
    t.fit(&mut model, &data)?;
    t.save_checkpoint(&model, &path)?;
    // Another optimizer kind: refused with a hint that compiles.
    let mut sgd = classifier(4, OptimizerConfig::sgd(0.1))?;
    let before = params(&sgd.net)?;
    match t.load_checkpoint(&mut sgd, &path) {
        Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains("`adam`") && msg.contains("OptimizerConfig::adam("), "{msg}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(params(&sgd.net)?, before);
    assert_eq!(sgd.epochs_trained(), 0);
    // Another shape: the tensor is named.
    let mut wide = Learner::new(mlp(7, 4)?, Loss::CrossEntropy, OptimizerConfig::adam(0.01));
    match t.load_checkpoint(&mut wide, &path) {
        Err(Error::Format { msg, .. }) => assert!(msg.contains("model.0.weight"), "{msg}"),
        other => panic!("expected Format, got {other:?}"),
    }
    // A parameters-only file is not a Trainer checkpoint; say how to load it.
    let plain = temp_path("plain.safetensors");
    checkpoint::save(&model.net, &plain)?;
    assert!(!checkpoint::is_trainer_checkpoint(&plain)?);
    match t.load_checkpoint(&mut sgd, &plain) {
        Err(Error::Format { msg, .. }) => assert!(msg.contains("kiln::checkpoint::load(&mut model.net"), "{msg}"),
        other => panic!("expected Format, got {other:?}"),
    }
    assert!(checkpoint::is_trainer_checkpoint(temp_path("missing.safetensors")).is_err());
    let _ = (std::fs::remove_file(&path), std::fs::remove_file(&plain));
    Ok(())
}

#[test]
fn optimizer_state_round_trips_and_refuses_what_does_not_fit() -> Result<()> {
    for device in devices() {
        let w = Tensor::new(&[1f32, -2., 3.], &device)?.requires_grad_();
        let b = Tensor::new(&[0.5f32], &device)?.requires_grad_();
        let loss = |w: &Tensor, b: &Tensor| -> Result<Tensor> { w.sqr()?.sum_all()?.add(&b.sqr()?.sum_all()?) };
        let mut adam = Adam::new(vec![w.clone(), b.clone()], 0.1);
        for _ in 0..3 {
            adam.zero_grad();
            loss(&w, &b)?.backward()?;
            adam.step()?;
        }
        let state = adam.state_dict()?;
        // A copy on the CPU takes the state over, and both go on alike.
        let (w2, b2) = (w.copy_to(&cpu())?.detach().requires_grad_(), b.copy_to(&cpu())?.detach().requires_grad_());
        let mut other = Adam::new(vec![w2.clone(), b2.clone()], 0.7).betas(0.5, 0.5);
        other.load_state_dict(&state)?;
        assert_eq!((other.steps_taken(), other.learning_rate()), (3, 0.1));
        for (opt, w, b) in [(&mut adam, &w, &b), (&mut other, &w2, &b2)] {
            opt.zero_grad();
            loss(w, b)?.backward()?;
            opt.step()?;
        }
        assert_eq!(w.to_vec::<f32>()?, w2.to_vec::<f32>()?, "on {device}");
        // Refusals leave the optimizer as it was.
        let mut bad = state.clone();
        bad.buffers.insert("0.exp_avg".into(), Tensor::zeros(4, DType::F32, &cpu())?);
        let mut fresh = Adam::new(vec![w2.clone(), b2.clone()], 0.3);
        assert!(matches!(fresh.load_state_dict(&bad), Err(Error::InvalidArgument { .. })));
        let mut bad = state.clone();
        bad.buffers.insert("2.exp_avg".into(), Tensor::zeros(1, DType::F32, &cpu())?);
        assert!(fresh.load_state_dict(&bad).is_err());
        let mut bad = state.clone();
        bad.buffers.remove("1.exp_avg_sq");
        assert!(fresh.load_state_dict(&bad).is_err());
        let mut bad = state.clone();
        bad.hyperparameters.insert("step".into(), 1.5);
        assert!(fresh.load_state_dict(&bad).is_err());
        assert_eq!((fresh.steps_taken(), fresh.learning_rate(), fresh.moments(0).0.is_none()), (0, 0.3, true));
        let mut sgd = Sgd::new(vec![w2.clone(), b2.clone()], 0.1);
        match sgd.load_state_dict(&state) {
            Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains("`adam`") && msg.contains("`sgd`"), "{msg}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        ran(device);
    }
    Ok(())
}

// ---- evaluate and predict ---------------------------------------------------

#[test]
fn evaluate_reads_once_and_predict_reads_nothing() -> Result<()> {
    for g in gpus() {
        let data = classes()?;
        let mut model = classifier(1, OptimizerConfig::sgd(0.1))?;
        let t = trainer(1, g)?;
        let val = data.val.as_ref().unwrap();
        let mark = thread_transfer_stats();
        let out = t.predict(&mut model, val)?;
        let moved = thread_transfer_stats().since(&mark);
        assert_eq!((out.device(), out.dims()), (g, &[100usize, 4][..]));
        assert_eq!(moved.direction(Direction::DeviceToHost).count, 0, "{}", moved.report(5));
        let mark = thread_transfer_stats();
        let e = t.evaluate(&mut model, val)?;
        let moved = thread_transfer_stats().since(&mark);
        assert_eq!(moved.direction(Direction::DeviceToHost).count, 1, "{}", moved.report(5));
        assert_eq!(e.examples, 100);
        // A loader of inputs alone is enough to predict (the same batches:
        // a matmul's rounding may depend on the batch's rows).
        let inputs = DataLoader::new(vec![val.tensors()[0].clone()], 64)?;
        assert_eq!(t.predict(&mut model, &inputs)?.to_vec::<f32>()?, out.to_vec::<f32>()?);
        assert!(t.evaluate(&mut model, &inputs).is_err(), "evaluate needs targets");
        ran(g);
    }
    Ok(())
}

// ---- learning-rate schedules -------------------------------------------------

#[test]
fn schedules_follow_pytorch_and_set_each_epochs_rate() -> Result<()> {
    let step = StepLr::new(3, 0.1)?;
    assert_eq!((0..7).map(|e| step.factor(e)).collect::<Vec<_>>()[..4], [1.0, 1.0, 1.0, 0.1]);
    let cos = CosineLr::new(4, 0.0)?;
    let want = [1.0, 0.8535533905932737, 0.5, 0.14644660940672627, 0.0];
    for (e, w) in want.iter().enumerate() {
        assert!((cos.factor(e) - w).abs() < 1e-15, "cosine at {e}");
    }
    let warm = LinearWarmup::new(4, 0.0)?;
    assert_eq!((0..6).map(|e| warm.factor(e)).collect::<Vec<_>>(), [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]);
    let both = warm.times(step);
    assert_eq!(both.factor(3), 0.75 * 0.1);
    assert!(StepLr::new(1, -1.0).is_err() && CosineLr::new(0, 0.0).is_err() && CosineLr::new(3, 2.0).is_err());
    assert!(LinearWarmup::new(3, 1.5).is_err());

    let data = classes()?;
    let mut model = classifier(1, OptimizerConfig::sgd(0.2))?.lr_schedule(LinearWarmup::new(2, 0.5)?.then(2, StepLr::new(1, 0.5)?));
    let h = trainer(5, cpu())?.fit(&mut model, &data)?;
    assert_eq!(h.epochs.iter().map(|e| e.lr).collect::<Vec<_>>(), [0.1, 0.15000000000000002, 0.2, 0.1, 0.05]);
    assert_eq!(model.live_optimizer().unwrap().learning_rate(), 0.05);
    // A factor that is not a number stops the fit, naming the epoch.
    let mut model = classifier(1, OptimizerConfig::sgd(0.2))?.lr_schedule(|e: usize| if e == 1 { f64::NAN } else { 1.0 });
    match trainer(3, cpu())?.fit(&mut model, &data) {
        Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains("epoch 1"), "{msg}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    Ok(())
}

// ---- callbacks -----------------------------------------------------------------

#[test]
fn early_stopping_waits_patience_epochs_then_stops() -> Result<()> {
    let data = classes()?;
    // lr 0: the validation loss never improves after the first epoch.
    let mut model = classifier(1, OptimizerConfig::sgd(0.0))?;
    let mut t = Trainer::builder().max_epochs(20).progress(Progress::Off).callback(EarlyStopping::new(Monitor::ValLoss, 3)).build()?;
    let h = t.fit(&mut model, &data)?;
    assert_eq!(h.epochs.len(), 4, "the best, then 3 without improvement");
    assert_eq!(h.stopped_by.as_deref(), Some("early_stopping_val_loss"));
    assert_eq!(t.callback_states()["early_stopping_val_loss"]["wait"], 3.0);
    // A metric that is not finite stops at once.
    let mut model = classifier(1, OptimizerConfig::sgd(1e30))?;
    let mut t = Trainer::builder().max_epochs(20).progress(Progress::Off).callback(EarlyStopping::new(Monitor::TrainLoss, 100)).build()?;
    let h = t.fit(&mut model, &data)?;
    assert!(h.epochs.len() < 20 && !h.last().unwrap().train_loss.is_finite(), "{:?}", h.train_losses());
    // Monitoring what the fit cannot give fails before training.
    let no_val = DataModule { train: data.train.clone(), val: None };
    let mut model = classifier(1, OptimizerConfig::sgd(0.1))?;
    let mut t = Trainer::builder().max_epochs(2).callback(EarlyStopping::new(Monitor::ValLoss, 1)).build()?;
    match t.fit(&mut model, &no_val) {
        Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains("no validation data"), "{msg}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(model.epochs_trained(), 0);
    let mut regression = Learner::new(Linear::new(2, 1, &cpu())?, Loss::Mse, OptimizerConfig::sgd(0.1));
    let mut t = Trainer::builder().max_epochs(2).callback(EarlyStopping::new(Monitor::ValMetric, 1)).build()?;
    assert!(t.fit(&mut regression, &synthetic_regression(64, 32, 16)?).is_err());
    Ok(())
}

#[test]
fn best_checkpoint_keeps_the_best_epoch_and_its_state_resumes() -> Result<()> {
    let data = classes()?;
    let path = temp_path("best.safetensors");
    let mut model = classifier(1, OptimizerConfig::adam(0.05))?;
    let mut t = Trainer::builder()
        .max_epochs(8)
        .progress(Progress::Off)
        .callback(BestCheckpoint::new(&path, Monitor::ValLoss))
        .callback(EarlyStopping::new(Monitor::ValLoss, 50))
        .build()?;
    let h = t.fit(&mut model, &data)?;
    let losses = h.val_losses();
    let (best_epoch, best) = losses.iter().enumerate().fold((0, f64::MAX), |b, (i, &v)| if v < b.1 { (i, v) } else { b });
    let states = t.callback_states();
    assert_eq!(states["best_checkpoint_val_loss"]["best"], best);
    assert_eq!(states["best_checkpoint_val_loss"]["best_epoch"], best_epoch as f64);
    // The file is the best epoch's: its parameters give its validation loss.
    let mut restored = classifier(6, OptimizerConfig::adam(0.05))?;
    let mut t2 = Trainer::builder()
        .max_epochs(1)
        .callback(BestCheckpoint::new(temp_path("unused.safetensors"), Monitor::ValLoss))
        .callback(EarlyStopping::new(Monitor::ValLoss, 50))
        .build()?;
    t2.load_checkpoint(&mut restored, &path)?;
    assert_eq!(restored.epochs_trained(), best_epoch + 1);
    let e = t2.evaluate(&mut restored, data.val.as_ref().unwrap())?;
    assert_eq!(e.loss, best);
    // The callbacks' states came back with it (as of the best epoch).
    let back = t2.callback_states();
    assert_eq!(back["best_checkpoint_val_loss"]["best"], best);
    assert_eq!(back["early_stopping_val_loss"]["best"], best);
    assert_eq!(back["early_stopping_val_loss"]["wait"], 0.0);
    let _ = std::fs::remove_file(&path);
    Ok(())
}

/// Records what it sees and stops after a given epoch.
struct Recorder {
    seen: Vec<usize>,
    stop_after: usize,
    started: Option<FitStart>,
}

impl Callback for Recorder {
    fn name(&self) -> String {
        "recorder".into()
    }
    fn on_fit_start(&mut self, fit: &FitStart) -> Result<()> {
        self.started = Some(fit.clone());
        Ok(())
    }
    fn on_epoch_end(&mut self, end: &mut EpochEnd<'_>) -> Result<()> {
        self.seen.push(end.stats().epoch);
        assert_eq!(end.history.epochs.len(), self.seen.len());
        if end.stats().epoch == self.stop_after {
            end.stop_training();
        }
        Ok(())
    }
    fn state(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([("epochs_seen".to_string(), self.seen.len() as f64)])
    }
}

#[test]
fn a_callback_of_ones_own_sees_each_epoch_and_can_stop() -> Result<()> {
    let data = classes()?;
    let mut model = classifier(1, OptimizerConfig::sgd(0.1))?;
    let mut t = Trainer::builder()
        .max_epochs(10)
        .progress(Progress::Off)
        .callback(Recorder { seen: Vec::new(), stop_after: 2, started: None })
        .build()?;
    let h = t.fit(&mut model, &data)?;
    assert_eq!(h.epochs.len(), 3);
    assert_eq!(h.stopped_by.as_deref(), Some("recorder"));
    assert_eq!(t.callback_states()["recorder"]["epochs_seen"], 3.0);
    Ok(())
}

// ---- devices ---------------------------------------------------------------------

#[test]
fn num_gpus_zero_brings_a_gpu_model_back_to_the_cpu() -> Result<()> {
    for g in gpus() {
        let data = classes()?;
        let mut model = classifier(1, OptimizerConfig::sgd(0.1))?;
        model.net.to(&g)?;
        let mut t = Trainer::builder().max_epochs(1).num_gpus(0).progress(Progress::Off).build()?;
        let h = t.fit(&mut model, &data)?;
        assert_eq!((h.device, model.net.devices()), (cpu(), vec![cpu()]));
        // The data too: a GPU data set trains on the CPU.
        let on_gpu = DataModule::from_tensors(data.train.tensors()[0].to(&g)?, data.train.tensors()[1].to(&g)?)?;
        t.fit(&mut model, &on_gpu)?;
        ran(g);
    }
    Ok(())
}

/// A model that computes with a tensor it does not list as a parameter.
struct Hidden {
    layer: Linear,
    shift: Tensor,
}

impl Module for Hidden {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.layer.forward(&x.add(&self.shift)?)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.layer.named_parameters()
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.layer.visit_parameters_mut(f)
    }
}

#[test]
fn an_error_never_asks_to_move_an_input_the_trainer_owns() -> Result<()> {
    let g = gpus()[0];
    let data = classes()?;
    for (train_on, shift_on) in [(cpu(), g), (g, cpu())] {
        let net = Hidden { layer: Linear::new(6, 4, &cpu())?, shift: Tensor::zeros(6, DType::F32, &shift_on)? };
        let mut model = Learner::new(net, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
        let t = trainer(1, train_on)?;
        let errors = [
            t.evaluate(&mut model, data.val.as_ref().unwrap()).unwrap_err(),
            t.predict(&mut model, &data.train).unwrap_err(),
            trainer(1, train_on)?.fit(&mut model, &data).unwrap_err(),
        ];
        for err in errors {
            let text = err.to_string();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{text}");
            assert!(!text.contains(".to(&") && text.contains("named_parameters") && text.contains(&format!("on {shift_on}")), "{text}");
        }
    }
    // Without the Trainer, the same forward suggests moving an operand.
    let net = Hidden { layer: Linear::new(6, 4, &cpu())?, shift: Tensor::zeros(6, DType::F32, &g)? };
    assert!(matches!(net.forward(&data.train.tensors()[0]), Err(Error::DeviceMismatch { .. })));
    Ok(())
}

// ---- DataModule ----------------------------------------------------------------------

#[test]
fn from_tensors_and_a_seeded_random_split() -> Result<()> {
    let n = 1797;
    let x = Tensor::arange(0.0, n as f64, 1.0, &cpu())?.reshape((n, 1))?;
    let y = Tensor::arange_dtype(0.0, n as f64, 1.0, DType::I64, &cpu())?;
    let data = DataModule::from_tensors(x.clone(), y.clone())?;
    assert_eq!((data.train.num_examples(), data.train.batch_size(), data.train.is_shuffled(), data.val.is_none()), (n, 32, true, true));
    kiln::manual_seed(3);
    let before = kiln::Tensor::rand(1, &cpu())?.to_vec::<f32>()?;
    kiln::manual_seed(3);
    let split = data.clone().with_batch_size(64)?.random_split(0.2, 42)?;
    // The split draws from its seed alone: kiln's generator did not move.
    assert_eq!(kiln::Tensor::rand(1, &cpu())?.to_vec::<f32>()?, before);
    let val = split.val.as_ref().unwrap();
    // scikit-learn's test_size=0.2 of 1797: 360 held out, 1437 to train.
    assert_eq!((split.train.num_examples(), val.num_examples(), val.batch_size(), val.is_shuffled()), (1437, 360, 64, false));
    let rows = |l: &DataLoader| l.tensors()[1].to_vec::<i64>();
    let (train_rows, val_rows) = (rows(&split.train)?, rows(val)?);
    let mut all = [train_rows.clone(), val_rows.clone()].concat();
    all.sort();
    assert_eq!(all, (0..n as i64).collect::<Vec<_>>(), "disjoint and complete");
    assert!(val_rows.windows(2).all(|w| w[0] < w[1]), "in their original order");
    let mut expected: Vec<i64> = permutation_from_seed(n, 42)[..360].to_vec();
    expected.sort();
    assert_eq!(val_rows, expected);
    // Features follow their rows.
    assert_eq!(val.tensors()[0].to_vec::<f32>()?, val_rows.iter().map(|&r| r as f32).collect::<Vec<_>>());
    // The same seed, the same split; another seed, another.
    assert_eq!(rows(data.clone().random_split(0.2, 42)?.val.as_ref().unwrap())?, val_rows);
    assert_ne!(rows(data.clone().random_split(0.2, 43)?.val.as_ref().unwrap())?, val_rows);
    for bad in [0.0, 1.0, -0.5, f64::NAN] {
        assert!(matches!(data.clone().random_split(bad, 1), Err(Error::InvalidArgument { .. })), "{bad}");
    }
    assert!(split.clone().random_split(0.1, 1).is_err(), "already split");
    let tiny = DataModule::from_tensors(x.narrow(0, 0, 1)?, y.narrow(0, 0, 1)?)?;
    assert!(tiny.random_split(0.5, 1).is_err());
    assert!(DataModule::from_tensors(x.clone(), y.narrow(0, 0, 5)?).is_err());
    assert!(data.with_batch_size(0).is_err());
    Ok(())
}

// ---- the data on the device --------------------------------------------------------------

/// Host↔device transfers in `d` (device-to-device ones apart).
fn host_device(d: &TransferStats) -> u64 {
    d.direction(Direction::HostToDevice).count + d.direction(Direction::DeviceToHost).count
}

#[test]
fn a_data_set_that_fits_is_copied_to_the_device_once() -> Result<()> {
    for g in gpus() {
        kiln::manual_seed(0);
        let data = synthetic_classification(1437, 360, 64, 10, 64)?;
        let mut model = Learner::new(mlp(64, 10)?, Loss::CrossEntropy, OptimizerConfig::adam(0.01));
        let mut t = trainer(30, g)?;
        let mark = thread_transfer_stats();
        t.fit(&mut model, &data)?;
        let moved = thread_transfer_stats().since(&mark);
        // The model (4 tensors) and the data (4) once; then per epoch one
        // shuffled order up and one read of the losses down.
        assert_eq!(moved.direction(Direction::HostToDevice).count, 4 + 4 + 30, "{}", moved.report(5));
        assert_eq!(moved.direction(Direction::DeviceToHost).count, 30);
        assert!(host_device(&moved) <= 10 * 30, "at most 10 per epoch");
        assert_eq!(data.train.device_copy(), Some(g));
        // A second fit reuses the copy the loaders hold.
        let mark = thread_transfer_stats();
        trainer(2, g)?.fit(&mut model, &data)?;
        assert_eq!(host_device(&thread_transfer_stats().since(&mark)), 2 + 2);
        // Streaming instead: each batch's two tensors, every epoch.
        let streamed = data.clone().with_placement(Placement::Stream);
        let mark = thread_transfer_stats();
        trainer(2, g)?.fit(&mut model, &streamed)?;
        let moved = thread_transfer_stats().since(&mark);
        assert_eq!(moved.direction(Direction::HostToDevice).count, 2 * 2 * (23 + 6), "{}", moved.report(5));
        assert_eq!(streamed.train.device_copy(), None);
        ran(g);
    }
    Ok(())
}

#[test]
fn streaming_uploads_the_next_batch_before_the_current_one_is_used() -> Result<()> {
    let g = gpus()[0];
    let x = Tensor::rand((10, 3), &cpu())?;
    let loader = DataLoader::new(vec![x.clone()], 4)?.placement(Placement::Stream);
    let mark = thread_transfer_stats();
    let mut batches = loader.iter_on(&g)?;
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 0, "nothing before the first batch is asked for");
    let first = batches.next().unwrap()?;
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 2, "the first batch and the one after it");
    assert_eq!(first[0].device(), g);
    let rest: Vec<Vec<Tensor>> = batches.collect::<Result<_>>()?;
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 3);
    let rows: Vec<usize> = std::iter::once(&first).chain(&rest).map(|b| b[0].dims()[0]).collect();
    assert_eq!(rows, [4, 4, 2]);
    let got: Vec<f32> = std::iter::once(&first).chain(&rest).flat_map(|b| b[0].to_vec::<f32>().unwrap()).collect();
    assert_eq!(got, x.to_vec::<f32>()?);
    // Shuffled, streamed and held on the device give the same batches.
    let shuffled = DataLoader::new(vec![x.clone()], 4)?.shuffle(true);
    let epoch = |l: &DataLoader| -> Result<Vec<f32>> {
        kiln::manual_seed(9);
        let mut out = Vec::new();
        for b in l.iter_on(&g)? {
            out.extend(b?[0].to_vec::<f32>()?);
        }
        Ok(out)
    };
    let held = epoch(&shuffled)?;
    assert_eq!(epoch(&shuffled.clone().placement(Placement::Stream))?, held);
    let on_cpu = {
        kiln::manual_seed(9);
        shuffled.iter()?.map(|b| b.and_then(|b| b[0].to_vec::<f32>())).collect::<Result<Vec<_>>>()?.concat()
    };
    assert_eq!(on_cpu, held);
    ran(g);
    Ok(())
}

#[test]
fn a_data_set_that_does_not_fit_is_streamed_or_refused() -> Result<()> {
    // A simulated GPU of this test's own, 16 MiB: Auto holds at most half
    // of what is free.
    let g = common::own_sims(1, 16 << 20)[0];
    let x = Tensor::zeros((5000, 1000), DType::F32, &cpu())?; // 20 MB
    let loader = DataLoader::new(vec![x], 1000)?;
    let mut batches = loader.iter_on(&g)?;
    assert_eq!(batches.next().unwrap()?[0].device(), g);
    assert_eq!(loader.device_copy(), None, "streamed");
    drop(batches);
    match loader.clone().placement(Placement::Device).iter_on(&g) {
        Err(Error::OutOfMemory { device, .. }) => assert_eq!(device, g),
        Err(e) => panic!("expected OutOfMemory, got {e}"),
        Ok(_) => panic!("expected OutOfMemory"),
    }
    // A small one is held there.
    let small = DataLoader::new(vec![Tensor::zeros((100, 1000), DType::F32, &cpu())?], 10)?;
    small.iter_on(&g)?.next().unwrap()?;
    assert_eq!(small.device_copy(), Some(g));
    small.release_device_copy();
    assert_eq!(small.device_copy(), None);
    Ok(())
}

// ---- transfers booked at the caller's line ------------------------------------------------

/// The lines of this file at which `diff` booked transfers.
fn lines(diff: &TransferStats) -> Vec<u32> {
    common::booked_lines(diff, file!())
}

#[test]
fn the_loader_and_checkpoint_load_book_at_the_callers_line() -> Result<()> {
    let g = gpus()[0];
    let x = Tensor::rand((10, 3), &cpu())?;
    for placement in [Placement::Auto, Placement::Stream] {
        let loader = DataLoader::new(vec![x.clone()], 4)?.shuffle(true).placement(placement);
        let mark = thread_transfer_stats();
        let batches = loader.iter_on(&g)?; // line A
        let line_a = line!() - 1;
        for b in batches {
            b?;
        }
        assert_eq!(lines(&thread_transfer_stats().since(&mark)), vec![line_a], "{placement:?}");
    }
    let on_gpu = DataLoader::new(vec![x.to(&g)?], 4)?.shuffle(true);
    let mark = thread_transfer_stats();
    let batches = on_gpu.iter()?; // line B: the shuffled order goes up
    let line_b = line!() - 1;
    drop(batches);
    assert_eq!(lines(&thread_transfer_stats().since(&mark)), vec![line_b]);

    let path = temp_path("sites.safetensors");
    let mut net = Linear::new(3, 2, &cpu())?;
    checkpoint::save(&net, &path)?;
    let mark = thread_transfer_stats();
    checkpoint::load(&mut net, &path, &g)?; // line C
    let line_c = line!() - 1;
    let loaded = checkpoint::load_tensors(&path, &g)?; // line D
    let line_d = line!() - 1;
    assert_eq!(lines(&thread_transfer_stats().since(&mark)), vec![line_c, line_d]);
    assert_eq!(loaded.len(), 2);
    let _ = std::fs::remove_file(&path);
    Ok(())
}

#[test]
fn checkpoint_load_keeps_each_parameters_identity_across_devices() -> Result<()> {
    let g = gpus()[0];
    let path = temp_path("identity.safetensors");
    let source = Linear::new(3, 2, &cpu())?;
    checkpoint::save(&source, &path)?;
    let mut net = Linear::new(3, 2, &cpu())?;
    let mut opt = Sgd::new(net.parameters(), 0.1);
    checkpoint::load(&mut net, &path, &g)?;
    assert_eq!(net.devices(), vec![g]);
    // The optimizer built before the load still updates the parameters.
    net.forward(&Tensor::ones((1, 3), DType::F32, &g)?)?.sum_all()?.backward()?;
    opt.step()?;
    assert_ne!(net.weight().to_vec::<f32>()?, source.weight().to_vec::<f32>()?);
    let _ = std::fs::remove_file(&path);
    Ok(())
}

/// `num_gpus(n)` beyond the machine trains on what there is (the book's
/// `min`), and the trainer says so: `num_gpus()` is the number used,
/// `num_gpus_requested()` the number asked, `gpu_notice()` the reason.
#[test]
fn num_gpus_beyond_the_machine_reports_the_gpus_used_and_why() -> Result<()> {
    let n = kiln::num_gpus();
    let t = Trainer::builder().max_epochs(1).num_gpus(n + 2).progress(Progress::Off).build()?;
    assert_eq!((t.num_gpus(), t.num_gpus_requested(), t.gpus().len()), (n, n + 2, n));
    let notice = t.gpu_notice().expect("a notice");
    assert!(notice.contains(&format!("num_gpus({}) asked", n + 2)) && notice.contains(&format!("has {n} GPU")), "{notice}");
    let t = Trainer::builder().max_epochs(1).num_gpus(n).progress(Progress::Off).build()?;
    assert_eq!((t.num_gpus(), t.num_gpus_requested(), t.gpu_notice()), (n, n, None));
    if let Some(d) = gpus().first() {
        let t = Trainer::builder().max_epochs(1).device(*d).build()?;
        assert_eq!((t.num_gpus(), t.num_gpus_requested(), t.gpu_notice()), (1, 1, None));
    }
    Ok(())
}

/// The shuffles of a fit come from the learner's own seeded generator, not
/// kiln's global one: random numbers drawn between `load_checkpoint` and
/// `fit` leave the resumed curve equal to the uninterrupted one, exactly,
/// on one device and data-parallel on two.
#[test]
fn a_resumed_fit_shuffles_as_the_uninterrupted_one_whatever_is_drawn_in_between() -> Result<()> {
    let net =
        || -> Result<Sequential> { Ok(Sequential::new().add(Linear::new(6, 16, &cpu())?).add(ReLU).add(Linear::new(16, 4, &cpu())?)) };
    let path = temp_path("resume-draws.safetensors");
    let mut setups: Vec<Box<dyn Fn(usize) -> Result<Trainer>>> = vec![Box::new(|e| trainer(e, cpu()))];
    for d in gpus().into_iter().take(1) {
        setups.push(Box::new(move |e| trainer(e, d)));
    }
    let sims = common::sims();
    if sims.len() >= 2 {
        let two = sims[..2].to_vec();
        setups.push(Box::new(move |e| Trainer::builder().max_epochs(e).devices(two.clone()).progress(Progress::Off).build()));
    }
    for make in &setups {
        let data = classes()?;
        kiln::manual_seed(1);
        let mut whole = Learner::new(net()?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
        let straight = make(6)?.fit(&mut whole, &data)?;

        kiln::manual_seed(1);
        let mut first = Learner::new(net()?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
        let mut t = make(3)?;
        let a = t.fit(&mut first, &data)?;
        t.save_checkpoint(&first, &path)?;
        let mut resumed = Learner::new(net()?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
        let mut t = make(3)?;
        t.load_checkpoint(&mut resumed, &path)?;
        // Whatever the program does in between draws from kiln's generator.
        Tensor::rand((17, 3), &cpu())?;
        let _ = kiln::data::permutation(50);
        let b = t.fit(&mut resumed, &data)?;
        assert_eq!(resumed.shuffle_seed(), whole.shuffle_seed());
        assert_eq!([a.train_losses(), b.train_losses()].concat(), straight.train_losses(), "{:?}", t.gpus());
        assert_eq!(params(&resumed.net)?, params(&whole.net)?);
    }
    std::fs::remove_file(&path).ok();
    Ok(())
}

#[test]
fn trainer_trains_the_chapters_lazy_linear_regression() -> Result<()> {
    // The chapter's model is nn.LazyLinear(1): no parameter before the first
    // forward. fit creates them (one forward of the first batch) before it
    // builds the optimizer, so SGD updates them.
    let mut devices = vec![cpu()];
    devices.extend(common::sims());
    for device in devices {
        kiln::manual_seed(0);
        let data = synthetic_regression(1000, 1000, 32)?;
        let mut model = Learner::new(LazyLinear::new(1), Loss::Mse, OptimizerConfig::sgd(0.03));
        let mut trainer = Trainer::builder().max_epochs(3).device(device).progress(Progress::Off).build()?;
        let history = trainer.fit(&mut model, &data)?;
        let w = model.net.parameter("weight")?;
        assert_eq!(w.device(), device);
        assert!(history.last().unwrap().train_loss < 0.01, "on {device}: {:?}", history.train_losses());
        let w = w.to_vec::<f32>()?;
        assert!((w[0] - 2.0).abs() < 0.05 && (w[1] + 3.4).abs() < 0.05, "on {device}: w = {w:?}");
    }
    Ok(())
}
