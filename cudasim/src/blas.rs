//! cuBLAS: handles bound to the context current at creation, a stream per
//! handle, and a reference column-major gemm (strided batched; f32, f64, and
//! f16 through `cublasGemmStridedBatchedEx`) that validates its arguments as
//! the cuBLAS documentation says and runs on the handle's stream.

use crate::context::GEMMS;
use crate::{check_range, current, injected_failure, lock, log, stream_of, Ctx, Op, Sim, Stream};
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

pub type Status = u32;
const SUCCESS: Status = 0;
const NOT_INITIALIZED: Status = 1;
const ALLOC_FAILED: Status = 3;
const INVALID_VALUE: Status = 7;
const NOT_SUPPORTED: Status = 15;

const CUDA_R_16F: c_int = 2;
const CUDA_R_32F: c_int = 0;
const CUDA_R_64F: c_int = 1;
const COMPUTE_32F: c_int = 68;
const COMPUTE_32F_FAST_TF32: c_int = 77;
const TF32_TENSOR_OP_MATH: c_int = 3;

struct Handle {
    ctx: &'static Ctx,
    stream: Mutex<Option<Arc<Stream>>>,
    math_mode: Mutex<c_int>,
}

fn handles() -> &'static Mutex<std::collections::HashSet<usize>> {
    static H: std::sync::OnceLock<Mutex<std::collections::HashSet<usize>>> = std::sync::OnceLock::new();
    H.get_or_init(|| Mutex::new(std::collections::HashSet::new()))
}

fn handle(h: *mut c_void) -> Option<&'static Handle> {
    if h.is_null() || !lock(handles()).contains(&(h as usize)) {
        return None;
    }
    // SAFETY: registered handles are live boxed `Handle`s.
    Some(unsafe { &*(h as *const Handle) })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Ty {
    F16,
    F32,
    F64,
}

impl Ty {
    pub(crate) fn size(self) -> usize {
        match self {
            Ty::F16 => 2,
            Ty::F32 => 4,
            Ty::F64 => 8,
        }
    }
}

/// One strided-batched gemm, queued on the handle's stream.
pub(crate) struct Gemm {
    ty: Ty,
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f64,
    beta: f64,
    a: u64,
    lda: usize,
    sa: i64,
    b: u64,
    ldb: usize,
    sb: i64,
    c: u64,
    ldc: usize,
    sc: i64,
    count: usize,
    tf32: bool,
}

pub(crate) unsafe fn load(ty: Ty, p: u64, i: usize) -> f64 {
    unsafe {
        match ty {
            Ty::F16 => half::f16::from_bits(*(p as *const u16).add(i)).to_f64(),
            Ty::F32 => *(p as *const f32).add(i) as f64,
            Ty::F64 => *(p as *const f64).add(i),
        }
    }
}

pub(crate) unsafe fn store(ty: Ty, p: u64, i: usize, v: f64) {
    unsafe {
        match ty {
            Ty::F16 => *(p as *mut u16).add(i) = half::f16::from_f32(v as f32).to_bits(),
            Ty::F32 => *(p as *mut f32).add(i) = v as f32,
            Ty::F64 => *(p as *mut f64).add(i) = v,
        }
    }
}

/// f32 rounded to TF32 (10 mantissa bits, nearest even), as tensor cores read it.
pub(crate) fn tf32(v: f64) -> f64 {
    let bits = (v as f32).to_bits();
    let r = bits.wrapping_add(0xFFF + ((bits >> 13) & 1)) & !0x1FFF;
    f32::from_bits(r) as f64
}

impl Gemm {
    /// Bytes of one operand stored column-major with `rows` x `cols`, leading
    /// dimension `ld`, over the batch.
    fn extent(&self, rows: usize, cols: usize, ld: usize, stride: i64) -> usize {
        if rows == 0 || cols == 0 || self.count == 0 {
            return 0;
        }
        let last = (self.count - 1) as i64 * stride.max(0);
        (last as usize + (cols - 1) * ld + rows) * self.ty.size()
    }

    /// The launch census's record of this gemm (`census`): its shape and
    /// multiply-adds, and the allocations its operands lie in.
    fn record(&self, sim: &Sim, dev: usize) {
        let ty = match self.ty {
            Ty::F16 => "f16",
            Ty::F32 => "f32",
            Ty::F64 => "f64",
        };
        let (m, n, k, batch) = (self.m as u64, self.n as u64, self.k as u64, self.count as u64);
        crate::census::record(crate::census::Record {
            kind: "gemm",
            device: dev,
            name: format!("cublas:gemm_{ty}"),
            arg_bytes: crate::census::reachable_bytes(&lock(&sim.mem), [self.a, self.b, self.c]),
            m,
            n,
            k,
            batch,
            macs: m * n * k * batch,
            ..Default::default()
        });
    }

    pub(crate) fn run(&self, sim: &Sim, dev: usize) -> Result<(), String> {
        let (ar, ac) = if self.ta { (self.k, self.m) } else { (self.m, self.k) };
        let (br, bc) = if self.tb { (self.n, self.k) } else { (self.k, self.n) };
        let what = |s: &str| format!("cuBLAS gemm ({:?}, m={}, n={}, k={}, batch={}) {s}", self.ty, self.m, self.n, self.k, self.count);
        if self.k > 0 && self.alpha != 0.0 {
            check_range(sim, dev, self.a, self.extent(ar, ac, self.lda, self.sa), &what("reading A"))?;
            check_range(sim, dev, self.b, self.extent(br, bc, self.ldb, self.sb), &what("reading B"))?;
        }
        check_range(sim, dev, self.c, self.extent(self.m, self.n, self.ldc, self.sc), &what("writing C"))?;
        let rd = |v: f64| if self.tf32 { tf32(v) } else { v };
        for bi in 0..self.count {
            let (a, b, c) = (self.sa * bi as i64, self.sb * bi as i64, self.sc * bi as i64);
            for j in 0..self.n {
                for i in 0..self.m {
                    let mut acc = 0f64;
                    for p in 0..self.k {
                        let ai = if self.ta { p + i * self.lda } else { i + p * self.lda };
                        let bj = if self.tb { j + p * self.ldb } else { p + j * self.ldb };
                        // SAFETY: every index lies in the extents checked above.
                        let (x, y) = unsafe {
                            (load(self.ty, self.a, (a as usize).wrapping_add(ai)), load(self.ty, self.b, (b as usize).wrapping_add(bj)))
                        };
                        acc += rd(x) * rd(y);
                    }
                    let ci = (c as usize).wrapping_add(i + j * self.ldc);
                    // beta == 0: C is not read (it may hold NaN), as cuBLAS documents.
                    // SAFETY: inside the checked extent of C.
                    unsafe {
                        let old = if self.beta == 0.0 { 0.0 } else { self.beta * load(self.ty, self.c, ci) };
                        store(self.ty, self.c, ci, self.alpha * acc + old);
                    }
                }
            }
        }
        if crate::census::enabled() {
            self.record(sim, dev);
        }
        Ok(())
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasCreate_v2(out: *mut *mut c_void) -> Status {
    unsafe {
        let Ok(ctx) = current() else {
            log("cublasCreate: no current CUDA context");
            return NOT_INITIALIZED;
        };
        if out.is_null() {
            return INVALID_VALUE;
        }
        if injected_failure("cublasCreate_v2") {
            return ALLOC_FAILED;
        }
        let h = Box::into_raw(Box::new(Handle { ctx, stream: Mutex::new(None), math_mode: Mutex::new(0) })) as *mut c_void;
        lock(handles()).insert(h as usize);
        *out = h;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasDestroy_v2(h: *mut c_void) -> Status {
    unsafe {
        if !lock(handles()).remove(&(h as usize)) {
            return NOT_INITIALIZED;
        }
        drop(Box::from_raw(h as *mut Handle));
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasSetStream_v2(h: *mut c_void, stream: *mut c_void) -> Status {
    let Some(hd) = handle(h) else { return NOT_INITIALIZED };
    match stream_of(stream, hd.ctx) {
        Ok(s) if std::ptr::eq(s.ctx, hd.ctx) => {
            *lock(&hd.stream) = Some(s);
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasSetMathMode(h: *mut c_void, mode: c_int) -> Status {
    let Some(hd) = handle(h) else { return NOT_INITIALIZED };
    *lock(&hd.math_mode) = mode;
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasGetMathMode(h: *mut c_void, mode: *mut c_int) -> Status {
    unsafe {
        let Some(hd) = handle(h) else { return NOT_INITIALIZED };
        if mode.is_null() {
            return INVALID_VALUE;
        }
        *mode = *lock(&hd.math_mode);
        SUCCESS
    }
}

fn op(t: c_int) -> Option<bool> {
    match t {
        0 => Some(false),
        1 | 2 => Some(true), // real types: conjugate transpose is transpose
        _ => None,
    }
}

/// Validates as documented (cublas<t>gemmStridedBatched: "the parameters
/// m, n, k < 0, lda < max(1, m) if transa == N else max(1, k), ldb < max(1, k)
/// if transb == N else max(1, n), ldc < max(1, m), or batchCount < 0" give
/// CUBLAS_STATUS_INVALID_VALUE), then queues the gemm.
#[allow(clippy::too_many_arguments)]
unsafe fn submit(
    h: *mut c_void,
    ty: Ty,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f64,
    beta: f64,
    a: u64,
    lda: c_int,
    sa: i64,
    b: u64,
    ldb: c_int,
    sb: i64,
    c: u64,
    ldc: c_int,
    sc: i64,
    count: c_int,
    tf32_compute: bool,
) -> Status {
    let Some(hd) = handle(h) else { return NOT_INITIALIZED };
    let (Some(ta), Some(tb)) = (op(transa), op(transb)) else { return INVALID_VALUE };
    if m < 0 || n < 0 || k < 0 || count < 0 {
        return INVALID_VALUE;
    }
    let need_a = if ta { k } else { m }.max(1);
    let need_b = if tb { n } else { k }.max(1);
    if lda < need_a || ldb < need_b || ldc < m.max(1) {
        log(&format!(
            "cuBLAS gemm: invalid leading dimension (m={m} n={n} k={k} lda={lda} (needs >= {need_a}) ldb={ldb} (needs >= {need_b}) ldc={ldc} (needs >= {}))",
            m.max(1)
        ));
        return INVALID_VALUE;
    }
    if m == 0 || n == 0 || count == 0 {
        return SUCCESS;
    }
    let stream = match lock(&hd.stream).clone() {
        Some(s) => s,
        None => hd.ctx.default_stream(),
    };
    let tf32 = tf32_compute || (ty == Ty::F32 && *lock(&hd.math_mode) == TF32_TENSOR_OP_MATH);
    let g = Gemm {
        ty,
        ta,
        tb,
        m: m as usize,
        n: n as usize,
        k: k as usize,
        alpha,
        beta,
        a,
        lda: lda as usize,
        sa,
        b,
        ldb: ldb as usize,
        sb,
        c,
        ldc: ldc as usize,
        sc,
        count: count as usize,
        tf32,
    };
    GEMMS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    stream.push(Op::Gemm(g));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasSgemmStridedBatched(
    h: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    sa: i64,
    b: *const f32,
    ldb: c_int,
    sb: i64,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
    sc: i64,
    count: c_int,
) -> Status {
    unsafe {
        if alpha.is_null() || beta.is_null() {
            return INVALID_VALUE;
        }
        submit(
            h,
            Ty::F32,
            transa,
            transb,
            m,
            n,
            k,
            *alpha as f64,
            *beta as f64,
            a as u64,
            lda,
            sa,
            b as u64,
            ldb,
            sb,
            c as u64,
            ldc,
            sc,
            count,
            false,
        )
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasDgemmStridedBatched(
    h: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f64,
    a: *const f64,
    lda: c_int,
    sa: i64,
    b: *const f64,
    ldb: c_int,
    sb: i64,
    beta: *const f64,
    c: *mut f64,
    ldc: c_int,
    sc: i64,
    count: c_int,
) -> Status {
    unsafe {
        if alpha.is_null() || beta.is_null() {
            return INVALID_VALUE;
        }
        submit(h, Ty::F64, transa, transb, m, n, k, *alpha, *beta, a as u64, lda, sa, b as u64, ldb, sb, c as u64, ldc, sc, count, false)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasSgemm_v2(
    h: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> Status {
    unsafe { cublasSgemmStridedBatched(h, transa, transb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasDgemm_v2(
    h: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f64,
    a: *const f64,
    lda: c_int,
    b: *const f64,
    ldb: c_int,
    beta: *const f64,
    c: *mut f64,
    ldc: c_int,
) -> Status {
    unsafe { cublasDgemmStridedBatched(h, transa, transb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasGemmStridedBatchedEx(
    h: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    atype: c_int,
    lda: c_int,
    sa: i64,
    b: *const c_void,
    btype: c_int,
    ldb: c_int,
    sb: i64,
    beta: *const c_void,
    c: *mut c_void,
    ctype: c_int,
    ldc: c_int,
    sc: i64,
    count: c_int,
    compute: c_int,
    _algo: c_int,
) -> Status {
    unsafe {
        if alpha.is_null() || beta.is_null() {
            return INVALID_VALUE;
        }
        if atype != btype || atype != ctype {
            return NOT_SUPPORTED;
        }
        let ty = match atype {
            CUDA_R_16F => Ty::F16,
            CUDA_R_32F => Ty::F32,
            CUDA_R_64F => Ty::F64,
            _ => return NOT_SUPPORTED,
        };
        let (al, be) = match (ty, compute) {
            (Ty::F64, _) => (*(alpha as *const f64), *(beta as *const f64)),
            (_, COMPUTE_32F | COMPUTE_32F_FAST_TF32) => (*(alpha as *const f32) as f64, *(beta as *const f32) as f64),
            _ => return NOT_SUPPORTED,
        };
        submit(
            h,
            ty,
            transa,
            transb,
            m,
            n,
            k,
            al,
            be,
            a as u64,
            lda,
            sa,
            b as u64,
            ldb,
            sb,
            c as u64,
            ldc,
            sc,
            count,
            compute == COMPUTE_32F_FAST_TF32,
        )
    }
}
