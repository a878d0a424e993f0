//! Running a program on one device and judging what it did: outcomes,
//! sensible errors, the expected argument errors.

use super::*;

/// What one step gave, comparable across devices.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// dims, dtype, and the values' bits (as f64) when small enough to read.
    Value(Vec<usize>, DType, Option<Vec<u64>>),
    /// The error's kind.
    Error(&'static str),
    /// An operand was missing (its step failed).
    Skipped,
    /// A step whose result is not a tensor.
    Done,
}

pub(crate) fn kind(e: &Error) -> &'static str {
    match e {
        Error::DeviceMismatch { .. } => "DeviceMismatch",
        Error::NoSuchDevice { .. } => "NoSuchDevice",
        Error::ShapeMismatch { .. } => "ShapeMismatch",
        Error::DTypeMismatch { .. } => "DTypeMismatch",
        Error::UnsupportedDType { .. } => "UnsupportedDType",
        Error::OutOfMemory { .. } => "OutOfMemory",
        Error::InvalidArgument { .. } => "InvalidArgument",
        Error::KernelFailed { .. } => "KernelFailed",
        Error::Backend { .. } => "Backend",
        _ => "other",
    }
}

/// Errors a well-behaved library may return for a random program. Anything
/// else (a failed kernel, a backend failure) is a defect.
pub(crate) fn sensible(e: &Error) -> bool {
    matches!(
        kind(e),
        "NoSuchDevice" | "ShapeMismatch" | "DTypeMismatch" | "UnsupportedDType" | "OutOfMemory" | "InvalidArgument" | "DeviceMismatch"
    )
}

/// Indices made valid for dimension `dim` of `a`: the CPU raises for a bad
/// index at the call while a GPU reports it at the next synchronising call,
/// so out-of-range indices are drawn by their own step (`BadIndex`).
pub(crate) fn in_range(ids: &[i64], a: &Tensor, dim: i64) -> Vec<i64> {
    match dim_size(a, dim) {
        Some(&0) => Vec::new(),
        Some(&size) => ids.iter().map(|&i| i.rem_euclid(size.min(i64::MAX as usize) as i64)).collect(),
        None => ids.to_vec(),
    }
}

/// The size of dimension `dim` of `a` as index ops see it (a 0-d tensor
/// has one element along 0 and −1, as in PyTorch), None when out of range.
pub(crate) fn dim_size(a: &Tensor, dim: i64) -> Option<&usize> {
    let dims: &[usize] = if a.rank() == 0 { &[1] } else { a.dims() };
    let rank = dims.len() as i64;
    let dim = if dim < 0 { dim + rank } else { dim };
    usize::try_from(dim).ok().and_then(|d| dims.get(d))
}

/// An index tensor of `dtype`, or of i64 when a value does not fit `dtype`
/// (a wrapped index would be out of range: the CPU refuses it, a GPU skips
/// it, and the devices would legitimately disagree).
pub(crate) fn idx_tensor(ids: &[i64], dtype: DType, device: &Device) -> kiln::Result<Tensor> {
    let max = match dtype {
        DType::U8 => u8::MAX as i64,
        DType::I32 => i32::MAX as i64,
        _ => i64::MAX,
    };
    let t = Tensor::from_vec(ids.to_vec(), ids.len(), device)?;
    if ids.iter().all(|&i| (0..=max).contains(&i)) {
        t.to_dtype(dtype)
    } else {
        Ok(t)
    }
}

/// An index for gather/scatter on `a` along `dim`: `a`'s rank (0-d as
/// 1-d), at most 2 along the other dimensions, `k` along `dim` (none when
/// that dimension is empty), values from `ids` made valid (an out-of-range
/// index is an error on the CPU and skipped on a GPU, see `in_range`). A
/// dimension out of range gives some index: the op refuses it.
pub(crate) fn gather_index(a: &Tensor, dim: i64, k: usize, ids: &[i64], dtype: DType, device: &Device) -> kiln::Result<Tensor> {
    let dims = if a.rank() == 0 { vec![1] } else { a.dims().to_vec() };
    let d = dim.rem_euclid(dims.len() as i64) as usize;
    let size = dims[d].min(i64::MAX as usize) as i64;
    let mut idims: Vec<usize> = dims.iter().map(|&s| s.min(2)).collect();
    idims[d] = if size == 0 { 0 } else { k };
    let n = count(&idims);
    let vals: Vec<i64> = (0..n).map(|j| ids.get(j % ids.len().max(1)).copied().unwrap_or(0).rem_euclid(size.max(1))).collect();
    idx_tensor(&vals, dtype, device)?.reshape(idims)
}

/// A selector of `Tensor::i` from a program's (kind, start, end).
pub(crate) fn selector(kind: u8, s: i64, e: i64) -> kiln::Selector {
    use std::ops::Bound::{Excluded, Included, Unbounded};
    match kind {
        0 => kiln::Selector::All,
        1 => kiln::Selector::Index(s),
        2 => kiln::Selector::Range(Included(s), Excluded(e)),
        3 => kiln::Selector::Range(Included(s), Unbounded),
        4 => kiln::Selector::Range(Unbounded, Excluded(e)),
        _ => kiln::Selector::Range(Included(s), Included(e)),
    }
}

/// A device that does not exist.
pub(crate) fn missing(which: u8) -> Device {
    match which {
        0 => gpu(kiln::MAX_SIM_GPUS + 99),
        1 => gpu(usize::MAX),
        _ => gpu(kiln::num_gpus()),
    }
}

/// Every way a program can name a device without a tensor on it, on `d`.
pub(crate) fn on_device(d: Device, dims: &[usize], dtype: DType, how: u8) -> kiln::Result<Option<Tensor>> {
    let n = count(dims).min(64);
    Ok(Some(match how {
        0 => Tensor::zeros(dims, dtype, &d)?,
        1 => Tensor::ones(dims, dtype, &d)?,
        2 => Tensor::full(2.5, dims, dtype, &d)?,
        3 => Tensor::rand_uniform(-1.0, 1.0, dims, dtype, &d)?,
        4 => Tensor::randn_with(0.0, 1.0, dims, dtype, &d)?,
        5 => Tensor::arange_dtype(0.0, n as f64, 1.0, dtype, &d)?,
        6 => Tensor::from_vec(vec![1i32; n], n, &d)?,
        7 => Tensor::eye(n, dtype, &d)?,
        8 => Tensor::linspace(0.0, 1.0, n, &d)?,
        9 => {
            kiln::synchronize(&d)?;
            return Ok(None);
        }
        10 => {
            kiln::memory_stats(&d)?;
            return Ok(None);
        }
        11 => {
            kiln::reset_peak_memory(&d)?;
            return Ok(None);
        }
        12 => {
            kiln::empty_cache(&d)?;
            return Ok(None);
        }
        _ => {
            let _scope = kiln::default_device_scope(d)?;
            Tensor::new_default(&[1i32, 2, 3])?
        }
    }))
}

pub(crate) fn run_step(step: &Step, vals: &[Option<Tensor>], device: &Device, sim: Device) -> Option<kiln::Result<Option<Tensor>>> {
    if operands(step).iter().any(|&i| vals.get(i).is_none_or(|v| v.is_none())) {
        return None;
    }
    // Checked just above: every operand exists.
    macro_rules! arg {
        ($i:expr) => {
            vals[$i].clone().expect("operand checked")
        };
    }
    let r: kiln::Result<Option<Tensor>> = (|| {
        Ok(Some(match step {
            Step::Create { dims, dtype, how, value } => match how {
                0 => Tensor::zeros(dims.as_slice(), *dtype, device)?,
                1 => Tensor::ones(dims.as_slice(), *dtype, device)?,
                2 => Tensor::full(*value, dims.as_slice(), *dtype, device)?,
                3 => Tensor::rand_uniform(-2.0, 2.0, dims.as_slice(), *dtype, device)?,
                4 => Tensor::randn_with(0.0, 3.0, dims.as_slice(), *dtype, device)?,
                _ => {
                    let n = count(dims).min(64);
                    Tensor::arange_dtype(0.0, n as f64, 1.0, *dtype, device)?.reshape(dims.as_slice())?
                }
            },
            Step::FromValues { dims, dtype, values } => Tensor::from_vec(values.clone(), dims.as_slice(), device)?.to_dtype(*dtype)?,
            Step::NoSuchDevice { dims, dtype, which, how } => return on_device(missing(*which), dims, *dtype, *how),
            Step::ToMissing { a, which, copy } => {
                let a = arg!(*a);
                if *copy {
                    a.copy_to(&missing(*which))?
                } else {
                    a.to(&missing(*which))?
                }
            }
            Step::Unary { a, op } => arg!(*a).unary(*op)?,
            Step::Binary { a, b, op } => {
                let (a, b) = (arg!(*a), arg!(*b));
                count_mixed(device, &[&a, &b]);
                a.binary(&b, *op)?
            }
            Step::Reduce { a, op, dim, keepdim } => arg!(*a).reduce(*op, &[*dim], *keepdim)?,
            Step::ReduceAll { a, which } => {
                let a = arg!(*a);
                match which {
                    0 => a.sum_all()?,
                    1 => a.max_all()?,
                    2 => a.mean_all()?,
                    3 => a.norm()?,
                    _ => a.min_all()?,
                }
            }
            Step::Matmul { a, b } => arg!(*a).matmul(&arg!(*b))?,
            Step::CumSum { a, dim } => arg!(*a).cumsum(*dim)?,
            Step::Composite { a, which, dim } => {
                let a = arg!(*a);
                match which {
                    0 => a.gelu()?,
                    1 => a.gelu_tanh()?,
                    2 => a.silu()?,
                    3 => a.logsumexp(&[*dim], rng_keep(*dim))?,
                    4 => a.var_dims(&[*dim], 1.0, false)?,
                    _ => a.std_dims(&[*dim], 0.0, true)?,
                }
            }
            Step::Transpose { a, d0, d1 } => arg!(*a).transpose(*d0, *d1)?,
            Step::Narrow { a, dim, start, len } => arg!(*a).narrow(*dim, *start, *len)?,
            Step::Reshape { a, dims } => arg!(*a).reshape(dims.as_slice())?,
            Step::Broadcast { a, dims } => arg!(*a).broadcast_to(dims.as_slice())?,
            Step::Unsqueeze { a, dim } => arg!(*a).unsqueeze(*dim)?,
            Step::Squeeze { a, dim } => arg!(*a).squeeze(*dim)?,
            Step::FlattenFrom { a, from } => arg!(*a).flatten_from(*from)?,
            Step::Permute { a, perm } => arg!(*a).permute(perm)?,
            Step::Cat { a, b, dim } => {
                let (a, b) = (arg!(*a), arg!(*b));
                count_mixed(device, &[&a, &b]);
                Tensor::cat(&[&a, &b], *dim)?
            }
            Step::Stack { a, b, dim } => {
                let (a, b) = (arg!(*a), arg!(*b));
                count_mixed(device, &[&a, &b]);
                Tensor::stack(&[&a, &b], *dim)?
            }
            Step::IndexSelect { a, ids, ids_dtype, dim } => {
                let a = arg!(*a);
                a.index_select(&idx_tensor(&in_range(ids, &a, *dim), *ids_dtype, device)?, *dim)?
            }
            Step::IndexAdd { a, src, ids, ids_dtype, dim } => {
                let a = arg!(*a);
                a.index_add(&idx_tensor(&in_range(ids, &a, *dim), *ids_dtype, device)?, &arg!(*src), *dim)?
            }
            Step::Gather { a, src, dim, ids, ids_dtype, mode, k } => {
                let a = arg!(*a);
                let index = gather_index(&a, *dim, *k, ids, *ids_dtype, device)?;
                match mode {
                    0 => a.gather(*dim, &index)?,
                    1 => a.scatter(*dim, &index, &arg!(*src))?,
                    _ => a.scatter_add(*dim, &index, &arg!(*src))?,
                }
            }
            Step::Sort { a, dim, descending, which, k } => {
                let a = arg!(*a);
                match which {
                    0 => a.sort(*dim, *descending)?.0,
                    1 => a.argsort(*dim, *descending)?,
                    2 => a.topk(*k, *dim, *descending, true)?.0,
                    _ => a.topk(*k, *dim, *descending, false)?.1,
                }
            }
            Step::Slice { a, sels } => arg!(*a).i(sels.iter().map(|&(kind, s, e)| selector(kind, s, e)).collect::<Vec<_>>())?,
            Step::Where { c, a, b } => {
                let (a, b) = (arg!(*a), arg!(*b));
                count_mixed(device, &[&a, &b]);
                arg!(*c).where_cond(&a, &b)?
            }
            Step::BadIndex { a, which, value, dim } => return bad_index(&arg!(*a), *which, *value, *dim, device),
            Step::Cast { a, dtype } => arg!(*a).to_dtype(*dtype)?,
            Step::Contiguous { a } => arg!(*a).contiguous()?,
            Step::Assign { dst, src } => {
                count_mixed(device, &[&arg!(*dst), &arg!(*src)]);
                arg!(*dst).assign(&arg!(*src))?;
                return Ok(None);
            }
            Step::RoundTrip { a } => {
                let a = arg!(*a);
                let other = if a.device() == cpu() { sim } else { cpu() };
                a.copy_to(&other)?.to(device)?
            }
            Step::Print { a } => {
                let a = arg!(*a);
                let text = format!("{a}");
                assert!(text.starts_with("tensor("), "printing gave {text:?}");
                return Ok(None);
            }
            Step::ToVec2 { a } => {
                let a = arg!(*a);
                let rows = match a.dtype() {
                    DType::F32 => a.to_vec2::<f32>()?.len(),
                    DType::I64 => a.to_vec2::<i64>()?.len(),
                    DType::I32 => a.to_vec2::<i32>()?.len(),
                    _ => a.to_dtype(DType::F64)?.to_vec2::<f64>()?.len(),
                };
                assert_eq!(rows, a.dims()[0]);
                return Ok(None);
            }
        }))
    })();
    Some(r)
}

/// Steps whose two tensor operands had different dtypes (counted on the CPU).
pub(crate) static MIXED: AtomicU64 = AtomicU64::new(0);

fn count_mixed(device: &Device, ts: &[&Tensor]) {
    if device.is_cpu() && ts.windows(2).any(|w| w[0].dtype() != w[1].dtype()) {
        MIXED.fetch_add(1, Ordering::Relaxed);
    }
}

/// Bad-index steps whose value reached a kernel on the GPU and was
/// reported by the next synchronising call.
pub(crate) static REPORTED: AtomicU64 = AtomicU64::new(0);

/// A step with an index or label `value` out of range: on the CPU the call
/// raises; on a GPU the call returns and the next synchronising call
/// reports it, naming the op and the value (a `KernelFailed` that this
/// turns into the CPU's `InvalidArgument` for the comparison). A GPU call
/// whose kernel reads nothing (an empty output) reports nothing, and counts
/// as the same outcome.
fn bad_index(a: &Tensor, which: u8, value: i64, dim: i64, device: &Device) -> kiln::Result<Option<Tensor>> {
    let op = ["index_select", "index_add", "one_hot", "cross_entropy"][which as usize % 4];
    let ids = Tensor::from_vec(vec![value], 1, device)?;
    let bound = match which % 4 {
        0 | 1 => dim_size(a, dim).copied().unwrap_or(0),
        2 => 3,
        _ => a.elem_count(),
    };
    let result = match which % 4 {
        0 => a.index_select(&ids, dim),
        1 => a.index_add(&ids, &a.narrow(dim, 0, 1.min(bound))?, dim),
        2 => kiln::nn::one_hot(&ids, 3, a.dtype()),
        _ => kiln::nn::cross_entropy(&a.reshape((1, a.elem_count()))?, &ids),
    };
    if device.is_cpu() || usize::try_from(value).is_ok_and(|v| v < bound) {
        // The CPU raises at the call; an index in range is an ordinary call.
        return result.map(Some);
    }
    // On the GPU: reported by the next synchronising call (or, when a later
    // kernel of the same call was launched after the bad one had run, by
    // that launch already: launches fail fast on a poisoned queue).
    let t = match result {
        Ok(t) => Some(t),
        Err(Error::KernelFailed { .. }) => None,
        Err(e) => return Err(e),
    };
    match kiln::synchronize(device) {
        Err(Error::KernelFailed { op: got, msg, .. }) => {
            assert_eq!(got, op, "{msg}");
            assert!(msg.contains(&format!(" {value} is out of range")), "{msg}");
            REPORTED.fetch_add(1, Ordering::Relaxed);
            Err(Error::InvalidArgument { op: got, msg })
        }
        Err(e) => Err(e),
        // A kernel with nothing to write reads no index.
        Ok(()) if t.as_ref().is_some_and(|t| t.elem_count() == 0) || a.elem_count() == 0 => {
            Err(Error::InvalidArgument { op: op.into(), msg: "nothing read".into() })
        }
        Ok(()) => panic!("{op} of the bad index {value} on {device} was not reported"),
    }
}

/// keepdim for a composite's reduction, from its dimension (so that the
/// program stays a pure function of its steps).
pub(crate) fn rng_keep(dim: i64) -> bool {
    dim % 2 == 0
}

/// The error a step that names a device that does not exist may give
/// instead of `NoSuchDevice`: the one the same call gives on `device`, where
/// it has a bad argument besides (creation checks a shape's size or a
/// dtype before the device: `rand` of an integer dtype, a shape whose
/// element count does not fit). Anything else must be `NoSuchDevice`.
pub(crate) fn argument_error(step: &Step, device: Device) -> Option<&'static str> {
    match step {
        Step::NoSuchDevice { dims, dtype, how, .. } => match on_device(device, dims, *dtype, *how) {
            Err(e) if !matches!(e, Error::OutOfMemory { .. }) => Some(kind(&e)),
            _ => None,
        },
        _ => None,
    }
}

/// Whether a step uses a device that does not exist (and must fail with
/// `NoSuchDevice`, or the error of a bad argument besides).
pub(crate) fn names_missing(step: &Step) -> bool {
    matches!(step, Step::NoSuchDevice { .. } | Step::ToMissing { .. })
}

/// Reads a result for comparison; large results are compared by shape only.
pub(crate) fn observe(t: &Tensor) -> kiln::Result<Outcome> {
    let values = if t.elem_count() <= 4096 {
        Some(t.to_vec_f64()?.iter().map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() }).collect())
    } else {
        t.block_until_ready()?;
        None
    };
    Ok(Outcome::Value(t.dims().to_vec(), t.dtype(), values))
}

/// Runs a program on `device`; Err describes a defect.
pub(crate) fn execute(steps: &[Step], device: &Device, sim: Device, heartbeat: &AtomicU64) -> Result<Vec<Outcome>, String> {
    let mut vals: Vec<Option<Tensor>> = Vec::new();
    let mut outcomes = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let outcome = match run_step(step, &vals, device, sim) {
            Some(Ok(_)) if names_missing(step) => return Err(format!("step {i} {step:?}: a device that does not exist was accepted")),
            Some(Err(e))
                if names_missing(step) && !matches!(e, Error::NoSuchDevice { .. }) && Some(kind(&e)) != argument_error(step, *device) =>
            {
                return Err(format!("step {i} {step:?}: a device that does not exist gave {e}, not NoSuchDevice"));
            }
            None => {
                vals.push(None);
                Outcome::Skipped
            }
            Some(Ok(None)) => {
                // Assign changed its destination in place: observe that.
                if let Step::Assign { dst, .. } = step {
                    let t = vals[*dst].clone().expect("assign ran, so its destination exists");
                    vals.push(None);
                    observe(&t).map_err(|e| format!("step {i}: reading after assign: {e}"))?
                } else {
                    vals.push(None);
                    Outcome::Done
                }
            }
            Some(Ok(Some(t))) => {
                let o = match observe(&t) {
                    Ok(o) => o,
                    Err(e) if sensible(&e) => Outcome::Error(kind(&e)),
                    Err(e) => return Err(format!("step {i} {step:?}: reading the result failed: {e}")),
                };
                vals.push(Some(t));
                o
            }
            Some(Err(e)) => {
                if !sensible(&e) {
                    return Err(format!("step {i} {step:?}: an error of the wrong kind: {e}"));
                }
                vals.push(None);
                Outcome::Error(kind(&e))
            }
        };
        outcomes.push(outcome);
        heartbeat.fetch_add(1, Ordering::Relaxed);
    }
    drop(vals);
    kiln::synchronize(device).map_err(|e| format!("synchronize after the program: {e}"))?;
    Ok(outcomes)
}
