//! The CPU device, which the whole process shares: memory booked per
//! thread and exact across threads, storages kept per thread and never
//! reused while referenced, in-place writes seen through every view,
//! readers racing a first write, temporaries overwritten only when nothing
//! else sees them, and the dense path of small elementwise kernels against
//! the general one. Each is checked for exactness.
//!
//! The tests of this binary book memory on the CPU: they run one at a time
//! (`serial`).

mod common;

use common::{serial, within};
use kiln::{cpu, memory_stats, reset_peak_memory, BinaryOp, DType, Error, Tensor, UnaryOp};
use std::sync::{Arc, Barrier};

#[test]
fn cpu_memory_booked_on_one_thread_and_freed_on_another_is_exact() {
    let _s = serial();
    let base = memory_stats(&cpu()).unwrap();
    let sizes: Vec<usize> = (0..100).map(|i| 1 + i * 37 % 5000).collect();
    let bytes: usize = sizes.iter().map(|n| n * 4).sum();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<Tensor>>();
    let made = std::thread::spawn(move || {
        let ts: Vec<Tensor> = sizes.iter().map(|&n| Tensor::ones(n, DType::F32, &cpu()).unwrap()).collect();
        tx.send(ts).unwrap();
    });
    made.join().unwrap();
    let tensors = rx.recv().unwrap();
    // The making thread has exited: its booking outlives it.
    let held = memory_stats(&cpu()).unwrap();
    assert_eq!((held.in_use, held.live_tensors), (base.in_use + bytes, base.live_tensors + 100));
    // Freed on a third thread.
    std::thread::spawn(move || drop(tensors)).join().unwrap();
    let after = memory_stats(&cpu()).unwrap();
    assert_eq!((after.in_use, after.live_tensors), (base.in_use, base.live_tensors));
}

#[test]
fn cpu_memory_is_exact_with_more_live_threads_than_booking_slots() {
    let _s = serial();
    let base = memory_stats(&cpu()).unwrap();
    // More threads at once than the 256 per-thread slots: the rest book in
    // the shared counters.
    let n = 300;
    let all_hold = Arc::new(Barrier::new(n + 1));
    let checked = Arc::new(Barrier::new(n + 1));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (all_hold, checked) = (all_hold.clone(), checked.clone());
            std::thread::spawn(move || {
                let t = Tensor::zeros(i + 1, DType::U8, &cpu()).unwrap();
                all_hold.wait();
                checked.wait();
                drop(t);
            })
        })
        .collect();
    all_hold.wait();
    let held = memory_stats(&cpu()).unwrap();
    assert_eq!((held.in_use, held.live_tensors), (base.in_use + n * (n + 1) / 2, base.live_tensors + n));
    checked.wait();
    for t in threads {
        t.join().unwrap();
    }
    let after = memory_stats(&cpu()).unwrap();
    assert_eq!((after.in_use, after.live_tensors), (base.in_use, base.live_tensors));
}

#[test]
fn cpu_peak_is_the_largest_total_since_the_reset() {
    let _s = serial();
    let base = memory_stats(&cpu()).unwrap().in_use;
    reset_peak_memory(&cpu()).unwrap();
    assert_eq!(memory_stats(&cpu()).unwrap().peak, base);
    let a = Tensor::zeros(1 << 20, DType::U8, &cpu()).unwrap();
    drop(a);
    let b = Tensor::zeros(3 << 20, DType::U8, &cpu()).unwrap();
    let c = Tensor::zeros(1, DType::F64, &cpu()).unwrap();
    drop(b);
    let stats = memory_stats(&cpu()).unwrap();
    assert_eq!((stats.in_use, stats.peak), (base + 8, base + (3 << 20) + 8));
    drop(c);
    reset_peak_memory(&cpu()).unwrap();
    assert_eq!(memory_stats(&cpu()).unwrap().peak, base);
}

#[test]
fn a_refused_cpu_request_books_nothing_on_any_thread() {
    let _s = serial();
    let base = memory_stats(&cpu()).unwrap();
    let refused = std::thread::spawn(|| Tensor::zeros(1usize << 60, DType::U8, &cpu())).join().unwrap();
    assert!(matches!(refused, Err(Error::OutOfMemory { .. })), "{refused:?}");
    let after = memory_stats(&cpu()).unwrap();
    assert_eq!((after.in_use, after.live_tensors), (base.in_use, base.live_tensors));
}

#[test]
fn a_storage_still_referenced_is_never_reused() {
    let _s = serial();
    let x = Tensor::new(&[1f32, 2., 3., 4.], &cpu()).unwrap();
    let alias = x.clone();
    let view = x.narrow(0, 1, 2).unwrap();
    drop(x);
    // Many storages made and dropped on this thread: any reuse of the
    // aliased storage would overwrite it.
    let mut acc = Tensor::zeros(4, DType::F32, &cpu()).unwrap();
    for _ in 0..1000 {
        acc = (&acc + 1.0).unwrap();
    }
    assert_eq!(acc.to_vec::<f32>().unwrap(), vec![1000.0; 4]);
    assert_eq!(alias.to_vec::<f32>().unwrap(), vec![1., 2., 3., 4.]);
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![2., 3.]);
    assert!(view.same_storage(&alias));
    // A storage dropped on another thread, then the last reference here.
    let shared = Tensor::new(&[7i64, 8], &cpu()).unwrap();
    let other = shared.clone();
    std::thread::spawn(move || drop(other)).join().unwrap();
    let again = Tensor::new(&[9i64, 10], &cpu()).unwrap();
    assert_eq!(shared.to_vec::<i64>().unwrap(), vec![7, 8]);
    drop(shared);
    assert_eq!(again.to_vec::<i64>().unwrap(), vec![9, 10]);
}

/// Values of `dtype` for the comparison of the dense and general paths:
/// zeros (integer division by zero), negatives, NaN and infinities for floats.
fn values(dtype: DType, n: usize, salt: u64) -> Tensor {
    let v: Vec<f64> = (0..n)
        .map(|i| {
            let k = (i as u64).wrapping_mul(2654435761).wrapping_add(salt) % 23;
            match (dtype.is_float(), k) {
                (true, 0) => f64::NAN,
                (true, 1) => f64::INFINITY,
                (true, 2) => -0.0,
                (_, 3) => 0.0,
                (false, _) if dtype == DType::U8 => (k * 11) as f64,
                _ => k as f64 - 9.5 * dtype.is_float() as u8 as f64 - 9.0,
            }
        })
        .collect();
    Tensor::from_vec(v, n, &cpu()).unwrap().to_dtype(dtype).unwrap()
}

/// The same elements as `t` through a strided view (the general path).
fn strided(t: &Tensor) -> Tensor {
    let two = Tensor::stack(&[t, t], 1).unwrap(); // (n, 2), contiguous
    two.narrow(1, 0, 1).unwrap().squeeze(1).unwrap() // stride 2: a view
}

fn same_bits(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dtype(), b.dtype(), "{what}: dtype");
    assert_eq!(a.dims(), b.dims(), "{what}: shape");
    let (x, y) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        assert!(p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()), "{what}: element {i}: dense {p}, general {q}");
    }
}

#[test]
fn the_dense_path_computes_what_the_general_path_computes() {
    let _s = serial();
    let binary = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::SigmoidBackward,
        BinaryOp::TanhBackward,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
    ];
    let unary = [UnaryOp::Neg, UnaryOp::Abs, UnaryOp::Sqr, UnaryOp::Relu, UnaryOp::AddScalar(2.0), UnaryOp::MulScalar(-3.0), UnaryOp::Exp];
    for dtype in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8] {
        // 1 element, a short run, and a run just above the dense path's limit.
        for n in [1, 37, 5000] {
            let (a, b) = (values(dtype, n, 1), values(dtype, n, 7));
            assert!(a.is_contiguous() && (n == 1 || !strided(&a).is_contiguous()));
            for op in binary {
                let dense = a.binary(&b, op);
                let general = strided(&a).binary(&strided(&b), op);
                match (dense, general) {
                    (Ok(d), Ok(g)) => same_bits(&d, &g, &format!("{op:?} {dtype} n={n}")),
                    (Err(d), Err(g)) => assert_eq!(d.to_string(), g.to_string()),
                    (d, g) => panic!("{op:?} {dtype}: dense {d:?}, general {g:?}"),
                }
            }
            for op in unary {
                match (a.unary(op), strided(&a).unary(op)) {
                    (Ok(d), Ok(g)) => same_bits(&d, &g, &format!("{op:?} {dtype} n={n}")),
                    (Err(d), Err(g)) => assert_eq!(d.to_string(), g.to_string()),
                    (d, g) => panic!("{op:?} {dtype}: dense {d:?}, general {g:?}"),
                }
            }
        }
    }
}

#[test]
fn the_dense_path_reads_offsets_and_one_storage_twice() {
    let _s = serial();
    let x = Tensor::new(&[1f32, 2., 3., 4., 5., 6.], &cpu()).unwrap();
    let tail = x.narrow(0, 3, 3).unwrap(); // dense, offset 3
    let head = x.narrow(0, 0, 3).unwrap();
    assert_eq!((&tail + &head).unwrap().to_vec::<f32>().unwrap(), vec![5., 7., 9.]);
    assert_eq!((&tail * &tail).unwrap().to_vec::<f32>().unwrap(), vec![16., 25., 36.]);
    assert_eq!((&x - &x).unwrap().to_vec::<f32>().unwrap(), vec![0.; 6]);
    assert_eq!(tail.lt(&head).unwrap().to_vec::<u8>().unwrap(), vec![0, 0, 0]);
}

#[test]
fn in_place_writes_are_seen_through_every_view_of_a_storage_made_by_an_op() {
    let _s = serial();
    let x = (Tensor::ones(8, DType::F32, &cpu()).unwrap() * 3.0).unwrap();
    let view = x.narrow(0, 2, 4).unwrap();
    assert_eq!((&view + &view).unwrap().to_vec::<f32>().unwrap(), vec![6.0; 4]);
    for v in [1.0f32, 2.0, 5.0] {
        x.assign(&Tensor::full(v as f64, 8, DType::F32, &cpu()).unwrap()).unwrap();
        assert_eq!((&view * 2.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0 * v; 4]);
    }
    assert_eq!(kiln::busy_threads(), 0, "no storage lock is left held");
}

#[test]
fn readers_racing_the_first_write_of_a_frozen_storage_see_old_or_new_values_never_a_mix() {
    let _s = serial();
    within(120, "readers racing first writes", || {
        let n = 4096; // the dense path's limit: both the dense and the general path read it
        for round in 0..200 {
            let x = (Tensor::ones(n, DType::F32, &cpu()).unwrap() * 1.0).unwrap(); // frozen
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let started = Arc::new(Barrier::new(2));
            let readers: Vec<_> = (0..2)
                .map(|r| {
                    let (x, stop, started) = (x.clone(), stop.clone(), started.clone());
                    std::thread::spawn(move || {
                        if r == 0 {
                            started.wait();
                        }
                        let mut reads = 0u64;
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) || reads == 0 {
                            // Dense path (two inputs, one storage) and general path (a reduction).
                            let doubled = (&x + &x).unwrap().to_vec::<f32>().unwrap();
                            assert!(
                                doubled.iter().all(|&v| v == doubled[0]) && (doubled[0] == 2.0 || doubled[0] == 4.0),
                                "round {round}: a torn read {:?}",
                                &doubled[..4]
                            );
                            let sum = x.sum_all().unwrap().to_scalar::<f32>().unwrap();
                            assert!(sum == n as f32 || sum == 2.0 * n as f32, "round {round}: a torn sum {sum}");
                            reads += 1;
                        }
                        reads
                    })
                })
                .collect();
            started.wait();
            x.assign(&Tensor::full(2.0, n, DType::F32, &cpu()).unwrap()).unwrap();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            for r in readers {
                assert!(r.join().unwrap() > 0);
            }
            assert_eq!(x.sum_all().unwrap().to_scalar::<f32>().unwrap(), 2.0 * n as f32);
        }
    });
}

#[test]
fn a_temporary_given_by_value_is_overwritten_only_when_nothing_else_sees_it() {
    let _s = serial();
    let n = 1 << 18; // 1 MiB of f32
    let x = Tensor::rand(n, &cpu()).unwrap();
    let reference = (&x.sqr().unwrap() - 0.5).unwrap().to_vec::<f32>().unwrap();
    // Elided: the temporary's buffer takes the result; nothing more is booked.
    let base = memory_stats(&cpu()).unwrap();
    reset_peak_memory(&cpu()).unwrap();
    let y = (x.sqr().unwrap() - 0.5).unwrap();
    let stats = memory_stats(&cpu()).unwrap();
    assert_eq!((stats.in_use, stats.peak), (base.in_use + 4 * n, base.in_use + 4 * n), "one buffer, not two");
    assert_eq!(y.to_vec::<f32>().unwrap(), reference);
    // A clone sees the tensor: it is not overwritten.
    let t = x.sqr().unwrap();
    let keep = t.clone();
    let z = (t - 0.5).unwrap();
    assert!(!z.same_storage(&keep));
    assert_eq!(z.to_vec::<f32>().unwrap(), reference);
    assert_eq!((&keep - 0.5).unwrap().to_vec::<f32>().unwrap(), reference);
    // A view shares its storage: the base tensor is untouched.
    let v = x.narrow(0, 1, 2).unwrap();
    let before = x.narrow(0, 1, 2).unwrap().to_vec::<f32>().unwrap();
    let w = (v + 1.0).unwrap();
    assert_eq!(x.narrow(0, 1, 2).unwrap().to_vec::<f32>().unwrap(), before);
    assert_eq!(w.to_vec::<f32>().unwrap(), before.iter().map(|v| v + 1.0).collect::<Vec<_>>());
    // An integer tensor with a fractional scalar promotes: a new f32 tensor.
    let i = Tensor::new(&[1i64, 2, 3], &cpu()).unwrap();
    let f = (i - 0.5).unwrap();
    assert_eq!((f.dtype(), f.to_vec::<f32>().unwrap()), (DType::F32, vec![0.5, 1.5, 2.5]));
    // -tensor and scalar - tensor by value too.
    let neg = (-Tensor::new(&[1f64, -2.0], &cpu()).unwrap()).unwrap();
    assert_eq!(neg.to_vec::<f64>().unwrap(), vec![-1.0, 2.0]);
    assert_eq!((10.0 - Tensor::new(&[1f32, 2.0], &cpu()).unwrap()).unwrap().to_vec::<f32>().unwrap(), vec![9.0, 8.0]);
}

#[test]
fn a_temporary_that_autograd_needs_is_not_overwritten() {
    let _s = serial();
    let w = Tensor::new(&[1f32, 2.0, 3.0], &cpu()).unwrap().requires_grad_();
    // `t` is recorded (sqr saves its input); `t * 2` by value must not write over it.
    let t = w.sqr().unwrap();
    let y = (t * 2.0).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![4.0, 8.0, 12.0]);
}
