//! cuBLAS for float matmul, loaded on the first one (kiln's own kernel
//! runs when it is missing).

use super::{CudaBackend, Raw};
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::cuda::GemmCall;
use std::ffi::c_void;
use std::panic::catch_unwind;

/// How a missing cuBLAS is described (and recognised: it is not retried).
const BLAS_MISSING: &str = "cuBLAS (libcublas.so) not found";

/// cuBLAS, created on first matmul.
pub(crate) struct Blas {
    handle: Raw<cudarc::cublas::sys::cublasHandle_t>,
}

impl CudaBackend {
    /// Runs `f` with the cuBLAS handle, or returns None when cuBLAS cannot be
    /// had (matmul then uses kiln's own kernel, and says so once on stderr).
    /// Only a missing library is remembered; a failed `cublasCreate` (for
    /// example out of memory) is tried again at the next matmul.
    fn with_blas<T>(&self, f: impl FnOnce(&Blas) -> Result<T>) -> Result<Option<T>> {
        use cudarc::cublas::sys as cb;
        let mut guard = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(guard.as_ref(), Some(Ok(_))) && !self.blas_missing(guard.as_ref()) {
            // SAFETY: dlopen attempts, then handle creation on the bound context.
            let created = catch_unwind(|| unsafe {
                if !cb::is_culib_present() {
                    return Err(BLAS_MISSING.to_string());
                }
                let mut h: cb::cublasHandle_t = std::ptr::null_mut();
                let st = cb::cublasCreate_v2(&mut h);
                if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return Err(format!("cublasCreate failed: {st:?}"));
                }
                let st = cb::cublasSetStream_v2(h, self.stream.0 as cb::cudaStream_t);
                if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    let _ = cb::cublasDestroy_v2(h);
                    return Err(format!("cublasSetStream failed: {st:?}"));
                }
                if crate::base::env::env_flag("KILN_CUDA_TF32").unwrap_or(false) {
                    let _ = cb::cublasSetMathMode(h, cb::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH);
                }
                Ok(Blas { handle: Raw(h) })
            })
            .unwrap_or_else(|_| Err(format!("{BLAS_MISSING} (a function kiln needs is missing)")));
            if let Err(why) = &created
                && !self.blas_warned.swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                eprintln!("kiln: cuBLAS unavailable on {} ({why}); matmul uses kiln's own CUDA kernel", self.device);
            }
            *guard = Some(created);
        }
        match guard.as_ref() {
            Some(Ok(blas)) => f(blas).map(Some),
            _ => Ok(None),
        }
    }

    fn blas_missing(&self, state: Option<&std::result::Result<Blas, String>>) -> bool {
        matches!(state, Some(Err(why)) if why.starts_with(BLAS_MISSING))
    }

    /// Whether cuBLAS is in use, for `devices()`.
    pub(super) fn blas_status(&self) -> String {
        match self.blas.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            None => "not loaded yet".into(),
            Some(Ok(_)) => "yes".into(),
            Some(Err(why)) => format!("no: {why}"),
        }
    }
}

impl CudaBackend {
    /// A matrix product through cuBLAS; `Ok(false)` when cuBLAS cannot be had.
    pub(super) fn gemm_blas(&self, call: &GemmCall) -> Result<bool> {
        Ok(self.with_blas(|blas| gemm(self, blas, call))?.is_some())
    }

    /// Whether cuBLAS loads here (loading it on the first call).
    pub(super) fn blas_loads(&self) -> Result<bool> {
        Ok(self.with_blas(|_| Ok(()))?.is_some())
    }
}

/// Row-major C (m x n) = A (m x k) B (k x n) as column-major
/// C^T (n x m) = B^T A^T: cuBLAS's first operand is B, its second A.
fn gemm(be: &CudaBackend, blas: &Blas, g: &GemmCall) -> Result<()> {
    use cudarc::cublas::sys as cb;
    let op = |t: bool| if t { cb::cublasOperation_t::CUBLAS_OP_T } else { cb::cublasOperation_t::CUBLAS_OP_N };
    let (tb, ldb) = g.b_form;
    let (ta, lda) = g.a_form;
    let h = blas.handle.0;
    let (mm, nn, kk) = (g.n as i32, g.m as i32, g.k as i32);
    let ldc = g.ldc as i32;
    let stride_c = g.stride_c as i64;
    // SAFETY: pointers address device buffers holding every element the
    // strides reach (checked by the front end); alpha/beta live on the stack.
    let status = unsafe {
        match g.dtype {
            DType::F32 => {
                let (alpha, beta) = (1f32, g.accumulate as u8 as f32);
                cb::cublasSgemmStridedBatched(
                    h,
                    op(tb),
                    op(ta),
                    mm,
                    nn,
                    kk,
                    &alpha,
                    g.b as *const f32,
                    ldb as i32,
                    g.stride_b as i64,
                    g.a as *const f32,
                    lda as i32,
                    g.stride_a as i64,
                    &beta,
                    g.c as *mut f32,
                    ldc,
                    stride_c,
                    g.count as i32,
                )
            }
            DType::F64 => {
                let (alpha, beta) = (1f64, g.accumulate as u8 as f64);
                cb::cublasDgemmStridedBatched(
                    h,
                    op(tb),
                    op(ta),
                    mm,
                    nn,
                    kk,
                    &alpha,
                    g.b as *const f64,
                    ldb as i32,
                    g.stride_b as i64,
                    g.a as *const f64,
                    lda as i32,
                    g.stride_a as i64,
                    &beta,
                    g.c as *mut f64,
                    ldc,
                    stride_c,
                    g.count as i32,
                )
            }
            DType::F16 => {
                // f16 in and out, f32 accumulation.
                let (alpha, beta) = (1f32, g.accumulate as u8 as f32);
                cb::cublasGemmStridedBatchedEx(
                    h,
                    op(tb),
                    op(ta),
                    mm,
                    nn,
                    kk,
                    &alpha as *const f32 as *const c_void,
                    g.b as *const c_void,
                    cb::cudaDataType_t::CUDA_R_16F,
                    ldb as i32,
                    g.stride_b as i64,
                    g.a as *const c_void,
                    cb::cudaDataType_t::CUDA_R_16F,
                    lda as i32,
                    g.stride_a as i64,
                    &beta as *const f32 as *const c_void,
                    g.c as *mut c_void,
                    cb::cudaDataType_t::CUDA_R_16F,
                    ldc,
                    stride_c,
                    g.count as i32,
                    cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            DType::I64 | DType::I32 | DType::U8 | DType::BF16 => {
                return Err(be.err(format!("cuBLAS gemm asked for {} (a kiln bug: please report it)", g.dtype)));
            }
        }
    };
    if status == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(be.err(format!("cuBLAS gemm ({}, m={}, n={}, k={}, batch={}) failed: {status:?}", g.dtype, g.m, g.n, g.k, g.count)))
    }
}
