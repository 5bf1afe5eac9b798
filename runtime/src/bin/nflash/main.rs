//! `nflash`: run a `.nflash` pack on this device.

mod common;
mod memory;
mod plan_sim;
mod ppl;
mod probe;
mod run;
mod sampling;
mod serve;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use nflash_runtime::args::{join_dash_values, OptionSpec};
use nflash_runtime::message;

/// Run large language models packed by `prep` from a single `.nflash` file.
#[derive(Parser)]
#[command(
    name = "nflash",
    version,
    about,
    long_about = None,
    after_help = "Environment: NFLASH_KERNELS=portable runs the portable kernels instead of the CPU's SIMD ones (the same results, slower: for ruling the SIMD kernels out)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, or chat interactively when no prompt is given.
    Run(run::RunArgs),
    /// Serve the model to apps over HTTP: OpenAI-compatible chat and text completions, streaming
    Serve(serve::ServeArgs),
    /// Measure perplexity of the model on a text file.
    Ppl(ppl::PplArgs),
    /// Measure this device (flash read bandwidth, memory bandwidth, Q4_0 matvec and sparse FFN speeds) and write a device profile
    Probe(probe::ProbeArgs),
    /// Predict decode tokens/s of a pack or a model shape (llama-7b … gemma3-4b: see its --help) on a device profile
    PlanSim(plan_sim::PlanSimArgs),
}

/// Keeps large freed blocks (prefill scratch, dequantized weight tiles) in
/// the heap instead of returning them to the kernel after every layer, which
/// would make each reuse page-fault and zero the pages again.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc malloc parameters; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// Restores the default SIGPIPE action, so that `nflash plan-sim … | head`
/// ends quietly when the reader exits (Rust ignores SIGPIPE, and printing
/// to the closed pipe would panic). nflash writes files only through
/// temporary names, so being stopped by it leaves no half file (all but
/// `nflash probe`, see `main`).
fn default_sigpipe() {
    // SAFETY: installs the default action (no handler code runs), at start
    // before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
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
    // `nflash probe` writes a scratch file: SIGPIPE on a closed stderr would
    // end it before it removes that file, so it keeps Rust's default
    // (ignored) and reports through message!, which drops write errors.
    if !matches!(cli.command, Command::Probe(_)) {
        default_sigpipe();
    }
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Ppl(a) => ppl::run(a),
        Command::Probe(a) => probe::run(a),
        Command::PlanSim(a) => plan_sim::run(a),
    };
    if let Err(e) = result {
        message!("error: {e:#}");
        std::process::exit(1);
    }
}
