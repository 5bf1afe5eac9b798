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

/// Parses the command line. An option's value that begins with a dash
/// and is not an option of the command (`--draft-tokens -1`,
/// `--memory-budget -5MiB`, `--prompt "- a list"`) is joined to its option
/// (`--draft-tokens=-1`), so it reaches the option's own check instead of
/// clap's "unexpected argument '-1' found"; a missing value
/// (`--memory-budget --prompt hi`) still says one is required.
fn parse_cli() -> Cli {
    let cmd = Cli::command();
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // The subcommand's options (the first word that names one), and the top level's.
    let sub = args.iter().skip(1).find_map(|a| a.to_str().and_then(|a| cmd.find_subcommand(a)));
    let opts: Vec<&clap::Arg> = cmd.get_arguments().chain(sub.into_iter().flat_map(|s| s.get_arguments())).collect();
    let is_option = |t: &str| {
        let name = t.split('=').next().unwrap_or(t);
        opts.iter().any(|a| {
            a.get_long().is_some_and(|l| name.strip_prefix("--") == Some(l))
                || a.get_short().is_some_and(|c| name.strip_prefix('-').is_some_and(|r| r.starts_with(c)))
        }) || matches!(name, "--help" | "-h" | "--version" | "-V")
    };
    let takes_value = |t: &str| {
        opts.iter()
            .any(|a| a.get_action().takes_values() && a.get_long().is_some_and(|l| t.strip_prefix("--") == Some(l)))
    };
    let mut i = 1;
    while i + 1 < args.len() {
        let (Some(t), Some(v)) = (args[i].to_str(), args[i + 1].to_str()) else {
            i += 1;
            continue;
        };
        if t == "--" {
            break;
        }
        if takes_value(t) && v.starts_with('-') && v != "-" && !is_option(v) {
            args[i] = format!("{t}={v}").into();
            args.remove(i + 1);
        }
        i += 1;
    }
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
