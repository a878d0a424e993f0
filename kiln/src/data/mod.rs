//! Data: a [`DataLoader`] over in-memory tensors, the synthetic data sets of
//! the book (linear regression with w = [2, −3.4], b = 4.2; Gaussian class
//! clusters), scikit-learn's handwritten digits (shipped with kiln, real
//! data for the CNN chapters: [`digits`]), and a reader for Fashion-MNIST's
//! IDX files from a local directory (nothing is ever downloaded).
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
use crate::{Error, Result, Tensor};
use std::panic::Location;

mod digits;
mod fashion_mnist;
mod loader;
pub(crate) use loader::{array_split, batch_ranges};
mod synthetic;

pub use digits::{digits, load_digits, DIGITS_CLASSES, DIGITS_EXAMPLES, DIGITS_VALIDATION};
pub use fashion_mnist::{fashion_mnist, load_fashion_mnist, read_idx, IdxArray, FASHION_MNIST_CLASSES};
pub use loader::{permutation, permutation_for_epoch, permutation_from_seed, Batches, DataLoader, Placement};
pub use synthetic::{make_classification, make_regression, synthetic_classification, synthetic_regression};

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
