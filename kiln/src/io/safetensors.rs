//! Safetensors files of any origin (PyTorch, Hugging Face, candle, kiln's
//! own checkpoints): the format itself (dtypes, the atomic write, the
//! checks of a file read back), used by [`crate::checkpoint`] for models,
//! and maps by name for everyone else.

use crate::base::buffer::CpuBuffer;
use crate::runtime::ledger;
use crate::{DType, Device, Error, Result, Shape, Tensor};
use ::safetensors::{Dtype as SDtype, SafeTensors, View};
use half::{bf16, f16};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::panic::Location;
use std::path::{Path, PathBuf};

/// Loads every tensor of a safetensors file onto `device`, by name.
///
/// Any writer's file is read (the `__metadata__` entry is skipped) as long
/// as its dtypes are kiln's: F32, F64, I64, I32, U8, F16, BF16; another
/// dtype (BOOL, I8, F8 …) is an [`Error::Format`](crate::Error::Format)
/// naming the tensor, as is a truncated or inconsistent file or a header
/// that names a tensor twice. Reading onto a GPU books one host-to-device
/// transfer per tensor at the caller's line. For the file's order use
/// [`load_tensors`].
///
/// ```
/// use kiln::{cpu, io, try_gpu, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-load-st-{}.safetensors", std::process::id()));
/// let w = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
/// let b = Tensor::new(&[0.5f32, -0.5], &cpu())?;
/// io::save_safetensors(&path, &[("layer.weight", &w), ("layer.bias", &b)])?;
/// let tensors = io::load_safetensors(&path, &try_gpu(0))?;
/// assert_eq!(tensors["layer.bias"].to_vec::<f32>()?, vec![0.5, -0.5]);
/// assert_eq!(tensors["layer.weight"].device(), try_gpu(0));
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn load_safetensors(path: impl AsRef<Path>, device: &Device) -> Result<HashMap<String, Tensor>> {
    let _site = ledger::site_scope(Location::caller());
    crate::registry::backend(*device)?;
    Ok(load_tensors(path, device)?.into_iter().collect())
}

/// Saves named tensors (from any devices) to a safetensors file, atomically
/// (see [`save_tensors`]). Names must be distinct
/// ([`Error::InvalidArgument`](crate::Error::InvalidArgument)). Reading a
/// GPU tensor books a device-to-host transfer at the caller's line.
///
/// ```
/// use kiln::{cpu, io, DType, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-save-st-{}.safetensors", std::process::id()));
/// let x = Tensor::ones((2, 2), DType::F16, &cpu())?;
/// io::save_safetensors(&path, &[("x", &x)])?;
/// assert_eq!(io::load_safetensors(&path, &cpu())?["x"].dtype(), DType::F16);
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn save_safetensors(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let _site = ledger::site_scope(Location::caller());
    let owned: Vec<(String, Tensor)> = tensors.iter().map(|(n, t)| (n.to_string(), (*t).clone())).collect();
    save_tensors(&owned, path)
}

pub(crate) fn format_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Format { path: path.display().to_string(), msg: msg.into() }
}

pub(crate) fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
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

pub(crate) fn from_sdtype(d: SDtype) -> Option<DType> {
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

pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| io_err(path, "cannot read the checkpoint", e))
}

pub(crate) fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    check_unique_names(path, bytes)?;
    SafeTensors::deserialize(bytes).map_err(|e| format_err(path, format!("not a valid safetensors file (corrupt or truncated?): {e}")))
}

pub(crate) fn upload(path: &Path, name: &str, view: &safetensors::tensor::TensorView<'_>, device: &Device) -> Result<Tensor> {
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

pub(crate) fn metadata_of(st_bytes: &[u8]) -> HashMap<String, String> {
    SafeTensors::read_metadata(st_bytes).ok().and_then(|(_, m)| m.metadata().clone()).unwrap_or_default()
}
