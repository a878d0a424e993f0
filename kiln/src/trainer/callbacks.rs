//! Code that runs at points of a fit: the [`Callback`] trait, what it sees
//! ([`FitStart`], [`EpochEnd`]), and the two kiln provides, [`EarlyStopping`]
//! and [`BestCheckpoint`], with the [`Monitor`]ed quantity.

use super::{EpochStats, History};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    pub(super) stop: Option<String>,
    pub(super) checkpoints: Vec<PathBuf>,
    pub(super) current: String,
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
                ));
            }
        }
        Ok(())
    }
}
