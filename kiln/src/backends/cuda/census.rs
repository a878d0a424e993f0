//! The launch census: every kernel, cuBLAS and cuDNN call the CUDA simulator ran,
//! with the serial work of each launch's busiest thread, read from the
//! simulator (`cudasim/`, `KILN_CUDASIM_CENSUS=1`) through the two functions
//! it exports beside the driver's. A real driver has neither, and the census
//! says so.

use crate::base::error::{Error, Result};
use std::ffi::{c_char, c_int};

/// One launch of the census: a kernel kiln launched, a cuBLAS gemm or a
/// cuDNN convolution.
///
/// The simulator counts a kernel thread's work in basic blocks executed
/// (its compiled code instrumented with g++'s `-fsanitize-coverage=trace-pc`):
/// a loop of `n` iterations costs about `n` or more, whatever the work in
/// each. A kernel whose busiest thread does work that grows with the batch
/// or the image has a `work_max` that grows with them too.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchRecord {
    /// `kernel`, `gemm` or `dnn` (a cuDNN convolution).
    pub kind: String,
    /// The CUDA ordinal of the device it ran on.
    pub cuda_ordinal: u64,
    /// The kernel's name (`conv_im2col_f32`), `cublas:gemm_f32` or
    /// `cudnn:conv_fwd_f32` (`bwd_data`, `bwd_filter`).
    pub name: String,
    /// Blocks (kernels; 0 for gemm and dnn).
    pub grid: u64,
    /// Threads per block (kernels; 0 for gemm and dnn).
    pub block: u64,
    /// Threads launched (`grid · block`).
    pub threads: u64,
    /// Basic blocks executed by all threads.
    pub work_total: u64,
    /// Basic blocks executed by the busiest thread: the launch's serial work.
    pub work_max: u64,
    /// Bytes of the device allocations the arguments point into (an upper
    /// bound on the bytes the launch moved).
    pub arg_bytes: u64,
    /// gemm: rows of C (cuBLAS's column-major view); dnn: output channels.
    pub m: u64,
    /// gemm: columns of C; dnn: output positions per image.
    pub n: u64,
    /// gemm: the reduction length; dnn: input channels of a group × kernel taps.
    pub k: u64,
    /// gemm: the batch count; dnn: images.
    pub batch: u64,
    /// gemm and dnn: multiply-adds run inside the library (`m·n·k·batch`).
    pub macs: u64,
}

type TakeFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;
type EnabledFn = unsafe extern "C" fn() -> c_int;

/// The simulator's census functions, when the loaded driver is the
/// simulator (looked up only in a library already loaded: nothing is opened).
fn functions() -> Option<(TakeFn, EnabledFn)> {
    for name in [c"libcuda.so", c"libcuda.so.1"] {
        // SAFETY: RTLD_NOLOAD only returns a handle to a library already in
        // the process; the symbols, when present, have the C signatures the
        // simulator exports (cudasim/src/census.rs).
        unsafe {
            let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if h.is_null() {
                continue;
            }
            let take = libc::dlsym(h, c"kiln_cudasim_census_take".as_ptr());
            let enabled = libc::dlsym(h, c"kiln_cudasim_census_enabled".as_ptr());
            if !take.is_null() && !enabled.is_null() {
                return Some((
                    std::mem::transmute::<*mut libc::c_void, TakeFn>(take),
                    std::mem::transmute::<*mut libc::c_void, EnabledFn>(enabled),
                ));
            }
        }
    }
    None
}

fn unavailable(why: &str) -> Error {
    Error::invalid(
        "launch census",
        format!("{why}; the census is taken by the CUDA simulator: run under `KILN_CUDASIM_CENSUS=1 scripts/cudasim.sh ...`"),
    )
}

/// Takes (and clears) the simulator's records; the caller synchronizes
/// first ([`crate::take_launch_census`]).
pub(crate) fn take_records() -> Result<Vec<LaunchRecord>> {
    let Some((take, enabled)) = functions() else {
        return Err(unavailable("no CUDA simulator is loaded in this process"));
    };
    // SAFETY: the simulator's functions (see `functions`).
    if unsafe { enabled() } == 0 {
        return Err(unavailable("the CUDA simulator runs without its census (KILN_CUDASIM_CENSUS is not 1)"));
    }
    let mut buf: Vec<u8> = Vec::new();
    let text = loop {
        // SAFETY: a null buffer of capacity 0 asks for the length only.
        let need = unsafe { take(std::ptr::null_mut(), 0) };
        buf.resize(need + 1, 0);
        // SAFETY: `buf` holds `buf.len()` writable bytes.
        let got = unsafe { take(buf.as_mut_ptr() as *mut c_char, buf.len()) };
        if got <= buf.len() {
            // Written (and cleared in the simulator) whenever it fitted.
            buf.truncate(got);
            break String::from_utf8_lossy(&buf).into_owned();
        }
        // More records arrived between the two calls: ask again.
    };
    text.lines().filter(|l| !l.trim().is_empty()).map(parse).collect()
}

/// A census as a table: one row per kernel launch, the busiest thread's
/// work first, then the cuBLAS and cuDNN calls and their multiply-adds.
///
/// ```
/// assert!(kiln::census_table(&[]).contains("0 kernel launches"));
/// ```
pub fn census_table(records: &[LaunchRecord]) -> String {
    let mut kernels: Vec<&LaunchRecord> = records.iter().filter(|r| r.kind == "kernel").collect();
    kernels.sort_by_key(|r| std::cmp::Reverse(r.work_max));
    let mut s = format!("{:<34} {:>9} {:>10} {:>12} {:>12}\n", "kernel", "threads", "work max", "work total", "arg bytes");
    for r in &kernels {
        s.push_str(&format!("{:<34} {:>9} {:>10} {:>12} {:>12}\n", r.name, r.threads, r.work_max, r.work_total, r.arg_bytes));
    }
    let gemms: Vec<&LaunchRecord> = records.iter().filter(|r| r.kind == "gemm").collect();
    let macs: u64 = gemms.iter().map(|r| r.macs).sum();
    s.push_str(&format!("{} kernel launches, {} cuBLAS gemm calls, {macs} multiply-adds in cuBLAS", kernels.len(), gemms.len()));
    let convs: Vec<&LaunchRecord> = records.iter().filter(|r| r.kind == "dnn").collect();
    let dnn_macs: u64 = convs.iter().map(|r| r.macs).sum();
    s.push_str(&format!(", {} cuDNN convolution calls, {dnn_macs} multiply-adds in cuDNN\n", convs.len()));
    s
}

fn parse(line: &str) -> Result<LaunchRecord> {
    let bad = |what: &str| Error::Backend {
        device: crate::Device::Cpu,
        msg: format!("the CUDA simulator's census line {line:?} {what} (a simulator/kiln version mismatch: rebuild both)"),
    };
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(&format!("is not JSON: {e}")))?;
    let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64).ok_or_else(|| bad(&format!("lacks the number {k:?}")));
    let text =
        |k: &str| v.get(k).and_then(serde_json::Value::as_str).map(str::to_string).ok_or_else(|| bad(&format!("lacks the text {k:?}")));
    Ok(LaunchRecord {
        kind: text("kind")?,
        cuda_ordinal: num("device")?,
        name: text("name")?,
        grid: num("grid")?,
        block: num("block")?,
        threads: num("threads")?,
        work_total: num("work_total")?,
        work_max: num("work_max")?,
        arg_bytes: num("arg_bytes")?,
        m: num("m")?,
        n: num("n")?,
        k: num("k")?,
        batch: num("batch")?,
        macs: num("macs")?,
    })
}
