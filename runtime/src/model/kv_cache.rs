//! The KV cache: keys and values of every past position, per layer.

/// Keys and values per layer, f32, `[capacity, n_kv_heads * head_dim]` each.
/// Memory is reserved up front but only touched (and so resident) as
/// positions are filled.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    kv_dim: usize,
    capacity: usize,
    len: usize,
}

impl KvCache {
    /// A cache for `n_layers` layers of `kv_dim` (= `n_kv_heads * head_dim`)
    /// elements per position and `capacity` positions (tokens).
    pub fn new(n_layers: usize, kv_dim: usize, capacity: usize) -> Self {
        let mk = || (0..n_layers).map(|_| Vec::with_capacity(capacity * kv_dim)).collect();
        KvCache { k: mk(), v: mk(), kv_dim, capacity, len: 0 }
    }

    /// Bytes the cache holds when full: `2 * layers * capacity * kv_dim * 4`.
    pub fn bytes_at_capacity(n_layers: usize, kv_dim: usize, capacity: usize) -> u64 {
        nflash_plan::layout::kv_cache_bytes(n_layers, kv_dim, capacity)
    }

    /// Positions filled (tokens).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    /// Appends `k`, `v` (`[n, kv_dim]`) to `layer`. All layers must be
    /// appended the same number of rows before [`Self::commit`].
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        self.k[layer].extend_from_slice(k);
        self.v[layer].extend_from_slice(v);
    }

    /// Keys and values of `layer` so far, including rows appended before commit:
    /// `[positions, kv_dim]`.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }

    /// Marks `n` appended positions as filled.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }
}
