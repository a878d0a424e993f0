//! The seeded generators the tests draw cases from: two streams (so that a
//! suite keeps the cases its seeds have always given) behind one set of
//! draws. Never a source of security, only of reproducible cases.

/// What a test draws; each generator gives `next`.
pub trait Draw {
    /// 64 random bits.
    fn next(&mut self) -> u64;
    /// 0..n (0 when n is 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// lo..=hi.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    /// Uniform in [0, 1), 53 bits.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// True with probability `p`.
    fn coin(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    /// True `percent` times in a hundred.
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    /// One of `items` (which must not be empty).
    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

/// xorshift64* (Vigna): the differential and file-fuzzing suites' stream.
pub struct XorShift(pub u64);

impl Draw for XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// SplitMix64: the program fuzzer's and the CNN fuzzer's stream (also what
/// kiln's own `permutation_from_seed` uses).
pub struct SplitMix(pub u64);

impl Draw for SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
