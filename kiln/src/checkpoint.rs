//! Checkpoints: a model's parameters saved as safetensors and loaded back
//! straight onto a chosen device (the chapter's exercise 2: reading and
//! writing parameters that live on a GPU).
//!
//! Saving is atomic: the file is written to `<path>.<pid>.tmp` in the same
//! directory, flushed to disk, then renamed over `path`, and the directory is
//! flushed too, so an interrupted save leaves the previous checkpoint intact
//! and a finished one survives a power cut. The temporary files of earlier
//! saves that were killed (their process is gone) are removed by the next
//! save to the same path. A file whose header names one tensor twice is
//! refused. Loading checks every tensor
//! (present, same shape, same dtype, nothing extra) and copies them to the
//! device before touching the model: on any error the model is unchanged.
//!
//! ```
//! use kiln::nn::{Linear, Module};
//! use kiln::{checkpoint, cpu, try_gpu};
//! let dir = std::env::temp_dir().join(format!("kiln-doc-ckpt-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("linear.safetensors");
//!
//! let net = Linear::new(2, 1, &cpu())?;
//! checkpoint::save(&net, &path)?;
//!
//! let mut other = Linear::new(2, 1, &cpu())?;
//! checkpoint::load(&mut other, &path, &try_gpu(0))?;
//! assert_eq!(other.weight().device(), try_gpu(0));
//! assert_eq!(other.weight().to_vec::<f32>()?, net.weight().to_vec::<f32>()?);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), kiln::Error>(())
//! ```

pub(crate) use crate::io::safetensors::save_with_metadata;
use crate::io::safetensors::{format_err, from_sdtype, io_err, metadata_of, parse, read_file, upload};
pub use crate::io::safetensors::{load_tensors, save_tensors, temp_path};
use crate::nn::Module;
use crate::{no_grad, Device, Result, Tensor};
use ::safetensors::SafeTensors;
use std::collections::HashMap;
use std::panic::Location;
use std::path::Path;

/// Saves a model's parameters (by their [`Module::named_parameters`] names).
#[track_caller]
pub fn save(model: &dyn Module, path: impl AsRef<Path>) -> Result<()> {
    save_tensors(&state_tensors(model), path)
}

/// A model's parameters and then its buffers (running statistics), by name:
/// what a checkpoint holds.
pub(crate) fn state_tensors(model: &dyn Module) -> Vec<(String, Tensor)> {
    let mut all = model.named_parameters();
    all.extend(model.named_buffers());
    all
}

/// The `format` entry of the metadata of a checkpoint written by
/// [`Trainer::save_checkpoint`](crate::trainer::Trainer::save_checkpoint),
/// whose parameters are the tensors named `model.<parameter>`.
pub(crate) const TRAINER_FORMAT: &str = "kiln.trainer/1";

/// Whether `path` is a checkpoint written by
/// [`Trainer::save_checkpoint`](crate::trainer::Trainer::save_checkpoint)
/// (to resume with [`Trainer::load_checkpoint`](crate::trainer::Trainer::load_checkpoint))
/// rather than a parameters-only file of [`save`]. Reads the header only;
/// an unreadable or malformed file is an error.
///
/// ```
/// use kiln::nn::Linear;
/// use kiln::checkpoint;
/// let path = std::env::temp_dir().join(format!("kiln-doc-is-trainer-{}.safetensors", std::process::id()));
/// checkpoint::save(&Linear::new(2, 1, &kiln::cpu())?, &path)?;
/// assert!(!checkpoint::is_trainer_checkpoint(&path)?);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn is_trainer_checkpoint(path: impl AsRef<Path>) -> Result<bool> {
    use std::io::Read;
    let path = path.as_ref();
    let mut file = std::fs::File::open(path).map_err(|e| io_err(path, "cannot read the checkpoint", e))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| format_err(path, "not a valid safetensors file: shorter than its 8-byte header length"))?;
    // safetensors' own limit on the header.
    const MAX_HEADER: u64 = 100_000_000;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(format_err(path, format!("not a valid safetensors file: a header of {len} bytes (at most {MAX_HEADER})")));
    }
    let mut header = Vec::new();
    file.take(len).read_to_end(&mut header).map_err(|e| io_err(path, "cannot read the checkpoint", e))?;
    if header.len() as u64 != len {
        return Err(format_err(
            path,
            format!("not a valid safetensors file: its header needs {len} bytes, the file holds {}", header.len()),
        ));
    }
    let json: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| format_err(path, format!("not a valid safetensors file: its header is not JSON ({e})")))?;
    Ok(json.get("__metadata__").and_then(|m| m.get("format")).and_then(|f| f.as_str()) == Some(TRAINER_FORMAT))
}

/// Loads a model's parameters from `path` straight onto `device`. Every
/// parameter must be in the file with its shape and dtype, and the file
/// must hold nothing else; otherwise a [`Error::Format`](crate::Error::Format) names the tensor
/// and the model is left unchanged. A parameter already on `device` is
/// overwritten in place; one elsewhere moves to `device` keeping its
/// identity (as [`Module::to`] does: an optimizer holding it follows it),
/// its gradient cleared. Uploads are booked at the caller's line.
///
/// A checkpoint written by
/// [`Trainer::save_checkpoint`](crate::trainer::Trainer::save_checkpoint)
/// (or a [`BestCheckpoint`](crate::trainer::BestCheckpoint)) loads too:
/// its parameters are taken, its optimizer state is left out.
///
/// A model built from lazy layers has no parameters until its first
/// forward: create them with [`Module::init_lazy`] and a sample batch
/// before loading (the error says so otherwise).
///
/// ```
/// use kiln::models::lenet;
/// use kiln::nn::Module;
/// use kiln::{checkpoint, DType, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-lazy-{}.safetensors", std::process::id()));
/// let x = Tensor::zeros((1, 1, 28, 28), DType::F32, &kiln::cpu())?;
/// let mut trained = lenet(10);
/// trained.init_lazy(&x)?;
/// checkpoint::save(&trained, &path)?;
///
/// let mut fresh = lenet(10);
/// let err = checkpoint::load(&mut fresh, &path, &kiln::cpu()).unwrap_err().to_string();
/// assert!(err.contains("tensor `0.bias`") && err.contains("init_lazy"), "{err}");
/// fresh.init_lazy(&x)?;
/// checkpoint::load(&mut fresh, &path, &kiln::cpu())?;
/// assert_eq!(fresh.parameter("0.weight")?.to_vec::<f32>()?, trained.parameter("0.weight")?.to_vec::<f32>()?);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn load(model: &mut dyn Module, path: impl AsRef<Path>, device: &Device) -> Result<()> {
    let _site = crate::runtime::ledger::site_scope(Location::caller());
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let prefix = if metadata_of(&bytes).get("format").map(String::as_str) == Some(TRAINER_FORMAT) { "model." } else { "" };
    let loaded = stage_parameters(model, path, &st, prefix, device)?;
    apply_parameters(model, loaded)
}

/// Reads every parameter of `model` from the tensors named `prefix +
/// name`, checks it (present, same shape and dtype; no other tensor with
/// the prefix) and copies it to `device`, without touching the model.
fn stage_parameters(
    model: &dyn Module,
    path: &Path,
    st: &SafeTensors<'_>,
    prefix: &str,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let params = state_tensors(model);
    // In sorted order, so that the tensor an error names is the same on
    // every run (the header's order is a hash map's).
    let mut names = st.names();
    names.sort();
    for file_name in names {
        let Some(name) = file_name.strip_prefix(prefix) else { continue };
        if !params.iter().any(|(n, _)| n == name) {
            if model.has_lazy_parameters() {
                return Err(format_err(
                    path,
                    format!(
                        "tensor `{file_name}` is in the file but not in the model: the model has lazy layers whose parameters \
                         do not exist yet (they are made by the first forward); call `model.init_lazy(&x)?` with a sample \
                         batch first, then load"
                    ),
                ));
            }
            let expected: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
            return Err(format_err(
                path,
                format!(
                    "tensor `{file_name}` is in the file but not in the model (the model has [{}]); was it saved from another model?",
                    expected.join(", ")
                ),
            ));
        }
    }
    let mut loaded = HashMap::with_capacity(params.len());
    for (name, p) in &params {
        let file_name = format!("{prefix}{name}");
        let view = st.tensor(&file_name).map_err(|_| format_err(path, format!("tensor `{file_name}` is missing from the checkpoint")))?;
        let file_dtype = from_sdtype(view.dtype());
        if file_dtype != Some(p.dtype()) {
            return Err(format_err(
                path,
                format!("tensor `{file_name}` has dtype {:?} in the file, the model's is {}", view.dtype(), p.dtype()),
            ));
        }
        if view.shape() != p.dims() {
            return Err(format_err(
                path,
                format!("tensor `{file_name}` has shape {:?} in the file, the model's is {:?}", view.shape(), p.dims()),
            ));
        }
        loaded.insert(name.clone(), upload(path, &file_name, &view, device)?);
    }
    Ok(loaded)
}

/// Puts staged parameters into the model (everything was checked and
/// copied before: this cannot fail half-way for lack of memory).
fn apply_parameters(model: &mut dyn Module, mut loaded: HashMap<String, Tensor>) -> Result<()> {
    let _g = no_grad();
    model.visit_parameters_mut(&mut |name, p| {
        let Some(new) = loaded.remove(name) else { return Ok(()) };
        if p.device() == new.device() {
            p.assign(&new)
        } else {
            if p.requires_grad() {
                p.zero_grad();
            }
            *p = p.relocated(new, None);
            Ok(())
        }
    })?;
    model.visit_buffers_mut(&mut |name, b| {
        let Some(new) = loaded.remove(name) else { return Ok(()) };
        if b.device() == new.device() {
            b.assign(&new)
        } else {
            *b = new;
            Ok(())
        }
    })
}

/// A checkpoint of the Trainer's, read and checked: the parameters staged
/// on the device, the other tensors (optimizer buffers) there too, and the
/// metadata.
pub(crate) struct TrainingFile {
    pub(crate) parameters: HashMap<String, Tensor>,
    pub(crate) others: std::collections::BTreeMap<String, Tensor>,
    pub(crate) metadata: HashMap<String, String>,
}

/// Reads a checkpoint written by the Trainer for `model`, onto `device`,
/// without changing the model ([`TrainingFile::apply`] does).
pub(crate) fn read_training(model: &dyn Module, path: &Path, device: &Device, site: &'static Location<'static>) -> Result<TrainingFile> {
    let _site = crate::runtime::ledger::site_scope(site);
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let metadata = metadata_of(&bytes);
    match metadata.get("format") {
        Some(f) if f == TRAINER_FORMAT => {}
        other => {
            return Err(format_err(
                path,
                format!(
                    "not a Trainer checkpoint (its metadata `format` is {:?}, expected \"{TRAINER_FORMAT}\"); \
                     load a parameters-only file with `kiln::checkpoint::load(&mut model.net, path, &device)?`",
                    other
                ),
            ));
        }
    }
    let parameters = stage_parameters(model, path, &st, "model.", device)?;
    let mut others = std::collections::BTreeMap::new();
    for name in st.names() {
        if name.starts_with("model.") {
            continue;
        }
        let view = st.tensor(name).map_err(|e| format_err(path, format!("tensor `{name}`: {e}")))?;
        others.insert(name.to_string(), upload(path, name, &view, device)?);
    }
    Ok(TrainingFile { parameters, others, metadata })
}

impl TrainingFile {
    /// Puts the parameters into the model.
    pub(crate) fn apply_parameters(&mut self, model: &mut dyn Module) -> Result<()> {
        apply_parameters(model, std::mem::take(&mut self.parameters))
    }
}
