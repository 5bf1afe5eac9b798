//! The FFN neuron engine over neuron clusters (PowerInfer-2 §4; SPEC §4.4).
//!
//! Each neuron is a bundle: gate row | up row | down column, `hidden`
//! elements each. For a token x, neuron i contributes
//! `act(gate_i · x + bg_i) * (up_i · x + bu_i) * down_i` to the output.
//! This issue computes every neuron (dense); sparse decode skips neurons.

use nflash_format::{Activation, BundleLayout, FfnLayer, NeuronCluster};
use rayon::prelude::*;

use crate::ops::activate;
use crate::weights::{axpy_row, row_dot, row_to_f32, DotInput};

/// One layer's FFN, as views of its neuron clusters.
pub struct Ffn<'a> {
    act: Activation,
    hidden: usize,
    layout: BundleLayout,
    /// The layer's FFN segment.
    data: &'a [u8],
    clusters: Vec<NeuronCluster>,
    /// Gate bias in packed neuron order `[n_neurons]`.
    gate_bias: Option<Vec<f32>>,
    /// Up bias in packed neuron order `[n_neurons]`.
    up_bias: Option<Vec<f32>>,
    /// Down bias `[hidden]`.
    down_bias: Option<Vec<f32>>,
}

impl<'a> Ffn<'a> {
    /// Views layer `f` whose segment bytes are `data` (validated by `Pack::open`).
    /// Biases, when the model has them, are given in packed neuron order.
    pub fn new(
        f: &FfnLayer,
        data: &'a [u8],
        act: Activation,
        gate_bias: Option<Vec<f32>>,
        up_bias: Option<Vec<f32>>,
        down_bias: Option<Vec<f32>>,
    ) -> Self {
        Ffn {
            act,
            hidden: f.bundle.row_elems as usize,
            layout: f.bundle,
            data,
            clusters: f.clusters.clone(),
            gate_bias,
            up_bias,
            down_bias,
        }
    }

    /// Bundle bytes of the neuron at packed position `first + i` of cluster `c`.
    #[inline]
    fn bundle(&self, c: &NeuronCluster, i: usize) -> (&'a [u8], &'a [u8], &'a [u8]) {
        let rb = self.layout.row_bytes as usize;
        let start = c.offset as usize + i * self.layout.bundle_bytes as usize;
        let b = &self.data[start..start + 3 * rb];
        (&b[..rb], &b[rb..2 * rb], &b[2 * rb..])
    }

    /// `out[t] += FFN(xs[t])` for `n = xs.len()` tokens, over every neuron.
    /// `xs`: inputs prepared for the bundle dtype; `out`: `[n, hidden]`.
    pub fn forward_dense(&self, xs: &[DotInput], out: &mut [f32]) {
        let n = xs.len();
        let h = self.hidden;
        let dt = self.layout.dtype;
        debug_assert_eq!(out.len(), n * h);
        let min_len = self.clusters.len().div_ceil(2 * rayon::current_num_threads());
        let acc = self
            .clusters
            .par_iter()
            .with_min_len(min_len.max(1))
            .fold(
                || (vec![0f32; n * h], vec![0f32; h], vec![0f32; n]),
                |(mut acc, mut down, mut a), c| {
                    for i in 0..c.n_neurons as usize {
                        let p = c.first as usize + i;
                        let (g_row, u_row, d_row) = self.bundle(c, i);
                        let bg = self.gate_bias.as_ref().map_or(0.0, |b| b[p]);
                        let bu = self.up_bias.as_ref().map_or(0.0, |b| b[p]);
                        for (t, x) in xs.iter().enumerate() {
                            let g = row_dot(dt, h, g_row, x) + bg;
                            let u = row_dot(dt, h, u_row, x) + bu;
                            a[t] = activate(self.act, g) * u;
                        }
                        if n == 1 {
                            axpy_row(dt, d_row, a[0], &mut acc);
                        } else {
                            row_to_f32(dt, d_row, &mut down);
                            for (t, &at) in a.iter().enumerate() {
                                if at != 0.0 {
                                    let o = &mut acc[t * h..(t + 1) * h];
                                    for (o, w) in o.iter_mut().zip(&down) {
                                        *o += at * w;
                                    }
                                }
                            }
                        }
                    }
                    (acc, down, a)
                },
            )
            .map(|(acc, _, _)| acc)
            .reduce(
                || vec![0f32; n * h],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                    a
                },
            );
        for (t, o) in out.chunks_exact_mut(h).enumerate() {
            for (j, v) in o.iter_mut().enumerate() {
                *v += acc[t * h + j] + self.down_bias.as_ref().map_or(0.0, |b| b[j]);
            }
        }
    }
}

impl Ffn<'_> {
    /// `out[t] += FFN(x[t])` for a batch (prefill): `x` `[n, hidden]` (normed,
    /// f32), `out` `[n, hidden]`. Neuron clusters are dequantized a tile at a
    /// time and multiplied with candle-core's matmul: `A = act(X·Gᵀ)∘(X·Uᵀ)`,
    /// `out += A·D`, where the tile's rows of G, U, D are its bundles.
    pub fn forward_batch(&self, x: &[f32], out: &mut [f32]) -> crate::error::Result<()> {
        let h = self.hidden;
        let n = x.len() / h;
        let dt = self.layout.dtype;
        let xt = crate::matmul::input(x, n, h)?;
        let tile = (crate::matmul::TILE_ELEMS / h).max(1);
        let mut group: Vec<&NeuronCluster> = Vec::new();
        let mut acc = vec![0f32; n * h];
        let mut flush = |group: &mut Vec<&NeuronCluster>| -> crate::error::Result<()> {
            if group.is_empty() {
                return Ok(());
            }
            let p0 = group[0].first as usize;
            let m: usize = group.iter().map(|c| c.n_neurons as usize).sum();
            let idx: Vec<(&NeuronCluster, usize)> = group
                .iter()
                .flat_map(|c| (0..c.n_neurons as usize).map(move |i| (*c, i)))
                .collect();
            let (mut wg, mut wu, mut wd) = (vec![0f32; m * h], vec![0f32; m * h], vec![0f32; m * h]);
            wg.par_chunks_mut(h)
                .zip(wu.par_chunks_mut(h))
                .zip(wd.par_chunks_mut(h))
                .zip(idx.par_iter())
                .for_each(|(((g, u), d), (c, i))| {
                    let (gr, ur, dr) = self.bundle(c, *i);
                    row_to_f32(dt, gr, g);
                    row_to_f32(dt, ur, u);
                    row_to_f32(dt, dr, d);
                });
            let g = crate::matmul::matmul_xwt(&xt, wg, m, h)?; // [n, m]
            let u = crate::matmul::matmul_xwt(&xt, wu, m, h)?; // [n, m]
            let mut a = g;
            for (row_a, row_u) in a.chunks_exact_mut(m).zip(u.chunks_exact(m)) {
                for (j, (av, uv)) in row_a.iter_mut().zip(row_u).enumerate() {
                    let bg = self.gate_bias.as_ref().map_or(0.0, |b| b[p0 + j]);
                    let bu = self.up_bias.as_ref().map_or(0.0, |b| b[p0 + j]);
                    *av = activate(self.act, *av + bg) * (uv + bu);
                }
            }
            let y = crate::matmul::matmul_aw(a, n, wd, m, h)?; // [n, hidden]
            acc.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
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
                *v += a + self.down_bias.as_ref().map_or(0.0, |b| b[j]);
            }
        }
        Ok(())
    }

    /// Storage type of the bundles (inputs must be prepared for it).
    pub fn dtype(&self) -> nflash_format::DType {
        self.layout.dtype
    }
}
