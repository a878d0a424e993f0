//! What a child process made by `fork()` inherits from kiln, and how kiln
//! keeps it usable.
//!
//! Why: the child starts with one thread, the one that called `fork`, and
//! with every lock exactly as it was at that instant. A storage lock that
//! another thread of the parent held (a kernel reading the storage) would
//! stay held forever in the child, so the child's first write to that
//! storage would hang; the CPU's thread pool and the simulated GPUs' queue
//! workers do not exist in the child at all.
//!
//! So kiln registers fork handlers (`pthread_atfork`) the first time a
//! thread uses it:
//! - **before** the fork, a gate closes: a thread about to take its first
//!   storage lock waits, and the fork waits until no thread holds one
//!   (kernels in flight finish, none starts); the transfer ledger's lock is
//!   taken so that no booking is half done;
//! - **in the child**, kernels run on the calling thread only (the pool's
//!   threads are gone) and simulated GPUs say that their queue did not
//!   survive the fork, instead of waiting for it forever;
//! - in both processes the gate opens again.
//!
//! The gate's cost, paid when a thread takes its first storage lock (not
//! for each lock of a kernel): a plain store to the thread's own slot, a
//! load of the gate flag, and a plain store when the last lock is released.
//! The forking thread raises the flag and then runs
//! `membarrier(PRIVATE_EXPEDITED)`, a full memory barrier on every running
//! thread of the process, before it reads the slots: an asymmetric Dekker
//! handshake, so either the fork sees a thread's busy mark or that thread
//! sees the flag. Where membarrier is unavailable (not Linux, an old
//! kernel, a sandbox that forbids it) the locking side pays a full fence.

use crate::runtime::thread_slot;
use std::cell::Cell;
use std::sync::atomic::{compiler_fence, fence, AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::OnceLock;

#[repr(align(128))]
struct Slot {
    /// Storage locks (and lock-holding sections) the slot's thread is in.
    depth: AtomicU32,
}

static SLOTS: [Slot; thread_slot::SLOTS] = [const { Slot { depth: AtomicU32::new(0) } }; thread_slot::SLOTS];
/// Busy threads that have no slot (more than `thread_slot::SLOTS` threads).
static UNSLOTTED: AtomicUsize = AtomicUsize::new(0);
/// The gate: closed while a fork is being prepared.
static CLOSED: AtomicBool = AtomicBool::new(false);
/// True in a child process made by `fork` after this process used kiln.
static CHILD: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Depth of a thread without a slot.
    static UNSLOTTED_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Marks this thread as holding storage locks while it lives (see the
/// module's documentation). Taken before the locks, dropped after them.
pub(crate) struct Busy {
    slot: Option<usize>,
    /// Not `Send`: the mark belongs to the thread that made it.
    _thread: std::marker::PhantomData<std::sync::MutexGuard<'static, ()>>,
}

impl Busy {
    /// Enters a lock-holding section; waits at the gate when this is the
    /// thread's outermost one and a fork is being prepared.
    #[inline]
    pub(crate) fn enter() -> Busy {
        // Before any thread is first marked busy (one atomic load after
        // the first call).
        install_handlers();
        match thread_slot::mine() {
            Some(i) => {
                let depth = &SLOTS[i].depth;
                let d = depth.load(Ordering::Relaxed);
                depth.store(d + 1, Ordering::Relaxed);
                if d == 0 {
                    order_mark_before_check();
                    if CLOSED.load(Ordering::Relaxed) {
                        wait_at_gate(depth);
                    }
                }
                Busy { slot: Some(i), _thread: std::marker::PhantomData }
            }
            None => {
                let d = UNSLOTTED_DEPTH.try_with(|c| c.replace(c.get() + 1)).unwrap_or(1);
                if d == 0 {
                    UNSLOTTED.fetch_add(1, Ordering::SeqCst);
                    while CLOSED.load(Ordering::SeqCst) {
                        UNSLOTTED.fetch_sub(1, Ordering::SeqCst);
                        while CLOSED.load(Ordering::SeqCst) {
                            std::thread::sleep(std::time::Duration::from_micros(50));
                        }
                        UNSLOTTED.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Busy { slot: None, _thread: std::marker::PhantomData }
            }
        }
    }
}

impl Drop for Busy {
    #[inline]
    fn drop(&mut self) {
        match self.slot {
            Some(i) => {
                let depth = &SLOTS[i].depth;
                // Release: the locks were let go before a waiting fork sees 0.
                depth.store(depth.load(Ordering::Relaxed) - 1, Ordering::Release);
            }
            None => {
                let d = UNSLOTTED_DEPTH.try_with(|c| c.replace(c.get().saturating_sub(1))).unwrap_or(1);
                if d == 1 {
                    UNSLOTTED.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }
}

/// Orders this thread's busy mark before its load of the gate flag: the
/// forking thread's membarrier supplies the hardware barrier, so only the
/// compiler must keep the order; without membarrier, a full fence.
#[inline(always)]
fn order_mark_before_check() {
    if barrier_available() {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

#[cold]
fn wait_at_gate(depth: &AtomicU32) {
    loop {
        // Not busy while waiting: the fork must not wait for this thread.
        depth.store(0, Ordering::Release);
        while CLOSED.load(Ordering::Acquire) {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        depth.store(1, Ordering::Relaxed);
        order_mark_before_check();
        if !CLOSED.load(Ordering::Relaxed) {
            return;
        }
    }
}

/// True in a child process made by `fork` after its parent used kiln: the
/// CPU's pool and the simulated GPUs' workers do not exist here.
#[inline]
pub(crate) fn in_child() -> bool {
    CHILD.load(Ordering::Relaxed)
}

/// Registers the fork handlers once per process (called by
/// [`Busy::enter`], so before any thread can be busy, by the host pool's
/// first booking, and before a simulated GPU's worker thread starts).
#[inline]
pub(crate) fn install_handlers() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        barrier_available();
        #[cfg(unix)]
        // SAFETY: the handlers are plain functions that live as long as the process.
        unsafe {
            libc::pthread_atfork(Some(prepare), Some(parent), Some(child));
        }
    });
}

#[cfg(unix)]
extern "C" fn prepare() {
    CLOSED.store(true, Ordering::SeqCst);
    full_barrier_on_all_threads();
    let own = thread_slot::mine();
    for (i, slot) in SLOTS[..thread_slot::used()].iter().enumerate() {
        // The forking thread's own locks (none, unless fork is called from
        // inside kiln) are not waited for.
        if Some(i) == own {
            continue;
        }
        while slot.depth.load(Ordering::Acquire) != 0 {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
    let own_unslotted = own.is_none() && UNSLOTTED_DEPTH.try_with(|c| c.get()).unwrap_or(0) > 0;
    while UNSLOTTED.load(Ordering::SeqCst) > usize::from(own_unslotted) {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    crate::runtime::ledger::hold_for_fork(true);
}

#[cfg(unix)]
extern "C" fn parent() {
    crate::runtime::ledger::hold_for_fork(false);
    CLOSED.store(false, Ordering::SeqCst);
}

#[cfg(unix)]
extern "C" fn child() {
    CHILD.store(true, Ordering::SeqCst);
    crate::runtime::ledger::hold_for_fork(false);
    CLOSED.store(false, Ordering::SeqCst);
}

/// Whether `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` is registered for
/// this process (asked once).
#[inline]
fn barrier_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(register_membarrier)
}

#[cfg(target_os = "linux")]
mod sys {
    pub const QUERY: libc::c_int = 0;
    pub const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    pub const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;
    pub fn membarrier(cmd: libc::c_int) -> libc::c_long {
        // SAFETY: membarrier takes integers only and touches no memory of ours.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_uint, 0 as libc::c_int) }
    }
}

#[cfg(target_os = "linux")]
fn register_membarrier() -> bool {
    let supported = sys::membarrier(sys::QUERY);
    supported >= 0
        && supported & sys::PRIVATE_EXPEDITED as libc::c_long != 0
        && sys::membarrier(sys::REGISTER_PRIVATE_EXPEDITED) == 0
        && sys::membarrier(sys::PRIVATE_EXPEDITED) == 0
}

#[cfg(not(target_os = "linux"))]
fn register_membarrier() -> bool {
    false
}

#[cfg(unix)]
fn full_barrier_on_all_threads() {
    #[cfg(target_os = "linux")]
    if barrier_available() && sys::membarrier(sys::PRIVATE_EXPEDITED) == 0 {
        return;
    }
    // The locking side fences itself when membarrier is unavailable.
    fence(Ordering::SeqCst);
}

/// Busy marks held now, over every thread (for tests: 0 when no thread is
/// inside a storage lock).
#[doc(hidden)]
pub fn busy_threads() -> usize {
    SLOTS[..thread_slot::used()].iter().filter(|s| s.depth.load(Ordering::Acquire) != 0).count() + UNSLOTTED.load(Ordering::SeqCst)
}
