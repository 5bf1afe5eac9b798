//! Neuron-cluster checksums (SPEC §4.10, since format 3.4): the CRC-32C
//! (Castagnoli) of every neuron cluster's bundles, stored in one table
//! segment, so a runtime can check each cluster after reading it and before
//! computing with it.
//!
//! The checksum covers a cluster's `n_neurons × bundle_bytes` bytes from its
//! offset, without the alignment padding after it, so it does not depend on
//! how a device merges or aligns its reads.

use crate::manifest::Manifest;

/// Name of the table segment (kind [`crate::SegmentKind::ClusterChecksums`]).
pub const SEGMENT_NAME: &str = "checksums";

/// Bytes per table entry: one little-endian `u32`.
pub const ENTRY_BYTES: u64 = 4;

/// CRC-32C of `bytes` (the `crc-fast` crate's CRC-32/ISCSI: SSE4.2 with
/// PCLMULQDQ on x86-64, the ARMv8 CRC and PMULL instructions on aarch64,
/// chosen at run time; a table-driven fallback elsewhere).
/// `cluster_crc32c(b"123456789") = 0xe3069283`.
#[inline]
pub fn cluster_crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// The CRC-32C of a cluster written in pieces: the same value as
/// [`cluster_crc32c`] of the pieces joined.
pub struct ClusterHasher(crc_fast::Digest);

impl Default for ClusterHasher {
    fn default() -> Self {
        ClusterHasher(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }
}

impl ClusterHasher {
    /// Adds `bytes` after those already hashed.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The CRC-32C of everything added.
    pub fn finish(&self) -> u32 {
        self.0.finalize() as u32
    }
}

/// Neuron clusters of every FFN unit of `m`, in table order (`None` on overflow).
pub fn total_clusters(m: &Manifest) -> Option<u64> {
    m.ffn.iter().try_fold(0u64, |n, f| n.checked_add(f.clusters.len() as u64))
}

/// The table's bytes for `crcs` (one per cluster, units in `Manifest.ffn`
/// order, clusters in order within each unit).
pub fn encode(crcs: &[u32]) -> Vec<u8> {
    crcs.iter().flat_map(|c| c.to_le_bytes()).collect()
}

/// The decoded table: cluster `c` of FFN unit `u` has checksum
/// `crcs[start[u] + c]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterChecksums {
    crcs: Vec<u32>,
    /// `[units + 1]`: index of each unit's first entry, then the total.
    start: Vec<usize>,
}

impl ClusterChecksums {
    /// Decodes the table segment's `bytes` for manifest `m`.
    ///
    /// # Errors
    /// Why the table does not fit `m`: its length is not 4 bytes per neuron
    /// cluster of `m` (SPEC §4.10).
    pub fn decode(bytes: &[u8], m: &Manifest) -> Result<Self, String> {
        let total = total_clusters(m).ok_or("the cluster count overflows")?;
        if Some(bytes.len() as u64) != total.checked_mul(ENTRY_BYTES) {
            return Err(format!(
                "{} bytes, but the manifest has {total} neuron clusters ({ENTRY_BYTES} bytes each)",
                bytes.len()
            ));
        }
        let crcs = bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let mut start = Vec::with_capacity(m.ffn.len() + 1);
        let mut at = 0usize;
        for f in &m.ffn {
            start.push(at);
            at += f.clusters.len();
        }
        start.push(at);
        Ok(ClusterChecksums { crcs, start })
    }

    /// The checksums of FFN unit `u`'s clusters (`[n_clusters]`).
    ///
    /// # Panics
    /// If `u` is not a unit of the manifest the table was decoded for.
    pub fn unit(&self, u: usize) -> &[u32] {
        &self.crcs[self.start[u]..self.start[u + 1]]
    }

    /// Every checksum, in table order.
    pub fn all(&self) -> &[u32] {
        &self.crcs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_is_castagnoli_and_appends() {
        // The check value of CRC-32C (RFC 3720 appendix B.4 uses this polynomial).
        assert_eq!(cluster_crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(cluster_crc32c(b""), 0);
        let whole = cluster_crc32c(b"neuron cluster bytes");
        let mut h = ClusterHasher::default();
        h.update(b"neuron ");
        h.update(b"cluster bytes");
        assert_eq!(h.finish(), whole);
        // Long inputs take the vector path: against a bitwise reference.
        let long: Vec<u8> = (0..100_003u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let mut crc = !0u32;
        for &b in &long {
            crc ^= b as u32;
            for _ in 0..8 {
                crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
            }
        }
        assert_eq!(cluster_crc32c(&long), !crc);
        // Not the IEEE CRC-32 of segment checksums.
        assert_ne!(cluster_crc32c(b"123456789"), crc32fast::hash(b"123456789"));
    }

    #[test]
    fn encode_is_little_endian_u32s() {
        assert_eq!(encode(&[1, 0xa1b2_c3d4]), [1, 0, 0, 0, 0xd4, 0xc3, 0xb2, 0xa1]);
    }
}
