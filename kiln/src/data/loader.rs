//! [`DataLoader`]: batches over in-memory tensors, shuffled or in order, kept
//! on the device they are asked for when they fit ([`Placement`]), and the
//! permutations that shuffle them.

use crate::runtime::ledger::site_scope;
use crate::runtime::rng;
use crate::{Device, Error, Result, Tensor};
use parking_lot::Mutex;
use std::panic::Location;
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
    pub(super) tensors: Vec<Tensor>,
    pub(super) batch_size: usize,
    pub(super) shuffle: bool,
    pub(super) drop_last: bool,
    pub(super) placement: Placement,
    /// The copies on other devices, at most one per device: one for a
    /// fit on one device, one per device of a data-parallel fit.
    resident: Arc<Mutex<Vec<Resident>>>,
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
        for (i, t) in tensors.iter().enumerate() {
            if t.rank() == 0 || t.dims()[0] != n {
                let rows = if t.rank() == 0 { "no first dimension".to_string() } else { format!("{} rows", t.dims()[0]) };
                return Err(Error::ShapeMismatch {
                    op: format!(
                        "DataLoader: every tensor needs the same number of rows (first dimension); tensor 0 has {n} rows, tensor {i} has {rows}"
                    ),
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
            resident: Arc::new(Mutex::new(Vec::new())),
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
            self.resident = Arc::new(Mutex::new(Vec::new()));
        }
        self
    }

    /// True when a short last batch is dropped ([`DataLoader::drop_last`]).
    pub fn is_drop_last(&self) -> bool {
        self.drop_last
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
        self.resident.lock().first().map(|r| r.device)
    }

    /// Every device the loader holds a copy of its examples on, in the
    /// order they were asked for: one after an epoch on one device, one
    /// per device after a data-parallel fit (each device cuts its own
    /// pieces of every batch from its own copy).
    ///
    /// ```
    /// use kiln::data::DataLoader;
    /// use kiln::{Tensor, DType, cpu};
    /// let loader = DataLoader::new(vec![Tensor::zeros((8, 2), DType::F32, &cpu())?], 4)?;
    /// assert!(loader.device_copies().is_empty());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn device_copies(&self) -> Vec<Device> {
        self.resident.lock().iter().map(|r| r.device).collect()
    }

    /// Drops the loader's copies of its examples on other devices (and
    /// those of its clones), freeing that memory; the next epoch there
    /// copies them again.
    pub fn release_device_copy(&self) {
        self.resident.lock().clear();
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
        self.batches(self.tensors.clone(), None, site, None)
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
        self.iter_on_epoch(device, None)
    }

    /// [`DataLoader::iter_on`] with the shuffled order of `epoch` under
    /// `seed` ([`permutation_for_epoch`]) instead of one drawn from kiln's
    /// generator (with `None`, or when the loader does not shuffle, the
    /// same as `iter_on`). The [`Trainer`](crate::trainer::Trainer) asks for
    /// its epochs so: the learner's shuffling seed and epoch count decide
    /// the order, and a checkpoint carries both.
    #[track_caller]
    pub(crate) fn iter_on_epoch(&self, device: &Device, order: Option<(u64, u64)>) -> Result<Batches> {
        let site = Location::caller();
        let _site = site_scope(site);
        match self.resident_on(device)? {
            Some(tensors) => self.batches(tensors, None, site, order),
            None => self.batches(self.tensors.clone(), Some(*device), site, order),
        }
    }

    /// The examples on `device` when they live there or the loader holds
    /// (or now makes) a copy there; `None` when they are to be streamed.
    fn resident_on(&self, device: &Device) -> Result<Option<Vec<Tensor>>> {
        Ok(self.resident_on_all(std::slice::from_ref(device))?.and_then(|mut all| all.pop()))
    }

    /// The examples on each of `devices` (where they live, or a copy the
    /// loader holds or now makes there, booked once), or `None` when they
    /// are to be streamed: the placement says so, or under
    /// [`Placement::Auto`] they do not fit on one of the devices (at most
    /// half of its free memory), and then no new copy is kept. Copies on
    /// devices not in `devices` are dropped first: their memory may be
    /// needed.
    pub(crate) fn resident_on_all(&self, devices: &[Device]) -> Result<Option<Vec<Vec<Tensor>>>> {
        if devices.iter().all(|d| *d == self.device()) {
            return Ok(Some(devices.iter().map(|_| self.tensors.clone()).collect()));
        }
        if self.placement == Placement::Stream {
            return Ok(None);
        }
        let mut cache = self.resident.lock();
        cache.retain(|r| devices.contains(&r.device));
        let _g = crate::no_grad();
        let mut out = Vec::with_capacity(devices.len());
        let mut made = Vec::new();
        for device in devices {
            if *device == self.device() {
                out.push(self.tensors.clone());
                continue;
            }
            if let Some(r) = cache.iter().find(|r| r.device == *device) {
                out.push(r.tensors.clone());
                continue;
            }
            let copy = if self.placement == Placement::Auto && !fits(self.num_bytes(), device)? {
                None
            } else {
                match self.tensors.iter().map(|t| t.to(device)).collect::<Result<Vec<_>>>() {
                    Ok(tensors) => Some(tensors),
                    // Auto: what did not fit is streamed instead.
                    Err(Error::OutOfMemory { .. }) if self.placement == Placement::Auto => None,
                    Err(e) => return Err(e),
                }
            };
            match copy {
                Some(tensors) => {
                    made.push(Resident { device: *device, tensors: tensors.clone() });
                    out.push(tensors);
                }
                // The copies made by this call are dropped here, before the
                // first batch is uploaded.
                None => return Ok(None),
            }
        }
        cache.extend(made);
        Ok(Some(out))
    }

    fn batches(
        &self,
        tensors: Vec<Tensor>,
        upload_to: Option<Device>,
        site: &'static Location<'static>,
        seeded: Option<(u64, u64)>,
    ) -> Result<Batches> {
        let n = self.num_examples();
        let order = if self.shuffle && n > 1 {
            let device = tensors[0].device();
            let perm = match seeded {
                Some((seed, epoch)) => permutation_for_epoch(n, seed, epoch),
                None => permutation(n),
            };
            Some(Tensor::from_vec(perm, n, &device)?)
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
pub(crate) fn fits(bytes: usize, device: &Device) -> Result<bool> {
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

/// The shuffled order of epoch `epoch` (counted from 0) under `seed`, as
/// PyTorch's `DistributedSampler` derives its order from its seed and
/// `set_epoch`: determined by the two alone, without reading or moving
/// kiln's generator. Epoch 0's order is [`permutation_from_seed`]`(n,
/// seed)`; each later epoch's seed is mixed from both. The
/// [`Trainer`](crate::trainer::Trainer) shuffles its epochs so, with the
/// learner's shuffling seed ([`Learner::shuffle_seed`]) and epoch count:
/// a resumed fit sees the orders an uninterrupted one would, whatever drew
/// random numbers in between.
///
/// [`Learner::shuffle_seed`]: crate::trainer::Learner::shuffle_seed
///
/// ```
/// use kiln::data::{permutation_for_epoch, permutation_from_seed};
/// assert_eq!(permutation_for_epoch(8, 7, 0), permutation_from_seed(8, 7));
/// assert_eq!(permutation_for_epoch(8, 7, 3), permutation_for_epoch(8, 7, 3));
/// assert_ne!(permutation_for_epoch(8, 7, 1), permutation_for_epoch(8, 7, 2));
/// ```
pub fn permutation_for_epoch(n: usize, seed: u64, epoch: u64) -> Vec<i64> {
    if epoch == 0 {
        return permutation_from_seed(n, seed);
    }
    // SplitMix64's finaliser over the epoch, then over the seed mixed in:
    // no two (seed, epoch) pairs share a stream by a simple shift.
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    permutation_from_seed(n, mix(seed ^ mix(epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15))))
}

/// `(start, rows)` of each batch of an epoch of `n` examples in batches of
/// `batch_size` (0 counts as 1): the last one shorter, or left out with
/// `drop_last`. One rule for the loader's batches, the data-parallel
/// Trainer's and [`DistributedSampler`](crate::dist::DistributedSampler)'s.
pub(crate) fn batch_ranges(n: usize, batch_size: usize, drop_last: bool) -> Vec<(usize, usize)> {
    let bs = batch_size.max(1);
    (0..n).step_by(bs).map(|s| (s, bs.min(n - s))).filter(|&(_, rows)| !(drop_last && rows < bs)).collect()
}

/// `(offset, len)` of piece `i` of `rows` consecutive rows cut into `n`
/// pieces as numpy's `array_split` cuts them: the first `rows % n` pieces
/// one row longer (`n` of 0 counts as 1; `i` past the last piece gets an
/// empty piece at the end). One rule for the devices of one process and the
/// ranks of a [`Group`](crate::dist::Group), so n processes step on the
/// batch one process with n devices would.
pub(crate) fn array_split(rows: usize, n: usize, i: usize) -> (usize, usize) {
    let n = n.max(1);
    if i >= n {
        return (rows, 0);
    }
    let (base, extra) = (rows / n, rows % n);
    (i * base + i.min(extra), base + usize::from(i < extra))
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
