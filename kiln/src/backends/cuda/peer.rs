//! Holding a device's queue (for tests of asynchrony) and copies between
//! two CUDA devices with peer access.

use super::{ck, dev_ptr, CudaBackend, Raw};
use crate::base::error::Result;
use crate::kernel::index_check::FaultRecord;
use crate::kernel::QueueHold;
use crate::kernel::Src;
use cudarc::driver::sys as cu;
use std::ffi::{c_int, c_void};

impl CudaBackend {
    /// Stops the stream at this point until the hold drops: the stream waits
    /// on a word of mapped pinned memory that a helper thread sets then.
    pub(super) fn hold(&self) -> Result<QueueHold> {
        use std::sync::atomic::{AtomicU32, Ordering};
        let mut flag = self.hold_flag.lock().unwrap_or_else(|e| e.into_inner());
        if flag.is_none() {
            let mut host: *mut c_void = std::ptr::null_mut();
            let mut dev: cu::CUdeviceptr = 0;
            // SAFETY: out-pointers to locals; 2 = CU_MEMHOSTALLOC_DEVICEMAP.
            // The word lives as long as the process.
            unsafe {
                ck(cu::cuMemHostAlloc(&mut host, 4, 2), "cuMemHostAlloc").map_err(|e| self.err(e))?;
                (*(host as *const AtomicU32)).store(0, Ordering::SeqCst);
                if let Err(e) = ck(cu::cuMemHostGetDevicePointer_v2(&mut dev, host, 0), "cuMemHostGetDevicePointer") {
                    let _ = cu::cuMemFreeHost(host);
                    return Err(self.err(e));
                }
            }
            *flag = Some((Raw(host as *mut u32), dev));
        }
        let (host, dev) = flag.as_ref().map(|(h, d)| (h.0 as usize, *d)).unwrap_or((0, 0));
        let n = self.holds.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
        // SAFETY: a mapped pinned word; 0 = CU_STREAM_WAIT_VALUE_GEQ.
        ck(unsafe { cu::cuStreamWaitValue32_v2(self.stream.0, dev, n, 0) }, "cuStreamWaitValue32")
            .map_err(|e| self.err(format!("{e}: this device cannot hold its queue (stream memory operations unsupported)")))?;
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        std::thread::Builder::new()
            .name(format!("kiln-cuda-hold-{}", self.device))
            .spawn(move || {
                let _ = rx.recv();
                // SAFETY: the word lives as long as the process.
                unsafe { (*(host as *const AtomicU32)).fetch_max(n, Ordering::SeqCst) };
            })
            .map_err(|e| self.err(format!("cannot start the thread that releases the hold: {e}")))?;
        Ok(QueueHold { _release: tx })
    }

    /// The device address of the fault record that index checks write
    /// (`kernel::index_check`), made on first use: 40 bytes of mapped
    /// pinned memory, so the host reads it without a copy.
    pub(super) fn fault_ptr(&self) -> Result<u64> {
        let mut fault = self.fault.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, dev)) = fault.as_ref() {
            return Ok(*dev);
        }
        let size = std::mem::size_of::<FaultRecord>();
        let mut host: *mut c_void = std::ptr::null_mut();
        let mut dev: cu::CUdeviceptr = 0;
        // SAFETY: out-pointers to locals; 2 = CU_MEMHOSTALLOC_DEVICEMAP. The
        // record lives as long as the process.
        unsafe {
            ck(cu::cuMemHostAlloc(&mut host, size, 2), "cuMemHostAlloc").map_err(|e| self.err(e))?;
            std::ptr::write_bytes(host as *mut u8, 0, size);
            if let Err(e) = ck(cu::cuMemHostGetDevicePointer_v2(&mut dev, host, 0), "cuMemHostGetDevicePointer") {
                let _ = cu::cuMemFreeHost(host);
                return Err(self.err(e));
            }
        }
        *fault = Some((Raw(host as *mut FaultRecord), dev));
        self.fault_host.store(host as *mut FaultRecord, std::sync::atomic::Ordering::Release);
        Ok(dev)
    }

    /// The bad index a kernel recorded, if any, as the error to report;
    /// `take` clears the record (a synchronising call reports it once).
    /// Reads pinned host memory: no transfer, no wait, no lock.
    pub(super) fn fault(&self, take: bool) -> Option<crate::Error> {
        use std::sync::atomic::{AtomicU32, Ordering};
        let rec = self.fault_host.load(Ordering::Acquire);
        if rec.is_null() {
            return None;
        }
        // SAFETY: the record lives as long as the process; kernels write it
        // with atomics and publish it with state 2 after a system fence.
        unsafe {
            let state = &*(std::ptr::addr_of!((*rec).state) as *const AtomicU32);
            if state.load(Ordering::Acquire) != 2 {
                return None;
            }
            let copy = std::ptr::read_volatile(rec);
            // Taken once: of two threads synchronising at once, one reports it.
            if take && state.compare_exchange(2, 0, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return None;
            }
            Some(copy.error(self.device))
        }
    }

    /// Whether this device may access `peer`'s memory: asks the driver and
    /// enables peer access from this context on the first call per peer.
    pub(super) fn peer_access(&self, peer: &CudaBackend) -> bool {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&ok) = peers.get(&peer.ordinal) {
            return ok;
        }
        let ok = self
            .guarded("enabling peer access", || {
                let (mut a, mut b, mut can): (cu::CUdevice, cu::CUdevice, c_int) = (0, 0, 0);
                // SAFETY: out-pointers to locals; this context is bound and
                // the peer's lives as long as the process.
                unsafe {
                    ck(cu::cuDeviceGet(&mut a, self.ordinal as c_int), "cuDeviceGet").map_err(|e| self.err(e))?;
                    ck(cu::cuDeviceGet(&mut b, peer.ordinal as c_int), "cuDeviceGet").map_err(|e| self.err(e))?;
                    ck(cu::cuDeviceCanAccessPeer(&mut can, a, b), "cuDeviceCanAccessPeer").map_err(|e| self.err(e))?;
                    Ok(can != 0
                        && matches!(
                            cu::cuCtxEnablePeerAccess(peer.ctx.0, 0),
                            cu::CUresult::CUDA_SUCCESS | cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                        ))
                }
            })
            .unwrap_or(false);
        peers.insert(peer.ordinal, ok);
        ok
    }

    /// Queues a copy of `src` into `dst` (device memory of `peer`) on this
    /// stream, after the work queued so far on `peer`'s stream, and makes
    /// `peer`'s stream wait for it: a two-way barrier with events, as
    /// PyTorch's cross-device copy has. `dst` is a block of `peer`'s cache,
    /// which returns blocks in `peer`'s stream order: kernels queued there
    /// may still use it, and a copy on this stream is not ordered after them
    /// otherwise.
    pub(super) fn queue_peer_copy(&self, src: &Src, peer: &CudaBackend, dst: u64) -> Result<()> {
        self.wait_for_stream_of(peer)?;
        let size = src.storage.dtype.size_in_bytes();
        let bytes = src.layout.elem_count() * size;
        let base = dev_ptr(self, &src.storage)?;
        // The front end hands over contiguous views (see `download`).
        let Some((a, _)) = src.layout.contiguous_range() else {
            return Err(self.err("a strided view reached a peer copy (a kiln bug: please report it)"));
        };
        let from = base + (a * size) as u64;
        let mut ev: cu::CUevent = std::ptr::null_mut();
        // SAFETY: both ranges are device memory of at least `bytes` bytes,
        // kept for the copy by stream order on both devices; the event is
        // destroyed once the wait on it is queued (the driver defers that).
        unsafe {
            if bytes > 0 {
                ck(cu::cuMemcpyPeerAsync(dst, peer.ctx.0, from, self.ctx.0, bytes, self.stream.0), "cuMemcpyPeerAsync")
                    .map_err(|e| self.err(e))?;
            }
            ck(cu::cuEventCreate(&mut ev, 2), "cuEventCreate").map_err(|e| self.err(e))?;
            let mut queued = ck(cu::cuEventRecord(ev, self.stream.0), "cuEventRecord").map_err(|e| self.err(e));
            if queued.is_ok() {
                queued = peer
                    .bind()
                    .and_then(|()| ck(cu::cuStreamWaitEvent(peer.stream.0, ev, 0), "cuStreamWaitEvent").map_err(|e| peer.err(e)));
            }
            let _ = cu::cuEventDestroy_v2(ev);
            queued
        }
    }

    /// Makes this device's stream wait (on the device) for the work queued
    /// so far on `peer`'s stream; leaves this device's context bound.
    fn wait_for_stream_of(&self, peer: &CudaBackend) -> Result<()> {
        let mut ev: cu::CUevent = std::ptr::null_mut();
        peer.bind()?;
        // SAFETY: the event is made and recorded in `peer`'s context, waited
        // on from this one, and destroyed once the wait is queued.
        unsafe {
            ck(cu::cuEventCreate(&mut ev, 2), "cuEventCreate").map_err(|e| peer.err(e))?;
            let recorded = ck(cu::cuEventRecord(ev, peer.stream.0), "cuEventRecord").map_err(|e| peer.err(e));
            let waited = recorded.and_then(|()| {
                self.bind()?;
                ck(cu::cuStreamWaitEvent(self.stream.0, ev, 0), "cuStreamWaitEvent").map_err(|e| self.err(e))
            });
            let _ = cu::cuEventDestroy_v2(ev);
            self.bind()?;
            waited
        }
    }
}
