//! A CUDA device's memory: a caching allocator in size classes (blocks are
//! reused in stream order, so nothing is kept alive for queued work), and
//! pinned staging chunks for transfers to and from the host.

use super::{ck, error_text, CudaBackend, DevBuf, Raw};
use crate::base::buffer::CpuBuffer;
use crate::base::error::{human_bytes, Error, Result};
use crate::map_buffer;
use cudarc::driver::sys as cu;
use std::collections::HashMap;
use std::ffi::c_void;

/// Bytes rounded up to the allocator's size classes: 512 B below 1 MiB,
/// 2 MiB above, so that freed blocks fit later requests of similar size.
///
/// With `KILN_CUDA_EXACT_BLOCKS=1` (read once) blocks are the bytes asked,
/// rounded to 4 only, so that a memory checker below kiln (the CUDA
/// simulator's red zones, compute-sanitizer) sees a kernel that overruns its
/// tensor and not only one that overruns the block; for tests.
fn size_class(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 2 << 20;
    static EXACT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *EXACT.get_or_init(|| crate::env_flag("KILN_CUDA_EXACT_BLOCKS") == Some(true)) {
        return bytes.div_ceil(4) * 4;
    }
    if bytes < (1 << 20) {
        bytes.div_ceil(SMALL) * SMALL
    } else {
        bytes.div_ceil(LARGE) * LARGE
    }
}

/// Freed device blocks by size class, reused before asking the driver.
#[derive(Default)]
pub(super) struct BlockCache {
    pub(super) free: HashMap<usize, Vec<u64>>,
    pub(super) bytes: usize,
}

/// Pinned host memory for staging transfers: at least two chunks, so that the
/// CPU copy of one overlaps the DMA of the other, and up to
/// [`MAX_STAGING_CHUNKS`] so that an upload queued behind long-running work
/// takes a free chunk instead of waiting for that work (uploads overlap
/// compute).
pub(super) struct Staging {
    chunks: Vec<StagingChunk>,
    /// Counts chunk uses, to pick the least recently used one to wait for.
    uses: u64,
}

struct StagingChunk {
    ptr: Raw<*mut u8>,
    size: usize,
    /// Recorded after the last DMA that used this chunk.
    event: Raw<cu::CUevent>,
    pending: bool,
    last_use: u64,
}

/// Bytes per staging chunk.
const STAGING_CHUNK: usize = 8 << 20;
/// Most staging chunks per device (64 MiB of pinned memory).
const MAX_STAGING_CHUNKS: usize = 8;

impl CudaBackend {
    // ---- memory -----------------------------------------------------------

    /// Device memory of at least `bytes`, from the cache or the driver. On a
    /// driver OOM the cache is given back and the allocation retried once.
    /// `None` means out of memory.
    pub(crate) fn alloc_dev(&self, bytes: usize) -> Result<Option<DevBuf>> {
        if bytes == 0 {
            return Ok(Some(DevBuf { ptr: 0, cap: 0 }));
        }
        let cap = size_class(bytes);
        {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(ptr) = cache.free.get_mut(&cap).and_then(|v| v.pop()) {
                cache.bytes -= cap;
                self.pool.set_cached(cache.bytes);
                return Ok(Some(DevBuf { ptr, cap }));
            }
        }
        for attempt in 0..2 {
            let mut ptr: cu::CUdeviceptr = 0;
            // SAFETY: out-pointer to a local; the context is bound by the caller.
            let r = unsafe { cu::cuMemAlloc_v2(&mut ptr, cap) };
            match r {
                cu::CUresult::CUDA_SUCCESS => return Ok(Some(DevBuf { ptr, cap })),
                cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY if attempt == 0 => self.free_cache()?,
                cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => return Ok(None),
                other => return Err(self.err(format!("cuMemAlloc of {} failed: {}", human_bytes(cap), error_text(other)))),
            }
        }
        Ok(None)
    }

    /// Returns a block to the cache. Safe at once: every later use of the
    /// block is queued on the same stream after the work that used it.
    pub(crate) fn free_dev(&self, buf: DevBuf) {
        if buf.cap == 0 {
            return;
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.free.entry(buf.cap).or_default().push(buf.ptr);
        cache.bytes += buf.cap;
        self.pool.set_cached(cache.bytes);
    }

    /// Gives every cached block back to the driver. The blocks are taken out
    /// of the cache first and the stream synchronised after: every kernel
    /// that used a taken block was queued before it returned to the cache,
    /// so before the sync (taking them after the sync would free a block
    /// that another thread reused and queued work on in between). Binds the
    /// context itself, so it works from any thread; a failed cuMemFree is an
    /// error naming the device and the bytes.
    pub(super) fn free_cache(&self) -> Result<()> {
        self.bind()?;
        let blocks: Vec<(usize, u64)> = {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            let taken = cache.free.drain().flat_map(|(cap, ptrs)| ptrs.into_iter().map(move |p| (cap, p))).collect();
            cache.bytes = 0;
            self.pool.set_cached(0);
            taken
        };
        if blocks.is_empty() {
            return Ok(());
        }
        // SAFETY: the stream is alive; the blocks are in no cache and unused
        // once the work queued before this point has run.
        unsafe {
            ck(cu::cuStreamSynchronize(self.stream.0), "cuStreamSynchronize").map_err(|e| self.err(e))?;
            let mut failed = Vec::new();
            for &(cap, p) in &blocks {
                if let Err(e) = ck(cu::cuMemFree_v2(p), "cuMemFree") {
                    failed.push((cap, e));
                }
            }
            if let Some((_, first)) = failed.first() {
                let bytes: usize = failed.iter().map(|(c, _)| c).sum();
                return Err(self.err(format!(
                    "emptying the cache: {} of {} blocks ({}) could not be freed; first: {first}; the memory stays allocated \
                     until the process exits",
                    failed.len(),
                    blocks.len(),
                    human_bytes(bytes)
                )));
            }
        }
        Ok(())
    }

    pub(super) fn oom(&self, bytes: usize) -> Error {
        let stats = self.pool.stats();
        Error::OutOfMemory {
            device: self.device,
            requested: bytes,
            in_use: stats.in_use,
            capacity: stats.capacity.unwrap_or(0),
            limit: None,
        }
    }

    // ---- transfers ----------------------------------------------------------

    /// One pinned chunk and its event, or None (and nothing leaked) when
    /// either cannot be had.
    fn new_chunk(&self) -> Option<StagingChunk> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let mut ev: cu::CUevent = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; 2 = CU_EVENT_DISABLE_TIMING. The
        // pinned block is freed again if the event cannot be made.
        unsafe {
            if cu::cuMemAllocHost_v2(&mut p, STAGING_CHUNK) != cu::CUresult::CUDA_SUCCESS {
                return None;
            }
            if cu::cuEventCreate(&mut ev, 2) != cu::CUresult::CUDA_SUCCESS {
                let _ = cu::cuMemFreeHost(p);
                return None;
            }
        }
        Some(StagingChunk { ptr: Raw(p as *mut u8), size: STAGING_CHUNK, event: Raw(ev), pending: false, last_use: 0 })
    }

    fn drop_chunk(c: StagingChunk) {
        // SAFETY: the chunk's DMA is finished or never started; freed once.
        unsafe {
            let _ = cu::cuEventDestroy_v2(c.event.0);
            let _ = cu::cuMemFreeHost(c.ptr.0 as *mut c_void);
        }
    }

    /// Runs `f` with the staging chunks, creating them on first use. `None`
    /// when pinned memory cannot be had (transfers then go synchronously).
    fn with_staging<T>(&self, f: impl FnOnce(Option<&mut Staging>) -> Result<T>) -> Result<T> {
        let mut guard = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let mut chunks = Vec::new();
            for _ in 0..2 {
                match self.new_chunk() {
                    Some(c) => chunks.push(c),
                    None => break,
                }
            }
            if chunks.len() < 2 {
                // One chunk is not enough for the double buffering: give it back.
                chunks.into_iter().for_each(Self::drop_chunk);
                *guard = Some(None);
            } else {
                *guard = Some(Some(Staging { chunks, uses: 0 }));
            }
        }
        f(guard.as_mut().and_then(|s| s.as_mut()))
    }

    /// A chunk the host may fill now: one whose last DMA has finished
    /// (asked without blocking), else a new one while fewer than
    /// MAX_STAGING_CHUNKS exist, else the least recently used one once its
    /// DMA is done.
    fn free_chunk(&self, st: &mut Staging) -> Result<usize> {
        st.uses += 1;
        let mut order: Vec<usize> = (0..st.chunks.len()).collect();
        order.sort_by_key(|&i| st.chunks[i].last_use);
        for &i in &order {
            let c = &mut st.chunks[i];
            if c.pending {
                // SAFETY: the event is alive.
                match unsafe { cu::cuEventQuery(c.event.0) } {
                    cu::CUresult::CUDA_SUCCESS => c.pending = false,
                    cu::CUresult::CUDA_ERROR_NOT_READY => continue,
                    other => return Err(self.err(format!("cuEventQuery failed: {}", error_text(other)))),
                }
            }
            c.last_use = st.uses;
            return Ok(i);
        }
        if st.chunks.len() < MAX_STAGING_CHUNKS
            && let Some(mut c) = self.new_chunk()
        {
            c.last_use = st.uses;
            st.chunks.push(c);
            return Ok(st.chunks.len() - 1);
        }
        let i = order[0];
        let c = &mut st.chunks[i];
        // SAFETY: the event is alive.
        ck(unsafe { cu::cuEventSynchronize(c.event.0) }, "cuEventSynchronize").map_err(|e| self.err(e))?;
        c.pending = false;
        c.last_use = st.uses;
        Ok(i)
    }

    /// Host bytes to device memory, queued on the stream. Returns once the
    /// host bytes have been copied out (to pinned staging or by the driver).
    pub(super) fn write_device(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let stream = self.stream.0;
        self.with_staging(|staging| {
            // SAFETY: pointers to live host memory and device memory of at
            // least `src.len()` bytes; staging chunks are reused only after
            // their event says the previous DMA finished.
            unsafe {
                let Some(st) = staging else {
                    ck(cu::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), stream), "cuMemcpyHtoDAsync")
                        .map_err(|e| self.err(e))?;
                    return ck(cu::cuStreamSynchronize(stream), "cuStreamSynchronize").map_err(|e| self.err(e));
                };
                for (i, piece) in src.chunks(STAGING_CHUNK).enumerate() {
                    let k = self.free_chunk(st)?;
                    let c = &mut st.chunks[k];
                    std::ptr::copy_nonoverlapping(piece.as_ptr(), c.ptr.0, piece.len());
                    let at = dst + (i * STAGING_CHUNK) as u64;
                    ck(cu::cuMemcpyHtoDAsync_v2(at, c.ptr.0 as *const c_void, piece.len(), stream), "cuMemcpyHtoDAsync")
                        .map_err(|e| self.err(e))?;
                    ck(cu::cuEventRecord(c.event.0, stream), "cuEventRecord").map_err(|e| self.err(e))?;
                    c.pending = true;
                    debug_assert!(piece.len() <= c.size);
                }
                Ok(())
            }
        })
    }

    /// Device bytes to host memory, after all queued work; blocks until done.
    pub(super) fn read_device(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let stream = self.stream.0;
        self.with_staging(|staging| {
            // SAFETY: as in write_device; a chunk is read on the host only
            // after its event completed.
            unsafe {
                let Some(st) = staging else {
                    ck(cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len(), stream), "cuMemcpyDtoHAsync")
                        .map_err(|e| self.err(e))?;
                    return ck(cu::cuStreamSynchronize(stream), "cuStreamSynchronize").map_err(|e| self.err(e));
                };
                let total = dst.len();
                let n = total.div_ceil(STAGING_CHUNK);
                let issue = |st: &mut Staging, i: usize| -> Result<()> {
                    let c = &mut st.chunks[i % 2];
                    if c.pending {
                        ck(cu::cuEventSynchronize(c.event.0), "cuEventSynchronize").map_err(|e| self.err(e))?;
                    }
                    let len = STAGING_CHUNK.min(total - i * STAGING_CHUNK);
                    let at = src + (i * STAGING_CHUNK) as u64;
                    ck(cu::cuMemcpyDtoHAsync_v2(c.ptr.0 as *mut c_void, at, len, stream), "cuMemcpyDtoHAsync").map_err(|e| self.err(e))?;
                    ck(cu::cuEventRecord(c.event.0, stream), "cuEventRecord").map_err(|e| self.err(e))?;
                    c.pending = true;
                    Ok(())
                };
                issue(st, 0)?;
                for i in 0..n {
                    if i + 1 < n {
                        issue(st, i + 1)?;
                    }
                    let c = &mut st.chunks[i % 2];
                    ck(cu::cuEventSynchronize(c.event.0), "cuEventSynchronize").map_err(|e| self.err(e))?;
                    c.pending = false;
                    let start = i * STAGING_CHUNK;
                    let len = STAGING_CHUNK.min(total - start);
                    std::ptr::copy_nonoverlapping(c.ptr.0, dst.as_mut_ptr().add(start), len);
                }
                Ok(())
            }
        })
    }

    /// A temporary device buffer, returned to the cache when dropped.
    /// Booked in the device's ledger like a tensor (a convolution's
    /// workspace counts against `KILN_CUDA_MEMORY` and shows in the memory
    /// figures while it lives).
    pub(crate) fn temp_buf(&self, bytes: usize) -> Result<TempBuf<'_>> {
        self.pool.reserve(bytes)?;
        match self.alloc_dev(bytes) {
            Ok(Some(buf)) => Ok(TempBuf { backend: self, buf: Some(buf), bytes }),
            Ok(None) => {
                self.pool.unreserve(bytes);
                Err(self.oom(bytes))
            }
            Err(e) => {
                self.pool.unreserve(bytes);
                Err(e)
            }
        }
    }
}

/// Scratch device memory for one operation.
pub(crate) struct TempBuf<'a> {
    backend: &'a CudaBackend,
    buf: Option<DevBuf>,
    bytes: usize,
}

impl TempBuf<'_> {
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.as_ref().map(|b| b.ptr).unwrap_or(0)
    }
}

impl Drop for TempBuf<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.backend.free_dev(b);
            self.backend.pool.unreserve(self.bytes);
        }
    }
}

/// The typed elements of a host buffer as bytes.
pub(super) fn host_bytes(buf: &CpuBuffer) -> &[u8] {
    map_buffer!(buf, v => {
        // SAFETY: plain-old-data elements viewed as their bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(&v[..])) }
    })
}

pub(super) fn host_bytes_mut(buf: &mut CpuBuffer) -> &mut [u8] {
    map_buffer!(buf, v => {
        // SAFETY: every bit pattern is a valid element of these types
        // (f16/bf16 are u16 newtypes), and the slice covers exactly the vector.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(&v[..])) }
    })
}
