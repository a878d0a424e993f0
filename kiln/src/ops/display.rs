//! Printing like PyTorch: `tensor([[1., 1., 1.],\n        [1., 1., 1.]], device=gpu(0))`.
//! Printing a GPU tensor reads it to the host, which the ledger books as one
//! device-to-host transfer; large tensors are elided (first and last three
//! entries of each dimension), and only those entries are read.

use crate::{DType, Tensor};
use std::fmt::{self, Write};

/// Dimensions longer than this are elided when the tensor is large.
const EDGE: usize = 3;
/// Tensors with more elements than this are printed elided.
const THRESHOLD: usize = 1000;

struct Formatter {
    integral: bool,
    float: bool,
    width: usize,
}

impl Formatter {
    fn new(values: &[f64], dtype: DType) -> Self {
        let float = dtype.is_float();
        let integral = !float || values.iter().all(|v| v.fract() == 0.0 || !v.is_finite());
        let mut f = Formatter { integral, float, width: 0 };
        f.width = values.iter().map(|&v| f.text(v).len()).max().unwrap_or(0);
        f
    }
    fn text(&self, v: f64) -> String {
        if !self.float {
            format!("{}", v as i64)
        } else if v.is_nan() {
            "nan".into()
        } else if v.is_infinite() {
            if v > 0.0 {
                "inf".into()
            } else {
                "-inf".into()
            }
        } else if self.integral {
            format!("{v:.0}.")
        } else {
            format!("{v:.4}")
        }
    }
}

/// Writes nested brackets. `elided[d]` says that dimension d holds only its
/// first and last EDGE entries, with "..." printed between them.
fn write_nested(out: &mut String, values: &[f64], dims: &[usize], elided: &[bool], f: &Formatter, indent: usize) {
    if dims.is_empty() {
        let _ = write!(out, "{:>w$}", f.text(values[0]), w = f.width);
        return;
    }
    let n = dims[0];
    let inner: usize = dims[1..].iter().product();
    out.push('[');
    let shown: Vec<Option<usize>> = if elided[0] {
        (0..EDGE).map(Some).chain(std::iter::once(None)).chain((EDGE..2 * EDGE).map(Some)).collect()
    } else {
        (0..n).map(Some).collect()
    };
    for (k, i) in shown.iter().enumerate() {
        if k > 0 {
            out.push(',');
            if dims.len() > 1 {
                out.push_str(&"\n".repeat(dims.len() - 1));
                out.push_str(&" ".repeat(indent + 1));
            } else {
                out.push(' ');
            }
        }
        match i {
            Some(i) => write_nested(out, &values[i * inner..(i + 1) * inner], &dims[1..], &elided[1..], f, indent + 1),
            None => out.push_str("..."),
        }
    }
    out.push(']');
}

/// The part of a large tensor that is printed: the first and last EDGE
/// entries of every long dimension, gathered on the tensor's own device so
/// that printing a huge GPU tensor reads a few numbers, not all of them.
fn printed_part(t: &Tensor) -> crate::Result<(Tensor, Vec<bool>)> {
    let _g = crate::no_grad();
    let mut part = t.detach();
    let mut elided = vec![false; t.rank()];
    if t.elem_count() <= THRESHOLD {
        return Ok((part, elided));
    }
    for (d, flag) in elided.iter_mut().enumerate() {
        let n = part.dims()[d];
        if n > 2 * EDGE {
            let (head, tail) = (part.narrow(d, 0, EDGE)?, part.narrow(d, n - EDGE, EDGE)?);
            part = Tensor::cat(&[&head, &tail], d)?;
            *flag = true;
        }
    }
    Ok((part, elided))
}

impl fmt::Display for Tensor {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.elem_count() == 0 {
            // PyTorch's form; nothing to read, and nothing to walk however
            // large the other dimensions are.
            let mut s = String::from("tensor([]");
            if self.rank() != 1 {
                let dims: Vec<String> = self.dims().iter().map(|d| d.to_string()).collect();
                let _ = write!(s, ", size=({}{})", dims.join(", "), if dims.len() == 1 { "," } else { "" });
            }
            if !self.device().is_cpu() {
                let _ = write!(s, ", device={}", self.device());
            }
            if !matches!(self.dtype(), DType::F32 | DType::I64) {
                let _ = write!(s, ", dtype={}", self.dtype());
            }
            s.push(')');
            return out.write_str(&s);
        }
        let read = printed_part(self).and_then(|(part, elided)| Ok((part.read_host(std::panic::Location::caller())?, part, elided)));
        let (buf, part, elided) = match read {
            Ok(r) => r,
            Err(e) => return write!(out, "tensor(<not readable: {e}>, shape={:?}, device={})", self.dims(), self.device()),
        };
        let values: Vec<f64> = (0..buf.len()).map(|i| buf.get_f64(i)).collect();
        let f = Formatter::new(&values, self.dtype());
        let mut s = String::from("tensor(");
        write_nested(&mut s, &values, part.dims(), &elided, &f, 7);
        if !self.device().is_cpu() {
            let _ = write!(s, ", device={}", self.device());
        }
        if !matches!(self.dtype(), DType::F32 | DType::I64) {
            let _ = write!(s, ", dtype={}", self.dtype());
        }
        if self.requires_grad() {
            s.push_str(", requires_grad=true");
        }
        s.push(')');
        out.write_str(&s)
    }
}

impl Tensor {
    /// Prints the tensor and a newline to stdout, booking the read (a
    /// device-to-host transfer on a GPU) at the caller's line.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// Tensor::new(&[1, 2, 3], &cpu())?.show();
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn show(&self) {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        std::println!("{self}");
    }
}
