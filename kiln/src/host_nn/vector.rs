//! The vector instruction sets the f32 kernels are written for: one generic
//! kernel body per kernel, compiled for AVX-512 (16 lanes, 32 registers) and
//! for AVX2 with FMA (8 lanes, 16 registers), picked at run time.

/// Which vector instructions the f32 kernels use on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    /// No SIMD kernels: the portable paths (the `gemm` crate).
    Portable,
    /// AVX2 and FMA.
    Avx2,
    /// AVX-512F.
    Avx512,
}

/// The best level this CPU has, lowered by `KILN_HOST_NN_ISA=avx2|portable`
/// (read once) and by [`set_ceiling`] (tests).
pub(crate) fn level() -> Level {
    use std::sync::atomic::Ordering;
    use std::sync::OnceLock;
    static DETECTED: OnceLock<Level> = OnceLock::new();
    let detected = *DETECTED.get_or_init(|| {
        let cpu = detect();
        match std::env::var("KILN_HOST_NN_ISA").as_deref() {
            Ok("portable") => Level::Portable,
            Ok("avx2") => cpu.min(Level::Avx2),
            _ => cpu,
        }
    });
    let ceiling = match CEILING.load(Ordering::Relaxed) {
        0 => Level::Portable,
        1 => Level::Avx2,
        _ => Level::Avx512,
    };
    detected.min(ceiling)
}

static CEILING: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Caps the level for the whole process (the tests run every path this way;
/// results stay correct whatever runs concurrently, only slower or faster).
#[cfg(test)]
pub(crate) fn set_ceiling(l: Level) {
    CEILING.store(l as u8, std::sync::atomic::Ordering::Relaxed);
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Level::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Level::Avx2;
        }
    }
    Level::Portable
}

/// One vector instruction set: the operations the kernel bodies use, all
/// `#[inline(always)]` so that they compile inside the `#[target_feature]`
/// entry points of [`crate::host_nn::conv`]'s kernels.
///
/// # Safety
/// Every operation requires the CPU to have the instruction set; pointers
/// must be valid for `LANES` f32s.
pub(crate) trait Isa: Copy + Send + Sync + 'static {
    /// A vector of f32.
    type V: Copy;
    /// f32 lanes per vector.
    const LANES: usize;
    /// Accumulators a tile may keep (of the registers there are).
    const ACCUMULATORS: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn splat(x: f32) -> Self::V;
    /// `a·b + c`.
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// The even and the odd elements of the `2·LANES` values at `p`.
    unsafe fn load_even_odd(p: *const f32) -> (Self::V, Self::V);
    /// `a` and `b` interleaved: (`a0 b0 a1 b1 …` up to lane LANES/2,
    /// the rest).
    unsafe fn interleave(a: Self::V, b: Self::V) -> (Self::V, Self::V);
    /// `out[i] += Σ lanes of acc[i]` for every i (a transposing tree).
    unsafe fn add_sums(acc: &[Self::V], out: *mut f32);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Isa;
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub(crate) struct Avx512;

    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    impl Isa for Avx512 {
        type V = __m512;
        const LANES: usize = 16;
        const ACCUMULATORS: usize = 24;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_sub_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn load_even_odd(p: *const f32) -> (__m512, __m512) {
            unsafe {
                let (a, b) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
                (_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b))
            }
        }
        #[inline(always)]
        unsafe fn interleave(a: __m512, b: __m512) -> (__m512, __m512) {
            unsafe {
                let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
                let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
                (_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b))
            }
        }
        #[inline(always)]
        unsafe fn add_sums(acc: &[__m512], out: *mut f32) {
            unsafe {
                let mut chunks = acc.chunks_exact(16);
                let mut at = out;
                for c in &mut chunks {
                    let v: &[__m512; 16] = c.try_into().unwrap_or_else(|_| unreachable!());
                    _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), sum16(v)));
                    at = at.add(16);
                }
                for (i, &v) in chunks.remainder().iter().enumerate() {
                    *at.add(i) += _mm512_reduce_add_ps(v);
                }
            }
        }
    }

    /// Lane i of the result is the sum of `v[i]`'s lanes: 45 instructions
    /// instead of 16 reductions of 8.
    #[inline(always)]
    unsafe fn sum16(v: &[__m512; 16]) -> __m512 {
        unsafe {
            // Pairs: per 128-bit quarter, [a0+a2, b0+b2, a1+a3, b1+b3].
            let p: [__m512; 8] = std::array::from_fn(|j| {
                let (a, b) = (v[2 * j], v[2 * j + 1]);
                _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
            });
            // Quads: per quarter, that quarter's sum of a, b, c, d.
            let q: [__m512; 4] = std::array::from_fn(|j| {
                let (a, b) = (_mm512_castps_pd(p[2 * j]), _mm512_castps_pd(p[2 * j + 1]));
                _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)))
            });
            // Add the quarters: h0 holds vectors 0-7 as [0-3 half, 0-3 half, 4-7, 4-7].
            let h0 = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(q[0], q[1]), _mm512_shuffle_f32x4::<0b11_01_11_01>(q[0], q[1]));
            let h1 = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(q[2], q[3]), _mm512_shuffle_f32x4::<0b11_01_11_01>(q[2], q[3]));
            // Quarters: the totals of vectors 0-3, 4-7, 8-11, 12-15.
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(h0, h1), _mm512_shuffle_f32x4::<0b11_01_11_01>(h0, h1))
        }
    }

    impl Isa for Avx2 {
        type V = __m256;
        const LANES: usize = 8;
        const ACCUMULATORS: usize = 12;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_sub_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn load_even_odd(p: *const f32) -> (__m256, __m256) {
            unsafe {
                let (a, b) = (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
                // Per 128-bit half [a0 a2 b0 b2 | a4 a6 b4 b6], then the 64-bit pairs in order.
                let even = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
                let odd = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
                (
                    _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(even))),
                    _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(odd))),
                )
            }
        }
        #[inline(always)]
        unsafe fn interleave(a: __m256, b: __m256) -> (__m256, __m256) {
            unsafe {
                let (lo, hi) = (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
                (_mm256_permute2f128_ps::<0x20>(lo, hi), _mm256_permute2f128_ps::<0x31>(lo, hi))
            }
        }
        #[inline(always)]
        unsafe fn add_sums(acc: &[__m256], out: *mut f32) {
            unsafe {
                let mut chunks = acc.chunks_exact(8);
                let mut at = out;
                for c in &mut chunks {
                    let v: &[__m256; 8] = c.try_into().unwrap_or_else(|_| unreachable!());
                    _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), sum8(v)));
                    at = at.add(8);
                }
                for (i, &v) in chunks.remainder().iter().enumerate() {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                    *at.add(i) += lanes.iter().sum::<f32>();
                }
            }
        }
    }

    /// Lane i of the result is the sum of `v[i]`'s lanes.
    #[inline(always)]
    unsafe fn sum8(v: &[__m256; 8]) -> __m256 {
        unsafe {
            let p: [__m256; 4] = std::array::from_fn(|j| {
                let (a, b) = (v[2 * j], v[2 * j + 1]);
                _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b))
            });
            let q: [__m256; 2] = std::array::from_fn(|j| {
                let (a, b) = (_mm256_castps_pd(p[2 * j]), _mm256_castps_pd(p[2 * j + 1]));
                _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)))
            });
            // Halves: q[0] holds vectors 0-3 per half, q[1] vectors 4-7.
            _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(q[0], q[1]), _mm256_permute2f128_ps::<0x31>(q[0], q[1]))
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};
