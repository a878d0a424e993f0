//! The NVRTC pass-through: this library also stands in for `libnvrtc.so`
//! (`scripts/cudasim.sh` links it under NVRTC's names in a folder of its
//! own), forwards every call to the real NVRTC (`KILN_CUDASIM_NVRTC`, a path
//! the script sets), and remembers each program's source and options, so
//! that when `nvrtcGetPTX` or `nvrtcGetCUBIN` hands out an image, the source
//! it came from is recorded (`sources`) for `cuModuleLoadData` to compile for
//! the host.
//!
//! The real NVRTC still compiles everything: a CUDA compile error fails as
//! on a GPU machine, and the image the driver gets is NVRTC's own. Nothing
//! here changes what kiln sees, only what the simulator remembers.

use crate::sources::{self, elf_extent, Source};
use crate::{lock, log};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

type Prog = *mut c_void;
/// `nvrtcResult`, a C enum.
type Res = c_int;
const NVRTC_SUCCESS: Res = 0;
const NVRTC_ERROR_INTERNAL_ERROR: Res = 11;

type CreateFn = unsafe extern "C" fn(*mut Prog, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> Res;
type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> Res;
type BytesFn = unsafe extern "C" fn(Prog, *mut c_char) -> Res;
type IntsFn = unsafe extern "C" fn(*mut c_int) -> Res;

/// The real NVRTC's functions. The optional ones are missing from old
/// versions; kiln copes with their absence, so calls to them fail cleanly.
struct Real {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
    create: CreateFn,
    destroy: unsafe extern "C" fn(*mut Prog) -> Res,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Res,
    ptx_size: SizeFn,
    ptx: BytesFn,
    log_size: SizeFn,
    log: BytesFn,
    cubin_size: Option<SizeFn>,
    cubin: Option<BytesFn>,
    num_archs: Option<IntsFn>,
    archs: Option<IntsFn>,
    add_name_expression: Option<unsafe extern "C" fn(Prog, *const c_char) -> Res>,
    lowered_name: Option<unsafe extern "C" fn(Prog, *const c_char, *mut *const c_char) -> Res>,
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

/// A symbol's address as the function pointer type `F`.
///
/// # Safety
/// `p` must be the address of a function whose C signature `F` spells.
pub(crate) unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    unsafe {
        debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        std::mem::transmute_copy(&p)
    }
}

fn load_real() -> Result<Real, String> {
    let path = std::env::var_os("KILN_CUDASIM_NVRTC")
        .filter(|p| !p.is_empty())
        .ok_or("KILN_CUDASIM_NVRTC is not set: the simulator's NVRTC stand-in forwards to the real NVRTC at that path (scripts/cudasim.sh sets it)")?;
    let shown = path.to_string_lossy().into_owned();
    let c = CString::new(path.into_encoded_bytes()).map_err(|_| format!("KILN_CUDASIM_NVRTC={shown} contains a NUL byte"))?;
    // SAFETY: dlopen with a valid C string. RTLD_LOCAL: NVRTC's symbols must
    // not take the place of this library's for anyone else.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!("the real NVRTC KILN_CUDASIM_NVRTC={shown} cannot be loaded ({})", dlerror()));
    }
    let sym = |name: &CStr| -> Option<*mut c_void> {
        // SAFETY: a live handle and a C string.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let need = |name: &CStr| sym(name).ok_or_else(|| format!("the real NVRTC {shown} lacks {}", name.to_string_lossy()));
    // Pointed at this very library (directly or through a link), every call
    // would forward to itself forever.
    if std::ptr::eq(need(c"nvrtcVersion")? as *const (), nvrtcVersion as *const ()) {
        return Err(format!("KILN_CUDASIM_NVRTC={shown} is the simulator itself, not the real NVRTC"));
    }
    // SAFETY (every fn_ptr): each symbol is the NVRTC function of that
    // name, whose C signature the field's type spells.
    unsafe {
        Ok(Real {
            version: fn_ptr(need(c"nvrtcVersion")?),
            error_string: fn_ptr(need(c"nvrtcGetErrorString")?),
            create: fn_ptr(need(c"nvrtcCreateProgram")?),
            destroy: fn_ptr(need(c"nvrtcDestroyProgram")?),
            compile: fn_ptr(need(c"nvrtcCompileProgram")?),
            ptx_size: fn_ptr(need(c"nvrtcGetPTXSize")?),
            ptx: fn_ptr(need(c"nvrtcGetPTX")?),
            log_size: fn_ptr(need(c"nvrtcGetProgramLogSize")?),
            log: fn_ptr(need(c"nvrtcGetProgramLog")?),
            cubin_size: sym(c"nvrtcGetCUBINSize").map(|p| fn_ptr(p)),
            cubin: sym(c"nvrtcGetCUBIN").map(|p| fn_ptr(p)),
            num_archs: sym(c"nvrtcGetNumSupportedArchs").map(|p| fn_ptr(p)),
            archs: sym(c"nvrtcGetSupportedArchs").map(|p| fn_ptr(p)),
            add_name_expression: sym(c"nvrtcAddNameExpression").map(|p| fn_ptr(p)),
            lowered_name: sym(c"nvrtcGetLoweredName").map(|p| fn_ptr(p)),
        })
    }
}

/// The real NVRTC, or why there is none (said once on stderr; the calls
/// then fail with NVRTC_ERROR_INTERNAL_ERROR, whose error string says why).
fn real() -> Result<&'static Real, &'static str> {
    static REAL: OnceLock<Result<Real, String>> = OnceLock::new();
    REAL.get_or_init(|| {
        let r = load_real();
        if let Err(e) = &r {
            log(e);
        }
        r
    })
    .as_ref()
    .map_err(|e| e.as_str())
}

/// What the simulator knows of a live program.
struct Program {
    source: Source,
}

fn programs() -> &'static Mutex<HashMap<usize, Program>> {
    static P: OnceLock<Mutex<HashMap<usize, Program>>> = OnceLock::new();
    P.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The NVRTC options that mean the same to the host compiler: macro
/// definitions and the language standard. The rest (architecture, fmad,
/// fast math, debug info) concern code generation for the GPU.
fn host_options(options: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = options.iter();
    while let Some(o) = it.next() {
        let o = o.trim();
        let mut macro_option = |flag: &str, long: &str| -> bool {
            if let Some(v) = o.strip_prefix(long).and_then(|v| v.strip_prefix('=')) {
                out.push(format!("{flag}{v}"));
            } else if o == flag || o == long {
                if let Some(v) = it.next() {
                    out.push(format!("{flag}{}", v.trim()));
                }
            } else if let Some(v) = o.strip_prefix(flag) {
                out.push(format!("{flag}{v}"));
            } else {
                return false;
            }
            true
        };
        if macro_option("-D", "--define-macro") || macro_option("-U", "--undefine-macro") {
            continue;
        }
        if let Some(std) = o.strip_prefix("--std=").or_else(|| o.strip_prefix("-std=")) {
            out.push(format!("-std={std}"));
        }
    }
    out
}

/// Records that `prog` produced `image`.
fn capture(prog: Prog, image: &[u8]) {
    let source = match lock(programs()).get(&(prog as usize)) {
        Some(p) => p.source.clone(),
        None => return,
    };
    sources::remember(image, Arc::new(source));
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> Res {
    unsafe {
        match real() {
            Ok(r) => (r.version)(major, minor),
            Err(_) => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetErrorString(result: Res) -> *const c_char {
    unsafe {
        match real() {
            Ok(r) => (r.error_string)(result),
            Err(why) => {
                // Kiln shows this string as the reason NVRTC is unusable.
                static WHY: OnceLock<CString> = OnceLock::new();
                match result {
                    NVRTC_SUCCESS => c"NVRTC_SUCCESS".as_ptr(),
                    NVRTC_ERROR_INTERNAL_ERROR => WHY
                        .get_or_init(|| CString::new(format!("NVRTC_ERROR_INTERNAL_ERROR (cudasim: {why})")).unwrap_or_default())
                        .as_ptr(),
                    _ => c"NVRTC_ERROR (cudasim: no real NVRTC)".as_ptr(),
                }
            }
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetNumSupportedArchs(n: *mut c_int) -> Res {
    unsafe {
        match real().ok().and_then(|r| r.num_archs) {
            Some(f) => f(n),
            None => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetSupportedArchs(archs: *mut c_int) -> Res {
    unsafe {
        match real().ok().and_then(|r| r.archs) {
            Some(f) => f(archs),
            None => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcCreateProgram(
    prog: *mut Prog,
    src: *const c_char,
    name: *const c_char,
    num_headers: c_int,
    headers: *const *const c_char,
    include_names: *const *const c_char,
) -> Res {
    unsafe {
        let Ok(r) = real() else { return NVRTC_ERROR_INTERNAL_ERROR };
        let result = (r.create)(prog, src, name, num_headers, headers, include_names);
        if result == NVRTC_SUCCESS && !prog.is_null() && !src.is_null() {
            let name = if name.is_null() { "default_program".to_string() } else { CStr::from_ptr(name).to_string_lossy().into_owned() };
            let text = CStr::from_ptr(src).to_bytes().to_vec();
            let source = Source { name, text, host_options: Vec::new(), headers: num_headers.max(0) as usize };
            lock(programs()).insert(*prog as usize, Program { source });
        }
        result
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcDestroyProgram(prog: *mut Prog) -> Res {
    unsafe {
        let Ok(r) = real() else { return NVRTC_ERROR_INTERNAL_ERROR };
        if !prog.is_null() {
            lock(programs()).remove(&(*prog as usize));
        }
        (r.destroy)(prog)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcCompileProgram(prog: Prog, num_options: c_int, options: *const *const c_char) -> Res {
    unsafe {
        let Ok(r) = real() else { return NVRTC_ERROR_INTERNAL_ERROR };
        if !options.is_null() && num_options > 0 {
            let given: Vec<String> = (0..num_options as usize)
                .map(|i| *options.add(i))
                .filter(|o| !o.is_null())
                .map(|o| CStr::from_ptr(o).to_string_lossy().into_owned())
                .collect();
            if let Some(p) = lock(programs()).get_mut(&(prog as usize)) {
                p.source.host_options = host_options(&given);
            }
        }
        (r.compile)(prog, num_options, options)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetPTXSize(prog: Prog, size: *mut usize) -> Res {
    unsafe {
        match real() {
            Ok(r) => (r.ptx_size)(prog, size),
            Err(_) => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetPTX(prog: Prog, ptx: *mut c_char) -> Res {
    unsafe {
        let Ok(r) = real() else { return NVRTC_ERROR_INTERNAL_ERROR };
        let result = (r.ptx)(prog, ptx);
        let mut size = 0usize;
        if result == NVRTC_SUCCESS && !ptx.is_null() && (r.ptx_size)(prog, &mut size) == NVRTC_SUCCESS {
            capture(prog, std::slice::from_raw_parts(ptx as *const u8, size));
        }
        result
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetCUBINSize(prog: Prog, size: *mut usize) -> Res {
    unsafe {
        match real().ok().and_then(|r| r.cubin_size) {
            Some(f) => f(prog, size),
            None => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetCUBIN(prog: Prog, cubin: *mut c_char) -> Res {
    unsafe {
        let (Some(get), Some(get_size)) = (real().ok().and_then(|r| r.cubin), real().ok().and_then(|r| r.cubin_size)) else {
            return NVRTC_ERROR_INTERNAL_ERROR;
        };
        let result = get(prog, cubin);
        let mut size = 0usize;
        if result == NVRTC_SUCCESS && !cubin.is_null() && get_size(prog, &mut size) == NVRTC_SUCCESS {
            let bytes = std::slice::from_raw_parts(cubin as *const u8, size);
            // The driver will know the image's length only from its header:
            // the record is keyed by the same span.
            let span = elf_extent(bytes).map_or(size, |e| e.min(size));
            capture(prog, &bytes[..span]);
        }
        result
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetProgramLogSize(prog: Prog, size: *mut usize) -> Res {
    unsafe {
        match real() {
            Ok(r) => (r.log_size)(prog, size),
            Err(_) => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetProgramLog(prog: Prog, log: *mut c_char) -> Res {
    unsafe {
        match real() {
            Ok(r) => (r.log)(prog, log),
            Err(_) => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcAddNameExpression(prog: Prog, name: *const c_char) -> Res {
    unsafe {
        match real().ok().and_then(|r| r.add_name_expression) {
            Some(f) => f(prog, name),
            None => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetLoweredName(prog: Prog, name: *const c_char, lowered: *mut *const c_char) -> Res {
    unsafe {
        match real().ok().and_then(|r| r.lowered_name) {
            Some(f) => f(prog, name, lowered),
            None => NVRTC_ERROR_INTERNAL_ERROR,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_meaning_changing_options_reach_the_host_compiler() {
        let given: Vec<String> = [
            "--fmad=false",
            "--std=c++20",
            "--gpu-architecture=sm_90",
            "-DA=1",
            "--define-macro=B",
            "-D",
            "C=3",
            "-UD",
            "--undefine-macro=E",
            "--use_fast_math",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(host_options(&given), ["-std=c++20", "-DA=1", "-DB", "-DC=3", "-UD", "-UE"]);
        assert!(host_options(&["-D".to_string()]).is_empty(), "a dangling -D is dropped, not a panic");
    }
}
