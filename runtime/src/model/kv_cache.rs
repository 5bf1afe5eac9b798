//! The KV cache: keys and values of every past position, per layer, in f16
//! (the default) or f32 ([`KvType`]). A sliding-window layer keeps only a
//! ring of its last positions: its window plus room for one pass
//! (`nflash_plan::layout::kv_layer_capacity`). The ring is stored as
//! contiguous rows that are moved back to the start of the buffer when a
//! pass would not fit behind them (the `W − 1` rows the pass's first token
//! attends to are kept), so the attention kernels always read one run of
//! rows; the move costs `W − 1` rows once every `room` tokens.

use half::f16;
use half::slice::HalfFloatSliceExt;
pub use nflash_plan::KvType;

use crate::kernels::KvSlice;

/// One layer's keys or values, `[positions, kv_dim]`.
enum Rows {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Rows {
    fn new(kv: KvType, cap: usize) -> Self {
        match kv {
            KvType::F16 => Rows::F16(Vec::with_capacity(cap)),
            KvType::F32 => Rows::F32(Vec::with_capacity(cap)),
        }
    }

    /// Appends `x` (f32), rounding to f16 for an f16 cache.
    fn extend(&mut self, x: &[f32]) {
        match self {
            Rows::F16(v) => {
                let n = v.len();
                v.resize(n + x.len(), f16::ZERO);
                v[n..].convert_from_f32_slice(x);
            }
            Rows::F32(v) => v.extend_from_slice(x),
        }
    }

    fn truncate(&mut self, n: usize) {
        match self {
            Rows::F16(v) => v.truncate(n),
            Rows::F32(v) => v.truncate(n),
        }
    }

    /// Drops the first `n` elements, moving the rest to the start.
    fn drop_front(&mut self, n: usize) {
        match self {
            Rows::F16(v) => drop(v.drain(..n)),
            Rows::F32(v) => drop(v.drain(..n)),
        }
    }

    /// Elements held.
    fn len(&self) -> usize {
        match self {
            Rows::F16(v) => v.len(),
            Rows::F32(v) => v.len(),
        }
    }

    fn view(&self) -> KvSlice<'_> {
        match self {
            Rows::F16(v) => KvSlice::F16(v),
            Rows::F32(v) => KvSlice::F32(v),
        }
    }
}

/// Keys and values per layer, `[rows, n_kv_heads * head_dim]` each, where
/// layer `l`'s rows are positions `first[l]..`: every position for a
/// global layer (`first` 0), the last ones for a sliding-window layer.
/// Memory is reserved up front (each layer's ring size) but only touched
/// (and so resident) as positions are filled.
pub struct KvCache {
    layers: Vec<LayerKv>,
    kv: KvType,
    kv_dim: usize,
    capacity: usize,
    len: usize,
    /// A position [`Self::truncate`] must be able to return to
    /// ([`Self::hold`]); `usize::MAX` for none.
    hold: usize,
}

/// One layer's keys and values.
struct LayerKv {
    k: Rows,
    v: Rows,
    /// Its sliding window (positions a token attends to, itself included),
    /// `None` for a global layer.
    window: Option<usize>,
    /// The rows reserved (a sliding-window layer's ring size).
    ring: usize,
    /// The position of its first row.
    first: usize,
}

impl LayerKv {
    /// Rows held.
    fn rows(&self, kv_dim: usize) -> usize {
        self.k.len() / kv_dim
    }
}

impl KvCache {
    /// A cache of `kv` elements for `n_layers` global layers of `kv_dim` (=
    /// `n_kv_heads * head_dim`) elements per position and `capacity`
    /// positions (tokens).
    pub fn new(n_layers: usize, kv_dim: usize, capacity: usize, kv: KvType) -> Self {
        Self::with_layers(&vec![(None, capacity); n_layers], kv_dim, capacity, kv)
    }

    /// A cache for `capacity` positions (tokens) whose layer `l` has sliding
    /// window `layers[l].0` (`None`: global) and reserves `layers[l].1`
    /// rows (`nflash_plan::layout::kv_layer_capacity`).
    pub fn with_layers(layers: &[(Option<usize>, usize)], kv_dim: usize, capacity: usize, kv: KvType) -> Self {
        let layers = layers
            .iter()
            .map(|&(window, ring)| LayerKv {
                k: Rows::new(kv, ring * kv_dim),
                v: Rows::new(kv, ring * kv_dim),
                window,
                ring,
                first: 0,
            })
            .collect();
        KvCache { layers, kv, kv_dim, capacity, len: 0, hold: usize::MAX }
    }

    /// The element type.
    pub fn kv_type(&self) -> KvType {
        self.kv
    }

    /// Positions filled (tokens).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Maximum positions (tokens).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether [`Self::truncate`] to `len` positions keeps them: every
    /// sliding-window layer still holds the positions that the token at
    /// `len` attends to.
    pub fn can_truncate_to(&self, len: usize) -> bool {
        len <= self.len && self.layers.iter().all(|l| l.window.is_none_or(|w| l.first <= (len + 1).saturating_sub(w)))
    }

    /// Drops positions `len..` (and rows appended but not committed), so a
    /// conversation can continue from a shared prefix, and returns the
    /// positions kept: `len` (at most the length),
    /// or 0 when a sliding-window layer no longer holds what position `len`
    /// attends to ([`Self::can_truncate_to`]), in which case the cache is
    /// emptied and the caller prefills from the start.
    pub fn truncate(&mut self, len: usize) -> usize {
        // Rows appended by a pass that failed before its commit go too.
        let len = len.min(self.len);
        let len = if self.can_truncate_to(len) { len } else { 0 };
        self.len = len;
        for l in &mut self.layers {
            if len == 0 {
                l.first = 0;
            }
            let n = (len - l.first) * self.kv_dim;
            l.k.truncate(n);
            l.v.truncate(n);
        }
        len
    }

    /// Keeps truncating back to `len` possible while passes run one token
    /// at a time (a draft's guesses, issue 47): until `hold(None)`, each
    /// sliding-window layer keeps every row that position `len` attends to
    /// (its ring grows by those passes' rows past its room, if it must).
    pub fn hold(&mut self, len: Option<usize>) {
        self.hold = len.unwrap_or(usize::MAX);
    }

    /// Appends `k`, `v` (`[n, kv_dim]`, f32: positions `len()..len() + n`)
    /// to `layer`. All layers must be appended the same number of rows
    /// before [`Self::commit`]. A sliding-window layer whose ring would
    /// overflow first drops the rows before the `W − 1` that position
    /// `len()` attends to; a pass longer than the ring's room grows it.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let kv_dim = self.kv_dim;
        let l = &mut self.layers[layer];
        if let Some(w) = l.window {
            let keep_from = (self.len.min(self.hold) + 1).saturating_sub(w);
            if l.rows(kv_dim) + k.len() / kv_dim > l.ring && keep_from > l.first {
                let drop = (keep_from - l.first) * kv_dim;
                l.k.drop_front(drop);
                l.v.drop_front(drop);
                l.first = keep_from;
            }
        }
        l.k.extend(k);
        l.v.extend(v);
    }

    /// Keys and values of `layer` so far, including rows appended before
    /// commit: `[rows, kv_dim]`, and the position of the first row.
    pub fn layer(&self, layer: usize) -> (KvSlice<'_>, KvSlice<'_>, usize) {
        let l = &self.layers[layer];
        (l.k.view(), l.v.view(), l.first)
    }

    /// Rows (positions) layer `layer` holds now.
    pub fn layer_rows(&self, layer: usize) -> usize {
        self.layers[layer].rows(self.kv_dim)
    }

    /// Marks `n` appended positions as filled.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of a pass that failed before its commit are dropped by a
    /// truncation to the committed length, so the next pass's positions
    /// line up; a sliding layer's ring moves past old positions only when
    /// full, and a truncation further back than it holds empties the cache.
    #[test]
    fn truncate_drops_uncommitted_rows_and_rings_keep_their_window() {
        let mut kv = KvCache::with_layers(&[(None, 64), (Some(3), 6)], 2, 64, KvType::F32);
        let rows = |n: usize, v: f32| vec![v; n * 2];
        for l in 0..2 {
            kv.append(l, &rows(4, 1.0), &rows(4, 1.0));
        }
        kv.commit(4);
        // A failed pass: appended, never committed.
        kv.append(0, &rows(2, 9.0), &rows(2, 9.0));
        assert_eq!(kv.layer_rows(0), 6);
        assert_eq!(kv.truncate(4), 4);
        assert_eq!((kv.layer_rows(0), kv.layer_rows(1)), (4, 4));
        // 3 more: the ring (6 rows) moves to positions 2.. (the 2 that
        // position 4, the pass's first, attends to, and the pass).
        for l in 0..2 {
            kv.append(l, &rows(3, 2.0), &rows(3, 2.0));
        }
        kv.commit(3);
        assert_eq!(kv.layer(1).2, 2);
        assert_eq!(kv.layer_rows(1), 5);
        assert!(kv.can_truncate_to(4) && !kv.can_truncate_to(3));
        assert_eq!(kv.truncate(5), 5);
        assert_eq!(kv.truncate(3), 0);
        assert!(kv.is_empty() && kv.layer_rows(0) == 0 && kv.layer(1).2 == 0);
    }

    /// One-token passes after `hold(Some(p))` (a draft's) keep truncation
    /// to `p` possible though the ring fills; without the hold they do not.
    #[test]
    fn a_hold_keeps_a_truncation_back_to_it_possible() {
        for held in [false, true] {
            let mut kv = KvCache::with_layers(&[(Some(3), 4)], 2, 64, KvType::F32);
            let row = vec![1f32; 2];
            let step = |kv: &mut KvCache| {
                kv.append(0, &row, &row);
                kv.commit(1);
            };
            (0..6).for_each(|_| step(&mut kv));
            kv.hold(held.then_some(6));
            (0..4).for_each(|_| step(&mut kv));
            assert_eq!(kv.can_truncate_to(6), held, "hold {held}");
            kv.hold(None);
            assert_eq!(kv.truncate(6), if held { 6 } else { 0 });
        }
    }
}
