//! `nflash-runtime`: run a `.nflash` pack within a memory budget — read the
//! resident tensors, pin hot FFN neuron clusters, fetch cold ones from flash
//! through the neuron cache and the I/O pipeline, and generate text.
//!
//! Layers, each using only the ones above it in this list:
//! - [`cpu`]: the big and little cores, and pinning threads to them;
//! - [`kernels`]: all quantized and SIMD arithmetic (portable reference,
//!   x86 AVX2, aarch64 NEON, run-time dispatch);
//! - [`model`]: the transformer over a pack; the FFN takes its neuron
//!   clusters from a [`model::ClusterSource`] and knows nothing of I/O;
//! - [`offload`]: the segmented neuron cache, the aligned slots and the I/O
//!   pipeline — the [`model::ClusterSource`] that reads from flash;
//! - [`engine`], [`generate`], [`session`], [`ppl`]: a loaded pack with its
//!   tokenizer and chat template, the generation loop, a conversation's KV
//!   cache kept across requests (prefix reuse), perplexity;
//! - [`placement`]: memory budget → plan → where neuron clusters live, and
//!   the engine loaded that way (what `nflash` and the C library run).
//! - [`pressure`]: the system's memory signals (cgroup, `MemAvailable`,
//!   PSI) and the governor that resizes the neuron cache under them.
//!
//! Planning (how much is hot, how big the cold cache is) is the
//! `nflash-plan` crate. Entry points: [`nflash_format::Pack::open_resident`],
//! `nflash_plan::planner::plan`, [`Engine::load_with`],
//! [`generate::generate`], [`ppl::perplexity`].

pub mod args;
pub mod chat;
pub mod cpu;
pub mod draft;
pub mod engine;
pub mod error;
pub mod generate;
pub mod kernels;
pub mod message;
pub mod model;
pub mod offload;
pub mod placement;
pub mod ppl;
pub mod pressure;
pub mod sampler;
pub mod session;
pub mod spin;
pub mod stats;
pub mod tokenizer;

pub use engine::{load_model, Engine, Prompter};
pub use error::{Error, Result};
pub use model::Model;
