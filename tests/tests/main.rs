//! The end-to-end tests of prep and the nflash runtime: one test binary
//! (as ripgrep has), one module per area. Fixtures come from the
//! `nflash-tests` library (`tests/src/lib.rs`).
//!
//! Allocation tests (`no_alloc*`) count every allocation of the process
//! through [`nflash_tests::CountingAlloc`], so each runs alone in a child
//! process of this binary ([`nflash_tests::run_alone`]).

#[global_allocator]
static A: nflash_tests::CountingAlloc = nflash_tests::CountingAlloc;

mod android;
mod bad_input;
mod chat_templates;
mod checksums;
mod common;
mod fuzz;
mod gemma3;
mod gguf;
mod kernel_paths;
mod moe;
mod no_alloc;
mod no_alloc_cache;
mod offload;
mod plan_sim;
mod pressure;
mod probe;
mod profile;
mod reference;
mod relu;
mod rough_edges;
mod serve;
mod smollm2;
mod sparse;
mod spec;
mod speculative;
mod synth;
