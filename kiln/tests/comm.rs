//! Collectives (`kiln::comm`): each checked against the same computation
//! done on one device, for every dtype, on groups of 2, 3 and 4 simulated
//! GPUs (the simulated ring), a CPU with a simulated GPU and two CPU-less
//! groups of mixed kinds (peer copies), and the CUDA devices present; plus
//! the errors, the transfer guard, the ledger, asynchrony and memory.

#[path = "common/mod.rs"]
mod common;

use kiln::comm::{self, ReduceOp};
use kiln::{DType, Device, Direction, Error, GuardLevel, Result, Tensor};

/// Four simulated GPUs of this binary's own, 256 MiB each, shared by the
/// tests that run beside each other.
fn sims() -> &'static [Device] {
    &all_sims()[..4]
}

/// The four, and two more that only the test measuring memory uses (it
/// fills one: a test beside it on the same device would see memory that is
/// not its own, or run out).
fn all_sims() -> &'static [Device] {
    common::own_sims(6, 256 << 20)
}

/// The groups every collective is checked on: ring groups of 2, 3 and 4
/// simulated GPUs (and one in another order), a CPU with a simulated GPU,
/// and the CUDA devices when there are two or more.
fn groups() -> Vec<Vec<Device>> {
    let s = sims();
    let mut g = vec![s[..2].to_vec(), s[..3].to_vec(), s.to_vec(), vec![s[2], s[0], s[3]], vec![kiln::cpu(), s[1]], vec![s[0]]];
    let cuda = common::cuda_devices();
    if cuda.len() >= 2 {
        g.push(cuda.clone());
        g.push(vec![cuda[0], s[0]]);
    }
    g
}

const DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::I32, DType::U8];

/// Rank r's data: small integers (exact in every dtype and in any order of
/// summation), different per rank, with a NaN-free pattern.
fn data(rank: usize, len: usize, dtype: DType) -> Vec<f64> {
    (0..len)
        .map(|i| {
            let v = ((i * 7 + rank * 13) % 11) as f64;
            if dtype == DType::U8 {
                v
            } else {
                v - 5.0
            }
        })
        .collect()
}

fn tensor(values: &[f64], dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::from_vec(values.to_vec(), values.len(), &device)?.to_dtype(dtype)
}

fn reference(parts: &[Vec<f64>], op: ReduceOp, dtype: DType) -> Vec<f64> {
    let mut out = parts[0].clone();
    for p in &parts[1..] {
        for (o, v) in out.iter_mut().zip(p) {
            *o = match op {
                ReduceOp::Sum | ReduceOp::Mean => *o + v,
                ReduceOp::Max => o.max(*v),
                ReduceOp::Min => o.min(*v),
                _ => unreachable!(),
            };
        }
    }
    if dtype == DType::U8 && matches!(op, ReduceOp::Sum) {
        out.iter_mut().for_each(|v| *v = (*v as u64 % 256) as f64);
    }
    if op == ReduceOp::Mean {
        out.iter_mut().for_each(|v| *v /= parts.len() as f64);
    }
    out
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap_or_else(|e| panic!("reading from {}: {e}", t.device()))
}

#[track_caller]
fn check(what: &str, group: &[Device], dtype: DType, got: &Tensor, device: Device, expected: &[f64]) {
    assert_eq!(got.device(), device, "{what} on {group:?} {dtype}: result device");
    assert_eq!(got.dtype(), dtype, "{what} on {group:?}: dtype");
    let v = values(got);
    let tol = match dtype {
        DType::BF16 | DType::F16 => 0.01,
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        _ => 0.0,
    };
    assert_eq!(v.len(), expected.len(), "{what} on {group:?} {dtype}: length");
    for (i, (a, b)) in v.iter().zip(expected).enumerate() {
        assert!((a - b).abs() <= tol * b.abs().max(1.0), "{what} on {group:?} {dtype}: element {i} is {a}, expected {b}");
    }
}

/// A mean of f16 whose sum leaves f16's range (its largest is 65,504) but
/// whose mean does not: summed in f32 and rounded once, so finite, in every
/// call that means, on every group (NCCL's too). (bf16 has f32's range:
/// widening it buys one rounding, not range.)
#[test]
fn a_half_mean_whose_sum_overflows_is_finite() -> Result<()> {
    for group in groups().into_iter().filter(|g| g.len() >= 2) {
        {
            let (dtype, big) = (DType::F16, 40000.0);
            let parts = || -> Result<Vec<Tensor>> { group.iter().map(|d| Tensor::full(big, 4, dtype, d)).collect() };
            let want = vec![big; 4];
            let what = |call: &str| format!("{call} mean of {dtype} on {group:?}");
            for t in comm::all_reduce(&parts()?, ReduceOp::Mean)? {
                check(&what("all_reduce"), &group, dtype, &t, t.device(), &want);
            }
            let inputs = parts()?;
            comm::all_reduce_(&inputs, ReduceOp::Mean)?;
            for t in &inputs {
                check(&what("all_reduce_"), &group, dtype, t, t.device(), &want);
            }
            let root = comm::reduce(&parts()?, group.len() - 1, ReduceOp::Mean)?;
            check(&what("reduce"), &group, dtype, &root, group[group.len() - 1], &want);
            let blocks = comm::reduce_scatter(
                &group.iter().map(|d| Tensor::full(big, 2 * group.len(), dtype, d)).collect::<Result<Vec<_>>>()?,
                ReduceOp::Mean,
            )?;
            for (r, t) in blocks.iter().enumerate() {
                check(&what("reduce_scatter"), &group, dtype, t, group[r], &[big; 2]);
            }
        }
    }
    Ok(())
}

#[test]
fn every_collective_equals_the_one_device_computation_for_every_dtype_and_group() -> Result<()> {
    for group in groups() {
        let n = group.len();
        for dtype in DTYPES {
            for len in [0usize, 1, 5, 7, 64, 1001] {
                let host: Vec<Vec<f64>> = (0..n).map(|r| data(r, len, dtype)).collect();
                let parts = || -> Result<Vec<Tensor>> { group.iter().zip(&host).map(|(d, h)| tensor(h, dtype, *d)).collect() };
                let ops: &[ReduceOp] = if dtype.is_float() {
                    &[ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min]
                } else {
                    &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]
                };
                for &op in ops {
                    let expected = reference(&host, op, dtype);
                    let inputs = parts()?;
                    let out = comm::all_reduce(&inputs, op)?;
                    for (r, t) in out.iter().enumerate() {
                        check(&format!("all_reduce {op:?} len {len}"), &group, dtype, t, group[r], &expected);
                        check("all_reduce leaves its inputs", &group, dtype, &inputs[r], group[r], &host[r]);
                    }
                    let inputs = parts()?;
                    comm::all_reduce_(&inputs, op)?;
                    for (r, t) in inputs.iter().enumerate() {
                        check(&format!("all_reduce_ {op:?} len {len}"), &group, dtype, t, group[r], &expected);
                    }
                    for root in 0..n {
                        let r = comm::reduce(&parts()?, root, op)?;
                        check(&format!("reduce {op:?} root {root}"), &group, dtype, &r, group[root], &expected);
                    }
                }
                for (root, want) in host.iter().enumerate() {
                    let inputs = parts()?;
                    comm::broadcast_(&inputs, root)?;
                    for (r, t) in inputs.iter().enumerate() {
                        check(&format!("broadcast_ root {root} len {len}"), &group, dtype, t, group[r], want);
                    }
                }
                let gathered: Vec<f64> = host.concat();
                for (r, t) in comm::all_gather(&parts()?)?.iter().enumerate() {
                    check(&format!("all_gather len {len}"), &group, dtype, t, group[r], &gathered);
                }
                // reduce_scatter: each rank's input is n blocks of len.
                let big: Vec<Vec<f64>> = (0..n).map(|r| data(r + 1, n * len, dtype)).collect();
                let inputs: Vec<Tensor> = group.iter().zip(&big).map(|(d, h)| tensor(h, dtype, *d)).collect::<Result<_>>()?;
                let sum = reference(&big, ReduceOp::Sum, dtype);
                for (r, t) in comm::reduce_scatter(&inputs, ReduceOp::Sum)?.iter().enumerate() {
                    check(&format!("reduce_scatter len {len}"), &group, dtype, t, group[r], &sum[r * len..(r + 1) * len]);
                }
                let everywhere = comm::broadcast(&parts()?[0], &group)?;
                for (r, t) in everywhere.iter().enumerate() {
                    check("broadcast", &group, dtype, t, group[r], &host[0]);
                }
            }
        }
        common::report_ran(group[0]);
    }
    Ok(())
}

#[test]
fn random_float_sums_are_bit_identical_on_every_device_and_close_to_the_reference() -> Result<()> {
    kiln::manual_seed(3);
    for group in groups().into_iter().filter(|g| g.len() > 1) {
        for dtype in [DType::F32, DType::F64] {
            let inputs: Vec<Tensor> =
                group.iter().map(|d| Tensor::randn(4099, d).and_then(|t| t.to_dtype(dtype))).collect::<Result<_>>()?;
            let host: Vec<Vec<f64>> = inputs.iter().map(values).collect();
            let out = comm::all_reduce(&inputs, ReduceOp::Sum)?;
            let first = values(&out[0]);
            for t in &out[1..] {
                assert!(values(t).iter().zip(&first).all(|(a, b)| a.to_bits() == b.to_bits()), "{group:?} {dtype}: devices disagree");
            }
            let expected = reference(&host, ReduceOp::Sum, dtype);
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
            for (a, b) in first.iter().zip(&expected) {
                assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{group:?} {dtype}: {a} vs {b}");
            }
        }
    }
    Ok(())
}

#[test]
fn a_nan_wins_max_and_min_and_integer_sums_wrap() -> Result<()> {
    for group in groups().into_iter().filter(|g| g.len() > 1) {
        let n = group.len();
        let parts: Vec<Tensor> = group
            .iter()
            .enumerate()
            .map(|(r, d)| Tensor::new(&[if r == n - 1 { f32::NAN } else { 1.0 }, r as f32, -(r as f32)], d))
            .collect::<Result<_>>()?;
        for op in [ReduceOp::Max, ReduceOp::Min] {
            for t in comm::all_reduce(&parts, op)? {
                let v = t.to_vec::<f32>()?;
                assert!(v[0].is_nan(), "{op:?} on {group:?}: {v:?}");
                assert_eq!(v[1..], if op == ReduceOp::Max { [(n - 1) as f32, 0.] } else { [0., -((n - 1) as f32)] });
            }
        }
        let bytes: Vec<Tensor> = group.iter().map(|d| Tensor::new(&[200u8, 1], d)).collect::<Result<_>>()?;
        let sum = comm::all_reduce(&bytes, ReduceOp::Sum)?;
        assert_eq!(sum[n - 1].to_vec::<u8>()?, vec![((200 * n) % 256) as u8, n as u8], "{group:?}");
    }
    Ok(())
}

#[test]
fn non_contiguous_inputs_are_read_and_written_through_their_views() -> Result<()> {
    for group in groups() {
        let parts: Vec<Tensor> = group
            .iter()
            .enumerate()
            .map(|(r, d)| Tensor::arange(0., 6., 1., d).and_then(|t| t.add_scalar(r as f64)?.reshape((2, 3))?.t()))
            .collect::<Result<_>>()?;
        let n = group.len() as f32;
        let offset: f32 = (0..group.len()).map(|r| r as f32).sum();
        let expected: Vec<f32> = [0., 3., 1., 4., 2., 5.].iter().map(|v| v * n + offset).collect();
        for t in comm::all_reduce(&parts, ReduceOp::Sum)? {
            assert_eq!(t.to_vec::<f32>()?, expected, "{group:?}");
        }
        comm::all_reduce_(&parts, ReduceOp::Sum)?;
        for t in &parts {
            assert_eq!((t.dims(), t.to_vec::<f32>()?), (&[3, 2][..], expected.clone()), "{group:?}");
        }
    }
    Ok(())
}

#[test]
fn scatter_gather_and_split_batch_cut_as_pytorch_and_carry_gradients() -> Result<()> {
    let group = &sims()[..3];
    let x = Tensor::arange(0., 10., 1., &kiln::cpu())?.reshape((5, 2))?.requires_grad_();
    let pieces = comm::scatter(&x, group, None)?;
    // torch.chunk(5 rows, 3) = 2, 2, 1.
    assert_eq!(pieces.iter().map(|p| p.dims()[0]).collect::<Vec<_>>(), vec![2, 2, 1]);
    assert_eq!(pieces.iter().map(|p| p.device()).collect::<Vec<_>>(), group.to_vec());
    // Fewer pieces than devices for a small batch: 5 rows over 4 devices.
    assert_eq!(comm::scatter(&x, &sims()[..4], None)?.iter().map(|p| p.dims()[0]).collect::<Vec<_>>(), vec![2, 2, 1]);
    assert_eq!(comm::scatter(&x.narrow(0, 0, 0)?, group, None)?.len(), 3);
    let sized = comm::scatter(&x, group, Some(&[0, 4, 1]))?;
    assert_eq!(sized[1].to_vec::<f32>()?, vec![0., 1., 2., 3., 4., 5., 6., 7.]);
    assert!(comm::scatter(&x, group, Some(&[1, 1])).is_err());
    assert!(comm::scatter(&x, group, Some(&[1, 1, 1])).is_err());
    let back = comm::gather(&pieces, &kiln::cpu())?;
    assert_eq!(back.to_vec::<f32>()?, x.to_vec::<f32>()?);
    back.mul_scalar(3.)?.sum_all()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![3.; 10]);
    let y = Tensor::new(&[0i64, 1, 2, 3, 4], &kiln::cpu())?;
    let (xs, ys) = comm::split_batch(&x.detach(), &y, &group[..2])?;
    assert_eq!((xs[1].dims(), ys[1].to_vec::<i64>()?), (&[2, 2][..], vec![3, 4]));
    assert!(comm::split_batch(&x, &y.narrow(0, 0, 4)?, group).is_err());
    Ok(())
}

#[test]
fn the_books_allreduce_sums_into_every_tensor() -> Result<()> {
    for group in groups() {
        let data: Vec<Tensor> =
            group.iter().enumerate().map(|(i, d)| Tensor::full((i + 1) as f64, (1, 2), DType::F32, d)).collect::<Result<_>>()?;
        comm::allreduce(&data)?;
        let total = (1..=group.len()).sum::<usize>() as f32;
        for (t, d) in data.iter().zip(&group) {
            common::assert_f32(t, *d, &[1, 2], &[total, total]);
        }
    }
    Ok(())
}

#[test]
fn malformed_groups_are_typed_errors_that_change_nothing() -> Result<()> {
    let s = sims();
    let a = Tensor::ones(4, DType::F32, &s[0])?;
    let b = Tensor::ones(4, DType::F32, &s[1])?;
    assert!(matches!(comm::all_reduce(&[], ReduceOp::Sum), Err(Error::InvalidArgument { .. })));
    let dup = comm::all_reduce_(&[a.clone(), a.clone()], ReduceOp::Sum).unwrap_err();
    assert!(dup.to_string().contains("both on gpu"), "{dup}");
    assert!(matches!(comm::all_reduce(&[a.clone(), b.to_dtype(DType::F64)?], ReduceOp::Sum), Err(Error::DTypeMismatch { .. })));
    assert!(matches!(comm::all_reduce(&[a.clone(), Tensor::ones(5, DType::F32, &s[1])?], ReduceOp::Sum), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(comm::reduce(&[a.clone(), b.clone()], 2, ReduceOp::Sum), Err(Error::InvalidArgument { .. })));
    assert!(matches!(comm::broadcast_(&[a.clone(), b.clone()], 5), Err(Error::InvalidArgument { .. })));
    let ints = [Tensor::ones(2, DType::I64, &s[0])?, Tensor::ones(2, DType::I64, &s[1])?];
    assert!(matches!(comm::all_reduce(&ints, ReduceOp::Mean), Err(Error::UnsupportedDType { .. })));
    assert!(matches!(
        comm::reduce_scatter(&[Tensor::ones(3, DType::F32, &s[0])?, Tensor::ones(3, DType::F32, &s[1])?], ReduceOp::Sum),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(comm::all_gather(&[Tensor::ones((), DType::F32, &s[0])?, Tensor::ones((), DType::F32, &s[1])?]).is_err());
    assert!(matches!(comm::broadcast(&a, &[s[0], kiln::gpu(999)]), Err(Error::NoSuchDevice { .. })));
    assert!(comm::broadcast(&a, &[s[1], s[1]]).is_err());
    assert!(comm::broadcast(&a, &[]).is_err());
    assert_eq!((a.to_vec::<f32>()?, b.to_vec::<f32>()?), (vec![1.; 4], vec![1.; 4]));
    Ok(())
}

#[test]
fn the_transfer_guard_refuses_before_anything_moves_and_the_ledger_books_the_ring() -> Result<()> {
    let s = &sims()[..2];
    let parts = [Tensor::ones(1000, DType::F32, &s[0])?, Tensor::full(2., 1000, DType::F32, &s[1])?];
    {
        let _guard = kiln::transfer_guard_for(Direction::DeviceToDevice, GuardLevel::Disallow);
        let before = kiln::thread_transfer_stats();
        assert!(matches!(comm::all_reduce_(&parts, ReduceOp::Sum), Err(Error::TransferDisallowed { .. })));
        assert!(matches!(comm::all_reduce(&parts, ReduceOp::Sum), Err(Error::TransferDisallowed { .. })));
        assert!(matches!(comm::broadcast_(&parts, 0), Err(Error::TransferDisallowed { .. })));
        assert_eq!(kiln::thread_transfer_stats().since(&before).total().count, 0);
    }
    assert_eq!(parts[0].to_vec::<f32>()?, vec![1.; 1000]);
    assert_eq!(parts[1].to_vec::<f32>()?, vec![2.; 1000]);
    let before = kiln::thread_transfer_stats();
    let line = line!() + 1;
    comm::all_reduce_(&parts, ReduceOp::Sum)?;
    let moved = kiln::thread_transfer_stats().since(&before);
    // Two ranks: each link carries one chunk of 500 in each phase.
    let d2d = moved.direction(Direction::DeviceToDevice);
    assert_eq!((d2d.count, d2d.bytes), (2, 2 * 2 * 500 * 4));
    assert!(moved.by_site.keys().all(|(site, _)| site.contains(&format!("comm.rs:{line}:"))), "{:?}", moved.by_site);
    assert_eq!(parts[1].to_vec::<f32>()?, vec![3.; 1000]);
    Ok(())
}

#[test]
fn collectives_return_before_they_run_and_the_next_read_waits() -> Result<()> {
    let s = &sims()[..2];
    let parts = [Tensor::ones(10, DType::F32, &s[0])?, Tensor::ones(10, DType::F32, &s[1])?];
    let out = {
        let _hold = kiln::hold_queue(&s[0])?;
        // Queued behind the held queue: returns at once all the same.
        comm::all_reduce(&parts, ReduceOp::Sum)?
    };
    assert_eq!(out[1].to_vec::<f32>()?, vec![2.; 10]);
    Ok(())
}

#[test]
fn memory_returns_to_its_baseline_and_a_staging_buffer_that_does_not_fit_queues_nothing() -> Result<()> {
    let s = &all_sims()[4..6];
    kiln::synchronize(&s[0])?;
    let base: Vec<usize> = s.iter().map(|d| d.memory_stats().map(|m| m.in_use)).collect::<Result<_>>()?;
    {
        let parts = [Tensor::ones(1 << 16, DType::F32, &s[0])?, Tensor::ones(1 << 16, DType::F32, &s[1])?];
        for _ in 0..3 {
            comm::all_reduce_(&parts, ReduceOp::Sum)?;
            let _ = comm::all_reduce(&parts, ReduceOp::Max)?;
        }
        assert_eq!(parts[0].to_vec::<f32>()?[0], 8.);
    }
    for d in s {
        kiln::synchronize(d)?;
    }
    let after: Vec<usize> = s.iter().map(|d| d.memory_stats().map(|m| m.in_use)).collect::<Result<_>>()?;
    assert_eq!(after, base);
    // Fill the second device: the ring's staging buffer there cannot be made.
    let cap = s[1].memory_stats()?.capacity.unwrap();
    let parts = [Tensor::ones(16 << 20, DType::F32, &s[0])?, Tensor::ones(16 << 20, DType::F32, &s[1])?];
    let free = cap - s[1].memory_stats()?.in_use;
    let ballast = Tensor::zeros((free - (1 << 20)) / 4, DType::F32, &s[1])?;
    assert!(matches!(comm::all_reduce_(&parts, ReduceOp::Sum), Err(Error::OutOfMemory { .. })));
    assert_eq!(parts[1].to_vec::<f32>()?[..3], [1., 1., 1.]);
    drop(ballast);
    comm::all_reduce_(&parts, ReduceOp::Sum)?;
    assert_eq!(parts[1].to_vec::<f32>()?[..3], [2., 2., 2.]);
    Ok(())
}
