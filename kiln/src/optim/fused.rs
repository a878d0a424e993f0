//! What the fused optimizer kernels (`sgd_kernel`, `adam_kernel`) share:
//! which parameters they take, running a kernel into a new tensor or into
//! a parameter's own storage, and the table of a multi-tensor launch (every
//! parameter of a step in one CUDA launch, as PyTorch's `foreach`
//! optimizers).

use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::kernel::cuda::{CudaDevice, KernelArgs, BLOCK};
use crate::kernel::{CustomKernel, Kernel, MultiPart, OpRef};
use crate::ops::conv::{check_extents, dptr};
use crate::Tensor;
use std::collections::HashSet;

/// Whether `p` can take a fused step from `operands` (its gradient and
/// its state, on `p`'s device already): f32 or f64, every operand of `p`'s
/// dtype, shape and device and sharing the storage of no parameter of the
/// step (`storages`, from [`storages`]: one launch writes them all while
/// it reads the operands), and `p` one contiguous run of its storage, which
/// the step then writes in place.
pub(super) fn takes_in_place<'a>(p: &Tensor, operands: impl IntoIterator<Item = &'a Tensor>, storages: &HashSet<usize>) -> bool {
    matches!(p.dtype(), DType::F32 | DType::F64)
        && p.layout().contiguous_range().is_some()
        && operands
            .into_iter()
            .all(|t| t.dtype() == p.dtype() && t.dims() == p.dims() && t.device() == p.device() && !storages.contains(&t.storage_id()))
}

/// The storages of the parameters of a step (see [`takes_in_place`]).
pub(super) fn storages(params: &[Tensor]) -> HashSet<usize> {
    params.iter().map(Tensor::storage_id).collect()
}

/// The parameters a step has updated so far. When a later update fails,
/// the step fails and drops its new state, so these are poisoned with the
/// failure: their values stand for a step that did not happen, and must
/// not be read as if it had.
#[derive(Default)]
pub(super) struct Stepped<'a> {
    params: Vec<&'a Tensor>,
}

impl<'a> Stepped<'a> {
    /// Runs `update` of `params`; on failure poisons every parameter
    /// updated before, and those of `update` (which may have written part
    /// of them), and returns the error.
    pub(super) fn run(&mut self, params: impl IntoIterator<Item = &'a Tensor>, update: impl FnOnce() -> Result<()>) -> Result<()> {
        self.params.extend(params);
        update().inspect_err(|err| {
            for p in &self.params {
                p.storage.poison(err);
            }
        })
    }
}

/// Where `p`'s elements start in its storage (for a `p` that
/// [`takes_in_place`] accepts).
pub(super) fn offset(p: &Tensor) -> usize {
    p.layout().contiguous_range().map_or(0, |(a, _)| a)
}

/// A contiguous tensor of `p`'s dtype, shape and device whose elements are
/// not yet written: the new state of a fused step, allocated before any
/// parameter changes and written by the step's kernels.
pub(super) fn uninit_like(p: &Tensor) -> Result<Tensor> {
    Ok(Tensor::from_storage(p.alloc_like(p.dtype(), p.shape())?, p.shape().clone()))
}

/// Groups the indices `0..n` by the device and dtype of `param(i)`, in
/// order of first appearance: the parameters one multi-tensor launch can
/// take.
pub(super) fn groups<'a>(n: usize, param: impl Fn(usize) -> &'a Tensor) -> Vec<Vec<usize>> {
    let mut out: Vec<((crate::Device, DType), Vec<usize>)> = Vec::new();
    for i in 0..n {
        let k = (param(i).device(), param(i).dtype());
        match out.iter_mut().find(|(g, _)| *g == k) {
            Some((_, members)) => members.push(i),
            None => out.push((k, vec![i])),
        }
    }
    out.into_iter().map(|(_, members)| members).collect()
}

/// Runs `k` over `inputs` (contiguous already), writing `target`'s own
/// storage (a parameter in place, or a new state from [`uninit_like`]).
pub(super) fn run_into(k: &dyn CustomKernel, target: &Tensor, inputs: &[&Tensor]) -> Result<()> {
    let kernel = Kernel::Custom { op: OpRef::Borrowed(k), inputs: inputs.iter().map(|t| t.src()).collect() };
    crate::backends::launch_into(&kernel, &target.storage)
}

/// Parts one multi-tensor launch takes: its argument struct (3.5 KB) stays
/// under the 4 KB of parameters every CUDA kernel may take; a step with
/// more parameters launches once per 48.
pub(super) const FOREACH_PARTS: usize = 48;

/// Elements one block of a multi-tensor kernel updates: 8 per thread, so
/// no thread's work grows with a parameter's size.
pub(super) const FOREACH_CHUNK: usize = BLOCK as usize * 8;

/// The argument of a multi-tensor kernel: per part, up to four inputs and
/// three outputs (addresses of their first element, 0 where absent), its
/// element count and its first block; then the op's scalars.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct ForeachArgs {
    pub input: [[u64; FOREACH_PARTS]; 4],
    pub out: [[u64; FOREACH_PARTS]; 3],
    pub n: [u64; FOREACH_PARTS],
    pub first_block: [u64; FOREACH_PARTS + 1],
    pub parts: u64,
    pub chunk: u64,
    /// The op's scalars (learning rate, momentum, ...), as the op names them.
    pub s: [f64; 8],
    pub flags: u64,
}

const _: () =
    assert!(std::mem::size_of::<ForeachArgs>() == 8 * (9 * FOREACH_PARTS + 1 + 2 + 8 + 1) && std::mem::size_of::<ForeachArgs>() <= 4096);

impl KernelArgs for ForeachArgs {
    fn bytes(&self) -> &[u8] {
        // SAFETY: a repr(C) struct of u64 and f64 only (no padding, size
        // asserted above): every byte is initialised.
        unsafe { std::slice::from_raw_parts((self as *const ForeachArgs).cast::<u8>(), std::mem::size_of::<ForeachArgs>()) }
    }
}

/// The C side of [`ForeachArgs`], and `foreach_part`, which finds the part
/// and the element range of the calling block (a scan over at most
/// [`FOREACH_PARTS`] entries by each thread: bounded work).
pub(super) fn foreach_c_source() -> String {
    format!(
        r#"
struct ForeachArgs {{ u64 input[4][{p}]; u64 out[3][{p}]; u64 n[{p}]; u64 first_block[{p1}]; u64 parts; u64 chunk; double s[8]; u64 flags; }};
// The part of block `b`, and the elements [begin, end) of it the block updates.
__device__ __forceinline__ u64 foreach_part(const ForeachArgs& a, u64 b, u64* begin, u64* end) {{
    u64 t = 0;
    while (t + 1 < a.parts && a.first_block[t + 1] <= b) ++t;
    *begin = (b - a.first_block[t]) * a.chunk;
    *end = *begin + a.chunk < a.n[t] ? *begin + a.chunk : a.n[t];
    return t;
}}
"#,
        p = FOREACH_PARTS,
        p1 = FOREACH_PARTS + 1
    )
}

/// Launches `{prefix}_{dtype}` (of `module`) over `parts`,
/// [`FOREACH_PARTS`] at a time. Every op lays a part out as `[p, g, ...]`:
/// part `j` reads its inputs (present ones contiguous, of `n` elements, the
/// gradient's count, all of the outputs' dtype) and writes `n` elements of
/// each output from its offset. Every part is checked before the first
/// launch. `scalars` and `flags` are the op's.
pub(super) fn launch_foreach(
    dev: &dyn CudaDevice,
    module: &'static crate::kernel::cuda::CudaModule,
    prefix: &str,
    parts: &[&MultiPart<'_>],
    scalars: [f64; 8],
    flags: u64,
) -> Result<()> {
    let Some(dtype) = parts.iter().find_map(|p| p.outs.first()).map(|(s, _)| s.dtype) else { return Ok(()) };
    let kernel = &format!("{prefix}_{}", crate::kernel::cuda::dtype_tag(dtype));
    let n_of = |p: &MultiPart<'_>| p.inputs.get(1).and_then(|g| g.as_ref()).map_or(0, |g| g.layout.elem_count());
    let mut args = ForeachArgs {
        input: [[0; FOREACH_PARTS]; 4],
        out: [[0; FOREACH_PARTS]; 3],
        n: [0; FOREACH_PARTS],
        first_block: [0; FOREACH_PARTS + 1],
        parts: 0,
        chunk: FOREACH_CHUNK as u64,
        s: scalars,
        flags,
    };
    let mut blocks = 0u64;
    let flush = |args: &mut ForeachArgs, blocks: &mut u64| -> Result<()> {
        if args.parts > 0 {
            let grid = u32::try_from(*blocks).ok().filter(|&g| g <= i32::MAX as u32).ok_or_else(|| Error::Backend {
                device: dev_device(parts),
                msg: format!("{kernel}: {blocks} blocks do not fit one launch"),
            })?;
            dev.launch(module, kernel, grid, BLOCK, &*args)?;
        }
        args.parts = 0;
        args.input = [[0; FOREACH_PARTS]; 4];
        args.out = [[0; FOREACH_PARTS]; 3];
        *blocks = 0;
        Ok(())
    };
    // Every part is checked before the first launch: a part refused here
    // writes nothing (an address or grid failure later may, after an
    // earlier launch; the caller poisons the call's outputs then).
    for part in parts {
        let n = n_of(part);
        if n == 0 {
            continue;
        }
        if part.inputs.len() > 4 || part.outs.len() > 3 || part.outs.is_empty() {
            return Err(Error::Backend {
                device: dev_device(parts),
                msg: format!(
                    "{kernel}: a part with {} inputs and {} outputs (at most 4 and 3); a kiln defect",
                    part.inputs.len(),
                    part.outs.len()
                ),
            });
        }
        let present: Vec<_> = part.inputs.iter().flatten().cloned().collect();
        for (k, &(out, offset)) in part.outs.iter().enumerate() {
            let inputs: &[_] = if k == 0 { &present } else { &[] };
            check_extents(kernel, inputs, &vec![n; inputs.len()], out, offset.saturating_add(n))?;
        }
        let dtype = part.outs[0].0.dtype;
        if present.iter().any(|s| s.storage.dtype != dtype) || part.outs.iter().any(|(o, _)| o.dtype != dtype) {
            return Err(Error::Backend {
                device: dev_device(parts),
                msg: format!("{kernel}: operands of different dtypes in one part; a kiln defect"),
            });
        }
    }
    for part in parts {
        let n = n_of(part);
        if n == 0 {
            continue;
        }
        if args.parts as usize == FOREACH_PARTS {
            flush(&mut args, &mut blocks)?;
        }
        let j = args.parts as usize;
        for (k, input) in part.inputs.iter().enumerate() {
            args.input[k][j] = match input {
                Some(src) => dptr(dev, src)?,
                None => 0,
            };
        }
        for (k, &(out, offset)) in part.outs.iter().enumerate() {
            args.out[k][j] = dev.ptr(out)? + (offset * out.dtype.size_in_bytes()) as u64;
        }
        args.n[j] = n as u64;
        args.first_block[j] = blocks;
        blocks += n.div_ceil(FOREACH_CHUNK) as u64;
        args.first_block[j + 1] = blocks;
        args.parts += 1;
    }
    flush(&mut args, &mut blocks)
}

/// The device of the first output of `parts`, for an error.
fn dev_device(parts: &[&MultiPart<'_>]) -> crate::Device {
    parts.iter().find_map(|p| p.outs.first()).map_or(crate::Device::Cpu, |(s, _)| s.device)
}
