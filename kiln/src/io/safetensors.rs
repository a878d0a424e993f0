//! Safetensors files of any origin (PyTorch, Hugging Face, candle, kiln's
//! own checkpoints) as maps by name; the parsing and its checks are
//! [`crate::checkpoint`]'s.

use crate::runtime::ledger;
use crate::{checkpoint, Device, Result, Tensor};
use std::collections::HashMap;
use std::panic::Location;
use std::path::Path;

/// Loads every tensor of a safetensors file onto `device`, by name.
///
/// Any writer's file is read (the `__metadata__` entry is skipped) as long
/// as its dtypes are kiln's: F32, F64, I64, I32, U8, F16, BF16; another
/// dtype (BOOL, I8, F8 …) is an [`Error::Format`](crate::Error::Format)
/// naming the tensor, as is a truncated or inconsistent file or a header
/// that names a tensor twice. Reading onto a GPU books one host-to-device
/// transfer per tensor at the caller's line. For the file's order use
/// [`checkpoint::load_tensors`].
///
/// ```
/// use kiln::{cpu, io, try_gpu, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-load-st-{}.safetensors", std::process::id()));
/// let w = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
/// let b = Tensor::new(&[0.5f32, -0.5], &cpu())?;
/// io::save_safetensors(&path, &[("layer.weight", &w), ("layer.bias", &b)])?;
/// let tensors = io::load_safetensors(&path, &try_gpu(0))?;
/// assert_eq!(tensors["layer.bias"].to_vec::<f32>()?, vec![0.5, -0.5]);
/// assert_eq!(tensors["layer.weight"].device(), try_gpu(0));
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn load_safetensors(path: impl AsRef<Path>, device: &Device) -> Result<HashMap<String, Tensor>> {
    let _site = ledger::site_scope(Location::caller());
    crate::registry::backend(*device)?;
    Ok(checkpoint::load_tensors(path, device)?.into_iter().collect())
}

/// Saves named tensors (from any devices) to a safetensors file, atomically
/// (see [`checkpoint::save_tensors`]). Names must be distinct
/// ([`Error::InvalidArgument`](crate::Error::InvalidArgument)). Reading a
/// GPU tensor books a device-to-host transfer at the caller's line.
///
/// ```
/// use kiln::{cpu, io, DType, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-save-st-{}.safetensors", std::process::id()));
/// let x = Tensor::ones((2, 2), DType::F16, &cpu())?;
/// io::save_safetensors(&path, &[("x", &x)])?;
/// assert_eq!(io::load_safetensors(&path, &cpu())?["x"].dtype(), DType::F16);
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn save_safetensors(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let _site = ledger::site_scope(Location::caller());
    let owned: Vec<(String, Tensor)> = tensors.iter().map(|(n, t)| (n.to_string(), (*t).clone())).collect();
    checkpoint::save_tensors(&owned, path)
}
