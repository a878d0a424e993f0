//! The book's convolutional networks, as [`Sequential`]s of lazy layers
//! (input channels come from the first batch): [`lenet`] (sigmoid, average
//! pooling), [`bn_lenet`] (LeNet with batch normalisation) and
//! [`resnet18`] (the 1-channel Fashion-MNIST variant); and
//! [`synthetic_images`], a seeded image task that a CNN learns quickly and a
//! linear model or MLP does not (so a broken convolution shows up as
//! accuracy).
//!
//! ```
//! use kiln::models::{lenet, synthetic_image_task};
//! use kiln::nn::{Loss, Module};
//! use kiln::optim::OptimizerConfig;
//! use kiln::trainer::{Learner, Progress, Trainer};
//! kiln::manual_seed(0);
//! let data = synthetic_image_task(256, 64, 64, 1)?;
//! let mut model = Learner::new(lenet(4), Loss::CrossEntropy, OptimizerConfig::adam(0.01));
//! let mut trainer = Trainer::builder().max_epochs(1).progress(Progress::Off).build()?;
//! let history = trainer.fit(&mut model, &data)?;
//! assert_eq!(history.epochs.len(), 1);
//! assert_eq!(model.net.parameter("0.weight")?.dims(), &[6, 1, 5, 5]);
//! # Ok::<(), kiln::Error>(())
//! ```

use crate::data::{DataLoader, DataModule};
use crate::nn::{
    AdaptiveAvgPool2d, AvgPool2d, Flatten, LazyBatchNorm1d, LazyBatchNorm2d, LazyConv2d, LazyLinear, MaxPool2d, ReLU, Residual, Sequential,
    Sigmoid,
};
use crate::{Conv2dArgs, Device, Error, Result, Tensor};

/// LeNet-5 as the book writes it: two 5×5 convolutions (6 and 16 channels,
/// the first padded by 2) with sigmoid and 2×2 average pooling, then dense
/// layers of 120, 84 and `num_classes`. For 28×28 single-channel images.
pub fn lenet(num_classes: usize) -> Sequential {
    Sequential::new()
        .add(LazyConv2d::new(6, 5, Conv2dArgs::default().padding(2)))
        .add(Sigmoid)
        .add(AvgPool2d::new(2, 2, 0))
        .add(LazyConv2d::new(16, 5, Conv2dArgs::default()))
        .add(Sigmoid)
        .add(AvgPool2d::new(2, 2, 0))
        .add(Flatten)
        .add(LazyLinear::new(120))
        .add(Sigmoid)
        .add(LazyLinear::new(84))
        .add(Sigmoid)
        .add(LazyLinear::new(num_classes))
}

/// LeNet with batch normalisation after every convolution and hidden dense
/// layer (the book's `BNLeNet`).
pub fn bn_lenet(num_classes: usize) -> Sequential {
    Sequential::new()
        .add(LazyConv2d::new(6, 5, Conv2dArgs::default()))
        .add(LazyBatchNorm2d::new())
        .add(Sigmoid)
        .add(AvgPool2d::new(2, 2, 0))
        .add(LazyConv2d::new(16, 5, Conv2dArgs::default()))
        .add(LazyBatchNorm2d::new())
        .add(Sigmoid)
        .add(AvgPool2d::new(2, 2, 0))
        .add(Flatten)
        .add(LazyLinear::new(120))
        .add(LazyBatchNorm1d::new())
        .add(Sigmoid)
        .add(LazyLinear::new(84))
        .add(LazyBatchNorm1d::new())
        .add(Sigmoid)
        .add(LazyLinear::new(num_classes))
}

/// ResNet-18 as the book's Fashion-MNIST variant: a 7×7/2 convolution of 64
/// channels, batch norm, ReLU and 3×3/2 max pooling, four stages of two
/// [`Residual`] blocks (64, 128, 256, 512 channels; the later stages halve
/// the size), global average pooling and a dense layer.
pub fn resnet18(num_classes: usize) -> Sequential {
    let mut net = Sequential::new()
        .add(LazyConv2d::new(64, 7, Conv2dArgs::default().stride(2).padding(3)))
        .add(LazyBatchNorm2d::new())
        .add(ReLU)
        .add(MaxPool2d::new(3, 2, 1));
    for (i, channels) in [64, 128, 256, 512].into_iter().enumerate() {
        for j in 0..2 {
            let first_of_later_stage = j == 0 && i > 0;
            net.push(Residual::new(channels, first_of_later_stage, if first_of_later_stage { 2 } else { 1 }));
        }
    }
    net.add(AdaptiveAvgPool2d::new(1)).add(Flatten).add(LazyLinear::new(num_classes))
}

/// SplitMix64: the task's own generator, so the data is the same whatever
/// else draws random numbers.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The number of classes of [`synthetic_images`].
pub const SYNTHETIC_CLASSES: usize = 4;

/// `n` seeded 1×28×28 images in [0, 1] and their labels (i64, cycling
/// through the 4 classes), on `device`. Each image is faint noise with one
/// bright shape at a random place: a horizontal bar (class 0), a vertical
/// bar (1), a plus sign (2) or a hollow square (3). The place varies, so a
/// model must recognise the shape wherever it is: what convolutions and
/// pooling do, and a dense layer over pixels does badly.
pub fn synthetic_images(n: usize, seed: u64, device: &Device) -> Result<(Tensor, Tensor)> {
    const S: usize = 28;
    let mut rng = SplitMix(seed ^ 0x6b69_6c6e);
    let mut pixels = Vec::new();
    pixels
        .try_reserve_exact(n.checked_mul(S * S).ok_or_else(|| Error::invalid("synthetic_images", "too many images"))?)
        .map_err(|_| Error::invalid("synthetic_images", format!("cannot allocate {n} images")))?;
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let class = i % SYNTHETIC_CLASSES;
        let mut img = [0f32; S * S];
        for p in img.iter_mut() {
            *p = 0.25 * rng.uniform();
        }
        // A 7×7 box anywhere in the image.
        let (y0, x0) = (rng.below(S - 7), rng.below(S - 7));
        let bright = 0.6 + 0.4 * rng.uniform();
        let on = |dy: usize, dx: usize| match class {
            0 => dy == 3,
            1 => dx == 3,
            2 => dy == 3 || dx == 3,
            _ => (dy == 0 || dy == 6 || dx == 0 || dx == 6) && dy < 7 && dx < 7,
        };
        for dy in 0..7 {
            for dx in 0..7 {
                if on(dy, dx) {
                    img[(y0 + dy) * S + x0 + dx] = bright;
                }
            }
        }
        pixels.extend_from_slice(&img);
        labels.push(class as i64);
    }
    Ok((Tensor::from_vec(pixels, (n, 1, S, S), device)?, Tensor::from_vec(labels, n, device)?))
}

/// [`synthetic_images`] as a [`DataModule`] on the CPU: `num_train`
/// shuffled training images (seed `seed`) and `num_val` validation ones
/// (drawn with another seed), in batches of `batch_size`.
pub fn synthetic_image_task(num_train: usize, num_val: usize, batch_size: usize, seed: u64) -> Result<DataModule> {
    let (x, y) = synthetic_images(num_train, seed, &Device::Cpu)?;
    let train = DataLoader::new(vec![x, y], batch_size)?.shuffle(true);
    let val = if num_val > 0 {
        let (x, y) = synthetic_images(num_val, seed.wrapping_add(0x5eed), &Device::Cpu)?;
        Some(DataLoader::new(vec![x, y], batch_size)?)
    } else {
        None
    };
    Ok(DataModule { train, val })
}
