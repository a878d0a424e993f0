//! `+ - * /` on tensors and scalars. Every operator returns
//! `Result<Tensor>`, so `(&a + &b)?` reads naturally and errors (devices,
//! shapes) propagate with `?`. A tensor given by value to a scalar operator
//! may be overwritten with the result when nothing else holds its storage
//! (`Tensor::unary_owned`).

use crate::ops::unary::UnaryOp;
use crate::{Result, Tensor};
use std::ops::{Add, Div, Mul, Neg, Sub};

macro_rules! tensor_op {
    ($trait:ident, $method:ident, $fn:ident, $scalar:expr, $rscalar:expr) => {
        impl $trait<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$fn(self, rhs)
            }
        }
        impl $trait<Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$fn(&self, &rhs)
            }
        }
        impl $trait<&Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$fn(&self, rhs)
            }
        }
        impl $trait<Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$fn(self, &rhs)
            }
        }
        impl $trait<f64> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: f64) -> Result<Tensor> {
                self.unary($scalar(rhs))
            }
        }
        impl $trait<f64> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: f64) -> Result<Tensor> {
                self.unary_owned($scalar(rhs))
            }
        }
        impl $trait<&Tensor> for f64 {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                rhs.unary($rscalar(self))
            }
        }
        impl $trait<Tensor> for f64 {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                rhs.unary_owned($rscalar(self))
            }
        }
    };
}

tensor_op!(Add, add, add, UnaryOp::AddScalar, UnaryOp::AddScalar);
tensor_op!(Sub, sub, sub, UnaryOp::SubScalar, UnaryOp::RSubScalar);
tensor_op!(Mul, mul, mul, UnaryOp::MulScalar, UnaryOp::MulScalar);
tensor_op!(Div, div, div, UnaryOp::DivScalar, UnaryOp::RDivScalar);

impl Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }
}

impl Neg for Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        self.unary_owned(UnaryOp::Neg)
    }
}
