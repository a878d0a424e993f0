//! What every fit loop (one device, replicas in one process, ranks across
//! processes) does with a batch before its step: take the features and
//! targets, and word a forward that met a tensor the model did not move.

use crate::{Device, Error, Result, Tensor};

/// The features and targets of a batch (its first two tensors).
pub(super) fn split_batch<'a>(op: &str, batch: &'a [Tensor]) -> Result<(&'a Tensor, &'a Tensor)> {
    match batch {
        [x, y, ..] => Ok((x, y)),
        _ => Err(Error::invalid(op, format!("a batch needs features and targets (2 tensors), got {}", batch.len()))),
    }
}

/// A forward that failed because a tensor the model computes with was not
/// moved with its parameters. The Trainer owns the input and moved it, so
/// the message says what to fix in the model instead of suggesting to move
/// an operand.
pub(super) fn owned_input(op: &str, device: Device, e: Error) -> Error {
    match e {
        Error::DeviceMismatch { op: what, lhs, rhs } if lhs != device || rhs != device => {
            let elsewhere = if lhs != device { lhs } else { rhs };
            Error::invalid(
                op,
                format!(
                    "the Trainer moved the model and the batch to {device}, yet the forward met a tensor on {elsewhere} ({what}); \
                     every tensor a model computes with must be listed by its `named_parameters` and `visit_parameters_mut`, \
                     so that `Module::to` moves it"
                ),
            )
        }
        other => other,
    }
}
