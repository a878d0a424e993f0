//! The book's `Trainer`, device-aware: `gpus` are the first
//! `min(num_gpus, num_gpus())` GPUs; [`Trainer::prepare_model`] moves the
//! model to `gpus[0]`, [`Trainer::prepare_batch`] moves each batch there;
//! with no GPU everything stays on the CPU. Per-step losses stay on the
//! device and are read to the host once per epoch, in one transfer.
//!
//! ```
//! use kiln::data::synthetic_regression;
//! use kiln::nn::{Linear, Loss, Module};
//! use kiln::optim::OptimizerConfig;
//! use kiln::trainer::{Learner, Trainer};
//!
//! kiln::manual_seed(0);
//! let data = synthetic_regression(1000, 100, 32)?;
//! let net = Linear::new(2, 1, &kiln::cpu())?;
//! let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.03));
//! let mut trainer = Trainer::new(3, 1, 0.0); // one GPU if there is one
//! let history = trainer.fit(&mut model, &data)?;
//! assert!(history.last().unwrap().train_loss < 0.01);
//! assert_eq!(model.net.weight().device(), trainer.device());
//! # Ok::<(), kiln::Error>(())
//! ```

use crate::data::{make_regression, DataLoader, DataModule};
use crate::nn::{init, Linear, Loss, Module};
use crate::optim::{Optimizer, OptimizerConfig};
use crate::{no_grad, Device, Error, Result, Tensor};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A network with its loss and its optimizer: what the book's `d2l.Module`
/// bundles, and what [`Trainer::fit`] trains.
pub struct Learner<N: Module> {
    /// The network.
    pub net: N,
    /// The loss (and metric) to use.
    pub loss: Loss,
    /// The optimizer, built by `fit` after the model is on its device.
    pub optimizer: OptimizerConfig,
}

impl<N: Module> Learner<N> {
    /// Bundles a network, a loss and an optimizer.
    pub fn new(net: N, loss: Loss, optimizer: OptimizerConfig) -> Learner<N> {
        Learner { net, loss, optimizer }
    }
}

/// What one epoch gave.
#[derive(Clone, Debug, PartialEq)]
pub struct EpochStats {
    /// The epoch, from 0.
    pub epoch: usize,
    /// Mean training loss over the epoch's batches.
    pub train_loss: f64,
    /// Mean validation loss, when there is validation data.
    pub val_loss: Option<f64>,
    /// Mean validation metric (accuracy for classification), when there is one.
    pub val_metric: Option<f64>,
    /// Wall time of the epoch (training and validation), in seconds.
    pub seconds: f64,
}

/// The record of a [`Trainer::fit`].
#[derive(Clone, Debug, PartialEq)]
pub struct History {
    /// One entry per epoch.
    pub epochs: Vec<EpochStats>,
    /// The metric's name, when the loss has one.
    pub metric_name: Option<String>,
    /// Where the training ran.
    pub device: Device,
}

impl History {
    /// The last epoch.
    pub fn last(&self) -> Option<&EpochStats> {
        self.epochs.last()
    }

    /// Training loss per epoch.
    pub fn train_losses(&self) -> Vec<f64> {
        self.epochs.iter().map(|e| e.train_loss).collect()
    }

    /// Validation loss per epoch (epochs without validation left out).
    pub fn val_losses(&self) -> Vec<f64> {
        self.epochs.iter().filter_map(|e| e.val_loss).collect()
    }

    /// Mean seconds per epoch.
    pub fn seconds_per_epoch(&self) -> f64 {
        if self.epochs.is_empty() {
            return 0.0;
        }
        self.epochs.iter().map(|e| e.seconds).sum::<f64>() / self.epochs.len() as f64
    }

    /// Draws the loss curves (and the metric, when there is one) to a PNG.
    pub fn save_plot(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        // Fonts may be missing on a server: fall back to a chart without text.
        self.draw(path, true).or_else(|_| self.draw(path, false))
    }

    fn draw(&self, path: &Path, text: bool) -> Result<()> {
        use plotters::prelude::*;
        let err =
            |e: &dyn std::fmt::Display| Error::Io { path: path.display().to_string(), msg: format!("cannot draw the loss plot: {e}") };
        let root = BitMapBackend::new(path, (640, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let series: Vec<(&str, Vec<f64>, RGBColor)> = {
            let mut s = vec![("train loss", self.train_losses(), BLUE)];
            let val = self.val_losses();
            if !val.is_empty() {
                s.push(("val loss", val, RED));
            }
            let metric: Vec<f64> = self.epochs.iter().filter_map(|e| e.val_metric).collect();
            if !metric.is_empty() {
                s.push(("val metric", metric, GREEN));
            }
            s
        };
        let x_max = (self.epochs.len().max(2)) as f64;
        let y_max = series.iter().flat_map(|s| s.1.iter().copied()).filter(|v| v.is_finite()).fold(0.0f64, f64::max).max(1e-12) * 1.05;
        let mut builder = ChartBuilder::on(&root);
        builder.margin(15);
        if text {
            builder.caption("training", ("sans-serif", 22)).x_label_area_size(35).y_label_area_size(55);
        }
        let mut chart = builder.build_cartesian_2d(1.0..x_max, 0.0..y_max).map_err(|e| err(&e))?;
        if text {
            chart.configure_mesh().x_desc("epoch").draw().map_err(|e| err(&e))?;
        }
        for (name, values, color) in series {
            let pts: Vec<(f64, f64)> = values.iter().enumerate().map(|(i, &v)| ((i + 1) as f64, v)).collect();
            let s = chart.draw_series(LineSeries::new(pts, color.stroke_width(2))).map_err(|e| err(&e))?;
            if text {
                s.label(name).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
            }
        }
        if text {
            chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
        Ok(())
    }
}

/// Whether to show a progress bar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// When stderr is a terminal (the default).
    Auto,
    /// Never.
    Off,
}

/// Trains a [`Learner`] for `max_epochs` on the first `min(num_gpus,
/// kiln::num_gpus())` GPUs (only the first is used for compute), or on the
/// CPU when there is none, clipping the gradient norm to
/// `gradient_clip_val` when it is positive.
#[derive(Clone, Debug)]
pub struct Trainer {
    /// Epochs to run.
    pub max_epochs: usize,
    /// GPUs asked for.
    pub num_gpus: usize,
    /// Gradient-norm clipping threshold (0 for none).
    pub gradient_clip_val: f64,
    gpus: Vec<Device>,
    progress: Progress,
    plot: Option<PathBuf>,
}

impl Trainer {
    /// A trainer; `gpus` are decided now, from the GPUs that exist.
    pub fn new(max_epochs: usize, num_gpus: usize, gradient_clip_val: f64) -> Trainer {
        let gpus = (0..num_gpus.min(crate::num_gpus())).map(Device::Gpu).collect();
        Trainer { max_epochs, num_gpus, gradient_clip_val, gpus, progress: Progress::Auto, plot: None }
    }

    /// Trains on one chosen device instead (builder style): a GPU becomes
    /// `gpus == [device]`; the CPU empties `gpus`. Fails when the device
    /// does not exist.
    pub fn on_device(mut self, device: Device) -> Result<Trainer> {
        crate::Tensor::zeros((), crate::DType::F32, &device)?;
        self.gpus = if device.is_gpu() { vec![device] } else { Vec::new() };
        Ok(self)
    }

    /// Shows or hides the progress bar (builder style).
    pub fn progress(mut self, progress: Progress) -> Trainer {
        self.progress = progress;
        self
    }

    /// Writes the loss curves to a PNG at the end of `fit` (builder style).
    pub fn plot_to(mut self, path: impl Into<PathBuf>) -> Trainer {
        self.plot = Some(path.into());
        self
    }

    /// The GPUs this trainer uses (empty: the CPU).
    pub fn gpus(&self) -> &[Device] {
        &self.gpus
    }

    /// Where training runs: `gpus[0]`, or the CPU.
    pub fn device(&self) -> Device {
        self.gpus.first().copied().unwrap_or(Device::Cpu)
    }

    /// Moves each tensor of a batch to `gpus[0]` (no-op without GPUs or when
    /// already there).
    #[track_caller]
    pub fn prepare_batch(&self, batch: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        match self.gpus.first() {
            Some(d) => batch.iter().map(|t| t.to(d)).collect(),
            None => Ok(batch),
        }
    }

    /// Moves the model's parameters to `gpus[0]` (no-op without GPUs).
    #[track_caller]
    pub fn prepare_model(&self, model: &mut dyn Module) -> Result<()> {
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        match self.gpus.first() {
            Some(d) => model.to(d),
            None => Ok(()),
        }
    }

    /// Creates the parameters of lazy layers (the chapter's `LazyLinear`)
    /// before the optimizer is built: one forward of the first training
    /// batch, on the training device, without gradients and in evaluation
    /// mode (no dropout draw). PyTorch Lightning and d2l do the same; the
    /// optimizer then sees every parameter from the first step.
    fn materialize<N: Module>(&self, model: &mut Learner<N>, data: &DataModule) -> Result<()> {
        if !model.net.has_lazy_parameters() {
            return Ok(());
        }
        let Some(batch) = data.train.iter()?.next() else { return Ok(()) };
        let batch = self.prepare_batch(batch?)?;
        let (x, _) = split_batch(&batch)?;
        let _g = no_grad();
        model.net.eval();
        let out = model.net.forward(x);
        model.net.train();
        out?;
        if model.net.has_lazy_parameters() {
            return Err(Error::invalid("fit", "a lazy layer still has no parameters after a forward of the first batch"));
        }
        Ok(())
    }

    fn clip_gradients(&self, params: &[Tensor]) -> Result<()> {
        let grads: Vec<(Tensor, Tensor)> = params.iter().filter_map(|p| p.grad().map(|g| (p.clone(), g))).collect();
        let mut total: Option<Tensor> = None;
        for (_, g) in &grads {
            let s = g.sqr()?.sum_all()?;
            total = Some(match total {
                Some(t) => t.add(&s)?,
                None => s,
            });
        }
        let Some(total) = total else { return Ok(()) };
        // scale = min(1, clip / norm), computed on the device: no read-back.
        let scale = total.sqrt()?.add_scalar(1e-12)?.recip()?.mul_scalar(self.gradient_clip_val)?.minimum_scalar(1.0)?;
        for (p, g) in grads {
            p.set_grad(Some(g.mul(&scale)?))?;
        }
        Ok(())
    }

    /// Trains: each epoch runs every training batch (forward, loss,
    /// backward, clipping, step), then validation without gradients, and
    /// reads the epoch's losses from the device in one transfer.
    #[track_caller]
    pub fn fit<N: Module>(&mut self, model: &mut Learner<N>, data: &DataModule) -> Result<History> {
        // Every transfer of the fit (model, batches, losses) is booked at the
        // caller's line.
        let _site = crate::runtime::ledger::site_scope(std::panic::Location::caller());
        if data.train.is_empty() {
            return Err(Error::invalid("fit", "the training loader yields no batch (fewer examples than one batch with drop_last?)"));
        }
        self.prepare_model(&mut model.net)?;
        self.materialize(model, data)?;
        let mut optimizer = model.optimizer.build(model.net.parameters())?;
        let device = self.device();
        let show = self.progress == Progress::Auto && std::io::stderr().is_terminal();
        let bar = if show {
            let b = indicatif::ProgressBar::new((self.max_epochs * data.train.len()) as u64);
            if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed_precise} {msg}") {
                b.set_style(style);
            }
            b
        } else {
            indicatif::ProgressBar::hidden()
        };
        let mut history = History { epochs: Vec::new(), metric_name: model.loss.metric_name().map(String::from), device };
        for epoch in 0..self.max_epochs {
            let start = Instant::now();
            let (sums, steps, val_steps, has_metric) = self.run_epoch(model, &mut *optimizer, data, &bar)?;
            // The one device-to-host read of the epoch.
            let values = sums.to_vec_f64()?;
            let train_loss = values[0] / steps as f64;
            let val_loss = (val_steps > 0).then(|| values[1] / val_steps as f64);
            let val_metric = (val_steps > 0 && has_metric).then(|| values[2] / val_steps as f64);
            let seconds = start.elapsed().as_secs_f64();
            if show {
                let mut msg = format!("epoch {}/{} loss {train_loss:.4}", epoch + 1, self.max_epochs);
                if let Some(v) = val_loss {
                    msg += &format!(" val {v:.4}");
                }
                if let Some(m) = val_metric {
                    msg += &format!(" {} {m:.3}", model.loss.metric_name().unwrap_or("metric"));
                }
                bar.set_message(msg);
            }
            history.epochs.push(EpochStats { epoch, train_loss, val_loss, val_metric, seconds });
        }
        bar.finish_and_clear();
        if let Some(path) = &self.plot {
            history.save_plot(path)?;
        }
        Ok(history)
    }

    /// One epoch: returns the device tensor [train loss sum, val loss sum,
    /// val metric sum], the step counts, and whether there is a metric.
    fn run_epoch<N: Module>(
        &self,
        model: &mut Learner<N>,
        optimizer: &mut dyn Optimizer,
        data: &DataModule,
        bar: &indicatif::ProgressBar,
    ) -> Result<(Tensor, usize, usize, bool)> {
        let device = self.device();
        model.net.train();
        let mut train_sum: Option<Tensor> = None;
        let mut steps = 0;
        for batch in data.train.iter()? {
            let batch = self.prepare_batch(batch?)?;
            let (x, y) = split_batch(&batch)?;
            let loss = model.loss.compute(&model.net.forward(x)?, y)?;
            optimizer.zero_grad();
            loss.backward()?;
            if self.gradient_clip_val > 0.0 {
                self.clip_gradients(optimizer.parameters())?;
            }
            optimizer.step()?;
            let _g = no_grad();
            let loss = loss.detach();
            train_sum = Some(match train_sum {
                Some(s) => s.add(&loss)?,
                None => loss,
            });
            steps += 1;
            bar.inc(1);
        }
        let zero = || Tensor::zeros((), crate::DType::F32, &device);
        let (mut val_sum, mut metric_sum, mut val_steps) = (None::<Tensor>, None::<Tensor>, 0);
        let mut has_metric = false;
        if let Some(val) = &data.val {
            let _g = no_grad();
            model.net.eval();
            for batch in val.iter()? {
                let batch = self.prepare_batch(batch?)?;
                let (x, y) = split_batch(&batch)?;
                let pred = model.net.forward(x)?;
                let l = model.loss.compute(&pred, y)?;
                val_sum = Some(match val_sum {
                    Some(s) => s.add(&l)?,
                    None => l,
                });
                if let Some(m) = model.loss.metric(&pred, y) {
                    let m = m?;
                    has_metric = true;
                    metric_sum = Some(match metric_sum {
                        Some(s) => s.add(&m)?,
                        None => m,
                    });
                }
                val_steps += 1;
            }
            model.net.train();
        }
        let _g = no_grad();
        let as_f32 = |t: Option<Tensor>| -> Result<Tensor> {
            match t {
                Some(t) => t.reshape(())?.to_dtype(crate::DType::F32),
                None => zero(),
            }
        };
        let parts = [as_f32(train_sum)?, as_f32(val_sum)?, as_f32(metric_sum)?];
        let sums = Tensor::stack(&[&parts[0], &parts[1], &parts[2]], 0)?;
        Ok((sums, steps, val_steps, has_metric))
    }
}

fn split_batch(batch: &[Tensor]) -> Result<(&Tensor, &Tensor)> {
    match batch {
        [x, y, ..] => Ok((x, y)),
        _ => Err(Error::invalid("fit", format!("a batch needs features and targets (2 tensors), got {}", batch.len()))),
    }
}

/// The result of [`bench_w5`].
#[derive(Clone, Debug, PartialEq)]
pub struct W5Report {
    /// Milliseconds per epoch, training only (data generation excluded).
    pub ms_per_epoch: f64,
    /// Epochs run.
    pub epochs: usize,
    /// Learned weight.
    pub w: Vec<f32>,
    /// Learned bias.
    pub b: f32,
    /// Final training loss (mean over the last epoch).
    pub final_loss: f64,
}

/// Workload W5 of `kiln bench`: linear regression with autograd on the CPU,
/// 1000 examples of the book's synthetic data, batch 32, shuffled, SGD
/// lr 0.03, `epochs` epochs, through [`Linear`], [`Loss::Mse`] and the
/// [`Trainer`]. Run it with `RAYON_NUM_THREADS=1` for the reference figure.
///
/// ```
/// let r = kiln::trainer::bench_w5(3)?;
/// assert!((r.w[0] - 2.0).abs() < 0.05 && (r.b - 4.2).abs() < 0.05);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn bench_w5(epochs: usize) -> Result<W5Report> {
    crate::manual_seed(0);
    let (x, y) = make_regression(&[2.0, -3.4], 4.2, 0.01, 1000, &Device::Cpu)?;
    let data = DataModule { train: DataLoader::new(vec![x, y], 32)?.shuffle(true), val: None };
    let net = Linear::new(2, 1, &Device::Cpu)?;
    init::normal_(&net.weight(), 0.0, 0.01)?;
    if let Some(b) = net.bias() {
        init::zeros_(&b)?;
    }
    let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::new(epochs, 0, 0.0).progress(Progress::Off);
    let start = Instant::now();
    let history = trainer.fit(&mut model, &data)?;
    let ms_per_epoch = start.elapsed().as_secs_f64() * 1e3 / epochs.max(1) as f64;
    let w = model.net.weight().to_vec::<f32>()?;
    let b = model.net.bias().map(|b| b.to_vec::<f32>()).transpose()?.map(|v| v[0]).unwrap_or(0.0);
    Ok(W5Report { ms_per_epoch, epochs, w, b, final_loss: history.last().map(|e| e.train_loss).unwrap_or(f64::NAN) })
}
