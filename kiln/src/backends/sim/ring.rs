//! The simulated GPUs' communicator: collectives as a real chunked ring
//! across the devices' collective queues, over a modelled link.
//!
//! Each device has a queue for collectives beside its compute queue (see
//! `queue.rs`), so communication overlaps compute as NCCL's stream does. A
//! collective first makes each collective queue wait for the work queued
//! so far on its compute queue (the inputs are produced there), then runs
//! its steps. In one step every device sends one chunk to its neighbour:
//! the sender's queue copies the chunk into a staging buffer that lives on
//! the receiver (booked in its memory), and the receiver's queue waits for
//! that copy, combines the staging buffer into its own chunk, and then
//! waits out the rest of the modelled transfer time, latency + bytes /
//! bandwidth, counted from the start of the send. A sender waits for its
//! receiver to have consumed the previous step's staging buffer before it
//! refills it. Each queue only ever writes its own device's buffers and
//! reads its own (and its staging), so no two queues contend for a lock.
//!
//! An all-reduce of S bytes over n devices is a reduce-scatter and an
//! all-gather of n − 1 steps each, so on an idle machine it takes about
//! 2(n − 1)·(latency + S / (n·bandwidth)): the textbook ring cost, which
//! `kiln bench Comm` measures. Where the host's own copies take longer than
//! the modelled link (a fast link, a large buffer), the host's time shows
//! in wall time; the devices' clocks (`queue.rs`) charge a transfer its
//! modelled time only, so `sim::elapsed` gives the ring's time
//! on GPUs of their own, whatever this host's cores and memory allow.
//!
//! The link is `KILN_SIM_LINK_BANDWIDTH` (default 12 GB/s, a PCIe 3.0 ×16
//! link as NCCL measures it) and `KILN_SIM_LINK_LATENCY` (default 10 µs,
//! in microseconds), or [`set_link`] at run time.

use super::queue::{Job, SimEvent, Stamp};
use super::SimBackend;
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{Layout, Shape};
use crate::kernel::comm::{chunk_bounds, Combine, Communicator, Part};
use crate::kernel::cuda::CudaDevice;
use crate::kernel::storage::Storage;
use crate::kernel::Backend;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use std::borrow::Cow;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// The simulated GPUs' communicator (every simulated GPU returns it).
pub(crate) static RING: SimRing = SimRing;

/// Collectives over simulated GPUs as a chunked ring (see the module's doc).
pub(crate) struct SimRing;

/// Default bandwidth of the modelled link between two simulated GPUs, in
/// bytes per second: what NCCL reaches over PCIe 3.0 ×16.
pub const DEFAULT_LINK_BANDWIDTH: f64 = 12e9;
/// Default latency of one transfer over the modelled link.
pub const DEFAULT_LINK_LATENCY: Duration = Duration::from_micros(10);

/// The modelled link between two neighbouring simulated GPUs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimLink {
    /// Bytes per second (finite, above 0).
    pub bandwidth: f64,
    /// Fixed cost of every transfer.
    pub latency: Duration,
}

impl SimLink {
    /// Time to move `bytes` over the link.
    pub fn transfer_time(&self, bytes: usize) -> Duration {
        self.latency + Duration::from_secs_f64(bytes as f64 / self.bandwidth)
    }
}

static LINK: RwLock<Option<SimLink>> = RwLock::new(None);

/// The link the simulated GPUs' collectives model now.
pub(crate) fn link() -> SimLink {
    if let Some(l) = *LINK.read().unwrap_or_else(|e| e.into_inner()) {
        return l;
    }
    let from_env = || {
        let bandwidth = crate::base::env::env_setting(
            "KILN_SIM_LINK_BANDWIDTH",
            "bytes per second, such as 12GB (12 GB/s) or 500MB; the unit may end in /s",
            |v| crate::base::env::parse_bytes(v.trim_end_matches("/s")).ok().map(|b| b as f64).filter(|&b| b > 0.0),
        )
        .unwrap_or(DEFAULT_LINK_BANDWIDTH);
        let latency = crate::base::env::env_setting("KILN_SIM_LINK_LATENCY", "microseconds from 0 to 1000000, e.g. 10", |v| {
            v.trim_end_matches("us").trim().parse::<u64>().ok().filter(|&us| us <= 1_000_000)
        })
        .map_or(DEFAULT_LINK_LATENCY, Duration::from_micros);
        SimLink { bandwidth, latency }
    };
    let mut slot = LINK.write().unwrap_or_else(|e| e.into_inner());
    *slot.get_or_insert_with(from_env)
}

/// Sets the link the simulated GPUs' collectives model from now on.
pub(crate) fn set_link(link: SimLink) -> Result<()> {
    if !(link.bandwidth.is_finite() && link.bandwidth > 0.0) || link.latency > Duration::from_secs(1) {
        return Err(Error::invalid(
            "sim::set_link",
            format!("bandwidth must be a finite number of bytes per second above 0 and latency at most 1 s, got {link:?}"),
        ));
    }
    *LINK.write().unwrap_or_else(|e| e.into_inner()) = Some(link);
    Ok(())
}

/// `out[to..to + len] = combine(out[to..], input[from..from + len])`, or a
/// copy without `combine`.
#[derive(Clone)]
struct Move {
    from: usize,
    to: usize,
    len: usize,
    combine: Option<Combine>,
}

fn combine_into<T: Copy>(out: &mut [T], input: &[T], f: impl Fn(T, T) -> T) {
    for (o, &i) in out.iter_mut().zip(input) {
        *o = f(*o, i);
    }
}

/// Max and min that let a NaN win, as kiln's `maximum`/`minimum` do.
#[allow(clippy::eq_op)]
fn fmax<T: PartialOrd + Copy>(a: T, b: T) -> T {
    // x != x only for a NaN.
    if a != a || (b == b && a >= b) {
        a
    } else {
        b
    }
}

#[allow(clippy::eq_op)]
fn fmin<T: PartialOrd + Copy>(a: T, b: T) -> T {
    if a != a || (b == b && a <= b) {
        a
    } else {
        b
    }
}

macro_rules! each_dtype {
    ($out:expr, $input:expr, |$o:ident, $i:ident| $body:expr, |$of:ident, $if_:ident| $fbody:expr) => {
        match ($out, $input) {
            (CpuBuffer::F32($of), CpuBuffer::F32($if_)) => $fbody,
            (CpuBuffer::F64($of), CpuBuffer::F64($if_)) => $fbody,
            (CpuBuffer::F16($of), CpuBuffer::F16($if_)) => $fbody,
            (CpuBuffer::BF16($of), CpuBuffer::BF16($if_)) => $fbody,
            (CpuBuffer::I64($o), CpuBuffer::I64($i)) => $body,
            (CpuBuffer::I32($o), CpuBuffer::I32($i)) => $body,
            (CpuBuffer::U8($o), CpuBuffer::U8($i)) => $body,
            (o, i) => {
                return Err(Error::invalid(
                    "collective",
                    format!("a ring step met buffers of {} and {} (a kiln bug: please report it)", o.dtype(), i.dtype()),
                ))
            }
        }
    };
}

impl CustomKernel for Move {
    fn name(&self) -> &'static str {
        "collective"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let (from, to, len) = (self.from, self.to, self.len);
        let input = inputs[0].buf;
        if from + len > input.len() || to + len > out.len() {
            return Err(Error::invalid("collective", "a ring step out of its buffers' bounds (a kiln bug: please report it)"));
        }
        match self.combine {
            None => each_dtype!(out, input, |o, i| o[to..to + len].copy_from_slice(&i[from..from + len]), |o, i| o[to..to + len]
                .copy_from_slice(&i[from..from + len])),
            Some(Combine::Sum) => each_dtype!(
                out,
                input,
                |o, i| combine_into(&mut o[to..to + len], &i[from..from + len], |a, b| a.wrapping_add(b)),
                |o, i| combine_into(&mut o[to..to + len], &i[from..from + len], |a, b| a + b)
            ),
            Some(Combine::Max) => {
                each_dtype!(out, input, |o, i| combine_into(&mut o[to..to + len], &i[from..from + len], |a, b| a.max(b)), |o, i| {
                    combine_into(&mut o[to..to + len], &i[from..from + len], fmax)
                })
            }
            Some(Combine::Min) => {
                each_dtype!(out, input, |o, i| combine_into(&mut o[to..to + len], &i[from..from + len], |a, b| a.min(b)), |o, i| {
                    combine_into(&mut o[to..to + len], &i[from..from + len], fmin)
                })
            }
        }
        Ok(())
    }
    fn cuda(&self, _dev: &dyn CudaDevice, _inputs: &[Src<'_>], _out: &Storage) -> Result<()> {
        Err(Error::invalid("collective", "the simulated ring's steps run on simulated GPUs only (a kiln bug: please report it)"))
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(self.clone())
    }
}

/// A whole storage as a kernel operand.
fn whole(storage: &Arc<Storage>) -> Src<'static> {
    Src { storage: Cow::Owned(storage.clone()), layout: Cow::Owned(Layout::contiguous(Shape::from(storage.len))) }
}

fn sim_of(storage: &Storage) -> Result<&'static SimBackend> {
    storage.backend.as_any().downcast_ref::<SimBackend>().ok_or_else(|| Error::Backend {
        device: storage.device,
        msg: "the simulated ring was given a storage of another backend (a kiln bug: please report it)".into(),
    })
}

/// One chunk a sender moves in a step: from its `src` part to part `dst`.
#[derive(Clone, Copy)]
struct Send {
    src: usize,
    dst: usize,
    /// Offsets within the parts (the Part's own offset is added).
    from: usize,
    to: usize,
    len: usize,
}

/// A collective in progress over `storages` (one per rank), on their
/// devices' collective queues.
struct Steps<'a> {
    storages: Vec<&'a Arc<Storage>>,
    offsets: Vec<usize>,
    devs: Vec<&'static SimBackend>,
    dtype: DType,
    /// Staging buffers, by sender, on that sender's receiver.
    staging: Vec<Option<Arc<Storage>>>,
    /// Each rank's collective queue after its last receive.
    received: Vec<Option<Arc<SimEvent>>>,
    link: SimLink,
}

impl<'a> Steps<'a> {
    /// Opens a collective: `links[s] = Some(r)` when rank `s` sends to rank
    /// `r` in this algorithm (at most `staging_len` elements a step). The
    /// staging buffers are allocated first, so running out of memory queues
    /// nothing.
    fn open(parts: &'a [Part], links: &[Option<usize>], staging_len: usize) -> Result<Steps<'a>> {
        let devs = parts.iter().map(|p| sim_of(&p.storage)).collect::<Result<Vec<_>>>()?;
        let dtype = parts[0].storage.dtype;
        let mut staging = Vec::with_capacity(parts.len());
        for l in links {
            staging.push(match l {
                Some(r) if staging_len > 0 => Some(crate::backends::alloc(devs[*r], dtype, staging_len)?),
                _ => None,
            });
        }
        // The inputs are produced by work queued on the compute queues.
        for d in &devs {
            let ready = d.compute_queue().record_event();
            d.comm_queue().wait_event(ready)?;
        }
        Ok(Steps {
            storages: parts.iter().map(|p| &p.storage).collect(),
            offsets: parts.iter().map(|p| p.offset).collect(),
            devs,
            dtype,
            staging,
            received: vec![None; parts.len()],
            link: link(),
        })
    }

    /// A copy within one rank's device, on its collective queue: `len`
    /// elements of `src` from `from` into `dst` at `to` (absolute offsets).
    fn local_copy(&self, rank: usize, src: &Arc<Storage>, from: usize, dst: &Arc<Storage>, to: usize, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let op = Move { from, to, len, combine: None };
        let kernel = Kernel::Custom { op: OpRef::Shared(Arc::new(op)), inputs: smallvec::smallvec![whole(src)] };
        self.devs[rank].comm_queue().submit(Job::Transfer(Box::new((kernel, dst.clone())), None))?;
        Ok(())
    }

    /// One step: every send at once, then every receive.
    fn step(&mut self, sends: &[Send], combine: Option<Combine>) -> Result<()> {
        let size = self.dtype.size_in_bytes();
        let mut in_flight = Vec::with_capacity(sends.len());
        for s in sends.iter().filter(|s| s.len > 0) {
            let Some(staging) = self.staging[s.src].clone() else {
                return Err(Error::invalid("collective", "a ring step on a link without staging (a kiln bug: please report it)"));
            };
            let q = self.devs[s.src].comm_queue();
            // The receiver has combined the previous step's staging buffer.
            if let Some(done) = &self.received[s.dst] {
                q.wait_event(done.clone())?;
            }
            let started = Arc::new(Stamp::default());
            let op = Move { from: self.offsets[s.src] + s.from, to: 0, len: s.len, combine: None };
            let kernel = Kernel::Custom { op: OpRef::Shared(Arc::new(op)), inputs: smallvec::smallvec![whole(self.storages[s.src])] };
            q.submit(Job::Transfer(Box::new((kernel, staging.clone())), Some(started.clone())))?;
            in_flight.push((*s, staging, q.record_event(), started));
        }
        for (s, staging, sent, started) in in_flight {
            let q = self.devs[s.dst].comm_queue();
            q.wait_event(sent)?;
            let op = Move { from: 0, to: self.offsets[s.dst] + s.to, len: s.len, combine };
            let kernel = Kernel::Custom { op: OpRef::Shared(Arc::new(op)), inputs: smallvec::smallvec![whole(&staging)] };
            q.submit(Job::Transfer(Box::new((kernel, self.storages[s.dst].clone())), None))?;
            // The rest of the modelled transfer time, from the send's start.
            let modelled = u64::try_from(self.link.transfer_time(s.len * size).as_nanos()).unwrap_or(u64::MAX);
            q.submit(Job::Arrive(started, modelled))?;
            self.received[s.dst] = Some(q.record_event());
        }
        Ok(())
    }
}

/// The ring's neighbour links: rank d sends to d + 1.
fn ring_links(n: usize) -> Vec<Option<usize>> {
    (0..n).map(|d| Some((d + 1) % n)).collect()
}

/// Reduce-scatter steps over chunks `chunks`: in step s rank d sends chunk
/// (d − s + shift) mod n, so after them rank d holds the combination of
/// chunk (d + 1 + shift) mod n.
fn reduce_scatter_steps(steps: &mut Steps<'_>, chunks: &[(usize, usize)], shift: usize, op: Combine) -> Result<()> {
    let n = chunks.len();
    for s in 0..n - 1 {
        let sends: Vec<Send> = (0..n)
            .map(|d| {
                let c = chunks[(d + n - s + shift) % n];
                Send { src: d, dst: (d + 1) % n, from: c.0, to: c.0, len: c.1 }
            })
            .collect();
        steps.step(&sends, Some(op))?;
    }
    Ok(())
}

/// All-gather steps: rank d starts owning chunk (d + 1 + shift) mod n; after
/// them every rank holds every chunk.
fn all_gather_steps(steps: &mut Steps<'_>, chunks: &[(usize, usize)], shift: usize) -> Result<()> {
    let n = chunks.len();
    for s in 0..n - 1 {
        let sends: Vec<Send> = (0..n)
            .map(|d| {
                let c = chunks[(d + 1 + shift + n - s) % n];
                Send { src: d, dst: (d + 1) % n, from: c.0, to: c.0, len: c.1 }
            })
            .collect();
        steps.step(&sends, None)?;
    }
    Ok(())
}

fn max_chunk(chunks: &[(usize, usize)]) -> usize {
    chunks.iter().map(|c| c.1).max().unwrap_or(0)
}

impl Communicator for SimRing {
    fn name(&self) -> String {
        let l = link();
        format!("simulated ring ({:.1} GB/s, {} us per transfer)", l.bandwidth / 1e9, l.latency.as_micros())
    }

    fn all_reduce(&self, parts: &[Part], op: Combine) -> Result<()> {
        let n = parts.len();
        let chunks = chunk_bounds(parts[0].len, n);
        let mut steps = Steps::open(parts, &ring_links(n), max_chunk(&chunks))?;
        reduce_scatter_steps(&mut steps, &chunks, 0, op)?;
        all_gather_steps(&mut steps, &chunks, 0)
    }

    fn broadcast(&self, parts: &[Part], root: usize) -> Result<()> {
        // A pipelined chain root → root + 1 → ...: n chunks, chunk c
        // crosses link j (the j-th hop) at step c + j.
        let n = parts.len();
        let chunks = chunk_bounds(parts[0].len, n);
        let rank = |j: usize| (root + j) % n;
        let mut links = vec![None; n];
        for j in 0..n - 1 {
            links[rank(j)] = Some(rank(j + 1));
        }
        let mut steps = Steps::open(parts, &links, max_chunk(&chunks))?;
        for g in 0..(2 * n - 2) {
            let sends: Vec<Send> = (0..n - 1)
                .filter(|&j| g >= j && g - j < n)
                .map(|j| {
                    let c = chunks[g - j];
                    Send { src: rank(j), dst: rank(j + 1), from: c.0, to: c.0, len: c.1 }
                })
                .collect();
            steps.step(&sends, None)?;
        }
        Ok(())
    }

    fn reduce(&self, parts: &[Part], _root: usize, op: Combine) -> Result<()> {
        // The other parts are scratch space: a ring all-reduce leaves the
        // result on every rank, the root's included.
        self.all_reduce(parts, op)
    }

    fn all_gather(&self, inputs: &[Part], outputs: &[Part]) -> Result<()> {
        let n = inputs.len();
        let l = inputs[0].len;
        let chunks: Vec<(usize, usize)> = (0..n).map(|i| (i * l, l)).collect();
        let mut steps = Steps::open(outputs, &ring_links(n), l)?;
        for (d, (i, o)) in inputs.iter().zip(outputs).enumerate() {
            steps.local_copy(d, &i.storage, i.offset, &o.storage, o.offset + d * l, l)?;
        }
        // Rank d owns chunk d: (d + 1 + shift) mod n with shift = n − 1.
        all_gather_steps(&mut steps, &chunks, n - 1)
    }

    fn join(&self, backends: &[&'static dyn Backend]) -> Result<()> {
        for b in backends {
            let d = b.as_any().downcast_ref::<SimBackend>().ok_or_else(|| Error::Backend {
                device: b.device(),
                msg: "the simulated ring was asked to join another backend's device (a kiln bug: please report it)".into(),
            })?;
            if let Some(comm) = d.comm.get() {
                d.compute_queue().wait_event(comm.record_event())?;
            }
        }
        Ok(())
    }

    fn reduce_scatter(&self, inputs: &[Part], outputs: &[Part], op: Combine) -> Result<()> {
        let n = inputs.len();
        let l = outputs[0].len;
        let chunks: Vec<(usize, usize)> = (0..n).map(|i| (i * l, l)).collect();
        let mut steps = Steps::open(inputs, &ring_links(n), l)?;
        // Rank d ends owning chunk d: shift n − 1.
        reduce_scatter_steps(&mut steps, &chunks, n - 1, op)?;
        for (d, (i, o)) in inputs.iter().zip(outputs).enumerate() {
            steps.local_copy(d, &i.storage, i.offset + d * l, &o.storage, o.offset, l)?;
        }
        Ok(())
    }
}
