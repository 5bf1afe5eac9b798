//! Decode-speed simulation beyond this machine (`nflash plan-sim`):
//! a synthetic manifest of a model shape whose FFN activation statistics are
//! those `prep synth` generates (mean sparsity, power-law hotness), so the
//! planner ([`crate::planner::plan`]) and its cost model
//! ([`crate::cost::estimate`]) can be applied to any device profile.
//!
//! Mixture-of-experts shapes have one FFN unit per expert (SPEC §4.4), as
//! `prep convert` writes them: each expert's neurons follow the power law
//! within the expert (mean `1 − sparsity` over the tokens routed to it),
//! and the experts' shares of the tokens follow a power law of exponent
//! `router_skew` (0: every expert equally often), so the planner ranks
//! clusters by P(expert) × P(neuron | expert) per byte as for a real pack.

use nflash_format::{
    Activation, Architecture, BundleLayout, Criterion, DType, DeviceProfile, FfnLayer, Gemma3, LayerSet, LayerSparsity,
    Manifest, ModelConfig, Moe, NeuronCluster, Phi3, PredictorKind, PredictorQuality, Segment, SegmentKind, SparseInfo,
    TensorEntry, TokenizerInfo,
};

use crate::layout::align_up;

/// A model shape (HF config values).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Name on the command line.
    pub name: &'static str,
    /// `hidden_size`.
    pub hidden: u64,
    /// `intermediate_size` (per expert).
    pub inter: u64,
    /// `num_hidden_layers`.
    pub layers: u64,
    /// `num_attention_heads`.
    pub heads: u64,
    /// `num_key_value_heads`.
    pub kv_heads: u64,
    /// `vocab_size`.
    pub vocab: u64,
    /// FFN experts per layer (1: dense).
    pub experts: u64,
    /// Experts each token is routed to.
    pub active_experts: u64,
    /// `head_dim` (`hidden / heads` but for Qwen3).
    pub head_dim: u64,
    /// `tie_word_embeddings`: the output projection is the embedding
    /// matrix, so there is no `lm_head` to keep in memory.
    pub tied: bool,
    /// The architecture of a dense shape (a mixture of experts is
    /// simulated as Mixtral whatever this says).
    pub arch: Architecture,
    /// `sliding_window`, tokens (Gemma 3: of its sliding layers).
    pub window: Option<u64>,
}

/// Shapes `plan-sim` knows: Llama-2-7B, Mistral-7B (the shapes `prep synth`
/// writes, with Llama's 32000-token vocabulary), Mixtral-8x7B (47B, top-2),
/// Qwen3-30B-A3B (128 experts, top-8, its 151 936-token vocabulary),
/// `prep synth`'s tiny-moe (with SmolLM2's 49 152 tokens), and the phone
/// models Qwen3-4B, Phi-4-mini and Gemma-3-4B (their HF configs: tied
/// embeddings; Gemma's sliding-window layers).
pub const SHAPES: [Shape; 8] = [
    Shape {
        name: "llama-7b",
        hidden: 4096,
        inter: 11008,
        layers: 32,
        heads: 32,
        kv_heads: 32,
        vocab: 32000,
        experts: 1,
        active_experts: 1,
        head_dim: 128,
        tied: false,
        arch: Architecture::Mistral,
        window: None,
    },
    Shape {
        name: "mistral-7b",
        hidden: 4096,
        inter: 14336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        vocab: 32000,
        experts: 1,
        active_experts: 1,
        head_dim: 128,
        tied: false,
        arch: Architecture::Mistral,
        window: None,
    },
    Shape {
        name: "mixtral-47b",
        hidden: 4096,
        inter: 14336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        vocab: 32000,
        experts: 8,
        active_experts: 2,
        head_dim: 128,
        tied: false,
        arch: Architecture::Mistral,
        window: None,
    },
    Shape {
        name: "qwen3-30b-a3b",
        hidden: 2048,
        inter: 768,
        layers: 48,
        heads: 32,
        kv_heads: 4,
        vocab: 151936,
        experts: 128,
        active_experts: 8,
        head_dim: 128,
        tied: false,
        arch: Architecture::Mistral,
        window: None,
    },
    Shape {
        name: "tiny-moe",
        hidden: 128,
        inter: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        vocab: 49152,
        experts: 8,
        active_experts: 2,
        head_dim: 32,
        tied: false,
        arch: Architecture::Mistral,
        window: None,
    },
    // Qwen/Qwen3-4B config.json.
    Shape {
        name: "qwen3-4b",
        hidden: 2560,
        inter: 9728,
        layers: 36,
        heads: 32,
        kv_heads: 8,
        vocab: 151936,
        experts: 1,
        active_experts: 1,
        head_dim: 128,
        tied: true,
        arch: Architecture::Qwen3,
        window: None,
    },
    // microsoft/Phi-4-mini-instruct config.json: partial_rotary_factor 0.75.
    Shape {
        name: "phi4-mini",
        hidden: 3072,
        inter: 8192,
        layers: 32,
        heads: 24,
        kv_heads: 8,
        vocab: 200064,
        experts: 1,
        active_experts: 1,
        head_dim: 128,
        tied: true,
        arch: Architecture::Phi3(Phi3 { rotary_dim: 96 }),
        window: None,
    },
    // google/gemma-3-4b-it config.json text_config and Gemma3TextConfig's
    // defaults: 8 heads of 256, 4 KV heads, 262 208 tokens, window 1024
    // on five layers of every six (sliding_window_pattern 6).
    Shape {
        name: "gemma3-4b",
        hidden: 2560,
        inter: 10240,
        layers: 34,
        heads: 8,
        kv_heads: 4,
        vocab: 262208,
        experts: 1,
        active_experts: 1,
        head_dim: 256,
        tied: true,
        arch: Architecture::Gemma3(Gemma3 {
            query_pre_attn_scalar: 256,
            rope_local_base_freq: 10000.0,
            sliding_layers: LayerSet::EMPTY,
        }),
        window: Some(1024),
    },
];

/// Looks up a shape by name.
pub fn shape(name: &str) -> Option<Shape> {
    SHAPES.iter().copied().find(|s| s.name == name)
}

/// What the simulated pack looks like.
#[derive(Debug, Clone, Copy)]
pub struct SimOptions {
    /// Mean fraction of (routed) FFN neurons inactive per token, in [0, 1).
    pub sparsity: f64,
    /// Power-law exponent of neuron activation frequency over hotness rank.
    pub skew: f64,
    /// Weight type of matrices.
    pub quant: DType,
    /// Predictor recall of active neurons.
    pub recall: f64,
    /// Predictor precision (active among selected).
    pub precision: f64,
    /// Predictor size as a fraction of a layer's FFN bytes (MLP predictor, Q8_0).
    pub predictor_budget: f64,
    /// Mixtures of experts: power-law exponent of expert popularity (0: uniform routing).
    pub router_skew: f64,
}

/// `p_k = min(0.999, c·(k+1)^-skew)` for hotness ranks `k = 0..n`, with `c`
/// found by bisection so that the mean is `mean` (≤ 0.999): the per-neuron
/// activation probabilities `prep synth` generates, hottest first.
pub fn power_law(n: usize, mean: f64, skew: f64) -> Vec<f64> {
    const P_MAX: f64 = 0.999;
    let eval = |c: f64| -> Vec<f64> { (0..n).map(|k| (c * ((k + 1) as f64).powf(-skew)).min(P_MAX)).collect() };
    let avg = |c: f64| eval(c).iter().sum::<f64>() / n.max(1) as f64;
    let mean = mean.min(P_MAX);
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while avg(hi) < mean && hi < 1e300 {
        hi *= 2.0;
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if avg(mid) < mean {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    eval(hi)
}

/// A manifest of `shape` as `prep convert --quant` would write it with a
/// sparse MLP predictor, clusters sized for `dev` (no tensor data: only what
/// the planner reads), and each FFN unit's share of the tokens (1 per
/// dense layer; an expert's from `o.router_skew`). Returns `None` if
/// `hidden` is not a multiple of the quantization block.
pub fn synthetic_manifest(shape: &Shape, o: &SimOptions, dev: &DeviceProfile) -> Option<(Manifest, Vec<f64>)> {
    let (h, l, e) = (shape.hidden, shape.layers, shape.experts.max(1));
    let n = shape.inter;
    let head_dim = shape.head_dim;
    let (qd, kvd) = (shape.heads * head_dim, shape.kv_heads * head_dim);
    let row = o.quant.row_bytes(h)?;
    let bundle = BundleLayout::new(o.quant, h)?;
    // Within a unit: the frequencies over the tokens it runs.
    let mean = 1.0 - o.sparsity;
    let freq = power_law(n as usize, mean, o.skew);
    let curve: Vec<f32> = (0..=32).map(|k| freq[(k * (n as usize - 1) + 16) / 32] as f32).collect();
    let scale = o.recall / o.precision.max(1e-6);
    let need: Vec<f64> = freq.iter().map(|p| (p * scale).min(1.0)).collect();
    let cluster_bytes = crate::planner::choose_cluster_bytes(dev, bundle.bundle_bytes, &need);
    let per = (cluster_bytes / bundle.bundle_bytes).max(1) as u32;
    // MLP predictor: rank r with (hidden + n) Q8_0 weights per rank ≈ budget × the unit's FFN bytes.
    let q8 = DType::Q8_0.row_bytes(32)? as f64 / 32.0;
    let ffn_unit = n as f64 * bundle.bundle_bytes as f64;
    let rank = ((o.predictor_budget * ffn_unit / ((h + n) as f64 * q8)) as u64 / 32 * 32).clamp(32, h);
    let predictor_bytes = (rank as f64 * (h + n) as f64 * q8) as u64;
    let moe = (e > 1).then_some(Moe {
        num_experts: e as u32,
        experts_per_token: shape.active_experts as u32,
        norm_topk_prob: true,
    });
    let mut tensors = Vec::new();
    let mut tensor = |name: String, rows: u64, bytes_per_row: u64, dtype: DType| {
        tensors.push(TensorEntry {
            name,
            segment: 1,
            offset: 0,
            bytes: rows * bytes_per_row,
            dtype,
            shape: vec![rows, h],
        });
    };
    tensor("model.embed_tokens.weight".into(), shape.vocab, row, o.quant);
    if !shape.tied {
        tensor("lm_head.weight".into(), shape.vocab, row, o.quant);
    }
    for i in 0..l {
        let p = format!("model.layers.{i}.self_attn");
        tensor(format!("{p}.q_proj.weight"), qd, row, o.quant);
        tensor(format!("{p}.k_proj.weight"), kvd, row, o.quant);
        tensor(format!("{p}.v_proj.weight"), kvd, row, o.quant);
        tensor(format!("{p}.o_proj.weight"), h, o.quant.row_bytes(qd)?, o.quant);
        if moe.is_some() {
            tensor(format!("model.layers.{i}.block_sparse_moe.gate.weight"), e, 4 * h, DType::F32);
        }
    }
    let resident: u64 = tensors.iter().map(|t| t.bytes).sum::<u64>() + l * (e * predictor_bytes + 2 * h * 4) + h * 4;
    let mut segments = vec![
        Segment { name: "tokenizer".into(), kind: SegmentKind::Tokenizer, offset: 0, bytes: 1 << 20, crc32: 0 },
        Segment { name: "resident".into(), kind: SegmentKind::Resident, offset: 0, bytes: resident, crc32: 0 },
    ];
    let clusters: Vec<NeuronCluster> = (0..n as u32)
        .step_by(per as usize)
        .map(|first| NeuronCluster { offset: 0, first, n_neurons: per.min(n as u32 - first) })
        .collect();
    let unit_bytes: u64 = clusters.iter().map(|c| align_up(c.n_neurons as u64 * bundle.bundle_bytes)).sum();
    let quality = PredictorQuality {
        recall: o.recall as f32,
        precision: o.precision as f32,
        bundles_skipped: (1.0 - need.iter().sum::<f64>() / n as f64) as f32,
        sparsity: 1.0 - mean as f32,
        tokens: 0,
    };
    let ffn = (0..(l * e) as u32)
        .map(|u| {
            let (layer, expert) = (u / e as u32, u % e as u32);
            segments.push(Segment {
                name: if moe.is_some() { format!("ffn.{layer}.{expert}") } else { format!("ffn.{layer}") },
                kind: SegmentKind::Ffn,
                offset: 0,
                bytes: unit_bytes,
                crc32: 0,
            });
            FfnLayer {
                layer,
                segment: segments.len() as u32 - 1,
                n_neurons: n as u32,
                bundle,
                cluster_align: 4096,
                clusters: clusters.clone(),
                order: Vec::new(),
                sparse: Some(LayerSparsity {
                    threshold: 0.0,
                    predictor_threshold: 0.0,
                    predictor_bytes,
                    quality,
                    frequency_curve: curve.clone(),
                }),
            }
        })
        .collect();
    // Each expert's share of the tokens: the power law of the router skew, summing to the active experts.
    let share: Vec<f64> = match moe {
        Some(m) => {
            let one = power_law(e as usize, m.experts_per_token as f64 / e as f64, o.router_skew);
            (0..l).flat_map(|_| one.iter().copied()).collect()
        }
        None => vec![1.0; l as usize],
    };
    let manifest = Manifest {
        producer: format!("nflash plan-sim ({})", shape.name),
        config: ModelConfig {
            architecture: match (moe, shape.arch) {
                (Some(m), _) => Architecture::Mixtral(m),
                // Every sixth layer global, as Gemma3TextConfig's default pattern.
                (None, Architecture::Gemma3(g)) => Architecture::Gemma3(Gemma3 {
                    sliding_layers: LayerSet::from_fn(l, |i| !(i as u64 + 1).is_multiple_of(6)),
                    ..g
                }),
                (None, a) => a,
            },
            vocab_size: shape.vocab,
            hidden_size: h,
            intermediate_size: n,
            num_layers: l,
            num_heads: shape.heads,
            num_kv_heads: shape.kv_heads,
            head_dim,
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            rope_scaling: None,
            max_position_embeddings: 32768,
            sliding_window: shape.window,
            activation: Activation::Relu,
            tie_word_embeddings: shape.tied,
            attention_bias: false,
            mlp_bias: moe.is_none(),
            bos_token_id: None,
            eos_token_ids: Vec::new(),
        },
        tokenizer: TokenizerInfo {
            segment: "tokenizer".into(),
            json_bytes: 2 << 20,
            chat_template: None,
            bos_token: None,
            eos_token: None,
            add_bos_token: false,
        },
        segments,
        tensors,
        ffn,
        sparse: Some(SparseInfo {
            criterion: Criterion::GateUp,
            predictor: PredictorKind::Mlp,
            rank: rank as u32,
            target_sparsity: o.sparsity as f32,
            recall_target: o.recall as f32,
            calib_tokens: 0,
            calib_source: "synthetic".into(),
        }),
        plan: None,
    };
    Some((manifest, share))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma-3-4B at 8k context: 29 of its 34 layers slide (window 1024),
    /// so their KV cache is a ring of 1024 + one prefill pass, and the
    /// whole cache costs what the 5 global layers need plus the rings.
    #[test]
    fn gemma3_kv_cache_counts_rings_for_sliding_layers() {
        use crate::layout::{kv_cache_bytes, kv_cache_bytes_of, kv_ring_room, KvType};
        let dev = DeviceProfile::parse(include_str!("../../profiles/dev-host.toml")).unwrap();
        let o = SimOptions {
            sparsity: 0.9,
            skew: 1.0,
            quant: DType::Q4_0,
            recall: 0.95,
            precision: 0.5,
            predictor_budget: 0.1,
            router_skew: 1.0,
        };
        let (m, _) = synthetic_manifest(&shape("gemma3-4b").unwrap(), &o, &dev).unwrap();
        let c = &m.config;
        assert!(c.check().is_ok());
        let sliding = (0..34).filter(|&l| c.layer_window(l).is_some()).count();
        assert_eq!(sliding, 29);
        let per_pos = kv_cache_bytes(1, 1024, 1, KvType::F16);
        let ring = (1024 + kv_ring_room(c)) as u64;
        assert_eq!(kv_cache_bytes_of(c, 8192, KvType::F16), per_pos * (5 * 8192 + 29 * ring));
        assert_eq!(kv_cache_bytes_of(c, 512, KvType::F16), per_pos * 34 * 512, "a short context fits every ring");
        assert!(kv_cache_bytes_of(c, 8192, KvType::F16) < kv_cache_bytes(34, 1024, 8192, KvType::F16) / 3);
    }

    #[test]
    fn power_law_has_the_requested_mean_and_is_decreasing() {
        for (mean, skew) in [(0.1, 1.5), (0.2, 1.0), (0.4, 0.5), (0.1, 0.0)] {
            let p = power_law(1000, mean, skew);
            let m = p.iter().sum::<f64>() / 1000.0;
            assert!((m - mean).abs() < 1e-6, "mean {m} for target {mean}");
            assert!(p.windows(2).all(|w| w[0] >= w[1]));
            assert!(p.iter().all(|&v| v > 0.0 && v <= 0.999));
        }
        // Skew 1.5 at mean 0.1: the hottest 20% carry about 80% of activations.
        let p = power_law(11008, 0.1, 1.5);
        let top: f64 = p[..2201].iter().sum::<f64>() / p.iter().sum::<f64>();
        assert!((0.7..0.9).contains(&top), "{top}");
    }

    /// The phone shapes have tied embeddings: no `lm_head` in the
    /// resident bytes, which are then smaller by exactly its rows.
    #[test]
    fn tied_shapes_keep_no_lm_head() {
        let dev = DeviceProfile::parse(include_str!("../../profiles/dev-host.toml")).unwrap();
        let o = SimOptions {
            sparsity: 0.9,
            skew: 1.5,
            quant: DType::Q4_0,
            recall: 0.99,
            precision: 0.5,
            predictor_budget: 0.1,
            router_skew: 0.0,
        };
        let tied = shape("qwen3-4b").unwrap();
        let resident = |s: &Shape| synthetic_manifest(s, &o, &dev).unwrap().0.segments[1].bytes;
        let (m, _) = synthetic_manifest(&tied, &o, &dev).unwrap();
        assert!(m.config.tie_word_embeddings && m.tensors.iter().all(|t| t.name != "lm_head.weight"));
        let untied = Shape { tied: false, ..tied };
        let lm_head = DType::Q4_0.row_bytes(tied.hidden).unwrap() * tied.vocab;
        assert_eq!(resident(&untied) - resident(&tied), lm_head);
        assert!(m.config.check().is_ok() && synthetic_manifest(&shape("phi4-mini").unwrap(), &o, &dev).is_some());
    }
}
