//! Adam's update as three kernels per parameter (the new first moment, the
//! new second moment, then the parameter in place) instead of about fifteen
//! launches of tensor ops, and on CUDA one launch for every parameter of a
//! step ([`AdamForeach`], up to 48 parameters a launch): the same operations
//! in the same order and precision as the composed ops (each product, sum,
//! quotient and square root rounded to the parameter's type), so the values
//! are the same bits. f32 and f64 parameters; other dtypes take the
//! composed ops.

use super::fused;
use crate::backends::host::loops::update_indexed;
use crate::backends::host::unsupported_op;
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::host_nn::NnFloat;
use crate::kernel::cuda::{c_type, dtype_tag, CudaDevice, CudaModule};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, MultiKernel, MultiPart, Src};
use crate::ops::conv::{check_extents, dptr};
use crate::Tensor;
use std::sync::Arc;

/// One Adam kernel. With `g' = g + p·λ` (λ = 0: `g' = g`):
#[derive(Clone, Copy, Debug)]
enum AdamKernel {
    /// [p, g, m] → m·β₁ + g'·(1−β₁); [p, g] (the first step) → g'·(1−β₁).
    First { beta: f64, one_minus_beta: f64, weight_decay: f64 },
    /// [p, g, v] → v·β₂ + (g'·g')·(1−β₂); [p, g] → (g'·g')·(1−β₂).
    Second { beta: f64, one_minus_beta: f64, weight_decay: f64 },
    /// [m, v] → p ← p − m / (√(v / c₂) + ε) · (lr / c₁), in place: p is the
    /// output storage's elements from `offset` on.
    Param { lr_over_c1: f64, c2: f64, eps: f64, offset: usize },
}

impl AdamKernel {
    /// The new value at one element: `x` is p (moments) or m (the parameter),
    /// `y` is g or v, `s` the old moment if any, `p` the parameter.
    fn at<T: NnFloat>(&self, p: T, y: T, s: Option<T>) -> T {
        let decayed = |g: T, wd: f64| if wd != 0.0 { g + p * T::from_f64(wd) } else { g };
        match *self {
            AdamKernel::First { beta, one_minus_beta, weight_decay } => {
                let g = decayed(y, weight_decay);
                match s {
                    Some(m) => m * T::from_f64(beta) + g * T::from_f64(one_minus_beta),
                    None => g * T::from_f64(one_minus_beta),
                }
            }
            AdamKernel::Second { beta, one_minus_beta, weight_decay } => {
                let g = decayed(y, weight_decay);
                match s {
                    Some(v) => v * T::from_f64(beta) + g * g * T::from_f64(one_minus_beta),
                    None => g * g * T::from_f64(one_minus_beta),
                }
            }
            // Here `y` is m and `s` is v.
            AdamKernel::Param { lr_over_c1, c2, eps, .. } => {
                let v = s.unwrap_or(T::ZERO);
                p - y / ((v / T::from_f64(c2)).sqrt() + T::from_f64(eps)) * T::from_f64(lr_over_c1)
            }
        }
    }
}

crate::kernel_args! {
    /// An Adam kernel's argument (`s` is 0 when absent). kind 0: a moment
    /// (`a` = β, `b` = 1 − β, `second` = 1 for the second moment); kind 1:
    /// the parameter (`x` = m, `y` = v, `a` = lr / c₁, `b` = c₂, `c` = ε).
    AdamArgs { p: u64, x: u64, y: u64, out: u64, n: u64, a: f64, b: f64, c: f64, weight_decay: f64, kind: u64, second: u64 }
}

/// The contiguous elements of an operand, or `None`.
fn slice<'a, T>(i: &'a HostIn<'_>, typed: impl Fn(&'a CpuBuffer) -> Option<&'a [T]>) -> Option<&'a [T]> {
    let (a, e) = i.layout.contiguous_range()?;
    typed(i.buf)?.get(a..e)
}

impl CustomKernel for AdamKernel {
    fn name(&self) -> &'static str {
        match self {
            AdamKernel::First { .. } => "adam_first_moment",
            AdamKernel::Second { .. } => "adam_second_moment",
            AdamKernel::Param { .. } => "adam_step",
        }
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        fn f32s(b: &CpuBuffer) -> Option<&[f32]> {
            if let CpuBuffer::F32(v) = b {
                Some(v)
            } else {
                None
            }
        }
        fn f64s(b: &CpuBuffer) -> Option<&[f64]> {
            if let CpuBuffer::F64(v) = b {
                Some(v)
            } else {
                None
            }
        }
        let refused = || unsupported_op(self.name());
        if let AdamKernel::Param { offset, .. } = *self {
            match out {
                CpuBuffer::F32(p) => {
                    let (m, v) = (slice(&inputs[0], f32s).ok_or_else(refused)?, slice(&inputs[1], f32s).ok_or_else(refused)?);
                    let p = p.get_mut(offset..offset + m.len()).filter(|_| v.len() == m.len()).ok_or_else(refused)?;
                    update_indexed(p, threads, |i, p| self.at(p, m[i], Some(v[i])));
                }
                CpuBuffer::F64(p) => {
                    let (m, v) = (slice(&inputs[0], f64s).ok_or_else(refused)?, slice(&inputs[1], f64s).ok_or_else(refused)?);
                    let p = p.get_mut(offset..offset + m.len()).filter(|_| v.len() == m.len()).ok_or_else(refused)?;
                    update_indexed(p, threads, |i, p| self.at(p, m[i], Some(v[i])));
                }
                _ => return Err(refused()),
            }
            return Ok(());
        }
        match out {
            CpuBuffer::F32(o) => {
                let (p, g) = (slice(&inputs[0], f32s).ok_or_else(refused)?, slice(&inputs[1], f32s).ok_or_else(refused)?);
                let s = inputs.get(2).map(|s| slice(s, f32s).ok_or_else(refused)).transpose()?;
                update_indexed(o, threads, |i, _| self.at(p[i], g[i], s.map(|s| s[i])));
            }
            CpuBuffer::F64(o) => {
                let (p, g) = (slice(&inputs[0], f64s).ok_or_else(refused)?, slice(&inputs[1], f64s).ok_or_else(refused)?);
                let s = inputs.get(2).map(|s| slice(s, f64s).ok_or_else(refused)).transpose()?;
                update_indexed(o, threads, |i, _| self.at(p[i], g[i], s.map(|s| s[i])));
            }
            _ => return Err(refused()),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (n, args) = match *self {
            AdamKernel::Param { lr_over_c1, c2, eps, offset } => {
                let n = inputs[0].layout.elem_count();
                check_extents(self.name(), inputs, &[n, n], out, offset.saturating_add(n))?;
                let p = dev.ptr(out)? + (offset * out.dtype.size_in_bytes()) as u64;
                let (m, v) = (dptr(dev, &inputs[0])?, dptr(dev, &inputs[1])?);
                (n, AdamArgs { p, x: m, y: v, out: p, n: n as u64, a: lr_over_c1, b: c2, c: eps, weight_decay: 0.0, kind: 1, second: 0 })
            }
            AdamKernel::First { beta, one_minus_beta, weight_decay } | AdamKernel::Second { beta, one_minus_beta, weight_decay } => {
                let n = out.len;
                check_extents(self.name(), inputs, &vec![n; inputs.len()], out, n)?;
                let s = if inputs.len() > 2 { dptr(dev, &inputs[2])? } else { 0 };
                let (p, g, o) = (dptr(dev, &inputs[0])?, dptr(dev, &inputs[1])?, dev.ptr(out)?);
                let second = u64::from(matches!(self, AdamKernel::Second { .. }));
                (n, AdamArgs { p, x: g, y: s, out: o, n: n as u64, a: beta, b: one_minus_beta, c: 0.0, weight_decay, kind: 0, second })
            }
        };
        if n == 0 {
            return Ok(());
        }
        dev.launch(&MODULE, &format!("adam_{}", dtype_tag(out.dtype)), dev.grid_for(n), crate::kernel::cuda::BLOCK, &args)
    }
    fn writes_nothing(&self, inputs: &[Src<'_>], out_len: usize) -> bool {
        match self {
            AdamKernel::Param { .. } => inputs[0].layout.elem_count() == 0,
            AdamKernel::First { .. } | AdamKernel::Second { .. } => out_len == 0,
        }
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("adam", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(AdamArgs::C_DECL);
    s.push_str(&fused::foreach_c_source());
    s.push_str(
        r#"
// kind 0: a moment, from x = g and y = the old moment (0: none): with
// g' = g + p·λ, m' = y·β + g'·(1−β), or v' = y·β + (g'·g')·(1−β).
// kind 1: p − x / (√(y / c₂) + ε) · (lr / c₁) with x = m', y = v', in place
// (out is p). Each product, sum, quotient and root rounded to T as the
// composed ops round them; each thread reads its element before writing it.
template <typename T> __device__ void adam_impl(const AdamArgs& a) {
    const T* p = (const T*)a.p;
    const T* __restrict__ x = (const T*)a.x;
    const T* __restrict__ y = (const T*)a.y;
    T* out = (T*)a.out;
    T ta = (T)a.a, tb = (T)a.b, tc = (T)a.c, wd = (T)a.weight_decay;
    GRID_LOOP(i, a.n) {
        if (a.kind == 1) {
            T q = Ar<T>::add(Fl<T>::sqrt(Ar<T>::div(y[i], tb)), tc);
            out[i] = Ar<T>::sub(p[i], Ar<T>::mul(Ar<T>::div(x[i], q), ta));
        } else {
            T g = x[i];
            if (a.weight_decay != 0.0) g = Ar<T>::add(g, Ar<T>::mul(p[i], wd));
            T term = a.second ? Ar<T>::mul(Ar<T>::mul(g, g), tb) : Ar<T>::mul(g, tb);
            out[i] = a.y ? Ar<T>::add(Ar<T>::mul(y[i], ta), term) : term;
        }
    }
}

// Every parameter of a step (up to 48) in one launch: block b updates a
// chunk of one part (`foreach_part`). Inputs: [p, g, m, v] (m, v 0 before
// the first step); outputs: [m', v', p]. s = [β₁, 1−β₁, β₂, 1−β₂, λ,
// lr / c₁, c₂, ε]. The same expressions, in the same order, as adam_impl's
// two moments and then the parameter.
template <typename T> __device__ void adam_foreach_impl(const ForeachArgs& a) {
    u64 begin, end;
    u64 t = foreach_part(a, blockIdx.x, &begin, &end);
    const T* __restrict__ g = (const T*)a.input[1][t];
    const T* __restrict__ m = (const T*)a.input[2][t];
    const T* __restrict__ v = (const T*)a.input[3][t];
    T* __restrict__ mout = (T*)a.out[0][t];
    T* __restrict__ vout = (T*)a.out[1][t];
    T* __restrict__ p = (T*)a.out[2][t];
    T b1 = (T)a.s[0], omb1 = (T)a.s[1], b2 = (T)a.s[2], omb2 = (T)a.s[3], wd = (T)a.s[4];
    T lr_c1 = (T)a.s[5], c2 = (T)a.s[6], eps = (T)a.s[7];
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
        T pi = p[i];
        T gi = g[i];
        if (a.s[4] != 0.0) gi = Ar<T>::add(gi, Ar<T>::mul(pi, wd));
        T m1 = Ar<T>::mul(gi, omb1);
        if (m) m1 = Ar<T>::add(Ar<T>::mul(m[i], b1), m1);
        T v1 = Ar<T>::mul(Ar<T>::mul(gi, gi), omb2);
        if (v) v1 = Ar<T>::add(Ar<T>::mul(v[i], b2), v1);
        mout[i] = m1;
        vout[i] = v1;
        T q = Ar<T>::add(Fl<T>::sqrt(Ar<T>::div(v1, c2)), eps);
        p[i] = Ar<T>::sub(pi, Ar<T>::mul(Ar<T>::div(m1, q), lr_c1));
    }
}
"#,
    );
    for dt in [DType::F32, DType::F64] {
        let (tag, ty) = (dtype_tag(dt), c_type(dt));
        s.push_str(&format!("extern \"C\" __global__ void adam_{tag}(AdamArgs a) {{ adam_impl<{ty}>(a); }}\n"));
        s.push_str(&format!("extern \"C\" __global__ void adam_foreach_{tag}(ForeachArgs a) {{ adam_foreach_impl<{ty}>(a); }}\n"));
    }
    s
}

/// `p ← p − m / (√(v / c₂) + ε) · (lr / c₁)` in one kernel, in `p`'s own
/// storage. Only for a parameter that [`fused::takes_in_place`] accepts,
/// with `m` and `v` from [`first_moment`] and [`second_moment`].
pub(super) fn param_step_in_place(p: &Tensor, m: &Tensor, v: &Tensor, lr_over_c1: f64, c2: f64, eps: f64) -> Result<()> {
    fused::run_into(&AdamKernel::Param { lr_over_c1, c2, eps, offset: fused::offset(p) }, p, &[m, v])
}

/// Adam's step for many parameters of one device and dtype at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct AdamForeach {
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub lr_over_c1: f64,
    pub c2: f64,
    pub eps: f64,
}

/// One parameter's step: `p` (f32/f64, one contiguous run, that
/// [`fused::takes_in_place`] accepts), its gradient and old moments
/// (contiguous, on `p`'s device), and the uninitialised storages of the
/// new moments.
pub(super) struct AdamPart<'a> {
    pub p: &'a Tensor,
    pub g: &'a Tensor,
    pub old_m: Option<&'a Tensor>,
    pub old_v: Option<&'a Tensor>,
    pub m: &'a Tensor,
    pub v: &'a Tensor,
}

impl AdamForeach {
    /// Runs the step of every part: one launch per 48 parameters where the
    /// device has it (CUDA), else three kernels per parameter, with the same
    /// values either way.
    pub(super) fn run(&self, parts: &[AdamPart<'_>]) -> Result<()> {
        let multi: Vec<MultiPart<'_>> = parts
            .iter()
            .map(|q| MultiPart {
                inputs: [Some(q.p.src()), Some(q.g.src()), q.old_m.map(Tensor::src), q.old_v.map(Tensor::src)].into_iter().collect(),
                outs: [(&*q.m.storage, 0), (&*q.v.storage, 0), (&*q.p.storage, fused::offset(q.p))].into_iter().collect(),
            })
            .collect();
        if crate::backends::launch_multi(self, &multi)? {
            return Ok(());
        }
        let (wd, (b1, b2)) = (self.weight_decay, (self.beta1, self.beta2));
        for q in parts {
            let first = AdamKernel::First { beta: b1, one_minus_beta: 1.0 - b1, weight_decay: wd };
            fused::run_into(&first, q.m, &[Some(q.p), Some(q.g), q.old_m].into_iter().flatten().collect::<Vec<_>>())?;
            let second = AdamKernel::Second { beta: b2, one_minus_beta: 1.0 - b2, weight_decay: wd };
            fused::run_into(&second, q.v, &[Some(q.p), Some(q.g), q.old_v].into_iter().flatten().collect::<Vec<_>>())?;
            param_step_in_place(q.p, q.m, q.v, self.lr_over_c1, self.c2, self.eps)?;
        }
        Ok(())
    }
}

impl MultiKernel for AdamForeach {
    fn name(&self) -> &'static str {
        "adam_foreach"
    }
    fn cuda(&self, dev: &dyn CudaDevice, parts: &[&MultiPart<'_>]) -> Result<()> {
        let (b1, b2) = (self.beta1, self.beta2);
        let scalars = [b1, 1.0 - b1, b2, 1.0 - b2, self.weight_decay, self.lr_over_c1, self.c2, self.eps];
        fused::launch_foreach(dev, &MODULE, "adam_foreach", parts, scalars, 0)
    }
}
