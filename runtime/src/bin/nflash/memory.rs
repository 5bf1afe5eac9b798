//! `--memory-budget` and the cache overrides shared by `run` and `ppl`.

use anyhow::{Context, Result};
use clap::Args;
use nflash_format::{DeviceProfile, Pack, Plan};
use nflash_plan::layout::IoEngine;
use nflash_plan::planner::parse_bytes;
use nflash_plan::KvType;
use nflash_runtime::draft::DraftKind;
use nflash_runtime::model::CacheStats;
use nflash_runtime::placement::{self, MemoryOptions};
use nflash_runtime::pressure::{Governor, Signals, Watch};
use nflash_runtime::Engine;

/// Memory options (PowerInfer-2's segmented neuron cache; SPEC §4.6).
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Memory (neuron cache)")]
pub struct MemoryArgs {
    /// Whole-process memory budget (e.g. 96MiB, 1.5GiB): the fixed region
    /// (resident weights, KV cache at --ctx, scratch) plus hot neurons plus
    /// the cold neuron cache; the rest of the FFN is read from flash on
    /// demand. Under memory pressure nflash goes below it. `auto`: start at
    /// the memory available less --memory-reserve and follow it, up to
    /// --memory-max (default: the whole model in memory). Default: the
    /// pack's plan, or everything in memory.
    #[arg(long, value_parser = parse_budget)]
    pub memory_budget: Option<Budget>,
    /// With --memory-budget auto: the most nflash holds (e.g. 2GiB); the
    /// plan is made for it.
    #[arg(long, value_parser = parse_bytes)]
    pub memory_max: Option<u64>,
    /// Device profile (TOML) to plan with; default: the pack's plan's
    /// device, else the built-in dev-host profile.
    #[arg(long)]
    pub device: Option<std::path::PathBuf>,
    /// Override the plan: fraction of each layer's FFN neurons pinned hot (0–1, whole clusters).
    #[arg(long)]
    pub hot_fraction: Option<f64>,
    /// Override the plan: cold neuron cache size (e.g. 8MiB); raised to one layer's cold clusters if smaller.
    #[arg(long, value_parser = parse_bytes)]
    pub cold_cache: Option<u64>,
    /// Override the plan: reads of neuron clusters in flight at once (I/O
    /// threads, or the io_uring queue depth).
    #[arg(long)]
    pub io_threads: Option<usize>,
    /// How cold neuron clusters are read: auto (io_uring where the kernel
    /// allows it, else threads), uring, or threads (one blocking read per
    /// I/O thread).
    #[arg(long, default_value = "auto", value_parser = parse_io_engine)]
    pub io_engine: IoEngine,
    /// Memory kept free for other apps (e.g. 32MiB): when the memory cgroup's
    /// room or MemAvailable falls below it, or PSI shows memory stalls,
    /// nflash gives neuron-cache memory back (down to its floor: resident
    /// weights, KV cache, scratch and one layer's staging slots), and takes
    /// it again up to the budget once the pressure has been gone for 2 s.
    #[arg(long, default_value = "32MiB", value_parser = parse_bytes)]
    pub memory_reserve: u64,
    /// KV cache element type: f16 (half the memory, as llama.cpp) or f32.
    /// The memory plan sizes the KV cache for it.
    #[arg(long, default_value = "f16", value_parser = parse_kv)]
    pub kv: KvType,
}

/// A `--memory-budget`: bytes, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// A whole-process budget, bytes.
    Bytes(u64),
    /// Follow the memory available, up to `--memory-max`.
    Auto,
}

/// `--memory-budget`: a size ([`parse_bytes`]) or `auto`.
pub fn parse_budget(s: &str) -> std::result::Result<Budget, String> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(Budget::Auto);
    }
    parse_bytes(s).map(Budget::Bytes).map_err(|e| format!("{e}, or auto"))
}

/// `--io-engine`: `auto`, `uring` or `threads`.
pub fn parse_io_engine(s: &str) -> std::result::Result<IoEngine, String> {
    s.parse()
}

/// `--kv`: `f16` or `f32`.
pub fn parse_kv(s: &str) -> std::result::Result<KvType, String> {
    s.parse()
}

impl MemoryArgs {
    /// The `--device` profile, read and checked. Callers read it before
    /// opening the pack (which loads the resident tensors), so a bad profile
    /// fails at once.
    pub fn device_profile(&self) -> Result<Option<DeviceProfile>> {
        Ok(match &self.device {
            Some(p) => Some(DeviceProfile::load(p)?),
            None => None,
        })
    }
}

/// Starts the governor that resizes `engine`'s neuron cache under memory
/// pressure (`nflash_runtime::pressure`), keeping `a.memory_reserve` free
/// (in a memory cgroup, at most the gap between its limit and `budget`, the
/// plan's whole-process budget in bytes); `None` if the cache's memory
/// cannot move or the thread cannot start.
pub fn follow_memory(engine: &Engine, a: &MemoryArgs, budget: Option<u64>) -> Option<Watch> {
    let mem = engine.model.memory_control()?;
    // A reserve above what is free was reported when the cache was sized (placement).
    let signals = Signals::detect();
    let mut gov = Governor::new(a.memory_reserve, mem.floor_bytes(), mem.ceiling_bytes());
    // auto's ceiling is no budget the user gave: the whole reserve is kept.
    gov.budget = budget.filter(|_| a.memory_budget != Some(Budget::Auto));
    Watch::start(signals, gov, mem).ok()
}

/// The memory-budget keys of `--stats-json` and of serve's `timings`, over
/// a span: `budget_min_bytes` and `budget_max_bytes` (the whole-process
/// `budget` less what the cache had given back from its ceiling when it
/// held least and most: `held` from the governor's `Watch`), and the
/// span's `budget_shrinks`, `budget_grows`, `bytes_returned` and
/// `reads_after_shrink`, summed over `spans`.
pub fn budget_json(
    budget: Option<u64>,
    held: Option<(&Watch, (u64, u64))>,
    spans: &[&CacheStats],
) -> serde_json::Map<String, serde_json::Value> {
    let given_back = held.map(|(w, (lo, hi))| (w.ceiling().saturating_sub(lo), w.ceiling().saturating_sub(hi)));
    let less = |pick: fn((u64, u64)) -> u64| budget.zip(given_back).map(|(b, g)| b.saturating_sub(pick(g)));
    let sum = |f: fn(&CacheStats) -> u64| spans.iter().map(|s| f(s)).sum::<u64>();
    let j = serde_json::json!({
        "budget_min_bytes": less(|g| g.0),
        "budget_max_bytes": less(|g| g.1),
        "budget_shrinks": sum(|s| s.budget_shrinks),
        "budget_grows": sum(|s| s.budget_grows),
        "bytes_returned": sum(|s| s.bytes_returned),
        "reads_after_shrink": sum(|s| s.reads_after_shrink),
    });
    match j {
        serde_json::Value::Object(m) => m,
        _ => unreachable!("a JSON object literal"),
    }
}

/// Loads the engine as [`nflash_runtime::placement::load_engine`] does with
/// these options. `device`: from [`MemoryArgs::device_profile`]; `ctx`:
/// tokens; `verify`: check each neuron cluster's CRC-32C as it is read;
/// `draft`: a draft pack (`--draft`) and the draft kind, planned inside the
/// budget ([`nflash_plan::planner::draft_pack_bytes`]), loaded all in
/// memory after the model and attached to it; not loaded, with a note,
/// where `auto` would never draft with it (the model all in memory).
pub fn load_engine<'p>(
    pack: &'p Pack,
    draft: Option<(&'p Pack, DraftKind)>,
    a: &MemoryArgs,
    device: Option<DeviceProfile>,
    ctx: usize,
    verify: bool,
) -> Result<(Engine<'p>, Option<Plan>)> {
    let auto = a.memory_budget == Some(Budget::Auto);
    if a.memory_max.is_some() && !auto {
        anyhow::bail!(
            "--memory-max goes with --memory-budget auto; a --memory-budget of a size is already the most nflash holds"
        );
    }
    let o = MemoryOptions {
        memory_budget: match a.memory_budget {
            Some(Budget::Bytes(b)) => Some(b),
            _ => a.memory_max,
        },
        auto,
        reserve: Some(a.memory_reserve),
        device,
        hot_fraction: a.hot_fraction,
        cold_cache: a.cold_cache,
        io_threads: a.io_threads,
        io_engine: a.io_engine,
        kv: a.kv,
        draft_bytes: draft.map_or(0, |(d, _)| nflash_plan::planner::draft_pack_bytes(d.manifest(), ctx as u32, a.kv)),
    };
    let (mut engine, plan) = placement::load_engine(pack, &o, ctx, verify)?;
    let Some((d, kind)) = draft else { return Ok((engine, plan)) };
    if kind == DraftKind::Auto && engine.model.cache_regions().io_engine.is_none() {
        // Not loaded, but a wrong draft is still refused (attach_draft checks a loaded one).
        engine.check_draft_tokenizer(d)?;
        nflash_runtime::message!(
            "note: the draft pack {} is not loaded: the whole model is in memory, where auto never drafts (a verify pass costs about what it saves); pass --speculate-draft pack to draft with it anyway",
            d.path().display()
        );
        return Ok((engine, plan));
    }
    if std::fs::canonicalize(d.path()).ok() == std::fs::canonicalize(pack.path()).ok() {
        nflash_runtime::message!(
            "note: the draft pack is the model's own pack: its guesses cost a model step each, so it cannot speed decoding up (a smaller model of the same family can)"
        );
    }
    engine.attach_draft(pack, d).with_context(|| format!("loading the draft pack {}", d.path().display()))?;
    Ok((engine, plan))
}
