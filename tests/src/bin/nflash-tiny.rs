//! `nflash-tiny`: writes a tiny random Hugging Face checkpoint of an
//! architecture (the fixtures of the test suite, `nflash_tests::TinySpec`)
//! for scripts that need one without the test binary, such as
//! `make test-aarch64` (scripts/test_aarch64.sh).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use nflash_tests::TinySpec;

/// Writes a tiny random checkpoint (config.json, model.safetensors, a
/// word-level tokenizer of 80 tokens `w3` … `w79`) to DIR.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The architecture.
    #[arg(value_enum)]
    arch: Arch,
    /// Output directory (created).
    dir: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum Arch {
    /// Gemma 3: sliding-window and global layers, (1 + w) norms, GeGLU.
    Gemma3,
    /// Phi-3: fused projections, partial RoPE, LongRoPE.
    Phi3,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.dir.exists() {
        anyhow::bail!("{} exists; give a new directory", a.dir.display());
    }
    let spec = match a.arch {
        Arch::Gemma3 => TinySpec::gemma3(a.seed),
        Arch::Phi3 => TinySpec::phi3(a.seed),
    };
    nflash_tests::write_tiny_checkpoint(&a.dir, &spec);
    Ok(())
}
