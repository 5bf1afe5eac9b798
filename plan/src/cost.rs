//! The decode cost model (PowerInfer-2 §4.4): how likely decode needs each
//! neuron and neuron cluster, what the flash reads of the misses cost, and
//! the expected time per decode token of a plan ([`estimate`]), which
//! [`crate::planner::plan`] stores in the pack and `nflash plan-sim` prints.

use nflash_format::{DeviceProfile, Manifest, Plan, PredictorKind};

use crate::layout::{hot_clusters, kv_cache_bytes, KvType, MAX_MERGE_BYTES};

/// Probability that decode needs each neuron of FFN unit `l` (packed order)
/// when the unit runs: the profiled activation frequency scaled by the
/// predictor's recall / precision (1 for a dense pack or the exact
/// predictor, which read every bundle). For an expert this is P(neuron
/// needed | expert chosen); times its share of the tokens
/// ([`unit_share_of`]) it is the probability per token.
pub(crate) fn need_probability(m: &Manifest, l: usize) -> Vec<f64> {
    neuron_need_probability(m.sparse.as_ref(), m.ffn[l].sparse.as_ref(), m.ffn[l].n_neurons as usize)
}

/// FFN unit `l`'s share of the tokens (1 when `share` has no entry).
pub(crate) fn unit_share_of(share: &[f64], l: usize) -> f64 {
    share.get(l).copied().unwrap_or(1.0)
}

/// The probability that decode runs each FFN unit for a token when the pack
/// records no routing statistics (`[units]`): 1 for a dense model,
/// `experts_per_token / num_experts` for every expert of a mixture.
/// `Pack::unit_share` gives the measured shares where the pack has them.
pub fn uniform_unit_share(m: &Manifest) -> Vec<f64> {
    let s = m.config.architecture.moe().map_or(1.0, |e| e.experts_per_token as f64 / e.num_experts as f64);
    vec![s; m.ffn.len()]
}

/// Probability that decode needs each of a layer's `n` neurons (packed
/// order), from the pack-wide `info` and the layer's `sp` sparsity settings
/// (SPEC §4.5): `recall·f + fpr·(1 − f)` for the profiled frequency `f`,
/// with the predictor's false-positive rate from its recall and precision;
/// all 1 for a dense layer or the exact predictor.
pub fn neuron_need_probability(
    info: Option<&nflash_format::SparseInfo>,
    sp: Option<&nflash_format::LayerSparsity>,
    n: usize,
) -> Vec<f64> {
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
pub(crate) struct Cl {
    /// Bytes read (aligned).
    pub(crate) bytes: u64,
    /// Probability that a decode token needs it.
    pub(crate) p: f64,
}

/// Expected decode I/O seconds per token for clusters `cs` (all cold):
/// each is read with probability `p`; adjacent needed clusters merge, so a
/// read is about `bytes / (1 − p)` long (capped at the merge limit).
pub(crate) fn io_seconds(dev: &DeviceProfile, cs: &[Cl]) -> f64 {
    cs.iter().map(|c| io_term(dev, c)).sum()
}

/// One cluster's share of [`io_seconds`].
pub(crate) fn io_term(dev: &DeviceProfile, c: &Cl) -> f64 {
    let run = (c.bytes as f64 / (1.0 - c.p).max(1e-3)).min(MAX_MERGE_BYTES as f64);
    c.p * c.bytes as f64 / dev.random_read_bytes_per_s(run as u64)
}

/// Every FFN unit's clusters with their read size and need probability per
/// token: the unit's share of the tokens (`share`: 1 for a dense layer, an
/// expert's routed share) times the probability that the unit, when it
/// runs, needs a neuron of the cluster. (Not the product of per-neuron
/// probabilities scaled by the share: the neurons of an expert are needed
/// together, only when the router picks it.)
pub(crate) fn cluster_needs(m: &Manifest, share: &[f64]) -> Vec<Vec<Cl>> {
    (0..m.ffn.len())
        .map(|l| {
            let f = &m.ffn[l];
            let p = need_probability(m, l);
            let s = unit_share_of(share, l);
            f.clusters
                .iter()
                .map(|c| Cl {
                    bytes: crate::layout::cluster_read_bytes(f, c),
                    p: s * cluster_need(&p[c.first as usize..(c.first + c.n_neurons) as usize]),
                })
                .collect()
        })
        .collect()
}

/// KV cache bytes layer `l`'s attention reads for a decode token at
/// `position`: the keys and values of the positions it attends to (itself
/// and those before it, at most its sliding window), as the KV cache
/// stores them. The estimate takes the token at half the context, the
/// mean over a generation that fills it.
fn kv_read_bytes(m: &Manifest, l: usize, position: u32, kv: KvType) -> u64 {
    let c = &m.config;
    let seen = c.layer_window(l).map_or(position as u64 + 1, |w| (position as u64 + 1).min(w));
    kv_cache_bytes(1, (c.num_kv_heads * c.head_dim) as usize, seen as usize, kv)
}

/// Bytes of decoder layer `l`'s attention weights, and of a mixture of
/// experts its router (read once per decode token).
pub(crate) fn attention_bytes(m: &Manifest, l: usize) -> u64 {
    let prefix = format!("model.layers.{l}.self_attn.");
    let router = m.config.router_name(l);
    m.tensors
        .iter()
        .filter(|t| t.name.starts_with(&prefix) || router.as_deref() == Some(t.name.as_str()))
        .map(|t| t.bytes)
        .sum()
}

/// Each FFN unit's share of its decoder layer's attention time: 1 for a
/// dense layer; for an expert its share of the tokens over the sum of its
/// layer's shares, so a layer's experts together get its attention once.
pub(crate) fn attention_split(m: &Manifest, share: &[f64]) -> Vec<f64> {
    let e = m.config.experts() as usize;
    (0..m.ffn.len())
        .map(|u| {
            let layer = &share[u / e * e..(u / e + 1) * e];
            let sum: f64 = layer.iter().sum();
            if e == 1 {
                1.0
            } else if sum > 0.0 {
                share[u] / sum
            } else {
                1.0 / e as f64
            }
        })
        .collect()
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
    /// Expected flash bytes read per token; at most the cold FFN bytes
    /// (speculation's extra reads are cold clusters too).
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

/// The expected decode cost of plan `p` for `m` on `dev` (see [`Estimate`]);
/// `share`: each FFN unit's share of the tokens (`Pack::unit_share`, or
/// [`uniform_unit_share`]).
pub fn estimate(m: &Manifest, share: &[f64], dev: &DeviceProfile, p: &Plan) -> Estimate {
    let hot: Vec<usize> = m.ffn.iter().zip(&p.hot_neurons).map(|(f, &h)| hot_clusters(f, h)).collect();
    let needs = cluster_needs(m, share);
    estimate_with(m, share, dev, p.threads, (p.ctx, KvType::of_plan(m, p)), &needs, &hot, p.cold_bytes)
}

/// Speculative decoding as the cost model sees it (issue 47): each decode
/// pass verifies `draft_tokens` drafted tokens beside its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verify {
    /// Tokens drafted per pass, K: at most `nflash run --draft-tokens`, on
    /// average `draft_tokens / verify_passes` of its `--stats-json` (a
    /// prompt lookup drafts only where it finds a match).
    pub draft_tokens: f64,
    /// Share of the drafted tokens accepted, α (`acceptance_rate` of
    /// `nflash run --stats-json`).
    pub acceptance: f64,
    /// What each token of a pass beyond the first adds to the pass's
    /// compute, as a share of a decode token's (weights are read once per
    /// pass either way; the lm_head runs only up to the first rejected
    /// token). [`VERIFY_TOKEN_COST`] on the dev host; near 1 where
    /// compute bounds decode and the kernels' cost per token does not fall
    /// with more tokens, lower where memory bandwidth bounds it.
    pub token_cost: f64,
    /// Clusters a pass reads per cluster its tokens need in all, as
    /// measured on a pack (`verify_cluster_union_per_pass` /
    /// `verify_clusters_needed_per_pass` of `nflash run --stats-json`);
    /// `None`: tokens need clusters independently.
    pub union_share: Option<f64>,
}

/// [`Verify::token_cost`] fitted to the dev host's `make bench-speculate`
/// (bench/runs/2026-12-06-speculate): a pass of `1 + K` tokens cost
/// `1 + 0.5·K` decode tokens (SmolLM2 in memory, prompt lookup on the
/// summary prompt: 2.44 tokens per pass of 4.4 at 0.93x plain decode; the
/// synthetic 7B at bench-scale's (b): 2.31 of 2.5 at 1.40x).
pub const VERIFY_TOKEN_COST: f64 = 0.5;

impl Verify {
    /// Tokens a pass gives on average: its own and the accepted drafted
    /// ones, `1 + α·K` (with speculation on every pass, `decode_tokens /
    /// decode_passes` of `nflash run --stats-json`).
    pub fn tokens_per_pass(&self) -> f64 {
        1.0 + self.acceptance.clamp(0.0, 1.0) * self.draft_tokens.max(0.0)
    }
}

/// The expected cost of one verify pass of `v.draft_tokens + 1` tokens
/// with plan `p` (as [`estimate`] for one decode token; divide
/// [`Verify::tokens_per_pass`] by its [`Estimate::token_ms`] for tokens/s):
/// attention, predictor and lm_head weights read once and their compute
/// `1 + token_cost · K` times a token's; the KV cache read per token; the
/// FFN the larger of the union of the tokens' bundles at the sparse FFN
/// speed and `1 + token_cost · K` times a token's; each cold cluster needed
/// by any of the pass's tokens read once, with the cold LRU's window
/// counted in passes. A cluster a token needs with probability `p` is
/// needed by the pass with `1 − (1 − p)^(K+1)` (tokens independent: real
/// text's tokens share more neurons, so this is an upper bound), or with
/// `union_share · (K+1) · p` (at least `p`, at most 1) where measured.
/// `read_bytes_per_token` of the result is per pass.
pub fn estimate_verify(m: &Manifest, share: &[f64], dev: &DeviceProfile, p: &Plan, v: &Verify) -> Estimate {
    let hot: Vec<usize> = m.ffn.iter().zip(&p.hot_neurons).map(|(f, &h)| hot_clusters(f, h)).collect();
    let n = v.draft_tokens.max(0.0) + 1.0;
    let needs: Vec<Vec<Cl>> = cluster_needs(m, share)
        .into_iter()
        .map(|cs| {
            let any = |p: f64| match v.union_share {
                Some(u) => (u * n * p).clamp(p, 1.0),
                None => 1.0 - (1.0 - p).powf(n),
            };
            cs.into_iter().map(|c| Cl { p: any(c.p), ..c }).collect()
        })
        .collect();
    let pass = Pass { tokens: n, token_cost: v.token_cost };
    estimate_pass(m, share, dev, p.threads, (p.ctx, KvType::of_plan(m, p)), &needs, &hot, p.cold_bytes, pass)
}

/// The tokens of a forward pass the cost model prices ([`estimate_pass`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pass {
    /// Tokens in the pass, on average (1: decode).
    pub(crate) tokens: f64,
    /// [`Verify::token_cost`].
    pub(crate) token_cost: f64,
}

/// [`estimate`] from the planner's per-layer clusters and hot cluster counts,
/// for a KV cache of `kv` elements at `ctx` tokens.
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn estimate_with(
    m: &Manifest,
    share: &[f64],
    dev: &DeviceProfile,
    threads: u32,
    ctx_kv: (u32, KvType),
    layers: &[Vec<Cl>],
    hot: &[usize],
    cold_bytes: u64,
) -> Estimate {
    let decode = Pass { tokens: 1.0, token_cost: 0.0 };
    estimate_pass(m, share, dev, threads, ctx_kv, layers, hot, cold_bytes, decode)
}

/// [`estimate_with`] for a forward pass of `pass.tokens` tokens whose
/// clusters' need probabilities in `layers` are the pass's (any token's);
/// see [`estimate_verify`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn estimate_pass(
    m: &Manifest,
    share: &[f64],
    dev: &DeviceProfile,
    threads: u32,
    (ctx, kv): (u32, KvType),
    layers: &[Vec<Cl>],
    hot: &[usize],
    cold_bytes: u64,
    pass: Pass,
) -> Estimate {
    let n = pass.tokens.max(1.0);
    // A token's compute, `ms`, for the whole pass (its weights read once).
    let more = |ms: f64| ms * (1.0 + pass.token_cost * (n - 1.0));
    let matvec = dev.matvec_bytes_per_s(threads);
    let attention = dev.attention_bytes_per_s(threads);
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
        // A decoder layer's attention once, at its first FFN unit; an expert's
        // predictor only when the router picks it.
        let first = l == 0 || m.ffn[l - 1].layer != f.layer;
        let attn_ms = if first {
            let kv_ms = kv_read_bytes(m, f.layer as usize, ctx / 2, kv) as f64 / matvec * 1e3;
            more(attention_bytes(m, f.layer as usize) as f64 / attention * 1e3) + n * kv_ms
        } else {
            0.0
        };
        e.attention_ms += attn_ms;
        let run = unit_share_of(share, l);
        let pred_ms = more(f.sparse.as_ref().map_or(0, |s| s.predictor_bytes) as f64 * run / predictor * 1e3);
        e.predictor_ms += pred_ms;
        let bundle_ms = f.bundle.bundle_bytes as f64 / ffn_speed * 1e3;
        let ffn_ms = if n == 1.0 {
            run * q.iter().sum::<f64>() * bundle_ms
        } else {
            // The bundles any token needs, each read once; or each token's compute.
            let union: f64 = q.iter().map(|q| 1.0 - (1.0 - run * q).powf(n)).sum();
            (union * bundle_ms).max(more(run * q.iter().sum::<f64>() * bundle_ms))
        };
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
        // Speculative prefetch (`nflash run --speculate auto`): when a dense
        // layer would wait longer than a predictor evaluation, one more
        // (over the cold neurons' rows) starts the reads before the
        // attention; never for a mixture of experts' layers.
        let spec = f.sparse.is_some() && exposed > pred_ms && m.config.experts() <= 1;
        // Speculation reads clusters that turn out unneeded, but only cold
        // ones: never more than the layer's cold bytes in all.
        let cold_layer: f64 = cs[hot[l]..].iter().map(|c| c.bytes as f64).sum();
        let extra = if spec && bytes > 0.0 { (1.0 + SPECULATION_WASTE).min(cold_layer / bytes).max(1.0) } else { 1.0 };
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
    let head: u64 = m
        .tensors
        .iter()
        .filter(|t| {
            t.name == "lm_head.weight" || (m.config.tie_word_embeddings && t.name == "model.embed_tokens.weight")
        })
        .map(|t| t.bytes)
        .sum();
    e.lm_head_ms = more(head as f64 / matvec * 1e3);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An expert picked for a quarter of the tokens needs its cluster of 256
    /// neurons a quarter of the time, however many of them it needs when
    /// picked (not 1 − Π(1 − ¼·qᵢ), which is nearly 1).
    #[test]
    fn an_experts_clusters_are_needed_only_when_it_is_routed_to() {
        let dev = nflash_format::DeviceProfile::parse(include_str!("../../profiles/dev-host.toml")).unwrap();
        let shape = crate::sim::Shape {
            name: "t",
            hidden: 64,
            inter: 256,
            layers: 1,
            heads: 4,
            kv_heads: 2,
            vocab: 64,
            experts: 4,
            active_experts: 1,
            head_dim: 16,
            tied: false,
            arch: nflash_format::Architecture::Mistral,
            window: None,
        };
        let o = crate::sim::SimOptions {
            sparsity: 0.9,
            skew: 0.0,
            quant: nflash_format::DType::Q8_0,
            recall: 1.0,
            precision: 1.0,
            predictor_budget: 0.1,
            router_skew: 0.0,
        };
        let (mut m, share) = crate::sim::synthetic_manifest(&shape, &o, &dev).unwrap();
        // One cluster per expert.
        for f in &mut m.ffn {
            f.clusters = vec![nflash_format::NeuronCluster { offset: 0, first: 0, n_neurons: 256 }];
        }
        assert_eq!(share, vec![0.25; 4]);
        let needs = cluster_needs(&m, &share);
        for cs in &needs {
            assert_eq!(cs.len(), 1);
            assert!((cs[0].p - 0.25).abs() < 1e-6, "{}", cs[0].p);
        }
        // The FFN's compute counts the routed expert's neurons only.
        let est = estimate_with(&m, &share, &dev, 2, (64, KvType::F16), &needs, &[1, 1, 1, 1], 0);
        let all =
            estimate_with(&m, &[1.0; 4], &dev, 2, (64, KvType::F16), &cluster_needs(&m, &[1.0; 4]), &[1, 1, 1, 1], 0);
        assert!((est.ffn_ms * 4.0 - all.ffn_ms).abs() < 1e-9 * all.ffn_ms.max(1.0), "{} {}", est.ffn_ms, all.ffn_ms);
    }

    /// A verify pass of one token is decode; with every draft rejected a
    /// pass gives one token at more cost; reads of clusters shared by the
    /// pass's tokens are paid once, so where flash bounds decode a pass
    /// of accepted tokens is cheaper per token.
    #[test]
    fn a_verify_pass_pays_shared_reads_once_and_compute_per_token() {
        let dev = nflash_format::DeviceProfile::parse(include_str!("../../profiles/dev-host.toml")).unwrap();
        let o = crate::sim::SimOptions {
            sparsity: 0.9,
            skew: 1.5,
            quant: nflash_format::DType::Q4_0,
            recall: 0.99,
            precision: 1.0,
            predictor_budget: 0.1,
            router_skew: 0.0,
        };
        let (m, share) = crate::sim::synthetic_manifest(&crate::sim::shape("llama-7b").unwrap(), &o, &dev).unwrap();
        let req = |budget_bytes| crate::planner::PlanRequest {
            budget_bytes,
            ctx: 128,
            kv: KvType::F16,
            threads: 2,
            io_threads: None,
            measured: None,
            unit_share: Some(share.clone()),
            draft_bytes: 0,
        };
        let fixed = crate::planner::fixed_region(&m, 128, KvType::F16, None).total();
        let ffn: u64 =
            m.ffn.iter().flat_map(|f| f.clusters.iter().map(move |c| crate::layout::cluster_read_bytes(f, c))).sum();
        let v = |k: f64, a, union_share| Verify { draft_tokens: k, acceptance: a, token_cost: 1.0, union_share };
        let in_memory = crate::planner::plan(&m, &dev, &req(fixed + ffn + (64 << 20))).unwrap();
        let offloaded = crate::planner::plan(&m, &dev, &req(fixed + ffn / 4)).unwrap();
        for p in [&in_memory, &offloaded] {
            let one = estimate(&m, &share, &dev, p);
            let same = estimate_verify(&m, &share, &dev, p, &v(0.0, 0.5, None));
            assert!((same.token_ms() - one.token_ms()).abs() < 1e-9 * one.token_ms(), "{same:?} {one:?}");
        }
        // In memory, compute bound: a pass of 4 gives fewer than 4 tokens
        // for 4 tokens' compute; with no compute per extra token it pays.
        let one = estimate(&m, &share, &dev, &in_memory);
        let pass = estimate_verify(&m, &share, &dev, &in_memory, &v(3.0, 0.8, None));
        let t = v(3.0, 0.8, None).tokens_per_pass();
        assert!(pass.token_ms() / t > one.token_ms(), "{} against {}", pass.token_ms() / t, one.token_ms());
        let free = Verify { token_cost: 0.0, ..v(3.0, 0.8, None) };
        assert!(estimate_verify(&m, &share, &dev, &in_memory, &free).token_ms() / t < one.token_ms());
        // Offloaded: tokens that share their clusters (a third of what
        // they need in all is distinct) read less per token, and a pass
        // per token costs less than decode.
        let one = estimate(&m, &share, &dev, &offloaded);
        let shared = estimate_verify(&m, &share, &dev, &offloaded, &v(3.0, 0.8, Some(0.33)));
        let apart = estimate_verify(&m, &share, &dev, &offloaded, &v(3.0, 0.8, None));
        assert!(shared.read_bytes_per_token < apart.read_bytes_per_token);
        assert!(shared.read_bytes_per_token / t < one.read_bytes_per_token, "{shared:?} {one:?}");
        assert!(shared.token_ms() / t < one.token_ms(), "{} against {}", shared.token_ms() / t, one.token_ms());
        assert_eq!(v(4.0, 0.0, None).tokens_per_pass(), 1.0);
        assert_eq!(v(4.0, 1.0, None).tokens_per_pass(), 5.0);
        assert!((v(3.4, 0.424, None).tokens_per_pass() - 2.4416).abs() < 1e-12);
    }

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
