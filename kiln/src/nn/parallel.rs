//! [`DataParallel`]: a module run on several devices at once, the book's
//! "Concise Implementation for Multiple GPUs" (PyTorch's `nn.DataParallel`),
//! and the replication the data-parallel [`Trainer`](crate::trainer::Trainer)
//! shares with it.

use super::module::{Module, ParamVisitor};
use crate::{comm, Device, Error, Result, Tensor};
use std::panic::Location;

/// A copy of `module` on `device` with tensors of its own: its parameters
/// are copies (new leaves when `leaf`, which then require grad as the
/// originals do; otherwise differentiable copies whose gradients flow back
/// to the originals) and its buffers are detached copies.
pub(crate) fn replicate(module: &dyn Module, device: &Device, leaf: bool) -> Result<Box<dyn Module>> {
    if module.has_lazy_parameters() {
        return Err(Error::invalid(
            "replicate",
            format!(
                "{} has lazy layers whose parameters do not exist yet, so its replicas would start from different values; \
                 run one forward on the first device first (`net.forward(&x)?`) to create them",
                module.describe()
            ),
        ));
    }
    let mut copy = module.boxed_clone().ok_or_else(|| {
        Error::invalid(
            "replicate",
            format!(
                "{} cannot be copied onto other devices: implement `Module::boxed_clone` for it \
                 (for a module that derives Clone: `fn boxed_clone(&self) -> Option<Box<dyn Module>> {{ Some(Box::new(self.clone())) }}`)",
                module.describe()
            ),
        )
    })?;
    copy.visit_parameters_mut(&mut |_, p| {
        *p = if leaf {
            let data = {
                let _g = crate::no_grad();
                p.copy_to(device)?.detach()
            };
            if p.requires_grad() {
                data.requires_grad_()
            } else {
                data
            }
        } else {
            p.to(device)?
        };
        Ok(())
    })?;
    copy.visit_buffers_mut(&mut |_, b| {
        let _g = crate::no_grad();
        *b = b.copy_to(device)?.detach();
        Ok(())
    })?;
    copy.place_lazy_parameters(device);
    Ok(copy)
}

/// Runs a module on several devices at once: each forward cuts the batch
/// along dimension 0 over `devices` ([`comm::scatter`]), runs a replica of
/// the module on each piece, and gathers the outputs on `devices[0]`
/// ([`comm::gather`]). The module itself lives on `devices[0]` and is the
/// first replica; the others are made at each forward from its parameters
/// (differentiable copies, as PyTorch's `DataParallel` broadcasts them), so
/// gradients flow back into the wrapped module's parameters, summed over
/// the devices, and an optimizer over [`Module::parameters`] trains it.
/// Buffers (batch normalisation's running statistics) are copied to the
/// replicas and only the first replica's updates are kept, as in PyTorch.
///
/// The replicas run concurrently on asynchronous devices: their kernels are
/// queued one device after the other and run in parallel. A batch with
/// fewer rows than devices uses fewer devices (PyTorch's `scatter`). Lazy
/// layers work: the first piece runs on the module itself, which makes
/// their parameters before the other replicas copy them. For
/// training on several GPUs the [`Trainer`](crate::trainer::Trainer) with
/// `num_gpus > 1` is faster: it keeps its replicas between steps and moves
/// only gradients.
///
/// ```
/// use kiln::nn::{DataParallel, Linear, Module};
/// use kiln::Tensor;
///
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let net = DataParallel::new(Linear::new(3, 1, &gpus[0])?, &gpus)?;
/// let x = Tensor::ones((4, 3), kiln::DType::F32, &kiln::cpu())?;
/// let y = net.forward(&x)?; // rows 0..2 on gpu 0, rows 2..4 on gpu 1
/// assert_eq!((y.dims(), y.device()), (&[4, 1][..], gpus[0]));
/// y.sum_all()?.backward()?;
/// let g = net.module().weight().grad().unwrap();
/// assert_eq!(g.to_vec::<f32>()?, vec![4., 4., 4.]); // summed over both devices' rows
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct DataParallel<M: Module> {
    module: M,
    devices: Vec<Device>,
}

impl<M: Module> DataParallel<M> {
    /// Wraps `module`, moving it to `devices[0]` (booked at the caller's
    /// line). The devices must exist and be distinct.
    #[track_caller]
    pub fn new(mut module: M, devices: &[Device]) -> Result<DataParallel<M>> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        let Some(first) = devices.first() else {
            return Err(Error::invalid("DataParallel", "needs at least one device"));
        };
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(Error::invalid("DataParallel", format!("{d} is listed twice in the devices")));
            }
            crate::registry::backend(*d)?;
        }
        module.to(first)?;
        Ok(DataParallel { module, devices: devices.to_vec() })
    }

    /// The wrapped module (the first replica).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The wrapped module, mutably.
    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    /// The wrapped module, unwrapped.
    pub fn into_inner(self) -> M {
        self.module
    }

    /// The devices it runs on; outputs are gathered on the first.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }
}

impl<M: Module> Module for DataParallel<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let first = self.devices[0];
        if let Some((name, p)) = self.module.named_parameters().into_iter().find(|(_, p)| p.device() != first) {
            return Err(Error::DeviceMismatch {
                op: format!("DataParallel: parameter `{name}` is on {} but the module must stay on devices[0] = {first}", p.device()),
                lhs: first,
                rhs: p.device(),
            });
        }
        if self.devices.len() == 1 {
            return self.module.forward(&x.to(&first)?);
        }
        let pieces = comm::scatter(x, &self.devices, None)?;
        let mut outputs = Vec::with_capacity(pieces.len());
        for (i, piece) in pieces.iter().enumerate() {
            outputs.push(if i == 0 {
                self.module.forward(piece)?
            } else {
                replicate(&self.module, &self.devices[i], false)?.forward(piece)?
            });
        }
        comm::gather(&outputs, &first)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.module.named_parameters()
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.module.visit_parameters_mut(f)
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.module.named_buffers()
    }
    fn visit_buffers_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.module.visit_buffers_mut(f)
    }
    fn set_training(&mut self, training: bool) {
        self.module.set_training(training)
    }
    fn describe(&self) -> String {
        let devices: Vec<String> = self.devices.iter().map(|d| d.to_string()).collect();
        format!("DataParallel([{}], {})", devices.join(", "), self.module.describe())
    }
    fn place_lazy_parameters(&mut self, device: &Device) {
        self.module.place_lazy_parameters(device)
    }
    fn has_lazy_parameters(&self) -> bool {
        self.module.has_lazy_parameters()
    }
    fn visit_children(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
        f(&self.module)
    }
}
