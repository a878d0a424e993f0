//! Modules and launches. `cuModuleLoadData` gets the cubin or PTX that NVRTC
//! made; the simulator looks up the source NVRTC made it from (`sources`),
//! has it compiled for the host (`hostcc`), and exposes the kernels that
//! both the image and the host library define, so that a name the image
//! lacks (a kernel without `extern "C"` has a mangled one) is not found here
//! either, as on a GPU. `cuLaunchKernel` copies the arguments by the sizes
//! the host compiler deduced and queues the grid on the stream.

use crate::context::{current, initialized, injected_failure, record_launch, registry, Ctx};
use crate::hostcc::{self, HostModule};
use crate::sources::{self, elf_extent};
use crate::stream::{stream_here, Op};
use crate::{log, tri, CUresult};
use crate::{INVALID_CONTEXT, INVALID_HANDLE, INVALID_IMAGE, INVALID_VALUE, LAUNCH_OUT_OF_RESOURCES, NOT_FOUND, NOT_SUPPORTED, SUCCESS};
use std::collections::HashSet;
use std::ffi::{c_char, c_uint, c_void, CStr};
use std::sync::Arc;

pub(crate) struct Module {
    ctx: &'static Ctx,
    host: Arc<HostModule>,
    /// The kernels of `host` that the image defines too.
    names: HashSet<String>,
}

pub(crate) struct Function {
    ctx: &'static Ctx,
    module: usize,
    host: Arc<HostModule>,
    name: String,
}

/// The bytes of the image at `image`: a cubin (its length from its ELF
/// header) or NUL-terminated PTX text.
///
/// # Safety
/// `image` must point at a complete image, as for the real driver.
unsafe fn image_bytes<'a>(image: *const c_void) -> Result<&'a [u8], String> {
    unsafe {
        let p = image as *const u8;
        // Byte by byte, so that a short C string is not read past its NUL.
        let is_elf = b"\x7fELF".iter().enumerate().all(|(i, &b)| *p.add(i) == b);
        if is_elf {
            let header = std::slice::from_raw_parts(p, 64);
            let len = elf_extent(header).ok_or("an ELF image that is not a 64-bit little-endian CUDA cubin (or claims over 1 GiB)")?;
            return Ok(std::slice::from_raw_parts(p, len));
        }
        let text = CStr::from_ptr(image as *const c_char).to_bytes();
        let is_ptx = std::str::from_utf8(text).is_ok_and(|t| t.contains(".version") && t.contains(".target"));
        if !is_ptx {
            return Err("the image is neither a cubin (ELF) nor PTX text (no .version/.target)".into());
        }
        Ok(text)
    }
}

/// What names an image can define: the strings of a cubin's string tables,
/// or the `.entry` names of PTX.
fn image_strings(image: &[u8]) -> HashSet<&[u8]> {
    if image.starts_with(b"\x7fELF") {
        return elf_strings(image);
    }
    let mut names = HashSet::new();
    for line in image.split(|&b| b == b'\n') {
        let Some(at) = line.windows(7).position(|w| w == b".entry ") else { continue };
        let rest = &line[at + 7..];
        let rest = &rest[rest.iter().take_while(|b| b.is_ascii_whitespace()).count()..];
        let len = rest.iter().take_while(|b| b.is_ascii_alphanumeric() || **b == b'_').count();
        if len > 0 {
            names.insert(&rest[..len]);
        }
    }
    names
}

/// The NUL-separated strings of the string-table sections (SHT_STRTAB) of a
/// 64-bit ELF, which hold its symbols' names; sections that lie outside the
/// image are skipped.
fn elf_strings(elf: &[u8]) -> HashSet<&[u8]> {
    const SHT_STRTAB: u32 = 3;
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |o: usize| elf.get(o..o + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
    let u64_at = |o: usize| elf.get(o..o + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).map(|v| v as usize);
    let mut strings = HashSet::new();
    let (Some(shoff), Some(shentsize), Some(shnum)) = (u64_at(0x28), u16_at(0x3A), u16_at(0x3C)) else { return strings };
    for i in 0..shnum {
        let Some(header) = shoff.checked_add(i * shentsize) else { break };
        let (Some(kind), Some(offset), Some(size)) = (u32_at(header + 4), u64_at(header + 24), u64_at(header + 32)) else { break };
        if kind != SHT_STRTAB {
            continue;
        }
        if let Some(table) = offset.checked_add(size).and_then(|end| elf.get(offset..end)) {
            strings.extend(table.split(|&b| b == 0).filter(|s| !s.is_empty()));
        }
    }
    strings
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> CUresult {
    unsafe {
        let ctx = tri!(current());
        if module.is_null() || image.is_null() {
            return INVALID_VALUE;
        }
        // Loading a module waits for the device to be idle, as on a GPU (seen
        // on an H200 with lazy and with eager loading: the first use of a kernel
        // waited for a stream held by cuStreamWaitValue32).
        crate::context::wait_for_every_stream(ctx);
        let bytes = match image_bytes(image) {
            Ok(b) => b,
            Err(e) => {
                log(&format!("cuModuleLoadData: {e}"));
                return INVALID_IMAGE;
            }
        };
        let Some(source) = sources::source_of(bytes) else {
            log("cuModuleLoadData: no NVRTC program under this simulator produced this image, so there is no source to compile for \
             the host: it was compiled by an NVRTC the simulator does not stand in front of, or kiln found it in a cache the \
             simulator's records do not cover (scripts/cudasim.sh keeps kiln's cache inside the simulator's; a KILN_CACHE_DIR \
             set by hand must be emptied or unset)");
            return INVALID_IMAGE;
        };
        if source.headers > 0 {
            log(&format!(
                "cuModuleLoadData: `{}` was created with {} headers; the simulator compiles self-contained sources only",
                source.name, source.headers
            ));
            return NOT_SUPPORTED;
        }
        let host = match hostcc::module_for(&source) {
            Ok(h) => h,
            Err((code, msg)) => {
                log(&format!("cuModuleLoadData: {}", msg.lines().next().unwrap_or_default()));
                return code;
            }
        };
        let strings = image_strings(bytes);
        let names: HashSet<String> = host.kernels.keys().filter(|n| strings.contains(n.as_bytes())).cloned().collect();
        if names.is_empty() {
            log(&format!("cuModuleLoadData: the image of `{}` defines none of the kernels its source has for the host", source.name));
            return INVALID_IMAGE;
        }
        let h = Box::into_raw(Box::new(0u8)) as *mut c_void;
        registry().modules.insert(h as usize, Module { ctx, host, names });
        *module = h;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(module: *mut c_void) -> CUresult {
    unsafe {
        tri!(initialized());
        let mut r = registry();
        if r.modules.remove(&(module as usize)).is_none() {
            return INVALID_HANDLE;
        }
        // Its functions go with it, as on a GPU (the host library stays loaded:
        // queued launches may still run it).
        r.functions.retain(|_, f| f.module != module as usize);
        drop(Box::from_raw(module as *mut u8));
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut *mut c_void, module: *mut c_void, name: *const c_char) -> CUresult {
    unsafe {
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
        let host = m.host.clone();
        let h = Box::into_raw(Box::new(0u8)) as *mut c_void;
        r.functions.insert(h as usize, Function { ctx, module: module as usize, host, name });
        *f = h;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
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
    unsafe {
        let (ctx, s) = tri!(stream_here(stream));
        let (fctx, host, name) = match registry().functions.get(&(f as usize)) {
            Some(func) => (func.ctx, func.host.clone(), func.name.clone()),
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
        let Some(k) = host.kernels.get(&name) else { return NOT_FOUND };
        if params.is_null() && !k.sizes.is_empty() {
            return INVALID_VALUE;
        }
        // A GPU takes at most 4 KB of kernel parameters (CUDA before 12.1;
        // NVRTC refuses a kernel that declares more).
        let param_bytes: usize = k.sizes.iter().sum();
        if param_bytes > 4096 {
            log(&format!("kernel {name}: {param_bytes} bytes of parameters, more than the 4096 a GPU takes"));
            return INVALID_VALUE;
        }
        if injected_failure(&format!("cuLaunchKernel.{name}")) {
            return LAUNCH_OUT_OF_RESOURCES;
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
        let ptrs = k.is_ptr.iter().enumerate().filter(|&(_, &p)| p).map(|(i, _)| i).collect();
        let index = k.index;
        record_launch(&name, gx);
        s.push(Op::Kernel { name, host, index, grid: gx, block: bx, args, ptrs });
        SUCCESS
    }
}
