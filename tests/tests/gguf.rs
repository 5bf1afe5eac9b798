//! GGUF input (`prep convert --model FILE.gguf`): the tokenizer built from
//! `tokenizer.ggml.*` against llama.cpp's own ids, the Q4_0/Q8_0 blocks a
//! pack copies bit for bit, and the model against its Hugging Face twin.

use std::path::{Path, PathBuf};

use nflash_format::Pack;
use nflash_tests::{convert, repo_root, run, smollm2_dir, write_tiny_checkpoint, TinySpec};

use crate::common::{our_logits, rel_error, top1_agreement};

/// The demo model's GGUF (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 token
/// embedding), fetched by `make model`.
fn demo_gguf() -> PathBuf {
    let p = repo_root().join("models/.download/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} missing: run `make model` first", p.display());
    p
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Asserts that the tokenizer prep builds from `gguf` gives llama.cpp's
/// ids (`fixture`, made by scripts/tokenize_fixture.py with llama-tokenize
/// on the same file) for every text of tests/data/tokenizer/texts.json:
/// code, Unicode, numbers, whitespace runs and WikiText-2 lines.
fn assert_tokenizes_like_llama_cpp(gguf: &Path, fixture: &Path) {
    let dir = repo_root().join("tests/data/tokenizer");
    let texts: Vec<String> = serde_json::from_slice(&std::fs::read(dir.join("texts.json")).unwrap()).unwrap();
    let fixture: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture).unwrap()).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(fixture["ids"].clone()).unwrap();
    assert_eq!(texts.len(), want.len());
    assert!(texts.len() >= 300);

    let t = tmp();
    let pack_path = t.path().join("g.nflash");
    convert(gguf, &pack_path, "f32");
    let pack = Pack::open(&pack_path).unwrap();
    let tok = nflash_runtime::tokenizer::Tokenizer::from_json(&pack.tokenizer_json().unwrap()).unwrap();
    let mut bad = Vec::new();
    for (text, ids) in texts.iter().zip(&want) {
        let ours = tok.encode_as_text_at_most(text, usize::MAX).unwrap();
        if &ours != ids {
            bad.push(format!("{text:?}: llama.cpp {ids:?}, nflash {ours:?}"));
        }
    }
    assert!(bad.is_empty(), "{} of {} texts tokenize differently:\n{}", bad.len(), texts.len(), bad.join("\n"));
}

#[test]
fn bpe_tokenizer_matches_llama_cpp_on_varied_text() {
    // SmolLM2's byte-level BPE vocabulary, pre-tokenizer "smollm".
    assert_tokenizes_like_llama_cpp(
        &demo_gguf(),
        &repo_root().join("tests/data/tokenizer/smollm2-llama-tokenize.json"),
    );
}

#[test]
fn sentencepiece_tokenizer_matches_llama_cpp_on_varied_text() {
    // A SentencePiece BPE vocabulary of 400 pieces with byte fallback,
    // split digits, a user-defined token and the space prefix (Llama 2 and
    // Gemma vocabularies are of this kind).
    let d = repo_root().join("tests/data/gguf");
    assert_tokenizes_like_llama_cpp(&d.join("tiny-llama-f32.gguf"), &d.join("spm-ids.json"));
}

/// A resident tensor's bytes in a pack.
fn pack_tensor(pack: &Pack, name: &str) -> Vec<u8> {
    pack.tensor(name).unwrap_or_else(|e| panic!("{name} in the pack: {e}")).1.to_vec()
}

/// The data of GGUF tensor `name`, found by walking the file's header by
/// hand ([`nflash_tests::gguf_layout`]) with only the size rules of Q8_0,
/// Q4_0 and F32.
fn gguf_tensor(path: &Path, name: &str) -> Vec<u8> {
    let b = std::fs::read(path).unwrap();
    let l = nflash_tests::gguf_layout(&b);
    let (_, ne, ty, off) =
        l.tensors.iter().find(|t| t.0 == name).unwrap_or_else(|| panic!("{name} in {}", path.display()));
    let elems: u64 = ne.iter().map(|&p| u64::from_le_bytes(b[p..p + 8].try_into().unwrap())).product();
    let bytes = match ty {
        0 => elems * 4,
        8 => elems / 32 * 34,
        2 => elems / 32 * 18,
        _ => panic!("{name} is of type {ty}"),
    };
    b[l.data_start + *off as usize..][..bytes as usize].to_vec()
}

/// Asserts that `nflash run` answers the demo question with Paris.
fn assert_answers_paris(pack: &Path) {
    let args = ["run", "--model", pack.to_str().unwrap(), "--chat", "--prompt", "What is the capital of France?"];
    let o = run("nflash", &[&args[..], &["--temperature", "0"]].concat());
    assert!(String::from_utf8_lossy(&o.stdout).contains("Paris"), "{}", String::from_utf8_lossy(&o.stdout));
}

/// `llama-quantize --pure` of the demo GGUF as `ty`, made once by the
/// vendored llama.cpp's own quantizer when `make bench` built it
/// (bench-out/llama-native/build/bin); `None` when it is not built.
fn quantized_gguf(ty: &str) -> Option<PathBuf> {
    let bin = repo_root().join("bench-out/llama-native/build/bin");
    let tool = bin.join("llama-quantize");
    if !tool.exists() {
        eprintln!("skipping: {} is not built (scripts/bench_setup.sh builds it)", tool.display());
        return None;
    }
    let dir = repo_root().join("target/test-packs");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(format!("smollm2-{ty}.gguf"));
    if !out.exists() {
        let part = dir.join(format!("smollm2-{ty}.gguf.part"));
        let o = std::process::Command::new(&tool)
            .env("LD_LIBRARY_PATH", &bin)
            .args(["--allow-requantize", "--pure"])
            .arg(demo_gguf())
            .arg(&part)
            .arg(ty)
            .output()
            .unwrap();
        assert!(o.status.success(), "llama-quantize failed: {}", String::from_utf8_lossy(&o.stderr));
        std::fs::rename(&part, &out).unwrap();
    }
    Some(out)
}

/// Asserts that the pack converted from `g` as `quant` holds the GGUF's
/// blocks of `layers`' attention (Q and K rows un-permuted whole, so each
/// row's blocks are the GGUF's), and of their gate and up rows inside the
/// FFN bundles, and of the token embedding.
fn assert_blocks_copied(g: &Path, pack: &Pack, quant: &str, layers: &[usize]) {
    let block = if quant == "q8_0" { 34 } else { 18 };
    let cfg = &pack.manifest().config;
    let (h, hd) = (cfg.hidden_size as usize, cfg.head_dim as usize);
    let row = h / 32 * block;
    assert_eq!(pack_tensor(pack, "model.embed_tokens.weight"), gguf_tensor(g, "token_embd.weight"));
    for &l in layers {
        for (ours, theirs) in [("v_proj", "attn_v"), ("o_proj", "attn_output")] {
            assert_eq!(
                pack_tensor(pack, &format!("model.layers.{l}.self_attn.{ours}.weight")),
                gguf_tensor(g, &format!("blk.{l}.{theirs}.weight")),
                "{quant} layer {l} {ours}"
            );
        }
        for (ours, theirs) in [("q_proj", "attn_q"), ("k_proj", "attn_k")] {
            // HF row (head, p, j) is GGUF row (head, j, p).
            let (ours, theirs) = (
                pack_tensor(pack, &format!("model.layers.{l}.self_attn.{ours}.weight")),
                gguf_tensor(g, &format!("blk.{l}.{theirs}.weight")),
            );
            assert_eq!(ours.len(), theirs.len());
            for r in 0..ours.len() / row {
                let (head, p, j) = (r / hd, (r % hd) / (hd / 2), r % (hd / 2));
                let gr = head * hd + 2 * j + p;
                assert_eq!(ours[r * row..][..row], theirs[gr * row..][..row], "{quant} layer {l} row {r}");
            }
        }
        // The FFN: bundle i is gate row i | up row i | down column i (dense pack, original order).
        let ffn = pack.ffn_layer(l).unwrap();
        let seg = pack.segment(ffn.segment).unwrap();
        let (gate, up) =
            (gguf_tensor(g, &format!("blk.{l}.ffn_gate.weight")), gguf_tensor(g, &format!("blk.{l}.ffn_up.weight")));
        for c in &ffn.clusters {
            let bytes = &seg[c.offset as usize..];
            for k in 0..c.n_neurons as usize {
                let i = c.first as usize + k;
                let b = &bytes[k * ffn.bundle.bundle_bytes as usize..];
                assert_eq!(b[..row], gate[i * row..][..row], "{quant} layer {l} gate row {i}");
                assert_eq!(b[row..2 * row], up[i * row..][..row], "{quant} layer {l} up row {i}");
            }
        }
    }
}

#[test]
fn q8_0_blocks_of_a_llama_cpp_gguf_are_copied_bit_for_bit() {
    // tests/data/gguf/tiny-llama-q8_0.gguf: `llama-quantize --pure` of the
    // tiny llama twin (scripts/make_gguf_fixtures.py).
    let t = tmp();
    let g = repo_root().join("tests/data/gguf/tiny-llama-q8_0.gguf");
    let p = t.path().join("q.nflash");
    // Without --quant, the GGUF's own type.
    let o = nflash_tests::prep_convert(&g, &p, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(log.contains("--quant q8_0, the GGUF's own type"), "{log}");
    // Embedding, output, and per layer q, k, v, o, gate, up.
    assert!(log.contains("14 matrices copied bit for bit as q8_0"), "{log}");
    assert!(log.contains("requantized as q8_0: relative RMS error"), "{log}");
    let pack = Pack::open(&p).unwrap();
    assert_blocks_copied(&g, &pack, "q8_0", &[0, 1]);
    assert_eq!(pack_tensor(&pack, "lm_head.weight"), gguf_tensor(&g, "output.weight"));
    // Asked for q4_0, the same file is requantized, and says so.
    let o = nflash_tests::prep_convert(&g, &t.path().join("q4.nflash"), &["--quant", "q4_0"]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success()
            && !log.contains("copied bit for bit")
            && log.contains("14 matrices (14 Q8_0) dequantized and quantized as q4_0: relative RMS error"),
        "{log}"
    );
}

#[test]
fn smollm2_q8_0_and_q4_0_ggufs_are_copied_bit_for_bit() {
    // The token embedding of the demo GGUF is Q8_0 as llama.cpp stored it.
    let t = tmp();
    let p = t.path().join("g.nflash");
    let o = nflash_tests::prep_convert(&demo_gguf(), &p, &["--quant", "q8_0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(log.contains("1 matrix copied bit for bit as q8_0"), "{log}");
    assert!(log.contains("180 matrices (180 Q4_1) dequantized and quantized as q8_0: relative RMS error"), "{log}");
    assert!(log.contains("nflash has no kernels for Q4_1"), "{log}");
    assert!(log.contains("relative RMS error"), "{log}");
    let pack = Pack::open(&p).unwrap();
    assert_eq!(pack_tensor(&pack, "model.embed_tokens.weight"), gguf_tensor(&demo_gguf(), "token_embd.weight"));

    // Every matrix of llama.cpp's own Q8_0 and Q4_0 files of SmolLM2
    // (where `make bench` built llama-quantize).
    for (ty, quant) in [("Q8_0", "q8_0"), ("Q4_0", "q4_0")] {
        let Some(g) = quantized_gguf(ty) else { return };
        let p = t.path().join(format!("{quant}.nflash"));
        let o = nflash_tests::prep_convert(&g, &p, &["--quant", quant]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(log.contains(&format!("181 matrices copied bit for bit as {quant}")), "{log}");
        assert_blocks_copied(&g, &Pack::open(&p).unwrap(), quant, &[0, 29]);
    }
}

#[test]
fn gguf_pack_matches_the_hf_converted_pack() {
    // The demo GGUF and the Hugging Face checkpoint made from it (make
    // model: Q4_1 → BF16) give the same config and nearly the same logits.
    let t = tmp();
    let (g, hf) = (t.path().join("g.nflash"), t.path().join("hf.nflash"));
    convert(&demo_gguf(), &g, "f32");
    convert(&smollm2_dir(), &hf, "f32");
    let (pg, ph) = (Pack::open(&g).unwrap(), Pack::open(&hf).unwrap());
    assert_eq!(pg.manifest().config, ph.manifest().config);
    assert_eq!(pg.manifest().tokenizer.add_bos_token, ph.manifest().tokenizer.add_bos_token);
    assert_eq!(pg.manifest().tokenizer.chat_template, ph.manifest().tokenizer.chat_template);
    let tokens = crate::smollm2::eval_tokens(48);
    let (ours, theirs) = (our_logits(&g, &tokens), our_logits(&hf, &tokens));
    // The only difference is the HF checkpoint's BF16 rounding of the Q4_1 values.
    let err = rel_error(&ours.0, &theirs.0);
    assert!(err < 1e-2, "relative logit error {err}");
    assert!(top1_agreement(&ours.0, &theirs.0) >= 0.95);
    assert_answers_paris(&g);
}

#[test]
fn tiny_ggufs_of_every_architecture_match_their_hf_twins() {
    // tests/data/gguf/tiny-NAME-f32.gguf was written by llama.cpp's
    // convert_hf_to_gguf.py from the checkpoint of TinySpec::gguf_twin(NAME)
    // (scripts/make_gguf_fixtures.py): Q/K rows permuted (llama, mixtral,
    // smollm3), fused Q/K/V and gate/up with LongRoPE factors as tensors
    // (phi3), stacked experts (mixtral, qwen3moe), (1 + w) norms and the
    // sliding-window pattern left to llama.cpp's code (gemma3).
    let t = tmp();
    let tokens: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % 400).collect();
    for name in TinySpec::GGUF_TWINS {
        let spec = TinySpec::gguf_twin(name).unwrap();
        let dir = t.path().join(name);
        write_tiny_checkpoint(&dir, &spec);
        let (hf, gg) = (t.path().join(format!("{name}-hf.nflash")), t.path().join(format!("{name}-gguf.nflash")));
        convert(&dir, &hf, "f32");
        convert(&repo_root().join(format!("tests/data/gguf/tiny-{name}-f32.gguf")), &gg, "f32");
        let (ph, pg) = (Pack::open(&hf).unwrap(), Pack::open(&gg).unwrap());
        let (ch, cg) = (&ph.manifest().config, &pg.manifest().config);
        assert_eq!(cg.architecture, ch.architecture, "{name}");
        assert_eq!(
            (cg.num_layers, cg.hidden_size, cg.intermediate_size, cg.head_dim),
            (ch.num_layers, ch.hidden_size, ch.intermediate_size, ch.head_dim),
            "{name}"
        );
        // RoPE scaling recovered exactly, Llama 3's from rope_freqs.weight (llama31).
        assert_eq!(cg.rope_scaling, ch.rope_scaling, "{name}");
        // The same f32 weights through the same kernels: the same bits
        // (the bound is 1e-4), in prefill and in decode.
        let (ours, theirs) = (our_logits(&gg, &tokens), our_logits(&hf, &tokens));
        for (path, a, b) in [("prefill", &ours.0, &theirs.0), ("decode", &ours.1, &theirs.1)] {
            let max = a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(a == b, "{name} ({path}): logits differ from the Hugging Face twin's, max |difference| {max:e}");
        }
    }
}

#[test]
fn smollm2_gguf_from_convert_hf_to_gguf_matches_the_hf_converted_pack() {
    // target/test-packs/smollm2-hf-q8_0.gguf, where scripts/gguf_acceptance.sh
    // made it with llama.cpp's own tools (convert_hf_to_gguf.py --outtype
    // bf16 of make model's checkpoint, then llama-quantize --pure Q8_0; they
    // need torch, which make test does not install).
    let g = repo_root().join("target/test-packs/smollm2-hf-q8_0.gguf");
    if !g.exists() {
        eprintln!("skipping: {} is made by scripts/gguf_acceptance.sh", g.display());
        return;
    }
    let t = tmp();
    let p = t.path().join("g.nflash");
    convert(&g, &p, "q8_0");
    let hf = crate::smollm2::pack("q8_0");
    let (pg, ph) = (Pack::open(&p).unwrap(), Pack::open(&hf).unwrap());
    assert_eq!(pg.manifest().config, ph.manifest().config);
    // ggml's Q8_0 quantization of the BF16 weights and nflash's give the
    // same blocks: every matrix but the down projection is the same bytes.
    let mut same = 0;
    for e in ph.manifest().tensors.iter().filter(|e| e.dtype == nflash_format::DType::Q8_0) {
        assert_eq!(pack_tensor(&pg, &e.name), pack_tensor(&ph, &e.name), "{}", e.name);
        same += 1;
    }
    assert_eq!(same, 1 + 30 * 4);
    let row = 576 / 32 * 34;
    for l in 0..30 {
        let (fg, fh) = (pg.ffn_layer(l).unwrap(), ph.ffn_layer(l).unwrap());
        let (sg, sh) = (pg.segment(fg.segment).unwrap(), ph.segment(fh.segment).unwrap());
        for (cg, ch) in fg.clusters.iter().zip(&fh.clusters) {
            for k in 0..cg.n_neurons as usize {
                let at = k * fg.bundle.bundle_bytes as usize;
                let (a, b) = (&sg[cg.offset as usize + at..], &sh[ch.offset as usize + at..]);
                assert_eq!(a[..2 * row], b[..2 * row], "layer {l} neuron {} gate/up", cg.first as usize + k);
            }
        }
    }
    assert_answers_paris(&p);
}

#[test]
fn gguf_input_profiles_trains_predictors_and_plans_as_hf_input_does() {
    // A sparse conversion planned for a device, from a GGUF (a mixture of
    // experts, so routing statistics are gathered too), then a run within
    // the plan's budget.
    let t = tmp();
    let g = repo_root().join("tests/data/gguf/tiny-mixtral-f32.gguf");
    let calib = t.path().join("calib.txt");
    let (text, _) = nflash_tests::eval_text();
    std::fs::write(&calib, &text[..text.len().min(20_000)]).unwrap();
    let p = t.path().join("s.nflash");
    let profile = repo_root().join("profiles/dev-host.toml");
    let mut flags = vec!["--quant", "q8_0", "--cluster-bytes", "1KiB", "--calib", calib.to_str().unwrap()];
    flags.extend(nflash_tests::QUICK_CALIB);
    flags.extend([
        "--sparsity",
        "0.5",
        "--device",
        profile.to_str().unwrap(),
        "--memory-budget",
        "48MiB",
        "--ctx",
        "64",
    ]);
    let o = nflash_tests::prep_convert(&g, &p, &flags);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pack = Pack::open(&p).unwrap();
    let m = pack.manifest();
    assert!(m.sparse.is_some() && m.plan.is_some(), "a sparse pack with a plan");
    assert!(m.ffn.iter().all(|f| f.sparse.is_some()), "every expert has its sparsity settings");
    let o = run(
        "nflash",
        &[
            "run",
            "--model",
            p.to_str().unwrap(),
            "--raw",
            "--prompt",
            "The city",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_gguf_given_where_a_pack_or_a_type_is_expected_gets_advice() {
    // nflash run on a GGUF says to convert it first.
    let g = repo_root().join("tests/data/gguf/tiny-llama-f32.gguf");
    let o = run("nflash", &["run", "--model", g.to_str().unwrap(), "--prompt", "x"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("is a GGUF file, not an nflash pack") && err.contains("prep convert"),
        "{err}"
    );
    // A GGUF of a type without kernels (Q4_1) defaults to q8_0, saying why.
    let t = tmp();
    let o = nflash_tests::prep_convert(&demo_gguf(), &t.path().join("d.nflash"), &[]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && log.contains("note: --quant q8_0, since the GGUF's type has no nflash kernels"),
        "{log}"
    );
    // An F32 GGUF keeps the usual default, q4_0.
    let o = nflash_tests::prep_convert(&g, &t.path().join("f.nflash"), &[]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !log.contains("note: --quant") && log.contains("quantized as q4_0"), "{log}");
}
