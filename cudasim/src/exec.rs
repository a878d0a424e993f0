//! The host-compiled kernels (`kernels.cu` built by build.rs with the shim
//! header) and how one launch runs: blocks one after another, the threads of
//! a block as fibers on the stream's worker thread, switched at
//! `__syncthreads()`.

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

#[repr(C)]
struct KernelEntry {
    name: *const c_char,
    fun: *const c_void,
    invoke: *const c_void,
    nargs: c_int,
    sizes: *const usize,
    is_ptr: *const u8,
}

extern "C" {
    fn kiln_sim_kernel_count() -> c_int;
    fn kiln_sim_kernel(i: c_int) -> *const KernelEntry;
    fn kiln_sim_run_thread(i: c_int, params: *const *mut c_void);
    fn kiln_sim_set_ids(tx: c_uint, bx: c_uint, bdim: c_uint, gdim: c_uint);
}

/// One kernel of the host-compiled table.
pub struct KernelInfo {
    pub index: usize,
    /// Size in bytes of each argument, in order.
    pub sizes: Vec<usize>,
    /// Whether each argument is a pointer (checked against device memory).
    pub is_ptr: Vec<bool>,
}

/// Every kernel, by name.
pub fn table() -> &'static HashMap<String, KernelInfo> {
    static TABLE: OnceLock<HashMap<String, KernelInfo>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut map = HashMap::new();
        // SAFETY: the generated table holds `count` valid entries whose
        // arrays have `nargs` elements, alive for the life of the process.
        unsafe {
            for i in 0..kiln_sim_kernel_count() {
                let e = &*kiln_sim_kernel(i);
                let n = e.nargs.max(0) as usize;
                let name = CStr::from_ptr(e.name).to_string_lossy().into_owned();
                let sizes = std::slice::from_raw_parts(e.sizes, n).to_vec();
                let is_ptr = std::slice::from_raw_parts(e.is_ptr, n).iter().map(|&b| b != 0).collect();
                map.insert(name, KernelInfo { index: i as usize, sizes, is_ptr });
            }
        }
        map
    })
}

const FIBER_STACK: usize = 128 * 1024;

thread_local! {
    static STACKS: RefCell<Vec<DefaultStack>> = const { RefCell::new(Vec::new()) };
    static YIELDER: Cell<*const Yielder<(), ()>> = const { Cell::new(std::ptr::null()) };
    static SYNCS: Cell<u64> = const { Cell::new(0) };
}

/// `__syncthreads()`: suspends the calling thread's fiber; the block's
/// scheduler resumes it once every other thread of the block got there too.
#[no_mangle]
pub extern "C" fn kiln_sim_syncthreads() {
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

/// Runs a whole 1-D grid on the calling thread. `params` point at the
/// argument values (copied at launch).
pub fn run_grid(index: usize, grid: u32, block: u32, params: &[*mut c_void]) -> Result<(), String> {
    let params_addr = params.as_ptr() as usize;
    for bx in 0..grid {
        let mut fibers: Vec<Option<Coroutine<(), (), (), DefaultStack>>> = Vec::with_capacity(block as usize);
        for _ in 0..block {
            let stack = take_stack()?;
            let co = Coroutine::with_stack(stack, move |y: &Yielder<(), ()>, ()| {
                YIELDER.with(|c| c.set(y as *const _));
                // SAFETY: the table index is valid and `params` outlives the grid.
                unsafe { kiln_sim_run_thread(index as c_int, params_addr as *const *mut c_void) };
            });
            fibers.push(Some(co));
        }
        let mut live = block as usize;
        while live > 0 {
            for (tx, slot) in fibers.iter_mut().enumerate() {
                let Some(co) = slot.as_mut() else { continue };
                // SAFETY: sets the thread-local ids the kernel reads.
                unsafe { kiln_sim_set_ids(tx as c_uint, bx, block, grid) };
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
