//! Range indexing, `x.i((.., 0..2, -1))` (PyTorch's `x[:, 0:2, -1]`,
//! candle's `i`): one selector per leading dimension, built from `narrow`
//! and `squeeze`, so the result is a view (no copy) and its gradient comes
//! from theirs.

use crate::base::error::{Error, Result};
use crate::Tensor;
use std::ops::{Bound, Range, RangeFrom, RangeFull, RangeInclusive, RangeTo, RangeToInclusive};

/// What [`Tensor::i`] takes for one dimension: `..`, a range (`a..b`,
/// `a..`, `..b`, `a..=b`, `..=b`) or a single position, which removes the
/// dimension. Negative positions and bounds (of a signed type) count from
/// the end, as in PyTorch.
///
/// ```
/// use kiln::Selector;
/// use std::ops::Bound;
/// assert_eq!(Selector::from(1..3), Selector::Range(Bound::Included(1), Bound::Excluded(3)));
/// assert_eq!(Selector::from(-1), Selector::Index(-1));
/// assert_eq!(Selector::from(..).to_string(), "..");
/// assert_eq!(Selector::from(2..=4).to_string(), "2..=4");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selector {
    /// `..`: the whole dimension.
    All,
    /// One position (negative: from the end); the dimension is removed.
    Index(i64),
    /// The positions from the start bound to the end bound.
    Range(Bound<i64>, Bound<i64>),
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selector::All => f.write_str(".."),
            Selector::Index(i) => write!(f, "{i}"),
            Selector::Range(start, end) => {
                match start {
                    Bound::Included(s) => write!(f, "{s}")?,
                    // A range type never excludes its start; say it anyway.
                    Bound::Excluded(s) => write!(f, "({s} excluded)")?,
                    Bound::Unbounded => {}
                }
                match end {
                    Bound::Included(e) => write!(f, "..={e}"),
                    Bound::Excluded(e) => write!(f, "..{e}"),
                    Bound::Unbounded => f.write_str(".."),
                }
            }
        }
    }
}

impl From<RangeFull> for Selector {
    fn from(_: RangeFull) -> Selector {
        Selector::All
    }
}

/// A bound as i64; a `usize` beyond i64 is out of every range anyway.
fn wide<T: TryInto<i64>>(v: T) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

macro_rules! selectors_of {
    ($($t:ty),*) => { $(
        impl From<$t> for Selector {
            fn from(i: $t) -> Selector {
                Selector::Index(wide(i))
            }
        }
        impl From<Range<$t>> for Selector {
            fn from(r: Range<$t>) -> Selector {
                Selector::Range(Bound::Included(wide(r.start)), Bound::Excluded(wide(r.end)))
            }
        }
        impl From<RangeFrom<$t>> for Selector {
            fn from(r: RangeFrom<$t>) -> Selector {
                Selector::Range(Bound::Included(wide(r.start)), Bound::Unbounded)
            }
        }
        impl From<RangeTo<$t>> for Selector {
            fn from(r: RangeTo<$t>) -> Selector {
                Selector::Range(Bound::Unbounded, Bound::Excluded(wide(r.end)))
            }
        }
        impl From<RangeInclusive<$t>> for Selector {
            fn from(r: RangeInclusive<$t>) -> Selector {
                let (start, end) = r.into_inner();
                Selector::Range(Bound::Included(wide(start)), Bound::Included(wide(end)))
            }
        }
        impl From<RangeToInclusive<$t>> for Selector {
            fn from(r: RangeToInclusive<$t>) -> Selector {
                Selector::Range(Bound::Unbounded, Bound::Included(wide(r.end)))
            }
        }
    )* };
}
selectors_of!(usize, isize, i64, i32);

/// The argument of [`Tensor::i`]: one selector, or a tuple of up to eight
/// (one per leading dimension; the dimensions after them are kept whole),
/// `()` for none, or a `Vec`/slice of [`Selector`]s built at run time.
///
/// ```
/// use kiln::{Selector, TensorIndex};
/// assert_eq!((.., 1).selectors(), vec![Selector::All, Selector::Index(1)]);
/// assert_eq!(vec![Selector::from(0..2)].selectors().len(), 1);
/// ```
pub trait TensorIndex {
    /// The selectors, first dimension first.
    fn selectors(self) -> Vec<Selector>;
}

impl<S: Into<Selector>> TensorIndex for S {
    fn selectors(self) -> Vec<Selector> {
        vec![self.into()]
    }
}

impl TensorIndex for Vec<Selector> {
    fn selectors(self) -> Vec<Selector> {
        self
    }
}

impl TensorIndex for () {
    fn selectors(self) -> Vec<Selector> {
        Vec::new()
    }
}

impl TensorIndex for &[Selector] {
    fn selectors(self) -> Vec<Selector> {
        self.to_vec()
    }
}

macro_rules! tuple_index {
    ($($name:ident $i:tt),+) => {
        impl<$($name: Into<Selector>),+> TensorIndex for ($($name,)+) {
            fn selectors(self) -> Vec<Selector> {
                vec![$(self.$i.into()),+]
            }
        }
    };
}
tuple_index!(A 0);
tuple_index!(A 0, B 1);
tuple_index!(A 0, B 1, C 2);
tuple_index!(A 0, B 1, C 2, D 3);
tuple_index!(A 0, B 1, C 2, D 3, E 4);
tuple_index!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_index!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_index!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);

/// What one selector does to its dimension, checked against its size.
enum Step {
    Keep,
    Narrow(usize, usize),
    Pick(usize),
}

/// Checks `sel` against dimension `dim` of size `size`.
fn step(sel: Selector, dim: usize, size: usize) -> Result<Step> {
    // A dimension beyond i64 (only in an empty tensor) is as long as i64 reaches.
    let n = i64::try_from(size).unwrap_or(i64::MAX);
    let from_end = |v: i64| if v < 0 { v + n } else { v };
    let out_of_range = |what: String| {
        Error::invalid(
            "i",
            format!(
                "{what} is out of range for dimension {dim} of size {size}; positions run from {} to {} (negative ones count from the end)",
                -n,
                n - 1
            ),
        )
    };
    match sel {
        Selector::All => Ok(Step::Keep),
        Selector::Index(i) => {
            let p = from_end(i);
            if p < 0 || p >= n {
                return Err(out_of_range(format!("index {i}")));
            }
            Ok(Step::Pick(p as usize))
        }
        Selector::Range(start, end) => {
            let s = match start {
                Bound::Included(s) => from_end(s),
                Bound::Excluded(s) => from_end(s).saturating_add(1),
                Bound::Unbounded => 0,
            };
            let e = match end {
                Bound::Included(e) => from_end(e).saturating_add(1),
                Bound::Excluded(e) => from_end(e),
                Bound::Unbounded => n,
            };
            if s < 0 || e < 0 || s > n || e > n {
                return Err(out_of_range(format!("range {sel}")));
            }
            if e < s {
                return Err(Error::invalid(
                    "i",
                    format!(
                        "range {sel} runs backwards in dimension {dim} of size {size} (from {s} to {e}); write it start..end with start <= end"
                    ),
                ));
            }
            if s == 0 && e == n {
                return Ok(Step::Keep);
            }
            Ok(Step::Narrow(s as usize, (e - s) as usize))
        }
    }
}

impl Tensor {
    /// Range indexing: PyTorch's `x[:, 0:2, -1]` is `x.i((.., 0..2, -1))`
    /// (candle's `i`). One [`Selector`] per leading dimension: `..` keeps
    /// it, a range (`a..b`, `a..`, `..b`, `a..=b`, `..=b`) narrows it, a
    /// single position picks one entry and removes the dimension; negative
    /// positions and bounds count from the end. Dimensions after the
    /// selectors are kept whole. The result is a view (no copy), with a
    /// gradient.
    ///
    /// Out of range is an `InvalidArgument` error naming the dimension, the
    /// selector and the size, and so is a range that runs backwards (PyTorch
    /// clamps a slice to the dimension and gives an empty one for
    /// `x[3:1]`; see the README's table of differences).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::arange(0.0, 12.0, 1.0, &cpu())?.reshape((3, 4))?;
    /// let y = x.i((.., 0..2))?;
    /// assert!(y.same_storage(&x));
    /// assert_eq!(y.to_vec2::<f32>()?, vec![vec![0., 1.], vec![4., 5.], vec![8., 9.]]);
    /// assert_eq!(x.i(1)?.to_vec::<f32>()?, vec![4., 5., 6., 7.]);
    /// assert_eq!(x.i((-1, 1..=2))?.to_vec::<f32>()?, vec![9., 10.]);
    /// assert_eq!(x.i((1.., -1))?.to_vec::<f32>()?, vec![7., 11.]);
    /// let e = x.i((.., 2..5)).unwrap_err().to_string();
    /// assert!(e.contains("range 2..5") && e.contains("dimension 1 of size 4"), "{e}");
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn i(&self, index: impl TensorIndex) -> Result<Tensor> {
        let sels = index.selectors();
        if sels.len() > self.rank() {
            return Err(Error::invalid(
                "i",
                format!(
                    "{} selectors for a tensor of rank {} (shape {}); give at most one per dimension",
                    sels.len(),
                    self.rank(),
                    self.shape()
                ),
            ));
        }
        // Every selector is checked before anything is built.
        let steps = sels.iter().enumerate().map(|(d, &s)| step(s, d, self.dims()[d])).collect::<Result<Vec<_>>>()?;
        let mut t = self.clone();
        let mut d = 0;
        for s in steps {
            match s {
                Step::Keep => d += 1,
                Step::Narrow(start, len) => {
                    t = t.narrow(d, start, len)?;
                    d += 1;
                }
                Step::Pick(p) => t = t.narrow(d, p, 1)?.squeeze(d)?,
            }
        }
        Ok(t)
    }
}
