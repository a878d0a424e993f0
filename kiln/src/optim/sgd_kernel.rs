//! SGD's update as one kernel per parameter (two with momentum) instead of
//! one launch per arithmetic step, and on CUDA one launch for every
//! parameter of a step ([`SgdForeach`], up to 48 parameters a launch): the
//! same operations in the same order and precision as the composed ops
//! (`g + p·λ`, `v·μ + g`, `p − v·lr`, each rounded to the parameter's
//! type), so the values are the same bits. The parameter is updated in
//! place, in its own storage: no new buffer and no copy back (a LeNet step
//! on CUDA launched a copy per parameter for that). f32 and f64
//! parameters; other dtypes take the composed ops.

use super::fused;
use crate::backends::host::loops::update_indexed;
use crate::backends::host::unsupported_op;
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::cuda::{c_type, dtype_tag, CudaDevice, CudaModule};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, MultiKernel, MultiPart, Src};
use crate::ops::conv::{check_extents, dptr};
use crate::Tensor;
use std::sync::Arc;

/// One SGD kernel. With `g' = g + p·λ` (λ = 0: `g' = g`):
#[derive(Clone, Copy, Debug)]
enum SgdKernel {
    /// [g] → p ← p − g'·lr, in place: p is the `n` elements of the output
    /// storage from `offset` on.
    Param { lr: f64, weight_decay: f64, offset: usize },
    /// [p, g, v] → v·μ + g'; [p, g] (the first step) → g'.
    Velocity { momentum: f64, weight_decay: f64, has_velocity: bool },
}

impl SgdKernel {
    fn at<T: crate::host_nn::NnFloat>(&self, p: T, g: T, v: Option<T>) -> T {
        let (SgdKernel::Param { weight_decay: wd, .. } | SgdKernel::Velocity { weight_decay: wd, .. }) = *self;
        let g = if wd != 0.0 { g + p * T::from_f64(wd) } else { g };
        match *self {
            SgdKernel::Param { lr, .. } => p - g * T::from_f64(lr),
            SgdKernel::Velocity { momentum, .. } => match v {
                Some(v) => v * T::from_f64(momentum) + g,
                None => g,
            },
        }
    }
}

crate::kernel_args! {
    /// An SGD kernel's argument (`v` is 0 when absent).
    SgdArgs { p: u64, g: u64, v: u64, out: u64, n: u64, lr: f64, momentum: f64, weight_decay: f64, kind: u64 }
}

impl CustomKernel for SgdKernel {
    fn name(&self) -> &'static str {
        match self {
            SgdKernel::Param { .. } => "sgd_step",
            SgdKernel::Velocity { .. } => "sgd_momentum",
        }
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        fn slice<'a>(i: &'a HostIn<'_>) -> Option<&'a CpuBuffer> {
            i.layout.contiguous_range().map(|_| i.buf)
        }
        let range = |i: &HostIn<'_>| i.layout.contiguous_range().unwrap_or((0, 0));
        if let SgdKernel::Param { offset, .. } = *self {
            let (a, e) = range(&inputs[0]);
            let place = offset..offset + (e - a);
            match (out, slice(&inputs[0])) {
                (CpuBuffer::F32(p), Some(CpuBuffer::F32(g))) if place.end <= p.len() => {
                    update_indexed(&mut p[place], threads, |i, p| self.at(p, g[a + i], None))
                }
                (CpuBuffer::F64(p), Some(CpuBuffer::F64(g))) if place.end <= p.len() => {
                    update_indexed(&mut p[place], threads, |i, p| self.at(p, g[a + i], None))
                }
                _ => return Err(unsupported_op(self.name())),
            }
            return Ok(());
        }
        let v = inputs.get(2);
        match (out, slice(&inputs[0]), slice(&inputs[1])) {
            (CpuBuffer::F32(o), Some(CpuBuffer::F32(p)), Some(CpuBuffer::F32(g))) => {
                let (pr, gr) = (range(&inputs[0]), range(&inputs[1]));
                let vs = match v.map(|v| (v.buf, range(v))) {
                    Some((CpuBuffer::F32(b), (a, e))) => Some(&b[a..e]),
                    Some(_) => return Err(unsupported_op(self.name())),
                    None => None,
                };
                update_indexed(o, threads, |i, _| self.at(p[pr.0 + i], g[gr.0 + i], vs.map(|v| v[i])));
            }
            (CpuBuffer::F64(o), Some(CpuBuffer::F64(p)), Some(CpuBuffer::F64(g))) => {
                let (pr, gr) = (range(&inputs[0]), range(&inputs[1]));
                let vs = match v.map(|v| (v.buf, range(v))) {
                    Some((CpuBuffer::F64(b), (a, e))) => Some(&b[a..e]),
                    Some(_) => return Err(unsupported_op(self.name())),
                    None => None,
                };
                update_indexed(o, threads, |i, _| self.at(p[pr.0 + i], g[gr.0 + i], vs.map(|v| v[i])));
            }
            _ => return Err(unsupported_op(self.name())),
        }
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (n, args) = match *self {
            SgdKernel::Param { lr, weight_decay, offset } => {
                // In place: the output storage holds p from `offset` on.
                let n = inputs[0].layout.elem_count();
                check_extents(self.name(), inputs, &[n], out, offset.saturating_add(n))?;
                let p = dev.ptr(out)? + (offset * out.dtype.size_in_bytes()) as u64;
                let g = dptr(dev, &inputs[0])?;
                (n, SgdArgs { p, g, v: 0, out: p, n: n as u64, lr, momentum: 0.0, weight_decay, kind: 0 })
            }
            SgdKernel::Velocity { momentum, weight_decay, has_velocity } => {
                let n = out.len;
                check_extents(self.name(), inputs, &vec![n; inputs.len()], out, n)?;
                let v = if inputs.len() > 2 { dptr(dev, &inputs[2])? } else { 0 };
                let (p, g, out) = (dptr(dev, &inputs[0])?, dptr(dev, &inputs[1])?, dev.ptr(out)?);
                (n, SgdArgs { p, g, v, out, n: n as u64, lr: 0.0, momentum, weight_decay, kind: if has_velocity { 1 } else { 2 } })
            }
        };
        if n == 0 {
            return Ok(());
        }
        dev.launch(&MODULE, &format!("sgd_{}", dtype_tag(out.dtype)), dev.grid_for(n), crate::kernel::cuda::BLOCK, &args)
    }
    fn writes_nothing(&self, inputs: &[Src<'_>], out_len: usize) -> bool {
        match self {
            SgdKernel::Param { .. } => inputs[0].layout.elem_count() == 0,
            SgdKernel::Velocity { .. } => out_len == 0,
        }
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("sgd", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(SgdArgs::C_DECL);
    s.push_str(&fused::foreach_c_source());
    s.push_str(
        r#"
// kind 0: p − g'·lr (in place: out is p); 1: v·μ + g'; 2: g' (g' = g + p·λ,
// or g when λ = 0), each product and sum rounded to T as the composed ops
// round them. p and out may be one array: each thread reads its element
// before writing it.
template <typename T> __device__ void sgd_impl(const SgdArgs& a) {
    const T* p = (const T*)a.p;
    const T* __restrict__ g = (const T*)a.g;
    const T* __restrict__ v = (const T*)a.v;
    T* out = (T*)a.out;
    T lr = (T)a.lr, mu = (T)a.momentum, wd = (T)a.weight_decay;
    GRID_LOOP(i, a.n) {
        T gi = g[i];
        if (a.weight_decay != 0.0) gi = Ar<T>::add(gi, Ar<T>::mul(p[i], wd));
        if (a.kind == 0) out[i] = Ar<T>::sub(p[i], Ar<T>::mul(gi, lr));
        else if (a.kind == 1) out[i] = Ar<T>::add(Ar<T>::mul(v[i], mu), gi);
        else out[i] = gi;
    }
}

// Every parameter of a step (up to 48) in one launch: block b updates a
// chunk of one part (`foreach_part`). Inputs: [p, g, v (0: none)]; outputs:
// [v', p] with momentum (flags bit 0), [p] without. s = [lr, μ, λ]. The
// same expressions, in the same order, as sgd_impl's kinds 1 or 2 then 0.
template <typename T> __device__ void sgd_foreach_impl(const ForeachArgs& a) {
    u64 begin, end;
    u64 t = foreach_part(a, blockIdx.x, &begin, &end);
    bool momentum = (a.flags & 1) != 0;
    const T* __restrict__ g = (const T*)a.input[1][t];
    const T* __restrict__ v = (const T*)a.input[2][t];
    T* vout = (T*)a.out[0][t];  // p itself without momentum: not written then
    T* __restrict__ p = (T*)a.out[momentum ? 1 : 0][t];
    T lr = (T)a.s[0], mu = (T)a.s[1], wd = (T)a.s[2];
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
        T pi = p[i];
        T gi = g[i];
        if (a.s[2] != 0.0) gi = Ar<T>::add(gi, Ar<T>::mul(pi, wd));
        if (momentum) {
            if (v) gi = Ar<T>::add(Ar<T>::mul(v[i], mu), gi);
            vout[i] = gi;
        }
        p[i] = Ar<T>::sub(pi, Ar<T>::mul(gi, lr));
    }
}
"#,
    );
    for dt in [DType::F32, DType::F64] {
        let (tag, ty) = (dtype_tag(dt), c_type(dt));
        s.push_str(&format!("extern \"C\" __global__ void sgd_{tag}(SgdArgs a) {{ sgd_impl<{ty}>(a); }}\n"));
        s.push_str(&format!("extern \"C\" __global__ void sgd_foreach_{tag}(ForeachArgs a) {{ sgd_foreach_impl<{ty}>(a); }}\n"));
    }
    s
}

/// SGD's step for many parameters of one device and dtype at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct SgdForeach {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
}

/// One parameter's step: `p` (f32/f64, one contiguous run, that
/// [`fused::takes_in_place`] accepts), its gradient and old velocity
/// (contiguous, on `p`'s device) and, with momentum, the uninitialised
/// storage of the new velocity.
pub(super) struct SgdPart<'a> {
    pub p: &'a Tensor,
    pub g: &'a Tensor,
    pub old: Option<&'a Tensor>,
    pub new: Option<&'a Tensor>,
}

impl SgdForeach {
    /// Runs the step of every part: one launch per 48 parameters where the
    /// device has it (CUDA), else one or two kernels per parameter, with the
    /// same values either way.
    pub(super) fn run(&self, parts: &[SgdPart<'_>]) -> Result<()> {
        let multi: Vec<MultiPart<'_>> = parts
            .iter()
            .map(|q| {
                let mut outs = smallvec::SmallVec::new();
                if let Some(new) = q.new {
                    outs.push((&*new.storage, 0));
                }
                outs.push((&*q.p.storage, fused::offset(q.p)));
                MultiPart { inputs: [Some(q.p.src()), Some(q.g.src()), q.old.map(Tensor::src)].into_iter().collect(), outs }
            })
            .collect();
        if crate::backends::launch_multi(self, &multi)? {
            return Ok(());
        }
        for q in parts {
            match q.new {
                Some(new) => {
                    let k = SgdKernel::Velocity { momentum: self.momentum, weight_decay: self.weight_decay, has_velocity: q.old.is_some() };
                    fused::run_into(&k, new, &[Some(q.p), Some(q.g), q.old].into_iter().flatten().collect::<Vec<_>>())?;
                    param_step_in_place(q.p, new, self.lr, 0.0)?;
                }
                None => param_step_in_place(q.p, q.g, self.lr, self.weight_decay)?,
            }
        }
        Ok(())
    }
}

impl MultiKernel for SgdForeach {
    fn name(&self) -> &'static str {
        "sgd_foreach"
    }
    fn cuda(&self, dev: &dyn CudaDevice, parts: &[&MultiPart<'_>]) -> Result<()> {
        let scalars = [self.lr, self.momentum, self.weight_decay, 0.0, 0.0, 0.0, 0.0, 0.0];
        fused::launch_foreach(dev, &MODULE, "sgd_foreach", parts, scalars, u64::from(self.momentum != 0.0))
    }
}

/// `p ← p − (g + p·λ)·lr` in one kernel, in `p`'s own storage. Only for a
/// pair that [`fused::takes_in_place`] accepts, with `g` contiguous.
pub(super) fn param_step_in_place(p: &Tensor, g: &Tensor, lr: f64, weight_decay: f64) -> Result<()> {
    fused::run_into(&SgdKernel::Param { lr, weight_decay, offset: fused::offset(p) }, p, &[g])
}
