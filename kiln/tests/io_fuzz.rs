//! Hostile files for kiln::io: 5,000 seeded corruptions of valid `.npy`,
//! `.npz` and safetensors files (bit flips, truncations, overwritten bytes,
//! lying headers, huge shapes, bad dtypes, lying sizes, counts, offsets and
//! methods in the zip directory, zip bombs honest and lying) must each give
//! a value or an error, never a panic or an abort, and never make the
//! reader hold more memory than the file justifies.
//!
//! Memory is measured by a counting global allocator (this binary's only
//! test, so nothing else allocates meanwhile): the peak of live bytes while
//! one file is read, above what was live before, must stay under
//! `8 × file length + 1 MiB`. A deflated member's honest zeros are allowed
//! their real size on top.
//!
//! `KILN_IO_FUZZ_FILES` (default 5000) and `KILN_IO_FUZZ_SEED` (default 1)
//! change the run.

mod common;

use common::rng::{Draw, XorShift as Rng};

use kiln::{cpu, io, DType, Device, Tensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Counts live heap bytes, their peak and the largest single request.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(now, Relaxed);
        }
        LARGEST.fetch_max(layout.size(), Relaxed);
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let now = LIVE.fetch_add(new_size - layout.size(), Relaxed) + (new_size - layout.size());
                PEAK.fetch_max(now, Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
        }
        LARGEST.fetch_max(new_size, Relaxed);
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The file formats the fuzzer writes and reads back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Npy,
    Npz,
    Safetensors,
}

/// A `.npy` stream with the header `dict` and `data` after it.
fn npy(dict: &str, data: &[u8]) -> Vec<u8> {
    let len = (10 + dict.len() + 1).div_ceil(64) * 64 - 10;
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(len.min(u16::MAX as usize) as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.resize(10 + len - 1, b' ');
    out.push(b'\n');
    out.extend_from_slice(data);
    out
}

const DESCRS: [&str; 24] = [
    "<f4", ">f4", "<f8", ">f8", "<i8", ">i8", "<i4", ">i4", "|u1", "<u1", "|b1", "<f2", ">f2", "<V2", "|V2", "<u2", "|O", "<c16", "<U10",
    "|S3", "<M8[ns]", "", "f", "<V3",
];
const DIMS: [u64; 14] = [0, 1, 2, 3, 7, 255, 4096, 65_536, 1 << 31, (1 << 32) + 1, 1 << 40, 1 << 62, u64::MAX, 3_000_000_000];

fn shape_text(dims: &[u64]) -> String {
    match dims {
        [] => "()".into(),
        [d] => format!("({d},)"),
        _ => format!("({})", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

/// A header that may lie: random descr, order, shape; data of random length.
fn lying_npy(r: &mut Rng) -> Vec<u8> {
    let rank = r.below(5);
    let dims: Vec<u64> = (0..rank).map(|_| if r.below(2) == 0 { r.pick(&DIMS) } else { r.below(6) as u64 }).collect();
    let descr = r.pick(&DESCRS);
    let dict = match r.below(12) {
        0 => format!("{{'descr': [('a', '{descr}')], 'fortran_order': False, 'shape': {}, }}", shape_text(&dims)),
        1 => format!("{{'descr': '{descr}', 'shape': {}, }}", shape_text(&dims)),
        2 => format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': [{}], }}", dims.len()),
        _ => format!(
            "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {}, }}",
            if r.below(2) == 0 { "True" } else { "False" },
            shape_text(&dims)
        ),
    };
    let data_len = match r.below(3) {
        0 => r.below(64),
        1 => r.below(4096),
        _ => dims.iter().try_fold(8u64, |a, &d| a.checked_mul(d)).filter(|&n| n <= 1 << 16).unwrap_or(16) as usize,
    };
    let data: Vec<u8> = (0..data_len).map(|_| r.next() as u8).collect();
    npy(&dict, &data)
}

/// A valid tensor of a random dtype and small shape.
fn tensor(r: &mut Rng) -> Tensor {
    let dtype = r.pick(&[DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16]);
    let rank = r.below(4);
    let dims: Vec<usize> = (0..rank).map(|_| r.below(6)).collect();
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|i| (i % 200) as f64).collect();
    Tensor::from_vec(v, dims, &cpu()).unwrap().to_dtype(dtype).unwrap()
}

/// An archive built by the zip crate, members as given; `zip64` forces the
/// Zip64 extra fields numpy's writer (Python's zipfile) puts in.
fn zip_of(members: &[(String, Vec<u8>)], deflated: bool, zip64: bool) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let method = if deflated { zip::CompressionMethod::Deflated } else { zip::CompressionMethod::Stored };
    for (name, data) in members {
        w.start_file(name.as_str(), zip::write::SimpleFileOptions::default().compression_method(method).large_file(zip64)).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

/// A valid file of `kind`, or a hostile one built whole (lying headers,
/// bombs).
fn base(r: &mut Rng, kind: Kind) -> (Vec<u8>, usize) {
    match kind {
        Kind::Npy => {
            if r.below(3) == 0 {
                (lying_npy(r), 0)
            } else {
                (io::npy_to_bytes(&tensor(r)).unwrap(), 0)
            }
        }
        Kind::Npz => {
            let n = 1 + r.below(3);
            let mut honest_inflation = 0;
            let members: Vec<(String, Vec<u8>)> = (0..n)
                .map(|i| {
                    let bytes = match r.below(8) {
                        0 => lying_npy(r),
                        1 => {
                            // A bomb, honest: zeros that deflate ~1000:1.
                            let len = 1 << (16 + r.below(7));
                            honest_inflation += len;
                            npy(&format!("{{'descr': '|u1', 'fortran_order': False, 'shape': ({len},), }}"), &vec![0; len])
                        }
                        2 => {
                            // A bomb, lying: a small header, zeros far past it.
                            let mut b = io::npy_to_bytes(&tensor(r)).unwrap();
                            b.extend(std::iter::repeat_n(0, 1 << (16 + r.below(7))));
                            b
                        }
                        _ => io::npy_to_bytes(&tensor(r)).unwrap(),
                    };
                    let name = if r.below(30) == 0 { format!("m{i}.txt") } else { format!("m{i}.npy") };
                    (name, bytes)
                })
                .collect();
            (zip_of(&members, r.below(2) == 0, r.below(3) == 0), honest_inflation)
        }
        Kind::Safetensors => {
            let n = 1 + r.below(3);
            let names = ["a", "b.weight", "c"];
            let tensors: Vec<(&str, Tensor)> = (0..n).map(|i| (names[i], tensor(r))).collect();
            let dir = std::env::temp_dir().join(format!("kiln-io-fuzz-st-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("base.safetensors");
            let list: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
            io::save_safetensors(&path, &list).unwrap();
            let mut bytes = std::fs::read(&path).unwrap();
            if r.below(4) == 0 {
                lie_in_safetensors_header(r, &mut bytes);
            }
            (bytes, 0)
        }
    }
}

/// Rewrites the JSON header of a safetensors file with a lying shape,
/// dtype or offsets (and sometimes a lying header length).
fn lie_in_safetensors_header(r: &mut Rng, bytes: &mut Vec<u8>) {
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8_lossy(&bytes[8..8 + len]).into_owned();
    let lie = match r.below(4) {
        0 => header.replacen("\"shape\":[", &format!("\"shape\":[{},", r.pick(&DIMS)), 1),
        1 => header.replacen("\"dtype\":\"", &format!("\"dtype\":\"{}", r.pick(&["X", "BOOL\",\"x\":\"", "F8_E4M3\",\"y\":\"", ""])), 1),
        2 => header.replacen("\"data_offsets\":[", &format!("\"data_offsets\":[{},", r.pick(&DIMS)), 1),
        _ => header.replacen('{', &format!("{{\"__metadata__\":{{\"k\":\"{}\"}},", "v".repeat(r.below(300))), 1),
    };
    let mut out = (lie.len() as u64).to_le_bytes().to_vec();
    if r.below(5) == 0 {
        out = r.pick(&DIMS).to_le_bytes().to_vec();
    }
    out.extend_from_slice(lie.as_bytes());
    out.extend_from_slice(&bytes[8 + len..]);
    *bytes = out;
}

/// Offsets of every occurrence of a zip signature.
fn find_all(bytes: &[u8], sig: &[u8; 4]) -> Vec<usize> {
    bytes.windows(4).enumerate().filter(|(_, w)| w == sig).map(|(i, _)| i).collect()
}

/// Overwrites a field of a zip structure with an interesting value.
fn lie_in_zip(r: &mut Rng, bytes: &mut [u8]) {
    // (signature, field offsets of u16, field offsets of u32)
    let structures: [(&[u8; 4], &[usize], &[usize]); 4] = [
        (b"PK\x05\x06", &[4, 6, 8, 10, 20], &[12, 16]),
        (b"PK\x01\x02", &[8, 10, 28, 30, 32, 34], &[16, 20, 24, 42]),
        (b"PK\x03\x04", &[6, 8, 26, 28], &[14, 18, 22]),
        (b"PK\x06\x06", &[12, 14], &[16, 20, 24, 28, 32, 36, 40, 44, 48, 52]),
    ];
    let (sig, u16s, u32s) = r.pick(&structures);
    let at = find_all(bytes, sig);
    if at.is_empty() {
        return;
    }
    let base = r.pick(&at);
    let values32 = [0u32, 1, 0xFFFF_FFFF, 0x7FFF_FFFF, 0x1000_0000, bytes.len() as u32, r.next() as u32];
    let values16 = [0u16, 1, 0xFFFF, 8, 12, 99, r.next() as u16];
    let (offset, value) = if r.below(2) == 0 && !u16s.is_empty() {
        (r.pick(u16s), r.pick(&values16).to_le_bytes().to_vec())
    } else {
        (r.pick(u32s), r.pick(&values32).to_le_bytes().to_vec())
    };
    if let Some(slot) = bytes.get_mut(base + offset..base + offset + value.len()) {
        slot.copy_from_slice(&value);
    }
}

/// One corruption of a valid or hostile file.
fn corrupt(r: &mut Rng, kind: Kind, bytes: &mut Vec<u8>) -> &'static str {
    if bytes.is_empty() {
        return "empty";
    }
    match r.below(if kind == Kind::Npz { 6 } else { 4 }) {
        0 => {
            for _ in 0..1 + r.below(8) {
                let i = r.below(bytes.len());
                bytes[i] ^= 1 << r.below(8);
            }
            "bit flips"
        }
        1 => {
            let cut = r.below(bytes.len());
            bytes.truncate(cut);
            "truncation"
        }
        2 => {
            let start = r.below(bytes.len());
            let end = (start + 1 + r.below(16)).min(bytes.len());
            for b in &mut bytes[start..end] {
                *b = r.next() as u8;
            }
            "overwritten bytes"
        }
        3 => "as built (possibly lying)",
        _ => {
            lie_in_zip(r, bytes);
            "lying zip directory"
        }
    }
}

fn read(kind: Kind, bytes: &[u8], device: &Device) -> Result<usize, kiln::Error> {
    Ok(match kind {
        Kind::Npy => io::npy_from_bytes(bytes, device)?.elem_count(),
        Kind::Npz => io::npz_from_bytes(bytes, device)?.values().map(|t| t.elem_count()).sum(),
        Kind::Safetensors => {
            // Through a file: the safetensors loader reads paths.
            let path = std::env::temp_dir().join(format!("kiln-io-fuzz-{}.safetensors", std::process::id()));
            std::fs::write(&path, bytes).unwrap();
            io::load_safetensors(&path, device)?.values().map(|t| t.elem_count()).sum()
        }
    })
}

#[test]
fn corrupted_files_give_errors_never_panics_and_bounded_memory() {
    let files: usize = std::env::var("KILN_IO_FUZZ_FILES").ok().and_then(|v| v.parse().ok()).unwrap_or(5000);
    let seed: u64 = std::env::var("KILN_IO_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let gpu = common::sims()[0];
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (mut errors, mut values, mut worst_ratio, mut worst_peak, mut largest) = (0, 0, 0f64, 0usize, 0usize);
    let mut worst = String::new();
    let mut per_kind = std::collections::BTreeMap::new();
    let mut kinds_of_error = std::collections::BTreeMap::new();
    for i in 0..files {
        let kind = [Kind::Npy, Kind::Npz, Kind::Safetensors][i % 3];
        let (mut bytes, honest) = base(&mut r, kind);
        let how = corrupt(&mut r, kind, &mut bytes);
        *per_kind.entry(format!("{kind:?}")).or_insert(0) += 1;
        let device = if i % 10 == 9 { gpu } else { cpu() };
        let before = LIVE.load(Relaxed);
        PEAK.store(before, Relaxed);
        LARGEST.store(0, Relaxed);
        let outcome = std::panic::catch_unwind(|| read(kind, &bytes, &device));
        let peak = PEAK.load(Relaxed).saturating_sub(before);
        let bound = 8 * bytes.len() + (1 << 20) + 2 * honest;
        assert!(
            peak <= bound,
            "file {i} ({kind:?}, {how}, {} bytes, seed {seed}): {peak} bytes held while reading, bound {bound}",
            bytes.len()
        );
        largest = largest.max(LARGEST.load(Relaxed));
        if honest == 0 {
            // The worst that a file without honest zeros made the reader hold.
            let ratio = peak as f64 / bytes.len().max(1) as f64;
            if peak > worst_peak {
                worst_peak = peak;
                worst = format!("{kind:?}, {how}, {} bytes: {} KiB", bytes.len(), peak >> 10);
            }
            worst_ratio = worst_ratio.max(ratio);
        }
        match outcome {
            Err(_) => panic!("file {i} ({kind:?}, {how}, seed {seed}): the reader panicked"),
            Ok(Ok(_)) => values += 1,
            Ok(Err(e)) => {
                errors += 1;
                let variant = format!("{e:?}").split([' ', '{', '(']).next().unwrap_or("").to_string();
                assert!(
                    matches!(e, kiln::Error::Format { .. }),
                    "file {i} ({kind:?}, {how}, seed {seed}): expected a Format error, got {e}"
                );
                *kinds_of_error.entry(variant).or_insert(0) += 1;
            }
        }
    }
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("kiln-io-fuzz-st-{}", std::process::id())));
    let _ = std::fs::remove_file(std::env::temp_dir().join(format!("kiln-io-fuzz-{}.safetensors", std::process::id())));
    println!(
        "io fuzz: {files} files {per_kind:?} (seed {seed}): {errors} errors {kinds_of_error:?}, {values} read whole (a corruption that left them valid), 0 panics; \
         files without honest zeros: most memory held while reading one {worst}, at most {worst_ratio:.1}x a file's size; \
         largest single allocation while reading {} KiB",
        largest >> 10
    );
    assert!(errors > files / 2, "most corrupted files must be refused ({errors} of {files})");
}
