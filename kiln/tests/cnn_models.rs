//! The book's convolutional networks end to end: the book's LeNet recipe
//! learns scikit-learn's digits as PyTorch does from the same weights;
//! LeNet and BN-LeNet train on the synthetic images with the same loss
//! curve on the CPU, a simulated GPU and every CUDA device; BN-LeNet and ResNet-18 train a step everywhere;
//! batch-norm buffers follow train()/eval(), move with to(device) and
//! survive a checkpoint onto another device.

mod common;

use common::{cuda_devices, sims};
use kiln::models::{bn_lenet, lenet, resnet18, synthetic_image_task, synthetic_images, SYNTHETIC_CLASSES};
use kiln::nn::{BatchNorm2d, Loss, Module, Sequential};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{cpu, DType, Device, Error, Result, Tensor};

fn fit(net: Sequential, epochs: usize, device: Device) -> Result<(Vec<f64>, f64)> {
    kiln::manual_seed(3);
    let data = synthetic_image_task(1024, 256, 64, 11)?;
    let mut model = Learner::new(net, Loss::CrossEntropy, OptimizerConfig::adam(0.01));
    let mut trainer = Trainer::builder().max_epochs(epochs).device(device).progress(Progress::Off).build()?;
    let h = trainer.fit(&mut model, &data)?;
    let acc = h.last().and_then(|e| e.train_metric).unwrap_or(0.0);
    Ok((h.train_losses(), acc))
}

/// Sigmoid LeNet sits on its plateau for the first epochs (PyTorch's too,
/// with the same data, architecture and optimizer): its curve is compared
/// across devices; BN-LeNet leaves the plateau and is held to a training
/// accuracy (its validation accuracy in evaluation mode, through running
/// statistics of 128 small steps, is erratic here, as PyTorch's is).
#[test]
fn lenet_and_bn_lenet_train_on_the_synthetic_images_with_the_same_curve_on_every_device() -> Result<()> {
    let (curve, _) = fit(lenet(SYNTHETIC_CLASSES), 3, cpu())?;
    let (bn_curve, acc) = fit(bn_lenet(SYNTHETIC_CLASSES), 8, cpu())?;
    eprintln!("LeNet {curve:?}; BN-LeNet {bn_curve:?}, accuracy {acc}");
    assert!(acc >= ACCURACY, "BN-LeNet on the CPU reached {acc} training accuracy (curve {bn_curve:?})");
    // A simulated GPU runs the host's kernels: its curves match the CPU's to
    // 1e-4. A CUDA device sums its products (cuBLAS) and reductions in
    // another order, and eight epochs of Adam carry that rounding on: an
    // H200's BN-LeNet loss was 1.1e-4 from the CPU's at epoch 2 of 8. Its
    // curves are held to 1e-3 of the loss (a wrong gradient or kernel moves
    // them by far more).
    let mut others = vec![(sims()[0], false)];
    others.extend(cuda_devices().into_iter().map(|d| (d, true)));
    for (d, cuda) in others {
        let close = |x: f64, y: f64| (x - y).abs() <= if cuda { 1e-3 * x.abs().max(1.0) } else { 1e-4 };
        let (c, _) = fit(lenet(SYNTHETIC_CLASSES), 3, d)?;
        for (i, (x, y)) in curve.iter().zip(&c).enumerate() {
            assert!(close(*x, *y), "LeNet epoch {i}: loss {y} on {d}, {x} on the CPU");
        }
        // The CUDA simulator runs every kernel thread on the CPU, eight
        // epochs of BN-LeNet take it minutes: there the curve is held over
        // the first three epochs and the accuracy is the CPU's to reach.
        let simulated_cuda = cuda && std::env::var_os("KILN_CUDASIM").is_some();
        let (c, a) = fit(bn_lenet(SYNTHETIC_CLASSES), if simulated_cuda { 3 } else { 8 }, d)?;
        assert!(simulated_cuda || a >= ACCURACY, "BN-LeNet on {d} reached {a}");
        for (i, (x, y)) in bn_curve.iter().zip(&c).enumerate() {
            assert!(close(*x, *y), "BN-LeNet epoch {i}: loss {y} on {d}, {x} on the CPU");
        }
    }
    Ok(())
}

const ACCURACY: f64 = 0.85;

/// One SGD step of `net` on 4 synthetic images on `d`; the loss.
fn one_step(mut net: Sequential, d: Device) -> Result<f64> {
    let (x, y) = synthetic_images(4, 5, &d)?;
    net.to(&d)?;
    let loss = Loss::CrossEntropy.compute(&net.forward(&x)?, &y)?;
    loss.backward()?;
    for p in net.parameters() {
        let g = p.grad().expect("every parameter has a gradient");
        p.assign(&(&p - &(g * 0.01)?)?)?;
    }
    loss.to_scalar::<f32>().map(f64::from)
}

#[test]
fn bn_lenet_and_resnet18_train_a_step_on_every_device() -> Result<()> {
    for d in common::devices() {
        kiln::manual_seed(1);
        let a = one_step(bn_lenet(10), d)?;
        kiln::manual_seed(1);
        let b = one_step(resnet18(10), d)?;
        assert!(a.is_finite() && b.is_finite(), "losses on {d}: {a}, {b}");
    }
    let net = resnet18(10);
    let _ = net.forward(&Tensor::zeros((2, 1, 28, 28), DType::F32, &cpu())?)?;
    // 11.18M parameters as PyTorch's 1-channel ResNet-18 with 10 classes.
    assert_eq!(net.num_parameters(), 11_178_378);
    assert_eq!(net.named_buffers().len(), 2 * 17);
    Ok(())
}

#[test]
fn batch_norm_buffers_follow_the_mode_move_and_are_checkpointed() -> Result<()> {
    let g = sims()[0];
    let mut bn = BatchNorm2d::new(2, &cpu())?;
    let x = Tensor::from_vec((0..16).map(|i| i as f32).collect::<Vec<_>>(), (2, 2, 2, 2), &cpu())?;
    bn.forward(&x)?;
    // Channel 0 holds 0..4 and 8..12: mean 5.5; channel 1 mean 9.5.
    assert_eq!(bn.running_mean().to_vec::<f32>()?, vec![0.55, 0.95]);
    bn.eval();
    let before = bn.running_mean().to_vec::<f32>()?;
    let y = bn.forward(&x)?;
    assert_eq!(bn.running_mean().to_vec::<f32>()?, before, "evaluation leaves the running statistics");
    // Evaluation uses them: (x − 0.55)/√(rv + eps).
    let rv = bn.running_var().to_vec::<f32>()?[0];
    assert!((y.to_vec::<f32>()?[0] - (0.0 - 0.55) / (rv + 1e-5).sqrt()).abs() < 1e-5);

    // A device mismatch names the layer's parameter and both devices.
    match bn.forward(&x.to(&g)?) {
        Err(Error::DeviceMismatch { op, .. }) => assert!(op.contains("weight") && op.contains("cpu"), "{op}"),
        other => panic!("expected a device mismatch, got {other:?}"),
    }
    bn.to(&g)?;
    assert_eq!(bn.running_mean().device(), g);
    bn.train();
    bn.forward(&x.to(&g)?)?;
    assert_eq!(bn.running_mean().device(), g);

    // A checkpoint written on the GPU loads onto the CPU with its buffers.
    let dir = std::env::temp_dir().join(format!("kiln-cnn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bn.safetensors");
    kiln::checkpoint::save(&bn, &path)?;
    let mut fresh = BatchNorm2d::new(2, &cpu())?;
    kiln::checkpoint::load(&mut fresh, &path, &cpu())?;
    assert_eq!(fresh.running_mean().to_vec::<f32>()?, bn.running_mean().to_vec::<f32>()?);
    assert_eq!(fresh.running_var().to_vec::<f32>()?, bn.running_var().to_vec::<f32>()?);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// An out-of-memory anywhere in a training step of BN-LeNet on a simulated
/// GPU (the forward, a convolution's or batch norm's backward, the update)
/// fails the step and leaves the parameters and the optimizer's state
/// (Adam's moments and counters) bit for bit as they were; with the memory
/// back the same learner trains. Swept over the free memory, from none to
/// more than a step needs. The running statistics are not compared: the
/// forward updates them in place, as PyTorch's does, so a step that fails in
/// its backward keeps that update (PyTorch's would too).
#[test]
fn out_of_memory_in_a_cnn_step_leaves_parameters_buffers_and_optimizer_as_they_were() -> Result<()> {
    sims(); // the shared simulated GPUs first, so that this one is not among them
    let d = common::own_sims(1, 256 << 20)[0];
    kiln::manual_seed(5);
    let data = synthetic_image_task(64, 0, 64, 2)?;
    // Read on the host: the device is full while a failed state is checked.
    let bits =
        |t: &Tensor| -> Result<Vec<u64>> { Ok(t.to(&cpu())?.to_dtype(DType::F64)?.to_vec::<f64>()?.iter().map(|v| v.to_bits()).collect()) };
    // (parameters, optimizer state, running statistics)
    type Snapshot = (Vec<Vec<u64>>, Vec<Vec<u64>>, Vec<Vec<u64>>);
    let snapshot = |m: &Learner<Sequential>| -> Result<Snapshot> {
        let params = m.net.parameters().iter().map(bits).collect::<Result<_>>()?;
        let state = m.live_optimizer().expect("a step made the optimizer").state_dict()?;
        let mut opt: Vec<Vec<u64>> = state.buffers.values().map(bits).collect::<Result<_>>()?;
        opt.push(state.hyperparameters.values().map(|v| v.to_bits()).collect());
        let buffers = m.net.named_buffers().iter().map(|(_, b)| bits(b)).collect::<Result<_>>()?;
        Ok((params, opt, buffers))
    };
    let mut model = Learner::new(bn_lenet(SYNTHETIC_CLASSES), Loss::CrossEntropy, OptimizerConfig::adam(0.01));
    let mut trainer = Trainer::builder().max_epochs(1).device(d).progress(Progress::Off).build()?;
    // One step made the lazy layers and the optimizer's state: what a step
    // needs beyond what is held now bounds the sweep.
    kiln::reset_peak_memory(&d)?;
    trainer.fit(&mut model, &data)?;
    kiln::synchronize(&d)?;
    let stats = d.memory_stats()?;
    let need = stats.peak - stats.in_use;
    let (mut failed, mut passed) = (0, 0);
    for k in 0..=12 {
        let free = need * k / 10;
        kiln::synchronize(&d)?;
        let s = d.memory_stats()?;
        let fill = s.capacity.unwrap() - s.in_use - free;
        let ballast = Tensor::zeros(fill / 4, DType::F32, &d)?;
        let before = (snapshot(&model)?, model.steps_trained());
        match trainer.fit(&mut model, &data) {
            Ok(_) => passed += 1,
            Err(Error::OutOfMemory { device, .. }) => {
                assert_eq!(device, d);
                failed += 1;
                let ((p0, o0, _), steps0) = &before;
                let (p1, o1, _) = snapshot(&model)?;
                assert!(p1 == *p0, "an out-of-memory with {free} B free changed the parameters");
                assert!(o1 == *o0, "an out-of-memory with {free} B free changed the optimizer's state");
                assert_eq!(model.steps_trained(), *steps0);
            }
            Err(e) => panic!("with {free} B free: {e}"),
        }
        drop(ballast);
    }
    assert!(failed >= 5 && passed >= 1, "{failed} steps failed and {passed} passed over the sweep");
    // With the memory back, the same learner trains on.
    let steps = model.steps_trained();
    trainer.fit(&mut model, &data)?;
    assert_eq!(model.steps_trained(), steps + 1);
    Ok(())
}

/// PyTorch's figures for the book's LeNet recipe on the digits from the
/// same initial weights, data and batch order (`scripts/lenet_digits_torch.py`,
/// torch 2.15 on the CPU): epoch, train loss, validation accuracy.
const TORCH_LENET_DIGITS: &str = include_str!("data/lenet_digits_torch.txt");

/// The README's LeNet recipe on `device` for `epochs` epochs: train losses
/// and validation accuracies.
fn books_lenet_recipe(device: Device, epochs: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    use kiln::data::{digits, DIGITS_CLASSES};
    use kiln::nn::init_cnn;
    kiln::manual_seed(0);
    let data = digits(28, 256)?;
    let mut net = lenet(DIGITS_CLASSES);
    net.init_lazy(&data.train.tensors()[0].narrow(0, 0, 256)?)?;
    net.apply(&mut init_cnn)?;
    let a = (6.0f32 / (25.0 + 150.0)).sqrt();
    assert!(net.parameter("0.weight")?.to_vec::<f32>()?.iter().all(|w| w.abs() <= a), "init_cnn draws U(±√(6 / (fan_in + fan_out)))");
    let mut model = Learner::new(net, Loss::CrossEntropy, OptimizerConfig::sgd(0.9)).with_shuffle_seed(0);
    let mut trainer = Trainer::builder().max_epochs(epochs).device(device).progress(Progress::Off).build()?;
    let history = trainer.fit(&mut model, &data)?;
    Ok((history.train_losses(), history.val_metrics()))
}

/// The book's LeNet recipe (sigmoid LeNet, `init_lazy` then
/// `apply(init_cnn)` for Xavier-uniform weights, SGD with lr 0.9, batches
/// of 256), as the README writes it, learns scikit-learn's digits as
/// PyTorch does from the same weights, data and batch order: the same
/// plateau of about 100 epochs (6 steps each), the same escape, and the same
/// validation accuracy at the end. kiln's and PyTorch's losses agreed to
/// 1e-4 at every epoch when recorded; the bounds leave room for summation
/// order, not for a wrong gradient (which moves the escape by tens of
/// epochs or stops it).
///
/// A simulated GPU runs the CPU's kernels, so its run is held to the CPU's
/// own losses and accuracies, to 1e-6, over the first
/// [`SIM_RECIPE_EPOCHS`] epochs (the loss moves by about 1e-3 a step on the
/// plateau, so a wrong gradient shows at once); the 200 epochs are the
/// CPU's. A CUDA device sums in another order and runs the whole recipe,
/// held to PyTorch's final accuracy.
#[test]
fn the_books_lenet_recipe_learns_the_digits_as_pytorch_does_from_the_same_weights() -> Result<()> {
    let torch: Vec<(f64, f64)> = TORCH_LENET_DIGITS
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let f: Vec<f64> = l.split_whitespace().map(|v| v.parse().expect("a number")).collect();
            (f[1], f[2])
        })
        .collect();
    let epochs = torch.len();
    let final_accuracy = torch[epochs - 1].1;
    assert!(final_accuracy >= 0.85, "the recorded PyTorch run ends at {final_accuracy}");
    let (losses, accs) = books_lenet_recipe(cpu(), epochs)?;
    eprintln!(
        "LeNet recipe on the digits on the CPU: loss {:?} ... {:?}, accuracy {:?} ... {:?}",
        &losses[..2],
        &losses[epochs - 2..],
        &accs[..2],
        &accs[epochs - 2..]
    );
    let acc = accs[epochs - 1];
    assert!((acc - final_accuracy).abs() <= 0.02, "the recipe ends at validation accuracy {acc}, PyTorch at {final_accuracy}");
    for (e, ((loss, acc), (t_loss, t_acc))) in losses.iter().zip(&accs).zip(&torch).enumerate() {
        assert!(
            (loss - t_loss).abs() <= 0.01 + 0.02 * t_loss && (acc - t_acc).abs() <= 0.03,
            "epoch {}: loss {loss} and validation accuracy {acc}, PyTorch {t_loss} and {t_acc}",
            e + 1
        );
    }
    {
        let d = sims()[0];
        let (sim_losses, sim_accs) = books_lenet_recipe(d, SIM_RECIPE_EPOCHS)?;
        for e in 0..SIM_RECIPE_EPOCHS {
            assert!(
                (sim_losses[e] - losses[e]).abs() <= 1e-6 && (sim_accs[e] - accs[e]).abs() <= 1e-6,
                "epoch {}: on {d} loss {} and validation accuracy {}, on the CPU {} and {}",
                e + 1,
                sim_losses[e],
                sim_accs[e],
                losses[e],
                accs[e]
            );
        }
    }
    for d in cuda_devices() {
        let (_, accs) = books_lenet_recipe(d, epochs)?;
        let acc = accs[epochs - 1];
        assert!((acc - final_accuracy).abs() <= 0.02, "on {d} the recipe ends at validation accuracy {acc}, PyTorch at {final_accuracy}");
    }
    Ok(())
}

/// Epochs of the recipe a simulated GPU runs beside the CPU's run.
const SIM_RECIPE_EPOCHS: usize = 20;

/// `load_digits` is scikit-learn's `load_digits()`: its class counts, its
/// pixel total, its last image, and at 28×28 PyTorch's bilinear resize
/// (`F.interpolate(x / 16, size=(28, 28), mode="bilinear")`, in f64).
#[test]
fn the_shipped_digits_are_scikit_learns_and_resize_as_pytorch_does() -> Result<()> {
    use kiln::data::{load_digits, DIGITS_EXAMPLES};
    let (x, y) = load_digits(8, &cpu())?;
    let labels = y.to_vec::<i64>()?;
    let mut counts = [0usize; 10];
    for &l in &labels {
        counts[l as usize] += 1;
    }
    assert_eq!(counts, [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]);
    assert_eq!(labels[DIGITS_EXAMPLES - 5..], [9, 0, 8, 9, 8]);
    let pixels = x.to_vec::<f32>()?;
    assert_eq!(pixels.iter().map(|&p| f64::from(p) * 16.0).sum::<f64>(), 561_718.0);
    let last: Vec<f32> = pixels[(DIGITS_EXAMPLES - 1) * 64..].iter().map(|p| p * 16.0).collect();
    assert_eq!(last[..16], [0., 0., 10., 14., 8., 1., 0., 0., 0., 2., 16., 14., 6., 1., 0., 0.]);
    let (x28, _) = load_digits(28, &cpu())?;
    assert_eq!(x28.dims(), [DIGITS_EXAMPLES, 1, 28, 28]);
    let row = x28.narrow(0, 0, 1)?.flatten_all()?.narrow(0, 10 * 28 + 5, 7)?.to_vec::<f32>()?;
    let torch =
        [0.2633928571428571, 0.4419642857142856, 0.6205357142857142, 0.7991071428571428, 0.676339285714286, 0.453125, 0.22991071428571438];
    common::assert_close(&row, &torch, 1e-6, "digit 0, row 10, columns 5..12 at 28x28");
    let total: f64 = x28.to_vec::<f32>()?.iter().map(|&p| f64::from(p)).sum();
    assert!((total - 430_065.34).abs() < 0.5, "pixel total at 28x28 {total}, PyTorch's 430065.34");
    assert!(load_digits(0, &cpu()).is_err());
    for d in sims().into_iter().take(1).chain(cuda_devices()) {
        let (xd, yd) = load_digits(8, &d)?;
        assert_eq!((xd.device(), yd.device()), (d, d));
    }
    Ok(())
}
