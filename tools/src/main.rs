//! `prep`: convert a Hugging Face checkpoint into one `.nflash` pack, and
//! inspect or verify packs.

mod checkpoint;
mod convert;
mod inspect;
mod pack;
mod verify;

use clap::{Parser, Subcommand};

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
    /// Convert a Hugging Face checkpoint directory into a .nflash pack.
    Convert(convert::ConvertArgs),
    /// Print a pack's header, config, segments and tensor types.
    Inspect(inspect::InspectArgs),
    /// Check every checksum of a pack.
    Verify(verify::VerifyArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Convert(a) => convert::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Verify(a) => verify::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
