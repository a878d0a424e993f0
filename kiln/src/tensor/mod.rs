//! The tensor: a view (layout) of a storage on one device, plus the autograd
//! node that produced it when gradients are being recorded; the checks every
//! op makes first; and how an op runs its kernel into a new tensor.
//!
//! Every operation follows the same path: check devices, then dtypes and
//! shapes, hand a [`Kernel`] to the device's backend (`run_new`), record the
//! op for autograd (`autograd::record`). The ops themselves live in `ops/`.

use crate::backends;
use crate::base::buffer::WithDType;
use crate::base::device::Device;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{Layout, Shape};
use crate::kernel::storage::{Storage, StorageHandle};
use crate::kernel::Backend;
use crate::kernel::{Kernel, Src};
use smallvec::SmallVec;
use std::borrow::Cow;
use std::sync::{Arc, Mutex};

/// What the gradient of an op gets: the gradient of its output, its inputs
/// (as recorded), and its output when the op asked to keep it.
pub(crate) struct GradCtx<'a> {
    pub g: &'a Tensor,
    pub inputs: &'a [Tensor],
    pub output: Option<&'a Tensor>,
}

/// The gradient of each input, in order (`None`: no gradient to it).
pub(crate) type Grads = SmallVec<[Option<Tensor>; 2]>;

/// An op's gradient rule, recorded with its output.
pub(crate) type Backward = Box<dyn Fn(&GradCtx<'_>) -> Result<Grads> + Send + Sync>;

/// A node of the autograd graph: a leaf (a parameter, which keeps its
/// accumulated gradient), or the op that produced a tensor, with its inputs
/// and gradient rule.
pub(crate) struct Node {
    /// The op's inputs (empty for a leaf).
    pub(crate) inputs: SmallVec<[Tensor; 2]>,
    /// The gradient rule; `None` for a leaf.
    pub(crate) backward: Option<Backward>,
    /// The op's output without its node (no cycle), when the rule reuses it.
    pub(crate) output: Option<Tensor>,
    pub(crate) grad: Mutex<Option<Tensor>>,
    /// For a parameter (leaf) that `Module::to` moved: its data now, without
    /// a node (a handle taken before the move finds it here).
    pub(crate) moved: Mutex<Option<Tensor>>,
}

/// An n-dimensional array that lives on one device.
///
/// Cloning is cheap and shares the storage, like cloning an `Arc`.
///
/// ```
/// use kiln::{Tensor, DType, cpu};
/// let x = Tensor::new(&[1f32, 2., 3.], &cpu())?;
/// assert_eq!(x.device(), cpu());
/// let y = (&x * 2.0)?;
/// assert_eq!(y.to_vec::<f32>()?, vec![2., 4., 6.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor {
    pub(crate) storage: StorageHandle,
    pub(crate) layout: Layout,
    pub(crate) node: Option<Arc<Node>>,
}

/// Host data with a shape: scalars, slices, vectors and nested arrays.
pub trait HostData<T: WithDType> {
    /// The shape of the data.
    fn shape(&self) -> Shape;
    /// The elements in row-major order.
    fn flatten(&self) -> Vec<T>;
}

impl<T: WithDType> HostData<T> for T {
    fn shape(&self) -> Shape {
        Shape::from(())
    }
    fn flatten(&self) -> Vec<T> {
        vec![*self]
    }
}
impl<T: WithDType> HostData<T> for [T] {
    fn shape(&self) -> Shape {
        Shape::from(self.len())
    }
    fn flatten(&self) -> Vec<T> {
        self.to_vec()
    }
}
impl<T: WithDType, const N: usize> HostData<T> for [T; N] {
    fn shape(&self) -> Shape {
        Shape::from(N)
    }
    fn flatten(&self) -> Vec<T> {
        self.to_vec()
    }
}
impl<T: WithDType> HostData<T> for Vec<T> {
    fn shape(&self) -> Shape {
        Shape::from(self.len())
    }
    fn flatten(&self) -> Vec<T> {
        self.clone()
    }
}
impl<T: WithDType, const N: usize, const M: usize> HostData<T> for [[T; N]; M] {
    fn shape(&self) -> Shape {
        Shape::from((M, N))
    }
    fn flatten(&self) -> Vec<T> {
        self.iter().flatten().copied().collect()
    }
}
impl<T: WithDType, const N: usize, const M: usize, const L: usize> HostData<T> for [[[T; N]; M]; L] {
    fn shape(&self) -> Shape {
        Shape::from((L, M, N))
    }
    fn flatten(&self) -> Vec<T> {
        self.iter().flatten().flatten().copied().collect()
    }
}

pub(crate) fn check_same_device(op: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    let (da, db) = (a.device(), b.device());
    if da != db {
        return Err(Error::DeviceMismatch { op: op.to_string(), lhs: da, rhs: db });
    }
    Ok(())
}

/// Refuses operands of two dtypes, for the ops that PyTorch refuses them
/// for too (`matmul`, `index_add`, the convolutions); the error's hint names
/// the wider dtype ([`DType::promote`]).
pub(crate) fn check_same_dtype(op: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op: op.to_string(), lhs: a.dtype(), rhs: b.dtype() });
    }
    Ok(())
}

impl Tensor {
    /// The dtype of an op between these tensors: PyTorch's
    /// `torch.result_type` (see [`DType::result_type`] for the rule and
    /// its table; a 0-d tensor counts as a scalar for dtype purposes).
    /// Returns f32 for no tensors.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let b = Tensor::new(&[1u8, 2], &cpu())?;
    /// let i = Tensor::new(&[1i32, 2], &cpu())?;
    /// let half = Tensor::new(&0.5f64, &cpu())?; // 0-d
    /// assert_eq!(Tensor::result_type(&[&b, &i]), DType::I32);
    /// assert_eq!(Tensor::result_type(&[&i, &half]), DType::F64);
    /// assert_eq!((&b + &i)?.dtype(), DType::I32);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn result_type(tensors: &[&Tensor]) -> DType {
        let operands: SmallVec<[(DType, usize); 4]> = tensors.iter().map(|t| (t.dtype(), t.rank())).collect();
        DType::result_type(&operands).unwrap_or(DType::F32)
    }
}

/// Half-precision types are for storage: arithmetic refuses them.
pub(crate) fn check_compute(op: &str, dtype: DType) -> Result<()> {
    if matches!(dtype, DType::F16 | DType::BF16) {
        return Err(Error::UnsupportedDType { op: op.to_string(), dtype });
    }
    Ok(())
}

/// A dimension: a `usize`, or a signed integer where −1 is the last
/// dimension, −2 the one before, as in PyTorch.
///
/// ```
/// use kiln::{Tensor, cpu};
/// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
/// assert_eq!(x.sum(-1)?.to_vec::<f32>()?, vec![3., 7.]);
/// assert_eq!(x.sum(0usize)?.to_vec::<f32>()?, vec![4., 6.]);
/// assert!(x.sum(-3).is_err());
/// # Ok::<(), kiln::Error>(())
/// ```
pub trait Dim: Copy {
    /// The dimension as an index in `0..rank`, or an error naming `op`.
    fn index(self, op: &str, rank: usize) -> Result<usize>;
}

impl Dim for usize {
    fn index(self, op: &str, rank: usize) -> Result<usize> {
        check_dim(op, self, rank)?;
        Ok(self)
    }
}

macro_rules! signed_dim {
    ($($t:ty),*) => { $(
        impl Dim for $t {
            fn index(self, op: &str, rank: usize) -> Result<usize> {
                let d = self as i64;
                let i = if d < 0 { d + rank as i64 } else { d };
                if i < 0 || i >= rank as i64 {
                    return Err(Error::invalid(op, format!("dimension {d} is out of range for a tensor of rank {rank} (valid: {} to {})", -(rank as i64), rank as i64 - 1)));
                }
                Ok(i as usize)
            }
        }
    )* };
}
signed_dim!(i32, i64, isize);

pub(crate) fn check_dim(op: &str, dim: usize, rank: usize) -> Result<()> {
    if dim >= rank {
        return Err(Error::invalid(op, format!("dimension {dim} is out of range for a tensor of rank {rank}")));
    }
    Ok(())
}

impl Tensor {
    // ---- construction -------------------------------------------------

    pub(crate) fn from_storage(storage: Arc<Storage>, shape: Shape) -> Tensor {
        Tensor { storage: StorageHandle::new(storage), layout: Layout::contiguous(shape), node: None }
    }

    /// A contiguous output of `shape` on the same device as `self`.
    pub(crate) fn alloc_like(&self, dtype: DType, shape: &Shape) -> Result<Arc<Storage>> {
        backends::alloc_on(self.storage.backend, self.storage.device, dtype, shape.checked_elem_count("allocation")?)
    }

    /// This view as a kernel operand, borrowed (no reference count touched).
    #[inline]
    pub(crate) fn src(&self) -> Src<'_> {
        Src { storage: Cow::Borrowed(&self.storage), layout: Cow::Borrowed(&self.layout) }
    }

    #[inline]
    pub(crate) fn backend(&self) -> &'static dyn Backend {
        self.storage.backend
    }

    /// Runs `kernel` into a new contiguous tensor of `shape` and `dtype` on
    /// this tensor's device (see [`backends::run_new`]).
    #[inline(always)]
    pub(crate) fn run_new(&self, kernel: Kernel<'_>, dtype: DType, shape: Shape) -> Result<Tensor> {
        let len = shape.checked_elem_count_for(|| kernel.name())?;
        let storage = backends::run_new(self.storage.backend, self.storage.device, &kernel, dtype, len)?;
        Ok(Tensor::from_storage(storage, shape))
    }

    /// [`run_new`](Self::run_new) for an output of this tensor's shape (an
    /// elementwise op): its element count is known to fit, and a contiguous
    /// input's strides are the output's, so neither is computed again (the
    /// one-element add spends its time in such bookkeeping).
    #[inline(always)]
    pub(crate) fn run_new_same_shape(&self, kernel: Kernel<'_>, dtype: DType) -> Result<Tensor> {
        let len = self.layout.elem_count();
        if len == usize::MAX || !self.layout.is_contiguous() {
            // A saturated count (a huge broadcast view) is checked and named.
            return self.run_new(kernel, dtype, self.shape().clone());
        }
        let storage = backends::run_new(self.storage.backend, self.storage.device, &kernel, dtype, len)?;
        let layout = Layout { offset: 0, ..self.layout.clone() };
        Ok(Tensor { storage: StorageHandle::new(storage), layout, node: None })
    }

    // ---- what a tensor is ---------------------------------------------

    /// The device the tensor lives on.
    pub fn device(&self) -> Device {
        self.storage.device()
    }
    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.layout.shape
    }
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.layout.dims()
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.layout.dims().len()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype
    }
    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.layout.elem_count()
    }
    /// Shape, strides and offset into the storage.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// True when the elements are dense and row-major.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }
    /// True when both tensors are views of the same storage (what `to`
    /// returns on the tensor's own device; `copy_to` never does).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let z = Tensor::new(&[1f32], &cpu())?;
    /// assert!(z.to(&cpu())?.same_storage(&z));
    /// assert!(!z.copy_to(&cpu())?.same_storage(&z));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }
    /// An identity of the underlying storage, equal for two tensors exactly
    /// when [`same_storage`](Self::same_storage) holds (while both live).
    pub(crate) fn storage_id(&self) -> usize {
        Arc::as_ptr(&self.storage) as usize
    }
    /// Bytes of the underlying storage.
    pub fn storage_bytes(&self) -> usize {
        self.storage.bytes()
    }
    /// The i-th dimension, or an error naming the rank.
    pub fn dim(&self, i: impl Dim) -> Result<usize> {
        let i = i.index("dim", self.rank())?;
        Ok(self.dims()[i])
    }

    /// A new tensor sharing storage with another layout (views).
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor { storage: self.storage.clone(), layout, node: None }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // No values: Debug must never transfer.
        write!(f, "Tensor[{:?}, {}, {}]", self.dims(), self.dtype(), self.device())
    }
}
