//! What the simulator's test binaries share: the simulator library loaded
//! as a process loads it, the driver, NVRTC and cuBLAS calls they make
//! through it, and a small fake NVRTC (compiled here with g++) standing in
//! for the real one.
#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A stand-in for NVRTC: "compiles" a source into PTX text with an `.entry`
/// for each `__global__ void NAME(` and the source as comments (so that two
/// sources never make the same image); rejects sources that say
/// NVRTC_REJECTS. It has no CUBIN functions, as an old NVRTC.
pub const FAKE_NVRTC: &str = r#"
#include <stdlib.h>
#include <string.h>
#include <string>
struct Prog { std::string src, ptx; };
extern "C" {
int nvrtcVersion(int* a, int* b) { *a = 12; *b = 9; return 0; }
const char* nvrtcGetErrorString(int r) { return r ? "FAKE_NVRTC_ERROR" : "FAKE_NVRTC_SUCCESS"; }
int nvrtcGetNumSupportedArchs(int* n) { *n = 1; return 0; }
int nvrtcGetSupportedArchs(int* a) { a[0] = 90; return 0; }
int nvrtcCreateProgram(Prog** p, const char* src, const char*, int, const char* const*, const char* const*) {
    *p = new Prog{src, ""};
    return 0;
}
int nvrtcDestroyProgram(Prog** p) { delete *p; *p = 0; return 0; }
int nvrtcCompileProgram(Prog* p, int, const char* const*) {
    if (p->src.find("NVRTC_REJECTS") != std::string::npos) return 6;
    p->ptx = ".version 8.0\n.target sm_90\n";
    size_t at = 0;
    const std::string marker = "__global__ void ";
    while ((at = p->src.find(marker, at)) != std::string::npos) {
        at += marker.size();
        size_t end = p->src.find('(', at);
        p->ptx += ".visible .entry " + p->src.substr(at, end - at) + "(\n";
    }
    for (char c : p->src) { p->ptx += c; if (c == '\n') p->ptx += "// "; }
    return 0;
}
int nvrtcGetPTXSize(Prog* p, size_t* n) { *n = p->ptx.size() + 1; return 0; }
int nvrtcGetPTX(Prog* p, char* out) { memcpy(out, p->ptx.c_str(), p->ptx.size() + 1); return 0; }
int nvrtcGetProgramLogSize(Prog*, size_t* n) { *n = 9; return 0; }
int nvrtcGetProgramLog(Prog*, char* out) { memcpy(out, "fake log", 9); return 0; }
}
"#;

pub type Res = c_int;
pub type Prog = *mut c_void;

/// The simulator library as a process would load it, and the functions
/// these tests call.
pub struct Sim {
    pub lib: *mut c_void,
}

impl Sim {
    pub fn open() -> Sim {
        let path = CString::new(sim_library().to_string_lossy().as_bytes()).unwrap();
        // SAFETY: dlopen of the simulator, as cudarc does.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!lib.is_null(), "cannot dlopen {}", sim_library().display());
        Sim { lib }
    }

    /// The simulator's function `name` as `F`.
    pub fn f<F: Copy>(&self, name: &str) -> F {
        let c = CString::new(name).unwrap();
        // SAFETY: a live handle; the caller names the C signature as F.
        let p = unsafe { libc::dlsym(self.lib, c.as_ptr()) };
        assert!(!p.is_null(), "the simulator lacks {name}");
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        unsafe { std::mem::transmute_copy(&p) }
    }

    pub fn stat(&self, what: &str) -> i64 {
        let c = CString::new(what).unwrap();
        unsafe { self.f::<unsafe extern "C" fn(*const c_char) -> i64>("kiln_cudasim_stat")(c.as_ptr()) }
    }

    /// Compiles `source` with `options` through the NVRTC stand-in; the PTX
    /// image, or NVRTC's result code.
    pub fn nvrtc_ptx(&self, source: &str, options: &[&str]) -> Result<Vec<u8>, Res> {
        self.nvrtc_image(source, options, false)
    }

    /// Like [`Self::nvrtc_ptx`], or the cubin when `cubin`.
    pub fn nvrtc_image(&self, source: &str, options: &[&str], cubin: bool) -> Result<Vec<u8>, Res> {
        unsafe {
            let create: unsafe extern "C" fn(
                *mut Prog,
                *const c_char,
                *const c_char,
                c_int,
                *const *const c_char,
                *const *const c_char,
            ) -> Res = self.f("nvrtcCreateProgram");
            let compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Res = self.f("nvrtcCompileProgram");
            let (size_name, get_name) = if cubin { ("nvrtcGetCUBINSize", "nvrtcGetCUBIN") } else { ("nvrtcGetPTXSize", "nvrtcGetPTX") };
            let size: unsafe extern "C" fn(Prog, *mut usize) -> Res = self.f(size_name);
            let get: unsafe extern "C" fn(Prog, *mut c_char) -> Res = self.f(get_name);
            let destroy: unsafe extern "C" fn(*mut Prog) -> Res = self.f("nvrtcDestroyProgram");
            let src = CString::new(source).unwrap();
            let mut prog: Prog = std::ptr::null_mut();
            let r = create(&mut prog, src.as_ptr(), c"test_module.cu".as_ptr(), 0, std::ptr::null(), std::ptr::null());
            if r != 0 {
                return Err(r);
            }
            let opts: Vec<CString> = options.iter().map(|o| CString::new(*o).unwrap()).collect();
            let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
            let r = compile(prog, ptrs.len() as c_int, ptrs.as_ptr());
            if r != 0 {
                destroy(&mut prog);
                return Err(r);
            }
            let mut n = 0usize;
            assert_eq!(size(prog, &mut n), 0);
            let mut ptx = vec![0u8; n];
            assert_eq!(get(prog, ptx.as_mut_ptr() as *mut c_char), 0);
            assert_eq!(destroy(&mut prog), 0);
            Ok(ptx)
        }
    }

    /// cuInit and device 0's primary context made current.
    pub fn init(&self) -> Result<(), u32> {
        unsafe {
            let init: unsafe extern "C" fn(c_uint) -> u32 = self.f("cuInit");
            let retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> u32 = self.f("cuDevicePrimaryCtxRetain");
            let set: unsafe extern "C" fn(*mut c_void) -> u32 = self.f("cuCtxSetCurrent");
            check(init(0))?;
            let mut ctx = std::ptr::null_mut();
            check(retain(&mut ctx, 0))?;
            check(set(ctx))
        }
    }

    pub fn load(&self, image: &[u8]) -> Result<*mut c_void, u32> {
        let load: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> u32 = self.f("cuModuleLoadData");
        let mut module = std::ptr::null_mut();
        check(unsafe { load(&mut module, image.as_ptr() as *const c_void) })?;
        Ok(module)
    }

    pub fn function(&self, module: *mut c_void, name: &str) -> Result<*mut c_void, u32> {
        let get: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> u32 = self.f("cuModuleGetFunction");
        let name = CString::new(name).unwrap();
        let mut f = std::ptr::null_mut();
        check(unsafe { get(&mut f, module, name.as_ptr()) })?;
        Ok(f)
    }

    /// Device memory holding `bytes`.
    pub fn upload(&self, bytes: &[u8]) -> u64 {
        let alloc: unsafe extern "C" fn(*mut u64, usize) -> u32 = self.f("cuMemAlloc_v2");
        let htod: unsafe extern "C" fn(u64, *const c_void, usize) -> u32 = self.f("cuMemcpyHtoD_v2");
        let mut dev = 0u64;
        unsafe {
            assert_eq!(alloc(&mut dev, bytes.len()), 0);
            assert_eq!(htod(dev, bytes.as_ptr() as *const c_void, bytes.len()), 0);
        }
        dev
    }

    /// `len` bytes of device memory at `dev`, after the work queued before.
    pub fn download(&self, dev: u64, len: usize) -> Vec<u8> {
        let dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> u32 = self.f("cuMemcpyDtoH_v2");
        let mut out = vec![0u8; len];
        assert_eq!(unsafe { dtoh(out.as_mut_ptr() as *mut c_void, dev, len) }, 0);
        out
    }

    /// Queues kernel `name` of `module` on the default stream; `args` point
    /// at the argument values.
    pub fn launch(&self, module: *mut c_void, name: &str, grid: c_uint, block: c_uint, args: &mut [*mut c_void]) {
        type Launch = unsafe extern "C" fn(
            *mut c_void,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            *mut c_void,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> u32;
        let launch: Launch = self.f("cuLaunchKernel");
        let f = self.function(module, name).unwrap();
        let r = unsafe { launch(f, grid, 1, 1, block, 1, 1, 0, std::ptr::null_mut(), args.as_mut_ptr(), std::ptr::null_mut()) };
        assert_eq!(r, 0, "launching {name}");
    }
}

pub fn check(r: u32) -> Result<(), u32> {
    if r == 0 {
        Ok(())
    } else {
        Err(r)
    }
}

/// target/debug/libkiln_cudasim.so, next to this test's own folder.
pub fn sim_library() -> PathBuf {
    // `cargo test` builds the library beside this test (target/<profile>/deps:
    // the crate is also an rlib so that cargo builds it for its tests at all);
    // `cargo build` puts it one folder up.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let beside = deps.join("libkiln_cudasim.so");
    if beside.exists() {
        return beside;
    }
    deps.parent().unwrap().join("libkiln_cudasim.so")
}

/// The fake NVRTC, compiled into `dir`.
pub fn fake_nvrtc(dir: &Path) -> PathBuf {
    let src = dir.join("fake_nvrtc.cpp");
    let lib = dir.join("libfake_nvrtc.so");
    std::fs::write(&src, FAKE_NVRTC).unwrap();
    let out =
        Command::new("g++").args(["-shared", "-fPIC", "-O1", "-o"]).arg(&lib).arg(&src).output().expect("g++ (the simulator needs it too)");
    assert!(out.status.success(), "building the fake NVRTC failed:\n{}", String::from_utf8_lossy(&out.stderr));
    lib
}

/// Leaves out the simulator settings of the environment this test runs in
/// (under scripts/cudasim.sh there are some): each scenario sets its own.
pub fn clean_env(cmd: &mut Command) {
    for k in [
        "KILN_CUDASIM_NVRTC",
        "KILN_CUDASIM_CXX",
        "KILN_CUDASIM_CACHE",
        "KILN_CUDASIM_FAIL",
        "KILN_CUDASIM_QUIET",
        "KILN_CUDASIM_DEVICES",
        "KILN_CUDASIM_TIGHT",
        "KILN_CUDASIM_CENSUS",
    ] {
        cmd.env_remove(k);
    }
}
