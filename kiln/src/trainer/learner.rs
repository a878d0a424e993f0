//! [`Learner`]: a network with its loss, its optimizer and its training counts.

use crate::nn::{Loss, Module};
use crate::optim::{Configured, LrSchedule, Optimizer, OptimizerConfig};
use crate::{Error, Result};

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
    pub(super) schedule: Option<Box<dyn LrSchedule>>,
    pub(super) configured: Option<Configured>,
    pub(super) epochs_trained: usize,
    pub(super) steps_trained: u64,
    pub(super) shuffle_seed: Option<u64>,
}

impl<N: Module> Learner<N> {
    /// Bundles a network, a loss and an optimizer.
    pub fn new(net: N, loss: Loss, optimizer: OptimizerConfig) -> Learner<N> {
        Learner { net, loss, optimizer, schedule: None, configured: None, epochs_trained: 0, steps_trained: 0, shuffle_seed: None }
    }

    /// Multiplies the learning rate by `schedule.factor(epoch)` in each
    /// epoch (builder style).
    pub fn lr_schedule(mut self, schedule: impl LrSchedule + 'static) -> Learner<N> {
        self.schedule = Some(Box::new(schedule));
        self
    }

    /// The seed of the learner's shuffling generator: epoch `k` of a fit
    /// sees the training rows in the order
    /// [`permutation_for_epoch`](crate::data::permutation_for_epoch)`(n, seed,
    /// k)`, `k` counted over every fit. `None` until the first fit of a
    /// shuffled loader draws it from kiln's generator (so
    /// [`crate::manual_seed`] decides it) or [`Learner::with_shuffle_seed`]
    /// sets it; saved and restored by training checkpoints, so a resumed
    /// fit shuffles as the uninterrupted one would have, whatever else drew
    /// random numbers in between (the generator is the learner's own, as
    /// PyTorch's `DistributedSampler` has its seed and epoch).
    ///
    /// ```
    /// use kiln::data::synthetic_classification;
    /// use kiln::nn::{Linear, Loss};
    /// use kiln::optim::OptimizerConfig;
    /// use kiln::trainer::{Learner, Progress, Trainer};
    /// let data = synthetic_classification(64, 0, 4, 3, 16)?;
    /// let mut model = Learner::new(Linear::new(4, 3, &kiln::cpu())?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1)).with_shuffle_seed(7);
    /// Trainer::builder().max_epochs(1).progress(Progress::Off).build()?.fit(&mut model, &data)?;
    /// assert_eq!(model.shuffle_seed(), Some(7));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn shuffle_seed(&self) -> Option<u64> {
        self.shuffle_seed
    }

    /// Sets the seed of the learner's shuffling generator (builder style):
    /// see [`Learner::shuffle_seed`].
    pub fn with_shuffle_seed(mut self, seed: u64) -> Learner<N> {
        self.shuffle_seed = Some(seed);
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
    pub(super) fn lr_factor(&self, epoch: usize) -> Result<f64> {
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
    pub(super) fn ensure_optimizer(&mut self) -> Result<()> {
        let configured = self.optimizer.configure(self.configured.take(), self.net.parameters())?;
        self.configured = Some(configured);
        Ok(())
    }
}
