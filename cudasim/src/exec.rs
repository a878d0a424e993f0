//! How one launch runs: the blocks of the grid one after another on the
//! stream's worker thread, the threads of a block as fibers (corosensei)
//! switched at `__syncthreads()`, so that a block's threads see each other's
//! `__shared__` writes at a barrier exactly as the kernel's author expects,
//! without an OS thread per GPU thread.

use crate::hostcc::HostModule;
use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};
use std::cell::{Cell, RefCell};
use std::ffi::c_void;

const FIBER_STACK: usize = 128 * 1024;

thread_local! {
    static STACKS: RefCell<Vec<DefaultStack>> = const { RefCell::new(Vec::new()) };
    static YIELDER: Cell<*const Yielder<(), ()>> = const { Cell::new(std::ptr::null()) };
    static SYNCS: Cell<u64> = const { Cell::new(0) };
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

/// Runs a whole 1-D grid of kernel `index` of `host` on the calling thread.
/// `params` point at the argument values (copied at launch).
pub(crate) fn run_grid(host: &HostModule, index: usize, grid: u32, block: u32, params: &[*mut c_void]) -> Result<(), String> {
    let params_addr = params.as_ptr() as usize;
    let run_thread = host.run_thread_fn();
    let index = index as std::ffi::c_int;
    for bx in 0..grid {
        let mut fibers: Vec<Option<Coroutine<(), (), (), DefaultStack>>> = Vec::with_capacity(block as usize);
        for _ in 0..block {
            let stack = take_stack()?;
            let co = Coroutine::with_stack(stack, move |y: &Yielder<(), ()>, ()| {
                YIELDER.with(|c| c.set(y as *const _));
                // SAFETY: the kernel index is valid for the module, and
                // `params` (one pointer per argument, each to a value of the
                // argument's size) outlives the grid.
                unsafe { run_thread(index, params_addr as *const *mut c_void) };
            });
            fibers.push(Some(co));
        }
        let mut live = block as usize;
        while live > 0 {
            for (tx, slot) in fibers.iter_mut().enumerate() {
                let Some(co) = slot.as_mut() else { continue };
                host.set_ids(tx as u32, bx, block, grid);
                match co.resume(()) {
                    CoroutineResult::Yield(()) => {}
                    CoroutineResult::Return(()) => {
                        if let Some(done) = slot.take() {
                            let stack = done.into_stack();
                            STACKS.with(|s| s.borrow_mut().push(stack));
                        }
                        live -= 1;
                    }
                }
            }
        }
        YIELDER.with(|c| c.set(std::ptr::null()));
    }
    Ok(())
}
