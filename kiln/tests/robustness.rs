//! Robustness under bad input, faults and load: one test per class of defect
//! found by the robustness review (deadlocks, aborts, hangs, wrapped sizes,
//! swallowed kernel failures, accounting underflow, spurious out-of-memory,
//! an unbounded queue, checkpoint leftovers, unbounded settings).
//!
//! Tests that could hang run under a watchdog that fails them, naming what
//! hung, instead of stalling the suite. Every test of this binary takes one
//! lock, so the CPU's memory figures are exact.

#[macro_use]
mod common;

use common::{serial, within};
use kiln::{cpu, memory_stats, synchronize, DType, Device, Error, Tensor};
use std::time::Duration;

fn main() -> std::process::ExitCode {
    if let Ok(dir) = std::env::var("KILN_TEST_SAVE_LOOP_DIR") {
        save_loop_child(&dir);
    }
    common::run_suite(trials![
        opposite_assigns_on_two_threads_do_not_deadlock,
        printing_an_empty_tensor_with_a_huge_dimension_does_not_abort,
        empty_matmul_with_a_huge_batch_is_empty_not_an_abort,
        reading_more_than_the_host_can_hold_is_out_of_memory,
        kernels_skip_empty_tensors_however_large_their_other_dimensions,
        size_arithmetic_never_wraps,
        index_add_in_half_precision_adds_on_every_device,
        a_failed_kernel_is_reported_on_the_cpu_at_once,
        a_failed_kernel_on_a_simulated_gpu_is_reported_at_the_next_synchronising_call,
        a_refused_allocation_books_nothing,
        memory_freed_by_queued_work_is_reused_instead_of_out_of_memory,
        the_launch_queue_is_bounded,
        assigning_into_a_broadcast_view_is_refused,
        from_vec_with_the_wrong_length_says_so,
        too_many_simulated_gpus_is_an_error,
        a_save_removes_the_temporary_files_of_killed_saves,
        a_header_naming_a_tensor_twice_is_refused,
        kills_mid_save_leave_no_torn_file_and_no_leftovers,
        a_gzipped_idx_file_that_inflates_past_its_header_is_refused,
        report_lines_from_many_threads_arrive_whole,
    ])
}

/// Simulated GPUs this binary owns: slot 0 is small, for memory tests.
fn own(slot: usize) -> Device {
    common::own_sims(4, 64 << 20)[slot]
}

fn opposite_assigns_on_two_threads_do_not_deadlock() {
    let _s = serial();
    for device in [cpu(), own(1)] {
        let a = Tensor::zeros(64, DType::F32, &device).unwrap();
        let b = Tensor::ones(64, DType::F32, &device).unwrap();
        let (a2, b2) = (a.clone(), b.clone());
        within(60, "a.assign(&b) beside b.assign(&a)", move || {
            let t = std::thread::spawn(move || {
                for _ in 0..20_000 {
                    a2.assign(&b2).unwrap();
                }
            });
            for _ in 0..20_000 {
                b.assign(&a).unwrap();
            }
            t.join().unwrap();
            synchronize(&device).unwrap();
            // Both now hold one of the two original values everywhere.
            let (va, vb) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            assert!(va.iter().all(|&x| x == va[0]) && vb.iter().all(|&x| x == vb[0]), "{va:?} {vb:?}");
        });
    }
}

fn printing_an_empty_tensor_with_a_huge_dimension_does_not_abort() {
    let _s = serial();
    let t = Tensor::zeros([1usize << 40, 0], DType::F32, &cpu()).unwrap();
    assert_eq!(t.to_string(), "tensor([], size=(1099511627776, 0))");
    let g = Tensor::zeros([0usize], DType::F64, &own(1)).unwrap();
    assert_eq!(g.to_string(), format!("tensor([], device={}, dtype=f64)", own(1)));
}

fn empty_matmul_with_a_huge_batch_is_empty_not_an_abort() {
    let _s = serial();
    for device in [cpu(), own(1)] {
        let a = Tensor::zeros([1usize << 40, 0, 3], DType::F32, &device).unwrap();
        let b = Tensor::zeros([3, 2], DType::F32, &device).unwrap();
        let c = within(30, "empty batched matmul", move || a.matmul(&b).map(|c| c.dims().to_vec()));
        assert_eq!(c.unwrap(), vec![1usize << 40, 0, 2]);
    }
}

fn reading_more_than_the_host_can_hold_is_out_of_memory() {
    let _s = serial();
    for device in [cpu(), own(1)] {
        // 4 TiB of f32 to read back: one element broadcast.
        let huge = Tensor::ones(1, DType::F32, &device).unwrap().broadcast_to([1usize << 40]).unwrap();
        match huge.to_vec::<f32>() {
            Err(Error::OutOfMemory { device: d, requested, .. }) => {
                assert_eq!(d, cpu(), "host memory ran out");
                assert_eq!(requested, 4usize << 40);
            }
            other => panic!("expected OutOfMemory on the host, got {other:?}"),
        }
    }
}

fn kernels_skip_empty_tensors_however_large_their_other_dimensions() {
    let _s = serial();
    for device in [cpu(), own(1)] {
        let ids = Tensor::from_vec(vec![0i64, 2, 1], 3, &device).unwrap();
        let x = Tensor::zeros([1usize << 40, 3, 0], DType::F32, &device).unwrap();
        let (dims, after) = within(30, "index_select on an empty tensor", move || {
            let y = x.index_select(&ids, 1).unwrap();
            let dims = y.dims().to_vec();
            // The device still answers.
            let after = Tensor::ones(2, DType::F32, &device).unwrap().to_vec::<f32>().unwrap();
            (dims, after)
        });
        assert_eq!(dims, vec![1usize << 40, 3, 0]);
        assert_eq!(after, vec![1.0, 1.0]);
    }
}

fn size_arithmetic_never_wraps() {
    let _s = serial();
    let d = cpu();
    // narrow of an empty tensor whose strides overflow.
    let t = Tensor::zeros([0, 8, 1usize << 63, 3], DType::F32, &d).unwrap();
    let n = t.narrow(1, 4, 4).unwrap();
    assert_eq!(n.dims(), &[0, 4, 1usize << 63, 3]);
    assert_eq!(n.to_vec::<f32>().unwrap(), Vec::<f32>::new());
    // cat of those.
    let c = Tensor::cat(&[&t, &t], 1).unwrap();
    assert_eq!(c.dims(), &[0, 16, 1usize << 63, 3]);
    assert_eq!(c.to_vec::<f32>().unwrap(), Vec::<f32>::new());
    // to_vec2 of many empty rows: out of memory, not a panic.
    let rows = Tensor::zeros([usize::MAX, 0], DType::F32, &d).unwrap();
    assert!(matches!(rows.to_vec2::<f32>(), Err(Error::OutOfMemory { .. })));
    // A broadcast whose element count does not fit in usize.
    let r = Tensor::ones(1, DType::F32, &d).unwrap().broadcast_to([1usize << 33, 1usize << 33]);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    // cat whose joined dimension overflows.
    let e = Tensor::zeros([0, usize::MAX], DType::F32, &d).unwrap();
    let r = Tensor::cat(&[&e, &e], 1);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    // flatten_from whose merged size overflows.
    let f = Tensor::zeros([0, 1usize << 40, 1usize << 40], DType::F32, &d).unwrap();
    assert!(matches!(f.flatten_from(1), Err(Error::InvalidArgument { .. })));
    assert_eq!(f.flatten_from(0).unwrap().dims(), &[0]);
    // Creation with an element count that does not fit.
    assert!(matches!(Tensor::zeros([1usize << 40, 1usize << 40], DType::U8, &d), Err(Error::InvalidArgument { .. })));
}

fn index_add_in_half_precision_adds_on_every_device() {
    let _s = serial();
    for device in [cpu(), own(1)] {
        for dtype in [DType::F16, DType::BF16] {
            let x = Tensor::from_vec(vec![1f32, 2., 3., 4.], (2, 2), &device).unwrap().to_dtype(dtype).unwrap();
            let src = Tensor::from_vec(vec![10f32, 20., 30., 40.], (2, 2), &device).unwrap().to_dtype(dtype).unwrap();
            let ids = Tensor::from_vec(vec![1i64, 1], 2, &device).unwrap();
            let y = x.index_add(&ids, &src, 0).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(y.to_vec::<f32>().unwrap(), vec![1., 2., 43., 64.], "{dtype} on {device}");
        }
    }
}

fn a_failed_kernel_is_reported_on_the_cpu_at_once() {
    let _s = serial();
    let x = Tensor::ones(4, DType::F32, &cpu()).unwrap();
    kiln::inject_kernel_failure(&cpu());
    match x.exp() {
        Err(Error::KernelFailed { device, op, .. }) => assert_eq!((device, op.as_str()), (cpu(), "exp")),
        other => panic!("expected KernelFailed, got {other:?}"),
    }
    assert_eq!(x.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0; 4]);
}

fn a_failed_kernel_on_a_simulated_gpu_is_reported_at_the_next_synchronising_call() {
    let _s = serial();
    let g = own(2);
    let x = Tensor::ones(4, DType::F32, &g).unwrap();
    synchronize(&g).unwrap();
    kiln::inject_kernel_failure(&g);
    // Asynchronous: the launch itself succeeds.
    let y = x.exp().unwrap();
    match synchronize(&g) {
        Err(Error::KernelFailed { device, op, .. }) => assert_eq!((device, op.as_str()), (g, "exp")),
        other => panic!("expected KernelFailed from synchronize, got {other:?}"),
    }
    drop(y);
    // Reported once; the device then works again.
    synchronize(&g).unwrap();
    assert_eq!(x.mul_scalar(3.0).unwrap().to_vec::<f32>().unwrap(), vec![3.0; 4]);

    // A read is a synchronising call too, and work queued after the failure
    // is skipped until it is reported.
    kiln::inject_kernel_failure(&g);
    let y = x.exp().unwrap();
    let z = y.add_scalar(1.0);
    let read = match z {
        Ok(z) => z.to_vec::<f32>(),
        Err(e) => Err(e),
    };
    assert!(matches!(read, Err(Error::KernelFailed { .. })), "{read:?}");
    synchronize(&g).unwrap();
    assert_eq!(x.add_scalar(1.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0; 4]);
}

fn a_refused_allocation_books_nothing() {
    let _s = serial();
    let keep = Tensor::zeros(5, DType::U8, &cpu()).unwrap();
    let before = memory_stats(&cpu()).unwrap();
    for len in [usize::MAX - 1, usize::MAX / 2, isize::MAX as usize] {
        assert!(matches!(Tensor::zeros(len, DType::U8, &cpu()), Err(Error::OutOfMemory { .. })));
        let now = memory_stats(&cpu()).unwrap();
        assert_eq!((now.in_use, now.live_tensors), (before.in_use, before.live_tensors), "after refusing {len} bytes");
    }
    drop(keep);
    let after = memory_stats(&cpu()).unwrap();
    assert_eq!(after.in_use, before.in_use - 5);
}

fn memory_freed_by_queued_work_is_reused_instead_of_out_of_memory() {
    let _s = serial();
    let g = own(0); // 64 MiB
    let base = memory_stats(&g).unwrap().in_use;
    for round in 0..5 {
        {
            let a = Tensor::rand((1024, 1024), &g).unwrap(); // 4 MiB
            let mut outs = Vec::new();
            for _ in 0..12 {
                outs.push(a.matmul(&a).unwrap()); // 4 MiB each, queued
            }
            // Every tensor is dropped while their kernels may still run.
        }
        // Nearly the whole device: fits only once the queued kernels let go.
        let big = Tensor::zeros((64 << 20) - base - 1024, DType::U8, &g);
        assert!(big.is_ok(), "round {round}: {:?}", big.err());
    }
}

fn the_launch_queue_is_bounded() {
    let _s = serial();
    let g = own(3);
    let x = Tensor::ones(1, DType::F32, &g).unwrap();
    let hold = kiln::hold_queue(&g).unwrap().expect("a simulated GPU's queue can be held");
    let launched = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (l2, x2) = (launched.clone(), x.clone());
    let t = std::thread::spawn(move || {
        for _ in 0..5000 {
            x2.assign(&x2.add_scalar(0.0).unwrap()).unwrap();
            l2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    // While the queue is held, the launching thread must block once the
    // queue is full (two kernels per iteration).
    std::thread::sleep(Duration::from_millis(500));
    let queued = launched.load(std::sync::atomic::Ordering::SeqCst);
    assert!(queued * 2 <= 1024 + 2, "{queued} iterations launched against a held queue of depth 1024");
    drop(hold);
    within(60, "the launching thread after the hold", move || t.join().unwrap());
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0]);
}

fn assigning_into_a_broadcast_view_is_refused() {
    let _s = serial();
    let base = Tensor::zeros((1, 3), DType::F32, &cpu()).unwrap();
    let view = base.broadcast_to((4, 3)).unwrap();
    let src = Tensor::rand((4, 3), &cpu()).unwrap();
    assert!(matches!(view.assign(&src), Err(Error::InvalidArgument { .. })));
    assert_eq!(base.to_vec::<f32>().unwrap(), vec![0.0; 3]);
}

fn from_vec_with_the_wrong_length_says_so() {
    let _s = serial();
    let err = Tensor::from_vec(vec![1f32; 5], (2, 3), &cpu()).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }));
    let msg = err.to_string();
    assert!(msg.contains("[5]") && msg.contains("element count") && !msg.contains("broadcast"), "{msg}");
}

fn too_many_simulated_gpus_is_an_error() {
    let _s = serial();
    assert!(matches!(kiln::try_ensure_simulated_gpus(100_000, 1 << 20), Err(Error::InvalidArgument { .. })));
    assert!(kiln::ensure_simulated_gpus(100_000, 1 << 20).len() <= kiln::MAX_SIM_GPUS);
}

// ---- checkpoints ------------------------------------------------------

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-robust-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tensors(seed: f32) -> Vec<(String, Tensor)> {
    vec![
        ("w".to_string(), Tensor::full(seed as f64, (256, 256), DType::F32, &cpu()).unwrap()),
        ("b".to_string(), Tensor::full(seed as f64, 256, DType::F32, &cpu()).unwrap()),
    ]
}

fn a_save_removes_the_temporary_files_of_killed_saves() {
    let _s = serial();
    let dir = scratch("leftovers");
    let path = dir.join("model.safetensors");
    // A dead process's leftover, and one of a live process (pid 1).
    let dead = dir.join("model.safetensors.999999999.tmp");
    let live = dir.join("model.safetensors.1.tmp");
    std::fs::write(&dead, b"partial").unwrap();
    std::fs::write(&live, b"in progress").unwrap();
    kiln::checkpoint::save_tensors(&tensors(1.0), &path).unwrap();
    assert!(!dead.exists(), "the dead save's temporary file is still there");
    assert!(live.exists(), "a live process's save was disturbed");
    let _ = std::fs::remove_dir_all(&dir);
}

fn a_header_naming_a_tensor_twice_is_refused() {
    let _s = serial();
    let dir = scratch("dup");
    let path = dir.join("dup.safetensors");
    let header = br#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 8]);
    std::fs::write(&path, &bytes).unwrap();
    match kiln::checkpoint::load_tensors(&path, &cpu()) {
        Err(Error::Format { msg, .. }) => assert!(msg.contains("`w` twice"), "{msg}"),
        other => panic!("expected a Format error, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The child of `kills_mid_save_leave_no_torn_file_and_no_leftovers`: this
/// binary run with `KILN_TEST_SAVE_LOOP_DIR` set saves there in a loop until
/// killed (it is not a test).
fn save_loop_child(dir: &str) -> ! {
    let path = std::path::Path::new(dir).join("model.safetensors");
    let mut i = 0f32;
    loop {
        kiln::checkpoint::save_tensors(&tensors(i), &path).unwrap();
        i += 1.0;
    }
}

fn kills_mid_save_leave_no_torn_file_and_no_leftovers() {
    let _s = serial();
    let dir = scratch("kills");
    let path = dir.join("model.safetensors");
    let exe = std::env::current_exe().unwrap();
    let kills: u64 = std::env::var("KILN_TEST_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let mut rng = 0x1234_5678u64;
    let (mut mid_save, mut whole) = (0, 0);
    for k in 0..kills {
        let mut child = std::process::Command::new(&exe)
            .env("KILN_TEST_SAVE_LOOP_DIR", &dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        std::thread::sleep(Duration::from_millis(150 + (rng >> 33) % 200));
        child.kill().unwrap();
        child.wait().unwrap();
        // A temporary file left behind: this kill landed in a save.
        if std::fs::read_dir(&dir).unwrap().flatten().any(|e| e.file_name().to_string_lossy().ends_with(".tmp")) {
            mid_save += 1;
        }
        if path.exists() {
            whole += 1;
            // Whatever was in place is a whole checkpoint with one value.
            let loaded = kiln::checkpoint::load_tensors(&path, &cpu()).unwrap_or_else(|e| panic!("kill {k}: torn checkpoint: {e}"));
            let w = loaded.iter().find(|(n, _)| n == "w").unwrap().1.to_vec::<f32>().unwrap();
            assert!(w.iter().all(|&x| x == w[0]), "kill {k}: a mixed checkpoint");
        }
    }
    kiln::checkpoint::save_tensors(&tensors(-1.0), &path).unwrap();
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).filter(|n| n != "model.safetensors").collect();
    assert!(left.is_empty(), "left behind after {kills} kills and a save: {left:?}");
    println!(
        "kills: {kills}; {mid_save} left a temporary file (killed mid-save); {whole} found a whole checkpoint in place; none left after the next save"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn a_gzipped_idx_file_that_inflates_past_its_header_is_refused() {
    let _s = serial();
    use std::io::Write;
    let dir = scratch("idx");
    let path = dir.join("bomb.gz");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&[0, 0, 8, 1, 0, 0, 0, 10]).unwrap();
    gz.write_all(&vec![0u8; 64 << 20]).unwrap();
    std::fs::write(&path, gz.finish().unwrap()).unwrap();
    match kiln::data::read_idx(&path) {
        Err(Error::Format { msg, .. }) => assert!(msg.contains("inflates past"), "{msg}"),
        other => panic!("expected a Format error, got {:?}", other.map(|a| a.dims)),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// CI counts the tests that ran on CUDA devices from lines that tests on
/// many threads append to one report file (`KILN_TEST_REPORT`): each line
/// must arrive whole. Written with `writeln!`, text and newline went out in
/// two calls, and two tests' lines sometimes merged into one.
fn report_lines_from_many_threads_arrive_whole() {
    let path = std::env::temp_dir().join(format!("kiln-report-lines-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    std::thread::scope(|s| {
        for t in 0..8 {
            let path = &path;
            s.spawn(move || {
                for i in 0..400 {
                    common::append_line(path, &format!("RAN-CUDA gpu({t}) test_{i:04}_with_a_name_of_some_length suite"));
                }
            });
        }
    });
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 8 * 400);
    let distinct: std::collections::HashSet<&str> = lines.iter().copied().collect();
    assert_eq!(distinct.len(), 8 * 400);
    assert!(lines.iter().all(|l| l.starts_with("RAN-CUDA gpu(") && l.ends_with(" suite") && l.matches("RAN-CUDA").count() == 1));
}
