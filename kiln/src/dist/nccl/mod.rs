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
use crate::comm::{part, ReduceOp};
use crate::kernel::comm::{ProcessComms, RankCall, RankComm};
use crate::{backends, registry, Device, Result, Tensor};
use std::sync::Mutex;
use std::time::Duration;

/// Opens the engine when this process computes on a device whose backend
/// has communicators across processes and the launch can bootstrap them.
/// Under an MPI launcher every rank must agree: NCCL serves the launch only
/// when each rank has such a device (an `srun` that shows each task one GPU
/// leaves local ranks past 0 on the CPU); otherwise every rank takes the
/// MPI engine, as before.
pub(crate) fn open(launch: &Launch, timeout: Duration) -> Option<Result<Box<dyn Engine>>> {
    if launch.size < 2 {
        return None;
    }
    let local = local_comms(launch);
    if launch.launcher.is_mpi() {
        let mpi = match mpi_engine(launch, timeout)? {
            Ok(e) => e,
            Err(e) => return Some(Err(e)),
        };
        return Some(start_over_mpi(launch, timeout, local, mpi));
    }
    let (device, comms) = local?;
    Some(start_from_env(launch, timeout, device, comms))
}

/// This process's device and its backend's communicators across processes.
fn local_comms(launch: &Launch) -> Option<(Device, &'static dyn ProcessComms)> {
    if launch.local_rank >= crate::num_gpus() {
        return None;
    }
    let device = Device::Gpu(launch.local_rank);
    Some((device, registry::backend(device).ok()?.process_comms().ok()?))
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

/// Under MPI: the ranks agree (through MPI) whether every one can use NCCL
/// and rank 0 has an id; then MPI broadcasts the id. Any "no" gives every
/// rank the MPI engine itself.
fn start_over_mpi(
    launch: &Launch,
    timeout: Duration,
    local: Option<(Device, &'static dyn ProcessComms)>,
    mpi: Box<dyn Engine>,
) -> Result<Box<dyn Engine>> {
    let (rank, size) = (launch.rank, launch.size);
    let id = match (rank, local) {
        (0, Some((_, comms))) => comms.unique_id().ok(),
        _ => None,
    };
    let can = i64::from(local.is_some() && (rank != 0 || id.is_some()));
    let all = mpi.run(Call { kind: CallKind::AllReduce(ReduceOp::Min), data: Payload::Staged(HostBuf::I64(vec![can])) })?;
    let (HostBuf::I64(all), Some((device, comms))) = (all, local) else { return Ok(mpi) };
    if all != [1] {
        return Ok(mpi);
    }
    let mine = id.unwrap_or_else(|| vec![0u8; 128]);
    let id = match mpi.run(Call { kind: CallKind::Broadcast { root: 0 }, data: Payload::Staged(HostBuf::U8(mine)) })? {
        HostBuf::U8(id) => id,
        _ => return Err(dist_error(rank, size, "dist::init", "the NCCL id came back as another type (a kiln bug: please report it)")),
    };
    let rank_comm = comms
        .join(registry::backend(device)?, &id, size, rank, init_timeout(timeout))
        .map_err(|e| dist_error(rank, size, "dist::init", e.to_string()))?;
    Ok(Box::new(NcclEngine::new(launch, device, comms, rank_comm, Some(mpi), timeout)))
}

/// How long making the communicator waits for every rank to join:
/// `KILN_DIST_INIT_TIMEOUT` seconds, else the group's timeout but at least
/// 10 minutes (ranks start at different times; PyTorch waits as long).
fn init_timeout(timeout: Duration) -> Duration {
    let set = std::env::var("KILN_DIST_INIT_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok());
    set.unwrap_or(timeout.max(Duration::from_secs(600))).min(super::MAX_TIMEOUT)
}

/// Under torchrun-style variables: NCCL's own bootstrap. `NCCL_COMM_ID`,
/// when unset, is `MASTER_ADDR` and `KILN_NCCL_PORT` (default
/// `MASTER_PORT + 1`: torchrun's agent keeps its store on `MASTER_PORT`),
/// set for the bootstrap and removed after it.
fn start_from_env(launch: &Launch, timeout: Duration, device: Device, comms: &'static dyn ProcessComms) -> Result<Box<dyn Engine>> {
    let (rank, size) = (launch.rank, launch.size);
    let err = |msg: String| dist_error(rank, size, "dist::init", msg);
    let set_here = if std::env::var_os("NCCL_COMM_ID").is_none() {
        let addr = std::env::var("MASTER_ADDR").ok();
        let port = match std::env::var("KILN_NCCL_PORT") {
            Ok(p) => p.trim().parse::<u16>().ok(),
            Err(_) => std::env::var("MASTER_PORT").ok().and_then(|p| p.trim().parse::<u16>().ok()).and_then(|p| p.checked_add(1)),
        };
        let (Some(addr), Some(port)) = (addr, port) else {
            return Err(err(format!(
                "this process is {launch}: NCCL's bootstrap needs MASTER_ADDR and MASTER_PORT (or KILN_NCCL_PORT, or \
                 NCCL_COMM_ID) naming rank 0's address and a port; or launch with mpirun or srun (build with `--features mpi`)"
            )));
        };
        let host = if addr.contains(':') && !addr.starts_with('[') { format!("[{addr}]") } else { addr };
        // SAFETY: the environment is written while the group is made, which
        // programs do first; a thread reading the environment meanwhile (in
        // C, getenv) could see it torn. NCCL reads it in ncclGetUniqueId and,
        // on rank 0, in ncclCommInitRank; it is removed after.
        unsafe { std::env::set_var("NCCL_COMM_ID", format!("{host}:{port}")) };
        true
    } else {
        false
    };
    let joined = comms
        .unique_id()
        .and_then(|id| comms.join(registry::backend(device)?, &id, size, rank, init_timeout(timeout)))
        .map_err(|e| err(e.to_string()));
    if set_here {
        // SAFETY: as above.
        unsafe { std::env::remove_var("NCCL_COMM_ID") };
    }
    Ok(Box::new(NcclEngine::new(launch, device, comms, joined?, None, timeout)))
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
    /// Held from a call's fingerprint to its end, so that two threads'
    /// calls reach NCCL in the order they passed the check, on every rank.
    calls: Mutex<()>,
}

impl NcclEngine {
    fn new(
        launch: &Launch,
        device: Device,
        comms: &'static dyn ProcessComms,
        rank_comm: Box<dyn RankComm>,
        inner: Option<Box<dyn Engine>>,
        timeout: Duration,
    ) -> NcclEngine {
        NcclEngine {
            rank: launch.rank,
            size: launch.size,
            device,
            comms,
            rank_comm,
            inner,
            timeout: Mutex::new(timeout),
            calls: Mutex::new(()),
        }
    }
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
    fn check_fingerprint(&self, kind: CallKind, dtype: crate::DType, len: usize, failed: Option<&str>) -> Result<()> {
        let Some(mpi) = &self.inner else {
            return match failed {
                Some(why) => Err(dist_error(self.rank, self.size, kind.name(), why.to_string())),
                None => Ok(()),
            };
        };
        let mine = vec![fingerprint_code(kind), dtype as i64, len as i64, root_of(kind), i64::from(failed.is_some())];
        let all = match mpi.run(Call { kind: CallKind::AllGather, data: Payload::Staged(HostBuf::I64(mine.clone())) })? {
            HostBuf::I64(v) => v,
            _ => return Err(dist_error(self.rank, self.size, kind.name(), "fingerprints came back as another type (a kiln bug)")),
        };
        let err = |msg: String| Err(dist_error(self.rank, self.size, kind.name(), msg));
        if let Some(why) = failed {
            return err(why.to_string());
        }
        for (r, theirs) in all.chunks(5).enumerate() {
            if theirs.get(4) == Some(&1) {
                return err(format!(
                    "rank {r} could not take part in this collective (its error is in its own output); the call was not made"
                ));
            }
            if theirs[..4] != mine[..4] {
                return err(format!(
                    "the ranks called different collectives through NCCL: rank {} {}, rank {r} {}; every rank must make the same \
                     calls in the same order",
                    self.rank,
                    describe_fingerprint(&mine),
                    describe_fingerprint(theirs)
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
            let done = self.on_device(CallKind::AllReduce(ReduceOp::Sum), &one, &[1], None, None).unwrap_or_else(|| Ok(one.clone()));
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

    fn on_device(
        &self,
        kind: CallKind,
        t: &Tensor,
        dims: &[usize],
        into: Option<&Tensor>,
        divisor: Option<usize>,
    ) -> Option<Result<Tensor>> {
        // Chosen by the tensor's kind of device, dtype and call, which every
        // rank shares (a rank's own device differs from the others').
        if registry::backend(t.device()).ok()?.process_comms().is_err() {
            return None;
        }
        let call = self.rank_call(kind, t.dtype())?;
        Some(self.run_on_device(kind, call, t, dims, into, divisor))
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
    /// This rank's part of `call`: prepared here (a tensor on another device
    /// of this kind moved to this rank's, a half-precision mean widened to
    /// f32 so that it is rounded once, as on the staged path, the output
    /// allocated), then every rank's fingerprint checked (with whether each
    /// could prepare: a rank that could not makes every rank fail, not skip
    /// the call), then the NCCL call, waited for; then the mean divided.
    fn run_on_device(
        &self,
        kind: CallKind,
        call: RankCall,
        t: &Tensor,
        dims: &[usize],
        into: Option<&Tensor>,
        divisor: Option<usize>,
    ) -> Result<Tensor> {
        let _order = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        let half_mean = divisor.is_some() && matches!(t.dtype(), crate::DType::F16 | crate::DType::BF16);
        let prepared = self.prepare(t, dims, into, half_mean);
        let failed = prepared.as_ref().err().map(|e| e.to_string());
        let shared = self.check_fingerprint(kind, t.dtype(), t.elem_count(), failed.as_deref());
        let (input, out) = match (prepared, shared) {
            (Ok(p), Ok(())) => p,
            (Err(e), _) | (Ok(_), Err(e)) => {
                // The other ranks learn it (fingerprints), or, without MPI,
                // their calls fail or time out on the aborted communicator.
                self.rank_comm.abort(&e);
                return Err(e);
            }
        };
        self.rank_comm.queue(call, &part(&input), &part(&out))?;
        self.rank_comm.wait(self.timeout()).map_err(|e| dist_error(self.rank, self.size, kind.name(), e.to_string()))?;
        drop(_order);
        // The result in `t`'s dtype and device, divided for a mean.
        let result = match (half_mean, divisor) {
            (true, Some(n)) => out.div_scalar(n as f64)?.to_dtype(t.dtype())?,
            _ => {
                super::divide_in_place(&out, divisor)?;
                out
            }
        };
        let result = if result.device() == t.device() { result } else { result.to(&t.device())? };
        match into {
            Some(dst) if !dst.same_storage(&result) => {
                dst.assign(&result)?;
                Ok(dst.clone())
            }
            _ => Ok(result),
        }
    }

    /// The input on this rank's device and the tensor NCCL writes: `into`
    /// itself when NCCL can work there in place.
    fn prepare(&self, t: &Tensor, dims: &[usize], into: Option<&Tensor>, half_mean: bool) -> Result<(Tensor, Tensor)> {
        let mut input = if t.device() == self.device { t.contiguous()? } else { t.to(&self.device)?.contiguous()? };
        if half_mean {
            input = input.to_dtype(crate::DType::F32)?;
        }
        let in_place = !half_mean
            && t.device() == self.device
            && into.is_some_and(|dst| dst.is_contiguous() && dst.same_storage(&input) && dst.layout.offset() == input.layout.offset());
        let out = match into {
            Some(dst) if in_place => dst.clone(),
            _ => {
                let len: usize = dims.iter().product();
                let b = registry::backend(self.device)?;
                Tensor::from_storage(backends::alloc_on(b, self.device, input.dtype(), len)?, crate::Shape::from(dims.to_vec()))
            }
        };
        Ok((input, out))
    }
}

/// A call's number in a fingerprint.
fn fingerprint_code(kind: CallKind) -> i64 {
    match kind {
        CallKind::AllReduce(op) => 1 + op as i64,
        CallKind::ReduceScatter(op) => 10 + op as i64,
        CallKind::Broadcast { .. } => 20,
        CallKind::AllGather => 30,
        CallKind::Reduce { .. } | CallKind::Barrier | CallKind::Send { .. } | CallKind::Recv { .. } => 40,
    }
}

fn root_of(kind: CallKind) -> i64 {
    match kind {
        CallKind::Broadcast { root } | CallKind::Reduce { root, .. } => root as i64,
        CallKind::AllReduce(_)
        | CallKind::ReduceScatter(_)
        | CallKind::AllGather
        | CallKind::Barrier
        | CallKind::Send { .. }
        | CallKind::Recv { .. } => 0,
    }
}

/// A fingerprint in words: "all_reduce (op 0) of 4 elements of dtype 1".
fn describe_fingerprint(f: &[i64]) -> String {
    let call = match f.first().copied().unwrap_or(-1) {
        c @ 1..=9 => format!("all_reduce ({})", reduction(c - 1)),
        c @ 10..=19 => format!("reduce_scatter ({})", reduction(c - 10)),
        20 => format!("broadcast from rank {}", f.get(3).copied().unwrap_or(-1)),
        30 => "all_gather".to_string(),
        c => format!("call {c}"),
    };
    let dtype = [
        crate::DType::U8,
        crate::DType::I32,
        crate::DType::I64,
        crate::DType::F16,
        crate::DType::BF16,
        crate::DType::F32,
        crate::DType::F64,
    ]
    .into_iter()
    .find(|d| *d as i64 == f.get(1).copied().unwrap_or(-1))
    .map(|d| d.to_string())
    .unwrap_or_else(|| "?".into());
    format!("{call} of {} {dtype} elements", f.get(2).copied().unwrap_or(-1))
}

/// A `ReduceOp`'s name from its number.
fn reduction(code: i64) -> &'static str {
    [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min]
        .into_iter()
        .find(|op| *op as i64 == code)
        .map(|op| match op {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
        .unwrap_or("?")
}
