//! The multi-GPU cells of the chapter as tests, on two simulated GPUs: where
//! tensors live, what mixing devices does, what `to` and `copy_to` share, and
//! the transfer ledger and guard that make every copy visible.

mod common;

use kiln::data::synthetic_regression;
use kiln::nn::{Linear, Loss, Module, Sequential};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::Result;
use kiln::{
    cpu, default_device, default_device_scope, gpu, num_gpus, thread_transfer_stats, transfer_guard, transfer_guard_for, try_all_gpus,
    try_gpu, why_not_gpu, DType, Device, DeviceKind, Direction, Error, FallbackReason, GuardLevel, Tensor, TransferCount, TransferStats,
};

/// gpu(0) and gpu(1) of the chapter: the first two simulated GPUs.
fn two_gpus() -> (Device, Device) {
    let sims = common::sims();
    (sims[0], sims[1])
}

/// The one pair booked in `diff`, with its count and bytes.
#[track_caller]
fn only_pair(diff: &TransferStats) -> ((Direction, Device, Device), TransferCount) {
    assert_eq!(diff.by_pair.len(), 1, "expected one kind of transfer, got {diff:?}");
    let (k, c) = diff.by_pair.iter().next().expect("one pair");
    (*k, *c)
}

/// Asserts that the transfers in `diff` were booked at exactly these lines
/// of this file (a line may hold several call sites, at different columns).
#[track_caller]
fn sites_are(diff: &TransferStats, lines: &[u32]) {
    let mut expected = lines.to_vec();
    expected.sort();
    assert_eq!(common::booked_lines(diff, file!()), expected, "lines of the booked call sites");
}

#[test]
fn chapter_cells_on_two_gpus() {
    let (g0, g1) = two_gpus();
    let before = thread_transfer_stats();

    // X = torch.ones(2, 3, device=try_gpu()); Y = torch.rand(2, 3, device=try_gpu(1))
    let x = Tensor::ones((2, 3), DType::F32, &g0).unwrap();
    kiln::manual_seed(3);
    let y = Tensor::rand((2, 3), &g1).unwrap();
    assert_eq!((x.device(), y.device()), (g0, g1));
    // Creating on a device transfers nothing.
    assert_eq!(thread_transfer_stats().since(&before).total(), TransferCount::default());

    // X + Y: operands on different devices are an error, never a silent copy.
    match &x + &y {
        Err(e @ Error::DeviceMismatch { .. }) => {
            let Error::DeviceMismatch { op, lhs, rhs } = &e else { unreachable!() };
            assert_eq!((op.as_str(), *lhs, *rhs), ("add", g0, g1));
            let msg = e.to_string();
            assert!(msg.contains(&g0.to_string()) && msg.contains(&g1.to_string()) && msg.contains(".to("), "{msg}");
        }
        other => panic!("X + Y: expected DeviceMismatch, got {other:?}"),
    }

    // Z = X.cuda(1): exactly one device-to-device transfer of 24 bytes.
    let mark = thread_transfer_stats();
    let line = line!() + 1;
    let z = x.to(&g1).unwrap();
    let diff = thread_transfer_stats().since(&mark);
    assert_eq!(only_pair(&diff), ((Direction::DeviceToDevice, g0, g1), TransferCount { count: 1, bytes: 24 }));
    sites_are(&diff, &[line]);
    assert_eq!(z.device(), g1);
    assert!(!z.same_storage(&x));

    // Y + Z on gpu(1).
    let s = (&y + &z).unwrap();
    assert_eq!(s.device(), g1);
    let yv = y.to_vec::<f32>().unwrap();
    assert_eq!(s.to_vec::<f32>().unwrap(), yv.iter().map(|v| v + 1.0).collect::<Vec<_>>());

    // Z.cuda(1) is Z: no copy, no transfer.
    let mark = thread_transfer_stats();
    assert!(z.to(&g1).unwrap().same_storage(&z));
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 0);

    // copy_to always allocates, even on the same device (which crosses no bus).
    let c = z.copy_to(&g1).unwrap();
    assert!(!c.same_storage(&z));
    assert_eq!((c.device(), c.storage_bytes()), (g1, 24));
    assert_eq!(thread_transfer_stats().since(&mark).direction(Direction::DeviceToDevice).count, 0);
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![1.0; 6]);
}

#[test]
fn ledger_counts_every_transfer_per_direction_and_pair() {
    let (g0, g1) = two_gpus();
    let mark = thread_transfer_stats();
    let l_up = line!() + 1;
    let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &g0).unwrap(); // host -> gpu(0), 16 bytes
    let l_vec = line!() + 1;
    let v = a.to_vec::<f32>().unwrap(); // gpu(0) -> host
    assert_eq!(v, vec![1., 2., 3., 4.]);
    let l_scalar = line!() + 1;
    let s = a.sum_all().unwrap().to_scalar::<f32>().unwrap(); // gpu(0) -> host, 4 bytes
    assert_eq!(s, 10.0);
    let l_d2d = line!() + 1;
    let b = a.to(&g1).unwrap().copy_to(&g0).unwrap(); // gpu(0) -> gpu(1) -> gpu(0)
    let l_item = line!() + 1;
    assert_eq!(b.narrow(0, 1, 1).unwrap().narrow(1, 0, 1).unwrap().item().unwrap(), 3.0); // 4 bytes
    let l_host = line!() + 1;
    let h = b.to(&cpu()).unwrap(); // gpu(0) -> host, 16 bytes
                                   // Reads of CPU tensors and ops on a device are not transfers.
    let _ = h.to_vec::<f32>().unwrap();
    let _ = (&b * 2.0).unwrap().sum(0).unwrap();
    let diff = thread_transfer_stats().since(&mark);
    let pair = |d, s, t| diff.by_pair.get(&(d, s, t)).copied().unwrap_or_default();
    assert_eq!(pair(Direction::HostToDevice, cpu(), g0), TransferCount { count: 1, bytes: 16 });
    assert_eq!(pair(Direction::DeviceToHost, g0, cpu()), TransferCount { count: 4, bytes: 16 + 4 + 4 + 16 });
    assert_eq!(pair(Direction::DeviceToDevice, g0, g1), TransferCount { count: 1, bytes: 16 });
    assert_eq!(pair(Direction::DeviceToDevice, g1, g0), TransferCount { count: 1, bytes: 16 });
    assert_eq!(diff.by_pair.len(), 4, "{diff:?}");
    assert_eq!(diff.total(), TransferCount { count: 7, bytes: 16 + 40 + 32 });
    assert_eq!(diff.direction(Direction::DeviceToHost).count, 4);
    sites_are(&diff, &[l_up, l_vec, l_scalar, l_d2d, l_item, l_host]);
    // The chained `to(..).copy_to(..)` is two call sites on one line.
    let d2d: Vec<_> = diff.by_site.iter().filter(|((s, _), _)| s.starts_with(&format!("{}:{l_d2d}:", file!()))).collect();
    assert_eq!(d2d.len(), 2);
    assert!(d2d.iter().all(|((_, dir), c)| *dir == Direction::DeviceToDevice && **c == TransferCount { count: 1, bytes: 16 }));
    assert_eq!(diff.by_site.len(), 7);
    // The readable report names the directions, the pairs and the busiest site.
    let report = diff.report(3);
    assert!(report.starts_with("transfers: 7 ("), "{report}");
    assert!(report.contains("device-to-host") && report.contains(&format!("{g0} -> cpu")), "{report}");
    assert!(report.contains("busiest call sites") && report.contains("chapter.rs"), "{report}");
    // The process-wide ledger saw at least as much.
    assert!(kiln::transfer_stats().total().count >= 7);
}

#[test]
fn printing_a_gpu_tensor_is_one_device_to_host_transfer() {
    let (g0, _) = two_gpus();
    let x = Tensor::ones((2, 3), DType::F32, &g0).unwrap();
    let mark = thread_transfer_stats();
    let text = format!("{x}");
    assert_eq!(text, format!("tensor([[1., 1., 1.],\n        [1., 1., 1.]], device={g0})"));
    let diff = thread_transfer_stats().since(&mark);
    assert_eq!(only_pair(&diff), ((Direction::DeviceToHost, g0, cpu()), TransferCount { count: 1, bytes: 24 }));
    // Debug shows no values and transfers nothing.
    let mark = thread_transfer_stats();
    assert_eq!(format!("{x:?}"), format!("Tensor[[2, 3], f32, {g0}]"));
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 0);
}

#[test]
fn keeping_a_log_on_the_device_makes_one_transfer_instead_of_one_per_step() {
    // Exercise 3 of the chapter, small: log a norm per step.
    let (g0, _) = two_gpus();
    let a = Tensor::eye(4, DType::F32, &g0).unwrap();
    let mark = thread_transfer_stats();
    let mut host_log = Vec::new();
    for i in 0..10 {
        host_log.push(a.mul_scalar(i as f64).unwrap().norm().unwrap().to_scalar::<f32>().unwrap());
    }
    assert_eq!(thread_transfer_stats().since(&mark).direction(Direction::DeviceToHost).count, 10);
    let mark = thread_transfer_stats();
    let norms: Vec<Tensor> = (0..10).map(|i| a.mul_scalar(i as f64).unwrap().norm().unwrap()).collect();
    let refs: Vec<&Tensor> = norms.iter().collect();
    let device_log = Tensor::stack(&refs, 0).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(thread_transfer_stats().since(&mark).direction(Direction::DeviceToHost), TransferCount { count: 1, bytes: 40 });
    assert_eq!(device_log, host_log);
    assert_eq!(device_log, (0..10).map(|i| 2.0 * i as f32).collect::<Vec<_>>());
}

#[test]
fn transfer_guard_disallow_refuses_with_direction_devices_and_site() {
    let (g0, g1) = two_gpus();
    let x = Tensor::ones(3, DType::F32, &g0).unwrap();
    let host = Tensor::ones(3, DType::F32, &cpu()).unwrap();
    let mark = thread_transfer_stats();
    {
        let _guard = transfer_guard(GuardLevel::Disallow);
        let check = |e: Error, dir: Direction, src: Device, dst: Device, line: u32| match &e {
            Error::TransferDisallowed { direction, src: s, dst: t, location } => {
                assert_eq!((*direction, *s, *t), (dir, src, dst));
                assert!(location.starts_with(&format!("{}:{line}:", file!())), "location {location}");
                let msg = e.to_string();
                assert!(msg.contains(&dir.to_string()) && msg.contains(&src.to_string()) && msg.contains(&dst.to_string()), "{msg}");
            }
            other => panic!("expected TransferDisallowed, got {other:?}"),
        };
        let line = line!() + 1;
        check(x.to_vec::<f32>().unwrap_err(), Direction::DeviceToHost, g0, cpu(), line);
        let line = line!() + 1;
        check(x.to(&cpu()).unwrap_err(), Direction::DeviceToHost, g0, cpu(), line);
        let line = line!() + 1;
        check(x.sum_all().unwrap().item().unwrap_err(), Direction::DeviceToHost, g0, cpu(), line);
        let line = line!() + 1;
        check(Tensor::new(&[1f32], &g0).unwrap_err(), Direction::HostToDevice, cpu(), g0, line);
        let line = line!() + 1;
        check(host.to(&g1).unwrap_err(), Direction::HostToDevice, cpu(), g1, line);
        let line = line!() + 1;
        check(x.copy_to(&g1).unwrap_err(), Direction::DeviceToDevice, g0, g1, line);
        // Work that stays on its device is allowed.
        let y = (&x + &x).unwrap().sum_all().unwrap();
        assert!(y.to(&g0).unwrap().same_storage(&y));
        assert!(x.copy_to(&g0).is_ok());
        assert!(host.to_vec::<f32>().is_ok());
        // Printing cannot return an error: it says why it shows no values.
        let text = format!("{x}");
        assert!(text.contains("not readable") && text.contains("disallowed"), "{text}");
    }
    // Nothing refused was booked.
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 0);
    // The guard is over: the same transfers work again.
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0; 3]);
}

#[test]
fn transfer_guard_per_direction_log_and_nesting() {
    let (g0, g1) = two_gpus();
    let x = Tensor::ones(2, DType::F32, &g0).unwrap();
    {
        let _outer = transfer_guard_for(Direction::DeviceToHost, GuardLevel::Disallow);
        assert!(matches!(x.to_vec::<f32>(), Err(Error::TransferDisallowed { .. })));
        // Other directions are untouched.
        assert!(x.to(&g1).is_ok());
        assert!(Tensor::new(&[1f32], &g0).is_ok());
        {
            // Log lets the transfer happen (and prints it to stderr), and books it.
            let _inner = transfer_guard(GuardLevel::Log);
            let mark = thread_transfer_stats();
            assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0, 1.0]);
            assert_eq!(thread_transfer_stats().since(&mark).direction(Direction::DeviceToHost).count, 1);
        }
        // The inner guard restored the outer one.
        assert!(matches!(x.to_vec::<f32>(), Err(Error::TransferDisallowed { .. })));
        // Guards are per thread.
        let other = std::thread::spawn(move || x.to_vec::<f32>().is_ok()).join().unwrap();
        assert!(other, "a guard on one thread must not affect another");
    }
    let x = Tensor::ones(2, DType::F32, &g0).unwrap();
    assert!(x.to_vec::<f32>().is_ok());
}

#[test]
fn default_device_scope_is_scoped_and_per_thread() {
    let (g0, g1) = two_gpus();
    assert_eq!(default_device(), cpu());
    {
        let _s = default_device_scope(g1).unwrap();
        assert_eq!(default_device(), g1);
        let t = Tensor::new_default(&[1f32, 2.]).unwrap();
        assert_eq!(t.device(), g1);
        {
            let _inner = default_device_scope(g0).unwrap();
            assert_eq!(Tensor::new_default(&[1i64]).unwrap().device(), g0);
            let elsewhere = std::thread::spawn(default_device).join().unwrap();
            assert_eq!(elsewhere, cpu(), "the default device is per thread");
        }
        assert_eq!(default_device(), g1);
        assert!(matches!(default_device_scope(gpu(99)), Err(Error::NoSuchDevice { .. })));
        assert_eq!(default_device(), g1, "a failed scope changes nothing");
    }
    assert_eq!(default_device(), cpu());
}

#[test]
fn try_gpu_semantics() {
    let (g0, g1) = two_gpus();
    let n = num_gpus();
    assert!(n >= 2);
    // Simulated GPUs come after any real ones.
    let cuda = common::cuda_devices().len();
    assert!(g0 >= gpu(cuda) && g1 > g0);
    assert_eq!(try_gpu(0), gpu(0));
    assert_eq!(try_gpu(n - 1), gpu(n - 1));
    assert_eq!(try_gpu(n), cpu());
    assert_eq!(try_gpu(1000), cpu());
    assert_eq!(try_all_gpus(), (0..n).map(gpu).collect::<Vec<_>>());
    assert_eq!(why_not_gpu(0), None);
    assert_eq!(why_not_gpu(n - 1), None);
    assert_eq!(why_not_gpu(n), Some(FallbackReason::IndexOutOfRange { index: n, count: n }));
    let reason = why_not_gpu(n + 5).unwrap().to_string();
    assert!(reason.contains(&format!("gpu({})", n + 5)) && reason.contains(&n.to_string()), "{reason}");
    assert!(gpu(0).exists() && gpu(n - 1).exists() && !gpu(n).exists() && cpu().exists());
    assert!(cpu().is_cpu() && !cpu().is_gpu() && g0.is_gpu());
    // devices(): the CPU first, then one record per GPU; simulated ones say so.
    let list = kiln::devices();
    assert_eq!(list.len(), n + 1);
    assert_eq!((list[0].device, list[0].kind), (cpu(), DeviceKind::Cpu));
    for (i, info) in list[1..].iter().enumerate() {
        assert_eq!(info.device, gpu(i));
    }
    for g in [g0, g1] {
        let info = list.iter().find(|i| i.device == g).unwrap();
        assert_eq!(info.kind, DeviceKind::Simulated);
        assert!(info.name.contains("simulated"), "{}", info.name);
        let cap = kiln::memory_stats(&g).unwrap().capacity;
        assert!(cap.is_some() && info.memory_total == cap);
    }
    // Device names and parsing.
    assert_eq!((cpu().to_string(), gpu(1).to_string()), ("cpu".to_string(), "gpu(1)".to_string()));
    for (text, dev) in [("cpu", cpu()), ("gpu", gpu(0)), ("gpu(1)", gpu(1)), ("gpu:2", gpu(2)), ("cuda:3", gpu(3)), (" GPU(4) ", gpu(4))] {
        assert_eq!(text.parse::<Device>().unwrap(), dev, "{text}");
    }
    assert!(matches!("tpu".parse::<Device>(), Err(Error::InvalidArgument { .. })));
}

#[test]
fn copies_between_gpus_keep_values_and_dtypes() {
    let (g0, g1) = two_gpus();
    let i = Tensor::new(&[[1i64, -2], [3, 4]], &g0).unwrap().t().unwrap();
    let j = i.to(&g1).unwrap();
    assert_eq!((j.device(), j.dtype(), j.dims()), (g1, DType::I64, &[2usize, 2][..]));
    assert_eq!(j.to_vec::<i64>().unwrap(), vec![1, 3, -2, 4]);
    let m = (&j.to_dtype(DType::F64).unwrap() * 0.5).unwrap().to(&g0).unwrap().to(&cpu()).unwrap();
    assert_eq!(m.to_vec::<f64>().unwrap(), vec![0.5, 1.5, -1.0, 2.0]);
}

#[test]
fn printing_a_large_gpu_tensor_reads_only_what_is_shown() {
    let gpus = common::sims();
    let x = Tensor::arange(0.0, 10_000.0, 1.0, &gpus[0]).unwrap().reshape((100, 100)).unwrap();
    let before = kiln::thread_transfer_stats();
    let text = x.to_string();
    let moved = kiln::thread_transfer_stats().since(&before).total();
    // The 6 x 6 corner entries, one read.
    assert_eq!((moved.count, moved.bytes), (1, 6 * 6 * 4), "{text}");
    assert!(text.starts_with("tensor([[   0.,    1.,    2., ...,   97.,   98.,   99.],"), "{text}");
    assert!(text.contains("..."), "{text}");
    // The simulated GPU comes after any real (or simulated CUDA) ones.
    assert!(text.ends_with(&format!("9997., 9998., 9999.]], device={})", gpus[0])), "{text}");
}

#[test]
fn transfers_inside_kiln_are_booked_at_the_users_line() -> Result<()> {
    let g = common::sims()[0];
    let before = thread_transfer_stats();
    let mut net = Sequential::new().add(Linear::new(2, 1, &cpu())?);
    net.to(&g)?; // line A
    let line_a = line!() - 1;
    let x = Tensor::ones((1, 2), DType::F32, &g)?;
    x.show(); // line B
    let line_b = line!() - 1;
    kiln::println!("{x}"); // line C
    let line_c = line!() - 1;
    // A gradient through `to` crosses devices inside backward.
    let w = Tensor::ones((2,), DType::F32, &cpu())?.requires_grad_();
    let moved = w.to(&g)?; // line D
    let line_d = line!() - 1;
    moved.sum_all()?.backward()?; // line E
    let line_e = line!() - 1;
    let diff = thread_transfer_stats().since(&before);
    assert_eq!(lines(&diff), vec![line_a, line_b, line_c, line_d, line_e], "{}", diff.report(10));

    // The Trainer: model, batches and losses, all at the fit line.
    kiln::manual_seed(0);
    let data = synthetic_regression(64, 0, 32)?;
    let mut model = Learner::new(Linear::new(2, 1, &cpu())?, Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::builder().max_epochs(1).device(g).progress(Progress::Off).build()?;
    let before = thread_transfer_stats();
    trainer.fit(&mut model, &data)?; // line F
    let line_f = line!() - 1;
    assert_eq!(lines(&thread_transfer_stats().since(&before)), vec![line_f]);
    Ok(())
}

/// The lines of this file at which `diff` booked transfers.
fn lines(diff: &TransferStats) -> Vec<u32> {
    common::booked_lines(diff, file!())
}
