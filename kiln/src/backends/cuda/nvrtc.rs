//! Run-time compilation of the kernel families with NVRTC, found at run
//! time like the driver (through kiln's own handle of the library, so that
//! `KILN_NVRTC_LIB` names the one used). Results are kept in a disk cache
//! (`$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`)
//! keyed by the source, the options and the NVRTC version, because a family
//! takes seconds to compile.

use cudarc::nvrtc::sys;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

/// What a compilation produced.
pub(crate) enum Image {
    /// Machine code for one `sm_XY`.
    Cubin(Vec<u8>),
    /// PTX for a virtual `compute_XY`, NUL-terminated, for the driver to JIT.
    Ptx(Vec<u8>),
}

impl Image {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Image::Cubin(b) | Image::Ptx(b) => b,
        }
    }
}

/// Options every compilation uses: no contraction of a*b+c into FMA, so that
/// results round like the CPU's.
pub(crate) const COMMON_OPTIONS: [&str; 2] = ["--fmad=false", "--std=c++17"];

type Prog = sys::nvrtcProgram;
type Res = sys::nvrtcResult;

/// The NVRTC functions kiln calls, looked up in kiln's own handle of the
/// library, so that the library `KILN_NVRTC_LIB` names is the one used (with
/// cudarc's loader a toolkit's `libnvrtc.so` symlink on the search path could
/// win over it).
struct Api {
    create: unsafe extern "C" fn(*mut Prog, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> Res,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Res,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    cubin_size: Option<unsafe extern "C" fn(Prog, *mut usize) -> Res>,
    cubin: Option<unsafe extern "C" fn(Prog, *mut c_char) -> Res>,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    destroy: unsafe extern "C" fn(*mut Prog) -> Res,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
    num_archs: Option<unsafe extern "C" fn(*mut c_int) -> Res>,
    archs: Option<unsafe extern "C" fn(*mut c_int) -> Res>,
}

/// A symbol's address as the function pointer type `F`.
///
/// # Safety
/// `p` must be the address of a function whose C signature `F` spells.
pub(super) unsafe fn fn_ptr<F: Copy>(p: *mut std::ffi::c_void) -> F {
    unsafe {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut std::ffi::c_void>());
        std::mem::transmute_copy(&p)
    }
}

/// The dynamic loader: dlopen on Unix; elsewhere (Windows) libloading,
/// which cudarc loads the driver with, so it adds no crate. NCCL is opened
/// with it too (`nccl.rs`).
#[cfg(unix)]
pub(super) mod dl {
    use std::ffi::{c_void, CStr};
    /// Opens a library; `global` makes its symbols visible to later loads.
    pub(in crate::backends::cuda) unsafe fn open(name: &CStr, global: bool) -> *mut c_void {
        unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | if global { libc::RTLD_GLOBAL } else { libc::RTLD_LOCAL }) }
    }
    pub(in crate::backends::cuda) unsafe fn sym(handle: *mut c_void, name: &CStr) -> *mut c_void {
        unsafe { libc::dlsym(handle, name.as_ptr()) }
    }
    pub(in crate::backends::cuda) fn error() -> String {
        // SAFETY: dlerror returns null or a C string valid until the next dl call.
        let e = unsafe { libc::dlerror() };
        if e.is_null() {
            "unknown error".into()
        } else {
            unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
        }
    }
}

#[cfg(not(unix))]
pub(super) mod dl {
    use std::ffi::{c_void, CStr};
    thread_local!(static LAST: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) });
    /// Opens a library, kept for the life of the process (as on Unix).
    pub(in crate::backends::cuda) unsafe fn open(name: &CStr, _global: bool) -> *mut c_void {
        let Ok(name) = name.to_str() else { return std::ptr::null_mut() };
        match libloading::Library::new(name) {
            Ok(lib) => Box::into_raw(Box::new(lib)).cast(),
            Err(e) => {
                LAST.with(|l| *l.borrow_mut() = e.to_string());
                std::ptr::null_mut()
            }
        }
    }
    pub(in crate::backends::cuda) unsafe fn sym(handle: *mut c_void, name: &CStr) -> *mut c_void {
        let lib = &*handle.cast::<libloading::Library>();
        lib.get::<*mut c_void>(name.to_bytes()).map(|s| *s).unwrap_or(std::ptr::null_mut())
    }
    pub(in crate::backends::cuda) fn error() -> String {
        LAST.with(|l| l.borrow().clone())
    }
}

fn dlerror() -> String {
    dl::error()
}

impl Api {
    /// Looks the functions up in `handle` (from dlopen of `lib`).
    ///
    /// # Safety
    /// `handle` must be a live dlopen handle of an NVRTC library.
    unsafe fn from_handle(handle: *mut std::ffi::c_void, lib: &str) -> Result<Api, String> {
        unsafe {
            let sym = |name: &str| -> Option<*mut std::ffi::c_void> {
                let c = CString::new(name).ok()?;
                let p = dl::sym(handle, &c);
                (!p.is_null()).then_some(p)
            };
            let need = |name: &str| sym(name).ok_or_else(|| format!("the NVRTC library {lib} lacks {name}"));
            // SAFETY (every fn_ptr): each symbol is the NVRTC function of that
            // name, whose C signature the pointer type spells.
            Ok(Api {
                create: fn_ptr(need("nvrtcCreateProgram")?),
                compile: fn_ptr(need("nvrtcCompileProgram")?),
                ptx_size: fn_ptr(need("nvrtcGetPTXSize")?),
                ptx: fn_ptr(need("nvrtcGetPTX")?),
                cubin_size: sym("nvrtcGetCUBINSize").map(|p| fn_ptr(p)),
                cubin: sym("nvrtcGetCUBIN").map(|p| fn_ptr(p)),
                log_size: fn_ptr(need("nvrtcGetProgramLogSize")?),
                log: fn_ptr(need("nvrtcGetProgramLog")?),
                destroy: fn_ptr(need("nvrtcDestroyProgram")?),
                version: fn_ptr(need("nvrtcVersion")?),
                error_string: fn_ptr(need("nvrtcGetErrorString")?),
                num_archs: sym("nvrtcGetNumSupportedArchs").map(|p| fn_ptr(p)),
                archs: sym("nvrtcGetSupportedArchs").map(|p| fn_ptr(p)),
            })
        }
    }
}

/// A library kiln opens itself (NVRTC, NCCL, cuDNN): its live dlopen
/// handle, kept for the life of the process, and how it was found.
pub(super) struct Opened {
    handle: *mut std::ffi::c_void,
    /// The path the user named, or the name the loader found.
    name: String,
    /// The variable that named it, when one did.
    named_by: Option<&'static str>,
}

impl Opened {
    /// Looks the library's functions up with `lookup` (given the handle and
    /// the name), naming the variable in its error when the user named the
    /// library; with that name.
    pub(super) fn load<T>(self, lookup: impl FnOnce(*mut std::ffi::c_void, &str) -> Result<T, String>) -> Result<(T, String), String> {
        match lookup(self.handle, &self.name) {
            Ok(t) => Ok((t, self.name)),
            Err(e) => Err(match self.named_by {
                Some(var) => format!("{var}={}: {e}", self.name),
                None => e,
            }),
        }
    }
}

/// Opens a library: exactly the one `var` names when it is set (and no
/// other when that fails; `global_named` makes its symbols visible to later
/// loads), else the first of `names` the loader finds; `Ok(None)` when none
/// is found. `what` names the library in the errors.
pub(super) fn open_library<S: AsRef<str>>(
    var: &'static str,
    what: &str,
    names: impl IntoIterator<Item = S>,
    global_named: bool,
) -> Result<Option<Opened>, String> {
    if let Some(path) = std::env::var_os(var).filter(|p| !p.is_empty()) {
        let shown = path.to_string_lossy().into_owned();
        let c = CString::new(path.into_encoded_bytes()).map_err(|_| format!("{var}={shown} contains a NUL byte"))?;
        // SAFETY: dlopen with a valid C string.
        let handle = unsafe { dl::open(&c, global_named) };
        if handle.is_null() {
            return Err(format!(
                "{var}={shown} could not be loaded ({}); fix the path or unset {var} to use the {what} on the library path",
                dlerror()
            ));
        }
        return Ok(Some(Opened { handle, name: shown, named_by: Some(var) }));
    }
    for name in names {
        let name = name.as_ref();
        let Ok(c) = CString::new(name) else { continue };
        // SAFETY: dlopen with a valid C string.
        let handle = unsafe { dl::open(&c, false) };
        if !handle.is_null() {
            return Ok(Some(Opened { handle, name: name.to_string(), named_by: None }));
        }
    }
    Ok(None)
}

/// Opens NVRTC: exactly the library `KILN_NVRTC_LIB` names when it is set
/// (and no other when that fails), else the first of cudarc's candidate
/// names the loader finds.
fn load() -> Result<Api, String> {
    let found = open_library("KILN_NVRTC_LIB", "NVRTC", cudarc::get_lib_name_candidates("nvrtc"), true)?;
    let opened = found.ok_or_else(|| MISSING.to_string())?;
    // SAFETY: a live handle of the library named as NVRTC (by the user, or
    // by its file name).
    opened.load(|handle, name| unsafe { Api::from_handle(handle, name) }).map(|(api, _)| api)
}

/// The loaded NVRTC, or why there is none. Never panics.
fn api() -> Result<&'static Api, String> {
    static API: std::sync::OnceLock<Result<Api, String>> = std::sync::OnceLock::new();
    API.get_or_init(load).as_ref().map_err(|e| e.clone())
}

const MISSING: &str = "NVRTC (libnvrtc.so) was not found, so kiln cannot compile its CUDA kernels; install the CUDA toolkit \
or `pip install nvidia-cuda-nvrtc-cu12` and add its lib folder to LD_LIBRARY_PATH (or set KILN_NVRTC_LIB to the library's path)";

fn check(api: &Api, r: Res, what: &str) -> Result<(), String> {
    if r == Res::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static C string.
    let msg = unsafe { CStr::from_ptr((api.error_string)(r)) }.to_string_lossy().into_owned();
    Err(format!("{what}: {msg}"))
}

/// NVRTC's version (major, minor).
pub(crate) fn version() -> Result<(i32, i32), String> {
    let api = api()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: out-pointers to locals.
    check(api, unsafe { (api.version)(&mut major, &mut minor) }, "nvrtcVersion")?;
    Ok((major, minor))
}

/// The `sm_XY` numbers this NVRTC can target.
pub(crate) fn supported_archs() -> Result<Vec<i32>, String> {
    let api = api()?;
    let (Some(num_archs), Some(archs_of)) = (api.num_archs, api.archs) else {
        return Err("NVRTC lacks nvrtcGetSupportedArchs (it is older than CUDA 11.2)".into());
    };
    let mut n: c_int = 0;
    // SAFETY: out-pointer to a local, then a buffer of the size NVRTC gave.
    check(api, unsafe { num_archs(&mut n) }, "nvrtcGetNumSupportedArchs")?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    check(api, unsafe { archs_of(archs.as_mut_ptr()) }, "nvrtcGetSupportedArchs")?;
    Ok(archs)
}

/// Compiles `source` with `options`. `cubin` asks for machine code
/// (`--gpu-architecture=sm_XY` among the options), else PTX is returned.
pub(crate) fn compile(name: &str, source: &str, options: &[String], cubin: bool) -> Result<Image, String> {
    let api = api()?;
    catch_unwind(AssertUnwindSafe(|| compile_inner(api, name, source, options, cubin)))
        .unwrap_or_else(|_| Err("NVRTC panicked while compiling".into()))
}

fn compile_inner(api: &Api, name: &str, source: &str, options: &[String], cubin: bool) -> Result<Image, String> {
    let src = CString::new(source).map_err(|_| "kernel source contains a NUL byte".to_string())?;
    let cname = CString::new(format!("kiln_{name}.cu")).map_err(|_| "bad program name".to_string())?;
    let opts: Vec<CString> = options.iter().filter_map(|o| CString::new(o.as_str()).ok()).collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: Prog = std::ptr::null_mut();
    // SAFETY: every pointer is to a live C string; the program is destroyed
    // below on every path after creation.
    unsafe {
        check(api, (api.create)(&mut prog, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()), "nvrtcCreateProgram")?;
        let result = (|| {
            let r = (api.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            if r != Res::NVRTC_SUCCESS {
                let mut size = 0usize;
                let _ = (api.log_size)(prog, &mut size);
                let mut log = vec![0u8; size.max(1)];
                let _ = (api.log)(prog, log.as_mut_ptr() as *mut c_char);
                let log = String::from_utf8_lossy(&log).trim_end_matches('\0').to_string();
                return Err(format!("NVRTC failed to compile kernel family `{name}` with {options:?}:\n{log}"));
            }
            let mut size = 0usize;
            if cubin {
                let (Some(cubin_size), Some(get_cubin)) = (api.cubin_size, api.cubin) else {
                    return Err("NVRTC lacks nvrtcGetCUBIN (it is older than CUDA 11.1)".into());
                };
                check(api, cubin_size(prog, &mut size), "nvrtcGetCUBINSize")?;
                let mut out = vec![0u8; size];
                check(api, get_cubin(prog, out.as_mut_ptr() as *mut c_char), "nvrtcGetCUBIN")?;
                Ok(Image::Cubin(out))
            } else {
                check(api, (api.ptx_size)(prog, &mut size), "nvrtcGetPTXSize")?;
                let mut out = vec![0u8; size];
                check(api, (api.ptx)(prog, out.as_mut_ptr() as *mut c_char), "nvrtcGetPTX")?;
                Ok(Image::Ptx(out))
            }
        })();
        let _ = (api.destroy)(&mut prog);
        result
    }
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KILN_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kiln"))
}

/// 64-bit FNV-1a, enough to name cache files.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Like [`compile`], through the disk cache (`KILN_NO_KERNEL_CACHE=1` skips it).
pub(crate) fn compile_cached(name: &str, source: &str, options: &[String], cubin: bool) -> Result<Image, String> {
    let (major, minor) = version()?;
    let use_cache = !crate::base::env::env_flag("KILN_NO_KERNEL_CACHE").unwrap_or(false);
    let path = cache_dir().filter(|_| use_cache).map(|d| {
        let key = fnv1a(&[source.as_bytes(), options.join(" ").as_bytes(), format!("{major}.{minor}").as_bytes(), &[cubin as u8]]);
        d.join("cuda").join(format!("{name}-{key:016x}.{}", if cubin { "cubin" } else { "ptx" }))
    });
    if let Some(p) = &path
        && let Ok(bytes) = std::fs::read(p)
        && !bytes.is_empty()
    {
        return Ok(if cubin { Image::Cubin(bytes) } else { Image::Ptx(bytes) });
    }
    let image = compile(name, source, options, cubin)?;
    if let Some(p) = &path {
        // Best effort: a read-only home only costs the next process a compile.
        if let Some(dir) = p.parent()
            && std::fs::create_dir_all(dir).is_ok()
        {
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, image.bytes()).is_ok() {
                let _ = std::fs::rename(&tmp, p);
            }
        }
    }
    Ok(image)
}
