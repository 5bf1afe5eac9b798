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

use nflash_format::{DeviceProfile, Manifest, Plan, PredictorKind, SegmentKind};

use crate::cache::{cluster_read_bytes, hot_clusters, MAX_MERGE_BYTES};
use crate::error::{Error, Result};
use crate::flash::align_up;
use crate::generate::PREFILL_CHUNK;
use crate::kv_cache::KvCache;
use crate::model::FFN_TILE_ELEMS;

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
/// of the compute kernels, thread stacks, allocator slack), bytes. Measured
/// on SmolLM2-135M as peak RSS minus the start-up RSS, the hot and cold
/// regions, the KV cache in use and the scratch estimate: about 4 MiB.
pub const RUNTIME_MARGIN_BYTES: u64 = 4 << 20;

/// Most I/O threads a plan starts (and `--io-threads` accepts): one per
/// read in flight, up to the deepest queue `nflash probe` measures.
pub const MAX_IO_THREADS: u32 = 64;

/// Parses a byte size for the command line: `96MiB`, `1.5GiB`, `100MB`
/// (10⁸), or plain bytes (the `parse-size` crate's syntax).
///
/// # Errors
/// A message with examples.
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    parse_size::parse_size(s).map_err(|e| format!("{e}: expected a size such as 96MiB, 1.5GiB, 100MB or 1048576"))
}

/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Whole-process memory budget, bytes.
    pub budget_bytes: u64,
    /// Context length, tokens (sizes the KV cache).
    pub ctx: u32,
    /// Compute threads.
    pub threads: u32,
    /// I/O threads; `None` = from the profile (its I/O queues, at most [`MAX_IO_THREADS`]: each
    /// thread keeps one read in flight, and the probe measures up to 64).
    pub io_threads: Option<u32>,
    /// The process's memory measured with the resident tensors and tokenizer
    /// loaded (`nflash run` measures itself); replaces the estimate of the
    /// resident + runtime part of the fixed region.
    pub measured: Option<Footprint>,
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
    /// Prefill and decode scratch buffers.
    pub scratch: u64,
    /// Runtime code, libraries, in-memory tokenizer.
    pub runtime: u64,
}

impl FixedRegion {
    /// Sum of the parts.
    pub fn total(&self) -> u64 {
        self.resident + self.kv + self.scratch + self.runtime
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
        )
    }
}

/// The fixed region of `m` at context `ctx` (see the module docs); with a
/// `measured` footprint (resident tensors and tokenizer loaded) the runtime
/// part is its resident set less the resident segments, plus
/// [`RUNTIME_MARGIN_BYTES`], and at least enough that the whole fixed region
/// covers the load peak: the transient and the KV cache, scratch and neuron
/// cache allocated later never coexist, but both must fit the budget.
pub fn fixed_region(m: &Manifest, ctx: u32, measured: Option<Footprint>) -> FixedRegion {
    let c = &m.config;
    let (h, qd, kvd) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let resident = m.segments.iter().filter(|s| s.kind != SegmentKind::Ffn).map(|s| s.bytes).sum();
    let kv = KvCache::bytes_at_capacity(c.num_layers as usize, kvd as usize, ctx as usize);
    // One prefill chunk: activations [n, ·], one FFN weight tile (gate, up, down,
    // f32), its [n, m] products, candle's copies of them, and the logits.
    let n = (ctx as u64).min(PREFILL_CHUNK as u64);
    let tile_rows = (FFN_TILE_ELEMS as u64 / h.max(1)).clamp(1, c.intermediate_size.max(1));
    let activations = n * (6 * h + 2 * qd + 2 * kvd) * 4;
    let tile = 3 * tile_rows * h * 4 + 4 * n * tile_rows * 4 + 2 * n * h * 4;
    let scores = n * ctx as u64 * 4;
    let scratch = activations + tile + scores + 2 * c.vocab_size * 4 + n * c.intermediate_size;
    let runtime = match measured {
        Some(f) => (f.rss.saturating_sub(resident) + RUNTIME_MARGIN_BYTES).max(f.peak.saturating_sub(resident + kv + scratch)),
        None => RUNTIME_BASE_BYTES + TOKENIZER_FACTOR * m.tokenizer.json_bytes,
    };
    FixedRegion { resident, kv, scratch, runtime }
}

/// Probability that decode needs each neuron of layer `l` (packed order):
/// the profiled activation frequency scaled by the predictor's
/// recall / precision (1 for a dense pack or the exact predictor, which read every bundle).
fn need_probability(m: &Manifest, l: usize) -> Vec<f64> {
    neuron_need_probability(m.sparse.as_ref(), m.ffn[l].sparse.as_ref(), m.ffn[l].n_neurons as usize)
}

/// Probability that decode needs each of a layer's `n` neurons (packed
/// order), from the pack-wide `info` and the layer's `sp` sparsity settings
/// (SPEC §4.5): `recall·f + fpr·(1 − f)` for the profiled frequency `f`,
/// with the predictor's false-positive rate from its recall and precision;
/// all 1 for a dense layer or the exact predictor.
pub fn neuron_need_probability(info: Option<&nflash_format::SparseInfo>, sp: Option<&nflash_format::LayerSparsity>, n: usize) -> Vec<f64> {
    let (Some(info), Some(sp)) = (info, sp) else { return vec![1.0; n] };
    if info.predictor == PredictorKind::Exact || sp.frequency_curve.len() < 2 {
        return vec![1.0; n];
    }
    let q = &sp.quality;
    let curve = &sp.frequency_curve;
    let k = (curve.len() - 1) as f64;
    let freq: Vec<f64> = (0..n)
        .map(|p| {
            // Linear interpolation in the curve sampled at round(k·(n-1)/32).
            let x = if n > 1 { p as f64 * k / (n - 1) as f64 } else { 0.0 };
            let i = (x.floor() as usize).min(curve.len() - 2);
            (curve[i] as f64 + (curve[i + 1] - curve[i]) as f64 * (x - i as f64)).clamp(0.0, 1.0)
        })
        .collect();
    // A neuron is selected when it is active and caught (recall), or inactive
    // and a false positive: the predictor selects recall·f̄/precision of the
    // neurons, recall·f̄ of them rightly, so its false-positive rate among
    // inactive neurons is (recall·f̄/precision − recall·f̄)/(1 − f̄). False
    // positives fall on cold neurons as much as on hot ones.
    let recall = (q.recall as f64).clamp(0.0, 1.0);
    let mean = freq.iter().sum::<f64>() / n.max(1) as f64;
    let selected = if q.precision > 0.0 { (recall * mean / q.precision as f64).min(1.0) } else { 1.0 };
    let fpr = if mean < 1.0 { ((selected - recall * mean) / (1.0 - mean)).clamp(0.0, 1.0) } else { 0.0 };
    freq.iter().map(|&f| (recall * f + fpr * (1.0 - f)).clamp(0.0, 1.0)).collect()
}

/// Probability that decode needs a cluster whose neurons are needed with
/// probabilities `p` (independently): `1 − Π(1 − pᵢ)`.
pub fn cluster_need(p: &[f64]) -> f64 {
    1.0 - p.iter().map(|q| 1.0 - q).product::<f64>()
}

/// One cluster as the planner sees it.
#[derive(Debug, Clone, Copy)]
struct Cl {
    /// Bytes read (aligned).
    bytes: u64,
    /// Probability that a decode token needs it.
    p: f64,
}

/// Expected decode I/O seconds per token for clusters `cs` (all cold):
/// each is read with probability `p`; adjacent needed clusters merge, so a
/// read is about `bytes / (1 − p)` long (capped at the merge limit).
fn io_seconds(dev: &DeviceProfile, cs: &[Cl]) -> f64 {
    cs.iter().map(|c| io_term(dev, c)).sum()
}

/// One cluster's share of [`io_seconds`].
fn io_term(dev: &DeviceProfile, c: &Cl) -> f64 {
    let run = (c.bytes as f64 / (1.0 - c.p).max(1e-3)).min(MAX_MERGE_BYTES as f64);
    c.p * c.bytes as f64 / dev.random_read_bytes_per_s(run as u64)
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
        let cs: Vec<Cl> = p
            .chunks(k)
            .map(|ch| Cl { bytes: align_up(ch.len() as u64 * bundle_bytes), p: cluster_need(ch) })
            .collect();
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
    let fixed = fixed_region(m, req.ctx, req.measured);
    let budget = req.budget_bytes;
    // The minimum: the fixed region and one layer's FFN clusters, which stage reads.
    let max_layer: u64 = m.ffn.iter().map(|f| f.clusters.iter().map(|c| cluster_read_bytes(f, c)).sum::<u64>()).max().unwrap_or(0);
    let need = fixed.total() + max_layer;
    if need > budget {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        // The largest context whose KV cache fits (the rest of the minimum does not depend on it).
        // Per context token: its KV entries and one prefill chunk's attention scores.
        let scores = (req.ctx as u64).min(PREFILL_CHUNK as u64) * req.ctx as u64 * 4;
        let per_token = (fixed.kv + scores) / req.ctx.max(1) as u64;
        let rest = need - fixed.kv - scores.min(fixed.scratch);
        let ctx_fit = if per_token > 0 && budget > rest { (budget - rest) / per_token * 98 / 100 } else { 0 };
        // Only when that context really fits: a load peak larger than the
        // steady state does not shrink with the KV cache.
        let fits = |c: u64| fixed_region(m, c as u32, req.measured).total() + max_layer <= budget;
        let ctx_hint = if ctx_fit >= 16 && ctx_fit < req.ctx as u64 && fits(ctx_fit) {
            format!(", or lower --ctx to {ctx_fit} or less")
        } else {
            String::new()
        };
        return Err(Error::Format(nflash_format::Error::Budget {
            budget,
            budget_mib: mib(budget),
            need,
            need_mib: mib(need),
            short_mib: mib(need - budget),
            detail: format!("{} + one layer's FFN neuron clusters to stage reads {:.1} MiB", fixed.describe(req.ctx), mib(max_layer)),
            suggest_mib: (need as f64 * 1.02 / (1u64 << 20) as f64).ceil() as u64,
            ctx_hint,
        }));
    }
    let avail = budget - fixed.total();
    let matvec = dev.matvec_bytes_per_s(req.threads);
    // Per layer: clusters with their need probability, and attention compute time.
    let layers = cluster_needs(m);
    let t_attn: Vec<f64> = (0..m.ffn.len()).map(|l| attention_bytes(m, l) as f64 / matvec).collect();
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
    let est = estimate_with(m, dev, req.threads, req.ctx, &layers, &hot, cold_bytes);
    let io_threads = req.io_threads.unwrap_or_else(|| dev.flash.io_queues.min(MAX_IO_THREADS)).max(1);
    let hot_neurons = hot
        .iter()
        .zip(&m.ffn)
        .map(|(&h, f)| f.clusters[..h].iter().map(|c| c.n_neurons).sum())
        .collect();
    let cluster_bytes = m.ffn.first().and_then(|f| f.clusters.first().map(|c| c.n_neurons as u64 * f.bundle.bundle_bytes)).unwrap_or(0);
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

/// Every layer's clusters with their read size and need probability.
fn cluster_needs(m: &Manifest) -> Vec<Vec<Cl>> {
    (0..m.ffn.len())
        .map(|l| {
            let f = &m.ffn[l];
            let p = need_probability(m, l);
            f.clusters
                .iter()
                .map(|c| Cl { bytes: cluster_read_bytes(f, c), p: cluster_need(&p[c.first as usize..(c.first + c.n_neurons) as usize]) })
                .collect()
        })
        .collect()
}

/// KV cache bytes one layer's attention reads for a decode token at
/// `position`: the keys and values of the positions it attends to, up to the
/// sliding window, as [`KvCache`] stores them. The estimate takes the token
/// at half the context, the mean over a generation that fills it.
fn kv_read_bytes(m: &Manifest, position: u32) -> u64 {
    let c = &m.config;
    let seen = c.sliding_window.map_or(position as u64, |w| (position as u64).min(w as u64 + 1));
    KvCache::bytes_at_capacity(1, (c.num_kv_heads * c.head_dim) as usize, seen as usize)
}

/// Bytes of layer `l`'s attention weights (read once per decode token).
fn attention_bytes(m: &Manifest, l: usize) -> u64 {
    let prefix = format!("model.layers.{l}.self_attn.");
    m.tensors.iter().filter(|t| t.name.starts_with(&prefix)).map(|t| t.bytes).sum()
}

/// Expected decode cost per token of a plan, split by resource (what
/// `nflash plan-sim` prints; the planner stores its total in the plan).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Estimate {
    /// Attention (dense): its projections and the KV cache at half the context, ms.
    pub attention_ms: f64,
    /// Predictors, ms.
    pub predictor_ms: f64,
    /// FFN of the predicted neurons (their gate/up/down bundles), ms.
    pub ffn_ms: f64,
    /// Output projection (lm_head), ms.
    pub lm_head_ms: f64,
    /// CPU time the reads take from the compute threads (syscalls,
    /// completions: [`DeviceProfile::read_cpu_s`] per read ÷ threads), ms.
    pub io_cpu_ms: f64,
    /// Flash reads of missed cold clusters, ms (overlapped with the layer's
    /// FFN compute, and with its attention when speculated).
    pub io_ms: f64,
    /// Sum over layers of the I/O time compute does not hide, ms
    /// ([`OVERLAP_LOSS`]): reads overlapping the FFN and the reads' CPU
    /// time, or with a speculative prefetch (layers where that leaves more
    /// than a predictor evaluation exposed, as `nflash run` decides) reads
    /// `× (1 + SPECULATION_WASTE)` overlapping attention, predictor, FFN and
    /// the reads' CPU time.
    pub io_exposed_ms: f64,
    /// Layers that run a speculative prefetch.
    pub speculated_layers: u32,
    /// Expected flash bytes read per token.
    pub read_bytes_per_token: f64,
    /// Expected share of needed clusters found in memory (hot or cold region).
    pub hit_rate: f64,
    /// Of those, the share found in the hot region (the rest: cold LRU hits).
    pub hot_hit_rate: f64,
}

impl Estimate {
    /// Time per decode token, ms: compute plus the I/O it does not hide.
    pub fn token_ms(&self) -> f64 {
        self.compute_ms() + self.io_exposed_ms
    }

    /// Compute alone (with the CPU side of the reads), ms.
    pub fn compute_ms(&self) -> f64 {
        self.attention_ms + self.predictor_ms + self.ffn_ms + self.lm_head_ms + self.io_cpu_ms
    }

    /// Which resource bounds decode: `"flash I/O"` when un-hidden I/O is
    /// more than half the time, `"compute + I/O"` when it is a fifth to a
    /// half, else `"compute"`.
    pub fn bound(&self) -> &'static str {
        let share = self.io_exposed_ms / self.token_ms().max(1e-12);
        if share > 0.5 {
            "flash I/O"
        } else if share > 0.2 {
            "compute + I/O"
        } else {
            "compute"
        }
    }
}

/// The expected decode cost of plan `p` for `m` on `dev` (see [`Estimate`]).
pub fn estimate(m: &Manifest, dev: &DeviceProfile, p: &Plan) -> Estimate {
    let hot: Vec<usize> = m.ffn.iter().zip(&p.hot_neurons).map(|(f, &h)| hot_clusters(f, h)).collect();
    estimate_with(m, dev, p.threads, p.ctx, &cluster_needs(m), &hot, p.cold_bytes)
}

/// [`estimate`] from the planner's per-layer clusters and hot cluster counts.
///
/// Compute: attention weights / the profile's attention-block speed and
/// the KV cache and lm_head / its matvec speed at `threads`; the
/// predictor's bytes / its Q8_0 predictor speed and the bundles of the
/// neurons the predictor selects / its sparse FFN speed (`[kernels]`, the
/// matvec speed without them); each read's CPU time
/// ([`DeviceProfile::read_cpu_s`]) shared by the threads. I/O: each cold cluster is needed
/// with its probability `p`; the cold LRU keeps it as [`lru_hit`] says;
/// misses are read at the profile's random-read bandwidth for the merged
/// read size, hidden behind the layer's FFN (and, speculated, its
/// attention and predictor: [`Estimate::io_exposed_ms`]).
fn estimate_with(m: &Manifest, dev: &DeviceProfile, threads: u32, ctx: u32, layers: &[Vec<Cl>], hot: &[usize], cold_bytes: u64) -> Estimate {
    let matvec = dev.matvec_bytes_per_s(threads);
    let attention = dev.attention_bytes_per_s(threads);
    let kv_ms = kv_read_bytes(m, ctx / 2) as f64 / matvec * 1e3;
    let ffn_speed = dev.ffn_bytes_per_s(threads);
    let predictor = dev.predictor_bytes_per_s(threads);
    let cold: Vec<&Cl> = layers.iter().zip(hot).flat_map(|(cs, &h)| cs[h..].iter()).collect();
    let slot = cold.iter().map(|c| c.bytes).max().unwrap_or(1).max(1);
    let slots = (cold_bytes / slot) as f64;
    let k_tokens = lru_window_tokens(&cold.iter().map(|c| c.p).collect::<Vec<_>>(), slots);
    let keep = |p: f64| lru_hit(p, k_tokens);
    let mut e = Estimate::default();
    let (mut needed, mut found, mut found_hot) = (0.0, 0.0, 0.0);
    for (l, cs) in layers.iter().enumerate() {
        let f = &m.ffn[l];
        let q = need_probability(m, l);
        let attn_ms = attention_bytes(m, l) as f64 / attention * 1e3 + kv_ms;
        e.attention_ms += attn_ms;
        let pred_ms = f.sparse.as_ref().map_or(0, |s| s.predictor_bytes) as f64 / predictor * 1e3;
        e.predictor_ms += pred_ms;
        let ffn_ms = q.iter().sum::<f64>() * f.bundle.bundle_bytes as f64 / ffn_speed * 1e3;
        e.ffn_ms += ffn_ms;
        // read_cpu_ms: the reads' CPU time per compute thread.
        let (mut io_s, mut read_cpu_ms, mut bytes) = (0.0, 0.0, 0.0);
        for (i, c) in cs.iter().enumerate() {
            needed += c.p;
            if i < hot[l] {
                found += c.p;
                found_hot += c.p;
                continue;
            }
            let k = keep(c.p);
            found += c.p * k;
            bytes += c.p * (1.0 - k) * c.bytes as f64;
            read_cpu_ms += c.p * (1.0 - k) * dev.read_cpu_s(c.bytes) / threads.max(1) as f64 * 1e3;
            io_s += io_term(dev, c) * (1.0 - k);
        }
        // The reads' CPU time runs on the compute threads, alongside the FFN.
        let io_ms = io_s * 1e3;
        let exposed = overlap_exposed(ffn_ms + read_cpu_ms, io_ms);
        // Speculative prefetch (`nflash run --speculate auto`): when the layer
        // would wait longer than a predictor evaluation, one more (over the
        // cold neurons' rows) starts the reads before the attention.
        let spec = f.sparse.is_some() && exposed > pred_ms;
        let extra = if spec { 1.0 + SPECULATION_WASTE } else { 1.0 };
        let cpu_ms = read_cpu_ms * extra;
        if spec {
            let (h, n) = (m.config.hidden_size as f64, f.n_neurons as f64);
            let cold_n = cs[hot[l]..].len() as f64 / cs.len().max(1) as f64 * n;
            e.predictor_ms += pred_ms * (h + cold_n) / (h + n);
            e.io_exposed_ms += overlap_exposed(attn_ms + pred_ms + ffn_ms + cpu_ms, io_ms * extra);
            e.speculated_layers += 1;
        } else {
            e.io_exposed_ms += exposed;
        }
        e.io_ms += io_ms * extra;
        e.read_bytes_per_token += bytes * extra;
        e.io_cpu_ms += cpu_ms;
    }
    let head: u64 = m.tensors.iter().filter(|t| t.name == "lm_head.weight" || (m.config.tie_word_embeddings && t.name == "model.embed_tokens.weight")).map(|t| t.bytes).sum();
    e.lm_head_ms = head as f64 / matvec * 1e3;
    e.hit_rate = if needed > 0.0 { found / needed } else { 1.0 };
    e.hot_hit_rate = if needed > 0.0 { found_hot / needed } else { 1.0 };
    e
}

/// Share of the shorter of a layer's overlapping compute and reads that is
/// not hidden: a layer takes `max(c, r) + OVERLAP_LOSS · min(c, r)`. The I/O
/// threads issue and complete reads on the compute threads' cores, so the
/// queue is not kept full while the cores compute, and the last reads of a
/// layer land after its resident neurons are done. Fitted on the dev host
/// (2026-12-02, 2 cores, 16 I/O threads) to the points of `make bench-scale`
/// where reads and compute are of similar size (0.3: 0.8 at half the FFN
/// took 187 ms per token, with 144 ms of compute and 143 ms of reads).
pub const OVERLAP_LOSS: f64 = 0.3;

/// The part of a layer's `io` ms that its overlapping `compute` ms does not
/// hide ([`OVERLAP_LOSS`]).
fn overlap_exposed(compute: f64, io: f64) -> f64 {
    if io <= 0.0 {
        return 0.0;
    }
    compute.max(io) + OVERLAP_LOSS * compute.min(io) - compute
}

/// Extra reads of a speculative prefetch, as a fraction of the layer's
/// misses: clusters the speculation reads that the layer then does not
/// need. Measured precision 0.84–0.95 on the synthetic 7B at sparsity
/// 0.9–0.6 and half the FFN in memory (2026-12-02).
pub const SPECULATION_WASTE: f64 = 0.12;

/// How many tokens back the cold LRU reaches: `K` such that the clusters
/// used in the last `K` decode tokens fill its `slots`, for clusters needed
/// independently with probabilities `p` per token. A window of `K` tokens
/// holds cluster `i` with probability `1 − (1 − pᵢ)^⌊K⌋ · (1 − frac(K)·pᵢ)`
/// (its `⌊K⌋` last tokens, and the layer-ordered part of one more).
/// `f64::INFINITY` when every cluster fits; 0 without slots.
pub fn lru_window_tokens(p: &[f64], slots: f64) -> f64 {
    if slots < 1.0 {
        return 0.0;
    }
    if p.iter().filter(|&&q| q > 0.0).count() as f64 <= slots {
        return f64::INFINITY;
    }
    let held = |k: f64| -> f64 {
        let (whole, part) = (k.floor() as i32, k.fract());
        p.iter().map(|&q| 1.0 - (1.0 - q).powi(whole) * (1.0 - part * q)).sum()
    };
    let (mut lo, mut hi) = (0.0, 1.0);
    while held(hi) < slots {
        hi *= 2.0;
        if hi > 1e12 {
            return f64::INFINITY;
        }
    }
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if held(mid) < slots {
            lo = mid
        } else {
            hi = mid
        }
    }
    // A window of whole tokens (up to rounding in the sum) keeps that many.
    if hi.ceil() - hi < 1e-9 {
        hi.ceil()
    } else {
        hi
    }
}

/// Probability that a cold cluster needed with probability `p` per token is
/// found in the LRU whose window is `k_tokens` ([`lru_window_tokens`]).
///
/// Decode asks for clusters layer by layer in the same order every token,
/// so a cluster needed again `j` tokens later has seen about `j` tokens'
/// worth of other clusters pass through the LRU since: it is still there iff
/// `j ≤ K`, which happens with probability `1 − (1 − p)^⌊K⌋`. A window under
/// one token (cold region smaller than one token's cold clusters, as when
/// the region is little more than the staging of two layers' reads) keeps
/// nothing from one token to the next, whatever `p`. Che's approximation
/// for independent requests (`1 − e^{−pT}`) instead gave hot-ish cold
/// clusters hits there and put the synthetic 7B's hit rate 0.03–0.07 too
/// high at the tight limits of `make bench-scale`; with a cold region of 69
/// or 140 MiB the measured hit rate was the same (0.672 / 0.671, sparsity 0.8).
pub fn lru_hit(p: f64, k_tokens: f64) -> f64 {
    if k_tokens.is_infinite() {
        return 1.0;
    }
    let whole = k_tokens.floor().min(1e9) as i32;
    1.0 - (1.0 - p.clamp(0.0, 1.0)).powi(whole)
}

/// A human-readable summary of `p` (printed by `prep convert` and `nflash run --stats`).
pub fn describe(p: &Plan, m: &Manifest) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let ffn_total: u64 = m.ffn.iter().flat_map(|f| f.clusters.iter().map(move |c| cluster_read_bytes(f, c))).sum();
    let hot_n: u64 = p.hot_neurons.iter().map(|&h| h as u64).sum();
    let all_n: u64 = m.ffn.iter().map(|f| f.n_neurons as u64).sum();
    let (lo, hi) = (p.hot_neurons.iter().min().copied().unwrap_or(0), p.hot_neurons.iter().max().copied().unwrap_or(0));
    format!(
        "plan for {} at {:.1} MiB (ctx {}, {} threads):\n  fixed region {:.1} MiB (resident {:.1} MiB, KV cache {:.1} MiB, scratch and runtime {:.1} MiB)\n  hot region   {:.1} MiB: {hot_n} of {all_n} neurons ({:.0}%), {lo}–{hi} per layer\n  cold region  {:.1} MiB (LRU of {:.0} KiB neuron clusters), {} I/O thread(s)\n  FFN on flash {:.1} MiB; expected {:.2} MiB read and {:.1} ms per decode token",
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
    )
}

/// Bytes of the hot region that pins `hot_neurons[l]` packed positions of
/// each layer `l` of `m` (whole clusters only).
pub fn hot_region_bytes(m: &Manifest, hot_neurons: &[u32]) -> u64 {
    m.ffn.iter().zip(hot_neurons).flat_map(|(f, &h)| f.clusters[..hot_clusters(f, h)].iter().map(move |c| cluster_read_bytes(f, c))).sum()
}

/// The cache layout a plan describes.
pub fn cache_config(p: &Plan) -> crate::cache::CacheConfig {
    crate::cache::CacheConfig {
        hot_neurons: p.hot_neurons.clone(),
        cold_bytes: p.cold_bytes,
        io_threads: p.io_threads as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_hides_all_but_a_share_of_the_shorter_side() {
        assert_eq!(overlap_exposed(5.0, 0.0), 0.0);
        assert_eq!(overlap_exposed(0.0, 4.0), 4.0);
        // Reads shorter than compute: OVERLAP_LOSS of them shows.
        assert!((overlap_exposed(10.0, 4.0) - OVERLAP_LOSS * 4.0).abs() < 1e-12);
        // Reads longer: they show beyond the compute, plus OVERLAP_LOSS of the compute.
        assert!((overlap_exposed(4.0, 10.0) - (6.0 + OVERLAP_LOSS * 4.0)).abs() < 1e-12);
    }

    #[test]
    fn lru_window_counts_whole_tokens() {
        // 1 000 clusters each needed half the time: one token's window holds
        // 500 of them, two tokens' 750.
        let p = vec![0.5; 1000];
        let k = lru_window_tokens(&p, 750.0);
        assert!((k - 2.0).abs() < 1e-9, "{k}");
        assert!((lru_hit(0.5, k) - 0.75).abs() < 1e-9, "{k} {}", lru_hit(0.5, k));
        // 1.5 tokens: 500 + half of the next token's new 250.
        assert!((lru_window_tokens(&p, 625.0) - 1.5).abs() < 1e-9);
        // Less than one token's clusters fit: nothing survives to the next
        // token, however often a cluster is needed.
        let k = lru_window_tokens(&p, 400.0);
        assert!(k < 1.0);
        assert_eq!(lru_hit(0.999, k), 0.0);
        // Everything fits; no slots at all.
        assert!(lru_window_tokens(&p, 1000.0).is_infinite());
        assert_eq!(lru_hit(0.01, f64::INFINITY), 1.0);
        assert_eq!(lru_window_tokens(&p, 0.0), 0.0);
        // Clusters never needed take no slot.
        let mut q = vec![0.0; 5000];
        q[..1000].fill(0.5);
        assert!((lru_window_tokens(&q, 750.0) - 2.0).abs() < 1e-9);
    }
}
