//! The book's convolutional networks end to end: LeNet learns the synthetic
//! image task on the CPU and on a simulated GPU (and every CUDA device) with
//! the same loss curve; BN-LeNet and ResNet-18 train a step everywhere;
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
    let mut others = vec![sims()[0]];
    others.extend(cuda_devices());
    for d in others {
        let (c, _) = fit(lenet(SYNTHETIC_CLASSES), 3, d)?;
        for (i, (x, y)) in curve.iter().zip(&c).enumerate() {
            assert!((x - y).abs() <= 1e-4, "LeNet epoch {i}: loss {y} on {d}, {x} on the CPU");
        }
        let (c, a) = fit(bn_lenet(SYNTHETIC_CLASSES), 8, d)?;
        assert!(a >= ACCURACY, "BN-LeNet on {d} reached {a}");
        for (i, (x, y)) in bn_curve.iter().zip(&c).enumerate() {
            assert!((x - y).abs() <= 1e-4, "BN-LeNet epoch {i}: loss {y} on {d}, {x} on the CPU");
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
