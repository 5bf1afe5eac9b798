//! `nflash-tiny`: writes a tiny random Hugging Face checkpoint of an
//! architecture (the fixtures of the test suite, `nflash_tests::TinySpec`)
//! for scripts that need one without the test binary, such as
//! `make test-aarch64` (scripts/test_aarch64.sh).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use nflash_tests::TinySpec;

/// Writes a tiny random checkpoint (config.json, model.safetensors, a
/// word-level tokenizer of 80 tokens `w3` … `w79`) to DIR; the size flags
/// make larger ones (e.g. to profile the runtime).
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
    /// Residual width (`hidden_size`) instead of the fixture's 64 (a
    /// multiple of 32 for Q4_0/Q8_0 packs).
    #[arg(long)]
    hidden: Option<usize>,
    /// FFN neurons per layer (`intermediate_size`) instead of the fixture's.
    #[arg(long)]
    inter: Option<usize>,
    /// Decoder layers instead of the fixture's.
    #[arg(long)]
    layers: Option<usize>,
    /// Query heads; `--kv-heads` key/value heads; `--head-dim` elements per head.
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    head_dim: Option<usize>,
    /// Gemma 3's sliding window, tokens.
    #[arg(long)]
    window: Option<usize>,
    /// Vocabulary (`w3` … `w{vocab-1}` and three specials) instead of 80.
    #[arg(long)]
    vocab: Option<usize>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Arch {
    /// Gemma 3: sliding-window and global layers, (1 + w) norms, GeGLU.
    Gemma3,
    /// Phi-3: fused projections, partial RoPE, LongRoPE.
    Phi3,
    /// The checkpoints of the GGUF twins (`TinySpec::gguf_twin`; tests/data/gguf/).
    GgufLlama,
    GgufLlama31,
    GgufMixtral,
    GgufQwen2,
    GgufQwen3,
    GgufQwen3moe,
    GgufSmollm3,
    GgufPhi3,
    GgufGemma3,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.dir.exists() {
        anyhow::bail!("{} exists; give a new directory", a.dir.display());
    }
    let mut spec = match a.arch {
        Arch::Gemma3 => TinySpec::gemma3(a.seed),
        Arch::Phi3 => TinySpec::phi3(a.seed),
        twin => {
            let name = twin.to_possible_value().expect("named").get_name().trim_start_matches("gguf-").to_string();
            TinySpec::gguf_twin(&name).expect("every twin has a spec")
        }
    };
    spec.hidden = a.hidden.unwrap_or(spec.hidden);
    spec.inter = a.inter.unwrap_or(spec.inter);
    spec.layers = a.layers.unwrap_or(spec.layers);
    spec.heads = a.heads.unwrap_or(spec.heads);
    spec.kv_heads = a.kv_heads.unwrap_or(spec.kv_heads);
    spec.head_dim = a.head_dim.or(spec.head_dim);
    spec.sliding_window = a.window.or(spec.sliding_window);
    spec.vocab = a.vocab.unwrap_or(spec.vocab);
    if a.head_dim.is_some() && matches!(a.arch, Arch::Gemma3) {
        spec.query_pre_attn_scalar = a.head_dim;
    }
    if spec.vocab < 4 || spec.heads == 0 || spec.kv_heads == 0 || spec.heads % spec.kv_heads != 0 {
        anyhow::bail!("--vocab must be at least 4 and --heads a positive multiple of --kv-heads");
    }
    nflash_tests::write_tiny_checkpoint(&a.dir, &spec);
    Ok(())
}
