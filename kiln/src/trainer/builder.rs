//! [`TrainerBuilder`]: a [`Trainer`]'s settings by name.

use super::{Callback, Progress, Trainer};
use crate::{Device, Error, Result};
#[cfg(feature = "plot")]
use std::path::PathBuf;

/// Settings of a [`Trainer`], by name: see [`Trainer::builder`].
#[derive(Default)]
pub struct TrainerBuilder {
    max_epochs: Option<usize>,
    num_gpus: usize,
    device: Option<Device>,
    devices: Option<Vec<Device>>,
    gradient_clip_val: f64,
    bucket_bytes: Option<usize>,
    check_replicas: bool,
    progress: Progress,
    callbacks: Vec<Box<dyn Callback>>,
    group: Option<crate::dist::Group>,
    #[cfg(feature = "plot")]
    plot: Option<PathBuf>,
}

impl TrainerBuilder {
    /// Trains data-parallel across the processes of `group` (one device per
    /// process: the group's, [`Group::device`]), as PyTorch's
    /// `DistributedDataParallel`: each global batch (the loader's batch
    /// size) is cut into one piece per rank, gradients are summed across
    /// the ranks, and every rank takes the same step, so n processes train
    /// as one process on the same batches. Every rank reports the same
    /// history; only rank 0 shows progress and writes checkpoints. A group
    /// of one process changes nothing. Replaces [`TrainerBuilder::device`],
    /// [`TrainerBuilder::num_gpus`] and [`TrainerBuilder::devices`].
    ///
    /// ```
    /// use kiln::trainer::Trainer;
    /// let group = kiln::dist::init()?; // under mpirun: every rank of the job
    /// let trainer = Trainer::builder().max_epochs(1).process_group(group.clone()).build()?;
    /// assert_eq!(trainer.device(), group.device());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    ///
    /// [`Group::device`]: crate::dist::Group::device
    pub fn process_group(mut self, group: crate::dist::Group) -> TrainerBuilder {
        self.group = Some(group);
        self
    }

    /// Epochs each [`Trainer::fit`] runs (required).
    pub fn max_epochs(mut self, max_epochs: usize) -> TrainerBuilder {
        self.max_epochs = Some(max_epochs);
        self
    }

    /// Train on the first `min(num_gpus, kiln::num_gpus())` GPUs, as the
    /// book's `Trainer(num_gpus=...)`: on one, the model and the batches go
    /// there; on several, training is data-parallel (PyTorch's DDP: each
    /// GPU holds a replica and computes its share of every batch, the
    /// gradients are summed across them, and the replicas stay identical).
    /// 0, the default, trains on the CPU. Replaces a
    /// [`TrainerBuilder::device`] and [`TrainerBuilder::devices`].
    ///
    /// Asking for more GPUs than the machine has is not an error (the
    /// book's `min`): [`Trainer::num_gpus`] then says how many are used,
    /// [`Trainer::num_gpus_requested`] how many were asked for,
    /// [`Trainer::gpu_notice`] why they differ, and `build` prints that
    /// notice once on stderr when it trains on fewer GPUs than asked but at
    /// least one (on a machine without GPUs the CPU is the book's `try_gpu`
    /// fallback, not printed). [`TrainerBuilder::devices`], which names the
    /// GPUs, refuses one that does not exist instead.
    ///
    /// ```
    /// use kiln::trainer::Trainer;
    /// let trainer = Trainer::builder().max_epochs(1).num_gpus(kiln::num_gpus() + 1).build()?;
    /// assert_eq!(trainer.num_gpus(), kiln::num_gpus());
    /// assert_eq!(trainer.num_gpus_requested(), kiln::num_gpus() + 1);
    /// assert!(trainer.gpu_notice().unwrap().contains("asked"));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    ///
    /// [`Trainer::num_gpus`]: super::Trainer::num_gpus
    /// [`Trainer::num_gpus_requested`]: super::Trainer::num_gpus_requested
    /// [`Trainer::gpu_notice`]: super::Trainer::gpu_notice
    pub fn num_gpus(mut self, num_gpus: usize) -> TrainerBuilder {
        self.num_gpus = num_gpus;
        self.device = None;
        self.devices = None;
        self
    }

    /// Train data-parallel on these GPUs (PyTorch Lightning's
    /// `devices=[...]`): the first holds the learner's model, the others
    /// replicas. `build` fails when one is not a GPU, does not exist, or is
    /// listed twice. Replaces [`TrainerBuilder::num_gpus`] and
    /// [`TrainerBuilder::device`].
    ///
    /// ```
    /// use kiln::trainer::Trainer;
    /// let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
    /// let trainer = Trainer::builder().max_epochs(1).devices(gpus.clone()).build()?;
    /// assert_eq!((trainer.gpus(), trainer.num_gpus()), (&gpus[..], 2));
    /// assert!(Trainer::builder().max_epochs(1).devices(vec![gpus[0], gpus[0]]).build().is_err());
    /// assert!(Trainer::builder().max_epochs(1).devices(vec![kiln::cpu()]).build().is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn devices(mut self, devices: Vec<Device>) -> TrainerBuilder {
        self.devices = Some(devices);
        self.device = None;
        self
    }

    /// Train on this device (a GPU, or the CPU) instead; `build` fails when
    /// it does not exist. Replaces a [`TrainerBuilder::num_gpus`].
    pub fn device(mut self, device: Device) -> TrainerBuilder {
        self.device = Some(device);
        self.devices = None;
        self
    }

    /// Clip the gradients' global norm to this value before each step
    /// (0, the default: no clipping).
    pub fn gradient_clip_val(mut self, gradient_clip_val: f64) -> TrainerBuilder {
        self.gradient_clip_val = gradient_clip_val;
        self
    }

    /// With several GPUs, the size of a gradient bucket: gradients are
    /// summed across the devices a bucket at a time, each started as soon
    /// as backward has produced it ([`DEFAULT_BUCKET_BYTES`], 25 MiB, as
    /// PyTorch's DDP; at least 1 byte: then each parameter is a bucket).
    ///
    /// [`DEFAULT_BUCKET_BYTES`]: super::DEFAULT_BUCKET_BYTES
    pub fn bucket_size(mut self, bytes: usize) -> TrainerBuilder {
        self.bucket_bytes = Some(bytes);
        self
    }

    /// With several GPUs, check after every step that every replica's
    /// parameters equal the first's in every bit, failing the fit if not (a
    /// debugging aid: it reads every parameter to the host each step).
    pub fn check_replicas(mut self, check: bool) -> TrainerBuilder {
        self.check_replicas = check;
        self
    }

    /// Show a progress bar or not ([`Progress::Auto`] by default).
    pub fn progress(mut self, progress: Progress) -> TrainerBuilder {
        self.progress = progress;
        self
    }

    /// Adds a callback (run in the order added).
    pub fn callback(mut self, callback: impl Callback + 'static) -> TrainerBuilder {
        self.callbacks.push(Box::new(callback));
        self
    }

    /// Writes the loss curves to a PNG at the end of each fit (across
    /// processes, rank 0 writes it). Needs kiln's `plot` feature.
    #[cfg(feature = "plot")]
    pub fn plot_to(mut self, path: impl Into<PathBuf>) -> TrainerBuilder {
        self.plot = Some(path.into());
        self
    }

    /// The trainer. Fails when `max_epochs` was not given, the clipping value
    /// is negative or not finite, the device does not exist, or two
    /// callbacks share a name.
    pub fn build(self) -> Result<Trainer> {
        let op = "Trainer::builder";
        let max_epochs = self.max_epochs.ok_or_else(|| {
            Error::invalid(op, "max_epochs is not set; say how long each fit trains, e.g. `Trainer::builder().max_epochs(10)`")
        })?;
        if self.bucket_bytes == Some(0) {
            return Err(Error::invalid(op, "bucket_size must be at least 1 byte"));
        }
        if !(self.gradient_clip_val.is_finite() && self.gradient_clip_val >= 0.0) {
            return Err(Error::invalid(
                op,
                format!("gradient_clip_val must be a finite number ≥ 0 (0: no clipping), got {}", self.gradient_clip_val),
            ));
        }
        let mut names: Vec<String> = Vec::new();
        for c in &self.callbacks {
            let name = c.name();
            if names.contains(&name) {
                return Err(Error::invalid(op, format!("two callbacks are named `{name}`; their checkpoint states would clash")));
            }
            names.push(name);
        }
        let (device, devices) = match &self.group {
            Some(g) => (Some(g.device()), None),
            None => (self.device, self.devices),
        };
        let (num_gpus, gpus) = match (device, devices) {
            (_, Some(devices)) => {
                if devices.is_empty() {
                    return Err(Error::invalid(op, "devices is empty; list at least one GPU, or use `.device(kiln::cpu())`"));
                }
                for (i, d) in devices.iter().enumerate() {
                    if !d.is_gpu() {
                        return Err(Error::invalid(
                            op,
                            format!(
                                "devices lists {d}; data-parallel training runs on GPUs (train on the CPU with `.device(kiln::cpu())`)"
                            ),
                        ));
                    }
                    if devices[..i].contains(d) {
                        return Err(Error::invalid(op, format!("{d} is listed twice in devices")));
                    }
                    d.memory_stats()?;
                }
                (devices.len(), devices)
            }
            (Some(device), None) => {
                device.memory_stats()?;
                (usize::from(device.is_gpu()), if device.is_gpu() { vec![device] } else { Vec::new() })
            }
            (None, None) => (self.num_gpus, (0..self.num_gpus.min(crate::num_gpus())).map(Device::Gpu).collect()),
        };
        let gpu_notice = (gpus.len() < num_gpus).then(|| {
            let on = match gpus.len() {
                0 => "the CPU".to_string(),
                1 => "gpu(0)".to_string(),
                n => format!("{n} GPUs, gpu(0) to gpu({})", n - 1),
            };
            format!(
                "Trainer: num_gpus({num_gpus}) asked, but this machine has {} GPU{}; training on {on} (ask for at most {} to silence this)",
                gpus.len(),
                if gpus.len() == 1 { "" } else { "s" },
                gpus.len()
            )
        });
        // A machine without GPUs training on the CPU is the book's
        // `try_gpu` fallback, which every run without a GPU takes: said by
        // `gpu_notice` and the fit's device, not on stderr.
        if let (Some(notice), false) = (&gpu_notice, gpus.is_empty()) {
            notify_once(notice);
        }
        Ok(Trainer {
            max_epochs,
            num_gpus_requested: num_gpus,
            gpu_notice,
            gradient_clip_val: self.gradient_clip_val,
            gpus,
            bucket_bytes: self.bucket_bytes.unwrap_or(super::DEFAULT_BUCKET_BYTES),
            check_replicas: self.check_replicas,
            progress: self.progress,
            callbacks: self.callbacks,
            group: self.group,
            #[cfg(feature = "plot")]
            plot: self.plot,
        })
    }
}

/// Prints `notice` on stderr the first time this process builds a trainer
/// with it (a loop that builds many trainers says it once).
fn notify_once(notice: &str) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if !seen.iter().any(|s| s == notice) {
        seen.push(notice.to_string());
        eprintln!("{notice}");
    }
}
