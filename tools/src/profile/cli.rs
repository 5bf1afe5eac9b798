//! `prep profile`: FFN neuron activity of a checkpoint on calibration text.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use nflash_format::Criterion;

use super::{profile, Profile, ProfileOptions};
use crate::checkpoint::Checkpoint;
use nflash_runtime::message;

/// Arguments of `prep profile`.
#[derive(Args)]
pub struct ProfileArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// UTF-8 calibration text, tokenized without BOS or chat template.
    #[arg(long)]
    calib: PathBuf,
    #[command(flatten)]
    run: CalibArgs,
    /// Output profile file (written to a temporary file, then renamed).
    #[arg(long)]
    out: PathBuf,
}

/// How much calibration text to profile (shared by `prep profile` and `prep convert --calib`).
#[derive(Args, Clone, Debug)]
pub struct CalibArgs {
    /// Calibration tokens to run (the first ones of the text).
    #[arg(long, default_value_t = 50_000)]
    pub tokens: usize,
    /// Window length, tokens: windows are independent causal sequences.
    #[arg(long, default_value_t = 512)]
    pub window: usize,
    /// FFN inputs kept per layer for predictor training (evenly spaced tokens).
    #[arg(long, default_value_t = 8192)]
    pub sample: usize,
}

impl CalibArgs {
    /// As profile options.
    pub fn options(&self) -> ProfileOptions {
        ProfileOptions { tokens: self.tokens, window: self.window, sample: self.sample }
    }
}

pub fn run(a: ProfileArgs) -> Result<()> {
    let opts = a.run.options();
    opts.check()?;
    if a.out.is_dir() {
        bail!(
            "--out {} is a directory; pass a file path, e.g. {}",
            a.out.display(),
            a.out.join("model.profile").display()
        );
    }
    let t0 = std::time::Instant::now();
    let ck = Checkpoint::open_any(&a.model)?;
    let cfg = &ck.config;
    if a.run.window as u64 > cfg.max_position_embeddings {
        message!(
            "warning: --window {} is beyond the model's trained context ({} tokens)",
            a.run.window,
            cfg.max_position_embeddings
        );
    }
    crate::output::check_out(&a.out, "--out", &[&a.calib], &[&a.model])?;
    message!(
        "profiling {} ({}, {} layers, FFN {}) on {}",
        a.model.display(),
        cfg.family(),
        cfg.num_layers,
        cfg.intermediate_size,
        a.calib.display()
    );
    let p = profile(&ck, &a.calib, &opts)?;
    let secs = t0.elapsed().as_secs_f64();
    p.save(&a.out)?;
    summary(&p, &a.out, secs);
    Ok(())
}

fn summary(p: &Profile, out: &std::path::Path, secs: f64) {
    let bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    let c = &p.calib;
    message!(
        "profiled {} tokens ({} window{} of ≤ {} tokens) in {secs:.1} s, {:.0} tokens/s; sample of {} tokens per layer",
        c.n_tokens,
        c.n_windows,
        if c.n_windows == 1 { "" } else { "s" },
        c.window,
        c.n_tokens as f64 / secs.max(1e-9),
        p.n_sample()
    );
    let mid = p.layers.len() / 2;
    let experts = p.model.experts as usize;
    if experts > 1 {
        let share = p.routed_share();
        let (lo, hi) = share.iter().fold((f32::MAX, 0f32), |(lo, hi), &s| (lo.min(s), hi.max(s)));
        message!(
            "router: experts get {:.1}% to {:.1}% of the tokens (uniform routing: {:.1}%)",
            100.0 * lo,
            100.0 * hi,
            100.0 * p.model.experts_per_token as f64 / experts as f64
        );
    }
    if experts > 1 {
        message!("3 of the {} experts (layer.expert):", p.layers.len());
    }
    for (i, l) in p.layers.iter().enumerate() {
        if i == 0 || i == mid || i + 1 == p.layers.len() {
            let f = l.frequency(Criterion::GateUp, 0.5);
            let hot = f.iter().filter(|&&v| v > 0.8).count();
            let name =
                if experts > 1 { format!("expert {}.{}", i / experts, i % experts) } else { format!("layer {i:>3}") };
            message!(
                "{name}: |act(gate)| zero {:.1}%, |act(gate)·up| zero {:.1}%, gate-up threshold at 50% sparsity {:.4}, neurons active > 80% of tokens there: {hot}/{}",
                100.0 * l.gate.zero_fraction(),
                100.0 * l.gate_up.zero_fraction(),
                l.threshold(Criterion::GateUp, 0.5),
                f.len()
            );
        }
    }
    // Not println!: a closed stdout must not turn a finished profile into a panic.
    let _ = writeln!(std::io::stdout(), "wrote {} ({:.1} MiB)", out.display(), bytes as f64 / (1 << 20) as f64);
}
