//! [`Dropout`]: zeroes a random fraction of its input in training mode.

use super::module::Module;
use crate::{Error, Result, Tensor};

/// In training mode, zeroes each element with probability `p` and scales the
/// others by 1/(1−p); in evaluation mode, the identity. The mask is drawn on
/// the input's device from kiln's seeded generator.
///
/// ```
/// use kiln::nn::{Dropout, Module};
/// use kiln::{Tensor, DType, cpu};
/// let mut d = Dropout::new(0.5)?;
/// let x = Tensor::ones((1000,), DType::F32, &cpu())?;
/// let y = d.forward(&x)?.to_vec::<f32>()?;
/// assert!(y.iter().all(|&v| v == 0.0 || v == 2.0));
/// d.eval();
/// assert_eq!(d.forward(&x)?.to_vec::<f32>()?, vec![1.0; 1000]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Dropout {
    p: f64,
    training: bool,
}

impl Dropout {
    /// Dropout with probability `p` in [0, 1).
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid("Dropout", format!("the probability must be in [0, 1), got {p}")));
        }
        Ok(Dropout { p, training: true })
    }

    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Whether the layer is in training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }
}

impl Module for Dropout {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !self.training || self.p == 0.0 {
            return Ok(x.clone());
        }
        let u = Tensor::rand_uniform(0.0, 1.0, x.shape().clone(), x.dtype(), &x.device())?;
        let keep = u.ge(&Tensor::full(self.p, (), x.dtype(), &x.device())?)?.to_dtype(x.dtype())?;
        x.mul(&keep.mul_scalar(1.0 / (1.0 - self.p))?)
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    fn describe(&self) -> String {
        format!("Dropout(p={})", self.p)
    }
}
