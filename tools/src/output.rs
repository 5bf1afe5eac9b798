//! Checks on output paths, shared by every subcommand that writes a file.

use std::path::Path;

use anyhow::{bail, Result};

/// Refuses `out` (given with `flag`) before any work unless it can be
/// written without harm: its directory exists (outputs never create
/// directories: a typo should fail, naming the missing directory); it is not
/// a directory, FIFO, device or other non-regular file (the temporary file +
/// rename would replace it); it is none of the files `inputs`, and not an
/// existing file inside one of the directories `input_dirs` (writing it
/// would destroy an input).
///
/// # Errors
/// The path and what is wrong with it.
pub fn check_out(out: &Path, flag: &str, inputs: &[&Path], input_dirs: &[&Path]) -> Result<()> {
    let dir = out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if dir.exists() && !dir.is_dir() {
        bail!("{flag} {}: {} is a file, not a directory; choose another path", out.display(), dir.display());
    }
    if !dir.is_dir() {
        bail!(
            "{flag} {}: the directory {} does not exist; create it first (mkdir -p {}) or choose another path",
            out.display(),
            dir.display(),
            dir.display()
        );
    }
    if let Ok(meta) = std::fs::metadata(out) {
        if meta.is_dir() {
            bail!("{flag} {} is a directory; pass a file path inside it", out.display());
        }
        if !meta.is_file() {
            bail!(
                "{flag} {} exists and is not a regular file (a device, FIFO or socket); it would be replaced: choose another path",
                out.display()
            );
        }
    }
    let (Ok(o), Ok(d)) = (
        out.canonicalize().or_else(|_| dir.canonicalize().map(|d| d.join(out.file_name().unwrap_or_default()))),
        dir.canonicalize(),
    ) else {
        return Ok(());
    };
    // A model given as one file (a GGUF) is an input file too.
    for i in inputs.iter().chain(input_dirs.iter().filter(|d| d.is_file())) {
        if i.canonicalize().is_ok_and(|c| c == o) {
            bail!(
                "{flag} {} is also an input of this command; writing it would destroy that file: choose another path",
                out.display()
            );
        }
    }
    for i in input_dirs.iter().filter(|_| out.exists()) {
        if i.canonicalize().is_ok_and(|c| d.starts_with(&c)) {
            bail!(
                "{flag} {} is an existing file inside the checkpoint directory {}; writing it would destroy the checkpoint: choose another path",
                out.display(),
                i.display()
            );
        }
    }
    Ok(())
}
