//! `nflash-plan`: how a `.nflash` pack should use a device's memory and
//! flash (PowerInfer-2 §4.4), with no dependency on the runtime.
//!
//! - [`layout`]: sizes shared with the runtime (read alignment, merged
//!   reads, hot clusters, KV cache, prefill tiles) and [`CacheConfig`];
//! - [`planner`]: the memory plan for a budget (`prep convert --device`,
//!   `nflash run --memory-budget`);
//! - [`cost`]: the decode cost model behind it;
//! - [`sim`]: synthetic manifests of model shapes (`nflash plan-sim`).

pub mod cost;
pub mod error;
pub mod layout;
pub mod planner;
pub mod sim;

pub use error::{Error, Result};
pub use layout::{CacheConfig, KvType};
