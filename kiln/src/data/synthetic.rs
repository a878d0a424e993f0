//! The book's synthetic data sets: linear regression with w = [2, −3.4],
//! b = 4.2, and Gaussian class clusters.

use super::{DataLoader, DataModule};
use crate::{DType, Device, Error, Result, Tensor};

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
