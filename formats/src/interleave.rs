//! The in-memory Q4_0×8 layout (SPEC §5.1): a Q4_0 matrix `[rows, cols]`
//! (rows a multiple of [`Q4_0X8_ROWS`]) reordered so that each group of 8
//! consecutive rows is one sequential stream. Within group `g`, column block
//! `b` (32 elements) is 144 bytes: the 8 rows' f16 scales (16 bytes), then
//! the 8 rows' 16 bytes of packed nibbles. Same size as the row layout.
//!
//! A decode matrix-vector product then reads one stream per group instead of
//! one per row, and the kernel handles two rows per 256-bit register (the
//! idea of llama.cpp's repacked `block_q4_0x8`). Packs store the row layout;
//! [`crate::Pack::interleave_q4_0`] converts resident tensors after loading.

/// Rows per interleaved group.
pub const Q4_0X8_ROWS: usize = 8;
/// Bytes of one Q4_0 block (f16 scale + 16 bytes of nibbles), SPEC §5.
const BLOCK: usize = 18;
/// Bytes of one column block of a group: 8 scales then 8 × 16 nibble bytes.
pub const Q4_0X8_GROUP_BLOCK: usize = Q4_0X8_ROWS * BLOCK;

/// Whether a Q4_0 matrix `[rows, cols]` can take the Q4_0×8 layout.
pub fn can_interleave(rows: u64, cols: u64) -> bool {
    rows > 0 && rows.is_multiple_of(Q4_0X8_ROWS as u64) && cols > 0 && cols.is_multiple_of(32)
}

/// Reorders a Q4_0 matrix of `cols` elements per row from the row layout to
/// the Q4_0×8 layout, in place, one group at a time (`scratch` grows to one
/// group, `8 × cols / 32 × 18` bytes).
///
/// Panics if `data.len()` is not a whole number of 8-row groups; callers
/// check shapes with [`can_interleave`] first.
pub fn interleave_q4_0(data: &mut [u8], cols: usize, scratch: &mut Vec<u8>) {
    let nb = cols / 32;
    let group = Q4_0X8_ROWS * nb * BLOCK;
    assert!(
        cols.is_multiple_of(32) && data.len().is_multiple_of(group),
        "Q4_0×8: {} bytes is not a whole number of 8-row groups of {cols} columns",
        data.len()
    );
    scratch.clear();
    scratch.resize(group, 0);
    for g in data.chunks_exact_mut(group) {
        scratch.copy_from_slice(g);
        for b in 0..nb {
            let out = &mut g[b * Q4_0X8_GROUP_BLOCK..(b + 1) * Q4_0X8_GROUP_BLOCK];
            for r in 0..Q4_0X8_ROWS {
                let src = &scratch[(r * nb + b) * BLOCK..][..BLOCK];
                out[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                out[16 + 16 * r..32 + 16 * r].copy_from_slice(&src[2..]);
            }
        }
    }
}

/// Row `r`'s bytes in the row layout (`cols / 32` blocks of 18 bytes, into
/// `out`), read from a matrix in the Q4_0×8 layout.
///
/// Panics if `r` is outside `data` or `out` is not one row long.
pub fn q4_0x8_row(data: &[u8], cols: usize, r: usize, out: &mut [u8]) {
    let nb = cols / 32;
    assert_eq!(out.len(), nb * BLOCK, "Q4_0×8 row buffer");
    let g = &data[(r / Q4_0X8_ROWS) * Q4_0X8_ROWS * nb * BLOCK..][..Q4_0X8_ROWS * nb * BLOCK];
    let i = r % Q4_0X8_ROWS;
    for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
        let blk = &g[b * Q4_0X8_GROUP_BLOCK..];
        o[..2].copy_from_slice(&blk[2 * i..2 * i + 2]);
        o[2..].copy_from_slice(&blk[16 + 16 * i..32 + 16 * i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_comes_back_from_the_interleaved_layout() {
        let (rows, cols) = (16, 96);
        let rb = cols / 32 * BLOCK;
        let orig: Vec<u8> = (0..rows * rb).map(|i| (i * 7 + i / 13) as u8).collect();
        let mut m = orig.clone();
        interleave_q4_0(&mut m, cols, &mut Vec::new());
        assert_ne!(m, orig);
        let mut row = vec![0u8; rb];
        for r in 0..rows {
            q4_0x8_row(&m, cols, r, &mut row);
            assert_eq!(row, orig[r * rb..(r + 1) * rb], "row {r}");
        }
        // Group 1, block 2: row 8's scale first, row 9's nibbles at 32.
        let blk = &m[8 * rb + 2 * Q4_0X8_GROUP_BLOCK..];
        assert_eq!(blk[..2], orig[8 * rb + 2 * BLOCK..][..2]);
        assert_eq!(blk[32..48], orig[9 * rb + 2 * BLOCK + 2..][..16]);
    }

    #[test]
    fn shapes_that_cannot_interleave() {
        assert!(can_interleave(8, 32) && can_interleave(4096, 4096));
        assert!(!can_interleave(12, 32) && !can_interleave(8, 48) && !can_interleave(0, 32));
    }
}
