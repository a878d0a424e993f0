//! Device-side index checks: how a kernel that reads indices or labels
//! reports a bad one without a hidden synchronisation.
//!
//! On the CPU the front end reads the indices and raises at the call. On an
//! asynchronous device it does not (that would be a device-to-host transfer
//! and a wait): the kernel checks each index as it reads it, and the first
//! bad one poisons the device's queue, like CUDA's device-side assert, so
//! that the next synchronising call (`synchronize`, `block_until_ready`, a
//! read) returns [`Error::KernelFailed`] naming the op, the bad value and
//! the bound. Meanwhile the kernel writes zeros for (or skips) what the bad
//! index would have read, so that no memory outside the tensor is touched.
//!
//! One call per kernel, on either side:
//!
//! - **Host kernels** (the CPU and the simulated GPUs, whose worker turns a
//!   kernel's error into a poisoned queue): [`IndexCheck::check`] for each
//!   index read, `?` on its result.
//! - **CUDA kernels**: [`IndexCheck::cuda`] gives the two argument fields
//!   the kernel needs (`fault`, `site`; put them in its `kernel_args!`
//!   struct with the dimension, `dim`), and the kernel calls the prelude's
//!   `kiln_index_ok(p.fault, p.site, value, bound, p.dim)`, which returns
//!   whether the index is in range and records the first bad one in the
//!   device's fault record (mapped pinned host memory: the host reads it
//!   when it synchronises, without a copy). The backend reports it at the
//!   next synchronising call and refuses launches until then, as a
//!   simulated GPU's poisoned queue does.
//!
//! ```text
//! // Rust, in the op's `cuda` method:
//! let (fault, site) = CHECK.cuda(dev)?;
//! let args = MyArgs { ids, .., fault, site, dim: dim as i64 };
//! // CUDA C, in the kernel:
//! i64 v = read_raw(ids, p.li, j);
//! if (!kiln_index_ok(p.fault, p.site, v, p.d, p.dim)) { out[t] = zero; continue; }
//! ```

use crate::base::device::Device;
use crate::base::error::{Error, Result};
use crate::kernel::cuda::CudaDevice;
use std::sync::Mutex;

/// What an op reads: indices into a dimension, or class labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IndexKind {
    /// Indices into dimension `dim` of size `bound`.
    Index,
    /// Class labels below `bound`.
    Label,
}

/// An op's index check: the op's name (as errors report it) and what it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IndexCheck {
    pub op: &'static str,
    pub kind: IndexKind,
}

/// The checks CUDA kernels have named so far: a kernel records its site's
/// number (1-based; 0 is "none"), the backend reads the name back.
static SITES: Mutex<Vec<IndexCheck>> = Mutex::new(Vec::new());

impl IndexCheck {
    /// A check of indices for `op`.
    pub(crate) const fn index(op: &'static str) -> IndexCheck {
        IndexCheck { op, kind: IndexKind::Index }
    }
    /// A check of class labels for `op`.
    pub(crate) const fn label(op: &'static str) -> IndexCheck {
        IndexCheck { op, kind: IndexKind::Label }
    }

    /// The position `value` names when it lies in `0..bound`, else the error
    /// the op reports (a host kernel returns it: the CPU raises it, a
    /// simulated GPU's queue is poisoned with it). `dim` is the dimension
    /// indexed (ignored for labels).
    #[inline]
    pub(crate) fn check(&self, value: i64, bound: usize, dim: usize) -> Result<usize> {
        match usize::try_from(value) {
            Ok(i) if i < bound => Ok(i),
            _ => Err(self.error(Device::Cpu, value, bound as u64, dim as i64)),
        }
    }

    /// The error for a bad `value` on `device` (a host kernel's is
    /// renamed to its device by the backend that ran it).
    pub(crate) fn error(&self, device: Device, value: i64, bound: u64, dim: i64) -> Error {
        Error::KernelFailed { device, op: self.op.to_string(), msg: self.message(value, bound, dim) }
    }

    /// What went wrong, as the CPU's front end says it.
    pub(crate) fn message(&self, value: i64, bound: u64, dim: i64) -> String {
        match self.kind {
            IndexKind::Index => format!("index {value} is out of range for dimension {dim} of size {bound}"),
            IndexKind::Label => format!("label {value} is out of range for {bound} classes"),
        }
    }

    /// This check's site number, for a CUDA kernel (registered on first use).
    pub(crate) fn site(&self) -> u64 {
        let mut sites = SITES.lock().unwrap_or_else(|e| e.into_inner());
        match sites.iter().position(|s| s == self) {
            Some(i) => i as u64 + 1,
            None => {
                sites.push(*self);
                sites.len() as u64
            }
        }
    }

    /// The check that site number `site` names, if any.
    pub(crate) fn of_site(site: u64) -> Option<IndexCheck> {
        let sites = SITES.lock().unwrap_or_else(|e| e.into_inner());
        usize::try_from(site).ok().and_then(|s| s.checked_sub(1)).and_then(|i| sites.get(i).copied())
    }

    /// The `fault` and `site` argument fields of a CUDA kernel that checks
    /// its indices with `kiln_index_ok` on `dev`.
    pub(crate) fn cuda(&self, dev: &dyn CudaDevice) -> Result<(u64, u64)> {
        Ok((dev.fault_record()?, self.site()))
    }
}

/// The fault record a CUDA kernel writes (`struct KilnFault` in the
/// prelude): `state` 0 (clear), 1 (being written) or 2 (a bad index, with
/// the site, value, bound and dimension).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct FaultRecord {
    pub state: u32,
    pub pad: u32,
    pub site: u64,
    pub value: i64,
    pub bound: u64,
    pub dim: i64,
}

impl FaultRecord {
    /// The error a filled record reports on `device`.
    pub(crate) fn error(&self, device: Device) -> Error {
        match IndexCheck::of_site(self.site) {
            Some(check) => check.error(device, self.value, self.bound, self.dim),
            None => Error::KernelFailed {
                device,
                op: "index check".into(),
                msg: format!("index {} is out of range (bound {}) at an unknown site {}", self.value, self.bound, self.site),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_op_the_value_and_the_bound() {
        let c = IndexCheck::index("index_select");
        assert_eq!(c.check(2, 3, 0).unwrap(), 2);
        let e = c.check(3, 3, 1).unwrap_err().to_string();
        assert!(e.contains("index_select") && e.contains("index 3 is out of range for dimension 1 of size 3"), "{e}");
        assert!(c.check(-1, 3, 0).is_err());
        let l = IndexCheck::label("cross_entropy");
        assert!(l.check(7, 3, 0).unwrap_err().to_string().contains("label 7 is out of range for 3 classes"));
        let site = l.site();
        assert_eq!(l.site(), site);
        assert_eq!(IndexCheck::of_site(site), Some(l));
        assert_eq!(IndexCheck::of_site(0), None);
        assert_eq!(std::mem::size_of::<FaultRecord>(), 40);
    }
}
