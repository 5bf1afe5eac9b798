//! The forward pass, top to bottom: embed → per layer (attention norm,
//! attention, [post-attention norm,] residual, FFN norm, FFN, [post-FFN
//! norm,] residual) → final norm; then logits. The bracketed norms are
//! Gemma 3's. Decode (one token) runs the FFN sparse through the predictor
//! and may start the next layer's cold reads early (speculative prefetch).

use rayon::prelude::*;
use std::time::Instant;

use nflash_plan::layout::FFN_TILE_ELEMS;

use super::attention::{AttnScratch, Heads, PassRope, RopeTables};
use super::ffn::{BatchMask, Selection};
use super::kv_cache::KvCache;
use super::ops::{rms_norm, Rope};
use super::predictor::{LayerCounts, LayerSparse, PredictScratch};
use super::source::{ClusterSource, LayerClusters, Loc};
use super::{ExpertPrefetch, Layer, Model, Pass, Pick, Router, SpecScratch, Speculation, Timings, Unit, Work};
use crate::error::{Error, Result};
use crate::kernels::gemm::MIN_BATCH;
use crate::kernels::matrix::q8_input;
use crate::kernels::DotInput;
use crate::kernels::Q8Vec;
use nflash_format::DType;

/// Verify passes of at least this many tokens compute the FFN in lockstep
/// ([`super::ffn::Ffn::forward_tokens`]), shorter ones token by token.
/// Measured on SmolLM2 q4_0 (sparse, in memory, 2 threads, Zen 4 and
/// Xeon), lockstep against token by token: 2 tokens 1.12–1.19× the time,
/// 5 tokens 1.00–1.02×, 9 tokens 0.93–0.95×, 17 tokens 0.87×. On these
/// CPUs decode's FFN is compute-bound, and the ×8 kernels' cost per token
/// falls little with more tokens.
const LOCKSTEP_TOKENS: usize = 9;

impl Model<'_> {
    /// Runs `tokens` at positions `kv.len()..` and returns the final-normed
    /// hidden states `[n, hidden]`; the KV cache grows by `n`. One token is a
    /// [`Pass::Decode`], more a [`Pass::Prefill`].
    ///
    /// # Errors
    /// [`Error::ContextFull`] if the tokens do not fit, [`Error::TokenOutOfRange`],
    /// a failed cluster read ([`Error::ClusterRead`]), NaN or infinity in a
    /// layer's output ([`Error::NonFiniteActivations`]).
    pub fn forward(&self, kv: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
        let pass = if tokens.len() == 1 { Pass::Decode } else { Pass::Prefill };
        self.forward_with(kv, tokens, pass)
    }

    /// A speculative verification pass ([`Pass::Verify`]): `tokens` at
    /// positions `kv.len()..`, each computed with decode's bits, and their
    /// final-normed hidden states `[n, hidden]`; the KV cache grows by `n`
    /// (roll back rejected positions with [`KvCache::truncate`]).
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn verify(&self, kv: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward_with(kv, tokens, Pass::Verify)
    }

    /// A self-speculation draft pass ([`Pass::Draft`]) of `token` at
    /// position `kv.len()`: the final-normed hidden state `[hidden]` of the
    /// model on its resident neurons only (no flash reads); the KV cache
    /// grows by one (truncate it before the verify pass).
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn draft(&self, kv: &mut KvCache, token: u32) -> Result<Vec<f32>> {
        self.forward_with(kv, &[token], Pass::Draft)
    }

    /// [`Self::forward`] with an explicit pass: batches of at least
    /// `MIN_BATCH` tokens use dense matmuls (masked for [`Pass::Evaluate`]),
    /// smaller ones and every [`Pass::Verify`] run token by token (sparse
    /// unless [`Pass::Prefill`]).
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn forward_with(&self, kv: &mut KvCache, tokens: &[u32], pass: Pass) -> Result<Vec<f32>> {
        let mut guard = self.work.lock().unwrap_or_else(|e| e.into_inner());
        // Tells the source when the pass ends, on every return.
        struct PassEnd<'s>(&'s dyn ClusterSource);
        impl Drop for PassEnd<'_> {
            fn drop(&mut self) {
                self.0.end_pass();
            }
        }
        let _end = PassEnd(self.source.as_ref());
        let work = &mut *guard;
        let (n, h, p0) = (tokens.len(), self.cfg.hidden_size as usize, kv.len());
        if p0 + n > kv.capacity() {
            return Err(Error::ContextFull { context: kv.capacity() });
        }
        let eps = self.cfg.rms_norm_eps as f32;
        let heads = Heads {
            n_heads: self.cfg.num_heads as usize,
            n_kv_heads: self.cfg.num_kv_heads as usize,
            head_dim: self.cfg.head_dim as usize,
            scale: self.cfg.attn_scale(),
            eps,
        };
        // Prefill always takes the batched kernels. Which ones depends on the
        // pass's length (short Q8_0 passes: `gemm_x8_f32` and the direct down
        // projection; long ones: f32 panels), and they sum in different
        // orders: a token's results depend on its pass, so session.rs reuses
        // only whole passes, the ones a fresh prefill runs (generate.rs `prefill`).
        let batched = pass.batched(n);
        let sparse_on = self.sparse_enabled && pass != Pass::Prefill;
        let tables = |rope| {
            let (cos, sin) = Rope::tables(rope, p0, n, kv.capacity());
            RopeTables { rope, cos, sin }
        };
        let rope = PassRope { global: tables(&self.rope), local: self.rope_local.as_ref().map(tables) };
        let mut attn = AttnScratch::new(n, h, &heads);
        let mut xn = vec![0f32; n * h]; // [n, hidden], RMSNormed
                                        // Gemma 3: the FFN's output, normed before it joins the residual.
        let mut y = if self.cfg.sandwich_norms() { vec![0f32; n * h] } else { Vec::new() };

        // Counters describe decode / evaluation only: kept here, added to
        // `work` at the end unless this is a prefill. Timings go to the pass's own profile.
        let mut tm = Timings::default();

        // 1. Embed: x [n, hidden].
        let t = Instant::now();
        let mut x = self.embed(tokens)?;
        tm.norm_s += t.elapsed().as_secs_f64();
        for (l, layer) in self.layers.iter().enumerate() {
            // 2. Attention norm, attention, residual.
            let t = Instant::now();
            norm_rows(&x, &layer.attn_norm, eps, &mut xn);
            tm.norm_s += t.elapsed().as_secs_f64();
            layer.attn.forward(l, &xn, p0, &heads, &rope, kv, batched, &mut attn, &mut tm)?;
            let t = Instant::now();
            if let Some(w) = &layer.post_attn_norm {
                norm_rows(&attn.out, w, eps, &mut xn);
                x.iter_mut().zip(&xn).for_each(|(a, b)| *a += b);
            } else {
                x.iter_mut().zip(&attn.out).for_each(|(a, b)| *a += b);
            }
            tm.o_proj_s += t.elapsed().as_secs_f64();
            // 3. FFN norm.
            let t = Instant::now();
            norm_rows(&x, &layer.ffn_norm, eps, &mut xn);
            tm.norm_s += t.elapsed().as_secs_f64();
            // 4. FFN through the neuron engine (a mixture of experts: routed,
            //    then each chosen expert), added to the residual, or for
            //    Gemma 3 into `y`, normed, then added.
            work.layer_wait[l] = (0.0, 0.0);
            let out = if layer.post_ffn_norm.is_some() {
                y.fill(0.0);
                &mut y
            } else {
                &mut x
            };
            let (counts, speculate) = match &layer.router {
                None => {
                    let unit = &layer.units[0];
                    let sparse = unit.sparse.as_ref().filter(|_| sparse_on);
                    let c = if pass == Pass::Verify && n > 1 {
                        self.ffn_verify(unit, sparse, &xn, work, &mut tm, out)?
                    } else if pass == Pass::Draft {
                        self.ffn_token(unit, sparse, &xn, true, work, &mut tm, out)?
                    } else {
                        self.ffn_rows(unit, sparse, batched, &xn, work, &mut tm, out)?
                    };
                    (c, sparse.is_some())
                }
                Some(router) => (self.ffn_moe(l, layer, router, sparse_on, pass, &xn, work, &mut tm, out)?, true),
            };
            if let Some(w) = &layer.post_ffn_norm {
                let t = Instant::now();
                norm_rows(&y, w, eps, &mut xn);
                x.iter_mut().zip(&xn).for_each(|(a, b)| *a += b);
                tm.norm_s += t.elapsed().as_secs_f64();
            }
            // Decode: start the next layer's cold reads (a mixture of
            // experts: read its likely experts) before its attention.
            if n == 1 && speculate && pass != Pass::Draft {
                let useful = self.speculation_yield(&work.expert_prefetch);
                self.speculate(l + 1, &x, &work.layer_wait, useful, &mut work.spec, &mut tm);
            }
            if pass != Pass::Prefill && pass != Pass::Draft {
                work.counts[l].add(&counts);
            }
            // 5. Non-finite activations end the pass here, naming the layer
            //    (later layers, norms and quantized dots would hide them).
            if let Some(i) = x.iter().position(|v| !v.is_finite()) {
                return Err(Error::NonFiniteActivations { layer: l, position: p0 + i / h });
            }
        }
        kv.commit(n);
        // 6. Final norm.
        let t = Instant::now();
        let mut row_in = vec![0f32; h];
        for row in x.chunks_exact_mut(h) {
            row_in.copy_from_slice(row);
            rms_norm(&row_in, &self.final_norm, eps, row);
        }
        tm.norm_s += t.elapsed().as_secs_f64();
        if pass == Pass::Prefill {
            work.prefill_timings.add(&tm);
        } else {
            work.timings.add(&tm);
        }
        Ok(x)
    }

    /// The embedding rows of `tokens`: `[n, hidden]`.
    ///
    /// # Errors
    /// [`Error::TokenOutOfRange`].
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size as usize;
        let mut x = vec![0f32; tokens.len() * h];
        for (t, &id) in tokens.iter().enumerate() {
            if id as u64 >= self.cfg.vocab_size {
                return Err(Error::TokenOutOfRange { id, vocab: self.cfg.vocab_size });
            }
            self.embed.row_to_f32(id as usize, &mut x[t * h..(t + 1) * h]);
        }
        // Gemma 3 scales the embeddings by √hidden (1 elsewhere: skipped).
        let scale = self.cfg.embed_scale();
        if scale != 1.0 {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(x)
    }

    /// One FFN unit over rows `xn` (`[n, hidden]`, normed), added to `out`
    /// (`[n, hidden]`): as one batch ([`Self::ffn_batch`]) when `batched`,
    /// else token by token ([`Self::ffn_token`]).
    #[allow(clippy::too_many_arguments)]
    fn ffn_rows(
        &self,
        unit: &Unit,
        sparse: Option<&LayerSparse>,
        batched: bool,
        xn: &[f32],
        work: &mut Work,
        tm: &mut Timings,
        out: &mut [f32],
    ) -> Result<LayerCounts> {
        if batched {
            return self.ffn_batch(unit, sparse, xn, work, tm, out);
        }
        let h = self.cfg.hidden_size as usize;
        let mut c = LayerCounts::default();
        for (xr, outr) in xn.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            c.add(&self.ffn_token(unit, sparse, xr, false, work, tm, outr)?);
        }
        Ok(c)
    }

    /// A mixture-of-experts FFN over `xn` (`[n, hidden]`, normed), added to
    /// the residual `out` (`[n, hidden]`): each token is routed (exactly:
    /// the router is computed, never predicted), then each expert runs the
    /// tokens routed to it, as one batch when they are at least `MIN_BATCH`
    /// of a batched pass (prefill grouped per expert), and its outputs are
    /// added to those tokens' rows times their routing weights, experts in
    /// ascending order.
    #[allow(clippy::too_many_arguments)]
    fn ffn_moe(
        &self,
        l: usize,
        layer: &Layer,
        router: &Router,
        sparse_on: bool,
        pass: Pass,
        xn: &[f32],
        work: &mut Work,
        tm: &mut Timings,
        out: &mut [f32],
    ) -> Result<LayerCounts> {
        let h = self.cfg.hidden_size as usize;
        let n = xn.len() / h;
        let (batched, resident) = (pass.batched(n), pass == Pass::Draft);
        let k = router.moe.experts_per_token as usize;
        // Route every token: `routes[t·k ..]` its experts, ascending, with weights.
        let t = Instant::now();
        let mut routes = std::mem::take(&mut work.routes);
        routes.clear();
        for xr in xn.chunks_exact(h) {
            router.route(xr, &mut work.router_probs, &mut routes);
        }
        tm.router_s += t.elapsed().as_secs_f64();
        // The experts a speculative prefetch guessed for this layer, against the router's choice.
        if n == 1 && std::mem::replace(&mut work.spec.guess_layer, usize::MAX) == l {
            let g = &work.spec.guess;
            let hit = routes.iter().filter(|r| g.iter().any(|q| q.0 == r.0)).count() as u64;
            let p = &mut work.expert_prefetch;
            (p.guessed, p.routed, p.hit) = (p.guessed + g.len() as u64, p.routed + k as u64, p.hit + hit);
        }
        let (mut xs, mut ys) = (std::mem::take(&mut work.expert_x), std::mem::take(&mut work.expert_y));
        let mut counts = LayerCounts::default();
        let result = (|| -> Result<()> {
            if batched {
                // Prefill grouped per expert: each expert's tokens as one batch.
                let mut rows: Vec<(usize, f32)> = Vec::new();
                for (e, unit) in layer.units.iter().enumerate() {
                    rows.clear();
                    rows.extend(super::moe::routed_to(&routes, k, e));
                    if rows.is_empty() {
                        continue;
                    }
                    xs.clear();
                    rows.iter().for_each(|&(t, _)| xs.extend_from_slice(&xn[t * h..(t + 1) * h]));
                    ys.clear();
                    ys.resize(rows.len() * h, 0.0);
                    let sparse = unit.sparse.as_ref().filter(|_| sparse_on);
                    let c = self.ffn_rows(unit, sparse, rows.len() >= MIN_BATCH, &xs, work, tm, &mut ys)?;
                    counts.add(&c);
                    for (&(t, w), y) in rows.iter().zip(ys.chunks_exact(h)) {
                        out[t * h..(t + 1) * h].iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
                    }
                }
            } else if pass == Pass::Verify && n > 1 {
                counts = self.ffn_moe_verify(layer, &routes, k, sparse_on, xn, work, tm, out)?;
            } else {
                for (t, outr) in out.chunks_exact_mut(h).enumerate() {
                    let (xr, experts) = (&xn[t * h..(t + 1) * h], &routes[t * k..(t + 1) * k]);
                    counts.add(&self.ffn_moe_token(layer, experts, sparse_on, resident, xr, work, tm, &mut ys, outr)?);
                }
            }
            Ok(())
        })();
        (work.routes, work.expert_x, work.expert_y) = (routes, xs, ys);
        result.map(|_| counts)
    }

    /// A batch's FFN (prefill or evaluation) of one unit: `xn` `[n, hidden]` normed,
    /// `out` `[n, hidden]` the residual it adds to. Every cluster is
    /// fetched (cold ones streamed in large merged reads); with `sparse`,
    /// the neurons decode would skip are dropped and counted.
    fn ffn_batch(
        &self,
        unit: &Unit,
        sparse: Option<&LayerSparse>,
        xn: &[f32],
        work: &mut Work,
        tm: &mut Timings,
        out: &mut [f32],
    ) -> Result<LayerCounts> {
        let (u, ffn) = (unit.index, &unit.ffn);
        let t_pred = Instant::now();
        let mask = match sparse {
            Some(sp) => Some(BatchMask {
                criterion: sp.criterion,
                threshold: sp.threshold,
                predicted: sp.predict_batch(self.cfg.activation, xn, self.cfg.hidden_size as usize)?,
            }),
            None => None,
        };
        let t_ffn = Instant::now();
        tm.predictor_s += (t_ffn - t_pred).as_secs_f64();
        work.needed.clear();
        work.needed.extend(0..ffn.n_clusters() as u32);
        self.source.fetch(u, &work.needed, &mut work.table)?;
        let src = LayerClusters::new(self.source.as_ref(), u, &work.table);
        // Short batches multiply the down projection from the quantized
        // weights (no dequantized tile): their gate/up products may span as
        // many neurons as a full pass's tile holds, in fewer, larger steps.
        let n = xn.len() / self.cfg.hidden_size as usize;
        let tile = if ffn.down_direct_for(n) {
            FFN_TILE_ELEMS * nflash_plan::layout::prefill_chunk(&self.cfg) / n.max(1)
        } else {
            FFN_TILE_ELEMS
        };
        let c = ffn.forward_batch(&src, xn, mask.as_ref(), tile, out)?;
        tm.ffn_s += t_ffn.elapsed().as_secs_f64();
        Ok(c)
    }

    /// One token's FFN through one unit (`x`: normed input `[hidden]`,
    /// `out`: residual `[hidden]`), sparse when `sparse` is given: predict
    /// ([`Self::pick`]), fetch the clusters of the selected neurons, compute
    /// ([`Self::ffn_picked`]). Time spent goes to `tm`. With `resident`
    /// (a draft pass), only the selected neurons in memory now
    /// ([`Self::fetch_picked`]).
    #[allow(clippy::too_many_arguments)]
    fn ffn_token(
        &self,
        unit: &Unit,
        sparse: Option<&LayerSparse>,
        x: &[f32],
        resident: bool,
        work: &mut Work,
        tm: &mut Timings,
        out: &mut [f32],
    ) -> Result<LayerCounts> {
        let mut picks = std::mem::take(&mut work.picks);
        picks.resize_with(1, Pick::default);
        let xin = work.xin.get_or_insert_with(|| DotInput::new(unit.ffn.dtype()));
        xin.set(x);
        self.pick(unit, sparse, x, xin, &mut work.predict, &mut picks[0]);
        tm.predictor_s += picks[0].pred_s;
        let t1 = Instant::now();
        let r = self
            .fetch_picked(unit, resident, &mut picks[0], &mut work.table)
            .and_then(|()| self.ffn_picked(unit, sparse, &picks[0], work, tm, out, t1));
        work.picks = picks;
        r
    }

    /// Fetches the clusters of `pick` into `table` ([`ClusterSource::fetch`]);
    /// with `resident` (a draft pass), only those in memory now
    /// ([`ClusterSource::fetch_resident`]), and `pick` is cut down to them
    /// and to the selected neurons they hold.
    fn fetch_picked(&self, unit: &Unit, resident: bool, pick: &mut Pick, table: &mut Vec<Loc>) -> Result<()> {
        if !resident {
            return self.source.fetch(unit.index, &pick.needed, table);
        }
        self.source.fetch_resident(unit.index, &pick.needed, table)?;
        let here = |c: u32| table.get(c as usize).is_some_and(|l| *l != Loc::None);
        let ffn = &unit.ffn;
        if pick.listed {
            pick.list.retain(|&p| here(ffn.cluster_of(p as usize) as u32));
        } else {
            pick.list.clear();
            for &c in pick.needed.iter().filter(|&&c| here(c)) {
                pick.list.extend(ffn.first_neuron(c as usize) as u32..ffn.first_neuron(c as usize + 1) as u32);
            }
            pick.listed = true;
        }
        pick.needed.retain(|&c| here(c));
        Ok(())
    }

    /// A verify pass's FFN of one unit ([`Pass::Verify`]): `xn` `[n, hidden]`
    /// normed, `out` `[n, hidden]` the residual it adds to. Every token's
    /// neurons are selected first ([`Self::pick`], as decode does). Q4_0
    /// and Q8_0 bundles, at least [`LOCKSTEP_TOKENS`] tokens: the union of the tokens' clusters is fetched (it
    /// fits: the cold region holds at least one layer's cold clusters), and
    /// every token is computed in one lockstep pass over it
    /// ([`super::ffn::Ffn::forward_tokens`]: each weight read once, decode's
    /// bits for each token). Shorter passes, f16 and f32 bundles: the first token's
    /// clusters are fetched and the others' reads started
    /// ([`ClusterSource::fetch_ahead`]), then each token is computed as
    /// decode computes it, in order.
    fn ffn_verify(
        &self,
        unit: &Unit,
        sparse: Option<&LayerSparse>,
        xn: &[f32],
        work: &mut Work,
        tm: &mut Timings,
        out: &mut [f32],
    ) -> Result<LayerCounts> {
        let h = self.cfg.hidden_size as usize;
        let n = xn.len() / h;
        let dtype = unit.ffn.dtype();
        let mut picks = std::mem::take(&mut work.picks);
        picks.resize_with(n, Pick::default);
        let result = (|| -> Result<LayerCounts> {
            let mut xins = DotInput::rows(dtype, xn, h);
            for ((x, xin), pick) in xn.chunks_exact(h).zip(&xins).zip(picks.iter_mut()) {
                self.pick(unit, sparse, x, xin, &mut work.predict, pick);
                tm.predictor_s += pick.pred_s;
            }
            let union = union_of(picks.iter().map(|p| &p.needed[..]));
            let mut counts = LayerCounts {
                verify_needed: picks.iter().map(|p| p.needed.len() as u64).sum(),
                verify_union: union.len() as u64,
                ..Default::default()
            };
            if matches!(dtype, DType::Q4_0 | DType::Q8_0) && n >= LOCKSTEP_TOKENS {
                let t1 = Instant::now();
                self.source.fetch(unit.index, &union, &mut work.table)?;
                let src = LayerClusters::new(self.source.as_ref(), unit.index, &work.table);
                let neurons = unit.ffn.n_neurons() as u64;
                let sels: Vec<Selection> = picks.iter().map(|p| p.selection(neurons).0).collect();
                let ys: Vec<&Q8Vec> = xins.iter().map(q8_input).collect();
                let gate = sparse.map(|sp| (sp.criterion, sp.threshold));
                let mut computed = vec![0u64; n];
                let wait0 = self.source.wait_s();
                unit.ffn.forward_tokens(&src, &ys, &sels, gate, &mut work.ffn, out, &mut computed)?;
                tm.ffn_s += t1.elapsed().as_secs_f64();
                self.add_layer_wait(work, unit.index, wait0, picks.iter().map(|p| p.pred_s).sum());
                for (pick, &done) in picks.iter().zip(&computed) {
                    let read = pick.selection(neurons).1;
                    counts.add(&LayerCounts { neurons, read, computed: done, ..Default::default() });
                }
                return Ok(counts);
            }
            let tf = Instant::now();
            self.source.fetch(unit.index, &picks[0].needed, &mut work.table)?;
            for pick in &picks[1..] {
                self.source.fetch_ahead(unit.index, &pick.needed);
            }
            tm.ffn_s += tf.elapsed().as_secs_f64();
            for (t, (xin, outr)) in xins.iter_mut().zip(out.chunks_exact_mut(h)).enumerate() {
                let t1 = Instant::now();
                if t > 0 {
                    self.source.fetch(unit.index, &picks[t].needed, &mut work.table)?;
                }
                // The token's input, prepared once for its pick.
                std::mem::swap(work.xin.get_or_insert_with(|| DotInput::new(dtype)), xin);
                counts.add(&self.ffn_picked(unit, sparse, &picks[t], work, tm, outr, t1)?);
            }
            Ok(counts)
        })();
        work.picks = picks;
        result
    }

    /// One unit's selection for one token (decode): its predictor's choice
    /// of neurons for the normed input `x` (`[hidden]`, also prepared as
    /// `xin`), or every neuron without one, the clusters holding them, and
    /// the time it took.
    fn pick(
        &self,
        unit: &Unit,
        sparse: Option<&LayerSparse>,
        x: &[f32],
        xin: &DotInput,
        predict: &mut PredictScratch,
        pick: &mut Pick,
    ) {
        let t = Instant::now();
        pick.listed = sparse.is_some_and(|sp| sp.predict_token(self.cfg.activation, xin, x, predict, &mut pick.list));
        if pick.listed {
            unit.ffn.clusters_of(&pick.list, &mut pick.needed);
        } else {
            pick.needed.clear();
            pick.needed.extend(0..unit.ffn.n_clusters() as u32);
        }
        pick.pred_s = t.elapsed().as_secs_f64();
    }

    /// The FFN of one unit for one token whose clusters `pick` were just
    /// fetched into `work.table`: computes the selected neurons from the
    /// prepared input `work.xin` into `out` (`[hidden]`). `t1` is when the
    /// fetch began; the time since goes to `tm`, the wait for reads and the
    /// pick's predictor time to the layer's `layer_wait`.
    #[allow(clippy::too_many_arguments)]
    fn ffn_picked(
        &self,
        unit: &Unit,
        sparse: Option<&LayerSparse>,
        pick: &Pick,
        work: &mut Work,
        tm: &mut Timings,
        out: &mut [f32],
        t1: Instant,
    ) -> Result<LayerCounts> {
        let (u, ffn_unit) = (unit.index, &unit.ffn);
        let n = ffn_unit.n_neurons() as u64;
        let Work { ffn, xin, table, .. } = work;
        let xin = xin.as_ref().ok_or_else(|| Error::Internal("FFN input not prepared".into()))?;
        let src = LayerClusters::new(self.source.as_ref(), u, table);
        let gate = sparse.map(|sp| (sp.criterion, sp.threshold));
        let (sel, read) = pick.selection(n);
        let wait0 = self.source.wait_s();
        let computed = ffn_unit.forward_token(&src, xin, sel, gate, ffn, out)?;
        tm.ffn_s += t1.elapsed().as_secs_f64();
        self.add_layer_wait(work, u, wait0, pick.pred_s);
        Ok(LayerCounts { neurons: n, read, computed, ..Default::default() })
    }

    /// Adds to unit `u`'s layer in `work.layer_wait` the wall time compute
    /// threads waited for reads since the source's `wait_s` was `wait0`,
    /// and `pred_s` of predictor time.
    fn add_layer_wait(&self, work: &mut Work, u: usize, wait0: f64, pred_s: f64) {
        // Compute threads wait side by side: their summed wait over the thread count is wall time.
        let waited = (self.source.wait_s() - wait0) / rayon::current_num_threads() as f64;
        let w = &mut work.layer_wait[self.cfg.unit_layer_expert(u).0];
        (w.0, w.1) = (w.0 + waited, w.1 + pred_s);
    }

    /// A verify pass's mixture-of-experts FFN ([`Pass::Verify`], `n` > 1
    /// tokens; `routes` `[n · k]`, each token's experts ascending, with
    /// weights): grouped per expert, so each routed expert's clusters are
    /// read once for the pass. Every (token, expert) selection is made
    /// first ([`Self::pick`], as decode makes it); then, expert after
    /// expert, the union of its tokens' clusters is fetched (the later
    /// experts' reads started right after the first's,
    /// [`ClusterSource::fetch_ahead`]) and each of its tokens computed from
    /// that token's prepared input ([`Self::ffn_picked`], decode's bits);
    /// last, each token adds its experts' outputs times their weights to
    /// `out` (`[n, hidden]`) in its routing order, as decode does
    /// ([`Self::ffn_moe_token`]). One expert's union fits the cold region,
    /// which holds at least one layer's cold clusters.
    #[allow(clippy::too_many_arguments)]
    fn ffn_moe_verify(
        &self,
        layer: &Layer,
        routes: &[(u32, f32)],
        k: usize,
        sparse_on: bool,
        xn: &[f32],
        work: &mut Work,
        tm: &mut Timings,
        out: &mut [f32],
    ) -> Result<LayerCounts> {
        let h = self.cfg.hidden_size as usize;
        let n = xn.len() / h;
        let unit_of = |e: u32| &layer.units[e as usize];
        let sparse_of = |e: u32| unit_of(e).sparse.as_ref().filter(|_| sparse_on);
        let dtype = layer.units[0].ffn.dtype();
        let mut picks = std::mem::take(&mut work.picks);
        picks.resize_with(n * k, Pick::default);
        let result = (|| -> Result<LayerCounts> {
            let mut xins = DotInput::rows(dtype, xn, h);
            // 1. Every token's selection in each of its experts.
            for (i, (&(e, _), pick)) in routes.iter().zip(picks.iter_mut()).enumerate() {
                let t = i / k;
                self.pick(unit_of(e), sparse_of(e), &xn[t * h..(t + 1) * h], &xins[t], &mut work.predict, pick);
                tm.predictor_s += pick.pred_s;
            }
            // 2. The experts routed to, ascending, and the union of each one's clusters.
            let mut experts: Vec<u32> = routes.iter().map(|r| r.0).collect();
            experts.sort_unstable();
            experts.dedup();
            let slots = |e: u32| (0..n * k).filter(move |&i| routes[i].0 == e);
            let unions: Vec<Vec<u32>> =
                experts.iter().map(|&e| union_of(slots(e).map(|i| &picks[i].needed[..]))).collect();
            let mut counts = LayerCounts {
                verify_needed: picks.iter().map(|p| p.needed.len() as u64).sum(),
                verify_union: unions.iter().map(|u| u.len() as u64).sum(),
                ..Default::default()
            };
            // 3. Expert after expert: its union fetched once, its tokens computed.
            let tf = Instant::now();
            for (&e, u) in experts.iter().zip(&unions).skip(1) {
                self.source.fetch_ahead(unit_of(e).index, u);
            }
            tm.ffn_s += tf.elapsed().as_secs_f64();
            let mut ys = vec![0f32; n * k * h];
            for (&e, u) in experts.iter().zip(&unions) {
                let mut t1 = Instant::now();
                self.source.fetch(unit_of(e).index, u, &mut work.table)?;
                for i in slots(e) {
                    let xin = &mut xins[i / k];
                    std::mem::swap(work.xin.get_or_insert_with(|| DotInput::new(dtype)), xin);
                    let c =
                        self.ffn_picked(unit_of(e), sparse_of(e), &picks[i], work, tm, &mut ys[i * h..(i + 1) * h], t1);
                    std::mem::swap(work.xin.get_or_insert_with(|| DotInput::new(dtype)), xin);
                    counts.add(&c?);
                    t1 = Instant::now();
                }
            }
            // 4. Each token's experts, weighted, in its routing order.
            for (i, (&(_, w), y)) in routes.iter().zip(ys.chunks_exact(h)).enumerate() {
                let t = i / k;
                out[t * h..(t + 1) * h].iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
            }
            Ok(counts)
        })();
        work.picks = picks;
        result
    }

    /// One token's mixture-of-experts FFN (decode): `experts` (its routed
    /// experts, with weights) each run on the normed input `x` (`[hidden]`)
    /// into `ys` (scratch) and added to `out` (`[hidden]`) times their
    /// weights, in order. Every
    /// expert's selection is made first, and the reads of the second and
    /// later ones start ([`super::ClusterSource::fetch_ahead`]) right after
    /// the first one's fetch, so they land while the first computes.
    #[allow(clippy::too_many_arguments)]
    fn ffn_moe_token(
        &self,
        layer: &Layer,
        experts: &[(u32, f32)],
        sparse_on: bool,
        resident: bool,
        x: &[f32],
        work: &mut Work,
        tm: &mut Timings,
        ys: &mut Vec<f32>,
        out: &mut [f32],
    ) -> Result<LayerCounts> {
        let h = x.len();
        let mut picks = std::mem::take(&mut work.picks);
        picks.resize_with(experts.len(), Pick::default);
        let result = (|| -> Result<LayerCounts> {
            let mut counts = LayerCounts::default();
            let unit_of = |e: u32| &layer.units[e as usize];
            let sparse_of = |e: u32| unit_of(e).sparse.as_ref().filter(|_| sparse_on);
            // Select every expert's neurons; fetch the first, read ahead the others.
            let xin = work.xin.get_or_insert_with(|| DotInput::new(unit_of(experts[0].0).ffn.dtype()));
            xin.set(x);
            for (j, &(e, _)) in experts.iter().enumerate() {
                self.pick(unit_of(e), sparse_of(e), x, xin, &mut work.predict, &mut picks[j]);
                tm.predictor_s += picks[j].pred_s;
                let tf = Instant::now();
                if j == 0 {
                    self.fetch_picked(unit_of(e), resident, &mut picks[0], &mut work.table)?;
                } else if !resident {
                    self.source.fetch_ahead(unit_of(e).index, &picks[j].needed);
                }
                tm.ffn_s += tf.elapsed().as_secs_f64();
            }
            for (j, &(e, w)) in experts.iter().enumerate() {
                let t = Instant::now();
                if j > 0 {
                    self.fetch_picked(unit_of(e), resident, &mut picks[j], &mut work.table)?;
                }
                ys.clear();
                ys.resize(h, 0.0);
                counts.add(&self.ffn_picked(unit_of(e), sparse_of(e), &picks[j], work, tm, ys, t)?);
                out.iter_mut().zip(ys.iter()).for_each(|(o, y)| *o += w * y);
            }
            Ok(counts)
        })();
        work.picks = picks;
        result
    }

    /// The share of a speculative prefetch's work that has paid so far
    /// (1 until there is evidence): speculative reads the layer then used,
    /// times, for a mixture of experts, guessed experts the router chose
    /// (`guess`). Counters are cumulative since load.
    fn speculation_yield(&self, guess: &ExpertPrefetch) -> f64 {
        const EVIDENCE: u64 = 64;
        let st = self.source.stats();
        let used = if st.speculated >= EVIDENCE { st.speculated_used as f64 / st.speculated as f64 } else { 1.0 };
        let chosen = if guess.guessed >= EVIDENCE { guess.precision() } else { 1.0 };
        used * chosen
    }

    /// Speculative prefetch for layer `l` during decode: its predictor run on
    /// its FFN norm of `x` (`[hidden]`, the layer's input, before its
    /// attention adds to it) selects the clusters to read while the attention
    /// computes ([`super::ClusterSource::speculate`]). With
    /// [`Speculation::Auto`], skipped unless the wait it is expected to hide
    /// (the layer's last FFN call's wait for reads times `useful`, the share
    /// of speculative work that paid so far, [`Self::speculation_yield`])
    /// outweighs that call's predictor time, which the prefetch spends
    /// again; never for a mixture of experts, whose layer-ahead guess is
    /// then only scored. Time goes to the predictor.
    fn speculate(
        &self,
        l: usize,
        x: &[f32],
        layer_wait: &[(f64, f64)],
        useful: f64,
        sc: &mut SpecScratch,
        tm: &mut Timings,
    ) {
        let Some(layer) = self.layers.get(l) else { return };
        let (waited, pred) = layer_wait[l];
        let has_cold = layer.units.iter().any(|u| self.source.first_cold_cluster(u.index) < u.ffn.n_clusters());
        let moe = layer.router.is_some();
        let go = match self.speculation {
            Speculation::Auto => !moe && waited * useful > pred && layer.units[0].sparse.is_some(),
            Speculation::Always => has_cold,
            Speculation::Never => false,
        };
        // A mixture of experts under `auto` guesses the layer's experts (for
        // the layer-ahead prediction's precision and recall) but reads
        // nothing ahead: on the synthetic Mixtral the guessed experts'
        // predictors and wasted reads cost more than they hid (decode 7-10%
        // slower at half and a quarter of the experts in memory,
        // docs/benchmarks.md); the token's later experts are read ahead
        // exactly instead (`ffn_moe_token`).
        let guess_only = !go && moe && self.speculation == Speculation::Auto;
        if !go && !guess_only {
            return;
        }
        let t0 = Instant::now();
        sc.x.resize(x.len(), 0.0);
        rms_norm(x, &layer.ffn_norm, self.cfg.rms_norm_eps as f32, &mut sc.x);
        match &layer.router {
            None => {
                if layer.units[0].sparse.is_some() {
                    self.speculate_unit(&layer.units[0], sc);
                }
            }
            Some(router) => {
                // Layer-ahead expert prediction: this layer's router on the
                // current hidden state picks the experts to read ahead.
                let mut guess = std::mem::take(&mut sc.guess);
                guess.clear();
                router.route(&sc.x, &mut sc.probs, &mut guess);
                if self.misguide_prefetch {
                    // Tests: the experts the router ranks lowest instead.
                    guess.clear();
                    sc.probs.iter_mut().for_each(|p| *p = -*p);
                    super::moe::top_k(&sc.probs, router.moe.experts_per_token as usize, false, &mut guess);
                }
                // Descending, so the expert the layer runs first is the last
                // speculated: the cache protects the last speculation's reads.
                if go {
                    for &(e, _) in guess.iter().rev() {
                        self.speculate_unit(&layer.units[e as usize], sc);
                    }
                }
                sc.guess = guess;
                sc.guess_layer = l;
            }
        }
        tm.predictor_s += t0.elapsed().as_secs_f64();
    }

    /// Starts reading the cold clusters of `unit` that decode will likely
    /// need for the FFN input `sc.x` (normed): those its predictor selects,
    /// or all of them without one (a dense expert).
    fn speculate_unit(&self, unit: &Unit, sc: &mut SpecScratch) {
        let (u, ffn) = (unit.index, &unit.ffn);
        let first_cluster = self.source.first_cold_cluster(u);
        if first_cluster >= ffn.n_clusters() {
            return;
        }
        let SpecScratch { x: xn, xin, predict, list, needed, .. } = sc;
        let Some(sp) = unit.sparse.as_ref() else {
            needed.clear();
            needed.extend(first_cluster as u32..ffn.n_clusters() as u32);
            self.source.speculate(u, needed);
            return;
        };
        let xin = xin.get_or_insert_with(|| DotInput::new(ffn.dtype()));
        xin.set(xn);
        // Scores for the cold neurons only: the hot ones are always in memory.
        let first = ffn.first_neuron(first_cluster);
        if sp.predict_token_from(self.cfg.activation, xin, xn, first, predict, list) {
            ffn.clusters_of(list, needed);
        } else {
            needed.clear();
            needed.extend(first_cluster as u32..ffn.n_clusters() as u32);
        }
        self.source.speculate(u, needed);
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
        self.lm_head.matvec(&DotInput::from_slice(self.lm_head.dtype, hidden), &mut out);
        self.work.lock().unwrap_or_else(|e| e.into_inner()).timings.lm_head_s += t0.elapsed().as_secs_f64();
        out
    }

    /// Logits `[n, vocab]` for `n` final hidden states `[n, hidden]`.
    pub fn logits_batch(&self, hidden: &[f32]) -> Vec<f32> {
        let h = self.cfg.hidden_size as usize;
        let xs = DotInput::rows(self.lm_head.dtype, hidden, h);
        let mut out = vec![0f32; xs.len() * self.cfg.vocab_size as usize];
        self.lm_head.matmul(&xs, &mut out);
        out
    }
}

/// The union of index lists, ascending, each once (a verify pass's clusters).
fn union_of<'a>(lists: impl Iterator<Item = &'a [u32]>) -> Vec<u32> {
    let mut all: Vec<u32> = lists.flatten().copied().collect();
    all.sort_unstable();
    all.dedup();
    all
}

/// RMSNorms each row of `x` (`[n, hidden]`) into `out`, rows in parallel
/// when there are several.
fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    if x.len() == h {
        return rms_norm(x, weight, eps, out);
    }
    out.par_chunks_exact_mut(h).zip(x.par_chunks_exact(h)).for_each(|(o, row)| rms_norm(row, weight, eps, o));
}
