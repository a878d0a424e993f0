//! cudasim: a CUDA driver API, cuBLAS, cuDNN and NVRTC-pass-through simulator for
//! kiln's tests.
//!
//! Built as a shared library that exports the subset of `libcuda.so`,
//! `libcublas.so`, `libcudnn.so.9`, `libnvrtc.so` and `libnccl.so.2` that kiln resolves at
//! run time, so that
//! kiln's unchanged CUDA backend runs on the CPU when `scripts/cudasim.sh`
//! puts this library first on `LD_LIBRARY_PATH` under those names and sets
//! `KILN_CUDASIM=1`. See README.md for what it proves and what it cannot.
//!
//! Model: per-thread current context; one primary context per device; streams
//! run in order on worker threads, asynchronously to the host; events;
//! async copies happen when the stream reaches them; device memory is kept
//! apart from host memory, poisoned (0xFF bytes) on allocation, guarded by
//! red zones and inaccessible pages (a kernel's out-of-bounds access or use
//! after free fails its launch, naming it: `memory`, `exec`), and every
//! pointer a kernel, copy or gemm uses is checked against live allocations
//! of a device it may access; a fault is sticky for the context, as on a
//! GPU. Kernels are whatever kiln compiled: the NVRTC calls are
//! forwarded to the real NVRTC and each program's source is remembered, so
//! that `cuModuleLoadData` can compile that source for the host with g++ (once
//! per machine, through a disk cache) where a GPU driver would load the cubin.
//!
//! Files, by concern: `context` (devices, contexts, the handle registry,
//! fault injection and the stats tests read), `memory` (allocations, pointer
//! checks, copies), `stream` (stream workers, events), `module` (images,
//! modules, launches), `exec` (running a grid as fibers), `nvrtc` (the NVRTC
//! pass-through that captures sources), `sources` (which source each image
//! came from), `hostcc` (the host compiler and its cache), `blas` (cuBLAS),
//! `dnn` (cuDNN's convolutions over a reference implementation),
//! `nccl` (NCCL's collectives over the simulated devices, one process),
//! `census` (the opt-in launch census, `KILN_CUDASIM_CENSUS=1`: each
//! launch's per-thread work in basic blocks, and each gemm's multiply-adds,
//! handed out by `kiln_cudasim_census_take`).
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

mod blas;
mod census;
mod context;
mod dnn;
mod exec;
mod hostcc;
mod memory;
mod module;
mod nccl;
mod nvrtc;
mod sources;
mod stream;

use std::ffi::{c_char, c_uint, CStr};
use std::sync::{Mutex, MutexGuard};

pub(crate) use context::{current, injected_failure, Ctx, Sim};
pub(crate) use memory::check_range;
pub(crate) use stream::{stream_of, Op, Stream};

pub type CUresult = c_uint;
pub type CUdeviceptr = u64;

pub const SUCCESS: CUresult = 0;
pub const INVALID_VALUE: CUresult = 1;
pub const OUT_OF_MEMORY: CUresult = 2;
pub const NOT_INITIALIZED: CUresult = 3;
pub const NO_DEVICE: CUresult = 100;
pub const INVALID_DEVICE: CUresult = 101;
pub const INVALID_IMAGE: CUresult = 200;
pub const INVALID_CONTEXT: CUresult = 201;
pub const PEER_ACCESS_UNSUPPORTED: CUresult = 217;
/// A GPU driver says this when it cannot JIT-compile PTX; here: g++ failed on
/// the module's source, or its output could not be loaded.
pub const INVALID_PTX: CUresult = 218;
/// A GPU driver says this when its PTX JIT library is missing; here: the
/// host compiler (g++) cannot be run.
pub const JIT_COMPILER_NOT_FOUND: CUresult = 221;
pub const INVALID_HANDLE: CUresult = 400;
pub const NOT_FOUND: CUresult = 500;
pub const NOT_READY: CUresult = 600;
pub const ILLEGAL_ADDRESS: CUresult = 700;
pub const LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
pub const PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
pub const PEER_ACCESS_NOT_ENABLED: CUresult = 705;
pub const LAUNCH_FAILED: CUresult = 719;
pub const NOT_SUPPORTED: CUresult = 801;

/// A diagnostic on stderr, unless `KILN_CUDASIM_QUIET=1` (tests that fault
/// on purpose would otherwise drown the output).
pub(crate) fn log(msg: &str) {
    if std::env::var("KILN_CUDASIM_QUIET").map(|v| v != "1").unwrap_or(true) {
        eprintln!("cudasim: {msg}");
    }
}

/// A diagnostic that `KILN_CUDASIM_QUIET` does not silence: a kernel source
/// the host compiler rejects is a broken test setup, and g++'s message is
/// the only way to see why.
pub(crate) fn log_always(msg: &str) {
    eprintln!("cudasim: {msg}");
}

pub(crate) fn env_bytes(name: &str, default: usize) -> usize {
    let Ok(v) = std::env::var(name) else { return default };
    let v = v.trim().to_ascii_lowercase();
    let (num, mul) = if let Some(n) = v.strip_suffix("gib").or_else(|| v.strip_suffix('g')) {
        (n, 1usize << 30)
    } else if let Some(n) = v.strip_suffix("mib").or_else(|| v.strip_suffix('m')) {
        (n, 1 << 20)
    } else if let Some(n) = v.strip_suffix("kib").or_else(|| v.strip_suffix('k')) {
        (n, 1 << 10)
    } else {
        (v.as_str(), 1)
    };
    match num.trim().parse::<usize>() {
        Ok(n) => n.saturating_mul(mul),
        Err(_) => {
            log(&format!("{name}={v} is not a size (e.g. 512MiB); using {default}"));
            default
        }
    }
}

/// Locks, ignoring poisoning: a panic elsewhere must not turn every later
/// driver call into another panic across the C boundary.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `?` for functions that return a `CUresult`.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}
pub(crate) use tri;

// ---- errors ---------------------------------------------------------------------------

fn error_name(r: CUresult) -> Option<&'static CStr> {
    Some(match r {
        SUCCESS => c"CUDA_SUCCESS",
        INVALID_VALUE => c"CUDA_ERROR_INVALID_VALUE",
        OUT_OF_MEMORY => c"CUDA_ERROR_OUT_OF_MEMORY",
        NOT_INITIALIZED => c"CUDA_ERROR_NOT_INITIALIZED",
        NO_DEVICE => c"CUDA_ERROR_NO_DEVICE",
        INVALID_DEVICE => c"CUDA_ERROR_INVALID_DEVICE",
        INVALID_IMAGE => c"CUDA_ERROR_INVALID_IMAGE",
        INVALID_CONTEXT => c"CUDA_ERROR_INVALID_CONTEXT",
        PEER_ACCESS_UNSUPPORTED => c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        INVALID_PTX => c"CUDA_ERROR_INVALID_PTX",
        JIT_COMPILER_NOT_FOUND => c"CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        INVALID_HANDLE => c"CUDA_ERROR_INVALID_HANDLE",
        NOT_FOUND => c"CUDA_ERROR_NOT_FOUND",
        NOT_READY => c"CUDA_ERROR_NOT_READY",
        ILLEGAL_ADDRESS => c"CUDA_ERROR_ILLEGAL_ADDRESS",
        LAUNCH_OUT_OF_RESOURCES => c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        PEER_ACCESS_ALREADY_ENABLED => c"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        PEER_ACCESS_NOT_ENABLED => c"CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        LAUNCH_FAILED => c"CUDA_ERROR_LAUNCH_FAILED",
        NOT_SUPPORTED => c"CUDA_ERROR_NOT_SUPPORTED",
        _ => return None,
    })
}

fn error_text(r: CUresult) -> Option<&'static CStr> {
    Some(match r {
        SUCCESS => c"no error",
        INVALID_VALUE => c"invalid argument",
        OUT_OF_MEMORY => c"out of memory",
        NOT_INITIALIZED => c"initialization error",
        NO_DEVICE => c"no CUDA-capable device is detected (cudasim: set KILN_CUDASIM=1)",
        INVALID_DEVICE => c"invalid device ordinal",
        INVALID_IMAGE => c"device kernel image is invalid",
        INVALID_CONTEXT => c"invalid device context",
        INVALID_PTX => c"a PTX JIT compilation failed (cudasim: the host compiler rejected the module's source; its message is on stderr)",
        JIT_COMPILER_NOT_FOUND => c"PTX JIT compiler library not found (cudasim: the host compiler g++ cannot be run)",
        INVALID_HANDLE => c"invalid resource handle",
        NOT_FOUND => c"named symbol not found",
        NOT_READY => c"device not ready",
        ILLEGAL_ADDRESS => c"an illegal memory access was encountered",
        LAUNCH_OUT_OF_RESOURCES => c"too many resources requested for launch",
        LAUNCH_FAILED => c"unspecified launch failure",
        NOT_SUPPORTED => c"operation not supported",
        _ => return None,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(r: CUresult, out: *mut *const c_char) -> CUresult {
    unsafe {
        if out.is_null() {
            return INVALID_VALUE;
        }
        match error_name(r) {
            Some(s) => {
                *out = s.as_ptr();
                SUCCESS
            }
            None => {
                *out = std::ptr::null();
                INVALID_VALUE
            }
        }
    }
}

/// The message of the last fault recorded with each result code (a
/// context's sticky fault), as text that lives as long as the process: the
/// driver's error strings are static, and a caller may keep the pointer.
/// Contexts record one fault each, so at most one string per device leaks.
/// Keyed by (device, code): the text of the calling thread's current
/// device is preferred, then the last recorded with that code.
type FaultTexts = std::collections::HashMap<(Option<usize>, CUresult), &'static CStr>;

fn fault_texts() -> &'static Mutex<FaultTexts> {
    static T: std::sync::OnceLock<Mutex<FaultTexts>> = std::sync::OnceLock::new();
    T.get_or_init(|| Mutex::new(std::collections::HashMap::new()))
}

/// Remembers a context's fault, so that `cuGetErrorString` of its code says
/// what happened (which kernel, which address) after the usual text: a
/// program that reports the driver's error string (kiln does) names the
/// kernel without reading the simulator's stderr, which
/// `KILN_CUDASIM_QUIET=1` silences.
pub(crate) fn remember_fault(code: CUresult, dev: usize, msg: &str) {
    let Some(base) = error_text(code) else { return };
    let text = format!("{} (cudasim, device {dev}: {})", base.to_string_lossy(), msg.replace('\0', " "));
    if let Ok(c) = std::ffi::CString::new(text) {
        let c: &'static CStr = Box::leak(c.into_boxed_c_str());
        let mut t = lock(fault_texts());
        t.insert((Some(dev), code), c);
        t.insert((None, code), c);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(r: CUresult, out: *mut *const c_char) -> CUresult {
    unsafe {
        if out.is_null() {
            return INVALID_VALUE;
        }
        let texts = lock(fault_texts());
        if let Some(text) = texts.get(&(context::current_device(), r)).or_else(|| texts.get(&(None, r))) {
            *out = text.as_ptr();
            return SUCCESS;
        }
        match error_text(r) {
            Some(s) => {
                *out = s.as_ptr();
                SUCCESS
            }
            None => {
                *out = std::ptr::null();
                INVALID_VALUE
            }
        }
    }
}
