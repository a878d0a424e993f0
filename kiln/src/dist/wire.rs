//! What crosses between processes: a tensor's elements staged in host
//! memory ([`HostBuf`]), the call an engine runs on them ([`Call`]) and the
//! fingerprint every rank publishes for each collective ([`Fingerprint`]).

// Fingerprints and raw pointers serve the engines that cross processes
// (feature `mpi`).
#![cfg_attr(not(feature = "mpi"), allow(dead_code))]

use crate::comm::ReduceOp;
use crate::kernel::storage::{OperandLocks, Storage};
use crate::kernel::Out;
use crate::{DType, Device, Error, Result, Tensor};
use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

/// A tensor's elements in host memory, in a type every engine can reduce.
/// f16 and bf16 travel as f32 (exact both ways; their sums are rounded
/// once, at the end).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum HostBuf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

/// The element type on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wire {
    F32,
    F64,
    I32,
    I64,
    U8,
}

impl Wire {
    pub(crate) fn code(self) -> u64 {
        match self {
            Wire::F32 => 1,
            Wire::F64 => 2,
            Wire::I32 => 3,
            Wire::I64 => 4,
            Wire::U8 => 5,
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            Wire::F32 | Wire::I32 => 4,
            Wire::F64 | Wire::I64 => 8,
            Wire::U8 => 1,
        }
    }

    fn name(code: u64) -> &'static str {
        match code {
            1 => "f32",
            2 => "f64",
            3 => "i32",
            4 => "i64",
            5 => "u8",
            _ => "none",
        }
    }
}

impl HostBuf {
    /// `t`'s elements, read to the host (a counted transfer from a GPU).
    pub(crate) fn of(t: &Tensor) -> Result<HostBuf> {
        Ok(match t.dtype() {
            DType::F32 => HostBuf::F32(t.to_vec::<f32>()?),
            DType::F16 | DType::BF16 => HostBuf::F32(t.to_dtype(DType::F32)?.to_vec::<f32>()?),
            DType::F64 => HostBuf::F64(t.to_vec::<f64>()?),
            DType::I32 => HostBuf::I32(t.to_vec::<i32>()?),
            DType::I64 => HostBuf::I64(t.to_vec::<i64>()?),
            DType::U8 => HostBuf::U8(t.to_vec::<u8>()?),
        })
    }

    /// `len` zeros of `dtype`'s wire type.
    pub(crate) fn zeros(dtype: DType, len: usize) -> HostBuf {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => HostBuf::F32(vec![0.0; len]),
            DType::F64 => HostBuf::F64(vec![0.0; len]),
            DType::I32 => HostBuf::I32(vec![0; len]),
            DType::I64 => HostBuf::I64(vec![0; len]),
            DType::U8 => HostBuf::U8(vec![0; len]),
        }
    }

    /// `len` zeros of the wire type `wire`.
    pub(crate) fn zeros_of(wire: Wire, len: usize) -> HostBuf {
        match wire {
            Wire::F32 => HostBuf::F32(vec![0.0; len]),
            Wire::F64 => HostBuf::F64(vec![0.0; len]),
            Wire::I32 => HostBuf::I32(vec![0; len]),
            Wire::I64 => HostBuf::I64(vec![0; len]),
            Wire::U8 => HostBuf::U8(vec![0; len]),
        }
    }

    /// A tensor of `dtype` and `dims` on `device` holding these elements,
    /// divided by `divisor` (a mean) in the wire type before they take
    /// `dtype`: f16 and bf16 are rounded once, and a sum past their range
    /// whose mean is not does not become infinite.
    pub(crate) fn into_tensor(self, dtype: DType, dims: &[usize], device: &Device, divisor: Option<usize>) -> Result<Tensor> {
        let t = match self {
            HostBuf::F32(v) => Tensor::from_vec(v, dims, device)?,
            HostBuf::F64(v) => Tensor::from_vec(v, dims, device)?,
            HostBuf::I32(v) => Tensor::from_vec(v, dims, device)?,
            HostBuf::I64(v) => Tensor::from_vec(v, dims, device)?,
            HostBuf::U8(v) => Tensor::from_vec(v, dims, device)?,
        };
        let t = match divisor {
            Some(n) => t.div_scalar(n as f64)?,
            None => t,
        };
        if t.dtype() == dtype {
            Ok(t)
        } else {
            t.to_dtype(dtype)
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            HostBuf::F32(v) => v.len(),
            HostBuf::F64(v) => v.len(),
            HostBuf::I32(v) => v.len(),
            HostBuf::I64(v) => v.len(),
            HostBuf::U8(v) => v.len(),
        }
    }

    pub(crate) fn wire(&self) -> Wire {
        match self {
            HostBuf::F32(_) => Wire::F32,
            HostBuf::F64(_) => Wire::F64,
            HostBuf::I32(_) => Wire::I32,
            HostBuf::I64(_) => Wire::I64,
            HostBuf::U8(_) => Wire::U8,
        }
    }

    pub(crate) fn as_ptr(&self) -> *const std::ffi::c_void {
        match self {
            HostBuf::F32(v) => v.as_ptr().cast(),
            HostBuf::F64(v) => v.as_ptr().cast(),
            HostBuf::I32(v) => v.as_ptr().cast(),
            HostBuf::I64(v) => v.as_ptr().cast(),
            HostBuf::U8(v) => v.as_ptr().cast(),
        }
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut std::ffi::c_void {
        match self {
            HostBuf::F32(v) => v.as_mut_ptr().cast(),
            HostBuf::F64(v) => v.as_mut_ptr().cast(),
            HostBuf::I32(v) => v.as_mut_ptr().cast(),
            HostBuf::I64(v) => v.as_mut_ptr().cast(),
            HostBuf::U8(v) => v.as_mut_ptr().cast(),
        }
    }
}

/// A contiguous run of a CPU tensor's own elements, which an engine reads
/// where they are (and, for an in-place call, writes there) under the
/// storage's lock: nothing is copied. The view keeps the storage alive, so
/// an engine that still holds it after its caller gave up (a call stuck
/// inside MPI) never touches freed memory.
#[derive(Clone)]
pub(crate) struct HostView {
    storage: Arc<Storage>,
    offset: usize,
    len: usize,
    wire: Wire,
    /// Whether the call writes its result here (under the write lock).
    pub(crate) write: bool,
}

impl fmt::Debug for HostView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostView({} {:?} elements at {}{})", self.len, self.wire, self.offset, if self.write { ", written" } else { "" })
    }
}

impl HostView {
    /// `t`'s elements where they are: when `t` is a contiguous tensor on the
    /// CPU of a type that travels as itself (not f16 or bf16), whose
    /// contents are not poisoned; `None` otherwise (the caller stages).
    pub(crate) fn of(t: &Tensor, write: bool) -> Option<HostView> {
        let wire = match t.dtype() {
            DType::F32 => Wire::F32,
            DType::F64 => Wire::F64,
            DType::I32 => Wire::I32,
            DType::I64 => Wire::I64,
            DType::U8 => Wire::U8,
            DType::F16 | DType::BF16 => return None,
        };
        if t.device() != Device::Cpu || !t.is_contiguous() || t.storage.fault().is_some() {
            return None;
        }
        Some(HostView { storage: Arc::clone(&t.storage), offset: t.layout.offset(), len: t.elem_count(), wire, write })
    }

    /// Runs `f` with the address of the first element, under the storage's
    /// read lock, or its write lock when the call writes here.
    pub(crate) fn with_ptr<R>(&self, f: impl FnOnce(*mut c_void) -> R) -> std::result::Result<R, String> {
        let check = |held: usize| {
            if self.offset.checked_add(self.len).is_none_or(|end| end > held) {
                Err(format!(
                    "a view of {} elements at {} does not fit its storage of {held} (a kiln bug: please report it)",
                    self.len, self.offset
                ))
            } else {
                Ok(())
            }
        };
        let size = self.wire.size();
        if self.write {
            let mut locks = OperandLocks::new(&[], Out::Storage(&self.storage)).map_err(|e| e.to_string())?;
            let (_, buf) = locks.split();
            check(buf.len())?;
            let base: *mut c_void = crate::map_buffer!(buf, v => v.as_mut_ptr().cast());
            // SAFETY: in bounds (checked above); the write lock is held while `f` runs.
            Ok(f(unsafe { base.cast::<u8>().add(self.offset * size).cast() }))
        } else {
            let read = self.storage.read();
            let buf = read.host();
            check(buf.len())?;
            // Only read through (MPI's send buffers are `const void*`).
            let base: *mut c_void = crate::map_buffer!(buf, v => v.as_ptr() as *mut c_void);
            // SAFETY: in bounds (checked above); the read lock is held while `f` runs.
            Ok(f(unsafe { base.cast::<u8>().add(self.offset * size).cast() }))
        }
    }
}

impl HostView {
    /// Marks the tensor's contents as not trustworthy (a write that failed
    /// or never finished): reading them returns `err`.
    pub(crate) fn poison(&self, err: &Error) {
        self.storage.poison(err);
    }

    /// A staged copy of the elements.
    pub(crate) fn staged(&self) -> std::result::Result<HostBuf, String> {
        let mut buf = HostBuf::zeros_of(self.wire, self.len);
        let dst = buf.as_mut_ptr();
        let bytes = self.len * self.wire.size();
        // SAFETY: both hold `len` elements of the wire type; distinct allocations.
        self.with_ptr(|src| unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), dst.cast::<u8>(), bytes) })?;
        Ok(buf)
    }
}

/// This rank's elements as a call hands them to an engine.
#[derive(Debug)]
pub(crate) enum Payload {
    /// Staged in host memory: the engine's to use and return.
    Staged(HostBuf),
    /// A CPU tensor's own memory (see [`HostView`]).
    InPlace(HostView),
}

impl Payload {
    pub(crate) fn len(&self) -> usize {
        match self {
            Payload::Staged(b) => b.len(),
            Payload::InPlace(v) => v.len,
        }
    }

    pub(crate) fn wire(&self) -> Wire {
        match self {
            Payload::Staged(b) => b.wire(),
            Payload::InPlace(v) => v.wire,
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.len() * self.wire().size()
    }
}

/// What an engine does with a rank's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CallKind {
    /// Every rank gets the combination of all ranks' buffers.
    AllReduce(ReduceOp),
    /// Every rank gets `root`'s buffer.
    Broadcast { root: usize },
    /// `root` gets the combination; the others keep their buffer.
    Reduce { root: usize, op: ReduceOp },
    /// Every rank gets all buffers one after another, rank 0 first.
    AllGather,
    /// Rank r gets the combination of the r-th of `size` equal pieces.
    ReduceScatter(ReduceOp),
    /// Returns when every rank has called it (an empty buffer).
    Barrier,
    /// The buffer goes to `peer`, which calls `Recv`.
    Send { peer: usize },
    /// The buffer (its length and type) is filled from `peer`'s `Send`.
    Recv { peer: usize },
}

impl CallKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            CallKind::AllReduce(_) => "all_reduce",
            CallKind::Broadcast { .. } => "broadcast",
            CallKind::Reduce { .. } => "reduce",
            CallKind::AllGather => "all_gather",
            CallKind::ReduceScatter(_) => "reduce_scatter",
            CallKind::Barrier => "barrier",
            CallKind::Send { .. } => "send",
            CallKind::Recv { .. } => "recv",
        }
    }

    /// Whether every rank of the group takes part (and so gets a
    /// sequence number): not `send`/`recv`.
    pub(crate) fn is_collective(self) -> bool {
        match self {
            CallKind::AllReduce(_)
            | CallKind::Broadcast { .. }
            | CallKind::Reduce { .. }
            | CallKind::AllGather
            | CallKind::ReduceScatter(_)
            | CallKind::Barrier => true,
            CallKind::Send { .. } | CallKind::Recv { .. } => false,
        }
    }

    fn code(self) -> u64 {
        match self {
            CallKind::AllReduce(_) => 1,
            CallKind::Broadcast { .. } => 2,
            CallKind::Reduce { .. } => 3,
            CallKind::AllGather => 4,
            CallKind::ReduceScatter(_) => 5,
            CallKind::Barrier => 6,
            CallKind::Send { .. } => 7,
            CallKind::Recv { .. } => 8,
        }
    }

    fn op_code(self) -> u64 {
        let op = match self {
            CallKind::AllReduce(op) | CallKind::Reduce { op, .. } | CallKind::ReduceScatter(op) => op,
            CallKind::Broadcast { .. } | CallKind::AllGather | CallKind::Barrier | CallKind::Send { .. } | CallKind::Recv { .. } => {
                return 0;
            }
        };
        match op {
            ReduceOp::Sum => 1,
            ReduceOp::Mean => 2,
            ReduceOp::Max => 3,
            ReduceOp::Min => 4,
        }
    }

    fn root(self) -> u64 {
        match self {
            CallKind::Broadcast { root } | CallKind::Reduce { root, .. } => root as u64,
            CallKind::Send { peer } | CallKind::Recv { peer } => peer as u64,
            CallKind::AllReduce(_) | CallKind::AllGather | CallKind::ReduceScatter(_) | CallKind::Barrier => 0,
        }
    }
}

/// One call: what to do, and this rank's buffer. An engine returns the
/// call's result staged, or nothing (an empty buffer) when the call wrote
/// it into a view of the tensor ([`HostView::write`]).
#[derive(Debug)]
pub(crate) struct Call {
    pub(crate) kind: CallKind,
    pub(crate) data: Payload,
}

/// What every rank publishes for its n-th collective, so that two ranks
/// that call different collectives (another op, dtype, size or root) get an
/// error naming both calls instead of a wrong result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    pub(crate) seq: u64,
    pub(crate) kind: u64,
    pub(crate) op: u64,
    pub(crate) wire: u64,
    pub(crate) count: u64,
    pub(crate) root: u64,
}

impl Fingerprint {
    /// The fingerprint of collective number `seq`: `kind` on `data`.
    pub(crate) fn of(seq: u64, kind: CallKind, data: &Payload) -> Fingerprint {
        Fingerprint { seq, kind: kind.code(), op: kind.op_code(), wire: data.wire().code(), count: data.len() as u64, root: kind.root() }
    }

    pub(crate) fn to_words(self) -> [u64; 6] {
        [self.seq, self.kind, self.op, self.wire, self.count, self.root]
    }

    pub(crate) fn from_words(w: [u64; 6]) -> Fingerprint {
        Fingerprint { seq: w[0], kind: w[1], op: w[2], wire: w[3], count: w[4], root: w[5] }
    }

    /// Equal calls, whatever their sequence numbers.
    pub(crate) fn same_call(&self, other: &Fingerprint) -> bool {
        (self.kind, self.op, self.wire, self.count, self.root) == (other.kind, other.op, other.wire, other.count, other.root)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            1 => "all_reduce",
            2 => "broadcast",
            3 => "reduce",
            4 => "all_gather",
            5 => "reduce_scatter",
            6 => "barrier",
            7 => "send",
            8 => "recv",
            _ => "unknown call",
        };
        write!(f, "#{} {kind}", self.seq)?;
        let op = match self.op {
            1 => Some("sum"),
            2 => Some("mean"),
            3 => Some("max"),
            4 => Some("min"),
            _ => None,
        };
        if let Some(op) = op {
            write!(f, " ({op})")?;
        }
        if self.kind != 6 {
            write!(f, " of {} {} elements", self.count, Wire::name(self.wire))?;
        }
        if matches!(self.kind, 2 | 3) {
            write!(f, " from root {}", self.root)?;
        }
        Ok(())
    }
}

/// The error of a process group.
pub(crate) fn dist_error(rank: usize, size: usize, op: &str, msg: impl Into<String>) -> Error {
    Error::Distributed { rank, size, op: op.to_string(), msg: msg.into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu;

    /// What an in-place call that failed part-way leaves: a poisoned CPU
    /// storage, which every view refuses to read, compute from or write
    /// into, with the original error (and without waiting for its lock,
    /// which a call stuck inside MPI still holds).
    #[test]
    fn a_poisoned_cpu_tensor_is_refused_read_computed_and_written() -> Result<()> {
        let t = Tensor::new(&[1f32, 2., 3.], &cpu())?;
        let alias = t.narrow(0, 1, 2)?;
        let err = dist_error(1, 2, "all_reduce_", "MPI_Allreduce failed part-way");
        let view = HostView::of(&t, true).expect("a contiguous f32 CPU tensor is used in place");
        assert_eq!((view.len, view.offset, view.wire), (3, 0, Wire::F32));
        // Held locked as a call stuck inside MPI would hold it.
        let mut locks = OperandLocks::new(&[], Out::Storage(&view.storage))?;
        let _held = locks.split();
        view.poison(&err);
        for got in [t.to_vec::<f32>().map(drop), alias.to_vec::<f32>().map(drop), (&alias + 1.0).map(drop), t.sum_all().map(drop)] {
            assert_eq!(got.unwrap_err().to_string(), err.to_string());
        }
        assert_eq!(alias.assign(&Tensor::new(&[0f32, 0.], &cpu())?).unwrap_err().to_string(), err.to_string());
        // Not used in place again: a staged read, which returns the error.
        assert!(HostView::of(&t, false).is_none());
        Ok(())
    }

    #[test]
    fn views_are_taken_of_contiguous_cpu_tensors_of_wire_types_only() -> Result<()> {
        let m = Tensor::new(&[[1f64, 2.], [3., 4.]], &cpu())?;
        let row = m.narrow(0, 1, 1)?;
        let v = HostView::of(&row, false).expect("a contiguous row");
        assert_eq!((v.offset, v.len, v.wire), (2, 2, Wire::F64));
        assert_eq!(v.staged().map_err(|m| dist_error(0, 1, "test", m))?, HostBuf::F64(vec![3., 4.]));
        assert!(HostView::of(&m.t()?, false).is_none(), "a strided view is staged");
        assert!(HostView::of(&m.to_dtype(DType::BF16)?, false).is_none(), "bf16 travels as f32");
        let empty = Tensor::zeros((0, 3), DType::U8, &cpu())?;
        assert_eq!(HostView::of(&empty, true).map(|v| v.len), Some(0));
        Ok(())
    }
}
