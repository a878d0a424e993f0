//! argmax and argmin over one dimension: the index (i64) of the first
//! extreme value, or of the first NaN when there is one (PyTorch and numpy).
//! `Tensor::reduce` (`Reduction::ArgMax`/`ArgMin`) and `argmax`/`argmin` come
//! here.

use crate::backends::host::num::Num;
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{Layout, Shape};
use crate::kernel::cuda::{
    block_for, c_type, dtype_tag, grid_for_blocks, make_lay, merge_dims, split_parts, CudaDevice, CudaModule, BLOCK,
};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::Tensor;
use std::sync::Arc;

/// out (i64, src's shape with `dim` set to 1) = the index of the extreme of
/// input 0 along `dim`.
#[derive(Clone, Copy, Debug)]
struct ArgReduce {
    dim: usize,
    max: bool,
}

fn arg_reduce<T: Num>(s: &[T], l: &Layout, dim: usize, out: &mut [i64], max: bool) {
    let n = l.dims()[dim];
    if n == 0 {
        // The front end refuses an arg-reduction over an empty dimension;
        // index 0 rather than a read out of bounds should one get here.
        out.fill(0);
        return;
    }
    let stride = l.strides[dim];
    let base = l.narrow(dim, 0, 1);
    for (o, b) in out.iter_mut().zip(base.offsets()) {
        let mut best = s[b];
        let mut idx = 0;
        // NaN wins, the first one (PyTorch and numpy): `v != v` only for NaN.
        #[allow(clippy::eq_op)]
        if best == best {
            for i in 1..n {
                let v = s[b + i * stride];
                #[allow(clippy::eq_op)]
                if v != v {
                    idx = i;
                    break;
                }
                if (max && v > best) || (!max && v < best) {
                    best = v;
                    idx = i;
                }
            }
        }
        *o = idx as i64;
    }
}

crate::kernel_args! {
    /// argmax/argmin in one pass: one block per output.
    ArgArgs { src: u64, outer: Lay, stride: i64, out: u64, n_out: u64, n_in: u64, is_max: i64 }
}

crate::kernel_args! {
    /// Long and few, pass 1: block b's best (key, index) of its part.
    ArgPartialArgs { src: u64, outer: Lay, stride: i64, keys: u64, idxs: u64, n_out: u64, n_in: u64, parts: u64, is_max: i64 }
}

crate::kernel_args! {
    /// Pass 2: each output merges its parts in order.
    ArgFinalArgs { keys: u64, idxs: u64, out: u64, n_out: u64, parts: u64, is_max: i64 }
}

impl CustomKernel for ArgReduce {
    fn name(&self) -> &'static str {
        if self.max {
            "argmax"
        } else {
            "argmin"
        }
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let (src, l) = (inputs[0].buf, inputs[0].layout);
        let CpuBuffer::I64(o) = out else { return Err(crate::backends::host::unsupported_op(self.name())) };
        match src {
            CpuBuffer::F32(s) => arg_reduce(s, l, self.dim, o, self.max),
            CpuBuffer::F64(s) => arg_reduce(s, l, self.dim, o, self.max),
            CpuBuffer::I64(s) => arg_reduce(s, l, self.dim, o, self.max),
            CpuBuffer::I32(s) => arg_reduce(s, l, self.dim, o, self.max),
            CpuBuffer::U8(s) => arg_reduce(s, l, self.dim, o, self.max),
            CpuBuffer::F16(_) | CpuBuffer::BF16(_) => return Err(crate::backends::host::unsupported_op(self.name())),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let src = &inputs[0];
        let l = &src.layout;
        let kept: Vec<usize> = (0..l.dims().len()).filter(|&d| d != self.dim).collect();
        let od: Vec<usize> = kept.iter().map(|&d| l.dims()[d]).collect();
        let os: Vec<usize> = kept.iter().map(|&d| l.strides()[d]).collect();
        let n_out: usize = od.iter().product();
        let (md, ms) = merge_dims(&od, &[&os]);
        let outer = make_lay(&md, &ms[0], l.offset()).map_err(|m| dev.err(m))?;
        let (n_in, stride) = (l.dims()[self.dim], l.strides()[self.dim] as i64);
        let (src_ptr, out_ptr, tag) = (dev.ptr(&src.storage)?, dev.ptr(out)?, dtype_tag(src.storage.dtype));
        let is_max = self.max as i64;
        let parts = split_parts(dev.sm_count(), n_out, n_in);
        if parts > 1 {
            // Long and few: many blocks, then one pass over their candidates.
            let key_size = if matches!(src.storage.dtype, DType::U8 | DType::I32) { 4 } else { 8 };
            let keys = dev.temp(n_out * parts * key_size)?;
            let idxs = dev.temp(n_out * parts * 8)?;
            let args = ArgPartialArgs {
                src: src_ptr,
                outer,
                stride,
                keys: keys.ptr(),
                idxs: idxs.ptr(),
                n_out: n_out as u64,
                n_in: n_in as u64,
                parts: parts as u64,
                is_max,
            };
            dev.launch(&MODULE, &format!("arg_partial_{tag}"), grid_for_blocks(n_out * parts), BLOCK, &args)?;
            let args = ArgFinalArgs { keys: keys.ptr(), idxs: idxs.ptr(), out: out_ptr, n_out: n_out as u64, parts: parts as u64, is_max };
            return dev.launch(&MODULE, &format!("arg_final_{tag}"), dev.grid_for(n_out), BLOCK, &args);
        }
        let args = ArgArgs { src: src_ptr, outer, stride, out: out_ptr, n_out: n_out as u64, n_in: n_in as u64, is_max };
        dev.launch(&MODULE, &format!("arg_reduce_{tag}"), n_out.min(1 << 20) as u32, block_for(n_in), &args)
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("argreduce", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::new();
    for decl in [ArgArgs::C_DECL, ArgPartialArgs::C_DECL, ArgFinalArgs::C_DECL] {
        s.push_str(decl);
    }
    s.push_str(ARG_CU);
    for dt in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8] {
        let (tag, ty) = (dtype_tag(dt), c_type(dt));
        s.push_str(&format!(
            "extern \"C\" __global__ void arg_reduce_{tag}(ArgArgs p) {{ arg_reduce_impl<{ty}>(p); }}\n\
             extern \"C\" __global__ void arg_partial_{tag}(ArgPartialArgs p) {{ arg_partial_impl<{ty}>(p); }}\n\
             extern \"C\" __global__ void arg_final_{tag}(ArgFinalArgs p) {{ arg_final_impl<{ty}>(p); }}\n"
        ));
    }
    s
}

const ARG_CU: &str = r#"
// The value argmax/argmin compares: exact for integers (i64 above 2^53 must
// not tie through f64), f64 for the float types (the first NaN wins).
template <typename T> struct ArgKey {
    typedef double type;
    static __device__ __forceinline__ double get(T x) { return Cv<T>::to(x); }
};
template <> struct ArgKey<i64> {
    typedef i64 type;
    static __device__ __forceinline__ i64 get(i64 x) { return x; }
};
template <> struct ArgKey<i32> {
    typedef i32 type;
    static __device__ __forceinline__ i32 get(i32 x) { return x; }
};
template <> struct ArgKey<u8> {
    typedef int type;
    static __device__ __forceinline__ int get(u8 x) { return (int)x; }
};

// Merges candidate (v, j) into (best, idx): a NaN beats every number (the
// first NaN wins, as in PyTorch and the CPU), else the extreme value, the
// first index among equals; idx < 0 means no candidate yet.
template <typename K>
__device__ __forceinline__ void arg_take(K& best, i64& idx, K v, i64 j, i64 is_max) {
    if (j < 0) return;
    if (idx < 0) { best = v; idx = j; return; }
    bool vn = v != v, bn = best != best;
    if (vn || bn) {
        if (vn && (!bn || j < idx)) { best = v; idx = j; }
        return;
    }
    if ((is_max ? v > best : v < best) || (v == best && j < idx)) { best = v; idx = j; }
}

// Block-wide (best, idx) over the reduced indices [lo, hi) of the output
// whose first element is at `base`, left in sk[0], si[0].
template <typename T>
__device__ void arg_block(const T* src, i64 base, i64 stride, u64 lo, u64 hi, i64 is_max,
                          typename ArgKey<T>::type* sk, i64* si) {
    typedef typename ArgKey<T>::type K;
    K best = K();
    i64 idx = -1;
    for (u64 r = lo + threadIdx.x; r < hi; r += blockDim.x) {
        arg_take<K>(best, idx, ArgKey<T>::get(src[base + (i64)r * stride]), (i64)r, is_max);
    }
    sk[threadIdx.x] = best;
    si[threadIdx.x] = idx;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            K b = sk[threadIdx.x];
            i64 i = si[threadIdx.x];
            arg_take<K>(b, i, sk[threadIdx.x + s], si[threadIdx.x + s], is_max);
            sk[threadIdx.x] = b;
            si[threadIdx.x] = i;
        }
        __syncthreads();
    }
}

template <typename T> __device__ void arg_reduce_impl(const ArgArgs& p) {
    __shared__ typename ArgKey<T>::type sk[256];
    __shared__ i64 si[256];
    const T* src = (const T*)p.src;
    i64* out = (i64*)p.out;
    for (u64 o = blockIdx.x; o < p.n_out; o += gridDim.x) {
        arg_block<T>(src, lay_off(p.outer, o), p.stride, 0, p.n_in, p.is_max, sk, si);
        if (threadIdx.x == 0) out[o] = si[0] < 0 ? 0 : si[0];
        __syncthreads();
    }
}

template <typename T> __device__ void arg_partial_impl(const ArgPartialArgs& p) {
    __shared__ typename ArgKey<T>::type sk[256];
    __shared__ i64 si[256];
    const T* src = (const T*)p.src;
    typename ArgKey<T>::type* pk = (typename ArgKey<T>::type*)p.keys;
    i64* pi = (i64*)p.idxs;
    u64 chunk = (p.n_in + p.parts - 1) / p.parts;
    for (u64 b = blockIdx.x; b < p.n_out * p.parts; b += gridDim.x) {
        u64 o = b / p.parts, q = b % p.parts;
        u64 lo = q * chunk, hi = lo + chunk < p.n_in ? lo + chunk : p.n_in;
        arg_block<T>(src, lay_off(p.outer, o), p.stride, lo, hi, p.is_max, sk, si);
        if (threadIdx.x == 0) { pk[b] = sk[0]; pi[b] = si[0]; }
        __syncthreads();
    }
}

template <typename T> __device__ void arg_final_impl(const ArgFinalArgs& p) {
    typedef typename ArgKey<T>::type K;
    const K* pk = (const K*)p.keys;
    const i64* pi = (const i64*)p.idxs;
    i64* out = (i64*)p.out;
    GRID_LOOP(o, p.n_out) {
        K best = K();
        i64 idx = -1;
        for (u64 q = 0; q < p.parts; ++q) arg_take<K>(best, idx, pk[o * p.parts + q], pi[o * p.parts + q], p.is_max);
        out[o] = idx < 0 ? 0 : idx;
    }
}
"#;

impl Tensor {
    /// argmax (`max`) or argmin over `dim`, as i64; the dimension kept as
    /// size 1 when `keepdim`.
    pub(crate) fn arg_reduce(&self, max: bool, dim: usize, keepdim: bool) -> Result<Tensor> {
        let op = ArgReduce { dim, max };
        if self.dims()[dim] == 0 {
            return Err(Error::invalid(op.name(), format!("cannot reduce an empty dimension of shape {}", self.shape())));
        }
        let mut kept = self.dims().to_vec();
        kept[dim] = 1;
        let t = self.run_new(
            Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src()] },
            DType::I64,
            Shape::from(kept),
        )?;
        if keepdim {
            Ok(t)
        } else {
            t.squeeze(dim)
        }
    }
}
