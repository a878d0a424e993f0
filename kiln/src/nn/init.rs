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

/// Xavier (Glorot) uniform: U[−a, a] with a = gain·√(6 / (fan_in + fan_out)).
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
