//! Optimizers: [`Sgd`] (momentum, weight decay) and [`Adam`]. They update
//! parameters in place, on the parameters' own device, without recording
//! gradients: every parameter stays the same tensor (same storage), so a
//! model and its optimizer always agree. An optimizer built before
//! [`Module::to`](crate::nn::Module::to) follows the parameters to their new
//! device (their identity is kept; see [`Tensor::latest`]), moving its own
//! state (momentum, moments) there on the next step.
//!
//! A step is transactional: everything that allocates (new state, and the
//! new values of any parameter updated by composed ops) runs first, and the
//! parameters change only once all of it exists, so a step that fails (e.g.
//! `OutOfMemory` on a full GPU) leaves the parameters, the state and Adam's
//! step counter exactly as they were. SGD and Adam then update each
//! f32/f64 parameter in place, which allocates nothing: on a CUDA device
//! every parameter of a step in one launch per 48 parameters of a dtype
//! (the multi-tensor kernels, as PyTorch's `foreach` optimizers), elsewhere
//! with one to three kernels per parameter; the values are the same bits
//! either way, and the same as the composed tensor ops.
//!
//! An optimizer's state (momentum, moments, step counter, hyperparameters)
//! is exported with [`Optimizer::state_dict`] and put back with
//! [`Optimizer::load_state_dict`] (PyTorch's names), which is how the
//! [`Trainer`](crate::trainer::Trainer)'s checkpoints resume Adam exactly.
//! Learning-rate schedules ([`LrSchedule`]: [`StepLr`], [`CosineLr`],
//! [`LinearWarmup`], closures, and their compositions) give a factor per
//! epoch that the Trainer applies to the optimizer's learning rate.
//!
//! ```
//! use kiln::optim::{Optimizer, Sgd};
//! use kiln::{Tensor, cpu};
//! let w = Tensor::new(&[1f32, -2.], &cpu())?.requires_grad_();
//! let mut opt = Sgd::new(vec![w.clone()], 0.1);
//! w.sqr()?.sum_all()?.backward()?; // grad = 2w
//! opt.step()?;
//! assert_eq!(w.to_vec::<f32>()?, vec![0.8, -1.6]);
//! opt.zero_grad();
//! assert!(w.grad().is_none());
//! # Ok::<(), kiln::Error>(())
//! ```

use crate::{no_grad, Error, Result, Tensor};
use std::collections::BTreeMap;

mod adam;
mod adam_kernel;
mod fused;
mod schedule;
mod sgd;
mod sgd_kernel;

pub use adam::Adam;
pub use schedule::{CosineLr, LinearWarmup, LrSchedule, StepLr, Then, Times};
pub use sgd::Sgd;

/// What every optimizer does.
pub trait Optimizer {
    /// Applies one update to every parameter that has a gradient; all or
    /// nothing (a failed step changes neither parameters nor state). Moves of
    /// state to a parameter's new device are booked at the caller's line.
    #[track_caller]
    fn step(&mut self) -> Result<()>;
    /// Clears the gradients of the parameters.
    fn zero_grad(&mut self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }
    /// The learning rate.
    fn learning_rate(&self) -> f64;
    /// Changes the learning rate (for schedules).
    fn set_learning_rate(&mut self, lr: f64);
    /// The parameters it updates.
    fn parameters(&self) -> &[Tensor];
    /// The optimizer's state: its hyperparameters, step counter and
    /// per-parameter buffers (the same tensors, nothing is copied or moved).
    /// Optimizers that do not implement it return an error.
    fn state_dict(&self) -> Result<OptimizerState> {
        Err(Error::invalid("state_dict", "this optimizer does not export its state; implement `Optimizer::state_dict`"))
    }
    /// Puts back a state from [`Optimizer::state_dict`] of an optimizer of
    /// the same kind over parameters of the same shapes, hyperparameters
    /// included (as PyTorch's `load_state_dict`). Buffers go to their
    /// parameter's device (booked at the caller's line). All or nothing: on
    /// an error the optimizer is unchanged.
    #[track_caller]
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        let _ = state;
        Err(Error::invalid("load_state_dict", "this optimizer does not load a state; implement `Optimizer::load_state_dict`"))
    }
}

/// What [`Optimizer::state_dict`] exports: the optimizer's kind (`"sgd"`,
/// `"adam"`), its hyperparameters by name (`lr`, `momentum`, `beta1`, ...,
/// and Adam's `step`), and its buffers by `"{parameter index}.{name}"`
/// with PyTorch's names (`0.momentum_buffer`, `3.exp_avg`, `3.exp_avg_sq`).
/// A buffer that does not exist yet (no step taken) is absent.
///
/// ```
/// use kiln::optim::{Adam, Optimizer};
/// use kiln::{Tensor, cpu};
/// let w = Tensor::new(&[1f32, -2.], &cpu())?.requires_grad_();
/// let mut opt = Adam::new(vec![w.clone()], 0.1);
/// w.sqr()?.sum_all()?.backward()?;
/// opt.step()?;
/// let state = opt.state_dict()?;
/// assert_eq!(state.kind, "adam");
/// assert_eq!(state.hyperparameters["step"], 1.0);
/// assert_eq!(state.buffers.keys().collect::<Vec<_>>(), ["0.exp_avg", "0.exp_avg_sq"]);
///
/// // Another Adam over a parameter of the same shape takes it over.
/// let v = Tensor::new(&[1f32, -2.], &cpu())?.requires_grad_();
/// let mut other = Adam::new(vec![v.clone()], 0.5);
/// other.load_state_dict(&state)?;
/// assert_eq!((other.steps_taken(), other.learning_rate()), (1, 0.1));
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct OptimizerState {
    /// `"sgd"` or `"adam"` for kiln's optimizers.
    pub kind: String,
    /// Hyperparameters and counters by name.
    pub hyperparameters: BTreeMap<String, f64>,
    /// Per-parameter buffers by `"{index}.{name}"`.
    pub buffers: BTreeMap<String, Tensor>,
}

impl OptimizerState {
    fn hyper(&self, op: &str, name: &str) -> Result<f64> {
        match self.hyperparameters.get(name) {
            Some(v) if v.is_finite() => Ok(*v),
            Some(v) => Err(Error::invalid(op, format!("hyperparameter `{name}` is {v}; it must be a finite number"))),
            None => Err(Error::invalid(op, format!("the state has no hyperparameter `{name}` (it has {:?})", self.hyperparameters.keys()))),
        }
    }

    /// Checks the kind, then each buffer against its parameter (index in
    /// range, a known name, the parameter's shape and dtype), and copies it
    /// to the parameter's device: `names.len()` slots per parameter.
    fn check_kind(&self, op: &str, kind: &str) -> Result<()> {
        if self.kind != kind {
            return Err(Error::invalid(op, format!("the state is of a `{}` optimizer, this one is `{kind}`", self.kind)));
        }
        Ok(())
    }

    fn buffers_for(&self, op: &str, names: &[&str], params: &[Tensor]) -> Result<Vec<Vec<Option<Tensor>>>> {
        let mut out = vec![vec![None; names.len()]; params.len()];
        for (key, t) in &self.buffers {
            let parsed = key.split_once('.').and_then(|(i, name)| Some((i.parse::<usize>().ok()?, names.iter().position(|n| *n == name)?)));
            let Some((i, slot)) = parsed else {
                return Err(Error::invalid(op, format!("buffer `{key}` is not `<parameter index>.<{}>`", names.join("|"))));
            };
            let Some(p) = params.get(i) else {
                return Err(Error::invalid(op, format!("buffer `{key}` is for parameter {i}, this optimizer has {}", params.len())));
            };
            if t.dims() != p.dims() || t.dtype() != p.dtype() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "buffer `{key}` is {} {:?}, parameter {i} is {} {:?}; was the state saved from another model?",
                        t.dtype(),
                        t.dims(),
                        p.dtype(),
                        p.dims()
                    ),
                ));
            }
            let _g = no_grad();
            out[i][slot] = Some(t.detach().to(&p.latest().device())?);
        }
        Ok(out)
    }
}

fn non_negative(op: &str, name: &str, v: f64) -> Result<f64> {
    if v >= 0.0 {
        Ok(v)
    } else {
        Err(Error::invalid(op, format!("hyperparameter `{name}` is {v}; it must not be negative")))
    }
}

fn check_params(op: &str, params: &[Tensor]) -> Result<()> {
    for (i, p) in params.iter().enumerate() {
        if !p.is_leaf() {
            return Err(Error::invalid(op, format!("parameter {i} ({p:?}) is not a leaf; mark it with `requires_grad_()`")));
        }
    }
    Ok(())
}

/// For each parameter, whether it shares its storage with another of the
/// list (the same tensor listed twice, or two views of one storage). Such a
/// parameter takes the composed path, where every new value is computed
/// from the parameters before the step and written after; updating it in
/// place would let one update see another's result.
fn shares_storage(params: &[Tensor]) -> Vec<bool> {
    let mut ids: Vec<usize> = params.iter().map(|p| p.storage_id()).collect();
    ids.sort_unstable();
    params
        .iter()
        .map(|p| {
            let at = ids.partition_point(|&s| s < p.storage_id());
            ids.get(at + 1) == Some(&p.storage_id())
        })
        .collect()
}

/// Replaces each handle of a parameter that `Module::to` moved by the
/// parameter as it is now (same identity).
fn follow_moves(params: &mut [Tensor]) {
    for p in params {
        *p = p.latest();
    }
}

/// An optimizer described before the parameters exist: the
/// [`Trainer`](crate::trainer::Trainer) builds it after moving the model,
/// from the parameters as they are then (the chapter's
/// `configure_optimizers`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// [`Sgd`].
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum μ (0 for none).
        momentum: f64,
        /// Weight decay λ (0 for none).
        weight_decay: f64,
    },
    /// [`Adam`] with β = (0.9, 0.999), ε = 1e-8.
    Adam {
        /// Learning rate.
        lr: f64,
        /// Weight decay (0 for none).
        weight_decay: f64,
    },
}

impl OptimizerConfig {
    /// Plain SGD.
    pub fn sgd(lr: f64) -> OptimizerConfig {
        OptimizerConfig::Sgd { lr, momentum: 0.0, weight_decay: 0.0 }
    }

    /// Adam without weight decay.
    pub fn adam(lr: f64) -> OptimizerConfig {
        OptimizerConfig::Adam { lr, weight_decay: 0.0 }
    }

    /// `"sgd"` or `"adam"`: the [`OptimizerState::kind`] of what it builds.
    pub fn kind(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd { .. } => "sgd",
            OptimizerConfig::Adam { .. } => "adam",
        }
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        match *self {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::Adam { lr, .. } => lr,
        }
    }

    /// The optimizer over `params`, keeping `existing` (its buffers and step
    /// counter) when it is of the same kind over the same parameters, with
    /// this configuration's hyperparameters.
    pub(crate) fn configure(&self, existing: Option<Configured>, params: Vec<Tensor>) -> Result<Configured> {
        check_params("optimizer", &params)?;
        let same_params = |old: &[Tensor]| old.len() == params.len() && old.iter().zip(&params).all(|(a, b)| a.same_parameter(b));
        Ok(match (*self, existing) {
            (OptimizerConfig::Sgd { lr, momentum, weight_decay }, Some(Configured::Sgd(mut sgd))) if same_params(&sgd.params) => {
                (sgd.lr, sgd.momentum, sgd.weight_decay) = (lr, momentum, weight_decay);
                Configured::Sgd(sgd)
            }
            (OptimizerConfig::Adam { lr, weight_decay }, Some(Configured::Adam(mut adam))) if same_params(&adam.params) => {
                (adam.lr, adam.weight_decay) = (lr, weight_decay);
                Configured::Adam(adam)
            }
            (OptimizerConfig::Sgd { lr, momentum, weight_decay }, _) => {
                Configured::Sgd(Sgd::new(params, lr).momentum(momentum).weight_decay(weight_decay))
            }
            (OptimizerConfig::Adam { lr, weight_decay }, _) => Configured::Adam(Adam::new(params, lr).weight_decay(weight_decay)),
        })
    }

    /// The optimizer over `params`.
    pub fn build(&self, params: Vec<Tensor>) -> Result<Box<dyn Optimizer>> {
        check_params("optimizer", &params)?;
        Ok(match *self {
            OptimizerConfig::Sgd { lr, momentum, weight_decay } => {
                Box::new(Sgd::new(params, lr).momentum(momentum).weight_decay(weight_decay))
            }
            OptimizerConfig::Adam { lr, weight_decay } => Box::new(Adam::new(params, lr).weight_decay(weight_decay)),
        })
    }
}

/// An optimizer built from an [`OptimizerConfig`], kept by a
/// [`Learner`](crate::trainer::Learner) across fits.
pub(crate) enum Configured {
    Sgd(Sgd),
    Adam(Adam),
}

impl Configured {
    pub(crate) fn get(&self) -> &dyn Optimizer {
        match self {
            Configured::Sgd(o) => o,
            Configured::Adam(o) => o,
        }
    }
    pub(crate) fn get_mut(&mut self) -> &mut dyn Optimizer {
        match self {
            Configured::Sgd(o) => o,
            Configured::Adam(o) => o,
        }
    }
}
