//! `nflash-runtime`: run a `.nflash` pack within a memory budget — read the
//! resident tensors, pin hot FFN neuron clusters, fetch cold ones from flash
//! through the neuron cache ([`cache`]) and the I/O pipeline ([`io`]), and
//! generate text.
//!
//! Entry points: [`nflash_format::Pack::open_resident`], [`planner::plan`],
//! [`Engine::load_with`], [`generate::generate`], [`ppl::perplexity`].

pub mod cache;
pub mod chat;
pub mod engine;
pub mod error;
pub mod ffn;
pub mod flash;
pub mod generate;
pub mod io;
pub mod kv_cache;
pub mod matmul;
pub mod message;
pub mod model;
pub mod ops;
pub mod planner;
pub mod ppl;
pub mod sampler;
pub mod sim;
pub mod simd;
pub mod sparse;
pub mod stats;
pub mod tokenizer;
pub mod weights;

pub use engine::Engine;
pub use error::{Error, Result};
pub use model::Model;
