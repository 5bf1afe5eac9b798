//! The decoder-only transformer (Llama / Mistral / Qwen2) over a pack.
//!
//! Per layer: `x += Wo · attn(RoPE(Wq·norm(x)), RoPE(Wk·norm(x)), Wv·norm(x))`,
//! then `x += FFN(norm(x))` through the neuron engine. Tensor names are the
//! Hugging Face ones (SPEC §4.3).

use candle_core::quantized::GgmlType;
use nflash_format::{DType, ModelConfig, Pack};
use rayon::prelude::*;

use crate::error::{Error, Result};
use std::sync::Mutex;
use std::time::Instant;

use crate::cache::{CacheConfig, CacheStats, LayerClusters, Loc, NeuronCache};
use crate::ffn::{BatchMask, Ffn, FfnScratch, Selection};
use crate::sparse::{LayerCounts, LayerSparse, PredictScratch};
use crate::kv_cache::KvCache;
use crate::matmul::MIN_BATCH;
use crate::ops::{rms_norm, softmax, Rope};
use crate::weights::{matvec_many, DotInput, QMatrix};

/// Elements of one dequantized FFN weight tile (per gate / up / down
/// matrix, f32) in batched passes: bounds prefill scratch, so the planner's
/// fixed region holds whatever the FFN's placement (results do not depend
/// on the memory budget).
pub const FFN_TILE_ELEMS: usize = 1 << 18;

struct Layer<'a> {
    attn_norm: Vec<f32>, // [hidden]
    ffn_norm: Vec<f32>,  // [hidden]
    q: QMatrix<'a>,      // [n_heads * head_dim, hidden]
    k: QMatrix<'a>,      // [n_kv_heads * head_dim, hidden]
    v: QMatrix<'a>,      // [n_kv_heads * head_dim, hidden]
    o: QMatrix<'a>,      // [hidden, n_heads * head_dim]
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    o_bias: Option<Vec<f32>>,
    ffn: Ffn,
    /// Sparse-decode settings; `None` for a dense pack.
    sparse: Option<LayerSparse<'a>>,
}

/// How a forward pass computes the FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Prompt processing: every neuron (PowerInfer-2 runs prefill dense).
    Prefill,
    /// Token generation: the pack's predictor and thresholds, unless dense is forced.
    Decode,
    /// Quality evaluation of sparse decode over a batch: dense matmuls with
    /// the neurons decode would skip dropped, and recall counted.
    Evaluate,
}

/// Time spent per part of the forward pass, seconds, summed over calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct Timings {
    /// Norms, Q/K/V/O projections, RoPE, attention.
    pub attention_s: f64,
    /// Predictor evaluation (sparse decode).
    pub predictor_s: f64,
    /// FFN neuron engine.
    pub ffn_s: f64,
    /// Output projection to logits.
    pub lm_head_s: f64,
}

impl Timings {
    fn add(&mut self, o: &Timings) {
        self.attention_s += o.attention_s;
        self.predictor_s += o.predictor_s;
        self.ffn_s += o.ffn_s;
        self.lm_head_s += o.lm_head_s;
    }
}

/// Per-call scratch and counters, behind a lock so `forward` takes `&self`.
#[derive(Default)]
struct Work {
    ffn: FfnScratch,
    predict: PredictScratch,
    /// Packed positions selected by the predictor `[≤ n_neurons]`.
    list: Vec<u32>,
    /// The FFN input prepared for the bundle dtype.
    xin: Option<DotInput>,
    /// Per-layer sparse counters.
    counts: Vec<LayerCounts>,
    /// Speculative prefetch buffers.
    spec: SpecScratch,
    /// `[n_layers]` the last decode step's (I/O wait, predictor) wall time of
    /// each layer's FFN, seconds: whether a speculative prefetch pays.
    layer_wait: Vec<(f64, f64)>,
    /// Clusters the current layer call needs, ascending.
    needed: Vec<u32>,
    /// `[n_clusters]` where each needed cluster is.
    table: Vec<Loc>,
    timings: Timings,
}

/// When decode runs a speculative prefetch ([`Model::set_speculation`];
/// `nflash run --speculate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Speculation {
    /// For a layer whose last FFN call waited for reads longer than its
    /// predictor took (the default).
    #[default]
    Auto,
    /// Before every sparse layer that has cold neurons.
    Always,
    /// Never.
    Never,
}

/// Buffers of a speculative prefetch ([`Model::speculate`]).
#[derive(Default)]
struct SpecScratch {
    /// `[hidden]` the layer's FFN norm of the residual it speculates on.
    x: Vec<f32>,
    /// `x` prepared for the predictor.
    xin: Option<DotInput>,
    predict: PredictScratch,
    /// Packed positions selected `[≤ n_neurons]`.
    list: Vec<u32>,
    /// Their clusters, ascending.
    needed: Vec<u32>,
}

/// A model whose weights are views into an open [`Pack`].
pub struct Model<'a> {
    /// Hyper-parameters from the manifest.
    pub cfg: ModelConfig,
    embed: QMatrix<'a>,   // [vocab, hidden]
    lm_head: QMatrix<'a>, // [vocab, hidden]; the embedding when tied
    final_norm: Vec<f32>, // [hidden]
    layers: Vec<Layer<'a>>,
    rope: Rope,
    /// Use the pack's predictors in [`Pass::Decode`] / [`Pass::Evaluate`].
    sparse_enabled: bool,
    /// When decode reads the next layer's likely clusters ahead of its attention.
    speculation: Speculation,
    /// Hot and cold regions of the FFN neuron clusters.
    cache: NeuronCache,
    work: Mutex<Work>,
}

fn tensor<'a>(pack: &'a Pack, name: &str, shape: &[u64]) -> Result<(DType, &'a [u8])> {
    let (t, bytes) = pack.tensor(name).map_err(|e| match e {
        nflash_format::Error::NotFound { .. } => Error::MissingTensor {
            name: name.to_string(),
        },
        e => e.into(),
    })?;
    if t.shape != shape {
        return Err(Error::Shape {
            name: name.into(),
            expected: shape.to_vec(),
            found: t.shape.clone(),
            dtype: t.dtype,
        });
    }
    Ok((t.dtype, bytes))
}

pub(crate) fn matrix<'a>(pack: &'a Pack, name: &str, rows: u64, cols: u64) -> Result<QMatrix<'a>> {
    let (dt, bytes) = tensor(pack, name, &[rows, cols])?;
    if pack.is_interleaved(name) {
        return Ok(QMatrix::q4_0x8(rows as usize, cols as usize, bytes));
    }
    Ok(QMatrix::new(dt, rows as usize, cols as usize, bytes))
}

pub(crate) fn vector(pack: &Pack, name: &str, len: u64) -> Result<Vec<f32>> {
    let (dt, bytes) = tensor(pack, name, &[len])?;
    let mut out = vec![0f32; len as usize];
    crate::weights::row_to_f32(dt, bytes, &mut out);
    Ok(out)
}


fn opt_vector(pack: &Pack, name: &str, len: u64, present: bool) -> Result<Option<Vec<f32>>> {
    if present {
        vector(pack, name, len).map(Some)
    } else {
        Ok(None)
    }
}

impl<'a> Model<'a> {
    /// Builds views of every tensor, checking names and shapes against the
    /// config, with every FFN neuron cluster read into memory (no budget).
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Shape`], [`Error::Io`].
    pub fn load(pack: &'a Pack) -> Result<Self> {
        Self::load_with(pack, &CacheConfig::all_hot(pack))
    }

    /// As [`Self::load`], with the FFN split between a hot region, a cold
    /// cache and flash as `cache` says.
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_with(pack: &'a Pack, cache: &CacheConfig) -> Result<Self> {
        let cfg = pack.manifest().config.clone();
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let qd = cfg.num_heads * cfg.head_dim;
        let kvd = cfg.num_kv_heads * cfg.head_dim;
        let inter = cfg.intermediate_size;
        let embed = matrix(pack, "model.embed_tokens.weight", v, h)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed
        } else {
            matrix(pack, "lm_head.weight", v, h)?
        };
        let sparse_info = pack.manifest().sparse.clone();
        let qkv_bias = cfg.attention_bias || cfg.architecture == nflash_format::Architecture::Qwen2;
        let mut layers = Vec::with_capacity(cfg.num_layers as usize);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let f = pack.ffn_layer(l as usize)?;
            let sparse = match (&sparse_info, &f.sparse) {
                (Some(si), Some(ls)) => Some(LayerSparse::load(pack, l as usize, si.predictor, si.criterion, ls)?),
                _ => None,
            };
            let ffn = Ffn::new(
                f,
                cfg.activation,
                opt_vector(pack, &format!("{p}.mlp.gate_proj.bias"), inter, cfg.mlp_bias)?,
                opt_vector(pack, &format!("{p}.mlp.up_proj.bias"), inter, cfg.mlp_bias)?,
                opt_vector(pack, &format!("{p}.mlp.down_proj.bias"), h, cfg.mlp_bias)?,
            );
            layers.push(Layer {
                attn_norm: vector(pack, &format!("{p}.input_layernorm.weight"), h)?,
                ffn_norm: vector(pack, &format!("{p}.post_attention_layernorm.weight"), h)?,
                q: matrix(pack, &format!("{p}.self_attn.q_proj.weight"), qd, h)?,
                k: matrix(pack, &format!("{p}.self_attn.k_proj.weight"), kvd, h)?,
                v: matrix(pack, &format!("{p}.self_attn.v_proj.weight"), kvd, h)?,
                o: matrix(pack, &format!("{p}.self_attn.o_proj.weight"), h, qd)?,
                q_bias: opt_vector(pack, &format!("{p}.self_attn.q_proj.bias"), qd, qkv_bias)?,
                k_bias: opt_vector(pack, &format!("{p}.self_attn.k_proj.bias"), kvd, qkv_bias)?,
                v_bias: opt_vector(pack, &format!("{p}.self_attn.v_proj.bias"), kvd, qkv_bias)?,
                o_bias: opt_vector(
                    pack,
                    &format!("{p}.self_attn.o_proj.bias"),
                    h,
                    cfg.attention_bias && cfg.architecture != nflash_format::Architecture::Qwen2,
                )?,
                ffn,
                sparse,
            });
        }
        Ok(Model {
            rope: Rope::new(&cfg),
            final_norm: vector(pack, "model.norm.weight", h)?,
            embed,
            lm_head,
            sparse_enabled: sparse_info.is_some(),
            speculation: Speculation::Auto,
            cache: NeuronCache::open(pack, cache)?,
            work: Mutex::new(Work {
                counts: vec![LayerCounts::default(); layers.len()],
                layer_wait: vec![(0.0, 0.0); layers.len()],
                ..Default::default()
            }),
            layers,
            cfg,
        })
    }

    /// Whether the pack has sparse-decode settings.
    pub fn is_sparse_pack(&self) -> bool {
        self.layers.iter().any(|l| l.sparse.is_some())
    }

    /// Forces dense FFN evaluation everywhere (`--dense`) or restores the pack's sparsity.
    pub fn set_dense(&mut self, dense: bool) {
        self.sparse_enabled = !dense && self.is_sparse_pack();
    }

    /// When sparse decode runs a speculative prefetch of the next layer's
    /// cold clusters (default [`Speculation::Auto`]; `nflash run --speculate`).
    pub fn set_speculation(&mut self, s: Speculation) {
        self.speculation = s;
    }

    /// Per-layer sparse-FFN counters since load or the last [`Self::reset_counters`].
    pub fn counters(&self) -> (Vec<LayerCounts>, Timings) {
        let w = self.work.lock().unwrap_or_else(|e| e.into_inner());
        (w.counts.clone(), w.timings)
    }

    /// Neuron-cache counters (cumulative since load).
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Hot and cold region sizes, bytes, and whether reads bypass the page cache.
    pub fn cache_regions(&self) -> (u64, u64, bool) {
        (self.cache.hot_bytes(), self.cache.cold_bytes(), self.cache.is_direct())
    }

    /// Zeroes the counters and timings.
    pub fn reset_counters(&self) {
        let mut w = self.work.lock().unwrap_or_else(|e| e.into_inner());
        w.counts.iter_mut().for_each(|c| *c = LayerCounts::default());
        w.timings = Timings::default();
    }

    /// A KV cache for `capacity` tokens.
    /// A KV cache for `capacity` tokens, or an error if its memory cannot be reserved.
    ///
    /// # Errors
    /// [`Error::Usage`] naming the size and `--ctx`.
    pub fn try_new_kv_cache(&self, capacity: usize) -> Result<KvCache> {
        let kvd = (self.cfg.num_kv_heads * self.cfg.head_dim) as usize;
        let bytes = KvCache::bytes_at_capacity(self.layers.len(), kvd, capacity);
        // Reserve once to see whether the system grants it (pages are only touched as tokens fill).
        let elems = capacity.checked_mul(kvd).and_then(|e| e.checked_mul(2 * self.layers.len()));
        let ok = elems.is_some_and(|e| Vec::<f32>::new().try_reserve_exact(e).is_ok());
        if !ok {
            return Err(Error::Usage(format!(
                "cannot reserve the KV cache for a context of {capacity} tokens ({:.1} MiB); lower --ctx",
                bytes as f64 / (1u64 << 20) as f64
            )));
        }
        Ok(self.new_kv_cache(capacity))
    }

    /// A KV cache for `capacity` tokens (aborts if the memory cannot be
    /// reserved; see [`Self::try_new_kv_cache`]).
    pub fn new_kv_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(
            self.layers.len(),
            (self.cfg.num_kv_heads * self.cfg.head_dim) as usize,
            capacity,
        )
    }

    /// Runs `tokens` at positions `kv.len()..` and returns the final-normed
    /// hidden states `[n, hidden]`; the KV cache grows by `n`. One token is a
    /// [`Pass::Decode`], more a [`Pass::Prefill`].
    ///
    /// # Errors
    /// [`Error::ContextFull`] if the tokens do not fit, [`Error::TokenOutOfRange`].
    pub fn forward(&self, kv: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
        let pass = if tokens.len() == 1 { Pass::Decode } else { Pass::Prefill };
        self.forward_with(kv, tokens, pass)
    }

    /// [`Self::forward`] with an explicit pass: batches of at least
    /// `MIN_BATCH` tokens use dense matmuls (masked for [`Pass::Evaluate`]),
    /// smaller ones run token by token (sparse unless [`Pass::Prefill`]).
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn forward_with(&self, kv: &mut KvCache, tokens: &[u32], pass: Pass) -> Result<Vec<f32>> {
        let mut guard = self.work.lock().unwrap_or_else(|e| e.into_inner());
        let work = &mut *guard;
        let n = tokens.len();
        let h = self.cfg.hidden_size as usize;
        let (nh, nkv, hd) = (
            self.cfg.num_heads as usize,
            self.cfg.num_kv_heads as usize,
            self.cfg.head_dim as usize,
        );
        let (qd, kvd) = (nh * hd, nkv * hd);
        let p0 = kv.len();
        if p0 + n > kv.capacity() {
            return Err(Error::ContextFull {
                context: kv.capacity(),
            });
        }
        let eps = self.cfg.rms_norm_eps as f32;
        // x: [n, hidden]
        let mut x = vec![0f32; n * h];
        for (t, &id) in tokens.iter().enumerate() {
            if id as u64 >= self.cfg.vocab_size {
                return Err(Error::TokenOutOfRange {
                    id,
                    vocab: self.cfg.vocab_size,
                });
            }
            self.embed.row_to_f32(id as usize, &mut x[t * h..(t + 1) * h]);
        }
        let mut normed = vec![0f32; h];
        let mut q = vec![0f32; n * qd]; // [n, n_heads * head_dim]
        let mut k = vec![0f32; n * kvd]; // [n, n_kv_heads * head_dim]
        let mut v = vec![0f32; n * kvd];
        let mut attn = vec![0f32; n * qd];
        let mut o = vec![0f32; n * h];
        let window = self.cfg.sliding_window.map(|w| w as usize);
        let batched = n >= MIN_BATCH;
        let half = hd / 2;
        let (cos, sin) = self.rope.tables(p0, n); // [n, head_dim/2] each
        let mut xn = vec![0f32; n * h]; // [n, hidden], RMSNormed
        let sparse_on = self.sparse_enabled && pass != Pass::Prefill;
        // Counters and timings describe decode / evaluation only: kept here,
        // added to `work` at the end unless this is a prefill.
        let mut tm = Timings::default();
        for (l, layer) in self.layers.iter().enumerate() {
            let t_attn = Instant::now();
            // Attention block.
            norm_rows(&x, &layer.attn_norm, eps, &mut xn);
            let same = layer.k.dtype == layer.q.dtype && layer.v.dtype == layer.q.dtype;
            if batched || !same {
                project(&layer.q, &xn, batched, &mut q)?;
                project(&layer.k, &xn, batched, &mut k)?;
                project(&layer.v, &xn, batched, &mut v)?;
            } else {
                // Decode: Q, K and V in one parallel region per token.
                for t in 0..n {
                    let xin = DotInput::from_slice(layer.q.dtype, &xn[t * h..(t + 1) * h]);
                    matvec_many(
                        &[&layer.q, &layer.k, &layer.v],
                        &xin,
                        &mut [&mut q[t * qd..(t + 1) * qd], &mut k[t * kvd..(t + 1) * kvd], &mut v[t * kvd..(t + 1) * kvd]],
                    );
                }
            }
            add_bias(&mut q, layer.q_bias.as_deref());
            add_bias(&mut k, layer.k_bias.as_deref());
            add_bias(&mut v, layer.v_bias.as_deref());
            for t in 0..n {
                let (c, sn) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
                self.rope.rotate(&mut q[t * qd..(t + 1) * qd], c, sn);
                self.rope.rotate(&mut k[t * kvd..(t + 1) * kvd], c, sn);
            }
            kv.append(l, &k, &v);
            let (kc, vc) = kv.layer(l);
            let scale = 1.0 / (hd as f32).sqrt();
            let group = nh / nkv;
            // One task per (token, head).
            attn.par_chunks_mut(hd).enumerate().for_each_init(
                Vec::new,
                |scores: &mut Vec<f32>, (idx, out)| {
                    let (t, head) = (idx / nh, idx % nh);
                    let pos = p0 + t;
                    // Sliding window: the current token and the `w` before it, as
                    // flash-attention's window (w, 0) and candle-transformers' Mistral.
                    let start = window.map_or(0, |w| pos.saturating_sub(w));
                    let kvh = head / group;
                    let qv = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
                    scores.clear();
                    for j in start..=pos {
                        let kr = &kc[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd];
                        scores.push(f32::vec_dot(hd, qv, kr) * scale);
                    }
                    softmax(scores);
                    out.fill(0.0);
                    for (j, &s) in (start..=pos).zip(scores.iter()) {
                        let vr = &vc[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd];
                        for (o, b) in out.iter_mut().zip(vr) {
                            *o += s * b;
                        }
                    }
                },
            );
            project(&layer.o, &attn, batched, &mut o)?;
            add_bias(&mut o, layer.o_bias.as_deref());
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            // FFN block through the neuron engine.
            norm_rows(&x, &layer.ffn_norm, eps, &mut xn);
            tm.attention_s += t_attn.elapsed().as_secs_f64();
            let sparse = layer.sparse.as_ref().filter(|_| sparse_on);
            let counts = if batched {
                let t_pred = Instant::now();
                let mask = match sparse {
                    Some(sp) => Some(BatchMask {
                        criterion: sp.criterion,
                        threshold: sp.threshold,
                        predicted: sp.predict_batch(self.cfg.activation, &xn, h)?,
                    }),
                    None => None,
                };
                let t_ffn = Instant::now();
                tm.predictor_s += (t_ffn - t_pred).as_secs_f64();
                // Prefill: every cluster, cold ones streamed in large merged reads.
                work.needed.clear();
                work.needed.extend(0..layer.ffn.n_clusters() as u32);
                self.cache.fetch(l, &work.needed, &mut work.table)?;
                let src = LayerClusters::Cached { cache: &self.cache, layer: l, table: &work.table };
                let c = layer.ffn.forward_batch(&src, &xn, mask.as_ref(), FFN_TILE_ELEMS, &mut x)?;
                tm.ffn_s += t_ffn.elapsed().as_secs_f64();
                c
            } else {
                let mut c = LayerCounts::default();
                for (xr, outr) in xn.chunks_exact(h).zip(x.chunks_exact_mut(h)) {
                    c.add(&self.ffn_token(l, sparse, xr, work, &mut tm, outr)?);
                }
                if n == 1 && sparse.is_some() {
                    self.speculate(l + 1, &x, &work.layer_wait, &mut work.spec, &mut tm);
                }
                c
            };
            if pass != Pass::Prefill {
                work.counts[l].add(&counts);
            }
        }
        if pass != Pass::Prefill {
            work.timings.add(&tm);
        }
        kv.commit(n);
        for row in x.chunks_exact_mut(h) {
            normed.copy_from_slice(row);
            rms_norm(&normed, &self.final_norm, eps, row);
        }
        Ok(x)
    }

    /// One token's FFN (`x`: normed input `[hidden]`, `out`: residual `[hidden]`), sparse when `sparse` is given.
    /// Time spent goes to `tm`.
    fn ffn_token(&self, l: usize, sparse: Option<&LayerSparse>, x: &[f32], work: &mut Work, tm: &mut Timings, out: &mut [f32]) -> Result<LayerCounts> {
        let layer = &self.layers[l];
        let n = layer.ffn.n_neurons() as u64;
        let t0 = Instant::now();
        let Work { ffn, predict, list, xin, needed, table, .. } = work;
        let xin = xin.get_or_insert_with(|| DotInput::new(layer.ffn.dtype()));
        xin.set(x);
        // Predict, then fetch the clusters holding the selected neurons.
        let (listed, gate) = match sparse {
            Some(sp) => (sp.predict_token(self.cfg.activation, xin, x, predict, list), Some((sp.criterion, sp.threshold))),
            None => (false, None),
        };
        let t1 = Instant::now();
        tm.predictor_s += (t1 - t0).as_secs_f64();
        if listed {
            layer.ffn.clusters_of(list, needed);
        } else {
            needed.clear();
            needed.extend(0..layer.ffn.n_clusters() as u32);
        }
        self.cache.fetch(l, needed, table)?;
        let src = LayerClusters::Cached { cache: &self.cache, layer: l, table };
        let (sel, read) = if listed { (Selection::List(list), list.len() as u64) } else { (Selection::All, n) };
        let wait0 = self.cache.wait_s();
        let computed = layer.ffn.forward_token(&src, xin, sel, gate, ffn, out)?;
        tm.ffn_s += t1.elapsed().as_secs_f64();
        // Compute threads wait side by side: their summed wait over the thread count is wall time.
        let waited = (self.cache.wait_s() - wait0) / rayon::current_num_threads() as f64;
        work.layer_wait[l] = (waited, (t1 - t0).as_secs_f64());
        Ok(LayerCounts { neurons: n, read, computed, ..Default::default() })
    }

    /// Speculative prefetch for layer `l` during decode: its predictor run on
    /// its FFN norm of `x` (`[hidden]`, the layer's input, before its
    /// attention adds to it) selects the clusters to read while the attention
    /// computes ([`NeuronCache::speculate`]). Skipped unless the layer's last
    /// FFN call waited for reads longer than its predictor took (so it stops
    /// when the reads are hidden anyway). Time goes to the predictor.
    fn speculate(&self, l: usize, x: &[f32], layer_wait: &[(f64, f64)], sc: &mut SpecScratch, tm: &mut Timings) {
        let Some(layer) = self.layers.get(l) else { return };
        let Some(sp) = layer.sparse.as_ref() else { return };
        // Worth a predictor evaluation only if the layer's last FFN call
        // waited longer than that for its reads.
        let (waited, pred) = layer_wait[l];
        let go = match self.speculation {
            Speculation::Auto => waited > pred,
            Speculation::Always => self.cache.first_cold_cluster(l) < layer.ffn.n_clusters(),
            Speculation::Never => false,
        };
        if !go {
            return;
        }
        let t0 = Instant::now();
        let SpecScratch { x: xn, xin, predict, list, needed } = sc;
        xn.resize(x.len(), 0.0);
        rms_norm(x, &layer.ffn_norm, self.cfg.rms_norm_eps as f32, xn);
        let xin = xin.get_or_insert_with(|| DotInput::new(layer.ffn.dtype()));
        xin.set(xn);
        // Scores for the cold neurons only: the hot ones are always in memory.
        let first = layer.ffn.first_neuron(self.cache.first_cold_cluster(l));
        if sp.predict_token_from(self.cfg.activation, xin, xn, first, predict, list) {
            layer.ffn.clusters_of(list, needed);
            self.cache.speculate(l, needed);
        }
        tm.predictor_s += t0.elapsed().as_secs_f64();
    }

    /// Logits `[vocab]` for one final hidden state `[hidden]`; errors on NaN or
    /// infinite values (damaged weights), naming `position`.
    ///
    /// # Errors
    /// [`Error::NonFinite`].
    pub fn checked_logits(&self, hidden: &[f32], position: usize) -> Result<Vec<f32>> {
        // Checked before the output projection: quantizing its input for the
        // Q8_0 dot turns NaN into 0, which would give finite, flat logits.
        if !hidden.iter().all(|v| v.is_finite()) {
            return Err(Error::NonFinite { position });
        }
        let l = self.logits(hidden);
        if l.iter().all(|v| v.is_finite()) {
            Ok(l)
        } else {
            Err(Error::NonFinite { position })
        }
    }

    /// Logits `[vocab]` for one final hidden state `[hidden]`.
    pub fn logits(&self, hidden: &[f32]) -> Vec<f32> {
        let t0 = Instant::now();
        let mut out = vec![0f32; self.cfg.vocab_size as usize];
        self.lm_head
            .matvec(&DotInput::from_slice(self.lm_head.dtype, hidden), &mut out);
        self.work.lock().unwrap_or_else(|e| e.into_inner()).timings.lm_head_s += t0.elapsed().as_secs_f64();
        out
    }

    /// Logits `[n, vocab]` for `n` final hidden states `[n, hidden]`.
    pub fn logits_batch(&self, hidden: &[f32]) -> Vec<f32> {
        let h = self.cfg.hidden_size as usize;
        let xs: Vec<DotInput> = hidden
            .chunks_exact(h)
            .map(|r| DotInput::from_slice(self.lm_head.dtype, r))
            .collect();
        let mut out = vec![0f32; xs.len() * self.cfg.vocab_size as usize];
        self.lm_head.matmul(&xs, &mut out);
        out
    }
}

/// RMSNorms each row of `x` (`[n, hidden]`) into `out`.
fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    for (row, o) in x.chunks_exact(weight.len()).zip(out.chunks_exact_mut(weight.len())) {
        rms_norm(row, weight, eps, o);
    }
}

/// `out = x · mᵀ` for `x` `[n, cols]`: candle-core matmul over dequantized
/// tiles for batches, per-row quantized dot products otherwise.
fn project(m: &QMatrix, x: &[f32], batched: bool, out: &mut [f32]) -> Result<()> {
    if batched {
        return m.matmul_f32(x, out);
    }
    let xs: Vec<DotInput> = x.chunks_exact(m.cols).map(|r| DotInput::from_slice(m.dtype, r)).collect();
    m.matmul(&xs, out);
    Ok(())
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(a, c)| *a += c);
        }
    }
}
