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

use crate::nn::Module;
use crate::{Device, Result, Tensor};
use std::collections::BTreeMap;
use std::panic::Location;
#[cfg(feature = "plot")]
use std::path::PathBuf;

mod batch;
mod bench;
mod buckets;
mod builder;
mod callbacks;
mod distributed;
mod fit;
mod learner;
mod metrics;
mod parallel;
mod progress;
mod state;

pub use bench::{bench_w5, W5Report};
pub use builder::TrainerBuilder;
pub use callbacks::{BestCheckpoint, Callback, EarlyStopping, EpochEnd, FitStart, Monitor};
pub use learner::Learner;
#[cfg(feature = "plot")]
pub use metrics::register_plot_font;
pub use metrics::{EpochStats, Evaluation, History, ParallelStats};
pub use parallel::DEFAULT_BUCKET_BYTES;
pub use progress::Progress;

/// Trains a [`Learner`] for `max_epochs` per fit on the first `min(num_gpus,
/// kiln::num_gpus())` GPUs (or the GPUs named by
/// [`TrainerBuilder::devices`]), or on the CPU when there is none, clipping
/// the gradient norm to `gradient_clip_val` when it is positive. Built with
/// [`Trainer::builder`].
///
/// On one GPU the model and the batches go there. On several, training is
/// data-parallel, as PyTorch's DDP: the learner's model stays on the first
/// GPU and each other GPU holds a replica; every batch is split across the
/// GPUs, each computes the forward and backward of its share, the gradients
/// are summed across the GPUs in buckets while backward runs, and every GPU
/// takes the same optimizer step, so the replicas stay identical and the
/// curve is the one a single device would give.
pub struct Trainer {
    max_epochs: usize,
    num_gpus_requested: usize,
    gpu_notice: Option<String>,
    gradient_clip_val: f64,
    gpus: Vec<Device>,
    bucket_bytes: usize,
    check_replicas: bool,
    progress: Progress,
    callbacks: Vec<Box<dyn Callback>>,
    /// The processes training together (`None`: this process alone).
    group: Option<crate::dist::Group>,
    #[cfg(feature = "plot")]
    plot: Option<PathBuf>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("max_epochs", &self.max_epochs)
            .field("num_gpus", &self.gpus.len())
            .field("num_gpus_requested", &self.num_gpus_requested)
            .field("gradient_clip_val", &self.gradient_clip_val)
            .field("gpus", &self.gpus)
            .field("progress", &self.progress)
            .field("callbacks", &self.callbacks.iter().map(|c| c.name()).collect::<Vec<_>>())
            .finish()
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

    /// The number of GPUs training runs on: `min(num_gpus, kiln::num_gpus())`
    /// for [`TrainerBuilder::num_gpus`], the length of
    /// [`TrainerBuilder::devices`], 0 on the CPU.
    ///
    /// ```
    /// use kiln::trainer::Trainer;
    /// kiln::ensure_simulated_gpus(2, 256 << 20);
    /// let n = kiln::num_gpus(); // 2 or more
    /// let t = Trainer::builder().max_epochs(1).num_gpus(n + 1).build()?; // prints a notice
    /// assert_eq!((t.num_gpus(), t.num_gpus_requested(), t.gpus().len()), (n, n + 1, n));
    /// assert!(t.gpu_notice().is_some());
    /// assert!(Trainer::builder().max_epochs(1).num_gpus(2).build()?.gpu_notice().is_none());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn num_gpus(&self) -> usize {
        self.gpus.len()
    }

    /// The number of GPUs asked for (by [`TrainerBuilder::num_gpus`], or as
    /// many as [`TrainerBuilder::devices`] listed; 1 for a GPU named by
    /// [`TrainerBuilder::device`]).
    pub fn num_gpus_requested(&self) -> usize {
        self.num_gpus_requested
    }

    /// Why [`Trainer::num_gpus`] is less than asked, when it is (the line
    /// `build` printed on stderr): `None` when training uses every GPU
    /// asked for.
    pub fn gpu_notice(&self) -> Option<&str> {
        self.gpu_notice.as_deref()
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

    /// The process group this trainer trains across, when it has one of
    /// more than one process ([`TrainerBuilder::process_group`]).
    pub fn process_group(&self) -> Option<&crate::dist::Group> {
        self.group.as_ref().filter(|g| g.size() > 1)
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
}
