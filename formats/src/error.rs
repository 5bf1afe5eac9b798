//! The one error type of `nflash-format`.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing a pack. Variants carry the
/// offending offset, length, segment or path so a message can name it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error on `path`.
    /// (The cause is part of the message and deliberately not a `source()`, so
    /// `anyhow`'s `{:#}` does not print it twice.)
    #[error("I/O error on {path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    /// The pack path does not exist.
    #[error("{path}: no such file; check the path, or create the pack with `prep convert`")]
    Missing { path: PathBuf },
    /// The pack path is a directory (e.g. a Hugging Face checkpoint).
    #[error("{path} is a directory, not an nflash pack; pass the .nflash file written by `prep convert` (a checkpoint directory must be converted first)")]
    IsDirectory { path: PathBuf },
    /// The pack path is neither a file nor a directory: a FIFO, a device or
    /// a socket, which opening could block on or read as empty.
    #[error("{path} is {kind}, not a file; pass the .nflash file written by `prep convert`")]
    NotRegularFile { path: PathBuf, kind: &'static str },
    /// The file is smaller than the fixed header (SPEC §2).
    #[error("{path}: file is {len} bytes, shorter than the {need}-byte header: the file is truncated or not an nflash pack; re-run `prep convert`")]
    TruncatedHeader { path: PathBuf, len: u64, need: u64 },
    /// The first 8 bytes are not `NFLASHPK` (SPEC §2).
    #[error("{path}: bad magic {found:02x?}: not an nflash pack (expected \"NFLASHPK\"); pass a .nflash file written by `prep convert`")]
    BadMagic { path: PathBuf, found: [u8; 8] },
    /// The file is a GGUF model (llama.cpp), not a pack.
    #[error(
        "{path} is a GGUF file, not an nflash pack; convert it first: prep convert --model {path} --out MODEL.nflash"
    )]
    Gguf { path: PathBuf },
    /// The pack was written by a newer format version than this build reads.
    #[error("{path}: pack format version {major}.{minor} is newer than this build supports ({sup_major}.{sup_minor}); use nflash/prep {need} or newer, or re-create the pack with this prep")]
    NewerVersion { path: PathBuf, major: u16, minor: u16, sup_major: u16, sup_minor: u16, need: String },
    /// The pack was written by an older, incompatible format major version.
    #[error("{path}: pack format version {major}.{minor} is older than this build reads ({sup_major}.{sup_minor}); re-create the pack from the checkpoint with this build's `prep convert`")]
    OlderVersion { path: PathBuf, major: u16, minor: u16, sup_major: u16, sup_minor: u16 },
    /// A stored CRC32 does not match the bytes (SPEC §6).
    #[error("{path}: checksum mismatch in {what}: stored {stored:#010x}, computed {computed:#010x}; the file is corrupt, copy or convert it again")]
    Checksum { path: PathBuf, what: String, stored: u32, computed: u32 },
    /// A neuron cluster's bytes do not match its CRC-32C (SPEC §4.10):
    /// `unit` names the decoder layer (and expert), `offset` is the
    /// cluster's absolute file offset, `len` its bytes of bundles.
    #[error("{path}: neuron cluster {cluster} of {unit} (file offset {offset}, {len} bytes) is damaged: CRC-32C stored {stored:#010x}, computed {computed:#010x}. This copy of the pack is corrupt (bad flash or an interrupted copy): push or copy it again, or convert the checkpoint again; `prep verify` checks a whole pack")]
    ClusterChecksum { path: PathBuf, unit: String, cluster: usize, offset: u64, len: u64, stored: u32, computed: u32 },
    /// The file is shorter than its header says (the manifest ends past EOF).
    #[error("{path}: file is {len} bytes but its header records {expected} bytes (manifest at offset {manifest_offset}): the file is truncated, e.g. by an interrupted copy or conversion; copy or convert it again")]
    Truncated { path: PathBuf, len: u64, expected: u64, manifest_offset: u64 },
    /// A range `[offset, offset+len)` lies outside the region holding it.
    #[error("{path}: {what} at offset {offset} length {len} extends past the end of its {region} ({limit} bytes): the file is truncated or corrupt; copy or convert it again")]
    OutOfRange { path: PathBuf, what: String, offset: u64, len: u64, region: &'static str, limit: u64 },
    /// A structurally invalid field (bad alignment, bad dtype for a shape, …).
    #[error("{path}: invalid {what}: {why}")]
    Invalid { path: PathBuf, what: String, why: String },
    /// The manifest could not be decoded.
    #[error("{path}: manifest ({len} bytes at offset {offset}) cannot be decoded: {why}")]
    Manifest { path: PathBuf, offset: u64, len: u64, why: String },
    /// A lookup by name found nothing.
    #[error("{path}: no {kind} named {name:?} in the pack")]
    NotFound { path: PathBuf, kind: &'static str, name: String },
    /// A device profile that cannot be used (SPEC §4.6).
    #[error("device profile {path}: {reason}; fix the file or measure one with `nflash probe --out FILE`")]
    Profile { path: PathBuf, reason: String },
    /// A memory budget the planner cannot meet (SPEC §4.6).
    #[error("memory budget {budget_mib:.1} MiB is short of the minimum, {suggest_mib} MiB ({detail}); use --memory-budget {suggest_mib}MiB or more{ctx_hint}")]
    Budget {
        /// The budget, bytes.
        budget: u64,
        budget_mib: f64,
        /// The minimum: fixed region plus one layer's FFN staging, bytes.
        need: u64,
        need_mib: f64,
        short_mib: f64,
        /// The parts of the minimum.
        detail: String,
        /// The minimum as stated: `need` plus [`MEASUREMENT_SLACK_BYTES`](crate::error::MEASUREMENT_SLACK_BYTES),
        /// rounded up to whole MiB, so that the next run accepts it.
        suggest_mib: u64,
        /// `, or lower --ctx to N or less` when a smaller context would fit.
        ctx_hint: String,
    },
    /// A writer-side misuse (e.g. a row length not a multiple of the block size).
    #[error("cannot write pack: {0}")]
    Write(String),
}

/// What a process measures of itself (its resident set at load) varies a
/// little from run to run; the minimum budget an error states includes this
/// much on top of the measured need, so a run given that budget is accepted.
pub const MEASUREMENT_SLACK_BYTES: u64 = 768 << 10;

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), err: source }
    }
}
