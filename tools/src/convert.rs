//! `prep convert`: Hugging Face checkpoint → `.nflash` pack.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use nflash_format::{Criterion, DType, PredictorKind};

use crate::checkpoint::Checkpoint;
use crate::pack::{check_tensors, write_pack, PackOptions};
use crate::predictor::MlpInit;
use crate::profile::{CalibArgs, Profile};
use crate::sparsify::{self, SparseOptions, SparsePlan};
use nflash_runtime::message;

/// Arguments of `prep convert`.
#[derive(Args)]
pub struct ConvertArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json),
    /// or a GGUF file (a split one's first part, or a directory holding one).
    #[arg(long)]
    model: PathBuf,
    /// Output .nflash file (written to a temporary file, then renamed).
    #[arg(long)]
    out: PathBuf,
    /// Weight type: q4_0, q8_0 (GGML-compatible blocks), f16 or f32
    /// [default: q4_0; for a GGUF: its own type if Q8_0 or Q4_0 (blocks copied), q8_0 for Q4_1/Q5_x/K-quants].
    #[arg(long)]
    quant: Option<DType>,
    /// Target size of one neuron cluster (a run of FFN neuron bundles read
    /// together), e.g. 64KiB. Default: chosen by the planner for --device, else 64KiB.
    #[arg(long, value_parser = nflash_plan::planner::parse_bytes)]
    cluster_bytes: Option<u64>,
    #[command(flatten)]
    sparse: SparseArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Offline planning for a target device (PowerInfer-2 §4.4; SPEC §4.6).
#[derive(Args)]
#[command(next_help_heading = "Device plan (hot neurons, cold cache, I/O)")]
pub struct DeviceArgs {
    /// Device profile (TOML, see profiles/): plan hot neurons, cold cache,
    /// cluster size and I/O threads for it and store the plan in the pack.
    #[arg(long)]
    device: Option<PathBuf>,
    /// Whole-process memory budget on the device (e.g. 96MiB, 4GiB); default: the profile's available memory.
    #[arg(long, requires = "device", value_parser = nflash_plan::planner::parse_bytes)]
    memory_budget: Option<u64>,
    /// Context length (tokens) the KV cache is planned for; default min(4096, the model's maximum), as `nflash run`.
    #[arg(long, requires = "device", value_parser = clap::value_parser!(u32).range(2..=nflash_format::MAX_CONTEXT as i64))]
    ctx: Option<u32>,
    /// Compute threads on the device; default: its core count.
    #[arg(long, requires = "device", value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
}

/// Sparse-pack options: without `--calib` or `--profile` the pack is dense.
#[derive(Args)]
#[command(next_help_heading = "Activation sparsity (sparse decode)")]
#[command(group(clap::ArgGroup::new("source").args(["calib", "profile"])))]
pub struct SparseArgs {
    /// Calibration text (UTF-8): profile FFN activity on it and write a sparse pack.
    #[arg(long, conflicts_with = "profile")]
    calib: Option<PathBuf>,
    /// Reuse a profile written by `prep profile` instead of profiling (--calib).
    #[arg(long)]
    profile: Option<PathBuf>,
    #[command(flatten)]
    calib_run: CalibArgs,
    /// Target fraction of FFN neurons inactive per token, in [0, 1); ReLU-family models use their natural sparsity.
    /// The default, 0.3 with the MLP predictor, is the knee measured on SmolLM2-135M (docs/benchmarks.md, quality).
    #[arg(long, default_value_t = 0.3, allow_negative_numbers = true, requires = "source")]
    sparsity: f64,
    /// What decides that a neuron is active: |act(gate)| (gate) or |act(gate)·up| (gate-up).
    #[arg(long, default_value = "gate-up", requires = "source")]
    criterion: Criterion,
    /// How decode picks neurons before reading them: exact (all gate/up, sparse down), low-rank or mlp.
    #[arg(long, default_value = "mlp", requires = "source")]
    predictor: PredictorKind,
    /// Predictor rank r (multiple of 32); default from --predictor-budget.
    #[arg(long, requires = "source")]
    rank: Option<usize>,
    /// Predictor size as a fraction of the layer's FFN bytes, used to choose the rank.
    #[arg(long, default_value_t = 0.10, allow_negative_numbers = true, requires = "source")]
    predictor_budget: f64,
    /// Fraction of truly active neurons the predictor must keep on held-out calibration tokens
    /// [default: 0.99 for ReLU-family models (relu, dReLU), 0.95 otherwise].
    #[arg(long, allow_negative_numbers = true, requires = "source")]
    recall: Option<f64>,
    /// MLP predictor training epochs.
    #[arg(long, default_value_t = 20, requires = "source")]
    epochs: usize,
    /// MLP predictor seed.
    #[arg(long, default_value_t = 0, requires = "source")]
    seed: u64,
    /// How the MLP predictor starts: gate-svd (the gate projection's best low-rank
    /// approximation, which predicts ReLU activity) or random
    /// [default: gate-svd for ReLU-family models, random otherwise].
    #[arg(long, requires = "source")]
    predictor_init: Option<MlpInit>,
}

impl SparseArgs {
    fn check(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.sparsity) {
            bail!(
                "--sparsity {} is outside [0, 1): it is the fraction of FFN neurons skipped per token, e.g. 0.5",
                self.sparsity
            );
        }
        if let Some(r) = self.recall.filter(|r| !(*r > 0.0 && *r <= 1.0)) {
            bail!("--recall {r} is outside (0, 1]");
        }
        if !(self.predictor_budget > 0.0 && self.predictor_budget <= 1.0) {
            bail!("--predictor-budget {} is outside (0, 1]", self.predictor_budget);
        }
        if let Some(r) = self.rank {
            if r == 0 || r % 32 != 0 {
                bail!("--rank {r} must be a positive multiple of 32 (predictor rows are stored in 32-element blocks)");
            }
        }
        if self.predictor_init.is_some() && self.predictor != PredictorKind::Mlp {
            bail!("--predictor-init applies to the MLP predictor only; drop it or pass --predictor mlp");
        }
        if self.epochs == 0 {
            bail!("--epochs 0 would leave the MLP predictor untrained; use at least 1 (default 20)");
        }
        Ok(())
    }

    /// The sparse plan, or `None` for a dense pack.
    fn plan(
        &self,
        ck: &Checkpoint,
        model_dir: &std::path::Path,
        quant: DType,
        stages: &mut Stages,
    ) -> Result<Option<SparsePlan>> {
        let profile = match (&self.calib, &self.profile) {
            (None, None) => return Ok(None),
            (_, Some(p)) => {
                let pr = Profile::load(p)?;
                pr.check_matches(ck, model_dir)?;
                pr
            }
            (Some(c), None) => {
                let t = std::time::Instant::now();
                let pr = crate::profile::profile(ck, c, &self.calib_run.options())?;
                message!("profiled {} tokens in {:.1} s", pr.calib.n_tokens, t.elapsed().as_secs_f64());
                stages.mark("profile");
                pr
            }
        };
        let t = std::time::Instant::now();
        // ReLU family: exact activity, so a stricter recall target and the gate-SVD start.
        let relu = ck.config.activation.is_relu_family();
        let recall = self.recall.unwrap_or(if relu { 0.99 } else { 0.95 });
        let plan = sparsify::plan(
            ck,
            &profile,
            &SparseOptions {
                sparsity: self.sparsity,
                criterion: self.criterion,
                predictor: self.predictor,
                rank: self.rank,
                budget: self.predictor_budget,
                recall,
                epochs: self.epochs,
                seed: self.seed,
                init: self.predictor_init.unwrap_or(if relu { MlpInit::GateSvd } else { MlpInit::Random }),
            },
            quant,
        )?;
        // Means over layers; over experts weighted by the tokens routed to
        // each, leaving out those too rarely routed to have a predictor.
        let weight: Vec<f32> = match &plan.routed_share {
            Some(share) => share
                .iter()
                .zip(&plan.layers)
                .map(|(&s, l)| if l.sparse.quality.tokens > 0 { s } else { 0.0 })
                .collect(),
            None => vec![1.0; plan.layers.len()],
        };
        let total = weight.iter().sum::<f32>().max(f32::MIN_POSITIVE);
        let mean = |f: &dyn Fn(&nflash_format::PredictorQuality) -> f32| {
            plan.layers.iter().zip(&weight).map(|(l, w)| w * f(&l.sparse.quality)).sum::<f32>() / total
        };
        let over = if plan.routed_share.is_some() { "means over experts, by tokens routed" } else { "layer means" };
        message!(
            "{} predictor (rank {}) built in {:.1} s: held-out recall {:.3}, precision {:.3}, bundles skipped {:.1}%, sparsity {:.1}% ({over})",
            plan.info.predictor.name(),
            plan.info.rank,
            t.elapsed().as_secs_f64(),
            mean(&|q| q.recall),
            mean(&|q| q.precision),
            100.0 * mean(&|q| q.bundles_skipped),
            100.0 * mean(&|q| q.sparsity),
        );
        // The decision threshold is set on held-out tokens for the target; a
        // predictor too weak to rank the neurons still falls short of it.
        let achieved = f64::from(mean(&|q| q.recall));
        if plan.info.predictor != PredictorKind::Exact && achieved < recall - RECALL_SHORTFALL {
            let others = match plan.info.predictor {
                PredictorKind::Mlp => "calibrate on more tokens (--tokens, --sample), or use --predictor exact",
                _ => "or use --predictor mlp or exact",
            };
            message!(
                "warning: the {} predictor reaches held-out recall {achieved:.3}, short of the target {recall}: \
                 it misses active neurons, which costs quality (check with `prep verify --quality`); \
                 raise --rank (or --predictor-budget), {others}",
                plan.info.predictor.name()
            );
        }
        stages.mark("predictors");
        let runs: Vec<crate::predictor::Training> = plan.layers.iter().filter_map(|l| l.training).collect();
        if !runs.is_empty() {
            let k = runs.len() as f32;
            let mut kept: Vec<usize> = runs.iter().map(|r| r.kept_epoch).collect();
            kept.sort_unstable();
            message!(
                "MLP training loss (binary cross-entropy, layer mean): first epoch {:.4}, last epoch {:.4}; weights kept after epoch {}..{} (median {}; 0 = initialisation), chosen on held-out tokens",
                runs.iter().map(|r| r.first).sum::<f32>() / k,
                runs.iter().map(|r| r.last).sum::<f32>() / k,
                kept[0],
                kept[kept.len() - 1],
                kept[kept.len() / 2],
            );
        }
        Ok(Some(plan))
    }
}

/// How far below the recall target (`--recall`) the held-out recall may fall
/// before `prep convert` warns; the threshold is set on other tokens than
/// those it is measured on, so a few thousandths either way are noise.
const RECALL_SHORTFALL: f64 = 0.02;

pub fn run(a: ConvertArgs) -> Result<()> {
    a.sparse.check()?;
    if a.cluster_bytes.is_some_and(|c| c == 0 || c > 64 << 20) {
        bail!("--cluster-bytes must be between 1 and 64 MiB");
    }
    let device = match &a.device.device {
        Some(p) => Some(nflash_format::DeviceProfile::load(p)?),
        None => None,
    };
    if a.out.is_dir() {
        bail!(
            "--out {} is a directory; pass a file path, e.g. {}",
            a.out.display(),
            a.out.join("model.nflash").display()
        );
    }
    // Never overwrite an input: a file of the checkpoint, the calibration text, the profile, the device profile.
    let inputs: Vec<&std::path::Path> =
        [&a.sparse.calib, &a.sparse.profile, &a.device.device].into_iter().flatten().map(|p| p.as_path()).collect();
    crate::output::check_out(&a.out, "--out", &inputs, &[&a.model])?;
    let t0 = std::time::Instant::now();
    let mut stages = Stages::start();
    let ck = Checkpoint::open_any(&a.model)?;
    let quant = match (a.quant, ck.gguf().and_then(|g| g.own_quant())) {
        (Some(q), _) => q,
        (None, Some((q, why))) => {
            message!("note: --quant {q}, {why}; pass --quant to choose another");
            q
        }
        (None, None) => DType::Q4_0,
    };
    for (k, v) in &ck.defaults_used {
        message!(
            "note: config.json has no {k}; using {v}, the default of transformers' config class for {}",
            ck.config.architecture.hf_name()
        );
    }
    check_tensors(&ck)?;
    let tok = nflash_runtime::tokenizer::Tokenizer::from_json(&ck.tokenizer_json)
        .map_err(|e| anyhow::anyhow!("{}/tokenizer.json cannot be loaded: {e}", a.model.display()))?;
    let n_ids = tok.vocab_size() as u64;
    if n_ids > ck.config.vocab_size {
        let name = tok.highest_id().map(|(name, _)| name).unwrap_or_default();
        if ck.gguf().is_some() {
            bail!(
                "{}: tokenizer.ggml.tokens has {n_ids} tokens (the last {name:?}) but the embedding has only {} rows; the vocabulary does not belong to these weights: the file is corrupt",
                a.model.display(),
                ck.config.vocab_size
            );
        }
        bail!(
            "{}/tokenizer.json has token ids up to {} (token {name:?}) but the embedding has only {} rows (vocab_size in config.json); the tokenizer does not belong to these weights: use the tokenizer.json that came with this checkpoint",
            a.model.display(),
            n_ids - 1,
            ck.config.vocab_size
        );
    }
    let cfg = &ck.config;
    message!(
        "converting {} ({}, {} layers, hidden {}, FFN {}, {} tensors) to {} as {}",
        a.model.display(),
        cfg.family_and_activation(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        ck.tensor_count(),
        a.out.display(),
        quant
    );
    stages.mark("open + check");
    let plan = a.sparse.plan(&ck, &a.model, quant, &mut stages)?;
    // Cluster size: given, or matched to the device's reads and the expected need of cold neurons.
    let cluster_bytes = match (a.cluster_bytes, &device) {
        (Some(c), _) => c,
        (None, None) => 64 * 1024,
        (None, Some(dev)) => {
            let bundle = nflash_format::BundleLayout::new(quant, cfg.hidden_size).map_or(1, |b| b.bundle_bytes);
            let n = cfg.intermediate_size as usize;
            let p = match &plan {
                Some(sp) => {
                    nflash_plan::cost::neuron_need_probability(Some(&sp.info), sp.layers.first().map(|l| &l.sparse), n)
                }
                None => vec![1.0; n],
            };
            let c = nflash_plan::planner::choose_cluster_bytes(dev, bundle, &p);
            // What the pack and its plan use: whole neurons, read in 4 KiB-aligned units.
            let k = crate::pack::neurons_per_cluster(c, bundle, cfg.intermediate_size);
            message!(
                "neuron cluster size for {}: {k} neurons of {bundle} bytes, {:.1} KiB ({} KiB per read, 4 KiB-aligned); chosen for the device's reads",
                dev.name,
                (k * bundle) as f64 / 1024.0,
                nflash_plan::layout::align_up(k * bundle) / 1024
            );
            c
        }
    };
    let ctx = a.device.ctx.unwrap_or_else(|| cfg.max_position_embeddings.min(4096) as u32);
    if device.is_some() && ctx as u64 > cfg.max_position_embeddings {
        message!(
            "warning: --ctx {ctx} exceeds the model's trained context ({} tokens, max_position_embeddings); the plan sizes the KV cache for it, but text past that context is not meaningful",
            cfg.max_position_embeddings
        );
    }
    if let (Some(dev), None) = (&device, a.device.memory_budget) {
        message!(
            "memory budget: {:.1} MiB, the available memory of profile {} (--memory-budget to choose another)",
            dev.memory.available_bytes as f64 / (1 << 20) as f64,
            dev.name
        );
    }
    let planner = device.as_ref().map(|dev| {
        let req = nflash_plan::planner::PlanRequest {
            budget_bytes: a.device.memory_budget.unwrap_or(dev.memory.available_bytes),
            ctx,
            // nflash run's default KV cache (it re-plans for --kv f32).
            kv: nflash_plan::KvType::default(),
            threads: a.device.threads.unwrap_or_else(|| dev.n_cores()),
            io_threads: None,
            measured: None,
            // A mixture of experts: each expert's routed share, as profiled.
            unit_share: plan
                .as_ref()
                .and_then(|p| p.routed_share.as_ref())
                .map(|s| s.iter().map(|&v| v as f64).collect()),
            draft_bytes: 0,
        };
        move |m: &nflash_format::Manifest| -> Result<nflash_format::Plan> {
            Ok(nflash_plan::planner::plan(m, dev, &req)?)
        }
    });
    write_pack(
        &ck,
        &a.out,
        &PackOptions { quant, cluster_bytes, cluster_align: 4096, alignment: nflash_format::DEFAULT_ALIGNMENT },
        plan.as_ref(),
        planner.as_ref().map(|p| p as crate::pack::Planner),
    )?;
    stages.mark("plan + quantize + pack");
    stages.print();
    let size = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    message!(
        "wrote {} ({:.1} MiB) in {:.1} s",
        a.out.display(),
        size as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Wall time and peak resident memory of each conversion stage (streaming
/// prep reports both). The peak is reset between stages through
/// `/proc/self/clear_refs` where Linux allows it, so each row is that
/// stage's own peak; elsewhere it is the running peak.
struct Stages {
    t: std::time::Instant,
    rows: Vec<(&'static str, f64, Option<u64>)>,
}

impl Stages {
    fn start() -> Self {
        Self::reset_peak();
        Stages { t: std::time::Instant::now(), rows: Vec::new() }
    }

    fn reset_peak() {
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    }

    /// Ends stage `name`.
    fn mark(&mut self, name: &'static str) {
        self.rows.push((name, self.t.elapsed().as_secs_f64(), nflash_runtime::stats::peak_rss_bytes()));
        Self::reset_peak();
        self.t = std::time::Instant::now();
    }

    fn print(&self) {
        message!("{:<24} {:>9} {:>14}", "stage", "wall s", "peak RSS MiB");
        for (name, s, peak) in &self.rows {
            let p = peak.map_or("-".into(), |b| format!("{:.0}", b as f64 / (1 << 20) as f64));
            message!("{name:<24} {s:>9.1} {p:>14}");
        }
        let total: f64 = self.rows.iter().map(|r| r.1).sum();
        let peak = self.rows.iter().filter_map(|r| r.2).max();
        message!(
            "{:<24} {total:>9.1} {:>14}",
            "total",
            peak.map_or("-".into(), |b| format!("{:.0}", b as f64 / (1 << 20) as f64))
        );
    }
}
