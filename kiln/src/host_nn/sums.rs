//! Sums of many values, blocked: lanes in the element type, blocks in f64.

use super::NnFloat;

/// Elements summed in the element type before the partial sum joins an
/// f64 total: short enough that rounding stays near one ulp of the block,
/// long enough to run at the speed of the loads.
const BLOCK: usize = 256;
/// Independent partial sums within a block (vector lanes for the compiler).
const LANES: usize = 16;

/// The sum of `xs`: blocks summed in `T` over independent lanes, blocks
/// added in f64. The same order of sums for every call, so the same bits.
pub(crate) fn sum<T: NnFloat>(xs: &[T]) -> f64 {
    let mut total = 0.0f64;
    for block in xs.chunks(BLOCK) {
        total += block_sum(block, |x| x);
    }
    total
}

/// The sum of `f(x)` over one block, in `LANES` partial sums.
#[inline(always)]
pub(crate) fn block_sum<T: NnFloat>(block: &[T], f: impl Fn(T) -> T) -> f64 {
    let mut lanes = [T::ZERO; LANES];
    let mut chunks = block.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            lanes[i] += f(c[i]);
        }
    }
    for (i, &x) in chunks.remainder().iter().enumerate() {
        lanes[i] += f(x);
    }
    lanes.iter().map(|v| v.to_f64()).sum()
}
