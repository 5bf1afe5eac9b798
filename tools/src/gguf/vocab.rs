//! The tokenizer of a GGUF file (`tokenizer.ggml.*`) as a Hugging Face
//! `tokenizer.json` and `tokenizer_config.json`, built to tokenize as
//! llama.cpp tokenizes the same file (`src/llama-vocab.cpp`).

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Map, Value};

use super::file::{GgufFile, MetaArray, MetaValue};

/// llama.cpp's token types (`llama_token_type`).
const NORMAL: i64 = 1;
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

fn flag(g: &GgufFile, key: &str) -> Result<Option<bool>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| anyhow!("metadata key {key:?} is {}, not a bool", v.kind())),
    }
}

/// Builds the tokenizer of `g`.
///
/// # Errors
/// A tokenizer model other than `gpt2` (byte-level BPE), a pre-tokenizer
/// type outside [`PRE_TYPES`] (named), inconsistent arrays (tokens, types,
/// merges), a special token id beyond the vocabulary.
pub fn build(g: &GgufFile) -> Result<Vocab> {
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| anyhow!("metadata key \"tokenizer.ggml.model\" is missing or not a string; the GGUF has no tokenizer nflash can use"))?;
    if model != "gpt2" {
        bail!(
            "tokenizer.ggml.model is {model:?}; nflash builds \"gpt2\" (byte-level BPE) vocabularies from GGUF so far"
        );
    }
    let pre = match g.get("tokenizer.ggml.pre") {
        None => bail!("metadata key \"tokenizer.ggml.pre\" is missing: llama.cpp would fall back to the \"default\" pre-tokenizer and warn that quality degrades; convert the model again with a current llama.cpp"),
        Some(v) => v.as_str().ok_or_else(|| anyhow!("metadata key \"tokenizer.ggml.pre\" is {}, not a string", v.kind()))?,
    };
    let (regexes, ignore_merges) = pre_tokenizer(pre).ok_or_else(|| {
        anyhow!("tokenizer.ggml.pre is {pre:?}, a pre-tokenizer nflash does not build (it builds {PRE_TYPES}); nflash will not guess, since a wrong one tokenizes differently from llama.cpp")
    })?;
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let types = ints(g, "tokenizer.ggml.token_type")?;
    if let Some(t) = types {
        if t.len() != n {
            bail!("tokenizer.ggml.token_type has {} entries, tokenizer.ggml.tokens {n}: the file is corrupt", t.len());
        }
    }
    let merges = strings(g, "tokenizer.ggml.merges")?;
    if let Some((i, m)) = merges.iter().enumerate().find(|(_, m)| m.split(' ').count() != 2) {
        bail!(
            "merge {i} of tokenizer.ggml.merges, {m:?}, is not two tokens separated by one space: the file is corrupt"
        );
    }
    let mut vocab = Map::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        if vocab.insert(t.clone(), json!(i)).is_some() {
            bail!("token {i} of tokenizer.ggml.tokens, {t:?}, appears twice: the file is corrupt");
        }
    }
    let ty = |i: usize| types.map_or(NORMAL, |t| t[i]);
    // Control and user-defined tokens are matched whole before the
    // pre-tokenizer, as llama.cpp's `tokenizer_st_partition` does.
    let added: Vec<Value> = (0..n)
        .filter(|&i| matches!(ty(i), CONTROL | USER_DEFINED))
        .map(|i| {
            json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": ty(i) == CONTROL})
        })
        .collect();
    let splits: Vec<Value> = regexes
        .iter()
        .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
        .collect();
    let mut pre_tokenizers = splits;
    pre_tokenizers
        .push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}));
    let tokenizer = json!({
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
    });
    let bos = token_id(g, "tokenizer.ggml.bos_token_id", n)?;
    let eos = token_id(g, "tokenizer.ggml.eos_token_id", n)?;
    let eot = token_id(g, "tokenizer.ggml.eot_token_id", n)?.filter(|&t| Some(t) != eos);
    // llama.cpp's default for BPE vocabularies without the key: no BOS.
    let add_bos = flag(g, "tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let mut tc = Map::new();
    tc.insert("add_bos_token".into(), json!(add_bos));
    if let Some(b) = bos {
        tc.insert("bos_token".into(), json!(tokens[b as usize]));
    }
    if let Some(e) = eos {
        tc.insert("eos_token".into(), json!(tokens[e as usize]));
    }
    if let Some(t) = g.get("tokenizer.chat_template") {
        let t = t
            .as_str()
            .ok_or_else(|| anyhow!("metadata key \"tokenizer.chat_template\" is {}, not a string", t.kind()))?;
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
