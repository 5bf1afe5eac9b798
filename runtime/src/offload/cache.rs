//! The segmented neuron cache (PowerInfer-2 §4.2; docs/DESIGN.md, one
//! token's path, steps 5–7): FFN neuron clusters live either in the **hot region** (a
//! prefix of each layer's packed, hot-first clusters, read once at load and
//! pinned) or in the **cold region** (an LRU of fixed-size slots filled on
//! demand by the I/O pipeline). The fixed region (resident tensors, KV
//! cache, scratch) is outside this type; `nflash_plan::planner` sizes all
//! three. [`NeuronCache`] is the model's [`ClusterSource`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use nflash_format::Pack;
use nflash_plan::layout::IoEngine;
use nflash_plan::layout::{cluster_read_bytes, hot_clusters, MAX_MERGE_BYTES, READ_ALIGN};
use nflash_plan::CacheConfig;

use super::flash::{FlashFile, Shared};
use super::io::IoPipeline;
use super::slots::{AlignedBuf, Claim, ReadRequest, Slots, Stalled, CORRUPT, FAILED, READY};
use crate::error::{Error, Result};
use crate::model::source::{CacheStats, ClusterSource, Loc, MemoryControl, Regions};

/// Clusters that decode needs with at least this probability are read ahead
/// while the previous layer computes.
pub const PREFETCH_MIN_P: f64 = 0.9;

/// Sentinel for "no slot" / "no owner".
const NONE: u32 = u32::MAX;

/// One cluster on flash (16 bytes: a Mixtral expert's FFN has 14336
/// one-neuron clusters, so this table is counted in the plan,
/// `nflash_plan::layout::INDEX_BYTES_PER_CLUSTER`).
#[derive(Debug, Clone, Copy)]
struct ClusterSpan {
    /// Absolute file offset (direct-I/O aligned).
    offset: u64,
    /// Bytes of bundles (`n_neurons × bundle_bytes`).
    need: u32,
    /// Bytes read: `need` rounded up to the direct-I/O alignment.
    read: u32,
}

struct LayerLayout {
    /// The FFN unit in messages (`layer 3`, `layer 3 expert 1`).
    label: String,
    clusters: Vec<ClusterSpan>,
    /// `[n_clusters]` CRC-32C of each cluster's `need` bytes (formats/SPEC.md
    /// §4.10), checked after every read; empty when not checked.
    crcs: Vec<u32>,
    /// Clusters `0..hot` are pinned.
    hot: usize,
    /// `[n_clusters]` whether decode usually needs the cluster (read ahead while the previous layer computes).
    prefetch: Vec<bool>,
    /// Offset of cluster 0 in the hot region.
    hot_base: usize,
    /// Clusters `0..x8` (hot ones) hold their bundles in the ×8 bundle layout.
    x8: usize,
    /// The bundles' type, row width (elements) and size (bytes) when the
    /// layer's hot clusters are in the ×8 layout (to put one read back there).
    x8_form: Option<(nflash_format::DType, usize, u64)>,
}

impl LayerLayout {
    /// Where cluster `c` starts in the hot region, bytes (its hot copy, if it has one).
    fn hot_at(&self, c: usize) -> usize {
        self.hot_base + (self.clusters[c].offset - self.clusters[0].offset) as usize
    }

    /// Bytes clusters `..k` take in the hot region.
    fn prefix_bytes(&self, k: usize) -> u64 {
        match k {
            0 => 0,
            _ => self.clusters[k - 1].offset + self.clusters[k - 1].read as u64 - self.clusters[0].offset,
        }
    }
}

/// LRU bookkeeping of the cold region, touched only by the compute side.
struct Lru {
    /// `[layer][cluster]` → slot, or [`NONE`].
    slot_of: Vec<Vec<u32>>,
    /// slot → (layer, cluster) it holds, or ([`NONE`], _).
    owner: Vec<(u32, u32)>,
    /// Doubly linked list over slots: `head` least recently used.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    /// slot → the fetch (epoch) that last needed it; slots of the current fetch are never evicted.
    used: Vec<u64>,
    /// slot → read ahead by a prefetch and not yet used.
    prefetched: Vec<bool>,
    /// slot → read ahead by a speculative prefetch ([`NeuronCache::speculate`]) and not yet used.
    speculated: Vec<bool>,
    /// Cluster counters (`needed`, `hot_hits`, `cold_hits`, `misses`, `speculated*`) since load.
    counts: CacheStats,
    epoch: u64,
    /// The layer of the last [`NeuronCache::speculate`] call, until that layer's fetch
    /// (which keeps its epoch, so the speculative reads are not evicted by it).
    spec_layer: u32,
    /// slot → given back to the system by a shrink ([`Lru::shrink`]): out of
    /// the list, never claimed, until a grow brings it back.
    off: Vec<bool>,
    /// Slots in the list (not `off`).
    n_on: usize,
    /// Slots wanted by the last resize: a shrink that had to leave slots of
    /// the fetch then running finishes at the next fetch.
    target: usize,
    /// `[layer]` hot clusters wanted in memory by the last resize ([`Core::apply`]).
    target_live: Vec<usize>,
    /// A forward pass is running: between its first fetch and its end
    /// ([`NeuronCache::end_pass`]), the hot clusters of the unit whose
    /// locations the last fetch handed out ([`Self::busy`]) change only at
    /// a fetch; every other unit's at once.
    in_pass: bool,
    /// The unit of the last fetch in this pass, whose hot locations a
    /// layer call may be using (`NONE` between passes).
    busy: u32,
    /// The last resize is not fully applied ([`Core::apply`]).
    pending: bool,
    /// `[layer][cluster / 64]` bit set: the cluster's slot was given back
    /// by a shrink and the cluster not read again since (for
    /// `reads_after_shrink`).
    dropped: Vec<Vec<u64>>,
}

impl Lru {
    fn new(layers: &[LayerLayout], n_slots: usize) -> Self {
        let mut l = Lru {
            slot_of: layers.iter().map(|l| vec![NONE; l.clusters.len()]).collect(),
            owner: vec![(NONE, NONE); n_slots],
            prev: vec![NONE; n_slots],
            next: vec![NONE; n_slots],
            head: NONE,
            tail: NONE,
            used: vec![0; n_slots],
            prefetched: vec![false; n_slots],
            speculated: vec![false; n_slots],
            counts: CacheStats::default(),
            // Above every slot's `used` (0): no slot is the current fetch's
            // before the first fetch, so a resize can give any back.
            epoch: 1,
            spec_layer: NONE,
            off: vec![false; n_slots],
            n_on: n_slots,
            target: n_slots,
            target_live: Vec::new(),
            in_pass: false,
            busy: NONE,
            pending: false,
            dropped: layers.iter().map(|l| vec![0; l.clusters.len().div_ceil(64)]).collect(),
        };
        for s in 0..n_slots as u32 {
            l.push_back(s);
        }
        l
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p == NONE {
            self.head = n
        } else {
            self.next[p as usize] = n
        }
        if n == NONE {
            self.tail = p
        } else {
            self.prev[n as usize] = p
        }
    }

    fn push_back(&mut self, s: u32) {
        self.prev[s as usize] = self.tail;
        self.next[s as usize] = NONE;
        if self.tail == NONE {
            self.head = s
        } else {
            self.next[self.tail as usize] = s
        }
        self.tail = s;
    }

    fn push_front(&mut self, s: u32) {
        self.prev[s as usize] = NONE;
        self.next[s as usize] = self.head;
        if self.head == NONE {
            self.tail = s
        } else {
            self.prev[self.head as usize] = s
        }
        self.head = s;
    }

    /// Gives slots back to the system, least recently used first, until
    /// `to` remain (or no other can go): slots of the current fetch and
    /// slots with a read or a check running stay. Their clusters are
    /// forgotten (read again when needed). Returns the bytes given back.
    fn shrink(&mut self, slots: &Slots, to: usize) -> u64 {
        let mut bytes = 0u64;
        let mut s = self.head;
        while self.n_on > to && s != NONE {
            let next = self.next[s as usize];
            if self.used[s as usize] != self.epoch {
                if let Some(b) = slots.discard(s) {
                    self.unlink(s);
                    self.off[s as usize] = true;
                    self.n_on -= 1;
                    let (ol, oc) = std::mem::replace(&mut self.owner[s as usize], (NONE, NONE));
                    if ol != NONE {
                        self.slot_of[ol as usize][oc as usize] = NONE;
                        self.dropped[ol as usize][oc as usize / 64] |= 1 << (oc % 64);
                    }
                    self.prefetched[s as usize] = false;
                    self.speculated[s as usize] = false;
                    bytes += b as u64;
                }
            }
            s = next;
        }
        bytes
    }

    /// Brings slots given back by [`Self::shrink`] into use again, until
    /// `to` are (or none is left off), as the least recently used (taken
    /// first; their pages are committed again by the reads into them).
    /// Returns how many came back.
    fn grow(&mut self, to: usize) -> usize {
        let mut n = 0;
        for s in 0..self.off.len() {
            if self.n_on >= to {
                break;
            }
            if std::mem::take(&mut self.off[s]) {
                self.push_front(s as u32);
                self.n_on += 1;
                n += 1;
            }
        }
        n
    }

    /// Takes every slot but the first `n` out of use (a cache opened with
    /// room beyond its planned slots).
    fn keep_first(&mut self, n: usize) {
        for s in n..self.off.len() {
            self.unlink(s as u32);
            self.off[s] = true;
        }
        self.n_on = n.min(self.off.len());
        self.target = self.n_on;
    }

    /// Counts a read of cluster `c` of `layer` whose slot a shrink gave back.
    fn note_read(&mut self, layer: usize, c: usize) {
        let w = &mut self.dropped[layer][c / 64];
        if *w & (1 << (c % 64)) != 0 {
            *w &= !(1 << (c % 64));
            self.counts.reads_after_shrink += 1;
        }
    }

    fn touch(&mut self, s: u32) {
        self.unlink(s);
        self.push_back(s);
        self.used[s as usize] = self.epoch;
    }

    /// Reassigns the least recently used slot to cluster `c` of `layer`
    /// (forgetting what it held) and marks it used by the current epoch;
    /// `None` if that slot is used by the current epoch, i.e. every slot is.
    fn evict(&mut self, layer: usize, c: usize) -> Option<u32> {
        let s = self.head;
        if s == NONE || self.used[s as usize] == self.epoch {
            return None;
        }
        let (ol, oc) = self.owner[s as usize];
        if ol != NONE {
            self.slot_of[ol as usize][oc as usize] = NONE;
        }
        self.owner[s as usize] = (layer as u32, c as u32);
        self.slot_of[layer][c] = s;
        self.note_read(layer, c);
        self.prefetched[s as usize] = false;
        self.speculated[s as usize] = false;
        self.touch(s);
        Some(s)
    }
}

/// What [`NeuronCache::slot_held`] found for a cluster.
enum Held {
    /// No cold slot holds it.
    No,
    /// This slot holds it, ready or being read.
    Yes(u32),
    /// This slot's read of it failed or was damaged; the slot is empty and
    /// still the cluster's.
    Failed(u32),
}

/// Builds merged reads: consecutive clusters whose file ranges touch go
/// into one `preadv` of at most [`MAX_MERGE_BYTES`].
/// A request being built is queued when the merger is dropped, so an
/// early return (an error) never leaves claimed slots unread, which
/// would make every later claim of them wait for a read that never comes.
struct Merger<'a> {
    io: &'a IoPipeline,
    req: Option<ReadRequest>,
}

impl Drop for Merger<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

impl<'a> Merger<'a> {
    fn new(io: &'a IoPipeline) -> Self {
        Merger { io, req: None }
    }

    fn push(&mut self, span: ClusterSpan, claim: Claim) {
        let io = self.io;
        let claim = match &mut self.req {
            Some(r) => match r.try_append(span.offset, span.need as u64, claim, span.read, MAX_MERGE_BYTES) {
                Ok(()) => return,
                Err(claim) => claim,
            },
            None => claim,
        };
        if let Some(r) = self.req.take() {
            io.submit(r);
        }
        self.req = Some(ReadRequest::new(span.offset, span.need as u64, claim, span.read));
    }

    /// Queues the request being built and starts every queued read.
    fn flush(&mut self) {
        if let Some(r) = self.req.take() {
            self.io.submit(r);
        }
        self.io.flush();
    }
}

/// The hot and cold regions plus the I/O pipeline feeding the cold one.
pub struct NeuronCache {
    core: Arc<Core>,
    io: IoPipeline,
    wait_ns: AtomicU64,
}

/// The regions and their bookkeeping, shared by the cache and its
/// [`CacheMemory`] handles.
struct Core {
    /// The pack file, for messages.
    path: std::path::PathBuf,
    layers: Vec<LayerLayout>,
    hot: AlignedBuf,
    /// `[layer]` hot clusters in memory now (`..= LayerLayout::hot`): a
    /// resize below the hot region gives the others back, and they are
    /// served as cold clusters. Changed only under the LRU's lock, at a
    /// point where no layer call uses a cluster ([`Core::apply`]).
    live: Vec<AtomicUsize>,
    shared: Arc<Shared>,
    lru: Mutex<Lru>,
    /// Cold slots at load (the plan's cold region); the slots beyond them
    /// stage the hot clusters a resize gives back.
    planned_slots: usize,
}

impl NeuronCache {
    /// Reads the hot clusters of every layer of `pack` (large sequential
    /// reads) and sets up a cold region of `cfg.cold_bytes` (at least one
    /// layer's cold clusters) with `cfg.io_threads` I/O threads. With
    /// `cfg.verify` and a pack that has neuron-cluster checksums (SPEC
    /// §4.10), every cluster is checked after it is read and before it is
    /// used: hot ones here, cold ones on the I/O thread that reads them (or
    /// on a compute thread that needs one before that thread got to it).
    ///
    /// # Errors
    /// [`nflash_format::Error::ClusterChecksum`] (as [`Error::Format`]) for a
    /// damaged hot cluster, as the checksum table's own errors;
    /// [`Error::Io`] if the pack cannot be reopened or read,
    /// [`Error::Usage`] if the hot-set list does not match the layers,
    /// [`Error::Alloc`] if the regions cannot be allocated,
    /// [`Error::Thread`] if the I/O threads cannot be started.
    pub fn open(pack: &Pack, cfg: &CacheConfig) -> Result<Self> {
        let m = pack.manifest();
        if cfg.hot_neurons.len() != m.ffn.len() {
            return Err(Error::Usage(format!("{} hot-set sizes for {} layers", cfg.hot_neurons.len(), m.ffn.len())));
        }
        let meta = std::fs::metadata(pack.path()).map_err(|e| Error::Io { path: pack.path().to_path_buf(), err: e })?;
        let read_align = m.ffn.iter().map(nflash_plan::layout::read_align).max().unwrap_or(READ_ALIGN as u64);
        let flash = FlashFile::open(pack.path(), &meta, read_align)?;
        let checksums = if cfg.verify { pack.cluster_checksums()? } else { None };
        let (layers, hot_total) = layouts(pack, cfg, checksums.as_ref())?;
        // Address space for the whole hot region: pages are committed as hot clusters are read.
        let hot = AlignedBuf::zeroed(hot_total, "the hot region")?;
        let (n_slots, slot_bytes) = cold_slots(&layers, cfg.cold_bytes);
        // Room to stage every hot cluster of a layer, should a resize give
        // them all back: address space only until used.
        let capacity = n_slots + layers.iter().map(|l| l.hot).max().unwrap_or(0);
        let shared = Arc::new(Shared {
            flash,
            slots: Slots::new(capacity, slot_bytes as usize)?,
            error: Mutex::new(None),
            bytes_read: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        });
        let mut core = Core {
            path: pack.path().to_path_buf(),
            lru: Mutex::new(Lru::new(&layers, capacity)),
            live: layers.iter().map(|l| AtomicUsize::new(l.hot)).collect(),
            layers,
            hot,
            shared: Arc::clone(&shared),
            planned_slots: n_slots,
        };
        // What to hold at first: what `start_bytes` holds (everything
        // without it), as a resize to it would leave the cache (the rest
        // grows later).
        let (live, slots) = core.plan(cfg.start_bytes.unwrap_or(u64::MAX));
        read_hot(&core.shared.flash, &core.layers, &live, core.hot.as_mut_slice())?;
        check_hot(&core.path, &core.layers, &live, core.hot.as_slice())?;
        if crate::kernels::x8_available() {
            interleave_hot(pack, &mut core.layers, &live, core.hot.as_mut_slice());
        }
        let lru = core.lru.get_mut().unwrap_or_else(|e| e.into_inner());
        lru.keep_first(slots);
        // Hot clusters left on flash were never held: their reads are not
        // `reads_after_shrink`.
        for (a, &k) in core.live.iter().zip(&live) {
            a.store(k, Ordering::Relaxed);
        }
        lru.target_live = live;
        // Without a cold region nothing is ever read: one idle thread, no ring.
        let io = if capacity == 0 {
            IoPipeline::start(shared, 1, IoEngine::Threads)?
        } else {
            IoPipeline::start(shared, cfg.io_threads, cfg.io_engine)?
        };
        Ok(NeuronCache { core: Arc::new(core), io, wait_ns: AtomicU64::new(0) })
    }

    /// Hot region at load, bytes.
    pub fn hot_bytes(&self) -> u64 {
        self.core.hot.len() as u64
    }

    /// Cold region at load, bytes.
    pub fn cold_bytes(&self) -> u64 {
        (self.core.planned_slots * self.core.shared.slots.slot_bytes()) as u64
    }

    /// A handle that resizes this cache's memory from any thread
    /// ([`MemoryControl`]), while generation goes on.
    pub fn memory(&self) -> CacheMemory {
        CacheMemory { core: Arc::clone(&self.core) }
    }

    /// Ends a forward pass: no cluster is in use until the next fetch, so a
    /// resize that waits for the hot region happens now.
    pub fn end_pass(&self) {
        let mut lru = self.core.lru.lock().unwrap_or_else(|e| e.into_inner());
        lru.in_pass = false;
        lru.busy = NONE;
        // No slot is in use: the last fetch's may go too.
        lru.epoch += 1;
        self.core.apply(&mut lru);
    }

    /// Whether cluster reads bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.core.shared.flash.is_direct()
    }

    /// Makes the clusters `needed` (ascending indices) of `layer` available:
    /// fills `table` (`[n_clusters]`) with each one's location and queues
    /// merged reads for the misses, which complete in the background. Then
    /// queues reads of the next layer's likely-needed cold clusters
    /// (prefetch), so the disk keeps working while this layer computes.
    ///
    /// # Errors
    /// [`Error::Internal`] if the cold region cannot hold this layer's misses
    /// (a sizing bug: it is always at least one layer's cold clusters).
    pub fn fetch(&self, layer: usize, needed: &[u32], table: &mut Vec<Loc>) -> Result<()> {
        let lay = &self.core.layers[layer];
        let mut lru = self.begin_layer_call(layer, table);
        let hot = self.core.live[layer].load(Ordering::Relaxed);
        let mut st = CacheStats::default();
        let mut reads = Merger::new(&self.io);
        for &c in needed {
            let c = c as usize;
            st.needed += 1;
            if c < hot {
                table[c] = Loc::Hot(lay.hot_at(c));
                st.hot_hits += 1;
                continue;
            }
            let claim = match self.slot_held(&lru, layer, c) {
                Held::Yes(s) => {
                    lru.touch(s);
                    table[c] = Loc::Slot(s);
                    // A prefetched cluster was read for this use: a miss, read ahead of time.
                    if std::mem::take(&mut lru.prefetched[s as usize]) {
                        st.misses += 1;
                        st.read_ahead_used += 1;
                        st.speculated_used += std::mem::take(&mut lru.speculated[s as usize]) as u64;
                    } else {
                        st.cold_hits += 1;
                    }
                    continue;
                }
                // Its read failed or was damaged: read it again, into the same slot.
                Held::Failed(s) => self.reclaim(&mut lru, layer, c, s)?,
                Held::No => self.claim(&mut lru, layer, c)?.ok_or_else(|| {
                    Error::Internal(format!(
                        "the cold region ({} bytes) cannot hold layer {layer}'s cold clusters",
                        self.cold_bytes()
                    ))
                })?,
            };
            table[c] = Loc::Slot(claim.slot());
            st.misses += 1;
            reads.push(lay.clusters[c], claim);
        }
        reads.flush();
        // Prefetch: the next layer's (or the next token's first layer's) cold
        // clusters that are usually needed, into slots not used by this layer.
        let next = (layer + 1) % self.core.layers.len();
        let nl = &self.core.layers[next];
        for c in self.core.live[next].load(Ordering::Relaxed)..nl.clusters.len() {
            if !nl.prefetch[c] || lru.slot_of[next][c] != NONE {
                continue;
            }
            // A prefetch stops at the first slot it cannot take.
            let Ok(Some(claim)) = self.claim(&mut lru, next, c) else { break };
            lru.prefetched[claim.slot() as usize] = true;
            reads.push(nl.clusters[c], claim);
        }
        reads.flush();
        let c = &mut lru.counts;
        c.needed += st.needed;
        c.hot_hits += st.hot_hits;
        c.cold_hits += st.cold_hits;
        c.misses += st.misses;
        c.speculated_used += st.speculated_used;
        c.read_ahead_used += st.read_ahead_used;
        Ok(())
    }

    /// The start of a layer call ([`Self::fetch`], [`Self::fetch_resident`]):
    /// `table` emptied to `layer`'s clusters, a new epoch (unless a
    /// speculative prefetch of this layer began it: its slots stay
    /// protected), a pending resize applied (no layer call uses a cluster
    /// now), then `layer` marked busy. Returns the LRU, locked.
    fn begin_layer_call(&self, layer: usize, table: &mut Vec<Loc>) -> std::sync::MutexGuard<'_, Lru> {
        table.clear();
        table.resize(self.core.layers[layer].clusters.len(), Loc::None);
        let mut lru = self.core.lru.lock().unwrap_or_else(|e| e.into_inner());
        if std::mem::replace(&mut lru.spec_layer, NONE) != layer as u32 {
            lru.epoch += 1;
        }
        lru.in_pass = true;
        lru.busy = NONE;
        self.core.apply(&mut lru);
        lru.busy = layer as u32;
        lru
    }

    /// [`Self::fetch`] for a draft pass (`ClusterSource::fetch_resident`):
    /// locates the clusters of `needed` that are hot, or in a cold slot
    /// whose read has completed and been checked ([`READY`]); the others
    /// stay [`Loc::None`]. Starts no read (nor the next layer's prefetch),
    /// waits for none and leaves the counters alone; the slots it locates
    /// are touched, so they are protected for this layer call as a fetch's
    /// are (from eviction and from a resize).
    pub fn fetch_resident(&self, layer: usize, needed: &[u32], table: &mut Vec<Loc>) {
        let lay = &self.core.layers[layer];
        let mut lru = self.begin_layer_call(layer, table);
        let hot = self.core.live[layer].load(Ordering::Relaxed);
        for &c in needed {
            let c = c as usize;
            if c < hot {
                table[c] = Loc::Hot(lay.hot_at(c));
                continue;
            }
            let s = lru.slot_of[layer][c];
            if s != NONE && self.core.shared.slots.state(s) == READY {
                lru.touch(s);
                table[c] = Loc::Slot(s);
            }
        }
    }

    /// Starts reading the clusters `needed` (ascending indices) of `layer`
    /// that are not in memory, as part of the current fetch: unlike
    /// [`Self::fetch`] it starts no new epoch, so the slots of the fetch
    /// before it stay in place while that layer call computes, and the
    /// ones it claims are protected as well. Stops when no slot is free
    /// (the layer's own fetch later reads the rest). For the second and
    /// later experts of a decoded token: their selected clusters are known
    /// exactly (router and predictor have run), so their reads start
    /// before the first expert computes. A no-op without a cold region.
    pub fn fetch_ahead(&self, layer: usize, needed: &[u32]) {
        let mut lru = self.core.lru.lock().unwrap_or_else(|e| e.into_inner());
        if !lru.owner.is_empty() {
            self.read_ahead(&mut lru, layer, needed, false);
        }
    }

    /// Queues reads of the cold clusters `clusters` (ascending) of `layer`
    /// that are not in memory, into free slots of the current epoch,
    /// marked read ahead (and `speculative`); stops when no slot is free.
    /// Clusters already held are touched. Returns how many reads it queued.
    fn read_ahead(&self, lru: &mut Lru, layer: usize, clusters: &[u32], speculative: bool) -> u64 {
        let lay = &self.core.layers[layer];
        let mut reads = Merger::new(&self.io);
        let mut n = 0u64;
        for &c in clusters {
            let c = c as usize;
            if c < self.core.live[layer].load(Ordering::Relaxed) {
                continue;
            }
            let claim = match self.slot_held(lru, layer, c) {
                Held::Yes(s) => {
                    lru.touch(s);
                    continue;
                }
                Held::Failed(s) => match self.reclaim(lru, layer, c, s) {
                    Ok(claim) => claim,
                    Err(_) => break,
                },
                Held::No => match self.claim(lru, layer, c) {
                    Ok(Some(claim)) => claim,
                    _ => break,
                },
            };
            lru.prefetched[claim.slot() as usize] = true;
            lru.speculated[claim.slot() as usize] = speculative;
            reads.push(lay.clusters[c], claim);
            n += 1;
        }
        reads.flush();
        n
    }

    /// Index of `layer`'s first cold cluster (clusters before it are hot).
    pub fn first_cold_cluster(&self, layer: usize) -> usize {
        self.core.live[layer].load(Ordering::Relaxed)
    }

    /// Time compute threads have waited for reads so far, summed over threads, seconds.
    pub fn wait_s(&self) -> f64 {
        self.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// Speculative prefetch (cross-layer, the lookahead idea of Deja Vu,
    /// Liu et al. 2023, applied to the I/O pipeline): queues reads of the cold
    /// clusters `likely` (ascending indices) of `layer` that are not in
    /// memory, so the flash keeps reading while the compute threads run the
    /// layer's attention. The layer's next [`Self::fetch`] finds them (or
    /// waits for them) like any cold cluster and reads whatever the
    /// speculation missed; clusters it does not need stay in the LRU. A
    /// no-op when the cold region is empty.
    pub fn speculate(&self, layer: usize, likely: &[u32]) {
        let mut lru = self.core.lru.lock().unwrap_or_else(|e| e.into_inner());
        if lru.owner.is_empty() {
            return;
        }
        lru.epoch += 1;
        lru.spec_layer = layer as u32;
        let n = self.read_ahead(&mut lru, layer, likely, true);
        lru.counts.speculated += n;
    }

    /// Whether cluster `c` of `layer` has a cold slot: ready or being read
    /// ([`Held::Yes`]), or one whose read failed or was damaged, now
    /// emptied and still assigned to the cluster, to read it again
    /// ([`Held::Failed`], [`Self::reclaim`]).
    fn slot_held(&self, lru: &Lru, layer: usize, c: usize) -> Held {
        let s = lru.slot_of[layer][c];
        if s == NONE {
            Held::No
        } else if self.core.shared.slots.forget_failed(s) {
            Held::Failed(s)
        } else {
            Held::Yes(s)
        }
    }

    /// Claims slot `s`, which holds cluster `c` of `layer` after a failed
    /// or damaged read ([`Held::Failed`]), to read it again: touched for the
    /// current fetch, its prefetch marks cleared. Taking the cluster's own
    /// slot needs no eviction, so a read again never finds every slot taken
    /// by the current fetch (a speculative prefetch of a damaged layer
    /// fills the cold region with this fetch's epoch).
    ///
    /// # Errors
    /// As [`Self::claim`].
    fn reclaim(&self, lru: &mut Lru, layer: usize, c: usize, s: u32) -> Result<Claim> {
        lru.touch(s);
        lru.prefetched[s as usize] = false;
        lru.speculated[s as usize] = false;
        self.claim_slot(layer, c, s)
    }

    /// Takes the least recently used slot not used by the current fetch for
    /// cluster `c` of `layer` (marked pending); `None` if every slot is in use.
    ///
    /// # Errors
    /// [`Error::ReadStalled`] if an earlier read into that slot has not
    /// landed within the read timeout ([`super::slots::READ_TIMEOUT`]).
    fn claim(&self, lru: &mut Lru, layer: usize, c: usize) -> Result<Option<Claim>> {
        let Some(s) = lru.evict(layer, c) else { return Ok(None) };
        self.claim_slot(layer, c, s).map(Some)
    }

    /// Marks slot `s` pending for a read of cluster `c` of `layer` (with the
    /// cluster's CRC-32C to check, where the pack has them).
    ///
    /// # Errors
    /// As [`Self::claim`].
    fn claim_slot(&self, layer: usize, c: usize, s: u32) -> Result<Claim> {
        let lay = &self.core.layers[layer];
        let claim = match lay.crcs.get(c) {
            Some(&crc) => self.core.shared.slots.claim_checked(s, lay.clusters[c].need, crc),
            None => self.core.shared.slots.claim(s),
        };
        claim.map_err(|e| self.stalled(layer, c, e))
    }

    /// The error for cluster `c` of `layer`, whose read (or the read still
    /// holding the slot it needs) did not land in time.
    fn stalled(&self, layer: usize, c: usize, e: Stalled) -> Error {
        let span = self.core.layers[layer].clusters[c];
        Error::ReadStalled {
            path: self.core.path.clone(),
            layer,
            cluster: c,
            offset: span.offset,
            secs: e.waited.as_secs_f64(),
        }
    }

    /// The bytes (`n_neurons × bundle_bytes`) of cluster `c` of `layer` at
    /// `loc` (from [`Self::fetch`]), waiting for its read if needed.
    ///
    /// # Errors
    /// [`Error::ClusterRead`] if its read failed (e.g. the file shrank while
    /// running); [`nflash_format::Error::ClusterChecksum`] (as
    /// [`Error::Format`]) if the bytes read do not match its CRC-32C;
    /// [`Error::Internal`] if it was not fetched.
    pub fn cluster(&self, layer: usize, c: usize, loc: Loc) -> Result<&[u8]> {
        let span = self.core.layers[layer].clusters[c];
        match loc {
            Loc::Hot(off) => self
                .core
                .hot
                .get(off, span.need as usize)
                .ok_or_else(|| Error::Internal(format!("layer {layer} cluster {c} outside the hot region"))),
            Loc::Slot(s) => {
                let (state, waited) = self.core.shared.slots.wait(s).map_err(|e| self.stalled(layer, c, e))?;
                if waited > 0 {
                    self.wait_ns.fetch_add(waited, Ordering::Relaxed);
                }
                match state {
                    READY => self
                        .core
                        .shared
                        .slots
                        .ready_bytes(s, span.need as usize)
                        .ok_or_else(|| Error::Internal(format!("cold slot {s} reassigned while in use"))),
                    FAILED => {
                        // The next fetch of this cluster reads it again.
                        let msg = self
                            .core
                            .shared
                            .error
                            .lock()
                            .map(|g| g.clone())
                            .ok()
                            .flatten()
                            .unwrap_or_else(|| "read failed".into());
                        Err(Error::ClusterRead { layer, cluster: c, offset: span.offset, len: span.need as u64, msg })
                    }
                    // The next fetch of this cluster reads it again.
                    CORRUPT => Err(self.damaged(layer, c, self.core.shared.slots.seen_crc(s))),
                    _ => Err(Error::Internal(format!("cold slot {s} used before it was fetched"))),
                }
            }
            Loc::None => Err(Error::Internal(format!("layer {layer} cluster {c} used but not fetched"))),
        }
    }

    /// The error for cluster `c` of `layer` read with CRC-32C `computed`.
    fn damaged(&self, layer: usize, c: usize, computed: u32) -> Error {
        damaged(&self.core.path, &self.core.layers[layer], c, computed)
    }

    /// Counters since load (cumulative; subtract with [`CacheStats::since`]).
    pub fn stats(&self) -> CacheStats {
        let mut c = self.core.lru.lock().unwrap_or_else(|e| e.into_inner()).counts;
        c.bytes_read = self.core.shared.bytes_read.load(Ordering::Relaxed);
        c.reads = self.core.shared.reads.load(Ordering::Relaxed);
        c.io_wait_s = self.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9;
        c
    }
}

impl ClusterSource for NeuronCache {
    fn fetch(&self, layer: usize, needed: &[u32], table: &mut Vec<Loc>) -> Result<()> {
        NeuronCache::fetch(self, layer, needed, table)
    }

    fn fetch_resident(&self, layer: usize, needed: &[u32], table: &mut Vec<Loc>) -> Result<()> {
        NeuronCache::fetch_resident(self, layer, needed, table);
        Ok(())
    }

    fn cluster(&self, layer: usize, c: usize, loc: Loc) -> Result<&[u8]> {
        NeuronCache::cluster(self, layer, c, loc)
    }

    fn speculate(&self, layer: usize, likely: &[u32]) {
        NeuronCache::speculate(self, layer, likely)
    }

    fn fetch_ahead(&self, layer: usize, needed: &[u32]) {
        NeuronCache::fetch_ahead(self, layer, needed)
    }

    fn first_cold_cluster(&self, layer: usize) -> usize {
        NeuronCache::first_cold_cluster(self, layer)
    }

    fn x8_clusters(&self, layer: usize) -> usize {
        self.core.layers[layer].x8.min(self.core.live[layer].load(Ordering::Relaxed))
    }

    fn end_pass(&self) {
        NeuronCache::end_pass(self)
    }

    fn wait_s(&self) -> f64 {
        NeuronCache::wait_s(self)
    }

    fn stats(&self) -> CacheStats {
        NeuronCache::stats(self)
    }

    fn memory_control(&self) -> Option<Arc<dyn MemoryControl>> {
        Some(Arc::new(self.memory()))
    }

    fn regions(&self) -> Regions {
        let cold_bytes = self.cold_bytes();
        let io_engine = (cold_bytes > 0).then(|| self.io.engine_name());
        Regions { hot_bytes: self.hot_bytes(), cold_bytes, direct: self.is_direct(), io_engine }
    }
}

/// Resizes a [`NeuronCache`]'s memory from any thread ([`NeuronCache::memory`]).
///
/// Under a smaller size the cold region goes first, by whole slots, least
/// recently used first, down to one layer's cold clusters (what a fetch
/// needs); then the hot region, the same share of each layer's hot
/// clusters, least often active first (the end of its hot prefix, SPEC
/// §4.4's hot-first order), which are served as cold clusters from then on
/// (the cold region grows by what a fetch of them needs). Every byte is
/// given back to the system at once (`madvise(MADV_DONTNEED)`). Slots the
/// current fetch holds, or that a read is filling, stay until the next
/// fetch; hot clusters change only between layer calls (at a fetch, or
/// at once while no forward pass runs). A larger size reads the hot
/// clusters back from flash (checked, and in the ×8 layout again) and
/// brings the slots back. Results do not depend on the size.
#[derive(Clone)]
pub struct CacheMemory {
    core: Arc<Core>,
}

impl MemoryControl for CacheMemory {
    fn floor_bytes(&self) -> u64 {
        self.core.cost(&vec![0; self.core.layers.len()])
    }

    fn ceiling_bytes(&self) -> u64 {
        self.core.hot.len() as u64 + (self.core.planned_slots * self.core.shared.slots.slot_bytes()) as u64
    }

    fn held_bytes(&self) -> u64 {
        let lru = self.core.lru.lock().unwrap_or_else(|e| e.into_inner());
        self.core.held(&lru)
    }

    fn resize(&self, bytes: u64) -> u64 {
        let core = &self.core;
        let (live, slots) = core.plan(bytes);
        let mut lru = core.lru.lock().unwrap_or_else(|e| e.into_inner());
        let before = core.held(&lru);
        let (shrinks, grows) = (lru.counts.budget_shrinks, lru.counts.budget_grows);
        lru.target = slots;
        lru.target_live = live;
        lru.pending = true;
        // In a pass, the unit a layer call may be using keeps its hot
        // clusters until the next fetch; the rest moves now (at 7B a
        // prefill layer call lasts about a second, and other apps do not wait).
        core.apply(&mut lru);
        // One resize counts once, when it asks for less or more than held,
        // however many steps (now, at later fetches) it takes.
        let wanted = core.bytes(&lru.target_live, slots);
        lru.counts.budget_shrinks = shrinks + u64::from(wanted < before);
        lru.counts.budget_grows = grows + u64::from(wanted > before);
        core.held(&lru)
    }
}

impl Core {
    /// `[layer]` hot clusters in memory now.
    fn live_now(&self) -> impl Iterator<Item = usize> + '_ {
        self.live.iter().map(|k| k.load(Ordering::Relaxed))
    }

    /// Hot-region bytes with `live` (`[layer]`) hot clusters.
    fn hot_bytes(&self, live: impl IntoIterator<Item = usize>) -> u64 {
        self.layers.iter().zip(live).map(|(l, k)| l.prefix_bytes(k)).sum()
    }

    /// Cold slots a fetch needs with `live` (`[layer]`) hot clusters: the
    /// most cold clusters of one layer.
    fn min_slots(&self, live: impl IntoIterator<Item = usize>) -> usize {
        self.layers.iter().zip(live).map(|(l, k)| l.clusters.len() - k).max().unwrap_or(0)
    }

    /// Bytes held with `live` hot clusters per layer and `slots` cold slots.
    fn bytes(&self, live: &[usize], slots: usize) -> u64 {
        self.hot_bytes(live.iter().copied()) + (slots * self.shared.slots.slot_bytes()) as u64
    }

    /// Bytes held with `live` hot clusters per layer and the fewest slots.
    fn cost(&self, live: &[usize]) -> u64 {
        self.bytes(live, self.min_slots(live.iter().copied()))
    }

    /// Bytes held now.
    fn held(&self, lru: &Lru) -> u64 {
        self.hot_bytes(self.live_now()) + (lru.n_on * self.shared.slots.slot_bytes()) as u64
    }

    /// Hot clusters per layer and cold slots for holding at most `bytes`
    /// (at least the floor): every hot cluster and up to the planned slots
    /// if they fit; else the largest share of each layer's hot clusters
    /// (in 1/1024ths) that fits with the slots its fetches need.
    fn plan(&self, bytes: u64) -> (Vec<usize>, usize) {
        let full: Vec<usize> = self.layers.iter().map(|l| l.hot).collect();
        let slot = self.shared.slots.slot_bytes() as u64;
        let cap = self.shared.slots.len();
        let slots_for = |live: &[usize]| -> usize {
            let need = self.min_slots(live.iter().copied());
            let k = bytes.saturating_sub(self.hot_bytes(live.iter().copied())).checked_div(slot).unwrap_or(0);
            (k.min(self.planned_slots.max(need) as u64) as usize).max(need).min(cap)
        };
        if self.cost(&full) <= bytes {
            let n = slots_for(&full);
            return (full, n);
        }
        let share = |i: usize| -> Vec<usize> { full.iter().map(|&h| h * i / 1024).collect() };
        let live = (0..1024).rev().map(share).find(|live| self.cost(live) <= bytes).unwrap_or_else(|| share(0));
        let n = slots_for(&live);
        (live, n)
    }

    /// Moves the regions to the last resize's targets, but for the hot
    /// clusters of the unit a layer call may be using (`lru.busy`), which
    /// stay pending until the next fetch. Slots of the current fetch stay
    /// too ([`Lru::shrink`]).
    fn apply(&self, lru: &mut Lru) {
        if !std::mem::take(&mut lru.pending) {
            return;
        }
        // Slots first: the hot clusters given back are cold from now on.
        let need = self.min_slots(lru.target_live.iter().copied());
        if lru.n_on < need {
            lru.grow(need);
        }
        for l in 0..self.layers.len() {
            let (t, k) = (lru.target_live[l], self.live[l].load(Ordering::Relaxed));
            if t != k && l == lru.busy as usize {
                lru.pending = true;
                continue;
            }
            if t < k {
                let lay = &self.layers[l];
                let base = lay.hot_base as u64;
                let (from, to) = (base + lay.prefix_bytes(t), base + lay.prefix_bytes(k));
                self.live[l].store(t, Ordering::Relaxed);
                // SAFETY: clusters t..k of `l` are not hot any more (`live`
                // is t), so no later fetch hands out a location in this
                // range, and no layer call holds one now: `l` is not the
                // unit of the pass's last fetch (`busy`), whose locations
                // are the only ones a layer call uses, and we hold the LRU's lock.
                let b = unsafe { self.hot.give_back(from as usize, (to - from) as usize) };
                lru.counts.bytes_returned += b as u64;
                for c in t..k {
                    lru.dropped[l][c / 64] |= 1 << (c % 64);
                }
            } else if t > k {
                match self.promote(l, k, t) {
                    Ok(()) => self.live[l].store(t, Ordering::Relaxed),
                    // Stays cold; the next resize tries again.
                    Err(_) => lru.target_live[l] = k,
                }
            }
        }
        let to = lru.target.max(self.min_slots(self.live_now()));
        if lru.n_on > to {
            let b = lru.shrink(&self.shared.slots, to);
            lru.counts.bytes_returned += b;
            // Slots of the current fetch stay until the next one.
            lru.pending |= lru.n_on > to;
        } else if lru.n_on < to {
            lru.grow(to);
        }
    }

    /// Reads hot clusters `k..t` of layer `l` back into the hot region
    /// (one read), checks them and puts them in the ×8 layout where the
    /// layer's other hot clusters are.
    ///
    /// # Errors
    /// A read error or a damaged cluster.
    fn promote(&self, l: usize, k: usize, t: usize) -> Result<()> {
        let lay = &self.layers[l];
        let at = lay.hot_at(k);
        let len = (lay.prefix_bytes(t) - lay.prefix_bytes(k)) as usize;
        // SAFETY (the contract of `fill`): clusters k..t of `l` are not
        // hot now (`live` is k), so no fetch hands out a location in this
        // range and nobody reads it; `apply` runs under the LRU's lock,
        // alone, and never for the unit a layer call may be using (`busy`).
        unsafe {
            self.hot.fill(at, len, |buf| {
                read_clusters(&self.shared.flash, lay, k..t, buf)?;
                check_clusters(&self.path, lay, k..t, buf)?;
                interleave_clusters(lay, k..t, buf, &mut Vec::new());
                Ok(())
            })
        }
    }
}

/// Every layer's clusters on flash (with their CRC-32C from `checksums`,
/// to check), hot prefix and prefetch flags (from the pack's activation
/// statistics), and the hot region's total size, bytes.
///
/// # Errors
/// [`Error::Usage`] for a cluster too large for one read (over 4 GiB).
fn layouts(
    pack: &Pack,
    cfg: &CacheConfig,
    checksums: Option<&nflash_format::ClusterChecksums>,
) -> Result<(Vec<LayerLayout>, usize)> {
    let m = pack.manifest();
    let mut layers = Vec::with_capacity(m.ffn.len());
    let mut hot_total = 0usize;
    // Each unit's share of the tokens: an expert's clusters are needed only when it is routed to.
    let share = pack.unit_share().unwrap_or_else(|_| nflash_plan::cost::uniform_unit_share(m));
    for (u, ((f, &hot_n), &run)) in m.ffn.iter().zip(&cfg.hot_neurons).zip(&share).enumerate() {
        let base = pack.segment_file_offset(f.segment);
        let crcs = checksums.map_or_else(Vec::new, |t| t.unit(u).to_vec());
        let clusters = f
            .clusters
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (need, read) = (c.n_neurons as u64 * f.bundle.bundle_bytes, cluster_read_bytes(f, c));
                match (u32::try_from(need), u32::try_from(read)) {
                    (Ok(need), Ok(read)) => Ok(ClusterSpan { offset: base + c.offset, need, read }),
                    _ => Err(Error::Usage(format!(
                        "neuron cluster {i} of {} is {need} bytes, more than one read can hold (4 GiB); convert the checkpoint again with a smaller --cluster-bytes",
                        m.config.unit_label(u)
                    ))),
                }
            })
            .collect::<Result<Vec<ClusterSpan>>>()?;
        let hot = hot_clusters(f, hot_n);
        // Read ahead the clusters needed by most tokens (PREFETCH_MIN_P).
        let p = nflash_plan::cost::neuron_need_probability(m.sparse.as_ref(), f.sparse.as_ref(), f.n_neurons as usize);
        let prefetch = f
            .clusters
            .iter()
            .map(|c| {
                run * nflash_plan::cost::cluster_need(&p[c.first as usize..(c.first + c.n_neurons) as usize])
                    >= PREFETCH_MIN_P
            })
            .collect();
        let label = m.config.unit_label(u);
        let l = LayerLayout { label, clusters, crcs, hot, prefetch, hot_base: hot_total, x8: 0, x8_form: None };
        hot_total += l.prefix_bytes(hot) as usize;
        layers.push(l);
    }
    Ok((layers, hot_total))
}

/// The cold region for `layers` and a requested size of `cold_bytes`:
/// `(slots, bytes per slot)`. A slot holds the largest cluster read; there
/// are at least as many as one layer's cold clusters (they also stage that
/// layer's reads) and at most as many as all cold clusters (more is never
/// used); none when every cluster is hot.
fn cold_slots(layers: &[LayerLayout], cold_bytes: u64) -> (usize, u64) {
    let max_cold =
        layers.iter().map(|l| l.clusters[l.hot..].iter().map(|c| c.read as u64).sum::<u64>()).max().unwrap_or(0);
    let slot_bytes = layers.iter().flat_map(|l| l.clusters.iter().map(|c| c.read as u64)).max().unwrap_or(0);
    let all_cold: usize = layers.iter().map(|l| l.clusters.len() - l.hot).sum();
    let n_slots = if max_cold == 0 { 0 } else { (cold_bytes.max(max_cold) / slot_bytes).min(all_cold as u64) as usize };
    (n_slots.max(layers.iter().map(|l| l.clusters.len() - l.hot).max().unwrap_or(0)), slot_bytes)
}

/// Reads the first `live[l]` hot clusters of every layer `l` into `hot`
/// (laid out as [`layouts`] says).
fn read_hot(flash: &FlashFile, layers: &[LayerLayout], live: &[usize], hot: &mut [u8]) -> Result<()> {
    for (l, &k) in layers.iter().zip(live).filter(|(_, &k)| k > 0) {
        read_clusters(flash, l, 0..k, &mut hot[l.hot_base..])?;
    }
    Ok(())
}

/// Reads clusters `r` of `l`, one contiguous file range, into `buf` (laid
/// out as in the hot region, from cluster `r.start`), in 8 MiB pieces.
///
/// # Errors
/// As [`FlashFile::read_into`].
fn read_clusters(flash: &FlashFile, l: &LayerLayout, r: std::ops::Range<usize>, buf: &mut [u8]) -> Result<()> {
    let last = l.clusters[r.end - 1];
    let (start, end) = (l.clusters[r.start].offset, last.offset + last.read as u64);
    let need_end = last.offset + last.need as u64;
    let mut at = start;
    while at < end {
        let n = (end - at).min(8 << 20);
        let off = (at - start) as usize;
        flash.read_into(at, &mut [&mut buf[off..off + n as usize]], need_end.saturating_sub(at).min(n))?;
        at += n;
    }
    Ok(())
}

/// Checks the first `live[l]` hot clusters of every layer `l` in `hot`
/// (laid out as [`layouts`] says, in the file's row layout: before
/// [`interleave_hot`]) against their CRC-32C. Layers are checked in
/// parallel on the compute threads.
fn check_hot(path: &std::path::Path, layers: &[LayerLayout], live: &[usize], hot: &[u8]) -> Result<()> {
    use rayon::prelude::*;
    layers.par_iter().zip(live).try_for_each(|(l, &k)| check_clusters(path, l, 0..k, &hot[l.hot_base..]))
}

/// Checks clusters `r` of `l` in `buf` (laid out as in the hot region, from
/// cluster `r.start`, in the file's row layout) against their CRC-32C,
/// where the pack has them.
///
/// # Errors
/// [`nflash_format::Error::ClusterChecksum`] (as [`Error::Format`]) for the first damaged one.
fn check_clusters(path: &std::path::Path, l: &LayerLayout, r: std::ops::Range<usize>, buf: &[u8]) -> Result<()> {
    let base = l.hot_at(r.start);
    for c in r.filter(|&c| c < l.crcs.len()) {
        let at = l.hot_at(c) - base;
        let got = nflash_format::checksums::cluster_crc32c(&buf[at..at + l.clusters[c].need as usize]);
        if got != l.crcs[c] {
            return Err(damaged(path, l, c, got));
        }
    }
    Ok(())
}

/// The error for cluster `c` of layer `l` of the pack at `path`, read with CRC-32C `computed`.
fn damaged(path: &std::path::Path, l: &LayerLayout, c: usize, computed: u32) -> Error {
    let span = &l.clusters[c];
    Error::Format(nflash_format::Error::ClusterChecksum {
        path: path.to_path_buf(),
        unit: l.label.clone(),
        cluster: c,
        offset: span.offset,
        len: span.need as u64,
        stored: l.crcs.get(c).copied().unwrap_or(0),
        computed,
    })
}

/// Reorders every layer's hot clusters to the ×8 bundle layout (SPEC §5.1)
/// where the bundles' type and width allow it, so decode computes 8 neurons'
/// gate, up and down rows per kernel call; cold clusters keep the file's row
/// layout (they are read into slots as stored). The first `live[l]` of layer
/// `l` are in memory and reordered now; the others when they are read back
/// ([`Core::promote`]).
fn interleave_hot(pack: &Pack, layers: &mut [LayerLayout], live: &[usize], hot: &mut [u8]) {
    let mut scratch = Vec::new();
    for ((f, l), &k) in pack.manifest().ffn.iter().zip(layers.iter_mut()).zip(live) {
        let (dt, cols) = (f.bundle.dtype, f.bundle.row_elems);
        if l.hot == 0 || !nflash_format::interleave::can_interleave(dt, 8, cols) {
            continue;
        }
        l.x8_form = Some((dt, cols as usize, f.bundle.bundle_bytes));
        interleave_clusters(l, 0..k, &mut hot[l.hot_base..], &mut scratch);
        l.x8 = l.hot;
    }
}

/// Puts clusters `r` of `l` in `buf` (laid out as in the hot region, from
/// cluster `r.start`) into the ×8 layout of the layer's hot clusters; a
/// no-op for a layer whose hot clusters keep the row layout.
fn interleave_clusters(l: &LayerLayout, r: std::ops::Range<usize>, buf: &mut [u8], scratch: &mut Vec<u8>) {
    let Some((dt, cols, bundle)) = l.x8_form else { return };
    let base = l.hot_at(r.start);
    for c in r {
        let (at, need) = (l.hot_at(c) - base, l.clusters[c].need as usize);
        let n = (need as u64 / bundle) as usize;
        nflash_format::interleave::interleave_bundles(dt, cols, n, &mut buf[at..at + need], scratch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(n_clusters: usize, hot: usize) -> LayerLayout {
        LayerLayout {
            label: "layer 0".into(),
            clusters: (0..n_clusters as u64)
                .map(|c| ClusterSpan { offset: c * 4096, need: 4000, read: 4096 })
                .collect(),
            crcs: Vec::new(),
            hot,
            prefetch: vec![false; n_clusters],
            hot_base: 0,
            x8: 0,
            x8_form: None,
        }
    }

    /// The slot order from least to most recently used.
    fn order(l: &Lru) -> Vec<u32> {
        let mut v = Vec::new();
        let mut s = l.head;
        while s != NONE {
            v.push(s);
            s = l.next[s as usize];
        }
        v
    }

    /// A read batch dropped before it was flushed (an early return on an
    /// error in `fetch`) is still queued: its claimed slots are read (here
    /// by a pipeline that holds its reads and fails them when it ends),
    /// never left pending for a read that nobody will make.
    #[test]
    fn a_read_batch_dropped_on_an_early_return_is_still_queued() {
        use crate::offload::io::tests::setup;
        use nflash_plan::layout::IoEngine;
        let (_f, sh, io) = setup(4 * 4096, 4, 1, IoEngine::Threads);
        drop(io);
        let io = IoPipeline::held(Arc::clone(&sh));
        sh.slots.set_timeout(std::time::Duration::from_millis(100));
        {
            let mut reads = Merger::new(&io);
            let span = |c: u64| ClusterSpan { offset: c * 4096, need: 4000, read: 4096 };
            reads.push(span(0), sh.slots.claim(0).unwrap());
            reads.push(span(1), sh.slots.claim(1).unwrap());
            // An error returns here, before `reads.flush()`.
        }
        drop(io);
        for s in [0, 1] {
            assert_eq!(sh.slots.wait(s).map(|(state, _)| state), Ok(FAILED), "slot {s} was left pending");
        }
    }

    #[test]
    fn eviction_takes_the_least_recently_used_slot_and_forgets_its_cluster() {
        let mut l = Lru::new(&[layout(8, 0), layout(8, 0)], 3);
        assert_eq!(order(&l), [0, 1, 2]);
        l.epoch = 1;
        assert_eq!(l.evict(0, 5), Some(0));
        assert_eq!(l.evict(0, 6), Some(1));
        assert_eq!(order(&l), [2, 0, 1]);
        assert_eq!((l.slot_of[0][5], l.owner[0]), (0, (0, 5)));
        // A new fetch: slot 0 is touched again, so slot 2 then slot 1 go first.
        l.epoch = 2;
        l.touch(0);
        assert_eq!(l.evict(1, 3), Some(2));
        assert_eq!(l.evict(1, 4), Some(1));
        assert_eq!(l.slot_of[0][6], NONE, "cluster 6 lost its slot");
        assert_eq!((l.slot_of[1][4], l.owner[1]), (1, (1, 4)));
        // Every slot is used by the current epoch: nothing to evict.
        assert_eq!(l.evict(1, 5), None);
        assert_eq!(l.slot_of[1][5], NONE);
    }

    #[test]
    fn eviction_clears_the_prefetch_marks_of_the_slot() {
        let mut l = Lru::new(&[layout(4, 0)], 1);
        l.epoch = 1;
        let s = l.evict(0, 1).unwrap();
        l.prefetched[s as usize] = true;
        l.speculated[s as usize] = true;
        l.epoch = 2;
        assert_eq!(l.evict(0, 2), Some(s));
        assert!(!l.prefetched[s as usize] && !l.speculated[s as usize]);
        assert_eq!(l.slot_of[0][1], NONE);
    }

    #[test]
    fn the_cold_region_holds_one_layer_at_least_and_every_cold_cluster_at_most() {
        // Layer 0: 1 of 4 clusters hot (3 cold); layer 1: 2 of 4 hot (2 cold).
        let layers = [layout(4, 1), layout(4, 2)];
        assert_eq!(cold_slots(&layers, 0), (3, 4096), "one layer's cold clusters");
        assert_eq!(cold_slots(&layers, 4 * 4096 + 100), (4, 4096), "whole slots of the request");
        assert_eq!(cold_slots(&layers, 1 << 30), (5, 4096), "never more than every cold cluster");
        // Everything hot: no cold region.
        assert_eq!(cold_slots(&[layout(4, 4), layout(2, 2)], 1 << 30).0, 0);
        // Slots are as large as the largest cluster read.
        let mut big = layout(3, 0);
        big.clusters[1].read = 3 * 4096;
        assert_eq!(cold_slots(&[big], 0), (3, 3 * 4096));
    }

    #[test]
    fn a_shrink_gives_back_the_least_recently_used_slots_but_not_the_current_fetchs() {
        let layers = vec![layout(8, 0)];
        let slots = Slots::new(6, 4096).unwrap();
        let mut l = Lru::new(&layers, 6);
        l.epoch = 1;
        // Clusters 0..6 in slots 0..6, read in that order; 4 and 5 by the current fetch.
        for c in 0..6 {
            if c == 4 {
                l.epoch += 1;
            }
            assert_eq!(l.evict(0, c), Some(c as u32));
        }
        assert_eq!(l.shrink(&slots, 1), 4 * 4096, "slots 0..4 go; the current fetch's stay");
        assert_eq!((l.n_on, order(&l)), (2, vec![4, 5]));
        assert!(l.off[..4].iter().all(|&o| o) && l.slot_of[0][..4].iter().all(|&s| s == NONE));
        assert_eq!(l.owner[0], (NONE, NONE));
        // The next fetch can take them.
        l.epoch += 1;
        assert_eq!(l.shrink(&slots, 1), 4096);
        assert_eq!(order(&l), vec![5]);
        assert_eq!(l.evict(0, 6), Some(5));
        assert_eq!(l.evict(0, 7), None, "the last slot is the current fetch's");
        // Growing brings them back as the least recently used, taken first.
        assert_eq!(l.grow(3), 2);
        assert_eq!((l.n_on, order(&l)), (3, vec![1, 0, 5]));
        assert_eq!(l.grow(10), 3);
        assert_eq!(l.n_on, 6);
        // Reading again a cluster that a shrink dropped is counted once.
        l.epoch += 1;
        let s = l.evict(0, 0).unwrap();
        assert!(!l.off[s as usize]);
        assert_eq!(l.counts.reads_after_shrink, 1);
        l.evict(0, 7);
        assert_eq!(l.counts.reads_after_shrink, 1, "cluster 7 was never dropped");
        assert_eq!(l.slot_of[0][0], s);
    }

    #[test]
    fn no_slots_means_nothing_to_evict() {
        let mut l = Lru::new(&[layout(4, 4)], 0);
        l.epoch = 1;
        assert_eq!(l.evict(0, 0), None);
    }
}
