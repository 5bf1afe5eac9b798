//! The in-memory ×8 layouts (SPEC §5.1): a Q4_0 or Q8_0 matrix `[rows, cols]`
//! (rows a multiple of [`X8_ROWS`]) reordered so that each group of 8
//! consecutive rows is one sequential stream. Within group `g`, column
//! block `b` (32 elements) holds the 8 rows' f16 scales (16 bytes), then
//! the rows' quant bytes (16 per row for Q4_0, 32 for Q8_0) four at a
//! time: word `j` of row `r` at byte `16 + 32 j + 4 r`. A 256-bit register
//! loaded from there has one row per 32-bit lane, so a kernel sums each
//! row in its own lane and computes 8 rows × several tokens per pass (the
//! idea of llama.cpp's repacked `block_q4_0x8`). Same size as the row
//! layout. Packs store the row layout; [`crate::Pack::interleave`] converts
//! resident tensors after loading, and [`pack_group`] builds one group from
//! any 8 rows (the FFN's neuron bundles, for prefill).

use crate::DType;

/// Rows per interleaved group.
pub const X8_ROWS: usize = 8;
/// Bytes of the 8 f16 scales at the start of a group's column block.
const SCALES: usize = 2 * X8_ROWS;

/// Bytes of one column block of a group (8 rows × 32 elements) of `dtype`:
/// 144 for Q4_0, 272 for Q8_0; `None` for types without a ×8 layout.
pub fn group_block_bytes(dtype: DType) -> Option<usize> {
    quant_bytes(dtype).map(|q| SCALES + X8_ROWS * q)
}

/// Quant bytes of one 32-element block of `dtype` (after its f16 scale).
fn quant_bytes(dtype: DType) -> Option<usize> {
    match dtype {
        DType::Q4_0 => Some(16),
        DType::Q8_0 => Some(32),
        DType::F32 | DType::F16 => None,
    }
}

/// Whether a matrix `[rows, cols]` of `dtype` can take the ×8 layout.
pub fn can_interleave(dtype: DType, rows: u64, cols: u64) -> bool {
    quant_bytes(dtype).is_some()
        && rows > 0
        && rows.is_multiple_of(X8_ROWS as u64)
        && cols > 0
        && cols.is_multiple_of(32)
}

/// Writes one ×8 group (`cols / 32` column blocks, [`group_block_bytes`]
/// each) into `out` from 8 rows in the row layout (`cols / 32` blocks of
/// 18 or 34 bytes each); a `None` row is written as zeros (scale 0).
///
/// Panics if `dtype` has no ×8 layout or a length does not match (caller bugs).
pub fn pack_group(dtype: DType, cols: usize, rows: [Option<&[u8]>; X8_ROWS], out: &mut [u8]) {
    let (q, gb) = (quant_bytes(dtype).expect("×8 dtype"), group_block_bytes(dtype).expect("×8 dtype"));
    let (nb, block) = (cols / 32, 2 + q);
    assert_eq!(out.len(), nb * gb, "×8 group of {cols} columns");
    for (r, row) in rows.iter().enumerate() {
        let Some(row) = row else {
            for b in 0..nb {
                let o = &mut out[b * gb..(b + 1) * gb];
                o[2 * r..2 * r + 2].fill(0);
                for j in 0..q / 4 {
                    o[SCALES + 32 * j + 4 * r..][..4].fill(0);
                }
            }
            continue;
        };
        assert!(row.len() >= nb * block, "row {r} of a ×8 group is short");
        for b in 0..nb {
            let (src, o) = (&row[b * block..(b + 1) * block], &mut out[b * gb..(b + 1) * gb]);
            o[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
            for j in 0..q / 4 {
                o[SCALES + 32 * j + 4 * r..][..4].copy_from_slice(&src[2 + 4 * j..6 + 4 * j]);
            }
        }
    }
}

/// Reorders a Q4_0 or Q8_0 matrix of `cols` elements per row from the row
/// layout to the ×8 layout, in place, one group at a time (`scratch` grows
/// to one group).
///
/// Panics if `data.len()` is not a whole number of 8-row groups; callers
/// check shapes with [`can_interleave`] first.
pub fn interleave(dtype: DType, data: &mut [u8], cols: usize, scratch: &mut Vec<u8>) {
    let row = dtype.row_bytes(cols as u64).expect("row size") as usize;
    let group = X8_ROWS * row;
    assert!(
        can_interleave(dtype, X8_ROWS as u64, cols as u64) && data.len().is_multiple_of(group),
        "{dtype}×8: {} bytes is not a whole number of 8-row groups of {cols} columns",
        data.len()
    );
    scratch.clear();
    scratch.extend_from_slice(&data[..group]);
    for g in data.chunks_exact_mut(group) {
        scratch.copy_from_slice(g);
        let rows = std::array::from_fn(|r| Some(&scratch[r * row..(r + 1) * row]));
        pack_group(dtype, cols, rows, g);
    }
}

/// Row `r`'s bytes in the row layout (into `out`, one row long), read from
/// a `dtype` matrix in the ×8 layout.
///
/// Panics if `r` is outside `data` or `out` is not one row long.
pub fn x8_row(dtype: DType, data: &[u8], cols: usize, r: usize, out: &mut [u8]) {
    let (q, gb) = (quant_bytes(dtype).expect("×8 dtype"), group_block_bytes(dtype).expect("×8 dtype"));
    let (nb, block) = (cols / 32, 2 + q);
    assert_eq!(out.len(), nb * block, "{dtype}×8 row buffer");
    let g = &data[(r / X8_ROWS) * nb * gb..][..nb * gb];
    let i = r % X8_ROWS;
    for (b, o) in out.chunks_exact_mut(block).enumerate() {
        let blk = &g[b * gb..];
        o[..2].copy_from_slice(&blk[2 * i..2 * i + 2]);
        for j in 0..q / 4 {
            o[2 + 4 * j..6 + 4 * j].copy_from_slice(&blk[SCALES + 32 * j + 4 * i..][..4]);
        }
    }
}

/// Reorders the `n` neuron bundles of one cluster (each gate row | up row
/// | down column of `cols` elements of `dtype`, SPEC §4.4) to the ×8 bundle
/// layout, in place: every full run of 8 bundles (bundles `8g .. 8g+8`, at
/// byte `8g · bundle_bytes`) becomes their 8 gate rows as one ×8 group, then
/// their 8 up rows, then their 8 down columns (each [`pack_group`]); the last
/// `n mod 8` bundles keep the row layout. The size is unchanged and a group
/// starts where its first bundle did. `scratch` grows to one group.
///
/// Panics if `dtype` has no ×8 layout, `cols` is not a multiple of 32 or
/// `data` is shorter than `n` bundles (callers check [`can_interleave`]).
pub fn interleave_bundles(dtype: DType, cols: usize, n: usize, data: &mut [u8], scratch: &mut Vec<u8>) {
    assert!(can_interleave(dtype, X8_ROWS as u64, cols as u64), "{dtype} bundles of {cols} columns have no ×8 layout");
    let row = dtype.row_bytes(cols as u64).expect("row size") as usize;
    let group = X8_ROWS * 3 * row;
    for g in data[..n / X8_ROWS * group].chunks_exact_mut(group) {
        scratch.clear();
        scratch.extend_from_slice(g);
        for (m, out) in g.chunks_exact_mut(X8_ROWS * row).enumerate() {
            let rows = std::array::from_fn(|r| Some(&scratch[(3 * r + m) * row..(3 * r + m + 1) * row]));
            pack_group(dtype, cols, rows, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bundle `i` of a cluster of `n` bundles in the ×8 bundle layout
    /// ([`interleave_bundles`]) back in the row layout (gate row | up row |
    /// down column) into `out` (one bundle long).
    ///
    /// Panics if `i >= n`, `data` is short or `out` is not one bundle long.
    fn x8_bundle(dtype: DType, cols: usize, n: usize, data: &[u8], i: usize, out: &mut [u8]) {
        assert!(i < n, "bundle {i} of {n}");
        let row = dtype.row_bytes(cols as u64).expect("row size") as usize;
        assert_eq!(out.len(), 3 * row, "{dtype} bundle buffer");
        if i >= n / X8_ROWS * X8_ROWS {
            out.copy_from_slice(&data[i * 3 * row..(i + 1) * 3 * row]);
            return;
        }
        let group = &data[i / X8_ROWS * X8_ROWS * 3 * row..][..X8_ROWS * 3 * row];
        for (m, o) in out.chunks_exact_mut(row).enumerate() {
            x8_row(dtype, &group[m * X8_ROWS * row..(m + 1) * X8_ROWS * row], cols, i % X8_ROWS, o);
        }
    }

    #[test]
    fn every_row_comes_back_from_the_interleaved_layout() {
        for (dt, block) in [(DType::Q4_0, 18), (DType::Q8_0, 34)] {
            let (rows, cols) = (16, 96);
            let rb = cols / 32 * block;
            let orig: Vec<u8> = (0..rows * rb).map(|i| (i * 7 + i / 13) as u8).collect();
            let mut m = orig.clone();
            interleave(dt, &mut m, cols, &mut Vec::new());
            assert_ne!(m, orig);
            let mut row = vec![0u8; rb];
            for r in 0..rows {
                x8_row(dt, &m, cols, r, &mut row);
                assert_eq!(row, orig[r * rb..(r + 1) * rb], "{dt} row {r}");
            }
            // Group 1, block 2: row 8's scale first; row 9's quant bytes 4..8 at 16 + 32 + 4.
            let gb = group_block_bytes(dt).unwrap();
            let blk = &m[8 * rb + 2 * gb..];
            assert_eq!(blk[..2], orig[8 * rb + 2 * block..][..2]);
            assert_eq!(blk[52..56], orig[9 * rb + 2 * block + 2 + 4..][..4]);
        }
    }

    #[test]
    fn every_bundle_comes_back_from_the_x8_bundle_layout() {
        for (dt, block) in [(DType::Q4_0, 18), (DType::Q8_0, 34)] {
            // 19 bundles: two full groups of 8, then 3 left in the row layout.
            let (n, cols) = (19, 64);
            let bb = 3 * cols / 32 * block;
            let orig: Vec<u8> = (0..n * bb + 5).map(|i| (i * 11 + i / 7) as u8).collect();
            let mut m = orig.clone();
            interleave_bundles(dt, cols, n, &mut m, &mut Vec::new());
            assert_ne!(m[..16 * bb], orig[..16 * bb]);
            assert_eq!(m[16 * bb..], orig[16 * bb..], "{dt}: the tail keeps the row layout");
            let mut b = vec![0u8; bb];
            for i in 0..n {
                x8_bundle(dt, cols, n, &m, i, &mut b);
                assert_eq!(b, orig[i * bb..(i + 1) * bb], "{dt} bundle {i}");
            }
            // Group 1's up rows are one ×8 group: its row 2 is bundle 10's up row.
            let (rb, mut r) = (bb / 3, vec![0u8; bb / 3]);
            x8_row(dt, &m[8 * bb + 8 * rb..8 * bb + 16 * rb], cols, 2, &mut r);
            assert_eq!(r, orig[10 * bb + rb..10 * bb + 2 * rb]);
        }
    }

    #[test]
    fn a_missing_row_is_packed_as_zeros() {
        let cols = 64;
        let row: Vec<u8> = (0..2 * 34).map(|i| i as u8 + 1).collect();
        let mut out = vec![0xAAu8; 2 * 272];
        let rows = std::array::from_fn(|r| (r != 3).then_some(&row[..]));
        pack_group(DType::Q8_0, cols, rows, &mut out);
        let mut back = vec![0u8; 68];
        x8_row(DType::Q8_0, &out, cols, 3, &mut back);
        assert!(back.iter().all(|&b| b == 0));
        x8_row(DType::Q8_0, &out, cols, 4, &mut back);
        assert_eq!(back, row);
    }

    #[test]
    fn shapes_that_cannot_interleave() {
        assert!(can_interleave(DType::Q4_0, 8, 32) && can_interleave(DType::Q8_0, 4096, 4096));
        assert!(!can_interleave(DType::Q4_0, 12, 32) && !can_interleave(DType::Q4_0, 8, 48));
        assert!(!can_interleave(DType::Q8_0, 0, 32) && !can_interleave(DType::F16, 8, 32));
    }
}
