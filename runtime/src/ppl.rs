//! Perplexity over non-overlapping windows (as llama.cpp's `perplexity`,
//! without its half-window scoring: every token after a window's first is
//! scored). Where the tokenizer starts text with BOS, each window's first
//! token is replaced by BOS, as llama.cpp does (`tokens[batch_start] =
//! bos`): a model such as Gemma is only meaningful after it.

use crate::error::{Error, Result};
use crate::model::Model;

/// Result of [`perplexity`].
#[derive(Debug, Clone, Copy)]
pub struct Perplexity {
    /// exp(mean negative log-likelihood).
    pub perplexity: f64,
    /// Tokens scored.
    pub tokens: usize,
    /// Windows run.
    pub windows: usize,
}

/// [`perplexity`] plus the model's top-1 token at every scored position
/// (`[tokens]`), to compare two models position by position.
#[derive(Debug, Clone)]
pub struct Scored {
    /// Perplexity figures.
    pub ppl: Perplexity,
    /// Argmax of the logits at each scored position, in order.
    pub top1: Vec<u32>,
}

/// Scores `tokens` in windows of `ctx` tokens, each window's first token
/// replaced by `bos` when given ([`crate::engine::Engine::bos_of_text`]).
/// `on_window(done, total)` reports progress.
///
/// # Errors
/// [`Error::Usage`] for `ctx < 2` or fewer than 2 tokens; model errors.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    on_window: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    score(model, tokens, ctx, bos, on_window).map(|s| s.ppl)
}

/// [`perplexity`] that also returns the top-1 token of every scored position.
///
/// # Errors
/// As [`perplexity`].
pub fn score(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    mut on_window: impl FnMut(usize, usize),
) -> Result<Scored> {
    if ctx < 2 {
        return Err(Error::Usage(format!("--ctx {ctx} must be at least 2")));
    }
    if tokens.len() < 2 {
        return Err(Error::Usage(format!("the text has {} tokens; perplexity needs at least 2", tokens.len())));
    }
    let h = model.cfg.hidden_size as usize;
    let vocab = model.cfg.vocab_size as usize;
    let windows: Vec<&[u32]> = tokens.chunks(ctx).filter(|w| w.len() >= 2).collect();
    let mut nll = 0f64;
    let mut count = 0usize;
    let mut top1 = Vec::with_capacity(tokens.len());
    let mut window = Vec::with_capacity(ctx.min(tokens.len()));
    for (wi, w) in windows.iter().enumerate() {
        // The window as run: its first token BOS where the text starts so
        // (never scored: targets are `w[1..]`).
        window.clear();
        window.extend_from_slice(w);
        if let Some(b) = bos {
            window[0] = b;
        }
        let run = &window[..];
        let mut kv = model.new_kv_cache(w.len());
        // The window in nearly equal parts of at most `prefill_chunk` tokens
        // (scratch bounded as in generation, each part batched).
        let parts = w.len().div_ceil(nflash_plan::layout::prefill_chunk(&model.cfg));
        let mut hidden = Vec::with_capacity(w.len() * h);
        for p in 0..parts {
            let (lo, hi) = (p * w.len() / parts, (p + 1) * w.len() / parts);
            hidden.extend(model.forward_with(&mut kv, &run[lo..hi], crate::model::Pass::Evaluate)?);
        }
        if !hidden.iter().all(|v| v.is_finite()) {
            return Err(Error::NonFinite { position: 0 });
        }
        // Logits in chunks of 32 positions to bound memory.
        for (ci, hs) in hidden[..(w.len() - 1) * h].chunks(32 * h).enumerate() {
            let logits = model.logits_batch(hs);
            for (j, row) in logits.chunks_exact(vocab).enumerate() {
                let target = w[ci * 32 + j + 1] as usize;
                let (arg, &mx) =
                    row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).expect("vocab > 0");
                top1.push(arg as u32);
                if !row.iter().all(|v| v.is_finite()) {
                    return Err(Error::NonFinite { position: ci * 32 + j });
                }
                let max = mx as f64;
                let lse = row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
                nll += lse - row[target] as f64;
                count += 1;
            }
        }
        on_window(wi + 1, windows.len());
    }
    Ok(Scored {
        ppl: Perplexity { perplexity: (nll / count as f64).exp(), tokens: count, windows: windows.len() },
        top1,
    })
}
