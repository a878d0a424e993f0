//! Optimizers: [`Sgd`] (momentum, weight decay) and [`Adam`]. They update
//! parameters in place, on the parameters' own device, without recording
//! gradients: every parameter stays the same tensor (same storage), so a
//! model and its optimizer always agree. An optimizer built before
//! [`Module::to`](crate::nn::Module::to) follows the parameters to their new
//! device (their identity is kept; see [`Tensor::latest`]), moving its own
//! state (momentum, moments) there on the next step.
//!
//! A step is transactional: every new value (parameters and state) is
//! computed into new buffers first and committed only when all of them
//! exist, so a step that fails (e.g. `OutOfMemory` on a full GPU) leaves the
//! parameters, the state and Adam's step counter exactly as they were.
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
use std::panic::Location;

/// What every optimizer does.
pub trait Optimizer {
    /// Applies one update to every parameter that has a gradient; all or
    /// nothing (a failed step changes neither parameters nor state). Moves of
    /// state to a parameter's new device are booked at the caller's line.
    #[track_caller]
    fn step(&mut self) -> Result<()>;
    /// Clears the gradients of the parameters.
    fn zero_grad(&mut self);
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

/// Stochastic gradient descent, with optional momentum and weight decay
/// (PyTorch's formulation: v ← μ·v + g + λ·p, p ← p − lr·v).
pub struct Sgd {
    params: Vec<Tensor>,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    velocity: Vec<Option<Tensor>>,
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(params: Vec<Tensor>, lr: f64) -> Sgd {
        let n = params.len();
        Sgd { params, lr, momentum: 0.0, weight_decay: 0.0, velocity: vec![None; n] }
    }

    /// Checks that every parameter is a leaf (made with `requires_grad_`).
    pub fn checked(params: Vec<Tensor>, lr: f64) -> Result<Sgd> {
        check_params("Sgd", &params)?;
        Ok(Sgd::new(params, lr))
    }

    /// Sets the momentum μ (builder style).
    pub fn momentum(mut self, momentum: f64) -> Sgd {
        self.momentum = momentum;
        self
    }

    /// Sets the weight decay λ (builder style).
    pub fn weight_decay(mut self, weight_decay: f64) -> Sgd {
        self.weight_decay = weight_decay;
        self
    }

    /// The momentum buffer of parameter `i` (none before its first step with
    /// momentum, or for an index out of range).
    pub fn velocity(&self, i: usize) -> Option<Tensor> {
        self.velocity.get(i).cloned().flatten()
    }
}

/// Replaces each handle of a parameter that `Module::to` moved by the
/// parameter as it is now (same identity).
fn follow_moves(params: &mut [Tensor]) {
    for p in params {
        *p = p.latest();
    }
}

impl Optimizer for Sgd {
    #[track_caller]
    fn step(&mut self) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        let _g = no_grad();
        follow_moves(&mut self.params);
        // Compute everything into new buffers; commit only when all exist.
        let mut velocity = self.velocity.clone();
        let mut updates: Vec<(usize, Tensor)> = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let Some(mut g) = p.grad() else { continue };
            if self.weight_decay != 0.0 {
                g = g.add(&p.mul_scalar(self.weight_decay)?)?;
            }
            if self.momentum != 0.0 {
                let next = match &velocity[i] {
                    Some(old) => old.to(&p.device())?.mul_scalar(self.momentum)?.add(&g)?,
                    None => g.force_copy()?,
                };
                velocity[i] = Some(next.clone());
                g = next;
            }
            updates.push((i, p.sub(&g.mul_scalar(self.lr)?)?));
        }
        for (i, new) in updates {
            self.params[i].assign(&new)?;
        }
        self.velocity = velocity;
        Ok(())
    }
    fn zero_grad(&mut self) {
        for p in &self.params {
            p.zero_grad();
        }
    }
    fn learning_rate(&self) -> f64 {
        self.lr
    }
    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn parameters(&self) -> &[Tensor] {
        &self.params
    }
    fn state_dict(&self) -> Result<OptimizerState> {
        let hyperparameters =
            [("lr", self.lr), ("momentum", self.momentum), ("weight_decay", self.weight_decay)].map(|(k, v)| (k.to_string(), v)).into();
        let buffers = self.velocity.iter().enumerate().filter_map(|(i, v)| Some((format!("{i}.momentum_buffer"), v.clone()?))).collect();
        Ok(OptimizerState { kind: "sgd".into(), hyperparameters, buffers })
    }
    #[track_caller]
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        let op = "Sgd::load_state_dict";
        state.check_kind(op, "sgd")?;
        let lr = non_negative(op, "lr", state.hyper(op, "lr")?)?;
        let momentum = non_negative(op, "momentum", state.hyper(op, "momentum")?)?;
        let weight_decay = non_negative(op, "weight_decay", state.hyper(op, "weight_decay")?)?;
        let buffers = state.buffers_for(op, &["momentum_buffer"], &self.params)?;
        self.velocity = buffers.into_iter().map(|mut b| b.swap_remove(0)).collect();
        (self.lr, self.momentum, self.weight_decay) = (lr, momentum, weight_decay);
        Ok(())
    }
}

/// Adam (Kingma & Ba), with bias correction and optional L2 weight decay.
///
/// ```
/// use kiln::optim::{Adam, Optimizer};
/// use kiln::{Tensor, cpu};
/// let w = Tensor::new(&[3f32], &cpu())?.requires_grad_();
/// let mut opt = Adam::new(vec![w.clone()], 0.1);
/// for _ in 0..100 {
///     opt.zero_grad();
///     w.sqr()?.sum_all()?.backward()?;
///     opt.step()?;
/// }
/// assert!(w.to_vec::<f32>()?[0].abs() < 0.1);
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct Adam {
    params: Vec<Tensor>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    t: i32,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl Adam {
    /// Adam with β = (0.9, 0.999), ε = 1e-8.
    pub fn new(params: Vec<Tensor>, lr: f64) -> Adam {
        let n = params.len();
        Adam { params, lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, t: 0, m: vec![None; n], v: vec![None; n] }
    }

    /// Sets β₁ and β₂ (builder style).
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Adam {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }

    /// Sets ε (builder style).
    pub fn eps(mut self, eps: f64) -> Adam {
        self.eps = eps;
        self
    }

    /// Sets the L2 weight decay (builder style).
    pub fn weight_decay(mut self, weight_decay: f64) -> Adam {
        self.weight_decay = weight_decay;
        self
    }

    /// The first and second moment estimates of parameter `i` (none before
    /// its first step).
    pub fn moments(&self, i: usize) -> (Option<Tensor>, Option<Tensor>) {
        (self.m.get(i).cloned().flatten(), self.v.get(i).cloned().flatten())
    }

    /// Steps taken (the bias-correction counter).
    pub fn steps_taken(&self) -> i32 {
        self.t
    }
}

impl Optimizer for Adam {
    #[track_caller]
    fn step(&mut self) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        let _g = no_grad();
        follow_moves(&mut self.params);
        let t = self.t.saturating_add(1);
        let c1 = 1.0 - self.beta1.powi(t);
        let c2 = 1.0 - self.beta2.powi(t);
        // Compute everything into new buffers; commit only when all exist.
        let (mut ms, mut vs) = (self.m.clone(), self.v.clone());
        let mut updates: Vec<(usize, Tensor)> = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let Some(mut g) = p.grad() else { continue };
            let device = p.device();
            if self.weight_decay != 0.0 {
                g = g.add(&p.mul_scalar(self.weight_decay)?)?;
            }
            let m = match &ms[i] {
                Some(m) => m.to(&device)?.mul_scalar(self.beta1)?.add(&g.mul_scalar(1.0 - self.beta1)?)?,
                None => g.mul_scalar(1.0 - self.beta1)?,
            };
            let v = match &vs[i] {
                Some(v) => v.to(&device)?.mul_scalar(self.beta2)?.add(&g.sqr()?.mul_scalar(1.0 - self.beta2)?)?,
                None => g.sqr()?.mul_scalar(1.0 - self.beta2)?,
            };
            let denom = v.div_scalar(c2)?.sqrt()?.add_scalar(self.eps)?;
            let update = m.div(&denom)?.mul_scalar(self.lr / c1)?;
            updates.push((i, p.sub(&update)?));
            ms[i] = Some(m);
            vs[i] = Some(v);
        }
        for (i, new) in updates {
            self.params[i].assign(&new)?;
        }
        self.m = ms;
        self.v = vs;
        self.t = t;
        Ok(())
    }
    fn zero_grad(&mut self) {
        for p in &self.params {
            p.zero_grad();
        }
    }
    fn learning_rate(&self) -> f64 {
        self.lr
    }
    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn parameters(&self) -> &[Tensor] {
        &self.params
    }
    fn state_dict(&self) -> Result<OptimizerState> {
        let hyperparameters = [
            ("lr", self.lr),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("step", f64::from(self.t)),
        ]
        .map(|(k, v)| (k.to_string(), v))
        .into();
        let mut buffers = BTreeMap::new();
        for (i, (m, v)) in self.m.iter().zip(&self.v).enumerate() {
            if let Some(m) = m {
                buffers.insert(format!("{i}.exp_avg"), m.clone());
            }
            if let Some(v) = v {
                buffers.insert(format!("{i}.exp_avg_sq"), v.clone());
            }
        }
        Ok(OptimizerState { kind: "adam".into(), hyperparameters, buffers })
    }
    #[track_caller]
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        let op = "Adam::load_state_dict";
        state.check_kind(op, "adam")?;
        let lr = non_negative(op, "lr", state.hyper(op, "lr")?)?;
        let (beta1, beta2) = (state.hyper(op, "beta1")?, state.hyper(op, "beta2")?);
        for (name, b) in [("beta1", beta1), ("beta2", beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::invalid(op, format!("hyperparameter `{name}` is {b}; it must be in [0, 1)")));
            }
        }
        let eps = non_negative(op, "eps", state.hyper(op, "eps")?)?;
        let weight_decay = non_negative(op, "weight_decay", state.hyper(op, "weight_decay")?)?;
        let step = state.hyper(op, "step")?;
        if step.fract() != 0.0 || !(0.0..=f64::from(i32::MAX)).contains(&step) {
            return Err(Error::invalid(op, format!("`step` is {step}; it must be a whole number of steps from 0 to {}", i32::MAX)));
        }
        let buffers = state.buffers_for(op, &["exp_avg", "exp_avg_sq"], &self.params)?;
        let (mut m, mut v) = (Vec::with_capacity(buffers.len()), Vec::with_capacity(buffers.len()));
        for (i, mut b) in buffers.into_iter().enumerate() {
            let (exp_avg_sq, exp_avg) = (b.pop().flatten(), b.pop().flatten());
            if exp_avg.is_some() != exp_avg_sq.is_some() {
                return Err(Error::invalid(op, format!("parameter {i} has one of `{i}.exp_avg` and `{i}.exp_avg_sq` but not the other")));
            }
            m.push(exp_avg);
            v.push(exp_avg_sq);
        }
        (self.m, self.v) = (m, v);
        (self.lr, self.beta1, self.beta2, self.eps, self.weight_decay) = (lr, beta1, beta2, eps, weight_decay);
        self.t = step as i32;
        Ok(())
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
