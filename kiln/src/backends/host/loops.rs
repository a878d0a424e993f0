//! The loops of host kernels, written once and monomorphised per op: an op
//! supplies its element function, these walk the operands. Contiguous
//! operands take a dense loop the compiler vectorises; strided ones walk
//! rows of the last dimension; above [`PAR_MIN`] elements the work is split
//! over kiln's pool when `threads > 1` (the caller holds the locks).

use super::num::Accumulate;
use crate::base::buffer::WithDType;
use crate::base::shape::{Dims, Layout, Shape};
use crate::runtime::pool::on_pool;
use rayon::prelude::*;

/// Runs `f` compiled for AVX2 where this CPU has it (checked once; the
/// standard library caches the answer). kiln is built for the baseline
/// x86-64 (SSE2), so without this every elementwise loop ran four f32 lanes
/// wide; `f` is inlined into an AVX2 function, so its loops are vectorised
/// eight wide. Only the width changes: no fused multiply-add is enabled,
/// and each element is computed by the same operations in the same order,
/// so results are bit-identical on every x86-64 CPU.
#[inline(always)]
pub(crate) fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: this CPU has AVX2, the only feature `avx2` enables.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// Below this many elements a loop runs as built: the call into the AVX2
/// copy costs more than the width saves (W4's one-element add).
const WIDE_MIN: usize = 64;

/// [`wide`] for a loop over `n` elements, plain below [`WIDE_MIN`].
#[inline(always)]
pub(crate) fn wide_for<R>(n: usize, f: impl FnOnce() -> R) -> R {
    if n < WIDE_MIN {
        f()
    } else {
        wide(f)
    }
}

/// Elementwise work below this many elements stays on one thread.
pub(crate) const PAR_MIN: usize = 1 << 16;
/// Elements per parallel chunk.
pub(crate) const CHUNK: usize = 1 << 15;

/// out[i] = f(src[layout(i)]), dense and parallel when it can be.
#[inline(always)]
pub(crate) fn map_unary<T: WithDType, U: WithDType, F: Fn(T) -> U + Sync>(src: &[T], layout: &Layout, out: &mut [U], threads: usize, f: F) {
    if let Some((a, b)) = layout.contiguous_range() {
        let src = &src[a..b];
        if threads > 1 && out.len() >= PAR_MIN {
            on_pool(|| {
                out.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(o, s)| {
                    wide(|| {
                        for (o, &s) in o.iter_mut().zip(s) {
                            *o = f(s);
                        }
                    })
                })
            });
        } else {
            wide_for(out.len(), || {
                for (o, &s) in out.iter_mut().zip(src) {
                    *o = f(s);
                }
            })
        }
    } else {
        for (o, i) in out.iter_mut().zip(layout.offsets()) {
            *o = f(src[i]);
        }
    }
}

/// How a unary function is applied: from a view into a new buffer
/// ([`Mapped`]) or over a buffer in place ([`InPlace`]). A family's op
/// table is written once, for both.
pub(crate) trait Apply<T> {
    fn apply<F: Fn(T) -> T + Sync>(self, f: F);
}

pub(crate) struct Mapped<'a, T> {
    pub src: &'a [T],
    pub layout: &'a Layout,
    pub out: &'a mut [T],
    pub threads: usize,
}

impl<T: WithDType> Apply<T> for Mapped<'_, T> {
    #[inline(always)]
    fn apply<F: Fn(T) -> T + Sync>(self, f: F) {
        map_unary(self.src, self.layout, self.out, self.threads, f)
    }
}

/// A buffer rewritten element by element (numpy's temporary elision).
pub(crate) struct InPlace<'a, T> {
    pub buf: &'a mut [T],
    pub threads: usize,
}

impl<T: WithDType> Apply<T> for InPlace<'_, T> {
    #[inline(always)]
    fn apply<F: Fn(T) -> T + Sync>(self, f: F) {
        if self.threads > 1 && self.buf.len() >= PAR_MIN {
            on_pool(|| {
                self.buf.par_chunks_mut(CHUNK).for_each(|c| {
                    wide(|| {
                        for x in c.iter_mut() {
                            *x = f(*x);
                        }
                    })
                })
            });
        } else {
            wide_for(self.buf.len(), || {
                for x in self.buf.iter_mut() {
                    *x = f(*x);
                }
            })
        }
    }
}

/// Row starts of a layout without its last dimension, in row-major order:
/// (outer layout, row length, stride along the row).
pub(crate) fn rows(layout: &Layout) -> (Layout, usize, usize) {
    let dims = layout.dims();
    if dims.is_empty() {
        return (Layout { shape: Shape::from(()), strides: Dims::new(), offset: layout.offset }, 1, 1);
    }
    let r = dims.len() - 1;
    let outer = Layout { shape: Shape::from(&dims[..r]), strides: Dims::from_slice(&layout.strides[..r]), offset: layout.offset };
    (outer, dims[r], layout.strides[r])
}

/// Two views of one shape, with size-1 dimensions dropped and neighbouring
/// dimensions merged wherever both views step through them evenly, so that
/// e.g. a (32, 1) + (1,) broadcast becomes one row of 32 instead of 32 rows
/// of one.
pub(crate) fn simplify_pair(la: &Layout, lb: &Layout) -> (Layout, Layout) {
    let dims = la.dims();
    let (mut d, mut sa, mut sb) = (Dims::new(), Dims::new(), Dims::new());
    for (i, &n) in dims.iter().enumerate() {
        if n == 1 {
            continue;
        }
        if let (Some(&pd), Some(&pa), Some(&pb)) = (d.last(), sa.last(), sb.last())
            && pa == la.strides[i] * n
            && pb == lb.strides[i] * n
        {
            let last = d.len() - 1;
            d[last] = pd * n;
            sa[last] = la.strides[i];
            sb[last] = lb.strides[i];
            continue;
        }
        d.push(n);
        sa.push(la.strides[i]);
        sb.push(lb.strides[i]);
    }
    let shape = Shape(d);
    (Layout { shape: shape.clone(), strides: sa, offset: la.offset }, Layout { shape, strides: sb, offset: lb.offset })
}

/// Offset of row `row` of an outer layout (index decomposition).
pub(crate) fn row_start(outer: &Layout, mut row: usize) -> usize {
    let mut off = outer.offset;
    for d in (0..outer.dims().len()).rev() {
        let n = outer.dims()[d];
        off += (row % n) * outer.strides[d];
        row /= n;
    }
    off
}

/// out[i] = f(a[la(i)], b[lb(i)]): dense, broadcast rows, or strided.
#[inline(always)]
pub(crate) fn map_binary<T: Copy + Send + Sync, U: Copy + Send + Sync, F: Fn(T, T) -> U + Sync>(
    a: &[T],
    la: &Layout,
    b: &[T],
    lb: &Layout,
    out: &mut [U],
    threads: usize,
    f: F,
) {
    if let (Some((a0, a1)), Some((b0, b1))) = (la.contiguous_range(), lb.contiguous_range()) {
        let (a, b) = (&a[a0..a1], &b[b0..b1]);
        if threads > 1 && out.len() >= PAR_MIN {
            on_pool(|| {
                out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK))).for_each(|(o, (a, b))| {
                    wide(|| {
                        for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
                            *o = f(x, y);
                        }
                    })
                })
            });
        } else {
            wide_for(out.len(), || {
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    *o = f(x, y);
                }
            })
        }
        return;
    }
    // Broadcast or strided: walk rows of the last dimension.
    let (la, lb) = simplify_pair(la, lb);
    let (oa, n, sa) = rows(&la);
    let (ob, _, sb) = rows(&lb);
    let row = |r: usize, o: &mut [U]| {
        let (pa, pb) = (row_start(&oa, r), row_start(&ob, r));
        wide_for(n, || match (sa, sb) {
            (1, 1) => {
                for ((o, &x), &y) in o.iter_mut().zip(&a[pa..pa + n]).zip(&b[pb..pb + n]) {
                    *o = f(x, y);
                }
            }
            (1, 0) => {
                let y = b[pb];
                for (o, &x) in o.iter_mut().zip(&a[pa..pa + n]) {
                    *o = f(x, y);
                }
            }
            (0, 1) => {
                let x = a[pa];
                for (o, &y) in o.iter_mut().zip(&b[pb..pb + n]) {
                    *o = f(x, y);
                }
            }
            _ => {
                for (j, o) in o.iter_mut().enumerate() {
                    *o = f(a[pa + j * sa], b[pb + j * sb]);
                }
            }
        })
    };
    if n == 0 {
        return;
    }
    if threads > 1 && out.len() >= PAR_MIN {
        let rows_per = (CHUNK / n).max(1);
        on_pool(|| {
            out.par_chunks_mut(rows_per * n).enumerate().for_each(|(c, chunk)| {
                for (i, o) in chunk.chunks_mut(n).enumerate() {
                    row(c * rows_per + i, o);
                }
            })
        });
    } else {
        for (r, o) in out.chunks_mut(n).enumerate() {
            row(r, o);
        }
    }
}

/// How a binary function is applied: over two views of one shape into a
/// new buffer ([`Mapped2`], any layouts) or over dense runs ([`Dense2`],
/// the CPU's path for small operands). A family's op table serves both.
pub(crate) trait Apply2<T, U> {
    fn apply<F: Fn(T, T) -> U + Sync>(self, f: F);
}

pub(crate) struct Mapped2<'a, T, U> {
    pub a: &'a [T],
    pub la: &'a Layout,
    pub b: &'a [T],
    pub lb: &'a Layout,
    pub out: &'a mut [U],
    pub threads: usize,
}

impl<T: Copy + Send + Sync, U: Copy + Send + Sync> Apply2<T, U> for Mapped2<'_, T, U> {
    #[inline(always)]
    fn apply<F: Fn(T, T) -> U + Sync>(self, f: F) {
        map_binary(self.a, self.la, self.b, self.lb, self.out, self.threads, f)
    }
}

/// Dense runs at least as long as `out`, on the calling thread.
pub(crate) struct Dense2<'a, T, U> {
    pub a: &'a [T],
    pub b: &'a [T],
    pub out: &'a mut [U],
}

impl<T: Copy, U> Apply2<T, U> for Dense2<'_, T, U> {
    #[inline(always)]
    fn apply<F: Fn(T, T) -> U + Sync>(self, f: F) {
        // Indexed, with the bounds checked once up front: a few elements
        // take a plain loop, longer runs a vectorised one.
        let n = self.out.len();
        let (a, b, out) = (&self.a[..n], &self.b[..n], self.out);
        wide_for(n, || {
            for i in 0..n {
                out[i] = f(a[i], b[i]);
            }
        })
    }
}

/// A reduction's arithmetic: its identity and how two partial results
/// combine, in the accumulator type `A` (f64 for float sums and products, so
/// that the result hardly depends on how the work was split; the dtype
/// itself otherwise, so integers wrap like every integer op).
pub(crate) struct Fold<A, C, M, F> {
    pub init: A,
    pub combine: C,
    /// Applied to each source element (widened) before it is combined.
    pub map: M,
    /// Applied to each finished accumulator before its one rounding to the
    /// dtype (a norm's square root, taken on the f64 sum of squares).
    pub finish: F,
}

/// Folds a dense run in eight independent lanes (vectorised; the order of
/// the combinations does not change an associative reduction beyond
/// rounding, and f64 lanes make float sums exact to numpy's).
#[inline(always)]
fn fold_dense<T: Copy, A: Copy, C: Fn(A, A) -> A, M, F>(s: &[T], to: impl Fn(T) -> A, fold: &Fold<A, C, M, F>) -> A {
    wide_for(s.len(), || fold_lanes(s, to, fold))
}

/// [`fold_dense`]'s loop.
#[inline(always)]
fn fold_lanes<T: Copy, A: Copy, C: Fn(A, A) -> A, M, F>(s: &[T], to: impl Fn(T) -> A, fold: &Fold<A, C, M, F>) -> A {
    const LANES: usize = 8;
    let mut acc = [fold.init; LANES];
    let chunks = s.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = (fold.combine)(acc[j], to(c[j]));
        }
    }
    let mut total = acc.into_iter().fold(fold.init, |a, b| (fold.combine)(a, b));
    for &x in rest {
        total = (fold.combine)(total, to(x));
    }
    total
}

/// out (src's shape with `dims` set to 1) = the fold of src over `dims`,
/// accumulated in `T::Acc`.
#[inline(always)]
pub(crate) fn reduce<
    T: Accumulate,
    C: Fn(T::Acc, T::Acc) -> T::Acc + Sync,
    M: Fn(T::Acc) -> T::Acc + Sync,
    F: Fn(T::Acc) -> T::Acc + Sync,
>(
    s: &[T],
    l: &Layout,
    dims: &[usize],
    out: &mut [T],
    threads: usize,
    fold: Fold<T::Acc, C, M, F>,
) {
    let (map, finish) = (&fold.map, &fold.finish);
    let (to, from) = (move |x: T| map(T::widen(x)), move |a: T::Acc| T::narrow(finish(a)));
    let rank = l.dims().len();
    if l.elem_count() == 0 {
        // Nothing to combine, and an empty layout's strides may be
        // meaningless (saturated): never walk them.
        out.fill(from(fold.init));
        return;
    }
    // Everything, dense: one pass, parallel for big inputs.
    if out.len() == 1
        && let Some((a, b)) = l.contiguous_range()
    {
        let s = &s[a..b];
        let total = if threads > 1 && s.len() >= PAR_MIN {
            on_pool(|| s.par_chunks(CHUNK).map(|c| fold_dense(c, to, &fold)).reduce(|| fold.init, |x, y| (fold.combine)(x, y)))
        } else {
            fold_dense(s, to, &fold)
        };
        out[0] = from(total);
        return;
    }
    if rank == 0 {
        out[0] = from((fold.combine)(fold.init, to(s[l.offset])));
        return;
    }
    // Where each source element lands: the output's strides with 0 on the
    // reduced dimensions.
    let out_dims: Dims = (0..rank).map(|d| if dims.contains(&d) { 1 } else { l.dims()[d] }).collect();
    let out_strides = Shape(out_dims).strides();
    let bcast_strides: Dims = (0..rank).map(|d| if dims.contains(&d) { 0 } else { out_strides[d] }).collect();
    let out_layout = Layout { shape: l.shape.clone(), strides: bcast_strides, offset: 0 };
    let (l, out_layout) = simplify_pair(l, &out_layout);
    let (so, n, ss) = rows(&l);
    let (oo, _, os) = rows(&out_layout);
    let rows_count = l.elem_count() / n.max(1);
    // Every output accumulates in A (in f32, 2^20 rows of 0.1 summed over a
    // non-last dimension drift to 105891.84).
    let mut acc: Vec<T::Acc> = vec![fold.init; out.len()];
    for r in 0..rows_count {
        let (ps, po) = (row_start(&so, r), row_start(&oo, r));
        if os == 0 {
            // The last dimension is reduced: fold the row into one value.
            let v = if ss == 1 {
                fold_dense(&s[ps..ps + n], to, &fold)
            } else {
                (0..n).fold(fold.init, |a, j| (fold.combine)(a, to(s[ps + j * ss])))
            };
            acc[po] = (fold.combine)(acc[po], v);
        } else {
            for j in 0..n {
                acc[po + j * os] = (fold.combine)(acc[po + j * os], to(s[ps + j * ss]));
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = from(a);
    }
}

/// Fills `v` with `x`, over the pool for big buffers.
pub(crate) fn fill<T: WithDType>(v: &mut [T], x: T, threads: usize) {
    if threads > 1 && v.len() >= PAR_MIN {
        on_pool(|| v.par_chunks_mut(CHUNK).for_each(|c| c.fill(x)));
    } else {
        v.fill(x);
    }
}

/// Sets each element of `v` to `f(i, v[i])` (its index and its value), over
/// the pool for big buffers.
pub(crate) fn update_indexed<T: Copy + Send>(v: &mut [T], threads: usize, f: impl Fn(usize, T) -> T + Sync) {
    let body = |start: usize, chunk: &mut [T]| {
        for (j, x) in chunk.iter_mut().enumerate() {
            *x = f(start + j, *x);
        }
    };
    if threads > 1 && v.len() >= PAR_MIN {
        on_pool(|| v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| body(c * CHUNK, chunk)));
    } else {
        body(0, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` over `x` plainly, as built.
    #[inline(never)]
    fn plain<F: Fn(f32) -> f32>(x: &[f32], f: F) -> Vec<f32> {
        x.iter().map(|&v| f(v)).collect()
    }

    /// The AVX2 copy and the baseline build compute the same bits. Its teeth
    /// are in an optimised build (`cargo test --release -p kiln --lib`),
    /// where the loops are vectorised; test builds of kiln are lightly
    /// optimised, and there it checks the dispatch alone.
    #[test]
    fn the_avx2_loops_give_the_bits_of_the_plain_ones() {
        // Values across the range, with the specials and subnormals.
        let mut x: Vec<f32> = (0..4099u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)) % 1e6).collect();
        x.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE / 4.0, 1e-40, -3.5]);
        type Case = (&'static str, fn(f32) -> f32);
        let fns: [Case; 6] = [
            // a*b+c is where a build with FMA would fuse and round once.
            ("x*x*0.1+0.3", |v| v * v * 0.1 + 0.3),
            ("1/(1+exp(-x))", |v| 1.0 / (1.0 + (-v).exp())),
            ("sqrt", f32::sqrt),
            ("max(x,0)", |v| v.max(0.0)),
            ("tanh", f32::tanh),
            ("x/3-x", |v| v / 3.0 - v),
        ];
        for (name, f) in fns {
            let want = plain(&x, f);
            let layout = Layout::contiguous(Shape::from(x.len()));
            let mut got = vec![0f32; x.len()];
            map_unary(&x, &layout, &mut got, 1, f);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{name}({}) = {a} wide, {b} plain", x[i]);
            }
        }
        // A sum over lanes, in f64, the same way.
        let fold = Fold { init: 0f64, combine: |a: f64, b: f64| a + b, map: |a: f64| a, finish: |a: f64| a };
        let finite: Vec<f32> = x.iter().copied().filter(|v| v.is_finite()).collect();
        assert!(finite.len() > 3000);
        let wide_sum = fold_dense(&finite, |v: f32| f64::from(v), &fold);
        let plain_sum = fold_lanes(&finite, |v: f32| f64::from(v), &fold);
        assert_eq!(wide_sum.to_bits(), plain_sum.to_bits());
    }
}
