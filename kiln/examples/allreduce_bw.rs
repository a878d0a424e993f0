//! All-reduce bandwidth across GPUs, reported as nccl-tests'
//! `all_reduce_perf` reports it: for each size S (bytes per device), the
//! time of one in-place sum (`comm::all_reduce_`) over n devices, the
//! algorithm bandwidth S / t and the bus bandwidth S / t · 2(n − 1)/n (what
//! each link carries in a ring, comparable across n and with nccl-tests'
//! `busbw` column). Uses every CUDA device, or with `--sim N` that many
//! simulated GPUs (their modelled link); `kiln devices` says whether CUDA
//! collectives run through NCCL or peer copies.
//!
//! ```sh
//! cargo run --release -p kiln --example allreduce_bw             # the CUDA devices
//! cargo run --release -p kiln --example allreduce_bw -- --sim 4  # 4 simulated GPUs
//! cargo run --release -p kiln --example allreduce_bw -- --max 1GiB --iters 20
//! ```

use kiln::comm::{self, ReduceOp};
use kiln::{DType, Device, DeviceKind, Tensor};
use std::time::Instant;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn main() -> kiln::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters: usize = arg(&args, "--iters").and_then(|v| v.parse().ok()).unwrap_or(10).max(1);
    let max = arg(&args, "--max").map(|v| kiln::parse_bytes(&v)).transpose()?.unwrap_or(256 << 20);
    let devices: Vec<Device> = match arg(&args, "--sim") {
        Some(n) => kiln::ensure_simulated_gpus(n.parse().unwrap_or(2), 2 * max + (64 << 20)),
        None => kiln::devices().into_iter().filter(|d| d.kind == DeviceKind::Cuda).map(|d| d.device).collect(),
    };
    let n = devices.len();
    if n < 2 {
        println!("allreduce_bw: needs two GPUs or more, found {n} CUDA device(s); try `--sim 2`");
        return Ok(());
    }
    let how = kiln::devices()
        .into_iter()
        .find(|i| i.device == devices[0])
        .and_then(|i| i.details.into_iter().find(|(k, _)| k == "collectives").map(|(_, v)| v))
        .unwrap_or_default();
    println!("all_reduce_ (sum, f32, in place) over {n} devices {devices:?}: {how}");
    println!("{:>12} {:>12} {:>12} {:>14} {:>14}", "bytes", "elements", "time (us)", "algbw (GB/s)", "busbw (GB/s)");
    let mut bytes = 1usize << 10;
    while bytes <= max {
        let len = bytes / 4;
        let parts: Vec<Tensor> = devices.iter().map(|d| Tensor::ones(len, DType::F32, d)).collect::<kiln::Result<_>>()?;
        // Warm up: communicators, streams, kernels.
        comm::all_reduce_(&parts, ReduceOp::Sum)?;
        for d in &devices {
            kiln::synchronize(d)?;
        }
        let start = Instant::now();
        for _ in 0..iters {
            comm::all_reduce_(&parts, ReduceOp::Sum)?;
        }
        for d in &devices {
            kiln::synchronize(d)?;
        }
        let secs = start.elapsed().as_secs_f64() / iters as f64;
        let algbw = bytes as f64 / secs / 1e9;
        let busbw = algbw * 2.0 * (n - 1) as f64 / n as f64;
        println!("{bytes:>12} {len:>12} {:>12.1} {algbw:>14.2} {busbw:>14.2}", secs * 1e6);
        // Every device holds n^(iters + 1).
        let expected = (n as f64).powi(iters as i32 + 1);
        let got = f64::from(parts[n - 1].narrow(0, 0, 1)?.to_vec::<f32>()?[0]);
        let ok = if expected < f64::from(f32::MAX) { ((got - expected) / expected).abs() < 1e-5 } else { got.is_infinite() };
        assert!(ok, "all_reduce_ gave {got}, expected {expected}");
        bytes *= 4;
    }
    Ok(())
}
