//! Gemma 3 (issue 44): tiny random checkpoints against candle-transformers'
//! `gemma3` where it follows transformers, the image-and-text layout, and
//! the ring KV cache of the sliding-window layers through `Session`.

use std::ops::ControlFlow;

use crate::common::{check_close, our_logits_kv, tiny_f32_pack};
use nflash_format::Pack;
use nflash_plan::KvType;
use nflash_runtime::engine::Engine;
use nflash_runtime::generate::GenerateOptions;
use nflash_runtime::model::kv_cache::KvCache;
use nflash_runtime::sampler::{Sampler, SamplerConfig};
use nflash_runtime::session::Session;
use nflash_tests::TinySpec;

fn spec(seed: u64) -> TinySpec {
    TinySpec::gemma3(seed)
}

#[test]
fn gemma3_local_and_global_layers_match_candle() {
    check_close("gemma3 sliding/global", spec(40));
}

#[test]
fn gemma3_layer_types_mha_bf16() {
    let s = TinySpec {
        kv_heads: 4,
        dtype: "BF16",
        layer_types: Some(vec!["sliding_attention", "full_attention", "sliding_attention"]),
        ..spec(41)
    };
    check_close("gemma3 layer_types bf16", s);
}

/// The window decides: the same checkpoint with a window of 6 gives other
/// logits (so the tests above see the boundary: candle with W − 1 and
/// ours with W agree only if nflash sees exactly W positions).
#[test]
fn gemma3_window_changes_logits() {
    let (_t1, _, a, tokens) = tiny_f32_pack(&spec(40));
    let (_t2, _, b, _) = tiny_f32_pack(&TinySpec { sliding_window: Some(6), ..spec(40) });
    let (la, lb) = (our_logits_kv(&a, &tokens, KvType::F32), our_logits_kv(&b, &tokens, KvType::F32));
    assert_eq!(
        nflash_tests::logit_bits(&la.0[..5]),
        nflash_tests::logit_bits(&lb.0[..5]),
        "positions within both windows"
    );
    assert_ne!(nflash_tests::logit_bits(&la.0[5..]), nflash_tests::logit_bits(&lb.0[5..]));
}

/// `Gemma3ForConditionalGeneration` (text_config, `model.language_model.*`
/// tensors, a vision tower) converts to the pack of its language model:
/// the same logits, bit for bit, as the text-only checkpoint.
#[test]
fn gemma3_image_and_text_checkpoint_converts_its_language_model() {
    let (_t1, _, text, tokens) = tiny_f32_pack(&spec(42));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mm");
    nflash_tests::write_tiny_checkpoint(&dir, &TinySpec { multimodal: true, ..spec(42) });
    let out = tmp.path().join("mm.nflash");
    let o = nflash_tests::prep_convert(&dir, &out, &["--quant", "f32"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("vision tower") && stderr.contains("1 tensors"), "{stderr}");
    let (a, b) = (our_logits_kv(&text, &tokens, KvType::F32), our_logits_kv(&out, &tokens, KvType::F32));
    assert_eq!(nflash_tests::logit_bits(&a.0), nflash_tests::logit_bits(&b.0));
}

/// Runs `tokens` through `kv` as prefill does (passes of at most `pass`
/// tokens), then decodes `extra` one at a time; the logits of the last
/// prompt token and of each decoded token.
fn run(
    model: &nflash_runtime::model::Model,
    kv: &mut KvCache,
    tokens: &[u32],
    pass: usize,
    extra: &[u32],
) -> Vec<Vec<u32>> {
    let h = model.cfg.hidden_size as usize;
    let mut out = Vec::new();
    let mut last = Vec::new();
    for chunk in tokens.chunks(pass) {
        last = model.forward(kv, chunk).unwrap();
    }
    out.push(model.logits(&last[last.len() - h..]));
    for &t in extra {
        out.push(model.logits(&model.forward(kv, &[t]).unwrap()));
    }
    nflash_tests::logit_bits(&out)
}

/// The sliding-window layers keep a ring of window + one pass positions,
/// and give the bits of a cache that keeps every position: prefill passes
/// much longer than the window (512 tokens, window 5), decode past the
/// ring's end, and a rollback of the last tokens of a pass (rejected draft
/// tokens) followed by other tokens.
#[test]
fn gemma3_ring_kv_cache_gives_the_bits_of_a_full_cache() {
    let (_tmp, _, pack, _) = tiny_f32_pack(&spec(43));
    let p = Pack::open_resident(&pack).unwrap();
    let engine = Engine::load(&p).unwrap();
    let model = &engine.model;
    let pass = nflash_plan::layout::prefill_chunk(&model.cfg);
    let ctx = 2048;
    let text: Vec<u32> = (0..1200u32).map(|i| 3 + (i * 37 + i / 7) % 77).collect();
    let kvd = (model.cfg.num_kv_heads * model.cfg.head_dim) as usize;
    let mut ring = model.new_kv_cache(ctx);
    let mut full = KvCache::new(model.cfg.num_layers as usize, kvd, ctx, KvType::F16);
    let extra: Vec<u32> = (0..600u32).map(|i| 3 + (i * 11) % 77).collect();
    let a = run(model, &mut ring, &text, pass, &extra);
    let b = run(model, &mut full, &text, pass, &extra);
    assert!(a == b, "the ring's logits differ from a full cache's");
    // Layer 0 slides: window 5 + one pass; layer 1 holds everything.
    assert!(ring.layer_rows(0) <= 5 + pass, "{} rows", ring.layer_rows(0));
    assert_eq!(ring.layer_rows(1), text.len() + extra.len());
    // Rollback within the last pass: 6 tokens verified at once, 4 rejected.
    let len = ring.len();
    let draft = [5u32, 9, 11, 13, 17, 19];
    for kv in [&mut ring, &mut full] {
        model.forward(kv, &draft).unwrap();
        assert_eq!(kv.truncate(len + 2), len + 2);
    }
    assert!(run(model, &mut ring, &[23], pass, &[29, 31]) == run(model, &mut full, &[23], pass, &[29, 31]));
    // Back within the ring works; further back than it holds keeps nothing.
    assert!(ring.can_truncate_to(len - 100));
    assert!(!ring.can_truncate_to(len - pass - 10));
    assert_eq!(ring.truncate(len - pass - 10), 0);
    assert!(ring.is_empty());
}

/// Through `Session`: a follow-up request reuses the prefix of whole
/// prefill passes while the sliding layers' rings still hold it, and
/// prefills again from the start once decoding has moved them past it;
/// either way its logits and tokens are a fresh session's.
#[test]
fn gemma3_session_reuses_within_the_ring_and_prefills_again_beyond() {
    let (_tmp, _, pack, _) = tiny_f32_pack(&spec(44));
    let p = Pack::open_resident(&pack).unwrap();
    let engine = Engine::load(&p).unwrap();
    let pass = nflash_plan::layout::prefill_chunk(&engine.model.cfg);
    let greedy = || Sampler::new(SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 });
    let text: Vec<u32> = (0..900u32).map(|i| 3 + (i * 13 + i / 5) % 77).collect();
    let (first, second) = (&text[..pass + 100], &text[..pass + 300]);
    for (decoded, want_reused) in [(8, pass), (pass + 20, 0)] {
        let opts = GenerateOptions { max_tokens: decoded, ignore_eos: true, ..Default::default() };
        let mut s = Session::new(&engine, 2048).unwrap();
        s.generate(&engine, first, &mut greedy(), &opts, |_| ControlFlow::Continue(())).unwrap();
        let (logits, reused) = s.prefill(&engine, second).unwrap();
        assert_eq!(reused, want_reused, "after {decoded} decoded tokens");
        let (fresh, _) = Session::new(&engine, 2048).unwrap().prefill(&engine, second).unwrap();
        assert_eq!(
            nflash_tests::logit_bits(&[logits]),
            nflash_tests::logit_bits(&[fresh]),
            "after {decoded} decoded tokens"
        );
        let opts = GenerateOptions { max_tokens: 16, ignore_eos: true, ..Default::default() };
        let mut fresh = Session::new(&engine, 2048).unwrap();
        let want = fresh.generate(&engine, second, &mut greedy(), &opts, |_| ControlFlow::Continue(())).unwrap();
        let got = s.generate(&engine, second, &mut greedy(), &opts, |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(got.tokens, want.tokens);
    }
}

/// Perplexity windows start with BOS where the text does (as llama.cpp's
/// `perplexity`): each window's first token is replaced by it, and the
/// figure is the mean negative log-likelihood of the rest given that.
#[test]
fn perplexity_windows_start_with_bos() {
    let (_tmp, _, pack, _) = tiny_f32_pack(&spec(45));
    let p = Pack::open(&pack).unwrap();
    let model = nflash_runtime::load_model(&p, &nflash_plan::CacheConfig::all_hot(&p)).unwrap();
    let text: Vec<u32> = (0..40u32).map(|i| 3 + (i * 29) % 77).collect();
    let ctx = 20;
    let with = nflash_runtime::ppl::perplexity(&model, &text, ctx, Some(0), |_, _| {}).unwrap();
    let without = nflash_runtime::ppl::perplexity(&model, &text, ctx, None, |_, _| {}).unwrap();
    let mut nll = 0f64;
    for w in text.chunks(ctx) {
        let run = [&[0u32][..], &w[1..]].concat();
        let mut kv = model.new_kv_cache(ctx);
        for (i, &t) in run.iter().enumerate().take(ctx - 1) {
            let l = model.logits(&model.forward(&mut kv, &[t]).unwrap());
            let max = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = l.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
            nll += lse - l[w[i + 1] as usize] as f64;
        }
    }
    let want = (nll / (text.len() - 2) as f64).exp();
    assert_eq!(with.tokens, text.len() - 2);
    assert!((with.perplexity / want - 1.0).abs() < 1e-4, "{} vs {want}", with.perplexity);
    assert!((without.perplexity / want - 1.0).abs() > 1e-3, "BOS changed nothing");
}
