//! Run-time compilation of the kernel families with NVRTC, found at run
//! time like the driver. Results are kept in a disk cache
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

/// Loads the NVRTC library named by `KILN_NVRTC_LIB` (a full path) first, so
/// that a library outside the loader's search path is found by its soname.
fn preload_from_env() {
    if let Ok(path) = std::env::var("KILN_NVRTC_LIB") {
        if let Ok(c) = CString::new(path.clone()) {
            // SAFETY: dlopen with a valid C string; the handle is kept for the
            // life of the process on purpose.
            let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if handle.is_null() {
                eprintln!("kiln: KILN_NVRTC_LIB={path} could not be loaded");
            }
        }
    }
}

/// Whether an NVRTC library can be loaded. Never panics.
pub(crate) fn available() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRESENT.get_or_init(|| {
        preload_from_env();
        // SAFETY: only tries to dlopen candidate names.
        catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    })
}

const MISSING: &str = "NVRTC (libnvrtc.so) was not found, so kiln cannot compile its CUDA kernels; install the CUDA toolkit \
or `pip install nvidia-cuda-nvrtc-cu12` and add its lib folder to LD_LIBRARY_PATH (or set KILN_NVRTC_LIB to the library's path)";

fn check(r: sys::nvrtcResult, what: &str) -> Result<(), String> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static C string.
    let msg = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(r)) }.to_string_lossy().into_owned();
    Err(format!("{what}: {msg}"))
}

/// NVRTC's version (major, minor).
pub(crate) fn version() -> Result<(i32, i32), String> {
    if !available() {
        return Err(MISSING.into());
    }
    catch_unwind(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: out-pointers to locals.
        check(unsafe { sys::nvrtcVersion(&mut major, &mut minor) }, "nvrtcVersion")?;
        Ok((major, minor))
    })
    .unwrap_or_else(|_| Err(MISSING.into()))
}

/// The `sm_XY` numbers this NVRTC can target.
pub(crate) fn supported_archs() -> Result<Vec<i32>, String> {
    if !available() {
        return Err(MISSING.into());
    }
    catch_unwind(|| {
        let mut n: c_int = 0;
        // SAFETY: out-pointer to a local, then a buffer of the size NVRTC gave.
        check(unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }, "nvrtcGetNumSupportedArchs")?;
        let mut archs = vec![0 as c_int; n.max(0) as usize];
        check(unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }, "nvrtcGetSupportedArchs")?;
        Ok(archs)
    })
    .unwrap_or_else(|_| Err("NVRTC lacks nvrtcGetSupportedArchs (it is older than CUDA 11.2)".into()))
}

/// Compiles `source` with `options`. `cubin` asks for machine code
/// (`--gpu-architecture=sm_XY` among the options), else PTX is returned.
pub(crate) fn compile(name: &str, source: &str, options: &[String], cubin: bool) -> Result<Image, String> {
    if !available() {
        return Err(MISSING.into());
    }
    catch_unwind(AssertUnwindSafe(|| compile_inner(name, source, options, cubin)))
        .unwrap_or_else(|_| Err("NVRTC panicked while compiling (a symbol is missing from libnvrtc?)".into()))
}

fn compile_inner(name: &str, source: &str, options: &[String], cubin: bool) -> Result<Image, String> {
    let src = CString::new(source).map_err(|_| "kernel source contains a NUL byte".to_string())?;
    let cname = CString::new(format!("kiln_{name}.cu")).map_err(|_| "bad program name".to_string())?;
    let opts: Vec<CString> = options.iter().filter_map(|o| CString::new(o.as_str()).ok()).collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is to a live C string; the program is destroyed
    // below on every path after creation.
    unsafe {
        check(
            sys::nvrtcCreateProgram(&mut prog, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()),
            "nvrtcCreateProgram",
        )?;
        let result = (|| {
            let r = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            if r != sys::nvrtcResult::NVRTC_SUCCESS {
                let mut size = 0usize;
                let _ = sys::nvrtcGetProgramLogSize(prog, &mut size);
                let mut log = vec![0u8; size.max(1)];
                let _ = sys::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char);
                let log = String::from_utf8_lossy(&log).trim_end_matches('\0').to_string();
                return Err(format!("NVRTC failed to compile kernel family `{name}` with {options:?}:\n{log}"));
            }
            let mut size = 0usize;
            if cubin {
                check(sys::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize")?;
                let mut out = vec![0u8; size];
                check(sys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut c_char), "nvrtcGetCUBIN")?;
                Ok(Image::Cubin(out))
            } else {
                check(sys::nvrtcGetPTXSize(prog, &mut size), "nvrtcGetPTXSize")?;
                let mut out = vec![0u8; size];
                check(sys::nvrtcGetPTX(prog, out.as_mut_ptr() as *mut c_char), "nvrtcGetPTX")?;
                Ok(Image::Ptx(out))
            }
        })();
        let _ = sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("KILN_CACHE_DIR") {
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
    let use_cache = std::env::var("KILN_NO_KERNEL_CACHE").map(|v| v != "1").unwrap_or(true);
    let path = cache_dir().filter(|_| use_cache).map(|d| {
        let key = fnv1a(&[source.as_bytes(), options.join(" ").as_bytes(), format!("{major}.{minor}").as_bytes(), &[cubin as u8]]);
        d.join("cuda").join(format!("{name}-{key:016x}.{}", if cubin { "cubin" } else { "ptx" }))
    });
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(if cubin { Image::Cubin(bytes) } else { Image::Ptx(bytes) });
            }
        }
    }
    let image = compile(name, source, options, cubin)?;
    if let Some(p) = &path {
        // Best effort: a read-only home only costs the next process a compile.
        if let Some(dir) = p.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, image.bytes()).is_ok() {
                    let _ = std::fs::rename(&tmp, p);
                }
            }
        }
    }
    Ok(image)
}
