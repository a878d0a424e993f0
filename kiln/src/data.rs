//! Data: a [`DataLoader`] over in-memory tensors, the synthetic data sets of
//! the book (linear regression with w = [2, −3.4], b = 4.2; Gaussian class
//! clusters), and a reader for Fashion-MNIST's IDX files from a local
//! directory (nothing is ever downloaded).
//!
//! ```
//! use kiln::data::{make_regression, DataLoader};
//! use kiln::cpu;
//! kiln::manual_seed(0);
//! let (x, y) = make_regression(&[2.0, -3.4], 4.2, 0.01, 100, &cpu())?;
//! let loader = DataLoader::new(vec![x, y], 32)?.shuffle(true);
//! assert_eq!(loader.len(), 4); // 32 + 32 + 32 + 4
//! for batch in loader.iter()? {
//!     let batch = batch?;
//!     assert_eq!(batch[0].dims()[1], 2);
//! }
//! # Ok::<(), kiln::Error>(())
//! ```

use crate::runtime::rng;
use crate::{DType, Device, Error, Result, Tensor};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Batches of rows of one or more tensors that share their first dimension
/// (features and labels). Without shuffling, batches are views (no copy);
/// with shuffling, each epoch gathers the rows once in a new order drawn
/// from kiln's seeded generator ([`crate::manual_seed`]), on the tensors'
/// device, and batches are views of that.
#[derive(Clone, Debug)]
pub struct DataLoader {
    tensors: Vec<Tensor>,
    batch_size: usize,
    shuffle: bool,
    drop_last: bool,
}

impl DataLoader {
    /// A loader over `tensors` (each with the same number of rows), in order,
    /// keeping the last, smaller batch.
    pub fn new(tensors: Vec<Tensor>, batch_size: usize) -> Result<DataLoader> {
        let first = tensors.first().ok_or_else(|| Error::invalid("DataLoader", "needs at least one tensor"))?;
        if batch_size == 0 {
            return Err(Error::invalid("DataLoader", "the batch size must be at least 1"));
        }
        if first.rank() == 0 {
            return Err(Error::invalid("DataLoader", "tensors need a first dimension (rows)"));
        }
        let n = first.dims()[0];
        for t in &tensors {
            if t.rank() == 0 || t.dims()[0] != n {
                return Err(Error::ShapeMismatch {
                    op: "DataLoader: every tensor needs the same number of rows".into(),
                    lhs: first.dims().to_vec(),
                    rhs: t.dims().to_vec(),
                });
            }
            if t.device() != first.device() {
                return Err(Error::DeviceMismatch { op: "DataLoader".into(), lhs: first.device(), rhs: t.device() });
            }
        }
        Ok(DataLoader { tensors, batch_size, shuffle: false, drop_last: false })
    }

    /// Shuffle the rows every epoch (builder style).
    pub fn shuffle(mut self, shuffle: bool) -> DataLoader {
        self.shuffle = shuffle;
        self
    }

    /// Drop the last batch when it is smaller than the batch size (builder style).
    pub fn drop_last(mut self, drop_last: bool) -> DataLoader {
        self.drop_last = drop_last;
        self
    }

    /// Number of examples.
    pub fn num_examples(&self) -> usize {
        self.tensors[0].dims()[0]
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The tensors, as given.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The device the data lives on.
    pub fn device(&self) -> Device {
        self.tensors[0].device()
    }

    /// Batches per epoch.
    pub fn len(&self) -> usize {
        let n = self.num_examples();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// True when an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One epoch of batches; with shuffling, a new order each call.
    pub fn iter(&self) -> Result<Batches> {
        let n = self.num_examples();
        let tensors = if self.shuffle && n > 1 {
            let perm = permutation(n);
            let ids = Tensor::from_vec(perm, n, &self.device())?;
            self.tensors.iter().map(|t| t.index_select(&ids, 0)).collect::<Result<Vec<_>>>()?
        } else {
            self.tensors.clone()
        };
        Ok(Batches { tensors, start: 0, n, batch_size: self.batch_size, drop_last: self.drop_last })
    }
}

/// A random permutation of 0..n (Fisher–Yates) from kiln's seeded generator.
///
/// ```
/// kiln::manual_seed(1);
/// let a = kiln::data::permutation(10);
/// kiln::manual_seed(1);
/// assert_eq!(a, kiln::data::permutation(10));
/// let mut s = a.clone();
/// s.sort();
/// assert_eq!(s, (0..10).collect::<Vec<i64>>());
/// ```
pub fn permutation(n: usize) -> Vec<i64> {
    let mut v: Vec<i64> = (0..n as i64).collect();
    if n < 2 {
        return v;
    }
    // One draw from kiln's generator seeds a SplitMix64 stream for the
    // swaps: reproducible under `manual_seed`, and cheap per element.
    let mut state = rng::next_u64();
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for i in (1..n).rev() {
        // Multiply-shift maps 64 random bits onto 0..=i.
        let j = ((next() as u128 * (i as u128 + 1)) >> 64) as usize;
        v.swap(i, j);
    }
    v
}

/// The batches of one epoch: each item is one batch, a view of each tensor.
pub struct Batches {
    tensors: Vec<Tensor>,
    start: usize,
    n: usize,
    batch_size: usize,
    drop_last: bool,
}

impl Iterator for Batches {
    type Item = Result<Vec<Tensor>>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.start >= self.n {
            return None;
        }
        let len = self.batch_size.min(self.n - self.start);
        if self.drop_last && len < self.batch_size {
            return None;
        }
        let start = self.start;
        self.start += len;
        Some(self.tensors.iter().map(|t| t.narrow(0, start, len)).collect())
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let rest = self.n.saturating_sub(self.start);
        let k = if self.drop_last { rest / self.batch_size } else { rest.div_ceil(self.batch_size) };
        (k, Some(k))
    }
}

/// A training loader and, optionally, a validation loader.
#[derive(Clone, Debug)]
pub struct DataModule {
    /// Batches for training (usually shuffled).
    pub train: DataLoader,
    /// Batches for validation (in order), if any.
    pub val: Option<DataLoader>,
}

/// `n` examples of y = X·w + b + ε with X ~ N(0, 1) of shape (n, len(w)),
/// ε ~ N(0, noise²); y has shape (n, 1). The book's `SyntheticRegressionData`.
pub fn make_regression(w: &[f32], b: f32, noise: f64, n: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    if w.is_empty() {
        return Err(Error::invalid("make_regression", "needs at least one weight"));
    }
    let x = Tensor::randn((n, w.len()), device)?;
    let wt = Tensor::from_vec(w.to_vec(), (w.len(), 1), device)?;
    let eps = Tensor::randn_with(0.0, noise, (n, 1), DType::F32, device)?;
    let y = x.matmul(&wt)?.add_scalar(b as f64)?.add(&eps)?;
    Ok((x, y))
}

/// The book's synthetic regression data: w = [2, −3.4], b = 4.2, noise 0.01,
/// `num_train` shuffled training examples and `num_val` validation ones, on
/// the CPU (the [`Trainer`](crate::trainer::Trainer) moves batches).
pub fn synthetic_regression(num_train: usize, num_val: usize, batch_size: usize) -> Result<DataModule> {
    let (x, y) = make_regression(&[2.0, -3.4], 4.2, 0.01, num_train + num_val, &Device::Cpu)?;
    split(x, y, num_train, num_val, batch_size)
}

fn split(x: Tensor, y: Tensor, num_train: usize, num_val: usize, batch_size: usize) -> Result<DataModule> {
    let train = DataLoader::new(vec![x.narrow(0, 0, num_train)?, y.narrow(0, 0, num_train)?], batch_size)?.shuffle(true);
    let val = if num_val > 0 {
        Some(DataLoader::new(vec![x.narrow(0, num_train, num_val)?, y.narrow(0, num_train, num_val)?], batch_size)?)
    } else {
        None
    };
    Ok(DataModule { train, val })
}

/// `n` examples in `num_classes` Gaussian clusters: class centers drawn from
/// N(0, 2.5²) in `num_features` dimensions, points at unit spread around
/// them; labels (i64) cycle through the classes. Returns (X (n, features) f32, labels (n)).
pub fn make_classification(n: usize, num_features: usize, num_classes: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    if num_features == 0 || num_classes < 2 {
        return Err(Error::invalid("make_classification", "needs at least one feature and two classes"));
    }
    let centers = Tensor::randn_with(0.0, 2.5, (num_classes, num_features), DType::F32, device)?;
    let labels: Vec<i64> = (0..n).map(|i| (i % num_classes) as i64).collect();
    let y = Tensor::from_vec(labels, n, device)?;
    let x = centers.index_select(&y, 0)?.add(&Tensor::randn((n, num_features), device)?)?;
    Ok((x, y))
}

/// Synthetic classification data (see [`make_classification`]) split into
/// shuffled training and in-order validation loaders, on the CPU.
pub fn synthetic_classification(
    num_train: usize,
    num_val: usize,
    num_features: usize,
    num_classes: usize,
    batch_size: usize,
) -> Result<DataModule> {
    let (x, y) = make_classification(num_train + num_val, num_features, num_classes, &Device::Cpu)?;
    split(x, y, num_train, num_val, batch_size)
}

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
