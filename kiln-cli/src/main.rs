//! The `kiln` command: where people meet the library first.
//!
//! - `kiln tour` (the default): the "GPUs" chapter, step by step, on the devices present.
//! - `kiln devices`: every device with its memory, like `nvidia-smi`.
//! - `kiln bench`: the benchmark workloads and the chapter's exercises.
//! - `kiln train`: train a model on the best device, with a progress bar, plots and checkpoints.

mod bench;
mod devices;
mod plot;
mod tour;
mod train;
mod util;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};
use std::process::ExitCode;
use util::{CliError, Result};

/// kiln: tensors that live on a device, and data that moves only when you say so.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, about, after_help = "With no command, `kiln` runs the tour.")]
struct Cli {
    /// Add simulated GPUs (after any real ones) so that this many exist, e.g. `--sim-gpus 2`
    /// (the same as KILN_SIM_GPUS=2).
    #[arg(long, global = true, value_name = "N", value_parser = clap::value_parser!(u64).range(0..=kiln::MAX_SIM_GPUS as u64))]
    sim_gpus: Option<u64>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Walk through the "GPUs" chapter on the devices present (the default).
    Tour,
    /// List every device kiln can use, with its memory.
    Devices {
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run benchmark workloads (all when none is named).
    Bench(bench::BenchArgs),
    /// Train a model on the best device.
    Train(train::TrainArgs),
}

/// Parses a device name (`cpu`, `gpu`, `gpu(1)`, `gpu:1`, `cuda:1`).
pub fn parse_device(s: &str) -> std::result::Result<kiln::Device, String> {
    s.parse::<kiln::Device>().map_err(|_| format!("`{s}` is not a device; write cpu, gpu(0), gpu:1 or cuda:1"))
}

/// Fails with one line when `device` does not exist on this machine.
pub fn check_device(device: kiln::Device) -> Result<()> {
    kiln::memory_stats(&device).map(|_| ()).map_err(CliError::from)
}

/// The one-line form of a clap error, with its tip when it has one.
fn clap_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("bad arguments").trim_start_matches("error:").trim().to_string();
    let tip = text.lines().map(str::trim).find(|l| l.starts_with("tip:")).map(|t| t.trim_start_matches("tip:").trim().to_string());
    match tip {
        Some(tip) => format!("{first}; {tip} (see `kiln --help`)"),
        None => format!("{first} (see `kiln --help`)"),
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.sim_gpus {
        let n = n as usize;
        let have = kiln::num_gpus();
        if n > have {
            let sims = kiln::devices().iter().filter(|d| d.kind == kiln::DeviceKind::Simulated).count();
            kiln::try_ensure_simulated_gpus(sims + (n - have), kiln::DEFAULT_SIM_GPU_MEMORY)?;
        }
    }
    match cli.command.unwrap_or(Command::Tour) {
        Command::Tour => tour::run(),
        Command::Devices { json } => devices::run(json),
        Command::Bench(args) => bench::run(args),
        Command::Train(args) => train::run(args),
    }
}

#[cfg(unix)]
fn default_sigpipe() {
    // Like other command-line tools, end quietly when the reader of our
    // output goes away (`kiln bench --json | head -1`).
    // SAFETY: restoring the default disposition of a signal is async-signal-safe
    // and done before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(not(unix))]
fn default_sigpipe() {}

fn main() -> ExitCode {
    default_sigpipe();
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown".into());
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        eprintln!("kiln: internal error: {}{at}; please report it", msg.replace('\n', " "));
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    ExitCode::from(e.exit_code().clamp(0, 255) as u8)
                }
                _ => {
                    eprintln!("kiln: {}", clap_line(&e));
                    ExitCode::from(2)
                }
            };
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln: {}", e.0.replace('\n', " "));
            ExitCode::from(1)
        }
    }
}
