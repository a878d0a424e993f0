//! Helpers shared by kiln's integration tests: the devices every test runs
//! on, simulated GPUs a test binary owns alone, and assertions that name the
//! device when they fail.
#![allow(dead_code)]

use kiln::{Device, DeviceKind, Tensor};
use std::sync::OnceLock;

/// Capacity of the two shared simulated GPUs.
pub const SIM_CAPACITY: usize = 512 << 20;

/// The two simulated GPUs every suite runs on (created when the process has
/// fewer, whatever `KILN_SIM_GPUS` says).
pub fn sims() -> Vec<Device> {
    kiln::ensure_simulated_gpus(2, SIM_CAPACITY)
}

/// Every real CUDA device of this machine (none without a GPU).
pub fn cuda_devices() -> Vec<Device> {
    kiln::devices().into_iter().filter(|d| d.kind == DeviceKind::Cuda).map(|d| d.device).collect()
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
        let existing = kiln::devices().iter().filter(|d| d.kind == DeviceKind::Simulated).count();
        let all = kiln::ensure_simulated_gpus(existing + n, capacity);
        (n, capacity, all[existing..].to_vec())
    });
    assert_eq!((*count, *cap), (n, capacity), "own_sims must be called with the same arguments in one binary");
    list
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

/// The running test's name (libtest names each test's thread after it).
pub fn test_name() -> String {
    std::thread::current().name().unwrap_or("?").to_string()
}

fn report_line(line: &str) {
    if let Ok(path) = std::env::var("KILN_TEST_REPORT") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// Books that the running test ran on `device` when it is a CUDA device
/// (`KILN_TEST_REPORT` names the file CI counts these lines in).
pub fn report_ran(device: Device) {
    if kiln::devices().iter().any(|i| i.device == device && i.kind == DeviceKind::Cuda) {
        report_line(&format!("RAN-CUDA {device} {}", test_name()));
    }
}

/// Reports a test (or part of one) that did not run: `SKIPPED: test: reason`
/// on stderr and in the report. With `KILN_REQUIRE_CUDA=1` (CI on the CUDA
/// simulator) a skip for want of a CUDA device is a failure instead.
pub fn skip(reason: &str) {
    let line = format!("SKIPPED: {}: {reason}", test_name());
    eprintln!("{line}");
    report_line(&line);
}

/// Skips for want of a CUDA device, or fails when one is required.
pub fn skip_no_cuda(reason: &str) {
    if std::env::var("KILN_REQUIRE_CUDA").map(|v| v == "1").unwrap_or(false) {
        panic!("KILN_REQUIRE_CUDA=1 but {}: {reason}", test_name());
    }
    skip(reason);
}

/// Ulps by which a device's transcendental functions (exp, log, sin, cos,
/// tanh, pow) may differ from the CPU's (glibc): 0 on the CPU and the
/// simulated GPUs, which run the same code; 2 on CUDA, whose libdevice
/// double functions have a maximum error of 1 ulp (exp, log) to 2 ulps (cos,
/// pow) (CUDA C++ Programming Guide, "Mathematical Functions"). `randn`
/// combines log, sqrt and cos: it gets 4 times that.
pub fn transcendental_ulps(device: Device) -> u64 {
    let cuda = kiln::devices().iter().any(|i| i.device == device && i.kind == DeviceKind::Cuda);
    if cuda {
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
