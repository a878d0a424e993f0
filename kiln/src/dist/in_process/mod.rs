//! The engine of a group whose ranks are threads of this process, one per
//! device ([`Group::in_process`](crate::dist::Group::in_process)): the
//! in-process case of the rank-local seam, so code written for one process
//! per device (the [`Trainer`](crate::trainer::Trainer) with a process
//! group, a hand-written training loop) runs unchanged with one thread per
//! device.
//!
//! - **Calls**: each rank calls with its own tensor, moved to its device.
//!   The last rank to arrive at a collective runs it once over every rank's
//!   tensor through [`crate::comm`] — the simulated GPUs' ring, NCCL within
//!   one process, or peer copies — so the bytes, the ledger and the
//!   results are those of the multi-device calls; then every rank takes
//!   its own result. A rank's calls run one at a time, in the order it
//!   makes them. The work is queued on the devices; a rank returns once it
//!   is queued, as every device call does.
//! - **Fingerprints**: the rank that completes a call compares every rank's
//!   (call, reduction, dtype, element count, root) first: different calls
//!   are an error on every rank naming both, not a wrong result.
//! - **Failures**: a rank that does not arrive within the group's timeout,
//!   or whose every handle was dropped (its thread ended or panicked), is
//!   named in an error on every waiting rank; the group is then broken and
//!   every later call fails at once. A rank that could not prepare its part
//!   (its tensor could not move to its device) fails the call on every
//!   rank, instead of leaving the others to wait.
//! - **Send and receive** go through a mailbox per (sender, receiver): a
//!   send returns at once; a receive waits, as a call does, for the
//!   sender's buffer, checked against the shape and dtype it expects.

use super::engine::{Done, Engine, Pending};
use super::wire::{dist_error, Call, CallKind, HostBuf, Payload};
use crate::comm;
use crate::{no_grad, DType, Device, Error, Result, Tensor};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One engine per rank of a new world over `devices` (rank r computes on
/// `devices[r]`), waiting `timeout` for the other ranks.
pub(crate) fn open(devices: &[Device], timeout: Duration) -> Result<Vec<Arc<dyn Engine>>> {
    const OP: &str = "Group::in_process";
    if devices.is_empty() {
        return Err(dist_error(0, 0, OP, "needs at least one device (one rank per device)"));
    }
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(dist_error(
                i,
                devices.len(),
                OP,
                format!(
                    "{d} is listed twice: each rank computes on a device of its own (ranks {} and {i})",
                    devices[..i].iter().position(|x| x == d).unwrap_or(0)
                ),
            ));
        }
        crate::registry::backend(*d)?;
    }
    let n = devices.len();
    let world = Arc::new(World {
        devices: devices.to_vec(),
        state: Mutex::new(State {
            seq: 0,
            arrived: (0..n).map(|_| None).collect(),
            running: false,
            results: (0..n).map(|_| None).collect(),
            broken: None,
            left: vec![false; n],
            mail: HashMap::new(),
        }),
        changed: Condvar::new(),
        timeout_ns: AtomicU64::new(duration_ns(timeout)),
    });
    Ok((0..n).map(|rank| Arc::new(InProcessRank { world: world.clone(), rank, order: Mutex::new(()) }) as Arc<dyn Engine>).collect())
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// What the ranks of one world share.
struct World {
    devices: Vec<Device>,
    state: Mutex<State>,
    /// Signalled whenever `state` changes: a rank arrived or left, a call's
    /// results are in, a mail was posted, the group broke.
    changed: Condvar,
    timeout_ns: AtomicU64,
}

struct State {
    /// The number of the collective being gathered (each rank's n-th
    /// collective is call n).
    seq: u64,
    /// Each rank's part of call `seq`, once it arrived.
    arrived: Vec<Option<Arrival>>,
    /// Every rank arrived at call `seq` and its last rank is running it.
    running: bool,
    /// Each rank's result of a finished call, until it takes it: (call
    /// number, result).
    results: Vec<Option<(u64, Result<Option<Tensor>>)>>,
    /// Why the group is broken (every call fails with it).
    broken: Option<String>,
    /// The ranks whose every handle was dropped.
    left: Vec<bool>,
    /// Sent buffers not received yet, per (sender, receiver), in order.
    mail: HashMap<(usize, usize), VecDeque<HostBuf>>,
}

/// One rank's part of a collective.
struct Arrival {
    kind: CallKind,
    dtype: DType,
    len: usize,
    /// The rank's elements, flat, on its device (`None` for a barrier), or
    /// why it could not make them.
    part: std::result::Result<Option<Tensor>, String>,
    /// The tensor the rank's result is written into, for an in-place call.
    into: Option<Tensor>,
}

impl Arrival {
    fn describe(&self, seq: u64) -> String {
        let mut s = format!("#{seq} {}", self.kind.name());
        let op = match self.kind {
            CallKind::AllReduce(op) | CallKind::Reduce { op, .. } | CallKind::ReduceScatter(op) => Some(op),
            CallKind::Broadcast { .. } | CallKind::AllGather | CallKind::Barrier | CallKind::Send { .. } | CallKind::Recv { .. } => None,
        };
        if let Some(op) = op {
            s.push_str(&format!(" ({})", format!("{op:?}").to_lowercase()));
        }
        if self.kind != CallKind::Barrier {
            s.push_str(&format!(" of {} {} elements", self.len, self.dtype));
        }
        if let CallKind::Broadcast { root } | CallKind::Reduce { root, .. } = self.kind {
            s.push_str(&format!(" from root {root}"));
        }
        s
    }

    fn same_call(&self, other: &Arrival) -> bool {
        (self.kind, self.dtype, self.len) == (other.kind, other.dtype, other.len)
    }
}

/// One rank of an in-process world.
struct InProcessRank {
    world: Arc<World>,
    rank: usize,
    /// Held through each call: a rank's calls (from clones of its group on
    /// several threads too) run one at a time.
    order: Mutex<()>,
}

impl Drop for InProcessRank {
    fn drop(&mut self) {
        let mut st = self.world.lock();
        st.left[self.rank] = true;
        drop(st);
        self.world.changed.notify_all();
    }
}

impl World {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    fn size(&self) -> usize {
        self.devices.len()
    }
}

impl InProcessRank {
    fn error(&self, op: &str, msg: impl Into<String>) -> Error {
        dist_error(self.rank, self.world.size(), op, msg)
    }

    /// Takes part in the next collective with `arrival` and returns this
    /// rank's result (flat, on this rank's device; `None` for a barrier or a
    /// result written into `arrival.into`).
    fn collective(&self, arrival: Arrival) -> Result<Option<Tensor>> {
        let _order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        let op = arrival.kind.name();
        let world = &*self.world;
        let mut st = world.lock();
        if let Some(why) = &st.broken {
            return Err(self.error(op, why.clone()));
        }
        let seq = st.seq;
        st.arrived[self.rank] = Some(arrival);
        if st.arrived.iter().all(Option::is_some) {
            let arrivals: Vec<Arrival> = st.arrived.iter_mut().map(|a| a.take().expect("every rank arrived")).collect();
            if let Some(why) = mismatch(seq, &arrivals) {
                st.broken = Some(why.clone());
                drop(st);
                world.changed.notify_all();
                return Err(self.error(op, why));
            }
            st.running = true;
            drop(st);
            // Run outside the lock: the waiting ranks sleep, mail still moves.
            // A panic inside is an error on every rank, not a wait forever.
            let results = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&world.devices, arrivals))).unwrap_or_else(|_| {
                Err(self
                    .error(op, format!("kiln bug: running {op} over the ranks' tensors panicked; the call's results were not computed")))
            });
            let mut st = world.lock();
            let mine = match results {
                Ok(mut outs) => {
                    for (r, out) in outs.iter_mut().enumerate() {
                        st.results[r] = Some((seq, Ok(out.take())));
                    }
                    st.results[self.rank].take().map_or(Ok(None), |(_, out)| out)
                }
                Err(e) => {
                    for r in 0..world.size() {
                        st.results[r] = Some((seq, Err(e.clone())));
                    }
                    st.results[self.rank] = None;
                    Err(e)
                }
            };
            st.seq += 1;
            st.running = false;
            drop(st);
            world.changed.notify_all();
            return mine;
        }
        let deadline = Instant::now() + world.timeout();
        loop {
            if let Some((done, _)) = &st.results[self.rank]
                && *done == seq
            {
                return st.results[self.rank].take().map_or(Ok(None), |(_, out)| out);
            }
            if let Some(why) = &st.broken {
                return Err(self.error(op, why.clone()));
            }
            if !st.running {
                let described = st.arrived[self.rank].as_ref().map(|a| a.describe(seq)).unwrap_or_default();
                let missing: Vec<usize> = (0..world.size()).filter(|&r| st.arrived[r].is_none()).collect();
                let gone: Vec<usize> = missing.iter().copied().filter(|&r| st.left[r]).collect();
                let why = if !gone.is_empty() {
                    Some(format!(
                        "{} left the group (every handle of its Group was dropped: its thread ended or panicked) before calling {described}; the group is broken",
                        ranks(&gone)
                    ))
                } else if Instant::now() >= deadline {
                    Some(format!(
                        "{} did not call {described} within {:.1} s (ranks that did: {}); the group is broken. \
                         A rank that is slow on purpose needs a longer `Group::set_timeout` (or `KILN_DIST_TIMEOUT`)",
                        ranks(&missing),
                        world.timeout().as_secs_f64(),
                        (0..world.size()).filter(|r| !missing.contains(r)).map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
                    ))
                } else {
                    None
                };
                if let Some(why) = why {
                    st.arrived[self.rank] = None;
                    st.broken = Some(why.clone());
                    drop(st);
                    world.changed.notify_all();
                    return Err(self.error(op, why));
                }
            }
            let wait = if st.running { Duration::from_millis(100) } else { deadline.saturating_duration_since(Instant::now()) };
            st = world.changed.wait_timeout(st, wait.max(Duration::from_millis(1))).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Posts `buf` to `peer`'s mailbox from this rank.
    fn send(&self, peer: usize, buf: HostBuf) -> Result<()> {
        let mut st = self.world.lock();
        if let Some(why) = &st.broken {
            return Err(self.error("send", why.clone()));
        }
        st.mail.entry((self.rank, peer)).or_default().push_back(buf);
        drop(st);
        self.world.changed.notify_all();
        Ok(())
    }

    /// The next buffer `peer` sent this rank, which must be like `want`.
    fn recv(&self, peer: usize, want: &HostBuf) -> Result<HostBuf> {
        let _order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        let world = &*self.world;
        let deadline = Instant::now() + world.timeout();
        let mut st = world.lock();
        loop {
            if let Some(why) = &st.broken {
                return Err(self.error("recv", why.clone()));
            }
            if let Some(buf) = st.mail.get_mut(&(peer, self.rank)).and_then(VecDeque::pop_front) {
                if buf.len() != want.len() || buf.wire() != want.wire() {
                    return Err(self.error(
                        "recv",
                        format!(
                            "rank {peer} sent {} elements as {:?}, and this rank receives {} as {:?}: pass the shape and dtype of the tensor it sends",
                            buf.len(),
                            buf.wire(),
                            want.len(),
                            want.wire()
                        ),
                    ));
                }
                return Ok(buf);
            }
            let why = if st.left[peer] {
                Some(format!("rank {peer} left the group (every handle of its Group was dropped) without sending; the group is broken"))
            } else if Instant::now() >= deadline {
                Some(format!("rank {peer} sent nothing within {:.1} s; the group is broken", world.timeout().as_secs_f64()))
            } else {
                None
            };
            if let Some(why) = why {
                st.broken = Some(why.clone());
                drop(st);
                world.changed.notify_all();
                return Err(self.error("recv", why));
            }
            let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            st = world.changed.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

fn ranks(list: &[usize]) -> String {
    match list {
        [one] => format!("rank {one}"),
        many => format!("ranks {}", many.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

/// Why the ranks' parts of call `seq` are not one call: the first rank that
/// differs from rank 0, with both calls, or one that could not make its part.
fn mismatch(seq: u64, arrivals: &[Arrival]) -> Option<String> {
    for (r, a) in arrivals.iter().enumerate() {
        if let Err(why) = &a.part {
            return Some(format!("rank {r} could not make its part of {}: {why}", a.describe(seq)));
        }
        if !a.same_call(&arrivals[0]) {
            return Some(format!(
                "ranks called different collectives: rank 0 called {}, rank {r} called {}; the group is broken",
                arrivals[0].describe(seq),
                a.describe(seq)
            ));
        }
    }
    None
}

/// Runs one collective over every rank's part through `comm`: each rank's
/// result, flat on its device (`None` where it was written into the rank's
/// `into`, or for a barrier).
fn run(devices: &[Device], arrivals: Vec<Arrival>) -> Result<Vec<Option<Tensor>>> {
    let _g = no_grad();
    let n = devices.len();
    let kind = arrivals[0].kind;
    let mut parts = Vec::with_capacity(n);
    let mut intos = Vec::with_capacity(n);
    for a in arrivals {
        // Checked by `mismatch`: every part was made.
        parts.push(a.part.ok().flatten());
        intos.push(a.into);
    }
    let parts: Vec<Tensor> = parts.into_iter().flatten().collect();
    // Written where they are when every rank's destination is its own part.
    let in_place =
        parts.len() == n && intos.iter().zip(&parts).all(|(into, p)| into.as_ref().is_some_and(|i| i.is_contiguous() && p.same_storage(i)));
    let all = |v: Vec<Tensor>| v.into_iter().map(Some).collect::<Vec<_>>();
    match kind {
        CallKind::Barrier => Ok(vec![None; n]),
        CallKind::AllReduce(op) if in_place => {
            comm::all_reduce_(&parts, op)?;
            Ok(vec![None; n])
        }
        CallKind::AllReduce(op) => Ok(all(comm::all_reduce(&parts, op)?)),
        CallKind::Broadcast { root } if in_place => {
            comm::broadcast_(&parts, root)?;
            Ok(vec![None; n])
        }
        CallKind::Broadcast { root } => {
            let mut out = comm::broadcast(&parts[root], devices)?;
            // The root's result is a tensor of its own, not its input.
            out[root] = parts[root].force_copy()?;
            Ok(all(out))
        }
        CallKind::Reduce { root, op } => {
            let combined = comm::reduce(&parts, root, op)?;
            let mut out = Vec::with_capacity(n);
            for (r, p) in parts.iter().enumerate() {
                out.push(Some(if r == root { combined.clone() } else { p.force_copy()? }));
            }
            Ok(out)
        }
        CallKind::AllGather => Ok(all(comm::all_gather(&parts)?)),
        CallKind::ReduceScatter(op) => Ok(all(comm::reduce_scatter(&parts, op)?)),
        CallKind::Send { .. } | CallKind::Recv { .. } => {
            Err(dist_error(0, n, kind.name(), "kiln bug: a send or receive reached the collectives of an in-process group"))
        }
    }
}

impl Engine for InProcessRank {
    fn name(&self) -> &'static str {
        "in-process"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.world.size()
    }

    fn submit(&self, call: Call) -> Result<Box<dyn Pending>> {
        let op = call.kind.name();
        let staged = |data: Payload| match data {
            Payload::Staged(buf) => Ok(buf),
            Payload::InPlace(view) => view.staged().map_err(|msg| self.error(op, msg)),
        };
        let out = match call.kind {
            CallKind::Barrier => self
                .collective(Arrival { kind: call.kind, dtype: DType::U8, len: 0, part: Ok(None), into: None })
                .map(|_| HostBuf::U8(Vec::new())),
            CallKind::Send { peer } => self.send(peer, staged(call.data)?).map(|()| HostBuf::U8(Vec::new())),
            CallKind::Recv { peer } => self.recv(peer, &staged(call.data)?),
            // `on_device` takes every collective of tensors: none is staged.
            CallKind::AllReduce(_)
            | CallKind::Broadcast { .. }
            | CallKind::Reduce { .. }
            | CallKind::AllGather
            | CallKind::ReduceScatter(_) => {
                Err(self.error(op, "kiln bug: an in-process group's collective was staged through host memory"))
            }
        };
        Ok(Box::new(Done(out)))
    }

    fn on_device(
        &self,
        kind: CallKind,
        t: &Tensor,
        dims: &[usize],
        into: Option<&Tensor>,
        _divisor: Option<usize>,
    ) -> Option<Result<Tensor>> {
        match kind {
            CallKind::AllReduce(_)
            | CallKind::Broadcast { .. }
            | CallKind::Reduce { .. }
            | CallKind::AllGather
            | CallKind::ReduceScatter(_) => {}
            CallKind::Barrier | CallKind::Send { .. } | CallKind::Recv { .. } => return None,
        }
        Some(self.on_own_device(kind, t, dims, into))
    }

    fn timeout(&self) -> Duration {
        self.world.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.world.timeout_ns.store(duration_ns(timeout), Ordering::Relaxed);
    }
}

impl InProcessRank {
    /// `kind` on `t` (moved to this rank's device): the result of `dims` on
    /// `t`'s device, written into `into` when given. A mean is divided by
    /// `comm` (by the number of ranks).
    fn on_own_device(&self, kind: CallKind, t: &Tensor, dims: &[usize], into: Option<&Tensor>) -> Result<Tensor> {
        let _g = no_grad();
        let device = self.world.devices[self.rank];
        let part = t.to(&device).and_then(|p| p.flatten_all()).map(Some).map_err(|e| e.to_string());
        let arrival = Arrival { kind, dtype: t.dtype(), len: t.elem_count(), part, into: into.cloned() };
        let out = self.collective(arrival)?;
        match (out, into) {
            (None, Some(into)) => Ok(into.clone()),
            (Some(flat), into) => {
                let out = flat.reshape(dims)?.to(&t.device())?;
                match into {
                    Some(into) => {
                        into.assign(&out)?;
                        Ok(into.clone())
                    }
                    None => Ok(out),
                }
            }
            (None, None) => Err(self.error(kind.name(), "kiln bug: a collective of an in-process group gave no result")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ReduceOp;

    #[test]
    fn a_world_needs_distinct_devices() {
        assert!(open(&[], Duration::from_secs(1)).is_err());
        let twice = open(&[Device::Cpu, Device::Cpu], Duration::from_secs(1)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(twice.contains("listed twice"), "{twice}");
        let world = open(&[Device::Cpu], Duration::from_secs(1)).expect("a world of one CPU rank");
        assert_eq!((world.len(), world[0].name(), world[0].size()), (1, "in-process", 1));
    }

    #[test]
    fn fingerprints_name_both_calls() {
        let a = Arrival { kind: CallKind::AllReduce(ReduceOp::Sum), dtype: DType::F32, len: 4, part: Ok(None), into: None };
        let b = Arrival { kind: CallKind::Broadcast { root: 1 }, dtype: DType::F32, len: 4, part: Ok(None), into: None };
        let why = mismatch(3, &[a, b]).unwrap_or_default();
        assert!(why.contains("rank 0 called #3 all_reduce (sum) of 4 f32 elements"), "{why}");
        assert!(why.contains("rank 1 called #3 broadcast of 4 f32 elements from root 1"), "{why}");
    }
}
