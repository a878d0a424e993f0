//! Workspace, checked sizes and the split of work over threads.

use super::{NnError, NnFloat, NnResult};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// An empty vector with room for `len` elements, or `OutOfMemory`: also
/// when the machine could never hold them (the allocator, overcommitting,
/// would say yes and the writes that follow would wait on the OOM killer).
fn reserved<T>(op: &'static str, len: usize) -> NnResult<Vec<T>> {
    crate::base::buffer::try_with_capacity(len).ok_or(NnError::OutOfMemory { op, bytes: len.saturating_mul(std::mem::size_of::<T>()) })
}

/// `len` zeros in a new vector, or `OutOfMemory` (never an abort).
pub(crate) fn zeroed<T: NnFloat>(op: &'static str, len: usize) -> NnResult<Vec<T>> {
    let mut v = reserved(op, len)?;
    v.resize(len, T::ZERO);
    Ok(v)
}

/// `f(i)` for `i < len` in a new vector, or `OutOfMemory`.
pub(crate) fn try_collect<T>(op: &'static str, len: usize, f: impl FnMut(usize) -> T) -> NnResult<Vec<T>> {
    let mut v = reserved(op, len)?;
    v.extend((0..len).map(f));
    Ok(v)
}

/// The product of user-given sizes, or `InvalidArgument` naming `what` when
/// it does not fit (in elements of 8 bytes, so that any byte count made from
/// it fits an `isize` too).
pub(crate) fn product(op: &'static str, what: &str, dims: &[usize]) -> NnResult<usize> {
    const LIMIT: usize = (isize::MAX as usize) / 8;
    let mut n: usize = 1;
    for &d in dims {
        n = n
            .checked_mul(d)
            .filter(|&n| n <= LIMIT)
            .ok_or_else(|| NnError::invalid(op, format!("{what} {dims:?} has too many elements")))?;
    }
    Ok(n)
}

/// `a + b` for user-given sizes.
pub(crate) fn add(op: &'static str, what: &str, a: usize, b: usize) -> NnResult<usize> {
    a.checked_add(b).ok_or_else(|| NnError::invalid(op, format!("{what} overflows ({a} + {b})")))
}

/// `a · b` for user-given sizes.
pub(crate) fn mul(op: &'static str, what: &str, a: usize, b: usize) -> NnResult<usize> {
    a.checked_mul(b).ok_or_else(|| NnError::invalid(op, format!("{what} overflows ({a} · {b})")))
}

/// Refuses a slice whose length is not the one the shape asks for.
pub(crate) fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> NnResult<()> {
    if got == want {
        Ok(())
    } else {
        Err(NnError::invalid(op, format!("{what} has {got} elements where the shape asks for {want}")))
    }
}

/// An output that tasks share to write disjoint parts of it.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T> {
    ptr: *mut T,
    len: usize,
}
// SAFETY: every user writes only the elements its unit of work owns (each
// use says which), so no two tasks touch one element.
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(s: &mut [T]) -> Self {
        SharedMut { ptr: s.as_mut_ptr(), len: s.len() }
    }

    /// Elements `off..off + len` of the output.
    ///
    /// # Safety
    /// While the tasks run, no other task touches these elements, and the
    /// output outlives the returned slice.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice<'a>(&self, off: usize, len: usize) -> &'a mut [T] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "host_nn: a task's part lies outside its output");
        // SAFETY: inside the output (checked above); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

/// Runs `unit(workspace, u)` for every `u < units`. With `threads > 1` that
/// many rayon tasks pull units from a shared counter (no lock, no wait), each
/// with its own workspace made by `init` at its first unit; otherwise the
/// calling thread runs them in order. The first error stops the rest.
pub(crate) fn for_each_unit<W>(
    threads: usize,
    units: usize,
    init: impl Fn() -> NnResult<W> + Sync,
    unit: impl Fn(&mut W, usize) -> NnResult<()> + Sync,
) -> NnResult<()> {
    if units == 0 {
        return Ok(());
    }
    let tasks = threads.min(units);
    if tasks <= 1 {
        let mut ws = init()?;
        return (0..units).try_for_each(|u| unit(&mut ws, u));
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    (0..tasks).into_par_iter().try_for_each(|_| {
        let mut ws = None;
        loop {
            if failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let u = next.fetch_add(1, Ordering::Relaxed);
            if u >= units {
                return Ok(());
            }
            if ws.is_none() {
                ws = Some(init().inspect_err(|_| failed.store(true, Ordering::Relaxed))?);
            }
            if let Some(ws) = ws.as_mut() {
                unit(ws, u).inspect_err(|_| failed.store(true, Ordering::Relaxed))?;
            }
        }
    })
}

/// `0..len` cut into `parts` near-equal ranges; range `i`.
pub(crate) fn part(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let parts = parts.max(1);
    let (q, r) = (len / parts, len % parts);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}
