//! The benchmark workloads: W1–W5, the asynchronous-op overhead, and the
//! per-op overhead by op kind.

use super::{best_gpu, keep, round, Ctx, Row, Stats};
use crate::fail;
use crate::util::Result;
use kiln::{cpu, DType, Device, Tensor};
use serde_json::json;
use std::cell::RefCell;
use std::time::Instant;

pub(super) fn w1(ctx: &mut Ctx) -> Result<()> {
    let dev = ctx.device;
    let n = if ctx.quick { 256 } else { 2048 };
    let a = Tensor::rand((n, n), &dev)?;
    let b = Tensor::rand((n, n), &dev)?;
    let stats = ctx.measure("matmul", 2, ctx.runs(7), || {
        let c = a.matmul(&b)?;
        c.block_until_ready()?;
        keep(c);
        Ok(())
    })?;
    let flops = 2.0 * (n as f64).powi(3);
    let rate = flops / (stats.median_ms * 1e-3) / 1e9;
    ctx.emit(Row::new("W1", format!("matmul {n}x{n} f32"), dev, stats, rate, "GFLOP/s").with("size", n));
    Ok(())
}

pub(super) fn w2(ctx: &mut Ctx) -> Result<()> {
    let dev = ctx.device;
    let iters = if ctx.quick { 100 } else { 1000 };
    let a = Tensor::rand((100, 100), &dev)?;
    let b = Tensor::rand((100, 100), &dev)?;
    let stats = ctx.measure("matmul+norm", 1, ctx.runs(7), || {
        let mut sum = 0f32;
        for _ in 0..iters {
            let c = a.matmul(&b)?;
            sum += c.norm()?.to_scalar::<f32>()?;
        }
        keep(sum);
        Ok(())
    })?;
    let row = Row::new("W2", format!("{iters}x (matmul 100x100, norm to host)"), dev, stats, stats.median_ms, "ms")
        .with("iters", iters)
        .with("us_per_iter", round(stats.median_ms * 1e3 / iters as f64, 3));
    ctx.emit(row);
    Ok(())
}

pub(super) fn w3(ctx: &mut Ctx) -> Result<()> {
    let dev = ctx.device;
    let n: usize = if ctx.quick { 1_000_000 } else { 100_000_000 };
    ctx.progress.set(format!("{} generating x ({})", ctx.label, kiln::human_bytes(4 * n)));
    let x = Tensor::rand(n, &dev)?;
    let stats = ctx.measure("y = x² - 0.5; z = y³ - 0.2", 1, ctx.runs(5), || {
        let y = (x.sqr()? - 0.5)?;
        let z = (y.powi(3)? - 0.2)?;
        z.block_until_ready()?;
        keep(z);
        Ok(())
    })?;
    let bytes = 32.0 * n as f64;
    let rate = bytes / (stats.median_ms * 1e-3) / 1e9;
    let row = Row::new("W3", format!("n={n}: y=x^2-0.5, z=y^3-0.2"), dev, stats, rate, "GB/s").with("n", n).with("gbytes", bytes / 1e9);
    ctx.emit(row);
    Ok(())
}

pub(super) fn w4(ctx: &mut Ctx) -> Result<()> {
    let dev = ctx.device;
    let iters = if ctx.quick { 1000 } else { 10_000 };
    let b = Tensor::ones(1, DType::F32, &dev)?;
    let last = RefCell::new(None);
    let stats = ctx.measure("a = a + b", 1, ctx.runs(7), || {
        let mut a = Tensor::zeros(1, DType::F32, &dev)?;
        for _ in 0..iters {
            a = (&a + &b)?;
        }
        a.block_until_ready()?;
        *last.borrow_mut() = Some(a);
        Ok(())
    })?;
    if let Some(a) = last.into_inner() {
        let v = a.to_scalar::<f32>()?;
        if v != iters as f32 {
            return Err(fail!("W4 computed {v}, expected {iters}"));
        }
    }
    let rate = stats.median_ms * 1e3 / iters as f64;
    ctx.emit(Row::new("W4", format!("{iters}x (a = a + b), 1 element"), dev, stats, rate, "us/op").with("iters", iters));
    Ok(())
}

/// Linear regression from scratch with autograd (the chapter's book, section 3.4):
/// returns (w, b) after `epochs` epochs of minibatch SGD.
pub fn linreg_scratch(
    features: &Tensor,
    labels: &Tensor,
    batch: usize,
    lr: f64,
    epochs: usize,
    seed: u64,
) -> kiln::Result<(Tensor, Tensor)> {
    let dev = features.device();
    let n = features.dims()[0];
    kiln::manual_seed(seed);
    let w = Tensor::randn_with(0.0, 0.01, (2, 1), DType::F32, &dev)?.requires_grad_();
    let b = Tensor::zeros(1, DType::F32, &dev)?.requires_grad_();
    for _ in 0..epochs {
        let perm = Tensor::from_vec(kiln::data::permutation(n), n, &dev)?;
        let mut start = 0;
        while start < n {
            let len = batch.min(n - start);
            let ids = perm.narrow(0, start, len)?;
            let x = features.index_select(&ids, 0)?;
            let y = labels.index_select(&ids, 0)?;
            let loss = ((x.matmul(&w)? + &b)? - &y)?.sqr()?.mean_all()?;
            loss.backward()?;
            {
                let _no_grad = kiln::no_grad();
                for p in [&w, &b] {
                    if let Some(g) = p.grad() {
                        p.assign(&(p - &(&g * lr)?)?)?;
                    }
                    p.zero_grad();
                }
            }
            start += len;
        }
    }
    Ok((w, b))
}

pub(super) fn w5(ctx: &mut Ctx) -> Result<()> {
    let dev = ctx.device;
    let (n, batch, lr) = (1000, 32, 0.03);
    let epochs = if ctx.quick { 2 } else { 10 };
    let true_w = Tensor::new(&[[2f32], [-3.4]], &dev)?;
    let features = Tensor::randn((n, 2), &dev)?;
    let noise = Tensor::randn_with(0.0, 0.01, (n, 1), DType::F32, &dev)?;
    let labels = ((features.matmul(&true_w)? + 4.2)? + &noise)?;
    let result = RefCell::new(None);
    let mut seed = 42u64;
    let stats = ctx.measure("linear regression", 1, ctx.runs(7), || {
        seed += 1;
        let (w, b) = linreg_scratch(&features, &labels, batch, lr, epochs, seed)?;
        w.block_until_ready()?;
        *result.borrow_mut() = Some((w, b));
        Ok(())
    })?;
    let mut row = Row::new(
        "W5",
        format!("linreg autograd, n={n} bs={batch} lr={lr}, {epochs} epochs"),
        dev,
        stats.per(epochs),
        stats.median_ms / epochs as f64,
        "ms/epoch",
    )
    .with("epochs", epochs);
    if let Some((w, b)) = result.into_inner() {
        let w = w.detach().to_vec::<f32>()?;
        let b = b.detach().to_vec::<f32>()?;
        row = row.with("w", json!([round(w[0] as f64, 4), round(w[1] as f64, 4)])).with("b", round(b[0] as f64, 4));
    }
    ctx.emit(row);
    if dev.is_cpu() {
        // The same training through nn::Linear, Loss::Mse, Sgd and the Trainer (the
        // book's concise version), as kiln::trainer::bench_w5 runs it.
        let per_epoch = RefCell::new(Vec::new());
        let last = RefCell::new(None);
        ctx.measure("linear regression, Trainer", 0, 1 + ctx.runs(7), || {
            let r = kiln::trainer::bench_w5(epochs)?;
            per_epoch.borrow_mut().push(r.ms_per_epoch);
            *last.borrow_mut() = Some(r);
            Ok(())
        })?;
        let mut samples = per_epoch.into_inner();
        samples.remove(0); // the first run warms up
        let stats = Stats::from_samples(samples);
        let mut row = Row::new(
            "W5",
            format!("nn::Linear + Trainer, n={n} bs={batch} lr={lr}, {epochs} epochs"),
            dev,
            stats,
            stats.median_ms,
            "ms/epoch",
        )
        .with("epochs", epochs);
        if let Some(r) = last.into_inner() {
            row = row.with("w", json!([round(r.w[0] as f64, 4), round(r.w[1] as f64, 4)])).with("b", round(r.b as f64, 4));
        }
        ctx.emit(row);
    }
    Ok(())
}

pub(super) fn async_op(ctx: &mut Ctx) -> Result<()> {
    let dev = if ctx.device.is_gpu() && kiln::devices().iter().any(|d| d.device == ctx.device && d.kind == kiln::DeviceKind::Simulated) {
        ctx.device
    } else {
        kiln::ensure_simulated_gpus(1, kiln::DEFAULT_SIM_GPU_MEMORY)[0]
    };
    let iters = if ctx.quick { 1000 } else { 10_000 };
    let b = Tensor::ones(1, DType::F32, &dev)?;
    let enqueue = RefCell::new(Vec::new());
    let stats = ctx.measure("async add", 1, ctx.runs(7), || {
        let start = Instant::now();
        let mut a = Tensor::zeros(1, DType::F32, &dev)?;
        for _ in 0..iters {
            a = (&a + &b)?;
        }
        enqueue.borrow_mut().push(start.elapsed().as_secs_f64() * 1e3);
        kiln::synchronize(&dev)?;
        keep(a);
        Ok(())
    })?;
    let enqueue = Stats::from_samples(enqueue.into_inner());
    let rate = stats.median_ms * 1e3 / iters as f64;
    let row = Row::new("Async", format!("{iters}x 1-element add, enqueue+complete"), dev, stats, rate, "us/op")
        .with("iters", iters)
        .with("enqueue_us_per_op", round(enqueue.median_ms * 1e3 / iters as f64, 4))
        .with("target_us_per_op", 2.0);
    ctx.emit(row);
    Ok(())
}

/// One case of the per-op overhead benchmark: its op kind, what it does, the device it
/// runs on, and one call of the op.
type OverheadCase<'a> = (&'static str, &'static str, Device, Box<dyn Fn() -> kiln::Result<Tensor> + 'a>);

/// Per-op overhead by op kind: `iters` calls of one small op in a loop (so the time is
/// nearly all dispatch, bookkeeping and allocation), warm-up then the median of N loops,
/// reported in ns per op. The op kinds: unary, binary with broadcast, reduction, matmul
/// 4x4, `to` onto the tensor's own device (the same tensor back, no copy), and `to`
/// between the CPU and a GPU (a simulated one when the machine has none).
pub(super) fn overhead(ctx: &mut Ctx) -> Result<()> {
    let dev = ctx.device;
    let iters = if ctx.quick { 1000 } else { 10_000 };
    let runs = ctx.runs(7);
    let one = Tensor::new(&[0.5f32], &dev)?;
    let m44 = Tensor::rand((4, 4), &dev)?;
    let n44 = Tensor::rand((4, 4), &dev)?;
    let v16 = Tensor::rand(16, &dev)?;
    if !one.to(&dev)?.same_storage(&one) {
        return Err(fail!("Overhead: to() onto the tensor's own device made a copy"));
    }
    // The other side of the transfers: a GPU when the ops run on the CPU, the CPU otherwise.
    let (host, gpu_dev) = if dev.is_gpu() { (cpu(), dev) } else { (dev, best_gpu(ctx)) };
    let on_host = Tensor::new(&[0.5f32], &host)?;
    let on_gpu = Tensor::new(&[0.5f32], &gpu_dev)?;
    let cases: Vec<OverheadCase> = vec![
        ("unary", "exp of 1 element", dev, Box::new(|| one.exp())),
        ("binary_broadcast", "(1,) + (4,4)", dev, Box::new(|| &one + &m44)),
        ("reduction", "sum_all of 16 elements", dev, Box::new(|| v16.sum_all())),
        ("matmul_4x4", "(4,4) @ (4,4)", dev, Box::new(|| m44.matmul(&n44))),
        ("to_same_device", "to() onto its own device: the same tensor", dev, Box::new(|| one.to(&dev))),
        ("to_cpu_to_gpu", "to() of 1 element, cpu to gpu", gpu_dev, Box::new(|| on_host.to(&gpu_dev))),
        ("to_gpu_to_cpu", "to() of 1 element, gpu to cpu", gpu_dev, Box::new(|| on_gpu.to(&host))),
    ];
    for (op, what, on, f) in &cases {
        let stats = ctx.measure(&format!("{op} x{iters}"), 1, runs, || {
            let mut last = None;
            for _ in 0..iters {
                last = Some(keep(f()?));
            }
            // Asynchronous devices: the loop counts once the queued work has run.
            kiln::synchronize(on)?;
            kiln::synchronize(&dev)?;
            keep(last);
            Ok(())
        })?;
        let ns = stats.median_ms * 1e6 / iters as f64;
        let row = Row::new("Overhead", format!("{iters}x {op}: {what}"), on, stats, ns, "ns/op")
            .with("op", *op)
            .with("ns_per_op", round(ns, 2))
            .with("iters", iters);
        ctx.emit(row);
    }
    Ok(())
}
