//! The packed Hugging Face tokenizer and UTF-8-safe streaming detokenization.

use crate::error::{Error, Result};

/// A `tokenizers` tokenizer loaded from the pack's `tokenizer.json`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Parses `tokenizer.json` bytes.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the JSON is not a tokenizer.
    pub fn from_json(json: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| {
                Error::Tokenizer(format!(
                    "cannot load the packed tokenizer.json: {e}; the pack may be corrupt (check it with `prep verify`), or convert it again"
                ))
            })?;
        Ok(Tokenizer { inner })
    }

    /// Largest token id + 1, counting added tokens: the embedding rows the
    /// tokenizer needs. (Not `get_vocab_size`, which counts tokens: ids may
    /// have gaps, and added tokens may carry ids past the model vocabulary.)
    pub fn vocab_size(&self) -> usize {
        let max_id = self.highest_id().map_or(0, |(_, m)| m as usize + 1);
        max_id.max(self.inner.get_vocab_size(true))
    }

    /// The token with the largest id (added tokens included), if any.
    pub fn highest_id(&self) -> Option<(String, u32)> {
        self.inner.get_vocab(true).into_iter().max_by_key(|(_, id)| *id)
    }

    /// Encodes `text`; `add_special_tokens` applies the tokenizer's
    /// post-processor (e.g. a BOS), as HF does for a raw prompt, and is off for
    /// text rendered by a chat template.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes `ids`, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenizer(format!("decoding failed: {e}")))
    }

    /// The id of a token string, if any.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// Turns a stream of token ids into text pieces without ever splitting a
/// UTF-8 character: a piece is released only once its bytes decode cleanly
/// (no trailing U+FFFD), and decoding restarts a few tokens back so
/// byte-level merges across token boundaries come out right.
#[derive(Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl TextStream {
    /// Adds a token; returns newly completed text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.tokens.push(id);
        let prev = tok.decode(&self.tokens[self.prefix..self.read])?;
        let now = tok.decode(&self.tokens[self.prefix..])?;
        if now.len() > prev.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&prev) {
            let piece = now[prev.len()..].to_string();
            self.prefix = self.read;
            self.read = self.tokens.len();
            Ok(Some(piece))
        } else {
            Ok(None)
        }
    }

    /// Whatever remains undecoded at the end of generation (may hold U+FFFD
    /// if the model stopped inside a character).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        let prev = tok.decode(&self.tokens[self.prefix..self.read])?;
        let now = tok.decode(&self.tokens[self.prefix..])?;
        self.prefix = self.tokens.len();
        self.read = self.tokens.len();
        Ok((now.len() > prev.len()).then(|| now.get(prev.len()..).unwrap_or(&now).to_string()))
    }

    /// All token ids pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}
