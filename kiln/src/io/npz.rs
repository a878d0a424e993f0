//! numpy's `.npz`: a zip archive with one `.npy` member per array, stored
//! (`np.savez`) or deflated (`np.savez_compressed`).

use super::npy::{npy_len, read_array, write_array, Bounds};
use super::Origin;
use crate::runtime::ledger;
use crate::{Device, Error, Result, Tensor};
use std::collections::HashMap;
use std::io::{BufReader, Cursor, Read, Seek, SeekFrom, Write};
use std::panic::Location;
use std::path::Path;
use zip::CompressionMethod;

/// The most bytes deflate can produce per compressed byte (its longest
/// match, 258 bytes, from a code of two bits or so, is 1032:1): a member
/// whose header promises more than this times its compressed size lies.
const MAX_DEFLATE_RATIO: u64 = 1032;

/// Bytes added to that bound for the header and the end of the stream.
const DEFLATE_SLACK: u64 = 1 << 10;

fn zip_err(origin: &Origin, e: zip::result::ZipError) -> Error {
    use std::io::ErrorKind::{InvalidData, InvalidInput, UnexpectedEof};
    match e {
        // The zip crate's reads past the end (a lying offset or size) and
        // bad data are the archive's fault, not the disk's.
        zip::result::ZipError::Io(e) if matches!(e.kind(), InvalidData | InvalidInput | UnexpectedEof) => {
            origin.format(format!("not a readable .npz (zip) archive: {e}"))
        }
        zip::result::ZipError::Io(e) => origin.io("cannot read the archive", e),
        e => origin.format(format!("not a readable .npz (zip) archive: {e}")),
    }
}

/// The fixed part of a central directory entry: no entry is shorter.
const MIN_DIRECTORY_ENTRY: u64 = 46;

/// Refuses an end-of-central-directory record that counts more members
/// than its directory's size can hold. The zip crate reserves room for the
/// count before it reads the entries (up to 65,535 of some 200 bytes each,
/// 14 MB for a file of a few KiB); Python's zipfile, numpy's reader, relies
/// on the same size field. Zip64 records are checked by the zip crate.
fn check_member_count<R: Read + Seek>(r: &mut R, archive_len: u64, origin: &Origin) -> Result<()> {
    const EOCD: u64 = 22;
    let tail_len = archive_len.min(u16::MAX as u64 + EOCD);
    let mut tail = vec![0u8; tail_len as usize];
    r.seek(SeekFrom::Start(archive_len - tail_len))
        .and_then(|_| r.read_exact(&mut tail))
        .and_then(|_| r.seek(SeekFrom::Start(0)))
        .map_err(|e| origin.io("cannot read the archive", e))?;
    let Some(at) = tail.windows(4).rposition(|w| w == b"PK\x05\x06") else { return Ok(()) };
    let Some(eocd) = tail.get(at..at + EOCD as usize) else { return Ok(()) };
    let u16_at = |i: usize| u16::from_le_bytes([eocd[i], eocd[i + 1]]);
    let (on_disk, total, comment) = (u16_at(8), u16_at(10), u16_at(20) as usize);
    let directory_size = u32::from_le_bytes([eocd[12], eocd[13], eocd[14], eocd[15]]);
    // Only a record that ends the file (after its comment) is the real one;
    // one with a Zip64 locator before it has its counts in the Zip64 record.
    let zip64 = at >= 20 && &tail[at - 20..at - 16] == b"PK\x06\x07";
    if at + EOCD as usize + comment != tail.len() || zip64 {
        return Ok(());
    }
    let count = on_disk.max(total) as u64;
    if count * MIN_DIRECTORY_ENTRY > directory_size as u64 {
        return Err(origin.format(format!(
            "the zip directory claims {count} members in {directory_size} bytes, where each takes at least {MIN_DIRECTORY_ENTRY}: the archive is corrupt"
        )));
    }
    Ok(())
}

/// Every array of an archive, in the order of its directory.
#[track_caller]
fn read_archive<R: Read + Seek>(mut reader: R, archive_len: u64, origin: &Origin, device: &Device) -> Result<Vec<(String, Tensor)>> {
    check_member_count(&mut reader, archive_len, origin)?;
    let mut zip = zip::ZipArchive::new(reader).map_err(|e| zip_err(origin, e))?;
    let mut out: Vec<(String, Tensor)> = Vec::with_capacity(zip.len().min(1 << 10));
    let mut index: HashMap<String, usize> = HashMap::new();
    for i in 0..zip.len() {
        let mut member = zip.by_index(i).map_err(|e| zip_err(origin, e))?;
        let name = member.name().to_string();
        let at = origin.member(&name);
        let Some(key) = name.strip_suffix(".npy") else {
            return Err(at.format("is not a .npy array; an .npz holds only `<name>.npy` members (as np.savez writes them)"));
        };
        let (size, compressed) = (member.size(), member.compressed_size());
        let bounds = match member.compression() {
            CompressionMethod::Stored => {
                if size != compressed {
                    return Err(at.format(format!(
                        "the zip directory says this stored member is {size} bytes and {compressed} bytes compressed; they must be equal"
                    )));
                }
                // Allocated whole only when the archive can hold that much.
                Bounds { total: Some(size), present: compressed <= archive_len, declared: true, max_data: None }
            }
            CompressionMethod::Deflated => Bounds {
                total: Some(size),
                present: false,
                declared: true,
                max_data: Some(compressed.saturating_mul(MAX_DEFLATE_RATIO).saturating_add(DEFLATE_SLACK)),
            },
            other => {
                return Err(at.format(format!("compressed with {other}; numpy writes members stored or deflated, which kiln reads")));
            }
        };
        let tensor = read_array(&mut member, bounds, &at, device)?;
        match index.get(key) {
            // Two members of one name: the last wins, as in np.load.
            Some(&slot) => out[slot].1 = tensor,
            None => {
                index.insert(key.to_string(), out.len());
                out.push((key.to_string(), tensor));
            }
        }
    }
    Ok(out)
}

fn check_names(tensors: &[(&str, &Tensor)]) -> Result<()> {
    for (i, (name, _)) in tensors.iter().enumerate() {
        if name.is_empty() {
            return Err(Error::invalid("write_npz", "an array name is empty; give every array a name, e.g. `[(\"x\", &x)]`"));
        }
        if tensors[..i].iter().any(|(n, _)| n == name) {
            return Err(Error::invalid("write_npz", format!("the array name `{name}` appears twice; each member needs its own name")));
        }
    }
    Ok(())
}

/// Writes the archive to `w`.
fn write_archive<W: Write + Seek>(
    w: W,
    tensors: &[(&str, &Tensor)],
    compressed: bool,
    origin: &Origin,
    site: &'static Location<'static>,
) -> Result<W> {
    let mut zip = zip::ZipWriter::new(w);
    let method = if compressed { CompressionMethod::Deflated } else { CompressionMethod::Stored };
    for (name, tensor) in tensors {
        let member = format!("{name}.npy");
        // Zip64 entries only where the 32-bit sizes cannot hold the member.
        let options = zip::write::SimpleFileOptions::default().compression_method(method).large_file(npy_len(tensor) >= u32::MAX as u64);
        zip.start_file(member.as_str(), options).map_err(|e| zip_write_err(origin, e))?;
        write_array(&mut zip, tensor, site, &origin.member(&member))?;
    }
    zip.finish().map_err(|e| zip_write_err(origin, e))
}

fn zip_write_err(origin: &Origin, e: zip::result::ZipError) -> Error {
    match e {
        zip::result::ZipError::Io(e) => origin.io("cannot write the archive", e),
        e => Error::Io { path: origin.path.clone(), msg: format!("cannot write the archive: {e}") },
    }
}

/// Reads every array of an `.npz` file onto `device`, by name (numpy's
/// `np.load` of an `.npz`; the key of member `x.npy` is `x`).
///
/// Members may be stored (`np.savez`) or deflated (`np.savez_compressed`);
/// each is read as [`read_npy`](super::read_npy) reads a file, with the same
/// checks, and a deflated member is inflated only as far as its header's
/// size. A member that is not `<name>.npy` (numpy would hand out its raw
/// bytes; a map of tensors has no place for them), any compression but these two,
/// a corrupt member (CRC mismatch, bad deflate stream) or a zip directory
/// whose sizes disagree with the member are [`Error::Format`] naming the
/// member. Reading onto a GPU books one host-to-device transfer per array
/// at the caller's line.
///
/// ```
/// use kiln::{cpu, io, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-read-npz-{}.npz", std::process::id()));
/// let w = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
/// io::write_npz(&path, &[("w", &w)], false)?;
/// let arrays = io::read_npz(&path, &cpu())?;
/// assert_eq!(arrays["w"].to_vec2::<f32>()?, vec![vec![1., 2.], vec![3., 4.]]);
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn read_npz(path: impl AsRef<Path>, device: &Device) -> Result<HashMap<String, Tensor>> {
    let _site = ledger::site_scope(Location::caller());
    Ok(read_npz_ordered(path, device)?.into_iter().collect())
}

/// [`read_npz`], keeping the archive's order (the order `np.savez` was
/// given the arrays in).
///
/// ```
/// use kiln::{cpu, io, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-read-npz-ordered-{}.npz", std::process::id()));
/// let (b, a) = (Tensor::new(&[1i64], &cpu())?, Tensor::new(&[2i64], &cpu())?);
/// io::write_npz(&path, &[("b", &b), ("a", &a)], true)?;
/// let names: Vec<String> = io::read_npz_ordered(&path, &cpu())?.into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["b", "a"]);
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn read_npz_ordered(path: impl AsRef<Path>, device: &Device) -> Result<Vec<(String, Tensor)>> {
    let _site = ledger::site_scope(Location::caller());
    let path = path.as_ref();
    let origin = Origin::file(path);
    crate::registry::backend(*device)?;
    let file = std::fs::File::open(path).map_err(|e| origin.io("cannot open the .npz file", e))?;
    let len = file.metadata().map_err(|e| origin.io("cannot read the .npz file's size", e))?.len();
    read_archive(BufReader::new(file), len, &origin, device)
}

/// Reads an `.npz` archive held in memory onto `device`, by name; errors
/// name the source `<bytes>`. See [`read_npz`].
///
/// ```
/// use kiln::{cpu, io, Tensor};
/// let x = Tensor::new(&[1u8, 0, 1], &cpu())?;
/// let bytes = io::npz_to_bytes(&[("mask", &x)], false)?;
/// assert_eq!(io::npz_from_bytes(&bytes, &cpu())?["mask"].to_vec::<u8>()?, vec![1, 0, 1]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn npz_from_bytes(bytes: &[u8], device: &Device) -> Result<HashMap<String, Tensor>> {
    let _site = ledger::site_scope(Location::caller());
    Ok(npz_from_bytes_ordered(bytes, device)?.into_iter().collect())
}

/// [`npz_from_bytes`], keeping the archive's order.
///
/// ```
/// use kiln::{cpu, io, Tensor};
/// let x = Tensor::new(&[1f32], &cpu())?;
/// let bytes = io::npz_to_bytes(&[("z", &x), ("y", &x)], true)?;
/// assert_eq!(io::npz_from_bytes_ordered(&bytes, &cpu())?[0].0, "z");
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn npz_from_bytes_ordered(bytes: &[u8], device: &Device) -> Result<Vec<(String, Tensor)>> {
    let _site = ledger::site_scope(Location::caller());
    crate::registry::backend(*device)?;
    read_archive(Cursor::new(bytes), bytes.len() as u64, &Origin::bytes(), device)
}

/// Writes named tensors (from any devices) to an `.npz` file, each as the
/// member `<name>.npy`, deflated when `compressed` (numpy's
/// `np.savez_compressed`) and stored otherwise (`np.savez`). Reading a GPU
/// tensor is a device-to-host transfer booked at the caller's line. Names
/// must be non-empty and distinct ([`Error::InvalidArgument`]); an existing
/// file is replaced, and a write that fails part-way (a refused transfer, a
/// full disk) removes the file.
///
/// ```
/// use kiln::{cpu, io, DType, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-write-npz-{}.npz", std::process::id()));
/// let x = Tensor::zeros((1000,), DType::F32, &cpu())?;
/// io::write_npz(&path, &[("x", &x)], true)?;
/// assert!(std::fs::metadata(&path).unwrap().len() < 1000); // zeros deflate well
/// assert!(io::write_npz(&path, &[("x", &x), ("x", &x)], true).is_err());
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn write_npz(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)], compressed: bool) -> Result<()> {
    let site = Location::caller();
    let _site = ledger::site_scope(site);
    check_names(tensors)?;
    let path = path.as_ref();
    let origin = Origin::file(path);
    let file = std::fs::File::create(path).map_err(|e| origin.io("cannot create the .npz file", e))?;
    let written = write_archive(std::io::BufWriter::new(file), tensors, compressed, &origin, site)
        .and_then(|mut w| w.flush().map_err(|e| origin.io("cannot write the .npz file", e)));
    if written.is_err() {
        // No half-written archive is left behind (a refused transfer, a full disk).
        let _ = std::fs::remove_file(path);
    }
    written
}

/// Named tensors as the bytes of an `.npz` archive. See [`write_npz`].
///
/// ```
/// use kiln::{cpu, io, Tensor};
/// let bytes = io::npz_to_bytes(&[("x", &Tensor::new(&[1f64], &cpu())?)], false)?;
/// assert!(bytes.starts_with(b"PK"));
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn npz_to_bytes(tensors: &[(&str, &Tensor)], compressed: bool) -> Result<Vec<u8>> {
    let site = Location::caller();
    let _site = ledger::site_scope(site);
    check_names(tensors)?;
    Ok(write_archive(Cursor::new(Vec::new()), tensors, compressed, &Origin::bytes(), site)?.into_inner())
}
