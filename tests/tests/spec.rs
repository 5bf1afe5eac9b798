//! formats/SPEC.md held to the bytes `prep` writes: `formats/python/`
//! holds a second reader written from the SPEC alone (Python, standard
//! library only). On a dense and a sparse, planned tiny pack it must read
//! every value `prep inspect --json` prints, re-encode the manifest to the
//! stored bytes, and dequantize the weights to the checkpoint's.

use std::process::Command;

use nflash_tests::{bin, convert_with, repo_root, tiny_words, write_tiny_checkpoint, TinySpec, QUICK_CALIB};

/// Runs `formats/python/check_pack.py` with `args`; fails with its output.
fn check_pack(args: &[&str]) {
    let script = repo_root().join("formats/python/check_pack.py");
    let o = Command::new("python3").arg(&script).args(args).output().expect("python3 runs (the Makefile needs it too)");
    assert!(
        o.status.success(),
        "check_pack.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn the_python_reader_written_from_the_spec_reads_what_prep_writes() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { inter: 256, layers: 2, ..TinySpec::default() };
    let ckpt = dir.path().join("ckpt");
    write_tiny_checkpoint(&ckpt, &spec);
    let calib = dir.path().join("calib.txt");
    std::fs::write(&calib, tiny_words(1200, spec.vocab, 7)).unwrap();
    let profile = repo_root().join("profiles/dev-host.toml");
    let dense = dir.path().join("dense.nflash");
    convert_with(&ckpt, &dense, &["--quant", "q8_0"]);
    let sparse = dir.path().join("sparse.nflash");
    let calib = calib.to_str().unwrap();
    let mut flags = vec!["--quant", "q4_0", "--cluster-bytes", "1KiB", "--calib", calib];
    flags.extend(QUICK_CALIB);
    let profile = profile.to_str().unwrap();
    flags.extend(["--device", profile, "--memory-budget", "64MiB", "--ctx", "64"]);
    convert_with(&ckpt, &sparse, &flags);
    let prep = bin("prep");
    for p in [&dense, &sparse] {
        check_pack(&["compare", p.to_str().unwrap(), "--prep", prep.to_str().unwrap()]);
        check_pack(&["weights", p.to_str().unwrap(), "--model", ckpt.to_str().unwrap()]);
    }
    // The dense architectures of format 3.5: Qwen3 (q/k norms), SmolLM3
    // (its RoPE layer set, a newtype variant), Phi-3 (its fields and
    // LongRoPE, and its fused projections stored split: `weights` reads the
    // rows SPEC §4.1 names) and Gemma 3 (its fields, and norm weights
    // stored as 1 + w: `weights` fails when they are the checkpoint's w).
    for spec in [
        TinySpec { arch: "Qwen3ForCausalLM", head_dim: Some(24), tied: false, ..TinySpec::default() },
        TinySpec {
            arch: "SmolLM3ForCausalLM",
            layers: 4,
            no_rope_layers: Some(vec![1, 0, 1, 0]),
            ..TinySpec::default()
        },
        TinySpec::phi3(1),
        TinySpec::gemma3(1),
    ] {
        let ckpt = dir.path().join(spec.arch);
        write_tiny_checkpoint(&ckpt, &spec);
        let pack = dir.path().join(format!("{}.nflash", spec.arch));
        convert_with(&ckpt, &pack, &["--quant", "q8_0"]);
        check_pack(&["compare", pack.to_str().unwrap(), "--prep", prep.to_str().unwrap()]);
        check_pack(&["weights", pack.to_str().unwrap(), "--model", ckpt.to_str().unwrap(), "--all-layers"]);
    }
    // Mixtures of experts (format 3.3): one FFN unit per expert.
    // Sparse with few calibration tokens: some experts get too few to train a
    // predictor, and select every neuron (predictor threshold the lowest f32).
    let few = ["--cluster-bytes", "1KiB", "--calib", calib, "--tokens", "40", "--window", "8", "--sample", "16"];
    for (arch, experts, sparse) in [
        ("MixtralForCausalLM", 4, Some(&[][..])),
        ("Qwen3MoeForCausalLM", 6, None),
        ("Qwen3MoeForCausalLM", 6, Some(&few[..])),
    ] {
        let spec = TinySpec { arch, experts, top_k: 2, inter: 64, tied: false, act: "relu", ..TinySpec::default() };
        let ckpt = dir.path().join(arch);
        write_tiny_checkpoint(&ckpt, &spec);
        let pack = dir.path().join(format!("{arch}-{}.nflash", sparse.map_or(0, <[&str]>::len)));
        let mut flags = vec!["--quant", "q4_0"];
        match sparse {
            // Calibrated: expert statistics in the metadata, predictors per expert.
            Some([]) => {
                flags.extend(["--cluster-bytes", "1KiB", "--calib", calib]);
                flags.extend(QUICK_CALIB);
            }
            Some(f) => flags.extend_from_slice(f),
            None => {}
        }
        convert_with(&ckpt, &pack, &flags);
        if sparse.is_some_and(|f| !f.is_empty()) {
            let p = nflash_format::Pack::open(&pack).unwrap();
            let keep_all =
                p.manifest().ffn.iter().filter(|f| f.sparse.as_ref().unwrap().predictor_threshold == f32::MIN);
            assert!(keep_all.count() > 0, "no expert fell back to reading every neuron");
        }
        check_pack(&["compare", pack.to_str().unwrap(), "--prep", prep.to_str().unwrap()]);
        check_pack(&["weights", pack.to_str().unwrap(), "--model", ckpt.to_str().unwrap(), "--all-layers"]);
    }
}
