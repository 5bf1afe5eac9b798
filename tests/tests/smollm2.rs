//! End-to-end checks on the real SmolLM2-135M-Instruct checkpoint made by `make model`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use crate::common::{assert_matches_reference, our_logits, reference_logits, top1_agreement};
use nflash_format::Pack;
use nflash_plan::CacheConfig;
use nflash_runtime::{ppl, Engine};
use nflash_tests::{convert, eval_text, repo_root, run, smollm2_dir};

const CHATML_PROMPT: &str = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
const CHATML_IDS: [u32; 16] = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198];

/// The SmolLM2 pack for `quant`, converted once per test run.
pub fn pack(quant: &str) -> PathBuf {
    static PACKS: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut map = PACKS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    map.entry(quant.to_string())
        .or_insert_with(|| {
            let dir = repo_root().join("target/test-packs");
            std::fs::create_dir_all(&dir).unwrap();
            let out = dir.join(format!("smollm2-{quant}.nflash"));
            convert(&smollm2_dir(), &out, quant);
            out
        })
        .clone()
}

pub fn eval_tokens(n: usize) -> Vec<u32> {
    let (text, _) = eval_text();
    let tok = tokenizers::Tokenizer::from_file(smollm2_dir().join("tokenizer.json")).unwrap();
    let ids = tok.encode(&text[..text.len().min(200_000)], false).unwrap().get_ids().to_vec();
    assert!(ids.len() >= n, "evaluation text too short");
    ids[..n].to_vec()
}

#[test]
fn make_model_output_is_a_valid_hf_checkpoint() {
    let dir = smollm2_dir();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cfg["hidden_size"], 576);
    assert_eq!(cfg["num_key_value_heads"], 3);
    assert_eq!(cfg["tie_word_embeddings"], true);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 272);
    assert!(st.tensor("lm_head.weight").is_err(), "tied model must not have lm_head.weight");
    let shape = |n: &str| st.tensor(n).unwrap().shape().to_vec();
    assert_eq!(shape("model.embed_tokens.weight"), [49152, 576]);
    assert_eq!(shape("model.layers.0.self_attn.q_proj.weight"), [576, 576]);
    assert_eq!(shape("model.layers.29.self_attn.k_proj.weight"), [192, 576]);
    assert_eq!(shape("model.layers.7.self_attn.v_proj.weight"), [192, 576]);
    assert_eq!(shape("model.layers.3.mlp.gate_proj.weight"), [1536, 576]);
    assert_eq!(shape("model.layers.3.mlp.down_proj.weight"), [576, 1536]);
    assert_eq!(shape("model.norm.weight"), [576]);
    assert!(st.tensors().iter().all(|(_, t)| t.dtype() == safetensors::Dtype::BF16));
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert_eq!(tok.encode(CHATML_PROMPT, false).unwrap().get_ids(), CHATML_IDS);
    let tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    assert!(tc["chat_template"].as_str().unwrap().contains("<|im_start|>"));
}

#[test]
fn packed_chat_template_and_tokenizer_reproduce_the_chatml_ids() {
    let p = Pack::open(pack("q8_0")).unwrap();
    let e = Engine::load(&p).unwrap();
    let rendered = e
        .template
        .as_ref()
        .unwrap()
        .render(&[
            nflash_runtime::chat::Message::new(
                "system",
                "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
            ),
            nflash_runtime::chat::Message::new("user", "What is the capital of France?"),
        ])
        .unwrap();
    assert!(rendered.ends_with(CHATML_PROMPT), "{rendered:?}");
    assert_eq!(e.tokenizer.encode(CHATML_PROMPT, false).unwrap(), CHATML_IDS);
    assert_eq!(e.stop_ids, vec![2]);
}

#[test]
fn f32_pack_matches_candle_reference_on_64_tokens() {
    let tokens = eval_tokens(64);
    let reference = reference_logits(&smollm2_dir(), &tokens);
    assert_matches_reference("SmolLM2 f32", &our_logits(&pack("f32"), &tokens), &reference);
}

fn prefill_logits(quant: &str, tokens: &[u32]) -> Vec<Vec<f32>> {
    let p = Pack::open(pack(quant)).unwrap();
    let m = nflash_runtime::load_model(&p, &CacheConfig::all_hot(&p)).unwrap();
    let mut kv = m.new_kv_cache(tokens.len());
    let h = m.forward(&mut kv, tokens).unwrap();
    m.logits_batch(&h).chunks(m.cfg.vocab_size as usize).map(|c| c.to_vec()).collect()
}

#[test]
fn q8_0_agrees_with_f32_on_top1() {
    let tokens = eval_tokens(256);
    let agree = top1_agreement(&prefill_logits("q8_0", &tokens), &prefill_logits("f32", &tokens));
    eprintln!("q8_0 vs f32 top-1 agreement over 256 positions of {}: {agree:.4}", eval_text().1);
    assert!(agree >= 0.95, "top-1 agreement {agree} < 0.95");
}

#[test]
fn q4_0_perplexity_is_reported_and_close_to_f32() {
    let tokens = eval_tokens(1024);
    let mut r = Vec::new();
    for q in ["f32", "q4_0"] {
        let p = Pack::open(pack(q)).unwrap();
        let m = nflash_runtime::load_model(&p, &CacheConfig::all_hot(&p)).unwrap();
        r.push(ppl::perplexity(&m, &tokens, 512, None, |_, _| {}).unwrap().perplexity);
    }
    eprintln!("perplexity over 1024 tokens of {} (ctx 512): f32 {:.3}, q4_0 {:.3}", eval_text().1, r[0], r[1]);
    assert!(r[0].is_finite() && r[0] > 1.0 && r[0] < 100.0, "f32 perplexity {}", r[0]);
    assert!(r[1] < r[0] * 1.5, "q4_0 perplexity {} too far above f32 {}", r[1], r[0]);
}

#[test]
fn greedy_chat_answers_paris_in_q8_0_and_q4_0() {
    for q in ["q8_0", "q4_0"] {
        let p = pack(q);
        let o = run(
            "nflash",
            &[
                "run",
                "--model",
                p.to_str().unwrap(),
                "--chat",
                "--prompt",
                "What is the capital of France?",
                "--temperature",
                "0",
                "--max-tokens",
                "32",
            ],
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{q}: {}", String::from_utf8_lossy(&o.stderr));
        eprintln!("{q}: {out}");
        assert!(out.contains("Paris"), "{q} answered {out:?}");
    }
}

#[test]
fn ppl_cli_json_and_stats_json() {
    let p = pack("q4_0");
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, eval_text().0.chars().take(4000).collect::<String>()).unwrap();
    let o = run(
        "nflash",
        &[
            "ppl",
            "--model",
            p.to_str().unwrap(),
            "--file",
            text.to_str().unwrap(),
            "--ctx",
            "128",
            "--max-tokens",
            "300",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(j["perplexity"].as_f64().unwrap() > 1.0);
    assert_eq!(j["tokens"], 300 - 3); // 3 windows (128, 128, 44); the first token of each is not scored
    let stats = tmp.path().join("s.json");
    let o = run(
        "nflash",
        &[
            "run",
            "--model",
            p.to_str().unwrap(),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--seed",
            "3",
            "--stats-json",
            stats.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert_eq!(s["generated_tokens"], 8);
    assert!(s["prompt_tokens"].as_u64().unwrap() >= 4);
    for k in ["prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_bytes"] {
        assert!(s[k].as_f64().unwrap() > 0.0, "{k}");
    }
}

#[test]
fn interrupted_convert_leaves_no_partial_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("int.nflash");
    let mut child = std::process::Command::new(nflash_tests::bin("prep"))
        .args(["convert", "--model", smollm2_dir().to_str().unwrap(), "--out", out.to_str().unwrap(), "--quant", "f32"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the temporary file exists, i.e. writing is under way.
    let started = std::time::Instant::now();
    let has_tmp =
        || std::fs::read_dir(tmp.path()).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains(".tmp-"));
    while !has_tmp() && started.elapsed().as_secs() < 60 && child.try_wait().unwrap().is_none() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let interrupted = child.try_wait().unwrap().is_none();
    let _ = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status();
    let status = child.wait().unwrap();
    let names: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp-")), "temporary file left: {names:?}");
    if interrupted && !status.success() {
        assert!(!out.exists(), "partial output left at the final path");
        assert_eq!(status.code(), Some(130));
    }
}

#[test]
fn interactive_chat_keeps_the_conversation() {
    use std::io::Write;
    let p = pack("q8_0");
    let mut child = std::process::Command::new(nflash_tests::bin("nflash"))
        .args(["run", "--model", p.to_str().unwrap(), "--temperature", "0", "--max-tokens", "40"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"What is the capital of France?\nAnd of Germany?\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (first, second) = out.split_once('\n').unwrap_or((&out, ""));
    assert!(first.contains("Paris"), "{out:?}");
    assert!(second.contains("Berlin"), "the second turn must see the first: {out:?}");
}

/// A conversation continued through [`nflash_runtime::session::Session`]
/// (its prefix's keys and values reused) gives the bits of a fresh session
/// prefilling the whole conversation: the logits of the request's last
/// token and every key and value in the KV cache, then the greedy tokens.
/// Requests that repeat, continue a chat after its decoded reply, add a
/// few tokens inside a prefill pass, cross one or several passes (256
/// tokens for SmolLM2) or shrink; in Q8_0 (f32 prefill, whose short and
/// long passes take different kernels) and Q4_0 (quantized prefill GEMM).
#[test]
fn reused_prefixes_give_the_logits_and_kv_cache_of_a_fresh_prefill() {
    use nflash_runtime::generate::GenerateOptions;
    use nflash_runtime::sampler::{Sampler, SamplerConfig};
    use nflash_runtime::session::Session;
    for quant in ["q8_0", "q4_0"] {
        let p = pack(quant);
        let pack = Pack::open_resident(&p).unwrap();
        let engine = Engine::load(&pack).unwrap();
        let pass = nflash_plan::layout::prefill_chunk(&engine.model.cfg);
        let opts = GenerateOptions { max_tokens: 12, ignore_eos: true, ..Default::default() };
        let greedy = || Sampler::new(SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 });
        let go = |s: &mut Session, ids: &[u32]| {
            s.generate(&engine, ids, &mut greedy(), &opts, |_| std::ops::ControlFlow::Continue(())).unwrap()
        };
        let fresh = |ids: &[u32]| go(&mut Session::new(&engine, 1024).unwrap(), ids).tokens;
        let text = eval_tokens(700);
        let chat = CHATML_IDS.to_vec();
        // (earlier request, later request)
        let cases: Vec<(Vec<u32>, Vec<u32>)> = vec![
            (chat.clone(), chat.clone()),
            (chat.clone(), [chat.clone(), fresh(&chat), chat[..6].to_vec()].concat()),
            (text[..40].to_vec(), text[..43].to_vec()),
            (text[..40].to_vec(), text[..52].to_vec()),
            (text[..256].to_vec(), text[..256].to_vec()),
            (text[..256].to_vec(), text[..257].to_vec()),
            (text[..300].to_vec(), text[..290].to_vec()),
            (text[..300].to_vec(), text[..640].to_vec()),
            (text[..600].to_vec(), text[..530].to_vec()),
        ];
        let mut reused_cases = 0;
        for (i, (first, second)) in cases.iter().enumerate() {
            let mut s = Session::new(&engine, 1024).unwrap();
            go(&mut s, first);
            let (logits, reused) = s.prefill(&engine, second).unwrap();
            let mut f = Session::new(&engine, 1024).unwrap();
            let (want, none) = f.prefill(&engine, second).unwrap();
            assert_eq!(none, 0);
            let same = first.iter().zip(second).take_while(|(a, b)| a == b).count();
            let expect = same.min(first.len() - first.len() % pass).min(second.len() - 1);
            assert_eq!(reused, expect - expect % pass, "{quant} case {i}");
            reused_cases += usize::from(reused > 0);
            assert_eq!(bits(&logits), bits(&want), "{quant} case {i}: logits, {reused} tokens reused");
            assert_eq!(kv_bits(s.kv_cache()), kv_bits(f.kv_cache()), "{quant} case {i}: KV cache");
            // And generation after the prefix: the greedy tokens of a fresh prefill.
            let mut s = Session::new(&engine, 1024).unwrap();
            go(&mut s, first);
            let t = go(&mut s, second);
            assert_eq!(t.reused_tokens, reused, "{quant} case {i}");
            assert_eq!(t.tokens, fresh(second), "{quant} case {i}: reused {} tokens", t.reused_tokens);
        }
        assert_eq!(reused_cases, 4, "{quant}: the cases that cross a whole pass reuse it");
    }
}

/// The bits of `x`, for comparisons that tell -0.0 from 0.0 and NaN from NaN.
fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Every key and value of every layer in `kv`, as bits.
fn kv_bits(kv: &nflash_runtime::model::kv_cache::KvCache) -> Vec<u32> {
    use nflash_runtime::kernels::KvSlice;
    let mut out = Vec::new();
    for l in 0..kv.n_layers() {
        let (k, v, _) = kv.layer(l);
        for s in [k, v] {
            match s {
                KvSlice::F16(x) => out.extend(x.iter().map(|e| u32::from(e.to_bits()))),
                KvSlice::F32(x) => out.extend(bits(x)),
            }
        }
    }
    assert!(kv.n_layers() > 0 && !kv.is_empty(), "an empty KV cache");
    out
}

/// The planner's fixed region (scratch, runtime) is an estimate the budget
/// depends on: a run that prefills full chunks and fills its context keeps
/// its peak RSS within the budget, for budgets that offload part of the FFN.
#[test]
fn a_full_context_stays_within_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let prompt = tmp.path().join("p.txt");
    // About 280 tokens: one full prefill chunk (256) and part of another.
    std::fs::write(&prompt, eval_text().0.chars().take(1000).collect::<String>()).unwrap();
    let stats = tmp.path().join("s.json");
    for (q, budget, ctx) in [("q4_0", "80MiB", "384"), ("q8_0", "120MiB", "512"), ("q8_0", "105MiB", "384")] {
        let p = pack(q);
        let a = ["run", "--model", p.to_str().unwrap(), "--raw", "--prompt-file", prompt.to_str().unwrap()];
        let o = run(
            "nflash",
            &[&a[..], &["--ctx", ctx, "--max-tokens", "600", "--ignore-eos", "--temperature", "0"]].concat(),
        );
        assert!(o.status.success(), "{q} in memory: {}", String::from_utf8_lossy(&o.stderr));
        // Generation ends at the context; the figures are in the JSON.
        let o2 = run(
            "nflash",
            &[
                &a[..],
                &["--ctx", ctx, "--max-tokens", "600", "--memory-budget", budget, "--ignore-eos", "--temperature", "0"],
                &["--stats-json", stats.to_str().unwrap()],
            ]
            .concat(),
        );
        assert!(o2.status.success(), "{q} at {budget}: {}", String::from_utf8_lossy(&o2.stderr));
        assert_eq!(o.stdout, o2.stdout, "{q} at {budget}: the text differs from the run in memory");
        let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
        let (peak, limit) = (s["peak_rss_bytes"].as_u64().unwrap(), s["memory_budget_bytes"].as_u64().unwrap());
        let used = s["prompt_tokens"].as_u64().unwrap() + s["generated_tokens"].as_u64().unwrap();
        eprintln!(
            "{q} at {budget}, ctx {ctx}: {used} tokens, peak RSS {:.1} MiB, hit rate {}",
            peak as f64 / 1048576.0,
            s["cache_hit_rate"]
        );
        assert!(used + 2 >= ctx.parse::<u64>().unwrap(), "{q}: the run used {used} of {ctx} tokens");
        assert!(s["bytes_read_per_token"].as_f64().unwrap() > 0.0, "{q} at {budget}: nothing offloaded");
        assert!(peak <= limit, "{q} at {budget}, ctx {ctx}: peak RSS {peak} > budget {limit} bytes");
    }
}
