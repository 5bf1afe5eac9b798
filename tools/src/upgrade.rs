//! `prep upgrade`: rewrite a pack of an earlier format minor (3.2, 3.3) as
//! the current one, adding what can be computed from the pack itself: the
//! neuron-cluster checksums (formats/SPEC.md §4.10). Much faster than
//! converting the checkpoint again (no profiling, no predictor training):
//! the file is read once and written once.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use nflash_format::{checksums, Pack, PackWriter, SegmentKind};
use nflash_runtime::message;

/// Arguments of `prep upgrade`.
#[derive(Args)]
pub struct UpgradeArgs {
    /// The .nflash pack to upgrade (format 3.2 or 3.3).
    file: PathBuf,
    /// Where to write the upgraded pack (temporary file + rename; not the input).
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: UpgradeArgs) -> Result<()> {
    crate::output::check_out(&a.out, "--out", &[&a.file], &[])?;
    let pack = Pack::open(&a.file)?;
    let m = pack.manifest();
    let h = pack.header();
    if m.segments.iter().any(|s| s.kind == SegmentKind::ClusterChecksums) {
        bail!(
            "{} is format {}.{} and already has neuron-cluster checksums: nothing to upgrade",
            a.file.display(),
            h.major,
            h.minor
        );
    }
    if h.minor < 2 {
        // Before 3.2 the tokenizer's post-processor decided a raw prompt's BOS
        // token (SPEC §4.2): the same manifest would run differently as 3.4.
        bail!(
            "{} is format {}.{}: packs before 3.2 cannot be upgraded (their raw prompts take BOS differently); convert the checkpoint again",
            a.file.display(),
            h.major,
            h.minor
        );
    }
    let total = nflash_plan::layout::segment_bytes(m);
    let pb = crate::progress::Progress::new(
        total,
        "{msg:>10} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        "upgrade",
    );
    pb.set_message("upgrade".to_string());
    let mut w = PackWriter::create(&a.out, h.alignment)?;
    *crate::IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()) = Some(w.temp_path().to_path_buf());
    let mut crcs = Vec::new();
    for (i, s) in m.segments.iter().enumerate() {
        // Every byte copied is checked first, so the new checksums vouch for verified bytes.
        pack.verify_segment(i as u32)?;
        let bytes = pack.segment(i as u32).context("a mapped pack holds every segment")?;
        w.begin_segment(&s.name, s.kind)?;
        w.write(bytes)?;
        w.end_segment()?;
        pb.inc(s.bytes);
    }
    // Segments keep their order and alignment, so every offset inside them (tensors, clusters) holds.
    for f in &m.ffn {
        let seg = pack.segment(f.segment).context("a mapped pack holds every segment")?;
        for c in &f.clusters {
            let len = c.n_neurons as usize * f.bundle.bundle_bytes as usize;
            crcs.push(checksums::cluster_crc32c(&seg[c.offset as usize..c.offset as usize + len]));
        }
    }
    w.begin_segment(checksums::SEGMENT_NAME, SegmentKind::ClusterChecksums)?;
    w.write(&checksums::encode(&crcs))?;
    w.end_segment()?;
    pb.finish_and_clear();
    let result = w.finish(m.clone());
    *crate::IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let out = result?;
    // What was written reads back as the same pack, every cluster checked.
    let new = Pack::open(&out)?;
    new.verify()?;
    let n = new.verify_clusters()?.unwrap_or(0);
    message!(
        "wrote {}: format {}.{} -> {}.{}, {} neuron-cluster checksums added",
        out.display(),
        h.major,
        h.minor,
        new.header().major,
        new.header().minor,
        n
    );
    Ok(())
}
