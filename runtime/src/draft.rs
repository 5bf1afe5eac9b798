//! Drafts for speculative decoding: cheap guesses of the next tokens, which
//! one verify pass of the model ([`crate::model::Model::verify`]) checks
//! together (`crate::generate`). A draft never changes the text: every
//! token is the one the model samples (see `generate_until`).

/// Which draft speculative decoding uses (`nflash run --speculate-draft`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftKind {
    /// No speculative decoding: one forward pass per token.
    #[default]
    Off,
    /// Prompt lookup: the tokens that followed the latest earlier
    /// occurrence of the context's last n-gram ([`lookup`]); no model.
    Lookup,
}

impl DraftKind {
    /// Every value, with its command-line name.
    pub const ALL: [(DraftKind, &'static str); 2] = [(DraftKind::Off, "off"), (DraftKind::Lookup, "lookup")];

    /// The name used in flags and statistics (`off`, `lookup`).
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(k, _)| *k == self).map_or("off", |(_, n)| n)
    }
}

impl std::str::FromStr for DraftKind {
    type Err = crate::error::Error;

    /// `off` or `lookup`.
    fn from_str(s: &str) -> crate::error::Result<Self> {
        Self::ALL
            .iter()
            .find(|(_, name)| *name == s)
            .map(|(v, _)| *v)
            .ok_or_else(|| crate::error::Error::Usage(format!("unknown draft {s:?}: expected off or lookup")))
    }
}

/// Speculative-decoding settings of one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecOptions {
    /// The draft.
    pub draft: DraftKind,
    /// Most tokens drafted per verify pass (K; the pass runs K + 1 tokens).
    pub max_draft: usize,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions { draft: DraftKind::Off, max_draft: DEFAULT_DRAFT_TOKENS }
    }
}

/// Default K: tokens drafted per verify pass.
pub const DEFAULT_DRAFT_TOKENS: usize = 4;

/// Largest K accepted (`--draft-tokens`, libnflash's `params.draft_tokens`).
pub const MAX_DRAFT_TOKENS: usize = 16;

/// Longest n-gram prompt lookup matches (tokens); it tries n = 3, 2, 1 in
/// turn, as llama.cpp's `lookup` example and prompt-lookup decoding
/// (Saxena 2023) do.
pub const LOOKUP_MAX_NGRAM: usize = 3;

/// Prompt-lookup draft: for n from [`LOOKUP_MAX_NGRAM`] down to 1, finds the
/// latest earlier occurrence in `context` (token ids: the prompt and the
/// text so far) of its last n tokens that `k` tokens follow (else the
/// latest one, followed by fewer), and puts the (at most `k`) tokens that
/// followed it into `out` (cleared first). Empty when no n-gram recurs.
/// Cost: one backward scan of `context` per n, O(len × n).
pub fn lookup(context: &[u32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = context.len();
    if k == 0 || len < 2 {
        return;
    }
    for n in (1..=LOOKUP_MAX_NGRAM.min(len - 1)).rev() {
        let tail = &context[len - n..];
        let at = |i: usize| &context[i..i + n] == tail;
        // Starts i < len - n of the n-gram: the latest with k tokens after
        // it, else the latest (inside a run of repeats, the one just before
        // the tail, which only the tail follows).
        let full = (0..(len - n).saturating_sub(k).min(len - n)).rev().find(|&i| i + n + k <= len && at(i));
        if let Some(i) = full.or_else(|| (0..len - n).rev().find(|&i| at(i))) {
            let from = i + n;
            out.extend_from_slice(&context[from..(from + k).min(len)]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(context: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        lookup(context, k, &mut out);
        out
    }

    #[test]
    fn lookup_continues_the_latest_longest_match() {
        // "1 2 3" recurs: what followed its latest earlier occurrence.
        assert_eq!(draft(&[1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2), vec![7, 8]);
        // Only the last token recurs: a 1-gram match.
        assert_eq!(draft(&[5, 6, 7, 8, 6], 3), vec![7, 8, 6]);
        // k caps the draft; the draft may run into the tail itself.
        assert_eq!(draft(&[1, 2, 1, 2], 5), vec![1, 2]);
        // In a run of repeats, an occurrence that k tokens follow.
        assert_eq!(draft(&[9, 7, 7, 7, 7, 7, 7, 7], 3), vec![7, 7, 7]);
        // Else the latest, followed by fewer.
        assert_eq!(draft(&[9, 7, 7, 7, 7], 3), vec![7]);
        // A 3-gram beats a later 1-gram.
        assert_eq!(draft(&[4, 5, 6, 0, 6, 1, 4, 5, 6], 1), vec![0]);
    }

    #[test]
    fn lookup_drafts_nothing_without_a_recurrence() {
        assert!(draft(&[1, 2, 3, 4], 4).is_empty());
        assert!(draft(&[7], 4).is_empty());
        assert!(draft(&[], 4).is_empty());
        assert!(draft(&[3, 3], 0).is_empty());
    }
}
