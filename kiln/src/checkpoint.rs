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

use crate::base::buffer::CpuBuffer;
use crate::nn::Module;
use crate::{no_grad, DType, Device, Error, Result, Shape, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype as SDtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::panic::Location;
use std::path::{Path, PathBuf};

fn format_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Format { path: path.display().to_string(), msg: msg.into() }
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), msg: format!("{what}: {e}") }
}

fn to_sdtype(d: DType) -> SDtype {
    match d {
        DType::F32 => SDtype::F32,
        DType::F64 => SDtype::F64,
        DType::I64 => SDtype::I64,
        DType::I32 => SDtype::I32,
        DType::U8 => SDtype::U8,
        DType::F16 => SDtype::F16,
        DType::BF16 => SDtype::BF16,
    }
}

fn from_sdtype(d: SDtype) -> Option<DType> {
    Some(match d {
        SDtype::F32 => DType::F32,
        SDtype::F64 => DType::F64,
        SDtype::I64 => DType::I64,
        SDtype::I32 => DType::I32,
        SDtype::U8 => DType::U8,
        SDtype::F16 => DType::F16,
        SDtype::BF16 => DType::BF16,
        _ => return None,
    })
}

/// A tensor's elements as little-endian bytes on the host.
struct HostTensor {
    dtype: SDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &HostTensor {
    fn dtype(&self) -> SDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn le_bytes(buf: &CpuBuffer) -> Vec<u8> {
    match buf {
        CpuBuffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuBuffer::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuBuffer::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuBuffer::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuBuffer::U8(v) => v.clone(),
        CpuBuffer::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuBuffer::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn from_le_bytes(dtype: DType, b: &[u8]) -> CpuBuffer {
    fn chunks<const N: usize, T>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        b.chunks_exact(N).map(|c| f(c.try_into().unwrap_or([0; N]))).collect()
    }
    match dtype {
        DType::F32 => CpuBuffer::F32(chunks(b, f32::from_le_bytes)),
        DType::F64 => CpuBuffer::F64(chunks(b, f64::from_le_bytes)),
        DType::I64 => CpuBuffer::I64(chunks(b, i64::from_le_bytes)),
        DType::I32 => CpuBuffer::I32(chunks(b, i32::from_le_bytes)),
        DType::U8 => CpuBuffer::U8(b.to_vec()),
        DType::F16 => CpuBuffer::F16(chunks(b, f16::from_le_bytes)),
        DType::BF16 => CpuBuffer::BF16(chunks(b, bf16::from_le_bytes)),
    }
}

/// The temporary file a save to `path` writes first: `<path>.<pid>.tmp`.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".{}.tmp", std::process::id()));
    path.with_file_name(name)
}

/// Saves named tensors (from any devices: GPU tensors are read to the host,
/// one booked transfer each) to a safetensors file, atomically.
#[track_caller]
pub fn save_tensors(tensors: &[(String, Tensor)], path: impl AsRef<Path>) -> Result<()> {
    save_with_metadata(tensors, None, path.as_ref(), Location::caller())
}

/// [`save_tensors`] with the safetensors header's `__metadata__` map.
pub(crate) fn save_with_metadata(
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
    path: &Path,
    site: &'static Location<'static>,
) -> Result<()> {
    let _site = crate::runtime::ledger::site_scope(site);
    let mut host = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if host.iter().any(|(n, _): &(String, HostTensor)| n == name) {
            return Err(Error::invalid("save", format!("the tensor name `{name}` appears twice")));
        }
        let buf = t.read_host(site)?;
        host.push((name.clone(), HostTensor { dtype: to_sdtype(t.dtype()), shape: t.dims().to_vec(), bytes: le_bytes(&buf) }));
    }
    let bytes = safetensors::serialize(host.iter().map(|(n, h)| (n.as_str(), h)), metadata)
        .map_err(|e| format_err(path, format!("cannot encode the checkpoint: {e}")))?;
    remove_stale_temp_files(path);
    let tmp = temp_path(path);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(&tmp, "cannot write the checkpoint (the previous one, if any, is untouched)", e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(path, "cannot move the new checkpoint into place (the previous one, if any, is untouched)", e)
    })?;
    sync_parent_dir(path)
}

/// Flushes the directory holding `path`, so that the rename that put the new
/// checkpoint in place is itself on disk.
fn sync_parent_dir(path: &Path) -> Result<()> {
    // Elsewhere a directory cannot be opened to be flushed.
    #[cfg(not(unix))]
    let _ = path;
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_err(dir, "the checkpoint was written but its directory could not be flushed to disk", e))?;
    }
    Ok(())
}

/// Removes `<path>.<pid>.tmp` files left by saves whose process was killed:
/// those whose pid is no running process. A save in progress in another
/// live process keeps its file. Best effort: a file that cannot be removed
/// stays, and the save goes on.
fn remove_stale_temp_files(path: &Path) {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else { return };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let prefix = format!("{name}.");
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(file) = file.to_str() else { continue };
        let Some(pid) = file.strip_prefix(&prefix).and_then(|rest| rest.strip_suffix(".tmp")) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !process_alive(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
        // SAFETY: signal 0 only checks that the process exists; nothing is sent.
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Refuses a header that names one tensor twice (the JSON map would
/// otherwise keep the last one silently).
fn check_unique_names(path: &Path, bytes: &[u8]) -> Result<()> {
    use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Option<String>, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut twice = None;
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                if !seen.insert(key.clone()) && twice.is_none() {
                    twice = Some(key);
                }
            }
            Ok(twice)
        }
    }
    let Some(len) = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))) else { return Ok(()) };
    let Some(header) = usize::try_from(len).ok().and_then(|n| bytes.get(8..8usize.checked_add(n)?)) else { return Ok(()) };
    // A header that is not JSON is reported by safetensors' own parser.
    if let Ok(Some(name)) = serde_json::Deserializer::from_slice(header).deserialize_map(Keys) {
        return Err(format_err(
            path,
            format!("the header names tensor `{name}` twice; the file is corrupt or was not written by a safetensors writer"),
        ));
    }
    Ok(())
}

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

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| io_err(path, "cannot read the checkpoint", e))
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    check_unique_names(path, bytes)?;
    SafeTensors::deserialize(bytes).map_err(|e| format_err(path, format!("not a valid safetensors file (corrupt or truncated?): {e}")))
}

fn upload(path: &Path, name: &str, view: &safetensors::tensor::TensorView<'_>, device: &Device) -> Result<Tensor> {
    let dtype = from_sdtype(view.dtype())
        .ok_or_else(|| format_err(path, format!("tensor `{name}` has dtype {:?}, which kiln does not support", view.dtype())))?;
    let shape = Shape::from(view.shape().to_vec());
    let expect = shape.elem_count() * dtype.size_in_bytes();
    if view.data().len() != expect {
        return Err(format_err(path, format!("tensor `{name}` holds {} bytes, its shape {shape} needs {expect}", view.data().len())));
    }
    Tensor::from_host_buffer(from_le_bytes(dtype, view.data()), shape, device)
}

/// Loads every tensor of a safetensors file onto `device`, in file order.
/// Uploads are booked at the caller's line.
#[track_caller]
pub fn load_tensors(path: impl AsRef<Path>, device: &Device) -> Result<Vec<(String, Tensor)>> {
    let _site = crate::runtime::ledger::site_scope(Location::caller());
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut names: Vec<(usize, String)> = st.iter().map(|(n, v)| (v.data().as_ptr() as usize, n.to_string())).collect();
    names.sort();
    let mut out = Vec::with_capacity(names.len());
    for (_, name) in names {
        let view = st.tensor(&name).map_err(|e| format_err(path, format!("tensor `{name}`: {e}")))?;
        out.push((name.clone(), upload(path, &name, &view, device)?));
    }
    Ok(out)
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

fn metadata_of(st_bytes: &[u8]) -> HashMap<String, String> {
    SafeTensors::read_metadata(st_bytes).ok().and_then(|(_, m)| m.metadata().clone()).unwrap_or_default()
}

/// Loads a model's parameters from `path` straight onto `device`. Every
/// parameter must be in the file with its shape and dtype, and the file
/// must hold nothing else; otherwise a [`Error::Format`] names the tensor
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
            ))
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
