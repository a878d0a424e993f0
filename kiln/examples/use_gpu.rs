//! The "GPUs" chapter of Dive into Deep Learning, cell by cell, in Rust.
//!
//! Run it with two simulated GPUs when the machine has none:
//!
//!     KILN_SIM_GPUS=2 cargo run --release -p kiln --example use_gpu

use kiln::{cpu, gpu, num_gpus, try_all_gpus, try_gpu, DType, Tensor};

fn main() -> kiln::Result<()> {
    // Computing devices.
    println!("{} {} {}", cpu(), gpu(0), gpu(1));
    println!("num_gpus() = {}", num_gpus());
    println!("try_gpu() = {}, try_gpu(10) = {}, try_all_gpus() = {:?}", try_gpu(0), try_gpu(10), try_all_gpus());
    if let Some(why) = kiln::why_not_gpu(10) {
        println!("try_gpu(10) fell back to the CPU because {why}");
    }

    // Tensors and GPUs: a tensor is created on the CPU by default.
    let x = Tensor::new(&[1i64, 2, 3], &cpu())?;
    println!("x.device() = {}", x.device());

    // Storage on the GPU.
    let big_x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    println!("X = {big_x}");
    let y = Tensor::rand((2, 3), &try_gpu(1))?;
    println!("Y = {y}");

    // Copying: X + Y mixes devices, which is an error, never a silent copy.
    match &big_x + &y {
        Ok(sum) => println!("X + Y = {sum} (both on {})", sum.device()),
        Err(e) => println!("X + Y fails: {e}"),
    }
    let z = big_x.to(&try_gpu(1))?;
    println!("Z = X.to(gpu(1)) = {z}");
    println!("Y + Z = {}", (&y + &z)?);
    println!("Z.to(gpu(1)) is Z: {}", z.to(&try_gpu(1))?.same_storage(&z));
    println!("Z.copy_to(gpu(1)) is Z: {}", z.copy_to(&try_gpu(1))?.same_storage(&z));

    println!("\n{}", kiln::transfer_stats().report(5));
    Ok(())
}
