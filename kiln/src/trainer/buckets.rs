//! How the data-parallel paths group gradients for their sums: in one
//! process over several devices (`parallel.rs`) and across processes
//! (`distributed.rs`).

use crate::Tensor;

/// Buckets of at most `bytes` (a larger parameter gets one of its own) of
/// the trainable parameters, the last first (backward reaches them first),
/// one dtype per bucket (a bucket is summed as one flat tensor).
pub(super) fn plan_buckets(params: &[Tensor], bytes: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0usize;
    let mut dtype = None;
    for (i, p) in params.iter().enumerate().rev() {
        if !p.requires_grad() {
            continue;
        }
        let size = p.elem_count().saturating_mul(p.dtype().size_in_bytes());
        if buckets.is_empty() || dtype != Some(p.dtype()) || (filled.saturating_add(size) > bytes.max(1) && filled > 0) {
            buckets.push(Vec::new());
            filled = 0;
            dtype = Some(p.dtype());
        }
        filled = filled.saturating_add(size);
        if let Some(b) = buckets.last_mut() {
            b.push(i);
        }
    }
    buckets
}

/// For each of `len` parameters, the bucket that holds it (`None`: not
/// trainable).
pub(super) fn bucket_index(buckets: &[Vec<usize>], len: usize) -> Vec<Option<usize>> {
    let mut of = vec![None; len];
    for (b, bucket) in buckets.iter().enumerate() {
        for &i in bucket {
            of[i] = Some(b);
        }
    }
    of
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{cpu, DType, Result};

    #[test]
    fn buckets_hold_the_last_parameters_first_up_to_their_size_one_dtype_each() -> Result<()> {
        let p = |n: usize, dtype: DType| Tensor::zeros(n, dtype, &cpu()).map(|t| t.requires_grad_());
        let f32s = |n: usize| p(n, DType::F32);
        let params = vec![f32s(10)?, f32s(10)?, f32s(30)?, Tensor::zeros(5, DType::F32, &cpu())?, f32s(10)?];
        let buckets = plan_buckets(&params, 80);
        assert_eq!(buckets, vec![vec![4], vec![2], vec![1, 0]]);
        assert_eq!(bucket_index(&buckets, params.len()), vec![Some(2), Some(2), Some(1), None, Some(0)]);
        // One bucket for everything when it fits.
        assert_eq!(plan_buckets(&params, 1 << 20), vec![vec![4, 2, 1, 0]]);
        // A change of dtype starts a bucket, even when there is room.
        let mixed = vec![f32s(2)?, p(2, DType::F64)?, p(2, DType::F64)?, f32s(2)?];
        assert_eq!(plan_buckets(&mixed, 1 << 20), vec![vec![3], vec![2, 1], vec![0]]);
        // Nothing trainable: no bucket; a zero budget still takes one each.
        assert!(plan_buckets(&params[3..4], 80).is_empty());
        assert_eq!(plan_buckets(&params[..2], 0), vec![vec![1], vec![0]]);
        Ok(())
    }
}
