//! The simulated GPUs' own controls: the link their collectives model
//! ([`SimLink`], [`link`], [`set_link`]) and the device clocks that time
//! their work as GPUs of their own would run it ([`elapsed`]). Simulated
//! GPUs let multi-GPU code run on any machine
//! ([`crate::ensure_simulated_gpus`], `KILN_SIM_GPUS`); what they compute is
//! exact, and these say how long it would take.

use crate::backends::sim::ring;
pub use crate::backends::sim::ring::{SimLink, DEFAULT_LINK_BANDWIDTH, DEFAULT_LINK_LATENCY};
use crate::base::error::{Error, Result};
use crate::Device;

/// The modelled link between neighbouring simulated GPUs that their
/// collectives run over now (`KILN_SIM_LINK_BANDWIDTH`,
/// `KILN_SIM_LINK_LATENCY`, or [`set_link`]).
///
/// ```
/// let link = kiln::sim::link();
/// assert!(link.bandwidth > 0.0);
/// ```
pub fn link() -> SimLink {
    ring::link()
}

/// Sets the link simulated GPUs' collectives model from now on, for every
/// thread: a ring all-reduce of S bytes over n simulated GPUs then takes
/// about 2(n − 1)·(latency + S / (n·bandwidth)).
///
/// ```
/// use kiln::sim::{self, SimLink};
/// use std::time::Duration;
/// let before = sim::link();
/// sim::set_link(SimLink { bandwidth: 1e9, latency: Duration::from_micros(5) })?;
/// assert_eq!(sim::link().bandwidth, 1e9);
/// assert!(sim::set_link(SimLink { bandwidth: 0.0, latency: Duration::ZERO }).is_err());
/// sim::set_link(before)?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn set_link(link: SimLink) -> Result<()> {
    ring::set_link(link)
}

/// Runs `work` and returns, with its result, how long the work it queued
/// on the simulated GPUs `devices` took on their own clocks: what GPUs of
/// their own would take, free of this host's cores and memory.
///
/// A simulated GPU computes on the host, so its wall time is the host's:
/// on a machine with fewer cores than simulated GPUs, or when the host
/// copies a collective's chunks slower than the modelled link would carry
/// them, the wall time is the host's limit, not the GPUs'. Each simulated
/// GPU therefore also keeps a device clock: a kernel advances it by the
/// time it ran for (for a kernel that reads and writes 256K elements or
/// more, its CPU time: one core's time, leaving out any wait for a core
/// that other simulated GPUs held); a transfer between devices by the link's
/// modelled time ([`SimLink::transfer_time`]) alone; a wait for another
/// device by moving it to when that device got there. The host's own
/// delays (a late launch, a descheduled thread) do not count. So an
/// all-reduce of S bytes over n devices takes exactly the ring's
/// 2(n − 1)·(latency + ⌈S/n⌉ / bandwidth) on these clocks, and a
/// training step its compute plus the communication it does not hide.
///
/// The clocks of all `devices` start together when `work` starts; the
/// interval ends when the last of them has finished the work queued on it
/// by then (this call waits for it, and reports a failed kernel as
/// [`crate::synchronize`] does). List every device the work uses: a wait
/// for a device outside the list reads a clock that did not start with
/// them. Errors when `devices` is empty, names a device twice, or names
/// one that is not a simulated GPU (time CUDA work with
/// [`crate::synchronize`] and [`std::time::Instant`]).
///
/// ```
/// use kiln::comm::{self, ReduceOp};
/// use kiln::sim::{self, SimLink};
/// use kiln::{DType, Tensor};
/// use std::time::Duration;
///
/// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
/// let before = sim::link();
/// let link = SimLink { bandwidth: 12e9, latency: Duration::from_micros(10) };
/// sim::set_link(link)?;
/// let grads = [Tensor::ones(1 << 20, DType::F32, &gpus[0])?, Tensor::ones(1 << 20, DType::F32, &gpus[1])?];
/// let ((), took) = sim::elapsed(&gpus, || comm::all_reduce_(&grads, ReduceOp::Sum))?;
/// // A ring over 2 devices: 2 steps of one 2 MiB half each.
/// let ring = 2 * link.transfer_time(2 << 20);
/// assert!(took >= ring && took < ring + Duration::from_micros(20), "{took:?} against {ring:?}");
/// sim::set_link(before)?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn elapsed<R>(devices: &[Device], work: impl FnOnce() -> Result<R>) -> Result<(R, std::time::Duration)> {
    const OP: &str = "sim::elapsed";
    if devices.is_empty() {
        return Err(Error::invalid(OP, "needs at least one device"));
    }
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(Error::invalid(OP, format!("{d} is listed twice in the devices")));
        }
    }
    let mut sims = Vec::with_capacity(devices.len());
    for d in devices {
        let backend = crate::registry::backend(*d)?;
        let Some(sim) = backend.as_any().downcast_ref::<crate::backends::sim::SimBackend>() else {
            return Err(Error::invalid(
                OP,
                format!(
                    "{d} is a {} device, and only simulated GPUs keep a modelled clock; time other devices' work on the wall clock: \
                     `let t = std::time::Instant::now(); work()?; kiln::synchronize(&device)?; let took = t.elapsed();`",
                    backend.kind()
                ),
            ));
        };
        sims.push(sim);
    }
    for d in devices {
        crate::synchronize(d)?;
    }
    let start = crate::backends::sim::now_ns();
    for sim in &sims {
        sim.mark_clocks(Some(start))?;
    }
    let result = work();
    let ends: Result<Vec<_>> = sims.iter().map(|sim| sim.mark_clocks(None)).collect();
    // Wait for every device even after a failure, then report the first.
    let mut synced: Result<()> = Ok(());
    for d in devices {
        let next = crate::synchronize(d);
        if synced.is_ok() {
            synced = next;
        }
    }
    let (result, ends) = (result?, ends?);
    synced?;
    let end = ends.iter().flatten().map(|slot| slot.load(std::sync::atomic::Ordering::Acquire)).max().unwrap_or(start);
    Ok((result, std::time::Duration::from_nanos(end.saturating_sub(start))))
}
