//! Reading tensors back to the host (`to_vec`, `to_scalar`, `item`): a
//! device-to-host transfer on a GPU, booked in the ledger at the caller's
//! line and refused under a transfer guard.

use crate::base::buffer::CpuBuffer;
use crate::runtime::ledger;
use crate::{Device, Error, Result, Tensor, WithDType};
use std::panic::Location;

impl Tensor {
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
        self.read_as("to_vec")
    }

    /// The elements as `T`, which must be the tensor's dtype. The error
    /// names the read (`to_scalar::<f64>`) and advises converting the
    /// tensor to the type asked for (`lhs`: asked, `rhs`: held).
    #[track_caller]
    fn read_as<T: WithDType>(&self, op: &str) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch { op: format!("{op}::<{}>", T::DTYPE), lhs: T::DTYPE, rhs: self.dtype() });
        }
        let buf = self.read_host(Location::caller())?;
        T::from_buffer(buf).ok_or_else(|| Error::invalid(op, "dtype changed during the read"))
    }

    /// Reads the elements as a vector of rows (2-D tensors).
    #[track_caller]
    pub fn to_vec2<T: WithDType>(&self) -> Result<Vec<Vec<T>>> {
        if self.rank() != 2 {
            return Err(Error::invalid("to_vec2", format!("needs a 2-D tensor, this one has shape {}", self.shape())));
        }
        let (rows, cols) = (self.dims()[0], self.dims()[1]);
        let flat = self.read_as::<T>("to_vec2")?;
        let mut out = crate::runtime::memory::try_vec(rows)?;
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
    /// let x = Tensor::new(&[5f32], &cpu())?;
    /// assert_eq!(x.to_scalar::<f32>()?, 5.0);
    /// // Another type is refused, naming the read and the conversion to make.
    /// let e = x.to_scalar::<f64>().unwrap_err().to_string();
    /// assert!(e.starts_with("to_scalar::<f64>") && e.contains("to_dtype(DType::F64)"), "{e}");
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn to_scalar<T: WithDType>(&self) -> Result<T> {
        if self.elem_count() != 1 {
            return Err(Error::invalid("to_scalar", format!("needs exactly one element, this tensor has shape {}", self.shape())));
        }
        Ok(self.read_as::<T>("to_scalar")?[0])
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
        // Backends read contiguous views; a strided one is made contiguous
        // on its own device first (a GPU kernel, no extra transfer).
        let this = if self.is_contiguous() || self.backend().host_memory() { self.clone() } else { self.force_copy()? };
        let data = this.backend().download(&this.src())?;
        if let Some(ticket) = ticket {
            ticket.book();
        }
        Ok(data)
    }
}
