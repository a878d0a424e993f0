//! How one launch runs: the blocks of the grid one after another on the
//! stream's worker thread, the threads of a block as fibers (corosensei)
//! switched at `__syncthreads()`, so that a block's threads see each other's
//! `__shared__` writes at a barrier exactly as the kernel's author expects,
//! without an OS thread per GPU thread.
//!
//! A kernel that touches an inaccessible page (the guard pages around every
//! device allocation, freed device memory, a null or wild pointer) or
//! overflows its fiber's stack raises SIGSEGV (or SIGBUS) on the worker
//! thread. The simulator's handler (installed at the first launch, on an
//! alternate signal stack of each worker) sees that the fault came from the
//! fiber being resumed and makes that fiber return a [`Trap`] instead of
//! going on (corosensei's trap support: the handler rewrites the
//! interrupted registers so that the fiber's stack is reset and it returns);
//! the block's other fibers are abandoned (`force_reset`: kernel code holds
//! nothing that needs dropping) and the launch fails, naming the thread and
//! the address. Faults anywhere else go to the handler that was there
//! before (Rust's stack overflow report, or the default: the process dies
//! as it would have without the simulator). Only Linux on x86-64 and
//! AArch64 have the register code; elsewhere a fault kills the process.

use crate::census::Work;
use crate::hostcc::HostModule;
use corosensei::stack::DefaultStack;
use corosensei::trap::CoroutineTrapHandler;
use corosensei::{Coroutine, CoroutineResult, Yielder};
use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};

const FIBER_STACK: usize = 128 * 1024;
/// The alternate signal stack of each worker thread (the fault handler runs
/// there, so that a fiber's stack overflow can be handled too).
const SIGNAL_STACK: usize = 64 * 1024;

/// A fault of a kernel's thread: the signal, the address it touched, and
/// whether it was a write (when the hardware says).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Trap {
    pub sig: c_int,
    pub addr: usize,
    pub write: Option<bool>,
    /// The address is in the fiber's own stack (guard page included): a
    /// stack overflow.
    pub stack: bool,
}

type Fiber = Coroutine<(), (), Result<(), Trap>, DefaultStack>;

/// Why a grid did not complete.
pub(crate) enum GridError {
    /// The launch could not be set up (no fiber stack).
    Resources(String),
    /// Thread `tx` of block `bx` faulted.
    Fault { tx: u32, bx: u32, trap: Trap },
}

thread_local! {
    static STACKS: RefCell<Vec<DefaultStack>> = const { RefCell::new(Vec::new()) };
    static YIELDER: Cell<*const Yielder<(), ()>> = const { Cell::new(std::ptr::null()) };
    static SYNCS: Cell<u64> = const { Cell::new(0) };
    /// The fiber being resumed now, for the fault handler (None outside
    /// kernel code).
    static RUNNING: Cell<Option<CoroutineTrapHandler<Result<(), Trap>>>> = const { Cell::new(None) };
    static ALT_STACK: RefCell<Option<AltStack>> = const { RefCell::new(None) };
}

/// `__syncthreads()` (the host-compiled module calls it through the pointer
/// it was given at load): suspends the calling thread's fiber; the block's
/// scheduler resumes it once every other thread of the block got there too.
pub(crate) extern "C" fn syncthreads() {
    let y = YIELDER.with(|c| c.get());
    if y.is_null() {
        return;
    }
    SYNCS.with(|c| c.set(c.get() + 1));
    // SAFETY: `y` is the yielder of the fiber running now (set when it
    // started and after each resume), alive while the fiber is.
    unsafe { (*y).suspend(()) };
    YIELDER.with(|c| c.set(y));
}

fn take_stack() -> Result<DefaultStack, String> {
    if let Some(s) = STACKS.with(|s| s.borrow_mut().pop()) {
        return Ok(s);
    }
    DefaultStack::new(FIBER_STACK).map_err(|e| format!("cannot allocate a fiber stack: {e}"))
}

fn give_back(co: Fiber) {
    let stack = co.into_stack();
    STACKS.with(|s| s.borrow_mut().push(stack));
}

/// Runs a whole 1-D grid of kernel `index` of `host` on the calling thread.
/// `params` point at the argument values (copied at launch).
///
/// With `census` (the launch census is on and `host` was built for it),
/// each GPU thread's work is its module's basic-block counter read before
/// and after every resume of its fiber, added up over the resumes (one per
/// `__syncthreads()`, plus one), and the grid's total and largest are
/// returned; without it the counter is not read and the work is zero.
pub(crate) fn run_grid(
    host: &HostModule,
    index: usize,
    grid: u32,
    block: u32,
    params: &[*mut c_void],
    census: bool,
) -> Result<Work, GridError> {
    fault::prepare_thread();
    let mut work = Work::default();
    let mut steps: Vec<u64> = if census { vec![0; block as usize] } else { Vec::new() };
    let params_addr = params.as_ptr() as usize;
    let run_thread = host.run_thread_fn();
    let index = index as std::ffi::c_int;
    for bx in 0..grid {
        let mut fibers: Vec<Option<Fiber>> = Vec::with_capacity(block as usize);
        for _ in 0..block {
            let stack = take_stack().map_err(GridError::Resources)?;
            let co = Coroutine::with_stack(stack, move |y: &Yielder<(), ()>, ()| {
                YIELDER.with(|c| c.set(y as *const _));
                // SAFETY: the kernel index is valid for the module, and
                // `params` (one pointer per argument, each to a value of the
                // argument's size) outlives the grid.
                unsafe { run_thread(index, params_addr as *const *mut c_void) };
                Ok(())
            });
            fibers.push(Some(co));
        }
        steps.fill(0);
        let mut live = block as usize;
        let mut failed = None;
        while live > 0 && failed.is_none() {
            for (tx, slot) in fibers.iter_mut().enumerate() {
                let Some(co) = slot.as_mut() else { continue };
                host.set_ids(tx as u32, bx, block, grid);
                RUNNING.with(|r| r.set(Some(co.trap_handler())));
                let before = if census { host.work() } else { 0 };
                let step = co.resume(());
                if census {
                    steps[tx] += host.work().wrapping_sub(before);
                }
                RUNNING.with(|r| r.set(None));
                match step {
                    CoroutineResult::Yield(()) => {}
                    CoroutineResult::Return(result) => {
                        if let Some(done) = slot.take() {
                            give_back(done);
                        }
                        live -= 1;
                        if let Err(trap) = result {
                            failed = Some(GridError::Fault { tx: tx as u32, bx, trap });
                            break;
                        }
                    }
                }
            }
        }
        YIELDER.with(|c| c.set(std::ptr::null()));
        if let Some(e) = failed {
            for mut co in fibers.into_iter().flatten() {
                // SAFETY: the other threads of the faulting block are
                // suspended in kernel code (C++ frames and the closure
                // above), which holds nothing that needs dropping.
                unsafe { co.force_reset() };
                give_back(co);
            }
            return Err(e);
        }
        for (tx, &s) in steps.iter().enumerate() {
            work.total += s;
            if s > work.max {
                work = Work { max: s, max_block: bx, max_thread: tx as u32, ..work };
            }
        }
    }
    Ok(work)
}

/// The worker's alternate signal stack, given back when the thread ends.
struct AltStack {
    map: *mut c_void,
    len: usize,
}

impl Drop for AltStack {
    fn drop(&mut self) {
        // SAFETY: this thread's alternate stack, which it is not running on
        // (thread-locals are dropped in ordinary code): switched off first.
        unsafe {
            let off = libc::stack_t { ss_sp: std::ptr::null_mut(), ss_flags: libc::SS_DISABLE, ss_size: 0 };
            libc::sigaltstack(&off, std::ptr::null_mut());
            libc::munmap(self.map, self.len);
        }
    }
}

mod fault {
    use super::{AltStack, Trap, ALT_STACK, RUNNING, SIGNAL_STACK};
    use std::ffi::{c_int, c_void};
    use std::sync::{Once, OnceLock};

    /// The dispositions of SIGSEGV and SIGBUS before the simulator's.
    static PREVIOUS: OnceLock<[libc::sigaction; 2]> = OnceLock::new();
    static INSTALL: Once = Once::new();

    /// Installs the fault handler (once per process) and gives the calling
    /// worker thread an alternate signal stack (once per thread), unless it
    /// has one.
    pub(super) fn prepare_thread() {
        if !cfg!(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))) {
            return;
        }
        INSTALL.call_once(|| {
            // SAFETY: plain sigaction calls; the previous dispositions are
            // stored before the new handler can run.
            unsafe {
                let mut old: [libc::sigaction; 2] = std::mem::zeroed();
                libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut old[0]);
                libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old[1]);
                let _ = PREVIOUS.set(old);
                let mut new: libc::sigaction = std::mem::zeroed();
                new.sa_sigaction = on_fault as *const () as usize;
                new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut new.sa_mask);
                libc::sigaction(libc::SIGSEGV, &new, std::ptr::null_mut());
                libc::sigaction(libc::SIGBUS, &new, std::ptr::null_mut());
            }
        });
        ALT_STACK.with(|a| {
            let mut a = a.borrow_mut();
            if a.is_some() {
                return;
            }
            // SAFETY: queries and sets this thread's alternate stack, a
            // fresh mapping with an inaccessible page below it.
            unsafe {
                let mut cur: libc::stack_t = std::mem::zeroed();
                libc::sigaltstack(std::ptr::null(), &mut cur);
                if cur.ss_flags & libc::SS_DISABLE == 0 {
                    return; // it has one already
                }
                let page = 4096;
                let len = SIGNAL_STACK + page;
                let map = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                if map == libc::MAP_FAILED {
                    return;
                }
                libc::mprotect(map, page, libc::PROT_NONE);
                let st = libc::stack_t { ss_sp: (map as usize + page) as *mut c_void, ss_flags: 0, ss_size: SIGNAL_STACK };
                if libc::sigaltstack(&st, std::ptr::null_mut()) == 0 {
                    *a = Some(AltStack { map, len });
                } else {
                    libc::munmap(map, len);
                }
            }
        });
    }

    /// The interrupted stack pointer, and whether the access was a write.
    ///
    /// # Safety
    /// `uc` is the context the kernel passed to the handler.
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    unsafe fn sp_and_write(uc: *mut libc::ucontext_t) -> (usize, Option<bool>) {
        unsafe {
            let g = &(*uc).uc_mcontext.gregs;
            // Bit 1 of the page fault error code: the access was a write.
            (g[libc::REG_RSP as usize] as usize, Some(g[libc::REG_ERR as usize] & 2 != 0))
        }
    }

    #[cfg(all(target_os = "linux", target_arch = "aarch64"))]
    unsafe fn sp_and_write(uc: *mut libc::ucontext_t) -> (usize, Option<bool>) {
        ((*uc).uc_mcontext.sp as usize, None)
    }

    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    unsafe fn redirect(uc: *mut libc::ucontext_t, regs: corosensei::trap::TrapHandlerRegs) {
        unsafe {
            let corosensei::trap::TrapHandlerRegs { rip, rsp, rbp, rdi, rsi } = regs;
            let g = &mut (*uc).uc_mcontext.gregs;
            g[libc::REG_RIP as usize] = rip as i64;
            g[libc::REG_RSP as usize] = rsp as i64;
            g[libc::REG_RBP as usize] = rbp as i64;
            g[libc::REG_RDI as usize] = rdi as i64;
            g[libc::REG_RSI as usize] = rsi as i64;
        }
    }

    #[cfg(all(target_os = "linux", target_arch = "aarch64"))]
    unsafe fn redirect(uc: *mut libc::ucontext_t, regs: corosensei::trap::TrapHandlerRegs) {
        let corosensei::trap::TrapHandlerRegs { pc, sp, x0, x1, x29, lr } = regs;
        let m = &mut (*uc).uc_mcontext;
        m.pc = pc;
        m.sp = sp;
        m.regs[0] = x0;
        m.regs[1] = x1;
        m.regs[29] = x29;
        m.regs[30] = lr;
    }

    #[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
    unsafe fn sp_and_write(_: *mut libc::ucontext_t) -> (usize, Option<bool>) {
        (0, None)
    }

    #[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
    unsafe fn redirect(_: *mut libc::ucontext_t, _: corosensei::trap::TrapHandlerRegs) {}

    /// SIGSEGV/SIGBUS: a fault of the fiber being resumed on this thread
    /// makes it return a [`Trap`]; any other goes to the previous handler.
    /// Async-signal-safe: it reads and writes this thread's cells only.
    unsafe extern "C" fn on_fault(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
        unsafe {
            let uc = ctx as *mut libc::ucontext_t;
            if let Some(h) = RUNNING.with(|r| r.get()) {
                let (sp, write) = sp_and_write(uc);
                if h.stack_ptr_in_bounds(sp) {
                    RUNNING.with(|r| r.set(None));
                    let addr = (*info).si_addr() as usize;
                    let trap = Trap { sig, addr, write, stack: h.stack_ptr_in_bounds(addr) };
                    let regs = h.setup_trap_handler(move || Err(trap));
                    redirect(uc, regs);
                    return;
                }
            }
            chain(sig, info, ctx);
        }
    }

    unsafe fn chain(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
        unsafe {
            let i = if sig == libc::SIGSEGV { 0 } else { 1 };
            let old = PREVIOUS.get().map(|p| p[i]);
            match old {
                Some(o) if o.sa_sigaction != libc::SIG_DFL && o.sa_sigaction != libc::SIG_IGN => {
                    if o.sa_flags & libc::SA_SIGINFO != 0 {
                        let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = std::mem::transmute(o.sa_sigaction);
                        f(sig, info, ctx);
                    } else {
                        let f: extern "C" fn(c_int) = std::mem::transmute(o.sa_sigaction);
                        f(sig);
                    }
                }
                _ => {
                    // The default: the access faults again on return and the
                    // process dies of it, as without the simulator.
                    let mut dfl: libc::sigaction = std::mem::zeroed();
                    dfl.sa_sigaction = libc::SIG_DFL;
                    libc::sigaction(sig, &dfl, std::ptr::null_mut());
                }
            }
        }
    }
}
