//! One conformance suite for every device: the CPU, two simulated GPUs and
//! every CUDA device present. Each test runs the same operations on each
//! device and compares the results with hand-computed values, exactly
//! (float tolerance only for transcendental functions). One file per
//! concern; each test runs on every device through `on_every_device`.

#[path = "../common/mod.rs"]
mod common;

mod autograd;
mod composites;
mod creation;
mod dims;
mod dtypes;
mod elementwise;
mod errors;
mod indexing;
mod matmul;
mod reductions;
mod storage;
mod views;

use kiln::{Device, Result, Tensor};

/// A 2-D f32 tensor from rows.
fn t2(rows: &[&[f32]], d: Device) -> Result<Tensor> {
    let cols = rows.first().map_or(0, |r| r.len());
    Tensor::from_vec(rows.concat(), (rows.len(), cols), &d)
}
