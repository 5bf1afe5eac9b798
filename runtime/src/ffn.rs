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

/// Element `p` of an optional bias vector (0 without bias).
#[inline]
fn bias(b: &Option<Vec<f32>>, p: usize) -> f32 {
    b.as_ref().map_or(0.0, |b| b[p])
}

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

    /// `out += FFN(x)` for one token (decode), over every neuron.
    /// `x`: the normed input prepared for the bundle dtype; `out`: `[hidden]`.
    /// Clusters are split across the rayon pool; each task accumulates into
    /// its own `[hidden]` buffer, summed at the end.
    pub fn forward_token(&self, x: &DotInput, out: &mut [f32]) {
        let h = self.hidden;
        let dt = self.layout.dtype;
        let act = self.act;
        let min_len = self.clusters.len().div_ceil(2 * rayon::current_num_threads());
        let acc = self
            .clusters
            .par_iter()
            .with_min_len(min_len.max(1))
            .fold(
                || vec![0f32; h],
                |mut acc, c| {
                    let n = c.n_neurons as usize;
                    let mut i = 0;
                    if let DotInput::Q8(y) = x {
                        // Two neurons per pass: gate and up rows of both in one 4-row kernel.
                        while i + 1 < n {
                            let (g0, u0, d0) = self.bundle(c, i);
                            let (g1, u1, d1) = self.bundle(c, i + 1);
                            let [g0v, u0v, g1v, u1v] = crate::simd::dot4(dt, h, [g0, u0, g1, u1], y);
                            let p = c.first as usize + i;
                            let a0 = activate(act, g0v + bias(&self.gate_bias, p)) * (u0v + bias(&self.up_bias, p));
                            let a1 = activate(act, g1v + bias(&self.gate_bias, p + 1)) * (u1v + bias(&self.up_bias, p + 1));
                            crate::simd::axpy2(dt, [d0, d1], [a0, a1], &mut acc);
                            i += 2;
                        }
                    }
                    for i in i..n {
                        let p = c.first as usize + i;
                        let (g_row, u_row, d_row) = self.bundle(c, i);
                        let g = row_dot(dt, h, g_row, x) + bias(&self.gate_bias, p);
                        let u = row_dot(dt, h, u_row, x) + bias(&self.up_bias, p);
                        axpy_row(dt, d_row, activate(act, g) * u, &mut acc);
                    }
                    acc
                },
            )
            .reduce(
                || vec![0f32; h],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                    a
                },
            );
        for (j, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
            *o += a + bias(&self.down_bias, j);
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
                    let (bg, bu) = (bias(&self.gate_bias, p0 + j), bias(&self.up_bias, p0 + j));
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
                *v += a + bias(&self.down_bias, j);
            }
        }
        Ok(())
    }

    /// Storage type of the bundles (inputs must be prepared for it).
    pub fn dtype(&self) -> nflash_format::DType {
        self.layout.dtype
    }
}
