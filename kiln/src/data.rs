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

use crate::runtime::ledger::site_scope;
use crate::runtime::rng;
use crate::{DType, Device, Error, Result, Tensor};
use parking_lot::Mutex;
use std::io::Read;
use std::panic::Location;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a loader keeps its examples when batches are asked for on another
/// device ([`DataLoader::iter_on`], and so the [`Trainer`](crate::trainer::Trainer)).
///
/// ```
/// use kiln::data::{DataLoader, Placement};
/// use kiln::{Tensor, cpu};
/// let x = Tensor::zeros((10, 2), kiln::DType::F32, &cpu())?;
/// let loader = DataLoader::new(vec![x], 4)?.placement(Placement::Stream);
/// assert_eq!(loader.get_placement(), Placement::Stream);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// On the device when the examples take at most half of its free
    /// memory (capacity less kiln's use), else [`Placement::Stream`]; also
    /// streamed when the copy runs out of memory. The default.
    #[default]
    Auto,
    /// On the device: the examples are copied there once (one booked
    /// transfer per tensor) at the first epoch and kept by the loader; an
    /// [`Error::OutOfMemory`] when they do not fit.
    Device,
    /// Where they are: each batch is cut there and copied to the device,
    /// one batch ahead of the one being trained on.
    Stream,
}

/// The loader's examples on a device other than their own, made at the
/// first epoch there and kept for the next ones.
#[derive(Debug)]
struct Resident {
    device: Device,
    tensors: Vec<Tensor>,
}

/// Batches of rows of one or more tensors that share their first dimension
/// (features and labels). Without shuffling, batches are views (no copy);
/// with shuffling, each epoch draws a new order from kiln's seeded
/// generator ([`crate::manual_seed`]) and each batch gathers its rows, on
/// the tensors' device.
///
/// [`DataLoader::iter_on`] gives the batches on another device (what the
/// [`Trainer`](crate::trainer::Trainer) uses): by default the loader then
/// holds a copy of its examples on that device when they fit (see
/// [`Placement`]), copied once and booked once in the transfer ledger, and
/// otherwise uploads each batch one ahead of the one being trained on.
/// Clones of a loader share that copy; it is made at the first epoch on the
/// device, so later in-place writes to the source tensors are not seen
/// ([`DataLoader::release_device_copy`] drops it).
#[derive(Clone, Debug)]
pub struct DataLoader {
    tensors: Vec<Tensor>,
    batch_size: usize,
    shuffle: bool,
    drop_last: bool,
    placement: Placement,
    resident: Arc<Mutex<Option<Resident>>>,
}

impl DataLoader {
    /// A loader over `tensors` (each with the same number of rows), in order,
    /// keeping the last, smaller batch.
    ///
    /// ```
    /// use kiln::data::DataLoader;
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::zeros((5, 2), DType::F32, &cpu())?;
    /// let y = Tensor::zeros(4, DType::I64, &cpu())?;
    /// assert!(DataLoader::new(vec![x.clone(), y], 2).is_err()); // 5 rows and 4
    /// assert_eq!(DataLoader::new(vec![x], 2)?.len(), 3);
    /// # Ok::<(), kiln::Error>(())
    /// ```
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
        Ok(DataLoader {
            tensors,
            batch_size,
            shuffle: false,
            drop_last: false,
            placement: Placement::Auto,
            resident: Arc::new(Mutex::new(None)),
        })
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

    /// Where the examples go when batches are asked for on another device
    /// (builder style); [`Placement::Auto`] by default.
    pub fn placement(mut self, placement: Placement) -> DataLoader {
        if placement != self.placement {
            self.placement = placement;
            self.resident = Arc::new(Mutex::new(None));
        }
        self
    }

    /// The placement asked for with [`DataLoader::placement`].
    pub fn get_placement(&self) -> Placement {
        self.placement
    }

    /// Whether shuffling is on.
    pub fn is_shuffled(&self) -> bool {
        self.shuffle
    }

    /// Number of examples.
    pub fn num_examples(&self) -> usize {
        self.tensors[0].dims()[0]
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The same loader with another batch size (shuffling, `drop_last` and
    /// placement kept; the device copy is shared).
    ///
    /// ```
    /// use kiln::data::DataLoader;
    /// use kiln::{Tensor, DType, cpu};
    /// let loader = DataLoader::new(vec![Tensor::zeros((10, 1), DType::F32, &cpu())?], 4)?;
    /// assert_eq!(loader.with_batch_size(5)?.len(), 2);
    /// assert!(loader.with_batch_size(0).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn with_batch_size(&self, batch_size: usize) -> Result<DataLoader> {
        if batch_size == 0 {
            return Err(Error::invalid("DataLoader", "the batch size must be at least 1"));
        }
        Ok(DataLoader { batch_size, ..self.clone() })
    }

    /// The tensors, as given.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The device the data lives on.
    pub fn device(&self) -> Device {
        self.tensors[0].device()
    }

    /// The device holding the loader's copy of its examples, if it made one
    /// (see [`Placement`]).
    ///
    /// ```
    /// use kiln::data::DataLoader;
    /// use kiln::{Tensor, DType, cpu, try_gpu};
    /// let loader = DataLoader::new(vec![Tensor::zeros((8, 2), DType::F32, &cpu())?], 4)?;
    /// assert_eq!(loader.device_copy(), None);
    /// for batch in loader.iter_on(&try_gpu(0))? {
    ///     assert_eq!(batch?[0].device(), try_gpu(0));
    /// }
    /// // Held on the GPU (when there is one) for the next epochs.
    /// assert_eq!(loader.device_copy(), try_gpu(0).is_gpu().then(|| try_gpu(0)));
    /// loader.release_device_copy();
    /// assert_eq!(loader.device_copy(), None);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn device_copy(&self) -> Option<Device> {
        self.resident.lock().as_ref().map(|r| r.device)
    }

    /// Drops the loader's copy of its examples on another device (and that
    /// of its clones), freeing that memory; the next epoch there copies
    /// them again.
    pub fn release_device_copy(&self) {
        *self.resident.lock() = None;
    }

    /// Bytes of the examples (every tensor).
    pub fn num_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.elem_count().saturating_mul(t.dtype().size_in_bytes())).fold(0, usize::saturating_add)
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

    /// One epoch of batches, on the tensors' device; with shuffling, a new
    /// order each call. On a GPU the order is drawn on the host and copied
    /// there (one transfer, booked at the caller's line).
    #[track_caller]
    pub fn iter(&self) -> Result<Batches> {
        let site = Location::caller();
        let _site = site_scope(site);
        self.batches(self.tensors.clone(), None, site)
    }

    /// One epoch of batches on `device`: from the loader's copy of its
    /// examples there when it holds one or makes one now (see
    /// [`Placement`]), else cut where the examples are and uploaded one
    /// batch ahead: while the device runs the step on batch `k`, batch
    /// `k + 1` is already copied (asynchronous devices queue the step, so
    /// the host goes on to the next upload at once). Every transfer, now or
    /// while iterating, is booked at the line that called `iter_on`.
    ///
    /// ```
    /// use kiln::data::DataLoader;
    /// use kiln::{Tensor, DType, cpu, try_gpu};
    /// kiln::manual_seed(0);
    /// let x = Tensor::rand((100, 3), &cpu())?;
    /// let y = Tensor::zeros(100, DType::I64, &cpu())?;
    /// let loader = DataLoader::new(vec![x, y], 32)?.shuffle(true);
    /// let before = kiln::thread_transfer_stats();
    /// for _epoch in 0..3 {
    ///     for batch in loader.iter_on(&try_gpu(0))? {
    ///         assert_eq!(batch?[0].device(), try_gpu(0));
    ///     }
    /// }
    /// let moved = kiln::thread_transfer_stats().since(&before).total().count;
    /// // On a GPU: x and y once, then one shuffled order per epoch.
    /// assert_eq!(moved, if try_gpu(0).is_gpu() { 2 + 3 } else { 0 });
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn iter_on(&self, device: &Device) -> Result<Batches> {
        let site = Location::caller();
        let _site = site_scope(site);
        match self.resident_on(device)? {
            Some(tensors) => self.batches(tensors, None, site),
            None => self.batches(self.tensors.clone(), Some(*device), site),
        }
    }

    /// The examples on `device` when they live there or the loader holds
    /// (or now makes) a copy there; `None` when they are to be streamed.
    fn resident_on(&self, device: &Device) -> Result<Option<Vec<Tensor>>> {
        if self.device() == *device {
            return Ok(Some(self.tensors.clone()));
        }
        if self.placement == Placement::Stream {
            return Ok(None);
        }
        let mut cache = self.resident.lock();
        if let Some(r) = cache.as_ref().filter(|r| r.device == *device) {
            return Ok(Some(r.tensors.clone()));
        }
        // A copy on another device goes first: its memory may be needed.
        *cache = None;
        if self.placement == Placement::Auto && !fits(self.num_bytes(), device)? {
            return Ok(None);
        }
        let _g = crate::no_grad();
        match self.tensors.iter().map(|t| t.to(device)).collect::<Result<Vec<_>>>() {
            Ok(tensors) => {
                *cache = Some(Resident { device: *device, tensors: tensors.clone() });
                Ok(Some(tensors))
            }
            // Auto: what did not fit is streamed instead (the partial copy
            // is dropped here, before the first batch is uploaded).
            Err(Error::OutOfMemory { .. }) if self.placement == Placement::Auto => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn batches(&self, tensors: Vec<Tensor>, upload_to: Option<Device>, site: &'static Location<'static>) -> Result<Batches> {
        let n = self.num_examples();
        let order = if self.shuffle && n > 1 {
            let device = tensors[0].device();
            Some(Tensor::from_vec(permutation(n), n, &device)?)
        } else {
            None
        };
        Ok(Batches {
            tensors,
            order,
            start: 0,
            n,
            batch_size: self.batch_size,
            drop_last: self.drop_last,
            upload_to,
            ahead: None,
            done: false,
            site,
        })
    }
}

/// Whether `bytes` of examples should be held on `device`: at most half of
/// what is free there (capacity less kiln's use), leaving the rest to the
/// model, its gradients and activations. Anything fits the host.
fn fits(bytes: usize, device: &Device) -> Result<bool> {
    if device.is_cpu() {
        return Ok(true);
    }
    let stats = device.memory_stats()?;
    Ok(match stats.capacity {
        Some(capacity) => bytes <= capacity.saturating_sub(stats.in_use) / 2,
        None => true,
    })
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
    if n < 2 {
        return (0..n as i64).collect();
    }
    permutation_from_seed(n, rng::next_u64())
}

/// A random permutation of 0..n (Fisher–Yates) determined by `seed` alone:
/// it neither reads nor moves kiln's generator.
///
/// ```
/// use kiln::data::permutation_from_seed;
/// assert_eq!(permutation_from_seed(6, 42), permutation_from_seed(6, 42));
/// assert_ne!(permutation_from_seed(6, 42), permutation_from_seed(6, 43));
/// ```
pub fn permutation_from_seed(n: usize, seed: u64) -> Vec<i64> {
    let mut v: Vec<i64> = (0..n as i64).collect();
    // A SplitMix64 stream for the swaps: reproducible, and cheap per element.
    let mut state = seed;
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

/// The batches of one epoch: each item is one batch, one tensor per tensor
/// of the loader, on the device it was asked for.
pub struct Batches {
    tensors: Vec<Tensor>,
    /// The epoch's order of the rows, on the tensors' device (shuffling).
    order: Option<Tensor>,
    start: usize,
    n: usize,
    batch_size: usize,
    drop_last: bool,
    /// Streaming: the device each batch is copied to.
    upload_to: Option<Device>,
    /// Streaming: the next batch, already copied.
    ahead: Option<Result<Vec<Tensor>>>,
    /// An error ended the epoch.
    done: bool,
    /// Where transfers are booked: the line that asked for the epoch.
    site: &'static Location<'static>,
}

impl Batches {
    /// The next batch where the rows are (a view, or the gathered rows).
    fn cut(&mut self) -> Option<Result<Vec<Tensor>>> {
        if self.start >= self.n {
            return None;
        }
        let len = self.batch_size.min(self.n - self.start);
        if self.drop_last && len < self.batch_size {
            return None;
        }
        let start = self.start;
        self.start += len;
        Some(match &self.order {
            Some(order) => order.narrow(0, start, len).and_then(|ids| self.tensors.iter().map(|t| t.index_select(&ids, 0)).collect()),
            None => self.tensors.iter().map(|t| t.narrow(0, start, len)).collect(),
        })
    }

    /// The next batch on the device it is streamed to.
    fn cut_and_upload(&mut self, device: Device) -> Option<Result<Vec<Tensor>>> {
        let batch = self.cut()?;
        Some(batch.and_then(|b| b.iter().map(|t| t.to(&device)).collect()))
    }
}

impl Iterator for Batches {
    type Item = Result<Vec<Tensor>>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let _site = site_scope(self.site);
        let item = match self.upload_to {
            None => self.cut(),
            Some(device) => {
                let current = match self.ahead.take() {
                    Some(batch) => Some(batch),
                    None => self.cut_and_upload(device),
                };
                // Copy the following batch now, before the caller queues
                // its step on this one.
                if matches!(current, Some(Ok(_))) {
                    self.ahead = self.cut_and_upload(device);
                }
                current
            }
        };
        if matches!(item, Some(Err(_))) {
            self.done = true;
        }
        item
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.done {
            return (0, Some(0));
        }
        let rest = self.n.saturating_sub(self.start);
        let k = if self.drop_last { rest / self.batch_size } else { rest.div_ceil(self.batch_size) };
        let k = k + usize::from(self.ahead.is_some());
        (k, Some(k))
    }
}

/// A training loader and, optionally, a validation loader.
///
/// ```
/// use kiln::data::DataModule;
/// use kiln::{Tensor, DType, cpu};
/// kiln::manual_seed(0);
/// let x = Tensor::rand((100, 4), &cpu())?;
/// let y = Tensor::zeros(100, DType::I64, &cpu())?;
/// // Every row for training, in shuffled batches of 32 ...
/// let data = DataModule::from_tensors(x, y)?;
/// assert_eq!((data.train.num_examples(), data.train.batch_size()), (100, 32));
/// // ... or a seeded random fifth held out for validation, in batches of 16.
/// let data = data.with_batch_size(16)?.random_split(0.2, 42)?;
/// assert_eq!(data.train.num_examples(), 80);
/// assert_eq!(data.val.as_ref().map(|v| v.num_examples()), Some(20));
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct DataModule {
    /// Batches for training (usually shuffled).
    pub train: DataLoader,
    /// Batches for validation (in order), if any.
    pub val: Option<DataLoader>,
}

impl DataModule {
    /// Features `x` and targets `y` (the same number of rows, on one
    /// device), every row for training, shuffled each epoch, in batches of
    /// 32 ([`DataModule::with_batch_size`] changes it); no validation
    /// loader ([`DataModule::random_split`] makes one).
    pub fn from_tensors(x: Tensor, y: Tensor) -> Result<DataModule> {
        Ok(DataModule { train: DataLoader::new(vec![x, y], 32)?.shuffle(true), val: None })
    }

    /// The same loaders with another batch size.
    pub fn with_batch_size(self, batch_size: usize) -> Result<DataModule> {
        let train = self.train.with_batch_size(batch_size)?;
        let val = self.val.map(|v| v.with_batch_size(batch_size)).transpose()?;
        Ok(DataModule { train, val })
    }

    /// The same loaders with another [`Placement`].
    ///
    /// ```
    /// use kiln::data::{synthetic_regression, Placement};
    /// let data = synthetic_regression(100, 20, 10)?.with_placement(Placement::Stream);
    /// assert_eq!(data.val.map(|v| v.get_placement()), Some(Placement::Stream));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn with_placement(self, placement: Placement) -> DataModule {
        DataModule { train: self.train.placement(placement), val: self.val.map(|v| v.placement(placement)) }
    }

    /// Holds out a random `val_fraction` of the training rows for
    /// validation, the rows drawn from `seed` alone (kiln's generator is
    /// neither read nor moved): `ceil(val_fraction · n)` rows, as
    /// scikit-learn's `train_test_split(test_size=val_fraction)`. Both parts
    /// keep the rows' original order; the training loader keeps its settings
    /// and the validation loader is in order. The rows are gathered on the
    /// tensors' device (on a GPU, the row indices are copied there: two
    /// booked transfers, at the caller's line).
    ///
    /// Errors: a validation loader already there, a fraction outside (0, 1),
    /// or one that leaves either part empty.
    #[track_caller]
    pub fn random_split(self, val_fraction: f64, seed: u64) -> Result<DataModule> {
        let _site = site_scope(Location::caller());
        if self.val.is_some() {
            return Err(Error::invalid("random_split", "this DataModule already has a validation loader; split before adding one"));
        }
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(Error::invalid("random_split", format!("the validation fraction must be in (0, 1), got {val_fraction}")));
        }
        let n = self.train.num_examples();
        let n_val = (val_fraction * n as f64).ceil() as usize;
        if n_val == 0 || n_val >= n {
            return Err(Error::invalid(
                "random_split",
                format!(
                    "a fraction of {val_fraction} of {n} rows leaves {n_val} for validation and {} for training; both need one",
                    n.saturating_sub(n_val)
                ),
            ));
        }
        let perm = permutation_from_seed(n, seed);
        let mut val_rows = perm[..n_val].to_vec();
        let mut train_rows = perm[n_val..].to_vec();
        val_rows.sort_unstable();
        train_rows.sort_unstable();
        let device = self.train.device();
        let gather = |rows: Vec<i64>| -> Result<Vec<Tensor>> {
            let len = rows.len();
            let ids = Tensor::from_vec(rows, len, &device)?;
            self.train.tensors.iter().map(|t| t.index_select(&ids, 0)).collect()
        };
        let train_tensors = gather(train_rows)?;
        let val_tensors = gather(val_rows)?;
        let template = &self.train;
        let loader = |tensors: Vec<Tensor>, shuffle: bool| -> Result<DataLoader> {
            Ok(DataLoader::new(tensors, template.batch_size)?
                .shuffle(shuffle)
                .drop_last(shuffle && template.drop_last)
                .placement(template.placement))
        };
        Ok(DataModule { train: loader(train_tensors, template.shuffle)?, val: Some(loader(val_tensors, false)?) })
    }
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
