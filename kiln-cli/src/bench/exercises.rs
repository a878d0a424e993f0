//! The chapter's exercises Ex1–Ex4, timed.

use super::{best_gpu, keep, round, Ctx, Row, Stats};
use crate::fail;
use crate::util::Result;
use kiln::{cpu, gpu, Device, Tensor};

/// One Ex1 measurement.
struct Point {
    device: Device,
    size: usize,
    reps: usize,
    stats: Stats,
    gflops: f64,
}

pub(super) fn ex1(ctx: &mut Ctx) -> Result<()> {
    let mut devices = vec![cpu()];
    if kiln::num_gpus() == 0 {
        let d = kiln::ensure_simulated_gpus(1, kiln::DEFAULT_SIM_GPU_MEMORY)[0];
        ctx.note(format!("Ex1: no GPU on this machine, so the GPU side is simulated {d} (host RAM, one core)."));
    }
    devices.extend((0..kiln::num_gpus()).map(gpu));
    let info = kiln::devices();
    let is_sim = |d: Device| info.iter().any(|i| i.device == d && i.kind != kiln::DeviceKind::Cuda);
    let max = if ctx.quick { 128 } else { 4096 };
    let mut points = Vec::new();
    for &dev in &devices {
        let mut size = 16;
        while size <= max {
            if size == 4096 && is_sim(dev) && !ctx.full {
                break;
            }
            let a = Tensor::rand((size, size), &dev)?;
            let b = Tensor::rand((size, size), &dev)?;
            let flops = 2.0 * (size as f64).powi(3);
            let target = if ctx.quick { 2e6 } else { 5e7 };
            let reps = ((target / flops) as usize).max(1);
            let runs = ctx.runs(if size >= 2048 { 3 } else { 5 });
            let stats = ctx.measure(&format!("{dev} {size}x{size} x{reps}"), 1, runs, || {
                let mut last = None;
                for _ in 0..reps {
                    last = Some(a.matmul(&b)?);
                }
                kiln::synchronize(&dev)?;
                keep(last);
                Ok(())
            })?;
            let stats = stats.per(reps);
            let gflops = flops / (stats.median_ms * 1e-3) / 1e9;
            points.push(Point { device: dev, size, reps, stats, gflops });
            size *= 2;
        }
    }
    let cpu_rate = |size: usize| points.iter().find(|p| p.device == cpu() && p.size == size).map(|p| p.gflops);
    let mut wins_from = std::collections::BTreeMap::new();
    for &dev in devices.iter().filter(|d| d.is_gpu()) {
        let mine: Vec<&Point> = points.iter().filter(|p| p.device == dev).collect();
        // The smallest size from which the GPU beats the CPU at every larger size measured on
        // both, by more than 5% (less is timing noise).
        let mut from = None;
        for p in mine.iter().rev() {
            match cpu_rate(p.size) {
                Some(c) if p.gflops > 1.05 * c => from = Some(p.size),
                Some(_) => break,
                None => {}
            }
        }
        wins_from.insert(dev, from);
        ctx.note(match from {
            Some(s) => format!("Ex1: {dev} beats the CPU from {s}x{s} on."),
            None => format!("Ex1: {dev} never beats the CPU ({} thread(s)) by more than 5% at the sizes measured.", ctx.threads),
        });
    }
    for p in &points {
        let mut row = Row::new("Ex1", format!("matmul {0}x{0} (x{1}/run)", p.size, p.reps), p.device, p.stats, p.gflops, "GFLOP/s")
            .with("size", p.size);
        if p.device.is_gpu() {
            row = row.with("gpu_wins_from", wins_from.get(&p.device).copied().flatten());
        }
        ctx.emit(row);
    }
    if let Some(path) = ctx.plot.clone() {
        let series: Vec<(String, Vec<(usize, f64)>)> = devices
            .iter()
            .map(|&d| {
                let name =
                    info.iter().find(|i| i.device == d && d.is_gpu()).map(|i| format!("{d} ({})", i.kind)).unwrap_or_else(|| d.to_string());
                (name, points.iter().filter(|p| p.device == d).map(|p| (p.size, p.gflops)).collect())
            })
            .collect();
        crate::plot::gflops_vs_size(&path, &series, ctx.threads)?;
        ctx.note(format!("Ex1: plot written to {}", path.display()));
    } else if !ctx.json {
        ctx.note("Ex1: add `--plot ex1.png` for a plot of GFLOP/s against size.".into());
    }
    Ok(())
}

pub(super) fn ex3(ctx: &mut Ctx) -> Result<()> {
    let dev = best_gpu(ctx);
    let iters = if ctx.quick { 100 } else { 1000 };
    let a = Tensor::rand((100, 100), &dev)?;
    let b = Tensor::rand((100, 100), &dev)?;
    let per_step = || -> kiln::Result<Vec<f32>> {
        let mut log = Vec::with_capacity(iters);
        for _ in 0..iters {
            let c = a.matmul(&b)?;
            log.push(c.norm()?.to_scalar::<f32>()?);
        }
        Ok(log)
    };
    let on_device = || -> kiln::Result<Vec<f32>> {
        let mut log = Vec::with_capacity(iters);
        for _ in 0..iters {
            let c = a.matmul(&b)?;
            log.push(c.norm()?);
        }
        let refs: Vec<&Tensor> = log.iter().collect();
        Tensor::stack(&refs, 0)?.to_vec::<f32>()
    };
    // Count the transfers of one run of each, on this thread only.
    let before = kiln::thread_transfer_stats();
    let log_a = per_step()?;
    let mid = kiln::thread_transfer_stats();
    let log_b = on_device()?;
    let after = kiln::thread_transfer_stats();
    let (ta, tb) = (mid.since(&before).total(), after.since(&mid).total());
    if log_a != log_b {
        return Err(fail!("Ex3: the two logs differ"));
    }
    let sa = ctx.measure("log each step to the host", 0, ctx.runs(7), || per_step().map(keep).map(|_| ()))?;
    let sb = ctx.measure("log on the device, read once", 0, ctx.runs(7), || on_device().map(keep).map(|_| ()))?;
    let speedup = sa.median_ms / sb.median_ms;
    ctx.emit(
        Row::new("Ex3", format!("{iters}x matmul+norm, read each norm"), dev, sa, sa.median_ms, "ms")
            .with("transfers", ta.count)
            .with("transfer_bytes", ta.bytes)
            .with("iters", iters),
    );
    ctx.emit(
        Row::new("Ex3", format!("{iters}x matmul+norm, stack, read once"), dev, sb, sb.median_ms, "ms")
            .with("transfers", tb.count)
            .with("transfer_bytes", tb.bytes)
            .with("iters", iters)
            .with("speedup", round(speedup, 3)),
    );
    ctx.note(format!(
        "Ex3: logging every step made {} device-to-host transfers, the on-device log {}; {:.2}x faster on {dev}.",
        ta.count, tb.count, speedup
    ));
    if kiln::devices().iter().any(|d| d.device == dev && d.kind == kiln::DeviceKind::Simulated) {
        ctx.note("Ex3: on a simulated GPU each read waits for the queue and pays a simulated bus round trip (KILN_SIM_TRANSFER_LATENCY, 10 us by default); a real GPU's PCIe round trip is of that order.".into());
    }
    Ok(())
}

pub(super) fn ex4(ctx: &mut Ctx) -> Result<()> {
    let (d0, d1) = if kiln::num_gpus() >= 2 {
        (gpu(0), gpu(1))
    } else {
        let sims = kiln::ensure_simulated_gpus(2, kiln::DEFAULT_SIM_GPU_MEMORY);
        ctx.note(format!("Ex4: fewer than two GPUs here, so simulated {} and {} stand in.", sims[0], sims[1]));
        (sims[0], sims[1])
    };
    let n = if ctx.quick { 256 } else { 2048 };
    let a0 = Tensor::rand((n, n), &d0)?;
    let b0 = Tensor::rand((n, n), &d0)?;
    let a1 = Tensor::rand((n, n), &d1)?;
    let b1 = Tensor::rand((n, n), &d1)?;
    let a1_on0 = a1.to(&d0)?;
    let b1_on0 = b1.to(&d0)?;
    let runs = ctx.runs(7);
    let seq = ctx.measure(&format!("both on {d0}"), 1, runs, || {
        let c0 = a0.matmul(&b0)?;
        let c1 = a1_on0.matmul(&b1_on0)?;
        kiln::synchronize(&d0)?;
        keep((c0, c1));
        Ok(())
    })?;
    let conc = ctx.measure(&format!("{d0} and {d1} at once"), 1, runs, || {
        let c0 = a0.matmul(&b0)?;
        let c1 = a1.matmul(&b1)?;
        kiln::synchronize(&d0)?;
        kiln::synchronize(&d1)?;
        keep((c0, c1));
        Ok(())
    })?;
    let flops = 2.0 * 2.0 * (n as f64).powi(3);
    let speedup = seq.median_ms / conc.median_ms;
    let rate = |s: &Stats| flops / (s.median_ms * 1e-3) / 1e9;
    ctx.emit(
        Row::new("Ex4", format!("2 matmuls {n}x{n}, in sequence"), d0, seq, rate(&seq), "GFLOP/s").with("size", n).with("speedup", 1.0),
    );
    ctx.emit(
        Row::new("Ex4", format!("2 matmuls {n}x{n}, one per device"), format!("{d0}+{d1}"), conc, rate(&conc), "GFLOP/s")
            .with("size", n)
            .with("speedup", round(speedup, 3)),
    );
    ctx.note(format!("Ex4: two devices at once {speedup:.2}x faster than one in sequence (target 1.8x with two free cores)."));
    Ok(())
}

pub(super) fn ex2(ctx: &mut Ctx) -> Result<()> {
    use kiln::nn::{Linear, Module, ReLU, Sequential};
    let mut devices = vec![cpu()];
    if kiln::num_gpus() == 0 {
        let d = kiln::ensure_simulated_gpus(1, kiln::DEFAULT_SIM_GPU_MEMORY)[0];
        ctx.note(format!("Ex2: no GPU on this machine, so the GPU side is simulated {d}."));
    }
    devices.extend((0..kiln::num_gpus()).map(gpu));
    let dir = std::env::temp_dir().join(format!("kiln-bench-ex2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| fail!("Ex2: cannot create {}: {e}", dir.display()))?;
    let hidden = if ctx.quick { 64 } else { 1024 };
    let make = || -> kiln::Result<Sequential> {
        Ok(Sequential::new()
            .add(Linear::new(784, hidden, &cpu())?)
            .add(ReLU)
            .add(Linear::new(hidden, hidden, &cpu())?)
            .add(ReLU)
            .add(Linear::new(hidden, 10, &cpu())?))
    };
    let result = (|| -> Result<()> {
        for &dev in &devices {
            let mut net = make()?;
            net.to(&dev)?;
            let path = dir.join(format!("mlp-{}.safetensors", dev.to_string().replace(['(', ')'], "")));
            let save = ctx.measure(&format!("save from {dev}"), 1, ctx.runs(5), || kiln::checkpoint::save(&net, &path))?;
            let bytes = std::fs::metadata(&path).map(|m| m.len()).map_err(|e| fail!("Ex2: {}: {e}", path.display()))?;
            let mut other = make()?;
            let load = ctx.measure(&format!("load onto {dev}"), 1, ctx.runs(5), || {
                kiln::checkpoint::load(&mut other, &path, &dev)?;
                kiln::synchronize(&dev)
            })?;
            // The round trip is exact, and the loaded parameters live on the device.
            for ((name, a), (_, b)) in net.named_parameters().iter().zip(other.named_parameters()) {
                if b.device() != dev || a.detach().to_vec::<f32>()? != b.detach().to_vec::<f32>()? {
                    return Err(fail!("Ex2: parameter {name} did not survive the round trip on {dev}"));
                }
            }
            let mb = |s: &Stats| bytes as f64 / (s.median_ms * 1e-3) / 1e6;
            let params = net.num_parameters();
            ctx.emit(
                Row::new("Ex2", format!("save MLP 784-{hidden}-{hidden}-10 ({params} params)"), dev, save, mb(&save), "MB/s")
                    .with("bytes", bytes)
                    .with("parameters", params),
            );
            ctx.emit(
                Row::new("Ex2", format!("load MLP 784-{hidden}-{hidden}-10 ({params} params)"), dev, load, mb(&load), "MB/s")
                    .with("bytes", bytes)
                    .with("parameters", params),
            );
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}
