//! A GGUF model's metadata as the Hugging Face `config.json` of its class,
//! and its tensors under Hugging Face names: the names and settings of
//! llama.cpp's converter (`convert_hf_to_gguf.py`, `conversion/*.py`) read
//! back, with the facts llama.cpp keeps in its code rather than in the file
//! (`src/models/*.cpp` `load_arch_hparams`) supplied as llama.cpp supplies
//! them.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use nflash_format::{MAX_CONTEXT, MAX_LAYERS};
use serde_json::{json, Map, Value};

use super::file::{GgufFile, MetaArray, MetaValue};
use super::vocab::Vocab;
use super::{Rows, Source};

/// The `general.architecture` values nflash converts.
pub const ARCHITECTURES: &str = "llama (Llama, Mistral, Mixtral), qwen2, qwen3, qwen3moe, smollm3, phi3, gemma3";

/// The model families of [`ARCHITECTURES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    SmolLm3,
    Phi3,
    Gemma3,
}

/// Reads `{arch}.*` keys, naming the key in each error.
struct Keys<'a> {
    g: &'a GgufFile,
    arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn opt_u64(&self, k: &str) -> Result<Option<u64>> {
        self.g.opt_u64(&self.key(k))
    }
    /// A count that must be present and positive, at most `max`.
    fn count(&self, k: &str, max: u64) -> Result<u64> {
        let key = self.key(k);
        match self.opt_u64(k)? {
            None => bail!("metadata key {key:?} is missing; nflash needs it to build the model config"),
            Some(0) => bail!("metadata key {key:?} is 0; it must be positive: the file is corrupt"),
            Some(n) if n > max => {
                bail!("metadata key {key:?} is {n}, more than nflash reads ({max}): the file is corrupt")
            }
            Some(n) => Ok(n),
        }
    }
    /// A float key, finite, as the shortest decimal that round-trips
    /// through f32 (GGUF stores 1e-5 as the f32 9.99999975e-06;
    /// config.json says 1e-05).
    fn opt_f32(&self, k: &str) -> Result<Option<f64>> {
        let key = self.key(k);
        let Some(v) = self.g.get(&key) else { return Ok(None) };
        let x = v.as_f64().ok_or_else(|| anyhow!("metadata key {key:?} is {}, not a number", v.kind()))?;
        if !x.is_finite() {
            bail!("metadata key {key:?} is {x}: the file is corrupt");
        }
        Ok(Some((x as f32).to_string().parse::<f64>().expect("a float's display parses")))
    }
    fn positive_f32(&self, k: &str) -> Result<Option<f64>> {
        match self.opt_f32(k)? {
            Some(x) if x <= 0.0 => {
                bail!("metadata key {:?} is {x}; it must be positive: the file is corrupt", self.key(k))
            }
            x => Ok(x),
        }
    }
    fn opt_str(&self, k: &str) -> Result<Option<&str>> {
        self.g.opt_str(&self.key(k))
    }
}

/// The config and the tensor map of a GGUF model: its `config.json` as
/// Hugging Face writes it for the model's class, the Hugging Face name of
/// each stored tensor, and the tensors read into the config (Phi-3's
/// LongRoPE factors).
pub struct Built {
    pub config: Value,
    pub map: HashMap<String, Source>,
    pub consumed: Vec<String>,
}

/// Builds [`Built`] for the model whose first part is `files[0]`; `seen`
/// maps each GGUF tensor name to its part.
///
/// # Errors
/// An architecture outside [`ARCHITECTURES`], a missing, mistyped,
/// non-finite or inconsistent key (named), tensors of layers beyond
/// `block_count`, settings nflash does not read (named).
pub fn build(files: &[GgufFile], seen: &HashMap<&str, usize>, vocab: &Vocab) -> Result<Built> {
    let g = &files[0];
    let Some(arch) = g.opt_str("general.architecture")? else {
        bail!("metadata key \"general.architecture\" is missing; is this a model GGUF?");
    };
    let family = match arch {
        "llama" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "qwen3moe" => Family::Qwen3Moe,
        "smollm3" => Family::SmolLm3,
        "phi3" => Family::Phi3,
        "gemma3" => Family::Gemma3,
        other => bail!(
            "general.architecture is {other:?}; nflash converts GGUF files of {ARCHITECTURES} (a Hugging Face checkpoint of the model may be supported: see the README)"
        ),
    };
    let k = Keys { g, arch };
    let n_layers = k.count("block_count", MAX_LAYERS)?;
    // Every `blk.N.*` tensor belongs to a layer the metadata declares.
    if let Some(t) = seen.keys().find(|t| layer_of(t).is_some_and(|l| l >= n_layers)) {
        bail!(
            "tensor {t:?} belongs to a layer beyond {arch}.block_count ({n_layers}): the metadata and the tensors disagree; the file is corrupt"
        );
    }
    let hidden = k.count("embedding_length", 1 << 20)?;
    let heads = k.count("attention.head_count", 1 << 12)?;
    let kv_heads = k.opt_u64("attention.head_count_kv")?.unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        bail!(
            "{arch}.attention.head_count_kv is {kv_heads}; it must divide {arch}.attention.head_count ({heads}) (GQA)"
        );
    }
    let head_dim = match k.opt_u64("attention.key_length")? {
        Some(0) => bail!("{arch}.attention.key_length is 0: the file is corrupt"),
        Some(d) => d,
        None if hidden % heads != 0 => bail!(
            "{arch}.embedding_length ({hidden}) is not a multiple of {arch}.attention.head_count ({heads}), and {arch}.attention.key_length does not give the head size: the file is corrupt"
        ),
        None => hidden / heads,
    };
    if let Some(v) = k.opt_u64("attention.value_length")? {
        if v != head_dim {
            bail!("{arch}.attention.value_length ({v}) differs from the key length ({head_dim}); nflash reads models whose keys and values have one head size");
        }
    }
    let ffn = k.count("feed_forward_length", 1 << 24)?;
    let ctx = k.count("context_length", 1 << 32)?;
    let eps = k
        .positive_f32("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| anyhow!("metadata key \"{arch}.attention.layer_norm_rms_epsilon\" is missing"))?;
    // llama.cpp's default base (`rope_freq_base_train`) where the key is absent.
    let theta = k.positive_f32("rope.freq_base")?.unwrap_or(10000.0);
    let n_tokens = vocab.n_tokens as u64;
    let vocab_size = k.opt_u64("vocab_size")?.unwrap_or(n_tokens);
    if vocab_size < n_tokens {
        bail!(
            "{arch}.vocab_size is {vocab_size}, but tokenizer.ggml.tokens has {n_tokens} tokens: the file is corrupt"
        );
    }
    if let Some(rd) = k.opt_u64("rope.dimension_count")? {
        if family != Family::Phi3 && rd != head_dim {
            bail!("{arch}.rope.dimension_count is {rd}, not the head size {head_dim}: partial RoPE is not a {arch} setting nflash reads");
        }
    }
    let experts = k.opt_u64("expert_count")?.unwrap_or(0);
    if experts > 0 && !matches!(family, Family::Llama | Family::Qwen3Moe) {
        bail!("{arch}.expert_count is {experts}; nflash reads mixtures of experts of the llama (Mixtral) and qwen3moe architectures");
    }
    let class = match family {
        Family::Llama if experts > 0 => "MixtralForCausalLM",
        Family::Llama => "LlamaForCausalLM",
        Family::Qwen2 => "Qwen2ForCausalLM",
        Family::Qwen3 => "Qwen3ForCausalLM",
        Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        Family::SmolLm3 => "SmolLM3ForCausalLM",
        Family::Phi3 => "Phi3ForCausalLM",
        Family::Gemma3 => "Gemma3ForCausalLM",
    };
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("intermediate_size".into(), json!(ffn));
    c.insert("num_hidden_layers".into(), json!(n_layers));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("num_key_value_heads".into(), json!(kv_heads));
    c.insert("head_dim".into(), json!(head_dim));
    c.insert("rms_norm_eps".into(), json!(eps));
    c.insert("rope_theta".into(), json!(theta));
    c.insert("max_position_embeddings".into(), json!(ctx));
    c.insert("vocab_size".into(), json!(vocab_size));
    c.insert("tie_word_embeddings".into(), json!(!seen.contains_key("output.weight")));
    c.insert("hidden_act".into(), json!("silu"));
    if family == Family::Llama {
        c.insert("attention_bias".into(), json!(seen.contains_key("blk.0.attn_q.bias")));
    }
    c.insert("mlp_bias".into(), json!(seen.contains_key("blk.0.ffn_gate.bias")));
    for (key, v) in [("bos_token_id", vocab.bos), ("eos_token_id", vocab.eos)] {
        c.insert(key.into(), json!(v));
    }
    if let Some(t) = k.opt_str("rope.scaling.type")? {
        match t {
            "none" => {}
            "linear" => {
                let f = k.positive_f32("rope.scaling.factor")?.ok_or_else(|| {
                    anyhow!("{arch}.rope.scaling.type is linear but {arch}.rope.scaling.factor is missing")
                })?;
                c.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": f}));
            }
            other => bail!(
                "{arch}.rope.scaling.type is {other:?}; nflash reads linear RoPE scaling from GGUF (and Phi-3's LongRoPE factors); convert the Hugging Face checkpoint"
            ),
        }
    }
    let mut consumed = Vec::new();
    if seen.contains_key("rope_freqs.weight") {
        // Llama 3.1-style scaling: llama.cpp's converter stores the
        // per-frequency divisors, not the parameters they came from.
        if c.contains_key("rope_scaling") {
            bail!("the GGUF has both {arch}.rope.scaling.type and rope_freqs.weight; llama.cpp's converter writes one or the other: the file is corrupt");
        }
        let factors = rope_factors(files, seen, "rope_freqs.weight", head_dim / 2, "RoPE frequency")?;
        let original = k.opt_u64("rope.scaling.original_context_length")?;
        if let Some(o) = original.filter(|o| !(1..=MAX_CONTEXT).contains(o)) {
            bail!(
                "{arch}.rope.scaling.original_context_length is {o}; it must be between 1 and {MAX_CONTEXT} tokens: the file is corrupt"
            );
        }
        if let Some(scaling) = llama3_from_factors(&factors, theta, head_dim, original)? {
            c.insert("rope_scaling".into(), scaling);
        }
        consumed.push("rope_freqs.weight".to_string());
    }
    match family {
        Family::Llama | Family::Qwen2 | Family::Qwen3 => {}
        Family::SmolLm3 => {
            // llama.cpp `llama_model_smollm3`: every 4th layer is NoPE
            // (`n_no_rope_layer_step = 4`), whatever the checkpoint said.
            let layers: Vec<u8> = (0..n_layers).map(|l| u8::from((l + 1) % 4 != 0)).collect();
            c.insert("no_rope_layers".into(), json!(layers));
        }
        Family::Phi3 => {
            let rot = k.opt_u64("rope.dimension_count")?.unwrap_or(head_dim);
            if rot == 0 || rot > head_dim {
                bail!("{arch}.rope.dimension_count is {rot}; it must be in 1..={head_dim} (the head size)");
            }
            c.insert("partial_rotary_factor".into(), json!(rot as f64 / head_dim as f64));
            // llama.cpp turns Phi-3's sliding window off (`llama_model_phi3`).
            c.insert("sliding_window".into(), Value::Null);
            let original = k.opt_u64("rope.scaling.original_context_length")?;
            if let Some(o) = original {
                c.insert("original_max_position_embeddings".into(), json!(o));
            }
            let long = seen.contains_key("rope_factors_long.weight");
            let short = seen.contains_key("rope_factors_short.weight");
            if long != short {
                bail!("the GGUF has only one of rope_factors_long.weight and rope_factors_short.weight; LongRoPE needs both");
            }
            if long {
                if original.is_none() {
                    bail!("the GGUF has LongRoPE factors but no {arch}.rope.scaling.original_context_length");
                }
                let read = |name| rope_factors(files, seen, name, rot / 2, "LongRoPE");
                let (s, l) = (read("rope_factors_short.weight")?, read("rope_factors_long.weight")?);
                c.insert("rope_scaling".into(), json!({"type": "longrope", "short_factor": s, "long_factor": l}));
                consumed.extend(["rope_factors_short.weight".to_string(), "rope_factors_long.weight".to_string()]);
            }
        }
        Family::Qwen3Moe => {
            if experts == 0 {
                bail!("{arch}.expert_count is missing or 0; a qwen3moe model has experts");
            }
            // llama.cpp's qwen3moe graph always renormalizes the top-k weights.
            c.insert("norm_topk_prob".into(), json!(true));
            c.insert("decoder_sparse_step".into(), json!(1));
            c.insert("mlp_only_layers".into(), json!([]));
            c.insert("moe_intermediate_size".into(), json!(k.count("expert_feed_forward_length", 1 << 24)?));
        }
        Family::Gemma3 => {
            c.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            c.remove("hidden_act");
            // llama.cpp `llama_model_gemma3`: scores scaled by 1/√head_dim,
            // or 1/√(hidden/heads) for the 27B model (62 layers).
            let scalar = if n_layers == 62 { hidden / heads } else { head_dim };
            c.insert("query_pre_attn_scalar".into(), json!(scalar));
            if let Some(s) = k.opt_f32("final_logit_softcapping")?.filter(|s| *s != 0.0) {
                c.insert("final_logit_softcapping".into(), json!(s));
            }
            let window = k.opt_u64("attention.sliding_window")?.unwrap_or(0);
            // Local layers' RoPE base: the key, else llama.cpp's default (`rope_freq_base_train_swa`).
            c.insert("rope_local_base_freq".into(), json!(k.positive_f32("rope.freq_base_swa")?.unwrap_or(10000.0)));
            if window == 0 {
                c.insert("sliding_window".into(), Value::Null);
                c.insert("layer_types".into(), json!(vec!["full_attention"; n_layers as usize]));
            } else {
                c.insert("sliding_window".into(), json!(window));
                // llama.cpp `load_swa_pattern(ml, 6)`: a per-layer array, a
                // period, or every 6th layer global.
                let key = k.key("attention.sliding_window_pattern");
                let sliding: Vec<bool> = match g.get(&key) {
                    None => (0..n_layers).map(|l| l % 6 < 5).collect(),
                    Some(MetaValue::Array(MetaArray::Int(v))) if v.len() as u64 == n_layers => {
                        v.iter().map(|&x| x != 0).collect()
                    }
                    Some(v) => match v.as_u64() {
                        Some(0) => vec![true; n_layers as usize],
                        Some(n) => (0..n_layers).map(|l| l % n < n - 1).collect(),
                        None => bail!("metadata key {key:?} is {}, not a period or one flag per layer", v.kind()),
                    },
                };
                let types: Vec<&str> =
                    sliding.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
                c.insert("layer_types".into(), json!(types));
            }
        }
    }
    if experts > 0 {
        let used = k.count("expert_used_count", experts)?;
        let key = if family == Family::Llama { "num_local_experts" } else { "num_experts" };
        c.insert(key.into(), json!(experts));
        c.insert("num_experts_per_tok".into(), json!(used));
    }
    let map = tensor_map(
        family,
        n_layers as usize,
        seen,
        (heads * head_dim) as usize,
        (kv_heads * head_dim) as usize,
        ffn as usize,
        heads as usize,
        kv_heads as usize,
    );
    Ok(Built { config: Value::Object(c), map, consumed })
}

/// The layer of a `blk.N.*` tensor name.
fn layer_of(name: &str) -> Option<u64> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The Hugging Face name of each GGUF tensor of a dense model (the
/// experts are added once the config is parsed: [`super::GgufStore::map_experts`]).
#[allow(clippy::too_many_arguments)]
fn tensor_map(
    family: Family,
    n_layers: usize,
    seen: &HashMap<&str, usize>,
    q_rows: usize,
    kv_rows: usize,
    ffn: usize,
    heads: usize,
    kv_heads: usize,
) -> HashMap<String, Source> {
    let mut map = HashMap::new();
    // A mapping whose GGUF tensor is absent is kept too, so that a missing
    // tensor is named by its GGUF name.
    let mut put = |hf: String, gguf: String, rows: Rows| {
        let file = seen.get(gguf.as_str()).copied();
        map.insert(hf, Source { file, tensor: gguf, rows });
    };
    put("model.embed_tokens.weight".into(), "token_embd.weight".into(), Rows::All);
    put("model.norm.weight".into(), "output_norm.weight".into(), Rows::All);
    put("lm_head.weight".into(), "output.weight".into(), Rows::All);
    // llama.cpp's converter permutes the Q and K rows of the llama and
    // smollm3 architectures (`LlamaModel.permute`, `undo_permute`).
    let unpermute = matches!(family, Family::Llama | Family::SmolLm3);
    let norms: &[(&str, &str)] = match family {
        Family::Gemma3 => &[
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
        ],
        _ => &[
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
        ],
    };
    for l in 0..n_layers {
        let (hf, g) = (format!("model.layers.{l}"), format!("blk.{l}"));
        for (h, t) in norms {
            put(format!("{hf}.{h}.weight"), format!("{g}.{t}.weight"), Rows::All);
        }
        put(format!("{hf}.self_attn.o_proj.weight"), format!("{g}.attn_output.weight"), Rows::All);
        put(format!("{hf}.self_attn.o_proj.bias"), format!("{g}.attn_output.bias"), Rows::All);
        if family == Family::Phi3 {
            // The fused projections: query, key, value rows; gate, then up rows.
            let qkv = format!("{g}.attn_qkv.weight");
            for (name, row0, rows) in
                [("q_proj", 0, q_rows), ("k_proj", q_rows, kv_rows), ("v_proj", q_rows + kv_rows, kv_rows)]
            {
                put(format!("{hf}.self_attn.{name}.weight"), qkv.clone(), Rows::Range { row0, rows });
            }
            let up = format!("{g}.ffn_up.weight");
            put(format!("{hf}.mlp.gate_proj.weight"), up.clone(), Rows::Range { row0: 0, rows: ffn });
            put(format!("{hf}.mlp.up_proj.weight"), up, Rows::Range { row0: ffn, rows: ffn });
            put(format!("{hf}.mlp.down_proj.weight"), format!("{g}.ffn_down.weight"), Rows::All);
            continue;
        }
        for (h, t, n) in [("q_proj", "attn_q", heads), ("k_proj", "attn_k", kv_heads), ("v_proj", "attn_v", 0)] {
            let rows = if unpermute && n > 0 { Rows::Unpermute { heads: n } } else { Rows::All };
            put(format!("{hf}.self_attn.{h}.weight"), format!("{g}.{t}.weight"), rows);
            put(format!("{hf}.self_attn.{h}.bias"), format!("{g}.{t}.bias"), rows);
        }
        for (h, t) in [("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")] {
            put(format!("{hf}.mlp.{h}.weight"), format!("{g}.{t}.weight"), Rows::All);
            put(format!("{hf}.mlp.{h}.bias"), format!("{g}.{t}.bias"), Rows::All);
        }
    }
    map
}

/// Reads a 1-D F32 tensor of `n` positive RoPE factors (Phi-3's
/// `rope_factors_{short,long}`, Llama 3's `rope_freqs`).
///
/// # Errors
/// Another type or shape, a factor that is not a positive number (named), I/O.
fn rope_factors(files: &[GgufFile], seen: &HashMap<&str, usize>, name: &str, n: u64, what: &str) -> Result<Vec<f64>> {
    let f = &files[seen[name]];
    let t = f.tensor(name).expect("seen");
    if t.ggml != super::file::GgmlType::F32 || t.ne.len() != 1 || t.ne[0] != n {
        bail!(
            "tensor {name} is {} of shape {:?}; {what} factors are F32, one per rotated pair ({n})",
            t.ggml.name(),
            t.ne
        );
    }
    let mut b = vec![0u8; t.bytes as usize];
    f.read(t, 0, &mut b)?;
    let v: Vec<f64> = super::decode_floats(t.ggml, &b).into_iter().map(f64::from).collect();
    if let Some(x) = v.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
        bail!("tensor {name} holds {x}; {what} factors are positive: the file is corrupt");
    }
    Ok(v)
}

/// The Hugging Face `rope_scaling` (`llama3`) whose per-frequency divisors
/// are `factors` (`[head_dim / 2]`, llama.cpp's `rope_freqs.weight`), or
/// `None` when every divisor is 1.
///
/// llama.cpp's converter (`conversion/llama.py`, `generate_extra_tensors`)
/// stores `1 / ((1 − s) / factor + s)` per frequency `f`, with the
/// smoothing `s = (L·f/2π − low) / (high − low)` clamped to [0, 1] (`L` the
/// pretrained context), and drops the parameters. `factor` is the largest
/// divisor; `s` is linear in `f`, so two frequencies inside the band give
/// its slope and intercept, and with `L` (the
/// `rope.scaling.original_context_length` key, which the converter does not
/// write) the two band edges `low` and `high`; without the key, `low` is
/// taken as 1 (as in every Llama 3.x), which gives `L` (8192 for Llama 3.x). These
/// are rounded to 1/64 where that is within 1e-4 (the converter computes in
/// f32), and the divisors they give must match the file's within 1e-5
/// (relative), so the pack's RoPE is the file's. With fewer than two
/// frequencies inside the band, the converter's defaults (`low` 1, `high` 4)
/// are taken if they reproduce the divisors.
///
/// # Errors
/// Divisors that no `llama3` setting reproduces (say which).
fn llama3_from_factors(factors: &[f64], theta: f64, head_dim: u64, original: Option<u64>) -> Result<Option<Value>> {
    let factor = factors.iter().copied().fold(1.0, f64::max);
    if factors.iter().all(|&r| r == 1.0) {
        return Ok(None);
    }
    const REFUSE: &str =
        "nflash reads the rope_freqs of Llama 3.1-style models only: convert the Hugging Face checkpoint";
    if let Some((i, r)) = factors.iter().enumerate().find(|(_, &r)| r < 1.0) {
        bail!("rope_freqs.weight[{i}] is {r}, below 1: Llama 3 RoPE scaling only divides frequencies by 1 or more; {REFUSE}");
    }
    if let Some(i) = factors.windows(2).position(|w| w[1] < w[0]) {
        bail!(
            "rope_freqs.weight[{}] is {}, below the divisor before it ({}): Llama 3 RoPE scaling divides lower frequencies by as much or more; {REFUSE}",
            i + 1,
            factors[i + 1],
            factors[i]
        );
    }
    let near = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b;
    let inv_freq: Vec<f64> = (0..factors.len()).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
    // The smoothing of each frequency strictly inside the band.
    let band: Vec<(f64, f64)> = factors
        .iter()
        .zip(&inv_freq)
        .filter(|(&r, _)| !near(r, 1.0) && !near(r, factor))
        .map(|(&r, &f)| (f, (1.0 / r - 1.0 / factor) / (1.0 - 1.0 / factor)))
        .collect();
    let two_pi = 2.0 * std::f64::consts::PI;
    let snap = |x: f64| {
        let g = (x * 64.0).round() / 64.0;
        if (x - g).abs() <= 1e-4 * x.abs().max(1.0) {
            g
        } else {
            x
        }
    };
    // Candidate (original context, low, high), first match wins.
    let mut candidates: Vec<(u64, f64, f64)> = Vec::new();
    if band.len() >= 2 {
        // Least squares of s = a·f + b, where s = L·f / (2π(high − low)) −
        // low / (high − low): only the slope and the intercept are in the
        // file. Without the key, take low = 1 (as every Llama 3.x), which gives L.
        let n = band.len() as f64;
        let (mf, ms) = (band.iter().map(|p| p.0).sum::<f64>() / n, band.iter().map(|p| p.1).sum::<f64>() / n);
        let sxy: f64 = band.iter().map(|(f, s)| (f - mf) * (s - ms)).sum();
        let sxx: f64 = band.iter().map(|(f, _)| (f - mf) * (f - mf)).sum();
        let a = sxy / sxx;
        let b = ms - a * mf;
        let old = original.unwrap_or_else(|| {
            let l = (two_pi * a / -b).round();
            if l.is_finite() && (1.0..=MAX_CONTEXT as f64).contains(&l) {
                l as u64
            } else {
                8192
            }
        });
        let width = old as f64 / (two_pi * a);
        let low = -b * width;
        candidates.push((old, snap(low), snap(low + width)));
    } else {
        // One frequency or none inside the band: llama.cpp's converter's
        // defaults (low 1, high 4) with the key's context, else the one the
        // banded frequency gives, else 8192, else a power of two.
        let mut ls: Vec<u64> = original.into_iter().collect();
        if let Some(&(f, s)) = band.first() {
            ls.push((two_pi * (3.0 * s + 1.0) / f).round().clamp(1.0, MAX_CONTEXT as f64) as u64);
        }
        ls.push(8192);
        ls.extend((4..=20).map(|k| 1u64 << k));
        candidates.extend(ls.into_iter().map(|l| (l, 1.0, 4.0)));
    }
    let fits = |&(old, low, high): &(u64, f64, f64)| {
        let scaling = nflash_format::RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: old,
        };
        low.is_finite()
            && high.is_finite()
            && low > 0.0
            && low < high
            && factors.iter().zip(&inv_freq).all(|(&r, &f)| near(f / scaling.llama3_inv_freq(f), r))
    };
    let Some((old, low, high)) = candidates.iter().copied().find(fits) else {
        bail!(
            "rope_freqs.weight holds divisors from 1 to {factor} that no Llama 3 RoPE scaling gives (the band between them must follow Llama 3's smoothing){}; {REFUSE}",
            original.map_or(String::new(), |o| format!(" with the original context {o} of rope.scaling.original_context_length"))
        );
    };
    Ok(Some(json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rope_freqs` as llama.cpp's converter computes it, in f32
    /// (`conversion/llama.py`, `generate_extra_tensors`).
    fn converter_factors(theta: f32, dim: usize, factor: f32, low: f32, high: f32, old: f32) -> Vec<f64> {
        (0..dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf((2 * i) as f32 / dim as f32);
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                let r = if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                f64::from(r)
            })
            .collect()
    }

    #[test]
    fn llama3_scaling_is_recovered_from_rope_freqs() {
        // Llama 3.1 8B (head_dim 128, factor 8), Llama 3.2 1B (head_dim 64,
        // factor 32), a made-up one with other band edges and L given by the key.
        for (theta, dim, factor, low, high, old, key) in [
            (500000.0, 128, 8.0, 1.0, 4.0, 8192.0, None),
            (500000.0, 64, 32.0, 1.0, 4.0, 8192.0, None),
            (10000.0, 16, 8.0, 1.0, 4.0, 64.0, None),
            (1e6, 128, 16.0, 2.0, 8.0, 32768.0, Some(32768)),
        ] {
            let f = converter_factors(theta, dim, factor, low, high, old);
            let v = llama3_from_factors(&f, f64::from(theta), dim as u64, key).unwrap().unwrap();
            assert_eq!(
                v,
                json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                       "original_max_position_embeddings": old as u64}),
                "{theta} {dim}"
            );
        }
    }

    #[test]
    fn rope_freqs_that_are_not_llama3_are_refused() {
        let good = converter_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(llama3_from_factors(&vec![1.0; 64], 500000.0, 128, None).unwrap(), None);
        // One divisor inside the band moved by 0.1%.
        let i = good.iter().position(|&r| r > 1.0 && r < 8.0).unwrap() + 1;
        let mut bent = good.clone();
        bent[i] *= 1.001;
        let e = llama3_from_factors(&bent, 500000.0, 128, None).unwrap_err().to_string();
        assert!(e.contains("no Llama 3 RoPE scaling") && e.contains("Hugging Face checkpoint"), "{e}");
        // Not monotone: a high frequency divided, a low one kept.
        let mut swapped = good;
        swapped.swap(0, 63);
        assert!(llama3_from_factors(&swapped, 500000.0, 128, None).is_err());
        // Divisors below 1 (llama3 only slows rotation down), named.
        let e = llama3_from_factors(&[1.0, 0.5, 1.0, 1.0], 10000.0, 8, None).unwrap_err().to_string();
        assert!(e.contains("rope_freqs.weight[1] is 0.5"), "{e}");
        // One frequency inside the band and a context other than 8192: found.
        let f = converter_factors(10000.0, 16, 8.0, 1.0, 4.0, 4096.0);
        assert_eq!(f.iter().filter(|&&r| r > 1.0 && r < 8.0).count(), 1);
        let v = llama3_from_factors(&f, 10000.0, 16, None).unwrap().unwrap();
        assert_eq!(v["original_max_position_embeddings"], 4096);
    }
}
