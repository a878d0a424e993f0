//! Matrix products over strided host slices, through the `gemm` crates.

use super::NnFloat;
pub(crate) use gemm_common::Parallelism;

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
    let par = if threads > 1 && work >= PARALLEL_MIN { Parallelism::Rayon(threads) } else { Parallelism::None };
    // SAFETY: the three views lie inside their slices (checked above), and
    // `dst` is borrowed mutably, so it overlaps neither operand.
    let ran = unsafe {
        strided_gemm(
            (m, n, k),
            dst.as_mut_ptr(),
            (d_cs as isize, d_rs as isize),
            accumulate,
            a.data.as_ptr(),
            (a.cs as isize, a.rs as isize),
            b.data.as_ptr(),
            (b.cs as isize, b.rs as isize),
            (T::ONE, T::ONE),
            par,
        )
    };
    assert!(ran, "host_nn::matmul::gemm: no gemm kernel for {}", std::any::type_name::<T>());
}

/// The `gemm` crates' product over raw strided views:
/// `dst = alpha·dst + beta·(lhs · rhs)` (`alpha` only read when `read_dst`),
/// for f32, f64 and f16 through gemm-f32, gemm-f64 and gemm-f16 directly.
/// (The `gemm` umbrella crate dispatches the same way, but also compiles
/// its two complex-number kernels, a sixth of kiln's first build, which
/// kiln never calls.) Any other element type, or a negative stride, is
/// refused with `false` and nothing written.
///
/// The kernels are fastest on a column-major destination: a row-major one
/// (kiln's usual) is computed as the transposed product, `dstᵀ = rhsᵀ ·
/// lhsᵀ`, which is the same sums in the same order with the roles of rows
/// and columns exchanged.
///
/// # Safety
/// As `gemm::gemm`: every element the strides reach lies inside its
/// allocation, and `dst` overlaps neither operand.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn strided_gemm<T: 'static + Copy>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    (dst_cs, dst_rs): (isize, isize),
    read_dst: bool,
    lhs: *const T,
    (lhs_cs, lhs_rs): (isize, isize),
    rhs: *const T,
    (rhs_cs, rhs_rs): (isize, isize),
    (alpha, beta): (T, T),
    parallelism: Parallelism,
) -> bool {
    use std::any::TypeId;
    if [dst_cs, dst_rs, lhs_cs, lhs_rs, rhs_cs, rhs_rs].iter().any(|&s| s < 0) {
        return false;
    }
    let ((m, n), (dst_cs, dst_rs), (lhs, (lhs_cs, lhs_rs)), (rhs, (rhs_cs, rhs_rs))) = if dst_cs < dst_rs {
        ((n, m), (dst_rs, dst_cs), (rhs, (rhs_rs, rhs_cs)), (lhs, (lhs_rs, lhs_cs)))
    } else {
        ((m, n), (dst_cs, dst_rs), (lhs, (lhs_cs, lhs_rs)), (rhs, (rhs_cs, rhs_rs)))
    };
    macro_rules! run {
        ($t:ty, $f:expr) => {{
            // SAFETY: T is $t (checked by the caller of the macro), so the
            // casts are identities; the views are the caller's promise.
            unsafe {
                $f(
                    m,
                    n,
                    k,
                    dst.cast::<$t>(),
                    dst_cs,
                    dst_rs,
                    read_dst,
                    lhs.cast::<$t>(),
                    lhs_cs,
                    lhs_rs,
                    rhs.cast::<$t>(),
                    rhs_cs,
                    rhs_rs,
                    *(&alpha as *const T).cast::<$t>(),
                    *(&beta as *const T).cast::<$t>(),
                    false,
                    false,
                    false,
                    parallelism,
                )
            };
            true
        }};
    }
    let t = TypeId::of::<T>();
    if t == TypeId::of::<f32>() {
        run!(f32, gemm_f32::gemm::f32::get_gemm_fn())
    } else if t == TypeId::of::<f64>() {
        run!(f64, gemm_f64::gemm::f64::get_gemm_fn())
    } else if t == TypeId::of::<half::f16>() {
        run!(gemm_f16::f16, gemm_f16::gemm::f16::get_gemm_fn())
    } else {
        false
    }
}
