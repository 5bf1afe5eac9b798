//! Tiny random checkpoints of each supported variant, converted to f32 packs,
//! must match candle-transformers run on the same checkpoint.

use crate::common::{
    assert_close_to_reference, assert_matches_reference, check_close, check_greedy, our_logits, our_logits_ctx,
    our_logits_kv, reference_logits, tiny_f32_pack,
};
use nflash_plan::KvType::F32;
use nflash_tests::TinySpec;

fn check(name: &str, spec: TinySpec) {
    let (_tmp, dir, pack, tokens) = tiny_f32_pack(&spec);
    let reference = reference_logits(&dir, &tokens);
    assert_matches_reference(name, &our_logits(&pack, &tokens), &reference);
}

#[test]
fn llama_gqa_llama3_rope_bf16_two_shards() {
    check(
        "llama gqa llama3 bf16 sharded",
        TinySpec { rope_theta: 1e6, llama3_scaling: true, dtype: "BF16", shards: 2, seed: 11, ..Default::default() },
    );
}

#[test]
fn llama_untied_f16() {
    check("llama untied f16", TinySpec { tied: false, dtype: "F16", seed: 12, ..Default::default() });
}

#[test]
fn llama_tied_f32_mha() {
    check("llama mha f32", TinySpec { kv_heads: 4, seed: 13, ..Default::default() });
}

#[test]
fn qwen2_qkv_bias_untied_f32() {
    check(
        "qwen2 bias",
        TinySpec { arch: "Qwen2ForCausalLM", tied: false, rope_theta: 1e6, seed: 14, ..Default::default() },
    );
}

#[test]
fn qwen2_tied_bf16_three_shards() {
    check(
        "qwen2 tied bf16",
        TinySpec { arch: "Qwen2ForCausalLM", tied: true, dtype: "BF16", shards: 3, seed: 15, ..Default::default() },
    );
}

#[test]
fn mistral_explicit_head_dim_sliding_window() {
    check(
        "mistral head_dim 32 window 8",
        TinySpec {
            arch: "MistralForCausalLM",
            tied: false,
            head_dim: Some(32),
            sliding_window: Some(8),
            rope_theta: 1e6,
            seed: 16,
            ..Default::default()
        },
    );
}

#[test]
fn mixtral_top2_of_4_experts() {
    let spec = TinySpec { arch: "MixtralForCausalLM", tied: false, rope_theta: 1e6, seed: 17, ..Default::default() };
    check("mixtral 4 experts top-2", spec.clone());
    check_greedy("mixtral 4 experts top-2", spec);
}

#[test]
fn qwen3_moe_qk_norm_top3_of_8_unnormalized_bf16() {
    let spec = TinySpec {
        arch: "Qwen3MoeForCausalLM",
        experts: 8,
        top_k: 3,
        norm_topk_prob: false,
        inter: 32,
        head_dim: Some(32),
        dtype: "BF16",
        rope_theta: 1e6,
        seed: 18,
        ..Default::default()
    };
    check("qwen3-moe 8 experts top-3", spec.clone());
    check_greedy("qwen3-moe 8 experts top-3", spec);
}

#[test]
fn qwen3_moe_normalized_tied() {
    let spec = TinySpec { arch: "Qwen3MoeForCausalLM", tied: true, seed: 19, ..Default::default() };
    check("qwen3-moe normalized tied", spec.clone());
    check_greedy("qwen3-moe normalized tied", spec);
}

#[test]
fn qwen3_qk_norm_explicit_head_dim_untied_bf16() {
    // head_dim 24 is not hidden / heads (16): the explicit key must win.
    let spec = TinySpec {
        arch: "Qwen3ForCausalLM",
        tied: false,
        head_dim: Some(24),
        dtype: "BF16",
        rope_theta: 1e6,
        seed: 31,
        ..Default::default()
    };
    check_close("qwen3 head_dim 24 untied", spec);
}

#[test]
fn qwen3_tied_mha_f32() {
    let spec =
        TinySpec { arch: "Qwen3ForCausalLM", tied: true, kv_heads: 4, layers: 3, seed: 32, ..Default::default() };
    check_close("qwen3 tied mha", spec);
}

#[test]
fn smollm3_nope_layers_from_the_list() {
    let spec = TinySpec {
        arch: "SmolLM3ForCausalLM",
        layers: 4,
        no_rope_layers: Some(vec![1, 0, 1, 0]),
        rope_theta: 5e6,
        seed: 33,
        ..Default::default()
    };
    check_close("smollm3 no_rope_layers [1,0,1,0]", spec);
}

#[test]
fn smollm3_nope_layers_from_the_interval_untied() {
    let spec = TinySpec {
        arch: "SmolLM3ForCausalLM",
        layers: 4,
        tied: false,
        no_rope_layer_interval: Some(2),
        seed: 34,
        ..Default::default()
    };
    check_close("smollm3 no_rope_layer_interval 2", spec);
}

/// Neither `no_rope_layers` nor `no_rope_layer_interval`: transformers'
/// `SmolLM3Config` makes every 4th layer NoPE (interval 4), while
/// candle-transformers would rotate every layer. HF decides: the pack must
/// give the logits, bit for bit, of the same weights with
/// `no_rope_layer_interval: 4` spelled out (which candle reads as HF does).
#[test]
fn smollm3_without_nope_keys_follows_transformers_interval_4() {
    let base = TinySpec { arch: "SmolLM3ForCausalLM", layers: 4, seed: 35, ..Default::default() };
    let (_t1, _d1, implicit, tokens) = tiny_f32_pack(&base);
    let explicit_spec = TinySpec { no_rope_layer_interval: Some(4), ..base.clone() };
    let (_t2, dir, explicit, _) = tiny_f32_pack(&explicit_spec);
    let (a, b) = (our_logits_kv(&implicit, &tokens, F32), our_logits_kv(&explicit, &tokens, F32));
    assert_eq!(nflash_tests::logit_bits(&a.1), nflash_tests::logit_bits(&b.1), "implicit vs explicit interval 4");
    assert_close_to_reference("smollm3 default interval", &a, &reference_logits(&dir, &tokens), 1e-4);
    // And layer 3 really is NoPE: rotating every layer gives other logits.
    let all_rope = TinySpec { no_rope_layers: Some(vec![1, 1, 1, 1]), ..base };
    let (_t3, _d3, rotated, _) = tiny_f32_pack(&all_rope);
    assert_ne!(nflash_tests::logit_bits(&our_logits_kv(&rotated, &tokens, F32).1), nflash_tests::logit_bits(&a.1));
}

/// `prep inspect` names SmolLM3's NoPE layers and Qwen3's per-head norms.
#[test]
fn inspect_shows_nope_layers_and_qk_norms() {
    for (spec, want) in [
        (
            TinySpec {
                arch: "SmolLM3ForCausalLM",
                layers: 4,
                no_rope_layers: Some(vec![1, 0, 1, 0]),
                ..Default::default()
            },
            "NoPE layers (no RoPE): 1, 3",
        ),
        (TinySpec { arch: "Qwen3ForCausalLM", ..Default::default() }, "RMSNorm on each query and key head"),
    ] {
        let (_tmp, _dir, pack, _) = tiny_f32_pack(&spec);
        let o = nflash_tests::run("prep", &["inspect", pack.to_str().unwrap()]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success() && out.contains(want), "{}: no {want:?} in\n{out}", spec.arch);
    }
}

/// Phi-3: the fused `qkv_proj` and `gate_up_proj` split at convert, RoPE
/// on the first 3/4 of each head (Phi-4-mini's `partial_rotary_factor`),
/// GQA, tied embeddings.
#[test]
fn phi3_fused_projections_partial_rotary_tied() {
    let spec = TinySpec {
        arch: "Phi3ForCausalLM",
        partial_rotary_factor: Some(0.75),
        tied: true,
        rope_theta: 1e4,
        seed: 36,
        ..Default::default()
    };
    check_close("phi3 partial rotary 0.75 tied", spec);
}

/// Phi-3-mini's shape of config: every element rotated, MHA, untied, BF16.
#[test]
fn phi3_full_rotary_mha_untied_bf16() {
    let spec =
        TinySpec { arch: "Phi3ForCausalLM", kv_heads: 4, tied: false, dtype: "BF16", seed: 37, ..Default::default() };
    check_close("phi3 full rotary untied", spec);
}

/// LongRoPE (Phi-3.5-mini, Phi-4-mini): the short factors in a context of
/// at most `original_max_position_embeddings` (256) tokens, the long ones
/// in a longer context, whatever the conversation's length; the attention
/// factor here is 1 (max_position_embeddings = original). candle's `phi3`
/// multiplies the frequencies by the factors where transformers divides,
/// so candle runs with the reciprocals of the factors in force: then both
/// compute transformers' frequencies, and every logit must agree.
#[test]
fn phi3_longrope_short_and_long_factors_follow_transformers() {
    let short: Vec<f32> = (0..6).map(|i| 1.0 + 0.5 * i as f32).collect();
    let long: Vec<f32> = (0..6).map(|i| 2.0 + 4.0 * i as f32).collect();
    let spec = TinySpec {
        arch: "Phi3ForCausalLM",
        partial_rotary_factor: Some(0.75),
        longrope: Some((short.clone(), long.clone())),
        seed: 38,
        ..Default::default()
    };
    let (tmp, dir, pack, tokens) = tiny_f32_pack(&spec);
    let mut ours = vec![];
    for (ctx, factors) in [(tokens.len() + 1, &short), (300, &long)] {
        let cdir = tmp.path().join(format!("candle-{ctx}"));
        std::fs::create_dir(&cdir).unwrap();
        std::fs::copy(dir.join("model.safetensors"), cdir.join("model.safetensors")).unwrap();
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let recip: Vec<f32> = factors.iter().map(|f| 1.0 / f).collect();
        cfg["rope_scaling"]["short_factor"] = serde_json::json!(recip);
        std::fs::write(cdir.join("config.json"), cfg.to_string()).unwrap();
        let got = our_logits_ctx(&pack, &tokens, F32, ctx);
        assert_close_to_reference(&format!("phi3 longrope ctx {ctx}"), &got, &reference_logits(&cdir, &tokens), 1e-4);
        ours.push(nflash_tests::logit_bits(&got.1));
    }
    assert_ne!(ours[0], ours[1], "the long factors changed nothing");
}

/// The architectures issue 44 adds, as q8_0 and q4_0 packs, stay as close
/// to candle's logits on the f32 checkpoint as Llama's packs do (the first
/// spec): relative error below 3% for q8_0 and 35% for q4_0 (these tiny
/// random models quantize poorly: measured for Llama 1.9–2.1% and 25%,
/// for the new ones 0.7–2.1% and 9.7–25%), and the same top-1 token at 90%
/// of the positions or more. NoPE layers are given explicitly and Phi-3
/// runs without LongRoPE, where candle departs from transformers (checked
/// in f32 above).
#[test]
fn new_architectures_quantized_stay_as_close_as_llama() {
    let specs = [
        ("llama", TinySpec { layers: 4, seed: 51, ..Default::default() }),
        ("qwen3", TinySpec { arch: "Qwen3ForCausalLM", head_dim: Some(32), seed: 50, ..Default::default() }),
        (
            "smollm3",
            TinySpec {
                arch: "SmolLM3ForCausalLM",
                layers: 4,
                no_rope_layers: Some(vec![1, 0, 1, 1]),
                seed: 51,
                ..Default::default()
            },
        ),
        ("phi3", TinySpec { longrope: None, ..TinySpec::phi3(52) }),
        ("gemma3", TinySpec::gemma3(53)),
    ];
    for (name, spec) in specs {
        let (tmp, dir, _, tokens) = crate::common::tiny_f32_pack(&spec);
        let reference = reference_logits(&dir, &tokens);
        for (quant, bound) in [("q8_0", 0.03), ("q4_0", 0.35)] {
            let pack = tmp.path().join(format!("{quant}.nflash"));
            nflash_tests::convert(&dir, &pack, quant);
            let (prefill, decode) = our_logits(&pack, &tokens);
            for (path, l) in [("prefill", &prefill), ("decode", &decode)] {
                let err = crate::common::rel_error(l, &reference);
                let agree = crate::common::top1_agreement(l, &reference);
                eprintln!("{name} {quant} {path}: relative error {err:.2e}, top-1 agreement {agree:.3}");
                assert!(err < bound, "{name} {quant} {path}: relative error {err:.3e} ≥ {bound}");
                assert!(agree >= 0.9, "{name} {quant} {path}: top-1 agreement {agree}");
            }
        }
    }
}
