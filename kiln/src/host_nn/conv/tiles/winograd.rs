//! Winograd F(2×2, 3×3)'s transform bodies, compiled inside each
//! instruction set's `#[target_feature]` entry points ([`super::Kernels`]).
// The transforms index the 4×4 tiles as their formulas do.
#![allow(clippy::needless_range_loop)]

use crate::host_nn::vector::Isa;

/// `Bᵀ d B` of a row of tiles: `rows[r]` is row r of the tiles' 4-row
/// strip of the band (tile j's columns at `2j .. 2j + 4`); tile j's
/// element ξ goes to `v[ξ·xi_stride + j]`. Writes up to `LANES − 1`
/// tiles past `tw` (the caller leaves room).
///
/// # Safety
/// The CPU has `I`; each row holds `2·tw + 2·LANES + 2` values; `v` has
/// room for the writes.
#[inline(always)]
pub unsafe fn input_row<I: Isa>(rows: [*const f32; 4], tw: usize, v: *mut f32, xi_stride: usize) {
    unsafe {
        let mut j = 0;
        while j < tw {
            let mut e = [[I::zero(); 4]; 4];
            for (er, row) in e.iter_mut().zip(rows) {
                let (d0, d1) = I::load_even_odd(row.add(2 * j));
                let (d2, d3) = I::load_even_odd(row.add(2 * j + 2));
                *er = [I::sub(d0, d2), I::add(d1, d2), I::sub(d2, d1), I::sub(d1, d3)];
            }
            for k in 0..4 {
                let at = v.add(k * xi_stride + j);
                I::store(at, I::sub(e[0][k], e[2][k]));
                I::store(at.add(4 * xi_stride), I::add(e[1][k], e[2][k]));
                I::store(at.add(8 * xi_stride), I::sub(e[2][k], e[1][k]));
                I::store(at.add(12 * xi_stride), I::sub(e[1][k], e[3][k]));
            }
            j += I::LANES;
        }
    }
}

/// `Aᵀ m A + bias` of a row of tiles (tile j's element ξ at
/// `m[ξ·xi_stride + j]`): output rows `out[0]` and, when `rows` is 2,
/// `out[1]`, columns `2j, 2j + 1` below `ow`.
///
/// # Safety
/// The CPU has `I`; `m` is readable at every element of `tw` tiles
/// rounded up to whole vectors; the output rows hold `ow` values,
/// `ow ≤ 2·tw`.
#[inline(always)]
pub unsafe fn output_row<I: Isa>(m: *const f32, xi_stride: usize, tw: usize, bias: f32, out: [*mut f32; 2], rows: usize, ow: usize) {
    unsafe {
        let b = I::splat(bias);
        let mut j = 0;
        while j < tw {
            let mut s = [[I::zero(); 4]; 2];
            for k in 0..4 {
                let at = m.add(k * xi_stride + j);
                let (m0, m1, m2, m3) =
                    (I::load(at), I::load(at.add(4 * xi_stride)), I::load(at.add(8 * xi_stride)), I::load(at.add(12 * xi_stride)));
                s[0][k] = I::add(I::add(m0, m1), m2);
                s[1][k] = I::sub(I::sub(m1, m2), m3);
            }
            for (a, sa) in s.iter().enumerate().take(rows) {
                let y0 = I::add(I::add(I::add(sa[0], sa[1]), sa[2]), b);
                let y1 = I::add(I::sub(I::sub(sa[1], sa[2]), sa[3]), b);
                let (lo, hi) = I::interleave(y0, y1);
                let dst = out[a].add(2 * j);
                let left = ow - 2 * j;
                if left >= 2 * I::LANES {
                    I::store(dst, lo);
                    I::store(dst.add(I::LANES), hi);
                } else {
                    let mut tail = [0f32; 32];
                    I::store(tail.as_mut_ptr(), lo);
                    I::store(tail.as_mut_ptr().add(I::LANES), hi);
                    std::ptr::copy_nonoverlapping(tail.as_ptr(), dst, left);
                }
            }
            j += I::LANES;
        }
    }
}

/// `A dY Aᵀ` of a row of output-gradient tiles: `rows[a]` is gradient
/// row a of the tiles (tile j's columns at `2j, 2j + 1`, zero past the
/// output); tile j's element ξ goes to `z[ξ·xi_stride + j]`. Writes up
/// to `LANES − 1` tiles past `tw`.
///
/// # Safety
/// The CPU has `I`; each row holds `2·tw + 2·LANES` values; `z` has room.
#[inline(always)]
pub unsafe fn gradient_row<I: Isa>(rows: [*const f32; 2], tw: usize, z: *mut f32, xi_stride: usize) {
    unsafe {
        let zero = I::zero();
        let mut j = 0;
        while j < tw {
            let (y00, y01) = I::load_even_odd(rows[0].add(2 * j));
            let (y10, y11) = I::load_even_odd(rows[1].add(2 * j));
            let q = [
                [y00, y01],
                [I::add(y00, y10), I::add(y01, y11)],
                [I::sub(y00, y10), I::sub(y01, y11)],
                [I::sub(zero, y10), I::sub(zero, y11)],
            ];
            for (r, [a, b]) in q.iter().enumerate() {
                let at = z.add(4 * r * xi_stride + j);
                I::store(at, *a);
                I::store(at.add(xi_stride), I::add(*a, *b));
                I::store(at.add(2 * xi_stride), I::sub(*a, *b));
                I::store(at.add(3 * xi_stride), I::sub(zero, *b));
            }
            j += I::LANES;
        }
    }
}
