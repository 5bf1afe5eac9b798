//! Streaming f32 forward pass of a Hugging Face checkpoint over many
//! calibration tokens at once, one layer's weights in memory at a time.
//!
//! The residual stream of every calibration token (`[n_tokens, hidden]`)
//! stays in memory; a layer's attention weights are loaded, applied to all
//! windows and dropped, then its FFN weights. Windows are independent causal
//! sequences starting at position 0. Semantics follow `runtime/src/model/`
//! (`attention.rs`, `forward.rs`: GQA, RMSNorm, RoPE with scaling, Mistral
//! sliding window, biases, FFN activations), so the statistics describe
//! what the runtime computes.

use std::ops::Range;

use anyhow::{bail, Result};
use candle_core::quantized::GgmlType;
use candle_core::{Device, Tensor, D};
use nflash_format::{Activation, Architecture, ModelConfig, Moe};
use nflash_runtime::model::moe::top_k;
use nflash_runtime::model::ops::{activate, activate_up, rms_norm, softmax, Rope};
use rayon::prelude::*;

/// Where the forward pass gets its weights: a checkpoint on disk
/// ([`crate::checkpoint::Checkpoint`]) or a generator (`prep synth`).
/// Tensor names and shapes are Hugging Face's (`model.layers.{l}.mlp.gate_proj.weight`, `[n_neurons, hidden]`).
pub trait WeightSource: Sync {
    /// Model hyper-parameters.
    fn config(&self) -> &ModelConfig;
    /// Tensor `name` as f32, checked to have `shape`.
    ///
    /// # Errors
    /// Missing tensor, wrong shape or dtype, read failures.
    fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;
    /// Rows `rows` of the 2-D tensor `name` of `shape` (`[rows.len(), shape[1]]`),
    /// without materializing the rest.
    ///
    /// # Errors
    /// As [`WeightSource::tensor_f32`]; a row index out of range.
    fn rows_f32(&self, name: &str, shape: &[usize], rows: &[u32]) -> Result<Vec<f32>>;
}

/// Tokens of equal-length windows batched into one attention pass (one
/// matmul per projection).
const ATTN_BATCH_TOKENS: usize = 4096;

/// The residual stream of all calibration tokens and the checkpoint it runs.
pub struct Forward<'a> {
    ck: &'a dyn WeightSource,
    cfg: ModelConfig,
    /// Token ranges of the windows, in order, covering `0..n_tokens`.
    windows: Vec<Range<usize>>,
    /// Residual stream `[n_tokens, hidden]`.
    x: Vec<f32>,
    rope: Rope,
    /// Gemma 3's RoPE of its sliding-window layers.
    rope_local: Option<Rope>,
}

/// One layer's attention weights as tensors.
struct Attention {
    norm: Vec<f32>, // [hidden]
    q: Tensor,      // [n_heads * head_dim, hidden]
    k: Tensor,      // [n_kv_heads * head_dim, hidden]
    v: Tensor,      // [n_kv_heads * head_dim, hidden]
    o: Tensor,      // [hidden, n_heads * head_dim]
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    v_bias: Option<Tensor>,
    o_bias: Option<Tensor>,
    /// Qwen3: RMSNorm weights `[head_dim]` of each query and key head, before RoPE.
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// Whether RoPE rotates queries and keys (false in SmolLM3's NoPE layers).
    rope: bool,
    /// Whether that RoPE is the local one (Gemma 3's sliding layers).
    local_rope: bool,
    /// Sliding window: positions a token attends to, itself included.
    window: Option<usize>,
    /// Gemma 3: the norm `[hidden]` of the block's output.
    post_norm: Option<Vec<f32>>,
}

/// A mixture-of-experts layer's router (`[num_experts, hidden]`) and routing
/// settings (SPEC §4.1).
pub struct Router {
    norm: Vec<f32>, // [hidden], post_attention_layernorm
    weight: Tensor, // [num_experts, hidden]
    moe: Moe,
    eps: f32,
}

/// One layer's FFN weights: `down · (act(gate·xn + bg) ⊙ (up·xn + bu)) + bd`
/// (dReLU: `relu(up·xn + bu)`)
/// with `xn = RMSNorm(x)` (post_attention_layernorm).
pub struct Ffn {
    norm: Vec<f32>, // [hidden]
    gate: Tensor,   // [n_neurons, hidden]
    up: Tensor,     // [n_neurons, hidden]
    down: Tensor,   // [hidden, n_neurons]
    gate_bias: Option<Tensor>,
    up_bias: Option<Tensor>,
    down_bias: Option<Tensor>,
    act: Activation,
    eps: f32,
    /// Gemma 3: the norm `[hidden]` of the FFN's output ([`Ffn::down`] applies it).
    post_norm: Option<Vec<f32>>,
}

/// FFN activations of a chunk of tokens, each `[n, n_neurons]`.
pub struct Activations {
    /// `a = act(gate·xn + bg)`.
    pub a: Vec<f32>,
    /// `hv = a ⊙ (up·xn + bu)`, the input of the down projection.
    pub hv: Vec<f32>,
}

fn matrix(ck: &dyn WeightSource, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
    Ok(Tensor::from_vec(ck.tensor_f32(name, &[rows, cols])?, (rows, cols), &Device::Cpu)?)
}

/// Qwen3's per-head norm weight `name` (`[head_dim]`), or `None` for a model without.
fn head_norm(ck: &dyn WeightSource, name: &str, cfg: &ModelConfig) -> Result<Option<Vec<f32>>> {
    if !cfg.qk_norm() {
        return Ok(None);
    }
    Ok(Some(ck.tensor_f32(name, &[cfg.head_dim as usize])?))
}

fn bias(ck: &dyn WeightSource, name: &str, len: usize, present: bool) -> Result<Option<Tensor>> {
    if !present {
        return Ok(None);
    }
    Ok(Some(Tensor::from_vec(ck.tensor_f32(name, &[len])?, len, &Device::Cpu)?))
}

/// `x · wᵀ (+ b)` for `x` `[.., in]`, `w` `[out, in]`.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    Ok(match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// RMSNorms every row of `x` (`[n, hidden]`) with `weight` (`[hidden]`).
fn norm_rows(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(weight.len()).zip(x.par_chunks(weight.len())).for_each(|(o, r)| rms_norm(r, weight, eps, o));
    out
}

/// Attention output `[b * len, hidden]` for `b` windows of `len` tokens
/// with residual stream `x` `[b * len, hidden]`: projections by candle-core
/// matmuls, RoPE and the causal softmax per (token, head) as the runtime does.
fn attend(cfg: &ModelConfig, rope: &Rope, w: &Attention, x: &[f32], b: usize, len: usize) -> Result<Vec<f32>> {
    let eps = cfg.rms_norm_eps as f32;
    let h = cfg.hidden_size as usize;
    let (nh, nkv, hd) = (cfg.num_heads as usize, cfg.num_kv_heads as usize, cfg.head_dim as usize);
    let xn = Tensor::from_vec(norm_rows(x, &w.norm, cfg.rms_norm_eps as f32), (b * len, h), &Device::Cpu)?;
    let project = |m: &Tensor, bias: Option<&Tensor>| -> Result<Vec<f32>> {
        Ok(linear(&xn, m, bias)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let mut q = project(&w.q, w.q_bias.as_ref())?; // [b, len, nh, hd]
    let mut k = project(&w.k, w.k_bias.as_ref())?; // [b, len, nkv, hd]
                                                   // Qwen3: RMSNorm of each query and key head.
    for (m, norm) in [(&mut q, &w.q_norm), (&mut k, &w.k_norm)] {
        if let Some(wt) = norm {
            m.par_chunks_mut(hd).for_each(|head| {
                let v = head.to_vec();
                rms_norm(&v, wt, cfg.rms_norm_eps as f32, head);
            });
        }
    }
    let v = project(&w.v, w.v_bias.as_ref())?; // [b, len, nkv, hd]
    if w.rope {
        // [len, rotary_dim/2] each; every window starts at position 0 and is its own context.
        let (cos, sin) = rope.tables(0, len, len);
        let half = rope.half();
        for (m, width) in [(&mut q, nh * hd), (&mut k, nkv * hd)] {
            m.par_chunks_mut(width).enumerate().for_each(|(i, row)| {
                let t = i % len;
                rope.rotate(row, &cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            });
        }
    }
    let shape = Heads { len, nh, nkv, hd, sliding: w.window, scale: cfg.attn_scale() };
    let attn = causal_attention(&q, &k, &v, &shape);
    let attn = Tensor::from_vec(attn, (b * len, nh * hd), &Device::Cpu)?;
    let out = linear(&attn, &w.o, w.o_bias.as_ref())?.flatten_all()?.to_vec1::<f32>()?;
    Ok(match &w.post_norm {
        Some(norm) => norm_rows(&out, norm, eps),
        None => out,
    })
}

/// Window length and head layout of [`causal_attention`].
struct Heads {
    len: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    /// Sliding window: the current token and the `w − 1` before it.
    sliding: Option<usize>,
    /// Scores are `q·k · scale`.
    scale: f32,
}

/// Softmax attention of every (window, token, head) over the window's tokens
/// up to itself (and within the sliding window), query head `h` reading kv
/// head `h / (nh / nkv)`: q `[b, len, nh, hd]` (after RoPE), k (after RoPE)
/// and v `[b, len, nkv, hd]` → `[b, len, nh * hd]`. The same arithmetic as
/// runtime/src/model/attention.rs.
fn causal_attention(q: &[f32], k: &[f32], v: &[f32], s: &Heads) -> Vec<f32> {
    let (len, nh, nkv, hd) = (s.len, s.nh, s.nkv, s.hd);
    let (qd, kvd, group) = (nh * hd, nkv * hd, nh / nkv);
    let scale = s.scale;
    let mut out = vec![0f32; q.len()];
    out.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, o)| {
        let (row, head) = (idx / nh, idx % nh); // row = window · len + t
        let (t, w0) = (row % len, row - row % len);
        let kvh = head / group;
        let qv = &q[row * qd + head * hd..row * qd + (head + 1) * hd];
        let start = s.sliding.map_or(0, |w| (t + 1).saturating_sub(w));
        let kv = |j: usize| (w0 + j) * kvd + kvh * hd; // offset of key/value j's head
        scores.clear();
        scores.extend((start..=t).map(|j| f32::vec_dot(hd, qv, &k[kv(j)..kv(j) + hd]) * scale));
        softmax(scores);
        for (j, &p) in (start..=t).zip(scores.iter()) {
            o.iter_mut().zip(&v[kv(j)..kv(j) + hd]).for_each(|(a, b)| *a += p * b);
        }
    });
    out
}

/// Splits `n_tokens` into windows of `window` tokens; a final partial
/// window is kept when it has at least 2 tokens (as `nflash ppl`).
pub fn split_windows(n_tokens: usize, window: usize) -> Vec<Range<usize>> {
    (0..n_tokens).step_by(window.max(1)).map(|s| s..(s + window).min(n_tokens)).filter(|r| r.len() >= 2).collect()
}

impl<'a> Forward<'a> {
    /// Embeds `tokens` (`[n_tokens]`), split into `windows` (from [`split_windows`]).
    ///
    /// # Errors
    /// A token id ≥ `vocab_size`, a missing or misshapen embedding.
    pub fn new(ck: &'a dyn WeightSource, tokens: &[u32], windows: Vec<Range<usize>>) -> Result<Self> {
        let cfg = ck.config().clone();
        let (h, vocab) = (cfg.hidden_size as usize, cfg.vocab_size as usize);
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
            bail!("the tokenizer gave token id {id}, but the embedding has only {vocab} rows (vocab_size in config.json); tokenizer.json does not belong to these weights");
        }
        let mut x = ck.rows_f32("model.embed_tokens.weight", &[vocab, h], tokens)?; // [n_tokens, hidden]
        let scale = cfg.embed_scale();
        if scale != 1.0 {
            x.par_iter_mut().for_each(|v| *v *= scale);
        }
        Ok(Forward { ck, rope: Rope::new(&cfg), rope_local: cfg.local_rope().map(|c| Rope::new(&c)), cfg, windows, x })
    }

    /// Calibration tokens (rows of the residual stream).
    pub fn n_tokens(&self) -> usize {
        self.x.len() / self.cfg.hidden_size as usize
    }

    fn attention_weights(&self, l: usize) -> Result<Attention> {
        let (ck, cfg) = (self.ck, &self.cfg);
        let h = cfg.hidden_size as usize;
        let qd = (cfg.num_heads * cfg.head_dim) as usize;
        let kvd = (cfg.num_kv_heads * cfg.head_dim) as usize;
        let qwen2 = cfg.architecture == Architecture::Qwen2;
        let qkv_bias = cfg.attention_bias || qwen2;
        let p = format!("model.layers.{l}.self_attn");
        let norms = cfg.layer_norms(l);
        Ok(Attention {
            norm: ck.tensor_f32(&norms.attn, &[h])?,
            post_norm: norms.post_attn.map(|n| ck.tensor_f32(&n, &[h])).transpose()?,
            q: matrix(ck, &format!("{p}.q_proj.weight"), qd, h)?,
            k: matrix(ck, &format!("{p}.k_proj.weight"), kvd, h)?,
            v: matrix(ck, &format!("{p}.v_proj.weight"), kvd, h)?,
            o: matrix(ck, &format!("{p}.o_proj.weight"), h, qd)?,
            q_bias: bias(ck, &format!("{p}.q_proj.bias"), qd, qkv_bias)?,
            k_bias: bias(ck, &format!("{p}.k_proj.bias"), kvd, qkv_bias)?,
            v_bias: bias(ck, &format!("{p}.v_proj.bias"), kvd, qkv_bias)?,
            o_bias: bias(ck, &format!("{p}.o_proj.bias"), h, cfg.attention_bias && !qwen2)?,
            q_norm: head_norm(ck, &format!("{p}.q_norm.weight"), cfg)?,
            k_norm: head_norm(ck, &format!("{p}.k_norm.weight"), cfg)?,
            rope: cfg.layer_uses_rope(l),
            local_rope: cfg.layer_uses_local_rope(l),
            window: cfg.layer_window(l).map(|w| w as usize),
        })
    }

    /// Adds layer `l`'s attention block to the residual stream of every
    /// window. `progress(tokens)` is called after each batch of windows.
    ///
    /// # Errors
    /// Missing or misshapen attention tensors; tensor op failures.
    pub fn attention(&mut self, l: usize, mut progress: impl FnMut(usize)) -> Result<()> {
        let w = self.attention_weights(l)?;
        let h = self.cfg.hidden_size as usize;
        let mut i = 0;
        while i < self.windows.len() {
            let len = self.windows[i].len();
            let max_b = (ATTN_BATCH_TOKENS / len).max(1);
            let b = self.windows[i..].iter().take(max_b).take_while(|r| r.len() == len).count();
            let rows = self.windows[i].start * h..self.windows[i + b - 1].end * h;
            let rope = self.rope_local.as_ref().filter(|_| w.local_rope).unwrap_or(&self.rope);
            let out = attend(&self.cfg, rope, &w, &self.x[rows.clone()], b, len)?;
            self.x[rows].iter_mut().zip(&out).for_each(|(a, d)| *a += d);
            progress(b * len);
            i += b;
        }
        Ok(())
    }

    /// Loads FFN unit `u`'s weights (SPEC §4.4): layer `u`'s FFN, or of a
    /// mixture of experts expert `u mod num_experts` of layer `⌊u / num_experts⌋`.
    ///
    /// # Errors
    /// Missing or misshapen FFN tensors.
    pub fn ffn(&self, u: usize) -> Result<Ffn> {
        let (ck, cfg) = (self.ck, &self.cfg);
        let (h, inter) = (cfg.hidden_size as usize, cfg.intermediate_size as usize);
        let l = cfg.unit_layer_expert(u).0;
        let p = format!("model.layers.{l}.mlp");
        let [gate, up, down] = cfg.ffn_tensor_names(u);
        let norms = cfg.layer_norms(l);
        Ok(Ffn {
            norm: ck.tensor_f32(&norms.ffn, &[h])?,
            post_norm: norms.post_ffn.map(|n| ck.tensor_f32(&n, &[h])).transpose()?,
            gate: matrix(ck, &gate, inter, h)?,
            up: matrix(ck, &up, inter, h)?,
            down: matrix(ck, &down, h, inter)?,
            gate_bias: bias(ck, &format!("{p}.gate_proj.bias"), inter, cfg.mlp_bias)?,
            up_bias: bias(ck, &format!("{p}.up_proj.bias"), inter, cfg.mlp_bias)?,
            down_bias: bias(ck, &format!("{p}.down_proj.bias"), h, cfg.mlp_bias)?,
            act: cfg.activation,
            eps: cfg.rms_norm_eps as f32,
        })
    }

    /// Layer `l`'s router, or `None` for a dense model.
    ///
    /// # Errors
    /// A missing or misshapen router or norm.
    pub fn router(&self, l: usize) -> Result<Option<Router>> {
        let (Some(name), Some(moe)) = (self.cfg.router_name(l), self.cfg.architecture.moe()) else { return Ok(None) };
        let h = self.cfg.hidden_size as usize;
        Ok(Some(Router {
            norm: self.ck.tensor_f32(&self.cfg.layer_norms(l).ffn, &[h])?,
            weight: matrix(self.ck, &name, moe.num_experts as usize, h)?,
            moe,
            eps: self.cfg.rms_norm_eps as f32,
        }))
    }

    /// Routes every calibration token through `r` as the runtime does
    /// (`nflash_runtime::model::moe`: softmax of the router logits, top-k,
    /// weights renormalized per `norm_topk_prob`): `[n_tokens · k]` (expert,
    /// weight), each token's experts ascending.
    ///
    /// # Errors
    /// Tensor op failures.
    pub fn route(&self, r: &Router) -> Result<Vec<(u32, f32)>> {
        let (h, e) = (self.cfg.hidden_size as usize, r.moe.num_experts as usize);
        let n = self.n_tokens();
        let mut routes = Vec::with_capacity(n * r.moe.experts_per_token as usize);
        for s in (0..n).step_by(ATTN_BATCH_TOKENS) {
            let rows = s..(s + ATTN_BATCH_TOKENS).min(n);
            let xn = Tensor::from_vec(
                norm_rows(&self.x[rows.start * h..rows.end * h], &r.norm, r.eps),
                (rows.len(), h),
                &Device::Cpu,
            )?;
            let mut logits = linear(&xn, &r.weight, None)?.flatten_all()?.to_vec1::<f32>()?;
            for p in logits.chunks_exact_mut(e) {
                softmax(p);
                top_k(p, r.moe.experts_per_token as usize, r.moe.norm_topk_prob, &mut routes);
            }
        }
        Ok(routes)
    }

    /// FFN inputs of the calibration tokens `idx` (ascending or not): their
    /// rows of the residual stream RMSNormed with `ffn`'s norm, `[idx.len(), hidden]`.
    pub fn ffn_input_of(&self, ffn: &Ffn, idx: &[usize]) -> Vec<f32> {
        let h = self.cfg.hidden_size as usize;
        let mut out = vec![0f32; idx.len() * h];
        out.par_chunks_mut(h)
            .zip(idx.par_iter())
            .for_each(|(o, &t)| rms_norm(&self.x[t * h..(t + 1) * h], &ffn.norm, ffn.eps, o));
        out
    }

    /// RMSNorm with the `[hidden]` weight tensor `norm` of token rows `rows`: `[rows.len(), hidden]`.
    ///
    /// # Errors
    /// A missing or misshapen norm weight.
    pub fn normed(&self, norm: &str, rows: Range<usize>) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size as usize;
        let w = self.ck.tensor_f32(norm, &[h])?;
        Ok(norm_rows(&self.x[rows.start * h..rows.end * h], &w, self.cfg.rms_norm_eps as f32))
    }

    /// FFN input `xn = post_attention_layernorm(x)` of token rows `rows`: `[rows.len(), hidden]`.
    pub fn ffn_input(&self, ffn: &Ffn, rows: Range<usize>) -> Vec<f32> {
        let h = self.cfg.hidden_size as usize;
        norm_rows(&self.x[rows.start * h..rows.end * h], &ffn.norm, ffn.eps)
    }

    /// Adds `delta` (`[rows.len(), hidden]`) to the residual stream of `rows`.
    pub fn add_residual(&mut self, rows: Range<usize>, delta: &[f32]) {
        let h = self.cfg.hidden_size as usize;
        self.x[rows.start * h..rows.end * h].iter_mut().zip(delta).for_each(|(a, d)| *a += d);
    }
}

impl Ffn {
    /// Activations of `n` tokens with FFN inputs `xn` `[n, hidden]`.
    ///
    /// # Errors
    /// Tensor op failures.
    pub fn activations(&self, xn: Vec<f32>, n: usize) -> Result<Activations> {
        let h = self.gate.dim(D::Minus1)?;
        let xn = Tensor::from_vec(xn, (n, h), &Device::Cpu)?;
        let g = linear(&xn, &self.gate, self.gate_bias.as_ref())?.flatten_all()?.to_vec1::<f32>()?;
        let mut hv = linear(&xn, &self.up, self.up_bias.as_ref())?.flatten_all()?.to_vec1::<f32>()?;
        let mut a = g;
        let act = self.act;
        a.par_iter_mut().zip(hv.par_iter_mut()).for_each(|(a, u)| {
            *a = activate(act, *a);
            *u = activate_up(act, *u) * *a;
        });
        Ok(Activations { a, hv })
    }

    /// FFN output `down · hv (+ bias)`, for Gemma 3 then RMSNormed
    /// (`post_feedforward_layernorm`): `[n, hidden]` for `hv` `[n, n_neurons]`.
    ///
    /// # Errors
    /// Tensor op failures.
    pub fn down(&self, hv: Vec<f32>, n: usize) -> Result<Vec<f32>> {
        let inter = self.down.dim(D::Minus1)?;
        let hv = Tensor::from_vec(hv, (n, inter), &Device::Cpu)?;
        let out = linear(&hv, &self.down, self.down_bias.as_ref())?.flatten_all()?.to_vec1::<f32>()?;
        Ok(match &self.post_norm {
            Some(norm) => norm_rows(&out, norm, self.eps),
            None => out,
        })
    }

    /// Neurons in the layer (`intermediate_size`).
    pub fn n_neurons(&self) -> usize {
        self.gate.dims()[0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(sliding: Option<u64>) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Mistral,
            vocab_size: 10,
            hidden_size: 16,
            intermediate_size: 8,
            num_layers: 1,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 64,
            sliding_window: sliding,
            activation: Activation::Silu,
            tie_word_embeddings: true,
            attention_bias: true,
            mlp_bias: false,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    struct Lcg(u64);
    impl Lcg {
        fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
            (0..n)
                .map(|_| {
                    self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    scale * ((self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
                })
                .collect()
        }
    }

    fn t(v: Vec<f32>, shape: &[usize]) -> Tensor {
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The runtime's per-token attention (runtime/src/model/attention.rs) on
    /// plain vectors; with `qk_norm`, each query and key head RMSNormed by
    /// `raw[9]` / `raw[10]` before RoPE (Qwen3); without `rope`, no rotation
    /// (a SmolLM3 NoPE layer).
    fn reference(c: &ModelConfig, raw: &[Vec<f32>], x: &[f32], len: usize, qk_norm: bool, rope_on: bool) -> Vec<f32> {
        let (h, nh, nkv, hd) = (16, 4, 2, 8);
        let (qd, kvd) = (nh * hd, nkv * hd);
        // Gemma 3: its sliding layers' RoPE, its scale, the norm of the output.
        let gemma = c.gemma3().is_some();
        let rope = Rope::new(&c.local_rope().unwrap_or(c.clone()));
        let scale = if gemma {
            1.0 / (c.gemma3().unwrap().query_pre_attn_scalar as f32).sqrt()
        } else {
            1.0 / (hd as f32).sqrt()
        };
        let (cos, sin) = rope.tables(0, len, len);
        let mv = |m: &[f32], b: &[f32], v: &[f32]| -> Vec<f32> {
            b.iter()
                .enumerate()
                .map(|(r, bb)| bb + (0..v.len()).map(|j| m[r * v.len() + j] * v[j]).sum::<f32>())
                .collect()
        };
        let mut out = vec![0f32; x.len()];
        for (wx, wo) in x.chunks(len * h).zip(out.chunks_mut(len * h)) {
            let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
            for t in 0..len {
                let mut xn = vec![0f32; h];
                rms_norm(&wx[t * h..(t + 1) * h], &raw[0], 1e-5, &mut xn);
                let (mut qt, mut kt) = (mv(&raw[1], &raw[5], &xn), mv(&raw[2], &raw[6], &xn));
                if qk_norm {
                    for (v, w) in [(&mut qt, &raw[9]), (&mut kt, &raw[10])] {
                        for head in v.chunks_mut(hd) {
                            let copy = head.to_vec();
                            rms_norm(&copy, w, 1e-5, head);
                        }
                    }
                }
                if rope_on {
                    rope.rotate(&mut qt, &cos[t * hd / 2..(t + 1) * hd / 2], &sin[t * hd / 2..(t + 1) * hd / 2]);
                    rope.rotate(&mut kt, &cos[t * hd / 2..(t + 1) * hd / 2], &sin[t * hd / 2..(t + 1) * hd / 2]);
                }
                q.extend(qt);
                k.extend(kt);
                v.extend(mv(&raw[3], &raw[7], &xn));
            }
            for t in 0..len {
                let mut attn = vec![0f32; qd];
                for head in 0..nh {
                    let kvh = head / (nh / nkv);
                    // The window holds the token and the w − 1 before it (HF, llama.cpp).
                    let start = c.sliding_window.map_or(0, |w| (t + 1).saturating_sub(w as usize));
                    let qv = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
                    let mut sc: Vec<f32> = (start..=t)
                        .map(|j| (0..hd).map(|i| qv[i] * k[j * kvd + kvh * hd + i]).sum::<f32>() * scale)
                        .collect();
                    nflash_runtime::model::ops::softmax(&mut sc);
                    for (j, s) in (start..=t).zip(&sc) {
                        for i in 0..hd {
                            attn[head * hd + i] += s * v[j * kvd + kvh * hd + i];
                        }
                    }
                }
                let o = mv(&raw[4], &raw[8], &attn);
                if gemma {
                    rms_norm(&o, &raw[11], 1e-5, &mut wo[t * h..(t + 1) * h]);
                } else {
                    wo[t * h..(t + 1) * h].copy_from_slice(&o);
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_runtime_semantics() {
        let mut rng = Lcg(5);
        let (h, qd, kvd) = (16, 32, 16);
        let raw: Vec<Vec<f32>> = vec![
            rng.vec(h, 0.2).iter().map(|v| 1.0 + v).collect(),
            rng.vec(qd * h, 0.5),
            rng.vec(kvd * h, 0.5),
            rng.vec(kvd * h, 0.5),
            rng.vec(h * qd, 0.3),
            rng.vec(qd, 0.1),
            rng.vec(kvd, 0.1),
            rng.vec(kvd, 0.1),
            rng.vec(h, 0.1),
            rng.vec(8, 0.3).iter().map(|v| 1.0 + v).collect(),
            rng.vec(8, 0.3).iter().map(|v| 1.0 + v).collect(),
            rng.vec(h, 0.3).iter().map(|v| 1.0 + v).collect(),
        ];
        let mut w = Attention {
            norm: raw[0].clone(),
            q: t(raw[1].clone(), &[qd, h]),
            k: t(raw[2].clone(), &[kvd, h]),
            v: t(raw[3].clone(), &[kvd, h]),
            o: t(raw[4].clone(), &[h, qd]),
            q_bias: Some(t(raw[5].clone(), &[qd])),
            k_bias: Some(t(raw[6].clone(), &[kvd])),
            v_bias: Some(t(raw[7].clone(), &[kvd])),
            o_bias: Some(t(raw[8].clone(), &[h])),
            q_norm: None,
            k_norm: None,
            rope: true,
            local_rope: false,
            window: None,
            post_norm: None,
        };
        let (b, len) = (3, 11);
        let x = rng.vec(b * len * h, 1.0);
        // Gemma 3's sliding layer: its local RoPE base, query_pre_attn_scalar
        // 12 (not head_dim 8), the norm of the block's output.
        let gemma = |sliding| ModelConfig {
            architecture: Architecture::Gemma3(nflash_format::Gemma3 {
                query_pre_attn_scalar: 12,
                rope_local_base_freq: 100.0,
                sliding_layers: nflash_format::LayerSet::from_fn(1, |_| true),
            }),
            ..cfg(sliding)
        };
        for (c, qk_norm, rope) in [
            (cfg(None), false, true),
            (cfg(Some(3)), false, true),
            (cfg(None), true, true),
            (cfg(None), false, false),
            (gemma(Some(4)), true, true),
        ] {
            let sliding = c.sliding_window;
            let gemma = c.gemma3().is_some();
            w.post_norm = gemma.then(|| raw[11].clone());
            w.local_rope = gemma;
            (w.q_norm, w.k_norm) = if qk_norm { (Some(raw[9].clone()), Some(raw[10].clone())) } else { (None, None) };
            w.rope = rope;
            w.window = sliding.map(|s| s as usize);
            let want = reference(&c, &raw, &x, len, qk_norm, rope);
            let got = attend(&c, &Rope::new(&c.local_rope().unwrap_or(c.clone())), &w, &x, b, len).unwrap();
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 1e-4, "sliding {sliding:?}, q/k norm {qk_norm}, rope {rope}, gemma {gemma}: max error {err}");
            // The norms and the missing rotation change the result: the test sees them.
            if qk_norm || !rope || gemma {
                let plain = reference(&c, &raw, &x, len, false, true);
                assert!(got.iter().zip(&plain).any(|(a, b)| (a - b).abs() > 1e-3));
            }
        }
    }

    #[test]
    fn windows_keep_partial_of_two() {
        assert_eq!(split_windows(10, 4), vec![0..4, 4..8, 8..10]);
        assert_eq!(split_windows(9, 4), vec![0..4, 4..8]);
        assert_eq!(split_windows(8, 4), vec![0..4, 4..8]);
    }
}
