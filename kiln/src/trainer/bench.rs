//! Workload W5 of `kiln bench`, through the Trainer.

use super::{Learner, Progress, Trainer};
use crate::data::{make_regression, DataLoader, DataModule};
use crate::nn::{init, Linear, Loss};
use crate::optim::OptimizerConfig;
use crate::{Device, Result};
use std::time::Instant;

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
    let mut trainer = Trainer::builder().max_epochs(epochs).progress(Progress::Off).build()?;
    let start = Instant::now();
    let history = trainer.fit(&mut model, &data)?;
    let ms_per_epoch = start.elapsed().as_secs_f64() * 1e3 / epochs.max(1) as f64;
    let w = model.net.weight().to_vec::<f32>()?;
    let b = model.net.bias().map(|b| b.to_vec::<f32>()).transpose()?.map(|v| v[0]).unwrap_or(0.0);
    Ok(W5Report { ms_per_epoch, epochs, w, b, final_loss: history.last().map(|e| e.train_loss).unwrap_or(f64::NAN) })
}
