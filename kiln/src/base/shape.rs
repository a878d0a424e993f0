//! Shapes and layouts. A layout is a shape plus strides and an offset into
//! storage, so transpose, narrow and broadcast are views that copy nothing.

use crate::{Error, Result};
use smallvec::SmallVec;
use std::ops::{Deref, DerefMut};

/// Dimensions or strides: up to four inline, more on the heap.
///
/// Why not a plain `SmallVec`: shapes and layouts are copied on every
/// operation, and `SmallVec`'s clone goes through a length-dependent
/// `memcpy` call; an inline `Dims` is copied as a fixed block of bits.
#[derive(Eq, Default, Debug)]
pub(crate) struct Dims(SmallVec<[usize; 4]>);

impl std::hash::Hash for Dims {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.as_slice().hash(state)
    }
}

impl PartialEq for Dims {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        // Element by element: a slice comparison calls `memcmp`, which
        // costs more than a rank-2 compare does.
        let (a, b) = (self.as_slice(), other.as_slice());
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
    }
}

impl Clone for Dims {
    #[inline]
    fn clone(&self) -> Self {
        if self.0.spilled() {
            return Dims(SmallVec::from_slice(&self.0));
        }
        // SAFETY: an inline SmallVec of `usize` owns no heap memory and its
        // elements are `Copy`: a bitwise copy is an independent, valid value
        // (dropping either frees nothing).
        unsafe { std::ptr::read(self) }
    }
}

impl Deref for Dims {
    type Target = SmallVec<[usize; 4]>;
    #[inline]
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for Dims {
    #[inline]
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl FromIterator<usize> for Dims {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        Dims(iter.into_iter().collect())
    }
}

impl Dims {
    pub(crate) fn new() -> Self {
        Dims(SmallVec::new())
    }
    #[inline]
    pub(crate) fn from_slice(d: &[usize]) -> Self {
        Dims(SmallVec::from_slice(d))
    }
    pub(crate) fn from_elem(x: usize, n: usize) -> Self {
        Dims(SmallVec::from_elem(x, n))
    }
    pub(crate) fn from_vec(v: Vec<usize>) -> Self {
        Dims(SmallVec::from_vec(v))
    }
}

/// The extent of each dimension of a tensor.
///
/// ```
/// use kiln::Shape;
/// let s: Shape = (2, 3).into();
/// assert_eq!(s.dims(), &[2, 3]);
/// assert_eq!(s.elem_count(), 6);
/// ```
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub(crate) Dims);

impl Shape {
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements (1 for a scalar).
    #[inline]
    pub fn elem_count(&self) -> usize {
        // Saturating, so an absurd shape asks for usize::MAX elements and
        // fails as out-of-memory instead of wrapping to a small buffer.
        self.0.iter().fold(1usize, |acc, &d| acc.saturating_mul(d))
    }
    /// The number of elements, or `InvalidArgument` naming the shape when it
    /// does not fit in a `usize`. An empty shape (a zero anywhere) has 0
    /// elements however large its other dimensions are.
    pub(crate) fn checked_elem_count(&self, op: &str) -> Result<usize> {
        checked_product(op, self.dims())
    }
    /// [`checked_elem_count`](Self::checked_elem_count), naming the op only on failure.
    #[inline]
    pub(crate) fn checked_elem_count_for(&self, op: impl FnOnce() -> &'static str) -> Result<usize> {
        let dims = self.dims();
        match dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) {
            Some(n) => Ok(n),
            None if dims.contains(&0) => Ok(0),
            None => checked_product(op(), dims),
        }
    }
    /// Row-major strides of a contiguous tensor of this shape.
    ///
    /// ```
    /// assert_eq!(kiln::Shape::from((2, 3, 4)).contiguous_strides(), vec![12, 4, 1]);
    /// ```
    pub fn contiguous_strides(&self) -> Vec<usize> {
        self.strides().to_vec()
    }
    /// [`contiguous_strides`](Self::contiguous_strides), inline.
    #[inline]
    pub(crate) fn strides(&self) -> Dims {
        let dims = self.0.as_slice();
        if dims.len() <= 4 {
            // The common case, without SmallVec's per-element bookkeeping.
            let mut s = [0usize; 4];
            let mut acc = 1usize;
            for i in (0..dims.len()).rev() {
                s[i] = acc;
                acc = acc.saturating_mul(dims[i]);
            }
            return Dims(SmallVec::from_buf_and_len(s, dims.len()));
        }
        let mut strides = Dims::from_elem(0, dims.len());
        let mut acc = 1;
        for i in (0..dims.len()).rev() {
            strides[i] = acc;
            acc = acc.saturating_mul(dims[i]);
        }
        strides
    }
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(Dims::new())
    }
}
impl From<usize> for Shape {
    fn from(d: usize) -> Self {
        Shape(Dims::from_slice(&[d]))
    }
}
impl From<(usize,)> for Shape {
    fn from(d: (usize,)) -> Self {
        Shape(Dims::from_slice(&[d.0]))
    }
}
impl From<(usize, usize)> for Shape {
    fn from(d: (usize, usize)) -> Self {
        Shape(Dims::from_slice(&[d.0, d.1]))
    }
}
impl From<(usize, usize, usize)> for Shape {
    fn from(d: (usize, usize, usize)) -> Self {
        Shape(Dims::from_slice(&[d.0, d.1, d.2]))
    }
}
impl From<(usize, usize, usize, usize)> for Shape {
    fn from(d: (usize, usize, usize, usize)) -> Self {
        Shape(Dims::from_slice(&[d.0, d.1, d.2, d.3]))
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape(Dims::from_slice(&d))
    }
}
impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape(Dims::from_slice(d))
    }
}
impl From<&Vec<usize>> for Shape {
    fn from(d: &Vec<usize>) -> Self {
        Shape(Dims::from_slice(d))
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(Dims::from_vec(d))
    }
}
impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}

/// Shape, strides (in elements) and start offset of a view into storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub(crate) shape: Shape,
    pub(crate) strides: Dims,
    pub(crate) offset: usize,
}

impl Layout {
    /// A contiguous row-major layout starting at 0.
    #[inline]
    pub fn contiguous(shape: Shape) -> Self {
        let strides = match shape.dims() {
            // The common ranks without a loop.
            [] => Dims::new(),
            [_] => Dims(SmallVec::from_buf_and_len([1, 0, 0, 0], 1)),
            [_, n] => Dims(SmallVec::from_buf_and_len([*n, 1, 0, 0], 2)),
            _ => shape.strides(),
        };
        Layout { shape, strides, offset: 0 }
    }
    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// The dims.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Offset of the first element.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }
    /// True when the elements are dense and in row-major order.
    #[inline]
    pub fn is_contiguous(&self) -> bool {
        let (dims, strides) = (self.shape.0.as_slice(), self.strides.as_slice());
        let mut acc = 1;
        for (&d, &s) in dims.iter().zip(strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc = acc.saturating_mul(d);
        }
        true
    }
    /// True when two elements of the view are one memory location (a
    /// broadcast dimension: stride 0 and size above 1).
    pub(crate) fn has_internal_overlap(&self) -> bool {
        self.elem_count() > 1 && self.shape.0.iter().zip(self.strides.iter()).any(|(&d, &s)| d > 1 && s == 0)
    }
    /// Offsets of the first and one-past-last element when contiguous.
    #[inline]
    pub fn contiguous_range(&self) -> Option<(usize, usize)> {
        self.is_contiguous().then(|| (self.offset, self.offset + self.elem_count()))
    }
    /// Swaps two dimensions (a view).
    pub(crate) fn transpose(&self, a: usize, b: usize) -> Layout {
        let mut l = self.clone();
        l.shape.0.swap(a, b);
        l.strides.swap(a, b);
        l
    }
    /// Reorders dimensions (a view).
    pub(crate) fn permute(&self, perm: &[usize]) -> Layout {
        let shape = perm.iter().map(|&p| self.shape.0[p]).collect();
        let strides = perm.iter().map(|&p| self.strides[p]).collect();
        Layout { shape: Shape(shape), strides, offset: self.offset }
    }
    /// Restricts dimension `dim` to `start..start+len` (a view). The caller
    /// checked `start + len <= dims[dim]`. An empty result keeps the offset:
    /// the strides of an empty tensor may be meaningless (saturated), and no
    /// element is ever read through them.
    pub(crate) fn narrow(&self, dim: usize, start: usize, len: usize) -> Layout {
        let mut l = self.clone();
        l.shape.0[dim] = len;
        if l.shape.elem_count() > 0 {
            // A non-empty view of a non-empty tensor: every offset it reaches
            // lies in the storage, so this cannot overflow.
            l.offset += start * self.strides[dim];
        }
        l
    }
    /// Broadcasts to `target` with stride 0 on the new or stretched dims.
    pub(crate) fn broadcast_as(&self, target: &Shape) -> Result<Layout> {
        let l = self.broadcast_view(target)?;
        target.checked_elem_count("broadcast_to")?;
        Ok(l)
    }
    /// [`broadcast_as`](Self::broadcast_as) without the check that the
    /// target's element count fits a `usize`: for a kernel operand whose
    /// output is checked instead (a matmul of an empty output never walks
    /// its operands, however large their broadcast batch).
    pub(crate) fn broadcast_view(&self, target: &Shape) -> Result<Layout> {
        let src = self.dims();
        let dst = target.dims();
        if dst.len() < src.len() {
            return Err(Error::shape("broadcast_to", src, dst));
        }
        let pad = dst.len() - src.len();
        let mut strides = Dims::from_elem(0, dst.len());
        for (i, &d) in dst.iter().enumerate() {
            if i < pad {
                continue;
            }
            let s = src[i - pad];
            if s == d {
                strides[i] = self.strides[i - pad];
            } else if s == 1 {
                strides[i] = 0;
            } else {
                return Err(Error::shape("broadcast_to", src, dst));
            }
        }
        Ok(Layout { shape: target.clone(), strides, offset: self.offset })
    }
    /// Iterates the storage offsets of all elements in row-major order.
    pub(crate) fn offsets(&self) -> StridedOffsets<'_> {
        StridedOffsets::new(self)
    }
}

/// Storage offsets of a strided layout, in row-major element order.
pub(crate) struct StridedOffsets<'a> {
    dims: &'a [usize],
    strides: &'a [usize],
    index: Dims,
    next: usize,
    remaining: usize,
    /// Contiguous from `next` on: each offset is the previous plus one.
    dense: bool,
}

impl<'a> StridedOffsets<'a> {
    fn new(l: &'a Layout) -> Self {
        StridedOffsets {
            dims: l.dims(),
            strides: &l.strides,
            index: Dims::from_elem(0, l.dims().len()),
            next: l.offset,
            remaining: l.elem_count(),
            dense: l.is_contiguous(),
        }
    }
}

impl Iterator for StridedOffsets<'_> {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let out = self.next;
        // Index views and most kernel operands are contiguous: no index
        // arithmetic for them (this iterator was 4% of W5's instructions).
        if self.dense {
            self.next += 1;
            return Some(out);
        }
        for d in (0..self.dims.len()).rev() {
            self.index[d] += 1;
            self.next += self.strides[d];
            if self.index[d] < self.dims[d] {
                break;
            }
            self.next -= self.strides[d] * self.index[d];
            self.index[d] = 0;
        }
        Some(out)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

/// The product of `dims` (an element count, or the size of merged
/// dimensions), or `InvalidArgument` naming them when it does not fit in a
/// `usize`. A zero anywhere makes it 0, whatever the other factors.
///
/// All size arithmetic on user-given dimensions goes through this and
/// [`checked_sum`], so that no size wraps around to a small number.
pub(crate) fn checked_product(op: &str, dims: &[usize]) -> Result<usize> {
    if dims.contains(&0) {
        return Ok(0);
    }
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| too_large(op, dims))
}

/// `a + b` for sizes, or `InvalidArgument` naming `dims` when it overflows.
pub(crate) fn checked_sum(op: &str, a: usize, b: usize, dims: &[usize]) -> Result<usize> {
    a.checked_add(b).ok_or_else(|| too_large(op, dims))
}

fn too_large(op: &str, dims: &[usize]) -> Error {
    Error::invalid(
        op,
        format!("the shape {dims:?} has more elements than a usize can count; no device can hold it, so use smaller dimensions"),
    )
}

/// The numpy broadcast of two shapes.
pub(crate) fn broadcast_shapes(op: &str, a: &Shape, b: &Shape) -> Result<Shape> {
    let out = broadcast_dims(a.dims(), b.dims()).ok_or_else(|| Error::shape(op, a.dims(), b.dims()))?;
    checked_product(op, &out)?;
    Ok(Shape(out))
}

/// The numpy broadcast of two lists of dimensions, or None when they do
/// not broadcast; its product is not checked (see [`broadcast_shapes`]).
pub(crate) fn broadcast_dims(a: &[usize], b: &[usize]) -> Option<Dims> {
    let rank = a.len().max(b.len());
    let mut out = Dims::from_elem(0, rank);
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_offsets_of_transpose() {
        let l = Layout::contiguous((2, 3).into()).transpose(0, 1);
        assert_eq!(l.offsets().collect::<Vec<_>>(), vec![0, 3, 1, 4, 2, 5]);
        assert!(!l.is_contiguous());
    }

    #[test]
    fn broadcast_rules() {
        let s = broadcast_shapes("add", &(3, 1).into(), &(4,).into()).unwrap();
        assert_eq!(s.dims(), &[3, 4]);
        assert!(broadcast_shapes("add", &(3,).into(), &(4,).into()).is_err());
        let l = Layout::contiguous((3, 1).into()).broadcast_as(&(2, 3, 4).into()).unwrap();
        assert_eq!(l.strides(), &[0, 1, 0]);
    }
}
