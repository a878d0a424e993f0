//! From kiln's primitive kernels to CUDA launches: merges dimensions so that
//! strided operands take as few as possible, picks the kernel by dtype and
//! sends matmul to cuBLAS where it can.

use super::kernels::{binary_code, dtype_tag, reduce_code, unary_code, MAX_DIMS};
use super::{dev_ptr, CudaBackend};
use crate::base::shape::Layout;
use crate::op::{Distribution, Kernel, ReduceOp, Src};
use crate::{DType, Result};
use std::ffi::c_void;

/// A strided view as the kernels read it (`struct Lay` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Lay {
    rank: i64,
    off: i64,
    dims: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
}

/// Kernel arguments, each in its own 8-byte-aligned box so that the
/// pointers handed to the driver stay valid until the launch returns.
#[derive(Default)]
pub(crate) struct Args {
    values: Vec<Box<[u64]>>,
}

impl Args {
    fn push_words(&mut self, words: Vec<u64>) -> &mut Self {
        self.values.push(words.into_boxed_slice());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.push_words(vec![v])
    }
    fn i64(&mut self, v: i64) -> &mut Self {
        self.push_words(vec![v as u64])
    }
    /// An `int`: the driver reads the first 4 bytes (little-endian).
    fn i32(&mut self, v: i32) -> &mut Self {
        self.push_words(vec![v as u32 as u64])
    }
    fn f64(&mut self, v: f64) -> &mut Self {
        self.push_words(vec![v.to_bits()])
    }
    fn lay(&mut self, l: &Lay) -> &mut Self {
        let mut w = Vec::with_capacity(2 + 2 * MAX_DIMS);
        w.push(l.rank as u64);
        w.push(l.off as u64);
        w.extend(l.dims.iter().map(|&d| d as u64));
        w.extend(l.strides.iter().map(|&s| s as u64));
        self.push_words(w)
    }
    pub(crate) fn pointers(&mut self) -> Vec<*mut c_void> {
        self.values.iter_mut().map(|v| v.as_mut_ptr() as *mut c_void).collect()
    }
}

/// Merges dimensions of `dims` that every layout walks contiguously
/// (stride[d] == stride[d+1] * dims[d+1]) and drops size-1 dimensions. The
/// row-major order of elements, and so each element's offset, is unchanged.
fn merge(dims: &[usize], strides: &[&[usize]]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut out_dims: Vec<usize> = Vec::new();
    let mut out_strides: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
    for d in 0..dims.len() {
        if dims[d] == 1 {
            continue;
        }
        if let Some(last) = out_dims.last_mut() {
            let mergeable = strides.iter().zip(&out_strides).all(|(s, o)| o.last().copied() == Some(s[d] * dims[d]));
            if mergeable {
                *last *= dims[d];
                for (o, s) in out_strides.iter_mut().zip(strides) {
                    if let Some(x) = o.last_mut() {
                        *x = s[d];
                    }
                }
                continue;
            }
        }
        out_dims.push(dims[d]);
        for (o, s) in out_strides.iter_mut().zip(strides) {
            o.push(s[d]);
        }
    }
    (out_dims, out_strides)
}

fn make_lay(be: &CudaBackend, dims: &[usize], strides: &[usize], offset: usize) -> Result<Lay> {
    if dims.len() > MAX_DIMS {
        return Err(be.err(format!(
            "a strided operand has {} dimensions that cannot be merged; kiln's CUDA kernels take at most {MAX_DIMS}: \
             make it contiguous first (e.g. `.contiguous()`), or reshape it to fewer dimensions",
            dims.len()
        )));
    }
    let mut l = Lay { rank: dims.len() as i64, off: offset as i64, dims: [1; MAX_DIMS], strides: [0; MAX_DIMS] };
    for (i, (&d, &s)) in dims.iter().zip(strides).enumerate() {
        l.dims[i] = d as i64;
        l.strides[i] = s as i64;
    }
    Ok(l)
}

/// Lays for several layouts of the same shape, merged together.
fn lays(be: &CudaBackend, layouts: &[&Layout]) -> Result<Vec<Lay>> {
    let dims = layouts[0].dims();
    let strides: Vec<&[usize]> = layouts.iter().map(|l| l.strides()).collect();
    let (md, ms) = merge(dims, &strides);
    layouts.iter().zip(&ms).map(|(l, s)| make_lay(be, &md, s, l.offset())).collect()
}

fn lay1(be: &CudaBackend, l: &Layout) -> Result<Lay> {
    Ok(lays(be, &[l])?.remove(0))
}

const BLOCK: u32 = 256;

fn grid_for(be: &CudaBackend, n: usize) -> u32 {
    let blocks = n.div_ceil(BLOCK as usize).max(1);
    blocks.min(be.sm_count() as usize * 32).min(u32::MAX as usize) as u32
}

fn elementwise(be: &CudaBackend, name: &str, n: usize, args: &mut Args) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    be.launch_raw(name, grid_for(be, n), BLOCK, args)
}

fn ptr(be: &CudaBackend, s: &crate::storage::Storage) -> Result<u64> {
    dev_ptr(be, s)
}

/// Runs one kernel on `be`'s stream (the context is bound by the caller).
pub(crate) fn run(be: &CudaBackend, kernel: &Kernel<'_>, out: &crate::storage::Storage) -> Result<()> {
    if kernel.writes_nothing(out.len) {
        return Ok(());
    }
    match kernel {
        Kernel::Fill { value } => {
            let name = format!("fill_{}", dtype_tag(out.dtype));
            elementwise(be, &name, out.len, Args::default().u64(ptr(be, out)?).u64(out.len as u64).f64(*value))
        }
        Kernel::Arange { start, step } => {
            let name = format!("arange_{}", dtype_tag(out.dtype));
            elementwise(be, &name, out.len, Args::default().u64(ptr(be, out)?).u64(out.len as u64).f64(*start).f64(*step))
        }
        Kernel::Random { seed, offset, dist } => {
            let name = format!("random_{}", dtype_tag(out.dtype));
            let (d, a, b) = match *dist {
                Distribution::Uniform { lo, hi } => (0, lo, hi),
                Distribution::Normal { mean, std } => (1, mean, std),
            };
            let mut args = Args::default();
            args.u64(ptr(be, out)?).u64(out.len as u64).u64(*seed).u64(*offset).i32(d).f64(a).f64(b);
            elementwise(be, &name, out.len, &mut args)
        }
        Kernel::Unary { op, src } => {
            let (code, a, b, n) = unary_code(*op);
            let l = lay1(be, &src.layout)?;
            let name = format!("unary_{}", dtype_tag(src.storage.dtype));
            let mut args = Args::default();
            args.u64(ptr(be, &src.storage)?).lay(&l).u64(ptr(be, out)?).u64(out.len as u64).i32(code).f64(a).f64(b).i32(n);
            elementwise(be, &name, out.len, &mut args)
        }
        Kernel::Binary { op, lhs, rhs } => {
            let ls = lays(be, &[&lhs.layout, &rhs.layout])?;
            let kind = if op.is_comparison() { "compare" } else { "binary" };
            let name = format!("{kind}_{}", dtype_tag(lhs.storage.dtype));
            let mut args = Args::default();
            args.u64(ptr(be, &lhs.storage)?)
                .lay(&ls[0])
                .u64(ptr(be, &rhs.storage)?)
                .lay(&ls[1])
                .u64(ptr(be, out)?)
                .u64(out.len as u64)
                .i32(binary_code(*op));
            elementwise(be, &name, out.len, &mut args)
        }
        Kernel::Reduce { op, src, dims } => reduce(be, *op, src, dims, out),
        Kernel::Matmul { lhs, rhs, m, n, k } => matmul(be, lhs, rhs, out, *m, *n, *k),
        Kernel::Copy { src, dst_layout } => copy(be, src, ptr(be, out)?, out.dtype, dst_layout),
        Kernel::IndexSelect { src, ids, dim } => {
            let dims = src.layout.dims();
            let outer: usize = dims[..*dim].iter().product();
            let inner: usize = dims[dim + 1..].iter().product();
            let d = dims[*dim];
            let n = ids.layout.elem_count();
            let name = format!("index_select_{}_{}", dtype_tag(src.storage.dtype), dtype_tag(ids.storage.dtype));
            let mut args = Args::default();
            args.u64(ptr(be, &src.storage)?)
                .lay(&lay1(be, &src.layout)?)
                .u64(ptr(be, &ids.storage)?)
                .lay(&lay1(be, &ids.layout)?)
                .u64(ptr(be, out)?)
                .u64(outer as u64)
                .u64(d as u64)
                .u64(n as u64)
                .u64(inner as u64);
            elementwise(be, &name, outer * n * inner, &mut args)
        }
        Kernel::IndexAdd { src, ids, dim } => {
            let dims = src.layout.dims();
            let outer: usize = dims[..*dim].iter().product();
            let inner: usize = dims[dim + 1..].iter().product();
            let n = dims[*dim].min(ids.layout.elem_count());
            let d = out.len / (outer * inner).max(1);
            let name = format!("index_add_{}_{}", dtype_tag(src.storage.dtype), dtype_tag(ids.storage.dtype));
            let mut args = Args::default();
            args.u64(ptr(be, &src.storage)?)
                .lay(&lay1(be, &src.layout)?)
                .u64(ptr(be, &ids.storage)?)
                .lay(&lay1(be, &ids.layout)?)
                .u64(ptr(be, out)?)
                .u64(outer as u64)
                .u64(d as u64)
                .u64(n as u64)
                .u64(inner as u64);
            elementwise(be, &name, outer * inner, &mut args)
        }
        Kernel::Where { cond, on_true, on_false } => {
            let ls = lays(be, &[&cond.layout, &on_true.layout, &on_false.layout])?;
            let name = format!("where_{}_{}", dtype_tag(cond.storage.dtype), dtype_tag(on_true.storage.dtype));
            let mut args = Args::default();
            args.u64(ptr(be, &cond.storage)?)
                .lay(&ls[0])
                .u64(ptr(be, &on_true.storage)?)
                .lay(&ls[1])
                .u64(ptr(be, &on_false.storage)?)
                .lay(&ls[2])
                .u64(ptr(be, out)?)
                .u64(out.len as u64);
            elementwise(be, &name, out.len, &mut args)
        }
    }
}

/// dst[dst_layout] = src, converting dtypes.
fn copy(be: &CudaBackend, src: &Src, dst_ptr: u64, dst_dtype: DType, dst_layout: &Layout) -> Result<()> {
    let n = dst_layout.elem_count();
    if n == 0 {
        return Ok(());
    }
    let sdt = src.storage.dtype;
    let src_ptr = ptr(be, &src.storage)?;
    if sdt == dst_dtype && src_ptr != dst_ptr {
        if let (Some((a, _)), Some((b, _))) = (src.layout.contiguous_range(), dst_layout.contiguous_range()) {
            let size = sdt.size_in_bytes();
            return be.copy_d2d(dst_ptr + (b * size) as u64, src_ptr + (a * size) as u64, n * size);
        }
    }
    let ls = lays(be, &[&src.layout, dst_layout])?;
    let name = format!("copy_{}_{}", dtype_tag(sdt), dtype_tag(dst_dtype));
    let mut args = Args::default();
    args.u64(src_ptr).lay(&ls[0]).u64(dst_ptr).lay(&ls[1]).u64(n as u64);
    elementwise(be, &name, n, &mut args)
}

/// The view's elements, contiguous, into device memory at `dst`.
pub(crate) fn gather(be: &CudaBackend, src: &Src, dst: u64) -> Result<()> {
    copy(be, src, dst, src.storage.dtype, &Layout::contiguous(src.layout.shape().clone()))
}

/// Blocks per output for a reduction: one when there are outputs enough to
/// fill the device, else enough to give each multiprocessor several blocks
/// of at least 4096 elements each.
pub(crate) fn split_parts(be: &CudaBackend, n_out: usize, n_in: usize) -> usize {
    const MIN_PER_BLOCK: usize = 4096;
    let target_blocks = be.sm_count() as usize * 4;
    if n_out >= target_blocks || n_in < 2 * MIN_PER_BLOCK {
        return 1;
    }
    (target_blocks / n_out.max(1)).min(n_in / MIN_PER_BLOCK).clamp(1, 1024)
}

fn grid_for_blocks(blocks: usize) -> u32 {
    blocks.clamp(1, 1 << 20) as u32
}

fn block_for(n_in: usize) -> u32 {
    (n_in.next_power_of_two() as u32).clamp(32, BLOCK)
}

fn reduce(be: &CudaBackend, op: ReduceOp, src: &Src, dims: &[usize], out: &crate::storage::Storage) -> Result<()> {
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
    let (md, ms) = merge(&od, &[&os]);
    let outer = make_lay(be, &md, &ms[0], l.offset())?;
    let src_ptr = ptr(be, &src.storage)?;
    let out_ptr = ptr(be, out)?;
    let tag = dtype_tag(src.storage.dtype);
    let grid = n_out.min(1 << 20) as u32;
    if matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin) {
        let d = dims[0];
        let n_in = l.dims()[d];
        let stride = l.strides()[d] as i64;
        let is_max = (op == ReduceOp::ArgMax) as i32;
        let parts = split_parts(be, n_out, n_in);
        if parts > 1 {
            // Long and few: many blocks, then one pass over their candidates.
            let key_size = if matches!(src.storage.dtype, DType::U8 | DType::I32) { 4 } else { 8 };
            let keys = be.temp(n_out * parts * key_size)?;
            let idxs = be.temp(n_out * parts * 8)?;
            let mut args = Args::default();
            args.u64(src_ptr)
                .lay(&outer)
                .i64(stride)
                .u64(keys.ptr())
                .u64(idxs.ptr())
                .u64(n_out as u64)
                .u64(n_in as u64)
                .u64(parts as u64)
                .i32(is_max);
            be.launch_raw(&format!("arg_partial_{tag}"), grid_for_blocks(n_out * parts), BLOCK, &mut args)?;
            let mut args = Args::default();
            args.u64(src_ptr).lay(&outer).u64(keys.ptr()).u64(idxs.ptr()).u64(out_ptr).u64(n_out as u64).u64(parts as u64).i32(is_max);
            return elementwise(be, &format!("arg_final_{tag}"), n_out, &mut args);
        }
        let mut args = Args::default();
        args.u64(src_ptr).lay(&outer).i64(stride).u64(out_ptr).u64(n_out as u64).u64(n_in as u64).i32(is_max);
        return be.launch_raw(&format!("arg_reduce_{tag}"), grid, block_for(n_in), &mut args);
    }
    let (id, is) = pick(dims);
    let n_in: usize = id.iter().product();
    if n_in == 0 {
        // A sum over nothing is 0, all bits clear in every dtype (the front
        // end refuses max/min of nothing).
        return be.memset_zero(out_ptr, out.bytes());
    }
    let (mid, mis) = merge(&id, &[&is]);
    let inner = make_lay(be, &mid, &mis[0], 0)?;
    let parts = split_parts(be, n_out, n_in);
    if parts > 1 {
        // sum_all, norm, mean_all: the whole device, then one pass over the
        // partial accumulators (f64 for f32, as the single-block kernel).
        let acc_size = match src.storage.dtype {
            DType::F32 | DType::F64 | DType::I64 => 8,
            _ => src.storage.dtype.size_in_bytes(),
        };
        let partial = be.temp(n_out * parts * acc_size)?;
        let mut args = Args::default();
        args.u64(src_ptr)
            .lay(&outer)
            .lay(&inner)
            .u64(partial.ptr())
            .u64(n_out as u64)
            .u64(n_in as u64)
            .u64(parts as u64)
            .i32(reduce_code(op));
        be.launch_raw(&format!("reduce_partial_{tag}"), grid_for_blocks(n_out * parts), BLOCK, &mut args)?;
        let mut args = Args::default();
        args.u64(partial.ptr()).u64(out_ptr).u64(n_out as u64).u64(parts as u64).i32(reduce_code(op));
        return elementwise(be, &format!("reduce_final_{tag}"), n_out, &mut args);
    }
    let mut args = Args::default();
    args.u64(src_ptr).lay(&outer).lay(&inner).u64(out_ptr).u64(n_out as u64).u64(n_in as u64).i32(reduce_code(op));
    if n_in <= 16 && n_out >= 4096 {
        be.launch_raw(&format!("reduce_thread_{tag}"), grid_for(be, n_out), BLOCK, &mut args)
    } else {
        be.launch_raw(&format!("reduce_block_{tag}"), grid, block_for(n_in), &mut args)
    }
}

/// How cuBLAS (column-major) sees a row-major `rows x cols` operand with
/// strides `(rs, cs)`: (transposed, leading dimension), or None when the
/// strides fit neither form.
fn gemm_form(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(bool, usize)> {
    if cols == 1 || cs == 1 {
        let ld = if rows == 1 { cols.max(1) } else { rs };
        if ld >= cols.max(1) {
            return Some((false, ld));
        }
    }
    if rows == 1 || rs == 1 {
        let ld = if cols == 1 { rows.max(1) } else { cs };
        if ld >= rows.max(1) {
            return Some((true, ld));
        }
    }
    None
}

fn fits_i32(v: usize) -> bool {
    v <= i32::MAX as usize
}

fn matmul(be: &CudaBackend, lhs: &Src, rhs: &Src, out: &crate::storage::Storage, m: usize, n: usize, k: usize) -> Result<()> {
    let dtype = out.dtype;
    let out_ptr = ptr(be, out)?;
    if out.len == 0 {
        return Ok(());
    }
    if k == 0 {
        return be.memset_zero(out_ptr, out.bytes());
    }
    let r = lhs.layout.dims().len();
    let batch_dims = &lhs.layout.dims()[..r - 2];
    let batch: usize = batch_dims.iter().product();
    if matches!(dtype, DType::F32 | DType::F64 | DType::F16) && [m, n, k].iter().all(|&v| fits_i32(v)) {
        // Operands whose strides cuBLAS cannot take are made contiguous first.
        let size = dtype.size_in_bytes();
        let mut temps = Vec::new();
        let mut prepare = |s: &Src, rows: usize, cols: usize| -> Result<(u64, Layout)> {
            let l = &s.layout;
            let (rs, cs) = (l.strides()[r - 2], l.strides()[r - 1]);
            if gemm_form(rows, cols, rs, cs).is_some() {
                return Ok((ptr(be, &s.storage)?, l.clone().into_owned()));
            }
            let t = be.temp(l.elem_count() * size)?;
            gather(be, s, t.ptr())?;
            let p = t.ptr();
            temps.push(t);
            Ok((p, Layout::contiguous(l.shape().clone())))
        };
        let (a_ptr, la) = prepare(lhs, m, k)?;
        let (b_ptr, lb) = prepare(rhs, k, n)?;
        let (a_form, b_form) =
            (gemm_form(m, k, la.strides()[r - 2], la.strides()[r - 1]), gemm_form(k, n, lb.strides()[r - 2], lb.strides()[r - 1]));
        if let (Some((ta, lda)), Some((tb, ldb))) = (a_form, b_form) {
            // Batch dims merged over both operands; the last merged dim goes to
            // strided-batched gemm, any others are a loop.
            let sa = &la.strides()[..r - 2];
            let sb = &lb.strides()[..r - 2];
            let (bd, bs) = merge(batch_dims, &[sa, sb]);
            let (count, stride_a, stride_b) = match bd.last() {
                Some(&c) => (c, bs[0][bd.len() - 1], bs[1][bd.len() - 1]),
                None => (1, 0, 0),
            };
            let outer_dims = &bd[..bd.len().saturating_sub(1)];
            let outer_count: usize = outer_dims.iter().product();
            if fits_i32(lda) && fits_i32(ldb) && fits_i32(count) {
                let done = be.with_blas(|blas| {
                    for o in 0..outer_count {
                        // Offsets of this outer batch index in each operand.
                        let (mut rem, mut oa, mut ob) = (o, la.offset(), lb.offset());
                        for d in (0..outer_dims.len()).rev() {
                            let i = rem % outer_dims[d];
                            rem /= outer_dims[d];
                            oa += i * bs[0][d];
                            ob += i * bs[1][d];
                        }
                        let c_off = o * count * m * n;
                        gemm(
                            be,
                            blas,
                            dtype,
                            GemmCall {
                                a: a_ptr + (oa * size) as u64,
                                b: b_ptr + (ob * size) as u64,
                                c: out_ptr + (c_off * size) as u64,
                                m,
                                n,
                                k,
                                a_form: (ta, lda),
                                b_form: (tb, ldb),
                                stride_a,
                                stride_b,
                                count,
                            },
                        )?;
                    }
                    Ok(())
                })?;
                if done.is_some() {
                    return Ok(());
                }
            }
        }
    }
    // kiln's own kernel: integers, and floats without cuBLAS.
    let name = format!("matmul_{}", dtype_tag(dtype));
    let batch_lay = |l: &Layout| -> Result<Lay> {
        let (d, s) = merge(&l.dims()[..r - 2], &[&l.strides()[..r - 2]]);
        make_lay(be, &d, &s[0], l.offset())
    };
    let (la, lb) = (&lhs.layout, &rhs.layout);
    let mut args = Args::default();
    args.u64(ptr(be, &lhs.storage)?)
        .lay(&batch_lay(la)?)
        .i64(la.strides()[r - 2] as i64)
        .i64(la.strides()[r - 1] as i64)
        .u64(ptr(be, &rhs.storage)?)
        .lay(&batch_lay(lb)?)
        .i64(lb.strides()[r - 2] as i64)
        .i64(lb.strides()[r - 1] as i64)
        .u64(out_ptr)
        .u64(batch as u64)
        .u64(m as u64)
        .u64(n as u64)
        .u64(k as u64);
    elementwise(be, &name, batch * m * n, &mut args)
}

struct GemmCall {
    a: u64,
    b: u64,
    c: u64,
    m: usize,
    n: usize,
    k: usize,
    a_form: (bool, usize),
    b_form: (bool, usize),
    stride_a: usize,
    stride_b: usize,
    count: usize,
}

/// Row-major C (m x n) = A (m x k) B (k x n) as column-major
/// C^T (n x m) = B^T A^T: cuBLAS's first operand is B, its second A.
fn gemm(be: &CudaBackend, blas: &super::Blas, dtype: DType, g: GemmCall) -> Result<()> {
    use cudarc::cublas::sys as cb;
    let op = |t: bool| if t { cb::cublasOperation_t::CUBLAS_OP_T } else { cb::cublasOperation_t::CUBLAS_OP_N };
    let (tb, ldb) = g.b_form;
    let (ta, lda) = g.a_form;
    let h = blas.handle.0;
    let (mm, nn, kk) = (g.n as i32, g.m as i32, g.k as i32);
    let ldc = g.n as i32;
    let stride_c = (g.m * g.n) as i64;
    // SAFETY: pointers address device buffers holding every element the
    // strides reach (checked by the front end); alpha/beta live on the stack.
    let status = unsafe {
        match dtype {
            DType::F32 => {
                let (alpha, beta) = (1f32, 0f32);
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
                let (alpha, beta) = (1f64, 0f64);
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
            _ => {
                // f16 in and out, f32 accumulation.
                let (alpha, beta) = (1f32, 0f32);
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
        }
    };
    if status == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(be.err(format!("cuBLAS gemm ({dtype}, m={}, n={}, k={}, batch={}) failed: {status:?}", g.m, g.n, g.k, g.count)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_contiguous_to_one_dim() {
        let (d, s) = merge(&[2, 3, 4], &[&[12, 4, 1]]);
        assert_eq!(d, vec![24]);
        assert_eq!(s, vec![vec![1]]);
    }

    #[test]
    fn merge_keeps_transpose_and_broadcast_apart() {
        // A transposed (3, 2) view of a (2, 3) matrix cannot be merged.
        let (d, s) = merge(&[3, 2], &[&[1, 3]]);
        assert_eq!((d, s), (vec![3, 2], vec![vec![1, 3]]));
        // Broadcast rows: (4, 5) with strides (0, 1) next to a contiguous one.
        let (d, s) = merge(&[4, 5], &[&[0, 1], &[5, 1]]);
        assert_eq!((d, s), (vec![4, 5], vec![vec![0, 1], vec![5, 1]]));
        // Size-1 dims vanish.
        let (d, s) = merge(&[1, 6, 1], &[&[99, 1, 7]]);
        assert_eq!((d, s), (vec![6], vec![vec![1]]));
    }

    #[test]
    fn gemm_forms() {
        assert_eq!(gemm_form(3, 4, 4, 1), Some((false, 4))); // row-major
        assert_eq!(gemm_form(3, 4, 1, 3), Some((true, 3))); // transposed view
        assert_eq!(gemm_form(3, 4, 8, 2), None); // every other column
        assert_eq!(gemm_form(1, 4, 0, 1), Some((false, 4))); // broadcast single row
    }
}
