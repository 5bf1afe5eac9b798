//! From a profile to a sparse pack's contents: per-layer activity thresholds,
//! hot-first neuron order, and calibrated predictors (SPEC §4.5).

use anyhow::{bail, Result};

use nflash_format::{Criterion, DType, LayerSparsity, PredictorKind, SparseInfo};

use crate::checkpoint::Checkpoint;
use crate::predictor::{build, keep_all, GateUp, PredictorOptions, MIN_PREDICTOR_SAMPLE};
use crate::profile::Profile;

/// Choices for `prep convert --calib`.
#[derive(Clone, Debug)]
pub struct SparseOptions {
    /// Target fraction of inactive neurons per layer, in [0, 1) (ignored by ReLU-family models).
    pub sparsity: f64,
    /// Activity criterion.
    pub criterion: Criterion,
    /// Predictor.
    pub predictor: PredictorKind,
    /// How the MLP predictor starts.
    pub init: crate::predictor::MlpInit,
    /// Predictor rank; `None`: from `budget`.
    pub rank: Option<usize>,
    /// Predictor size budget as a fraction of the layer's FFN bytes.
    pub budget: f64,
    /// Recall target on held-out calibration tokens.
    pub recall: f64,
    /// MLP training epochs.
    pub epochs: usize,
    /// MLP seed.
    pub seed: u64,
}

/// One layer's part of a [`SparsePlan`].
pub struct LayerPlan {
    /// `order[p]` = original neuron id at packed position `p` (hot first).
    pub order: Vec<u32>,
    /// Manifest entry (`predictor_bytes` is filled in by the packer).
    pub sparse: LayerSparsity,
    /// Predictor tensors `(suffix, shape, data)`, rows in original neuron order.
    pub tensors: Vec<(&'static str, Vec<usize>, Vec<f32>)>,
    /// MLP training record.
    pub training: Option<crate::predictor::Training>,
}

/// Everything the packer needs for a sparse pack.
pub struct SparsePlan {
    /// Manifest-wide settings.
    pub info: SparseInfo,
    /// Per FFN unit (layer, or expert of a layer).
    pub layers: Vec<LayerPlan>,
    /// Mixture of experts: the fraction of calibration tokens routed to each
    /// unit (`[units]`, SPEC §4.9 `experts.routed_share`); `None` when dense.
    pub routed_share: Option<Vec<f32>>,
}

/// Storage type of predictor matrices: Q8_0 for quantized packs (the Q8_0
/// input prepared for the FFN serves both), else the pack's type.
pub fn predictor_dtype(quant: DType) -> DType {
    match quant {
        DType::Q4_0 | DType::Q8_0 => DType::Q8_0,
        d => d,
    }
}

/// Rank r (a multiple of 32, at least 32, at most `hidden` rounded down to
/// 32) whose predictor takes about `budget` of the layer's FFN bytes.
pub fn rank_for_budget(kind: PredictorKind, budget: f64, hidden: usize, n: usize, quant: DType) -> usize {
    let pd = predictor_dtype(quant);
    let ffn = 3 * n as u64 * quant.row_bytes(hidden as u64).unwrap_or(4 * hidden as u64);
    let elem = pd.row_bytes(32).unwrap_or(128) as f64 / 32.0;
    let per_rank = match kind {
        PredictorKind::Exact => return 0,
        PredictorKind::LowRank => (hidden + 2 * n) as f64 * elem,
        PredictorKind::Mlp => (hidden + n) as f64 * elem + 4.0,
    };
    let r = (budget * ffn as f64 / per_rank) as usize / 32 * 32;
    r.clamp(32, (hidden / 32 * 32).max(32))
}

/// Thresholds, hot-first order and predictors for every layer.
///
/// # Errors
/// A profile of another model, checkpoint read failures, predictor training failures.
pub fn plan(ck: &Checkpoint, profile: &Profile, o: &SparseOptions, quant: DType) -> Result<SparsePlan> {
    let cfg = &ck.config;
    let (h, n) = (cfg.hidden_size as usize, cfg.intermediate_size as usize);
    let relu = cfg.activation.is_relu_family();
    let max_rank = (h / 32 * 32).max(32);
    if let Some(r) = o.rank.filter(|&r| r > max_rank) {
        bail!("--rank {r} is larger than the model allows: at most {max_rank} (hidden_size {h} rounded down to a multiple of 32)");
    }
    let rank = match o.predictor {
        PredictorKind::Exact => 0,
        k => o.rank.unwrap_or_else(|| rank_for_budget(k, o.budget, h, n, quant)),
    };
    let moe = cfg.architecture.moe().is_some();
    let pb = crate::progress::Progress::new(
        cfg.ffn_units(),
        if moe {
            "{msg:>10} [{elapsed_precise}] {wide_bar} {pos}/{len} experts eta {eta}"
        } else {
            "{msg:>10} [{elapsed_precise}] {wide_bar} {pos}/{len} layers eta {eta}"
        },
        "predictors",
    );
    pb.set_message(format!("{} r={rank}", o.predictor.name()));
    let mut layers = Vec::with_capacity(cfg.ffn_units() as usize);
    let mut natural = Vec::new();
    let mut few = Vec::new(); // experts with too few sampled tokens for a predictor
    for (l, lp) in profile.layers.iter().enumerate() {
        // ReLU family: active ⇔ act > 0, whatever the requested sparsity.
        let (t, s) = if relu {
            (0.0, lp.zero_fraction(o.criterion))
        } else if o.sparsity <= 0.0 {
            (-1.0, 0.0)
        } else {
            (lp.threshold(o.criterion, o.sparsity), o.sparsity)
        };
        natural.push(s);
        let freq = lp.frequency(o.criterion, s.clamp(0.0, 0.999));
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by(|&a, &b| freq[b as usize].total_cmp(&freq[a as usize]).then(a.cmp(&b)));
        let curve = (0..=32).map(|k| freq[order[(k * (n - 1) + 16) / 32] as usize]).collect();
        let p = format!("model.layers.{l}.mlp");
        let [gate_name, up_name, _] = cfg.ffn_tensor_names(l);
        let gate = ck.tensor_f32(&gate_name, &[n, h])?;
        let up = ck.tensor_f32(&up_name, &[n, h])?;
        let (gb, ub) = if cfg.mlp_bias {
            (
                Some(ck.tensor_f32(&format!("{p}.gate_proj.bias"), &[n])?),
                Some(ck.tensor_f32(&format!("{p}.up_proj.bias"), &[n])?),
            )
        } else {
            (None, None)
        };
        let w = GateUp { gate: &gate, up: &up, gate_bias: gb.as_deref(), up_bias: ub.as_deref(), n, hidden: h };
        let sample = profile.sample(l);
        let built = if moe && sample.len() / h < MIN_PREDICTOR_SAMPLE {
            // A rarely routed expert: decode reads all of it when it runs.
            few.push((cfg.unit_name(l), sample.len() / h));
            let sparsity = 1.0 - freq.iter().sum::<f32>() / n.max(1) as f32;
            keep_all(o.predictor, rank, n, h, sparsity)
        } else {
            build(
                &w,
                &sample,
                cfg.activation,
                t,
                &PredictorOptions {
                    kind: o.predictor,
                    rank,
                    recall: o.recall,
                    criterion: o.criterion,
                    epochs: o.epochs,
                    seed: o.seed.wrapping_add(l as u64),
                    init: o.init,
                },
            )?
        };
        layers.push(LayerPlan {
            order,
            sparse: LayerSparsity {
                threshold: t,
                predictor_threshold: built.threshold,
                predictor_bytes: 0,
                quality: built.quality,
                frequency_curve: curve,
            },
            tensors: built.tensors,
            training: built.training,
        });
        pb.inc(1);
    }
    pb.finish_and_clear();
    if !few.is_empty() {
        let names: Vec<String> = few.iter().take(8).map(|(u, s)| format!("{u} ({s})")).collect();
        nflash_runtime::message!(
            "{} expert(s) got fewer than {MIN_PREDICTOR_SAMPLE} of the sampled calibration tokens, too few to train a predictor (layer.expert (sampled tokens)): {}{}; decode reads every neuron of those when the router picks them (calibrate on more tokens, --tokens and --sample, to train them)",
            few.len(),
            names.join(", "),
            if few.len() > 8 { ", …" } else { "" }
        );
    }
    // The mean over units weighted by the tokens each ran (an expert that got
    // no calibration token says nothing about the model's sparsity).
    let weights: Vec<f64> = profile.layers.iter().map(|l| l.n_tokens() as f64).collect();
    let total: f64 = weights.iter().sum();
    let target = if relu && total > 0.0 {
        natural.iter().zip(&weights).map(|(s, w)| s * w).sum::<f64>() / total
    } else if relu {
        0.0
    } else {
        o.sparsity
    };
    Ok(SparsePlan {
        info: SparseInfo {
            criterion: o.criterion,
            predictor: o.predictor,
            rank: rank as u32,
            target_sparsity: target as f32,
            recall_target: o.recall as f32,
            calib_tokens: profile.calib.n_tokens,
            calib_source: profile.calib.source.clone(),
        },
        layers,
        routed_share: moe.then(|| profile.routed_share()),
    })
}
