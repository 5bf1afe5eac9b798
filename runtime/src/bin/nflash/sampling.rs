//! The sampling and speculative-decoding flags shared by `nflash run` and `nflash serve`.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::builder::TypedValueParser;
use clap::Args;
use nflash_runtime::draft::{DraftKind, SpecOptions};
use nflash_runtime::generate::GenStats;
use nflash_runtime::sampler::{self, SamplerConfig};

/// Sampling options; each defaults to the checkpoint's
/// `generation_config.json` value stored in the pack (SPEC §4.9), else
/// nflash's own default.
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature, a finite number ≥ 0; 0 = greedy (deterministic)
    /// [default: the checkpoint's generation_config.json value stored in the pack, else 0.8].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_temperature)]
    pub temperature: Option<f32>,
    /// Sample from the k most likely tokens, 0 = all
    /// [default: the checkpoint's generation_config.json value stored in the pack, else 40].
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<usize>,
    /// Nucleus sampling mass in (0, 1], 1 = off
    /// [default: the checkpoint's generation_config.json value stored in the pack, else 0.95].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_top_p)]
    pub top_p: Option<f32>,
    /// RNG seed (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
}

/// `--temperature`: a finite number ≥ 0.
fn parse_temperature(s: &str) -> std::result::Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if sampler::valid_temperature(t) => Ok(t),
        _ => Err("must be a finite number ≥ 0 (0 = greedy), e.g. 0.7".into()),
    }
}

/// `--top-p`: a number in (0, 1].
fn parse_top_p(s: &str) -> std::result::Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if sampler::valid_top_p(p) => Ok(p),
        _ => Err("must be a number in (0, 1] (1 = off), e.g. 0.9".into()),
    }
}

impl SamplingArgs {
    /// The sampler settings in force and where each came from: the flag,
    /// the pack (the checkpoint's generation_config.json), or nflash's
    /// default. The seed is `--seed`, else the clock.
    pub fn resolve(&self, g: &nflash_format::GenerationDefaults) -> (SamplerConfig, [&'static str; 3]) {
        fn pick<T>(flag: Option<T>, pack: Option<T>, default: T) -> (T, &'static str) {
            match (flag, pack) {
                (Some(v), _) => (v, "flag"),
                (None, Some(v)) => (v, "pack: generation_config.json"),
                (None, None) => (default, "nflash default"),
            }
        }
        let seed = self.seed.unwrap_or_else(clock_seed);
        let (temperature, st) = pick(self.temperature, g.temperature, sampler::DEFAULT_TEMPERATURE);
        let (top_k, sk) = pick(self.top_k, g.top_k.map(|k| k as usize), sampler::DEFAULT_TOP_K);
        let (top_p, sp) = pick(self.top_p, g.top_p, sampler::DEFAULT_TOP_P);
        (SamplerConfig { temperature, top_k, top_p, seed }, [st, sk, sp])
    }
}

/// A seed from the clock, nanoseconds.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// The speculative-decoding keys of `--stats-json` and of serve's
/// `timings`, from one generation's counters: `decode_passes`,
/// `decode_tokens`, `speculate_draft`, `draft_tokens`, `accepted_tokens`,
/// `acceptance_rate`, `acceptance_by_draft` (per draft kind that guessed:
/// tokens drafted and accepted and the rate; empty without speculation),
/// `draft_passes`, `verify_passes`, `draft_seconds`, `verify_seconds`.
pub fn speculation_json(st: &GenStats) -> serde_json::Map<String, serde_json::Value> {
    let mut by_draft = serde_json::Map::new();
    if st.draft != DraftKind::Off {
        by_draft.insert(
            st.draft_source.name().to_string(),
            serde_json::json!({"draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
                "acceptance_rate": st.acceptance_rate()}),
        );
    }
    match serde_json::json!({
        "decode_passes": st.decode_steps,
        "decode_tokens": st.decode_tokens,
        "speculate_draft": st.draft.name(),
        "draft_tokens": st.draft_tokens,
        "accepted_tokens": st.accepted_tokens,
        "acceptance_rate": st.acceptance_rate(),
        "acceptance_by_draft": by_draft,
        "draft_passes": st.draft_passes,
        "verify_passes": st.verify_passes,
        "draft_seconds": st.draft_s,
        "verify_seconds": st.verify_s,
    }) {
        serde_json::Value::Object(m) => m,
        _ => unreachable!("a JSON object literal"),
    }
}

/// Speculative-decoding options (`nflash_runtime::draft`).
#[derive(Args, Clone, Debug)]
pub struct SpeculateArgs {
    /// Speculative decoding: a draft guesses up to --draft-tokens next
    /// tokens and one verify pass of the model checks them all, each with
    /// decode's arithmetic, so the text is the same as without. off; auto,
    /// the default (prompt lookup where it pays: K follows the acceptance so
    /// far after matches of the same length, and drafting pauses where a
    /// verify pass would cost more than it saves; in memory it never
    /// drafts);
    /// lookup (prompt lookup: what followed the latest earlier occurrence of
    /// the last 1–3 tokens; pays where the output repeats the prompt or
    /// itself, as summaries, extraction and code edits do), or self
    /// (self-speculation: the model on the neurons it holds in memory, no
    /// flash reads; pays where decode reads much from flash and much of a
    /// sparse pack is resident), or pack (a draft pack's guesses: --draft;
    /// with --draft, auto drafts with it where its acceptance so far pays
    /// for its passes and the verify pass: never in memory). Not the same
    /// as --speculate, the prefetch of neuron clusters.
    #[arg(
        long,
        default_value = "auto",
        value_parser = clap::builder::PossibleValuesParser::new(DraftKind::ALL.map(|(_, name)| name)).try_map(|s| s.parse::<DraftKind>())
    )]
    pub speculate_draft: DraftKind,
    /// Most tokens a draft guesses per verify pass (K; the pass runs K + 1
    /// tokens) [default: 4].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=nflash_runtime::draft::MAX_DRAFT_TOKENS as i64).map(usize::from))]
    pub draft_tokens: Option<usize>,
    /// A draft pack (from `prep convert`): a small model with the model's
    /// tokenizer (the same family, e.g. SmolLM2-135M for a larger SmolLM2)
    /// whose greedy guesses verify passes check. It is held all in memory,
    /// with a KV cache of its own, inside --memory-budget (--stats shows
    /// its share of the fixed region).
    #[arg(long, value_name = "PACK")]
    pub draft: Option<PathBuf>,
}

impl SpeculateArgs {
    /// The generation's speculative-decoding settings (`auto` drafts
    /// with the --draft pack where one is given).
    pub fn options(&self) -> SpecOptions {
        SpecOptions {
            draft: self.speculate_draft,
            max_draft: self.draft_tokens.unwrap_or(nflash_runtime::draft::DEFAULT_DRAFT_TOKENS),
        }
    }

    /// Checks that --draft and --speculate-draft agree; notes a
    /// --draft-tokens that `off` leaves unused (a sweep over drafts with
    /// one K passes both, so it is not refused).
    ///
    /// # Errors
    /// `pack` without --draft, or --draft with a draft that does not use it.
    pub fn check(&self) -> Result<()> {
        if let (DraftKind::Off, Some(k)) = (self.speculate_draft, self.draft_tokens) {
            nflash_runtime::message!("note: --draft-tokens {k} is unused: --speculate-draft off drafts no tokens");
        }
        match (self.speculate_draft, &self.draft) {
            (DraftKind::Pack, None) => {
                bail!("--speculate-draft pack needs a draft pack: pass --draft PACK (a small model with the same tokenizer)")
            }
            (DraftKind::Auto | DraftKind::Pack, _) | (_, None) => Ok(()),
            (d, Some(p)) => bail!(
                "--draft {} is used by --speculate-draft pack (or auto), not {}; drop one of them",
                p.display(),
                d.name()
            ),
        }
    }
}
