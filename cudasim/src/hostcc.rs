//! The host compiler and its cache: turns the CUDA C++ source of a module
//! (whatever kiln compiled with NVRTC) into a shared library for the CPU and
//! loads it.
//!
//! The source is pasted between `shim/cuda_shim.h` (enough CUDA C++ for g++)
//! and `shim/launch.hpp` (launch glue), followed by a generated table of its
//! `__global__` kernels, whose names are found by preprocessing the source
//! and whose argument lists the C++ compiler deduces from each kernel's own
//! signature. g++ compiles that with the flags kiln's kernels are written
//! for (no contraction, as NVRTC's `--fmad=false`; wrapping integers), and
//! the library is dlopened and never closed (its kernels may run until the
//! process ends, and closing libraries with thread-locals invites trouble).
//!
//! Each library is compiled once per machine: it is kept in the cache folder
//! (`KILN_CUDASIM_CACHE`, else `$XDG_CACHE_HOME/kiln-cudasim`, else
//! `~/.cache/kiln-cudasim`) under a hash of everything that decides its
//! contents (the source, its options, the shim, the glue, the flags — the
//! launch census's instrumentation included — and the compiler's version), written through a temporary file and a rename, and
//! built under a per-key file lock so that concurrent test processes do not
//! compile the same source twice. Within a process a module is built once
//! and shared by every context; a failure is remembered too, so kiln's retry
//! with PTX does not run g++ again on a source it rejected.

use crate::nvrtc::fn_ptr;
use crate::sources::{fnv128, Source};
use crate::{exec, lock, log, log_always, CUresult, INVALID_PTX, JIT_COMPILER_NOT_FOUND};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString, OsString};
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Kernel modules this process compiled with the host compiler.
pub(crate) static COMPILES: AtomicU64 = AtomicU64::new(0);
/// Kernel modules this process found already compiled in the disk cache.
pub(crate) static CACHE_HITS: AtomicU64 = AtomicU64::new(0);

const SHIM: &str = include_str!("../shim/cuda_shim.h");
const LAUNCH: &str = include_str!("../shim/launch.hpp");
/// Names the generated table's layout and the loader's expectations: part of
/// every cache key, so that a simulator that reads tables differently never
/// loads a library an older one wrote. `kiln_sim_abi` in launch.hpp too.
const GENERATOR: &str = "kiln-cudasim host module, table abi 3";
const ABI: c_int = 3;
/// The flags kiln's kernels are compiled with for the host: C++17 as NVRTC
/// is given, no contraction of a*b+c (NVRTC runs with --fmad=false), no C++
/// exceptions, wrapping signed integers and no type-based alias analysis
/// (kernels reinterpret bits), a shared library exporting only the table
/// (`-fvisibility=hidden`, so that no kernel name can be interposed by a
/// symbol of the process), no undefined symbol left for dlopen to fail on,
/// and stack clash protection: a frame larger than a page touches each page
/// as it grows, so a kernel that overflows its fiber's stack faults on the
/// stack's guard page (and is reported, `exec`) instead of jumping past it
/// into other memory.
const FLAGS: [&str; 12] = [
    "-std=c++17",
    "-fstack-clash-protection",
    "-ffp-contract=off",
    "-fno-exceptions",
    "-fwrapv",
    "-fno-strict-aliasing",
    "-O2",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-w",
    "-Wl,-z,defs",
];

/// The extra flag of the launch census (`KILN_CUDASIM_CENSUS=1`): g++ calls
/// `__sanitizer_cov_trace_pc` (launch.hpp) at every basic block, so the
/// simulator can count each GPU thread's work (`census`).
const CENSUS_FLAG: &str = "-fsanitize-coverage=trace-pc";

/// The flags of this process's modules: [`FLAGS`], and [`CENSUS_FLAG`] when
/// the census is on (part of the cache key, so that instrumented and plain
/// libraries never mix).
fn flags() -> Vec<&'static str> {
    let mut f = FLAGS.to_vec();
    if crate::census::enabled() {
        f.push(CENSUS_FLAG);
    }
    f
}

/// Why a module could not be had: the driver error code and the message.
pub(crate) type Failure = (CUresult, String);

/// One kernel of a host module.
pub(crate) struct KernelInfo {
    pub index: usize,
    /// Size in bytes of each argument, in order.
    pub sizes: Vec<usize>,
    /// Whether each argument is a pointer (checked against device memory).
    pub is_ptr: Vec<bool>,
}

type RunThread = unsafe extern "C" fn(c_int, *const *mut c_void);
type SetIds = unsafe extern "C" fn(c_uint, c_uint, c_uint, c_uint);
type Work = unsafe extern "C" fn() -> u64;

/// A module's source compiled for the host and loaded.
pub(crate) struct HostModule {
    pub kernels: HashMap<String, KernelInfo>,
    run_thread: RunThread,
    set_ids: SetIds,
    work: Work,
}

/// The table entry `kiln_sim_kernel` returns (`KilnSimKernel` in launch.hpp).
#[repr(C)]
struct KernelEntry {
    name: *const c_char,
    fun: *const c_void,
    invoke: *const c_void,
    nargs: c_int,
    sizes: *const usize,
    is_ptr: *const u8,
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a C string valid until the next dl call.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl HostModule {
    /// Loads a library this module's compiler wrote and reads its table.
    fn open(path: &Path) -> Result<HostModule, String> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| "the path contains a NUL byte".to_string())?;
        // SAFETY: dlopen of a library we generated; it has no constructors
        // beyond the C++ runtime's.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("dlopen failed: {}", dlerror()));
        }
        // SAFETY: `handle` is live; each symbol has the C signature launch.hpp
        // gives it. On any failure the library is closed again, so that a
        // rebuilt file at the same path is really reopened.
        unsafe {
            let table = Self::read_table(handle);
            match table {
                Ok((kernels, run_thread, set_ids, work)) => Ok(HostModule { kernels, run_thread, set_ids, work }),
                Err(e) => {
                    libc::dlclose(handle);
                    Err(e)
                }
            }
        }
    }

    /// # Safety
    /// `handle` must be a live dlopen handle.
    unsafe fn read_table(handle: *mut c_void) -> Result<(HashMap<String, KernelInfo>, RunThread, SetIds, Work), String> {
        unsafe {
            let sym = |name: &CStr| -> Result<*mut c_void, String> {
                let p = libc::dlsym(handle, name.as_ptr());
                if p.is_null() {
                    Err(format!("it lacks {} (not a module this simulator wrote)", name.to_string_lossy()))
                } else {
                    Ok(p)
                }
            };
            let abi: unsafe extern "C" fn() -> c_int = fn_ptr(sym(c"kiln_sim_abi")?);
            if abi() != ABI {
                return Err(format!("its table is version {}, not {ABI}", abi()));
            }
            let count: unsafe extern "C" fn() -> c_int = fn_ptr(sym(c"kiln_sim_kernel_count")?);
            let entry: unsafe extern "C" fn(c_int) -> *const KernelEntry = fn_ptr(sym(c"kiln_sim_kernel")?);
            let run_thread: RunThread = fn_ptr(sym(c"kiln_sim_run_thread")?);
            let set_ids: SetIds = fn_ptr(sym(c"kiln_sim_set_ids")?);
            let work: Work = fn_ptr(sym(c"kiln_sim_work")?);
            let bind: unsafe extern "C" fn(extern "C" fn()) = fn_ptr(sym(c"kiln_sim_bind")?);
            bind(exec::syncthreads);
            let mut kernels = HashMap::new();
            for i in 0..count().max(0) {
                let e = &*entry(i);
                let n = e.nargs.clamp(0, 4096) as usize;
                if e.name.is_null() || (n > 0 && (e.sizes.is_null() || e.is_ptr.is_null())) {
                    return Err(format!("entry {i} of its table is damaged"));
                }
                let name = CStr::from_ptr(e.name).to_string_lossy().into_owned();
                let sizes = std::slice::from_raw_parts(e.sizes, n).to_vec();
                let is_ptr = std::slice::from_raw_parts(e.is_ptr, n).iter().map(|&b| b != 0).collect();
                kernels.insert(name, KernelInfo { index: i as usize, sizes, is_ptr });
            }
            Ok((kernels, run_thread, set_ids, work))
        }
    }

    /// The function that runs one GPU thread of kernel `index`, for fibers
    /// (which need a `'static` callee, not a borrow of the module).
    pub(crate) fn run_thread_fn(&self) -> RunThread {
        self.run_thread
    }

    /// Sets the thread-local `threadIdx`, `blockIdx`, `blockDim`, `gridDim`
    /// that the module's kernels read.
    pub(crate) fn set_ids(&self, tx: u32, bx: u32, block: u32, grid: u32) {
        // SAFETY: plain stores into the module's thread-locals.
        unsafe { (self.set_ids)(tx, bx, block, grid) }
    }

    /// The basic blocks the module's instrumented code has executed on the
    /// calling thread so far (always 0 unless it was built for the census).
    pub(crate) fn work(&self) -> u64 {
        // SAFETY: a plain read of the module's thread-local counter.
        unsafe { (self.work)() }
    }
}

// ---- the compiler --------------------------------------------------------------------

/// A host C++ compiler that answered `--version`.
pub(crate) struct Compiler {
    program: OsString,
    /// `--version`'s first line and `-dumpmachine`: part of every cache key,
    /// so that an upgraded compiler rebuilds.
    identity: String,
}

impl Compiler {
    pub(crate) fn find(program: &OsString) -> Result<Compiler, Failure> {
        let ask = |arg: &str| -> Result<String, Failure> {
            let out = Command::new(program).arg(arg).stdin(Stdio::null()).output().map_err(|e| {
                (
                    JIT_COMPILER_NOT_FOUND,
                    format!(
                        "cannot run the host compiler `{}` ({e}): the simulator compiles kiln's kernels with it at run time; install g++ \
                         (apt-get install g++) or name another with KILN_CUDASIM_CXX",
                        program.to_string_lossy()
                    ),
                )
            })?;
            if !out.status.success() {
                return Err((JIT_COMPILER_NOT_FOUND, format!("`{} {arg}` failed ({})", program.to_string_lossy(), out.status)));
            }
            Ok(String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().trim().to_string())
        };
        let identity = format!("{} / {}", ask("--version")?, ask("-dumpmachine")?);
        Ok(Compiler { program: program.clone(), identity })
    }

    /// Runs the compiler with `args`, its output into files so that no pipe
    /// can fill up, for at most `limit`. Returns what it said on stderr, as
    /// the error when it failed.
    fn run(&self, args: &[OsString], log_file: &Path, limit: Duration) -> Result<(), String> {
        let stderr = File::create(log_file).map_err(|e| format!("cannot create {} ({e})", log_file.display()))?;
        let mut child = Command::new(&self.program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot run `{}` ({e})", self.program.to_string_lossy()))?;
        let start = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if start.elapsed() > limit => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("`{}` ran for more than {} s and was stopped", self.program.to_string_lossy(), limit.as_secs()));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(format!("waiting for `{}` failed ({e})", self.program.to_string_lossy())),
            }
        };
        if status.success() {
            return Ok(());
        }
        let said = std::fs::read(log_file).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
        Err(format!("`{}` failed ({status}):\n{}", self.program.to_string_lossy(), said.trim_end()))
    }
}

/// The compiler the simulator uses: `KILN_CUDASIM_CXX`, else `g++`.
fn compiler() -> Result<&'static Compiler, Failure> {
    static CXX: OnceLock<Result<Compiler, Failure>> = OnceLock::new();
    CXX.get_or_init(|| {
        let program = std::env::var_os("KILN_CUDASIM_CXX").filter(|p| !p.is_empty()).unwrap_or_else(|| "g++".into());
        Compiler::find(&program)
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// How long one compiler run may take (`KILN_CUDASIM_CXX_TIMEOUT` seconds,
/// 600): a wedged compiler must not hang the test suite.
fn time_limit() -> Duration {
    Duration::from_secs(std::env::var("KILN_CUDASIM_CXX_TIMEOUT").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(600))
}

// ---- the cache ---------------------------------------------------------------------------

/// The simulator's cache folder (created when missing). When the usual one
/// cannot be created, a folder of this process under the temporary folder:
/// every module is then compiled again by every process, but it works.
pub(crate) fn cache_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let wanted = std::env::var_os("KILN_CUDASIM_CACHE").filter(|d| !d.is_empty()).map(PathBuf::from).or_else(|| {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").filter(|d| !d.is_empty()).map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("kiln-cudasim"))
        });
        if let Some(dir) = wanted {
            // Created and writable (a read-only one would fail every compile).
            let probe = dir.join(format!(".probe.{}", std::process::id()));
            match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&probe, b"")) {
                Ok(()) => {
                    let _ = std::fs::remove_file(&probe);
                    return dir;
                }
                Err(e) => log(&format!("cannot write to the cache folder {} ({e}); using a temporary one", dir.display())),
            }
        }
        let dir = std::env::temp_dir().join(format!("kiln-cudasim-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        dir
    })
    .clone()
}

/// The cache key of `source` compiled by `cc`.
fn cache_key(source: &Source, cc: &Compiler) -> u128 {
    fnv128(&[
        GENERATOR.as_bytes(),
        SHIM.as_bytes(),
        LAUNCH.as_bytes(),
        flags().join(" ").as_bytes(),
        cc.identity.as_bytes(),
        source.name.as_bytes(),
        source.host_options.join("\n").as_bytes(),
        &source.text,
    ])
}

/// An exclusive advisory lock on a file, released when dropped (or when the
/// process dies, so a crashed compile never blocks the next one).
struct FileLock(File);

impl FileLock {
    /// Waits up to `limit` for the lock; None when it cannot be had (no
    /// locking on this file system, or a holder that takes too long), in
    /// which case the caller builds without it: a duplicate compile is
    /// waste, not harm, as results are renamed into place.
    fn acquire(path: &Path, limit: Duration) -> Option<FileLock> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path).ok()?;
        let start = Instant::now();
        loop {
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Some(FileLock(file));
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) || start.elapsed() > limit {
                log(&format!("building without the lock {} ({err})", path.display()));
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocking our own descriptor (closing it would too).
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Removes the listed files when dropped: the temporaries of a compile, on
/// every path out of it.
struct Scratch(Vec<PathBuf>);

impl Drop for Scratch {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

// ---- building a module ---------------------------------------------------------------------

/// The host module for `source`: built once per process (and once per
/// machine through the cache), shared by every context that loads it.
pub(crate) fn module_for(source: &Source) -> Result<Arc<HostModule>, Failure> {
    type Built = Arc<OnceLock<Result<Arc<HostModule>, Failure>>>;
    static BUILT: OnceLock<Mutex<HashMap<u128, Built>>> = OnceLock::new();
    let cc = compiler()?;
    let key = cache_key(source, cc);
    let cell = lock(BUILT.get_or_init(|| Mutex::new(HashMap::new()))).entry(key).or_default().clone();
    cell.get_or_init(|| build(source, cc, &cache_dir(), key, time_limit()).map(Arc::new)).clone()
}

/// Loads the module for `source` from `dir`, compiling it there first when
/// it is missing or unusable.
pub(crate) fn build(source: &Source, cc: &Compiler, dir: &Path, key: u128, limit: Duration) -> Result<HostModule, Failure> {
    let so = dir.join(format!("{key:032x}.so"));
    let from_cache = |so: &Path| -> Option<HostModule> {
        if !so.exists() {
            return None;
        }
        match HostModule::open(so) {
            Ok(m) => {
                CACHE_HITS.fetch_add(1, Ordering::Relaxed);
                Some(m)
            }
            Err(e) => {
                log(&format!("the cached module {} is unusable ({e}); compiling it again", so.display()));
                None
            }
        }
    };
    if let Some(m) = from_cache(&so) {
        return Ok(m);
    }
    let _lock = FileLock::acquire(&dir.join(format!("{key:032x}.lock")), limit);
    // Another process may have built it while this one waited for the lock.
    if let Some(m) = from_cache(&so) {
        return Ok(m);
    }
    let started = Instant::now();
    compile(source, cc, dir, key, &so, limit).map_err(|e| {
        log_always(&format!("cannot compile the kernels of `{}` for the host: {e}", source.name));
        (
            INVALID_PTX,
            format!("the kernels of `{}` could not be compiled for the host (the reason was logged when it first failed)", source.name),
        )
    })?;
    COMPILES.fetch_add(1, Ordering::Relaxed);
    log(&format!("compiled the kernels of `{}` for the host in {:.1} s ({})", source.name, started.elapsed().as_secs_f64(), so.display()));
    HostModule::open(&so).map_err(|e| {
        let msg = format!("the module compiled from `{}` cannot be loaded from {}: {e}", source.name, so.display());
        log_always(&msg);
        (INVALID_PTX, msg)
    })
}

/// Compiles `source` into the library `so` (through a temporary and a
/// rename, so that a concurrent reader never sees half a file).
fn compile(source: &Source, cc: &Compiler, dir: &Path, key: u128, so: &Path, limit: Duration) -> Result<(), String> {
    static SERIAL: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {} ({e})", dir.display()))?;
    let stem = format!(".{key:032x}.{}.{}", std::process::id(), SERIAL.fetch_add(1, Ordering::Relaxed));
    let part = |ext: &str| dir.join(format!("{stem}.{ext}"));
    let (module_cu, preprocessed, full_cpp, tmp_so, said) = (part("cu.cpp"), part("i"), part("cpp"), part("so.tmp"), part("log"));
    let _scratch = Scratch(vec![module_cu.clone(), preprocessed.clone(), full_cpp.clone(), tmp_so.clone(), said.clone()]);

    // The shim, then the source as NVRTC got it (messages cite its own lines).
    let mut text = Vec::with_capacity(SHIM.len() + source.text.len() + 64);
    text.extend_from_slice(SHIM.as_bytes());
    text.extend_from_slice(format!("\n#line 1 \"{}\"\n", source.name.replace(['"', '\\', '\n'], "_")).as_bytes());
    text.extend_from_slice(&source.text);
    text.push(b'\n');
    std::fs::write(&module_cu, &text).map_err(|e| format!("cannot write {} ({e})", module_cu.display()))?;

    // Kernel names: preprocess with `__global__` made visible.
    let mut args: Vec<OsString> = ["-E", "-P", "-x", "c++", "-std=c++17", "-D__global__=KILN_SIM_GLOBAL"].map(OsString::from).to_vec();
    args.extend(source.host_options.iter().map(OsString::from));
    args.extend([OsString::from("-o"), preprocessed.clone().into(), module_cu.clone().into()]);
    cc.run(&args, &said, limit)?;
    let expanded = std::fs::read(&preprocessed).map_err(|e| format!("cannot read {} ({e})", preprocessed.display()))?;
    let names = kernel_names(&String::from_utf8_lossy(&expanded));
    if names.is_empty() {
        return Err("the source defines no `extern \"C\" __global__ void` kernel".into());
    }

    text.extend_from_slice(b"#line 1 \"cudasim-launch.hpp\"\n");
    text.extend_from_slice(LAUNCH.as_bytes());
    text.extend_from_slice(table(&names).as_bytes());
    std::fs::write(&full_cpp, &text).map_err(|e| format!("cannot write {} ({e})", full_cpp.display()))?;

    let mut args: Vec<OsString> = flags().into_iter().map(OsString::from).collect();
    args.extend(source.host_options.iter().map(OsString::from));
    args.extend([OsString::from("-o"), tmp_so.clone().into(), OsString::from("-x"), OsString::from("c++"), full_cpp.clone().into()]);
    if let Err(e) = cc.run(&args, &said, limit) {
        // Kept for whoever reads the message: g++ cites lines of this file.
        let kept = dir.join(format!("{key:032x}.failed.cpp"));
        let shown = match std::fs::rename(&full_cpp, &kept) {
            Ok(()) => format!("\n(the file it compiled is {})", kept.display()),
            Err(_) => String::new(),
        };
        return Err(format!("{e}{shown}"));
    }
    std::fs::rename(&tmp_so, so).map_err(|e| format!("cannot move the module into the cache as {} ({e})", so.display()))
}

/// The generated part of a module: the table of its kernels.
fn table(names: &[String]) -> String {
    let mut r#gen = String::from("\nstatic const KilnSimKernel* kiln_sim_table() {\n    static const KilnSimKernel t[] = {\n");
    for n in names {
        r#gen.push_str(&format!("        kiln_sim_entry(\"{n}\", &{n}),\n"));
    }
    r#gen.push_str("    };\n    return t;\n}\n");
    r#gen.push_str(&format!("static int kiln_sim_table_len() {{ return {}; }}\n", names.len()));
    r#gen
}

/// The `__global__` kernels a preprocessed source defines or declares (with
/// `__global__` expanded to `KILN_SIM_GLOBAL`), in order, once each. Kernel
/// templates are left out: only an instantiation has a name to launch, and a
/// GPU driver could only find it by its mangled name.
fn kernel_names(expanded: &str) -> Vec<String> {
    const MARKER: &str = "KILN_SIM_GLOBAL";
    let mut names = Vec::new();
    let mut from = 0;
    while let Some(at) = expanded[from..].find(MARKER).map(|i| i + from) {
        from = at + MARKER.len();
        let before = &expanded[..at];
        let statement_start = before.rfind([';', '}', '{']).map_or(0, |i| i + 1);
        if before[statement_start..].split(|c: char| !c.is_ascii_alphanumeric() && c != '_').any(|w| w == "template") {
            continue;
        }
        let mut rest = expanded[from..].trim_start();
        if !rest.starts_with("void") {
            continue;
        }
        rest = rest["void".len()..].trim_start();
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !name.is_empty() && !name.starts_with(|c: char| c.is_ascii_digit()) && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_are_found_once_and_templates_skipped() {
        let text = "extern \"C\" KILN_SIM_GLOBAL void fill_f32(float* p) { }\n\
                    extern \"C\" KILN_SIM_GLOBAL void fill_f32(float* p);\n\
                    template <typename T> KILN_SIM_GLOBAL void generic(T* p) { }\n\
                    struct S { int a; }; extern \"C\" { KILN_SIM_GLOBAL void in_block(int n) { } }\n\
                    extern \"C\" KILN_SIM_GLOBAL  void\n   spaced_out(int n) { }\n\
                    static KILN_SIM_GLOBAL int not_void() { return 0; }";
        assert_eq!(kernel_names(text), ["fill_f32", "in_block", "spaced_out"]);
        assert!(kernel_names("int main() { return 0; }").is_empty());
        assert!(kernel_names("KILN_SIM_GLOBAL").is_empty());
    }

    #[test]
    fn the_table_names_each_kernel() {
        let t = table(&["a".into(), "b_2".into()]);
        assert!(t.contains("kiln_sim_entry(\"a\", &a)") && t.contains("kiln_sim_entry(\"b_2\", &b_2)"));
        assert!(t.contains("return 2;"));
    }
}
