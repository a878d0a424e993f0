//! Memory on every device: capacity and OutOfMemory on simulated GPUs,
//! nothing half-done after a failure, peak tracking, accounting back to its
//! baseline after drop, and a 1,000,000-op soak that leaks nothing.
//!
//! Each test measures a simulated GPU that no other test touches (tests of
//! one binary run concurrently), so every comparison is exact. The CPU is
//! measured under a lock.

mod common;

use kiln::{cpu, memory_stats, reset_peak_memory, synchronize, thread_transfer_stats, DType, Device, Error, Result, Tensor};
use std::sync::Mutex;

const SLOTS: usize = 8;
const CAPACITY: usize = 64 << 20;

/// The simulated GPU that test number `slot` owns.
fn own(slot: usize) -> Device {
    common::own_sims(SLOTS, CAPACITY)[slot]
}

/// Serialises the tests that measure devices shared with other tests of
/// this binary (the CPU, CUDA).
static SHARED_DEVICES: Mutex<()> = Mutex::new(());

fn in_use(d: Device) -> usize {
    memory_stats(&d).unwrap().in_use
}

fn live(d: Device) -> usize {
    memory_stats(&d).unwrap().live_tensors
}

#[track_caller]
fn expect_oom<T: std::fmt::Debug>(r: Result<T>, d: Device, requested: usize, used: usize) {
    match r {
        Err(e @ Error::OutOfMemory { .. }) => {
            let Error::OutOfMemory { device, requested: req, in_use, capacity } = &e else { unreachable!() };
            assert_eq!((*device, *req, *in_use, *capacity), (d, requested, used, CAPACITY), "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("out of memory on {d}")) && msg.contains("64.0 MiB"), "{msg}");
        }
        other => panic!("expected OutOfMemory on {d}, got {other:?}"),
    }
}

#[test]
fn out_of_memory_is_raised_at_the_call_and_is_recoverable() {
    let d = own(0);
    let stats = memory_stats(&d).unwrap();
    assert_eq!((stats.capacity, stats.in_use, stats.live_tensors), (Some(CAPACITY), 0, 0));
    let n = CAPACITY * 6 / 10 / 4; // 60% of the device in f32
    let a = Tensor::zeros(n, DType::F32, &d).unwrap();
    let used = in_use(d);
    assert_eq!(used, 4 * n);
    expect_oom(Tensor::zeros(n, DType::F32, &d), d, 4 * n, used);
    // OOM is recoverable: after dropping, the same allocation succeeds.
    drop(a);
    synchronize(&d).unwrap();
    assert_eq!((in_use(d), live(d)), (0, 0));
    let b = Tensor::ones(n, DType::F32, &d).unwrap();
    assert_eq!(b.sum_all().unwrap().to_scalar::<f32>().unwrap(), n as f32);
    drop(b);
    synchronize(&d).unwrap();
    assert_eq!((in_use(d), live(d)), (0, 0));
}

#[test]
fn a_failed_operation_leaves_nothing_half_done() {
    let (d, other) = (own(1), own(2));
    let n = CAPACITY * 6 / 10 / 4 / 3 * 3;
    let a = Tensor::ones(n, DType::F32, &d).unwrap();
    let small = Tensor::ones(3, DType::F32, &other).unwrap();
    let big_elsewhere = Tensor::ones(n, DType::F32, &other).unwrap();
    let host = vec![0f32; n];
    let (ids, one) = (Tensor::new(&[0i64], &d).unwrap(), Tensor::ones(1, DType::F32, &d).unwrap());
    synchronize(&d).unwrap();
    let (used, tensors) = (in_use(d), live(d));
    let mark = thread_transfer_stats();
    let failures: Vec<(&str, usize, Result<Tensor>)> = vec![
        ("add", 4 * n, &a + &a),
        ("mul_scalar", 4 * n, a.mul_scalar(2.0)),
        ("exp", 4 * n, a.exp()),
        ("copy_to", 4 * n, a.copy_to(&d)),
        ("contiguous of a transpose", 4 * n, a.reshape((3, n / 3)).unwrap().t().unwrap().contiguous()),
        ("to_dtype", 8 * n, a.to_dtype(DType::F64)),
        ("cat", 4 * n, Tensor::cat(&[&a], 0)),
        ("stack", 4 * n, Tensor::stack(&[&a], 0)),
        ("zeros", 4 * n, Tensor::zeros(n, DType::F32, &d)),
        ("rand", 4 * n, Tensor::rand(n, &d)),
        ("upload from the host", 4 * n, Tensor::from_slice(&host, n, &d)),
        ("copy from another GPU", 4 * n, big_elsewhere.to(&d)),
        ("index_add", 4 * n, a.index_add(&ids, &one, 0)),
    ];
    for (what, bytes, r) in failures {
        expect_oom(r, d, bytes, used);
        assert_eq!((in_use(d), live(d)), (used, tensors), "{what} left memory booked");
    }
    // Transfers that could not happen are not in the ledger.
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 0, "{:?}", thread_transfer_stats().since(&mark));
    // The operand is intact, and small work still fits.
    assert_eq!(a.sum_all().unwrap().to_scalar::<f32>().unwrap(), n as f32);
    assert_eq!(small.to(&d).unwrap().to_vec::<f32>().unwrap(), vec![1.0; 3]);
    drop((a, ids, one));
    synchronize(&d).unwrap();
    assert_eq!((in_use(d), live(d)), (0, 0));
}

#[test]
fn peak_tracking_and_reset() {
    let d = own(3);
    reset_peak_memory(&d).unwrap();
    let base = in_use(d);
    assert_eq!(memory_stats(&d).unwrap().peak, base);
    let a = Tensor::zeros(1 << 18, DType::F32, &d).unwrap(); // 1 MiB
    let b = Tensor::zeros(1 << 18, DType::F64, &d).unwrap(); // 2 MiB
    let stats = memory_stats(&d).unwrap();
    assert_eq!((stats.in_use, stats.peak, stats.live_tensors), (base + (3 << 20), base + (3 << 20), 2));
    drop(b);
    drop(a);
    synchronize(&d).unwrap();
    let stats = memory_stats(&d).unwrap();
    assert_eq!((stats.in_use, stats.peak, stats.live_tensors), (base, base + (3 << 20), 0));
    reset_peak_memory(&d).unwrap();
    assert_eq!(memory_stats(&d).unwrap().peak, base);
    let c = Tensor::zeros(1 << 10, DType::U8, &d).unwrap();
    assert_eq!(memory_stats(&d).unwrap().peak, base + 1024);
    drop(c);
    // The readable summary.
    let text = memory_stats(&d).unwrap().to_string();
    assert!(text.starts_with(&format!("{d}: ")) && text.contains("peak 1.0 KiB") && text.contains("capacity 64.0 MiB"), "{text}");
    let info = kiln::devices().into_iter().find(|i| i.device == d).unwrap();
    assert_eq!(info.memory_total, Some(CAPACITY));
}

/// Runs every op family once, keeping some results alive; returns them.
fn every_op_family(d: Device) -> Result<Vec<Tensor>> {
    kiln::manual_seed(5);
    let a = Tensor::rand((16, 24), &d)?;
    let b = Tensor::randn((24, 8), &d)?;
    let c = a.matmul(&b)?;
    let s = (&c + &Tensor::ones(8, DType::F32, &d)?)?.relu()?.sum(1)?;
    let t = a.t()?.contiguous()?.narrow(0, 2, 5)?.exp()?.mean_keepdim(1)?;
    let cat = Tensor::cat(&[&a, &a.sqr()?], 0)?;
    let st = Tensor::stack(&[&s, &s], 1)?;
    let ids = Tensor::new(&[1i64, 0, 3], &d)?;
    let sel = cat.index_select(&ids, 0)?;
    let add = Tensor::zeros((4, 24), DType::F32, &d)?.index_add(&ids, &sel, 0)?;
    let cmp = a.gt(&a.mean_all()?)?;
    let w = cmp.where_cond(&a, &a.neg()?)?;
    let h = w.to_dtype(DType::F16)?.to_dtype(DType::F64)?;
    let am = a.argmax(1)?;
    let n = c.norm()?;
    let x = Tensor::new(&[1f32, 2., 3.], &d)?.requires_grad_();
    x.sqr()?.sum_all()?.backward()?;
    let g = x.grad().expect("a gradient");
    let copy = st.copy_to(&d)?;
    let eye = Tensor::eye(5, DType::I64, &d)?;
    let _ = n.to_scalar::<f32>()?;
    let _ = format!("{h}");
    Ok(vec![add, t, am, g, copy, eye])
}

fn back_to_baseline(d: Device) {
    synchronize(&d).unwrap();
    let before = memory_stats(&d).unwrap();
    let kept = every_op_family(d).unwrap();
    synchronize(&d).unwrap();
    let during = memory_stats(&d).unwrap();
    let kept_bytes: usize = kept.iter().map(|t| t.storage_bytes()).sum();
    // Only the kept results (and the gradient's leaf, kept alive by x.grad) remain.
    assert!(during.in_use >= before.in_use + kept_bytes, "{during} vs {before}");
    drop(kept);
    synchronize(&d).unwrap();
    let after = memory_stats(&d).unwrap();
    assert_eq!((after.in_use, after.live_tensors), (before.in_use, before.live_tensors), "on {d}: {after} vs {before}");
}

#[test]
fn memory_returns_to_baseline_on_an_owned_gpu() {
    back_to_baseline(own(4));
}

#[test]
fn memory_returns_to_baseline_on_the_cpu_and_cuda() {
    let _lock = SHARED_DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    back_to_baseline(cpu());
    for d in common::cuda_devices() {
        back_to_baseline(d);
    }
}

#[test]
fn a_million_tiny_ops_leak_nothing() {
    let d = own(5);
    synchronize(&d).unwrap();
    reset_peak_memory(&d).unwrap();
    let base = memory_stats(&d).unwrap();
    let start = std::time::Instant::now();
    let one = Tensor::ones(1, DType::F32, &d).unwrap();
    let mut acc = Tensor::zeros(1, DType::F32, &d).unwrap();
    const OPS: usize = 1_000_000;
    const READ_EVERY: usize = 10_000;
    for i in 1..=OPS {
        acc = (&acc + &one).unwrap();
        if i % READ_EVERY == 0 {
            // A training loop reads its loss now and then, which also bounds the queue.
            assert_eq!(acc.to_scalar::<f32>().unwrap(), i as f32);
        }
    }
    assert_eq!(acc.to_scalar::<f32>().unwrap(), OPS as f32);
    let elapsed = start.elapsed();
    eprintln!("{OPS} one-element adds on simulated {d}: {elapsed:.2?} ({:.2} us/op)", elapsed.as_secs_f64() * 1e6 / OPS as f64);
    drop((acc, one));
    synchronize(&d).unwrap();
    let after = memory_stats(&d).unwrap();
    assert_eq!((after.in_use, after.live_tensors), (base.in_use, base.live_tensors), "{after}");
    // Storage never piled up: at most the queue's worth of 4-byte results was alive.
    assert!(after.peak <= base.in_use + 4 * (READ_EVERY + 4), "peak {} during the soak", after.peak);
}

#[test]
fn impossible_allocations_are_errors_not_aborts() {
    let _lock = SHARED_DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let d = own(6);
    for dev in [cpu(), d] {
        let before = memory_stats(&dev).unwrap();
        for r in [
            Tensor::zeros(1usize << 60, DType::F32, &dev),
            Tensor::arange(0.0, 1e18, 1.0, &dev),
            Tensor::ones((1usize << 40, 1usize << 40), DType::F64, &dev),
            Tensor::rand(usize::MAX / 2, &dev),
        ] {
            match r {
                Err(Error::OutOfMemory { device, .. }) => assert_eq!(device, dev),
                Err(Error::InvalidArgument { .. }) => {}
                other => panic!("an impossible allocation on {dev}: expected OutOfMemory, got {other:?}"),
            }
        }
        let after = memory_stats(&dev).unwrap();
        assert_eq!((after.in_use, after.live_tensors), (before.in_use, before.live_tensors));
    }
}
