//! Every code cell of the chapter's five versions (../shared/seeds), as the
//! machine running the test has them: with no GPU (`cargo test`), one
//! (`KILN_SIM_GPUS=1`) or two (`KILN_SIM_GPUS=2`). Nothing here adds GPUs:
//! each cell asserts what the chapter states for the GPUs that exist.

use kiln::data::synthetic_regression;
use kiln::nn::{LazyLinear, Loss, Module, ParamVisitor, Sequential};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{cpu, gpu, num_gpus, try_all_gpus, try_gpu, DType, Device, Error, Result, Tensor};

#[test]
fn devices_and_try_gpu() {
    // cpu(), gpu(0), gpu(1) name devices; naming never fails.
    assert_eq!((cpu().to_string(), gpu(0).to_string(), gpu(1).to_string()), ("cpu".into(), "gpu(0)".into(), "gpu(1)".into()));
    let n = num_gpus();
    // try_gpu(i) is gpu(i) if it exists, else the CPU; try_all_gpus() is every GPU or [cpu].
    assert_eq!(try_gpu(0), if n >= 1 { gpu(0) } else { cpu() });
    assert_eq!(try_gpu(10), cpu());
    let all = try_all_gpus();
    assert_eq!(all, if n == 0 { vec![cpu()] } else { (0..n).map(Device::Gpu).collect() });
}

#[test]
fn tensors_live_where_created_and_mixing_devices_is_an_error() -> Result<()> {
    // x = torch.tensor([1, 2, 3]); x.device -> cpu
    let x = Tensor::new(&[1, 2, 3], &cpu())?;
    assert_eq!((x.device(), x.dtype()), (cpu(), DType::I32));
    // X = torch.ones(2, 3, device=try_gpu()); Y = torch.rand(2, 3, device=try_gpu(1))
    let big_x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    let y = Tensor::rand((2, 3), &try_gpu(1))?;
    assert_eq!((big_x.device(), y.device()), (try_gpu(0), try_gpu(1)));
    // X + Y: with one GPU or two, the devices differ (gpu(0) and cpu, or
    // gpu(0) and gpu(1)): an error, never a silent copy. With none, it computes.
    match (&big_x + &y, try_gpu(0) != try_gpu(1)) {
        (Err(Error::DeviceMismatch { lhs, rhs, .. }), true) => assert_eq!((lhs, rhs), (try_gpu(0), try_gpu(1))),
        (Ok(sum), false) => assert_eq!(sum.device(), cpu()),
        (other, differ) => panic!("devices differ = {differ}: {other:?}"),
    }
    // Z = X.cuda(1); Y + Z; Z.cuda(1) is Z
    let z = big_x.to(&try_gpu(1))?;
    assert_eq!((&y + &z)?.device(), try_gpu(1));
    assert!(z.to(&try_gpu(1))?.same_storage(&z));
    Ok(())
}

#[test]
fn mxnet_copyto_always_copies_and_as_in_context_does_not() -> Result<()> {
    // y = x.copyto(mx.gpu()); z = x.as_in_context(mx.gpu()); z.as_in_context(mx.gpu()) is z
    let x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    let copied = x.copy_to(&try_gpu(0))?;
    assert!(!copied.same_storage(&x));
    assert!(x.to(&try_gpu(0))?.same_storage(&x));
    assert_eq!(copied.to_vec::<f32>()?, vec![1.0; 6]);
    Ok(())
}

#[test]
fn tensorflow_device_scope_and_jax_device_put() -> Result<()> {
    // with tf.device('/GPU:0'): X = tf.ones((2, 3))
    {
        let _scope = kiln::default_device_scope(try_gpu(0))?;
        assert_eq!(Tensor::new_default(&[1f32, 2.])?.device(), try_gpu(0));
    }
    assert_eq!(kiln::default_device(), cpu());
    // jax.device_put(x, try_gpu(1)); lazy execution: the result is returned at
    // once and block_until_ready waits for it.
    let x = Tensor::rand((64, 64), &cpu())?;
    let on = x.to(&try_gpu(num_gpus().saturating_sub(1)))?;
    let y = on.matmul(&on)?;
    y.block_until_ready()?;
    kiln::synchronize(&y.device())?;
    assert_eq!(y.dims(), &[64, 64]);
    Ok(())
}

/// The chapter's set_scratch_params_device: plain tensors as parameters.
struct Scratch {
    w: Tensor,
    b: Tensor,
}

impl Module for Scratch {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.w)?.add(&self.b)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("w".into(), self.w.clone()), ("b".into(), self.b.clone())]
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("w", &mut self.w)?;
        f("b", &mut self.b)
    }
}

#[test]
fn neural_networks_on_the_gpu_and_scratch_params() -> Result<()> {
    // net = nn.Sequential(nn.LazyLinear(1)); net = net.to(device=try_gpu()); net(X)
    let mut net = Sequential::new().add(LazyLinear::new(1));
    net.to(&try_gpu(0))?;
    let x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    assert_eq!(net.forward(&x)?.device(), try_gpu(0));
    // net[0].weight.data.device
    assert_eq!(net[0].parameter("weight")?.device(), try_gpu(0));
    // set_scratch_params_device
    let mut m = Scratch { w: Tensor::randn((2, 1), &cpu())?.requires_grad_(), b: Tensor::zeros(1, DType::F32, &cpu())?.requires_grad_() };
    m.to(&try_gpu(0))?;
    assert!(m.w.device() == try_gpu(0) && m.b.device() == try_gpu(0) && m.w.requires_grad());
    Ok(())
}

#[test]
fn trainer_with_num_gpus_trains_the_lazy_linear_regression() -> Result<()> {
    // model = d2l.LinearRegression(lr=0.03); trainer = d2l.Trainer(max_epochs=3, num_gpus=1)
    kiln::manual_seed(0);
    let data = synthetic_regression(1000, 1000, 32)?;
    let mut model = Learner::new(LazyLinear::new(1), Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::new(3, 1, 0.0).progress(Progress::Off);
    let history = trainer.fit(&mut model, &data)?;
    assert_eq!(history.device, try_gpu(0));
    assert_eq!(model.net.parameter("weight")?.device(), try_gpu(0));
    assert!(history.last().unwrap().val_loss.unwrap() < 0.01, "{history:?}");
    Ok(())
}
