//! `kiln bench`: the benchmark workloads (W1–W5, the asynchronous-op
//! overhead, the per-op overhead by op kind), the chapter's exercises
//! (Ex1–Ex4), and many devices (Comm: all-reduce against the ring's cost;
//! Dp: a data-parallel epoch of LeNet and ResNet-18 on 1, 2 and 4 GPUs), timed as warm-up runs then the median of N runs. `--json`
//! prints one JSON object per line.

use crate::fail;
use crate::util::{fmt_ms, fmt_rate, table, Align, Progress, Result};
use kiln::{gpu, Device};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::time::Instant;

mod census;
mod exercises;
mod parallel;
mod workloads;

use exercises::{ex1, ex2, ex3, ex4};
use parallel::{comm_bench, dp_bench};
use workloads::{async_op, overhead, w1, w2, w3, w4, w5};

/// Options of `kiln bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Workloads to run, case-insensitive: W1 W2 W3 W4 W5 Async Overhead Ex1 Ex2 Ex3 Ex4 Comm Dp (all when none is named).
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
    /// Instead of timing: the launch census of one LeNet and one ResNet-18
    /// training step on `--device`, a CUDA device of the CUDA simulator run
    /// with KILN_CUDASIM_CENSUS=1 (kernels, threads, the busiest thread's
    /// serial work, multiply-adds in cuBLAS).
    #[arg(long)]
    pub census: bool,
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
    Comm,
    Dp,
}

const ALL: [Workload; 13] = [
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
    Workload::Comm,
    Workload::Dp,
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
            Workload::Comm => "Comm",
            Workload::Dp => "Dp",
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
    if args.census {
        return census::run(args.device);
    }
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
            Workload::Comm => comm_bench(&mut ctx),
            Workload::Dp => dp_bench(&mut ctx),
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
                .filter(|(k, _)| {
                    [
                        "transfers",
                        "speedup",
                        "bytes",
                        "gpu_wins_from",
                        "measured_over_model",
                        "device_over_model",
                        "comm_share",
                        "device_speedup",
                    ]
                    .contains(&k.as_str())
                })
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
