//! Lock-free reads of storages that were never written in place.
//!
//! Why: most storages are written once, by the kernel that makes them, and
//! only read after that; a read lock per operand per operation (two atomic
//! read-modify-writes each, which drain the store buffer) costs as much as
//! a small operation itself. So a CPU storage starts *frozen*: kernels read
//! it without its lock, inside a **read epoch** of their thread. The first
//! in-place write to a frozen storage (`assign`, the optimizers' updates)
//! *thaws* it, once in its life; from then on it is read and written under
//! its lock as before. This is user-space RCU (the "membarrier" flavour of
//! liburcu), applied to one flag per storage.
//!
//! The protocol, per thread and per storage:
//! - A reader marks its thread's epoch odd (a plain store), then reads each
//!   operand's `frozen` flag; frozen operands are read without a lock,
//!   others under their read lock. When the kernel is done, the epoch is
//!   made even again (a release store).
//! - A writer about to write a frozen storage clears the flag, then calls
//!   `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`: every running thread of
//!   the process passes a full memory barrier. Any reader that read the flag
//!   as frozen therefore had its odd epoch visible before that barrier; the
//!   writer waits until each thread seen inside an epoch has left it, then
//!   takes the storage's write lock. A reader that starts later sees the flag
//!   cleared and takes the read lock, which the writer holds.
//! - The writer holds no lock and is in no epoch while it waits, and a reader
//!   in an epoch never waits for a thaw, so no cycle of waits can form.
//!
//! Readers pay two plain stores and a load per operation; a thaw costs one
//! system call and a wait of a few microseconds. Where `membarrier` is not
//! available (an old kernel, a sandbox that forbids it, not Linux), no
//! storage is frozen and every read takes its lock.

use crate::thread_slot;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Whether storages may be frozen: membarrier with private expedited
/// barriers is available and registered for this process.
#[doc(hidden)]
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    // `KILN_READ_EPOCHS=0` turns lock-free reads off (every read locks), to
    // compare, or to test that path where membarrier exists.
    *OK.get_or_init(|| crate::device::env_flag("KILN_READ_EPOCHS").unwrap_or(true) && register_membarrier())
}

#[cfg(target_os = "linux")]
mod sys {
    pub const QUERY: libc::c_int = 0;
    pub const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    pub const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;
    /// SAFETY: membarrier takes integers only.
    pub fn membarrier(cmd: libc::c_int) -> libc::c_long {
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

#[repr(align(128))]
struct Reader {
    /// Odd while the thread reads in an epoch.
    epoch: AtomicU64,
}

/// Indexed by the thread's `thread_slot` index (a thread without one reads
/// under locks).
static READERS: [Reader; thread_slot::SLOTS] = [const { Reader { epoch: AtomicU64::new(0) } }; thread_slot::SLOTS];

/// A thread's read epoch, for the duration of one kernel: while it lives,
/// frozen storages may be read without their lock ([`ReadEpoch::active`]).
pub(crate) struct ReadEpoch(Option<&'static Reader>);

impl ReadEpoch {
    /// Enters this thread's read epoch; inactive (every read must lock) when
    /// epochs are unavailable, the thread has no slot, or it is in one already.
    #[inline]
    pub(crate) fn enter() -> ReadEpoch {
        if !available() {
            return ReadEpoch(None);
        }
        let Some(i) = thread_slot::mine() else { return ReadEpoch(None) };
        let r = &READERS[i];
        let e = r.epoch.load(Ordering::Relaxed);
        if e & 1 == 1 {
            return ReadEpoch(None);
        }
        r.epoch.store(e + 1, Ordering::Relaxed);
        // Orders the store above before the loads of `frozen` flags that
        // follow, for the compiler; the hardware barrier comes from the
        // writer's membarrier, which every running thread passes.
        std::sync::atomic::compiler_fence(Ordering::SeqCst);
        ReadEpoch(Some(r))
    }
    /// No epoch: every read takes its lock (kernels of other devices, whose
    /// storages are never frozen, so that a thaw never waits for them).
    #[inline]
    pub(crate) fn none() -> ReadEpoch {
        ReadEpoch(None)
    }
    /// True when frozen storages may be read without their lock.
    #[inline]
    pub(crate) fn active(&self) -> bool {
        self.0.is_some()
    }
}

impl Drop for ReadEpoch {
    #[inline]
    fn drop(&mut self) {
        if let Some(r) = self.0 {
            // Release: this thread's reads happen before a waiting writer sees the epoch end.
            r.epoch.store(r.epoch.load(Ordering::Relaxed) + 1, Ordering::Release);
        }
    }
}

/// Thaws a frozen storage before its first in-place write: clears `frozen`
/// and waits until no thread can still be reading it without its lock.
/// The caller holds no storage lock and is in no read epoch.
pub(crate) fn thaw(frozen: &AtomicBool) {
    if !frozen.load(Ordering::Acquire) {
        return;
    }
    // One thaw at a time: waits are rare and short.
    static THAWING: Mutex<()> = Mutex::new(());
    let _one = THAWING.lock().unwrap_or_else(|e| e.into_inner());
    if !frozen.swap(false, Ordering::SeqCst) {
        return;
    }
    THAWS.fetch_add(1, Ordering::Relaxed);
    #[cfg(target_os = "linux")]
    if sys::membarrier(sys::PRIVATE_EXPEDITED) != 0 {
        // Registered at start-up, so this cannot fail; if it ever did, a
        // full barrier here still orders our side.
        std::sync::atomic::fence(Ordering::SeqCst);
    }
    let own = thread_slot::mine();
    for (i, r) in READERS[..thread_slot::used()].iter().enumerate() {
        if Some(i) == own {
            continue;
        }
        let seen = r.epoch.load(Ordering::Acquire);
        if seen & 1 == 0 {
            continue;
        }
        // Inside an epoch that may read the storage: wait for it to end.
        let mut spins = 0u32;
        while r.epoch.load(Ordering::Acquire) == seen {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 1024 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }
}

/// Thaws performed so far (for tests: a storage thaws once in its life).
#[doc(hidden)]
pub fn thaw_count() -> u64 {
    THAWS.load(Ordering::Relaxed)
}

static THAWS: AtomicU64 = AtomicU64::new(0);
