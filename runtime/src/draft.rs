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
    /// Self-speculation from memory: the model itself on the neurons it
    /// holds in memory (hot, and cold clusters already cached), with no
    /// flash reads ([`self_draft`]); greedy guesses.
    SelfDraft,
    /// Prompt lookup where it pays: [`Adaptive`] picks K from the
    /// acceptance seen so far and drafts nothing while the expected gain
    /// does not cover a verify pass's cost (counts only, no clocks). With a
    /// draft pack (`nflash run --draft PACK`) the pack guesses, under the
    /// same controller with its passes' cost counted.
    Auto,
    /// A draft pack: a small model with the same tokenizer, all in memory,
    /// with its own KV cache ([`DraftCache`]); greedy guesses.
    Pack,
}

impl DraftKind {
    /// Every value, with its command-line name.
    pub const ALL: [(DraftKind, &'static str); 5] = [
        (DraftKind::Off, "off"),
        (DraftKind::Auto, "auto"),
        (DraftKind::Lookup, "lookup"),
        (DraftKind::SelfDraft, "self"),
        (DraftKind::Pack, "pack"),
    ];

    /// The draft that makes the guesses: [`DraftKind::Lookup`] for
    /// [`DraftKind::Auto`], else itself.
    pub fn source(self) -> DraftKind {
        if self == DraftKind::Auto {
            DraftKind::Lookup
        } else {
            self
        }
    }

    /// The name used in flags and statistics (`off`, `auto`, `lookup`, `self`, `pack`).
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(k, _)| *k == self).map_or("off", |(_, n)| n)
    }
}

impl std::str::FromStr for DraftKind {
    type Err = crate::error::Error;

    /// `off`, `auto`, `lookup`, `self` or `pack`.
    fn from_str(s: &str) -> crate::error::Result<Self> {
        Self::ALL.iter().find(|(_, name)| *name == s).map(|(v, _)| *v).ok_or_else(|| {
            crate::error::Error::Usage(format!("unknown draft {s:?}: expected off, auto, lookup, self or pack"))
        })
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
/// followed it into `out` (cleared first). Returns n, the length of the
/// match (0, and `out` empty, when no n-gram recurs). Cost: one backward
/// scan of `context` per n, O(len × n).
pub fn lookup(context: &[u32], k: usize, out: &mut Vec<u32>) -> usize {
    out.clear();
    let len = context.len();
    if k == 0 || len < 2 {
        return 0;
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
            return n;
        }
    }
    0
}

/// What one more token of a verify pass costs, in decode steps, as `auto`
/// counts it when the model is in memory: a pass of K + 1 tokens costs
/// `1 + β·K` steps. A verify pass computes each token with decode's
/// kernels; `make bench-speculate` (docs/benchmarks.md, 2026-12-06 21:40)
/// measured 0.47–0.68 per extra token in memory with SmolLM2-135M Q4_0, and
/// prompt lookup in memory won on one prompt of four (1.16×, acceptance
/// 0.68) and lost on three (0.74–0.93×). With 0.6 here, `auto`'s probes
/// cost 4–8% in memory and never paid on those prompts (the same
/// benchmark's `results-auto-beta-0.6.json`); 1.0 keeps `auto` from
/// drafting in memory at all (`--speculate-draft lookup` still drafts
/// there, for text that repeats itself).
pub const VERIFY_TOKEN_COST_IN_MEMORY: f64 = 1.0;

/// [`VERIFY_TOKEN_COST_IN_MEMORY`] when the model reads neuron clusters
/// from flash: the pass reads the clusters its tokens share once, and
/// their reads overlap the compute, so an extra token costs less than in
/// memory (0.19–0.53 at bench-offload's limits (b) and (c) in the same
/// benchmark; 0.44 for the synthetic 7B at bench-scale's (b)).
pub const VERIFY_TOKEN_COST_OFFLOAD: f64 = 0.5;

/// Lookup matches of one length that [`Adaptive`] first lets pass without
/// drafting (decoding plainly) after a pass of that length that did not
/// pay (doubling after each probe that still does not, up to
/// [`ADAPTIVE_MAX_PAUSE`]).
pub const ADAPTIVE_PAUSE: usize = 8;

/// Longest pause of [`Adaptive`], matches of one length.
pub const ADAPTIVE_MAX_PAUSE: usize = 64;

/// Weight each earlier verify pass keeps in [`Adaptive`]'s counts per later
/// pass (about the last ten passes count).
const ADAPTIVE_DECAY: f64 = 0.9;

/// The `auto` draft's controller: chooses K for each verify pass from the
/// acceptance seen so far after lookup matches of the same length, or 0
/// (decode plainly) where speculation would cost more than it saves. It
/// uses counts only, so a seeded run makes the same choices on every
/// machine.
///
/// Model: each guess is accepted with probability `p` until the first
/// rejection (a geometric run), so a pass with K guesses yields
/// `E(K) = (1 − p^(K+1)) / (1 − p)` tokens for a cost of `1 + β·K` decode
/// steps (β: [`VERIFY_TOKEN_COST_IN_MEMORY`] or
/// [`VERIFY_TOKEN_COST_OFFLOAD`]). `p` is estimated apart for each match
/// length n (1 to [`LOOKUP_MAX_NGRAM`] tokens; [`lookup`] returns it): a
/// guess that continues a 3-gram is far likelier than one that continues a
/// lone recurring token (on `make bench-speculate`'s summary prompt, 74%
/// of first guesses after a 3-gram match against 23% after a 1-gram one).
/// Each estimate is accepted guesses over accepted guesses plus
/// rejections (the maximum-likelihood estimate for such runs), decayed per
/// pass, starting from one of each. K is the one that maximizes
/// `E(K) / (1 + β·K)`; when even that is at most 1 (a plain step's yield),
/// matches of that length draft nothing for the next [`ADAPTIVE_PAUSE`]
/// times they occur (doubling while probes still do not pay), then probe
/// again.
#[derive(Debug, Clone)]
pub struct Adaptive {
    /// Per match length (index n − 1).
    arms: [Arm; LOOKUP_MAX_NGRAM],
    beta: f64,
    max_k: usize,
}

/// [`Adaptive`]'s counts for one match length.
#[derive(Debug, Clone, Copy)]
struct Arm {
    accepted: f64,
    rejected: f64,
    pause: usize,
    wait: usize,
}

impl Adaptive {
    /// A controller for at most `max_k` guesses per pass; `offload`: the
    /// model reads neuron clusters from flash. A draft made by a model adds
    /// its passes' cost ([`Self::with_draft_cost`]).
    pub fn new(max_k: usize, offload: bool) -> Self {
        let beta = if offload { VERIFY_TOKEN_COST_OFFLOAD } else { VERIFY_TOKEN_COST_IN_MEMORY };
        let arm = Arm { accepted: 1.0, rejected: 1.0, pause: ADAPTIVE_PAUSE, wait: 0 };
        Adaptive { arms: [arm; LOOKUP_MAX_NGRAM], beta, max_k }
    }

    /// Counts each guess's draft pass too: `cost` decode steps of the model
    /// (a draft pack: [`DraftModel::cost`]), added to β. `auto` with a draft
    /// pack keeps one arm (match length 1) for all its guesses.
    pub fn with_draft_cost(mut self, cost: f64) -> Self {
        self.beta += cost.max(0.0);
        self
    }

    /// The arm of match length `n` (clamped to 1 ..= [`LOOKUP_MAX_NGRAM`]).
    fn arm(&mut self, n: usize) -> &mut Arm {
        &mut self.arms[n.clamp(1, LOOKUP_MAX_NGRAM) - 1]
    }

    /// The estimated chance that a guess after a match of `n` tokens is
    /// accepted, given the ones before it were.
    pub fn acceptance(&self, n: usize) -> f64 {
        let a = &self.arms[n.clamp(1, LOOKUP_MAX_NGRAM) - 1];
        a.accepted / (a.accepted + a.rejected)
    }

    /// The best K (1..=max_k) after a match of `n` tokens for the current
    /// estimate, and its expected tokens per decode step's cost (above 1:
    /// speculation pays).
    pub fn best(&self, n: usize) -> (usize, f64) {
        let p = self.acceptance(n);
        let mut best = (1, 0.0);
        for k in 1..=self.max_k.max(1) {
            let yield_ = (1.0 - p.powi(k as i32 + 1)) / (1.0 - p).max(1e-9);
            let gain = yield_ / (1.0 + self.beta * k as f64);
            if gain > best.1 {
                best = (k, gain);
            }
        }
        best
    }

    /// Whether any acceptance could pay: a pass whose every guess is kept
    /// yields more per cost than a plain step (never with β ≥ 1).
    pub fn can_pay(&self) -> bool {
        let k = self.max_k.max(1) as f64;
        (k + 1.0) / (1.0 + self.beta * k) > 1.0
    }

    /// Guesses to draft after a lookup match of `n` tokens: 0 while that
    /// length is paused (decode plainly), and always where no acceptance
    /// could pay ([`Self::can_pay`]).
    pub fn next_k(&mut self, n: usize) -> usize {
        if !self.can_pay() {
            return 0;
        }
        let arm = self.arm(n);
        if arm.wait > 0 {
            arm.wait -= 1;
            return 0;
        }
        self.best(n).0
    }

    /// Records a verify pass after a match of `n` tokens that checked
    /// `drafted` guesses and kept `kept` of them, and pauses that length
    /// if speculation after it no longer pays.
    pub fn record(&mut self, n: usize, drafted: usize, kept: usize) {
        if drafted == 0 {
            return;
        }
        let arm = self.arm(n);
        arm.accepted = arm.accepted * ADAPTIVE_DECAY + kept as f64;
        arm.rejected = arm.rejected * ADAPTIVE_DECAY + (kept < drafted) as u8 as f64;
        let pays = self.best(n).1 > 1.0;
        let arm = self.arm(n);
        if pays {
            arm.pause = ADAPTIVE_PAUSE;
        } else {
            arm.wait = arm.pause;
            arm.pause = (arm.pause * 2).min(ADAPTIVE_MAX_PAUSE);
        }
    }
}

/// Self-speculation draft: runs `first` (the last sampled token, at
/// position `kv.len()`) and then each guess through the model on its
/// resident neurons only ([`crate::model::Model::draft`], no flash reads),
/// and puts the argmax of each pass's logits into `out` (cleared first):
/// at most `k` guesses, ending before one in `stop_ids` or with non-finite
/// logits. The guesses are point masses, checked against the model's own
/// samples (`crate::generate`), because what is resident depends on run-time
/// state (reads in flight, memory pressure): drawing guesses from the
/// draft's distribution for speculative sampling
/// ([`crate::sampler::Sampler::accept_or_resample`]) would make a seeded
/// run's text depend on it. The passes write the KV cache past
/// `kv.len()`; it is truncated back before this returns, so the verify pass
/// finds it as it was. Returns the draft passes run.
///
/// # Errors
/// Model errors (a failed pass).
pub fn self_draft(
    model: &crate::model::Model,
    kv: &mut crate::model::kv_cache::KvCache,
    first: u32,
    k: usize,
    stop_ids: &[u32],
    out: &mut Vec<u32>,
) -> crate::error::Result<usize> {
    out.clear();
    let base = kv.len();
    kv.hold(Some(base));
    let mut passes = 0;
    let result = (|| {
        let mut t = first;
        while out.len() < k {
            let hs = model.draft(kv, t)?;
            passes += 1;
            let logits = model.logits(&hs);
            if !logits.iter().all(|v| v.is_finite()) {
                break;
            }
            t = crate::sampler::argmax(&logits);
            if stop_ids.contains(&t) {
                break;
            }
            out.push(t);
        }
        Ok(passes)
    })();
    kv.hold(None);
    kv.truncate(base);
    result
}

/// A draft pack's model, attached to the engine it drafts for
/// (`Engine::attach_draft`).
pub struct DraftModel<'a> {
    /// The draft model, all in memory.
    pub model: crate::model::Model<'a>,
    /// What one of its forward passes costs, in decode steps of the model
    /// it drafts for, as `auto` counts it ([`Adaptive::with_draft_cost`]):
    /// its pack's bytes over the model's (counts, no clocks).
    pub cost: f64,
}

/// A draft pack's KV cache and the token ids in it, for
/// [`DraftKind::Pack`]: the draft model (all in memory) follows the text
/// the target model commits, catching up on the tokens it has not seen
/// before each draft and dropping the guesses the verify pass rejected
/// (the longest prefix it shares with the text is kept).
pub struct DraftCache {
    kv: crate::model::kv_cache::KvCache,
    /// The ids in `kv`, one per position.
    ids: Vec<u32>,
    /// Catch-ups that found the shared prefix gone from a sliding-window
    /// layer's KV ring and ran the text from the start.
    restarts: usize,
}

impl DraftCache {
    /// An empty cache of `capacity` tokens for the draft `model`.
    ///
    /// # Errors
    /// [`crate::Error::KvCache`] when the KV cache cannot be reserved.
    pub fn new(model: &crate::model::Model, capacity: usize) -> crate::error::Result<Self> {
        Ok(DraftCache { kv: model.try_new_kv_cache(capacity)?, ids: Vec::new(), restarts: 0 })
    }

    /// Tokens in the draft's KV cache.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Catch-ups ([`Self::catch_up`]) that could not roll a sliding-window
    /// layer's KV ring back to the prefix shared with the text and ran the
    /// text from the start instead (slower, same guesses).
    pub fn restarts(&self) -> usize {
        self.restarts
    }

    /// Whether the draft's KV cache is empty.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Makes the draft's KV cache hold `text` (token ids): keeps the
    /// longest prefix it shares with `text` and runs the rest through the
    /// draft `model`, in prefill passes of
    /// [`nflash_plan::layout::prefill_chunk`] tokens. It stops before an id
    /// past the draft's embedding rows (the model's may be more: padded
    /// vocabularies), so it then holds less than `text`. Returns the passes run.
    ///
    /// # Errors
    /// The draft model's errors (a failed pass; the cache is then emptied).
    pub fn catch_up(&mut self, model: &crate::model::Model, text: &[u32]) -> crate::error::Result<usize> {
        let same = self.ids.iter().zip(text).take_while(|(a, b)| a == b).count();
        let kept = self.kv.truncate(same);
        self.restarts += usize::from(kept < same);
        self.ids.truncate(kept);
        let known =
            text[kept..].iter().position(|&t| u64::from(t) >= model.cfg.vocab_size).map_or(text.len(), |i| kept + i);
        let mut passes = 0;
        for chunk in text[kept..known].chunks(nflash_plan::layout::prefill_chunk(&model.cfg)) {
            if let Err(e) = model.forward(&mut self.kv, chunk) {
                self.kv.truncate(0);
                self.ids.clear();
                return Err(e);
            }
            self.ids.extend_from_slice(chunk);
            passes += 1;
        }
        Ok(passes)
    }

    /// Guesses up to `k` tokens after `text` (the token ids the target
    /// model has committed: its KV cache's and the last sampled token)
    /// with the draft `model`, greedily (argmax, as [`self_draft`]'s
    /// guesses and for the same reason), into `out` (cleared first). First
    /// the draft catches up ([`Self::catch_up`]) on `text` less its last
    /// token, then runs that token and each guess but the last, one
    /// decode pass each. Drafting ends early before a
    /// guess in `stop_ids` or at or past `vocab` (the target's vocabulary),
    /// at non-finite logits, or where the draft's KV cache is full; it
    /// guesses nothing after an id past the draft's embedding rows.
    /// Returns the draft's forward passes.
    ///
    /// # Errors
    /// The draft model's errors (a failed pass).
    pub fn propose(
        &mut self,
        model: &crate::model::Model,
        text: &[u32],
        k: usize,
        stop_ids: &[u32],
        vocab: u64,
        out: &mut Vec<u32>,
    ) -> crate::error::Result<usize> {
        out.clear();
        let Some((&last, before)) = text.split_last() else { return Ok(0) };
        // Room for `text` and all but the last guess.
        let k = k.min((self.kv.capacity() + 1).saturating_sub(text.len()));
        if k == 0 {
            return Ok(0);
        }
        let mut passes = self.catch_up(model, before)?;
        if self.ids.len() < before.len() || u64::from(last) >= model.cfg.vocab_size {
            // The text holds an id the draft has no embedding for: no guess.
            return Ok(passes);
        }
        // A sliding-window layer keeps the rows the next catch-up may
        // truncate back to (the guesses are run one at a time).
        self.kv.hold(Some(self.ids.len()));
        let guessed = (|| {
            let mut t = last;
            loop {
                let hs = model.forward(&mut self.kv, &[t])?;
                self.ids.push(t);
                passes += 1;
                let logits = model.logits(&hs);
                if !logits.iter().all(|v| v.is_finite()) {
                    break;
                }
                t = crate::sampler::argmax(&logits);
                if stop_ids.contains(&t) || u64::from(t) >= vocab {
                    break;
                }
                out.push(t);
                if out.len() == k {
                    break;
                }
            }
            Ok(passes)
        })();
        self.kv.hold(None);
        if guessed.is_err() {
            // A failed pass may have left rows uncommitted: start over next time.
            self.kv.truncate(0);
            self.ids.clear();
        }
        guessed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(context: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let n = lookup(context, k, &mut out);
        assert_eq!(n == 0, out.is_empty(), "a match length is returned with a draft");
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
        // A 3-gram beats a later 1-gram, and its length is returned.
        assert_eq!(draft(&[4, 5, 6, 0, 6, 1, 4, 5, 6], 1), vec![0]);
        let mut out = Vec::new();
        assert_eq!(lookup(&[4, 5, 6, 0, 6, 1, 4, 5, 6], 1, &mut out), 3);
        assert_eq!(lookup(&[5, 6, 7, 8, 6], 3, &mut out), 1);
        assert_eq!(lookup(&[1, 2, 9, 1, 2], 3, &mut out), 2);
        assert_eq!(out, vec![9, 1, 2]);
    }

    /// High acceptance: long drafts; low: pauses that grow, then a probe;
    /// recovery resets the pause. Each match length keeps its own counts.
    /// The choices follow the counts alone.
    #[test]
    fn adaptive_k_follows_acceptance_and_pauses_where_it_does_not_pay() {
        // A draft pass that costs a tenth of a step still pays offloaded;
        // one as dear as half a step (β + 0.5 ≥ 1) never does.
        assert!(Adaptive::new(4, true).with_draft_cost(0.1).can_pay());
        assert!(!Adaptive::new(4, true).with_draft_cost(0.5).can_pay());
        // In memory no acceptance pays: nothing is ever drafted.
        let mut never = Adaptive::new(8, false);
        assert!(!never.can_pay());
        for _ in 0..100 {
            assert_eq!(never.next_k(3), 0);
            never.record(3, 4, 4);
        }
        let mut a = Adaptive::new(8, true);
        // The prior (one accepted, one rejected): p = 0.5 pays only a little.
        assert_eq!(a.best(3).0, 1);
        for _ in 0..20 {
            let k = a.next_k(3);
            assert!(k > 0);
            a.record(3, k, k);
        }
        assert!(a.acceptance(3) > 0.9, "{}", a.acceptance(3));
        assert_eq!(a.next_k(3), 8, "every guess accepted: the longest draft");
        // 3-gram matches learned nothing about 1-gram ones.
        assert_eq!(a.acceptance(1), 0.5);
        assert_eq!(a.next_k(1), 1);
        // Every first guess after a 1-gram rejected: those stop drafting,
        // while 3-gram matches keep their long drafts.
        let mut paused = 0;
        for _ in 0..40 {
            match a.next_k(1) {
                0 => paused += 1,
                k => a.record(1, k, 0),
            }
        }
        assert!(a.best(1).1 <= 1.0 && paused >= 20, "paused {paused} of 40 matches");
        assert_eq!(a.next_k(3), 8, "a 1-gram's rejections leave 3-gram drafts alone");
        // Pauses double up to the cap.
        let waits: Vec<usize> = (0..3)
            .map(|_| {
                let mut n = 0;
                while a.next_k(1) == 0 {
                    n += 1;
                }
                a.record(1, 1, 0);
                n
            })
            .collect();
        assert!(waits.windows(2).all(|w| w[1] >= w[0]) && waits[2] <= ADAPTIVE_MAX_PAUSE, "{waits:?}");
        // Lengths beyond the longest n-gram share its counts.
        assert_eq!(a.acceptance(LOOKUP_MAX_NGRAM + 2), a.acceptance(LOOKUP_MAX_NGRAM));
        // Offload makes extra tokens cheaper than in memory: a lower acceptance pays.
        let (mut mem, mut off) = (Adaptive::new(4, false), Adaptive::new(4, true));
        for _ in 0..10 {
            mem.record(2, 2, 1);
            off.record(2, 2, 1);
        }
        assert!(off.best(2).1 > mem.best(2).1);
        // A middling acceptance (1 of 2 per pass) is about break-even offloaded.
        assert!((off.best(2).1 - 1.0).abs() < 0.2, "{}", off.best(2).1);
        // The same outcomes give the same choices.
        let run = || {
            let mut a = Adaptive::new(6, true);
            (0..50)
                .map(|i| {
                    let n = 1 + i % 3;
                    let k = a.next_k(n);
                    a.record(n, k, (i * 7 % 5).min(k));
                    k
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn lookup_drafts_nothing_without_a_recurrence() {
        assert!(draft(&[1, 2, 3, 4], 4).is_empty());
        assert!(draft(&[7], 4).is_empty());
        assert!(draft(&[], 4).is_empty());
        assert!(draft(&[3, 3], 0).is_empty());
    }
}
