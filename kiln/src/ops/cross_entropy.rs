//! Cross-entropy of logits against labels, row by row, in one kernel each
//! way: `nn::cross_entropy` of f32 and f64 logits is these rows' mean.
//! Composed from log-softmax, one-hot, a product and sums it launched about
//! ten kernels forward and as many backward per training step; fused, one
//! kernel computes every row's loss and one its gradient.
//!
//! Row i of logits x with label y: `loss_i = ln Σ_j exp(x_ij − m_i) −
//! (x_iy − m_i)`, `m_i` the row's largest logit, computed in f64 and
//! rounded once to the logits' dtype (the composed form rounded every
//! step). The gradient recomputes the row's sum (a row is read twice
//! rather than a softmax stored):
//! `∂loss_i/∂x_ij = g_i · (exp(x_ij − m_i) / Σ − [j = y])`. A NaN logit
//! makes its row's loss and gradient NaN. A label outside `0..classes` is
//! checked where it is read, as `one_hot` checks it: the host kernel
//! returns the error, a CUDA kernel records it for the next synchronising
//! call (`kernel::index_check`), both naming `cross_entropy`.

use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::Shape;
use crate::kernel::cuda::{c_type, dtype_tag, lay, CudaDevice, CudaModule, BLOCK};
use crate::kernel::index_check::IndexCheck;
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::map_buffer;
use crate::ops::index_select::index_list;
use crate::runtime::memory::try_vec;
use crate::Tensor;
use std::sync::Arc;

/// The label check: a bad label names `cross_entropy`.
const CHECK: IndexCheck = IndexCheck::label("cross_entropy");

crate::kernel_args! {
    /// A cross-entropy kernel's argument: logits (n, classes), labels (n),
    /// the rows' output gradient (n; backward only), out (n) forward or
    /// (n, classes) backward; `fault`, `site` for the label check.
    CrossEntropyArgs { x: u64, xl: Lay, ids: u64, il: Lay, g: u64, gl: Lay, out: u64, n: u64, classes: u64, fault: u64, site: u64 }
}

/// Forward: out (n) = each row's loss. Backward: out (n, classes) = the
/// gradient of the rows' losses weighted by input 2.
#[derive(Clone, Copy, Debug)]
struct CrossEntropy {
    classes: usize,
    backward: bool,
}

/// `(m, Σ_j exp(x_j − m))` of one row.
fn row_stats(row: &[f64]) -> (f64, f64) {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (m, row.iter().map(|&v| (v - m).exp()).sum())
}

impl CustomKernel for CrossEntropy {
    fn name(&self) -> &'static str {
        CHECK.op
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        let c = self.classes;
        let labels = index_list(inputs[1].buf, inputs[1].layout, CHECK, c, 0)?;
        // The rows' output gradient (backward): n values, as f64.
        let mut g = try_vec(if self.backward { labels.len() } else { 0 })?;
        if self.backward {
            g.extend(inputs[2].layout.offsets().map(|o| inputs[2].buf.get_f64(o)));
        }
        // One row of logits at a time, as f64 (never a copy of them all:
        // the logits may be most of memory).
        let (x, mut at) = (inputs[0].buf, inputs[0].layout.offsets());
        let mut row = try_vec(c)?;
        map_buffer!(out, o => {
            for (i, &y) in labels.iter().enumerate() {
                row.clear();
                row.extend(at.by_ref().take(c).map(|off| x.get_f64(off)));
                let (m, sum) = row_stats(&row);
                if self.backward {
                    for (j, &v) in row.iter().enumerate() {
                        let p = (v - m).exp() / sum - f64::from(u8::from(j == y));
                        o[i * c + j] = WithDType::from_f64(g[i] * p);
                    }
                } else {
                    o[i] = WithDType::from_f64(sum.ln() - (row[y] - m));
                }
            }
        });
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let (x, ids) = (&inputs[0], &inputs[1]);
        // The forward has no gradient input: the labels stand in (unread).
        let g = inputs.get(2).unwrap_or(ids);
        let n = ids.layout.elem_count();
        let (fault, site) = CHECK.cuda(dev)?;
        let args = CrossEntropyArgs {
            x: dev.ptr(&x.storage)?,
            xl: lay(dev, &x.layout)?,
            ids: dev.ptr(&ids.storage)?,
            il: lay(dev, &ids.layout)?,
            g: dev.ptr(&g.storage)?,
            gl: lay(dev, &g.layout)?,
            out: dev.ptr(out)?,
            n: n as u64,
            classes: self.classes as u64,
            fault,
            site,
        };
        let way = if self.backward { "bwd" } else { "fwd" };
        let name = format!("cross_entropy_{way}_{}", dtype_tag(x.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(n), BLOCK, &args)
    }
    fn writes_nothing(&self, inputs: &[Src<'_>], _out_len: usize) -> bool {
        // With no classes there is nothing to write, but every label is
        // still checked (PyTorch refuses a label for 0 classes too).
        inputs[1].layout.elem_count() == 0
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("cross_entropy", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

/// The dtypes of logits the fused kernels take; others go through the
/// composed form.
const FUSED_DTYPES: [DType; 2] = [DType::F32, DType::F64];

fn cuda_source() -> String {
    let mut s = String::from(CrossEntropyArgs::C_DECL);
    s.push_str(
        r#"
// One thread per row, in f64 as the host kernel: the row's largest logit,
// the sum of exponentials, then the loss (forward) or the gradient
// (backward). A label out of range is recorded in the fault record and
// gives a NaN row.
template <typename T> __device__ void cross_entropy_impl(const CrossEntropyArgs& p, bool backward) {
    const T* x = (const T*)p.x;
    const i64* ids = (const i64*)p.ids;
    T* out = (T*)p.out;
    GRID_LOOP(i, p.n) {
        i64 v = read_raw(ids, p.il, i);
        bool ok = kiln_index_ok(p.fault, p.site, v, p.classes, 0);
        const double nan = __longlong_as_double(0x7ff8000000000000ll);
        double m = __longlong_as_double(0xfff0000000000000ll); // -inf
        for (u64 j = 0; j < p.classes; ++j) m = fmax(m, Cv<T>::to(x[lay_off(p.xl, i * p.classes + j)]));
        double sum = 0.0;
        for (u64 j = 0; j < p.classes; ++j) sum += ::exp(Cv<T>::to(x[lay_off(p.xl, i * p.classes + j)]) - m);
        if (backward) {
            double g = Cv<T>::to(((const T*)p.g)[lay_off(p.gl, i)]);
            for (u64 j = 0; j < p.classes; ++j) {
                double e = ::exp(Cv<T>::to(x[lay_off(p.xl, i * p.classes + j)]) - m) / sum;
                double d = ok ? e - ((u64)v == j ? 1.0 : 0.0) : nan;
                out[i * p.classes + j] = Cv<T>::from(g * d);
            }
        } else {
            double xy = ok ? Cv<T>::to(x[lay_off(p.xl, i * p.classes + (u64)v)]) : nan;
            out[i] = Cv<T>::from(::log(sum) - (xy - m));
        }
    }
}
"#,
    );
    for dt in FUSED_DTYPES {
        let (tag, ty) = (dtype_tag(dt), c_type(dt));
        s.push_str(&format!(
            "extern \"C\" __global__ void cross_entropy_fwd_{tag}(CrossEntropyArgs p) {{ cross_entropy_impl<{ty}>(p, false); }}\n\
             extern \"C\" __global__ void cross_entropy_bwd_{tag}(CrossEntropyArgs p) {{ cross_entropy_impl<{ty}>(p, true); }}\n"
        ));
    }
    s
}

impl Tensor {
    /// True when these logits' dtype has the fused kernels
    /// ([`cross_entropy_rows`](Self::cross_entropy_rows)).
    pub(crate) fn has_fused_cross_entropy(&self) -> bool {
        FUSED_DTYPES.contains(&self.dtype())
    }

    /// Each row's cross-entropy loss, `(n)`, of logits `self` (n, classes)
    /// of f32 or f64 against i64 `labels` (n) on the same device (checked
    /// by `nn::cross_entropy` before); the gradient flows to `self`.
    pub(crate) fn cross_entropy_rows(&self, labels: &Tensor) -> Result<Tensor> {
        if !self.has_fused_cross_entropy() || labels.dtype() != DType::I64 || self.rank() != 2 {
            return Err(Error::invalid(
                CHECK.op,
                format!(
                    "fused rows take 2-D f32/f64 logits and i64 labels, got {} and {} (a kiln bug: please report it)",
                    self.dtype(),
                    labels.dtype()
                ),
            ));
        }
        let (n, classes) = (self.dims()[0], self.dims()[1]);
        let labels = labels.flatten_all()?.detach();
        let op = CrossEntropy { classes, backward: false };
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src(), labels.src()] };
        let rows = self.run_new(kernel, self.dtype(), Shape::from(n))?;
        Ok(crate::autograd::record(rows, &[self], false, || {
            Box::new(move |c| Ok(smallvec::smallvec![Some(c.inputs[0].cross_entropy_rows_grad(&labels, c.g)?)]))
        }))
    }

    /// The gradient of [`cross_entropy_rows`](Self::cross_entropy_rows)
    /// for the rows' output gradient `g` (n): `(n, classes)`.
    fn cross_entropy_rows_grad(&self, labels: &Tensor, g: &Tensor) -> Result<Tensor> {
        let op = CrossEntropy { classes: self.dims()[1], backward: true };
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![self.src(), labels.src(), g.src()] };
        self.run_new(kernel, self.dtype(), Shape::from(self.dims().to_vec()))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn both_directions_have_a_kernel_per_dtype() {
        let src = super::cuda_source();
        for name in ["cross_entropy_fwd_f32", "cross_entropy_bwd_f32", "cross_entropy_fwd_f64", "cross_entropy_bwd_f64"] {
            assert!(src.contains(&format!("void {name}(CrossEntropyArgs p)")), "{name}");
        }
    }

    #[test]
    fn a_row_is_its_log_sum_exp_less_the_labelled_logit() {
        let (m, sum) = super::row_stats(&[1.0, 2.0, 3.0]);
        assert_eq!(m, 3.0);
        let expected = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln() - 2.0;
        assert!((sum.ln() - (2.0 - m) - expected).abs() < 1e-15);
    }
}
