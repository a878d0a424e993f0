//! Conversions between tensors and the `ndarray` crate's arrays (cargo
//! feature `ndarray`).
//!
//! An array becomes a tensor with one copy of its elements (a gather in
//! logical order when it is not in standard layout: transposed, sliced with
//! steps, negative strides), uploaded to the chosen device; a tensor becomes
//! an owned array after one read to the host, which is a device-to-host
//! transfer booked at the caller's line when the tensor is on a GPU.

use crate::runtime::ledger;
use crate::runtime::memory::try_vec;
use crate::{Device, Error, Result, Shape, Tensor, WithDType};
use ndarray::{Array2, ArrayBase, ArrayD, Data, Dimension, IxDyn};
use std::panic::Location;

impl Tensor {
    /// A tensor on `device` holding a copy of `array`'s elements, with its
    /// shape (any dimensionality, 0-d and empty included, any layout; the
    /// tensor is always row-major). Uploading to a GPU is a host-to-device
    /// transfer booked at the caller's line. Feature `ndarray`.
    ///
    /// ```
    /// use kiln::{cpu, Tensor};
    /// use ndarray::array;
    /// let a = array![[1f32, 2., 3.], [4., 5., 6.]];
    /// let t = Tensor::from_ndarray(&a, &cpu())?;
    /// assert_eq!(t.dims(), &[2, 3]);
    /// // A transposed view is gathered in its logical order.
    /// let t2 = Tensor::from_ndarray(&a.t(), &cpu())?;
    /// assert_eq!(t2.to_vec2::<f32>()?, vec![vec![1., 4.], vec![2., 5.], vec![3., 6.]]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn from_ndarray<T, S, D>(array: &ArrayBase<S, D>, device: &Device) -> Result<Tensor>
    where
        T: WithDType,
        S: Data<Elem = T>,
        D: Dimension,
    {
        let _site = ledger::site_scope(Location::caller());
        crate::registry::backend(*device)?;
        let mut elems = try_vec::<T>(array.len())?;
        match array.as_slice() {
            // Standard layout: one copy of the memory as it is.
            Some(slice) => elems.extend_from_slice(slice),
            None => elems.extend(array.iter().copied()),
        }
        Tensor::from_host_buffer(T::into_buffer(elems), Shape::from(array.shape().to_vec()), device)
    }

    /// The tensor as an owned `ndarray` array of its shape; `T` must be the
    /// tensor's dtype ([`Error::DTypeMismatch`] otherwise). Reading a GPU
    /// tensor is a device-to-host transfer booked at the caller's line.
    /// Feature `ndarray`.
    ///
    /// ```
    /// use kiln::{cpu, Tensor};
    /// let t = Tensor::new(&[[1i64, 2], [3, 4]], &cpu())?;
    /// let a = t.to_ndarray::<i64>()?;
    /// assert_eq!(a.shape(), &[2, 2]);
    /// assert_eq!(a[[1, 0]], 3);
    /// assert!(t.to_ndarray::<f32>().is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn to_ndarray<T: WithDType>(&self) -> Result<ArrayD<T>> {
        let elems = self.host_elems::<T>("to_ndarray", Location::caller())?;
        ArrayD::from_shape_vec(IxDyn(self.dims()), elems).map_err(|e| Error::invalid("to_ndarray", e.to_string()))
    }

    /// [`to_ndarray`](Self::to_ndarray) for a 2-D tensor, as an
    /// [`Array2`]; another rank is [`Error::InvalidArgument`].
    /// Feature `ndarray`.
    ///
    /// ```
    /// use kiln::{cpu, DType, Tensor};
    /// let m = Tensor::eye(3, DType::F64, &cpu())?.to_ndarray2::<f64>()?;
    /// assert_eq!(m.diag().sum(), 3.0);
    /// assert!(Tensor::ones((2, 2, 2), DType::F64, &cpu())?.to_ndarray2::<f64>().is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn to_ndarray2<T: WithDType>(&self) -> Result<Array2<T>> {
        let [rows, cols] = self.dims() else {
            return Err(Error::invalid(
                "to_ndarray2",
                format!("needs a 2-D tensor, this one has shape {}; use `to_ndarray` for any rank", self.shape()),
            ));
        };
        let (rows, cols) = (*rows, *cols);
        let elems = self.host_elems::<T>("to_ndarray2", Location::caller())?;
        Array2::from_shape_vec((rows, cols), elems).map_err(|e| Error::invalid("to_ndarray2", e.to_string()))
    }

    /// The elements on the host as `T`, checking the dtype first.
    fn host_elems<T: WithDType>(&self, op: &str, site: &'static Location<'static>) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            // The dtype the caller asked for first: the error's hint then
            // converts the tensor to it.
            return Err(Error::DTypeMismatch { op: format!("{op}::<{}>", T::DTYPE), lhs: T::DTYPE, rhs: self.dtype() });
        }
        let buf = self.read_host(site)?;
        T::from_buffer(buf).ok_or_else(|| Error::invalid(op, "the dtype changed during the read"))
    }
}

/// `ArrayD::try_from(&tensor)`: [`Tensor::to_ndarray`]. Feature `ndarray`.
///
/// ```
/// use kiln::{cpu, Tensor};
/// let a = ndarray::ArrayD::<f32>::try_from(&Tensor::new(&[1f32, 2.], &cpu())?)?;
/// assert_eq!(a.as_slice(), Some(&[1f32, 2.][..]));
/// # Ok::<(), kiln::Error>(())
/// ```
impl<T: WithDType> TryFrom<&Tensor> for ArrayD<T> {
    type Error = Error;
    #[track_caller]
    fn try_from(t: &Tensor) -> Result<Self> {
        t.to_ndarray()
    }
}

/// `Array2::try_from(&tensor)`: [`Tensor::to_ndarray2`]. Feature `ndarray`.
///
/// ```
/// use kiln::{cpu, Tensor};
/// let a = ndarray::Array2::<u8>::try_from(&Tensor::new(&[[1u8], [2]], &cpu())?)?;
/// assert_eq!(a.dim(), (2, 1));
/// # Ok::<(), kiln::Error>(())
/// ```
impl<T: WithDType> TryFrom<&Tensor> for Array2<T> {
    type Error = Error;
    #[track_caller]
    fn try_from(t: &Tensor) -> Result<Self> {
        t.to_ndarray2()
    }
}

/// `Tensor::try_from(&array)`: [`Tensor::from_ndarray`] onto the CPU.
/// Feature `ndarray`.
///
/// ```
/// use kiln::Tensor;
/// let t = Tensor::try_from(&ndarray::arr1(&[1i32, 2, 3]))?;
/// assert_eq!(t.device(), kiln::cpu());
/// # Ok::<(), kiln::Error>(())
/// ```
impl<T, S, D> TryFrom<&ArrayBase<S, D>> for Tensor
where
    T: WithDType,
    S: Data<Elem = T>,
    D: Dimension,
{
    type Error = Error;
    #[track_caller]
    fn try_from(array: &ArrayBase<S, D>) -> Result<Self> {
        Tensor::from_ndarray(array, &Device::Cpu)
    }
}
