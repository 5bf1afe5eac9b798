//! A conversation kept across requests: its KV cache and the tokens in it,
//! so that a request whose tokens start with the previous request's tokens
//! runs only the new ones (prefix reuse). Used by interactive chat
//! (`nflash run` without a prompt) and `nflash serve`.

use std::ops::ControlFlow;

use crate::engine::Engine;
use crate::error::Result;
use crate::generate::{generate_until, GenStats, GenerateOptions};
use crate::model::kv_cache::KvCache;
use crate::sampler::Sampler;

/// Fewest tokens run again after a reused prefix: prefill passes of fewer
/// tokens take other kernel paths (one token: the decode matvec), whose
/// results differ in the last bits from a longer pass's.
pub const MIN_SUFFIX: usize = crate::kernels::gemm::MIN_BATCH;

/// A KV cache and the token ids whose keys and values it holds.
pub struct Session {
    kv: KvCache,
    /// The ids in `kv`, one per position: `cached.len() == kv.len()`.
    cached: Vec<u32>,
    /// Leading positions of `kv` computed by prefill (the prompts), as
    /// opposed to decode (the generated tokens, computed one at a time by
    /// other kernels): only these are reused, so a reused prefix holds the
    /// keys and values a fresh prefill would compute.
    prefilled: usize,
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
        Ok(Session { kv: engine.model.try_new_kv_cache(ctx)?, cached: Vec::new(), prefilled: 0 })
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
    /// longest prefix of `ids` already in the KV cache from an earlier
    /// prefill is kept (at most all but the last [`MIN_SUFFIX`] ids), the
    /// rest is prefilled, then decoding runs as
    /// [`generate_until`] does. Earlier replies (computed by decode) are
    /// prefilled again, and where prefill results depend on the pass
    /// ([`crate::Model::prefill_batch_invariant`]: Q4_0) only whole
    /// prefill passes are reused, so the tokens are always those of a
    /// fresh prefill of `ids`. After an error the cache keeps only the
    /// reused prefix.
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
        let same = self.cached.iter().zip(ids).take_while(|(a, b)| a == b).count();
        let mut common = same.min(self.prefilled).min(ids.len().saturating_sub(MIN_SUFFIX));
        // Where a token's prefill result depends on its pass (Q4_0), only
        // whole passes are reused, each run at the offset a fresh prefill
        // runs it: the rest is computed exactly as a fresh prefill would.
        let pass = nflash_plan::layout::prefill_chunk(&engine.model.cfg);
        let invariant = engine.model.prefill_batch_invariant();
        if !invariant {
            common -= common % pass;
        }
        self.kv.truncate(common);
        self.cached.truncate(common);
        let new = &ids[common..];
        match generate_until(&engine.model, &mut self.kv, &engine.tokenizer, new, sampler, opts, on_text) {
            Ok((tokens, stats)) => {
                self.cached.extend_from_slice(new);
                self.prefilled =
                    if invariant { self.cached.len() } else { self.cached.len() - self.cached.len() % pass };
                self.cached.extend_from_slice(&tokens);
                // The last sampled token was never run through the model;
                // a prefill cancelled between passes ran only part of `new`.
                self.cached.truncate(self.kv.len());
                self.prefilled = self.prefilled.min(self.cached.len());
                Ok(Turn { tokens, stats, reused_tokens: common })
            }
            Err(e) => {
                self.kv.truncate(common);
                self.prefilled = common;
                Err(e)
            }
        }
    }
}
