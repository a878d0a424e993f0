//! Neural networks: the [`Module`] trait, layers ([`Linear`],
//! [`LazyLinear`], [`Embedding`], [`Sequential`], activations, [`Flatten`], [`Dropout`],
//! convolution, pooling and normalisation layers, [`Residual`]),
//! initializers ([`init`]) and losses.
//!
//! Parameters live on one device; a forward whose input is elsewhere fails
//! with [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) naming the
//! parameter, and [`Module::to`] moves a model (the chapter's
//! `net = net.to(device=try_gpu())`).
//!
//! ```
//! use kiln::nn::{LazyLinear, Module, Sequential};
//! use kiln::{Tensor, DType, try_gpu};
//! let net = Sequential::new().add(LazyLinear::new(1));
//! let x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
//! let y = net.forward(&x)?;
//! assert_eq!(y.device(), try_gpu(0));
//! assert_eq!(net[0].parameter("weight")?.device(), try_gpu(0));
//! # Ok::<(), kiln::Error>(())
//! ```

mod activation;
mod conv;
mod dropout;
mod embedding;
pub mod init;
mod lazy;
mod linear;
mod loss;
mod module;
mod norm;
pub(crate) mod parallel;
mod sequential;

pub use activation::{Flatten, ReLU, SiLU, Sigmoid, Tanh, GELU};
pub use conv::{AdaptiveAvgPool2d, AvgPool2d, Conv2d, Conv2dSpec, LazyConv2d, MaxPool2d};
pub use dropout::Dropout;
pub use embedding::{embedding, Embedding};
pub use init::init_cnn;
pub use lazy::{Lazy, LazySpec};
pub use linear::{LazyLinear, Linear, LinearSpec};
pub use loss::{accuracy, cross_entropy, log_softmax, mse_loss, one_hot, softmax, Loss};
pub use module::{apply, Module, ParamVisitor};
pub use norm::{BatchNorm, BatchNorm1d, BatchNorm2d, BatchNormSpec, LayerNorm, LazyBatchNorm, LazyBatchNorm1d, LazyBatchNorm2d, Residual};
pub use parallel::DataParallel;
pub use sequential::Sequential;
