//! A conversation kept across requests: its KV cache and the tokens in it,
//! so that a request whose tokens start with the previous request's tokens
//! runs only the new ones (prefix reuse). Used by interactive chat
//! (`nflash run` without a prompt) and `nflash serve`.

use std::ops::ControlFlow;

use crate::draft::{DraftCache, DraftKind};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::generate::{generate_with_draft, prefill, CancelToken, GenStats, GenerateOptions, PackDraft};
use crate::model::kv_cache::KvCache;
use crate::sampler::Sampler;

/// A KV cache and the token ids whose keys and values it holds.
pub struct Session {
    kv: KvCache,
    /// The ids in `kv`, one per position: `cached.len() == kv.len()`.
    cached: Vec<u32>,
    /// Leading positions of `kv` computed by whole prefill passes of the
    /// prompts (multiples of [`nflash_plan::layout::prefill_chunk`]), as
    /// opposed to the last, partial pass and decode (the generated tokens,
    /// computed one at a time by other kernels): only these are reused, so
    /// a reused prefix holds the bits of the keys and values a fresh
    /// prefill would compute.
    prefilled: usize,
    /// A draft pack's KV cache ([`DraftKind::Pack`]), made at its first use.
    draft: Option<DraftCache>,
}

/// What one [`Session::generate`] did.
#[derive(Debug, Clone)]
pub struct Turn {
    /// Generated token ids (the stop token excluded).
    pub tokens: Vec<u32>,
    /// Counters; `stats.prompt_tokens` counts only the tokens run in prefill
    /// (the request's tokens less `reused_tokens`).
    pub stats: GenStats,
    /// Leading tokens of the request already in the KV cache, not run again.
    pub reused_tokens: usize,
}

impl Session {
    /// An empty session with a KV cache of `ctx` tokens.
    ///
    /// # Errors
    /// [`crate::Error::KvCache`] when the KV cache cannot be reserved.
    pub fn new(engine: &Engine, ctx: usize) -> Result<Self> {
        Ok(Session { kv: engine.model.try_new_kv_cache(ctx)?, cached: Vec::new(), prefilled: 0, draft: None })
    }

    /// The context length, tokens (the KV cache's capacity).
    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    /// Forgets the conversation (the next request is prefilled whole).
    pub fn clear(&mut self) {
        self.kv.truncate(0);
        self.cached.clear();
        self.prefilled = 0;
    }

    /// Generates after `ids`, the whole conversation's token ids: the
    /// longest prefix of `ids` already in the KV cache from earlier
    /// prefill passes is kept ([`Self::keep_prefix`]), the rest is
    /// prefilled, then decoding runs as [`generate_until`] does. The
    /// tokens, logits and KV cache are those of a fresh prefill of `ids`,
    /// bit for bit. After an error the cache keeps only the reused prefix.
    ///
    /// # Errors
    /// As [`crate::generate::generate`]: [`crate::Error::EmptyPrompt`],
    /// [`crate::Error::PromptTooLong`], model and tokenizer errors.
    pub fn generate(
        &mut self,
        engine: &Engine,
        ids: &[u32],
        sampler: &mut Sampler,
        opts: &GenerateOptions,
        on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<Turn> {
        let common = self.keep_prefix(engine, ids);
        let new = &ids[common..];
        // A draft pack's KV cache lives as long as the conversation.
        let pack = match (&engine.draft, opts.speculate.draft) {
            (Some(draft), DraftKind::Pack | DraftKind::Auto) => {
                if self.draft.is_none() {
                    self.draft = Some(DraftCache::new(&draft.model, self.kv.capacity())?);
                }
                self.draft.as_mut().map(|cache| PackDraft { draft, cache, history: &self.cached[..common] })
            }
            _ => None,
        };
        let result =
            generate_with_draft(&engine.model, &mut self.kv, &engine.tokenizer, new, sampler, opts, pack, on_text);
        match result {
            Ok((tokens, stats)) => {
                self.prefilled_through(engine, new);
                self.cached.extend_from_slice(&tokens);
                // The last sampled token was never run through the model;
                // a prefill cancelled between passes ran only part of `new`.
                self.cached.truncate(self.kv.len());
                self.prefilled = self.prefilled.min(self.cached.len());
                Ok(Turn { tokens, stats, reused_tokens: common })
            }
            Err(e) => {
                self.keep(common);
                Err(e)
            }
        }
    }

    /// Prefills `ids` as [`Self::generate`] does, reusing the same prefix,
    /// and returns the logits of the last id (`[vocab]`) and the number of
    /// leading ids reused. The KV cache then holds exactly `ids`.
    ///
    /// # Errors
    /// [`Error::EmptyPrompt`], [`Error::PromptTooLong`] (no room for the
    /// prompt and one generated token), model errors.
    pub fn prefill(&mut self, engine: &Engine, ids: &[u32]) -> Result<(Vec<f32>, usize)> {
        if ids.len() >= self.kv.capacity() {
            return Err(Error::PromptTooLong { prompt: ids.len(), context: self.kv.capacity(), reserve: 1 });
        }
        let common = self.keep_prefix(engine, ids);
        let new = &ids[common..];
        match prefill(&engine.model, &mut self.kv, new, &CancelToken::default()) {
            Ok(Some(logits)) => {
                self.prefilled_through(engine, new);
                Ok((logits, common))
            }
            Ok(None) => Err(Error::Internal("a prefill nobody could cancel was cancelled".into())),
            Err(e) => {
                self.keep(common);
                Err(e)
            }
        }
    }

    /// The KV cache (its positions hold the keys and values of the ids of
    /// the conversation so far, but the last sampled one).
    pub fn kv_cache(&self) -> &KvCache {
        &self.kv
    }

    /// Keeps the longest prefix of `ids` that is in the KV cache and was
    /// computed by whole prefill passes, less at least one id (the last id
    /// of a request is always run, for its logits), rounded down to whole
    /// passes of [`nflash_plan::layout::prefill_chunk`] tokens, so that the
    /// rest runs in the passes a fresh prefill of `ids` would run; none of
    /// it when a sliding-window layer's KV ring has moved past it. Returns
    /// its length.
    fn keep_prefix(&mut self, engine: &Engine, ids: &[u32]) -> usize {
        let same = self.cached.iter().zip(ids).take_while(|(a, b)| a == b).count();
        let pass = nflash_plan::layout::prefill_chunk(&engine.model.cfg);
        let mut common = same.min(self.prefilled).min(ids.len().saturating_sub(1));
        common -= common % pass;
        self.keep(common)
    }

    /// Forgets every position from `len` on, and returns the positions
    /// kept: `len`, or 0 when a sliding-window layer's KV ring no longer
    /// holds what position `len` attends to ([`KvCache::truncate`]).
    fn keep(&mut self, len: usize) -> usize {
        let kept = self.kv.truncate(len);
        self.cached.truncate(kept);
        self.prefilled = self.prefilled.min(kept);
        kept
    }

    /// Records that `new` was prefilled after the kept prefix.
    fn prefilled_through(&mut self, engine: &Engine, new: &[u32]) {
        let pass = nflash_plan::layout::prefill_chunk(&engine.model.cfg);
        self.cached.extend_from_slice(new);
        self.prefilled = self.cached.len() - self.cached.len() % pass;
    }
}
