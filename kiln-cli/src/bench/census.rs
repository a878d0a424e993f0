//! `kiln bench --census`: the launch census of one training step of LeNet
//! (28×28, batch 8) and of ResNet-18 (96×96, batch 2) on a CUDA device of
//! the CUDA simulator with `KILN_CUDASIM_CENSUS=1`: every kernel launched,
//! its threads and the serial work of its busiest thread, and the
//! multiply-adds that ran inside cuBLAS (see `kiln::take_launch_census`).

use crate::util::Result;
use kiln::models::{lenet, resnet18, synthetic_images};
use kiln::nn::{Loss, Module, Sequential};
use kiln::optim::{Optimizer, Sgd};
use kiln::Device;

/// One SGD step of `net` on `batch` images of `size`², after a first step
/// that loads the modules; the census of the second.
fn step_census(mut net: Sequential, batch: usize, size: usize, d: Device) -> kiln::Result<Vec<kiln::LaunchRecord>> {
    let (x, y) = synthetic_images(batch, 3, &d)?;
    let x = if size == 28 { x } else { x.interpolate([size, size], kiln::InterpMode::Nearest)? }.contiguous()?;
    net.init_lazy(&x.to(&kiln::cpu())?)?;
    net.to(&d)?;
    let mut opt = Sgd::new(net.parameters(), 0.01);
    let mut step = || -> kiln::Result<()> {
        opt.zero_grad();
        Loss::CrossEntropy.compute(&net.forward(&x)?, &y)?.backward()?;
        opt.step()
    };
    step()?;
    kiln::take_launch_census()?;
    step()?;
    kiln::take_launch_census()
}

/// Prints the census tables on `device` (a CUDA device of the simulator).
pub fn run(device: Device) -> Result<()> {
    let info = kiln::devices().into_iter().find(|i| i.device == device);
    if info.as_ref().map(|i| i.kind) != Some(kiln::DeviceKind::Cuda) {
        return Err(crate::fail!(
            "--census runs on a CUDA device of the CUDA simulator: `KILN_CUDASIM_CENSUS=1 KILN_CUDASIM_SMS=132 scripts/cudasim.sh kiln bench --census --device gpu:0` ({device} is not a CUDA device)"
        ));
    }
    for (what, net, batch, size) in [("LeNet, 28×28, batch 8", lenet(10), 8, 28), ("ResNet-18, 96×96, batch 2", resnet18(10), 2, 96)] {
        let records = step_census(net, batch, size, device)?;
        println!("== launch census of one training step: {what}, on {device}");
        println!("{}", kiln::census_table(&records));
    }
    Ok(())
}
