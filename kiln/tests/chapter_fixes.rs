//! What a port of the chapter found wrong (issue 10, first list): the
//! Trainer with `LazyLinear`, lazy layers and optimizers across
//! `Module::to`, error hints that compile, ledger call sites at the user's
//! line, and integer literals.

use kiln::data::synthetic_regression;
use kiln::nn::{LazyLinear, Linear, Loss, Module, Sequential};
use kiln::optim::{Adam, Optimizer, OptimizerConfig, Sgd};
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{cpu, thread_transfer_stats, DType, Device, Error, Result, Tensor, TransferStats};

fn sims() -> Vec<Device> {
    kiln::ensure_simulated_gpus(2, 256 << 20)
}

/// The lines of this file at which `diff` booked transfers.
fn lines(diff: &TransferStats) -> Vec<u32> {
    let mut out: Vec<u32> = diff
        .by_site
        .keys()
        .map(|(s, _)| {
            let rest = s.strip_prefix(&format!("{}:", file!())).unwrap_or_else(|| panic!("a transfer booked outside this file: {s}"));
            rest.split(':').next().and_then(|l| l.parse().ok()).unwrap_or_else(|| panic!("no line in {s}"))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[test]
fn trainer_trains_the_chapters_lazy_linear_regression() -> Result<()> {
    // The chapter's model is nn.LazyLinear(1): no parameter before the first
    // forward. fit creates them (one forward of the first batch) before it
    // builds the optimizer, so SGD updates them.
    let mut devices = vec![cpu()];
    devices.extend(sims());
    for device in devices {
        kiln::manual_seed(0);
        let data = synthetic_regression(1000, 1000, 32)?;
        let mut model = Learner::new(LazyLinear::new(1), Loss::Mse, OptimizerConfig::sgd(0.03));
        let mut trainer = Trainer::builder().max_epochs(3).device(device).progress(Progress::Off).build()?;
        let history = trainer.fit(&mut model, &data)?;
        let w = model.net.parameter("weight")?;
        assert_eq!(w.device(), device);
        assert!(history.last().unwrap().train_loss < 0.01, "on {device}: {:?}", history.train_losses());
        let w = w.to_vec::<f32>()?;
        assert!((w[0] - 2.0).abs() < 0.05 && (w[1] + 3.4).abs() < 0.05, "on {device}: w = {w:?}");
    }
    Ok(())
}

#[test]
fn a_lazy_layer_remembers_to_and_creates_its_parameters_there() -> Result<()> {
    let g = sims()[0];
    // net = nn.Sequential(nn.LazyLinear(1)); net = net.to(device=try_gpu())
    let mut net = Sequential::new().add(LazyLinear::new(1));
    net.to(&g)?;
    assert!(net.has_lazy_parameters());
    // An input elsewhere is a device mismatch naming the input, as in PyTorch.
    let err = net.forward(&Tensor::ones((2, 3), DType::F32, &cpu())?).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { lhs: Device::Cpu, rhs, .. } if rhs == g), "{err}");
    assert!(net.has_lazy_parameters(), "a failed forward creates nothing");
    let y = net.forward(&Tensor::ones((2, 3), DType::F32, &g)?)?;
    assert_eq!(y.device(), g);
    assert_eq!(net[0].parameter("weight")?.device(), g);
    assert!(!net.has_lazy_parameters());
    Ok(())
}

#[test]
fn optimizers_built_before_to_follow_the_parameters() -> Result<()> {
    let g = sims()[0];
    for adam in [false, true] {
        let mut net = Linear::new(2, 1, &cpu())?;
        let mut opt: Box<dyn Optimizer> =
            if adam { Box::new(Adam::new(net.parameters(), 0.1)) } else { Box::new(Sgd::new(net.parameters(), 0.1).momentum(0.9)) };
        // One step on the CPU (creates momentum state there), then move.
        net.forward(&Tensor::ones((1, 2), DType::F32, &cpu())?)?.sum_all()?.backward()?;
        opt.step()?;
        let handle = net.weight();
        net.to(&g)?;
        // Identity kept: the old handle names the same parameter.
        assert!(handle.same_parameter(&net.weight()) && handle.latest().device() == g);
        assert!(net.weight().grad().is_some_and(|gr| gr.device() == g), "the gradient moved along");
        opt.zero_grad();
        let before = net.weight().to_vec::<f32>()?;
        net.forward(&Tensor::ones((1, 2), DType::F32, &g)?)?.sum_all()?.backward()?;
        opt.step()?;
        let after = net.weight().to_vec::<f32>()?;
        assert_ne!(before, after, "adam={adam}: the optimizer built before `to` updated the moved parameter");
        assert!(opt.parameters().iter().all(|p| p.device() == g));
    }
    Ok(())
}

#[test]
fn device_hints_are_rust_that_compiles() -> Result<()> {
    let g = sims()[0];
    let a = Tensor::ones((2,), DType::F32, &cpu())?;
    let b = Tensor::ones((2,), DType::F32, &g)?;
    let msg = a.add(&b).unwrap_err().to_string();
    assert!(msg.ends_with("move one operand first, e.g. `rhs.to(&kiln::cpu())?`"), "{msg}");
    let msg = b.add(&a).unwrap_err().to_string();
    assert!(msg.ends_with(&format!("e.g. `rhs.to(&kiln::{g:?})?`").replace("Gpu(", "gpu(")), "{msg}");
    // A forward whose input is elsewhere: the input moves.
    let net = Sequential::new().add(Linear::new(2, 1, &g)?);
    let msg = net.forward(&a).unwrap_err().to_string();
    let Device::Gpu(i) = g else { unreachable!() };
    assert_eq!(
        msg,
        format!(
            "input is on cpu while layer 0 weight is on {g}; kiln never copies silently: move the input first, e.g. `x.to(&kiln::gpu({i}))?`"
        )
    );
    Ok(())
}

#[test]
fn transfers_inside_kiln_are_booked_at_the_users_line() -> Result<()> {
    let g = sims()[0];
    let before = thread_transfer_stats();
    let mut net = Sequential::new().add(Linear::new(2, 1, &cpu())?);
    net.to(&g)?; // line A
    let line_a = line!() - 1;
    let x = Tensor::ones((1, 2), DType::F32, &g)?;
    x.show(); // line B
    let line_b = line!() - 1;
    kiln::println!("{x}"); // line C
    let line_c = line!() - 1;
    // A gradient through `to` crosses devices inside backward.
    let w = Tensor::ones((2,), DType::F32, &cpu())?.requires_grad_();
    let moved = w.to(&g)?; // line D
    let line_d = line!() - 1;
    moved.sum_all()?.backward()?; // line E
    let line_e = line!() - 1;
    let diff = thread_transfer_stats().since(&before);
    assert_eq!(lines(&diff), vec![line_a, line_b, line_c, line_d, line_e], "{}", diff.report(10));

    // The Trainer: model, batches and losses, all at the fit line.
    kiln::manual_seed(0);
    let data = synthetic_regression(64, 0, 32)?;
    let mut model = Learner::new(Linear::new(2, 1, &cpu())?, Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::builder().max_epochs(1).device(g).progress(Progress::Off).build()?;
    let before = thread_transfer_stats();
    trainer.fit(&mut model, &data)?; // line F
    let line_f = line!() - 1;
    assert_eq!(lines(&thread_transfer_stats().since(&before)), vec![line_f]);
    Ok(())
}
#[test]
fn rust_integer_literals_make_i32_tensors() -> Result<()> {
    let x = Tensor::new(&[1, 2, 3], &cpu())?;
    assert_eq!(x.dtype(), DType::I32);
    assert_eq!(x.to_vec::<i32>()?, vec![1, 2, 3]);
    assert_eq!((&x * 2.0)?.to_vec::<i32>()?, vec![2, 4, 6]);
    Ok(())
}
