//! Adam, with bias correction and L2 weight decay.

use super::{adam_kernel, follow_moves, fused, non_negative, shares_storage, Optimizer, OptimizerState};
use crate::{no_grad, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::panic::Location;

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
    pub(super) params: Vec<Tensor>,
    pub(super) lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    pub(super) weight_decay: f64,
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

/// A parameter that takes the fused step: its gradient and old moments,
/// contiguous on its device, and the new moments' storages.
struct Fused {
    i: usize,
    g: Tensor,
    old_m: Option<Tensor>,
    old_v: Option<Tensor>,
    m: Tensor,
    v: Tensor,
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
        // Everything that allocates runs first (the new moments' storages,
        // and the values of the composed path); the parameters change only
        // once all of it exists. The fused kernels then write the moments
        // and update each parameter in place, which allocates nothing.
        let (mut ms, mut vs) = (self.m.clone(), self.v.clone());
        let shared = shares_storage(&self.params);
        let storages = fused::storages(&self.params);
        let mut fused_steps: Vec<Fused> = Vec::with_capacity(self.params.len());
        let mut assigns: Vec<(usize, Tensor)> = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            let Some(mut g) = p.grad() else { continue };
            let device = p.device();
            let old_m = ms[i].as_ref().map(|m| m.to(&device)).transpose()?;
            let old_v = vs[i].as_ref().map(|v| v.to(&device)).transpose()?;
            if !shared[i] && fused::takes_in_place(p, [Some(&g), old_m.as_ref(), old_v.as_ref()].into_iter().flatten(), &storages) {
                // One launch for all of them, or three kernels each: the
                // same values as below.
                let contiguous = |t: Option<Tensor>| t.map(|t| t.contiguous()).transpose();
                let (old_m, old_v) = (contiguous(old_m)?, contiguous(old_v)?);
                fused_steps.push(Fused { i, g: g.contiguous()?, old_m, old_v, m: fused::uninit_like(p)?, v: fused::uninit_like(p)? });
                continue;
            }
            if self.weight_decay != 0.0 {
                g = g.add(&p.mul_scalar(self.weight_decay)?)?;
            }
            let m = match &old_m {
                Some(m) => m.mul_scalar(self.beta1)?.add(&g.mul_scalar(1.0 - self.beta1)?)?,
                None => g.mul_scalar(1.0 - self.beta1)?,
            };
            let v = match &old_v {
                Some(v) => v.mul_scalar(self.beta2)?.add(&g.sqr()?.mul_scalar(1.0 - self.beta2)?)?,
                None => g.sqr()?.mul_scalar(1.0 - self.beta2)?,
            };
            let denom = v.div_scalar(c2)?.sqrt()?.add_scalar(self.eps)?;
            let update = m.div(&denom)?.mul_scalar(self.lr / c1)?;
            assigns.push((i, p.sub(&update)?));
            ms[i] = Some(m);
            vs[i] = Some(v);
        }
        let step = adam_kernel::AdamForeach {
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            lr_over_c1: self.lr / c1,
            c2,
            eps: self.eps,
        };
        let params = &self.params;
        let mut stepped = fused::Stepped::default();
        for group in fused::groups(fused_steps.len(), |k| &params[fused_steps[k].i]) {
            let parts: Vec<adam_kernel::AdamPart<'_>> = group
                .iter()
                .map(|&k| {
                    let f = &fused_steps[k];
                    adam_kernel::AdamPart { p: &params[f.i], g: &f.g, old_m: f.old_m.as_ref(), old_v: f.old_v.as_ref(), m: &f.m, v: &f.v }
                })
                .collect();
            stepped.run(parts.iter().map(|q| q.p), || step.run(&parts))?;
        }
        for (i, new) in &assigns {
            stepped.run([&params[*i]], || params[*i].assign(new))?;
        }
        for f in fused_steps {
            ms[f.i] = Some(f.m);
            vs[f.i] = Some(f.v);
        }
        self.m = ms;
        self.v = vs;
        self.t = t;
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
