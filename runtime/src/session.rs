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

/// A KV cache and the token ids whose keys and values it holds.
pub struct Session {
    kv: KvCache,
    /// The ids in `kv`, one per position: `cached.len() == kv.len()`.
    cached: Vec<u32>,
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
        Ok(Session { kv: engine.model.try_new_kv_cache(ctx)?, cached: Vec::new() })
    }

    /// The context length, tokens (the KV cache's capacity).
    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    /// Tokens now in the KV cache.
    pub fn cached_tokens(&self) -> usize {
        self.cached.len()
    }

    /// Forgets the conversation (the next request is prefilled whole).
    pub fn clear(&mut self) {
        self.kv.truncate(0);
        self.cached.clear();
    }

    /// Generates after `ids`, the whole conversation's token ids: the
    /// longest prefix of `ids` already in the KV cache is kept (at most
    /// all but the last id, whose logits are needed), the rest is
    /// prefilled, then decoding runs as [`generate_until`] does. After an
    /// error the cache keeps only the reused prefix.
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
        let common = self.cached.iter().zip(ids).take_while(|(a, b)| a == b).count().min(ids.len().saturating_sub(1));
        self.kv.truncate(common);
        self.cached.truncate(common);
        let new = &ids[common..];
        match generate_until(&engine.model, &mut self.kv, &engine.tokenizer, new, sampler, opts, on_text) {
            Ok((tokens, stats)) => {
                self.cached.extend_from_slice(new);
                self.cached.extend_from_slice(&tokens);
                // The last sampled token was never run through the model.
                self.cached.truncate(self.kv.len());
                Ok(Turn { tokens, stats, reused_tokens: common })
            }
            Err(e) => {
                self.kv.truncate(common);
                Err(e)
            }
        }
    }
}
