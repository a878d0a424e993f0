//! After a device fault nothing read is ever silently wrong: a kernel that
//! fails on an asynchronous device (here a bad `index_select` index) is
//! reported once, by the first synchronising call on that device, and every
//! result it concerns is *poisoned*: the failed kernel's output, the work
//! queued after it until the report (on CUDA, every kernel since the last
//! synchronising call that found no fault), anything computed from those,
//! on that device or copied to another, return the original fault on every
//! read until recomputed. The device works again after the report.
//!
//! Runs on two simulated GPUs of this binary's own, and on CUDA devices
//! when there are some (`scripts/cudasim.sh` in CI). The tests take one lock:
//! a fault is reported to whichever call synchronises its device first.

mod common;

use common::serial;
use kiln::{memory_stats, synchronize, DType, Device, Error, Tensor};

/// Pairs of devices (the faulting one, another): two simulated GPUs of this
/// binary's own, and each CUDA device with a second one (CUDA, or a
/// simulated GPU when it is alone).
fn pairs() -> Vec<(Device, Device)> {
    let sims = common::own_sims(2, 256 << 20);
    let mut pairs = vec![(sims[0], sims[1])];
    let cuda = common::cuda_devices();
    for (i, &c) in cuda.iter().enumerate() {
        let other = if cuda.len() > 1 { cuda[(i + 1) % cuda.len()] } else { sims[1] };
        pairs.push((c, other));
    }
    pairs
}

fn is_sim(d: Device) -> bool {
    common::own_sims(2, 256 << 20).contains(&d)
}

/// True when `r` is the bad index's failure on `d`.
fn is_the_fault<T: std::fmt::Debug>(r: &kiln::Result<T>, d: Device) -> bool {
    matches!(r, Err(Error::KernelFailed { device, op, msg }) if *device == d && op == "index_select" && msg.contains("out of range"))
}

fn read(t: &kiln::Result<Tensor>) -> kiln::Result<Vec<f32>> {
    match t {
        Ok(t) => t.to_vec::<f32>(),
        Err(e) => Err(e.clone()),
    }
}

/// x = [[1, 2], [3, 4], [5, 6]] on `d`.
fn x_on(d: Device) -> Tensor {
    Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &d).unwrap()
}

/// A freed tensor of 1234.5s: a skipped kernel's output would read them
/// back from the reused buffer.
fn leave_garbage(d: Device) {
    let junk = Tensor::full(1234.5, (2, 2), DType::F32, &d).unwrap();
    junk.block_until_ready().unwrap();
    drop(junk);
    // A clean synchronisation point: what was made so far is trusted.
    synchronize(&d).unwrap();
}

/// x's rows 0 and 7: row 7 does not exist. The call itself succeeds on a GPU.
fn bad_index_select(x: &Tensor, d: Device) -> Tensor {
    let ids = Tensor::new(&[0i64, 7], &d).unwrap();
    x.index_select(&ids, 0).unwrap()
}

/// The fuzzer's program: a bad `index_select`, then rand_uniform, add,
/// matmul and a copy to the other device (and work there on it), then
/// reads of everything, in several orders. The first read on the faulting
/// device reports the fault; every read of a tensor made after the fault,
/// or derived from one, returns it, however often; tensors made before the
/// fault read correctly after the report; fresh tensors compute correctly.
#[test]
fn after_a_fault_every_read_of_an_affected_tensor_returns_the_fault() {
    let _s = serial();
    for (d, d1) in pairs() {
        const NAMES: [&str; 8] = ["before", "bad", "rand", "sum", "product", "copy", "copy_derived", "rand_derived"];
        let n = NAMES.len();
        // Every rotation of the read order, forwards and backwards.
        let mut orders: Vec<Vec<usize>> = Vec::new();
        for k in 0..n {
            let fwd: Vec<usize> = (0..n).map(|i| (i + k) % n).collect();
            orders.push(fwd.iter().rev().copied().collect());
            orders.push(fwd);
        }
        for order in orders {
            let x = x_on(d);
            let before = x.mul_scalar(10.0).unwrap();
            leave_garbage(d);
            let bad = bad_index_select(&x, d);
            let rand = Tensor::rand_uniform(0.0, 1.0, (2, 2), DType::F32, &d).unwrap();
            let sum = (&bad + &rand).unwrap();
            let product = rand.matmul(&rand).unwrap();
            // A copy to the other device: on simulated GPUs (and CUDA peers)
            // queued without the host; through the host it synchronises `d`,
            // and so reports the fault itself.
            let copy = rand.to(&d1);
            let mut reported = copy.is_err();
            if let Err(e) = &copy {
                assert!(!is_sim(d), "a copy between simulated GPUs does not synchronise: {e}");
                assert!(is_the_fault(&copy, d), "{copy:?}");
            }
            let copy_derived = copy.as_ref().map_err(Clone::clone).and_then(|c| c.mul_scalar(2.0));
            let rand_derived = rand.add_scalar(1.0).unwrap();
            let tensors: Vec<kiln::Result<Tensor>> = vec![
                Ok(before.clone()),
                Ok(bad.clone()),
                Ok(rand.clone()),
                Ok(sum.clone()),
                Ok(product.clone()),
                copy.clone(),
                copy_derived.clone(),
                Ok(rand_derived.clone()),
            ];
            for round in 0..2 {
                for &i in &order {
                    let got = read(&tensors[i]);
                    let on_d = !matches!(NAMES[i], "copy" | "copy_derived");
                    if NAMES[i] == "before" {
                        if reported {
                            assert_eq!(got.as_ref().ok(), Some(&vec![10f32, 20., 30., 40., 50., 60.]), "{d}: before, order {order:?}");
                        } else {
                            // The first synchronising call on `d` reports the fault, whatever it reads.
                            assert!(is_the_fault(&got, d), "{d}: the first read (of `before`) must report the fault: {got:?}");
                        }
                    } else {
                        assert!(
                            is_the_fault(&got, d),
                            "{d}: read {round} of `{}` (made after the fault), order {order:?}: expected the fault, got {got:?}",
                            NAMES[i]
                        );
                    }
                    if on_d {
                        reported = true;
                    }
                }
            }
            // Reported once: `d` synchronises cleanly now, and works again.
            synchronize(&d).unwrap();
            synchronize(&d1).unwrap();
            let fresh = (&x.mul_scalar(2.0).unwrap() + 1.0).unwrap();
            assert_eq!(fresh.to_vec::<f32>().unwrap(), vec![3., 5., 7., 9., 11., 13.], "{d}: a fresh tensor after the report");
            let good = x.index_select(&Tensor::new(&[2i64, 0], &d).unwrap(), 0).unwrap();
            assert_eq!(good.to_vec::<f32>().unwrap(), vec![5., 6., 1., 2.]);
            let r = Tensor::rand_uniform(0.0, 1.0, (64,), DType::F32, &d).unwrap().to(&d1).unwrap();
            assert!(r.to_vec::<f32>().unwrap().iter().all(|v| (0.0..1.0).contains(v)), "{d}: fresh rand copied to {d1}");
            // Still poisoned, however many synchronising calls later.
            assert!(is_the_fault(&read(&Ok(sum)), d));
            assert!(is_the_fault(&read(&Ok(rand)), d));
        }
    }
}

/// Printing a poisoned tensor shows the error instead of values, and the
/// mark stays: a later explicit read returns the fault.
#[test]
fn printing_a_poisoned_tensor_shows_the_error_and_keeps_it() {
    let _s = serial();
    for (d, _) in pairs() {
        let x = x_on(d);
        leave_garbage(d);
        let bad = bad_index_select(&x, d);
        let rand = Tensor::rand_uniform(0.0, 1.0, (2, 2), DType::F32, &d).unwrap();
        // The first print takes the report...
        let text = format!("{rand}");
        assert!(text.contains("not readable") && text.contains("index_select"), "{d}: {text}");
        assert!(!text.contains("1234.5"), "{d}: {text}");
        // ... and later ones, and explicit reads, still see the fault.
        for t in [&rand, &bad] {
            let text = format!("{t}");
            assert!(text.contains("not readable") && text.contains("index_select"), "{d}: {text}");
            assert!(is_the_fault(&t.to_vec::<f32>(), d));
        }
        let derived = rand.exp().unwrap();
        let text = format!("{derived}");
        assert!(text.contains("not readable") && text.contains("out of range"), "{d}: {text}");
        synchronize(&d).unwrap();
    }
}

/// Another thread's work queued after the fault is poisoned too, whichever
/// thread's read reports the fault; tensors made before it read correctly.
#[test]
fn another_threads_tensors_after_the_fault_are_poisoned_too() {
    let _s = serial();
    for (d, _) in pairs() {
        let x = x_on(d);
        let a = Tensor::new(&[1f32, 2., 3.], &d).unwrap();
        leave_garbage(d);
        let bad = bad_index_select(&x, d);
        let a2 = a.clone();
        let (y, first, second) = std::thread::spawn(move || {
            let y = a2.mul_scalar(3.0).unwrap();
            let first = y.to_vec::<f32>();
            let second = y.to_vec::<f32>();
            (y, first, second)
        })
        .join()
        .unwrap();
        assert!(is_the_fault(&first, d), "{d}: {first:?}");
        assert!(is_the_fault(&second, d), "{d}: {second:?}");
        assert!(is_the_fault(&y.add_scalar(1.0).unwrap().to_vec::<f32>(), d));
        assert!(is_the_fault(&bad.to_vec::<f32>(), d));
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1., 2., 3.], "{d}: made before the fault");
        synchronize(&d).unwrap();
    }
}

/// A tensor skipped after the fault and copied to the other device errors
/// when read there, and so does what is computed from it there, even after
/// both devices have synchronised.
#[test]
fn a_poisoned_tensor_copied_to_another_device_errors_there() {
    let _s = serial();
    for (d, d1) in pairs() {
        let x = x_on(d);
        leave_garbage(d);
        let _bad = bad_index_select(&x, d);
        let rand = Tensor::rand_uniform(0.0, 1.0, (2, 2), DType::F32, &d).unwrap();
        let copied = match rand.to(&d1) {
            Ok(c) => c,
            Err(e) => {
                // Through the host (a CUDA device and a simulated GPU): the
                // copy reads, and so reports the fault at once.
                assert!(!is_sim(d), "{e}");
                assert!(is_the_fault(&Err::<(), _>(e), d));
                synchronize(&d).unwrap();
                continue;
            }
        };
        assert_eq!(copied.device(), d1);
        let there = copied.mul_scalar(2.0).unwrap();
        // `d1` itself has no failure to report.
        synchronize(&d1).unwrap();
        assert!(is_the_fault(&copied.to_vec::<f32>(), d), "{d} -> {d1}");
        assert!(is_the_fault(&there.to_vec::<f32>(), d), "{d} -> {d1}");
        // The report on `d`, then the copies still carry it.
        assert!(is_the_fault(&synchronize(&d), d));
        assert!(is_the_fault(&copied.to_vec::<f32>(), d));
        assert!(is_the_fault(&copied.to(&kiln::cpu()).map(|_| ()), d));
        assert!(is_the_fault(&there.to(&d).and_then(|t| t.to_vec::<f32>()), d));
        // Fresh copies are fine.
        assert_eq!(x.to(&d1).unwrap().to_vec::<f32>().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
    }
}

/// A kernel that succeeds writing all of a poisoned storage recomputes it;
/// one that writes part of it, or reads a poisoned input, leaves it marked.
#[test]
fn an_in_place_recompute_clears_the_mark() {
    let _s = serial();
    for (d, _) in pairs() {
        let x = x_on(d);
        let clean = Tensor::new(&[7f32, 8., 9., 10.], &d).unwrap();
        leave_garbage(d);
        let _bad = bad_index_select(&x, d);
        let y = Tensor::rand_uniform(0.0, 1.0, (4,), DType::F32, &d).unwrap();
        let z = Tensor::rand_uniform(0.0, 1.0, (4,), DType::F32, &d).unwrap();
        assert!(is_the_fault(&synchronize(&d), d));
        assert!(is_the_fault(&y.to_vec::<f32>(), d));
        // Whole: recomputed.
        y.assign(&Tensor::new(&[1f32, 2., 3., 4.], &d).unwrap()).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![1., 2., 3., 4.], "{d}");
        assert_eq!((&y + 1.0).unwrap().to_vec::<f32>().unwrap(), vec![2., 3., 4., 5.], "{d}");
        // In part: the rest is still the skipped kernel's.
        z.narrow(0, 0, 2).unwrap().assign(&Tensor::ones(2, DType::F32, &d).unwrap()).unwrap();
        assert!(is_the_fault(&z.to_vec::<f32>(), d), "{d}: a partial write must keep the mark");
        // A clean storage overwritten from a poisoned one takes its fault.
        clean.assign(&z).unwrap();
        assert!(is_the_fault(&clean.to_vec::<f32>(), d), "{d}: written from a poisoned input");
        // An in-place op reading the poisoned storage keeps the mark.
        let ids = Tensor::new(&[0i64, 1], &d).unwrap();
        let added = z.index_add(&ids, &Tensor::ones(2, DType::F32, &d).unwrap(), 0).unwrap();
        assert!(is_the_fault(&added.to_vec::<f32>(), d));
        // The whole of z, written again: recomputed, and so is `clean`.
        z.assign(&Tensor::zeros(4, DType::F32, &d).unwrap()).unwrap();
        clean.assign(&z.add_scalar(5.0).unwrap()).unwrap();
        assert_eq!(z.to_vec::<f32>().unwrap(), vec![0.; 4], "{d}");
        assert_eq!(clean.to_vec::<f32>().unwrap(), vec![5.; 4], "{d}");
        synchronize(&d).unwrap();
    }
}

/// An optimizer step over one poisoned gradient poisons that parameter and
/// its new state, and steps the others as if nothing had happened (on CUDA
/// one multi-tensor launch leaves the poisoned part out; elsewhere its
/// kernels pass the mark on); the step itself does not fail.
#[test]
fn an_optimizer_step_over_a_poisoned_gradient_poisons_only_that_parameter() {
    use kiln::optim::{Adam, Optimizer, Sgd};
    let _s = serial();
    for (d, _) in pairs() {
        for adam in [false, true] {
            let make = |dev: &Device| -> Vec<Tensor> {
                (0..3).map(|i| Tensor::new(&[[1f32 + i as f32, 2.], [3., 4.]], dev).unwrap().requires_grad_()).collect()
            };
            let optimizer = |ps: &[Tensor]| -> Box<dyn Optimizer> {
                if adam {
                    Box::new(Adam::new(ps.to_vec(), 0.1))
                } else {
                    Box::new(Sgd::new(ps.to_vec(), 0.1).momentum(0.9))
                }
            };
            // The reference: the same step on the CPU.
            let want = make(&kiln::cpu());
            let mut reference = optimizer(&want);
            let (ps, x) = (make(&d), x_on(d));
            let mut opt = optimizer(&ps);
            for (p, w) in ps.iter().zip(&want) {
                p.sqr().unwrap().sum_all().unwrap().backward().unwrap();
                w.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            }
            reference.step().unwrap();
            leave_garbage(d);
            ps[1].set_grad(Some(bad_index_select(&x, d))).unwrap();
            assert!(is_the_fault(&synchronize(&d), d));
            opt.step().unwrap();
            let name = if adam { "Adam" } else { "SGD" };
            for i in [0, 2] {
                assert_eq!(ps[i].to_vec::<f32>().unwrap(), want[i].to_vec::<f32>().unwrap(), "{name} on {d}: parameter {i}");
            }
            assert!(is_the_fault(&ps[1].to_vec::<f32>(), d), "{name} on {d}: the parameter of the poisoned gradient");
            let state = opt.state_dict().unwrap();
            for (key, t) in &state.buffers {
                let got = t.to_vec::<f32>();
                if key.starts_with("1.") {
                    assert!(is_the_fault(&got, d), "{name} on {d}: state {key}: {got:?}");
                } else {
                    assert_eq!(got.unwrap(), reference.state_dict().unwrap().buffers[key].to_vec::<f32>().unwrap(), "{name} on {d}: {key}");
                }
            }
            synchronize(&d).unwrap();
        }
    }
}

/// A collective over a poisoned input poisons every device's result.
#[test]
fn a_collective_over_a_poisoned_input_poisons_every_output() {
    let _s = serial();
    let sims = common::own_sims(2, 256 << 20);
    let (d0, d1) = (sims[0], sims[1]);
    let x = x_on(d0);
    leave_garbage(d0);
    let _bad = bad_index_select(&x, d0);
    let a = Tensor::rand_uniform(0.0, 1.0, (1000,), DType::F32, &d0).unwrap();
    let b = Tensor::ones(1000, DType::F32, &d1).unwrap();
    kiln::comm::all_reduce_(&[a.clone(), b.clone()], kiln::comm::ReduceOp::Sum).unwrap();
    assert!(is_the_fault(&b.to_vec::<f32>(), d0), "the other device's result");
    assert!(is_the_fault(&a.to_vec::<f32>(), d0));
    assert!(is_the_fault(&b.to_vec::<f32>(), d0), "read again");
    let _ = synchronize(&d0);
    let _ = synchronize(&d1);
    // Fresh collectives work.
    let a = Tensor::ones(1000, DType::F32, &d0).unwrap();
    let b = Tensor::ones(1000, DType::F32, &d1).unwrap();
    kiln::comm::all_reduce_(&[a.clone(), b.clone()], kiln::comm::ReduceOp::Sum).unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![2.; 1000]);
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![2.; 1000]);
}

/// Poisoned tensors free their memory like any other: after dropping
/// everything, memory is back where it started on both devices.
#[test]
fn memory_returns_to_baseline_after_dropping_poisoned_tensors() {
    let _s = serial();
    for (d, d1) in pairs() {
        synchronize(&d).unwrap();
        synchronize(&d1).unwrap();
        let base = (memory_stats(&d).unwrap().in_use, memory_stats(&d1).unwrap().in_use);
        {
            let x = x_on(d);
            leave_garbage(d);
            let bad = bad_index_select(&x, d);
            let rand = Tensor::rand_uniform(0.0, 1.0, (256, 256), DType::F32, &d).unwrap();
            let product = rand.matmul(&rand).unwrap();
            let sum = (&product + &bad.sum_all().unwrap()).unwrap();
            let copy = sum.to(&d1);
            assert!(is_the_fault(&sum.to_vec::<f32>(), d));
            if let Ok(c) = &copy {
                assert!(is_the_fault(&c.to_vec::<f32>(), d));
            }
            drop((x, bad, rand, product, sum, copy));
        }
        let _ = synchronize(&d);
        synchronize(&d).unwrap();
        synchronize(&d1).unwrap();
        let now = (memory_stats(&d).unwrap().in_use, memory_stats(&d1).unwrap().in_use);
        assert_eq!(now, base, "{d}, {d1}: bytes in use after dropping everything");
    }
}
