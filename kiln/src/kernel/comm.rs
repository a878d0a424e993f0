//! The collective contract: what a backend implements to move and reduce
//! data across its own devices natively (a ring over simulated GPUs' queues,
//! NCCL over CUDA devices). The front end (`comm/`) validates, books the
//! traffic in the transfer ledger and falls back to peer copies and ordinary
//! kernels for any group of devices no communicator covers, so a backend
//! without one still runs every collective.
//!
//! Every call is asynchronous like a kernel launch: it queues its work on the
//! devices of the group (each device's part after the work queued there
//! before, and before the work queued after) and returns. A read or a
//! barrier waits for it; a failure poisons the queues it ran on and is
//! reported by the next synchronising call.

use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::storage::Storage;
use std::sync::Arc;

/// How a reduction combines the parts of its devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Combine {
    /// Elementwise sum (integers wrap).
    Sum,
    /// Elementwise maximum; NaN wins.
    Max,
    /// Elementwise minimum; NaN wins.
    Min,
}

/// One device's part of a collective: `len` contiguous elements of
/// `storage` from element `offset`. The parts of one call are on distinct
/// devices, all of one dtype, in the group's order (rank i = part i).
#[derive(Clone)]
pub(crate) struct Part {
    pub storage: Arc<Storage>,
    pub offset: usize,
    pub len: usize,
}

/// Collectives over the devices of one backend. The front end calls them
/// only with parts whose devices all return this communicator from
/// [`Backend::communicator`](crate::kernel::Backend::communicator),
/// at least two of them, validated (same dtype, lengths as documented,
/// distinct devices); `parts` may name any subset of the devices in any
/// order. All are in place and asynchronous (see the module's doc).
pub(crate) trait Communicator: Send + Sync {
    /// What it is, for `kiln devices` and errors: "simulated ring", "NCCL 2.21.5".
    fn name(&self) -> String;
    /// Whether it combines `dtype` with `op` as kiln does (integers wrap,
    /// a NaN wins a max or min). The front end sends a reduction it does
    /// not through peer copies and kernels instead: NCCL's float max and
    /// min let a NaN lose.
    fn reduces(&self, _dtype: DType, _op: Combine) -> bool {
        true
    }
    /// Every part becomes the elementwise combination of all parts; the
    /// results are bit-identical on every device.
    fn all_reduce(&self, parts: &[Part], op: Combine) -> Result<()>;
    /// Part `root` is copied into every other part.
    fn broadcast(&self, parts: &[Part], root: usize) -> Result<()>;
    /// Part `root` becomes the combination of all parts; the other parts
    /// may be used as scratch space (their contents are unspecified after).
    fn reduce(&self, parts: &[Part], root: usize, op: Combine) -> Result<()>;
    /// `outputs[i]` (n·L elements) becomes the concatenation of every
    /// `inputs[j]` (L elements each), in rank order.
    fn all_gather(&self, inputs: &[Part], outputs: &[Part]) -> Result<()>;
    /// `outputs[i]` (L elements) becomes elements i·L..(i+1)·L of the
    /// combination of every `inputs[j]` (n·L elements each); the inputs may
    /// be used as scratch space.
    fn reduce_scatter(&self, inputs: &[Part], outputs: &[Part], op: Combine) -> Result<()>;
    /// Makes the compute stream of each device wait (without blocking the
    /// host) for the collectives queued on it so far. The front end joins
    /// after every public collective; the data-parallel trainer joins once
    /// before the optimizer step, so that backward's kernels queued
    /// meanwhile overlap the communication.
    fn join(&self, backends: &[&'static dyn crate::kernel::Backend]) -> Result<()>;
}

/// The chunks a ring cuts `len` elements into for `n` devices: `n` runs,
/// the first `len % n` one element longer (numpy's `array_split`), as
/// `(start, len)`.
pub(crate) fn chunk_bounds(len: usize, n: usize) -> Vec<(usize, usize)> {
    let n = n.max(1);
    let (base, extra) = (len / n, len % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let l = base + usize::from(i < extra);
            let c = (start, l);
            start += l;
            c
        })
        .collect()
}

/// Elements rank `d` sends to rank `d + 1` in a ring all-reduce over `n`
/// ranks of chunks `chunks` (reduce-scatter, then all-gather): every chunk
/// but one in each phase. What the transfer ledger books per link.
pub(crate) fn ring_all_reduce_sent(chunks: &[(usize, usize)], d: usize) -> usize {
    let n = chunks.len();
    let total: usize = chunks.iter().map(|c| c.1).sum();
    if n < 2 {
        return 0;
    }
    // Reduce-scatter skips chunk d + 1 (the one d ends up owning is sent to
    // it), all-gather skips chunk d + 2 (the one d receives last).
    (total - chunks[(d + 1) % n].1) + (total - chunks[(d + 2) % n].1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_like_array_split() {
        assert_eq!(chunk_bounds(10, 3), vec![(0, 4), (4, 3), (7, 3)]);
        assert_eq!(chunk_bounds(2, 4), vec![(0, 1), (1, 1), (2, 0), (2, 0)]);
        assert_eq!(chunk_bounds(0, 2), vec![(0, 0), (0, 0)]);
        for len in 0..40 {
            for n in 1..7 {
                let c = chunk_bounds(len, n);
                assert_eq!(c.len(), n);
                assert_eq!(c.iter().map(|c| c.1).sum::<usize>(), len);
                assert!(c.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
            }
        }
    }

    #[test]
    fn a_ring_all_reduce_sends_two_n_minus_one_chunks_per_link() {
        let c = chunk_bounds(12, 4);
        for d in 0..4 {
            assert_eq!(ring_all_reduce_sent(&c, d), 2 * 3 * 3);
        }
        assert_eq!(ring_all_reduce_sent(&chunk_bounds(12, 1), 0), 0);
    }
}

/// One rank's collective across processes, on device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RankCall {
    /// Every rank's input combined; `len` elements in and out.
    AllReduce(Combine),
    /// The root's input on every rank.
    Broadcast { root: usize },
    /// Every rank's `len` elements, rank 0's first: the output holds
    /// `size · len`.
    AllGather,
    /// The combination's `rank`-th piece of `len` elements: the input holds
    /// `size · len`.
    ReduceScatter(Combine),
}

/// Communicators across processes on one kind of device (NCCL on CUDA):
/// the [`Backend::process_comms`](crate::kernel::Backend::process_comms)
/// of a backend that has them.
pub(crate) trait ProcessComms: Send + Sync {
    /// What runs the calls ("NCCL 2.21.5").
    fn name(&self) -> String;
    /// Whether it combines `dtype` with `op` as kiln does.
    fn reduces(&self, dtype: DType, op: Combine) -> bool;
    /// A new id for a communicator (rank 0 makes it and hands it to the
    /// others), or the one the environment names (`NCCL_COMM_ID`).
    fn unique_id(&self) -> Result<Vec<u8>>;
    /// Joins the communicator `id` names as `rank` of `size`, on `device`
    /// (one of this backend's): returns when every rank has joined, or an
    /// error once `timeout` has passed without them (where the library can
    /// make communicators without blocking; otherwise it blocks until they
    /// join or the library gives up).
    fn join(
        &self,
        device: &'static dyn crate::kernel::Backend,
        id: &[u8],
        size: usize,
        rank: usize,
        timeout: std::time::Duration,
    ) -> Result<Box<dyn RankComm>>;
}

/// This process's rank of a communicator across processes.
pub(crate) trait RankComm: Send + Sync {
    /// Queues `call` on the device after the work queued so far: reads
    /// `input`, writes `output` (each contiguous on this rank's device).
    fn queue(&self, call: RankCall, input: &Part, output: &Part) -> Result<()>;
    /// Waits until the calls queued so far are done: an error names a
    /// failed call, or the wait that passed `timeout` (the communicator is
    /// then aborted, so the device is not left waiting for a dead rank).
    fn wait(&self, timeout: std::time::Duration) -> Result<()>;
    /// Aborts the communicator after this rank failed on its own side of a
    /// call (its calls from now on are `err`): the other ranks then fail or
    /// time out rather than pair their next call with this rank's.
    fn abort(&self, err: &crate::Error);
}
