//! Differential test against numpy: seeded random cases over the op
//! families (elementwise, scalar, broadcasting, reductions, matmul, casts,
//! softmax, indexing: index_select, gather/scatter, sort/topk, range
//! indexing, `where_cond`, `cat`, the norm, the ops that take a
//! dimension), every dtype (f32, f64, i64, i32, u8, f16, bf16) per op and
//! operands of two dtypes (PyTorch's promotion, 0-d operands counted as
//! scalars), dimensions counted from either end and out of range, shapes
//! (rank 0 to 3, zero-size), non-contiguous and broadcast views, on the CPU
//! and a simulated GPU. A call kiln refuses is written as its error's kind,
//! and the script checks that PyTorch refuses it too or that the README's
//! table documents the refusal. kiln's inputs and results are written as JSON lines;
//! `scripts/diff_numpy.py` recomputes every case with numpy and reports any
//! difference outside the README's table "Where kiln differs from PyTorch".
//!
//! Runs when a Python with numpy is found: `$KILN_NUMPY_PYTHON`, else
//! `python3` if it imports numpy; otherwise the test is reported ignored,
//! with the reason (a failure with `KILN_REQUIRE_NUMPY=1`). CI runs it
//! through `.ci/differential.sh`, which installs numpy into a venv.
//! `KILN_DIFF_CASES` (default 4000) and `KILN_DIFF_SEED` (default 1) change
//! the run.

#[macro_use]
mod common;

use common::rng::{Draw, XorShift as Rng};

use common::Ran;
use kiln::{cpu, DType, Device, Result, Tensor};
use std::fmt::Write as _;
use std::process::Command;

fn main() -> std::process::ExitCode {
    common::run_suite(trials![kiln_agrees_with_numpy])
}

/// A Python that imports numpy (`KILN_NUMPY_PYTHON`, else `python3`), if there is one.
fn python() -> Option<String> {
    let candidates: Vec<String> = match std::env::var("KILN_NUMPY_PYTHON") {
        Ok(p) => vec![p],
        Err(_) => vec!["python3".into()],
    };
    candidates.into_iter().find(|p| Command::new(p).args(["-c", "import numpy"]).output().is_ok_and(|o| o.status.success()))
}

fn num(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        }
    } else {
        format!("{v:?}")
    }
}

/// `"out":{..}` for a result, `"error":"Kind"` for a refusal (the script
/// decides whether PyTorch refuses it too, or the README's table says so).
fn out(r: Result<Tensor>) -> Result<String> {
    Ok(match r {
        Ok(t) => format!("\"out\":{}", json(&t)?),
        Err(e) => format!("\"error\":\"{}\"", kind(&e)),
    })
}

fn kind(e: &kiln::Error) -> &'static str {
    match e {
        kiln::Error::DTypeMismatch { .. } => "DTypeMismatch",
        kiln::Error::UnsupportedDType { .. } => "UnsupportedDType",
        kiln::Error::InvalidArgument { .. } => "InvalidArgument",
        kiln::Error::ShapeMismatch { .. } => "ShapeMismatch",
        _ => "other",
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::U8 => "u8",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// `{"dtype": .., "shape": [..], "data": [..]}` of a tensor's logical values.
fn json(t: &Tensor) -> Result<String> {
    let data: Vec<String> = match t.dtype() {
        // f32 printed as f32 (shortest round trip), not widened.
        DType::F32 => t.to_vec::<f32>()?.into_iter().map(|v| if v.is_finite() { format!("{v:?}") } else { num(v as f64) }).collect(),
        _ => t.to_vec_f64()?.into_iter().map(num).collect(),
    };
    Ok(format!("{{\"dtype\":\"{}\",\"shape\":{:?},\"data\":[{}]}}", dtype_name(t.dtype()), t.dims(), data.join(",")))
}

fn random_shape(r: &mut Rng, max_rank: usize) -> Vec<usize> {
    let rank = r.below(max_rank + 1);
    (0..rank).map(|_| if r.below(12) == 0 { 0 } else { 1 + r.below(4) }).collect()
}

/// A tensor of `shape` and `dtype` on `dev`: sometimes a transposed
/// (non-contiguous) view, sometimes with a NaN or an infinity.
fn random_tensor(r: &mut Rng, shape: &[usize], dtype: DType, dev: Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let vals: Vec<f64> = (0..n)
        .map(|_| match dtype {
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 => match r.below(40) {
                0 => f64::NAN,
                1 => f64::INFINITY,
                2 => 0.0,
                _ => ((r.unit() * 2.0 - 1.0) * 4.0 * 1024.0).round() / 1024.0,
            },
            DType::U8 => r.below(256) as f64,
            _ => r.below(41) as f64 - 20.0,
        })
        .collect();
    let transposed = shape.len() >= 2 && r.below(3) == 0;
    let mut store_shape = shape.to_vec();
    if transposed {
        store_shape.swap(0, 1);
    }
    let base = Tensor::from_vec(vals, store_shape, &cpu())?.to_dtype(dtype)?.to(&dev)?;
    if transposed {
        base.transpose(0, 1)
    } else {
        Ok(base)
    }
}

/// Every dtype, the half types included.
const EVERY: [DType; 7] = [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16];

/// One case: the op's JSON fields, or None when this draw is not a case.
fn case(r: &mut Rng, dev: Device) -> Result<Option<String>> {
    let family = r.below(13);
    let mut s = String::new();
    match family {
        0 => {
            // Elementwise functions (half types: refused, the README's table).
            let dtype = r.pick(&EVERY);
            let ops: &[&str] = if dtype.is_float() {
                &["neg", "abs", "exp", "log", "sqrt", "sqr", "sin", "cos", "tanh", "sigmoid", "relu", "recip"]
            } else if dtype == DType::U8 {
                &["abs", "sqr", "relu"]
            } else {
                &["neg", "abs", "sqr", "relu", "exp", "sqrt"]
            };
            let op = r.pick(ops);
            let x = {
                let sh = random_shape(r, 3);
                random_tensor(r, &sh, dtype, dev)
            }?;
            let y = match op {
                "neg" => x.neg(),
                "abs" => x.abs(),
                "exp" => x.exp(),
                "log" => x.log(),
                "sqrt" => x.sqrt(),
                "sqr" => x.sqr(),
                "sin" => x.sin(),
                "cos" => x.cos(),
                "tanh" => x.tanh(),
                "sigmoid" => x.sigmoid(),
                "relu" => x.relu(),
                _ => x.recip(),
            };
            write!(s, "\"op\":\"{op}\",\"a\":{},{}", json(&x)?, out(y)?).unwrap();
        }
        1 => {
            // Tensor ⊕ Rust scalar, with PyTorch's promotion.
            let dtype = r.pick(&EVERY);
            let op = r.pick(&["add_scalar", "sub_scalar", "mul_scalar", "div_scalar", "maximum_scalar", "minimum_scalar", "clamp"]);
            let scalar = if r.below(2) == 0 { r.below(7) as f64 - 3.0 } else { (r.unit() * 6.0 - 3.0 * 1.0).round() / 4.0 + 0.25 };
            let hi = scalar + r.below(5) as f64;
            let x = {
                let sh = random_shape(r, 3);
                random_tensor(r, &sh, dtype, dev)
            }?;
            if op == "div_scalar" && scalar == 0.0 {
                return Ok(None);
            }
            let y = match op {
                "add_scalar" => x.add_scalar(scalar),
                "sub_scalar" => x.sub_scalar(scalar),
                "mul_scalar" => x.mul_scalar(scalar),
                "div_scalar" => x.div_scalar(scalar),
                "maximum_scalar" => x.maximum_scalar(scalar),
                "minimum_scalar" => x.minimum_scalar(scalar),
                _ => x.clamp(scalar, hi),
            };
            write!(s, "\"op\":\"{op}\",\"a\":{},\"s\":{},\"hi\":{},{}", json(&x)?, num(scalar), num(hi), out(y)?).unwrap();
        }
        2 => {
            // Binary ops with numpy broadcasting (one side may be a stride-0
            // view, or 0-d), operands of one dtype or of two (promotion).
            let da = r.pick(&EVERY);
            let db = if r.below(2) == 0 { da } else { r.pick(&EVERY) };
            let op = r.pick(&["add", "sub", "mul", "div", "maximum", "minimum", "eq", "lt", "ge", "pow"]);
            let shape = random_shape(r, 3);
            let skip = if r.below(5) == 0 { shape.len() } else { r.below(shape.len() + 1) };
            let other: Vec<usize> = shape.iter().map(|&d| if r.below(3) == 0 { 1 } else { d }).collect::<Vec<_>>().split_off(skip);
            let (sa, sb) = if r.below(2) == 0 { (shape, other) } else { (other, shape) };
            let a = random_tensor(r, &sa, da, dev)?;
            let b = random_tensor(r, &sb, db, dev)?;
            let both_int = !da.is_float() && !db.is_float();
            if op == "div" && both_int && b.to_vec_f64()?.contains(&0.0) {
                return Ok(None);
            }
            let y = match op {
                "add" => a.add(&b),
                "sub" => a.sub(&b),
                "mul" => a.mul(&b),
                "div" => a.div(&b),
                "maximum" => a.maximum(&b),
                "minimum" => a.minimum(&b),
                "eq" => a.eq(&b),
                "lt" => a.lt(&b),
                "pow" => a.pow(&b),
                _ => a.ge(&b),
            };
            write!(s, "\"op\":\"{op}\",\"a\":{},\"b\":{},{}", json(&a)?, json(&b)?, out(y)?).unwrap();
        }
        3 => {
            // Reductions over one dimension (negative half the time, out of
            // range sometimes; 0 and -1 of a 0-d tensor) or all; every dtype
            // (mean of integers and half types are refused).
            let dtype = r.pick(&EVERY);
            let op = r.pick(&["sum", "max", "min", "argmax", "argmin", "mean", "sum_all", "max_all"]);
            let shape = random_shape(r, 3);
            let x = random_tensor(r, &shape, dtype, dev)?;
            let rank = shape.len();
            if op.ends_with("_all") {
                if op == "max_all" && x.elem_count() == 0 {
                    return Ok(None);
                }
                let y = if op == "sum_all" { x.sum_all() } else { x.max_all() };
                write!(s, "\"op\":\"{op}\",\"a\":{},{}", json(&x)?, out(y)?).unwrap();
            } else {
                let n = rank.max(1);
                let d = r.below(n);
                if op != "sum" && op != "mean" && shape.get(d) == Some(&0) {
                    return Ok(None);
                }
                let signed = match r.below(10) {
                    0 => r.pick(&[-(n as i64) - 1, n as i64, n as i64 + 2]),
                    1..=4 => d as i64 - n as i64,
                    _ => d as i64,
                };
                let keep = r.below(2) == 0;
                let y = match (op, keep) {
                    ("sum", false) => x.sum(signed),
                    ("sum", true) => x.sum_keepdim(signed),
                    ("max", false) => x.max(signed),
                    ("max", true) => x.max_keepdim(signed),
                    ("min", false) => x.min(signed),
                    ("min", true) => x.min_keepdim(signed),
                    ("argmax", false) => x.argmax(signed),
                    ("argmax", true) => x.argmax_keepdim(signed),
                    ("argmin", _) => x.argmin(signed),
                    ("mean", false) => x.mean(signed),
                    _ => x.mean_keepdim(signed),
                };
                let keep = keep && op != "argmin";
                write!(s, "\"op\":\"{op}\",\"a\":{},\"dim\":{signed},\"keepdim\":{keep},{}", json(&x)?, out(y)?).unwrap();
            }
        }
        4 => {
            // Matmul: matrix, batched with broadcast batch, matrix-vector;
            // sometimes operands of two dtypes (refused, as PyTorch's).
            let dtype = r.pick(&[DType::F32, DType::F64, DType::I64, DType::I32]);
            let db = if r.below(5) == 0 { r.pick(&[DType::F32, DType::F64, DType::I64, DType::I32]) } else { dtype };
            let (m, k, n) = (r.below(4) + usize::from(r.below(8) != 0), r.below(5), 1 + r.below(4));
            let (sa, sb) = match r.below(3) {
                0 => (vec![m, k], vec![k, n]),
                1 => (vec![2, m, k], vec![1, k, n]),
                _ => (vec![m, k], vec![k]),
            };
            let a = random_tensor(r, &sa, dtype, dev)?;
            let b = random_tensor(r, &sb, db, dev)?;
            // NaN·0 and ∞·0 orders differ between BLAS implementations.
            let finite = |t: &Tensor| -> Result<bool> { Ok(t.to_vec_f64()?.iter().all(|v| v.is_finite())) };
            if !finite(&a)? || !finite(&b)? {
                return Ok(None);
            }
            write!(s, "\"op\":\"matmul\",\"a\":{},\"b\":{},{}", json(&a)?, json(&b)?, out(a.matmul(&b))?).unwrap();
        }
        5 => {
            // Casts between every pair of dtypes. Float to integer only for
            // values an integer holds (out of range and NaN are a documented
            // difference).
            let from = r.pick(&EVERY);
            let to = r.pick(&EVERY);
            let sh = random_shape(r, 3);
            let mut x = random_tensor(r, &sh, if from.is_float() { DType::F64 } else { from }, dev)?;
            if from.is_float() && !to.is_float() {
                let lo = if to == DType::U8 { 0.0 } else { -100.0 };
                x = x.clamp(lo, 100.0)?.where_cond_nan_to(lo)?;
            }
            if from == DType::I64 && r.below(2) == 0 {
                // Large values: one rounding to f32, wrapping to u8/i32.
                x = x.mul_scalar((1i64 << 40) as f64 + 12345.0)?.add_scalar(7.0)?;
            }
            let x = x.to_dtype(from)?;
            write!(s, "\"op\":\"cast\",\"a\":{},\"to\":\"{}\",{}", json(&x)?, dtype_name(to), out(x.to_dtype(to))?).unwrap();
        }
        6 => {
            // softmax / log_softmax over any dimension, every dtype (integers
            // compute in f32, half types are refused: the README's table).
            let dtype = r.pick(&EVERY);
            let shape = random_shape(r, 3);
            let x = random_tensor(r, &shape, if dtype.is_float() { DType::F64 } else { dtype }, dev)?;
            let x = if dtype.is_float() { x.clamp(-50.0, 50.0)? } else { x }.to_dtype(dtype)?;
            let n = shape.len().max(1) as i64;
            let d = match r.below(8) {
                0 => r.pick(&[-n - 1, n]),
                1..=3 => r.below(n as usize) as i64 - n,
                _ => r.below(n as usize) as i64,
            };
            let op = r.pick(&["softmax", "log_softmax"]);
            let y = if op == "softmax" { x.softmax(d) } else { x.log_softmax(d) };
            write!(s, "\"op\":\"{op}\",\"a\":{},\"dim\":{d},{}", json(&x)?, out(y)?).unwrap();
        }
        7 => {
            // index_select with i64/i32 indices, on views, every dtype.
            let dtype = r.pick(&EVERY);
            let shape = random_shape(r, 3);
            if shape.is_empty() || shape.contains(&0) {
                return Ok(None);
            }
            let d = r.below(shape.len());
            let ids: Vec<i64> = (0..r.below(5)).map(|_| r.below(shape[d]) as i64).collect();
            let ids = Tensor::from_vec(ids.clone(), ids.len(), &dev)?.to_dtype(r.pick(&[DType::I64, DType::I32]))?;
            let x = random_tensor(r, &shape, dtype, dev)?;
            let y = x.index_select(&ids, d as i64 - shape.len() as i64);
            write!(s, "\"op\":\"index_select\",\"a\":{},\"ids\":{},\"dim\":{d},{}", json(&x)?, json(&ids)?, out(y)?).unwrap();
        }
        8 => {
            // cat (operands of one dtype or two) and narrow of views.
            let dtype = r.pick(&EVERY);
            let db = if r.below(2) == 0 { dtype } else { r.pick(&EVERY) };
            let shape = random_shape(r, 3);
            if shape.is_empty() {
                return Ok(None);
            }
            let d = r.below(shape.len());
            let a = random_tensor(r, &shape, dtype, dev)?;
            let mut other = shape.clone();
            other[d] = r.below(3);
            let b = random_tensor(r, &other, db, dev)?;
            let cat = Tensor::cat(&[&a, &b], -(shape.len() as i64) + d as i64)?;
            let total = cat.dims()[d];
            let start = r.below(total + 1);
            let len = r.below(total - start + 1);
            let y = cat.narrow(d, start, len)?;
            write!(
                s,
                "\"op\":\"cat_narrow\",\"a\":{},\"b\":{},\"dim\":{d},\"start\":{start},\"len\":{len},\"out\":{}",
                json(&a)?,
                json(&b)?,
                json(&y)?
            )
            .unwrap();
        }
        9 => {
            // where_cond with branches of one dtype or two, broadcasting.
            let (da, db) = (r.pick(&EVERY), r.pick(&EVERY));
            let shape = random_shape(r, 2);
            let c = random_tensor(r, &shape, DType::U8, dev)?.gt(&Tensor::new(&127u8, &dev)?)?;
            let sa: Vec<usize> = if r.below(3) == 0 { vec![] } else { shape.clone() };
            let a = random_tensor(r, &sa, da, dev)?;
            let b = random_tensor(r, &shape, db, dev)?;
            write!(s, "\"op\":\"where\",\"c\":{},\"a\":{},\"b\":{},{}", json(&c)?, json(&a)?, json(&b)?, out(c.where_cond(&a, &b))?)
                .unwrap();
        }
        11 => return indexing_case(r, dev),
        10 => {
            // The norm, every dtype (integers are refused, as PyTorch's
            // linalg.vector_norm refuses them; half types: the README's table).
            let dtype = r.pick(&EVERY);
            let shape = random_shape(r, 3);
            let x = random_tensor(r, &shape, dtype, dev)?;
            write!(s, "\"op\":\"norm\",\"a\":{},{}", json(&x)?, out(x.norm())?).unwrap();
        }
        _ => {
            // The ops that take a dimension, with every dimension from
            // -(rank + 2) to rank + 1: PyTorch's rule decides which are
            // valid and what they name.
            let dtype = r.pick(&EVERY);
            let shape = random_shape(r, 3);
            let x = random_tensor(r, &shape, dtype, dev)?;
            let rank = shape.len() as i64;
            let d = r.below(2 * rank as usize + 4) as i64 - rank - 2;
            let op = r.pick(&["transpose", "unsqueeze", "squeeze", "flatten_from", "narrow", "stack", "cumsum", "sum_keepdim", "argmax"]);
            let y = match op {
                "transpose" => x.transpose(d, -1),
                "unsqueeze" => x.unsqueeze(d),
                "squeeze" => x.squeeze(d),
                "flatten_from" => x.flatten_from(d),
                "narrow" => x.narrow(d, 0, 1.min(x.dim(d).unwrap_or(0))),
                "stack" => Tensor::stack(&[&x, &x], d),
                "cumsum" => x.cumsum(d),
                "sum_keepdim" => x.sum_keepdim(d),
                _ => x.argmax(d),
            };
            write!(s, "\"op\":\"dim_{op}\",\"a\":{},\"dim\":{d},{}", json(&x)?, out(y)?).unwrap();
        }
    }
    Ok(Some(s))
}

/// gather, scatter, scatter_add (repeated indices: the last write wins,
/// the adds accumulate), sort and argsort (stable, NaN largest), topk, and
/// range indexing, on views, with i64/i32 indices.
fn indexing_case(r: &mut Rng, dev: Device) -> Result<Option<String>> {
    let dtype = r.pick(&EVERY[..5]);
    let shape = random_shape(r, 3);
    if shape.is_empty() || shape.contains(&0) {
        return Ok(None);
    }
    let x = random_tensor(r, &shape, dtype, dev)?;
    let rank = shape.len();
    let d = r.below(rank);
    let signed = if r.below(2) == 0 { d as i64 } else { d as i64 - rank as i64 };
    let op = r.pick(&["gather", "scatter", "scatter_add", "sort", "argsort", "topk", "topk_indices", "index"]);
    let mut s = String::new();
    match op {
        "gather" | "scatter" | "scatter_add" => {
            let idims: Vec<usize> = shape.iter().enumerate().map(|(e, &n)| if e == d { r.below(4) } else { 1 + r.below(n) }).collect();
            let ids: Vec<i64> = (0..idims.iter().product()).map(|_| r.below(shape[d]) as i64).collect();
            let index = Tensor::from_vec(ids, idims.clone(), &dev)?.to_dtype(r.pick(&[DType::I64, DType::I32]))?;
            let (y, src) = if op == "gather" {
                (x.gather(signed, &index)?, None)
            } else {
                // src may be larger than the index.
                let sdims: Vec<usize> = idims.iter().map(|&n| n + r.below(2)).collect();
                let src = random_tensor(r, &sdims, dtype, dev)?;
                let y = if op == "scatter" { x.scatter(signed, &index, &src)? } else { x.scatter_add(signed, &index, &src)? };
                (y, Some(src))
            };
            let src = match src {
                Some(t) => format!(",\"src\":{}", json(&t)?),
                None => String::new(),
            };
            write!(s, "\"op\":\"{op}\",\"a\":{},\"index\":{},\"dim\":{signed}{src},\"out\":{}", json(&x)?, json(&index)?, json(&y)?)
                .unwrap();
        }
        "sort" | "argsort" | "topk" | "topk_indices" => {
            let descending = r.below(2) == 0;
            let k = r.below(shape[d] + 1);
            let y = match op {
                "sort" => x.sort(signed, descending)?.0,
                "argsort" => x.argsort(signed, descending)?,
                "topk" => x.topk(k, signed, descending, true)?.0,
                _ => x.topk(k, signed, descending, true)?.1,
            };
            write!(s, "\"op\":\"{op}\",\"a\":{},\"dim\":{signed},\"descending\":{descending},\"k\":{k},\"out\":{}", json(&x)?, json(&y)?)
                .unwrap();
        }
        _ => {
            // One valid selector per leading dimension: (kind, start, end),
            // bounds sometimes negative (from the end).
            use kiln::Selector;
            use std::ops::Bound::{Excluded, Included, Unbounded};
            let mut sels = Vec::new();
            let mut plain = Vec::new();
            for &n in &shape[..r.below(rank + 1)] {
                let n = n as i64;
                let neg = |r: &mut Rng, v: i64| if v < n && r.below(2) == 0 { v - n } else { v };
                let s0 = r.below(n as usize + 1) as i64;
                let e0 = s0 + r.below((n - s0) as usize + 1) as i64;
                let (kind, a, b) = match r.below(6) {
                    0 => (0, 0, 0),
                    1 => {
                        let i = r.below(n as usize) as i64;
                        (1, neg(r, i), 0)
                    }
                    2 => (2, neg(r, s0), neg(r, e0)),
                    3 => (3, neg(r, s0), 0),
                    4 => (4, 0, neg(r, e0)),
                    _ => (5, neg(r, s0), neg(r, e0.max(1) - 1).max(-n)),
                };
                sels.push(match kind {
                    0 => Selector::All,
                    1 => Selector::Index(a),
                    2 => Selector::Range(Included(a), Excluded(b)),
                    3 => Selector::Range(Included(a), Unbounded),
                    4 => Selector::Range(Unbounded, Excluded(b)),
                    _ => Selector::Range(Included(a), Included(b)),
                });
                plain.push(format!("[{kind},{a},{b}]"));
            }
            let y = x.i(sels)?;
            write!(s, "\"op\":\"index\",\"a\":{},\"sels\":[{}],\"out\":{}", json(&x)?, plain.join(","), json(&y)?).unwrap();
        }
    }
    Ok(Some(s))
}

/// NaN replaced by `v` (for casts to integers).
trait NanTo {
    fn where_cond_nan_to(&self, v: f64) -> Result<Tensor>;
}

impl NanTo for Tensor {
    fn where_cond_nan_to(&self, v: f64) -> Result<Tensor> {
        let nan = self.ne(self)?;
        nan.where_cond(&Tensor::full(v, (), self.dtype(), &self.device())?, self)
    }
}

fn kiln_agrees_with_numpy() -> Ran {
    let Some(py) = python() else {
        let why = "no Python with numpy (set KILN_NUMPY_PYTHON, or run .ci/differential.sh)";
        assert!(!common::required("KILN_REQUIRE_NUMPY"), "KILN_REQUIRE_NUMPY=1 but {why}");
        return Err(common::skip(why));
    };
    let cases: usize = std::env::var("KILN_DIFF_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(4000);
    let seed: u64 = std::env::var("KILN_DIFF_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let sim = kiln::ensure_simulated_gpus(1, 512 << 20)[0];
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut lines = String::new();
    let mut written = 0;
    while written < cases {
        let dev = if written % 2 == 0 { cpu() } else { sim };
        match case(&mut r, dev) {
            Ok(Some(fields)) => {
                writeln!(lines, "{{\"id\":{written},\"device\":\"{dev}\",{fields}}}").unwrap();
                written += 1;
            }
            Ok(None) => {}
            Err(e) => panic!("case {written} on {dev}: kiln refused a valid case: {e}"),
        }
    }
    let path = std::env::temp_dir().join(format!("kiln-differential-{}.jsonl", std::process::id()));
    std::fs::write(&path, lines).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/diff_numpy.py");
    let out = Command::new(&py).arg(script).arg(&path).output().expect("run the numpy comparer");
    let _ = std::fs::remove_file(&path);
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{report}");
    assert!(out.status.success(), "kiln and numpy differ:\n{report}");
    Ok(())
}
