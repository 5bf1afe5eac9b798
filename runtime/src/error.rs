//! The one error type of `nflash-runtime`.

/// Errors from loading a pack, tokenizing and generating.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pack itself is invalid (names the segment / offset).
    #[error(transparent)]
    Format(#[from] nflash_format::Error),
    /// A tensor the model needs is not in the pack.
    #[error("the pack has no tensor {name:?}; it was written by an incompatible prep, re-run `prep convert`")]
    MissingTensor { name: String },
    /// A tensor's shape or type does not match the model config.
    #[error("tensor {name:?} has shape {found:?} and type {dtype}, expected shape {expected:?}")]
    Shape { name: String, expected: Vec<u64>, found: Vec<u64>, dtype: nflash_format::DType },
    /// The packed tokenizer cannot be loaded or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A token id that has no embedding row.
    #[error("token id {id} is outside the embedding table ({vocab} rows): the tokenizer and the weights do not belong together")]
    TokenOutOfRange { id: u32, vocab: u64 },
    /// The chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
    /// The prompt does not fit the context.
    #[error("the prompt is {prompt} tokens but the context holds {context} (with {reserve} reserved for generation); shorten the prompt or raise --ctx")]
    PromptTooLong { prompt: usize, context: usize, reserve: usize },
    /// The KV cache is full.
    #[error("context full: {context} tokens; raise --ctx")]
    ContextFull { context: usize },
    /// Nothing to run.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// An I/O error on a file.
    #[error("{path}: {err}")]
    Io { path: std::path::PathBuf, err: std::io::Error },
    /// A neuron-cluster read failed (read error, or the file shrank while running).
    #[error("reading FFN layer {layer} neuron cluster {cluster} (file offset {offset}, {len} bytes) failed: {msg}")]
    ClusterRead { layer: usize, cluster: usize, offset: u64, len: u64, msg: String },
    /// A neuron-cluster read has not completed within the read timeout
    /// (`offload::slots::READ_TIMEOUT`): the storage is not answering.
    #[error("reading FFN layer {layer} neuron cluster {cluster} (file offset {offset}) from {} has not completed after {secs:.1} s: the storage is not answering (a removed card, a hung network or FUSE file system); copy the pack to local storage and run again", path.display())]
    ReadStalled { path: std::path::PathBuf, layer: usize, cluster: usize, offset: u64, secs: f64 },
    /// Invalid user setting (names the flag).
    #[error("{0}")]
    Usage(String),
    /// The memory budget cannot hold the model, or the cache layout asked
    /// for does not fit in it (names the option, the budget and its parts).
    #[error("{0}")]
    Budget(String),
    /// Memory could not be allocated (names what for and how much).
    #[error("cannot allocate {bytes} bytes for {what}; lower --memory-budget or --ctx, or free memory")]
    Alloc { what: &'static str, bytes: u64 },
    /// The KV cache for a context could not be reserved.
    #[error("cannot reserve the KV cache for a context of {ctx} tokens ({mib:.1} MiB); lower --ctx")]
    KvCache { ctx: usize, mib: f64 },
    /// A thread could not be started.
    #[error("cannot start the {what}: {err}")]
    Thread { what: &'static str, err: std::io::Error },
    /// A plan could not be made (names the budget and its parts).
    #[error(transparent)]
    Plan(#[from] nflash_plan::Error),
    /// A bug in nflash rather than in its input (please report it).
    #[error("internal error: {0}")]
    Internal(String),
    /// The model produced NaN or infinite logits.
    #[error("the model produced non-finite logits (NaN or infinity) at position {position}: the output layer's weights are damaged or overflow; check every segment with `nflash run --verify full` or `prep verify`, and if they pass, convert the checkpoint again with a current prep (it refuses non-finite and out-of-range weights)")]
    NonFinite { position: usize },
    /// A decoder layer's output holds NaN or infinity (checked after every layer).
    #[error("non-finite activations (NaN or infinity) in layer {layer} at position {position}: that layer's weights are damaged or overflow, or its keys and values overflow the f16 KV cache (try `--kv f32`); check every segment with `nflash run --verify full` or `prep verify`, and if they pass, convert the checkpoint again with a current prep (it refuses non-finite and out-of-range weights)")]
    NonFiniteActivations { layer: usize, position: usize },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
