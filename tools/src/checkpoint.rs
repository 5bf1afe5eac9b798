//! Reading a Hugging Face checkpoint directory: config.json,
//! generation_config.json, single or sharded safetensors (BF16/F16/F32),
//! tokenizer.json and tokenizer_config.json.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use nflash_format::{Activation, Architecture, Gemma3, LayerSet, ModelConfig, Moe, Phi3, RopeScaling, MAX_EXPERTS};
use safetensors::tensor::Metadata;
use safetensors::Dtype;
use serde_json::Value;

struct Shard {
    path: PathBuf,
    /// Tensor data is read with `pread`, so a 7B checkpoint streamed through
    /// prep never counts towards its resident memory.
    file: File,
    data_start: usize,
    meta: Metadata,
}

/// An opened checkpoint. Tensors are read lazily, one at a time.
pub struct Checkpoint {
    /// Checkpoint directory.
    pub dir: PathBuf,
    /// Parsed hyper-parameters.
    pub config: ModelConfig,
    /// `tokenizer.json` bytes.
    pub tokenizer_json: Vec<u8>,
    /// `tokenizer_config.json`, or `Null` when absent.
    pub tokenizer_config: Value,
    /// Keys config.json lacks and the transformers class defaults used for
    /// them ([`class_defaults_used`]).
    pub defaults_used: Vec<(String, Value)>,
    /// Sampling defaults from `generation_config.json` (SPEC §4.9).
    pub generation: nflash_format::GenerationDefaults,
    store: Store,
    /// Whether the norm weights are stored as `w` for a norm that scales
    /// by `1 + w` (Gemma 3 safetensors): they are read as `1 + w` (SPEC §4.3).
    norms_plus_one: bool,
}

/// Where a checkpoint's tensors are stored.
enum Store {
    /// Hugging Face safetensors (one file or shards).
    Safetensors(Safetensors),
    /// A GGUF file (llama.cpp), its tensors under Hugging Face names.
    Gguf(crate::gguf::GgufStore),
}

/// The safetensors shards of a Hugging Face checkpoint directory.
struct Safetensors {
    dir: PathBuf,
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
    /// Tensors a shard holds but the index's weight_map does not list.
    unlisted: HashMap<String, usize>,
    /// Tensors the model reads that the checkpoint stores as rows of a
    /// fused one (Phi-3's `qkv_proj` and `gate_up_proj`), by name.
    views: HashMap<String, RowView>,
    /// The checkpoint's name of each tensor nflash names otherwise (the
    /// language model of a [`GEMMA3_MM`] checkpoint: [`gemma3_mm_name`]).
    aliases: HashMap<String, String>,
}

/// Rows `row0 .. row0 + rows` of the fused 2-D tensor `fused` (`[fused_rows, cols]`).
struct RowView {
    fused: String,
    row0: usize,
    rows: usize,
    fused_rows: usize,
    cols: usize,
}

/// Phi-3's split of its fused projections (HF `Phi3Attention.qkv_proj`:
/// query, key, value rows in that order; `Phi3MLP.gate_up_proj`: gate rows,
/// then up rows, as its `chunk(2)` reads them): the q/k/v and gate/up
/// projection names nflash stores, each a view of the fused tensor.
fn phi3_views(c: &ModelConfig) -> HashMap<String, RowView> {
    let (qd, kvd) = ((c.num_heads * c.head_dim) as usize, (c.num_kv_heads * c.head_dim) as usize);
    let (inter, h) = (c.intermediate_size as usize, c.hidden_size as usize);
    let mut v = HashMap::new();
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        let qkv = format!("{p}.self_attn.qkv_proj.weight");
        for (name, row0, rows) in [("q_proj", 0, qd), ("k_proj", qd, kvd), ("v_proj", qd + kvd, kvd)] {
            let view = RowView { fused: qkv.clone(), row0, rows, fused_rows: qd + 2 * kvd, cols: h };
            v.insert(format!("{p}.self_attn.{name}.weight"), view);
        }
        let gate_up = format!("{p}.mlp.gate_up_proj.weight");
        for (name, row0) in [("gate_proj", 0), ("up_proj", inter)] {
            let view = RowView { fused: gate_up.clone(), row0, rows: inter, fused_rows: 2 * inter, cols: h };
            v.insert(format!("{p}.mlp.{name}.weight"), view);
        }
    }
    v
}

/// Reads and parses a JSON file; errors name the file.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

fn get_u64(cfg: &Value, key: &str) -> Result<Option<u64>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            v.as_u64().map(Some).ok_or_else(|| anyhow!("config.json: {key} = {v} is not a non-negative integer"))
        }
    }
}

fn req_u64(cfg: &Value, key: &str) -> Result<u64> {
    get_u64(cfg, key)?.ok_or_else(|| anyhow!("config.json has no {key}; it is required"))
}

fn get_f64(cfg: &Value, key: &str) -> Result<Option<f64>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| anyhow!("config.json: {key} = {v} is not a number")),
    }
}

fn get_bool(cfg: &Value, key: &str, default: bool) -> Result<bool> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_bool().ok_or_else(|| anyhow!("config.json: {key} = {v} is not a boolean")),
    }
}

/// Token ids from an `eos_token_id` value: an integer or a list of them.
pub fn token_ids(v: Option<&Value>, what: &str) -> Result<Vec<u32>> {
    let as_id = |v: &Value| {
        v.as_u64()
            .filter(|&x| x <= u32::MAX as u64)
            .map(|x| x as u32)
            .ok_or_else(|| anyhow!("{what}: {v} is not a token id"))
    };
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

/// HF class of SmolLM3 checkpoints: Llama with NoPE layers.
pub const SMOLLM3: &str = "SmolLM3ForCausalLM";

/// HF class of Phi-3 checkpoints (Phi-3, Phi-3.5-mini, Phi-4-mini).
pub const PHI3: &str = "Phi3ForCausalLM";

/// HF class of text-only Gemma 3 checkpoints (270M, 1B).
pub const GEMMA3: &str = "Gemma3ForCausalLM";

/// HF class of the image-and-text Gemma 3 checkpoints (4B and up): a
/// `text_config` for the language model, whose weights nflash converts,
/// and a vision tower it skips.
pub const GEMMA3_MM: &str = "Gemma3ForConditionalGeneration";

/// The config of the language model a `config.json` describes: for
/// [`GEMMA3_MM`], its `text_config` as a [`GEMMA3`] config, with the top
/// level's `bos_token_id`, `eos_token_id` and `tie_word_embeddings` where
/// the text config lacks them; otherwise `cfg` itself.
///
/// # Errors
/// A [`GEMMA3_MM`] config without a `text_config` object.
pub fn language_model_config(cfg: &Value) -> Result<Value> {
    if arch_of(cfg) != GEMMA3_MM {
        return Ok(cfg.clone());
    }
    let mut text = cfg.get("text_config").filter(|t| t.is_object()).cloned().ok_or_else(|| {
        anyhow!("config.json: {GEMMA3_MM} without a text_config object; the language model's settings are there")
    })?;
    let obj = text.as_object_mut().expect("an object");
    obj.insert("architectures".into(), serde_json::json!([GEMMA3]));
    for k in ["bos_token_id", "eos_token_id", "tie_word_embeddings"] {
        if let (false, Some(v)) = (obj.contains_key(k), cfg.get(k)) {
            obj.insert(k.into(), v.clone());
        }
    }
    Ok(text)
}

/// `architectures[0]` of a config, or "" when it has none.
fn arch_of(cfg: &Value) -> &str {
    cfg.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).unwrap_or_default()
}

/// The name nflash gives (SPEC §4.3) to tensor `stored` of a
/// [`GEMMA3_MM`] checkpoint: `model.*` for `language_model.model.*`
/// (transformers before 4.52) or `model.language_model.*` (later), and
/// `lm_head.*` for `language_model.lm_head.*`. `None` for a tensor of the
/// vision tower or the projector.
fn gemma3_mm_name(stored: &str) -> Option<String> {
    for (from, to) in [
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ] {
        if let Some(rest) = stored.strip_prefix(from) {
            return Some(format!("{to}{rest}"));
        }
    }
    None
}

/// Gemma 3's sliding-window layers (SPEC §4.1): from `layer_types`
/// (`"sliding_attention"` or `"full_attention"` per layer), else every
/// layer but each `sliding_window_pattern`-th (`(l + 1) % pattern != 0`),
/// as transformers' `Gemma3TextConfig` does.
///
/// # Errors
/// A `layer_types` list of the wrong length or with another entry, a
/// pattern of 0.
fn gemma3_sliding_layers(cfg: &Value, n_layers: u64) -> Result<LayerSet> {
    match cfg.get("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() as u64 != n_layers {
                bail!("config.json: layer_types has {} entries, but the model has {n_layers} layers (num_hidden_layers); it needs \"sliding_attention\" or \"full_attention\" for each", a.len());
            }
            let mut sliding = Vec::with_capacity(a.len());
            for (l, v) in a.iter().enumerate() {
                match v.as_str() {
                    Some("sliding_attention") => sliding.push(true),
                    Some("full_attention") => sliding.push(false),
                    _ => bail!("config.json: layer_types[{l}] = {v}; each entry is \"sliding_attention\" or \"full_attention\""),
                }
            }
            Ok(LayerSet::from_fn(n_layers, |l| sliding[l]))
        }
        None | Some(Value::Null) => {
            let every = req_u64(cfg, "sliding_window_pattern")?;
            if every == 0 {
                bail!("config.json: sliding_window_pattern is 0; every sliding_window_pattern-th layer is global (Gemma 3 uses 6)");
            }
            Ok(LayerSet::from_fn(n_layers, |l| !(l as u64 + 1).is_multiple_of(every)))
        }
        Some(v) => {
            bail!("config.json: layer_types = {v} is not a list of \"sliding_attention\" and \"full_attention\"")
        }
    }
}

/// The defaults of transformers' config class `arch_name` for the keys
/// nflash reads, where a checkpoint's config.json may omit them: the
/// class's `__init__` signature (`Qwen3Config`, `SmolLM3Config`,
/// `Phi3Config`, `Gemma3TextConfig`). For the
/// other classes only `hidden_act` (`silu` in each); their other keys are
/// required. Keys present in config.json, even as `null`, are kept.
fn class_defaults(arch_name: &str) -> Vec<(&'static str, Value)> {
    use serde_json::json;
    match arch_name {
        "Qwen3ForCausalLM" => vec![
            ("vocab_size", json!(151936)),
            ("hidden_size", json!(4096)),
            ("intermediate_size", json!(22016)),
            ("num_hidden_layers", json!(32)),
            ("num_attention_heads", json!(32)),
            ("num_key_value_heads", json!(32)),
            ("head_dim", json!(128)),
            ("hidden_act", json!("silu")),
            ("max_position_embeddings", json!(32768)),
            ("rms_norm_eps", json!(1e-6)),
            ("tie_word_embeddings", json!(false)),
            ("rope_theta", json!(10000.0)),
            ("attention_bias", json!(false)),
            ("use_sliding_window", json!(false)),
        ],
        SMOLLM3 => vec![
            ("vocab_size", json!(128256)),
            ("hidden_size", json!(2048)),
            ("intermediate_size", json!(11008)),
            ("num_hidden_layers", json!(36)),
            ("num_attention_heads", json!(16)),
            ("num_key_value_heads", json!(4)),
            ("hidden_act", json!("silu")),
            ("max_position_embeddings", json!(32768)),
            ("rms_norm_eps", json!(1e-6)),
            ("bos_token_id", json!(128000)),
            ("eos_token_id", json!(128001)),
            ("rope_theta", json!(2000000.0)),
            ("use_sliding_window", json!(false)),
            ("no_rope_layer_interval", json!(4)),
            ("attention_bias", json!(false)),
            ("mlp_bias", json!(false)),
            ("tie_word_embeddings", json!(true)),
        ],
        PHI3 => vec![
            ("vocab_size", json!(32064)),
            ("hidden_size", json!(3072)),
            ("intermediate_size", json!(8192)),
            ("num_hidden_layers", json!(32)),
            ("num_attention_heads", json!(32)),
            ("hidden_act", json!("silu")),
            ("max_position_embeddings", json!(4096)),
            ("rms_norm_eps", json!(1e-5)),
            ("rope_theta", json!(10000.0)),
            ("partial_rotary_factor", json!(1.0)),
            ("bos_token_id", json!(1)),
            ("eos_token_id", json!(32000)),
            ("tie_word_embeddings", json!(false)),
        ],
        GEMMA3 => vec![
            ("vocab_size", json!(262208)),
            ("hidden_size", json!(2304)),
            ("intermediate_size", json!(9216)),
            ("num_hidden_layers", json!(26)),
            ("num_attention_heads", json!(8)),
            ("num_key_value_heads", json!(4)),
            ("head_dim", json!(256)),
            ("hidden_activation", json!("gelu_pytorch_tanh")),
            ("max_position_embeddings", json!(131072)),
            ("rms_norm_eps", json!(1e-6)),
            ("eos_token_id", json!(1)),
            ("bos_token_id", json!(2)),
            ("tie_word_embeddings", json!(true)),
            ("rope_theta", json!(1000000.0)),
            ("attention_bias", json!(false)),
            ("query_pre_attn_scalar", json!(256)),
            ("sliding_window", json!(4096)),
            ("rope_local_base_freq", json!(10000.0)),
            ("sliding_window_pattern", json!(6)),
        ],
        _ => vec![("hidden_act", json!("silu"))],
    }
}

/// Phi-3's rotated elements per head: `⌊head_dim · partial_rotary_factor⌋`
/// (HF `Phi3Attention.rotary_ndims`), which must be even and at least 2.
///
/// # Errors
/// A factor outside (0, 1] or a rotated width RoPE cannot pair up.
fn phi3_rotary_dim(cfg: &Value, head_dim: u64) -> Result<u64> {
    let f = get_f64(cfg, "partial_rotary_factor")?.unwrap_or(1.0);
    if !(f > 0.0 && f <= 1.0) {
        bail!("config.json: partial_rotary_factor = {f}; it is the share of each head RoPE rotates, in (0, 1]");
    }
    let rot = (head_dim as f64 * f) as u64;
    if rot < 2 || !rot.is_multiple_of(2) {
        bail!("config.json: partial_rotary_factor {f} of head_dim {head_dim} rotates {rot} elements; RoPE needs an even number, at least 2");
    }
    Ok(rot)
}

/// `cfg` with the RoPE settings of configs saved by transformers 5, which
/// keeps them in `rope_parameters`, where the top level lacks them:
/// `rope_theta`, `partial_rotary_factor` and, where its `rope_type` is not
/// `default`, the scaling (read as `rope_scaling`).
fn with_rope_parameters(cfg: &Value) -> Value {
    let mut cfg = cfg.clone();
    if let Some(obj) = cfg.as_object_mut() {
        // Gemma 3 keeps one set per layer type: the global layers' is the
        // model's, the sliding layers' base is `rope_local_base_freq`, and
        // a scaling of theirs is kept to be refused.
        let per_type = obj.get("rope_parameters").and_then(|rp| rp.get("sliding_attention")).cloned();
        if let Some(local) = per_type {
            if let (false, Some(v)) = (obj.contains_key("rope_local_base_freq"), local.get("rope_theta")) {
                obj.insert("rope_local_base_freq".into(), v.clone());
            }
            let kind = local.get("rope_type").or_else(|| local.get("type")).and_then(Value::as_str);
            if kind.is_some_and(|k| k != "default") {
                obj.insert("rope_parameters.sliding_attention".into(), local);
            }
            let global = obj["rope_parameters"].get("full_attention").cloned().unwrap_or(Value::Null);
            obj.insert("rope_parameters".into(), global);
        }
        if let Some(rp) = obj.get("rope_parameters").filter(|v| v.is_object()).cloned() {
            for k in ["rope_theta", "partial_rotary_factor"] {
                if let (false, Some(v)) = (obj.contains_key(k), rp.get(k)) {
                    obj.insert(k.into(), v.clone());
                }
            }
            let kind = rp.get("rope_type").or_else(|| rp.get("type")).and_then(Value::as_str);
            if kind.is_some_and(|k| k != "default") && obj.get("rope_scaling").is_none_or(Value::is_null) {
                obj.insert("rope_scaling".into(), rp);
            }
        }
    }
    cfg
}

/// [`with_rope_parameters`], then the keys still missing filled from
/// [`class_defaults`].
fn with_class_defaults(cfg: &Value, arch_name: &str) -> Value {
    let mut cfg = with_rope_parameters(cfg);
    if let Some(obj) = cfg.as_object_mut() {
        for (k, v) in class_defaults(arch_name) {
            if takes_default(obj.get(k), k) {
                obj.insert(k.into(), v);
            }
        }
    }
    cfg
}

/// Whether config key `k` with value `v` takes the class default: absent,
/// or `null` where null means nothing of its own (a null `sliding_window`,
/// `rope_scaling`, `head_dim` or token id does: no window, no scaling,
/// `hidden_size / num_attention_heads`, none).
fn takes_default(v: Option<&Value>, k: &str) -> bool {
    const NULL_MEANS_SOMETHING: [&str; 6] =
        ["sliding_window", "rope_scaling", "head_dim", "bos_token_id", "eos_token_id", "layer_types"];
    match v {
        None => true,
        Some(Value::Null) => !NULL_MEANS_SOMETHING.contains(&k),
        Some(_) => false,
    }
}

/// The keys of `config.json` that nflash reads but the file lacks (also in
/// `rope_parameters`), with the default of transformers' config class for
/// `architectures[0]` it uses instead ([`class_defaults`]; not the
/// `hidden_act` of classes with no other defaults), for `prep convert` to say.
pub fn class_defaults_used(cfg: &Value) -> Vec<(String, Value)> {
    let defaults = class_defaults(arch_of(cfg));
    if defaults.len() <= 1 {
        return Vec::new();
    }
    let given = with_rope_parameters(cfg);
    defaults.into_iter().filter(|(k, _)| takes_default(given.get(k), k)).map(|(k, v)| (k.to_string(), v)).collect()
}

/// SmolLM3's RoPE layers (SPEC §4.1): `no_rope_layers[l]` = 1 means layer
/// `l` uses RoPE, 0 that it is a NoPE layer; without that list, every
/// `no_rope_layer_interval`-th layer is NoPE (`(l + 1) % interval == 0`),
/// as transformers' `SmolLM3Config` does.
///
/// # Errors
/// A list shorter than the model or with entries other than 0 and 1, an
/// interval of 0.
fn smollm3_rope_layers(cfg: &Value, n_layers: u64) -> Result<LayerSet> {
    match cfg.get("no_rope_layers") {
        Some(Value::Array(a)) => {
            if (a.len() as u64) < n_layers {
                bail!("config.json: no_rope_layers has {} entries, but the model has {n_layers} layers (num_hidden_layers); it needs a 0 (NoPE) or 1 (RoPE) for every layer", a.len());
            }
            let mut flags = Vec::with_capacity(n_layers as usize);
            for (l, v) in a.iter().take(n_layers as usize).enumerate() {
                match v.as_u64() {
                    Some(f @ (0 | 1)) => flags.push(f == 1),
                    _ => {
                        bail!("config.json: no_rope_layers[{l}] = {v}; each entry is 0 (NoPE layer) or 1 (RoPE layer)")
                    }
                }
            }
            Ok(LayerSet::from_fn(n_layers, |l| flags[l]))
        }
        None | Some(Value::Null) => {
            let every = req_u64(cfg, "no_rope_layer_interval")?;
            if every == 0 {
                bail!(
                    "config.json: no_rope_layer_interval is 0; it is the distance between NoPE layers (SmolLM3 uses 4)"
                );
            }
            Ok(LayerSet::from_fn(n_layers, |l| !(l as u64 + 1).is_multiple_of(every)))
        }
        Some(v) => bail!("config.json: no_rope_layers = {v} is not a list of 0 and 1 per layer"),
    }
}

fn rope_scaling(cfg: &Value) -> Result<Option<RopeScaling>> {
    let Some(rs) = cfg.get("rope_scaling").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = rs
        .get("rope_type")
        .or_else(|| rs.get("type"))
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("config.json: rope_scaling has no \"type\" or \"rope_type\""))?;
    let num = |k: &str| -> Result<f64> {
        rs.get(k)
            .and_then(Value::as_f64)
            .ok_or_else(|| anyhow!("config.json: rope_scaling ({kind}) needs a number {k}"))
    };
    let count = |k: &str| -> Result<u64> {
        rs.get(k)
            .and_then(Value::as_u64)
            .ok_or_else(|| anyhow!("config.json: rope_scaling ({kind}) needs a positive integer {k}"))
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear { factor: num("factor")? })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: count("original_max_position_embeddings")?,
        })),
        "longrope" | "su" => longrope(cfg, rs).map(Some),
        other => {
            bail!("config.json: rope_scaling type {other:?} is not supported; supported: linear, llama3, longrope")
        }
    }
}

/// LongRoPE settings as transformers' `_compute_longrope_parameters` reads
/// them: `short_factor` and `long_factor` lists; the pretrained context
/// from `original_max_position_embeddings` (in `rope_scaling`, else at the
/// top level, as Phi-3 keeps it); the attention factor from
/// `rope_scaling.attention_factor`, else `√(1 + ln s / ln original)` with
/// `s = max_position_embeddings / original` (1 when `s ≤ 1`).
///
/// # Errors
/// A missing or malformed factor list or context, naming the key.
fn longrope(cfg: &Value, rs: &Value) -> Result<RopeScaling> {
    let factors = |k: &str| -> Result<Vec<f32>> {
        let list = rs
            .get(k)
            .and_then(Value::as_array)
            .ok_or_else(|| anyhow!("config.json: rope_scaling (longrope) needs a list of numbers {k}"))?;
        list.iter()
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0 && *x <= f64::from(f32::MAX))
                    .map(|x| x as f32)
                    .ok_or_else(|| anyhow!("config.json: rope_scaling.{k} holds {v}; each factor is a positive number"))
            })
            .collect()
    };
    let inner = match rs.get("original_max_position_embeddings").filter(|v| !v.is_null()) {
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            anyhow!("config.json: rope_scaling.original_max_position_embeddings = {v} is not a positive integer")
        })?),
        None => None,
    };
    let original = match (inner, get_u64(cfg, "original_max_position_embeddings")?) {
        (Some(a), Some(b)) if a != b => bail!(
            "config.json: original_max_position_embeddings is {b}, but rope_scaling.original_max_position_embeddings is {a}; keep one, the pretrained context"
        ),
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => bail!(
            "config.json: rope_scaling (longrope) needs original_max_position_embeddings, the pretrained context"
        ),
    };
    if original == 0 {
        bail!("config.json: original_max_position_embeddings is 0");
    }
    let attention_factor = match rs.get("attention_factor").filter(|v| !v.is_null()) {
        Some(v) => {
            v.as_f64().ok_or_else(|| anyhow!("config.json: rope_scaling.attention_factor = {v} is not a number"))?
        }
        None => {
            let max = get_u64(cfg, "max_position_embeddings")?.unwrap_or(original);
            let s = max as f64 / original as f64;
            if s <= 1.0 {
                1.0
            } else {
                (1.0 + s.ln() / (original as f64).ln()).sqrt()
            }
        }
    };
    Ok(RopeScaling::LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

/// Sampling defaults from `generation_config.json`: `temperature`, `top_p`
/// and `top_k` where set; `do_sample: false` means greedy (temperature 0),
/// as Hugging Face `generate` does.
///
/// # Errors
/// A value of the wrong type or out of range, naming the key.
pub fn generation_defaults(g: &Value) -> Result<nflash_format::GenerationDefaults> {
    if !g.is_object() {
        bail!("generation_config.json is not a JSON object; fix or remove the file");
    }
    // Numbers an f32 holds: 1e300 would become infinity.
    let num = |k: &str| -> Result<Option<f32>> {
        match g.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x.abs() <= f64::from(f32::MAX) => Ok(Some(x as f32)),
                _ => bail!("generation_config.json: {k} = {v} is not a number in range; fix or remove the key"),
            },
        }
    };
    let mut d = nflash_format::GenerationDefaults {
        temperature: num("temperature")?,
        top_p: num("top_p")?,
        top_k: match g.get("top_k") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|&k| k <= u32::MAX as u64).ok_or_else(|| {
                anyhow!("generation_config.json: top_k = {v} is not a non-negative integer; fix or remove the key")
            })? as u32),
        },
    };
    match g.get("do_sample") {
        None | Some(Value::Null) | Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => d.temperature = Some(0.0),
        Some(v) => bail!("generation_config.json: do_sample = {v} is not true or false; fix or remove the key"),
    }
    d.check().map_err(|e| anyhow!("generation_config.json: {e}; fix or remove the key"))?;
    Ok(d)
}

/// HF class of TurboSparse / Bamboo checkpoints: Mistral attention, dReLU FFN
/// (`relu(gate·x) · relu(up·x)`, TurboSparse arXiv 2406.05955).
pub const BAMBOO: &str = "BambooForCausalLM";

/// HF class of TurboSparse-Mixtral checkpoints (TurboSparse arXiv
/// 2406.05955): Mixtral with dReLU experts. Read as Mixtral: the keys
/// `num_local_experts`, `num_experts_per_tok` and `hidden_act` (`"relu"`,
/// which means dReLU for this class, or `"drelu"`), and the Mixtral tensor
/// names (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`).
/// Other tensors the checkpoint holds (its own activation predictors) are
/// not read: prep builds its own from the profile.
pub const TURBOSPARSE_MIXTRAL: &str = "TurboSparseMixtralForCausalLM";

/// Mixture-of-experts settings of `config.json` for the HF class `arch_name`
/// (`None` for a dense class): Mixtral `num_local_experts`,
/// `num_experts_per_tok` (top-k weights always renormalized); Qwen3-MoE
/// `num_experts`, `num_experts_per_tok`, `norm_topk_prob` (default false, as
/// transformers' `Qwen3MoeConfig`), with every layer a mixture
/// (`decoder_sparse_step` 1, `mlp_only_layers` empty).
///
/// # Errors
/// A missing or malformed key, a top-k above the expert count, a layout
/// of dense and mixture layers nflash does not run.
fn parse_moe(cfg: &Value, arch_name: &str) -> Result<Option<Architecture>> {
    let routing = |experts_key: &str, norm: bool| -> Result<Moe> {
        let experts = req_u64(cfg, experts_key)?;
        let top_k = req_u64(cfg, "num_experts_per_tok")?;
        if experts == 0 || experts > u64::from(MAX_EXPERTS) {
            bail!("config.json: {experts_key} = {experts}; supported: 1 to {MAX_EXPERTS} experts per layer");
        }
        if top_k == 0 || top_k > experts {
            bail!("config.json: num_experts_per_tok = {top_k}, but a layer has {experts} experts ({experts_key}); a token is routed to between 1 and {experts} of them: fix the config");
        }
        Ok(Moe { num_experts: experts as u32, experts_per_token: top_k as u32, norm_topk_prob: norm })
    };
    match arch_name {
        "MixtralForCausalLM" | TURBOSPARSE_MIXTRAL => {
            Ok(Some(Architecture::Mixtral(routing("num_local_experts", true)?)))
        }
        "Qwen3MoeForCausalLM" => {
            let step = get_u64(cfg, "decoder_sparse_step")?.unwrap_or(1);
            let dense_layers = match cfg.get("mlp_only_layers") {
                None | Some(Value::Null) => 0,
                Some(Value::Array(a)) => a.len(),
                Some(v) => bail!("config.json: mlp_only_layers = {v} is not a list of layer indices"),
            };
            if step != 1 || dense_layers != 0 {
                bail!("config.json: decoder_sparse_step = {step} with {dense_layers} mlp_only_layers: nflash runs Qwen3-MoE models whose every layer is a mixture of experts (decoder_sparse_step 1, mlp_only_layers [])");
            }
            if get_bool(cfg, "use_sliding_window", false)? {
                bail!(
                    "config.json: use_sliding_window is true; sliding-window attention is not supported for Qwen3-MoE"
                );
            }
            Ok(Some(Architecture::Qwen3Moe(routing("num_experts", get_bool(cfg, "norm_topk_prob", false)?)?)))
        }
        _ => Ok(None),
    }
}

/// Refuses `rope_parameters` (transformers 5) that do not describe RoPE:
/// not an object, a per-layer-type entry (`full_attention`,
/// `sliding_attention`) that is not one, a `rope_type` that is not a
/// string, or a scaling factor without a `rope_type`, each named by its key
/// path (as `rope_scaling` at the top level is refused).
///
/// # Errors
/// The first malformed entry.
fn check_rope_parameters(cfg: &Value) -> Result<()> {
    let Some(rp) = cfg.get("rope_parameters").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    if !rp.is_object() {
        bail!("config.json: rope_parameters = {rp} is not an object of RoPE settings (rope_type, rope_theta, …)");
    }
    let per_type = ["full_attention", "sliding_attention"];
    let mut sets: Vec<(String, &Value)> = Vec::new();
    if per_type.iter().any(|k| rp.get(*k).is_some()) {
        for k in per_type {
            if let Some(v) = rp.get(k) {
                sets.push((format!("rope_parameters.{k}"), v));
            }
        }
    } else {
        sets.push(("rope_parameters".into(), rp));
    }
    for (path, v) in sets {
        let Some(obj) = v.as_object() else {
            bail!("config.json: {path} = {v} is not an object of RoPE settings (rope_type, rope_theta, …)");
        };
        let kind = obj.get("rope_type").or_else(|| obj.get("type")).filter(|t| !t.is_null());
        match kind {
            Some(Value::String(_)) => {}
            Some(t) => bail!("config.json: {path}.rope_type = {t} is not a string (default, linear, llama3, longrope)"),
            None => {
                let scaling = obj
                    .keys()
                    .find(|k| !matches!(k.as_str(), "rope_theta" | "partial_rotary_factor" | "rope_type" | "type"));
                if let Some(k) = scaling {
                    bail!("config.json: {path} has {k} but no rope_type; say which scaling it belongs to (linear, llama3, longrope)");
                }
            }
        }
    }
    Ok(())
}

/// Parses HF `config.json` (+ `generation_config.json` for extra EOS ids).
/// A [`GEMMA3_MM`] config is read as its language model's
/// ([`language_model_config`]).
pub fn parse_config(cfg: &Value, gen: Option<&Value>) -> Result<ModelConfig> {
    let flat = language_model_config(cfg)?;
    let cfg = &flat;
    let arch_name = cfg
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("config.json has no \"architectures\" list"))?;
    let raw = cfg;
    check_rope_parameters(cfg)?;
    let cfg = &with_class_defaults(cfg, arch_name);
    // TurboSparse (dReLU) checkpoints are Mistral-shaped "Bamboo" models, or Mixtral-shaped.
    let bamboo = arch_name == BAMBOO || arch_name == TURBOSPARSE_MIXTRAL;
    let architecture = match parse_moe(cfg, arch_name)? {
        Some(a) => Some(a),
        None if arch_name == BAMBOO => Some(Architecture::Mistral),
        None if arch_name == PHI3 => {
            let heads = req_u64(cfg, "num_attention_heads")?.max(1);
            let head_dim = get_u64(cfg, "head_dim")?.unwrap_or(req_u64(cfg, "hidden_size")? / heads);
            Some(Architecture::Phi3(Phi3 { rotary_dim: phi3_rotary_dim(cfg, head_dim)? }))
        }
        None if arch_name == SMOLLM3 => {
            Some(Architecture::SmolLm3(smollm3_rope_layers(cfg, req_u64(cfg, "num_hidden_layers")?)?))
        }
        None if arch_name == GEMMA3 => Some(Architecture::Gemma3(Gemma3 {
            query_pre_attn_scalar: req_u64(cfg, "query_pre_attn_scalar")?,
            rope_local_base_freq: get_f64(cfg, "rope_local_base_freq")?
                .ok_or_else(|| anyhow!("config.json has no rope_local_base_freq; it is required for {arch_name}"))?,
            sliding_layers: gemma3_sliding_layers(cfg, req_u64(cfg, "num_hidden_layers")?)?,
        })),
        None => Architecture::from_hf(arch_name),
    }
    .ok_or_else(|| {
        anyhow!(
            "unsupported architecture {arch_name:?}; supported: {}, {GEMMA3_MM} (its language model), {BAMBOO} and {TURBOSPARSE_MIXTRAL} (dReLU)",
            Architecture::SUPPORTED.join(", ")
        )
    })?;
    let hidden_size = req_u64(cfg, "hidden_size")?;
    let num_heads = req_u64(cfg, "num_attention_heads")?;
    if num_heads == 0 {
        bail!("config.json: num_attention_heads is 0");
    }
    if matches!(architecture, Architecture::Qwen3 | Architecture::SmolLm3(_))
        && get_bool(cfg, "use_sliding_window", false)?
    {
        bail!("config.json: use_sliding_window is true; sliding-window attention is not supported for {arch_name}");
    }
    // Options of known architectures that nflash does not run: refused,
    // never run with other semantics.
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(v) = cfg.get(key).filter(|v| !v.is_null()) {
            bail!("config.json: {key} = {v}; soft-capping of logits is not supported (nflash runs models that set it to null)");
        }
    }
    if get_bool(cfg, "use_bidirectional_attention", false)? {
        bail!(
            "config.json: use_bidirectional_attention is true (an embedding model); nflash runs causal language models"
        );
    }
    if let Some(v) = cfg.get("rope_parameters.sliding_attention") {
        bail!("config.json: rope_parameters.sliding_attention = {v}; the sliding-window layers of {arch_name} run default RoPE with rope_local_base_freq, nflash does not scale them");
    }
    // Gemma names its activation `hidden_activation` (its `hidden_act`, where present, is not read by transformers).
    let act_key = if matches!(architecture, Architecture::Gemma3(_)) { "hidden_activation" } else { "hidden_act" };
    let act_name = match cfg.get(act_key) {
        Some(Value::String(s)) => s.as_str(),
        Some(v) => bail!("config.json: {act_key} = {v} is not a string"),
        None => bail!("config.json has no {act_key}; it is required for {arch_name}"),
    };
    let activation = match Activation::from_hf(act_name) {
        Some(Activation::Relu) if bamboo => Activation::DRelu,
        // transformers has no "drelu": it is TurboSparse's spelling only.
        Some(Activation::DRelu) if !bamboo => bail!(
            "config.json: {act_key} \"drelu\" is TurboSparse's activation ({BAMBOO} or {TURBOSPARSE_MIXTRAL}); {arch_name} has no such activation in transformers"
        ),
        Some(a) => a,
        None => bail!("config.json: {act_key} {act_name:?} is not supported; supported: silu, relu, drelu, gelu, gelu_pytorch_tanh"),
    };
    if bamboo && activation != Activation::DRelu {
        bail!(
            "config.json: {arch_name} with hidden_act {act_name:?}: TurboSparse models use dReLU, hidden_act \"relu\""
        );
    }
    // Special token ids, each list read once: (file and key, ids).
    let ids = |file: &'static str, v: &Value, key: &'static str| -> Result<(String, Vec<u32>)> {
        let what = format!("{file} {key}");
        let list = token_ids(v.get(key), &what)?;
        Ok((what, list))
    };
    let (cfg_bos, cfg_eos) = (ids("config.json", cfg, "bos_token_id")?, ids("config.json", cfg, "eos_token_id")?);
    let (gen_bos, gen_eos) = match gen {
        Some(g) => {
            (ids("generation_config.json", g, "bos_token_id")?, ids("generation_config.json", g, "eos_token_id")?)
        }
        None => Default::default(),
    };
    let mut eos = cfg_eos.1.clone();
    for &id in &gen_eos.1 {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    let sliding_window = match architecture {
        Architecture::Mistral | Architecture::Mixtral(_) => get_u64(cfg, "sliding_window")?,
        Architecture::Qwen2 if get_bool(cfg, "use_sliding_window", false)? => get_u64(cfg, "sliding_window")?,
        // A window at least as long as the model's context is no window
        // (Phi-3.5-mini and Phi-4-mini set 262144).
        Architecture::Phi3(_) => get_u64(cfg, "sliding_window")?
            .filter(|&w| w < get_u64(cfg, "max_position_embeddings").ok().flatten().unwrap_or(u64::MAX)),
        Architecture::Gemma3(g) => match get_u64(cfg, "sliding_window")? {
            None if g.sliding_layers.iter().next().is_some() => bail!(
                "config.json: sliding_window is null, but layer_types (or sliding_window_pattern) makes layers {} sliding-window layers; set the window",
                g.sliding_layers.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ")
            ),
            // A window as long as the model's context is none (the layers keep their local RoPE).
            w => w.filter(|&w| w < get_u64(cfg, "max_position_embeddings").ok().flatten().unwrap_or(u64::MAX)),
        },
        _ => None,
    };
    let config = ModelConfig {
        architecture,
        vocab_size: req_u64(cfg, "vocab_size")?,
        hidden_size,
        // Qwen3-MoE: the experts' width (its intermediate_size is that of dense layers it has none of).
        intermediate_size: match architecture {
            Architecture::Qwen3Moe(_) => req_u64(cfg, "moe_intermediate_size")?,
            _ => req_u64(cfg, "intermediate_size")?,
        },
        num_layers: req_u64(cfg, "num_hidden_layers")?,
        num_heads,
        num_kv_heads: get_u64(cfg, "num_key_value_heads")?.unwrap_or(num_heads),
        head_dim: get_u64(cfg, "head_dim")?.unwrap_or(hidden_size / num_heads),
        rms_norm_eps: get_f64(cfg, "rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta: get_f64(cfg, "rope_theta")?.unwrap_or(10000.0),
        rope_scaling: rope_scaling(cfg)?,
        max_position_embeddings: get_u64(cfg, "max_position_embeddings")?.unwrap_or(2048),
        sliding_window,
        activation,
        tie_word_embeddings: get_bool(cfg, "tie_word_embeddings", false)?,
        attention_bias: get_bool(cfg, "attention_bias", false)?,
        mlp_bias: get_bool(cfg, "mlp_bias", false)?,
        // config.json's, else generation_config.json's.
        bos_token_id: cfg_bos.1.first().or(gen_bos.1.first()).copied(),
        eos_token_ids: eos,
    };
    config.check().map_err(|e| anyhow!("config.json: {e}"))?;
    // Special token ids index the embedding: one past it is a broken config.
    let vocab = config.vocab_size;
    for (key, list) in [cfg_bos, cfg_eos, gen_bos, gen_eos] {
        if let Some(bad) = list.iter().find(|&&id| u64::from(id) >= vocab) {
            if let Some(k) = key.strip_prefix("config.json ").filter(|k| raw.get(*k).is_none()) {
                bail!(
                    "config.json has no {k}, and transformers' default for {arch_name}, {bad}, is not a token of this model (vocab_size {vocab}); add {k} to config.json (the tokenizer's tokenizer.json names the right id)"
                );
            }
            bail!(
                "{key} {bad} is not a token of this model: vocab_size is {vocab} (ids 0..={}); fix the id in the file (the tokenizer's tokenizer.json names the right one)",
                vocab.saturating_sub(1)
            );
        }
    }
    Ok(config)
}

impl Checkpoint {
    /// Opens `dir`, parsing the config and every safetensors header.
    ///
    /// # Errors
    /// Missing files (named), invalid JSON, unsupported architecture or
    /// settings, a shard listed in the index but absent, unreadable headers.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.exists() {
            bail!("{} does not exist; pass a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) or a GGUF file", dir.display());
        }
        if !dir.is_dir() {
            bail!("{} is not a directory or a .gguf file; pass a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) or a GGUF file", dir.display());
        }
        let cfg_path = dir.join("config.json");
        if !cfg_path.exists() {
            bail!(
                "{} has no config.json and no .gguf file; pass a Hugging Face checkpoint directory or a GGUF file",
                dir.display()
            );
        }
        let cfg = read_json(&cfg_path)?;
        let gen_path = dir.join("generation_config.json");
        let gen = if gen_path.exists() { Some(read_json(&gen_path)?) } else { None };
        let config = parse_config(&cfg, gen.as_ref())?;
        let defaults_used = class_defaults_used(&language_model_config(&cfg)?);

        let tok_path = dir.join("tokenizer.json");
        let tokenizer_json = std::fs::read(&tok_path).with_context(|| {
            format!("cannot read {}; nflash needs the Hugging Face fast tokenizer file", tok_path.display())
        })?;
        // Read now, before any long work (calibration) that needs it.
        nflash_runtime::tokenizer::Tokenizer::from_json(&tokenizer_json).map_err(|e| {
            anyhow!(
                "{}: {e}; use the tokenizer.json that came with the checkpoint (re-download it)",
                tok_path.display()
            )
        })?;
        let tc_path = dir.join("tokenizer_config.json");
        let tokenizer_config = if tc_path.exists() { read_json(&tc_path)? } else { Value::Null };

        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        // Sharded: tensor name → shard file, as the index's weight_map says.
        // With both, model.safetensors is the checkpoint, as Hugging Face loads it.
        let weight_map: Option<HashMap<String, String>> = if single.exists() {
            if index_path.exists() {
                nflash_runtime::message!(
                    "note: {} has both model.safetensors and model.safetensors.index.json; using model.safetensors, as Hugging Face does",
                    dir.display()
                );
            }
            None
        } else if index_path.exists() {
            let idx = read_json(&index_path)?;
            let map = idx
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| anyhow!("{} has no weight_map object", index_path.display()))?;
            Some(
                map.iter()
                    .map(|(k, v)| {
                        v.as_str().map(|f| (k.clone(), f.to_string())).ok_or_else(|| {
                            anyhow!("{}: weight_map value {v} of {k} is not a file name", index_path.display())
                        })
                    })
                    .collect::<Result<_>>()?,
            )
        } else {
            bail!("{} has neither model.safetensors nor model.safetensors.index.json", dir.display());
        };
        if weight_map.as_ref().is_some_and(|m| m.is_empty()) {
            bail!(
                "{}: weight_map is empty; the index lists no tensors: re-download the checkpoint",
                index_path.display()
            );
        }
        let mut shard_names: Vec<String> = match &weight_map {
            Some(m) => m.values().cloned().collect(),
            None => vec!["model.safetensors".into()],
        };
        shard_names.sort();
        shard_names.dedup();
        let mut shards: Vec<Shard> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut unlisted: HashMap<String, usize> = HashMap::new();
        for name in shard_names {
            if name.contains('/') || name.contains("..") {
                bail!("shard name {name:?} in the index is not a plain file name");
            }
            let path = dir.join(&name);
            if path.is_dir() {
                bail!("{} is a directory, not a safetensors file; re-download the checkpoint", path.display());
            }
            if let Some(kind) = nflash_format::reader::special_file_kind(&path) {
                bail!("{} is {kind}, not a safetensors file; re-download the checkpoint", path.display());
            }
            let file = File::open(&path).with_context(|| {
                format!(
                    "shard {} is named in the index but cannot be opened; re-download the checkpoint",
                    path.display()
                )
            })?;
            // SAFETY: read-only map of a checkpoint file that is not modified
            // while prep runs; every access goes through ranges validated
            // by safetensors' header parser and checked below.
            let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
            let (n, meta) = safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| {
                anyhow!(
                    "{}: invalid safetensors header ({e:?}): the file is truncated or corrupt; re-download it",
                    path.display()
                )
            })?;
            let data_start = 8 + n;
            let data_len = mmap.len() - data_start;
            for (tname, info) in meta.tensors() {
                if info.data_offsets.1 > data_len {
                    bail!("{}: tensor {tname} extends past the end of the file (truncated download?)", path.display());
                }
                // A tensor stored twice is ambiguous whatever the index says.
                if let Some(&other) = index.get(&tname) {
                    bail!(
                        "tensor {tname} is stored in two shards, {} and {}; the checkpoint is inconsistent: re-download it",
                        shards[other].path.display(),
                        path.display()
                    );
                }
                index.insert(tname.clone(), shards.len());
            }
            drop(mmap); // only its header pages were touched
            shards.push(Shard { path, file, data_start, meta });
        }
        if let Some(m) = &weight_map {
            // Every tensor is read from the shard the index names for it.
            for (tname, file) in m {
                match index.get(tname) {
                    Some(&i) if shards[i].path.file_name().is_some_and(|f| f == file.as_str()) => {}
                    Some(&i) => bail!(
                        "{}: weight_map puts {tname} in {file}, but it is stored in {}; the index does not match the shards: re-download the checkpoint",
                        index_path.display(),
                        shards[i].path.display()
                    ),
                    None => bail!(
                        "{}: weight_map puts {tname} in {file}, but that shard does not contain it; re-download the checkpoint",
                        index_path.display()
                    ),
                }
            }
            // Tensors the index does not list are not part of the model.
            for (t, &i) in index.iter().filter(|(t, _)| !m.contains_key(*t)) {
                unlisted.insert(t.clone(), i);
            }
            index.retain(|t, _| m.contains_key(t));
        }
        let generation = gen.as_ref().map(generation_defaults).transpose()?.unwrap_or_default();
        // The language model of an image-and-text Gemma 3, under nflash's names.
        let mut aliases = HashMap::new();
        if arch_of(&cfg) == GEMMA3_MM {
            let mut skipped = 0usize;
            for stored in index.keys() {
                match gemma3_mm_name(stored) {
                    Some(name) => {
                        if index.contains_key(&name) {
                            bail!("tensor {name} is stored twice, as {name} and as {stored}; the checkpoint is inconsistent: re-download it");
                        }
                        if let Some(other) = aliases.insert(name.clone(), stored.clone()) {
                            bail!("tensor {name} is stored twice, as {other} and as {stored}; the checkpoint is inconsistent: re-download it");
                        }
                    }
                    None if stored.starts_with("model.")
                        && !stored.starts_with("model.vision_tower.")
                        && !stored.starts_with("model.multi_modal_projector.") => {}
                    None => skipped += 1,
                }
            }
            nflash_runtime::message!(
"note: {} is {GEMMA3_MM}: converting its language model (text_config); nflash runs text only, so the vision tower and projector ({skipped} tensors) are skipped",
                dir.display()
            );
        }
        let views =
            if matches!(config.architecture, Architecture::Phi3(_)) { phi3_views(&config) } else { HashMap::new() };
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            tokenizer_json,
            tokenizer_config,
            defaults_used,
            generation,
            store: Store::Safetensors(Safetensors { dir: dir.to_path_buf(), shards, index, unlisted, views, aliases }),
            norms_plus_one: matches!(config.architecture, Architecture::Gemma3(_)),
            config,
        })
    }
}

impl Safetensors {
    /// The checkpoint's name of tensor `name` (nflash's, SPEC §4.3).
    fn stored<'n>(&'n self, name: &'n str) -> &'n str {
        self.aliases.get(name).map_or(name, String::as_str)
    }

    /// The stored tensor that tensor `name` (nflash's name) is read from:
    /// itself, its name in an image-and-text checkpoint, or the fused
    /// tensor it is rows of.
    fn source_of<'n>(&'n self, name: &'n str) -> &'n str {
        match self.views.get(name) {
            Some(v) => &v.fused,
            None => self.stored(name),
        }
    }

    /// The stored tensors of the model that none of `used` (stored names,
    /// [`Self::source_of`]) is, sorted: weights `config.json` does not
    /// describe (an image-and-text checkpoint's vision tower aside).
    fn unused_tensors(&self, used: &std::collections::HashSet<&str>) -> Vec<String> {
        let mm = !self.aliases.is_empty();
        let mut out: Vec<String> = self
            .index
            .keys()
            // Neither read nor part of the vision tower.
            .filter(|n| !(used.contains(n.as_str()) || mm && gemma3_mm_name(n).is_none()))
            .cloned()
            .collect();
        out.sort();
        out
    }

    /// A fingerprint of the weights, 16 hex digits: CRC-32 (two seeds) over
    /// every tensor's name, shape and the f32 values of 16 elements at its
    /// start, middle and end (so BF16 weights and their F32 copy agree). It
    /// tells two checkpoints of one shape apart (a fine-tune from its base)
    /// without reading gigabytes; profiles store it.
    ///
    /// # Errors
    /// Read failures, naming the shard.
    fn fingerprint(&self) -> Result<String> {
        let mut names: Vec<&String> = self.index.keys().collect();
        names.sort();
        let (mut a, mut b) = (crc32fast::Hasher::new(), crc32fast::Hasher::new_with_initial(0x9E37_79B9));
        let mut buf = [0u8; 64];
        for name in names {
            let s = &self.shards[self.index[name]];
            let info = s.meta.info(name).expect("indexed");
            let head = format!("{name}|{:?}|", info.shape);
            a.update(head.as_bytes());
            b.update(head.as_bytes());
            let width = match info.dtype {
                Dtype::F32 => 4,
                Dtype::F16 | Dtype::BF16 => 2,
                _ => continue, // refused when read
            };
            let (lo, hi) = info.data_offsets;
            let n_elems = (hi - lo) / width;
            // 16 elements at the start, middle and end, as f32 values: the
            // same weights stored as BF16 or F32 give the same fingerprint.
            for at in [0, n_elems / 2, n_elems.saturating_sub(16)] {
                let n = 16.min(n_elems - at.min(n_elems));
                read_at(s, name, &mut buf[..n * width], (s.data_start + lo + at * width) as u64)?;
                for v in decode(info.dtype, &buf[..n * width]) {
                    a.update(&v.to_bits().to_le_bytes());
                    b.update(&v.to_bits().to_le_bytes());
                }
            }
        }
        Ok(format!("{:08x}{:08x}", a.finalize(), b.finalize()))
    }

    /// Whether the checkpoint has tensor `name` (stored, or rows of a fused tensor it stores).
    fn has(&self, name: &str) -> bool {
        self.index.contains_key(self.stored(name))
            || self.views.get(name).is_some_and(|v| self.index.contains_key(&v.fused))
    }

    /// Total tensors across shards.
    fn tensor_count(&self) -> usize {
        self.index.len()
    }

    /// Shape of tensor `name`.
    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        if let Some(v) = self.views.get(name) {
            let fused = self.shape(&v.fused)?;
            if fused != [v.fused_rows, v.cols] {
                bail!(
                    "tensor {} has shape {fused:?}, expected [{}, {}] from config.json (the fused projection whose rows {}..{} are {name})",
                    v.fused,
                    v.fused_rows,
                    v.cols,
                    v.row0,
                    v.row0 + v.rows
                );
            }
            return Ok(vec![v.rows, v.cols]);
        }
        let name = self.stored(name);
        let s = self.shard_of(name)?;
        Ok(s.meta.info(name).expect("indexed").shape.clone())
    }

    fn shard_of(&self, name: &str) -> Result<&Shard> {
        if let Some(&i) = self.unlisted.get(name) {
            bail!(
                "tensor {name} is in {}, but model.safetensors.index.json's weight_map does not list it: the index is incomplete; re-download it",
                self.shards[i].path.display()
            );
        }
        let i = *self.index.get(name).ok_or_else(|| {
            // The language model of an image-and-text checkpoint: the names it would have.
            let as_stored = match name.strip_prefix("model.") {
                Some(rest) if !self.aliases.is_empty() => {
                    format!(" (stored as model.language_model.{rest} or language_model.model.{rest})")
                }
                _ => String::new(),
            };
            anyhow!(
                "tensor {name}{as_stored} is missing from the checkpoint in {}; the download is incomplete or config.json does not match the weights: re-download the checkpoint",
                self.dir.display()
            )
        })?;
        Ok(&self.shards[i])
    }

    /// Shard, element width (bytes) and absolute data range of tensor `name`, checked to have `shape`.
    /// For rows of a fused tensor, the fused tensor is checked to have those
    /// rows' columns and its own row count.
    fn locate(&self, name: &str, shape: &[usize]) -> Result<(&Shard, Dtype, u64, usize)> {
        if let Some(v) = self.views.get(name) {
            if shape.len() != 2 || shape[0] != v.rows {
                bail!("tensor {name} (rows {}..{} of {}): asked for shape {shape:?}", v.row0, v.row0 + v.rows, v.fused);
            }
            let (s, dtype, off, len) = self.locate(&v.fused, &[v.fused_rows, shape[1]])?;
            let row_bytes = len / v.fused_rows;
            return Ok((s, dtype, off + (v.row0 * row_bytes) as u64, v.rows * row_bytes));
        }
        let name = self.stored(name);
        let s = self.shard_of(name)?;
        let info = s.meta.info(name).expect("indexed");
        if info.shape != shape {
            bail!("tensor {name} has shape {:?}, expected {shape:?} from config.json", info.shape);
        }
        let width = match info.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => bail!("tensor {name} in {} has dtype {other:?}; supported: BF16, F16, F32", s.path.display()),
        };
        let (a, b) = info.data_offsets;
        let n: usize = shape.iter().product();
        if b - a != n * width {
            bail!("tensor {name}: {} bytes for {n} elements of {:?}", b - a, info.dtype);
        }
        Ok((s, info.dtype, (s.data_start + a) as u64, b - a))
    }

    /// Reads tensor `name` as f32, checking it has `shape`.
    ///
    /// # Errors
    /// Missing tensor, wrong shape, dtype other than BF16/F16/F32, read
    /// failures, a NaN or infinite element (named by index).
    fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (s, dtype, off, len) = self.locate(name, shape)?;
        let mut bytes = vec![0u8; len];
        read_at(s, self.stored(name), &mut bytes, off)?;
        let v = decode(dtype, &bytes);
        check_finite(self.stored(name), shape, &v, 0, &s.path)?;
        Ok(v)
    }

    /// Rows `rows` of the 2-D tensor `name` (`[rows.len(), shape[1]]`), read one by one.
    ///
    /// # Errors
    /// As [`Safetensors::tensor_f32`]; a row index ≥ `shape[0]`.
    fn rows_f32(&self, name: &str, shape: &[usize], rows: &[u32]) -> Result<Vec<f32>> {
        let (s, dtype, off, len) = self.locate(name, shape)?;
        let (n_rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let row_bytes = len / n_rows.max(1);
        let mut bytes = vec![0u8; row_bytes];
        let mut out = Vec::with_capacity(rows.len() * cols);
        for &r in rows {
            if r as usize >= n_rows {
                bail!("row {r} of {name} is out of range: it has {n_rows} rows");
            }
            read_at(s, self.stored(name), &mut bytes, off + (r as usize * row_bytes) as u64)?;
            let v = decode(dtype, &bytes);
            check_finite(self.stored(name), shape, &v, r as usize * cols, &s.path)?;
            out.extend(v);
        }
        Ok(out)
    }
}

impl Checkpoint {
    /// Opens a Hugging Face checkpoint directory or a GGUF file (a `.gguf`,
    /// a split GGUF's first part, or a directory holding one).
    ///
    /// # Errors
    /// As [`Checkpoint::open`] and [`crate::gguf::GgufStore::open`].
    pub fn open_any(path: &Path) -> Result<Self> {
        if crate::gguf::is_gguf(path) {
            Self::open_gguf(path)
        } else {
            Self::open(path)
        }
    }

    /// Opens a GGUF model: its metadata becomes the `config.json` that
    /// [`parse_config`] reads, as for a Hugging Face checkpoint.
    ///
    /// # Errors
    /// As [`crate::gguf::GgufStore::open`] and [`parse_config`].
    pub fn open_gguf(path: &Path) -> Result<Self> {
        let mut g = crate::gguf::GgufStore::open(path)?;
        let config = parse_config(&g.config_json, Some(&g.generation_json))
            .with_context(|| format!("the model config built from {}'s metadata", g.path().display()))?;
        g.map_experts(&config);
        let generation = generation_defaults(&g.generation_json)?;
        nflash_runtime::tokenizer::Tokenizer::from_json(&g.tokenizer_json)
            .map_err(|e| anyhow!("the tokenizer built from {}: {e}", g.path().display()))?;
        Ok(Checkpoint {
            dir: g.path().to_path_buf(),
            tokenizer_json: g.tokenizer_json.clone(),
            tokenizer_config: g.tokenizer_config.clone(),
            defaults_used: Vec::new(),
            generation,
            // llama.cpp's converter stores Gemma's norms as 1 + w already.
            norms_plus_one: false,
            config,
            store: Store::Gguf(g),
        })
    }

    /// What the model config was read from, for messages: `config.json`,
    /// or the GGUF's metadata.
    pub fn config_name(&self) -> &'static str {
        match self.store {
            Store::Safetensors(_) => "config.json",
            Store::Gguf(_) => "the GGUF's metadata",
        }
    }

    /// The GGUF store, for a checkpoint read from GGUF.
    pub fn gguf(&self) -> Option<&crate::gguf::GgufStore> {
        match &self.store {
            Store::Gguf(g) => Some(g),
            Store::Safetensors(_) => None,
        }
    }

    /// The stored tensor that tensor `name` (nflash's name) is read from:
    /// itself, its name in an image-and-text checkpoint, the fused tensor
    /// it is rows of, or its GGUF tensor.
    pub fn source_of<'n>(&'n self, name: &'n str) -> &'n str {
        match &self.store {
            Store::Safetensors(s) => s.source_of(name),
            Store::Gguf(g) => g.source_of(name),
        }
    }

    /// The stored tensors of the model that none of `used` (stored names,
    /// [`Self::source_of`]) is, sorted: weights the config does not
    /// describe (an image-and-text checkpoint's vision tower aside).
    pub fn unused_tensors(&self, used: &std::collections::HashSet<&str>) -> Vec<String> {
        match &self.store {
            Store::Safetensors(s) => s.unused_tensors(used),
            Store::Gguf(g) => g.unused_tensors(used),
        }
    }

    /// Whether `name` is a norm weight stored as `w` for `1 + w` (Gemma 3's
    /// `*layernorm.weight`, `self_attn.{q,k}_norm.weight`, `model.norm.weight`).
    fn is_plus_one_norm(&self, name: &str) -> bool {
        self.norms_plus_one
            && (name.ends_with("layernorm.weight") || name.ends_with("_norm.weight") || name == "model.norm.weight")
    }

    /// A fingerprint of the weights, 16 hex digits, that tells two
    /// checkpoints of one shape apart without reading them whole; profiles
    /// store it ([`Safetensors::fingerprint`], [`crate::gguf::GgufStore::fingerprint`]).
    ///
    /// # Errors
    /// Read failures, naming the file.
    pub fn fingerprint(&self) -> Result<String> {
        match &self.store {
            Store::Safetensors(s) => s.fingerprint(),
            Store::Gguf(g) => g.fingerprint(),
        }
    }

    /// Whether the checkpoint has tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        match &self.store {
            Store::Safetensors(s) => s.has(name),
            Store::Gguf(g) => g.has(name),
        }
    }

    /// Number of stored tensors.
    pub fn tensor_count(&self) -> usize {
        match &self.store {
            Store::Safetensors(s) => s.tensor_count(),
            Store::Gguf(g) => g.tensor_count(),
        }
    }

    /// Shape of tensor `name`.
    ///
    /// # Errors
    /// A missing tensor (named, with what to do).
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        match &self.store {
            Store::Safetensors(s) => s.shape(name),
            Store::Gguf(g) => g.shape(name),
        }
    }

    /// Reads tensor `name` as f32, checking it has `shape` (a Gemma norm
    /// stored as `w` is returned as `1 + w`, added in f32 as transformers'
    /// `Gemma3RMSNorm` does).
    ///
    /// # Errors
    /// Missing tensor, wrong shape, an unsupported dtype, read failures, a
    /// NaN or infinite element (named by index).
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let mut v = match &self.store {
            Store::Safetensors(s) => s.tensor_f32(name, shape)?,
            Store::Gguf(g) => {
                let v = g.tensor_f32(name, shape)?;
                check_finite(g.source_of(name), shape, &v, 0, g.path())?;
                v
            }
        };
        if self.is_plus_one_norm(name) {
            v.iter_mut().for_each(|w| *w += 1.0);
        }
        Ok(v)
    }

    /// Rows `rows` of the 2-D tensor `name` (`[rows.len(), shape[1]]`).
    ///
    /// # Errors
    /// As [`Checkpoint::tensor_f32`]; a row index ≥ `shape[0]`.
    pub fn rows_f32(&self, name: &str, shape: &[usize], rows: &[u32]) -> Result<Vec<f32>> {
        match &self.store {
            Store::Safetensors(s) => s.rows_f32(name, shape, rows),
            Store::Gguf(g) => {
                let v = g.rows_f32(name, shape, rows)?;
                check_finite(g.source_of(name), &[rows.len(), shape[1]], &v, 0, g.path())?;
                Ok(v)
            }
        }
    }

    /// Tensor `name`'s Q4_0 or Q8_0 blocks exactly as the GGUF stores them
    /// (rows in Hugging Face order), when it stores them as `dtype`; `None`
    /// for a safetensors checkpoint or another type.
    ///
    /// # Errors
    /// As [`Checkpoint::tensor_f32`].
    pub fn blocks(&self, name: &str, shape: &[usize], dtype: nflash_format::DType) -> Result<Option<Vec<u8>>> {
        use crate::gguf::file::GgmlType;
        let ty = match dtype {
            nflash_format::DType::Q4_0 => GgmlType::Q4_0,
            nflash_format::DType::Q8_0 => GgmlType::Q8_0,
            _ => return Ok(None),
        };
        match &self.store {
            Store::Gguf(g) => g.blocks(name, shape, ty),
            Store::Safetensors(_) => Ok(None),
        }
    }
}

fn read_at(s: &Shard, name: &str, buf: &mut [u8], off: u64) -> Result<()> {
    s.file.read_exact_at(buf, off).with_context(|| {
        format!(
            "cannot read tensor {name} from {} (truncated or unreadable); re-download the checkpoint",
            s.path.display()
        )
    })
}

/// Refuses NaN and ±infinity in `values`, elements `first..` of tensor
/// `name` (`shape`): nothing computed from them would mean anything, and
/// quantizing to Q4_0/Q8_0 would silently turn them into finite numbers.
///
/// # Errors
/// The tensor, the file and the first bad element, by flat index and by
/// coordinates.
pub fn check_finite(name: &str, shape: &[usize], values: &[f32], first: usize, file: &Path) -> Result<()> {
    let Some(i) = values.iter().position(|v| !v.is_finite()) else {
        return Ok(());
    };
    let flat = first + i;
    bail!(
        "tensor {name} in {} holds {} at element {flat} (index {:?} of shape {shape:?}); a checkpoint with non-finite weights cannot be converted: re-download it, or fix the training run that wrote it",
        file.display(),
        values[i],
        unravel(flat, shape)
    )
}

/// Coordinates of flat row-major index `i` in `shape`.
pub fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        idx[d] = i % n.max(1);
        i /= n.max(1);
    }
    idx
}

/// Little-endian BF16/F16/F32 bytes to f32.
fn decode(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    use crate::gguf::file::GgmlType;
    let ty = match dtype {
        Dtype::F32 => GgmlType::F32,
        Dtype::F16 => GgmlType::F16,
        _ => GgmlType::BF16,
    };
    crate::gguf::decode_floats(ty, bytes)
}

impl crate::forward::WeightSource for Checkpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Checkpoint::tensor_f32(self, name, shape)
    }
    fn rows_f32(&self, name: &str, shape: &[usize], rows: &[u32]) -> Result<Vec<f32>> {
        Checkpoint::rows_f32(self, name, shape, rows)
    }
}
