//! kiln's all-reduce across processes (`Group::all_reduce` on CPU f32
//! tensors, through the MPI engine) beside raw `MPI_Allreduce` on the same
//! number of bytes (rsmpi, `Vec<f32>` buffers), for 1 MiB to 256 MiB.
//! Each run measures one side; `scripts/dist-bench.sh` interleaves runs of
//! both and reports the medians and their ratio.
//!
//!     cargo build --release -p kiln --features mpi --example dist_allreduce_bench
//!     mpirun -np 2 target/release/examples/dist_allreduce_bench kiln
//!     mpirun -np 2 target/release/examples/dist_allreduce_bench raw
//!
//! Rank 0 prints `side bytes seconds` for each size: the median of the
//! iterations' times, each iteration ended by the slowest rank (a barrier).

use kiln::comm::ReduceOp;
use kiln::Tensor;
use mpi::collective::SystemOperation;
use mpi::traits::*;
use std::time::Instant;

const SIZES: [usize; 5] = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20];

fn iters(bytes: usize) -> usize {
    if bytes >= 64 << 20 {
        5
    } else {
        15
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let side = std::env::args().nth(1).unwrap_or_else(|| "kiln".into());
    match side.as_str() {
        "raw" => {
            let universe = mpi::initialize().ok_or("MPI was initialised already")?;
            let world = universe.world();
            for bytes in SIZES {
                let n = bytes / 4;
                let send = vec![1f32; n];
                let mut recv = vec![0f32; n];
                let mut times = Vec::new();
                for i in 0..iters(bytes) + 2 {
                    world.barrier();
                    let t = Instant::now();
                    world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
                    world.barrier();
                    if i >= 2 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                assert_eq!(recv[n - 1], world.size() as f32);
                if world.rank() == 0 {
                    println!("raw {bytes} {:.6}", median(times));
                }
            }
        }
        _ => {
            let group = kiln::dist::init()?;
            for bytes in SIZES {
                let n = bytes / 4;
                let x = Tensor::ones(n, kiln::DType::F32, &kiln::cpu())?;
                let mut times = Vec::new();
                let mut last = None;
                for i in 0..iters(bytes) + 2 {
                    group.barrier()?;
                    let t = Instant::now();
                    let sum = group.all_reduce(&x, ReduceOp::Sum)?;
                    group.barrier()?;
                    if i >= 2 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                    last = Some(sum);
                }
                if let Some(sum) = last {
                    assert_eq!(sum.narrow(0, n - 1, 1)?.to_vec::<f32>()?[0], group.size() as f32);
                }
                if group.is_main() {
                    println!("kiln {bytes} {:.6}", median(times));
                }
                // In place (PyTorch's `dist.all_reduce(t)`): the sum is made
                // in the tensor's own memory. Ones summed repeatedly grow
                // by the size each time (exact for 2 and 4 ranks).
                let mut times = Vec::new();
                let rounds = iters(bytes) + 2;
                for i in 0..rounds {
                    group.barrier()?;
                    let t = Instant::now();
                    group.all_reduce_(&x, ReduceOp::Sum)?;
                    group.barrier()?;
                    if i >= 2 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                let want = (group.size() as f64).powi(rounds as i32);
                let got = x.narrow(0, n - 1, 1)?.to_vec::<f32>()?[0] as f64;
                assert!((got - want).abs() <= 1e-5 * want, "{got} after {rounds} in-place sums, want {want}");
                if group.is_main() {
                    println!("kiln_ {bytes} {:.6}", median(times));
                }
            }
        }
    }
    Ok(())
}
