//! Device and page-locked host memory, and the checks every pointer goes
//! through. Device memory is ordinary host memory, kept apart in books so
//! that a kernel, copy or gemm given a host pointer, a freed block, another
//! device's memory without peer access, or a range past the end of its
//! allocation is reported (and made sticky) instead of silently working as
//! it would on the CPU.

use crate::context::{ctx_from, current, initialized, injected_failure, Sim};
use crate::stream::{stream_here, Op};
use crate::{env_bytes, lock, log, tri, CUdeviceptr, CUresult};
use crate::{INVALID_CONTEXT, INVALID_VALUE, OUT_OF_MEMORY, SUCCESS};
use std::collections::{BTreeMap, VecDeque};
use std::ffi::{c_uint, c_void};

const POISON: u8 = 0xFF;
const ALIGN: usize = 256;
/// Freed device memory stays mapped (poisoned) up to this many bytes, so that
/// a stale pointer reads poison rather than another allocation.
const QUARANTINE: usize = 256 << 20;

/// The books of every allocation.
#[derive(Default)]
pub(crate) struct Mem {
    /// Live device allocations: base -> (len, device).
    pub dev: BTreeMap<u64, (usize, usize)>,
    pub used: Vec<usize>,
    /// Freed allocations still mapped: base -> (len, device).
    pub freed: BTreeMap<u64, (usize, usize)>,
    pub freed_order: VecDeque<u64>,
    pub freed_bytes: usize,
    /// Page-locked host allocations: base -> len.
    pub host: BTreeMap<u64, usize>,
    pub host_bytes: usize,
}

/// Where a device address lies: (device, bytes from there to the end of its
/// allocation), or why it is not usable.
pub(crate) fn resolve(mem: &Mem, p: u64) -> Result<(usize, usize), String> {
    if let Some((&base, &(len, dev))) = mem.dev.range(..=p).next_back() {
        if p <= base + len as u64 {
            return Ok((dev, (base + len as u64 - p) as usize));
        }
    }
    if let Some((&base, &(len, dev))) = mem.freed.range(..=p).next_back() {
        if p < base + len.max(1) as u64 {
            return Err(format!("0x{p:x} is device {dev} memory that was freed (use after free)"));
        }
    }
    if let Some((&base, &len)) = mem.host.range(..=p).next_back() {
        if p < base + len as u64 {
            return Err(format!("0x{p:x} is page-locked host memory, not device memory"));
        }
    }
    Err(format!("0x{p:x} is not device memory (a host pointer or garbage)"))
}

/// Checks that `[p, p+len)` is live memory of a device that `dev` may access.
pub(crate) fn check_range(sim: &Sim, dev: usize, p: u64, len: usize, what: &str) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    let mem = lock(&sim.mem);
    let (owner, avail) = resolve(&mem, p).map_err(|e| format!("{what}: {e}"))?;
    drop(mem);
    if avail < len {
        return Err(format!("{what}: {len} bytes at 0x{p:x} run {} bytes past the end of its allocation", len - avail));
    }
    if owner != dev && !lock(&sim.devices[dev].peers)[owner] {
        return Err(format!(
            "{what}: 0x{p:x} is memory of device {owner}, used from device {dev} without peer access (cuCtxEnablePeerAccess)"
        ));
    }
    Ok(())
}

pub(crate) fn check_host(sim: &Sim, p: *const c_void, len: usize, what: &str) -> Result<(), String> {
    if len > 0 && p.is_null() {
        return Err(format!("{what}: null host pointer"));
    }
    let mem = lock(&sim.mem);
    if let Some((&base, &(alen, dev))) = mem.dev.range(..=(p as u64)).next_back() {
        if (p as u64) < base + alen as u64 {
            return Err(format!("{what}: 0x{:x} is device {dev} memory, passed where host memory is expected", p as u64));
        }
    }
    Ok(())
}

fn layout(len: usize) -> Option<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(len.max(1), ALIGN).ok()
}

// ---- memory in the driver API ------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    let ctx = tri!(current());
    let sim = tri!(initialized());
    if ptr.is_null() || bytes == 0 {
        return INVALID_VALUE;
    }
    let d = &sim.devices[ctx.dev];
    let mut mem = lock(&sim.mem);
    if mem.used[ctx.dev].saturating_add(d.reserved).saturating_add(bytes) > d.capacity || injected_failure("cuMemAlloc_v2") {
        return OUT_OF_MEMORY;
    }
    let Some(l) = layout(bytes) else { return OUT_OF_MEMORY };
    let p = std::alloc::alloc(l);
    if p.is_null() {
        return OUT_OF_MEMORY;
    }
    std::ptr::write_bytes(p, POISON, bytes);
    mem.used[ctx.dev] += bytes;
    mem.dev.insert(p as u64, (bytes, ctx.dev));
    *ptr = p as u64;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    let ctx = tri!(current());
    let sim = tri!(initialized());
    if ptr == 0 {
        return SUCCESS;
    }
    let mem = lock(&sim.mem);
    let Some(&(len, dev)) = mem.dev.get(&ptr) else {
        let why = resolve(&mem, ptr).err().unwrap_or_else(|| format!("0x{ptr:x} is not the start of an allocation"));
        drop(mem);
        log(&format!("cuMemFree: {why}"));
        return INVALID_VALUE;
    };
    if dev != ctx.dev {
        drop(mem);
        log(&format!("cuMemFree of device {dev} memory while device {}'s context is current", ctx.dev));
        return INVALID_CONTEXT;
    }
    drop(mem);
    // As on a GPU, freeing device memory synchronises the device: it waits
    // for the work queued on every stream of the context (with the memory
    // table unlocked, since that work may allocate).
    crate::context::wait_for_every_stream(ctx);
    let mut mem = lock(&sim.mem);
    if mem.dev.get(&ptr) != Some(&(len, dev)) {
        // Freed by another thread while this one waited (and perhaps made
        // again): a double free either way.
        drop(mem);
        log(&format!("cuMemFree: 0x{ptr:x} was freed twice"));
        return INVALID_VALUE;
    }
    if injected_failure("cuMemFree_v2") {
        // The block stays allocated, as after a failed free on a GPU.
        return INVALID_VALUE;
    }
    mem.dev.remove(&ptr);
    mem.used[dev] -= len;
    // Poisoned and kept mapped for a while, so that work still queued on it
    // reads poison (and is reported) instead of another tensor's data.
    std::ptr::write_bytes(ptr as *mut u8, POISON, len);
    mem.freed.insert(ptr, (len, dev));
    mem.freed_order.push_back(ptr);
    mem.freed_bytes += len;
    while mem.freed_bytes > QUARANTINE {
        let Some(old) = mem.freed_order.pop_front() else { break };
        if let Some((l, _)) = mem.freed.remove(&old) {
            mem.freed_bytes -= l;
            if let Some(lay) = layout(l) {
                std::alloc::dealloc(old as *mut u8, lay);
            }
        }
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let ctx = tri!(current());
    let sim = tri!(initialized());
    if free.is_null() || total.is_null() {
        return INVALID_VALUE;
    }
    let d = &sim.devices[ctx.dev];
    *total = d.capacity;
    *free = d.capacity.saturating_sub(d.reserved).saturating_sub(lock(&sim.mem).used[ctx.dev]);
    SUCCESS
}

unsafe fn host_alloc(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    let _ = tri!(current());
    let sim = tri!(initialized());
    if pp.is_null() {
        return INVALID_VALUE;
    }
    let limit = env_bytes("KILN_CUDASIM_PINNED", usize::MAX);
    let mut mem = lock(&sim.mem);
    if mem.host_bytes.saturating_add(bytes) > limit {
        return OUT_OF_MEMORY;
    }
    let Some(l) = layout(bytes) else { return OUT_OF_MEMORY };
    let p = std::alloc::alloc(l);
    if p.is_null() {
        return OUT_OF_MEMORY;
    }
    std::ptr::write_bytes(p, POISON, bytes.max(1));
    mem.host.insert(p as u64, bytes.max(1));
    mem.host_bytes += bytes;
    *pp = p as *mut c_void;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    if injected_failure("cuMemAllocHost_v2") {
        return OUT_OF_MEMORY;
    }
    host_alloc(pp, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    host_alloc(pp, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(d: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) -> CUresult {
    let _ = tri!(current());
    let sim = tri!(initialized());
    if d.is_null() || flags != 0 {
        return INVALID_VALUE;
    }
    let mem = lock(&sim.mem);
    match mem.host.range(..=(p as u64)).next_back() {
        Some((&base, &len)) if (p as u64) < base + len as u64 => {
            *d = p as u64;
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    let sim = tri!(initialized());
    let mut mem = lock(&sim.mem);
    let Some(len) = mem.host.remove(&(p as u64)) else { return INVALID_VALUE };
    mem.host_bytes -= len;
    if let Some(l) = layout(len) {
        std::alloc::dealloc(p as *mut u8, l);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, len: usize, stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    if let Err(e) =
        check_range(sim, ctx.dev, dst, len, "cuMemcpyHtoDAsync destination").and(check_host(sim, src, len, "cuMemcpyHtoDAsync source"))
    {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        // The host bytes are read when the stream gets there, as a DMA from
        // page-locked memory would: reusing the buffer before then is a bug.
        s.push(Op::HtoD { dst, src: src as usize, len });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, len: usize, stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    if let Err(e) =
        check_range(sim, ctx.dev, src, len, "cuMemcpyDtoHAsync source").and(check_host(sim, dst, len, "cuMemcpyDtoHAsync destination"))
    {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        s.push(Op::DtoH { dst: dst as usize, src, len });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, len: usize) -> CUresult {
    let ctx = tri!(current());
    let r = cuMemcpyHtoDAsync_v2(dst, src, len, std::ptr::null_mut());
    if r != SUCCESS {
        return r;
    }
    let s = ctx.default_stream();
    s.wait_for(s.ticket());
    ctx.sticky()
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, len: usize) -> CUresult {
    let ctx = tri!(current());
    let r = cuMemcpyDtoHAsync_v2(dst, src, len, std::ptr::null_mut());
    if r != SUCCESS {
        return r;
    }
    let s = ctx.default_stream();
    s.wait_for(s.ticket());
    ctx.sticky()
}

fn owner(sim: &Sim, p: u64) -> Option<usize> {
    resolve(&lock(&sim.mem), p).ok().map(|(d, _)| d)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, len: usize, stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    // Unified addressing: either side may be another device's memory (the
    // driver copies between devices with or without peer access).
    let src_dev = owner(sim, src).unwrap_or(ctx.dev);
    let dst_dev = owner(sim, dst).unwrap_or(ctx.dev);
    let checked = check_range(sim, dst_dev, dst, len, "cuMemcpyDtoDAsync destination").and(check_range(
        sim,
        src_dev,
        src,
        len,
        "cuMemcpyDtoDAsync source",
    ));
    if let Err(e) = checked {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        s.push(Op::DtoD { dst, dst_dev, src, src_dev, len });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: CUdeviceptr,
    dst_ctx: *mut c_void,
    src: CUdeviceptr,
    src_ctx: *mut c_void,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    let (_, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    let (Some(dc), Some(sc)) = (ctx_from(dst_ctx), ctx_from(src_ctx)) else { return INVALID_CONTEXT };
    // Peer copies need no peer access: the driver stages them if it must.
    let checked = check_range(sim, dc.dev, dst, len, "cuMemcpyPeerAsync destination").and(check_range(
        sim,
        sc.dev,
        src,
        len,
        "cuMemcpyPeerAsync source",
    ));
    if let Err(e) = checked {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        // Run by the stream's worker; ranges re-checked against their own
        // devices when it gets there.
        s.push(Op::DtoD { dst, dst_dev: dc.dev, src, src_dev: sc.dev, len });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, value: u8, len: usize, stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    if let Err(e) = check_range(sim, ctx.dev, dst, len, "cuMemsetD8Async") {
        log(&e);
        return INVALID_VALUE;
    }
    if len > 0 {
        s.push(Op::Memset { dst, value, len });
    }
    SUCCESS
}
