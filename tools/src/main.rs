//! `prep`: convert a Hugging Face checkpoint into one `.nflash` pack, and
//! inspect or verify packs.

mod checkpoint;
mod convert;
mod forward;
mod gguf;
mod histogram;
mod inspect;
mod output;
mod pack;
mod plot;
mod predictor;
mod profile;
mod progress;
mod quality;
mod sparsify;
mod synth;
mod upgrade;
mod verify;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use nflash_runtime::args::{join_dash_values, OptionSpec};
use nflash_runtime::message;

/// Prepare models for nflash: convert Hugging Face checkpoints into
/// flash-friendly `.nflash` packs.
#[derive(Parser)]
#[command(name = "prep", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert a Hugging Face checkpoint directory or a GGUF file into a .nflash pack.
    Convert(convert::ConvertArgs),
    /// Print a pack's header, config, segments and tensor types.
    Inspect(inspect::InspectArgs),
    /// Check every checksum of packs; with --quality, measure sparse vs dense quality.
    Verify(verify::VerifyArgs),
    /// Rewrite a pack of format 3.2 or 3.3 as the current format, adding neuron-cluster checksums
    /// (no checkpoint needed; the file is read and written once).
    Upgrade(upgrade::UpgradeArgs),
    /// Profile FFN neuron activity on calibration text.
    Profile(profile::ProfileArgs),
    /// Write a synthetic Hugging Face checkpoint (llama-7b, mistral-7b, tiny; mixtures of experts mixtral-47b, qwen3-30b-a3b, tiny-moe) with
    /// controlled FFN activation sparsity and hot-neuron skew.
    Synth(synth::SynthArgs),
}

/// The pack (or synthetic checkpoint directory) being written, if any:
/// removed when prep is interrupted, so Ctrl-C never leaves a partial output behind.
pub static IN_PROGRESS: std::sync::Mutex<Option<std::path::PathBuf>> = std::sync::Mutex::new(None);

/// Keeps large freed blocks (activations, gradients of predictor training,
/// weight matrices) in the heap instead of returning them to the kernel after
/// every use: otherwise each reuse page-faults and zeroes them again, which
/// took about a quarter of predictor training time at 7B (perf).
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc malloc parameters; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// Parses the command line, an option's value that begins with a dash
/// joined to its option first ([`nflash_runtime::args::join_dash_values`]).
fn parse_cli() -> Cli {
    let cmd = Cli::command();
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // The subcommand's options (the first word that names one), and the top level's.
    let sub = args.iter().skip(1).find_map(|a| a.to_str().and_then(|a| cmd.find_subcommand(a)));
    fn spec(a: &clap::Arg) -> OptionSpec<'_> {
        OptionSpec { long: a.get_long(), short: a.get_short(), takes_value: a.get_action().takes_values() }
    }
    let opts: Vec<OptionSpec> =
        cmd.get_arguments().chain(sub.into_iter().flat_map(|s| s.get_arguments())).map(spec).collect();
    let args = join_dash_values(args, &opts);
    Cli::from_arg_matches(&cmd.get_matches_from(args)).unwrap_or_else(|e| e.exit())
}

fn main() {
    tune_allocator();
    let cli = parse_cli();
    let _ = ctrlc::set_handler(|| {
        // The lock is held until exit: the main thread cannot rename the
        // output into place (it takes the lock first) while it is removed.
        let guard = IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = guard.clone() {
            // The main thread may still be creating files in a directory: retry until it is gone.
            for _ in 0..100 {
                let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
                if p.symlink_metadata().is_err() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            // message!, not eprintln!, which panics when stderr is a closed
            // pipe (the parent that read it was killed first): a panic here
            // would end this thread and leave prep running without its handler.
            if p.symlink_metadata().is_err() {
                message!("\ninterrupted: removed the partial {}", p.display());
            } else {
                message!("\ninterrupted: could not remove the partial {}; delete it", p.display());
            }
        } else {
            message!("\ninterrupted");
        }
        std::process::exit(130);
    });
    if matches!(cli.command, Command::Inspect(_) | Command::Verify(_)) {
        // Read-only commands: `prep inspect … | head` ends quietly when the
        // reader exits instead of panicking on the closed pipe. (Commands that
        // write files keep Rust's default, so a closed pipe cannot stop them
        // before they remove their temporary output.)
        // SAFETY: installs the default action (no handler code runs), before
        // any work starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.command {
        Command::Convert(a) => convert::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Verify(a) => verify::run(a),
        Command::Upgrade(a) => upgrade::run(a),
        Command::Profile(a) => profile::run(a),
        Command::Synth(a) => synth::run(a),
    };
    if let Err(e) = result {
        message!("error: {e:#}");
        std::process::exit(1);
    }
}
