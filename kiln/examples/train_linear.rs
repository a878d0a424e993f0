//! Linear regression with autograd, the book's first model, trained by the
//! [`Trainer`] on the best device present, then W5 of `kiln bench`.
//!
//!     RAYON_NUM_THREADS=1 cargo run --release -p kiln --example train_linear
//!     KILN_SIM_GPUS=1 cargo run --release -p kiln --example train_linear

use kiln::data::synthetic_regression;
use kiln::nn::{init, Linear, Loss, Module};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{bench_w5, Learner, Trainer};

fn main() -> kiln::Result<()> {
    kiln::manual_seed(0);
    let data = synthetic_regression(1000, 1000, 32)?;
    let net = Linear::new(2, 1, &kiln::cpu())?;
    init::normal_(&net.weight(), 0.0, 0.01)?;
    let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::builder().max_epochs(3).num_gpus(1).build()?;
    let history = trainer.fit(&mut model, &data)?;
    for e in &history.epochs {
        println!("epoch {}: train loss {:.6}, val loss {:.6}", e.epoch + 1, e.train_loss, e.val_loss.unwrap_or(f64::NAN));
    }
    println!(
        "trained on {}; w = {:?}, b = {:?}",
        history.device,
        model.net.weight().to_vec::<f32>()?,
        model.net.parameter("bias")?.to_vec::<f32>()?
    );

    // W5: median of 7 runs of 10 epochs.
    let mut runs: Vec<f64> = Vec::new();
    let mut last = None;
    for _ in 0..7 {
        let r = bench_w5(10)?;
        runs.push(r.ms_per_epoch);
        last = Some(r);
    }
    runs.sort_by(f64::total_cmp);
    if let Some(r) = last {
        println!(
            "W5 linear regression (1000 examples, batch 32, SGD lr 0.03, 10 epochs, {} thread(s)): {:.3} ms/epoch (median of 7; min {:.3}); w = {:?}, b = {:.4}",
            rayon::current_num_threads(),
            runs[3],
            runs[0],
            r.w,
            r.b
        );
    }
    Ok(())
}
