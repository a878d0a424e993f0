//! cuDNN's convolutions: the calls kiln makes (handles, 4-d tensor, filter
//! and convolution descriptors, algorithm heuristics and search, workspace
//! sizes, forward / backward-data / backward-filter) over a reference
//! implementation that runs on the handle's stream.
//!
//! What it checks, as cuDNN documents (`CUDNN_STATUS_BAD_PARAM` otherwise):
//! descriptors made and set, one data type for every operand, the filter's
//! channels equal to the input's divided by the group count, the group count
//! dividing the output channels, the output tensor equal to
//! `cudnnGetConvolution2dForwardOutputDim`'s, an algorithm of the right
//! family, non-null alpha and beta, and a workspace at least as large as
//! the algorithm needs (non-null when that is not zero). When the call runs
//! on the stream, every pointer is checked to hold what the descriptors
//! reach (a fault naming the call otherwise, as for a kernel), and the
//! workspace is overwritten, so that a caller that reads it afterwards, or
//! lets other work use it while the call is queued, gets garbage as on a GPU.
//!
//! The algorithms it offers, per direction: one with no workspace and one
//! that needs one image's unfolded input (`C·kh·kw·oh·ow` elements), listed
//! first by the heuristics forward. Backward, the one without workspace is
//! listed first and marked non-deterministic (as cuDNN's `ALGO_0`s, which
//! use atomics), so a caller that wants deterministic results must skip it
//! and take the one with workspace. Every
//! algorithm computes the same reference: products summed in f64 (f32 inputs
//! rounded to TF32 first when the descriptor's math type allows tensor
//! cores), then `alpha·sum + beta·out` (out not read when beta is 0).
//! Status codes are cuDNN 9's.

use crate::blas::{load, store, tf32, Ty};
use crate::{check_range, current, injected_failure, lock, log, stream_of, Ctx, Op, Sim, Stream};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

pub type Status = c_int;
const SUCCESS: Status = 0;
const NOT_INITIALIZED: Status = 1001;
const BAD_PARAM: Status = 2000;
const BAD_PARAM_NULL_POINTER: Status = 2002;
const NOT_SUPPORTED: Status = 3000;
const ALLOC_FAILED: Status = 4003;
const EXECUTION_FAILED: Status = 5000;

const DATA_FLOAT: c_int = 0;
const DATA_DOUBLE: c_int = 1;
const TENSOR_NCHW: c_int = 0;
const CONVOLUTION: c_int = 0;
const CROSS_CORRELATION: c_int = 1;
const FMA_MATH: c_int = 3;
const NON_DETERMINISTIC: c_int = 0;
const DETERMINISTIC: c_int = 1;

/// The version reported: 9.1.0.
const VERSION: usize = 90100;

/// Which convolution a call computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    Forward,
    BackwardData,
    BackwardFilter,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Forward => "cudnnConvolutionForward",
            Dir::BackwardData => "cudnnConvolutionBackwardData",
            Dir::BackwardFilter => "cudnnConvolutionBackwardFilter",
        }
    }
    /// The algorithms offered, best first: (algo, needs workspace, deterministic).
    fn algos(self) -> [(c_int, bool, bool); 2] {
        match self {
            // IMPLICIT_PRECOMP_GEMM, IMPLICIT_GEMM.
            Dir::Forward => [(1, true, true), (0, false, true)],
            // ALGO_0 (atomics: non-deterministic), then ALGO_1, as cuDNN
            // often ranks them.
            Dir::BackwardData | Dir::BackwardFilter => [(0, false, false), (1, true, true)],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dims {
    ty: Ty,
    n: usize,
    c: usize,
    h: usize,
    w: usize,
}

#[derive(Clone, Copy, Debug)]
struct ConvDesc {
    /// pad, stride, dilation: (h, w) each.
    pad: (usize, usize),
    stride: (usize, usize),
    dil: (usize, usize),
    mode: c_int,
    compute: c_int,
    groups: usize,
    math: c_int,
}

#[derive(Clone, Copy, Debug)]
enum Desc {
    Tensor(Option<Dims>),
    Filter(Option<Dims>),
    Conv(Option<ConvDesc>),
}

struct Handle {
    ctx: &'static Ctx,
    stream: Mutex<Option<Arc<Stream>>>,
}

/// Live handles and descriptors, by the address given out.
#[derive(Default)]
struct Registry {
    handles: HashMap<usize, Arc<Handle>>,
    descs: HashMap<usize, Desc>,
    next: usize,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Registry { next: 0xd00_0000, ..Default::default() }))
}

fn new_id(r: &mut Registry) -> usize {
    r.next += 16;
    r.next
}

fn handle(h: *mut c_void) -> Option<Arc<Handle>> {
    lock(registry()).handles.get(&(h as usize)).cloned()
}

fn desc(d: *mut c_void) -> Option<Desc> {
    lock(registry()).descs.get(&(d as usize)).copied()
}

fn tensor(d: *mut c_void) -> Option<Dims> {
    match desc(d)? {
        Desc::Tensor(t) => t,
        _ => None,
    }
}

fn filter(d: *mut c_void) -> Option<Dims> {
    match desc(d)? {
        Desc::Filter(f) => f,
        _ => None,
    }
}

fn conv(d: *mut c_void) -> Option<ConvDesc> {
    match desc(d)? {
        Desc::Conv(c) => c,
        _ => None,
    }
}

fn ty_of(code: c_int) -> Option<Ty> {
    match code {
        DATA_FLOAT => Some(Ty::F32),
        DATA_DOUBLE => Some(Ty::F64),
        _ => None,
    }
}

/// The output of `x` under `w` and `c`, as cuDNN computes it; None when the
/// three do not fit together.
fn out_dims(x: Dims, w: Dims, c: ConvDesc) -> Option<Dims> {
    if x.ty != w.ty || c.groups == 0 || x.c != w.c * c.groups || !w.n.is_multiple_of(c.groups) {
        return None;
    }
    let side = |len: usize, pad: usize, k: usize, d: usize, s: usize| -> Option<usize> {
        let span = d * (k - 1) + 1;
        let padded = len + 2 * pad;
        (padded >= span && s > 0).then(|| (padded - span) / s + 1)
    };
    Some(Dims {
        ty: x.ty,
        n: x.n,
        c: w.n,
        h: side(x.h, c.pad.0, w.h, c.dil.0, c.stride.0)?,
        w: side(x.w, c.pad.1, w.w, c.dil.1, c.stride.1)?,
    })
}

/// One convolution, queued on the handle's stream.
pub(crate) struct Conv {
    dir: Dir,
    x: Dims,
    w: Dims,
    y: Dims,
    c: ConvDesc,
    /// x, w, y: for backward, dx, dw and dy where they are written/read.
    px: u64,
    pw: u64,
    py: u64,
    alpha: f64,
    beta: f64,
    ws: u64,
    ws_bytes: usize,
}

/// Workspace bytes algorithm `algo` of `dir` needs for these operands (None
/// for an algorithm it does not offer, or a size past usize).
fn workspace(dir: Dir, algo: c_int, x: Dims, w: Dims, y: Dims) -> Option<usize> {
    let &(_, needs, _) = dir.algos().iter().find(|a| a.0 == algo)?;
    if !needs {
        return Some(0);
    }
    [w.h, w.w, y.h, y.w, x.ty.size()].iter().try_fold(x.c, |acc, &v| acc.checked_mul(v))
}

impl Conv {
    fn len(d: Dims) -> usize {
        d.n * d.c * d.h * d.w
    }

    pub(crate) fn run(&self, sim: &Sim, dev: usize) -> Result<(), String> {
        let what = |s: &str| format!("{} (x {:?}, w {:?}, y {:?}) {s}", self.dir.name(), self.x, self.w, self.y);
        let size = self.x.ty.size();
        let (out, out_len) = match self.dir {
            Dir::Forward => (self.py, Conv::len(self.y)),
            Dir::BackwardData => (self.px, Conv::len(self.x)),
            Dir::BackwardFilter => (self.pw, Conv::len(self.w)),
        };
        for (p, len, role) in [(self.px, Conv::len(self.x), "x"), (self.pw, Conv::len(self.w), "w"), (self.py, Conv::len(self.y), "y")] {
            let doing = if p == out { "writing" } else { "reading" };
            check_range(sim, dev, p, len * size, &what(&format!("{doing} {role}")))?;
        }
        check_range(sim, dev, self.ws, self.ws_bytes, &what("using its workspace"))?;
        let (x, w, y, c) = (self.x, self.w, self.y, self.c);
        let (cg, kg) = (x.c / c.groups, w.n / c.groups);
        let tf = self.x.ty == Ty::F32 && c.math != FMA_MATH;
        let rd = |p: u64, i: usize| {
            // SAFETY: every index below lies in the extents checked above.
            let v = unsafe { load(x.ty, p, i) };
            if tf {
                tf32(v)
            } else {
                v
            }
        };
        // The filter tap that meets input offset (ky, kx) (flipped for true convolution).
        let tap = |ky: usize, kx: usize| if c.mode == CONVOLUTION { (w.h - 1 - ky, w.w - 1 - kx) } else { (ky, kx) };
        let mut sums = vec![0f64; out_len];
        for n in 0..y.n {
            for k in 0..y.c {
                let g = k / kg;
                for oy in 0..y.h {
                    for ox in 0..y.w {
                        let yi = ((n * y.c + k) * y.h + oy) * y.w + ox;
                        for ci in 0..cg {
                            let xc = g * cg + ci;
                            for ky in 0..w.h {
                                let iy = (oy * c.stride.0 + ky * c.dil.0) as isize - c.pad.0 as isize;
                                if iy < 0 || iy >= x.h as isize {
                                    continue;
                                }
                                for kx in 0..w.w {
                                    let ix = (ox * c.stride.1 + kx * c.dil.1) as isize - c.pad.1 as isize;
                                    if ix < 0 || ix >= x.w as isize {
                                        continue;
                                    }
                                    let xi = ((n * x.c + xc) * x.h + iy as usize) * x.w + ix as usize;
                                    let (ty, tx) = tap(ky, kx);
                                    let wi = ((k * w.c + ci) * w.h + ty) * w.w + tx;
                                    match self.dir {
                                        Dir::Forward => sums[yi] += rd(self.px, xi) * rd(self.pw, wi),
                                        Dir::BackwardData => sums[xi] += rd(self.py, yi) * rd(self.pw, wi),
                                        Dir::BackwardFilter => sums[wi] += rd(self.py, yi) * rd(self.px, xi),
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // The workspace's contents are the algorithm's own: overwrite them.
        // SAFETY: checked live for ws_bytes above.
        if self.ws_bytes > 0 {
            unsafe { std::ptr::write_bytes(self.ws as *mut u8, 0xA5, self.ws_bytes) };
        }
        for (i, s) in sums.into_iter().enumerate() {
            // beta == 0: the output is not read (it may hold NaN), as cuDNN documents.
            // SAFETY: inside the checked extent of the output.
            unsafe {
                let old = if self.beta == 0.0 { 0.0 } else { self.beta * load(x.ty, out, i) };
                store(x.ty, out, i, self.alpha * s + old);
            }
        }
        if crate::census::enabled() {
            let ty = match x.ty {
                Ty::F16 => "f16",
                Ty::F32 => "f32",
                Ty::F64 => "f64",
            };
            let dir = match self.dir {
                Dir::Forward => "fwd",
                Dir::BackwardData => "bwd_data",
                Dir::BackwardFilter => "bwd_filter",
            };
            crate::census::record(crate::census::Record {
                kind: "dnn",
                device: dev,
                name: format!("cudnn:conv_{dir}_{ty}"),
                arg_bytes: crate::census::reachable_bytes(&lock(&sim.mem), [self.px, self.pw, self.py]),
                m: y.c as u64,
                n: (y.h * y.w) as u64,
                k: (cg * w.h * w.w) as u64,
                batch: y.n as u64,
                macs: (y.n * y.c * y.h * y.w * cg * w.h * w.w) as u64,
                ..Default::default()
            });
        }
        Ok(())
    }
}

// ---- handles ------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn cudnnGetVersion() -> usize {
    VERSION
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnGetErrorString(s: Status) -> *const c_char {
    let text: &'static [u8] = match s {
        SUCCESS => b"CUDNN_STATUS_SUCCESS\0",
        NOT_INITIALIZED => b"CUDNN_STATUS_NOT_INITIALIZED\0",
        BAD_PARAM => b"CUDNN_STATUS_BAD_PARAM\0",
        BAD_PARAM_NULL_POINTER => b"CUDNN_STATUS_BAD_PARAM_NULL_POINTER\0",
        NOT_SUPPORTED => b"CUDNN_STATUS_NOT_SUPPORTED\0",
        ALLOC_FAILED => b"CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED\0",
        EXECUTION_FAILED => b"CUDNN_STATUS_EXECUTION_FAILED\0",
        _ => b"CUDNN_STATUS_UNKNOWN\0",
    };
    text.as_ptr() as *const c_char
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnCreate(out: *mut *mut c_void) -> Status {
    let Ok(ctx) = current() else {
        log("cudnnCreate: no current CUDA context");
        return NOT_INITIALIZED;
    };
    if out.is_null() {
        return BAD_PARAM_NULL_POINTER;
    }
    if injected_failure("cudnnCreate") {
        return ALLOC_FAILED;
    }
    let mut r = lock(registry());
    let id = new_id(&mut r);
    r.handles.insert(id, Arc::new(Handle { ctx, stream: Mutex::new(None) }));
    // SAFETY: checked non-null; the caller's out-pointer.
    unsafe { *out = id as *mut c_void };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnDestroy(h: *mut c_void) -> Status {
    if lock(registry()).handles.remove(&(h as usize)).is_some() {
        SUCCESS
    } else {
        BAD_PARAM
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetStream(h: *mut c_void, stream: *mut c_void) -> Status {
    let Some(hd) = handle(h) else { return BAD_PARAM };
    match stream_of(stream, hd.ctx) {
        Ok(s) if std::ptr::eq(s.ctx, hd.ctx) => {
            *lock(&hd.stream) = Some(s);
            SUCCESS
        }
        _ => BAD_PARAM,
    }
}

// ---- descriptors ----------------------------------------------------------------

unsafe fn create(out: *mut *mut c_void, d: Desc) -> Status {
    if out.is_null() {
        return BAD_PARAM_NULL_POINTER;
    }
    let mut r = lock(registry());
    let id = new_id(&mut r);
    r.descs.insert(id, d);
    // SAFETY: checked non-null; the caller's out-pointer.
    unsafe { *out = id as *mut c_void };
    SUCCESS
}

fn destroy(d: *mut c_void, kind: fn(&Desc) -> bool) -> Status {
    let mut r = lock(registry());
    match r.descs.get(&(d as usize)) {
        Some(x) if kind(x) => {
            r.descs.remove(&(d as usize));
            SUCCESS
        }
        _ => BAD_PARAM,
    }
}

fn set(d: *mut c_void, new: Desc) -> Status {
    let mut r = lock(registry());
    match r.descs.get_mut(&(d as usize)) {
        Some(old) if std::mem::discriminant(old) == std::mem::discriminant(&new) => {
            *old = new;
            SUCCESS
        }
        _ => BAD_PARAM,
    }
}

fn dims4(ty: c_int, format: c_int, n: c_int, c: c_int, h: c_int, w: c_int) -> Option<Dims> {
    if format != TENSOR_NCHW || [n, c, h, w].iter().any(|&v| v <= 0) {
        return None;
    }
    // cuDNN's tensors hold fewer than 2^31 elements.
    let len = n as i128 * c as i128 * h as i128 * w as i128;
    (len < i32::MAX as i128).then_some(Dims { ty: ty_of(ty)?, n: n as usize, c: c as usize, h: h as usize, w: w as usize })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnCreateTensorDescriptor(out: *mut *mut c_void) -> Status {
    unsafe { create(out, Desc::Tensor(None)) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnDestroyTensorDescriptor(d: *mut c_void) -> Status {
    destroy(d, |x| matches!(x, Desc::Tensor(_)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetTensor4dDescriptor(d: *mut c_void, format: c_int, ty: c_int, n: c_int, c: c_int, h: c_int, w: c_int) -> Status {
    match dims4(ty, format, n, c, h, w) {
        Some(t) => set(d, Desc::Tensor(Some(t))),
        None => BAD_PARAM,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnCreateFilterDescriptor(out: *mut *mut c_void) -> Status {
    unsafe { create(out, Desc::Filter(None)) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnDestroyFilterDescriptor(d: *mut c_void) -> Status {
    destroy(d, |x| matches!(x, Desc::Filter(_)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetFilter4dDescriptor(d: *mut c_void, ty: c_int, format: c_int, k: c_int, c: c_int, h: c_int, w: c_int) -> Status {
    match dims4(ty, format, k, c, h, w) {
        Some(f) => set(d, Desc::Filter(Some(f))),
        None => BAD_PARAM,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnCreateConvolutionDescriptor(out: *mut *mut c_void) -> Status {
    unsafe { create(out, Desc::Conv(None)) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnDestroyConvolutionDescriptor(d: *mut c_void) -> Status {
    destroy(d, |x| matches!(x, Desc::Conv(_)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetConvolution2dDescriptor(
    d: *mut c_void,
    pad_h: c_int,
    pad_w: c_int,
    u: c_int,
    v: c_int,
    dil_h: c_int,
    dil_w: c_int,
    mode: c_int,
    compute: c_int,
) -> Status {
    if pad_h < 0
        || pad_w < 0
        || u <= 0
        || v <= 0
        || dil_h <= 0
        || dil_w <= 0
        || !matches!(mode, CONVOLUTION | CROSS_CORRELATION)
        || ty_of(compute).is_none()
    {
        return BAD_PARAM;
    }
    let (groups, math) = match desc(d) {
        Some(Desc::Conv(Some(old))) => (old.groups, old.math),
        _ => (1, 0),
    };
    let c = ConvDesc {
        pad: (pad_h as usize, pad_w as usize),
        stride: (u as usize, v as usize),
        dil: (dil_h as usize, dil_w as usize),
        mode,
        compute,
        groups,
        math,
    };
    set(d, Desc::Conv(Some(c)))
}

/// Changes a set convolution descriptor (BAD_PARAM before it is set).
fn update(d: *mut c_void, f: impl FnOnce(&mut ConvDesc)) -> Status {
    let mut r = lock(registry());
    match r.descs.get_mut(&(d as usize)) {
        Some(Desc::Conv(Some(c))) => {
            f(c);
            SUCCESS
        }
        _ => BAD_PARAM,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetConvolutionGroupCount(d: *mut c_void, groups: c_int) -> Status {
    if groups <= 0 {
        return BAD_PARAM;
    }
    update(d, |c| c.groups = groups as usize)
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetConvolutionMathType(d: *mut c_void, math: c_int) -> Status {
    if !(0..=3).contains(&math) {
        return BAD_PARAM;
    }
    update(d, |c| c.math = math)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolution2dForwardOutputDim(
    cd: *mut c_void,
    xd: *mut c_void,
    wd: *mut c_void,
    n: *mut c_int,
    c: *mut c_int,
    h: *mut c_int,
    w: *mut c_int,
) -> Status {
    let (Some(cv), Some(x), Some(f)) = (conv(cd), tensor(xd), filter(wd)) else { return BAD_PARAM };
    if [n, c, h, w].iter().any(|p| p.is_null()) {
        return BAD_PARAM_NULL_POINTER;
    }
    let Some(y) = out_dims(x, f, cv) else { return BAD_PARAM };
    // SAFETY: checked non-null; the caller's out-pointers.
    unsafe {
        *n = y.n as c_int;
        *c = y.c as c_int;
        *h = y.h as c_int;
        *w = y.w as c_int;
    }
    SUCCESS
}

// ---- algorithms ---------------------------------------------------------------

/// cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (one layout for all three).
#[repr(C)]
pub struct AlgoPerf {
    algo: c_int,
    status: Status,
    time: f32,
    memory: usize,
    determinism: c_int,
    math_type: c_int,
    reserved: [c_int; 3],
}

/// The operands of a call, checked to fit together: (x, w, y, conv).
fn operands(xd: *mut c_void, wd: *mut c_void, cd: *mut c_void, yd: *mut c_void) -> Result<(Dims, Dims, Dims, ConvDesc), Status> {
    let (Some(x), Some(w), Some(c), Some(y)) = (tensor(xd), filter(wd), conv(cd), tensor(yd)) else {
        log("cuDNN: a descriptor is not made or not set");
        return Err(BAD_PARAM);
    };
    if ty_of(c.compute) != Some(x.ty) {
        log(&format!("cuDNN: compute type {} for {:?} data (kiln's convolutions compute in their data type)", c.compute, x.ty));
        return Err(NOT_SUPPORTED);
    }
    match out_dims(x, w, c) {
        Some(o) if o == y => Ok((x, w, y, c)),
        o => {
            log(&format!("cuDNN: output {y:?} does not match {o:?} for input {x:?}, filter {w:?} and {c:?}"));
            Err(BAD_PARAM)
        }
    }
}

unsafe fn algorithms(
    dir: Dir,
    ops: Result<(Dims, Dims, Dims, ConvDesc), Status>,
    requested: c_int,
    returned: *mut c_int,
    perf: *mut AlgoPerf,
) -> Status {
    let (x, w, y, c) = match ops {
        Ok(o) => o,
        Err(s) => return s,
    };
    if returned.is_null() || perf.is_null() {
        return BAD_PARAM_NULL_POINTER;
    }
    if requested <= 0 {
        return BAD_PARAM;
    }
    let algos = dir.algos();
    let count = algos.len().min(requested as usize);
    for (i, &(algo, _, det)) in algos.iter().take(count).enumerate() {
        // SAFETY: the caller's array of `requested` entries.
        unsafe {
            *perf.add(i) = AlgoPerf {
                algo,
                status: SUCCESS,
                time: (i + 1) as f32,
                memory: workspace(dir, algo, x, w, y).unwrap_or(0),
                determinism: if det { DETERMINISTIC } else { NON_DETERMINISTIC },
                math_type: c.math,
                reserved: [0; 3],
            };
        }
    }
    // SAFETY: checked non-null.
    unsafe { *returned = count as c_int };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionForwardAlgorithm_v7(
    h: *mut c_void,
    xd: *mut c_void,
    wd: *mut c_void,
    cd: *mut c_void,
    yd: *mut c_void,
    requested: c_int,
    returned: *mut c_int,
    perf: *mut AlgoPerf,
) -> Status {
    if handle(h).is_none() {
        return BAD_PARAM;
    }
    unsafe { algorithms(Dir::Forward, operands(xd, wd, cd, yd), requested, returned, perf) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardDataAlgorithm_v7(
    h: *mut c_void,
    wd: *mut c_void,
    dyd: *mut c_void,
    cd: *mut c_void,
    dxd: *mut c_void,
    requested: c_int,
    returned: *mut c_int,
    perf: *mut AlgoPerf,
) -> Status {
    if handle(h).is_none() {
        return BAD_PARAM;
    }
    unsafe { algorithms(Dir::BackwardData, operands(dxd, wd, cd, dyd), requested, returned, perf) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    h: *mut c_void,
    xd: *mut c_void,
    dyd: *mut c_void,
    cd: *mut c_void,
    dwd: *mut c_void,
    requested: c_int,
    returned: *mut c_int,
    perf: *mut AlgoPerf,
) -> Status {
    if handle(h).is_none() {
        return BAD_PARAM;
    }
    unsafe { algorithms(Dir::BackwardFilter, operands(xd, dwd, cd, dyd), requested, returned, perf) }
}

unsafe fn workspace_size(dir: Dir, ops: Result<(Dims, Dims, Dims, ConvDesc), Status>, algo: c_int, out: *mut usize) -> Status {
    let (x, w, y, _) = match ops {
        Ok(o) => o,
        Err(s) => return s,
    };
    if out.is_null() {
        return BAD_PARAM_NULL_POINTER;
    }
    match workspace(dir, algo, x, w, y) {
        Some(b) => {
            // SAFETY: checked non-null.
            unsafe { *out = b };
            SUCCESS
        }
        None => BAD_PARAM,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionForwardWorkspaceSize(
    h: *mut c_void,
    xd: *mut c_void,
    wd: *mut c_void,
    cd: *mut c_void,
    yd: *mut c_void,
    algo: c_int,
    out: *mut usize,
) -> Status {
    if handle(h).is_none() {
        return BAD_PARAM;
    }
    unsafe { workspace_size(Dir::Forward, operands(xd, wd, cd, yd), algo, out) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardDataWorkspaceSize(
    h: *mut c_void,
    wd: *mut c_void,
    dyd: *mut c_void,
    cd: *mut c_void,
    dxd: *mut c_void,
    algo: c_int,
    out: *mut usize,
) -> Status {
    if handle(h).is_none() {
        return BAD_PARAM;
    }
    unsafe { workspace_size(Dir::BackwardData, operands(dxd, wd, cd, dyd), algo, out) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardFilterWorkspaceSize(
    h: *mut c_void,
    xd: *mut c_void,
    dyd: *mut c_void,
    cd: *mut c_void,
    dwd: *mut c_void,
    algo: c_int,
    out: *mut usize,
) -> Status {
    if handle(h).is_none() {
        return BAD_PARAM;
    }
    unsafe { workspace_size(Dir::BackwardFilter, operands(xd, dwd, cd, dyd), algo, out) }
}

// ---- running --------------------------------------------------------------------

/// Checks a call and queues it on the handle's stream.
#[allow(clippy::too_many_arguments)]
unsafe fn submit(
    dir: Dir,
    h: *mut c_void,
    ops: Result<(Dims, Dims, Dims, ConvDesc), Status>,
    (px, pw, py): (u64, u64, u64),
    algo: c_int,
    alpha: *const c_void,
    beta: *const c_void,
    ws: *mut c_void,
    ws_bytes: usize,
    searching: bool,
) -> Status {
    let Some(hd) = handle(h) else { return BAD_PARAM };
    let (x, w, y, c) = match ops {
        Ok(o) => o,
        Err(s) => return s,
    };
    if alpha.is_null() || beta.is_null() {
        return BAD_PARAM_NULL_POINTER;
    }
    let Some(need) = workspace(dir, algo, x, w, y) else {
        log(&format!("{}: algorithm {algo} is not one of this direction's", dir.name()));
        return BAD_PARAM;
    };
    if ws_bytes < need || (need > 0 && ws.is_null()) {
        log(&format!("{}: algorithm {algo} needs {need} bytes of workspace, given {ws_bytes} at {ws:?}", dir.name()));
        return BAD_PARAM;
    }
    // Injected failures are for the calls a program makes, not the runs of
    // a search (which has its own: `<call>.search`).
    if !searching && injected_failure(dir.name()) {
        return EXECUTION_FAILED;
    }
    // `<call>.unsupported`: the call refuses its operands, as cuDNN does
    // when an algorithm cannot take them (a pointer's alignment, say).
    if !searching && injected_failure(&format!("{}.unsupported", dir.name())) {
        return NOT_SUPPORTED;
    }
    if !searching {
        LAST_ALGO.store(algo as i64, std::sync::atomic::Ordering::SeqCst);
    }
    // SAFETY: alpha and beta point to the data type's scalars (double for
    // double data, float otherwise), as cuDNN documents.
    let (alpha, beta) = unsafe {
        match x.ty {
            Ty::F64 => (*(alpha as *const f64), *(beta as *const f64)),
            Ty::F32 | Ty::F16 => (*(alpha as *const f32) as f64, *(beta as *const f32) as f64),
        }
    };
    let stream = lock(&hd.stream).clone().unwrap_or_else(|| hd.ctx.default_stream());
    CONVS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    stream.push(Op::Dnn(Box::new(Conv { dir, x, w, y, c, px, pw, py, alpha, beta, ws: ws as u64, ws_bytes: need })));
    SUCCESS
}

/// The algorithm of the last convolution a program ran (not a search's),
/// -1 before any (`kiln_cudasim_stat("cudnn_last_algo")`).
pub(crate) static LAST_ALGO: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(-1);

/// cuDNN convolutions queued so far (`kiln_cudasim_stat("cudnn_convs")`).
pub(crate) static CONVS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnConvolutionForward(
    h: *mut c_void,
    alpha: *const c_void,
    xd: *mut c_void,
    x: *const c_void,
    wd: *mut c_void,
    w: *const c_void,
    cd: *mut c_void,
    algo: c_int,
    ws: *mut c_void,
    ws_bytes: usize,
    beta: *const c_void,
    yd: *mut c_void,
    y: *mut c_void,
) -> Status {
    unsafe { submit(Dir::Forward, h, operands(xd, wd, cd, yd), (x as u64, w as u64, y as u64), algo, alpha, beta, ws, ws_bytes, false) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnConvolutionBackwardData(
    h: *mut c_void,
    alpha: *const c_void,
    wd: *mut c_void,
    w: *const c_void,
    dyd: *mut c_void,
    dy: *const c_void,
    cd: *mut c_void,
    algo: c_int,
    ws: *mut c_void,
    ws_bytes: usize,
    beta: *const c_void,
    dxd: *mut c_void,
    dx: *mut c_void,
) -> Status {
    unsafe {
        submit(Dir::BackwardData, h, operands(dxd, wd, cd, dyd), (dx as u64, w as u64, dy as u64), algo, alpha, beta, ws, ws_bytes, false)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnConvolutionBackwardFilter(
    h: *mut c_void,
    alpha: *const c_void,
    xd: *mut c_void,
    x: *const c_void,
    dyd: *mut c_void,
    dy: *const c_void,
    cd: *mut c_void,
    algo: c_int,
    ws: *mut c_void,
    ws_bytes: usize,
    beta: *const c_void,
    dwd: *mut c_void,
    dw: *mut c_void,
) -> Status {
    unsafe {
        submit(Dir::BackwardFilter, h, operands(xd, dwd, cd, dyd), (x as u64, dw as u64, dy as u64), algo, alpha, beta, ws, ws_bytes, false)
    }
}

/// The search (`cudnnFind*AlgorithmEx`): runs every algorithm whose
/// workspace fits (the output is overwritten, as cuDNN's search does) and
/// reports them fastest first, where the fastest is the heuristics' last
/// (so the two orders differ), then those that failed or did not fit (with
/// their status, or `CUDNN_STATUS_ALLOC_FAILED`). `KILN_CUDASIM_FAIL` names
/// `<call>.search` for a search that fails as a whole.
#[allow(clippy::too_many_arguments)]
unsafe fn find(
    dir: Dir,
    h: *mut c_void,
    ops: Result<(Dims, Dims, Dims, ConvDesc), Status>,
    ptrs: (u64, u64, u64),
    requested: c_int,
    returned: *mut c_int,
    perf: *mut AlgoPerf,
    ws: *mut c_void,
    ws_bytes: usize,
) -> Status {
    unsafe {
        let st = algorithms(dir, ops, requested, returned, perf);
        if st != SUCCESS {
            return st;
        }
        let (one32, zero32, one64, zero64) = (1f32, 0f32, 1f64, 0f64);
        let f64_data = matches!(ops, Ok((x, ..)) if x.ty == Ty::F64);
        let (alpha, beta) = if f64_data {
            (&one64 as *const f64 as *const c_void, &zero64 as *const f64 as *const c_void)
        } else {
            (&one32 as *const f32 as *const c_void, &zero32 as *const f32 as *const c_void)
        };
        if injected_failure(&format!("{}.search", dir.name())) {
            return EXECUTION_FAILED;
        }
        let n = *returned as usize;
        let mut entries: Vec<AlgoPerf> = (0..n).map(|i| std::ptr::read(perf.add(i))).collect();
        for (i, e) in entries.iter_mut().enumerate() {
            if e.memory > ws_bytes {
                e.status = ALLOC_FAILED;
                e.time = -1.0;
                continue;
            }
            // As cuDNN does, an algorithm that fails is marked and the
            // search goes on.
            let st = submit(dir, h, ops, ptrs, e.algo, alpha, beta, ws, ws_bytes, true);
            if st != SUCCESS {
                e.status = st;
                e.time = -1.0;
                continue;
            }
            // The timings: the heuristics' last is the fastest here, so
            // that a caller that takes the timed order is seen to.
            e.time = (n - i) as f32;
        }
        entries.sort_by(|a, b| (a.status != SUCCESS).cmp(&(b.status != SUCCESS)).then(a.time.total_cmp(&b.time)));
        for (i, e) in entries.into_iter().enumerate() {
            std::ptr::write(perf.add(i), e);
        }
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnFindConvolutionForwardAlgorithmEx(
    h: *mut c_void,
    xd: *mut c_void,
    x: *const c_void,
    wd: *mut c_void,
    w: *const c_void,
    cd: *mut c_void,
    yd: *mut c_void,
    y: *mut c_void,
    requested: c_int,
    returned: *mut c_int,
    perf: *mut AlgoPerf,
    ws: *mut c_void,
    ws_bytes: usize,
) -> Status {
    unsafe { find(Dir::Forward, h, operands(xd, wd, cd, yd), (x as u64, w as u64, y as u64), requested, returned, perf, ws, ws_bytes) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnFindConvolutionBackwardDataAlgorithmEx(
    h: *mut c_void,
    wd: *mut c_void,
    w: *const c_void,
    dyd: *mut c_void,
    dy: *const c_void,
    cd: *mut c_void,
    dxd: *mut c_void,
    dx: *mut c_void,
    requested: c_int,
    returned: *mut c_int,
    perf: *mut AlgoPerf,
    ws: *mut c_void,
    ws_bytes: usize,
) -> Status {
    unsafe {
        find(Dir::BackwardData, h, operands(dxd, wd, cd, dyd), (dx as u64, w as u64, dy as u64), requested, returned, perf, ws, ws_bytes)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnFindConvolutionBackwardFilterAlgorithmEx(
    h: *mut c_void,
    xd: *mut c_void,
    x: *const c_void,
    dyd: *mut c_void,
    dy: *const c_void,
    cd: *mut c_void,
    dwd: *mut c_void,
    dw: *mut c_void,
    requested: c_int,
    returned: *mut c_int,
    perf: *mut AlgoPerf,
    ws: *mut c_void,
    ws_bytes: usize,
) -> Status {
    unsafe {
        find(Dir::BackwardFilter, h, operands(xd, dwd, cd, dyd), (x as u64, dw as u64, dy as u64), requested, returned, perf, ws, ws_bytes)
    }
}
