//! The launch census (`KILN_CUDASIM_CENSUS=1`, `src/census.rs`) through the
//! simulator's C API: each GPU thread's work in basic blocks grows with the
//! loop it runs, shrinks as a grid-stride loop gets more threads, adds up
//! across `__syncthreads()`, names the thread that did the most, is the same
//! on every run; `arg_bytes` counts the allocations the arguments reach; a
//! cuBLAS gemm is recorded with its multiply-adds; a buffer too small for
//! the records leaves them in place; and without the variable nothing is
//! recorded. Each scenario runs in a child process of this test binary (the
//! simulator reads its environment once per process), so the variable never
//! reaches another test binary's simulator.
//!
//! `census_overhead` (ignored; `cargo test -p kiln-cudasim --test census --
//! --ignored --nocapture`) times the same kernels with and without the
//! census.

mod common;

use common::{clean_env, fake_nvrtc, Sim};
use libtest_mimic::{Arguments, Trial};
use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output};
use std::time::Instant;

const SCENARIO: &str = "CUDASIM_CENSUS_SCENARIO";

const KERNELS: &str = r#"
// Each thread runs `n` steps of a serial recurrence (nothing g++ can
// vectorise or fold), so its work is about n blocks.
extern "C" __global__ void spin(unsigned int* out, int n) {
    unsigned int x = threadIdx.x;
    for (int i = 0; i < n; i++) x = x * 1664525u + 1013904223u;
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}
// Only thread `who` of block `where` runs the `n` steps.
extern "C" __global__ void one_slow(unsigned int* out, int n, unsigned int where, unsigned int who) {
    unsigned int x = threadIdx.x;
    if (blockIdx.x == where && threadIdx.x == who)
        for (int i = 0; i < n; i++) x = x * 1664525u + 1013904223u;
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}
// `n` steps before a barrier and `n` after it: two resumes per thread.
extern "C" __global__ void halves(unsigned int* out, int n) {
    unsigned int x = threadIdx.x;
    for (int i = 0; i < n; i++) x = x * 1664525u + 1013904223u;
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
    __syncthreads();
    for (int i = 0; i < n; i++) x = x * 1664525u + 1013904223u;
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}
// A grid-stride loop over `n` elements.
extern "C" __global__ void stride(float* data, unsigned long long n) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (unsigned long long)blockDim.x * gridDim.x)
        data[i] = data[i] * 2.0f + 1.0f;
}
// kiln's way: one struct of device addresses.
struct Bufs { unsigned long long dst, src, also; unsigned int n; };
extern "C" __global__ void via_struct(Bufs p) {
    if (blockIdx.x == 0 && threadIdx.x == 0) ((float*)p.dst)[0] = ((const float*)p.src)[0] + (float)p.n;
}
"#;

/// The struct `via_struct` takes.
#[repr(C)]
struct Bufs {
    dst: u64,
    src: u64,
    also: u64,
    n: u32,
}

/// One census record, parsed from its JSON line (flat, no commas in names).
#[derive(Debug, Clone)]
struct Rec {
    line: String,
}

impl Rec {
    fn raw(&self, key: &str) -> &str {
        let pat = format!("\"{key}\":");
        let at = self.line.find(&pat).unwrap_or_else(|| panic!("no {key} in {}", self.line)) + pat.len();
        let rest = &self.line[at..];
        let end = rest.find([',', '}']).unwrap();
        &rest[..end]
    }
    fn n(&self, key: &str) -> u64 {
        self.raw(key).parse().unwrap_or_else(|_| panic!("{key} is not a number in {}", self.line))
    }
    fn s(&self, key: &str) -> String {
        self.raw(key).trim_matches('"').to_string()
    }
}

fn take(sim: &Sim) -> Vec<Rec> {
    let take: unsafe extern "C" fn(*mut c_char, usize) -> usize = sim.f("kiln_cudasim_census_take");
    let len = unsafe { take(std::ptr::null_mut(), 0) };
    let mut buf = vec![0u8; len + 1];
    assert_eq!(unsafe { take(buf.as_mut_ptr() as *mut c_char, buf.len()) }, len);
    assert_eq!(buf[len], 0, "NUL-terminated when there is room");
    assert_eq!(unsafe { take(std::ptr::null_mut(), 0) }, 0, "taken");
    let text = String::from_utf8(buf[..len].to_vec()).unwrap();
    assert!(text.is_empty() || text.ends_with('\n'));
    text.lines().map(|l| Rec { line: l.to_string() }).collect()
}

fn sync(sim: &Sim) {
    let sync: unsafe extern "C" fn() -> u32 = sim.f("cuCtxSynchronize");
    assert_eq!(unsafe { sync() }, 0);
}

fn p<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

/// The one record of a launch of `kernel(out, n)` on `grid` x `block`.
fn launch_n(sim: &Sim, module: *mut c_void, kernel: &str, grid: u32, block: u32, n: c_int) -> Rec {
    let mut out = sim.upload(&vec![0u8; (grid * block) as usize * 4]);
    let mut n = n;
    sim.launch(module, kernel, grid, block, &mut [p(&mut out), p(&mut n)]);
    sync(sim);
    let recs = take(sim);
    assert_eq!(recs.len(), 1, "{recs:?}");
    let r = recs[0].clone();
    assert_eq!((r.s("kind"), r.s("name")), ("kernel".into(), kernel.into()));
    assert_eq!((r.n("grid"), r.n("block"), r.n("threads")), (grid as u64, block as u64, (grid * block) as u64));
    assert!(r.n("work_total") >= r.n("work_max") && r.n("work_max") > 0, "{}", r.line);
    assert_eq!(r.n("arg_bytes"), (grid * block) as u64 * 4, "out's allocation: {}", r.line);
    r
}

fn census(sim: &Sim) {
    let enabled: unsafe extern "C" fn() -> c_int = sim.f("kiln_cudasim_census_enabled");
    assert_eq!(unsafe { enabled() }, 1);
    sim.init().unwrap();
    let module = sim.load(&sim.nvrtc_ptx(KERNELS, &[]).unwrap()).unwrap();

    // (a) work per thread grows linearly with its loop.
    let small = launch_n(sim, module, "spin", 2, 32, 10);
    let large = launch_n(sim, module, "spin", 2, 32, 1000);
    let grown = large.n("work_max") - small.n("work_max");
    assert!((990..=3 * 990).contains(&grown), "work_max {} -> {}", small.n("work_max"), large.n("work_max"));
    assert_eq!(large.n("work_total"), 64 * large.n("work_max"), "every thread did the same");
    println!("spin: n=10 work_max {}, n=1000 work_max {}", small.n("work_max"), large.n("work_max"));
    // ... deterministically.
    let again = launch_n(sim, module, "spin", 2, 32, 1000);
    assert_eq!((again.n("work_max"), again.n("work_total")), (large.n("work_max"), large.n("work_total")));
    // ... and the record names the thread that did the most.
    let mut out = sim.upload(&[0u8; 4 * 3 * 64]);
    let (mut n, mut at_block, mut at_thread) = (1000 as c_int, 2u32, 37u32);
    sim.launch(module, "one_slow", 3, 64, &mut [p(&mut out), p(&mut n), p(&mut at_block), p(&mut at_thread)]);
    sync(sim);
    let slow = take(sim).remove(0);
    assert_eq!((slow.n("work_max_block"), slow.n("work_max_thread")), (2, 37), "{}", slow.line);
    assert!(slow.n("work_max") >= 1000 && slow.n("work_total") - slow.n("work_max") < 191 * 20, "{}", slow.line);

    // (b) a grid-stride loop over a fixed count: more threads, less each.
    let count = 4096u64;
    let mut data = sim.upload(&vec![0u8; count as usize * 4]);
    let mut last = u64::MAX;
    for (grid, block) in [(1u32, 32u32), (1, 128), (4, 128), (8, 256)] {
        let mut n = count;
        sim.launch(module, "stride", grid, block, &mut [p(&mut data), p(&mut n)]);
        sync(sim);
        let r = take(sim).remove(0);
        let per = count / (grid * block) as u64;
        println!("stride over {count} with {} threads: work_max {} ({per} elements each)", grid * block, r.n("work_max"));
        assert!(r.n("work_max") < last && r.n("work_max") >= per, "{}", r.line);
        last = r.n("work_max");
    }

    // (c) a thread resumed after __syncthreads() keeps counting.
    let split = launch_n(sim, module, "halves", 2, 64, 500);
    let whole = launch_n(sim, module, "spin", 2, 64, 1000);
    let (s, w) = (split.n("work_max"), whole.n("work_max"));
    println!("halves n=500: work_max {s}; spin n=1000: work_max {w}");
    assert!(s >= 1000 && s.abs_diff(w) <= 50, "both halves count: {s} against {w}");

    // arg_bytes: the allocations the argument words reach, each once, a
    // pointer into the middle of one included.
    let (dst, src) = (sim.upload(&[0u8; 1000]), sim.upload(&[0u8; 4096]));
    let mut bufs = Bufs { dst, src: src + 100, also: dst + 8, n: 7 };
    sim.launch(module, "via_struct", 1, 1, &mut [p(&mut bufs)]);
    sync(sim);
    let r = take(sim).remove(0);
    assert_eq!((r.s("name").as_str(), r.n("arg_bytes")), ("via_struct", 1000 + 4096), "{}", r.line);

    // (d) a gemm: m·n·k·batch multiply-adds.
    gemm(sim);

    // (e) too small a buffer: nothing written, nothing lost.
    let take_fn: unsafe extern "C" fn(*mut c_char, usize) -> usize = sim.f("kiln_cudasim_census_take");
    let mut out = sim.upload(&[0u8; 4 * 32]);
    let mut n: c_int = 3;
    for _ in 0..2 {
        sim.launch(module, "spin", 1, 32, &mut [p(&mut out), p(&mut n)]);
    }
    sync(sim);
    let len = unsafe { take_fn(std::ptr::null_mut(), 0) };
    let mut short = vec![0xAAu8; len - 1];
    assert_eq!(unsafe { take_fn(short.as_mut_ptr() as *mut c_char, short.len()) }, len);
    assert!(short.iter().all(|&b| b == 0xAA), "nothing written");
    assert_eq!(unsafe { take_fn(std::ptr::null_mut(), 0) }, len, "nothing lost");
    let mut exact = vec![0xAAu8; len];
    assert_eq!(unsafe { take_fn(exact.as_mut_ptr() as *mut c_char, len) }, len);
    let text = String::from_utf8(exact).unwrap();
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(text.lines().all(|l| l.starts_with("{\"kind\":\"kernel\",\"device\":0,\"name\":\"spin\",")), "{text}");
    assert_eq!(unsafe { take_fn(std::ptr::null_mut(), 0) }, 0);
}

/// A strided-batched SGEMM (m=4, n=5, k=6, batch 3) and its record.
fn gemm(sim: &Sim) {
    type Sgemm = unsafe extern "C" fn(
        *mut c_void,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        *const f32,
        u64,
        c_int,
        i64,
        u64,
        c_int,
        i64,
        *const f32,
        u64,
        c_int,
        i64,
        c_int,
    ) -> u32;
    let create: unsafe extern "C" fn(*mut *mut c_void) -> u32 = sim.f("cublasCreate_v2");
    let sgemm: Sgemm = sim.f("cublasSgemmStridedBatched");
    let (m, n, k, batch) = (4, 5, 6, 3);
    let a = sim.upload(&vec![0u8; 4 * (m * k * batch) as usize]);
    let b = sim.upload(&vec![0u8; 4 * (k * n * batch) as usize]);
    let c = sim.upload(&vec![0u8; 4 * (m * n * batch) as usize]);
    let mut h = std::ptr::null_mut();
    assert_eq!(unsafe { create(&mut h) }, 0);
    let (alpha, beta) = (1f32, 0f32);
    let r = unsafe { sgemm(h, 0, 0, m, n, k, &alpha, a, m, (m * k) as i64, b, k, (k * n) as i64, &beta, c, m, (m * n) as i64, batch) };
    assert_eq!(r, 0);
    sync(sim);
    let recs = take(sim);
    assert_eq!(recs.len(), 1, "{recs:?}");
    let g = &recs[0];
    println!("{}", g.line);
    assert_eq!((g.s("kind"), g.s("name")), ("gemm".into(), "cublas:gemm_f32".into()));
    assert_eq!((g.n("m"), g.n("n"), g.n("k"), g.n("batch"), g.n("macs")), (4, 5, 6, 3, 4 * 5 * 6 * 3));
    assert_eq!((g.n("threads"), g.n("work_total"), g.n("work_max")), (0, 0, 0));
    assert_eq!(g.n("arg_bytes"), 4 * (4 * 6 + 6 * 5 + 4 * 5) * 3, "A, B and C");
}

/// (f) Without the variable: nothing is recorded, and the module the
/// census built (in the same cache folder, before) is not used: it is
/// compiled again, uninstrumented.
fn off(sim: &Sim) {
    let enabled: unsafe extern "C" fn() -> c_int = sim.f("kiln_cudasim_census_enabled");
    assert_eq!(unsafe { enabled() }, 0);
    sim.init().unwrap();
    let module = sim.load(&sim.nvrtc_ptx(KERNELS, &[]).unwrap()).unwrap();
    assert_eq!((sim.stat("host_compiles"), sim.stat("host_cache_hits")), (1, 0), "the instrumented library is not reused");
    let mut out = sim.upload(&[0u8; 4 * 64]);
    let mut n: c_int = 100;
    sim.launch(module, "spin", 2, 32, &mut [p(&mut out), p(&mut n)]);
    sync(sim);
    let take_fn: unsafe extern "C" fn(*mut c_char, usize) -> usize = sim.f("kiln_cudasim_census_take");
    assert_eq!(unsafe { take_fn(std::ptr::null_mut(), 0) }, 0);
    assert!(take(sim).is_empty());
}

/// Times a few kernels (best of 3), census on or off as the process is.
fn overhead(sim: &Sim) {
    sim.init().unwrap();
    let module = sim.load(&sim.nvrtc_ptx(KERNELS, &[]).unwrap()).unwrap();
    let best = |f: &dyn Fn()| {
        f();
        (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min)
    };
    let count = 1u64 << 22;
    let data = sim.upload(&vec![0u8; count as usize * 4]);
    let out = sim.upload(&vec![0u8; 4 * 256 * 64]);
    let stride_ms = best(&|| {
        let (mut d, mut n) = (data, count);
        sim.launch(module, "stride", 64, 256, &mut [p(&mut d), p(&mut n)]);
        sync(sim);
    });
    let spin_ms = best(&|| {
        let (mut o, mut n) = (out, 20_000 as c_int);
        sim.launch(module, "spin", 64, 256, &mut [p(&mut o), p(&mut n)]);
        sync(sim);
    });
    let short_ms = best(&|| {
        let (mut o, mut n) = (out, 1 as c_int);
        sim.launch(module, "spin", 64, 256, &mut [p(&mut o), p(&mut n)]);
        sync(sim);
    });
    println!("TIMES stride={stride_ms:.2} spin={spin_ms:.2} short={short_ms:.2}");
}

fn main() -> ExitCode {
    if let Ok(scenario) = std::env::var(SCENARIO) {
        let sim = Sim::open();
        match scenario.as_str() {
            "census" => census(&sim),
            "off" => off(&sim),
            "load" => {
                // The census's module, compiled into the cache folder.
                sim.init().unwrap();
                sim.load(&sim.nvrtc_ptx(KERNELS, &[]).unwrap()).unwrap();
                assert_eq!(sim.stat("host_compiles"), 1);
            }
            "overhead" => overhead(&sim),
            other => panic!("unknown scenario {other}"),
        }
        println!("SCENARIO-OK");
        return ExitCode::SUCCESS;
    }
    let trials = vec![
        Trial::test("the_census_counts_each_threads_work_and_each_gemms_macs", || {
            let dir = scratch("census");
            let nvrtc = fake_nvrtc(&dir);
            println!("{}", succeeded(&child("census", true, &[("KILN_CUDASIM_NVRTC", &nvrtc), ("KILN_CUDASIM_CACHE", &dir)]), "census"));
            Ok(())
        }),
        Trial::test("without_kiln_cudasim_census_nothing_is_recorded", || {
            let dir = scratch("off");
            let nvrtc = fake_nvrtc(&dir);
            let env = [("KILN_CUDASIM_NVRTC", nvrtc.as_path()), ("KILN_CUDASIM_CACHE", &dir)];
            succeeded(&child("load", true, &env), "loading with the census");
            succeeded(&child("off", false, &env), "census off");
            Ok(())
        }),
        Trial::test("census_overhead", || {
            let dir = scratch("overhead");
            let nvrtc = fake_nvrtc(&dir);
            let env = [("KILN_CUDASIM_NVRTC", nvrtc.as_path()), ("KILN_CUDASIM_CACHE", &dir)];
            let times = |census: bool| -> Vec<f64> {
                let text = succeeded(&child("overhead", census, &env), "overhead");
                let line = text.lines().find(|l| l.starts_with("TIMES ")).unwrap().to_string();
                line.split_whitespace().skip(1).map(|kv| kv.split('=').nth(1).unwrap().parse().unwrap()).collect()
            };
            let (plain, counted) = (times(false), times(true));
            for (i, what) in ["stride (4M elements, 16384 threads)", "spin (20000 steps, 16384 threads)", "spin (1 step, 16384 threads)"]
                .iter()
                .enumerate()
            {
                println!("{what}: {:.1} ms plain, {:.1} ms counted: x{:.2}", plain[i], counted[i], counted[i] / plain[i]);
            }
            Ok(())
        })
        .with_ignored_flag(true),
    ];
    libtest_mimic::run(&Arguments::from_args(), trials).exit_code()
}

/// A scratch folder of this test, emptied.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cudasim-census").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `scenario` in a child process of this test binary, with the census
/// on or off.
fn child(scenario: &str, census: bool, env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(SCENARIO, scenario).env("KILN_CUDASIM", "1");
    clean_env(&mut cmd);
    if census {
        cmd.env("KILN_CUDASIM_CENSUS", "1");
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn succeeded(out: &Output, what: &str) -> String {
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("SCENARIO-OK"), "{what} failed:\n{text}");
    text
}
