//! Fully connected layers: [`Linear`] and [`LazyLinear`], whose input size
//! is found at the first forward.

use super::lazy::{Lazy, LazySpec};
use super::module::{input_device_mismatch, Module, ParamVisitor};
use crate::{DType, Device, Error, Result, Tensor};

/// y = x·Wᵀ + b, with W of shape (out, in) and b of shape (out), like
/// PyTorch's `nn.Linear`. Initialized as PyTorch does: U[−k, k] with
/// k = 1/√in, from kiln's seeded generator.
///
/// ```
/// use kiln::nn::{Linear, Module};
/// use kiln::{Tensor, cpu};
/// let layer = Linear::new(2, 1, &cpu())?;
/// let x = Tensor::ones((4, 2), kiln::DType::F32, &cpu())?;
/// assert_eq!(layer.forward(&x)?.dims(), &[4, 1]);
/// assert_eq!(layer.weight().device(), cpu());
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Linear {
    /// A layer from `in_features` to `out_features` on `device`, f32, with a bias.
    pub fn new(in_features: usize, out_features: usize, device: &Device) -> Result<Linear> {
        Linear::with_options(in_features, out_features, true, DType::F32, device)
    }

    /// A layer with or without bias, of a chosen float dtype.
    pub fn with_options(in_features: usize, out_features: usize, bias: bool, dtype: DType, device: &Device) -> Result<Linear> {
        if in_features == 0 || out_features == 0 {
            return Err(Error::invalid(
                "Linear",
                format!("in_features ({in_features}) and out_features ({out_features}) must both be at least 1"),
            ));
        }
        let k = 1.0 / (in_features as f64).sqrt();
        let weight = Tensor::rand_uniform(-k, k, (out_features, in_features), dtype, device)?.requires_grad_();
        let bias = if bias { Some(Tensor::rand_uniform(-k, k, out_features, dtype, device)?.requires_grad_()) } else { None };
        Ok(Linear { weight, bias })
    }

    /// A layer with the given weight (out, in) and bias (out), marked as
    /// parameters (they share storage with the tensors given).
    pub fn from_tensors(weight: &Tensor, bias: Option<&Tensor>) -> Result<Linear> {
        if weight.rank() != 2 {
            return Err(Error::invalid("Linear", format!("the weight must be 2-D (out, in), got shape {}", weight.shape())));
        }
        if let Some(b) = bias {
            if b.dims() != [weight.dims()[0]] {
                return Err(Error::shape("Linear bias", b.dims(), &[weight.dims()[0]]));
            }
            if b.device() != weight.device() {
                return Err(Error::DeviceMismatch { op: "Linear::from_tensors".into(), lhs: weight.device(), rhs: b.device() });
            }
        }
        Ok(Linear { weight: weight.detach().requires_grad_(), bias: bias.map(|b| b.detach().requires_grad_()) })
    }

    /// The weight, (out, in). Shares storage with the layer's parameter.
    pub fn weight(&self) -> Tensor {
        self.weight.clone()
    }

    /// The bias, (out), if the layer has one.
    pub fn bias(&self) -> Option<Tensor> {
        self.bias.clone()
    }

    /// Input size.
    pub fn in_features(&self) -> usize {
        self.weight.dims()[1]
    }

    /// Output size.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}

impl Module for Linear {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(self.clone()))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.device() != self.weight.device() {
            return Err(input_device_mismatch(x.device(), "weight", self.weight.device()));
        }
        if x.rank() == 0 || x.dims()[x.rank() - 1] != self.in_features() {
            return Err(Error::ShapeMismatch {
                op: format!(
                    "Linear({} -> {}) forward: the input's last dimension must be {}",
                    self.in_features(),
                    self.out_features(),
                    self.in_features()
                ),
                lhs: x.dims().to_vec(),
                rhs: self.weight.dims().to_vec(),
            });
        }
        let y = x.matmul(&self.weight.t()?)?;
        match &self.bias {
            Some(b) => {
                if b.device() != x.device() {
                    return Err(input_device_mismatch(x.device(), "bias", b.device()));
                }
                y.add(b)
            }
            None => Ok(y),
        }
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("weight", &mut self.weight)?;
        if let Some(b) = &mut self.bias {
            f("bias", b)?;
        }
        Ok(())
    }
    fn describe(&self) -> String {
        format!("Linear(in={}, out={}, bias={}, {})", self.in_features(), self.out_features(), self.bias.is_some(), self.weight.device())
    }
}

/// A [`Linear`] layer whose input size is found at the first forward; its
/// parameters are then created on the input's device (PyTorch's
/// `nn.LazyLinear`, the chapter's `nn.LazyLinear(1)`). After
/// [`Module::to`] they are created on that device instead, and an input
/// elsewhere is a [`Error::DeviceMismatch`], as in PyTorch.
///
/// ```
/// use kiln::nn::{LazyLinear, Module};
/// use kiln::{Tensor, DType, try_gpu};
/// let net = LazyLinear::new(1);
/// assert!(net.named_parameters().is_empty());
/// let x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
/// net.forward(&x)?;
/// assert_eq!(net.parameter("weight")?.dims(), &[1, 3]);
/// assert_eq!(net.parameter("weight")?.device(), try_gpu(0));
/// # Ok::<(), kiln::Error>(())
/// ```
pub type LazyLinear = Lazy<LinearSpec>;

/// What a [`LazyLinear`] is made from: its output size and whether it has
/// a bias; the input size is the input's last dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearSpec {
    /// Outputs.
    pub out_features: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
}

impl LazyLinear {
    /// A layer with `out_features` outputs and a bias.
    pub fn new(out_features: usize) -> LazyLinear {
        Lazy::from_spec(LinearSpec { out_features, bias: true })
    }

    /// Without a bias.
    pub fn without_bias(out_features: usize) -> LazyLinear {
        Lazy::from_spec(LinearSpec { out_features, bias: false })
    }
}

impl LazySpec for LinearSpec {
    type Module = Linear;
    fn name(&self) -> &'static str {
        "LazyLinear"
    }
    fn pending(&self) -> String {
        format!("LazyLinear(in=?, out={}, bias={})", self.out_features, self.bias)
    }
    fn make(&self, x: &Tensor) -> Result<Linear> {
        if x.rank() == 0 {
            return Err(Error::invalid("LazyLinear", "needs an input of rank 1 or more to find its input size"));
        }
        Linear::with_options(x.dims()[x.rank() - 1], self.out_features, self.bias, x.dtype(), &x.device())
    }
}
