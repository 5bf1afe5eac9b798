//! The attention block: Q/K/V projections, RoPE, the KV cache, scaled
//! dot-product attention with GQA (and an optional sliding window), and the
//! output projection. Tensor names are the Hugging Face ones
//! (`model.layers.{l}.self_attn.*`, formats/SPEC.md §4.3).

use std::time::Instant;

use rayon::prelude::*;

use super::kv_cache::KvCache;
use super::ops::{rms_norm, softmax, Rope};
use super::Timings;
use crate::error::Result;
use crate::kernels::{attn_scores, attn_values, matvec_many, quantized_prefill, DotInput, KvSlice, QMatrix};

/// One layer's attention weights, views into the pack.
pub(crate) struct Attention<'a> {
    /// `[n_heads · head_dim, hidden]`.
    pub q: QMatrix<'a>,
    /// `[n_kv_heads · head_dim, hidden]`.
    pub k: QMatrix<'a>,
    /// `[n_kv_heads · head_dim, hidden]`.
    pub v: QMatrix<'a>,
    /// `[hidden, n_heads · head_dim]`.
    pub o: QMatrix<'a>,
    /// Biases `[n_heads · head_dim]`, `[n_kv_heads · head_dim]` ×2, `[hidden]` (Qwen2: q/k/v).
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub o_bias: Option<Vec<f32>>,
    /// RMSNorm weights `[head_dim]` applied to each query and key head
    /// before RoPE (Qwen3 `self_attn.q_norm`, `self_attn.k_norm`).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// Which RoPE rotates queries and keys: none in SmolLM3's NoPE layers
    /// ([`nflash_format::ModelConfig::layer_uses_rope`]), the local one in
    /// Gemma 3's sliding-window layers.
    pub rope: LayerRope,
    /// Sliding window, positions a token attends to (itself included;
    /// [`nflash_format::ModelConfig::layer_window`]); `None` = the whole context.
    pub window: Option<usize>,
}

/// The RoPE a layer applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerRope {
    /// None (a NoPE layer).
    None,
    /// `rope_theta` and `rope_scaling`.
    Global,
    /// Gemma 3's sliding layers: `rope_local_base_freq`, no scaling.
    Local,
}

/// Head geometry (HF config `num_attention_heads`, `num_key_value_heads`,
/// `head_dim`) and the attention's scale.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA: each serves `n_heads / n_kv_heads` query heads).
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Scores are `q·k · scale` ([`nflash_format::ModelConfig::attn_scale`]).
    pub scale: f32,
    /// RMSNorm epsilon of the per-head query and key norms (`rms_norm_eps`).
    pub eps: f32,
}

/// Buffers of one forward pass over `n` tokens, reused by every layer.
pub(crate) struct AttnScratch {
    /// `[n, n_heads · head_dim]`.
    q: Vec<f32>,
    /// `[n, n_kv_heads · head_dim]`.
    k: Vec<f32>,
    /// `[n, n_kv_heads · head_dim]`.
    v: Vec<f32>,
    /// `[n, n_heads · head_dim]`: attention output before `o_proj`.
    attn: Vec<f32>,
    /// `[n, hidden]`: the block's output, to add to the residual.
    pub out: Vec<f32>,
}

impl AttnScratch {
    /// Buffers for `n` tokens.
    pub fn new(n: usize, hidden: usize, h: &Heads) -> Self {
        let (qd, kvd) = (h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim);
        AttnScratch {
            q: vec![0f32; n * qd],
            k: vec![0f32; n * kvd],
            v: vec![0f32; n * kvd],
            attn: vec![0f32; n * qd],
            out: vec![0f32; n * hidden],
        }
    }
}

/// RoPE rotations of one forward pass: `(cos, sin)`, each `[n, rotary_dim / 2]`.
pub(crate) struct RopeTables<'r> {
    pub rope: &'r Rope,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// The rotations of a pass for every kind of layer: the global RoPE's, and
/// Gemma 3's local one's where the model has sliding layers.
pub(crate) struct PassRope<'r> {
    pub global: RopeTables<'r>,
    pub local: Option<RopeTables<'r>>,
}

impl Attention<'_> {
    /// Attention of layer `l` for `n` tokens at positions `p0 ..`: `xn`
    /// (`[n, hidden]`, RMSNormed) → `s.out` (`[n, hidden]`). Appends the
    /// tokens' keys and values to `kv` (committed by the caller after the
    /// last layer). `batched`: project with the prefill matmul. Step times
    /// go to `tm` (`qkv_s`, `attend_s`, `o_proj_s`).
    ///
    /// # Errors
    /// Matmul failures ([`crate::Error::Internal`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        l: usize,
        xn: &[f32],
        p0: usize,
        h: &Heads,
        rope: &PassRope,
        kv: &mut KvCache,
        batched: bool,
        s: &mut AttnScratch,
        tm: &mut Timings,
    ) -> Result<()> {
        let t = Instant::now();
        let hidden = self.q.cols;
        let n = xn.len() / hidden;
        let (qd, kvd) = (h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim);
        // Q, K, V projections: one quantized input for the three; for one
        // token (decode) in one parallel region.
        let same = self.k.dtype == self.q.dtype && self.v.dtype == self.q.dtype;
        if !same || (batched && !quantized_prefill(self.q.dtype)) {
            project(&self.q, xn, batched, &mut s.q)?;
            project(&self.k, xn, batched, &mut s.k)?;
            project(&self.v, xn, batched, &mut s.v)?;
        } else if n == 1 {
            let xin = DotInput::from_slice(self.q.dtype, xn);
            matvec_many(&[&self.q, &self.k, &self.v], &xin, &mut [&mut s.q, &mut s.k, &mut s.v]);
        } else {
            let xs = DotInput::rows(self.q.dtype, xn, hidden);
            self.q.matmul(&xs, &mut s.q);
            self.k.matmul(&xs, &mut s.k);
            self.v.matmul(&xs, &mut s.v);
        }
        add_bias(&mut s.q, self.q_bias.as_deref());
        add_bias(&mut s.k, self.k_bias.as_deref());
        add_bias(&mut s.v, self.v_bias.as_deref());
        // Qwen3: RMSNorm of each query and key head.
        head_norm(&mut s.q, self.q_norm.as_deref(), h.eps);
        head_norm(&mut s.k, self.k_norm.as_deref(), h.eps);
        // RoPE on queries and keys (none in a NoPE layer).
        let tables = match self.rope {
            LayerRope::None => None,
            LayerRope::Global => Some(&rope.global),
            LayerRope::Local => rope.local.as_ref(),
        };
        if let Some(rope) = tables {
            let half = rope.rope.half();
            for t in 0..n {
                let (c, sn) = (&rope.cos[t * half..(t + 1) * half], &rope.sin[t * half..(t + 1) * half]);
                rope.rope.rotate(&mut s.q[t * qd..(t + 1) * qd], c, sn);
                rope.rope.rotate(&mut s.k[t * kvd..(t + 1) * kvd], c, sn);
            }
        }
        let t = lap(t, &mut tm.qkv_s);
        // KV cache, then softmax(q·kᵀ / √d)·v per (token, head).
        kv.append(l, &s.k, &s.v);
        let (kc, vc, first) = kv.layer(l);
        attend(&s.q, kc, vc, first, p0, self.window, h, &mut s.attn);
        let t = lap(t, &mut tm.attend_s);
        // Output projection.
        project(&self.o, &s.attn, batched, &mut s.out)?;
        add_bias(&mut s.out, self.o_bias.as_deref());
        lap(t, &mut tm.o_proj_s);
        Ok(())
    }
}

/// Adds the time since `t` to `acc` (seconds) and returns now.
fn lap(t: Instant, acc: &mut f64) -> Instant {
    let now = Instant::now();
    *acc += (now - t).as_secs_f64();
    now
}

/// Scaled dot-product attention of queries `q` (`[n, n_heads · head_dim]`,
/// positions `p0 ..`) over the cached keys and values `kc`, `vc`
/// (`[rows, n_kv_heads · head_dim]`, f16 or f32, row 0 holding position
/// `first`) into `out` (`[n, n_heads · head_dim]`), causal, each token
/// seeing at most the `window` positions up to itself. One task per (token, KV head) computes
/// the query heads that share that KV head (GQA) together, so each cached
/// row is read once for all of them; when that makes fewer than four tasks
/// per thread (decode: one token, a few KV heads), one task per (token,
/// query head) instead, so the threads finish together (SmolLM2's 3 KV
/// heads on 2 threads left one thread a third idle). Each head's result
/// has the same bits either way (the kernels sum each head on its own).
/// The tasks run in parallel even for one decode token over a few cached
/// positions: on one thread the other would idle long enough for rayon to
/// put it to sleep, and waking it cost the next op more than attention
/// saved (SmolLM2 q4_0 after a 16-token prompt: output projection 0.73 →
/// 0.58 ms, decode 96 → 99 tokens/s, medians of 4; at 190 positions a
/// 2¹⁸-product threshold had cost 2.2 ms of attention per token against
/// 1.35 ms).
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    kc: KvSlice,
    vc: KvSlice,
    first: usize,
    p0: usize,
    window: Option<usize>,
    h: &Heads,
    out: &mut [f32],
) {
    let (nh, hd) = (h.n_heads, h.head_dim);
    let (qd, kvd) = (nh * hd, h.n_kv_heads * hd);
    let n = q.len() / qd.max(1);
    let scale = h.scale;
    let group = nh / h.n_kv_heads;
    // Query heads per task: a whole GQA group, or one head when that leaves
    // too few tasks to share out.
    let per = if n * h.n_kv_heads >= 4 * rayon::current_num_threads() { group } else { 1 };
    let tasks_per_token = nh / per;
    let task = |scores: &mut Vec<f32>, idx: usize, out: &mut [f32]| {
        let (t, h0) = (idx / tasks_per_token, idx % tasks_per_token * per);
        let kvh = h0 / group;
        let pos = p0 + t;
        // Sliding window: the current token and the `w − 1` before it, as
        // transformers' `sliding_window_overlay` and llama.cpp's
        // `is_masked_swa`; `start` as a row of the layer's cache.
        let start = window.map_or(0, |w| (pos + 1).saturating_sub(w)).max(first);
        let len = pos + 1 - start;
        let start = start - first;
        let qv = &q[t * qd + h0 * hd..t * qd + (h0 + per) * hd];
        scores.clear();
        scores.resize(per * len, 0.0);
        attn_scores(qv, hd, kc, kvd, kvh * hd, start, scale, scores);
        scores.chunks_exact_mut(len).for_each(softmax);
        out.fill(0.0);
        attn_values(scores, hd, vc, kvd, kvh * hd, start, out);
    };
    out.par_chunks_mut(per * hd).enumerate().for_each_init(Vec::new, |scores, (idx, o)| task(scores, idx, o));
}

/// `out = x · mᵀ` for `x` `[n, cols]`: in a batch, the quantized GEMM
/// ([`QMatrix::matmul`]) where [`quantized_prefill`] says so, else
/// candle-core's matmul over dequantized tiles; per-row dot products for
/// a few tokens.
pub(crate) fn project(m: &QMatrix, x: &[f32], batched: bool, out: &mut [f32]) -> Result<()> {
    if batched && !quantized_prefill(m.dtype) {
        m.matmul_f32(x, out);
        return Ok(());
    }
    m.matmul(&DotInput::rows(m.dtype, x, m.cols), out);
    Ok(())
}

/// RMSNorms each head (`weight.len()` elements) of `x` (`[n, heads · head_dim]`) in place.
fn head_norm(x: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    if let Some(w) = weight {
        let mut head = vec![0f32; w.len()];
        for v in x.chunks_exact_mut(w.len()) {
            head.copy_from_slice(v);
            rms_norm(&head, w, eps, v);
        }
    }
}

/// Adds `bias` (`[d]`) to every row of `x` (`[n, d]`).
fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(a, c)| *a += c);
        }
    }
}
