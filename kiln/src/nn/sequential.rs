//! [`Sequential`]: layers applied one after the other, reachable by index
//! (the chapter's `net[0].weight.data.device`).

use super::module::{in_layer, Module, ParamVisitor};
use crate::{Result, Tensor};

/// Layers applied in order. `net[i]` is the i-th layer; parameters are named
/// `"{i}.{name}"` (`"0.weight"`), as in PyTorch.
///
/// ```
/// use kiln::nn::{Linear, Module, ReLU, Sequential};
/// use kiln::{Tensor, DType, cpu};
/// let net = Sequential::new()
///     .add(Linear::new(4, 8, &cpu())?)
///     .add(ReLU)
///     .add(Linear::new(8, 1, &cpu())?);
/// assert_eq!(net.len(), 3);
/// assert_eq!(net[0].parameter("weight")?.device(), cpu());
/// let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
/// let y = net.forward(&Tensor::ones((5, 4), DType::F32, &cpu())?)?;
/// assert_eq!(y.dims(), &[5, 1]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Sequential {
    /// An empty stack (its forward is the identity).
    pub fn new() -> Sequential {
        Sequential { layers: Vec::new() }
    }

    /// Appends a layer (builder style; the book's `net.add(...)`).
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: Module + 'static>(mut self, layer: M) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }

    /// Appends a layer.
    pub fn push<M: Module + 'static>(&mut self, layer: M) {
        self.layers.push(Box::new(layer));
    }

    /// Appends an already boxed layer.
    pub fn push_boxed(&mut self, layer: Box<dyn Module>) {
        self.layers.push(layer);
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// True when there is no layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The i-th layer, if there is one.
    pub fn get(&self, i: usize) -> Option<&dyn Module> {
        self.layers.get(i).map(|l| &**l)
    }

    /// The i-th layer, mutably.
    pub fn get_mut(&mut self, i: usize) -> Option<&mut (dyn Module + 'static)> {
        self.layers.get_mut(i).map(|l| &mut **l)
    }
}

impl std::ops::Index<usize> for Sequential {
    type Output = dyn Module;
    /// The i-th layer; panics when out of range, like indexing a `Vec`
    /// (use [`Sequential::get`] to check).
    fn index(&self, i: usize) -> &Self::Output {
        &*self.layers[i]
    }
}

impl Module for Sequential {
    fn visit_children(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
        for layer in &self.layers {
            f(&**layer)?;
        }
        Ok(())
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        let layers = self.layers.iter().map(|l| l.boxed_clone()).collect::<Option<Vec<_>>>()?;
        Some(Box::new(Sequential { layers }))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h).map_err(|e| in_layer(e, i))?;
        }
        Ok(h)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (name, t) in layer.named_parameters() {
                out.push((format!("{i}.{name}"), t));
            }
        }
        out
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.visit_parameters_mut(&mut |name, t| f(&format!("{i}.{name}"), t))?;
        }
        Ok(())
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (name, t) in layer.named_buffers() {
                out.push((format!("{i}.{name}"), t));
            }
        }
        out
    }
    fn visit_buffers_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.visit_buffers_mut(&mut |name, t| f(&format!("{i}.{name}"), t))?;
        }
        Ok(())
    }
    fn place_lazy_parameters(&mut self, device: &crate::Device) {
        for layer in &mut self.layers {
            layer.place_lazy_parameters(device);
        }
    }
    fn has_lazy_parameters(&self) -> bool {
        self.layers.iter().any(|l| l.has_lazy_parameters())
    }
    fn set_training(&mut self, training: bool) {
        for layer in &mut self.layers {
            layer.set_training(training);
        }
    }
    fn describe(&self) -> String {
        let inner: Vec<String> = self.layers.iter().enumerate().map(|(i, l)| format!("  ({i}) {}", l.describe())).collect();
        format!("Sequential(\n{}\n)", inner.join("\n"))
    }
}
