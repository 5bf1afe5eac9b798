//! CPU: the runtime's own kernels over decode-sized working sets — the Q4_0
//! matrix-vector product, the attention block, the sparse FFN and the Q8_0
//! predictor — in GB/s of weight bytes.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::quantized::k_quants::{BlockQ4_0, GgmlType};
use nflash_format::{Activation, BundleLayout, DType, FfnLayer, NeuronCluster};
use nflash_runtime::kernels::{quantize_row, DotInput, QMatrix};
use nflash_runtime::model::ffn::{Ffn, FfnScratch, Selection};
use nflash_runtime::model::SegmentClusters;
use nflash_runtime::offload::slots::AlignedBuf;

use super::SplitMix;

/// A random `rows × cols` Q4_0 matrix (`cols` a multiple of 32).
pub(super) fn q4_0_matrix(rows: usize, cols: usize) -> Result<QMatrixOwned> {
    let per_row = cols / BlockQ4_0::BLCK_SIZE * std::mem::size_of::<BlockQ4_0>();
    let mut bytes = AlignedBuf::zeroed(rows * per_row, "the probe's Q4_0 matrix")?;
    let mut rng = SplitMix(0x0A4);
    let (mut row, mut q) = (vec![0f32; cols], Vec::with_capacity(per_row));
    for out in bytes.as_mut_slice().chunks_exact_mut(per_row) {
        row.iter_mut().for_each(|v| *v = rng.next_f32());
        q.clear();
        quantize_row(DType::Q4_0, &row, &mut q);
        out.copy_from_slice(&q);
    }
    Ok(QMatrixOwned { bytes, rows, cols, interleaved: false })
}

/// Owned Q4_0 rows viewed as a [`QMatrix`].
pub(super) struct QMatrixOwned {
    /// `rows × cols / 32` Q4_0 blocks, aligned.
    bytes: AlignedBuf,
    rows: usize,
    cols: usize,
    /// In the ×8 layout (`nflash_format::interleave`).
    interleaved: bool,
}

impl QMatrixOwned {
    /// Reorders the blocks to the ×8 layout (rows a multiple of 8).
    pub(super) fn interleave(&mut self) {
        nflash_format::interleave::interleave(DType::Q4_0, self.bytes.as_mut_slice(), self.cols, &mut Vec::new());
        self.interleaved = true;
    }

    fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    fn view(&self) -> QMatrix<'_> {
        if self.interleaved {
            return QMatrix::x8(DType::Q4_0, self.rows, self.cols, self.bytes());
        }
        QMatrix::new(DType::Q4_0, self.rows, self.cols, self.bytes())
    }
}

/// Q4_0 matrix-vector speed on the current rayon pool, GB/s of weight bytes
/// ([`median_gb_s`] of `matvec`).
pub(super) fn matvec_speed(m: &QMatrixOwned, x: &[f32], run_secs: f64) -> Result<f64> {
    let mat = m.view();
    let input = DotInput::from_slice(DType::Q4_0, x);
    let mut out = vec![0f32; mat.rows];
    median_gb_s(1, run_secs, || {
        mat.matvec(&input, &mut out);
        std::hint::black_box(&out);
        Ok(m.bytes().len() as u64)
    })
}

/// Decode attention projection speed on the current rayon pool, GB/s of
/// weight bytes: `m`'s rows cut into layers of four square `[cols, cols]`
/// matrices, each layer run as decode runs it (Q, K and V in one parallel
/// region, the O projection of the quantized Q output in another); what
/// the matvec figure leaves out is the per-layer fork–join and the smaller
/// matrices ([`median_gb_s`]).
pub(super) fn attention_speed(m: &QMatrixOwned, x: &[f32], run_secs: f64) -> Result<f64> {
    let cols = m.cols;
    let bytes = m.bytes();
    // [rows, cols] per projection: square, or a quarter of `m` if it is smaller (--quick).
    let rows = cols.min(m.rows / 4) / 8 * 8;
    let sq = bytes.len() / m.rows * rows; // bytes of one projection
    let n_layers = m.rows / (4 * rows);
    let view = |i: usize| {
        let b = &bytes[i * sq..(i + 1) * sq];
        if m.interleaved {
            QMatrix::x8(DType::Q4_0, rows, cols, b)
        } else {
            QMatrix::new(DType::Q4_0, rows, cols, b)
        }
    };
    let layers: Vec<[QMatrix; 4]> =
        (0..n_layers).map(|l| [view(4 * l), view(4 * l + 1), view(4 * l + 2), view(4 * l + 3)]).collect();
    let xin = DotInput::from_slice(DType::Q4_0, x);
    let mut attn_in = DotInput::new(DType::Q4_0);
    let (mut q, mut k, mut v, mut o) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
    let mut q_full = vec![0f32; cols]; // O's input: Q's output, zero-padded when rows < cols
    median_gb_s(1, run_secs, || {
        for [wq, wk, wv, wo] in &layers {
            nflash_runtime::kernels::matvec_many(&[wq, wk, wv], &xin, &mut [&mut q, &mut k, &mut v]);
            q_full[..rows].copy_from_slice(&q);
            attn_in.set(&q_full);
            wo.matvec(&attn_in, &mut o);
        }
        std::hint::black_box((&k, &v, &o));
        Ok((n_layers * 4 * sq) as u64)
    })
}

/// GB/s of the bytes each call of `pass` returns: `warmup` calls, then the
/// median of 7 runs, each repeating `pass` for at least `run_secs`.
///
/// # Errors
/// The first error `pass` returns.
fn median_gb_s(warmup: usize, run_secs: f64, mut pass: impl FnMut() -> Result<u64>) -> Result<f64> {
    for _ in 0..warmup {
        pass()?;
    }
    let mut speeds = Vec::with_capacity(7);
    for _ in 0..7 {
        let t = Instant::now();
        let mut bytes = 0u64;
        let mut reps = 0u64;
        while reps == 0 || t.elapsed().as_secs_f64() < run_secs {
            bytes += pass()?;
            reps += 1;
        }
        speeds.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    speeds.sort_by(f64::total_cmp);
    Ok(speeds[speeds.len() / 2])
}

/// One predictor layer as decode runs it (`LayerSparse`, MLP kind): a
/// Q8_0 projection `[256, cols]`, then gate and up factors `[cols, 256]`.
pub(super) struct PredictorLayer {
    proj: Vec<u8>,
    gate: Vec<u8>,
    up: Vec<u8>,
}

/// `n` predictor layers of random Q8_0 weights for hidden size `cols`.
pub(super) fn predictor_layers(n: usize, cols: usize) -> Vec<PredictorLayer> {
    const R: usize = 256;
    let mut rng = SplitMix(0x9D);
    let mut mat = |rows: usize, width: usize| {
        let mut bytes = Vec::new();
        let mut row = vec![0f32; width];
        for _ in 0..rows {
            row.iter_mut().for_each(|v| *v = rng.next_f32());
            nflash_runtime::kernels::quantize_row(DType::Q8_0, &row, &mut bytes);
        }
        bytes
    };
    (0..n).map(|_| PredictorLayer { proj: mat(R, cols), gate: mat(cols, R), up: mat(cols, R) }).collect()
}

/// Predictor speed on the current rayon pool, GB/s of predictor weight
/// bytes: every layer's projection of `x`, then its gate and up factors in
/// one parallel region, as `LayerSparse::predict_token` does ([`median_gb_s`]).
pub(super) fn predictor_speed(layers: &[PredictorLayer], x: &[f32], run_secs: f64) -> Result<f64> {
    const R: usize = 256;
    let cols = x.len();
    let xin = DotInput::from_slice(DType::Q8_0, x);
    let mut zin = DotInput::new(DType::Q8_0);
    let (mut z, mut g, mut u) = (vec![0f32; R], vec![0f32; cols], vec![0f32; cols]);
    let bytes: usize = layers.iter().map(|l| l.proj.len() + l.gate.len() + l.up.len()).sum();
    median_gb_s(1, run_secs, || {
        for l in layers {
            QMatrix::new(DType::Q8_0, R, cols, &l.proj).matvec(&xin, &mut z);
            zin.set(&z);
            let (gm, um) = (QMatrix::new(DType::Q8_0, cols, R, &l.gate), QMatrix::new(DType::Q8_0, cols, R, &l.up));
            nflash_runtime::kernels::matvec_many(&[&gm, &um], &zin, &mut [&mut g, &mut u]);
        }
        std::hint::black_box((&g, &u));
        Ok(bytes as u64)
    })
}

/// Sparse FFN decode speed of the runtime's neuron engine
/// ([`Ffn::forward_token`]) on the current rayon pool, GB/s of selected
/// bundle bytes. `bundles`' bytes are read as Q4_0 bundles (gate row, up
/// row, down column of `x.len()` elements each, SPEC §4.4), one neuron per
/// cluster, cut into layers of `layer_neurons`; each layer's neurons are
/// dealt at random into 8 disjoint selections (1/8 ≈ 12% selected, as
/// decode at sparsity 0.9). A pass runs one selection of every layer, one
/// `forward_token` call per layer as decode does, the next pass the next
/// selection, so a selection's bundles have left the caches when it comes
/// round again. Median of 7 runs of at least `run_secs`.
///
/// # Errors
/// If the engine refuses the layout (a bug: the layout is built here).
pub(super) fn ffn_speed(bundles: &QMatrixOwned, layer_neurons: usize, x: &[f32], run_secs: f64) -> Result<f64> {
    let cols = x.len();
    let n = bundles.rows / 3;
    let layer_neurons = layer_neurons.clamp(1, n.max(1));
    let layout =
        BundleLayout::new(DType::Q4_0, cols as u64).context("FFN probe: hidden size does not fit Q4_0 blocks")?;
    let bb = layout.bundle_bytes;
    let layer = FfnLayer {
        layer: 0,
        segment: 0,
        n_neurons: n as u32,
        bundle: layout,
        cluster_align: 1,
        clusters: (0..n as u32).map(|i| NeuronCluster { offset: i as u64 * bb, first: i, n_neurons: 1 }).collect(),
        order: (0..n as u32).collect(),
        sparse: None,
    };
    let offsets: Vec<u64> = layer.clusters.iter().map(|c| c.offset).collect();
    let seg = SegmentClusters::new(bundles.bytes(), &offsets);
    let src = seg.view();
    let ffn = Ffn::new(&layer, Activation::Relu, None, None, None);
    // groups[g][layer]: selection g of each layer, ascending packed positions.
    let n_layers = n / layer_neurons;
    let mut groups: Vec<Vec<Vec<u32>>> = vec![vec![Vec::new(); n_layers]; 8];
    let mut rng = SplitMix(0xFF);
    for p in 0..(n_layers * layer_neurons) as u32 {
        groups[(rng.next() % 8) as usize][p as usize / layer_neurons].push(p);
    }
    let input = DotInput::from_slice(DType::Q4_0, x);
    let mut scratch = FfnScratch::default();
    let mut out = vec![0f32; cols];
    let mut k = 0usize;
    // Eight warm-up passes: every selection once.
    median_gb_s(8, run_secs, || {
        let sels = &groups[k % groups.len()];
        k += 1;
        let mut bytes = 0u64;
        for sel in sels {
            ffn.forward_token(&src, &input, Selection::List(sel), None, &mut scratch, &mut out)?;
            bytes += sel.len() as u64 * bb;
        }
        std::hint::black_box(&out);
        Ok(bytes)
    })
}
