//! A seeded random-program fuzzer: thousands of small programs over random
//! shapes (zero-size and absurdly large dimensions among them), every dtype
//! (i32 included, for data and for indices), the CPU, a simulated GPU and
//! devices that do not exist (creating on them, moving and copying to them,
//! synchronising and querying them). Each program
//! runs on the CPU and on the simulated GPU, and the test checks:
//! - no panic crosses the API (each program runs under `catch_unwind`);
//! - no hang (a watchdog ends the process, naming the program, when no step
//!   finishes for 60 s);
//! - every error is of a sensible kind (a user error or out-of-memory, never a
//!   failed kernel or a backend failure), and every use of a device that does
//!   not exist is `NoSuchDevice`;
//! - the CPU and the simulated GPU agree: the same errors, the same shapes,
//!   and bit-identical values;
//! - memory on both devices returns to its baseline once the program's
//!   tensors are dropped.
//!
//! `KILN_FUZZ_CASES` sets the number of programs (default 2,000; the
//! robustness issue's run used 100,000), `KILN_FUZZ_SEED` the first seed.

use kiln::{cpu, gpu, BinaryOp, DType, Device, Error, ReduceOp, Tensor, UnaryOp};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// SplitMix64: small, seedable, good enough to pick program steps.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

const DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16];
/// The dtypes an index tensor may have.
const INDEX_DTYPES: [DType; 3] = [DType::I64, DType::I32, DType::U8];
const HUGE: [usize; 5] = [1 << 33, 1 << 40, 1 << 62, 1 << 63, usize::MAX];

fn dim(rng: &mut Rng) -> usize {
    if rng.chance(6) {
        rng.pick(&HUGE)
    } else {
        rng.pick(&[0, 1, 1, 2, 2, 3, 3, 4, 5, 7])
    }
}

/// Elements of a shape, saturating (the fuzzer's own arithmetic must not
/// overflow on the huge dimensions it makes).
fn count(dims: &[usize]) -> usize {
    if dims.contains(&0) {
        0
    } else {
        dims.iter().fold(1usize, |a, &d| a.saturating_mul(d))
    }
}

fn shape(rng: &mut Rng) -> Vec<usize> {
    let rank = rng.pick(&[0, 1, 1, 2, 2, 2, 3, 3, 4]);
    let mut dims: Vec<usize> = (0..rank).map(|_| dim(rng)).collect();
    // A huge dimension mostly comes with a zero one: a valid empty tensor
    // whose strides would overflow. Otherwise the shape is made certainly too
    // large for any host (a 16 GiB tensor would be allocated lazily and then
    // really touched by later steps).
    if let Some(i) = dims.iter().position(|&d| d > 1 << 20) {
        if rng.chance(80) {
            let z = rng.below(dims.len());
            dims[z] = 0;
        } else if count(&dims) < 1 << 42 {
            dims[i] = 1 << 62;
        }
    }
    dims
}

/// One step of a program; operands name earlier values by index.
#[derive(Clone, Debug)]
enum Step {
    Create {
        dims: Vec<usize>,
        dtype: DType,
        how: u8,
        value: f64,
    },
    FromValues {
        dims: Vec<usize>,
        dtype: DType,
        values: Vec<f64>,
    },
    /// A use of a device that does not exist, `which` of three: an index
    /// far beyond the limit, `usize::MAX`, and the next unused index.
    NoSuchDevice {
        dims: Vec<usize>,
        dtype: DType,
        which: u8,
        how: u8,
    },
    /// `to`/`copy_to` of an operand onto a device that does not exist.
    ToMissing {
        a: usize,
        which: u8,
        copy: bool,
    },
    Unary {
        a: usize,
        op: UnaryOp,
    },
    Binary {
        a: usize,
        b: usize,
        op: BinaryOp,
    },
    Reduce {
        a: usize,
        op: ReduceOp,
        dim: usize,
        keepdim: bool,
    },
    ReduceAll {
        a: usize,
        which: u8,
    },
    Matmul {
        a: usize,
        b: usize,
    },
    /// `cumsum` along a dimension (signed, possibly out of range).
    CumSum {
        a: usize,
        dim: i64,
    },
    /// A composite, `which` of gelu, gelu_tanh, silu, logsumexp, var, std
    /// (the last three along `dim`).
    Composite {
        a: usize,
        which: u8,
        dim: i64,
    },
    Transpose {
        a: usize,
        d0: usize,
        d1: usize,
    },
    Narrow {
        a: usize,
        dim: usize,
        start: usize,
        len: usize,
    },
    Reshape {
        a: usize,
        dims: Vec<usize>,
    },
    Broadcast {
        a: usize,
        dims: Vec<usize>,
    },
    Unsqueeze {
        a: usize,
        dim: usize,
    },
    Squeeze {
        a: usize,
        dim: usize,
    },
    FlattenFrom {
        a: usize,
        from: usize,
    },
    Permute {
        a: usize,
        perm: Vec<usize>,
    },
    Cat {
        a: usize,
        b: usize,
        dim: usize,
    },
    Stack {
        a: usize,
        b: usize,
        dim: usize,
    },
    IndexSelect {
        a: usize,
        ids: Vec<i64>,
        ids_dtype: DType,
        dim: usize,
    },
    IndexAdd {
        a: usize,
        src: usize,
        ids: Vec<i64>,
        ids_dtype: DType,
        dim: usize,
    },
    Where {
        c: usize,
        a: usize,
        b: usize,
    },
    Cast {
        a: usize,
        dtype: DType,
    },
    Contiguous {
        a: usize,
    },
    Assign {
        dst: usize,
        src: usize,
    },
    RoundTrip {
        a: usize,
    },
    Print {
        a: usize,
    },
    ToVec2 {
        a: usize,
    },
}

const UNARY: [UnaryOp; 23] = [
    UnaryOp::Erf,
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sqrt,
    UnaryOp::Sqr,
    UnaryOp::Recip,
    UnaryOp::Sin,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Relu,
    UnaryOp::Powi(3),
    UnaryOp::Powi(-2),
    UnaryOp::Powf(0.5),
    UnaryOp::AddScalar(-1.0),
    UnaryOp::SubScalar(2.5),
    UnaryOp::MulScalar(3.0),
    UnaryOp::DivScalar(0.0),
    UnaryOp::RDivScalar(1.0),
    UnaryOp::MaxScalar(0.5),
    UnaryOp::MinScalar(f64::NAN),
    UnaryOp::Affine(2.0, -1.0),
];
const BINARY: [BinaryOp; 13] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::Maximum,
    BinaryOp::Minimum,
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
];
const REDUCE: [ReduceOp; 6] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod, ReduceOp::ArgMax, ReduceOp::ArgMin];

fn value(rng: &mut Rng) -> f64 {
    rng.pick(&[0.0, 1.0, -1.0, 2.5, -3.0, 0.1, 300.0, -7.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e30, 65504.0])
}

fn program(rng: &mut Rng) -> Vec<Step> {
    let len = 2 + rng.below(8);
    let mut steps = Vec::new();
    for i in 0..len {
        // Operands are earlier values; the first steps create some.
        let any = |rng: &mut Rng| rng.below(i.max(1));
        let step = if i < 2 || rng.chance(15) {
            if rng.chance(40) {
                let dims = shape(rng);
                let n: usize = count(&dims).min(64);

                let values = (0..n).map(|_| value(rng)).collect();
                Step::FromValues { dims, dtype: rng.pick(&DTYPES), values }
            } else if rng.chance(4) {
                Step::NoSuchDevice { dims: shape(rng), dtype: rng.pick(&DTYPES), which: rng.below(3) as u8, how: rng.below(14) as u8 }
            } else {
                Step::Create { dims: shape(rng), dtype: rng.pick(&DTYPES), how: rng.below(6) as u8, value: value(rng) }
            }
        } else {
            let a = any(rng);
            match rng.below(29) {
                0 | 1 => Step::Unary { a, op: rng.pick(&UNARY) },
                2..=4 => Step::Binary { a, b: any(rng), op: rng.pick(&BINARY) },
                5 => Step::Reduce { a, op: rng.pick(&REDUCE), dim: rng.below(5), keepdim: rng.chance(50) },
                6 => Step::ReduceAll { a, which: rng.below(5) as u8 },
                7 => Step::Matmul { a, b: any(rng) },
                8 => Step::Transpose { a, d0: rng.below(4), d1: rng.below(4) },
                9 => {
                    let start = if rng.chance(10) { rng.pick(&HUGE) } else { rng.below(5) };
                    Step::Narrow { a, dim: rng.below(4), start, len: rng.below(4) }
                }
                10 => Step::Reshape { a, dims: shape(rng) },
                11 => {
                    // A broadcast view of 2^62 elements is valid, but any
                    // reduction over it would run for years (as in PyTorch):
                    // views stay small unless empty.
                    let mut dims = shape(rng);
                    if count(&dims) > 1 << 20 {
                        let z = rng.below(dims.len());
                        dims[z] = 0;
                    }
                    Step::Broadcast { a, dims }
                }
                12 => Step::Unsqueeze { a, dim: rng.below(5) },
                13 => Step::Squeeze { a, dim: rng.below(4) },
                14 => Step::FlattenFrom { a, from: rng.below(4) },
                15 => {
                    let mut perm: Vec<usize> = (0..rng.below(5)).collect();
                    for k in (1..perm.len()).rev() {
                        let j = rng.below(k + 1);
                        perm.swap(k, j);
                    }
                    Step::Permute { a, perm }
                }
                16 => Step::Cat { a, b: any(rng), dim: rng.below(4) },
                17 => Step::Stack { a, b: any(rng), dim: rng.below(4) },
                18 => Step::IndexSelect {
                    a,
                    ids: (0..rng.below(5)).map(|_| rng.below(6) as i64 - 1).collect(),
                    ids_dtype: rng.pick(&INDEX_DTYPES),
                    dim: rng.below(4),
                },
                19 => Step::IndexAdd {
                    a,
                    src: any(rng),
                    ids: (0..rng.below(4)).map(|_| rng.below(5) as i64).collect(),
                    ids_dtype: rng.pick(&INDEX_DTYPES),
                    dim: rng.below(3),
                },
                20 => Step::Where { c: any(rng), a, b: any(rng) },
                21 => Step::Cast { a, dtype: rng.pick(&DTYPES) },
                22 => Step::Contiguous { a },
                23 => Step::Assign { dst: a, src: any(rng) },
                24 => Step::RoundTrip { a },
                25 => Step::ToMissing { a, which: rng.below(3) as u8, copy: rng.chance(50) },
                26 => Step::CumSum { a, dim: rng.below(7) as i64 - 3 },
                27 => Step::Composite { a, which: rng.below(6) as u8, dim: rng.below(7) as i64 - 3 },
                _ => {
                    if rng.chance(50) {
                        Step::Print { a }
                    } else {
                        Step::ToVec2 { a }
                    }
                }
            }
        };
        steps.push(step);
    }
    steps
}

/// The earlier values a step reads.
fn operands(step: &Step) -> Vec<usize> {
    match step {
        Step::Create { .. } | Step::FromValues { .. } | Step::NoSuchDevice { .. } => vec![],
        Step::Binary { a, b, .. } | Step::Matmul { a, b } | Step::Cat { a, b, .. } | Step::Stack { a, b, .. } => vec![*a, *b],
        Step::IndexAdd { a, src, .. } => vec![*a, *src],
        Step::Where { c, a, b } => vec![*c, *a, *b],
        Step::Assign { dst, src } => vec![*dst, *src],
        Step::Unary { a, .. }
        | Step::Reduce { a, .. }
        | Step::ReduceAll { a, .. }
        | Step::CumSum { a, .. }
        | Step::Composite { a, .. }
        | Step::Transpose { a, .. }
        | Step::Narrow { a, .. }
        | Step::Reshape { a, .. }
        | Step::Broadcast { a, .. }
        | Step::Unsqueeze { a, .. }
        | Step::Squeeze { a, .. }
        | Step::FlattenFrom { a, .. }
        | Step::Permute { a, .. }
        | Step::IndexSelect { a, .. }
        | Step::Cast { a, .. }
        | Step::Contiguous { a }
        | Step::RoundTrip { a }
        | Step::Print { a }
        | Step::ToVec2 { a }
        | Step::ToMissing { a, .. } => vec![*a],
    }
}

/// What one step gave, comparable across devices.
#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    /// dims, dtype, and the values' bits (as f64) when small enough to read.
    Value(Vec<usize>, DType, Option<Vec<u64>>),
    /// The error's kind.
    Error(&'static str),
    /// An operand was missing (its step failed).
    Skipped,
    /// A step whose result is not a tensor.
    Done,
}

fn kind(e: &Error) -> &'static str {
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
fn sensible(e: &Error) -> bool {
    matches!(
        kind(e),
        "NoSuchDevice" | "ShapeMismatch" | "DTypeMismatch" | "UnsupportedDType" | "OutOfMemory" | "InvalidArgument" | "DeviceMismatch"
    )
}

/// Indices made valid for dimension `dim` of `a`: the CPU checks index
/// values while a GPU does not read them back (that would be a hidden
/// transfer), so out-of-range indices are compared elsewhere.
fn in_range(ids: &[i64], a: &Tensor, dim: usize) -> Vec<i64> {
    match a.dims().get(dim) {
        Some(&0) => Vec::new(),
        Some(&size) => ids.iter().map(|&i| i.rem_euclid(size.min(i64::MAX as usize) as i64)).collect(),
        None => ids.to_vec(),
    }
}

/// An index tensor of `dtype`, or of i64 when a value does not fit `dtype`
/// (a wrapped index would be out of range: the CPU refuses it, a GPU skips
/// it, and the devices would legitimately disagree).
fn idx_tensor(ids: &[i64], dtype: DType, device: &Device) -> kiln::Result<Tensor> {
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

/// A device that does not exist.
fn missing(which: u8) -> Device {
    match which {
        0 => gpu(kiln::MAX_SIM_GPUS + 99),
        1 => gpu(usize::MAX),
        _ => gpu(kiln::num_gpus()),
    }
}

/// Every way a program can name a device without a tensor on it, on `d`.
fn on_device(d: Device, dims: &[usize], dtype: DType, how: u8) -> kiln::Result<Option<Tensor>> {
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

fn run_step(step: &Step, vals: &[Option<Tensor>], device: &Device, sim: Device) -> Option<kiln::Result<Option<Tensor>>> {
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
            Step::Binary { a, b, op } => arg!(*a).binary(&arg!(*b), *op)?,
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
            Step::Cat { a, b, dim } => Tensor::cat(&[&arg!(*a), &arg!(*b)], *dim)?,
            Step::Stack { a, b, dim } => Tensor::stack(&[&arg!(*a), &arg!(*b)], *dim)?,
            Step::IndexSelect { a, ids, ids_dtype, dim } => {
                let a = arg!(*a);
                a.index_select(&idx_tensor(&in_range(ids, &a, *dim), *ids_dtype, device)?, *dim)?
            }
            Step::IndexAdd { a, src, ids, ids_dtype, dim } => {
                let a = arg!(*a);
                a.index_add(&idx_tensor(&in_range(ids, &a, *dim), *ids_dtype, device)?, &arg!(*src), *dim)?
            }
            Step::Where { c, a, b } => arg!(*c).where_cond(&arg!(*a), &arg!(*b))?,
            Step::Cast { a, dtype } => arg!(*a).to_dtype(*dtype)?,
            Step::Contiguous { a } => arg!(*a).contiguous()?,
            Step::Assign { dst, src } => {
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

/// keepdim for a composite's reduction, from its dimension (so that the
/// program stays a pure function of its steps).
fn rng_keep(dim: i64) -> bool {
    dim % 2 == 0
}

/// The error a step that names a device that does not exist may give
/// instead of `NoSuchDevice`: the one the same call gives on `device`, where
/// it has a bad argument besides (creation checks a shape's size or a
/// dtype before the device: `rand` of an integer dtype, a shape whose
/// element count does not fit). Anything else must be `NoSuchDevice`.
fn argument_error(step: &Step, device: Device) -> Option<&'static str> {
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
fn names_missing(step: &Step) -> bool {
    matches!(step, Step::NoSuchDevice { .. } | Step::ToMissing { .. })
}

/// Reads a result for comparison; large results are compared by shape only.
fn observe(t: &Tensor) -> kiln::Result<Outcome> {
    let values = if t.elem_count() <= 4096 {
        Some(t.to_vec_f64()?.iter().map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() }).collect())
    } else {
        t.block_until_ready()?;
        None
    };
    Ok(Outcome::Value(t.dims().to_vec(), t.dtype(), values))
}

/// Runs a program on `device`; Err describes a defect.
fn execute(steps: &[Step], device: &Device, sim: Device, heartbeat: &AtomicU64) -> Result<Vec<Outcome>, String> {
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

/// Puts the process under memory pressure: with its address space capped,
/// a program that asks the host for gigabytes (a reduction over an empty
/// dimension with a huge one beside it, say) meets a refused allocation,
/// which must be `OutOfMemory`, instead of slowly filling the machine.
fn limit_address_space(bytes: u64) {
    #[cfg(target_os = "linux")]
    {
        let limit = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: setrlimit reads the struct we pass; lowering the soft limit is always allowed.
        let r = unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
        assert_eq!(r, 0, "setrlimit failed");
    }
}

fn describe(seed: u64, steps: &[Step]) -> String {
    let mut s = format!("program of seed {seed}:\n");
    for (i, st) in steps.iter().enumerate() {
        let _ = writeln!(s, "  v{i} = {st:?}");
    }
    s
}

#[test]
fn random_programs_never_panic_hang_or_disagree() {
    let cases: u64 = std::env::var("KILN_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let first: u64 = std::env::var("KILN_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    limit_address_space(6 << 30);
    let sim = kiln::ensure_simulated_gpus(1, 256 << 20)[0];
    let devices = [cpu(), sim];

    // The watchdog: no step for 60 s is a hang.
    let heartbeat = Arc::new(AtomicU64::new(0));
    let current = Arc::new(std::sync::Mutex::new(String::new()));
    {
        let (heartbeat, current) = (heartbeat.clone(), current.clone());
        std::thread::spawn(move || {
            let mut last = (heartbeat.load(Ordering::Relaxed), Instant::now());
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let now = heartbeat.load(Ordering::Relaxed);
                if now != last.0 {
                    last = (now, Instant::now());
                } else if last.1.elapsed() > Duration::from_secs(60) {
                    // Straight to stderr: the harness's capture would swallow eprintln.
                    use std::io::Write as _;
                    let _ = writeln!(
                        std::io::stderr(),
                        "HANG: no step finished for 60 s in\n{}",
                        current.lock().unwrap_or_else(|e| e.into_inner())
                    );
                    std::process::exit(3);
                }
            }
        });
    }

    let baseline: Vec<(usize, usize)> =
        devices.iter().map(|d| kiln::memory_stats(d).map(|s| (s.in_use, s.live_tensors)).unwrap()).collect();
    let mut defects = Vec::new();
    let (mut steps_run, mut errors, mut missing_uses, mut i32_uses) = (0usize, 0usize, 0usize, 0usize);
    for seed in first..first + cases {
        let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
        let steps = program(&mut rng);
        missing_uses += steps.iter().filter(|s| names_missing(s)).count();
        i32_uses += steps.iter().filter(|s| format!("{s:?}").contains("I32")).count();
        *current.lock().unwrap_or_else(|e| e.into_inner()) = describe(seed, &steps);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // The same random numbers on both devices.
            kiln::manual_seed(seed);
            let on_cpu = execute(&steps, &devices[0], sim, &heartbeat)?;
            kiln::manual_seed(seed);
            let on_gpu = execute(&steps, &devices[1], sim, &heartbeat)?;
            if on_cpu != on_gpu {
                let at = on_cpu.iter().zip(&on_gpu).position(|(a, b)| a != b).unwrap_or(0);
                // The devices' capacities differ (host RAM vs 256 MiB): one
                // may run out of memory where the other does not. The rest
                // of the program then diverges legitimately.
                let oom = Outcome::Error("OutOfMemory");
                if on_cpu[at] == oom || on_gpu[at] == oom {
                    return Ok(on_cpu[..at].to_vec());
                }
                return Err(format!("cpu and {} disagree at step {at}: {:?} vs {:?}", devices[1], on_cpu[at], on_gpu[at]));
            }
            Ok(on_cpu)
        }));
        match result {
            Ok(Ok(outcomes)) => {
                steps_run += outcomes.len();
                errors += outcomes.iter().filter(|o| matches!(o, Outcome::Error(_))).count();
            }
            Ok(Err(defect)) => defects.push(format!("{defect}\n{}", describe(seed, &steps))),
            Err(_) => defects.push(format!("PANIC\n{}", describe(seed, &steps))),
        }
        for (d, base) in devices.iter().zip(&baseline) {
            let s = kiln::memory_stats(d).unwrap();
            if (s.in_use, s.live_tensors) != *base {
                defects.push(format!(
                    "memory on {d} is {} B in {} tensors after the program, baseline {base:?}\n{}",
                    s.in_use,
                    s.live_tensors,
                    describe(seed, &steps)
                ));
            }
        }
        if defects.len() >= 10 {
            break;
        }
    }
    println!(
        "fuzz: {cases} programs, {steps_run} steps ({missing_uses} on devices that do not exist, {i32_uses} with i32), {errors} user errors, {} defects",
        defects.len()
    );
    assert!(
        defects.is_empty(),
        "{} defects; the first ones:\n{}",
        defects.len(),
        defects.iter().take(5).cloned().collect::<Vec<_>>().join("\n")
    );
}
