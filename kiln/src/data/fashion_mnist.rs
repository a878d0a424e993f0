//! Fashion-MNIST's IDX files, read from a local directory (nothing is ever
//! downloaded).

use super::{DataLoader, DataModule};
use crate::{Device, Error, Result, Tensor};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The names of Fashion-MNIST's ten classes, by label.
pub const FASHION_MNIST_CLASSES: [&str; 10] =
    ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"];

fn io_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io { path: path.display().to_string(), msg: e.to_string() }
}

fn format_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Format { path: path.display().to_string(), msg: msg.into() }
}

/// An IDX array of unsigned bytes: its dimensions and its elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// Elements, row-major.
    pub data: Vec<u8>,
}

/// Decompresses a gzipped IDX file, reading no more than its header says
/// it holds (plus one byte, to tell a longer stream): a small file that
/// inflates without end (a "gzip bomb") is an error, not an exhausted host.
fn gunzip_idx(path: &Path, raw: &[u8]) -> Result<Vec<u8>> {
    let gz_err = |e: std::io::Error| format_err(path, format!("not a valid gzip stream: {e}"));
    let mut reader = flate2::read::GzDecoder::new(raw);
    let mut head = [0u8; 4];
    reader.read_exact(&mut head).map_err(gz_err)?;
    let rank = head[3] as usize;
    let mut dims = vec![0u8; 4 * rank];
    reader.read_exact(&mut dims).map_err(gz_err)?;
    let count = dims
        .chunks(4)
        .try_fold(1usize, |a, b| a.checked_mul(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize))
        .ok_or_else(|| format_err(path, "the header's dimensions overflow"))?;
    let header = 4 + dims.len();
    let limit = count.checked_add(header + 1).ok_or_else(|| format_err(path, "the header's dimensions overflow"))?;
    let mut out = Vec::new();
    out.try_reserve_exact(header.saturating_add(count.min(1 << 30)))
        .map_err(|_| format_err(path, format!("the header announces {count} bytes, more than this machine can hold")))?;
    out.extend_from_slice(&head);
    out.extend_from_slice(&dims);
    let mut chunk = vec![0u8; 1 << 16];
    while out.len() < limit {
        let want = chunk.len().min(limit - out.len());
        let n = reader.read(&mut chunk[..want]).map_err(gz_err)?;
        if n == 0 {
            break;
        }
        out.try_reserve(n).map_err(|_| format_err(path, format!("the header announces {count} bytes, more than this machine can hold")))?;
        out.extend_from_slice(&chunk[..n]);
    }
    if out.len() > header + count {
        return Err(format_err(
            path,
            format!("the gzip stream inflates past the {count} bytes of data its header announces; the file is corrupt"),
        ));
    }
    Ok(out)
}

/// Reads an IDX file of unsigned bytes (the MNIST format), gzipped or not
/// (recognised by its first bytes, not its name).
pub fn read_idx(path: impl AsRef<Path>) -> Result<IdxArray> {
    let path = path.as_ref();
    let raw = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) { gunzip_idx(path, &raw)? } else { raw };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(format_err(path, "not an IDX file: it must start with two zero bytes, a type byte and a rank byte"));
    }
    if bytes[2] != 0x08 {
        return Err(format_err(path, format!("IDX element type 0x{:02x} is not supported; kiln reads unsigned bytes (0x08)", bytes[2])));
    }
    let rank = bytes[3] as usize;
    let header = 4 + 4 * rank;
    if bytes.len() < header {
        return Err(format_err(path, format!("truncated header: {} bytes, a rank-{rank} IDX header needs {header}", bytes.len())));
    }
    let dims: Vec<usize> = (0..rank)
        .map(|i| {
            let b = &bytes[4 + 4 * i..8 + 4 * i];
            u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
        })
        .collect();
    let count =
        dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| format_err(path, format!("dimensions {dims:?} overflow")))?;
    let body = bytes.len() - header;
    if body != count {
        return Err(format_err(
            path,
            format!("dimensions {dims:?} need {count} bytes of data but the file holds {body}; the file is truncated or corrupt"),
        ));
    }
    Ok(IdxArray { dims, data: bytes[header..].to_vec() })
}

fn find_file(dir: &Path, base: &str) -> Result<PathBuf> {
    for name in [format!("{base}.gz"), base.to_string()] {
        let p = dir.join(&name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(Error::Io {
        path: dir.join(format!("{base}.gz")).display().to_string(),
        msg: format!(
            "not found (nor {base} without .gz); kiln downloads nothing: put Fashion-MNIST's four IDX files \
             (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, gzipped or not) in {}",
            dir.display()
        ),
    })
}

/// Fashion-MNIST from `dir`: images (n, 1, 28, 28) as f32 in [0, 1] and
/// labels (n) as i64, on `device`. `train` picks the training set (60,000
/// images) or the test set (10,000). Files may be gzipped or not.
pub fn load_fashion_mnist(dir: impl AsRef<Path>, train: bool, device: &Device) -> Result<(Tensor, Tensor)> {
    let dir = dir.as_ref();
    let prefix = if train { "train" } else { "t10k" };
    let img_path = find_file(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let lbl_path = find_file(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    let images = read_idx(&img_path)?;
    let labels = read_idx(&lbl_path)?;
    if images.dims.len() != 3 {
        return Err(format_err(&img_path, format!("images must be a rank-3 IDX array (n, rows, cols), got dimensions {:?}", images.dims)));
    }
    if labels.dims.len() != 1 {
        return Err(format_err(&lbl_path, format!("labels must be a rank-1 IDX array, got dimensions {:?}", labels.dims)));
    }
    let (n, h, w) = (images.dims[0], images.dims[1], images.dims[2]);
    if labels.dims[0] != n {
        return Err(format_err(&lbl_path, format!("{} labels for {n} images in {}", labels.dims[0], img_path.display())));
    }
    if let Some(bad) = labels.data.iter().find(|&&l| l > 9) {
        return Err(format_err(&lbl_path, format!("label {bad} is not a Fashion-MNIST class (0 to 9)")));
    }
    let pixels: Vec<f32> = images.data.iter().map(|&p| p as f32 / 255.0).collect();
    let x = Tensor::from_vec(pixels, (n, 1, h, w), device)?;
    let y = Tensor::from_vec(labels.data.iter().map(|&l| l as i64).collect::<Vec<_>>(), n, device)?;
    Ok((x, y))
}

/// Fashion-MNIST loaders from `dir`: shuffled training batches and in-order
/// test batches, on the CPU.
pub fn fashion_mnist(dir: impl AsRef<Path>, batch_size: usize) -> Result<DataModule> {
    let dir = dir.as_ref();
    let (x, y) = load_fashion_mnist(dir, true, &Device::Cpu)?;
    let (xv, yv) = load_fashion_mnist(dir, false, &Device::Cpu)?;
    Ok(DataModule { train: DataLoader::new(vec![x, y], batch_size)?.shuffle(true), val: Some(DataLoader::new(vec![xv, yv], batch_size)?) })
}
