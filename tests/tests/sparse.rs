//! Sparse packs end to end on tiny random checkpoints: `prep convert --calib`
//! → sparse decode in the runtime.

use std::path::{Path, PathBuf};

use nflash_format::Pack;
use nflash_plan::CacheConfig;
use nflash_tests::{
    assert_fails, assert_no_output, rel_error_flat, run, tiny_words, write_tiny_checkpoint, TinySpec, QUICK_CALIB,
};

struct Fixture {
    _dir: tempfile::TempDir,
    ckpt: PathBuf,
    calib: PathBuf,
    root: PathBuf,
}

fn fixture(spec: &TinySpec) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    write_tiny_checkpoint(&ckpt, spec);
    let calib = dir.path().join("calib.txt");
    std::fs::write(&calib, tiny_words(1200, spec.vocab, 99)).unwrap();
    Fixture { root: dir.path().to_path_buf(), _dir: dir, ckpt, calib }
}

/// `prep convert` with calibration flags; panics with stderr on failure.
fn convert_sparse(f: &Fixture, name: &str, quant: &str, extra: &[&str]) -> PathBuf {
    let out = f.root.join(name);
    let mut args = vec![
        "convert",
        "--model",
        f.ckpt.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quant",
        quant,
        "--calib",
        f.calib.to_str().unwrap(),
    ];
    args.extend(QUICK_CALIB);
    args.extend_from_slice(extra);
    let o = run("prep", &args);
    assert!(o.status.success(), "prep convert failed: {}", String::from_utf8_lossy(&o.stderr));
    out
}

/// Logits of token-by-token decode (the sparse path unless `dense`).
fn decode_logits(pack: &Path, tokens: &[u32], dense: bool) -> Vec<f32> {
    let pack = Pack::open(pack).unwrap();
    let mut model = nflash_runtime::load_model(&pack, &CacheConfig::all_hot(&pack)).unwrap();
    model.set_dense(dense);
    let mut kv = model.new_kv_cache(tokens.len() + 1);
    tokens
        .iter()
        .flat_map(|&t| {
            let h = model.forward(&mut kv, &[t]).unwrap();
            model.logits(&h)
        })
        .collect()
}

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| (3 + (i * 7) % (vocab - 3)) as u32).collect()
}

#[test]
fn sparsity_zero_decode_is_bit_identical_to_dense() {
    let spec = TinySpec::default();
    let f = fixture(&spec);
    for quant in ["f32", "q8_0"] {
        let p = convert_sparse(&f, &format!("s0-{quant}.nflash"), quant, &["--sparsity", "0", "--predictor", "exact"]);
        let t = tokens(12, spec.vocab);
        assert_eq!(decode_logits(&p, &t, false), decode_logits(&p, &t, true), "{quant}");
    }
}

#[test]
fn relu_model_with_threshold_zero_gives_exactly_the_dense_result() {
    let spec = TinySpec { act: "relu", seed: 5, ..TinySpec::default() };
    let f = fixture(&spec);
    let p = convert_sparse(&f, "relu.nflash", "f32", &["--predictor", "exact"]);
    let pack = Pack::open(&p).unwrap();
    let m = pack.manifest();
    assert!(m.ffn.iter().all(|l| l.sparse.as_ref().unwrap().threshold == 0.0));
    let t = tokens(12, spec.vocab);
    let (sparse, dense) = (decode_logits(&p, &t, false), decode_logits(&p, &t, true));
    assert_eq!(sparse, dense);
    // And neurons really were skipped (ReLU zeros about half of them).
    let o = run(
        "nflash",
        &["ppl", "--model", p.to_str().unwrap(), "--file", f.calib.to_str().unwrap(), "--json", "--ctx", "40"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let s = j["ffn_sparsity"].as_f64().unwrap();
    assert!(s > 0.2 && s < 0.8, "ReLU sparsity {s}");
    assert_eq!(j["bundles_skipped"].as_f64().unwrap(), 0.0, "exact predictor reads every bundle");
}

#[test]
fn neuron_reordering_preserves_the_model_function() {
    let spec = TinySpec { inter: 160, ..TinySpec::default() };
    let f = fixture(&spec);
    let dense_pack = f.root.join("dense.nflash");
    nflash_tests::convert(&f.ckpt, &dense_pack, "f32");
    let sparse_pack = convert_sparse(&f, "ordered.nflash", "f32", &["--sparsity", "0.5", "--predictor", "exact"]);
    let pack = Pack::open(&sparse_pack).unwrap();
    let reordered = pack.manifest().ffn.iter().any(|l| l.order.iter().enumerate().any(|(p, &i)| p as u32 != i));
    assert!(reordered, "the sparse pack should store neurons hot first, not in original order");
    let t = tokens(16, spec.vocab);
    let a = decode_logits(&dense_pack, &t, true);
    let b = decode_logits(&sparse_pack, &t, true);
    let e = rel_error_flat(&b, &a);
    assert!(e < 1e-5, "reordered dense logits differ: relative error {e}");
}

#[test]
fn predictors_report_sparsity_and_recall() {
    let spec = TinySpec { hidden: 64, inter: 192, ..TinySpec::default() };
    let f = fixture(&spec);
    for pred in ["low-rank", "mlp"] {
        let p = convert_sparse(
            &f,
            &format!("{pred}.nflash"),
            "q8_0",
            &["--sparsity", "0.5", "--predictor", pred, "--rank", "32"],
        );
        let o = run(
            "nflash",
            &["ppl", "--model", p.to_str().unwrap(), "--file", f.calib.to_str().unwrap(), "--json", "--ctx", "40"],
        );
        assert!(o.status.success(), "{pred}: {}", String::from_utf8_lossy(&o.stderr));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let (s, b, r) = (
            j["ffn_sparsity"].as_f64().unwrap(),
            j["bundles_skipped"].as_f64().unwrap(),
            j["recall"].as_f64().unwrap(),
        );
        assert!(s > 0.3 && s < 0.9, "{pred}: ffn_sparsity {s}");
        assert!(b > 0.0 && b <= s, "{pred}: bundles_skipped {b} (sparsity {s})");
        assert!(r > 0.5 && r <= 1.0, "{pred}: recall {r}");
        assert_eq!(j["layers"].as_array().unwrap().len(), spec.layers);
        // --dense evaluates every neuron.
        let o = run(
            "nflash",
            &[
                "ppl",
                "--model",
                p.to_str().unwrap(),
                "--file",
                f.calib.to_str().unwrap(),
                "--json",
                "--ctx",
                "40",
                "--dense",
            ],
        );
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(j["ffn_sparsity"].as_f64().unwrap(), 0.0);
        // The summary is in the manifest and shown by prep inspect.
        let o = run("prep", &["inspect", p.to_str().unwrap(), "--json"]);
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(j["sparse"]["predictor"], pred);
        assert_eq!(j["sparse"]["layers"][0]["frequency_curve"].as_array().unwrap().len(), 33);
        // Sparse decode runs.
        let o = run(
            "nflash",
            &[
                "run",
                "--model",
                p.to_str().unwrap(),
                "--prompt",
                "w5 w6 w7",
                "--max-tokens",
                "8",
                "--temperature",
                "0",
                "--stats",
            ],
        );
        assert!(o.status.success(), "{pred}: {}", String::from_utf8_lossy(&o.stderr));
        assert!(String::from_utf8_lossy(&o.stderr).contains("bundles skipped"));
    }
}

#[test]
fn quality_report_compares_sparse_and_dense() {
    let spec = TinySpec::default();
    let f = fixture(&spec);
    let p = convert_sparse(&f, "q.nflash", "f32", &["--sparsity", "0.3", "--predictor", "low-rank", "--rank", "32"]);
    let plot = f.root.join("q.png");
    let o = run(
        "prep",
        &[
            "verify",
            p.to_str().unwrap(),
            "--quality",
            "--text",
            f.calib.to_str().unwrap(),
            "--ctx",
            "40",
            "--json",
            "--plot",
            plot.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let r = &j[0];
    for k in ["dense_ppl", "sparse_ppl", "delta_pct", "top1_agreement", "ffn_sparsity", "bundles_skipped", "recall"] {
        assert!(r[k].as_f64().is_some_and(f64::is_finite), "{k}: {r}");
    }
    assert!(r["top1_agreement"].as_f64().unwrap() <= 1.0);
    let png = std::fs::read(&plot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}

/// `o` failed cleanly with every needle in stderr, and left no pack.
#[track_caller]
fn assert_clean_failure(what: &str, o: &std::process::Output, needles: &[&str], out: &Path) {
    assert_fails(what, o, needles);
    assert_no_output(out);
}

#[test]
fn bad_sparsity_inputs_are_refused_clearly() {
    let spec = TinySpec::default();
    let f = fixture(&spec);
    let out = f.root.join("bad.nflash");
    let base = |extra: &[&str]| {
        let mut a =
            vec!["convert", "--model", f.ckpt.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quant", "f32"];
        a.extend_from_slice(extra);
        run("prep", &a)
    };
    let calib = f.calib.to_str().unwrap();
    for s in ["1", "1.5", "-0.1", "NaN"] {
        let o = base(&["--calib", calib, "--sparsity", s]);
        assert_clean_failure(&format!("--sparsity {s}"), &o, &["--sparsity"], &out);
    }
    let o = base(&["--calib", calib, "--predictor", "low-rank", "--predictor-init", "random"]);
    assert_clean_failure("--predictor-init without the MLP", &o, &["--predictor-init", "--predictor mlp"], &out);
    let empty = f.root.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    assert_clean_failure("empty calib", &base(&["--calib", empty.to_str().unwrap()]), &["empty.txt"], &out);
    let binary = f.root.join("binary.txt");
    std::fs::write(&binary, b"w3 w4 \xff\xfe w5").unwrap();
    assert_clean_failure("non-UTF-8 calib", &base(&["--calib", binary.to_str().unwrap()]), &["UTF-8"], &out);
    let short = f.root.join("short.txt");
    std::fs::write(&short, tiny_words(20, spec.vocab, 1)).unwrap();
    assert_clean_failure(
        "fewer tokens than a window",
        &base(&["--calib", short.to_str().unwrap(), "--window", "64"]),
        &["window"],
        &out,
    );
    // A profile of a differently shaped model.
    let other = TinySpec { inter: 128, ..TinySpec::default() };
    let g = fixture(&other);
    let prof = f.root.join("other.profile");
    let o = run(
        "prep",
        &[
            "profile",
            "--model",
            g.ckpt.to_str().unwrap(),
            "--calib",
            g.calib.to_str().unwrap(),
            "--tokens",
            "200",
            "--window",
            "50",
            "--out",
            prof.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = base(&["--profile", prof.to_str().unwrap()]);
    assert_clean_failure("profile of another model", &o, &["profile", "128"], &out);
    // A file that is not a profile.
    let o = base(&["--profile", calib]);
    assert_clean_failure("not a profile", &o, &["calib.txt"], &out);
    // Sparsity options without a calibration source would silently give a dense pack.
    let o = base(&["--sparsity", "0.7", "--predictor", "mlp"]);
    assert_clean_failure("sparse flags without --calib", &o, &["--calib", "--profile"], &out);
    // --rank beyond the hidden size.
    let o = base(&["--calib", calib, "--predictor", "low-rank", "--rank", "4096"]);
    assert_clean_failure("--rank 4096", &o, &["--rank 4096", "at most"], &out);
}

#[test]
fn quality_plot_path_is_checked_before_scoring_and_leaves_nothing() {
    let spec = TinySpec::default();
    let f = fixture(&spec);
    let p = convert_sparse(&f, "p.nflash", "f32", &["--sparsity", "0.3", "--predictor", "exact"]);
    let dir = f.root.join("adir");
    std::fs::create_dir(&dir).unwrap();
    let o = run(
        "prep",
        &[
            "verify",
            p.to_str().unwrap(),
            "--quality",
            "--text",
            f.calib.to_str().unwrap(),
            "--plot",
            dir.to_str().unwrap(),
        ],
    );
    assert_clean_failure("--plot a directory", &o, &["--plot", "directory"], &f.root.join("never"));
    let leftovers: Vec<_> = std::fs::read_dir(&f.root)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("tmp"))
        .collect();
    assert!(leftovers.is_empty(), "left {leftovers:?}");
}

/// Gemma 3 (GeGLU, sandwich norms, sliding-window layers): profiled by
/// prep's f32 forward, its predictors find the neurons the runtime's
/// forward activates. The MLP predictor's recall on held-out text shows
/// that both forwards agree: trained on the inputs of another model, it
/// would miss most of them. `prep inspect` shows the layer kinds.
#[test]
fn gemma3_sparse_decode_recalls_the_active_neurons() {
    let spec = TinySpec { inter: 192, ..TinySpec::gemma3(3) };
    let f = fixture(&spec);
    let p = convert_sparse(&f, "gemma3.nflash", "q8_0", &["--sparsity", "0.5", "--predictor", "mlp", "--rank", "32"]);
    let held_out = f.root.join("held-out.txt");
    std::fs::write(&held_out, tiny_words(400, spec.vocab, 7)).unwrap();
    let o = run(
        "nflash",
        &["ppl", "--model", p.to_str().unwrap(), "--file", held_out.to_str().unwrap(), "--json", "--ctx", "40"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let (s, r) = (j["ffn_sparsity"].as_f64().unwrap(), j["recall"].as_f64().unwrap());
    eprintln!("gemma3 sparse: ffn_sparsity {s:.3}, recall {r:.3}");
    assert!(s > 0.3 && s < 0.9, "ffn_sparsity {s}");
    assert!(r > 0.8, "recall {r}");
    let o = run("prep", &["inspect", p.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("sliding-window layers (local RoPE theta 10000): 0, 2; global layers: 1"), "{out}");
}
