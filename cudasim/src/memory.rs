//! Device and page-locked host memory, and the checks every pointer goes
//! through. Device memory is ordinary host memory, kept apart in books so
//! that a kernel, copy or gemm given a host pointer, a freed block, another
//! device's memory without peer access, or a range past the end of its
//! allocation is reported (and made sticky) instead of silently working as
//! it would on the CPU.
//!
//! Kernels are host code that reach memory through raw pointers, so the
//! books cannot see their accesses; the layout of device memory does
//! instead (the guard). Every device allocation lives in one reserved
//! region of address space (the arena: [`ARENA`] bytes mapped `PROT_NONE`,
//! nothing committed), on pages of its own made read-write, with at least
//! [`GAP`] bytes of inaccessible pages before and after it. The data ends at
//! the last 256-byte boundary of its pages (cuMemAlloc's alignment), so a
//! kernel that runs past the end touches at most 255 bytes of red zone
//! before it reaches an inaccessible page; the part of the first page before
//! the data is red zone too. Red zones are filled with [`GUARD`] and checked
//! after every kernel (`check_guards`, a scan of under a page per live
//! allocation of the device); an access to an inaccessible page raises
//! SIGSEGV, which `exec` turns into a failure of the kernel that made it
//! (`describe` says whose allocation the address is near). So: writes past
//! either end are always found; reads are found beyond the red zones (one
//! element past the end whenever the size is a multiple of 256 bytes, as
//! kiln's size classes are); a far write or read (within [`GAP`]) hits an
//! inaccessible page, never the simulator's heap, which lies outside the
//! arena. Freed blocks are made inaccessible at once and their addresses
//! are not reused (until the arena runs out, when the oldest freed slots
//! are), so a kernel that uses freed memory faults instead of reading
//! another tensor.

use crate::context::{ctx_from, current, initialized, injected_failure, Sim};
use crate::stream::{stream_here, Op};
use crate::{env_bytes, lock, log, tri, CUdeviceptr, CUresult};
use crate::{INVALID_CONTEXT, INVALID_VALUE, OUT_OF_MEMORY, SUCCESS};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{c_uint, c_void};

const POISON: u8 = 0xFF;
const ALIGN: usize = 256;
/// The red zones' bytes (an f32 of -2.7e7, unlikely to be written by
/// chance).
const GUARD: u8 = 0xCB;
/// Inaccessible bytes between two device allocations (and before the first):
/// a kernel's access up to this far outside its allocation faults.
const GAP: usize = 1 << 20;
/// Address space reserved for device memory (nothing is committed until an
/// allocation's pages are made accessible); smaller reservations are tried
/// when this one is refused (`ulimit -v`).
const ARENA: usize = 8 << 40;
/// Freed allocations remembered, so that a late use is reported as a use
/// after free (their addresses stay inaccessible whether remembered or not).
const FREED_BOOKS: usize = 1 << 16;

/// The region device memory is carved from.
pub(crate) struct Arena {
    base: u64,
    len: usize,
    /// Where the next allocation's pages start (bump allocation).
    next: u64,
    /// Freed slots (start, pages' length), oldest first: reused only once the
    /// arena is used up.
    free: VecDeque<(u64, usize)>,
}

/// The books of every allocation.
#[derive(Default)]
pub(crate) struct Mem {
    /// Live device allocations: base -> (len, device).
    pub dev: BTreeMap<u64, (usize, usize)>,
    /// The accessible pages of each live device allocation: base -> (start,
    /// end); `[start, base)` and `[base + len, end)` are its red zones.
    pub zones: HashMap<u64, (u64, u64)>,
    pub used: Vec<usize>,
    /// Freed allocations (the last [`FREED_BOOKS`]): base -> (len, device).
    pub freed: BTreeMap<u64, (usize, usize)>,
    pub freed_order: VecDeque<u64>,
    /// Page-locked host allocations: base -> len.
    pub host: BTreeMap<u64, usize>,
    pub host_bytes: usize,
    pub arena: Option<Arena>,
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Reserves the arena: the largest of a few sizes the system grants.
fn reserve_arena() -> Option<Arena> {
    for len in [ARENA, ARENA >> 3, ARENA >> 6, ARENA >> 9] {
        // SAFETY: a fresh anonymous mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0)
        };
        if p != libc::MAP_FAILED {
            let base = p as u64;
            return Some(Arena { base, len, next: base + GAP as u64, free: VecDeque::new() });
        }
    }
    None
}

/// Pages of the arena for an allocation of `bytes`: (base of the data,
/// start, end of its accessible pages), the red zones filled with [`GUARD`]
/// and the data with [`POISON`]; None when the arena cannot be had or is full.
fn map_device(mem: &mut Mem, bytes: usize) -> Option<(u64, u64, u64)> {
    let page = page_size();
    let align = if tight() { (1usize << bytes.trailing_zeros().min(8)).max(4) } else { ALIGN };
    let rounded = bytes.checked_next_multiple_of(align)?;
    let span = rounded.checked_next_multiple_of(page)?;
    if mem.arena.is_none() {
        mem.arena = reserve_arena();
        if mem.arena.is_none() {
            log("cuMemAlloc: cannot reserve address space for device memory (ulimit -v?)");
        }
    }
    let arena = mem.arena.as_mut()?;
    let end_of_arena = arena.base + arena.len as u64;
    let start = if arena.next.checked_add((span + GAP) as u64).is_some_and(|e| e <= end_of_arena) {
        let s = arena.next;
        arena.next += (span + GAP) as u64;
        s
    } else {
        // Used up: the oldest freed slot that is large enough (its pages
        // stay flanked by the gaps they had).
        let i = arena.free.iter().position(|&(_, l)| l >= span)?;
        let (s, l) = arena.free.remove(i)?;
        if l > span {
            arena.free.push_back((s + span as u64, l - span));
        }
        s
    };
    // SAFETY: [start, start + span) lies inside the arena, in no live allocation.
    let ok = unsafe { libc::mprotect(start as *mut c_void, span, libc::PROT_READ | libc::PROT_WRITE) } == 0;
    if !ok {
        unmap_device(mem, start, span);
        return None;
    }
    let end = start + span as u64;
    let base = end - rounded as u64;
    // SAFETY: the pages were just made accessible.
    unsafe {
        std::ptr::write_bytes(start as *mut u8, GUARD, (base - start) as usize);
        std::ptr::write_bytes(base as *mut u8, POISON, bytes);
        std::ptr::write_bytes((base + bytes as u64) as *mut u8, GUARD, rounded - bytes);
    }
    Some((base, start, end))
}

/// `KILN_CUDASIM_TIGHT=1` (read once): an allocation is aligned to the
/// largest power of two that divides its size, from 4 to 256 bytes, instead
/// of cuMemAlloc's 256, so that its data ends on the inaccessible page
/// whenever its size is a multiple of 4: reading one element past the end
/// then faults too. Only for programs whose kernels need no more alignment
/// than their elements' (kiln's: no vector types), in tests.
fn tight() -> bool {
    static TIGHT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TIGHT.get_or_init(|| std::env::var("KILN_CUDASIM_TIGHT").is_ok_and(|v| v == "1"))
}

/// Makes `[start, start + span)` inaccessible again, its memory given back.
fn unmap_device(mem: &mut Mem, start: u64, span: usize) {
    // SAFETY: pages of the arena, replaced by fresh inaccessible ones.
    let p = unsafe {
        libc::mmap(
            start as *mut c_void,
            span,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        // SAFETY: as above; at least keep them inaccessible.
        unsafe { libc::mprotect(start as *mut c_void, span, libc::PROT_NONE) };
    }
    if let Some(a) = mem.arena.as_mut() {
        a.free.push_back((start, span));
    }
}

/// Checks the red zones of device `dev`'s live allocations after a kernel
/// ran on it: a description of those it changed (restored, so that each
/// write is reported once), or Ok. Allocations of other devices are not
/// looked at: their own kernels may be running.
pub(crate) fn check_guards(sim: &Sim, dev: usize) -> Result<(), String> {
    let mem = lock(&sim.mem);
    let mut found = Vec::new();
    for (&base, &(len, d)) in &mem.dev {
        if d != dev {
            continue;
        }
        let Some(&(start, end)) = mem.zones.get(&base) else { continue };
        let after = base + len as u64;
        // SAFETY: the red zones of a live allocation are accessible.
        let (front, back) = unsafe {
            (
                std::slice::from_raw_parts_mut(start as *mut u8, (base - start) as usize),
                std::slice::from_raw_parts_mut(after as *mut u8, (end - after) as usize),
            )
        };
        // The common case first: both zones intact (compared a page at a
        // time with memcmp, the scan's whole cost).
        if is_guard(front) && is_guard(back) {
            continue;
        }
        let changed = |zone: &[u8]| zone.iter().filter(|&&b| b != GUARD).count();
        let (before, past) = (changed(front), changed(back));
        let mut what = Vec::new();
        if before > 0 {
            let first = front.iter().position(|&b| b != GUARD).unwrap_or(0);
            what.push(format!("{before} byte(s) before its start (from {} bytes before it)", front.len() - first));
        }
        if past > 0 {
            let last = back.iter().rposition(|&b| b != GUARD).unwrap_or(0);
            what.push(format!("{past} byte(s) after its end (up to {} bytes past it)", last + 1));
        }
        found.push(format!("device {d}'s allocation 0x{base:x} of {len} bytes: {}", what.join(" and ")));
        front.fill(GUARD);
        back.fill(GUARD);
    }
    if found.is_empty() {
        return Ok(());
    }
    let n = found.len();
    Err(format!(
        "wrote outside its memory (the simulator's red zones): {}{}",
        found.into_iter().take(3).collect::<Vec<_>>().join("; "),
        if n > 3 { format!("; and {} more allocation(s)", n - 3) } else { String::new() }
    ))
}

/// Whether every byte of `zone` is [`GUARD`].
fn is_guard(zone: &[u8]) -> bool {
    static PAGE: [u8; 4096] = [GUARD; 4096];
    zone.chunks(PAGE.len()).all(|c| c == &PAGE[..c.len()])
}

/// What address `p` (of a faulting access) is near: an allocation's end or
/// start (live or freed), or nothing the simulator made.
pub(crate) fn describe(sim: &Sim, p: u64) -> String {
    let mem = lock(&sim.mem);
    // (distance, description) of the nearest allocation of `books` within
    // GAP of p: 0 inside it, else the bytes outside it plus one.
    let near = |books: &BTreeMap<u64, (usize, usize)>, freed: bool| -> Option<(u64, String)> {
        let tag = if freed { "freed " } else { "" };
        let below = books.range(..=p).next_back().map(|(&b, &(l, d))| {
            let end = b + l as u64;
            if p < end {
                (0, format!("inside device {d}'s {tag}allocation 0x{b:x} of {l} bytes, at +{}", p - b))
            } else {
                (p - end + 1, format!("{} bytes past the end of device {d}'s {tag}allocation 0x{b:x} of {l} bytes", p - end))
            }
        });
        let above = books.range(p + 1..).next().map(|(&b, &(l, d))| {
            (b - p + 1, format!("{} bytes before the start of device {d}'s {tag}allocation 0x{b:x} of {l} bytes", b - p))
        });
        [below, above].into_iter().flatten().filter(|(dist, _)| *dist <= GAP as u64 + 1).min_by_key(|(dist, _)| *dist)
    };
    let gone = |(dist, text): (u64, String)| (dist, format!("{text} (use after free)"));
    match [near(&mem.dev, false), near(&mem.freed, true).map(gone)].into_iter().flatten().min_by_key(|(dist, _)| *dist) {
        Some((_, text)) => text,
        None => {
            let in_arena = mem.arena.as_ref().is_some_and(|a| p >= a.base && p < a.base + a.len as u64);
            if in_arena {
                format!("0x{p:x} is device memory address space, far from any allocation")
            } else {
                format!("0x{p:x} is not device memory (a host pointer or garbage)")
            }
        }
    }
}

/// Where a device address lies: (device, bytes from there to the end of its
/// allocation), or why it is not usable.
pub(crate) fn resolve(mem: &Mem, p: u64) -> Result<(usize, usize), String> {
    if let Some((&base, &(len, dev))) = mem.dev.range(..=p).next_back()
        && p <= base + len as u64
    {
        return Ok((dev, (base + len as u64 - p) as usize));
    }
    if let Some((&base, &(len, dev))) = mem.freed.range(..=p).next_back()
        && p < base + len.max(1) as u64
    {
        return Err(format!("0x{p:x} is device {dev} memory that was freed (use after free)"));
    }
    if let Some((&base, &len)) = mem.host.range(..=p).next_back()
        && p < base + len as u64
    {
        return Err(format!("0x{p:x} is page-locked host memory, not device memory"));
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
    if let Some((&base, &(alen, dev))) = mem.dev.range(..=(p as u64)).next_back()
        && (p as u64) < base + alen as u64
    {
        return Err(format!("{what}: 0x{:x} is device {dev} memory, passed where host memory is expected", p as u64));
    }
    Ok(())
}

fn layout(len: usize) -> Option<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(len.max(1), ALIGN).ok()
}

/// `KILN_CUDASIM_SHORT_ALLOC=BYTES`: an allocation of exactly BYTES bytes
/// gets 4 bytes less than asked, so that a kernel that fills the buffer it
/// was given writes past the end of its allocation (tests of the guard
/// through a program that has no out-of-bounds kernel of its own).
fn short_allocation(bytes: usize) -> usize {
    static SHORT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let short = *SHORT.get_or_init(|| env_bytes("KILN_CUDASIM_SHORT_ALLOC", 0));
    if short > 4 && bytes == short {
        log(&format!("cuMemAlloc: {bytes} bytes asked, {} given, as KILN_CUDASIM_SHORT_ALLOC asks", bytes - 4));
        bytes - 4
    } else {
        bytes
    }
}

// ---- memory in the driver API ------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    unsafe {
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
        let bytes = short_allocation(bytes);
        let Some((base, start, end)) = map_device(&mut mem, bytes) else { return OUT_OF_MEMORY };
        mem.used[ctx.dev] += bytes;
        mem.dev.insert(base, (bytes, ctx.dev));
        mem.zones.insert(base, (start, end));
        *ptr = base;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
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
    // Inaccessible from now on (a kernel still using it faults, and is
    // reported as using freed memory), its pages given back, and its
    // addresses not handed out again while the arena lasts.
    if let Some((start, end)) = mem.zones.remove(&ptr) {
        unmap_device(&mut mem, start, (end - start) as usize);
    }
    mem.freed.insert(ptr, (len, dev));
    mem.freed_order.push_back(ptr);
    while mem.freed_order.len() > FREED_BOOKS {
        let Some(old) = mem.freed_order.pop_front() else { break };
        mem.freed.remove(&old);
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    unsafe {
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
}

unsafe fn host_alloc(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    unsafe {
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
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    unsafe {
        if injected_failure("cuMemAllocHost_v2") {
            return OUT_OF_MEMORY;
        }
        host_alloc(pp, bytes)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    unsafe { host_alloc(pp, bytes) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(d: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) -> CUresult {
    unsafe {
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
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    unsafe {
        let sim = tri!(initialized());
        let mut mem = lock(&sim.mem);
        let Some(len) = mem.host.remove(&(p as u64)) else { return INVALID_VALUE };
        mem.host_bytes -= len;
        if let Some(l) = layout(len) {
            std::alloc::dealloc(p as *mut u8, l);
        }
        SUCCESS
    }
}

#[unsafe(no_mangle)]
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

#[unsafe(no_mangle)]
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, len: usize) -> CUresult {
    unsafe {
        let ctx = tri!(current());
        let r = cuMemcpyHtoDAsync_v2(dst, src, len, std::ptr::null_mut());
        if r != SUCCESS {
            return r;
        }
        let s = ctx.default_stream();
        s.wait_for(s.ticket());
        ctx.sticky()
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, len: usize) -> CUresult {
    unsafe {
        let ctx = tri!(current());
        let r = cuMemcpyDtoHAsync_v2(dst, src, len, std::ptr::null_mut());
        if r != SUCCESS {
            return r;
        }
        let s = ctx.default_stream();
        s.wait_for(s.ticket());
        ctx.sticky()
    }
}

fn owner(sim: &Sim, p: u64) -> Option<usize> {
    resolve(&lock(&sim.mem), p).ok().map(|(d, _)| d)
}

#[unsafe(no_mangle)]
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

#[unsafe(no_mangle)]
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

#[unsafe(no_mangle)]
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
