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
//!   named in an error on every waiting rank, and so is a run that does not
//!   return within it; the group is then broken and every later call fails
//!   at once. A rank that could not prepare its part (its tensor could not
//!   move to its device) fails the call on every rank, instead of leaving
//!   the others to wait. A call that failed while it ran leaves an in-place
//!   destination poisoned, as the other engines do.
//! - **Send and receive** go through a mailbox per (sender, receiver): a
//!   send returns at once; a receive waits, as a call does, for the
//!   sender's buffer, checked against the shape and dtype it expects.

use super::engine::{Done, Engine, Pending};
use super::wire::{dist_error, Call, CallKind, HostBuf, Payload};
use crate::comm;
use crate::runtime::ledger;
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
            running: None,
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
    /// The rank running call `seq` (every rank arrived; it came last).
    running: Option<usize>,
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
    /// The call site the rank's thread books transfers to, if any.
    site: Option<&'static std::panic::Location<'static>>,
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

    /// Takes part in the next collective with `arrival`: this rank's result
    /// (flat, on this rank's device; `None` for a barrier or a result
    /// written into `arrival.into`), or why the call did not run.
    fn collective(&self, arrival: Arrival) -> Outcome {
        let _order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        let op = arrival.kind.name();
        let world = &*self.world;
        let n = world.size();
        let mut st = world.lock();
        if let Some(why) = &st.broken {
            return Outcome::NotRun(self.error(op, why.clone()));
        }
        let seq = st.seq;
        st.arrived[self.rank] = Some(arrival);
        if st.arrived.iter().all(Option::is_some) {
            let arrivals: Vec<Arrival> = st.arrived.iter_mut().filter_map(Option::take).collect();
            if let Some(why) = mismatch(seq, &arrivals) {
                break_group(&mut st, why.clone());
                drop(st);
                world.changed.notify_all();
                return Outcome::NotRun(self.error(op, why));
            }
            let described = arrivals[0].describe(seq);
            st.running = Some(self.rank);
            drop(st);
            // Booked at a rank's call (the first that has a site: inside
            // `Trainer::fit`, the caller's line), unless this thread has one.
            let _site = arrivals.iter().find_map(|a| a.site).map(ledger::site_scope);
            // Run outside the lock: the waiting ranks sleep, mail still moves.
            // A panic inside is an error on every rank, not a wait forever.
            let results = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&world.devices, arrivals))).unwrap_or_else(|_| {
                Err(self
                    .error(op, format!("kiln bug: running {described} over the ranks' tensors panicked; its results were not computed")))
            });
            let mut st = world.lock();
            st.seq += 1;
            st.running = None;
            let mine = if let Some(why) = &st.broken {
                // A waiting rank gave up on this run (past the timeout).
                Err(self.error(op, format!("{described} finished after the other ranks gave up on it: {why}")))
            } else {
                match results {
                    Ok(mut outs) => {
                        for (r, out) in outs.iter_mut().enumerate() {
                            st.results[r] = Some((seq, Ok(out.take())));
                        }
                        st.results[self.rank].take().map_or(Ok(None), |(_, out)| out)
                    }
                    Err(e) => {
                        for r in (0..n).filter(|&r| r != self.rank) {
                            let why = format!("{described} failed while rank {} ran it over every rank's tensors: {e}", self.rank);
                            st.results[r] = Some((seq, Err(dist_error(r, n, op, why))));
                        }
                        Err(e)
                    }
                }
            };
            drop(st);
            world.changed.notify_all();
            return Outcome::Ran(mine);
        }
        let deadline = Instant::now() + world.timeout();
        loop {
            if let Some((done, _)) = &st.results[self.rank]
                && *done == seq
            {
                return Outcome::Ran(st.results[self.rank].take().map_or(Ok(None), |(_, out)| out));
            }
            if let Some(why) = &st.broken {
                return Outcome::NotRun(self.error(op, why.clone()));
            }
            let mine = st.arrived[self.rank].as_ref();
            let described = mine.map(|a| a.describe(seq)).unwrap_or_default();
            // This rank's own part, when it could not make it: said too.
            let own = match mine.map(|a| &a.part) {
                Some(Err(e)) => format!(" (and this rank could not make its part: {e})"),
                _ => String::new(),
            };
            let why = match st.running {
                Some(runner) if Instant::now() >= deadline => Some(format!(
                    "{described} did not finish within {}: rank {runner} runs it over every rank's tensors and has not returned \
                     (a device that does not finish its work?); the group is broken",
                    secs(world.timeout())
                )),
                Some(_) => None,
                None => {
                    let missing: Vec<usize> = (0..n).filter(|&r| st.arrived[r].is_none()).collect();
                    let gone: Vec<usize> = missing.iter().copied().filter(|&r| st.left[r]).collect();
                    if !gone.is_empty() {
                        Some(format!(
                            "{} left the group (every handle of its Group was dropped: its thread ended or panicked) before calling {described}{own}; \
                             the group is broken",
                            ranks(&gone)
                        ))
                    } else if Instant::now() >= deadline {
                        Some(format!(
                            "{} did not call {described} within {} (ranks that did: {}){own}; the group is broken. \
                             A rank that is slow on purpose needs a longer `Group::set_timeout` (or `KILN_DIST_TIMEOUT`)",
                            ranks(&missing),
                            secs(world.timeout()),
                            (0..n).filter(|r| !missing.contains(r)).map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
                        ))
                    } else {
                        None
                    }
                }
            };
            if let Some(why) = why {
                break_group(&mut st, why.clone());
                drop(st);
                world.changed.notify_all();
                return Outcome::NotRun(self.error(op, why));
            }
            let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            st = world.changed.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner()).0;
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
    /// (Not ordered with this rank's collectives: a receive waits for its
    /// sender only.)
    fn recv(&self, peer: usize, want: &HostBuf) -> Result<HostBuf> {
        let world = &*self.world;
        let deadline = Instant::now() + world.timeout();
        let mut st = world.lock();
        loop {
            if let Some(why) = &st.broken {
                return Err(self.error("recv", why.clone()));
            }
            let why = match st.mail.get_mut(&(peer, self.rank)).and_then(VecDeque::pop_front) {
                Some(buf) if buf.len() == want.len() && buf.wire() == want.wire() => return Ok(buf),
                Some(buf) => format!(
                    "rank {peer} sent {} elements as {:?}, and rank {} receives {} as {:?}: pass the shape and dtype of the tensor it sends; \
                     the group is broken",
                    buf.len(),
                    buf.wire(),
                    self.rank,
                    want.len(),
                    want.wire()
                ),
                None if st.left[peer] => {
                    format!("rank {peer} left the group (every handle of its Group was dropped) without sending; the group is broken")
                }
                None if Instant::now() >= deadline => {
                    format!("rank {peer} sent nothing within {}; the group is broken", secs(world.timeout()))
                }
                None => {
                    let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                    st = world.changed.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner()).0;
                    continue;
                }
            };
            break_group(&mut st, why.clone());
            drop(st);
            world.changed.notify_all();
            return Err(self.error("recv", why));
        }
    }
}

/// How a rank's part of a collective ended.
enum Outcome {
    /// The call did not run (the group is broken, the calls differ, a rank
    /// is silent or left): nothing was written.
    NotRun(Error),
    /// The call ran: this rank's result, or the error of running it (after
    /// which a destination may be half written).
    Ran(Result<Option<Tensor>>),
}

/// Breaks the group for `why`, and drops the parts waiting in it (device
/// buffers, kept otherwise until every handle is dropped).
fn break_group(st: &mut State, why: String) {
    st.broken = Some(why);
    for a in &mut st.arrived {
        *a = None;
    }
}

/// A wait in seconds, as the errors say it ("0.5 s", "60 s").
fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
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
            CallKind::Barrier => match self.collective(Arrival {
                kind: call.kind,
                dtype: DType::U8,
                len: 0,
                part: Ok(None),
                into: None,
                site: ledger::current_site(),
            }) {
                Outcome::NotRun(e) | Outcome::Ran(Err(e)) => Err(e),
                Outcome::Ran(Ok(_)) => Ok(HostBuf::U8(Vec::new())),
            },
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
        let arrival = Arrival { kind, dtype: t.dtype(), len: t.elem_count(), part, into: into.cloned(), site: ledger::current_site() };
        let out = match self.collective(arrival) {
            // Nothing was written: `into` keeps its value.
            Outcome::NotRun(e) => return Err(e),
            Outcome::Ran(out) => out,
        };
        let result = out.and_then(|out| match (out, into) {
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
        });
        // The call ran: a destination it failed to finish is not trustworthy.
        if let (Err(e), Some(into)) = (&result, into) {
            into.storage.poison(e);
        }
        result
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
        let a = Arrival { kind: CallKind::AllReduce(ReduceOp::Sum), dtype: DType::F32, len: 4, part: Ok(None), into: None, site: None };
        let b = Arrival { kind: CallKind::Broadcast { root: 1 }, dtype: DType::F32, len: 4, part: Ok(None), into: None, site: None };
        let why = mismatch(3, &[a, b]).unwrap_or_default();
        assert!(why.contains("rank 0 called #3 all_reduce (sum) of 4 f32 elements"), "{why}");
        assert!(why.contains("rank 1 called #3 broadcast of 4 f32 elements from root 1"), "{why}");
    }
}
