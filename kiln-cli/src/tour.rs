//! `kiln tour`: the "GPUs" chapter of Dive into Deep Learning, in its order,
//! on the devices of this machine. Each step has a title and prints what the
//! chapter prints; where the machine has fewer than two GPUs, the tour adds
//! simulated ones and says so.

use crate::util::Result;
use kiln::{cpu, gpu, human_bytes, num_gpus, try_all_gpus, try_gpu, DType, Tensor};

fn step(n: usize, title: &str) {
    println!();
    println!("== {n}. {title} ==");
}

/// Runs the tour.
pub fn run() -> Result<()> {
    println!("kiln tour: the \"GPUs\" chapter of Dive into Deep Learning, step by step.");

    step(1, "Computing devices");
    println!("cpu() = {}, gpu(0) = {}, gpu(1) = {}   (naming a device never fails)", cpu(), gpu(0), gpu(1));
    println!("{}", crate::devices::render(&kiln::devices()));
    let gpus = num_gpus();
    println!("num_gpus() = {gpus}");

    step(2, "Falling back to the CPU: try_gpu and try_all_gpus");
    println!("try_gpu(0) = {}, try_gpu(10) = {}, try_all_gpus() = {:?}", try_gpu(0), try_gpu(10), try_all_gpus());
    if let Some(why) = kiln::why_not_gpu(10) {
        println!("try_gpu(10) fell back to the CPU because {why}");
    }

    step(3, "Tensors and GPUs: every tensor has a device");
    let x = Tensor::new(&[1i64, 2, 3], &cpu())?;
    println!("x = {x}");
    println!("x.device() = {}", x.device());

    step(4, "Storage on the GPU");
    if gpus < 2 {
        let sims = kiln::ensure_simulated_gpus(2 - gpus + count_sims(), kiln::DEFAULT_SIM_GPU_MEMORY);
        // Only the GPUs added now: with KILN_SIM_GPUS=1 that is gpu(1) alone.
        let added: Vec<String> = sims.iter().filter(|d| matches!(d, kiln::Device::Gpu(i) if *i >= gpus)).map(|d| d.to_string()).collect();
        let what =
            if added.len() == 1 { format!("a simulated GPU ({})", added[0]) } else { format!("simulated GPUs ({})", added.join(", ")) };
        println!(
            "This machine has {gpus} GPU(s); the tour adds {what} with kiln::ensure_simulated_gpus(2, ...), \
             so that X can live on gpu(0) and Y on gpu(1). Each has its own memory and its own queue."
        );
        println!("num_gpus() = {}", num_gpus());
    }
    let big_x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    println!("X = Tensor::ones((2, 3), F32, &try_gpu(0))?");
    println!("X = {big_x}");
    println!("{}", kiln::memory_stats(&gpu(0))?);
    let y = Tensor::rand((2, 3), &try_gpu(1))?;
    println!("Y = Tensor::rand((2, 3), &try_gpu(1))?");
    println!("Y = {y}");

    step(5, "Copying: X + Y mixes devices");
    println!("&X + &Y =");
    match &big_x + &y {
        Ok(sum) => println!("  {sum}"),
        Err(e) => println!("  Error: {e}"),
    }
    let z = big_x.to(&gpu(1))?;
    println!("Z = X.to(&gpu(1))?");
    println!("X = {big_x}");
    println!("Z = {z}");
    println!("Y + Z = {}", (&y + &z)?);

    step(6, "`to` shares storage when already there, `copy_to` always allocates");
    let before = kiln::memory_stats(&gpu(1))?.in_use;
    let same = z.to(&gpu(1))?;
    println!("Z.to(&gpu(1))?.same_storage(&Z) = {}   (the chapter's `Z.cuda(1) is Z`)", same.same_storage(&z));
    let mid = kiln::memory_stats(&gpu(1))?.in_use;
    let copy = z.copy_to(&gpu(1))?;
    copy.block_until_ready()?;
    println!("Z.copy_to(&gpu(1))?.same_storage(&Z) = {}   (MXNet's `copyto`)", copy.same_storage(&z));
    let after = kiln::memory_stats(&gpu(1))?.in_use;
    println!(
        "gpu(1) memory in use: {} before, {} after `to` (+{}), {} after `copy_to` (+{})",
        human_bytes(before),
        human_bytes(mid),
        human_bytes(mid - before),
        human_bytes(after),
        human_bytes(after.saturating_sub(mid))
    );
    drop((same, copy));

    step(7, "Asynchronous execution");
    let a = Tensor::rand((512, 512), &gpu(0))?;
    let start = std::time::Instant::now();
    let c = a.matmul(&a)?;
    let enqueued = start.elapsed();
    c.block_until_ready()?;
    let done = start.elapsed();
    println!(
        "a.matmul(&a) on gpu(0) returned after {:.1} us; c.block_until_ready() after {:.1} us: operations are queued, \
         reads and block_until_ready wait for them",
        enqueued.as_secs_f64() * 1e6,
        done.as_secs_f64() * 1e6
    );
    drop((a, c));

    crate::train::tour_network(8, &big_x, step)?;

    step(10, "The transfer ledger: every copy this tour made");
    print!("{}", kiln::transfer_stats().report(5));
    Ok(())
}

fn count_sims() -> usize {
    kiln::devices().iter().filter(|d| d.kind == kiln::DeviceKind::Simulated).count()
}
