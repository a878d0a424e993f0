//! Matrix products over strided host slices, through the `gemm` crate.

use super::NnFloat;

/// A strided matrix view: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

/// Below this many multiply-adds a product runs on one thread: splitting
/// costs more than it saves.
const PARALLEL_MIN: usize = 1 << 20;

fn fits(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    rows == 0
        || cols == 0
        || (rows - 1).checked_mul(rs).and_then(|a| (cols - 1).checked_mul(cs).and_then(|b| a.checked_add(b))).is_some_and(|e| e < len)
}

/// `dst = a · b` (m×k times k×n), or `dst += a · b` when `accumulate`.
/// `dst` is m×n with row stride `d_rs` and column stride `d_cs`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: NnFloat>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
    (d_rs, d_cs): (usize, usize),
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    accumulate: bool,
    threads: usize,
) {
    // The gemm crate reads and writes through raw pointers: these bounds are
    // what makes that sound, so they are checked in release builds too.
    assert!(
        fits(dst.len(), m, n, d_rs, d_cs) && fits(a.data.len(), m, k, a.rs, a.cs) && fits(b.data.len(), k, n, b.rs, b.cs),
        "host_nn gemm: a matrix view exceeds its slice"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[i * d_rs + j * d_cs] = T::ZERO;
                }
            }
        }
        return;
    }
    let work = m.saturating_mul(n).saturating_mul(k);
    let par = if threads > 1 && work >= PARALLEL_MIN { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the three views lie inside their slices (checked above), and
    // `dst` is borrowed mutably, so it overlaps neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            d_cs as isize,
            d_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            par,
        );
    }
}
