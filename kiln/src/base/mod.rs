//! The bottom layer: plain types every other layer uses, with no knowledge of
//! devices' backends, tensors or kernels (dtypes, shapes and layouts, host
//! buffers, errors, environment settings, the device vocabulary).

pub(crate) mod buffer;
pub(crate) mod device;
pub(crate) mod dtype;
pub(crate) mod env;
pub(crate) mod error;
pub(crate) mod shape;
