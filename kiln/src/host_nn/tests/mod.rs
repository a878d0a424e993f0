//! Tests of the host kernels against the naive definitions in
//! `reference.rs`, against finite differences (f64), and of every argument
//! check.

mod conv;
mod fuzz;
mod interp;
mod norm;
mod pool;

use super::NnFloat;

/// xorshift64*: the same cases on every machine.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// In `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// In `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    /// In [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// `n` values in [−2, 2], multiples of 1/256 (exact in f32 as in f64).
    pub fn vals(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| ((self.unit() * 4.0 - 2.0) * 256.0).round() / 256.0).collect()
    }
}

pub fn to<T: NnFloat>(v: &[f64]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x)).collect()
}

/// Asserts `got` matches `want` within `tol` of the larger of 1 and the
/// largest `|want|` (sums of products cancel: an element near 0 carries the
/// rounding of terms as large as the others).
#[track_caller]
pub fn close<T: NnFloat>(got: &[T], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        if w.is_nan() && g.is_nan() {
            continue;
        }
        assert!((g - w).abs() <= tol * scale, "{what}: element {i} is {g}, expected {w} (tolerance {tol:e} × {scale})");
    }
}

/// Checks `grad` against central differences of `loss` at every element
/// of `x` (f64; the ops are smooth where they are evaluated).
#[track_caller]
pub fn fd_check(x: &[f64], grad: &[f64], loss: impl Fn(&[f64]) -> f64, what: &str) {
    let h = 1e-5;
    let mut x = x.to_vec();
    for i in 0..x.len() {
        let orig = x[i];
        x[i] = orig + h;
        let up = loss(&x);
        x[i] = orig - h;
        let down = loss(&x);
        x[i] = orig;
        let fd = (up - down) / (2.0 * h);
        assert!((fd - grad[i]).abs() <= 1e-6 * (1.0 + fd.abs()), "{what}: gradient element {i} is {}, finite difference {fd}", grad[i]);
    }
}

/// Tolerance of `T` against an f64 reference.
pub fn tol<T: NnFloat>() -> f64 {
    if T::IS_F32 {
        2e-6
    } else {
        1e-13
    }
}
