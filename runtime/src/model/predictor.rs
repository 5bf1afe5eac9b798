//! Activation sparsity at decode: which FFN neurons are active, and the
//! predictors that guess them before their gate and up rows are read
//! (PowerInfer-2 §4.1, Deja Vu; SPEC §4.5).
//!
//! A neuron at packed position `p` is *active* for input `x` when its
//! criterion value exceeds the layer threshold `t`:
//! - [`Criterion::Gate`]: `|act(gate_p · x)| > t`;
//! - [`Criterion::GateUp`]: `|act(gate_p · x) · (up_p · x)| > t`.
//!
//! A *predictor* chooses the neurons whose bundles are read and computed;
//! only those that are also active get a down-projection.

use nflash_format::{Activation, Criterion, DType, LayerSparsity, Pack, PredictorKind};

use super::ops::{activate, neuron_output};
use super::tensors::{matrix, vector};
use crate::error::Result;
use crate::kernels::{DotInput, QMatrix};

/// Criterion value of one neuron from its gate and up pre-activations.
#[inline]
pub fn criterion_value(c: Criterion, act: Activation, g: f32, u: f32) -> f32 {
    match c {
        Criterion::Gate => activate(act, g).abs(),
        Criterion::GateUp => neuron_output(act, g, u).abs(),
    }
}

/// A layer's predictor weights, views into the pack's resident segment.
pub enum Predictor<'a> {
    /// Every neuron is read and computed.
    Exact,
    /// `z = proj·x` `[r]`; estimates `ĝ = gate·z`, `û = up·z` `[n_neurons]`;
    /// score = criterion value of (ĝ, û).
    LowRank {
        proj: QMatrix<'a>, // [r, hidden]
        gate: QMatrix<'a>, // [n_neurons, r]
        up: QMatrix<'a>,   // [n_neurons, r]
    },
    /// `z = relu(w1·x + b1)` `[r]`; score = `w2·z + b2` `[n_neurons]` (a logit).
    Mlp {
        w1: QMatrix<'a>, // [r, hidden]
        b1: Vec<f32>,    // [r]
        w2: QMatrix<'a>, // [n_neurons, r]
        b2: Vec<f32>,    // [n_neurons]
    },
}

/// One layer's sparse-decode settings.
pub struct LayerSparse<'a> {
    /// Activity criterion.
    pub criterion: Criterion,
    /// Active iff criterion value `> threshold`.
    pub threshold: f32,
    /// Predicted iff score `> predictor_threshold`.
    pub predictor_threshold: f32,
    /// Predictor weights.
    pub predictor: Predictor<'a>,
}

/// Scratch for decode-time prediction, reused across tokens and layers.
#[derive(Default)]
pub struct PredictScratch {
    /// `[r]`: the predictor's hidden vector.
    z: Vec<f32>,
    /// `z` prepared for the second matrix.
    z_in: Option<DotInput>,
    /// `[n_neurons]`: scores (or ĝ for low-rank).
    scores: Vec<f32>,
    /// `[n_neurons]`: û for low-rank.
    up: Vec<f32>,
}

/// Rows of tensor `name` (the predictor rank for `proj` / `w1`); 0 if absent (then `matrix` reports it).
fn rows(pack: &Pack, name: &str) -> u64 {
    pack.tensor(name).map(|(t, _)| t.shape.first().copied().unwrap_or(0)).unwrap_or(0)
}

impl<'a> LayerSparse<'a> {
    /// Loads FFN unit `l`'s settings and predictor tensors (`nflash.predictor.{l}.*`,
    /// of an expert `nflash.predictor.{layer}.{expert}.*`; SPEC §4.5).
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Shape`] (the rank must agree between tensors).
    pub fn load(
        pack: &'a Pack,
        l: usize,
        kind: PredictorKind,
        criterion: Criterion,
        s: &LayerSparsity,
    ) -> Result<Self> {
        let cfg = &pack.manifest().config;
        let (h, n) = (cfg.hidden_size, cfg.intermediate_size);
        let unit = cfg.unit_name(l);
        let name = |t: &str| format!("nflash.predictor.{unit}.{t}");
        let predictor = match kind {
            PredictorKind::Exact => Predictor::Exact,
            PredictorKind::LowRank => {
                let r = rows(pack, &name("proj"));
                let proj = matrix(pack, &name("proj"), r, h)?;
                Predictor::LowRank {
                    proj,
                    gate: matrix(pack, &name("gate"), n, r)?,
                    up: matrix(pack, &name("up"), n, r)?,
                }
            }
            PredictorKind::Mlp => {
                let r = rows(pack, &name("w1"));
                Predictor::Mlp {
                    w1: matrix(pack, &name("w1"), r, h)?,
                    b1: vector(pack, &name("b1"), r)?,
                    w2: matrix(pack, &name("w2"), n, r)?,
                    b2: vector(pack, &name("b2"), n)?,
                }
            }
        };
        Ok(LayerSparse { criterion, threshold: s.threshold, predictor_threshold: s.predictor_threshold, predictor })
    }

    /// Decode: appends to `list` the packed positions the predictor selects
    /// for one token (`x`: the FFN input prepared for the predictor's first
    /// matrix). Returns `false` for the exact predictor (every neuron; `list`
    /// untouched). No allocation once `s` has grown to size.
    pub fn predict_token(
        &self,
        act: Activation,
        x: &DotInput,
        x_f32: &[f32],
        s: &mut PredictScratch,
        list: &mut Vec<u32>,
    ) -> bool {
        self.predict_token_from(act, x, x_f32, 0, s, list)
    }

    /// [`Self::predict_token`] over the packed positions `first ..` only
    /// (rounded down to a multiple of 8): speculative prefetch needs no scores
    /// for the hot neurons, which are always in memory.
    pub fn predict_token_from(
        &self,
        act: Activation,
        x: &DotInput,
        x_f32: &[f32],
        first: usize,
        s: &mut PredictScratch,
        list: &mut Vec<u32>,
    ) -> bool {
        list.clear();
        let tau = self.predictor_threshold;
        let first = first / 8 * 8;
        match &self.predictor {
            Predictor::Exact => return false,
            Predictor::LowRank { proj, gate, up } => {
                s.z.resize(proj.rows, 0.0);
                proj_matvec(proj, x, x_f32, &mut s.z);
                let z_in = s.z_in.get_or_insert_with(|| DotInput::new(gate.dtype));
                z_in.set(&s.z);
                let first = first.min(gate.rows / 8 * 8);
                s.scores.resize(gate.rows - first, 0.0);
                s.up.resize(up.rows - first, 0.0);
                crate::kernels::matvec_many_from(&[gate, up], first, z_in, &mut [&mut s.scores, &mut s.up]);
                for (p, (&g, &u)) in s.scores.iter().zip(&s.up).enumerate() {
                    if criterion_value(self.criterion, act, g, u) > tau {
                        list.push((first + p) as u32);
                    }
                }
            }
            Predictor::Mlp { w1, b1, w2, b2 } => {
                s.z.resize(w1.rows, 0.0);
                proj_matvec(w1, x, x_f32, &mut s.z);
                s.z.iter_mut().zip(b1).for_each(|(z, b)| *z = (*z + b).max(0.0));
                let z_in = s.z_in.get_or_insert_with(|| DotInput::new(w2.dtype));
                z_in.set(&s.z);
                let first = first.min(w2.rows / 8 * 8);
                s.scores.resize(w2.rows - first, 0.0);
                crate::kernels::matvec_many_from(&[w2], first, z_in, &mut [&mut s.scores]);
                for (p, (&v, &b)) in s.scores.iter().zip(&b2[first..]).enumerate() {
                    if v + b > tau {
                        list.push((first + p) as u32);
                    }
                }
            }
        }
        true
    }

    /// Evaluation (batched): `[n, n_neurons]` flags, 1 where the predictor
    /// selects the neuron for token `t`; `x`: `[n, hidden]` f32. `None` for exact.
    ///
    /// # Errors
    /// candle-core matmul failures.
    pub fn predict_batch(&self, act: Activation, x: &[f32], hidden: usize) -> Result<Option<Vec<bool>>> {
        let n = x.len() / hidden;
        let tau = self.predictor_threshold;
        Ok(Some(match &self.predictor {
            Predictor::Exact => return Ok(None),
            Predictor::LowRank { proj, gate, up } => {
                let mut z = vec![0f32; n * proj.rows];
                proj.matmul_f32(x, &mut z);
                let mut g = vec![0f32; n * gate.rows];
                let mut u = vec![0f32; n * up.rows];
                gate.matmul_f32(&z, &mut g);
                up.matmul_f32(&z, &mut u);
                g.iter().zip(&u).map(|(&g, &u)| criterion_value(self.criterion, act, g, u) > tau).collect()
            }
            Predictor::Mlp { w1, b1, w2, b2 } => {
                let mut z = vec![0f32; n * w1.rows];
                w1.matmul_f32(x, &mut z);
                for row in z.chunks_exact_mut(w1.rows) {
                    row.iter_mut().zip(b1).for_each(|(z, b)| *z = (*z + b).max(0.0));
                }
                let mut s = vec![0f32; n * w2.rows];
                w2.matmul_f32(&z, &mut s);
                s.chunks_exact(w2.rows).flat_map(|row| row.iter().zip(b2).map(|(&v, &b)| v + b > tau)).collect()
            }
        }))
    }
}

/// `out = m · x`, using the prepared input when its kind matches `m`'s dtype,
/// else preparing `x_f32` on the fly (predictor and FFN stored in different types).
fn proj_matvec(m: &QMatrix, x: &DotInput, x_f32: &[f32], out: &mut [f32]) {
    let compatible = matches!(
        (m.dtype, x),
        (DType::Q8_0 | DType::Q4_0, DotInput::Q8(_)) | (DType::F16, DotInput::F16(_)) | (DType::F32, DotInput::F32(_))
    );
    if compatible {
        m.matvec(x, out);
    } else {
        m.matvec(&DotInput::from_slice(m.dtype, x_f32), out);
    }
}

/// Per-layer counters of sparse FFN work, summed over tokens.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LayerCounts {
    /// (token, neuron) pairs seen.
    pub neurons: u64,
    /// Pairs whose bundle was read and gate/up computed (predicted).
    pub read: u64,
    /// Pairs whose down projection was computed (predicted and active).
    pub computed: u64,
    /// Truly active pairs (known only in batched evaluation).
    pub active: u64,
    /// Truly active pairs that were predicted (batched evaluation).
    pub hit: u64,
    /// Verify passes (speculative decoding) of a dense layer: neuron
    /// clusters each token needed, summed over the pass's tokens.
    pub verify_needed: u64,
    /// The same passes' union of those clusters: what the pass fetches
    /// (`verify_union / verify_needed` is the share a pass does not repeat).
    pub verify_union: u64,
}

impl LayerCounts {
    /// Fraction of neurons whose down projection was skipped.
    pub fn ffn_sparsity(&self) -> f64 {
        1.0 - self.computed as f64 / self.neurons.max(1) as f64
    }
    /// Fraction of neuron bundles neither read nor computed.
    pub fn bundles_skipped(&self) -> f64 {
        1.0 - self.read as f64 / self.neurons.max(1) as f64
    }
    /// Fraction of truly active neurons predicted; `None` when not measured.
    pub fn recall(&self) -> Option<f64> {
        (self.active > 0).then(|| self.hit as f64 / self.active as f64)
    }
    /// Adds `o` to `self`.
    pub fn add(&mut self, o: &LayerCounts) {
        self.neurons += o.neurons;
        self.read += o.read;
        self.computed += o.computed;
        self.active += o.active;
        self.hit += o.hit;
        self.verify_needed += o.verify_needed;
        self.verify_union += o.verify_union;
    }
}

/// Layer means of [`LayerCounts`] fractions (what `nflash ppl` and `--stats` report).
#[derive(Debug, Clone, PartialEq)]
pub struct SparsitySummary {
    /// Mean over layers of the fraction of neurons whose down projection was skipped.
    pub ffn_sparsity: f64,
    /// Mean over layers of the fraction of neuron bundles neither read nor computed.
    pub bundles_skipped: f64,
    /// Mean over layers of predictor recall, when measured (batched evaluation).
    pub recall: Option<f64>,
    /// Per-layer `(ffn_sparsity, bundles_skipped, recall)`.
    pub layers: Vec<(f64, f64, Option<f64>)>,
}

impl SparsitySummary {
    /// Summarizes per-layer counters; `None` if nothing was counted.
    pub fn new(counts: &[LayerCounts]) -> Option<Self> {
        if counts.is_empty() || counts.iter().all(|c| c.neurons == 0) {
            return None;
        }
        let layers: Vec<_> = counts.iter().map(|c| (c.ffn_sparsity(), c.bundles_skipped(), c.recall())).collect();
        let n = layers.len() as f64;
        let recalls: Vec<f64> = layers.iter().filter_map(|l| l.2).collect();
        Some(SparsitySummary {
            ffn_sparsity: layers.iter().map(|l| l.0).sum::<f64>() / n,
            bundles_skipped: layers.iter().map(|l| l.1).sum::<f64>() / n,
            recall: (!recalls.is_empty()).then(|| recalls.iter().sum::<f64>() / recalls.len() as f64),
            layers,
        })
    }
}
