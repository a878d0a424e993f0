//! The errors of the host kernels.

use std::fmt;

/// Why a host kernel refused to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NnError {
    /// An argument PyTorch would refuse, or a slice of the wrong length.
    InvalidArgument {
        /// The operation, e.g. `conv2d`.
        op: &'static str,
        /// What was wrong, naming the argument and the sizes.
        msg: String,
    },
    /// The host could not give the kernel its workspace.
    OutOfMemory {
        /// The operation.
        op: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
}

/// The result of a host kernel.
pub type NnResult<T> = std::result::Result<T, NnError>;

impl NnError {
    pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> NnError {
        NnError::InvalidArgument { op, msg: msg.into() }
    }
}

impl fmt::Display for NnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NnError::InvalidArgument { op, msg } => write!(f, "{op}: {msg}"),
            NnError::OutOfMemory { op, bytes } => write!(f, "{op}: the host cannot allocate {bytes} bytes of workspace"),
        }
    }
}

impl std::error::Error for NnError {}

impl From<NnError> for crate::Error {
    fn from(e: NnError) -> crate::Error {
        match e {
            NnError::InvalidArgument { op, msg } => crate::Error::InvalidArgument { op: op.to_string(), msg },
            NnError::OutOfMemory { bytes, .. } => crate::runtime::memory::host_oom(bytes),
        }
    }
}
