//! Small pieces shared by the subcommands: the one-line error type, a plain
//! text table, and a progress line on stderr that only shows on a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Duration;

/// An error for the user: one line, printed as `kiln: <message>`.
#[derive(Debug)]
pub struct CliError(pub String);

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<kiln::Error> for CliError {
    fn from(e: kiln::Error) -> Self {
        CliError(e.to_string())
    }
}

/// The result type of the subcommands.
pub type Result<T> = std::result::Result<T, CliError>;

/// Builds a [`CliError`] from a format string.
#[macro_export]
macro_rules! fail {
    ($($arg:tt)*) => { $crate::util::CliError(format!($($arg)*)) };
}

/// How a table column is aligned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// Renders rows as a boxed table in the style of `nvidia-smi`.
pub fn table(headers: &[(&str, Align)], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let rule = {
        let mut s = String::from("+");
        for w in &widths {
            s.push_str(&"-".repeat(w + 2));
            s.push('+');
        }
        s
    };
    let line = |cells: Vec<&str>| {
        let mut s = String::from("|");
        for ((cell, w), (_, align)) in cells.iter().zip(&widths).zip(headers) {
            let pad = w - cell.chars().count();
            match align {
                Align::Left => s.push_str(&format!(" {cell}{} |", " ".repeat(pad))),
                Align::Right => s.push_str(&format!(" {}{cell} |", " ".repeat(pad))),
            }
        }
        s
    };
    let mut out = String::new();
    out.push_str(&rule);
    out.push('\n');
    out.push_str(&line(headers.iter().map(|(h, _)| *h).collect()));
    out.push('\n');
    out.push_str(&rule.replace('-', "="));
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out.push_str(&rule);
    out
}

/// A spinner with a message on stderr, drawn only when stderr is a terminal.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A new progress line (hidden when stderr is not a terminal).
    pub fn new() -> Progress {
        let bar = if std::io::stderr().is_terminal() {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            bar.set_style(ProgressStyle::with_template("{spinner} [{elapsed}] {msg}").unwrap_or_else(|_| ProgressStyle::default_spinner()));
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        } else {
            ProgressBar::hidden()
        };
        Progress { bar }
    }

    /// Replaces the message.
    pub fn set(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
    }

    /// Runs `f` with the progress line cleared, so that output does not mix with it.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }

    /// Removes the progress line.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Formats milliseconds with a precision that suits their size.
pub fn fmt_ms(ms: f64) -> String {
    if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else if ms >= 1.0 {
        format!("{ms:.2} ms")
    } else {
        format!("{:.2} us", ms * 1e3)
    }
}

/// Formats a rate with three significant digits.
pub fn fmt_rate(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Checks that `path` can be written (creating it), so that a long run does
/// not fail at its end because of a bad output path.
pub fn check_writable(path: &std::path::Path, what: &str) -> Result<()> {
    if path.as_os_str().is_empty() {
        return Err(fail!("{what}: empty path"));
    }
    if path.is_dir() {
        return Err(fail!("cannot write {what} to {}: it is a directory; give a file name", path.display()));
    }
    if path.exists() {
        // An existing file: opening it for writing (without truncating) proves it can be replaced.
        return std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map(|_| ())
            .map_err(|e| fail!("cannot write {what} to {}: {e}", path.display()));
    }
    // A new file: probe its directory with a temporary file, so that a run
    // that fails later leaves no empty file behind.
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let probe = dir.join(format!(".kiln-write-check-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&probe)
        .map(|_| {
            let _ = std::fs::remove_file(&probe);
        })
        .map_err(|e| fail!("cannot write {what} to {}: {e}", path.display()))
}
