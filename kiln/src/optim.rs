//! Optimizers: [`Sgd`] (momentum, weight decay) and [`Adam`]. They update
//! parameters in place, on the parameters' own device, without recording
//! gradients: every parameter stays the same tensor (same storage), so a
//! model and its optimizer always agree.
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
    /// Applies one update to every parameter that has a gradient.
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
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _g = no_grad();
        for (p, v) in self.params.iter().zip(self.velocity.iter_mut()) {
            let Some(mut g) = p.grad() else { continue };
            if self.weight_decay != 0.0 {
                g = g.add(&p.mul_scalar(self.weight_decay)?)?;
            }
            if self.momentum != 0.0 {
                let next = match v.take() {
                    Some(old) => old.mul_scalar(self.momentum)?.add(&g)?,
                    None => g.contiguous()?,
                };
                *v = Some(next.clone());
                g = next;
            }
            p.assign(&p.sub(&g.mul_scalar(self.lr)?)?)?;
        }
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
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        let _g = no_grad();
        self.t += 1;
        let c1 = 1.0 - self.beta1.powi(self.t);
        let c2 = 1.0 - self.beta2.powi(self.t);
        for i in 0..self.params.len() {
            let p = &self.params[i];
            let Some(mut g) = p.grad() else { continue };
            if self.weight_decay != 0.0 {
                g = g.add(&p.mul_scalar(self.weight_decay)?)?;
            }
            let m = match self.m[i].take() {
                Some(m) => m.mul_scalar(self.beta1)?.add(&g.mul_scalar(1.0 - self.beta1)?)?,
                None => g.mul_scalar(1.0 - self.beta1)?,
            };
            let v = match self.v[i].take() {
                Some(v) => v.mul_scalar(self.beta2)?.add(&g.sqr()?.mul_scalar(1.0 - self.beta2)?)?,
                None => g.sqr()?.mul_scalar(1.0 - self.beta2)?,
            };
            let denom = v.div_scalar(c2)?.sqrt()?.add_scalar(self.eps)?;
            let update = m.div(&denom)?.mul_scalar(self.lr / c1)?;
            p.assign(&p.sub(&update)?)?;
            self.m[i] = Some(m);
            self.v[i] = Some(v);
        }
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
