//! Lazy layers: a layer whose size comes from the first input it sees
//! (PyTorch's `nn.LazyLinear`, `nn.LazyConv2d`, `nn.LazyBatchNorm2d`). One
//! wrapper, [`Lazy`], holds what they share (the device they were placed
//! on, the training mode, the layer once made, and every `Module` method);
//! a [`LazySpec`] says how to make the layer from an input.

use super::module::{input_device_mismatch, lazy_float_input, Module, ParamVisitor};
use crate::{no_grad, Device, Error, Result, Tensor};
use std::sync::OnceLock;

/// How a lazy layer makes its module from the first input: [`Lazy`]
/// checks the input's device and dtype, then asks the spec.
pub trait LazySpec: Clone + Send + Sync + 'static {
    /// The layer made.
    type Module: Module + Clone + 'static;
    /// The layer's name, as errors and `describe` give it.
    fn name(&self) -> &'static str;
    /// The layer's description before an input has made it, e.g.
    /// `LazyLinear(in=?, out=3, bias=true)`.
    fn pending(&self) -> String;
    /// The layer for input `x` (an input of a rank it refuses is an error
    /// saying what it needs), with parameters on `x`'s device in `x`'s dtype.
    fn make(&self, x: &Tensor) -> Result<Self::Module>;
}

/// A layer made from its first input by its [`LazySpec`]; its parameters
/// are created on the input's device, or, after [`Module::to`], on that
/// device (an input elsewhere is then an [`Error::DeviceMismatch`], as in
/// PyTorch). [`LazyLinear`](super::LazyLinear),
/// [`LazyConv2d`](super::LazyConv2d) and
/// [`LazyBatchNorm`](super::LazyBatchNorm) are `Lazy` layers.
///
/// ```
/// use kiln::nn::{LazyLinear, Module};
/// use kiln::{Tensor, DType, cpu};
/// let layer = LazyLinear::new(2);
/// assert!(layer.has_lazy_parameters() && layer.initialized().is_none());
/// layer.forward(&Tensor::ones((4, 3), DType::F32, &cpu())?)?;
/// assert_eq!(layer.initialized().map(|l| l.in_features()), Some(3));
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct Lazy<S: LazySpec> {
    spec: S,
    training: bool,
    device: Option<Device>,
    inner: OnceLock<S::Module>,
}

impl<S: LazySpec> Lazy<S> {
    /// A layer that `spec` will make at the first forward, in training mode.
    pub fn from_spec(spec: S) -> Lazy<S> {
        Lazy { spec, training: true, device: None, inner: OnceLock::new() }
    }
    /// What the layer will be made from.
    pub fn spec(&self) -> &S {
        &self.spec
    }
    /// The layer, once an input has made it.
    pub fn initialized(&self) -> Option<&S::Module> {
        self.inner.get()
    }
    /// The spec, changed by `f` (before the layer is made).
    pub(crate) fn map_spec(mut self, f: impl FnOnce(&mut S)) -> Lazy<S> {
        f(&mut self.spec);
        self
    }
}

impl<S: LazySpec> std::fmt::Debug for Lazy<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl<S: LazySpec> Module for Lazy<S> {
    fn visit_children(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
        match self.inner.get() {
            Some(l) => f(l),
            None => Ok(()),
        }
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(self.clone()))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(layer) = self.inner.get() {
            return layer.forward(x);
        }
        if let Some(d) = self.device
            && x.device() != d
        {
            return Err(input_device_mismatch(x.device(), "weight", d));
        }
        lazy_float_input(&self.describe(), x)?;
        let mut layer = {
            let _g = no_grad();
            self.spec.make(x)?
        };
        layer.set_training(self.training);
        // Another thread may have won the race; either way one layer stays.
        let _ = self.inner.set(layer);
        match self.inner.get() {
            Some(layer) => layer.forward(x),
            None => Err(Error::invalid(self.spec.name(), "initialization failed")),
        }
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.inner.get().map(|l| l.named_parameters()).unwrap_or_default()
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        match self.inner.get_mut() {
            Some(l) => l.visit_parameters_mut(f),
            None => Ok(()),
        }
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.inner.get().map(|l| l.named_buffers()).unwrap_or_default()
    }
    fn visit_buffers_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        match self.inner.get_mut() {
            Some(l) => l.visit_buffers_mut(f),
            None => Ok(()),
        }
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
        if let Some(l) = self.inner.get_mut() {
            l.set_training(training);
        }
    }
    fn place_lazy_parameters(&mut self, device: &Device) {
        if self.inner.get().is_none() {
            self.device = Some(*device);
        }
    }
    fn has_lazy_parameters(&self) -> bool {
        self.inner.get().is_none()
    }
    fn describe(&self) -> String {
        match self.inner.get() {
            Some(l) => format!("Lazy{}", l.describe()),
            None => self.spec.pending(),
        }
    }
}
