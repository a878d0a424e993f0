//! Process-wide machinery below the backends: per-thread slots, fork
//! handling, memory accounting, the transfer ledger, random numbers, host
//! facts and injected failures for tests.

pub(crate) mod faults;
pub(crate) mod fork;
pub(crate) mod host;
pub(crate) mod ledger;
pub(crate) mod memory;
pub(crate) mod pool;
pub(crate) mod rng;
pub(crate) mod thread_slot;
