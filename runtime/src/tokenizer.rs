//! The packed Hugging Face tokenizer and UTF-8-safe streaming detokenization.

use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};

/// Bytes of text tokenized at once by [`Tokenizer::encode_at_most`] when
/// counting a long text's tokens.
pub const PIECE_BYTES: usize = 16 << 10;

/// A `tokenizers` tokenizer loaded from the pack's `tokenizer.json`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The added tokens marked special (control tokens such as
    /// `<|im_end|>`), longest text first.
    specials: Arc<Vec<Special>>,
    /// Finds the specials' texts (leftmost, longest).
    finder: Option<Arc<aho_corasick::AhoCorasick>>,
    /// `inner` with special tokens read as plain text
    /// (`encode_special_tokens`), made the first time it is needed.
    plain: Arc<OnceLock<tokenizers::Tokenizer>>,
}

/// A special (control) token: its text, id and whitespace stripping.
#[derive(Debug, Clone)]
pub struct Special {
    /// What the token spells, e.g. `<|im_end|>`.
    pub text: String,
    /// Its id.
    pub id: u32,
    /// It takes the whitespace before it (HF `lstrip`).
    lstrip: bool,
    /// It takes the whitespace after it (HF `rstrip`).
    rstrip: bool,
}

impl Tokenizer {
    /// Parses `tokenizer.json` bytes.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the JSON is not a tokenizer.
    pub fn from_json(json: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| Error::Tokenizer(format!("tokenizer.json cannot be read by the tokenizers library: {e}")))?;
        let mut specials: Vec<Special> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| Special { text: t.content, id, lstrip: t.lstrip, rstrip: t.rstrip })
            .collect();
        specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        let finder = if specials.is_empty() {
            None
        } else {
            let f = aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(specials.iter().map(|s| s.text.as_str()))
                .map_err(|e| Error::Tokenizer(format!("cannot index the special tokens: {e}")))?;
            Some(Arc::new(f))
        };
        Ok(Tokenizer { inner, specials: Arc::new(specials), finder, plain: Arc::default() })
    }

    /// The special (control) tokens, longest text first.
    pub fn specials(&self) -> &[Special] {
        &self.specials
    }

    /// The first special token spelled in `text` at or after byte `from`
    /// (the longest where several start at one place): (start, end, index
    /// in [`Self::specials`]).
    pub fn find_special(&self, text: &str, from: usize) -> Option<(usize, usize, usize)> {
        let m = self.finder.as_ref()?.find(aho_corasick::Input::new(text).range(from..))?;
        Some((m.start(), m.end(), m.pattern().as_usize()))
    }

    /// Encodes `text` with every special token's text read as plain
    /// characters (never a control token id), at most `limit` tokens as
    /// [`Self::encode_at_most`] does. No post-processor (no BOS).
    ///
    /// # Errors
    /// As [`Self::encode_at_most`].
    pub fn encode_as_text_at_most(&self, text: &str, limit: usize) -> Result<Vec<u32>> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        encode_at_most(plain, text, false, limit)
    }

    /// Encodes `text` where the special tokens spelled outside `text`'s
    /// `escaped` characters are control tokens and each escaped character
    /// stands for the text it maps to, read as plain characters: the text
    /// between two control tokens is tokenized as one piece, with every
    /// escaped character replaced, by [`Self::encode_as_text_at_most`].
    /// At most `limit` tokens. This is how chat content stays text inside
    /// a rendered template (`Engine::encode_chat`).
    ///
    /// # Errors
    /// As [`Self::encode_at_most`].
    pub fn encode_escaped_at_most(&self, text: &str, escaped: &[(char, &str)], limit: usize) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut piece_start = 0;
        let mut from = 0;
        let push_text = |ids: &mut Vec<u32>, piece: &str| -> Result<()> {
            if piece.is_empty() {
                return Ok(());
            }
            let mut unescaped = String::with_capacity(piece.len());
            for c in piece.chars() {
                match escaped.iter().find(|(e, _)| *e == c) {
                    Some((_, t)) => unescaped.push_str(t),
                    None => unescaped.push(c),
                }
            }
            let room = limit.saturating_sub(ids.len());
            match self.encode_as_text_at_most(&unescaped, room) {
                Ok(more) => ids.extend(more),
                Err(Error::PromptTooLong { prompt, .. }) => {
                    return Err(Error::PromptTooLong { prompt: ids.len() + prompt, context: limit, reserve: 0 })
                }
                Err(e) => return Err(e),
            }
            Ok(())
        };
        while let Some((mut start, mut end, i)) = self.find_special(text, from) {
            let sp = &self.specials[i];
            if sp.lstrip {
                start = piece_start.max(text[..start].trim_end().len());
            }
            if sp.rstrip {
                end = text.len() - text[end..].trim_start().len();
            }
            push_text(&mut ids, &text[piece_start..start])?;
            ids.push(sp.id);
            if ids.len() > limit {
                return Err(Error::PromptTooLong { prompt: ids.len(), context: limit, reserve: 0 });
            }
            piece_start = end;
            from = end;
        }
        push_text(&mut ids, &text[piece_start..])?;
        Ok(ids)
    }

    /// Largest token id + 1, counting added tokens: the embedding rows the
    /// tokenizer needs. (Not `get_vocab_size`, which counts tokens: ids may
    /// have gaps, and added tokens may carry ids past the model vocabulary.)
    pub fn vocab_size(&self) -> usize {
        let max_id = self.highest_id().map_or(0, |(_, m)| m as usize + 1);
        max_id.max(self.inner.get_vocab_size(true))
    }

    /// The first difference between this tokenizer's vocabulary and
    /// `other`'s (added tokens included), as `(id, this token, other's
    /// token)` with `None` for an id one of them lacks; `None` when every
    /// id names the same token in both (a draft model must share the
    /// target's ids: `Engine::attach_draft`).
    pub fn vocab_difference(&self, other: &Tokenizer) -> Option<(u32, Option<String>, Option<String>)> {
        let by_id = |t: &Tokenizer| {
            let mut v: Vec<(u32, String)> = t.inner.get_vocab(true).into_iter().map(|(s, id)| (id, s)).collect();
            v.sort_unstable();
            v
        };
        let (a, b) = (by_id(self), by_id(other));
        let (mut i, mut j) = (0, 0);
        while i < a.len() || j < b.len() {
            match (a.get(i), b.get(j)) {
                (Some(x), Some(y)) if x == y => (i, j) = (i + 1, j + 1),
                (Some(x), Some(y)) if x.0 == y.0 => return Some((x.0, Some(x.1.clone()), Some(y.1.clone()))),
                (Some(x), y) if y.is_none_or(|y| x.0 < y.0) => return Some((x.0, Some(x.1.clone()), None)),
                (_, Some(y)) => return Some((y.0, None, Some(y.1.clone()))),
                _ => break,
            }
        }
        None
    }

    /// The token with the largest id (added tokens included), if any.
    pub fn highest_id(&self) -> Option<(String, u32)> {
        self.inner.get_vocab(true).into_iter().max_by_key(|(_, id)| *id)
    }

    /// Encodes `text`; `add_special_tokens` applies the tokenizer's
    /// post-processor (e.g. a BOS), as HF does for a raw prompt, and is off for
    /// text rendered by a chat template.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        encode(&self.inner, text, add_special_tokens)
    }

    /// As [`Self::encode`], refusing text of more than `limit` tokens without
    /// tokenizing it whole: text of more than [`PIECE_BYTES`] bytes and more
    /// bytes than `limit` (a token covers at least one byte, so shorter text
    /// cannot be over) is first counted piece by piece (pieces cut after
    /// whitespace), so the memory it takes stays that of a piece (the
    /// tokenizer keeps some hundred bytes per token) however long the text is.
    ///
    /// # Errors
    /// [`Error::PromptTooLong`] (`prompt`: the tokens counted so far, at
    /// least `limit` + 1; `reserve` 0) and as [`Self::encode`].
    pub fn encode_at_most(&self, text: &str, add_special_tokens: bool, limit: usize) -> Result<Vec<u32>> {
        encode_at_most(&self.inner, text, add_special_tokens, limit)
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

/// [`Tokenizer::encode_at_most`] with `tok`.
fn encode_at_most(tok: &tokenizers::Tokenizer, text: &str, add_special_tokens: bool, limit: usize) -> Result<Vec<u32>> {
    if text.len() > PIECE_BYTES && text.len() > limit {
        let mut counted = 0usize;
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = rest.len().min(PIECE_BYTES);
            while !rest.is_char_boundary(cut) {
                cut -= 1;
            }
            if cut < rest.len() {
                // After the last whitespace of the piece, where there is one.
                cut = rest[..cut].rfind(char::is_whitespace).map_or(cut, |i| i + 1).max(1);
                while !rest.is_char_boundary(cut) {
                    cut += 1;
                }
            }
            counted += encode(tok, &rest[..cut], false)?.len();
            // Pieces may split what the whole text merges: a few tokens of slack per cut.
            if counted > limit.saturating_add(8 * (text.len() - rest.len()).div_ceil(PIECE_BYTES) + 8) {
                return Err(Error::PromptTooLong { prompt: counted, context: limit, reserve: 0 });
            }
            rest = &rest[cut..];
        }
    }
    let ids = encode(tok, text, add_special_tokens)?;
    if ids.len() > limit {
        return Err(Error::PromptTooLong { prompt: ids.len(), context: limit, reserve: 0 });
    }
    Ok(ids)
}

/// [`Tokenizer::encode`] with `tok`.
fn encode(tok: &tokenizers::Tokenizer, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
    let enc = tok.encode(text, add_special_tokens).map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
    Ok(enc.get_ids().to_vec())
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
