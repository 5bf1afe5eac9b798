//! `--memory-budget` and the cache overrides shared by `run` and `ppl`.

use anyhow::{bail, Context, Result};
use clap::Args;
use nflash_format::{DeviceProfile, Pack, Plan};
use nflash_plan::layout::IoEngine;
use nflash_plan::planner::{self, parse_bytes, Footprint, PlanRequest};
use nflash_plan::{CacheConfig, KvType};
use nflash_runtime::Engine;

/// The profile used when the pack has no plan and no --device is given:
/// this repository's `profiles/dev-host.toml`, measured by `nflash probe`.
const DEFAULT_PROFILE: &str = include_str!("../../../../profiles/dev-host.toml");

/// Memory options (PowerInfer-2's segmented neuron cache; SPEC §4.6).
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Memory (neuron cache)")]
pub struct MemoryArgs {
    /// Whole-process memory budget (e.g. 96MiB, 1.5GiB): the fixed region
    /// (resident weights, KV cache at --ctx, scratch) plus hot neurons plus
    /// the cold neuron cache; the rest of the FFN is read from flash on
    /// demand. Default: the pack's plan, or everything in memory.
    #[arg(long, value_parser = parse_bytes)]
    pub memory_budget: Option<u64>,
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
    /// KV cache element type: f16 (half the memory, as llama.cpp) or f32.
    /// The memory plan sizes the KV cache for it.
    #[arg(long, default_value = "f16", value_parser = parse_kv)]
    pub kv: KvType,
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

/// The cache layout to run with, and the plan it came from (if any).
///
/// Order: no budget and no plan → everything in memory; `--memory-budget`
/// → plan now with `--device` / the pack's device / dev-host; no flag but a
/// stored plan → the stored plan (re-planned if `ctx` or `threads` differ);
/// then the override flags.
/// `measured`: the process's footprint with the resident tensors and
/// tokenizer loaded, used instead of the planner's estimate of them.
/// `device`: the `--device` profile, loaded by the caller.
pub fn resolve(
    pack: &Pack,
    a: &MemoryArgs,
    device: Option<DeviceProfile>,
    ctx: usize,
    threads: usize,
    measured: Option<Footprint>,
) -> Result<(CacheConfig, Option<Plan>)> {
    let m = pack.manifest();
    let stored = m.plan.as_ref();
    let budget = a.memory_budget.or(stored.map(|p| p.memory_budget_bytes));
    let plan = match (budget, stored) {
        (None, _) => None,
        // The stored plan as is, when nothing it depends on changed.
        (Some(_), Some(p))
            if a.memory_budget.is_none()
                && p.ctx as usize == ctx
                && KvType::of_plan(m, p) == a.kv
                && p.threads as usize == threads
                && device.is_none()
                && measured.is_none() =>
        {
            Some(p.clone())
        }
        (Some(budget_bytes), _) => {
            let dev = match (device, stored) {
                (Some(d), _) => d,
                (None, Some(p)) => p.device.clone(),
                (None, None) => DeviceProfile::parse(DEFAULT_PROFILE)
                    .map_err(anyhow::Error::msg)
                    .context("built-in dev-host profile")?,
            };
            let req = PlanRequest {
                budget_bytes,
                ctx: ctx as u32,
                kv: a.kv,
                threads: threads as u32,
                io_threads: a.io_threads.map(|n| n as u32),
                measured,
                unit_share: Some(pack.unit_share()?),
            };
            let from_pack = a.memory_budget.is_none();
            Some(planner::plan(m, &dev, &req).with_context(|| {
                if from_pack {
                    format!(
                        "the memory budget {:.1} MiB is the pack's plan's (it was planned at ctx {}, {} threads); pass --memory-budget to choose another",
                        budget_bytes as f64 / (1u64 << 20) as f64,
                        stored.map_or(0, |p| p.ctx),
                        stored.map_or(0, |p| p.threads)
                    )
                } else {
                    "--memory-budget".to_string()
                }
            })?)
        }
    };
    let mut cfg = plan.as_ref().map_or_else(|| CacheConfig::all_hot(pack), CacheConfig::from_plan);
    if let Some(f) = a.hot_fraction {
        if !(0.0..=1.0).contains(&f) || f.is_nan() {
            bail!("--hot-fraction {f} is outside [0, 1]");
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
            nflash_runtime::message!(
                "note: --hot-fraction {f} pins {:.0}% of the FFN's neurons: hot sets are whole neuron clusters, and this pack's are {} neurons each; convert with a smaller --cluster-bytes for finer hot sets",
                100.0 * got,
                m.ffn.first().and_then(|l| l.clusters.first()).map_or(0, |c| c.n_neurons)
            );
        }
    }
    if let Some(c) = a.cold_cache {
        cfg.cold_bytes = c;
    }
    cfg.io_engine = a.io_engine;
    if let Some(n) = a.io_threads {
        let max = planner::MAX_IO_THREADS as usize;
        if n == 0 || n > max {
            bail!("--io-threads must be between 1 and {max}");
        }
        cfg.io_threads = n;
    }
    if let (Some(p), true) = (&plan, a.hot_fraction.is_some() || a.cold_cache.is_some()) {
        let hot = planner::hot_region_bytes(m, &cfg.hot_neurons);
        // Saturating: --cold-cache is the user's number, up to 2^64 - 1.
        let need = p.fixed_bytes.saturating_add(hot).saturating_add(cfg.cold_bytes);
        if need > p.memory_budget_bytes {
            let given = match (a.hot_fraction.is_some(), a.cold_cache.is_some()) {
                (true, true) => "--hot-fraction and --cold-cache",
                (true, false) => "--hot-fraction (with the plan's cold region)",
                _ => "--cold-cache (with the plan's hot region)",
            };
            bail!(
                "{given} need about {:.1} MiB (fixed region {:.1} MiB + hot {:.1} MiB + cold {:.1} MiB), more than the {:.1} MiB memory budget; lower them, pass --hot-fraction too, or raise --memory-budget",
                need as f64 / (1u64 << 20) as f64,
                p.fixed_bytes as f64 / (1u64 << 20) as f64,
                hot as f64 / (1u64 << 20) as f64,
                cfg.cold_bytes as f64 / (1u64 << 20) as f64,
                p.memory_budget_bytes as f64 / (1u64 << 20) as f64
            );
        }
    }
    Ok((cfg, plan))
}

/// Loads the engine with the cache layout [`resolve`] chooses once the
/// resident tensors and tokenizer are in memory, measured from this
/// process's footprint at that point, and KV caches of `--kv` elements;
/// returns the plan too.
/// `device`: from [`MemoryArgs::device_profile`]; `verify`: check each
/// neuron cluster's CRC-32C as it is read ([`CacheConfig::verify`]).
pub fn load_engine<'p>(
    pack: &'p Pack,
    a: &MemoryArgs,
    device: Option<DeviceProfile>,
    ctx: usize,
    verify: bool,
) -> Result<(Engine<'p>, Option<Plan>)> {
    if ctx as u64 > nflash_format::MAX_CONTEXT {
        let m = &pack.manifest().config;
        let kvd = (m.num_kv_heads * m.head_dim) as usize;
        let kv = nflash_plan::layout::kv_cache_bytes(m.num_layers as usize, kvd, ctx, a.kv);
        anyhow::bail!(
            "--ctx {ctx} exceeds the supported maximum of {} tokens (its KV cache alone would take {:.1} GiB); use a smaller --ctx",
            nflash_format::MAX_CONTEXT,
            kv as f64 / (1u64 << 30) as f64
        );
    }
    let mut plan = None;
    let mut engine = Engine::load_planned(pack, || {
        nflash_runtime::stats::trim_heap();
        let footprint = nflash_runtime::stats::rss_bytes()
            .map(|rss| Footprint { rss, peak: nflash_runtime::stats::peak_rss_bytes().unwrap_or(rss) });
        let (cache, p) = resolve(pack, a, device, ctx, rayon::current_num_threads(), footprint)
            .map_err(|e| nflash_runtime::Error::Usage(format!("{e:#}")))?;
        plan = p;
        Ok(CacheConfig { verify, ..cache })
    })?;
    engine.model.set_kv_type(a.kv);
    Ok((engine, plan))
}
