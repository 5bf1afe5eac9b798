//! The KV cache: keys and values of every past position, per layer, in f16
//! (the default) or f32 ([`KvType`]).

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

    fn view(&self) -> KvSlice<'_> {
        match self {
            Rows::F16(v) => KvSlice::F16(v),
            Rows::F32(v) => KvSlice::F32(v),
        }
    }
}

/// Keys and values per layer, `[capacity, n_kv_heads * head_dim]` each.
/// Memory is reserved up front but only touched (and so resident) as
/// positions are filled.
pub struct KvCache {
    k: Vec<Rows>,
    v: Vec<Rows>,
    kv: KvType,
    kv_dim: usize,
    capacity: usize,
    len: usize,
}

impl KvCache {
    /// A cache of `kv` elements for `n_layers` layers of `kv_dim` (=
    /// `n_kv_heads * head_dim`) elements per position and `capacity`
    /// positions (tokens).
    pub fn new(n_layers: usize, kv_dim: usize, capacity: usize, kv: KvType) -> Self {
        let mk = || (0..n_layers).map(|_| Rows::new(kv, capacity * kv_dim)).collect();
        KvCache { k: mk(), v: mk(), kv, kv_dim, capacity, len: 0 }
    }

    /// Bytes the cache holds when full: `2 * layers * capacity * kv_dim * kv.bytes()`.
    pub fn bytes_at_capacity(n_layers: usize, kv_dim: usize, capacity: usize, kv: KvType) -> u64 {
        nflash_plan::layout::kv_cache_bytes(n_layers, kv_dim, capacity, kv)
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
        self.k.len()
    }

    /// Maximum positions (tokens).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Drops positions `len..`, so a conversation can continue from a shared prefix.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            let n = len * self.kv_dim;
            self.k.iter_mut().for_each(|k| k.truncate(n));
            self.v.iter_mut().for_each(|v| v.truncate(n));
        }
    }

    /// Appends `k`, `v` (`[n, kv_dim]`, f32) to `layer`. All layers must be
    /// appended the same number of rows before [`Self::commit`].
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        self.k[layer].extend(k);
        self.v[layer].extend(v);
    }

    /// Keys and values of `layer` so far, including rows appended before commit:
    /// `[positions, kv_dim]`.
    pub fn layer(&self, layer: usize) -> (KvSlice<'_>, KvSlice<'_>) {
        (self.k[layer].view(), self.v[layer].view())
    }

    /// Marks `n` appended positions as filled.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }
}
