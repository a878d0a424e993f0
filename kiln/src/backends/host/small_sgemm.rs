//! f32 matrix products small enough to live in the caches (W2's 100×100),
//! without packing: a register tile reads the left operand's scalars with
//! any strides and the right operand's rows where they are (unit column
//! stride), and writes the result once. Two tiles: 8 rows × 32 columns in
//! AVX-512F on CPUs that have it, 6 rows × 16 columns in AVX2+FMA on the
//! others.
//!
//! Why a kernel of our own: at these sizes the gemm crate spends about half
//! of its time packing and on partial tiles (49 GFLOP/s of an AVX2 core's
//! 94 on a 100³ product); a tile that reads the operands in place reaches
//! ~80% of the peak. On an AVX-512 Xeon (Sapphire Rapids, beside an H200)
//! W2 took 1.07–1.21× less time than candle's through the 16-lane tile,
//! 1.01–1.09× through gemm and 0.92× through the 8-lane tile. Larger
//! products, other strides, other dtypes and CPUs without AVX2+FMA go to
//! gemm.
//!
//! Each output element is one chain of fused multiply-adds over k in order,
//! so a result does not depend on where it falls in the tiling, on the
//! thread count, or on which of the two tiles ran.

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

/// The instruction sets a tile is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Isa {
    /// 8-lane AVX2 and FMA: 6 rows × 16 columns.
    Avx2,
    /// 16-lane AVX-512F: 8 rows × 32 columns.
    Avx512,
}

/// Every tile this CPU can run, narrowest first (read once).
fn available() -> &'static [Isa] {
    use std::sync::OnceLock;
    static ISAS: OnceLock<Vec<Isa>> = OnceLock::new();
    ISAS.get_or_init(|| {
        #[allow(unused_mut)]
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
        }
        isas
    })
}

/// The tile this CPU runs, if any: the widest it has.
fn chosen() -> Option<Isa> {
    available().last().copied()
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
/// contiguous and the CPU has AVX-512F, or AVX2 and FMA. Returns false,
/// having written nothing, otherwise.
pub(crate) fn matmul(a: View<'_>, b: View<'_>, dst: &mut [f32], mnk: (usize, usize, usize)) -> bool {
    matmul_on(chosen(), a, b, dst, mnk)
}

/// [`matmul`] through the tile of `isa` (`None`: no tile, refused).
fn matmul_on(isa: Option<Isa>, a: View<'_>, b: View<'_>, dst: &mut [f32], (m, n, k): (usize, usize, usize)) -> bool {
    let work = m.saturating_mul(n).saturating_mul(k);
    // A tile runs only on a CPU that has its instructions (`available`).
    let Some(isa) = isa.filter(|i| available().contains(i)) else { return false };
    // The tile's lanes run along n: with fewer than 16 columns most of them
    // idle (a matrix-vector product is 8× slower than gemm's). Its stores
    // are amortised along k: with fewer than 8 steps they dominate.
    if work > SMALL_MAX || m == 0 || k < 8 || n < NR || b.cs != 1 {
        return false;
    }
    // Soundness of the raw reads and writes below, checked in release too.
    if !(inside(&a, m, k) && inside(&b, k, n) && dst.len() >= m * n) {
        return false;
    }
    run(isa, a, b, dst, (m, n, k))
}

#[cfg(target_arch = "x86_64")]
fn run(isa: Isa, a: View<'_>, b: View<'_>, dst: &mut [f32], mnk: (usize, usize, usize)) -> bool {
    // SAFETY: `isa` is one `available` found on this CPU, and every index the
    // tiles touch is inside its slice (both checked by the caller: the
    // largest index of each view, whose strides are non-negative).
    match isa {
        Isa::Avx2 => unsafe { avx2::product(a, b, dst, mnk) },
        Isa::Avx512 => unsafe { avx512::product(a, b, dst, mnk) },
    }
    true
}

#[cfg(not(target_arch = "x86_64"))]
fn run(_: Isa, _: View<'_>, _: View<'_>, _: &mut [f32], _: (usize, usize, usize)) -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{View, MR, NR};
    use std::arch::x86_64::*;

    /// Lane masks for a partial 8-wide vector of `lanes` (0..=8) columns.
    #[inline(always)]
    unsafe fn mask(lanes: usize) -> __m256i {
        unsafe {
            let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), idx)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(a: View<'_>, b: View<'_>, dst: &mut [f32], (m, n, k): (usize, usize, usize)) {
        unsafe {
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
            unsafe {
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
        }

        /// R rows × 1 to 8 columns: one vector through a lane mask.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn one<const R: usize>(&self, a: *const f32, b: *const f32, c: *mut f32, m0: __m256i) {
            unsafe {
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
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::View;
    use std::arch::x86_64::*;

    /// Rows of the 16-lane tile: 8 rows × 2 vectors are 16 accumulators of
    /// the 32 registers, enough independent FMA chains to hide the latency.
    const MR: usize = 8;
    /// Columns of the tile: two 16-lane vectors.
    const NR: usize = 32;

    /// The mask of the first `lanes` (0..=16) lanes.
    #[inline(always)]
    fn mask(lanes: usize) -> __mmask16 {
        if lanes >= 16 {
            0xFFFF
        } else {
            ((1u32 << lanes) - 1) as __mmask16
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn product(a: View<'_>, b: View<'_>, dst: &mut [f32], (m, n, k): (usize, usize, usize)) {
        unsafe {
            let (ap, bp, cp) = (a.data.as_ptr().add(a.offset), b.data.as_ptr().add(b.offset), dst.as_mut_ptr());
            let t = Tile { k, a_rs: a.rs, a_cs: a.cs, b_rs: b.rs, c_rs: n };
            let mut j = 0;
            while j < n {
                let cols = (n - j).min(NR);
                let (m0, m1) = (mask(cols.min(16)), mask(cols.saturating_sub(16)));
                let mut i = 0;
                while i < m {
                    let rows = (m - i).min(MR);
                    let (at, bt, ct) = (ap.add(i * a.rs), bp.add(j), cp.add(i * n + j));
                    macro_rules! by_rows {
                    ($f:ident $(, $flag:literal)?; $($x:expr),*) => {
                        match rows {
                            8 => t.$f::<8 $(, $flag)?>($($x),*),
                            7 => t.$f::<7 $(, $flag)?>($($x),*),
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
                        by_rows!(two, false; at, bt, ct, m1)
                    } else if cols > 16 {
                        by_rows!(two, true; at, bt, ct, m1)
                    } else {
                        by_rows!(one; at, bt, ct, m0)
                    }
                    i += rows;
                }
                j += cols;
            }
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
        /// R rows × 32 columns, or (`MASKED`) 17 to 31, the second vector
        /// through the lane mask `m1`.
        #[target_feature(enable = "avx512f")]
        #[inline]
        unsafe fn two<const R: usize, const MASKED: bool>(&self, a: *const f32, b: *const f32, c: *mut f32, m1: __mmask16) {
            unsafe {
                let mut acc = [[_mm512_setzero_ps(); 2]; R];
                let (mut ak, mut bk) = (a, b);
                for _ in 0..self.k {
                    let b0 = _mm512_loadu_ps(bk);
                    let b1 = if MASKED { _mm512_maskz_loadu_ps(m1, bk.add(16)) } else { _mm512_loadu_ps(bk.add(16)) };
                    for (r, row) in acc.iter_mut().enumerate() {
                        let x = _mm512_set1_ps(*ak.add(r * self.a_rs));
                        row[0] = _mm512_fmadd_ps(x, b0, row[0]);
                        row[1] = _mm512_fmadd_ps(x, b1, row[1]);
                    }
                    // After the last step these point past the operands, where
                    // nothing reads: `add` would promise they stay inside.
                    ak = ak.wrapping_add(self.a_cs);
                    bk = bk.wrapping_add(self.b_rs);
                }
                for (r, row) in acc.iter().enumerate() {
                    let cr = c.add(r * self.c_rs);
                    _mm512_storeu_ps(cr, row[0]);
                    if MASKED {
                        _mm512_mask_storeu_ps(cr.add(16), m1, row[1]);
                    } else {
                        _mm512_storeu_ps(cr.add(16), row[1]);
                    }
                }
            }
        }

        /// R rows × 1 to 16 columns: one vector through a lane mask.
        #[target_feature(enable = "avx512f")]
        #[inline]
        unsafe fn one<const R: usize>(&self, a: *const f32, b: *const f32, c: *mut f32, m0: __mmask16) {
            unsafe {
                let mut acc = [_mm512_setzero_ps(); R];
                let (mut ak, mut bk) = (a, b);
                for _ in 0..self.k {
                    let b0 = _mm512_maskz_loadu_ps(m0, bk);
                    for (r, row) in acc.iter_mut().enumerate() {
                        let x = _mm512_set1_ps(*ak.add(r * self.a_rs));
                        *row = _mm512_fmadd_ps(x, b0, *row);
                    }
                    ak = ak.wrapping_add(self.a_cs);
                    bk = bk.wrapping_add(self.b_rs);
                }
                for (r, row) in acc.iter().enumerate() {
                    _mm512_mask_storeu_ps(c.add(r * self.c_rs), m0, *row);
                }
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

    /// Each tile this test can run here, and a skip line for the others.
    fn tiles_here(what: &str) -> Vec<Isa> {
        let here = available().to_vec();
        for isa in [Isa::Avx2, Isa::Avx512] {
            if !here.contains(&isa) {
                eprintln!("SKIPPED: {what} through the {isa:?} tile: this CPU lacks its instructions");
            }
        }
        here
    }

    #[test]
    fn every_tile_shape_and_stride_gives_the_exact_product() {
        let mut checked = 0;
        let tiles = tiles_here("the exact products");
        // Last tiles of 1 to 8 rows and last strips of every width class of
        // both tiles: for the 16-column one 1, 7, 8, 9, 15 and 16 columns,
        // for the 32-column one 1, 4, 8, 16, 17, 23, 24, 25, 31 and 32.
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
            (8, 32, 8),
            (15, 63, 12),
            (16, 64, 9),
            (9, 40, 8),
            // The 32-column tile's variants by rows: one vector (1-16
            // columns), two (32), two with a masked second (17-31).
            (10, 16, 8),
            (11, 48, 8),
            (7, 48, 9),
            (1, 20, 8),
            (14, 20, 8),
            (2, 32, 8),
            (3, 64, 8),
            (6, 32, 8),
        ];
        for &isa in &tiles {
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
                    assert!(matmul_on(Some(isa), a, b, &mut out, (m, n, k)), "{isa:?}: {m}x{n}x{k} refused");
                    assert_eq!(out, reference(a, b, (m, n, k)), "{isa:?}: {m}x{n}x{k}, a strides ({}, {})", a.rs, a.cs);
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 3 * shapes.len() * tiles.len());
        // What the library calls uses the chosen tile (or gemm, refused here).
        let v = ints(256, 3);
        let view = View { data: &v, offset: 0, rs: 16, cs: 1 };
        let mut out = vec![0f32; 32];
        assert_eq!(matmul(view, view, &mut out, (2, 16, 8)), chosen().is_some());
    }

    #[test]
    fn it_refuses_what_it_does_not_cover_and_writes_nothing() {
        let v = vec![1f32; 256];
        let a = View { data: &v, offset: 0, rs: 16, cs: 1 };
        let b = a;
        let mut out = vec![7f32; 256];
        for isa in available().iter().copied().map(Some).chain([None]) {
            // Each call differs from an accepted one (2×8 · 8×16) in one way.
            let refuse = |a, b, out: &mut [f32], mnk, why| assert!(!matmul_on(isa, a, b, out, mnk), "{isa:?}: {why}");
            refuse(a, View { rs: 1, cs: 16, ..b }, &mut out, (2, 16, 8), "b's columns not contiguous");
            refuse(a, b, &mut out, (2, 15, 8), "n < 16");
            refuse(a, b, &mut out, (2, 16, 7), "k < 8");
            refuse(a, b, &mut out, (1 << 11, 1 << 11, 8), "more than 2^20 multiply-adds");
            refuse(View { offset: 241, ..a }, b, &mut out, (2, 16, 8), "a view past its slice");
            refuse(a, b, &mut out[..31], (2, 16, 8), "a destination too short");
            refuse(View { offset: 300, ..a }, b, &mut out, (0, 16, 8), "no rows (and a past its slice)");
            refuse(a, View { offset: 130, ..b }, &mut out, (2, 16, 8), "b past its slice");
            assert!(out.iter().all(|&x| x == 7.0));
            assert_eq!(matmul_on(isa, a, b, &mut out, (2, 16, 8)), isa.is_some());
            out.fill(7.0);
        }
    }

    #[test]
    fn non_finite_values_propagate_as_ieee_says() {
        for isa in tiles_here("non-finite values") {
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
            assert!(matmul_on(Some(isa), av, bv, &mut out, (2, 16, 8)));
            // inf·0 is NaN; inf·1 + 0·3 is inf; NaN anywhere in a row is NaN.
            assert!(out[0].is_nan(), "{isa:?}");
            assert!(out[1..16].iter().all(|&x| x == f32::INFINITY), "{isa:?}");
            assert!(out[16..].iter().all(|x| x.is_nan()), "{isa:?}");
        }
    }
}
