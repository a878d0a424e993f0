//! A short seeded fuzz of the CNN ops on CUDA against the CPU: conv2d and
//! conv_transpose2d (stride, padding, dilation, groups, output_padding),
//! max and average pooling, batch_norm and layer_norm, with small random
//! shapes and arguments, forward and backward, f32 and f64. Every valid
//! case must match the CPU (f64 tightly, f32 within a tolerance), every
//! refused one must be refused on both.
//!
//! Under the CUDA simulator (CI) the kernels run inside its memory checks
//! (cudasim/src/memory.rs: red zones and inaccessible pages around every
//! allocation), so a kernel that reads or writes outside its buffers fails
//! its case with the kernel's name instead of corrupting the process. It runs
//! in a child process there, so that a faulted device (a fault is sticky, as
//! on a GPU) cannot fail the tests that come after it, with
//! `KILN_CUDA_EXACT_BLOCKS=1` and `KILN_CUDASIM_TIGHT=1`, so that each tensor
//! has a driver allocation of its own size (not a 512-byte size class) that
//! ends on an inaccessible page: an overrun of one element faults, read or
//! write. On real GPUs it runs in place.

use super::*;
use crate::common::rng::{Draw, SplitMix as Rng};
use kiln::{Conv2dArgs, Pool2dArgs};

/// The fuzz's child process: each tensor in a driver allocation of its own
/// size (kiln's size classes off), placed so that it ends on an inaccessible
/// page (the simulator's 256-byte alignment off): an overrun by one element,
/// read or write, is caught.
const CHECKED: &[(&str, &str)] = &[("KILN_CUDA_EXACT_BLOCKS", "1"), ("KILN_CUDASIM_TIGHT", "1")];

const SEED: u64 = 0x6b69_6c6e_636e_6e31;
const CASES: usize = 600;

/// splitmix64.
/// The case values this suite draws.
trait Cases: Draw {
    /// Roughly normal (a sum of uniforms), never a tie in practice.
    fn normal(&mut self) -> f64 {
        (0..4).map(|_| (self.next() >> 11) as f64 / (1u64 << 53) as f64).sum::<f64>() - 2.0
    }
    fn values(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.normal()).collect()
    }
    fn pair(&mut self, lo: usize, hi: usize) -> [usize; 2] {
        [self.range(lo, hi), self.range(lo, hi)]
    }
}

impl<R: Draw> Cases for R {}

#[derive(Clone, Debug)]
enum Op {
    Conv { args: Conv2dArgs, transpose: bool, bias: bool },
    MaxPool(Pool2dArgs),
    AvgPool(Pool2dArgs),
    BatchNorm { training: bool, running: bool, weight: bool, bias: bool },
    LayerNorm { normalized: Vec<usize>, weight: bool, bias: bool },
}

/// One case: the op, the dtype, the leaves' shapes and values (gradients
/// are taken for each), other inputs (running statistics), and the seed of
/// the output's weights in the loss.
#[derive(Clone, Debug)]
struct Case {
    op: Op,
    dtype: DType,
    leaves: Vec<(Vec<usize>, Vec<f64>)>,
    others: Vec<(Vec<usize>, Vec<f64>)>,
    loss_seed: u64,
}

impl Case {
    /// conv_transpose2d with output_padding ≥ stride on some axis.
    fn output_padding_at_least_stride(&self) -> bool {
        match &self.op {
            Op::Conv { args, transpose: true, .. } => (0..2).any(|i| args.output_padding[i] >= args.stride[i]),
            _ => false,
        }
    }

    fn summary(&self) -> String {
        let shapes: Vec<&Vec<usize>> = self.leaves.iter().map(|(s, _)| s).collect();
        format!("{:?} {:?} on {shapes:?}", self.dtype, self.op)
    }
}

fn leaf(r: &mut Rng, shape: Vec<usize>) -> (Vec<usize>, Vec<f64>) {
    let n = shape.iter().product();
    (shape, r.values(n))
}

fn draw(r: &mut Rng) -> Case {
    let dtype = if r.coin(0.5) { DType::F32 } else { DType::F64 };
    let n = r.range(1, 2);
    let mut others = Vec::new();
    let (op, leaves) = match r.below(6) {
        k @ (0 | 1) => {
            let transpose = k == 1;
            let groups = r.range(1, 3);
            let (icg, ocg) = (r.range(1, 2), r.range(1, 2));
            let kernel = r.pair(1, 3);
            let stride = r.pair(1, 3);
            let dilation = r.pair(1, 2);
            let mut args = Conv2dArgs::default().stride(stride).padding(r.pair(0, 2)).dilation(dilation).groups(groups);
            if transpose {
                let limit = |i: usize| stride[i].max(dilation[i]);
                args = args.output_padding([r.below(limit(0)), r.below(limit(1))]);
            } else if r.coin(0.1) {
                args = args.same();
            }
            let c = groups * icg;
            let mut w = if transpose { vec![c, ocg, kernel[0], kernel[1]] } else { vec![groups * ocg, icg, kernel[0], kernel[1]] };
            if r.coin(0.05) {
                w[1] += 1; // the channels do not match: refused
            }
            let bias = r.coin(0.5);
            let outs = if transpose { groups * ocg } else { w[0] };
            let x = vec![n, c, r.range(1, 6), r.range(1, 6)];
            let mut leaves = vec![leaf(r, x), leaf(r, w)];
            if bias {
                leaves.push(leaf(r, vec![outs]));
            }
            (Op::Conv { args, transpose, bias }, leaves)
        }
        k @ (2 | 3) => {
            let kernel = r.pair(1, 3);
            // Padding up to half the window (more is refused: now and then).
            let pad = |r: &mut Rng, k: usize| if r.coin(0.1) { k / 2 + 1 } else { r.range(0, k / 2) };
            let padding = [pad(r, kernel[0]), pad(r, kernel[1])];
            let mut args = Pool2dArgs::new(kernel).padding(padding).ceil_mode(r.coin(0.3));
            if r.coin(0.75) {
                args = args.stride(r.pair(1, 3));
            }
            let shape = vec![n, r.range(1, 3), r.range(1, 7), r.range(1, 7)];
            let x = leaf(r, shape);
            if k == 2 {
                (Op::MaxPool(args.dilation(r.pair(1, 2))), vec![x])
            } else {
                args = args.count_include_pad(r.coin(0.5));
                if r.coin(0.2) {
                    args = args.divisor_override(Some(r.range(1, 4) as i64));
                }
                (Op::AvgPool(args), vec![x])
            }
        }
        4 => {
            let rank = r.range(2, 4);
            let c = r.range(1, 3);
            let mut shape = vec![r.range(1, 3), c];
            shape.extend((2..rank).map(|_| r.range(1, 3)));
            let training = r.coin(0.7);
            // Evaluation without running statistics is refused.
            let running = if training { r.coin(0.5) } else { r.coin(0.9) };
            let (weight, bias) = (r.coin(0.5), r.coin(0.5));
            let mut leaves = vec![leaf(r, shape)];
            if weight {
                leaves.push(leaf(r, vec![c]));
            }
            if bias {
                leaves.push(leaf(r, vec![c]));
            }
            if running {
                others.push(leaf(r, vec![c]));
                others.push((vec![c], (0..c).map(|_| 0.5 + r.normal().abs()).collect()));
            }
            (Op::BatchNorm { training, running, weight, bias }, leaves)
        }
        _ => {
            let rank = r.range(1, 4);
            let shape: Vec<usize> = (0..rank).map(|_| r.range(1, 4)).collect();
            let k = r.range(1, rank);
            let mut normalized = shape[rank - k..].to_vec();
            if r.coin(0.05) {
                normalized[0] += 1; // not a suffix of the shape: refused
            }
            let (weight, bias) = (r.coin(0.5), r.coin(0.5));
            let mut leaves = vec![leaf(r, shape)];
            if weight {
                leaves.push(leaf(r, normalized.clone()));
            }
            if bias {
                leaves.push(leaf(r, normalized.clone()));
            }
            (Op::LayerNorm { normalized, weight, bias }, leaves)
        }
    };
    Case { op, dtype, leaves, others, loss_seed: r.next() }
}

/// The case's outputs (the op's result, then the running statistics after
/// it) and the gradients of its leaves, on `d`; an error when refused.
fn eval(case: &Case, d: Device) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let make = |(shape, v): &(Vec<usize>, Vec<f64>)| -> Result<Tensor> {
        Tensor::from_vec(v.clone(), shape.clone(), &cpu())?.to_dtype(case.dtype)?.to(&d)
    };
    let leaves: Vec<Tensor> = case.leaves.iter().map(|l| make(l).map(|t| t.requires_grad_())).collect::<Result<_>>()?;
    let others: Vec<Tensor> = case.others.iter().map(make).collect::<Result<_>>()?;
    let x = &leaves[0];
    let opt = |present: bool, i: usize| present.then(|| &leaves[i]);
    let y = match &case.op {
        Op::Conv { args, transpose, bias } => {
            let b = opt(*bias, 2);
            if *transpose {
                x.conv_transpose2d(&leaves[1], b, *args)?
            } else {
                x.conv2d(&leaves[1], b, *args)?
            }
        }
        Op::MaxPool(args) => x.max_pool2d(*args)?,
        Op::AvgPool(args) => x.avg_pool2d(*args)?,
        Op::BatchNorm { training, running, weight, bias } => {
            let (rm, rv) = if *running { (Some(&others[0]), Some(&others[1])) } else { (None, None) };
            x.batch_norm(rm, rv, opt(*weight, 1), opt(*bias, 1 + *weight as usize), *training, 0.1, 1e-5)?
        }
        Op::LayerNorm { normalized, weight, bias } => x.layer_norm(normalized, opt(*weight, 1), opt(*bias, 1 + *weight as usize), 1e-5)?,
    };
    let r = Rng(case.loss_seed).values(y.elem_count());
    let r = Tensor::from_vec(r, y.dims().to_vec(), &cpu())?.to_dtype(case.dtype)?.to(&d)?;
    y.mul(&r)?.sum_all()?.backward()?;
    let _g = kiln::no_grad();
    let grads = leaves
        .iter()
        .map(|l| l.grad().ok_or_else(|| Error::InvalidArgument { op: "cnn fuzz".into(), msg: "a leaf got no gradient".into() }))
        .collect::<Result<_>>()?;
    // A kernel's fault (the simulator's guard) is reported by the next
    // synchronising call: make it this case's.
    kiln::synchronize(&d)?;
    let mut outs = vec![y];
    outs.extend(others);
    Ok((outs, grads))
}

/// Whether `got` (CUDA) matches `want` (CPU): shapes, then every value.
fn matches(got: &Tensor, want: &Tensor, tol: f64) -> std::result::Result<(), String> {
    if got.dims() != want.dims() {
        return Err(format!("shape {:?} on CUDA, {:?} on the CPU", got.dims(), want.dims()));
    }
    let (g, w) = (got.to_vec_f64().map_err(|e| e.to_string())?, want.to_vec_f64().map_err(|e| e.to_string())?);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        if !(a == b || (a - b).abs() <= tol * (1.0 + b.abs()) || (a.is_nan() && b.is_nan())) {
            return Err(format!("element {i} is {a} on CUDA, {b} on the CPU (tolerance {tol})"));
        }
    }
    Ok(())
}

/// Runs `case` on the CPU and on `d`: None when they agree (both refused
/// it, or both computed the same), else what differs.
fn check_case(case: &Case, d: Device) -> Option<String> {
    let want = eval(case, cpu());
    let got = eval(case, d);
    let tol = if case.dtype == DType::F64 { 1e-9 } else { 2e-4 };
    match (got, want) {
        (Err(_), Err(_)) => None,
        (Ok(_), Err(e)) => Some(format!("refused on the CPU ({e}) but not on CUDA")),
        (Err(e), Ok(_)) => Some(format!("failed on CUDA: {e}")),
        (Ok((go, gg)), Ok((wo, wg))) => {
            let named = |what: &str, i: usize, e: String| format!("{what} {i}: {e}");
            for (i, (g, w)) in go.iter().zip(&wo).enumerate() {
                if let Err(e) = matches(g, w, tol) {
                    return Some(named(if i == 0 { "output" } else { "running statistic" }, i, e));
                }
            }
            for (i, (g, w)) in gg.iter().zip(&wg).enumerate() {
                if let Err(e) = matches(g, w, tol) {
                    return Some(named("gradient of input", i, e));
                }
            }
            None
        }
    }
}

fn fuzz(devs: &[Device]) -> Result<()> {
    let mut r = Rng(SEED);
    let cases: Vec<Case> = (0..CASES).map(|_| draw(&mut r)).collect();
    // The class a held-out test found: the input smaller than the windows.
    let past_stride = cases.iter().filter(|c| c.output_padding_at_least_stride()).count();
    assert!(past_stride > 0, "seed {SEED:#x} draws no conv_transpose2d with output_padding >= stride");
    let mut refused = 0;
    let start = std::time::Instant::now();
    for (i, case) in cases.iter().enumerate() {
        let d = devs[i % devs.len()];
        if let Some(why) = check_case(case, d) {
            panic!("case {i} of seed {SEED:#x} on {d}: {why}\n  {}", case.summary());
        }
        refused += eval(case, cpu()).is_err() as usize;
    }
    println!(
        "{} CNN cases (seed {SEED:#x}; {past_stride} conv_transpose2d with output_padding >= stride) matched the CPU on {} CUDA device(s) in {:.1} s, {refused} of them refused on both",
        cases.len(),
        devs.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The fuzz above: on the simulator in a child process on every simulated
/// CUDA device (cases alternate between them), on real GPUs in place.
pub(crate) fn cuda_cnn_ops_fuzzed_match_the_cpu() -> Ran {
    if common::is_child() {
        return in_simulator_child(CHECKED, |_| fuzz(&cuda_devices()));
    }
    if cuda_devices().is_empty() {
        return Err(no_cuda_device());
    }
    if sim_stat("events").is_some() {
        return in_simulator_child(CHECKED, |_| fuzz(&cuda_devices()));
    }
    on_cuda("cnn fuzz", |d| fuzz(&[d]))
}
