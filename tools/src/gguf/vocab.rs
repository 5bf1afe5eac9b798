//! The tokenizer of a GGUF file (`tokenizer.ggml.*`) as a Hugging Face
//! `tokenizer.json` and `tokenizer_config.json`, built to tokenize as
//! llama.cpp tokenizes the same file (`src/llama-vocab.cpp`).

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Map, Value};

use super::file::{GgufFile, MetaArray, MetaValue};

/// llama.cpp's token types (`llama_token_type`).
const NORMAL: i64 = 1;
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The `tokenizer.ggml.pre` types nflash builds, with llama.cpp's
/// pre-tokenizer regexes for each (`llm_tokenizer_bpe`, applied in order,
/// each splitting the pieces the one before left) and whether a word that
/// is itself a token skips the merges (`ignore_merges`).
fn pre_tokenizer(pre: &str) -> Option<(&'static [&'static str], bool)> {
    const GPT2: &str = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
    const LLAMA3: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    const QWEN2: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    const GPT4O: &str = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    Some(match pre {
        "default" => (&["[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2, "\\p{N}+", "[0-9][0-9][0-9]"], false),
        "gpt-2" => (&[GPT2], false),
        "smollm" | "starcoder" => (&["\\p{N}", GPT2], false),
        "llama3" | "llama-v3" | "llama-bpe" => (&[LLAMA3], true),
        "qwen2" | "deepseek-r1-qwen" => (&[QWEN2], false),
        "gpt-4o" | "llama4" => (&[GPT4O], false),
        _ => return None,
    })
}

/// The `tokenizer.ggml.pre` types [`build`] accepts, for errors.
pub const PRE_TYPES: &str =
    "default, gpt-2, smollm, starcoder, llama3, llama-v3, llama-bpe, qwen2, deepseek-r1-qwen, gpt-4o, llama4";

/// A built tokenizer: `tokenizer.json` bytes, `tokenizer_config.json`, and special ids.
pub struct Vocab {
    /// Hugging Face `tokenizer.json`.
    pub tokenizer_json: Vec<u8>,
    /// `tokenizer_config.json` (`add_bos_token`, `bos_token`, `eos_token`, `chat_template`).
    pub tokenizer_config: Value,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`, when it differs from EOS (a chat turn's end).
    pub eot: Option<u32>,
    /// Number of tokens.
    pub n_tokens: usize,
}

fn strings<'a>(g: &'a GgufFile, key: &str) -> Result<&'a [String]> {
    match g.get(key) {
        Some(MetaValue::Array(MetaArray::Str(v))) => Ok(v),
        Some(v) => bail!("metadata key {key:?} is {}, not an array of strings", v.kind()),
        None => bail!("metadata key {key:?} is missing; the GGUF has no tokenizer nflash can use"),
    }
}

fn ints<'a>(g: &'a GgufFile, key: &str) -> Result<Option<&'a [i64]>> {
    match g.get(key) {
        Some(MetaValue::Array(MetaArray::Int(v))) => Ok(Some(v)),
        Some(v) => bail!("metadata key {key:?} is {}, not an array of integers", v.kind()),
        None => Ok(None),
    }
}

/// Token id `key`, checked against the vocabulary size.
fn token_id(g: &GgufFile, key: &str, n: usize) -> Result<Option<u32>> {
    let Some(v) = g.get(key) else { return Ok(None) };
    // llama.cpp writes -1 (as u32 0xFFFFFFFF) for "none".
    if matches!(v, MetaValue::I64(-1) | MetaValue::U64(0xFFFF_FFFF)) {
        return Ok(None);
    }
    let id = v.as_u64().ok_or_else(|| anyhow!("metadata key {key:?} is {}, not a token id", v.kind()))?;
    if id >= n as u64 {
        bail!("metadata key {key:?} is {id}, but the vocabulary has {n} tokens: the file is corrupt");
    }
    Ok(Some(id as u32))
}

/// Builds the tokenizer of `g`: `gpt2` (byte-level BPE) or `llama`
/// (SentencePiece) vocabularies.
///
/// # Errors
/// Another tokenizer model (named), a pre-tokenizer type outside
/// [`PRE_TYPES`] (named), inconsistent arrays (tokens, types, merges,
/// scores), a special token id beyond the vocabulary.
pub fn build(g: &GgufFile) -> Result<Vocab> {
    let model = g.opt_str("tokenizer.ggml.model")?.ok_or_else(|| {
        anyhow!("metadata key \"tokenizer.ggml.model\" is missing; the GGUF has no tokenizer nflash can use")
    })?;
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let types = ints(g, "tokenizer.ggml.token_type")?;
    if let Some(t) = types {
        if t.len() != n {
            bail!("tokenizer.ggml.token_type has {} entries, tokenizer.ggml.tokens {n}: the file is corrupt", t.len());
        }
    }
    let ty = |i: usize| types.map_or(NORMAL, |t| t[i]);
    let mut vocab = Map::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        if t.is_empty() {
            bail!("token {i} of tokenizer.ggml.tokens is empty: the file is corrupt");
        }
        if vocab.insert(t.clone(), json!(i)).is_some() {
            bail!("token {i} of tokenizer.ggml.tokens, {t:?}, appears twice: the file is corrupt");
        }
    }
    // Control and user-defined tokens are matched whole before the
    // tokenizer runs, as llama.cpp's `tokenizer_st_partition` does.
    let added: Vec<Value> = (0..n)
        .filter(|&i| matches!(ty(i), CONTROL | USER_DEFINED))
        .map(|i| {
            json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": ty(i) == CONTROL})
        })
        .collect();
    let tokenizer = match model {
        "gpt2" => gpt2(g, vocab, added)?,
        "llama" => spm(g, tokens, &ty, vocab, added)?,
        other => bail!(
            "tokenizer.ggml.model is {other:?}; nflash builds \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece) vocabularies"
        ),
    };
    specials(g, tokens, model == "llama", tokenizer)
}

/// A `gpt2` (byte-level BPE) vocabulary: `tokenizer.ggml.merges` and
/// llama.cpp's pre-tokenizer regexes for `tokenizer.ggml.pre`.
fn gpt2(g: &GgufFile, vocab: Map<String, Value>, added: Vec<Value>) -> Result<Value> {
    let Some(pre) = g.opt_str("tokenizer.ggml.pre")? else {
        bail!("metadata key \"tokenizer.ggml.pre\" is missing: llama.cpp would fall back to the \"default\" pre-tokenizer and warn that quality degrades; convert the model again with a current llama.cpp");
    };
    let (regexes, ignore_merges) = pre_tokenizer(pre).ok_or_else(|| {
        anyhow!("tokenizer.ggml.pre is {pre:?}, a pre-tokenizer nflash does not build (it builds {PRE_TYPES}); nflash will not guess, since a wrong one tokenizes differently from llama.cpp")
    })?;
    let merges = strings(g, "tokenizer.ggml.merges")?;
    for (i, m) in merges.iter().enumerate() {
        let parts: Vec<&str> = m.split(' ').collect();
        if parts.len() != 2 {
            bail!("merge {i} of tokenizer.ggml.merges, {m:?}, is not two tokens separated by one space: the file is corrupt");
        }
        if let Some(p) = parts.iter().find(|p| !vocab.contains_key(**p)) {
            bail!("merge {i} of tokenizer.ggml.merges, {m:?}, names {p:?}, which tokenizer.ggml.tokens does not hold: the file is corrupt");
        }
    }
    let mut pre_tokenizers: Vec<Value> = regexes
        .iter()
        .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
        .collect();
    pre_tokenizers
        .push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}));
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
            "vocab": vocab, "merges": merges,
        },
    }))
}

/// A `llama` (SentencePiece) vocabulary as llama.cpp's `llm_tokenizer_spm`
/// reads it: the text of each fragment, a space put first where
/// `tokenizer.ggml.add_space_prefix` (default true) says so, spaces as
/// `▁`, then adjacent pieces merged best score first while their
/// concatenation is a token, and bytes for what never forms one
/// (`<0xXX>`). As a Hugging Face BPE model (transformers'
/// `LlamaConverter`): a merge for every split of a normal token into two
/// tokens, ranked by the score of the token it makes.
fn spm(
    g: &GgufFile,
    tokens: &[String],
    ty: &dyn Fn(usize) -> i64,
    vocab: Map<String, Value>,
    added: Vec<Value>,
) -> Result<Value> {
    let n = tokens.len();
    let scores = match g.get("tokenizer.ggml.scores") {
        Some(MetaValue::Array(MetaArray::Float(v))) if v.len() == n => v,
        Some(v) => bail!(
            "metadata key \"tokenizer.ggml.scores\" is {}, not an array of {n} floats: the file is corrupt",
            v.kind()
        ),
        None => bail!("metadata key \"tokenizer.ggml.scores\" is missing; a SentencePiece vocabulary needs its scores"),
    };
    let pre = g.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    if pre != "default" {
        bail!("tokenizer.ggml.pre is {pre:?} for a SentencePiece (\"llama\") vocabulary; llama.cpp reads only \"default\" there");
    }
    let add_space_prefix = g.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let id_of: std::collections::HashSet<&str> = tokens.iter().map(String::as_str).collect();
    // (score of the merged token, its id, left, right), best first.
    let mut merges: Vec<(f64, usize, &str, &str)> = Vec::new();
    for (i, t) in tokens.iter().enumerate().filter(|&(i, _)| ty(i) == NORMAL) {
        for (at, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(at);
            if id_of.contains(l) && id_of.contains(r) {
                merges.push((scores[i], i, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.len().cmp(&b.2.len())));
    let merges: Vec<Value> = merges.into_iter().map(|(_, _, l, r)| json!([l, r])).collect();
    let unk = (0..n).find(|&i| ty(i) == UNKNOWN).map(|i| tokens[i].clone());
    let mut normalizers = Vec::new();
    if add_space_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": "▁"}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    }))
}

/// The special ids, `add_bos_token` and the chat template of `g`, beside
/// `tokenizer`; `spm` for a SentencePiece vocabulary (llama.cpp's default
/// there is to add BOS).
fn specials(g: &GgufFile, tokens: &[String], spm: bool, tokenizer: Value) -> Result<Vocab> {
    let n = tokens.len();
    let bos = token_id(g, "tokenizer.ggml.bos_token_id", n)?;
    let eos = token_id(g, "tokenizer.ggml.eos_token_id", n)?;
    let eot = token_id(g, "tokenizer.ggml.eot_token_id", n)?.filter(|&t| Some(t) != eos);
    // llama.cpp's defaults without the key: BOS for SentencePiece vocabularies, none for BPE.
    let add_bos = g.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(spm);
    let mut tc = Map::new();
    tc.insert("add_bos_token".into(), json!(add_bos));
    if let Some(b) = bos {
        tc.insert("bos_token".into(), json!(tokens[b as usize]));
    }
    if let Some(e) = eos {
        tc.insert("eos_token".into(), json!(tokens[e as usize]));
    }
    if let Some(t) = g.opt_str("tokenizer.chat_template")? {
        tc.insert("chat_template".into(), json!(t));
    }
    Ok(Vocab {
        tokenizer_json: serde_json::to_vec(&tokenizer)?,
        tokenizer_config: Value::Object(tc),
        bos,
        eos,
        eot,
        n_tokens: n,
    })
}
