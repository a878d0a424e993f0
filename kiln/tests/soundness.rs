//! Soundness under threads: one test per class of defect that the adversarial
//! review of the lock-free reads found (issue 16), each under a watchdog, each
//! checking exact values. Every storage is read under its lock now; these tests
//! keep it that way, and keep rayon's work-stealing and `fork` from turning a
//! lock into a deadlock or a torn read.
//!
//! - two to four first writers beside readers, on big and dense-path storages;
//! - writes on rayon workers beside a parallel kernel on an outside thread;
//! - a write nested in a parallel matmul on its own worker;
//! - `fork` while other threads read, and the child writes what they read;
//! - `index_add` never waits for another thread's kernel;
//! - the mix of all of these (first writes, reads, parallel kernels and
//!   optimizer steps) on 8 threads for `KILN_STRESS_SECS` seconds.

mod common;

use common::{serial, within};
use kiln::nn::Module;
use kiln::optim::{Optimizer, Sgd};
use kiln::{cpu, DType, Tensor};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn full(v: f64, n: usize) -> Tensor {
    Tensor::full(v, n, DType::F32, &cpu()).unwrap()
}

/// A tensor made by an operation (never written in place yet): the kind the
/// lock-free reads treated as frozen.
fn made_by_an_op(v: f64, n: usize) -> Tensor {
    (full(v, n) * 1.0).unwrap()
}

/// Readers sum `x` while `writers` threads assign constant tensors into it
/// at once, from its first write on. Every sum must be `n · v` for one of
/// the values ever stored: a mix of old and new elements is a torn read.
fn first_writers_beside_readers(n: usize, writers: usize, rounds: usize) {
    let torn = Arc::new(AtomicUsize::new(0));
    for round in 0..rounds {
        let x = made_by_an_op(1.0, n);
        let values: Vec<f64> = (0..writers).map(|w| 2.0 + w as f64).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let start = Arc::new(Barrier::new(writers + 3));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (x, stop, start, torn, values) = (x.clone(), stop.clone(), start.clone(), torn.clone(), values.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let mut reads = 0;
                    while !stop.load(Ordering::Acquire) || reads < 3 {
                        let s = x.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
                        if s != n as f64 && !values.iter().any(|v| s == v * n as f64) {
                            torn.fetch_add(1, Ordering::Relaxed);
                        }
                        reads += 1;
                    }
                })
            })
            .collect();
        let ws: Vec<_> = values
            .iter()
            .map(|&v| {
                let (x, start) = (x.clone(), start.clone());
                let src = full(v, n);
                std::thread::spawn(move || {
                    start.wait();
                    for _ in 0..3 {
                        x.assign(&src).unwrap();
                    }
                })
            })
            .collect();
        start.wait();
        for w in ws {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Release);
        for r in readers {
            r.join().unwrap();
        }
        assert_eq!(torn.load(Ordering::Relaxed), 0, "round {round}: a reader saw a mix of old and new values");
    }
}

#[test]
fn two_to_four_first_writers_beside_readers_never_tear_a_big_storage() {
    let _s = serial();
    within(120, "first writers on 2^20 elements", || {
        for writers in 2..=4 {
            first_writers_beside_readers(1 << 20, writers, 60);
        }
    });
}

#[test]
fn two_to_four_first_writers_beside_readers_never_tear_a_dense_path_storage() {
    let _s = serial();
    within(120, "first writers on 4096 elements", || {
        for writers in 2..=4 {
            first_writers_beside_readers(4096, writers, 150);
        }
    });
}

#[test]
fn writes_on_rayon_workers_beside_a_parallel_kernel_on_an_outside_thread_make_progress() {
    let _s = serial();
    within(60, "writes on rayon workers beside a parallel sum", || {
        let big = made_by_an_op(1.0, 1 << 20);
        let stop = Arc::new(AtomicBool::new(false));
        let sums = Arc::new(AtomicU64::new(0));
        let outside = {
            let (big, stop, sums) = (big.clone(), stop.clone(), sums.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    assert_eq!(big.sum_all().unwrap().to_scalar::<f32>().unwrap(), (1 << 20) as f32);
                    sums.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        let two = full(2.0, 1 << 16);
        for _ in 0..40 {
            let fresh: Vec<Tensor> = (0..32).map(|_| made_by_an_op(1.0, 1 << 16)).collect();
            fresh.par_iter().for_each(|p| p.assign(&two).unwrap());
            for p in &fresh {
                assert_eq!(p.sum_all().unwrap().to_scalar::<f32>().unwrap(), 2.0 * (1 << 16) as f32);
            }
        }
        stop.store(true, Ordering::Release);
        outside.join().unwrap();
        assert!(sums.load(Ordering::Relaxed) > 0);
    });
}

/// Small integers: every product is exact in f32 whatever the order of the
/// additions, so a product is either the old one or the new one exactly.
fn int_matrix(n: usize, seed: u64) -> Vec<f32> {
    (0..n * n).map(|i| ((i as u64).wrapping_mul(2654435761).wrapping_add(seed) % 3) as f32).collect()
}

#[test]
fn a_write_nested_in_a_parallel_matmul_on_its_own_worker_neither_tears_nor_deadlocks() {
    let _s = serial();
    within(120, "a write nested in a parallel matmul", || {
        let n = 512; // well above the size where a matmul spreads over threads
        let (old, new) = (int_matrix(n, 1), int_matrix(n, 7));
        let b = Tensor::from_vec(int_matrix(n, 3), (n, n), &cpu()).unwrap();
        let (new_t, old_t) = (Tensor::from_vec(new, (n, n), &cpu()).unwrap(), Tensor::from_vec(old, (n, n), &cpu()).unwrap());
        let want_old = old_t.matmul(&b).unwrap().to_vec::<f32>().unwrap();
        let want_new = new_t.matmul(&b).unwrap().to_vec::<f32>().unwrap();
        let torn = AtomicUsize::new(0);
        let deadline = Instant::now() + Duration::from_secs(6);
        let mut rounds = 0;
        // More workers than cores: idle ones steal pieces of a matmul, and
        // the worker that waits for them steals the jobs queued beside it.
        let users = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
        while Instant::now() < deadline {
            // A fresh `a` each round, made by an op and never written yet.
            let a = (&old_t * 1.0).unwrap();
            users.install(|| {
                (0..32).into_par_iter().for_each(|j| {
                    if j % 2 == 1 {
                        a.assign(if j % 4 == 1 { &new_t } else { &old_t }).unwrap();
                    } else {
                        let p = a.matmul(&b).unwrap().to_vec::<f32>().unwrap();
                        if p != want_old && p != want_new {
                            torn.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            });
            rounds += 1;
        }
        assert_eq!(torn.load(Ordering::Relaxed), 0, "{rounds} rounds: products mixing old and new values of `a`");
    });
}

#[test]
fn kernels_on_rayon_workers_run_on_the_worker_and_give_exact_results() {
    let _s = serial();
    within(60, "kernels on rayon workers", || {
        let x = Tensor::arange(0.0, (1 << 18) as f64, 1.0, &cpu()).unwrap().to_dtype(DType::F64).unwrap();
        let want = ((1u64 << 18) * ((1 << 18) - 1) / 2) as f64;
        let sums: Vec<f64> = (0..32).into_par_iter().map(|_| x.sum_all().unwrap().to_scalar::<f64>().unwrap()).collect();
        assert!(sums.iter().all(|&s| s == want), "{sums:?}");
    });
}

#[cfg(unix)]
#[test]
fn fork_while_other_threads_read_leaves_the_child_able_to_write_what_they_read() {
    let _s = serial();
    // Each child is killed by its own alarm after 8 s and reaped within 10 s,
    // so no hung child outlives the test (holding the harness's output open).
    within(300, "fork beside readers", || {
        let big = made_by_an_op(1.0, 1 << 20);
        let small = made_by_an_op(1.0, 512);
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = [big.clone(), small.clone(), big.clone()]
            .into_iter()
            .map(|x| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let n = x.elem_count() as f32;
                    while !stop.load(Ordering::Acquire) {
                        assert_eq!(x.sum_all().unwrap().to_scalar::<f32>().unwrap(), n);
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        let mut hung = 0;
        for _ in 0..20 {
            // SAFETY: the child only runs kiln operations and leaves with
            // `_exit`, never returning into the test harness.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                // SAFETY: a plain system call; SIGALRM's default action ends the child.
                unsafe { libc::alarm(8) };
                let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // Writes to the storages the parent's threads were reading,
                    // a parallel-sized kernel (the pool's threads are gone here),
                    // and a fresh tensor.
                    big.assign(&full(3.0, 1 << 20)).unwrap();
                    small.assign(&full(3.0, 512)).unwrap();
                    let s = big.sum_all().unwrap().to_scalar::<f32>().unwrap();
                    let m = made_by_an_op(2.0, 300 * 300).reshape((300, 300)).unwrap();
                    let p = m.matmul(&m).unwrap().to_vec::<f32>().unwrap();
                    let t = small.sum_all().unwrap().to_scalar::<f32>().unwrap();
                    (s == 3.0 * (1 << 20) as f32 && t == 3.0 * 512.0 && p.iter().all(|&v| v == 1200.0)) as i32
                }))
                .unwrap_or(2);
                // SAFETY: ends the child at once, without running the parent's atexit handlers.
                unsafe { libc::_exit(if code == 1 { 0 } else { 10 + code }) };
            }
            let start = Instant::now();
            let mut status = 0;
            loop {
                // SAFETY: waits for our own child.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child failed: status {status}");
                    break;
                }
                if start.elapsed() > Duration::from_secs(10) {
                    // SAFETY: kills our own hung child.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, &mut status, 0);
                    }
                    hung += 1;
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        stop.store(true, Ordering::Release);
        for r in readers {
            r.join().unwrap();
        }
        assert_eq!(hung, 0, "children that hung after a fork beside readers");
    });
}

#[test]
fn index_add_never_waits_for_a_kernel_of_another_thread() {
    let _s = serial();
    within(120, "index_add beside a big matmul", || {
        let n = 3000;
        let m = made_by_an_op(1.0, n * n).reshape((n, n)).unwrap();
        let started = Arc::new(Barrier::new(2));
        let done = Arc::new(AtomicBool::new(false));
        let other = {
            let (started, done) = (started.clone(), done.clone());
            std::thread::spawn(move || {
                started.wait();
                let p = m.matmul(&m).unwrap();
                done.store(true, Ordering::Release);
                assert_eq!(p.narrow(0, 0, 1).unwrap().narrow(1, 0, 1).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), n as f32);
            })
        };
        started.wait();
        std::thread::sleep(Duration::from_millis(30));
        let ids = Tensor::new(&[0i64, 2, 2], &cpu()).unwrap();
        let src = Tensor::ones((3, 4), DType::F32, &cpu()).unwrap();
        let mut finished_before_the_matmul = true;
        for _ in 0..50 {
            let dst = made_by_an_op(0.0, 16).reshape((4, 4)).unwrap();
            let y = dst.index_add(&ids, &src, 0).unwrap();
            assert_eq!(y.to_vec::<f32>().unwrap(), [vec![1.0; 4], vec![0.0; 4], vec![2.0; 4], vec![0.0; 4]].concat());
            finished_before_the_matmul &= !done.load(Ordering::Acquire);
        }
        other.join().unwrap();
        assert!(finished_before_the_matmul, "an index_add waited for another thread's matmul to finish");
    });
}

#[test]
fn eight_threads_of_first_writes_reads_parallel_kernels_and_optimizer_steps_stay_exact() {
    let _s = serial();
    let secs: u64 = std::env::var("KILN_STRESS_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    within(secs + 120, "the mixed soundness stress", move || {
        let n = 1 << 17; // parallel-sized
        let shared: Arc<Vec<Tensor>> = Arc::new((0..4).map(|_| made_by_an_op(1.0, n)).collect());
        let (ones, twos) = (full(1.0, n), full(2.0, n));
        let deadline = Instant::now() + Duration::from_secs(secs);
        let errors = Arc::new(AtomicUsize::new(0));
        let ops = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (shared, ones, twos, errors, ops) = (shared.clone(), ones.clone(), twos.clone(), errors.clone(), ops.clone());
                std::thread::spawn(move || {
                    let bad = |e: &AtomicUsize| e.fetch_add(1, Ordering::Relaxed);
                    // Each thread's own model: SGD steps with exact arithmetic.
                    let net = kiln::nn::Linear::new(4, 1, &cpu()).unwrap();
                    net.weight().assign(&Tensor::zeros((1, 4), DType::F32, &cpu()).unwrap()).unwrap();
                    let mut opt = Sgd::new(net.parameters(), 0.5);
                    let x = Tensor::ones((2, 4), DType::F32, &cpu()).unwrap();
                    let mut steps = 0f32;
                    let mut i = 0usize;
                    while Instant::now() < deadline {
                        let s = &shared[(t + i) % shared.len()];
                        match (t + i) % 4 {
                            0 => s.assign(if i.is_multiple_of(2) { &twos } else { &ones }).unwrap(),
                            1 => {
                                let v = s.sum_all().unwrap().to_scalar::<f32>().unwrap();
                                if v != n as f32 && v != 2.0 * n as f32 {
                                    bad(&errors);
                                }
                            }
                            2 => {
                                let fresh = made_by_an_op(0.0, n);
                                fresh.assign(s).unwrap();
                                let v = (&fresh * 2.0).unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                                let w = (&fresh * 2.0).unwrap().min_all().unwrap().to_scalar::<f32>().unwrap();
                                if v != w {
                                    bad(&errors);
                                }
                            }
                            _ => {
                                // loss = sum(w · x) so dL/dw = sum of x's rows = 2 per entry.
                                opt.zero_grad();
                                net.weight().matmul(&x.t().unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                                opt.step().unwrap();
                                steps += 1.0;
                                let w = net.weight().to_vec::<f32>().unwrap();
                                if w.iter().any(|&v| v != -steps) {
                                    bad(&errors);
                                }
                            }
                        }
                        i += 1;
                        ops.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(errors.load(Ordering::Relaxed), 0, "torn or wrong values in {} operations", ops.load(Ordering::Relaxed));
        assert!(ops.load(Ordering::Relaxed) > 8, "the threads made progress");
        assert_eq!(kiln::busy_threads(), 0, "no storage lock is left held");
    });
}
