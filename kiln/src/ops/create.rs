//! Creating tensors: from host data (an upload), filled with a constant, a
//! range or random numbers (`fill.rs`), the identity, and on the default
//! device.

use super::copy::CopyOp;
use super::fill::FillOp;
use crate::backends;
use crate::base::buffer::CpuBuffer;
use crate::base::shape::Layout;
use crate::kernel::storage::Storage;
use crate::kernel::{Kernel, OpRef};
use crate::registry::{backend as device_backend, default_device};
use crate::runtime::{ledger, rng};
use crate::tensor::HostData;
use crate::{DType, Device, Error, Result, Shape, Tensor, WithDType};
use smallvec::SmallVec;
use std::panic::Location;

impl Tensor {
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
        let shape = data.shape();
        check_upload_fits(device, T::DTYPE, shape.elem_count())?;
        Tensor::from_host_buffer(T::into_buffer(data.flatten()), shape, device)
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

    /// Like [`from_vec`](Self::from_vec), copying from a slice. An upload
    /// the device cannot hold is `OutOfMemory` before the slice is copied,
    /// and a copy the host cannot hold is `OutOfMemory` too.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::from_slice(&[1f32, 2., 3., 4.], (2, 2), &cpu())?;
    /// assert_eq!(x.to_vec::<f32>()?, vec![1., 2., 3., 4.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn from_slice<T: WithDType>(data: &[T], shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        check_upload_fits(device, T::DTYPE, data.len())?;
        let mut owned = crate::runtime::memory::try_vec(data.len())?;
        owned.extend_from_slice(data);
        Tensor::from_host_buffer(T::into_buffer(owned), shape.into(), device)
    }

    fn filled(op: FillOp, shape: Shape, dtype: DType, device: &Device) -> Result<Tensor> {
        // The device first, as every operation checks it first.
        let b = device_backend(*device)?;
        let len = shape.checked_elem_count("tensor creation")?;
        let kernel = Kernel::Custom { op: OpRef::Borrowed(&op), inputs: SmallVec::new() };
        let out = backends::run_new(b, *device, &kernel, dtype, len)?;
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
        Tensor::filled(FillOp::Constant(value), shape.into(), dtype, device)
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

    /// `start, start + step, ...` up to `end` (excluded), as f32. A step
    /// whose sign leads away from `end` is an error, as in PyTorch (equal
    /// bounds give an empty tensor).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// assert_eq!(Tensor::arange(0.0, 3.0, 1.0, &cpu())?.to_vec::<f32>()?, vec![0., 1., 2.]);
    /// assert_eq!(Tensor::arange(1.0, 0.0, -0.25, &cpu())?.to_vec::<f32>()?, vec![1., 0.75, 0.5, 0.25]);
    /// assert!(Tensor::arange(1.0, 20.0, -0.25, &cpu()).is_err());
    /// assert_eq!(Tensor::arange(2.0, 2.0, -1.0, &cpu())?.dims(), &[0]);
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
        if (step > 0.0 && end < start) || (step < 0.0 && end > start) {
            // PyTorch: "upper bound and larger bound inconsistent with step sign".
            let fix = if step > 0.0 { "a negative step to count down" } else { "a positive step to count up" };
            return Err(Error::invalid(
                "arange",
                format!("the bounds {start} to {end} are inconsistent with the sign of the step {step}; use {fix}, or swap the bounds"),
            ));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        Tensor::filled(FillOp::Arange { start, step }, Shape::from(n), dtype, device)
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
        Tensor::filled(FillOp::Arange { start, step }, Shape::from(steps), DType::F32, device)
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
        let op = CopyOp { dst_layout: diagonal };
        backends::launch_into(&Kernel::Custom { op: OpRef::Borrowed(&op), inputs: smallvec::smallvec![one.src()] }, &out.storage)?;
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
        Tensor::random(|seed, offset| FillOp::Uniform { seed, offset, lo, hi }, shape.into(), dtype, device)
    }

    /// Standard normal, f32.
    pub fn randn(shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::randn_with(0.0, 1.0, shape, DType::F32, device)
    }

    /// Normal with a mean and a standard deviation.
    pub fn randn_with(mean: f64, std: f64, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::random(|seed, offset| FillOp::Normal { seed, offset, mean, std }, shape.into(), dtype, device)
    }

    fn random(dist: impl FnOnce(u64, u64) -> FillOp, shape: Shape, dtype: DType, device: &Device) -> Result<Tensor> {
        let b = device_backend(*device)?;
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType { op: "rand".into(), dtype });
        }
        let len = shape.checked_elem_count("rand")?;
        // Allocated before the generator moves: a refused allocation (or a
        // failed kernel) leaves the thread's random stream as it was.
        let out = backends::alloc_on(b, *device, dtype, len)?;
        let before = rng::state();
        let (seed, offset) = rng::reserve(len);
        let op = dist(seed, offset);
        if let Err(err) = backends::launch_into(&Kernel::Custom { op: OpRef::Borrowed(&op), inputs: SmallVec::new() }, &out) {
            rng::restore(before);
            return Err(err);
        }
        Ok(Tensor::from_storage(out, shape))
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

/// Refuses an upload of `len` elements that cannot fit on `device` before
/// the host's elements are copied: with most of a large GPU in use, that
/// copy alone took most of the host's memory and 40 s before the device
/// said no (seen on an H200). The upload checks again when it allocates.
fn check_upload_fits(device: &Device, dtype: DType, len: usize) -> Result<()> {
    let b = device_backend(*device)?;
    match device {
        Device::Cpu => Ok(()),
        Device::Gpu(_) => b.pool().check_fits(len.saturating_mul(dtype.size_in_bytes())),
    }
}
