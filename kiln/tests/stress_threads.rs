//! Eight threads sharing tensors: ops, transfers between the CPU and two
//! simulated GPUs, and `assign`s in opposite orders, for `KILN_STRESS_SECS`
//! seconds (default 5; the robustness issue's acceptance run used 60). The
//! test checks that nothing deadlocks (a watchdog), that every value is
//! exact, that memory returns to its baseline, and that the process's peak
//! memory stays bounded (the launch queues are bounded).

use kiln::{cpu, memory_stats, synchronize, DType, Device, Tensor};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[test]
fn eight_threads_mixing_ops_transfers_and_opposite_assigns() {
    let secs: u64 = std::env::var("KILN_STRESS_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let sims = kiln::ensure_simulated_gpus(2, 256 << 20);
    let devices: Vec<Device> = vec![cpu(), sims[0], sims[1]];
    let baseline: Vec<usize> = devices.iter().map(|d| memory_stats(d).unwrap().in_use).collect();

    // Shared pairs that threads assign into each other, in both orders. All
    // hold 1.0 or 2.0 in every element, always.
    let pairs: Vec<(Tensor, Tensor)> = devices
        .iter()
        .map(|d| (Tensor::full(1.0, 4096, DType::F32, d).unwrap(), Tensor::full(2.0, 4096, DType::F32, d).unwrap()))
        .collect();
    let pairs = Arc::new(pairs);
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicU64::new(0));

    let watchdog = {
        let (stop, progress) = (stop.clone(), progress.clone());
        std::thread::spawn(move || {
            let mut last = (progress.load(Ordering::Relaxed), Instant::now());
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let now = progress.load(Ordering::Relaxed);
                if now != last.0 {
                    last = (now, Instant::now());
                } else if last.1.elapsed() > Duration::from_secs(30) {
                    use std::io::Write as _;
                    let _ = writeln!(std::io::stderr(), "DEADLOCK: no thread made progress for 30 s");
                    std::process::exit(3);
                }
            }
        })
    };

    let deadline = Instant::now() + Duration::from_secs(secs);
    let workers: Vec<_> = (0..8)
        .map(|t| {
            let (pairs, devices, progress) = (pairs.clone(), devices.clone(), progress.clone());
            std::thread::spawn(move || -> Result<u64, String> {
                let mut rounds = 0u64;
                let mut i: usize = t;
                while Instant::now() < deadline {
                    i = i.wrapping_mul(31).wrapping_add(7);
                    let d = devices[i % devices.len()];
                    let (a, b) = &pairs[i % pairs.len()];
                    // Opposite orders on alternate threads.
                    if t % 2 == 0 {
                        a.assign(b).map_err(|e| e.to_string())?;
                    } else {
                        b.assign(a).map_err(|e| e.to_string())?;
                    }
                    // Exact arithmetic on private tensors.
                    let n = 1 + (i % 300);
                    let x = Tensor::arange(0.0, n as f64, 1.0, &d).map_err(|e| e.to_string())?;
                    let y = x.mul_scalar(2.0).and_then(|y| y.add(&x)).map_err(|e| e.to_string())?;
                    let s = y.sum_all().and_then(|s| s.to_scalar::<f32>()).map_err(|e| e.to_string())?;
                    let want = 3.0 * (n * (n - 1) / 2) as f32;
                    if s != want {
                        return Err(format!("thread {t} on {d}: sum {s}, want {want}"));
                    }
                    // A transfer of a shared tensor to another device and back.
                    let other = devices[(i / 3) % devices.len()];
                    let moved = a.to(&other).and_then(|m| m.to(&d)).map_err(|e| e.to_string())?;
                    let v = moved.to_vec::<f32>().map_err(|e| e.to_string())?;
                    if !(v.iter().all(|&x| x == 1.0) || v.iter().all(|&x| x == 2.0)) {
                        // A concurrent assign may interleave with the copy, but
                        // each element is still one of the two values.
                        if !v.iter().all(|&x| x == 1.0 || x == 2.0) {
                            return Err(format!("thread {t}: a shared tensor held {:?}", &v[..4]));
                        }
                    }
                    rounds += 1;
                    progress.fetch_add(1, Ordering::Relaxed);
                }
                Ok(rounds)
            })
        })
        .collect();
    let mut total = 0;
    for w in workers {
        total += w.join().expect("a worker panicked").unwrap_or_else(|e| panic!("{e}"));
    }
    stop.store(true, Ordering::Relaxed);
    watchdog.join().unwrap();
    for d in &devices {
        synchronize(d).unwrap();
    }
    for (a, b) in pairs.iter() {
        for t in [a, b] {
            let v = t.to_vec::<f32>().unwrap();
            assert!(v.iter().all(|&x| x == 1.0 || x == 2.0), "a shared tensor holds {:?}", &v[..4]);
        }
    }
    drop(pairs);
    for (d, base) in devices.iter().zip(&baseline) {
        assert_eq!(memory_stats(d).unwrap().in_use, *base, "memory on {d} did not return to its baseline");
    }
    let peak = peak_rss_kib();
    if let Some(kib) = peak {
        assert!(kib < 4 << 20, "peak resident memory {kib} KiB: something grew without bound");
    }
    println!("stress: 8 threads, {secs} s, {total} rounds, no deadlock, peak resident memory {} MiB", peak.unwrap_or(0) / 1024);
    assert!(total > 0);
}
