//! `.npy`/`.npz` checked against numpy itself, both ways
//! (`scripts/io_numpy.py`): numpy writes every dtype kiln has (and its
//! bool), both byte orders, C and Fortran order, 0-d and empty arrays,
//! header versions 1.0/2.0/3.0, `np.savez` and `np.savez_compressed`, and
//! kiln reads them on every device (the CPU, a simulated GPU, CUDA when
//! present), comparing every byte; then kiln writes the same kinds of
//! arrays, from the CPU and from a GPU, and numpy reads and compares them.
//!
//! Runs when a Python with numpy is found (`$KILN_NUMPY_PYTHON`, else
//! `python3`); otherwise the tests are reported ignored with the reason, and
//! fail with `KILN_REQUIRE_NUMPY=1` (CI: `.ci/differential.sh`, which also
//! installs `ml_dtypes` for numpy's bfloat16).

#[macro_use]
mod common;

use common::Ran;
use half::{bf16, f16};
use kiln::{cpu, io, DType, Device, Tensor};
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> std::process::ExitCode {
    common::run_suite(trials![numpy_writes_kiln_reads, kiln_writes_numpy_reads])
}

fn python() -> std::result::Result<String, common::Skip> {
    let candidate = std::env::var("KILN_NUMPY_PYTHON").unwrap_or_else(|_| "python3".into());
    if Command::new(&candidate).args(["-c", "import numpy"]).output().is_ok_and(|o| o.status.success()) {
        return Ok(candidate);
    }
    let why = "no Python with numpy (set KILN_NUMPY_PYTHON, or run .ci/differential.sh)";
    assert!(!common::required("KILN_REQUIRE_NUMPY"), "KILN_REQUIRE_NUMPY=1 but {why}");
    Err(common::skip(why))
}

fn script(py: &str, verb: &str, dir: &Path) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/io_numpy.py");
    let out = Command::new(py).arg(script).arg(verb).arg(dir).output().expect("run scripts/io_numpy.py");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "io_numpy.py {verb} failed:\n{text}");
    text
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-io-numpy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn dtype(name: &str) -> DType {
    match name {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "i64" => DType::I64,
        "i32" => DType::I32,
        "u8" => DType::U8,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => panic!("unknown dtype {other} in the manifest"),
    }
}

/// A tensor's elements as little-endian bytes in row-major order: what the
/// `.raw` files hold.
fn le_bytes(t: &Tensor) -> Vec<u8> {
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

fn dims(shape: &str) -> Vec<usize> {
    shape.split(',').filter(|s| !s.is_empty()).map(|s| s.parse().unwrap()).collect()
}

#[track_caller]
fn assert_same(t: &Tensor, device: Device, dtype_name: &str, shape: &str, raw: &Path, what: &str) {
    assert_eq!(t.device(), device, "{what}: device");
    assert_eq!(t.dtype(), dtype(dtype_name), "{what} on {device}: dtype");
    assert_eq!(t.dims(), dims(shape).as_slice(), "{what} on {device}: shape");
    let want = std::fs::read(raw).unwrap();
    assert!(le_bytes(t) == want, "{what} on {device}: the elements differ from numpy's");
}

fn numpy_writes_kiln_reads() -> Ran {
    let py = python()?;
    let dir = scratch("read");
    eprintln!("{}", script(&py, "write", &dir).trim());
    let manifest = std::fs::read_to_string(dir.join("manifest.txt")).unwrap();
    let mut arrays = 0;
    for device in common::devices() {
        for line in manifest.lines() {
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["npy", file, dt, shape] => {
                    let path = dir.join(file);
                    let t = io::read_npy(&path, &device).unwrap_or_else(|e| panic!("{file} on {device}: {e}"));
                    assert_same(&t, device, dt, shape, &dir.join(format!("{file}.raw")), file);
                    let from_bytes = io::npy_from_bytes(&std::fs::read(&path).unwrap(), &device).unwrap();
                    assert_same(&from_bytes, device, dt, shape, &dir.join(format!("{file}.raw")), file);
                }
                ["npz", file, member, dt, shape] => {
                    let all = io::read_npz(dir.join(file), &device).unwrap_or_else(|e| panic!("{file} on {device}: {e}"));
                    let t = all.get(*member).unwrap_or_else(|| panic!("{file} has no `{member}`: {:?}", all.keys()));
                    assert_same(t, device, dt, shape, &dir.join(format!("{file}.{member}.raw")), &format!("{file}[{member}]"));
                }
                _ => panic!("bad manifest line {line}"),
            }
            arrays += 1;
        }
        common::report_ran(device);
    }
    // The archives' order is the order numpy was given the arrays in.
    let first_member = manifest.lines().find(|l| l.starts_with("npz stored.npz ")).unwrap().split(' ').nth(2).unwrap();
    assert_eq!(io::read_npz_ordered(dir.join("stored.npz"), &cpu()).unwrap()[0].0, first_member);
    eprintln!("kiln read {arrays} numpy arrays exactly (all devices)");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Arrays of `dtype` with the dtype's extremes and, for floats, NaN,
/// infinities and -0.
fn sample(dtype: DType, dims: &[usize], device: &Device) -> Tensor {
    let n: usize = dims.iter().product();
    let t = match dtype {
        DType::I64 => {
            let v: Vec<i64> = (0..n as i64).map(|i| [i64::MIN, i64::MAX, -1][i as usize % 3].wrapping_add(i * 7919)).collect();
            Tensor::from_vec(v, dims, &cpu())
        }
        DType::I32 => {
            let v: Vec<i32> = (0..n as i32).map(|i| [i32::MIN, i32::MAX, -1][i as usize % 3].wrapping_add(i * 7919)).collect();
            Tensor::from_vec(v, dims, &cpu())
        }
        DType::U8 => Tensor::from_vec((0..n).map(|i| (i * 37 % 256) as u8).collect::<Vec<_>>(), dims, &cpu()),
        _ => {
            let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 1e-30];
            let v: Vec<f64> = (0..n).map(|i| if i < specials.len() { specials[i] } else { (i as f64 - 7.25) * 3.5 }).collect();
            Tensor::from_vec(v, dims, &cpu()).and_then(|t| t.to_dtype(dtype))
        }
    };
    t.and_then(|t| t.to(device)).unwrap()
}

fn kiln_writes_numpy_reads() -> Ran {
    let py = python()?;
    let dir = scratch("write");
    let gpu = common::sims()[0];
    let dtypes = [
        (DType::F32, "f32"),
        (DType::F64, "f64"),
        (DType::I64, "i64"),
        (DType::I32, "i32"),
        (DType::U8, "u8"),
        (DType::F16, "f16"),
        (DType::BF16, "bf16"),
    ];
    let mut manifest = String::new();
    let mut members: Vec<(String, Tensor)> = Vec::new();
    for (dtype, name) in dtypes {
        for (sname, dims) in [("3d", vec![2usize, 3, 4]), ("0d", vec![]), ("empty", vec![0, 3]), ("1d", vec![5])] {
            for device in [cpu(), gpu] {
                let t = sample(dtype, &dims, &device);
                let file = format!("{name}_{sname}_{}.npy", if device == cpu() { "cpu" } else { "gpu" });
                io::write_npy(dir.join(&file), &t).unwrap();
                std::fs::write(dir.join(format!("{file}.raw")), le_bytes(&t)).unwrap();
                let shape: Vec<String> = t.dims().iter().map(|d| d.to_string()).collect();
                manifest += &format!("npy {file} {name} {}\n", shape.join(","));
                // A transposed view is written in its logical (row-major) order.
                if dims.len() == 3 {
                    let view = t.transpose(0, 2).unwrap();
                    assert!(!view.is_contiguous());
                    let file = file.replace(".npy", "_transposed.npy");
                    std::fs::write(dir.join(&file), io::npy_to_bytes(&view).unwrap()).unwrap();
                    std::fs::write(dir.join(format!("{file}.raw")), le_bytes(&view)).unwrap();
                    manifest += &format!("npy {file} {name} 4,3,2\n");
                }
                if device == gpu {
                    members.push((format!("{name}_{sname}"), t));
                }
            }
        }
    }
    for (archive, compressed) in [("stored.npz", false), ("deflated.npz", true)] {
        let list: Vec<(&str, &Tensor)> = members.iter().map(|(n, t)| (n.as_str(), t)).collect();
        io::write_npz(dir.join(archive), &list, compressed).unwrap();
        for (member, t) in &members {
            std::fs::write(dir.join(format!("{archive}.{member}.raw")), le_bytes(t)).unwrap();
            let shape: Vec<String> = t.dims().iter().map(|d| d.to_string()).collect();
            let dt = dtypes.iter().find(|(d, _)| *d == t.dtype()).unwrap().1;
            manifest += &format!("npz {archive} {member} {dt} {}\n", shape.join(","));
        }
    }
    std::fs::write(dir.join("manifest.txt"), manifest).unwrap();
    eprintln!("{}", script(&py, "check", &dir).trim());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
