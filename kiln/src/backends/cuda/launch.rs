//! From kernels to CUDA launches, with no knowledge of any op: a family
//! member names its module and kernel (`FamilyCall`), the launch shape of a
//! family is decided here (grid-stride loops for elementwise kernels; one
//! block per output, one thread per output, or two passes for reductions),
//! and an op with kernels of its own launches them itself through the
//! [`CudaDevice`] this backend implements.

use super::{ck, dev_ptr, CudaBackend};
use crate::base::error::{Error, Result};
use crate::kernel::cuda::{
    block_for, grid_for_blocks, lay, lays, make_lay, merge_dims, split_parts, BinaryArgs, CudaDevice, CudaModule, DnnConvCall, GemmCall,
    KernelArgs, Offload, ReduceArgs, ReduceFinalArgs, ReducePartialArgs, TempBuffer, UnaryArgs, BLOCK,
};
use crate::kernel::storage::Storage;
use crate::kernel::{Kernel, Src};
use cudarc::driver::sys as cu;
use std::ffi::c_void;

/// Runs one kernel on `be`'s stream (the context is bound by the caller).
pub(crate) fn run(be: &CudaBackend, kernel: &Kernel<'_>, out: &Storage) -> Result<()> {
    if kernel.writes_nothing(out.len) {
        return Ok(());
    }
    match kernel {
        Kernel::Unary { op, src } => {
            let call = op.cuda(src.storage.dtype);
            let args = UnaryArgs {
                src: be.ptr(&src.storage)?,
                sl: lay(be, &src.layout)?,
                out: be.ptr(out)?,
                n: out.len as u64,
                a: call.a,
                b: call.b,
                pn: call.n,
            };
            let per_thread = if contiguous(&[&args.sl]) { pack_len(src.storage.dtype.size_in_bytes()) } else { 1 };
            be.launch(call.module, &call.kernel, be.grid_for(out.len.div_ceil(per_thread)), BLOCK, &args)
        }
        Kernel::Binary { op, lhs, rhs } => {
            let call = op.cuda(lhs.storage.dtype);
            let ls = lays(be, &[&lhs.layout, &rhs.layout])?;
            let args = BinaryArgs {
                a: be.ptr(&lhs.storage)?,
                la: ls[0],
                b: be.ptr(&rhs.storage)?,
                lb: ls[1],
                out: be.ptr(out)?,
                n: out.len as u64,
            };
            let per_thread = if contiguous(&[&args.la, &args.lb]) { pack_len(lhs.storage.dtype.size_in_bytes()) } else { 1 };
            be.launch(call.module, &call.kernel, be.grid_for(out.len.div_ceil(per_thread)), BLOCK, &args)
        }
        Kernel::Reduce { op, src, dims } => {
            let call = op.cuda(src.storage.dtype);
            reduce(be, call.module, &call.kernel, src, dims, out)
        }
        Kernel::Custom { op, inputs } => op.cuda(be, inputs, out),
    }
}

/// Elements of a 16-byte pack (`PACK_BYTES` in the prelude): what a thread
/// of an elementwise kernel handles at a time over contiguous operands.
fn pack_len(elem_size: usize) -> usize {
    (16 / elem_size.max(1)).max(1)
}

/// Whether every operand is one contiguous run (the kernels' packed path;
/// it also needs aligned addresses, which the kernel checks).
fn contiguous(lays: &[&crate::kernel::cuda::Lay]) -> bool {
    lays.iter().all(|l| l.rank == 1 && l.strides[0] == 1)
}

/// A reduction of `src` over `dims` with the kernels `{prefix}_block`,
/// `_thread`, `_partial` and `_final` of `module`. A fold over nothing
/// writes the identity (the kernels start from it).
fn reduce(be: &CudaBackend, module: &'static CudaModule, prefix: &str, src: &Src, dims: &[usize], out: &Storage) -> Result<()> {
    let l = &src.layout;
    let rank = l.dims().len();
    let kept: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
    let pick = |ds: &[usize]| -> (Vec<usize>, Vec<usize>) {
        (ds.iter().map(|&d| l.dims()[d]).collect(), ds.iter().map(|&d| l.strides()[d]).collect())
    };
    let (od, os) = pick(&kept);
    let n_out: usize = od.iter().product();
    if n_out == 0 {
        return Ok(());
    }
    let (md, ms) = merge_dims(&od, &[&os]);
    let outer = make_lay(&md, &ms[0], l.offset()).map_err(|m| be.err(m))?;
    let (id, is) = pick(dims);
    let n_in: usize = id.iter().product();
    let (mid, mis) = merge_dims(&id, &[&is]);
    let inner = make_lay(&mid, &mis[0], 0).map_err(|m| be.err(m))?;
    let src_ptr = be.ptr(&src.storage)?;
    let out_ptr = be.ptr(out)?;
    let parts = split_parts(be.sm_count(), n_out, n_in);
    if parts > 1 {
        // sum_all, norm, mean_all: the whole device, then one pass over the
        // partial accumulators (8 bytes each: f64 for f32, the dtype else).
        let acc_size = src.storage.dtype.size_in_bytes().max(8);
        let partial = be.temp_buf(n_out * parts * acc_size)?;
        let args = ReducePartialArgs {
            src: src_ptr,
            outer,
            inner,
            part: partial.ptr(),
            n_out: n_out as u64,
            n_in: n_in as u64,
            parts: parts as u64,
        };
        be.launch(module, &format!("{prefix}_partial"), grid_for_blocks(n_out * parts), BLOCK, &args)?;
        let args = ReduceFinalArgs { part: partial.ptr(), out: out_ptr, n_out: n_out as u64, parts: parts as u64 };
        return be.launch(module, &format!("{prefix}_final"), be.grid_for(n_out), BLOCK, &args);
    }
    let args = ReduceArgs { src: src_ptr, outer, inner, out: out_ptr, n_out: n_out as u64, n_in: n_in as u64 };
    if n_in <= 16 && n_out >= 4096 {
        be.launch(module, &format!("{prefix}_thread"), be.grid_for(n_out), BLOCK, &args)
    } else {
        be.launch(module, &format!("{prefix}_block"), n_out.min(1 << 20) as u32, block_for(n_in), &args)
    }
}

/// Device memory returned to the cache when dropped.
struct Temp<'a>(super::memory::TempBuf<'a>);

impl TempBuffer for Temp<'_> {
    fn ptr(&self) -> u64 {
        self.0.ptr()
    }
}

impl CudaDevice for CudaBackend {
    fn launch(&self, module: &'static CudaModule, kernel: &str, grid: u32, block: u32, args: &dyn KernelArgs) -> Result<()> {
        let f = self.function(module, kernel)?;
        let mut param = args.bytes().as_ptr() as *mut c_void;
        // SAFETY: one parameter, the argument struct, which `args` keeps
        // alive for this call; the driver copies it before returning.
        let r = unsafe { cu::cuLaunchKernel(f, grid.max(1), 1, 1, block, 1, 1, 0, self.stream.0, &mut param, std::ptr::null_mut()) };
        ck(r, &format!("launching {kernel}")).map_err(|e| self.err(e))
    }
    fn grid_for(&self, n: usize) -> u32 {
        let blocks = n.div_ceil(BLOCK as usize).max(1);
        blocks.min(self.sm_count() as usize * 32).min(u32::MAX as usize) as u32
    }
    fn sm_count(&self) -> u32 {
        self.sm_count as u32
    }
    fn ptr(&self, s: &Storage) -> Result<u64> {
        dev_ptr(self, s)
    }
    fn temp(&self, bytes: usize) -> Result<Box<dyn TempBuffer + '_>> {
        Ok(Box::new(Temp(self.temp_buf(bytes)?)))
    }
    fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are device memory of at least `bytes` bytes.
        ck(unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.0) }, "cuMemcpyDtoDAsync").map_err(|e| self.err(e))
    }
    fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `ptr` addresses at least `bytes` bytes of device memory.
        ck(unsafe { cu::cuMemsetD8Async(ptr, 0, bytes, self.stream.0) }, "cuMemsetD8Async").map_err(|e| self.err(e))
    }
    fn gemm(&self, call: &GemmCall) -> Result<bool> {
        self.gemm_blas(call)
    }
    fn has_gemm(&self) -> Result<bool> {
        self.blas_loads()
    }
    fn conv_dnn(&self, call: &DnnConvCall) -> Result<Offload> {
        self.conv_cudnn(call)
    }
    fn err(&self, msg: String) -> Error {
        CudaBackend::err(self, msg)
    }
    fn fault_record(&self) -> Result<u64> {
        self.fault_ptr()
    }
}
