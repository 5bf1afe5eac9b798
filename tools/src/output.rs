//! Checks on output paths, shared by every subcommand that writes a file.

use std::path::Path;

use anyhow::{bail, Result};

/// Refuses `out` (given with `flag`) unless its directory exists. Outputs
/// never create directories: a typo in a path should fail, naming the
/// missing directory, rather than leave a tree of new directories.
///
/// # Errors
/// The missing directory, or a parent that is a file.
pub fn check_out_dir(out: &Path, flag: &str) -> Result<()> {
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
    Ok(())
}
