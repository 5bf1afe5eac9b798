//! How the FFN gets its neuron clusters: the [`ClusterSource`] trait, so the
//! model knows nothing of flash, caches or I/O threads.
//!
//! A source is asked, once per layer call, to make some clusters of a layer
//! available ([`ClusterSource::fetch`]), then for each cluster's bytes
//! ([`ClusterSource::cluster`]), which may wait for a read in flight. The
//! offload cache (`crate::offload::NeuronCache`) is the source `nflash run`
//! uses; [`SegmentClusters`] serves one FFN segment already in memory (unit
//! tests, `nflash probe`).

use crate::error::{Error, Result};

/// Where a fetched cluster is, as the source that fetched it put it (its
/// meaning is the source's own; the model only hands it back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loc {
    /// Not fetched for the current call.
    None,
    /// Resident, at this byte offset of the source's memory.
    Hot(usize),
    /// In this slot of the source's cold region (possibly still being read).
    Slot(u32),
}

/// Counters of a source since it was opened (cumulative; subtract with
/// [`CacheStats::since`]). Units: clusters, bytes, seconds.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct CacheStats {
    /// Clusters requested.
    pub needed: u64,
    /// Requested clusters found in the hot region.
    pub hot_hits: u64,
    /// Requested clusters found in the cold region.
    pub cold_hits: u64,
    /// Requested clusters read from flash.
    pub misses: u64,
    /// Bytes read from flash (cluster reads, aligned).
    pub bytes_read: u64,
    /// `preadv` calls (merged reads).
    pub reads: u64,
    /// Time compute threads spent waiting for reads, summed over threads, seconds.
    pub io_wait_s: f64,
    /// Clusters read by speculative prefetch ([`ClusterSource::speculate`]).
    pub speculated: u64,
    /// Of those, clusters the layer's fetch then needed (counted as misses there too).
    pub speculated_used: u64,
    /// Misses whose read began before their layer's fetch asked for them:
    /// the next layer's usual clusters, a speculative prefetch, or a later
    /// expert of the token ([`ClusterSource::fetch_ahead`]).
    pub read_ahead_used: u64,
    /// Resizes that gave memory back ([`MemoryControl::resize`]).
    pub budget_shrinks: u64,
    /// Resizes that took memory again.
    pub budget_grows: u64,
    /// Bytes given back to the system by those shrinks.
    pub bytes_returned: u64,
    /// Cluster reads of clusters that a shrink had dropped from memory.
    pub reads_after_shrink: u64,
}

impl CacheStats {
    /// Fraction of requested clusters served from memory (hot or cold region).
    pub fn hit_rate(&self) -> f64 {
        if self.needed == 0 {
            1.0
        } else {
            (self.hot_hits + self.cold_hits) as f64 / self.needed as f64
        }
    }

    /// Fraction of requested clusters served from the hot region.
    pub fn hot_hit_rate(&self) -> f64 {
        if self.needed == 0 {
            1.0
        } else {
            self.hot_hits as f64 / self.needed as f64
        }
    }

    /// `self - before`, for a span of work.
    pub fn since(&self, before: &CacheStats) -> CacheStats {
        CacheStats {
            needed: self.needed - before.needed,
            hot_hits: self.hot_hits - before.hot_hits,
            cold_hits: self.cold_hits - before.cold_hits,
            misses: self.misses - before.misses,
            bytes_read: self.bytes_read - before.bytes_read,
            reads: self.reads - before.reads,
            io_wait_s: self.io_wait_s - before.io_wait_s,
            speculated: self.speculated - before.speculated,
            speculated_used: self.speculated_used - before.speculated_used,
            read_ahead_used: self.read_ahead_used - before.read_ahead_used,
            budget_shrinks: self.budget_shrinks - before.budget_shrinks,
            budget_grows: self.budget_grows - before.budget_grows,
            bytes_returned: self.bytes_returned - before.bytes_returned,
            reads_after_shrink: self.reads_after_shrink - before.reads_after_shrink,
        }
    }
}

/// Memory a source holds, bytes, and how it reads.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Regions {
    /// Hot region (pinned clusters), bytes.
    pub hot_bytes: u64,
    /// Cold region (clusters cached after a read), bytes.
    pub cold_bytes: u64,
    /// Whether reads bypass the page cache (`O_DIRECT`).
    pub direct: bool,
    /// The I/O engine reading cold clusters (`"io_uring"` or `"threads"`);
    /// `None` without a cold region.
    pub io_engine: Option<&'static str>,
}

/// Resizes a source's memory while it is in use, from any thread: an app
/// or a pressure signal asks for less (or more) memory, and the source
/// gives back (or takes) what it can between its floor and its ceiling.
/// Results never depend on the size.
pub trait MemoryControl: Send + Sync {
    /// The least the source can hold, bytes (what one layer's fetch needs).
    fn floor_bytes(&self) -> u64;
    /// The most it holds, bytes (its size at load).
    fn ceiling_bytes(&self) -> u64;
    /// What it holds now, bytes.
    fn held_bytes(&self) -> u64;
    /// Moves toward holding `bytes` (clamped between floor and ceiling),
    /// giving memory back to the system at once; returns what it holds
    /// after, bytes (more than asked while the current fetch holds some).
    fn resize(&self, bytes: u64) -> u64;
}

/// Gives the FFN the neuron clusters of a layer, resident.
///
/// Clusters are numbered per layer in packed order (formats/SPEC.md §4.4);
/// their bytes are `n_neurons × bundle_bytes` of bundles.
pub trait ClusterSource: Send + Sync {
    /// Makes the clusters `needed` (ascending indices) of `layer` available:
    /// fills `table` (`[n_clusters]`, cleared first) with each one's
    /// location; reads may still be in flight when this returns.
    ///
    /// # Errors
    /// The source's, e.g. a cold region too small for one layer's clusters.
    fn fetch(&self, layer: usize, needed: &[u32], table: &mut Vec<Loc>) -> Result<()>;

    /// As [`Self::fetch`], for a draft pass (self-speculation: the model on
    /// what it holds in memory): only the clusters of `needed` that are in
    /// memory now get a location in `table`; the others stay [`Loc::None`].
    /// Reads nothing, waits for no read, counts nothing. By default every
    /// cluster is in memory (sources without I/O).
    ///
    /// # Errors
    /// As [`Self::fetch`].
    fn fetch_resident(&self, layer: usize, needed: &[u32], table: &mut Vec<Loc>) -> Result<()> {
        self.fetch(layer, needed, table)
    }

    /// The bytes (at least `n_neurons × bundle_bytes`) of cluster `c` of
    /// `layer` at `loc` (from [`Self::fetch`]), waiting for its read if needed.
    ///
    /// # Errors
    /// [`Error::ClusterRead`] if its read failed; [`Error::Internal`] if it
    /// was not fetched.
    fn cluster(&self, layer: usize, c: usize, loc: Loc) -> Result<&[u8]>;

    /// A hint: clusters `likely` (ascending) of `layer` will be fetched soon
    /// (speculative prefetch). Sources without I/O ignore it.
    fn speculate(&self, _layer: usize, _likely: &[u32]) {}

    /// Starts the reads of clusters `needed` (ascending) of `layer`, which
    /// a fetch after the current layer call's will ask for, without
    /// releasing the clusters the current call holds (best effort: what
    /// does not fit is read by that fetch). Sources without I/O ignore it.
    fn fetch_ahead(&self, _layer: usize, _needed: &[u32]) {}

    /// The end of a forward pass: no cluster location from a fetch is used
    /// until the next fetch. Sources whose memory moves resize then.
    fn end_pass(&self) {}

    /// Index of `layer`'s first cluster that is not always resident
    /// (`usize::MAX` when every cluster is).
    fn first_cold_cluster(&self, _layer: usize) -> usize {
        usize::MAX
    }

    /// Number of `layer`'s leading clusters whose bundles the source holds in
    /// the ×8 bundle layout (`nflash_format::interleave::interleave_bundles`,
    /// SPEC §5.1) rather than the row layout of the file; 0 by default.
    fn x8_clusters(&self, _layer: usize) -> usize {
        0
    }

    /// Seconds compute threads have waited for reads so far, summed over threads.
    fn wait_s(&self) -> f64 {
        0.0
    }

    /// A handle that resizes the source's memory from any thread; `None`
    /// for sources whose memory cannot move.
    fn memory_control(&self) -> Option<std::sync::Arc<dyn MemoryControl>> {
        None
    }

    /// Counters since the source was opened.
    fn stats(&self) -> CacheStats;

    /// Memory held and how reads are made.
    fn regions(&self) -> Regions;
}

/// One layer's clusters as the FFN sees them for one call: a source, the
/// layer and the locations its fetch returned.
#[derive(Clone, Copy)]
pub struct LayerClusters<'c> {
    source: &'c dyn ClusterSource,
    layer: usize,
    table: &'c [Loc],
    /// Clusters `0..x8` are in the ×8 bundle layout ([`ClusterSource::x8_clusters`]).
    x8: usize,
}

impl<'c> LayerClusters<'c> {
    /// Clusters of `layer` at the locations `table` (`[n_clusters]`) from `source`'s fetch.
    pub fn new(source: &'c dyn ClusterSource, layer: usize, table: &'c [Loc]) -> Self {
        LayerClusters { source, layer, table, x8: source.x8_clusters(layer) }
    }

    /// Whether cluster `c`'s bundles are in the ×8 bundle layout (SPEC §5.1).
    #[inline]
    pub fn is_x8(&self, c: usize) -> bool {
        c < self.x8
    }

    /// Bytes from the start of cluster `c` (at least its bundles), waiting
    /// for its read if needed.
    ///
    /// # Errors
    /// As [`ClusterSource::cluster`].
    #[inline]
    pub fn get(&self, c: usize) -> Result<&'c [u8]> {
        let loc = self.table.get(c).copied().unwrap_or(Loc::None);
        self.source.cluster(self.layer, c, loc)
    }
}

/// A whole FFN segment in memory, for any layer: cluster `c` starts at
/// `offsets[c]` (`NeuronCluster::offset`). Every cluster is hot.
pub struct SegmentClusters<'d> {
    data: &'d [u8],
    table: Vec<Loc>,
    x8: usize,
}

impl<'d> SegmentClusters<'d> {
    /// The segment `data` with cluster offsets `offsets` (`[n_clusters]`, bytes).
    pub fn new(data: &'d [u8], offsets: &[u64]) -> Self {
        SegmentClusters { data, table: offsets.iter().map(|&o| Loc::Hot(o as usize)).collect(), x8: 0 }
    }

    /// Declares clusters `0..n` to be in the ×8 bundle layout: the caller
    /// has reordered them with `nflash_format::interleave::interleave_bundles`.
    pub fn with_x8_clusters(mut self, n: usize) -> Self {
        self.x8 = n;
        self
    }

    /// Every cluster, as the FFN takes them.
    pub fn view(&self) -> LayerClusters<'_> {
        LayerClusters::new(self, 0, &self.table)
    }
}

impl ClusterSource for SegmentClusters<'_> {
    fn fetch(&self, _layer: usize, needed: &[u32], table: &mut Vec<Loc>) -> Result<()> {
        table.clear();
        table.resize(self.table.len(), Loc::None);
        for &c in needed {
            table[c as usize] = self.table[c as usize];
        }
        Ok(())
    }

    fn cluster(&self, layer: usize, c: usize, loc: Loc) -> Result<&[u8]> {
        match loc {
            Loc::Hot(off) if off <= self.data.len() => Ok(&self.data[off..]),
            _ => Err(Error::Internal(format!("layer {layer} cluster {c} used but not fetched"))),
        }
    }

    fn x8_clusters(&self, _layer: usize) -> usize {
        self.x8
    }

    fn stats(&self) -> CacheStats {
        CacheStats::default()
    }

    fn regions(&self) -> Regions {
        Regions { hot_bytes: self.data.len() as u64, cold_bytes: 0, direct: false, io_engine: None }
    }
}
