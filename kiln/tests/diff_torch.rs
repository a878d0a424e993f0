//! Differential test of gradients against PyTorch (`torch.autograd`), run on
//! demand: PyTorch is several GB, so normal CI does not install it.
//!
//! Seeded random cases over the differentiable ops (elementwise unary and
//! binary with broadcasting, `maximum`/`minimum` with ties and NaN, scalar
//! ops, `clamp`, `powi`/`powf` including exponent 0 at x = 0, `pow`, sum /
//! mean / max / min reductions, matmul, softmax / log_softmax, `mse_loss`,
//! `cross_entropy`, `index_select`, `index_add`, `cat`, `stack`, views
//! (narrow, transpose, permute, broadcast, reshape, squeeze), casts and
//! `where_cond`, and operands of two dtypes: f32 with f64, a 0-d one among
//! them, through the binary family, `where_cond` and `cat`, each gradient in
//! its leaf's dtype), f32 and f64, shapes of rank 0 to 3 with zero-size ones,
//! non-contiguous leaves, on the CPU and a simulated GPU. Each case builds
//! `loss = sum(op(inputs) · w)` for a random weight `w`, runs `backward`, and
//! writes inputs, `w`, the output and every leaf's gradient as one JSON
//! line; `scripts/diff_torch.py` recomputes them with PyTorch and reports
//! every difference outside the README's table "Where kiln differs from
//! PyTorch".
//!
//! Runs only when `KILN_TORCH_PYTHON` names a Python with torch (otherwise
//! the test is reported ignored, with the reason). `scripts/diff-torch.sh` makes the venv
//! and runs it. `KILN_TORCH_CASES` (default 4000), `KILN_TORCH_SEED`
//! (default 1), `KILN_TORCH_KEEP=path` keeps the cases file.

#[macro_use]
mod common;

use common::rng::{Draw, XorShift as Rng};

use common::Ran;
use kiln::nn::{cross_entropy, mse_loss};
use kiln::{cpu, DType, Device, Result, Tensor};
use std::fmt::Write as _;
use std::process::Command;

/// A number as the JSON that the PyTorch side reads: NaN and the infinities
/// spelled as Python's `json` module writes and parses them.
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
        DType::F32 => t.to_vec::<f32>()?.into_iter().map(|v| if v.is_finite() { format!("{v:?}") } else { num(v as f64) }).collect(),
        _ => t.to_vec_f64()?.into_iter().map(num).collect(),
    };
    Ok(format!("{{\"dtype\":\"{}\",\"shape\":{:?},\"data\":[{}]}}", dtype_name(t.dtype()), t.dims(), data.join(",")))
}

fn random_shape(r: &mut Rng, min_rank: usize, max_rank: usize) -> Vec<usize> {
    let rank = min_rank + r.below(max_rank - min_rank + 1);
    (0..rank).map(|_| if r.below(12) == 0 { 0 } else { 1 + r.below(4) }).collect()
}

/// How the values of a random tensor are drawn.
#[derive(Clone, Copy, PartialEq)]
enum Vals {
    /// Multiples of 1/1024 in [−4, 4], rarely 0.
    Plain,
    /// As Plain, sometimes NaN, ±∞ or 0.
    Edgy,
    /// Small integers in [−2, 2] (ties for maximum/minimum/max/min), sometimes NaN.
    Ties,
    /// In (0.25, 4] (bases of pow, arguments of log).
    Positive,
}

fn draw(r: &mut Rng, vals: Vals) -> f64 {
    let plain = |r: &mut Rng| ((r.unit() * 2.0 - 1.0) * 4.0 * 1024.0).round() / 1024.0;
    match vals {
        Vals::Plain => plain(r),
        Vals::Edgy => match r.below(30) {
            0 => f64::NAN,
            1 => f64::INFINITY,
            2 => f64::NEG_INFINITY,
            3 | 4 => 0.0,
            _ => plain(r),
        },
        Vals::Ties => match r.below(25) {
            0 => f64::NAN,
            _ => r.below(5) as f64 - 2.0,
        },
        Vals::Positive => 0.25 + (r.unit() * 3.75 * 1024.0).round() / 1024.0 + 1.0 / 1024.0,
    }
}

/// A tensor of `shape` and `dtype` on `dev`: sometimes a transposed
/// (non-contiguous) view.
fn random_tensor(r: &mut Rng, shape: &[usize], dtype: DType, dev: Device, vals: Vals) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n).map(|_| draw(r, vals)).collect();
    let transposed = shape.len() >= 2 && r.below(3) == 0;
    let mut store_shape = shape.to_vec();
    if transposed {
        store_shape.swap(0, 1);
    }
    let base = Tensor::from_vec(data, store_shape, &cpu())?.to_dtype(dtype)?.to(&dev)?;
    if transposed {
        base.transpose(0, 1)
    } else {
        Ok(base)
    }
}

/// A leaf that requires grad (possibly a non-contiguous one).
fn leaf(r: &mut Rng, shape: &[usize], dtype: DType, dev: Device, vals: Vals) -> Result<Tensor> {
    Ok(random_tensor(r, shape, dtype, dev, vals)?.requires_grad_())
}

/// A broadcast partner of `shape`: some dimensions 1, some leading ones dropped.
fn broadcast_partner(r: &mut Rng, shape: &[usize]) -> Vec<usize> {
    let skip = r.below(shape.len() + 1);
    shape.iter().map(|&d| if r.below(3) == 0 { 1 } else { d }).collect::<Vec<_>>().split_off(skip)
}

/// One case: the op, its leaves (name, tensor), other inputs (name, JSON),
/// parameters (JSON fields) and the output; None when the draw is no case.
struct Case {
    op: String,
    family: &'static str,
    leaves: Vec<(&'static str, Tensor)>,
    extra: String,
    out: Tensor,
}

fn case(r: &mut Rng, dev: Device) -> Result<Option<Case>> {
    let dtype = r.pick(&[DType::F32, DType::F64]);
    let mut extra = String::new();
    let family_no = r.below(15);
    let (family, op, leaves, out): (&'static str, String, Vec<(&'static str, Tensor)>, Tensor) = match family_no {
        0 => {
            let op = r.pick(&[
                "neg",
                "abs",
                "exp",
                "log",
                "sqrt",
                "sqr",
                "recip",
                "sin",
                "cos",
                "tanh",
                "sigmoid",
                "relu",
                "erf",
                "gelu",
                "gelu_tanh",
                "silu",
            ]);
            let vals = if op == "log" && r.below(2) == 0 { Vals::Positive } else { Vals::Edgy };
            let sh = random_shape(r, 0, 3);
            let x = leaf(r, &sh, dtype, dev, vals)?;
            let y = match op {
                "neg" => x.neg()?,
                "abs" => x.abs()?,
                "exp" => x.exp()?,
                "log" => x.log()?,
                "sqrt" => x.sqrt()?,
                "sqr" => x.sqr()?,
                "recip" => x.recip()?,
                "sin" => x.sin()?,
                "cos" => x.cos()?,
                "tanh" => x.tanh()?,
                "sigmoid" => x.sigmoid()?,
                "erf" => x.erf()?,
                "gelu" => x.gelu()?,
                "gelu_tanh" => x.gelu_tanh()?,
                "silu" => x.silu()?,
                _ => x.relu()?,
            };
            ("unary", op.into(), vec![("a", x)], y)
        }
        1 => {
            let op = r.pick(&["add", "sub", "mul", "div", "maximum", "minimum", "pow"]);
            let vals = match op {
                "maximum" | "minimum" => Vals::Ties,
                "pow" => Vals::Plain,
                _ => Vals::Edgy,
            };
            let shape = random_shape(r, 0, 3);
            let other = broadcast_partner(r, &shape);
            let (sa, sb) = if r.below(2) == 0 { (shape, other) } else { (other, shape) };
            let a = if op == "pow" {
                // Positive bases, and 0 (with exponents 0 and positive ones).
                let t = random_tensor(r, &sa, dtype, dev, Vals::Positive)?;
                let zero = random_tensor(r, &sa, dtype, dev, Vals::Plain)?.gt(&Tensor::full(2.5, (), dtype, &dev)?)?;
                zero.where_cond(&Tensor::zeros((), dtype, &dev)?, &t)?.requires_grad_()
            } else {
                leaf(r, &sa, dtype, dev, vals)?
            };
            let b = if op == "pow" {
                let e = random_tensor(r, &sb, dtype, dev, Vals::Ties)?;
                e.ne(&e)?.where_cond(&Tensor::full(0.5, (), dtype, &dev)?, &e)?.requires_grad_()
            } else {
                leaf(r, &sb, dtype, dev, vals)?
            };
            let y = match op {
                "add" => a.add(&b)?,
                "sub" => a.sub(&b)?,
                "mul" => a.mul(&b)?,
                "div" => a.div(&b)?,
                "maximum" => a.maximum(&b)?,
                "minimum" => a.minimum(&b)?,
                _ => a.pow(&b)?,
            };
            ("binary", op.into(), vec![("a", a), ("b", b)], y)
        }
        2 => {
            let op =
                r.pick(&["add_scalar", "sub_scalar", "mul_scalar", "div_scalar", "maximum_scalar", "minimum_scalar", "clamp", "affine"]);
            let s = r.below(7) as f64 - 3.0 + if r.below(2) == 0 { 0.0 } else { 0.5 };
            let hi = s + r.below(4) as f64;
            if op == "div_scalar" && s == 0.0 {
                return Ok(None);
            }
            let sh = random_shape(r, 0, 3);
            let vals = if r.below(2) == 0 { Vals::Ties } else { Vals::Edgy };
            let x = leaf(r, &sh, dtype, dev, vals)?;
            let y = match op {
                "add_scalar" => x.add_scalar(s)?,
                "sub_scalar" => x.sub_scalar(s)?,
                "mul_scalar" => x.mul_scalar(s)?,
                "div_scalar" => x.div_scalar(s)?,
                "maximum_scalar" => x.maximum_scalar(s)?,
                "minimum_scalar" => x.minimum_scalar(s)?,
                "clamp" => x.clamp(s, hi)?,
                _ => x.affine(s, hi)?,
            };
            write!(extra, ",\"s\":{},\"hi\":{}", num(s), num(hi)).unwrap();
            ("scalar", op.into(), vec![("a", x)], y)
        }
        3 => {
            let sh = random_shape(r, 0, 3);
            let vals = if r.below(2) == 0 { Vals::Ties } else { Vals::Plain };
            let x = leaf(r, &sh, dtype, dev, vals)?;
            let (op, y) = if r.below(2) == 0 {
                let n = r.below(7) as i32 - 2;
                write!(extra, ",\"n\":{n}").unwrap();
                ("powi", x.powi(n)?)
            } else {
                let p = r.pick(&[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, -1.0, -0.5]);
                write!(extra, ",\"p\":{}", num(p)).unwrap();
                ("powf", x.powf(p)?)
            };
            ("pow", op.into(), vec![("a", x)], y)
        }
        4 => {
            let op = r.pick(&[
                "sum",
                "mean",
                "max",
                "min",
                "prod",
                "cumsum",
                "logsumexp",
                "var",
                "std",
                "sum_all",
                "mean_all",
                "max_all",
                "min_all",
                "prod_all",
            ]);
            let shape = random_shape(r, 0, 3);
            let vals = if op.starts_with("max") || op.starts_with("min") || op.starts_with("prod") { Vals::Ties } else { Vals::Edgy };
            let x = leaf(r, &shape, dtype, dev, vals)?;
            let y = if op.ends_with("_all") {
                if (op == "max_all" || op == "min_all") && x.elem_count() == 0 {
                    return Ok(None);
                }
                match op {
                    "sum_all" => x.sum_all()?,
                    "mean_all" => x.mean_all()?,
                    "max_all" => x.max_all()?,
                    "prod_all" => x.prod_all()?,
                    _ => x.min_all()?,
                }
            } else {
                if shape.is_empty() {
                    return Ok(None);
                }
                let d = r.below(shape.len());
                if (op == "max" || op == "min") && shape[d] == 0 {
                    return Ok(None);
                }
                let signed = if r.below(2) == 0 { d as i64 } else { d as i64 - shape.len() as i64 };
                let keep = r.below(2) == 0;
                write!(extra, ",\"dim\":{signed},\"keepdim\":{keep}").unwrap();
                match (op, keep) {
                    ("sum", false) => x.sum(signed)?,
                    ("sum", true) => x.sum_keepdim(signed)?,
                    ("mean", false) => x.mean(signed)?,
                    ("mean", true) => x.mean_keepdim(signed)?,
                    ("max", false) => x.max(signed)?,
                    ("max", true) => x.max_keepdim(signed)?,
                    ("min", false) => x.min(signed)?,
                    ("prod", false) => x.prod(signed)?,
                    ("prod", true) => x.prod_keepdim(signed)?,
                    ("cumsum", _) => x.cumsum(signed)?,
                    ("logsumexp", k) => x.logsumexp(&[signed], k)?,
                    ("var" | "std", k) => {
                        let correction = r.pick(&[0.0, 1.0]);
                        write!(extra, ",\"correction\":{correction}").unwrap();
                        if op == "var" {
                            x.var_dims(&[signed], correction, k)?
                        } else {
                            x.std_dims(&[signed], correction, k)?
                        }
                    }
                    _ => x.min_keepdim(signed)?,
                }
            };
            ("reduce", op.into(), vec![("a", x)], y)
        }
        5 => {
            let (m, k, n) = (r.below(4) + usize::from(r.below(8) != 0), r.below(5), 1 + r.below(4));
            let (sa, sb) = match r.below(5) {
                0 => (vec![m, k], vec![k, n]),
                1 => (vec![2, m, k], vec![1, k, n]),
                2 => (vec![m, k], vec![3, k, n]),
                3 => (vec![m, k], vec![k]),
                _ => (vec![k], vec![k, n]),
            };
            let a = leaf(r, &sa, dtype, dev, Vals::Plain)?;
            let b = leaf(r, &sb, dtype, dev, Vals::Plain)?;
            let y = a.matmul(&b)?;
            ("matmul", "matmul".into(), vec![("a", a), ("b", b)], y)
        }
        6 => {
            let shape = random_shape(r, 1, 3);
            let x = leaf(r, &shape, dtype, dev, Vals::Plain)?;
            let d = r.below(shape.len()) as i64 - if r.below(2) == 0 { shape.len() as i64 } else { 0 };
            let op = r.pick(&["softmax", "log_softmax"]);
            let y = if op == "softmax" { x.softmax(d)? } else { x.log_softmax(d)? };
            write!(extra, ",\"dim\":{d}").unwrap();
            ("softmax", op.into(), vec![("a", x)], y)
        }
        7 => {
            if r.below(2) == 0 {
                let shape = random_shape(r, 0, 3);
                let p = leaf(r, &shape, dtype, dev, Vals::Plain)?;
                let t = leaf(r, &shape, dtype, dev, Vals::Plain)?;
                let y = mse_loss(&p, &t)?;
                ("loss", "mse_loss".into(), vec![("a", p), ("b", t)], y)
            } else {
                let (n, c) = (if r.below(8) == 0 { 0 } else { 1 + r.below(4) }, 1 + r.below(5));
                let logits = leaf(r, &[n, c], dtype, dev, Vals::Plain)?;
                let labels: Vec<i64> = (0..n).map(|_| r.below(c) as i64).collect();
                let labels = Tensor::from_vec(labels, n, &dev)?;
                let y = cross_entropy(&logits, &labels)?;
                write!(extra, ",\"labels\":{}", json(&labels)?).unwrap();
                ("loss", "cross_entropy".into(), vec![("a", logits)], y)
            }
        }
        8 => {
            let shape = random_shape(r, 1, 3);
            if shape.contains(&0) {
                return Ok(None);
            }
            let d = r.below(shape.len());
            let ids: Vec<i64> = (0..r.below(5)).map(|_| r.below(shape[d]) as i64).collect();
            let ids = Tensor::from_vec(ids.clone(), ids.len(), &dev)?.to_dtype(r.pick(&[DType::I64, DType::I32]))?;
            let x = leaf(r, &shape, dtype, dev, Vals::Plain)?;
            write!(extra, ",\"ids\":{},\"dim\":{d}", json(&ids)?).unwrap();
            if r.below(2) == 0 {
                let y = x.index_select(&ids, d as i64 - shape.len() as i64)?;
                ("index", "index_select".into(), vec![("a", x)], y)
            } else {
                let mut sd = shape.clone();
                sd[d] = ids.elem_count();
                let src = leaf(r, &sd, dtype, dev, Vals::Plain)?;
                let y = x.index_add(&ids, &src, d)?;
                ("index", "index_add".into(), vec![("a", x), ("b", src)], y)
            }
        }
        9 => {
            let shape = random_shape(r, 1, 3);
            let d = r.below(shape.len());
            let a = leaf(r, &shape, dtype, dev, Vals::Plain)?;
            if r.below(2) == 0 {
                let mut other = shape.clone();
                other[d] = r.below(3);
                let b = leaf(r, &other, dtype, dev, Vals::Plain)?;
                let y = Tensor::cat(&[&a, &b], d as i64 - shape.len() as i64)?;
                write!(extra, ",\"dim\":{d}").unwrap();
                ("join", "cat".into(), vec![("a", a), ("b", b)], y)
            } else {
                let b = leaf(r, &shape, dtype, dev, Vals::Plain)?;
                let d = r.below(shape.len() + 1);
                let y = Tensor::stack(&[&a, &b, &a], d)?;
                write!(extra, ",\"dim\":{d}").unwrap();
                ("join", "stack".into(), vec![("a", a), ("b", b)], y)
            }
        }
        10 => {
            let op = r.pick(&["narrow", "transpose", "permute", "broadcast", "reshape", "squeeze_unsqueeze"]);
            let shape = random_shape(r, if op == "broadcast" || op == "reshape" { 0 } else { 1 }, 3);
            if op == "transpose" && shape.len() < 2 {
                return Ok(None);
            }
            let x = leaf(r, &shape, dtype, dev, Vals::Plain)?;
            let y = match op {
                "narrow" => {
                    let d = r.below(shape.len());
                    let start = r.below(shape[d] + 1);
                    let len = r.below(shape[d] - start + 1);
                    write!(extra, ",\"dim\":{d},\"start\":{start},\"len\":{len}").unwrap();
                    x.narrow(d, start, len)?
                }
                "transpose" => {
                    let (i, j) = (r.below(shape.len()), r.below(shape.len()));
                    write!(extra, ",\"i\":{i},\"j\":{j}").unwrap();
                    x.transpose(i, j)?
                }
                "permute" => {
                    let mut perm: Vec<usize> = (0..shape.len()).collect();
                    for i in (1..perm.len()).rev() {
                        perm.swap(i, r.below(i + 1));
                    }
                    write!(extra, ",\"perm\":{perm:?}").unwrap();
                    x.permute(&perm)?
                }
                "broadcast" => {
                    // Each dimension of size 1 may grow; new leading ones.
                    let mut to: Vec<usize> = (0..r.below(3)).map(|_| r.below(4)).collect();
                    to.extend(shape.iter().map(|&d| if d == 1 { r.below(4) } else { d }));
                    write!(extra, ",\"to\":{to:?}").unwrap();
                    x.broadcast_to(to)?
                }
                "reshape" => {
                    let n: usize = shape.iter().product();
                    let to = if n == 0 { vec![0, 2] } else { vec![n] };
                    write!(extra, ",\"to\":{to:?}").unwrap();
                    x.reshape(to)?
                }
                _ => {
                    let d = r.below(shape.len() + 1);
                    write!(extra, ",\"dim\":{d}").unwrap();
                    x.unsqueeze(d)?.sqr()?.squeeze(d)?
                }
            };
            // A non-linear op after the view, so the view's gradient is not all w.
            let y = y.mul(&y.detach().add_scalar(1.0)?)?;
            ("view", op.into(), vec![("a", x)], y)
        }
        11 => {
            let sh = random_shape(r, 0, 3);
            let x = leaf(r, &sh, dtype, dev, Vals::Plain)?;
            let to = if dtype == DType::F32 { DType::F64 } else { DType::F32 };
            let y = x.to_dtype(to)?.sqr()?.to_dtype(dtype)?;
            ("cast", "cast_sqr".into(), vec![("a", x)], y)
        }
        13 => {
            // Operands of two dtypes (PyTorch's promotion; issue 18): f32 and
            // f64 in either order, the second sometimes 0-d (a scalar for
            // dtype purposes: f32 with a 0-d f64 stays f32).
            let other_dtype = if dtype == DType::F32 { DType::F64 } else { DType::F32 };
            let op = r.pick(&["add", "sub", "mul", "div", "maximum", "minimum", "where", "cat"]);
            let shape = random_shape(r, if op == "cat" { 1 } else { 0 }, 3);
            let a = leaf(r, &shape, dtype, dev, Vals::Edgy)?;
            let sb: Vec<usize> = if op != "cat" && r.below(3) == 0 { vec![] } else { shape.clone() };
            let b = leaf(r, &sb, other_dtype, dev, Vals::Edgy)?;
            let y = match op {
                "add" => a.add(&b)?,
                "sub" => a.sub(&b)?,
                "mul" => a.mul(&b)?,
                "div" => a.div(&b)?,
                "maximum" => a.maximum(&b)?,
                "minimum" => a.minimum(&b)?,
                "where" => {
                    let cond = random_tensor(r, &shape, DType::F32, dev, Vals::Plain)?.gt(&Tensor::zeros((), DType::F32, &dev)?)?;
                    write!(extra, ",\"cond\":{}", json(&cond)?).unwrap();
                    cond.where_cond(&a, &b)?
                }
                _ => {
                    let d = r.below(shape.len()) as i64 - if r.below(2) == 0 { shape.len() as i64 } else { 0 };
                    write!(extra, ",\"dim\":{d}").unwrap();
                    Tensor::cat(&[&a, &b], d)?
                }
            };
            ("mixed", op.into(), vec![("a", a), ("b", b)], y)
        }
        12 => {
            let shape = random_shape(r, 0, 3);
            let a = leaf(r, &shape, dtype, dev, Vals::Edgy)?;
            let other = broadcast_partner(r, &shape);
            let b = leaf(r, &other, dtype, dev, Vals::Edgy)?;
            let cond = random_tensor(r, &shape, DType::F32, dev, Vals::Plain)?.gt(&Tensor::zeros((), DType::F32, &dev)?)?;
            let y = cond.where_cond(&a, &b)?;
            write!(extra, ",\"cond\":{}", json(&cond)?).unwrap();
            ("where", "where".into(), vec![("a", a), ("b", b)], y)
        }
        _ => {
            // A small chain: tanh(a @ b + c).sum(-1) through log_softmax.
            let (m, k, n) = (1 + r.below(3), 1 + r.below(3), 1 + r.below(3));
            let a = leaf(r, &[m, k], dtype, dev, Vals::Plain)?;
            let b = leaf(r, &[k, n], dtype, dev, Vals::Plain)?;
            let c = leaf(r, &[n], dtype, dev, Vals::Plain)?;
            let y = a.matmul(&b)?.add(&c)?.tanh()?.log_softmax(-1)?.sum(-1)?;
            ("chain", "chain".into(), vec![("a", a), ("b", b), ("c", c)], y)
        }
    };
    Ok(Some(Case { op, family, leaves, extra, out }))
}

/// Runs one case: loss = sum(out · w), backward, and the JSON line.
fn run_case(r: &mut Rng, id: usize, dev: Device) -> Result<Option<String>> {
    let Some(c) = case(r, dev)? else { return Ok(None) };
    let w = random_tensor(r, c.out.dims(), c.out.dtype(), dev, Vals::Plain)?;
    let loss = c.out.mul(&w)?.sum_all()?;
    loss.backward()?;
    let mut s = String::new();
    write!(s, "{{\"id\":{id},\"device\":\"{dev}\",\"family\":\"{}\",\"op\":\"{}\"{}", c.family, c.op, c.extra).unwrap();
    let mut inputs = Vec::new();
    let mut grads = Vec::new();
    for (name, t) in &c.leaves {
        inputs.push(format!("\"{name}\":{}", json(&t.detach())?));
        grads.push(match t.grad() {
            Some(g) => format!("\"{name}\":{}", json(&g)?),
            None => format!("\"{name}\":null"),
        });
    }
    write!(
        s,
        ",\"inputs\":{{{}}},\"w\":{},\"out\":{},\"grads\":{{{}}}}}",
        inputs.join(","),
        json(&w)?,
        json(&c.out.detach())?,
        grads.join(",")
    )
    .unwrap();
    Ok(Some(s))
}

fn main() -> std::process::ExitCode {
    common::run_suite(trials![kiln_gradients_agree_with_pytorch])
}

fn kiln_gradients_agree_with_pytorch() -> Ran {
    let Ok(py) = std::env::var("KILN_TORCH_PYTHON") else {
        return Err(common::skip("KILN_TORCH_PYTHON is not set (a Python with torch; scripts/diff-torch.sh makes one)"));
    };
    let cases: usize = std::env::var("KILN_TORCH_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(4000);
    let seed: u64 = std::env::var("KILN_TORCH_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let sim = kiln::ensure_simulated_gpus(1, 512 << 20)[0];
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut lines = String::new();
    let mut written = 0;
    while written < cases {
        let dev = if written % 2 == 0 { cpu() } else { sim };
        match run_case(&mut r, written, dev) {
            Ok(Some(line)) => {
                lines.push_str(&line);
                lines.push('\n');
                written += 1;
            }
            Ok(None) => {}
            Err(e) => panic!("case {written} on {dev}: kiln refused a valid case: {e}"),
        }
    }
    let keep = std::env::var("KILN_TORCH_KEEP").ok();
    let path = match &keep {
        Some(p) => std::path::PathBuf::from(p),
        None => std::env::temp_dir().join(format!("kiln-diff-torch-{}.jsonl", std::process::id())),
    };
    std::fs::write(&path, lines).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/diff_torch.py");
    let out = Command::new(&py).arg(script).arg(&path).output().expect("run the PyTorch comparer");
    if keep.is_none() {
        let _ = std::fs::remove_file(&path);
    }
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{report}");
    assert!(out.status.success(), "kiln's gradients and PyTorch's differ:\n{report}");
    Ok(())
}
