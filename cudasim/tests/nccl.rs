//! The simulator's own tests of its NCCL stand-in, through the C API as a
//! program would call it (kiln's collectives are checked by kiln's suites
//! under scripts/cudasim.sh): every collective's values on three devices,
//! the checks made at the call, a group with a refused call queuing
//! nothing, collectives ordered by their streams, and the failures on the
//! streams (ranks that called different collectives, a freed buffer, a rank
//! that never arrives) faulting the contexts instead of hanging.
//!
//! Each scenario runs in a child process of this test binary, because the
//! simulator reads its environment once per process. Needs no g++ and no
//! NVRTC: no kernel is compiled.
// Ranks index several arrays at once; NCCL's calls take many arguments.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use libtest_mimic::{Arguments, Trial};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::PathBuf;
use std::process::{Command, ExitCode};

const SCENARIO: &str = "CUDASIM_NCCL_SCENARIO";
const DEVICES: usize = 3;

// ncclDataType_t, ncclRedOp_t and ncclResult_t numbers.
const I32: c_uint = 2;
const U8: c_uint = 1;
const F16: c_uint = 6;
const F32: c_uint = 7;
const BF16: c_uint = 9;
const SUM: c_uint = 0;
const MAX: c_uint = 2;
const AVG: c_uint = 4;
const INVALID_ARGUMENT: u32 = 4;
const INVALID_USAGE: u32 = 5;
const UNHANDLED_CUDA: u32 = 1;
/// CUDA_ERROR_LAUNCH_FAILED: a context faulted by a failed collective.
const LAUNCH_FAILED: u32 = 719;

type Res = u32;
type Ptr = *mut c_void;

/// The simulator library and the functions these tests call.
struct Sim {
    lib: Ptr,
    ctxs: Vec<Ptr>,
    streams: Vec<Ptr>,
}

impl Sim {
    /// The library, initialised, with a context and a stream per device.
    fn open() -> Sim {
        let path = CString::new(sim_library().to_string_lossy().as_bytes()).unwrap();
        // SAFETY: dlopen of the simulator, as kiln does.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!lib.is_null(), "cannot dlopen {}", sim_library().display());
        let mut sim = Sim { lib, ctxs: Vec::new(), streams: Vec::new() };
        unsafe {
            assert_eq!(sim.f::<unsafe extern "C" fn(c_uint) -> Res>("cuInit")(0), 0);
            for d in 0..DEVICES {
                let mut ctx = std::ptr::null_mut();
                assert_eq!(sim.f::<unsafe extern "C" fn(*mut Ptr, c_int) -> Res>("cuDevicePrimaryCtxRetain")(&mut ctx, d as c_int), 0);
                sim.ctxs.push(ctx);
                sim.bind(d);
                let mut s = std::ptr::null_mut();
                assert_eq!(sim.f::<unsafe extern "C" fn(*mut Ptr, c_uint) -> Res>("cuStreamCreate")(&mut s, 1), 0);
                sim.streams.push(s);
            }
        }
        sim
    }

    fn f<F: Copy>(&self, name: &str) -> F {
        let c = CString::new(name).unwrap();
        // SAFETY: a live handle; the caller names the C signature as F.
        let p = unsafe { libc::dlsym(self.lib, c.as_ptr()) };
        assert!(!p.is_null(), "the simulator lacks {name}");
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<Ptr>());
        unsafe { std::mem::transmute_copy(&p) }
    }

    fn stat(&self, what: &str) -> i64 {
        let c = CString::new(what).unwrap();
        unsafe { self.f::<unsafe extern "C" fn(*const c_char) -> i64>("kiln_cudasim_stat")(c.as_ptr()) }
    }

    fn bind(&self, d: usize) {
        assert_eq!(unsafe { self.f::<unsafe extern "C" fn(Ptr) -> Res>("cuCtxSetCurrent")(self.ctxs[d]) }, 0);
    }

    /// Device `d` memory holding `bytes`.
    fn upload(&self, d: usize, bytes: &[u8]) -> u64 {
        self.bind(d);
        let mut p = 0u64;
        unsafe {
            assert_eq!(self.f::<unsafe extern "C" fn(*mut u64, usize) -> Res>("cuMemAlloc_v2")(&mut p, bytes.len()), 0);
            assert_eq!(
                self.f::<unsafe extern "C" fn(u64, *const c_void, usize) -> Res>("cuMemcpyHtoD_v2")(p, bytes.as_ptr().cast(), bytes.len()),
                0
            );
        }
        p
    }

    /// `len` bytes at `p` on device `d`, after device `d`'s NCCL stream.
    fn download(&self, d: usize, p: u64, len: usize) -> Vec<u8> {
        assert_eq!(self.sync(d), 0, "device {d}'s stream");
        let mut out = vec![0u8; len];
        assert_eq!(
            unsafe { self.f::<unsafe extern "C" fn(Ptr, u64, usize) -> Res>("cuMemcpyDtoH_v2")(out.as_mut_ptr().cast(), p, len) },
            0
        );
        out
    }

    fn sync(&self, d: usize) -> Res {
        self.bind(d);
        unsafe { self.f::<unsafe extern "C" fn(Ptr) -> Res>("cuStreamSynchronize")(self.streams[d]) }
    }

    fn comms(&self, devs: &[c_int]) -> Vec<Ptr> {
        let mut comms = vec![std::ptr::null_mut(); devs.len()];
        let init: unsafe extern "C" fn(*mut Ptr, c_int, *const c_int) -> Res = self.f("ncclCommInitAll");
        assert_eq!(unsafe { init(comms.as_mut_ptr(), devs.len() as c_int, devs.as_ptr()) }, 0);
        comms
    }

    fn group<T>(&self, calls: impl FnOnce() -> T) -> (T, Res) {
        unsafe {
            assert_eq!(self.f::<unsafe extern "C" fn() -> Res>("ncclGroupStart")(), 0);
            let t = calls();
            (t, self.f::<unsafe extern "C" fn() -> Res>("ncclGroupEnd")())
        }
    }

    fn all_reduce(&self, send: u64, recv: u64, count: usize, ty: c_uint, op: c_uint, comm: Ptr, stream: Ptr) -> Res {
        type F = unsafe extern "C" fn(u64, u64, usize, c_uint, c_uint, Ptr, Ptr) -> Res;
        unsafe { self.f::<F>("ncclAllReduce")(send, recv, count, ty, op, comm, stream) }
    }

    fn last_error(&self) -> String {
        unsafe { CStr::from_ptr(self.f::<unsafe extern "C" fn(Ptr) -> *const c_char>("ncclGetLastError")(std::ptr::null_mut())) }
            .to_string_lossy()
            .into_owned()
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
}

fn sim_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let beside = deps.join("libkiln_cudasim.so");
    if beside.exists() {
        return beside;
    }
    deps.parent().unwrap().join("libkiln_cudasim.so")
}

/// Every collective's values over three devices, and the ranks' agreement.
fn collectives(sim: &Sim) {
    let comms = sim.comms(&[0, 1, 2]);
    let rank_data = |r: usize| -> Vec<f32> { (0..6).map(|i| (i * 3 + r * 7) as f32 - 5.0).collect() };
    let bufs: Vec<u64> = (0..DEVICES).map(|r| sim.upload(r, &f32s(&rank_data(r)))).collect();
    let sum: Vec<f32> = (0..6).map(|i| (0..DEVICES).map(|r| rank_data(r)[i]).sum()).collect();
    let ((), end) = sim.group(|| {
        for r in 0..DEVICES {
            assert_eq!(sim.all_reduce(bufs[r], bufs[r], 6, F32, SUM, comms[r], sim.streams[r]), 0);
        }
    });
    assert_eq!(end, 0);
    for r in 0..DEVICES {
        assert_eq!(to_f32s(&sim.download(r, bufs[r], 24)), sum, "all-reduce on rank {r}");
    }
    assert_eq!(sim.stat("nccl_collectives"), 1);
    assert_eq!(sim.stat("nccl_comms"), 3);

    // Broadcast from rank 2, reduce (max) to rank 1, all-gather, reduce-scatter.
    type Bcast = unsafe extern "C" fn(u64, u64, usize, c_uint, c_int, Ptr, Ptr) -> Res;
    type Reduce = unsafe extern "C" fn(u64, u64, usize, c_uint, c_uint, c_int, Ptr, Ptr) -> Res;
    type Gather = unsafe extern "C" fn(u64, u64, usize, c_uint, Ptr, Ptr) -> Res;
    type Scatter = unsafe extern "C" fn(u64, u64, usize, c_uint, c_uint, Ptr, Ptr) -> Res;
    let (bcast, reduce, gather, scatter): (Bcast, Reduce, Gather, Scatter) =
        (sim.f("ncclBroadcast"), sim.f("ncclReduce"), sim.f("ncclAllGather"), sim.f("ncclReduceScatter"));
    let ints = |r: usize| -> Vec<u8> { [r as i32 * 10 - 7, 3 - r as i32].iter().flat_map(|x| x.to_ne_bytes()).collect() };
    let src: Vec<u64> = (0..DEVICES).map(|r| sim.upload(r, &ints(r))).collect();
    let out: Vec<u64> = (0..DEVICES).map(|r| sim.upload(r, &[0xAB; 8])).collect();
    let wide: Vec<u64> = (0..DEVICES).map(|r| sim.upload(r, &[0; 24])).collect();
    let ((), end) = sim.group(|| unsafe {
        for r in 0..DEVICES {
            assert_eq!(bcast(bufs[r], bufs[r], 6, F32, 2, comms[r], sim.streams[r]), 0);
            assert_eq!(reduce(src[r], out[r], 2, I32, MAX, 1, comms[r], sim.streams[r]), 0);
            assert_eq!(gather(src[r], wide[r], 2, I32, comms[r], sim.streams[r]), 0);
        }
    });
    assert_eq!(end, 0);
    for r in 0..DEVICES {
        assert_eq!(to_f32s(&sim.download(r, bufs[r], 24)), sum, "broadcast leaves the sum everywhere");
        let got = sim.download(r, out[r], 8);
        if r == 1 {
            assert_eq!(got, [13i32, 3].iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>(), "reduce's root");
        } else {
            assert_eq!(got, vec![0xAB; 8], "reduce writes the root only");
        }
        assert_eq!(sim.download(r, wide[r], 24), (0..DEVICES).flat_map(ints).collect::<Vec<u8>>(), "all-gather on rank {r}");
    }
    let halves: Vec<u64> = (0..DEVICES).map(|r| sim.upload(r, &[0; 8])).collect();
    let ((), end) = sim.group(|| unsafe {
        for r in 0..DEVICES {
            assert_eq!(scatter(wide[r], halves[r], 2, I32, SUM, comms[r], sim.streams[r]), 0);
        }
    });
    assert_eq!(end, 0);
    let all: Vec<i32> = (0..DEVICES).flat_map(|r| [r as i32 * 10 - 7, 3 - r as i32]).collect();
    for r in 0..DEVICES {
        let want: Vec<u8> = all[2 * r..2 * r + 2].iter().flat_map(|v| (v * DEVICES as i32).to_ne_bytes()).collect();
        assert_eq!(sim.download(r, halves[r], 8), want, "reduce-scatter block {r}");
    }

    // NCCL's semantics: a NaN loses a float max, u8 sums wrap, avg divides,
    // half types round once per step.
    let pair = sim.comms(&[2, 0]);
    let a = sim.upload(2, &f32s(&[f32::NAN, 1.0]));
    let b = sim.upload(0, &f32s(&[2.0, f32::NAN]));
    let c = sim.upload(2, &[200, 1]);
    let d = sim.upload(0, &[100, 2]);
    let e = sim.upload(2, &f32s(&[3.0, -1.0]));
    let g = sim.upload(0, &f32s(&[4.0, 2.0]));
    let hbits = |v: &[f32], bf: bool| -> Vec<u8> {
        v.iter().flat_map(|&x| if bf { half::bf16::from_f32(x).to_ne_bytes() } else { half::f16::from_f32(x).to_ne_bytes() }).collect()
    };
    let h1 = sim.upload(2, &hbits(&[2048.0, 256.0], false));
    let h2 = sim.upload(0, &hbits(&[1.0, 1.0], false));
    let b1 = sim.upload(2, &hbits(&[256.0, 1.0], true));
    let b2 = sim.upload(0, &hbits(&[1.0, 1.0], true));
    let ((), end) = sim.group(|| {
        for (r, (x, y, z, h, bf)) in [(a, c, e, h1, b1), (b, d, g, h2, b2)].into_iter().enumerate() {
            let s = sim.streams[[2, 0][r]];
            assert_eq!(sim.all_reduce(x, x, 2, F32, MAX, pair[r], s), 0);
            assert_eq!(sim.all_reduce(y, y, 2, U8, SUM, pair[r], s), 0);
            assert_eq!(sim.all_reduce(z, z, 2, F32, AVG, pair[r], s), 0);
            assert_eq!(sim.all_reduce(h, h, 2, F16, SUM, pair[r], s), 0);
            assert_eq!(sim.all_reduce(bf, bf, 2, BF16, SUM, pair[r], s), 0);
        }
    });
    assert_eq!(end, 0);
    for (dev, x, y, z, h, bf) in [(2, a, c, e, h1, b1), (0, b, d, g, h2, b2)] {
        assert_eq!(to_f32s(&sim.download(dev, x, 8)), vec![2.0, 1.0], "fmax: the NaN loses");
        assert_eq!(sim.download(dev, y, 2), vec![44, 3]);
        assert_eq!(to_f32s(&sim.download(dev, z, 8)), vec![3.5, 0.5]);
        // 2048 + 1 is a tie in f16 (spacing 2): even, 2048; 256 + 1 in bf16 likewise.
        assert_eq!(sim.download(dev, h, 4), hbits(&[2048.0, 257.0], false));
        assert_eq!(sim.download(dev, bf, 4), hbits(&[256.0, 2.0], true));
    }
    assert_eq!(sim.stat("nccl_collectives"), 1 + 3 + 1 + 5);
}

/// Refusals at the call, with the reason; a refused call in a group drops
/// the whole group.
fn errors(sim: &Sim) {
    let comms = sim.comms(&[0, 1]);
    let buf: Vec<u64> = (0..2).map(|r| sim.upload(r, &f32s(&[1.0, 2.0]))).collect();
    assert_eq!(sim.all_reduce(buf[0], buf[0], 2, F32, SUM, 0x1234 as Ptr, sim.streams[0]), INVALID_ARGUMENT);
    assert!(sim.last_error().contains("invalid communicator"), "{}", sim.last_error());
    assert_eq!(sim.all_reduce(buf[0], buf[0], 2, 42, SUM, comms[0], sim.streams[0]), INVALID_ARGUMENT);
    assert_eq!(sim.all_reduce(buf[0], buf[0], 2, F32, 9, comms[0], sim.streams[0]), INVALID_ARGUMENT);
    assert_eq!(sim.all_reduce(0, buf[0], 2, F32, SUM, comms[0], sim.streams[0]), INVALID_ARGUMENT);
    assert_eq!(sim.all_reduce(buf[0], buf[0], 2, F32, SUM, comms[0], sim.streams[1]), UNHANDLED_CUDA);
    assert!(sim.last_error().contains("a stream of device 1 given to the communicator of device 0"), "{}", sim.last_error());
    type Bcast = unsafe extern "C" fn(u64, u64, usize, c_uint, c_int, Ptr, Ptr) -> Res;
    assert_eq!(unsafe { sim.f::<Bcast>("ncclBroadcast")(buf[0], buf[0], 2, F32, 2, comms[0], sim.streams[0]) }, INVALID_ARGUMENT);
    assert_eq!(unsafe { sim.f::<unsafe extern "C" fn() -> Res>("ncclGroupEnd")() }, INVALID_USAGE);
    let mut two = [std::ptr::null_mut(); 2];
    let init: unsafe extern "C" fn(*mut Ptr, c_int, *const c_int) -> Res = sim.f("ncclCommInitAll");
    assert_eq!(unsafe { init(two.as_mut_ptr(), 2, [1, 1].as_ptr()) }, INVALID_USAGE);
    assert_eq!(unsafe { init(two.as_mut_ptr(), 1, [7].as_ptr()) }, INVALID_ARGUMENT);
    // Rank 0 accepted, rank 1 refused: the group ends in the error, and rank
    // 0's part never runs (it would wait for rank 1 forever).
    let (codes, end) = sim.group(|| {
        [
            sim.all_reduce(buf[0], buf[0], 2, F32, SUM, comms[0], sim.streams[0]),
            sim.all_reduce(buf[1], buf[1], 2, 42, SUM, comms[1], sim.streams[1]),
        ]
    });
    assert_eq!((codes, end), ([0, INVALID_ARGUMENT], INVALID_ARGUMENT));
    assert!(sim.last_error().contains("nothing of the group was queued"), "{}", sim.last_error());
    for r in 0..2 {
        assert_eq!(to_f32s(&sim.download(r, buf[r], 8)), vec![1.0, 2.0]);
    }
    assert_eq!(sim.stat("nccl_collectives"), 0);
    // The communicators still work, and their next collective is their first.
    let ((), end) = sim.group(|| {
        for r in 0..2 {
            assert_eq!(sim.all_reduce(buf[r], buf[r], 2, F32, SUM, comms[r], sim.streams[r]), 0);
        }
    });
    assert_eq!(end, 0);
    assert_eq!(to_f32s(&sim.download(1, buf[1], 8)), vec![2.0, 4.0]);
    type Destroy = unsafe extern "C" fn(Ptr) -> Res;
    assert_eq!(unsafe { sim.f::<Destroy>("ncclCommDestroy")(comms[0]) }, 0);
    assert_eq!(unsafe { sim.f::<Destroy>("ncclCommDestroy")(comms[0]) }, INVALID_ARGUMENT);
}

/// A collective runs when every rank's stream reaches it: one stream held
/// on a value in mapped memory holds it back for everyone.
fn ordering(sim: &Sim) {
    let comms = sim.comms(&[0, 1]);
    let buf: Vec<u64> = (0..2).map(|r| sim.upload(r, &f32s(&[1.0]))).collect();
    sim.bind(0);
    let mut host: Ptr = std::ptr::null_mut();
    let mut dev = 0u64;
    unsafe {
        assert_eq!(sim.f::<unsafe extern "C" fn(*mut Ptr, usize, c_uint) -> Res>("cuMemHostAlloc")(&mut host, 4, 2), 0);
        *(host as *mut u32) = 0;
        assert_eq!(sim.f::<unsafe extern "C" fn(*mut u64, Ptr, c_uint) -> Res>("cuMemHostGetDevicePointer_v2")(&mut dev, host, 0), 0);
        type Wait = unsafe extern "C" fn(Ptr, u64, u32, c_uint) -> Res;
        assert_eq!(sim.f::<Wait>("cuStreamWaitValue32_v2")(sim.streams[0], dev, 1, 0), 0);
    }
    let ((), end) = sim.group(|| {
        for r in 0..2 {
            assert_eq!(sim.all_reduce(buf[r], buf[r], 1, F32, SUM, comms[r], sim.streams[r]), 0);
        }
    });
    assert_eq!(end, 0);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(sim.stat("nccl_collectives"), 0, "ran before rank 0's stream reached it");
    unsafe { std::ptr::write_volatile(host as *mut u32, 1) };
    assert_eq!(to_f32s(&sim.download(1, buf[1], 4)), vec![2.0]);
    assert_eq!(sim.stat("nccl_collectives"), 1);
}

/// Failures on the streams fault every waiting rank's context instead of
/// hanging or moving data: ranks that called different collectives, a
/// freed buffer, and (with a 1 s timeout) a rank that never arrives.
fn failures(sim: &Sim) {
    let comms = sim.comms(&[0, 1]);
    let buf: Vec<u64> = (0..2).map(|r| sim.upload(r, &f32s(&[1.0, 2.0]))).collect();
    // Rank 0 sums 2 elements, rank 1 one: a GPU hangs or corrupts; here both fault.
    let ((), end) = sim.group(|| {
        assert_eq!(sim.all_reduce(buf[0], buf[0], 2, F32, SUM, comms[0], sim.streams[0]), 0);
        assert_eq!(sim.all_reduce(buf[1], buf[1], 1, F32, SUM, comms[1], sim.streams[1]), 0);
    });
    assert_eq!(end, 0);
    assert_eq!((sim.sync(0), sim.sync(1)), (LAUNCH_FAILED, LAUNCH_FAILED));
    let mut err = 0u32;
    type AsyncError = unsafe extern "C" fn(Ptr, *mut u32) -> Res;
    assert_eq!(unsafe { sim.f::<AsyncError>("ncclCommGetAsyncError")(comms[0], &mut err) }, 0);
    assert_eq!(err, UNHANDLED_CUDA);
}

fn timeout(sim: &Sim) {
    let comms = sim.comms(&[1, 2]);
    let buf = sim.upload(1, &f32s(&[1.0]));
    // Rank 0 alone (no group, and rank 1 never called): it waits 1 s, then faults.
    let start = std::time::Instant::now();
    assert_eq!(sim.all_reduce(buf, buf, 1, F32, SUM, comms[0], sim.streams[1]), 0);
    assert_eq!(sim.sync(1), LAUNCH_FAILED);
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
    assert_eq!(sim.sync(2), 0, "the rank that never arrived is untouched");
}

fn bad_buffer(sim: &Sim) {
    let comms = sim.comms(&[0, 1]);
    let good = sim.upload(0, &f32s(&[1.0]));
    let freed = sim.upload(1, &f32s(&[5.0]));
    sim.bind(1);
    assert_eq!(unsafe { sim.f::<unsafe extern "C" fn(u64) -> Res>("cuMemFree_v2")(freed) }, 0);
    let ((), end) = sim.group(|| {
        assert_eq!(sim.all_reduce(good, good, 1, F32, SUM, comms[0], sim.streams[0]), 0);
        assert_eq!(sim.all_reduce(freed, freed, 1, F32, SUM, comms[1], sim.streams[1]), 0);
    });
    assert_eq!(end, 0);
    assert_eq!((sim.sync(0), sim.sync(1)), (LAUNCH_FAILED, LAUNCH_FAILED));
}

fn main() -> ExitCode {
    if let Ok(scenario) = std::env::var(SCENARIO) {
        let sim = Sim::open();
        match scenario.as_str() {
            "collectives" => collectives(&sim),
            "errors" => errors(&sim),
            "ordering" => ordering(&sim),
            "failures" => failures(&sim),
            "timeout" => timeout(&sim),
            "bad_buffer" => bad_buffer(&sim),
            other => panic!("unknown scenario {other}"),
        }
        println!("SCENARIO-OK");
        return ExitCode::SUCCESS;
    }
    let scenario = |name: &'static str, test: &'static str| {
        Trial::test(name, move || {
            let out = Command::new(std::env::current_exe().unwrap())
                .env(SCENARIO, test)
                .env("KILN_CUDASIM", "1")
                .env("KILN_CUDASIM_DEVICES", DEVICES.to_string())
                .env("KILN_CUDASIM_QUIET", "1")
                .env("KILN_CUDASIM_NCCL_TIMEOUT", "1")
                .env_remove("KILN_CUDASIM_FAIL")
                .env_remove("KILN_CUDASIM_MEMORY")
                .output()
                .unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            if out.status.success() && text.contains("SCENARIO-OK") {
                Ok(())
            } else {
                Err(format!("scenario {test}:\n{text}").into())
            }
        })
    };
    let trials = vec![
        scenario("every_collective_computes_nccls_values_once_for_every_rank", "collectives"),
        scenario("calls_are_checked_when_made_and_a_refused_call_drops_its_group", "errors"),
        scenario("a_collective_waits_for_every_ranks_stream", "ordering"),
        scenario("ranks_that_disagree_fault_their_contexts", "failures"),
        scenario("a_rank_that_never_arrives_faults_the_others_after_the_timeout", "timeout"),
        scenario("a_freed_buffer_faults_every_rank_of_the_collective", "bad_buffer"),
    ];
    libtest_mimic::run(&Arguments::from_args(), trials).exit_code()
}
