//! Layers without parameters: activations and [`Flatten`].

use super::module::Module;
use crate::{Result, Tensor};

/// max(x, 0), elementwise.
///
/// ```
/// use kiln::nn::{Module, ReLU};
/// let x = kiln::Tensor::new(&[-1f32, 2.], &kiln::cpu())?;
/// assert_eq!(ReLU.forward(&x)?.to_vec::<f32>()?, vec![0., 2.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct ReLU;

impl Module for ReLU {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.relu()
    }
    fn describe(&self) -> String {
        "ReLU".into()
    }
}

/// 1 / (1 + e⁻ˣ), elementwise.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sigmoid;

impl Module for Sigmoid {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.sigmoid()
    }
    fn describe(&self) -> String {
        "Sigmoid".into()
    }
}

/// tanh x, elementwise.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tanh;

impl Module for Tanh {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.tanh()
    }
    fn describe(&self) -> String {
        "Tanh".into()
    }
}

/// GELU, elementwise: exact (x·Φ(x), PyTorch's default) or its tanh
/// approximation (`GELU { tanh: true }`, PyTorch's `approximate="tanh"`).
///
/// ```
/// use kiln::nn::{Module, GELU};
/// let x = kiln::Tensor::new(&[0f32, 1.], &kiln::cpu())?;
/// let y = GELU::default().forward(&x)?.to_vec::<f32>()?;
/// assert!(y[0] == 0.0 && (y[1] - 0.8413447).abs() < 1e-6);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct GELU {
    /// Use the tanh approximation instead of erf.
    pub tanh: bool,
}

impl Module for GELU {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.tanh {
            x.gelu_tanh()
        } else {
            x.gelu()
        }
    }
    fn describe(&self) -> String {
        if self.tanh { "GELU(approximate=tanh)" } else { "GELU" }.into()
    }
}

/// SiLU (swish), x·σ(x), elementwise.
#[derive(Clone, Copy, Debug, Default)]
pub struct SiLU;

impl Module for SiLU {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.silu()
    }
    fn describe(&self) -> String {
        "SiLU".into()
    }
}

/// Flattens every dimension after the first: (n, c, h, w) → (n, c·h·w).
///
/// ```
/// use kiln::nn::{Flatten, Module};
/// let x = kiln::Tensor::zeros((2, 1, 28, 28), kiln::DType::F32, &kiln::cpu())?;
/// assert_eq!(Flatten.forward(&x)?.dims(), &[2, 784]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Flatten;

impl Module for Flatten {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() <= 1 {
            return Ok(x.clone());
        }
        x.flatten_from(1)
    }
    fn describe(&self) -> String {
        "Flatten".into()
    }
}
