//! Filling an output from nothing: a constant, a range, or counter-based
//! random numbers (Philox 4x32-10: element i of a draw uses counter
//! `offset + i`, so every device produces the same values). The
//! constructors that use it are in `create.rs`.

use crate::backends::host::loops::{fill, CHUNK, PAR_MIN};
use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::cuda::{c_type, dtype_tag, CudaDevice, CudaModule, BLOCK};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Src};
use crate::map_buffer;
use crate::runtime::pool::on_pool;
use crate::runtime::rng;
use rayon::prelude::*;
use std::sync::Arc;

/// What to fill an output with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum FillOp {
    /// out[i] = value
    Constant(f64),
    /// out[i] = start + i·step
    Arange { start: f64, step: f64 },
    /// Uniform in [lo, hi), from counter `offset + i` of `seed`.
    Uniform { seed: u64, offset: u64, lo: f64, hi: f64 },
    /// Normal with `mean` and `std`, from counter `offset + i` of `seed`.
    Normal { seed: u64, offset: u64, mean: f64, std: f64 },
}

crate::kernel_args! {
    /// A fill kernel's argument.
    FillArgs { out: u64, n: u64, a: f64, b: f64, seed: u64, offset: u64 }
}

impl FillOp {
    fn fill_host<T: WithDType>(self, v: &mut [T], threads: usize) {
        match self {
            FillOp::Constant(value) => fill(v, T::from_f64(value), threads),
            FillOp::Arange { start, step } => {
                for (i, x) in v.iter_mut().enumerate() {
                    *x = T::from_f64(start + i as f64 * step);
                }
            }
            FillOp::Uniform { seed, offset, lo, hi } => random_host(v, threads, |i| {
                let x = T::from_f64(lo + (hi - lo) * rng::uniform(seed, offset + i));
                // Rounding to f32 (or narrower) can reach the excluded upper
                // bound; a uniform draw never returns it.
                if x.to_f64() >= hi {
                    T::from_f64(lo)
                } else {
                    x
                }
            }),
            FillOp::Normal { seed, offset, mean, std } => {
                random_host(v, threads, |i| T::from_f64(mean + std * rng::normal(seed, offset + i)))
            }
        }
    }
    /// (kernel kind, a, b, seed, offset) for the CUDA kernel.
    fn cuda_args(self) -> (&'static str, f64, f64, u64, u64) {
        match self {
            FillOp::Constant(v) => ("constant", v, 0.0, 0, 0),
            FillOp::Arange { start, step } => ("arange", start, step, 0, 0),
            FillOp::Uniform { seed, offset, lo, hi } => ("uniform", lo, hi, seed, offset),
            FillOp::Normal { seed, offset, mean, std } => ("normal", mean, std, seed, offset),
        }
    }
}

/// v[i] = draw(i), over the pool for big outputs (each element's value
/// depends only on its index, so the split does not matter).
fn random_host<T: WithDType>(v: &mut [T], threads: usize, draw: impl Fn(u64) -> T + Sync) {
    let fill_chunk = |start: usize, chunk: &mut [T]| {
        for (j, x) in chunk.iter_mut().enumerate() {
            *x = draw((start + j) as u64);
        }
    };
    if threads > 1 && v.len() >= PAR_MIN {
        on_pool(|| v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| fill_chunk(c * CHUNK, chunk)));
    } else {
        fill_chunk(0, v);
    }
}

impl CustomKernel for FillOp {
    fn name(&self) -> &'static str {
        match self {
            FillOp::Constant(_) => "fill",
            FillOp::Arange { .. } => "arange",
            FillOp::Uniform { .. } | FillOp::Normal { .. } => "random",
        }
    }
    fn host(&self, _inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        map_buffer!(out, v => self.fill_host(v, threads));
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, _inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (kind, a, b, seed, offset) = self.cuda_args();
        let args = FillArgs { out: dev.ptr(out)?, n: out.len as u64, a, b, seed, offset };
        dev.launch(&MODULE, &format!("fill_{kind}_{}", dtype_tag(out.dtype)), dev.grid_for(out.len), BLOCK, &args)
    }
    fn overwrites(&self, _inputs: &[Src<'_>], _out_len: usize) -> bool {
        true
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("fill", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(FillArgs::C_DECL);
    s.push_str(FILL_CU);
    for dt in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16] {
        let (tag, ty) = (dtype_tag(dt), c_type(dt));
        for kind in ["constant", "arange", "uniform", "normal"] {
            s.push_str(&format!("extern \"C\" __global__ void fill_{kind}_{tag}(FillArgs p) {{ fill_{kind}<{ty}>(p); }}\n"));
        }
    }
    s
}

const FILL_CU: &str = r#"
template <typename T> __device__ void fill_constant(const FillArgs& p) {
    T* out = (T*)p.out;
    T v = Cv<T>::from(p.a);
    GRID_LOOP(i, p.n) out[i] = v;
}

template <typename T> __device__ void fill_arange(const FillArgs& p) {
    T* out = (T*)p.out;
    GRID_LOOP(i, p.n) out[i] = Cv<T>::from(p.a + (double)i * p.b);
}

// Philox 4x32-10, as kiln::philox4x32.
__device__ __forceinline__ void philox(u32 c[4], u32 k0, u32 k1) {
    const u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    for (int round = 0; round < 10; ++round) {
        if (round > 0) { k0 += W0; k1 += W1; }
        u32 hi0 = __umulhi(M0, c[0]), lo0 = M0 * c[0];
        u32 hi1 = __umulhi(M1, c[2]), lo1 = M1 * c[2];
        u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
}

__device__ __forceinline__ void draw(const FillArgs& p, u64 i, u32 c[4]) {
    u64 idx = p.offset + i;
    c[0] = (u32)idx; c[1] = (u32)(idx >> 32); c[2] = 0u; c[3] = 0u;
    philox(c, (u32)p.seed, (u32)(p.seed >> 32));
}

// Uniform in [a, b): rounding to a narrower type can reach the excluded
// upper bound, which a uniform draw never returns (the CPU does the same).
template <typename T> __device__ void fill_uniform(const FillArgs& p) {
    T* out = (T*)p.out;
    GRID_LOOP(i, p.n) {
        u32 c[4];
        draw(p, i, c);
        u64 bits = (((u64)c[0]) << 21) ^ (((u64)c[1]) >> 11);
        double u = (double)(bits & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
        T x = Cv<T>::from(p.a + (p.b - p.a) * u);
        if (Cv<T>::to(x) >= p.b) x = Cv<T>::from(p.a);
        out[i] = x;
    }
}

// Normal with mean a and standard deviation b (Box-Muller).
template <typename T> __device__ void fill_normal(const FillArgs& p) {
    T* out = (T*)p.out;
    GRID_LOOP(i, p.n) {
        u32 c[4];
        draw(p, i, c);
        double u1 = ((double)c[2] + 0.5) * (1.0 / 4294967296.0);
        double u2 = (double)c[3] * (1.0 / 4294967296.0);
        double z = ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);
        out[i] = Cv<T>::from(p.a + p.b * z);
    }
}
"#;
