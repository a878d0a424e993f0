//! Which CUDA C++ source each image came from.
//!
//! A GPU driver runs the cubin or PTX it is given; the simulator cannot, so
//! it runs the *source* NVRTC compiled into that image, compiled again for
//! the host. The NVRTC pass-through (`nvrtc.rs`) records, for every image it
//! hands out, the program's source and the options that change its meaning
//! (`-D`, `-U`, `-std`); `cuModuleLoadData` looks the image up here.
//!
//! Records are also kept on disk (`<cache>/images-1/<hash of the image>.src`),
//! because kiln caches NVRTC's output on disk itself: a process that finds
//! its cubins in kiln's cache never calls NVRTC, yet must find their source.
//! `scripts/cudasim.sh` points kiln's cache inside the simulator's, so that
//! the two are cleared together.

use crate::{lock, log};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// One NVRTC program as the host compiler needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    /// The program's name (`nvrtcCreateProgram`), used in g++'s messages.
    pub name: String,
    /// The CUDA C++ text, exactly as given to NVRTC.
    pub text: Vec<u8>,
    /// NVRTC options that mean the same to g++ (`-DX=1`, `-UX`, `-std=c++20`),
    /// passed after the simulator's own flags.
    pub host_options: Vec<String>,
    /// How many headers were given to `nvrtcCreateProgram`: the simulator
    /// compiles self-contained sources only, and says so.
    pub headers: usize,
}

/// A 128-bit hash in the manner of FNV-1a, eight bytes a step (images are
/// megabytes, and every module load hashes one) with the high half folded
/// back after each multiply so that every input bit reaches every output
/// bit. Our own, rather than std's, because its values name files on disk and
/// must not change with the toolchain. Each part is followed by a separator
/// so that ("ab", "c") and ("a", "bc") differ.
pub(crate) fn fnv128(parts: &[&[u8]]) -> u128 {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    let step = |h: &mut u128, v: u64| {
        *h ^= v as u128;
        *h = h.wrapping_mul(PRIME);
        *h ^= *h >> 64;
    };
    for p in parts {
        let mut words = p.chunks_exact(8);
        for w in &mut words {
            step(&mut h, u64::from_le_bytes(w.try_into().unwrap_or([0; 8])));
        }
        for &b in words.remainder() {
            step(&mut h, b as u64);
        }
        step(&mut h, 0x1_0000_0000 | p.len() as u64);
    }
    h
}

/// The key of an image: its bytes without trailing NULs, so that NVRTC's
/// NUL-terminated PTX buffer and the C string the driver reads agree.
pub(crate) fn image_key(image: &[u8]) -> u128 {
    let end = image.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    fnv128(&[&image[..end]])
}

/// Bytes spanned by a 64-bit little-endian ELF from its header alone (the
/// furthest of its section and program header tables, which NVRTC's cubins
/// place last), or None when `header` is not that of a CUDA ELF or claims an
/// implausible size. The driver is given a bare pointer, so this is all
/// there is to know a cubin's length by.
pub(crate) fn elf_extent(header: &[u8]) -> Option<usize> {
    const EM_CUDA: u16 = 190;
    const MAX: u64 = 1 << 30;
    if header.len() < 64 || &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| u16::from_le_bytes([header[o], header[o + 1]]) as u64;
    let u64_at = |o: usize| u64::from_le_bytes(header[o..o + 8].try_into().unwrap_or([0; 8]));
    if u16_at(0x12) as u16 != EM_CUDA {
        return None;
    }
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3A), u16_at(0x3C));
    let ends = [phoff.checked_add(phentsize * phnum)?, shoff.checked_add(shentsize * shnum)?];
    let end = ends.into_iter().max()?.max(64);
    (end <= MAX).then_some(end as usize)
}

/// The folder of the records, named for the way images are keyed. Kiln's
/// own cache of images must move when this does, or the images it holds
/// would have no record: `scripts/cudasim.sh` puts kiln's cache in
/// `kiln-<the same number>`. Bump both when `image_key` or `fnv128` changes
/// (a test pins their values).
pub(crate) const RECORDS: &str = "images-1";

fn records() -> &'static Mutex<HashMap<u128, Arc<Source>>> {
    static R: OnceLock<Mutex<HashMap<u128, Arc<Source>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

fn record_path(dir: &Path, key: u128) -> PathBuf {
    dir.join(RECORDS).join(format!("{key:032x}.src"))
}

/// Remembers that NVRTC made `image` from `source`, in memory and (best
/// effort: a read-only or full disk only costs a later process the record)
/// on disk.
pub(crate) fn remember(image: &[u8], source: Arc<Source>) {
    let key = image_key(image);
    let known = lock(records()).insert(key, source.clone()).is_some_and(|old| *old == *source);
    if known {
        return;
    }
    let path = record_path(&crate::hostcc::cache_dir(), key);
    if path.exists() {
        return;
    }
    if let Err(e) = write_atomically(&path, &encode(&source)) {
        log(&format!(
            "cannot record the source of an NVRTC image at {} ({e}); a later process that loads it from kiln's cache will not find it",
            path.display()
        ));
    }
}

/// The source NVRTC compiled into `image`, from this process's records or
/// the disk's.
pub(crate) fn source_of(image: &[u8]) -> Option<Arc<Source>> {
    let key = image_key(image);
    if let Some(s) = lock(records()).get(&key) {
        return Some(s.clone());
    }
    let path = record_path(&crate::hostcc::cache_dir(), key);
    let bytes = std::fs::read(&path).ok()?;
    match decode(&bytes) {
        Ok(s) => {
            let s = Arc::new(s);
            lock(records()).insert(key, s.clone());
            Some(s)
        }
        Err(e) => {
            log(&format!("ignoring the damaged source record {} ({e})", path.display()));
            None
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same folder and
/// a rename, so that a concurrent reader sees the whole file or none.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static SERIAL: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().ok_or_else(|| std::io::Error::other("no parent folder"))?;
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), SERIAL.fetch_add(1, Ordering::Relaxed)));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

const MAGIC: &str = "kiln-cudasim source v1\n";

/// `MAGIC`, then `name`, `option` (one per host option), `headers` lines,
/// then `text <length>` and the source's bytes.
fn encode(s: &Source) -> Vec<u8> {
    let mut out = String::from(MAGIC);
    out.push_str(&format!("name {}\n", s.name.replace('\n', " ")));
    for o in &s.host_options {
        out.push_str(&format!("option {}\n", o.replace('\n', " ")));
    }
    out.push_str(&format!("headers {}\ntext {}\n", s.headers, s.text.len()));
    let mut out = out.into_bytes();
    out.extend_from_slice(&s.text);
    out
}

fn decode(bytes: &[u8]) -> Result<Source, String> {
    let mut rest = bytes.strip_prefix(MAGIC.as_bytes()).ok_or("not a source record of this version")?;
    let mut source = Source { name: String::new(), text: Vec::new(), host_options: Vec::new(), headers: 0 };
    loop {
        let eol = rest.iter().position(|&b| b == b'\n').ok_or("truncated")?;
        let line = std::str::from_utf8(&rest[..eol]).map_err(|_| "a header line is not UTF-8")?;
        rest = &rest[eol + 1..];
        let (field, value) = line.split_once(' ').unwrap_or((line, ""));
        match field {
            "name" => source.name = value.to_string(),
            "option" => source.host_options.push(value.to_string()),
            "headers" => source.headers = value.parse().map_err(|_| "bad header count")?,
            "text" => {
                let len: usize = value.parse().map_err(|_| "bad text length")?;
                if rest.len() != len {
                    return Err(format!("the text is {} bytes, not {len}", rest.len()));
                }
                source.text = rest.to_vec();
                return Ok(source);
            }
            _ => return Err(format!("unknown field `{field}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Source {
        Source {
            name: "kiln_copy.cu".into(),
            text: b"extern \"C\" __global__ void k(int* p) { p[0] = 1; }\n\0odd bytes\xff".to_vec(),
            host_options: vec!["-DX=1".into(), "-std=c++20".into()],
            headers: 0,
        }
    }

    #[test]
    fn records_round_trip_and_damage_is_refused() {
        let s = sample();
        let bytes = encode(&s);
        assert_eq!(decode(&bytes).unwrap(), s);
        assert!(decode(&bytes[..bytes.len() - 1]).is_err(), "a truncated record");
        assert!(decode(b"something else").is_err());
        assert!(decode(&[]).is_err());
        let mut extra = bytes.clone();
        extra.push(b'x');
        assert!(decode(&extra).is_err(), "a record with trailing bytes");
        let mut bad = bytes;
        bad[MAGIC.len()] = b'X';
        assert!(decode(&bad).is_err(), "an unknown field");
    }

    #[test]
    fn image_keys_ignore_trailing_nuls_only() {
        assert_eq!(image_key(b".version 8.0\0"), image_key(b".version 8.0"));
        assert_eq!(image_key(b"abc\0\0\0"), image_key(b"abc"));
        assert_ne!(image_key(b"abc"), image_key(b"abd"));
        assert_ne!(fnv128(&[b"ab", b"c"]), fnv128(&[b"a", b"bc"]));
    }

    #[test]
    fn image_keys_are_what_the_records_on_disk_were_written_with() {
        // Changing these values orphans every image in kiln's cache: bump
        // RECORDS and the `kiln-N` of scripts/cudasim.sh with them.
        assert_eq!(format!("{:032x}", image_key(b"kiln\0")), "76245ecfc18e1daf38cd6a089184e512");
        assert_eq!(format!("{:032x}", fnv128(&[b"0123456789abcdef", b"x"])), "9470993aeba5a20962297d91c25f1e2f");
        assert_eq!(RECORDS, "images-1");
    }

    #[test]
    fn elf_extent_reads_only_a_plausible_cuda_header() {
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = 2;
        h[5] = 1;
        h[0x12..0x14].copy_from_slice(&190u16.to_le_bytes());
        h[0x20..0x28].copy_from_slice(&1000u64.to_le_bytes()); // phoff
        h[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        h[0x38..0x3A].copy_from_slice(&3u16.to_le_bytes());
        h[0x28..0x30].copy_from_slice(&500u64.to_le_bytes()); // shoff
        h[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        h[0x3C..0x3E].copy_from_slice(&4u16.to_le_bytes());
        assert_eq!(elf_extent(&h), Some(1000 + 3 * 56));
        let mut x86 = h.clone();
        x86[0x12] = 62;
        assert_eq!(elf_extent(&x86), None, "not a CUDA ELF");
        let mut huge = h.clone();
        huge[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(elf_extent(&huge), None, "an offset that overflows");
        assert_eq!(elf_extent(&h[..32]), None);
        assert_eq!(elf_extent(b"not an elf at all, but long enough to be read as a header......."), None);
    }
}
