//! Collectives over tensors that live on different devices: the building
//! blocks of data-parallel training ("Multiple GPUs" and its concise
//! sequel in the book) — [`broadcast`], [`all_reduce`], [`reduce`],
//! [`all_gather`], [`reduce_scatter`], [`scatter`] and [`gather`] — and the
//! book's own from-scratch helpers, [`allreduce`] and [`split_batch`].
//!
//! Each takes one tensor per device (rank i is the i-th tensor) and is
//! asynchronous like every other device operation: the work is queued on
//! the devices and the call returns; a read or [`crate::synchronize`] waits
//! for it. The bytes that cross between devices are booked in the transfer
//! ledger as device-to-device traffic at your line, and a
//! [transfer guard](crate::transfer_guard) refuses them before anything is
//! queued. Tensors of different dtypes or shapes, no tensor at all, or two
//! tensors on one device are errors.
//!
//! How the data moves depends on the devices: simulated GPUs run a real
//! chunked ring across their collective queues over a modelled link
//! ([`crate::sim::SimLink`], [`crate::sim::set_link`]); CUDA devices run NCCL, loaded at
//! run time (`libnccl.so.2`: `pip install nvidia-nccl-cu12` and put its
//! `nvidia/nccl/lib` folder on `LD_LIBRARY_PATH`, or name the library with
//! `KILN_NCCL_LIB`), on a stream of its own per device that waits for the
//! device's compute stream, and that the compute stream waits for, without
//! blocking the host; any other group of devices (the CPU with GPUs, CUDA
//! devices without NCCL or with `KILN_DISABLE_NCCL=1`) goes through peer
//! copies and ordinary kernels on the first device. A max or min of floats
//! on CUDA devices takes that path too, because NCCL's lets a NaN lose.
//! Either way every device gets the same bits, and `kiln devices` (the
//! "collectives" detail of [`crate::devices`]) says which path each GPU
//! takes, and why when NCCL is missing.
//!
//! ```
//! use kiln::comm::{self, ReduceOp};
//! use kiln::{Tensor, gpu};
//!
//! let gpus = kiln::ensure_simulated_gpus(2, 256 << 20); // or kiln::try_all_gpus() on a machine with GPUs
//! let parts = [
//!     Tensor::new(&[1f32, 2.], &gpus[0])?,
//!     Tensor::new(&[10f32, 20.], &gpus[1])?,
//! ];
//! let sums = comm::all_reduce(&parts, ReduceOp::Sum)?;
//! assert_eq!(sums[1].device(), gpus[1]);
//! assert_eq!(sums[1].to_vec::<f32>()?, vec![11., 22.]);
//! let everywhere = comm::broadcast(&parts[0], &gpus)?;
//! assert_eq!(everywhere[1].to_vec::<f32>()?, vec![1., 2.]);
//! # Ok::<(), kiln::Error>(())
//! ```

mod generic;

// Moved to `kiln::sim`; kept here so that older code still builds.
use crate::base::error::{Error, Result};
use crate::kernel::comm::{chunk_bounds, ring_all_reduce_sent, Combine, Communicator, Part};
use crate::kernel::Backend;
use crate::runtime::ledger::{self, site_scope, Ticket};
#[doc(hidden)]
pub use crate::sim::{SimLink, DEFAULT_LINK_BANDWIDTH, DEFAULT_LINK_LATENCY};
use crate::{DType, Device, Tensor};
use std::panic::Location;

/// How [`all_reduce`], [`reduce`] and [`reduce_scatter`] combine the
/// devices' tensors (PyTorch's `torch.distributed.ReduceOp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Elementwise sum; integers wrap.
    Sum,
    /// Elementwise mean: the sum divided by the number of devices (float
    /// dtypes only; f16 and bf16 are summed in f32 and rounded once, so a
    /// sum past f16's range still gives a finite mean, and the devices
    /// exchange f32: twice the bytes of a sum of the same tensor).
    Mean,
    /// Elementwise maximum; a NaN wins.
    Max,
    /// Elementwise minimum; a NaN wins.
    Min,
}

impl ReduceOp {
    pub(crate) fn combine(self) -> Combine {
        match self {
            ReduceOp::Sum | ReduceOp::Mean => Combine::Sum,
            ReduceOp::Max => Combine::Max,
            ReduceOp::Min => Combine::Min,
        }
    }
}

/// Moved to [`crate::sim::link`] (the simulated GPUs' own controls).
#[deprecated(since = "0.2.0", note = "moved to `kiln::sim::link`")]
pub fn simulated_link() -> SimLink {
    crate::sim::link()
}

/// Moved to [`crate::sim::set_link`].
#[deprecated(since = "0.2.0", note = "moved to `kiln::sim::set_link`")]
pub fn set_simulated_link(link: SimLink) -> Result<()> {
    crate::sim::set_link(link)
}

/// Moved to [`crate::sim::elapsed`].
#[deprecated(since = "0.2.0", note = "moved to `kiln::sim::elapsed`")]
pub fn simulated_elapsed<R>(devices: &[Device], work: impl FnOnce() -> Result<R>) -> Result<(R, std::time::Duration)> {
    crate::sim::elapsed(devices, work)
}

/// The group's checks: at least one tensor, one per device, one dtype, and
/// (`same_shape`) one shape.
fn check_group(op: &str, tensors: &[Tensor], same_shape: bool) -> Result<()> {
    let Some(first) = tensors.first() else {
        return Err(Error::invalid(op, "needs at least one tensor (one per device)"));
    };
    for (i, t) in tensors.iter().enumerate() {
        if let Some(j) = tensors[..i].iter().position(|u| u.device() == t.device()) {
            return Err(Error::invalid(
                op,
                format!(
                    "tensors {j} and {i} are both on {}; a collective takes one tensor per device (combine tensors on one device with ordinary ops first)",
                    t.device()
                ),
            ));
        }
        if t.dtype() != first.dtype() {
            return Err(Error::DTypeMismatch { op: op.into(), lhs: first.dtype(), rhs: t.dtype() });
        }
        if same_shape && t.dims() != first.dims() {
            return Err(Error::shape(op, first.dims(), t.dims()));
        }
    }
    Ok(())
}

/// The communicator every tensor's device shares, when there are two
/// devices or more and all have one.
fn native(tensors: &[Tensor]) -> Option<&'static dyn Communicator> {
    if tensors.len() < 2 {
        return None;
    }
    let first = tensors[0].backend().communicator()?;
    tensors[1..]
        .iter()
        .all(|t| {
            t.backend().communicator().is_some_and(|c| std::ptr::addr_eq(c as *const dyn Communicator, first as *const dyn Communicator))
        })
        .then_some(first)
}

/// [`native`], for a reduction: when the communicator combines the
/// tensors' dtype with `op` as kiln does (NCCL's float max and min let a
/// NaN lose, so those go through peer copies and kernels).
fn native_reducing(tensors: &[Tensor], op: ReduceOp) -> Option<&'static dyn Communicator> {
    native(tensors).filter(|c| c.reduces(tensors[0].dtype(), op.combine()))
}

fn backends_of(tensors: &[Tensor]) -> Vec<&'static dyn Backend> {
    tensors.iter().map(|t| t.backend()).collect()
}

/// A dense tensor's elements as a collective's part.
pub(crate) fn part(t: &Tensor) -> Part {
    Part { storage: (*t.storage).clone(), offset: t.layout.offset(), len: t.elem_count() }
}

/// True when a collective may write `t`'s elements in place.
fn writable_in_place(t: &Tensor) -> bool {
    t.is_contiguous()
}

/// Checks the guard for traffic `(from rank, to rank, bytes)` before
/// anything is queued; the tickets are booked once the work is queued.
fn tickets(tensors: &[Tensor], traffic: &[(usize, usize, usize)], site: &'static Location<'static>) -> Result<Vec<Ticket>> {
    let mut out = Vec::new();
    for &(from, to, bytes) in traffic {
        if bytes > 0
            && let Some(t) = ledger::check(tensors[from].device(), tensors[to].device(), bytes, site)?
        {
            out.push(t);
        }
    }
    Ok(out)
}

fn book(tickets: Vec<Ticket>) {
    for t in tickets {
        t.book();
    }
}

/// What a ring all-reduce of `len` elements of `dtype` moves over each link.
fn ring_traffic(n: usize, len: usize, dtype: DType) -> Vec<(usize, usize, usize)> {
    let chunks = chunk_bounds(len, n);
    (0..n).map(|d| (d, (d + 1) % n, ring_all_reduce_sent(&chunks, d) * dtype.size_in_bytes())).collect()
}

fn refuse_integer_mean(op: &str, tensors: &[Tensor], reduce: ReduceOp) -> Result<()> {
    let dtype = tensors.first().map(|t| t.dtype());
    match dtype {
        Some(d) if reduce == ReduceOp::Mean && !d.is_float() => {
            Err(Error::UnsupportedDType { op: format!("{op} with ReduceOp::Mean"), dtype: d })
        }
        _ => Ok(()),
    }
}

/// `sum / n` in `sum`'s dtype (half types divide in f32 and round once).
fn mean_of(sum: &Tensor, n: usize) -> Result<Tensor> {
    match sum.dtype() {
        DType::F16 | DType::BF16 => sum.to_dtype(DType::F32)?.div_scalar(n as f64)?.to_dtype(sum.dtype()),
        _ => sum.div_scalar(n as f64),
    }
}

/// For a mean of f16 or bf16, the tensors widened to f32: the sum is taken
/// there and rounded once with the division, so a sum past the half type's
/// range (two f16 40,000s) gives a finite mean, as the process groups'
/// engines give. `None` for any other call.
fn widened_for_mean(tensors: &[Tensor], op: ReduceOp) -> Result<Option<Vec<Tensor>>> {
    match tensors.first().map(|t| t.dtype()) {
        Some(DType::F16 | DType::BF16) if op == ReduceOp::Mean => {
            Ok(Some(tensors.iter().map(|t| t.to_dtype(DType::F32)).collect::<Result<_>>()?))
        }
        _ => Ok(None),
    }
}

/// Each device's tensor becomes the mean: the sum divided by `n`.
fn divide_in_place(tensors: &[Tensor], n: usize) -> Result<()> {
    for t in tensors {
        t.assign(&mean_of(t, n)?)?;
    }
    Ok(())
}

/// In place: every tensor becomes the elementwise combination (`op`) of all
/// of them (PyTorch's `torch.distributed.all_reduce`). The tensors keep
/// their identity and device; every device gets the same bits.
///
/// ```
/// use kiln::comm::{self, ReduceOp};
/// use kiln::Tensor;
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let grads = [Tensor::new(&[1f32, 4.], &gpus[0])?, Tensor::new(&[3f32, 0.], &gpus[1])?];
/// comm::all_reduce_(&grads, ReduceOp::Mean)?;
/// assert_eq!(grads[0].to_vec::<f32>()?, vec![2., 2.]);
/// assert_eq!(grads[1].to_vec::<f32>()?, vec![2., 2.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn all_reduce_(tensors: &[Tensor], op: ReduceOp) -> Result<()> {
    let site = Location::caller();
    let _site = site_scope(site);
    check_group("all_reduce_", tensors, true)?;
    refuse_integer_mean("all_reduce_", tensors, op)?;
    let _g = crate::no_grad();
    if let Some(wide) = widened_for_mean(tensors, op)? {
        // The widened copies are the call's own: reduced where they are.
        all_reduce_(&wide, op)?;
        for (t, m) in tensors.iter().zip(&wide) {
            t.assign(&m.to_dtype(t.dtype())?)?;
        }
        return Ok(());
    }
    if let Some(comm) = native_reducing(tensors, op).filter(|_| tensors.iter().all(writable_in_place)) {
        let (n, t0) = (tensors.len(), &tensors[0]);
        let tickets = tickets(tensors, &ring_traffic(n, t0.elem_count(), t0.dtype()), site)?;
        if t0.elem_count() > 0 {
            let parts: Vec<Part> = tensors.iter().map(part).collect();
            comm.all_reduce(&parts, op.combine())?;
            comm.join(&backends_of(tensors))?;
        }
        book(tickets);
    } else {
        let results = all_reduce(tensors, op)?;
        for (t, r) in tensors.iter().zip(&results) {
            t.assign(r)?;
        }
        return Ok(());
    }
    if op == ReduceOp::Mean {
        divide_in_place(tensors, tensors.len())?;
    }
    Ok(())
}

/// The elementwise combination (`op`) of every tensor, as a new tensor on
/// each tensor's device (PyTorch's `all_reduce` on copies). Every device
/// gets the same bits.
///
/// ```
/// use kiln::comm::{self, ReduceOp};
/// use kiln::Tensor;
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let parts = [Tensor::new(&[1i64, 5], &gpus[0])?, Tensor::new(&[3i64, 2], &gpus[1])?];
/// let max = comm::all_reduce(&parts, ReduceOp::Max)?;
/// assert_eq!(max[0].to_vec::<i64>()?, vec![3, 5]);
/// assert_eq!(parts[0].to_vec::<i64>()?, vec![1, 5]); // the inputs are left alone
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn all_reduce(tensors: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
    let site = Location::caller();
    let _site = site_scope(site);
    check_group("all_reduce", tensors, true)?;
    refuse_integer_mean("all_reduce", tensors, op)?;
    let _g = crate::no_grad();
    if let Some(wide) = widened_for_mean(tensors, op)? {
        return all_reduce(&wide, op)?.iter().zip(tensors).map(|(m, t)| m.to_dtype(t.dtype())).collect();
    }
    let out = match native_reducing(tensors, op) {
        Some(comm) => {
            let (n, t0) = (tensors.len(), &tensors[0]);
            let tickets = tickets(tensors, &ring_traffic(n, t0.elem_count(), t0.dtype()), site)?;
            let copies = tensors.iter().map(|t| t.force_copy()).collect::<Result<Vec<_>>>()?;
            if t0.elem_count() > 0 {
                let parts: Vec<Part> = copies.iter().map(part).collect();
                comm.all_reduce(&parts, op.combine())?;
                comm.join(&backends_of(tensors))?;
            }
            book(tickets);
            copies
        }
        None => generic::all_reduce(tensors, op.combine())?,
    };
    if op == ReduceOp::Mean {
        return out.iter().map(|t| mean_of(t, tensors.len())).collect();
    }
    Ok(out)
}

/// Copies of `tensor` on every device of `devices`, in order (PyTorch's
/// `torch.cuda.comm.broadcast`); on `tensor`'s own device the result is
/// `tensor` itself, as [`Tensor::to`] gives. The copies are differentiable:
/// their gradients flow back to `tensor`.
///
/// ```
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let w = kiln::Tensor::new(&[0.5f32, -1.], &gpus[0])?;
/// let replicas = kiln::comm::broadcast(&w, &gpus)?;
/// assert!(replicas[0].same_storage(&w));
/// assert_eq!(replicas[1].to_vec::<f32>()?, vec![0.5, -1.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn broadcast(tensor: &Tensor, devices: &[Device]) -> Result<Vec<Tensor>> {
    let _site = site_scope(Location::caller());
    check_devices("broadcast", devices)?;
    devices.iter().map(|d| tensor.to(d)).collect()
}

/// In place: every tensor gets the values of `tensors[root]` (how a
/// data-parallel run makes its replicas' parameters equal at the start).
///
/// ```
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let w = [kiln::Tensor::new(&[1f32, 2.], &gpus[0])?, kiln::Tensor::zeros(2, kiln::DType::F32, &gpus[1])?];
/// kiln::comm::broadcast_(&w, 0)?;
/// assert_eq!(w[1].to_vec::<f32>()?, vec![1., 2.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn broadcast_(tensors: &[Tensor], root: usize) -> Result<()> {
    let site = Location::caller();
    let _site = site_scope(site);
    check_group("broadcast_", tensors, true)?;
    check_root("broadcast_", tensors, root)?;
    let _g = crate::no_grad();
    let n = tensors.len();
    match native(tensors).filter(|_| tensors.iter().all(writable_in_place)) {
        Some(comm) => {
            let bytes = tensors[0].elem_count() * tensors[0].dtype().size_in_bytes();
            let chain: Vec<(usize, usize, usize)> = (0..n - 1).map(|j| ((root + j) % n, (root + j + 1) % n, bytes)).collect();
            let tickets = tickets(tensors, &chain, site)?;
            if bytes > 0 {
                let parts: Vec<Part> = tensors.iter().map(part).collect();
                comm.broadcast(&parts, root)?;
                comm.join(&backends_of(tensors))?;
            }
            book(tickets);
            Ok(())
        }
        None => {
            let src = &tensors[root];
            let copies = tensors.iter().map(|t| src.to(&t.device())).collect::<Result<Vec<_>>>()?;
            for (i, (t, c)) in tensors.iter().zip(&copies).enumerate() {
                if i != root {
                    t.assign(c)?;
                }
            }
            Ok(())
        }
    }
}

/// The combination (`op`) of every tensor, as a new tensor on the device of
/// `tensors[root]` (PyTorch's `torch.distributed.reduce`, out of place).
///
/// ```
/// use kiln::comm::{self, ReduceOp};
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let parts = [kiln::Tensor::new(&[1f32], &gpus[0])?, kiln::Tensor::new(&[2f32], &gpus[1])?];
/// let total = comm::reduce(&parts, 1, ReduceOp::Sum)?;
/// assert_eq!((total.device(), total.to_vec::<f32>()?), (gpus[1], vec![3.]));
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn reduce(tensors: &[Tensor], root: usize, op: ReduceOp) -> Result<Tensor> {
    let site = Location::caller();
    let _site = site_scope(site);
    check_group("reduce", tensors, true)?;
    check_root("reduce", tensors, root)?;
    refuse_integer_mean("reduce", tensors, op)?;
    let _g = crate::no_grad();
    if let Some(wide) = widened_for_mean(tensors, op)? {
        return reduce(&wide, root, op)?.to_dtype(tensors[0].dtype());
    }
    let out = match native_reducing(tensors, op) {
        Some(comm) => {
            let (n, t0) = (tensors.len(), &tensors[0]);
            let tickets = tickets(tensors, &ring_traffic(n, t0.elem_count(), t0.dtype()), site)?;
            let copies = tensors.iter().map(|t| t.force_copy()).collect::<Result<Vec<_>>>()?;
            if t0.elem_count() > 0 {
                let parts: Vec<Part> = copies.iter().map(part).collect();
                comm.reduce(&parts, root, op.combine())?;
                comm.join(&backends_of(tensors))?;
            }
            book(tickets);
            copies[root].clone()
        }
        None => generic::reduce(tensors, root, op.combine())?,
    };
    if op == ReduceOp::Mean {
        return mean_of(&out, tensors.len());
    }
    Ok(out)
}

/// Every tensor, concatenated along dimension 0 in rank order, as a new
/// tensor on each device (PyTorch's `all_gather_into_tensor`). The tensors
/// must have one shape.
///
/// ```
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let parts = [kiln::Tensor::new(&[[1f32, 2.]], &gpus[0])?, kiln::Tensor::new(&[[3f32, 4.]], &gpus[1])?];
/// let all = kiln::comm::all_gather(&parts)?;
/// assert_eq!(all[1].to_vec2::<f32>()?, vec![vec![1., 2.], vec![3., 4.]]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn all_gather(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    let site = Location::caller();
    let _site = site_scope(site);
    check_group("all_gather", tensors, true)?;
    if tensors[0].rank() == 0 {
        return Err(Error::invalid(
            "all_gather",
            "tensors are concatenated along dimension 0: give them at least one dimension (`t.reshape(1)?`)",
        ));
    }
    let _g = crate::no_grad();
    let n = tensors.len();
    let mut dims = tensors[0].dims().to_vec();
    dims[0] = dims[0].checked_mul(n).ok_or_else(|| Error::invalid("all_gather", "the gathered shape overflows"))?;
    match native(tensors) {
        Some(comm) => {
            let bytes = tensors[0].elem_count() * tensors[0].dtype().size_in_bytes();
            let traffic: Vec<(usize, usize, usize)> = (0..n).map(|d| (d, (d + 1) % n, (n - 1) * bytes)).collect();
            let tickets = tickets(tensors, &traffic, site)?;
            let inputs =
                tensors.iter().map(|t| if t.is_contiguous() { Ok(t.clone()) } else { t.force_copy() }).collect::<Result<Vec<_>>>()?;
            let outputs = tensors
                .iter()
                .map(|t| {
                    crate::backends::alloc(t.backend(), t.dtype(), n * t.elem_count()).map(|s| Tensor::from_storage(s, dims.clone().into()))
                })
                .collect::<Result<Vec<_>>>()?;
            if bytes > 0 {
                comm.all_gather(&inputs.iter().map(part).collect::<Vec<_>>(), &outputs.iter().map(part).collect::<Vec<_>>())?;
            }
            comm.join(&backends_of(tensors))?;
            book(tickets);
            Ok(outputs)
        }
        None => generic::all_gather(tensors),
    }
}

/// The combination (`op`) of every tensor, cut along dimension 0 into one
/// block per device: rank i gets block i, as a new tensor (PyTorch's
/// `reduce_scatter_tensor`). Dimension 0 must be divisible by the number
/// of tensors.
///
/// ```
/// use kiln::comm::{self, ReduceOp};
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let parts = [kiln::Tensor::new(&[1f32, 2., 3., 4.], &gpus[0])?, kiln::Tensor::new(&[10f32, 20., 30., 40.], &gpus[1])?];
/// let blocks = comm::reduce_scatter(&parts, ReduceOp::Sum)?;
/// assert_eq!(blocks[0].to_vec::<f32>()?, vec![11., 22.]);
/// assert_eq!(blocks[1].to_vec::<f32>()?, vec![33., 44.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn reduce_scatter(tensors: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
    let site = Location::caller();
    let _site = site_scope(site);
    check_group("reduce_scatter", tensors, true)?;
    refuse_integer_mean("reduce_scatter", tensors, op)?;
    let n = tensors.len();
    let t0 = &tensors[0];
    if t0.rank() == 0 || !t0.dims()[0].is_multiple_of(n) {
        return Err(Error::invalid(
            "reduce_scatter",
            format!("dimension 0 of shape {} must be divisible by the number of tensors, {n}, to cut one block per device", t0.shape()),
        ));
    }
    let _g = crate::no_grad();
    if let Some(wide) = widened_for_mean(tensors, op)? {
        return reduce_scatter(&wide, op)?.iter().map(|m| m.to_dtype(t0.dtype())).collect();
    }
    let mut dims = t0.dims().to_vec();
    dims[0] /= n;
    let out = match native_reducing(tensors, op) {
        Some(comm) => {
            let block = t0.elem_count() / n;
            let bytes = block * t0.dtype().size_in_bytes();
            let traffic: Vec<(usize, usize, usize)> = (0..n).map(|d| (d, (d + 1) % n, (n - 1) * bytes)).collect();
            let tickets = tickets(tensors, &traffic, site)?;
            let inputs = tensors.iter().map(|t| t.force_copy()).collect::<Result<Vec<_>>>()?;
            let outputs = tensors
                .iter()
                .map(|t| crate::backends::alloc(t.backend(), t.dtype(), block).map(|s| Tensor::from_storage(s, dims.clone().into())))
                .collect::<Result<Vec<_>>>()?;
            if bytes > 0 {
                let (i, o): (Vec<Part>, Vec<Part>) = (inputs.iter().map(part).collect(), outputs.iter().map(part).collect());
                comm.reduce_scatter(&i, &o, op.combine())?;
            }
            comm.join(&backends_of(tensors))?;
            book(tickets);
            outputs
        }
        None => generic::reduce_scatter(tensors, op.combine())?,
    };
    if op == ReduceOp::Mean {
        return out.iter().map(|t| mean_of(t, n)).collect();
    }
    Ok(out)
}

/// Cuts `tensor` along dimension 0 and puts piece i on `devices[i]`
/// (PyTorch's `torch.cuda.comm.scatter`). Without `chunk_sizes` the pieces
/// are `torch.chunk`'s: ⌈n / devices⌉ rows each, the last smaller, and so
/// possibly fewer pieces than devices when the batch is small (5 rows over
/// 4 devices: 2, 2, 1); with them, piece i has `chunk_sizes[i]` rows (one
/// size per device, summing to the rows). The pieces are differentiable.
///
/// ```
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let x = kiln::Tensor::arange(0., 6., 1., &kiln::cpu())?.reshape((3, 2))?;
/// let pieces = kiln::comm::scatter(&x, &gpus, None)?;
/// assert_eq!((pieces[0].dims(), pieces[1].dims()), (&[2, 2][..], &[1, 2][..]));
/// assert_eq!(pieces[1].device(), gpus[1]);
/// let pieces = kiln::comm::scatter(&x, &gpus, Some(&[1, 2]))?;
/// assert_eq!(pieces[1].to_vec::<f32>()?, vec![2., 3., 4., 5.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn scatter(tensor: &Tensor, devices: &[Device], chunk_sizes: Option<&[usize]>) -> Result<Vec<Tensor>> {
    let _site = site_scope(Location::caller());
    check_devices("scatter", devices)?;
    if tensor.rank() == 0 {
        return Err(Error::invalid("scatter", "a 0-d tensor has no dimension 0 to cut; reshape it first (`t.reshape(1)?`)"));
    }
    let rows = tensor.dims()[0];
    let sizes = match chunk_sizes {
        Some(s) => {
            if s.len() != devices.len() || s.iter().try_fold(0usize, |a, &b| a.checked_add(b)) != Some(rows) {
                return Err(Error::invalid(
                    "scatter",
                    format!(
                        "chunk_sizes {s:?} must give one size per device ({}) and sum to the {rows} rows of dimension 0",
                        devices.len()
                    ),
                ));
            }
            s.to_vec()
        }
        None => torch_chunk_sizes(rows, devices.len()),
    };
    let mut start = 0;
    let mut out = Vec::with_capacity(sizes.len());
    for (size, d) in sizes.iter().zip(devices) {
        out.push(tensor.narrow(0, start, *size)?.to(d)?);
        start += size;
    }
    Ok(out)
}

/// The sizes `torch.chunk(rows, k)` cuts: ⌈rows / k⌉ each while rows last,
/// `k` empty pieces for no rows.
fn torch_chunk_sizes(rows: usize, k: usize) -> Vec<usize> {
    if rows == 0 {
        return vec![0; k];
    }
    let size = rows.div_ceil(k);
    let mut sizes = vec![size; rows / size];
    if !rows.is_multiple_of(size) {
        sizes.push(rows % size);
    }
    sizes
}

/// The tensors concatenated along dimension 0 on `destination` (PyTorch's
/// `torch.cuda.comm.gather`); differentiable, so a data-parallel forward's
/// outputs gathered here send their gradients back to each device.
///
/// ```
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let parts = [kiln::Tensor::new(&[1f32], &gpus[0])?, kiln::Tensor::new(&[2f32, 3.], &gpus[1])?];
/// let all = kiln::comm::gather(&parts, &gpus[0])?;
/// assert_eq!(all.to_vec::<f32>()?, vec![1., 2., 3.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn gather(tensors: &[Tensor], destination: &Device) -> Result<Tensor> {
    let _site = site_scope(Location::caller());
    check_group("gather", tensors, false)?;
    let moved = tensors.iter().map(|t| t.to(destination)).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&moved.iter().collect::<Vec<_>>(), 0)
}

/// The book's `split_batch`: features and labels cut along dimension 0 and
/// spread over `devices` as [`scatter`] cuts them.
///
/// ```
/// use kiln::{Tensor, cpu};
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let x = Tensor::arange(0., 24., 1., &cpu())?.reshape((4, 6))?;
/// let y = Tensor::new(&[0i64, 1, 2, 3], &cpu())?;
/// let (xs, ys) = kiln::comm::split_batch(&x, &y, &gpus)?;
/// assert_eq!((xs[1].dims(), ys[1].to_vec::<i64>()?), (&[2, 6][..], vec![2, 3]));
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn split_batch(x: &Tensor, y: &Tensor, devices: &[Device]) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let _site = site_scope(Location::caller());
    if x.rank() == 0 || y.rank() == 0 || x.dims()[0] != y.dims()[0] {
        return Err(Error::invalid(
            "split_batch",
            format!("features {} and labels {} must have the same number of rows (dimension 0)", x.shape(), y.shape()),
        ));
    }
    Ok((scatter(x, devices, None)?, scatter(y, devices, None)?))
}

/// The book's from-scratch `allreduce`: sums every tensor into the first
/// (copying each to the first device) and copies the sum back into every
/// other, in place. [`all_reduce_`] with [`ReduceOp::Sum`] gives the same
/// result with less traffic.
///
/// ```
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let data = [kiln::Tensor::ones((1, 2), kiln::DType::F32, &gpus[0])?, kiln::Tensor::full(2., (1, 2), kiln::DType::F32, &gpus[1])?];
/// kiln::comm::allreduce(&data)?;
/// assert_eq!(data[1].to_vec::<f32>()?, vec![3., 3.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn allreduce(data: &[Tensor]) -> Result<()> {
    let _site = site_scope(Location::caller());
    check_group("allreduce", data, true)?;
    let _g = crate::no_grad();
    let d0 = data[0].device();
    let mut sum = data[0].clone();
    for t in &data[1..] {
        sum = sum.add(&t.to(&d0)?)?;
    }
    let copies = data[1..].iter().map(|t| sum.to(&t.device())).collect::<Result<Vec<_>>>()?;
    data[0].assign(&sum)?;
    for (t, c) in data[1..].iter().zip(&copies) {
        t.assign(c)?;
    }
    Ok(())
}

fn check_devices(op: &str, devices: &[Device]) -> Result<()> {
    if devices.is_empty() {
        return Err(Error::invalid(op, "needs at least one device"));
    }
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(Error::invalid(op, format!("{d} is listed twice in the devices")));
        }
        crate::registry::backend(*d)?;
    }
    Ok(())
}

fn check_root(op: &str, tensors: &[Tensor], root: usize) -> Result<()> {
    if root >= tensors.len() {
        return Err(Error::invalid(
            op,
            format!("root {root} is not a rank: there are {} tensors (ranks 0..{})", tensors.len(), tensors.len()),
        ));
    }
    Ok(())
}

/// All-reduce (sum) in place without making the compute queues wait:
/// the data-parallel trainer's gradient buckets, whose results are only
/// read after [`join`]. The tensors must be contiguous.
#[track_caller]
pub(crate) fn all_reduce_sum_async(tensors: &[Tensor]) -> Result<()> {
    let site = Location::caller();
    check_group("all_reduce", tensors, true)?;
    let _g = crate::no_grad();
    match native(tensors).filter(|_| tensors.iter().all(writable_in_place)) {
        Some(comm) => {
            let (n, t0) = (tensors.len(), &tensors[0]);
            let tickets = tickets(tensors, &ring_traffic(n, t0.elem_count(), t0.dtype()), site)?;
            if t0.elem_count() > 0 {
                comm.all_reduce(&tensors.iter().map(part).collect::<Vec<_>>(), Combine::Sum)?;
            }
            book(tickets);
            Ok(())
        }
        None => all_reduce_(tensors, ReduceOp::Sum),
    }
}

/// Makes the compute queues of `tensors`' devices wait for the collectives
/// queued on them (see [`all_reduce_sum_async`]).
pub(crate) fn join(tensors: &[Tensor]) -> Result<()> {
    if let Some(comm) = native(tensors) {
        comm.join(&backends_of(tensors))?;
    }
    Ok(())
}
