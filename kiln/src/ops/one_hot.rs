//! `one_hot`: rows of zeros with a one at each label's class, read from the
//! labels by a kernel of its own (it was a comparison with `arange` before),
//! so that a label out of range is checked where it is read: on a GPU it
//! poisons the device's queue and the next synchronising call reports it
//! (`kernel::index_check`), naming the op that asked (`one_hot`, or
//! `cross_entropy` for its targets). `nn::one_hot` is the public function.

use crate::backends::host::loops::fill;
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
use crate::ops::index_select::{index_list, INDEX_DTYPES};
use crate::Tensor;
use std::sync::Arc;

/// out (n, classes) = one-hot rows of the n labels of input 0.
#[derive(Clone, Copy, Debug)]
struct OneHot {
    classes: usize,
    check: IndexCheck,
}

crate::kernel_args! {
    /// A one-hot kernel's argument: n labels, out (n, classes); `fault`,
    /// `site` for the label check.
    OneHotArgs { ids: u64, li: Lay, out: u64, n: u64, classes: u64, fault: u64, site: u64 }
}

impl CustomKernel for OneHot {
    fn name(&self) -> &'static str {
        // The op that asked: a bad label names it.
        self.check.op
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, threads: usize) -> Result<()> {
        let classes = self.classes;
        let picked = index_list(inputs[0].buf, inputs[0].layout, self.check, classes, 0)?;
        map_buffer!(out, o => {
            fill(o, WithDType::from_f64(0.0), threads);
            for (i, c) in picked.into_iter().enumerate() {
                o[i * classes + c] = WithDType::from_f64(1.0);
            }
        });
        Ok(())
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let ids = &inputs[0];
        let n = ids.layout.elem_count();
        let (fault, site) = self.check.cuda(dev)?;
        let args = OneHotArgs {
            ids: dev.ptr(&ids.storage)?,
            li: lay(dev, &ids.layout)?,
            out: dev.ptr(out)?,
            n: n as u64,
            classes: self.classes as u64,
            fault,
            site,
        };
        let name = format!("one_hot_{}_{}", dtype_tag(out.dtype), dtype_tag(ids.storage.dtype));
        dev.launch(&MODULE, &name, dev.grid_for(n), BLOCK, &args)
    }
    fn writes_nothing(&self, inputs: &[Src<'_>], _out_len: usize) -> bool {
        // With no classes there is nothing to write, but every label is
        // still checked (PyTorch refuses a label for 0 classes too).
        inputs[0].layout.elem_count() == 0
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(*self)
    }
}

static MODULE: CudaModule = CudaModule::generated("one_hot", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(OneHotArgs::C_DECL);
    s.push_str(
        r#"
// One thread per label: a label out of range is recorded in the fault
// record (reported by the next synchronising call) and gives a row of zeros.
template <typename T, typename I> __device__ void one_hot_impl(const OneHotArgs& p) {
    const I* ids = (const I*)p.ids;
    T* out = (T*)p.out;
    GRID_LOOP(i, p.n) {
        i64 v = read_raw(ids, p.li, i);
        bool ok = kiln_index_ok(p.fault, p.site, v, p.classes, 0);
        for (u64 c = 0; c < p.classes; ++c) out[i * p.classes + c] = Cv<T>::from(ok && (u64)v == c ? 1.0 : 0.0);
    }
}
"#,
    );
    for dt in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16] {
        for it in INDEX_DTYPES {
            let (tn, tt, in_, iy) = (dtype_tag(dt), c_type(dt), dtype_tag(it), c_type(it));
            s.push_str(&format!("extern \"C\" __global__ void one_hot_{tn}_{in_}(OneHotArgs p) {{ one_hot_impl<{tt}, {iy}>(p); }}\n"));
        }
    }
    s
}

impl Tensor {
    /// One-hot rows `(n, classes)` of `dtype` for the n labels of `self` (an
    /// integer tensor of any shape, read in row-major order), on its
    /// device, with the labels checked by the kernel under `check`'s name
    /// (the front end checks CPU labels before).
    pub(crate) fn one_hot_rows(&self, classes: usize, dtype: DType, check: IndexCheck) -> Result<Tensor> {
        if !INDEX_DTYPES.contains(&self.dtype()) {
            return Err(Error::invalid(check.op, format!("labels must be integers (i64, i32 or u8), got {}", self.dtype())));
        }
        let flat = self.flatten_all()?;
        let n = flat.elem_count();
        let op = OneHot { classes, check };
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![flat.src()] };
        self.run_new(kernel, dtype, Shape::from((n, classes)))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_dtype_pair_has_a_kernel() {
        let src = super::cuda_source();
        assert!(src.contains("void one_hot_f32_i64(OneHotArgs p)"));
        assert!(src.contains("void one_hot_bf16_u8(OneHotArgs p)"));
    }
}
