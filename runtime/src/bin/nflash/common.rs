//! Helpers shared by the subcommands.

use anyhow::{Context, Result};
use std::path::Path;

/// Runs `f` on a worker of a rayon pool of `threads` threads (`None`: one
/// per core). Running the whole command inside the pool keeps the many small
/// parallel regions of a forward pass on worker threads, instead of
/// blocking the main thread on a lock for each one.
pub fn in_pool<T: Send>(threads: Option<usize>, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    if threads == Some(0) {
        anyhow::bail!("--threads must be at least 1");
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .build()
        .context("cannot start the thread pool")?;
    pool.install(f)
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
    let pack = nflash_format::Pack::open_resident(path)?;
    if verify {
        pack.verify()?;
    }
    Ok(pack)
}
