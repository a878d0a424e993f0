//! Helpers shared by kiln's integration tests: the devices every test runs
//! on, simulated GPUs a test binary owns alone, and assertions that name the
//! device when they fail.
#![allow(dead_code)]

pub mod rng;

use kiln::{Device, DeviceKind, Tensor};
use std::sync::OnceLock;

/// Capacity of the two shared simulated GPUs.
pub const SIM_CAPACITY: usize = 512 << 20;

/// The two simulated GPUs every suite runs on (created when the process has
/// fewer, whatever `KILN_SIM_GPUS` says).
pub fn sims() -> Vec<Device> {
    kiln::ensure_simulated_gpus(2, SIM_CAPACITY)
}

/// Every real CUDA device of this machine (none without a GPU). With
/// `KILN_REQUIRE_CUDA` set to 1 or more, having none is a failure: every suite that runs on
/// CUDA devices asks here.
pub fn cuda_devices() -> Vec<Device> {
    let found: Vec<Device> = kiln::devices().into_iter().filter(|d| d.kind == DeviceKind::Cuda).map(|d| d.device).collect();
    if found.is_empty() && cuda_required() {
        panic!("KILN_REQUIRE_CUDA is set but there is no CUDA device: {}", why_no_cuda());
    }
    found
}

/// The devices a conformance test runs on: the CPU, two simulated GPUs, and
/// every CUDA device when there is one.
pub fn devices() -> Vec<Device> {
    let sims = sims();
    let mut all = vec![kiln::cpu()];
    all.extend(sims);
    all.extend(cuda_devices());
    all
}

/// `n` simulated GPUs that only this test binary uses, created after any that
/// exist (from `KILN_SIM_GPUS` or elsewhere), each with `capacity` bytes.
/// The first call of a binary decides `n` and `capacity`: later calls must
/// pass the same values. Use it in binaries that measure memory exactly, and
/// give each test its own slot, since tests of a binary run concurrently.
pub fn own_sims(n: usize, capacity: usize) -> &'static [Device] {
    static OWN: OnceLock<(usize, usize, Vec<Device>)> = OnceLock::new();
    let (count, cap, list) = OWN.get_or_init(|| {
        // Added in one step under the registry's lock: counting the existing
        // ones first raced with tests making theirs.
        (n, capacity, kiln::add_simulated_gpus(n, capacity).expect("room for this binary's own simulated GPUs"))
    });
    assert_eq!((*count, *cap), (n, capacity), "own_sims must be called with the same arguments in one binary");
    list
}

/// The lines of `file` (the caller's `file!()`) at which `diff` booked
/// transfers, sorted, each once; a transfer booked in another file fails.
pub fn booked_lines(diff: &kiln::TransferStats, file: &str) -> Vec<u32> {
    let mut out: Vec<u32> = diff
        .by_site
        .keys()
        .map(|(s, _)| {
            let rest = s.strip_prefix(&format!("{file}:")).unwrap_or_else(|| panic!("a transfer booked outside {file}: {s}"));
            rest.split(':').next().and_then(|l| l.parse().ok()).unwrap_or_else(|| panic!("no line in {s}"))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Transfers in `direction` that this thread booked since `before` at line
/// `line` of `file` (the caller's `file!()`).
pub fn booked_at(before: &kiln::TransferStats, file: &str, line: u32, direction: kiln::Direction) -> u64 {
    let site = format!("{file}:{line}:");
    kiln::thread_transfer_stats()
        .since(before)
        .by_site
        .iter()
        .filter(|((s, d), _)| s.starts_with(&site) && *d == direction)
        .map(|(_, c)| c.count)
        .sum()
}

/// Runs `f` on a thread of its own and fails the test if it is not done
/// after `secs` seconds, so that a hang or a deadlock fails the test with
/// `what` instead of hanging the suite.
pub fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{what}: not done after {secs} s (a hang or a deadlock)"),
        // Its thread panicked (the panic message is printed above).
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

/// One test at a time among the tests of a binary that take it (each test
/// binary compiles this module, so each has a lock of its own): for tests
/// that measure something the whole process shares, such as CPU memory.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on every device, failing with the device's name and the error.
pub fn on_every_device(f: impl Fn(Device) -> kiln::Result<()>) {
    for d in devices() {
        if let Err(e) = f(d) {
            panic!("on {d}: {e}");
        }
        report_ran(d);
    }
}

/// The f32 elements of `t`, checking on the way that it lives on `device`.
#[track_caller]
pub fn f32s(t: &Tensor, device: Device) -> Vec<f32> {
    assert_eq!(t.device(), device, "result of an op on {device} landed on {}", t.device());
    t.to_vec::<f32>().unwrap_or_else(|e| panic!("reading a tensor on {device}: {e}"))
}

/// Asserts shape, device and exact f32 values.
#[track_caller]
pub fn assert_f32(t: &Tensor, device: Device, dims: &[usize], expected: &[f32]) {
    assert_eq!(t.dims(), dims, "shape on {device}");
    assert_eq!(t.dtype(), kiln::DType::F32, "dtype on {device}");
    assert_eq!(f32s(t, device), expected, "values on {device}");
}

/// Asserts shape, device and exact values of any dtype, compared as f64.
#[track_caller]
pub fn assert_values(t: &Tensor, device: Device, dims: &[usize], expected: &[f64]) {
    assert_eq!(t.device(), device, "device of result");
    assert_eq!(t.dims(), dims, "shape on {device}");
    let got = t.to_vec_f64().unwrap_or_else(|e| panic!("reading a tensor on {device}: {e}"));
    assert_eq!(got, expected, "values on {device}");
}

/// Asserts that every value is within `tol` (relative to max(1, |expected|)).
#[track_caller]
pub fn assert_close(got: &[f32], expected: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths differ");
    for (i, (&g, &e)) in got.iter().zip(expected).enumerate() {
        let err = (g as f64 - e).abs() / e.abs().max(1.0);
        assert!(err <= tol, "{what}: element {i} is {g}, expected {e} (relative error {err:e} > {tol:e})");
    }
}

// ---- reporting: what ran on CUDA, what was skipped and why ------------------

thread_local! {
    /// The test running on this thread, set by [`trial`] (libtest-mimic's
    /// worker threads are not named after their tests).
    static RUNNING: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// The running test's name (set by [`trial`]; under libtest, the name of the
/// thread, which libtest names after the test).
pub fn test_name() -> String {
    RUNNING.with(|r| r.borrow().clone()).unwrap_or_else(|| std::thread::current().name().unwrap_or("?").to_string())
}

/// Appends `line` to the report file in one `write`: tests run on several
/// threads (and binaries), and `writeln!` on a file writes the text and its
/// newline in separate calls, so two tests' lines could interleave into one
/// that CI's count then missed.
fn report_line(line: &str) {
    if let Ok(path) = std::env::var("KILN_TEST_REPORT") {
        append_line(std::path::Path::new(&path), line);
    }
}

/// Appends `line` and a newline to the file at `path` in one `write`.
pub fn append_line(path: &std::path::Path, line: &str) {
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

/// Whether `device` is a CUDA device.
pub fn is_cuda(device: Device) -> bool {
    kiln::devices().iter().any(|i| i.device == device && i.kind == DeviceKind::Cuda)
}

/// Whether `device` is a CUDA device of the CUDA simulator (scripts/cudasim.sh).
pub fn is_simulated_cuda(device: Device) -> bool {
    kiln::devices().iter().any(|i| i.device == device && i.kind == DeviceKind::Cuda && i.name.starts_with("kiln cudasim"))
}

/// The test binary's name without its hash (`cuda` for `cuda-0123abcd...`).
pub fn suite_name() -> String {
    let exe = std::env::current_exe().ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_default();
    match exe.rsplit_once('-') {
        Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
        _ => exe,
    }
}

/// Books that the running test ran on `device` when it is a CUDA device:
/// `RAN-CUDA device test suite` in the file `KILN_TEST_REPORT` names, where
/// CI counts these lines.
pub fn report_ran(device: Device) {
    if is_cuda(device) {
        report_line(&format!("RAN-CUDA {device} {} {}", test_name(), suite_name()));
    }
}

/// Why this machine has no CUDA device.
pub fn why_no_cuda() -> String {
    kiln::why_no_cuda_device().map(|w| w.to_string()).unwrap_or_else(|| "there is one".into())
}

/// Whether `KILN_REQUIRE_CUDA` is 1 or more (CI on the CUDA simulator sets
/// 2): then a test that would run on CUDA devices fails when there is none,
/// instead of running on the others only or being skipped.
pub fn cuda_required() -> bool {
    cuda_devices_required() >= 1
}

/// How many CUDA devices `KILN_REQUIRE_CUDA=N` requires (0 when unset): a
/// test that needs more devices than the machine has fails when it needs at
/// most N, and is skipped otherwise (a one-GPU machine runs with
/// `KILN_REQUIRE_CUDA=1`, and skips the two-device tests with their reason).
pub fn cuda_devices_required() -> usize {
    std::env::var("KILN_REQUIRE_CUDA").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Whether the environment variable `var` is `1`.
pub fn required(var: &str) -> bool {
    std::env::var(var).map(|v| v == "1").unwrap_or(false)
}

/// Why a test did not run. A test of a `harness = false` suite returns it
/// (as [`Ran`]); [`trial`] reports the test `ignored (reason)`, never passed.
#[derive(Debug)]
pub struct Skip(pub String);

/// What a test that may not be able to run returns.
pub type Ran = std::result::Result<(), Skip>;

/// A skip of the running test: `SKIPPED: test: reason` goes to the report
/// (`KILN_TEST_REPORT`) and the returned [`Skip`] to the harness.
pub fn skip(reason: impl Into<String>) -> Skip {
    let reason = reason.into();
    report_line(&format!("SKIPPED: {}: {reason}", test_name()));
    Skip(reason)
}

/// A skip for want of a CUDA device, or a failure when one is required
/// ([`cuda_required`]).
pub fn skip_no_cuda(reason: impl Into<String>) -> Skip {
    skip_too_few_cuda(1, reason)
}

/// A skip for want of `need` CUDA devices, or a failure when
/// `KILN_REQUIRE_CUDA` requires at least that many.
pub fn skip_too_few_cuda(need: usize, reason: impl Into<String>) -> Skip {
    let reason = reason.into();
    let required = cuda_devices_required();
    if required >= need {
        panic!("KILN_REQUIRE_CUDA={required} but {}: {reason}", test_name());
    }
    skip(reason)
}

/// What a test function of a `harness = false` suite may return.
pub trait Outcome {
    /// None when the test ran, else why it did not.
    fn skipped(self) -> Option<String>;
}

impl Outcome for () {
    fn skipped(self) -> Option<String> {
        None
    }
}

impl Outcome for Ran {
    fn skipped(self) -> Option<String> {
        self.err().map(|s| s.0)
    }
}

/// One test of a `harness = false` suite (libtest-mimic): a panic fails it,
/// a returned [`Skip`] reports it `ignored (reason)`.
pub fn trial<O: Outcome + 'static>(name: &'static str, test: fn() -> O) -> libtest_mimic::Trial {
    libtest_mimic::Trial::ignorable_test(name, move || {
        RUNNING.with(|r| *r.borrow_mut() = Some(name.to_string()));
        let outcome = std::panic::catch_unwind(test);
        RUNNING.with(|r| *r.borrow_mut() = None);
        match outcome {
            Ok(o) => Ok(match o.skipped() {
                None => libtest_mimic::Completion::Completed,
                Some(why) => libtest_mimic::Completion::ignored_with(why),
            }),
            Err(payload) => std::panic::resume_unwind(payload),
        }
    })
}

/// Runs a `harness = false` suite with libtest's command line (filters,
/// `--exact`, `--list`, `--ignored`, `--test-threads`).
pub fn run_suite(trials: Vec<libtest_mimic::Trial>) -> std::process::ExitCode {
    libtest_mimic::run(&libtest_mimic::Arguments::from_args(), trials).exit_code()
}

/// `(line!(), expr)`: the line an expression is on, for
/// [`booked_at`] (a test that books transfers at that line).
#[allow(unused_macros)]
macro_rules! at_line {
    ($e:expr) => {
        (line!(), $e)
    };
}

/// The trials of the named test functions: `common::run_suite(trials![a, b])`.
#[allow(unused_macros)]
macro_rules! trials {
    ($($test:ident),* $(,)?) => {
        vec![$(common::trial(stringify!($test), $test)),*]
    };
}

/// Runs this test binary again as a child process that runs only the
/// running test, with `env` set (for settings read once per process, such as
/// the CUDA simulator's); `KILN_TEST_CHILD` tells the child it is one.
/// Returns the child's stdout and stderr, failing unless it succeeded and
/// printed `CHILD-OK`.
pub fn run_child(env: &[(&str, &str)]) -> String {
    let name = test_name();
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args(["--exact", name.as_str(), "--nocapture", "--test-threads=1"]).env("KILN_TEST_CHILD", &name).env_remove("KILN_TEST_REPORT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the test binary runs again");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let settings: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    assert!(out.status.success() && text.contains("CHILD-OK"), "{name} as a child with {}:\n{text}", settings.join(" "));
    text
}

/// Whether this process is the child [`run_child`] started for the running test.
pub fn is_child() -> bool {
    std::env::var("KILN_TEST_CHILD").map(|v| v == test_name()).unwrap_or(false)
}

/// Ulps by which a device's transcendental functions (exp, log, sin, cos,
/// tanh, pow) may differ from the CPU's (glibc): 0 on the CPU and the
/// simulated GPUs, which run the same code; 2 on CUDA, whose libdevice
/// double functions have a maximum error of 1 ulp (exp, log) to 2 ulps (cos,
/// pow) (CUDA C++ Programming Guide, "Mathematical Functions"). `randn`
/// combines log, sqrt and cos: it gets 4 times that.
pub fn transcendental_ulps(device: Device) -> u64 {
    if is_cuda(device) {
        2
    } else {
        0
    }
}

/// Distance in ulps between two finite f64 of the same sign (else u64::MAX).
pub fn ulps64(a: f64, b: f64) -> u64 {
    if a == b {
        return 0;
    }
    if a.is_nan() || b.is_nan() || a.is_sign_negative() != b.is_sign_negative() {
        return u64::MAX;
    }
    a.to_bits().abs_diff(b.to_bits())
}

/// Asserts that f64 values agree within `ulps`.
#[track_caller]
pub fn assert_ulps(got: &[f64], expected: &[f64], ulps: u64, what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths differ");
    for (i, (&g, &e)) in got.iter().zip(expected).enumerate() {
        assert!(ulps64(g, e) <= ulps, "{what}: element {i} is {g:e}, expected {e:e} (more than {ulps} ulps apart)");
    }
}
