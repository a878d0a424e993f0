//! Data-parallel training on several GPUs, as PyTorch's
//! `DistributedDataParallel` does it within one process:
//!
//! - at the start of a fit the model is replicated from the first GPU onto
//!   the others (its parameters broadcast, booked as device-to-device
//!   traffic), and each replica gets an optimizer whose state is a copy of
//!   the learner's;
//! - each batch is cut along dimension 0 into one piece per device (the
//!   first `rows % n` pieces one row longer), and every replica runs its
//!   forward and backward on its piece; the kernels are queued device after
//!   device by this thread and run concurrently on the devices;
//! - each replica's loss is weighted by its share of the batch, so that the
//!   sum of the replicas' gradients is the gradient of the batch's mean
//!   loss: one step on n devices equals one step on one device;
//! - the backward passes run node by node in lockstep
//!   ([`backward_lockstep`]); gradients are summed across devices in
//!   buckets (25 MiB by default, [`TrainerBuilder::bucket_size`]) of
//!   parameters in reverse order, each started as soon as every replica has
//!   produced it, on the devices' collective queues, while the rest of
//!   backward is queued behind it; the optimizer's kernels wait for the
//!   sums (a join), not the host;
//! - every replica takes the same optimizer step on the same summed
//!   gradients, so the replicas stay bit-identical
//!   ([`TrainerBuilder::check_replicas`] verifies it after every step);
//! - a parameter that no replica gave a gradient keeps none (the optimizer
//!   skips it, as on one device); one that only some replicas reached gets
//!   zeros from the others;
//! - batch normalisation uses each device's batch statistics and keeps
//!   running statistics per replica (PyTorch DDP without SyncBatchNorm);
//!   the first replica's, the learner's own, are the ones evaluated and
//!   saved;
//! - validation, evaluation and prediction run on the first GPU.
//!
//! [`TrainerBuilder::bucket_size`]: super::TrainerBuilder::bucket_size
//! [`TrainerBuilder::check_replicas`]: super::TrainerBuilder::check_replicas

use super::batch::owned_input;
use super::buckets::{bucket_index, plan_buckets};
use super::metrics::Sums;
use crate::autograd::backward_lockstep;
use crate::data::{array_split, batch_ranges, DataLoader};
use crate::nn::parallel::replicate;
use crate::nn::{Loss, Module};
use crate::optim::{Optimizer, OptimizerConfig};
use crate::{comm, no_grad, Device, Error, Result, Tensor};
use std::collections::HashMap;

/// The default size of a gradient bucket, as PyTorch's DDP.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The replicas of a data-parallel fit beyond the first (the learner's own
/// network and optimizer), and the plan of its gradient buckets.
pub(super) struct Replicas {
    devices: Vec<Device>,
    nets: Vec<Box<dyn Module>>,
    optimizers: Vec<Box<dyn Optimizer>>,
    /// Parameter indices (into `parameters()` of any replica) per bucket,
    /// the last parameters first.
    buckets: Vec<Vec<usize>>,
    /// The bucket of each parameter (`None`: frozen, never reduced).
    bucket_of: Vec<Option<usize>>,
    check: bool,
}

/// A loader's first two tensors (features, targets) on every device of a
/// fit (the loader's own copies, kept for the next fits), so that each
/// device cuts its own piece of every batch from its own copy: no batch
/// crosses between devices (each rank of PyTorch's DDP loads its own
/// shard).
pub(super) struct Resident {
    per_device: Vec<(Tensor, Tensor)>,
    rows: usize,
    batch_size: usize,
    shuffle: bool,
    drop_last: bool,
}

/// One epoch over [`Resident`] data: the row order on every device.
pub(super) struct ResidentEpoch<'a> {
    data: &'a Resident,
    order: Option<Vec<Tensor>>,
}

impl Resident {
    /// The loader's examples on every device of `devices`: the copies the
    /// loader holds for the next fits too (made and booked once, dropped by
    /// [`DataLoader::release_device_copy`]), when its placement allows it
    /// and they fit on each (at most half of what is free there, as the
    /// loader decides); `None` otherwise.
    pub(super) fn new(loader: &DataLoader, devices: &[Device]) -> Result<Option<Resident>> {
        if loader.tensors().len() < 2 {
            return Ok(None);
        }
        let Some(copies) = loader.resident_on_all(devices)? else { return Ok(None) };
        let mut per_device = Vec::with_capacity(copies.len());
        for tensors in copies {
            let mut first_two = tensors.into_iter().take(2);
            if let (Some(x), Some(y)) = (first_two.next(), first_two.next()) {
                per_device.push((x, y));
            }
        }
        Ok(Some(Resident {
            per_device,
            rows: loader.num_examples(),
            batch_size: loader.batch_size(),
            shuffle: loader.is_shuffled(),
            drop_last: loader.is_drop_last(),
        }))
    }

    /// An epoch: with shuffling, the order of `seeded` (seed, epoch), or a
    /// new one drawn from kiln's generator, exactly as the loader makes it
    /// (so a data-parallel run sees the batches one device would), copied
    /// to every device.
    #[track_caller]
    pub(super) fn epoch(&self, seeded: Option<(u64, u64)>) -> Result<ResidentEpoch<'_>> {
        let order = if self.shuffle && self.rows > 1 {
            let perm = match seeded {
                Some((seed, epoch)) => crate::data::permutation_for_epoch(self.rows, seed, epoch),
                None => crate::data::permutation(self.rows),
            };
            Some(self.per_device.iter().map(|(x, _)| Tensor::from_vec(perm.clone(), self.rows, &x.device())).collect::<Result<Vec<_>>>()?)
        } else {
            None
        };
        Ok(ResidentEpoch { data: self, order })
    }
}

impl ResidentEpoch<'_> {
    /// `(start, rows)` of each batch of the epoch.
    pub(super) fn batches(&self) -> Vec<(usize, usize)> {
        batch_ranges(self.data.rows, self.data.batch_size, self.data.drop_last)
    }

    /// Each device's piece of the batch of `rows` rows from `start`.
    pub(super) fn pieces(&self, start: usize, rows: usize) -> Result<Vec<Option<(Tensor, Tensor)>>> {
        let _g = no_grad();
        let mut at = start;
        let mut out = Vec::with_capacity(self.data.per_device.len());
        for (r, size) in split_sizes(rows, self.data.per_device.len()).into_iter().enumerate() {
            let (x, y) = &self.data.per_device[r];
            out.push(if size == 0 {
                None
            } else {
                Some(match &self.order {
                    Some(order) => {
                        let ids = order[r].narrow(0, at, size)?;
                        (x.index_select(&ids, 0)?, y.index_select(&ids, 0)?)
                    }
                    None => (x.narrow(0, at, size)?, y.narrow(0, at, size)?),
                })
            });
            at += size;
        }
        Ok(out)
    }
}

/// The sizes numpy's `array_split` cuts `rows` into for `n` devices (the
/// rule [`DistributedSampler`](crate::dist::DistributedSampler) cuts ranks'
/// pieces by).
pub(super) fn split_sizes(rows: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| array_split(rows, n, i).1).collect()
}

impl Replicas {
    /// Replicates `net` (on `devices[0]`) onto `devices[1..]` with
    /// optimizers built from `config` and loaded with `primary`'s state.
    pub(super) fn new(
        net: &dyn Module,
        primary: &dyn Optimizer,
        config: &OptimizerConfig,
        devices: &[Device],
        bucket_bytes: usize,
        check: bool,
    ) -> Result<Replicas> {
        let state = primary.state_dict()?;
        let mut nets = Vec::with_capacity(devices.len() - 1);
        let mut optimizers = Vec::with_capacity(devices.len() - 1);
        for d in &devices[1..] {
            let replica = replicate(net, d, true)?;
            let mut opt = config.build(replica.parameters())?;
            opt.load_state_dict(&state)?;
            opt.set_learning_rate(primary.learning_rate());
            nets.push(replica);
            optimizers.push(opt);
        }
        let params = net.parameters();
        let buckets = plan_buckets(&params, bucket_bytes);
        let bucket_of = bucket_index(&buckets, params.len());
        Ok(Replicas { devices: devices.to_vec(), nets, optimizers, buckets, bucket_of, check })
    }

    /// The devices, the first being the learner's.
    pub(super) fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Sets every replica's learning rate (the learner's is set by the fit).
    pub(super) fn set_learning_rate(&mut self, lr: f64) {
        for o in &mut self.optimizers {
            o.set_learning_rate(lr);
        }
    }

    /// Training mode on every replica.
    pub(super) fn train(&mut self) {
        for n in &mut self.nets {
            n.train();
        }
    }

    /// The pieces of the batch `(x, y)` (on `devices[0]`) for each device
    /// (`None`: no rows for it), cut as [`split_sizes`] says and copied.
    pub(super) fn cut(&self, x: &Tensor, y: &Tensor) -> Result<Vec<Option<(Tensor, Tensor)>>> {
        let n = self.devices.len();
        let rows = x.dims().first().copied().unwrap_or(0);
        let mut pieces = Vec::with_capacity(n);
        let mut start = 0;
        let _g = no_grad();
        for (r, size) in split_sizes(rows, n).into_iter().enumerate() {
            pieces.push(if size == 0 {
                None
            } else {
                Some((x.narrow(0, start, size)?.to(&self.devices[r])?, y.narrow(0, start, size)?.to(&self.devices[r])?))
            });
            start += size;
        }
        Ok(pieces)
    }

    /// One data-parallel step on a batch of `rows` rows given as one piece
    /// per device: forward and backward on every device, gradients summed,
    /// one optimizer step per replica. `sums[r]` gathers device r's metrics.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step(
        &mut self,
        net: &mut dyn Module,
        optimizer: &mut dyn Optimizer,
        kind: Loss,
        pieces: &[Option<(Tensor, Tensor)>],
        rows: usize,
        clip: &dyn Fn(&[Tensor]) -> Result<()>,
        sums: &mut [Sums],
    ) -> Result<()> {
        let n = self.devices.len();
        optimizer.zero_grad();
        for o in &mut self.optimizers {
            o.zero_grad();
        }
        // Forward on every device with rows, each loss weighted by its share.
        let mut losses: Vec<(usize, Tensor)> = Vec::with_capacity(n);
        for (r, piece) in pieces.iter().enumerate() {
            let Some((xr, yr)) = piece else { continue };
            let replica: &dyn Module = if r == 0 { &*net } else { &*self.nets[r - 1] };
            let device = self.devices[r];
            let pred = replica.forward(xr).map_err(|e| owned_input("fit", device, e))?;
            let loss = kind.compute(&pred, yr)?;
            let size = xr.dims()[0];
            sums[r].add(&loss, &pred, yr, kind, size)?;
            losses.push((r, loss.mul_scalar(size as f64 / rows as f64)?));
        }
        let params: Vec<Vec<Tensor>> = (0..n).map(|r| if r == 0 { net.parameters() } else { self.nets[r - 1].parameters() }).collect();
        let index: Vec<HashMap<usize, usize>> =
            params.iter().map(|ps| ps.iter().enumerate().filter_map(|(i, p)| p.node_id().map(|k| (k, i))).collect()).collect();
        let mut got = vec![vec![false; params[0].len()]; n];
        let mut waiting: Vec<usize> = self.buckets.iter().map(|b| b.len() * losses.len()).collect();
        let mut reduced: Vec<Option<Vec<Tensor>>> = vec![None; self.buckets.len()];
        {
            let roots: Vec<&Tensor> = losses.iter().map(|(_, l)| l).collect();
            let active: Vec<usize> = losses.iter().map(|(r, _)| *r).collect();
            let (buckets, bucket_of, devices) = (&self.buckets, &self.bucket_of, &self.devices);
            backward_lockstep(&roots, &mut |i, leaf| {
                let r = active[i];
                let Some(&p) = index[r].get(&leaf) else { return Ok(()) };
                let Some(b) = bucket_of[p] else { return Ok(()) };
                if !std::mem::replace(&mut got[r][p], true) {
                    waiting[b] -= 1;
                }
                if waiting[b] == 0 && reduced[b].is_none() {
                    reduced[b] = Some(reduce_bucket(&buckets[b], &params, &got, devices)?);
                }
                Ok(())
            })?;
        }
        // Buckets some parameter of which no replica reached: reduce what
        // there is (zeros for the missing), leave the unreached alone.
        for (b, bucket) in self.buckets.iter().enumerate() {
            if reduced[b].is_none() {
                reduced[b] = Some(reduce_bucket(bucket, &params, &got, &self.devices)?);
            }
        }
        // The optimizers' kernels wait for the sums on the devices.
        if let Some(Some(any)) = reduced.iter().find(|r| r.is_some()) {
            comm::join(any)?;
        }
        for (b, bucket) in self.buckets.iter().enumerate() {
            let Some(flats) = &reduced[b] else { continue };
            let mut offset = 0;
            for &p in bucket {
                if !(0..n).any(|r| got[r][p]) {
                    continue;
                }
                let len = params[0][p].elem_count();
                for (r, flat) in flats.iter().enumerate() {
                    let g = flat.narrow(0, offset, len)?.reshape(params[r][p].dims())?;
                    params[r][p].set_grad(Some(g))?;
                }
                offset += len;
            }
        }
        for ps in &params {
            clip(ps)?;
        }
        // The replicas first: if one fails (out of memory), the learner's
        // network and optimizer are untouched (the replicas are rebuilt by
        // the next fit).
        for o in &mut self.optimizers {
            o.step()?;
        }
        optimizer.step()?;
        if self.check {
            self.check_identical(net)?;
        }
        Ok(())
    }

    /// Errs when a replica's parameter differs in any bit from the
    /// learner's (each is read to the host: a debugging aid).
    fn check_identical(&self, net: &dyn Module) -> Result<()> {
        let primary = net.named_parameters();
        for (k, replica) in self.nets.iter().enumerate() {
            for ((name, p), (_, q)) in primary.iter().zip(replica.named_parameters()) {
                let (a, b) = (p.to_vec_f64()?, q.to_vec_f64()?);
                if a.len() != b.len() || a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
                    return Err(Error::invalid(
                        "fit",
                        format!(
                            "replica {} on {} differs from the first in parameter `{name}` after a step (a kiln bug: please report it)",
                            k + 1,
                            self.devices[k + 1]
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Flattens one bucket's gradients on every device (zeros where a replica
/// has none for a parameter some replica reached) and starts their sum
/// across the devices; returns the flat tensors the sums land in.
fn reduce_bucket(bucket: &[usize], params: &[Vec<Tensor>], got: &[Vec<bool>], devices: &[Device]) -> Result<Vec<Tensor>> {
    let _g = no_grad();
    let n = devices.len();
    let members: Vec<usize> = bucket.iter().copied().filter(|&p| (0..n).any(|r| got[r][p])).collect();
    let mut flats = Vec::with_capacity(n);
    for r in 0..n {
        let mut pieces = Vec::with_capacity(members.len());
        for &p in &members {
            let param = &params[r][p];
            pieces.push(match param.grad().filter(|_| got[r][p]) {
                Some(g) => g.flatten_all()?,
                None => Tensor::zeros(param.elem_count(), param.dtype(), &devices[r])?,
            });
        }
        flats.push(if pieces.is_empty() {
            Tensor::zeros(0, params[r].first().map_or(crate::DType::F32, |p| p.dtype()), &devices[r])?
        } else {
            Tensor::cat(&pieces.iter().collect::<Vec<_>>(), 0)?
        });
    }
    if flats.iter().all(|f| f.elem_count() > 0) {
        comm::all_reduce_sum_async(&flats)?;
    }
    Ok(flats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_split_as_numpy_array_split() {
        assert_eq!(split_sizes(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(split_sizes(3, 4), vec![1, 1, 1, 0]);
        assert_eq!(split_sizes(0, 2), vec![0, 0]);
    }
}
