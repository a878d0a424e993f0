//! What a fit and an evaluation report: [`EpochStats`], [`History`] (and its
//! plot), [`Evaluation`], and the on-device sums they are read from.

use crate::nn::Loss;
#[cfg(feature = "plot")]
use crate::Error;
use crate::{no_grad, DType, Device, Result, Tensor};
#[cfg(feature = "plot")]
use std::path::Path;

/// What one epoch gave. Losses and metrics are means over the examples
/// (a short last batch weighs what its examples weigh).
#[derive(Clone, Debug, PartialEq)]
pub struct EpochStats {
    /// The epoch, from 0, counted over every fit of the learner.
    pub epoch: usize,
    /// Mean training loss over the epoch's examples (as the parameters were
    /// at each step).
    pub train_loss: f64,
    /// Mean training metric (accuracy for classification), when the loss has one.
    pub train_metric: Option<f64>,
    /// Mean validation loss, when there is validation data.
    pub val_loss: Option<f64>,
    /// Validation metric (accuracy: correct / examples), when there is one.
    pub val_metric: Option<f64>,
    /// The learning rate of the epoch.
    pub lr: f64,
    /// Wall time of the epoch (training and validation), in seconds.
    pub seconds: f64,
    /// Where a data-parallel epoch's time and traffic went (`None` on one
    /// device).
    pub parallel: Option<ParallelStats>,
}

/// What a data-parallel epoch spent, so that a run that does not scale
/// says why.
#[derive(Clone, Debug, PartialEq)]
pub struct ParallelStats {
    /// Devices the epoch trained on.
    pub devices: usize,
    /// Mean over the devices of the seconds each spent running kernels,
    /// where the device keeps count (simulated GPUs; `None` elsewhere).
    pub compute_seconds: Option<f64>,
    /// Mean over the devices of the seconds each device's compute queue
    /// waited for its collectives (and for copies from other devices):
    /// communication that compute did not hide. `None` where not counted.
    pub comm_wait_seconds: Option<f64>,
    /// Bytes that crossed between devices (the batch pieces and the
    /// gradient sums), from this thread's transfer ledger.
    pub comm_bytes: u64,
}

/// Snapshots taken at an epoch's start to report its [`ParallelStats`].
pub(super) struct ParallelProbe {
    devices: Vec<Device>,
    times: Option<Vec<crate::kernel::QueueTimes>>,
    ledger: crate::TransferStats,
}

impl ParallelProbe {
    /// Starts counting on `devices` (nothing when `None`).
    pub(super) fn start(devices: Option<&[Device]>) -> ParallelProbe {
        let devices = devices.map(<[Device]>::to_vec).unwrap_or_default();
        let times = queue_times(&devices);
        ParallelProbe { devices, times, ledger: crate::thread_transfer_stats() }
    }

    /// The stats since the start (waiting for the devices' work first, so
    /// that the times are complete); `None` for a single device.
    pub(super) fn finish(self) -> Result<Option<ParallelStats>> {
        if self.devices.is_empty() {
            return Ok(None);
        }
        for d in &self.devices {
            crate::synchronize(d)?;
        }
        let n = self.devices.len() as f64;
        let (compute, wait) = match (self.times, queue_times(&self.devices)) {
            (Some(a), Some(b)) => {
                let sum = |f: fn(&crate::kernel::QueueTimes) -> u64| {
                    a.iter().zip(&b).map(|(a, b)| f(b).saturating_sub(f(a)) as f64 * 1e-9).sum::<f64>() / n
                };
                (Some(sum(|t| t.compute_ns)), Some(sum(|t| t.wait_ns)))
            }
            _ => (None, None),
        };
        let moved = crate::thread_transfer_stats().since(&self.ledger).direction(crate::Direction::DeviceToDevice);
        Ok(Some(ParallelStats { devices: self.devices.len(), compute_seconds: compute, comm_wait_seconds: wait, comm_bytes: moved.bytes }))
    }
}

fn queue_times(devices: &[Device]) -> Option<Vec<crate::kernel::QueueTimes>> {
    devices.iter().map(|d| crate::registry::backend(*d).ok().and_then(|b| b.queue_times())).collect()
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
    /// The callback that stopped the fit before `max_epochs`, if one did.
    pub stopped_by: Option<String>,
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

    /// Validation metric per epoch (epochs without one left out).
    pub fn val_metrics(&self) -> Vec<f64> {
        self.epochs.iter().filter_map(|e| e.val_metric).collect()
    }

    /// Mean seconds per epoch.
    pub fn seconds_per_epoch(&self) -> f64 {
        if self.epochs.is_empty() {
            return 0.0;
        }
        self.epochs.iter().map(|e| e.seconds).sum::<f64>() / self.epochs.len() as f64
    }

    /// Draws the loss curves (and the metric, when there is one) to a PNG.
    /// Needs kiln's `plot` feature.
    #[cfg(feature = "plot")]
    pub fn save_plot(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        register_plot_font();
        // Should the font not load, a chart without text still gets drawn;
        // a failure to write the file is reported as it is.
        let rgb = self.draw(path, true).or_else(|_| self.draw(path, false))?;
        crate::io::write_png_rgb(path, PLOT_SIZE.0, PLOT_SIZE.1, &rgb)
    }

    /// The chart's pixels (8-bit RGB rows).
    #[cfg(feature = "plot")]
    fn draw(&self, path: &Path, text: bool) -> Result<Vec<u8>> {
        use plotters::prelude::*;
        let err =
            |e: &dyn std::fmt::Display| Error::Io { path: path.display().to_string(), msg: format!("cannot draw the loss plot: {e}") };
        // Drawn into memory, then encoded by `io::write_png_rgb` (plotters'
        // own encoder would build the whole `image` crate for this one file).
        let mut rgb = vec![0u8; PLOT_SIZE.0 as usize * PLOT_SIZE.1 as usize * 3];
        let root = BitMapBackend::with_buffer(&mut rgb, PLOT_SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let series: Vec<(&str, Vec<f64>, RGBColor)> = {
            let mut s = vec![("train loss", self.train_losses(), BLUE)];
            let val = self.val_losses();
            if !val.is_empty() {
                s.push(("val loss", val, RED));
            }
            let metric = self.val_metrics();
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
        drop(chart);
        drop(root);
        Ok(rgb)
    }
}

/// The loss plot's width and height in pixels.
#[cfg(feature = "plot")]
const PLOT_SIZE: (u32, u32) = (640, 420);

/// The result of [`Trainer::evaluate`]: means over every example.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean loss over the examples.
    pub loss: f64,
    /// The metric (accuracy = correct / examples), when the loss has one.
    pub metric: Option<f64>,
    /// Examples predicted right, for classification.
    pub correct: Option<u64>,
    /// Examples evaluated.
    pub examples: usize,
}

/// Sums of one pass over a loader, on the device: loss × examples and
/// correct predictions.
pub(super) struct Sums {
    pub(super) loss: Option<Tensor>,
    pub(super) correct: Option<Tensor>,
    pub(super) examples: usize,
}

impl Sums {
    pub(super) fn new() -> Sums {
        Sums { loss: None, correct: None, examples: 0 }
    }

    /// Adds a batch of `n` examples: its mean loss and, for classification,
    /// its predictions (detached).
    pub(super) fn add(&mut self, loss: &Tensor, pred: &Tensor, target: &Tensor, kind: Loss, n: usize) -> Result<()> {
        let _g = no_grad();
        let weighted = loss.detach().to_dtype(DType::F64)?.mul_scalar(n as f64)?;
        self.loss = Some(accumulate(self.loss.take(), weighted)?);
        if kind.metric_name().is_some() {
            let hits = pred.detach().argmax(1)?.eq(&target.flatten_all()?)?.to_dtype(DType::F64)?.sum_all()?;
            self.correct = Some(accumulate(self.correct.take(), hits)?);
        }
        self.examples += n;
        Ok(())
    }

    /// These sums and `other`'s (moved to `device`) together.
    pub(super) fn merge(self, other: Sums, device: &Device) -> Result<Sums> {
        let _g = no_grad();
        let join = |a: Option<Tensor>, b: Option<Tensor>| -> Result<Option<Tensor>> {
            Ok(match (a, b) {
                (a, None) => a,
                (None, Some(b)) => Some(b.to(device)?),
                (Some(a), Some(b)) => Some(a.to(device)?.add(&b.to(device)?)?),
            })
        };
        Ok(Sums {
            loss: join(self.loss, other.loss)?,
            correct: join(self.correct, other.correct)?,
            examples: self.examples + other.examples,
        })
    }

    /// [loss sum, correct] as two f64 scalars on `device` (zeros when absent).
    pub(super) fn parts(self, device: &Device) -> Result<[Tensor; 2]> {
        let zero = || Tensor::zeros((), DType::F64, device);
        Ok([self.loss.map_or_else(zero, |t| t.reshape(()))?, self.correct.map_or_else(zero, |t| t.reshape(()))?])
    }
}

pub(super) fn accumulate(acc: Option<Tensor>, t: Tensor) -> Result<Tensor> {
    match acc {
        Some(a) => a.add(&t),
        None => Ok(t),
    }
}

/// The mean of a sum over `n` examples.
pub(super) fn mean(sum: f64, n: usize) -> f64 {
    sum / n as f64
}

/// The font every kiln plot writes its text in: DejaVu Sans, bundled in the
/// binary (`assets/`, under the Bitstream Vera licence), so a plot has text
/// on a server with no fonts and the binary links no font library.
#[cfg(feature = "plot")]
static PLOT_FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Makes plotters' `"sans-serif"` family (its default, and the one kiln's
/// plots name) the bundled DejaVu Sans, in every style. Plots drawn by kiln
/// call it themselves; call it before drawing your own charts with
/// plotters' `ab_glyph` feature, which knows no font until one is
/// registered. Idempotent and cheap after the first call.
///
/// ```
/// kiln::trainer::register_plot_font();
/// kiln::trainer::register_plot_font(); // again: nothing changes
/// ```
#[cfg(feature = "plot")]
pub fn register_plot_font() {
    use plotters::style::FontStyle;
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        for style in [FontStyle::Normal, FontStyle::Bold, FontStyle::Italic, FontStyle::Oblique] {
            // The bytes are a valid TrueType font (checked by a test), so
            // this cannot fail; were it to, plots fall back to no text.
            let _ = plotters::style::register_font("sans-serif", style, PLOT_FONT);
        }
    });
}

#[cfg(all(test, feature = "plot"))]
mod plot_font_tests {
    use plotters::style::IntoFont;

    #[test]
    fn the_bundled_font_lays_out_text_and_a_plot_has_text() {
        super::register_plot_font();
        let (w, h) = ("sans-serif", 20).into_font().box_size("epoch 10").expect("the bundled font is registered and valid");
        assert!(w > 40 && h > 10, "a laid-out caption of 8 characters at 20 px: {w}×{h}");
        let epoch = |epoch, train_loss| super::EpochStats {
            epoch,
            train_loss,
            train_metric: None,
            val_loss: Some(train_loss * 1.1),
            val_metric: None,
            lr: 0.1,
            seconds: 1.0,
            parallel: None,
        };
        let history =
            super::History { epochs: vec![epoch(0, 2.0), epoch(1, 1.0)], metric_name: None, device: crate::cpu(), stopped_by: None };
        let dir = std::env::temp_dir().join(format!("kiln-plot-font-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.png");
        // With text, not the fallback: draw(…, true) itself succeeds, and
        // draws more than the chart without text (its letters).
        let with = history.draw(&path, true).expect("a plot with text");
        let without = history.draw(&path, false).expect("a plot without text");
        let dark = |rgb: &[u8]| rgb.chunks(3).filter(|p| p.iter().all(|&c| c < 100)).count();
        assert!(dark(&with) > dark(&without) + 200, "letters drawn: {} dark pixels against {}", dark(&with), dark(&without));
        crate::io::write_png_rgb(&path, super::PLOT_SIZE.0, super::PLOT_SIZE.1, &with).expect("written");
        assert!(std::fs::metadata(&path).unwrap().len() > 1000);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
