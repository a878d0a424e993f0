//! A failed optimizer step changes nothing: parameters, SGD momentum, Adam
//! moments and step counter stay bit-identical when a step runs out of
//! memory part-way (issue 9).
//!
//! No hook inside kiln is needed to fail a step in its middle: the free
//! memory is swept finely (byte steps around the step's peak on a small
//! simulated GPU; page steps of the address space on the CPU, in a child
//! process), so that each allocation of the step is in turn the one that
//! does not fit. The parameters have different sizes (1, 2, 3 units), and an
//! optimizer handles them in order, so the size of the refused allocation
//! (`OutOfMemory::requested`) says which parameter the step had reached: a
//! failure at parameter k came after the new values of parameters 0..k and
//! of their state had been computed, which a step that wrote each parameter
//! as it went would already have changed. `memory_stats` confirms it: the
//! peak since the step began, minus the memory in use when it began, holds
//! at least those new values. After the sweep, the optimizer must equal a
//! reference that took the same successful steps and never failed, and a
//! step with memory back must match the reference's.

use kiln::optim::{Adam, Optimizer, Sgd};
use kiln::{cpu, DType, Device, DeviceKind, Error, Tensor};
use std::fmt::Debug;

/// A simulated GPU only this binary uses, with 1 MiB.
fn small_gpu() -> Device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    *DEV.get_or_init(|| {
        let existing = kiln::devices().iter().filter(|d| d.kind == DeviceKind::Simulated).count();
        kiln::ensure_simulated_gpus(existing + 1, 1 << 20)[existing]
    })
}

/// The tests fill the one small GPU (or the child's address space): one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

fn all_bits(ps: &[Tensor]) -> Vec<Vec<u32>> {
    ps.iter().map(bits).collect()
}

/// `n` parameters of `unit`, `2 unit`, ... elements, with the gradient of
/// `sum(p²)` (= 2p), made from `seed` (the same values on every call).
fn params(dev: Device, n: usize, unit: usize, seed: u64) -> Vec<Tensor> {
    kiln::manual_seed(seed);
    let ps: Vec<Tensor> =
        (0..n).map(|i| Tensor::rand_uniform(-1.0, 1.0, unit * (i + 1), DType::F32, &dev).unwrap().requires_grad_()).collect();
    for p in &ps {
        p.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    }
    ps
}

/// One failed step.
#[derive(Debug)]
struct Failure {
    /// The parameter whose update was being computed (from the size of the
    /// refused allocation), if any.
    at: Option<usize>,
    /// The bytes the step had allocated and still held when it failed: the
    /// peak since it began minus the memory in use when it began.
    held: usize,
}

/// What a sweep saw.
#[derive(Debug, Default)]
struct Sweep {
    /// Steps that succeeded (and were matched by a reference step).
    successes: usize,
    failures: Vec<Failure>,
}

impl Sweep {
    /// How many failures landed in the update of each parameter.
    fn by_parameter(&self, n: usize) -> Vec<usize> {
        (0..n).map(|k| self.failures.iter().filter(|f| f.at == Some(k)).count()).collect()
    }
}

/// How finely to sweep the free memory: up from nothing by `stride` until
/// a step succeeds, then by `fine` over the last stride and one more (where
/// the step's last allocations just fail or just fit). A step that fails
/// with some free memory fails with less: the steps below the first
/// success are the failures, at every depth of the step.
#[derive(Clone, Copy)]
struct Grid {
    stride: usize,
    fine: usize,
}

/// Takes a step with only `free` bytes available for each `free` of the
/// `grid`, up to `limit`; `squeeze(free)` makes that so and returns what
/// undoes it (or `None` to skip that value). Every step that runs out of
/// memory must leave the parameters and `state` bit-identical; every step
/// that succeeds is matched by a step of `reference` with memory to spare.
fn sweep<O: Optimizer, S: PartialEq + Debug, G>(
    dev: Device,
    (grid, limit): (Grid, usize),
    squeeze: impl Fn(usize) -> Option<G>,
    (ps, opt): (&[Tensor], &mut O),
    reference: &mut O,
    state: impl Fn(&O) -> S,
) -> Sweep {
    let sizes: Vec<usize> = ps.iter().map(|p| p.elem_count() * 4).collect();
    let mut seen = Sweep::default();
    let mut step_with = |free: usize| -> bool {
        // Pending kernels hold their temporaries: let them finish first.
        kiln::synchronize(&dev).unwrap();
        kiln::empty_cache(&dev).unwrap();
        let before = (all_bits(ps), state(opt));
        let Some(guard) = squeeze(free) else { return false };
        kiln::reset_peak_memory(&dev).unwrap();
        let start = kiln::memory_stats(&dev).unwrap().in_use;
        let result = opt.step();
        let held = kiln::memory_stats(&dev).unwrap().peak - start;
        drop(guard);
        match result {
            Ok(()) => {
                seen.successes += 1;
                reference.step().unwrap();
                true
            }
            Err(Error::OutOfMemory { device, requested, .. }) => {
                assert_eq!(device, dev);
                let at = sizes.iter().position(|&b| b == requested);
                assert_eq!(
                    (all_bits(ps), state(opt)),
                    before,
                    "a step that failed with {free} bytes free, at parameter {at:?} after allocating {held} bytes, changed something"
                );
                seen.failures.push(Failure { at, held });
                false
            }
            Err(e) => panic!("with {free} bytes free: unexpected error: {e}"),
        }
    };
    let first_success = (0..=limit).step_by(grid.stride).find(|&free| step_with(free));
    let Some(first) = first_success else { panic!("no step succeeded with up to {limit} bytes free") };
    for free in (first.saturating_sub(grid.stride)..first + grid.stride).step_by(grid.fine) {
        step_with(free);
    }
    seen
}

/// The bytes a step allocates beyond what is in use when it begins (its
/// peak), measured on a throwaway copy of the optimizer.
fn step_peak<O: Optimizer>(dev: Device, mut probe: O) -> usize {
    kiln::synchronize(&dev).unwrap();
    kiln::reset_peak_memory(&dev).unwrap();
    let start = kiln::memory_stats(&dev).unwrap().in_use;
    probe.step().unwrap();
    let peak = kiln::memory_stats(&dev).unwrap().peak - start;
    drop(probe);
    kiln::synchronize(&dev).unwrap();
    peak
}

/// On a simulated GPU: 61 bytes at a time (prime, so that the free memory
/// falls at every offset within the step's allocations as the sweep goes),
/// then byte by byte.
const GPU_GRID: Grid = Grid { stride: 61, fine: 1 };

/// Fills a simulated GPU so that `free` bytes stay free.
fn ballast(dev: Device, free: usize) -> Option<Tensor> {
    let stats = kiln::memory_stats(&dev).unwrap();
    let fill = stats.capacity.unwrap_or(0).saturating_sub(stats.in_use).checked_sub(free)?;
    Tensor::zeros(fill, DType::U8, &dev).ok()
}

fn sgd(ps: &[Tensor]) -> Sgd {
    Sgd::new(ps.to_vec(), 0.1).momentum(0.9).weight_decay(0.01)
}

fn sgd_state(o: &Sgd) -> Vec<Option<Vec<u32>>> {
    (0..o.parameters().len()).map(|i| o.velocity(i).as_ref().map(bits)).collect()
}

fn adam(ps: &[Tensor]) -> Adam {
    Adam::new(ps.to_vec(), 0.01).weight_decay(0.01)
}

type AdamState = (Vec<Option<Vec<u32>>>, i32);

fn adam_state(o: &Adam) -> AdamState {
    let mut s = Vec::new();
    for i in 0..o.parameters().len() {
        let (m, v) = o.moments(i);
        s.push(m.as_ref().map(bits));
        s.push(v.as_ref().map(bits));
    }
    (s, o.steps_taken())
}

/// Sweeps `make`'s optimizer over 3 parameters of 1, 2 and 3 `unit`s of
/// f32 on `dev`, under `squeeze`, and checks everything the module comment
/// promises. `kept` is the number of tensors per parameter a step holds
/// until it commits (its new state, and the new parameter where it is not
/// updated in place).
#[allow(clippy::too_many_arguments)]
fn check_all_or_nothing<O: Optimizer, S: PartialEq + Debug, G>(
    dev: Device,
    unit: usize,
    kept: usize,
    make: impl Fn(&[Tensor]) -> O,
    state: impl Fn(&O) -> S,
    grid: Grid,
    squeeze: impl Fn(usize) -> Option<G>,
    every_parameter: bool,
) -> Sweep {
    let n = 3;
    let ps = params(dev, n, unit, 7);
    let rs = params(dev, n, unit, 7);
    let (mut opt, mut reference) = (make(&ps), make(&rs));
    // One step first, so that there is state to keep.
    opt.step().unwrap();
    reference.step().unwrap();
    let peak = {
        let probe_ps = params(dev, n, unit, 7);
        let mut probe = make(&probe_ps);
        probe.step().unwrap();
        step_peak(dev, probe)
    };

    // A step needs at most its peak once its pending frees are waited for;
    // the CPU maps a little more than it holds.
    let seen = sweep(dev, (grid, 2 * peak + (1 << 20)), squeeze, (&ps, &mut opt), &mut reference, &state);
    println!(
        "{dev}: step peak {peak} B; {} steps succeeded, {} failed; failures in the update of parameter 0, 1, 2: {:?}",
        seen.successes,
        seen.failures.len(),
        seen.by_parameter(n)
    );
    assert!(seen.successes > 0, "no step had enough memory: {seen:?}");
    // Failures landed in the update of every parameter, the last included:
    // after the new values of every other parameter and of its state had
    // been computed (2 momenta, or 2 parameters, 4 moments and Adam's
    // counter, that a step writing as it went would have changed). SGD on
    // the CPU is the exception: its step allocates only the new momenta,
    // which glibc places in the holes the previous step's momenta left, so
    // an address-space cap meets only the first (the simulated GPU's sweep,
    // which counts every byte, reaches every parameter).
    let reached = seen.by_parameter(n);
    let must_reach = if every_parameter { n } else { 1 };
    for (k, &count) in reached.iter().enumerate().take(must_reach) {
        assert!(count > 0, "no step failed while updating parameter {k}: {seen:?}");
    }
    // The memory in use agrees: a failure at parameter k held at least the
    // new values of parameters 0..k (a GPU's temporaries can be held longer).
    let unit_bytes = unit * 4;
    for f in &seen.failures {
        let done: usize = (0..f.at.unwrap_or(0)).map(|j| kept * (j + 1) * unit_bytes).sum();
        assert!(f.held >= done, "{f:?}: the step held less than the {done} B of the new values it had computed");
    }

    // Nothing was lost or half-done: the optimizer equals the reference,
    // which took the same successful steps and never failed...
    assert_eq!(all_bits(&ps), all_bits(&rs));
    assert_eq!(state(&opt), state(&reference));
    // ...and, with memory back, the next step succeeds and matches it (with
    // fresh gradients: after many steps on the same ones SGD has settled).
    for (o, params) in [(&mut opt, &ps), (&mut reference, &rs)] {
        o.zero_grad();
        for p in params.iter() {
            p.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        }
    }
    let before = all_bits(&ps);
    opt.step().unwrap();
    reference.step().unwrap();
    assert_ne!(all_bits(&ps), before, "the step changed nothing");
    assert_eq!(all_bits(&ps), all_bits(&rs));
    assert_eq!(state(&opt), state(&reference));
    seen
}

/// What SGD with momentum holds per parameter until it commits: the new
/// momentum buffer (the parameter is then updated in place).
const SGD_KEPT: usize = 1;

/// What Adam holds per parameter until it commits: the two new moments
/// (the parameter is then updated in place).
const ADAM_KEPT: usize = 2;

#[test]
fn sgd_with_momentum_step_is_all_or_nothing() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = small_gpu();
    check_all_or_nothing(dev, 1024, SGD_KEPT, sgd, sgd_state, GPU_GRID, |free| ballast(dev, free), true);
}

#[test]
fn adam_step_is_all_or_nothing_including_its_step_counter() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = small_gpu();
    check_all_or_nothing(dev, 1024, ADAM_KEPT, adam, adam_state, GPU_GRID, |free| ballast(dev, free), true);
}

// ---- the CPU: host memory pressure from an address-space limit ------------
//
// The CPU has no capacity of its own; its allocations fail when the host
// refuses them. A child process (this binary, running only `cpu_child`)
// caps its own address space a few pages above what it has mapped before
// each step, so that the step's buffers are refused in turn. The child's
// allocator is set (glibc's environment variables) so that this is exact:
// one heap for every thread (a thread's own heap grows inside space it has
// reserved already, which a cap does not see), a mapping of its own for
// every buffer of 64 KiB or more that the heap's spare space cannot hold,
// and 64 KiB of spare heap kept for the small allocations around the
// tensors (all small: the cap does not meet them).

/// The address space this process has mapped, in bytes.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn address_space() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().next().unwrap().parse().unwrap();
    // SAFETY: sysconf only reads a configuration value.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize
}

/// Caps the address space at `bytes` until dropped.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
struct AddressSpaceCap;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
impl AddressSpaceCap {
    fn new(bytes: usize) -> AddressSpaceCap {
        AddressSpaceCap::set(bytes as libc::rlim_t);
        AddressSpaceCap
    }
    fn set(cur: libc::rlim_t) {
        let limit = libc::rlimit { rlim_cur: cur, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: setrlimit reads the struct we pass; the hard limit stays infinite.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0, "setrlimit failed");
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
impl Drop for AddressSpaceCap {
    fn drop(&mut self) {
        AddressSpaceCap::set(libc::RLIM_INFINITY);
    }
}

/// The CPU parameters' unit: 160 KiB of f32, above the mapping threshold
/// and the heap's spare space set for the child (64 KiB each), below the
/// size from which the CPU keeps freed buffers for reuse (1 MiB) even at 3
/// units, so that the address space follows the memory in use.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const CPU_UNIT: usize = 40 << 10;

/// The child: both optimizers swept on the CPU, over parameters of 1, 2 and
/// 3 units. Does nothing unless run by
/// `cpu_steps_are_all_or_nothing_under_host_memory_pressure`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn cpu_child() {
    if std::env::var_os("KILN_TEST_OPTIM_CPU_CHILD").is_none() {
        return;
    }
    let dev = cpu();
    // 23 pages at a time (prime, as on the GPU), then page by page.
    let pages = Grid { stride: 23 << 12, fine: 1 << 12 };
    let squeeze = |free: usize| Some(AddressSpaceCap::new(address_space() + free));
    let s = check_all_or_nothing(dev, CPU_UNIT, SGD_KEPT, sgd, sgd_state, pages, squeeze, false);
    println!("CPU-CHILD sgd: {} steps succeeded, {} failed, by parameter {:?}", s.successes, s.failures.len(), s.by_parameter(3));
    let a = check_all_or_nothing(dev, CPU_UNIT, ADAM_KEPT, adam, adam_state, pages, squeeze, true);
    println!("CPU-CHILD adam: {} steps succeeded, {} failed, by parameter {:?}", a.successes, a.failures.len(), a.by_parameter(3));
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn cpu_steps_are_all_or_nothing_under_host_memory_pressure() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "cpu_child", "--nocapture", "--test-threads=1"])
        .env("KILN_TEST_OPTIM_CPU_CHILD", "1")
        .env("RAYON_NUM_THREADS", "1")
        .env("MALLOC_ARENA_MAX", "1")
        .env("MALLOC_MMAP_THRESHOLD_", "65536")
        .env("MALLOC_TOP_PAD_", "65536")
        .env("MALLOC_TRIM_THRESHOLD_", "65536")
        // The same as glibc tunables (newer glibc prefers them).
        .env(
            "GLIBC_TUNABLES",
            "glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=65536:glibc.malloc.top_pad=65536:glibc.malloc.trim_threshold=65536",
        )
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // An abort (an infallible allocation refused) or a failed check ends the child.
    assert!(out.status.success(), "the CPU sweep failed ({}):\n{text}", out.status);
    for name in ["sgd", "adam"] {
        let line =
            text.lines().find(|l| l.starts_with(&format!("CPU-CHILD {name}: "))).unwrap_or_else(|| panic!("no {name} line in\n{text}"));
        println!("{line}");
    }
}
