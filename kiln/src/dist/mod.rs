//! Training across processes and machines: a rank-local process group
//! over the engines clusters already run (MPI, behind the `mpi` feature),
//! as PyTorch's `torch.distributed`.
//!
//! Start the same program once per device with a launcher — `mpirun -np 4
//! ./train`, `srun -n 8 ./train` — and call [`init`] in each process. It
//! reads what the launcher set (this process's rank, the job's size, its
//! rank on its machine), opens the engine that serves the launch, and gives
//! a [`Group`]: collectives over *this rank's* tensor ([`Group::all_reduce`],
//! [`Group::broadcast`], [`Group::reduce`], [`Group::all_gather`],
//! [`Group::reduce_scatter`], [`Group::barrier`], [`Group::send`],
//! [`Group::recv`]). Started without a launcher, [`init`] gives a world of
//! one, so the same program runs on a laptop. The
//! [`Trainer`](crate::trainer::Trainer) takes a group
//! ([`TrainerBuilder::process_group`](crate::trainer::TrainerBuilder::process_group))
//! and trains data-parallel across the processes.
//!
//! Failures are named, not hung: every collective carries a sequence
//! number and a fingerprint (call, reduction, dtype, element count, root)
//! that each rank sends to the others, and waits for every rank's before it
//! starts, so two ranks calling different collectives get an error naming
//! both calls instead of a wrong sum, and a rank that does not arrive
//! within the timeout (`KILN_DIST_TIMEOUT` seconds, 60 by default,
//! [`Group::set_timeout`]) is an error on every waiting rank naming the
//! silent rank and the collective. The group is then broken (every later
//! call fails at once) and the job is aborted (`MPI_Abort`) when the
//! process exits, so that the silent rank does not hang on.
//!
//! Tensors on the CPU and on simulated GPUs are staged through host memory;
//! the transfers are counted as every host read is. Calls block until this
//! rank's part is done and are not differentiable; the `*_async` calls
//! ([`Group::all_reduce_async`] and its siblings, PyTorch's
//! `async_op=True`) return a [`Work`] at once instead, to wait for later.
//!
//! ```
//! use kiln::comm::ReduceOp;
//! use kiln::{dist, Tensor};
//!
//! let group = dist::init()?; // a world of one when started without mpirun
//! let x = Tensor::new(&[1f32, 2.], &group.device())?;
//! let sum = group.all_reduce(&x, ReduceOp::Sum)?; // every rank's x, summed
//! if group.size() == 1 {
//!     assert_eq!(sum.to_vec::<f32>()?, vec![1., 2.]);
//! }
//! let all = group.all_gather(&x)?; // rank 0's x, then rank 1's, ...
//! assert_eq!(all.dims(), &[2 * group.size()]);
//! # Ok::<(), kiln::Error>(())
//! ```

mod engine;
mod in_process;
mod launch;
#[cfg(feature = "mpi")]
mod mpi;
mod nccl;
mod sampler;
mod wire;

pub use launch::{Launch, Launcher};
pub use sampler::DistributedSampler;

use crate::comm::ReduceOp;
use crate::runtime::ledger::site_scope;
use crate::{no_grad, DType, Device, Error, Result, Tensor};
use engine::{Engine, Open, Pending};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use wire::{dist_error, Call, CallKind, HostBuf, HostView, Payload};

/// The engines, in the order they are tried for a launch. A new engine is a
/// folder under `dist/` plus one line here.
const ENGINES: &[(&str, Open)] = &[
    ("nccl", nccl::open),
    #[cfg(feature = "mpi")]
    ("mpi", mpi::open),
    ("single", engine::open_single),
];

/// The default wait for the other ranks (`KILN_DIST_TIMEOUT`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest wait a group takes (a longer one is cut to it): a year, so
/// that a deadline never overflows the clock.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// What this rank's calls have moved and waited, since the group was made.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommStats {
    /// Calls made.
    pub calls: u64,
    /// Bytes of this rank's buffers handed to the engine.
    pub bytes: u64,
    /// Seconds spent inside calls (staging included).
    pub seconds: f64,
}

/// A group of processes: this process's rank in it, its size, the device it
/// computes on, and collectives over this rank's tensors. Cheap to clone
/// (the clones share one engine). Made by [`init`] or [`Group::single`].
#[derive(Clone)]
pub struct Group {
    engine: Arc<dyn Engine>,
    device: Device,
    local_rank: usize,
    stats: Arc<Mutex<CommStats>>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("engine", &self.engine.name())
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("device", &self.device)
            .finish()
    }
}

/// A collective started by one of the `*_async` calls of a [`Group`]
/// (PyTorch's `async_op=True` handle): the call runs on the engine in the
/// order the calls were made, while this thread goes on; [`Work::wait`]
/// gives the result. (On the `nccl` engine a call of device tensors has
/// already run when its `Work` is returned: each is waited for, so that a
/// dead rank is caught. On an in-process group the call returns once every
/// rank has arrived and the work is queued on the devices.) The input was copied when the call was made, so
/// writing it afterwards does not change the result. Dropping a `Work`
/// unwaited is allowed: the call still runs (the other ranks take part in
/// it), and its result is dropped.
///
/// ```
/// use kiln::{comm::ReduceOp, dist::Group, Tensor, cpu};
/// let g = Group::single(cpu());
/// let grads = [Tensor::new(&[1f32, 2.], &cpu())?, Tensor::new(&[3f32], &cpu())?];
/// // Start every bucket's all-reduce, then wait for them in order.
/// let works = grads.iter().map(|t| g.all_reduce_async(t, ReduceOp::Mean)).collect::<kiln::Result<Vec<_>>>()?;
/// let means = works.into_iter().map(|w| w.wait()).collect::<kiln::Result<Vec<_>>>()?;
/// assert_eq!(means[1].to_vec::<f32>()?, vec![3.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[must_use = "a collective's result is in its Work: call `wait()`"]
pub struct Work {
    pending: Box<dyn Pending>,
    op: &'static str,
    dtype: DType,
    dims: Vec<usize>,
    device: Device,
    divisor: Option<usize>,
    stats: Arc<Mutex<CommStats>>,
    /// The tensor the engine writes the result into, for a call started in
    /// place; `None`: the result comes back staged.
    into: Option<Tensor>,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("dtype", &self.dtype)
            .field("dims", &self.dims)
            .field("device", &self.device)
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl Work {
    /// Whether the collective is done on this rank ([`wait`](Self::wait)
    /// would return at once).
    pub fn is_completed(&self) -> bool {
        self.pending.is_done()
    }

    /// Waits for the collective and returns this rank's result, on the
    /// input's device with its dtype: the errors of the blocking call (a
    /// silent rank named within the timeout, a mismatched call naming both
    /// ranks' calls).
    pub fn wait(self) -> Result<Tensor> {
        let start = Instant::now();
        let out = self.pending.wait();
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).seconds += start.elapsed().as_secs_f64();
        let _g = no_grad();
        match self.into {
            // Written in place: a mean is divided there (a failed division
            // leaves the tensor poisoned, as `all_reduce_`).
            Some(t) => {
                out?;
                divide_in_place(&t, self.divisor)?;
                Ok(t)
            }
            None => out?.into_tensor(self.dtype, &self.dims, &self.device, self.divisor),
        }
    }
}

/// The launch this process is part of, read from the environment (see
/// [`Launcher`]); a variable that is set but not a rank is an error.
///
/// ```
/// let launch = kiln::dist::launch()?;
/// assert!(launch.rank < launch.size);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn launch() -> Result<Launch> {
    launch::detect(&|k| std::env::var(k).ok()).map_err(|msg| dist_error(0, 1, "dist::launch", msg))
}

/// The names of the engines compiled into this build, in the order they
/// are tried (`"nccl"`, `"mpi"` with the `mpi` feature, then `"single"`).
pub fn engines() -> Vec<&'static str> {
    ENGINES.iter().map(|(name, _)| *name).collect()
}

/// The process group of this launch, made by the first call and returned
/// by the next ones: under `mpirun`, `mpiexec` or `srun` the MPI engine
/// (feature `mpi`) over every rank of the job, started without a launcher a
/// world of one. The group's device is `gpu(local_rank)` when this machine
/// has that GPU, else the CPU.
///
/// Errors when a launcher started several processes but no engine of this
/// build serves it (each rank would otherwise train alone on all the data),
/// and when the engine fails to start.
pub fn init() -> Result<Group> {
    // The first call's error as it was (its variant, this rank and size), on every call.
    static WORLD: OnceLock<Result<Group>> = OnceLock::new();
    WORLD.get_or_init(open_world).clone()
}

fn timeout_from_env(op: &str) -> Result<Duration> {
    match std::env::var("KILN_DIST_TIMEOUT") {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>().ok().filter(|s| *s > 0.0).and_then(|s| Duration::try_from_secs_f64(s).ok()) {
            Some(d) => Ok(d.min(MAX_TIMEOUT)),
            None => Err(dist_error(0, 1, op, format!("KILN_DIST_TIMEOUT={v:?} is not a positive number of seconds"))),
        },
    }
}

fn open_world() -> Result<Group> {
    let launch = launch()?;
    let timeout = timeout_from_env("dist::init")?;
    for (_, open) in ENGINES {
        if let Some(engine) = open(&launch, timeout) {
            let engine: Arc<dyn Engine> = Arc::from(engine?);
            let device = if launch.local_rank < crate::num_gpus() { Device::Gpu(launch.local_rank) } else { Device::Cpu };
            return Ok(Group { engine, device, local_rank: launch.local_rank, stats: Arc::default() });
        }
    }
    let why = if launch.launcher.is_mpi() {
        format!(
            "this process is {launch}, but this build of kiln has no MPI engine: rebuild with `--features mpi` \
             (e.g. `cargo build --release --features mpi`, with Open MPI or MPICH installed); \
             otherwise every rank would train alone on all the data"
        )
    } else {
        let why = nccl::describe(&launch).err().unwrap_or_else(|| "NCCL did not start".into());
        format!(
            "this process is {launch}: torchrun-style launches need NCCL across processes on this rank's CUDA device, and \
             {why}; launch with mpirun or srun and build with `--features mpi` (which also moves CPU tensors)"
        )
    };
    Err(dist_error(launch.rank, launch.size, "dist::init", why))
}

/// What `kiln devices` says about distributed support: the engines compiled
/// in, and what [`init`] would do in this process.
pub fn describe() -> String {
    let engines = engines().join(", ");
    let this = match launch() {
        Ok(l) if l.size > 1 => match (nccl::describe(&l), ENGINES.iter().find(|(name, _)| !matches!(*name, "single" | "nccl"))) {
            // Under an MPI launcher NCCL's id travels over MPI: without it, no NCCL.
            (Ok(nccl), _) if !l.launcher.is_mpi() || cfg!(feature = "mpi") => format!("{l}: engine nccl ({nccl}) if every rank has one"),
            (Ok(_), None) => format!("{l}: no engine in this build for it (rebuild with `--features mpi`)"),
            (Ok(_), Some((name, _))) => format!("{l}: engine {name}"),
            (Err(_), Some((name, _))) => format!("{l}: engine {name}"),
            (Err(why), None) => format!("{l}: no engine in this build for it ({why}; rebuild with `--features mpi`)"),
        },
        Ok(l) => format!("{l}"),
        Err(e) => e.to_string(),
    };
    let compiled = if cfg!(feature = "mpi") { "MPI compiled in" } else { "no MPI (build with `--features mpi`)" };
    format!("{compiled}; engines: {engines}; this process: {this}")
}

impl Group {
    /// A world of one on `device`: every collective returns this rank's own
    /// tensor (what PyTorch's give with one process).
    ///
    /// ```
    /// use kiln::{dist::Group, comm::ReduceOp, Tensor, cpu};
    /// let g = Group::single(cpu());
    /// assert_eq!((g.rank(), g.size(), g.engine()), (0, 1, "single"));
    /// let x = Tensor::new(&[3i64, 4], &cpu())?;
    /// assert_eq!(g.all_reduce(&x, ReduceOp::Max)?.to_vec::<i64>()?, vec![3, 4]);
    /// assert!(g.send(&x, 1).is_err()); // no rank 1
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn single(device: Device) -> Group {
        Group { engine: Arc::new(engine::Single), device, local_rank: 0, stats: Arc::default() }
    }

    /// A group whose ranks are threads of this process, rank r computing on
    /// `devices[r]`: one [`Group`] per device, each to be used from a thread
    /// of its own, as a process of a launch uses its group. Code written for
    /// one process per device — a [`Trainer`](crate::trainer::Trainer) with
    /// [`process_group`](crate::trainer::TrainerBuilder::process_group), a
    /// loop of `all_reduce_` calls — then runs with one thread per device.
    ///
    /// Each rank's tensor is moved to its device; the last rank to arrive
    /// at a collective runs it once over every rank's tensor as
    /// [`crate::comm`] does (the simulated GPUs' ring, NCCL within one
    /// process, or peer copies: the same bytes and results), booked in the
    /// ledger at that rank's call. A rank that does not arrive within the
    /// timeout (`KILN_DIST_TIMEOUT`, [`Group::set_timeout`]: one for the
    /// whole group), or whose every handle is dropped (its thread ended or
    /// panicked), is named in an error on every waiting rank, and the group
    /// breaks; ranks that call different collectives get an error naming
    /// both calls. Errors when `devices` is empty or names a device twice.
    ///
    /// ```
    /// use kiln::{comm::ReduceOp, dist::Group, Tensor};
    /// let gpus = kiln::ensure_simulated_gpus(2, 64 << 20);
    /// let groups = Group::in_process(&gpus)?;
    /// let sums = std::thread::scope(|s| {
    ///     let handles: Vec<_> = groups
    ///         .into_iter()
    ///         .map(|g| {
    ///             s.spawn(move || -> kiln::Result<Vec<f32>> {
    ///                 let x = Tensor::new(&[g.rank() as f32 + 1.0], &g.device())?;
    ///                 g.all_reduce_(&x, ReduceOp::Sum)?; // every rank's x, summed
    ///                 x.to_vec::<f32>()
    ///             })
    ///         })
    ///         .collect();
    ///     handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect::<kiln::Result<Vec<_>>>()
    /// })?;
    /// assert_eq!(sums, vec![vec![3.0], vec![3.0]]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn in_process(devices: &[Device]) -> Result<Vec<Group>> {
        let engines = in_process::open(devices, timeout_from_env("Group::in_process")?)?;
        Ok(engines
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (engine, &device))| Group { engine, device, local_rank: rank, stats: Arc::default() })
            .collect())
    }

    /// This process's rank, 0 to `size() - 1`.
    pub fn rank(&self) -> usize {
        self.engine.rank()
    }

    /// The number of processes.
    pub fn size(&self) -> usize {
        self.engine.size()
    }

    /// This process's rank among the processes of its machine.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Whether this is rank 0, the one that writes checkpoints and logs.
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    /// The device this process computes on: `gpu(local_rank)` when this
    /// machine has it, else the CPU.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The engine's name (`"nccl"`, `"mpi"`, `"single"`, `"in-process"`).
    pub fn engine(&self) -> &'static str {
        self.engine.name()
    }

    /// How long a call waits for the other ranks before it is an error.
    pub fn timeout(&self) -> Duration {
        self.engine.timeout()
    }

    /// Sets that wait for every clone of this group (zero is refused; one
    /// past [`MAX_TIMEOUT`] is cut to it).
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        if timeout.is_zero() {
            return Err(self.error("set_timeout", "the timeout must be longer than zero"));
        }
        self.engine.set_timeout(timeout.min(MAX_TIMEOUT));
        Ok(())
    }

    /// What this rank's calls have moved and waited so far.
    pub fn stats(&self) -> CommStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn error(&self, op: &str, msg: impl Into<String>) -> Error {
        dist_error(self.rank(), self.size(), op, msg)
    }

    fn check_rank(&self, op: &str, what: &str, r: usize) -> Result<()> {
        if r >= self.size() {
            return Err(self.error(op, format!("{what} {r} is not a rank of this group of {} (0 to {})", self.size(), self.size() - 1)));
        }
        Ok(())
    }

    /// Books one call of `bytes` that started at `start` in the stats.
    fn book(&self, bytes: u64, start: Instant) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.calls += 1;
        s.bytes += bytes;
        s.seconds += start.elapsed().as_secs_f64();
    }

    fn run(&self, kind: CallKind, data: Payload) -> Result<HostBuf> {
        let start = Instant::now();
        let bytes = data.bytes() as u64;
        let out = self.engine.run(Call { kind, data });
        self.book(bytes, start);
        out
    }

    /// `t`'s elements for `kind`: the tensor's own memory, read where it
    /// is, for a call that only reads its buffer (all-reduce, all-gather,
    /// reduce-scatter) on a contiguous CPU tensor of a type that travels as
    /// itself when there are other ranks; else a staged copy (a counted
    /// transfer from a GPU), which a broadcast or reduce may write.
    fn payload(&self, kind: CallKind, t: &Tensor) -> Result<Payload> {
        let reads_only = match kind {
            CallKind::AllReduce(_) | CallKind::AllGather | CallKind::ReduceScatter(_) => true,
            CallKind::Broadcast { .. } | CallKind::Reduce { .. } | CallKind::Barrier | CallKind::Send { .. } | CallKind::Recv { .. } => {
                false
            }
        };
        match HostView::of(t, false).filter(|_| reads_only && self.size() > 1) {
            Some(view) => Ok(Payload::InPlace(view)),
            None => Ok(Payload::Staged(HostBuf::of(t)?)),
        }
    }

    /// What divides this rank's result of `kind`: the size, for a mean this
    /// rank receives (a reduce's root only); `None` otherwise.
    fn mean_divisor(&self, kind: CallKind) -> Option<usize> {
        let mean = match kind {
            CallKind::AllReduce(op) | CallKind::ReduceScatter(op) => op == ReduceOp::Mean,
            CallKind::Reduce { root, op } => op == ReduceOp::Mean && root == self.rank(),
            CallKind::Broadcast { .. } | CallKind::AllGather | CallKind::Barrier | CallKind::Send { .. } | CallKind::Recv { .. } => false,
        };
        (mean && self.size() > 1).then_some(self.size())
    }

    /// Runs `kind` on `t`'s elements and makes a tensor of `dims` on `t`'s
    /// device from the result (a mean divided before it takes `t`'s dtype,
    /// so f16 and bf16 are rounded once).
    fn collective(&self, kind: CallKind, t: &Tensor, dims: &[usize]) -> Result<Tensor> {
        let _g = no_grad();
        if let Some(out) = self.on_device(kind, t, dims, None) {
            return out;
        }
        let out = self.run(kind, self.payload(kind, t)?)?;
        out.into_tensor(t.dtype(), dims, &t.device(), self.mean_divisor(kind))
    }

    /// Starts `kind` on a copy of `t`'s elements and returns at once; the
    /// [`Work`] makes a tensor of `dims` on `t`'s device from the result.
    fn collective_async(&self, kind: CallKind, t: &Tensor, dims: &[usize]) -> Result<Work> {
        let _g = no_grad();
        if let Some(out) = self.on_device(kind, t, dims, None) {
            return Ok(self.done_work(kind, out?, t));
        }
        self.submit(kind, Payload::Staged(HostBuf::of(t)?), t, dims, None)
    }

    /// `kind` on `t` on its device through the engine, booked as a call,
    /// when the engine runs it there (see [`Engine::on_device`]): the
    /// result, a mean divided (written into `into` when given).
    fn on_device(&self, kind: CallKind, t: &Tensor, dims: &[usize], into: Option<&Tensor>) -> Option<Result<Tensor>> {
        let start = Instant::now();
        let out = self.engine.on_device(kind, t, dims, into, self.mean_divisor(kind))?;
        self.book((t.elem_count() * t.dtype().size_in_bytes()) as u64, start);
        Some(out)
    }

    /// The [`Work`] of a call already done on the device: `out`.
    fn done_work(&self, kind: CallKind, out: Tensor, t: &Tensor) -> Work {
        Work {
            pending: Box::new(engine::Done(Ok(HostBuf::U8(Vec::new())))),
            op: kind.name(),
            dtype: t.dtype(),
            dims: out.dims().to_vec(),
            device: t.device(),
            divisor: None,
            stats: self.stats.clone(),
            into: Some(out),
        }
    }

    /// [`all_reduce_`](Self::all_reduce_), started: the engine writes the
    /// result into `t`'s own memory when `t` is a contiguous CPU tensor of a
    /// type that travels as itself and there are other ranks (no copy;
    /// `wait` returns `t`), else (a world of one too) the call works on a
    /// staged copy and `wait` returns the result as a new tensor. For
    /// kiln's own buffers (the Trainer's gradient buckets): `t` must be
    /// neither read nor written until the wait, which is why this is not
    /// public.
    pub(crate) fn all_reduce_async_in_place(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        self.check_mean("all_reduce_async_in_place", t, op)?;
        let _g = no_grad();
        let kind = CallKind::AllReduce(op);
        if let Some(out) = self.on_device(kind, t, t.dims(), Some(t)) {
            return Ok(self.done_work(kind, out?, t));
        }
        match HostView::of(t, true).filter(|_| self.size() > 1) {
            Some(view) => self.submit(kind, Payload::InPlace(view), t, t.dims(), Some(t.clone())),
            None => self.submit(kind, Payload::Staged(HostBuf::of(t)?), t, t.dims(), None),
        }
    }

    /// Hands `data` over as `kind` and returns the [`Work`] of its result
    /// (a tensor like `t` of `dims`, or `into` written in place).
    fn submit(&self, kind: CallKind, data: Payload, t: &Tensor, dims: &[usize], into: Option<Tensor>) -> Result<Work> {
        // Booked as `run` books a call: a refused one counts too, and the
        // staging copy is not the call's time.
        let start = Instant::now();
        let bytes = data.bytes() as u64;
        let submitted = self.engine.submit(Call { kind, data });
        self.book(bytes, start);
        let pending = submitted?;
        Ok(Work {
            pending,
            op: kind.name(),
            dtype: t.dtype(),
            dims: dims.to_vec(),
            device: t.device(),
            divisor: self.mean_divisor(kind),
            stats: self.stats.clone(),
            into,
        })
    }

    /// Runs `kind` and writes its result into `t`: in `t`'s own memory when
    /// it is a contiguous CPU tensor of a type that travels as itself (the
    /// engine works there under the storage's write lock), else through a
    /// staged copy and [`Tensor::assign`]. A mean's division that fails
    /// after the sum was written leaves `t` poisoned.
    fn collective_into(&self, kind: CallKind, t: &Tensor) -> Result<()> {
        let _g = no_grad();
        let divisor = self.mean_divisor(kind);
        if let Some(out) = self.on_device(kind, t, t.dims(), Some(t)) {
            return out.map(drop);
        }
        if let Some(view) = HostView::of(t, true) {
            self.run(kind, Payload::InPlace(view))?;
            return divide_in_place(t, divisor);
        }
        let out = self.run(kind, Payload::Staged(HostBuf::of(t)?))?;
        t.assign(&out.into_tensor(t.dtype(), t.dims(), &t.device(), divisor)?)
    }

    fn check_mean(&self, op: &str, t: &Tensor, reduce: ReduceOp) -> Result<()> {
        if reduce == ReduceOp::Mean && !t.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: format!("{op}(Mean)"), dtype: t.dtype() });
        }
        Ok(())
    }

    /// Every rank's `t` combined by `op`, on every rank (on `t`'s device).
    /// All ranks pass tensors of one dtype and element count.
    ///
    /// ```
    /// use kiln::{comm::ReduceOp, dist::Group, Tensor, cpu};
    /// let g = Group::single(cpu());
    /// let x = Tensor::new(&[1f32, 2.], &cpu())?;
    /// assert_eq!(g.all_reduce(&x, ReduceOp::Mean)?.to_vec::<f32>()?, vec![1., 2.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_mean("all_reduce", t, op)?;
        self.collective(CallKind::AllReduce(op), t, t.dims())
    }

    /// [`all_reduce`](Self::all_reduce) in place, as PyTorch's
    /// `dist.all_reduce(t)`: every rank's `t` is overwritten with the
    /// combination (every view of its storage sees it). A contiguous CPU
    /// tensor of f32, f64, i32, i64 or u8 is reduced where it is, with no
    /// copy; any other goes through a staged copy. A broadcast view (whose
    /// elements share memory) is refused, as by [`Tensor::assign`].
    ///
    /// When the call fails after the engine started writing (MPI failed
    /// mid-call, or did not return), `t`'s contents are not trustworthy:
    /// reading `t` then returns the error.
    ///
    /// ```
    /// use kiln::{comm::ReduceOp, dist::Group, Tensor, cpu};
    /// let g = Group::single(cpu());
    /// let grads = Tensor::new(&[1f32, 2.], &cpu())?;
    /// g.all_reduce_(&grads, ReduceOp::Mean)?; // averaged across the ranks
    /// assert_eq!(grads.to_vec::<f32>()?, vec![1., 2.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn all_reduce_(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_mean("all_reduce_", t, op)?;
        self.check_writable("all_reduce_", t)?;
        if self.size() == 1 {
            return Ok(());
        }
        self.collective_into(CallKind::AllReduce(op), t)
    }

    /// [`broadcast`](Self::broadcast) in place, as PyTorch's
    /// `dist.broadcast(t, root)`: every rank's `t` is overwritten with
    /// `root`'s (in `t`'s own memory when it is a contiguous CPU tensor of
    /// a type that travels as itself). The contents are not trustworthy
    /// after a failure, as for [`all_reduce_`](Self::all_reduce_).
    ///
    /// ```
    /// use kiln::{dist::Group, Tensor, cpu};
    /// let g = Group::single(cpu());
    /// let w = Tensor::new(&[0.5f32, -1.], &cpu())?;
    /// g.broadcast_(&w, 0)?; // rank 0's weights on every rank
    /// assert_eq!(w.to_vec::<f32>()?, vec![0.5, -1.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn broadcast_(&self, t: &Tensor, root: usize) -> Result<()> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_rank("broadcast_", "root", root)?;
        self.check_writable("broadcast_", t)?;
        if self.size() == 1 {
            return Ok(());
        }
        self.collective_into(CallKind::Broadcast { root }, t)
    }

    /// Refuses, as [`Tensor::assign`] does, a destination whose elements
    /// share memory (so a world of one refuses what a larger one would).
    fn check_writable(&self, op: &str, t: &Tensor) -> Result<()> {
        if t.layout.has_internal_overlap() {
            return Err(self.error(
                op,
                format!(
                    "the tensor of shape {} is a broadcast view whose elements share memory; pass the tensor it was broadcast from, or `t.contiguous()?`",
                    t.shape()
                ),
            ));
        }
        Ok(())
    }

    /// `root`'s `t` on every rank; the others' `t` gives the dtype and shape
    /// (the same as root's).
    #[track_caller]
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_rank("broadcast", "root", root)?;
        self.collective(CallKind::Broadcast { root }, t, t.dims())
    }

    /// Every rank's `t` combined by `op` on `root`; the other ranks get
    /// their own `t` back.
    #[track_caller]
    pub fn reduce(&self, t: &Tensor, root: usize, op: ReduceOp) -> Result<Tensor> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_rank("reduce", "root", root)?;
        self.check_mean("reduce", t, op)?;
        self.collective(CallKind::Reduce { root, op }, t, t.dims())
    }

    /// Every rank's `t`, concatenated along dimension 0 in rank order
    /// (PyTorch's `all_gather_into_tensor`); a scalar gives a vector of
    /// `size()` elements.
    #[track_caller]
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let _site = site_scope(std::panic::Location::caller());
        self.collective(CallKind::AllGather, t, &self.gathered_dims(t))
    }

    fn gathered_dims(&self, t: &Tensor) -> Vec<usize> {
        let mut dims = t.dims().to_vec();
        match dims.first_mut() {
            Some(d0) => *d0 *= self.size(),
            None => dims.push(self.size()),
        }
        dims
    }

    /// `t` cut along dimension 0 into `size()` equal pieces; rank r gets
    /// piece r combined by `op` across ranks (PyTorch's
    /// `reduce_scatter_tensor`). Dimension 0 must divide by `size()`.
    #[track_caller]
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let _site = site_scope(std::panic::Location::caller());
        let dims = self.scattered_dims("reduce_scatter", t, op)?;
        self.collective(CallKind::ReduceScatter(op), t, &dims)
    }

    fn scattered_dims(&self, call: &str, t: &Tensor, op: ReduceOp) -> Result<Vec<usize>> {
        self.check_mean(call, t, op)?;
        let mut dims = t.dims().to_vec();
        let n = self.size();
        match dims.first_mut() {
            Some(d0) if *d0 % n == 0 => *d0 /= n,
            _ => {
                return Err(self.error(call, format!("dimension 0 of shape {:?} must be a multiple of the group's size {n}", t.dims())));
            }
        }
        Ok(dims)
    }

    /// [`all_reduce`](Self::all_reduce), started: returns at once with a
    /// [`Work`] whose [`wait`](Work::wait) gives the result. `t` is copied
    /// at the call (a CPU tensor too), so it may be written meanwhile.
    #[track_caller]
    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_mean("all_reduce_async", t, op)?;
        self.collective_async(CallKind::AllReduce(op), t, t.dims())
    }

    /// [`broadcast`](Self::broadcast), started (see
    /// [`all_reduce_async`](Self::all_reduce_async)).
    #[track_caller]
    pub fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Work> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_rank("broadcast_async", "root", root)?;
        self.collective_async(CallKind::Broadcast { root }, t, t.dims())
    }

    /// [`reduce`](Self::reduce), started (see
    /// [`all_reduce_async`](Self::all_reduce_async)).
    #[track_caller]
    pub fn reduce_async(&self, t: &Tensor, root: usize, op: ReduceOp) -> Result<Work> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_rank("reduce_async", "root", root)?;
        self.check_mean("reduce_async", t, op)?;
        self.collective_async(CallKind::Reduce { root, op }, t, t.dims())
    }

    /// [`all_gather`](Self::all_gather), started (see
    /// [`all_reduce_async`](Self::all_reduce_async)).
    #[track_caller]
    pub fn all_gather_async(&self, t: &Tensor) -> Result<Work> {
        let _site = site_scope(std::panic::Location::caller());
        self.collective_async(CallKind::AllGather, t, &self.gathered_dims(t))
    }

    /// [`reduce_scatter`](Self::reduce_scatter), started (see
    /// [`all_reduce_async`](Self::all_reduce_async)).
    #[track_caller]
    pub fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        let _site = site_scope(std::panic::Location::caller());
        let dims = self.scattered_dims("reduce_scatter_async", t, op)?;
        self.collective_async(CallKind::ReduceScatter(op), t, &dims)
    }

    /// Returns when every rank has called it.
    #[track_caller]
    pub fn barrier(&self) -> Result<()> {
        let _site = site_scope(std::panic::Location::caller());
        self.run(CallKind::Barrier, Payload::Staged(HostBuf::U8(Vec::new()))).map(drop)
    }

    /// Sends `t` to rank `dst`, which calls [`Group::recv`] with its shape
    /// and dtype.
    #[track_caller]
    pub fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_rank("send", "destination", dst)?;
        if dst == self.rank() {
            return Err(self.error("send", "a rank cannot send to itself"));
        }
        let _g = no_grad();
        self.run(CallKind::Send { peer: dst }, Payload::Staged(HostBuf::of(t)?)).map(drop)
    }

    /// A tensor of `dims` and `dtype` on this group's device, received from
    /// rank `src`'s [`Group::send`].
    #[track_caller]
    pub fn recv(&self, dims: &[usize], dtype: DType, src: usize) -> Result<Tensor> {
        let _site = site_scope(std::panic::Location::caller());
        self.check_rank("recv", "source", src)?;
        if src == self.rank() {
            return Err(self.error("recv", "a rank cannot receive from itself"));
        }
        let len = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| self.error("recv", format!("shape {dims:?} overflows")))?;
        let out = self.run(CallKind::Recv { peer: src }, Payload::Staged(HostBuf::zeros(dtype, len)))?;
        out.into_tensor(dtype, dims, &self.device, None)
    }
}

/// Divides `t`, which a collective wrote in place, by `divisor` (a mean),
/// in place; a failed division leaves `t` poisoned, since it then holds the
/// sum and not the mean.
pub(crate) fn divide_in_place(t: &Tensor, divisor: Option<usize>) -> Result<()> {
    if let Some(n) = divisor
        && let Err(e) = t.div_scalar(n as f64).and_then(|m| t.assign(&m))
    {
        t.storage.poison(&e);
        return Err(e);
    }
    Ok(())
}
