//! The simulated GPUs' device clocks (`kiln::sim::elapsed`):
//! every collective of the ring takes, on them, exactly the time its
//! schedule of modelled transfers gives (the textbook ring cost), on any
//! link, size, dtype and group, however slow this host's own copies are;
//! a kernel takes its host time; a device clock never runs ahead of the
//! wall clock; and the errors.
//!
//! The tests share one process-wide link (`set_simulated_link`), so they
//! run one at a time under `SERIAL`.

#[path = "common/mod.rs"]
mod common;

use kiln::comm::{self, ReduceOp};
use kiln::sim::{self, SimLink};
use kiln::{DType, Device, Error, Result, Tensor};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// Four simulated GPUs of this binary's own, 256 MiB each.
fn sims() -> &'static [Device] {
    common::own_sims(4, 256 << 20)
}

/// The links the tests model: the default (12 GB/s, 10 µs, faster than
/// this host copies), one with no latency, and a slow one with a long
/// latency.
fn links() -> [SimLink; 3] {
    [
        SimLink { bandwidth: kiln::sim::DEFAULT_LINK_BANDWIDTH, latency: kiln::sim::DEFAULT_LINK_LATENCY },
        SimLink { bandwidth: 40e9, latency: Duration::ZERO },
        SimLink { bandwidth: 0.5e9, latency: Duration::from_micros(250) },
    ]
}

/// Runs `f` with `link` set, and the link before restored.
fn with_link<R>(link: SimLink, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let before = sim::link();
    sim::set_link(link)?;
    let result = f();
    sim::set_link(before)?;
    result
}

/// The ring's modelled time for `steps` steps whose chunks are `lo` to
/// `hi` bytes: each step is one transfer, as the ring's schedule has it.
/// Within a step the ranks' chunks differ by at most one element, so the
/// whole lies between all steps of the smallest and all of the largest.
fn bounds(link: SimLink, steps: usize, lo: usize, hi: usize) -> (Duration, Duration) {
    let t = |b: usize| Duration::from_nanos(link.transfer_time(b).as_nanos() as u64);
    (t(lo) * steps as u32, t(hi) * steps as u32)
}

fn assert_within(what: &str, took: Duration, (lo, hi): (Duration, Duration)) {
    // 1 µs per bound for the nanosecond rounding of each step.
    let slack = Duration::from_micros(1);
    assert!(took + slack >= lo && took <= hi + slack, "{what}: {took:?} on the device clocks, the ring's schedule gives {lo:?}..={hi:?}");
}

fn ones(len: usize, dtype: DType, devices: &[Device]) -> Result<Vec<Tensor>> {
    devices.iter().map(|d| Tensor::ones(len, dtype, d)).collect()
}

#[test]
fn every_collective_takes_its_rings_modelled_time_on_the_device_clocks() -> Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for link in links() {
        with_link(link, || {
            for n in [2, 3, 4] {
                let group = &sims()[..n];
                // Sizes that divide evenly, that do not, one smaller than the
                // group, and a large one (4 MiB of f32 a device).
                for (len, dtype) in
                    [(n * 1000, DType::F32), (1_000_003, DType::F32), (n - 1, DType::F64), (1 << 20, DType::F32), (77_777, DType::F16)]
                {
                    let size = dtype.size_in_bytes();
                    let what = |op: &str| format!("{op} of {len} {dtype} on {n} simulated GPUs over {link:?}");
                    let (lo, hi) = (len / n * size, len.div_ceil(n) * size);

                    let parts = ones(len, dtype, group)?;
                    let ((), took) = sim::elapsed(group, || comm::all_reduce_(&parts, ReduceOp::Sum))?;
                    // Reduce-scatter, then all-gather: n − 1 steps each.
                    // With fewer elements than devices some chunks are
                    // empty and some sends in a step are skipped, so the
                    // steps may overlap: then it is one transfer at least.
                    let ring = if len < n {
                        (bounds(link, 1, size, size).0, bounds(link, 2 * (n - 1), size, size).1)
                    } else {
                        bounds(link, 2 * (n - 1), lo, hi)
                    };
                    assert_within(&what("all_reduce"), took, ring);
                    assert_eq!(parts[n - 1].to_vec_f64()?, vec![n as f64; len], "{}", what("all_reduce"));

                    let ((), took) = sim::elapsed(group, || comm::broadcast_(&parts, 1))?;
                    // A pipelined chain of n − 1 hops carrying n chunks (as
                    // many as are not empty).
                    let chain = if len < n { bounds(link, len + n - 2, size, size) } else { bounds(link, 2 * n - 2, lo, hi) };
                    assert_within(&what("broadcast"), took, chain);

                    let (gathered, took) = sim::elapsed(group, || comm::all_gather(&parts))?;
                    // n − 1 steps, each of one whole input.
                    assert_within(&what("all_gather"), took, bounds(link, n - 1, len * size, len * size));
                    assert_eq!(gathered[0].elem_count(), n * len);

                    if len % n == 0 {
                        // The ring works on a copy of the inputs, made by a
                        // kernel on each device: that kernel's host time
                        // adds to the ring's, and is at most the call's
                        // wall time.
                        let wall = Instant::now();
                        let (scattered, took) = sim::elapsed(group, || comm::reduce_scatter(&parts, ReduceOp::Sum))?;
                        let ring = bounds(link, n - 1, lo, lo);
                        assert_within(&what("reduce_scatter"), took, (ring.0, ring.1 + wall.elapsed()));
                        assert_eq!(scattered[1].to_vec_f64()?, vec![(n * n) as f64; len / n]);
                    }
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn the_ring_is_what_takes_the_time_not_a_gather_on_one_device() -> Result<()> {
    // A naive all-reduce (everything to the first device and back) moves
    // 2(n − 1)·S over one link; the ring's 2(n − 1)·S/n over each. On four
    // devices the clocks must show the ring's quarter.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let link = SimLink { bandwidth: 1e9, latency: Duration::ZERO };
    with_link(link, || {
        let group = sims();
        let bytes = 4 << 20;
        let parts = ones(bytes / 4, DType::F32, group)?;
        let ((), took) = sim::elapsed(group, || comm::all_reduce_(&parts, ReduceOp::Sum))?;
        let ring = link.transfer_time(bytes / 4) * 6;
        let naive = link.transfer_time(bytes) * 6;
        assert!(took.abs_diff(ring) < Duration::from_micros(10), "{took:?}, the ring's cost {ring:?}, a gather's {naive:?}");
        Ok(())
    })
}

#[test]
fn kernels_take_their_host_time_and_no_clock_runs_ahead_of_the_wall() -> Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let group = &sims()[..2];
    // Compute on the first device only: the interval is that device's
    // kernels, which ran on the host, so it is above zero and at most the
    // wall time around the call.
    let a = Tensor::ones((256, 256), DType::F32, &group[0])?;
    let wall = Instant::now();
    let (c, took) = sim::elapsed(group, || {
        let mut c = a.clone();
        for _ in 0..8 {
            c = c.matmul(&a)?.mul_scalar(1.0 / 256.0)?;
        }
        Ok(c)
    })?;
    let wall = wall.elapsed();
    assert!(took > Duration::ZERO && took <= wall, "device {took:?}, wall {wall:?}");
    assert_eq!(c.to_vec_f64()?[0], 1.0);

    // Nothing queued: nothing elapses on the devices, however long the
    // host takes.
    let ((), idle) = sim::elapsed(group, || {
        std::thread::sleep(Duration::from_millis(20));
        Ok(())
    })?;
    assert_eq!(idle, Duration::ZERO);

    // A slow link: the modelled transfers are also waited out on the
    // wall clock, so the wall time is at least the devices' time.
    with_link(SimLink { bandwidth: 0.1e9, latency: Duration::from_micros(100) }, || {
        let parts = ones(1 << 18, DType::F32, group)?;
        let wall = Instant::now();
        let ((), took) = sim::elapsed(group, || comm::all_reduce_(&parts, ReduceOp::Sum))?;
        let wall = wall.elapsed();
        let ring = sim::link().transfer_time(1 << 19) * 2;
        assert!(took.abs_diff(ring) < Duration::from_micros(2) && wall >= took, "device {took:?}, ring {ring:?}, wall {wall:?}");
        Ok(())
    })
}

#[test]
fn a_failed_kernel_is_reported_and_the_clocks_go_on() -> Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let group = &sims()[..2];
    // An index out of range fails on the device, asynchronously: the call
    // reports it when it waits for the devices, as synchronize does.
    let table = Tensor::ones((4, 3), DType::F32, &group[1])?;
    let bad = Tensor::new(&[0i64, 9], &group[1])?;
    let err = sim::elapsed(group, || table.index_select(&bad, 0)).unwrap_err();
    assert!(matches!(err, Error::KernelFailed { device, .. } if device == group[1]), "{err}");
    // The failure was reported once; the next interval is clean.
    let parts = ones(1000, DType::F32, group)?;
    let ((), took) = sim::elapsed(group, || comm::all_reduce_(&parts, ReduceOp::Sum))?;
    assert!(took > Duration::ZERO);
    Ok(())
}

#[test]
fn devices_without_a_modelled_clock_are_typed_errors() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = sims();
    let ran = std::cell::Cell::new(false);
    for (devices, says) in [
        (vec![], "at least one device"),
        (vec![s[0], s[0]], "twice"),
        (vec![s[0], kiln::cpu()], "only simulated GPUs keep a modelled clock"),
        (vec![Device::Gpu(97)], "97"),
    ] {
        let err = sim::elapsed(&devices, || {
            ran.set(true);
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains(says), "{devices:?}: {err}");
    }
    assert!(!ran.get(), "the work ran although the devices were refused");
}
