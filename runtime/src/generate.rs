//! The generation loop: batched prefill, then token-by-token decode with
//! streaming output and timing.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::draft::DraftKind;
use crate::error::{Error, Result};
use crate::model::kv_cache::KvCache;
use crate::model::Model;
use crate::sampler::Sampler;
use crate::tokenizer::{TextStream, Tokenizer};

/// Counters of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenStats {
    /// Prompt tokens run in prefill.
    pub prompt_tokens: usize,
    /// Tokens generated (the stop token not counted).
    pub generated_tokens: usize,
    /// Prefill wall time, seconds (prompt forward passes, a draft pack's
    /// too, + first sample).
    pub prefill_s: f64,
    /// Forward passes in decode: single-token ones, and verify passes of
    /// speculative decoding (`decode_passes` in `--stats-json`).
    pub decode_steps: usize,
    /// Tokens decode's passes sampled and generation used (accepted draft
    /// tokens and each pass's own sample; not those past a stop):
    /// `decode_steps` without speculative decoding.
    pub decode_tokens: usize,
    /// Decode wall time, seconds (forward passes, drafting + sampling).
    pub decode_s: f64,
    /// Tokens drafted for verify passes (speculative decoding).
    pub draft_tokens: usize,
    /// Drafted tokens the model's own samples matched (kept).
    pub accepted_tokens: usize,
    /// Verify passes (decode passes that checked a draft).
    pub verify_passes: usize,
    /// Forward passes a model draft ran (self-speculation, or a draft
    /// pack's, its catch-up prefill passes included), not counted in `decode_steps`.
    pub draft_passes: usize,
    /// Wall time spent drafting, seconds.
    pub draft_s: f64,
    /// Wall time of verify passes (forward pass + sampling), seconds.
    pub verify_s: f64,
    /// The draft used ([`GenerateOptions::speculate`]).
    pub draft: crate::draft::DraftKind,
    /// The draft that made the guesses: [`Self::draft`] with `auto`
    /// resolved (prompt lookup, or the draft pack where one was given).
    pub draft_source: crate::draft::DraftKind,
    /// Set to the context length (tokens) when generation stopped because
    /// the KV cache was full.
    pub context_full: Option<usize>,
    /// Wall time of each decode step (forward pass + sampling), seconds `[decode_steps]`.
    pub step_s: Vec<f64>,
    /// When decode began (the first token sampled by prefill), seconds
    /// since the Unix epoch: aligns [`Self::token_s`] with other clocks.
    pub decode_start_unix_s: f64,
    /// When each generated token was handed out, seconds after
    /// `decode_start_unix_s` `[generated_tokens]`: tokens/s over any span
    /// of decode (`make bench-pressure`'s before, during and after).
    pub token_s: Vec<f64>,
    /// Neuron-cache counters over decode only.
    pub decode_cache: crate::model::CacheStats,
    /// Neuron-cache counters over prefill only.
    pub prefill_cache: crate::model::CacheStats,
    /// Why generation ended.
    pub finish: Finish,
    /// Tokens in the KV cache when generation ended: where a cancelled
    /// generation stopped (inside the prompt when it was cancelled during
    /// prefill).
    pub stopped_at: usize,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Finish {
    /// A stop token was sampled.
    #[default]
    Stop,
    /// `max_tokens` tokens were generated.
    Length,
    /// The KV cache is full (its capacity is in [`GenStats::context_full`]).
    ContextFull,
    /// The caller's `on_text` asked to stop, or [`GenerateOptions::cancel`]
    /// was raised.
    Cancelled,
}

impl GenStats {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_s)
    }
    /// Tokens per second of decode: tokens its passes sampled (with
    /// speculative decoding, several per verify pass) over its wall time.
    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.decode_tokens, self.decode_s)
    }

    /// Share of drafted tokens kept (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_tokens == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.draft_tokens as f64
        }
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// What to generate.
#[derive(Debug, Clone, Default)]
pub struct GenerateOptions {
    /// Stop after this many generated tokens.
    pub max_tokens: usize,
    /// Token ids that end generation (any EOS); not printed.
    pub stop_ids: Vec<u32>,
    /// Keep going past stop ids (benchmarks).
    pub ignore_eos: bool,
    /// Raised from any thread, stops the generation at its next check:
    /// between prefill passes and after every token (whether or not the
    /// token produced text). The default is never raised.
    pub cancel: CancelToken,
    /// Speculative decoding (off by default): a draft's guesses checked by
    /// verify passes; the tokens are those plain decoding gives.
    pub speculate: crate::draft::SpecOptions,
}

/// A flag that stops a generation ([`GenerateOptions::cancel`]); clones
/// share it, so one clone goes to the generation and another to whoever
/// may stop it (another thread, a client's connection).
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token not yet raised.
    pub fn new() -> Self {
        Self::default()
    }

    /// Raises the flag: the generation stops at its next check.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Lowers the flag again, for a token reused from one generation to the
    /// next (call it before the generation starts, not while one runs).
    pub fn reset(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    /// Whether [`Self::cancel`] was called on this token or a clone.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Runs `prompt` (token ids appended after whatever `kv` holds) through
/// prefill, then samples up to `opts.max_tokens` tokens, calling `on_text`
/// with each complete UTF-8 piece. Returns the generated ids (stop token
/// excluded) and the counters.
///
/// # Errors
/// [`Error::EmptyPrompt`], [`Error::PromptTooLong`], model and tokenizer errors.
pub fn generate(
    model: &Model,
    kv: &mut KvCache,
    tok: &Tokenizer,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions,
    mut on_text: impl FnMut(&str),
) -> Result<(Vec<u32>, GenStats)> {
    generate_until(model, kv, tok, prompt, sampler, opts, |piece| {
        on_text(piece);
        ControlFlow::Continue(())
    })
}

/// Runs `prompt` (token ids appended after whatever `kv` holds) through
/// prefill, in passes of [`nflash_plan::layout::prefill_chunk`] tokens
/// counted from the first id of `prompt`, and returns the logits of its
/// last token (`[vocab]`). A token's results depend on the pass it is in
/// (short passes take other kernels than long ones: docs/DESIGN.md,
/// "Invariants"), so [`crate::session::Session`] reuses a KV cache only
/// by whole passes, where a fresh prefill would run the same passes.
///
/// `cancel` is checked before each pass: once it is set, `None` is returned
/// and the KV cache holds the passes run so far.
///
/// # Errors
/// [`Error::EmptyPrompt`]; [`Error::ContextFull`] if the prompt does not
/// fit; model errors (cluster reads, non-finite activations).
pub fn prefill(model: &Model, kv: &mut KvCache, prompt: &[u32], cancel: &CancelToken) -> Result<Option<Vec<f32>>> {
    let h = model.cfg.hidden_size as usize;
    let mut last_hidden = Vec::new();
    for chunk in prompt.chunks(nflash_plan::layout::prefill_chunk(&model.cfg)) {
        if cancel.is_cancelled() {
            return Ok(None);
        }
        let hs = model.forward_with(kv, chunk, crate::model::Pass::Prefill)?;
        last_hidden = hs[hs.len() - h..].to_vec();
    }
    if last_hidden.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    model.checked_logits(&last_hidden, kv.len() - 1).map(Some)
}

/// A draft pack for one generation ([`DraftKind::Pack`]): the draft model
/// and its KV cache, which [`crate::session::Session`] keeps across the
/// turns of a conversation.
pub struct PackDraft<'r, 'm> {
    /// The draft model, all in memory ([`crate::Engine::draft`]).
    pub draft: &'r crate::draft::DraftModel<'m>,
    /// Its KV cache and the ids in it.
    pub cache: &'r mut crate::draft::DraftCache,
    /// The ids the target's KV cache holds before the prompt (a
    /// conversation's earlier turns).
    pub history: &'r [u32],
}

/// A draft pack's failed pass (a damaged draft: non-finite activations)
/// ends its drafting for the generation, which goes on without it: the
/// text never depended on it. Says so on stderr; returns `None`.
fn drop_draft<'r, 'm>(e: Error) -> Option<PackDraft<'r, 'm>> {
    crate::message!("warning: the draft pack failed ({e}); decoding goes on without it");
    None
}

/// As [`generate`], with `on_text` able to stop generation: after
/// [`ControlFlow::Break`] no further token is computed and the stats say
/// [`Finish::Cancelled`]. The KV cache then holds the prompt and every
/// generated token but the last (which was never run through the model).
/// [`GenerateOptions::cancel`] stops it the same way, also during prefill
/// (checked between prefill passes: the KV cache then holds the passes
/// run, [`GenStats::stopped_at`] tokens, and no token is generated) and
/// after tokens that produce no text.
///
/// # Errors
/// As [`generate`].
pub fn generate_until(
    model: &Model,
    kv: &mut KvCache,
    tok: &Tokenizer,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions,
    on_text: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<(Vec<u32>, GenStats)> {
    generate_with_draft(model, kv, tok, prompt, sampler, opts, None, on_text)
}

/// As [`generate_until`], with a draft pack for [`DraftKind::Pack`]
/// (`pack`; `None` for the other drafts), which [`DraftKind::Auto`] then
/// drafts with (under [`crate::draft::Adaptive`], its passes' cost counted).
///
/// # Errors
/// As [`generate`]; [`Error::Usage`] for [`DraftKind::Pack`] without `pack`.
#[allow(clippy::too_many_arguments)]
pub fn generate_with_draft(
    model: &Model,
    kv: &mut KvCache,
    tok: &Tokenizer,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions,
    mut pack: Option<PackDraft<'_, '_>>,
    mut on_text: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<(Vec<u32>, GenStats)> {
    if opts.speculate.draft == DraftKind::Pack && pack.is_none() {
        return Err(Error::Usage("--speculate-draft pack needs a draft pack: pass --draft PACK".into()));
    }
    if prompt.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    if kv.len() + prompt.len() >= kv.capacity() {
        return Err(Error::PromptTooLong { prompt: kv.len() + prompt.len(), context: kv.capacity(), reserve: 1 });
    }
    let mut stats = GenStats { prompt_tokens: prompt.len(), ..Default::default() };
    // In memory, the other compute threads spin between the many short
    // parallel regions of prefill and decode (`spin`); a model that reads
    // from flash leaves the cores to the I/O threads.
    let _awake = model.cache_regions().io_engine.is_none().then(crate::spin::KeepAwake::start);
    let spec = opts.speculate;
    // The draft that guesses: `auto` drafts with a draft pack where one is given.
    let source = match (spec.draft, &pack) {
        (DraftKind::Auto, Some(_)) => DraftKind::Pack,
        (d, _) => d.source(),
    };
    // `auto`: K per pass from the acceptance so far, 0 where it does not pay.
    let offload = model.cache_regions().io_engine.is_some();
    let mut adaptive = (spec.draft == DraftKind::Auto).then(|| {
        let a = crate::draft::Adaptive::new(spec.max_draft, offload);
        match &pack {
            Some(p) if source == DraftKind::Pack => a.with_draft_cost(p.draft.cost),
            _ => a,
        }
    });
    let t0 = Instant::now();
    let prefill0 = model.cache_stats();
    let first = prefill(model, kv, prompt, &opts.cancel)?.map(|logits| sampler.sample(&logits));
    // A draft pack reads the prompt too, as part of prefill (unless `auto`
    // will never draft).
    let will_draft = source == DraftKind::Pack && adaptive.as_ref().is_none_or(|a| a.can_pay());
    if let (Some(p), Some(_), true) = (pack.as_mut(), first, will_draft) {
        match p.cache.catch_up(&p.draft.model, &[p.history, prompt].concat()) {
            Ok(n) => stats.draft_passes += n,
            Err(e) => pack = drop_draft(e),
        }
    }
    stats.prefill_s = t0.elapsed().as_secs_f64();
    stats.prefill_cache = model.cache_stats().since(&prefill0);
    let Some(mut next) = first else {
        stats.finish = Finish::Cancelled;
        stats.stopped_at = kv.len();
        return Ok((Vec::new(), stats));
    };
    let mut out = Vec::new();
    let mut stream = TextStream::default();
    let t1 = Instant::now();
    stats.decode_start_unix_s =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let cache0 = model.cache_stats();
    // Speculative decoding: `ahead` holds tokens already sampled after
    // `next` by a verify pass, whose forward passes (all but the last's)
    // are done; `context` the ids a lookup draft searches.
    let mut ahead: std::collections::VecDeque<u32> = std::collections::VecDeque::new();
    // (With a draft pack, the whole text the target has committed.)
    let mut context: Vec<u32> = match (source, &pack) {
        (DraftKind::Lookup, _) => prompt.to_vec(),
        (DraftKind::Pack, Some(p)) => [p.history, prompt].concat(),
        _ => Vec::new(),
    };
    let mut draft = Vec::new();
    // The length of the n-gram a lookup draft continues.
    let mut match_len = 0;
    let kv0 = kv.len();
    // Positions plain decoding would hold when generation ends: every token
    // pushed has had its forward pass, but a break right after a push.
    let mut kv_end;
    loop {
        kv_end = kv0 + out.len();
        if opts.max_tokens == 0 {
            stats.finish = Finish::Length;
            break;
        }
        if !opts.ignore_eos && opts.stop_ids.contains(&next) {
            stats.finish = Finish::Stop;
            break;
        }
        if opts.cancel.is_cancelled() {
            stats.finish = Finish::Cancelled;
            break;
        }
        out.push(next);
        stats.token_s.push(t1.elapsed().as_secs_f64());
        if let Some(piece) = stream.push(tok, next)? {
            if on_text(&piece).is_break() {
                stats.finish = Finish::Cancelled;
                break;
            }
        }
        if out.len() >= opts.max_tokens {
            stats.finish = Finish::Length;
            break;
        }
        if let Some(t) = ahead.pop_front() {
            // `next`'s forward pass was part of the verify pass.
            next = t;
            continue;
        }
        if kv.len() + 1 >= kv.capacity() {
            stats.context_full = Some(kv.capacity());
            stats.finish = Finish::ContextFull;
            break;
        }
        let ts = Instant::now();
        // Draft at most what the budget of tokens and the context leave;
        // `auto` cuts a lookup draft to the K its match length pays for.
        let room = if adaptive.as_ref().is_some_and(|a| !a.can_pay()) {
            0
        } else {
            spec.max_draft.min(opts.max_tokens - out.len() - 1).min(kv.capacity() - kv.len() - 2)
        };
        match source {
            DraftKind::Off | DraftKind::Auto => {}
            DraftKind::Lookup => {
                context.push(next);
                if room > 0 {
                    match_len = crate::draft::lookup(&context, room, &mut draft);
                    if let Some(a) = adaptive.as_mut().filter(|_| match_len > 0) {
                        draft.truncate(a.next_k(match_len));
                    }
                }
            }
            DraftKind::Pack => {
                context.push(next);
                // `auto`: the guesses' acceptance so far sets K (one arm).
                match_len = 1;
                let room = match adaptive.as_mut() {
                    Some(a) if room > 0 => room.min(a.next_k(match_len)),
                    _ => room,
                };
                if let (Some(p), true) = (pack.as_mut(), room > 0) {
                    let stops: &[u32] = if opts.ignore_eos { &[] } else { &opts.stop_ids };
                    match p.cache.propose(&p.draft.model, &context, room, stops, model.cfg.vocab_size, &mut draft) {
                        Ok(n) => stats.draft_passes += n,
                        Err(e) => {
                            draft.clear();
                            pack = drop_draft(e);
                        }
                    }
                }
            }
            DraftKind::SelfDraft => {
                if room > 0 {
                    let stops: &[u32] = if opts.ignore_eos { &[] } else { &opts.stop_ids };
                    stats.draft_passes += crate::draft::self_draft(model, kv, next, room, stops, &mut draft)?;
                }
            }
        }
        stats.draft_s += ts.elapsed().as_secs_f64();
        if draft.is_empty() {
            let hs = model.forward(kv, &[next])?;
            next = sampler.sample(&model.checked_logits(&hs, kv.len() - 1)?);
            stats.decode_tokens += 1;
        } else {
            let tv = Instant::now();
            let base = kv.len();
            let mut tokens = Vec::with_capacity(draft.len() + 1);
            tokens.push(next);
            tokens.extend_from_slice(&draft);
            let hs = model.verify(kv, &tokens)?;
            let h = model.cfg.hidden_size as usize;
            // The model's sample at each position, kept while it matches
            // the draft; the first that differs, follows the last guess or
            // ends generation (a stop id) ends the pass: exactly the
            // samples plain decoding draws. For a guess, which is a point
            // mass, that is speculative sampling's accept-or-resample
            // (`Sampler::accept_or_resample` with q = the guess), with
            // plain decoding's random numbers: the text never depends on
            // the draft, nor on what a self-draft found in memory.
            let mut kept = 0;
            let last = loop {
                let row = &hs[kept * h..(kept + 1) * h];
                let t = sampler.sample(&model.checked_logits(row, base + kept)?);
                let stops = !opts.ignore_eos && opts.stop_ids.contains(&t);
                if kept < draft.len() && t == draft[kept] && !stops {
                    ahead.push_back(t);
                    kept += 1;
                } else {
                    break t;
                }
            };
            kv.truncate(base + kept + 1);
            if matches!(source, DraftKind::Lookup | DraftKind::Pack) {
                context.extend(ahead.iter());
            }
            if let Some(a) = &mut adaptive {
                a.record(match_len, draft.len(), kept);
            }
            ahead.push_back(last);
            next = ahead.pop_front().unwrap_or(last);
            stats.draft_tokens += draft.len();
            stats.verify_passes += 1;
            stats.accepted_tokens += kept;
            stats.decode_tokens += kept + 1;
            stats.verify_s += tv.elapsed().as_secs_f64();
            draft.clear();
        }
        stats.step_s.push(ts.elapsed().as_secs_f64());
        stats.decode_steps += 1;
    }
    // Tokens a verify pass sampled past where generation stopped were
    // never used: not counted as decoded (plain decoding never samples them).
    stats.decode_tokens -= ahead.len();
    // A verify pass may have run tokens past where generation stopped:
    // leave the KV cache as plain decoding would.
    if kv.len() > kv_end {
        kv.truncate(kv_end);
    }
    stats.decode_s = t1.elapsed().as_secs_f64();
    stats.decode_cache = model.cache_stats().since(&cache0);
    if let Some(piece) = stream.finish(tok)? {
        if stats.finish != Finish::Cancelled {
            let _ = on_text(&piece);
        }
    }
    stats.generated_tokens = out.len();
    stats.draft = spec.draft;
    stats.draft_source = source;
    stats.stopped_at = kv.len();
    Ok((out, stats))
}
