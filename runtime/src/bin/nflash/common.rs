//! Helpers shared by the subcommands.

use anyhow::{Context, Result};
use std::path::Path;

/// Sizes the global rayon pool; `None` uses every core.
pub fn set_threads(threads: Option<usize>) -> Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            anyhow::bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    Ok(())
}

/// Reads a UTF-8 text file, naming the file and the bad byte offset on error.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (invalid byte at offset {}); convert it to UTF-8 first",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Opens a pack, optionally verifying every segment checksum.
pub fn open_pack(path: &Path, verify: bool) -> Result<nflash_format::Pack> {
    let pack = nflash_format::Pack::open(path)?;
    if verify {
        pack.verify()?;
    }
    Ok(pack)
}
