//! Bad input to `prep` and `nflash`: every case must end with a non-zero
//! exit status, no panic and no signal, an error message naming the problem,
//! and (for `prep convert`) no output file left behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use nflash_tests::{
    assert_fails, assert_no_output, convert, run, tiny_tokenizer_json, write_tiny_checkpoint, TinySpec,
};
use serde_json::{json, Value};

// ---------------------------------------------------------------- helpers

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `prep convert` on `dir`, expects a clean failure mentioning
/// `needles`, and that no output was left. Returns stderr.
#[track_caller]
fn convert_fails(dir: &Path, needles: &[&str]) -> String {
    let out = dir.parent().unwrap().join("out.nflash");
    let o = run("prep", &["convert", "--model", s(dir), "--out", s(&out), "--quant", "q8_0"]);
    let stderr = assert_fails("prep convert", &o, needles);
    assert_no_output(&out);
    stderr
}

/// A tiny default checkpoint in `tmp/ckpt`.
fn tiny_checkpoint(tmp: &Path, spec: &TinySpec) -> PathBuf {
    let dir = tmp.join("ckpt");
    write_tiny_checkpoint(&dir, spec);
    dir
}

/// A tiny q8_0 pack in `tmp/tiny.nflash`.
fn tiny_pack(tmp: &Path) -> PathBuf {
    let dir = tiny_checkpoint(tmp, &TinySpec::default());
    let pack = tmp.join("tiny.nflash");
    convert(&dir, &pack, "q8_0");
    pack
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

/// `(name, offset, bytes)` of every segment, from `prep inspect --json`.
fn segments(pack: &Path) -> Vec<(String, u64, u64)> {
    let o = run("prep", &["inspect", "--json", s(pack)]);
    assert!(o.status.success(), "prep inspect: {}", String::from_utf8_lossy(&o.stderr));
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    j["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_string(), s["offset"].as_u64().unwrap(), s["bytes"].as_u64().unwrap()))
        .collect()
}

fn segment(pack: &Path, name: &str) -> (u64, u64) {
    let segs = segments(pack);
    let (_, off, len) = segs.iter().find(|(n, _, _)| n == name).unwrap_or_else(|| panic!("no segment {name}"));
    (*off, *len)
}

/// Arguments for a short greedy `nflash run` of `pack`.
fn run_args<'a>(pack: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v =
        vec!["run", "--model", s(pack), "--max-tokens", "2", "--temperature", "0", "--seed", "1", "--threads", "1"];
    v.extend_from_slice(extra);
    v
}

/// `prep inspect`, `prep verify` and `nflash run` on `pack` all fail cleanly, mentioning `needles`.
#[track_caller]
fn all_readers_fail(case: &str, pack: &Path, needles: &[&str]) {
    let o = run("prep", &["inspect", s(pack)]);
    assert_fails(&format!("{case}: prep inspect"), &o, needles);
    let o = run("prep", &["inspect", "--json", s(pack)]);
    assert_fails(&format!("{case}: prep inspect --json"), &o, needles);
    let o = run("prep", &["verify", s(pack)]);
    assert_fails(&format!("{case}: prep verify"), &o, needles);
    let o = run("nflash", &run_args(pack, &["--prompt", "w3 w4"]));
    assert_fails(&format!("{case}: nflash run"), &o, needles);
}

/// Rewrites `file` (a safetensors file) without tensor `drop`.
fn remove_tensor(file: &Path, drop: &str) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: HashMap<String, safetensors::tensor::TensorView> =
        st.tensors().into_iter().filter(|(n, _)| n != drop).collect();
    assert!(views.len() + 1 == st.len(), "{drop} not in {}", file.display());
    safetensors::serialize_to_file(views, None, file).unwrap();
}

// ---------------------------------------------------- prep convert failures

/// Reads `path`, lets `f` change its bytes, writes them back.
fn edit_file(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, &bytes).unwrap();
}

#[test]
fn checkpoint_without_config_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    std::fs::remove_file(dir.join("config.json")).unwrap();
    convert_fails(&dir, &["config.json", s(&dir)]);
}

#[test]
fn unsupported_architecture_lists_supported() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let mut cfg = read_json(&dir.join("config.json"));
    cfg["architectures"] = json!(["GPT2LMHeadModel"]);
    write_json(&dir.join("config.json"), &cfg);
    convert_fails(&dir, &["GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]);
}

#[test]
fn missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    remove_tensor(&dir.join("model.safetensors"), "model.layers.1.mlp.up_proj.weight");
    convert_fails(&dir, &["model.layers.1.mlp.up_proj.weight", "missing", "re-download"]);
}

#[test]
fn missing_resident_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    remove_tensor(&dir.join("model.safetensors"), "model.norm.weight");
    convert_fails(&dir, &["model.norm.weight", "missing"]);
}

#[test]
fn empty_and_truncated_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let st = dir.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    convert_fails(&dir, &["model.safetensors", "truncated", "re-download"]);
    std::fs::write(&st, b"").unwrap();
    convert_fails(&dir, &["model.safetensors", "truncated", "re-download"]);
}

#[test]
fn shard_named_in_index_but_absent() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec { shards: 2, ..Default::default() });
    let shard = "model-00002-of-00002.safetensors";
    std::fs::remove_file(dir.join(shard)).unwrap();
    convert_fails(&dir, &[shard, "index"]);
}

#[test]
fn untied_config_without_lm_head() {
    let tmp = tempfile::tempdir().unwrap();
    // tied: true writes no lm_head.weight; then the config claims it is untied.
    let dir = tiny_checkpoint(tmp.path(), &TinySpec { tied: true, ..Default::default() });
    let mut cfg = read_json(&dir.join("config.json"));
    cfg["tie_word_embeddings"] = json!(false);
    write_json(&dir.join("config.json"), &cfg);
    convert_fails(&dir, &["lm_head.weight", "tie_word_embeddings"]);
}

#[test]
fn tokenizer_larger_than_embedding() {
    let tmp = tempfile::tempdir().unwrap();
    // Weights and config for 60 tokens, a tokenizer with 80.
    let dir = tiny_checkpoint(tmp.path(), &TinySpec { vocab: 60, ..Default::default() });
    write_json(&dir.join("tokenizer.json"), &tiny_tokenizer_json(80));
    convert_fails(&dir, &["79", "60"]);
}

#[test]
fn added_token_beyond_embedding() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let mut tok = read_json(&dir.join("tokenizer.json"));
    tok["added_tokens"].as_array_mut().unwrap().push(json!({
        "id": 500, "content": "<|big|>", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": true
    }));
    write_json(&dir.join("tokenizer.json"), &tok);
    convert_fails(&dir, &["80", "vocab_size"]);
}

#[test]
fn vocab_token_id_beyond_embedding() {
    // Same token count as the embedding, but one id far beyond it.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let mut tok = read_json(&dir.join("tokenizer.json"));
    tok["model"]["vocab"]["w79"] = json!(1000);
    write_json(&dir.join("tokenizer.json"), &tok);
    convert_fails(&dir, &["1000", "80"]);
}

// ------------------------------------------------------- damaged packs

#[test]
fn pack_truncated_inside_header() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let bytes = std::fs::read(&pack).unwrap();
    std::fs::write(&pack, &bytes[..30]).unwrap();
    all_readers_fail("truncated header", &pack, &["30 bytes", "64-byte header", "truncated"]);
}

#[test]
fn pack_truncated_inside_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let bytes = std::fs::read(&pack).unwrap();
    std::fs::write(&pack, &bytes[..bytes.len() - 5]).unwrap();
    let (len, full) = (bytes.len() - 5, bytes.len());
    all_readers_fail("truncated manifest", &pack, &["truncated", &format!("{len} bytes"), &format!("{full} bytes")]);
}

#[test]
fn pack_truncated_inside_segment() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let (off, len) = segment(&pack, "ffn.1");
    let bytes = std::fs::read(&pack).unwrap();
    let cut = (off + len / 2) as usize;
    std::fs::write(&pack, &bytes[..cut]).unwrap();
    let full = bytes.len();
    all_readers_fail("truncated segment", &pack, &["truncated", &format!("{cut} bytes"), &format!("{full} bytes")]);
}

#[test]
fn pack_with_wrong_magic() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    edit_file(&pack, |bytes| {
        bytes[0..8].copy_from_slice(b"NFLASHPX");
    });
    all_readers_fail("wrong magic", &pack, &["magic", "not an nflash pack", "prep convert"]);
    // A GGUF (llama.cpp's format) is named as one, with the command that converts it.
    edit_file(&pack, |bytes| {
        bytes[0..8].copy_from_slice(b"GGUF\x03\0\0\0");
    });
    all_readers_fail("GGUF magic", &pack, &["is a GGUF file, not an nflash pack", "prep convert --model"]);
}

fn set_major(pack: &Path, major: u16) {
    let mut bytes = std::fs::read(pack).unwrap();
    bytes[8..10].copy_from_slice(&major.to_le_bytes());
    let crc = crc32fast::hash(&bytes[0..60]);
    bytes[60..64].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(pack, &bytes).unwrap();
}

#[test]
fn pack_with_newer_major_version() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let (cur, next) = (nflash_format::VERSION_MAJOR, nflash_format::VERSION_MAJOR + 1);
    set_major(&pack, next);
    let minor = nflash_format::VERSION_MINOR;
    let (found, ours) = (format!("version {next}.{minor}"), format!("{cur}.{minor}"));
    all_readers_fail("newer major", &pack, &[&found, "newer", &ours, &format!("format {next}.{minor}")]);
}

#[test]
fn pack_with_older_major_version() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    set_major(&pack, nflash_format::VERSION_MAJOR - 1);
    let o = run("prep", &["inspect", s(&pack)]);
    let minor = nflash_format::VERSION_MINOR;
    let (found, ours) = (
        format!("version {}.{minor}", nflash_format::VERSION_MAJOR - 1),
        format!("{}.{minor}", nflash_format::VERSION_MAJOR),
    );
    let e = assert_fails("older major", &o, &[&found, &ours, "prep convert"]);
    assert!(!e.contains("newer than"), "an older version is not newer:\n{e}");
}

#[test]
fn pack_with_flipped_byte_in_segment() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let (off, len) = segment(&pack, "ffn.0");
    edit_file(&pack, |bytes| {
        bytes[(off + len / 3) as usize] ^= 0x40;
    });
    let needles = ["checksum mismatch", "segment \"ffn.0\"", &format!("offset {off}")];
    let o = run("prep", &["verify", s(&pack)]);
    assert_fails("prep verify", &o, &needles);
    let o = run("nflash", &run_args(&pack, &["--verify", "--prompt", "w3 w4"]));
    assert_fails("nflash run --verify", &o, &needles);
    let f = tmp.path().join("text.txt");
    std::fs::write(&f, "w3 w4 w5 w6 w7").unwrap();
    let o = run("nflash", &["ppl", "--model", s(&pack), "--file", s(&f), "--verify"]);
    assert_fails("nflash ppl --verify", &o, &needles);
}

#[test]
fn pack_with_flipped_byte_in_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    edit_file(&pack, |bytes| {
        let n = bytes.len();
        bytes[n - 100] ^= 0x55;
    });
    all_readers_fail("flipped manifest byte", &pack, &["checksum mismatch in manifest", "convert it again"]);
}

#[test]
fn corrupt_tokenizer_segment_without_verify() {
    // The tokenizer and resident segments are checksummed at every load, so
    // even without --verify a damaged tokenizer is named.
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let (off, len) = segment(&pack, "tokenizer");
    edit_file(&pack, |bytes| {
        bytes[(off + len / 2) as usize] ^= 0x55;
    });
    let o = run("nflash", &run_args(&pack, &["--prompt", "w3 w4"]));
    assert_fails("nflash run", &o, &["checksum mismatch", "segment \"tokenizer\"", "convert it again"]);
    let o = run("nflash", &run_args(&pack, &["--verify", "--prompt", "w3 w4"]));
    assert_fails("nflash run --verify", &o, &["checksum mismatch", "segment \"tokenizer\""]);
}

#[test]
fn corrupt_resident_segment_without_verify() {
    // Half of the resident tensors overwritten: caught at load, not a silent wrong answer.
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let (off, len) = segment(&pack, "resident");
    edit_file(&pack, |bytes| {
        bytes[off as usize..(off + len / 2) as usize].fill(0xff);
    });
    let o = run("nflash", &run_args(&pack, &["--prompt", "w3 w4"]));
    assert_fails("nflash run", &o, &["checksum mismatch", "segment \"resident\""]);
}

// ------------------------------------------------------- nflash run input

#[test]
fn prompt_longer_than_context() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let prompt: Vec<String> = (0..40).map(|i| format!("w{}", 3 + i)).collect();
    let prompt = prompt.join(" ");
    let o = run("nflash", &run_args(&pack, &["--ctx", "16", "--raw", "--prompt", &prompt]));
    assert_fails("long prompt", &o, &["40 tokens", "16", "--ctx"]);
}

#[test]
fn empty_prompt_and_empty_prompt_file() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let o = run("nflash", &run_args(&pack, &["--prompt", ""]));
    assert_fails("--prompt \"\"", &o, &["prompt is empty"]);
    let o = run("nflash", &run_args(&pack, &["--prompt", "  \n "]));
    assert_fails("blank --prompt", &o, &["prompt is empty"]);
    let f = tmp.path().join("empty.txt");
    std::fs::write(&f, "").unwrap();
    let o = run("nflash", &run_args(&pack, &["--prompt-file", s(&f)]));
    assert_fails("empty --prompt-file", &o, &["prompt is empty", s(&f)]);
}

#[test]
fn prompt_file_not_utf8() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let f = tmp.path().join("utf16.txt");
    std::fs::write(&f, [0xff, 0xfe, b'h', 0, b'i', 0]).unwrap();
    let o = run("nflash", &run_args(&pack, &["--prompt-file", s(&f)]));
    assert_fails("non-UTF-8 prompt file", &o, &[s(&f), "not UTF-8", "offset 0"]);
}

#[test]
fn missing_prompt_file() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let f = tmp.path().join("nope.txt");
    let o = run("nflash", &run_args(&pack, &["--prompt-file", s(&f)]));
    assert_fails("missing prompt file", &o, &[s(&f), "No such file"]);
}

// ------------------------------------------------------- user mistakes

#[test]
fn nonexistent_model_path() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope.nflash");
    let o = run("nflash", &run_args(&missing, &["--prompt", "hi"]));
    assert_fails("nflash run", &o, &[s(&missing), "no such file", "prep convert"]);
    let o = run("prep", &["inspect", s(&missing)]);
    assert_fails("prep inspect", &o, &[s(&missing), "no such file"]);
    let ck = tmp.path().join("no-ckpt");
    let out = tmp.path().join("out.nflash");
    let o = run("prep", &["convert", "--model", s(&ck), "--out", s(&out)]);
    assert_fails("prep convert", &o, &[s(&ck), "does not exist"]);
    assert_no_output(&out);
}

#[test]
fn directory_as_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let o = run("nflash", &run_args(&dir, &["--prompt", "hi"]));
    assert_fails("nflash run on a directory", &o, &[s(&dir), "directory", "prep convert"]);
    let o = run("prep", &["verify", s(&dir)]);
    assert_fails("prep verify on a directory", &o, &[s(&dir), "directory"]);
}

#[test]
fn checkpoint_file_as_model() {
    // A user passes the safetensors file instead of the converted pack.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let st = dir.join("model.safetensors");
    let o = run("nflash", &run_args(&st, &["--prompt", "hi"]));
    assert_fails("nflash run on safetensors", &o, &["not an nflash pack", "prep convert"]);
}

#[test]
fn unknown_quant_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let out = tmp.path().join("out.nflash");
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&out), "--quant", "q5_k"]);
    assert_fails("--quant q5_k", &o, &["q5_k", "--quant", "q4_0", "q8_0"]);
    assert_eq!(o.status.code(), Some(2), "clap usage errors exit 2");
    assert_no_output(&out);
}

#[test]
fn zero_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let o = run("nflash", &["run", "--model", s(&pack), "--prompt", "w3", "--max-tokens", "1", "--threads", "0"]);
    assert_fails("run --threads 0", &o, &["--threads", "at least 1"]);
    let f = tmp.path().join("text.txt");
    std::fs::write(&f, "w3 w4 w5").unwrap();
    let o = run("nflash", &["ppl", "--model", s(&pack), "--file", s(&f), "--threads", "0"]);
    assert_fails("ppl --threads 0", &o, &["--threads", "at least 1"]);
}

#[test]
fn out_under_a_regular_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let file = tmp.path().join("afile");
    std::fs::write(&file, "x").unwrap();
    let out = file.join("sub").join("out.nflash");
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&out), "--quant", "q8_0"]);
    assert_fails("--out under a file", &o, &[s(&file.join("sub")), "does not exist", "--out"]);
    assert!(!out.exists());
    assert_eq!(std::fs::read(&file).unwrap(), b"x", "the regular file was modified");
}

#[test]
fn out_is_an_existing_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let out = tmp.path().join("packs");
    std::fs::create_dir(&out).unwrap();
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&out), "--quant", "q8_0"]);
    assert_fails("--out is a directory", &o, &[s(&out), "is a directory", "--out"]);
    assert!(out.is_dir() && std::fs::read_dir(&out).unwrap().next().is_none(), "directory changed");
    assert_no_output(&out.with_file_name("packs.nflash"));
    for e in std::fs::read_dir(tmp.path()).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!n.contains(".tmp-"), "temporary file {n} was left behind");
    }
}

#[test]
fn ppl_on_empty_and_too_short_text() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let f = tmp.path().join("empty.txt");
    std::fs::write(&f, "").unwrap();
    let o = run("nflash", &["ppl", "--model", s(&pack), "--file", s(&f), "--threads", "1"]);
    assert_fails("ppl on empty text", &o, &[s(&f), "0 tokens", "at least 2"]);
    let f1 = tmp.path().join("one.txt");
    std::fs::write(&f1, "w3").unwrap();
    let o = run("nflash", &["ppl", "--model", s(&pack), "--file", s(&f1), "--threads", "1"]);
    assert_fails("ppl on one token", &o, &[s(&f1), "1 tokens", "at least 2"]);
}

#[test]
fn max_tokens_zero_generates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let o = run(
        "nflash",
        &["run", "--model", s(&pack), "--prompt", "w3 w4", "--max-tokens", "0", "--ignore-eos", "--temperature", "0"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "", "--max-tokens 0 printed text");
}

#[test]
fn chat_without_template() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let mut tc = read_json(&dir.join("tokenizer_config.json"));
    tc.as_object_mut().unwrap().remove("chat_template");
    write_json(&dir.join("tokenizer_config.json"), &tc);
    let pack = tmp.path().join("notemplate.nflash");
    convert(&dir, &pack, "q8_0");
    let o = run("nflash", &run_args(&pack, &["--chat", "--prompt", "w3"]));
    assert_fails("--chat without template", &o, &["no chat template", "--chat", "drop it"]);
    let o = run("nflash", &run_args(&pack, &["--system", "be brief", "--prompt", "w3"]));
    assert_fails("--system without template", &o, &["no chat template", "--system", "drop it"]);
    // Without a flag the prompt is sent as is.
    let o = run("nflash", &run_args(&pack, &["--prompt", "w3"]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn system_with_raw_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let o = run("nflash", &run_args(&pack, &["--prompt", "w3 w4", "--raw", "--system", "be brief"]));
    assert_fails("--system with --raw", &o, &["--system", "--raw"]);
}

#[test]
fn full_context_stops_with_a_note() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    // 2 prompt tokens in a 3-token context: room for one generated token of the 2 asked.
    let o = run("nflash", &run_args(&pack, &["--ctx", "3", "--raw", "--prompt", "w3 w4", "--ignore-eos"]));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("context (3 tokens) is full"), "{err}");
}

/// SmolLM3 NoPE settings that do not describe the model: each a clear
/// error naming the key.
#[test]
fn smollm3_bad_nope_settings_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec { arch: "SmolLM3ForCausalLM", layers: 3, ..Default::default() };
    let dir = tiny_checkpoint(tmp.path(), &spec);
    let cfg = read_json(&dir.join("config.json"));
    let cases: [(&str, Value, &[&str]); 5] = [
        ("no_rope_layers", json!([1, 0]), &["no_rope_layers has 2 entries", "3 layers"]),
        ("no_rope_layers", json!([1, 2, 1]), &["no_rope_layers[1] = 2", "0 (NoPE layer) or 1"]),
        ("no_rope_layers", json!("all"), &["no_rope_layers", "not a list"]),
        ("no_rope_layer_interval", json!(0), &["no_rope_layer_interval is 0"]),
        ("use_sliding_window", json!(true), &["use_sliding_window", "SmolLM3ForCausalLM"]),
    ];
    for (key, value, needles) in cases {
        let mut c = cfg.clone();
        c[key] = value;
        write_json(&dir.join("config.json"), &c);
        convert_fails(&dir, needles);
    }
}

/// A Qwen3 config.json that omits keys transformers' `Qwen3Config` gives
/// defaults for converts with those defaults (head_dim 128 here, not
/// hidden / heads), and one with a sliding window is refused by name.
#[test]
fn qwen3_config_defaults_and_sliding_window() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec { arch: "Qwen3ForCausalLM", head_dim: Some(128), ..Default::default() };
    let dir = tiny_checkpoint(tmp.path(), &spec);
    let mut cfg = read_json(&dir.join("config.json"));
    for k in ["head_dim", "hidden_act", "attention_bias", "use_sliding_window", "rope_theta"] {
        cfg.as_object_mut().unwrap().remove(k);
    }
    write_json(&dir.join("config.json"), &cfg);
    let pack = tmp.path().join("q.nflash");
    convert(&dir, &pack, "f32");
    let c = nflash_format::Pack::open(&pack).unwrap().manifest().config.clone();
    assert_eq!((c.head_dim, c.activation, c.rope_theta), (128, nflash_format::Activation::Silu, 10000.0));
    cfg["use_sliding_window"] = json!(true);
    write_json(&dir.join("config.json"), &cfg);
    convert_fails(&dir, &["use_sliding_window", "Qwen3ForCausalLM"]);
}

/// Phi-3: a fused projection of the wrong shape and a partial rotary
/// factor RoPE cannot use are errors naming the tensor or the key.
#[test]
fn phi3_bad_fused_tensors_and_rotary_factors_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec { arch: "Phi3ForCausalLM", ..Default::default() };
    let dir = tiny_checkpoint(tmp.path(), &spec);
    let cfg = read_json(&dir.join("config.json"));
    // head_dim 16: 0.5625 rotates 9 elements (odd), 1.5 more than the head.
    for (f, needle) in [(0.5625, "rotates 9 elements"), (1.5, "partial_rotary_factor = 1.5")] {
        let mut c = cfg.clone();
        c["partial_rotary_factor"] = json!(f);
        write_json(&dir.join("config.json"), &c);
        convert_fails(&dir, &[needle]);
    }
    // LongRoPE: a factor list that does not match the rotated width (16 → 8 factors).
    let mut c = cfg.clone();
    c["rope_scaling"] = json!({"type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], "long_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]});
    write_json(&dir.join("config.json"), &c);
    convert_fails(&dir, &["rope_scaling.long_factor has 7 entries", "needs 8"]);
    c["rope_scaling"] = json!({"type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], "long_factor": [1.0, -1.0, 1, 1, 1, 1, 1, 1]});
    write_json(&dir.join("config.json"), &c);
    convert_fails(&dir, &["rope_scaling.long_factor holds -1"]);
    c["rope_scaling"] = json!({"type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]});
    write_json(&dir.join("config.json"), &c);
    convert_fails(&dir, &["long_factor"]);
    write_json(&dir.join("config.json"), &cfg);
    // One row short: the fused tensor of another model.
    let other = TinySpec { kv_heads: 1, ..spec.clone() };
    let dir2 = tmp.path().join("other");
    write_tiny_checkpoint(&dir2, &other);
    std::fs::copy(dir2.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    convert_fails(&dir, &["model.layers.0.self_attn.qkv_proj.weight", "shape"]);
    // Transposed ([64, 128] for [128, 64]: the same bytes): named as the
    // fused tensor, not as the q_proj it would be split into.
    write_tiny_checkpoint(&dir, &spec);
    let st = dir.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let views: Vec<(String, Vec<usize>, Vec<u8>, safetensors::Dtype)> = {
        let t = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        t.tensors().into_iter().map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec(), v.dtype())).collect()
    };
    let views: Vec<(String, safetensors::tensor::TensorView)> = views
        .iter()
        .map(|(n, shape, data, dt)| {
            let shape =
                if n == "model.layers.0.self_attn.qkv_proj.weight" { vec![shape[1], shape[0]] } else { shape.clone() };
            (n.clone(), safetensors::tensor::TensorView::new(*dt, shape, data).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &st).unwrap();
    convert_fails(&dir, &["tensor model.layers.0.self_attn.qkv_proj.weight has shape [64, 128], expected [128, 64]"]);
}

/// RoPE settings that convert used to accept and that turned into NaN at
/// run time (blamed on the weights): each is now refused at convert,
/// naming the key. Found by trying bad input on the architectures of
/// issue 44; the whole kind (any RoPE frequency an f32 cannot hold, any
/// non-positive scaling factor) is checked in `ModelConfig::check`.
#[test]
fn rope_settings_that_overflow_f32_are_refused_at_convert() {
    let tmp = tempfile::tempdir().unwrap();
    let phi3 = tiny_checkpoint(tmp.path(), &TinySpec { arch: "Phi3ForCausalLM", ..Default::default() });
    let base = read_json(&phi3.join("config.json"));
    let ones = json!([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    let tiny = json!([1e-39, 1e-39, 1e-39, 1e-39, 1e-39, 1e-39, 1e-39, 1e-39]);
    let cases: Vec<(&str, Value, &[&str])> = vec![
        (
            "rope_scaling",
            json!({"type": "longrope", "short_factor": ones, "long_factor": ones, "attention_factor": 1e8}),
            &["attention_factor"],
        ),
        (
            "rope_scaling",
            json!({"type": "longrope", "short_factor": ones, "long_factor": tiny}),
            &["RoPE frequency", "rope_scaling"],
        ),
        ("rope_theta", json!(1e-300), &["RoPE frequency", "rope_theta"]),
        ("rope_scaling", json!({"type": "linear", "factor": 0.0}), &["linear", "factor"]),
        ("rope_scaling", json!({"type": "linear", "factor": -2.0}), &["linear", "factor"]),
        (
            "rope_scaling",
            json!({"type": "llama3", "factor": 0.0, "low_freq_factor": 0.0, "high_freq_factor": 0.0, "original_max_position_embeddings": 64}),
            &["llama3", "positive"],
        ),
        (
            "rope_scaling",
            json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": -5.7}),
            &["original_max_position_embeddings"],
        ),
        ("rms_norm_eps", json!(1e300), &["rms_norm_eps"]),
        ("sliding_window", json!(0), &["sliding_window is 0"]),
    ];
    for (key, value, needles) in cases {
        let mut c = base.clone();
        c[key] = value;
        write_json(&phi3.join("config.json"), &c);
        convert_fails(&phi3, needles);
    }
}

/// Configs saved by transformers 5 keep RoPE settings in `rope_parameters`:
/// the pack is the one of the transformers 4 spelling (the scaling and the
/// partial rotary factor are not dropped).
#[test]
fn rope_parameters_of_transformers_5_read_as_rope_scaling() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        arch: "Phi3ForCausalLM",
        partial_rotary_factor: Some(0.5),
        longrope: Some((vec![1.0, 1.5, 2.0, 2.5], vec![3.0, 5.0, 7.0, 9.0])),
        ..Default::default()
    };
    let dir = tiny_checkpoint(tmp.path(), &spec);
    let v4 = tmp.path().join("v4.nflash");
    convert(&dir, &v4, "f32");
    let mut c = read_json(&dir.join("config.json"));
    let mut rp = c["rope_scaling"].clone();
    rp["rope_type"] = json!("longrope");
    rp["rope_theta"] = c["rope_theta"].clone();
    rp["partial_rotary_factor"] = json!(0.5);
    let obj = c.as_object_mut().unwrap();
    for k in ["rope_scaling", "rope_theta", "partial_rotary_factor"] {
        obj.remove(k);
    }
    c["rope_parameters"] = rp;
    write_json(&dir.join("config.json"), &c);
    let v5 = tmp.path().join("v5.nflash");
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&v5), "--quant", "f32"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // Given in rope_parameters, so not a class default.
    for k in ["rope_theta", "partial_rotary_factor"] {
        assert!(!err.contains(&format!("has no {k}")), "{k} called a default:\n{err}");
    }
    let cfg = |p: &Path| nflash_format::Pack::open(p).unwrap().manifest().config.clone();
    assert_eq!(cfg(&v5), cfg(&v4));
    assert!(matches!(cfg(&v5).rope_scaling, Some(nflash_format::RopeScaling::LongRope { .. })));
    assert_eq!(cfg(&v5).rotary_dim(), 8);
}

/// Keys a config lacks that transformers' class defaults fill are named
/// at convert (so a shape error after it can be traced to the default);
/// `nflash run --enable-thinking` on a pack without a chat template is an
/// error, as `--system` is.
#[test]
fn class_defaults_are_named_and_enable_thinking_needs_a_template() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec { arch: "Qwen3ForCausalLM", ..Default::default() });
    let mut c = read_json(&dir.join("config.json"));
    c.as_object_mut().unwrap().remove("head_dim");
    write_json(&dir.join("config.json"), &c);
    let err = convert_fails(&dir, &["q_proj"]);
    assert!(err.contains("note: config.json has no head_dim; using 128"), "{err}");
    c["head_dim"] = json!(16);
    write_json(&dir.join("config.json"), &c);
    let tc = dir.join("tokenizer_config.json");
    let mut t = read_json(&tc);
    t.as_object_mut().unwrap().remove("chat_template");
    write_json(&tc, &t);
    let pack = tmp.path().join("base.nflash");
    convert(&dir, &pack, "q8_0");
    let o = run("nflash", &["run", "--model", s(&pack), "--prompt", "w3", "--enable-thinking", "false"]);
    assert_fails("nflash run --enable-thinking without a template", &o, &["no chat template"]);
}

/// Gemma 3 settings that do not describe the model, and options nflash
/// does not run: each a clear error naming the key.
#[test]
fn gemma3_bad_settings_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::gemma3(1));
    let cfg = read_json(&dir.join("config.json"));
    let cases: [(&str, Value, &[&str]); 9] = [
        ("layer_types", json!(["sliding_attention", "full_attention"]), &["layer_types has 2 entries", "3 layers"]),
        (
            "layer_types",
            json!(["sliding_attention", "chunked_attention", "full_attention"]),
            &["layer_types[1]", "\"full_attention\""],
        ),
        ("layer_types", json!("sliding"), &["layer_types", "not a list"]),
        ("sliding_window_pattern", json!(0), &["sliding_window_pattern is 0"]),
        ("sliding_window", Value::Null, &["sliding_window is null", "layers 0, 2 sliding"]),
        ("final_logit_softcapping", json!(30.0), &["final_logit_softcapping = 30.0", "not supported"]),
        ("attn_logit_softcapping", json!(50.0), &["attn_logit_softcapping = 50.0"]),
        ("use_bidirectional_attention", json!(true), &["use_bidirectional_attention"]),
        ("hidden_activation", json!("tanh"), &["hidden_activation \"tanh\" is not supported"]),
    ];
    for (key, value, needles) in cases {
        let mut c = cfg.clone();
        c[key] = value;
        write_json(&dir.join("config.json"), &c);
        convert_fails(&dir, needles);
    }
    // transformers 5's rope_parameters that describe no RoPE, named by key path.
    let rp_cases: [(Value, &[&str]); 6] = [
        (json!("default"), &["rope_parameters = \"default\" is not an object"]),
        (json!({"full_attention": 7}), &["rope_parameters.full_attention = 7 is not an object"]),
        (json!({"sliding_attention": [1, 2]}), &["rope_parameters.sliding_attention = [1,2] is not an object"]),
        (json!({"full_attention": {"rope_type": 7, "factor": 8.0}}), &["rope_parameters.full_attention.rope_type = 7"]),
        (
            json!({"full_attention": {"factor": 8.0, "rope_theta": 1e6}}),
            &["rope_parameters.full_attention has factor but no rope_type"],
        ),
        (json!({"factor": 8.0}), &["rope_parameters has factor but no rope_type"]),
    ];
    for (rp, needles) in rp_cases {
        let mut c = cfg.clone();
        c["rope_parameters"] = rp;
        write_json(&dir.join("config.json"), &c);
        convert_fails(&dir, needles);
    }
    // dReLU is TurboSparse's, not Gemma's.
    let mut c = cfg.clone();
    c["hidden_activation"] = json!("drelu");
    write_json(&dir.join("config.json"), &c);
    convert_fails(&dir, &["\"drelu\" is TurboSparse's activation"]);
    // An image-and-text checkpoint without its text config.
    let mm = json!({"architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {}});
    write_json(&dir.join("config.json"), &mm);
    convert_fails(&dir, &["Gemma3ForConditionalGeneration without a text_config"]);
}

/// An image-and-text Gemma 3 whose tensor is stored under both of
/// transformers' prefixes is refused (either copy could be the one read);
/// a missing tensor is named as the checkpoint would store it; tensors no
/// layer reads (config.json describing fewer layers) are warned about; a
/// null rope_theta takes Gemma's default (1e6), as a missing one does.
#[test]
fn gemma3_image_and_text_names_nulls_and_unused_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mm");
    nflash_tests::write_tiny_checkpoint(&dir, &TinySpec { multimodal: true, ..TinySpec::gemma3(1) });
    let st = dir.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = file.tensors();
    let norm = "model.language_model.layers.0.input_layernorm.weight";
    let view = tensors.iter().find(|(n, _)| n == norm).unwrap().1.clone();
    let write = |list: &[(String, safetensors::tensor::TensorView)]| {
        safetensors::serialize_to_file(list.iter().map(|(n, v)| (n.clone(), v.clone())), None, &st).unwrap()
    };
    write(&[tensors.clone(), vec![("language_model.model.layers.0.input_layernorm.weight".into(), view)]].concat());
    convert_fails(
        &dir,
        &[
            "stored twice",
            "model.language_model.layers.0.input_layernorm.weight",
            "language_model.model.layers.0.input_layernorm.weight",
        ],
    );
    tensors.retain(|(n, _)| n != "model.language_model.layers.1.pre_feedforward_layernorm.weight");
    write(&tensors);
    convert_fails(&dir, &["stored as model.language_model.layers.1.pre_feedforward_layernorm.weight"]);
    // A whole checkpoint again, described as 2 of its 3 layers, rope_theta null.
    std::fs::remove_dir_all(&dir).unwrap();
    nflash_tests::write_tiny_checkpoint(&dir, &TinySpec { multimodal: true, ..TinySpec::gemma3(1) });
    let mut c = read_json(&dir.join("config.json"));
    c["text_config"]["num_hidden_layers"] = json!(2);
    c["text_config"]["layer_types"] = json!(["sliding_attention", "full_attention"]);
    c["text_config"]["rope_theta"] = Value::Null;
    write_json(&dir.join("config.json"), &c);
    let pack = tmp.path().join("two.nflash");
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&pack), "--quant", "f32"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("warning: the checkpoint holds 13 tensors the model described by config.json does not use (model.language_model.layers.2."), "{err}");
    assert!(err.contains("rope_theta; using 1000000"), "{err}");
    assert_eq!(nflash_format::Pack::open(&pack).unwrap().manifest().config.rope_theta, 1e6);
}

/// A Gemma-3-4B-style text_config omits head_dim, query_pre_attn_scalar,
/// rope_theta, the activation and the layer pattern: transformers'
/// `Gemma3TextConfig` defaults fill them (named at convert), and the
/// transformers 5 spelling (`rope_parameters` per layer type) gives the
/// same pack; a scaled sliding-layer RoPE is refused.
#[test]
fn gemma3_text_config_defaults_and_rope_parameters_per_layer_type() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        arch: "Gemma3ForCausalLM",
        act: "gelu_pytorch_tanh",
        layers: 6,
        head_dim: Some(256),
        heads: 8,
        kv_heads: 4,
        hidden: 32,
        inter: 64,
        sliding_window: Some(8),
        multimodal: true,
        ..Default::default()
    };
    let dir = tiny_checkpoint(tmp.path(), &spec);
    let mut c = read_json(&dir.join("config.json"));
    let text = c["text_config"].as_object_mut().unwrap();
    for k in [
        "head_dim",
        "query_pre_attn_scalar",
        "rope_theta",
        "hidden_activation",
        "rope_local_base_freq",
        "num_attention_heads",
        "num_key_value_heads",
    ] {
        text.remove(k);
    }
    text.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": 8.0}));
    write_json(&dir.join("config.json"), &c);
    let v4 = tmp.path().join("v4.nflash");
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&v4), "--quant", "f32"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    for k in
        ["head_dim; using 256", "query_pre_attn_scalar; using 256", "rope_theta; using 1000000", "hidden_activation"]
    {
        assert!(err.contains(k), "{k} not named:\n{err}");
    }
    let cfg = |p: &Path| nflash_format::Pack::open(p).unwrap().manifest().config.clone();
    let g = cfg(&v4).gemma3().unwrap();
    assert_eq!((g.query_pre_attn_scalar, g.rope_local_base_freq), (256, 10000.0));
    assert_eq!(g.sliding_layers.iter().collect::<Vec<_>>(), [0, 1, 2, 3, 4], "every 6th layer is global");
    assert_eq!((cfg(&v4).rope_theta, cfg(&v4).activation), (1e6, nflash_format::Activation::GeluTanh));
    // transformers 5: rope_parameters per layer type.
    let text = c["text_config"].as_object_mut().unwrap();
    text.remove("rope_scaling");
    text.insert(
        "rope_parameters".into(),
        json!({"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    );
    write_json(&dir.join("config.json"), &c);
    let v5 = tmp.path().join("v5.nflash");
    convert(&dir, &v5, "f32");
    assert_eq!(cfg(&v5), cfg(&v4));
    c["text_config"]["rope_parameters"]["sliding_attention"]["rope_type"] = json!("linear");
    write_json(&dir.join("config.json"), &c);
    convert_fails(&dir, &["rope_parameters.sliding_attention", "rope_local_base_freq"]);
}

/// Checkpoint files that are not what they should be are named before any
/// long work: a tokenizer.json the tokenizers library cannot read (not
/// blamed on a pack that does not exist yet), a model.safetensors that is
/// a directory. A planned context beyond the model's is warned about, and
/// `nflash ppl`'s windows default to the model's context where it is under
/// 512 tokens (256 here), without the warning an over-long window gets.
#[test]
fn checkpoint_files_and_contexts_are_checked_up_front() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), &TinySpec::default());
    let tok = dir.join("tokenizer.json");
    let good = std::fs::read(&tok).unwrap();
    std::fs::write(&tok, "{garbage").unwrap();
    let calib = tmp.path().join("calib.txt");
    std::fs::write(&calib, nflash_tests::tiny_words(300, 80, 1)).unwrap();
    let out = tmp.path().join("t.nflash");
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&out), "--calib", s(&calib)]);
    let err = assert_fails(
        "garbage tokenizer.json",
        &o,
        &["tokenizer.json", "cannot be read by the tokenizers library", "re-download"],
    );
    assert!(!err.contains("pack may be corrupt"), "{err}");
    std::fs::write(&tok, good).unwrap();
    let st = dir.join("model.safetensors");
    let saved = tmp.path().join("saved.safetensors");
    std::fs::rename(&st, &saved).unwrap();
    std::fs::create_dir(&st).unwrap();
    convert_fails(&dir, &["model.safetensors is a directory"]);
    std::fs::remove_dir(&st).unwrap();
    std::fs::rename(&saved, &st).unwrap();
    let o = run(
        "prep",
        &[
            "convert",
            "--model",
            s(&dir),
            "--out",
            s(&out),
            "--quant",
            "q8_0",
            "--device",
            s(&nflash_tests::repo_root().join("profiles/dev-host.toml")),
            "--ctx",
            "1024",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("warning: --ctx 1024 exceeds the model's trained context (256 tokens"), "{err}");
    let o = run("nflash", &["ppl", "--model", s(&out), "--file", s(&calib), "--json"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("exceeds the model's trained context"), "{err}");
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["ctx"], 256);
}

/// A negative number given to an option reaches that option's own check,
/// in nflash and prep alike, instead of clap's "unexpected argument '-1'"
/// (which reads as if the option took no value).
#[test]
fn negative_numbers_reach_each_options_own_check() {
    let m = ["run", "--model", "/nonexistent.nflash", "--prompt", "hi"];
    for (extra, needles) in [
        (&["--draft-tokens", "-1"][..], &["'-1' for '--draft-tokens", "1..=16"][..]),
        (&["--temperature", "-0.5"], &["'-0.5' for '--temperature", "≥ 0"]),
        (&["--memory-budget", "-5MiB"], &["'-5MiB' for '--memory-budget", "cannot be negative"]),
        (&["--cold-cache", "-8MiB"], &["'-8MiB' for '--cold-cache", "cannot be negative"]),
    ] {
        let mut a = m.to_vec();
        a.extend_from_slice(extra);
        let o = run("nflash", &a);
        let e = assert_fails(&extra.join(" "), &o, needles);
        assert!(!e.contains("unexpected argument"), "{e}");
    }
    // A prompt that begins with a dash is a prompt: the run gets as far as the model.
    let o = run("nflash", &["run", "--model", "/nonexistent.nflash", "--prompt", "- a list"]);
    assert_fails("--prompt '- a list'", &o, &["/nonexistent.nflash"]);
    // A missing value still says one is required, not that the next word is unexpected.
    for opt in ["--memory-budget", "--draft-tokens"] {
        let o = run("nflash", &[&m[..], &[opt, "--max-tokens", "3"]].concat());
        assert_fails(&format!("{opt} without a value"), &o, &[&format!("a value is required for '{opt}")]);
    }
    let o = run("nflash", &["plan-sim", "--device", "x.toml", "--shape", "llama-7b", "--acceptance", "-0.1"]);
    assert_fails("plan-sim --acceptance -0.1", &o, &["--acceptance -0.1 is outside"]);
    let o = run("prep", &["convert", "--model", "/nonexistent", "--out", "/nonexistent.nflash", "--tokens", "-5"]);
    let e = assert_fails("prep convert --tokens -5", &o, &["'-5' for '--tokens"]);
    assert!(!e.contains("unexpected argument"), "{e}");
}
