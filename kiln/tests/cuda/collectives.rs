//! Collectives across CUDA devices (`kiln::comm`): which path runs (NCCL,
//! or peer copies and kernels with the reason), bit-identical results, the
//! transfer guard, asynchrony, and NCCL failures that queue nothing. The
//! values of every collective for every dtype are checked by
//! `tests/comm.rs`, which includes the CUDA devices in its groups.
//!
//! On the CUDA simulator (`scripts/cudasim.sh`) NCCL is the simulator's
//! stand-in unless `KILN_DISABLE_NCCL=1` (CI runs this suite both ways) or
//! `KILN_CUDASIM_NO_NCCL=1`; its `nccl_collectives` count shows whether a
//! collective went through NCCL.

use super::*;
use kiln::comm::{self, ReduceOp};

/// Two CUDA devices, or why the test cannot run.
fn two_cuda() -> std::result::Result<(Device, Device), Skip> {
    let devs = cuda_devices();
    if devs.len() < 2 {
        return Err(common::skip_too_few_cuda(2, format!("needs two CUDA devices, has {}", devs.len())));
    }
    Ok((devs[0], devs[1]))
}

fn collectives_detail(d: Device) -> String {
    let info = kiln::devices().into_iter().find(|i| i.device == d).expect("listed");
    info.details.into_iter().find(|(k, _)| k == "collectives").map(|(_, v)| v).unwrap_or_default()
}

/// What the environment says the CUDA devices' collectives should be:
/// `Some(reason)` for the fallback, `None` for NCCL (on the simulator).
fn expected_fallback() -> Option<&'static str> {
    if common::required("KILN_DISABLE_NCCL") {
        Some("NCCL disabled by KILN_DISABLE_NCCL=1")
    } else if common::required("KILN_CUDASIM_NO_NCCL") {
        Some("libnccl.so.2 not found")
    } else {
        None
    }
}

/// Whether NCCL runs the CUDA devices' collectives here.
fn nccl_in_use(d: Device) -> bool {
    collectives_detail(d).starts_with("NCCL ")
}

/// Collectives the simulated NCCL completed (0 on a real GPU, where the
/// count does not exist).
fn nccl_done() -> i64 {
    sim_stat("nccl_collectives").unwrap_or(0)
}

fn ramp(n: usize, salt: f32, device: Device) -> Result<Tensor> {
    Tensor::from_vec((0..n).map(|i| ((i * 7) % 13) as f32 - 6.0 + salt).collect::<Vec<_>>(), n, &device)
}

/// `kiln devices` names how each CUDA device runs collectives; on the
/// simulator, a sum goes through NCCL (its count grows by one per
/// collective) and a float max takes the peer-copy path (NCCL's fmax lets a
/// NaN lose), unless NCCL is disabled or missing, when nothing goes through
/// it and the reason is shown.
pub(crate) fn cuda_collectives_name_their_path_and_take_it() -> Ran {
    let _alone = DEVICES.write().unwrap_or_else(|e| e.into_inner());
    let (a, b) = two_cuda()?;
    let (da, db) = (collectives_detail(a), collectives_detail(b));
    println!("{a}: collectives: {da}\n{b}: collectives: {db}");
    assert_eq!(da, db, "every CUDA device runs collectives the same way");
    let simulated = sim_stat("events").is_some();
    match expected_fallback() {
        Some(reason) => {
            assert!(da.starts_with("peer copies and kernels (") && da.contains(reason), "{da}");
        }
        None if simulated => assert!(da.starts_with("NCCL 2.21.5"), "the simulator's NCCL is on the library path: {da}"),
        // A real machine: NCCL, or the fallback with its reason.
        None => assert!(da.starts_with("NCCL ") || da.starts_with("peer copies and kernels ("), "{da}"),
    }
    let nccl = nccl_in_use(a);
    let run = || -> Result<()> {
        let parts = [ramp(1000, 0.0, a)?, ramp(1000, 1.0, b)?];
        let before = nccl_done();
        comm::all_reduce_(&parts, ReduceOp::Sum)?;
        let expected: Vec<f32> = (0..1000).map(|i| 2.0 * (((i * 7) % 13) as f32 - 6.0) + 1.0).collect();
        assert_eq!(parts[1].to_vec::<f32>()?, expected);
        assert_eq!(parts[0].to_vec::<f32>()?, expected);
        if simulated {
            assert_eq!(nccl_done() - before, i64::from(nccl), "NCCL ran the sum: {nccl}");
        }
        // A float max with a NaN: kiln's answer, not NCCL's.
        let with_nan = [Tensor::new(&[f32::NAN, 1.0], &a)?, Tensor::new(&[2.0f32, 3.0], &b)?];
        let before = nccl_done();
        let max = comm::all_reduce(&with_nan, ReduceOp::Max)?;
        for t in &max {
            let v = t.to_vec::<f32>()?;
            assert!(v[0].is_nan() && v[1] == 3.0, "{v:?} on {}", t.device());
        }
        let ints = [Tensor::new(&[5i32, -1], &a)?, Tensor::new(&[2i32, 7], &b)?];
        assert_eq!(comm::all_reduce(&ints, ReduceOp::Max)?[0].to_vec::<i32>()?, vec![5, 7]);
        if simulated {
            assert_eq!(nccl_done() - before, i64::from(nccl), "only the integer max went through NCCL");
        }
        Ok(())
    };
    ran_on_two("collectives", a, b, run())
}

/// Every collective leaves the same bits on every device, in either order of
/// the devices (the other order is a communicator of its own), for floats
/// that round differently in every order of summation.
pub(crate) fn cuda_collective_results_are_bit_identical_on_every_device() -> Ran {
    // Shared: the tests that count the simulator's collectives run alone.
    let _shared = DEVICES.read().unwrap_or_else(|e| e.into_inner());
    let (a, b) = two_cuda()?;
    let bits = |t: &Tensor| -> Result<Vec<u64>> { Ok(t.to_dtype(DType::F64)?.to_vec::<f64>()?.iter().map(|v| v.to_bits()).collect()) };
    let run = || -> Result<()> {
        kiln::manual_seed(20);
        for group in [[a, b], [b, a]] {
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let parts: Vec<Tensor> =
                    group.iter().map(|d| Tensor::randn(4099, d)?.mul_scalar(100.0)?.to_dtype(dtype)).collect::<Result<_>>()?;
                let host: Vec<Vec<f64>> = parts.iter().map(|t| t.to_vec_f64()).collect::<Result<_>>()?;
                for op in [ReduceOp::Sum, ReduceOp::Mean] {
                    let out = comm::all_reduce(&parts, op)?;
                    assert_eq!(bits(&out[0])?, bits(&out[1])?, "all_reduce {op:?} {dtype} on {group:?}: the devices disagree");
                    let tol = match dtype {
                        DType::F16 | DType::BF16 => 0.02,
                        _ => 1e-5,
                    };
                    let scale = if op == ReduceOp::Mean { 0.5 } else { 1.0 };
                    for (i, v) in out[0].to_vec_f64()?.iter().enumerate() {
                        let want = (host[0][i] + host[1][i]) * scale;
                        assert!((v - want).abs() <= tol * (1.0 + want.abs()), "all_reduce {op:?} {dtype} element {i}: {v} vs {want}");
                    }
                }
                let gathered = comm::all_gather(&parts)?;
                assert_eq!(bits(&gathered[0])?, bits(&gathered[1])?, "all_gather {dtype} on {group:?}");
                let blocks = comm::reduce_scatter(&parts.iter().map(|p| p.narrow(0, 0, 4098)).collect::<Result<Vec<_>>>()?, ReduceOp::Sum)?;
                let whole = comm::all_reduce(&parts.iter().map(|p| p.narrow(0, 0, 4098)).collect::<Result<Vec<_>>>()?, ReduceOp::Sum)?;
                assert_eq!(bits(&blocks[1])?, bits(&whole[0].narrow(0, 2049, 2049)?)?, "reduce_scatter {dtype} on {group:?}");
                comm::broadcast_(&parts, 1)?;
                assert_eq!(bits(&parts[0])?, bits(&parts[1])?, "broadcast_ {dtype} on {group:?}");
            }
        }
        Ok(())
    };
    ran_on_two("collectives", a, b, run())
}

/// A transfer guard that disallows device-to-device traffic refuses a
/// collective before anything is queued: no collective runs, the values and
/// the ledger are unchanged.
pub(crate) fn cuda_a_transfer_guard_refuses_a_collective_before_anything_is_queued() -> Ran {
    let _alone = DEVICES.write().unwrap_or_else(|e| e.into_inner());
    let (a, b) = two_cuda()?;
    let run = || -> Result<()> {
        let parts = [ramp(4096, 0.0, a)?, ramp(4096, 10.0, b)?];
        let host: Vec<Vec<f32>> = parts.iter().map(|t| t.to_vec::<f32>()).collect::<Result<_>>()?;
        kiln::synchronize(&a)?;
        kiln::synchronize(&b)?;
        let before = (nccl_done(), kiln::thread_transfer_stats());
        {
            let _guard = kiln::transfer_guard_for(kiln::Direction::DeviceToDevice, kiln::GuardLevel::Disallow);
            for e in [
                comm::all_reduce_(&parts, ReduceOp::Sum).unwrap_err(),
                comm::all_reduce(&parts, ReduceOp::Sum).unwrap_err(),
                comm::broadcast_(&parts, 0).unwrap_err(),
                comm::all_gather(&parts).unwrap_err(),
                comm::reduce_scatter(&parts, ReduceOp::Sum).unwrap_err(),
            ] {
                assert!(matches!(e, Error::TransferDisallowed { .. }), "{e}");
            }
        }
        kiln::synchronize(&a)?;
        kiln::synchronize(&b)?;
        assert_eq!(nccl_done(), before.0, "a refused collective ran");
        assert_eq!(kiln::thread_transfer_stats().since(&before.1).total().count, 0, "a refused collective was booked");
        assert_eq!(parts[0].to_vec::<f32>()?, host[0]);
        assert_eq!(parts[1].to_vec::<f32>()?, host[1]);
        Ok(())
    };
    ran_on_two("guarded collectives", a, b, run())
}

/// A collective returns while the queue it waits for is held, has not run
/// then (on the simulator its count says so), and the next read waits for it.
pub(crate) fn cuda_collectives_return_before_they_run() -> Ran {
    let _alone = DEVICES.write().unwrap_or_else(|e| e.into_inner());
    let (a, b) = two_cuda()?;
    let run = || -> Result<()> {
        let parts = [ramp(100_000, 0.0, a)?, ramp(100_000, 3.0, b)?];
        let expected: Vec<f32> = (0..100_000).map(|i| 2.0 * (((i * 7) % 13) as f32 - 6.0) + 3.0).collect();
        // One all-reduce first loads the kernels of the peer-copy path
        // (loading waits for an idle device).
        comm::all_reduce(&parts, ReduceOp::Sum)?;
        kiln::synchronize(&a)?;
        kiln::synchronize(&b)?;
        let before = nccl_done();
        let hold = kiln::hold_queue(&a)?.expect("a CUDA device has a queue to hold");
        let queued = parts.clone();
        let returned = within(20, "an all-reduce behind a held queue", move || comm::all_reduce_(&queued, ReduceOp::Sum));
        std::thread::sleep(std::time::Duration::from_millis(50));
        let ran_while_held = nccl_done() != before;
        drop(hold);
        returned.expect("the all-reduce waited for the held queue instead of returning")?;
        assert!(!ran_while_held, "the collective ran although its first device's queue was held");
        assert_eq!(parts[0].to_vec::<f32>()?, expected);
        assert_eq!(parts[1].to_vec::<f32>()?, expected);
        Ok(())
    };
    ran_on_two("asynchronous collectives", a, b, run())
}

/// Whether the CUDA simulator's NCCL folder is on the library path, so a
/// child process can have NCCL (or, without the folder, not).
fn simulated_nccl_path() -> Option<String> {
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    path.split(':').any(|p| p.ends_with("cudasim-nccl")).then_some(path)
}

const NO_SIM_NCCL: &str = "needs the CUDA simulator's NCCL folder on LD_LIBRARY_PATH (scripts/cudasim.sh without KILN_CUDASIM_NO_NCCL=1)";

/// NCCL failures (the simulator's fault injection, in a child process with
/// NCCL enabled whatever this process has): a communicator that cannot be
/// made, and a call NCCL refuses for the second rank inside the group, are
/// errors naming the collective and NCCL's call; neither queues anything
/// (the tensors keep their values, no collective ran), and the next
/// collective works.
pub(crate) fn cuda_nccl_failures_are_errors_that_queue_nothing() -> Ran {
    if !common::is_child() && simulated_nccl_path().is_none() {
        return Err(common::skip(NO_SIM_NCCL));
    }
    let env = [("KILN_CUDASIM_FAIL", "ncclCommInitAll:1,ncclAllReduce:1@1"), ("KILN_CUDASIM_QUIET", "1"), ("KILN_DISABLE_NCCL", "0")];
    in_simulator_child(&env, |_| {
        let devs = cuda_devices();
        let (a, b) = (devs[0], devs[1]);
        assert!(nccl_in_use(a), "{}", collectives_detail(a));
        let parts = [ramp(64, 0.0, a)?, ramp(64, 1.0, b)?];
        let host: Vec<Vec<f32>> = parts.iter().map(|t| t.to_vec::<f32>()).collect::<Result<_>>()?;
        for call in ["ncclCommInitAll", "ncclAllReduce"] {
            let e = comm::all_reduce_(&parts, ReduceOp::Sum).expect_err(call);
            let msg = e.to_string();
            assert!(matches!(e, Error::Backend { .. }) && msg.contains("all_reduce through NCCL") && msg.contains(call), "{msg}");
            assert!(msg.contains("KILN_DISABLE_NCCL=1"), "the way out is named: {msg}");
            assert_eq!(nccl_done(), 0, "after the failed {call}");
            assert_eq!(parts[0].to_vec::<f32>()?, host[0], "after the failed {call}");
            assert_eq!(parts[1].to_vec::<f32>()?, host[1], "after the failed {call}");
        }
        comm::all_reduce_(&parts, ReduceOp::Sum)?;
        let sum: Vec<f32> = host[0].iter().zip(&host[1]).map(|(x, y)| x + y).collect();
        assert_eq!((parts[0].to_vec::<f32>()?, parts[1].to_vec::<f32>()?), (sum.clone(), sum));
        assert_eq!(nccl_done(), 1);
        Ok(())
    })
}

/// Without libnccl on the library path (a child process whose path lacks
/// the simulator's NCCL folder) the devices say why and what to install,
/// and collectives still run, through peer copies.
pub(crate) fn cuda_without_libnccl_collectives_say_why_and_still_run() -> Ran {
    let without = match simulated_nccl_path() {
        Some(path) => path.split(':').filter(|p| !p.ends_with("cudasim-nccl")).collect::<Vec<_>>().join(":"),
        None if common::is_child() => String::new(),
        None => return Err(common::skip(NO_SIM_NCCL)),
    };
    in_simulator_child(&[("LD_LIBRARY_PATH", &without), ("KILN_DISABLE_NCCL", "0")], |_| {
        let devs = cuda_devices();
        let why = collectives_detail(devs[0]);
        assert!(why.starts_with("peer copies and kernels (libnccl.so.2 not found") && why.contains("nvidia-nccl-cu12"), "{why}");
        let parts = [ramp(10, 0.0, devs[0])?, ramp(10, 1.0, devs[1])?];
        comm::all_reduce_(&parts, ReduceOp::Sum)?;
        assert_eq!(parts[0].to_vec::<f32>()?, parts[1].to_vec::<f32>()?);
        assert_eq!(nccl_done(), 0);
        Ok(())
    })
}

/// Fails the test with `result`'s error, naming what ran on which pair, or
/// books both devices as ran.
fn ran_on_two(what: &str, a: Device, b: Device, result: Result<()>) -> Ran {
    if let Err(e) = result {
        panic!("{what} on {a} and {b}: {e}");
    }
    common::report_ran(a);
    common::report_ran(b);
    Ok(())
}
