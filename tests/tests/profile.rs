//! `prep profile` end to end on tiny random checkpoints: deterministic output,
//! a file whose counts agree with its own thresholds, and clean failures on
//! bad input.
//!
//! The file is decoded here with a copy of the structures of
//! tools/src/profile.rs (magic, u32 version, zstd(bincode)), so a format
//! change without a version bump fails these tests.

use std::path::{Path, PathBuf};
use std::process::Output;

use nflash_tests::{assert_no_temp, run, tiny_words, write_tiny_checkpoint, TinySpec};
use serde::Deserialize;

#[derive(Deserialize, Debug)]
#[allow(dead_code)]
struct Histogram {
    zeros: u64,
    counts: Vec<u64>,
    min_exp: i32,
    total: u64,
}

#[derive(Deserialize, Debug)]
#[allow(dead_code)]
struct ProfileModel {
    architecture: String,
    hidden_size: u64,
    intermediate_size: u64,
    num_layers: u64,
    activation: String,
    experts: u32,
    experts_per_token: u32,
}

#[derive(Deserialize, Debug)]
#[allow(dead_code)]
struct CalibInfo {
    source: String,
    n_tokens: u64,
    window: u32,
    n_windows: u32,
}

#[derive(Deserialize, Debug)]
struct LayerProfile {
    gate: Histogram,
    gate_up: Histogram,
    grid: Vec<f32>,
    gate_thresholds: Vec<f32>,
    gate_up_thresholds: Vec<f32>,
    gate_counts: Vec<Vec<u32>>,
    gate_up_counts: Vec<Vec<u32>>,
    sample: Vec<u16>,
}

#[derive(Deserialize, Debug)]
struct Profile {
    model: ProfileModel,
    #[allow(dead_code)]
    checkpoint: String,
    calib: CalibInfo,
    layers: Vec<LayerProfile>,
}

fn load(path: &Path) -> Profile {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..8], b"NFPROFIL");
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 3, "profile version");
    let raw = zstd::decode_all(&bytes[12..]).unwrap();
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .reject_trailing_bytes()
        .deserialize(&raw)
        .unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A tiny checkpoint and a calibration text of `words` words in `tmp`.
fn setup(tmp: &Path, spec: &TinySpec, words: usize) -> (PathBuf, PathBuf) {
    let dir = tmp.join("ckpt");
    write_tiny_checkpoint(&dir, spec);
    let calib = tmp.join("calib.txt");
    std::fs::write(&calib, tiny_words(words, spec.vocab, 11)).unwrap();
    (dir, calib)
}

fn profile(dir: &Path, calib: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["profile", "--model", s(dir), "--calib", s(calib), "--out", s(out)];
    args.extend_from_slice(extra);
    run("prep", &args)
}

#[track_caller]
fn profile_ok(dir: &Path, calib: &Path, out: &Path, extra: &[&str]) -> Profile {
    let o = profile(dir, calib, out, extra);
    assert!(o.status.success(), "prep profile failed: {}", String::from_utf8_lossy(&o.stderr));
    load(out)
}

/// Every layer's shapes, thresholds and counts agree with each other and with the grid.
#[track_caller]
fn check_consistent(p: &Profile, spec: &TinySpec, n_tokens: u64, n_sample: usize) {
    let inter = spec.inter;
    assert_eq!(p.model.num_layers, spec.layers as u64);
    assert_eq!(p.model.intermediate_size, inter as u64);
    assert_eq!(p.calib.n_tokens, n_tokens);
    assert_eq!(p.layers.len(), spec.layers);
    for (l, lp) in p.layers.iter().enumerate() {
        assert_eq!(lp.grid.len(), 19);
        assert!((lp.grid[9] - 0.5).abs() < 1e-6);
        assert_eq!(lp.sample.len(), n_sample * spec.hidden, "layer {l} sample");
        assert!(lp.sample.iter().all(|&b| half::f16::from_bits(b).is_finite()));
        for (h, thr, counts) in [
            (&lp.gate, &lp.gate_thresholds, &lp.gate_counts),
            (&lp.gate_up, &lp.gate_up_thresholds, &lp.gate_up_counts),
        ] {
            assert_eq!(h.total, n_tokens * inter as u64);
            assert_eq!(h.total, h.zeros + h.counts.iter().sum::<u64>());
            assert!(thr.windows(2).all(|w| w[0] <= w[1]), "layer {l}: thresholds not ascending: {thr:?}");
            assert_eq!(counts.len(), 19);
            let zero_frac = h.zeros as f64 / h.total as f64;
            for (k, c) in counts.iter().enumerate() {
                assert_eq!(c.len(), inter);
                assert!(c.iter().all(|&v| v as u64 <= n_tokens));
                let active = c.iter().map(|&v| v as f64).sum::<f64>() / (inter as f64 * n_tokens as f64);
                // Below the fraction of exact zeros the threshold is 0 and every non-zero value counts.
                // Typically within 0.2%; up to ~2% where one 1/32-octave bin holds much of the
                // mass (|gelu(g)| piles up at its minimum, 0.17).
                let expect = 1.0 - (lp.grid[k] as f64).max(zero_frac);
                assert!(
                    (active - expect).abs() < 0.03,
                    "{} {}: layer {l}, s = {}: mean active fraction {active:.4}, expected {expect:.4}, zeros {zero_frac:.4}",
                    spec.arch,
                    spec.act,
                    lp.grid[k]
                );
            }
        }
    }
}

#[test]
fn profile_is_deterministic_and_consistent() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec::default();
    let (dir, calib) = setup(tmp.path(), &spec, 3000);
    let (a, b) = (tmp.path().join("a.profile"), tmp.path().join("b.profile"));
    let extra = ["--tokens", "2000", "--window", "128", "--sample", "50"];
    let p = profile_ok(&dir, &calib, &a, &extra);
    profile_ok(&dir, &calib, &b, &extra);
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(), "two runs gave different files");
    // 15 windows of 128 tokens and one of 80.
    assert_eq!((p.calib.window, p.calib.n_windows), (128, 16));
    assert_eq!(p.calib.source, "calib.txt");
    assert_eq!(p.model.architecture, "LlamaForCausalLM");
    assert_eq!(p.model.activation, "silu");
    check_consistent(&p, &spec, 2000, 50);
    assert!(p.layers[0].gate.zeros == 0, "SiLU gives no exact zeros");
}

#[test]
fn profile_of_other_architectures() {
    let cases = [
        TinySpec {
            arch: "MistralForCausalLM",
            sliding_window: Some(5),
            dtype: "BF16",
            shards: 2,
            ..TinySpec::default()
        },
        TinySpec { arch: "Qwen2ForCausalLM", act: "relu", layers: 3, kv_heads: 1, ..TinySpec::default() },
        TinySpec { arch: "Qwen3ForCausalLM", head_dim: Some(24), ..TinySpec::default() },
        TinySpec { arch: "SmolLM3ForCausalLM", layers: 3, no_rope_layers: Some(vec![1, 0, 1]), ..TinySpec::default() },
        TinySpec { arch: "Phi3ForCausalLM", partial_rotary_factor: Some(0.75), ..TinySpec::default() },
        TinySpec::gemma3(1),
        TinySpec {
            act: "gelu_pytorch_tanh",
            llama3_scaling: true,
            heads: 2,
            kv_heads: 2,
            head_dim: Some(16),
            ..TinySpec::default()
        },
    ];
    for spec in cases {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, calib) = setup(tmp.path(), &spec, 700);
        let out = tmp.path().join("p.profile");
        // 700 tokens: 10 windows of 64 and one of 60; the sample is capped at the tokens run.
        let p = profile_ok(&dir, &calib, &out, &["--window", "64", "--sample", "5000"]);
        assert_eq!(p.calib.n_windows, 11, "{}", spec.arch);
        check_consistent(&p, &spec, 700, 700);
        if spec.act == "relu" {
            let h = &p.layers[0].gate;
            let zf = h.zeros as f64 / h.total as f64;
            assert!(zf > 0.2, "ReLU gives exact zeros: {zf}");
            assert_eq!(p.layers[0].gate_thresholds[0], 0.0);
        }
    }
}

/// A mixture of experts: one profile per expert, each over the tokens the
/// router sent it; a layer's experts together saw every token `top_k` times;
/// each count and sample within the expert's own tokens.
#[test]
fn profile_of_a_mixture_of_experts() {
    for spec in [
        TinySpec { arch: "MixtralForCausalLM", act: "relu", experts: 4, top_k: 2, ..TinySpec::default() },
        TinySpec { arch: "Qwen3MoeForCausalLM", experts: 6, top_k: 3, inter: 64, ..TinySpec::default() },
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, calib) = setup(tmp.path(), &spec, 700);
        let out = tmp.path().join("p.profile");
        let p = profile_ok(&dir, &calib, &out, &["--window", "64", "--sample", "200"]);
        assert_eq!((p.model.experts, p.model.experts_per_token), (spec.experts as u32, spec.top_k as u32));
        assert_eq!(p.layers.len(), spec.layers * spec.experts);
        let pairs = 700 * spec.inter as u64;
        for (l, layer) in p.layers.chunks(spec.experts).enumerate() {
            let seen: u64 = layer.iter().map(|e| e.gate.total).sum();
            assert_eq!(seen, pairs * spec.top_k as u64, "{} layer {l}", spec.arch);
            let sampled: usize = layer.iter().map(|e| e.sample.len() / spec.hidden).sum();
            assert_eq!(sampled, 200 * spec.top_k, "{} layer {l}: every sampled token once per routing", spec.arch);
            for (e, ep) in layer.iter().enumerate() {
                let routed = ep.gate.total / spec.inter as u64;
                assert!(routed < 700, "{} layer {l} expert {e}: all tokens routed to one expert", spec.arch);
                for c in ep.gate_counts.iter().chain(&ep.gate_up_counts) {
                    assert!(c.iter().all(|&v| v as u64 <= routed));
                }
            }
        }
        if spec.act == "relu" {
            assert!(p.layers.iter().all(|e| e.gate.zeros > 0), "ReLU experts give exact zeros");
        }
    }
}

// ------------------------------------------------------------- bad input

/// A clean failure (see [`nflash_tests::assert_fails`]) that left no output
/// (an existing directory passed as `out` is input, not output).
#[track_caller]
fn assert_fails(what: &str, o: &Output, out: &Path, needles: &[&str]) {
    nflash_tests::assert_fails(what, o, needles);
    if !out.is_dir() {
        assert!(!out.exists(), "{what}: {} was left behind", out.display());
    }
    assert_no_temp(out);
}

#[test]
fn bad_input_fails_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec::default();
    let (dir, calib) = setup(tmp.path(), &spec, 300);
    let out = tmp.path().join("p.profile");
    let file = |name: &str, bytes: &[u8]| {
        let p = tmp.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };

    let empty = file("empty.txt", b"");
    assert_fails("empty calib", &profile(&dir, &empty, &out, &[]), &out, &["empty.txt", "empty"]);

    let latin1 = file("latin1.txt", b"w3 w4 caf\xe9 w5");
    assert_fails("non-UTF-8 calib", &profile(&dir, &latin1, &out, &[]), &out, &["latin1.txt", "not UTF-8", "offset 9"]);

    let o = profile(&dir, &calib, &out, &["--window", "512"]);
    assert_fails("calib shorter than a window", &o, &out, &["only 300 tokens", "--window"]);

    let o = profile(&dir, &calib, &out, &["--tokens", "100", "--window", "128"]);
    assert_fails("--tokens below --window", &o, &out, &["--tokens 100", "--window 128"]);

    let o = profile(&dir, &calib, &out, &["--tokens", "0"]);
    assert_fails("--tokens 0", &o, &out, &["--tokens 0"]);

    let o = profile(&dir, &calib, &out, &["--window", "1"]);
    assert_fails("--window 1", &o, &out, &["--window 1", "at least 2"]);

    let outdir = tmp.path().join("outdir");
    std::fs::create_dir(&outdir).unwrap();
    let o = profile(&dir, &calib, &outdir, &["--window", "64"]);
    assert_fails("--out a directory", &o, &outdir, &["outdir", "is a directory"]);

    let missing = tmp.path().join("no-such-model");
    let o = profile(&missing, &calib, &out, &["--window", "64"]);
    assert_fails("missing model dir", &o, &out, &["no-such-model", "does not exist"]);

    let o = profile(&dir, &tmp.path().join("nothing.txt"), &out, &["--window", "64"]);
    assert_fails("missing calib", &o, &out, &["nothing.txt", "cannot read"]);

    // Sanity: the same arguments with a fitting window succeed.
    profile_ok(&dir, &calib, &out, &["--window", "64"]);
}
