//! The offline plan stored in a pack (SPEC §4.6): how a device with a
//! memory budget splits the FFN between pinned hot neurons, a cold neuron
//! cache and flash reads.

use serde::{Deserialize, Serialize};

use crate::device::DeviceProfile;

/// Memory plan for one device and budget (SPEC §4.6). Written by
/// `prep convert --device P --memory-budget S`; `nflash run` uses it unless
/// its own flags override it, and re-plans with the stored profile when
/// `--memory-budget` or `--ctx` differ.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The device profile the plan was made for.
    pub device: DeviceProfile,
    /// Whole-process memory budget, bytes.
    pub memory_budget_bytes: u64,
    /// Context length (tokens) the KV cache is sized for.
    pub ctx: u32,
    /// Compute threads assumed.
    pub threads: u32,
    /// Fixed region, bytes: resident tensors + KV cache at `ctx` + scratch + runtime overhead.
    pub fixed_bytes: u64,
    /// Resident segment bytes (embeddings, attention, norms, predictors) inside `fixed_bytes`.
    pub resident_bytes: u64,
    /// KV cache bytes at `ctx` inside `fixed_bytes`.
    pub kv_bytes: u64,
    /// Hot neurons pinned per layer `[n_layers]`: packed positions `0..hot[l]`
    /// (always whole clusters; hot-first packs put the most frequent first).
    pub hot_neurons: Vec<u32>,
    /// Hot region, bytes (the pinned clusters).
    pub hot_bytes: u64,
    /// Cold region, bytes: LRU of clusters read on demand (at least one
    /// layer's cold clusters, which also stage in-flight reads).
    pub cold_bytes: u64,
    /// I/O threads reading cold clusters.
    pub io_threads: u32,
    /// Target neuron-cluster size the pack was written with, bytes.
    pub cluster_bytes: u64,
    /// Expected flash bytes read per decode token (estimate from the profile's frequencies).
    pub expected_read_bytes_per_token: u64,
    /// Expected decode time per token, ms (compute and I/O overlapped; estimate).
    pub expected_token_ms: f64,
}
