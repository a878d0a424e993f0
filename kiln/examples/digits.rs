//! scikit-learn's handwritten digits (8×8 pixels, ten classes, shipped with
//! kiln as `kiln::data::load_digits`) classified by an MLP trained with the
//! `Trainer` on the first GPU (or the CPU): the data through numpy's format,
//! written with the builder, the data held on the device, exact accuracy,
//! and a checkpoint that resumes Adam on the same curve.
//!
//!     cargo run --release -p kiln --example digits
//!     KILN_SIM_GPUS=1 cargo run --release -p kiln --example digits

use kiln::data::{load_digits, DataModule};
use kiln::nn::{Linear, Loss, ReLU, Sequential};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{cpu, try_gpu, Direction};

/// The MLP: 64 → 64 → 10, initialised from `seed`.
fn learner(seed: u64) -> kiln::Result<Learner<Sequential>> {
    kiln::manual_seed(seed);
    let net = Sequential::new().add(Linear::new(64, 64, &cpu())?).add(ReLU).add(Linear::new(64, 10, &cpu())?);
    Ok(Learner::new(net, Loss::CrossEntropy, OptimizerConfig::adam(0.01)))
}

fn main() -> kiln::Result<()> {
    let (x, y) = load_digits(8, &cpu())?; // pixels in [0, 1]
    let n = x.dims()[0];
    let x = x.reshape((n, 64))?;
    // The data through numpy's format, as a user's real data would arrive
    // (`np.savez_compressed("digits.npz", x=..., y=...)` writes the same file).
    let path = std::env::temp_dir().join(format!("kiln-digits-{}.npz", std::process::id()));
    kiln::io::write_npz(&path, &[("x", &x), ("y", &y)], true)?;
    let arrays = kiln::io::read_npz(&path, &cpu())?;
    let _ = std::fs::remove_file(&path);
    let (x, y) = (arrays["x"].clone(), arrays["y"].clone());
    println!("read digits.npz: x {:?} {}, y {:?} {}", x.dims(), x.dtype(), y.dims(), y.dtype());
    // A seeded fifth held out (scikit-learn's test_size=0.2: 360 images),
    // batches of 64: the last validation batch has 40 images.
    let data = DataModule::from_tensors(x, y)?.with_batch_size(64)?.random_split(0.2, 42)?;
    let val = data.val.as_ref().map_or(0, |v| v.num_examples());
    let device = try_gpu(0);
    println!("{n} digit images, {} to train and {val} to validate, on {device}", data.train.num_examples());

    // 30 epochs of Adam; the data is copied to the device once.
    let epochs = 30;
    let mut model = learner(0)?;
    let mut trainer = Trainer::builder().max_epochs(epochs).device(device).progress(Progress::Off).build()?;
    let before = kiln::thread_transfer_stats();
    let straight = trainer.fit(&mut model, &data)?;
    let moved = kiln::thread_transfer_stats().since(&before);
    for e in straight.epochs.iter().filter(|e| e.epoch % 5 == 4) {
        println!(
            "epoch {:>2}: train loss {:.4}, val loss {:.4}, val accuracy {:.4}",
            e.epoch + 1,
            e.train_loss,
            e.val_loss.unwrap_or(f64::NAN),
            e.val_metric.unwrap_or(f64::NAN)
        );
    }
    let (up, down) = (moved.direction(Direction::HostToDevice).count, moved.direction(Direction::DeviceToHost).count);
    println!(
        "transfers over {epochs} epochs: {up} host-to-device, {down} device-to-host ({:.1} per epoch)",
        (up + down) as f64 / epochs as f64
    );

    // Exact accuracy: correct predictions over every validation image,
    // the short last batch included.
    if let Some(val_loader) = &data.val {
        let e = trainer.evaluate(&mut model, val_loader)?;
        println!(
            "validation accuracy {:.6} ({} of {} right), loss {:.6}",
            e.metric.unwrap_or(f64::NAN),
            e.correct.unwrap_or(0),
            e.examples,
            e.loss
        );
    }

    // Half the epochs, a checkpoint, and a fresh learner that resumes
    // from it: the curve is the uninterrupted one, bit for bit.
    let path = std::env::temp_dir().join(format!("kiln-digits-{}.safetensors", std::process::id()));
    let mut first = learner(0)?;
    let mut half = Trainer::builder().max_epochs(epochs / 2).device(device).progress(Progress::Off).build()?;
    let a = half.fit(&mut first, &data)?;
    half.save_checkpoint(&first, &path)?;
    let mut resumed = learner(1)?;
    half.load_checkpoint(&mut resumed, &path)?;
    let b = half.fit(&mut resumed, &data)?;
    let _ = std::fs::remove_file(&path);
    let curve = |h: &[&kiln::trainer::History]| -> Vec<(f64, Option<f64>, Option<f64>)> {
        h.iter().flat_map(|h| h.epochs.iter().map(|e| (e.train_loss, e.val_loss, e.val_metric))).collect()
    };
    let same = curve(&[&a, &b]) == curve(&[&straight]);
    println!(
        "resumed after epoch {} from a checkpoint: the same loss curve as the uninterrupted run: {same} (final train loss {:.6} vs {:.6})",
        a.epochs.len(),
        b.last().map_or(f64::NAN, |e| e.train_loss),
        straight.last().map_or(f64::NAN, |e| e.train_loss)
    );
    if !same {
        eprintln!("the resumed run diverged from the uninterrupted one");
        std::process::exit(1);
    }
    Ok(())
}
