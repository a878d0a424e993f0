//! The book's LeNet recipe (sigmoid LeNet, Xavier-uniform weights through
//! `init_cnn`, SGD with lr 0.9, batches of 256) on scikit-learn's
//! handwritten digits, which kiln ships (`kiln::data::digits`, resized to
//! 28×28), on the best device here: the README's recipe, epoch by epoch.
//!
//!     cargo run --release -p kiln --example lenet_digits
//!     KILN_SIM_GPUS=1 cargo run --release -p kiln --example lenet_digits -- --epochs 40
//!
//! `--save-init FILE` also writes the initial parameters (safetensors):
//! `scripts/lenet_digits_torch.py` trains PyTorch from the same weights, on
//! the same data in the same order, and prints the figures that
//! `tests/cnn_models.rs` compares kiln with.

use kiln::data::{digits, DIGITS_CLASSES};
use kiln::models::lenet;
use kiln::nn::{init_cnn, Loss, Module};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut epochs = 150;
    let mut save_init = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--epochs", Some(n)) => epochs = n.parse().map_err(|_| format!("--epochs takes a number, not `{n}`"))?,
            ("--save-init", Some(path)) => save_init = Some(path),
            _ => return Err(format!("unknown argument `{arg}`: use --epochs N and --save-init FILE").into()),
        }
    }
    kiln::manual_seed(0);
    let data = digits(28, 256)?;
    let mut net = lenet(DIGITS_CLASSES);
    net.init_lazy(&data.train.tensors()[0].narrow(0, 0, 256)?)?;
    net.apply(&mut init_cnn)?;
    if let Some(path) = &save_init {
        kiln::checkpoint::save(&net, path)?;
        println!("initial parameters written to {path}");
    }
    let mut model = Learner::new(net, Loss::CrossEntropy, OptimizerConfig::sgd(0.9)).with_shuffle_seed(0);
    let mut trainer = Trainer::builder().max_epochs(epochs).num_gpus(1).progress(Progress::Off).build()?;
    let history = trainer.fit(&mut model, &data)?;
    println!("sigmoid LeNet on the digits (28x28), SGD lr 0.9, batch 256, on {}", trainer.device());
    for (e, (loss, acc)) in history.train_losses().iter().zip(history.val_metrics()).enumerate() {
        if (e + 1) % 10 == 0 || e + 1 == epochs {
            println!("epoch {:>3}  train loss {loss:.4}  validation accuracy {acc:.4}", e + 1);
        }
    }
    Ok(())
}
