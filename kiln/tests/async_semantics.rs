//! Asynchronous execution on simulated GPUs: operations enqueue and return,
//! waits (`synchronize`, `block_until_ready`, host reads) wait, copies
//! between devices follow event order, and dropping a tensor whose kernel has
//! not run yet is safe.
//!
//! Each test uses simulated GPUs of its own, so that a busy queue or a memory
//! count is never disturbed by another test running at the same time.

mod common;

use common::within;
use kiln::{cpu, memory_stats, synchronize, DType, Device, Error, Tensor};
use std::time::Duration;

const SLOTS: usize = 13;
const CAPACITY: usize = 128 << 20;
/// Matrices of this size take tens of milliseconds per product on one core.
const N: usize = 1024;

fn own(slot: usize) -> Device {
    common::own_sims(SLOTS, CAPACITY)[slot]
}

/// Keeps `d`'s queue busy for a while: a chain of N×N products whose values
/// stay exactly 1 (ones @ (ones / N)). Returns the last product.
fn busy(d: Device, products: usize) -> Tensor {
    let a = Tensor::ones((N, N), DType::F32, &d).unwrap();
    let b = Tensor::full(1.0 / N as f64, (N, N), DType::F32, &d).unwrap();
    let mut c = a;
    for _ in 0..products {
        c = c.matmul(&b).unwrap();
    }
    c
}

#[test]
fn operations_return_before_the_work_runs() {
    // gpu(0)'s queue is held, so nothing submitted to it can run: if any of
    // these calls waited for its kernel, it would never return. They run on
    // another thread so that such a bug fails the test instead of hanging it.
    let (g0, g1) = (own(0), own(1));
    let hold = kiln::hold_queue(&g0).unwrap().expect("a simulated GPU has a queue to hold");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let c = busy(g0, 4);
        let moved = c.to(&g1).unwrap(); // gpu(1) waits on an event, not the host
        let total = moved.sum_all().unwrap();
        tx.send(total).unwrap();
    });
    let total = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("operations on a held queue did not return: they waited for their kernels");
    // Nothing on gpu(0) has run yet, so nothing downstream on gpu(1) can have either.
    drop(hold);
    total.block_until_ready().unwrap();
    synchronize(&g0).unwrap();
    assert_eq!(total.to_scalar::<f32>().unwrap(), (N * N) as f32);
}

#[test]
fn synchronize_and_block_until_ready_wait_for_all_queued_work() {
    let d = own(2);
    synchronize(&d).unwrap();
    let base = memory_stats(&d).unwrap();
    let c = busy(d, 3);
    // Every intermediate handle is gone; the queue still holds what it needs.
    c.block_until_ready().unwrap();
    // Once the queue has run, it has let go of everything it held: only `c` is left.
    let after = memory_stats(&d).unwrap();
    assert_eq!((after.in_use, after.live_tensors), (base.in_use + 4 * N * N, base.live_tensors + 1), "{after}");
    let s = c.sum_all().unwrap();
    synchronize(&d).unwrap();
    assert_eq!(memory_stats(&d).unwrap().in_use, base.in_use + 4 * N * N + 4);
    assert_eq!(s.to_scalar::<f32>().unwrap(), (N * N) as f32);
    // Waiting on an idle device returns at once.
    synchronize(&d).unwrap();
    s.block_until_ready().unwrap();
}

#[test]
fn dropping_tensors_whose_kernels_have_not_run_is_safe() {
    let (d, other) = (own(3), own(4));
    synchronize(&d).unwrap();
    synchronize(&other).unwrap();
    let (base, base_other) = (memory_stats(&d).unwrap(), memory_stats(&other).unwrap());
    {
        let c = busy(d, 3);
        let s = c.sum_all().unwrap();
        let e = c.exp().unwrap().narrow(0, 0, 2).unwrap().contiguous().unwrap();
        let moved = c.to(&other).unwrap();
        let m = moved.mul_scalar(2.0).unwrap();
        drop((c, s, e, moved, m)); // all before their kernels ran
    }
    synchronize(&d).unwrap();
    synchronize(&other).unwrap();
    for (dev, b) in [(d, base), (other, base_other)] {
        let now = memory_stats(&dev).unwrap();
        assert_eq!((now.in_use, now.live_tensors), (b.in_use, b.live_tensors), "{now}");
    }
    // The devices still work.
    let x = Tensor::new(&[1f32, 2.], &d).unwrap();
    assert_eq!((&x + &x).unwrap().to_vec::<f32>().unwrap(), vec![2., 4.]);
    // A source dropped right after a copy was enqueued still gives its values.
    let c = busy(d, 2);
    let z = c.narrow(0, 0, 1).unwrap().to(&other).unwrap();
    drop(c);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![1.0; N]);
}

#[test]
fn a_copy_between_gpus_sees_the_values_produced_on_the_source() {
    let (g0, g1) = (own(5), own(6));
    // gpu(0) is busy; gpu(1) is idle and would read zeros if it did not wait.
    let c = busy(g0, 3);
    let z = c.to(&g1).unwrap();
    let zs = c.sum_all().unwrap().to(&g1).unwrap();
    let zt = c.t().unwrap().narrow(0, 1, 2).unwrap().copy_to(&g1).unwrap();
    assert_eq!(z.device(), g1);
    assert_eq!(zs.to_scalar::<f32>().unwrap(), (N * N) as f32);
    assert_eq!(z.sum_all().unwrap().to_scalar::<f32>().unwrap(), (N * N) as f32);
    assert_eq!(zt.to_vec::<f32>().unwrap(), vec![1.0; 2 * N]);
    // And to the host: a read waits for the work that produces the value.
    let c = busy(g0, 2);
    let h = c.to(&cpu()).unwrap();
    assert_eq!(h.sum_all().unwrap().to_scalar::<f32>().unwrap(), (N * N) as f32);
}

#[test]
fn a_copy_reads_its_source_before_later_writes_to_the_source() {
    let (g0, g1) = (own(7), own(8));
    // gpu(1) is busy, so the copy to it would run late; gpu(0) is idle, so
    // the overwrite of the source runs at once.
    let x = Tensor::new(&[1f32, 2., 3.], &g0).unwrap();
    let pending = busy(g1, 3);
    let z = x.to(&g1).unwrap();
    x.assign(&Tensor::zeros(3, DType::F32, &g0).unwrap()).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![1., 2., 3.], "the copy saw a write made after it");
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![0.; 3]);
    drop(pending);
    // The same from the host: the caller may overwrite its tensor at once.
    let h = Tensor::new(&[4f32, 5.], &cpu()).unwrap();
    let pending = busy(g1, 3);
    let z = h.to(&g1).unwrap();
    h.assign(&Tensor::zeros(2, DType::F32, &cpu()).unwrap()).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![4., 5.]);
    drop(pending);
}

#[test]
fn host_reads_wait_for_the_producing_work() {
    let d = own(9);
    let c = busy(d, 2);
    assert_eq!(c.narrow(0, N - 1, 1).unwrap().to_vec::<f32>().unwrap(), vec![1.0; N]);
    let c = busy(d, 2);
    assert_eq!(c.sum_all().unwrap().item().unwrap(), (N * N) as f64);
    let c = busy(d, 1);
    let text = c.narrow(0, 0, 1).unwrap().narrow(1, 0, 2).unwrap().to_string();
    assert_eq!(text, format!("tensor([[1., 1.]], device={d})"));
}

#[test]
fn the_queue_runs_in_order() {
    let d = own(10);
    let w = Tensor::zeros(4, DType::F32, &d).unwrap();
    for _ in 0..100 {
        w.assign(&(&w + 1.0).unwrap()).unwrap();
    }
    let snapshot = w.copy_to(&d).unwrap();
    w.assign(&Tensor::full(-1.0, 1, DType::F32, &d).unwrap()).unwrap();
    assert_eq!(snapshot.to_vec::<f32>().unwrap(), vec![100.0; 4]);
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![-1.0; 4]);
}

#[test]
fn several_threads_can_submit_to_one_gpu() {
    let d = own(11);
    let handles: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let one = Tensor::full(t as f64 + 1.0, 1, DType::F32, &d).unwrap();
                let mut acc = Tensor::zeros(1, DType::F32, &d).unwrap();
                for _ in 0..2000 {
                    acc = (&acc + &one).unwrap();
                }
                acc.to_scalar::<f32>().unwrap()
            })
        })
        .collect();
    let results: Vec<f32> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(results, vec![2000., 4000., 6000., 8000.]);
}

#[test]
fn out_of_memory_on_a_busy_device_is_raised_at_the_call() {
    // Slot 0 is shared with another test: only the error's fields that do
    // not depend on the other test's memory are checked.
    let d = own(0);
    let pending = busy(d, 2);
    let r = Tensor::zeros(CAPACITY / 4 + 1, DType::F32, &d);
    match r {
        Err(Error::OutOfMemory { device, requested, capacity, .. }) => {
            assert_eq!((device, requested, capacity), (d, CAPACITY + 4, CAPACITY));
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(pending.sum_all().unwrap().to_scalar::<f32>().unwrap(), (N * N) as f32);
}

#[test]
fn many_threads_waiting_on_a_busy_simulated_gpu_all_wake() {
    let g = own(12);
    within(60, "waiters on a simulated GPU", move || {
        for round in 0..20 {
            let hold = kiln::hold_queue(&g).unwrap().expect("a simulated GPU has a queue");
            let mut x = Tensor::zeros(16, DType::F32, &g).unwrap();
            for _ in 0..50 {
                x = (&x + 1.0).unwrap();
            }
            let waiters: Vec<_> = (0..8).map(|_| std::thread::spawn(move || kiln::synchronize(&g))).collect();
            std::thread::sleep(Duration::from_millis(2));
            drop(hold);
            for w in waiters {
                w.join().unwrap().unwrap();
            }
            assert_eq!(x.to_vec::<f32>().unwrap(), vec![50.0; 16], "round {round}");
        }
        // Reads racing the worker, with no hold: each must see its own result.
        let mut x = Tensor::zeros(1, DType::F32, &g).unwrap();
        for i in 1..=2000 {
            x = (&x + 1.0).unwrap();
            if i % 7 == 0 {
                assert_eq!(x.to_scalar::<f32>().unwrap(), i as f32);
            }
        }
    });
}
