//! The rough edges a new user hit (issue 19): bad numbers in checkpoints,
//! special token ids, sharded indexes, output paths, f16 fallback, labels,
//! profiles of another checkpoint, cluster sizes, units, defaults and the
//! command line. Each test fails on the code before the fix.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use nflash_tests::{
    assert_fails, assert_no_output, convert, convert_with, prep_convert, run, tiny_words, write_tiny_checkpoint,
    TinySpec,
};
use serde_json::{json, Value};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A tiny checkpoint `root/name` of `spec`.
fn checkpoint(root: &Path, name: &str, spec: &TinySpec) -> PathBuf {
    let dir = root.join(name);
    write_tiny_checkpoint(&dir, spec);
    dir
}

/// Overwrites element `index` (flat) of tensor `name` in the safetensors
/// file `file` with `value`, in the tensor's own dtype.
fn poke(file: &Path, name: &str, index: usize, value: f32) {
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header[name];
    let start = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize;
    let enc: Vec<u8> = match t["dtype"].as_str().unwrap() {
        "F32" => value.to_le_bytes().to_vec(),
        "F16" => half::f16::from_f32(value).to_le_bytes().to_vec(),
        "BF16" => half::bf16::from_f32(value).to_le_bytes().to_vec(),
        d => panic!("dtype {d}"),
    };
    let at = start + index * enc.len();
    bytes[at..at + enc.len()].copy_from_slice(&enc);
    std::fs::write(file, bytes).unwrap();
}

/// `prep convert` of `dir` with `extra` flags must fail naming `needles`, leaving no output.
#[track_caller]
fn convert_fails(dir: &Path, extra: &[&str], needles: &[&str]) -> String {
    let out = dir.parent().unwrap().join("refused.nflash");
    let e = assert_fails("prep convert", &prep_convert(dir, &out, extra), needles);
    assert_no_output(&out);
    e
}

// ------------------------------------------------ bad numbers in checkpoints

#[test]
fn non_finite_weights_are_refused_at_convert_naming_tensor_and_index() {
    let tmp = tempfile::tempdir().unwrap();
    // NaN, +inf and -inf, in an FFN matrix, an attention matrix and a norm, in each checkpoint dtype.
    let cases = [
        ("F32", "model.layers.1.mlp.up_proj.weight", 5, f32::NAN, "[0, 5]"),
        ("F16", "model.layers.0.self_attn.k_proj.weight", 64 * 3 + 7, f32::INFINITY, "[3, 7]"),
        ("BF16", "model.layers.1.post_attention_layernorm.weight", 9, f32::NEG_INFINITY, "[9]"),
    ];
    for (i, (dtype, tensor, index, value, coords)) in cases.into_iter().enumerate() {
        let dir = checkpoint(tmp.path(), &format!("c{i}"), &TinySpec { dtype, ..TinySpec::default() });
        poke(&dir.join("model.safetensors"), tensor, index, value);
        for quant in ["q4_0", "q8_0", "f16"] {
            convert_fails(&dir, &["--quant", quant], &[tensor, &format!("element {index}"), coords]);
        }
    }
}

#[test]
fn weights_beyond_the_stored_type_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "big", &TinySpec::default());
    // 1e5 does not fit F16 (max 65504); Q8_0 and Q4_0 blocks scale it and F32 keeps it.
    poke(&dir.join("model.safetensors"), "model.layers.0.mlp.down_proj.weight", 96 + 2, 1e5);
    convert_fails(
        &dir,
        &["--quant", "f16"],
        &["model.layers.0.mlp.down_proj.weight", "element 98", "[1, 2]", "beyond what f16"],
    );
    convert(&dir, &tmp.path().join("ok.nflash"), "q8_0");
    // 1e7 is beyond a Q4_0 block's scale (max/8 ≤ 65504) too.
    poke(&dir.join("model.safetensors"), "model.layers.0.mlp.down_proj.weight", 96 + 2, 1e7);
    convert_fails(&dir, &["--quant", "q4_0"], &["down_proj", "element 98", "beyond what q4_0"]);
    convert(&dir, &tmp.path().join("ok32.nflash"), "f32");
}

#[test]
fn special_token_ids_past_the_vocabulary_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec::default(); // vocab 80
    let cases: [(&str, &str, Value, &[&str]); 5] = [
        ("config.json", "eos_token_id", json!(80), &["config.json eos_token_id 80", "vocab_size is 80"]),
        ("config.json", "eos_token_id", json!([1, 500]), &["config.json eos_token_id 500"]),
        ("config.json", "bos_token_id", json!(81), &["config.json bos_token_id 81"]),
        ("generation_config.json", "eos_token_id", json!([1, 99]), &["generation_config.json eos_token_id 99"]),
        ("generation_config.json", "bos_token_id", json!(80), &["generation_config.json bos_token_id 80"]),
    ];
    for (i, (file, key, value, needles)) in cases.into_iter().enumerate() {
        let dir = checkpoint(tmp.path(), &format!("c{i}"), &spec);
        let mut j = read_json(&dir.join(file));
        j[key] = value;
        write_json(&dir.join(file), &j);
        convert_fails(&dir, &["--quant", "q8_0"], needles);
    }
}

#[test]
fn sharded_checkpoints_follow_the_weight_map_and_refuse_duplicates() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec { shards: 2, ..TinySpec::default() };
    let shard = |d: &Path, i: usize| d.join(format!("model-{i:05}-of-00002.safetensors"));

    // A tensor stored in both shards: an error naming both files.
    let dir = checkpoint(tmp.path(), "dup", &spec);
    let one = std::fs::read(shard(&dir, 1)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&one).unwrap();
    let two = std::fs::read(shard(&dir, 2)).unwrap();
    let st2 = safetensors::SafeTensors::deserialize(&two).unwrap();
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = st2.tensors();
    views.push(("model.embed_tokens.weight".into(), st.tensor("model.embed_tokens.weight").unwrap()));
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(shard(&dir, 2), bytes).unwrap();
    convert_fails(
        &dir,
        &["--quant", "q8_0"],
        &["model.embed_tokens.weight", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
    );

    // The index names a shard for a tensor that another shard holds: the
    // index and the files disagree.
    let dir = checkpoint(tmp.path(), "moved", &spec);
    let idx_path = dir.join("model.safetensors.index.json");
    let mut idx = read_json(&idx_path);
    let wm = idx["weight_map"].as_object_mut().unwrap();
    let (name, file) = wm.iter().find(|(_, f)| f.as_str() == Some("model-00002-of-00002.safetensors")).unwrap();
    let name = name.clone();
    assert_eq!(file, "model-00002-of-00002.safetensors");
    wm.insert(name.clone(), json!("model-00001-of-00002.safetensors"));
    write_json(&idx_path, &idx);
    convert_fails(&dir, &["--quant", "q8_0"], &[&name, "weight_map", "model-00001-of-00002.safetensors"]);

    // A shard the index does not name is not read (a stray file beside a good checkpoint).
    let dir = checkpoint(tmp.path(), "stray", &spec);
    std::fs::write(dir.join("model-00003-of-00002.safetensors"), b"not a safetensors file").unwrap();
    convert(&dir, &tmp.path().join("stray.nflash"), "q8_0");
}

#[test]
fn convert_into_a_missing_directory_fails_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let out = tmp.path().join("no/such/dir/x.nflash");
    let o = prep_convert(&dir, &out, &["--quant", "q8_0"]);
    assert_fails(
        "convert into a missing directory",
        &o,
        &[&tmp.path().join("no/such/dir").display().to_string(), "does not exist"],
    );
    assert!(!tmp.path().join("no").exists(), "prep created directories for --out");
    // The same for a profile.
    let calib = tmp.path().join("calib.txt");
    std::fs::write(&calib, tiny_words(200, 80, 1)).unwrap();
    let prof = tmp.path().join("gone/p.profile");
    let o = run("prep", &["profile", "--model", s(&dir), "--calib", s(&calib), "--out", s(&prof)]);
    assert_fails("profile into a missing directory", &o, &["gone", "does not exist"]);
    assert!(!tmp.path().join("gone").exists());
}

// ------------------------------------------------------------ what convert says

#[test]
fn f16_fallback_is_reported_by_convert_and_shown_by_inspect() {
    let tmp = tempfile::tempdir().unwrap();
    // head_dim 20: q_proj rows are 64 wide (quantized), o_proj rows 80 wide (not whole blocks).
    let dir = checkpoint(tmp.path(), "hd20", &TinySpec { head_dim: Some(20), ..TinySpec::default() });
    let pack = tmp.path().join("hd20.nflash");
    let o = prep_convert(&dir, &pack, &["--quant", "q4_0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("model.layers.*.self_attn.o_proj.weight (2 tensors") && e.contains("stored as f16, not q4_0"),
        "convert did not report the f16 fallback:\n{e}"
    );
    assert!(!e.contains("q_proj.weight (2 tensors"), "q_proj is quantized, not a fallback:\n{e}");
    let o = run("prep", &["inspect", s(&pack)]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("f16 fallback: model.layers.*.self_attn.o_proj.weight (2 tensors): rows of 80"), "{text}");
    let o = run("prep", &["inspect", "--json", s(&pack)]);
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        j["f16_fallback"],
        json!([{"tensors": "model.layers.*.self_attn.o_proj.weight", "count": 2, "row_elements": 80}])
    );
    // Without a fallback the list is empty and nothing is said.
    let plain = checkpoint(tmp.path(), "plain", &TinySpec::default());
    let pack2 = tmp.path().join("plain.nflash");
    let o = prep_convert(&plain, &pack2, &["--quant", "q4_0"]);
    assert!(o.status.success() && !stderr(&o).contains("stored as f16"), "{}", stderr(&o));
    let j: Value = serde_json::from_slice(&run("prep", &["inspect", "--json", s(&pack2)]).stdout).unwrap();
    assert_eq!(j["f16_fallback"], json!([]));
}

#[test]
fn drelu_models_are_labelled_drelu() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec { arch: "BambooForCausalLM", act: "relu", ..TinySpec::default() };
    let dir = checkpoint(tmp.path(), "bamboo", &spec);
    let pack = tmp.path().join("bamboo.nflash");
    let o = prep_convert(&dir, &pack, &["--quant", "q8_0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("(drelu, 2 layers"), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&run("prep", &["inspect", s(&pack)]).stdout).into_owned();
    assert!(text.contains("model: drelu, 2 layers"), "{text}");
    assert!(!text.contains("MistralForCausalLM"), "{text}");
    // Other models keep their class name and activation.
    let dir = checkpoint(tmp.path(), "llama", &TinySpec::default());
    let pack = tmp.path().join("llama.nflash");
    convert(&dir, &pack, "q8_0");
    let text = String::from_utf8_lossy(&run("prep", &["inspect", s(&pack)]).stdout).into_owned();
    assert!(text.contains("model: LlamaForCausalLM (silu), 2 layers"), "{text}");
}

#[test]
fn a_profile_of_another_checkpoint_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // Same shape, different weights (a fine-tune of a base, say).
    let a = checkpoint(tmp.path(), "a", &TinySpec { seed: 1, ..TinySpec::default() });
    let b = checkpoint(tmp.path(), "b", &TinySpec { seed: 2, ..TinySpec::default() });
    let calib = tmp.path().join("calib.txt");
    std::fs::write(&calib, tiny_words(1500, 80, 3)).unwrap();
    let prof = tmp.path().join("a.profile");
    let o = run(
        "prep",
        &["profile", "--model", s(&a), "--calib", s(&calib), "--out", s(&prof), "--tokens", "300", "--window", "50"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let args = ["--quant", "q8_0", "--profile", s(&prof), "--epochs", "3"];
    convert_fails(&b, &args, &["another checkpoint", "prep profile --model"]);
    // Its own checkpoint takes it.
    convert_with(&a, &tmp.path().join("a.nflash"), &args);
}

#[test]
fn convert_reports_the_cluster_size_the_plan_uses() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec { hidden: 128, inter: 1000, ..TinySpec::default() });
    let dev = nflash_tests::repo_root().join("profiles/oneplus-12.toml");
    let pack = tmp.path().join("p.nflash");
    let o = prep_convert(&dir, &pack, &["--quant", "q8_0", "--device", s(&dev), "--memory-budget", "64MiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    // "… N neurons of B bytes, X KiB (R KiB per read, …" and the plan's "LRU of R KiB neuron clusters".
    let said = e.lines().find(|l| l.contains("neuron cluster size")).unwrap_or_else(|| panic!("{e}"));
    let read_kib: u64 = said.split(" KiB per read").next().unwrap().rsplit('(').next().unwrap().trim().parse().unwrap();
    assert!(e.contains(&format!("LRU of {read_kib} KiB neuron clusters")), "convert said {said:?} but the plan:\n{e}");
    let m = nflash_format::Pack::open(&pack).unwrap();
    let f = &m.manifest().ffn[0];
    let neurons: u64 = said.split(": ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert_eq!(neurons, f.clusters[0].n_neurons as u64, "{said}");
}

// --------------------------------------------------------------- the runtime

/// `nflash run` of `pack` with `extra`, greedy, one thread; its output.
fn nflash_run(pack: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["run", "--model", s(pack), "--max-tokens", "2", "--seed", "1", "--threads", "1"];
    args.extend_from_slice(extra);
    run("nflash", &args)
}

/// Prompt tokens of `nflash run` with `extra`, from --stats-json.
fn prompt_tokens(pack: &Path, extra: &[&str]) -> u64 {
    let stats = pack.with_extension("stats.json");
    let mut args = vec!["--temperature", "0", "--stats-json", s(&stats)];
    args.extend_from_slice(extra);
    let o = nflash_run(pack, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    read_json(&stats)["prompt_tokens"].as_u64().unwrap()
}

#[test]
fn non_finite_activations_name_the_layer_and_sparse_ppl_fails_as_dense() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let calib = tmp.path().join("calib.txt");
    std::fs::write(&calib, tiny_words(1500, 80, 5)).unwrap();
    let pack = tmp.path().join("sparse.nflash");
    let mut args = vec!["--quant", "q8_0", "--calib", s(&calib), "--predictor", "exact"];
    args.extend_from_slice(&nflash_tests::QUICK_CALIB);
    convert_with(&dir, &pack, &args);
    // A NaN scale (f16 0x7E00) in the first gate block of layer 1's hottest neuron.
    let p = nflash_format::Pack::open(&pack).unwrap();
    let (_, seg) = p.segment_by_name("ffn.1").unwrap();
    let at = (seg.offset + p.manifest().ffn[1].clusters[0].offset) as usize;
    drop(p);
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[at..at + 2].copy_from_slice(&0x7E00u16.to_le_bytes());
    std::fs::write(&pack, bytes).unwrap();
    // The cluster's checksum (SPEC §4.10) catches it first; unchecked, the
    // NaN activations it produces are caught and named.
    let o = nflash_run(&pack, &["--raw", "--prompt", "w3 w4", "--temperature", "0"]);
    assert_fails("run", &o, &["neuron cluster 0 of layer 1", "CRC-32C"]);
    let o = nflash_run(&pack, &["--raw", "--prompt", "w3 w4", "--temperature", "0", "--verify", "off"]);
    assert_fails("run", &o, &["non-finite activations", "in layer 1", "prep verify"]);
    let text = tmp.path().join("eval.txt");
    std::fs::write(&text, tiny_words(300, 80, 9)).unwrap();
    for extra in [&[][..], &["--dense"][..]] {
        let mut a =
            vec!["ppl", "--model", s(&pack), "--file", s(&text), "--ctx", "32", "--threads", "1", "--verify", "off"];
        a.extend_from_slice(extra);
        let o = run("nflash", &a);
        assert_fails(&format!("ppl {extra:?}"), &o, &["non-finite activations", "in layer 1"]);
        assert!(!String::from_utf8_lossy(&o.stdout).contains("perplexity"), "{extra:?} printed a perplexity");
    }
}

#[test]
fn add_bos_token_is_honoured_for_raw_prompts() {
    let tmp = tempfile::tempdir().unwrap();
    let pack_with = |name: &str, add_bos: Option<bool>, post_processor: Value| -> PathBuf {
        let dir = checkpoint(tmp.path(), name, &TinySpec::default());
        let mut tc = read_json(&dir.join("tokenizer_config.json"));
        if let Some(b) = add_bos {
            tc["add_bos_token"] = json!(b);
        }
        write_json(&dir.join("tokenizer_config.json"), &tc);
        let mut tok = read_json(&dir.join("tokenizer.json"));
        tok["post_processor"] = post_processor;
        write_json(&dir.join("tokenizer.json"), &tok);
        let pack = tmp.path().join(format!("{name}.nflash"));
        convert(&dir, &pack, "q8_0");
        pack
    };
    // A post-processor that puts BOS (<|im_start|>, id 0 = bos_token_id) first, as Llama's does.
    let bos_first = json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [0], "tokens": ["<|im_start|>"]}}
    });
    let raw = ["--raw", "--prompt", "w3 w4"];
    // add_bos_token: true with a post-processor that adds nothing: BOS is prepended.
    assert_eq!(prompt_tokens(&pack_with("yes", Some(true), Value::Null), &raw), 3);
    // add_bos_token: false with a post-processor that adds BOS: none.
    assert_eq!(prompt_tokens(&pack_with("no", Some(false), bos_first.clone()), &raw), 2);
    // Not said: the post-processor decides, as Hugging Face does.
    assert_eq!(prompt_tokens(&pack_with("pp", None, bos_first), &raw), 3);
    assert_eq!(prompt_tokens(&pack_with("none", None, Value::Null), &raw), 2);
}

#[test]
fn instruct_packs_chat_by_default_and_raw_sends_the_prompt_as_is() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let pack = tmp.path().join("t.nflash");
    convert(&dir, &pack, "q8_0");
    let chat = prompt_tokens(&pack, &["--chat", "--prompt", "w3"]);
    assert_eq!(prompt_tokens(&pack, &["--prompt", "w3"]), chat, "the template is not applied by default");
    assert_eq!(prompt_tokens(&pack, &["--raw", "--prompt", "w3"]), 1);
    assert!(chat > 1);
    // A prompt file's final newline is not part of the user message.
    let f = tmp.path().join("p.txt");
    std::fs::write(&f, "w3\n").unwrap();
    assert_eq!(prompt_tokens(&pack, &["--prompt-file", s(&f)]), chat);
    // --help says so.
    let help = String::from_utf8_lossy(&run("nflash", &["run", "--help"]).stdout).into_owned();
    assert!(help.contains("--raw") && help.contains("the default when the pack has a template"), "{help}");
}

#[test]
fn sampling_defaults_come_from_generation_config_and_stats_say_which() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "gen", &TinySpec::default());
    write_json(
        &dir.join("generation_config.json"),
        &json!({"bos_token_id": 0, "eos_token_id": [1], "do_sample": true, "temperature": 0.0, "top_k": 7, "top_p": 0.5}),
    );
    let pack = tmp.path().join("gen.nflash");
    convert(&dir, &pack, "q8_0");
    let j: Value = serde_json::from_slice(&run("prep", &["inspect", "--json", s(&pack)]).stdout).unwrap();
    assert_eq!(j["metadata"]["generation"], json!({"temperature": 0.0, "top_p": 0.5, "top_k": 7}));
    let text = String::from_utf8_lossy(&run("prep", &["inspect", s(&pack)]).stdout).into_owned();
    assert!(
        text.contains("sampling defaults: temperature 0 (generation_config.json), top-k 7 (generation_config.json), top-p 0.5 (generation_config.json)"),
        "{text}"
    );
    let o = nflash_run(&pack, &["--prompt", "w3", "--stats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("sampling: temperature 0 (pack: generation_config.json), top-k 7 (pack: generation_config.json), top-p 0.5 (pack: generation_config.json)"), "{e}");
    // Temperature 0 from the pack is greedy: the seed does not matter.
    let out = |seed: &str| {
        let o = run(
            "nflash",
            &["run", "--model", s(&pack), "--prompt", "w3", "--max-tokens", "6", "--ignore-eos", "--seed", seed],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        o.stdout
    };
    assert_eq!(out("1"), out("2"));
    // A flag wins over the pack.
    let o = nflash_run(&pack, &["--prompt", "w3", "--stats", "--temperature", "0.3"]);
    assert!(stderr(&o).contains("temperature 0.3 (flag)"), "{}", stderr(&o));
    // do_sample: false is greedy, as in Hugging Face generate; nothing set: nflash's defaults.
    let dir2 = checkpoint(tmp.path(), "greedy", &TinySpec::default());
    write_json(&dir2.join("generation_config.json"), &json!({"do_sample": false, "temperature": 0.9}));
    let pack2 = tmp.path().join("greedy.nflash");
    convert(&dir2, &pack2, "q8_0");
    let o = nflash_run(&pack2, &["--prompt", "w3", "--stats"]);
    assert!(
        stderr(&o).contains("temperature 0 (pack: generation_config.json), top-k 40 (nflash default)"),
        "{}",
        stderr(&o)
    );
    let dir3 = checkpoint(tmp.path(), "plain", &TinySpec::default());
    let pack3 = tmp.path().join("plain.nflash");
    convert(&dir3, &pack3, "q8_0");
    let o = nflash_run(&pack3, &["--prompt", "w3", "--stats"]);
    assert!(stderr(&o).contains("sampling: temperature 0.8 (nflash default)"), "{}", stderr(&o));
    // Out-of-range values are refused at convert.
    write_json(&dir3.join("generation_config.json"), &json!({"top_p": 2.0}));
    convert_fails(&dir3, &["--quant", "q8_0"], &["generation_config.json", "top_p 2"]);
    let help = String::from_utf8_lossy(&run("nflash", &["run", "--help"]).stdout).into_owned();
    assert!(help.contains("generation_config.json"), "{help}");
}

#[test]
fn sampling_flags_out_of_range_get_range_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let pack = tmp.path().join("t.nflash");
    convert(&dir, &pack, "q8_0");
    for (flag, value, needle) in [
        ("--top-p", "-1", "(0, 1]"),
        ("--top-p", "0", "(0, 1]"),
        ("--top-p", "1.5", "(0, 1]"),
        ("--temperature", "inf", "finite number ≥ 0"),
        ("--temperature", "-1", "finite number ≥ 0"),
        ("--temperature", "NaN", "finite number ≥ 0"),
    ] {
        let o = nflash_run(&pack, &["--prompt", "w3", flag, value]);
        assert_fails(&format!("{flag} {value}"), &o, &[flag, value, needle]);
    }
}

/// Rewrites the manifest of `pack` through `edit` (same encoded length) and
/// fixes both CRCs, so only the reader's own checks can refuse it.
fn edit_manifest(pack: &Path, edit: impl FnOnce(&mut nflash_format::Manifest)) {
    use bincode::Options;
    let p = nflash_format::Pack::open(pack).unwrap();
    let mut m = p.manifest().clone();
    let h = *p.header();
    drop(p);
    edit(&mut m);
    let enc = bincode::DefaultOptions::new().with_fixint_encoding().with_little_endian().serialize(&m).unwrap();
    assert_eq!(enc.len() as u64, h.manifest_bytes);
    let mut bytes = std::fs::read(pack).unwrap();
    let off = h.manifest_offset as usize;
    bytes[off..off + enc.len()].copy_from_slice(&enc);
    bytes[32..36].copy_from_slice(&crc32fast::hash(&enc).to_le_bytes());
    let hc = crc32fast::hash(&bytes[..60]);
    bytes[60..64].copy_from_slice(&hc.to_le_bytes());
    std::fs::write(pack, bytes).unwrap();
}

#[test]
fn contexts_past_the_cap_are_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let pack = tmp.path().join("t.nflash");
    convert(&dir, &pack, "q8_0");
    // From the manifest.
    let bad = tmp.path().join("bad.nflash");
    std::fs::copy(&pack, &bad).unwrap();
    edit_manifest(&bad, |m| m.config.max_position_embeddings = 1 << 40);
    let o = nflash_run(&bad, &["--prompt", "w3"]);
    assert_fails("manifest context", &o, &["max_position_embeddings", "1099511627776", "1048576"]);
    // From config.json at convert.
    let mut c = read_json(&dir.join("config.json"));
    c["max_position_embeddings"] = json!(1u64 << 21);
    write_json(&dir.join("config.json"), &c);
    convert_fails(&dir, &["--quant", "q8_0"], &["max_position_embeddings", "2097152"]);
    // From the command line.
    let o = nflash_run(&pack, &["--prompt", "w3", "--ctx", "2000000"]);
    assert_fails("--ctx", &o, &["--ctx 2000000", "supported maximum of 1048576"]);
}

#[test]
fn manifest_decode_errors_carry_their_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let pack = tmp.path().join("t.nflash");
    convert(&dir, &pack, "q8_0");
    // The manifest framed 16 bytes short, CRCs fixed: decoding runs off its end.
    let mut bytes = std::fs::read(&pack).unwrap();
    let off = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let len = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize - 16;
    bytes[24..32].copy_from_slice(&(len as u64).to_le_bytes());
    let mc = crc32fast::hash(&bytes[off..off + len]);
    bytes[32..36].copy_from_slice(&mc.to_le_bytes());
    let hc = crc32fast::hash(&bytes[..60]);
    bytes[60..64].copy_from_slice(&hc.to_le_bytes());
    std::fs::write(&pack, bytes).unwrap();
    for o in [run("prep", &["inspect", s(&pack)]), nflash_run(&pack, &["--prompt", "w3"])] {
        let e = assert_fails("short manifest", &o, &["cannot be decoded", "ends inside a field"]);
        assert!(!e.contains("io error: \n") && !e.trim_end().ends_with("io error:"), "{e}");
    }
}

// ------------------------------------------------------- units and budgets

#[test]
fn sizes_need_a_unit_and_the_stated_minimum_budget_is_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec { hidden: 128, inter: 1024, ..TinySpec::default() });
    let pack = tmp.path().join("t.nflash");
    convert(&dir, &pack, "q8_0");
    for (cmd, flag) in [("run", "--memory-budget"), ("run", "--cold-cache")] {
        let o = nflash_run(&pack, &["--prompt", "w3", flag, "512"]);
        assert_fails(&format!("{cmd} {flag} 512"), &o, &[flag, "no unit", "512MiB"]);
    }
    let dev = nflash_tests::repo_root().join("profiles/oneplus-12.toml");
    let o = prep_convert(&dir, &tmp.path().join("x.nflash"), &["--device", s(&dev), "--memory-budget", "96"]);
    assert_fails("convert --memory-budget 96", &o, &["--memory-budget", "no unit", "96MiB"]);
    let o = run("nflash", &["plan-sim", "--device", s(&dev), "--model", s(&pack), "--memory-budget", "3"]);
    assert_fails("plan-sim --memory-budget 3", &o, &["no unit", "3MiB"]);
    // The minimum an error states is one number, and a run given it starts.
    let e = assert_fails(
        "1 MiB",
        &nflash_run(&pack, &["--prompt", "w3", "--memory-budget", "1MiB"]),
        &["short of the minimum, "],
    );
    let stated: u64 = e.split("short of the minimum, ").nth(1).unwrap().split(" MiB").next().unwrap().parse().unwrap();
    assert!(e.contains(&format!("use --memory-budget {stated}MiB or more")), "{e}");
    for _ in 0..3 {
        let o = nflash_run(&pack, &["--prompt", "w3", "--memory-budget", &format!("{stated}MiB"), "--stats"]);
        assert!(o.status.success(), "the stated minimum {stated} MiB was refused: {}", stderr(&o));
        // Figures per token in MiB.
        assert!(
            stderr(&o).contains("MiB read per token") && !stderr(&o).contains("KiB read per token"),
            "{}",
            stderr(&o)
        );
    }
}

#[test]
fn plan_sim_takes_a_pack_list_prints_mib_and_never_reads_more_than_the_cold_ffn() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = nflash_tests::repo_root().join("profiles/oneplus-12.toml");
    let a = tmp.path().join("a.nflash");
    let b = tmp.path().join("b.nflash");
    convert(&checkpoint(tmp.path(), "ca", &TinySpec::default()), &a, "q8_0");
    convert(&checkpoint(tmp.path(), "cb", &TinySpec { seed: 4, ..TinySpec::default() }), &b, "q4_0");
    let list = format!("{},{}", s(&a), s(&b));
    let o =
        run("nflash", &["plan-sim", "--device", s(&dev), "--model", &list, "--ffn-share", "1", "--sparsity", "0.5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("a.nflash") && out.contains("b.nflash"), "{out}");
    // Small budgets in MiB, not fractions of a GiB.
    assert!(out.contains("MiB ") && !out.contains("Gi "), "{out}");
    // The pack's own values override the shape options: said so.
    assert!(out.contains("--sparsity apply to --shape only"), "{out}");
    // Expected reads per token stay within the cold FFN bytes, speculation included.
    let o = run("nflash", &["plan-sim", "--device", s(&dev), "--shape", "llama-7b", "--sparsity", "0", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut speculated = 0;
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let j: Value = serde_json::from_str(line).unwrap();
        let Some(read) = j["read_bytes_per_token"].as_f64() else { continue };
        let cold = j["ffn_bytes"].as_f64().unwrap() * (1.0 - j["hot_share"].as_f64().unwrap());
        assert!(read <= cold * 1.000001, "{read} bytes read per token of {cold} cold FFN bytes: {j}");
        speculated += j["speculated_layers"].as_u64().unwrap();
    }
    assert!(speculated > 0, "no row speculated, so the cap was not exercised");
}

// ----------------------------------------------------------------- progress

#[test]
fn long_stages_report_progress_without_a_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec { hidden: 128, inter: 512, ..TinySpec::default() });
    let calib = tmp.path().join("calib.txt");
    std::fs::write(&calib, tiny_words(4000, 80, 5)).unwrap();
    let pack = tmp.path().join("p.nflash");
    // stderr is a pipe here, as in a log; lines every 0.02 s instead of 10 s.
    let o = std::process::Command::new(nflash_tests::bin("prep"))
        .args(["convert", "--model", s(&dir), "--out", s(&pack), "--quant", "q8_0", "--calib", s(&calib)])
        .args(["--tokens", "3000", "--window", "100", "--epochs", "20"])
        .env("NFLASH_PROGRESS_SECS", "0.02")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    let lines: Vec<&str> = e.lines().filter(|l| l.contains("elapsed, ETA")).collect();
    for stage in ["profile", "predictors"] {
        assert!(lines.iter().any(|l| l.starts_with(stage)), "no progress line for {stage}:\n{e}");
    }
    for l in &lines {
        let pct: f64 = l.split("% (").next().unwrap().rsplit(' ').next().unwrap().parse().unwrap();
        assert!((0.0..=100.0).contains(&pct), "{l}");
    }
}

// ------------------------------------------- found by trying to break it

#[test]
fn outputs_never_replace_inputs_or_special_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let calib = tmp.path().join("calib.txt");
    std::fs::write(&calib, tiny_words(300, 80, 1)).unwrap();
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    for out in [dir.join("model.safetensors"), dir.join("tokenizer.json"), calib.clone()] {
        let o = run(
            "prep",
            &[
                "profile",
                "--model",
                s(&dir),
                "--calib",
                s(&calib),
                "--out",
                s(&out),
                "--tokens",
                "100",
                "--window",
                "50",
            ],
        );
        assert_fails(&format!("profile --out {}", out.display()), &o, &["--out", "destroy"]);
    }
    assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), weights);
    let fifo = tmp.path().join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let o = prep_convert(&dir, &fifo, &["--quant", "q8_0"]);
    assert_fails("convert --out FIFO", &o, &["not a regular file"]);
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
    let o = prep_convert(&dir, &calib, &["--quant", "q8_0", "--calib", s(&calib)]);
    assert_fails("convert --out the calibration text", &o, &["also an input"]);
}

#[test]
fn metadata_must_be_an_object_and_verify_checks_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let pack = tmp.path().join("t.nflash");
    convert(&dir, &pack, "q8_0");
    // "{}" becomes "[]" (same length), with the segment CRC fixed in the manifest.
    let p = nflash_format::Pack::open(&pack).unwrap();
    let (idx, seg) = p.segment_by_name("metadata").unwrap();
    let seg = seg.clone();
    drop(p);
    assert_eq!(seg.bytes, 2);
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[seg.offset as usize..seg.offset as usize + 2].copy_from_slice(b"[]");
    std::fs::write(&pack, bytes).unwrap();
    edit_manifest(&pack, |m| m.segments[idx as usize].crc32 = crc32fast::hash(b"[]"));
    assert_fails("verify", &run("prep", &["verify", s(&pack)]), &["metadata", "not a JSON object"]);
    assert_fails("run", &nflash_run(&pack, &["--prompt", "w3"]), &["metadata", "not a JSON object"]);
}

#[test]
fn bad_generation_and_tokenizer_settings_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, Value, &str); 4] = [
        ("generation_config.json", json!({"do_sample": "yes", "temperature": 0.5}), "do_sample"),
        ("generation_config.json", json!([]), "not a JSON object"),
        ("generation_config.json", json!({"temperature": 1e300}), "temperature"),
        ("tokenizer_config.json", json!({"add_bos_token": "true"}), "add_bos_token"),
    ];
    for (i, (file, v, needle)) in cases.into_iter().enumerate() {
        let dir = checkpoint(tmp.path(), &format!("c{i}"), &TinySpec::default());
        write_json(&dir.join(file), &v);
        convert_fails(&dir, &["--quant", "q8_0"], &[file, needle]);
    }
    // --cold-cache near 2^64 does not wrap around the budget check.
    let dir = checkpoint(tmp.path(), "ok", &TinySpec::default());
    let pack = tmp.path().join("ok.nflash");
    convert(&dir, &pack, "q8_0");
    let o = nflash_run(&pack, &["--prompt", "w3", "--memory-budget", "64MiB", "--cold-cache", "18446744073709551615B"]);
    assert_fails("huge --cold-cache", &o, &["--cold-cache", "more than the"]);
}

#[test]
fn a_checkpoint_with_both_layouts_uses_model_safetensors_as_hugging_face_does() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "both", &TinySpec { shards: 2, ..TinySpec::default() });
    // A single file with other weights beside the shards: it is the one read.
    let single = checkpoint(tmp.path(), "single", &TinySpec { seed: 9, ..TinySpec::default() });
    std::fs::copy(single.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let (a, b) = (tmp.path().join("a.nflash"), tmp.path().join("b.nflash"));
    let o = prep_convert(&dir, &a, &["--quant", "q8_0"]);
    assert!(o.status.success() && stderr(&o).contains("using model.safetensors"), "{}", stderr(&o));
    convert(&single, &b, "q8_0");
    let ta = nflash_format::Pack::open(&a).unwrap().tensor("model.norm.weight").unwrap().1.to_vec();
    let tb = nflash_format::Pack::open(&b).unwrap().tensor("model.norm.weight").unwrap().1.to_vec();
    assert_eq!(ta, tb);
}

#[test]
fn interactive_mode_refuses_raw_and_cluster_bytes_take_units() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "ckpt", &TinySpec::default());
    let pack = tmp.path().join("t.nflash");
    convert_with(&dir, &pack, &["--quant", "q8_0", "--cluster-bytes", "2KiB"]);
    let m = nflash_format::Pack::open(&pack).unwrap();
    let f = &m.manifest().ffn[0];
    assert_eq!(f.clusters[0].n_neurons as u64, 2048 / f.bundle.bundle_bytes);
    let o = nflash_run(&pack, &["--raw"]);
    assert_fails("interactive --raw", &o, &["--raw", "interactive"]);
    // nflash ppl in a log: whole lines, no carriage returns.
    let text = tmp.path().join("eval.txt");
    std::fs::write(&text, tiny_words(300, 80, 9)).unwrap();
    let o = run("nflash", &["ppl", "--model", s(&pack), "--file", s(&text), "--ctx", "32"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains('\r') && stderr(&o).contains("window 10/10"), "{:?}", stderr(&o));
}
