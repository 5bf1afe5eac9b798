//! ReLU-family FFNs: `hidden_act: relu` with and without `mlp_bias`
//! and dReLU (TurboSparse, `BambooForCausalLM`) on tiny random checkpoints
//! match a straightforward f32 implementation written here (candle-transformers
//! has no FFN bias and no dReLU), and candle-transformers' Mistral where it
//! applies (ReLU without bias).

use std::collections::HashMap;
use std::path::Path;

use crate::common::{assert_matches_reference, our_logits, reference_logits, tiny_f32_pack};
use nflash_tests::{write_tiny_checkpoint, TinySpec};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// Every tensor of the checkpoint in `dir` as f32.
fn load_tensors(dir: &Path) -> HashMap<String, Vec<f32>> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            let d = t.data();
            let v: Vec<f32> = match t.dtype() {
                Dtype::F32 => d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
                Dtype::F16 => d.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                Dtype::BF16 => d.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                other => panic!("{other:?}"),
            };
            out.insert(name, v);
        }
    }
    out
}

/// `w · x` for `w` `[rows, x.len()]`.
fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len()).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * s * w).collect()
}

/// HF RoPE (rotate_half) on one head `[head_dim]` at position `pos`.
fn rope(v: &mut [f32], pos: usize, theta: f32) {
    let hd = v.len();
    for i in 0..hd / 2 {
        let f = theta.powf(-2.0 * i as f32 / hd as f32);
        let (s, c) = (pos as f32 * f).sin_cos();
        let (a, b) = (v[i], v[i + hd / 2]);
        v[i] = a * c - b * s;
        v[i + hd / 2] = b * c + a * s;
    }
}

/// Logits `[n][vocab]` of `tokens` by a direct f32 transcription of the HF
/// Llama/Mistral forward: RMSNorm, GQA with RoPE, causal softmax attention,
/// FFN `down · (relu(gate·x + bg) ⊙ up'(up·x + bu)) + bd`, where `up'` is the
/// identity for ReLU and ReLU for dReLU (Bamboo).
fn f32_reference(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let w = load_tensors(dir);
    let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (h, nh, nkv, layers) =
        (u("hidden_size"), u("num_attention_heads"), u("num_key_value_heads"), u("num_hidden_layers"));
    let hd = cfg["head_dim"].as_u64().map_or(h / nh, |v| v as usize);
    let eps = cfg["rms_norm_eps"].as_f64().unwrap() as f32;
    let theta = cfg["rope_theta"].as_f64().unwrap() as f32;
    assert_eq!(cfg["hidden_act"], "relu");
    let drelu = cfg["architectures"][0] == "BambooForCausalLM";
    let bias = cfg["mlp_bias"].as_bool().unwrap_or(false);
    let g = |n: &str| w.get(n).unwrap_or_else(|| panic!("{n}")).as_slice();
    let embed = g("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f32>> = tokens.iter().map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec()).collect();
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let (mut ks, mut vs, mut qs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let xn = rms_norm(x, g(&format!("{p}.input_layernorm.weight")), eps);
            let (mut q, mut k) = (
                matvec(g(&format!("{p}.self_attn.q_proj.weight")), &xn),
                matvec(g(&format!("{p}.self_attn.k_proj.weight")), &xn),
            );
            q.chunks_exact_mut(hd).for_each(|hq| rope(hq, pos, theta));
            k.chunks_exact_mut(hd).for_each(|hk| rope(hk, pos, theta));
            qs.push(q);
            ks.push(k);
            vs.push(matvec(g(&format!("{p}.self_attn.v_proj.weight")), &xn));
        }
        for (t, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0f32; nh * hd];
            for head in 0..nh {
                let kvh = head / (nh / nkv);
                let q = &qs[t][head * hd..(head + 1) * hd];
                let scores: Vec<f32> = (0..=t)
                    .map(|s| {
                        q.iter().zip(&ks[s][kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (s, es) in e.iter().enumerate() {
                    for d in 0..hd {
                        att[head * hd + d] += es / z * vs[s][kvh * hd + d];
                    }
                }
            }
            let o = matvec(g(&format!("{p}.self_attn.o_proj.weight")), &att);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let xn = rms_norm(x, g(&format!("{p}.post_attention_layernorm.weight")), eps);
            let mut gate = matvec(g(&format!("{p}.mlp.gate_proj.weight")), &xn);
            let mut up = matvec(g(&format!("{p}.mlp.up_proj.weight")), &xn);
            if bias {
                gate.iter_mut().zip(g(&format!("{p}.mlp.gate_proj.bias"))).for_each(|(a, b)| *a += b);
                up.iter_mut().zip(g(&format!("{p}.mlp.up_proj.bias"))).for_each(|(a, b)| *a += b);
            }
            let act: Vec<f32> =
                gate.iter().zip(&up).map(|(&gv, &uv)| gv.max(0.0) * if drelu { uv.max(0.0) } else { uv }).collect();
            let mut down = matvec(g(&format!("{p}.mlp.down_proj.weight")), &act);
            if bias {
                down.iter_mut().zip(g(&format!("{p}.mlp.down_proj.bias"))).for_each(|(a, b)| *a += b);
            }
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
    }
    let head = w.get("lm_head.weight").unwrap_or(w.get("model.embed_tokens.weight").unwrap());
    xs.iter().map(|x| matvec(head, &rms_norm(x, g("model.norm.weight"), eps))).collect()
}

fn check(name: &str, spec: TinySpec) -> Vec<Vec<f32>> {
    let (_tmp, dir, pack, tokens) = tiny_f32_pack(&spec);
    let reference = f32_reference(&dir, &tokens);
    assert_matches_reference(name, &our_logits(&pack, &tokens), &reference);
    if spec.arch == "MistralForCausalLM" && !spec.mlp_bias {
        // The transcription agrees with candle-transformers where both apply.
        assert_matches_reference(
            &format!("{name} (f32 reference vs candle)"),
            &(reference.clone(), reference.clone()),
            &reference_logits(&dir, &tokens),
        );
    }
    reference
}

#[test]
fn relu_llama_with_mlp_bias() {
    check("relu llama mlp_bias", TinySpec { act: "relu", mlp_bias: true, tied: false, seed: 31, ..Default::default() });
}

#[test]
fn relu_mistral_gqa_matches_candle_too() {
    check(
        "relu mistral",
        TinySpec { arch: "MistralForCausalLM", act: "relu", tied: false, seed: 32, ..Default::default() },
    );
}

#[test]
fn drelu_bamboo_with_mlp_bias() {
    let spec = TinySpec {
        arch: "BambooForCausalLM",
        act: "relu",
        mlp_bias: true,
        dtype: "BF16",
        seed: 33,
        ..Default::default()
    };
    let drelu = check("drelu bamboo mlp_bias", spec.clone());
    // The same weights read as plain ReLU give other logits: dReLU is really applied.
    let relu = {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        write_tiny_checkpoint(&dir, &TinySpec { arch: "MistralForCausalLM", ..spec });
        let tokens: Vec<u32> = (0..24).map(|i| ((i * 7 + 3) % 80) as u32).collect();
        f32_reference(&dir, &tokens)
    };
    assert!(
        crate::common::rel_error(&relu, &drelu) > 1e-2,
        "dReLU and ReLU logits are the same: the up ReLU had no effect"
    );
}
