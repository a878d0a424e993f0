//! The convolutional workloads of issue 19 on kiln's host kernels
//! (`kiln::host_nn`), called directly: conv2d forward and forward + backward
//! (input and weight gradients) on the LeNet and ResNet-18 layers and the
//! candle#3119 shape, and batch norm forward + backward in training. f32;
//! warm-up, then the median of 7 runs. One JSON line per workload (the
//! format of `bench/peers`), or a table.
//!
//!     cargo run --release -p kiln --example bench_conv -- [--threads N] [--json] [--runs N] [--parts] [workloads...]
//!
//! Workloads: c1 c2 c3 c4 c5 c6 c7 (or lenet1 lenet2 r64 r128 r256 c3119 bn;
//! default: all). Threads: `--threads`, else RAYON_NUM_THREADS, else 1; the
//! kernels run inside a rayon pool of that many threads, as kiln's CPU
//! backend runs them. `--parts` times the input and weight gradients alone
//! too. `BENCH_CPU_TIME=1` measures the process's CPU time instead of the
//! wall clock (on a busy machine it leaves out the waits for a CPU; for 1
//! thread only), `BENCH_BATCH=n` shrinks the batch (for valgrind).

use kiln::host_nn::*;
use std::time::Instant;

struct Conv {
    key: &'static str,
    alias: &'static str,
    label: &'static str,
    p: Conv2dParams,
}

/// A workload: its key and alias on the command line, its name in the
/// output (the same in the candle and PyTorch peers), and its shape.
fn conv((key, alias, label): (&'static str, &'static str, &'static str), [n, ic, oc, hw, k, pad]: [usize; 6]) -> Conv {
    Conv {
        key,
        alias,
        label,
        p: Conv2dParams {
            batch: n,
            in_channels: ic,
            out_channels: oc,
            input: [hw, hw],
            kernel: [k, k],
            stride: [1, 1],
            padding: Padding2d::symmetric([pad, pad]),
            dilation: [1, 1],
            groups: 1,
        },
    }
}

fn convs() -> Vec<Conv> {
    vec![
        conv(("c1", "lenet1", "C1 LeNet conv 1->6 5x5 pad 2, 28x28, batch 256"), [256, 1, 6, 28, 5, 2]),
        conv(("c2", "lenet2", "C2 LeNet conv 6->16 5x5, 14x14, batch 256"), [256, 6, 16, 14, 5, 0]),
        conv(("c3", "r64", "C3 ResNet 64->64 3x3 pad 1, 56x56, batch 32"), [32, 64, 64, 56, 3, 1]),
        conv(("c4", "r128", "C4 ResNet 128->128 3x3 pad 1, 28x28, batch 32"), [32, 128, 128, 28, 3, 1]),
        conv(("c5", "r256", "C5 ResNet 256->256 3x3 pad 1, 14x14, batch 32"), [32, 256, 256, 14, 3, 1]),
        conv(("c6", "c3119", "C6 candle#3119 3->16 3x3, 320x320, batch 2"), [2, 3, 16, 320, 3, 0]),
    ]
}

/// Deterministic values in [-1, 1).
fn vals(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// This process's CPU time in seconds (for `BENCH_CPU_TIME`: on a busy
/// machine it leaves out the time spent waiting for a CPU; with one thread
/// it stands for the wall clock of a quiet machine).
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn median_ms(runs: usize, mut f: impl FnMut()) -> (f64, f64, f64) {
    f();
    let cpu = std::env::var("BENCH_CPU_TIME").is_ok();
    let mut ts: Vec<f64> = (0..runs)
        .map(|_| {
            if cpu {
                let t = cpu_seconds();
                f();
                (cpu_seconds() - t) * 1e3
            } else {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            }
        })
        .collect();
    ts.sort_by(|a, b| a.total_cmp(b));
    (ts[ts.len() / 2], ts[0], ts[ts.len() - 1])
}

fn emit(json: bool, workload: &str, variant: &str, threads: usize, (med, min, max): (f64, f64, f64), gflop: Option<f64>) {
    if json {
        let g = gflop.map(|g| format!(",\"gflops\":{:.3}", g / (med * 1e-3))).unwrap_or_default();
        println!(
            "{{\"lib\":\"kiln\",\"workload\":\"{workload}\",\"variant\":\"{variant}\",\"threads\":{threads},\"median_ms\":{med:.4},\"min_ms\":{min:.4},\"max_ms\":{max:.4}{g}}}"
        );
    } else {
        let g = gflop.map(|g| format!("  {:.1} GFLOP/s", g / (med * 1e-3))).unwrap_or_default();
        println!("{workload:<48} {variant:<8} {med:>9.3} ms (min {min:.3}, max {max:.3}){g}");
    }
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut take = |flag: &str| -> Option<String> {
        let i = args.iter().position(|a| a == flag)?;
        args.remove(i);
        (i < args.len()).then(|| args.remove(i))
    };
    let threads: usize =
        take("--threads").or_else(|| std::env::var("RAYON_NUM_THREADS").ok()).and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let runs: usize = take("--runs").and_then(|v| v.parse().ok()).unwrap_or(7).max(1);
    let json = if let Some(i) = args.iter().position(|a| a == "--json") {
        args.remove(i);
        true
    } else {
        false
    };
    let parts = if let Some(i) = args.iter().position(|a| a == "--parts") {
        args.remove(i);
        true
    } else {
        false
    };
    let wanted: Vec<String> = args.iter().map(|a| a.to_lowercase()).collect();
    let want = |name: &str| wanted.is_empty() || wanted.iter().any(|w| w == name);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    pool.install(|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        for c in convs().into_iter().filter(|c| want(c.key) || want(c.alias)) {
            let mut p = c.p;
            // BENCH_BATCH: a smaller batch, for profiling under valgrind.
            if let Some(b) = std::env::var("BENCH_BATCH").ok().and_then(|v| v.parse().ok()) {
                p.batch = b;
            }
            let out = p.validate()?;
            let x = vals(p.input_shape().iter().product(), 1);
            let w = vals(p.weight_shape().iter().product(), 2);
            let dy = vals(out.iter().product(), 3);
            let mut y = vec![0f32; dy.len()];
            let (mut gx, mut gw) = (vec![0f32; x.len()], vec![0f32; w.len()]);
            let flop = 2.0 * (out.iter().product::<usize>() * p.weight_shape()[1..].iter().product::<usize>()) as f64 / 1e9;
            let fwd = median_ms(runs, || conv2d_forward(&p, &x, &w, None, &mut y, threads).expect("conv2d forward"));
            emit(json, c.label, "fwd", threads, fwd, Some(flop));
            let both = median_ms(runs, || {
                conv2d_forward(&p, &x, &w, None, &mut y, threads).expect("conv2d forward");
                conv2d_backward(&p, &x, &w, &dy, Some(&mut gx), Some(&mut gw), None, threads).expect("conv2d backward");
            });
            emit(json, c.label, "fwd+bwd", threads, both, Some(3.0 * flop));
            if parts {
                let gi = median_ms(runs, || conv2d_backward_input(&p, &w, &dy, &mut gx, threads).expect("input gradient"));
                emit(json, c.label, "bwd input", threads, gi, Some(flop));
                let gw_t = median_ms(runs, || conv2d_backward_weight(&p, &x, &dy, &mut gw, threads).expect("weight gradient"));
                emit(json, c.label, "bwd weight", threads, gw_t, Some(flop));
            }
        }
        if want("c7") || want("bn") {
            // Batch norm in training: forward with batch statistics, the
            // running-statistics update, and every gradient.
            let p = BatchNormParams { batch: 32, channels: 64, spatial: 56 * 56, eps: 1e-5 };
            let len = p.validate(true)?;
            let (x, dy) = (vals(len, 4), vals(len, 5));
            let (w, b) = (vals(64, 6), vals(64, 7));
            let (mut y, mut gx) = (vec![0f32; len], vec![0f32; len]);
            let (mut mean, mut invstd, mut var) = (vec![0f32; 64], vec![0f32; 64], vec![0f32; 64]);
            let (mut rm, mut rv) = (vec![0f32; 64], vec![1f32; 64]);
            let (mut gw, mut gb) = (vec![0f32; 64], vec![0f32; 64]);
            let t = median_ms(runs, || {
                batch_norm_train_forward(&p, &x, Some(&w), Some(&b), &mut y, &mut mean, &mut invstd, Some(&mut var), threads)
                    .expect("batch norm");
                batch_norm_update_running(&p, &mean, &var, 0.1, &mut rm, &mut rv).expect("running statistics");
                batch_norm_backward(&p, &x, &dy, Some(&w), &mean, &invstd, true, Some(&mut gx), Some(&mut gw), Some(&mut gb), threads)
                    .expect("batch norm backward");
            });
            emit(json, "C7 batch norm [32, 64, 56, 56] training", "fwd+bwd", threads, t, None);
        }
        Ok(())
    })?;
    Ok(())
}
