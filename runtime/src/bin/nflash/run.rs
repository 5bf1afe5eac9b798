//! `nflash run`: generate from a prompt, or chat interactively.

use nflash_runtime::pressure::Watch;
use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::builder::TypedValueParser;
use clap::Args;
use nflash_runtime::chat::{ChatOptions, ContentTokens, Message};
use nflash_runtime::draft::{DraftCache, DraftKind};
use nflash_runtime::generate::{generate_with_draft, GenStats, GenerateOptions, PackDraft};
use nflash_runtime::model::predictor::SparsitySummary;
use nflash_runtime::model::Speculation;
use nflash_runtime::sampler::Sampler;
use nflash_runtime::session::Session;
use nflash_runtime::stats::{peak_rss_bytes, percentile};
use nflash_runtime::{Engine, Model};

use crate::common::{check_output, context_len, in_pool, open_pack, read_text, write_atomic, Verify};
use crate::memory::{load_engine, MemoryArgs};
use crate::sampling::{SamplingArgs, SpeculateArgs};
use nflash_runtime::{message, message_part};

/// Arguments of `nflash run`.
#[derive(Args)]
pub struct RunArgs {
    /// The .nflash pack (from `prep convert`).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text. Without --prompt or --prompt-file, start an interactive chat.
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from a UTF-8 file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Wrap the prompt in the pack's chat template as a user message. This is
    /// the default when the pack has a template (instruct models); with the
    /// flag, a pack without one is an error.
    #[arg(long, conflicts_with = "raw")]
    chat: bool,
    /// Send the prompt as is, without the chat template (a BOS token first if
    /// the tokenizer asks for one).
    #[arg(long)]
    raw: bool,
    /// System message for the chat template (not with --raw).
    #[arg(long, conflicts_with = "raw")]
    system: Option<String>,
    /// In chats, tokenize special-token text in messages (e.g. `<|im_end|>`)
    /// as the control tokens it spells, as Hugging Face's apply_chat_template
    /// does; by default it is plain text (not with --raw, where the prompt is
    /// always tokenized as given, control tokens included).
    #[arg(long, conflicts_with = "raw")]
    special_tokens_in_content: bool,
    /// The chat template's `enable_thinking`: `false` makes Qwen3 and
    /// SmolLM3 answer without a `<think>` section; unset leaves the
    /// template's default (thinking). Templates without it ignore it.
    #[arg(long, value_name = "true|false", conflicts_with = "raw")]
    enable_thinking: Option<bool>,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Compute threads (default: the big cores where a phone has big and
    /// little ones, pinned there; else all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Context length in tokens (KV cache size); default: the pack plan's, else min(4096, model maximum).
    #[arg(long)]
    ctx: Option<usize>,
    /// Print speed and memory figures to stderr.
    #[arg(long)]
    stats: bool,
    /// Write speed and memory figures as one JSON object to this file.
    #[arg(long)]
    stats_json: Option<PathBuf>,
    /// Checksums to check: lazy = each neuron cluster's CRC-32C after it is
    /// read, before it is used; full = that and every segment's CRC-32 at
    /// start (reads the whole file; `--verify` alone means full); off = no
    /// cluster checks (to measure their cost).
    #[arg(long, value_enum, default_value = "lazy", num_args = 0..=1, default_missing_value = "full")]
    verify: Verify,
    /// Do not stop at end-of-sequence tokens (for benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Decode densely (every FFN neuron) even if the pack is sparse, for comparison.
    #[arg(long)]
    dense: bool,
    /// Speculative prefetch: read the next layer's likely cold neuron clusters
    /// while its attention runs. auto = on in dense layers where the read
    /// wait it would hide (measured so far) outweighs the predictor time it
    /// costs; in a mixture of experts' layers it only scores its guess (the
    /// routed experts are always read ahead).
    #[arg(
        long,
        default_value = "auto",
        value_parser = clap::builder::PossibleValuesParser::new(Speculation::ALL.map(|(_, name)| name)).try_map(|s| s.parse::<Speculation>())
    )]
    speculate: Speculation,
    #[command(flatten)]
    speculative: SpeculateArgs,
    #[command(flatten)]
    memory: MemoryArgs,
}

pub fn run(a: RunArgs) -> Result<()> {
    in_pool(a.threads, || run_in_pool(a))
}

fn run_in_pool(a: RunArgs) -> Result<()> {
    if let Some(p) = &a.stats_json {
        let mut inputs = vec![a.model.as_path()];
        inputs.extend(a.prompt_file.as_deref());
        check_output(p, "--stats-json", &inputs)?;
    }
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(f)) => Some(read_text(f)?),
        (None, None) => None,
    };
    a.speculative.check()?;
    let device = a.memory.device_profile()?;
    let pack = open_pack(&a.model, a.verify)?;
    let draft = a.speculative.draft.as_deref().map(|p| open_pack(p, a.verify).context("--draft")).transpose()?;
    let ctx = context_len(&pack, a.ctx)?;
    let draft_kind = draft.as_ref().map(|d| (d, a.speculative.speculate_draft));
    let (mut engine, plan) = load_engine(&pack, draft_kind, &a.memory, device, ctx, a.verify.clusters())?;
    if a.stats {
        if let Some(p) = &plan {
            message!(
                "{}\n  (planned at start from this process's measured footprint)",
                nflash_plan::planner::describe(p, pack.manifest())
            );
        }
        if let Some(d) = draft.as_ref().filter(|_| engine.draft.is_some()) {
            message!(
                "  draft pack {}: {:.1} MiB in memory{} (weights, KV cache at ctx {ctx}, scratch)",
                d.path().display(),
                nflash_plan::planner::draft_pack_bytes(d.manifest(), ctx as u32, a.memory.kv) as f64
                    / (1u64 << 20) as f64,
                if plan.is_some() { ", inside the fixed region" } else { "" }
            );
        }
    }
    if a.stats && (a.memory.hot_fraction.is_some() || a.memory.cold_cache.is_some()) {
        let r = engine.model.cache_regions();
        let (hot, cold) = (r.hot_bytes, r.cold_bytes);
        message!(
            "flags override the plan: hot region {:.1} MiB, cold region {:.1} MiB in force",
            hot as f64 / (1u64 << 20) as f64,
            cold as f64 / (1u64 << 20) as f64
        );
    }
    let budget = plan.as_ref().map(|p| p.memory_budget_bytes);
    let watch = crate::memory::follow_memory(&engine, &a.memory, budget);
    engine.model.set_dense(a.dense);
    engine.model.set_speculation(a.speculate);
    let (sampling, sources) = a.sampling.resolve(&engine.generation);
    if a.stats {
        message!(
            "sampling: temperature {} ({}), top-k {} ({}), top-p {} ({})",
            sampling.temperature,
            sources[0],
            sampling.top_k,
            sources[1],
            sampling.top_p,
            sources[2]
        );
    }
    let mut sampler = Sampler::new(sampling);
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        stop_ids: engine.stop_ids.clone(),
        ignore_eos: a.ignore_eos,
        speculate: a.speculative.options(),
        ..Default::default()
    };
    let Some(prompt) = prompt else {
        if a.raw {
            bail!("--raw applies to --prompt or --prompt-file; interactive mode always chats through the template");
        }
        let mut session = Session::new(&engine, ctx)?;
        return interactive(&engine, &mut session, &mut sampler, &opts, &a, budget, watch.as_ref());
    };
    if prompt.trim().is_empty() {
        match &a.prompt_file {
            Some(f) if a.prompt.is_none() => {
                bail!("the prompt is empty: {} holds no text; put the prompt in it, or pass --prompt TEXT", f.display())
            }
            _ => bail!("the prompt is empty; pass text with --prompt or --prompt-file"),
        }
    }
    // Instruct packs (a chat template) chat by default; --raw sends the text as is.
    let chat = !a.raw && (a.chat || engine.template.is_some() || a.system.is_some() || a.enable_thinking.is_some());
    let ids = if chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(Message::new("system", s));
        }
        // A message ends where its text does: a prompt file's final newline is not part of it.
        msgs.push(Message::new("user", prompt.trim_end()));
        engine.encode_chat_with(&msgs, usize::MAX, chat_options(&a))?.with_context(|| {
            format!(
                "this pack has no chat template, so {} cannot apply one; drop it (the prompt is then sent as is), or convert a model whose tokenizer_config.json has chat_template",
                if a.chat { "--chat" } else { "--system" }
            )
        })?
    } else {
        engine.encode_raw(&prompt)?
    };
    let mut kv = engine.model.try_new_kv_cache(ctx)?;
    let mut draft_cache = engine.draft.as_ref().map(|d| DraftCache::new(&d.model, ctx)).transpose()?;
    let pack_draft =
        engine.draft.as_ref().zip(draft_cache.as_mut()).map(|(draft, cache)| PackDraft { draft, cache, history: &[] });
    let mut stdout = std::io::stdout().lock();
    let (_, st) = generate_with_draft(
        &engine.model,
        &mut kv,
        &engine.tokenizer,
        &ids,
        &mut sampler,
        &opts,
        pack_draft,
        |piece| {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
            ControlFlow::Continue(())
        },
    )?;
    let _ = writeln!(stdout);
    report(&a, &st, &engine.model, budget, kv.capacity(), watch.as_ref())
}

/// How chat messages are rendered and tokenized
/// (--special-tokens-in-content, --enable-thinking).
fn chat_options(a: &RunArgs) -> ChatOptions {
    ChatOptions {
        content: if a.special_tokens_in_content { ContentTokens::Special } else { ContentTokens::Text },
        enable_thinking: a.enable_thinking,
    }
}

/// Prints / writes the stats; `budget`: the memory budget in force, bytes;
/// `ctx`: the KV cache's capacity, tokens; `watch`: the memory governor.
fn report(
    a: &RunArgs,
    st: &GenStats,
    model: &Model,
    budget: Option<u64>,
    ctx: usize,
    watch: Option<&Watch>,
) -> Result<()> {
    let (counts, tm) = model.counters();
    let ptm = model.prefill_timings();
    let sparse = model.is_sparse_pack() && !a.dense;
    // Dense decode reports 0% (every neuron read and computed).
    let sparsity = SparsitySummary::new(&counts);
    // Per decode step, milliseconds.
    let per = |s: f64| 1e3 * s / st.decode_tokens.max(1) as f64;
    if let Some(ctx) = st.context_full {
        message!("note: stopped because the context ({ctx} tokens) is full; raise --ctx for longer output");
    }
    let rss = peak_rss_bytes().unwrap_or(0);
    let ms: Vec<f64> = st.step_s.iter().map(|s| s * 1e3).collect();
    let mean_ms = if ms.is_empty() { 0.0 } else { ms.iter().sum::<f64>() / ms.len() as f64 };
    let (p50, p90, p99) = (
        percentile(&ms, 0.5).unwrap_or(0.0),
        percentile(&ms, 0.9).unwrap_or(0.0),
        percentile(&ms, 0.99).unwrap_or(0.0),
    );
    let c = &st.decode_cache;
    let ep = model.expert_prefetch();
    // Per token decode sampled (several per verify pass).
    let steps = st.decode_tokens.max(1) as f64;
    let bytes_per_token = c.bytes_read as f64 / steps;
    // Compute threads wait in parallel: their summed wait over the thread count is wall time.
    let io_wait_share = if st.decode_s > 0.0 {
        (c.io_wait_s / rayon::current_num_threads() as f64 / st.decode_s).min(1.0)
    } else {
        0.0
    };
    let r = model.cache_regions();
    let (hot_b, cold_b, direct) = (r.hot_bytes, r.cold_bytes, r.direct);
    let io_how = match r.io_engine {
        Some(e) => format!("{}, {e}", if direct { "O_DIRECT" } else { "buffered" }),
        None => (if direct { "O_DIRECT" } else { "buffered" }).to_string(),
    };
    let topo = nflash_runtime::cpu::Topology::system();
    if a.stats {
        message!(
            "prefill: {} tokens in {:.3} s, {:.1} tokens/s | decode: {} tokens generated, {} forward passes in {:.3} s, {:.1} tokens/s | peak RSS {:.1} MiB",
            st.prompt_tokens,
            st.prefill_s,
            st.prefill_tokens_per_s(),
            st.generated_tokens,
            st.decode_steps,
            st.decode_s,
            st.decode_tokens_per_s(),
            rss as f64 / (1 << 20) as f64
        );
        if st.draft != DraftKind::Off {
            message!(
                "speculative decoding ({}): {} tokens drafted, {} accepted ({:.1}%), {:.2} tokens per pass; draft {:.3} s, verify passes {:.3} s",
                st.draft.name(),
                st.draft_tokens,
                st.accepted_tokens,
                100.0 * st.acceptance_rate(),
                st.decode_tokens as f64 / st.decode_steps.max(1) as f64,
                st.draft_s,
                st.verify_s
            );
        }
        message!(
            "decode per token: attention {:.2} ms, predictor {:.2} ms, FFN {:.2} ms, lm_head {:.2} ms{}",
            per(tm.attention_s()),
            per(tm.predictor_s),
            per(tm.ffn_s),
            per(tm.lm_head_s),
            sparsity.as_ref().filter(|_| sparse).map_or(String::new(), |s| format!(
                " | FFN sparsity {:.1}%, bundles skipped {:.1}%",
                100.0 * s.ffn_sparsity,
                100.0 * s.bundles_skipped
            ))
        );
        let profile = |t: &nflash_runtime::model::Timings, scale: f64| {
            t.steps().iter().map(|(k, v)| format!("{k} {:.2}", v * scale)).collect::<Vec<_>>().join(", ")
        };
        message!(
            "kernels {} | {} compute threads{} | {} | page size {} KiB",
            nflash_runtime::kernels::isa(),
            rayon::current_num_threads(),
            if let Some(big) = topo.compute_cores(rayon::current_num_threads()) {
                format!(
                    " on the big cores {}, I/O threads on {}",
                    nflash_runtime::cpu::ranges(&big),
                    nflash_runtime::cpu::ranges(&topo.little())
                )
            } else if topo.is_heterogeneous() {
                format!(
                    " (more than the big cores: not pinned), I/O threads on {}",
                    nflash_runtime::cpu::ranges(&topo.little())
                )
            } else {
                String::new()
            },
            topo.describe(),
            nflash_runtime::offload::align::page_size() / 1024
        );
        message!("decode profile, ms per token: {}", profile(&tm, 1e3 / steps));
        if let Some(w) = watch {
            let (lo, hi) = w.held_range();
            let t = model.cache_stats();
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            message!(
                "memory pressure: follows {}; neuron cache held {:.1}-{:.1} MiB of {:.1} MiB; {} shrinks, {} grows, {:.1} MiB given back, {} clusters read again",
                w.signals(),
                mib(lo),
                mib(hi),
                mib(w.ceiling()),
                t.budget_shrinks,
                t.budget_grows,
                mib(t.bytes_returned),
                t.reads_after_shrink
            );
        }
        message!("prefill profile, ms in all: {}", profile(&ptm, 1e3));
        message!(
            "decode latency: mean {mean_ms:.2} ms, P50 {p50:.2} ms, P90 {p90:.2} ms, P99 {p99:.2} ms | neuron cache: hot {:.1} MiB, cold {:.1} MiB ({}), hit rate {:.1}% (hot region {:.1}%), {:.2} MiB read per token in {:.1} reads, I/O wait {:.1}% of decode",
            hot_b as f64 / (1 << 20) as f64,
            cold_b as f64 / (1 << 20) as f64,
            io_how,
            100.0 * c.hit_rate(),
            100.0 * c.hot_hit_rate(),
            bytes_per_token / (1 << 20) as f64,
            c.reads as f64 / steps,
            100.0 * io_wait_share
        );
        if c.misses > 0 {
            message!(
                "read ahead: {:.1}% of the cold misses were read before their layer asked (the next layer's usual clusters, speculative prefetch, a token's later experts)",
                100.0 * c.read_ahead_used as f64 / c.misses as f64
            );
        }
        if c.speculated > 0 {
            message!(
                "speculative prefetch: {:.1} clusters per token, {:.1}% of them used; {:.1}% of the cold misses were read ahead",
                c.speculated as f64 / steps,
                100.0 * c.speculated_used as f64 / c.speculated as f64,
                100.0 * c.speculated_used as f64 / c.misses.max(1) as f64
            );
        }
        if ep.guessed > 0 {
            message!(
                "expert prefetch: the next layer's router applied to the hidden state before its attention guessed {:.1}% of the experts the router then chose ({} of {} token-layer-expert routings; it guesses as many experts as the router picks, so precision = recall)",
                100.0 * ep.recall(),
                ep.hit,
                ep.routed
            );
        }
    }
    if let Some(path) = &a.stats_json {
        // Each step's time, seconds × `scale`.
        let profile_json = |t: &nflash_runtime::model::Timings, scale: f64| {
            t.steps()
                .iter()
                .map(|(k, v)| (k.to_string(), serde_json::json!(v * scale)))
                .collect::<serde_json::Map<_, _>>()
        };
        let j = serde_json::json!({
            "kernels": nflash_runtime::kernels::isa(),
            "compute_threads": rayon::current_num_threads(),
            "big_cores": topo.big(),
            "little_cores": topo.little(),
            "page_size_bytes": nflash_runtime::offload::align::page_size(),
            "prompt_tokens": st.prompt_tokens,
            "generated_tokens": st.generated_tokens,
            "prefill_seconds": st.prefill_s,
            "decode_seconds": st.decode_s,
            "decode_steps": st.decode_steps,
            "prefill_tokens_per_s": st.prefill_tokens_per_s(),
            "decode_tokens_per_s": st.decode_tokens_per_s(),
            "peak_rss_bytes": rss,
            "sparse": sparse,
            "ffn_sparsity": sparsity.as_ref().map(|s| s.ffn_sparsity),
            "bundles_skipped": sparsity.as_ref().map(|s| s.bundles_skipped),
            "attention_ms_per_token": per(tm.attention_s()),
            "predictor_ms_per_token": per(tm.predictor_s),
            "ffn_ms_per_token": per(tm.ffn_s),
            "lm_head_ms_per_token": per(tm.lm_head_s),
            "decode_profile_ms_per_token": profile_json(&tm, 1e3 / steps),
            "prefill_profile_ms": profile_json(&ptm, 1e3),
            "latency_ms_mean": mean_ms,
            "latency_ms_p50": p50,
            "latency_ms_p90": p90,
            "latency_ms_p99": p99,
            "cache_hit_rate": c.hit_rate(),
            "hot_hit_rate": c.hot_hit_rate(),
            "bytes_read_per_token": bytes_per_token,
            "reads_per_token": c.reads as f64 / steps,
            "io_wait_share": io_wait_share,
            "speculated_clusters_per_token": c.speculated as f64 / steps,
            "speculation_precision": (c.speculated > 0).then(|| c.speculated_used as f64 / c.speculated as f64),
            "hot_bytes": hot_b,
            "cold_bytes": cold_b,
            "o_direct": direct,
            "io_engine": r.io_engine,
            "memory_budget_bytes": budget,
            "ctx": ctx,
            "kv_cache": model.kv_type().name(),
        });
        let mut j = j;
        // Speculative decoding: verify passes apart from tokens.
        let mut spec = serde_json::json!({
            // Dense layers' neuron clusters per verify pass: each token's
            // summed, and their union (what the pass fetched).
            "verify_clusters_needed_per_pass": (st.verify_passes > 0)
                .then(|| counts.iter().map(|c| c.verify_needed).sum::<u64>() as f64 / st.verify_passes as f64),
            "verify_cluster_union_per_pass": (st.verify_passes > 0)
                .then(|| counts.iter().map(|c| c.verify_union).sum::<u64>() as f64 / st.verify_passes as f64),
            "clusters_read_per_token": c.misses as f64 / steps,
        });
        spec.as_object_mut().expect("an object").extend(crate::sampling::speculation_json(st));
        if let (Some(o), serde_json::Value::Object(add)) = (j.as_object_mut(), spec) {
            o.extend(add);
        }
        // The budget over the run: what the governor gave back comes off it.
        let total = model.cache_stats();
        let span = crate::memory::budget_json(budget, watch.map(|w| (w, w.held_range())), &[&total]);
        j.as_object_mut().expect("an object").extend(span);
        j["memory_signals"] = serde_json::json!(watch.map(|w| w.signals()));
        // When decode began and each token came: tokens/s over any span.
        j["decode_start_unix_s"] = serde_json::json!(st.decode_start_unix_s);
        j["token_times_s"] = serde_json::json!(st.token_s);
        let mem = model.memory_control();
        j["cache_floor_bytes"] = serde_json::json!(mem.as_ref().map(|m| m.floor_bytes()));
        j["cache_ceiling_bytes"] = serde_json::json!(mem.as_ref().map(|m| m.ceiling_bytes()));
        j["cache_held_bytes"] = serde_json::json!(mem.as_ref().map(|m| m.held_bytes()));
        j["misses_read_ahead"] = serde_json::json!((c.misses > 0).then(|| c.speculated_used as f64 / c.misses as f64));
        j["misses_read_early"] = serde_json::json!((c.misses > 0).then(|| c.read_ahead_used as f64 / c.misses as f64));
        j["expert_prefetch_precision"] = serde_json::json!((ep.guessed > 0).then(|| ep.precision()));
        j["expert_prefetch_recall"] = serde_json::json!((ep.guessed > 0).then(|| ep.recall()));
        write_atomic(path, format!("{j}\n").as_bytes())?;
    }
    Ok(())
}

/// A read–eval–print chat. The whole conversation is re-rendered each turn
/// and only the tokens past the prefix already in the KV cache are run
/// ([`Session`]).
fn interactive(
    engine: &Engine,
    session: &mut Session,
    sampler: &mut Sampler,
    opts: &GenerateOptions,
    a: &RunArgs,
    budget: Option<u64>,
    watch: Option<&Watch>,
) -> Result<()> {
    let system = a.system.as_deref();
    const NO_TEMPLATE: &str = "this pack has no chat template, so interactive chat is not possible; pass --prompt";
    anyhow::ensure!(engine.template.is_some(), NO_TEMPLATE);
    let mut msgs = Vec::new();
    if let Some(s) = system {
        msgs.push(Message::new("system", s));
    }
    message!("nflash chat — type a message, an empty line or Ctrl-D to quit.");
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    loop {
        message_part!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        msgs.push(Message::new("user", line.trim_end()));
        let ids = engine.encode_chat_with(&msgs, usize::MAX, chat_options(a))?.context(NO_TEMPLATE)?;
        engine.model.reset_counters();
        let result = session.generate(engine, &ids, sampler, opts, |p| {
            let _ = stdout.write_all(p.as_bytes());
            let _ = stdout.flush();
            ControlFlow::Continue(())
        });
        println!();
        let turn = match result {
            Ok(r) => r,
            Err(e) => {
                message!("error: {e}");
                msgs.pop();
                continue;
            }
        };
        report(a, &turn.stats, &engine.model, budget, session.capacity(), watch)?;
        let reply = engine.tokenizer.decode(&turn.tokens)?;
        msgs.push(Message::new("assistant", &reply));
    }
    Ok(())
}
