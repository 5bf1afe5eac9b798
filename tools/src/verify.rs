//! `prep verify`: check every checksum (segments' CRC-32, neuron clusters'
//! CRC-32C) of one or more packs and, with
//! `--quality`, measure sparse against dense quality on held-out text.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use nflash_format::Pack;

use crate::quality::{evaluate, print_table, QualityOptions};
use nflash_runtime::message;

/// Arguments of `prep verify`.
#[derive(Args)]
pub struct VerifyArgs {
    /// The .nflash pack(s).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Also measure quality: perplexity of the dense and the sparse model, Δ%,
    /// top-1 agreement, achieved sparsity and predictor recall on --text.
    #[arg(long, requires = "text")]
    quality: bool,
    /// Held-out UTF-8 text for --quality (e.g. wikitext2-test.txt).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Score at most this many tokens of --text.
    #[arg(long, default_value_t = 16_384)]
    tokens: usize,
    /// Window length in tokens [default: 512, or the model's context
    /// (max_position_embeddings) when shorter].
    #[arg(long)]
    ctx: Option<usize>,
    /// Write a PNG plot of perplexity against sparsity, one line per criterion and predictor.
    #[arg(long, requires = "quality")]
    plot: Option<PathBuf>,
    /// Print one JSON array of results (with --quality).
    #[arg(long)]
    json: bool,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

pub fn run(a: VerifyArgs) -> Result<()> {
    if let Some(p) = &a.plot {
        crate::plot::check_path(p)?;
    }
    for f in &a.files {
        let pack = Pack::open(f)?;
        let segs = &pack.manifest().segments;
        for (i, s) in segs.iter().enumerate() {
            pack.verify_segment(i as u32)?;
            if !a.json {
                message!("ok  {:<12} {:>12} bytes  crc32 {:08x}", s.name, s.bytes, s.crc32);
            }
        }
        pack.metadata()?;
        // Each neuron cluster against its CRC-32C (SPEC §4.10), naming the damaged one.
        let clusters = pack.verify_clusters()?;
        if !a.json {
            let what = match clusters {
                Some(n) => format!("and {n} neuron-cluster checksums"),
                None => format!(
                    "(format {}.{}: no neuron-cluster checksums; convert again for lazy verification by nflash run)",
                    pack.header().major,
                    pack.header().minor
                ),
            };
            println!("{}: header, manifest, {} segments {what} verified", f.display(), segs.len());
        }
    }
    if !a.quality {
        return Ok(());
    }
    let Some(text) = &a.text else { bail!("--quality needs --text FILE") };
    if a.ctx.is_some_and(|c| c < 2) {
        bail!("--ctx must be at least 2");
    }
    let opts = QualityOptions { text: text.clone(), tokens: a.tokens, ctx: a.ctx, quiet: a.json };
    let rows = match a.threads {
        Some(t) => rayon::ThreadPoolBuilder::new().num_threads(t).build()?.install(|| evaluate(&a.files, &opts))?,
        None => evaluate(&a.files, &opts)?,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_table(&rows);
    }
    if let Some(p) = &a.plot {
        crate::plot::perplexity_vs_sparsity(&rows, p)?;
        if !a.json {
            println!("plot: {}", p.display());
        }
    }
    Ok(())
}
