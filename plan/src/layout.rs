//! Sizes shared by the planner and the runtime: how neuron clusters are read
//! (direct-I/O alignment, merged reads), what the hot set holds, the KV
//! cache and the prefill scratch, and the cache layout a plan describes. One
//! definition each, so the plan's memory model and what `nflash run`
//! allocates cannot drift apart.

use nflash_format::{FfnLayer, Manifest, NeuronCluster, Pack, Plan};

/// Granularity of cluster reads, bytes: the cluster alignment `prep`
/// writes (formats/SPEC.md §4.4, `cluster_align`), so a cluster's read
/// never overlaps the next cluster. A file format constant, not the page
/// size: buffers are aligned to the running system's page size and the
/// file system's direct-I/O alignment is checked against it at run time
/// (nflash-runtime's `offload::align`).
pub const READ_ALIGN: usize = 4096;

/// Rounds `n` bytes up to a multiple of [`READ_ALIGN`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(READ_ALIGN as u64) * READ_ALIGN as u64
}

/// Granularity of `f`'s cluster reads, bytes: its cluster alignment, at
/// least [`READ_ALIGN`].
pub fn read_align(f: &FfnLayer) -> u64 {
    f.cluster_align.max(READ_ALIGN as u64)
}

/// Largest merged read, bytes (PowerInfer-2 reads clusters, not neurons;
/// beyond ~512 KiB flash bandwidth no longer grows: `nflash probe`'s read
/// table, profiles/dev-host.toml).
pub const MAX_MERGE_BYTES: u64 = 512 << 10;

/// Bytes of per-token prefill activations one forward pass may hold:
/// [`prefill_chunk`] takes as many tokens as fit.
pub const PREFILL_ACTIVATION_BYTES: u64 = 8 << 20;

/// Fewest and most tokens per prefill forward pass.
pub const PREFILL_CHUNK_RANGE: (usize, usize) = (64, 512);

/// Bytes of one token's activations in a prefill pass of a model `c`:
/// `6·hidden + 2·(heads·head_dim) + 2·(kv_heads·head_dim)` f32 (the
/// residual, normed input, attention output, FFN output and accumulators;
/// Q and the attention result; K and V), HF config `hidden_size`,
/// `num_attention_heads`, `num_key_value_heads`, `head_dim`.
pub fn prefill_activation_bytes(c: &nflash_format::ModelConfig) -> u64 {
    (6 * c.hidden_size + 2 * c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim) * 4
}

/// Tokens per prefill forward pass of a model `c` (bounds prefill scratch
/// memory): the largest power of two in [`PREFILL_CHUNK_RANGE`] whose
/// activations ([`prefill_activation_bytes`] per token) fit
/// [`PREFILL_ACTIVATION_BYTES`].
/// Longer passes amortize each layer's per-pass costs (thread wake-ups,
/// weights streamed from memory once per pass): SmolLM2-135M prefills 256
/// tokens per pass, a 7B model 64.
pub fn prefill_chunk(c: &nflash_format::ModelConfig) -> usize {
    let fit = (PREFILL_ACTIVATION_BYTES / prefill_activation_bytes(c).max(1)) as usize;
    let (lo, hi) = PREFILL_CHUNK_RANGE;
    if fit < lo {
        return lo;
    }
    (1usize << fit.ilog2()).clamp(lo, hi)
}

/// Elements of one dequantized FFN weight tile (per gate / up / down
/// matrix, f32) in batched passes: bounds prefill scratch, so the planner's
/// fixed region holds whatever the FFN's placement (results do not depend
/// on the memory budget).
pub const FFN_TILE_ELEMS: usize = 1 << 18;

/// Bytes the runtime allocates at load per FFN neuron, after it measured
/// its footprint: each neuron's bundle offset and cluster index
/// (`runtime/src/model/ffn.rs`, `Ffn::new`) and its predictor bias
/// (`runtime/src/model/predictor.rs`), 4 bytes each.
pub const INDEX_BYTES_PER_NEURON: u64 = 12;

/// Bytes the runtime allocates at load per neuron cluster, after it
/// measured its footprint: the FFN's cluster table (16), the neuron cache's
/// span (16), CRC-32C (4), cold slot (4) and prefetch flag (1)
/// (`runtime/src/offload/cache.rs`), rounded up. One-neuron clusters make
/// these tens of MiB (a Mixtral expert has 14336): they are part of the
/// plan's scratch ([`index_bytes`]).
pub const INDEX_BYTES_PER_CLUSTER: u64 = 48;

/// Bytes of the runtime's per-neuron and per-cluster tables for manifest
/// `m` ([`INDEX_BYTES_PER_NEURON`], [`INDEX_BYTES_PER_CLUSTER`]).
pub fn index_bytes(m: &nflash_format::Manifest) -> u64 {
    m.ffn
        .iter()
        .map(|f| f.n_neurons as u64 * INDEX_BYTES_PER_NEURON + f.clusters.len() as u64 * INDEX_BYTES_PER_CLUSTER)
        .sum()
}

/// Bytes read for cluster `c` of layer `f`: its bundles rounded up to
/// [`read_align`] (the cluster's size in the hot or cold region).
pub fn cluster_read_bytes(f: &FfnLayer, c: &NeuronCluster) -> u64 {
    (c.n_neurons as u64 * f.bundle.bundle_bytes).div_ceil(read_align(f)) * read_align(f)
}

/// Bytes of every FFN neuron cluster of `m` as read ([`cluster_read_bytes`]
/// summed): what the whole FFN takes in the hot and cold regions.
pub fn ffn_read_bytes(m: &Manifest) -> u64 {
    m.ffn.iter().flat_map(|f| f.clusters.iter().map(move |c| cluster_read_bytes(f, c))).sum()
}

/// Bytes of all of `m`'s segments (SPEC §3): the pack's weights, tokenizer
/// and predictors, without header and manifest.
pub fn segment_bytes(m: &Manifest) -> u64 {
    m.segments.iter().map(|s| s.bytes).sum()
}

/// How many of `f`'s clusters lie wholly in the hot prefix of `hot_neurons`
/// packed positions (the hot set holds whole clusters only).
pub fn hot_clusters(f: &FfnLayer, hot_neurons: u32) -> usize {
    f.clusters.iter().take_while(|c| c.first as u64 + c.n_neurons as u64 <= hot_neurons as u64).count()
}

/// Element type of the KV cache: f16 by default (as llama.cpp), f32 with
/// `nflash run --kv f32`. Attention reads it in either type and computes in
/// f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    /// Half precision, 2 bytes per element.
    #[default]
    F16,
    /// Single precision, 4 bytes per element.
    F32,
}

impl KvType {
    /// Every type, with its command-line name.
    pub const ALL: [(KvType, &'static str); 2] = [(KvType::F16, "f16"), (KvType::F32, "f32")];

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }

    /// The command-line name (`f16`, `f32`).
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(k, _)| *k == self).map_or("f16", |(_, n)| n)
    }

    /// The type a stored plan sized its KV cache for (plans made before the
    /// f16 default have f32 sizes): the one whose size at `p.ctx` is `p.kv_bytes`.
    pub fn of_plan(m: &nflash_format::Manifest, p: &Plan) -> KvType {
        let f32_bytes = kv_cache_bytes_of(&m.config, p.ctx as usize, KvType::F32);
        if p.kv_bytes == f32_bytes && f32_bytes > 0 {
            KvType::F32
        } else {
            KvType::F16
        }
    }
}

impl std::str::FromStr for KvType {
    type Err = String;

    /// `f16` or `f32`.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(k, _)| *k)
            .ok_or_else(|| format!("unknown KV cache type {s:?}: expected f16 or f32"))
    }
}

/// Positions the KV cache of layer `l` of model `c` holds in a run whose
/// context is `ctx` tokens: all of them, except in a sliding-window layer
/// (window `W`, [`nflash_format::ModelConfig::layer_window`]), whose cache
/// is a ring of `W + room` positions with `room` = [`kv_ring_room`]: the
/// window of the oldest token a pass runs, plus the pass itself, so that a
/// prefill chunk longer than the window and a rollback within the pass's
/// tokens both work (runtime/src/model/kv_cache.rs).
pub fn kv_layer_capacity(c: &nflash_format::ModelConfig, l: usize, ctx: usize) -> usize {
    match c.layer_window(l) {
        Some(w) => ctx.min((w as usize).saturating_add(kv_ring_room(c))),
        None => ctx,
    }
}

/// Room a sliding-window layer's KV ring keeps beyond its window, tokens:
/// the longest pass the runtime runs, one prefill chunk ([`prefill_chunk`]).
pub fn kv_ring_room(c: &nflash_format::ModelConfig) -> usize {
    prefill_chunk(c)
}

/// Bytes of the whole KV cache of model `c` in a run of `ctx` tokens, with
/// `kv` elements, when full: the sum over layers of
/// [`kv_layer_capacity`] positions of `2 · num_kv_heads · head_dim`
/// elements. A long context costs what the global layers need; the
/// sliding-window layers stay at their ring's size.
pub fn kv_cache_bytes_of(c: &nflash_format::ModelConfig, ctx: usize, kv: KvType) -> u64 {
    let kvd = (c.num_kv_heads * c.head_dim) as usize;
    (0..c.num_layers as usize).map(|l| kv_cache_bytes(1, kvd, kv_layer_capacity(c, l, ctx), kv)).sum()
}

/// Bytes of a KV cache of `kv` elements, `n_layers` layers, `kv_dim`
/// (`num_kv_heads · head_dim`) elements per position and `capacity`
/// positions, when full: `2 · layers · capacity · kv_dim · kv.bytes()`.
pub fn kv_cache_bytes(n_layers: usize, kv_dim: usize, capacity: usize, kv: KvType) -> u64 {
    2 * n_layers as u64 * capacity as u64 * kv_dim as u64 * kv.bytes()
}

/// How the FFN is split between memory and flash (what a [`Plan`] decides
/// and the runtime's neuron cache is opened with).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Hot neurons pinned per layer `[n_layers]` (packed positions `0..hot[l]`,
    /// rounded down to a neuron-cluster boundary).
    pub hot_neurons: Vec<u32>,
    /// Cold region, bytes; raised to one layer's cold clusters if smaller
    /// (they also stage the reads of one layer).
    pub cold_bytes: u64,
    /// Reads in flight at once: I/O threads, or the depth of the io_uring
    /// queue ([`IoEngine`]).
    pub io_threads: usize,
    /// How reads are issued.
    pub io_engine: IoEngine,
    /// Check each neuron cluster's CRC-32C (formats/SPEC.md §4.10) after it
    /// is read and before it is used: hot clusters at load, cold ones on the
    /// I/O threads. No effect on packs without checksums (before 3.4).
    pub verify: bool,
    /// Neuron-cache bytes (hot and cold regions) to hold at load; `None`:
    /// all of it. Below the regions above, the cache opens as a resize to
    /// this size would leave it (cold slots first, then the same share of
    /// each layer's least active hot clusters), reads only the hot clusters
    /// it keeps, and can grow to the full regions later (`nflash run
    /// --memory-budget auto`, or a budget above the memory available at start).
    pub start_bytes: Option<u64>,
}

/// How the runtime issues neuron-cluster reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngine {
    /// io_uring where the kernel allows it (Linux ≥ 5.6, not forbidden by
    /// seccomp, SELinux or `kernel.io_uring_disabled`), else threads.
    #[default]
    Auto,
    /// One io_uring: the compute thread that misses submits every read of a
    /// layer in one system call and one thread reaps completions (about a
    /// third of the CPU per read of `Threads` on the dev host: 7–8 µs
    /// against 22–26 µs for 8 KiB O_DIRECT reads, fio). Fails if the kernel
    /// refuses io_uring.
    Uring,
    /// `io_threads` threads, each making one blocking `preadv` at a time.
    Threads,
}

impl std::str::FromStr for IoEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(IoEngine::Auto),
            "uring" | "io_uring" => Ok(IoEngine::Uring),
            "threads" => Ok(IoEngine::Threads),
            _ => Err(format!("unknown I/O engine {s:?}: use auto, uring or threads")),
        }
    }
}

impl CacheConfig {
    /// Every FFN neuron pinned in memory (no budget).
    pub fn all_hot(pack: &Pack) -> Self {
        CacheConfig {
            hot_neurons: pack.manifest().ffn.iter().map(|f| f.n_neurons).collect(),
            cold_bytes: 0,
            io_threads: 1,
            io_engine: IoEngine::Auto,
            verify: true,
            start_bytes: None,
        }
    }

    /// The cache layout plan `p` describes.
    pub fn from_plan(p: &Plan) -> Self {
        CacheConfig {
            hot_neurons: p.hot_neurons.clone(),
            cold_bytes: p.cold_bytes,
            io_threads: p.io_threads as usize,
            io_engine: IoEngine::Auto,
            verify: true,
            start_bytes: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nflash_format::{Activation, Architecture, ModelConfig};

    fn shape(hidden: u64, heads: u64, kv_heads: u64, head_dim: u64) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            vocab_size: 1000,
            hidden_size: hidden,
            intermediate_size: 4 * hidden,
            num_layers: 2,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: None,
            max_position_embeddings: 4096,
            sliding_window: None,
            activation: Activation::Silu,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
        }
    }

    #[test]
    fn prefill_chunks_keep_activations_within_their_bytes() {
        // SmolLM2-135M: (6·576 + 2·576 + 2·192)·4 = 19 968 bytes per token.
        assert_eq!(prefill_activation_bytes(&shape(576, 9, 3, 64)), 19_968);
        assert_eq!(prefill_chunk(&shape(576, 9, 3, 64)), 256);
        // Llama-2-7B: 139 264 bytes per token, 60 fit: the floor of 64.
        assert_eq!(prefill_chunk(&shape(4096, 32, 32, 128)), 64);
        // A tiny model: the ceiling.
        assert_eq!(prefill_chunk(&shape(64, 4, 2, 16)), 512);
        for c in [shape(576, 9, 3, 64), shape(2048, 32, 8, 64), shape(896, 14, 2, 64)] {
            let n = prefill_chunk(&c) as u64;
            let per = prefill_activation_bytes(&c);
            assert!(n == PREFILL_CHUNK_RANGE.0 as u64 || n * per <= PREFILL_ACTIVATION_BYTES);
            assert!(n.is_power_of_two());
        }
    }
}
