//! `prep convert`: Hugging Face checkpoint → `.nflash` pack.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use nflash_format::DType;

use crate::checkpoint::Checkpoint;
use crate::pack::{check_tensors, write_pack, PackOptions};

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
}

pub fn run(a: ConvertArgs) -> Result<()> {
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
    write_pack(
        &ck,
        &a.out,
        &PackOptions {
            quant: a.quant,
            cluster_bytes: a.cluster_bytes,
            cluster_align: 4096,
            alignment: nflash_format::DEFAULT_ALIGNMENT,
        },
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
