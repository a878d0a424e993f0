//! A seeded random-program fuzzer: thousands of small programs over random
//! shapes (zero-size and absurdly large dimensions among them), every dtype
//! (i32 included, for data and for indices), the CPU, a simulated GPU and
//! devices that do not exist (creating on them, moving and copying to them,
//! synchronising and querying them). Each program
//! runs on the CPU and on the simulated GPU, and the test checks:
//! - no panic crosses the API (each program runs under `catch_unwind`);
//! - no hang (a watchdog ends the process, naming the program, when no step
//!   finishes for 60 s);
//! - every error is of a sensible kind (a user error or out-of-memory, never a
//!   failed kernel or a backend failure), and every use of a device that does
//!   not exist is `NoSuchDevice`;
//! - the CPU and the simulated GPU agree: the same errors, the same shapes,
//!   and bit-identical values;
//! - memory on both devices returns to its baseline once the program's
//!   tensors are dropped;
//! - operands of two dtypes promote alike on both devices, dimensions are
//!   drawn from −5 to 4 (negative ones and out-of-range ones on both
//!   sides), and a bad index or label raises at the call on the CPU and is
//!   reported by the GPU's next synchronising call, naming the op and the
//!   value.
//!
//! `KILN_FUZZ_CASES` sets the number of programs (default 2,000; the
//! robustness issue's run used 100,000), `KILN_FUZZ_SEED` the first seed.

#[path = "../common/mod.rs"]
mod common;
mod execute;
mod program;

use execute::*;
use program::*;

use kiln::{cpu, gpu, BinaryOp, DType, Device, Error, Reduction, Tensor, UnaryOp};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Puts the process under memory pressure: with its address space capped,
/// a program that asks the host for gigabytes (a reduction over an empty
/// dimension with a huge one beside it, say) meets a refused allocation,
/// which must be `OutOfMemory`, instead of slowly filling the machine.
fn limit_address_space(bytes: u64) {
    #[cfg(target_os = "linux")]
    {
        let limit = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: setrlimit reads the struct we pass; lowering the soft limit is always allowed.
        let r = unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
        assert_eq!(r, 0, "setrlimit failed");
    }
}

fn describe(seed: u64, steps: &[Step]) -> String {
    let mut s = format!("program of seed {seed}:\n");
    for (i, st) in steps.iter().enumerate() {
        let _ = writeln!(s, "  v{i} = {st:?}");
    }
    s
}

#[test]
fn random_programs_never_panic_hang_or_disagree() {
    let cases: u64 = std::env::var("KILN_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let first: u64 = std::env::var("KILN_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    limit_address_space(6 << 30);
    let sim = kiln::ensure_simulated_gpus(1, 256 << 20)[0];
    let devices = [cpu(), sim];

    // The watchdog: no step for 60 s is a hang.
    let heartbeat = Arc::new(AtomicU64::new(0));
    let current = Arc::new(std::sync::Mutex::new(String::new()));
    {
        let (heartbeat, current) = (heartbeat.clone(), current.clone());
        std::thread::spawn(move || {
            let mut last = (heartbeat.load(Ordering::Relaxed), Instant::now());
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let now = heartbeat.load(Ordering::Relaxed);
                if now != last.0 {
                    last = (now, Instant::now());
                } else if last.1.elapsed() > Duration::from_secs(60) {
                    // Straight to stderr: the harness's capture would swallow eprintln.
                    use std::io::Write as _;
                    let _ = writeln!(
                        std::io::stderr(),
                        "HANG: no step finished for 60 s in\n{}",
                        current.lock().unwrap_or_else(|e| e.into_inner())
                    );
                    std::process::exit(3);
                }
            }
        });
    }

    let baseline: Vec<(usize, usize)> =
        devices.iter().map(|d| kiln::memory_stats(d).map(|s| (s.in_use, s.live_tensors)).unwrap()).collect();
    let mut defects = Vec::new();
    let (mut steps_run, mut errors, mut missing_uses, mut i32_uses) = (0usize, 0usize, 0usize, 0usize);
    let (mut negative_dims, mut bad_indices) = (0usize, 0usize);
    for seed in first..first + cases {
        let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
        let steps = program(&mut rng);
        missing_uses += steps.iter().filter(|s| names_missing(s)).count();
        i32_uses += steps.iter().filter(|s| format!("{s:?}").contains("I32")).count();
        negative_dims += steps.iter().filter(|s| has_negative_dim(s)).count();
        bad_indices += steps.iter().filter(|s| matches!(s, Step::BadIndex { .. })).count();
        *current.lock().unwrap_or_else(|e| e.into_inner()) = describe(seed, &steps);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // The same random numbers on both devices.
            kiln::manual_seed(seed);
            let on_cpu = execute(&steps, &devices[0], sim, &heartbeat)?;
            kiln::manual_seed(seed);
            let on_gpu = execute(&steps, &devices[1], sim, &heartbeat)?;
            if on_cpu != on_gpu {
                let at = on_cpu.iter().zip(&on_gpu).position(|(a, b)| a != b).unwrap_or(0);
                // The devices' capacities differ (host RAM vs 256 MiB): one
                // may run out of memory where the other does not. The rest
                // of the program then diverges legitimately.
                let oom = Outcome::Error("OutOfMemory");
                if on_cpu[at] == oom || on_gpu[at] == oom {
                    return Ok(on_cpu[..at].to_vec());
                }
                return Err(format!("cpu and {} disagree at step {at}: {:?} vs {:?}", devices[1], on_cpu[at], on_gpu[at]));
            }
            Ok(on_cpu)
        }));
        match result {
            Ok(Ok(outcomes)) => {
                steps_run += outcomes.len();
                errors += outcomes.iter().filter(|o| matches!(o, Outcome::Error(_))).count();
            }
            Ok(Err(defect)) => defects.push(format!("{defect}\n{}", describe(seed, &steps))),
            Err(_) => defects.push(format!("PANIC\n{}", describe(seed, &steps))),
        }
        for (d, base) in devices.iter().zip(&baseline) {
            let s = kiln::memory_stats(d).unwrap();
            if (s.in_use, s.live_tensors) != *base {
                defects.push(format!(
                    "memory on {d} is {} B in {} tensors after the program, baseline {base:?}\n{}",
                    s.in_use,
                    s.live_tensors,
                    describe(seed, &steps)
                ));
            }
        }
        if defects.len() >= 10 {
            break;
        }
    }
    println!(
        "fuzz: {cases} programs, {steps_run} steps ({missing_uses} on devices that do not exist, {i32_uses} with i32, {negative_dims} with a negative dimension, {} between two dtypes, {bad_indices} with a bad index or label, {} of them reported by a GPU's next synchronising call), {errors} user errors, {} defects",
        MIXED.load(Ordering::Relaxed),
        REPORTED.load(Ordering::Relaxed),
        defects.len()
    );
    assert!(
        defects.is_empty(),
        "{} defects; the first ones:\n{}",
        defects.len(),
        defects.iter().take(5).cloned().collect::<Vec<_>>().join("\n")
    );
}
