//! The backward pass: from a one-element output, each node's gradient rule
//! in reverse topological order, gradients summed where a tensor is used
//! more than once, and accumulated into the leaves.

use super::no_grad;
use crate::tensor::{GradCtx, Node};
use crate::{Error, Result, Tensor};
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

impl Tensor {
    /// Backpropagates from this one-element tensor, adding d(self)/d(leaf)
    /// into every leaf's `grad()`. Gradients that cross devices (through a
    /// `to`) are booked in the transfer ledger at the caller's line.
    #[track_caller]
    pub fn backward(&self) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        if self.elem_count() != 1 {
            return Err(Error::invalid(
                "backward",
                format!(
                    "needs a one-element tensor, got shape {}; reduce it first (e.g. `.sum_all()?`) or use `backward_with`",
                    self.shape()
                ),
            ));
        }
        let seed = {
            let _g = no_grad();
            self.ones_like()?
        };
        self.backward_with(&seed)
    }

    /// Backpropagates with an explicit output gradient of `self`'s shape.
    #[track_caller]
    pub fn backward_with(&self, seed: &Tensor) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        let root =
            self.node.as_ref().ok_or_else(|| Error::invalid("backward", "this tensor does not depend on any tensor that requires grad"))?;
        if seed.dims() != self.dims() {
            return Err(Error::shape("backward", self.dims(), seed.dims()));
        }
        let _g = no_grad();
        let mut pass = Pass::new(root, seed);
        while pass.step(&mut |_| Ok(()))? {}
        Ok(())
    }
}

/// Backpropagates from several one-element outputs at once, node by node
/// in turn (the k-th node of each graph, then the (k+1)-th...), calling
/// `on_leaf(i, leaf)` as soon as the gradient of a leaf of graph `i` is
/// final (accumulated into its `grad()`), with the leaf's identity
/// ([`Tensor::node_id`]). The data-parallel trainer runs its replicas'
/// backward passes so, and starts reducing a bucket of gradients as soon
/// as every replica has produced it, while the rest of backward is queued
/// behind it.
pub(crate) fn backward_lockstep(roots: &[&Tensor], on_leaf: &mut dyn FnMut(usize, usize) -> Result<()>) -> Result<()> {
    let _g = no_grad();
    let mut passes = Vec::with_capacity(roots.len());
    for root in roots {
        let node =
            root.node.as_ref().ok_or_else(|| Error::invalid("backward", "this tensor does not depend on any tensor that requires grad"))?;
        if root.elem_count() != 1 {
            return Err(Error::invalid("backward", format!("needs a one-element tensor, got shape {}", root.shape())));
        }
        passes.push((node, root.ones_like()?));
    }
    let mut passes: Vec<Pass<'_>> = passes.iter().map(|(node, seed)| Pass::new(node, seed)).collect();
    let mut live = passes.len();
    while live > 0 {
        live = 0;
        for (i, pass) in passes.iter_mut().enumerate() {
            if pass.step(&mut |leaf| on_leaf(i, leaf))? {
                live += 1;
            }
        }
    }
    Ok(())
}

/// One backward pass in progress: the graph's nodes in reverse topological
/// order, and the gradients flowing into the nodes not yet visited.
struct Pass<'a> {
    order: std::vec::IntoIter<&'a Node>,
    grads: PtrMap<Tensor>,
}

impl<'a> Pass<'a> {
    fn new(root: &'a Arc<Node>, seed: &Tensor) -> Pass<'a> {
        let order = topological(root);
        let mut grads: PtrMap<Tensor> = PtrMap::with_capacity_and_hasher(order.len(), Default::default());
        grads.insert(key(root), seed.clone());
        Pass { order: order.into_iter(), grads }
    }

    /// Visits the next node; false when there was none. `on_leaf` gets the
    /// key of a leaf whose gradient was just accumulated (its last use).
    fn step(&mut self, on_leaf: &mut dyn FnMut(usize) -> Result<()>) -> Result<bool> {
        let Some(node) = self.order.next() else { return Ok(false) };
        let Some(g) = self.grads.remove(&node_key(node)) else { return Ok(true) };
        let Some(rule) = &node.backward else {
            // A leaf: accumulate.
            {
                let mut slot = node.grad.lock().unwrap_or_else(|e| e.into_inner());
                *slot = Some(match slot.take() {
                    Some(old) => old.add(&g)?,
                    None => g.contiguous()?,
                });
            }
            on_leaf(node_key(node))?;
            return Ok(true);
        };
        let input_grads = rule(&GradCtx { g: &g, inputs: &node.inputs, output: node.output.as_ref() })?;
        if input_grads.len() != node.inputs.len() {
            return Err(Error::invalid(
                "backward",
                format!(
                    "a gradient rule gave {} gradients for {} inputs (a kiln bug: please report it)",
                    input_grads.len(),
                    node.inputs.len()
                ),
            ));
        }
        for (input, ig) in node.inputs.iter().zip(input_grads) {
            let (Some(n), Some(ig)) = (&input.node, ig) else { continue };
            let k = key(n);
            let acc = match self.grads.remove(&k) {
                Some(old) => old.add(&ig)?,
                None => ig,
            };
            self.grads.insert(k, acc);
        }
        Ok(true)
    }
}

impl Tensor {
    /// The identity of this tensor's autograd node (a parameter's, for a
    /// leaf), as [`backward_lockstep`] reports leaves; `None` when it does
    /// not require grad.
    pub(crate) fn node_id(&self) -> Option<usize> {
        self.node.as_ref().map(key)
    }
}

/// Hashes node addresses with one multiply: SipHash costs more than the
/// small kernels of a training step.
#[derive(Default)]
struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type PtrMap<V> = HashMap<usize, V, BuildHasherDefault<PtrHasher>>;

fn key(n: &Arc<Node>) -> usize {
    Arc::as_ptr(n) as usize
}

fn node_key(n: &Node) -> usize {
    n as *const Node as usize
}

/// Nodes reachable from `root`, each after every node that uses it. The
/// references live as long as `root`, which owns the graph.
fn topological(root: &Arc<Node>) -> Vec<&Node> {
    let mut post = Vec::with_capacity(16);
    let mut seen: HashSet<usize, BuildHasherDefault<PtrHasher>> = HashSet::with_capacity_and_hasher(32, Default::default());
    let mut stack: Vec<(&Node, bool)> = Vec::with_capacity(16);
    stack.push((&**root, false));
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            post.push(node);
            continue;
        }
        if !seen.insert(node_key(node)) {
            continue;
        }
        stack.push((node, true));
        for input in &node.inputs {
            if let Some(n) = &input.node
                && !seen.contains(&key(n))
            {
                stack.push((&**n, false));
            }
        }
    }
    post.reverse();
    post
}
