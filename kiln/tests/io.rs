//! kiln::io on every device: `.npy`/`.npz` round trips of every dtype and
//! shape, files written by hand the way other writers write them (big-endian,
//! Fortran order, bool, bf16, header versions 2.0 and 3.0), every kind of
//! malformed file as an error naming what is wrong, transfers booked at the
//! caller's line and refused under a guard, safetensors of any origin as a
//! map by name.

#[macro_use]
mod common;

use half::{bf16, f16};
use kiln::{cpu, io, DType, Device, Direction, Error, GuardLevel, Tensor};
use std::io::Write as _;
use std::path::PathBuf;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-io-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16];

/// Elements of every dtype, floats with NaN, infinities and -0.
fn sample(dtype: DType, dims: &[usize], device: &Device) -> Tensor {
    let n: usize = dims.iter().product();
    let specials = [f64::NAN, f64::INFINITY, -0.0, f64::NEG_INFINITY];
    let v: Vec<f64> = (0..n).map(|i| if dtype.is_float() && i < specials.len() { specials[i] } else { (i % 251) as f64 - 100.0 }).collect();
    let v: Vec<f64> = if dtype == DType::U8 { v.iter().map(|x| x.abs()).collect() } else { v };
    Tensor::from_vec(v, dims, &cpu()).unwrap().to_dtype(dtype).unwrap().to(device).unwrap()
}

/// A tensor's elements as little-endian bytes: compares NaNs by their bits.
fn bits(t: &Tensor) -> Vec<u8> {
    match t.dtype() {
        DType::F32 => t.to_vec::<f32>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F64 => t.to_vec::<f64>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::I64 => t.to_vec::<i64>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::I32 => t.to_vec::<i32>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::U8 => t.to_vec::<u8>().unwrap(),
        DType::F16 => t.to_vec::<f16>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => t.to_vec::<bf16>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

#[track_caller]
fn assert_same(got: &Tensor, want: &Tensor, device: Device) {
    assert_eq!(got.device(), device, "device");
    assert_eq!((got.dtype(), got.dims()), (want.dtype(), want.dims()), "dtype and shape on {device}");
    assert_eq!(bits(got), bits(want), "elements of {} {:?} on {device}", want.dtype(), want.dims());
}

#[track_caller]
fn format_error<T: std::fmt::Debug>(r: kiln::Result<T>, expected: &str) -> String {
    match r {
        Err(Error::Format { msg, path }) => {
            assert!(msg.contains(expected), "expected a message with `{expected}`, got `{msg}` ({path})");
            msg
        }
        other => panic!("expected a Format error with `{expected}`, got {other:?}"),
    }
}

/// A `.npy` stream written by hand: `header` is the dict's text.
fn npy(major: u8, header: &str, data: &[u8]) -> Vec<u8> {
    let pre = if major == 1 { 10 } else { 12 };
    let len = (pre + header.len() + 1).div_ceil(64) * 64 - pre;
    let mut out = b"\x93NUMPY".to_vec();
    out.extend_from_slice(&[major, 0]);
    if major == 1 {
        out.extend_from_slice(&(len as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(len as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    out.resize(pre + len - 1, b' ');
    out.push(b'\n');
    out.extend_from_slice(data);
    out
}

fn dict(descr: &str, fortran: bool, shape: &str) -> String {
    format!("{{'descr': '{descr}', 'fortran_order': {}, 'shape': {shape}, }}", if fortran { "True" } else { "False" })
}

#[test]
fn every_dtype_and_shape_round_trips_on_every_device() {
    let dir = scratch("roundtrip");
    let shapes: [&[usize]; 6] = [&[], &[0], &[2, 0, 3], &[5], &[2, 3, 4], &[1, 1, 1, 1, 2]];
    common::on_every_device(|device| {
        let mut all = Vec::new();
        for dtype in DTYPES {
            for (k, dims) in shapes.iter().enumerate() {
                let t = sample(dtype, dims, &device);
                assert_same(&io::npy_from_bytes(&io::npy_to_bytes(&t)?, &device)?, &t, device);
                let path = dir.join(format!("{dtype}-{k}-{device}.npy"));
                io::write_npy(&path, &t)?;
                assert_same(&io::read_npy(&path, &device)?, &t, device);
                // Onto another device than the one it was written from.
                assert_same(&io::read_npy(&path, &cpu())?, &t.to(&cpu())?, cpu());
                all.push((format!("{dtype}_{k}"), t));
            }
        }
        let list: Vec<(&str, &Tensor)> = all.iter().map(|(n, t)| (n.as_str(), t)).collect();
        for compressed in [false, true] {
            let path = dir.join(format!("all-{compressed}-{device}.npz"));
            io::write_npz(&path, &list, compressed)?;
            let map = io::read_npz(&path, &device)?;
            assert_eq!(map.len(), all.len());
            for (name, t) in &all {
                assert_same(&map[name], t, device);
            }
            let ordered = io::npz_from_bytes_ordered(&io::npz_to_bytes(&list, compressed)?, &device)?;
            assert_eq!(
                ordered.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                all.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
            );
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_written_header_is_numpys() {
    // What numpy 2.4's np.save writes for np.array([1, 2], dtype='<f4').
    let bytes = io::npy_to_bytes(&Tensor::new(&[1f32, 2.], &cpu()).unwrap()).unwrap();
    let mut expected = b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }".to_vec();
    expected.resize(127, b' ');
    expected.push(b'\n');
    expected.extend_from_slice(&1f32.to_le_bytes());
    expected.extend_from_slice(&2f32.to_le_bytes());
    assert_eq!(bytes, expected);
    // bf16 as ml_dtypes' np.save writes it, u8 without a byte order, 0-d.
    let bf = io::npy_to_bytes(&Tensor::ones((), DType::BF16, &cpu()).unwrap()).unwrap();
    assert!(String::from_utf8_lossy(&bf).contains("{'descr': '<V2', 'fortran_order': False, 'shape': (), }"));
    let u = io::npy_to_bytes(&Tensor::zeros((2, 3), DType::U8, &cpu()).unwrap()).unwrap();
    assert!(String::from_utf8_lossy(&u).contains("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3), }"));
}

#[test]
fn a_non_contiguous_tensor_is_written_in_its_logical_order() {
    let t = Tensor::arange(0.0, 6.0, 1.0, &cpu()).unwrap().reshape((2, 3)).unwrap().t().unwrap();
    let back = io::npy_from_bytes(&io::npy_to_bytes(&t).unwrap(), &cpu()).unwrap();
    assert_eq!(back.to_vec2::<f32>().unwrap(), vec![vec![0., 3.], vec![1., 4.], vec![2., 5.]]);
}

#[test]
fn files_other_writers_write_are_read() {
    common::on_every_device(|device| {
        // Big-endian f32, as numpy writes '>f4'.
        let be: Vec<u8> = [1.5f32, -2.0, f32::INFINITY].iter().flat_map(|x| x.to_be_bytes()).collect();
        let t = io::npy_from_bytes(&npy(1, &dict(">f4", false, "(3,)"), &be), &device)?;
        assert_eq!(t.to_vec::<f32>()?, vec![1.5, -2.0, f32::INFINITY]);
        // Big-endian i64 and f64, f16.
        let be: Vec<u8> = [i64::MIN, 7].iter().flat_map(|x| x.to_be_bytes()).collect();
        assert_eq!(io::npy_from_bytes(&npy(1, &dict(">i8", false, "(2,)"), &be), &device)?.to_vec::<i64>()?, vec![i64::MIN, 7]);
        let be: Vec<u8> = [f16::from_f32(0.5)].iter().flat_map(|x| x.to_be_bytes()).collect();
        assert_eq!(io::npy_from_bytes(&npy(1, &dict(">f2", false, "()"), &be), &device)?.to_vec::<f16>()?, vec![f16::from_f32(0.5)]);
        // Fortran order: np.arange(6, dtype='<i4').reshape(2, 3, order='F').
        let f: Vec<u8> = [0i32, 1, 2, 3, 4, 5].iter().flat_map(|x| x.to_le_bytes()).collect();
        let t = io::npy_from_bytes(&npy(1, &dict("<i4", true, "(2, 3)"), &f), &device)?;
        assert_eq!(t.to_vec2::<i32>()?, vec![vec![0, 2, 4], vec![1, 3, 5]]);
        // Fortran order and big-endian at once, rank 3.
        let f: Vec<u8> = (0..24i32).flat_map(|x| x.to_be_bytes()).collect();
        let t = io::npy_from_bytes(&npy(1, &dict(">i4", true, "(2, 3, 4)"), &f), &device)?;
        let v = t.to_vec::<i32>()?;
        for (i, j, k) in (0..2).flat_map(|i| (0..3).flat_map(move |j| (0..4).map(move |k| (i, j, k)))) {
            assert_eq!(v[i * 12 + j * 4 + k], (i + 2 * j + 6 * k) as i32);
        }
        // numpy's bool is read as u8 of 0 and 1.
        let t = io::npy_from_bytes(&npy(1, &dict("|b1", false, "(4,)"), &[0, 1, 2, 255]), &device)?;
        assert_eq!((t.dtype(), t.to_vec::<u8>()?), (DType::U8, vec![0, 1, 1, 1]));
        // bf16: '<V2' from ml_dtypes, '|V2' re-saved by numpy, '>V2' big-endian.
        let one = bf16::from_f32(1.0).to_bits();
        for (descr, data) in [("<V2", one.to_le_bytes()), ("|V2", one.to_le_bytes()), (">V2", one.to_be_bytes())] {
            let t = io::npy_from_bytes(&npy(1, &dict(descr, false, "(1,)"), &data), &device)?;
            assert_eq!(t.to_vec::<bf16>()?, vec![bf16::ONE], "{descr}");
        }
        // Header versions 2.0 and 3.0 (UTF-8), a descr without a byte order,
        // keys in another order with double quotes, Python 2 longs.
        let d: Vec<u8> = [1f64, 2.].iter().flat_map(|x| x.to_le_bytes()).collect();
        for (major, header) in [
            (2, dict("<f8", false, "(2,)")),
            (3, dict("f8", false, "(2L,)")),
            (1, "{\"shape\": (1, 2), \"descr\": \"=f8\", \"fortran_order\": False}".into()),
        ] {
            let t = io::npy_from_bytes(&npy(major, &header, &d), &device)?;
            assert_eq!(t.to_vec::<f64>()?, vec![1., 2.], "version {major}: {header}");
        }
        // A zero-size array with enormous other dimensions holds nothing.
        let t = io::npy_from_bytes(&npy(1, &dict("<f4", false, "(0, 18446744073709551615)"), &[]), &device)?;
        assert_eq!(t.dims(), &[0, usize::MAX]);
        Ok(())
    });
}

#[test]
fn malformed_npy_files_are_errors_that_say_what_is_wrong() {
    let good = npy(1, &dict("<f4", false, "(2, 2)"), &[0; 16]);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (Vec::new(), "not a .npy array"),
        (b"PK\x03\x04 a zip".to_vec(), "not a .npy array"),
        (good[..7].to_vec(), "inside the .npy preamble"),
        (good[..9].to_vec(), "inside the .npy preamble"),
        (good[..40].to_vec(), "the stream holds only 40 bytes"),
        (good[..good.len() - 1].to_vec(), "truncated or lying header"),
        ([good.clone(), vec![0]].concat(), "1 more bytes follow"),
        ([b"\x93NUMPY\x04\x00".to_vec(), good[8..].to_vec()].concat(), "version 4.0"),
        (npy(1, &dict("<u2", false, "(2,)"), &[0; 4]), "`<u2` is not one kiln has"),
        (npy(1, &dict("<c8", false, "(1,)"), &[0; 8]), "`<c8` is not one kiln has"),
        (npy(1, &dict("|O", false, "(1,)"), &[0; 8]), "never unpickles"),
        (npy(1, &dict("<q7", false, "(1,)"), &[0; 8]), "not a numpy type descriptor"),
        (npy(1, &dict("<f4", false, "(1048576, 1048576)"), &[0; 16]), "truncated or lying header"),
        (npy(1, &dict("<f4", false, "(4611686018427387904, 4)"), &[0; 16]), "more bytes than a 64-bit size can count"),
        (npy(1, &dict("<f4", false, "(-1,)"), &[]), "dimension -1"),
        (npy(1, &format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}), }}", "1, ".repeat(65)), &[0; 4]), "65 dimensions"),
        (npy(3, &dict("<f4", false, "(1,)").replace("<f4", "<f\u{e9}"), &[0; 4]), "is not one kiln has"),
        ([b"\x93NUMPY\x03\x00\x06\x00\x00\x00{'a\xff'}".to_vec()].concat(), "not UTF-8 (byte 15)"),
        ([b"\x93NUMPY\x02\x00\xff\xff\xff\x7f".to_vec()].concat(), "the header is 2147483647 bytes long"),
    ];
    for (bytes, expected) in cases {
        format_error(io::npy_from_bytes(&bytes, &cpu()), expected);
    }
    // Files: the path is named; a missing file is an I/O error.
    let dir = scratch("malformed");
    let path = dir.join("short.npy");
    std::fs::write(&path, &good[..good.len() - 3]).unwrap();
    match io::read_npy(&path, &cpu()) {
        Err(Error::Format { path: p, msg }) => {
            assert_eq!(p, path.display().to_string());
            assert!(msg.contains("16 bytes from byte 128, but only 13 bytes follow"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(io::read_npy(dir.join("missing.npy"), &cpu()), Err(Error::Io { .. })));
    assert!(matches!(io::read_npy(&dir, &cpu()), Err(Error::Io { .. })));
    let _ = std::fs::remove_dir_all(&dir);
}

/// An archive written by the zip crate with members exactly as given.
fn zip_of(members: &[(&str, &[u8])], method: zip::CompressionMethod) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (name, data) in members {
        w.start_file(*name, zip::write::SimpleFileOptions::default().compression_method(method)).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

/// Sets the uncompressed size of the first member in the central directory.
fn lie_about_size(mut archive: Vec<u8>, size: u32) -> Vec<u8> {
    let at = archive.windows(4).position(|w| w == b"PK\x01\x02").expect("a central directory");
    archive[at + 24..at + 28].copy_from_slice(&size.to_le_bytes());
    archive
}

#[test]
fn malformed_npz_files_are_errors_that_name_the_member() {
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    let x_npy = io::npy_to_bytes(&x).unwrap();
    let stored = io::npz_to_bytes(&[("x", &x)], false).unwrap();
    let deflated = io::npz_to_bytes(&[("x", &x)], true).unwrap();
    use zip::CompressionMethod::{Deflated, Stored};
    // A CRC that does not match the member's bytes.
    let mut crc = stored.clone();
    let at = crc.windows(4).position(|w| w == b"\x00\x00\x80\x3f").unwrap(); // 1.0f32
    crc[at + 3] ^= 0x40;
    let msg = format_error(io::npz_from_bytes(&crc, &cpu()), "member `x.npy`");
    assert!(msg.contains("checksum") || msg.contains("CRC") || msg.contains("corrupt"), "{msg}");
    // A deflate stream cut short, and one with its bits flipped.
    let mut cut = deflated.clone();
    let at = cut.windows(4).position(|w| w == b"PK\x01\x02").unwrap();
    cut.drain(at - 8..at);
    assert!(matches!(io::npz_from_bytes(&cut, &cpu()), Err(Error::Format { .. })));
    // The zip directory lying about a member's size, stored and deflated.
    format_error(io::npz_from_bytes(&lie_about_size(stored.clone(), 0xFFFF_FFF0), &cpu()), "this stored member is");
    format_error(
        io::npz_from_bytes(&lie_about_size(deflated.clone(), 0xFFFF_FFF0), &cpu()),
        "the zip directory says the member is 4294967280 bytes",
    );
    // A header promising more than deflate can give from so few bytes (a bomb that is not one).
    let bomb = npy(1, &dict("|u1", false, "(1000000000,)"), &[0; 64]);
    format_error(
        io::npz_from_bytes(&lie_about_size(zip_of(&[("x.npy", &bomb)], Deflated), 1_000_000_128), &cpu()),
        "can inflate to at most",
    );
    // A member that inflates past what its header says.
    let long = [x_npy.clone(), vec![0; 1 << 20]].concat();
    format_error(io::npz_from_bytes(&zip_of(&[("x.npy", &long)], Deflated), &cpu()), "the member's header or the directory is wrong");
    let lied = lie_about_size(zip_of(&[("x.npy", &long)], Deflated), x_npy.len() as u32);
    format_error(io::npz_from_bytes(&lied, &cpu()), "more bytes follow");
    // Members that are not arrays; compression numpy does not write; not a zip.
    format_error(io::npz_from_bytes(&zip_of(&[("notes.txt", b"hi")], Stored), &cpu()), "member `notes.txt`: is not a .npy array");
    format_error(io::npz_from_bytes(&zip_of(&[("x.npy", b"not npy")], Stored), &cpu()), "member `x.npy`: not a .npy array");
    format_error(io::npz_from_bytes(b"\x93NUMPY not a zip", &cpu()), "not a readable .npz");
    format_error(io::npz_from_bytes(&stored[..stored.len() / 2], &cpu()), "not a readable .npz");
    // A real bomb is honest: 64 MiB of zeros in about 64 KiB reads as what it is.
    let zeros = npy(1, &dict("|u1", false, "(67108864,)"), &vec![0; 64 << 20]);
    let archive = zip_of(&[("z.npy", &zeros)], Deflated);
    assert!(archive.len() < 1 << 20);
    let z = io::npz_from_bytes(&archive, &cpu()).unwrap();
    assert_eq!(z["z"].dims(), &[64 << 20]);
    // An empty archive is an empty map.
    assert!(io::npz_from_bytes(&zip_of(&[], Stored), &cpu()).unwrap().is_empty());
}

#[test]
fn write_npz_refuses_empty_and_repeated_names() {
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    assert!(matches!(io::npz_to_bytes(&[("", &x)], false), Err(Error::InvalidArgument { .. })));
    match io::npz_to_bytes(&[("a", &x), ("a", &x)], true) {
        Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains("`a` appears twice"), "{msg}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_device_that_does_not_exist_is_refused_before_the_file_is_read() {
    let bytes = io::npy_to_bytes(&Tensor::new(&[1f32], &cpu()).unwrap()).unwrap();
    assert!(matches!(io::npy_from_bytes(&bytes, &kiln::gpu(999)), Err(Error::NoSuchDevice { .. })));
    assert!(matches!(io::read_npy("/no/such/file.npy", &kiln::gpu(999)), Err(Error::NoSuchDevice { .. })));
    assert!(matches!(io::read_npz("/no/such/file.npz", &kiln::gpu(999)), Err(Error::NoSuchDevice { .. })));
    assert!(matches!(io::load_safetensors("/no/such/file.safetensors", &kiln::gpu(999)), Err(Error::NoSuchDevice { .. })));
}

#[test]
fn transfers_are_booked_at_the_callers_line_and_guarded() {
    let gpu = common::sims()[0];
    let dir = scratch("ledger");
    let on_gpu = Tensor::new(&[[1f32, 2.], [3., 4.]], &gpu).unwrap();
    let on_cpu = Tensor::new(&[5i64, 6], &cpu()).unwrap();
    let h2d = Direction::HostToDevice;
    let d2h = Direction::DeviceToHost;

    let before = kiln::thread_transfer_stats();
    let (line, _) = at_line!(io::write_npy(dir.join("g.npy"), &on_gpu).unwrap());
    assert_eq!(common::booked_at(&before, file!(), line, d2h), 1);
    let (line, back) = at_line!(io::read_npy(dir.join("g.npy"), &gpu).unwrap());
    assert_eq!((common::booked_at(&before, file!(), line, h2d), back.device()), (1, gpu));
    let (line, bytes) = at_line!(io::npz_to_bytes(&[("g", &on_gpu), ("c", &on_cpu)], true).unwrap());
    assert_eq!(common::booked_at(&before, file!(), line, d2h), 1, "only the GPU tensor's read is a transfer");
    let (line, map) = at_line!(io::npz_from_bytes(&bytes, &gpu).unwrap());
    assert_eq!((common::booked_at(&before, file!(), line, h2d), map["c"].device()), (2, gpu));
    let (line, _) = at_line!(io::save_safetensors(dir.join("s.safetensors"), &[("g", &on_gpu), ("c", &on_cpu)]).unwrap());
    assert_eq!(common::booked_at(&before, file!(), line, d2h), 1);
    let (line, st) = at_line!(io::load_safetensors(dir.join("s.safetensors"), &gpu).unwrap());
    assert_eq!((common::booked_at(&before, file!(), line, h2d), st["g"].device()), (2, gpu));
    // Reading onto the CPU and writing CPU tensors are no transfers.
    let quiet = kiln::thread_transfer_stats();
    io::read_npy(dir.join("g.npy"), &cpu()).unwrap();
    io::npz_from_bytes(&io::npz_to_bytes(&[("c", &on_cpu)], false).unwrap(), &cpu()).unwrap();
    assert_eq!(kiln::thread_transfer_stats().since(&quiet).total().count, 0);

    // Under a guard: refused, naming this line; no file is left half-written.
    let _guard = kiln::transfer_guard(GuardLevel::Disallow);
    let (line, refused) = at_line!(io::read_npy(dir.join("g.npy"), &gpu));
    match refused {
        Err(Error::TransferDisallowed { location, direction, .. }) => {
            assert_eq!(direction, h2d);
            assert!(location.starts_with(&format!("{}:{line}:", file!())), "{location}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(io::write_npy(dir.join("refused.npy"), &on_gpu), Err(Error::TransferDisallowed { .. })));
    assert!(!dir.join("refused.npy").exists());
    assert!(matches!(
        io::write_npz(dir.join("refused.npz"), &[("c", &on_cpu), ("g", &on_gpu)], false),
        Err(Error::TransferDisallowed { .. })
    ));
    assert!(!dir.join("refused.npz").exists(), "a refused write leaves no half-written archive");
    assert!(matches!(io::npz_from_bytes(&bytes, &gpu), Err(Error::TransferDisallowed { .. })));
    assert!(matches!(io::load_safetensors(dir.join("s.safetensors"), &gpu), Err(Error::TransferDisallowed { .. })));
    assert!(io::read_npy(dir.join("g.npy"), &cpu()).is_ok(), "the CPU needs no transfer");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A safetensors file as another writer makes it: `(name, dtype, shape, bytes)`.
fn safetensors_file(tensors: &[(&str, &str, &[usize], Vec<u8>)], metadata: bool) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut data = Vec::new();
    if metadata {
        entries.push("\"__metadata__\":{\"format\":\"pt\"}".to_string());
    }
    for (name, dtype, shape, bytes) in tensors {
        let (a, b) = (data.len(), data.len() + bytes.len());
        entries.push(format!("\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{a},{b}]}}"));
        data.extend_from_slice(bytes);
    }
    let mut header = format!("{{{}}}", entries.join(",")).into_bytes();
    header.resize(header.len().div_ceil(8) * 8, b' ');
    [(header.len() as u64).to_le_bytes().to_vec(), header, data].concat()
}

#[test]
fn safetensors_of_any_origin_load_as_a_map_by_name() {
    let dir = scratch("safetensors");
    let path = dir.join("model.safetensors");
    let w: Vec<u8> = [1f32, 2., 3., 4.].iter().flat_map(|x| x.to_le_bytes()).collect();
    let ids: Vec<u8> = [7i64, -1].iter().flat_map(|x| x.to_le_bytes()).collect();
    let h: Vec<u8> = [bf16::from_f32(0.5)].iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(
        &path,
        safetensors_file(&[("encoder.weight", "F32", &[2, 2], w), ("ids", "I64", &[2], ids), ("scale", "BF16", &[], h)], true),
    )
    .unwrap();
    common::on_every_device(|device| {
        let map = io::load_safetensors(&path, &device)?;
        assert_eq!(map.len(), 3);
        common::assert_f32(&map["encoder.weight"], device, &[2, 2], &[1., 2., 3., 4.]);
        assert_eq!(map["ids"].to_vec::<i64>()?, vec![7, -1]);
        assert_eq!((map["scale"].dims(), map["scale"].to_vec::<bf16>()?), (&[][..], vec![bf16::from_f32(0.5)]));
        Ok(())
    });
    // A dtype kiln lacks is an error naming the tensor; so is a truncated file.
    std::fs::write(&path, safetensors_file(&[("mask", "BOOL", &[2], vec![1, 0])], false)).unwrap();
    format_error(io::load_safetensors(&path, &cpu()), "tensor `mask` has dtype");
    let good = safetensors_file(&[("x", "F32", &[2], vec![0; 8])], false);
    std::fs::write(&path, &good[..good.len() - 1]).unwrap();
    format_error(io::load_safetensors(&path, &cpu()), "not a valid safetensors file");
    // kiln's own writer; names must be distinct.
    let x = Tensor::new(&[1u8, 2], &cpu()).unwrap();
    io::save_safetensors(&path, &[("a", &x), ("b", &x)]).unwrap();
    assert_eq!(io::load_safetensors(&path, &cpu()).unwrap()["b"].to_vec::<u8>().unwrap(), vec![1, 2]);
    assert!(matches!(io::save_safetensors(&path, &[("a", &x), ("a", &x)]), Err(Error::InvalidArgument { .. })));
    let _ = std::fs::remove_dir_all(&dir);
}
