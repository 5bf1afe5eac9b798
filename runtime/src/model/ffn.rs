//! The FFN neuron engine over neuron clusters (PowerInfer-2 §4; SPEC §4.4).
//!
//! Each neuron is a bundle: gate row | up row | down column, `hidden`
//! elements each. For a token x, neuron i contributes
//! `act(gate_i · x + bg_i) * (up_i · x + bu_i) * down_i` to the output.
//! Sparse decode computes only the neurons the predictor selects. Bundle
//! bytes come from a [`super::source::ClusterSource`] ([`LayerClusters`]),
//! wherever they live.

use nflash_format::{Activation, BundleLayout, Criterion, FfnLayer, NeuronCluster};
use rayon::prelude::*;

use super::ops::{neuron_output, neuron_outputs};
use super::predictor::{criterion_value, LayerCounts};
use super::source::LayerClusters;
use crate::error::Result;
use crate::kernels::gemm::Dst;
use crate::kernels::matrix::{direct_f32, gemm_tokens, Acts};
use crate::kernels::{
    axpy_row, axpy_x8, axpy_x8_tokens, dot, gemm_x8, gemm_x8_quads, quantized_prefill, row_dot, row_to_f32, DotInput,
    Q8Batch, Q8Vec,
};
use nflash_format::interleave::{can_interleave, pack_group, X8_ROWS};

/// Batches of at most this many tokens run the FFN's down projection
/// straight from the quantized weights (`kernels::axpy_x8_tokens`); longer
/// ones dequantize the down rows once and multiply in f32 panels
/// (`kernels::gemm`), which pays off when many tokens share the
/// dequantization.
const DOWN_DIRECT_TOKENS: usize = 32;

/// Element `p` of an optional bias vector (0 without bias).
#[inline]
fn bias(b: &Option<Vec<f32>>, p: usize) -> f32 {
    b.as_ref().map_or(0.0, |b| b[p])
}

/// One layer's FFN over its neuron clusters.
pub struct Ffn {
    act: Activation,
    hidden: usize,
    layout: BundleLayout,
    clusters: Vec<NeuronCluster>,
    /// Cluster index of each packed position `[n_neurons]`.
    cluster_of: Vec<u32>,
    /// Bundle offset inside its cluster of each packed position, bytes `[n_neurons]`.
    offsets: Vec<u32>,
    /// Gate bias in packed neuron order `[n_neurons]`.
    gate_bias: Option<Vec<f32>>,
    /// Up bias in packed neuron order `[n_neurons]`.
    up_bias: Option<Vec<f32>>,
    /// Down bias `[hidden]`.
    down_bias: Option<Vec<f32>>,
}

impl Ffn {
    /// Layer `f` (validated by `Pack::open`). Biases, when the model has
    /// them, are given in packed neuron order.
    pub fn new(
        f: &FfnLayer,
        act: Activation,
        gate_bias: Option<Vec<f32>>,
        up_bias: Option<Vec<f32>>,
        down_bias: Option<Vec<f32>>,
    ) -> Self {
        let offsets = f
            .clusters
            .iter()
            .flat_map(|c| (0..c.n_neurons as u64).map(move |i| (i * f.bundle.bundle_bytes) as u32))
            .collect();
        let cluster_of = f
            .clusters
            .iter()
            .enumerate()
            .flat_map(|(ci, c)| std::iter::repeat_n(ci as u32, c.n_neurons as usize))
            .collect();
        Ffn {
            act,
            offsets,
            cluster_of,
            hidden: f.bundle.row_elems as usize,
            layout: f.bundle,
            clusters: f.clusters.clone(),
            gate_bias,
            up_bias,
            down_bias,
        }
    }

    /// `out += FFN(x)` for one token (decode) over the neurons `sel`
    /// selects, skipping the down projection of neurons whose criterion value
    /// is not above `gate.1` (`gate`: `None` = every selected neuron is active).
    /// `x`: the normed input prepared for the bundle dtype; `out`: `[hidden]`.
    ///
    /// The selection is cut into runs of at least [`CHUNK`] neurons, cut
    /// only between ×8 groups ([`Self::chunk_bounds`]), each accumulated
    /// into its own row of `s.partials` by one rayon task, and the rows are
    /// summed in order: the result does not depend on the thread count nor
    /// on where each cluster lives (hot clusters in the ×8 bundle layout
    /// give the bits of the row layout). Chunks wait for their clusters'
    /// reads ([`LayerClusters::get`]), so computing resident neurons overlaps
    /// the I/O of cold ones. No allocation once `s` has grown to size.
    /// Returns the number of neurons whose down projection was computed.
    ///
    /// # Errors
    /// A failed cluster read ([`crate::Error::ClusterRead`]).
    pub fn forward_token(
        &self,
        src: &LayerClusters,
        x: &DotInput,
        sel: Selection,
        gate: Option<(Criterion, f32)>,
        s: &mut FfnScratch,
        out: &mut [f32],
    ) -> Result<u64> {
        let h = self.hidden;
        let n_sel = sel.len(self.n_neurons());
        self.chunk_bounds(&sel, n_sel, &mut s.bounds);
        let n_chunks = s.bounds.len() - 1;
        s.partials.resize(n_chunks.max(1) * h, 0.0);
        s.computed.resize(n_chunks.max(1), 0);
        let bounds = &s.bounds;
        s.partials[..n_chunks * h]
            .par_chunks_mut(h)
            .zip(s.computed[..n_chunks].par_iter_mut())
            .enumerate()
            .try_for_each(|(ci, (acc, done))| -> Result<()> {
                acc.fill(0.0);
                *done = self.run_chunk(src, x, &sel, bounds[ci], bounds[ci + 1], gate, acc)?;
                Ok(())
            })?;
        let mut computed = 0u64;
        for (ci, acc) in s.partials[..n_chunks * h].chunks_exact(h).enumerate() {
            out.iter_mut().zip(acc).for_each(|(o, a)| *o += a);
            computed += s.computed[ci] as u64;
        }
        if let Some(b) = &self.down_bias {
            out.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
        Ok(computed)
    }

    /// `outs[t] += FFN(x_t)` for the tokens of a verify pass (`ys`: their
    /// normed inputs as Q8_0 vectors, for Q4_0 and Q8_0 bundles; `outs`:
    /// `[n, hidden]`), token `t` over the neurons `sels[t]` selects, with
    /// the bits [`Self::forward_token`] gives it alone: its selection is cut
    /// into decode's chunks ([`Self::chunk_bounds`]), each chunk summed from
    /// zero in ascending packed order into a partial row of its own, and
    /// each token's rows added to its output in order.
    ///
    /// The chunks of every token, ordered by their first neuron, are cut
    /// into runs of about equal work, one rayon task each
    /// ([`Self::run_window`]). A task walks its chunks in lockstep: each
    /// group of 8 bundles (or row-layout neuron) that any of them selects
    /// is computed for all of those chunks' tokens at once, so its weights
    /// are read once for the pass, not once per token: gate and up by
    /// `kernels::gemm_x8` four tokens at a time, down by
    /// `kernels::axpy_x8_tokens` with each token's mask. `computed[t]`
    /// (`[n]`) grows by the number of token `t`'s down projections computed.
    ///
    /// # Errors
    /// A failed cluster read ([`crate::Error::ClusterRead`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_tokens(
        &self,
        src: &LayerClusters,
        ys: &[&Q8Vec],
        sels: &[Selection],
        gate: Option<(Criterion, f32)>,
        s: &mut FfnScratch,
        outs: &mut [f32],
        computed: &mut [u64],
    ) -> Result<()> {
        let (h, nn) = (self.hidden, self.n_neurons());
        // 1. Every token's decode chunks, numbered token after token.
        s.chunks.clear();
        for (t, sel) in sels.iter().enumerate() {
            self.chunk_bounds(sel, sel.len(nn), &mut s.bounds);
            s.chunks.extend(s.bounds.windows(2).map(|b| TokenChunk { t, lo: b[0], hi: b[1] }));
        }
        let FfnScratch { chunks, order, cuts, partials, .. } = s;
        let nc = chunks.len();
        // 2. The chunks by first neuron, cut into runs of about equal size.
        let first = |c: &TokenChunk| if c.lo < c.hi { sels[c.t].get(c.lo) } else { 0 };
        order.clear();
        order.extend(0..nc);
        order.sort_by_key(|&i| (first(&chunks[i]), chunks[i].t));
        let total: usize = chunks.iter().map(|c| c.hi - c.lo).sum();
        let runs = (4 * rayon::current_num_threads()).min(nc).max(1);
        cuts.clear();
        cuts.push(0);
        let mut sum = 0;
        for (k, &i) in order.iter().enumerate() {
            sum += chunks[i].hi - chunks[i].lo;
            if sum * runs >= cuts.len() * total.max(1) && k + 1 < nc {
                cuts.push(k + 1);
            }
        }
        cuts.push(nc);
        partials.resize(nc * h, 0.0);
        let dst = Dst::new(partials, nc, h, h);
        let (chunks, order) = (&chunks[..], &order[..]);
        let done: Vec<Vec<u32>> = cuts
            .par_windows(2)
            .map(|w| self.run_window(src, ys, sels, gate, chunks, &order[w[0]..w[1]], &dst))
            .collect::<Result<_>>()?;
        // 3. Each token's partial rows in order, then the down bias: decode's sums.
        for (w, d) in cuts.windows(2).zip(&done) {
            for (&i, &n) in order[w[0]..w[1]].iter().zip(d) {
                computed[chunks[i].t] += n as u64;
            }
        }
        for (i, c) in chunks.iter().enumerate() {
            let out = &mut outs[c.t * h..(c.t + 1) * h];
            out.iter_mut().zip(&partials[i * h..(i + 1) * h]).for_each(|(o, a)| *o += a);
        }
        if let Some(b) = &self.down_bias {
            for out in outs.chunks_exact_mut(h) {
                out.iter_mut().zip(b).for_each(|(o, b)| *o += b);
            }
        }
        Ok(())
    }

    /// The chunks `ids` of a verify pass ([`Self::forward_tokens`]), each
    /// into its row of `dst` (`[chunks, hidden]`, written by this task
    /// alone) from zero, in lockstep: at each group of 8 bundles of a ×8
    /// cluster, or row-layout neuron, that any of them selects next, every
    /// chunk that selects in it computes its neurons there as
    /// [`Self::run_chunk`] would (the same kernels' bits, in the same
    /// order). Returns the down projections computed per chunk of `ids`.
    #[allow(clippy::too_many_arguments)]
    fn run_window(
        &self,
        src: &LayerClusters,
        ys: &[&Q8Vec],
        sels: &[Selection],
        gate: Option<(Criterion, f32)>,
        chunks: &[TokenChunk],
        ids: &[usize],
        dst: &Dst,
    ) -> Result<Vec<u32>> {
        /// A chunk's next selection index, its end, its partial row (of
        /// `dst`) and its count.
        struct Cursor {
            t: usize,
            i: usize,
            hi: usize,
            id: usize,
            done: u32,
        }
        let (h, dt) = (self.hidden, self.layout.dtype);
        let m = X8_ROWS * self.layout.row_bytes as usize;
        let mut curs: Vec<Cursor> = ids
            .iter()
            .map(|&id| {
                let c = chunks[id];
                // SAFETY: chunk `id`'s row is this task's alone (the windows
                // share no chunk), and no other reference to it is live.
                unsafe { dst.row(id, 0, h) }.fill(0.0);
                Cursor { t: c.t, i: c.lo, hi: c.hi, id, done: 0 }
            })
            .collect();
        let mut cur = None;
        // Per group: the cursors that select in it, their masks, gate and up values.
        let (mut part, mut masks) = (Vec::new(), Vec::new());
        let (mut g, mut u) = (Vec::new(), Vec::new());
        let (mut a, mut kept) = (Vec::new(), Vec::new());
        let mut packed = Vec::new();
        let mut tokens: Vec<&Q8Vec> = Vec::new();
        let mut accs: Vec<&mut [f32]> = Vec::new();
        let packable = can_interleave(dt, X8_ROWS as u64, h as u64);
        loop {
            let next = curs.iter().filter(|c| c.i < c.hi).map(|c| sels[c.t].get(c.i)).min();
            let Some(p) = next else { break };
            let g0 = self.group_start(p);
            let x8 = self.in_x8_group(src, p);
            // A full group of 8 row-layout bundles: packed into the ×8
            // layout here (the same bits: `in_x8_group`'s clusters are
            // packed alike), so its tokens share the ×8 kernels.
            let full = x8 || (packable && g0 + X8_ROWS <= self.first_neuron(self.cluster_of(p) + 1));
            if !full {
                // A row-layout neuron: each chunk at it, as `run_chunk`'s `single`.
                let (g_row, u_row, d_row) = self.bundle_at(src, &mut cur, p)?;
                for c in curs.iter_mut().filter(|c| c.i < c.hi && sels[c.t].get(c.i) == p) {
                    c.i += 1;
                    let gv = dot(dt, h, g_row, ys[c.t]);
                    if !self.passes_gate(gate, p, gv) {
                        continue;
                    }
                    let av = self.output(p, gv, dot(dt, h, u_row, ys[c.t]));
                    if keeps(gate, av) {
                        // SAFETY: as above.
                        axpy_row(dt, d_row, av, unsafe { dst.row(c.id, 0, h) });
                        c.done += 1;
                    }
                }
                continue;
            }
            part.clear();
            masks.clear();
            for (k, c) in curs.iter_mut().enumerate() {
                let mut mask = 0u8;
                while c.i < c.hi && sels[c.t].get(c.i) < g0 + X8_ROWS {
                    mask |= 1 << (sels[c.t].get(c.i) - g0);
                    c.i += 1;
                }
                if mask != 0 {
                    part.push(k);
                    masks.push(mask);
                }
            }
            let grp = if x8 {
                &self.cluster_bytes(src, &mut cur, g0)?[self.offsets[g0] as usize..][..3 * m]
            } else {
                packed.resize(3 * m, 0);
                let rb = self.layout.row_bytes as usize;
                let bytes = self.cluster_bytes(src, &mut cur, g0)?;
                let bundle = |r: usize| &bytes[self.offsets[g0 + r] as usize..][..3 * rb];
                for (k, out) in packed.chunks_exact_mut(m).enumerate() {
                    pack_group(dt, h, std::array::from_fn(|r| Some(&bundle(r)[k * rb..(k + 1) * rb])), out);
                }
                &packed[..]
            };
            tokens.clear();
            tokens.extend(part.iter().map(|&k| ys[curs[k].t]));
            for (half, vals) in [(&grp[..m], &mut g), (&grp[m..2 * m], &mut u)] {
                vals.clear();
                gemm_x8_quads(dt, h, half, &tokens, |_, d| vals.extend_from_slice(d));
            }
            a.clear();
            kept.clear();
            for (j, &mask) in masks.iter().enumerate() {
                let out = self.outputs_x8(g0, g[j], u[j]);
                let (mut aj, mut kj) = ([0f32; X8_ROWS], 0u8);
                for r in (0..X8_ROWS).filter(|r| mask & (1 << r) != 0) {
                    if self.passes_gate(gate, g0 + r, g[j][r]) && keeps(gate, out[r]) {
                        aj[r] = out[r];
                        kj |= 1 << r;
                    }
                }
                a.push(aj);
                kept.push(kj);
            }
            for (j, &k) in part.iter().enumerate() {
                curs[k].done += kept[j].count_ones();
                // SAFETY: as above; the participants are distinct chunks,
                // and `accs` is cleared before their rows are taken again.
                accs.push(unsafe { dst.row(curs[k].id, 0, h) });
            }
            axpy_x8_tokens(dt, &grp[2 * m..], &a, &kept, &mut accs);
            accs.clear();
        }
        Ok(curs.iter().map(|c| c.done).collect())
    }

    /// Where the selection `sel` (`n_sel` neurons) is cut into decode tasks,
    /// into `out` (`[n_chunks + 1]`, from 0 to `n_sel`): after at least
    /// [`CHUNK`] neurons, and never inside a group of 8 bundles of a cluster
    /// (so a ×8 group is computed by one task). Depends only on the
    /// selection and the clustering, not on where clusters live.
    fn chunk_bounds(&self, sel: &Selection, n_sel: usize, out: &mut Vec<usize>) {
        out.clear();
        out.push(0);
        let (mut start, mut prev) = (0, usize::MAX);
        for i in 0..n_sel {
            let g = self.group_start(sel.get(i));
            if i - start >= CHUNK && g != prev {
                out.push(i);
                start = i;
            }
            prev = g;
        }
        out.push(n_sel);
    }

    /// Packed position of the first neuron of the group of 8 bundles (or of
    /// a cluster's tail of fewer) that holds position `p`.
    #[inline]
    fn group_start(&self, p: usize) -> usize {
        let first = self.clusters[self.cluster_of[p] as usize].first as usize;
        first + (p - first) / X8_ROWS * X8_ROWS
    }

    /// Selected neurons `lo..hi` of `sel` into `acc` (`[hidden]`), in
    /// ascending packed order; returns how many were active. Neurons of a
    /// full group of 8 in a ×8 cluster go through [`Self::run_x8_group`],
    /// the others through the row kernels, two at a time where they can.
    #[allow(clippy::too_many_arguments)]
    fn run_chunk(
        &self,
        src: &LayerClusters,
        x: &DotInput,
        sel: &Selection,
        lo: usize,
        hi: usize,
        gate: Option<(Criterion, f32)>,
        acc: &mut [f32],
    ) -> Result<u32> {
        let (h, dt) = (self.hidden, self.layout.dtype);
        let keep = |a: f32| keeps(gate, a);
        let gate_only = matches!(gate, Some((Criterion::Gate, _)));
        // One row-layout neuron alone: gate (then, unless the gate rules it out, up) and down.
        let single = |p: usize, (g_row, u_row, d_row): Bundle, acc: &mut [f32]| -> u32 {
            let g = row_dot(dt, h, g_row, x);
            // The gate alone decides: the up row of a neuron it rules out is not read.
            if !self.passes_gate(gate, p, g) {
                return 0;
            }
            let a = self.output(p, g, row_dot(dt, h, u_row, x));
            if keep(a) {
                axpy_row(dt, d_row, a, acc);
                1
            } else {
                0
            }
        };
        let mut done = 0u32;
        let mut cur = None;
        // A row-layout neuron waiting for a partner for the 4-row kernel.
        let mut pending: Option<(usize, Bundle)> = None;
        let mut i = lo;
        while i < hi {
            let p = sel.get(i);
            if self.in_x8_group(src, p) {
                let g0 = self.group_start(p);
                if let Some((q, b)) = pending.take() {
                    done += single(q, b, acc);
                }
                let mut mask = 0u8;
                while i < hi && sel.get(i) < g0 + X8_ROWS {
                    mask |= 1 << (sel.get(i) - g0);
                    i += 1;
                }
                let DotInput::Q8(y) = x else { unreachable!("×8 bundles are Q4_0 or Q8_0") };
                done += self.run_x8_group(src, &mut cur, g0, mask, y, gate, acc)?;
                continue;
            }
            let b = self.bundle_at(src, &mut cur, p)?;
            i += 1;
            match (pending.take(), x) {
                (Some((p0, b0)), DotInput::Q8(y)) if !gate_only => {
                    // Two neurons per pass: gate and up rows of both in one 4-row kernel.
                    let [g0v, u0v, g1v, u1v] = crate::kernels::dot4(dt, h, [b0.0, b0.1, b.0, b.1], y);
                    let (a0, a1) = (self.output(p0, g0v, u0v), self.output(p, g1v, u1v));
                    match (keep(a0), keep(a1)) {
                        (true, true) => crate::kernels::axpy2(dt, [b0.2, b.2], [a0, a1], acc),
                        (true, false) => axpy_row(dt, b0.2, a0, acc),
                        (false, true) => axpy_row(dt, b.2, a1, acc),
                        (false, false) => {}
                    }
                    done += keep(a0) as u32 + keep(a1) as u32;
                }
                (None, DotInput::Q8(_)) if !gate_only => pending = Some((p, b)),
                _ => done += single(p, b, acc),
            }
        }
        if let Some((q, b)) = pending {
            done += single(q, b, acc);
        }
        Ok(done)
    }

    /// The selected neurons (`mask`, bit `r` = position `g0 + r`) of the ×8
    /// group of 8 bundles starting at packed position `g0` into `acc`: the 8
    /// gate and 8 up values in one ×8 kernel call each (unselected neurons'
    /// values are computed and dropped), then the kept neurons' down columns
    /// in one ×8 axpy. Returns how many were active.
    #[allow(clippy::too_many_arguments)]
    fn run_x8_group<'c>(
        &self,
        src: &LayerClusters<'c>,
        cur: &mut Option<(u32, &'c [u8])>,
        g0: usize,
        mask: u8,
        y: &Q8Vec,
        gate: Option<(Criterion, f32)>,
        acc: &mut [f32],
    ) -> Result<u32> {
        let (h, dt) = (self.hidden, self.layout.dtype);
        let m = X8_ROWS * self.layout.row_bytes as usize;
        let bytes = self.cluster_bytes(src, cur, g0)?;
        let grp = &bytes[self.offsets[g0] as usize..][..3 * m];
        let [g] = gemm_x8(dt, h, &grp[..m], [y]);
        let [u] = gemm_x8(dt, h, &grp[m..2 * m], [y]);
        let out = self.outputs_x8(g0, g, u);
        let (mut a, mut kept) = ([0f32; X8_ROWS], 0u8);
        for r in (0..X8_ROWS).filter(|r| mask & (1 << r) != 0) {
            if !self.passes_gate(gate, g0 + r, g[r]) {
                continue;
            }
            let v = out[r];
            if keeps(gate, v) {
                a[r] = v;
                kept |= 1 << r;
            }
        }
        if kept != 0 {
            axpy_x8(dt, &grp[2 * m..], a, kept, acc);
        }
        Ok(kept.count_ones())
    }

    /// Output `act(g + b_g) · (u + b_u)` of the neuron at packed position
    /// `p` from its gate and up dots `g`, `u` (biases added here).
    #[inline]
    fn output(&self, p: usize, g: f32, u: f32) -> f32 {
        neuron_output(self.act, g + bias(&self.gate_bias, p), u + bias(&self.up_bias, p))
    }

    /// [`Self::output`] of the 8 neurons at packed positions `g0 ..` from
    /// their gate and up dots, the activation 8 lanes at a time.
    #[inline]
    fn outputs_x8(&self, g0: usize, g: [f32; X8_ROWS], u: [f32; X8_ROWS]) -> [f32; X8_ROWS] {
        let mut a: [f32; X8_ROWS] = std::array::from_fn(|r| g[r] + bias(&self.gate_bias, g0 + r));
        let ub: [f32; X8_ROWS] = std::array::from_fn(|r| u[r] + bias(&self.up_bias, g0 + r));
        neuron_outputs(self.act, &mut a, &ub);
        a
    }

    /// Whether the `Gate` criterion of `gate`, if it is that one, leaves the
    /// neuron at `p` with gate dot `g` active (`true` for other criteria).
    /// NaN counts as active, as in [`keeps`], so damaged weights reach the
    /// output the same way on every path.
    #[inline]
    fn passes_gate(&self, gate: Option<(Criterion, f32)>, p: usize, g: f32) -> bool {
        match gate {
            Some((Criterion::Gate, t)) => {
                let v = criterion_value(Criterion::Gate, self.act, g + bias(&self.gate_bias, p), 0.0);
                v > t || v.is_nan()
            }
            _ => true,
        }
    }

    /// The bytes of the cluster holding packed position `p`, waiting for
    /// its read if needed; `cur` keeps the last cluster looked up.
    #[inline]
    fn cluster_bytes<'c>(
        &self,
        src: &LayerClusters<'c>,
        cur: &mut Option<(u32, &'c [u8])>,
        p: usize,
    ) -> Result<&'c [u8]> {
        let c = self.cluster_of[p];
        Ok(match *cur {
            Some((cc, b)) if cc == c => b,
            _ => {
                let b = src.get(c as usize)?;
                *cur = Some((c, b));
                b
            }
        })
    }

    /// Bundle bytes (gate row, up row, down column) of the neuron at packed
    /// position `p` in the row layout (not inside a ×8 group: see
    /// [`Self::group_weights`]), waiting for its cluster's read if needed.
    /// `cur` keeps the last cluster looked up, so a run of neurons of one
    /// cluster asks the source once.
    #[inline]
    fn bundle_at<'c>(
        &self,
        src: &LayerClusters<'c>,
        cur: &mut Option<(u32, &'c [u8])>,
        p: usize,
    ) -> Result<Bundle<'c>> {
        let rb = self.layout.row_bytes as usize;
        let b = &self.cluster_bytes(src, cur, p)?[self.offsets[p] as usize..][..3 * rb];
        Ok((&b[..rb], &b[rb..2 * rb], &b[2 * rb..]))
    }

    /// Whether packed position `p` lies in a full ×8 group of a cluster that
    /// `src` holds in the ×8 bundle layout.
    #[inline]
    fn in_x8_group(&self, src: &LayerClusters, p: usize) -> bool {
        let c = self.cluster_of[p] as usize;
        src.is_x8(c) && self.group_start(p) + X8_ROWS <= self.first_neuron(c + 1)
    }

    /// The clusters (ascending, each once) holding the packed positions
    /// `list` (ascending), into `out` (cleared first).
    pub fn clusters_of(&self, list: &[u32], out: &mut Vec<u32>) {
        out.clear();
        for &p in list {
            let c = self.cluster_of[p as usize];
            if out.last() != Some(&c) {
                out.push(c);
            }
        }
    }

    /// Index of the cluster holding packed position `p` (`p < n_neurons`).
    pub fn cluster_of(&self, p: usize) -> usize {
        self.cluster_of[p] as usize
    }

    /// Packed position of cluster `c`'s first neuron (`n_neurons` for `c == n_clusters`).
    pub fn first_neuron(&self, c: usize) -> usize {
        self.clusters.get(c).map_or(self.n_neurons(), |c| c.first as usize)
    }

    /// Number of neuron clusters.
    pub fn n_clusters(&self) -> usize {
        self.clusters.len()
    }

    /// Neurons in the layer.
    pub fn n_neurons(&self) -> usize {
        self.offsets.len()
    }
}

/// Sparse evaluation of a batch: which neurons each token keeps.
pub struct BatchMask {
    /// Activity criterion.
    pub criterion: Criterion,
    /// Active iff criterion value `> threshold`.
    pub threshold: f32,
    /// `[n, n_neurons]` predictor selection in packed order; `None` = every neuron (exact).
    pub predicted: Option<Vec<bool>>,
}

/// Neurons per decode task, at least (whole ×8 groups are added to reach
/// it, so the reduction order is fixed by the selection alone).
pub const CHUNK: usize = 32;

/// Whether the `GateUp` criterion of `gate`, if it is that one, keeps a
/// neuron whose output is `a` (its criterion value is `|a|`); `true` for
/// other criteria and for NaN (damaged weights reach the output).
#[inline]
fn keeps(gate: Option<(Criterion, f32)>, a: f32) -> bool {
    !matches!(gate, Some((Criterion::GateUp, t)) if a.abs() <= t)
}

/// One neuron's gate row, up row and down column (row layout).
type Bundle<'a> = (&'a [u8], &'a [u8], &'a [u8]);

/// The bytes of one group of bundles ([`Ffn::group_weights`]).
enum GroupWeights<'a> {
    /// A full ×8 group: its gate, up and down ×8 groups (SPEC §5.1).
    X8(&'a [u8]),
    /// Bundles in the row layout.
    Rows(Vec<Bundle<'a>>),
}

/// The neurons a decode step computes.
#[derive(Clone, Copy)]
pub enum Selection<'s> {
    /// Every neuron, in packed order.
    All,
    /// These packed positions, ascending.
    List(&'s [u32]),
}

impl Selection<'_> {
    #[inline]
    fn len(&self, n_neurons: usize) -> usize {
        match self {
            Selection::All => n_neurons,
            Selection::List(l) => l.len(),
        }
    }
    #[inline]
    fn get(&self, i: usize) -> usize {
        match self {
            Selection::All => i,
            Selection::List(l) => l[i] as usize,
        }
    }
}

/// Per-token decode buffers, reused across tokens and layers.
#[derive(Default)]
pub struct FfnScratch {
    /// `[n_chunks, hidden]` partial sums, one row per task.
    partials: Vec<f32>,
    /// `[n_chunks]` down projections computed per task.
    computed: Vec<u32>,
    /// `[n_chunks + 1]` where the selection is cut into tasks.
    bounds: Vec<usize>,
    /// A verify pass's chunks, token after token ([`Ffn::forward_tokens`]).
    chunks: Vec<TokenChunk>,
    /// Their indices, ordered by first neuron.
    order: Vec<usize>,
    /// Where `order` is cut into tasks (`[tasks + 1]`).
    cuts: Vec<usize>,
}

/// One decode chunk of one token of a verify pass: selection indices
/// `lo .. hi` of token `t` ([`Ffn::forward_tokens`]).
#[derive(Clone, Copy)]
struct TokenChunk {
    t: usize,
    lo: usize,
    hi: usize,
}

impl Ffn {
    /// `out[t] += FFN(x[t])` for a batch (prefill): `x` `[n, hidden]` (normed,
    /// f32), `out` `[n, hidden]`, a tile of neuron clusters at a time:
    /// `A = act(X·Gᵀ)∘(X·Uᵀ)`, `out += A·D`, where the tile's rows of G, U, D
    /// are its bundles. `X·Gᵀ` and `X·Uᵀ` by the quantized GEMM where
    /// [`quantized_prefill`] says so ([`Self::gate_up_gemm`]), else by the
    /// f32 products of `kernels::gemm` over dequantized rows; `A·D` always
    /// by the latter (the down columns' blocks run along `hidden`, not
    /// along the sum).
    ///
    /// With `mask`, the FFN is evaluated as sparse decode would: a neuron's
    /// product is dropped unless the predictor selected it and its criterion
    /// value is above the threshold; the returned counters say how much was
    /// kept (and, since every gate and up value is known here, the recall).
    /// `tile_elems` bounds the dequantized weight tile (elements per matrix).
    pub fn forward_batch(
        &self,
        src: &LayerClusters,
        x: &[f32],
        mask: Option<&BatchMask>,
        tile_elems: usize,
        out: &mut [f32],
    ) -> crate::error::Result<LayerCounts> {
        let mut counts = LayerCounts::default();
        let h = self.hidden;
        let n = x.len() / h;
        let dt = self.layout.dtype;
        // Q4_0 bundles: the tokens quantized to Q8_0 once for every gate/up GEMM;
        // short prompts of Q8_0 bundles: exact f32 tokens against ×8 groups.
        let quantized = quantized_prefill(dt);
        let direct = !quantized && direct_f32(dt, X8_ROWS, h, n);
        let ys: Vec<Q8Vec> =
            if quantized { x.par_chunks_exact(h).map(Q8Vec::from_slice).collect() } else { Vec::new() };
        let yr: Vec<&Q8Vec> = ys.iter().collect();
        let batch = Q8Batch::new(&yr);
        let xr: Vec<&[f32]> = if direct { x.chunks_exact(h).collect() } else { Vec::new() };
        let acts = if quantized {
            Some(Acts::Q8(&batch))
        } else if direct {
            Some(Acts::F32(&xr))
        } else {
            None
        };
        let tile = (tile_elems / h).max(1);
        let mut group: Vec<&NeuronCluster> = Vec::new();
        let mut acc = vec![0f32; n * h];
        // Buffers reused by every tile: dequantized down rows `[m, hidden]` and
        // the gate and up products `[n, m]`.
        let (mut wd, mut g, mut u) = (Vec::new(), Vec::new(), Vec::new());
        let mut flush = |group: &mut Vec<&NeuronCluster>| -> crate::error::Result<()> {
            if group.is_empty() {
                return Ok(());
            }
            let p0 = group[0].first as usize;
            // The group's clusters are consecutive: packed positions p0 .. p0 + m.
            let m: usize = group.iter().map(|c| c.n_neurons as usize).sum();
            for v in [&mut g, &mut u] {
                v.resize(n * m, 0.0);
            }
            let weights = self.group_weights(src, p0, m)?;
            if let Some(acts) = acts {
                self.gate_up_gemm(&weights, acts, m, &mut g, &mut u);
            } else {
                // Gate and up rows dequantized straight into the products' panels.
                for (which, out) in [(0, &mut g), (1, &mut u)] {
                    let fill =
                        |j0: usize, width: usize, panel: &mut [f32]| self.fill_panel(&weights, which, j0, width, panel);
                    crate::kernels::gemm::x_fill(x, &fill, (n, m, h), out, m, false);
                    // [n, m]
                }
            }
            let (a, u) = (&mut g[..n * m], &mut u[..n * m]);
            // Biases and the activation, tokens in parallel.
            let c = a
                .par_chunks_mut(m)
                .zip(u.par_chunks_mut(m))
                .enumerate()
                .map(|(t, (row_a, row_u))| self.batch_outputs(p0, t, mask, row_a, row_u))
                .reduce(LayerCounts::default, |mut x, y| {
                    x.add(&y);
                    x
                });
            counts.add(&c);
            if self.down_direct_for(n) {
                self.down_direct(&weights, a, m, &mut acc);
            } else if can_interleave(dt, X8_ROWS as u64, h as u64) {
                // Down panels (`[m, PANEL]` of hidden columns) filled straight
                // from the quantized bundles.
                let fill =
                    |j0: usize, width: usize, panel: &mut [f32]| self.fill_down_panel(&weights, j0, width, panel);
                crate::kernels::gemm::x_fill(a, &fill, (n, h, m), &mut acc, h, true);
                // += [n, hidden]
            } else {
                wd.resize(m * h, 0.0);
                self.down_rows(&weights, &mut wd[..m * h]);
                crate::kernels::gemm::aw(&*a, &wd[..m * h], (n, m, h), &mut acc, true);
                // += [n, hidden]
            }
            group.clear();
            Ok(())
        };
        let mut in_group = 0;
        for c in &self.clusters {
            if in_group + c.n_neurons as usize > tile && !group.is_empty() {
                flush(&mut group)?;
                in_group = 0;
            }
            in_group += c.n_neurons as usize;
            group.push(c);
        }
        flush(&mut group)?;
        for (o, row) in out.chunks_exact_mut(h).zip(acc.chunks_exact(h)) {
            for (j, (v, a)) in o.iter_mut().zip(row).enumerate() {
                *v += a + bias(&self.down_bias, j);
            }
        }
        if mask.is_none() {
            counts.neurons = (n * self.n_neurons()) as u64;
            counts.read = counts.neurons;
            counts.computed = counts.neurons;
        }
        Ok(counts)
    }

    /// One token's neuron outputs in a batch: the gate and up products
    /// `row_a`, `row_u` (`[m]`, neurons at packed positions `p0 ..`) get their
    /// biases, then `row_a` becomes the activation's output; with `mask`,
    /// the neurons decode would skip (token `t`'s prediction, the criterion)
    /// are zeroed and counted.
    fn batch_outputs(
        &self,
        p0: usize,
        t: usize,
        mask: Option<&BatchMask>,
        row_a: &mut [f32],
        row_u: &mut [f32],
    ) -> LayerCounts {
        let mut counts = LayerCounts::default();
        if let Some(b) = &self.gate_bias {
            row_a.iter_mut().zip(&b[p0..]).for_each(|(v, b)| *v += b);
        }
        if let Some(b) = &self.up_bias {
            row_u.iter_mut().zip(&b[p0..]).for_each(|(v, b)| *v += b);
        }
        let Some(mk) = mask else {
            neuron_outputs(self.act, row_a, row_u);
            return counts;
        };
        for (j, (av, &uv)) in row_a.iter_mut().zip(row_u.iter()).enumerate() {
            let gv = *av;
            *av = neuron_output(self.act, gv, uv);
            // NaN counts as active, so damaged weights reach the output and are reported.
            let v = criterion_value(mk.criterion, self.act, gv, uv);
            let active = v > mk.threshold || v.is_nan();
            let read = mk.predicted.as_ref().is_none_or(|p| p[t * self.n_neurons() + p0 + j]);
            counts.neurons += 1;
            counts.read += read as u64;
            counts.active += active as u64;
            counts.hit += (read && active) as u64;
            counts.computed += (read && active) as u64;
            if !(read && active) {
                *av = 0.0;
            }
        }
        counts
    }

    /// The gate and up projections of the `m` neurons of `weights`
    /// ([`Self::group_weights`]) for the tokens `acts` (`[n]`: quantized to
    /// Q8_0, or exact f32 for short prompts of Q8_0 bundles) into `g` and `u`
    /// (`[n, m]` each), by the ×8 kernels: each rayon task takes one group
    /// of up to 8 bundles of a cluster, as stored when its cluster is in the
    /// ×8 bundle layout, else packing its gate rows and up rows into ×8
    /// groups (SPEC §5.1), and runs them against every token.
    fn gate_up_gemm(
        &self,
        weights: &[(usize, usize, GroupWeights)],
        acts: Acts,
        m: usize,
        g: &mut [f32],
        u: &mut [f32],
    ) {
        let (h, dt, n) = (self.hidden, self.layout.dtype, acts.len());
        let gbytes = X8_ROWS * self.layout.row_bytes as usize;
        let (gd, ud) = (Dst::new(g, n, m, m), Dst::new(u, n, m, m));
        weights.par_iter().for_each_init(
            || (vec![0u8; gbytes], vec![0u8; gbytes]),
            |(bg, bu), &(j0, k, ref w)| {
                // SAFETY: each group writes only its own neurons' columns j0 .. j0 + k.
                unsafe {
                    match w {
                        // Already a ×8 group: gate rows, then up rows.
                        GroupWeights::X8(grp) => {
                            gemm_tokens(dt, h, &grp[..gbytes], acts, &gd, j0, k);
                            gemm_tokens(dt, h, &grp[gbytes..2 * gbytes], acts, &ud, j0, k);
                        }
                        GroupWeights::Rows(r) => {
                            let rows: [Option<&Bundle>; X8_ROWS] = std::array::from_fn(|i| r.get(i));
                            pack_group(dt, h, rows.map(|r| r.map(|b| b.0)), bg);
                            pack_group(dt, h, rows.map(|r| r.map(|b| b.1)), bu);
                            gemm_tokens(dt, h, bg, acts, &gd, j0, k);
                            gemm_tokens(dt, h, bu, acts, &ud, j0, k);
                        }
                    }
                }
            },
        );
    }

    /// The groups of up to 8 bundles (first position relative to `p0`,
    /// neurons) of the whole clusters at packed positions `p0 .. p0 + m`.
    fn groups(&self, p0: usize, m: usize) -> Vec<(usize, usize)> {
        let mut groups: Vec<(usize, usize)> = Vec::with_capacity(m.div_ceil(X8_ROWS) + 1);
        for j in 0..m {
            match groups.last_mut() {
                Some((j0, k)) if self.group_start(p0 + j) == p0 + *j0 => *k += 1,
                _ => groups.push((j, 1)),
            }
        }
        groups
    }

    /// The weights of the `m` neurons at packed positions `p0 ..` (whole
    /// clusters), group by group ([`Self::groups`]), waiting for their reads:
    /// (first position relative to `p0`, neurons, weights).
    ///
    /// # Errors
    /// A failed cluster read ([`crate::Error::ClusterRead`]).
    fn group_weights<'c>(
        &self,
        src: &LayerClusters<'c>,
        p0: usize,
        m: usize,
    ) -> Result<Vec<(usize, usize, GroupWeights<'c>)>> {
        let gbytes = X8_ROWS * self.layout.row_bytes as usize;
        let mut cur = None;
        let mut out = Vec::new();
        for (j0, k) in self.groups(p0, m) {
            let w = if self.in_x8_group(src, p0 + j0) {
                let bytes = self.cluster_bytes(src, &mut cur, p0 + j0)?;
                GroupWeights::X8(&bytes[self.offsets[p0 + j0] as usize..][..3 * gbytes])
            } else {
                GroupWeights::Rows((0..k).map(|i| self.bundle_at(src, &mut cur, p0 + j0 + i)).collect::<Result<_>>()?)
            };
            out.push((j0, k, w));
        }
        Ok(out)
    }

    /// Row `which` (0 gate, 1 up) of neurons `j0 .. j0 + width` of
    /// `weights` ([`Self::group_weights`]) into a panel of
    /// `kernels::gemm` (`panel[i * PANEL + c]` = element `i` of neuron
    /// `j0 + c`): a ×8 group straight from its bytes
    /// (`kernels::group_to_panel`; through 8 columns of its own when it
    /// crosses the panel's edge), other neurons one row at a time.
    fn fill_panel(
        &self,
        weights: &[(usize, usize, GroupWeights)],
        which: usize,
        j0: usize,
        width: usize,
        panel: &mut [f32],
    ) {
        use crate::kernels::PANEL;
        let (h, dt) = (self.hidden, self.layout.dtype);
        let gbytes = X8_ROWS * self.layout.row_bytes as usize;
        let mut row = Vec::new();
        let first = weights.partition_point(|(g0, k, _)| g0 + k <= j0);
        for &(g0, k, ref w) in weights[first..].iter().take_while(|(g0, _, _)| *g0 < j0 + width) {
            // The group's neurons inside the panel.
            let (lo, hi) = (g0.max(j0), (g0 + k).min(j0 + width));
            match w {
                GroupWeights::X8(b) if g0 >= j0 && g0 + X8_ROWS <= j0 + width => {
                    crate::kernels::group_to_panel(dt, h, &b[which * gbytes..][..gbytes], &mut panel[g0 - j0..], PANEL);
                }
                GroupWeights::X8(b) => {
                    // Across the panel's edge: its own 8 columns, then the part inside.
                    row.resize(X8_ROWS * h, 0.0);
                    crate::kernels::group_to_panel(dt, h, &b[which * gbytes..][..gbytes], &mut row, X8_ROWS);
                    for (prow, grow) in panel.chunks_exact_mut(PANEL).zip(row.chunks_exact(X8_ROWS)) {
                        prow[lo - j0..hi - j0].copy_from_slice(&grow[lo - g0..hi - g0]);
                    }
                }
                GroupWeights::Rows(r) => {
                    row.resize(h, 0.0);
                    for j in lo..hi {
                        row_to_f32(dt, [r[j - g0].0, r[j - g0].1][which], &mut row);
                        crate::kernels::gemm::set_panel_column(panel, j - j0, &row);
                    }
                }
            }
        }
    }

    /// Hidden columns `j0 .. j0 + width` (`width` = `PANEL`, `j0` a multiple
    /// of it) of the down rows of the `m` neurons of `weights`
    /// ([`Self::group_weights`]) into a panel of `kernels::gemm`
    /// (`panel[j · PANEL + c]` = element `j0 + c` of neuron `j`'s down row):
    /// 8 neurons at a time from a ×8 group (`kernels::group_rows_to_panel`),
    /// others from the one block of their row that holds the columns. For
    /// bundles of a ×8 dtype; the values of `row_to_f32`. Before, the tile's
    /// down rows were dequantized to a `[m, hidden]` buffer and copied
    /// into the panels from there, 64 bytes a row.
    fn fill_down_panel(&self, weights: &[(usize, usize, GroupWeights)], j0: usize, width: usize, panel: &mut [f32]) {
        use crate::kernels::PANEL;
        let (h, dt) = (self.hidden, self.layout.dtype);
        assert_eq!(width, PANEL, "down panel of {width} columns");
        let gbytes = X8_ROWS * self.layout.row_bytes as usize;
        let bb = dt.row_bytes(32).expect("a block's bytes") as usize;
        let mut blk = [0f32; 32];
        for &(g0, _, ref w) in weights {
            match w {
                GroupWeights::X8(b) => crate::kernels::group_rows_to_panel(
                    dt,
                    h,
                    &b[2 * gbytes..3 * gbytes],
                    j0,
                    &mut panel[g0 * PANEL..],
                    PANEL,
                ),
                GroupWeights::Rows(r) => {
                    for (i, bundle) in r.iter().enumerate() {
                        row_to_f32(dt, &bundle.2[j0 / 32 * bb..][..bb], &mut blk);
                        panel[(g0 + i) * PANEL..][..PANEL].copy_from_slice(&blk[j0 % 32..][..PANEL]);
                    }
                }
            }
        }
    }

    /// Whether a batch of `n` tokens multiplies the down projection straight
    /// from the quantized weights ([`DOWN_DIRECT_TOKENS`] at most, bundles
    /// of a ×8 dtype), with no dequantized down tile.
    pub(crate) fn down_direct_for(&self, n: usize) -> bool {
        n <= DOWN_DIRECT_TOKENS && can_interleave(self.layout.dtype, X8_ROWS as u64, self.hidden as u64)
    }

    /// `acc[t] += Σ_j a[t, j] · down_j` (`a`: `[n, m]` neuron outputs of
    /// the `m` neurons of `weights`, `acc`: `[n, hidden]`) straight from the
    /// quantized ×8 groups (`kernels::axpy_x8_tokens`; row-layout bundles
    /// packed into a group first): the hidden columns split among the
    /// threads, each summing the groups in order for every token.
    fn down_direct(&self, weights: &[(usize, usize, GroupWeights)], a: &[f32], m: usize, acc: &mut [f32]) {
        let (h, dt) = (self.hidden, self.layout.dtype);
        let n = a.len() / m.max(1);
        let (gbytes, nb) = (X8_ROWS * self.layout.row_bytes as usize, h / 32);
        let gblock = gbytes / nb.max(1);
        let per_task = nb.div_ceil(rayon::current_num_threads()).max(1);
        let dst = Dst::new(acc, n, h, h);
        (0..nb.div_ceil(per_task)).into_par_iter().for_each(|task| {
            let (b0, b1) = (task * per_task, (task * per_task + per_task).min(nb));
            let w = 32 * (b1 - b0);
            // The task's columns of every token, summed in a buffer of its own
            // and written back once: in `acc` the tasks' column ranges meet
            // inside cache lines, which two threads writing them for every
            // group would pass back and forth (the down projection of 16
            // tokens ran no faster on 2 threads than on 1).
            // SAFETY: this task alone writes columns 32·b0 .. 32·b1 of every row.
            let mut rows: Vec<&mut [f32]> = (0..n).map(|t| unsafe { dst.row(t, 32 * b0, w) }).collect();
            let mut local: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
            let mut outs: Vec<&mut [f32]> = local.chunks_exact_mut(w.max(1)).collect();
            let mut buf = Vec::new();
            let mut at = vec![[0f32; X8_ROWS]; n];
            let all = vec![0xFFu8; n];
            for (i, &(j0, k, ref w)) in weights.iter().enumerate() {
                if let Some((_, _, GroupWeights::X8(next))) = weights.get(i + 1) {
                    // This task's piece of the next group, while this one computes.
                    crate::kernels::prefetch(&next[2 * gbytes..3 * gbytes][b0 * gblock..b1 * gblock]);
                }
                for (t, row) in at.iter_mut().enumerate() {
                    row[..k].copy_from_slice(&a[t * m + j0..][..k]);
                    row[k..].fill(0.0);
                }
                let group = match w {
                    GroupWeights::X8(b) => &b[2 * gbytes..3 * gbytes],
                    GroupWeights::Rows(r) => {
                        buf.resize(gbytes, 0);
                        let rows: [Option<&[u8]>; X8_ROWS] = std::array::from_fn(|i| r.get(i).map(|b| b.2));
                        pack_group(dt, h, rows, &mut buf);
                        &buf[..]
                    }
                };
                crate::kernels::axpy_x8_tokens(dt, &group[b0 * gblock..b1 * gblock], &at, &all, &mut outs);
            }
            for (r, l) in rows.iter_mut().zip(local.chunks_exact(w.max(1))) {
                r.copy_from_slice(l);
            }
        });
    }

    /// The down columns of `weights` ([`Self::group_weights`], `m` neurons)
    /// dequantized to f32 into `w` (`[m, hidden]`; the input of prefill's
    /// down product): a ×8 group at a time (`kernels::group_to_f32`), else
    /// row by row, groups in parallel.
    fn down_rows(&self, weights: &[(usize, usize, GroupWeights)], w: &mut [f32]) {
        let (h, dt) = (self.hidden, self.layout.dtype);
        let gbytes = X8_ROWS * self.layout.row_bytes as usize;
        let mut parts = Vec::with_capacity(weights.len());
        let mut rest = w;
        for (_, k, gw) in weights {
            let (part, tail) = rest.split_at_mut(k * h);
            parts.push((gw, part));
            rest = tail;
        }
        parts.into_par_iter().for_each(|(gw, out)| match gw {
            GroupWeights::X8(b) => crate::kernels::group_to_f32(dt, h, &b[2 * gbytes..][..gbytes], out),
            GroupWeights::Rows(r) => {
                for (bundle, o) in r.iter().zip(out.chunks_exact_mut(h)) {
                    row_to_f32(dt, bundle.2, o);
                }
            }
        });
    }

    /// Storage type of the bundles (inputs must be prepared for it).
    pub fn dtype(&self) -> nflash_format::DType {
        self.layout.dtype
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matrix::DIRECT_F32_TOKENS;
    use crate::kernels::QMatrix;
    use crate::model::ops::activate;
    use crate::model::predictor::{LayerSparse, Predictor};
    use crate::model::source::SegmentClusters;
    use nflash_format::DType;

    /// Deterministic values in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    const H: usize = 32;
    const N: usize = 96;

    /// An f32 FFN layer of `N` neurons in one cluster: bundle p = gate row | up row | down column.
    fn layer(gate: &[f32], up: &[f32], down_t: &[f32]) -> (FfnLayer, Vec<u8>) {
        let mut data = Vec::new();
        for p in 0..N {
            for m in [gate, up, down_t] {
                data.extend(bytes(&m[p * H..(p + 1) * H]));
            }
        }
        let bundle = BundleLayout::new(DType::F32, H as u64).unwrap();
        let f = FfnLayer {
            layer: 0,
            segment: 0,
            n_neurons: N as u32,
            bundle,
            cluster_align: 4,
            clusters: vec![NeuronCluster { offset: 0, first: 0, n_neurons: N as u32 }],
            order: (0..N as u32).collect(),
            sparse: None,
        };
        (f, data)
    }

    /// A `dt` (Q4_0 or Q8_0) layer of `n` neurons in clusters of `size`
    /// (5: no full ×8 group; 13: one group of 8 and a tail of 5), rows
    /// `[hidden = 64]`.
    fn q_layer(dt: DType, seed: u64, n: usize, size: usize) -> (FfnLayer, Vec<u8>) {
        let h = 64;
        let bundle = BundleLayout::new(dt, h as u64).unwrap();
        let mut data = Vec::new();
        for p in 0..n {
            for m in 0..3 {
                crate::kernels::quantize_row(dt, &values(seed + (3 * p + m) as u64, h), &mut data);
            }
        }
        let clusters = (0..n.div_ceil(size))
            .map(|c| NeuronCluster {
                offset: (size * c) as u64 * bundle.bundle_bytes,
                first: (size * c) as u32,
                n_neurons: (n - size * c).min(size) as u32,
            })
            .collect();
        let f = FfnLayer {
            layer: 0,
            segment: 0,
            n_neurons: n as u32,
            bundle,
            cluster_align: 2,
            clusters,
            order: (0..n as u32).collect(),
            sparse: None,
        };
        (f, data)
    }

    /// Hot clusters in the ×8 bundle layout (as `NeuronCache` holds them)
    /// give the bits of the row layout: dense and sparse decode (both
    /// criteria, selections that cut groups) and prefill, Q4_0 and Q8_0,
    /// with the first two of three clusters interleaved.
    #[test]
    fn x8_bundle_clusters_give_the_bits_of_the_row_layout() {
        let (h, n) = (64, 37);
        for dt in [DType::Q4_0, DType::Q8_0] {
            let (f, data) = q_layer(dt, 60, n, 13);
            let ffn = Ffn::new(&f, Activation::Silu, None, None, None);
            let offsets: Vec<u64> = f.clusters.iter().map(|c| c.offset).collect();
            let mut inter = data.clone();
            for c in &f.clusters[..2] {
                let at = c.offset as usize;
                let len = c.n_neurons as usize * f.bundle.bundle_bytes as usize;
                nflash_format::interleave::interleave_bundles(
                    dt,
                    h,
                    c.n_neurons as usize,
                    &mut inter[at..at + len],
                    &mut Vec::new(),
                );
            }
            assert_ne!(inter, data);
            let (rows, x8) =
                (SegmentClusters::new(&data, &offsets), SegmentClusters::new(&inter, &offsets).with_x8_clusters(2));
            let x = values(61, h);
            let xin = DotInput::from_slice(dt, &x);
            let list: Vec<u32> = (0..n as u32).filter(|p| p % 3 != 1).collect();
            let one: Vec<u32> = vec![2, 14, 30];
            let cases = [
                (Selection::All, None),
                (Selection::List(&list), Some((Criterion::GateUp, 0.02))),
                (Selection::List(&list), Some((Criterion::Gate, 0.0))),
                (Selection::List(&one), None),
            ];
            for (k, &(sel, gate)) in cases.iter().enumerate() {
                let (mut a, mut b) = (vec![0.5f32; h], vec![0.5f32; h]);
                let mut s = FfnScratch::default();
                let na = ffn.forward_token(&rows.view(), &xin, sel, gate, &mut s, &mut a).unwrap();
                let nb = ffn.forward_token(&x8.view(), &xin, sel, gate, &mut s, &mut b).unwrap();
                assert_eq!((na, a), (nb, b), "{dt} decode case {k}");
            }
            // Short prefill, and a long one whose f32 panels (Q8_0) take
            // ×8 groups whole, across a panel's edge (positions 13..21) and
            // row by row; tiles of one cluster and of four.
            for (t, tile) in [(6, 16), (DIRECT_F32_TOKENS + 3, 64)] {
                let xs = values(62, t * h);
                let (mut a, mut b) = (vec![0f32; t * h], vec![0f32; t * h]);
                ffn.forward_batch(&rows.view(), &xs, None, tile * h, &mut a).unwrap();
                ffn.forward_batch(&x8.view(), &xs, None, tile * h, &mut b).unwrap();
                assert_eq!(a, b, "{dt} prefill of {t} tokens");
            }
        }
    }

    /// A damaged weight (a NaN gate scale) counts as active on both paths,
    /// so it reaches the output from a hot ×8 group as from a cold row.
    #[test]
    fn a_nan_weight_reaches_the_output_from_x8_and_row_clusters_alike() {
        let (h, n) = (64, 37);
        let (f, mut data) = q_layer(DType::Q4_0, 80, n, 13);
        // Neuron 3 (inside cluster 0's first group of 8): its gate row's first scale is NaN.
        let at = 3 * f.bundle.bundle_bytes as usize;
        data[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
        let ffn = Ffn::new(&f, Activation::Silu, None, None, None);
        let offsets: Vec<u64> = f.clusters.iter().map(|c| c.offset).collect();
        let mut inter = data.clone();
        let len = 13 * f.bundle.bundle_bytes as usize;
        nflash_format::interleave::interleave_bundles(DType::Q4_0, h, 13, &mut inter[..len], &mut Vec::new());
        let (rows, x8) =
            (SegmentClusters::new(&data, &offsets), SegmentClusters::new(&inter, &offsets).with_x8_clusters(1));
        let xin = DotInput::from_slice(DType::Q4_0, &values(81, h));
        let list: Vec<u32> = (0..n as u32).collect();
        for gate in [Some((Criterion::GateUp, 0.02)), Some((Criterion::Gate, 0.0))] {
            let (mut a, mut b) = (vec![0f32; h], vec![0f32; h]);
            let mut s = FfnScratch::default();
            let na = ffn.forward_token(&rows.view(), &xin, Selection::List(&list), gate, &mut s, &mut a).unwrap();
            let nb = ffn.forward_token(&x8.view(), &xin, Selection::List(&list), gate, &mut s, &mut b).unwrap();
            assert_eq!(na, nb, "{gate:?}: neurons computed");
            assert!(a.iter().chain(&b).all(|v| v.is_nan()), "{gate:?}: the NaN neuron was dropped");
        }
    }

    /// Prefill of a Q4_0 layer (quantized GEMM for gate/up, f32 matmul for
    /// down) against decode of each token (the four-row dot and axpy
    /// kernels): gate and up are the same bits, so only the down
    /// projection's summation order differs. Token counts not a multiple of
    /// the 4-token tile, and 1 token.
    #[test]
    fn quantized_prefill_matches_decode_token_by_token() {
        let (h, n) = (64, 37);
        let (f, data) = q_layer(DType::Q4_0, 40, n, 5);
        let ffn = Ffn::new(&f, Activation::Silu, None, None, None);
        let offsets: Vec<u64> = f.clusters.iter().map(|c| c.offset).collect();
        let seg = SegmentClusters::new(&data, &offsets);
        let src = seg.view();
        for n_tok in [1, 6, 9] {
            let x = values(50 + n_tok as u64, n_tok * h);
            let mut batch = vec![0.25f32; n_tok * h];
            // A tile of 16 neurons: three tiles, the last of 5.
            ffn.forward_batch(&src, &x, None, 16 * h, &mut batch).unwrap();
            for t in 0..n_tok {
                let xin = DotInput::from_slice(DType::Q4_0, &x[t * h..(t + 1) * h]);
                let mut one = vec![0.25f32; h];
                ffn.forward_token(&src, &xin, Selection::All, None, &mut FfnScratch::default(), &mut one).unwrap();
                for (a, b) in batch[t * h..(t + 1) * h].iter().zip(&one) {
                    assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{n_tok} tokens, token {t}: {a} vs {b}");
                }
            }
        }
    }

    /// A short Q8_0 prompt (exact f32 tokens against ×8 groups) agrees with
    /// a long one (weights dequantized into f32 panels) on the same tokens to
    /// f32 rounding, with hot ×8 clusters and row-layout ones.
    #[test]
    fn short_q8_0_prefill_matches_the_dequantized_matmul() {
        let (h, n) = (64, 37);
        let (f, data) = q_layer(DType::Q8_0, 70, n, 13);
        let ffn = Ffn::new(&f, Activation::Silu, None, None, None);
        let offsets: Vec<u64> = f.clusters.iter().map(|c| c.offset).collect();
        let mut inter = data.clone();
        let c0 = &f.clusters[0];
        let len = c0.n_neurons as usize * f.bundle.bundle_bytes as usize;
        nflash_format::interleave::interleave_bundles(DType::Q8_0, h, 13, &mut inter[..len], &mut Vec::new());
        let seg = SegmentClusters::new(&inter, &offsets).with_x8_clusters(1);
        let long = DIRECT_F32_TOKENS + 6;
        let x = values(71, long * h);
        let (mut a, mut b) = (vec![0f32; long * h], vec![0f32; 5 * h]);
        ffn.forward_batch(&seg.view(), &x, None, 16 * h, &mut a).unwrap();
        ffn.forward_batch(&seg.view(), &x[..5 * h], None, 16 * h, &mut b).unwrap();
        let mut differ = false;
        for (i, (p, q)) in a[..5 * h].iter().zip(&b).enumerate() {
            assert!((p - q).abs() <= 1e-4 * p.abs().max(1.0), "element {i}: {p} vs {q}");
            differ |= p != q;
        }
        assert!(differ, "the two paths summed in the same order: the test checks nothing");
    }

    #[test]
    fn batched_recall_and_sparsity_equal_a_brute_force_count() {
        let (gate, up, down_t) = (values(1, N * H), values(2, N * H), values(3, N * H));
        let (f, data) = layer(&gate, &up, &down_t);
        let ffn = Ffn::new(&f, Activation::Silu, None, None, None);
        let seg = SegmentClusters::new(&data, &[0]);
        let src = seg.view();
        let r = 8;
        let (proj, pg, pu) = (values(4, r * H), values(5, N * r), values(6, N * r));
        let (bp, bg, bu) = (bytes(&proj), bytes(&pg), bytes(&pu));
        let sp = LayerSparse {
            criterion: Criterion::GateUp,
            threshold: 0.05,
            predictor_threshold: 0.1,
            predictor: Predictor::LowRank {
                proj: QMatrix::new(DType::F32, r, H, &bp),
                gate: QMatrix::new(DType::F32, N, r, &bg),
                up: QMatrix::new(DType::F32, N, r, &bu),
            },
        };
        let n_tok = 16;
        let x = values(7, n_tok * H);
        let mask = BatchMask {
            criterion: sp.criterion,
            threshold: sp.threshold,
            predicted: sp.predict_batch(Activation::Silu, &x, H).unwrap(),
        };
        let mut out = vec![0f32; n_tok * H];
        let c = ffn.forward_batch(&src, &x, Some(&mask), crate::kernels::gemm::TILE_ELEMS, &mut out).unwrap();
        // Brute force, straight from the f32 weights.
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let (mut active, mut read, mut hit) = (0u64, 0u64, 0u64);
        for t in 0..n_tok {
            let xt = &x[t * H..(t + 1) * H];
            let z: Vec<f32> = (0..r).map(|k| dot(&proj[k * H..(k + 1) * H], xt)).collect();
            for p in 0..N {
                let g = dot(&gate[p * H..(p + 1) * H], xt);
                let u = dot(&up[p * H..(p + 1) * H], xt);
                let is_active = (activate(Activation::Silu, g) * u).abs() > 0.05;
                let (ge, ue) = (dot(&pg[p * r..(p + 1) * r], &z), dot(&pu[p * r..(p + 1) * r], &z));
                let predicted = (activate(Activation::Silu, ge) * ue).abs() > 0.1;
                active += is_active as u64;
                read += predicted as u64;
                hit += (is_active && predicted) as u64;
            }
        }
        assert!(active > 0 && hit > 0 && read < (n_tok * N) as u64, "degenerate fixture");
        // Values near a threshold may round differently between candle's matmul and this loop.
        let near = |a: u64, b: u64| (a as i64 - b as i64).abs() <= 2;
        assert!(near(c.active, active), "active {} vs {active}", c.active);
        assert!(near(c.read, read), "read {} vs {read}", c.read);
        assert!(near(c.hit, hit), "hit {} vs {hit}", c.hit);
        assert_eq!(c.neurons, (n_tok * N) as u64);
        assert_eq!(c.computed, c.hit);
    }

    #[test]
    fn sparse_decode_with_nothing_skipped_is_bit_identical_to_dense() {
        let (gate, up, down_t) = (values(11, N * H), values(12, N * H), values(13, N * H));
        let (f, data) = layer(&gate, &up, &down_t);
        let ffn = Ffn::new(&f, Activation::Silu, None, None, None);
        let seg = SegmentClusters::new(&data, &[0]);
        let src = seg.view();
        let x = DotInput::from_slice(DType::F32, &values(14, H));
        let mut s = FfnScratch::default();
        let (mut dense, mut sparse) = (vec![0.5f32; H], vec![0.5f32; H]);
        ffn.forward_token(&src, &x, Selection::All, None, &mut s, &mut dense).unwrap();
        let all: Vec<u32> = (0..N as u32).collect();
        let n = ffn
            .forward_token(&src, &x, Selection::List(&all), Some((Criterion::GateUp, -1.0)), &mut s, &mut sparse)
            .unwrap();
        assert_eq!(n, N as u64);
        assert_eq!(dense, sparse);
        // A real threshold skips neurons and changes the result.
        let mut skipped = vec![0.5f32; H];
        let n = ffn
            .forward_token(&src, &x, Selection::List(&all), Some((Criterion::GateUp, 0.3)), &mut s, &mut skipped)
            .unwrap();
        assert!(n < N as u64);
        assert_ne!(dense, skipped);
    }

    #[test]
    fn decode_result_does_not_depend_on_the_thread_count() {
        let (gate, up, down_t) = (values(21, N * H), values(22, N * H), values(23, N * H));
        let (f, data) = layer(&gate, &up, &down_t);
        let ffn = Ffn::new(&f, Activation::Silu, None, None, None);
        let seg = SegmentClusters::new(&data, &[0]);
        let src = seg.view();
        let x = DotInput::from_slice(DType::F32, &values(24, H));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut out = vec![0f32; H];
                ffn.forward_token(&src, &x, Selection::All, None, &mut FfnScratch::default(), &mut out).unwrap();
                out
            })
        };
        let one = run(1);
        for t in [2, 3, 4] {
            assert_eq!(one, run(t), "{t} threads");
        }
    }
}
