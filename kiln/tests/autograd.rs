//! Gradients of every differentiable op against central finite differences
//! on random inputs (f64, CPU), and a composed model against gradients
//! derived by hand.

#![allow(clippy::cloned_ref_to_slice_refs)] // `&[x.clone()]` reads best in the checks

use kiln::{cpu, no_grad, DType, Device, Result, Tensor};

const EPS: f64 = 1e-6;

/// Random f64 values in [lo, hi) of `shape`, kept at least `gap` away from
/// each of `avoid` (kinks such as 0 for relu/abs).
fn input(shape: &[usize], lo: f64, hi: f64, avoid: &[f64], gap: f64) -> Tensor {
    let t = Tensor::rand_uniform(lo, hi, shape.to_vec(), DType::F64, &cpu()).unwrap();
    let mut v = t.to_vec::<f64>().unwrap();
    for x in &mut v {
        for &a in avoid {
            if (*x - a).abs() < gap {
                *x = if *x >= a { a + gap } else { a - gap };
            }
        }
    }
    Tensor::from_vec(v, shape.to_vec(), &cpu()).unwrap()
}

fn weighted_sum(out: &Tensor, r: &Tensor) -> Result<f64> {
    out.to_dtype(DType::F64)?.mul(r)?.sum_all()?.to_scalar::<f64>()
}

/// Checks d/dx_i of sum(f(x) * R) against central differences for every
/// element of every input.
fn check(name: &str, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    check_tol(name, inputs, EPS, 1e-6, f)
}

fn check_tol(name: &str, inputs: &[Tensor], eps: f64, tol: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.requires_grad_()).collect();
    let out = f(&leaves).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
    let r = Tensor::randn_with(0.0, 1.0, out.shape().clone(), DType::F64, &out.device()).unwrap();
    let loss = out.to_dtype(DType::F64).unwrap().mul(&r).unwrap().sum_all().unwrap();
    loss.backward().unwrap_or_else(|e| panic!("{name}: backward failed: {e}"));
    let _g = no_grad();
    for (i, leaf) in leaves.iter().enumerate() {
        let grad = leaf.grad().unwrap_or_else(|| panic!("{name}: input {i} got no gradient"));
        assert_eq!(grad.dims(), leaf.dims(), "{name}: gradient shape of input {i}");
        assert_eq!(grad.device(), leaf.device(), "{name}: gradient device of input {i}");
        let analytic = grad.to_vec_f64().unwrap();
        let base = inputs[i].to_vec_f64().unwrap();
        for j in 0..base.len() {
            let eval = |delta: f64| -> f64 {
                let mut v = base.clone();
                v[j] += delta;
                let t = Tensor::from_vec(v, inputs[i].dims().to_vec(), &cpu()).unwrap().to_dtype(inputs[i].dtype()).unwrap();
                let mut args: Vec<Tensor> = inputs.to_vec();
                args[i] = t.to(&inputs[i].device()).unwrap();
                weighted_sum(&f(&args).unwrap(), &r).unwrap()
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            let a = analytic[j];
            assert!(
                (a - numeric).abs() <= tol * (1.0 + numeric.abs()),
                "{name}: d/d input {i}[{j}]: autograd {a}, finite differences {numeric}"
            );
        }
    }
}

fn x34() -> Tensor {
    input(&[3, 4], -2.0, 2.0, &[0.0], 0.1)
}

fn pos34() -> Tensor {
    input(&[3, 4], 0.3, 2.0, &[], 0.0)
}

#[test]
fn unary_ops_match_finite_differences() {
    kiln::manual_seed(1);
    let x = x34();
    let p = pos34();
    type F = fn(&Tensor) -> Result<Tensor>;
    let on_any: &[(&str, F)] = &[
        ("neg", |x| x.neg()),
        ("abs", |x| x.abs()),
        ("exp", |x| x.exp()),
        ("sqr", |x| x.sqr()),
        ("recip", |x| x.recip()),
        ("sin", |x| x.sin()),
        ("cos", |x| x.cos()),
        ("tanh", |x| x.tanh()),
        ("sigmoid", |x| x.sigmoid()),
        ("relu", |x| x.relu()),
        ("powi 3", |x| x.powi(3)),
        ("powi -2", |x| x.powi(-2)),
        ("add_scalar", |x| x.add_scalar(1.5)),
        ("sub_scalar", |x| x.sub_scalar(1.5)),
        ("rsub_scalar", |x| 2.0 - x),
        ("mul_scalar", |x| x.mul_scalar(-3.0)),
        ("div_scalar", |x| x.div_scalar(4.0)),
        ("rdiv_scalar", |x| 2.0 / x),
        ("affine", |x| x.affine(0.5, -1.0)),
        ("neg operator", |x| -x),
    ];
    for (name, f) in on_any {
        check(name, &[x.clone()], |a| f(&a[0]));
    }
    let on_positive: &[(&str, F)] = &[("log", |x| x.log()), ("sqrt", |x| x.sqrt()), ("powf 2.5", |x| x.powf(2.5))];
    for (name, f) in on_positive {
        check(name, &[p.clone()], |a| f(&a[0]));
    }
    // Away from the threshold so the kink is never crossed.
    let y = input(&[3, 4], -2.0, 2.0, &[0.3], 0.1);
    check("maximum_scalar", &[y.clone()], |a| a[0].maximum_scalar(0.3));
    check("minimum_scalar", &[y.clone()], |a| a[0].minimum_scalar(0.3));
    let z = input(&[3, 4], -2.0, 2.0, &[-0.5, 0.5], 0.1);
    check("clamp", &[z], |a| a[0].clamp(-0.5, 0.5));
}

#[test]
fn binary_ops_with_broadcasting_match_finite_differences() {
    kiln::manual_seed(2);
    let a = x34();
    let row = input(&[4], -2.0, 2.0, &[0.0], 0.2);
    let col = input(&[3, 1], -2.0, 2.0, &[0.0], 0.2);
    type F = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: &[(&str, F)] = &[
        ("add", |a, b| a.add(b)),
        ("sub", |a, b| a.sub(b)),
        ("mul", |a, b| a.mul(b)),
        ("div", |a, b| a.div(b)),
        ("add operator", |a, b| a + b),
        ("mul operator", |a, b| a * b),
    ];
    for (name, f) in ops {
        check(name, &[a.clone(), a.clone().affine(0.5, 0.1).unwrap()], |t| f(&t[0], &t[1]));
        check(&format!("{name} (3,4)x(4)"), &[a.clone(), row.clone()], |t| f(&t[0], &t[1]));
        check(&format!("{name} (3,1)x(3,4)"), &[col.clone(), a.clone()], |t| f(&t[0], &t[1]));
    }
    let base = pos34();
    let expo = input(&[4], -1.5, 1.5, &[], 0.0);
    check("pow", &[base, expo], |t| t[0].pow(&t[1]));
    // maximum/minimum: operands apart so no tie is crossed.
    let b = a.add_scalar(0.0).unwrap();
    let shifted = {
        let v: Vec<f64> = b.to_vec::<f64>().unwrap().iter().enumerate().map(|(i, x)| if i % 2 == 0 { x + 0.5 } else { x - 0.5 }).collect();
        Tensor::from_vec(v, (3, 4), &cpu()).unwrap()
    };
    check("maximum", &[a.clone(), shifted.clone()], |t| t[0].maximum(&t[1]));
    check("minimum", &[a.clone(), shifted], |t| t[0].minimum(&t[1]));
    // The fused gradients of sigmoid and tanh, as ops of their own (g, y).
    let y = input(&[3, 4], -0.9, 0.9, &[], 0.0);
    for (name, op) in [("sigmoid_backward", kiln::BinaryOp::SigmoidBackward), ("tanh_backward", kiln::BinaryOp::TanhBackward)] {
        check(name, &[a.clone(), y.clone()], |t| t[0].binary(&t[1], op));
        check(&format!("{name} (3,4)x(4)"), &[a.clone(), row.clone()], |t| t[0].binary(&t[1], op));
    }
}

/// sigmoid and tanh take their gradients from the fused ops: the same
/// values, to the bit, as the composite rules g·(y·(1−y)) and g·(1−y²).
#[test]
fn sigmoid_and_tanh_gradients_are_the_composite_rules_bit_for_bit() -> Result<()> {
    kiln::manual_seed(3);
    for dtype in [DType::F32, DType::F64] {
        let x = Tensor::randn_with(0.0, 3.0, vec![257], dtype, &cpu())?;
        let g = Tensor::randn_with(0.0, 1.0, vec![257], dtype, &cpu())?;
        for tanh in [false, true] {
            let leaf = x.requires_grad_();
            let y = if tanh { leaf.tanh()? } else { leaf.sigmoid()? };
            y.mul(&g)?.sum_all()?.backward()?;
            let got = leaf.grad().expect("a gradient").to_vec_f64()?;
            let _g = no_grad();
            let y = y.detach();
            let want = if tanh {
                g.mul(&y.sqr()?.unary(kiln::UnaryOp::RSubScalar(1.0))?)?
            } else {
                g.mul(&y.mul(&y.unary(kiln::UnaryOp::RSubScalar(1.0))?)?)?
            };
            let want = want.to_vec_f64()?;
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "tanh {tanh}, {dtype:?}");
        }
    }
    Ok(())
}

#[test]
fn reductions_match_finite_differences() {
    kiln::manual_seed(3);
    let x = x34();
    check("sum_all", &[x.clone()], |a| a[0].sum_all());
    check("sum(0)", &[x.clone()], |a| a[0].sum(0));
    check("sum_keepdim(1)", &[x.clone()], |a| a[0].sum_keepdim(1));
    check("sum_dims", &[input(&[2, 3, 4], -1.0, 1.0, &[], 0.0)], |a| a[0].sum_dims(&[0, 2], false));
    check("mean_all", &[x.clone()], |a| a[0].mean_all());
    check("mean(1)", &[x.clone()], |a| a[0].mean(1));
    // Random values have no ties, so max/min have a unique argmax.
    check("max(1)", &[x.clone()], |a| a[0].max(1));
    check("min(0)", &[x.clone()], |a| a[0].min(0));
    check("max_keepdim(0)", &[x.clone()], |a| a[0].max_keepdim(0));
    check("max_all", &[x.clone()], |a| a[0].max_all());
    check("min_all", &[x.clone()], |a| a[0].min_all());
    check("norm", &[x], |a| a[0].norm());
}

#[test]
fn matmul_matches_finite_differences() {
    kiln::manual_seed(4);
    let a = input(&[3, 4], -1.0, 1.0, &[], 0.0);
    let b = input(&[4, 5], -1.0, 1.0, &[], 0.0);
    check("matmul 2-D", &[a.clone(), b.clone()], |t| t[0].matmul(&t[1]));
    let batched = input(&[2, 3, 4], -1.0, 1.0, &[], 0.0);
    check("matmul batched x shared", &[batched.clone(), b.clone()], |t| t[0].matmul(&t[1]));
    let b2 = input(&[2, 4, 5], -1.0, 1.0, &[], 0.0);
    check("matmul batched x batched", &[batched, b2], |t| t[0].matmul(&t[1]));
    let v = input(&[4], -1.0, 1.0, &[], 0.0);
    check("matmul matrix x vector", &[a.clone(), v.clone()], |t| t[0].matmul(&t[1]));
    check("matmul vector x vector", &[v.clone(), v.affine(2.0, 0.1).unwrap()], |t| t[0].matmul(&t[1]));
    check("matmul with a transposed view", &[a.clone(), input(&[5, 4], -1.0, 1.0, &[], 0.0)], |t| t[0].matmul(&t[1].t()?));
}

#[test]
fn views_and_data_movement_match_finite_differences() {
    kiln::manual_seed(5);
    let x = x34();
    check("reshape", &[x.clone()], |a| a[0].reshape((2, 6)));
    check("transpose", &[x.clone()], |a| a[0].transpose(0, 1)?.mul(&Tensor::arange_dtype(1.0, 4.0, 1.0, DType::F64, &cpu())?));
    check("t + contiguous", &[x.clone()], |a| a[0].t()?.contiguous());
    check("permute", &[input(&[2, 3, 4], -1.0, 1.0, &[], 0.0)], |a| a[0].permute(&[2, 0, 1]));
    check("narrow", &[x.clone()], |a| a[0].narrow(1, 1, 2));
    check("slice", &[x.clone()], |a| a[0].slice(0, 1..3));
    check("get", &[x.clone()], |a| a[0].get(2));
    check("squeeze/unsqueeze", &[x.clone()], |a| a[0].unsqueeze(1)?.squeeze(1));
    check("flatten_all", &[x.clone()], |a| a[0].flatten_all());
    check("broadcast_to", &[input(&[4], -1.0, 1.0, &[], 0.0)], |a| a[0].broadcast_to((3, 4)));
    let ids = Tensor::new(&[2i64, 0, 2, 1], &cpu()).unwrap();
    check("index_select (repeated rows)", &[x.clone()], |a| a[0].index_select(&ids, 0));
    check("index_select dim 1", &[x.clone()], |a| a[0].index_select(&ids, 1));
    let y = input(&[2, 4], -1.0, 1.0, &[], 0.0);
    check("cat dim 0", &[x.clone(), y.clone()], |a| Tensor::cat(&[&a[0], &a[1]], 0));
    check("cat dim 1", &[x.clone(), input(&[3, 2], -1.0, 1.0, &[], 0.0)], |a| Tensor::cat(&[&a[0], &a[1]], 1));
    check("stack", &[x.clone(), x.affine(-1.0, 0.5).unwrap()], |a| Tensor::stack(&[&a[0], &a[1]], 1));
    let cond = Tensor::new(&[[1u8, 0, 1, 0], [0, 0, 1, 1], [1, 1, 0, 0]], &cpu()).unwrap();
    check("where_cond", &[x.clone(), x.affine(3.0, 1.0).unwrap()], |a| cond.where_cond(&a[0], &a[1]));
    check("where_cond broadcast", &[x.clone(), input(&[4], -1.0, 1.0, &[], 0.0)], |a| cond.where_cond(&a[0], &a[1]));
    // f32 -> f64: an f32 input needs a coarser step; a quadratic is exact.
    let x32 = x.to_dtype(DType::F32).unwrap();
    check_tol("to_dtype f32 -> f64", &[x32], 1e-2, 1e-4, |a| a[0].to_dtype(DType::F64)?.sqr());
}

#[test]
fn losses_match_finite_differences() {
    kiln::manual_seed(6);
    let logits = input(&[4, 3], -2.0, 2.0, &[], 0.0);
    let labels = Tensor::new(&[0i64, 2, 1, 2], &cpu()).unwrap();
    check("log_softmax", &[logits.clone()], |a| kiln::nn::log_softmax(&a[0], -1));
    check("cross_entropy", &[logits.clone()], |a| kiln::nn::cross_entropy(&a[0], &labels));
    let target = input(&[4, 3], -1.0, 1.0, &[], 0.0);
    check("mse_loss", &[logits, target], |a| kiln::nn::mse_loss(&a[0], &a[1]));
}

#[test]
fn gradients_flow_across_devices_and_stay_on_each_leaf_device() {
    let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
    kiln::manual_seed(7);
    let x = x34();
    // On a simulated GPU: the op runs there, the gradient lands there.
    let on_gpu = x.to(&gpus[0]).unwrap();
    check("tanh on gpu", &[on_gpu.clone()], |a| a[0].tanh());
    check("matmul on gpu", &[on_gpu.clone(), input(&[4, 2], -1.0, 1.0, &[], 0.0).to(&gpus[0]).unwrap()], |a| a[0].matmul(&a[1]));
    // A copy between devices is differentiable: d/dx of (x on gpu(1)) comes back to the CPU.
    check("to(gpu) then sqr", &[x.clone()], |a| a[0].to(&gpus[1])?.sqr()?.to(&Device::Cpu));
}

#[test]
fn composed_model_matches_hand_derived_gradients() -> Result<()> {
    // A two-layer network: h = sigmoid(X W1ᵀ + b1), o = h W2ᵀ + b2,
    // L = mean((o - y)²), with gradients derived by hand on the host.
    let (n, d, hdim) = (5usize, 3usize, 4usize);
    kiln::manual_seed(8);
    let x = Tensor::randn_with(0.0, 1.0, (n, d), DType::F64, &cpu())?;
    let y = Tensor::randn_with(0.0, 1.0, (n, 1), DType::F64, &cpu())?;
    let w1 = Tensor::randn_with(0.0, 0.5, (hdim, d), DType::F64, &cpu())?.requires_grad_();
    let b1 = Tensor::randn_with(0.0, 0.5, hdim, DType::F64, &cpu())?.requires_grad_();
    let w2 = Tensor::randn_with(0.0, 0.5, (1, hdim), DType::F64, &cpu())?.requires_grad_();
    let b2 = Tensor::randn_with(0.0, 0.5, 1, DType::F64, &cpu())?.requires_grad_();
    let h = x.matmul(&w1.t()?)?.add(&b1)?.sigmoid()?;
    let o = h.matmul(&w2.t()?)?.add(&b2)?;
    let loss = o.sub(&y)?.sqr()?.mean_all()?;
    loss.backward()?;
    assert!(x.grad().is_none() && !x.requires_grad(), "data never gets a gradient");

    let (xv, yv) = (x.to_vec::<f64>()?, y.to_vec::<f64>()?);
    let (w1v, b1v, w2v, b2v) = (w1.to_vec::<f64>()?, b1.to_vec::<f64>()?, w2.to_vec::<f64>()?, b2.to_vec::<f64>()?);
    let (mut gw1, mut gb1, mut gw2, mut gb2) = (vec![0.0; hdim * d], vec![0.0; hdim], vec![0.0; hdim], 0.0);
    let mut l = 0.0;
    for i in 0..n {
        let hv: Vec<f64> = (0..hdim)
            .map(|j| {
                let z: f64 = (0..d).map(|k| xv[i * d + k] * w1v[j * d + k]).sum::<f64>() + b1v[j];
                1.0 / (1.0 + (-z).exp())
            })
            .collect();
        let ov: f64 = (0..hdim).map(|j| hv[j] * w2v[j]).sum::<f64>() + b2v[0];
        let r = ov - yv[i];
        l += r * r / n as f64;
        let dout = 2.0 * r / n as f64; // dL/do
        gb2 += dout;
        for j in 0..hdim {
            gw2[j] += dout * hv[j];
            let dz = dout * w2v[j] * hv[j] * (1.0 - hv[j]);
            gb1[j] += dz;
            for k in 0..d {
                gw1[j * d + k] += dz * xv[i * d + k];
            }
        }
    }
    let close = |a: &[f64], b: &[f64], what: &str| {
        assert_eq!(a.len(), b.len());
        for (p, q) in a.iter().zip(b) {
            assert!((p - q).abs() < 1e-12, "{what}: autograd {p}, by hand {q}");
        }
    };
    close(&[loss.to_scalar::<f64>()?], &[l], "loss");
    close(&w1.grad().unwrap().to_vec::<f64>()?, &gw1, "dW1");
    close(&b1.grad().unwrap().to_vec::<f64>()?, &gb1, "db1");
    close(&w2.grad().unwrap().to_vec::<f64>()?, &gw2, "dW2");
    close(&b2.grad().unwrap().to_vec::<f64>()?, &[gb2], "db2");
    Ok(())
}

#[test]
fn gradients_accumulate_until_zeroed_and_no_grad_records_nothing() -> Result<()> {
    let w = Tensor::new(&[1f32, 2.], &cpu())?.requires_grad_();
    w.sqr()?.sum_all()?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![2., 4.]);
    w.sqr()?.sum_all()?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![4., 8.], "a second backward adds");
    w.zero_grad();
    assert!(w.grad().is_none());
    // A tensor used twice gets both contributions: d(w·w + 3w)/dw = 2w + 3.
    w.mul(&w)?.add(&w.mul_scalar(3.0)?)?.sum_all()?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![5., 7.]);
    {
        let _g = no_grad();
        let y = w.mul_scalar(2.0)?;
        assert!(!y.requires_grad());
        assert!(y.backward().is_err(), "nothing was recorded");
    }
    let d = w.detach();
    assert!(!d.requires_grad() && d.same_storage(&w));
    // backward needs one element.
    assert!(matches!(w.mul_scalar(1.0)?.backward(), Err(kiln::Error::InvalidArgument { .. })));
    // set_grad replaces (what clipping uses).
    w.set_grad(Some(Tensor::new(&[0.5f32, 0.5], &cpu())?))?;
    assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![0.5, 0.5]);
    Ok(())
}
