//! The manifest: everything about a pack except the bulk bytes (SPEC §4).
//!
//! Encoded with bincode 1.x, fixed-width little-endian integers
//! (`DefaultOptions::new().with_fixint_encoding().with_little_endian()`).

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::dtype::DType;

/// What a segment holds (SPEC §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SegmentKind {
    /// zstd-compressed `tokenizer.json`.
    Tokenizer,
    /// Tensors kept in memory for the whole run: embeddings, norms, attention,
    /// FFN biases, an untied `lm_head`.
    Resident,
    /// One layer's FFN neuron clusters.
    Ffn,
    /// A UTF-8 JSON object of optional settings (SPEC §4.9; format 3.2).
    Metadata,
    /// The CRC-32C of every neuron cluster (SPEC §4.10; format 3.4).
    ClusterChecksums,
}

/// One aligned byte range of the file (SPEC §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Unique name: `tokenizer`, `metadata`, `resident`, `ffn.{layer}` (`ffn.{layer}.{expert}`), `checksums`.
    pub name: String,
    /// Content kind.
    pub kind: SegmentKind,
    /// Absolute offset, bytes; a multiple of the header's alignment.
    pub offset: u64,
    /// Length, bytes.
    pub bytes: u64,
    /// CRC32 (IEEE) of the segment's bytes.
    pub crc32: u32,
}

/// A dense tensor inside a segment (SPEC §4.3). Row-major; the last
/// dimension is the row and, for quantized types, a multiple of 32.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Hugging Face tensor name (e.g. `model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Index into [`Manifest::segments`].
    pub segment: u32,
    /// Offset inside the segment, bytes.
    pub offset: u64,
    /// Length, bytes; equals `dtype.tensor_bytes(shape)`.
    pub bytes: u64,
    /// Storage type.
    pub dtype: DType,
    /// Shape in elements, PyTorch order (`[out_features, in_features]`).
    pub shape: Vec<u64>,
}

/// Layout of one neuron bundle (SPEC §4.4): gate row | up row | down column,
/// each `hidden_size` elements of `dtype`, back to back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleLayout {
    /// Storage type of all three parts.
    pub dtype: DType,
    /// Elements per part (`hidden_size`).
    pub row_elems: u64,
    /// Bytes per part: `dtype.row_bytes(row_elems)`.
    pub row_bytes: u64,
    /// Bytes per bundle: `3 * row_bytes`.
    pub bundle_bytes: u64,
}

impl BundleLayout {
    /// Layout for `hidden` elements per part; `None` if `hidden` does not fit `dtype`'s blocks.
    pub fn new(dtype: DType, hidden: u64) -> Option<Self> {
        let row_bytes = dtype.row_bytes(hidden)?;
        Some(BundleLayout { dtype, row_elems: hidden, row_bytes, bundle_bytes: row_bytes.checked_mul(3)? })
    }
}

/// A run of consecutive neurons (in packed order) stored contiguously and
/// starting on a cluster-aligned offset (SPEC §4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NeuronCluster {
    /// Offset inside the layer's FFN segment, bytes; a multiple of `cluster_align`.
    pub offset: u64,
    /// Packed position of the first neuron.
    pub first: u32,
    /// Number of neurons (bundles).
    pub n_neurons: u32,
}

/// One layer's FFN as neuron clusters (SPEC §4.4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FfnLayer {
    /// Decoder layer index.
    pub layer: u32,
    /// Index into [`Manifest::segments`] (kind [`SegmentKind::Ffn`]).
    pub segment: u32,
    /// Neurons in the layer (`intermediate_size`).
    pub n_neurons: u32,
    /// Bundle layout.
    pub bundle: BundleLayout,
    /// Alignment of each cluster's offset inside the segment, bytes.
    pub cluster_align: u64,
    /// Clusters in packed order, covering positions `0..n_neurons` exactly once.
    pub clusters: Vec<NeuronCluster>,
    /// `order[p]` = original neuron id (row of `gate_proj`) stored at packed position `p`.
    /// Sparse packs store neurons hot first (descending activation frequency).
    pub order: Vec<u32>,
    /// Activity threshold, predictor calibration and profile summary; `None` in dense packs (SPEC §4.5).
    pub sparse: Option<LayerSparsity>,
}

/// Which per-neuron value decides whether an FFN neuron is active (SPEC §4.5).
/// For ReLU-family models both reduce to `act > 0` at threshold 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Criterion {
    /// `|act(gate · x)|` (CATS, arXiv 2404.08763).
    Gate,
    /// `|act(gate · x) · (up · x)|`, the input of the down projection.
    GateUp,
}

impl Criterion {
    /// Command-line name: `gate`, `gate-up`.
    pub fn name(self) -> &'static str {
        match self {
            Criterion::Gate => "gate",
            Criterion::GateUp => "gate-up",
        }
    }
}

impl std::str::FromStr for Criterion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gate" => Ok(Criterion::Gate),
            "gate-up" => Ok(Criterion::GateUp),
            _ => Err(format!("unknown criterion {s:?}; use gate or gate-up")),
        }
    }
}

/// How decode decides which neurons to read and compute (SPEC §4.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PredictorKind {
    /// Gate and up for every neuron; down only for active ones.
    Exact,
    /// Rank-r estimate of gate and up through a projection of the input:
    /// tensors `nflash.predictor.{l}.proj` `[r, hidden]`, `.gate` and `.up` `[n_neurons, r]`.
    LowRank,
    /// Per-layer MLP `hidden → r → n_neurons` with ReLU, output a logit:
    /// `.w1` `[r, hidden]`, `.b1` `[r]`, `.w2` `[n_neurons, r]`, `.b2` `[n_neurons]`.
    Mlp,
}

impl PredictorKind {
    /// Command-line name: `exact`, `low-rank`, `mlp`.
    pub fn name(self) -> &'static str {
        match self {
            PredictorKind::Exact => "exact",
            PredictorKind::LowRank => "low-rank",
            PredictorKind::Mlp => "mlp",
        }
    }
}

impl std::str::FromStr for PredictorKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "exact" => Ok(PredictorKind::Exact),
            "low-rank" => Ok(PredictorKind::LowRank),
            "mlp" => Ok(PredictorKind::Mlp),
            _ => Err(format!("unknown predictor {s:?}; use exact, low-rank or mlp")),
        }
    }
}

/// Pack-wide sparsity settings (SPEC §4.5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SparseInfo {
    /// Activity criterion.
    pub criterion: Criterion,
    /// Predictor used by decode.
    pub predictor: PredictorKind,
    /// Predictor rank r (0 for [`PredictorKind::Exact`]).
    pub rank: u32,
    /// Target fraction of inactive neurons per layer; for ReLU-family models
    /// (natural sparsity) the mean measured fraction on the calibration text.
    pub target_sparsity: f32,
    /// Target fraction of truly active neurons the predictor keeps.
    pub recall_target: f32,
    /// Calibration tokens profiled.
    pub calib_tokens: u64,
    /// Calibration text file name.
    pub calib_source: String,
}

/// Predictor quality on held-out calibration tokens (SPEC §4.5).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PredictorQuality {
    /// Fraction of truly active neurons that were predicted.
    pub recall: f32,
    /// Fraction of predicted neurons that were truly active.
    pub precision: f32,
    /// Fraction of neuron bundles not predicted (neither read nor computed).
    pub bundles_skipped: f32,
    /// Fraction of neurons inactive under the threshold (down projection skipped).
    pub sparsity: f32,
    /// Held-out tokens the figures were measured on.
    pub tokens: u32,
}

/// One layer's sparsity settings and profile summary (SPEC §4.5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSparsity {
    /// A neuron is active iff its criterion value is `> threshold`.
    pub threshold: f32,
    /// A neuron is predicted iff its predictor score is `> predictor_threshold`
    /// (ignored by [`PredictorKind::Exact`]).
    pub predictor_threshold: f32,
    /// Predictor tensors, bytes (0 for exact).
    pub predictor_bytes: u64,
    /// Held-out predictor quality.
    pub quality: PredictorQuality,
    /// Activation frequency at packed positions `round(k·(n-1)/32)`, k = 0..=32 (hot first).
    pub frequency_curve: Vec<f32>,
}

/// Tokenizer and chat settings (SPEC §4.2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// Name of the segment holding zstd-compressed `tokenizer.json`.
    pub segment: String,
    /// Uncompressed size of `tokenizer.json`, bytes.
    pub json_bytes: u64,
    /// Jinja chat template from `tokenizer_config.json`, if any.
    pub chat_template: Option<String>,
    /// `bos_token` string from `tokenizer_config.json`, for templates.
    pub bos_token: Option<String>,
    /// `eos_token` string from `tokenizer_config.json`, for templates.
    pub eos_token: Option<String>,
    /// Whether a BOS token is prepended to a raw (non-chat) prompt (`add_bos_token`).
    pub add_bos_token: bool,
}

/// The manifest (SPEC §4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Tool and version that wrote the pack, e.g. `prep 0.1.0`.
    pub producer: String,
    /// Model hyper-parameters.
    pub config: ModelConfig,
    /// Tokenizer and chat template.
    pub tokenizer: TokenizerInfo,
    /// Segments in file order.
    pub segments: Vec<Segment>,
    /// Resident tensors.
    pub tensors: Vec<TensorEntry>,
    /// FFN neuron clusters, one entry per layer in layer order.
    pub ffn: Vec<FfnLayer>,
    /// Sparse decode settings; `None` for a dense pack (SPEC §4.5).
    pub sparse: Option<SparseInfo>,
    /// Memory plan for a device and budget; `None` if the pack was written without `--device` (SPEC §4.6).
    pub plan: Option<crate::plan::Plan>,
}

/// bincode options used for the manifest (SPEC §4).
pub(crate) fn bincode_options(limit: u64) -> impl bincode::Options {
    use bincode::Options;
    bincode::DefaultOptions::new().with_fixint_encoding().with_little_endian().with_limit(limit).reject_trailing_bytes()
}
