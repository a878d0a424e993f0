//! A small number for each live thread: the index of its entry in arrays
//! of per-thread cache lines that only it writes and other threads read
//! (the CPU's memory booking in `memory.rs`, the busy marks of `fork.rs`).
//!
//! A thread claims its index the first time it asks and gives it back when
//! it exits; the next thread to claim it inherits the entries as they are
//! (release/acquire on the claim, so it sees their last values). At most
//! [`SLOTS`] threads hold one at once: a thread beyond that gets `None`, and
//! its callers fall back to shared counters or locks.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Threads that hold an index at the same time.
pub(crate) const SLOTS: usize = 256;

static TAKEN: [AtomicBool; SLOTS] = [const { AtomicBool::new(false) }; SLOTS];
/// One past the highest index ever claimed: readers scan `0..used()`.
static USED: AtomicUsize = AtomicUsize::new(0);

struct Claim(Option<usize>);

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            // Release: the next thread to claim the index sees this one's
            // last writes to its entries.
            TAKEN[i].store(false, Ordering::Release);
        }
    }
}

impl Claim {
    fn new() -> Claim {
        for (i, taken) in TAKEN.iter().enumerate() {
            if taken.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                USED.fetch_max(i + 1, Ordering::AcqRel);
                return Claim(Some(i));
            }
        }
        Claim(None)
    }
}

thread_local! {
    static CLAIM: Claim = Claim::new();
}

/// This thread's index; `None` while the thread is exiting or when
/// [`SLOTS`] other threads hold one.
#[inline]
pub(crate) fn mine() -> Option<usize> {
    CLAIM.try_with(|c| c.0).ok().flatten()
}

/// One past the highest index ever claimed.
#[inline]
pub(crate) fn used() -> usize {
    USED.load(Ordering::Acquire)
}
