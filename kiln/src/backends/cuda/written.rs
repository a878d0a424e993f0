//! The storages a CUDA device's kernels wrote since the last clean
//! synchronisation point, so that a fault found later poisons them.
//!
//! A bad index is recorded by the kernel that met it (`peer.rs`'s fault
//! record) and found at the next synchronising call; the kernels launched
//! after it ran meanwhile, with the faulting kernel's zeros as inputs. Which
//! of them depend on it the host cannot tell, so on finding a fault every
//! storage written since the last synchronising call that found none is
//! poisoned with it ([`Storage::poison`]): reading any of them, or using it
//! as an input, returns the fault until it is recomputed. The list holds
//! `Weak` references: a storage dropped meanwhile needs no mark.

use crate::base::error::Error;
use crate::kernel::storage::Storage;
use std::sync::{Arc, Mutex, Weak};

/// Entries kept before dropped storages are swept out of the list.
const SWEEP_AT: usize = 4096;

#[derive(Default)]
pub(super) struct Written {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Launch number of the next entry.
    next: u64,
    /// (launch number, output), in launch order.
    outputs: Vec<(u64, Weak<Storage>)>,
    /// Length at which the list is next swept.
    sweep_at: usize,
    /// The devices (bit `ordinal % 64`) this device's stream copied into
    /// (a peer copy, a collective) since the last clean point: their work
    /// since may have read what a fault here spoiled.
    fed: u64,
    /// The devices that copied into this one since its last clean point.
    fed_by: u64,
}

/// A device's bit in `fed` and `fed_by`.
pub(super) fn bit(ordinal: usize) -> u64 {
    1 << (ordinal % 64)
}

impl Written {
    /// Notes that a kernel queued now writes `out`.
    pub(super) fn push(&self, out: &Arc<Storage>) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let n = inner.next;
        inner.next += 1;
        if inner.outputs.len() >= inner.sweep_at.max(SWEEP_AT) {
            inner.outputs.retain(|(_, w)| w.strong_count() > 0);
            inner.sweep_at = (inner.outputs.len() * 2).max(SWEEP_AT);
        }
        inner.outputs.push((n, Arc::downgrade(out)));
    }

    /// Notes that this device's stream copied into the device of bit `to`.
    pub(super) fn fed(&self, to: u64) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).fed |= to;
    }

    /// Notes that the device of bit `from` copied into this one.
    pub(super) fn fed_by(&self, from: u64) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).fed_by |= from;
    }

    /// The devices that copied into this one since its last clean point.
    pub(super) fn sources(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).fed_by
    }

    /// The point a synchronising call starts from: every entry before it
    /// was queued before the call.
    pub(super) fn mark(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).next
    }

    /// Poisons every storage written since the last clean point with the
    /// fault `err` of this device, which stays for this device's next
    /// synchronising call to report (another device's read found it).
    pub(super) fn poison_all(&self, err: &Error) {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for (_, w) in &inner.outputs {
            if let Some(s) = w.upgrade() {
                s.poison(err);
            }
        }
    }

    /// Settles a synchronising call that started at `mark`: `fault` (the
    /// fault record, read and taken under this list's lock, so that a
    /// concurrent call sees the marks once it sees no fault) poisons every
    /// storage written since the last clean point, and returns the devices
    /// this one fed since (whose lists the caller poisons too); without
    /// one, the entries before `mark` are clean and forgotten.
    pub(super) fn settle(&self, mark: u64, fault: impl FnOnce() -> Option<Error>) -> Result<(), (Error, u64)> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match fault() {
            Some(err) => {
                for (_, w) in inner.outputs.drain(..) {
                    if let Some(s) = w.upgrade() {
                        s.poison(&err);
                    }
                }
                let fed = std::mem::take(&mut inner.fed);
                inner.fed_by = 0;
                Err((err, fed))
            }
            None => {
                let done = inner.outputs.partition_point(|(n, _)| *n < mark);
                inner.outputs.drain(..done);
                inner.fed = 0;
                inner.fed_by = 0;
                Ok(())
            }
        }
    }
}
