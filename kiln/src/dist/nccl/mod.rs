//! The engine of a launch whose processes each compute on a device with
//! communicators across processes (NCCL on a CUDA device): collectives of
//! such tensors run on the device, never staged through host memory.
//!
//! - **Bootstrap**: under an MPI launcher, rank 0 makes NCCL's unique id and
//!   the MPI engine broadcasts it (that engine then also moves host
//!   tensors, and every NCCL call's fingerprint, below). Under torchrun-style
//!   variables, NCCL's own bootstrap: `NCCL_COMM_ID` (from `MASTER_ADDR` and
//!   `MASTER_PORT` when unset), from which every rank's `ncclGetUniqueId`
//!   gives the same id; tensors in host memory are then an error that says
//!   to launch with mpirun or srun.
//! - **Calls**: all-reduce, broadcast, all-gather and reduce-scatter of a
//!   tensor on this rank's device are queued on its stream, then waited for
//!   with the group's timeout: a dead or hung rank, or a failed call, is an
//!   error on every other rank naming the call, and the communicator is
//!   aborted (`ncclCommAbort`) so no stream waits forever. Reduce, send,
//!   receive, barrier, a float max or min (NCCL lets a NaN lose) and any
//!   tensor in host memory go through the MPI engine.
//! - **Fingerprints**: with MPI there, each NCCL call's fingerprint (call,
//!   reduction, dtype, element count, root) is checked across the ranks
//!   first (an all-gather of a few numbers), so mismatched calls are an
//!   error naming both ranks' calls, not a hang.

use super::engine::{Done, Engine, Pending};
use super::launch::Launch;
use super::wire::{dist_error, Call, CallKind, HostBuf, Payload};
use crate::comm::ReduceOp;
use crate::kernel::comm::{Part, ProcessComms, RankCall, RankComm};
use crate::{backends, registry, Device, Result, Tensor};
use std::sync::Mutex;
use std::time::Duration;

/// Opens the engine when this process computes on a device whose backend
/// has communicators across processes and the launch can bootstrap them.
pub(crate) fn open(launch: &Launch, timeout: Duration) -> Option<Result<Box<dyn Engine>>> {
    if launch.size < 2 || launch.local_rank >= crate::num_gpus() {
        return None;
    }
    let device = Device::Gpu(launch.local_rank);
    let comms = registry::backend(device).ok()?.process_comms().ok()?;
    let inner = if launch.launcher.is_mpi() {
        match mpi_engine(launch, timeout)? {
            Ok(e) => Some(e),
            Err(e) => return Some(Err(e)),
        }
    } else {
        None
    };
    Some(start(launch, timeout, device, comms, inner))
}

/// What serves this launch's device tensors across processes ("NCCL
/// 2.21.5 on gpu(0)"), or why nothing does.
pub(crate) fn describe(launch: &Launch) -> std::result::Result<String, String> {
    if launch.local_rank >= crate::num_gpus() {
        return Err(format!("gpu({}) (this process's local rank) does not exist here", launch.local_rank));
    }
    let device = Device::Gpu(launch.local_rank);
    let comms = registry::backend(device).map_err(|e| e.to_string())?.process_comms()?;
    Ok(format!("{} on {device}", comms.name()))
}

#[cfg(feature = "mpi")]
fn mpi_engine(launch: &Launch, timeout: Duration) -> Option<Result<Box<dyn Engine>>> {
    super::mpi::open(launch, timeout)
}

/// Without the MPI engine an MPI launch has no bootstrap here (the list's
/// last word then says to build with `--features mpi`).
#[cfg(not(feature = "mpi"))]
fn mpi_engine(_: &Launch, _: Duration) -> Option<Result<Box<dyn Engine>>> {
    None
}

fn start(
    launch: &Launch,
    timeout: Duration,
    device: Device,
    comms: &'static dyn ProcessComms,
    inner: Option<Box<dyn Engine>>,
) -> Result<Box<dyn Engine>> {
    let (rank, size) = (launch.rank, launch.size);
    let err = |msg: String| dist_error(rank, size, "dist::init", msg);
    let id = match &inner {
        Some(mpi) => {
            let mine = if rank == 0 { comms.unique_id()? } else { vec![0u8; 128] };
            let call = Call { kind: CallKind::Broadcast { root: 0 }, data: Payload::Staged(HostBuf::U8(mine)) };
            match mpi.run(call)? {
                HostBuf::U8(id) => id,
                _ => return Err(err("the NCCL id came back as another type (a kiln bug: please report it)".into())),
            }
        }
        None => {
            if std::env::var_os("NCCL_COMM_ID").is_none() {
                let (Ok(addr), Ok(port)) = (std::env::var("MASTER_ADDR"), std::env::var("MASTER_PORT")) else {
                    return Err(err(format!(
                        "this process is {launch}: NCCL's bootstrap needs MASTER_ADDR and MASTER_PORT (or NCCL_COMM_ID) set to \
                         rank 0's address and a free port, or launch with mpirun or srun (build with `--features mpi`)"
                    )));
                };
                // SAFETY: set once, while the group is made, before this
                // process starts NCCL (which reads it) or other threads of
                // kiln's that read the environment.
                unsafe { std::env::set_var("NCCL_COMM_ID", format!("{addr}:{port}")) };
            }
            comms.unique_id()?
        }
    };
    let rank_comm = comms.join(registry::backend(device)?, &id, size, rank)?;
    Ok(Box::new(NcclEngine { rank, size, device, comms, rank_comm, inner, timeout: Mutex::new(timeout) }))
}

struct NcclEngine {
    rank: usize,
    size: usize,
    device: Device,
    comms: &'static dyn ProcessComms,
    rank_comm: Box<dyn RankComm>,
    /// The MPI engine of an MPI launch: host tensors and fingerprints.
    inner: Option<Box<dyn Engine>>,
    timeout: Mutex<Duration>,
}

impl NcclEngine {
    /// The device call for `kind` on a tensor of `dtype`, if NCCL makes it
    /// as kiln does.
    fn rank_call(&self, kind: CallKind, dtype: crate::DType) -> Option<RankCall> {
        let combine = |op: ReduceOp| Some(op.combine()).filter(|&c| self.comms.reduces(dtype, c));
        match kind {
            CallKind::AllReduce(op) => combine(op).map(RankCall::AllReduce),
            CallKind::ReduceScatter(op) => combine(op).map(RankCall::ReduceScatter),
            CallKind::Broadcast { root } => Some(RankCall::Broadcast { root }),
            CallKind::AllGather => Some(RankCall::AllGather),
            CallKind::Reduce { .. } | CallKind::Barrier | CallKind::Send { .. } | CallKind::Recv { .. } => None,
        }
    }

    /// Checks across the ranks that each called `kind` on `len` elements
    /// of `dtype`, through the MPI engine when there is one.
    fn check_fingerprint(&self, kind: CallKind, dtype: crate::DType, len: usize) -> Result<()> {
        let Some(mpi) = &self.inner else { return Ok(()) };
        let (code, root) = match kind {
            CallKind::AllReduce(op) => (1 + op as i64, 0),
            CallKind::ReduceScatter(op) => (10 + op as i64, 0),
            CallKind::Broadcast { root } => (20, root as i64),
            CallKind::AllGather => (30, 0),
            CallKind::Reduce { .. } | CallKind::Barrier | CallKind::Send { .. } | CallKind::Recv { .. } => (40, 0),
        };
        let mine = vec![code, dtype as i64, len as i64, root];
        let all = match mpi.run(Call { kind: CallKind::AllGather, data: Payload::Staged(HostBuf::I64(mine.clone())) })? {
            HostBuf::I64(v) => v,
            _ => return Err(dist_error(self.rank, self.size, kind.name(), "fingerprints came back as another type (a kiln bug)")),
        };
        for (r, theirs) in all.chunks(4).enumerate() {
            if theirs != mine.as_slice() {
                return Err(dist_error(
                    self.rank,
                    self.size,
                    kind.name(),
                    format!(
                        "the ranks called different collectives through NCCL: rank {} {} of {len} {dtype} elements \
                         (fingerprint {mine:?}), rank {r} fingerprint {theirs:?}; every rank must make the same calls in the same order",
                        self.rank,
                        kind.name()
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Engine for NcclEngine {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn submit(&self, call: Call) -> Result<Box<dyn Pending>> {
        if let Some(mpi) = &self.inner {
            return mpi.submit(call);
        }
        let name = call.kind.name();
        if matches!(call.kind, CallKind::Barrier) {
            // A one-element all-reduce on the device, waited for.
            let one = Tensor::zeros(1, crate::DType::U8, &self.device)?;
            let done = self.on_device(CallKind::AllReduce(ReduceOp::Sum), &one, &[1], None).unwrap_or_else(|| Ok(one.clone()));
            return Ok(Box::new(Done(done.map(|_| HostBuf::U8(Vec::new())))));
        }
        Err(dist_error(
            self.rank,
            self.size,
            name,
            format!(
                "{name} of a tensor in host memory (or one NCCL does not combine as kiln: a float max or min, a reduce, send or \
                 receive) under torchrun-style variables: NCCL moves only tensors on {} here. Move the tensor there, or launch with \
                 mpirun or srun (build with `--features mpi`) to move host tensors too",
                self.device
            ),
        ))
    }

    fn on_device(&self, kind: CallKind, t: &Tensor, dims: &[usize], into: Option<&Tensor>) -> Option<Result<Tensor>> {
        // Chosen by the tensor's kind of device, dtype and call, which every
        // rank shares (a rank's own device differs from the others'): a
        // tensor on another device of this kind is moved to this rank's.
        if registry::backend(t.device()).ok()?.process_comms().is_err() {
            return None;
        }
        let call = self.rank_call(kind, t.dtype())?;
        if t.device() == self.device {
            return Some(self.run_on_device(kind, call, t, dims, into));
        }
        let moved = (|| {
            let here = t.to(&self.device)?;
            let out = self.run_on_device(kind, call, &here, dims, None)?.to(&t.device())?;
            match into {
                Some(dst) => dst.assign(&out).map(|()| dst.clone()),
                None => Ok(out),
            }
        })();
        Some(moved)
    }

    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner()) = timeout;
        if let Some(mpi) = &self.inner {
            mpi.set_timeout(timeout);
        }
    }
}

impl NcclEngine {
    fn run_on_device(&self, kind: CallKind, call: RankCall, t: &Tensor, dims: &[usize], into: Option<&Tensor>) -> Result<Tensor> {
        self.check_fingerprint(kind, t.dtype(), t.elem_count())?;
        let input = t.contiguous()?;
        let out = match into {
            // In place: NCCL reads and writes the same elements.
            Some(dst) if dst.is_contiguous() && dst.same_storage(&input) && dst.layout.offset() == input.layout.offset() => dst.clone(),
            _ => {
                let len: usize = dims.iter().product();
                let b = registry::backend(self.device)?;
                Tensor::from_storage(backends::alloc_on(b, self.device, t.dtype(), len)?, crate::Shape::from(dims.to_vec()))
            }
        };
        let part = |x: &Tensor| Part { storage: (*x.storage).clone(), offset: x.layout.offset(), len: x.elem_count() };
        let (inp, outp) = (part(&input), part(&out));
        // A reduce-scatter's part is each rank's piece.
        let outp = match call {
            RankCall::ReduceScatter(_) => Part { len: out.elem_count(), ..outp },
            RankCall::AllReduce(_) | RankCall::Broadcast { .. } | RankCall::AllGather => outp,
        };
        self.rank_comm.queue(call, &inp, &outp)?;
        self.rank_comm.wait(self.timeout()).map_err(|e| dist_error(self.rank, self.size, kind.name(), e.to_string()))?;
        match into {
            Some(dst) if !dst.same_storage(&out) => {
                dst.assign(&out)?;
                Ok(dst.clone())
            }
            _ => Ok(out),
        }
    }
}
