//! scikit-learn's handwritten digits, shipped with kiln: real data that a
//! CNN chapter's example can train on without a download.
//!
//! The 1,797 images are the test set of the UCI "Optical Recognition of
//! Handwritten Digits" data (E. Alpaydin and C. Kaynak, 1998; CC BY 4.0),
//! as scikit-learn's `load_digits` returns them: 8×8 counts of on pixels
//! (0 to 16) of 32×32 bitmaps written by 13 people. `digits.bin` holds them
//! in scikit-learn's order, 65 bytes an image: the label, then the 64
//! pixels row by row.

use super::{DataLoader, DataModule};
use crate::{Device, Error, InterpMode, Result, Tensor};

/// The images and labels, 65 bytes each (label, then 8×8 pixels).
static DIGITS: &[u8] = include_bytes!("digits.bin");

/// Number of classes of [`load_digits`] (the digits 0 to 9).
pub const DIGITS_CLASSES: usize = 10;
/// Number of images of [`load_digits`].
pub const DIGITS_EXAMPLES: usize = 1797;
/// Images [`digits`] holds out for validation: the last 360 of
/// [`load_digits`], a fifth.
pub const DIGITS_VALIDATION: usize = 360;

/// scikit-learn's digits (`sklearn.datasets.load_digits`) on `device`:
/// images `(1797, 1, size, size)` as f32 in [0, 1] (the counts 0 to 16
/// divided by 16) and labels `(1797)` as i64, in scikit-learn's order.
///
/// At `size` 8 the images are the originals; at any other size they are
/// resized with bilinear interpolation (`align_corners = false`, PyTorch's
/// `F.interpolate(x, size=(size, size), mode="bilinear")`). LeNet takes 28.
///
/// ```
/// use kiln::data::{load_digits, DIGITS_EXAMPLES};
/// let (x, y) = load_digits(8, &kiln::cpu())?;
/// assert_eq!(x.dims(), [DIGITS_EXAMPLES, 1, 8, 8]);
/// assert_eq!(y.to_vec::<i64>()?[..5], [0, 1, 2, 3, 4]);
/// assert_eq!(x.to_vec::<f32>()?[..4], [0.0, 0.0, 0.3125, 0.8125]); // 5/16, 13/16
/// let (x28, _) = load_digits(28, &kiln::cpu())?;
/// assert_eq!(x28.dims(), [DIGITS_EXAMPLES, 1, 28, 28]);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn load_digits(size: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    const SIDE: usize = 8;
    const RECORD: usize = 1 + SIDE * SIDE;
    if size == 0 {
        return Err(Error::invalid("load_digits", "the image size must be at least 1 (8 gives the originals, 28 LeNet's input)"));
    }
    debug_assert_eq!(DIGITS.len(), DIGITS_EXAMPLES * RECORD);
    let mut labels = Vec::with_capacity(DIGITS_EXAMPLES);
    let mut pixels = Vec::with_capacity(DIGITS_EXAMPLES * SIDE * SIDE);
    for record in DIGITS.chunks_exact(RECORD) {
        labels.push(i64::from(record[0]));
        pixels.extend(record[1..].iter().map(|&p| f32::from(p) / 16.0));
    }
    let x = Tensor::from_vec(pixels, (DIGITS_EXAMPLES, 1, SIDE, SIDE), &Device::Cpu)?;
    let x = if size == SIDE { x } else { x.interpolate((size, size), InterpMode::Bilinear { align_corners: false })? };
    let y = Tensor::from_vec(labels, DIGITS_EXAMPLES, &Device::Cpu)?;
    Ok((x.to(device)?, y.to(device)?))
}

/// [`load_digits`] at `size` as a [`DataModule`] on the CPU: the first
/// 1,437 images for training, shuffled each epoch, and the last
/// [`DIGITS_VALIDATION`] (360) for validation, in order, both in batches of
/// `batch_size`. The book's LeNet recipe learns them: see the README.
///
/// ```
/// use kiln::data::{digits, DIGITS_VALIDATION};
/// let data = digits(28, 256)?;
/// assert_eq!(data.train.num_examples(), 1437);
/// assert_eq!(data.train.len(), 6); // five batches of 256 and one of 157
/// assert_eq!(data.val.map(|v| v.num_examples()), Some(DIGITS_VALIDATION));
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn digits(size: usize, batch_size: usize) -> Result<DataModule> {
    let (x, y) = load_digits(size, &Device::Cpu)?;
    let n = DIGITS_EXAMPLES - DIGITS_VALIDATION;
    let train = DataLoader::new(vec![x.narrow(0, 0, n)?, y.narrow(0, 0, n)?], batch_size)?.shuffle(true);
    let val = DataLoader::new(vec![x.narrow(0, n, DIGITS_VALIDATION)?, y.narrow(0, n, DIGITS_VALIDATION)?], batch_size)?;
    Ok(DataModule { train, val: Some(val) })
}
