//! Running a collective when the ranks' streams reach it: the ranks meet,
//! the last to arrive checks the calls and buffers and computes the result
//! once for every rank (see the parent module's doc).

use super::{Call, Kind, RedOp, Task, Ty, COLLECTIVES, OK, UNHANDLED_CUDA_ERROR};
use crate::{check_range, lock, Sim, LAUNCH_FAILED};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A rank's call with its send and receive buffers, or None when it could
/// not take part (its context had faulted).
type Arrival = Option<(Call, u64, u64)>;

/// The ranks of one collective as they reach it.
pub(super) struct Meeting {
    /// Each rank's arrival once it arrived.
    calls: Vec<Option<Arrival>>,
    arrived: usize,
    left: usize,
    outcome: Option<Result<(), String>>,
}

/// How long a rank waits for the others (`KILN_CUDASIM_NCCL_TIMEOUT`).
pub(super) fn timeout() -> Duration {
    static T: OnceLock<Duration> = OnceLock::new();
    *T.get_or_init(|| {
        Duration::from_secs(std::env::var("KILN_CUDASIM_NCCL_TIMEOUT").ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(120))
    })
}

impl Task {
    /// This rank's stream reached the collective: waits for every rank,
    /// the last of which runs it.
    pub(crate) fn run(self, sim: &Sim) -> Result<(), (crate::CUresult, String)> {
        let part = Some((self.call, self.send, self.recv));
        let outcome = match &self.comm.world {
            Some(world) => world.meet(sim, self.comm.dev, self.seq, part),
            None => self.meet(sim, part),
        };
        outcome.map_err(|e| {
            // The message first: a caller that sees the error reads it.
            // Kept once: a pointer ncclGetLastError gave stays valid.
            let mut last = lock(&self.comm.last_error);
            if last.as_bytes().is_empty() {
                *last = std::ffi::CString::new(e.replace('\0', " ")).unwrap_or_default();
            }
            drop(last);
            let mut err = lock(&self.comm.async_error);
            if *err == OK {
                *err = if self.comm.world.is_some() { super::REMOTE_ERROR } else { UNHANDLED_CUDA_ERROR };
            }
            (LAUNCH_FAILED, e)
        })
    }

    /// This rank's context faulted before the collective: the others learn
    /// it instead of waiting.
    pub(crate) fn abandon(self, sim: &Sim) {
        let _ = match &self.comm.world {
            Some(world) => world.meet(sim, self.comm.dev, self.seq, None),
            None => self.meet(sim, None),
        };
    }

    fn meet(&self, sim: &Sim, call: Arrival) -> Result<(), String> {
        let clique = &self.comm.clique;
        let n = clique.devs.len();
        let what =
            format!("NCCL collective #{} ({}) on rank {} (device {})", self.seq, self.call.kind.name(), self.comm.rank, self.comm.dev);
        let mut meetings = lock(&clique.meetings);
        let m = meetings.entry(self.seq).or_insert_with(|| Meeting { calls: vec![None; n], arrived: 0, left: 0, outcome: None });
        let abandoned = call.is_none();
        m.calls[self.comm.rank] = Some(call);
        m.arrived += 1;
        if m.arrived == n && m.outcome.is_none() {
            let outcome = run_collective(sim, &clique.devs, &m.calls);
            if outcome.is_ok() {
                COLLECTIVES.fetch_add(1, Ordering::SeqCst);
            }
            m.outcome = Some(outcome);
            clique.cv.notify_all();
        }
        let deadline = Instant::now() + timeout();
        while m_outcome(&meetings, self.seq).is_none() && !abandoned {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    meetings.get(&self.seq).map(|m| (0..n).filter(|&r| m.calls[r].is_none()).collect()).unwrap_or_default();
                let msg = format!(
                    "{what}: ranks {missing:?} did not reach it within {} s (KILN_CUDASIM_NCCL_TIMEOUT); on a GPU this hangs",
                    timeout().as_secs()
                );
                if let Some(m) = meetings.get_mut(&self.seq) {
                    m.outcome = Some(Err(msg));
                }
                clique.cv.notify_all();
                break;
            }
            meetings = clique.cv.wait_timeout(meetings, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        let Some(m) = meetings.get_mut(&self.seq) else { return Err(format!("{what}: lost its meeting (a cudasim bug)")) };
        let outcome = m.outcome.clone().unwrap_or(Ok(()));
        m.left += 1;
        if m.left == n {
            meetings.remove(&self.seq);
        }
        outcome.map_err(|e| format!("{what}: {e}"))
    }
}

fn m_outcome(meetings: &HashMap<u64, Meeting>, seq: u64) -> Option<&Result<(), String>> {
    meetings.get(&seq).and_then(|m| m.outcome.as_ref())
}

/// Runs a collective every rank reached: checks the calls agree and every
/// buffer is device memory of its rank, then computes and writes.
fn run_collective(sim: &Sim, devs: &[usize], calls: &[Option<Arrival>]) -> Result<(), String> {
    let mut parts = Vec::with_capacity(calls.len());
    for (r, c) in calls.iter().enumerate() {
        match c {
            Some(Some(p)) => parts.push(*p),
            _ => return Err(format!("rank {r}'s device {} faulted before it; nothing was moved", devs[r])),
        }
    }
    let (c0, _, _) = parts[0];
    for (r, (c, _, _)) in parts.iter().enumerate() {
        if *c != c0 {
            return Err(format!(
                "the ranks called different collectives: rank 0 {c0:?}, rank {r} {c:?}; on a GPU this hangs or corrupts memory"
            ));
        }
    }
    let n = devs.len();
    let size = c0.ty.size();
    let bytes = c0.count * size;
    let (send_len, recv_len) = match c0.kind {
        Kind::AllReduce | Kind::Broadcast | Kind::Reduce => (bytes, bytes),
        Kind::AllGather => (bytes, n * bytes),
        Kind::ReduceScatter => (n * bytes, bytes),
    };
    let reads = |r: usize| !(c0.kind == Kind::Broadcast && r != c0.root);
    let writes = |r: usize| !(c0.kind == Kind::Reduce && r != c0.root);
    let name = c0.kind.name();
    // Every buffer first, so a bad one moves nothing.
    for (r, &(_, send, recv)) in parts.iter().enumerate() {
        if reads(r) {
            check_range(sim, devs[r], send, send_len, &format!("{name} rank {r} send buffer"))?;
        }
        if writes(r) {
            check_range(sim, devs[r], recv, recv_len, &format!("{name} rank {r} receive buffer"))?;
        }
    }
    // SAFETY: every range was checked live device memory above; the ranks'
    // streams are all parked here, so nothing else on them runs meanwhile.
    let read = |r: usize| unsafe { std::slice::from_raw_parts(parts[r].1 as *const u8, send_len).to_vec() };
    let write = |r: usize, data: &[u8]| unsafe { std::ptr::copy(data.as_ptr(), parts[r].2 as *mut u8, data.len()) };
    let reduce_all = || -> Vec<u8> {
        let op = c0.op.unwrap_or(RedOp::Sum);
        let mut acc = read(0);
        for r in 1..n {
            combine(c0.ty, op, &mut acc, &read(r));
        }
        if op == RedOp::Avg {
            divide(c0.ty, &mut acc, n);
        }
        acc
    };
    match c0.kind {
        Kind::AllReduce => {
            let out = reduce_all();
            (0..n).for_each(|r| write(r, &out));
        }
        Kind::Reduce => write(c0.root, &reduce_all()),
        Kind::Broadcast => {
            let data = read(c0.root);
            (0..n).for_each(|r| write(r, &data));
        }
        Kind::AllGather => {
            let all: Vec<u8> = (0..n).flat_map(read).collect();
            (0..n).for_each(|r| write(r, &all));
        }
        Kind::ReduceScatter => {
            let out = reduce_all();
            (0..n).for_each(|r| write(r, &out[r * bytes..(r + 1) * bytes]));
        }
    }
    Ok(())
}

/// `acc = op(acc, x)` elementwise over values of `ty` (native byte order).
pub(super) fn combine(ty: Ty, op: RedOp, acc: &mut [u8], x: &[u8]) {
    macro_rules! ints {
        ($t:ty) => {{
            const S: usize = std::mem::size_of::<$t>();
            for (a, b) in acc.chunks_exact_mut(S).zip(x.chunks_exact(S)) {
                let (p, q) = (<$t>::from_ne_bytes(a.try_into().unwrap()), <$t>::from_ne_bytes(b.try_into().unwrap()));
                let v = match op {
                    RedOp::Sum | RedOp::Avg => p.wrapping_add(q),
                    RedOp::Prod => p.wrapping_mul(q),
                    RedOp::Max => p.max(q),
                    RedOp::Min => p.min(q),
                };
                a.copy_from_slice(&v.to_ne_bytes());
            }
        }};
    }
    macro_rules! floats {
        ($t:ty, $acc:ty, $to:expr, $from:expr) => {{
            const S: usize = std::mem::size_of::<$t>();
            for (a, b) in acc.chunks_exact_mut(S).zip(x.chunks_exact(S)) {
                let (p, q): ($acc, $acc) =
                    ($to(<$t>::from_ne_bytes(a.try_into().unwrap())), $to(<$t>::from_ne_bytes(b.try_into().unwrap())));
                // fmax and fmin, as NCCL's kernels: a NaN loses.
                let v: $acc = match op {
                    RedOp::Sum | RedOp::Avg => p + q,
                    RedOp::Prod => p * q,
                    RedOp::Max => p.max(q),
                    RedOp::Min => p.min(q),
                };
                let v: $t = $from(v);
                a.copy_from_slice(&v.to_ne_bytes());
            }
        }};
    }
    match ty {
        Ty::I8 => ints!(i8),
        Ty::U8 => ints!(u8),
        Ty::I32 => ints!(i32),
        Ty::U32 => ints!(u32),
        Ty::I64 => ints!(i64),
        Ty::U64 => ints!(u64),
        Ty::F32 => floats!(f32, f32, |v| v, |v| v),
        Ty::F64 => floats!(f64, f64, |v| v, |v| v),
        Ty::F16 => floats!(half::f16, f32, half::f16::to_f32, half::f16::from_f32),
        Ty::BF16 => floats!(half::bf16, f32, half::bf16::to_f32, half::bf16::from_f32),
    }
}

/// `acc /= n` elementwise (ncclAvg; integers divide towards zero).
pub(super) fn divide(ty: Ty, acc: &mut [u8], n: usize) {
    macro_rules! each {
        ($t:ty, $acc:ty, $to:expr, $from:expr) => {{
            const S: usize = std::mem::size_of::<$t>();
            for a in acc.chunks_exact_mut(S) {
                let p: $acc = $to(<$t>::from_ne_bytes(a.try_into().unwrap()));
                let v: $t = $from(p / (n as $acc));
                a.copy_from_slice(&v.to_ne_bytes());
            }
        }};
    }
    match ty {
        Ty::I8 => each!(i8, i8, |v| v, |v| v),
        Ty::U8 => each!(u8, u8, |v| v, |v| v),
        Ty::I32 => each!(i32, i32, |v| v, |v| v),
        Ty::U32 => each!(u32, u32, |v| v, |v| v),
        Ty::I64 => each!(i64, i64, |v| v, |v| v),
        Ty::U64 => each!(u64, u64, |v| v, |v| v),
        Ty::F32 => each!(f32, f32, |v| v, |v| v),
        Ty::F64 => each!(f64, f64, |v| v, |v| v),
        Ty::F16 => each!(half::f16, f32, half::f16::to_f32, half::f16::from_f32),
        Ty::BF16 => each!(half::bf16, f32, half::bf16::to_f32, half::bf16::from_f32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    #[test]
    fn float_extrema_let_a_nan_lose_and_sums_wrap() {
        let mut a = f32s(&[f32::NAN, 1.0, -2.0]);
        combine(Ty::F32, RedOp::Max, &mut a, &f32s(&[3.0, f32::NAN, -1.0]));
        assert_eq!(a, f32s(&[3.0, 1.0, -1.0]));
        let mut b = vec![200u8, 1];
        combine(Ty::U8, RedOp::Sum, &mut b, &[100, 2]);
        assert_eq!(b, vec![44, 3]);
        let mut h: Vec<u8> = [half::f16::from_f32(1.0), half::f16::from_f32(2048.0)].iter().flat_map(|x| x.to_ne_bytes()).collect();
        let one: Vec<u8> = [half::f16::from_f32(0.5), half::f16::from_f32(1.0)].iter().flat_map(|x| x.to_ne_bytes()).collect();
        combine(Ty::F16, RedOp::Sum, &mut h, &one);
        // 2048 + 1 rounds to even in f16 (spacing 2 there).
        let got: Vec<f32> = h.chunks_exact(2).map(|c| half::f16::from_ne_bytes([c[0], c[1]]).to_f32()).collect();
        assert_eq!(got, vec![1.5, 2048.0]);
        let mut avg = f32s(&[3.0, 5.0]);
        divide(Ty::F32, &mut avg, 2);
        assert_eq!(avg, f32s(&[1.5, 2.5]));
    }
}
