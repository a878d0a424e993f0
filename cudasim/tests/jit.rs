//! The simulator's own tests of run-time kernel compilation: a source goes
//! through the NVRTC stand-in, its image through `cuModuleLoadData`, and the
//! kernels run; the disk cache, its damage and races, and the failures (a
//! source g++ rejects, no compiler, unknown or malformed images, no real
//! NVRTC) go through the driver's error codes without a panic.
//!
//! The library is dlopened from the target folder as kiln would load it.
//! A small fake NVRTC, compiled here with g++, stands in for the real one
//! (which `scripts/cudasim.sh` installs; kiln's suites use that), so these
//! tests need only g++. Each scenario runs in a child process of this test
//! binary, because the simulator reads its environment once per process.
//! One test uses the real NVRTC when there is one (under scripts/cudasim.sh)
//! and is reported ignored, with the reason, when there is none.

mod common;

use common::{clean_env, fake_nvrtc, sim_library, Res, Sim};
use libtest_mimic::{Arguments, Completion, Trial};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output};

const SCENARIO: &str = "CUDASIM_TEST_SCENARIO";

const KERNELS: &str = r#"
// Reverses each block of `data` through shared memory: wrong unless every
// thread's write lands before any thread reads, i.e. unless __syncthreads works.
extern "C" __global__ void reverse_block(float* data) {
    __shared__ float tile[64];
    unsigned int t = threadIdx.x;
    tile[t] = data[blockIdx.x * blockDim.x + t];
    __syncthreads();
    data[blockIdx.x * blockDim.x + t] = tile[blockDim.x - 1 - t];
}
// SCALE comes from an NVRTC option (-DSCALE=...), which must reach g++ too.
extern "C" __global__ void scale(float* data, float by, unsigned long long n) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (unsigned long long)blockDim.x * gridDim.x)
        data[i] = data[i] * by * SCALE;
}
"#;

/// The atomics of the shim: every thread of every block adds once.
const ATOMICS: &str = r#"
extern "C" __global__ void tally(unsigned int* count, float* sum, int* high) {
    atomicAdd(count, 1u);
    atomicAdd(sum, 0.5f);
    atomicMax(high, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}
"#;

/// Kernels that touch memory outside their buffer on purpose: `poke` writes
/// `data[at]` (thread 0 of block 0 only), `peek` reads it, `barrier_poke`
/// has thread 5 write it while the block's other threads wait at a barrier,
/// `deep` recurses until its stack runs out.
const OUT_OF_BOUNDS: &str = r#"
extern "C" __global__ void poke(float* data, long long at) {
    if (threadIdx.x == 0 && blockIdx.x == 0) data[at] = 1.0f;
}
extern "C" __global__ void peek(const float* data, long long at, float* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = data[at];
}
extern "C" __global__ void barrier_poke(float* data, long long at) {
    data[threadIdx.x] = 2.0f;
    __syncthreads();
    if (threadIdx.x == 5) data[at] = 1.0f;
    __syncthreads();
}
__device__ int deep(int n) {
    volatile char pad[4096];
    pad[n % 4096] = (char)n;
    return n == 0 ? 0 : deep(n - 1) + pad[n % 4096];
}
extern "C" __global__ void recurse(int* out, int n) { out[0] = deep(n); }
"#;

/// NVRTC accepts it (the fake one does not look), g++ does not.
const REJECTED_BY_GXX: &str = r#"
extern "C" __global__ void broken(float* data) { data[0] = function_the_host_lacks(); }
"#;
impl Sim {
    /// Runs `reverse_block` then `scale(by)` of `module` on 0..n and returns
    /// the result.
    fn run_kernels(&self, module: *mut c_void, n: usize, by: f32) -> Vec<f32> {
        let host: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_ne_bytes()).collect();
        let mut dev = self.upload(&host);
        self.launch(module, "reverse_block", (n / 64) as c_uint, 64, &mut [&mut dev as *mut u64 as *mut c_void]);
        let (mut by, mut count) = (by, n as u64);
        let mut args = [&mut dev as *mut u64 as *mut c_void, &mut by as *mut f32 as *mut c_void, &mut count as *mut u64 as *mut c_void];
        self.launch(module, "scale", 2, 32, &mut args);
        self.download(dev, n * 4).chunks(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
    }
}

/// A scratch folder of this test, emptied.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cudasim-jit").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `scenario` in a child process of this test binary with `env`.
fn child(scenario: &str, env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(SCENARIO, scenario).env("KILN_CUDASIM", "1");
    clean_env(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn succeeded(out: &Output, what: &str) -> String {
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("SCENARIO-OK"), "{what} failed:\n{text}");
    text
}

fn main() -> ExitCode {
    if let Ok(scenario) = std::env::var(SCENARIO) {
        // A child process of one of the tests below: a panic fails it.
        run_scenario(&scenario);
        return ExitCode::SUCCESS;
    }
    let ran = |name: &str, test: fn()| {
        Trial::test(name, move || {
            test();
            Ok(())
        })
    };
    let trials = vec![
        ran(
            "kernels_compiled_through_nvrtc_run_and_are_compiled_once_per_machine",
            kernels_compiled_through_nvrtc_run_and_are_compiled_once_per_machine,
        ),
        ran("racing_processes_compile_a_source_once", racing_processes_compile_a_source_once),
        ran("atomics_add_up_across_blocks", atomics_add_up_across_blocks),
        ran(
            "out_of_bounds_accesses_fail_the_kernel_by_name_and_the_process_survives",
            out_of_bounds_accesses_fail_the_kernel_by_name_and_the_process_survives,
        ),
        ran(
            "a_source_the_host_compiler_rejects_fails_the_load_with_its_message",
            a_source_the_host_compiler_rejects_fails_the_load_with_its_message,
        ),
        ran("no_compiler_and_no_cache_folder_are_reported_not_fatal", no_compiler_and_no_cache_folder_are_reported_not_fatal),
        ran("malformed_or_unknown_images_are_invalid_not_fatal", malformed_or_unknown_images_are_invalid_not_fatal),
        ran("without_a_real_nvrtc_the_stand_in_says_why", without_a_real_nvrtc_the_stand_in_says_why),
        ran("without_kiln_cudasim_there_is_no_device", without_kiln_cudasim_there_is_no_device),
        Trial::ignorable_test("the_real_nvrtcs_cubin_and_ptx_load_and_its_errors_pass_through", || {
            Ok(match the_real_nvrtcs_cubin_and_ptx_load_and_its_errors_pass_through() {
                Ok(()) => Completion::Completed,
                Err(why) => Completion::ignored_with(why),
            })
        }),
    ];
    libtest_mimic::run(&Arguments::from_args(), trials).exit_code()
}

/// The scenario a parent test asked for, in this child process.
fn run_scenario(scenario: &str) {
    let sim = Sim::open();
    match scenario {
        "compile" => {
            sim.init().unwrap();
            let ptx = sim.nvrtc_ptx(KERNELS, &["--fmad=false", "-DSCALE=2"]).unwrap();
            let module = sim.load(&ptx).unwrap();
            let out = sim.run_kernels(module, 128, 0.5);
            let want: Vec<f32> = (0..128).map(|i| ((i / 64) * 64 + 63 - i % 64) as f32).collect();
            assert_eq!(out, want, "reverse then scale by 0.5 * SCALE=2");
            assert_eq!(sim.function(module, "not_there").unwrap_err(), 500, "NOT_FOUND");
            // A second context's load of the same source shares the host module.
            let module2 = sim.load(&ptx).unwrap();
            assert_eq!(sim.run_kernels(module2, 64, 1.0), (0..64).rev().map(|i| i as f32 * 2.0).collect::<Vec<_>>());
            println!("compiles={} hits={}", sim.stat("host_compiles"), sim.stat("host_cache_hits"));
        }
        "cached" => {
            // The image from the fake NVRTC directly: this process never
            // compiled it, so its source must come from the disk's records.
            sim.init().unwrap();
            let ptx = fake_image(KERNELS);
            let module = sim.load(&ptx).unwrap();
            assert_eq!(sim.run_kernels(module, 64, 1.0), (0..64).rev().map(|i| i as f32 * 2.0).collect::<Vec<_>>());
            println!("compiles={} hits={}", sim.stat("host_compiles"), sim.stat("host_cache_hits"));
        }
        "atomics" => {
            sim.init().unwrap();
            let module = sim.load(&sim.nvrtc_ptx(ATOMICS, &[]).unwrap()).unwrap();
            let (mut count, mut sum, mut high) = (sim.upload(&[0; 4]), sim.upload(&0f32.to_ne_bytes()), sim.upload(&(-1i32).to_ne_bytes()));
            let ptr = |p: &mut u64| p as *mut u64 as *mut c_void;
            sim.launch(module, "tally", 4, 32, &mut [ptr(&mut count), ptr(&mut sum), ptr(&mut high)]);
            assert_eq!(sim.download(count, 4), 128u32.to_ne_bytes());
            assert_eq!(sim.download(sum, 4), 64f32.to_ne_bytes());
            assert_eq!(sim.download(high, 4), 127i32.to_ne_bytes());
        }
        "out_of_bounds" => out_of_bounds(&sim),
        "tight" => {
            // KILN_CUDASIM_TIGHT=1: data ends on the inaccessible page, so a
            // read of one element past the end faults too.
            sim.init().unwrap();
            let module = sim.load(&sim.nvrtc_ptx(OUT_OF_BOUNDS, &[]).unwrap()).unwrap();
            let mut data = sim.upload(&[0u8; 1000]);
            assert_eq!(data % 8, 0, "aligned to 8, the largest power of two that divides 1000");
            let (mut out, mut at) = (sim.upload(&[0u8; 4]), 250i64);
            let p = |v: &mut u64| v as *mut u64 as *mut c_void;
            sim.launch(module, "peek", 1, 1, &mut [p(&mut data), &mut at as *mut i64 as *mut c_void, p(&mut out)]);
            let sync: unsafe extern "C" fn() -> u32 = sim.f("cuCtxSynchronize");
            let text: unsafe extern "C" fn(u32, *mut *const c_char) -> u32 = sim.f("cuGetErrorString");
            assert_eq!(unsafe { sync() }, 700);
            let mut msg: *const c_char = std::ptr::null();
            assert_eq!(unsafe { text(700, &mut msg) }, 0);
            let msg = unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned();
            assert!(msg.contains("kernel peek") && msg.contains("a read") && msg.contains("0 bytes past the end"), "{msg}");
            println!("{msg}");
        }
        "real_nvrtc" => {
            sim.init().unwrap();
            let options = ["--fmad=false", "--std=c++17", "-DSCALE=2"];
            let want: Vec<f32> = (0..64).rev().map(|i| i as f32 * 2.0).collect();
            let cubin = sim.nvrtc_image(KERNELS, &[&options[..], &["--gpu-architecture=sm_90"]].concat(), true).unwrap();
            assert!(cubin.starts_with(b"\x7fELF"));
            assert_eq!(sim.run_kernels(sim.load(&cubin).unwrap(), 64, 1.0), want, "from the cubin");
            let ptx = sim.nvrtc_ptx(KERNELS, &[&options[..], &["--gpu-architecture=compute_90"]].concat()).unwrap();
            assert_eq!(sim.run_kernels(sim.load(&ptx).unwrap(), 64, 1.0), want, "from the PTX");
            assert_eq!(sim.stat("host_compiles"), 1, "one source, one host module");
            let broken = "extern \"C\" __global__ void k(int* p) { p[0] = not_declared; }";
            assert_eq!(sim.nvrtc_ptx(broken, &options).unwrap_err(), 6, "NVRTC_ERROR_COMPILATION");
        }
        "rejected" => {
            sim.init().unwrap();
            let ptx = sim.nvrtc_ptx(REJECTED_BY_GXX, &[]).unwrap();
            assert_eq!(sim.load(&ptx).unwrap_err(), 218, "CUDA_ERROR_INVALID_PTX");
            assert_eq!(sim.load(&ptx).unwrap_err(), 218, "the same again, from memory");
            assert_eq!(sim.stat("host_compiles"), 0);
            assert_eq!(sim.nvrtc_ptx("NVRTC_REJECTS", &[]).unwrap_err(), 6, "NVRTC's own compile error passes through");
        }
        "no_compiler" => {
            sim.init().unwrap();
            let ptx = sim.nvrtc_ptx(KERNELS, &["-DSCALE=1"]).unwrap();
            assert_eq!(sim.load(&ptx).unwrap_err(), 221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND");
        }
        "bad_images" => {
            sim.init().unwrap();
            assert_eq!(sim.load(b"hello\0").unwrap_err(), 200);
            assert_eq!(sim.load(b".version 8.0\n.target sm_90\n.visible .entry nobody_made_this(\n\0").unwrap_err(), 200);
            let mut elf = vec![0u8; 128];
            elf[..4].copy_from_slice(b"\x7fELF");
            elf[4] = 2;
            elf[5] = 1;
            elf[0x12] = 62; // x86-64, not CUDA
            assert_eq!(sim.load(&elf).unwrap_err(), 200);
            elf[0x12] = 190;
            assert_eq!(sim.load(&elf).unwrap_err(), 200, "a CUDA ELF nobody compiled");
        }
        "no_real_nvrtc" => {
            let version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Res = sim.f("nvrtcVersion");
            let text: unsafe extern "C" fn(Res) -> *const c_char = sim.f("nvrtcGetErrorString");
            let (mut a, mut b) = (0, 0);
            let r = unsafe { version(&mut a, &mut b) };
            assert_eq!(r, 11, "NVRTC_ERROR_INTERNAL_ERROR");
            let why = unsafe { CStr::from_ptr(text(r)) }.to_string_lossy().into_owned();
            assert!(why.contains("KILN_CUDASIM_NVRTC"), "{why}");
            println!("reason: {why}");
        }
        "no_simulator" => {
            // Without KILN_CUDASIM=1 nobody gets a simulated device.
            assert_eq!(sim.init().unwrap_err(), 100, "CUDA_ERROR_NO_DEVICE");
        }
        other => panic!("unknown scenario {other}"),
    }
    println!("SCENARIO-OK");
}

/// What the fake NVRTC makes of `source`, asked directly (not through the
/// simulator, which would record it).
fn fake_image(source: &str) -> Vec<u8> {
    let path = std::env::var("KILN_CUDASIM_NVRTC").unwrap();
    let c = CString::new(path).unwrap();
    let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null());
    let real = Sim { lib };
    real.nvrtc_ptx(source, &["-DSCALE=2"]).unwrap()
}

fn stat_line(text: &str) -> (i64, i64) {
    let line = text.lines().find_map(|l| l.find("compiles=").map(|at| &l[at..])).unwrap_or_else(|| panic!("no stats in:\n{text}"));
    let mut nums = line.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).map(|s| s.parse::<i64>().unwrap());
    (nums.next().unwrap(), nums.next().unwrap())
}

fn kernels_compiled_through_nvrtc_run_and_are_compiled_once_per_machine() {
    let dir = scratch("compile");
    let nvrtc = fake_nvrtc(&dir);
    let cache = dir.join("cache");
    let env = [("KILN_CUDASIM_NVRTC", nvrtc.as_path()), ("KILN_CUDASIM_CACHE", cache.as_path())];
    let first = succeeded(&child("compile", &env), "the first load");
    assert_eq!(stat_line(&first), (1, 0), "compiled once for two loads:\n{first}");
    let second = succeeded(&child("cached", &env), "a load from the disk cache");
    assert_eq!(stat_line(&second), (0, 1), "found in the cache:\n{second}");
    // A damaged cache entry is compiled again, not loaded or trusted.
    for entry in std::fs::read_dir(&cache).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "so") {
            std::fs::write(&p, b"not a library").unwrap();
        }
    }
    let third = succeeded(&child("cached", &env), "a load over a damaged cache entry");
    assert_eq!(stat_line(&third), (1, 0), "compiled again:\n{third}");
    let leftovers: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left in the cache: {leftovers:?}");
}

fn racing_processes_compile_a_source_once() {
    let dir = scratch("race");
    let nvrtc = fake_nvrtc(&dir);
    let cache = dir.join("cache");
    let env = [("KILN_CUDASIM_NVRTC", nvrtc.as_path()), ("KILN_CUDASIM_CACHE", cache.as_path())];
    let children: Vec<_> = (0..3)
        .map(|_| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.env(SCENARIO, "compile").env("KILN_CUDASIM", "1");
            clean_env(&mut cmd);
            for (k, v) in &env {
                cmd.env(k, v);
            }
            cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap()
        })
        .collect();
    let mut compiles = 0;
    for c in children {
        let text = succeeded(&c.wait_with_output().unwrap(), "a racing load");
        compiles += stat_line(&text).0;
    }
    assert_eq!(compiles, 1, "three processes, one compile (the others wait for it under the lock)");
}

fn atomics_add_up_across_blocks() {
    let dir = scratch("atomics");
    let nvrtc = fake_nvrtc(&dir);
    let cache = dir.join("cache");
    succeeded(&child("atomics", &[("KILN_CUDASIM_NVRTC", &nvrtc), ("KILN_CUDASIM_CACHE", &cache)]), "atomics");
}

fn out_of_bounds_accesses_fail_the_kernel_by_name_and_the_process_survives() {
    let dir = scratch("out-of-bounds");
    let nvrtc = fake_nvrtc(&dir);
    let cache = dir.join("cache");
    // A device per case, and one more that nothing goes wrong on.
    let devices = Path::new("11");
    let env = [("KILN_CUDASIM_NVRTC", nvrtc.as_path()), ("KILN_CUDASIM_CACHE", &cache), ("KILN_CUDASIM_DEVICES", devices)];
    let text = succeeded(&child("out_of_bounds", &env), "out of bounds");
    println!("{text}");
    let tight = Path::new("1");
    let env = [("KILN_CUDASIM_NVRTC", nvrtc.as_path()), ("KILN_CUDASIM_CACHE", &cache), ("KILN_CUDASIM_TIGHT", tight)];
    println!("{}", succeeded(&child("tight", &env), "a read one element past the end, KILN_CUDASIM_TIGHT=1"));
}

/// One out-of-bounds kernel per simulated device (a fault is sticky for the
/// device's context, as on a GPU); each is reported through the driver's
/// error code and string with the kernel's name, the other devices go on
/// working, and the last one, untouched, still runs kernels.
fn out_of_bounds(sim: &Sim) {
    type Ctx = *mut c_void;
    const ILLEGAL_ADDRESS: u32 = 700;
    sim.init().unwrap();
    let retain: unsafe extern "C" fn(*mut Ctx, c_int) -> u32 = sim.f("cuDevicePrimaryCtxRetain");
    let set: unsafe extern "C" fn(Ctx) -> u32 = sim.f("cuCtxSetCurrent");
    let sync: unsafe extern "C" fn() -> u32 = sim.f("cuCtxSynchronize");
    let text: unsafe extern "C" fn(u32, *mut *const c_char) -> u32 = sim.f("cuGetErrorString");
    let free: unsafe extern "C" fn(u64) -> u32 = sim.f("cuMemFree_v2");
    let alloc: unsafe extern "C" fn(*mut u64, usize) -> u32 = sim.f("cuMemAlloc_v2");
    let image = sim.nvrtc_ptx(OUT_OF_BOUNDS, &[]).unwrap();
    let use_device = |dev: c_int| unsafe {
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, dev), 0);
        assert_eq!(set(ctx), 0);
        sim.load(&image).unwrap()
    };
    let error_string = |r: u32| unsafe {
        let mut p: *const c_char = std::ptr::null();
        assert_eq!(text(r, &mut p), 0);
        CStr::from_ptr(p).to_string_lossy().into_owned()
    };
    // (what, bytes of the buffer, kernel, element index, what the report says)
    let cases: &[(&str, usize, &str, i64, &[&str])] = &[
        ("one element past the end, into the red zone", 1000, "poke", 250, &["kernel poke wrote outside", "after its end"]),
        ("one element past the end, onto a guard page", 1024, "poke", 256, &["kernel poke", "a write", "0 bytes past the end"]),
        ("one element before the start, into the red zone", 1000, "poke", -1, &["kernel poke wrote outside", "before its start"]),
        ("one element before the start, onto a guard page", 4096, "poke", -1, &["kernel poke", "a write", "4 bytes before the start"]),
        ("64 KiB past the end", 1000, "poke", 250 + 16384, &["kernel poke", "a write", "65536 bytes past the end"]),
        ("a read 64 KiB before the start", 4096, "peek", -16384, &["kernel peek", "a read", "65536 bytes before the start"]),
        ("while the block's other threads wait at a barrier", 1024, "barrier_poke", 300, &["kernel barrier_poke", "thread 5 of block 0"]),
        ("through a null pointer", 0, "poke", 0, &["kernel poke", "not device memory"]),
        ("freed memory", 4096, "poke", 0, &["kernel poke", "freed"]),
        ("a stack overflow", 0, "recurse", 100_000, &["kernel recurse", "stack overflow"]),
    ];
    let args_of = |kernel: &str, data: &mut u64, at: &mut i64, out: &mut u64, n: &mut c_int| -> Vec<*mut c_void> {
        let p = |v: &mut u64| v as *mut u64 as *mut c_void;
        match kernel {
            "peek" => vec![p(data), at as *mut i64 as *mut c_void, p(out)],
            "recurse" => vec![p(out), n as *mut c_int as *mut c_void],
            _ => vec![p(data), at as *mut i64 as *mut c_void],
        }
    };
    for (dev, &(what, bytes, kernel, at, says)) in cases.iter().enumerate() {
        let module = use_device(dev as c_int);
        let mut data = if bytes > 0 { sim.upload(&vec![0u8; bytes]) } else { 0 };
        let mut out = sim.upload(&[0u8; 4]);
        if what == "freed memory" {
            assert_eq!(unsafe { free(data) }, 0);
            // A later allocation does not get its addresses.
            let mut again = 0u64;
            assert_eq!(unsafe { alloc(&mut again, bytes) }, 0);
            assert_ne!(again, data);
            // Hidden from the launch's pointer check (which would refuse a
            // freed pointer before the kernel ran): the kernel computes it.
            let (mut base, mut at) = (again, (data as i64 - again as i64) / 4);
            let mut args = args_of(kernel, &mut base, &mut at, &mut out, &mut 0);
            sim.launch(module, kernel, 1, 32, &mut args);
        } else {
            let (mut at, mut n) = (at, at as c_int);
            let mut args = args_of(kernel, &mut data, &mut at, &mut out, &mut n);
            sim.launch(module, kernel, 1, 32, &mut args);
        }
        let r = unsafe { sync() };
        assert_eq!(r, ILLEGAL_ADDRESS, "{what}: cuCtxSynchronize");
        let msg = error_string(r);
        for s in says {
            assert!(msg.contains(s), "{what}: `{s}` is not in the error string: {msg}");
        }
        assert!(msg.contains(&format!("device {dev}")), "{what}: {msg}");
        println!("{what}: {msg}");
        // Sticky, as on a GPU.
        assert_eq!(unsafe { sync() }, ILLEGAL_ADDRESS, "{what}: the fault is sticky");
    }
    // A device no kernel misbehaved on still works, in the same process.
    let module = use_device(cases.len() as c_int);
    let other = sim.load(&sim.nvrtc_ptx(KERNELS, &["-DSCALE=1"]).unwrap()).unwrap();
    assert_eq!(sim.run_kernels(other, 64, 1.0), (0..64).rev().map(|i| i as f32).collect::<Vec<_>>());
    let mut data = sim.upload(&[0u8; 1000]);
    let mut at = 249i64;
    sim.launch(module, "poke", 1, 32, &mut [&mut data as *mut u64 as *mut c_void, &mut at as *mut i64 as *mut c_void]);
    assert_eq!(unsafe { sync() }, 0, "the last element is in bounds");
    assert_eq!(sim.download(data + 996, 4), 1f32.to_ne_bytes());
}

fn a_source_the_host_compiler_rejects_fails_the_load_with_its_message() {
    let dir = scratch("rejected");
    let nvrtc = fake_nvrtc(&dir);
    let cache = dir.join("cache");
    let out = child("rejected", &[("KILN_CUDASIM_NVRTC", &nvrtc), ("KILN_CUDASIM_CACHE", &cache)]);
    let text = succeeded(&out, "loading a source g++ rejects");
    assert!(text.contains("function_the_host_lacks"), "g++'s message is not in the log:\n{text}");
    assert_eq!(text.matches("cannot compile the kernels").count(), 1, "compiled (and reported) once:\n{text}");
}

fn no_compiler_and_no_cache_folder_are_reported_not_fatal() {
    let dir = scratch("no-compiler");
    let nvrtc = fake_nvrtc(&dir);
    let cache = dir.join("cache");
    let missing = dir.join("no-such-g++");
    let out = child("no_compiler", &[("KILN_CUDASIM_NVRTC", &nvrtc), ("KILN_CUDASIM_CACHE", &cache), ("KILN_CUDASIM_CXX", &missing)]);
    let text = succeeded(&out, "loading without a compiler");
    assert!(text.contains("KILN_CUDASIM_CXX"), "the message does not say how to fix it:\n{text}");
    // A cache folder that cannot be created: a temporary one serves.
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let unusable = Path::new("/proc/kiln-cudasim-cannot-be-here");
    let out = child("compile", &[("KILN_CUDASIM_NVRTC", &nvrtc), ("KILN_CUDASIM_CACHE", unusable), ("TMPDIR", &tmp)]);
    succeeded(&out, "compiling without a usable cache folder");
}

fn malformed_or_unknown_images_are_invalid_not_fatal() {
    let dir = scratch("bad-images");
    let nvrtc = fake_nvrtc(&dir);
    let cache = dir.join("cache");
    succeeded(&child("bad_images", &[("KILN_CUDASIM_NVRTC", &nvrtc), ("KILN_CUDASIM_CACHE", &cache)]), "bad images");
}

fn without_a_real_nvrtc_the_stand_in_says_why() {
    let dir = scratch("no-nvrtc");
    succeeded(&child("no_real_nvrtc", &[("KILN_CUDASIM_CACHE", &dir)]), "NVRTC calls without KILN_CUDASIM_NVRTC");
    // Pointed at the simulator itself, it must not forward to itself forever.
    let out = child("no_real_nvrtc", &[("KILN_CUDASIM_CACHE", &dir), ("KILN_CUDASIM_NVRTC", &sim_library())]);
    let text = succeeded(&out, "KILN_CUDASIM_NVRTC naming the simulator");
    assert!(text.contains("is the simulator itself"), "{text}");
}

fn without_kiln_cudasim_there_is_no_device() {
    let dir = scratch("no-simulator");
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(SCENARIO, "no_simulator").env_remove("KILN_CUDASIM");
    clean_env(&mut cmd);
    let out = cmd.env("KILN_CUDASIM_CACHE", &dir).output().unwrap();
    succeeded(&out, "cuInit without KILN_CUDASIM=1");
}

fn the_real_nvrtcs_cubin_and_ptx_load_and_its_errors_pass_through() -> Result<(), String> {
    let Some(real) = std::env::var_os("KILN_CUDASIM_NVRTC").filter(|p| !p.is_empty()) else {
        return Err("needs the real NVRTC (KILN_CUDASIM_NVRTC): run under scripts/cudasim.sh".into());
    };
    let dir = scratch("real-nvrtc");
    succeeded(&child("real_nvrtc", &[("KILN_CUDASIM_NVRTC", Path::new(&real)), ("KILN_CUDASIM_CACHE", &dir)]), "the real NVRTC");
    Ok(())
}
