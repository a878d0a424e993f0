//! Stochastic gradient descent with momentum and weight decay.

use super::{check_params, follow_moves, fused, non_negative, sgd_kernel, shares_storage, Optimizer, OptimizerState};
use crate::{no_grad, Result, Tensor};
use std::panic::Location;

/// Stochastic gradient descent, with optional momentum and weight decay
/// (PyTorch's formulation: v ← μ·v + g + λ·p, p ← p − lr·v).
pub struct Sgd {
    pub(super) params: Vec<Tensor>,
    pub(super) lr: f64,
    pub(super) momentum: f64,
    pub(super) weight_decay: f64,
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

/// A parameter that takes the fused step: its gradient and old velocity,
/// contiguous on its device, and with momentum the new velocity's storage.
struct Fused {
    i: usize,
    g: Tensor,
    old: Option<Tensor>,
    new: Option<Tensor>,
}

impl Optimizer for Sgd {
    #[track_caller]
    fn step(&mut self) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        let _g = no_grad();
        follow_moves(&mut self.params);
        // Everything that allocates runs first (gradients made contiguous,
        // the new momentum buffers, values of the composed path); the
        // parameters change only once all of it exists. The fused kernels
        // then write the new velocities and update each parameter in
        // place, which allocates nothing.
        let mut velocity = self.velocity.clone();
        let mut fused_steps: Vec<Fused> = Vec::with_capacity(self.params.len());
        let mut assigns: Vec<(usize, Tensor)> = Vec::new();
        let shared = shares_storage(&self.params);
        let storages = fused::storages(&self.params);
        for (i, p) in self.params.iter().enumerate() {
            let Some(mut g) = p.grad() else { continue };
            let old = if self.momentum != 0.0 { velocity[i].as_ref().map(|v| v.to(&p.device())).transpose()? } else { None };
            if !shared[i] && fused::takes_in_place(p, [Some(&g), old.as_ref()].into_iter().flatten(), &storages) {
                // One launch for all of them, or one or two kernels each:
                // the same values as below.
                let new = if self.momentum != 0.0 { Some(fused::uninit_like(p)?) } else { None };
                let old = old.map(|v| v.contiguous()).transpose()?;
                fused_steps.push(Fused { i, g: g.contiguous()?, old, new });
                continue;
            }
            if self.weight_decay != 0.0 {
                g = g.add(&p.mul_scalar(self.weight_decay)?)?;
            }
            if self.momentum != 0.0 {
                let next = match &old {
                    Some(old) => old.mul_scalar(self.momentum)?.add(&g)?,
                    None => g.force_copy()?,
                };
                velocity[i] = Some(next.clone());
                g = next;
            }
            assigns.push((i, p.sub(&g.mul_scalar(self.lr)?)?));
        }
        let step = sgd_kernel::SgdForeach { lr: self.lr, momentum: self.momentum, weight_decay: self.weight_decay };
        let params = &self.params;
        let mut stepped = fused::Stepped::default();
        for group in fused::groups(fused_steps.len(), |k| &params[fused_steps[k].i]) {
            let parts: Vec<sgd_kernel::SgdPart<'_>> = group
                .iter()
                .map(|&k| {
                    let f = &fused_steps[k];
                    sgd_kernel::SgdPart { p: &params[f.i], g: &f.g, old: f.old.as_ref(), new: f.new.as_ref() }
                })
                .collect();
            stepped.run(parts.iter().map(|q| q.p), || step.run(&parts))?;
        }
        for (i, new) in &assigns {
            stepped.run([&params[*i]], || params[*i].assign(new))?;
        }
        for f in fused_steps {
            if let Some(new) = f.new {
                velocity[f.i] = Some(new);
            }
        }
        self.velocity = velocity;
        Ok(())
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
