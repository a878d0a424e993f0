//! Memory on every device: capacity and OutOfMemory, nothing half-done after
//! a failure, peak tracking, accounting back to its baseline after drop, and
//! a 1,000,000-op soak that leaks nothing.
//!
//! Each test runs on a simulated GPU that no other test touches (tests of one
//! binary run concurrently), so every comparison is exact, and on every CUDA
//! device present, which the tests share: those (and the CPU) are measured
//! under a lock, one test at a time. A `RAN-CUDA` line is booked for each
//! CUDA device a test ran on; `KILN_REQUIRE_CUDA=1` makes having none a
//! failure.

mod common;

use kiln::{cpu, memory_stats, reset_peak_memory, synchronize, thread_transfer_stats, DType, Device, Error, Result, Tensor};
use std::sync::Mutex;

const SLOTS: usize = 10;
const CAPACITY: usize = 64 << 20;

/// The simulated GPU that test number `slot` owns.
fn own(slot: usize) -> Device {
    common::own_sims(SLOTS, CAPACITY)[slot]
}

/// Serialises the tests that measure devices shared with other tests of
/// this binary (the CPU, CUDA).
static SHARED_DEVICES: Mutex<()> = Mutex::new(());

fn shared_devices() -> std::sync::MutexGuard<'static, ()> {
    SHARED_DEVICES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on the simulated GPU `own(slot)`, then on every CUDA device
/// (under the lock), booking a RAN-CUDA line for each.
fn on_own_gpu_and_cuda(slot: usize, f: impl Fn(Device)) {
    f(own(slot));
    let _lock = shared_devices();
    for d in common::cuda_devices() {
        synchronize(&d).unwrap();
        f(d);
        common::report_ran(d);
    }
}

fn capacity(d: Device) -> usize {
    memory_stats(&d).unwrap().capacity.expect("a GPU has a capacity")
}

fn in_use(d: Device) -> usize {
    memory_stats(&d).unwrap().in_use
}

fn live(d: Device) -> usize {
    memory_stats(&d).unwrap().live_tensors
}

#[track_caller]
fn expect_oom<T: std::fmt::Debug>(r: Result<T>, d: Device, requested: usize, used: usize) {
    let cap = capacity(d);
    match r {
        Err(e @ Error::OutOfMemory { .. }) => {
            let Error::OutOfMemory { device, requested: req, in_use, capacity, .. } = &e else { unreachable!() };
            assert_eq!((*device, *req, *in_use, *capacity), (d, requested, used, cap), "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("out of memory on {d}")) && msg.contains(&kiln::human_bytes(cap)), "{msg}");
        }
        other => panic!("expected OutOfMemory on {d}, got {other:?}"),
    }
}

#[test]
fn out_of_memory_is_raised_at_the_call_and_is_recoverable() {
    assert_eq!(memory_stats(&own(0)).unwrap().capacity, Some(CAPACITY));
    on_own_gpu_and_cuda(0, |d| {
        let stats = memory_stats(&d).unwrap();
        let (base, tensors) = (stats.in_use, stats.live_tensors);
        let n = capacity(d) * 6 / 10 / 4; // 60% of the device in f32
        let a = Tensor::zeros(n, DType::F32, &d).unwrap();
        let used = in_use(d);
        assert_eq!(used, base + 4 * n);
        expect_oom(Tensor::zeros(n, DType::F32, &d), d, 4 * n, used);
        // OOM is recoverable: after dropping, the same allocation succeeds.
        drop(a);
        synchronize(&d).unwrap();
        assert_eq!((in_use(d), live(d)), (base, tensors));
        let b = Tensor::ones(n, DType::F32, &d).unwrap();
        assert_eq!(b.sum_all().unwrap().to_scalar::<f32>().unwrap(), n as f32);
        drop(b);
        synchronize(&d).unwrap();
        assert_eq!((in_use(d), live(d)), (base, tensors));
    });
}

#[test]
fn a_failed_operation_leaves_nothing_half_done() {
    leaves_nothing_half_done(own(1), Some(own(2)));
    let _lock = shared_devices();
    let cuda = common::cuda_devices();
    for (i, &d) in cuda.iter().enumerate() {
        // Another CUDA device holds the tensor copied from another GPU; with
        // only one, that case is left out (a simulated GPU is too small).
        let other = cuda.get((i + 1) % cuda.len()).copied().filter(|&o| o != d);
        leaves_nothing_half_done(d, other);
        common::report_ran(d);
    }
}

/// Operations that do not fit on `d` fail with OutOfMemory and leave its
/// memory, its live tensors and the transfer ledger as they were. `other`,
/// a device with at least `d`'s capacity, holds the source of a copy.
fn leaves_nothing_half_done(d: Device, other: Option<Device>) {
    synchronize(&d).unwrap();
    let baseline = (in_use(d), live(d));
    let n = capacity(d) * 6 / 10 / 4 / 3 * 3;
    let a = Tensor::ones(n, DType::F32, &d).unwrap();
    let small = other.map(|o| Tensor::ones(3, DType::F32, &o).unwrap());
    let big_elsewhere = other.map(|o| Tensor::ones(n, DType::F32, &o).unwrap());
    let host = vec![0f32; n];
    let (ids, one) = (Tensor::new(&[0i64], &d).unwrap(), Tensor::ones(1, DType::F32, &d).unwrap());
    synchronize(&d).unwrap();
    let (used, tensors) = (in_use(d), live(d));
    let mark = thread_transfer_stats();
    let mut failures: Vec<(&str, usize, Result<Tensor>)> = vec![
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
        ("index_add", 4 * n, a.index_add(&ids, &one, 0)),
    ];
    if let Some(big) = &big_elsewhere {
        failures.push(("copy from another GPU", 4 * n, big.to(&d)));
    }
    for (what, bytes, r) in failures {
        expect_oom(r, d, bytes, used);
        assert_eq!((in_use(d), live(d)), (used, tensors), "{what} left memory booked");
    }
    // Transfers that could not happen are not in the ledger.
    assert_eq!(thread_transfer_stats().since(&mark).total().count, 0, "{:?}", thread_transfer_stats().since(&mark));
    // The operand is intact, and small work still fits.
    assert_eq!(a.sum_all().unwrap().to_scalar::<f32>().unwrap(), n as f32);
    if let Some(small) = small {
        assert_eq!(small.to(&d).unwrap().to_vec::<f32>().unwrap(), vec![1.0; 3]);
    }
    drop((a, ids, one, big_elsewhere));
    synchronize(&d).unwrap();
    assert_eq!((in_use(d), live(d)), baseline);
}

#[test]
fn peak_tracking_and_reset() {
    on_own_gpu_and_cuda(3, peak_tracking_on);
}

fn peak_tracking_on(d: Device) {
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
    let (peak, cap) = (kiln::human_bytes(base + 1024), kiln::human_bytes(capacity(d)));
    assert!(
        text.starts_with(&format!("{d}: ")) && text.contains(&format!("peak {peak}")) && text.contains(&format!("capacity {cap}")),
        "{text}"
    );
    let info = kiln::devices().into_iter().find(|i| i.device == d).unwrap();
    assert_eq!(info.memory_total, Some(capacity(d)));
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
    let _lock = shared_devices();
    back_to_baseline(cpu());
    for d in common::cuda_devices() {
        back_to_baseline(d);
        common::report_ran(d);
    }
}

/// A million one-element adds on a simulated GPU, and on each CUDA device
/// (100,000 on the CUDA simulator, where each launch runs 256 GPU threads
/// on the CPU).
#[test]
fn a_million_tiny_ops_leak_nothing() {
    on_own_gpu_and_cuda(5, |d| {
        let simulated_cuda = common::is_simulated_cuda(d);
        tiny_ops_leak_nothing(d, if simulated_cuda { 100_000 } else { 1_000_000 });
    });
}

fn tiny_ops_leak_nothing(d: Device, ops: usize) {
    synchronize(&d).unwrap();
    reset_peak_memory(&d).unwrap();
    let base = memory_stats(&d).unwrap();
    let start = std::time::Instant::now();
    let one = Tensor::ones(1, DType::F32, &d).unwrap();
    let mut acc = Tensor::zeros(1, DType::F32, &d).unwrap();
    const READ_EVERY: usize = 10_000;
    for i in 1..=ops {
        acc = (&acc + &one).unwrap();
        if i % READ_EVERY == 0 {
            // A training loop reads its loss now and then, which also bounds the queue.
            assert_eq!(acc.to_scalar::<f32>().unwrap(), i as f32);
        }
    }
    assert_eq!(acc.to_scalar::<f32>().unwrap(), ops as f32);
    let elapsed = start.elapsed();
    eprintln!("{ops} one-element adds on {d}: {elapsed:.2?} ({:.2} us/op)", elapsed.as_secs_f64() * 1e6 / ops as f64);
    drop((acc, one));
    synchronize(&d).unwrap();
    let after = memory_stats(&d).unwrap();
    assert_eq!((after.in_use, after.live_tensors), (base.in_use, base.live_tensors), "{after}");
    // Storage never piled up: at most the queue's worth of 4-byte results was alive.
    assert!(after.peak <= base.in_use + 4 * (READ_EVERY + 4), "peak {} during the soak", after.peak);
}

#[test]
fn impossible_allocations_are_errors_not_aborts() {
    let _lock = shared_devices();
    let d = own(6);
    let cuda = common::cuda_devices();
    for dev in [cpu(), d].into_iter().chain(cuda.iter().copied()) {
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
        common::report_ran(dev);
    }
}

/// A simulated GPU keeps freed buffers of 16 KiB and more for reuse, as a
/// GPU's caching allocator does: counted in `cached` (never in `in_use`),
/// handed out again for the same size with every element rewritten, bounded
/// by a quarter of the capacity and by 512 buffers, and freed by
/// `empty_cache`.
#[test]
fn a_simulated_gpu_caches_freed_buffers_for_reuse() {
    let d = own(7);
    let cached = || memory_stats(&d).unwrap().cached;
    kiln::empty_cache(&d).unwrap();
    let base = memory_stats(&d).unwrap();
    assert_eq!(base.cached, 0);
    let n = 64 << 10; // 256 KiB of f32
    let x = Tensor::full(7.0, n, DType::F32, &d).unwrap();
    drop(x);
    synchronize(&d).unwrap();
    assert_eq!(cached(), 4 * n, "the dropped buffer is cached");
    assert_eq!(memory_stats(&d).unwrap().in_use, base.in_use, "a cached buffer is not in use");
    // The same size again takes it back, and every element is rewritten.
    let y = Tensor::arange(0.0, n as f64, 1.0, &d).unwrap().to_dtype(DType::F32).unwrap();
    let z = y.add_scalar(1.0).unwrap().sub_scalar(1.0).unwrap();
    let (yv, zv) = (y.to_vec::<f32>().unwrap(), z.to_vec::<f32>().unwrap());
    assert!(yv.iter().enumerate().all(|(i, &v)| v == i as f32), "a reused buffer kept old values");
    assert_eq!(zv, yv);
    drop((y, z));
    synchronize(&d).unwrap();
    // Over a quarter of the capacity (16 MiB here): freed, not cached.
    let before = cached();
    drop(Tensor::zeros(5 << 20, DType::F32, &d).unwrap());
    synchronize(&d).unwrap();
    assert_eq!(cached(), before, "a 20 MiB buffer is not cached on a 64 MiB device");
    // At most 512 buffers, however small.
    kiln::empty_cache(&d).unwrap();
    let many: Vec<Tensor> = (0..600).map(|_| Tensor::zeros(4 << 10, DType::F32, &d).unwrap()).collect();
    drop(many);
    synchronize(&d).unwrap();
    assert_eq!(cached(), 512 * (16 << 10));
    kiln::empty_cache(&d).unwrap();
    let after = memory_stats(&d).unwrap();
    assert_eq!((after.cached, after.in_use, after.live_tensors), (0, base.in_use, base.live_tensors), "{after}");
}

#[test]
fn memory_of_a_dropped_tensor_is_reusable_at_once_by_later_work_on_its_queue() {
    let g = own(8);
    kiln::synchronize(&g).unwrap();
    let base = memory_stats(&g).unwrap();
    let n = 10 << 20; // 40 MiB of f32
    let hold = kiln::hold_queue(&g).unwrap().expect("a simulated GPU has a queue");
    let x = Tensor::full(2.0, n, DType::F32, &g).unwrap(); // queued, not run
    let total = x.sum_all().unwrap(); // queued, reads x
    drop(x);
    // The queue still holds x's storage, but its 40 MiB are free for work
    // queued from now on, which runs after the sum (stream order).
    let stats = memory_stats(&g).unwrap();
    assert_eq!((stats.in_use, stats.live_tensors), (base.in_use + 4, base.live_tensors + 1));
    let y = Tensor::full(3.0, n, DType::F32, &g).expect("40 MiB on a 64 MiB GPU after the other 40 MiB were dropped");
    drop(hold);
    assert_eq!(total.to_scalar::<f32>().unwrap(), 2.0 * n as f32);
    assert_eq!(y.narrow(0, n - 2, 2).unwrap().to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
    drop((total, y));
    kiln::synchronize(&g).unwrap();
    let after = memory_stats(&g).unwrap();
    // Unbooked once: back to the baseline exactly.
    assert_eq!((after.in_use, after.live_tensors), (base.in_use, base.live_tensors));
}

/// The process's peak resident memory (VmHWM), in bytes.
fn peak_resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("a VmHWM line");
    line.split_whitespace().nth(1).and_then(|kb| kb.parse::<usize>().ok()).expect("VmHWM in kB") * 1024
}

/// An upload that cannot fit on a GPU is refused before the host's
/// elements are copied: the copy of a slice as large as most of a big GPU
/// took most of the host's memory, and 40 s, before the device said no.
/// The slice is 8 GiB of zeroed pages the host never touches (calloc), so
/// a copy would raise the peak resident memory by 8 GiB.
#[test]
fn an_upload_that_cannot_fit_is_refused_before_its_host_copy() {
    let d = own(9);
    let n = 2usize << 30;
    let host = vec![0f32; n];
    let used = in_use(d);
    let before = peak_resident_bytes();
    expect_oom(Tensor::from_slice(&host, n, &d), d, 4 * n, used);
    expect_oom(Tensor::new(host.as_slice(), &d), d, 4 * n, used);
    let grew = peak_resident_bytes().saturating_sub(before);
    assert!(grew < 1 << 30, "the refused uploads raised the peak resident memory by {}", kiln::human_bytes(grew));
    assert_eq!((in_use(d), live(d)), (used, 0));
}
