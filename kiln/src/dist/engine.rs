//! The seam every process-group engine implements, the list engines are
//! found in, and the engine of a world of one.

use super::launch::Launch;
use super::wire::{dist_error, Call, CallKind, HostBuf, Payload};
use crate::Result;
use std::time::Duration;

/// One way for the processes of a job to talk: it runs this rank's part of
/// each call, on buffers staged in host memory, and returns this rank's
/// result. Every call is rank-local: each rank passes its own buffer.
pub(crate) trait Engine: Send + Sync {
    /// The engine's name (`kiln devices`, errors).
    fn name(&self) -> &'static str;
    /// This process's rank.
    fn rank(&self) -> usize;
    /// The number of processes.
    fn size(&self) -> usize;
    /// Hands `call` over and returns at once; the result comes from the
    /// [`Pending`]. Calls run in the order they were handed over. An error
    /// here means nothing was handed over (the group is broken).
    fn submit(&self, call: Call) -> Result<Box<dyn Pending>>;
    /// Runs `call` and returns this rank's result: an error names the
    /// ranks and the call when another rank is silent past the timeout or
    /// called something else.
    fn run(&self, call: Call) -> Result<HostBuf> {
        self.submit(call)?.wait()
    }
    /// Runs `kind` on this rank's tensor `t` where it is, without the host,
    /// when the engine can (NCCL, on this rank's CUDA device): the result as
    /// a tensor of `dims` on `t`'s device, written into `into` when given,
    /// a mean divided by `divisor`. `None`: the call goes through host
    /// memory ([`submit`](Self::submit)). The choice depends only on what
    /// every rank shares (the call, the dtype, the kind of device).
    fn on_device(
        &self,
        _kind: CallKind,
        _t: &crate::Tensor,
        _dims: &[usize],
        _into: Option<&crate::Tensor>,
        _divisor: Option<usize>,
    ) -> Option<Result<crate::Tensor>> {
        None
    }
    /// How long a call waits for the other ranks before it is an error.
    fn timeout(&self) -> Duration;
    /// Sets that wait.
    fn set_timeout(&self, timeout: Duration);
}

/// A call handed to an engine and not waited for yet.
pub(crate) trait Pending: Send {
    /// Whether the result is in (a wait would not block).
    fn is_done(&self) -> bool;
    /// This rank's result, once the call is done.
    fn wait(self: Box<Self>) -> Result<HostBuf>;
}

/// A call whose result was known when it was handed over.
pub(crate) struct Done(pub(crate) Result<HostBuf>);

impl Pending for Done {
    fn is_done(&self) -> bool {
        true
    }

    fn wait(self: Box<Self>) -> Result<HostBuf> {
        self.0
    }
}

/// An engine's constructor: `None` when it does not serve this launch.
pub(crate) type Open = fn(&Launch, Duration) -> Option<Result<Box<dyn Engine>>>;

/// A world of one: every collective returns this rank's own data (the
/// reduction of one tensor), as PyTorch's with one process.
pub(crate) struct Single;

pub(super) fn open_single(launch: &Launch, _: Duration) -> Option<Result<Box<dyn Engine>>> {
    (launch.size == 1).then(|| Ok(Box::new(Single) as Box<dyn Engine>))
}

impl Engine for Single {
    fn name(&self) -> &'static str {
        "single"
    }

    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn submit(&self, call: Call) -> Result<Box<dyn Pending>> {
        Ok(Box::new(Done(self.run_now(call))))
    }

    fn timeout(&self) -> Duration {
        Duration::MAX
    }

    fn set_timeout(&self, _: Duration) {}
}

impl Single {
    fn run_now(&self, call: Call) -> Result<HostBuf> {
        match call.kind {
            CallKind::AllReduce(_)
            | CallKind::Broadcast { .. }
            | CallKind::Reduce { .. }
            | CallKind::AllGather
            | CallKind::ReduceScatter(_)
            | CallKind::Barrier => match call.data {
                Payload::Staged(own) => Ok(own),
                // Written in place: it already holds its own value.
                Payload::InPlace(view) if view.write => Ok(HostBuf::U8(Vec::new())),
                Payload::InPlace(view) => view.staged().map_err(|msg| dist_error(0, 1, call.kind.name(), msg)),
            },
            CallKind::Send { peer } | CallKind::Recv { peer } => Err(dist_error(
                0,
                1,
                call.kind.name(),
                format!("rank {peer} does not exist in a world of one; launch several processes with mpirun or srun"),
            )),
        }
    }
}
