//! Helpers shared by the subcommands.

use anyhow::{Context, Result};
use std::path::Path;

/// Runs `f` on a worker of a rayon pool of `threads` threads (`None`: one
/// per core). Running the whole command inside the pool keeps the many small
/// parallel regions of a forward pass on worker threads, instead of
/// blocking the main thread on a lock for each one.
pub fn in_pool<T: Send>(threads: Option<usize>, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    nflash_runtime::cpu::compute_pool(threads)?.install(f)
}

/// Reads a UTF-8 text file, naming the file and the bad byte offset on error.
pub fn read_text(path: &Path) -> Result<String> {
    let mut bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    // A UTF-8 byte-order mark (Windows editors write one) is not text.
    if bytes.starts_with(b"\xEF\xBB\xBF") {
        bytes.drain(..3);
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (invalid byte at offset {}); convert it to UTF-8 first",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Which checksums `nflash run` and `nflash ppl` check (`--verify`). The
/// tokenizer and resident segments' CRC-32 are checked at load in every mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Verify {
    /// Each neuron cluster's CRC-32C after it is read and before it is used
    /// (formats/SPEC.md §4.10): hot clusters at load, cold ones as they are read.
    Lazy,
    /// As `lazy`, and every segment's CRC-32 at start (reads the whole file).
    Full,
    /// No neuron-cluster checks: only to measure what the check costs.
    Off,
}

impl Verify {
    /// Whether neuron clusters are checked as they are read.
    pub fn clusters(self) -> bool {
        self != Verify::Off
    }
}

/// Opens a pack for running ([`nflash_runtime::placement::open_pack`]),
/// checking every segment's CRC-32 first with [`Verify::Full`].
pub fn open_pack(path: &Path, verify: Verify) -> Result<nflash_format::Pack> {
    Ok(nflash_runtime::placement::open_pack(path, verify == Verify::Full, verify.clusters())?)
}

/// The context length ([`nflash_runtime::placement::context_len`]).
pub fn context_len(pack: &nflash_format::Pack, flag: Option<usize>) -> Result<usize> {
    Ok(nflash_runtime::placement::context_len(pack, flag)?)
}

/// Checks before any work that `out` (given with `flag`) can be written: not
/// a directory, its directory exists, and it is none of `inputs`.
pub fn check_output(out: &Path, flag: &str, inputs: &[&Path]) -> Result<()> {
    if out.is_dir() {
        anyhow::bail!("{flag} {} is a directory; pass a file path", out.display());
    }
    let dir = out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.is_dir() {
        anyhow::bail!(
            "{flag} {}: the directory {} does not exist; create it or choose another path",
            out.display(),
            dir.display()
        );
    }
    if let Ok(o) = out.canonicalize() {
        for i in inputs {
            if i.canonicalize().is_ok_and(|c| c == o) {
                anyhow::bail!("{flag} {} is also an input of this command; writing it would destroy that file: choose another path", out.display());
            }
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file in the same directory
/// and a rename, so a failure never leaves a partial or clobbered file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
    tmp.write_all(bytes).with_context(|| format!("cannot write {}", path.display()))?;
    tmp.persist(path).map_err(|e| anyhow::anyhow!("cannot write {}: {}", path.display(), e.error))?;
    Ok(())
}
