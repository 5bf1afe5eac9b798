//! Quality of sparse decode against the dense model on held-out text:
//! perplexity, Δ%, top-1 agreement, achieved sparsity, recall.
//!
//! Each sparse pack is scored twice by the runtime's batched evaluation:
//! densely (every neuron) and as sparse decode would compute it (neurons the
//! predictor skips or the threshold rejects contribute nothing). The dense
//! reference is computed once per distinct model and FFN type in the list:
//! packs of one checkpoint differ only in neuron order, which changes the
//! dense result by float rounding alone.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use nflash_format::Pack;
use nflash_runtime::model::predictor::SparsitySummary;
use nflash_runtime::ppl::{score, Scored};
use nflash_runtime::Engine;
use serde::Serialize;

/// What to score.
pub struct QualityOptions {
    /// Held-out text.
    pub text: PathBuf,
    /// Tokens to score at most.
    pub tokens: usize,
    /// Window length, tokens; `None`: 512, or the model's context when shorter.
    pub ctx: Option<usize>,
    /// No progress output.
    pub quiet: bool,
}

/// One pack's result.
#[derive(Serialize, Clone, Debug)]
pub struct QualityRow {
    /// Pack path.
    pub pack: PathBuf,
    /// `gate` / `gate-up`, or `dense`.
    pub criterion: String,
    /// `exact` / `low-rank` / `mlp`, or `dense`.
    pub predictor: String,
    /// Predictor rank.
    pub rank: u32,
    /// Target sparsity the pack was built for.
    pub target_sparsity: f64,
    /// Dense perplexity.
    pub dense_ppl: f64,
    /// Sparse perplexity.
    pub sparse_ppl: f64,
    /// `100 · (sparse / dense − 1)`.
    pub delta_pct: f64,
    /// Fraction of scored positions where sparse and dense top-1 tokens agree.
    pub top1_agreement: f64,
    /// Mean over layers of the fraction of neurons whose down projection was skipped.
    pub ffn_sparsity: f64,
    /// Mean over layers of the fraction of neuron bundles neither read nor computed.
    pub bundles_skipped: f64,
    /// Mean over layers of predictor recall of the truly active neurons (`None`: not measured).
    pub recall: Option<f64>,
    /// FFN weight type of the pack.
    pub quant: String,
    /// Predictor tensors, bytes.
    pub predictor_bytes: u64,
    /// Tokens scored.
    pub tokens: usize,
}

fn run_scored(engine: &Engine, tokens: &[u32], o: &QualityOptions, what: &str) -> Result<Scored> {
    let t = std::time::Instant::now();
    let mut progress = nflash_runtime::message::ProgressLine::default();
    let ctx = o.ctx.unwrap_or_else(|| (engine.model.cfg.max_position_embeddings as usize).clamp(2, 512));
    let s = score(&engine.model, tokens, ctx, engine.bos_of_text(), |done, total| {
        if !o.quiet {
            progress.step(done, total, || {
                format!("{what}: window {done}/{total}, {:.0} s elapsed", t.elapsed().as_secs_f64())
            });
        }
    })?;
    if !o.quiet {
        progress.finish(&format!("{what}: perplexity {:.4} in {:.1} s", s.ppl.perplexity, t.elapsed().as_secs_f64()));
    }
    Ok(s)
}

/// Scores every pack; see the module docs.
///
/// # Errors
/// Unreadable or non-UTF-8 text, too few tokens, pack errors, packs whose tokenizers differ.
pub fn evaluate(files: &[PathBuf], o: &QualityOptions) -> Result<Vec<QualityRow>> {
    let bytes = std::fs::read(&o.text).with_context(|| format!("cannot read --text {}", o.text.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "--text {} is not UTF-8 (invalid byte at offset {}); pass a UTF-8 text file",
            o.text.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let mut dense_cache: Vec<(String, Scored)> = Vec::new();
    let mut rows = Vec::new();
    for f in files {
        let pack = Pack::open(f)?;
        let mut engine = Engine::load(&pack)?;
        let mut tokens = engine.tokenizer.encode(&text, false)?;
        tokens.truncate(o.tokens);
        if tokens.len() < 2 {
            bail!("--text {} gives {} tokens; quality needs at least 2", o.text.display(), tokens.len());
        }
        let m = pack.manifest();
        let key = format!(
            "{:?}|{}|{}",
            m.config,
            m.ffn.first().map_or(String::new(), |f| f.bundle.dtype.to_string()),
            tokens.len()
        );
        let name = short(f);
        let quant = m.ffn.first().map_or(String::new(), |f| f.bundle.dtype.to_string());
        let dense = match dense_cache.iter().find(|(k, _)| *k == key) {
            Some((_, d)) => d.clone(),
            None => {
                engine.model.set_dense(true);
                let d = run_scored(&engine, &tokens, o, &format!("{name} dense"))?;
                dense_cache.push((key, d.clone()));
                d
            }
        };
        let Some(si) = m.sparse.clone() else {
            rows.push(row(f, &quant, "dense", "dense", 0, 0.0, &dense, &dense, None, 0));
            continue;
        };
        engine.model.set_dense(false);
        engine.model.reset_counters();
        let sparse = run_scored(&engine, &tokens, o, &format!("{name} sparse"))?;
        let summary = SparsitySummary::new(&engine.model.counters().0);
        let pred_bytes = m.ffn.iter().filter_map(|f| f.sparse.as_ref()).map(|s| s.predictor_bytes).sum();
        rows.push(row(
            f,
            &quant,
            si.criterion.name(),
            si.predictor.name(),
            si.rank,
            si.target_sparsity as f64,
            &dense,
            &sparse,
            summary.as_ref(),
            pred_bytes,
        ));
    }
    Ok(rows)
}

#[allow(clippy::too_many_arguments)]
fn row(
    f: &Path,
    quant: &str,
    criterion: &str,
    predictor: &str,
    rank: u32,
    target: f64,
    dense: &Scored,
    sparse: &Scored,
    s: Option<&SparsitySummary>,
    predictor_bytes: u64,
) -> QualityRow {
    let agree = dense.top1.iter().zip(&sparse.top1).filter(|(a, b)| a == b).count();
    QualityRow {
        pack: f.to_path_buf(),
        criterion: criterion.into(),
        predictor: predictor.into(),
        rank,
        target_sparsity: target,
        dense_ppl: dense.ppl.perplexity,
        sparse_ppl: sparse.ppl.perplexity,
        delta_pct: 100.0 * (sparse.ppl.perplexity / dense.ppl.perplexity - 1.0),
        top1_agreement: agree as f64 / dense.top1.len().max(1) as f64,
        ffn_sparsity: s.map_or(0.0, |s| s.ffn_sparsity),
        bundles_skipped: s.map_or(0.0, |s| s.bundles_skipped),
        recall: s.and_then(|s| s.recall),
        quant: quant.to_string(),
        predictor_bytes,
        tokens: sparse.ppl.tokens,
    }
}

fn short(p: &Path) -> String {
    p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// The results as a table on stdout.
pub fn print_table(rows: &[QualityRow]) {
    println!(
        "{:<28} {:<5} {:<8} {:<9} {:>4} {:>6} {:>9} {:>9} {:>7} {:>6} {:>8} {:>8} {:>6} {:>9}",
        "pack",
        "quant",
        "criterion",
        "predictor",
        "rank",
        "target",
        "dense ppl",
        "sparse ppl",
        "Δ%",
        "top-1",
        "ffn spar",
        "skipped",
        "recall",
        "pred KiB"
    );
    for r in rows {
        println!(
            "{:<28} {:<5} {:<8} {:<9} {:>4} {:>5.0}% {:>9.3} {:>9.3} {:>+6.1}% {:>6.3} {:>7.1}% {:>7.1}% {:>6} {:>9.0}",
            short(&r.pack),
            r.quant,
            r.criterion,
            r.predictor,
            r.rank,
            100.0 * r.target_sparsity,
            r.dense_ppl,
            r.sparse_ppl,
            r.delta_pct,
            r.top1_agreement,
            100.0 * r.ffn_sparsity,
            100.0 * r.bundles_skipped,
            r.recall.map_or("-".into(), |v| format!("{v:.3}")),
            r.predictor_bytes as f64 / 1024.0
        );
    }
    if let Some(r) = rows.first() {
        println!("({} tokens scored per model)", r.tokens);
    }
}
