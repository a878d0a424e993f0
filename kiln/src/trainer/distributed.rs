//! Data-parallel training across processes (PyTorch's
//! `DistributedDataParallel` with one process per device), over a
//! [`Group`] of [`crate::dist`]:
//!
//! - at the start of a fit every parameter and buffer is broadcast from
//!   rank 0 (written in place, so an optimizer built before keeps them), and
//!   so is the learner's shuffling seed: every rank draws the same epoch
//!   order;
//! - each global batch (the loader's `batch_size`) is cut into one disjoint
//!   piece per rank ([`DistributedSampler`]); each rank gathers its piece's
//!   rows from its own copy of the data and runs forward and backward on it,
//!   its loss weighted by its share of the batch;
//! - the gradients are summed across ranks in buckets of parameters (the
//!   last first, one dtype each, [`TrainerBuilder::bucket_size`]) with one
//!   flag per parameter saying whether any rank reached it (a parameter no
//!   rank reached keeps no gradient, as on one process); a bucket's sum is
//!   started from backward as soon as backward has produced this rank's
//!   gradient of each of its parameters and every earlier bucket was
//!   started (the same order on every rank, whatever each rank's graph),
//!   so communication overlaps the rest of backward, as DDP's bucket hooks
//!   do; a bucket with a parameter the graph did not reach waits for the
//!   end of backward, with every bucket after it;
//! - every rank clips and steps on the same sums, so the ranks stay
//!   identical and one step equals one process's step on the whole batch;
//! - an epoch's loss and metric sums are summed across ranks, so every rank
//!   reports the same history; validation batches are cut the same way;
//! - batch normalisation uses each rank's piece statistics (no
//!   SyncBatchNorm); its running statistics are broadcast from rank 0 at
//!   the start of each fit.
//!
//! [`TrainerBuilder::bucket_size`]: super::TrainerBuilder::bucket_size

use super::batch::{owned_input, split_batch};
use super::buckets::{bucket_index, plan_buckets};
use super::metrics::Sums;
use super::Trainer;
use crate::autograd::backward_lockstep;
use crate::comm::ReduceOp;
use crate::data::DataLoader;
use crate::dist::{DistributedSampler, Group, Work};
use crate::nn::{Loss, Module};
use crate::optim::Optimizer;
use crate::{no_grad, DType, Device, Result, Tensor};

/// Writes rank 0's parameters and buffers into every rank's `net`.
pub(super) fn broadcast_module(group: &Group, net: &mut dyn Module) -> Result<()> {
    let _g = no_grad();
    net.visit_parameters_mut(&mut |_, p| group.broadcast_(p, 0))?;
    net.visit_buffers_mut(&mut |_, b| group.broadcast_(b, 0))
}

/// Rank 0's shuffling seed, on every rank. (On the group's device, as the
/// epoch's sums: an engine that moves only device tensors, NCCL under
/// torchrun-style variables, takes it.)
pub(super) fn broadcast_seed(group: &Group, seed: u64) -> Result<u64> {
    let t = Tensor::new(&[seed as i64], &group.device())?;
    Ok(group.broadcast(&t, 0)?.to_vec::<i64>()?[0] as u64)
}

/// Runs backward from `loss` (none: this rank has no rows in the batch) and
/// sums the gradients of `params` across the group, bucket by bucket,
/// setting each parameter's gradient to the sum (none where no rank had
/// one). A bucket's sum starts while backward runs, once backward has
/// produced this rank's gradient of every parameter in it and the buckets
/// before it have started: every rank starts them in the plan's order,
/// whatever its graph reached. A bucket with a parameter this rank's graph
/// did not reach (and every bucket after it) starts when backward ends. The
/// flags saying which parameters some rank reached are read to the host
/// once, after every bucket has been summed, not once per bucket: on a GPU
/// each read waits for the device.
pub(super) fn backward_and_all_reduce(group: &Group, loss: Option<Tensor>, params: &[Tensor], buckets: &[Vec<usize>]) -> Result<()> {
    let index: std::collections::HashMap<usize, usize> =
        params.iter().enumerate().filter_map(|(i, p)| p.node_id().map(|k| (k, i))).collect();
    let bucket_of = bucket_index(buckets, params.len());
    let mut sums = BucketSums { group, params, buckets, waiting: buckets.iter().map(Vec::len).collect(), next: 0, started: Vec::new() };
    if let Some(loss) = loss {
        let mut reached = vec![false; params.len()];
        backward_lockstep(&[&loss], &mut |_, leaf| {
            let Some(&i) = index.get(&leaf) else { return Ok(()) };
            let Some(b) = bucket_of[i] else { return Ok(()) };
            if !std::mem::replace(&mut reached[i], true) {
                sums.waiting[b] -= 1;
            }
            sums.start(false)
        })?;
        // The graph (activations and all) is freed before the waits.
        drop(loss);
    }
    // The buckets whose parameters this rank did not all reach.
    sums.start(true)?;
    let _g = no_grad();
    let mut summed: Vec<(&[usize], Tensor)> = Vec::with_capacity(sums.started.len());
    for (b, work) in sums.started {
        summed.push((buckets[b].as_slice(), work.wait()?));
    }
    if summed.is_empty() {
        return Ok(());
    }
    let flags = summed
        .iter()
        .map(|(bucket, sum)| sum.narrow(0, sum.elem_count() - bucket.len(), bucket.len())?.to_dtype(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    let reached = Tensor::cat(&flags.iter().collect::<Vec<_>>(), 0)?.to_vec::<f64>()?;
    let mut k = 0;
    for (bucket, sum) in &summed {
        let mut offset = 0;
        for &i in bucket.iter() {
            let p = &params[i];
            let len = p.elem_count();
            if reached[k] > 0.0 {
                p.set_grad(Some(sum.narrow(0, offset, len)?.reshape(p.dims())?))?;
            }
            offset += len;
            k += 1;
        }
    }
    Ok(())
}

/// The buckets' sums in flight, started in the plan's order.
struct BucketSums<'a> {
    group: &'a Group,
    params: &'a [Tensor],
    buckets: &'a [Vec<usize>],
    /// Per bucket, its parameters whose gradient on this rank is not final.
    waiting: Vec<usize>,
    /// The next bucket to start.
    next: usize,
    /// (bucket, its sum in flight), in the order started.
    started: Vec<(usize, Work)>,
}

impl BucketSums<'_> {
    /// Starts the next buckets while they are ready (all of them with `all`).
    fn start(&mut self, all: bool) -> Result<()> {
        while self.next < self.buckets.len() && (all || self.waiting[self.next] == 0) {
            let b = self.next;
            self.next += 1;
            if let Some(flat) = bucket_tensor(self.params, &self.buckets[b])? {
                // The local gradients are in the bucket now, and are replaced
                // by its sum: freed at once, so backward's peak memory does
                // not hold every gradient twice.
                for &i in &self.buckets[b] {
                    self.params[i].set_grad(None)?;
                }
                // The bucket is this call's own: summed where it is.
                self.started.push((b, self.group.all_reduce_async_in_place(&flat, ReduceOp::Sum)?));
            }
        }
        Ok(())
    }
}

/// One bucket as one flat tensor of its dtype: each parameter's gradient
/// (zeros for none) and, last, a flag per parameter (1: this rank has its
/// gradient). `None` for an empty bucket.
fn bucket_tensor(params: &[Tensor], bucket: &[usize]) -> Result<Option<Tensor>> {
    let _g = no_grad();
    let Some(&first) = bucket.first() else { return Ok(None) };
    let (dtype, device) = (params[first].dtype(), params[first].device());
    let mut pieces = Vec::with_capacity(bucket.len() + 1);
    let mut flags = Vec::with_capacity(bucket.len());
    for &i in bucket {
        let p = &params[i];
        match p.grad() {
            Some(g) => {
                pieces.push(g.to_dtype(dtype)?.flatten_all()?);
                flags.push(1.0);
            }
            None => {
                pieces.push(Tensor::zeros(p.elem_count(), dtype, &device)?);
                flags.push(0.0);
            }
        }
    }
    pieces.push(Tensor::new(flags.as_slice(), &device)?.to_dtype(dtype)?);
    Ok(Some(Tensor::cat(&pieces.iter().collect::<Vec<_>>(), 0)?))
}

/// This rank's rows of one global batch: `(x, y)` on `device`, or `None`
/// when its piece is empty.
fn piece(loader: &DataLoader, ids: Vec<i64>, device: &Device) -> Result<Option<(Tensor, Tensor)>> {
    if ids.is_empty() {
        return Ok(None);
    }
    let (x, y) = split_batch("fit", loader.tensors())?;
    let _g = no_grad();
    let len = ids.len();
    let idx = Tensor::from_vec(ids, len, &x.device())?;
    Ok(Some((x.index_select(&idx, 0)?.to(device)?, y.index_select(&idx, 0)?.to(device)?)))
}

impl Trainer {
    /// One data-parallel epoch of this rank at learning rate `lr`:
    /// this rank's training and validation sums (summed across ranks by
    /// the caller).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_distributed_epoch(
        &self,
        group: &Group,
        net: &mut dyn Module,
        optimizer: &mut dyn Optimizer,
        kind: Loss,
        train_loader: &DataLoader,
        val: Option<&DataLoader>,
        order: Option<(u64, u64)>,
        steps_trained: &mut u64,
        bar: &super::progress::Bar,
    ) -> Result<(Sums, Option<Sums>)> {
        let device = self.device();
        let sampler = DistributedSampler::new(train_loader.num_examples(), train_loader.batch_size(), group.rank(), group.size())
            .shuffle(order.map(|(seed, _)| seed))
            .drop_last(train_loader.is_drop_last());
        let epoch = order.map_or(0, |(_, e)| e);
        let params = optimizer.parameters().to_vec();
        let buckets = plan_buckets(&params, self.bucket_bytes);
        let mut train = Sums::new();
        net.train();
        for (ids, (_, rows)) in sampler.batches(epoch).into_iter().zip(sampler.global_batches()) {
            optimizer.zero_grad();
            let mut weighted = None;
            if let Some((x, y)) = piece(train_loader, ids, &device)? {
                let pred = net.forward(&x).map_err(|e| owned_input("fit", device, e))?;
                let loss = kind.compute(&pred, &y)?;
                let n = x.dims()[0];
                train.add(&loss, &pred, &y, kind, n)?;
                weighted = Some(loss.mul_scalar(n as f64 / rows as f64)?);
            }
            backward_and_all_reduce(group, weighted, &params, &buckets)?;
            if self.gradient_clip_val > 0.0 {
                self.clip_gradients(&params)?;
            }
            optimizer.step()?;
            *steps_trained += 1;
            bar.inc();
        }
        let val_sums = match val {
            Some(loader) => {
                let _g = no_grad();
                net.eval();
                let sampler = DistributedSampler::new(loader.num_examples(), loader.batch_size(), group.rank(), group.size());
                let mut sums = Sums::new();
                for ids in sampler.batches(0) {
                    if let Some((x, y)) = piece(loader, ids, &device)? {
                        let pred = net.forward(&x).map_err(|e| owned_input("fit", device, e))?;
                        let loss = kind.compute(&pred, &y)?;
                        sums.add(&loss, &pred, &y, kind, x.dims()[0])?;
                    }
                }
                net.train();
                Some(sums)
            }
            None => None,
        };
        Ok((train, val_sums))
    }
}

/// The epoch's sums of every rank, summed: `[train loss, train correct,
/// (val loss, val correct)]` followed by the example counts, as f64 on the
/// host.
pub(super) fn reduce_epoch_sums(group: &Group, values: Vec<f64>) -> Result<Vec<f64>> {
    let len = values.len();
    group.all_reduce(&Tensor::from_vec(values, len, &group.device())?, ReduceOp::Sum)?.to_vec::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets start in the plan's order whatever order their gradients
    /// become final in, so every rank issues the same sequence of calls:
    /// a ready bucket waits for the earlier ones.
    #[test]
    fn buckets_start_in_the_plans_order_whatever_order_they_become_ready() -> Result<()> {
        let group = Group::single(Device::Cpu);
        let params: Vec<Tensor> =
            (0..3).map(|i| Tensor::full(i as f64, 2, DType::F32, &Device::Cpu).map(|t| t.requires_grad_())).collect::<Result<_>>()?;
        let buckets = vec![vec![2], vec![0], vec![1]];
        let mut sums =
            BucketSums { group: &group, params: &params, buckets: &buckets, waiting: vec![1, 1, 1], next: 0, started: Vec::new() };
        // The last bucket's gradient is final first: nothing may start yet.
        sums.waiting[2] = 0;
        sums.start(false)?;
        assert!(sums.started.is_empty());
        sums.waiting[0] = 0;
        sums.start(false)?;
        assert_eq!(sums.started.iter().map(|(b, _)| *b).collect::<Vec<_>>(), [0]);
        sums.waiting[1] = 0;
        sums.start(false)?;
        assert_eq!(sums.started.iter().map(|(b, _)| *b).collect::<Vec<_>>(), [0, 1, 2]);
        // Forced at the end of backward: nothing is left to start twice.
        sums.start(true)?;
        assert_eq!(sums.started.len(), 3);
        Ok(())
    }
}
