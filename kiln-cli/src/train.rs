//! `kiln train`: train a classifier on the best device, with a progress bar,
//! a loss/accuracy plot and a final safetensors checkpoint; and the tour's
//! steps on networks (a network on a device, a short Trainer run).

use crate::fail;
use crate::util::{fmt_ms, table, Align, Result};
use kiln::data::{fashion_mnist, synthetic_classification, synthetic_regression, DataModule, FASHION_MNIST_CLASSES};
use kiln::nn::{Flatten, LazyLinear, Linear, Loss, Module, ReLU, Sequential};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{checkpoint, cpu, try_gpu, Direction, Tensor};
use std::path::{Path, PathBuf};

/// Options of `kiln train`.
#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Fashion-MNIST directory with the four IDX files (gzipped or not); synthetic data when absent.
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Use up to this many GPUs (the first one computes); 0 trains on the CPU. Not with --dist, where each process
    /// takes one device.
    #[arg(long, value_name = "N", default_value_t = 1, conflicts_with = "dist")]
    pub num_gpus: usize,
    /// Epochs to train.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub epochs: u32,
    /// Examples per batch.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_size: u32,
    /// Learning rate of SGD.
    #[arg(long, value_name = "LR", default_value_t = 0.1, allow_negative_numbers = true)]
    pub lr: f64,
    /// Width of the hidden layer of the MLP.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub hidden: u32,
    /// Directory for the plot (training.png), the parameters (model.safetensors) and the training checkpoint (checkpoint.safetensors).
    #[arg(long, value_name = "DIR", default_value = "kiln-train")]
    pub out: PathBuf,
    /// Resume from this checkpoint: a training checkpoint (checkpoint.safetensors: parameters, optimizer state, epoch count) or parameters only (model.safetensors).
    #[arg(long, value_name = "CKPT")]
    pub resume: Option<PathBuf>,
    /// The network: an MLP, or one of the book's CNNs (LeNet, LeNet with batch normalisation, ResNet-18; synthetic images when --data is absent).
    #[arg(long, value_enum, default_value_t = ModelKind::Mlp)]
    pub model: ModelKind,
    /// Random seed (data shuffling, initial parameters, synthetic data).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Train data-parallel across the processes of this launch, one device each (`mpirun -np 4 kiln train --dist`; a
    /// build with `--features mpi`): each batch is cut over the ranks, rank 0 prints, plots and writes the files. Replaces
    /// --num-gpus (each process takes gpu(local rank), or the CPU; the two together are refused). Alone, a world of one.
    #[arg(long)]
    pub dist: bool,
}

/// The networks `kiln train` trains.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelKind {
    /// Flatten, linear, ReLU, linear.
    Mlp,
    /// The book's LeNet (sigmoid, average pooling).
    Lenet,
    /// LeNet with batch normalisation.
    BnLenet,
    /// ResNet-18, 1-channel variant.
    Resnet18,
}

/// The MLP `kiln train` trains: flatten, linear, ReLU, linear.
fn mlp(inputs: usize, hidden: usize, classes: usize) -> kiln::Result<Sequential> {
    Ok(Sequential::new().add(Flatten).add(Linear::new(inputs, hidden, &cpu())?).add(ReLU).add(Linear::new(hidden, classes, &cpu())?))
}

fn check_out_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| fail!("cannot create the output directory {}: {e}", dir.display()))?;
    let probe = dir.join(format!(".kiln-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| fail!("cannot write to the output directory {}: {e}", dir.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// Runs `kiln train`.
pub fn run(args: TrainArgs) -> Result<()> {
    if let Some(dir) = &args.data
        && !dir.is_dir()
    {
        return Err(fail!("--data {}: no such directory; give the directory holding the Fashion-MNIST IDX files", dir.display()));
    }
    if let Some(ckpt) = &args.resume
        && !ckpt.is_file()
    {
        return Err(fail!("--resume {}: no such checkpoint file", ckpt.display()));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(fail!("--lr must be a positive number, got {}", args.lr));
    }
    // Across processes: every rank trains, rank 0 alone speaks and writes.
    let group = if args.dist { Some(kiln::dist::init()?) } else { None };
    if group.is_none() {
        let launch = kiln::dist::launch()?;
        if launch.size > 1 {
            return Err(fail!(
                "this process is {launch}: add --dist to train across the processes (without it every rank would train alone on all the data and write the same files)"
            ));
        }
    }
    let main = group.as_ref().is_none_or(|g| g.is_main());
    let out_dir = if main { check_out_dir(&args.out) } else { Ok(()) };
    if let Some(g) = &group {
        // Every rank learns whether rank 0 can write, so none waits for a
        // rank 0 that has given up.
        let ok = g.broadcast(&Tensor::new(&[i64::from(out_dir.is_ok())], &g.device())?, 0)?.to_vec::<i64>()?[0] == 1;
        if !ok && !main {
            return Err(fail!("rank 0 cannot write its output directory {}", args.out.display()));
        }
    }
    out_dir?;
    kiln::manual_seed(args.seed);
    let batch = args.batch_size as usize;
    let (data, what, inputs, classes): (DataModule, String, usize, usize) = match &args.data {
        Some(dir) => {
            let data = fashion_mnist(dir, batch)?;
            let inputs: usize = data.train.tensors()[0].dims()[1..].iter().product();
            (data, format!("Fashion-MNIST from {}", dir.display()), inputs, FASHION_MNIST_CLASSES.len())
        }
        None if args.model != ModelKind::Mlp => (
            kiln::models::synthetic_image_task(4096, 1024, batch, args.seed)?,
            "synthetic 28x28 images (4 shapes at random places)".into(),
            28 * 28,
            kiln::models::SYNTHETIC_CLASSES,
        ),
        None => (synthetic_classification(8192, 2048, 4, 10, batch)?, "synthetic classification (10 classes, 4 features)".into(), 4, 10),
    };
    let (net, net_name) = match args.model {
        ModelKind::Mlp => (mlp(inputs, args.hidden as usize, classes)?, format!("an MLP {inputs}-{}-{classes}", args.hidden)),
        ModelKind::Lenet => (kiln::models::lenet(classes), "LeNet".to_string()),
        ModelKind::BnLenet => (kiln::models::bn_lenet(classes), "LeNet with batch normalisation".to_string()),
        ModelKind::Resnet18 => (kiln::models::resnet18(classes), "ResNet-18".to_string()),
    };
    let mut model = Learner::new(net, Loss::CrossEntropy, OptimizerConfig::sgd(args.lr));
    let builder = Trainer::builder().max_epochs(args.epochs as usize).progress(Progress::Auto);
    let mut trainer = match &group {
        Some(g) => builder.process_group(g.clone()),
        None => builder.num_gpus(args.num_gpus),
    }
    .build()?;
    let device = trainer.device();
    if let Some(ckpt) = &args.resume {
        if model.net.has_lazy_parameters() {
            // The lazy layers take their sizes from an input: make them
            // (in evaluation mode, so no running statistic moves) before
            // the checkpoint fills them.
            let x = &data.train.tensors()[0];
            let _g = kiln::no_grad();
            model.net.eval();
            model.net.forward(&x.narrow(0, 0, x.dims()[0].min(2))?)?;
            model.net.train();
        }
        if checkpoint::is_trainer_checkpoint(ckpt)? {
            trainer.load_checkpoint(&mut model, ckpt)?;
            if main {
                println!("Resumed from {} (after epoch {})", ckpt.display(), model.epochs_trained());
            }
        } else {
            checkpoint::load(&mut model.net, ckpt, &device)?;
            if main {
                println!("Resumed from {} (parameters only)", ckpt.display());
            }
        }
    }
    let placement = match &group {
        Some(g) => format!("{} process(es) ({} engine), rank 0 on {device}", g.size(), g.engine()),
        None => format!("{device} (num_gpus {} asked, {} available)", args.num_gpus, kiln::num_gpus()),
    };
    if main {
        println!(
            "Training {net_name} ({} parameters) on {what}: {} training and {} validation examples, on {placement}, \
             {} epochs, batch {batch}, SGD lr {}",
            if model.net.has_lazy_parameters() { "lazy".to_string() } else { model.net.num_parameters().to_string() },
            data.train.num_examples(),
            data.val.as_ref().map(|v| v.num_examples()).unwrap_or(0),
            args.epochs,
            args.lr
        );
    }
    let before = kiln::thread_transfer_stats();
    let history = trainer.fit(&mut model, &data)?;
    let transfers = kiln::thread_transfer_stats().since(&before);
    if !main {
        // The history is every rank's (the sums are reduced across ranks),
        // and the parameters are rank 0's: nothing of this rank's to say.
        return Ok(());
    }

    let rows: Vec<Vec<String>> = history
        .epochs
        .iter()
        .map(|e| {
            vec![
                (e.epoch + 1).to_string(),
                format!("{:.4}", e.train_loss),
                e.val_loss.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into()),
                e.val_metric.map(|v| format!("{:.2}%", 100.0 * v)).unwrap_or_else(|| "-".into()),
                // Milliseconds under a second: a GPU's epochs of the small
                // networks take a few.
                if e.seconds < 1.0 { fmt_ms(e.seconds * 1e3) } else { format!("{:.2} s", e.seconds) },
            ]
        })
        .collect();
    println!(
        "{}",
        table(
            &[
                ("EPOCH", Align::Right),
                ("TRAIN LOSS", Align::Right),
                ("VAL LOSS", Align::Right),
                ("VAL ACCURACY", Align::Right),
                ("TIME", Align::Right)
            ],
            &rows
        )
    );
    if device.is_gpu() {
        println!(
            "Transfers: {} host-to-device (the model, and the data once when it fits on the device, else each batch), {} device-to-host (one read per epoch)",
            transfers.direction(Direction::HostToDevice).count,
            transfers.direction(Direction::DeviceToHost).count
        );
    }
    let plot = args.out.join("training.png");
    let losses = vec![("train loss".to_string(), history.train_losses()), ("val loss".to_string(), history.val_losses())];
    let acc: Vec<f64> = history.epochs.iter().filter_map(|e| e.val_metric).collect();
    crate::plot::curves(&plot, "kiln train", &losses, &[("val accuracy".to_string(), acc)])?;
    let params = args.out.join("model.safetensors");
    checkpoint::save(&model.net, &params)?;
    let ckpt = args.out.join("checkpoint.safetensors");
    trainer.save_checkpoint(&model, &ckpt)?;
    println!("Wrote {}, {} and {} (resume with --resume {})", plot.display(), params.display(), ckpt.display(), ckpt.display());
    Ok(())
}

/// The tour's steps on networks: a network on a device, and a short Trainer run.
pub fn tour_network(first: usize, x: &Tensor, step: fn(usize, &str)) -> Result<()> {
    step(first, "Neural networks and GPUs");
    let mut net = Sequential::new().add(LazyLinear::new(1));
    net.to(&try_gpu(0))?;
    println!("net = Sequential::new().add(LazyLinear::new(1)); net.to(&try_gpu(0))?;");
    let out = net.forward(x)?;
    println!("net.forward(&X) = {out}");
    println!("net[0].weight is on {}", net.parameter("0.weight")?.device());
    let host_x = x.to(&cpu())?;
    match net.forward(&host_x) {
        Ok(_) => println!("net.forward(&X on cpu) ran"),
        Err(e) => println!("net.forward(&X on cpu) fails: {e}"),
    }

    step(first + 1, "The Trainer with num_gpus: model and batches on gpus[0]");
    kiln::manual_seed(0);
    let data = synthetic_regression(1000, 100, 32)?;
    let mut model = Learner::new(Linear::new(2, 1, &cpu())?, Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::builder().max_epochs(3).num_gpus(1).progress(Progress::Off).build()?;
    println!("Trainer::builder().max_epochs(3).num_gpus(1).build()?: gpus = {:?}", trainer.gpus());
    let before = kiln::thread_transfer_stats();
    let history = trainer.fit(&mut model, &data)?;
    let moved = kiln::thread_transfer_stats().since(&before);
    for e in &history.epochs {
        println!("epoch {}: train loss {:.5}, val loss {:.5}", e.epoch + 1, e.train_loss, e.val_loss.unwrap_or(f64::NAN));
    }
    let w = model.net.weight();
    println!("weight on {}: {}", w.device(), w.detach().to_vec::<f32>()?.iter().map(|v| format!("{v:.3}")).collect::<Vec<_>>().join(", "));
    if let Some(b) = model.net.bias() {
        println!("bias: {:.3}   (the data was made with w = [2, -3.4], b = 4.2)", b.detach().to_vec::<f32>()?[0]);
    }
    println!(
        "fit made {} host-to-device copies (the model and the data set once, then one shuffled order per epoch) and read the losses device-to-host {} times (once per epoch)",
        moved.direction(Direction::HostToDevice).count,
        moved.direction(Direction::DeviceToHost).count
    );
    Ok(())
}
