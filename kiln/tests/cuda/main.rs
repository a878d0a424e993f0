//! The CUDA backend, checked as far as the machine allows:
//! - without a driver library: GPUs are only the simulated ones, `try_gpu`
//!   falls back and says why, nothing panics;
//! - with NVRTC (and ptxas): every kernel family compiles for sm_90, exactly
//!   the sources the backend runs (`KILN_REQUIRE_NVRTC=1` makes a missing
//!   NVRTC or ptxas a failure instead of a skip);
//! - with a CUDA device: real operations agree with the CPU, memory is
//!   booked and returned, out-of-memory is an error, transfers are ledgered;
//! - with two: collectives (NCCL or peer copies) name their path, agree
//!   bit for bit across devices, are asynchronous and refused by a guard.
//!
//! This binary never creates simulated GPUs, so that the GPU count seen here
//! is the machine's (plus any `KILN_SIM_GPUS`).

#[path = "../common/mod.rs"]
#[macro_use]
mod common;

mod cnn_fuzz;
mod collectives;
mod defects;
mod dnn;
mod faults;
mod no_gpu;
mod ops;
mod processes;

use cnn_fuzz::*;
use collectives::*;
use defects::*;
use dnn::*;
use faults::*;
use no_gpu::*;
use ops::*;
use processes::*;

use common::{Ran, Skip};
use kiln::{cpu, DType, Device, DeviceKind, Error, FallbackReason, Result, Tensor};
use std::sync::RwLock;

fn main() -> std::process::ExitCode {
    common::run_suite(trials![
        gpu_count_is_cuda_devices_then_simulated_ones,
        two_processes_on_one_cuda_device_each_run_nccl_collectives_and_train_lenet_as_one_process,
        a_rank_that_exits_or_calls_another_collective_is_named_by_the_other_through_nccl,
        a_rank_that_never_starts_is_named_within_the_timeout_through_nccl,
        without_a_driver_try_gpu_falls_back_and_says_why,
        with_a_driver_but_no_device_try_gpu_says_so,
        nvrtc_compiles_every_kernel_family_for_sm90,
        cuda_device_reports_itself,
        cuda_creation_and_random_match_the_cpu,
        cuda_elementwise_ops_match_the_cpu,
        cuda_reductions_match_the_cpu,
        cuda_matmul_matches_the_cpu,
        cuda_copies_casts_and_indexing_match_the_cpu,
        cuda_memory_is_booked_returned_and_bounded,
        cuda_transfers_are_ledgered_and_round_trip,
        cuda_negative_indices_are_reported_like_the_other_devices,
        cuda_integer_argmax_is_exact_above_2_pow_53,
        cuda_full_reductions_over_many_blocks_match_the_cpu,
        cuda_cached_bytes_are_reported_and_empty_cache_returns_them_from_any_thread,
        cuda_empty_cache_waits_for_queued_kernels_that_used_cached_blocks,
        cuda_empty_cache_does_not_free_blocks_reused_while_it_waits,
        cuda_uploads_do_not_wait_for_earlier_work,
        cuda_staging_buffers_are_not_reused_before_their_copy_ran,
        cuda_an_upload_past_the_last_staging_chunk_waits_for_the_oldest_copy,
        no_cuda_device_is_listed_without_nvrtc,
        a_kiln_nvrtc_lib_that_cannot_be_loaded_leaves_no_cuda_device_and_is_named,
        cuda_to_cuda_copies_are_peer_copies_that_do_not_block_the_host,
        cuda_a_driver_out_of_memory_empties_the_cache_and_retries_before_failing,
        cuda_a_lone_pinned_staging_chunk_and_its_event_are_not_leaked,
        cuda_matmul_uses_cublas_again_after_a_failed_cublas_create,
        cuda_convolutions_fall_back_to_direct_kernels_without_cublas_and_say_why,
        cuda_a_convolution_without_room_for_its_workspace_takes_smaller_chunks_or_the_direct_kernels,
        cuda_convolutions_run_in_cudnn_when_it_loads,
        cuda_cudnn_convolutions_from_many_threads_match_the_cpu,
        cuda_convolutions_cudnn_cannot_express_go_through_cublas,
        cuda_a_failing_cudnn_call_is_an_error_naming_it,
        cuda_an_unloadable_kiln_cudnn_lib_is_named_and_convolutions_use_cublas,
        cuda_kiln_disable_cudnn_is_named_and_convolutions_use_cublas,
        cuda_a_failed_cudnn_create_falls_back_and_is_tried_again,
        cuda_cudnn_benchmark_times_each_shape_once,
        cuda_a_cudnn_create_that_keeps_failing_is_given_up,
        cuda_an_algorithm_cudnn_refuses_is_passed_over,
        cuda_a_forced_cudnn_path_reports_a_refusal,
        cuda_optimizer_steps_are_one_launch_per_48_parameters,
        cuda_a_refused_optimizer_launch_fails_the_step_and_poisons_its_parameters,
        cuda_a_step_failing_in_a_later_group_poisons_the_groups_it_stepped,
        cuda_cudnn_without_room_for_a_workspace_takes_another_algorithm_or_path,
        cuda_full_reductions_launch_many_blocks,
        cuda_empty_cache_reports_a_failed_cumemfree,
        cuda_collectives_name_their_path_and_take_it,
        cuda_collective_results_are_bit_identical_on_every_device,
        cuda_a_transfer_guard_refuses_a_collective_before_anything_is_queued,
        cuda_collectives_return_before_they_run,
        cuda_nccl_failures_are_errors_that_queue_nothing,
        cuda_without_libnccl_collectives_say_why_and_still_run,
        cuda_a_kernel_writing_past_its_allocation_is_an_error_naming_it,
        cuda_cnn_ops_fuzzed_match_the_cpu,
    ])
}

fn cuda_devices() -> Vec<Device> {
    kiln::devices().into_iter().filter(|d| d.kind == DeviceKind::Cuda).map(|d| d.device).collect()
}

// ---- on a CUDA device --------------------------------------------------------

/// Tests that measure a device's memory exactly run alone (write lock);
/// the others share the devices (read lock).
static DEVICES: RwLock<()> = RwLock::new(());

/// Runs `f` on every CUDA device, or reports the test skipped (a failure
/// with KILN_REQUIRE_CUDA set).
fn on_cuda(test: &str, f: impl Fn(Device) -> Result<()>) -> Ran {
    let _shared = DEVICES.read().unwrap_or_else(|e| e.into_inner());
    run_on_cuda(test, f)
}

/// Like `on_cuda`, with no other test of this binary using the devices.
fn on_cuda_alone(test: &str, f: impl Fn(Device) -> Result<()>) -> Ran {
    let _alone = DEVICES.write().unwrap_or_else(|e| e.into_inner());
    run_on_cuda(test, f)
}

fn no_cuda_device() -> Skip {
    common::skip_no_cuda(format!(
        "no CUDA device: {}; `scripts/cudasim.sh cargo test -p kiln --test cuda` runs these on the CUDA simulator",
        common::why_no_cuda()
    ))
}

fn run_on_cuda(test: &str, f: impl Fn(Device) -> Result<()>) -> Ran {
    let devs = cuda_devices();
    if devs.is_empty() {
        return Err(no_cuda_device());
    }
    for d in devs {
        if let Err(e) = f(d) {
            panic!("{test} on {d}: {e}");
        }
        common::report_ran(d);
    }
    Ok(())
}

fn same(gpu: &Tensor, host: &Tensor, what: &str) -> Result<()> {
    assert_eq!(gpu.dims(), host.dims(), "{what}: shapes");
    assert_eq!(gpu.dtype(), host.dtype(), "{what}: dtypes");
    let (g, h) = (gpu.to_vec_f64()?, host.to_vec_f64()?);
    for (i, (a, b)) in g.iter().zip(&h).enumerate() {
        assert!(a == b || (a.is_nan() && b.is_nan()), "{what}: element {i} is {a} on the GPU, {b} on the CPU");
    }
    Ok(())
}

fn close(gpu: &Tensor, host: &Tensor, tol: f64, what: &str) -> Result<()> {
    assert_eq!(gpu.dims(), host.dims(), "{what}: shapes");
    let (g, h) = (gpu.to_vec_f64()?, host.to_vec_f64()?);
    for (i, (a, b)) in g.iter().zip(&h).enumerate() {
        let ok = (a - b).abs() <= tol * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
        assert!(ok, "{what}: element {i} is {a} on the GPU, {b} on the CPU (tolerance {tol})");
    }
    Ok(())
}

fn sample(shape: &[usize], salt: u64) -> Result<Tensor> {
    kiln::manual_seed(salt);
    Tensor::randn(shape, &cpu())
}
