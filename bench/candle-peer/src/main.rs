//! The candle peer of `bench/peers`: runs W1–W5 as `kiln bench` runs them, and the
//! convolution workloads C1–C6 as kiln's `bench_conv` example runs them (same sizes, same
//! warm-up, median of the same number of runs), and prints one JSON object per line, as
//! the numpy and PyTorch peers do. `peak` measures this core's f32 FMA peak.
//!
//!     candle-peer [--quick] [--runs N] [w1 w2 w3 w4 w5 c1 c2 c3 c4 c5 c6 peak]
//!
//! Threads: RAYON_NUM_THREADS, as candle reads it (`candle_core::utils::get_num_threads`).

use candle_core::{DType, Device, Tensor, Var};
use std::time::Instant;

/// The candle version pinned in Cargo.toml.
const CANDLE: &str = "0.11.1";

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Stats {
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
    runs: usize,
}

impl Stats {
    /// The median as `kiln bench` takes it (the mean of the middle two for an even count).
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

    fn per(self, k: usize) -> Stats {
        let k = k.max(1) as f64;
        Stats { median_ms: self.median_ms / k, min_ms: self.min_ms / k, max_ms: self.max_ms / k, runs: self.runs }
    }
}

struct Ctx {
    quick: bool,
    runs: Option<usize>,
    threads: usize,
}

impl Ctx {
    fn runs(&self, default: usize) -> usize {
        self.runs.unwrap_or(if self.quick { default.min(3) } else { default })
    }

    /// Warm-up runs, then `runs` timed runs of `f`, in ms: wall clock, or
    /// with `BENCH_CPU_TIME` set the process's CPU time (on a busy machine it
    /// leaves out the waits for a CPU; for 1 thread).
    fn measure(&self, warmup: usize, runs: usize, mut f: impl FnMut() -> Res<()>) -> Res<Stats> {
        for _ in 0..warmup {
            f()?;
        }
        let cpu = std::env::var("BENCH_CPU_TIME").is_ok();
        let mut samples = Vec::with_capacity(runs);
        for _ in 0..runs {
            if cpu {
                let start = cpu_seconds();
                f()?;
                samples.push((cpu_seconds() - start) * 1e3);
            } else {
                let start = Instant::now();
                f()?;
                samples.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(Stats::from_samples(samples))
    }

    /// One JSON line in the peers' format; `extra` is `"key":value` pairs, already JSON.
    fn emit(&self, lib: &str, workload: &str, variant: &str, s: &Stats, extra: &[(&str, String)]) {
        let mut line = format!(
            "{{\"lib\":{},\"workload\":{},\"variant\":{},\"threads\":{},\"median_ms\":{:.6},\"min_ms\":{:.6},\"max_ms\":{:.6},\"runs\":{}",
            quote(lib),
            quote(workload),
            quote(variant),
            self.threads,
            s.median_ms,
            s.min_ms,
            s.max_ms,
            s.runs
        );
        for (k, v) in extra {
            line.push_str(&format!(",{}:{}", quote(k), v));
        }
        line.push('}');
        println!("{line}");
    }
}

/// This process's CPU time in seconds.
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn keep<T>(v: T) -> T {
    std::hint::black_box(v)
}

fn w1(ctx: &Ctx) -> Res<()> {
    let dev = Device::Cpu;
    let n = if ctx.quick { 256 } else { 2048 };
    let a = Tensor::rand(0f32, 1f32, (n, n), &dev)?;
    let b = Tensor::rand(0f32, 1f32, (n, n), &dev)?;
    let s = ctx.measure(2, ctx.runs(7), || {
        keep(a.matmul(&b)?);
        Ok(())
    })?;
    let gflops = 2.0 * (n as f64).powi(3) / (s.median_ms * 1e-3) / 1e9;
    ctx.emit(
        "candle",
        &format!("W1 matmul {n}"),
        "a @ b (a.matmul(&b))",
        &s,
        &[("gflops", format!("{gflops:.4}")), ("size", n.to_string())],
    );
    Ok(())
}

fn w2(ctx: &Ctx) -> Res<()> {
    let dev = Device::Cpu;
    let iters = if ctx.quick { 100 } else { 1000 };
    let a = Tensor::rand(0f32, 1f32, (100, 100), &dev)?;
    let b = Tensor::rand(0f32, 1f32, (100, 100), &dev)?;
    let s = ctx.measure(1, ctx.runs(7), || {
        let mut sum = 0f32;
        for _ in 0..iters {
            let c = a.matmul(&b)?;
            // candle has no norm op: the Frobenius norm as sqrt(sum(c²)).
            sum += c.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
        }
        keep(sum);
        Ok(())
    })?;
    ctx.emit(
        "candle",
        "W2 1000x matmul100+norm",
        ".to_scalar() each iter (norm = sqr, sum_all, sqrt)",
        &s,
        &[("iters", iters.to_string()), ("us_per_iter", format!("{:.4}", s.median_ms * 1e3 / iters as f64))],
    );
    Ok(())
}

fn w3(ctx: &Ctx) -> Res<()> {
    let dev = Device::Cpu;
    let n: usize = if ctx.quick { 1_000_000 } else { 100_000_000 };
    let x = Tensor::rand(0f32, 1f32, n, &dev)?;
    let s = ctx.measure(1, ctx.runs(5), || {
        let y = (x.sqr()? - 0.5)?;
        // candle's powf is exp(3 ln y), NaN for y < 0: y³ as y² · y.
        let z = ((y.sqr()? * &y)? - 0.2)?;
        keep(z);
        Ok(())
    })?;
    let gbps = 32.0 * n as f64 / (s.median_ms * 1e-3) / 1e9;
    ctx.emit(
        "candle",
        "W3 elementwise 1e8",
        "y = x**2 - 0.5; z = y**3 - 0.2 (y**3 as y.sqr() * y)",
        &s,
        &[("n", n.to_string()), ("GBps_effective", format!("{gbps:.4}"))],
    );
    Ok(())
}

fn w4(ctx: &Ctx) -> Res<()> {
    let dev = Device::Cpu;
    let iters = if ctx.quick { 1000 } else { 10_000 };
    let b = Tensor::ones(1, DType::F32, &dev)?;
    let mut last = None;
    let s = ctx.measure(1, ctx.runs(7), || {
        let mut a = Tensor::zeros(1, DType::F32, &dev)?;
        for _ in 0..iters {
            a = (&a + &b)?;
        }
        last = Some(a);
        Ok(())
    })?;
    if let Some(a) = last {
        let v = a.to_vec1::<f32>()?[0];
        if v != iters as f32 {
            return Err(format!("W4 computed {v}, expected {iters}").into());
        }
    }
    ctx.emit(
        "candle",
        &format!("W4 {}k scalar adds", iters / 1000),
        "a = a + b (shape (1,))",
        &s,
        &[("iters", iters.to_string()), ("us_per_op", format!("{:.5}", s.median_ms * 1e3 / iters as f64))],
    );
    Ok(())
}

/// SplitMix64: the shuffles of W5 (kiln shuffles on the host too).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A random permutation of 0..n (Fisher–Yates).
    fn permutation(&mut self, n: usize) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            p.swap(i, j);
        }
        p
    }
}

/// Linear regression from scratch with autograd, as kiln's `linreg_scratch`: minibatch SGD
/// on (w, b) for `epochs` epochs, the batches drawn from a fresh permutation each epoch.
fn linreg(features: &Tensor, labels: &Tensor, batch: usize, lr: f64, epochs: usize, seed: u64) -> Res<(Var, Var)> {
    let dev = features.device();
    let n = features.dims()[0];
    let mut rng = Rng(seed);
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.01, (2, 1), dev)?)?;
    let b = Var::zeros(1, DType::F32, dev)?;
    for _ in 0..epochs {
        let perm = Tensor::from_vec(rng.permutation(n), n, dev)?;
        let mut start = 0;
        while start < n {
            let len = batch.min(n - start);
            let ids = perm.narrow(0, start, len)?;
            let x = features.index_select(&ids, 0)?;
            let y = labels.index_select(&ids, 0)?;
            let loss = (x.matmul(w.as_tensor())?.broadcast_add(b.as_tensor())? - &y)?.sqr()?.mean_all()?;
            // candle returns fresh gradients from each backward: nothing to zero.
            let grads = loss.backward()?;
            for p in [&w, &b] {
                if let Some(g) = grads.get(p.as_tensor()) {
                    p.set(&(p.as_tensor() - (g * lr)?)?)?;
                }
            }
            start += len;
        }
    }
    Ok((w, b))
}

fn w5(ctx: &Ctx) -> Res<()> {
    let dev = Device::Cpu;
    let (n, batch, lr) = (1000, 32, 0.03);
    let epochs = if ctx.quick { 2 } else { 10 };
    let true_w = Tensor::new(&[[2f32], [-3.4]], &dev)?;
    let features = Tensor::randn(0f32, 1.0, (n, 2), &dev)?;
    let noise = Tensor::randn(0f32, 0.01, (n, 1), &dev)?;
    let labels = ((features.matmul(&true_w)? + 4.2)? + &noise)?;
    let mut seed = 42u64;
    let mut last = None;
    let s = ctx.measure(1, ctx.runs(7), || {
        seed += 1;
        last = Some(linreg(&features, &labels, batch, lr, epochs, seed)?);
        Ok(())
    })?;
    let mut extra = vec![("epochs", epochs.to_string())];
    if let Some((w, b)) = last {
        let w = w.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        let b = b.as_tensor().to_vec1::<f32>()?;
        extra.push(("w", format!("[{:.4},{:.4}]", w[0], w[1])));
        extra.push(("b", format!("{:.4}", b[0])));
        if (w[0] - 2.0).abs() > 0.1 || (w[1] + 3.4).abs() > 0.1 || (b[0] - 4.2).abs() > 0.1 {
            return Err(format!("W5 did not converge: w = {w:?}, b = {}", b[0]).into());
        }
    }
    ctx.emit(
        "candle",
        "W5 linreg train",
        "Var + backward + manual SGD (ms per epoch)",
        &s.per(epochs),
        &extra.iter().map(|(k, v)| (*k, v.clone())).collect::<Vec<_>>(),
    );
    Ok(())
}

/// A convolution workload: key, name, then batch, in, out, size, kernel, padding.
type ConvWorkload = (&'static str, &'static str, usize, usize, usize, usize, usize, usize);

/// The convolution workloads of issue 19 (f32, no bias). The names are the ones
/// `bench_conv` and the PyTorch peer print.
const CONVS: [ConvWorkload; 6] = [
    ("c1", "C1 LeNet conv 1->6 5x5 pad 2, 28x28, batch 256", 256, 1, 6, 28, 5, 2),
    ("c2", "C2 LeNet conv 6->16 5x5, 14x14, batch 256", 256, 6, 16, 14, 5, 0),
    ("c3", "C3 ResNet 64->64 3x3 pad 1, 56x56, batch 32", 32, 64, 64, 56, 3, 1),
    ("c4", "C4 ResNet 128->128 3x3 pad 1, 28x28, batch 32", 32, 128, 128, 28, 3, 1),
    ("c5", "C5 ResNet 256->256 3x3 pad 1, 14x14, batch 32", 32, 256, 256, 14, 3, 1),
    ("c6", "C6 candle#3119 3->16 3x3, 320x320, batch 2", 2, 3, 16, 320, 3, 0),
];

/// conv2d forward, and forward + backward (input and weight gradients of the sum of the
/// output, which is PyTorch's `y.backward(ones_like(y))`).
fn conv(ctx: &Ctx, key: &str) -> Res<()> {
    let dev = Device::Cpu;
    let Some(&(_, name, n, ic, oc, hw, k, pad)) = CONVS.iter().find(|c| c.0 == key) else {
        return Err(format!("no convolution workload {key}").into());
    };
    let x = Tensor::rand(-1f32, 1f32, (n, ic, hw, hw), &dev)?;
    let w = Tensor::rand(-1f32, 1f32, (oc, ic, k, k), &dev)?;
    let out = (hw + 2 * pad - k + 1) as f64;
    let gflop = 2.0 * (n * oc * ic * k * k) as f64 * out * out / 1e9;
    let s = ctx.measure(1, ctx.runs(7), || {
        keep(x.conv2d(&w, pad, 1, 1, 1)?);
        Ok(())
    })?;
    ctx.emit("candle", name, "fwd", &s, &[("gflops", format!("{:.3}", gflop / (s.median_ms * 1e-3)))]);
    let (xv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
    let s = ctx.measure(1, ctx.runs(7), || {
        let y = xv.as_tensor().conv2d(wv.as_tensor(), pad, 1, 1, 1)?;
        let grads = y.sum_all()?.backward()?;
        keep((grads.get(xv.as_tensor()).is_some(), grads.get(wv.as_tensor()).is_some()));
        Ok(())
    })?;
    ctx.emit("candle", name, "fwd+bwd", &s, &[("gflops", format!("{:.3}", 3.0 * gflop / (s.median_ms * 1e-3)))]);
    Ok(())
}

/// This core's f32 FMA peak: independent chains of vector FMAs, as wide as the CPU allows.
fn peak(ctx: &Ctx) -> Res<()> {
    #[cfg(target_arch = "x86_64")]
    {
        let iters: u64 = if ctx.quick { 2_000_000 } else { 20_000_000 };
        let (width, name, f): (u64, &str, fn(u64) -> f32) = if std::arch::is_x86_feature_detected!("avx512f") {
            (16, "AVX-512 vfmadd, 12 chains", |n| unsafe { fma::avx512(n) })
        } else if std::arch::is_x86_feature_detected!("fma") {
            (8, "AVX2 vfmadd, 12 chains", |n| unsafe { fma::avx2(n) })
        } else {
            return Err("peak: this CPU has no FMA".into());
        };
        let s = ctx.measure(1, ctx.runs(7), || {
            keep(f(keep(iters)));
            Ok(())
        })?;
        let flops = iters as f64 * 12.0 * width as f64 * 2.0;
        let gflops = flops / (s.median_ms * 1e-3) / 1e9;
        ctx.emit("machine", "peak f32 FMA, 1 thread", name, &s, &[("gflops", format!("{gflops:.3}"))]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ctx;
        eprintln!("candle-peer: peak is measured on x86_64 only");
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512(iters: u64) -> f32 {
        let m = _mm512_set1_ps(0.999_999);
        let a = _mm512_set1_ps(1e-7);
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, m, a);
            }
        }
        let mut s = acc[0];
        for v in &acc[1..] {
            s = _mm512_add_ps(s, *v);
        }
        _mm512_reduce_add_ps(s)
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2(iters: u64) -> f32 {
        let m = _mm256_set1_ps(0.999_999);
        let a = _mm256_set1_ps(1e-7);
        let mut acc = [_mm256_set1_ps(1.0); 12];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, m, a);
            }
        }
        let mut s = acc[0];
        for v in &acc[1..] {
            s = _mm256_add_ps(s, *v);
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }
}

fn main() {
    let mut ctx = Ctx { quick: false, runs: None, threads: candle_core::utils::get_num_threads() };
    let mut which = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => ctx.quick = true,
            "--runs" => match args.next().and_then(|v| v.parse::<usize>().ok()).filter(|&r| r > 0) {
                Some(r) => ctx.runs = Some(r),
                None => fail("--runs takes a positive count"),
            },
            "-h" | "--help" => {
                println!("candle-peer [--quick] [--runs N] [w1 w2 w3 w4 w5 c1 c2 c3 c4 c5 c6 peak]");
                return;
            }
            w if ["w1", "w2", "w3", "w4", "w5", "peak"].contains(&w.to_ascii_lowercase().as_str())
                || CONVS.iter().any(|c| c.0 == w.to_ascii_lowercase()) =>
            {
                which.push(w.to_ascii_lowercase())
            }
            other => fail(&format!("unknown argument `{other}`; workloads are w1 w2 w3 w4 w5 c1 c2 c3 c4 c5 c6 peak")),
        }
    }
    if which.is_empty() {
        which = ["w1", "w2", "w3", "w4", "w5"].map(String::from).to_vec();
    }
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = false;
    println!(
        "{{\"lib\":\"candle\",\"candle\":\"{CANDLE}\",\"gemm\":\"0.19.0 x86-v4\",\"avx512f\":{avx512},\"threads\":{},\"quick\":{}}}",
        ctx.threads, ctx.quick
    );
    for w in &which {
        let r = match w.as_str() {
            "w1" => w1(&ctx),
            "w2" => w2(&ctx),
            "w3" => w3(&ctx),
            "w4" => w4(&ctx),
            "w5" => w5(&ctx),
            "peak" => peak(&ctx),
            c => conv(&ctx, c),
        };
        if let Err(e) = r {
            fail(&format!("{w} failed: {e}"));
        }
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("candle-peer: {msg}");
    std::process::exit(2)
}
