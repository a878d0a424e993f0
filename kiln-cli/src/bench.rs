//! `kiln bench`: the benchmark workloads (W1–W5, the asynchronous-op
//! overhead, the per-op overhead by op kind) and the chapter's exercises
//! (Ex1–Ex4), timed as warm-up runs then the median of N runs. `--json`
//! prints one JSON object per line.

use crate::fail;
use crate::util::{fmt_ms, fmt_rate, table, Align, Progress, Result};
use kiln::{cpu, gpu, DType, Device, Tensor};
use serde_json::{json, Map, Value};
use std::cell::RefCell;
use std::path::PathBuf;
use std::time::Instant;

/// Options of `kiln bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Workloads to run, case-insensitive: W1 W2 W3 W4 W5 Async Overhead Ex1 Ex2 Ex3 Ex4 (all when none is named).
    #[arg(value_name = "WORKLOAD")]
    pub workloads: Vec<String>,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write Ex1's GFLOP/s-against-size plot to this PNG file.
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
    /// The device W1–W5 run on.
    #[arg(long, value_name = "DEVICE", default_value = "cpu", value_parser = crate::parse_device)]
    pub device: Device,
    /// Small sizes and few runs: a smoke test in seconds (also KILN_BENCH_QUICK=1).
    #[arg(long)]
    pub quick: bool,
    /// Include 4096² in Ex1 on the CPU and on simulated GPUs (slow).
    #[arg(long)]
    pub full: bool,
    /// Timed runs per measurement (default: chosen per workload).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub runs: Option<u32>,
}

/// The workloads, in the order `kiln bench` runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    W1,
    W2,
    W3,
    W4,
    W5,
    Async,
    Overhead,
    Ex1,
    Ex2,
    Ex3,
    Ex4,
}

const ALL: [Workload; 11] = [
    Workload::W1,
    Workload::W2,
    Workload::W3,
    Workload::W4,
    Workload::W5,
    Workload::Async,
    Workload::Overhead,
    Workload::Ex1,
    Workload::Ex2,
    Workload::Ex3,
    Workload::Ex4,
];

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::W1 => "W1",
            Workload::W2 => "W2",
            Workload::W3 => "W3",
            Workload::W4 => "W4",
            Workload::W5 => "W5",
            Workload::Async => "Async",
            Workload::Overhead => "Overhead",
            Workload::Ex1 => "Ex1",
            Workload::Ex2 => "Ex2",
            Workload::Ex3 => "Ex3",
            Workload::Ex4 => "Ex4",
        }
    }

    fn parse(s: &str) -> Result<Workload> {
        ALL.iter().copied().find(|w| w.name().eq_ignore_ascii_case(s.trim())).ok_or_else(|| {
            let names: Vec<&str> = ALL.iter().map(|w| w.name()).collect();
            fail!("unknown workload `{s}`; choose from {}", names.join(", "))
        })
    }
}

/// Timings of one measurement, in milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub runs: usize,
}

impl Stats {
    fn from_samples(mut ms: Vec<f64>) -> Stats {
        ms.sort_by(|a, b| a.total_cmp(b));
        let n = ms.len();
        let median = if n == 0 {
            0.0
        } else if n % 2 == 1 {
            ms[n / 2]
        } else {
            0.5 * (ms[n / 2 - 1] + ms[n / 2])
        };
        Stats { median_ms: median, min_ms: ms.first().copied().unwrap_or(0.0), max_ms: ms.last().copied().unwrap_or(0.0), runs: n }
    }

    /// The same timings divided by `k` (per repetition).
    fn per(self, k: usize) -> Stats {
        let k = k.max(1) as f64;
        Stats { median_ms: self.median_ms / k, min_ms: self.min_ms / k, max_ms: self.max_ms / k, runs: self.runs }
    }
}

/// One result line.
struct Row {
    workload: &'static str,
    variant: String,
    device: String,
    stats: Stats,
    rate: f64,
    unit: &'static str,
    extra: Map<String, Value>,
}

fn round(v: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (v * scale).round() / scale
}

impl Row {
    fn new(workload: &'static str, variant: impl Into<String>, device: impl ToString, stats: Stats, rate: f64, unit: &'static str) -> Row {
        Row { workload, variant: variant.into(), device: device.to_string(), stats, rate, unit, extra: Map::new() }
    }

    fn with(mut self, key: &str, value: impl Into<Value>) -> Row {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    /// One JSON object, with the keys in a readable order (required ones first).
    fn to_json_line(&self, threads: usize) -> String {
        let Value::Object(m) = self.to_json(threads) else { return String::new() };
        let mut keys: Vec<&String> = m.keys().collect();
        let order = |k: &str| {
            ["workload", "variant", "device", "threads", "median_ms", "min_ms", "max_ms", "runs", "rate", "unit"]
                .iter()
                .position(|o| *o == k)
                .unwrap_or(usize::MAX)
        };
        keys.sort_by_key(|k| order(k));
        let fields: Vec<String> = keys.iter().map(|k| format!("{}:{}", Value::String((*k).clone()), m[*k])).collect();
        format!("{{{}}}", fields.join(","))
    }

    fn to_json(&self, threads: usize) -> Value {
        let mut m = Map::new();
        m.insert("workload".into(), json!(self.workload));
        m.insert("variant".into(), json!(self.variant));
        m.insert("device".into(), json!(self.device));
        m.insert("threads".into(), json!(threads));
        m.insert("median_ms".into(), json!(round(self.stats.median_ms, 6)));
        m.insert("min_ms".into(), json!(round(self.stats.min_ms, 6)));
        m.insert("max_ms".into(), json!(round(self.stats.max_ms, 6)));
        m.insert("runs".into(), json!(self.stats.runs));
        m.insert("rate".into(), json!(round(self.rate, 4)));
        m.insert("unit".into(), json!(self.unit));
        for (k, v) in &self.extra {
            m.insert(k.clone(), v.clone());
        }
        Value::Object(m)
    }
}

/// Shared state of one `kiln bench` run.
struct Ctx {
    json: bool,
    quick: bool,
    full: bool,
    runs: Option<usize>,
    device: Device,
    threads: usize,
    plot: Option<PathBuf>,
    progress: Progress,
    label: String,
    rows: Vec<Row>,
    notes: Vec<String>,
}

impl Ctx {
    /// Runs per measurement: the workload's default, fewer when quick, or what the user asked.
    fn runs(&self, default: usize) -> usize {
        self.runs.unwrap_or(if self.quick { default.min(3) } else { default })
    }

    /// Warm-up runs, then `runs` timed runs of `f`; the times in ms.
    fn measure(&self, what: &str, warmup: usize, runs: usize, mut f: impl FnMut() -> kiln::Result<()>) -> Result<Stats> {
        for i in 0..warmup {
            self.progress.set(format!("{} {what}: warm-up {}/{warmup}", self.label, i + 1));
            f()?;
        }
        let mut samples = Vec::with_capacity(runs);
        for i in 0..runs {
            self.progress.set(format!("{} {what}: run {}/{runs}", self.label, i + 1));
            let start = Instant::now();
            f()?;
            samples.push(start.elapsed().as_secs_f64() * 1e3);
        }
        Ok(Stats::from_samples(samples))
    }

    fn emit(&mut self, row: Row) {
        if self.json {
            let line = row.to_json_line(self.threads);
            self.progress.suspend(|| println!("{line}"));
        }
        self.rows.push(row);
    }

    fn note(&mut self, text: String) {
        if self.json {
            self.progress.suspend(|| eprintln!("{text}"));
        }
        self.notes.push(text);
    }
}

/// Runs `kiln bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    let mut chosen = Vec::new();
    for name in &args.workloads {
        let w = Workload::parse(name)?;
        if !chosen.contains(&w) {
            chosen.push(w);
        }
    }
    if chosen.is_empty() {
        chosen = ALL.to_vec();
    }
    crate::check_device(args.device)?;
    if let Some(path) = &args.plot {
        if !chosen.contains(&Workload::Ex1) {
            return Err(fail!("--plot draws Ex1's results; add Ex1 to the workloads"));
        }
        crate::util::check_writable(path, "the plot")?;
    }
    // Read (and a malformed value warned about) even when --quick is given.
    let quick_env = kiln::env_flag("KILN_BENCH_QUICK");
    let quick = args.quick || quick_env.unwrap_or(false);
    let mut ctx = Ctx {
        json: args.json,
        quick,
        full: args.full,
        runs: args.runs.map(|r| r as usize),
        device: args.device,
        threads: rayon::current_num_threads(),
        plot: args.plot,
        progress: Progress::new(),
        label: String::new(),
        rows: Vec::new(),
        notes: Vec::new(),
    };
    if !ctx.json {
        println!(
            "kiln bench: {} workload(s), {} thread(s) (RAYON_NUM_THREADS), warm-up then median of N runs{}",
            chosen.len(),
            ctx.threads,
            if quick { ", quick sizes" } else { "" }
        );
    }
    kiln::manual_seed(0);
    let total = chosen.len();
    for (i, w) in chosen.iter().enumerate() {
        ctx.label = format!("[{}/{total}] {}", i + 1, w.name());
        ctx.progress.set(ctx.label.clone());
        let result = match w {
            Workload::W1 => w1(&mut ctx),
            Workload::W2 => w2(&mut ctx),
            Workload::W3 => w3(&mut ctx),
            Workload::W4 => w4(&mut ctx),
            Workload::W5 => w5(&mut ctx),
            Workload::Async => async_op(&mut ctx),
            Workload::Overhead => overhead(&mut ctx),
            Workload::Ex1 => ex1(&mut ctx),
            Workload::Ex2 => ex2(&mut ctx),
            Workload::Ex3 => ex3(&mut ctx),
            Workload::Ex4 => ex4(&mut ctx),
        };
        if let Err(e) = result {
            ctx.progress.finish();
            return Err(fail!("{} failed: {e}", w.name()));
        }
    }
    ctx.progress.finish();
    if !ctx.json {
        println!("{}", summary(&ctx));
        for note in &ctx.notes {
            println!("{note}");
        }
    }
    Ok(())
}

fn summary(ctx: &Ctx) -> String {
    let rows: Vec<Vec<String>> = ctx
        .rows
        .iter()
        .map(|r| {
            let extra: Vec<String> = r
                .extra
                .iter()
                .filter(|(k, _)| ["transfers", "speedup", "bytes", "gpu_wins_from"].contains(&k.as_str()))
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            vec![
                r.workload.to_string(),
                r.variant.clone(),
                r.device.clone(),
                ctx.threads.to_string(),
                fmt_ms(r.stats.median_ms),
                fmt_ms(r.stats.min_ms),
                fmt_ms(r.stats.max_ms),
                format!("{} {}", fmt_rate(r.rate), r.unit),
                extra.join(" "),
            ]
        })
        .collect();
    table(
        &[
            ("WORKLOAD", Align::Left),
            ("VARIANT", Align::Left),
            ("DEVICE", Align::Left),
            ("THREADS", Align::Right),
            ("MEDIAN", Align::Right),
            ("MIN", Align::Right),
            ("MAX", Align::Right),
            ("RATE", Align::Right),
            ("NOTES", Align::Left),
        ],
        &rows,
    )
}

/// Black-box a value so the optimizer keeps the work that made it.
fn keep<T>(v: T) -> T {
    std::hint::black_box(v)
}

/// The first GPU, or a simulated one when the machine has none.
fn best_gpu(ctx: &mut Ctx) -> Device {
    if kiln::num_gpus() > 0 {
        gpu(0)
    } else {
        let d = kiln::ensure_simulated_gpus(1, kiln::DEFAULT_SIM_GPU_MEMORY)[0];
        ctx.note(format!("No GPU on this machine: using simulated {d}."));
        d
    }
}

fn w1(ctx: &mut Ctx) -> Result<()> {
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

fn w2(ctx: &mut Ctx) -> Result<()> {
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

fn w3(ctx: &mut Ctx) -> Result<()> {
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

fn w4(ctx: &mut Ctx) -> Result<()> {
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

fn w5(ctx: &mut Ctx) -> Result<()> {
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

fn async_op(ctx: &mut Ctx) -> Result<()> {
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
fn overhead(ctx: &mut Ctx) -> Result<()> {
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

/// One Ex1 measurement.
struct Point {
    device: Device,
    size: usize,
    reps: usize,
    stats: Stats,
    gflops: f64,
}

fn ex1(ctx: &mut Ctx) -> Result<()> {
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

fn ex3(ctx: &mut Ctx) -> Result<()> {
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

fn ex4(ctx: &mut Ctx) -> Result<()> {
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

fn ex2(ctx: &mut Ctx) -> Result<()> {
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
