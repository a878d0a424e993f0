//! Normalisation layers: [`BatchNorm`] (made by [`BatchNorm1d`] and
//! [`BatchNorm2d`], or lazily by [`LazyBatchNorm1d`] and
//! [`LazyBatchNorm2d`]) and [`LayerNorm`]; and the ResNet [`Residual`]
//! block.

use super::conv::{in_module, LazyConv2d};
use super::lazy::{Lazy, LazySpec};
use super::module::{input_device_mismatch, Module, ParamVisitor};
use crate::{Conv2dArgs, DType, Device, Error, Result, Tensor};

/// Batch normalisation over the channels (dimension 1), PyTorch's
/// `nn.BatchNorm1d` / `nn.BatchNorm2d`: a weight (ones) and a bias (zeros)
/// that are trained, and two buffers, the running mean (zeros) and
/// variance (ones), updated by each training forward with `momentum` 0.1
/// and used in evaluation mode ([`Module::eval`]). The buffers move with
/// [`Module::to`] and are saved in checkpoints.
///
/// ```
/// use kiln::nn::{BatchNorm2d, Module};
/// use kiln::{Tensor, cpu};
/// let mut bn = BatchNorm2d::new(3, &cpu())?;
/// let x = Tensor::randn((4, 3, 2, 2), &cpu())?;
/// let y = bn.forward(&x)?; // training: batch statistics
/// assert_eq!(y.dims(), &[4, 3, 2, 2]);
/// assert_eq!(bn.named_buffers().len(), 2);
/// bn.eval();
/// let _ = bn.forward(&x)?; // evaluation: running statistics
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct BatchNorm {
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    momentum: f64,
    eps: f64,
    training: bool,
    /// 2 (BatchNorm1d: `[N, C]` or `[N, C, L]`) or 4 (BatchNorm2d).
    spatial_rank: usize,
}

/// Makes the [`BatchNorm`] of `[N, C]` or `[N, C, L]` inputs.
pub struct BatchNorm1d;
/// Makes the [`BatchNorm`] of `[N, C, H, W]` inputs.
pub struct BatchNorm2d;

impl BatchNorm1d {
    /// Over `num_features` channels, f32.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(num_features: usize, device: &Device) -> Result<BatchNorm> {
        BatchNorm::with_options(num_features, 2, 1e-5, 0.1, DType::F32, device)
    }
}

impl BatchNorm2d {
    /// Over `num_features` channels, f32.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(num_features: usize, device: &Device) -> Result<BatchNorm> {
        BatchNorm::with_options(num_features, 4, 1e-5, 0.1, DType::F32, device)
    }
}

impl BatchNorm {
    /// `num_features` channels of inputs of rank `rank` (2 for BatchNorm1d,
    /// which also takes rank 3; 4 for BatchNorm2d).
    pub fn with_options(num_features: usize, rank: usize, eps: f64, momentum: f64, dtype: DType, device: &Device) -> Result<BatchNorm> {
        if num_features == 0 {
            return Err(Error::invalid("BatchNorm", "num_features must be at least 1"));
        }
        Ok(BatchNorm {
            weight: Tensor::ones(num_features, dtype, device)?.requires_grad_(),
            bias: Tensor::zeros(num_features, dtype, device)?.requires_grad_(),
            running_mean: Tensor::zeros(num_features, dtype, device)?,
            running_var: Tensor::ones(num_features, dtype, device)?,
            momentum,
            eps,
            training: true,
            spatial_rank: rank,
        })
    }

    /// The running mean (a buffer).
    pub fn running_mean(&self) -> Tensor {
        self.running_mean.clone()
    }

    /// The running variance (a buffer).
    pub fn running_var(&self) -> Tensor {
        self.running_var.clone()
    }

    /// Whether the layer is in training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }
}

impl Module for BatchNorm {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(self.clone()))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        for (what, t) in [("weight", &self.weight), ("running_mean", &self.running_mean), ("running_var", &self.running_var)] {
            if x.device() != t.device() {
                return Err(input_device_mismatch(x.device(), what, t.device()));
            }
        }
        let ok = if self.spatial_rank == 2 { matches!(x.rank(), 2 | 3) } else { x.rank() == 4 };
        if !ok {
            let want = if self.spatial_rank == 2 { "2-D (N, C) or 3-D (N, C, L)" } else { "4-D (N, C, H, W)" };
            return Err(Error::invalid(&self.describe(), format!("input must be {want}, got shape {}", x.shape())));
        }
        x.batch_norm(
            Some(&self.running_mean),
            Some(&self.running_var),
            Some(&self.weight),
            Some(&self.bias),
            self.training,
            self.momentum,
            self.eps,
        )
        .map_err(|e| in_module(e, &self.describe()))
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("weight", &mut self.weight)?;
        f("bias", &mut self.bias)
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        vec![("running_mean".into(), self.running_mean.clone()), ("running_var".into(), self.running_var.clone())]
    }
    fn visit_buffers_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("running_mean", &mut self.running_mean)?;
        f("running_var", &mut self.running_var)
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    fn describe(&self) -> String {
        format!("BatchNorm{}d({}, {})", self.spatial_rank / 2, self.weight.elem_count(), self.weight.device())
    }
}

/// A [`BatchNorm`] whose channel count comes from the first input
/// (PyTorch's `nn.LazyBatchNorm1d`/`2d`): made by [`LazyBatchNorm1d::new`]
/// or [`LazyBatchNorm2d::new`].
pub type LazyBatchNorm = Lazy<BatchNormSpec>;

/// What a [`LazyBatchNorm`] is made from: the rank of the inputs it
/// normalises (2 for `[N, C]`, 4 for `[N, C, H, W]`); the channels are the
/// input's dimension 1. eps 1e-5, momentum 0.1, as PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNormSpec {
    /// 2 (`BatchNorm1d`) or 4 (`BatchNorm2d`).
    pub spatial_rank: usize,
}

/// Makes the lazy [`BatchNorm`] of `[N, C]` or `[N, C, L]` inputs.
pub struct LazyBatchNorm1d;
/// Makes the lazy [`BatchNorm`] of `[N, C, H, W]` inputs.
pub struct LazyBatchNorm2d;

impl LazyBatchNorm1d {
    /// A batch normalisation of `[N, C]` inputs, `C` found at the first forward.
    #[allow(clippy::new_ret_no_self)]
    pub fn new() -> LazyBatchNorm {
        Lazy::from_spec(BatchNormSpec { spatial_rank: 2 })
    }
}

impl LazyBatchNorm2d {
    /// A batch normalisation of `[N, C, H, W]` inputs, `C` found at the first forward.
    #[allow(clippy::new_ret_no_self)]
    pub fn new() -> LazyBatchNorm {
        Lazy::from_spec(BatchNormSpec { spatial_rank: 4 })
    }
}

impl LazySpec for BatchNormSpec {
    type Module = BatchNorm;
    fn name(&self) -> &'static str {
        "LazyBatchNorm"
    }
    fn pending(&self) -> String {
        format!("LazyBatchNorm{}d(?)", self.spatial_rank / 2)
    }
    fn make(&self, x: &Tensor) -> Result<BatchNorm> {
        if x.rank() < 2 {
            return Err(Error::invalid("LazyBatchNorm", format!("input must have a channel dimension, got shape {}", x.shape())));
        }
        BatchNorm::with_options(x.dims()[1], self.spatial_rank, 1e-5, 0.1, x.dtype(), &x.device())
    }
}

/// Layer normalisation over the trailing dimensions `shape`, PyTorch's
/// `nn.LayerNorm`: a weight (ones) and a bias (zeros) of that shape.
///
/// ```
/// use kiln::nn::{LayerNorm, Module};
/// use kiln::{Tensor, cpu};
/// let ln = LayerNorm::new(&[2], &cpu())?;
/// let y = ln.forward(&Tensor::new(&[[1f32, 3.]], &cpu())?)?;
/// assert!((y.to_vec::<f32>()?[1] - 1.0).abs() < 1e-4);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct LayerNorm {
    shape: Vec<usize>,
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// Normalises over the trailing `shape`, eps 1e-5, f32.
    pub fn new(shape: &[usize], device: &Device) -> Result<LayerNorm> {
        Ok(LayerNorm {
            shape: shape.to_vec(),
            weight: Tensor::ones(shape.to_vec(), DType::F32, device)?.requires_grad_(),
            bias: Tensor::zeros(shape.to_vec(), DType::F32, device)?.requires_grad_(),
            eps: 1e-5,
        })
    }
}

impl Module for LayerNorm {
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
        x.layer_norm(&self.shape, Some(&self.weight), Some(&self.bias), self.eps).map_err(|e| in_module(e, &self.describe()))
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("weight", &mut self.weight)?;
        f("bias", &mut self.bias)
    }
    fn describe(&self) -> String {
        format!("LayerNorm({:?}, {})", self.shape, self.weight.device())
    }
}

/// The ResNet residual block of the book (`Residual`): two 3×3 convolutions
/// with batch normalisation and ReLU, plus the input (through a 1×1
/// convolution when `use_1x1conv`, to change channels or stride), then ReLU.
/// Its layers are lazy: input channels come from the first forward.
#[derive(Clone)]
pub struct Residual {
    conv1: LazyConv2d,
    conv2: LazyConv2d,
    conv3: Option<LazyConv2d>,
    bn1: LazyBatchNorm,
    bn2: LazyBatchNorm,
}

impl Residual {
    /// `num_channels` output channels; `strides` of the first convolution.
    pub fn new(num_channels: usize, use_1x1conv: bool, strides: usize) -> Residual {
        Residual {
            conv1: LazyConv2d::new(num_channels, 3, Conv2dArgs::default().padding(1).stride(strides)),
            conv2: LazyConv2d::new(num_channels, 3, Conv2dArgs::default().padding(1)),
            conv3: use_1x1conv.then(|| LazyConv2d::new(num_channels, 1, Conv2dArgs::default().stride(strides))),
            bn1: LazyBatchNorm2d::new(),
            bn2: LazyBatchNorm2d::new(),
        }
    }

    fn children(&self) -> Vec<(&'static str, &dyn Module)> {
        let mut v: Vec<(&'static str, &dyn Module)> = vec![("conv1", &self.conv1), ("conv2", &self.conv2)];
        if let Some(c) = &self.conv3 {
            v.push(("conv3", c));
        }
        v.push(("bn1", &self.bn1));
        v.push(("bn2", &self.bn2));
        v
    }

    fn children_mut(&mut self) -> Vec<(&'static str, &mut dyn Module)> {
        let mut v: Vec<(&'static str, &mut dyn Module)> = vec![("conv1", &mut self.conv1), ("conv2", &mut self.conv2)];
        if let Some(c) = &mut self.conv3 {
            v.push(("conv3", c));
        }
        v.push(("bn1", &mut self.bn1));
        v.push(("bn2", &mut self.bn2));
        v
    }
}

impl Module for Residual {
    fn visit_children(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
        for (_, c) in self.children() {
            f(c)?;
        }
        Ok(())
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(self.clone()))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.bn1.forward(&self.conv1.forward(x)?)?.relu()?;
        let y = self.bn2.forward(&self.conv2.forward(&y)?)?;
        let skip = match &self.conv3 {
            Some(c) => c.forward(x)?,
            None => x.clone(),
        };
        (y + skip)?.relu()
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.children().into_iter().flat_map(|(n, c)| c.named_parameters().into_iter().map(move |(p, t)| (format!("{n}.{p}"), t))).collect()
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        for (n, c) in self.children_mut() {
            c.visit_parameters_mut(&mut |p, t| f(&format!("{n}.{p}"), t))?;
        }
        Ok(())
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.children().into_iter().flat_map(|(n, c)| c.named_buffers().into_iter().map(move |(p, t)| (format!("{n}.{p}"), t))).collect()
    }
    fn visit_buffers_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        for (n, c) in self.children_mut() {
            c.visit_buffers_mut(&mut |p, t| f(&format!("{n}.{p}"), t))?;
        }
        Ok(())
    }
    fn set_training(&mut self, training: bool) {
        for (_, c) in self.children_mut() {
            c.set_training(training);
        }
    }
    fn place_lazy_parameters(&mut self, device: &Device) {
        for (_, c) in self.children_mut() {
            c.place_lazy_parameters(device);
        }
    }
    fn has_lazy_parameters(&self) -> bool {
        self.children().iter().any(|(_, c)| c.has_lazy_parameters())
    }
    fn describe(&self) -> String {
        format!("Residual(conv3={})", self.conv3.is_some())
    }
}
