//! The model hyper-parameters stored in the manifest (SPEC §4.1).
//!
//! Field names follow the Hugging Face `config.json` keys they come from.

use serde::{Deserialize, Serialize};

/// Largest context a pack may declare or a run may ask for, tokens (1 Mi):
/// far above the models nflash targets, low enough that nothing is sized
/// from an absurd number (SPEC §4.1, §6).
pub const MAX_CONTEXT: u64 = 1 << 20;

/// Mixture-of-experts routing of a decoder layer's FFN (SPEC §4.1): a
/// router `[num_experts, hidden]` scores the experts of each token, the top
/// `experts_per_token` run, and their outputs are summed weighted by the
/// softmax of the router logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moe {
    /// Experts per layer (Mixtral `num_local_experts`, Qwen3-MoE `num_experts`).
    pub num_experts: u32,
    /// Experts each token is routed to (`num_experts_per_tok`, top-k).
    pub experts_per_token: u32,
    /// Whether the top-k routing weights are divided by their sum
    /// (`norm_topk_prob`; Mixtral always does).
    pub norm_topk_prob: bool,
}

/// Largest `num_experts` a pack may declare: far above any released model
/// (Qwen3-MoE has 128), low enough to bound what is sized from it.
pub const MAX_EXPERTS: u32 = 1024;

/// Largest number of FFN units (`num_layers × num_experts`) of a pack.
pub const MAX_FFN_UNITS: u64 = 1 << 16;

/// Largest number of decoder layers a pack may have (`num_hidden_layers`,
/// SPEC §4.1); also the size of a [`LayerSet`].
pub const MAX_LAYERS: u64 = 1 << 10;

/// A set of decoder layers: bit `l % 64` of word `l / 64` is layer `l`
/// (SPEC §4.1, 128 bytes on the wire; format 3.5). Used for the layers that
/// apply RoPE in SmolLM3.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSet(pub [u64; 16]);

impl LayerSet {
    /// The empty set.
    pub const EMPTY: LayerSet = LayerSet([0; 16]);

    /// The set of the layers `l < n` for which `f(l)` holds; `n` at most [`MAX_LAYERS`].
    pub fn from_fn(n: u64, f: impl Fn(usize) -> bool) -> Self {
        let mut s = Self::EMPTY;
        for l in 0..n.min(MAX_LAYERS) as usize {
            if f(l) {
                s.0[l / 64] |= 1 << (l % 64);
            }
        }
        s
    }

    /// Whether layer `l` is in the set (false for `l ≥` [`MAX_LAYERS`]).
    pub fn contains(&self, l: usize) -> bool {
        l < MAX_LAYERS as usize && self.0[l / 64] >> (l % 64) & 1 == 1
    }

    /// The layers in the set, ascending.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_LAYERS as usize).filter(|&l| self.contains(l))
    }

    /// The first layer in the set at or past `n_layers` (one a model of
    /// `n_layers` layers does not have), if any.
    pub fn first_past(&self, n_layers: u64) -> Option<usize> {
        self.iter().find(|&l| l as u64 >= n_layers)
    }
}

/// The first of RoPE frequencies `freqs` that the runtime's f32 cannot
/// hold as a positive normal number (a tiny `rope_theta` or factor makes
/// one infinite or zero): its index and value.
fn unusable_frequency(freqs: &[f64]) -> Option<(usize, f64)> {
    freqs.iter().copied().enumerate().find(|&(_, f)| {
        let x = f as f32;
        !(x.is_finite() && x >= f32::MIN_POSITIVE)
    })
}

impl std::fmt::Debug for LayerSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

/// Supported model architectures (HF `architectures[0]`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Architecture {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM` (optional sliding-window attention).
    Mistral,
    /// `Qwen2ForCausalLM` (bias on the Q, K and V projections).
    Qwen2,
    /// `MixtralForCausalLM` (format 3.3): Mistral attention, a mixture of
    /// experts in place of the FFN (`block_sparse_moe`, experts `w1`/`w3`/`w2`).
    Mixtral(Moe),
    /// `Qwen3MoeForCausalLM` (format 3.3): RMSNorm on each query and key head
    /// (`q_norm`, `k_norm`), a mixture of many small experts (`mlp.experts`).
    Qwen3Moe(Moe),
    /// `Qwen3ForCausalLM` (format 3.5): Qwen3-MoE's attention (RMSNorm on
    /// each query and key head, explicit `head_dim`) with a dense FFN.
    Qwen3,
    /// `SmolLM3ForCausalLM` (format 3.5): Llama, except that only the layers
    /// in the set apply RoPE; the others are NoPE layers (`no_rope_layers[l]`
    /// = 1 means layer `l` uses RoPE; default from `no_rope_layer_interval`).
    SmolLm3(LayerSet),
    /// `Phi3ForCausalLM` (format 3.5; Phi-3, Phi-3.5-mini, Phi-4-mini):
    /// Llama, with the fused `qkv_proj` and `gate_up_proj` of the checkpoint
    /// split at convert (stored as `q_proj`/`k_proj`/`v_proj` and
    /// `gate_proj`/`up_proj`), and RoPE on the first `rotary_dim` elements
    /// of each head only (`partial_rotary_factor`).
    Phi3(Phi3),
    /// `Gemma3ForCausalLM` (format 3.5; also the language model of
    /// `Gemma3ForConditionalGeneration`): embeddings scaled by
    /// `√hidden_size`, RMSNorm on each query and key head, attention scaled
    /// by `1/√query_pre_attn_scalar`, a norm after attention and after the
    /// FFN as well as before each (`pre_feedforward_layernorm`,
    /// `post_feedforward_layernorm`), every norm weight stored as `1 + w`,
    /// and sliding-window (local) layers with their own RoPE base between
    /// the global ones.
    Gemma3(Gemma3),
}

/// Gemma 3's own settings (SPEC §4.1, 144 bytes on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gemma3 {
    /// Attention scores are `q·k / √query_pre_attn_scalar` (HF
    /// `query_pre_attn_scalar`, not `head_dim`), ≥ 1.
    pub query_pre_attn_scalar: u64,
    /// RoPE base of the sliding-window layers (`rope_local_base_freq`),
    /// which take no `rope_scaling`; the global layers use `rope_theta` and
    /// `rope_scaling`.
    pub rope_local_base_freq: f64,
    /// The sliding-window (local) layers (HF `layer_types[l] ==
    /// "sliding_attention"`); the others attend to the whole context.
    pub sliding_layers: LayerSet,
}

/// The names of one decoder layer's RMSNorm weights, each `[hidden]`
/// ([`ModelConfig::layer_norms`]). Llama-style models have no norms after
/// the blocks and call the FFN's `post_attention_layernorm`; Gemma 3 has
/// all four.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerNorms {
    /// Before attention (`input_layernorm`).
    pub attn: String,
    /// After attention, before the residual (Gemma 3's `post_attention_layernorm`).
    pub post_attn: Option<String>,
    /// Before the FFN (`post_attention_layernorm`; Gemma 3's `pre_feedforward_layernorm`).
    pub ffn: String,
    /// After the FFN, before the residual (Gemma 3's `post_feedforward_layernorm`).
    pub post_ffn: Option<String>,
}

impl LayerNorms {
    /// Every name, in the order the pack stores them: before attention,
    /// after it, before the FFN, after it.
    pub fn all(&self) -> impl Iterator<Item = &String> {
        [Some(&self.attn), self.post_attn.as_ref(), Some(&self.ffn), self.post_ffn.as_ref()].into_iter().flatten()
    }
}

/// Phi-3's own settings (SPEC §4.1, 8 bytes on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Phi3 {
    /// Elements of each query and key head that RoPE rotates, from the
    /// start of the head: `⌊head_dim · partial_rotary_factor⌋` (HF
    /// `Phi3Attention.rotary_ndims`); even, at most `head_dim`.
    pub rotary_dim: u64,
}

impl Architecture {
    /// The HF class names accepted.
    pub const SUPPORTED: [&'static str; 9] = [
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3ForCausalLM",
        "SmolLM3ForCausalLM",
        "Phi3ForCausalLM",
        "Gemma3ForCausalLM",
    ];

    /// Parses an HF `architectures` entry of a dense model with no settings
    /// of its own (the mixtures of experts need their routing settings and
    /// SmolLM3 its NoPE layers: `prep` reads them from config.json).
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Architecture::Llama),
            "MistralForCausalLM" => Some(Architecture::Mistral),
            "Qwen2ForCausalLM" => Some(Architecture::Qwen2),
            "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
            _ => None,
        }
    }

    /// The HF class name.
    pub fn hf_name(self) -> &'static str {
        let i = match self {
            Architecture::Llama => 0,
            Architecture::Mistral => 1,
            Architecture::Qwen2 => 2,
            Architecture::Mixtral(_) => 3,
            Architecture::Qwen3Moe(_) => 4,
            Architecture::Qwen3 => 5,
            Architecture::SmolLm3(_) => 6,
            Architecture::Phi3(_) => 7,
            Architecture::Gemma3(_) => 8,
        };
        Self::SUPPORTED[i]
    }

    /// The routing settings of a mixture of experts; `None` for a dense model.
    pub fn moe(self) -> Option<Moe> {
        match self {
            Architecture::Mixtral(m) | Architecture::Qwen3Moe(m) => Some(m),
            _ => None,
        }
    }
}

/// FFN activation (HF `hidden_act`). The neuron output is
/// `act(gate·x) · up·x`, except for [`Activation::DRelu`] (`relu(gate·x) · relu(up·x)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    /// `silu`: x · σ(x).
    Silu,
    /// `relu`: max(x, 0).
    Relu,
    /// `gelu`: exact erf GELU.
    Gelu,
    /// `gelu_pytorch_tanh` / `gelu_new`: tanh approximation.
    GeluTanh,
    /// dReLU (TurboSparse, arXiv 2406.05955): ReLU on both the gate and the
    /// up projection outputs. HF checkpoints say so with
    /// `architectures: ["BambooForCausalLM"]` (`model_type: "bamboo"`) and
    /// `hidden_act: "relu"`; `hidden_act: "drelu"` is accepted too (format 3.1).
    DRelu,
}

impl Activation {
    /// Parses HF `hidden_act`.
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "relu" => Some(Activation::Relu),
            "drelu" => Some(Activation::DRelu),
            "gelu" => Some(Activation::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(Activation::GeluTanh),
            _ => None,
        }
    }

    /// The `hidden_act` spelling (`drelu` for dReLU).
    pub fn name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::Relu => "relu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_pytorch_tanh",
            Activation::DRelu => "drelu",
        }
    }

    /// ReLU family (ReLU, dReLU): a neuron is active exactly when its output is non-zero.
    pub fn is_relu_family(self) -> bool {
        matches!(self, Activation::Relu | Activation::DRelu)
    }
}

/// RoPE frequency scaling (HF `rope_scaling`, keyed by `type` or `rope_type`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// `linear`: positions divided by `factor`.
    Linear { factor: f64 },
    /// `llama3`: per-frequency interpolation (Llama 3.1).
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: u64 },
    /// `longrope` (`su` before; Phi-3.5-mini, Phi-4-mini; format 3.5): each
    /// rotated frequency divided by its factor, `short_factor` for a run
    /// whose context is at most `original_max_position_embeddings` tokens
    /// and `long_factor` for a longer one (chosen once per run from the
    /// KV cache's size, as llama.cpp does, never from how long the
    /// conversation has grown), and cos/sin multiplied by
    /// `attention_factor` (HF `_compute_longrope_parameters`).
    LongRope {
        /// `[rotary_dim / 2]`, each finite and > 0.
        short_factor: Vec<f32>,
        /// `[rotary_dim / 2]`, each finite and > 0.
        long_factor: Vec<f32>,
        /// The pretrained context, tokens.
        original_max_position_embeddings: u64,
        /// The cos/sin scale: `rope_scaling.attention_factor`, else
        /// `√(1 + ln(s) / ln(original_max_position_embeddings))` with `s =
        /// max_position_embeddings / original_max_position_embeddings`, 1 when `s ≤ 1`.
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// One inverse frequency (radians per token) after `llama3` scaling (HF
    /// `_compute_llama3_parameters`): kept above the high-frequency band
    /// (wavelength below `original / high_freq_factor`), divided by `factor`
    /// below the low one, interpolated between; `inv_freq` itself for any
    /// other scaling.
    pub fn llama3_inv_freq(&self, inv_freq: f64) -> f64 {
        let RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } = self
        else {
            return inv_freq;
        };
        let old = *original_max_position_embeddings as f64;
        let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        if wavelen < high_wavelen {
            inv_freq
        } else if wavelen > low_wavelen {
            inv_freq / factor
        } else {
            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
            (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
        }
    }
}

/// Model hyper-parameters (SPEC §4.1). Sizes are element counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Architecture family.
    pub architecture: Architecture,
    /// Embedding rows (`vocab_size`).
    pub vocab_size: u64,
    /// Residual width (`hidden_size`).
    pub hidden_size: u64,
    /// FFN neurons per layer (`intermediate_size`).
    pub intermediate_size: u64,
    /// Decoder layers (`num_hidden_layers`).
    pub num_layers: u64,
    /// Query heads (`num_attention_heads`).
    pub num_heads: u64,
    /// Key/value heads (`num_key_value_heads`, default `num_attention_heads`).
    pub num_kv_heads: u64,
    /// Per-head width (`head_dim`, default `hidden_size / num_attention_heads`).
    pub head_dim: u64,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// RoPE base (`rope_theta`, default 10000).
    pub rope_theta: f64,
    /// RoPE scaling (`rope_scaling`).
    pub rope_scaling: Option<RopeScaling>,
    /// Trained context length (`max_position_embeddings`), tokens.
    pub max_position_embeddings: u64,
    /// Sliding attention window (Mistral `sliding_window`), tokens.
    pub sliding_window: Option<u64>,
    /// FFN activation (`hidden_act`).
    pub activation: Activation,
    /// Output projection shares the embedding matrix (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
    /// Bias on Q/K/V/O projections (`attention_bias`; Qwen2: Q/K/V only).
    pub attention_bias: bool,
    /// Bias on gate/up/down projections (`mlp_bias`).
    pub mlp_bias: bool,
    /// Beginning-of-sequence token (`bos_token_id`).
    pub bos_token_id: Option<u32>,
    /// Every end-of-sequence token (union of `eos_token_id` in config.json and
    /// generation_config.json).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// How tools name the model family: the HF class, except `drelu` for
    /// dReLU Mistral-shaped models (TurboSparse / Bamboo) and `drelu-moe`
    /// for dReLU Mixtrals (TurboSparse-Mixtral), which are stored as Mistral
    /// and Mixtral but are not those models to their users.
    pub fn family(&self) -> &'static str {
        match (self.activation, self.architecture) {
            (Activation::DRelu, Architecture::Mixtral(_)) => "drelu-moe",
            (Activation::DRelu, Architecture::Mistral) => "drelu",
            _ => self.architecture.hf_name(),
        }
    }

    /// [`Self::family`] with the FFN activation, e.g. `LlamaForCausalLM (silu)`;
    /// just `drelu` for dReLU models.
    pub fn family_and_activation(&self) -> String {
        if self.activation == Activation::DRelu
            && matches!(self.architecture, Architecture::Mistral | Architecture::Mixtral(_))
        {
            self.family().to_string()
        } else {
            format!("{} ({})", self.architecture.hf_name(), self.activation.name())
        }
    }

    /// Experts per layer: 1 for a dense model.
    pub fn experts(&self) -> u64 {
        self.architecture.moe().map_or(1, |m| u64::from(m.num_experts))
    }

    /// FFN units (SPEC §4.4): one per decoder layer, or one per expert of
    /// each layer for a mixture of experts (`num_layers × num_experts`).
    pub fn ffn_units(&self) -> u64 {
        self.num_layers.saturating_mul(self.experts())
    }

    /// (decoder layer, expert) of FFN unit `u`: unit `u` is expert
    /// `u mod num_experts` of layer `⌊u / num_experts⌋` (expert 0 when dense).
    pub fn unit_layer_expert(&self, u: usize) -> (usize, usize) {
        let e = self.experts() as usize;
        (u / e, u % e)
    }

    /// How FFN unit `u` is named in segment and predictor names: `{layer}`,
    /// or `{layer}.{expert}` for a mixture of experts (SPEC §3, §4.5).
    pub fn unit_name(&self, u: usize) -> String {
        let (l, e) = self.unit_layer_expert(u);
        if self.architecture.moe().is_some() {
            format!("{l}.{e}")
        } else {
            l.to_string()
        }
    }

    /// FFN unit `u` in messages: `layer {l}`, or `layer {l} expert {e}` for
    /// a mixture of experts.
    pub fn unit_label(&self, u: usize) -> String {
        let (l, e) = self.unit_layer_expert(u);
        if self.architecture.moe().is_some() {
            format!("layer {l} expert {e}")
        } else {
            format!("layer {l}")
        }
    }

    /// The checkpoint's names of FFN unit `u`'s gate, up and down projection
    /// weights (`[inter, hidden]`, `[inter, hidden]`, `[hidden, inter]`):
    /// `model.layers.{l}.mlp.{gate,up,down}_proj.weight`; Mixtral
    /// `model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`;
    /// Qwen3-MoE `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`.
    pub fn ffn_tensor_names(&self, u: usize) -> [String; 3] {
        let (l, e) = self.unit_layer_expert(u);
        match self.architecture {
            Architecture::Mixtral(_) => {
                let p = format!("model.layers.{l}.block_sparse_moe.experts.{e}");
                [format!("{p}.w1.weight"), format!("{p}.w3.weight"), format!("{p}.w2.weight")]
            }
            Architecture::Qwen3Moe(_) => {
                let p = format!("model.layers.{l}.mlp.experts.{e}");
                [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight"), format!("{p}.down_proj.weight")]
            }
            _ => {
                let p = format!("model.layers.{l}.mlp");
                [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight"), format!("{p}.down_proj.weight")]
            }
        }
    }

    /// Name of layer `l`'s router `[num_experts, hidden]` (a resident F32
    /// tensor, SPEC §4.3); `None` for a dense model.
    pub fn router_name(&self, l: usize) -> Option<String> {
        match self.architecture {
            Architecture::Mixtral(_) => Some(format!("model.layers.{l}.block_sparse_moe.gate.weight")),
            Architecture::Qwen3Moe(_) => Some(format!("model.layers.{l}.mlp.gate.weight")),
            _ => None,
        }
    }

    /// Whether attention RMSNorms each query and key head before RoPE
    /// (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, `[head_dim]`:
    /// Qwen3, Qwen3-MoE and Gemma 3).
    pub fn qk_norm(&self) -> bool {
        matches!(self.architecture, Architecture::Qwen3Moe(_) | Architecture::Qwen3 | Architecture::Gemma3(_))
    }

    /// Gemma 3's settings, `None` for other architectures.
    pub fn gemma3(&self) -> Option<Gemma3> {
        match self.architecture {
            Architecture::Gemma3(g) => Some(g),
            _ => None,
        }
    }

    /// Whether each decoder layer also normalizes the attention block's and
    /// the FFN's outputs before adding them to the residual (Gemma 3's
    /// `post_attention_layernorm` and `post_feedforward_layernorm`; its FFN
    /// input norm is then `pre_feedforward_layernorm`).
    pub fn sandwich_norms(&self) -> bool {
        self.gemma3().is_some()
    }

    /// The names of layer `l`'s norm weights `[hidden]` (SPEC §4.3).
    pub fn layer_norms(&self, l: usize) -> LayerNorms {
        let p = format!("model.layers.{l}");
        if self.sandwich_norms() {
            LayerNorms {
                attn: format!("{p}.input_layernorm.weight"),
                post_attn: Some(format!("{p}.post_attention_layernorm.weight")),
                ffn: format!("{p}.pre_feedforward_layernorm.weight"),
                post_ffn: Some(format!("{p}.post_feedforward_layernorm.weight")),
            }
        } else {
            LayerNorms {
                attn: format!("{p}.input_layernorm.weight"),
                post_attn: None,
                ffn: format!("{p}.post_attention_layernorm.weight"),
                post_ffn: None,
            }
        }
    }

    /// Factor applied to the embedding rows before the first layer:
    /// `√hidden_size` in f32 for Gemma 3 (HF `Gemma3TextScaledWordEmbedding`,
    /// llama.cpp `sqrtf(n_embd)`), else 1.
    pub fn embed_scale(&self) -> f32 {
        if self.gemma3().is_some() {
            (self.hidden_size as f32).sqrt()
        } else {
            1.0
        }
    }

    /// The attention scores' scale, `1/√d` in f32: `d = query_pre_attn_scalar`
    /// for Gemma 3, else `head_dim`.
    pub fn attn_scale(&self) -> f32 {
        let d = self.gemma3().map_or(self.head_dim, |g| g.query_pre_attn_scalar);
        1.0 / (d as f32).sqrt()
    }

    /// Sliding window of layer `l`, tokens: the positions a token attends
    /// to, itself included (HF `masking_utils.sliding_window_overlay`:
    /// key `j` is seen by query `i` when `i − W < j ≤ i`; llama.cpp
    /// `is_masked_swa`). Gemma 3: only its sliding layers; others: every
    /// layer when `sliding_window` is set. `None`: the whole context.
    pub fn layer_window(&self, l: usize) -> Option<u64> {
        match self.architecture {
            Architecture::Gemma3(g) if !g.sliding_layers.contains(l) => None,
            _ => self.sliding_window,
        }
    }

    /// Whether layer `l` takes its RoPE frequencies from
    /// [`Self::local_rope`] (Gemma 3's sliding layers) rather than from
    /// `rope_theta` and `rope_scaling`.
    pub fn layer_uses_local_rope(&self, l: usize) -> bool {
        self.gemma3().is_some_and(|g| g.sliding_layers.contains(l))
    }

    /// The config whose RoPE settings Gemma 3's sliding layers use:
    /// `rope_theta = rope_local_base_freq`, no `rope_scaling` (HF
    /// `Gemma3TextModel.rotary_emb_local`); `None` for other architectures.
    pub fn local_rope(&self) -> Option<ModelConfig> {
        self.gemma3().map(|g| ModelConfig { rope_theta: g.rope_local_base_freq, rope_scaling: None, ..self.clone() })
    }

    /// Elements of each query and key head that RoPE rotates, from the
    /// start of the head: `head_dim`, except Phi-3's partial rotary
    /// (SPEC §4.1).
    pub fn rotary_dim(&self) -> u64 {
        match self.architecture {
            Architecture::Phi3(p) => p.rotary_dim,
            _ => self.head_dim,
        }
    }

    /// Whether layer `l` rotates its queries and keys with RoPE: every layer
    /// but SmolLM3's NoPE layers (SPEC §4.1).
    pub fn layer_uses_rope(&self, l: usize) -> bool {
        match self.architecture {
            Architecture::SmolLm3(rope) => rope.contains(l),
            _ => true,
        }
    }

    /// RoPE's inverse frequencies, `[rotary_dim / 2]`: `rope_theta^(−2i/d)`
    /// over the `d = rotary_dim()` rotated elements, then `rope_scaling`
    /// (HF `_compute_default/linear/llama3/longrope_parameters`; for
    /// LongRoPE the short factors, or the long ones when `long`), in f64.
    pub fn rope_inv_freq(&self, long: bool) -> Vec<f64> {
        let d = self.rotary_dim() as usize;
        let mut inv_freq: Vec<f64> =
            (0..d / 2).map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / d as f64)).collect();
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => inv_freq.iter_mut().for_each(|f| *f /= factor),
            Some(scaling @ RopeScaling::Llama3 { .. }) => {
                inv_freq.iter_mut().for_each(|f| *f = scaling.llama3_inv_freq(*f))
            }
            Some(RopeScaling::LongRope { short_factor, long_factor, .. }) => {
                let ext = if long { long_factor } else { short_factor };
                inv_freq.iter_mut().zip(ext).for_each(|(f, e)| *f /= f64::from(*e));
            }
        }
        inv_freq
    }

    /// Checks internal consistency; returns a description of the first problem.
    pub fn check(&self) -> std::result::Result<(), String> {
        let nz = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (k, v) in nz {
            if v == 0 {
                return Err(format!("{k} is 0"));
            }
        }
        // Caps far above any real model; they bound allocations made from these numbers.
        let caps = [
            ("vocab_size", self.vocab_size, 1 << 22),
            ("hidden_size", self.hidden_size, 1 << 17),
            ("intermediate_size", self.intermediate_size, 1 << 19),
            ("num_hidden_layers", self.num_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_heads, 1 << 10),
            ("head_dim", self.head_dim, 1 << 12),
            ("max_position_embeddings", self.max_position_embeddings, MAX_CONTEXT),
        ];
        for (k, v, cap) in caps {
            if v > cap {
                return Err(format!("{k} = {v} exceeds the supported maximum {cap}"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} is odd; RoPE needs an even head_dim", self.head_dim));
        }
        let rot = self.rotary_dim();
        if rot == 0 || !rot.is_multiple_of(2) || rot > self.head_dim {
            return Err(format!(
                "RoPE would rotate {rot} elements of each head of {}; it rotates an even number from 2 to head_dim (partial_rotary_factor)",
                self.head_dim
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(format!("rms_norm_eps {} is not a positive number", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!("rope_theta {} is not a positive number", self.rope_theta));
        }
        if self.rms_norm_eps >= 1.0 {
            return Err(format!("rms_norm_eps {} is not below 1 (models use about 1e-6 to 1e-5)", self.rms_norm_eps));
        }
        if self.sliding_window == Some(0) {
            return Err("sliding_window is 0: a token could attend to nothing; leave the key out for no window".into());
        }
        match &self.rope_scaling {
            Some(RopeScaling::Linear { factor }) if !(factor.is_finite() && *factor > 0.0) => {
                return Err(format!("rope_scaling (linear) factor {factor:e} is not a positive number"));
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let ok = |x: f64| x.is_finite() && x > 0.0;
                if !(ok(*factor) && ok(*low_freq_factor) && ok(*high_freq_factor))
                    || *original_max_position_embeddings == 0
                {
                    return Err(format!("rope_scaling (llama3): factor {factor:e}, low_freq_factor {low_freq_factor:e}, high_freq_factor {high_freq_factor:e} and original_max_position_embeddings {original_max_position_embeddings} must all be positive"));
                }
                if low_freq_factor >= high_freq_factor {
                    return Err(format!(
                        "rope_scaling (llama3): low_freq_factor {low_freq_factor} is not below high_freq_factor {high_freq_factor}"
                    ));
                }
            }
            _ => {}
        }
        if let Some(RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        }) = &self.rope_scaling
        {
            for (k, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if f.len() as u64 != rot / 2 {
                    return Err(format!(
                        "rope_scaling.{k} has {} entries; RoPE rotates {rot} elements of each head, so it needs {}",
                        f.len(),
                        rot / 2
                    ));
                }
                if let Some(bad) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                    return Err(format!("rope_scaling.{k} holds {bad}; each factor is a positive number"));
                }
            }
            if *original_max_position_embeddings == 0 || *original_max_position_embeddings > MAX_CONTEXT {
                return Err(format!(
                    "rope_scaling original_max_position_embeddings {original_max_position_embeddings} is not between 1 and {MAX_CONTEXT}"
                ));
            }
            if !(attention_factor.is_finite() && *attention_factor > 0.0 && *attention_factor <= 16.0) {
                return Err(format!(
                    "rope_scaling.attention_factor {attention_factor:e} is not in (0, 16] (it scales cos and sin; models use about 1 to 1.2)"
                ));
            }
        }
        // Every frequency the runtime computes (in f32) must be a usable
        // number: a tiny rope_theta or factor makes it infinite or zero.
        for long in [false, true] {
            if let Some((i, f)) = unusable_frequency(&self.rope_inv_freq(long)) {
                return Err(format!(
                    "RoPE frequency {i} is {f:e}, which an f32 cannot hold as a positive number: check rope_theta {:e} and rope_scaling",
                    self.rope_theta
                ));
            }
        }
        if let Architecture::SmolLm3(rope) = self.architecture {
            if let Some(l) = rope.first_past(self.num_layers) {
                return Err(format!(
                    "the RoPE layer set names layer {l}, but the model has {} layers",
                    self.num_layers
                ));
            }
        }
        if let Some(g) = self.gemma3() {
            if g.query_pre_attn_scalar == 0 {
                return Err("query_pre_attn_scalar is 0; attention scores are divided by its square root".into());
            }
            if !(g.rope_local_base_freq.is_finite() && g.rope_local_base_freq > 0.0) {
                return Err(format!("rope_local_base_freq {} is not a positive number", g.rope_local_base_freq));
            }
            if let Some(l) = g.sliding_layers.first_past(self.num_layers) {
                return Err(format!(
                    "the sliding-window layer set names layer {l}, but the model has {} layers",
                    self.num_layers
                ));
            }
        }
        if let Some(local) = self.local_rope() {
            if let Some((i, f)) = unusable_frequency(&local.rope_inv_freq(false)) {
                return Err(format!(
                    "RoPE frequency {i} of the sliding-window layers is {f:e}, which an f32 cannot hold as a positive number: check rope_local_base_freq {:e}",
                    local.rope_theta
                ));
            }
        }
        if let Some(m) = self.architecture.moe() {
            if m.num_experts == 0 || m.num_experts > MAX_EXPERTS {
                return Err(format!("{} experts per layer (supported: 1 to {MAX_EXPERTS})", m.num_experts));
            }
            if m.experts_per_token == 0 || m.experts_per_token > m.num_experts {
                return Err(format!(
                    "num_experts_per_tok {} is not between 1 and the {} experts of a layer",
                    m.experts_per_token, m.num_experts
                ));
            }
            if self.ffn_units() > MAX_FFN_UNITS {
                return Err(format!(
                    "{} layers × {} experts exceed the supported {MAX_FFN_UNITS} expert FFNs",
                    self.num_layers, m.num_experts
                ));
            }
            if self.mlp_bias {
                return Err("mlp_bias with a mixture of experts is not supported".into());
            }
        }
        Ok(())
    }
}
