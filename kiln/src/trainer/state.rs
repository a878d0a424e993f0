//! Training checkpoints: [`Trainer::save_checkpoint`] and
//! [`Trainer::load_checkpoint`] carry the model, the optimizer's state, the
//! epoch and step counts, kiln's random generator and the callbacks' state.

use super::{Learner, Trainer};
use crate::checkpoint;
use crate::nn::Module;
use crate::optim::OptimizerState;
use crate::runtime::rng;
use crate::{Error, Result, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::panic::Location;
use std::path::Path;

impl Trainer {
    /// Writes a training checkpoint to `path` (safetensors, atomically): the
    /// parameters (`model.<name>`), the optimizer's state
    /// (`optimizer.<index>.<buffer>`, its hyperparameters and step counter
    /// in the metadata), the learner's epoch and step counts, its shuffling
    /// seed ([`Learner::shuffle_seed`]: with the epoch count, the order of
    /// every later epoch), kiln's random generator on this thread (so
    /// dropout goes on as it would have) and each callback's state. [`Trainer::load_checkpoint`]
    /// resumes from it exactly; [`checkpoint::load`] takes its parameters.
    ///
    /// ```
    /// use kiln::data::synthetic_classification;
    /// use kiln::nn::{Linear, Loss};
    /// use kiln::optim::OptimizerConfig;
    /// use kiln::trainer::{Learner, Trainer};
    /// let path = std::env::temp_dir().join(format!("kiln-doc-resume-{}.safetensors", std::process::id()));
    /// let learner = || -> kiln::Result<_> {
    ///     Ok(Learner::new(Linear::new(4, 3, &kiln::cpu())?, Loss::CrossEntropy, OptimizerConfig::adam(0.01)))
    /// };
    /// kiln::manual_seed(0);
    /// let data = synthetic_classification(256, 64, 4, 3, 32)?;
    ///
    /// // 4 epochs in one go.
    /// kiln::manual_seed(1);
    /// let mut whole = learner()?;
    /// let straight = Trainer::builder().max_epochs(4).build()?.fit(&mut whole, &data)?;
    ///
    /// // 2 epochs, a checkpoint, and 2 more in a fresh learner.
    /// kiln::manual_seed(1);
    /// let mut first = learner()?;
    /// let mut trainer = Trainer::builder().max_epochs(2).build()?;
    /// let a = trainer.fit(&mut first, &data)?;
    /// trainer.save_checkpoint(&first, &path)?;
    /// let mut resumed = learner()?;
    /// trainer.load_checkpoint(&mut resumed, &path)?;
    /// let b = trainer.fit(&mut resumed, &data)?;
    /// assert_eq!([a.train_losses(), b.train_losses()].concat(), straight.train_losses()); // exactly
    /// # std::fs::remove_file(&path).ok();
    /// # Ok::<(), kiln::Error>(())
    /// ```
    #[track_caller]
    pub fn save_checkpoint<N: Module>(&self, model: &Learner<N>, path: impl AsRef<Path>) -> Result<()> {
        self.save_checkpoint_at(model, path.as_ref(), Location::caller())
    }

    pub(super) fn save_checkpoint_at<N: Module>(&self, model: &Learner<N>, path: &Path, site: &'static Location<'static>) -> Result<()> {
        // Across processes the ranks hold the same state: rank 0 writes it.
        if self.process_group().is_some_and(|g| !g.is_main()) {
            return Ok(());
        }
        let mut tensors: Vec<(String, Tensor)> =
            crate::checkpoint::state_tensors(&model.net).into_iter().map(|(n, t)| (format!("model.{n}"), t)).collect();
        let mut metadata = HashMap::new();
        metadata.insert("format".to_string(), checkpoint::TRAINER_FORMAT.to_string());
        metadata.insert("epochs_trained".to_string(), model.epochs_trained.to_string());
        metadata.insert("steps_trained".to_string(), model.steps_trained.to_string());
        let (seed, offset) = rng::state();
        metadata.insert("rng.seed".to_string(), seed.to_string());
        metadata.insert("rng.offset".to_string(), offset.to_string());
        if let Some(seed) = model.shuffle_seed {
            metadata.insert("shuffle.seed".to_string(), seed.to_string());
        }
        let state = match &model.configured {
            Some(c) => Some(c.get().state_dict()?),
            None => None,
        };
        metadata.insert("optimizer.kind".to_string(), model.optimizer.kind().to_string());
        if let Some(state) = state {
            for (k, v) in &state.hyperparameters {
                // Rust prints an f64 with the fewest digits that read back to it.
                metadata.insert(format!("optimizer.{k}"), v.to_string());
            }
            tensors.extend(state.buffers.into_iter().map(|(k, t)| (format!("optimizer.{k}"), t)));
        }
        for c in &self.callbacks {
            for (k, v) in c.state() {
                metadata.insert(format!("callback.{}.{k}", c.name()), v.to_string());
            }
        }
        checkpoint::save_with_metadata(&tensors, Some(metadata), path, site)
    }

    /// Resumes from a checkpoint of [`Trainer::save_checkpoint`]: the
    /// parameters (onto the trainer's device, the model moved there
    /// first), the optimizer's state (its buffers and step counter; the
    /// hyperparameters stay the learner's [`OptimizerConfig`], whose kind
    /// must match), the epoch and step counts, kiln's random generator on
    /// this thread, and the state of this trainer's callbacks saved under
    /// their names. Everything is read and checked before the learner
    /// changes: on an error it is as it was. Transfers are booked at the
    /// caller's line.
    #[track_caller]
    pub fn load_checkpoint<N: Module>(&mut self, model: &mut Learner<N>, path: impl AsRef<Path>) -> Result<()> {
        let site = Location::caller();
        let _site = crate::runtime::ledger::site_scope(site);
        let path = path.as_ref();
        let op = "load_checkpoint";
        if model.net.has_lazy_parameters() {
            return Err(Error::invalid(
                op,
                "the model has lazy layers without parameters yet; create them first with a sample batch, e.g. `model.net.init_lazy(&x)?` (one forward without gradients)",
            ));
        }
        let device = self.device();
        self.prepare_model(&mut model.net)?;
        let mut file = checkpoint::read_training(&model.net, path, &device, site)?;
        let bad = |msg: String| Error::Format { path: path.display().to_string(), msg };
        let meta = &file.metadata;
        let number = |key: &str| -> Result<u64> {
            let v = meta.get(key).ok_or_else(|| bad(format!("the metadata has no `{key}`")))?;
            v.parse::<u64>().map_err(|_| bad(format!("the metadata's `{key}` is {v:?}, not a whole number")))
        };
        let float = |key: &str, v: &String| -> Result<f64> {
            v.parse::<f64>().map_err(|_| bad(format!("the metadata's `{key}` is {v:?}, not a number")))
        };
        let epochs = usize::try_from(number("epochs_trained")?).map_err(|_| bad("`epochs_trained` is too large".into()))?;
        let steps = number("steps_trained")?;
        let rng_state = (number("rng.seed")?, number("rng.offset")?);
        // Absent from a checkpoint saved before the first shuffled epoch
        // (and from older files): the next fit draws the seed then.
        let shuffle_seed = if meta.contains_key("shuffle.seed") { Some(number("shuffle.seed")?) } else { None };
        let kind = meta.get("optimizer.kind").ok_or_else(|| bad("the metadata has no `optimizer.kind`".into()))?;
        if kind != model.optimizer.kind() {
            return Err(Error::invalid(
                op,
                format!(
                    "{} holds the state of a `{kind}` optimizer, the learner's is `{}`; set it to the same kind first, e.g. `model.optimizer = kiln::optim::OptimizerConfig::{kind}({})`",
                    path.display(),
                    model.optimizer.kind(),
                    model.optimizer.learning_rate()
                ),
            ));
        }
        let mut hyperparameters = BTreeMap::new();
        for (k, v) in meta {
            if let Some(name) = k.strip_prefix("optimizer.").filter(|n| *n != "kind") {
                hyperparameters.insert(name.to_string(), float(k, v)?);
            }
        }
        let buffers: BTreeMap<String, Tensor> =
            file.others.iter().filter_map(|(k, t)| Some((k.strip_prefix("optimizer.")?.to_string(), t.clone()))).collect();
        if let Some(other) = file.others.keys().find(|k| !k.starts_with("optimizer.")) {
            return Err(bad(format!("tensor `{other}` is neither a parameter (`model.`) nor an optimizer buffer (`optimizer.`)")));
        }
        let mut callbacks: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
        for (k, v) in meta {
            if let Some(rest) = k.strip_prefix("callback.") {
                let (name, key) = rest.rsplit_once('.').ok_or_else(|| bad(format!("metadata key `{k}` is not `callback.<name>.<key>`")))?;
                callbacks.entry(name.to_string()).or_default().insert(key.to_string(), float(k, v)?);
            }
        }
        // The optimizer, checked against the parameters (the same tensors
        // the file's values go into, in place, below).
        let mut configured = if hyperparameters.is_empty() && buffers.is_empty() {
            // Saved before any fit: nothing to restore but the kind.
            model.optimizer.configure(None, model.net.parameters())?
        } else {
            let mut fresh = model.optimizer.configure(None, model.net.parameters())?;
            let state = OptimizerState { kind: kind.clone(), hyperparameters, buffers };
            fresh.get_mut().load_state_dict(&state).map_err(|e| bad(format!("the optimizer state does not fit this learner: {e}")))?;
            fresh
        };
        // The learner's configuration sets the hyperparameters it names.
        configured = model.optimizer.configure(Some(configured), model.net.parameters())?;
        // Commit.
        file.apply_parameters(&mut model.net)?;
        model.configured = Some(configured);
        model.epochs_trained = epochs;
        model.steps_trained = steps;
        model.shuffle_seed = shuffle_seed;
        rng::restore(rng_state);
        for c in &mut self.callbacks {
            if let Some(state) = callbacks.get(&c.name()) {
                c.load_state(state)?;
            }
        }
        Ok(())
    }
}
