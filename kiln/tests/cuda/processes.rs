//! Two processes, one simulated CUDA device each, launched with
//! torchrun-style variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`): `dist::init` opens the NCCL engine (NCCL's own
//! bootstrap through `NCCL_COMM_ID`), collectives of device tensors run in
//! NCCL without the host, LeNet trained on the two follows one process, and
//! a rank that exits or calls another collective is an error naming it.
//! Each process is this binary again, as a child running one role.

use super::*;
use kiln::comm::ReduceOp;
use kiln::data::{DataLoader, DataModule};
use kiln::dist;
use kiln::nn::{Loss, Module};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ROLE: &str = "KILN_TEST_NCCL_ROLE";

/// The simulated CUDA device this test runs beside, or why not.
fn simulated_cuda() -> std::result::Result<Device, Skip> {
    let Some(&d) = cuda_devices().first() else { return Err(no_cuda_device()) };
    if !common::is_simulated_cuda(d) {
        return Err(common::skip(format!(
            "two processes on one machine need two CUDA devices the simulator makes ({d} is a real GPU, which NCCL does not \
             give to two ranks)"
        )));
    }
    Ok(d)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-nccl-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

/// Starts this test again as a child in `role`, rank `rank` of `size`
/// (none: a world of one), with one simulated CUDA device.
fn spawn(role: &str, rank: Option<(usize, usize)>, dir: &Path, port: u16) -> Child {
    let name = common::test_name();
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args(["--exact", name.as_str(), "--nocapture", "--test-threads=1"])
        .env("KILN_TEST_CHILD", &name)
        .env(ROLE, role)
        .env("KILN_TEST_NCCL_DIR", dir)
        .env("KILN_CUDASIM_DEVICES", "1")
        // The processes meet through NCCL whatever the caller's setting (CI
        // also runs this suite with KILN_DISABLE_NCCL=1, for peer copies).
        .env("KILN_DISABLE_NCCL", "0")
        .env("KILN_CUDASIM_NCCL_DIR", dir)
        .env("KILN_CUDASIM_NCCL_TIMEOUT", "60")
        .env("KILN_DIST_TIMEOUT", "60")
        .env_remove("KILN_TEST_REPORT")
        .env_remove("NCCL_COMM_ID")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK"]
    {
        cmd.env_remove(v);
    }
    if role == "alone" {
        // The simulator would wait 10 minutes for the missing rank: kiln's
        // own timeout (a non-blocking communicator) must end it first.
        cmd.env("KILN_CUDASIM_NCCL_TIMEOUT", "600").env("KILN_DIST_INIT_TIMEOUT", "2");
    }
    if let Some((r, n)) = rank {
        cmd.env("RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
    }
    cmd.spawn().expect("the test binary starts again")
}

/// Waits for every child (killing all of them after `limit`); returns each
/// one's success and output.
fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<(bool, String)> {
    let start = Instant::now();
    let mut children: Vec<Option<Child>> = children.into_iter().map(Some).collect();
    loop {
        let running = children.iter_mut().flatten().filter_map(|c| c.try_wait().ok()).filter(Option::is_none).count();
        if running == 0 {
            break;
        }
        if start.elapsed() > limit {
            for c in children.iter_mut().flatten() {
                let _ = c.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    children
        .iter_mut()
        .map(|c| {
            let out = c.take().expect("a child").wait_with_output().expect("a child's output");
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            (out.status.success() && text.contains("CHILD-OK"), text)
        })
        .collect()
}

/// Runs this child's role (`KILN_TEST_NCCL_ROLE`), failing the child on its
/// error; `CHILD-OK` tells the parent it got through.
fn as_child(role: impl FnOnce(&str) -> Result<()>) -> Ran {
    role(&std::env::var(ROLE).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
    println!("CHILD-OK");
    Ok(())
}

/// A port number of this run (NCCL_COMM_ID names the communicator).
fn port() -> u16 {
    20000 + (std::process::id() % 20000) as u16
}

pub fn two_processes_on_one_cuda_device_each_run_nccl_collectives_and_train_lenet_as_one_process() -> Ran {
    if common::is_child() {
        return as_child(|role| match role {
            "reference" => write_training(None),
            "ranks" => rank_collectives_and_training(),
            other => panic!("no role {other:?}"),
        });
    }
    let d = simulated_cuda()?;
    let dir = scratch("train");
    let reference = wait_all(vec![spawn("reference", None, &dir, 0)], Duration::from_secs(600));
    assert!(reference[0].0, "one process:\n{}", reference[0].1);
    let one = read_numbers(&dir.join("world-1.txt"));
    let ranks =
        wait_all(vec![spawn("ranks", Some((0, 2)), &dir, port()), spawn("ranks", Some((1, 2)), &dir, port())], Duration::from_secs(600));
    for (r, (ok, text)) in ranks.iter().enumerate() {
        assert!(ok, "rank {r} of 2:\n{text}");
    }
    let two = read_numbers(&dir.join("world-2.txt"));
    let (losses, params) = (&two.0, &two.1);
    let (dl, dp) = (max_rel(losses, &one.0), max_rel(params, &one.1));
    println!(
        "2 processes through NCCL: losses {losses:?} (one process {:?}); max relative difference: losses {dl:.2e}, parameters {dp:.2e}",
        one.0
    );
    assert!(dl <= 1e-4, "losses differ by {dl:e}: {losses:?} against {:?}", one.0);
    assert!(dp <= 1e-5, "parameters differ by {dp:e}");
    common::report_ran(d);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

pub fn a_rank_that_exits_or_calls_another_collective_is_named_by_the_other_through_nccl() -> Ran {
    if common::is_child() {
        return as_child(|role| match role {
            "exits" => rank_that_exits(),
            "mismatch" => rank_that_mismatches(),
            other => panic!("no role {other:?}"),
        });
    }
    let d = simulated_cuda()?;
    for role in ["exits", "mismatch"] {
        let dir = scratch(role);
        let start = Instant::now();
        let out = wait_all(
            vec![spawn(role, Some((0, 2)), &dir, port() + 1), spawn(role, Some((1, 2)), &dir, port() + 1)],
            Duration::from_secs(300),
        );
        for (r, (ok, text)) in out.iter().enumerate() {
            assert!(ok, "{role}: rank {r} of 2:\n{text}");
        }
        println!("{role}: both ranks saw the error in {:.1} s", start.elapsed().as_secs_f64());
        let _ = std::fs::remove_dir_all(dir);
    }
    common::report_ran(d);
    Ok(())
}

/// Rank 0 of 2 started alone: its communicator is made without blocking
/// (`ncclCommInitRankConfig`), so `dist::init` fails within kiln's timeout
/// (`KILN_DIST_INIT_TIMEOUT=2`) saying the other rank did not join, instead
/// of hanging in NCCL's bootstrap.
pub fn a_rank_that_never_starts_is_named_within_the_timeout_through_nccl() -> Ran {
    if common::is_child() {
        return as_child(|role| match role {
            "alone" => rank_whose_peer_never_starts(),
            other => panic!("no role {other:?}"),
        });
    }
    let d = simulated_cuda()?;
    let dir = scratch("alone");
    let start = Instant::now();
    let out = wait_all(vec![spawn("alone", Some((0, 2)), &dir, port() + 2)], Duration::from_secs(300));
    assert!(out[0].0, "rank 0 of 2, alone:\n{}", out[0].1);
    if let Some(line) = out[0].1.lines().find(|l| l.contains("saw after")) {
        println!("{line}");
    }
    // A watchdog's bound (the simulator's own wait is 600 s), not a timing.
    assert!(start.elapsed() < Duration::from_secs(200), "{:?}", start.elapsed());
    common::report_ran(d);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

fn rank_whose_peer_never_starts() -> Result<()> {
    let start = Instant::now();
    match dist::init() {
        Err(e) if e.to_string().contains("ncclCommInitRankConfig (rank 0 of 2): the other ranks did not join within 2 s") => {
            println!("rank 0 saw after {:.1} s: {e}", start.elapsed().as_secs_f64());
            Ok(())
        }
        other => Err(fail(format!("rank 0 of 2, alone: {other:?}"))),
    }
}

fn fail(msg: impl Into<String>) -> Error {
    Error::Io { path: "nccl test".into(), msg: msg.into() }
}

fn out_dir() -> PathBuf {
    PathBuf::from(std::env::var("KILN_TEST_NCCL_DIR").expect("KILN_TEST_NCCL_DIR"))
}

fn check(what: &str, got: Vec<f32>, want: Vec<f32>) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(fail(format!("{what}: got {got:?}, want {want:?}")))
    }
}

/// Rank r's collectives (values worked out by hand), then the training.
fn rank_collectives_and_training() -> Result<()> {
    let g = dist::init()?;
    let (r, dev) = (g.rank(), g.device());
    if g.engine() != "nccl" || g.size() != 2 || !common::is_cuda(dev) {
        return Err(fail(format!("rank {r}: engine {}, size {}, device {dev}", g.engine(), g.size())));
    }
    let x = Tensor::new(&[1f32 + r as f32, 10. * (r as f32 + 1.), -3.], &dev)?;
    let before = kiln::thread_transfer_stats();
    let sum = g.all_reduce(&x, ReduceOp::Sum)?;
    let mean = g.all_reduce(&x, ReduceOp::Mean)?;
    let gathered = g.all_gather(&x)?;
    let root1 = g.broadcast(&x, 1)?;
    let pieces = g.reduce_scatter(&Tensor::new(&[1f32, 2., 3., 4.], &dev)?.mul_scalar(r as f64 + 1.)?, ReduceOp::Sum)?;
    let moved = kiln::thread_transfer_stats().since(&before).total().count;
    // Through NCCL on the device: only the upload of the reduce-scatter's input crossed the host.
    if moved != 1 {
        return Err(fail(format!("rank {r}: {moved} transfers for the collectives (1 expected: the upload)")));
    }
    check("all_reduce sum", sum.to_vec()?, vec![3., 30., -6.])?;
    check("all_reduce mean", mean.to_vec()?, vec![1.5, 15., -3.])?;
    check("all_gather", gathered.to_vec()?, vec![1., 10., -3., 2., 20., -3.])?;
    check("broadcast from 1", root1.to_vec()?, vec![2., 20., -3.])?;
    check("reduce_scatter", pieces.to_vec()?, if r == 0 { vec![3., 6.] } else { vec![9., 12.] })?;
    let inplace = Tensor::new(&[r as f32, 1.], &dev)?;
    g.all_reduce_(&inplace, ReduceOp::Sum)?;
    check("all_reduce_ in place", inplace.to_vec()?, vec![1., 2.])?;
    let ints = g.all_reduce(&Tensor::new(&[i64::MAX - 1 + r as i64, 5], &dev)?, ReduceOp::Sum)?;
    if ints.to_vec::<i64>()? != vec![(i64::MAX - 1).wrapping_add(i64::MAX), 10] {
        return Err(fail(format!("i64 sum wraps: {:?}", ints.to_vec::<i64>()?)));
    }
    g.barrier()?;
    // A tensor in host memory has no path here (no MPI): an error that says what to do.
    match g.all_reduce(&Tensor::new(&[1f32], &cpu())?, ReduceOp::Sum) {
        Err(Error::Distributed { msg, .. }) if msg.contains("mpirun") => {}
        other => return Err(fail(format!("a CPU tensor under torchrun variables: {other:?}"))),
    }
    write_training(Some(g))
}

/// LeNet on 128 random images (batches of 32, shuffled, with validation)
/// on this process's CUDA device, alone or on `group`; rank 0 (or the one
/// process) writes the losses and parameters.
fn write_training(group: Option<dist::Group>) -> Result<()> {
    kiln::manual_seed(11);
    let n = 128;
    let x = Tensor::randn((n, 1, 28, 28), &cpu())?;
    let y = Tensor::rand(n, &cpu())?.mul_scalar(9.99)?.to_dtype(DType::I64)?;
    let train = DataLoader::new(vec![x.narrow(0, 0, 96)?, y.narrow(0, 0, 96)?], 32)?.shuffle(true);
    let val = DataLoader::new(vec![x.narrow(0, 96, 32)?, y.narrow(0, 96, 32)?], 32)?;
    let data = DataModule { train, val: Some(val) };
    let mut learner =
        Learner::new(kiln::models::lenet(10), Loss::CrossEntropy, OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, weight_decay: 0.0 });
    let mut builder = Trainer::builder().max_epochs(2).progress(Progress::Off);
    let size = group.as_ref().map(|g| g.size()).unwrap_or(1);
    let main = group.as_ref().is_none_or(|g| g.is_main());
    builder = match group {
        Some(g) => builder.process_group(g),
        None => builder.device(kiln::gpu(0)),
    };
    let history = builder.build()?.fit(&mut learner, &data)?;
    if main {
        let mut params = Vec::new();
        for p in learner.net.parameters() {
            if !common::is_cuda(p.device()) {
                return Err(fail(format!("a parameter trained on {}", p.device())));
            }
            params.extend(p.to_vec_f64()?);
        }
        let line = |v: &[f64]| v.iter().map(|x| format!("{x:e}")).collect::<Vec<_>>().join(" ");
        let text = format!("{}\n{}\n", line(&history.train_losses()), line(&params));
        std::fs::write(out_dir().join(format!("world-{size}.txt")), text).map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}

fn read_numbers(path: &Path) -> (Vec<f64>, Vec<f64>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines().map(|l| l.split_whitespace().map(|v| v.parse::<f64>().expect("a number")).collect::<Vec<_>>());
    (lines.next().expect("losses"), lines.next().expect("parameters"))
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().chain(b).fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / scale).fold(0.0, f64::max)
}

/// Rank 1 exits after joining; rank 0's next collective is an error naming it.
fn rank_that_exits() -> Result<()> {
    let g = dist::init()?;
    // Both ranks are past the bootstrap and one collective; then one leaves.
    g.barrier()?;
    if g.rank() == 1 {
        println!("CHILD-OK");
        std::process::exit(0);
    }
    let x = Tensor::new(&[1f32, 2.], &g.device())?;
    match g.all_reduce(&x, ReduceOp::Sum) {
        Err(e) if e.to_string().contains("rank 1") => {
            println!("rank 0 saw: {e}");
            Ok(())
        }
        other => Err(fail(format!("rank 0 after rank 1 exited: {other:?}"))),
    }
}

/// The ranks all-reduce different lengths: an error on both.
fn rank_that_mismatches() -> Result<()> {
    let g = dist::init()?;
    let x = Tensor::zeros(4 + g.rank(), DType::F32, &g.device())?;
    match g.all_reduce(&x, ReduceOp::Sum) {
        Err(e) if e.to_string().contains("different collectives") => {
            println!("rank {} saw: {e}", g.rank());
            Ok(())
        }
        other => Err(fail(format!("rank {} with mismatched calls: {other:?}", g.rank()))),
    }
}
