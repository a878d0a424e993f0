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
