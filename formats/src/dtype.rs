//! Element and block types of stored tensors (SPEC §5).
//!
//! Quantized layouts are bit-identical to GGML's `block_q4_0` and
//! `block_q8_0`, so kernels written for GGML (candle-core's
//! `k_quants::BlockQ4_0`/`BlockQ8_0`) can read the mapped bytes directly.

use serde::{Deserialize, Serialize};

/// Storage type of a tensor row. The serialized tag is the variant index:
/// F32 = 0, F16 = 1, Q8_0 = 2, Q4_0 = 3 (SPEC §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE 754 binary32, 4 bytes per element.
    F32,
    /// IEEE 754 binary16, 2 bytes per element.
    F16,
    /// GGML Q8_0: blocks of 32 elements, f16 scale `d` then 32 × i8 (34 bytes).
    Q8_0,
    /// GGML Q4_0: blocks of 32 elements, f16 scale `d` then 16 bytes of
    /// nibbles; element j is the low nibble of byte j, element j+16 the high
    /// nibble, value = (q − 8) · d (18 bytes).
    Q4_0,
}

impl DType {
    /// Elements per block (1 for float types, 32 for Q8_0/Q4_0).
    pub const fn block_elems(self) -> u64 {
        match self {
            DType::F32 | DType::F16 => 1,
            DType::Q8_0 | DType::Q4_0 => 32,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
        }
    }

    /// Whether this is a block-quantized type.
    pub const fn is_quantized(self) -> bool {
        matches!(self, DType::Q8_0 | DType::Q4_0)
    }

    /// Bytes of a row of `n_elems` elements, or `None` when `n_elems` is not
    /// a multiple of [`Self::block_elems`] or the product overflows.
    pub fn row_bytes(self, n_elems: u64) -> Option<u64> {
        if !n_elems.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n_elems / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// Bytes of a row-major tensor of `shape` (the last dimension is the row),
    /// or `None` on overflow / a row length not a multiple of the block size.
    pub fn tensor_bytes(self, shape: &[u64]) -> Option<u64> {
        let (&row, rest) = shape.split_last()?;
        let rows = rest.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        self.row_bytes(row)?.checked_mul(rows)
    }

    /// Lower-case name as used on the command line (`q4_0`, `q8_0`, `f16`, `f32`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(DType::F32),
            "f16" => Ok(DType::F16),
            "q8_0" => Ok(DType::Q8_0),
            "q4_0" => Ok(DType::Q4_0),
            _ => Err(format!("unknown type {s:?}: expected one of q4_0, q8_0, f16, f32")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_match_ggml() {
        assert_eq!(DType::Q4_0.row_bytes(576), Some(18 * 18));
        assert_eq!(DType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(DType::F16.row_bytes(3), Some(6));
        assert_eq!(DType::Q4_0.row_bytes(33), None);
        assert_eq!(DType::F32.tensor_bytes(&[2, 3]), Some(24));
        assert_eq!(DType::F32.tensor_bytes(&[u64::MAX, 3]), None);
    }
}
