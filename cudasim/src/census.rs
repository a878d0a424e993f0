//! The launch census (`KILN_CUDASIM_CENSUS=1`): a record of every kernel
//! launch, cuBLAS gemm and cuDNN convolution the simulator completes, so that a test can fail
//! when a kernel gives one GPU thread serial work that grows with the
//! problem (one thread per channel summing N·H·W elements), and can count
//! the multiply-adds run inside cuBLAS.
//!
//! **Work** is counted in *basic blocks executed*: with the census on, every
//! module is compiled with g++'s `-fsanitize-coverage=trace-pc`, which calls
//! `__sanitizer_cov_trace_pc` (`shim/launch.hpp`) at the start of each basic
//! block of the optimised (`-O2`) code; the callback bumps a thread-local
//! counter, and `exec::run_grid` reads it around every resume of a GPU
//! thread's fiber, adding up each thread's share across resumes (a thread
//! that waits at `__syncthreads()` is resumed several times). A loop of `n`
//! iterations costs about `n` to a few `n` (one per block of its body, as
//! g++ laid it out; a loop g++ vectorised or unrolled counts once per
//! vector or unrolled step); code outside the module (libm's `expf`, the
//! shim's `__syncthreads`) counts as the one block that calls it. The
//! figures are deterministic for a given module, compiler and launch.
//!
//! A kernel record holds the device, the kernel's name, the grid, the block,
//! the threads (grid × block), the work of all threads together, the most
//! any one thread did and which thread that was, and `arg_bytes`: the sizes,
//! added up, of the distinct live device allocations that any 8-byte word
//! of the launch's argument bytes points into. kiln passes one struct of
//! `u64` device addresses, so every aligned word is looked at, not only the
//! arguments typed as pointers: it is the memory the arguments can reach,
//! an upper bound on the bytes the kernel moves (a word that happens to
//! equal a device address counts too). A gemm record holds `m`, `n`, `k`,
//! the batch count and the multiply-adds `m·n·k·batch`, with `arg_bytes` the
//! allocations A, B and C lie in, and no threads or work.
//!
//! Records are kept in order of completion (on each stream; streams run
//! concurrently) until [`kiln_cudasim_census_take`] hands them out as JSON
//! lines. With the census off nothing is counted or recorded, and modules
//! are compiled and cached exactly as without it.

use crate::lock;
use crate::memory::Mem;
use std::collections::BTreeSet;
use std::ffi::{c_char, c_int};
use std::sync::{Mutex, OnceLock};

/// Whether `KILN_CUDASIM_CENSUS=1` (read once per process).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CUDASIM_CENSUS").is_ok_and(|v| v.trim() == "1"))
}

/// What a completed grid's threads did, in basic blocks (all zero when the
/// census is off).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Work {
    /// All threads of the grid together.
    pub total: u64,
    /// The most one thread did.
    pub max: u64,
    /// The first thread (by block, then thread) that did [`Work::max`].
    pub max_block: u32,
    pub max_thread: u32,
}

/// One completed launch or gemm.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Record {
    /// `"kernel"`, `"gemm"` or `"dnn"` (a cuDNN convolution).
    pub kind: &'static str,
    pub device: usize,
    pub name: String,
    pub grid: u64,
    pub block: u64,
    pub threads: u64,
    pub work: Work,
    pub arg_bytes: u64,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
    pub macs: u64,
}

fn records() -> &'static Mutex<Vec<Record>> {
    static R: OnceLock<Mutex<Vec<Record>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Vec::new()))
}

/// Appends `r` (callers check [`enabled`] first).
pub(crate) fn record(r: Record) {
    lock(records()).push(r);
}

/// The bytes of the distinct live device allocations (of any device) that
/// the values in `words` point into.
pub(crate) fn reachable_bytes(mem: &Mem, words: impl IntoIterator<Item = u64>) -> u64 {
    let mut seen = BTreeSet::new();
    let mut bytes = 0u64;
    for w in words {
        if w == 0 {
            continue;
        }
        if let Some((&base, &(len, _))) = mem.dev.range(..=w).next_back()
            && w < base + len.max(1) as u64
            && seen.insert(base)
        {
            bytes += len as u64;
        }
    }
    bytes
}

/// `s` as the body of a JSON string.
fn escape(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

impl Record {
    /// One JSON object, then a newline.
    fn json_line(&self, out: &mut String) {
        out.push_str("{\"kind\":\"");
        out.push_str(self.kind);
        out.push_str(&format!("\",\"device\":{},\"name\":\"", self.device));
        escape(&self.name, out);
        out.push_str(&format!(
            "\",\"grid\":{},\"block\":{},\"threads\":{},\"work_total\":{},\"work_max\":{},\"work_max_block\":{},\
             \"work_max_thread\":{},\"arg_bytes\":{},\"m\":{},\"n\":{},\"k\":{},\"batch\":{},\"macs\":{}}}\n",
            self.grid,
            self.block,
            self.threads,
            self.work.total,
            self.work.max,
            self.work.max_block,
            self.work.max_thread,
            self.arg_bytes,
            self.m,
            self.n,
            self.k,
            self.batch,
            self.macs
        ));
    }
}

fn json(records: &[Record]) -> String {
    let mut out = String::new();
    for r in records {
        r.json_line(&mut out);
    }
    out
}

/// Hands out the census's records as JSON lines (UTF-8, one object per
/// record, each line ending in `\n`; keys `kind` (`"kernel"`, `"gemm"` or `"dnn"`),
/// `device`, `name`, `grid`, `block`, `threads`, `work_total`, `work_max`,
/// `work_max_block`, `work_max_thread`, `arg_bytes`, `m`, `n`, `k`, `batch`,
/// `macs`; see the module's documentation for their meaning).
///
/// Returns the length in bytes of all the records kept now. When `buf` is
/// not null and `cap` is at least that length, writes them to `buf` (with a
/// NUL after them when `cap` leaves room for one) and forgets them;
/// otherwise writes nothing and keeps them, so a caller asks with `(NULL,
/// 0)` and retries with a buffer of the size returned (more may have been
/// recorded meanwhile: a larger answer means the retry wrote nothing).
/// A launch is recorded when its stream completes it: synchronise first.
/// Always 0 with the census off.
///
/// # Safety
/// `buf`, when not null, must be writable for `cap` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kiln_cudasim_census_take(buf: *mut c_char, cap: usize) -> usize {
    unsafe {
        let mut kept = lock(records());
        let text = json(&kept);
        let len = text.len();
        if !buf.is_null() && cap >= len {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, len);
            if cap > len {
                *buf.add(len) = 0;
            }
            kept.clear();
        }
        len
    }
}

/// 1 when the census is on (`KILN_CUDASIM_CENSUS=1`), else 0.
#[unsafe(no_mangle)]
pub extern "C" fn kiln_cudasim_census_enabled() -> c_int {
    enabled() as c_int
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_one_json_line_with_the_name_escaped() {
        let r = Record {
            kind: "kernel",
            device: 1,
            name: "odd\"name\\\n\u{1}é".into(),
            grid: 2,
            block: 3,
            threads: 6,
            work: Work { total: 60, max: 11, max_block: 1, max_thread: 2 },
            arg_bytes: 4096,
            ..Default::default()
        };
        assert_eq!(
            json(&[r]),
            "{\"kind\":\"kernel\",\"device\":1,\"name\":\"odd\\\"name\\\\\\n\\u0001é\",\"grid\":2,\"block\":3,\"threads\":6,\
             \"work_total\":60,\"work_max\":11,\"work_max_block\":1,\"work_max_thread\":2,\"arg_bytes\":4096,\"m\":0,\"n\":0,\
             \"k\":0,\"batch\":0,\"macs\":0}\n"
        );
    }

    #[test]
    fn reachable_bytes_counts_each_allocation_once() {
        let mut mem = Mem::default();
        mem.dev.insert(0x1000, (100, 0));
        mem.dev.insert(0x2000, (4096, 1));
        let words = [0x1000, 0x1063, 0x1064, 0x2800, 0x2000, 0, 7, 0x9000];
        assert_eq!(reachable_bytes(&mem, words), 100 + 4096, "0x1064 is past the first allocation's end");
        assert_eq!(reachable_bytes(&mem, []), 0);
    }
}
