//! The [`Module`] trait: a forward function plus named parameters that can be
//! listed (for optimizers and checkpoints), moved to a device, and switched
//! between training and evaluation.

use crate::{Device, Error, Result, Tensor};

/// Visits each parameter by name, mutably: the one primitive that moving,
/// loading and re-initialising a model are built on.
pub type ParamVisitor<'a> = dyn FnMut(&str, &mut Tensor) -> Result<()> + 'a;

/// A layer, a stack of layers, or a whole model.
///
/// Implementors write `forward` and, when they hold parameters,
/// `named_parameters` and `visit_parameters_mut`; the rest is provided. A
/// model written "from scratch" with plain tensors as fields (the chapter's
/// `set_scratch_params_device`) implements the same two methods and can then
/// be moved with [`Module::to`] and saved with [`crate::checkpoint`].
///
/// ```
/// use kiln::nn::{Module, ParamVisitor};
/// use kiln::{Tensor, cpu, Result};
///
/// /// y = x·w + b, with plain tensors as parameters.
/// struct Scratch { w: Tensor, b: Tensor }
///
/// impl Module for Scratch {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         x.matmul(&self.w)?.add(&self.b)
///     }
///     fn named_parameters(&self) -> Vec<(String, Tensor)> {
///         vec![("w".into(), self.w.clone()), ("b".into(), self.b.clone())]
///     }
///     fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
///         f("w", &mut self.w)?;
///         f("b", &mut self.b)
///     }
/// }
///
/// let mut m = Scratch {
///     w: Tensor::new(&[[2f32], [-3.4]], &cpu())?.requires_grad_(),
///     b: Tensor::new(&[4.2f32], &cpu())?.requires_grad_(),
/// };
/// m.to(&kiln::try_gpu(0))?;
/// assert_eq!(m.w.device(), kiln::try_gpu(0));
/// assert!(m.w.requires_grad());
/// # Ok::<(), kiln::Error>(())
/// ```
pub trait Module {
    /// Computes the output for a batch `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Every parameter with its dotted name (`"0.weight"`), in a fixed order.
    /// The tensors share storage with the module's own.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// Calls `f` on every parameter, by name, with the right to replace it.
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        let _ = f;
        Ok(())
    }

    /// Every buffer with its dotted name (`"1.running_mean"`): module state
    /// that is not trained (batch normalisation's running statistics). Like
    /// parameters, buffers move with [`Module::to`] and are saved in
    /// checkpoints; optimizers never see them.
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// Calls `f` on every buffer, by name, with the right to replace it.
    fn visit_buffers_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        let _ = f;
        Ok(())
    }

    /// Switches training behaviour (dropout) on or off.
    fn set_training(&mut self, training: bool) {
        let _ = training;
    }

    /// A short description, used in `Debug` output of containers.
    fn describe(&self) -> String {
        let name = std::any::type_name::<Self>();
        name.rsplit("::").next().unwrap_or(name).to_string()
    }

    /// The parameters, without names.
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }

    /// The parameter called `name` (e.g. `"weight"`, `"0.bias"`).
    ///
    /// ```
    /// use kiln::nn::{Linear, Module};
    /// let layer = Linear::new(3, 2, &kiln::cpu())?;
    /// assert_eq!(layer.parameter("weight")?.dims(), &[2, 3]);
    /// assert!(layer.parameter("gamma").is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    fn parameter(&self, name: &str) -> Result<Tensor> {
        let all = self.named_parameters();
        let names: Vec<String> = all.iter().map(|(n, _)| n.clone()).collect();
        all.into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .ok_or_else(|| Error::invalid("parameter", format!("no parameter named `{name}`; this module has [{}]", names.join(", "))))
    }

    /// Total number of scalar parameters.
    fn num_parameters(&self) -> usize {
        self.named_parameters().iter().map(|(_, t)| t.elem_count()).sum()
    }

    /// Moves every parameter to `device` (PyTorch's `net.to(device)`). A
    /// parameter already there stays the very same tensor (same storage);
    /// one elsewhere is copied and becomes a new parameter on `device`.
    #[track_caller]
    fn to(&mut self, device: &Device) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        let device = *device;
        // Copy first, then swap in, so that a failure (e.g. out of memory)
        // leaves the module where it was. A moved parameter keeps its
        // identity (autograd leaf, gradient): optimizers built before the
        // move follow it (see `Tensor::latest`).
        let mut moved: Vec<Option<(Tensor, Option<Tensor>)>> = Vec::new();
        self.visit_parameters_mut(&mut |_, p| {
            moved.push(if p.device() == device {
                None
            } else {
                let _g = crate::no_grad();
                let data = p.to(&device)?.detach();
                let grad = p.grad().map(|g| g.to(&device)).transpose()?;
                Some((data, grad))
            });
            Ok(())
        })?;
        let mut buffers: Vec<Option<Tensor>> = Vec::new();
        self.visit_buffers_mut(&mut |_, b| {
            buffers.push(if b.device() == device { None } else { Some(b.to(&device)?.detach()) });
            Ok(())
        })?;
        let mut it = moved.into_iter();
        self.visit_parameters_mut(&mut |_, p| {
            if let Some(Some((data, grad))) = it.next() {
                // A frozen parameter stays frozen on its new device.
                *p = p.relocated(data, grad);
            }
            Ok(())
        })?;
        let mut it = buffers.into_iter();
        self.visit_buffers_mut(&mut |_, b| {
            if let Some(Some(new)) = it.next() {
                *b = new;
            }
            Ok(())
        })?;
        self.place_lazy_parameters(&device);
        Ok(())
    }

    /// Records where parameters that do not exist yet (those of lazy layers,
    /// created at the first forward) will be created; [`Module::to`] calls
    /// it. Containers pass it to their children; other modules ignore it.
    fn place_lazy_parameters(&mut self, device: &Device) {
        let _ = device;
    }

    /// True while some parameter does not exist yet (a lazy layer that has
    /// not seen an input); the [`Trainer`](crate::trainer::Trainer) runs one
    /// forward to create them before it builds the optimizer.
    fn has_lazy_parameters(&self) -> bool {
        false
    }

    /// Creates the parameters of the model's lazy layers
    /// ([`LazyLinear`](crate::nn::LazyLinear),
    /// [`LazyConv2d`](crate::nn::LazyConv2d), the lazy batch norms) from a
    /// sample batch `x`: one forward without gradients and in evaluation
    /// mode (no dropout draw, no running-statistics update), after which
    /// every parameter exists, on `x`'s device (or where [`Module::to`]
    /// said). d2l's `model.apply_init([X], init)` does the same forward;
    /// call it before [`checkpoint::load`](crate::checkpoint::load), an
    /// initializer such as [`init_cnn`](crate::nn::init_cnn), or building an
    /// optimizer. A model without lazy layers is left as it is, and the
    /// model is in training mode afterwards (where a new model starts).
    ///
    /// ```
    /// use kiln::models::lenet;
    /// use kiln::nn::Module;
    /// use kiln::{DType, Tensor};
    /// let mut net = lenet(10);
    /// assert!(net.named_parameters().is_empty());
    /// net.init_lazy(&Tensor::zeros((1, 1, 28, 28), DType::F32, &kiln::try_gpu(0))?)?;
    /// assert_eq!(net.parameter("0.weight")?.dims(), &[6, 1, 5, 5]);
    /// assert_eq!(net.devices(), vec![kiln::try_gpu(0)]);
    /// assert!(!net.has_lazy_parameters());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    fn init_lazy(&mut self, x: &Tensor) -> Result<()> {
        if !self.has_lazy_parameters() {
            return Ok(());
        }
        let out = {
            let _g = crate::no_grad();
            self.eval();
            let out = self.forward(x);
            self.train();
            out
        };
        out?;
        if self.has_lazy_parameters() {
            return Err(Error::invalid(
                "init_lazy",
                format!(
                    "{} still has lazy layers without parameters after a forward of the sample; does its forward skip a layer?",
                    self.describe()
                ),
            ));
        }
        Ok(())
    }

    /// Calls `f` on each direct child: the layers of a
    /// [`Sequential`](crate::nn::Sequential), the convolutions and norms of a
    /// [`Residual`](crate::nn::Residual), the layer a lazy layer has made.
    /// [`Module::apply`] walks the tree with it; a container of your own
    /// implements it to be walked.
    fn visit_children(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
        let _ = f;
        Ok(())
    }

    /// This module as [`std::any::Any`], so that a visitor of
    /// [`Module::apply`] can ask which layer it holds
    /// (`m.as_any().and_then(|a| a.downcast_ref::<Linear>())`, PyTorch's
    /// `type(m) == nn.Linear`). kiln's layers return `Some`; the default is
    /// `None`.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// Calls `f` on every submodule, children before their parent, then on
    /// this module itself: PyTorch's `nn.Module.apply`, e.g. with
    /// [`init_cnn`](crate::nn::init_cnn) (d2l's `net.apply(init_cnn)`). The
    /// first error stops the walk. A lazy layer's parameters are visited
    /// once it has them (after [`Module::init_lazy`]): its child is the
    /// layer it made. (On a `&dyn Module`, call [`apply`](crate::nn::apply).)
    ///
    /// ```
    /// use kiln::nn::{Linear, Module, ReLU, Sequential};
    /// let net = Sequential::new().add(Linear::new(2, 3, &kiln::cpu())?).add(ReLU).add(Linear::new(3, 1, &kiln::cpu())?);
    /// let mut linears = 0;
    /// net.apply(&mut |m| {
    ///     if m.as_any().and_then(|a| a.downcast_ref::<Linear>()).is_some() {
    ///         linears += 1;
    ///     }
    ///     Ok(())
    /// })?;
    /// assert_eq!(linears, 2);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    fn apply(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()>
    where
        Self: Sized,
    {
        apply_dyn(self, f)
    }

    /// The devices the parameters live on, without repeats, in order.
    fn devices(&self) -> Vec<Device> {
        let mut out: Vec<Device> = Vec::new();
        for (_, p) in self.named_parameters() {
            if !out.contains(&p.device()) {
                out.push(p.device());
            }
        }
        out
    }

    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }

    /// Training mode (dropout active).
    fn train(&mut self) {
        self.set_training(true);
    }

    /// Evaluation mode (dropout is the identity).
    fn eval(&mut self) {
        self.set_training(false);
    }

    /// A copy of this module that shares its tensors (parameters and
    /// buffers), boxed: what data-parallel training
    /// ([`DataParallel`](crate::nn::DataParallel), the
    /// [`Trainer`](crate::trainer::Trainer) on several GPUs) replicates a
    /// model from, giving each replica tensors of its own on its device.
    /// `None`, the default, when the module cannot be copied; kiln's layers
    /// and [`Sequential`](crate::nn::Sequential) return `Some`. A module of
    /// your own that derives `Clone` implements it in one line:
    ///
    /// ```
    /// use kiln::nn::{Module, ParamVisitor};
    /// use kiln::{Result, Tensor};
    ///
    /// #[derive(Clone)]
    /// struct Scale { w: Tensor }
    ///
    /// impl Module for Scale {
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> { x.mul(&self.w) }
    ///     fn named_parameters(&self) -> Vec<(String, Tensor)> { vec![("w".into(), self.w.clone())] }
    ///     fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> { f("w", &mut self.w) }
    ///     fn boxed_clone(&self) -> Option<Box<dyn Module>> { Some(Box::new(self.clone())) }
    /// }
    ///
    /// let m = Scale { w: Tensor::new(&[2f32], &kiln::cpu())?.requires_grad_() };
    /// let copy = m.boxed_clone().unwrap();
    /// assert!(copy.parameter("w")?.same_storage(&m.w));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        None
    }
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        (**self).named_parameters()
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        (**self).visit_parameters_mut(f)
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        (**self).named_buffers()
    }
    fn visit_buffers_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        (**self).visit_buffers_mut(f)
    }
    fn set_training(&mut self, training: bool) {
        (**self).set_training(training)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn place_lazy_parameters(&mut self, device: &Device) {
        (**self).place_lazy_parameters(device)
    }
    fn has_lazy_parameters(&self) -> bool {
        (**self).has_lazy_parameters()
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        (**self).boxed_clone()
    }
    fn visit_children(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
        (**self).visit_children(f)
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        (**self).as_any()
    }
    fn init_lazy(&mut self, x: &Tensor) -> Result<()> {
        (**self).init_lazy(x)
    }
}

/// [`Module::apply`] on a layer reached as `&dyn Module` (`&net[0]`, a
/// child in a visitor), where the method cannot be called: every
/// submodule, children first, then `module`.
///
/// ```
/// use kiln::nn::{apply, Linear, Module, Sequential};
/// let net = Sequential::new().add(Linear::new(2, 3, &kiln::cpu())?);
/// let mut seen = Vec::new();
/// apply(&net[0], &mut |m| Ok(seen.push(m.describe())))?;
/// assert_eq!(seen.len(), 1);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn apply(module: &dyn Module, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
    apply_dyn(module, f)
}

/// [`Module::apply`]'s walk: children first, then `m`.
fn apply_dyn(m: &dyn Module, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
    m.visit_children(&mut |c| apply_dyn(c, f))?;
    f(m)
}

/// A lazy layer's refusal of an input it cannot make float weights for: the
/// weights would take the input's dtype (an integer image, say), and the
/// layer's arithmetic needs f32 or f64, as PyTorch's convolution refuses a
/// uint8 input.
pub(crate) fn lazy_float_input(layer: &str, x: &Tensor) -> Result<()> {
    match x.dtype() {
        crate::DType::F32 | crate::DType::F64 => Ok(()),
        dtype => Err(Error::UnsupportedDType {
            op: format!("{layer} input (its weights take the input's dtype, and must be f32 or f64)"),
            dtype,
        }),
    }
}

/// The error of a forward pass whose input is on another device than a
/// parameter: "input is on cpu while weight is on gpu(0)". Containers
/// prefix the name with the layer (`layer 0 weight`).
pub(crate) fn input_device_mismatch(input: Device, param: &str, param_device: Device) -> Error {
    Error::DeviceMismatch { op: format!("input is on {input} while {param} is on {param_device}"), lhs: input, rhs: param_device }
}

/// Names the layer in a device mismatch raised by a child of a container.
pub(crate) fn in_layer(e: Error, index: usize) -> Error {
    match e {
        Error::DeviceMismatch { op, lhs, rhs } if op.starts_with("input is on ") => {
            let op = op.replacen(" while ", &format!(" while layer {index} "), 1);
            Error::DeviceMismatch { op, lhs, rhs }
        }
        other => other,
    }
}
