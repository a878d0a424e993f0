//! f32 matrix products small enough to live in the caches (W2's 100×100),
//! without packing: an AVX2+FMA register tile of 6 rows × 16 columns reads
//! the left operand's scalars with any strides and the right operand's rows
//! where they are (unit column stride), and writes the result once.
//!
//! Why a kernel of our own: at these sizes the gemm crate spends about half
//! of its time packing and on partial tiles (49 GFLOP/s of this core's 94 on
//! a 100³ product); a tile that reads the operands in place reaches ~80% of
//! the peak. Larger products, other strides, other dtypes, CPUs without
//! AVX2+FMA and CPUs with AVX-512 (whose 16-lane gemm kernels are faster
//! than this 8-lane tile) go to gemm.
//!
//! Each output element is one chain of fused multiply-adds over k in order,
//! so a result does not depend on where it falls in the tiling or on the
//! thread count.

/// Multiply-adds up to which a product takes this path (about 100³); above
/// it gemm's packed, cache-blocked kernels are faster.
pub(crate) const SMALL_MAX: usize = 1 << 20;
/// Rows of the register tile.
const MR: usize = 6;
/// Columns of the register tile: two AVX vectors.
const NR: usize = 16;

/// A row-major matrix view by raw strides (in elements) into a slice.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

/// Whether this CPU runs the kernel: AVX2 and FMA, and no AVX-512.
fn cpu_has_it() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        // With AVX-512 gemm's 16-lane kernels beat this 8-lane tile even
        // after packing, so such CPUs keep gemm.
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && !std::arch::is_x86_feature_detected!("avx512f")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether `index(rows-1, cols-1)` of a view lies inside its slice (the
/// kernel reads through raw pointers).
fn inside(v: &View<'_>, rows: usize, cols: usize) -> bool {
    rows == 0
        || cols == 0
        || (rows - 1)
            .checked_mul(v.rs)
            .and_then(|r| (cols - 1).checked_mul(v.cs).and_then(|c| r.checked_add(c)))
            .and_then(|e| e.checked_add(v.offset))
            .is_some_and(|e| e < v.data.len())
}

/// `dst` (m×n, row-major, contiguous) = `a` (m×k) · `b` (k×n), when this
/// path applies: the product is small, n ≥ 16 and k ≥ 8, `b`'s rows are
/// contiguous and the CPU has AVX2 and FMA (and no AVX-512). Returns false,
/// having written nothing, otherwise.
pub(crate) fn matmul(a: View<'_>, b: View<'_>, dst: &mut [f32], (m, n, k): (usize, usize, usize)) -> bool {
    let work = m.saturating_mul(n).saturating_mul(k);
    // The tile's lanes run along n: with fewer than 16 columns most of them
    // idle (a matrix-vector product is 8× slower than gemm's). Its stores
    // are amortised along k: with fewer than 8 steps they dominate.
    if work > SMALL_MAX || m == 0 || k < 8 || n < NR || b.cs != 1 || !cpu_has_it() {
        return false;
    }
    // Soundness of the raw reads and writes below, checked in release too.
    if !(inside(&a, m, k) && inside(&b, k, n) && dst.len() >= m * n) {
        return false;
    }
    run(a, b, dst, (m, n, k))
}

#[cfg(target_arch = "x86_64")]
fn run(a: View<'_>, b: View<'_>, dst: &mut [f32], mnk: (usize, usize, usize)) -> bool {
    // SAFETY: the CPU has AVX2 and FMA, and every index the tiles touch is
    // inside its slice (both checked by `matmul`: the largest index of each
    // view, whose strides are non-negative).
    unsafe { avx2::product(a, b, dst, mnk) };
    true
}

#[cfg(not(target_arch = "x86_64"))]
fn run(_: View<'_>, _: View<'_>, _: &mut [f32], _: (usize, usize, usize)) -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{View, MR, NR};
    use std::arch::x86_64::*;

    /// Lane masks for a partial 8-wide vector of `lanes` (0..=8) columns.
    #[inline(always)]
    unsafe fn mask(lanes: usize) -> __m256i {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), idx)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(a: View<'_>, b: View<'_>, dst: &mut [f32], (m, n, k): (usize, usize, usize)) {
        let (ap, bp, cp) = (a.data.as_ptr().add(a.offset), b.data.as_ptr().add(b.offset), dst.as_mut_ptr());
        let t = Tile { k, a_rs: a.rs, a_cs: a.cs, b_rs: b.rs, c_rs: n };
        let mut j = 0;
        while j < n {
            let cols = (n - j).min(NR);
            // A last strip of 8 columns or fewer takes one vector, not two.
            let masks = [mask(cols.min(8)), mask(cols.saturating_sub(8))];
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(MR);
                let (at, bt, ct) = (ap.add(i * a.rs), bp.add(j), cp.add(i * n + j));
                macro_rules! by_rows {
                    ($f:ident $(, $flag:literal)?; $($x:expr),*) => {
                        match rows {
                            6 => t.$f::<6 $(, $flag)?>($($x),*),
                            5 => t.$f::<5 $(, $flag)?>($($x),*),
                            4 => t.$f::<4 $(, $flag)?>($($x),*),
                            3 => t.$f::<3 $(, $flag)?>($($x),*),
                            2 => t.$f::<2 $(, $flag)?>($($x),*),
                            _ => t.$f::<1 $(, $flag)?>($($x),*),
                        }
                    };
                }
                if cols == NR {
                    by_rows!(two, false; at, bt, ct, masks[1])
                } else if cols > 8 {
                    by_rows!(two, true; at, bt, ct, masks[1])
                } else {
                    by_rows!(one; at, bt, ct, masks[0])
                }
                i += rows;
            }
            j += cols;
        }
    }

    /// One register tile's strides.
    struct Tile {
        k: usize,
        a_rs: usize,
        a_cs: usize,
        b_rs: usize,
        c_rs: usize,
    }

    impl Tile {
        /// R rows × 16 columns, or (`MASKED`) 9 to 15, the second vector
        /// through the lane mask `m1`.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn two<const R: usize, const MASKED: bool>(&self, a: *const f32, b: *const f32, c: *mut f32, m1: __m256i) {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let (mut ak, mut bk) = (a, b);
            for _ in 0..self.k {
                let b0 = _mm256_loadu_ps(bk);
                let b1 = if MASKED { _mm256_maskload_ps(bk.add(8), m1) } else { _mm256_loadu_ps(bk.add(8)) };
                for (r, row) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*ak.add(r * self.a_rs));
                    row[0] = _mm256_fmadd_ps(x, b0, row[0]);
                    row[1] = _mm256_fmadd_ps(x, b1, row[1]);
                }
                // After the last step these point past the operands, where
                // nothing reads: `add` would promise they stay inside.
                ak = ak.wrapping_add(self.a_cs);
                bk = bk.wrapping_add(self.b_rs);
            }
            for (r, row) in acc.iter().enumerate() {
                let cr = c.add(r * self.c_rs);
                _mm256_storeu_ps(cr, row[0]);
                if MASKED {
                    _mm256_maskstore_ps(cr.add(8), m1, row[1]);
                } else {
                    _mm256_storeu_ps(cr.add(8), row[1]);
                }
            }
        }

        /// R rows × 1 to 8 columns: one vector through a lane mask.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn one<const R: usize>(&self, a: *const f32, b: *const f32, c: *mut f32, m0: __m256i) {
            let mut acc = [_mm256_setzero_ps(); R];
            let (mut ak, mut bk) = (a, b);
            for _ in 0..self.k {
                let b0 = _mm256_maskload_ps(bk, m0);
                for (r, row) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*ak.add(r * self.a_rs));
                    *row = _mm256_fmadd_ps(x, b0, *row);
                }
                // After the last step these point past the operands, where
                // nothing reads: `add` would promise they stay inside.
                ak = ak.wrapping_add(self.a_cs);
                bk = bk.wrapping_add(self.b_rs);
            }
            for (r, row) in acc.iter().enumerate() {
                _mm256_maskstore_ps(c.add(r * self.c_rs), m0, *row);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random matrix with exact small values, so the
    /// reference (f64, exact) and the kernel (f32 FMA chains) agree exactly.
    fn ints(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 17) as f32 - 8.0
            })
            .collect()
    }

    fn reference(a: View<'_>, b: View<'_>, (m, n, k): (usize, usize, usize)) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    s += a.data[a.offset + i * a.rs + p * a.cs] as f64 * b.data[b.offset + p * b.rs + j * b.cs] as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn every_tile_shape_and_stride_gives_the_exact_product() {
        if !cpu_has_it() {
            // What is checkable here: the kernel declines, so gemm runs.
            let v = vec![1f32; 4];
            let view = View { data: &v, offset: 0, rs: 2, cs: 1 };
            assert!(!matmul(view, view, &mut [0f32; 4], (2, 2, 2)));
            eprintln!("SKIPPED: the tile's products: this CPU lacks AVX2+FMA or has AVX-512, so the kernel never runs here");
            return;
        }
        let mut checked = 0;
        // Rows 1 to 6 in the last tile; last strips of 16, 1, 7, 8, 9, 15 columns.
        let shapes = [
            (1, 16, 8),
            (6, 16, 8),
            (7, 17, 9),
            (13, 33, 9),
            (100, 100, 100),
            (5, 25, 64),
            (12, 48, 8),
            (2, 31, 11),
            (3, 24, 8),
            (4, 23, 10),
        ];
        for (m, n, k) in shapes {
            // a row-major, a transposed (column-major), a broadcast row; b
            // row-major with padded rows and an offset.
            let av = ints(m * k + 3, 1);
            let bv = ints((k * (n + 2)) + 5, 2);
            let b = View { data: &bv, offset: 5, rs: n + 2, cs: 1 };
            for a in [
                View { data: &av, offset: 0, rs: k, cs: 1 },
                View { data: &av, offset: 3, rs: 1, cs: m },
                View { data: &av, offset: 1, rs: 0, cs: 1 },
            ] {
                let mut out = vec![f32::NAN; m * n];
                assert!(matmul(a, b, &mut out, (m, n, k)), "{m}x{n}x{k} refused");
                assert_eq!(out, reference(a, b, (m, n, k)), "{m}x{n}x{k}, a strides ({}, {})", a.rs, a.cs);
                checked += 1;
            }
        }
        assert_eq!(checked, 3 * shapes.len());
    }

    #[test]
    fn it_refuses_what_it_does_not_cover_and_writes_nothing() {
        let v = vec![1f32; 256];
        let a = View { data: &v, offset: 0, rs: 16, cs: 1 };
        let b = a;
        let mut out = vec![7f32; 256];
        // Each call differs from an accepted one (2×8 · 8×16) in one way.
        assert!(!matmul(a, View { rs: 1, cs: 16, ..b }, &mut out, (2, 16, 8)), "b's columns not contiguous");
        assert!(!matmul(a, b, &mut out, (2, 15, 8)), "n < 16");
        assert!(!matmul(a, b, &mut out, (2, 16, 7)), "k < 8");
        assert!(!matmul(a, b, &mut out, (1 << 11, 1 << 11, 8)), "more than 2^20 multiply-adds");
        assert!(!matmul(View { offset: 241, ..a }, b, &mut out, (2, 16, 8)), "a view past its slice");
        assert!(!matmul(a, b, &mut out[..31], (2, 16, 8)), "a destination too short");
        assert!(!matmul(View { offset: 300, ..a }, b, &mut out, (0, 16, 8)), "no rows (and a past its slice)");
        assert!(!matmul(a, View { offset: 130, ..b }, &mut out, (2, 16, 8)), "b past its slice");
        assert!(out.iter().all(|&x| x == 7.0));
        assert_eq!(matmul(a, b, &mut out, (2, 16, 8)), cpu_has_it());
    }

    #[test]
    fn non_finite_values_propagate_as_ieee_says() {
        if !cpu_has_it() {
            eprintln!("SKIPPED: non-finite values through the tile: this CPU lacks AVX2+FMA or has AVX-512");
            return;
        }
        // a: 2×8, rows [inf, 0, 0…] and [1, NaN, 0…]; b: 8×16, rows [0, 1, 1…],
        // [2, 3, 3…] and zeros.
        let mut a = [0f32; 16];
        (a[0], a[8], a[9]) = (f32::INFINITY, 1.0, f32::NAN);
        let mut b = [0f32; 128];
        b[1..16].fill(1.0);
        b[16] = 2.0;
        b[17..32].fill(3.0);
        let mut out = [0f32; 32];
        let (av, bv) = (View { data: &a, offset: 0, rs: 8, cs: 1 }, View { data: &b, offset: 0, rs: 16, cs: 1 });
        assert!(matmul(av, bv, &mut out, (2, 16, 8)));
        // inf·0 is NaN; inf·1 + 0·3 is inf; NaN anywhere in a row is NaN.
        assert!(out[0].is_nan());
        assert!(out[1..16].iter().all(|&x| x == f32::INFINITY));
        assert!(out[16..].iter().all(|x| x.is_nan()));
    }
}
