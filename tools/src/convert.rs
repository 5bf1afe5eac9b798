//! `prep convert`: Hugging Face checkpoint → `.nflash` pack.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use nflash_format::{Criterion, DType, PredictorKind};

use crate::checkpoint::Checkpoint;
use crate::pack::{check_tensors, write_pack, PackOptions};
use crate::profile::{CalibArgs, Profile};
use crate::sparsify::{self, SparseOptions, SparsePlan};

/// Arguments of `prep convert`.
#[derive(Args)]
pub struct ConvertArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Output .nflash file (written to a temporary file, then renamed).
    #[arg(long)]
    out: PathBuf,
    /// Weight type: q4_0, q8_0 (GGML-compatible blocks), f16 or f32.
    #[arg(long, default_value = "q4_0")]
    quant: DType,
    /// Target size of one neuron cluster, bytes (a run of FFN neuron bundles read together).
    #[arg(long, default_value_t = 64 * 1024)]
    cluster_bytes: u64,
    #[command(flatten)]
    sparse: SparseArgs,
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
    /// The default, 0.3 with the MLP predictor, is the knee measured on SmolLM2-135M (README).
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
    /// Fraction of truly active neurons the predictor must keep on held-out calibration tokens.
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true, requires = "source")]
    recall: f64,
    /// MLP predictor training epochs.
    #[arg(long, default_value_t = 20, requires = "source")]
    epochs: usize,
    /// MLP predictor seed.
    #[arg(long, default_value_t = 0, requires = "source")]
    seed: u64,
}

impl SparseArgs {
    fn check(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.sparsity) {
            bail!("--sparsity {} is outside [0, 1): it is the fraction of FFN neurons skipped per token, e.g. 0.5", self.sparsity);
        }
        if !(self.recall > 0.0 && self.recall <= 1.0) {
            bail!("--recall {} is outside (0, 1]", self.recall);
        }
        if !(self.predictor_budget > 0.0 && self.predictor_budget <= 1.0) {
            bail!("--predictor-budget {} is outside (0, 1]", self.predictor_budget);
        }
        if let Some(r) = self.rank {
            if r == 0 || r % 32 != 0 {
                bail!("--rank {r} must be a positive multiple of 32 (predictor rows are stored in 32-element blocks)");
            }
        }
        if self.epochs == 0 {
            bail!("--epochs 0 would leave the MLP predictor untrained; use at least 1 (default 20)");
        }
        Ok(())
    }

    /// The sparse plan, or `None` for a dense pack.
    fn plan(&self, ck: &Checkpoint, model_dir: &std::path::Path, quant: DType) -> Result<Option<SparsePlan>> {
        let profile = match (&self.calib, &self.profile) {
            (None, None) => return Ok(None),
            (_, Some(p)) => {
                let pr = Profile::load(p)?;
                pr.check_matches(&ck.config, model_dir)?;
                pr
            }
            (Some(c), None) => {
                let t = std::time::Instant::now();
                let pr = crate::profile::profile(
                    ck,
                    c,
                    &self.calib_run.options(),
                )?;
                eprintln!("profiled {} tokens in {:.1} s", pr.calib.n_tokens, t.elapsed().as_secs_f64());
                pr
            }
        };
        let t = std::time::Instant::now();
        let plan = sparsify::plan(
            ck,
            &profile,
            &SparseOptions {
                sparsity: self.sparsity,
                criterion: self.criterion,
                predictor: self.predictor,
                rank: self.rank,
                budget: self.predictor_budget,
                recall: self.recall,
                epochs: self.epochs,
                seed: self.seed,
            },
            quant,
        )?;
        let n = plan.layers.len().max(1) as f32;
        let mean = |f: &dyn Fn(&nflash_format::PredictorQuality) -> f32| plan.layers.iter().map(|l| f(&l.sparse.quality)).sum::<f32>() / n;
        eprintln!(
            "{} predictor (rank {}) built in {:.1} s: held-out recall {:.3}, precision {:.3}, bundles skipped {:.1}%, sparsity {:.1}% (layer means)",
            plan.info.predictor.name(),
            plan.info.rank,
            t.elapsed().as_secs_f64(),
            mean(&|q| q.recall),
            mean(&|q| q.precision),
            100.0 * mean(&|q| q.bundles_skipped),
            100.0 * mean(&|q| q.sparsity),
        );
        let losses: Vec<(f32, f32)> = plan.layers.iter().filter_map(|l| l.loss).collect();
        if !losses.is_empty() {
            let k = losses.len() as f32;
            eprintln!(
                "MLP training loss (binary cross-entropy, layer mean): first epoch {:.4}, last epoch {:.4}",
                losses.iter().map(|l| l.0).sum::<f32>() / k,
                losses.iter().map(|l| l.1).sum::<f32>() / k
            );
        }
        Ok(Some(plan))
    }
}

pub fn run(a: ConvertArgs) -> Result<()> {
    a.sparse.check()?;
    if a.cluster_bytes == 0 || a.cluster_bytes > 64 << 20 {
        bail!("--cluster-bytes must be between 1 and 64 MiB");
    }
    if a.out.is_dir() {
        bail!(
            "--out {} is a directory; pass a file path, e.g. {}",
            a.out.display(),
            a.out.join("model.nflash").display()
        );
    }
    let t0 = std::time::Instant::now();
    let ck = Checkpoint::open(&a.model)?;
    check_tensors(&ck)?;
    let tok = nflash_runtime::tokenizer::Tokenizer::from_json(&ck.tokenizer_json)
        .map_err(|e| anyhow::anyhow!("{}/tokenizer.json cannot be loaded: {e}", a.model.display()))?;
    let n_ids = tok.vocab_size() as u64;
    if n_ids > ck.config.vocab_size {
        let name = tok.highest_id().map(|(name, _)| name).unwrap_or_default();
        bail!(
            "{}/tokenizer.json has token ids up to {} (token {name:?}) but the embedding has only {} rows (vocab_size in config.json); the tokenizer does not belong to these weights: use the tokenizer.json that came with this checkpoint",
            a.model.display(),
            n_ids - 1,
            ck.config.vocab_size
        );
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| {
            format!("cannot create the output directory {} for --out; choose another --out path", dir.display())
        })?;
    }
    let cfg = &ck.config;
    eprintln!(
        "converting {} ({}, {} layers, hidden {}, FFN {}, {} tensors) to {} as {}",
        a.model.display(),
        cfg.architecture.hf_name(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        ck.tensor_count(),
        a.out.display(),
        a.quant
    );
    let plan = a.sparse.plan(&ck, &a.model, a.quant)?;
    write_pack(
        &ck,
        &a.out,
        &PackOptions {
            quant: a.quant,
            cluster_bytes: a.cluster_bytes,
            cluster_align: 4096,
            alignment: nflash_format::DEFAULT_ALIGNMENT,
        },
        plan.as_ref(),
    )?;
    let size = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({:.1} MiB) in {:.1} s",
        a.out.display(),
        size as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
