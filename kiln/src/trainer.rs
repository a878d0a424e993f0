//! The book's `Trainer`, device-aware, built with named settings:
//! `gpus` are the first `min(num_gpus, num_gpus())` GPUs;
//! [`Trainer::prepare_model`] moves the model to `gpus[0]` (or to the CPU
//! when there is none), and the data goes there too: by default the loader
//! holds the whole data set on that device when it fits (copied once), and
//! otherwise uploads each batch one ahead of the step (see
//! [`Placement`](crate::data::Placement)). Per-step losses stay on the
//! device and are read to the host once per epoch, in one transfer.
//!
//! A [`Learner`] keeps its optimizer (momentum, Adam's moments and step
//! counter) and its epoch count across [`Trainer::fit`] calls, so two fits
//! of 15 epochs train exactly as one of 30; [`Trainer::save_checkpoint`]
//! and [`Trainer::load_checkpoint`] carry all of it, and kiln's random
//! generator, across processes. Losses and metrics are means over
//! examples. Learning-rate schedules come from [`crate::optim::LrSchedule`];
//! [`Callback`]s ([`EarlyStopping`], [`BestCheckpoint`], your own) run at
//! the end of each epoch.
//!
//! ```
//! use kiln::data::synthetic_regression;
//! use kiln::nn::{Linear, Loss, Module};
//! use kiln::optim::OptimizerConfig;
//! use kiln::trainer::{Learner, Trainer};
//!
//! kiln::manual_seed(0);
//! let data = synthetic_regression(1000, 100, 32)?;
//! let net = Linear::new(2, 1, &kiln::cpu())?;
//! let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.03));
//! let mut trainer = Trainer::builder().max_epochs(3).num_gpus(1).build()?; // one GPU if there is one
//! let history = trainer.fit(&mut model, &data)?;
//! assert!(history.last().unwrap().train_loss < 0.01);
//! assert_eq!(model.net.weight().device(), trainer.device());
//! # Ok::<(), kiln::Error>(())
//! ```

use crate::checkpoint;
use crate::data::{make_regression, DataLoader, DataModule};
use crate::nn::{init, Linear, Loss, Module};
use crate::optim::{Configured, LrSchedule, Optimizer, OptimizerConfig, OptimizerState};
use crate::runtime::rng;
use crate::{no_grad, DType, Device, Error, Result, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::panic::Location;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A network with its loss and its optimizer: what the book's `d2l.Module`
/// bundles, and what [`Trainer::fit`] trains. It keeps the optimizer the
/// first fit builds (and its state) and counts the epochs and steps it was
/// trained for, across fits; a learning-rate schedule set with
/// [`Learner::lr_schedule`] is applied per epoch of that count.
///
/// ```
/// use kiln::nn::{Linear, Loss};
/// use kiln::optim::{OptimizerConfig, StepLr};
/// use kiln::trainer::Learner;
/// let net = Linear::new(2, 1, &kiln::cpu())?;
/// let model = Learner::new(net, Loss::Mse, OptimizerConfig::adam(0.01)).lr_schedule(StepLr::new(10, 0.5)?);
/// assert_eq!(model.epochs_trained(), 0);
/// assert!(model.live_optimizer().is_none()); // built by the first fit
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct Learner<N: Module> {
    /// The network.
    pub net: N,
    /// The loss (and metric) to use.
    pub loss: Loss,
    /// The optimizer's kind and hyperparameters. The first fit builds the
    /// optimizer; later fits keep it (and its state) and apply this
    /// configuration's hyperparameters to it, unless the kind or the
    /// network's parameters changed, in which case it is built afresh.
    pub optimizer: OptimizerConfig,
    schedule: Option<Box<dyn LrSchedule>>,
    configured: Option<Configured>,
    epochs_trained: usize,
    steps_trained: u64,
}

impl<N: Module> Learner<N> {
    /// Bundles a network, a loss and an optimizer.
    pub fn new(net: N, loss: Loss, optimizer: OptimizerConfig) -> Learner<N> {
        Learner { net, loss, optimizer, schedule: None, configured: None, epochs_trained: 0, steps_trained: 0 }
    }

    /// Multiplies the learning rate by `schedule.factor(epoch)` in each
    /// epoch (builder style).
    pub fn lr_schedule(mut self, schedule: impl LrSchedule + 'static) -> Learner<N> {
        self.schedule = Some(Box::new(schedule));
        self
    }

    /// Epochs trained, over every fit (and restored by
    /// [`Trainer::load_checkpoint`]).
    pub fn epochs_trained(&self) -> usize {
        self.epochs_trained
    }

    /// Optimizer steps taken, over every fit.
    pub fn steps_trained(&self) -> u64 {
        self.steps_trained
    }

    /// The optimizer the fits use, once the first fit (or a
    /// [`Trainer::load_checkpoint`]) built it.
    pub fn live_optimizer(&self) -> Option<&dyn Optimizer> {
        self.configured.as_ref().map(|c| c.get())
    }

    /// Forgets the optimizer and its state: the next fit builds it afresh
    /// (the epoch count, and so the schedule, go on).
    pub fn reset_optimizer(&mut self) {
        self.configured = None;
    }

    /// The learning-rate factor of the schedule at `epoch` (1 without one).
    fn lr_factor(&self, epoch: usize) -> Result<f64> {
        let factor = self.schedule.as_ref().map_or(1.0, |s| s.factor(epoch));
        if factor.is_finite() && factor >= 0.0 {
            Ok(factor)
        } else {
            Err(Error::invalid(
                "fit",
                format!("the learning-rate schedule gave a factor of {factor} for epoch {epoch}; it must be a finite number ≥ 0"),
            ))
        }
    }

    /// Builds the optimizer, or keeps the one there (see
    /// [`Learner::optimizer`]).
    fn ensure_optimizer(&mut self) -> Result<()> {
        let configured = self.optimizer.configure(self.configured.take(), self.net.parameters())?;
        self.configured = Some(configured);
        Ok(())
    }
}

/// What one epoch gave. Losses and metrics are means over the examples
/// (a short last batch weighs what its examples weigh).
#[derive(Clone, Debug, PartialEq)]
pub struct EpochStats {
    /// The epoch, from 0, counted over every fit of the learner.
    pub epoch: usize,
    /// Mean training loss over the epoch's examples (as the parameters were
    /// at each step).
    pub train_loss: f64,
    /// Mean training metric (accuracy for classification), when the loss has one.
    pub train_metric: Option<f64>,
    /// Mean validation loss, when there is validation data.
    pub val_loss: Option<f64>,
    /// Validation metric (accuracy: correct / examples), when there is one.
    pub val_metric: Option<f64>,
    /// The learning rate of the epoch.
    pub lr: f64,
    /// Wall time of the epoch (training and validation), in seconds.
    pub seconds: f64,
}

/// The record of a [`Trainer::fit`].
#[derive(Clone, Debug, PartialEq)]
pub struct History {
    /// One entry per epoch.
    pub epochs: Vec<EpochStats>,
    /// The metric's name, when the loss has one.
    pub metric_name: Option<String>,
    /// Where the training ran.
    pub device: Device,
    /// The callback that stopped the fit before `max_epochs`, if one did.
    pub stopped_by: Option<String>,
}

impl History {
    /// The last epoch.
    pub fn last(&self) -> Option<&EpochStats> {
        self.epochs.last()
    }

    /// Training loss per epoch.
    pub fn train_losses(&self) -> Vec<f64> {
        self.epochs.iter().map(|e| e.train_loss).collect()
    }

    /// Validation loss per epoch (epochs without validation left out).
    pub fn val_losses(&self) -> Vec<f64> {
        self.epochs.iter().filter_map(|e| e.val_loss).collect()
    }

    /// Validation metric per epoch (epochs without one left out).
    pub fn val_metrics(&self) -> Vec<f64> {
        self.epochs.iter().filter_map(|e| e.val_metric).collect()
    }

    /// Mean seconds per epoch.
    pub fn seconds_per_epoch(&self) -> f64 {
        if self.epochs.is_empty() {
            return 0.0;
        }
        self.epochs.iter().map(|e| e.seconds).sum::<f64>() / self.epochs.len() as f64
    }

    /// Draws the loss curves (and the metric, when there is one) to a PNG.
    /// Needs kiln's `plot` feature.
    #[cfg(feature = "plot")]
    pub fn save_plot(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        // Fonts may be missing on a server: fall back to a chart without text.
        self.draw(path, true).or_else(|_| self.draw(path, false))
    }

    #[cfg(feature = "plot")]
    fn draw(&self, path: &Path, text: bool) -> Result<()> {
        use plotters::prelude::*;
        let err =
            |e: &dyn std::fmt::Display| Error::Io { path: path.display().to_string(), msg: format!("cannot draw the loss plot: {e}") };
        let root = BitMapBackend::new(path, (640, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let series: Vec<(&str, Vec<f64>, RGBColor)> = {
            let mut s = vec![("train loss", self.train_losses(), BLUE)];
            let val = self.val_losses();
            if !val.is_empty() {
                s.push(("val loss", val, RED));
            }
            let metric = self.val_metrics();
            if !metric.is_empty() {
                s.push(("val metric", metric, GREEN));
            }
            s
        };
        let x_max = (self.epochs.len().max(2)) as f64;
        let y_max = series.iter().flat_map(|s| s.1.iter().copied()).filter(|v| v.is_finite()).fold(0.0f64, f64::max).max(1e-12) * 1.05;
        let mut builder = ChartBuilder::on(&root);
        builder.margin(15);
        if text {
            builder.caption("training", ("sans-serif", 22)).x_label_area_size(35).y_label_area_size(55);
        }
        let mut chart = builder.build_cartesian_2d(1.0..x_max, 0.0..y_max).map_err(|e| err(&e))?;
        if text {
            chart.configure_mesh().x_desc("epoch").draw().map_err(|e| err(&e))?;
        }
        for (name, values, color) in series {
            let pts: Vec<(f64, f64)> = values.iter().enumerate().map(|(i, &v)| ((i + 1) as f64, v)).collect();
            let s = chart.draw_series(LineSeries::new(pts, color.stroke_width(2))).map_err(|e| err(&e))?;
            if text {
                s.label(name).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
            }
        }
        if text {
            chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
        Ok(())
    }
}

/// Whether to show a progress bar.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Progress {
    /// When stderr is a terminal and kiln was built with its `progress`
    /// feature (the default).
    #[default]
    Auto,
    /// Never.
    Off,
}

/// A progress bar when the `progress` feature is on and one is wanted.
struct Bar {
    #[cfg(feature = "progress")]
    bar: Option<indicatif::ProgressBar>,
}

impl Bar {
    fn new(progress: Progress, steps: u64) -> Bar {
        #[cfg(feature = "progress")]
        {
            use std::io::IsTerminal;
            let bar = (progress == Progress::Auto && std::io::stderr().is_terminal()).then(|| {
                let b = indicatif::ProgressBar::new(steps);
                if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed_precise} {msg}") {
                    b.set_style(style);
                }
                b
            });
            Bar { bar }
        }
        #[cfg(not(feature = "progress"))]
        {
            let _ = (progress, steps);
            Bar {}
        }
    }
    fn shown(&self) -> bool {
        #[cfg(feature = "progress")]
        return self.bar.is_some();
        #[cfg(not(feature = "progress"))]
        false
    }
    fn inc(&self) {
        #[cfg(feature = "progress")]
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }
    fn message(&self, msg: String) {
        #[cfg(feature = "progress")]
        if let Some(b) = &self.bar {
            b.set_message(msg);
        }
        #[cfg(not(feature = "progress"))]
        let _ = msg;
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        #[cfg(feature = "progress")]
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// A quantity a [`Callback`] watches, from each epoch's [`EpochStats`].
/// Losses are better lower, metrics (accuracy) higher.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Monitor {
    /// [`EpochStats::train_loss`].
    TrainLoss,
    /// [`EpochStats::train_metric`].
    TrainMetric,
    /// [`EpochStats::val_loss`].
    ValLoss,
    /// [`EpochStats::val_metric`].
    ValMetric,
}

impl Monitor {
    /// The monitored value of an epoch.
    ///
    /// ```
    /// use kiln::trainer::Monitor;
    /// assert!(Monitor::ValMetric.higher_is_better() && !Monitor::ValLoss.higher_is_better());
    /// assert_eq!(Monitor::ValLoss.to_string(), "val_loss");
    /// ```
    pub fn value(&self, stats: &EpochStats) -> Option<f64> {
        match self {
            Monitor::TrainLoss => Some(stats.train_loss),
            Monitor::TrainMetric => stats.train_metric,
            Monitor::ValLoss => stats.val_loss,
            Monitor::ValMetric => stats.val_metric,
        }
    }

    /// True for metrics, false for losses.
    pub fn higher_is_better(&self) -> bool {
        matches!(self, Monitor::TrainMetric | Monitor::ValMetric)
    }

    /// Whether `value` beats `best` by more than `min_delta`.
    fn improves(&self, value: f64, best: Option<f64>, min_delta: f64) -> bool {
        match best {
            None => value.is_finite(),
            Some(best) if self.higher_is_better() => value > best + min_delta,
            Some(best) => value < best - min_delta,
        }
    }

    /// Fails when a fit cannot give this value.
    fn check(&self, who: &str, fit: &FitStart) -> Result<()> {
        let missing = match self {
            Monitor::TrainLoss => None,
            Monitor::TrainMetric => fit.metric_name.is_none().then_some("the loss has no metric (cross-entropy's is accuracy)"),
            Monitor::ValLoss => (!fit.has_validation).then_some("the DataModule has no validation data"),
            Monitor::ValMetric => {
                if !fit.has_validation {
                    Some("the DataModule has no validation data")
                } else {
                    fit.metric_name.is_none().then_some("the loss has no metric (cross-entropy's is accuracy)")
                }
            }
        };
        match missing {
            Some(why) => Err(Error::invalid(
                who,
                format!("it monitors {self}, but {why}; monitor `Monitor::TrainLoss` or give the fit what it needs"),
            )),
            None => Ok(()),
        }
    }
}

impl std::fmt::Display for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Monitor::TrainLoss => "train_loss",
            Monitor::TrainMetric => "train_metric",
            Monitor::ValLoss => "val_loss",
            Monitor::ValMetric => "val_metric",
        })
    }
}

/// What a fit offers, given to [`Callback::on_fit_start`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FitStart {
    /// Whether the DataModule has validation batches.
    pub has_validation: bool,
    /// The loss's metric, if it has one.
    pub metric_name: Option<&'static str>,
    /// The learner's epoch count when the fit starts.
    pub first_epoch: usize,
}

/// The end of an epoch, as a [`Callback`] sees it: the epoch's numbers and
/// the fit's so far, and what the callback may ask of the Trainer.
pub struct EpochEnd<'a> {
    /// The fit so far; its last entry is this epoch.
    pub history: &'a History,
    stop: Option<String>,
    checkpoints: Vec<PathBuf>,
    current: String,
}

impl EpochEnd<'_> {
    /// This epoch's numbers.
    pub fn stats(&self) -> &EpochStats {
        // A fit pushes the epoch before its callbacks run.
        &self.history.epochs[self.history.epochs.len() - 1]
    }

    /// Ends the fit after this epoch (the other callbacks still run).
    pub fn stop_training(&mut self) {
        if self.stop.is_none() {
            self.stop = Some(self.current.clone());
        }
    }

    /// Asks for a training checkpoint at `path` once every callback has run
    /// (so it holds their state as of this epoch): see
    /// [`Trainer::save_checkpoint`].
    pub fn save_checkpoint(&mut self, path: impl Into<PathBuf>) {
        self.checkpoints.push(path.into());
    }
}

/// Code that runs at points of a fit: the end of each epoch (and the start
/// of the fit). A callback's [`Callback::state`] is saved in the Trainer's
/// checkpoints, under its [`Callback::name`], and put back by
/// [`Trainer::load_checkpoint`].
///
/// ```
/// use kiln::data::synthetic_regression;
/// use kiln::nn::{Linear, Loss};
/// use kiln::optim::OptimizerConfig;
/// use kiln::trainer::{Callback, EpochEnd, Learner, Trainer};
///
/// /// Stops once the training loss is below a threshold.
/// struct GoodEnough(f64);
/// impl Callback for GoodEnough {
///     fn name(&self) -> String {
///         "good_enough".into()
///     }
///     fn on_epoch_end(&mut self, end: &mut EpochEnd<'_>) -> kiln::Result<()> {
///         if end.stats().train_loss < self.0 {
///             end.stop_training();
///         }
///         Ok(())
///     }
/// }
///
/// kiln::manual_seed(0);
/// let data = synthetic_regression(1000, 0, 32)?;
/// let mut model = Learner::new(Linear::new(2, 1, &kiln::cpu())?, Loss::Mse, OptimizerConfig::sgd(0.03));
/// let mut trainer = Trainer::builder().max_epochs(50).callback(GoodEnough(0.01)).build()?;
/// let history = trainer.fit(&mut model, &data)?;
/// assert!(history.epochs.len() < 50);
/// assert_eq!(history.stopped_by.as_deref(), Some("good_enough"));
/// # Ok::<(), kiln::Error>(())
/// ```
pub trait Callback {
    /// A name unique among a Trainer's callbacks: the key of its state in
    /// checkpoints.
    fn name(&self) -> String;

    /// Before the first epoch of a fit: fail here when the fit cannot give
    /// what the callback needs.
    fn on_fit_start(&mut self, fit: &FitStart) -> Result<()> {
        let _ = fit;
        Ok(())
    }

    /// After each epoch (training and validation).
    fn on_epoch_end(&mut self, end: &mut EpochEnd<'_>) -> Result<()>;

    /// What to save in a checkpoint, by key.
    fn state(&self) -> BTreeMap<String, f64> {
        BTreeMap::new()
    }

    /// Puts back what [`Callback::state`] saved.
    fn load_state(&mut self, state: &BTreeMap<String, f64>) -> Result<()> {
        let _ = state;
        Ok(())
    }
}

/// Stops a fit when the monitored value has not improved (by more than
/// `min_delta`) for `patience` epochs in a row, or at once when it is not
/// finite (PyTorch Lightning's `EarlyStopping` with `check_finite`).
///
/// ```
/// use kiln::data::synthetic_classification;
/// use kiln::nn::{Linear, Loss};
/// use kiln::optim::OptimizerConfig;
/// use kiln::trainer::{EarlyStopping, Learner, Monitor, Trainer};
///
/// kiln::manual_seed(0);
/// let data = synthetic_classification(512, 128, 4, 3, 64)?;
/// let mut model = Learner::new(Linear::new(4, 3, &kiln::cpu())?, Loss::CrossEntropy, OptimizerConfig::adam(0.05));
/// let mut trainer = Trainer::builder().max_epochs(200).callback(EarlyStopping::new(Monitor::ValLoss, 3)).build()?;
/// let history = trainer.fit(&mut model, &data)?;
/// assert!(history.epochs.len() < 200);
/// assert_eq!(history.stopped_by.as_deref(), Some("early_stopping_val_loss"));
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct EarlyStopping {
    monitor: Monitor,
    patience: usize,
    min_delta: f64,
    best: Option<f64>,
    wait: usize,
}

impl EarlyStopping {
    /// Watches `monitor`; stops after `patience` epochs without improvement.
    pub fn new(monitor: Monitor, patience: usize) -> EarlyStopping {
        EarlyStopping { monitor, patience, min_delta: 0.0, best: None, wait: 0 }
    }

    /// An improvement must beat the best by more than `min_delta` (builder
    /// style; 0 by default, a negative or NaN value counts as 0).
    pub fn min_delta(mut self, min_delta: f64) -> EarlyStopping {
        self.min_delta = if min_delta > 0.0 { min_delta } else { 0.0 };
        self
    }

    /// The best value seen.
    pub fn best(&self) -> Option<f64> {
        self.best
    }

    /// Epochs since the last improvement.
    pub fn epochs_without_improvement(&self) -> usize {
        self.wait
    }
}

impl Callback for EarlyStopping {
    fn name(&self) -> String {
        format!("early_stopping_{}", self.monitor)
    }
    fn on_fit_start(&mut self, fit: &FitStart) -> Result<()> {
        self.monitor.check("EarlyStopping", fit)
    }
    fn on_epoch_end(&mut self, end: &mut EpochEnd<'_>) -> Result<()> {
        let Some(value) = self.monitor.value(end.stats()) else { return Ok(()) };
        if !value.is_finite() {
            end.stop_training();
        } else if self.monitor.improves(value, self.best, self.min_delta) {
            self.best = Some(value);
            self.wait = 0;
        } else {
            self.wait += 1;
            if self.wait >= self.patience {
                end.stop_training();
            }
        }
        Ok(())
    }
    fn state(&self) -> BTreeMap<String, f64> {
        let mut s = BTreeMap::from([("wait".to_string(), self.wait as f64)]);
        if let Some(b) = self.best {
            s.insert("best".into(), b);
        }
        s
    }
    fn load_state(&mut self, state: &BTreeMap<String, f64>) -> Result<()> {
        let wait = state.get("wait").copied().unwrap_or(0.0);
        if !(wait >= 0.0 && wait.fract() == 0.0 && wait <= u32::MAX as f64) {
            return Err(Error::invalid("EarlyStopping::load_state", format!("`wait` is {wait}; it must be a whole number of epochs")));
        }
        self.wait = wait as usize;
        self.best = state.get("best").copied();
        Ok(())
    }
}

/// Keeps the best training checkpoint: after each epoch whose monitored
/// value beats every earlier one, writes [`Trainer::save_checkpoint`] to
/// `path` (atomically, over the previous best). Load it with
/// [`Trainer::load_checkpoint`], or its parameters alone with
/// [`checkpoint::load`](crate::checkpoint::load). (PyTorch Lightning's
/// `ModelCheckpoint(monitor, save_top_k=1)`.)
///
/// ```
/// use kiln::data::synthetic_classification;
/// use kiln::nn::{Linear, Loss};
/// use kiln::optim::OptimizerConfig;
/// use kiln::trainer::{BestCheckpoint, Learner, Monitor, Trainer};
///
/// let path = std::env::temp_dir().join(format!("kiln-doc-best-{}.safetensors", std::process::id()));
/// kiln::manual_seed(0);
/// let data = synthetic_classification(256, 64, 4, 3, 32)?;
/// let mut model = Learner::new(Linear::new(4, 3, &kiln::cpu())?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
/// let mut trainer = Trainer::builder().max_epochs(5).callback(BestCheckpoint::new(&path, Monitor::ValMetric)).build()?;
/// let history = trainer.fit(&mut model, &data)?;
/// let best = history.val_metrics().into_iter().fold(f64::MIN, f64::max);
/// assert_eq!(trainer.callback_states()["best_checkpoint_val_metric"]["best"], best);
/// trainer.load_checkpoint(&mut model, &path)?; // the best epoch's parameters and optimizer
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct BestCheckpoint {
    path: PathBuf,
    monitor: Monitor,
    best: Option<f64>,
    best_epoch: Option<usize>,
}

impl BestCheckpoint {
    /// Writes the best checkpoint by `monitor` to `path`.
    pub fn new(path: impl Into<PathBuf>, monitor: Monitor) -> BestCheckpoint {
        BestCheckpoint { path: path.into(), monitor, best: None, best_epoch: None }
    }

    /// Where the checkpoint goes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The best value and its epoch, once there is one.
    pub fn best(&self) -> Option<(f64, usize)> {
        Some((self.best?, self.best_epoch?))
    }
}

impl Callback for BestCheckpoint {
    fn name(&self) -> String {
        format!("best_checkpoint_{}", self.monitor)
    }
    fn on_fit_start(&mut self, fit: &FitStart) -> Result<()> {
        self.monitor.check("BestCheckpoint", fit)
    }
    fn on_epoch_end(&mut self, end: &mut EpochEnd<'_>) -> Result<()> {
        let Some(value) = self.monitor.value(end.stats()) else { return Ok(()) };
        if self.monitor.improves(value, self.best, 0.0) {
            self.best = Some(value);
            self.best_epoch = Some(end.stats().epoch);
            end.save_checkpoint(self.path.clone());
        }
        Ok(())
    }
    fn state(&self) -> BTreeMap<String, f64> {
        let mut s = BTreeMap::new();
        if let (Some(b), Some(e)) = (self.best, self.best_epoch) {
            s.insert("best".to_string(), b);
            s.insert("best_epoch".to_string(), e as f64);
        }
        s
    }
    fn load_state(&mut self, state: &BTreeMap<String, f64>) -> Result<()> {
        match (state.get("best"), state.get("best_epoch")) {
            (Some(&b), Some(&e)) if e >= 0.0 && e.fract() == 0.0 && e <= u32::MAX as f64 => {
                (self.best, self.best_epoch) = (Some(b), Some(e as usize));
            }
            (None, None) => (self.best, self.best_epoch) = (None, None),
            _ => {
                return Err(Error::invalid(
                    "BestCheckpoint::load_state",
                    format!("expected `best` and a whole `best_epoch`, got {state:?}"),
                ))
            }
        }
        Ok(())
    }
}

/// The result of [`Trainer::evaluate`]: means over every example.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean loss over the examples.
    pub loss: f64,
    /// The metric (accuracy = correct / examples), when the loss has one.
    pub metric: Option<f64>,
    /// Examples predicted right, for classification.
    pub correct: Option<u64>,
    /// Examples evaluated.
    pub examples: usize,
}

/// Settings of a [`Trainer`], by name: see [`Trainer::builder`].
#[derive(Default)]
pub struct TrainerBuilder {
    max_epochs: Option<usize>,
    num_gpus: usize,
    device: Option<Device>,
    gradient_clip_val: f64,
    progress: Progress,
    callbacks: Vec<Box<dyn Callback>>,
    #[cfg(feature = "plot")]
    plot: Option<PathBuf>,
}

impl TrainerBuilder {
    /// Epochs each [`Trainer::fit`] runs (required).
    pub fn max_epochs(mut self, max_epochs: usize) -> TrainerBuilder {
        self.max_epochs = Some(max_epochs);
        self
    }

    /// Use the first `min(num_gpus, kiln::num_gpus())` GPUs (the first one
    /// computes); 0, the default, trains on the CPU. Replaces a
    /// [`TrainerBuilder::device`].
    pub fn num_gpus(mut self, num_gpus: usize) -> TrainerBuilder {
        self.num_gpus = num_gpus;
        self.device = None;
        self
    }

    /// Train on this device (a GPU, or the CPU) instead; `build` fails when
    /// it does not exist. Replaces a [`TrainerBuilder::num_gpus`].
    pub fn device(mut self, device: Device) -> TrainerBuilder {
        self.device = Some(device);
        self
    }

    /// Clip the gradients' global norm to this value before each step
    /// (0, the default: no clipping).
    pub fn gradient_clip_val(mut self, gradient_clip_val: f64) -> TrainerBuilder {
        self.gradient_clip_val = gradient_clip_val;
        self
    }

    /// Show a progress bar or not ([`Progress::Auto`] by default).
    pub fn progress(mut self, progress: Progress) -> TrainerBuilder {
        self.progress = progress;
        self
    }

    /// Adds a callback (run in the order added).
    pub fn callback(mut self, callback: impl Callback + 'static) -> TrainerBuilder {
        self.callbacks.push(Box::new(callback));
        self
    }

    /// Writes the loss curves to a PNG at the end of each fit. Needs kiln's
    /// `plot` feature.
    #[cfg(feature = "plot")]
    pub fn plot_to(mut self, path: impl Into<PathBuf>) -> TrainerBuilder {
        self.plot = Some(path.into());
        self
    }

    /// The trainer. Fails when `max_epochs` was not given, the clipping value
    /// is negative or not finite, the device does not exist, or two
    /// callbacks share a name.
    pub fn build(self) -> Result<Trainer> {
        let op = "Trainer::builder";
        let max_epochs = self.max_epochs.ok_or_else(|| {
            Error::invalid(op, "max_epochs is not set; say how long each fit trains, e.g. `Trainer::builder().max_epochs(10)`")
        })?;
        if !(self.gradient_clip_val.is_finite() && self.gradient_clip_val >= 0.0) {
            return Err(Error::invalid(
                op,
                format!("gradient_clip_val must be a finite number ≥ 0 (0: no clipping), got {}", self.gradient_clip_val),
            ));
        }
        let mut names: Vec<String> = Vec::new();
        for c in &self.callbacks {
            let name = c.name();
            if names.contains(&name) {
                return Err(Error::invalid(op, format!("two callbacks are named `{name}`; their checkpoint states would clash")));
            }
            names.push(name);
        }
        let (num_gpus, gpus) = match self.device {
            Some(device) => {
                device.memory_stats()?;
                (usize::from(device.is_gpu()), if device.is_gpu() { vec![device] } else { Vec::new() })
            }
            None => (self.num_gpus, (0..self.num_gpus.min(crate::num_gpus())).map(Device::Gpu).collect()),
        };
        Ok(Trainer {
            max_epochs,
            num_gpus,
            gradient_clip_val: self.gradient_clip_val,
            gpus,
            progress: self.progress,
            callbacks: self.callbacks,
            #[cfg(feature = "plot")]
            plot: self.plot,
        })
    }
}

/// Trains a [`Learner`] for `max_epochs` per fit on the first `min(num_gpus,
/// kiln::num_gpus())` GPUs (only the first is used for compute), or on the
/// CPU when there is none, clipping the gradient norm to
/// `gradient_clip_val` when it is positive. Built with [`Trainer::builder`].
pub struct Trainer {
    max_epochs: usize,
    num_gpus: usize,
    gradient_clip_val: f64,
    gpus: Vec<Device>,
    progress: Progress,
    callbacks: Vec<Box<dyn Callback>>,
    #[cfg(feature = "plot")]
    plot: Option<PathBuf>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("max_epochs", &self.max_epochs)
            .field("num_gpus", &self.num_gpus)
            .field("gradient_clip_val", &self.gradient_clip_val)
            .field("gpus", &self.gpus)
            .field("progress", &self.progress)
            .field("callbacks", &self.callbacks.iter().map(|c| c.name()).collect::<Vec<_>>())
            .finish()
    }
}

/// Sums of one pass over a loader, on the device: loss × examples and
/// correct predictions.
struct Sums {
    loss: Option<Tensor>,
    correct: Option<Tensor>,
    examples: usize,
}

impl Sums {
    fn new() -> Sums {
        Sums { loss: None, correct: None, examples: 0 }
    }

    /// Adds a batch of `n` examples: its mean loss and, for classification,
    /// its predictions (detached).
    fn add(&mut self, loss: &Tensor, pred: &Tensor, target: &Tensor, kind: Loss, n: usize) -> Result<()> {
        let _g = no_grad();
        let weighted = loss.detach().to_dtype(DType::F64)?.mul_scalar(n as f64)?;
        self.loss = Some(accumulate(self.loss.take(), weighted)?);
        if kind.metric_name().is_some() {
            let hits = pred.detach().argmax(1)?.eq(&target.flatten_all()?)?.to_dtype(DType::F64)?.sum_all()?;
            self.correct = Some(accumulate(self.correct.take(), hits)?);
        }
        self.examples += n;
        Ok(())
    }

    /// [loss sum, correct] as two f64 scalars on `device` (zeros when absent).
    fn parts(self, device: &Device) -> Result<[Tensor; 2]> {
        let zero = || Tensor::zeros((), DType::F64, device);
        Ok([self.loss.map_or_else(zero, |t| t.reshape(()))?, self.correct.map_or_else(zero, |t| t.reshape(()))?])
    }
}

fn accumulate(acc: Option<Tensor>, t: Tensor) -> Result<Tensor> {
    match acc {
        Some(a) => a.add(&t),
        None => Ok(t),
    }
}

/// The mean of a sum over `n` examples.
fn mean(sum: f64, n: usize) -> f64 {
    sum / n as f64
}

fn split_batch<'a>(op: &str, batch: &'a [Tensor]) -> Result<(&'a Tensor, &'a Tensor)> {
    match batch {
        [x, y, ..] => Ok((x, y)),
        _ => Err(Error::invalid(op, format!("a batch needs features and targets (2 tensors), got {}", batch.len()))),
    }
}

/// A forward that failed because a tensor the model computes with was not
/// moved with its parameters. The Trainer owns the input and moved it, so
/// the message says what to fix in the model instead of suggesting to move
/// an operand.
fn owned_input(op: &str, device: Device, e: Error) -> Error {
    match e {
        Error::DeviceMismatch { op: what, lhs, rhs } if lhs != device || rhs != device => {
            let elsewhere = if lhs != device { lhs } else { rhs };
            Error::invalid(
                op,
                format!(
                    "the Trainer moved the model and the batch to {device}, yet the forward met a tensor on {elsewhere} ({what}); \
                     every tensor a model computes with must be listed by its `named_parameters` and `visit_parameters_mut`, \
                     so that `Module::to` moves it"
                ),
            )
        }
        other => other,
    }
}

impl Trainer {
    /// Settings by name; `max_epochs` is required.
    ///
    /// ```
    /// use kiln::trainer::{Progress, Trainer};
    /// let trainer = Trainer::builder().max_epochs(30).num_gpus(1).gradient_clip_val(1.0).progress(Progress::Off).build()?;
    /// assert_eq!((trainer.max_epochs(), trainer.gradient_clip_val()), (30, 1.0));
    /// assert!(Trainer::builder().num_gpus(1).build().is_err()); // how many epochs?
    /// assert!(Trainer::builder().max_epochs(1).gradient_clip_val(-1.0).build().is_err());
    /// assert!(Trainer::builder().max_epochs(1).device(kiln::gpu(99)).build().is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn builder() -> TrainerBuilder {
        TrainerBuilder::default()
    }

    /// Epochs each fit runs.
    pub fn max_epochs(&self) -> usize {
        self.max_epochs
    }

    /// GPUs asked for.
    pub fn num_gpus(&self) -> usize {
        self.num_gpus
    }

    /// Gradient-norm clipping threshold (0 for none).
    pub fn gradient_clip_val(&self) -> f64 {
        self.gradient_clip_val
    }

    /// The GPUs this trainer uses (empty: the CPU).
    pub fn gpus(&self) -> &[Device] {
        &self.gpus
    }

    /// Where training runs: `gpus[0]`, or the CPU.
    pub fn device(&self) -> Device {
        self.gpus.first().copied().unwrap_or(Device::Cpu)
    }

    /// The state of each callback, by name (what a checkpoint saves).
    pub fn callback_states(&self) -> BTreeMap<String, BTreeMap<String, f64>> {
        self.callbacks.iter().map(|c| (c.name(), c.state())).collect()
    }

    /// Moves each tensor of a batch to `gpus[0]` (no-op without GPUs or when
    /// already there): the book's `prepare_batch`.
    #[track_caller]
    pub fn prepare_batch(&self, batch: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        match self.gpus.first() {
            Some(d) => batch.iter().map(|t| t.to(d)).collect(),
            None => Ok(batch),
        }
    }

    /// Moves the model's parameters to [`Trainer::device`]: `gpus[0]`, or
    /// the CPU when the trainer has no GPU (so a model left on a GPU comes
    /// back). Parameters already there stay the same tensors.
    #[track_caller]
    pub fn prepare_model(&self, model: &mut dyn Module) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        model.to(&self.device())
    }

    /// Creates the parameters of lazy layers (the chapter's `LazyLinear`)
    /// before the optimizer is built: one forward of the first training
    /// rows (in order, so the shuffle order is not drawn), on the training
    /// device, without gradients and in evaluation mode (no dropout draw).
    /// PyTorch Lightning and d2l do the same; the optimizer then sees every
    /// parameter from the first step.
    fn materialize<N: Module>(&self, model: &mut Learner<N>, data: &DataModule) -> Result<()> {
        if !model.net.has_lazy_parameters() {
            return Ok(());
        }
        let device = self.device();
        let x = &data.train.tensors()[0];
        let rows = data.train.batch_size().min(data.train.num_examples());
        let x = x.narrow(0, 0, rows)?.to(&device)?;
        let _g = no_grad();
        model.net.eval();
        let out = model.net.forward(&x);
        model.net.train();
        out.map_err(|e| owned_input("fit", device, e))?;
        if model.net.has_lazy_parameters() {
            return Err(Error::invalid("fit", "a lazy layer still has no parameters after a forward of the first batch"));
        }
        Ok(())
    }

    fn clip_gradients(&self, params: &[Tensor]) -> Result<()> {
        let grads: Vec<(Tensor, Tensor)> = params.iter().filter_map(|p| p.grad().map(|g| (p.clone(), g))).collect();
        let mut total: Option<Tensor> = None;
        for (_, g) in &grads {
            let s = g.sqr()?.sum_all()?;
            total = Some(accumulate(total, s)?);
        }
        let Some(total) = total else { return Ok(()) };
        // scale = min(1, clip / norm), computed on the device: no read-back.
        let scale = total.sqrt()?.add_scalar(1e-12)?.recip()?.mul_scalar(self.gradient_clip_val)?.minimum_scalar(1.0)?;
        for (p, g) in grads {
            p.set_grad(Some(g.mul(&scale)?))?;
        }
        Ok(())
    }

    /// Trains for `max_epochs` more epochs: each runs every training batch
    /// (forward, loss, backward, clipping, step), then validation without
    /// gradients, and reads the epoch's sums from the device in one
    /// transfer; then the callbacks run. The model, the data (see
    /// [`Placement`](crate::data::Placement)) and every transfer of the fit
    /// are booked at the caller's line.
    ///
    /// The learner's optimizer is built by the first fit and kept by the
    /// next ones, and its epoch count goes on, so two fits of 15 epochs
    /// train exactly as one of 30 (d2l's `fit` runs `max_epochs` each call;
    /// PyTorch Lightning's stops at `max_epochs` in all).
    #[track_caller]
    pub fn fit<N: Module>(&mut self, model: &mut Learner<N>, data: &DataModule) -> Result<History> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        if data.train.is_empty() {
            return Err(Error::invalid("fit", "the training loader yields no batch (fewer examples than one batch with drop_last?)"));
        }
        let device = self.device();
        self.prepare_model(&mut model.net)?;
        let val = data.val.as_ref().filter(|v| !v.is_empty());
        let start = FitStart { has_validation: val.is_some(), metric_name: model.loss.metric_name(), first_epoch: model.epochs_trained };
        for c in &mut self.callbacks {
            c.on_fit_start(&start)?;
        }
        self.materialize(model, data)?;
        model.ensure_optimizer()?;
        let bar = Bar::new(self.progress, (self.max_epochs.saturating_mul(data.train.len())) as u64);
        let mut history = History { epochs: Vec::new(), metric_name: model.loss.metric_name().map(String::from), device, stopped_by: None };
        for _ in 0..self.max_epochs {
            let timer = Instant::now();
            let epoch = model.epochs_trained;
            let lr = model.optimizer.learning_rate() * model.lr_factor(epoch)?;
            let (train, val_sums) = self.run_epoch(model, data, lr, &bar)?;
            let (train_n, val_n) = (train.examples, val_sums.as_ref().map_or(0, |s| s.examples));
            let mut parts = train.parts(&device)?.to_vec();
            if let Some(v) = val_sums {
                parts.extend(v.parts(&device)?);
            }
            let sums = {
                let _g = no_grad();
                Tensor::stack(&parts.iter().collect::<Vec<_>>(), 0)?
            };
            // The one device-to-host read of the epoch.
            let values = sums.to_vec_f64()?;
            let has_metric = model.loss.metric_name().is_some();
            let stats = EpochStats {
                epoch,
                train_loss: mean(values[0], train_n),
                train_metric: has_metric.then(|| mean(values[1], train_n)),
                val_loss: (values.len() == 4).then(|| mean(values[2], val_n)),
                val_metric: (values.len() == 4 && has_metric).then(|| mean(values[3], val_n)),
                lr,
                seconds: timer.elapsed().as_secs_f64(),
            };
            model.epochs_trained += 1;
            if bar.shown() {
                let mut msg = format!("epoch {} loss {:.4}", epoch + 1, stats.train_loss);
                if let Some(v) = stats.val_loss {
                    msg += &format!(" val {v:.4}");
                }
                if let Some(m) = stats.val_metric {
                    msg += &format!(" {} {m:.3}", model.loss.metric_name().unwrap_or("metric"));
                }
                bar.message(msg);
            }
            history.epochs.push(stats);
            let mut end = EpochEnd { history: &history, stop: None, checkpoints: Vec::new(), current: String::new() };
            for c in &mut self.callbacks {
                end.current = c.name();
                c.on_epoch_end(&mut end)?;
            }
            let (stop, checkpoints) = (end.stop, end.checkpoints);
            for path in checkpoints {
                self.save_checkpoint_at(model, &path, Location::caller())?;
            }
            if stop.is_some() {
                history.stopped_by = stop;
                break;
            }
        }
        drop(bar);
        #[cfg(feature = "plot")]
        if let Some(path) = &self.plot {
            history.save_plot(path)?;
        }
        Ok(history)
    }

    /// One epoch at learning rate `lr`: training sums and, when there is
    /// validation data, validation sums.
    fn run_epoch<N: Module>(&self, model: &mut Learner<N>, data: &DataModule, lr: f64, bar: &Bar) -> Result<(Sums, Option<Sums>)> {
        let device = self.device();
        let Learner { net, loss: kind, configured, steps_trained, .. } = model;
        let optimizer = configured.as_mut().ok_or_else(|| Error::invalid("fit", "the optimizer was not built"))?.get_mut();
        optimizer.set_learning_rate(lr);
        net.train();
        let mut train = Sums::new();
        for batch in data.train.iter_on(&device)? {
            let batch = batch?;
            let (x, y) = split_batch("fit", &batch)?;
            let pred = net.forward(x).map_err(|e| owned_input("fit", device, e))?;
            let loss = kind.compute(&pred, y)?;
            optimizer.zero_grad();
            loss.backward()?;
            if self.gradient_clip_val > 0.0 {
                self.clip_gradients(optimizer.parameters())?;
            }
            optimizer.step()?;
            *steps_trained += 1;
            train.add(&loss, &pred, y, *kind, x.dims()[0])?;
            bar.inc();
        }
        let val = match data.val.as_ref().filter(|v| !v.is_empty()) {
            Some(loader) => {
                let sums = self.eval_sums("fit", net, *kind, loader);
                net.train();
                Some(sums?)
            }
            None => None,
        };
        Ok((train, val))
    }

    /// Sums over a loader in evaluation mode, without gradients.
    fn eval_sums(&self, op: &str, net: &mut dyn Module, kind: Loss, loader: &DataLoader) -> Result<Sums> {
        let device = self.device();
        let _g = no_grad();
        net.eval();
        let mut sums = Sums::new();
        for batch in loader.iter_on(&device)? {
            let batch = batch?;
            let (x, y) = split_batch(op, &batch)?;
            let pred = net.forward(x).map_err(|e| owned_input(op, device, e))?;
            let loss = kind.compute(&pred, y)?;
            sums.add(&loss, &pred, y, kind, x.dims()[0])?;
        }
        Ok(sums)
    }

    /// The loss and metric of the model over every example of `loader`
    /// (batches of features and targets), on the trainer's device, in
    /// evaluation mode and without gradients; the sums are read back once.
    /// The model is moved to the trainer's device and left in evaluation
    /// mode (Lightning's `validate`).
    ///
    /// ```
    /// use kiln::data::{synthetic_classification, DataLoader};
    /// use kiln::nn::{Linear, Loss};
    /// use kiln::optim::OptimizerConfig;
    /// use kiln::trainer::{Learner, Trainer};
    /// kiln::manual_seed(0);
    /// let data = synthetic_classification(300, 100, 4, 3, 32)?; // 100 = 3 batches of 32 and one of 4
    /// let mut model = Learner::new(Linear::new(4, 3, &kiln::cpu())?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
    /// let trainer = Trainer::builder().max_epochs(1).build()?;
    /// let val = data.val.as_ref().unwrap();
    /// let e = trainer.evaluate(&mut model, val)?;
    /// assert_eq!(e.examples, 100);
    /// assert_eq!(e.metric, Some(e.correct.unwrap() as f64 / 100.0)); // exact, short batch included
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn evaluate<N: Module>(&self, model: &mut Learner<N>, loader: &DataLoader) -> Result<Evaluation> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        if loader.is_empty() {
            return Err(Error::invalid("evaluate", "the loader yields no batch"));
        }
        let device = self.device();
        self.prepare_model(&mut model.net)?;
        let sums = self.eval_sums("evaluate", &mut model.net, model.loss, loader)?;
        let n = sums.examples;
        let [loss, correct] = sums.parts(&device)?;
        let values = {
            let _g = no_grad();
            Tensor::stack(&[&loss, &correct], 0)?.to_vec_f64()?
        };
        let correct = model.loss.metric_name().map(|_| values[1] as u64);
        Ok(Evaluation { loss: mean(values[0], n), metric: correct.map(|c| mean(c as f64, n)), correct, examples: n })
    }

    /// The model's outputs for every batch of `loader` (its first tensor is
    /// the input; targets, if any, are ignored), concatenated along the
    /// first dimension, on the trainer's device: nothing is read back. In
    /// evaluation mode, without gradients; the model is moved to the
    /// trainer's device and left in evaluation mode (Lightning's `predict`).
    ///
    /// ```
    /// use kiln::data::DataLoader;
    /// use kiln::nn::{Linear, Loss, Module};
    /// use kiln::optim::OptimizerConfig;
    /// use kiln::trainer::{Learner, Trainer};
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &cpu())?;
    /// let net = Linear::new(2, 1, &cpu())?;
    /// let expected = net.forward(&x)?.to_vec::<f32>()?;
    /// let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.1));
    /// let trainer = Trainer::builder().max_epochs(1).build()?;
    /// let out = trainer.predict(&mut model, &DataLoader::new(vec![x], 2)?)?;
    /// assert_eq!(out.to_vec::<f32>()?, expected);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn predict<N: Module>(&self, model: &mut Learner<N>, loader: &DataLoader) -> Result<Tensor> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        if loader.is_empty() {
            return Err(Error::invalid("predict", "the loader yields no batch"));
        }
        let device = self.device();
        self.prepare_model(&mut model.net)?;
        let _g = no_grad();
        model.net.eval();
        let mut outputs = Vec::with_capacity(loader.len());
        for batch in loader.iter_on(&device)? {
            let batch = batch?;
            outputs.push(model.net.forward(&batch[0]).map_err(|e| owned_input("predict", device, e))?);
        }
        Tensor::cat(&outputs.iter().collect::<Vec<_>>(), 0)
    }

    /// Writes a training checkpoint to `path` (safetensors, atomically): the
    /// parameters (`model.<name>`), the optimizer's state
    /// (`optimizer.<index>.<buffer>`, its hyperparameters and step counter
    /// in the metadata), the learner's epoch and step counts, kiln's random
    /// generator on this thread (so shuffles and dropout go on as they
    /// would have) and each callback's state. [`Trainer::load_checkpoint`]
    /// resumes from it exactly; [`checkpoint::load`] takes its parameters.
    ///
    /// ```
    /// use kiln::data::synthetic_classification;
    /// use kiln::nn::{Linear, Loss};
    /// use kiln::optim::OptimizerConfig;
    /// use kiln::trainer::{Learner, Trainer};
    /// let path = std::env::temp_dir().join(format!("kiln-doc-resume-{}.safetensors", std::process::id()));
    /// let learner = || -> kiln::Result<_> {
    ///     Ok(Learner::new(Linear::new(4, 3, &kiln::cpu())?, Loss::CrossEntropy, OptimizerConfig::adam(0.01)))
    /// };
    /// kiln::manual_seed(0);
    /// let data = synthetic_classification(256, 64, 4, 3, 32)?;
    ///
    /// // 4 epochs in one go.
    /// kiln::manual_seed(1);
    /// let mut whole = learner()?;
    /// let straight = Trainer::builder().max_epochs(4).build()?.fit(&mut whole, &data)?;
    ///
    /// // 2 epochs, a checkpoint, and 2 more in a fresh learner.
    /// kiln::manual_seed(1);
    /// let mut first = learner()?;
    /// let mut trainer = Trainer::builder().max_epochs(2).build()?;
    /// let a = trainer.fit(&mut first, &data)?;
    /// trainer.save_checkpoint(&first, &path)?;
    /// let mut resumed = learner()?;
    /// trainer.load_checkpoint(&mut resumed, &path)?;
    /// let b = trainer.fit(&mut resumed, &data)?;
    /// assert_eq!([a.train_losses(), b.train_losses()].concat(), straight.train_losses()); // exactly
    /// # std::fs::remove_file(&path).ok();
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn save_checkpoint<N: Module>(&self, model: &Learner<N>, path: impl AsRef<Path>) -> Result<()> {
        self.save_checkpoint_at(model, path.as_ref(), Location::caller())
    }

    fn save_checkpoint_at<N: Module>(&self, model: &Learner<N>, path: &Path, site: &'static Location<'static>) -> Result<()> {
        let mut tensors: Vec<(String, Tensor)> =
            crate::checkpoint::state_tensors(&model.net).into_iter().map(|(n, t)| (format!("model.{n}"), t)).collect();
        let mut metadata = HashMap::new();
        metadata.insert("format".to_string(), checkpoint::TRAINER_FORMAT.to_string());
        metadata.insert("epochs_trained".to_string(), model.epochs_trained.to_string());
        metadata.insert("steps_trained".to_string(), model.steps_trained.to_string());
        let (seed, offset) = rng::state();
        metadata.insert("rng.seed".to_string(), seed.to_string());
        metadata.insert("rng.offset".to_string(), offset.to_string());
        let state = match &model.configured {
            Some(c) => Some(c.get().state_dict()?),
            None => None,
        };
        metadata.insert("optimizer.kind".to_string(), model.optimizer.kind().to_string());
        if let Some(state) = state {
            for (k, v) in &state.hyperparameters {
                // Rust prints an f64 with the fewest digits that read back to it.
                metadata.insert(format!("optimizer.{k}"), v.to_string());
            }
            tensors.extend(state.buffers.into_iter().map(|(k, t)| (format!("optimizer.{k}"), t)));
        }
        for c in &self.callbacks {
            for (k, v) in c.state() {
                metadata.insert(format!("callback.{}.{k}", c.name()), v.to_string());
            }
        }
        checkpoint::save_with_metadata(&tensors, Some(metadata), path, site)
    }

    /// Resumes from a checkpoint of [`Trainer::save_checkpoint`]: the
    /// parameters (onto the trainer's device, the model moved there
    /// first), the optimizer's state (its buffers and step counter; the
    /// hyperparameters stay the learner's [`OptimizerConfig`], whose kind
    /// must match), the epoch and step counts, kiln's random generator on
    /// this thread, and the state of this trainer's callbacks saved under
    /// their names. Everything is read and checked before the learner
    /// changes: on an error it is as it was. Transfers are booked at the
    /// caller's line.
    #[track_caller]
    pub fn load_checkpoint<N: Module>(&mut self, model: &mut Learner<N>, path: impl AsRef<Path>) -> Result<()> {
        let site = Location::caller();
        let _site = crate::runtime::ledger::site_scope(site);
        let path = path.as_ref();
        let op = "load_checkpoint";
        if model.net.has_lazy_parameters() {
            return Err(Error::invalid(
                op,
                "the model has lazy layers without parameters yet; run one forward first (e.g. `model.net.forward(&x)?`) so that they exist",
            ));
        }
        let device = self.device();
        self.prepare_model(&mut model.net)?;
        let mut file = checkpoint::read_training(&model.net, path, &device, site)?;
        let bad = |msg: String| Error::Format { path: path.display().to_string(), msg };
        let meta = &file.metadata;
        let number = |key: &str| -> Result<u64> {
            let v = meta.get(key).ok_or_else(|| bad(format!("the metadata has no `{key}`")))?;
            v.parse::<u64>().map_err(|_| bad(format!("the metadata's `{key}` is {v:?}, not a whole number")))
        };
        let float = |key: &str, v: &String| -> Result<f64> {
            v.parse::<f64>().map_err(|_| bad(format!("the metadata's `{key}` is {v:?}, not a number")))
        };
        let epochs = usize::try_from(number("epochs_trained")?).map_err(|_| bad("`epochs_trained` is too large".into()))?;
        let steps = number("steps_trained")?;
        let rng_state = (number("rng.seed")?, number("rng.offset")?);
        let kind = meta.get("optimizer.kind").ok_or_else(|| bad("the metadata has no `optimizer.kind`".into()))?;
        if kind != model.optimizer.kind() {
            return Err(Error::invalid(
                op,
                format!(
                    "{} holds the state of a `{kind}` optimizer, the learner's is `{}`; set it to the same kind first, e.g. `model.optimizer = kiln::optim::OptimizerConfig::{kind}({})`",
                    path.display(),
                    model.optimizer.kind(),
                    model.optimizer.learning_rate()
                ),
            ));
        }
        let mut hyperparameters = BTreeMap::new();
        for (k, v) in meta {
            if let Some(name) = k.strip_prefix("optimizer.").filter(|n| *n != "kind") {
                hyperparameters.insert(name.to_string(), float(k, v)?);
            }
        }
        let buffers: BTreeMap<String, Tensor> =
            file.others.iter().filter_map(|(k, t)| Some((k.strip_prefix("optimizer.")?.to_string(), t.clone()))).collect();
        if let Some(other) = file.others.keys().find(|k| !k.starts_with("optimizer.")) {
            return Err(bad(format!("tensor `{other}` is neither a parameter (`model.`) nor an optimizer buffer (`optimizer.`)")));
        }
        let mut callbacks: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
        for (k, v) in meta {
            if let Some(rest) = k.strip_prefix("callback.") {
                let (name, key) = rest.rsplit_once('.').ok_or_else(|| bad(format!("metadata key `{k}` is not `callback.<name>.<key>`")))?;
                callbacks.entry(name.to_string()).or_default().insert(key.to_string(), float(k, v)?);
            }
        }
        // The optimizer, checked against the parameters (the same tensors
        // the file's values go into, in place, below).
        let mut configured = if hyperparameters.is_empty() && buffers.is_empty() {
            // Saved before any fit: nothing to restore but the kind.
            model.optimizer.configure(None, model.net.parameters())?
        } else {
            let mut fresh = model.optimizer.configure(None, model.net.parameters())?;
            let state = OptimizerState { kind: kind.clone(), hyperparameters, buffers };
            fresh.get_mut().load_state_dict(&state).map_err(|e| bad(format!("the optimizer state does not fit this learner: {e}")))?;
            fresh
        };
        // The learner's configuration sets the hyperparameters it names.
        configured = model.optimizer.configure(Some(configured), model.net.parameters())?;
        // Commit.
        file.apply_parameters(&mut model.net)?;
        model.configured = Some(configured);
        model.epochs_trained = epochs;
        model.steps_trained = steps;
        rng::restore(rng_state);
        for c in &mut self.callbacks {
            if let Some(state) = callbacks.get(&c.name()) {
                c.load_state(state)?;
            }
        }
        Ok(())
    }
}

/// The result of [`bench_w5`].
#[derive(Clone, Debug, PartialEq)]
pub struct W5Report {
    /// Milliseconds per epoch, training only (data generation excluded).
    pub ms_per_epoch: f64,
    /// Epochs run.
    pub epochs: usize,
    /// Learned weight.
    pub w: Vec<f32>,
    /// Learned bias.
    pub b: f32,
    /// Final training loss (mean over the last epoch).
    pub final_loss: f64,
}

/// Workload W5 of `kiln bench`: linear regression with autograd on the CPU,
/// 1000 examples of the book's synthetic data, batch 32, shuffled, SGD
/// lr 0.03, `epochs` epochs, through [`Linear`], [`Loss::Mse`] and the
/// [`Trainer`]. Run it with `RAYON_NUM_THREADS=1` for the reference figure.
///
/// ```
/// let r = kiln::trainer::bench_w5(3)?;
/// assert!((r.w[0] - 2.0).abs() < 0.05 && (r.b - 4.2).abs() < 0.05);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn bench_w5(epochs: usize) -> Result<W5Report> {
    crate::manual_seed(0);
    let (x, y) = make_regression(&[2.0, -3.4], 4.2, 0.01, 1000, &Device::Cpu)?;
    let data = DataModule { train: DataLoader::new(vec![x, y], 32)?.shuffle(true), val: None };
    let net = Linear::new(2, 1, &Device::Cpu)?;
    init::normal_(&net.weight(), 0.0, 0.01)?;
    if let Some(b) = net.bias() {
        init::zeros_(&b)?;
    }
    let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::builder().max_epochs(epochs).progress(Progress::Off).build()?;
    let start = Instant::now();
    let history = trainer.fit(&mut model, &data)?;
    let ms_per_epoch = start.elapsed().as_secs_f64() * 1e3 / epochs.max(1) as f64;
    let w = model.net.weight().to_vec::<f32>()?;
    let b = model.net.bias().map(|b| b.to_vec::<f32>()).transpose()?.map(|v| v[0]).unwrap_or(0.0);
    Ok(W5Report { ms_per_epoch, epochs, w, b, final_loss: history.last().map(|e| e.train_loss).unwrap_or(f64::NAN) })
}
