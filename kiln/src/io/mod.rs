//! Data in and out: numpy's `.npy` and `.npz`, safetensors files of any
//! origin, and (with the `ndarray` feature) the `ndarray` crate's arrays.
//!
//! Every reader takes the device the tensors go to; reading onto a GPU is a
//! host-to-device transfer and writing a GPU tensor a device-to-host one,
//! booked in the transfer ledger at the line that called the reader or
//! writer, and refused under a [`transfer_guard`](crate::transfer_guard) like
//! any transfer.
//!
//! ```
//! use kiln::{cpu, io, try_gpu, Tensor};
//! let dir = std::env::temp_dir().join(format!("kiln-doc-io-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//!
//! let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &cpu())?;
//! io::write_npy(dir.join("x.npy"), &x)?;
//! let y = io::read_npy(dir.join("x.npy"), &try_gpu(0))?;   // straight onto a GPU, if any
//! assert_eq!(y.to_vec2::<f32>()?, x.to_vec2::<f32>()?);
//!
//! let labels = Tensor::new(&[3i64, 1, 4], &cpu())?;
//! io::write_npz(dir.join("set.npz"), &[("x", &x), ("labels", &labels)], true)?;
//! let set = io::read_npz(dir.join("set.npz"), &cpu())?;
//! assert_eq!(set["labels"].to_vec::<i64>()?, vec![3, 1, 4]);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), kiln::Error>(())
//! ```
//!
//! **Hostile files.** A malformed, truncated or lying file is an
//! [`Error::Format`] that names the file (and the `.npz` member or tensor),
//! what is wrong and at which byte; never a panic. Nothing is allocated
//! before the file is known to hold the bytes its header promises: the
//! shape's size is computed with checked arithmetic and compared with the
//! bytes present, and a compressed `.npz` member is inflated no further than
//! its header's size, into memory that grows with what actually inflates.
//!
//! **dtypes.** `.npy` descriptors map to kiln's dtypes: `f2` f16, `f4` f32,
//! `f8` f64, `i4` i32, `i8` i64, `u1` u8, `b1` (numpy's bool) u8 of 0 and 1,
//! and `V2` bf16. numpy has no bfloat16; `ml_dtypes.bfloat16` arrays saved
//! with `np.save` carry the descriptor `<V2` (two raw bytes), which is what
//! kiln writes for bf16 and what it reads as bf16; numpy loads such a file
//! as `V2`, and `.view(ml_dtypes.bfloat16)` gives the values back. Both byte
//! orders (`<`, `>`, and `|`/`=` for the reading machine's) and C and Fortran
//! order are read, as are header versions 1.0, 2.0 and 3.0; kiln writes
//! little-endian, C order, version 1.0 (2.0 when the header needs it).

mod npy;
mod npz;
#[cfg(feature = "plot")]
mod png_image;
pub(crate) mod safetensors;

#[cfg(feature = "ndarray")]
mod ndarray;

pub use npy::{npy_from_bytes, npy_to_bytes, read_npy, write_npy};
pub use npz::{npz_from_bytes, npz_from_bytes_ordered, npz_to_bytes, read_npz, read_npz_ordered, write_npz};
#[cfg(feature = "plot")]
pub use png_image::write_png_rgb;
pub use safetensors::{load_safetensors, save_safetensors};

use crate::runtime::memory::try_vec;
use crate::{CpuBuffer, DType, Error, Result};
use half::{bf16, f16};
use std::io::{Read, Write};

/// The name a reader gives in its errors: a file's path, or `<bytes>` for
/// the from-bytes variants, plus the `.npz` member being read.
#[derive(Clone, Debug)]
pub(crate) struct Origin {
    pub(crate) path: String,
    pub(crate) member: Option<String>,
}

impl Origin {
    pub(crate) fn file(path: &std::path::Path) -> Origin {
        Origin { path: path.display().to_string(), member: None }
    }
    pub(crate) fn bytes() -> Origin {
        Origin { path: "<bytes>".into(), member: None }
    }
    pub(crate) fn member(&self, name: &str) -> Origin {
        Origin { path: self.path.clone(), member: Some(name.to_string()) }
    }
    /// A malformed file: what is wrong with it.
    pub(crate) fn format(&self, msg: impl std::fmt::Display) -> Error {
        let msg = match &self.member {
            Some(m) => format!("member `{m}`: {msg}"),
            None => msg.to_string(),
        };
        Error::Format { path: self.path.clone(), msg }
    }
    /// An I/O failure. Inside an archive, a read that fails with bad data
    /// (a corrupt deflate stream, a CRC mismatch) is a malformed file.
    pub(crate) fn io(&self, what: &str, e: std::io::Error) -> Error {
        match (&self.member, e.kind()) {
            (Some(_), std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput | std::io::ErrorKind::UnexpectedEof) => {
                self.format(format!("{what}: {e}; the archive is corrupt"))
            }
            _ => Error::Io { path: self.path.clone(), msg: format!("{what}: {e}") },
        }
    }
    /// A write that failed: always an I/O error, naming the member.
    pub(crate) fn write_io(&self, e: std::io::Error) -> Error {
        let what = match &self.member {
            Some(m) => format!("cannot write member `{m}`"),
            None => "cannot write the array".to_string(),
        };
        Error::Io { path: self.path.clone(), msg: format!("{what}: {e}") }
    }
}

/// Host memory refused for `bytes` of elements being read.
fn host_oom(bytes: usize) -> Error {
    let in_use = crate::memory_stats(&crate::Device::Cpu).map(|s| s.in_use).unwrap_or(0);
    crate::runtime::host::host_out_of_memory(crate::Device::Cpu, bytes, in_use)
}

/// Which end of an element comes first in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ByteOrder {
    Little,
    Big,
}

impl ByteOrder {
    /// The order of the machine running this code.
    pub(crate) const NATIVE: ByteOrder = if cfg!(target_endian = "big") { ByteOrder::Big } else { ByteOrder::Little };
}

/// How the elements of an array are stored in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ElemFormat {
    /// The kiln dtype they are read as.
    pub(crate) dtype: DType,
    pub(crate) order: ByteOrder,
    /// numpy's bool: one byte, read as a u8 of 0 or 1.
    pub(crate) is_bool: bool,
}

/// Bytes read at a time: a multiple of every element size.
const CHUNK: usize = 64 << 10;

/// Fills `buf` from `reader`; returns how many bytes it got (fewer only at
/// the end of the stream).
fn read_full(reader: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Why decoding stopped early.
pub(crate) enum DecodeError {
    /// The stream ended after this many bytes of data.
    Truncated(u64),
    Io(std::io::Error),
    Other(Error),
}

impl From<Error> for DecodeError {
    fn from(e: Error) -> Self {
        DecodeError::Other(e)
    }
}

/// Reads `len` elements of `format` from `reader`. With `exact` the output
/// is allocated whole at once (the caller checked the bytes are there);
/// otherwise it grows with the bytes that actually arrive, so a stream that
/// promises more than it holds costs no more than what it holds.
pub(crate) fn decode(reader: &mut dyn Read, format: ElemFormat, len: usize, exact: bool) -> std::result::Result<CpuBuffer, DecodeError> {
    fn run<T, const N: usize>(
        reader: &mut dyn Read,
        len: usize,
        exact: bool,
        order: ByteOrder,
        le: fn([u8; N]) -> T,
        be: fn([u8; N]) -> T,
    ) -> std::result::Result<Vec<T>, DecodeError> {
        let convert = if order == ByteOrder::Little { le } else { be };
        let mut out: Vec<T> = if exact { try_vec(len)? } else { Vec::new() };
        let size = CHUNK.min(len.saturating_mul(N));
        let mut chunk = try_vec::<u8>(size)?;
        chunk.resize(size, 0);
        let mut left = len;
        while left > 0 {
            let want = left.min(CHUNK / N);
            let bytes = &mut chunk[..want * N];
            let got = read_full(reader, bytes).map_err(DecodeError::Io)?;
            let whole = got / N;
            if !exact {
                // Amortised growth: a promise of many elements reserves only
                // as the bytes behind it arrive.
                out.try_reserve(whole).map_err(|_| DecodeError::Other(host_oom(out.len().saturating_add(whole).saturating_mul(N))))?;
            }
            for c in bytes[..whole * N].chunks_exact(N) {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                out.push(convert(a));
            }
            if got < want * N {
                return Err(DecodeError::Truncated(((len - left) as u64 * N as u64) + got as u64));
            }
            left -= want;
        }
        Ok(out)
    }
    fn byte(b: [u8; 1]) -> u8 {
        b[0]
    }
    fn boolean(b: [u8; 1]) -> u8 {
        u8::from(b[0] != 0)
    }
    let o = format.order;
    Ok(match format.dtype {
        DType::U8 if format.is_bool => CpuBuffer::U8(run(reader, len, exact, o, boolean, boolean)?),
        DType::U8 => CpuBuffer::U8(run(reader, len, exact, o, byte, byte)?),
        DType::F32 => CpuBuffer::F32(run(reader, len, exact, o, f32::from_le_bytes, f32::from_be_bytes)?),
        DType::F64 => CpuBuffer::F64(run(reader, len, exact, o, f64::from_le_bytes, f64::from_be_bytes)?),
        DType::I64 => CpuBuffer::I64(run(reader, len, exact, o, i64::from_le_bytes, i64::from_be_bytes)?),
        DType::I32 => CpuBuffer::I32(run(reader, len, exact, o, i32::from_le_bytes, i32::from_be_bytes)?),
        DType::F16 => CpuBuffer::F16(run(reader, len, exact, o, f16::from_le_bytes, f16::from_be_bytes)?),
        DType::BF16 => CpuBuffer::BF16(run(reader, len, exact, o, bf16::from_le_bytes, bf16::from_be_bytes)?),
    })
}

/// Writes the elements little-endian, a chunk at a time (no copy of the
/// whole buffer).
pub(crate) fn encode_le(buf: &CpuBuffer, out: &mut dyn Write) -> std::io::Result<()> {
    fn run<T: Copy, const N: usize>(v: &[T], out: &mut dyn Write, le: fn(T) -> [u8; N]) -> std::io::Result<()> {
        let mut bytes = Vec::with_capacity(CHUNK.min(v.len() * N));
        for part in v.chunks(CHUNK / N) {
            bytes.clear();
            for &x in part {
                bytes.extend_from_slice(&le(x));
            }
            out.write_all(&bytes)?;
        }
        Ok(())
    }
    match buf {
        CpuBuffer::U8(v) => out.write_all(v),
        CpuBuffer::F32(v) => run(v, out, f32::to_le_bytes),
        CpuBuffer::F64(v) => run(v, out, f64::to_le_bytes),
        CpuBuffer::I64(v) => run(v, out, i64::to_le_bytes),
        CpuBuffer::I32(v) => run(v, out, i32::to_le_bytes),
        CpuBuffer::F16(v) => run(v, out, f16::to_le_bytes),
        CpuBuffer::BF16(v) => run(v, out, bf16::to_le_bytes),
    }
}

/// The elements of a Fortran-order (column-major) array of `dims`, in C
/// (row-major) order.
pub(crate) fn fortran_to_c(buf: CpuBuffer, dims: &[usize]) -> Result<CpuBuffer> {
    fn run<T: Copy>(src: Vec<T>, dims: &[usize]) -> Result<Vec<T>> {
        if dims.len() < 2 || src.len() < 2 {
            return Ok(src);
        }
        // Column-major strides; walk the output in row-major order with an
        // odometer, moving the source offset by one stride per step.
        let mut strides = vec![0usize; dims.len()];
        let mut s = 1usize;
        for (k, &d) in dims.iter().enumerate() {
            strides[k] = s;
            s = s.saturating_mul(d);
        }
        let mut out = try_vec(src.len())?;
        let mut index = vec![0usize; dims.len()];
        let mut offset = 0usize;
        for _ in 0..src.len() {
            out.push(src[offset]);
            for k in (0..dims.len()).rev() {
                index[k] += 1;
                offset += strides[k];
                if index[k] < dims[k] {
                    break;
                }
                offset -= strides[k] * dims[k];
                index[k] = 0;
            }
        }
        Ok(out)
    }
    fn wrap<T: crate::WithDType>(v: Vec<T>) -> CpuBuffer {
        T::into_buffer(v)
    }
    Ok(crate::map_buffer!(buf, v => wrap(run(v, dims)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fortran_order_becomes_c_order() {
        // a = np.arange(6).reshape(2, 3); a in Fortran order is 0 3 1 4 2 5.
        let f = CpuBuffer::I64(vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(fortran_to_c(f, &[2, 3]).unwrap(), CpuBuffer::I64(vec![0, 1, 2, 3, 4, 5]));
        // np.arange(24).reshape(2, 3, 4), Fortran order: element [i, j, k] at i + 2 j + 6 k.
        let dims = [2, 3, 4];
        let mut f = vec![0i32; 24];
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..4 {
                    f[i + 2 * j + 6 * k] = (i * 12 + j * 4 + k) as i32;
                }
            }
        }
        assert_eq!(fortran_to_c(CpuBuffer::I32(f), &dims).unwrap(), CpuBuffer::I32((0..24).collect()));
        // Empty and rank-1 arrays are the same in both orders.
        assert_eq!(fortran_to_c(CpuBuffer::F32(vec![]), &[0, 5]).unwrap(), CpuBuffer::F32(vec![]));
    }

    #[test]
    fn decode_reads_both_byte_orders_and_stops_at_a_short_stream() {
        let le = ElemFormat { dtype: DType::I32, order: ByteOrder::Little, is_bool: false };
        let be = ElemFormat { order: ByteOrder::Big, ..le };
        let bytes = [1u8, 0, 0, 0, 0, 0, 0, 2];
        assert!(matches!(decode(&mut &bytes[..], le, 2, true), Ok(CpuBuffer::I32(v)) if v == [1, 0x0200_0000]));
        assert!(matches!(decode(&mut &bytes[..], be, 2, false), Ok(CpuBuffer::I32(v)) if v == [0x0100_0000, 2]));
        assert!(matches!(decode(&mut &bytes[..7], le, 2, false), Err(DecodeError::Truncated(7))));
        let flag = ElemFormat { dtype: DType::U8, order: ByteOrder::Little, is_bool: true };
        assert!(matches!(decode(&mut &[0u8, 1, 2, 255][..], flag, 4, true), Ok(CpuBuffer::U8(v)) if v == [0, 1, 1, 1]));
    }
}
