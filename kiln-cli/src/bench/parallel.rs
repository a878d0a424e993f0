//! Many devices: `Comm` (an all-reduce on 2 and 4 simulated GPUs against
//! the ring's textbook cost, and on the CUDA devices present) and `Dp` (the
//! exercise the book's multi-GPU chapter ends with: a data-parallel epoch
//! of LeNet and of ResNet-18 on 1, 2 and 4 simulated GPUs, and on the CUDA
//! devices present, with the per-device batch fixed).

use super::{keep, round, Ctx, Row};
use crate::util::{CliError, Result};
use kiln::comm::{self, ReduceOp};
use kiln::models::{lenet, resnet18, synthetic_image_task};
use kiln::nn::Loss;
use kiln::optim::OptimizerConfig;
use kiln::sim::{self, SimLink};
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{Device, DeviceKind, Tensor};
use std::sync::mpsc;
use std::time::Duration;

/// Simulated GPUs for the scaling runs: four of their own, after any that
/// exist (2 GiB each).
fn sims(n: usize) -> Vec<Device> {
    let existing: Vec<Device> = kiln::devices().into_iter().filter(|d| d.kind == DeviceKind::Simulated).map(|d| d.device).collect();
    if existing.len() >= n {
        return existing[..n].to_vec();
    }
    kiln::ensure_simulated_gpus(n, kiln::DEFAULT_SIM_GPU_MEMORY)
}

fn cuda_devices() -> Vec<Device> {
    kiln::devices().into_iter().filter(|d| d.kind == DeviceKind::Cuda).map(|d| d.device).collect()
}

/// The ring's time for an all-reduce of `bytes` over `n` devices on `link`:
/// 2(n − 1) steps of one chunk each.
fn ring_model(n: usize, bytes: usize, link: SimLink) -> Duration {
    let chunk = bytes.div_ceil(n);
    (0..2 * (n - 1)).map(|_| link.transfer_time(chunk)).sum()
}

pub(super) fn comm_bench(ctx: &mut Ctx) -> Result<()> {
    let before = sim::link();
    let sizes: &[usize] = if ctx.quick { &[1 << 20] } else { &[1 << 20, 16 << 20, 64 << 20] };
    // The default link, and two slow ones on which the link (not this
    // host's own copies) is the bottleneck, so the ring's cost shows.
    let links = [
        before,
        SimLink { bandwidth: 1e9, latency: Duration::from_micros(10) },
        SimLink { bandwidth: 0.25e9, latency: Duration::from_micros(10) },
    ];
    let result = (|| -> Result<()> {
        for link in links {
            sim::set_link(link)?;
            for n in [2, 4] {
                let devices = sims(n);
                for &bytes in sizes {
                    let parts: Vec<Tensor> =
                        devices.iter().map(|d| Tensor::ones(bytes / 4, kiln::DType::F32, d)).collect::<kiln::Result<_>>()?;
                    // The wall time, and the time on the devices' own
                    // clocks (`sim::elapsed`: transfers at the modelled
                    // link's pace, whatever this host's copies take).
                    let mut on_devices = Vec::new();
                    let stats = ctx.measure(&format!("all_reduce {} MiB on {n} simulated GPUs", bytes >> 20), 1, ctx.runs(5), || {
                        let ((), took) = sim::elapsed(&devices, || comm::all_reduce_(&parts, ReduceOp::Sum))?;
                        on_devices.push(took.as_secs_f64() * 1e3);
                        Ok(())
                    })?;
                    let device_ms = median(on_devices);
                    let model = ring_model(n, bytes, link).as_secs_f64() * 1e3;
                    let busbw = 2.0 * (n - 1) as f64 / n as f64 * bytes as f64 / (stats.median_ms * 1e-3) / 1e9;
                    ctx.emit(
                        Row::new(
                            "Comm",
                            format!("all_reduce {} MiB, {n} simulated GPUs, {} GB/s link", bytes >> 20, link.bandwidth / 1e9),
                            devices[0],
                            stats,
                            busbw,
                            "GB/s bus",
                        )
                        .with("model_ms", round(model, 3))
                        .with("measured_over_model", round(stats.median_ms / model, 3))
                        .with("device_ms", round(device_ms, 3))
                        .with("device_over_model", round(device_ms / model, 4))
                        .with("bytes", bytes),
                    );
                }
            }
        }
        Ok(())
    })();
    sim::set_link(before)?;
    result?;
    let cuda = cuda_devices();
    if cuda.len() >= 2 {
        for &bytes in sizes {
            let parts: Vec<Tensor> = cuda.iter().map(|d| Tensor::ones(bytes / 4, kiln::DType::F32, d)).collect::<kiln::Result<_>>()?;
            let stats = ctx.measure(&format!("all_reduce {} MiB on {} CUDA devices", bytes >> 20, cuda.len()), 2, ctx.runs(10), || {
                comm::all_reduce_(&parts, ReduceOp::Sum)?;
                for d in &cuda {
                    kiln::synchronize(d)?;
                }
                Ok(())
            })?;
            let n = cuda.len() as f64;
            let busbw = 2.0 * (n - 1.0) / n * bytes as f64 / (stats.median_ms * 1e-3) / 1e9;
            ctx.emit(
                Row::new("Comm", format!("all_reduce {} MiB, {} CUDA devices", bytes >> 20, cuda.len()), cuda[0], stats, busbw, "GB/s bus")
                    .with("bytes", bytes),
            );
        }
    }
    Ok(())
}

/// One model of the data-parallel exercise.
struct Model {
    name: &'static str,
    make: fn() -> kiln::nn::Sequential,
    per_device_batch: usize,
    steps: usize,
    lr: f64,
    /// Timed rounds when the user names no `--runs`.
    rounds: usize,
}

/// One group of devices of the exercise, ready to time: its data, learner
/// and trainer.
struct Setup {
    devices: Vec<Device>,
    kind: DeviceKind,
    batch: usize,
    data: kiln::data::DataModule,
    model: Learner<kiln::nn::Sequential>,
    trainer: Trainer,
    samples: Vec<f64>,
    /// Simulated GPUs: each epoch's time on their device clocks.
    device_samples: Vec<f64>,
    last: Option<kiln::trainer::History>,
}

/// The median over rounds of the time per image of the baseline (`one`
/// samples of `one_batch` images) over that of `this`: a speedup.
fn per_image_speedup(one: &[f64], one_batch: usize, this: &[f64], this_batch: usize) -> f64 {
    median(one.iter().zip(this).map(|(a, b)| (a / one_batch as f64) / (b / this_batch as f64)).collect())
}

/// The median of `v` (0 when empty), as the other rows take it.
fn median(v: Vec<f64>) -> f64 {
    super::Stats::from_samples(v).median_ms
}

/// A one-device training of `m` on `device` from a host thread of its own,
/// run on demand: with the first device's in the same round it makes two
/// independent trainings at once (no communication, no lockstep, one host
/// thread each), what this machine gives two replicas at best: the ceiling
/// of a data-parallel speedup here.
struct Partner {
    go: mpsc::Sender<bool>,
    done: mpsc::Receiver<kiln::Result<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Partner {
    /// Builds and warms the partner's training (an error is returned here).
    fn start(m: &Model, device: Device) -> Result<Partner> {
        let (go, go_rx) = mpsc::channel::<bool>();
        let (done_tx, done) = mpsc::channel::<kiln::Result<()>>();
        let (make, batch, steps, lr) = (m.make, m.per_device_batch, m.steps, m.lr);
        let thread = std::thread::Builder::new()
            .name("kiln-bench-partner".into())
            .spawn(move || {
                let setup = || -> kiln::Result<_> {
                    let data = synthetic_image_task(batch * steps, 0, batch, 1)?;
                    let mut model = Learner::new(make(), Loss::CrossEntropy, OptimizerConfig::sgd(lr));
                    let mut trainer = Trainer::builder().max_epochs(1).progress(Progress::Off).device(device).build()?;
                    trainer.fit(&mut model, &data)?;
                    Ok((data, model, trainer))
                };
                let (data, mut model, mut trainer) = match setup() {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = done_tx.send(Err(e));
                        return;
                    }
                };
                let _ = done_tx.send(Ok(()));
                while let Ok(true) = go_rx.recv() {
                    if done_tx.send(trainer.fit(&mut model, &data).map(|_| ())).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| CliError(format!("bench: cannot start the partner thread: {e}")))?;
        let partner = Partner { go, done, thread: Some(thread) };
        partner.wait()?;
        Ok(partner)
    }

    fn wait(&self) -> Result<()> {
        match self.done.recv() {
            Ok(r) => Ok(r?),
            Err(_) => Err(CliError("bench: the partner thread stopped".into())),
        }
    }
}

impl Drop for Partner {
    fn drop(&mut self) {
        let _ = self.go.send(false);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub(super) fn dp_bench(ctx: &mut Ctx) -> Result<()> {
    // LeNet at the book's batch of 256 (per device here: weak scaling);
    // ResNet-18 at 16 per device, which two cores can time in seconds.
    // LeNet's rounds take a second each: 15 of them make its median ratio
    // steady where this machine's cores change speed from round to round.
    let models = [
        Model { name: "LeNet", make: || lenet(10), per_device_batch: 256, steps: if ctx.quick { 2 } else { 8 }, lr: 0.9, rounds: 15 },
        Model { name: "ResNet-18", make: || resnet18(10), per_device_batch: 16, steps: if ctx.quick { 1 } else { 4 }, lr: 0.05, rounds: 7 },
    ];
    let mut groups: Vec<Vec<Device>> = [1, 2, 4].iter().map(|&n| sims(n)).collect();
    let cuda = cuda_devices();
    for n in 1..=cuda.len() {
        groups.push(cuda[..n].to_vec());
    }
    for m in &models {
        let runs = ctx.runs(m.rounds);
        let mut setups = Vec::with_capacity(groups.len());
        for devices in &groups {
            let n = devices.len();
            let kind = kiln::devices().into_iter().find(|i| i.device == devices[0]).map(|i| i.kind).unwrap_or(DeviceKind::Simulated);
            let batch = m.per_device_batch * n;
            kiln::manual_seed(0);
            let data = synthetic_image_task(batch * m.steps, 0, batch, 0)?;
            let mut model = Learner::new((m.make)(), Loss::CrossEntropy, OptimizerConfig::sgd(m.lr));
            let builder = Trainer::builder().max_epochs(1).progress(Progress::Off);
            let mut trainer = if n == 1 { builder.device(devices[0]) } else { builder.devices(devices.clone()) }.build()?;
            // A first epoch makes the lazy layers and warms every cache.
            ctx.progress.set(format!("{} {} on {n} {kind:?} device(s): warm-up", ctx.label, m.name));
            trainer.fit(&mut model, &data)?;
            setups.push(Setup {
                devices: devices.clone(),
                kind,
                batch,
                data,
                model,
                trainer,
                samples: Vec::new(),
                device_samples: Vec::new(),
                last: None,
            });
        }
        // The ceiling: the 1-GPU training beside an independent one on the
        // second simulated GPU.
        let partner = match (setups.first(), groups.iter().find(|g| g.len() >= 2)) {
            (Some(one), Some(two)) if one.kind == DeviceKind::Simulated && one.devices.len() == 1 => {
                ctx.progress.set(format!("{} {} beside an independent training: warm-up", ctx.label, m.name));
                Some(Partner::start(m, two[1])?)
            }
            _ => None,
        };
        let mut pair_samples = Vec::new();
        // Rounds interleave the device counts (1, 2, 4, then again), and each
        // speedup is the median over rounds of the ratio within a round: this
        // machine's cores change speed over seconds (up to a third, the same
        // pinned matmul alone), which a run of 1 then 2 then 4 would read as
        // scaling.
        for r in 0..runs {
            for s in setups.iter_mut() {
                ctx.progress.set(format!("{} {} on {} device(s): round {}/{runs}", ctx.label, m.name, s.devices.len(), r + 1));
                let start = std::time::Instant::now();
                if s.kind == DeviceKind::Simulated {
                    let (history, took) = sim::elapsed(&s.devices, || s.trainer.fit(&mut s.model, &s.data))?;
                    s.samples.push(start.elapsed().as_secs_f64() * 1e3);
                    s.device_samples.push(took.as_secs_f64() * 1e3);
                    s.last = Some(history);
                } else {
                    s.last = Some(s.trainer.fit(&mut s.model, &s.data)?);
                    s.samples.push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
            if let Some(p) = &partner {
                ctx.progress.set(format!("{} {} beside an independent training: round {}/{runs}", ctx.label, m.name, r + 1));
                let s = &mut setups[0];
                let start = std::time::Instant::now();
                let _ = p.go.send(true);
                let own = s.trainer.fit(&mut s.model, &s.data);
                let theirs = p.wait();
                own?;
                theirs?;
                pair_samples.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        drop(partner);
        // Two trainings' images in the pair's time over one's in its own, per
        // round (the first setup is the one-GPU run the pair was made of).
        let ceiling = match setups.first() {
            Some(base) if !pair_samples.is_empty() => {
                Some(median(base.samples.iter().zip(&pair_samples).map(|(one, pair)| 2.0 * one / pair).collect()))
            }
            _ => None,
        };
        for i in 0..setups.len() {
            let s = &setups[i];
            let n = s.devices.len();
            let images = (s.batch * m.steps) as f64;
            let stats = super::Stats::from_samples(s.samples.clone());
            let rate = images / (stats.median_ms * 1e-3);
            let mut row = Row::new(
                "Dp",
                format!("{} epoch, {} images/device/step, {} steps, {n} {:?} GPU(s)", m.name, m.per_device_batch, m.steps, s.kind),
                s.devices[0],
                stats,
                rate,
                "images/s",
            )
            .with("devices", n);
            // The first group of the same kind with one device is the baseline.
            if let Some(base) = setups[..i].iter().find(|b| b.kind == s.kind && b.devices.len() == 1) {
                let speedup = per_image_speedup(&base.samples, base.batch, &s.samples, s.batch);
                row = row.with("speedup", round(speedup, 3));
                if !s.device_samples.is_empty() && base.device_samples.len() == s.device_samples.len() {
                    // The same on the devices' clocks: what GPUs of their
                    // own would give, this host's cores and its own
                    // overhead left out.
                    let speedup = per_image_speedup(&base.device_samples, base.batch, &s.device_samples, s.batch);
                    row = row.with("device_speedup", round(speedup, 3));
                }
                if let Some(ceiling) = ceiling.filter(|_| s.kind == DeviceKind::Simulated) {
                    row = row.with("ceiling", round(ceiling, 3)).with("efficiency", round(speedup / ceiling.max(1e-12), 3));
                }
            }
            if let Some(p) = keep(s.last.clone()).as_ref().and_then(|h| h.epochs.last()).and_then(|e| e.parallel.clone()) {
                row = row.with("comm_bytes", p.comm_bytes);
                if let (Some(c), Some(w)) = (p.compute_seconds, p.comm_wait_seconds) {
                    row = row
                        .with("compute_s", round(c, 4))
                        .with("comm_wait_s", round(w, 4))
                        .with("comm_share", round(w / (c + w).max(1e-12), 4));
                }
            }
            ctx.emit(row);
        }
        if let (Some(base), Some(ceiling)) = (setups.first(), ceiling) {
            let stats = super::Stats::from_samples(pair_samples.clone());
            let images = (2 * base.batch * m.steps) as f64;
            let row = Row::new(
                "Dp",
                format!("{} epoch, 2 independent 1-GPU trainings at once (the ceiling), {} images/step each", m.name, m.per_device_batch),
                base.devices[0],
                stats,
                images / (stats.median_ms * 1e-3),
                "images/s",
            )
            .with("devices", 2)
            .with("speedup", round(ceiling, 3));
            ctx.emit(row);
        }
    }
    ctx.note(format!(
        "Dp: weak scaling (the per-device batch is fixed); the device counts run in interleaved rounds, and speedup is the median over rounds of images/s against the 1-device run of the same kind in that round. ceiling: two independent 1-GPU trainings at once, each from its own host thread, against one (what this machine gives two replicas with no communication); efficiency = speedup / ceiling. Simulated GPUs each run on one core of this {}-core machine.",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    ));
    Ok(())
}
