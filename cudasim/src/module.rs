//! Modules and launches. `cuModuleLoadData` takes the cubin or PTX that NVRTC
//! made and exposes the kernels it defines that the host-compiled table
//! (`exec`) knows; `cuLaunchKernel` copies the arguments by the sizes the
//! host compiler deduced and queues the grid on the stream.

use crate::context::{current, initialized, record_launch, registry, Ctx};
use crate::stream::{stream_here, Op};
use crate::{exec, log, tri, CUresult};
use crate::{INVALID_CONTEXT, INVALID_HANDLE, INVALID_IMAGE, INVALID_VALUE, NOT_FOUND, NOT_SUPPORTED, SUCCESS};
use std::collections::HashSet;
use std::ffi::{c_char, c_uint, c_void, CStr};

pub(crate) struct Module {
    ctx: &'static Ctx,
    names: HashSet<String>,
}

pub(crate) struct Function {
    ctx: &'static Ctx,
    name: String,
}

/// The kernel names an image defines: `.entry` lines of PTX, or the symbols
/// of a cubin (ELF) that the host-compiled table knows.
fn image_kernels(image: &[u8]) -> Result<HashSet<String>, String> {
    let table = exec::table();
    if image.starts_with(b"\x7fELF") {
        let found: HashSet<String> = table
            .keys()
            .filter(|n| {
                let needle = [&b"\0"[..], n.as_bytes(), &b"\0"[..]].concat();
                image.windows(needle.len()).any(|w| w == needle.as_slice())
            })
            .cloned()
            .collect();
        return Ok(found);
    }
    let text = std::str::from_utf8(image).map_err(|_| "the image is neither a cubin (ELF) nor PTX text".to_string())?;
    if !text.contains(".version") || !text.contains(".target") {
        return Err("the image is neither a cubin (ELF) nor PTX (no .version/.target)".into());
    }
    let mut names = HashSet::new();
    for line in text.lines() {
        if let Some(at) = line.find(".entry ") {
            let name: String = line[at + 7..].trim().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    Ok(names)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> CUresult {
    let ctx = tri!(current());
    if module.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    let bytes: &[u8] = if std::slice::from_raw_parts(image as *const u8, 4) == b"\x7fELF" {
        // An ELF image: its size is e_shoff + e_shnum * e_shentsize.
        let hdr = std::slice::from_raw_parts(image as *const u8, 64);
        let shoff = u64::from_le_bytes(hdr[0x28..0x30].try_into().unwrap_or([0; 8])) as usize;
        let shentsize = u16::from_le_bytes([hdr[0x3A], hdr[0x3B]]) as usize;
        let shnum = u16::from_le_bytes([hdr[0x3C], hdr[0x3D]]) as usize;
        std::slice::from_raw_parts(image as *const u8, shoff + shentsize * shnum)
    } else {
        CStr::from_ptr(image as *const c_char).to_bytes()
    };
    let names = match image_kernels(bytes) {
        Ok(n) => n,
        Err(e) => {
            log(&format!("cuModuleLoadData: {e}"));
            return INVALID_IMAGE;
        }
    };
    if names.is_empty() {
        log("cuModuleLoadData: the image defines no kernel the simulator knows");
        return INVALID_IMAGE;
    }
    let h = Box::into_raw(Box::new(0u8)) as *mut c_void;
    registry().modules.insert(h as usize, Module { ctx, names });
    *module = h;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(module: *mut c_void) -> CUresult {
    tri!(initialized());
    let mut r = registry();
    if r.modules.remove(&(module as usize)).is_none() {
        return INVALID_HANDLE;
    }
    r.functions.retain(|_, _| true);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut *mut c_void, module: *mut c_void, name: *const c_char) -> CUresult {
    let ctx = tri!(current());
    if f.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    let name = CStr::from_ptr(name).to_string_lossy().into_owned();
    let mut r = registry();
    let Some(m) = r.modules.get(&(module as usize)) else { return INVALID_HANDLE };
    if !std::ptr::eq(m.ctx, ctx) {
        return INVALID_CONTEXT;
    }
    if !m.names.contains(&name) {
        return NOT_FOUND;
    }
    if !exec::table().contains_key(&name) {
        log(&format!("kernel {name} is in the module but not in the host-compiled kernels: rebuild cudasim"));
        return NOT_FOUND;
    }
    let h = Box::into_raw(Box::new(0u8)) as *mut c_void;
    r.functions.insert(h as usize, Function { ctx, name });
    *f = h;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let (fctx, name) = match registry().functions.get(&(f as usize)) {
        Some(func) => (func.ctx, func.name.clone()),
        None => return INVALID_HANDLE,
    };
    if !std::ptr::eq(fctx, ctx) {
        log(&format!("kernel {name} of device {} launched while device {}'s context is current", fctx.dev, ctx.dev));
        return INVALID_CONTEXT;
    }
    if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx > 1024 || shared > 48 * 1024 {
        return INVALID_VALUE;
    }
    if gy != 1 || gz != 1 || by != 1 || bz != 1 || !extra.is_null() {
        log("cuLaunchKernel: the simulator runs 1-D grids and blocks with kernelParams only");
        return NOT_SUPPORTED;
    }
    let Some(k) = exec::table().get(&name) else { return NOT_FOUND };
    if params.is_null() && !k.sizes.is_empty() {
        return INVALID_VALUE;
    }
    // The driver copies the argument values now: the caller's may go away.
    let mut args = Vec::with_capacity(k.sizes.len());
    for (i, &size) in k.sizes.iter().enumerate() {
        let p = *params.add(i);
        if p.is_null() {
            return INVALID_VALUE;
        }
        let mut words = vec![0u64; size.div_ceil(8).max(1)];
        std::ptr::copy_nonoverlapping(p as *const u8, words.as_mut_ptr() as *mut u8, size);
        args.push(words);
    }
    let ptrs = k.is_ptr.iter().enumerate().filter(|(_, &p)| p).map(|(i, _)| i).collect();
    record_launch(&name, gx);
    s.push(Op::Kernel { name, index: k.index, grid: gx, block: bx, args, ptrs });
    SUCCESS
}
