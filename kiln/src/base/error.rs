//! The one error type of kiln. Every message says what happened, with the
//! devices, shapes and bytes involved, and what to do about it.

use crate::{DType, Device};

/// Which way a transfer goes; used by the ledger, the guard and errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// Host memory to a GPU.
    HostToDevice,
    /// A GPU to host memory (includes printing and `to_vec`).
    DeviceToHost,
    /// One GPU to another.
    DeviceToDevice,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Direction::HostToDevice => "host-to-device",
            Direction::DeviceToHost => "device-to-host",
            Direction::DeviceToDevice => "device-to-device",
        })
    }
}

fn list(devices: &[Device]) -> String {
    devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
}

/// Formats a byte count the way people read it (`1.5 GiB`).
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Which limit refused a host allocation, with its figures (bytes).
///
/// ```
/// use kiln::HostLimit;
/// let l = HostLimit::AddressSpace { limit: 1 << 30, mapped: 900 << 20 };
/// assert!(l.to_string().contains("RLIMIT_AS"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostLimit {
    /// The process's address-space limit (`ulimit -v`, `RLIMIT_AS`), and
    /// the address space the process had mapped.
    AddressSpace {
        /// The limit.
        limit: usize,
        /// Mapped when the allocation was refused (`VmSize`).
        mapped: usize,
    },
    /// The process's data-segment limit (`ulimit -d`, `RLIMIT_DATA`), and
    /// its data segment (`VmData`: heap and private writable mappings).
    Data {
        /// The limit.
        limit: usize,
        /// In use when the allocation was refused.
        used: usize,
    },
    /// The memory limit of the process's control group (`memory.max`, or
    /// `memory.limit_in_bytes` under cgroup v1) and the group's usage.
    Cgroup {
        /// The file the limit was read from.
        path: String,
        /// The limit.
        limit: usize,
        /// The group's usage (`memory.current` / `memory.usage_in_bytes`).
        used: usize,
    },
    /// None of the process's limits: the machine's memory, all of it and
    /// what the OS could still give.
    Machine {
        /// The host's RAM.
        total: usize,
        /// Available without swapping.
        available: usize,
    },
}

impl std::fmt::Display for HostLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = human_bytes;
        match self {
            HostLimit::AddressSpace { limit, mapped } => write!(
                f,
                "the process's address-space limit (ulimit -v, RLIMIT_AS) of {}, with {} mapped; raise it (`ulimit -v`) or use less",
                h(*limit),
                h(*mapped)
            ),
            HostLimit::Data { limit, used } => write!(
                f,
                "the process's data limit (ulimit -d, RLIMIT_DATA) of {}, with {} in its data segment; raise it (`ulimit -d`) or use less",
                h(*limit),
                h(*used)
            ),
            HostLimit::Cgroup { path, limit, used } => {
                write!(f, "the control group's memory limit of {} ({path}), with {} in use by the group", h(*limit), h(*used))
            }
            HostLimit::Machine { total, available } => {
                write!(f, "the machine's memory: {} in all, {} available", h(*total), h(*available))
            }
        }
    }
}

/// Everything that can go wrong in kiln.
///
/// ```
/// use kiln::{Tensor, Error, cpu};
/// let a = Tensor::ones((2, 3), kiln::DType::F32, &cpu())?;
/// let b = Tensor::ones((4,), kiln::DType::F32, &cpu())?;
/// assert!(matches!(a.add(&b), Err(Error::ShapeMismatch { .. })));
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(thiserror::Error, Debug, Clone)]
#[non_exhaustive]
pub enum Error {
    /// Two operands of one operation live on different devices.
    #[error("{}", device_mismatch(op, *lhs, *rhs))]
    DeviceMismatch {
        /// The operation that was refused.
        op: String,
        /// Device of the first operand.
        lhs: Device,
        /// Device of the other operand.
        rhs: Device,
    },
    /// A device that does not exist on this machine was used.
    #[error("{device} does not exist; devices here: [{}]; use `kiln::try_gpu({})` to fall back to the CPU", list(.available), match .device { Device::Gpu(i) => *i, Device::Cpu => 0 })]
    NoSuchDevice {
        /// The device that was asked for.
        device: Device,
        /// The devices that do exist.
        available: Vec<Device>,
    },
    /// Shapes that do not fit together.
    #[error("{op}: shapes {lhs:?} and {rhs:?} do not fit together{}", hint(.op))]
    ShapeMismatch {
        /// The operation that was refused.
        op: String,
        /// Shape of the first operand.
        lhs: Vec<usize>,
        /// Shape of the other operand (or the requested shape).
        rhs: Vec<usize>,
    },
    /// Operands whose element types differ, or a dtype an op does not support.
    #[error("{}", dtype_mismatch(op, *lhs, *rhs))]
    DTypeMismatch {
        /// The operation that was refused.
        op: String,
        /// The first dtype.
        lhs: DType,
        /// The other dtype.
        rhs: DType,
    },
    /// An operation that does not support a dtype.
    #[error("{}", unsupported_dtype(op, *dtype))]
    UnsupportedDType {
        /// The operation that was refused.
        op: String,
        /// The dtype it was given.
        dtype: DType,
    },
    /// A device's memory is full.
    #[error("{}", out_of_memory(*.device, *.requested, *.in_use, *.capacity, .limit.as_ref()))]
    OutOfMemory {
        /// The device whose memory is full.
        device: Device,
        /// Bytes requested by the failing call.
        requested: usize,
        /// Bytes in use by kiln on that device.
        in_use: usize,
        /// Capacity of the device.
        capacity: usize,
        /// For host memory that the OS refused: the limit that refused it
        /// (the process's address-space or data limit, its control group's,
        /// or the machine's), with its figures. None for a device's own
        /// capacity (a GPU's, a simulated GPU's).
        limit: Option<HostLimit>,
    },
    /// A transfer forbidden by a [`crate::TransferGuard`].
    #[error(
        "{direction} transfer from {src} to {dst} at {location} is disallowed by a transfer guard; keep the data where it is, or allow it with `kiln::transfer_guard(...)`"
    )]
    TransferDisallowed {
        /// Which way the transfer would have gone.
        direction: Direction,
        /// Source device.
        src: Device,
        /// Destination device.
        dst: Device,
        /// The user's call site, `file:line:column`.
        location: String,
    },
    /// An argument out of range or otherwise meaningless.
    #[error("{op}: {msg}")]
    InvalidArgument {
        /// The operation that was refused.
        op: String,
        /// What was wrong and what to do.
        msg: String,
    },
    /// A failure inside a device backend (driver, compiler, library).
    #[error("{device}: {msg}")]
    Backend {
        /// The device whose backend failed.
        device: Device,
        /// The backend's message.
        msg: String,
    },
    /// A kernel that failed after it was accepted. On an asynchronous device
    /// this is reported once by the next synchronising call (`synchronize`,
    /// `block_until_ready`, a read, whichever tensor it reads), like CUDA's
    /// sticky errors; the device's queue skips the work queued after the
    /// failure until then. The results of the failed kernel, of the work
    /// queued after it until the report, and of anything computed from
    /// them are *poisoned*: every read of one of them (`to_vec`, printing,
    /// a copy to another device), and every read of what is computed from
    /// it, returns this same error until it is recomputed (overwritten
    /// whole by a kernel that succeeds). Nothing read is ever silently
    /// wrong; the device itself works again once the failure is reported.
    #[error(
        "{device}: kernel `{op}` failed: {msg}; reading the results of this kernel, of the work queued after it on {device} before this was reported, and of anything computed from them returns this error; recompute them (e.g. `let y = f(&x)?;` again)"
    )]
    KernelFailed {
        /// The device that ran the kernel.
        device: Device,
        /// The kernel's name.
        op: String,
        /// What went wrong.
        msg: String,
    },
    /// An I/O failure, with the path it concerned.
    #[error("{path}: {msg}")]
    Io {
        /// The file or directory.
        path: String,
        /// What went wrong.
        msg: String,
    },
    /// A checkpoint or data file that cannot be used.
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong with it, naming the tensor when there is one.
        msg: String,
    },
    /// A call of a process group ([`crate::dist`]) failed: another rank was
    /// silent past the timeout, called a different collective, or the
    /// engine (MPI) returned an error; or the launch cannot be served.
    #[error("rank {rank} of {size}: {op}: {msg}")]
    Distributed {
        /// This process's rank.
        rank: usize,
        /// The number of processes.
        size: usize,
        /// The call, e.g. `all_reduce`.
        op: String,
        /// What happened, naming the other ranks involved and what to do.
        msg: String,
    },
}

/// The message of `UnsupportedDType`: an op on a tensor can convert its
/// input first; a creation (random numbers) asks for another dtype.
fn unsupported_dtype(op: &str, dtype: DType) -> String {
    if op == "rand" {
        format!("{op}: not supported for dtype {dtype}; random values are floats: ask for `kiln::DType::F32` (or F64, F16, BF16)")
    } else {
        // The float that holds every value of the dtype (as near as there is
        // one): never a narrowing hint.
        let to = match dtype {
            DType::I32 | DType::I64 | DType::F64 => DType::F64,
            DType::U8 | DType::F16 | DType::BF16 | DType::F32 => DType::F32,
        };
        format!("{op}: not supported for dtype {dtype}; convert first with `.to_dtype(kiln::DType::{to:?})?`")
    }
}

/// The message of `OutOfMemory`: the device's own capacity, or for host
/// memory the OS refused, the limit that refused it.
fn out_of_memory(device: Device, requested: usize, in_use: usize, capacity: usize, limit: Option<&HostLimit>) -> String {
    let what = match limit {
        Some(limit) => format!("asked for {}, refused by {limit}; kiln holds {} there", human_bytes(requested), human_bytes(in_use)),
        None => format!("asked for {}, {} in use of {}", human_bytes(requested), human_bytes(in_use), human_bytes(capacity)),
    };
    format!(
        "out of memory on {device}: {what}; drop tensors you no longer need (their memory is reusable by later work on the device at once, even while kernels queued on them still run), call `kiln::empty_cache(&{})?`, or use a smaller batch",
        device_expr(device)
    )
}

/// The message of `DTypeMismatch`. A read of the wrong type (`to_vec::<T>`)
/// converts to the type asked for; two operands convert to the wider dtype
/// ([`DType::promote`]), never the narrower: that would lose values.
fn dtype_mismatch(op: &str, lhs: DType, rhs: DType) -> String {
    if op.contains("::<") {
        return format!("{op}: dtypes {lhs} and {rhs} differ; convert with `.to_dtype(DType::{lhs:?})?`");
    }
    let wide = lhs.promote(rhs);
    let which = if wide == lhs {
        format!("the {rhs} operand")
    } else if wide == rhs {
        format!("the {lhs} operand")
    } else {
        "both operands".to_string()
    };
    format!("{op}: dtypes {lhs} and {rhs} differ; convert {which} to the wider dtype with `.to_dtype(DType::{wide:?})?`")
}

/// The Rust expression that names a device: `kiln::cpu()`, `kiln::gpu(0)`.
fn device_expr(d: Device) -> String {
    match d {
        Device::Cpu => "kiln::cpu()".into(),
        Device::Gpu(i) => format!("kiln::gpu({i})"),
    }
}

fn device_mismatch(op: &str, lhs: Device, rhs: Device) -> String {
    if op.starts_with("input is on ") {
        // A forward: the input is what moves, to the parameters' device.
        format!("{op}; kiln never copies silently: move the input first, e.g. `x.to(&{})?`", device_expr(rhs))
    } else {
        format!(
            "{op}: operands are on different devices, {lhs} and {rhs}; kiln never copies silently: move one operand first, e.g. `rhs.to(&{})?`",
            device_expr(lhs)
        )
    }
}

/// What the shapes of a `ShapeMismatch` should have been. `op` is an op's
/// name (`add`, `matmul`), perhaps after a layer's (`Conv2d(..): add`): the
/// op's own rule, or the broadcasting one for the elementwise ops. A
/// sentence (`mse_loss: prediction and target need the same number of
/// elements`) already says what is wrong, and nothing broadcasts there: no
/// hint.
fn hint(op: &str) -> &'static str {
    let name = op.rsplit(": ").next().unwrap_or(op);
    match name {
        "matmul" => "; the inner dimensions must agree: (.., m, k) @ (.., k, n)",
        "matmul (batch dimensions)" => {
            "; the inner dimensions agree, but the batch dimensions (all but the last two) must broadcast: each equal or 1"
        }
        "reshape" => "; the element counts must be equal",
        "from_vec" => "; the data's length must equal the shape's element count (the product of its dimensions)",
        "gather" | "scatter" | "scatter_add" => "; the index must have the input's rank (and src's)",
        sentence if sentence.contains(' ') => "",
        _ => "; broadcasting needs each trailing dimension to be equal or 1",
    }
}

/// The result type of every fallible kiln function.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn invalid(op: &str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument { op: op.to_string(), msg: msg.into() }
    }
    pub(crate) fn shape(op: &str, lhs: &[usize], rhs: &[usize]) -> Self {
        Error::ShapeMismatch { op: op.to_string(), lhs: lhs.to_vec(), rhs: rhs.to_vec() }
    }
}
