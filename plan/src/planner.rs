//! The offline planner (PowerInfer-2 §4.4; SPEC §4.6): given a pack, a
//! device profile and a whole-process memory budget, choose how many hot
//! neurons each layer pins, how big the cold cache is and how many I/O
//! threads read it. Used by `prep convert --device` (stored in the pack) and
//! by `nflash run --memory-budget` (re-planned at start).
//!
//! Memory model: `budget = fixed + hot + cold`, where the fixed region is
//! the resident segments (embeddings, attention, norms, predictors), the KV
//! cache at the context length, scratch buffers and the runtime's own
//! footprint. Hot clusters are the most frequently needed first; a layer's
//! hot set grows until the expected I/O for its misses fits in its attention
//! compute time (the bound PowerInfer-2 uses), then the rest of the budget
//! goes to the cold LRU cache, which is never smaller than one layer's cold
//! clusters (they also stage that layer's reads).

use nflash_format::{DeviceProfile, Manifest, Plan, SegmentKind};

use crate::cost::{
    attention_bytes, attention_split, cluster_need, cluster_needs, estimate_with, io_seconds, io_term, Cl,
};
use crate::error::{Error, Result};
use crate::layout::{
    align_up, cluster_read_bytes, ffn_read_bytes, hot_clusters, kv_cache_bytes_of, KvType, FFN_TILE_ELEMS,
};

/// Process memory outside the model (code, libraries, thread stacks, the
/// allocator's arenas), bytes, for plans made off the device (`prep`).
/// With the tokenizer term below it matches what `nflash run` measures of
/// itself on SmolLM2-135M (x86-64 Linux) plus [`RUNTIME_MARGIN_BYTES`]:
/// about 27 MiB.
pub const RUNTIME_BASE_BYTES: u64 = 16 << 20;

/// The in-memory tokenizer (HF tokenizers' vocabulary and merge tables,
/// plus the transient JSON parse at load) as a multiple of its JSON size.
pub const TOKENIZER_FACTOR: u64 = 6;

/// Memory the runtime touches after it has measured itself at start (code
/// of the compute kernels, thread stacks, I/O rings, allocator slack), bytes.
/// Measured on SmolLM2-135M (q4_0 and q8_0, ctx 256–512, full prefill
/// chunks, x86-64 AVX-512) as peak RSS minus the start-up RSS, the hot and
/// cold regions, the KV cache and the scratch estimate: 3 to 4 MiB; one
/// more for other machines (tests/tests/smollm2.rs fills a context under
/// budgets and checks the peak).
pub const RUNTIME_MARGIN_BYTES: u64 = 5 << 20;

/// Most I/O threads a plan starts (and `--io-threads` accepts): one per
/// read in flight, up to the deepest queue `nflash probe` measures.
pub const MAX_IO_THREADS: u32 = 64;

/// Parses a byte size for the command line: `96MiB`, `1.5GiB`, `100MB`
/// (10⁸; `M` alone is 10⁶ too), `4096B` (the `parse-size` crate's syntax). The unit is required:
/// a bare number is refused, since `512` meant as MiB would be read as 512
/// bytes.
///
/// # Errors
/// A message with examples.
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{t}: a size cannot be negative; sizes such as 512MiB, 1.5GiB"));
    }
    // A unit ends the size: `512`, `1.5` and `1e9` have none.
    if t.chars().last().is_some_and(|c| c.is_ascii_digit() || c == '.') {
        return Err(format!(
            "{t} has no unit: write {t}MiB or {t}GiB (or {t}B for bytes); sizes such as 512MiB, 1.5GiB"
        ));
    }
    parse_size::parse_size(t).map_err(|e| format!("{e}: expected a size such as 96MiB, 1.5GiB, 100MB or 4096B"))
}

/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Whole-process memory budget, bytes.
    pub budget_bytes: u64,
    /// Context length, tokens (sizes the KV cache).
    pub ctx: u32,
    /// KV cache element type.
    pub kv: KvType,
    /// Compute threads.
    pub threads: u32,
    /// I/O threads; `None` = from the profile (its I/O queues, at most [`MAX_IO_THREADS`]: each
    /// thread keeps one read in flight, and the probe measures up to 64).
    pub io_threads: Option<u32>,
    /// The process's memory measured with the resident tensors and tokenizer
    /// loaded (`nflash run` measures itself); replaces the estimate of the
    /// resident + runtime part of the fixed region.
    pub measured: Option<Footprint>,
    /// Each FFN unit's share of the tokens (`[units]`: `Pack::unit_share`,
    /// an expert's routed share); `None` = [`crate::cost::uniform_unit_share`].
    pub unit_share: Option<Vec<f64>>,
    /// Memory held beside the model in the same budget, bytes: a draft
    /// pack for speculative decoding (`nflash run --draft`; issue 47), its
    /// weights, KV cache and scratch ([`draft_pack_bytes`]); 0 = none.
    /// Counted in the fixed region ([`FixedRegion::draft`]).
    pub draft_bytes: u64,
}

/// What a process measured of itself once loaded, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Resident set now (`VmRSS`, after returning freed heap to the kernel).
    pub rss: u64,
    /// Peak resident set so far (`VmHWM`): loading has transients (the
    /// tokenizer's JSON parse) that are freed by now but were resident, and
    /// count against the budget (a cgroup limit, the peak RSS reported).
    pub peak: u64,
}

/// The fixed region of a pack at a context length, bytes, with its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedRegion {
    /// Tokenizer and resident segments.
    pub resident: u64,
    /// KV cache at the context length.
    pub kv: u64,
    /// Prefill and decode scratch buffers, and the runtime's per-neuron and
    /// per-cluster tables ([`crate::layout::index_bytes`]).
    pub scratch: u64,
    /// Runtime code, libraries, in-memory tokenizer.
    pub runtime: u64,
    /// A draft pack held beside the model ([`PlanRequest::draft_bytes`]).
    pub draft: u64,
}

impl FixedRegion {
    /// Sum of the parts.
    pub fn total(&self) -> u64 {
        self.resident + self.kv + self.scratch + self.runtime + self.draft
    }

    /// `resident R MiB + KV cache at ctx N: K MiB + …` for messages.
    pub fn describe(&self, ctx: u32) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        format!(
            "fixed region: resident tensors {:.1} MiB + KV cache at ctx {ctx}: {:.1} MiB + scratch {:.1} MiB + runtime {:.1} MiB",
            mib(self.resident),
            mib(self.kv),
            mib(self.scratch),
            mib(self.runtime)
        ) + &if self.draft > 0 { format!(" + draft pack {:.1} MiB", mib(self.draft)) } else { String::new() }
    }
}

/// The fixed region of `m` at context `ctx` (see the module docs); with a
/// `measured` footprint (resident tensors and tokenizer loaded) the runtime
/// part is its resident set less the resident segments, plus
/// [`RUNTIME_MARGIN_BYTES`], and at least enough that the whole fixed region
/// covers the load peak: the transient and the KV cache, scratch and neuron
/// cache allocated later never coexist, but both must fit the budget.
pub fn fixed_region(m: &Manifest, ctx: u32, kv: KvType, measured: Option<Footprint>) -> FixedRegion {
    let c = &m.config;
    let h = c.hidden_size;
    let resident = resident_bytes(m);
    let kv = kv_cache_bytes_of(c, ctx as usize, kv);
    // One prefill chunk of n tokens, f32 (runtime/src/model/forward.rs): the
    // residual and normed input [n, hidden] (and the sandwich norms' output)
    // live through a layer; beside them, at most one step's buffers at a time,
    // each freed before the next: attention's Q, K, V, result and output
    // [n, ·] and its scores; the FFN's accumulator and quantized input
    // [n, hidden], gate and up products of one tile [n, tile rows] (a short
    // pass takes wider tiles, the same size in all: Ffn::forward_batch), one
    // dequantized down tile [tile rows, hidden] and the predictor's mask
    // [n, FFN] (bytes); or the predictor's own products, [n, FFN] twice.
    let n = (ctx as u64).min(crate::layout::prefill_chunk(c) as u64);
    let chunk = crate::layout::prefill_chunk(c) as u64;
    let (inter, qd, kvd) = (c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let tile_rows = (FFN_TILE_ELEMS as u64 / h.max(1)).clamp(1, inter.max(1));
    let live = n * (if c.sandwich_norms() { 3 } else { 2 }) * h * 4;
    let attention = n * (2 * qd + 2 * kvd + h) * 4 + n * ctx as u64 * 4;
    let mask = n * inter;
    let ffn = 2 * n * h * 4 + 2 * (chunk * tile_rows).min(n * inter) * 4 + tile_rows * h * 4 + mask;
    let predictor = if m.sparse.is_some() { 2 * n * inter * 4 + mask } else { 0 };
    // The runtime's per-neuron and per-cluster tables, allocated after it measured itself.
    let index = crate::layout::index_bytes(m);
    let scratch = live + attention.max(ffn).max(predictor) + 2 * c.vocab_size * 4 + index;
    let runtime = match measured {
        Some(f) => {
            (f.rss.saturating_sub(resident) + RUNTIME_MARGIN_BYTES).max(f.peak.saturating_sub(resident + kv + scratch))
        }
        None => runtime_estimate(m),
    };
    FixedRegion { resident, kv, scratch, runtime, draft: 0 }
}

/// What a draft pack `m` (speculative decoding's `--draft`, issue 47)
/// holds beside the model it drafts for, bytes: all of it in memory
/// (resident segments, every FFN neuron cluster), its KV cache at `ctx`
/// tokens of `kv` elements, its scratch and its in-memory tokenizer
/// ([`TOKENIZER_FACTOR`]); the process's own base ([`RUNTIME_BASE_BYTES`])
/// is the model's, counted once.
pub fn draft_pack_bytes(m: &Manifest, ctx: u32, kv: KvType) -> u64 {
    let f = fixed_region(m, ctx, kv, None);
    f.resident + f.kv + f.scratch + TOKENIZER_FACTOR * m.tokenizer.json_bytes + ffn_read_bytes(m)
}

/// Bytes of `m`'s tokenizer and resident segments (embeddings, attention,
/// norms, predictors): every segment but the FFN's.
pub fn resident_bytes(m: &Manifest) -> u64 {
    m.segments.iter().filter(|s| s.kind != SegmentKind::Ffn).map(|s| s.bytes).sum()
}

/// The runtime's own memory for `m` estimated off the device, bytes:
/// [`RUNTIME_BASE_BYTES`] and [`TOKENIZER_FACTOR`] times the tokenizer's JSON.
pub fn runtime_estimate(m: &Manifest) -> u64 {
    RUNTIME_BASE_BYTES + TOKENIZER_FACTOR * m.tokenizer.json_bytes
}

/// The least neuron cache a run of `m` can hold, bytes: one FFN unit's
/// clusters (the largest), which stage its reads when nothing is hot. With
/// the fixed region it is a plan's minimum budget.
pub fn staging_bytes(m: &Manifest) -> u64 {
    m.ffn.iter().map(|f| f.clusters.iter().map(|c| cluster_read_bytes(f, c)).sum::<u64>()).max().unwrap_or(0)
}

/// Chooses the neuron-cluster size for a layer of `n_neurons` bundles of
/// `bundle_bytes`, whose neurons are needed with probabilities `p` (packed
/// order): the size among 4 KiB … 512 KiB that minimises the expected decode
/// I/O time on `dev` (fewer, larger reads against reading unneeded
/// neighbours), preferring the smallest within 5 % of the best (finer hot
/// sets). Returns bytes.
pub fn choose_cluster_bytes(dev: &DeviceProfile, bundle_bytes: u64, p: &[f64]) -> u64 {
    let mut best: Vec<(u64, f64)> = Vec::new();
    for s in (12..=19).map(|e| 1u64 << e) {
        let k = (s / bundle_bytes.max(1)).max(1) as usize;
        let cs: Vec<Cl> =
            p.chunks(k).map(|ch| Cl { bytes: align_up(ch.len() as u64 * bundle_bytes), p: cluster_need(ch) }).collect();
        best.push((s, io_seconds(dev, &cs)));
    }
    let min = best.iter().map(|b| b.1).fold(f64::INFINITY, f64::min);
    best.iter().find(|b| b.1 <= min * 1.05).map_or(64 << 10, |b| b.0)
}

/// Plans hot set, cold cache and I/O threads for `m` on `dev` (module docs).
///
/// # Errors
/// [`nflash_format::Error::Budget`] (wrapped) if the fixed region alone
/// exceeds the budget, saying by how much.
pub fn plan(m: &Manifest, dev: &DeviceProfile, req: &PlanRequest) -> Result<Plan> {
    let fixed = FixedRegion { draft: req.draft_bytes, ..fixed_region(m, req.ctx, req.kv, req.measured) };
    let budget = req.budget_bytes;
    // The minimum: the fixed region and one layer's FFN clusters, which stage reads.
    let max_layer = staging_bytes(m);
    let need = fixed.total() + max_layer;
    if need > budget {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        // The largest context whose KV cache fits (the rest of the minimum does not depend on it).
        // Per context token: its KV entries and one prefill chunk's attention scores.
        let scores = (req.ctx as u64).min(crate::layout::prefill_chunk(&m.config) as u64) * req.ctx as u64 * 4;
        let per_token = (fixed.kv + scores) / req.ctx.max(1) as u64;
        let rest = need - fixed.kv - scores.min(fixed.scratch);
        let mut ctx_fit = if per_token > 0 && budget > rest { (budget - rest) / per_token * 98 / 100 } else { 0 };
        // Only a context that really fits, with the slack the stated minimum
        // has (so the next run accepts the hint too): stepping down from the
        // estimate, since a load peak larger than the steady state does not
        // shrink with the KV cache.
        let slack = nflash_format::error::MEASUREMENT_SLACK_BYTES;
        let fits = |c: u64| {
            fixed_region(m, c as u32, req.kv, req.measured).total() + req.draft_bytes + max_layer + slack <= budget
        };
        while ctx_fit >= 16 && !fits(ctx_fit) {
            ctx_fit = ctx_fit * 15 / 16;
        }
        let mut ctx_hint = if ctx_fit >= 16 && ctx_fit < req.ctx as u64 && fits(ctx_fit) {
            format!(", or lower --ctx to {ctx_fit} or less")
        } else {
            String::new()
        };
        if req.draft_bytes > 0 {
            ctx_hint += &format!(
                ", or drop --draft or lower --ctx (the draft pack takes {:.1} MiB at this context)",
                mib(req.draft_bytes)
            );
        }
        return Err(Error::Format(nflash_format::Error::Budget {
            budget,
            budget_mib: mib(budget),
            need,
            need_mib: mib(need),
            short_mib: mib(need - budget),
            detail: format!(
                "{} + one layer's FFN neuron clusters to stage reads {:.1} MiB",
                fixed.describe(req.ctx),
                mib(max_layer)
            ),
            suggest_mib: (need + nflash_format::error::MEASUREMENT_SLACK_BYTES).div_ceil(1 << 20),
            ctx_hint,
        }));
    }
    let avail = budget - fixed.total();
    let matvec = dev.matvec_bytes_per_s(req.threads);
    // Per FFN unit: clusters with their need probability (an expert's times
    // its routed share), and its part of its layer's attention compute time.
    let share = req.unit_share.clone().unwrap_or_else(|| crate::cost::uniform_unit_share(m));
    let layers = cluster_needs(m, &share);
    let split = attention_split(m, &share);
    let t_attn: Vec<f64> =
        (0..m.ffn.len()).map(|u| attention_bytes(m, m.ffn[u].layer as usize) as f64 / matvec * split[u]).collect();
    let total: u64 = layers.iter().flatten().map(|c| c.bytes).sum();
    let mut hot = vec![0usize; layers.len()];
    let cold_of = |l: usize, h: usize| -> u64 { layers[l][h..].iter().map(|c| c.bytes).sum() };
    let (hot_bytes, cold_bytes) = if avail >= total {
        hot.iter_mut().zip(&layers).for_each(|(h, cs)| *h = cs.len());
        (total, 0)
    } else {
        // Greedy: the most likely needed next cluster among layers whose expected
        // miss I/O does not yet fit in their attention time, while the hot set plus
        // one layer's cold clusters (the staging minimum) fits.
        let mut hot_bytes = 0u64;
        let mut io_rem: Vec<f64> = layers.iter().map(|cs| io_seconds(dev, cs)).collect();
        let mut cold: Vec<u64> = (0..layers.len()).map(|l| cold_of(l, 0)).collect();
        loop {
            let mut pick: Option<(usize, f64)> = None;
            for l in 0..layers.len() {
                let h = hot[l];
                if h == layers[l].len() || io_rem[l] <= t_attn[l] {
                    continue;
                }
                // Most likely needed first; ties go to the layer with the fewest hot
                // clusters, so equal layers grow evenly.
                let better = pick.is_none_or(|(b, p)| layers[l][h].p > p || (layers[l][h].p == p && h < hot[b]));
                if better {
                    pick = Some((l, layers[l][h].p));
                }
            }
            let Some((l, _)) = pick else { break };
            let c = layers[l][hot[l]];
            cold[l] -= c.bytes;
            // Staging: the current layer's cold clusters and the next one's, read ahead.
            let n = cold.len();
            let staging = (0..n).map(|j| cold[j] + if n > 1 { cold[(j + 1) % n] } else { 0 }).max().unwrap_or(0);
            if hot_bytes + c.bytes + staging > avail {
                break;
            }
            hot[l] += 1;
            io_rem[l] -= io_term(dev, &c);
            hot_bytes += c.bytes;
        }
        (hot_bytes, avail - hot_bytes)
    };
    let est = estimate_with(m, &share, dev, req.threads, (req.ctx, req.kv), &layers, &hot, cold_bytes);
    let io_threads = req.io_threads.unwrap_or_else(|| dev.flash.io_queues.min(MAX_IO_THREADS)).max(1);
    let hot_neurons = hot.iter().zip(&m.ffn).map(|(&h, f)| f.clusters[..h].iter().map(|c| c.n_neurons).sum()).collect();
    let cluster_bytes =
        m.ffn.first().and_then(|f| f.clusters.first().map(|c| c.n_neurons as u64 * f.bundle.bundle_bytes)).unwrap_or(0);
    Ok(Plan {
        device: dev.clone(),
        memory_budget_bytes: budget,
        ctx: req.ctx,
        threads: req.threads,
        fixed_bytes: fixed.total(),
        resident_bytes: fixed.resident,
        kv_bytes: fixed.kv,
        hot_neurons,
        hot_bytes,
        cold_bytes,
        io_threads,
        cluster_bytes,
        expected_read_bytes_per_token: est.read_bytes_per_token as u64,
        expected_token_ms: est.token_ms(),
    })
}

/// A human-readable summary of `p` (printed by `prep convert` and `nflash run --stats`).
pub fn describe(p: &Plan, m: &Manifest) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let ffn_total = ffn_read_bytes(m);
    let hot_n: u64 = p.hot_neurons.iter().map(|&h| h as u64).sum();
    let all_n: u64 = m.ffn.iter().map(|f| f.n_neurons as u64).sum();
    let (lo, hi) = (p.hot_neurons.iter().min().copied().unwrap_or(0), p.hot_neurons.iter().max().copied().unwrap_or(0));
    let unit = if m.config.architecture.moe().is_some() { "expert" } else { "layer" };
    let floor = p.fixed_bytes + staging_bytes(m);
    format!(
        "plan for {} at {:.1} MiB (ctx {}, {} threads):\n  fixed region {:.1} MiB (resident {:.1} MiB, KV cache {:.1} MiB, scratch and runtime {:.1} MiB)\n  hot region   {:.1} MiB: {hot_n} of {all_n} neurons ({:.0}%), {lo}–{hi} per {unit}\n  cold region  {:.1} MiB (LRU of {:.0} KiB neuron clusters), {} I/O thread(s)\n  FFN on flash {:.1} MiB; expected {:.2} MiB read and {:.1} ms per decode token\n  under memory pressure down to a floor of {:.1} MiB (the fixed region and one {unit}'s clusters): the cold region's least recently used clusters leave first, then the same share of every {unit}'s least active hot clusters; back to {:.1} MiB 2 s after",
        p.device.name,
        mib(p.memory_budget_bytes),
        p.ctx,
        p.threads,
        mib(p.fixed_bytes),
        mib(p.resident_bytes),
        mib(p.kv_bytes),
        mib(p.fixed_bytes.saturating_sub(p.resident_bytes + p.kv_bytes)),
        mib(p.hot_bytes),
        100.0 * hot_n as f64 / all_n.max(1) as f64,
        mib(p.cold_bytes),
        align_up(p.cluster_bytes) as f64 / 1024.0,
        p.io_threads,
        mib(ffn_total),
        mib(p.expected_read_bytes_per_token),
        p.expected_token_ms,
        mib(floor),
        mib(p.memory_budget_bytes),
    )
}

/// Bytes of the hot region that pins `hot_neurons[l]` packed positions of
/// each layer `l` of `m` (whole clusters only).
pub fn hot_region_bytes(m: &Manifest, hot_neurons: &[u32]) -> u64 {
    m.ffn
        .iter()
        .zip(hot_neurons)
        .flat_map(|(f, &h)| f.clusters[..hot_clusters(f, h)].iter().map(move |c| cluster_read_bytes(f, c)))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_need_a_unit() {
        assert_eq!(parse_bytes("96MiB"), Ok(96 << 20));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("4096B"), Ok(4096));
        assert_eq!(parse_bytes("100MB"), Ok(100_000_000));
        for bare in ["512", "1048576", "1.5", "1e9"] {
            let e = parse_bytes(bare).unwrap_err();
            assert!(e.contains("no unit") && e.contains(&format!("{bare}MiB")), "{bare}: {e}");
        }
        assert!(parse_bytes("lots").is_err());
        for negative in ["-1", "-5MiB", " -0.5GiB"] {
            let e = parse_bytes(negative).unwrap_err();
            assert!(e.contains("cannot be negative") && !e.contains("MiB or"), "{negative}: {e}");
        }
    }
}
