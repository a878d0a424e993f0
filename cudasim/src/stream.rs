//! Streams and events. Each stream is a worker thread that runs its queue in
//! order, asynchronously to the host: launches, copies (which read and write
//! memory when the worker gets there, not when they are queued, so a buffer
//! reused too early shows), waits on other streams' events, waits on values
//! in mapped host memory, cuBLAS gemms and ranks of NCCL collectives. A failed op makes the context's
//! fault sticky and the rest of the queue is skipped, as on a GPU.

use crate::context::{current, initialized, injected_failure, registry, sim, Ctx};
use crate::hostcc::HostModule;
use crate::memory::{self, check_range};
use crate::{blas, census, exec, lock, log, tri, CUdeviceptr, CUresult};
use crate::{ILLEGAL_ADDRESS, INVALID_HANDLE, INVALID_VALUE, LAUNCH_FAILED, LAUNCH_OUT_OF_RESOURCES, NOT_INITIALIZED};
use crate::{NOT_READY, OUT_OF_MEMORY, SUCCESS};
use std::collections::VecDeque;
use std::ffi::{c_uint, c_void};
use std::sync::{Arc, Condvar, Mutex};

/// One unit of a stream's queue.
pub(crate) enum Op {
    /// A launch: `args` holds each argument's bytes (copied at launch, as the
    /// driver does), `ptrs` which of them are pointers to check.
    Kernel {
        name: String,
        host: Arc<HostModule>,
        index: usize,
        grid: u32,
        block: u32,
        args: Vec<Vec<u64>>,
        ptrs: Vec<usize>,
    },
    HtoD {
        dst: u64,
        src: usize,
        len: usize,
    },
    DtoH {
        dst: usize,
        src: u64,
        len: usize,
    },
    DtoD {
        dst: u64,
        dst_dev: usize,
        src: u64,
        src_dev: usize,
        len: usize,
    },
    Memset {
        dst: u64,
        value: u8,
        len: usize,
    },
    Wait {
        stream: Arc<Stream>,
        ticket: u64,
    },
    WaitValue {
        addr: usize,
        value: u32,
        flags: u32,
    },
    Gemm(blas::Gemm),
    /// A cuDNN convolution (`dnn.rs`).
    Dnn(Box<crate::dnn::Conv>),
    /// This rank's part of an NCCL collective (`nccl.rs`).
    Nccl(Box<crate::nccl::Task>),
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    submitted: u64,
    done: u64,
    closing: bool,
}

pub(crate) struct Stream {
    pub ctx: &'static Ctx,
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Stream {
    pub(crate) fn new(ctx: &'static Ctx) -> Arc<Stream> {
        let s = Arc::new(Stream { ctx, q: Mutex::new(Queue::default()), cv: Condvar::new() });
        let worker = s.clone();
        let spawned = std::thread::Builder::new().name(format!("cudasim-dev{}", ctx.dev)).spawn(move || worker.serve());
        if let Err(e) = spawned {
            ctx.fault(LAUNCH_FAILED, format!("cannot start a stream worker thread: {e}"));
        }
        s
    }

    pub(crate) fn push(&self, op: Op) -> u64 {
        let mut q = lock(&self.q);
        q.ops.push_back(op);
        q.submitted += 1;
        self.cv.notify_all();
        q.submitted
    }

    /// The ticket of the last op submitted so far.
    pub(crate) fn ticket(&self) -> u64 {
        lock(&self.q).submitted
    }

    pub(crate) fn wait_for(&self, ticket: u64) {
        let mut q = lock(&self.q);
        while q.done < ticket {
            q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn reached(&self, ticket: u64) -> bool {
        lock(&self.q).done >= ticket
    }

    fn serve(self: Arc<Self>) {
        loop {
            let op = {
                let mut q = lock(&self.q);
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        break op;
                    }
                    if q.closing {
                        return;
                    }
                    q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            if self.ctx.sticky() == SUCCESS {
                if let Err((code, msg)) = self.run(op) {
                    self.ctx.fault(code, msg);
                }
            } else if let (Op::Nccl(task), Some(sim)) = (op, sim()) {
                // The other ranks learn that this one cannot take part.
                task.abandon(sim);
            }
            let mut q = lock(&self.q);
            q.done += 1;
            self.cv.notify_all();
        }
    }

    fn run(&self, op: Op) -> Result<(), (CUresult, String)> {
        let sim = sim().ok_or((NOT_INITIALIZED, "no simulator".to_string()))?;
        let dev = self.ctx.dev;
        let bad = |m: String| (ILLEGAL_ADDRESS, m);
        match op {
            Op::Kernel { name, host, index, grid, block, mut args, ptrs } => {
                for &i in &ptrs {
                    let p = args[i][0];
                    if p != 0 {
                        check_range(sim, dev, p, 1, &format!("kernel {name}, argument {i}")).map_err(bad)?;
                    }
                }
                let counting = census::enabled();
                // What the arguments can reach, before the kernel runs
                // (allocations do not change under it).
                let arg_bytes = if counting { census::reachable_bytes(&lock(&sim.mem), args.iter().flatten().copied()) } else { 0 };
                let params: Vec<*mut c_void> = args.iter_mut().map(|a| a.as_mut_ptr() as *mut c_void).collect();
                let ran = exec::run_grid(&host, index, grid, block, &params, counting);
                // Whatever happened, the red zones of this device's memory
                // say whether the kernel wrote outside its allocations (a
                // fault may follow such a write, and a write may not fault).
                let guards = memory::check_guards(sim, dev);
                match ran {
                    Err(exec::GridError::Resources(e)) => Err((LAUNCH_OUT_OF_RESOURCES, format!("kernel {name}: {e}"))),
                    Err(exec::GridError::Fault { tx, bx, trap }) => {
                        let access = match trap.write {
                            Some(true) => "a write",
                            Some(false) => "a read",
                            None => "an access",
                        };
                        let signal = if trap.sig == libc::SIGBUS { "SIGBUS" } else { "SIGSEGV" };
                        let place = if trap.stack {
                            format!("0x{:x}, the end of its stack (a stack overflow: each GPU thread has 128 KiB here)", trap.addr)
                        } else {
                            format!("0x{:x}: {}", trap.addr, memory::describe(sim, trap.addr as u64))
                        };
                        let also = guards.err().map(|g| format!("; it also {g}")).unwrap_or_default();
                        Err((
                            ILLEGAL_ADDRESS,
                            format!("kernel {name}: thread {tx} of block {bx} faulted ({signal}) on {access} at {place}{also}"),
                        ))
                    }
                    Ok(work) => {
                        guards.map_err(|g| (ILLEGAL_ADDRESS, format!("kernel {name} {g}")))?;
                        if counting {
                            census::record(census::Record {
                                kind: "kernel",
                                device: dev,
                                name,
                                grid: grid as u64,
                                block: block as u64,
                                threads: grid as u64 * block as u64,
                                work,
                                arg_bytes,
                                ..Default::default()
                            });
                        }
                        Ok(())
                    }
                }
            }
            Op::HtoD { dst, src, len } => {
                check_range(sim, dev, dst, len, "cuMemcpyHtoDAsync destination").map_err(bad)?;
                // SAFETY: the caller promised `len` readable host bytes at `src`
                // until the stream reaches this copy.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                Ok(())
            }
            Op::DtoH { dst, src, len } => {
                check_range(sim, dev, src, len, "cuMemcpyDtoHAsync source").map_err(bad)?;
                // SAFETY: as above, `len` writable host bytes at `dst`.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                Ok(())
            }
            Op::DtoD { dst, dst_dev, src, src_dev, len } => {
                check_range(sim, dst_dev, dst, len, "device copy destination").map_err(bad)?;
                check_range(sim, src_dev, src, len, "device copy source").map_err(bad)?;
                // SAFETY: both ranges checked live above.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                Ok(())
            }
            Op::Memset { dst, value, len } => {
                check_range(sim, dev, dst, len, "cuMemsetD8Async").map_err(bad)?;
                // SAFETY: checked live above.
                unsafe { std::ptr::write_bytes(dst as *mut u8, value, len) };
                Ok(())
            }
            Op::Wait { stream, ticket } => {
                stream.wait_for(ticket);
                Ok(())
            }
            Op::WaitValue { addr, value, flags } => {
                loop {
                    // SAFETY: page-locked host memory mapped for the device,
                    // checked at submission; read as the GPU would, volatile.
                    let v = unsafe { std::ptr::read_volatile(addr as *const u32) };
                    let ok = match flags & 3 {
                        0 => (v as i32).wrapping_sub(value as i32) >= 0,
                        1 => v == value,
                        2 => v & value != 0,
                        _ => !(v | value) != 0,
                    };
                    if ok {
                        return Ok(());
                    }
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
            }
            Op::Gemm(g) => g.run(sim, dev).map_err(bad),
            Op::Dnn(c) => c.run(sim, dev).map_err(bad),
            Op::Nccl(task) => task.run(sim),
        }
    }
}

/// The stream behind a handle (null: the context's default stream).
pub(crate) fn stream_of(h: *mut c_void, ctx: &'static Ctx) -> Result<Arc<Stream>, CUresult> {
    if h.is_null() || h as usize == 1 || h as usize == 2 {
        return Ok(ctx.default_stream());
    }
    registry().streams.get(&(h as usize)).cloned().ok_or(INVALID_HANDLE)
}

/// A stream of the current context, as every stream call requires.
pub(crate) fn stream_here(h: *mut c_void) -> Result<(&'static Ctx, Arc<Stream>), CUresult> {
    let ctx = current()?;
    let s = stream_of(h, ctx)?;
    if !std::ptr::eq(s.ctx, ctx) {
        log(&format!("a stream of device {} used while device {}'s context is current", s.ctx.dev, ctx.dev));
        return Err(INVALID_HANDLE);
    }
    Ok((ctx, s))
}

struct EventState {
    recorded: Option<(Arc<Stream>, u64)>,
}

// ---- streams and events in the driver API ------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(out: *mut *mut c_void, flags: c_uint) -> CUresult {
    unsafe {
        let ctx = tri!(current());
        if out.is_null() || flags > 1 {
            return INVALID_VALUE;
        }
        let s = Stream::new(ctx);
        let h = Arc::as_ptr(&s) as *mut c_void;
        registry().streams.insert(h as usize, s);
        *out = h;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    tri!(initialized());
    let Some(s) = registry().streams.remove(&(stream as usize)) else { return INVALID_HANDLE };
    let mut q = lock(&s.q);
    q.closing = true;
    s.cv.notify_all();
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    s.wait_for(s.ticket());
    ctx.sticky()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery(stream: *mut c_void) -> CUresult {
    let (ctx, s) = tri!(stream_here(stream));
    match ctx.sticky() {
        SUCCESS if s.reached(s.ticket()) => SUCCESS,
        SUCCESS => NOT_READY,
        e => e,
    }
}

fn event(h: *mut c_void) -> Result<&'static Mutex<EventState>, CUresult> {
    if h.is_null() || !registry().events.contains(&(h as usize)) {
        return Err(INVALID_HANDLE);
    }
    // SAFETY: registered handles are live boxes of Mutex<EventState>.
    Ok(unsafe { &*(h as *const Mutex<EventState>) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(out: *mut *mut c_void, _flags: c_uint) -> CUresult {
    unsafe {
        let _ = tri!(current());
        if out.is_null() {
            return INVALID_VALUE;
        }
        if injected_failure("cuEventCreate") {
            return OUT_OF_MEMORY;
        }
        let h = Box::into_raw(Box::new(Mutex::new(EventState { recorded: None }))) as *mut c_void;
        registry().events.insert(h as usize);
        *out = h;
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(ev: *mut c_void) -> CUresult {
    unsafe {
        tri!(initialized());
        if !registry().events.remove(&(ev as usize)) {
            return INVALID_HANDLE;
        }
        drop(Box::from_raw(ev as *mut Mutex<EventState>));
        SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(ev: *mut c_void, stream: *mut c_void) -> CUresult {
    let (_, s) = tri!(stream_here(stream));
    let e = tri!(event(ev));
    let ticket = s.ticket();
    lock(e).recorded = Some((s, ticket));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(ev: *mut c_void) -> CUresult {
    tri!(initialized());
    let e = tri!(event(ev));
    let rec = lock(e).recorded.clone();
    if let Some((s, t)) = rec {
        s.wait_for(t);
        return s.ctx.sticky();
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(ev: *mut c_void) -> CUresult {
    tri!(initialized());
    let e = tri!(event(ev));
    let rec = lock(e).recorded.clone();
    match rec {
        Some((s, t)) if !s.reached(t) => NOT_READY,
        Some((s, _)) => s.ctx.sticky(),
        None => SUCCESS,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(stream: *mut c_void, ev: *mut c_void, _flags: c_uint) -> CUresult {
    let (_, s) = tri!(stream_here(stream));
    let e = tri!(event(ev));
    let rec = lock(e).recorded.clone();
    if let Some((other, ticket)) = rec
        && !Arc::ptr_eq(&other, &s)
    {
        s.push(Op::Wait { stream: other, ticket });
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitValue32_v2(stream: *mut c_void, addr: CUdeviceptr, value: u32, flags: c_uint) -> CUresult {
    let (_, s) = tri!(stream_here(stream));
    let sim = tri!(initialized());
    let mem = lock(&sim.mem);
    let ok = matches!(mem.host.range(..=addr).next_back(), Some((&b, &l)) if addr + 4 <= b + l as u64);
    drop(mem);
    if !ok || addr & 3 != 0 || flags > 3 {
        log(&format!("cuStreamWaitValue32: 0x{addr:x} is not 4 aligned bytes of mapped page-locked host memory"));
        return INVALID_VALUE;
    }
    s.push(Op::WaitValue { addr: addr as usize, value, flags });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitValue32(stream: *mut c_void, addr: CUdeviceptr, value: u32, flags: c_uint) -> CUresult {
    unsafe { cuStreamWaitValue32_v2(stream, addr, value, flags) }
}
