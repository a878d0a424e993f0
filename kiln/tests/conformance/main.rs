//! One conformance suite for every device: the CPU, two simulated GPUs and
//! every CUDA device present. Each test runs the same operations on each
//! device and compares the results with hand-computed values, exactly
//! (float tolerance only for transcendental functions). One file per
//! concern; a test runs on every device through `on_every_device`, except
//! the few about what only one device kind does (the CPU's refusals of bad
//! indices, a host thread racing another, a simulated GPU's fault).

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

/// f32 values compared bit for bit (so NaN equals NaN).
#[track_caller]
pub(crate) fn same_f32_bits(t: &Tensor, expected: &[f32]) {
    // NaN's sign is not specified (0/0 is −NaN on x86): compare NaN as NaN.
    let bits = |x: &f32| if x.is_nan() { u32::MAX } else { x.to_bits() };
    let got: Vec<u32> = t.to_vec::<f32>().unwrap().iter().map(bits).collect();
    let want: Vec<u32> = expected.iter().map(bits).collect();
    assert_eq!(got, want, "got {:?}, expected {expected:?} on {}", t.to_vec::<f32>().unwrap(), t.device());
}
