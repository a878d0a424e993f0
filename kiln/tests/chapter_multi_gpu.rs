//! The book's sequel sections, cell by cell, on two simulated GPUs:
//! "Multiple GPUs" (LeNet from scratch with parameters on each device, the
//! hand-written allreduce, split_batch, train_batch) and "Concise
//! Implementation for Multiple GPUs" (ResNet-18 behind DataParallel). The
//! Fashion-MNIST batches are the seeded synthetic images of the same shape
//! (nothing can be downloaded here).

use kiln::comm;
use kiln::nn::{DataParallel, Module};
use kiln::optim::{Optimizer, Sgd};
use kiln::{Conv2dArgs, DType, Device, Pool2dArgs, Result, Tensor};

fn devices() -> Vec<Device> {
    kiln::ensure_simulated_gpus(2, 512 << 20)
}

/// `params = [W1, b1, W2, b2, W3, b3, W4, b4]`, scale 0.01.
fn init_params() -> Result<Vec<Tensor>> {
    let cpu = kiln::cpu();
    let scale = 0.01;
    Ok(vec![
        Tensor::randn((20, 1, 3, 3), &cpu)?.mul_scalar(scale)?,
        Tensor::zeros(20, DType::F32, &cpu)?,
        Tensor::randn((50, 20, 5, 5), &cpu)?.mul_scalar(scale)?,
        Tensor::zeros(50, DType::F32, &cpu)?,
        Tensor::randn((800, 128), &cpu)?.mul_scalar(scale)?,
        Tensor::zeros(128, DType::F32, &cpu)?,
        Tensor::randn((128, 10), &cpu)?.mul_scalar(scale)?,
        Tensor::zeros(10, DType::F32, &cpu)?,
    ])
}

/// The book's `lenet(X, params)`.
fn lenet(x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
    let pool = Pool2dArgs::new(2).stride(2);
    let h1 = x.conv2d(&p[0], Some(&p[1]), Conv2dArgs::default())?.relu()?.avg_pool2d(pool)?;
    let h2 = h1.conv2d(&p[2], Some(&p[3]), Conv2dArgs::default())?.relu()?.avg_pool2d(pool)?;
    let h2 = h2.reshape((h2.dims()[0], h2.elem_count() / h2.dims()[0]))?;
    let h3 = h2.matmul(&p[4])?.add(&p[5])?.relu()?;
    h3.matmul(&p[6])?.add(&p[7])
}

/// `get_params(params, device)`: copies on the device that require grad.
fn get_params(params: &[Tensor], device: &Device) -> Result<Vec<Tensor>> {
    params.iter().map(|p| Ok(p.to(device)?.detach().requires_grad_())).collect()
}

/// `d2l.sgd(params, lr, batch_size)`.
fn sgd(params: &[Tensor], lr: f64, batch_size: usize) -> Result<()> {
    let _g = kiln::no_grad();
    for p in params {
        let g = p.grad().expect("a gradient");
        p.assign(&p.sub(&g.mul_scalar(lr / batch_size as f64)?)?)?;
        p.zero_grad();
    }
    Ok(())
}

/// `train_batch(X, y, device_params, devices, lr)`.
fn train_batch(x: &Tensor, y: &Tensor, device_params: &[Vec<Tensor>], devices: &[Device], lr: f64) -> Result<()> {
    let (x_shards, y_shards) = comm::split_batch(x, y, devices)?;
    let mut ls = Vec::new();
    for ((xs, ys), w) in x_shards.iter().zip(&y_shards).zip(device_params) {
        // loss(reduction='none').sum()
        ls.push(kiln::nn::cross_entropy(&lenet(xs, w)?, ys)?.mul_scalar(xs.dims()[0] as f64)?);
    }
    for l in &ls {
        l.backward()?;
    }
    {
        let _g = kiln::no_grad();
        for i in 0..device_params[0].len() {
            let grads: Vec<Tensor> = device_params.iter().map(|p| p[i].grad().expect("a gradient")).collect();
            comm::allreduce(&grads)?;
        }
    }
    for p in device_params {
        sgd(p, lr, x.dims()[0])?;
    }
    Ok(())
}

#[test]
fn multiple_gpus_from_scratch() -> Result<()> {
    let devices = devices();
    kiln::manual_seed(0);
    let params = init_params()?;
    let new_params = get_params(&params, &devices[0])?;
    assert_eq!(new_params[1].to_vec::<f32>()?, vec![0.; 20]); // print('b1 weight:', ...)
    assert!(new_params[1].grad().is_none()); // print('b1 grad:', ...)

    // allreduce on [1, 1] and [2, 2]: both become [3, 3].
    let data: Vec<Tensor> =
        (0..2).map(|i| Tensor::ones((1, 2), DType::F32, &devices[i])?.mul_scalar((i + 1) as f64)).collect::<Result<_>>()?;
    assert_eq!((data[0].to_vec::<f32>()?, data[1].to_vec::<f32>()?), (vec![1., 1.], vec![2., 2.]));
    comm::allreduce(&data)?;
    assert_eq!((data[0].to_vec::<f32>()?, data[1].to_vec::<f32>()?), (vec![3., 3.], vec![3., 3.]));

    // nn.parallel.scatter(torch.arange(20).reshape(4, 5), devices).
    let data = Tensor::arange(0., 20., 1., &kiln::cpu())?.reshape((4, 5))?;
    let split = comm::scatter(&data, &devices, None)?;
    assert_eq!((split[0].device(), split[1].device()), (devices[0], devices[1]));
    assert_eq!(split[1].to_vec2::<f32>()?, vec![vec![10., 11., 12., 13., 14.], vec![15., 16., 17., 18., 19.]]);

    // train(num_gpus=2): two batches of the synthetic Fashion-MNIST task.
    let task = kiln::models::synthetic_image_task(64, 32, 32, 1)?;
    let device_params: Vec<Vec<Tensor>> = devices.iter().map(|d| get_params(&params, d)).collect::<Result<_>>()?;
    for batch in task.train.iter()? {
        let batch = batch?;
        train_batch(&batch[0], &batch[1], &device_params, &devices, 0.2)?;
        kiln::synchronize(&devices[0])?;
    }
    // The replicas stay equal, and evaluate on the first device.
    for (a, b) in device_params[0].iter().zip(&device_params[1]) {
        assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
    }
    let val = task.val.as_ref().unwrap();
    for batch in val.iter_on(&devices[0])? {
        let batch = batch?;
        let acc = kiln::nn::accuracy(&lenet(&batch[0], &device_params[0])?, &batch[1])?.to_scalar::<f32>()?;
        assert!((0.0..=1.0).contains(&acc));
    }
    Ok(())
}

#[test]
fn concise_multiple_gpus_resnet18_with_data_parallel() -> Result<()> {
    let devices = devices();
    kiln::manual_seed(0);
    let task = kiln::models::synthetic_image_task(16, 8, 8, 2)?;
    let mut net = kiln::models::resnet18(10);
    // The lazy layers are made by one forward, then init_weights(std=0.01).
    let x0 = task.train.tensors()[0].narrow(0, 0, 2)?;
    {
        let _g = kiln::no_grad();
        net.eval();
        net.forward(&x0)?;
        net.train();
    }
    for (name, p) in net.named_parameters() {
        if name.ends_with("weight") && p.rank() >= 2 {
            kiln::nn::init::normal_(&p, 0.0, 0.01)?;
        }
    }
    let net = DataParallel::new(net, &devices)?;
    let mut trainer = Sgd::new(net.parameters(), 0.1);
    for batch in task.train.iter()? {
        let batch = batch?;
        trainer.zero_grad();
        let (x, y) = (batch[0].to(&devices[0])?, batch[1].to(&devices[0])?);
        let l = kiln::nn::cross_entropy(&net.forward(&x)?, &y)?;
        l.backward()?;
        trainer.step()?;
        assert!(l.to_scalar::<f32>()?.is_finite());
    }
    assert!(net.parameters().iter().all(|p| p.device() == devices[0]));
    Ok(())
}
