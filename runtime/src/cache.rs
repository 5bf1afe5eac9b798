//! The segmented neuron cache (PowerInfer-2 §4.2; DESIGN.md): FFN neuron
//! clusters live either in the **hot region** (a prefix of each layer's
//! packed, hot-first clusters, read once at load and pinned) or in the
//! **cold region** (an LRU of fixed-size slots filled on demand by the I/O
//! pipeline). The fixed region (resident tensors, KV cache, scratch) is
//! outside this type; [`crate::planner`] sizes all three.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nflash_format::{FfnLayer, NeuronCluster, Pack};

use crate::error::{Error, Result};
use crate::flash::{align_up, AlignedBuf, FlashFile, MAX_IOVECS};
use crate::io::{IoPipeline, ReadRequest, Shared, EMPTY, FAILED, PENDING, READY};

/// Largest merged read, bytes (PowerInfer-2 reads clusters, not neurons;
/// beyond ~512 KiB flash bandwidth no longer grows, DESIGN.md).
pub const MAX_MERGE_BYTES: u64 = 512 << 10;

/// Bytes read for cluster `c` of layer `f`: its bundles rounded up to the
/// direct-I/O alignment (the cluster's size in the hot or cold region).
pub fn cluster_read_bytes(f: &FfnLayer, c: &NeuronCluster) -> u64 {
    align_up(c.n_neurons as u64 * f.bundle.bundle_bytes)
}

/// How many of `f`'s clusters lie wholly in the hot prefix of `hot_neurons`
/// packed positions (the hot set holds whole clusters only).
pub fn hot_clusters(f: &FfnLayer, hot_neurons: u32) -> usize {
    f.clusters.iter().take_while(|c| c.first as u64 + c.n_neurons as u64 <= hot_neurons as u64).count()
}

/// Clusters that decode needs with at least this probability are read ahead
/// while the previous layer computes.
pub const PREFETCH_MIN_P: f64 = 0.9;

/// Sentinel for "no slot" / "no owner".
const NONE: u32 = u32::MAX;

/// How the FFN is split between memory and flash.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Hot neurons pinned per layer `[n_layers]` (packed positions `0..hot[l]`,
    /// rounded down to a neuron-cluster boundary).
    pub hot_neurons: Vec<u32>,
    /// Cold region, bytes; raised to one layer's cold clusters if smaller
    /// (they also stage the reads of one layer).
    pub cold_bytes: u64,
    /// I/O threads.
    pub io_threads: usize,
}

impl CacheConfig {
    /// Every FFN neuron pinned in memory (no budget).
    pub fn all_hot(pack: &Pack) -> Self {
        CacheConfig {
            hot_neurons: pack.manifest().ffn.iter().map(|f| f.n_neurons).collect(),
            cold_bytes: 0,
            io_threads: 1,
        }
    }
}

/// Where one needed cluster is for the current layer call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loc {
    /// Not requested.
    None,
    /// In the hot region at this byte offset.
    Hot(usize),
    /// In this cold slot (wait for [`READY`]).
    Slot(u32),
}

/// One cluster on flash.
#[derive(Debug, Clone, Copy)]
struct ClusterSpan {
    /// Absolute file offset (direct-I/O aligned).
    offset: u64,
    /// Bytes of bundles (`n_neurons × bundle_bytes`).
    need: u64,
    /// Bytes read: `need` rounded up to the direct-I/O alignment.
    read: u64,
}

struct LayerLayout {
    clusters: Vec<ClusterSpan>,
    /// Clusters `0..hot` are pinned.
    hot: usize,
    /// `[n_clusters]` whether decode usually needs the cluster (read ahead while the previous layer computes).
    prefetch: Vec<bool>,
    /// Offset of cluster 0 in the hot region.
    hot_base: usize,
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
            epoch: 0,
            spec_layer: NONE,
        };
        for s in 0..n_slots as u32 {
            l.push_back(s);
        }
        l
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p == NONE { self.head = n } else { self.next[p as usize] = n }
        if n == NONE { self.tail = p } else { self.prev[n as usize] = p }
    }

    fn push_back(&mut self, s: u32) {
        self.prev[s as usize] = self.tail;
        self.next[s as usize] = NONE;
        if self.tail == NONE { self.head = s } else { self.next[self.tail as usize] = s }
        self.tail = s;
    }

    fn touch(&mut self, s: u32) {
        self.unlink(s);
        self.push_back(s);
        self.used[s as usize] = self.epoch;
    }
}

/// Builds merged reads: consecutive clusters whose file ranges touch go
/// into one `preadv` of at most [`MAX_MERGE_BYTES`].
#[derive(Default)]
struct Merger {
    req: Option<ReadRequest>,
}

impl Merger {
    fn push(&mut self, io: &IoPipeline, span: ClusterSpan, slot: u32) {
        if let Some(r) = &mut self.req {
            let end = r.offset + r.lens[..r.n].iter().map(|&l| l as u64).sum::<u64>();
            if end == span.offset && r.n < MAX_IOVECS && end + span.read - r.offset <= MAX_MERGE_BYTES {
                r.slots[r.n] = slot;
                r.lens[r.n] = span.read as u32;
                r.n += 1;
                r.need = span.offset + span.need - r.offset;
                return;
            }
            io.submit(*r);
        }
        let mut r = ReadRequest { offset: span.offset, need: span.need, n: 1, slots: [0; MAX_IOVECS], lens: [0; MAX_IOVECS] };
        r.slots[0] = slot;
        r.lens[0] = span.read as u32;
        self.req = Some(r);
    }

    fn flush(&mut self, io: &IoPipeline) {
        if let Some(r) = self.req.take() {
            io.submit(r);
        }
    }
}

/// Counters since load or the last reset.
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
    /// Clusters read by speculative prefetch ([`NeuronCache::speculate`]).
    pub speculated: u64,
    /// Of those, clusters the layer's fetch then needed (counted as misses there too).
    pub speculated_used: u64,
}

impl CacheStats {
    /// Fraction of requested clusters served from memory (hot or cold region).
    pub fn hit_rate(&self) -> f64 {
        if self.needed == 0 { 1.0 } else { (self.hot_hits + self.cold_hits) as f64 / self.needed as f64 }
    }

    /// Fraction of requested clusters served from the hot region.
    pub fn hot_hit_rate(&self) -> f64 {
        if self.needed == 0 { 1.0 } else { self.hot_hits as f64 / self.needed as f64 }
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
        }
    }
}

/// The hot and cold regions plus the I/O pipeline feeding the cold one.
pub struct NeuronCache {
    layers: Vec<LayerLayout>,
    hot: AlignedBuf,
    shared: Arc<Shared>,
    lru: Mutex<Lru>,
    io: IoPipeline,
    wait_ns: AtomicU64,
}

impl NeuronCache {
    /// Reads the hot clusters of every layer of `pack` (large sequential
    /// reads) and sets up a cold region of `cfg.cold_bytes` (at least one
    /// layer's cold clusters) with `cfg.io_threads` I/O threads.
    ///
    /// # Errors
    /// [`Error::Io`] if the pack cannot be reopened or read,
    /// [`Error::Usage`] if the hot-set list does not match the layers or
    /// memory cannot be allocated.
    pub fn open(pack: &Pack, cfg: &CacheConfig) -> Result<Self> {
        let m = pack.manifest();
        if cfg.hot_neurons.len() != m.ffn.len() {
            return Err(Error::Usage(format!("{} hot-set sizes for {} layers", cfg.hot_neurons.len(), m.ffn.len())));
        }
        let meta = std::fs::metadata(pack.path()).map_err(|e| Error::Io { path: pack.path().to_path_buf(), err: e })?;
        let flash = FlashFile::open(pack.path(), &meta)?;
        let mut layers = Vec::with_capacity(m.ffn.len());
        let mut hot_total = 0usize;
        let mut max_cold = 0u64;
        let mut slot_bytes = 0u64;
        for (f, &hot_n) in m.ffn.iter().zip(&cfg.hot_neurons) {
            let base = pack.segment_file_offset(f.segment);
            let clusters: Vec<ClusterSpan> = f
                .clusters
                .iter()
                .map(|c| ClusterSpan { offset: base + c.offset, need: c.n_neurons as u64 * f.bundle.bundle_bytes, read: cluster_read_bytes(f, c) })
                .collect();
            let hot = hot_clusters(f, hot_n);
            let hot_len = if hot == 0 { 0 } else { (clusters[hot - 1].offset + clusters[hot - 1].read - clusters[0].offset) as usize };
            max_cold = max_cold.max(clusters[hot..].iter().map(|c| c.read).sum());
            slot_bytes = slot_bytes.max(clusters.iter().map(|c| c.read).max().unwrap_or(0));
            // Read ahead the clusters needed by most tokens (PREFETCH_MIN_P).
            let p = crate::planner::neuron_need_probability(m.sparse.as_ref(), f.sparse.as_ref(), f.n_neurons as usize);
            let prefetch = f
                .clusters
                .iter()
                .map(|c| crate::planner::cluster_need(&p[c.first as usize..(c.first + c.n_neurons) as usize]) >= PREFETCH_MIN_P)
                .collect();
            layers.push(LayerLayout { clusters, hot, prefetch, hot_base: hot_total });
            hot_total += hot_len;
        }
        let hot = AlignedBuf::zeroed(hot_total)?;
        for l in &layers {
            if l.hot == 0 {
                continue;
            }
            // The hot prefix is one contiguous file range: read it in 8 MiB pieces.
            let (start, end) = (l.clusters[0].offset, l.clusters[l.hot - 1].offset + l.clusters[l.hot - 1].read);
            let need_end = l.clusters[l.hot - 1].offset + l.clusters[l.hot - 1].need;
            let mut at = start;
            while at < end {
                let n = (end - at).min(8 << 20);
                // SAFETY: the hot region is written only here, before any reader exists.
                let buf = unsafe { hot.slice_mut(l.hot_base + (at - start) as usize, n as usize) };
                flash.read_into(at, &mut [buf], need_end.saturating_sub(at).min(n))?;
                at += n;
            }
        }
        // At least one layer's cold clusters; at most every cold cluster (more is never used).
        let all_cold: usize = layers.iter().map(|l| l.clusters.len() - l.hot).sum();
        let n_slots = if max_cold == 0 { 0 } else { (cfg.cold_bytes.max(max_cold) / slot_bytes).min(all_cold as u64) as usize };
        let n_slots = n_slots.max(layers.iter().map(|l| l.clusters.len() - l.hot).max().unwrap_or(0));
        let shared = Arc::new(Shared {
            flash,
            slots: AlignedBuf::zeroed(n_slots * slot_bytes as usize)?,
            slot_bytes: slot_bytes as usize,
            state: (0..n_slots).map(|_| AtomicU8::new(EMPTY)).collect(),
            error: Mutex::new(None),
            bytes_read: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        });
        let io = IoPipeline::start(Arc::clone(&shared), if n_slots == 0 { 0 } else { cfg.io_threads })
            .map_err(|e| Error::Usage(format!("cannot start I/O threads: {e}")))?;
        Ok(NeuronCache {
            lru: Mutex::new(Lru::new(&layers, n_slots)),
            layers,
            hot,
            shared,
            io,
            wait_ns: AtomicU64::new(0),
        })
    }

    /// Hot region, bytes.
    pub fn hot_bytes(&self) -> u64 {
        self.hot.len() as u64
    }

    /// Cold region, bytes.
    pub fn cold_bytes(&self) -> u64 {
        self.shared.slots.len() as u64
    }

    /// Whether cluster reads bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.shared.flash.is_direct()
    }

    /// Makes the clusters `needed` (ascending indices) of `layer` available:
    /// fills `table` (`[n_clusters]`) with each one's location and queues
    /// merged reads for the misses, which complete in the background. Then
    /// queues reads of the next layer's likely-needed cold clusters
    /// (prefetch), so the disk keeps working while this layer computes.
    ///
    /// # Errors
    /// [`Error::Usage`] if the cold region cannot hold this layer's misses
    /// (a sizing bug: it is always at least one layer's cold clusters).
    pub fn fetch(&self, layer: usize, needed: &[u32], table: &mut Vec<Loc>) -> Result<()> {
        let lay = &self.layers[layer];
        table.clear();
        table.resize(lay.clusters.len(), Loc::None);
        let mut lru = self.lru.lock().unwrap_or_else(|e| e.into_inner());
        // After a speculative prefetch of this layer, keep its epoch: its slots stay protected.
        if std::mem::replace(&mut lru.spec_layer, NONE) != layer as u32 {
            lru.epoch += 1;
        }
        let mut st = CacheStats::default();
        let mut reads = Merger::default();
        for &c in needed {
            let c = c as usize;
            st.needed += 1;
            if c < lay.hot {
                table[c] = Loc::Hot(lay.hot_base + (lay.clusters[c].offset - lay.clusters[0].offset) as usize);
                st.hot_hits += 1;
                continue;
            }
            let s = self.slot_held(&mut lru, layer, c);
            if s != NONE {
                lru.touch(s);
                table[c] = Loc::Slot(s);
                // A prefetched cluster was read for this use: a miss, read ahead of time.
                if std::mem::take(&mut lru.prefetched[s as usize]) {
                    st.misses += 1;
                    st.speculated_used += std::mem::take(&mut lru.speculated[s as usize]) as u64;
                } else {
                    st.cold_hits += 1;
                }
                continue;
            }
            let Some(s) = self.claim(&mut lru, layer, c) else {
                return Err(Error::Usage(format!("the cold region ({} bytes) cannot hold layer {layer}'s cold clusters", self.cold_bytes())));
            };
            table[c] = Loc::Slot(s);
            st.misses += 1;
            reads.push(&self.io, lay.clusters[c], s);
        }
        reads.flush(&self.io);
        // Prefetch: the next layer's (or the next token's first layer's) cold
        // clusters that are usually needed, into slots not used by this layer.
        let next = (layer + 1) % self.layers.len();
        let nl = &self.layers[next];
        for c in nl.hot..nl.clusters.len() {
            if !nl.prefetch[c] || lru.slot_of[next][c] != NONE {
                continue;
            }
            let Some(s) = self.claim(&mut lru, next, c) else { break };
            lru.prefetched[s as usize] = true;
            reads.push(&self.io, nl.clusters[c], s);
        }
        reads.flush(&self.io);
        let c = &mut lru.counts;
        c.needed += st.needed;
        c.hot_hits += st.hot_hits;
        c.cold_hits += st.cold_hits;
        c.misses += st.misses;
        c.speculated_used += st.speculated_used;
        Ok(())
    }

    /// Index of `layer`'s first cold cluster (clusters before it are hot).
    pub fn first_cold_cluster(&self, layer: usize) -> usize {
        self.layers[layer].hot
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
        let lay = &self.layers[layer];
        let mut lru = self.lru.lock().unwrap_or_else(|e| e.into_inner());
        if lru.owner.is_empty() {
            return;
        }
        lru.epoch += 1;
        lru.spec_layer = layer as u32;
        let mut reads = Merger::default();
        let mut n = 0u64;
        for &c in likely {
            let c = c as usize;
            if c < lay.hot {
                continue;
            }
            let s = self.slot_held(&mut lru, layer, c);
            if s != NONE {
                lru.touch(s);
                continue;
            }
            let Some(s) = self.claim(&mut lru, layer, c) else { break };
            lru.prefetched[s as usize] = true;
            lru.speculated[s as usize] = true;
            reads.push(&self.io, lay.clusters[c], s);
            n += 1;
        }
        reads.flush(&self.io);
        lru.counts.speculated += n;
    }

    /// The cold slot holding cluster `c` of `layer` (ready or being read),
    /// or [`NONE`]. A slot whose read failed is forgotten (so the cluster is
    /// read again) and [`NONE`] returned.
    fn slot_held(&self, lru: &mut Lru, layer: usize, c: usize) -> u32 {
        let s = lru.slot_of[layer][c];
        if s != NONE && self.shared.state[s as usize].load(Ordering::Acquire) == FAILED {
            lru.slot_of[layer][c] = NONE;
            lru.owner[s as usize] = (NONE, NONE);
            self.shared.state[s as usize].store(EMPTY, Ordering::Relaxed);
            return NONE;
        }
        s
    }

    /// Takes the least recently used slot not used by the current fetch for
    /// cluster `c` of `layer` and marks it [`PENDING`]; `None` if every slot
    /// is in use.
    fn claim(&self, lru: &mut Lru, layer: usize, c: usize) -> Option<u32> {
        let s = lru.head;
        if s == NONE || lru.used[s as usize] == lru.epoch {
            return None;
        }
        // A read still running from an abandoned request must land before reuse.
        while self.shared.state[s as usize].load(Ordering::Acquire) == PENDING {
            std::thread::yield_now();
        }
        let (ol, oc) = lru.owner[s as usize];
        if ol != NONE {
            lru.slot_of[ol as usize][oc as usize] = NONE;
        }
        lru.owner[s as usize] = (layer as u32, c as u32);
        lru.slot_of[layer][c] = s;
        lru.prefetched[s as usize] = false;
        lru.speculated[s as usize] = false;
        lru.touch(s);
        self.shared.state[s as usize].store(PENDING, Ordering::Relaxed);
        Some(s)
    }

    /// The bytes (`n_neurons × bundle_bytes`) of cluster `c` of `layer` at
    /// `loc` (from [`Self::fetch`]), waiting for its read if needed.
    ///
    /// # Errors
    /// [`Error::Io`] if its read failed (e.g. the file shrank while running).
    pub fn cluster(&self, layer: usize, c: usize, loc: Loc) -> Result<&[u8]> {
        let span = self.layers[layer].clusters[c];
        match loc {
            // SAFETY: the hot region is never written after load.
            Loc::Hot(off) => Ok(unsafe { self.hot.slice(off, span.need as usize) }),
            Loc::Slot(s) => {
                let st = &self.shared.state[s as usize];
                let mut state = st.load(Ordering::Acquire);
                if state == PENDING {
                    let t0 = Instant::now();
                    let mut spins = 0u32;
                    while state == PENDING {
                        if spins < 64 {
                            std::hint::spin_loop();
                        } else {
                            std::thread::yield_now();
                        }
                        spins += 1;
                        state = st.load(Ordering::Acquire);
                    }
                    self.wait_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                match state {
                    // SAFETY: READY (acquired): the I/O thread finished writing this slot, and
                    // it is not reassigned while the current layer call uses it.
                    READY => Ok(unsafe { self.shared.slots.slice(s as usize * self.shared.slot_bytes, span.need as usize) }),
                    FAILED => {
                        // The next fetch of this cluster reads it again.
                        let msg = self.shared.error.lock().map(|g| g.clone()).ok().flatten().unwrap_or_else(|| "read failed".into());
                        Err(Error::ClusterRead { layer, cluster: c, offset: span.offset, len: span.need, msg })
                    }
                    _ => Err(Error::Usage(format!("cold slot {s} used before it was fetched"))),
                }
            }
            Loc::None => Err(Error::Usage(format!("layer {layer} cluster {c} used but not fetched"))),
        }
    }

    /// Counters since load (cumulative; subtract with [`CacheStats::since`]).
    pub fn stats(&self) -> CacheStats {
        let mut c = self.lru.lock().unwrap_or_else(|e| e.into_inner()).counts;
        c.bytes_read = self.shared.bytes_read.load(Ordering::Relaxed);
        c.reads = self.shared.reads.load(Ordering::Relaxed);
        c.io_wait_s = self.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9;
        c
    }
}

/// One layer's neuron clusters, wherever they are.
#[derive(Clone, Copy)]
pub enum LayerClusters<'c> {
    /// Fetched through the neuron cache for the current call.
    Cached {
        /// The cache.
        cache: &'c NeuronCache,
        /// Layer index.
        layer: usize,
        /// `[n_clusters]` locations from [`NeuronCache::fetch`].
        table: &'c [Loc],
    },
    /// A whole FFN segment in memory (unit tests, tools): cluster `c`
    /// starts at `offsets[c]` (`NeuronCluster::offset`).
    Segment {
        /// Segment bytes.
        data: &'c [u8],
        /// `[n_clusters]` cluster offsets in `data`, bytes.
        offsets: &'c [u64],
    },
}

impl<'c> LayerClusters<'c> {
    /// Bytes from the start of cluster `c` (at least its bundles), waiting
    /// for its read if needed.
    ///
    /// # Errors
    /// As [`NeuronCache::cluster`].
    #[inline]
    pub fn get(&self, c: usize) -> Result<&'c [u8]> {
        match *self {
            LayerClusters::Cached { cache, layer, table } => cache.cluster(layer, c, table[c]),
            LayerClusters::Segment { data, offsets } => Ok(&data[offsets[c] as usize..]),
        }
    }
}
