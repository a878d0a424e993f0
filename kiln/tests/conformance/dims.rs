//! Conformance: every op that takes a dimension, with every dimension from
//! −5 to 4 on tensors of rank 0 to 3, against PyTorch's rule for it:
//! which dimensions are valid, what a negative one names, the
//! shape of the result, and an error naming the rank for the rest. A
//! negative dimension must give exactly what its positive twin gives.
//!
//! PyTorch's rules (`maybe_wrap_dim`): most ops take `-r ..= r-1` and, on a
//! 0-d tensor, 0 and −1 as if it had one dimension (reductions, softmax,
//! cumsum, transpose, squeeze, flatten, `index_select` and `index_add` with
//! one index); ops that insert a dimension (`unsqueeze`, `stack`) take
//! `-(r+1) ..= r`; `narrow`, `cat` and `size(dim)` need a dimension to exist.

use crate::common::on_every_device;
use crate::same_f32_bits;
use kiln::{DType, Device, Error, Result, Tensor};

/// How an op resolves a dimension.
#[derive(Clone, Copy, PartialEq)]
enum Rule {
    /// `-r ..= r-1`, and 0 / −1 on a 0-d tensor.
    WrapScalar,
    /// `-(r+1) ..= r`.
    Insert,
    /// `-r ..= r-1`, none on a 0-d tensor.
    Exists,
}

/// The dimension `d` names under `rule` for rank `r`, or None when PyTorch
/// raises IndexError.
fn resolve(rule: Rule, d: i64, r: usize) -> Option<usize> {
    let n = match rule {
        Rule::WrapScalar => r.max(1),
        Rule::Insert => r + 1,
        Rule::Exists => r,
    } as i64;
    let w = if d < 0 { d + n } else { d };
    (0..n).contains(&w).then_some(w as usize)
}

/// The shape PyTorch gives for `op` over dimension `w` of `dims`.
fn expected_shape(op: &str, dims: &[usize], w: usize) -> Vec<usize> {
    let mut out = dims.to_vec();
    let r = dims.len();
    match op {
        "sum" | "max" | "min" | "prod" | "argmax" | "argmin" | "mean" | "var" | "std" | "logsumexp" => {
            if r > 0 {
                out.remove(w);
            }
        }
        "sum_keepdim" | "max_keepdim" | "argmax_keepdim" | "mean_keepdim" => {
            if r > 0 {
                out[w] = 1;
            }
        }
        "softmax" | "log_softmax" | "cumsum" | "index_add" => {}
        "transpose" => {
            if r > 0 {
                out.swap(w, 0);
            }
        }
        "squeeze" => {
            if r > 0 && out[w] == 1 {
                out.remove(w);
            }
        }
        "flatten_from" => {
            if r == 0 {
                return vec![1];
            }
            let merged = out[w..].iter().product();
            out.truncate(w);
            out.push(merged);
        }
        "unsqueeze" => out.insert(w, 1),
        "stack" => out.insert(w, 2),
        "narrow" => out[w] = 1,
        "cat" => out[w] *= 2,
        "index_select" => {
            if r > 0 {
                out[w] = 2;
            }
        }
        other => panic!("no rule for {other}"),
    }
    out
}

const OPS: &[(&str, Rule)] = &[
    ("sum", Rule::WrapScalar),
    ("sum_keepdim", Rule::WrapScalar),
    ("max", Rule::WrapScalar),
    ("max_keepdim", Rule::WrapScalar),
    ("min", Rule::WrapScalar),
    ("prod", Rule::WrapScalar),
    ("argmax", Rule::WrapScalar),
    ("argmax_keepdim", Rule::WrapScalar),
    ("argmin", Rule::WrapScalar),
    ("mean", Rule::WrapScalar),
    ("mean_keepdim", Rule::WrapScalar),
    ("var", Rule::WrapScalar),
    ("std", Rule::WrapScalar),
    ("logsumexp", Rule::WrapScalar),
    ("softmax", Rule::WrapScalar),
    ("log_softmax", Rule::WrapScalar),
    ("cumsum", Rule::WrapScalar),
    ("transpose", Rule::WrapScalar),
    ("squeeze", Rule::WrapScalar),
    ("flatten_from", Rule::WrapScalar),
    ("unsqueeze", Rule::Insert),
    ("stack", Rule::Insert),
    ("narrow", Rule::Exists),
    ("cat", Rule::Exists),
    ("index_select", Rule::WrapScalar),
    ("index_add", Rule::WrapScalar),
];

fn run(op: &str, x: &Tensor, d: i64) -> Result<Tensor> {
    let dev = x.device();
    match op {
        "sum" => x.sum(d),
        "sum_keepdim" => x.sum_keepdim(d),
        "max" => x.max(d),
        "max_keepdim" => x.max_keepdim(d),
        "min" => x.min(d),
        "prod" => x.prod(d),
        "argmax" => x.argmax(d),
        "argmax_keepdim" => x.argmax_keepdim(d),
        "argmin" => x.argmin(d),
        "mean" => x.mean(d),
        "mean_keepdim" => x.mean_keepdim(d),
        "var" => x.var(d),
        "std" => x.std(d),
        "logsumexp" => x.logsumexp(&[d], false),
        "softmax" => x.softmax(d),
        "log_softmax" => x.log_softmax(d),
        "cumsum" => x.cumsum(d),
        "transpose" => x.transpose(d, 0),
        "squeeze" => x.squeeze(d),
        "flatten_from" => x.flatten_from(d),
        "unsqueeze" => x.unsqueeze(d),
        "stack" => Tensor::stack(&[x, x], d),
        "narrow" => x.narrow(d, 0, 1),
        "cat" => Tensor::cat(&[x, x], d),
        // Two indices, or the one a 0-d tensor takes.
        "index_select" if x.rank() == 0 => x.index_select(&Tensor::new(&[0i64], &dev)?, d),
        "index_select" => x.index_select(&Tensor::new(&[0i64, 0], &dev)?, d),
        "index_add" if x.rank() == 0 => x.index_add(&Tensor::new(&[0i64], &dev)?, &x.mul_scalar(2.0)?, d),
        "index_add" => x.index_add(&Tensor::new(&[0i64, 0], &dev)?, &Tensor::cat(&[x, x], d)?.narrow(d, 0, 2)?, d),
        other => panic!("no op {other}"),
    }
}

/// Every value bit for bit, with the dtype and shape (NaN equal to NaN).
fn bits(t: &Tensor) -> Result<(DType, Vec<usize>, Vec<u64>)> {
    Ok((t.dtype(), t.dims().to_vec(), t.to_vec_f64()?.into_iter().map(|v| if v.is_nan() { 1 } else { v.to_bits() }).collect()))
}

fn check(d: Device, rank: usize) -> Result<()> {
    // Dimensions of sizes 2, 1, 3: a squeeze has a size-1 one to remove.
    let dims = [2usize, 1, 3][..rank].to_vec();
    let n: usize = dims.iter().product();
    let x = Tensor::from_vec((0..n).map(|v| (v as f32 * 0.75) - 1.0).collect::<Vec<_>>(), dims.as_slice(), &d)?;
    for &(op, rule) in OPS {
        for dim in -5i64..=4 {
            let got = run(op, &x, dim);
            let w = resolve(rule, dim, rank);
            match (w, got) {
                (Some(w), Ok(t)) => {
                    assert_eq!(t.dims(), expected_shape(op, &dims, w).as_slice(), "{op}({dim}) on {dims:?}, {d}");
                    // The negative dimension gives exactly what its positive twin gives.
                    let twin = run(op, &x, w as i64)?;
                    assert_eq!(bits(&t)?, bits(&twin)?, "{op}({dim}) vs {op}({w}) on {dims:?}, {d}");
                    if rank == 0 && !matches!(op, "unsqueeze" | "stack" | "flatten_from") {
                        // A 0-d tensor is its own reduction, cumsum, transpose...
                        let want = match op {
                            "argmax" | "argmax_keepdim" | "argmin" => 0.0,
                            "softmax" => 1.0,
                            "log_softmax" => 0.0,
                            "var" | "std" => f64::NAN,
                            "index_add" => -3.0,
                            _ => -1.0,
                        };
                        let v = t.to_vec_f64()?[0];
                        assert!(v == want || (v.is_nan() && want.is_nan()), "{op}({dim}) of a 0-d tensor: {v}, want {want}, {d}");
                    }
                }
                (None, Err(e)) => {
                    assert!(matches!(e, Error::InvalidArgument { .. }), "{op}({dim}) on {dims:?}: {e:?}");
                    let msg = e.to_string();
                    assert!(msg.contains("out of range") || msg.contains("0-d"), "{op}({dim}) on {dims:?}: {msg}");
                }
                (Some(_), Err(e)) => panic!("{op}({dim}) on {dims:?}, {d}: PyTorch accepts it, kiln gave {e}"),
                (None, Ok(t)) => panic!("{op}({dim}) on {dims:?}, {d}: PyTorch raises IndexError, kiln gave {:?}", t.dims()),
            }
        }
    }
    // size(dim): the dimension must exist.
    for dim in -5i64..=4 {
        match (resolve(Rule::Exists, dim, rank), x.dim(dim)) {
            (Some(w), Ok(s)) => assert_eq!(s, dims[w]),
            (None, Err(Error::InvalidArgument { .. })) => {}
            (w, got) => panic!("dim({dim}) of {dims:?}: {got:?}, PyTorch {w:?}"),
        }
    }
    Ok(())
}

#[test]
fn every_dimension_of_every_op_that_takes_one() {
    on_every_device(|d| {
        for rank in 0..=3 {
            check(d, rank)?;
        }
        Ok(())
    });
}

#[test]
fn flatten_from_resolves_negative_dimensions_against_the_rank() {
    on_every_device(|d| {
        let x = Tensor::zeros((5, 3), DType::F32, &d)?;
        // torch.zeros(5, 3).flatten(-2) is [15]; flatten(-1) and flatten(1) change nothing.
        assert_eq!(x.flatten_from(-2)?.dims(), &[15]);
        assert_eq!(x.flatten_from(0)?.dims(), &[15]);
        assert_eq!(x.flatten_from(-1)?.dims(), &[5, 3]);
        assert_eq!(x.flatten_from(1)?.dims(), &[5, 3]);
        // IndexError in PyTorch: -3 and 2 are out of range for rank 2.
        for bad in [-3i64, 2, 3] {
            let e = x.flatten_from(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("rank 2"), "{bad}: {e}");
        }
        let y = Tensor::arange(0.0, 24.0, 1.0, &d)?.reshape((2, 3, 4))?;
        assert_eq!(y.flatten_from(-2)?.dims(), &[2, 12]);
        assert_eq!(y.flatten_from(-3)?.dims(), &[24]);
        assert_eq!(y.flatten_from(1)?.to_vec::<f32>()?, y.to_vec::<f32>()?);
        assert!(y.flatten_from(3).is_err() && y.flatten_from(-4).is_err());
        // A 0-d tensor: flatten(0) and flatten(-1) give [1]; 1 is out of
        // range "for a tensor of rank 1" (PyTorch wraps as if it had one).
        let s = Tensor::new(&7f32, &d)?;
        crate::common::assert_f32(&s.flatten_from(0)?, d, &[1], &[7.]);
        crate::common::assert_f32(&s.flatten_from(-1)?, d, &[1], &[7.]);
        let e = s.flatten_from(1).unwrap_err().to_string();
        assert!(e.contains("rank 1"), "{e}");
        assert!(s.flatten_from(-2).is_err());
        Ok(())
    });
}

#[test]
fn negative_dimensions_count_from_the_end() {
    on_every_device(|d| {
        let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &d)?;
        assert_eq!(x.sum(-1)?.to_vec::<f32>()?, vec![6., 15.]);
        assert_eq!(x.sum(-2)?.to_vec::<f32>()?, vec![5., 7., 9.]);
        assert_eq!(x.max_keepdim(-1)?.dims(), &[2, 1]);
        assert_eq!(x.argmin(-1)?.to_vec::<i64>()?, vec![0, 0]);
        assert_eq!(x.transpose(-1, -2)?.dims(), &[3, 2]);
        assert_eq!(x.narrow(-1, 1, 2)?.to_vec::<f32>()?, vec![2., 3., 5., 6.]);
        assert_eq!(x.unsqueeze(-1)?.dims(), &[2, 3, 1]);
        assert_eq!(x.unsqueeze(-1)?.squeeze(-1)?.dims(), &[2, 3]);
        assert_eq!(Tensor::stack(&[&x, &x], -1)?.dims(), &[2, 3, 2]);
        assert_eq!(x.dim(-1)?, 3);
        assert!(matches!(x.sum(-3), Err(Error::InvalidArgument { .. })));
        assert!(matches!(x.sum(2), Err(Error::InvalidArgument { .. })));
        Ok(())
    });
}

#[test]
fn negative_dimensions_in_lists_of_dimensions() {
    on_every_device(|d| {
        let x = Tensor::new(&[[[1f32, 2.], [3., 4.], [5., 6.]]], &d)?; // (1, 3, 2)
        assert_eq!(x.sum_dims(&[-1], false)?.dims(), &[1, 3]);
        same_f32_bits(&x.sum_dims(&[-1], false)?, &[3., 7., 11.]);
        same_f32_bits(&x.sum_dims(&[0, -2], true)?, &[9., 12.]);
        assert_eq!(x.sum_dims(&[0, -2], true)?.dims(), &[1, 1, 2]);
        same_f32_bits(&x.mean_dims(&[-1, -2], false)?, &[3.5]);
        same_f32_bits(&x.reduce(kiln::Reduction::Max, &[-2], false)?, &[5., 6.]);
        assert_eq!(x.reduce(kiln::Reduction::ArgMax, &[-1i64], false)?.to_vec::<i64>()?, vec![1, 1, 1]);
        // usize lists (and Vec<usize>) still work.
        let dims: Vec<usize> = vec![1, 2];
        same_f32_bits(&x.sum_dims(&dims, false)?, &[21.]);
        // permute: -1 is the last dimension.
        let p = x.permute(&[-1, 0, 1])?;
        assert_eq!(p.dims(), &[2, 1, 3]);
        same_f32_bits(&p.contiguous()?, &[1., 3., 5., 2., 4., 6.]);
        let m = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &d)?;
        same_f32_bits(&m.permute(&[-1, 0])?.contiguous()?, &[1., 4., 2., 5., 3., 6.]);
        // Gradients flow through a negative-dimension reduction and permute.
        let w = Tensor::new(&[[1f32, 2.], [3., 4.]], &d)?.requires_grad_();
        w.permute(&[-1, -2])?.sqr()?.sum_dims(&[-1], false)?.sum_all()?.backward()?;
        same_f32_bits(&w.grad().expect("a gradient"), &[2., 4., 6., 8.]);

        // Out of range names the rank; a dimension named twice (once negative) is refused.
        for res in
            [x.sum_dims(&[-4], false), x.mean_dims(&[3], false), x.reduce(kiln::Reduction::Min, &[0, -4], false), x.permute(&[0, 1, 3])]
        {
            match res {
                Err(e @ Error::InvalidArgument { .. }) => assert!(e.to_string().contains("rank 3"), "{e}"),
                other => panic!("expected InvalidArgument naming the rank, got {other:?}"),
            }
        }
        assert!(matches!(x.sum_dims(&[2, -1], false), Err(Error::InvalidArgument { .. })));
        assert!(matches!(x.permute(&[0, 2, -1]), Err(Error::InvalidArgument { .. })));
        assert!(matches!(x.permute(&[0, -1]), Err(Error::InvalidArgument { .. })));
        Ok(())
    });
}
