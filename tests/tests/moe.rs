//! Mixtures of experts (Mixtral, TurboSparse-Mixtral, Qwen3-MoE): bad
//! configs refused by `prep convert`, and quantized packs giving the same
//! tokens wherever their experts' neuron clusters live.

use std::collections::HashMap;
use std::path::Path;

use nflash_tests::{
    assert_fails, assert_no_output, check_placement_and_threads, convert, run, write_tiny_checkpoint, TinySpec,
};
use serde_json::{json, Value};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn mixtral() -> TinySpec {
    TinySpec { arch: "MixtralForCausalLM", tied: false, rope_theta: 1e6, seed: 31, ..Default::default() }
}

fn qwen3_moe() -> TinySpec {
    TinySpec { arch: "Qwen3MoeForCausalLM", experts: 8, top_k: 3, inter: 64, seed: 32, ..Default::default() }
}

/// `prep convert` of `dir` (after `edit` changed its config.json) fails
/// naming `needles`, and leaves no output.
#[track_caller]
fn config_refused(spec: &TinySpec, edit: impl FnOnce(&mut Value), needles: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    write_tiny_checkpoint(&dir, spec);
    let path = dir.join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let out = tmp.path().join("out.nflash");
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&out), "--quant", "q8_0"]);
    assert_fails("prep convert", &o, needles);
    assert_no_output(&out);
}

#[test]
fn bad_moe_configs_are_clear_errors() {
    config_refused(&mixtral(), |c| c["num_experts_per_tok"] = json!(5), &["num_experts_per_tok = 5", "4 experts"]);
    config_refused(&mixtral(), |c| c["num_experts_per_tok"] = json!(0), &["num_experts_per_tok = 0"]);
    config_refused(&qwen3_moe(), |c| c["num_experts"] = json!(0), &["num_experts = 0"]);
    config_refused(
        &mixtral(),
        |c| {
            c.as_object_mut().unwrap().remove("num_local_experts");
        },
        &["num_local_experts", "required"],
    );
    config_refused(&qwen3_moe(), |c| c["decoder_sparse_step"] = json!(2), &["decoder_sparse_step = 2"]);
    config_refused(&qwen3_moe(), |c| c["mlp_only_layers"] = json!([0]), &["mlp_only_layers"]);
    config_refused(&qwen3_moe(), |c| c["mlp_only_layers"] = json!(5), &["mlp_only_layers = 5", "not a list"]);
    config_refused(&qwen3_moe(), |c| c["num_experts_per_tok"] = json!("3"), &["num_experts_per_tok", "integer"]);
    // More experts in the config than in the weights: the first missing one is named.
    config_refused(
        &mixtral(),
        |c| c["num_local_experts"] = json!(6),
        &["block_sparse_moe.gate.weight", "[4, 64]", "[6, 64]"],
    );
    config_refused(
        &TinySpec { arch: "TurboSparseMixtralForCausalLM", act: "silu", ..mixtral() },
        |_| {},
        &["TurboSparseMixtralForCausalLM", "dReLU"],
    );
}

/// Rewrites the checkpoint's `model.safetensors` with `f` applied to its tensors.
fn edit_tensors(dir: &Path, f: impl FnOnce(&mut HashMap<String, (Vec<usize>, Vec<u8>)>)) {
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut t: HashMap<String, (Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec()))).collect();
    f(&mut t);
    let views: HashMap<String, safetensors::tensor::TensorView> = t
        .iter()
        .map(|(n, (shape, data))| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &file).unwrap();
}

#[test]
fn missing_expert_and_bad_router_are_named() {
    for (spec, missing) in [
        (mixtral(), "model.layers.1.block_sparse_moe.experts.3.w3.weight"),
        (qwen3_moe(), "model.layers.0.mlp.experts.7.down_proj.weight"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        write_tiny_checkpoint(&dir, &spec);
        edit_tensors(&dir, |t| {
            t.remove(missing).unwrap();
        });
        let out = tmp.path().join("out.nflash");
        let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&out)]);
        assert_fails("prep convert", &o, &[missing, "missing"]);
        assert_no_output(&out);
    }
    // A router with a row too few.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    write_tiny_checkpoint(&dir, &qwen3_moe());
    let router = "model.layers.1.mlp.gate.weight";
    edit_tensors(&dir, |t| {
        let (shape, data) = t.get_mut(router).unwrap();
        shape[0] -= 1;
        data.truncate(shape[0] * shape[1] * 4);
    });
    let out = tmp.path().join("out.nflash");
    let o = run("prep", &["convert", "--model", s(&dir), "--out", s(&out)]);
    assert_fails("prep convert", &o, &[router, "[7, 64]", "[8, 64]"]);
    assert_no_output(&out);
}

/// A q4_0 pack of `spec` in `tmp`.
fn pack(tmp: &Path, spec: &TinySpec, quant: &str) -> std::path::PathBuf {
    let dir = tmp.join("ckpt");
    write_tiny_checkpoint(&dir, spec);
    let out = tmp.join("moe.nflash");
    convert(&dir, &out, quant);
    out
}

#[test]
fn mixtral_q4_0_same_tokens_under_every_placement() {
    let tmp = tempfile::tempdir().unwrap();
    check_placement_and_threads(&pack(tmp.path(), &TinySpec { vocab: 96, ..mixtral() }, "q4_0"));
}

#[test]
fn qwen3_moe_q8_0_same_tokens_under_every_placement() {
    let tmp = tempfile::tempdir().unwrap();
    check_placement_and_threads(&pack(tmp.path(), &TinySpec { vocab: 96, ..qwen3_moe() }, "q8_0"));
}

#[test]
fn turbosparse_mixtral_is_mixtral_with_drelu_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec { arch: "TurboSparseMixtralForCausalLM", act: "relu", vocab: 96, ..mixtral() };
    let p = pack(tmp.path(), &spec, "q8_0");
    let o = run("prep", &["inspect", "--json", s(&p)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["config"]["activation"], json!("DRelu"), "{j}");
    assert!(j["config"]["architecture"].to_string().contains("Mixtral"), "{j}");
    check_placement_and_threads(&p);
    let o = run("prep", &["inspect", s(&p)]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("4 experts per layer") && text.contains("2 per token") && text.contains("drelu-moe"),
        "{text}"
    );
    assert!(text.contains("FFN: 8 experts × 96 neurons"), "{text}");
}

/// `--hot-fraction` pins whole clusters: with one cluster per expert, 0.9
/// pins every expert (the nearest boundary) rather than none (rounding down).
#[test]
fn hot_fraction_pins_the_nearest_cluster_boundary() {
    let tmp = tempfile::tempdir().unwrap();
    let p = pack(tmp.path(), &TinySpec { vocab: 96, ..mixtral() }, "q4_0");
    let n = nflash_format::Pack::open(&p).unwrap();
    assert!(n.manifest().ffn.iter().all(|f| f.clusters.len() == 1), "the fixture needs one cluster per expert");
    drop(n);
    let stats = tmp.path().join("s.json");
    for (f, hot) in [("0.9", true), ("0.2", false)] {
        let o = run(
            "nflash",
            &[
                "run",
                "--model",
                s(&p),
                "--prompt",
                "w5 w9",
                "--max-tokens",
                "4",
                "--hot-fraction",
                f,
                "--stats-json",
                s(&stats),
            ],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let st: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
        assert_eq!(st["hot_bytes"].as_u64().unwrap() > 0, hot, "--hot-fraction {f}: {st}");
        if !hot {
            assert!(String::from_utf8_lossy(&o.stderr).contains("pins 0% of the FFN"));
        }
    }
}

#[test]
fn nflash_run_generates_from_a_moe_pack_with_and_without_a_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let p = pack(tmp.path(), &TinySpec { vocab: 96, ..mixtral() }, "q4_0");
    let gen = |extra: &[&str]| {
        let mut args =
            vec!["run", "--model", s(&p), "--prompt", "w5 w9 w11", "--max-tokens", "12", "--temperature", "0"];
        args.extend_from_slice(extra);
        let o = run("nflash", &args);
        assert!(o.status.success(), "nflash run {extra:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let free = gen(&[]);
    assert!(!free.trim().is_empty());
    // 2 MiB above the minimum nflash states for this pack: the runtime part
    // of it is this process's measured footprint, which varies by about a
    // MiB from run to run (a fixed 14 MiB, 1 MiB above it, failed once in CI).
    let o = run("nflash", &["run", "--model", s(&p), "--prompt", "w5", "--memory-budget", "1KiB"]);
    let err = String::from_utf8_lossy(&o.stderr);
    let min: u64 = err
        .split("short of the minimum, ")
        .nth(1)
        .and_then(|r| r.split(" MiB").next())
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("a 1 KiB budget was not refused with the minimum: {err}"));
    assert_eq!(gen(&["--memory-budget", &format!("{}MiB", min + 2)]), free);
}

/// A sparse pack of `spec` calibrated on tiny words, in `tmp`.
fn sparse_pack(tmp: &Path, spec: &TinySpec, extra: &[&str]) -> std::path::PathBuf {
    let dir = tmp.join("ckpt");
    write_tiny_checkpoint(&dir, spec);
    let calib = tmp.join("calib.txt");
    std::fs::write(&calib, nflash_tests::tiny_words(3000, spec.vocab, 5)).unwrap();
    let out = tmp.join("sparse.nflash");
    let mut flags = vec!["--quant", "q4_0", "--cluster-bytes", "1KiB", "--calib", s(&calib)];
    flags.extend(["--tokens", "3000", "--window", "100", "--sample", "3000", "--epochs", "3"]);
    flags.extend_from_slice(extra);
    nflash_tests::convert_with(&dir, &out, &flags);
    out
}

/// A tiny TurboSparse-Mixtral: ReLU experts, 6 of them, 2 per token.
fn turbosparse() -> TinySpec {
    TinySpec {
        arch: "TurboSparseMixtralForCausalLM",
        act: "relu",
        vocab: 96,
        inter: 256,
        experts: 6,
        top_k: 2,
        ..mixtral()
    }
}

#[test]
fn sparse_turbosparse_mixtral_same_tokens_under_every_placement() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = turbosparse();
    let p = sparse_pack(tmp.path(), &spec, &[]);
    let pack = nflash_format::Pack::open(&p).unwrap();
    let m = pack.manifest();
    assert!(m.sparse.is_some() && m.ffn.iter().all(|f| f.sparse.is_some()));
    // The routed shares: a layer's experts sum to experts_per_token.
    let share = pack.unit_share().unwrap();
    assert_eq!(share.len(), 12);
    for layer in share.chunks(6) {
        assert!((layer.iter().sum::<f64>() - 2.0).abs() < 1e-4, "{share:?}");
    }
    assert!(pack.metadata().unwrap().experts.is_some());
    check_placement_and_threads(&p);
}

/// Greedy tokens and logits of `path` under `cfg`, with the layer-ahead
/// expert prediction misguided or not; the counters after.
fn decode(
    path: &Path,
    cfg: &nflash_plan::CacheConfig,
    misguide: bool,
) -> (Vec<Vec<f32>>, Vec<u32>, nflash_runtime::model::CacheStats, nflash_runtime::model::ExpertPrefetch) {
    let pack = nflash_format::Pack::open_resident(path).unwrap();
    let mut model = nflash_runtime::load_model(&pack, cfg).unwrap();
    model.set_speculation(nflash_runtime::model::Speculation::Always);
    model.misguide_expert_prefetch(misguide);
    let prompt: Vec<u32> = (0..12).map(|i| 3 + (i * 5) % 70).collect();
    let (logits, tokens) = nflash_tests::greedy(&model, &prompt, 16);
    (logits, tokens, model.cache_stats(), model.expert_prefetch())
}

#[test]
fn wrong_expert_prefetch_costs_reads_never_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec { vocab: 96, inter: 256, experts: 8, top_k: 2, ..mixtral() };
    let dense = pack(tmp.path(), &spec, "q4_0");
    let (ref_logits, ref_tokens, _, _) =
        decode(&dense, &nflash_plan::CacheConfig::all_hot(&nflash_format::Pack::open(&dense).unwrap()), false);
    // Nothing hot: every expert's clusters come from flash.
    let placements = nflash_tests::placements(&dense);
    let cold = &placements[2].1;
    let (logits, tokens, st, ep) = decode(&dense, cold, false);
    assert_eq!(tokens, ref_tokens);
    assert_eq!(
        nflash_tests::logit_bits(&logits),
        nflash_tests::logit_bits(&ref_logits),
        "logits differ with expert prefetch"
    );
    assert!(st.speculated > 0 && st.speculated_used > 0, "{st:?}");
    assert!(ep.guessed > 0 && ep.precision() > 0.5 && ep.recall() > 0.5, "{ep:?}");
    // The router's lowest-ranked experts instead: the same tokens, few of the reads used.
    let (logits, tokens, st_wrong, ep_wrong) = decode(&dense, cold, true);
    assert_eq!(tokens, ref_tokens);
    assert_eq!(
        nflash_tests::logit_bits(&logits),
        nflash_tests::logit_bits(&ref_logits),
        "logits differ with a misguided expert prefetch"
    );
    assert!(st_wrong.speculated > 0, "{st_wrong:?}");
    assert_eq!(ep_wrong.hit, 0, "the lowest-ranked experts were chosen: {ep_wrong:?}");
    assert!(st_wrong.speculated_used < st.speculated_used, "{st_wrong:?} vs {st:?}");
}

/// Damage met only by decode's reads in a mixture of experts: every
/// expert of layer 1 damaged, nothing hot, single tokens straight into
/// decode (no prefill). The layer-ahead expert prefetch, the reads started
/// for a token's second expert before its first computes (`fetch_ahead`)
/// and the experts' own fetches all stop decode with the cluster's
/// checksum error.
#[test]
fn damaged_experts_met_only_by_decode_reads_stop_decode() {
    use nflash_runtime::model::Speculation;
    let tmp = tempfile::tempdir().unwrap();
    let spec = turbosparse();
    let p = sparse_pack(tmp.path(), &spec, &[]);
    let names: Vec<String> = (0..6).map(|e| format!("ffn.1.{e}")).collect();
    nflash_tests::damage_segments(&p, &names.iter().map(String::as_str).collect::<Vec<_>>());
    for sp in [Speculation::Never, Speculation::Always] {
        let (err, st) = nflash_tests::decode_until_error(&p, sp, 8);
        for needle in ["neuron cluster", "layer 1", "CRC-32C stored"] {
            assert!(err.contains(needle), "{sp:?}: {needle:?} not in {err}");
        }
        if sp == Speculation::Always {
            assert!(st.speculated > 0, "nothing was read ahead: {st:?}");
        }
    }
}
