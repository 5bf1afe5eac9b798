//! `prep synth`: a synthetic Hugging Face checkpoint of a chosen shape whose
//! FFN activation statistics are controlled.
//!
//! No ReLU-family checkpoint can be fetched here, so the sparse, skewed regime
//! of ReluLLaMA / ProSparse / TurboSparse models is generated instead:
//! - weights are random (uniform, scaled by fan-in), norms are 1;
//! - neuron `i`'s target activation probability `p_i` follows a power law over
//!   its hotness rank `k`: `p = min(1, c·(k+1)^-skew)`, with `c` chosen so the
//!   mean is `1 − sparsity`; ranks are a random permutation per layer, so hot
//!   neurons are scattered as in real models;
//! - ReLU (`hidden_act: relu`, `mlp_bias: true`): the gate bias of neuron `i`
//!   is set from the statistics of its pre-activation `z_i = gate_i · xn` over
//!   calibration tokens run through the layers generated so far:
//!   `b_i = −(μ_i + σ_i Φ⁻¹(1 − p_i))`, so `P(z_i + b_i > 0) ≈ p_i`;
//! - dReLU (TurboSparse, `BambooForCausalLM`): gate and up biases each target
//!   `√p_i` (their pre-activations come from independent projections);
//! - the gate (and, for dReLU, up) rows lie in a random `--active-rank`
//!   dimensional subspace of the hidden space, as activity is predictable from
//!   a low-dimensional projection in trained models (Deja Vu, PowerInfer):
//!   the trained predictors can then reach their recall target.
//!
//! Mixtures of experts (`mixtral-47b`, `qwen3-30b-a3b`, `tiny-moe`) have no
//! FFN biases (neither Hugging Face's Mixtral nor llama.cpp has them), so
//! the same control goes through a *bias channel*: hidden dimension 0 of
//! every embedding is the constant [`BIAS_CHANNEL`], and no attention or
//! expert output writes to it, so after each RMSNorm it is nearly the same
//! for every token; column 0 of a weight then acts as a bias. Each expert's
//! gate (dReLU: and up) column 0 sets its neurons' activation probabilities
//! from the statistics of the tokens the router sends it, and the router's
//! column 0 sets the experts' popularity: a power law over a random ranking
//! per layer (`--router-skew`), calibrated on the calibration tokens.
//!
//! Writing streams one tensor at a time: every tensor is regenerated from the
//! seed when its shard is written, so peak memory is one tensor plus one
//! layer's weights during calibration, whatever the model size.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::{Args, ValueEnum};
use indicatif::ProgressBar;
use nflash_format::{Activation, Architecture, ModelConfig, Moe};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use safetensors::tensor::View;
use safetensors::Dtype;
use serde_json::{json, Value};
use statrs::distribution::{ContinuousCDF, Normal};

use nflash_plan::sim::power_law;

use crate::checkpoint::{read_json, token_ids};
use crate::forward::{split_windows, Forward, WeightSource};
use crate::progress::Progress;
use nflash_runtime::message;

/// Model shapes `prep synth` can generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Shape {
    /// Llama-2-7B: hidden 4096, FFN 11008, 32 layers, 32 heads (MHA).
    #[value(name = "llama-7b")]
    Llama7b,
    /// Mistral-7B: hidden 4096, FFN 14336, 32 layers, 32 heads, 8 KV heads (GQA).
    #[value(name = "mistral-7b")]
    Mistral7b,
    /// For tests: hidden 128, FFN 512, 2 layers, 4 heads, 2 KV heads.
    Tiny,
    /// Mixtral-8x7B (TurboSparse-Mixtral-47B's shape): hidden 4096, 8 experts
    /// of FFN 14336, 2 per token, 32 layers, 32 heads, 8 KV heads.
    #[value(name = "mixtral-47b")]
    Mixtral47b,
    /// Qwen3-30B-A3B: hidden 2048, 128 experts of FFN 768, 8 per token, 48
    /// layers, 32 heads of 128, 4 KV heads, q/k RMSNorm.
    #[value(name = "qwen3-30b-a3b")]
    Qwen3MoeA3b,
    /// For tests: a Mixtral of hidden 128, 8 experts of FFN 256, 2 per token, 2 layers.
    #[value(name = "tiny-moe")]
    TinyMoe,
}

/// FFN activation of the generated model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SynthAct {
    /// ReLU on the gate (ReluLLaMA / ProSparse style; `hidden_act: relu`).
    Relu,
    /// ReLU on gate and up (TurboSparse; written as `BambooForCausalLM`).
    Drelu,
}

/// Weight storage type of the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SynthDtype {
    Bf16,
    F16,
    F32,
}

/// Arguments of `prep synth`.
#[derive(Args)]
pub struct SynthArgs {
    /// Model shape.
    #[arg(long, value_enum)]
    shape: Shape,
    /// Output checkpoint directory (must not exist; written to a temporary directory, then renamed).
    #[arg(long)]
    out: PathBuf,
    /// Target mean fraction of FFN neurons inactive per token, in (0, 1).
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    sparsity: f64,
    /// Power-law exponent of per-neuron activation probability over hotness rank
    /// (0: every neuron equally likely; 1.5: the hottest 20% give ~80% of activations at sparsity 0.9).
    #[arg(long, default_value_t = 1.5, allow_negative_numbers = true)]
    skew: f64,
    /// FFN activation.
    #[arg(long, value_enum, default_value = "relu")]
    act: SynthAct,
    /// Dimension of the subspace the gate (dReLU: and up) rows lie in; default 128 (tiny: 16).
    #[arg(long)]
    active_rank: Option<usize>,
    /// Decoder layers (default: the shape's), at most 256.
    #[arg(long)]
    layers: Option<usize>,
    /// Weight type.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: SynthDtype,
    /// Random seed (weights, hotness ranks, calibration tokens).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Directory with the tokenizer files to reuse (tokenizer.json, tokenizer_config.json;
    /// config.json / generation_config.json for BOS/EOS ids if present).
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct")]
    tokenizer: PathBuf,
    /// Largest shard, bytes (e.g. 2GiB).
    #[arg(long, default_value = "2GiB", value_parser = nflash_plan::planner::parse_bytes)]
    shard_bytes: u64,
    /// Calibration tokens (uniformly random ids) whose statistics set the biases, 16 to 65536.
    #[arg(long, default_value_t = 512)]
    calib_tokens: usize,
    /// Mixtures of experts: power-law exponent of expert popularity over a
    /// random ranking per layer (0: every expert equally often; 1: the most
    /// popular of 8 about 3× as often as the mean).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    router_skew: f64,
}

/// The command-line spelling of a `--shape`/`--act` value (`llama-7b`, `drelu`).
fn cli_name(v: impl ValueEnum) -> String {
    v.to_possible_value().map_or_else(String::new, |p| p.get_name().to_string())
}

/// A shape's dimensions.
struct Dims {
    arch: Architecture,
    hidden: u64,
    /// FFN neurons (per expert for a mixture of experts).
    inter: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    theta: f64,
    max_pos: u64,
}

/// The dimensions of `shape`.
fn dims(shape: Shape) -> Dims {
    let moe = |num_experts, experts_per_token| Moe { num_experts, experts_per_token, norm_topk_prob: true };
    let d = |arch, hidden, inter, layers, heads, kv_heads, theta, max_pos| Dims {
        arch,
        hidden,
        inter,
        layers,
        heads,
        kv_heads,
        head_dim: hidden / heads,
        theta,
        max_pos,
    };
    match shape {
        Shape::Llama7b => d(Architecture::Llama, 4096, 11008, 32, 32, 32, 10000.0, 4096),
        Shape::Mistral7b => d(Architecture::Mistral, 4096, 14336, 32, 32, 8, 1e6, 32768),
        Shape::Tiny => d(Architecture::Llama, 128, 512, 2, 4, 2, 10000.0, 512),
        Shape::Mixtral47b => d(Architecture::Mixtral(moe(8, 2)), 4096, 14336, 32, 32, 8, 1e6, 32768),
        Shape::Qwen3MoeA3b => {
            Dims { head_dim: 128, ..d(Architecture::Qwen3Moe(moe(128, 8)), 2048, 768, 48, 32, 4, 1e6, 32768) }
        }
        Shape::TinyMoe => d(Architecture::Mixtral(moe(8, 2)), 128, 256, 2, 4, 2, 1e6, 512),
    }
}

/// The constant of hidden dimension 0 in every embedding of a synthetic
/// mixture of experts (the bias channel, module docs).
const BIAS_CHANNEL: f32 = 4.0;

/// The generator: a [`WeightSource`] whose tensors are functions of the seed.
pub struct Synth {
    cfg: ModelConfig,
    seed: u64,
    /// Subspace dimension of gate (and dReLU up) rows.
    rank: usize,
    /// Calibrated biases by tensor name (`…gate_proj.bias`, `…up_proj.bias`), `[n_neurons]`.
    biases: Mutex<HashMap<String, Vec<f32>>>,
    /// Mixtures of experts: calibrated column 0 (the bias channel) of the
    /// experts' gate (dReLU: and up) weights and of the routers, by tensor name, `[rows]`.
    col0: Mutex<HashMap<String, Vec<f32>>>,
}

/// splitmix64 finalizer: decorrelates nearby seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a tensor name.
fn key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Uniform values in `[-a, a)` with standard deviation `std` (`a = √3·std`), one RNG per row.
fn fill_row(seed: u64, name_key: u64, row: u64, std: f32, out: &mut [f32]) {
    let mut rng = SmallRng::seed_from_u64(mix(seed ^ mix(name_key ^ mix(row))));
    let a = 3f32.sqrt() * std;
    out.iter_mut().for_each(|v| *v = (rng.random::<f32>() * 2.0 - 1.0) * a);
}

impl Synth {
    /// Whether `name` is a low-rank projection (gate; dReLU: up too), of a
    /// dense FFN or an expert (Mixtral `w1`/`w3`, Qwen3-MoE `gate_proj`/`up_proj`).
    fn is_low_rank(&self, name: &str) -> bool {
        let drelu = self.cfg.activation == Activation::DRelu;
        name.ends_with("mlp.gate_proj.weight")
            || (drelu && name.ends_with("mlp.up_proj.weight"))
            || (name.contains(".experts.")
                && (name.ends_with(".w1.weight")
                    || name.ends_with(".gate_proj.weight")
                    || (drelu && (name.ends_with(".w3.weight") || name.ends_with(".up_proj.weight")))))
    }

    /// Whether this is a synthetic mixture of experts (bias channel in hidden dimension 0).
    fn moe(&self) -> bool {
        self.cfg.architecture.moe().is_some()
    }

    /// Whether `name` is a router (`[num_experts, hidden]`).
    fn is_router(name: &str) -> bool {
        name.ends_with("block_sparse_moe.gate.weight") || name.ends_with("mlp.gate.weight")
    }

    /// Whether `name` writes to the residual stream (attention output, expert down projection).
    fn writes_residual(name: &str) -> bool {
        name.ends_with("o_proj.weight")
            || (name.contains(".experts.") && (name.ends_with(".w2.weight") || name.ends_with(".down_proj.weight")))
    }

    /// Applies the bias channel to rows `rows` (`out`: `[rows.len(), cols]`)
    /// of tensor `name` of a synthetic mixture of experts: the embedding's
    /// column 0 is [`BIAS_CHANNEL`]; residual writers' row 0 is zero; a
    /// calibrated column 0 (expert gate/up, router) is set.
    fn bias_channel(&self, name: &str, rows: Range<usize>, cols: usize, out: &mut [f32]) -> Result<()> {
        if name.contains("embed_tokens") {
            out.chunks_exact_mut(cols).for_each(|r| r[0] = BIAS_CHANNEL);
        } else if Self::writes_residual(name) && rows.start == 0 {
            out[..cols].fill(0.0);
        } else if Self::is_router(name) || self.is_low_rank(name) {
            let c = self.col0.lock().unwrap_or_else(|e| e.into_inner());
            // Before calibration (its own statistics) column 0 is 0.
            if let Some(v) = c.get(name) {
                out.chunks_exact_mut(cols).zip(&v[rows]).for_each(|(r, &b)| r[0] = b);
            } else {
                out.chunks_exact_mut(cols).for_each(|r| r[0] = 0.0);
            }
        }
        Ok(())
    }

    /// Standard deviation of a full-rank random tensor of `shape` named `name`:
    /// 1 for embeddings (RMSNorm rescales them), else 1/√fan_in so that every
    /// projection keeps its output O(1).
    fn std_of(name: &str, shape: &[usize]) -> f32 {
        if name.contains("embed_tokens") {
            1.0
        } else {
            1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt()
        }
    }

    /// Rows `rows` of tensor `name` of `shape`, `[rows.len(), cols]`.
    fn gen_rows(&self, name: &str, shape: &[usize], rows: Range<usize>) -> Result<Vec<f32>> {
        let cols = if shape.len() == 2 { shape[1] } else { 1 };
        let n = rows.len();
        if name.ends_with("norm.weight") {
            return Ok(vec![1.0; n * cols]);
        }
        if name.ends_with(".bias") {
            if name.ends_with("down_proj.bias")
                || (name.ends_with("up_proj.bias") && self.cfg.activation != Activation::DRelu)
            {
                return Ok(vec![0.0; n * cols]);
            }
            let b = self.biases.lock().unwrap_or_else(|e| e.into_inner());
            let v =
                b.get(name).with_context(|| format!("internal: bias {name} used before its layer was calibrated"))?;
            return Ok(v[rows].to_vec());
        }
        let mut out = vec![0f32; n * cols];
        if self.is_low_rank(name) {
            // Row i = g_i · P: g_i `[rank]` (std 1/√rank), P `[rank, hidden]` (std 1/√hidden).
            let p = self.basis(name, cols);
            let g = self.coefficients(name, rows.clone());
            let w = Tensor::from_vec(g, (n, self.rank), &Device::Cpu)?.matmul(&Tensor::from_vec(
                p,
                (self.rank, cols),
                &Device::Cpu,
            )?)?;
            out = w.flatten_all()?.to_vec1::<f32>()?;
        } else {
            let (k, std) = (key(name), Self::std_of(name, shape));
            out.par_chunks_mut(cols).zip(rows.clone()).for_each(|(o, r)| fill_row(self.seed, k, r as u64, std, o));
        }
        if self.moe() && cols > 1 {
            self.bias_channel(name, rows, cols, &mut out)?;
        }
        Ok(out)
    }

    /// `P` `[rank, hidden]` of a low-rank projection.
    fn basis(&self, name: &str, hidden: usize) -> Vec<f32> {
        let k = key(&format!("{name}#basis"));
        let mut p = vec![0f32; self.rank * hidden];
        let std = 1.0 / (hidden as f32).sqrt();
        p.par_chunks_mut(hidden).enumerate().for_each(|(r, o)| fill_row(self.seed, k, r as u64, std, o));
        p
    }

    /// Coefficients `g` `[rows.len(), rank]` of a low-rank projection.
    fn coefficients(&self, name: &str, rows: Range<usize>) -> Vec<f32> {
        let k = key(&format!("{name}#coef"));
        let mut g = vec![0f32; rows.len() * self.rank];
        let std = 1.0 / (self.rank as f32).sqrt();
        g.par_chunks_mut(self.rank).zip(rows).for_each(|(o, r)| fill_row(self.seed, k, r as u64, std, o));
        g
    }

    /// Target activation probability of every neuron of FFN unit `l` (a
    /// layer, or an expert of one) `[n_neurons]`: a power law over a random
    /// hotness ranking, mean `1 − sparsity`.
    pub fn targets(&self, l: usize, sparsity: f64, skew: f64) -> Vec<f64> {
        let n = self.cfg.intermediate_size as usize;
        self.ranked(power_law(n, 1.0 - sparsity, skew), 0x686f74 ^ l as u64)
    }

    /// Target share of the tokens of each expert of layer `l` `[num_experts]`
    /// (summing to `experts_per_token`): a power law of exponent `skew` over
    /// a random popularity ranking.
    fn expert_targets(&self, l: usize, skew: f64) -> Vec<f64> {
        let m = self.cfg.architecture.moe().expect("a mixture of experts");
        let e = m.num_experts as usize;
        self.ranked(power_law(e, m.experts_per_token as f64 / e as f64, skew), 0x726f75746572 ^ l as u64)
    }

    /// `curve` (by rank) assigned to a random permutation drawn from `stream`:
    /// element `order[k]` gets `curve[k]`.
    fn ranked(&self, curve: Vec<f64>, stream: u64) -> Vec<f64> {
        let n = curve.len();
        let mut order: Vec<usize> = (0..n).collect();
        // Fisher–Yates with a per-stream RNG: element order[k] gets rank k.
        let mut rng = SmallRng::seed_from_u64(mix(self.seed ^ mix(stream)));
        for i in (1..n).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        let mut p = vec![0.0; n];
        for (k, &i) in order.iter().enumerate() {
            p[i] = curve[k];
        }
        p
    }
}

impl WeightSource for Synth {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.gen_rows(name, shape, 0..shape[0])
    }
    fn rows_f32(&self, name: &str, shape: &[usize], rows: &[u32]) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(rows.len() * shape.get(1).copied().unwrap_or(1));
        for &r in rows {
            out.extend(self.gen_rows(name, shape, r as usize..r as usize + 1)?);
        }
        Ok(out)
    }
}

/// Tensor names and shapes in HF order.
fn tensor_list(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, n, v) = (cfg.hidden_size as usize, cfg.intermediate_size as usize, cfg.vocab_size as usize);
    let (qd, kvd) = ((cfg.num_heads * cfg.head_dim) as usize, (cfg.num_kv_heads * cfg.head_dim) as usize);
    let experts = cfg.experts() as usize;
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..cfg.num_layers as usize {
        let p = format!("model.layers.{l}");
        t.push((format!("{p}.input_layernorm.weight"), vec![h]));
        t.push((format!("{p}.self_attn.q_proj.weight"), vec![qd, h]));
        t.push((format!("{p}.self_attn.k_proj.weight"), vec![kvd, h]));
        t.push((format!("{p}.self_attn.v_proj.weight"), vec![kvd, h]));
        t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, qd]));
        if cfg.qk_norm() {
            t.push((format!("{p}.self_attn.q_norm.weight"), vec![cfg.head_dim as usize]));
            t.push((format!("{p}.self_attn.k_norm.weight"), vec![cfg.head_dim as usize]));
        }
        t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        if let Some(router) = cfg.router_name(l) {
            t.push((router, vec![experts, h]));
            for u in l * experts..(l + 1) * experts {
                let [gate, up, down] = cfg.ffn_tensor_names(u);
                t.push((gate, vec![n, h]));
                t.push((up, vec![n, h]));
                t.push((down, vec![h, n]));
            }
            continue;
        }
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![n, h]));
        t.push((format!("{p}.mlp.gate_proj.bias"), vec![n]));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![n, h]));
        t.push((format!("{p}.mlp.up_proj.bias"), vec![n]));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![h, n]));
        t.push((format!("{p}.mlp.down_proj.bias"), vec![h]));
    }
    t.push(("model.norm.weight".to_string(), vec![h]));
    t.push(("lm_head.weight".to_string(), vec![v, h]));
    t
}

/// Uniformly random token ids in `first..vocab`: the most diverse inputs, so
/// that each neuron's pre-activation statistics are those of the whole
/// embedding space rather than of a few frequent tokens (a Zipf-like stream
/// underestimates the spread and leaves real text ~1.5 points less sparse).
fn calib_tokens(n: usize, vocab: usize, first: usize, seed: u64) -> Vec<u32> {
    let mut rng = SmallRng::seed_from_u64(mix(seed ^ 0x63616c6962));
    (0..n).map(|_| rng.random_range(first as u32..vocab as u32)).collect()
}

/// Per-neuron mean and standard deviation over rows of `z` `[n_tokens, n]`.
fn column_stats(z: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let t = (z.len() / n).max(1) as f64;
    let (mut s, mut s2) = (vec![0f64; n], vec![0f64; n]);
    for row in z.chunks_exact(n) {
        for (i, &v) in row.iter().enumerate() {
            s[i] += v as f64;
            s2[i] += (v as f64) * (v as f64);
        }
    }
    let mu: Vec<f64> = s.iter().map(|v| v / t).collect();
    let sd = s2.iter().zip(&mu).map(|(v, m)| (v / t - m * m).max(1e-12).sqrt()).collect();
    (mu, sd)
}

/// `b_i = −(μ_i + σ_i Φ⁻¹(1 − p_i))`: bias making `P(z_i + b_i > 0) = p_i` for Gaussian `z_i`.
fn biases_for(mu: &[f64], sd: &[f64], p: &[f64]) -> Vec<f32> {
    let normal = Normal::standard();
    mu.iter()
        .zip(sd)
        .zip(p)
        .map(|((m, s), &p)| (-(m + s * normal.inverse_cdf((1.0 - p).clamp(1e-9, 1.0 - 1e-9)))) as f32)
        .collect()
}

/// Calibrates every layer's biases: runs the calibration tokens through the
/// layers generated so far. Returns the per-layer fraction of inactive
/// neurons on the calibration tokens.
fn calibrate(s: &Synth, a: &SynthArgs, pb: &ProgressBar) -> Result<Vec<f64>> {
    let cfg = s.cfg.clone();
    let (h, n) = (cfg.hidden_size as usize, cfg.intermediate_size as usize);
    let tokens = calib_tokens(a.calib_tokens, cfg.vocab_size as usize, 3.min(cfg.vocab_size as usize - 1), s.seed);
    let window = 128.min(tokens.len());
    let windows = split_windows(tokens.len(), window);
    let mut fwd = Forward::new(s, &tokens, windows)?;
    let rows = 0..fwd.n_tokens();
    let drelu = cfg.activation == Activation::DRelu;
    let mut achieved = Vec::new();
    for l in 0..cfg.num_layers as usize {
        fwd.attention(l, |_| {})?;
        if s.moe() {
            achieved.push(calibrate_moe_layer(s, a, &mut fwd, l)?);
            pb.inc(1);
            continue;
        }
        let xn = fwd.normed(&format!("model.layers.{l}.post_attention_layernorm.weight"), rows.clone())?; // [t, hidden]
        let t = xn.len() / h;
        let x = Tensor::from_vec(xn.clone(), (t, h), &Device::Cpu)?;
        let p = s.targets(l, a.sparsity, a.skew);
        let p_each: Vec<f64> = if drelu { p.iter().map(|v| v.sqrt()).collect() } else { p.clone() };
        let mut active: Vec<bool> = vec![true; t * n];
        for proj in if drelu { &["gate_proj", "up_proj"][..] } else { &["gate_proj"][..] } {
            let name = format!("model.layers.{l}.mlp.{proj}.weight");
            let b = calibrated_bias(s, &name, &x, &p_each, &mut active)?;
            s.biases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(format!("model.layers.{l}.mlp.{}", proj.replace("_proj", "_proj.bias")), b);
        }
        achieved.push(1.0 - active.iter().filter(|&&v| v).count() as f64 / active.len() as f64);
        let ffn = fwd.ffn(l)?;
        let act = ffn.activations(xn, t)?;
        let out = ffn.down(act.hv, t)?;
        fwd.add_residual(rows.clone(), &out);
        pb.inc(1);
    }
    Ok(achieved)
}

/// The bias of each neuron of the low-rank projection `name` that makes it
/// fire with probability `p` on the inputs `x` (`[t, hidden]`), from the
/// statistics of its pre-activations `z = (x · Pᵀ) · Gᵀ` (`[t, n]`, computed
/// without materializing the `[n, hidden]` matrix); clears `active`
/// (`[t, n]`) where `z + b ≤ 0`.
fn calibrated_bias(s: &Synth, name: &str, x: &Tensor, p: &[f64], active: &mut [bool]) -> Result<Vec<f32>> {
    let (h, n) = (s.cfg.hidden_size as usize, p.len());
    let basis = Tensor::from_vec(s.basis(name, h), (s.rank, h), &Device::Cpu)?;
    let coef = Tensor::from_vec(s.coefficients(name, 0..n), (n, s.rank), &Device::Cpu)?;
    let z = x.matmul(&basis.t()?)?.matmul(&coef.t()?)?.flatten_all()?.to_vec1::<f32>()?;
    let (mu, sd) = column_stats(&z, n);
    let b = biases_for(&mu, &sd, p);
    for (row, act) in z.chunks_exact(n).zip(active.chunks_exact_mut(n)) {
        row.iter().zip(&b).zip(act.iter_mut()).for_each(|((zi, bi), a)| *a &= zi + bi > 0.0);
    }
    Ok(b)
}

/// Calibrates layer `l` of a mixture of experts (module docs: the bias
/// channel): the router's column 0 so that the experts' shares of the
/// calibration tokens follow [`Synth::expert_targets`], then each expert's
/// gate (dReLU: and up) column 0 from the statistics of the tokens routed to
/// it, then runs the experts to move the residual stream on. Returns the
/// fraction of inactive (token, neuron) pairs over the experts' tokens.
fn calibrate_moe_layer(s: &Synth, a: &SynthArgs, fwd: &mut Forward, l: usize) -> Result<f64> {
    let cfg = &s.cfg;
    let moe = cfg.architecture.moe().expect("a mixture of experts");
    let (h, n, e, k) = (
        cfg.hidden_size as usize,
        cfg.intermediate_size as usize,
        moe.num_experts as usize,
        moe.experts_per_token as usize,
    );
    let rows = 0..fwd.n_tokens();
    let t = rows.len();
    let mut xn = fwd.normed(&format!("model.layers.{l}.post_attention_layernorm.weight"), rows.clone())?; // [t, hidden]
                                                                                                          // The bias channel's value after the norm, and the inputs without it.
    let m0 = (xn.chunks_exact(h).map(|r| r[0] as f64).sum::<f64>() / t as f64) as f32;
    xn.chunks_exact_mut(h).for_each(|r| r[0] = 0.0);
    let x = Tensor::from_vec(xn.clone(), (t, h), &Device::Cpu)?;
    // 1. Router: offsets so that each expert gets its target share of the tokens.
    let rname = cfg.router_name(l).expect("a router");
    let r = s.gen_rows(&rname, &[e, h], 0..e)?;
    let logits = x.matmul(&Tensor::from_vec(r, (e, h), &Device::Cpu)?.t()?)?.flatten_all()?.to_vec1::<f32>()?;
    let target = s.expert_targets(l, a.router_skew);
    let mut off: Vec<f64> = target.iter().map(|p| p.max(1e-6).ln()).collect();
    let shares = |off: &[f64]| -> Vec<f64> {
        let mut count = vec![0f64; e];
        let mut row = vec![0f32; e];
        let mut top = Vec::with_capacity(k);
        for lg in logits.chunks_exact(e) {
            row.iter_mut().zip(lg).zip(off).for_each(|((r, &z), &o)| *r = z + o as f32);
            top.clear();
            nflash_runtime::model::moe::top_k(&row, k, false, &mut top);
            top.iter().for_each(|&(i, _)| count[i as usize] += 1.0);
        }
        count.iter().map(|c| c / t as f64).collect()
    };
    for _ in 0..60 {
        let got = shares(&off);
        for ((o, &want), &g) in off.iter_mut().zip(&target).zip(&got) {
            *o += 0.7 * (want.max(1e-6).ln() - g.max(0.5 / t as f64).ln());
        }
    }
    let lock = |m: &Mutex<HashMap<String, Vec<f32>>>, name: String, v: Vec<f32>| {
        m.lock().unwrap_or_else(|e| e.into_inner()).insert(name, v);
    };
    lock(&s.col0, rname, off.iter().map(|&o| o as f32 / m0).collect());
    // 2. Each expert on the tokens the calibrated router sends it.
    let router = fwd.router(l)?.expect("a router");
    let routes = fwd.route(&router)?;
    let drelu = cfg.activation == Activation::DRelu;
    let mut delta = vec![0f32; t * h];
    let (mut inactive, mut pairs) = (0f64, 0f64);
    for ex in 0..e {
        let u = l * e + ex;
        let (idx, w): (Vec<usize>, Vec<f32>) = nflash_runtime::model::moe::routed_to(&routes, k, ex).unzip();
        // Statistics over the expert's tokens (all tokens when it gets too few to estimate them).
        let stat_rows: Vec<usize> = if idx.len() >= 16 { idx.clone() } else { (0..t).collect() };
        let sub: Vec<f32> = stat_rows.iter().flat_map(|&i| xn[i * h..(i + 1) * h].iter().copied()).collect();
        let xs = Tensor::from_vec(sub, (stat_rows.len(), h), &Device::Cpu)?;
        let p = s.targets(u, a.sparsity, a.skew);
        let p_each: Vec<f64> = if drelu { p.iter().map(|v| v.sqrt()).collect() } else { p.clone() };
        let mut active = vec![true; stat_rows.len() * n];
        let names = cfg.ffn_tensor_names(u);
        for name in if drelu { &names[..2] } else { &names[..1] } {
            let b = calibrated_bias(s, name, &xs, &p_each, &mut active)?;
            lock(&s.col0, name.clone(), b.iter().map(|&v| v / m0).collect());
        }
        if idx.len() >= 16 {
            inactive += active.iter().filter(|&&v| !v).count() as f64;
            pairs += active.len() as f64;
        }
        if idx.is_empty() {
            continue;
        }
        let ffn = fwd.ffn(u)?;
        let xin = fwd.ffn_input_of(&ffn, &idx);
        let act = ffn.activations(xin, idx.len())?;
        let out = ffn.down(act.hv, idx.len())?;
        for ((&i, &wt), o) in idx.iter().zip(&w).zip(out.chunks_exact(h)) {
            delta[i * h..(i + 1) * h].iter_mut().zip(o).for_each(|(d, v)| *d += wt * v);
        }
    }
    fwd.add_residual(rows, &delta);
    Ok(if pairs > 0.0 { inactive / pairs } else { 0.0 })
}

/// A tensor written lazily: its bytes are generated when the shard is written.
struct Lazy<'a> {
    s: &'a Synth,
    name: String,
    shape: Vec<usize>,
    dtype: Dtype,
    pb: &'a ProgressBar,
}

impl Lazy<'_> {
    fn bytes(&self) -> Result<Vec<u8>> {
        let rows = self.shape[0];
        let cols: usize = self.shape[1..].iter().product();
        let width = self.dtype.bitsize() / 8;
        let mut out = Vec::with_capacity(rows * cols * width);
        // Row blocks of ≤ 16 Mi elements keep the f32 transient small.
        let block = ((16usize << 20) / cols.max(1)).max(1);
        for r0 in (0..rows).step_by(block) {
            let v = self.s.gen_rows(&self.name, &self.shape, r0..(r0 + block).min(rows))?;
            match self.dtype {
                Dtype::F32 => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
                Dtype::F16 => out.extend(v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes())),
                _ => out.extend(v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())),
            }
        }
        Ok(out)
    }
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // Generation cannot fail for names from `tensor_list` once calibrated.
        let b = self.bytes().unwrap_or_else(|e| {
            message!("error: generating {}: {e:#}", self.name);
            std::process::exit(1)
        });
        self.pb.inc(b.len() as u64);
        Cow::Owned(b)
    }
    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

pub fn run(a: SynthArgs) -> Result<()> {
    if !(a.sparsity > 0.0 && a.sparsity < 1.0) {
        bail!(
            "--sparsity {} is outside (0, 1): it is the mean fraction of FFN neurons inactive per token, e.g. 0.9",
            a.sparsity
        );
    }
    if !(0.0..=8.0).contains(&a.skew) {
        bail!("--skew {} is outside [0, 8]: 0 means no hot neurons, 1.5 is the default", a.skew);
    }
    if !(0.0..=8.0).contains(&a.router_skew) {
        bail!(
            "--router-skew {} is outside [0, 8]: 0 means every expert equally popular, 1 is the default",
            a.router_skew
        );
    }
    if !(16..=MAX_CALIB_TOKENS).contains(&a.calib_tokens) {
        bail!("--calib-tokens {} is outside 16..={MAX_CALIB_TOKENS}: at least 16 to estimate neuron statistics, at most {MAX_CALIB_TOKENS} (memory grows with them; default 512)", a.calib_tokens);
    }
    if a.shard_bytes < 1 << 20 {
        bail!("--shard-bytes must be at least 1 MiB");
    }
    if let Some(l) = a.layers.filter(|l| !(1..=MAX_LAYERS).contains(l)) {
        bail!("--layers {l} is outside 1..={MAX_LAYERS}");
    }
    // The output must be a new directory: not an existing path (a dangling symlink included), not `..`.
    let name_ok = a.out.file_name().is_some_and(|n| n != "." && n != "..");
    if a.out.symlink_metadata().is_ok() || !name_ok {
        bail!(
            "--out {} must name a new directory (it exists, or is `.`/`..`): remove it or choose another --out",
            a.out.display()
        );
    }
    // Create the temporary output directory now, so a bad location fails before any heavy work.
    let parent = a.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    crate::output::check_out(&a.out, "--out", &[], &[&a.tokenizer])?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        a.out.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
        std::process::id()
    ));
    std::fs::create_dir(&tmp)
        .with_context(|| format!("cannot create {} (is {} writable?)", tmp.display(), parent.display()))?;
    *crate::IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()) = Some(tmp.clone());
    let result = synthesize(&a, &tmp);
    let mut guard = crate::IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner());
    // Holding the lock: an interrupt now waits for this to finish, then exits.
    let result = result.and_then(|t0| {
        std::fs::rename(&tmp, &a.out)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), a.out.display()))?;
        Ok(t0)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    *guard = None;
    drop(guard);
    let t0 = result?;
    let peak = nflash_runtime::stats::peak_rss_bytes().unwrap_or(0);
    message!(
        "wrote {} in {:.1} s (peak RSS {:.0} MiB)",
        a.out.display(),
        t0.elapsed().as_secs_f64(),
        peak as f64 / (1 << 20) as f64
    );
    Ok(())
}

/// Most calibration tokens (`[n, n_neurons]` pre-activations are kept per layer).
const MAX_CALIB_TOKENS: usize = 65536;
/// Most decoder layers.
const MAX_LAYERS: usize = 256;
/// Largest vocabulary accepted from the tokenizer directory.
const MAX_VOCAB: u64 = 1 << 20;

/// Calibrates and writes the checkpoint into `tmp`; returns the start time.
fn synthesize(a: &SynthArgs, tmp: &Path) -> Result<std::time::Instant> {
    let tok_json = a.tokenizer.join("tokenizer.json");
    let tok_bytes = std::fs::read(&tok_json).with_context(|| {
        format!("cannot read {}: pass --tokenizer DIR with a tokenizer.json (the default is the SmolLM2 checkpoint made by `make model`)", tok_json.display())
    })?;
    let tok = nflash_runtime::tokenizer::Tokenizer::from_json(&tok_bytes)
        .map_err(|e| anyhow::anyhow!("{} cannot be loaded: {e}", tok_json.display()))?;
    let cfg_path = a.tokenizer.join("config.json");
    let src_cfg = if cfg_path.exists() {
        read_json(&cfg_path).with_context(|| {
            format!(
                "{} is not valid JSON; fix it or remove it (it only supplies BOS/EOS ids and vocab_size)",
                cfg_path.display()
            )
        })?
    } else {
        message!("note: {} has no config.json: no BOS/EOS token ids in the synthetic config", a.tokenizer.display());
        Value::Null
    };
    if !a.tokenizer.join("tokenizer_config.json").exists() {
        message!(
            "note: {} has no tokenizer_config.json: the checkpoint will have no chat template",
            a.tokenizer.display()
        );
    }
    let n_tok = tok.vocab_size() as u64;
    let vocab = src_cfg.get("vocab_size").and_then(Value::as_u64).unwrap_or(n_tok).max(n_tok);
    if !(8..=MAX_VOCAB).contains(&vocab) {
        bail!(
            "vocabulary of {vocab} tokens ({} and its config.json vocab_size) is outside 8..={MAX_VOCAB}",
            tok_json.display()
        );
    }
    let Dims { arch, hidden, inter, layers, heads, kv_heads, head_dim, theta, max_pos } = dims(a.shape);
    let layers = a.layers.map_or(layers, |l| l as u64);
    let tiny = matches!(a.shape, Shape::Tiny | Shape::TinyMoe);
    let rank = a.active_rank.unwrap_or(if tiny { 16 } else { 128 });
    if rank == 0 || rank > hidden as usize {
        bail!("--active-rank {rank} must be in 1..={hidden} (hidden size)");
    }
    if a.act == SynthAct::Drelu && matches!(arch, Architecture::Qwen3Moe(_)) {
        bail!(
            "--act drelu: dReLU checkpoints are TurboSparse models (Mistral and Mixtral shapes); use --act relu for {}",
            cli_name(a.shape)
        );
    }
    let activation = match a.act {
        SynthAct::Relu => Activation::Relu,
        SynthAct::Drelu => Activation::DRelu,
    };
    let bos = token_ids(src_cfg.get("bos_token_id"), "config.json bos_token_id")?.first().copied();
    let eos = token_ids(src_cfg.get("eos_token_id"), "config.json eos_token_id")?;
    let cfg = ModelConfig {
        architecture: arch,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: 1e-5,
        rope_theta: theta,
        rope_scaling: None,
        max_position_embeddings: max_pos,
        sliding_window: None,
        activation,
        tie_word_embeddings: false,
        attention_bias: false,
        // Mixtures of experts use the bias channel instead (module docs).
        mlp_bias: arch.moe().is_none(),
        bos_token_id: bos,
        eos_token_ids: eos.clone(),
    };
    let synth = Synth {
        cfg: cfg.clone(),
        seed: a.seed,
        rank,
        biases: Mutex::new(HashMap::new()),
        col0: Mutex::new(HashMap::new()),
    };
    let t0 = std::time::Instant::now();
    let experts = arch.moe().map_or(String::new(), |m| {
        format!(", {} experts of which {} per token, router skew {}", m.num_experts, m.experts_per_token, a.router_skew)
    });
    message!(
        "synthesizing {} ({} layers, hidden {hidden}, FFN {inter}, {} KV heads, {}{experts}) with target sparsity {} and skew {} into {}",
        cli_name(a.shape), layers, kv_heads, cli_name(a.act), a.sparsity, a.skew, a.out.display()
    );

    // 1. Biases from calibration statistics.
    let pb = Progress::new(
        layers,
        "{msg:>10} [{elapsed_precise}] {wide_bar} {pos}/{len} layers eta {eta}",
        "synth: calibrate",
    );
    pb.set_message("calibrate");
    let achieved = calibrate(&synth, a, &pb)?;
    pb.finish_and_clear();
    let curve = power_law(inter as usize, 1.0 - a.sparsity, a.skew);
    let top20: f64 = curve[..inter as usize / 5].iter().sum::<f64>() / curve.iter().sum::<f64>();
    message!(
        "calibrated biases in {:.1} s on {} tokens: sparsity {:.3} (layer mean; target {}), hottest 20% of neurons give {:.0}% of activations, hottest neuron p={:.3}, coldest p={:.4}",
        t0.elapsed().as_secs_f64(),
        a.calib_tokens,
        achieved.iter().sum::<f64>() / achieved.len() as f64,
        a.sparsity,
        100.0 * top20,
        curve[0],
        curve[curve.len() - 1]
    );
    if let Some(m) = cfg.architecture.moe() {
        let shares =
            power_law(m.num_experts as usize, m.experts_per_token as f64 / m.num_experts as f64, a.router_skew);
        message!(
            "router (target): each layer's most popular expert gets {:.1}% of the tokens, the least popular {:.2}% (uniform routing: {:.1}%)",
            100.0 * shares[0],
            100.0 * shares[shares.len() - 1],
            100.0 * m.experts_per_token as f64 / m.num_experts as f64
        );
    }

    // 2. Shards, streamed into the temporary directory.
    write_dir(&synth, a, tmp, &cfg, &eos)?;
    Ok(t0)
}

fn write_dir(s: &Synth, a: &SynthArgs, dir: &Path, cfg: &ModelConfig, eos: &[u32]) -> Result<()> {
    let dtype = match a.dtype {
        SynthDtype::Bf16 => Dtype::BF16,
        SynthDtype::F16 => Dtype::F16,
        SynthDtype::F32 => Dtype::F32,
    };
    let width = dtype.bitsize() / 8;
    let list = tensor_list(cfg);
    let total: u64 = list.iter().map(|(_, sh)| (sh.iter().product::<usize>() * width) as u64).sum();
    // Group tensors into shards of at most --shard-bytes (a larger tensor gets its own).
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![Vec::new()];
    let mut size = 0u64;
    for (name, shape) in list {
        let b = (shape.iter().product::<usize>() * width) as u64;
        if size + b > a.shard_bytes && !shards.last().is_some_and(|v| v.is_empty()) {
            shards.push(Vec::new());
            size = 0;
        }
        size += b;
        shards.last_mut().expect("non-empty").push((name, shape));
    }
    message!(
        "writing {:.2} GiB of {} weights in {} shard(s)",
        total as f64 / (1u64 << 30) as f64,
        match a.dtype {
            SynthDtype::Bf16 => "BF16",
            SynthDtype::F16 => "F16",
            SynthDtype::F32 => "F32",
        },
        shards.len()
    );
    let pb = Progress::new(
        total,
        "{msg:>10} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        "synth: write shards",
    );
    let n_shards = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.into_iter().enumerate() {
        let file = format!("model-{:05}-of-{n_shards:05}.safetensors", i + 1);
        pb.set_message(format!("shard {}/{n_shards}", i + 1));
        for (name, _) in &shard {
            weight_map.insert(name.clone(), json!(file));
        }
        let views = shard.into_iter().map(|(name, shape)| (name.clone(), Lazy { s, name, shape, dtype, pb: &pb }));
        let path = dir.join(&file);
        safetensors::serialize_to_file(views, None, &path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        // safetensors creates the file 0600; checkpoints are shared like the other files.
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    }
    pb.finish_and_clear();
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_vec_pretty(&index)?)?;
    let drelu = cfg.activation == Activation::DRelu;
    let (arch, model_type) = match (drelu, cfg.architecture) {
        (true, Architecture::Mixtral(_)) => (crate::checkpoint::TURBOSPARSE_MIXTRAL, "turbosparse_mixtral"),
        (_, Architecture::Qwen3Moe(_)) => ("Qwen3MoeForCausalLM", "qwen3_moe"),
        (false, Architecture::Mixtral(_)) => ("MixtralForCausalLM", "mixtral"),
        (true, _) => (crate::checkpoint::BAMBOO, "bamboo"),
        (false, Architecture::Mistral) => ("MistralForCausalLM", "mistral"),
        _ => ("LlamaForCausalLM", "llama"),
    };
    let mut config = json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "relu",
        "mlp_bias": cfg.mlp_bias,
        "attention_bias": false,
        "tie_word_embeddings": false,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": if eos.len() == 1 { json!(eos[0]) } else { json!(eos) },
        "torch_dtype": match a.dtype { SynthDtype::Bf16 => "bfloat16", SynthDtype::F16 => "float16", SynthDtype::F32 => "float32" },
        "nflash_synth": {
            "shape": cli_name(a.shape), "sparsity": a.sparsity, "skew": a.skew, "act": cli_name(a.act),
            "active_rank": s.rank, "seed": a.seed, "calib_tokens": a.calib_tokens,
        },
    });
    match cfg.architecture {
        Architecture::Mixtral(m) => {
            config["num_local_experts"] = json!(m.num_experts);
            config["num_experts_per_tok"] = json!(m.experts_per_token);
            config["sliding_window"] = Value::Null;
            config["nflash_synth"]["router_skew"] = json!(a.router_skew);
        }
        Architecture::Qwen3Moe(m) => {
            config["num_experts"] = json!(m.num_experts);
            config["num_experts_per_tok"] = json!(m.experts_per_token);
            config["norm_topk_prob"] = json!(m.norm_topk_prob);
            config["moe_intermediate_size"] = json!(cfg.intermediate_size);
            config["decoder_sparse_step"] = json!(1);
            config["mlp_only_layers"] = json!([]);
            config["head_dim"] = json!(cfg.head_dim);
            config["use_sliding_window"] = json!(false);
            config["nflash_synth"]["router_skew"] = json!(a.router_skew);
        }
        _ => {}
    }
    if cfg.architecture == Architecture::Mistral || drelu {
        config["sliding_window"] = Value::Null;
    }
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config)?)?;
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"] {
        let src = a.tokenizer.join(f);
        if src.exists() {
            std::fs::copy(&src, dir.join(f)).with_context(|| format!("cannot copy {}", src.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn biases_hit_gaussian_targets() {
        let (mu, sd) = (vec![0.5, -1.0], vec![2.0, 0.5]);
        let b = biases_for(&mu, &sd, &[0.1, 0.9]);
        // P(z + b > 0) with z ~ N(μ, σ): threshold −b = μ + σ Φ⁻¹(1 − p).
        let n = Normal::standard();
        for i in 0..2 {
            let p = 1.0 - n.cdf((-(b[i] as f64) - mu[i]) / sd[i]);
            assert!((p - [0.1, 0.9][i]).abs() < 1e-5);
        }
    }

    #[test]
    fn calib_tokens_skip_control_ids_and_are_deterministic() {
        let a = calib_tokens(2000, 100, 3, 7);
        assert_eq!(a, calib_tokens(2000, 100, 3, 7));
        assert!(a.iter().all(|&t| (3..100).contains(&t)));
        assert_ne!(a, calib_tokens(2000, 100, 3, 8));
    }
}
