//! Communicators across processes (`ncclGetUniqueId` + `ncclCommInitRank`):
//! the processes of one machine meet through files in a directory that the
//! unique id names, as NCCL's ranks meet through its bootstrap.
//!
//! - **The id** names a directory under `KILN_CUDASIM_NCCL_DIR` (default
//!   `/dev/shm`, else the temporary directory). With `NCCL_COMM_ID` set,
//!   every process's `ncclGetUniqueId` gives the same id (from that
//!   address), as NCCL's does; else each call gives a new one, which rank 0
//!   hands to the others (over MPI, say).
//! - **Joining**: each rank writes `join.<rank>` (its pid) and waits until
//!   every rank's file names a live process, within the timeout. The
//!   collectives of this communicator then live in a folder named after
//!   rank 0's pid, so files a dead earlier run left behind are never read.
//! - **A collective** (the k-th of the communicator): when its stream gets
//!   there, each rank writes its call and its send buffer to `<k>.<rank>`
//!   (written aside, then renamed, so a reader sees all of it or nothing),
//!   waits for every rank's file, checks that the calls agree, computes its
//!   own result from all the inputs (reductions in rank order, so every
//!   rank gets the same bits) and writes it to its receive buffer. A rank
//!   removes its file of collective k - 1 once every rank's file of k is
//!   there (every rank has read k - 1 by then).
//! - **Failures**: a rank whose context faulted writes a file saying so, and
//!   the others fail at once; a rank that exits, or does not arrive within
//!   `KILN_CUDASIM_NCCL_TIMEOUT` seconds, fails the others naming it, and
//!   so does `ncclCommAbort` on a rank that is waiting.

use super::run::{combine, divide, timeout};
use super::{Call, Kind, RedOp, Ty};
use crate::{check_range, Sim};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The bytes of an `ncclUniqueId`.
pub(super) const ID_BYTES: usize = 128;
const MAGIC: &str = "kiln-cudasim-nccl:";

/// The processes of one communicator, from this rank's side.
pub(crate) struct World {
    /// Where this communicator's collectives meet.
    dir: PathBuf,
    /// Where the ranks joined.
    root: PathBuf,
    pub(super) size: usize,
    pub(super) rank: usize,
    /// Each rank's pid, to name a rank that exited.
    pids: Vec<u32>,
    /// Set by `ncclCommAbort`: a waiting collective gives up.
    pub(super) aborted: AtomicBool,
    /// The collective whose file this rank still has to remove.
    last: AtomicU64,
}

/// A new unique id, or the one `NCCL_COMM_ID` names.
pub(super) fn unique_id() -> [u8; ID_BYTES] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let token = match std::env::var("NCCL_COMM_ID") {
        Ok(addr) if !addr.trim().is_empty() => format!("addr-{}", sanitize(addr.trim())),
        _ => {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
            format!("{}-{nanos}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
        }
    };
    let mut id = [0u8; ID_BYTES];
    let text = format!("{MAGIC}{token}");
    let n = text.len().min(ID_BYTES - 1);
    id[..n].copy_from_slice(&text.as_bytes()[..n]);
    id
}

fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect()
}

fn base_dir() -> PathBuf {
    if let Ok(d) = std::env::var("KILN_CUDASIM_NCCL_DIR") {
        return PathBuf::from(d);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists()
}

/// Polls `ready` until it gives a value, a rank exits (its pid is gone),
/// `stop` is set, or the timeout passes.
fn poll<T>(
    what: &str,
    pids: &[u32],
    stop: &AtomicBool,
    missing: impl Fn() -> String,
    mut ready: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, String> {
    let deadline = Instant::now() + timeout();
    let mut pause = Duration::from_micros(20);
    loop {
        if let Some(v) = ready()? {
            return Ok(v);
        }
        if stop.load(Ordering::SeqCst) {
            return Err(format!("{what}: the communicator was aborted (ncclCommAbort)"));
        }
        if let Some((r, pid)) = pids.iter().enumerate().find(|&(_, &p)| p != 0 && !alive(p)) {
            return Err(format!("{what}: rank {r} (pid {pid}) exited; remote process exited"));
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{what}: {} did not arrive within {} s (KILN_CUDASIM_NCCL_TIMEOUT); on a GPU this hangs",
                missing(),
                timeout().as_secs()
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(2));
    }
}

/// Writes `data` to `path` so that a reader sees all of it or no file.
fn publish(path: &Path, data: &[u8]) -> Result<(), String> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data).and_then(|()| std::fs::rename(&tmp, path)).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

impl World {
    /// Joins the communicator the id names as `rank` of `size`.
    /// `stop` set (by `ncclCommAbort` of a communicator still being made)
    /// ends the wait for the others.
    pub(super) fn join(id: &[u8; ID_BYTES], size: usize, rank: usize, stop: &AtomicBool) -> Result<World, String> {
        let end = id.iter().position(|&b| b == 0).unwrap_or(ID_BYTES);
        let text = std::str::from_utf8(&id[..end]).map_err(|_| "ncclCommInitRank: the unique id is not one of cudasim's".to_string())?;
        let token = text.strip_prefix(MAGIC).ok_or_else(|| {
            "ncclCommInitRank: the unique id is not one of cudasim's (was it made by ncclGetUniqueId of this library?)".to_string()
        })?;
        let root = base_dir().join(format!("kiln-cudasim-nccl-{}", sanitize(token)));
        std::fs::create_dir_all(&root).map_err(|e| format!("ncclCommInitRank: cannot create {}: {e}", root.display()))?;
        let me = std::process::id();
        publish(&root.join(format!("join.{rank}")), me.to_string().as_bytes())?;
        let what = format!("ncclCommInitRank (rank {rank} of {size})");
        let missing = || {
            let gone: Vec<usize> = (0..size).filter(|r| !root.join(format!("join.{r}")).exists()).collect();
            format!("ranks {gone:?}")
        };
        let joined = poll(&what, &[], stop, missing, || {
            let mut pids = Vec::with_capacity(size);
            for r in 0..size {
                let Ok(text) = std::fs::read_to_string(root.join(format!("join.{r}"))) else { return Ok(None) };
                match text.trim().parse::<u32>() {
                    // A file a dead process left: wait for the live rank's.
                    Ok(pid) if alive(pid) => pids.push(pid),
                    _ => return Ok(None),
                }
            }
            Ok(Some(pids))
        });
        let pids = match joined {
            Ok(pids) => pids,
            Err(e) => {
                // Given up: a late rank must not find this one waiting.
                let mine = root.join(format!("join.{rank}"));
                if std::fs::read_to_string(&mine).is_ok_and(|t| t.trim() == me.to_string()) {
                    let _ = std::fs::remove_file(&mine);
                }
                let _ = std::fs::remove_dir(&root);
                return Err(e);
            }
        };
        let dir = root.join(format!("run-{}", pids[0]));
        std::fs::create_dir_all(&dir).map_err(|e| format!("ncclCommInitRank: cannot create {}: {e}", dir.display()))?;
        Ok(World { dir, root, size, rank, pids, aborted: AtomicBool::new(false), last: AtomicU64::new(u64::MAX) })
    }

    fn file(&self, seq: u64, rank: usize) -> PathBuf {
        self.dir.join(format!("{seq}.{rank}"))
    }

    /// This rank's part of collective `seq` (`None`: its context faulted
    /// first): publishes its call and input, waits for the others', and
    /// writes its result.
    pub(super) fn meet(&self, sim: &Sim, dev: usize, seq: u64, part: Option<(Call, u64, u64)>) -> Result<(), String> {
        let n = self.size;
        let name = part.map(|p| p.0.kind.name()).unwrap_or("a collective");
        let what = format!("NCCL collective #{seq} ({name}) on rank {} of {n} (device {dev}, pid {})", self.rank, std::process::id());
        let mut mine = Vec::new();
        match part {
            Some((call, send, _)) => {
                mine.extend(encode(call));
                let len = send_len(call, n);
                if reads(call, self.rank) && len > 0 {
                    check_range(sim, dev, send, len, &format!("{name} rank {} send buffer", self.rank))
                        .map_err(|e| format!("{what}: {e}"))?;
                    // SAFETY: checked live device memory of this rank's device;
                    // this rank's stream is parked here.
                    mine.extend_from_slice(unsafe { std::slice::from_raw_parts(send as *const u8, len) });
                }
            }
            None => mine.push(FAULTED),
        }
        publish(&self.file(seq, self.rank), &mine).map_err(|e| format!("{what}: {e}"))?;
        let missing = || {
            let gone: Vec<usize> = (0..n).filter(|&r| !self.file(seq, r).exists()).collect();
            format!("ranks {gone:?}")
        };
        let inputs = poll(&what, &self.pids, &self.aborted, missing, || {
            let mut all = Vec::with_capacity(n);
            for r in 0..n {
                match std::fs::read(self.file(seq, r)) {
                    Ok(bytes) => all.push(bytes),
                    Err(_) => return Ok(None),
                }
            }
            Ok(Some(all))
        })?;
        // Every rank has published `seq`, so each has read `seq - 1`.
        let prev = self.last.swap(seq, Ordering::SeqCst);
        if prev != u64::MAX {
            let _ = std::fs::remove_file(self.file(prev, self.rank));
        }
        let Some((call, _, recv)) = part else { return Ok(()) };
        let mut calls = Vec::with_capacity(n);
        for (r, bytes) in inputs.iter().enumerate() {
            if bytes.first() == Some(&FAULTED) {
                return Err(format!("{what}: rank {r}'s device faulted before it; nothing was moved"));
            }
            let c = decode(bytes).ok_or_else(|| format!("{what}: rank {r}'s part is unreadable"))?;
            if c != call {
                return Err(format!(
                    "{what}: the ranks called different collectives: rank {} {call:?}, rank {r} {c:?}; on a GPU this hangs or corrupts memory",
                    self.rank
                ));
            }
            calls.push(&bytes[HEADER..]);
        }
        let Some(out) = result(call, &calls, self.rank) else { return Ok(()) };
        check_range(sim, dev, recv, out.len(), &format!("{name} rank {} receive buffer", self.rank)).map_err(|e| format!("{what}: {e}"))?;
        // SAFETY: checked live device memory; this rank's stream is parked here.
        unsafe { std::ptr::copy(out.as_ptr(), recv as *mut u8, out.len()) };
        Ok(())
    }

    /// Removes this rank's files (at `ncclCommDestroy`). An aborted
    /// communicator keeps its last collective's file: a rank still on its
    /// way there reads it (a mismatch is then found there too).
    pub(super) fn leave(&self) {
        let last = self.last.load(Ordering::SeqCst);
        if last != u64::MAX && !self.aborted.load(Ordering::SeqCst) {
            let _ = std::fs::remove_file(self.file(last, self.rank));
        }
        let _ = std::fs::remove_file(self.root.join(format!("join.{}", self.rank)));
        // The last to leave removes the folders (fails while others remain).
        let _ = std::fs::remove_dir(&self.dir);
        let _ = std::fs::remove_dir(&self.root);
    }
}

const FAULTED: u8 = 0xFF;
/// kind, type, op, root (u32), count (u64).
const HEADER: usize = 1 + 1 + 1 + 4 + 8;

fn encode(c: Call) -> Vec<u8> {
    let kind = c.kind as u8;
    let ty = c.ty as u8;
    let op = c.op.map(|o| o as u8).unwrap_or(0xFE);
    let mut v = vec![kind, ty, op];
    v.extend_from_slice(&(c.root as u32).to_le_bytes());
    v.extend_from_slice(&(c.count as u64).to_le_bytes());
    v
}

fn decode(b: &[u8]) -> Option<Call> {
    if b.len() < HEADER {
        return None;
    }
    let kind =
        [Kind::AllReduce, Kind::Broadcast, Kind::Reduce, Kind::AllGather, Kind::ReduceScatter].into_iter().find(|k| *k as u8 == b[0])?;
    let ty =
        [Ty::I8, Ty::U8, Ty::I32, Ty::U32, Ty::I64, Ty::U64, Ty::F16, Ty::F32, Ty::F64, Ty::BF16].into_iter().find(|t| *t as u8 == b[1])?;
    let op = if b[2] == 0xFE {
        None
    } else {
        Some([RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg].into_iter().find(|o| *o as u8 == b[2])?)
    };
    let root = u32::from_le_bytes(b[3..7].try_into().ok()?) as usize;
    let count = u64::from_le_bytes(b[7..15].try_into().ok()?) as usize;
    Some(Call { kind, count, ty, op, root })
}

fn reads(c: Call, rank: usize) -> bool {
    !(c.kind == Kind::Broadcast && rank != c.root)
}

fn send_len(c: Call, n: usize) -> usize {
    let bytes = c.count * c.ty.size();
    match c.kind {
        Kind::AllReduce | Kind::Broadcast | Kind::Reduce | Kind::AllGather => bytes,
        Kind::ReduceScatter => n * bytes,
    }
}

/// `rank`'s result of `c` from every rank's input, or `None` when it
/// receives nothing (a reduce's other ranks).
fn result(c: Call, inputs: &[&[u8]], rank: usize) -> Option<Vec<u8>> {
    let n = inputs.len();
    let bytes = c.count * c.ty.size();
    let reduce_all = || {
        let op = c.op.unwrap_or(RedOp::Sum);
        let mut acc = inputs[0].to_vec();
        for x in &inputs[1..] {
            combine(c.ty, op, &mut acc, x);
        }
        if op == RedOp::Avg {
            divide(c.ty, &mut acc, n);
        }
        acc
    };
    match c.kind {
        Kind::AllReduce => Some(reduce_all()),
        Kind::Reduce => (rank == c.root).then(reduce_all),
        Kind::Broadcast => Some(inputs[c.root].to_vec()),
        Kind::AllGather => Some(inputs.concat()),
        Kind::ReduceScatter => Some(reduce_all()[rank * bytes..(rank + 1) * bytes].to_vec()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_survive_their_encoding_and_results_follow_each_kind() {
        let c = Call { kind: Kind::ReduceScatter, count: 2, ty: Ty::F32, op: Some(RedOp::Sum), root: 0 };
        assert_eq!(decode(&encode(c)), Some(c));
        let b = Call { kind: Kind::Broadcast, count: 1, ty: Ty::U8, op: None, root: 1 };
        assert_eq!(decode(&encode(b)), Some(b));
        let f = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        let (a, z) = (f(&[1.0, 2.0, 3.0, 4.0]), f(&[10.0, 20.0, 30.0, 40.0]));
        assert_eq!(result(c, &[&a, &z], 1), Some(f(&[33.0, 44.0])));
        assert_eq!(result(b, &[&[7], &[9]], 0), Some(vec![9]));
        let r = Call { kind: Kind::Reduce, count: 1, ty: Ty::U8, op: Some(RedOp::Max), root: 1 };
        assert_eq!((result(r, &[&[3], &[5]], 0), result(r, &[&[3], &[5]], 1)), (None, Some(vec![5])));
    }
}
