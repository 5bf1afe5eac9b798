//! Tiny random checkpoints of each supported variant, converted to f32 packs,
//! must match candle-transformers run on the same checkpoint.

use crate::common::{assert_matches_reference, our_logits, reference_logits, tiny_f32_pack};
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

/// Greedy decoding of 32 tokens after the prompt by our decode path, each
/// token checked against the reference's argmax at that position (so the
/// reference, decoding greedily, would choose the same 32 tokens).
fn check_greedy(name: &str, spec: TinySpec) {
    let (_tmp, dir, pack, tokens) = tiny_f32_pack(&spec);
    let prompt = &tokens[..8];
    let p = nflash_format::Pack::open(&pack).unwrap();
    let model = nflash_runtime::load_model(&p, &nflash_plan::CacheConfig::all_hot(&p)).unwrap();
    let (_, ours) = nflash_tests::greedy(&model, prompt, 32);
    let mut all = prompt.to_vec();
    all.extend(&ours);
    let reference = reference_logits(&dir, &all);
    let theirs: Vec<u32> =
        reference[prompt.len() - 1..all.len() - 1].iter().map(|l| crate::common::argmax(l) as u32).collect();
    assert_eq!(ours, theirs, "{name}: greedy tokens differ from the reference");
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
