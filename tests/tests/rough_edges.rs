//! The rough edges a new user hit (issue 19): bad numbers in checkpoints,
//! special token ids, sharded indexes, output paths, f16 fallback, labels,
//! profiles of another checkpoint, cluster sizes, units, defaults and the
//! command line. Each test fails on the code before the fix.

use std::path::{Path, PathBuf};

use nflash_tests::{
    assert_fails, assert_no_output, convert, convert_with, run, tiny_words, write_tiny_checkpoint, TinySpec,
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
    let mut args = vec!["convert", "--model", s(dir), "--out", s(&out)];
    args.extend_from_slice(extra);
    let e = assert_fails("prep convert", &run("prep", &args), needles);
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
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&out), "--quant", "q8_0"]);
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
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&pack), "--quant", "q4_0"]);
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
    let o = run("prep", &["convert", "--model", s(&plain), "--out", s(&pack2), "--quant", "q4_0"]);
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
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&pack), "--quant", "q8_0"]);
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
    let o = run(
        "prep",
        &[
            "convert",
            "--model",
            s(&dir),
            "--out",
            s(&pack),
            "--quant",
            "q8_0",
            "--device",
            s(&dev),
            "--memory-budget",
            "64MiB",
        ],
    );
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
