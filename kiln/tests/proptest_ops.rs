//! Property tests: elementwise ops with broadcasting, reductions, matmul,
//! permute + contiguous and cat against a naive reference, on random shapes
//! and values, on the CPU and a simulated GPU. Values are small integers, so
//! every result is exact in f32 and compared exactly.

mod common;

use kiln::{cpu, Device, Tensor};
use proptest::prelude::*;

fn devices() -> Vec<Device> {
    vec![cpu(), common::sims()[0]]
}

fn config() -> ProptestConfig {
    ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() }
}

/// Row-major strides of `dims`.
fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// The multi-index of flat position `i` in `dims`.
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

/// Flat position in an operand of shape `dims` broadcast to the output's
/// multi-index `out_idx` (numpy rules: align on the right, size 1 repeats).
fn broadcast_pos(out_idx: &[usize], dims: &[usize]) -> usize {
    let pad = out_idx.len() - dims.len();
    let st = strides(dims);
    dims.iter().enumerate().map(|(d, &n)| if n == 1 { 0 } else { out_idx[pad + d] * st[d] }).sum()
}

fn small_values(n: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec((-8i32..=8).prop_map(|v| v as f32), n)
}

/// An output shape and two shapes that broadcast to it.
fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>, Vec<usize>)> {
    prop::collection::vec(1usize..=4, 0..=4).prop_flat_map(|out| {
        let r = out.len();
        let operand = (prop::collection::vec(any::<bool>(), r), 0..=r);
        (Just(out), operand.clone(), operand).prop_map(|(out, (ml, dl), (mr, dr))| {
            let shrink = |mask: &[bool], drop: usize| -> Vec<usize> {
                out.iter().zip(mask).skip(drop).map(|(&n, &one)| if one { 1 } else { n }).collect()
            };
            let (l, r) = (shrink(&ml, dl), shrink(&mr, dr));
            // Where both operands shrank a dimension to 1 (or dropped it),
            // the broadcast is smaller than `out`.
            let rank = l.len().max(r.len());
            let at = |s: &[usize], i: usize| if i + s.len() >= rank { s[i + s.len() - rank] } else { 1 };
            let out: Vec<usize> = (0..rank).map(|i| at(&l, i).max(at(&r, i))).collect();
            (out, l, r)
        })
    })
}

/// Output shape, then shape and values of each operand.
type BroadcastCase = (Vec<usize>, Vec<usize>, Vec<f32>, Vec<usize>, Vec<f32>);

fn broadcast_case() -> impl Strategy<Value = BroadcastCase> {
    broadcast_pair().prop_flat_map(|(out, l, r)| {
        let (nl, nr) = (l.iter().product(), r.iter().product());
        (Just(out), Just(l), small_values(nl), Just(r), small_values(nr))
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn elementwise_ops_broadcast_like_numpy((out, ls, lv, rs, rv) in broadcast_case()) {
        let n: usize = out.iter().product();
        // Divisors are never zero.
        let rv_div: Vec<f32> = rv.iter().map(|&v| if v == 0.0 { 3.0 } else { v }).collect();
        type Op = (&'static str, fn(f32, f32) -> f32, fn(&Tensor, &Tensor) -> kiln::Result<Tensor>);
        let ops: [Op; 6] = [
            ("add", |a, b| a + b, |a, b| a.add(b)),
            ("sub", |a, b| a - b, |a, b| a.sub(b)),
            ("mul", |a, b| a * b, |a, b| a.mul(b)),
            ("div", |a, b| a / b, |a, b| a.div(b)),
            ("maximum", f32::max, |a, b| a.maximum(b)),
            ("minimum", f32::min, |a, b| a.minimum(b)),
        ];
        for d in devices() {
            let a = Tensor::from_slice(&lv, ls.clone(), &d).unwrap();
            for (name, f, op) in ops {
                let rvals = if name == "div" { &rv_div } else { &rv };
                let b = Tensor::from_slice(rvals, rs.clone(), &d).unwrap();
                let got = op(&a, &b).unwrap();
                prop_assert_eq!(got.dims(), &out[..]);
                prop_assert_eq!(got.device(), d);
                let expected: Vec<f32> = (0..n)
                    .map(|i| {
                        let idx = unravel(i, &out);
                        f(lv[broadcast_pos(&idx, &ls)], rvals[broadcast_pos(&idx, &rs)])
                    })
                    .collect();
                prop_assert_eq!(got.to_vec::<f32>().unwrap(), expected, "{} on {}", name, d);
            }
            let b = Tensor::from_slice(&rv, rs.clone(), &d).unwrap();
            let lt: Vec<u8> = (0..n)
                .map(|i| {
                    let idx = unravel(i, &out);
                    (lv[broadcast_pos(&idx, &ls)] < rv[broadcast_pos(&idx, &rs)]) as u8
                })
                .collect();
            prop_assert_eq!(a.lt(&b).unwrap().to_vec::<u8>().unwrap(), lt, "lt on {}", d);
        }
    }

    #[test]
    fn reductions_match_a_naive_fold(
        (dims, vals, mask, keepdim, transposed) in prop::collection::vec(1usize..=4, 1..=4).prop_flat_map(|dims| {
            let n = dims.iter().product();
            let r = dims.len();
            (Just(dims), small_values(n), prop::collection::vec(any::<bool>(), r), any::<bool>(), any::<bool>())
        })
    ) {
        let reduced: Vec<usize> = (0..dims.len()).filter(|&d| mask[d]).collect();
        // An empty list reduces every dimension, as PyTorch's sum(x, dim=[]).
        let mask = if reduced.is_empty() { vec![true; dims.len()] } else { mask };
        let kept: Vec<usize> = dims.iter().enumerate().map(|(d, &n)| if mask[d] { 1 } else { n }).collect();
        let out_dims: Vec<usize> =
            if keepdim { kept.clone() } else { dims.iter().enumerate().filter(|(d, _)| !mask[*d]).map(|(_, &n)| n).collect() };
        // Reference: fold every element into its output slot.
        let kst = strides(&kept);
        let mut sum = vec![0f32; kept.iter().product()];
        let mut max = vec![f32::NEG_INFINITY; sum.len()];
        for (i, &v) in vals.iter().enumerate() {
            let idx = unravel(i, &dims);
            let o: usize = idx.iter().enumerate().map(|(d, &j)| if mask[d] { 0 } else { j * kst[d] }).sum();
            sum[o] += v;
            max[o] = max[o].max(v);
        }
        for d in devices() {
            // The same logical tensor, either contiguous or a permuted view of
            // storage laid out in reverse dimension order.
            let x = if transposed {
                let rev: Vec<usize> = dims.iter().rev().copied().collect();
                let stored: Vec<f32> = (0..vals.len())
                    .map(|i| {
                        let idx = unravel(i, &rev);
                        let orig: Vec<usize> = idx.iter().rev().copied().collect();
                        vals[orig.iter().zip(strides(&dims)).map(|(a, b)| a * b).sum::<usize>()]
                    })
                    .collect();
                let perm: Vec<usize> = (0..dims.len()).rev().collect();
                Tensor::from_vec(stored, rev, &d).unwrap().permute(&perm).unwrap()
            } else {
                Tensor::from_slice(&vals, dims.clone(), &d).unwrap()
            };
            prop_assert_eq!(x.dims(), &dims[..]);
            let s = x.sum_dims(&reduced, keepdim).unwrap();
            prop_assert_eq!(s.dims(), &out_dims[..]);
            prop_assert_eq!(s.to_vec::<f32>().unwrap(), sum.clone(), "sum on {}", d);
            let m = x.reduce(kiln::Reduction::Max, &reduced, keepdim).unwrap();
            prop_assert_eq!(m.to_vec::<f32>().unwrap(), max.clone(), "max on {}", d);
            prop_assert_eq!(x.sum_all().unwrap().to_scalar::<f32>().unwrap(), vals.iter().sum::<f32>());
        }
    }

    #[test]
    fn matmul_matches_the_naive_triple_loop(
        (batch, m, k, n, av, bv, ta, tb) in (prop::collection::vec(1usize..=3, 0..=2), 1usize..=16, 1usize..=16, 1usize..=16)
            .prop_flat_map(|(batch, m, k, n)| {
                let nb: usize = batch.iter().product();
                (Just(batch), Just(m), Just(k), Just(n), small_values(nb * m * k), small_values(nb * k * n), any::<bool>(), any::<bool>())
            })
    ) {
        let nb: usize = batch.iter().product();
        let mut expected = vec![0f32; nb * m * n];
        for b in 0..nb {
            for i in 0..m {
                for j in 0..n {
                    expected[b * m * n + i * n + j] = (0..k).map(|p| av[b * m * k + i * k + p] * bv[b * k * n + p * n + j]).sum();
                }
            }
        }
        let dims = |r: usize, c: usize| -> Vec<usize> { batch.iter().copied().chain([r, c]).collect() };
        // A transposed operand is stored as (.., c, r) and viewed through `t()`.
        let operand = |vals: &[f32], r: usize, c: usize, transposed: bool, d: Device| -> Tensor {
            if transposed {
                let stored: Vec<f32> = (0..nb).flat_map(|b| (0..c).flat_map(move |j| (0..r).map(move |i| vals[b * r * c + i * c + j]))).collect();
                Tensor::from_vec(stored, dims(c, r), &d).unwrap().t().unwrap()
            } else {
                Tensor::from_slice(vals, dims(r, c), &d).unwrap()
            }
        };
        for d in devices() {
            let a = operand(&av, m, k, ta, d);
            let b = operand(&bv, k, n, tb, d);
            let c = a.matmul(&b).unwrap();
            prop_assert_eq!(c.dims(), &dims(m, n)[..]);
            prop_assert_eq!(c.to_vec::<f32>().unwrap(), expected.clone(), "on {} (lhs transposed {}, rhs transposed {})", d, ta, tb);
        }
    }

    #[test]
    fn permute_then_contiguous_reorders_values(
        (dims, vals, keys) in prop::collection::vec(1usize..=4, 1..=4).prop_flat_map(|dims| {
            let n = dims.iter().product();
            let r = dims.len();
            (Just(dims), small_values(n), prop::collection::vec(any::<u32>(), r))
        })
    ) {
        let mut perm: Vec<usize> = (0..dims.len()).collect();
        perm.sort_by_key(|&i| (keys[i], i));
        let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        let st = strides(&dims);
        let expected: Vec<f32> = (0..vals.len())
            .map(|i| {
                let idx = unravel(i, &out_dims);
                vals[perm.iter().enumerate().map(|(o, &p)| idx[o] * st[p]).sum::<usize>()]
            })
            .collect();
        for d in devices() {
            let x = Tensor::from_slice(&vals, dims.clone(), &d).unwrap();
            let p = x.permute(&perm).unwrap();
            prop_assert!(p.same_storage(&x));
            let c = p.contiguous().unwrap();
            prop_assert!(c.is_contiguous());
            prop_assert_eq!(c.dims(), &out_dims[..]);
            prop_assert_eq!(c.to_vec::<f32>().unwrap(), expected.clone(), "on {}", d);
            // Reading the view directly gives the same, and permuting back restores x.
            prop_assert_eq!(p.to_vec::<f32>().unwrap(), expected.clone());
            let mut inverse = vec![0; perm.len()];
            for (i, &q) in perm.iter().enumerate() {
                inverse[q] = i;
            }
            prop_assert_eq!(c.permute(&inverse).unwrap().contiguous().unwrap().to_vec::<f32>().unwrap(), vals.clone());
            if dims.len() >= 2 {
                let t = x.transpose(0, dims.len() - 1).unwrap().contiguous().unwrap();
                let tt = t.transpose(0, dims.len() - 1).unwrap().contiguous().unwrap();
                prop_assert_eq!(tt.to_vec::<f32>().unwrap(), vals.clone());
            }
        }
    }

    #[test]
    fn cat_matches_a_naive_concatenation(
        (dims, dim, sizes, vals) in (prop::collection::vec(1usize..=4, 1..=3), prop::collection::vec(0usize..=3, 1..=3))
            .prop_flat_map(|(dims, sizes)| {
                let r = dims.len();
                (Just(dims), 0..r, Just(sizes))
            })
            .prop_flat_map(|(dims, dim, sizes)| {
                let counts: Vec<usize> = sizes.iter().map(|&s| dims.iter().enumerate().map(|(d, &n)| if d == dim { s } else { n }).product()).collect();
                let vals = counts.into_iter().map(small_values).collect::<Vec<_>>();
                (Just(dims), Just(dim), Just(sizes), vals)
            })
    ) {
        let piece_dims = |s: usize| -> Vec<usize> { dims.iter().enumerate().map(|(d, &n)| if d == dim { s } else { n }).collect() };
        let total: usize = sizes.iter().sum();
        let out_dims = piece_dims(total);
        let n: usize = out_dims.iter().product();
        let expected: Vec<f32> = (0..n)
            .map(|i| {
                let mut idx = unravel(i, &out_dims);
                let mut piece = 0;
                while idx[dim] >= sizes[piece] {
                    idx[dim] -= sizes[piece];
                    piece += 1;
                }
                let pd = piece_dims(sizes[piece]);
                vals[piece][idx.iter().zip(strides(&pd)).map(|(a, b)| a * b).sum::<usize>()]
            })
            .collect();
        for d in devices() {
            let parts: Vec<Tensor> = sizes.iter().zip(&vals).map(|(&s, v)| Tensor::from_slice(v, piece_dims(s), &d).unwrap()).collect();
            let refs: Vec<&Tensor> = parts.iter().collect();
            let c = Tensor::cat(&refs, dim).unwrap();
            prop_assert_eq!(c.dims(), &out_dims[..]);
            prop_assert_eq!(c.device(), d);
            prop_assert_eq!(c.to_vec::<f32>().unwrap(), expected.clone(), "on {}", d);
        }
    }
}
