//! Parameter initializers. Each overwrites a tensor in place, on its own
//! device, from kiln's seeded generator ([`crate::manual_seed`]), so a
//! parameter stays the same tensor and runs are reproducible.
//!
//! ```
//! use kiln::nn::{init, Linear, Module};
//! kiln::manual_seed(0);
//! let layer = Linear::new(2, 1, &kiln::cpu())?;
//! init::normal_(&layer.weight(), 0.0, 0.01)?;
//! init::zeros_(&layer.bias().unwrap())?;
//! assert_eq!(layer.bias().unwrap().to_vec::<f32>()?, vec![0.0]);
//! # Ok::<(), kiln::Error>(())
//! ```

use super::{Conv2d, Linear, Module};
use crate::{no_grad, Error, Result, Tensor};

fn fill(t: &Tensor, value: &Tensor) -> Result<()> {
    let _g = no_grad();
    t.assign(value)
}

/// Fills with samples of N(mean, std²).
pub fn normal_(t: &Tensor, mean: f64, std: f64) -> Result<()> {
    fill(t, &Tensor::randn_with(mean, std, t.shape().clone(), t.dtype(), &t.device())?)
}

/// Fills with samples of U[lo, hi).
pub fn uniform_(t: &Tensor, lo: f64, hi: f64) -> Result<()> {
    fill(t, &Tensor::rand_uniform(lo, hi, t.shape().clone(), t.dtype(), &t.device())?)
}

/// Fills with one value.
pub fn constant_(t: &Tensor, value: f64) -> Result<()> {
    fill(t, &Tensor::full(value, (), t.dtype(), &t.device())?)
}

/// Fills with zeros.
pub fn zeros_(t: &Tensor) -> Result<()> {
    constant_(t, 0.0)
}

/// Fan-in and fan-out of a weight of shape (out, in, ...).
pub fn fans(t: &Tensor) -> Result<(usize, usize)> {
    let d = t.dims();
    match d.len() {
        0 => Err(Error::invalid("init", "fan-in and fan-out need a tensor of rank 1 or more")),
        1 => Ok((d[0], d[0])),
        _ => {
            let receptive: usize = d[2..].iter().product();
            Ok((d[1] * receptive, d[0] * receptive))
        }
    }
}

/// Xavier (Glorot) uniform, PyTorch's `nn.init.xavier_uniform_`: U[−a, a]
/// with a = gain·√(6 / (fan_in + fan_out)), the fans as [`fans`] (and
/// PyTorch's `_calculate_fan_in_and_fan_out`) count them: for a
/// convolution's weight `[out, in / groups, kh, kw]`, fan_in = in / groups ·
/// kh · kw and fan_out = out · kh · kw.
///
/// ```
/// use kiln::nn::{init, Conv2d};
/// use kiln::{Conv2dArgs, cpu};
/// let conv = Conv2d::new(1, 6, 5, Conv2dArgs::default(), &cpu())?;
/// init::xavier_uniform_(&conv.weight(), 1.0)?;
/// let a = (6.0f32 / (25.0 + 150.0)).sqrt();
/// assert!(conv.weight().to_vec::<f32>()?.iter().all(|w| w.abs() <= a));
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn xavier_uniform_(t: &Tensor, gain: f64) -> Result<()> {
    let (fan_in, fan_out) = fans(t)?;
    let a = gain * (6.0 / (fan_in + fan_out).max(1) as f64).sqrt();
    uniform_(t, -a, a)
}

/// Xavier (Glorot) normal: N(0, σ²) with σ = gain·√(2 / (fan_in + fan_out)).
pub fn xavier_normal_(t: &Tensor, gain: f64) -> Result<()> {
    let (fan_in, fan_out) = fans(t)?;
    normal_(t, 0.0, gain * (2.0 / (fan_in + fan_out).max(1) as f64).sqrt())
}

/// d2l's `init_cnn`, for [`Module::apply`]: a [`Linear`] or [`Conv2d`] layer
/// (a lazy one's, once made) gets Xavier-uniform weights
/// ([`xavier_uniform_`], gain 1); biases and every other layer stay as they
/// are. A lazy layer that has no parameters yet is an error saying to call
/// [`Module::init_lazy`] with a sample batch first (d2l's
/// `model.apply_init([X], init_cnn)` runs that forward itself).
///
/// ```
/// use kiln::models::lenet;
/// use kiln::nn::{init_cnn, Module};
/// use kiln::{DType, Tensor};
/// kiln::manual_seed(0);
/// let mut net = lenet(10);
/// assert!(net.apply(&mut init_cnn).unwrap_err().to_string().contains("init_lazy"));
/// net.init_lazy(&Tensor::zeros((1, 1, 28, 28), DType::F32, &kiln::cpu())?)?;
/// net.apply(&mut init_cnn)?;
/// let a = (6.0f32 / (400.0 + 120.0)).sqrt(); // the 400 → 120 dense layer
/// let w = net.parameter("7.weight")?.to_vec::<f32>()?;
/// assert!(w.iter().all(|w| w.abs() <= a) && w.iter().any(|w| w.abs() > 0.9 * a));
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn init_cnn(module: &dyn Module) -> Result<()> {
    if let Some(any) = module.as_any() {
        if let Some(l) = any.downcast_ref::<Linear>() {
            return xavier_uniform_(&l.weight(), 1.0);
        }
        if let Some(c) = any.downcast_ref::<Conv2d>() {
            return xavier_uniform_(&c.weight(), 1.0);
        }
    }
    let mut lazy_leaf = module.has_lazy_parameters();
    // A container with a lazy child: the child was reported first.
    module.visit_children(&mut |_| {
        lazy_leaf = false;
        Ok(())
    })?;
    if lazy_leaf {
        return Err(Error::invalid(
            "init_cnn",
            format!(
                "{} has no parameters yet (a lazy layer is made by its first forward); \
                 call `model.init_lazy(&x)?` with a sample batch first, then apply init_cnn",
                module.describe()
            ),
        ));
    }
    Ok(())
}
