//! Losses and metrics, computed on the operands' device and returned as 0-d
//! tensors there (reading them is the caller's choice, and a transfer).

use crate::kernel::index_check::IndexCheck;
use crate::tensor::Dim;
use crate::{DType, Error, Result, Tensor};

/// Mean squared error, mean over every element: mean((ŷ − y)²). The target
/// may have another shape with the same number of elements (e.g. (n) for
/// a prediction of shape (n, 1)); it is reshaped, never broadcast.
///
/// ```
/// use kiln::{Tensor, cpu};
/// let p = Tensor::new(&[[1f32], [2.]], &cpu())?;
/// let y = Tensor::new(&[1f32, 4.], &cpu())?;
/// assert_eq!(kiln::nn::mse_loss(&p, &y)?.to_scalar::<f32>()?, 2.0);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn mse_loss(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let target = if pred.dims() == target.dims() {
        target.clone()
    } else if pred.elem_count() == target.elem_count() {
        target.reshape(pred.shape().clone())?
    } else {
        return Err(Error::ShapeMismatch {
            op: format!(
                "mse_loss: the target needs the prediction's shape, or at least its number of elements ({} and {})",
                pred.elem_count(),
                target.elem_count()
            ),
            lhs: pred.dims().to_vec(),
            rhs: target.dims().to_vec(),
        });
    };
    // Empty: 0/0 = NaN, as PyTorch.
    let n = pred.elem_count() as f64;
    pred.sub(&target)?.sqr()?.sum_all()?.div_scalar(n)
}

/// log(softmax(x)) along `dim` (negative counts from the end), computed
/// stably as x − max − log Σ exp(x − max): PyTorch's
/// `F.log_softmax(x, dim)`, the same as [`Tensor::log_softmax`].
///
/// ```
/// use kiln::{Tensor, cpu};
/// let x = Tensor::new(&[[1000f32, 1000.]], &cpu())?;
/// let l = kiln::nn::log_softmax(&x, -1)?.to_vec::<f32>()?;
/// assert!((l[0] - (0.5f32).ln()).abs() < 1e-6);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn log_softmax(x: &Tensor, dim: impl Dim) -> Result<Tensor> {
    x.log_softmax(dim)
}

/// softmax(x) along `dim` (negative counts from the end): PyTorch's
/// `F.softmax(x, dim)`, the same as [`Tensor::softmax`].
///
/// ```
/// use kiln::{Tensor, cpu};
/// let x = Tensor::new(&[[1f32, 1.], [0., 0.]], &cpu())?;
/// assert_eq!(kiln::nn::softmax(&x, 0)?.to_vec::<f32>()?[0], 1.0 / (1.0 + (-1f32).exp()));
/// assert!(kiln::nn::softmax(&x, 2).unwrap_err().to_string().starts_with("softmax"));
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn softmax(x: &Tensor, dim: impl Dim) -> Result<Tensor> {
    x.softmax(dim)
}

fn check_labels(op: &str, logits: &Tensor, labels: &Tensor) -> Result<usize> {
    if logits.rank() != 2 {
        return Err(Error::invalid(op, format!("logits must be 2-D (batch, classes), got shape {}", logits.shape())));
    }
    if labels.dtype() != DType::I64 {
        return Err(Error::invalid(
            op,
            format!("labels must be i64 class indices, got {}; convert with `.to_dtype(DType::I64)?`", labels.dtype()),
        ));
    }
    if labels.elem_count() != logits.dims()[0] {
        return Err(Error::ShapeMismatch {
            op: format!("{op}: one label per row of the logits ({} rows, {} labels)", logits.dims()[0], labels.elem_count()),
            lhs: logits.dims().to_vec(),
            rhs: labels.dims().to_vec(),
        });
    }
    if labels.device() != logits.device() {
        return Err(Error::DeviceMismatch { op: op.into(), lhs: logits.device(), rhs: labels.device() });
    }
    Ok(logits.dims()[1])
}

/// Checks label values on the host, last of a loss's checks (so that every
/// other error is the same on every device). A GPU's labels are not read
/// back (that would be a hidden transfer and a wait): the kernel that reads
/// them checks them, and a bad one is reported by the next synchronising call.
fn check_label_values(op: &str, labels: &Tensor, classes: usize) -> Result<()> {
    if labels.device().is_cpu()
        && let Some(bad) =
            labels.to_dtype(DType::I64)?.to_vec::<i64>()?.into_iter().find(|&l| usize::try_from(l).map_or(true, |l| l >= classes))
    {
        return Err(Error::invalid(op, format!("label {bad} is out of range for {classes} classes")));
    }
    Ok(())
}

/// One-hot rows (n, classes) of integer `labels`, as `dtype`, on the labels'
/// device. A label outside `0..classes` is an error, as in PyTorch: for
/// labels on the CPU `InvalidArgument` at the call; labels on a GPU are not
/// read back to check (that would be a hidden transfer and a wait): the
/// kernel checks them, and a bad one makes the next synchronising call
/// (`synchronize`, `block_until_ready`, a read) return `KernelFailed`
/// naming `one_hot` and the label (PyTorch's device-side assert).
///
/// ```
/// use kiln::{Tensor, DType, cpu};
/// let y = Tensor::new(&[0i64, 2], &cpu())?;
/// assert_eq!(kiln::nn::one_hot(&y, 3, DType::F32)?.to_vec::<f32>()?, vec![1., 0., 0., 0., 0., 1.]);
/// assert!(kiln::nn::one_hot(&Tensor::new(&[0i64, 5, -1], &cpu())?, 3, DType::F32).is_err());
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn one_hot(labels: &Tensor, classes: usize, dtype: DType) -> Result<Tensor> {
    one_hot_for(IndexCheck::label("one_hot"), labels, classes, dtype)
}

/// [`one_hot`] whose label checks name `check`'s op.
fn one_hot_for(check: IndexCheck, labels: &Tensor, classes: usize, dtype: DType) -> Result<Tensor> {
    let op = check.op;
    if !matches!(labels.dtype(), DType::I64 | DType::I32 | DType::U8) {
        return Err(Error::invalid(op, format!("labels must be integers (i64, i32 or u8), got {}", labels.dtype())));
    }
    check_label_values(op, labels, classes)?;
    labels.one_hot_rows(classes, dtype, check)
}

/// Cross-entropy of logits (n, classes) against i64 labels (n), averaged
/// over the batch, through a stable log-softmax. f32 and f64 logits take
/// one fused kernel for the rows' losses (in f64, rounded once) and one for
/// their gradient; other dtypes the composed log-softmax. A label outside
/// `0..classes` is an error: on the CPU at the call; on a GPU (where the
/// labels are not read back) the next synchronising call returns
/// `KernelFailed` naming `cross_entropy` and the label.
///
/// ```
/// use kiln::{Tensor, cpu};
/// let logits = Tensor::new(&[[0f32, 0.], [0., 0.]], &cpu())?;
/// let labels = Tensor::new(&[0i64, 1], &cpu())?;
/// let l = kiln::nn::cross_entropy(&logits, &labels)?.to_scalar::<f32>()?;
/// assert!((l - 2f32.ln()).abs() < 1e-6);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let classes = check_labels("cross_entropy", logits, labels)?;
    // An empty batch: 0 · (−1/0) = NaN, as PyTorch.
    let n = logits.dims()[0] as f64;
    if logits.has_fused_cross_entropy() {
        // One kernel for the rows' losses, one for their gradient.
        check_label_values("cross_entropy", labels, classes)?;
        return logits.cross_entropy_rows(labels)?.sum_all()?.mul_scalar(1.0 / n);
    }
    // The log-softmax first: a dtype it refuses is refused before the labels
    // are looked at, on every device.
    let log_p = logits.log_softmax(-1)?;
    let targets = one_hot_for(IndexCheck::label("cross_entropy"), labels, classes, logits.dtype())?;
    let picked = log_p.mul(&targets)?;
    picked.sum_all()?.mul_scalar(-1.0 / n)
}

/// The fraction of rows whose largest logit is at the label, as a 0-d f32
/// tensor on the logits' device.
///
/// ```
/// use kiln::{Tensor, cpu};
/// let logits = Tensor::new(&[[2f32, 1.], [0., 3.], [5., 1.]], &cpu())?;
/// let labels = Tensor::new(&[0i64, 1, 1], &cpu())?;
/// let acc = kiln::nn::accuracy(&logits, &labels)?.to_scalar::<f32>()?;
/// assert!((acc - 2.0 / 3.0).abs() < 1e-6);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn accuracy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let classes = check_labels("accuracy", logits, labels)?;
    check_label_values("accuracy", labels, classes)?;
    let n = logits.dims()[0].max(1) as f64;
    let hits = logits.detach().argmax(1)?.eq(&labels.flatten_all()?)?.to_dtype(DType::F32)?;
    hits.sum_all()?.div_scalar(n)
}

/// A loss for the [`Trainer`](crate::trainer::Trainer), with the metric that
/// goes with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// [`mse_loss`]; no metric.
    Mse,
    /// [`cross_entropy`]; metric: [`accuracy`].
    CrossEntropy,
}

impl Loss {
    /// The loss of predictions `pred` against `target`, a 0-d tensor.
    pub fn compute(&self, pred: &Tensor, target: &Tensor) -> Result<Tensor> {
        match self {
            Loss::Mse => mse_loss(pred, target),
            Loss::CrossEntropy => cross_entropy(pred, target),
        }
    }

    /// The metric (accuracy for classification), if the loss has one.
    pub fn metric(&self, pred: &Tensor, target: &Tensor) -> Option<Result<Tensor>> {
        match self {
            Loss::Mse => None,
            Loss::CrossEntropy => Some(accuracy(pred, target)),
        }
    }

    /// The metric's name, if there is one.
    pub fn metric_name(&self) -> Option<&'static str> {
        match self {
            Loss::Mse => None,
            Loss::CrossEntropy => Some("accuracy"),
        }
    }
}
