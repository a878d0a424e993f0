//! Training across processes: this binary runs itself under `mpirun`
//! (`KILN_TEST_DIST_SCENARIO` names what each rank does) and checks what
//! the ranks computed and said:
//! - every collective of a group gives the values one can work out by hand,
//!   on 2 and 4 ranks, on the CPU and on simulated GPUs, in place and not;
//! - seeded random calls (every collective, dtype and reduction, shapes of
//!   zero elements, offset, transposed and broadcast views) on 3 ranks
//!   match the reference each rank computes from every rank's inputs;
//! - LeNet trained by 2 and 4 processes gives one process's parameters (one
//!   step) and loss curve (3 epochs), on the CPU and on simulated GPUs;
//! - a checkpoint written by rank 0 of 2 resumes in a world of one;
//! - two ranks that call different collectives get an error naming both
//!   calls; a rank that hangs is named by the others' watchdog within the
//!   timeout, and the job ends; a killed rank ends the job;
//! - under the CUDA simulator with a CUDA device per rank, the NCCL engine
//!   (its id broadcast over MPI) gives the same values and curve;
//! - an in-process group (one thread per simulated GPU) gives the same
//!   values, passes the same fuzzer, trains LeNet as one process does, and
//!   names a mismatched call, a silent rank and a rank whose thread ended.
//!
//! The runs under `mpirun` need the `mpi` feature and Open MPI
//! (`cargo test -p kiln --features mpi --test dist`); otherwise each of them
//! reports itself ignored with the reason. The in-process ones run always.

#[path = "common/mod.rs"]
#[macro_use]
mod common;

use common::{Ran, Skip};
use kiln::comm::ReduceOp;
use kiln::data::{DataLoader, DataModule};
use kiln::nn::{Loss, Module};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{cpu, dist, DType, Result, Tensor};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    if let Ok(scenario) = std::env::var("KILN_TEST_DIST_SCENARIO") {
        return worker(&scenario);
    }
    common::run_suite(trials![
        collectives_on_two_ranks,
        collectives_on_four_ranks,
        random_calls_on_three_ranks_match_a_reference,
        one_step_on_two_processes_gives_one_process_parameters,
        lenet_on_two_and_four_processes_follows_one_process_curve,
        lenet_on_simulated_gpus_in_two_processes_follows_one_process_curve,
        lenet_in_many_buckets_with_a_rank_without_rows_follows_one_process_curve,
        a_checkpoint_of_two_ranks_resumes_in_a_world_of_one,
        ranks_calling_different_collectives_get_an_error_naming_both,
        a_hung_rank_is_named_by_the_others_within_the_timeout,
        a_killed_rank_ends_the_job,
        started_calls_in_a_world_of_one,
        collectives_and_lenet_through_nccl_bootstrapped_over_mpi,
        collectives_of_threads_give_the_values_of_processes,
        collectives_of_threads_through_nccl_within_one_process,
        random_calls_on_three_threads_match_a_reference,
        lenet_on_threads_follows_one_process,
        threads_calling_different_collectives_get_an_error_naming_both,
        a_silent_thread_is_named_by_the_others_within_the_timeout,
        a_thread_that_ends_is_named_by_the_others_at_once,
    ])
}

// ---------------------------------------------------------------- driver

struct Run {
    ok: bool,
    output: String,
    seconds: f64,
}

fn mpirun_path() -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join("mpirun")).find(|p| p.is_file())
}

/// Runs this binary on `np` ranks under mpirun with `scenario`, killing it
/// after `limit` (a hang is a failure).
fn mpirun(np: usize, scenario: &str, env: &[(&str, String)], limit: Duration) -> std::result::Result<Run, Skip> {
    let skip = |why: &str| {
        // CI sets KILN_REQUIRE_MPI=1: there a missing piece is a failure.
        if std::env::var_os("KILN_REQUIRE_MPI").is_some() {
            panic!("KILN_REQUIRE_MPI is set but {why}");
        }
        common::skip(why)
    };
    if !cfg!(feature = "mpi") {
        return Err(skip("built without the `mpi` feature: run `cargo test -p kiln --features mpi --test dist`"));
    }
    let Some(mpirun) = mpirun_path() else {
        return Err(skip("no `mpirun` on PATH: install Open MPI (Debian: openmpi-bin libopenmpi-dev)"));
    };
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(mpirun);
    cmd.args(["--oversubscribe", "-np", &np.to_string()])
        .arg(exe)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("KILN_TEST_DIST_SCENARIO", scenario)
        .env_remove("KILN_SIM_GPUS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = cmd.spawn().expect("mpirun starts");
    let out_pipe = child.stdout.take().expect("stdout");
    let err_pipe = child.stderr.take().expect("stderr");
    let read = |mut p: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = p.read_to_string(&mut s);
            s
        })
    };
    let (out_t, err_t) = (read(Box::new(out_pipe)), read(Box::new(err_pipe)));
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for mpirun") {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let output = out_t.join().unwrap_or_default() + &err_t.join().unwrap_or_default();
            panic!("mpirun -np {np} ({scenario}) hung past {limit:?}; its output:\n{output}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = out_t.join().unwrap_or_default() + &err_t.join().unwrap_or_default();
    Ok(Run { ok: status.success(), output, seconds: start.elapsed().as_secs_f64() })
}

/// A fresh folder of this test's own: tests run in parallel, so each call
/// gets another name.
fn temp_dir(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kiln-dist-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn collectives(np: usize) -> Ran {
    let run = mpirun(np, "collectives", &[], Duration::from_secs(240))?;
    assert!(run.ok, "{}", run.output);
    for r in 0..np {
        assert!(run.output.contains(&format!("rank {r} of {np}: collectives ok")), "{}", run.output);
    }
    Ok(())
}

/// The `*_async` calls in a world of one (no launcher needed): the same
/// checks as on several ranks, on the CPU and on a simulated GPU.
fn started_calls_in_a_world_of_one() -> Ran {
    for device in [cpu(), kiln::ensure_simulated_gpus(1, 64 << 20)[0]] {
        let g = dist::Group::single(device);
        started(&g, &device).unwrap_or_else(|e| panic!("on {device}: {e}"));
        let stats = g.stats();
        assert_eq!(stats.calls, 8, "{stats:?}");
    }
    Ok(())
}

fn collectives_on_two_ranks() -> Ran {
    collectives(2)
}

fn collectives_on_four_ranks() -> Ran {
    collectives(4)
}

/// Seeded random calls on 3 ranks (an odd size: means that do not divide
/// evenly), each checked on every rank against the reference it computes
/// from every rank's inputs. `KILN_DIST_FUZZ_SEED` and
/// `KILN_DIST_FUZZ_CASES` (default 1 and 150) choose the cases.
fn random_calls_on_three_ranks_match_a_reference() -> Ran {
    let seed = std::env::var("KILN_DIST_FUZZ_SEED").unwrap_or_else(|_| "1".into());
    let cases = std::env::var("KILN_DIST_FUZZ_CASES").unwrap_or_else(|_| "150".into());
    let run = mpirun(3, "fuzz", &[("KILN_DIST_FUZZ_SEED", seed), ("KILN_DIST_FUZZ_CASES", cases)], Duration::from_secs(300))?;
    assert!(run.ok, "{}", run.output);
    for r in 0..3 {
        assert!(run.output.contains(&format!("rank {r} of 3: fuzz ok")), "{}", run.output);
    }
    Ok(())
}

/// (losses per epoch, parameters) of a training written by rank 0.
fn read_result(path: &Path) -> (Vec<f64>, Vec<f64>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let parse = |l: Option<&str>| -> Vec<f64> { l.unwrap_or("").split_whitespace().map(|v| v.parse().expect("a number")).collect() };
    (parse(lines.next()), parse(lines.next()))
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().chain(b).fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / scale).fold(0.0, f64::max)
}

fn compare_training(np: usize, setup: Setup, extra: &[(&str, String)], loss_tol: f64, param_tol: f64) -> Ran {
    let dir = temp_dir(&format!("train{np}"));
    let out = dir.join("result.txt");
    let mut env = vec![("KILN_TEST_DIST_OUT", out.display().to_string()), ("KILN_TEST_DIST_SETUP", setup.name().to_string())];
    env.extend(extra.iter().cloned());
    let run = mpirun(np, "train", &env, Duration::from_secs(600))?;
    assert!(run.ok, "{}", run.output);
    let (losses, params) = read_result(&out);
    let (one_losses, one_params) = train(setup, None).expect("one process trains");
    let (dl, dp) = (max_rel(&losses, &one_losses), max_rel(&params, &one_params));
    println!(
        "{np} ranks, {}: losses {losses:?} (one process {one_losses:?}); max relative difference: losses {dl:.2e}, parameters {dp:.2e}; {:.1} s",
        setup.name(),
        run.seconds
    );
    assert!(dl <= loss_tol, "losses differ by {dl:e} (bound {loss_tol:e}): {losses:?} against {one_losses:?}");
    assert!(dp <= param_tol, "parameters differ by {dp:e} (bound {param_tol:e})");
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

fn one_step_on_two_processes_gives_one_process_parameters() -> Ran {
    compare_training(2, Setup::OneStep, &[], 1e-6, 1e-6)
}

fn lenet_on_two_and_four_processes_follows_one_process_curve() -> Ran {
    compare_training(2, Setup::ThreeEpochs, &[], 1e-4, 1e-5)?;
    compare_training(4, Setup::ThreeEpochs, &[], 1e-4, 1e-5)
}

/// 4 ranks, LeNet in buckets of 4 KiB (each started from backward in the
/// plan's order), and a last batch of 3 rows: one rank has none and starts
/// every bucket after the others started theirs from backward. The same
/// curve and parameters as one process.
fn lenet_in_many_buckets_with_a_rank_without_rows_follows_one_process_curve() -> Ran {
    compare_training(4, Setup::Uneven, &[], 1e-4, 1e-5)
}

fn lenet_on_simulated_gpus_in_two_processes_follows_one_process_curve() -> Ran {
    compare_training(2, Setup::ThreeEpochs, &[("KILN_TEST_DIST_SIM", "1".into())], 1e-4, 1e-5)
}

/// With a CUDA device per rank (`KILN_CUDASIM_DEVICES=2 scripts/cudasim.sh`;
/// CI runs it so): the NCCL engine, its id broadcast over MPI, which also
/// carries host tensors, NCCL's declined calls (float max and min) and each
/// NCCL call's fingerprint. Every collective's values, and LeNet follows
/// one process.
fn collectives_and_lenet_through_nccl_bootstrapped_over_mpi() -> Ran {
    let cuda = common::cuda_devices().into_iter().filter(|&d| common::is_simulated_cuda(d)).count();
    if cuda < 2 {
        return Err(common::skip(
            "needs a simulated CUDA device per rank: run under `KILN_CUDASIM_DEVICES=2 scripts/cudasim.sh` (CI does)",
        ));
    }
    // The simulator's NCCL meets in a folder of this test's own.
    let meet = temp_dir("nccl");
    let dir = ("KILN_CUDASIM_NCCL_DIR", meet.display().to_string());
    let env = [("KILN_TEST_DIST_ENGINE", "nccl".to_string()), dir.clone()];
    let run = mpirun(2, "collectives", &env, Duration::from_secs(600))?;
    assert!(run.ok, "{}", run.output);
    compare_training(2, Setup::ThreeEpochs, &env, 1e-4, 1e-5)?;
    // Different NCCL calls: the fingerprints (over MPI) name both, before NCCL runs either.
    let env = [("KILN_TEST_DIST_ENGINE", "nccl".to_string()), ("KILN_TEST_DIST_ON_DEVICE", "1".to_string()), dir];
    let run = mpirun(2, "mismatch", &env, Duration::from_secs(120))?;
    assert!(!run.ok, "the job must end with an error:\n{}", run.output);
    assert!(run.output.contains("rank 0 all_reduce (sum) of 4 f32 elements, rank 1 all_reduce (sum) of 5 f32 elements"), "{}", run.output);
    let _ = std::fs::remove_dir_all(meet);
    Ok(())
}

fn a_checkpoint_of_two_ranks_resumes_in_a_world_of_one() -> Ran {
    let dir = temp_dir("ckpt");
    let out = dir.join("result.txt");
    let ckpt = dir.join("two.safetensors");
    let env = [
        ("KILN_TEST_DIST_OUT", out.display().to_string()),
        ("KILN_TEST_DIST_SETUP", Setup::TwoEpochs.name().to_string()),
        ("KILN_TEST_DIST_CHECKPOINT", ckpt.display().to_string()),
    ];
    let run = mpirun(2, "train", &env, Duration::from_secs(600))?;
    assert!(run.ok, "{}", run.output);
    // Rank 1 wrote nothing: one checkpoint, whole.
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files.len(), 2, "{files:?}");
    let (resumed_losses, resumed) = train(Setup::OneMoreEpoch, Some(&ckpt)).expect("the checkpoint resumes");
    let (straight_losses, straight) = train(Setup::ThreeEpochs, None).expect("one process trains");
    let (two_losses, _) = read_result(&out);
    let all: Vec<f64> = two_losses.iter().chain(&resumed_losses).copied().collect();
    assert!(max_rel(&all, &straight_losses) <= 1e-4, "{all:?} against {straight_losses:?}");
    assert!(max_rel(&resumed, &straight) <= 1e-3);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

fn ranks_calling_different_collectives_get_an_error_naming_both() -> Ran {
    let run = mpirun(2, "mismatch", &[], Duration::from_secs(120))?;
    assert!(!run.ok, "the job must end with an error:\n{}", run.output);
    assert!(
        // #3: init agrees on NCCL (#1), the barrier is #2.
        run.output.contains("rank 0 called #3 all_reduce (sum) of 4 f32 elements, rank 1 called #3 all_reduce (sum) of 5 f32 elements"),
        "{}",
        run.output
    );
    Ok(())
}

fn a_hung_rank_is_named_by_the_others_within_the_timeout() -> Ran {
    let run = mpirun(3, "hang", &[("KILN_DIST_TIMEOUT", "3".into())], Duration::from_secs(120))?;
    assert!(!run.ok, "the job must end with an error:\n{}", run.output);
    for r in [0, 2] {
        assert!(
            run.output.contains(&format!(
                "rank {r} of 3: all_reduce: rank 1 (its last collective: #2 all_reduce (sum) of 2 f32 elements) did not reach #3 all_reduce"
            )),
            "rank {r} names rank 1:\n{}",
            run.output
        );
    }
    // Rank 1 sleeps 600 s: the job was aborted long before.
    assert!(run.seconds < 60.0, "{} s", run.seconds);
    Ok(())
}

fn a_killed_rank_ends_the_job() -> Ran {
    let run = mpirun(2, "kill", &[("KILN_DIST_TIMEOUT", "5".into())], Duration::from_secs(120))?;
    assert!(!run.ok, "{}", run.output);
    assert!(run.output.contains("rank 1"), "the output names the killed rank:\n{}", run.output);
    assert!(run.seconds < 60.0, "{} s", run.seconds);
    Ok(())
}

// ---------------------------------------------------------------- threads

/// Runs `body` on every rank of an in-process group over `devices`, each on
/// a thread of its own; the ranks' results, in rank order. A rank that
/// panics fails the test after every rank has ended.
fn on_threads<T: Send>(devices: &[kiln::Device], body: impl Fn(dist::Group) -> Result<T> + Sync) -> Vec<Result<T>> {
    let groups = dist::Group::in_process(devices).expect("an in-process group");
    let body = &body;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(move || body(g))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| panic!("a rank's thread panicked"))).collect()
    })
}

fn collectives_of_threads_give_the_values_of_processes() -> Ran {
    let gpus = kiln::ensure_simulated_gpus(4, 256 << 20);
    // 2 and 4 simulated GPUs (their ring), and the CPU beside a GPU (peer copies).
    for devices in [&gpus[..2], &gpus[..4], &[cpu(), gpus[1]][..]] {
        for (r, result) in on_threads(devices, |g| {
            assert_eq!(g.engine(), "in-process");
            collectives_on(&g, g.device())
        })
        .into_iter()
        .enumerate()
        {
            result.unwrap_or_else(|e| panic!("rank {r} of {devices:?}: {e}"));
        }
    }
    Ok(())
}

/// One thread per CUDA device: the calls run in NCCL within the process
/// (under `KILN_CUDASIM_DEVICES=2 scripts/cudasim.sh`, the simulator's; CI
/// runs it so), with the same values, and LeNet follows one process.
fn collectives_of_threads_through_nccl_within_one_process() -> Ran {
    let cuda = common::cuda_devices();
    if cuda.len() < 2 {
        return Err(common::skip("needs two CUDA devices: run under `KILN_CUDASIM_DEVICES=2 scripts/cudasim.sh` (CI does)"));
    }
    for (r, result) in on_threads(&cuda[..2], |g| collectives_on(&g, g.device())).into_iter().enumerate() {
        result.unwrap_or_else(|e| panic!("rank {r} on {}: {e}", cuda[r]));
    }
    let results = on_threads(&cuda[..2], |g| train_on(Setup::ThreeEpochs, Some(g), None, None));
    let (one_losses, one_params) = train(Setup::ThreeEpochs, None).expect("one process trains");
    for (r, result) in results.into_iter().enumerate() {
        let (losses, params) = result.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let (dl, dp) = (max_rel(&losses, &one_losses), max_rel(&params, &one_params));
        println!("2 threads on {:?}, rank {r}: max relative difference: losses {dl:.2e}, parameters {dp:.2e}", &cuda[..2]);
        assert!(dl <= 1e-4 && dp <= 1e-5, "rank {r}: losses {dl:e}, parameters {dp:e}");
    }
    Ok(())
}

fn random_calls_on_three_threads_match_a_reference() -> Ran {
    let gpus = kiln::ensure_simulated_gpus(3, 256 << 20);
    for (r, result) in on_threads(&gpus[..3], |g| fuzz_on(&g, g.device())).into_iter().enumerate() {
        result.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    Ok(())
}

/// The Trainer with an in-process group (one thread per simulated GPU) takes
/// the path of one process per GPU, and follows one process: one step gives
/// its parameters; three epochs (2 ranks) and many small buckets with a
/// rank without rows in the last batch (4 ranks) its curve.
fn lenet_on_threads_follows_one_process() -> Ran {
    let gpus = kiln::ensure_simulated_gpus(4, 256 << 20);
    for (setup, ranks, loss_tol, param_tol) in
        [(Setup::OneStep, 2, 1e-6, 1e-6), (Setup::ThreeEpochs, 2, 1e-4, 1e-5), (Setup::Uneven, 4, 1e-4, 1e-5)]
    {
        let results = on_threads(&gpus[..ranks], |g| {
            let device = g.device();
            let (losses, params) = train_on(setup, Some(g.clone()), None, None)?;
            Ok((losses, params, device, g.stats()))
        });
        let (one_losses, one_params) = train(setup, None).expect("one process trains");
        for (r, result) in results.into_iter().enumerate() {
            let (losses, params, device, stats) = result.unwrap_or_else(|e| panic!("rank {r} of {ranks}: {e}"));
            assert_eq!(device, gpus[r]);
            assert!(stats.calls > 0 && stats.bytes > 0, "rank {r}: {stats:?}");
            let (dl, dp) = (max_rel(&losses, &one_losses), max_rel(&params, &one_params));
            println!("{ranks} threads, {}, rank {r}: max relative difference: losses {dl:.2e}, parameters {dp:.2e}", setup.name());
            assert!(dl <= loss_tol, "rank {r}: losses differ by {dl:e}: {losses:?} against {one_losses:?}");
            assert!(dp <= param_tol, "rank {r}: parameters differ by {dp:e}");
        }
    }
    Ok(())
}

fn threads_calling_different_collectives_get_an_error_naming_both() -> Ran {
    let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
    let results = on_threads(&gpus[..2], |g| {
        g.barrier()?;
        let x = Tensor::zeros(if g.rank() == 0 { 4 } else { 5 }, DType::F32, &g.device())?;
        let e = g.all_reduce(&x, ReduceOp::Sum).err().map(|e| e.to_string()).unwrap_or_default();
        // The group is broken: the next call fails at once with the same story.
        let again = g.barrier().err().map(|e| e.to_string()).unwrap_or_default();
        Ok((e, again))
    });
    for (r, result) in results.into_iter().enumerate() {
        let (e, again) = result.expect("the ranks return their errors");
        assert!(
            e.contains(&format!("rank {r} of 2"))
                && e.contains("rank 0 called #1 all_reduce (sum) of 4 f32 elements, rank 1 called #1 all_reduce (sum) of 5 f32 elements"),
            "rank {r}: {e}"
        );
        assert!(again.contains("ranks called different collectives"), "rank {r}: {again}");
    }
    Ok(())
}

fn a_silent_thread_is_named_by_the_others_within_the_timeout() -> Ran {
    let gpus = kiln::ensure_simulated_gpus(3, 256 << 20);
    let results = on_threads(&gpus[..3], |g| {
        let x = Tensor::new(&[1f32, 2.], &g.device())?;
        // Call #0 under the default timeout: the threads start when they start.
        g.all_reduce(&x, ReduceOp::Sum)?;
        g.set_timeout(Duration::from_secs(2))?;
        if g.rank() == 1 {
            // Silent past the timeout, its group still held.
            std::thread::sleep(Duration::from_secs(6));
        }
        Ok(g.all_reduce(&x, ReduceOp::Sum).err().map(|e| e.to_string()).unwrap_or_default())
    });
    for (r, result) in results.into_iter().enumerate() {
        let e = result.expect("the ranks return their errors");
        // Rank 1 is named (with another rank too, should that one have been
        // held up past the timeout on a loaded machine).
        let listed = e.split(" did not call #1 all_reduce").next().and_then(|p| p.rsplit(": ").next()).unwrap_or("");
        let names_rank_1 = e.contains(" did not call #1 all_reduce")
            && listed.trim_start_matches("ranks ").trim_start_matches("rank ").split(", ").any(|r| r == "1");
        if r == 1 {
            assert!(e.contains("broken") && names_rank_1, "the late rank finds the group broken: {e}");
        } else {
            assert!(e.contains(&format!("rank {r} of 3")) && names_rank_1 && e.contains("of 2 f32 elements within 2 s"), "rank {r}: {e}");
        }
    }
    Ok(())
}

fn a_thread_that_ends_is_named_by_the_others_at_once() -> Ran {
    let gpus = kiln::ensure_simulated_gpus(2, 256 << 20);
    let results = on_threads(&gpus[..2], |g| {
        // A timeout no run of this test reaches: the rank that left is named without it.
        g.set_timeout(Duration::from_secs(120))?;
        if g.rank() == 1 {
            return Ok((String::new(), String::new(), Duration::ZERO)); // its group is dropped here
        }
        let start = Instant::now();
        let x = Tensor::new(&[1f32], &g.device())?;
        let e = g.all_reduce(&x, ReduceOp::Sum).err().map(|e| e.to_string()).unwrap_or_default();
        let took = start.elapsed();
        let r = g.recv(&[1], DType::F32, 1).err().map(|e| e.to_string()).unwrap_or_default();
        Ok((e, r, took))
    });
    let (e, r, took) = results.into_iter().next().expect("rank 0").expect("rank 0 returns its error");
    assert!(e.contains("rank 1 left the group") && e.contains("#0 all_reduce (sum) of 1 f32 elements"), "{e}");
    // The group broke with it: the receive says so, at once.
    assert!(r.contains("rank 1 left the group"), "{r}");
    // Named when it left, not at the 120 s timeout (a watchdog's bound, not a timing).
    assert!(took < Duration::from_secs(60), "{took:?}");
    Ok(())
}

// ---------------------------------------------------------------- training

#[derive(Clone, Copy)]
enum Setup {
    OneStep,
    TwoEpochs,
    ThreeEpochs,
    OneMoreEpoch,
    /// Two epochs whose last batch has fewer rows than 4 ranks (a rank
    /// without rows), with buckets of 4 KiB (LeNet in many buckets).
    Uneven,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::OneStep => "one-step",
            Setup::TwoEpochs => "two-epochs",
            Setup::ThreeEpochs => "three-epochs",
            Setup::OneMoreEpoch => "one-more-epoch",
            Setup::Uneven => "uneven",
        }
    }

    fn from_name(name: &str) -> Setup {
        match name {
            "one-step" => Setup::OneStep,
            "two-epochs" => Setup::TwoEpochs,
            "one-more-epoch" => Setup::OneMoreEpoch,
            "uneven" => Setup::Uneven,
            _ => Setup::ThreeEpochs,
        }
    }
}

/// LeNet on 200 random 28×28 images of 10 classes (batches of 48, the last
/// one short), shuffled, with validation; trained on `group` (one process
/// when `None`). Returns the training losses and the parameters.
fn train_on(setup: Setup, group: Option<dist::Group>, resume: Option<&Path>, save: Option<&Path>) -> Result<(Vec<f64>, Vec<f64>)> {
    kiln::manual_seed(7);
    // Uneven: 147 training rows, batches of 48, 48, 48 and 3.
    let n = match setup {
        Setup::OneStep => 64,
        Setup::Uneven => 196,
        _ => 200,
    };
    let x = Tensor::randn((n, 1, 28, 28), &cpu())?;
    let y = Tensor::rand(n, &cpu())?.mul_scalar(9.99)?.to_dtype(DType::I64)?;
    let batch = if matches!(setup, Setup::OneStep) { 64 } else { 48 };
    let train = DataLoader::new(vec![x.narrow(0, 0, n * 3 / 4)?, y.narrow(0, 0, n * 3 / 4)?], batch)?.shuffle(true);
    let val = DataLoader::new(vec![x.narrow(0, n * 3 / 4, n - n * 3 / 4)?, y.narrow(0, n * 3 / 4, n - n * 3 / 4)?], batch)?;
    let data = DataModule { train, val: Some(val) };
    let epochs = match setup {
        Setup::OneStep | Setup::OneMoreEpoch => 1,
        Setup::TwoEpochs | Setup::Uneven => 2,
        Setup::ThreeEpochs => 3,
    };
    let mut learner =
        Learner::new(kiln::models::lenet(10), Loss::CrossEntropy, OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, weight_decay: 0.0 });
    let mut builder = Trainer::builder().max_epochs(epochs).progress(Progress::Off);
    if matches!(setup, Setup::Uneven) {
        builder = builder.bucket_size(4096);
    }
    if let Some(g) = group {
        builder = builder.process_group(g);
    }
    let mut trainer = builder.build()?;
    if let Some(path) = resume {
        // The lazy layers' parameters exist before the checkpoint fills them.
        let _g = kiln::no_grad();
        learner.net.init_lazy(&data.train.tensors()[0].narrow(0, 0, 1)?)?;
        drop(_g);
        trainer.load_checkpoint(&mut learner, path)?;
    }
    let history = trainer.fit(&mut learner, &data)?;
    if let Some(path) = save {
        trainer.save_checkpoint(&learner, path)?;
    }
    let mut params = Vec::new();
    for p in learner.net.parameters() {
        params.extend(p.to_vec_f64()?);
    }
    Ok((history.train_losses(), params))
}

fn train(setup: Setup, resume: Option<&Path>) -> Result<(Vec<f64>, Vec<f64>)> {
    train_on(setup, None, resume, None)
}

// ---------------------------------------------------------------- ranks

fn fail(op: &str, msg: impl Into<String>) -> kiln::Error {
    kiln::Error::Io { path: op.to_string(), msg: msg.into() }
}

fn worker(scenario: &str) -> ExitCode {
    let result = match scenario {
        "collectives" => worker_collectives(),
        "fuzz" => worker_fuzz(),
        "train" => worker_train(),
        "mismatch" => worker_mismatch(),
        "hang" => worker_hang(),
        "kill" => worker_kill(),
        other => Err(fail("dist test", format!("no scenario {other}"))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// The engine a scenario expects (`KILN_TEST_DIST_ENGINE`), checked.
fn check_engine(g: &dist::Group) -> Result<()> {
    match std::env::var("KILN_TEST_DIST_ENGINE") {
        Ok(want) if want != g.engine() => Err(fail("dist test", format!("rank {}: engine {}, expected {want}", g.rank(), g.engine()))),
        _ => Ok(()),
    }
}

fn check(what: &str, got: Vec<f64>, want: Vec<f64>) -> Result<()> {
    let same = got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
    if same {
        Ok(())
    } else {
        Err(fail("dist test", format!("{what}: got {got:?}, want {want:?}")))
    }
}

fn worker_collectives() -> Result<()> {
    kiln::ensure_simulated_gpus(1, 64 << 20);
    let g = dist::init()?;
    check_engine(&g)?;
    collectives_on(&g, kiln::gpu(0))
}

/// Every collective of `g`, on the CPU and on `gpu`, against values worked
/// out by hand.
fn collectives_on(g: &dist::Group, gpu: kiln::Device) -> Result<()> {
    let (r, n) = (g.rank(), g.size());
    let (rf, nf) = (r as f64, n as f64);
    let tri = nf * (nf - 1.0) / 2.0;
    for device in [cpu(), gpu] {
        let x = Tensor::new(&[rf as f32 + 1.0, 10.0 * rf as f32], &device)?;
        let sum = g.all_reduce(&x, ReduceOp::Sum)?;
        if sum.device() != device {
            return Err(fail("dist test", "the sum left the tensor's device"));
        }
        check("sum", sum.to_vec_f64()?, vec![tri + nf, 10.0 * tri])?;
        check("mean", g.all_reduce(&x, ReduceOp::Mean)?.to_vec_f64()?, vec![(tri + nf) / nf, 10.0 * tri / nf])?;
        check("max", g.all_reduce(&x, ReduceOp::Max)?.to_vec_f64()?, vec![nf, 10.0 * (nf - 1.0)])?;
        check("min", g.all_reduce(&x, ReduceOp::Min)?.to_vec_f64()?, vec![1.0, 0.0])?;
        let nan = Tensor::new(&[if r == 1 { f32::NAN } else { 1.0 }, -1.0], &device)?;
        check("NaN wins max", g.all_reduce(&nan, ReduceOp::Max)?.to_vec_f64()?, vec![f64::NAN, -1.0])?;
        check("NaN wins min", g.all_reduce(&nan, ReduceOp::Min)?.to_vec_f64()?, vec![f64::NAN, -1.0])?;
        let ints = Tensor::new(&[r as i64, 1 << 40], &device)?;
        check("i64 sum", g.all_reduce(&ints, ReduceOp::Sum)?.to_vec_f64()?, vec![tri, nf * (1u64 << 40) as f64])?;
        let half = x.to_dtype(DType::BF16)?;
        let hs = g.all_reduce(&half, ReduceOp::Sum)?;
        if hs.dtype() != DType::BF16 {
            return Err(fail("dist test", "bf16 came back as another dtype"));
        }
        check("bf16 sum", hs.to_vec_f64()?, vec![tri + nf, 10.0 * tri])?;
        let hm = g.all_reduce(&x.to_dtype(DType::F16)?, ReduceOp::Mean)?;
        let want: Vec<f64> = [(tri + nf) / nf, 10.0 * tri / nf].iter().map(|&v| half::f16::from_f64(v).to_f64()).collect();
        check("f16 mean", hm.to_vec_f64()?, want)?;
        check("broadcast", g.broadcast(&x, n - 1)?.to_vec_f64()?, vec![nf, 10.0 * (nf - 1.0)])?;
        let reduced = g.reduce(&x, 0, ReduceOp::Sum)?.to_vec_f64()?;
        check("reduce", reduced, if r == 0 { vec![tri + nf, 10.0 * tri] } else { vec![rf + 1.0, 10.0 * rf] })?;
        let gathered = g.all_gather(&x)?;
        let want: Vec<f64> = (0..n).flat_map(|k| [k as f64 + 1.0, 10.0 * k as f64]).collect();
        check("all_gather", gathered.to_vec_f64()?, want)?;
        // Rank k holds k at every position: rank r gets its piece summed.
        let ramp = Tensor::from_vec((0..2 * n).map(|i| (i as f32) * (rf as f32 + 1.0)).collect::<Vec<f32>>(), (n, 2), &device)?;
        let piece = g.reduce_scatter(&ramp, ReduceOp::Sum)?;
        let s = tri + nf;
        check("reduce_scatter", piece.to_vec_f64()?, vec![2.0 * rf * s, (2.0 * rf + 1.0) * s])?;
        if piece.dims() != [1, 2] {
            return Err(fail("dist test", format!("reduce_scatter gave shape {:?}", piece.dims())));
        }
        // A ring of sends: even ranks send first.
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mine = Tensor::new(&[rf as f32; 3], &device)?;
        let got = if r % 2 == 0 {
            g.send(&mine, next)?;
            g.recv(&[3], DType::F32, prev)?
        } else {
            let got = g.recv(&[3], DType::F32, prev)?;
            g.send(&mine, next)?;
            got
        };
        check("recv", got.to_vec_f64()?, vec![prev as f64; 3])?;
        in_place(g, &device)?;
        started(g, &device)?;
        g.barrier()?;
    }
    // Refusals name the problem before anything is sent.
    let x = Tensor::new(&[1i32, 2], &cpu())?;
    assert!(matches!(g.all_reduce(&x, ReduceOp::Mean), Err(kiln::Error::UnsupportedDType { .. })));
    assert!(g.broadcast(&x, n).unwrap_err().to_string().contains(&format!("root {n} is not a rank")));
    assert!(g.reduce_scatter(&Tensor::zeros(n + 1, DType::F32, &cpu())?, ReduceOp::Sum).is_err());
    assert!(g.send(&x, r).is_err());
    let stats = g.stats();
    assert!(stats.calls > 20 && stats.bytes > 0, "{stats:?}");
    g.barrier()?;
    println!("rank {r} of {n}: collectives ok");
    Ok(())
}

/// The `*_async` calls: several started before any is waited for, waited
/// in reverse order, on inputs written after the call (the result is that
/// of the input at the call); one dropped unwaited, after which the group
/// still agrees.
fn started(g: &dist::Group, device: &kiln::Device) -> Result<()> {
    let (r, n) = (g.rank(), g.size());
    let (rf, nf) = (r as f64, n as f64);
    let tri = nf * (nf - 1.0) / 2.0;
    let x = Tensor::new(&[rf as f32 + 1.0, 10.0 * rf as f32], device)?;
    let ramp = Tensor::from_vec((0..2 * n).map(|i| (i as f32) * (rf as f32 + 1.0)).collect::<Vec<f32>>(), (n, 2), device)?;
    let sum = g.all_reduce_async(&x, ReduceOp::Sum)?;
    let mean = g.all_reduce_async(&x.to_dtype(DType::F64)?, ReduceOp::Mean)?;
    let root = g.broadcast_async(&x, n - 1)?;
    let gathered = g.all_gather_async(&x)?;
    let piece = g.reduce_scatter_async(&ramp, ReduceOp::Sum)?;
    let reduced = g.reduce_async(&x, 0, ReduceOp::Max)?;
    let dropped = g.all_reduce_async(&x, ReduceOp::Min)?;
    // Written after the calls: the results are those of the old values.
    x.assign(&Tensor::full(-7.0, 2, DType::F32, device)?)?;
    ramp.assign(&Tensor::zeros((n, 2), DType::F32, device)?)?;
    drop(dropped);
    let reduced = reduced.wait()?;
    if !(sum.is_completed() && root.is_completed()) {
        return Err(fail("dist test", "calls made before a finished one are not completed"));
    }
    check("reduce_async", reduced.to_vec_f64()?, if r == 0 { vec![nf, 10.0 * (nf - 1.0)] } else { vec![rf + 1.0, 10.0 * rf] })?;
    let s = tri + nf;
    let piece = piece.wait()?;
    if piece.dims() != [1, 2] || piece.device() != *device {
        return Err(fail("dist test", format!("reduce_scatter_async gave shape {:?} on {}", piece.dims(), piece.device())));
    }
    check("reduce_scatter_async", piece.to_vec_f64()?, vec![2.0 * rf * s, (2.0 * rf + 1.0) * s])?;
    let want: Vec<f64> = (0..n).flat_map(|k| [k as f64 + 1.0, 10.0 * k as f64]).collect();
    check("all_gather_async", gathered.wait()?.to_vec_f64()?, want)?;
    check("broadcast_async", root.wait()?.to_vec_f64()?, vec![nf, 10.0 * (nf - 1.0)])?;
    let mean = mean.wait()?;
    if mean.dtype() != DType::F64 {
        return Err(fail("dist test", format!("an f64 mean came back as {}", mean.dtype())));
    }
    check("all_reduce_async mean", mean.to_vec_f64()?, vec![s / nf, 10.0 * tri / nf])?;
    check("all_reduce_async", sum.wait()?.to_vec_f64()?, vec![s, 10.0 * tri])?;
    // After the dropped call, the next ones still line up on every rank.
    let after = g.all_reduce(&Tensor::new(&[rf as f32], device)?, ReduceOp::Sum)?;
    check("all_reduce after a dropped Work", after.to_vec_f64()?, vec![tri])?;
    // Refusals come at the call, before anything is started.
    let ints = Tensor::new(&[1i32, 2], device)?;
    assert!(matches!(g.all_reduce_async(&ints, ReduceOp::Mean), Err(kiln::Error::UnsupportedDType { .. })));
    assert!(g.broadcast_async(&ints, n).unwrap_err().to_string().contains(&format!("root {n} is not a rank")));
    let scalar = Tensor::zeros((), DType::F32, device)?;
    assert!(g.reduce_scatter_async(&scalar, ReduceOp::Sum).unwrap_err().to_string().contains("must be a multiple"));
    Ok(())
}

/// The in-place calls: every dtype (in the tensor's memory where it can
/// be, through a staged copy where not), views with an offset, strided
/// views, aliases that see the result, and broadcast views refused on
/// every rank alike.
fn in_place(g: &dist::Group, device: &kiln::Device) -> Result<()> {
    let (r, n) = (g.rank(), g.size());
    let (rf, nf) = (r as f64, n as f64);
    let tri = nf * (nf - 1.0) / 2.0;
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8, DType::F16, DType::BF16] {
        let x = Tensor::new(&[rf + 1.0, 2.0 * rf], device)?.to_dtype(dtype)?;
        let alias = x.narrow(0, 1, 1)?;
        g.all_reduce_(&x, ReduceOp::Sum)?;
        if x.dtype() != dtype || x.device() != *device {
            return Err(fail("dist test", format!("all_reduce_ changed {dtype} on {device} to {} on {}", x.dtype(), x.device())));
        }
        check(&format!("all_reduce_ {dtype}"), x.to_vec_f64()?, vec![tri + nf, 2.0 * tri])?;
        check(&format!("all_reduce_ {dtype}, seen by a view"), alias.to_vec_f64()?, vec![2.0 * tri])?;
        if dtype.is_float() {
            g.all_reduce_(&x, ReduceOp::Mean)?;
            check(&format!("all_reduce_ mean {dtype}"), x.to_vec_f64()?, vec![tri + nf, 2.0 * tri])?;
        }
        let w = Tensor::new(&[rf, -rf], device)?.to_dtype(dtype)?;
        g.broadcast_(&w, n - 1)?;
        let last = nf - 1.0;
        let want = if dtype == DType::U8 { vec![last, 0.0] } else { vec![last, -last] };
        check(&format!("broadcast_ {dtype}"), w.to_vec_f64()?, want)?;
    }
    // A mean of f16 whose sum leaves f16's range (65504) but whose mean
    // does not: divided before it is rounded to f16, so not infinite.
    let big_half = Tensor::full(40000.0, 2, DType::F16, device)?;
    check("f16 mean past f16's range", g.all_reduce(&big_half, ReduceOp::Mean)?.to_vec_f64()?, vec![40000.0; 2])?;
    g.all_reduce_(&big_half, ReduceOp::Mean)?;
    check("f16 mean in place past f16's range", big_half.to_vec_f64()?, vec![40000.0; 2])?;
    // A view with an offset: only its elements change; read where it is.
    let big = Tensor::new(&[100.0, rf, 2.0 * rf, 100.0], device)?;
    let mid = big.narrow(0, 1, 2)?;
    check("all_reduce of a view", g.all_reduce(&mid, ReduceOp::Sum)?.to_vec_f64()?, vec![tri, 2.0 * tri])?;
    g.all_reduce_(&mid, ReduceOp::Max)?;
    check("all_reduce_ of a view", big.to_vec_f64()?, vec![100.0, nf - 1.0, 2.0 * (nf - 1.0), 100.0])?;
    // A strided view (staged, then assigned back in place).
    let m = Tensor::from_vec((0..6).map(|i| (i as f32) * (rf as f32 + 1.0)).collect::<Vec<f32>>(), (2, 3), device)?;
    let mt = m.t()?;
    g.all_reduce_(&mt, ReduceOp::Sum)?;
    check("all_reduce_ of a transposed view", m.to_vec_f64()?, (0..6).map(|i| i as f64 * (tri + nf)).collect())?;
    // Elements that share memory are refused before anything is sent.
    let one = Tensor::new(&[1f32], device)?.broadcast_to(3)?;
    let refused = g.all_reduce_(&one, ReduceOp::Sum).unwrap_err().to_string();
    if !refused.contains("broadcast view") {
        return Err(fail("dist test", format!("all_reduce_ of a broadcast view: {refused}")));
    }
    Ok(())
}

/// splitmix64: the fuzzer's numbers, the same on every rank for one seed.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Rank `rank`'s element `i` of case `case`: a small integer, exact in
/// every dtype and in every sum of a few of them (non-negative for u8).
fn fuzz_value(case: u64, rank: usize, i: usize, dtype: DType) -> f64 {
    let v = (mix(case ^ mix((rank as u64) << 32 ^ i as u64)) % 7) as f64;
    if dtype == DType::U8 {
        v
    } else {
        v - 3.0
    }
}

/// Every collective with random dtypes, shapes (zero-size included), views
/// (contiguous, offset, transposed, broadcast), reductions, roots and
/// devices, in place and not, against the reference each rank computes.
fn worker_fuzz() -> Result<()> {
    kiln::ensure_simulated_gpus(1, 64 << 20);
    let g = dist::init()?;
    fuzz_on(&g, kiln::gpu(0))
}

/// Seeded random calls of `g` on the CPU and on `gpu`, each checked against
/// the reference computed from every rank's inputs.
fn fuzz_on(g: &dist::Group, gpu: kiln::Device) -> Result<()> {
    let (r, n) = (g.rank(), g.size());
    let seed: u64 = std::env::var("KILN_DIST_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let cases: u64 = std::env::var("KILN_DIST_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(150);
    let dtypes = [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8, DType::F16, DType::BF16];
    let ops = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];
    for c in 0..cases {
        let case = mix(seed ^ mix(c));
        let pick = |k: u64, m: usize| (mix(case ^ k) % m as u64) as usize;
        let dtype = dtypes[pick(1, dtypes.len())];
        let op = ops[pick(2, ops.len())];
        let device = if pick(3, 2) == 0 { cpu() } else { gpu };
        let rank_count = pick(4, 4);
        let mut dims: Vec<usize> = (0..rank_count).map(|d| pick(10 + d as u64, 4)).collect();
        if let Some(d0) = dims.first_mut() {
            *d0 = n * pick(20, 3); // reduce_scatter cuts dimension 0 by n
        }
        let len: usize = dims.iter().product();
        let view = pick(5, 4); // 0 contiguous, 1 offset, 2 transposed, 3 broadcast
        let root = pick(6, n);
        let call = pick(7, 7);
        let what = format!("case {c} (seed {seed}): call {call} {op:?} {dtype} {dims:?} view {view} on {device}, root {root}");
        let values = |rank: usize| -> Vec<f64> { (0..len).map(|i| fuzz_value(case, rank, i, dtype)).collect() };
        let contiguous = |v: Vec<f64>| Tensor::from_vec(v, dims.as_slice(), &device)?.to_dtype(dtype);
        // This rank's input as the chosen kind of view, and a check that the
        // memory around an offset view was left alone.
        let mine = contiguous(values(r))?;
        let (x, base) = match view {
            1 if !dims.is_empty() => {
                let mut outer = dims.clone();
                outer[0] += 2;
                let base = Tensor::full(100.0, outer.as_slice(), dtype, &device)?;
                let x = base.narrow(0, 1, dims[0])?;
                x.assign(&mine)?;
                (x, Some(base))
            }
            2 if dims.len() >= 2 => (mine.transpose(0, 1)?.contiguous()?.transpose(0, 1)?, None),
            3 => {
                let one =
                    Tensor::from_vec(vec![fuzz_value(case, r, 0, dtype)], vec![1; dims.len()].as_slice(), &device)?.to_dtype(dtype)?;
                (one.broadcast_to(dims.as_slice())?, None)
            }
            _ => (mine, None),
        };
        let inputs: Vec<Vec<f64>> = (0..n).map(|k| if view == 3 { vec![fuzz_value(case, k, 0, dtype); len] } else { values(k) }).collect();
        let combine = |vals: &[f64]| -> f64 {
            match op {
                ReduceOp::Sum => vals.iter().sum(),
                ReduceOp::Mean => vals.iter().sum::<f64>() / n as f64,
                ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
                ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
                other => panic!("no reference for {other:?}"),
            }
        };
        let reduced: Vec<f64> = (0..len).map(|i| combine(&inputs.iter().map(|v| v[i]).collect::<Vec<_>>())).collect();
        let close = |got: &[f64], want: &[f64]| -> Result<()> {
            let tol = match dtype {
                DType::F16 | DType::BF16 => 1.0 / 64.0,
                DType::F32 => 1e-6,
                DType::F64 | DType::I32 | DType::I64 | DType::U8 => 1e-12,
            };
            let ok = got.len() == want.len() && got.iter().zip(want).all(|(a, b)| (a - b).abs() <= tol * b.abs().max(1.0));
            if ok {
                Ok(())
            } else {
                Err(fail("dist fuzz", format!("{what}: got {got:?}, want {want:?}")))
            }
        };
        let int_mean = op == ReduceOp::Mean && !dtype.is_float();
        let expect_refusal = |res: Result<()>, why: &str| -> Result<()> {
            match res {
                Err(_) => Ok(()),
                Ok(()) => Err(fail("dist fuzz", format!("{what}: {why} was accepted"))),
            }
        };
        match call {
            0 => match g.all_reduce(&x, op) {
                Err(kiln::Error::UnsupportedDType { .. }) if int_mean => {}
                Err(e) => return Err(fail("dist fuzz", format!("{what}: {e}"))),
                Ok(_) if int_mean => return Err(fail("dist fuzz", format!("{what}: an integer mean was accepted"))),
                Ok(t) => {
                    if t.dims() != dims.as_slice() || t.dtype() != dtype || t.device() != device {
                        return Err(fail("dist fuzz", format!("{what}: got {:?} {} on {}", t.dims(), t.dtype(), t.device())));
                    }
                    close(&t.to_vec_f64()?, &reduced)?;
                }
            },
            1 => {
                let res = g.all_reduce_(&x, op);
                if int_mean || (view == 3 && len > 1) {
                    expect_refusal(res, "an integer mean or a broadcast destination")?;
                    continue;
                }
                res?;
                close(&x.to_vec_f64()?, &reduced)?;
            }
            2 => close(&g.broadcast(&x, root)?.to_vec_f64()?, &inputs[root])?,
            3 => {
                let res = g.broadcast_(&x, root);
                if view == 3 && len > 1 {
                    expect_refusal(res, "a broadcast destination")?;
                    continue;
                }
                res?;
                close(&x.to_vec_f64()?, &inputs[root])?;
            }
            4 => {
                let t = g.all_gather(&x)?;
                let mut want_dims = dims.clone();
                match want_dims.first_mut() {
                    Some(d0) => *d0 *= n,
                    None => want_dims.push(n),
                }
                if t.dims() != want_dims.as_slice() {
                    return Err(fail("dist fuzz", format!("{what}: all_gather gave {:?}", t.dims())));
                }
                close(&t.to_vec_f64()?, &inputs.concat())?;
            }
            5 => {
                let res = g.reduce_scatter(&x, op);
                if dims.is_empty() || int_mean {
                    if res.is_ok() {
                        return Err(fail("dist fuzz", format!("{what}: reduce_scatter accepted a scalar or an integer mean")));
                    }
                    continue;
                }
                let piece = len / n;
                close(&res?.to_vec_f64()?, &reduced[r * piece..(r + 1) * piece])?;
            }
            _ => {
                let res = g.reduce(&x, root, op);
                if int_mean {
                    if res.is_ok() {
                        return Err(fail("dist fuzz", format!("{what}: reduce accepted an integer mean")));
                    }
                    continue;
                }
                let want = if r == root { reduced.clone() } else { inputs[r].clone() };
                close(&res?.to_vec_f64()?, &want)?;
            }
        }
        if let Some(base) = base {
            let all = base.to_vec_f64()?;
            let row: usize = dims[1..].iter().product();
            if all[..row].iter().chain(&all[all.len() - row..]).any(|&v| v != 100.0) {
                return Err(fail("dist fuzz", format!("{what}: the memory around the view changed: {all:?}")));
            }
        }
    }
    g.barrier()?;
    println!("rank {r} of {n}: fuzz ok ({cases} cases)");
    Ok(())
}

fn worker_train() -> Result<()> {
    let sim = std::env::var("KILN_TEST_DIST_SIM").is_ok();
    let launch = dist::launch()?;
    if sim {
        kiln::ensure_simulated_gpus(launch.size, 256 << 20);
    }
    let g = dist::init()?;
    check_engine(&g)?;
    if sim && g.device() != kiln::gpu(g.local_rank()) {
        return Err(fail("dist test", format!("rank {} trains on {}", g.rank(), g.device())));
    }
    let setup = Setup::from_name(&std::env::var("KILN_TEST_DIST_SETUP").unwrap_or_default());
    let save = std::env::var("KILN_TEST_DIST_CHECKPOINT").ok().map(PathBuf::from);
    let (losses, params) = train_on(setup, Some(g.clone()), None, save.as_deref())?;
    if g.is_main() {
        let out = std::env::var("KILN_TEST_DIST_OUT").map_err(|_| fail("dist test", "KILN_TEST_DIST_OUT"))?;
        let line = |v: &[f64]| v.iter().map(|x| format!("{x:e}")).collect::<Vec<_>>().join(" ");
        std::fs::write(out, format!("{}\n{}\n", line(&losses), line(&params))).map_err(|e| fail("dist test", e.to_string()))?;
    }
    let s = g.stats();
    println!("rank {}: {} calls, {} bytes, {:.3} s in collectives", g.rank(), s.calls, s.bytes, s.seconds);
    Ok(())
}

fn worker_mismatch() -> Result<()> {
    let g = dist::init()?;
    check_engine(&g)?;
    g.barrier()?;
    let len = if g.rank() == 0 { 4 } else { 5 };
    let device = if std::env::var_os("KILN_TEST_DIST_ON_DEVICE").is_some() { g.device() } else { cpu() };
    let x = Tensor::zeros(len, DType::F32, &device)?;
    match g.all_reduce(&x, ReduceOp::Sum) {
        Ok(_) => Err(fail("dist test", "different collectives gave a result")),
        Err(e) => {
            println!("{e}");
            Err(e)
        }
    }
}

fn worker_hang() -> Result<()> {
    let g = dist::init()?;
    let x = Tensor::new(&[1f32, 2.], &cpu())?;
    g.all_reduce(&x, ReduceOp::Sum)?;
    if g.rank() == 1 {
        std::thread::sleep(Duration::from_secs(600));
    }
    let started = Instant::now();
    let e = g.all_reduce(&x, ReduceOp::Sum).expect_err("rank 1 hangs");
    println!("{e} (after {:.1} s)", started.elapsed().as_secs_f64());
    // Every later call fails at once.
    let again = Instant::now();
    assert!(g.barrier().unwrap_err().to_string().contains("broken"));
    assert!(again.elapsed() < Duration::from_secs(1));
    Err(e)
}

fn worker_kill() -> Result<()> {
    let g = dist::init()?;
    let x = Tensor::new(&[1f32, 2.], &cpu())?;
    g.all_reduce(&x, ReduceOp::Sum)?;
    if g.rank() == 1 {
        // SAFETY: ends this process at once, as a crash or `kill -9` does.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    std::thread::sleep(Duration::from_millis(500));
    g.all_reduce(&x, ReduceOp::Sum).map(drop)
}
