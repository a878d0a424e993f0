//! LeNet trained data-parallel across processes: one process per device,
//! started by the launcher a cluster has. Each global batch of 256 is cut
//! into one piece per rank, the gradients are summed across the ranks, and
//! every rank takes the same step, so any number of processes trains as one
//! would. Rank 0 prints the curve and the share of time spent in
//! collectives.
//!
//!     cargo build --release -p kiln --features mpi --example dist_lenet
//!     mpirun -np 4 target/release/examples/dist_lenet             # one machine
//!     mpirun -np 8 -H a:4,b:4 target/release/examples/dist_lenet  # two
//!     srun -n 8 target/release/examples/dist_lenet                 # Slurm
//!
//! Started without a launcher it trains alone (a world of one).

use kiln::data::{DataLoader, DataModule};
use kiln::models::{lenet, synthetic_images, SYNTHETIC_CLASSES};
use kiln::nn::Loss;
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let epochs: usize = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(3);
    let group = kiln::dist::init()?;
    // Every rank makes the same data and model; rank 0's parameters are
    // broadcast at the start of the fit anyway.
    kiln::manual_seed(0);
    let (x, y) = synthetic_images(2048, 0, &kiln::cpu())?;
    let train = DataLoader::new(vec![x.narrow(0, 0, 1536)?, y.narrow(0, 0, 1536)?], 256)?.shuffle(true);
    let val = DataLoader::new(vec![x.narrow(0, 1536, 512)?, y.narrow(0, 1536, 512)?], 256)?;
    let data = DataModule { train, val: Some(val) };
    let mut model = Learner::new(lenet(SYNTHETIC_CLASSES), Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
    let mut trainer = Trainer::builder().max_epochs(epochs).progress(Progress::Off).process_group(group.clone()).build()?;
    let history = trainer.fit(&mut model, &data)?;
    if group.is_main() {
        println!("LeNet on {} process(es) ({} engine), rank 0 on {}", group.size(), group.engine(), trainer.device());
        for e in &history.epochs {
            let comm = e.parallel.as_ref().and_then(|p| p.comm_wait_seconds).unwrap_or(0.0);
            println!(
                "epoch {}  train loss {:.4}  val accuracy {:.3}  {:.2} s, {:.0}% in collectives",
                e.epoch + 1,
                e.train_loss,
                e.val_metric.unwrap_or(0.0),
                e.seconds,
                100.0 * comm / e.seconds.max(1e-9)
            );
        }
    }
    Ok(())
}
