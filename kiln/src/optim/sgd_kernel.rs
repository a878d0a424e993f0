//! SGD's update as one kernel per parameter (two with momentum) instead of
//! one launch per arithmetic step: the same operations in the same order
//! and precision as the composed ops (`g + p·λ`, `v·μ + g`, `p − v·lr`,
//! each rounded to the parameter's type), so the values are the same bits.
//! The parameter is updated in place, in its own storage: no new buffer and
//! no copy back (a LeNet step on CUDA launched a copy per parameter for
//! that). f32 and f64 parameters; other dtypes take the composed ops.

use super::fused;
use crate::backends::host::loops::update_indexed;
use crate::backends::host::unsupported_op;
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::Result;
use crate::kernel::cuda::{c_type, dtype_tag, CudaDevice, CudaModule};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Src};
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
"#,
    );
    for dt in [DType::F32, DType::F64] {
        s.push_str(&format!("extern \"C\" __global__ void sgd_{}(SgdArgs a) {{ sgd_impl<{}>(a); }}\n", dtype_tag(dt), c_type(dt)));
    }
    s
}

/// `p ← p − (g + p·λ)·lr` in one kernel, in `p`'s own storage. Only for a
/// pair that [`fused::takes_in_place`] accepts, with `g` contiguous.
pub(super) fn param_step_in_place(p: &Tensor, g: &Tensor, lr: f64, weight_decay: f64) -> Result<()> {
    fused::into_parameter(&SgdKernel::Param { lr, weight_decay, offset: fused::offset(p) }, p, &[g])
}

/// `v·μ + (g + p·λ)`, or `g + p·λ` at the first step, in one kernel.
pub(super) fn velocity_step(p: &Tensor, g: &Tensor, v: Option<&Tensor>, momentum: f64, weight_decay: f64) -> Result<Tensor> {
    let k = SgdKernel::Velocity { momentum, weight_decay, has_velocity: v.is_some() };
    fused::new_tensor(&k, [Some(p), Some(g), v].into_iter().flatten())
}
