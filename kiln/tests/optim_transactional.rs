//! A failed optimizer step changes nothing: parameters, SGD momentum, Adam
//! moments and step counter stay bit-identical when a step runs out of
//! memory part-way (issue 9).

use kiln::optim::{Adam, Optimizer, Sgd};
use kiln::{DType, Device, DeviceKind, Error, Tensor};

/// A simulated GPU only this binary uses, with 1 MiB.
fn small_gpu() -> Device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    *DEV.get_or_init(|| {
        let existing = kiln::devices().iter().filter(|d| d.kind == DeviceKind::Simulated).count();
        kiln::ensure_simulated_gpus(existing + 1, 1 << 20)[existing]
    })
}

/// The tests fill the one small GPU: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

/// Takes steps with less and less memory free (from `max_kib` KiB down to
/// none, 1 KiB at a time); every step that runs out of memory must leave the
/// parameters and `state` bit-identical. Returns how many failed.
fn steps_under_pressure<O: Optimizer, S: PartialEq + std::fmt::Debug>(
    dev: Device,
    ps: &[Tensor],
    opt: &mut O,
    max_kib: usize,
    state: impl Fn(&O) -> S,
) -> usize {
    let mut failures = 0;
    for free in (0..max_kib).rev().map(|k| k * 1024) {
        // Pending kernels hold their temporaries: let them finish first.
        kiln::synchronize(&dev).unwrap();
        let stats = kiln::memory_stats(&dev).unwrap();
        let fill = stats.capacity.unwrap_or(0).saturating_sub(stats.in_use).saturating_sub(free);
        let Ok(ballast) = Tensor::zeros(fill, DType::U8, &dev) else { continue };
        let before = (ps.iter().map(bits).collect::<Vec<_>>(), state(opt));
        match opt.step() {
            Ok(()) => {}
            Err(Error::OutOfMemory { .. }) => {
                failures += 1;
                assert_eq!(
                    (ps.iter().map(bits).collect::<Vec<_>>(), state(opt)),
                    before,
                    "a failed step with {free} bytes free changed something"
                );
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
        drop(ballast);
    }
    failures
}

fn params(dev: Device) -> Vec<Tensor> {
    (0..3).map(|i| Tensor::rand_uniform(-1.0, 1.0, 1024 + i, DType::F32, &dev).unwrap().requires_grad_()).collect()
}

#[test]
fn sgd_with_momentum_step_is_all_or_nothing() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = small_gpu();
    let ps = params(dev);
    let mut opt = Sgd::new(ps.clone(), 0.1).momentum(0.9).weight_decay(0.01);
    // One step first, so that there is momentum to keep.
    for p in &ps {
        p.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    }
    opt.step().unwrap();
    let failures =
        steps_under_pressure(dev, &ps, &mut opt, 40, |o: &Sgd| (0..3).map(|i| o.velocity(i).as_ref().map(bits)).collect::<Vec<_>>());
    assert!(failures > 3, "only {failures} steps ran out of memory");
    // And it still works once memory is back.
    let before = bits(&ps[0]);
    opt.step().unwrap();
    assert_ne!(bits(&ps[0]), before);
}

#[test]
fn adam_step_is_all_or_nothing_including_its_step_counter() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = small_gpu();
    let ps = params(dev);
    let mut opt = Adam::new(ps.clone(), 0.01).weight_decay(0.01);
    for p in &ps {
        p.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    }
    opt.step().unwrap();
    let state = |o: &Adam| {
        let mut s: Vec<Option<Vec<u32>>> = Vec::new();
        for i in 0..3 {
            let (m, v) = o.moments(i);
            s.push(m.as_ref().map(bits));
            s.push(v.as_ref().map(bits));
        }
        (s, o.steps_taken())
    };
    let failures = steps_under_pressure(dev, &ps, &mut opt, 60, state);
    assert!(failures > 3, "only {failures} steps ran out of memory");
    let steps = opt.steps_taken();
    opt.step().unwrap();
    assert_eq!(opt.steps_taken(), steps + 1);
}
