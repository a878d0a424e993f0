//! Settings from the environment: every kiln variable is read through
//! these, so a malformed value is reported the same way everywhere; and the
//! parsers of what a user writes for a setting (a size, a device).

use crate::base::device::Device;
use crate::base::error::{Error, Result};

/// Reads a setting from the environment. A malformed value is ignored with
/// one line on stderr that names the variable, the value and what was
/// expected, the same way for every kiln setting (once per variable and
/// value in a process, however often it is read); unset or blank is `None`.
pub(crate) fn env_setting<T>(name: &str, expected: &str, parse: impl Fn(&str) -> Option<T>) -> Option<T> {
    let raw = std::env::var_os(name)?;
    let text = raw.to_string_lossy();
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return None;
    }
    let parsed = parse(trimmed);
    if parsed.is_none() {
        static WARNED: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());
        let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
        let key = (name.to_string(), text.to_string());
        if !warned.contains(&key) {
            eprintln!("kiln: ignoring {name}={text:?}: expected {expected}");
            warned.push(key);
        }
    }
    parsed
}

/// What a boolean setting accepts, as the warning for a malformed one says.
const FLAG_EXPECTED: &str = "1 or 0 (also true/false, yes/no, on/off)";

/// Parses a boolean setting: `1`, `true`, `yes`, `on` or `0`, `false`, `no`,
/// `off`, in any case.
fn parse_flag(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Reads a boolean setting from the environment, the way kiln reads all of
/// its flags (`KILN_DISABLE_CUDA`, `KILN_CUDA_TF32`, `KILN_NO_KERNEL_CACHE`,
/// and the `kiln` command's `KILN_BENCH_QUICK`): `1`/`true`/`yes`/`on` or
/// `0`/`false`/`no`/`off` in any case; unset or blank is `None`. Anything
/// else is ignored (`None`) with the one warning line every malformed kiln
/// setting gives, `kiln: ignoring NAME="value": expected ...`, printed once
/// per process.
///
/// ```
/// // Unset (and blank) settings are None.
/// assert_eq!(kiln::env_flag("KILN_DOCTEST_FLAG_THAT_IS_NEVER_SET"), None);
/// ```
pub fn env_flag(name: &str) -> Option<bool> {
    env_setting(name, FLAG_EXPECTED, parse_flag)
}

/// Parses sizes like `2GiB`, `512MiB`, `1.5GB` or a plain byte count.
///
/// ```
/// assert_eq!(kiln::parse_bytes("2GiB")?, 2 << 30);
/// assert_eq!(kiln::parse_bytes("512")?, 512);
/// assert!(kiln::parse_bytes("lots").is_err());
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn parse_bytes(text: &str) -> Result<usize> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| Error::invalid("parse_bytes", format!("`{text}` is not a size; write e.g. `2GiB`, `512MiB` or `1000000`")))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        other => {
            return Err(Error::invalid("parse_bytes", format!("unknown unit `{other}` in `{text}`; use B, KiB, MiB, GiB, KB, MB or GB")));
        }
    };
    Ok((value * scale) as usize)
}

impl std::str::FromStr for Device {
    type Err = Error;
    /// Parses `cpu`, `gpu`, `gpu(1)`, `gpu:1`, `cuda:1`, and TensorFlow's `/CPU:0`,
    /// `/GPU:1`, `/device:GPU:1`.
    fn from_str(s: &str) -> Result<Device> {
        let t = s.trim().to_ascii_lowercase();
        // TensorFlow's `/CPU:0`, `/GPU:1` and `/device:GPU:1` name the same devices.
        let t = t.strip_prefix('/').unwrap_or(&t);
        let t = t.strip_prefix("device:").unwrap_or(t);
        if matches!(t, "cpu" | "cpu:0" | "cpu(0)") {
            return Ok(Device::Cpu);
        }
        for prefix in ["gpu", "cuda"] {
            if let Some(rest) = t.strip_prefix(prefix) {
                let rest = rest.trim_start_matches([':', '(']).trim_end_matches(')');
                if rest.is_empty() {
                    return Ok(Device::Gpu(0));
                }
                if let Ok(i) = rest.parse() {
                    return Ok(Device::Gpu(i));
                }
            }
        }
        Err(Error::invalid("device", format!("`{s}` is not a device; write `cpu`, `gpu`, `gpu(1)` or `gpu:1`")))
    }
}

#[cfg(test)]
mod flag_tests {
    use super::parse_flag;

    #[test]
    fn flags_parse_in_every_accepted_spelling_and_nothing_else() {
        for v in ["1", "true", "TRUE", "Yes", "on"] {
            assert_eq!(parse_flag(v), Some(true), "{v}");
        }
        for v in ["0", "false", "False", "NO", "off"] {
            assert_eq!(parse_flag(v), Some(false), "{v}");
        }
        for v in ["2", "enable", "y", "t", "-1", "1.0", "tru"] {
            assert_eq!(parse_flag(v), None, "{v}");
        }
    }
}
