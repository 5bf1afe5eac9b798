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

/// Tokens per attention task in a pass of several tokens (verify, prefill):
/// the block's queries share each cached key and value row they read.
const ATTN_BLOCK: usize = 16;

/// Scaled dot-product attention of queries `q` (`[n, n_heads · head_dim]`,
/// positions `p0 ..`) over the cached keys and values `kc`, `vc`
/// (`[rows, n_kv_heads · head_dim]`, f16 or f32, row 0 holding position
/// `first`) into `out` (`[n, n_heads · head_dim]`), causal, each token
/// seeing at most the `window` positions up to itself.
///
/// One token (decode): one task per KV head computes the query heads that
/// share it (GQA) together, so each cached row is read once for all of
/// them; when that makes fewer than four tasks per thread, one task per
/// query head instead, so the threads finish together (SmolLM2's 3 KV
/// heads on 2 threads left one thread a third idle). The tasks run in
/// parallel even over a few cached positions: on one thread the other
/// would idle long enough for rayon to put it to sleep, and waking it cost
/// the next op more than attention saved (SmolLM2 q4_0 after a 16-token
/// prompt: output projection 0.73 → 0.58 ms, decode 96 → 99 tokens/s,
/// medians of 4; at 190 positions a 2¹⁸-product threshold had cost 2.2 ms
/// of attention per token against 1.35 ms).
///
/// Several tokens: tasks take blocks of up to [`ATTN_BLOCK`] tokens
/// ([`attend_block`]), so a verify pass reads the cache once, not once
/// per token (an 810-token SmolLM2 q4_0 prefill took 1349 ms against
/// 1428 ms one task per token, medians of 4 alternating runs).
///
/// Each (token, head) has decode's bits whatever the task: its scores are
/// `dot_kv · scale` each, its softmax runs over its own positions, and its
/// output takes one fused multiply-add per position in ascending order
/// (`kernels::attn_values`).
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
    let qd = nh * hd;
    let n = q.len() / qd.max(1);
    let group = nh / h.n_kv_heads;
    let blocks = n.div_ceil(ATTN_BLOCK);
    // Query heads per task: a whole GQA group, or one head when that leaves
    // too few tasks to share out.
    let per = if blocks * h.n_kv_heads >= 4 * rayon::current_num_threads() { group } else { 1 };
    let span = Span { kc, vc, first, p0, window, h, q };
    if n == 1 {
        return out
            .par_chunks_mut(per * hd)
            .enumerate()
            .for_each_init(Vec::new, |scores, (i, o)| span.token(scores, 0, i * per, per, o));
    }
    // Tokens per block: the fewest blocks of at most ATTN_BLOCK, as even as can be.
    let tb = n.div_ceil(blocks);
    let tasks: Vec<(usize, usize)> = (0..blocks).flat_map(|b| (0..nh / per).map(move |g| (b * tb, g * per))).collect();
    let results: Vec<Vec<f32>> =
        tasks.par_iter().map(|&(t0, h0)| attend_block(&span, t0, (t0 + tb).min(n), h0, per)).collect();
    for (&(t0, h0), r) in tasks.iter().zip(&results) {
        for (i, o) in r.chunks_exact(per * hd).enumerate() {
            let at = (t0 + i) * qd + h0 * hd;
            out[at..at + per * hd].copy_from_slice(o);
        }
    }
}

/// What [`attend`]'s tasks share: the pass's queries, the layer's cache and
/// the geometry.
struct Span<'a> {
    q: &'a [f32],
    kc: KvSlice<'a>,
    vc: KvSlice<'a>,
    first: usize,
    p0: usize,
    window: Option<usize>,
    h: &'a Heads,
}

impl Span<'_> {
    /// Cache rows `[start, end)` that token `t` of the pass attends to.
    /// Sliding window: the token and the `w − 1` before it, as
    /// transformers' `sliding_window_overlay` and llama.cpp's
    /// `is_masked_swa`.
    fn rows(&self, t: usize) -> (usize, usize) {
        let pos = self.p0 + t;
        let start = self.window.map_or(0, |w| (pos + 1).saturating_sub(w)).max(self.first);
        (start - self.first, pos + 1 - self.first)
    }

    /// Offset in a cache row of the KV head that query head `h0` reads (GQA).
    fn kv_off(&self, h0: usize) -> usize {
        h0 / (self.h.n_heads / self.h.n_kv_heads) * self.h.head_dim
    }

    /// Token `t`'s query heads `h0 .. h0 + per` (one GQA group or part of
    /// one) into `out` (`[per, head_dim]`): decode's task.
    fn token(&self, scores: &mut Vec<f32>, t: usize, h0: usize, per: usize, out: &mut [f32]) {
        let h = self.h;
        let (hd, qd, kvd) = (h.head_dim, h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim);
        let off = self.kv_off(h0);
        let (start, end) = self.rows(t);
        let len = end - start;
        scores.clear();
        scores.resize(per * len, 0.0);
        attn_scores(&self.q[t * qd + h0 * hd..][..per * hd], hd, self.kc, kvd, off, start, h.scale, scores);
        scores.chunks_exact_mut(len).for_each(softmax);
        out.fill(0.0);
        attn_values(scores, hd, self.vc, kvd, off, start, out);
    }
}

/// Tokens `t0 .. t1` of a pass, query heads `h0 .. h0 + per` (of one KV
/// head): `[t1 − t0, per, head_dim]`. The block's scores are computed over
/// the union of its tokens' rows in one call (each key read once for every
/// query of the block; scores a token does not see are dropped), each
/// (token, head) softmaxed over its own rows, then the values: each head's
/// rows before those every token sees, then the rows all see in one call
/// for the block (each value row read once), then its own last rows, so
/// each head adds its positions in ascending order as decode does.
fn attend_block(s: &Span, t0: usize, t1: usize, h0: usize, per: usize) -> Vec<f32> {
    let h = s.h;
    let (hd, qd, kvd) = (h.head_dim, h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim);
    let off = s.kv_off(h0);
    let heads = (t1 - t0) * per;
    // Rows [lo, hi) some token sees; [common.0, common.1) every token sees.
    let (lo, common_end) = s.rows(t0);
    let (common_start, hi) = s.rows(t1 - 1);
    let len = hi - lo;
    let mut qs = Vec::with_capacity(heads * hd);
    for t in t0..t1 {
        qs.extend_from_slice(&s.q[t * qd + h0 * hd..][..per * hd]);
    }
    let mut scores = vec![0f32; heads * len];
    attn_scores(&qs, hd, s.kc, kvd, off, lo, h.scale, &mut scores);
    for t in t0..t1 {
        let (a, b) = s.rows(t);
        for i in (t - t0) * per..(t - t0 + 1) * per {
            softmax(&mut scores[i * len + a - lo..i * len + b - lo]);
        }
    }
    let mut out = vec![0f32; heads * hd];
    // One head's values over its rows [a, b) (a cache row range), added to its output.
    let own = |i: usize, (a, b): (usize, usize), out: &mut [f32]| {
        if a < b {
            attn_values(&scores[i * len + a - lo..i * len + b - lo], hd, s.vc, kvd, off, a, &mut out[i * hd..][..hd]);
        }
    };
    if common_start >= common_end {
        // No row every token sees (a sliding window shorter than the block).
        for t in t0..t1 {
            for i in (t - t0) * per..(t - t0 + 1) * per {
                own(i, s.rows(t), &mut out);
            }
        }
        return out;
    }
    for t in t0..t1 {
        let (a, _) = s.rows(t);
        for i in (t - t0) * per..(t - t0 + 1) * per {
            own(i, (a, common_start), &mut out);
        }
    }
    let cl = common_end - common_start;
    let mut p = Vec::with_capacity(heads * cl);
    for i in 0..heads {
        p.extend_from_slice(&scores[i * len + common_start - lo..][..cl]);
    }
    attn_values(&p, hd, s.vc, kvd, off, common_start, &mut out);
    for t in t0..t1 {
        let (_, b) = s.rows(t);
        for i in (t - t0) * per..(t - t0 + 1) * per {
            own(i, (common_end, b), &mut out);
        }
    }
    out
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
