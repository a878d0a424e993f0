//! The fit loop: [`Trainer::fit`], one epoch's steps, [`Trainer::evaluate`]
//! and [`Trainer::predict`].

use super::batch::{owned_input, split_batch};
use super::metrics::{accumulate, mean, ParallelProbe, Sums};
use super::parallel::{Replicas, Resident};
use super::progress::Bar;
use super::{EpochEnd, EpochStats, Evaluation, FitStart, History, Learner, Trainer};
use crate::data::{DataLoader, DataModule};
use crate::nn::{Loss, Module};
use crate::{no_grad, Error, Result, Tensor};
use std::panic::Location;
use std::time::Instant;

impl Trainer {
    /// Creates the parameters of lazy layers (the chapter's `LazyLinear`)
    /// before the optimizer is built: one forward of the first training
    /// rows (in order, so the shuffle order is not drawn), on the training
    /// device, without gradients and in evaluation mode (no dropout draw).
    /// PyTorch Lightning and d2l do the same; the optimizer then sees every
    /// parameter from the first step.
    fn materialize<N: Module>(&self, model: &mut Learner<N>, data: &DataModule) -> Result<()> {
        if !model.net.has_lazy_parameters() {
            return Ok(());
        }
        let device = self.device();
        let x = &data.train.tensors()[0];
        let rows = data.train.batch_size().min(data.train.num_examples());
        let x = x.narrow(0, 0, rows)?.to(&device)?;
        model.net.init_lazy(&x).map_err(|e| owned_input("fit", device, e))
    }

    /// The replicas of a data-parallel fit on `gpus` when there are several
    /// (see `parallel.rs`), made from the learner's network and optimizer.
    fn replicas<N: Module>(&self, model: &Learner<N>) -> Result<Option<Replicas>> {
        if self.gpus.len() < 2 {
            return Ok(None);
        }
        let optimizer = model.configured.as_ref().ok_or_else(|| Error::invalid("fit", "the optimizer was not built"))?.get();
        Replicas::new(&model.net, optimizer, &model.optimizer, &self.gpus, self.bucket_bytes, self.check_replicas).map(Some)
    }

    pub(super) fn clip_gradients(&self, params: &[Tensor]) -> Result<()> {
        let grads: Vec<(Tensor, Tensor)> = params.iter().filter_map(|p| p.grad().map(|g| (p.clone(), g))).collect();
        let mut total: Option<Tensor> = None;
        for (_, g) in &grads {
            let s = g.sqr()?.sum_all()?;
            total = Some(accumulate(total, s)?);
        }
        let Some(total) = total else { return Ok(()) };
        // scale = min(1, clip / norm), computed on the device: no read-back.
        let scale = total.sqrt()?.add_scalar(1e-12)?.recip()?.mul_scalar(self.gradient_clip_val)?.minimum_scalar(1.0)?;
        for (p, g) in grads {
            p.set_grad(Some(g.mul(&scale)?))?;
        }
        Ok(())
    }

    /// Trains for `max_epochs` more epochs: each runs every training batch
    /// (forward, loss, backward, clipping, step), then validation without
    /// gradients, and reads the epoch's sums from the device in one
    /// transfer; then the callbacks run. The model, the data (see
    /// [`Placement`](crate::data::Placement)) and every transfer of the fit
    /// are booked at the caller's line.
    ///
    /// The learner's optimizer is built by the first fit and kept by the
    /// next ones, and its epoch count goes on, so two fits of 15 epochs
    /// train exactly as one of 30 (d2l's `fit` runs `max_epochs` each call;
    /// PyTorch Lightning's stops at `max_epochs` in all).
    #[track_caller]
    pub fn fit<N: Module>(&mut self, model: &mut Learner<N>, data: &DataModule) -> Result<History> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        if data.train.is_empty() {
            return Err(Error::invalid("fit", "the training loader yields no batch (fewer examples than one batch with drop_last?)"));
        }
        let device = self.device();
        self.prepare_model(&mut model.net)?;
        let val = data.val.as_ref().filter(|v| !v.is_empty());
        let start = FitStart { has_validation: val.is_some(), metric_name: model.loss.metric_name(), first_epoch: model.epochs_trained };
        for c in &mut self.callbacks {
            c.on_fit_start(&start)?;
        }
        self.materialize(model, data)?;
        model.ensure_optimizer()?;
        if let Some(group) = self.process_group() {
            // Every rank starts from rank 0's model and epoch order.
            super::distributed::broadcast_module(group, &mut model.net)?;
            if data.train.is_shuffled() {
                let seed = *model.shuffle_seed.get_or_insert_with(crate::runtime::rng::next_u64);
                model.shuffle_seed = Some(super::distributed::broadcast_seed(group, seed)?);
            }
        }
        let mut replicas = self.replicas(model)?;
        // A data-parallel fit's examples on every device (made by its first epoch).
        let mut resident: Option<Option<Resident>> = None;
        // Progress and logs from rank 0 only.
        let progress = if self.process_group().is_some_and(|g| !g.is_main()) { super::Progress::Off } else { self.progress };
        let bar = Bar::new(progress, (self.max_epochs.saturating_mul(data.train.len())) as u64);
        let mut history = History { epochs: Vec::new(), metric_name: model.loss.metric_name().map(String::from), device, stopped_by: None };
        for _ in 0..self.max_epochs {
            let timer = Instant::now();
            let epoch = model.epochs_trained;
            let lr = model.optimizer.learning_rate() * model.lr_factor(epoch)?;
            let before = ParallelProbe::start(replicas.as_ref().map(|r| r.devices()));
            let comm_before = self.process_group().map(|g| g.stats());
            let (train, val_sums) = self.run_epoch(model, data, lr, &bar, replicas.as_mut(), &mut resident)?;
            let mut parallel = before.finish()?;
            let (mut train_n, mut val_n) = (train.examples, val_sums.as_ref().map_or(0, |s| s.examples));
            let mut parts = train.parts(&device)?.to_vec();
            if let Some(v) = val_sums {
                parts.extend(v.parts(&device)?);
            }
            let sums = {
                let _g = no_grad();
                Tensor::stack(&parts.iter().collect::<Vec<_>>(), 0)?
            };
            // The one device-to-host read of the epoch.
            let mut values = sums.to_vec_f64()?;
            if let (Some(group), Some(before)) = (self.process_group(), comm_before) {
                // Every rank's sums and example counts, summed: the same
                // history on every rank.
                values.extend([train_n as f64, val_n as f64]);
                values = super::distributed::reduce_epoch_sums(group, values)?;
                val_n = values.pop().unwrap_or(0.0) as usize;
                train_n = values.pop().unwrap_or(0.0) as usize;
                let after = group.stats();
                parallel = Some(super::ParallelStats {
                    devices: group.size(),
                    compute_seconds: None,
                    comm_wait_seconds: Some(after.seconds - before.seconds),
                    comm_bytes: after.bytes - before.bytes,
                });
            }
            let has_metric = model.loss.metric_name().is_some();
            let stats = EpochStats {
                epoch,
                train_loss: mean(values[0], train_n),
                train_metric: has_metric.then(|| mean(values[1], train_n)),
                val_loss: (values.len() == 4).then(|| mean(values[2], val_n)),
                val_metric: (values.len() == 4 && has_metric).then(|| mean(values[3], val_n)),
                lr,
                seconds: timer.elapsed().as_secs_f64(),
                parallel,
            };
            model.epochs_trained += 1;
            if bar.shown() {
                let mut msg = format!("epoch {} loss {:.4}", epoch + 1, stats.train_loss);
                if let Some(v) = stats.val_loss {
                    msg += &format!(" val {v:.4}");
                }
                if let Some(m) = stats.val_metric {
                    msg += &format!(" {} {m:.3}", model.loss.metric_name().unwrap_or("metric"));
                }
                bar.message(msg);
            }
            history.epochs.push(stats);
            let mut end = EpochEnd { history: &history, stop: None, checkpoints: Vec::new(), current: String::new() };
            for c in &mut self.callbacks {
                end.current = c.name();
                c.on_epoch_end(&mut end)?;
            }
            let (stop, checkpoints) = (end.stop, end.checkpoints);
            for path in checkpoints {
                // Rank 0 writes (save_checkpoint_at skips the others).
                self.save_checkpoint_at(model, &path, Location::caller())?;
            }
            if stop.is_some() {
                history.stopped_by = stop;
                break;
            }
        }
        drop(bar);
        // One plot per run: across processes, rank 0 draws it.
        #[cfg(feature = "plot")]
        if let Some(path) = &self.plot
            && self.process_group().is_none_or(|g| g.is_main())
        {
            history.save_plot(path)?;
        }
        Ok(history)
    }

    /// One epoch at learning rate `lr`: training sums and, when there is
    /// validation data, validation sums.
    fn run_epoch<N: Module>(
        &self,
        model: &mut Learner<N>,
        data: &DataModule,
        lr: f64,
        bar: &Bar,
        replicas: Option<&mut Replicas>,
        resident: &mut Option<Option<Resident>>,
    ) -> Result<(Sums, Option<Sums>)> {
        let device = self.device();
        // The epoch's order: the learner's shuffling seed (drawn from kiln's
        // generator by its first shuffled epoch) and epoch count.
        let order = if data.train.is_shuffled() && data.train.num_examples() > 1 {
            let seed = *model.shuffle_seed.get_or_insert_with(crate::runtime::rng::next_u64);
            Some((seed, model.epochs_trained as u64))
        } else {
            None
        };
        let Learner { net, loss: kind, configured, steps_trained, .. } = model;
        let optimizer = configured.as_mut().ok_or_else(|| Error::invalid("fit", "the optimizer was not built"))?.get_mut();
        optimizer.set_learning_rate(lr);
        net.train();
        if let Some(group) = self.process_group() {
            let val = data.val.as_ref().filter(|v| !v.is_empty());
            return self.run_distributed_epoch(group, net, optimizer, *kind, &data.train, val, order, steps_trained, bar);
        }
        let mut train = Sums::new();
        if let Some(replicas) = replicas {
            replicas.set_learning_rate(lr);
            replicas.train();
            let mut per_device: Vec<Sums> = replicas.devices().iter().map(|_| Sums::new()).collect();
            let clip = |ps: &[Tensor]| if self.gradient_clip_val > 0.0 { self.clip_gradients(ps) } else { Ok(()) };
            if resident.is_none() {
                *resident = Some(Resident::new(&data.train, replicas.devices())?);
            }
            match resident.as_ref().and_then(|r| r.as_ref()) {
                // Every device cuts its own piece from its own copy.
                Some(held) => {
                    let epoch = held.epoch(order)?;
                    for (start, rows) in epoch.batches() {
                        let pieces = epoch.pieces(start, rows)?;
                        replicas.step(net, optimizer, *kind, &pieces, rows, &clip, &mut per_device)?;
                        *steps_trained += 1;
                        bar.inc();
                    }
                }
                // The batches are made on the first device and cut there.
                None => {
                    for batch in data.train.iter_on_epoch(&device, order)? {
                        let batch = batch?;
                        let (x, y) = split_batch("fit", &batch)?;
                        let pieces = replicas.cut(x, y)?;
                        replicas.step(net, optimizer, *kind, &pieces, x.dims()[0], &clip, &mut per_device)?;
                        *steps_trained += 1;
                        bar.inc();
                    }
                }
            }
            for s in per_device {
                train = train.merge(s, &device)?;
            }
        } else {
            for batch in data.train.iter_on_epoch(&device, order)? {
                let batch = batch?;
                let (x, y) = split_batch("fit", &batch)?;
                let pred = net.forward(x).map_err(|e| owned_input("fit", device, e))?;
                let loss = kind.compute(&pred, y)?;
                optimizer.zero_grad();
                loss.backward()?;
                if self.gradient_clip_val > 0.0 {
                    self.clip_gradients(optimizer.parameters())?;
                }
                optimizer.step()?;
                *steps_trained += 1;
                train.add(&loss, &pred, y, *kind, x.dims()[0])?;
                bar.inc();
            }
        }
        let val = match data.val.as_ref().filter(|v| !v.is_empty()) {
            Some(loader) => {
                let sums = self.eval_sums("fit", net, *kind, loader);
                net.train();
                Some(sums?)
            }
            None => None,
        };
        Ok((train, val))
    }

    /// Sums over a loader in evaluation mode, without gradients.
    fn eval_sums(&self, op: &str, net: &mut dyn Module, kind: Loss, loader: &DataLoader) -> Result<Sums> {
        let device = self.device();
        let _g = no_grad();
        net.eval();
        let mut sums = Sums::new();
        for batch in loader.iter_on(&device)? {
            let batch = batch?;
            let (x, y) = split_batch(op, &batch)?;
            let pred = net.forward(x).map_err(|e| owned_input(op, device, e))?;
            let loss = kind.compute(&pred, y)?;
            sums.add(&loss, &pred, y, kind, x.dims()[0])?;
        }
        Ok(sums)
    }

    /// The loss and metric of the model over every example of `loader`
    /// (batches of features and targets), on the trainer's device, in
    /// evaluation mode and without gradients; the sums are read back once.
    /// The model is moved to the trainer's device and left in evaluation
    /// mode (Lightning's `validate`).
    ///
    /// ```
    /// use kiln::data::{synthetic_classification, DataLoader};
    /// use kiln::nn::{Linear, Loss};
    /// use kiln::optim::OptimizerConfig;
    /// use kiln::trainer::{Learner, Trainer};
    /// kiln::manual_seed(0);
    /// let data = synthetic_classification(300, 100, 4, 3, 32)?; // 100 = 3 batches of 32 and one of 4
    /// let mut model = Learner::new(Linear::new(4, 3, &kiln::cpu())?, Loss::CrossEntropy, OptimizerConfig::sgd(0.1));
    /// let trainer = Trainer::builder().max_epochs(1).build()?;
    /// let val = data.val.as_ref().unwrap();
    /// let e = trainer.evaluate(&mut model, val)?;
    /// assert_eq!(e.examples, 100);
    /// assert_eq!(e.metric, Some(e.correct.unwrap() as f64 / 100.0)); // exact, short batch included
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn evaluate<N: Module>(&self, model: &mut Learner<N>, loader: &DataLoader) -> Result<Evaluation> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        if loader.is_empty() {
            return Err(Error::invalid("evaluate", "the loader yields no batch"));
        }
        let device = self.device();
        self.prepare_model(&mut model.net)?;
        let sums = self.eval_sums("evaluate", &mut model.net, model.loss, loader)?;
        let n = sums.examples;
        let [loss, correct] = sums.parts(&device)?;
        let values = {
            let _g = no_grad();
            Tensor::stack(&[&loss, &correct], 0)?.to_vec_f64()?
        };
        let correct = model.loss.metric_name().map(|_| values[1] as u64);
        Ok(Evaluation { loss: mean(values[0], n), metric: correct.map(|c| mean(c as f64, n)), correct, examples: n })
    }

    /// The model's outputs for every batch of `loader` (its first tensor is
    /// the input; targets, if any, are ignored), concatenated along the
    /// first dimension, on the trainer's device: nothing is read back. In
    /// evaluation mode, without gradients; the model is moved to the
    /// trainer's device and left in evaluation mode (Lightning's `predict`).
    ///
    /// ```
    /// use kiln::data::DataLoader;
    /// use kiln::nn::{Linear, Loss, Module};
    /// use kiln::optim::OptimizerConfig;
    /// use kiln::trainer::{Learner, Trainer};
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &cpu())?;
    /// let net = Linear::new(2, 1, &cpu())?;
    /// let expected = net.forward(&x)?.to_vec::<f32>()?;
    /// let mut model = Learner::new(net, Loss::Mse, OptimizerConfig::sgd(0.1));
    /// let trainer = Trainer::builder().max_epochs(1).build()?;
    /// let out = trainer.predict(&mut model, &DataLoader::new(vec![x], 2)?)?;
    /// assert_eq!(out.to_vec::<f32>()?, expected);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn predict<N: Module>(&self, model: &mut Learner<N>, loader: &DataLoader) -> Result<Tensor> {
        let _site = crate::runtime::ledger::site_scope(Location::caller());
        if loader.is_empty() {
            return Err(Error::invalid("predict", "the loader yields no batch"));
        }
        let device = self.device();
        self.prepare_model(&mut model.net)?;
        let _g = no_grad();
        model.net.eval();
        let mut outputs = Vec::with_capacity(loader.len());
        for batch in loader.iter_on(&device)? {
            let batch = batch?;
            outputs.push(model.net.forward(&batch[0]).map_err(|e| owned_input("predict", device, e))?);
        }
        Tensor::cat(&outputs.iter().collect::<Vec<_>>(), 0)
    }
}
