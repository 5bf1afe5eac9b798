//! `nflash ppl`: perplexity on a text file.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nflash_runtime::model::predictor::SparsitySummary;
use nflash_runtime::ppl;

use crate::common::{in_pool, open_pack, read_text, Verify};
use crate::memory::{load_engine, MemoryArgs};
use nflash_runtime::message;
use nflash_runtime::message::ProgressLine;

/// Arguments of `nflash ppl`.
#[derive(Args)]
pub struct PplArgs {
    /// The .nflash pack.
    #[arg(long)]
    model: PathBuf,
    /// UTF-8 text to score.
    #[arg(long)]
    file: PathBuf,
    /// Window length in tokens (non-overlapping windows) [default: 512, or
    /// the model's context (max_position_embeddings) when shorter].
    #[arg(long)]
    ctx: Option<usize>,
    /// Score at most this many tokens of the file.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Compute threads (default: the big cores where there are big and little
    /// ones, pinned there; else all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Checksums to check: lazy = each neuron cluster's CRC-32C after it is
    /// read, before it is used; full = that and every segment's CRC-32 at
    /// start (reads the whole file; `--verify` alone means full); off = no
    /// cluster checks (to measure their cost).
    #[arg(long, value_enum, default_value = "lazy", num_args = 0..=1, default_missing_value = "full")]
    verify: Verify,
    /// Evaluate a sparse pack densely (every FFN neuron), for comparison.
    #[arg(long)]
    dense: bool,
    #[command(flatten)]
    memory: MemoryArgs,
}

pub fn run(a: PplArgs) -> Result<()> {
    in_pool(a.threads, || run_in_pool(a))
}

fn run_in_pool(a: PplArgs) -> Result<()> {
    if let Some(c) = a.ctx.filter(|&c| c < 2) {
        anyhow::bail!("--ctx {c} must be at least 2");
    }
    let text = read_text(&a.file)?;
    let device = a.memory.device_profile()?;
    let pack = open_pack(&a.model, a.verify)?;
    let max_pos = pack.manifest().config.max_position_embeddings;
    let ctx = a.ctx.unwrap_or_else(|| (max_pos as usize).clamp(2, 512));
    let (mut engine, _) = load_engine(&pack, None, &a.memory, device, ctx, a.verify.clusters())?;
    engine.model.set_dense(a.dense);
    if ctx as u64 > max_pos {
        message!("warning: --ctx {ctx} exceeds the model's trained context ({max_pos} tokens); perplexity past it is not meaningful");
    }
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
    let started = std::time::Instant::now();
    let n_tokens = tokens.len();
    if !quiet {
        let bos =
            if engine.bos_of_text().is_some() { ", each starting with BOS (as llama.cpp's perplexity)" } else { "" };
        message!("scoring {n_tokens} tokens in windows of {} tokens{bos}", ctx);
    }
    let mut progress = ProgressLine::default();
    let r = ppl::perplexity(&engine.model, &tokens, ctx, engine.bos_of_text(), |done, total| {
        if !quiet {
            progress.step(done, total, || {
                let secs = started.elapsed().as_secs_f64();
                let done_tokens = (done * ctx).min(n_tokens);
                let rate = done_tokens as f64 / secs.max(1e-9);
                let eta = (n_tokens - done_tokens) as f64 / rate.max(1e-9);
                format!("window {done}/{total}, {rate:.0} tokens/s, {secs:.0} s elapsed, about {eta:.0} s left")
            });
        }
    })?;
    let sparsity = SparsitySummary::new(&engine.model.counters().0);
    if a.json {
        let mut j = serde_json::json!({
            "perplexity": r.perplexity,
            "tokens": r.tokens,
            "windows": r.windows,
            "ctx": ctx,
            "model": a.model,
            "file": a.file,
            "sparse": engine.model.is_sparse_pack() && !a.dense,
        });
        if let Some(s) = &sparsity {
            j["ffn_sparsity"] = s.ffn_sparsity.into();
            j["bundles_skipped"] = s.bundles_skipped.into();
            j["recall"] = s.recall.into();
            j["layers"] = s
                .layers
                .iter()
                .map(|(f, b, r)| serde_json::json!({"ffn_sparsity": f, "bundles_skipped": b, "recall": r}))
                .collect();
        }
        println!("{j}");
    } else {
        if progress.is_tty() {
            message!();
        }
        println!(
            "perplexity {:.4} over {} scored tokens ({} window{} of at most {} tokens)",
            r.perplexity,
            r.tokens,
            r.windows,
            if r.windows == 1 { "" } else { "s" },
            ctx
        );
        if let Some(s) = sparsity.filter(|_| engine.model.is_sparse_pack() && !a.dense) {
            print_sparsity(&s);
        }
    }
    Ok(())
}

/// Per-layer and mean FFN sparsity, as a table on stdout.
fn print_sparsity(s: &SparsitySummary) {
    let pct = |v: f64| format!("{:5.1}%", 100.0 * v);
    let rec = |r: Option<f64>| r.map_or("    -".into(), pct);
    println!("layer  ffn sparsity  bundles skipped  recall");
    for (l, (f, b, r)) in s.layers.iter().enumerate() {
        println!("{l:>5}  {:>12}  {:>15}  {:>6}", pct(*f), pct(*b), rec(*r));
    }
    println!(" mean  {:>12}  {:>15}  {:>6}", pct(s.ffn_sparsity), pct(s.bundles_skipped), rec(s.recall));
}
