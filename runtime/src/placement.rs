//! Where a run keeps its FFN neuron clusters: from a whole-process memory
//! budget through the planner (`nflash_plan::planner`), the pack's stored
//! plan, or explicit overrides; then the engine loaded that way. Shared by
//! `nflash run`, `ppl`, `serve` and the C library.

use nflash_format::{DeviceProfile, Pack, Plan};
use nflash_plan::layout::IoEngine;
use nflash_plan::planner::{self, Footprint, PlanRequest};
use nflash_plan::{CacheConfig, KvType};

use crate::engine::Engine;
use crate::error::{Error, Result};

/// The profile used when the pack has no plan and no device is given:
/// this repository's `profiles/dev-host.toml`, measured by `nflash probe`.
const DEFAULT_PROFILE: &str = include_str!("../../profiles/dev-host.toml");

/// Memory options of a run (PowerInfer-2's segmented neuron cache; SPEC §4.6).
/// The command line's names are given for each.
#[derive(Debug, Clone, Default)]
pub struct MemoryOptions {
    /// `--memory-budget`: whole-process budget, bytes; `None`: the pack's
    /// plan's, or everything in memory. With `auto`, the `--memory-max`.
    pub memory_budget: Option<u64>,
    /// `--memory-budget auto`: the budget follows the memory available. The
    /// plan is made for `memory_budget` (`--memory-max`) or, without one,
    /// for a budget that holds the whole model in memory (the stored plan's
    /// budget is not used), and the neuron cache starts at what the memory available at
    /// load leaves ([`Self::reserve`]); a start short of the minimum is an error.
    pub auto: bool,
    /// `--memory-reserve`: bytes kept free for other apps
    /// ([`crate::pressure::Reading::margin`]). The neuron cache starts no
    /// larger than what the memory available at load, less this, leaves
    /// beside the fixed region (it grows later, as the governor allows);
    /// `None`: it starts as planned.
    pub reserve: Option<u64>,
    /// `--device`: the profile to plan with; `None`: the pack's plan's
    /// device, else the built-in dev-host profile.
    pub device: Option<DeviceProfile>,
    /// `--hot-fraction`: share of each layer's FFN neurons pinned hot (0–1).
    pub hot_fraction: Option<f64>,
    /// `--cold-cache`: cold neuron cache size, bytes.
    pub cold_cache: Option<u64>,
    /// `--io-threads`: reads in flight at once.
    pub io_threads: Option<usize>,
    /// `--io-engine`: how cold clusters are read.
    pub io_engine: IoEngine,
    /// `--kv`: KV cache element type.
    pub kv: KvType,
    /// `--draft`: bytes a draft pack holds beside the model, inside the
    /// budget ([`nflash_plan::planner::draft_pack_bytes`]); 0 = none.
    pub draft_bytes: u64,
}

/// The cache layout to run with, and the plan it came from (if any).
///
/// Order: no budget and no plan → everything in memory; a budget → plan
/// now with the device / the pack's device / dev-host; no budget but a
/// stored plan → the stored plan (re-planned if `ctx`, `threads`, the KV
/// type or `measured` differ); then the overrides.
/// `ctx`: tokens; `threads`: compute threads; `measured`: the process's
/// footprint with the resident tensors and tokenizer loaded, used instead
/// of the planner's estimate of them.
///
/// # Errors
/// [`Error::Budget`] naming the option when the budget cannot hold the
/// model (with the planner's explanation) or the overrides do not fit in
/// it; [`Error::Usage`] for an override out of range.
pub fn resolve(
    pack: &Pack,
    o: &MemoryOptions,
    ctx: usize,
    threads: usize,
    measured: Option<Footprint>,
) -> Result<(CacheConfig, Option<Plan>)> {
    let m = pack.manifest();
    let stored = m.plan.as_ref();
    let budget = if o.auto {
        // Up to --memory-max, or the whole model in memory.
        Some(o.memory_budget.unwrap_or_else(|| {
            let all: Vec<u32> = m.ffn.iter().map(|f| f.n_neurons).collect();
            let fixed = planner::fixed_region(m, ctx as u32, o.kv, measured).total() + o.draft_bytes;
            fixed + planner::hot_region_bytes(m, &all).max(planner::staging_bytes(m))
        }))
    } else {
        o.memory_budget.or(stored.map(|p| p.memory_budget_bytes))
    };
    let plan = match (budget, stored) {
        (None, _) => None,
        // The stored plan as is, when nothing it depends on changed.
        (Some(_), Some(p))
            if o.memory_budget.is_none()
                && p.ctx as usize == ctx
                && KvType::of_plan(m, p) == o.kv
                && p.threads as usize == threads
                && o.device.is_none()
                && o.draft_bytes == 0
                && measured.is_none() =>
        {
            Some(p.clone())
        }
        (Some(budget_bytes), _) => {
            let dev = match (&o.device, stored) {
                (Some(d), _) => d.clone(),
                (None, Some(p)) => p.device.clone(),
                (None, None) => DeviceProfile::parse(DEFAULT_PROFILE)
                    .map_err(|e| Error::Internal(format!("built-in dev-host profile: {e}")))?,
            };
            let req = PlanRequest {
                budget_bytes,
                ctx: ctx as u32,
                kv: o.kv,
                threads: threads as u32,
                io_threads: o.io_threads.map(|n| n as u32),
                measured,
                unit_share: Some(pack.unit_share()?),
                draft_bytes: o.draft_bytes,
            };
            Some(planner::plan(m, &dev, &req).map_err(|e| {
                Error::Budget(if o.memory_budget.is_none() {
                    format!(
                        "the memory budget {:.1} MiB is the pack's plan's (it was planned at ctx {}, {} threads); pass --memory-budget to choose another: {e}",
                        budget_bytes as f64 / (1u64 << 20) as f64,
                        stored.map_or(0, |p| p.ctx),
                        stored.map_or(0, |p| p.threads)
                    )
                } else {
                    let flag = if o.auto { "--memory-max" } else { "--memory-budget" };
                    format!("{flag}: {e}").replace("use --memory-budget", &format!("use {flag}"))
                })
            })?)
        }
    };
    let mut cfg = plan.as_ref().map_or_else(|| CacheConfig::all_hot(pack), CacheConfig::from_plan);
    if let Some(f) = o.hot_fraction {
        if !(0.0..=1.0).contains(&f) || f.is_nan() {
            return Err(Error::Usage(format!("--hot-fraction {f} is outside [0, 1]")));
        }
        // Whole neuron clusters only: each FFN unit's cluster boundary nearest
        // the fraction (rounding down would pin nothing of a unit, such as a
        // small expert, whose clusters are few).
        cfg.hot_neurons = m
            .ffn
            .iter()
            .map(|l| {
                let want = l.n_neurons as f64 * f;
                let bounds = l.clusters.iter().map(|c| c.first).chain([l.n_neurons]);
                bounds.min_by(|a, b| (*a as f64 - want).abs().total_cmp(&(*b as f64 - want).abs())).unwrap_or(0)
            })
            .collect();
        let (hot, all): (u64, u64) =
            m.ffn.iter().zip(&cfg.hot_neurons).fold((0, 0), |(h, a), (l, &n)| (h + n as u64, a + l.n_neurons as u64));
        let got = hot as f64 / all.max(1) as f64;
        if (got - f).abs() > 0.1 {
            crate::message!(
                "note: --hot-fraction {f} pins {:.0}% of the FFN's neurons: hot sets are whole neuron clusters, and this pack's are {} neurons each; convert with a smaller --cluster-bytes for finer hot sets",
                100.0 * got,
                m.ffn.first().and_then(|l| l.clusters.first()).map_or(0, |c| c.n_neurons)
            );
        }
    }
    if let Some(c) = o.cold_cache {
        cfg.cold_bytes = c;
    }
    cfg.io_engine = o.io_engine;
    if let Some(n) = o.io_threads {
        let max = planner::MAX_IO_THREADS as usize;
        if n == 0 || n > max {
            return Err(Error::Usage(format!("--io-threads must be between 1 and {max}")));
        }
        cfg.io_threads = n;
    }
    if let (Some(p), true) = (&plan, o.hot_fraction.is_some() || o.cold_cache.is_some()) {
        let hot = planner::hot_region_bytes(m, &cfg.hot_neurons);
        // Saturating: --cold-cache is the user's number, up to 2^64 - 1.
        let need = p.fixed_bytes.saturating_add(hot).saturating_add(cfg.cold_bytes);
        if need > p.memory_budget_bytes {
            let given = match (o.hot_fraction.is_some(), o.cold_cache.is_some()) {
                (true, true) => "--hot-fraction and --cold-cache",
                (true, false) => "--hot-fraction (with the plan's cold region)",
                _ => "--cold-cache (with the plan's hot region)",
            };
            return Err(Error::Budget(format!(
                "{given} need about {:.1} MiB (fixed region {:.1} MiB + hot {:.1} MiB + cold {:.1} MiB), more than the {:.1} MiB memory budget; lower them, pass --hot-fraction too, or raise --memory-budget",
                need as f64 / (1u64 << 20) as f64,
                p.fixed_bytes as f64 / (1u64 << 20) as f64,
                hot as f64 / (1u64 << 20) as f64,
                cfg.cold_bytes as f64 / (1u64 << 20) as f64,
                p.memory_budget_bytes as f64 / (1u64 << 20) as f64
            )));
        }
    }
    Ok((cfg, plan))
}

/// Loads the engine with the cache layout [`resolve`] chooses once the
/// resident tensors and tokenizer are in memory, measured from this
/// process's footprint at that point, and KV caches of `o.kv` elements;
/// returns the plan too. Call it on the rayon pool the model will run on
/// (the plan depends on its thread count). `ctx`: tokens; `verify`: check
/// each neuron cluster's CRC-32C as it is read ([`CacheConfig::verify`]).
///
/// # Errors
/// [`Error::Usage`] for a `ctx` past [`nflash_format::MAX_CONTEXT`] and as
/// [`resolve`]; as [`Engine::load_planned`].
pub fn load_engine<'p>(
    pack: &'p Pack,
    o: &MemoryOptions,
    ctx: usize,
    verify: bool,
) -> Result<(Engine<'p>, Option<Plan>)> {
    if ctx as u64 > nflash_format::MAX_CONTEXT {
        let m = &pack.manifest().config;
        let kv = nflash_plan::layout::kv_cache_bytes_of(m, ctx, o.kv);
        return Err(Error::Usage(format!(
            "--ctx {ctx} exceeds the supported maximum of {} tokens (its KV cache alone would take {:.1} GiB); use a smaller --ctx",
            nflash_format::MAX_CONTEXT,
            kv as f64 / (1u64 << 30) as f64
        )));
    }
    let mut plan = None;
    let mut engine = Engine::load_planned(pack, || {
        crate::stats::trim_heap();
        let footprint =
            crate::stats::rss_bytes().map(|rss| Footprint { rss, peak: crate::stats::peak_rss_bytes().unwrap_or(rss) });
        let (cache, p) = resolve(pack, o, ctx, rayon::current_num_threads(), footprint)?;
        let start_bytes = start_bytes(pack, o, ctx, &cache, p.as_ref(), footprint)?;
        plan = p;
        Ok(CacheConfig { verify, start_bytes, ..cache })
    })?;
    engine.model.set_kv_type(o.kv);
    Ok((engine, plan))
}

/// Neuron-cache bytes (hot and cold regions) to hold at load, for
/// [`CacheConfig::start_bytes`]: `None` (all of `cache`) where the memory
/// available now, less `o.reserve` ([`crate::pressure::Reading::margin`],
/// with the plan's budget), holds the fixed region and all of it, or
/// without a reserve, a footprint or any signal; else what it leaves (at
/// least the cache's minimum, one layer's clusters), with a note. `ctx`:
/// tokens; `plan`: the one `cache` came from; `measured`: the process now.
///
/// # Errors
/// [`Error::Budget`] with `o.auto` when the memory available does not hold
/// the fixed region and the cache's minimum.
fn start_bytes(
    pack: &Pack,
    o: &MemoryOptions,
    ctx: usize,
    cache: &CacheConfig,
    plan: Option<&Plan>,
    measured: Option<Footprint>,
) -> Result<Option<u64>> {
    let (Some(reserve), Some(f)) = (o.reserve, measured) else { return Ok(None) };
    // A budget given (not auto's ceiling) may fill a cgroup's limit.
    let budget = plan.map(|p| p.memory_budget_bytes).filter(|_| !o.auto);
    let Some(total) = crate::pressure::Signals::detect().read().allowance(f.rss, reserve, budget) else {
        return Ok(None);
    };
    let m = pack.manifest();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let fixed = plan.map_or_else(
        || planner::fixed_region(m, ctx as u32, o.kv, measured).total() + o.draft_bytes,
        |p| p.fixed_bytes,
    );
    let full = planner::hot_region_bytes(m, &cache.hot_neurons).saturating_add(cache.cold_bytes);
    let least = planner::staging_bytes(m);
    let ceiling = if o.memory_budget.is_some() { "--memory-max" } else { "the whole model" };
    if total >= fixed.saturating_add(full) {
        if o.auto {
            crate::message!(
                "memory budget auto: the memory available now less --memory-reserve ({:.1} MiB) leaves {:.1} MiB for this process, enough for the plan up to {ceiling} ({:.1} MiB): the neuron cache starts whole ({:.1} MiB)",
                mib(reserve),
                mib(total),
                mib(fixed + full),
                mib(full)
            );
        }
        return Ok(None);
    }
    if total < fixed.saturating_add(least) {
        let msg = format!(
            "the memory available now less --memory-reserve ({:.1} MiB) leaves {:.1} MiB for this process, short of its minimum {:.1} MiB (fixed region {:.1} MiB and one layer's neuron clusters {:.1} MiB)",
            mib(reserve),
            mib(total),
            mib(fixed + least),
            mib(fixed),
            mib(least)
        );
        if o.auto {
            return Err(Error::Budget(format!(
                "--memory-budget auto: {msg}; free memory, lower --ctx or --memory-reserve, or give a --memory-budget"
            )));
        }
        crate::message!("warning: {msg}: the neuron cache starts at its minimum and the system may stop this process");
        return Ok(Some(0));
    }
    let start = total - fixed;
    let plan = if o.auto { format!("the plan up to {ceiling}") } else { "the plan".into() };
    crate::message!(
        "note: the neuron cache starts at {:.1} MiB of the {:.1} MiB in {plan}: the memory available now less --memory-reserve ({:.1} MiB) leaves {:.1} MiB for this process; it grows toward the plan when memory is free (--stats: \"memory pressure\")",
        mib(start),
        mib(full),
        mib(reserve),
        mib(total)
    );
    Ok(Some(start))
}

/// Refuses to load `pack` (validated, nothing read yet) where the memory
/// free now (the cgroup's room, `MemAvailable`) cannot hold its resident
/// tensors and the runtime's own estimate (the planner's off-device figure,
/// [`planner::runtime_estimate`]), instead of being
/// killed by the kernel while loading. Without signals, nothing is checked.
///
/// # Errors
/// [`Error::Budget`] naming both figures.
fn check_room_to_load(pack: &Pack) -> Result<()> {
    let held = crate::stats::rss_bytes().unwrap_or(0);
    let Some(free) = crate::pressure::Signals::detect().read().allowance(held, 0, None) else { return Ok(()) };
    let m = pack.manifest();
    let resident = planner::resident_bytes(m);
    let need = resident + planner::runtime_estimate(m);
    if free < need {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        return Err(Error::Budget(format!(
            "only {:.1} MiB of memory is free for this process (its memory cgroup's limit, or MemAvailable), and loading {} takes about {:.1} MiB (resident tensors {:.1} MiB and the runtime); free memory, or run it where more is available",
            mib(free),
            pack.path().display(),
            mib(need),
            mib(resident)
        )));
    }
    Ok(())
}

/// The context length (KV cache tokens) to run `pack` with: `requested`,
/// else the one the pack's plan was made for, else min(4096, the model's
/// `max_position_embeddings`). Warns past the model's trained context.
///
/// # Errors
/// [`Error::Usage`] below 2 tokens.
pub fn context_len(pack: &Pack, requested: Option<usize>) -> Result<usize> {
    let max_pos = pack.manifest().config.max_position_embeddings as usize;
    let ctx = requested.or(pack.manifest().plan.as_ref().map(|p| p.ctx as usize)).unwrap_or(max_pos.clamp(2, 4096));
    if ctx < 2 {
        return Err(Error::Usage("--ctx must be at least 2".into()));
    }
    if ctx > max_pos {
        crate::message!(
            "warning: --ctx {ctx} exceeds the model's trained context ({max_pos} tokens); quality past it is not guaranteed"
        );
    }
    Ok(ctx)
}

/// Opens a pack for running: resident segments in memory, Q4_0 and Q8_0
/// matrices reordered to the ×8 layout where this CPU has its kernels, every
/// segment's CRC-32 checked first when `full_check`. A pack without
/// neuron-cluster checksums (before format 3.4) gets a one-line notice when
/// `check_clusters`; a 3.4 pack without them is refused then.
///
/// # Errors
/// As [`Pack::open_resident`], [`Pack::verify`], [`Pack::cluster_checksums`]
/// and [`Pack::interleave`].
pub fn open_pack(path: &std::path::Path, full_check: bool, check_clusters: bool) -> Result<Pack> {
    check_room_to_load(&Pack::open(path)?)?;
    let mut pack = Pack::open_resident(path)?;
    if full_check {
        pack.verify()?;
    }
    let has_table = pack.manifest().segments.iter().any(|s| s.kind == nflash_format::SegmentKind::ClusterChecksums);
    if check_clusters && !has_table {
        // A pack of format 3.4 or later without its table is damaged: this is the error saying so.
        pack.cluster_checksums()?;
        let h = pack.header();
        crate::message!(
            "note: {} is format {}.{}, without neuron-cluster checksums, so clusters are not checked as they are read (--verify full checks the whole file at start); add them with `prep upgrade` (or convert the checkpoint again) on the workstation",
            path.display(),
            h.major,
            h.minor
        );
    }
    if crate::kernels::x8_available() {
        // Matrices in groups of 8 rows: one stream per group, 8 rows per kernel call.
        pack.interleave()?;
    }
    Ok(pack)
}
