//! Helpers shared by the subcommands.

use anyhow::{Context, Result};
use nflash_runtime::message;
use std::path::Path;

/// Runs `f` on a worker of a rayon pool of `threads` threads (`None`: one
/// per core). Running the whole command inside the pool keeps the many small
/// parallel regions of a forward pass on worker threads, instead of
/// blocking the main thread on a lock for each one.
pub fn in_pool<T: Send>(threads: Option<usize>, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    if threads == Some(0) {
        anyhow::bail!("--threads must be at least 1");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(t) = threads.filter(|&t| t > 1024) {
        anyhow::bail!("--threads {t} is more than 1024; use at most the number of cores ({cores})");
    }
    if let Some(t) = threads.filter(|&t| t > 4 * cores) {
        message!("warning: --threads {t} is far more than the {cores} cores here; decode will be slow");
    }
    // Phones: compute on the big cores, one thread each, pinned there (I/O
    // threads go to the little ones: `nflash_runtime::cpu::pin_io_thread`).
    let topo = nflash_runtime::cpu::Topology::system();
    let n = threads.unwrap_or(topo.default_threads(cores));
    let pin = topo.compute_cores(n);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .start_handler(move |_| {
            if let Some(big) = &pin {
                if let Err(e) = nflash_runtime::cpu::pin_current_thread(big) {
                    warn_unpinned(&e);
                }
            }
        })
        .build()
        .context("cannot start the thread pool")?;
    pool.install(f)
}

/// One warning per process when compute threads cannot be pinned.
fn warn_unpinned(e: &std::io::Error) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        message!("warning: could not pin compute threads to the big cores ({e}); they run where the OS puts them");
    }
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

/// Opens a pack for running (resident segments in memory, Q4_0 and Q8_0
/// matrices reordered to the ×8 layout where this CPU has its kernels),
/// verifying every segment checksum first with [`Verify::Full`]. A pack
/// without neuron-cluster checksums (before format 3.4) gets a one-line
/// notice unless checks are off.
pub fn open_pack(path: &Path, verify: Verify) -> Result<nflash_format::Pack> {
    let mut pack = nflash_format::Pack::open_resident(path)?;
    if verify == Verify::Full {
        pack.verify()?;
    }
    let has_table = pack.manifest().segments.iter().any(|s| s.kind == nflash_format::SegmentKind::ClusterChecksums);
    if verify.clusters() && !has_table {
        let h = pack.header();
        nflash_runtime::message!(
            "note: {} is format {}.{}, without neuron-cluster checksums, so clusters are not checked as they are read (--verify full checks the whole file at start); add them with `prep upgrade` (or convert the checkpoint again) on the workstation",
            path.display(),
            h.major,
            h.minor
        );
    }
    if nflash_runtime::kernels::x8_available() {
        // Matrices in groups of 8 rows: one stream per group, 8 rows per kernel call.
        pack.interleave()?;
    }
    Ok(pack)
}

/// The context length (KV cache tokens) to run `pack` with: `--ctx`, else
/// the one the pack's plan was made for, else min(4096, the model's
/// `max_position_embeddings`). Warns past the model's trained context.
pub fn context_len(pack: &nflash_format::Pack, flag: Option<usize>) -> Result<usize> {
    let max_pos = pack.manifest().config.max_position_embeddings as usize;
    let ctx = flag.or(pack.manifest().plan.as_ref().map(|p| p.ctx as usize)).unwrap_or(max_pos.clamp(2, 4096));
    if ctx < 2 {
        anyhow::bail!("--ctx must be at least 2");
    }
    if ctx > max_pos {
        message!("warning: --ctx {ctx} exceeds the model's trained context ({max_pos} tokens); quality past it is not guaranteed");
    }
    Ok(ctx)
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
