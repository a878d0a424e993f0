//! Reverse-mode automatic differentiation. An operation whose input
//! requires gradients records a node naming the op and its inputs;
//! `backward` walks the graph from a scalar in reverse topological order and
//! accumulates gradients into the leaves, on each leaf's own device.

use crate::op::{BinaryOp, ReduceOp, UnaryOp};
use crate::{Error, Result, Tensor};
use smallvec::{smallvec, SmallVec};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// The gradients of a node's inputs (most ops have one or two).
type Grads = SmallVec<[(Tensor, Tensor); 2]>;
use std::sync::{Arc, Mutex};

/// What produced a tensor, with the inputs its gradient needs.
pub(crate) enum BackOp {
    Leaf,
    Unary(UnaryOp, Tensor),
    Binary(BinaryOp, Tensor, Tensor),
    Reduce(ReduceOp, Tensor, Vec<usize>),
    Matmul(Tensor, Tensor),
    Reshape(Tensor),
    Permute(Tensor, Vec<usize>),
    Narrow(Tensor, usize, usize),
    Broadcast(Tensor),
    IndexSelect(Tensor, Tensor, usize),
    /// dst, ids, src, dim
    IndexAdd(Tensor, Tensor, Tensor, usize),
    Cat(Vec<Tensor>, usize),
    Cast(Tensor),
    Where(Tensor, Tensor, Tensor),
    ToDevice(Tensor),
}

/// A node of the autograd graph. Leaves keep their accumulated gradient.
pub(crate) struct Node {
    op: BackOp,
    grad: Mutex<Option<Tensor>>,
    /// For a parameter (leaf) that `Module::to` moved: its data now, without
    /// a node (a handle taken before the move finds it here).
    moved: Mutex<Option<Tensor>>,
}

fn leaf_node() -> Arc<Node> {
    Arc::new(Node { op: BackOp::Leaf, grad: Mutex::new(None), moved: Mutex::new(None) })
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

/// Attaches a node to `t` when recording and some input requires grad.
#[inline]
pub(crate) fn record(t: Tensor, op: impl FnOnce() -> BackOp, inputs: &[&Tensor]) -> Tensor {
    // Most operations record nothing: decide that without a call.
    if inputs.iter().all(|i| i.node.is_none()) {
        return t;
    }
    record_node(t, op)
}

#[inline(never)]
fn record_node(mut t: Tensor, op: impl FnOnce() -> BackOp) -> Tensor {
    if is_grad_enabled() {
        t.node = Some(Arc::new(Node { op: op(), grad: Mutex::new(None), moved: Mutex::new(None) }));
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
        matches!(self.node.as_deref(), Some(Node { op: BackOp::Leaf, .. }))
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
        let order = topological(root);
        let mut grads: PtrMap<Tensor> = PtrMap::with_capacity_and_hasher(order.len(), Default::default());
        grads.insert(key(root), seed.clone());
        for node in order {
            let Some(g) = grads.remove(&node_key(node)) else { continue };
            if let BackOp::Leaf = node.op {
                let mut slot = node.grad.lock().unwrap_or_else(|e| e.into_inner());
                *slot = Some(match slot.take() {
                    Some(old) => old.add(&g)?,
                    None => g.contiguous()?,
                });
                continue;
            }
            for (input, ig) in input_grads(&node.op, &g)? {
                let Some(n) = &input.node else { continue };
                let k = key(n);
                let acc = match grads.remove(&k) {
                    Some(old) => old.add(&ig)?,
                    None => ig,
                };
                grads.insert(k, acc);
            }
        }
        Ok(())
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

fn inputs(op: &BackOp) -> SmallVec<[&Tensor; 3]> {
    match op {
        BackOp::Leaf => smallvec![],
        BackOp::Unary(_, x)
        | BackOp::Reduce(_, x, _)
        | BackOp::Reshape(x)
        | BackOp::Permute(x, _)
        | BackOp::Narrow(x, _, _)
        | BackOp::Broadcast(x)
        | BackOp::IndexSelect(x, _, _)
        | BackOp::Cast(x)
        | BackOp::ToDevice(x) => smallvec![x],
        BackOp::Binary(_, a, b) | BackOp::Matmul(a, b) => smallvec![a, b],
        BackOp::Where(_, a, b) => smallvec![a, b],
        BackOp::IndexAdd(d, _, s, _) => smallvec![d, s],
        BackOp::Cat(xs, _) => xs.iter().collect(),
    }
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
        for input in inputs(&node.op) {
            if let Some(n) = &input.node {
                if !seen.contains(&key(n)) {
                    stack.push((&**n, false));
                }
            }
        }
    }
    post.reverse();
    post
}

/// 0/1 of `x`'s dtype where `cmp(x, s)` holds.
fn mask_scalar(x: &Tensor, op: BinaryOp, s: f64) -> Result<Tensor> {
    let s = Tensor::full(s, (), x.dtype(), &x.device())?;
    x.binary(&s, op)?.to_dtype(x.dtype())
}

/// A 0-d tensor of `x`'s dtype and device.
fn scalar_like(x: &Tensor, v: f64) -> Result<Tensor> {
    Tensor::full(v, (), x.dtype(), &x.device())
}

/// `g` with zeros where the u8 `cond` is set (PyTorch's `masked_fill(cond,
/// 0)`: an infinite or NaN gradient there becomes 0, not NaN as `g · 0`).
fn zero_where(cond: &Tensor, g: &Tensor) -> Result<Tensor> {
    cond.where_cond(&scalar_like(g, 0.0)?, g)
}

/// Sums a broadcast gradient back down to `shape`.
pub(crate) fn sum_to(g: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if g.dims() == shape {
        return Ok(g.clone());
    }
    let extra = g.rank() - shape.len();
    let mut dims: Vec<usize> = (0..extra).collect();
    for (i, &s) in shape.iter().enumerate() {
        if s == 1 && g.dims()[extra + i] != 1 {
            dims.push(extra + i);
        }
    }
    g.sum_dims(&dims, true)?.reshape(shape)
}

fn input_grads(op: &BackOp, g: &Tensor) -> Result<Grads> {
    Ok(match op {
        BackOp::Leaf => smallvec![],
        BackOp::Unary(u, x) => {
            let d = match *u {
                UnaryOp::Neg => g.neg()?,
                UnaryOp::Abs => g.mul(&mask_scalar(x, BinaryOp::Gt, 0.0)?.sub(&mask_scalar(x, BinaryOp::Lt, 0.0)?)?)?,
                UnaryOp::Exp => g.mul(&x.exp()?)?,
                UnaryOp::Log => g.div(x)?,
                UnaryOp::Sqrt => g.div(&x.sqrt()?.mul_scalar(2.0)?)?,
                UnaryOp::Sqr => g.mul(&x.mul_scalar(2.0)?)?,
                UnaryOp::Recip => g.neg()?.div(&x.sqr()?)?,
                UnaryOp::Sin => g.mul(&x.cos()?)?,
                UnaryOp::Cos => g.mul(&x.sin()?.neg()?)?,
                UnaryOp::Tanh => g.mul(&x.tanh()?.sqr()?.unary(UnaryOp::RSubScalar(1.0))?)?,
                UnaryOp::Sigmoid => {
                    let s = x.sigmoid()?;
                    g.mul(&s.mul(&s.unary(UnaryOp::RSubScalar(1.0))?)?)?
                }
                // PyTorch's threshold_backward: zero where x <= 0, else g (a
                // NaN input passes the gradient through).
                UnaryOp::Relu => zero_where(&x.binary(&scalar_like(x, 0.0)?, BinaryOp::Le)?, g)?,
                // d/dx x^0 = 0 everywhere, 0 included (not 0 · x^-1 = NaN).
                UnaryOp::Powi(0) => g.zeros_like()?,
                UnaryOp::Powf(0.0) => g.zeros_like()?,
                UnaryOp::Powi(n) => match n.checked_sub(1) {
                    Some(m) => g.mul(&x.powi(m)?.mul_scalar(n as f64)?)?,
                    None => g.mul(&x.powf(n as f64 - 1.0)?.mul_scalar(n as f64)?)?,
                },
                UnaryOp::Powf(p) => g.mul(&x.powf(p - 1.0)?.mul_scalar(p)?)?,
                UnaryOp::AddScalar(_) | UnaryOp::SubScalar(_) => g.clone(),
                UnaryOp::RSubScalar(_) => g.neg()?,
                UnaryOp::MulScalar(s) => g.mul_scalar(s)?,
                UnaryOp::DivScalar(s) => g.div_scalar(s)?,
                UnaryOp::RDivScalar(s) => g.mul(&x.sqr()?.unary(UnaryOp::RDivScalar(-s))?)?,
                // PyTorch's clamp_min/clamp_max backward (torch 2.15): the
                // gradient passes strictly inside (x > min, x < max); 0 at
                // the boundary and at NaN.
                UnaryOp::MaxScalar(s) => g.mul(&mask_scalar(x, BinaryOp::Gt, s)?)?,
                UnaryOp::MinScalar(s) => g.mul(&mask_scalar(x, BinaryOp::Lt, s)?)?,
                UnaryOp::Affine(a, _) => g.mul_scalar(a)?,
            };
            smallvec![(x.clone(), d)]
        }
        BackOp::Binary(op, a, b) => {
            // Only inputs that are recorded need a gradient: a batch or a
            // target never does, and skipping it saves kernels every step.
            let (na, nb) = (a.node.is_some(), b.node.is_some());
            let mut out = Grads::new();
            match op {
                BinaryOp::Add | BinaryOp::Sub => {
                    if na {
                        out.push((a.clone(), sum_to(g, a.dims())?));
                    }
                    if nb {
                        let gb = if *op == BinaryOp::Add { sum_to(g, b.dims())? } else { sum_to(g, b.dims())?.neg()? };
                        out.push((b.clone(), gb));
                    }
                }
                BinaryOp::Mul => {
                    if na {
                        out.push((a.clone(), sum_to(&g.mul(b)?, a.dims())?));
                    }
                    if nb {
                        out.push((b.clone(), sum_to(&g.mul(a)?, b.dims())?));
                    }
                }
                BinaryOp::Div => {
                    if na {
                        out.push((a.clone(), sum_to(&g.div(b)?, a.dims())?));
                    }
                    if nb {
                        out.push((b.clone(), sum_to(&g.mul(a)?.div(&b.sqr()?)?.neg()?, b.dims())?));
                    }
                }
                BinaryOp::Pow => {
                    // PyTorch's pow_backward: the base gets 0 where the
                    // exponent is 0 (not 0 · 0^-1 = NaN), the exponent gets 0
                    // where the base is 0 and the exponent >= 0 (not 0^b · log 0).
                    if na {
                        let ga = g.mul(b)?.mul(&a.pow(&b.sub(&b.ones_like()?)?)?)?;
                        let ga = zero_where(&b.binary(&scalar_like(b, 0.0)?, BinaryOp::Eq)?, &ga)?;
                        out.push((a.clone(), sum_to(&ga, a.dims())?));
                    }
                    if nb {
                        let gb = g.mul(&a.pow(b)?)?.mul(&a.log()?)?;
                        let zero_base = a.binary(&scalar_like(a, 0.0)?, BinaryOp::Eq)?;
                        let cond = zero_base.mul(&b.binary(&scalar_like(b, 0.0)?, BinaryOp::Ge)?)?;
                        let gb = zero_where(&cond, &gb)?;
                        out.push((b.clone(), sum_to(&gb, b.dims())?));
                    }
                }
                BinaryOp::Maximum | BinaryOp::Minimum => {
                    // PyTorch: a tie splits the gradient 0.5/0.5; the operand
                    // that lost gets 0; where a NaN is involved neither lost,
                    // so both get the whole gradient.
                    let (a_lost, b_lost) =
                        if *op == BinaryOp::Maximum { (BinaryOp::Lt, BinaryOp::Gt) } else { (BinaryOp::Gt, BinaryOp::Lt) };
                    let tie = a.binary(b, BinaryOp::Eq)?;
                    let shared = tie.where_cond(&g.mul_scalar(0.5)?, g)?;
                    if na {
                        out.push((a.clone(), sum_to(&zero_where(&a.binary(b, a_lost)?, &shared)?, a.dims())?));
                    }
                    if nb {
                        out.push((b.clone(), sum_to(&zero_where(&a.binary(b, b_lost)?, &shared)?, b.dims())?));
                    }
                }
                _ => {}
            }
            out
        }
        BackOp::Reduce(op, x, dims) => {
            let d = match op {
                ReduceOp::Sum => g.broadcast_to(x.shape())?,
                ReduceOp::Max | ReduceOp::Min => {
                    // Ties share the gradient equally, as in PyTorch's amax.
                    let out = x.reduce(*op, dims, true)?;
                    // A NaN result is shared by the NaNs (PyTorch's evenly
                    // distributed backward): x != x only for NaN.
                    let x_nan = x.binary(x, BinaryOp::Ne)?;
                    let out_nan = out.binary(&out, BinaryOp::Ne)?;
                    let hits = out_nan.where_cond(&x_nan, &x.binary(&out, BinaryOp::Eq)?)?.to_dtype(x.dtype())?;
                    let share = hits.div(&hits.sum_dims(dims, true)?)?;
                    g.broadcast_to(x.shape())?.mul(&share)?
                }
                _ => return Ok(smallvec![]),
            };
            smallvec![(x.clone(), d)]
        }
        BackOp::Matmul(a, b) => {
            let mut out = Grads::new();
            if a.node.is_some() {
                let ga = g.matmul(&b.t()?)?;
                out.push((a.clone(), sum_to(&ga, a.dims())?));
            }
            if b.node.is_some() {
                let gb = a.t()?.matmul(g)?;
                out.push((b.clone(), sum_to(&gb, b.dims())?));
            }
            out
        }
        BackOp::Reshape(x) => smallvec![(x.clone(), g.reshape(x.shape())?)],
        BackOp::Permute(x, perm) => {
            let mut inverse = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inverse[p] = i;
            }
            smallvec![(x.clone(), g.permute(&inverse)?)]
        }
        BackOp::Narrow(x, dim, start) => {
            let (dim, start) = (*dim, *start);
            let size = x.dims()[dim];
            let len = g.dims()[dim];
            let mut parts = Vec::new();
            let piece = |n: usize| -> Result<Tensor> {
                let mut dims = x.dims().to_vec();
                dims[dim] = n;
                Tensor::zeros(dims, g.dtype(), &g.device())
            };
            if start > 0 {
                parts.push(piece(start)?);
            }
            parts.push(g.clone());
            if start + len < size {
                parts.push(piece(size - start - len)?);
            }
            let refs: Vec<&Tensor> = parts.iter().collect();
            smallvec![(x.clone(), Tensor::cat(&refs, dim)?)]
        }
        BackOp::Broadcast(x) => smallvec![(x.clone(), sum_to(g, x.dims())?)],
        BackOp::IndexSelect(x, ids, dim) => {
            let zeros = x.zeros_like()?;
            smallvec![(x.clone(), zeros.index_add(ids, &g.contiguous()?, *dim)?)]
        }
        BackOp::IndexAdd(dst, ids, src, dim) => {
            let mut out = Grads::new();
            if dst.node.is_some() {
                out.push((dst.clone(), g.clone()));
            }
            if src.node.is_some() {
                out.push((src.clone(), g.index_select(ids, *dim)?));
            }
            out
        }
        BackOp::Cat(xs, dim) => {
            let mut start = 0;
            let mut out = Grads::new();
            for x in xs {
                let n = x.dims()[*dim];
                out.push((x.clone(), g.narrow(*dim, start, n)?));
                start += n;
            }
            out
        }
        BackOp::Cast(x) => smallvec![(x.clone(), g.to_dtype(x.dtype())?)],
        BackOp::Where(c, a, b) => {
            let zero = Tensor::zeros((), g.dtype(), &g.device())?;
            let mut out = Grads::new();
            if a.node.is_some() {
                out.push((a.clone(), sum_to(&c.where_cond(g, &zero)?, a.dims())?));
            }
            if b.node.is_some() {
                out.push((b.clone(), sum_to(&c.where_cond(&zero, g)?, b.dims())?));
            }
            out
        }
        BackOp::ToDevice(x) => smallvec![(x.clone(), g.to(&x.device())?)],
    })
}
