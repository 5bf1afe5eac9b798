//! `nflash ppl`: perplexity on a text file.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nflash_runtime::{ppl, Engine};

use crate::common::{in_pool, open_pack, read_text};

/// Arguments of `nflash ppl`.
#[derive(Args)]
pub struct PplArgs {
    /// The .nflash pack.
    #[arg(long)]
    model: PathBuf,
    /// UTF-8 text to score.
    #[arg(long)]
    file: PathBuf,
    /// Window length in tokens (non-overlapping windows).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score at most this many tokens of the file.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Check every segment checksum before running.
    #[arg(long)]
    verify: bool,
}

pub fn run(a: PplArgs) -> Result<()> {
    in_pool(a.threads, || run_in_pool(a))
}

fn run_in_pool(a: PplArgs) -> Result<()> {
    let text = read_text(&a.file)?;
    let pack = open_pack(&a.model, a.verify)?;
    let engine = Engine::load(&pack)?;
    let mut tokens = engine.tokenizer.encode(&text, false)?;
    if let Some(m) = a.max_tokens {
        tokens.truncate(m);
    }
    if tokens.len() < 2 {
        anyhow::bail!(
            "{} gives {} tokens{}; perplexity needs at least 2: pass a longer UTF-8 text",
            a.file.display(),
            tokens.len(),
            if a.max_tokens.is_some() { " (after --max-tokens)" } else { "" }
        );
    }
    let quiet = a.json;
    let r = ppl::perplexity(&engine.model, &tokens, a.ctx, |done, total| {
        if !quiet {
            eprint!("\rwindow {done}/{total}");
        }
    })?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "perplexity": r.perplexity,
                "tokens": r.tokens,
                "windows": r.windows,
                "ctx": a.ctx,
                "model": a.model,
                "file": a.file,
            })
        );
    } else {
        eprintln!();
        println!(
            "perplexity {:.4} over {} tokens ({} windows of ≤ {} tokens)",
            r.perplexity, r.tokens, r.windows, a.ctx
        );
    }
    Ok(())
}
