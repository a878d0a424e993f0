//! Reverse-mode automatic differentiation. An op whose input requires
//! gradients records a node with its inputs and its gradient rule (written
//! beside the op, in `ops/`); `backward.rs` walks the graph from a scalar in
//! reverse topological order and accumulates gradients into the leaves, on
//! each leaf's own device.

mod backward;
pub(crate) use backward::backward_lockstep;

use crate::tensor::{Backward, Node};
use crate::{Error, Result, Tensor};
use smallvec::SmallVec;
use std::cell::Cell;
use std::sync::{Arc, Mutex};

fn leaf_node() -> Arc<Node> {
    Arc::new(Node { inputs: SmallVec::new(), backward: None, output: None, grad: Mutex::new(None), moved: Mutex::new(None) })
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether operations on this thread record the autograd graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Re-enables recording when dropped.
#[must_use = "recording resumes when this guard is dropped"]
pub struct NoGradGuard {
    previous: bool,
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

/// Stops recording gradients on this thread until the guard drops
/// (inference, optimizer updates; PyTorch's `torch.no_grad()`).
///
/// ```
/// use kiln::{Tensor, cpu};
/// let w = Tensor::new(&[1f32], &cpu())?.requires_grad_();
/// let y = {
///     let _g = kiln::no_grad();
///     (&w * 2.0)?
/// };
/// assert!(!y.requires_grad());
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn no_grad() -> NoGradGuard {
    let previous = GRAD_ENABLED.with(|g| g.replace(false));
    NoGradGuard { previous }
}

/// Attaches a node to `t` when recording and some input requires grad:
/// the inputs, the gradient rule made by `backward` (asked for only then),
/// and, when `keep_output`, `t` itself without its node (for rules that
/// reuse the forward output, such as exp's or sqrt's).
#[inline]
pub(crate) fn record(t: Tensor, inputs: &[&Tensor], keep_output: bool, backward: impl FnOnce() -> Backward) -> Tensor {
    // Most operations record nothing: decide that without a call.
    if inputs.iter().all(|i| i.node.is_none()) {
        return t;
    }
    record_node(t, inputs, keep_output, backward)
}

#[inline(never)]
fn record_node(mut t: Tensor, inputs: &[&Tensor], keep_output: bool, backward: impl FnOnce() -> Backward) -> Tensor {
    if is_grad_enabled() {
        let output = keep_output.then(|| t.detach());
        // Pushed one by one: `collect` into a SmallVec goes through its
        // general `extend`, which costs more than these one or two clones.
        let mut kept = SmallVec::new();
        for &i in inputs {
            kept.push(i.clone());
        }
        let inputs = kept;
        t.node = Some(Arc::new(Node { inputs, backward: Some(backward()), output, grad: Mutex::new(None), moved: Mutex::new(None) }));
    }
    t
}

impl Tensor {
    /// This tensor as a leaf that requires gradients (a parameter). Shares
    /// storage with `self`.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[3f32], &cpu())?.requires_grad_();
    /// let y = x.sqr()?.sum_all()?;
    /// y.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![6.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn requires_grad_(&self) -> Tensor {
        Tensor { storage: self.storage.clone(), layout: self.layout.clone(), node: Some(leaf_node()) }
    }

    /// The parameter as it is now. `Module::to` keeps each parameter's
    /// identity (its autograd leaf and gradient) and moves its data, as
    /// PyTorch's `.to()` does; a handle taken before the move (an optimizer's)
    /// still names the same parameter, and `latest()` gives its data on the
    /// new device. For any other tensor this is a clone.
    ///
    /// ```
    /// use kiln::nn::{Linear, Module};
    /// use kiln::try_gpu;
    /// let mut net = Linear::new(2, 1, &kiln::cpu())?;
    /// let before = net.weight();
    /// net.to(&try_gpu(0))?;
    /// assert!(before.latest().same_parameter(&net.weight()));
    /// assert_eq!(before.latest().device(), try_gpu(0));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn latest(&self) -> Tensor {
        let Some(node) = &self.node else { return self.clone() };
        match &*node.moved.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(data) => Tensor { storage: data.storage.clone(), layout: data.layout.clone(), node: self.node.clone() },
            None => self.clone(),
        }
    }

    /// True when both are handles of one parameter (one autograd leaf),
    /// wherever its data lives now.
    pub fn same_parameter(&self, other: &Tensor) -> bool {
        match (&self.node, &other.node) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b) && self.is_leaf(),
            _ => false,
        }
    }

    /// This parameter with `data` (already on its new device) as its
    /// contents: same leaf, so the gradient slot and every earlier handle
    /// follow. `grad` is the gradient moved alongside, if there was one.
    pub(crate) fn relocated(&self, data: Tensor, grad: Option<Tensor>) -> Tensor {
        let data = data.detach();
        match &self.node {
            Some(node) if self.is_leaf() => {
                *node.moved.lock().unwrap_or_else(|e| e.into_inner()) = Some(data.clone());
                if let Some(g) = grad {
                    *node.grad.lock().unwrap_or_else(|e| e.into_inner()) = Some(g);
                }
                Tensor { storage: data.storage, layout: data.layout, node: self.node.clone() }
            }
            _ => data,
        }
    }
    /// True when this tensor is recorded for autograd.
    pub fn requires_grad(&self) -> bool {
        self.node.is_some()
    }
    /// True for a parameter created with `requires_grad_`.
    pub fn is_leaf(&self) -> bool {
        matches!(self.node.as_deref(), Some(Node { backward: None, .. }))
    }
    /// The same values, cut from the graph.
    pub fn detach(&self) -> Tensor {
        Tensor { storage: self.storage.clone(), layout: self.layout.clone(), node: None }
    }
    /// The gradient accumulated into this leaf by `backward`, on its device.
    pub fn grad(&self) -> Option<Tensor> {
        let node = self.node.as_ref()?;
        node.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// Clears this leaf's gradient.
    pub fn zero_grad(&self) {
        if let Some(node) = &self.node {
            *node.grad.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
    /// Replaces this leaf's gradient (for gradient clipping and the like).
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        let node = self
            .node
            .as_ref()
            .ok_or_else(|| Error::invalid("set_grad", "this tensor does not require grad; call requires_grad_() first"))?;
        *node.grad.lock().unwrap_or_else(|e| e.into_inner()) = grad;
        Ok(())
    }
}
