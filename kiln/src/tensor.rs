//! The tensor: a view (layout) of a storage on one device, plus the autograd
//! node that produced it when gradients are being recorded.
//!
//! Every operation follows the same path: check devices, then dtypes and
//! shapes, allocate the output on the operands' device, hand a primitive
//! [`Kernel`](crate::op::Kernel) to that device's backend, record the op for
//! autograd. Nothing here ever moves data between devices except `to`,
//! `copy_to` and the host reads, all of which go through the ledger.

use crate::backend::{self, Backend};
use crate::backprop::{self, BackOp, Node};
use crate::base::buffer::CpuBuffer;
use crate::base::shape::Layout;
use crate::op::{Distribution, Kernel, Src};
use crate::registry::{backend as device_backend, default_device};
use crate::runtime::{ledger, rng};
use crate::storage::{Storage, StorageHandle};
use crate::{DType, Device, Error, Result, Shape, WithDType};
use std::borrow::Cow;
use std::panic::Location;
use std::sync::Arc;

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

pub(crate) fn check_same_dtype(op: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op: op.to_string(), lhs: a.dtype(), rhs: b.dtype() });
    }
    Ok(())
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
        backend::alloc_on(self.storage.backend, self.storage.device, dtype, shape.checked_elem_count("allocation")?)
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
    /// this tensor's device (see [`backend::run_new`]).
    #[inline(always)]
    pub(crate) fn run_new(&self, kernel: Kernel<'_>, dtype: DType, shape: Shape) -> Result<Tensor> {
        let len = shape.checked_elem_count_for(|| kernel.name())?;
        let storage = backend::run_new(self.storage.backend, self.storage.device, &kernel, dtype, len)?;
        Ok(Tensor::from_storage(storage, shape))
    }

    /// Uploads host elements to `device`, booking a host-to-device transfer
    /// when the device is a GPU.
    #[track_caller]
    pub(crate) fn from_host_buffer(data: CpuBuffer, shape: Shape, device: &Device) -> Result<Tensor> {
        if data.len() != shape.checked_elem_count("from_vec")? {
            return Err(Error::shape("from_vec", &[data.len()], shape.dims()));
        }
        let b = device_backend(*device)?;
        let (dtype, len) = (data.dtype(), data.len());
        let ticket = ledger::check(Device::Cpu, *device, data.size_in_bytes(), Location::caller())?;
        let buffer = b.upload(data)?;
        // Booked once done: an upload that ran out of memory moved nothing.
        if let Some(ticket) = ticket {
            ticket.book();
        }
        Ok(Tensor::from_storage(Storage::new_on(b, *device, buffer, dtype, len), shape))
    }

    /// A tensor from nested arrays, a slice or a scalar, on `device`.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let m = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// assert_eq!(m.dims(), &[2, 2]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn new<T: WithDType, D: HostData<T> + ?Sized>(data: &D, device: &Device) -> Result<Tensor> {
        Tensor::from_host_buffer(T::into_buffer(data.flatten()), data.shape(), device)
    }

    /// A tensor of `shape` holding `data` (row-major), on `device`.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::from_vec(vec![1f64, 2., 3., 4., 5., 6.], (2, 3), &cpu())?;
    /// assert_eq!(x.dims(), &[2, 3]);
    /// assert!(Tensor::from_vec(vec![1f32; 5], (2, 3), &cpu()).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn from_vec<T: WithDType>(data: Vec<T>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_host_buffer(T::into_buffer(data), shape.into(), device)
    }

    /// Like [`from_vec`](Self::from_vec), copying from a slice.
    #[track_caller]
    pub fn from_slice<T: WithDType>(data: &[T], shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_host_buffer(T::into_buffer(data.to_vec()), shape.into(), device)
    }

    fn filled(kernel: Kernel<'_>, shape: Shape, dtype: DType, device: &Device) -> Result<Tensor> {
        // The device first, as every operation checks it first.
        let b = device_backend(*device)?;
        let len = shape.checked_elem_count("tensor creation")?;
        let out = backend::run_new(b, *device, &kernel, dtype, len)?;
        Ok(Tensor::from_storage(out, shape))
    }

    /// A tensor of `shape` with every element `value`.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::full(7.0, (2,), DType::I64, &cpu())?;
    /// assert_eq!(x.to_vec::<i64>()?, vec![7, 7]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn full(value: f64, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::filled(Kernel::Fill { value }, shape.into(), dtype, device)
    }

    /// Zeros.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// assert_eq!(Tensor::zeros((2, 2), DType::F32, &cpu())?.sum_all()?.to_scalar::<f32>()?, 0.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(0.0, shape, dtype, device)
    }

    /// Ones (the chapter's `torch.ones(2, 3, device=try_gpu())`).
    ///
    /// ```
    /// use kiln::{Tensor, DType, try_gpu};
    /// let x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    /// assert_eq!(x.dims(), &[2, 3]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(1.0, shape, dtype, device)
    }

    /// Zeros with the shape, dtype and device of `self`.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape(), self.dtype(), &self.device())
    }

    /// Ones with the shape, dtype and device of `self`.
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape(), self.dtype(), &self.device())
    }

    /// `start, start + step, ...` up to `end` (excluded), as f32.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// assert_eq!(Tensor::arange(0.0, 3.0, 1.0, &cpu())?.to_vec::<f32>()?, vec![0., 1., 2.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn arange(start: f64, end: f64, step: f64, device: &Device) -> Result<Tensor> {
        Tensor::arange_dtype(start, end, step, DType::F32, device)
    }

    /// [`arange`](Self::arange) with a chosen dtype.
    pub fn arange_dtype(start: f64, end: f64, step: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid("arange", format!("start {start}, end {end} and step {step} must be finite with a non-zero step")));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        Tensor::filled(Kernel::Arange { start, step }, Shape::from(n), dtype, device)
    }

    /// `steps` evenly spaced values from `start` to `end` (both included), f32.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// assert_eq!(Tensor::linspace(0.0, 1.0, 5, &cpu())?.to_vec::<f32>()?, vec![0., 0.25, 0.5, 0.75, 1.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn linspace(start: f64, end: f64, steps: usize, device: &Device) -> Result<Tensor> {
        let step = if steps > 1 { (end - start) / (steps - 1) as f64 } else { 0.0 };
        Tensor::filled(Kernel::Arange { start, step }, Shape::from(steps), DType::F32, device)
    }

    /// The n×n identity matrix.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// assert_eq!(Tensor::eye(2, DType::F32, &cpu())?.to_vec::<f32>()?, vec![1., 0., 0., 1.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn eye(n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let out = Tensor::zeros((n, n), dtype, device)?;
        let one = Tensor::ones((1,), dtype, device)?.broadcast_to(n)?;
        // The diagonal is a strided view of the matrix: stride n + 1.
        let diagonal = Layout { shape: Shape::from(n), strides: crate::base::shape::Dims::from_slice(&[n + 1]), offset: 0 };
        backend::launch_into(&Kernel::Copy { src: one.src(), dst_layout: Cow::Owned(diagonal) }, &out.storage)?;
        Ok(out)
    }

    /// Uniform in [0, 1), f32, from this thread's seeded generator.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::rand((100,), &cpu())?;
    /// let v = x.to_vec::<f32>()?;
    /// assert!(v.iter().all(|&u| (0.0..1.0).contains(&u)));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn rand(shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::rand_uniform(0.0, 1.0, shape, DType::F32, device)
    }

    /// Uniform in [lo, hi).
    pub fn rand_uniform(lo: f64, hi: f64, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::random(Distribution::Uniform { lo, hi }, shape.into(), dtype, device)
    }

    /// Standard normal, f32.
    pub fn randn(shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::randn_with(0.0, 1.0, shape, DType::F32, device)
    }

    /// Normal with a mean and a standard deviation.
    pub fn randn_with(mean: f64, std: f64, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::random(Distribution::Normal { mean, std }, shape.into(), dtype, device)
    }

    fn random(dist: Distribution, shape: Shape, dtype: DType, device: &Device) -> Result<Tensor> {
        let b = device_backend(*device)?;
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType { op: "rand".into(), dtype });
        }
        let len = shape.checked_elem_count("rand")?;
        // Allocated before the generator moves: a refused allocation (or a
        // failed kernel) leaves the thread's random stream as it was.
        let out = backend::alloc_on(b, *device, dtype, len)?;
        let before = rng::state();
        let (seed, offset) = rng::reserve(len);
        if let Err(err) = backend::launch_into(&Kernel::Random { seed, offset, dist }, &out) {
            rng::restore(before);
            return Err(err);
        }
        Ok(Tensor::from_storage(out, shape))
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
    /// Bytes of the underlying storage.
    pub fn storage_bytes(&self) -> usize {
        self.storage.bytes()
    }
    /// The i-th dimension, or an error naming the rank.
    pub fn dim(&self, i: impl Dim) -> Result<usize> {
        let i = i.index("dim", self.rank())?;
        Ok(self.dims()[i])
    }

    // ---- transfers ----------------------------------------------------

    /// This tensor on `device`: the very same tensor (sharing storage) when it
    /// is already there, a copy otherwise (the chapter's `Z.cuda(1) is Z`,
    /// MXNet's `as_in_context`).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[1f32, 2.], &cpu())?;
    /// assert!(x.to(&cpu())?.same_storage(&x));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn to(&self, device: &Device) -> Result<Tensor> {
        if self.device() == *device {
            return Ok(self.clone());
        }
        self.copy_to(device)
    }

    /// A copy on `device` in new memory, always (MXNet's `copyto`). Crossing
    /// between devices is booked in the transfer ledger and checked by the
    /// transfer guard.
    #[track_caller]
    pub fn copy_to(&self, device: &Device) -> Result<Tensor> {
        let site = Location::caller();
        let dst = device_backend(*device)?;
        let src_device = self.device();
        let bytes = self.elem_count().saturating_mul(self.dtype().size_in_bytes());
        let ticket = ledger::check(src_device, *device, bytes, site)?;
        let shape = self.shape().clone();
        let src_backend = self.backend();
        let gpu_to_gpu_in_host_memory = src_backend.host_memory() && dst.host_memory() && src_backend.is_async() && dst.is_async();
        let out = if src_device == *device || gpu_to_gpu_in_host_memory {
            // Same device, or two simulated GPUs: the source's queue copies,
            // after the work that produces the source and before any write
            // to it enqueued later, and the destination's queue waits for
            // that copy (event order); the host does not wait. A
            // host-to-device copy is not done this way: the host may
            // overwrite its tensor right after the call, so it is copied
            // before returning.
            let out = backend::alloc(dst, self.dtype(), shape.elem_count())?;
            let dst_layout = Cow::Owned(Layout::contiguous(shape.clone()));
            // On the source's backend: its queue runs the copy.
            src_backend.launch(&Kernel::Copy { src: self.src(), dst_layout }, &out)?;
            if src_device != *device {
                if let Some(event) = src_backend.record_event() {
                    dst.wait_event(event)?;
                }
            }
            out
        } else if let Some(out) = src_backend.copy_to_peer(&self.src(), dst)? {
            // Two CUDA devices with peer access: a device-to-device copy on
            // the source's stream that the destination's stream waits for;
            // the host does not wait.
            out
        } else {
            // Through the host: the source's backend reads (waiting for its
            // queue), the destination's takes the elements.
            let data = src_backend.download(&self.src())?;
            let len = data.len();
            let buffer = dst.upload(data)?;
            Storage::new(dst, buffer, self.dtype(), len)
        };
        // Booked once done: a copy that ran out of memory moved nothing.
        if let Some(ticket) = ticket {
            ticket.book();
        }
        let t = Tensor::from_storage(out, shape);
        Ok(backprop::record(t, || BackOp::ToDevice(self.clone()), &[self]))
    }

    /// Waits until the work producing this tensor has run (JAX's
    /// `block_until_ready`). Returns the tensor for chaining.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::ones((2,), kiln::DType::F32, &cpu())?;
    /// x.block_until_ready()?;
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn block_until_ready(&self) -> Result<&Tensor> {
        self.backend().synchronize()?;
        Ok(self)
    }

    /// Reads the elements to the host, as a flat row-major vector. On a GPU
    /// this is a device-to-host transfer, booked in the ledger.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1i64, 2], [3, 4]], &cpu())?;
    /// assert_eq!(x.to_vec::<i64>()?, vec![1, 2, 3, 4]);
    /// assert!(x.to_vec::<f32>().is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch { op: "to_vec".into(), lhs: self.dtype(), rhs: T::DTYPE });
        }
        let buf = self.read_host(Location::caller())?;
        T::from_buffer(buf).ok_or_else(|| Error::invalid("to_vec", "dtype changed during the read"))
    }

    /// Reads the elements as a vector of rows (2-D tensors).
    #[track_caller]
    pub fn to_vec2<T: WithDType>(&self) -> Result<Vec<Vec<T>>> {
        if self.rank() != 2 {
            return Err(Error::invalid("to_vec2", format!("needs a 2-D tensor, this one has shape {}", self.shape())));
        }
        let (rows, cols) = (self.dims()[0], self.dims()[1]);
        let flat = self.to_vec::<T>()?;
        let mut out = crate::backend::host_kernels::try_vec(rows)?;
        if cols == 0 {
            out.resize(rows, Vec::new());
        } else {
            out.extend(flat.chunks(cols).map(|c| c.to_vec()));
        }
        Ok(out)
    }

    /// Reads a one-element tensor as a Rust value of its dtype.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// assert_eq!(Tensor::new(&[5f32], &cpu())?.to_scalar::<f32>()?, 5.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn to_scalar<T: WithDType>(&self) -> Result<T> {
        if self.elem_count() != 1 {
            return Err(Error::invalid("to_scalar", format!("needs exactly one element, this tensor has shape {}", self.shape())));
        }
        Ok(self.to_vec::<T>()?[0])
    }

    /// Reads a one-element tensor of any dtype as f64 (PyTorch's `item()`).
    #[track_caller]
    pub fn item(&self) -> Result<f64> {
        if self.elem_count() != 1 {
            return Err(Error::invalid("item", format!("needs exactly one element, this tensor has shape {}", self.shape())));
        }
        Ok(self.read_host(Location::caller())?.get_f64(0))
    }

    /// The elements on the host in row-major order, as any dtype converted to f64.
    #[track_caller]
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        let buf = self.read_host(Location::caller())?;
        Ok((0..buf.len()).map(|i| buf.get_f64(i)).collect())
    }

    pub(crate) fn read_host(&self, site: &'static Location<'static>) -> Result<CpuBuffer> {
        let bytes = self.elem_count().saturating_mul(self.dtype().size_in_bytes());
        // Guard first, book once the read succeeded (as copy_to does).
        let ticket = ledger::check(self.device(), Device::Cpu, bytes, site)?;
        let data = self.backend().download(&self.src())?;
        if let Some(ticket) = ticket {
            ticket.book();
        }
        Ok(data)
    }

    /// Overwrites this tensor's elements in place with `src` (broadcast to
    /// this shape), on this tensor's device. Every view of the storage sees
    /// the new values; this is how optimizers update parameters.
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let w = Tensor::zeros((2,), DType::F32, &cpu())?;
    /// let alias = w.clone();
    /// w.assign(&Tensor::new(&[1f32, 2.], &cpu())?)?;
    /// assert_eq!(alias.to_vec::<f32>()?, vec![1., 2.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn assign(&self, src: &Tensor) -> Result<()> {
        check_same_device("assign", self, src)?;
        check_same_dtype("assign", self, src)?;
        if self.layout.has_internal_overlap() {
            // Several elements of a broadcast view are one memory location:
            // which written value wins would be arbitrary (PyTorch refuses too).
            return Err(Error::invalid(
                "assign",
                format!(
                    "the destination of shape {} is a broadcast view whose elements share memory; assign to the tensor it was broadcast from, or to `dst.contiguous()?`",
                    self.shape()
                ),
            ));
        }
        let layout = src.layout.broadcast_as(self.shape()).map_err(|_| Error::shape("assign", src.dims(), self.dims()))?;
        let src = if src.same_storage(self) { src.force_copy()?.broadcast_to(self.shape())? } else { src.with_layout(layout) };
        backend::launch_into(&Kernel::Copy { src: src.src(), dst_layout: Cow::Borrowed(&self.layout) }, &self.storage)
    }

    /// A new tensor sharing storage with another layout (views).
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor { storage: self.storage.clone(), layout, node: None }
    }

    /// A contiguous copy on the same device, whatever the layout.
    pub(crate) fn force_copy(&self) -> Result<Tensor> {
        let dst_layout = Cow::Owned(Layout::contiguous(self.shape().clone()));
        self.run_new(Kernel::Copy { src: self.src(), dst_layout }, self.dtype(), self.shape().clone())
    }

    /// A tensor on the current default device (see [`crate::default_device_scope`]).
    ///
    /// ```
    /// let x = kiln::Tensor::new_default(&[1f32, 2.])?;
    /// assert_eq!(x.device(), kiln::default_device());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn new_default<T: WithDType, D: HostData<T> + ?Sized>(data: &D) -> Result<Tensor> {
        Tensor::new(data, &default_device())
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // No values: Debug must never transfer.
        write!(f, "Tensor[{:?}, {}, {}]", self.dims(), self.dtype(), self.device())
    }
}
