//! The transfer ledger and guard. Every copy that crosses between the host
//! and a GPU, or between two GPUs, is booked here with its bytes and the
//! user's call site, and may be refused by a thread-local guard (modelled on
//! JAX's `transfer_guard`). Reads of CPU tensors are not transfers.

use crate::{Device, Direction, Error, Result};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::panic::Location;
use std::sync::Mutex;

/// Count and bytes of some transfers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferCount {
    /// Number of transfers.
    pub count: u64,
    /// Bytes moved.
    pub bytes: u64,
}

impl TransferCount {
    fn add(&mut self, o: TransferCount) {
        self.count += o.count;
        self.bytes += o.bytes;
    }
    fn sub(&mut self, o: TransferCount) {
        self.count = self.count.saturating_sub(o.count);
        self.bytes = self.bytes.saturating_sub(o.bytes);
    }
}

/// A snapshot of the ledger: counts per direction and device pair, and per
/// call site.
///
/// ```
/// let before = kiln::thread_transfer_stats();
/// let x = kiln::Tensor::ones((2, 2), kiln::DType::F32, &kiln::cpu())?;
/// let _ = x.to_vec::<f32>()?; // a CPU read is not a transfer
/// assert_eq!(kiln::thread_transfer_stats().since(&before).total().count, 0);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Per (direction, source, destination).
    pub by_pair: BTreeMap<(Direction, Device, Device), TransferCount>,
    /// Per call site `file:line:column` and direction.
    pub by_site: BTreeMap<(String, Direction), TransferCount>,
}

impl TransferStats {
    /// All transfers.
    pub fn total(&self) -> TransferCount {
        let mut t = TransferCount::default();
        for c in self.by_pair.values() {
            t.add(*c);
        }
        t
    }
    /// Transfers in one direction.
    pub fn direction(&self, direction: Direction) -> TransferCount {
        let mut t = TransferCount::default();
        for ((d, _, _), c) in &self.by_pair {
            if *d == direction {
                t.add(*c);
            }
        }
        t
    }
    /// What happened after `earlier` was taken.
    pub fn since(&self, earlier: &TransferStats) -> TransferStats {
        let mut out = self.clone();
        for (k, c) in &earlier.by_pair {
            if let Some(v) = out.by_pair.get_mut(k) {
                v.sub(*c);
            }
        }
        for (k, c) in &earlier.by_site {
            if let Some(v) = out.by_site.get_mut(k) {
                v.sub(*c);
            }
        }
        out.by_pair.retain(|_, c| c.count > 0);
        out.by_site.retain(|_, c| c.count > 0);
        out
    }
    /// A readable report: totals per direction and device pair, then the
    /// `top` busiest call sites.
    pub fn report(&self, top: usize) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let total = self.total();
        let _ = writeln!(s, "transfers: {} ({})", total.count, crate::human_bytes(total.bytes as usize));
        for ((d, src, dst), c) in &self.by_pair {
            let _ = writeln!(s, "  {d:<16} {src} -> {dst}: {} ({})", c.count, crate::human_bytes(c.bytes as usize));
        }
        let mut sites: Vec<_> = self.by_site.iter().collect();
        sites.sort_by(|a, b| b.1.count.cmp(&a.1.count).then(a.0.cmp(b.0)));
        if !sites.is_empty() {
            let _ = writeln!(s, "busiest call sites:");
        }
        for ((site, d), c) in sites.into_iter().take(top) {
            let _ = writeln!(s, "  {:>7}x {:<16} {site} ({})", c.count, d.to_string(), crate::human_bytes(c.bytes as usize));
        }
        s
    }
    fn book(&mut self, direction: Direction, src: Device, dst: Device, bytes: u64, site: &str) {
        let c = TransferCount { count: 1, bytes };
        self.by_pair.entry((direction, src, dst)).or_default().add(c);
        self.by_site.entry((site.to_string(), direction)).or_default().add(c);
    }
}

static GLOBAL: Mutex<Option<TransferStats>> = Mutex::new(None);

#[cfg(unix)]
thread_local! {
    static HELD_FOR_FORK: RefCell<Option<std::sync::MutexGuard<'static, Option<TransferStats>>>> = const { RefCell::new(None) };
}

/// Takes (`true`) or lets go of (`false`) the global ledger's lock on the
/// thread that forks, so that the child never inherits it held by a thread
/// that does not exist there (see `fork.rs`). Only Unix forks.
#[cfg(unix)]
pub(crate) fn hold_for_fork(hold: bool) {
    let _ = HELD_FOR_FORK.try_with(|h| {
        let mut h = h.borrow_mut();
        *h = if hold { Some(GLOBAL.lock().unwrap_or_else(|e| e.into_inner())) } else { None };
    });
}

thread_local! {
    static LOCAL: RefCell<TransferStats> = RefCell::new(TransferStats::default());
    static GUARDS: Cell<[GuardLevel; 3]> = const { Cell::new([GuardLevel::Allow; 3]) };
    static SITE: Cell<Option<&'static Location<'static>>> = const { Cell::new(None) };
}

/// While alive, every transfer this thread books is attributed to one call
/// site: the user's line that entered a public function which transfers
/// inside kiln (`Module::to`, `Trainer::fit`, `backward`, printing with
/// [`crate::println!`] or [`Tensor::show`](crate::Tensor::show)). The
/// outermost scope wins, so nested entry points keep the user's line.
#[must_use = "the call site applies while this value is alive"]
#[doc(hidden)]
pub struct SiteScope {
    set: bool,
}

impl Drop for SiteScope {
    fn drop(&mut self) {
        if self.set {
            SITE.with(|s| s.set(None));
        }
    }
}

/// Attributes this thread's transfers to `site` until the scope drops
/// (unless an outer scope already did).
pub(crate) fn site_scope(site: &'static Location<'static>) -> SiteScope {
    SITE.with(|s| {
        if s.get().is_some() {
            SiteScope { set: false }
        } else {
            s.set(Some(site));
            SiteScope { set: true }
        }
    })
}

/// The call site this thread's transfers are attributed to now, if any.
pub(crate) fn current_site() -> Option<&'static Location<'static>> {
    SITE.with(|s| s.get())
}

/// Attributes the transfers of this thread to the caller's line until the
/// returned scope drops: what [`crate::println!`] expands to.
#[doc(hidden)]
#[track_caller]
pub fn __site_scope() -> SiteScope {
    site_scope(Location::caller())
}

/// The ledger of the whole process.
pub fn transfer_stats() -> TransferStats {
    GLOBAL.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default()
}

/// The transfers made by this thread only: what tests use, since other
/// threads may transfer at the same time.
pub fn thread_transfer_stats() -> TransferStats {
    LOCAL.with(|l| l.borrow().clone())
}

/// Clears the process ledger and this thread's.
pub fn reset_transfer_stats() {
    *GLOBAL.lock().unwrap_or_else(|e| e.into_inner()) = None;
    LOCAL.with(|l| *l.borrow_mut() = TransferStats::default());
}

/// What a guard does with a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardLevel {
    /// Let it happen (the default).
    Allow,
    /// Let it happen and print it to stderr with its call site.
    Log,
    /// Refuse it with [`Error::TransferDisallowed`].
    Disallow,
}

/// Restores the previous guard levels when dropped.
#[must_use = "the guard ends when this value is dropped"]
pub struct TransferGuard {
    previous: [GuardLevel; 3],
}

impl Drop for TransferGuard {
    fn drop(&mut self) {
        GUARDS.with(|g| g.set(self.previous));
    }
}

fn slot(d: Direction) -> usize {
    match d {
        Direction::HostToDevice => 0,
        Direction::DeviceToHost => 1,
        Direction::DeviceToDevice => 2,
    }
}

/// Sets the guard for every direction on this thread until the returned
/// value drops.
///
/// ```
/// use kiln::GuardLevel;
/// let _guard = kiln::transfer_guard(GuardLevel::Disallow);
/// // Any host<->GPU copy on this thread now fails with TransferDisallowed.
/// ```
pub fn transfer_guard(level: GuardLevel) -> TransferGuard {
    let previous = GUARDS.with(|g| g.replace([level; 3]));
    TransferGuard { previous }
}

/// Sets the guard for one direction on this thread until the returned value drops.
pub fn transfer_guard_for(direction: Direction, level: GuardLevel) -> TransferGuard {
    let previous = GUARDS.with(|g| {
        let old = g.get();
        let mut new = old;
        new[slot(direction)] = level;
        g.set(new);
        old
    });
    TransferGuard { previous }
}

/// A transfer the guard allowed, booked by [`Ticket::book`] once it has
/// happened, so that a copy that fails (out of memory) is never counted.
pub(crate) struct Ticket {
    direction: Direction,
    src: Device,
    dst: Device,
    bytes: usize,
    location: String,
}

impl Ticket {
    pub(crate) fn book(self) {
        let Ticket { direction, src, dst, bytes, location } = self;
        LOCAL.with(|l| l.borrow_mut().book(direction, src, dst, bytes as u64, &location));
        GLOBAL.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(Default::default).book(
            direction,
            src,
            dst,
            bytes as u64,
            &location,
        );
    }
}

/// Checks the guard for a transfer; `None` when it is not a transfer (both
/// ends on one device, or on the host).
pub(crate) fn check(src: Device, dst: Device, bytes: usize, site: &'static Location<'static>) -> Result<Option<Ticket>> {
    if src == dst {
        // A copy within one device crosses no bus.
        return Ok(None);
    }
    let direction = match (src, dst) {
        (Device::Cpu, Device::Cpu) => return Ok(None),
        (Device::Cpu, Device::Gpu(_)) => Direction::HostToDevice,
        (Device::Gpu(_), Device::Cpu) => Direction::DeviceToHost,
        (Device::Gpu(_), Device::Gpu(_)) => Direction::DeviceToDevice,
    };
    let site = SITE.with(|s| s.get()).unwrap_or(site);
    let location = format!("{}:{}:{}", site.file(), site.line(), site.column());
    match GUARDS.with(|g| g.get())[slot(direction)] {
        GuardLevel::Allow => {}
        GuardLevel::Log => eprintln!("kiln: {direction} transfer {src} -> {dst} of {} at {location}", crate::human_bytes(bytes)),
        GuardLevel::Disallow => return Err(Error::TransferDisallowed { direction, src, dst, location }),
    }
    Ok(Some(Ticket { direction, src, dst, bytes, location }))
}
