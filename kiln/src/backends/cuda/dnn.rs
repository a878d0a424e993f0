//! Convolutions through cuDNN, found at run time like NVRTC and NCCL (nothing
//! linked: one binary runs with and without it), as PyTorch runs them.
//!
//! - **Loading**: `KILN_CUDNN_LIB` when set (and no other library when that
//!   fails), else `libcudnn.so.9`, `libcudnn.so.8`, `libcudnn.so` (pip's
//!   `nvidia-cudnn-cu12`, apt's `libcudnn9-cuda-12`, PyTorch's wheels).
//!   `KILN_DISABLE_CUDNN=1` leaves it unloaded. cuDNN 8 or later. Only the
//!   legacy convolution API is used (its functions are in both 8 and 9).
//! - **Per device**: one handle, made on the first convolution with the
//!   device's context current and bound to its compute stream (a failed
//!   `cudnnCreate` is tried at three convolutions, then not again); workspace
//!   comes from the device's caching allocator ([`CudaDevice::temp`]), at
//!   most [`CONV_WORKSPACE_BYTES`], freed in stream order after the call.
//! - **Algorithms**: cuDNN's heuristics (`cudnnGetConvolution*Algorithm_v7`)
//!   rank them; with `KILN_CUDNN_BENCHMARK=1` cuDNN times them instead
//!   (`cudnnFind*AlgorithmEx`, once per shape, as
//!   `torch.backends.cudnn.benchmark`). Either way only deterministic
//!   algorithms are taken (no atomics: a given algorithm gives the same bits
//!   every run, like kiln's other paths), and the ranking is kept per shape.
//!   When the device has no room for an algorithm's workspace, or an
//!   algorithm refuses the operands, the next one is tried; so, as with
//!   PyTorch, which algorithm ran (and so the last bits of an f32 result)
//!   can differ between runs under memory pressure or with the benchmark.
//! - **Numerics**: f32 convolutions use FMA math (no TF32), as PyTorch with
//!   `allow_tf32 = False`; `KILN_CUDA_TF32=1` lets them use tensor cores, as
//!   it does for cuBLAS. f64 is supported; other dtypes are declined.
//! - **Declining**: a call cuDNN's legacy API cannot express (padding that
//!   differs top and bottom, as `padding="same"` with an even kernel gives;
//!   sizes past 32 bits) or for which no algorithm fits is
//!   [`Offload::Declined`] with the reason, and the convolution runs through
//!   im2col + cuBLAS (or is an error under `KILN_CUDA_CONV=cudnn`), as is one
//!   cuDNN refuses (a bad or unsupported parameter). A cuDNN call that fails
//!   otherwise is an [`Error::Backend`] naming it and cuDNN's status.

use super::nvrtc::{dl, fn_ptr, open_library};
use super::CudaBackend;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::kernel::cuda::{ConvDims, CudaDevice, DnnConvCall, DnnDirection, Offload, CONV_WORKSPACE_BYTES};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::catch_unwind;
use std::sync::{Mutex, OnceLock};

type Status = c_int;
/// Every cuDNN handle and descriptor is an opaque pointer.
type H = *mut c_void;
const SUCCESS: Status = 0;

const DATA_FLOAT: c_int = 0;
const DATA_DOUBLE: c_int = 1;
const TENSOR_NCHW: c_int = 0;
const CROSS_CORRELATION: c_int = 1;
const DEFAULT_MATH: c_int = 0;
const TENSOR_OP_MATH: c_int = 1;
const FMA_MATH: c_int = 3;
const DETERMINISTIC: c_int = 1;
/// More than any direction has algorithms (forward has 8).
const MAX_ALGOS: usize = 16;

/// Times a device's `cudnnCreate` is tried before cuDNN is given up there.
const CREATE_TRIES: u32 = 3;

/// The oldest cuDNN kiln uses.
const MIN_VERSION: usize = 8000;

/// `cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t`: one layout for all three.
#[repr(C)]
#[derive(Clone, Copy)]
struct AlgoPerf {
    algo: c_int,
    status: Status,
    time: f32,
    memory: usize,
    determinism: c_int,
    math_type: c_int,
    reserved: [c_int; 3],
}

const NO_PERF: AlgoPerf = AlgoPerf { algo: 0, status: -1, time: 0.0, memory: 0, determinism: 0, math_type: 0, reserved: [0; 3] };

/// The three directions' functions have one C shape each, with operands in
/// the order [`Operands`] gives: (a, b, conv, out).
type Heuristics = unsafe extern "C" fn(H, H, H, H, H, c_int, *mut c_int, *mut AlgoPerf) -> Status;
type Workspace = unsafe extern "C" fn(H, H, H, H, H, c_int, *mut usize) -> Status;
type Run = unsafe extern "C" fn(H, *const c_void, H, *const c_void, H, *const c_void, H, c_int, H, usize, *const c_void, H, H) -> Status;
type Find = unsafe extern "C" fn(H, H, *const c_void, H, *const c_void, H, H, H, c_int, *mut c_int, *mut AlgoPerf, H, usize) -> Status;

/// The cuDNN functions kiln calls, looked up in kiln's own handle.
struct Api {
    version: unsafe extern "C" fn() -> usize,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create: unsafe extern "C" fn(*mut H) -> Status,
    destroy: unsafe extern "C" fn(H) -> Status,
    set_stream: unsafe extern "C" fn(H, H) -> Status,
    create_tensor: unsafe extern "C" fn(*mut H) -> Status,
    destroy_tensor: unsafe extern "C" fn(H) -> Status,
    set_tensor: unsafe extern "C" fn(H, c_int, c_int, c_int, c_int, c_int, c_int) -> Status,
    create_filter: unsafe extern "C" fn(*mut H) -> Status,
    destroy_filter: unsafe extern "C" fn(H) -> Status,
    set_filter: unsafe extern "C" fn(H, c_int, c_int, c_int, c_int, c_int, c_int) -> Status,
    create_conv: unsafe extern "C" fn(*mut H) -> Status,
    destroy_conv: unsafe extern "C" fn(H) -> Status,
    set_conv: unsafe extern "C" fn(H, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int) -> Status,
    set_groups: unsafe extern "C" fn(H, c_int) -> Status,
    set_math: unsafe extern "C" fn(H, c_int) -> Status,
    output_dim: unsafe extern "C" fn(H, H, H, *mut c_int, *mut c_int, *mut c_int, *mut c_int) -> Status,
    /// Indexed by [`index`]: forward, backward data, backward filter.
    heuristics: [Heuristics; 3],
    workspace: [Workspace; 3],
    run: [Run; 3],
    find: [Find; 3],
}

fn index(d: DnnDirection) -> usize {
    match d {
        DnnDirection::Forward => 0,
        DnnDirection::BackwardData => 1,
        DnnDirection::BackwardFilter => 2,
    }
}

fn call_name(d: DnnDirection) -> &'static str {
    match d {
        DnnDirection::Forward => "cudnnConvolutionForward",
        DnnDirection::BackwardData => "cudnnConvolutionBackwardData",
        DnnDirection::BackwardFilter => "cudnnConvolutionBackwardFilter",
    }
}

impl Api {
    /// Looks the functions up in `handle` (from dlopen of `lib`).
    ///
    /// # Safety
    /// `handle` must be a live dlopen handle of a cuDNN library.
    unsafe fn from_handle(handle: H, lib: &str) -> std::result::Result<Api, String> {
        unsafe {
            let need = |name: &str| -> std::result::Result<H, String> {
                let c = CString::new(name).map_err(|_| format!("bad symbol name {name}"))?;
                let p = dl::sym(handle, &c);
                if p.is_null() {
                    Err(format!("the cuDNN library {lib} lacks {name} (older than cuDNN 8?)"))
                } else {
                    Ok(p)
                }
            };
            // SAFETY (every fn_ptr): each symbol is the cuDNN function of
            // that name, whose C signature the pointer type spells (handles
            // and descriptors are pointers, enums C ints).
            Ok(Api {
                version: fn_ptr(need("cudnnGetVersion")?),
                error_string: fn_ptr(need("cudnnGetErrorString")?),
                create: fn_ptr(need("cudnnCreate")?),
                destroy: fn_ptr(need("cudnnDestroy")?),
                set_stream: fn_ptr(need("cudnnSetStream")?),
                create_tensor: fn_ptr(need("cudnnCreateTensorDescriptor")?),
                destroy_tensor: fn_ptr(need("cudnnDestroyTensorDescriptor")?),
                set_tensor: fn_ptr(need("cudnnSetTensor4dDescriptor")?),
                create_filter: fn_ptr(need("cudnnCreateFilterDescriptor")?),
                destroy_filter: fn_ptr(need("cudnnDestroyFilterDescriptor")?),
                set_filter: fn_ptr(need("cudnnSetFilter4dDescriptor")?),
                create_conv: fn_ptr(need("cudnnCreateConvolutionDescriptor")?),
                destroy_conv: fn_ptr(need("cudnnDestroyConvolutionDescriptor")?),
                set_conv: fn_ptr(need("cudnnSetConvolution2dDescriptor")?),
                set_groups: fn_ptr(need("cudnnSetConvolutionGroupCount")?),
                set_math: fn_ptr(need("cudnnSetConvolutionMathType")?),
                output_dim: fn_ptr(need("cudnnGetConvolution2dForwardOutputDim")?),
                heuristics: [
                    fn_ptr(need("cudnnGetConvolutionForwardAlgorithm_v7")?),
                    fn_ptr(need("cudnnGetConvolutionBackwardDataAlgorithm_v7")?),
                    fn_ptr(need("cudnnGetConvolutionBackwardFilterAlgorithm_v7")?),
                ],
                workspace: [
                    fn_ptr(need("cudnnGetConvolutionForwardWorkspaceSize")?),
                    fn_ptr(need("cudnnGetConvolutionBackwardDataWorkspaceSize")?),
                    fn_ptr(need("cudnnGetConvolutionBackwardFilterWorkspaceSize")?),
                ],
                run: [
                    fn_ptr(need("cudnnConvolutionForward")?),
                    fn_ptr(need("cudnnConvolutionBackwardData")?),
                    fn_ptr(need("cudnnConvolutionBackwardFilter")?),
                ],
                find: [
                    fn_ptr(need("cudnnFindConvolutionForwardAlgorithmEx")?),
                    fn_ptr(need("cudnnFindConvolutionBackwardDataAlgorithmEx")?),
                    fn_ptr(need("cudnnFindConvolutionBackwardFilterAlgorithmEx")?),
                ],
            })
        }
    }

    /// cuDNN's name for a status.
    fn describe(&self, s: Status) -> String {
        // SAFETY: returns null or a static C string, copied at once.
        let text = unsafe { (self.error_string)(s) };
        if text.is_null() {
            format!("cuDNN status {s}")
        } else {
            // SAFETY: non-null C string owned by cuDNN.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        }
    }
}

/// The loaded library: its functions, the name it was found by, its version.
pub(super) struct Library {
    api: Api,
    name: String,
    version: (usize, usize, usize),
}

impl Library {
    /// "9.1.0 (libcudnn.so.9)", for `kiln devices`.
    pub(super) fn describe(&self) -> String {
        format!("{}.{}.{} ({})", self.version.0, self.version.1, self.version.2, self.name)
    }
}

/// How a missing cuDNN is described.
const MISSING: &str = "libcudnn.so.9 not found; `pip install nvidia-cudnn-cu12` and add its lib folder \
(site-packages/nvidia/cudnn/lib) to LD_LIBRARY_PATH, or set KILN_CUDNN_LIB to the library's path";

/// Opens cuDNN: exactly `KILN_CUDNN_LIB` when set, else the first name the
/// loader finds. The handle is kept for the life of the process.
fn open() -> std::result::Result<(Api, String), String> {
    let names = ["libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"];
    let opened = open_library("KILN_CUDNN_LIB", "cuDNN", names, false)?.ok_or_else(|| MISSING.to_string())?;
    // SAFETY: a live handle of the library named as cuDNN (by the user, or
    // by its file name).
    opened.load(|handle, name| unsafe { Api::from_handle(handle, name) })
}

/// cuDNN's version code as (major, minor, patch): 90100 for 9.1.0 (9 and
/// later), 8902 for 8.9.2 (before).
fn split_version(code: usize) -> (usize, usize, usize) {
    if code >= 90000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

fn load() -> std::result::Result<Library, String> {
    if crate::base::env::env_flag("KILN_DISABLE_CUDNN").unwrap_or(false) {
        return Err("cuDNN disabled by KILN_DISABLE_CUDNN=1".into());
    }
    let (api, name) = open()?;
    // SAFETY: no arguments.
    let code = unsafe { (api.version)() };
    if code < MIN_VERSION {
        let v = split_version(code);
        return Err(format!(
            "{name} is cuDNN {}.{}.{}, older than 8.0, which kiln needs; install cuDNN 9 (`pip install nvidia-cudnn-cu12`)",
            v.0, v.1, v.2
        ));
    }
    Ok(Library { api, name, version: split_version(code) })
}

/// The loaded cuDNN, or why there is none (loaded on first ask). Never panics.
pub(super) fn library() -> std::result::Result<&'static Library, &'static str> {
    static LIB: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    LIB.get_or_init(|| catch_unwind(load).unwrap_or_else(|_| Err("loading cuDNN panicked".into()))).as_ref().map_err(|e| e.as_str())
}

/// Whether cuDNN times its algorithms (`KILN_CUDNN_BENCHMARK=1`).
pub(super) fn benchmark() -> bool {
    crate::base::env::env_flag("KILN_CUDNN_BENCHMARK").unwrap_or(false)
}

/// A device's cuDNN: its handle and, per shape, the algorithms to try in
/// order with the workspace each needs.
pub(super) struct Dnn {
    handle: super::Raw<H>,
    plans: Mutex<HashMap<PlanKey, Vec<(c_int, usize)>>>,
}

/// What a plan depends on: the direction, dtype, geometry, whether TF32 is
/// allowed and whether the ranking was timed.
type PlanKey = (DnnDirection, DType, ConvDims, bool, bool);

/// One step of making a call's descriptors.
type DescStep<'a> = dyn Fn(&mut Descs<'a>) -> Status + 'a;

/// The descriptors of one call, destroyed when dropped.
struct Descs<'a> {
    api: &'a Api,
    x: H,
    w: H,
    y: H,
    conv: H,
}

impl Drop for Descs<'_> {
    fn drop(&mut self) {
        // SAFETY: each is null or a descriptor this struct made.
        unsafe {
            if !self.x.is_null() {
                (self.api.destroy_tensor)(self.x);
            }
            if !self.y.is_null() {
                (self.api.destroy_tensor)(self.y);
            }
            if !self.w.is_null() {
                (self.api.destroy_filter)(self.w);
            }
            if !self.conv.is_null() {
                (self.api.destroy_conv)(self.conv);
            }
        }
    }
}

/// The operands of `direction` in the order its functions take them:
/// (first input, second input, output), each a descriptor and a pointer.
fn operands(d: &Descs<'_>, call: &DnnConvCall) -> [(H, u64); 3] {
    let (x, w, y) = ((d.x, call.x), (d.w, call.w), (d.y, call.y));
    match call.direction {
        DnnDirection::Forward => [x, w, y],
        DnnDirection::BackwardData => [w, y, x],
        DnnDirection::BackwardFilter => [x, y, w],
    }
}

impl CudaBackend {
    /// The device's cuDNN handle, made on first use; the reason when there is    /// none. A failed `cudnnCreate` is tried again at the next call (as a
    /// failed `cublasCreate` is), up to [`CREATE_TRIES`] times, and said
    /// once on stderr.
    fn with_dnn<T>(&self, f: impl FnOnce(&'static Library, &Dnn) -> Result<T>) -> Result<std::result::Result<T, String>> {
        let lib = match library() {
            Ok(lib) => lib,
            Err(why) => return Ok(Err(why.to_string())),
        };
        let mut guard = self.dnn.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            // cudnnCreate is slow where it fails (it may load sub-libraries
            // each time): after a few failures it is not tried again.
            let failures = self.dnn_create_failures.load(std::sync::atomic::Ordering::Relaxed);
            if failures >= CREATE_TRIES {
                return Ok(Err(format!("cudnnCreate failed {failures} times on this device; not tried again")));
            }
            match self.make_handle(lib) {
                Ok(h) => *guard = Some(Dnn { handle: super::Raw(h), plans: Mutex::new(HashMap::new()) }),
                Err(why) => {
                    self.dnn_create_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if !self.dnn_warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        eprintln!("kiln: cuDNN unavailable on {} for now ({why}); convolutions take the next path", self.device);
                    }
                    return Ok(Err(why));
                }
            }
        }
        match guard.as_ref() {
            // The lock is held through the call: a cuDNN handle is not for
            // two threads at once.
            Some(dnn) => f(lib, dnn).map(Ok),
            None => Ok(Err("no cuDNN handle".into())),
        }
    }

    /// A cuDNN handle on this device's stream (its context is current).
    fn make_handle(&self, lib: &Library) -> std::result::Result<H, String> {
        let mut h: H = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device's context is current.
        let st = unsafe { (lib.api.create)(&mut h) };
        if st != SUCCESS {
            return Err(format!("cudnnCreate failed: {}", lib.api.describe(st)));
        }
        // SAFETY: a live handle and this device's stream.
        let st = unsafe { (lib.api.set_stream)(h, self.stream.0 as H) };
        if st != SUCCESS {
            // SAFETY: the handle just made, used by nothing else.
            unsafe { (lib.api.destroy)(h) };
            return Err(format!("cudnnSetStream failed: {}", lib.api.describe(st)));
        }
        Ok(h)
    }

    /// Whether cuDNN is there, for `devices()`: its version, or why not.
    pub(super) fn dnn_status(&self) -> std::result::Result<String, String> {
        library().map(|l| l.describe()).map_err(|e| e.to_string())
    }

    /// Runs `call` through cuDNN (see the module's notes).
    pub(super) fn conv_cudnn(&self, call: &DnnConvCall) -> Result<Offload> {
        match self.with_dnn(|lib, dnn| self.conv_with(lib, dnn, call))? {
            Ok(done) => Ok(done),
            Err(why) => Ok(Offload::Declined(format!("cuDNN: {why}"))),
        }
    }

    fn conv_with(&self, lib: &Library, dnn: &Dnn, call: &DnnConvCall) -> Result<Offload> {
        let api = &lib.api;
        let g = &call.dims;
        let name = call_name(call.direction);
        let what = |call_name: &str, st: Status| -> String {
            format!(
                "{call_name} ({name}, {} input {}×{}×{}×{}, weight {}×{}×{}×{}, {} groups) returned {}",
                call.dtype,
                g.n,
                g.c_in,
                g.h,
                g.w,
                g.c_out,
                g.c_in / g.groups.max(1),
                g.kh,
                g.kw,
                g.groups,
                api.describe(st)
            )
        };
        // A status that says cuDNN does not take the call (a bad or
        // unsupported parameter) declines it: the next path runs. Any other
        // is an error of the device.
        let outcome = |call_name: &str, st: Status| -> Result<Offload> {
            if refuses(lib.version.0, st) {
                Ok(Offload::Declined(what(call_name, st)))
            } else {
                Err(self.err(format!("{}; set KILN_DISABLE_CUDNN=1 to run convolutions without cuDNN", what(call_name, st))))
            }
        };
        let data = match call.dtype {
            DType::F32 => DATA_FLOAT,
            DType::F64 => DATA_DOUBLE,
            DType::F16 | DType::BF16 | DType::I64 | DType::I32 | DType::U8 => {
                return Ok(Offload::Declined(format!("cuDNN convolutions here take f32 and f64, not {}", call.dtype)));
            }
        };
        let sizes = [g.n, g.c_in, g.h, g.w, g.c_out, g.oh, g.ow, g.kh, g.kw, g.stride.0, g.stride.1, g.dilation.0, g.dilation.1, g.groups];
        let lens = [g.n * g.c_in * g.h * g.w, g.n * g.c_out * g.oh * g.ow, g.c_out * (g.c_in / g.groups.max(1)) * g.kh * g.kw];
        let small = sizes.iter().all(|&v| v <= i32::MAX as usize) && lens.iter().all(|&v| v < i32::MAX as usize);
        if !small || g.groups == 0 || g.pad.0 < 0 || g.pad.1 < 0 || g.pad.0 > i32::MAX as isize || g.pad.1 > i32::MAX as isize {
            return Ok(Offload::Declined("sizes or padding past cuDNN's 32-bit, non-negative descriptors".into()));
        }
        let tf32 = call.dtype == DType::F32 && crate::base::env::env_flag("KILN_CUDA_TF32").unwrap_or(false);
        let math = match (call.dtype, tf32) {
            (DType::F32, true) => TENSOR_OP_MATH,
            (DType::F32, false) => FMA_MATH,
            _ => DEFAULT_MATH,
        };
        let i = |v: usize| v as c_int;
        let mut d = Descs { api, x: std::ptr::null_mut(), w: std::ptr::null_mut(), y: std::ptr::null_mut(), conv: std::ptr::null_mut() };
        // Each step only after the one before succeeded (a failed create
        // leaves a null descriptor that no later call may be given).
        // SAFETY: out-pointers to the fields of `d`, which destroys them;
        // every size was checked to fit a C int above.
        let steps: [(&str, &DescStep<'_>); 10] = unsafe {
            [
                ("cudnnCreateTensorDescriptor", &|d| (api.create_tensor)(&mut d.x)),
                ("cudnnCreateTensorDescriptor", &|d| (api.create_tensor)(&mut d.y)),
                ("cudnnCreateFilterDescriptor", &|d| (api.create_filter)(&mut d.w)),
                ("cudnnCreateConvolutionDescriptor", &|d| (api.create_conv)(&mut d.conv)),
                ("cudnnSetTensor4dDescriptor", &|d| (api.set_tensor)(d.x, TENSOR_NCHW, data, i(g.n), i(g.c_in), i(g.h), i(g.w))),
                ("cudnnSetTensor4dDescriptor", &|d| (api.set_tensor)(d.y, TENSOR_NCHW, data, i(g.n), i(g.c_out), i(g.oh), i(g.ow))),
                ("cudnnSetFilter4dDescriptor", &|d| {
                    (api.set_filter)(d.w, data, TENSOR_NCHW, i(g.c_out), i(g.c_in / g.groups), i(g.kh), i(g.kw))
                }),
                ("cudnnSetConvolution2dDescriptor", &|d| {
                    (api.set_conv)(
                        d.conv,
                        g.pad.0 as c_int,
                        g.pad.1 as c_int,
                        i(g.stride.0),
                        i(g.stride.1),
                        i(g.dilation.0),
                        i(g.dilation.1),
                        CROSS_CORRELATION,
                        data,
                    )
                }),
                ("cudnnSetConvolutionGroupCount", &|d| (api.set_groups)(d.conv, i(g.groups))),
                ("cudnnSetConvolutionMathType", &|d| (api.set_math)(d.conv, math)),
            ]
        }; // Nothing is queued yet: a failure here declines the call whatever
           // the status (the next path runs it).
        for (step, run) in steps {
            let st = run(&mut d);
            if st != SUCCESS {
                return Ok(Offload::Declined(what(step, st)));
            }
        }
        // cuDNN pads top and bottom alike: where kiln's output differs from
        // what that gives, the padding is asymmetric and cuDNN cannot run it.
        let mut out = [0 as c_int; 4];
        // SAFETY: live descriptors and out-pointers to a local array.
        let st = unsafe { (api.output_dim)(d.conv, d.x, d.w, &mut out[0], &mut out[1], &mut out[2], &mut out[3]) };
        let want = [i(g.n), i(g.c_out), i(g.oh), i(g.ow)];
        if st != SUCCESS || out != want {
            return Ok(Offload::Declined(format!(
                "cuDNN pads both sides alike, which gives an output of {out:?} where this convolution's is {want:?} (padding top {}, left {})",
                g.pad.0, g.pad.1
            )));
        }
        let ops = operands(&d, call);
        let key: PlanKey = (call.direction, call.dtype, *g, tf32, benchmark());
        let known = dnn.plans.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
        let plan = match known {
            Some(p) => p,
            None => match self.rank(api, dnn, &d, &ops, call)? {
                Ranked::Plan(p, keep) => {
                    if keep {
                        dnn.plans.lock().unwrap_or_else(|e| e.into_inner()).insert(key, p.clone());
                    }
                    p
                } // Nothing queued either: a failed search ran nothing this
                // call relies on (the next path rewrites the output).
                Ranked::Refused(step, st) => return Ok(Offload::Declined(what(step, st))),
            },
        };
        if plan.is_empty() {
            return Ok(Offload::Declined(format!(
                "cuDNN offers no deterministic algorithm with a workspace under {CONV_WORKSPACE_BYTES} bytes for this {name}"
            )));
        }
        let (one32, zero32, one64, zero64) = (1f32, 0f32, 1f64, 0f64);
        let (alpha, beta) = if call.dtype == DType::F64 {
            (&one64 as *const f64 as *const c_void, &zero64 as *const f64 as *const c_void)
        } else {
            (&one32 as *const f32 as *const c_void, &zero32 as *const f32 as *const c_void)
        };
        let mut last = format!("no room on the device for the workspace of any cuDNN algorithm for this {name}");
        for &(algo, bytes) in &plan {
            let ws = match bytes {
                0 => None,
                _ => match self.temp(bytes) {
                    Ok(ws) => Some(ws),
                    Err(Error::OutOfMemory { .. }) => continue,
                    Err(e) => return Err(e),
                },
            };
            let ws_ptr = ws.as_ref().map(|w| w.ptr()).unwrap_or(0);
            let [(ad, a), (bd, b), (od, o)] = ops;
            // SAFETY: live handle and descriptors; pointers address device
            // buffers the descriptors describe (checked by the caller), the
            // workspace holds `bytes`, alpha and beta live on this stack.
            let st = unsafe {
                (api.run[index(call.direction)])(
                    dnn.handle.0,
                    alpha,
                    ad,
                    a as *const c_void,
                    bd,
                    b as *const c_void,
                    d.conv,
                    algo,
                    ws_ptr as H,
                    bytes,
                    beta,
                    od,
                    o as H,
                )
            };
            if st == SUCCESS {
                return Ok(Offload::Ran);
            }
            // An algorithm that refuses these operands (a pointer's
            // alignment, say, which the heuristics did not see): the next.
            match outcome(&format!("{name} with algorithm {algo}"), st)? {
                Offload::Declined(why) => last = why,
                Offload::Ran => return Ok(Offload::Ran),
            }
        }
        Ok(Offload::Declined(last))
    }

    /// The deterministic algorithms for a call, best first, with their
    /// workspace: cuDNN's heuristics, or its timings under
    /// `KILN_CUDNN_BENCHMARK=1`.
    fn rank(&self, api: &Api, dnn: &Dnn, d: &Descs<'_>, ops: &[(H, u64); 3], call: &DnnConvCall) -> Result<Ranked> {
        let k = index(call.direction);
        let [(ad, a), (bd, b), (od, o)] = *ops;
        let mut perf = [NO_PERF; MAX_ALGOS];
        let mut n: c_int = 0;
        // SAFETY: live handle and descriptors; `perf` holds MAX_ALGOS entries.
        let st = unsafe { (api.heuristics[k])(dnn.handle.0, ad, bd, d.conv, od, MAX_ALGOS as c_int, &mut n, perf.as_mut_ptr()) };
        if st != SUCCESS {
            return Ok(Ranked::Refused("the cuDNN heuristics", st));
        }
        let usable = |p: &AlgoPerf| p.status == SUCCESS && p.determinism == DETERMINISTIC;
        let mut ranked: Vec<(c_int, usize)> = Vec::new();
        for p in perf.iter().take((n.max(0) as usize).min(MAX_ALGOS)).filter(|p| usable(p)) {
            let mut bytes = 0usize;
            // SAFETY: as above, with an out-pointer to a local.
            let st = unsafe { (api.workspace[k])(dnn.handle.0, ad, bd, d.conv, od, p.algo, &mut bytes) };
            if st == SUCCESS && bytes <= CONV_WORKSPACE_BYTES && !ranked.iter().any(|r| r.0 == p.algo) {
                ranked.push((p.algo, bytes));
            }
        }
        if !benchmark() || ranked.len() < 2 {
            return Ok(Ranked::Plan(ranked, true));
        }
        // Timed, with room for the largest of these workspaces. Without
        // room, the heuristics' order serves this call and the search is
        // tried again at the next.
        let most = ranked.iter().map(|r| r.1).max().unwrap_or(0);
        let ws = match most {
            0 => None,
            _ => match self.temp(most) {
                Ok(ws) => Some(ws),
                Err(Error::OutOfMemory { .. }) => return Ok(Ranked::Plan(ranked, false)),
                Err(e) => return Err(e),
            },
        };
        let ws_ptr = ws.as_ref().map(|w| w.ptr()).unwrap_or(0);
        let mut timed = [NO_PERF; MAX_ALGOS];
        let mut n: c_int = 0;
        // SAFETY: as above; the search writes the output, which this call
        // computes next anyway, and uses the workspace it is given.
        let st = unsafe {
            (api.find[k])(
                dnn.handle.0,
                ad,
                a as *const c_void,
                bd,
                b as *const c_void,
                d.conv,
                od,
                o as H,
                MAX_ALGOS as c_int,
                &mut n,
                timed.as_mut_ptr(),
                ws_ptr as H,
                most,
            )
        };
        if st != SUCCESS {
            return Ok(Ranked::Refused("the cuDNN algorithm search", st));
        }
        let mut order: Vec<(c_int, usize)> = Vec::new();
        for p in timed.iter().take((n.max(0) as usize).min(MAX_ALGOS)).filter(|p| usable(p) && p.memory <= most) {
            if let Some(r) = ranked.iter().find(|r| r.0 == p.algo)
                && !order.iter().any(|o| o.0 == p.algo)
            {
                order.push(*r);
            }
        }
        if order.is_empty() {
            // Every algorithm failed its timed run (cuDNN says so per
            // algorithm): the heuristics' order for this call, and the
            // search again at the next.
            return Ok(Ranked::Plan(ranked, false));
        }
        // Those the search did not report, after the timed ones.
        for r in &ranked {
            if !order.iter().any(|o| o.0 == r.0) {
                order.push(*r);
            }
        }
        Ok(Ranked::Plan(order, true))
    }
}

/// What ranking the algorithms gave: a plan (and whether to keep it for the
/// shape), or the call and status with which cuDNN refused.
enum Ranked {
    Plan(Vec<(c_int, usize)>, bool),
    Refused(&'static str, Status),
}

/// Whether status `st` of cuDNN `major` says it does not take the call (a
/// bad or unsupported parameter, or a device or runtime it cannot serve)
/// rather than that it failed: cuDNN 9's `BAD_PARAM*` (2000s) and
/// `NOT_SUPPORTED*` (3000s); cuDNN 8's `BAD_PARAM` (3), `ARCH_MISMATCH` (6),
/// `NOT_SUPPORTED` (9) and `RUNTIME_PREREQUISITE_MISSING` (11).
fn refuses(major: usize, st: Status) -> bool {
    if major >= 9 {
        (2000..4000).contains(&st)
    } else {
        matches!(st, 3 | 6 | 9 | 11)
    }
}
