//! Runs the built `kiln` binary as a process and checks what it prints.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("KILN_SIM_GPUS")
        .env_remove("KILN_BENCH_QUICK")
        // What these tests expect counts kiln's simulated GPUs only: no CUDA
        // device of the machine (or of scripts/cudasim.sh) may add rows.
        .env("KILN_DISABLE_CUDA", "1")
        .output()
        .expect("the kiln binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-cli-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Checks the PNG signature and returns the width and height from the IHDR chunk.
fn png_size(path: &std::path::Path) -> (u32, u32) {
    let bytes = std::fs::read(path).expect("the PNG exists");
    assert!(bytes.len() > 33, "PNG too short: {} bytes", bytes.len());
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR", "first chunk is IHDR");
    let be = |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    assert_eq!(be(8), 13, "IHDR length");
    assert!(bytes.ends_with(&[0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82]), "ends with IEND");
    (be(16), be(20))
}

/// A bad invocation: non-zero exit, exactly one line on stderr starting with `kiln:`, no panic.
fn assert_one_line_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line on stderr, got: {err:?}");
    assert!(err.starts_with("kiln: "), "stderr starts with `kiln: `: {err:?}");
    assert!(err.contains(needle), "stderr mentions {needle:?}: {err:?}");
    assert!(!err.contains("panicked") && !err.contains("backtrace") && !err.contains("internal error"), "{err}");
}

#[test]
fn tour_walks_through_the_chapter() {
    for args in [&[][..], &["tour"][..]] {
        let o = kiln(args);
        let out = stdout(&o);
        assert!(o.status.success(), "tour failed: {}", stderr(&o));
        for needle in [
            "== 1. Computing devices ==",
            "cpu() = cpu, gpu(0) = gpu(0), gpu(1) = gpu(1)",
            "num_gpus() = 0",
            "try_gpu(0) = cpu, try_gpu(10) = cpu, try_all_gpus() = [cpu]",
            "try_gpu(10) fell back to the CPU because",
            "x.device() = cpu",
            "ensure_simulated_gpus(2, ...)",
            "num_gpus() = 2",
            "device=gpu(0))",
            "device=gpu(1))",
            "add: operands are on different devices, gpu(0) and gpu(1)",
            "Y + Z = tensor(",
            "Z.to(&gpu(1))?.same_storage(&Z) = true",
            "Z.copy_to(&gpu(1))?.same_storage(&Z) = false",
            "transfers: ",
            "device-to-device gpu(0) -> gpu(1): 1 (24 B)",
            "net[0].weight is on gpu(0)",
            "input is on cpu while layer 0 weight is on gpu(0)",
            "gpus = [gpu(0)]",
            "read the losses device-to-host 3 times (once per epoch)",
        ] {
            assert!(out.contains(needle), "tour output lacks {needle:?}:\n{out}");
        }
        // The steps come in the chapter's order.
        let pos = |s: &str| out.find(s).unwrap_or(usize::MAX);
        assert!(pos("Computing devices") < pos("try_gpu(10)"));
        assert!(pos("try_gpu(10)") < pos("x.device()"));
        assert!(pos("x.device()") < pos("different devices"));
        assert!(pos("different devices") < pos("Y + Z"));
        assert!(pos("Y + Z") < pos("net[0].weight"));
        assert!(pos("net[0].weight") < pos("gpus = [gpu(0)]"));
        assert!(pos("gpus = [gpu(0)]") < pos("transfers: "));
    }
}

/// The chapter, item 6 of issue 10: with one simulated GPU from the
/// environment, the tour adds one more and says so (not "gpu(0), gpu(1)").
#[test]
fn tour_with_one_simulated_gpu_says_it_adds_one() {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("tour")
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("KILN_BENCH_QUICK")
        .env("KILN_SIM_GPUS", "1")
        // No real GPU, so that the count below is the simulated one's.
        .env("KILN_DISABLE_CUDA", "1")
        .output()
        .expect("the kiln binary runs");
    let out = stdout(&o);
    assert!(o.status.success(), "tour failed: {}", stderr(&o));
    for needle in [
        "num_gpus() = 1",
        "This machine has 1 GPU(s); the tour adds a simulated GPU (gpu(1)) with kiln::ensure_simulated_gpus(2, ...)",
        "num_gpus() = 2",
        "add: operands are on different devices, gpu(0) and gpu(1)",
    ] {
        assert!(out.contains(needle), "tour output lacks {needle:?}:\n{out}");
    }
    assert!(!out.contains("simulated GPUs (gpu(0), gpu(1))"), "{out}");
    assert!(!stderr(&o).contains("kiln: ignoring"), "{}", stderr(&o));
}

#[test]
fn devices_json_lists_the_cpu_and_simulated_gpus() {
    let o = kiln(&["devices", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).expect("devices --json is JSON");
    let list = v.as_array().expect("an array");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["device"], "cpu");
    assert_eq!(list[0]["kind"], "cpu");
    assert!(list[0]["memory_in_use"].is_u64());
    assert!(list[0]["memory_total"].as_u64().unwrap_or(0) > 0);

    let o = kiln(&["--sim-gpus", "2", "devices", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).expect("JSON");
    let list = v.as_array().expect("an array");
    let names: Vec<&str> = list.iter().filter_map(|d| d["device"].as_str()).collect();
    assert_eq!(names, ["cpu", "gpu(0)", "gpu(1)"]);
    for (i, d) in list[1..].iter().enumerate() {
        assert_eq!(d["kind"], "simulated");
        assert_eq!(d["index"], i);
        assert_eq!(d["memory_total"], 2u64 << 30);
        assert_eq!(d["memory_in_use"], 0);
    }

    let o = kiln(&["--sim-gpus", "1", "devices"]);
    let out = stdout(&o);
    assert!(out.contains("| IDX |") && out.contains("KILN IN USE") && out.contains("simulated"), "{out}");
}

const REQUIRED: [&str; 8] = ["workload", "device", "threads", "median_ms", "min_ms", "max_ms", "rate", "unit"];

fn json_rows(out: &str) -> Vec<Value> {
    out.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .inspect(|row| {
            for key in REQUIRED {
                assert!(row.get(key).is_some(), "row lacks {key}: {row}");
            }
            assert!(row["median_ms"].as_f64().unwrap_or(-1.0) >= 0.0);
            assert!(row["min_ms"].as_f64() <= row["median_ms"].as_f64());
            assert!(row["median_ms"].as_f64() <= row["max_ms"].as_f64());
        })
        .collect()
}

#[test]
fn bench_json_has_the_required_keys_and_counts_transfers() {
    let o = kiln(&["bench", "w2", "W4", "ex3", "async", "--json", "--quick"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = json_rows(&stdout(&o));
    let workloads: Vec<&str> = rows.iter().filter_map(|r| r["workload"].as_str()).collect();
    // In the order asked for.
    assert_eq!(workloads, ["W2", "W4", "Ex3", "Ex3", "Async"]);
    for r in &rows {
        assert_eq!(r["threads"], 1, "RAYON_NUM_THREADS=1 is honoured: {r}");
    }
    assert_eq!(rows[0]["unit"], "ms");
    assert_eq!(rows[0]["device"], "cpu");
    assert_eq!(rows[1]["unit"], "us/op");
    // Ex3: logging every step reads each norm (one transfer per step), the on-device log reads once.
    assert_eq!(rows[2]["device"], "gpu(0)");
    assert_eq!(rows[2]["transfers"], 100);
    assert_eq!(rows[2]["transfer_bytes"], 400);
    assert_eq!(rows[3]["transfers"], 1);
    assert_eq!(rows[3]["transfer_bytes"], 400);
    assert_eq!(rows[4]["device"], "gpu(0)");
    assert_eq!(rows[4]["unit"], "us/op");
}

#[test]
fn bench_overhead_prints_a_row_per_op_kind() {
    let o = kiln(&["bench", "Overhead", "--quick", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = json_rows(&stdout(&o));
    let ops: Vec<&str> = rows.iter().filter_map(|r| r["op"].as_str()).collect();
    assert_eq!(
        ops,
        ["unary", "binary_broadcast", "reduction", "matmul_4x4", "to_same_device", "to_cpu_to_gpu", "to_gpu_to_cpu"],
        "{}",
        stdout(&o)
    );
    for r in &rows {
        for key in [
            "workload",
            "variant",
            "device",
            "threads",
            "median_ms",
            "min_ms",
            "max_ms",
            "runs",
            "rate",
            "unit",
            "op",
            "ns_per_op",
            "iters",
        ] {
            assert!(r.get(key).is_some(), "{key} missing: {r}");
        }
        assert_eq!(r["workload"], "Overhead");
        assert_eq!(r["threads"], 1);
        assert_eq!(r["unit"], "ns/op");
        assert_eq!(r["iters"], 1000);
        let ns = r["ns_per_op"].as_f64().unwrap_or(-1.0);
        assert!(ns > 0.0, "{r}");
        // ns per op is the loop's median over its iterations.
        let from_median = r["median_ms"].as_f64().unwrap_or(0.0) * 1e6 / 1000.0;
        assert!((ns - from_median).abs() <= 0.01 + 1e-6 * from_median, "{r}");
    }
    let device = |op: &str| rows.iter().find(|r| r["op"] == op).map(|r| r["device"].as_str().unwrap_or("").to_string());
    assert_eq!(device("unary").as_deref(), Some("cpu"));
    assert_eq!(device("to_cpu_to_gpu").as_deref(), Some("gpu(0)"));
}

#[test]
fn bench_ex2_saves_and_loads_on_every_device() {
    let o = kiln(&["bench", "Ex2", "--json", "--quick"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = json_rows(&stdout(&o));
    let got: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["device"].as_str().unwrap_or("").to_string(),
                r["variant"].as_str().unwrap_or("").split(' ').next().unwrap_or("").to_string(),
            )
        })
        .collect();
    let want = [("cpu", "save"), ("cpu", "load"), ("gpu(0)", "save"), ("gpu(0)", "load")];
    assert_eq!(got, want.map(|(a, b)| (a.to_string(), b.to_string())));
    // MLP 784-64-64-10 in f32: 55,050 parameters, plus the safetensors header.
    for r in &rows {
        assert_eq!(r["parameters"], 55050);
        assert!(r["bytes"].as_u64().unwrap_or(0) > 55050 * 4, "{r}");
        assert_eq!(r["unit"], "MB/s");
    }
}

#[test]
fn bench_table_and_async_devices() {
    let o = kiln(&["bench", "W1", "ex4", "--quick"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("| WORKLOAD |") && out.contains("GFLOP/s"), "{out}");
    assert!(out.contains("gpu(0)+gpu(1)"), "{out}");
    assert!(out.contains("speedup"), "{out}");
}

#[test]
fn bench_ex1_writes_a_png_plot() {
    let dir = scratch("ex1");
    let png = dir.join("ex1.png");
    let o = kiln(&["bench", "Ex1", "--quick", "--json", "--plot", png.to_str().expect("utf-8 path")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = json_rows(&stdout(&o));
    // Sizes 16..128 on the CPU and on the (simulated) GPU.
    assert_eq!(rows.len(), 8);
    assert!(rows.iter().all(|r| r["unit"] == "GFLOP/s" && r["size"].is_u64()));
    assert!(rows.iter().filter(|r| r["device"] == "gpu(0)").all(|r| r.get("gpu_wins_from").is_some()));
    assert_eq!(png_size(&png), (900, 600));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_arguments_give_one_line_and_a_nonzero_exit() {
    assert_one_line_error(&kiln(&["bench", "W9"]), "unknown workload `W9`");
    assert_one_line_error(&kiln(&["bench", "W4", "--device", "gpu(3)"]), "gpu(3) does not exist");
    assert_one_line_error(&kiln(&["bench", "W4", "--device", "tpu"]), "`tpu` is not a device");
    assert_one_line_error(&kiln(&["bench", "Ex1", "--plot", "/nonexistent-dir/x/plot.png"]), "cannot write the plot");
    assert_one_line_error(&kiln(&["frobnicate"]), "unrecognized subcommand");
    assert_one_line_error(&kiln(&["devices", "--jsn"]), "--jsn");
    assert_one_line_error(&kiln(&["train", "--data", "/nonexistent-kiln-data"]), "no such directory");
    assert_one_line_error(&kiln(&["train", "--epochs", "1", "--out", "/proc/kiln-cannot-write"]), "output directory");
    assert_one_line_error(&kiln(&["train", "--resume", "/nonexistent.safetensors", "--out", "/tmp"]), "no such checkpoint");
    assert_one_line_error(&kiln(&["train", "--lr", "-1", "--out", "/tmp"]), "--lr");
}

/// The parameter names of a safetensors file (its JSON header).
fn safetensors_names(path: &std::path::Path) -> Vec<String> {
    let bytes = std::fs::read(path).expect("the checkpoint exists");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("a JSON header");
    let mut names: Vec<String> = header.as_object().expect("an object").keys().filter(|k| *k != "__metadata__").cloned().collect();
    names.sort();
    names
}

#[test]
fn train_writes_a_plot_and_a_checkpoint_and_resumes() {
    let dir = scratch("train");
    let out = dir.join("out");
    let o = kiln(&["--sim-gpus", "1", "train", "--epochs", "2", "--hidden", "16", "--out", out.to_str().expect("utf-8")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("on gpu(0)") && text.contains("VAL ACCURACY"), "{text}");
    assert!(text.contains("2 device-to-host (one read per epoch)"), "{text}");
    assert_eq!(png_size(&out.join("training.png")), (1000, 450));
    let ckpt = out.join("model.safetensors");
    assert_eq!(safetensors_names(&ckpt), ["1.bias", "1.weight", "3.bias", "3.weight"]);

    let o = kiln(&[
        "train",
        "--epochs",
        "1",
        "--hidden",
        "16",
        "--num-gpus",
        "0",
        "--out",
        out.to_str().expect("utf-8"),
        "--resume",
        ckpt.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Resumed from") && stdout(&o).contains("on cpu"), "{}", stdout(&o));

    // The training checkpoint resumes the optimizer and the epoch count too.
    let full = out.join("checkpoint.safetensors");
    let o = kiln(&[
        "train",
        "--epochs",
        "1",
        "--hidden",
        "16",
        "--out",
        out.to_str().expect("utf-8"),
        "--resume",
        full.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("(after epoch 1)"), "{}", stdout(&o));

    // A checkpoint of another shape is refused, naming the tensor.
    let o = kiln(&[
        "train",
        "--epochs",
        "1",
        "--hidden",
        "8",
        "--out",
        out.to_str().expect("utf-8"),
        "--resume",
        ckpt.to_str().expect("utf-8"),
    ]);
    assert_one_line_error(&o, "1.weight");
    let _ = std::fs::remove_dir_all(dir);
}

/// Writes an IDX file: magic (0, 0, 0x08 = u8, rank), big-endian dims, then the bytes.
/// The table's rows without their TIME column.
fn epoch_rows(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with("|") && l.split('|').nth(1).is_some_and(|c| c.trim().parse::<u32>().is_ok()))
        .map(|l| l.split('|').take(5).collect::<Vec<_>>().join("|"))
        .collect()
}

#[test]
fn train_dist_alone_trains_as_one_process_and_launches_it_cannot_serve_are_refused() {
    let dir = scratch("train-dist");
    let (alone, plain) = (dir.join("alone"), dir.join("plain"));
    let args = |out: &std::path::Path| {
        vec!["train".to_string(), "--epochs".into(), "2".into(), "--hidden".into(), "8".into(), "--out".into(), out.display().to_string()]
    };
    let mut with_dist = args(&alone);
    with_dist.push("--dist".into());
    let o = kiln(&with_dist.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("on 1 process(es) (single engine), rank 0 on cpu"), "{text}");
    assert!(alone.join("checkpoint.safetensors").is_file() && alone.join("training.png").is_file());
    let mut on_cpu = args(&plain);
    on_cpu.extend(["--num-gpus".into(), "0".into()]);
    let o = kiln(&on_cpu.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = epoch_rows(&text);
    assert_eq!(rows.len(), 2, "{text}");
    assert_eq!(rows, epoch_rows(&stdout(&o)), "a world of one trains as one process does");
    // --num-gpus says how many devices one process drives; with --dist each
    // process takes one, so the two together are refused, not one ignored.
    let mut both = with_dist.clone();
    both.extend(["--num-gpus".into(), "2".into()]);
    let o = kiln(&both.iter().map(String::as_str).collect::<Vec<_>>());
    assert_one_line_error(&o, "--num-gpus");
    assert!(stderr(&o).contains("--dist"), "{}", stderr(&o));

    // Several ranks under an MPI launcher, with a build that has no MPI
    // engine: refused, not trained alone on all the data by each rank.
    if !cfg!(feature = "mpi") {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(with_dist.iter().map(String::as_str))
            .env("OMPI_COMM_WORLD_RANK", "0")
            .env("OMPI_COMM_WORLD_SIZE", "2")
            .env("OMPI_COMM_WORLD_LOCAL_RANK", "0")
            .env("KILN_DISABLE_CUDA", "1")
            .env_remove("KILN_SIM_GPUS")
            .output()
            .expect("the kiln binary runs");
        assert_one_line_error(&o, "--features mpi");
    }
    // Under a launcher of several ranks, without --dist: refused, as each
    // rank would train alone and write the same files.
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args(&dir.join("each")).iter().map(String::as_str))
        .env("OMPI_COMM_WORLD_RANK", "1")
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_LOCAL_RANK", "1")
        .env("KILN_DISABLE_CUDA", "1")
        .env_remove("KILN_SIM_GPUS")
        .output()
        .expect("the kiln binary runs");
    assert_one_line_error(&o, "add --dist");
    assert!(!dir.join("each").exists(), "nothing was written");
}

fn write_idx(path: &std::path::Path, dims: &[u32], data: &[u8]) {
    let mut bytes = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        bytes.extend_from_slice(&d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).expect("write IDX");
}

#[test]
fn train_reads_fashion_mnist_idx_files() {
    let dir = scratch("fmnist");
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("dir");
    for (prefix, n) in [("train", 64u32), ("t10k", 16)] {
        let pixels: Vec<u8> = (0..n as usize * 784).map(|i| ((i * 7) % 256) as u8).collect();
        let labels: Vec<u8> = (0..n as usize).map(|i| (i % 10) as u8).collect();
        write_idx(&data.join(format!("{prefix}-images-idx3-ubyte")), &[n, 28, 28], &pixels);
        write_idx(&data.join(format!("{prefix}-labels-idx1-ubyte")), &[n], &labels);
    }
    let out = dir.join("out");
    let o = kiln(&[
        "train",
        "--data",
        data.to_str().expect("utf-8"),
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--hidden",
        "8",
        "--out",
        out.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("MLP 784-8-10") && text.contains("Fashion-MNIST") && text.contains("64 training and 16 validation"), "{text}");
    assert!(out.join("model.safetensors").is_file());

    // The book's CNNs on the same files: BN-LeNet on a simulated GPU, its
    // checkpoint (with the running statistics) resumed on the CPU.
    let cnn = dir.join("cnn");
    let args = |extra: &[&str]| {
        let mut v = vec!["train", "--model", "bn-lenet", "--data", data.to_str().expect("utf-8"), "--epochs", "1", "--batch-size", "16"];
        v.extend_from_slice(&["--out", cnn.to_str().expect("utf-8")]);
        v.extend_from_slice(extra);
        v.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let mut first = vec!["--sim-gpus".to_string(), "1".to_string()];
    first.extend(args(&[]));
    let o = kiln(&first.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("LeNet with batch normalisation") && stdout(&o).contains("on gpu(0)"), "{}", stdout(&o));
    let params = cnn.join("model.safetensors");
    assert!(safetensors_names(&params).contains(&"1.running_mean".to_string()), "{:?}", safetensors_names(&params));
    let resumed = args(&["--num-gpus", "0", "--resume", params.to_str().expect("utf-8")]);
    let o = kiln(&resumed.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Resumed from") && stdout(&o).contains("on cpu"), "{}", stdout(&o));

    // A directory without the files: one line naming the missing file.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).expect("dir");
    assert_one_line_error(
        &kiln(&["train", "--data", empty.to_str().expect("utf-8"), "--out", out.to_str().expect("utf-8")]),
        "train-images-idx3-ubyte",
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn simulated_gpu_settings_are_bounded_and_malformed_ones_warn_alike() {
    // Too many on the command line: a usage error, nothing started.
    let o = kiln(&["--sim-gpus", "100000", "devices"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("0..=64"), "{}", stderr(&o));
    assert!(stdout(&o).is_empty());

    // Too many, or malformed, in the environment: one warning line of one
    // form, and no simulated GPU.
    for (var, value) in
        [("KILN_SIM_GPUS", "1000000"), ("KILN_SIM_GPUS", "two"), ("KILN_SIM_GPU_MEMORY", "lots"), ("KILN_SIM_QUEUE_DEPTH", "0")]
    {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["devices", "--json"])
            .env_remove("KILN_SIM_GPUS")
            .env("KILN_SIM_GPUS", "1")
            .env(var, value)
            .output()
            .expect("the kiln binary runs");
        assert!(o.status.success(), "{var}={value}: {}", stderr(&o));
        let err = stderr(&o);
        let warnings: Vec<&str> = err.lines().filter(|l| l.starts_with("kiln: ignoring ")).collect();
        assert_eq!(warnings.len(), 1, "{var}={value}: {err}");
        assert!(warnings[0].starts_with(&format!("kiln: ignoring {var}=\"{value}\": expected ")), "{}", warnings[0]);
        assert!(stdout(&o).lines().count() <= 3, "{var}={value} printed too much");
    }
}

/// Boolean settings warn like every other malformed setting (issue 9, item
/// 11), once, and are read even when the flag they stand for is given.
#[test]
fn a_malformed_boolean_setting_warns_in_the_common_form() {
    for (value, warns) in [("maybe", true), ("2", true), ("yes", false), ("0", false), ("", false)] {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["bench", "Async", "--quick", "--json"])
            .env("RAYON_NUM_THREADS", "1")
            .env_remove("KILN_SIM_GPUS")
            .env("KILN_BENCH_QUICK", value)
            .output()
            .expect("the kiln binary runs");
        assert!(o.status.success(), "KILN_BENCH_QUICK={value:?}: {}", stderr(&o));
        let err = stderr(&o);
        let warnings: Vec<&str> = err.lines().filter(|l| l.starts_with("kiln: ignoring ")).collect();
        if warns {
            assert_eq!(
                warnings,
                [format!("kiln: ignoring KILN_BENCH_QUICK=\"{value}\": expected 1 or 0 (also true/false, yes/no, on/off)")],
                "{err}"
            );
        } else {
            assert!(warnings.is_empty(), "KILN_BENCH_QUICK={value:?}: {err}");
        }
        assert_eq!(json_rows(&stdout(&o)).len(), 1, "KILN_BENCH_QUICK={value:?}: {}", stdout(&o));
    }
}
