//! Counter-based random numbers (Philox 4x32-10). Element `i` of a random
//! tensor depends only on the seed and its counter, never on the device or
//! the thread that computes it, so CPU, simulated GPUs and CUDA agree exactly.

use std::cell::Cell;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4x32 with 10 rounds: four random u32 from a 128-bit counter and a
/// 64-bit key.
#[inline]
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [((p1 >> 32) as u32) ^ c[1] ^ k[0], p1 as u32, ((p0 >> 32) as u32) ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// The four words for element `index` of a draw with this seed.
#[inline]
pub(crate) fn words(seed: u64, index: u64) -> [u32; 4] {
    philox4x32([index as u32, (index >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32])
}

/// Uniform in [0, 1) with 53 random bits.
#[inline]
pub(crate) fn uniform(seed: u64, index: u64) -> f64 {
    let w = words(seed, index);
    let bits = ((w[0] as u64) << 21) ^ ((w[1] as u64) >> 11);
    (bits & ((1u64 << 53) - 1)) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal by Box–Muller on two of the words.
#[inline]
pub(crate) fn normal(seed: u64, index: u64) -> f64 {
    let w = words(seed, index);
    let u1 = (w[2] as f64 + 0.5) * (1.0 / 4_294_967_296.0);
    let u2 = w[3] as f64 * (1.0 / 4_294_967_296.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

pub(crate) const DEFAULT_SEED: u64 = 0x6b69_6c6e; // "kiln"

thread_local! {
    static STATE: Cell<(u64, u64)> = const { Cell::new((DEFAULT_SEED, 0)) };
}

/// Sets the seed of this thread's generator and rewinds it, so that the same
/// sequence of random calls gives the same values, on every device.
///
/// The generator is per thread (each thread starts from the same default
/// seed), so that tests and worker threads are reproducible without
/// coordinating: seed the thread that creates the random tensors.
///
/// ```
/// use kiln::{Tensor, cpu};
/// kiln::manual_seed(42);
/// let a = Tensor::rand((3,), &cpu())?.to_vec::<f32>()?;
/// kiln::manual_seed(42);
/// let b = Tensor::rand((3,), &cpu())?.to_vec::<f32>()?;
/// assert_eq!(a, b);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn manual_seed(seed: u64) {
    STATE.with(|s| s.set((seed, 0)));
}

/// Reserves `n` counters of this thread's generator: (seed, first counter).
/// The counter wraps around after 2^64 values, as Philox's counter space does.
pub(crate) fn reserve(n: usize) -> (u64, u64) {
    STATE.with(|s| {
        let (seed, offset) = s.get();
        s.set((seed, offset.wrapping_add(n as u64)));
        (seed, offset)
    })
}

/// This thread's generator state, to put back with [`restore`] when the
/// operation that reserved counters fails.
pub(crate) fn state() -> (u64, u64) {
    STATE.with(|s| s.get())
}

/// Puts back a state taken with [`state`].
pub(crate) fn restore(state: (u64, u64)) {
    STATE.with(|s| s.set(state));
}

/// A random u64 from the thread's generator (for shuffles).
#[allow(dead_code)]
pub(crate) fn next_u64() -> u64 {
    let (seed, offset) = reserve(1);
    let w = words(seed, offset);
    ((w[0] as u64) << 32) | w[1] as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Random123's published known-answer vectors for philox4x32-10.
        assert_eq!(philox4x32([0, 0, 0, 0], [0, 0]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32([0xffffffff; 4], [0xffffffff; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
    }

    #[test]
    fn uniform_in_range() {
        for i in 0..1000 {
            let u = uniform(7, i);
            assert!((0.0..1.0).contains(&u));
        }
    }
}
