//! Matrix products: 2-D, batched (leading dimensions broadcast),
//! matrix-vector and vector-vector. On the host floats go through the gemm
//! crate (any strides; tiny products through a plain loop, whose dispatch
//! costs less; small f32 products through kiln's own AVX2 tile, which skips
//! gemm's packing), integers through a plain loop; on CUDA floats go through
//! cuBLAS (strided-batched) when it loads, else through kiln's own kernel.

use crate::backends::host::loops::fill;
use crate::backends::host::num::Num;
use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{broadcast_dims, Dims, Layout, Shape};
use crate::host_nn::matmul::{strided_gemm, Parallelism};
use crate::kernel::cuda::{c_type, dtype_tag, make_lay, merge_dims, CudaDevice, CudaModule, GemmCall, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::map_buffer;
use crate::runtime::pool::on_pool;
use crate::tensor::{check_same_device, check_same_dtype};
use crate::Tensor;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::sync::Arc;

/// Multiply-adds below which a matmul stays on one thread: on a 2-core
/// machine two threads make a 100×100 product slower, not faster.
const MATMUL_PAR_MIN: usize = 200 * 200 * 200;
/// Multiply-adds up to which a plain loop beats gemm's dispatch (a linear
/// regression's (32×2)@(2×1) takes 64).
const MATMUL_TINY: usize = 512;

/// out[b] = input 0 [b] (m×k) @ input 1 [b] (k×n), batch dims broadcast.
#[derive(Clone, Copy, Debug)]
struct Matmul {
    m: usize,
    n: usize,
    k: usize,
}

/// Offsets of each matrix of a batched operand.
fn batch_offsets(l: &Layout) -> SmallVec<[usize; 4]> {
    let r = l.dims().len();
    if r == 2 {
        return smallvec::smallvec![l.offset];
    }
    let batch = Layout { shape: Shape::from(&l.dims()[..r - 2]), strides: Dims::from_slice(&l.strides[..r - 2]), offset: l.offset };
    batch.offsets().collect()
}

fn matmul_gemm<T: WithDType + 'static>(
    a: &[T],
    la: &Layout,
    b: &[T],
    lb: &Layout,
    out: &mut [T],
    (m, n, k): (usize, usize, usize),
    threads: usize,
) -> Result<()> {
    let r = la.dims().len();
    let (a_rs, a_cs) = (la.strides[r - 2] as isize, la.strides[r - 1] as isize);
    let (b_rs, b_cs) = (lb.strides[r - 2] as isize, lb.strides[r - 1] as isize);
    let par = if threads > 1 && m * n * k >= MATMUL_PAR_MIN { Parallelism::Rayon(threads) } else { Parallelism::None };
    let (zero, one) = (T::from_f64(0.0), T::from_f64(1.0));
    let mut products = || {
        for (bi, (oa, ob)) in batch_offsets(la).into_iter().zip(batch_offsets(lb)).enumerate() {
            let dst = &mut out[bi * m * n..(bi + 1) * m * n];
            // SAFETY: the front end checked that every index the strides reach
            // lies inside the operands' storages, and `dst` holds m·n elements.
            let ran = unsafe {
                strided_gemm(
                    (m, n, k),
                    dst.as_mut_ptr(),
                    (1, n as isize),
                    false,
                    a.as_ptr().add(oa),
                    (a_cs, a_rs),
                    b.as_ptr().add(ob),
                    (b_cs, b_rs),
                    (zero, one),
                    par,
                )
            };
            // f32, f64 and f16 run; the host kernel calls this for no other.
            if !ran {
                return Err(crate::backends::host::unsupported_op("matmul"));
            }
        }
        Ok(())
    };
    // gemm's threads are those of the pool it is called in: kiln's own.
    if matches!(par, Parallelism::None) {
        products()
    } else {
        on_pool(products)
    }
}

/// f32 products: kiln's small-product kernel (`backends/host/small_sgemm.rs`)
/// where it applies, else gemm.
fn matmul_f32(
    a: &[f32],
    la: &Layout,
    b: &[f32],
    lb: &Layout,
    out: &mut [f32],
    (m, n, k): (usize, usize, usize),
    threads: usize,
) -> Result<()> {
    use crate::backends::host::small_sgemm::{self, View};
    if m.saturating_mul(n).saturating_mul(k) <= small_sgemm::SMALL_MAX {
        let r = la.dims().len();
        let view = |data, offset, l: &Layout| View { data, offset, rs: l.strides[r - 2], cs: l.strides[r - 1] };
        let mut all = true;
        for (bi, (oa, ob)) in batch_offsets(la).into_iter().zip(batch_offsets(lb)).enumerate() {
            let dst = &mut out[bi * m * n..(bi + 1) * m * n];
            // The conditions are the same for every matrix of a batch, so a
            // refusal comes at the first; gemm then writes every product.
            if !small_sgemm::matmul(view(a, oa, la), view(b, ob, lb), dst, (m, n, k)) {
                all = false;
                break;
            }
        }
        if all {
            return Ok(());
        }
    }
    matmul_gemm(a, la, b, lb, out, (m, n, k), threads)
}

fn matmul_naive<T: Num>(a: &[T], la: &Layout, b: &[T], lb: &Layout, out: &mut [T], (m, n, k): (usize, usize, usize)) {
    let r = la.dims().len();
    let (a_rs, a_cs) = (la.strides[r - 2], la.strides[r - 1]);
    let (b_rs, b_cs) = (lb.strides[r - 2], lb.strides[r - 1]);
    for (bi, (oa, ob)) in batch_offsets(la).into_iter().zip(batch_offsets(lb)).enumerate() {
        for i in 0..m {
            for j in 0..n {
                let mut acc = T::ZERO;
                for p in 0..k {
                    acc = acc.add(a[oa + i * a_rs + p * a_cs].mul(b[ob + p * b_rs + j * b_cs]));
                }
                out[bi * m * n + i * n + j] = acc;
            }
        }
    }
}

crate::kernel_args! {
    /// kiln's own matmul kernel (integers, and floats without cuBLAS).
    MatmulArgs { a: u64, ba: Lay, a_rs: i64, a_cs: i64, b: u64, bb: Lay, b_rs: i64, b_cs: i64, out: u64, batch: u64, m: u64, n: u64, k: u64 }
}

crate::kernel_args! {
    /// Gathers a strided operand into contiguous memory for cuBLAS.
    GatherArgs { src: u64, sl: Lay, dst: u64, n: u64 }
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

impl Matmul {
    /// Through cuBLAS: Ok(true) when it ran, Ok(false) when cuBLAS is
    /// missing or the shapes do not fit its integers.
    fn cublas(&self, dev: &dyn CudaDevice, lhs: &Src<'_>, rhs: &Src<'_>, out: &Storage) -> Result<bool> {
        let (m, n, k, dtype) = (self.m, self.n, self.k, out.dtype);
        if !matches!(dtype, DType::F32 | DType::F64 | DType::F16) || ![m, n, k].iter().all(|&v| fits_i32(v)) {
            return Ok(false);
        }
        let r = lhs.layout.dims().len();
        let size = dtype.size_in_bytes();
        // Operands whose strides cuBLAS cannot take are gathered first.
        let mut temps = Vec::new();
        let mut prepare = |s: &Src, rows: usize, cols: usize| -> Result<(u64, Layout)> {
            let l = &s.layout;
            if gemm_form(rows, cols, l.strides()[r - 2], l.strides()[r - 1]).is_some() {
                return Ok((dev.ptr(&s.storage)?, l.clone().into_owned()));
            }
            let t = dev.temp(l.elem_count() * size)?;
            let contiguous = Layout::contiguous(l.shape().clone());
            let (md, ms) = merge_dims(l.dims(), &[l.strides()]);
            let args = GatherArgs {
                src: dev.ptr(&s.storage)?,
                sl: make_lay(&md, &ms[0], l.offset()).map_err(|e| dev.err(e))?,
                dst: t.ptr(),
                n: l.elem_count() as u64,
            };
            dev.launch(&MODULE, &format!("matmul_gather_{}", dtype_tag(dtype)), dev.grid_for(l.elem_count()), BLOCK, &args)?;
            let p = t.ptr();
            temps.push(t);
            Ok((p, contiguous))
        };
        let (a_ptr, la) = prepare(lhs, m, k)?;
        let (b_ptr, lb) = prepare(rhs, k, n)?;
        let (Some((ta, lda)), Some((tb, ldb))) =
            (gemm_form(m, k, la.strides()[r - 2], la.strides()[r - 1]), gemm_form(k, n, lb.strides()[r - 2], lb.strides()[r - 1]))
        else {
            return Ok(false);
        };
        // Batch dims merged over both operands; the last merged dim goes to
        // strided-batched gemm, any others are a loop.
        let batch_dims = &la.dims()[..r - 2];
        let (bd, bs) = merge_dims(batch_dims, &[&la.strides()[..r - 2], &lb.strides()[..r - 2]]);
        let (count, stride_a, stride_b) = match bd.last() {
            Some(&c) => (c, bs[0][bd.len() - 1], bs[1][bd.len() - 1]),
            None => (1, 0, 0),
        };
        if !(fits_i32(lda) && fits_i32(ldb) && fits_i32(count)) {
            return Ok(false);
        }
        let outer_dims = &bd[..bd.len().saturating_sub(1)];
        let outer_count: usize = outer_dims.iter().product();
        let out_ptr = dev.ptr(out)?;
        for o in 0..outer_count {
            // Offsets of this outer batch index in each operand.
            let (mut rem, mut oa, mut ob) = (o, la.offset(), lb.offset());
            for d in (0..outer_dims.len()).rev() {
                let i = rem % outer_dims[d];
                rem /= outer_dims[d];
                oa += i * bs[0][d];
                ob += i * bs[1][d];
            }
            let call = GemmCall {
                dtype,
                a: a_ptr + (oa * size) as u64,
                b: b_ptr + (ob * size) as u64,
                c: out_ptr + ((o * count * m * n) * size) as u64,
                m,
                n,
                k,
                a_form: (ta, lda),
                b_form: (tb, ldb),
                stride_a,
                stride_b,
                ldc: n,
                stride_c: m * n,
                accumulate: false,
                count,
            };
            if !dev.gemm(&call)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl CustomKernel for Matmul {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        let (lhs, rhs) = (&inputs[0], &inputs[1]);
        let (m, n, k) = (self.m, self.n, self.k);
        if k == 0 {
            // A sum of nothing: zeros, without walking the operands' (empty)
            // layouts, whose strides may be meaningless.
            map_buffer!(out, v => fill(v, WithDType::from_f64(0.0), threads));
            return Ok(());
        }
        let tiny = m.saturating_mul(n).saturating_mul(k) <= MATMUL_TINY;
        let (la, lb) = (lhs.layout, rhs.layout);
        match (lhs.buf, rhs.buf, out) {
            (CpuBuffer::F32(a), CpuBuffer::F32(b), CpuBuffer::F32(o)) if tiny => matmul_naive(a, la, b, lb, o, (m, n, k)),
            (CpuBuffer::F64(a), CpuBuffer::F64(b), CpuBuffer::F64(o)) if tiny => matmul_naive(a, la, b, lb, o, (m, n, k)),
            (CpuBuffer::F32(a), CpuBuffer::F32(b), CpuBuffer::F32(o)) => matmul_f32(a, la, b, lb, o, (m, n, k), threads)?,
            (CpuBuffer::F64(a), CpuBuffer::F64(b), CpuBuffer::F64(o)) => matmul_gemm(a, la, b, lb, o, (m, n, k), threads)?,
            (CpuBuffer::F16(a), CpuBuffer::F16(b), CpuBuffer::F16(o)) => matmul_gemm(a, la, b, lb, o, (m, n, k), threads)?,
            (CpuBuffer::I64(a), CpuBuffer::I64(b), CpuBuffer::I64(o)) => matmul_naive(a, la, b, lb, o, (m, n, k)),
            (CpuBuffer::I32(a), CpuBuffer::I32(b), CpuBuffer::I32(o)) => matmul_naive(a, la, b, lb, o, (m, n, k)),
            (CpuBuffer::U8(a), CpuBuffer::U8(b), CpuBuffer::U8(o)) => matmul_naive(a, la, b, lb, o, (m, n, k)),
            _ => return Err(crate::backends::host::unsupported_op("matmul")),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (lhs, rhs) = (&inputs[0], &inputs[1]);
        if self.k == 0 {
            return dev.memset_zero(dev.ptr(out)?, out.bytes());
        }
        if self.cublas(dev, lhs, rhs, out)? {
            return Ok(());
        }
        // kiln's own kernel: integers, and floats without cuBLAS.
        let r = lhs.layout.dims().len();
        let batch: usize = lhs.layout.dims()[..r - 2].iter().product();
        let batch_lay = |l: &Layout| {
            let (d, s) = merge_dims(&l.dims()[..r - 2], &[&l.strides()[..r - 2]]);
            make_lay(&d, &s[0], l.offset()).map_err(|e| dev.err(e))
        };
        let (la, lb) = (&lhs.layout, &rhs.layout);
        let args = MatmulArgs {
            a: dev.ptr(&lhs.storage)?,
            ba: batch_lay(la)?,
            a_rs: la.strides()[r - 2] as i64,
            a_cs: la.strides()[r - 1] as i64,
            b: dev.ptr(&rhs.storage)?,
            bb: batch_lay(lb)?,
            b_rs: lb.strides()[r - 2] as i64,
            b_cs: lb.strides()[r - 1] as i64,
            out: dev.ptr(out)?,
            batch: batch as u64,
            m: self.m as u64,
            n: self.n as u64,
            k: self.k as u64,
        };
        dev.launch(&MODULE, &format!("matmul_{}", dtype_tag(out.dtype)), dev.grid_for(batch * self.m * self.n), BLOCK, &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("matmul", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::new();
    for decl in [MatmulArgs::C_DECL, GatherArgs::C_DECL] {
        s.push_str(decl);
    }
    s.push_str(MATMUL_CU);
    for dt in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16] {
        let (tag, ty) = (dtype_tag(dt), c_type(dt));
        s.push_str(&format!(
            "extern \"C\" __global__ void matmul_{tag}(MatmulArgs p) {{ matmul_impl<{ty}>(p); }}\n\
             extern \"C\" __global__ void matmul_gather_{tag}(GatherArgs p) {{ gather_impl<{ty}>(p); }}\n"
        ));
    }
    s
}

const MATMUL_CU: &str = r#"
template <typename T> struct MAcc { typedef T type; };
template <> struct MAcc<f16_t> { typedef float type; };

template <typename T> __device__ void matmul_impl(const MatmulArgs& p) {
    typedef typename MAcc<T>::type A;
    const T* a = (const T*)p.a;
    const T* b = (const T*)p.b;
    T* out = (T*)p.out;
    GRID_LOOP(t, p.batch * p.m * p.n) {
        u64 bi = t / (p.m * p.n);
        u64 ij = t % (p.m * p.n);
        u64 i = ij / p.n, j = ij % p.n;
        i64 oa = lay_off(p.ba, bi) + (i64)i * p.a_rs;
        i64 ob = lay_off(p.bb, bi) + (i64)j * p.b_cs;
        A acc = Cv<A>::from(0.0);
        for (u64 q = 0; q < p.k; ++q) {
            A x = Cv<A>::from(Cv<T>::to(a[oa + (i64)q * p.a_cs]));
            A y = Cv<A>::from(Cv<T>::to(b[ob + (i64)q * p.b_rs]));
            acc = Ar<A>::add(acc, Ar<A>::mul(x, y));
        }
        out[t] = Cv<T>::from(Cv<A>::to(acc));
    }
}
template <> __device__ void matmul_impl<i64>(const MatmulArgs& p) {
    const i64* a = (const i64*)p.a;
    const i64* b = (const i64*)p.b;
    i64* out = (i64*)p.out;
    GRID_LOOP(t, p.batch * p.m * p.n) {
        u64 bi = t / (p.m * p.n);
        u64 ij = t % (p.m * p.n);
        u64 i = ij / p.n, j = ij % p.n;
        i64 oa = lay_off(p.ba, bi) + (i64)i * p.a_rs;
        i64 ob = lay_off(p.bb, bi) + (i64)j * p.b_cs;
        i64 acc = 0;
        for (u64 q = 0; q < p.k; ++q) acc = Ar<i64>::add(acc, Ar<i64>::mul(a[oa + (i64)q * p.a_cs], b[ob + (i64)q * p.b_rs]));
        out[t] = acc;
    }
}

template <typename T> __device__ void gather_impl(const GatherArgs& p) {
    const T* src = (const T*)p.src;
    T* dst = (T*)p.dst;
    GRID_LOOP(i, p.n) dst[i] = src[lay_off(p.sl, i)];
}
"#;

impl Tensor {
    /// Matrix product: 2-D @ 2-D, batched (leading dims broadcast),
    /// matrix @ vector and vector @ vector.
    ///
    /// Both operands must have one dtype, as in PyTorch (`expected m1 and m2
    /// to have the same dtype`): matmul does not promote, and the error's
    /// hint names the wider dtype to convert to. An output with no elements
    /// is valid whatever the size of the other dimensions.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// let v = Tensor::new(&[1f32, 1.], &cpu())?;
    /// assert_eq!(a.matmul(&a)?.to_vec::<f32>()?, vec![7., 10., 15., 22.]);
    /// assert_eq!(a.matmul(&v)?.to_vec::<f32>()?, vec![3., 7.]);
    /// let huge = Tensor::zeros((usize::MAX, 0, 2), kiln::DType::F32, &cpu())?;
    /// assert_eq!(huge.matmul(&v)?.dims(), &[usize::MAX, 0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        check_same_device("matmul", self, rhs)?;
        check_same_dtype("matmul", self, rhs)?;
        if self.dtype() == DType::BF16 {
            return Err(Error::UnsupportedDType { op: "matmul".into(), dtype: self.dtype() });
        }
        if self.rank() == 0 || rhs.rank() == 0 {
            return Err(Error::invalid("matmul", "needs tensors of rank 1 or more; use `mul` for scalars"));
        }
        // Vectors become matrices and the added dimension is dropped after.
        let (a, drop_m) = if self.rank() == 1 { (self.unsqueeze(0)?, true) } else { (self.clone(), false) };
        let (b, drop_n) = if rhs.rank() == 1 { (rhs.unsqueeze(1)?, true) } else { (rhs.clone(), false) };
        let (ra, rb) = (a.rank(), b.rank());
        let (m, k) = (a.dims()[ra - 2], a.dims()[ra - 1]);
        let (k2, n) = (b.dims()[rb - 2], b.dims()[rb - 1]);
        if k != k2 {
            return Err(Error::shape("matmul", self.dims(), rhs.dims()));
        }
        let (sa, sb, out_shape) = if ra == 2 && rb == 2 {
            // The common case needs no batch broadcasting.
            (a.src(), b.src(), Shape::from((m, n)))
        } else {
            let batch = broadcast_dims(&a.dims()[..ra - 2], &b.dims()[..rb - 2])
                .ok_or_else(|| Error::shape("matmul (batch dimensions)", self.dims(), rhs.dims()))?;
            let with = |tail: [usize; 2]| {
                let mut dims = batch.to_vec();
                dims.extend(tail);
                Shape::from(dims)
            };
            // Only the output's size is checked: the operands are views that
            // the kernel walks only for the output's elements (none when it
            // is empty, however large the broadcast batch of the other).
            let out_shape = with([m, n]);
            out_shape.checked_elem_count("matmul")?;
            let mut sa = a.src();
            sa.layout = Cow::Owned(a.layout.broadcast_view(&with([m, k]))?);
            let mut sb = b.src();
            sb.layout = Cow::Owned(b.layout.broadcast_view(&with([k, n]))?);
            (sa, sb, out_shape)
        };
        let op = Matmul { m, n, k };
        let mut t =
            self.run_new(Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![sa, sb] }, self.dtype(), out_shape)?;
        t = crate::autograd::record(t, &[&a, &b], false, || {
            Box::new(|c| {
                let (a, b) = (&c.inputs[0], &c.inputs[1]);
                let ga = crate::ops::need(a, || crate::ops::sum_to(&c.g.matmul(&b.t()?)?, a.dims()))?;
                let gb = crate::ops::need(b, || crate::ops::sum_to(&a.t()?.matmul(c.g)?, b.dims()))?;
                Ok(smallvec::smallvec![ga, gb])
            })
        });
        if drop_n {
            t = t.squeeze(t.rank() - 1)?;
        }
        if drop_m {
            t = t.squeeze(t.rank() - if drop_n { 1 } else { 2 })?;
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::gemm_form;

    #[test]
    fn gemm_forms() {
        assert_eq!(gemm_form(3, 4, 4, 1), Some((false, 4)));
        assert_eq!(gemm_form(3, 4, 1, 3), Some((true, 3)));
        assert_eq!(gemm_form(3, 4, 8, 2), None);
        assert_eq!(gemm_form(1, 4, 0, 1), Some((false, 4)));
    }
}
