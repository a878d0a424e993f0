//! `kiln train`, and the tour's network and Trainer steps.

use crate::util::Result;
use kiln::Tensor;

/// Options of `kiln train`.
#[derive(clap::Args, Debug)]
pub struct TrainArgs {}

/// Runs `kiln train`.
pub fn run(_args: TrainArgs) -> Result<()> {
    Err(crate::fail!("`kiln train` needs kiln::nn, which is not built yet"))
}

/// The tour's steps on networks: a network on a device, and a short Trainer run.
pub fn tour_network(first: usize, _x: &Tensor, step: fn(usize, &str)) -> Result<()> {
    step(first, "Neural networks and GPUs");
    println!("(kiln::nn is not built yet)");
    Ok(())
}
