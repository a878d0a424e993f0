//! Learning-rate schedules: a factor per epoch, composable.

use crate::{Error, Result};

/// A learning-rate schedule: the factor that multiplies the optimizer's
/// learning rate (the [`OptimizerConfig`]'s) in each epoch, counted from 0
/// over every fit of a [`Learner`](crate::trainer::Learner) (PyTorch's
/// `LambdaLR`, stepped once per epoch, as Lightning does by default).
/// Closures `Fn(usize) -> f64` are schedules; [`StepLr`], [`CosineLr`] and
/// [`LinearWarmup`] are provided, and [`LrSchedule::then`] and
/// [`LrSchedule::times`] compose them. A factor that is negative or not
/// finite stops the fit with an error naming the epoch.
///
/// ```
/// use kiln::optim::{CosineLr, LinearWarmup, LrSchedule, StepLr};
/// // Five epochs of linear warm-up from 0.1, then a cosine over 20 epochs.
/// let s = LinearWarmup::new(5, 0.1)?.then(5, CosineLr::new(20, 0.0)?);
/// assert_eq!(s.factor(0), 0.1);
/// assert_eq!(s.factor(5), 1.0);
/// assert!((s.factor(15) - 0.5).abs() < 1e-12);
/// assert_eq!(s.factor(25), 0.0);
/// // Your own: halve every 3 epochs, times a step schedule.
/// let mine = (|epoch: usize| 0.5f64.powi((epoch / 3) as i32)).times(StepLr::new(10, 0.1)?);
/// assert_eq!(mine.factor(3), 0.5);
/// # Ok::<(), kiln::Error>(())
/// ```
pub trait LrSchedule {
    /// The factor for `epoch` (from 0).
    fn factor(&self, epoch: usize) -> f64;

    /// This schedule for the first `epochs` epochs, then `next`, which
    /// counts its epochs from 0 again (PyTorch's `SequentialLR`).
    fn then<S: LrSchedule>(self, epochs: usize, next: S) -> Then<Self, S>
    where
        Self: Sized,
    {
        Then { first: self, epochs, next }
    }

    /// The product of this schedule's factor and `other`'s (PyTorch's
    /// `ChainedScheduler`).
    fn times<S: LrSchedule>(self, other: S) -> Times<Self, S>
    where
        Self: Sized,
    {
        Times { a: self, b: other }
    }
}

impl<F: Fn(usize) -> f64> LrSchedule for F {
    fn factor(&self, epoch: usize) -> f64 {
        self(epoch)
    }
}

/// Multiplies the rate by `gamma` every `step_size` epochs: `gamma^(epoch /
/// step_size)` (PyTorch's `StepLR`).
///
/// ```
/// use kiln::optim::{LrSchedule, StepLr};
/// let s = StepLr::new(2, 0.5)?;
/// assert_eq!([0, 1, 2, 3, 4].map(|e| s.factor(e)), [1.0, 1.0, 0.5, 0.5, 0.25]);
/// assert!(StepLr::new(0, 0.5).is_err());
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLr {
    step_size: usize,
    gamma: f64,
}

impl StepLr {
    /// Every `step_size` (at least 1) epochs, times `gamma` (finite, ≥ 0).
    pub fn new(step_size: usize, gamma: f64) -> Result<StepLr> {
        if step_size == 0 {
            return Err(Error::invalid("StepLr", "step_size must be at least 1 epoch"));
        }
        if !(gamma.is_finite() && gamma >= 0.0) {
            return Err(Error::invalid("StepLr", format!("gamma must be a finite number ≥ 0, got {gamma}")));
        }
        Ok(StepLr { step_size, gamma })
    }
}

impl LrSchedule for StepLr {
    fn factor(&self, epoch: usize) -> f64 {
        self.gamma.powf((epoch / self.step_size) as f64)
    }
}

/// Cosine annealing from 1 down to `min_factor` over `t_max` epochs, then
/// `min_factor`: `min + (1 − min)·(1 + cos(π·epoch/t_max))/2` (PyTorch's
/// `CosineAnnealingLR` with `eta_min = min_factor · lr`, without restarts).
///
/// ```
/// use kiln::optim::{CosineLr, LrSchedule};
/// let s = CosineLr::new(10, 0.1)?;
/// assert_eq!(s.factor(0), 1.0);
/// assert!((s.factor(5) - 0.55).abs() < 1e-12);
/// assert_eq!(s.factor(10), 0.1);
/// assert_eq!(s.factor(99), 0.1);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineLr {
    t_max: usize,
    min_factor: f64,
}

impl CosineLr {
    /// Over `t_max` (at least 1) epochs, down to `min_factor` (in [0, 1]).
    pub fn new(t_max: usize, min_factor: f64) -> Result<CosineLr> {
        if t_max == 0 {
            return Err(Error::invalid("CosineLr", "t_max must be at least 1 epoch"));
        }
        if !(0.0..=1.0).contains(&min_factor) {
            return Err(Error::invalid("CosineLr", format!("min_factor must be in [0, 1], got {min_factor}")));
        }
        Ok(CosineLr { t_max, min_factor })
    }
}

impl LrSchedule for CosineLr {
    fn factor(&self, epoch: usize) -> f64 {
        if epoch >= self.t_max {
            return self.min_factor;
        }
        let cos = (std::f64::consts::PI * epoch as f64 / self.t_max as f64).cos();
        self.min_factor + (1.0 - self.min_factor) * (1.0 + cos) / 2.0
    }
}

/// Linear warm-up from `start_factor` to 1 over `epochs` epochs, then 1
/// (PyTorch's `LinearLR(start_factor, end_factor=1, total_iters=epochs)`).
///
/// ```
/// use kiln::optim::{LinearWarmup, LrSchedule};
/// let s = LinearWarmup::new(4, 0.5)?;
/// assert_eq!([0, 2, 4, 9].map(|e| s.factor(e)), [0.5, 0.75, 1.0, 1.0]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearWarmup {
    epochs: usize,
    start_factor: f64,
}

impl LinearWarmup {
    /// Over `epochs` epochs (0: no warm-up), from `start_factor` (in [0, 1]).
    pub fn new(epochs: usize, start_factor: f64) -> Result<LinearWarmup> {
        if !(0.0..=1.0).contains(&start_factor) {
            return Err(Error::invalid("LinearWarmup", format!("start_factor must be in [0, 1], got {start_factor}")));
        }
        Ok(LinearWarmup { epochs, start_factor })
    }
}

impl LrSchedule for LinearWarmup {
    fn factor(&self, epoch: usize) -> f64 {
        if epoch >= self.epochs {
            return 1.0;
        }
        self.start_factor + (1.0 - self.start_factor) * epoch as f64 / self.epochs as f64
    }
}

/// One schedule, then another: see [`LrSchedule::then`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Then<A, B> {
    first: A,
    epochs: usize,
    next: B,
}

impl<A: LrSchedule, B: LrSchedule> LrSchedule for Then<A, B> {
    fn factor(&self, epoch: usize) -> f64 {
        if epoch < self.epochs {
            self.first.factor(epoch)
        } else {
            self.next.factor(epoch - self.epochs)
        }
    }
}

/// The product of two schedules: see [`LrSchedule::times`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Times<A, B> {
    a: A,
    b: B,
}

impl<A: LrSchedule, B: LrSchedule> LrSchedule for Times<A, B> {
    fn factor(&self, epoch: usize) -> f64 {
        self.a.factor(epoch) * self.b.factor(epoch)
    }
}
