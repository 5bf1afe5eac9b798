//! The decoder-only transformer (Llama / Mistral / Qwen2, and the mixtures
//! of experts Mixtral / Qwen3-MoE) over a pack.
//!
//! Per layer: `x += Wo · attn(RoPE(Wq·norm(x)), RoPE(Wk·norm(x)), Wv·norm(x))`,
//! then `x += FFN(norm(x))` through the neuron engine, whose neuron clusters
//! come from a [`ClusterSource`]: the model knows nothing of flash or I/O.
//! In a mixture of experts the FFN is `Σ w_e · FFN_e(norm(x))` over the
//! experts the router picks, each expert an FFN unit of its own (SPEC §4.4).
//! Tensor names are the Hugging Face ones (formats/SPEC.md §4.3).
//!
//! - `tensors`: typed views of the pack's resident tensors, shapes checked;
//! - [`load`](Model::load): pack → model;
//! - `attention`: the attention block;
//! - [`moe`]: expert routing (router softmax, top-k);
//! - [`ffn`]: the FFN neuron engine (dense and sparse);
//! - [`predictor`]: activation predictors and sparsity counters;
//! - `forward`: the forward pass, as named steps;
//! - [`source`]: the [`ClusterSource`] trait;
//! - [`ops`], [`kv_cache`]: RMSNorm, RoPE, softmax, activations; the KV cache.

mod attention;
pub mod ffn;
mod forward;
pub mod kv_cache;
mod load;
pub mod moe;
pub mod ops;
pub mod predictor;
pub mod source;
mod tensors;

use std::sync::Mutex;

use nflash_format::{ModelConfig, Moe};

use crate::error::{Error, Result};
use crate::kernels::{DotInput, QMatrix};
use attention::Attention;
use ffn::{Ffn, FfnScratch};
use kv_cache::{KvCache, KvType};
use ops::Rope;
use predictor::{LayerCounts, LayerSparse, PredictScratch};
use source::Loc;

pub use source::{CacheStats, ClusterSource, LayerClusters, MemoryControl, Regions, SegmentClusters};

/// One FFN unit (SPEC §4.4): a dense layer's FFN, or one expert of a
/// mixture of experts, with its own neuron clusters and predictor.
struct Unit<'a> {
    /// Its index among the pack's FFN entries, as the [`ClusterSource`] numbers them.
    index: usize,
    ffn: Ffn,
    /// Sparse-decode settings; `None` for a dense pack.
    sparse: Option<LayerSparse<'a>>,
}

/// The router of a mixture-of-experts layer (HF `block_sparse_moe.gate`,
/// `mlp.gate`): exact, computed for every token, never predicted.
struct Router<'a> {
    /// `[num_experts, hidden]`, F32.
    weight: QMatrix<'a>,
    moe: Moe,
}

/// One decoder layer's weights.
struct Layer<'a> {
    /// RMSNorm weight before attention `[hidden]`.
    attn_norm: Vec<f32>,
    /// RMSNorm weight before the FFN `[hidden]`.
    ffn_norm: Vec<f32>,
    /// Gemma 3: RMSNorm weights `[hidden]` of the attention block's output
    /// and of the FFN's output, before each joins the residual.
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
    attn: Attention<'a>,
    /// The FFN: one unit, or one per expert (in expert order) with a router.
    units: Vec<Unit<'a>>,
    router: Option<Router<'a>>,
}

/// How a forward pass computes the FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Prompt processing: every neuron (PowerInfer-2 runs prefill dense).
    Prefill,
    /// Token generation: the pack's predictor and thresholds, unless dense is forced.
    Decode,
    /// Quality evaluation of sparse decode over a batch: dense matmuls with
    /// the neurons decode would skip dropped, and recall counted.
    Evaluate,
    /// Speculative verification: a few tokens (the last sampled one and a
    /// draft's guesses after it) in one pass, each with decode's arithmetic
    /// and bits (never the batched kernels) and its own predicted neurons.
    /// A layer's clusters that any of the tokens needs are read in one go:
    /// the first token's fetch, then the others' reads started at once
    /// ([`ClusterSource::fetch_ahead`]), so each cold cluster is read once
    /// per pass while the cold region holds them.
    Verify,
    /// Self-speculation's draft (`crate::draft::DraftKind::SelfDraft`): one
    /// token through the model as it stands in memory. Each FFN computes
    /// only the selected neurons whose clusters are resident (hot, or
    /// cold and already read: [`ClusterSource::fetch_resident`]); nothing
    /// is read from flash or prefetched, and the pass is left out of the
    /// decode counters. An approximation of decode, for guessing tokens.
    Draft,
}

impl Pass {
    /// Whether a pass of `n` tokens takes the batched kernels: prefill
    /// always, verify passes never, others from `MIN_BATCH` tokens on.
    pub(crate) fn batched(self, n: usize) -> bool {
        (n >= crate::kernels::gemm::MIN_BATCH && self != Pass::Verify) || self == Pass::Prefill
    }
}

/// Time spent per step of the forward pass, seconds, summed over calls:
/// the per-op profile of `nflash run --stats` (decode per token, prefill in
/// total). Wall time on the calling thread: a step's parallel region and its
/// fork/join cost are inside it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Timings {
    /// RMSNorms (before attention, before the FFN, and the final one) and the embedding lookup.
    pub norm_s: f64,
    /// Q, K, V projections, their biases and RoPE.
    pub qkv_s: f64,
    /// KV-cache append and scaled dot-product attention (QKᵀ, softmax, ·V).
    pub attend_s: f64,
    /// Output projection of attention, its bias and the residual add.
    pub o_proj_s: f64,
    /// Predictor evaluation (sparse decode).
    pub predictor_s: f64,
    /// Mixture-of-experts routing: router logits, softmax and top-k.
    pub router_s: f64,
    /// FFN neuron engine (gate/up/down projections, cluster fetch and wait).
    pub ffn_s: f64,
    /// Output projection to logits.
    pub lm_head_s: f64,
}

impl Timings {
    fn add(&mut self, o: &Timings) {
        self.norm_s += o.norm_s;
        self.qkv_s += o.qkv_s;
        self.attend_s += o.attend_s;
        self.o_proj_s += o.o_proj_s;
        self.predictor_s += o.predictor_s;
        self.router_s += o.router_s;
        self.ffn_s += o.ffn_s;
        self.lm_head_s += o.lm_head_s;
    }

    /// The attention block as a whole: norms, Q/K/V/O projections, RoPE, attention.
    pub fn attention_s(&self) -> f64 {
        self.norm_s + self.qkv_s + self.attend_s + self.o_proj_s
    }

    /// Every step, with its name (`norm`, `qkv`, `attend`, `o_proj`,
    /// `predictor`, `router`, `ffn`, `lm_head`), seconds.
    pub fn steps(&self) -> [(&'static str, f64); 8] {
        [
            ("norm", self.norm_s),
            ("qkv", self.qkv_s),
            ("attend", self.attend_s),
            ("o_proj", self.o_proj_s),
            ("predictor", self.predictor_s),
            ("router", self.router_s),
            ("ffn", self.ffn_s),
            ("lm_head", self.lm_head_s),
        ]
    }
}

/// Per-call scratch and counters, behind a lock so `forward` takes `&self`.
#[derive(Default)]
struct Work {
    ffn: FfnScratch,
    predict: PredictScratch,
    /// Decode: one token's selection per FFN unit it runs (`[1]` for a
    /// dense FFN, `[experts_per_token]` for a mixture of experts).
    picks: Vec<Pick>,
    /// The FFN input prepared for the bundle dtype.
    xin: Option<DotInput>,
    /// Per-layer sparse counters.
    counts: Vec<LayerCounts>,
    /// Speculative prefetch buffers.
    spec: SpecScratch,
    /// Layer-ahead expert prediction counters (decode).
    expert_prefetch: ExpertPrefetch,
    /// `[n_layers]` the last decode step's (I/O wait, predictor) wall time
    /// of each layer's FFN (a mixture of experts: summed over the experts it
    /// ran), seconds: whether a speculative prefetch pays.
    layer_wait: Vec<(f64, f64)>,
    /// Mixture of experts: `[n, experts_per_token]` each token's experts and
    /// their routing weights, from [`Router::route`].
    routes: Vec<(u32, f32)>,
    /// `[n_experts]` router logits, then probabilities, of one token.
    router_probs: Vec<f32>,
    /// `[m, hidden]` one expert's tokens' inputs (batched), and `[m, hidden]` (or `[hidden]`) its output.
    expert_x: Vec<f32>,
    expert_y: Vec<f32>,
    /// Clusters the current layer call needs, ascending.
    needed: Vec<u32>,
    /// `[n_clusters]` where each needed cluster is.
    table: Vec<Loc>,
    /// Decode and evaluation steps.
    timings: Timings,
    /// Prefill passes.
    prefill_timings: Timings,
}

/// One token's selection in one FFN unit (decode): what its predictor
/// chose and the clusters holding it.
#[derive(Default)]
struct Pick {
    /// Packed positions selected by the predictor `[≤ n_neurons]`, when `listed`.
    list: Vec<u32>,
    /// Clusters to fetch, ascending: those holding `list`, or all.
    needed: Vec<u32>,
    /// Whether `list` holds a selection (else every neuron runs).
    listed: bool,
    /// Seconds the selection took (predictor time).
    pred_s: f64,
}

impl Pick {
    /// The neurons to compute, as the FFN takes them, and how many of the
    /// unit's `n_neurons` that is.
    fn selection(&self, n_neurons: u64) -> (ffn::Selection<'_>, u64) {
        if self.listed {
            (ffn::Selection::List(&self.list), self.list.len() as u64)
        } else {
            (ffn::Selection::All, n_neurons)
        }
    }
}

/// When decode runs a speculative prefetch ([`Model::set_speculation`];
/// `nflash run --speculate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Speculation {
    /// For a dense layer whose expected hidden wait outweighs the
    /// prefetch's predictor time: its last FFN call's wait for reads, times
    /// the share of speculative reads used so far, against that call's
    /// predictor time (the default). A mixture of experts' layers are only
    /// guessed (the expert prediction's precision and recall), not read
    /// ahead: their guessed experts' predictors and wasted reads cost more
    /// than they hid (docs/benchmarks.md).
    #[default]
    Auto,
    /// Before every sparse layer that has cold neurons.
    Always,
    /// Never.
    Never,
}

impl Speculation {
    /// Every value, with its command-line name.
    pub const ALL: [(Speculation, &'static str); 3] =
        [(Speculation::Auto, "auto"), (Speculation::Always, "always"), (Speculation::Never, "never")];
}

impl std::str::FromStr for Speculation {
    type Err = Error;

    /// `auto`, `always` or `never`.
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .iter()
            .find(|(_, name)| *name == s)
            .map(|(v, _)| *v)
            .ok_or_else(|| Error::Usage(format!("unknown speculation {s:?}: expected auto, always or never")))
    }
}

/// Buffers of a speculative prefetch (`Model::speculate`).
#[derive(Default)]
struct SpecScratch {
    /// `[hidden]` the layer's FFN norm of the residual it speculates on.
    x: Vec<f32>,
    /// `x` prepared for the predictor.
    xin: Option<DotInput>,
    predict: PredictScratch,
    /// Packed positions selected `[≤ n_neurons]`.
    list: Vec<u32>,
    /// Their clusters, ascending.
    needed: Vec<u32>,
    /// `[n_experts]` router probabilities of the layer-ahead expert prediction.
    probs: Vec<f32>,
    /// The experts guessed for layer `guess_layer` (ascending, with weights).
    guess: Vec<(u32, f32)>,
    /// The layer `guess` is for; `usize::MAX` when none is pending.
    guess_layer: usize,
}

/// How well decode's layer-ahead expert prediction (speculative prefetch of
/// a mixture of experts' next layer, from that layer's router applied to
/// the hidden state before its attention) guessed the router's choice.
/// Counts are (token, layer, expert) routings.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ExpertPrefetch {
    /// Experts guessed (and their cold clusters read ahead).
    pub guessed: u64,
    /// Experts the router then chose, in layers that were guessed for.
    pub routed: u64,
    /// Guessed experts the router chose.
    pub hit: u64,
}

impl ExpertPrefetch {
    /// Fraction of guessed experts the router chose (1 when nothing was guessed).
    pub fn precision(&self) -> f64 {
        if self.guessed == 0 {
            1.0
        } else {
            self.hit as f64 / self.guessed as f64
        }
    }

    /// Fraction of chosen experts that were guessed (1 when nothing was guessed).
    pub fn recall(&self) -> f64 {
        if self.routed == 0 {
            1.0
        } else {
            self.hit as f64 / self.routed as f64
        }
    }
}

/// A model whose weights are views into an open pack, and whose FFN neuron
/// clusters come from a [`ClusterSource`].
pub struct Model<'a> {
    /// Hyper-parameters from the manifest.
    pub cfg: ModelConfig,
    /// `[vocab, hidden]`.
    embed: QMatrix<'a>,
    /// `[vocab, hidden]`; the embedding when tied.
    lm_head: QMatrix<'a>,
    /// `[hidden]`.
    final_norm: Vec<f32>,
    layers: Vec<Layer<'a>>,
    rope: Rope,
    /// Gemma 3's RoPE of its sliding-window layers ([`ModelConfig::local_rope`]).
    rope_local: Option<Rope>,
    /// Use the pack's predictors in [`Pass::Decode`] / [`Pass::Evaluate`].
    sparse_enabled: bool,
    /// Element type of the KV caches [`Self::new_kv_cache`] makes.
    kv_type: KvType,
    /// When decode reads the next layer's likely clusters ahead of its attention.
    speculation: Speculation,
    /// Tests: the layer-ahead expert prediction picks the experts the router
    /// ranks lowest, so speculative reads are wrong on purpose.
    misguide_prefetch: bool,
    /// Where the FFN's neuron clusters come from.
    source: Box<dyn ClusterSource + 'a>,
    work: Mutex<Work>,
}

impl Model<'_> {
    /// Whether the pack has sparse-decode settings.
    pub fn is_sparse_pack(&self) -> bool {
        self.layers.iter().flat_map(|l| &l.units).any(|u| u.sparse.is_some())
    }

    /// Forces dense FFN evaluation everywhere (`--dense`) or restores the pack's sparsity.
    pub fn set_dense(&mut self, dense: bool) {
        self.sparse_enabled = !dense && self.is_sparse_pack();
    }

    /// The KV cache element type of later [`Self::new_kv_cache`] calls
    /// (default f16; `nflash run --kv`).
    pub fn set_kv_type(&mut self, kv: KvType) {
        self.kv_type = kv;
    }

    /// The KV cache element type [`Self::new_kv_cache`] uses.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// When sparse decode runs a speculative prefetch of the next layer's
    /// cold clusters (default [`Speculation::Auto`]; `nflash run --speculate`).
    pub fn set_speculation(&mut self, s: Speculation) {
        self.speculation = s;
    }

    /// Makes decode's layer-ahead expert prediction guess the experts the
    /// router ranks lowest (tests: a wrong guess costs reads, never tokens).
    #[doc(hidden)]
    pub fn misguide_expert_prefetch(&mut self, on: bool) {
        self.misguide_prefetch = on;
    }

    /// Layer-ahead expert prediction counters of decode since load or the
    /// last [`Self::reset_counters`] (all 0 for a dense model).
    pub fn expert_prefetch(&self) -> ExpertPrefetch {
        self.work.lock().unwrap_or_else(|e| e.into_inner()).expert_prefetch
    }

    /// Per-layer sparse-FFN counters and the decode (and evaluation) step
    /// timings since load or the last [`Self::reset_counters`].
    pub fn counters(&self) -> (Vec<LayerCounts>, Timings) {
        let w = self.work.lock().unwrap_or_else(|e| e.into_inner());
        (w.counts.clone(), w.timings)
    }

    /// Step timings of the prefill passes since load or the last [`Self::reset_counters`].
    pub fn prefill_timings(&self) -> Timings {
        self.work.lock().unwrap_or_else(|e| e.into_inner()).prefill_timings
    }

    /// Neuron-cluster counters of the source (cumulative since load).
    pub fn cache_stats(&self) -> CacheStats {
        self.source.stats()
    }

    /// The source's hot and cold regions, bytes, and whether reads bypass the page cache.
    pub fn cache_regions(&self) -> Regions {
        self.source.regions()
    }

    /// A handle that resizes the neuron cache's memory from any thread
    /// while this model generates ([`MemoryControl`]); `None` when the
    /// source's memory cannot move.
    pub fn memory_control(&self) -> Option<std::sync::Arc<dyn MemoryControl>> {
        self.source.memory_control()
    }

    /// Zeroes the counters and timings.
    pub fn reset_counters(&self) {
        let mut w = self.work.lock().unwrap_or_else(|e| e.into_inner());
        w.counts.iter_mut().for_each(|c| *c = LayerCounts::default());
        w.timings = Timings::default();
        w.prefill_timings = Timings::default();
        w.expert_prefetch = ExpertPrefetch::default();
    }

    /// A KV cache for `capacity` tokens (of [`Self::kv_type`] elements;
    /// sliding-window layers hold a ring of their window plus one pass), or
    /// an error if its memory cannot be reserved.
    ///
    /// # Errors
    /// [`Error::KvCache`] naming the size and `--ctx`.
    pub fn try_new_kv_cache(&self, capacity: usize) -> Result<KvCache> {
        let bytes = nflash_plan::layout::kv_cache_bytes_of(&self.cfg, capacity, self.kv_type);
        // Reserve once to see whether the system grants it (pages are only touched as tokens fill).
        let ok = usize::try_from(bytes).is_ok_and(|b| Vec::<u8>::new().try_reserve_exact(b).is_ok());
        if !ok {
            return Err(Error::KvCache { ctx: capacity, mib: bytes as f64 / (1u64 << 20) as f64 });
        }
        Ok(self.new_kv_cache(capacity))
    }

    /// A KV cache for `capacity` tokens (aborts if the memory cannot be
    /// reserved; see [`Self::try_new_kv_cache`]).
    pub fn new_kv_cache(&self, capacity: usize) -> KvCache {
        let kvd = (self.cfg.num_kv_heads * self.cfg.head_dim) as usize;
        let layers: Vec<(Option<usize>, usize)> = (0..self.layers.len())
            .map(|l| {
                let rows = nflash_plan::layout::kv_layer_capacity(&self.cfg, l, capacity);
                (self.cfg.layer_window(l).map(|w| w as usize), rows)
            })
            .collect();
        KvCache::with_layers(&layers, kvd, capacity, self.kv_type)
    }
}
