//! Plain-Rust kernels: the reference every ISA-specific kernel is tested
//! against, and what runs on CPUs without one.
//!
//! They compute exactly what the x86 kernels ([`super::x86`]) compute, in
//! the same order: per 32-element block, integer sums over the same lanes
//! (exact), then the same float steps, with `f32::mul_add` where the SIMD
//! code uses a fused multiply-add. So a row gives the same bits on either
//! path, and the ISA files can be checked bit for bit. Block layouts: GGML
//! Q4_0 (18 bytes: f16 scale, 16 bytes of nibbles, element `i` in the low
//! nibble of byte `i`, element `16 + i` in its high nibble) and Q8_0 (34
//! bytes: f16 scale, 32 × i8) — formats/SPEC.md §5; Q4_0×8 groups — §5.1.

use half::f16;
use nflash_format::interleave::Q4_0X8_GROUP_BLOCK;

/// Bytes of a Q4_0 block.
const Q4_0_BLOCK: usize = 18;
/// Bytes of a Q8_0 block.
const Q8_0_BLOCK: usize = 34;

/// The f16 at `b[0..2]` (little-endian) as f32.
#[inline]
fn f16_le(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Integer dot of one Q4_0 block's 16 nibble bytes `q` with 32 i8 `y`, as the
/// 4 lanes the x86 kernels keep: lane `j` sums elements `4j..4j+4` and
/// `16+4j..16+4j+4` of `(nibble − 8) · y`.
#[inline]
fn q4_0_lanes(q: &[u8], y: &[u8]) -> [i32; 4] {
    let mut lanes = [0i32; 4];
    for (j, lane) in lanes.iter_mut().enumerate() {
        for i in 4 * j..4 * j + 4 {
            let lo = (q[i] & 0x0F) as i32 - 8;
            let hi = (q[i] >> 4) as i32 - 8;
            *lane += lo * y[i] as i8 as i32 + hi * y[16 + i] as i8 as i32;
        }
    }
    lanes
}

/// Sum of 4 lanes as `(l0 + l2) + (l1 + l3)` (the x86 `hsum4` order).
#[inline]
fn sum4(l: [f32; 4]) -> f32 {
    (l[0] + l[2]) + (l[1] + l[3])
}

/// Dot of one Q4_0 row (`nb` blocks) with the Q8_0 vector `y` (`nb` blocks).
fn dot_q4_0(nb: usize, row: &[u8], y: &[u8]) -> f32 {
    let mut acc = [0f32; 4];
    for b in 0..nb {
        let (x, yb) = (&row[b * Q4_0_BLOCK..], &y[b * Q8_0_BLOCK..]);
        let (dx, dy) = (f16_le(x), f16_le(yb));
        let lanes = q4_0_lanes(&x[2..18], &yb[2..34]);
        for (a, l) in acc.iter_mut().zip(lanes) {
            *a = dx.mul_add(l as f32 * dy, *a);
        }
    }
    sum4(acc)
}

/// Dot of one Q8_0 row (`nb` blocks) with the Q8_0 vector `y`: 8 lanes of 4
/// elements each, summed as the x86 `hsum` does.
fn dot_q8_0(nb: usize, row: &[u8], y: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for b in 0..nb {
        let (x, yb) = (&row[b * Q8_0_BLOCK..], &y[b * Q8_0_BLOCK..]);
        let d = f16_le(x) * f16_le(yb);
        for (m, a) in acc.iter_mut().enumerate() {
            let s: i32 = (4 * m..4 * m + 4).map(|i| x[2 + i] as i8 as i32 * yb[2 + i] as i8 as i32).sum();
            *a = d.mul_add(s as f32, *a);
        }
    }
    let s = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    sum4(s)
}

/// Dots of four Q4_0 rows (`cols` elements each) with the Q8_0 vector `y`
/// (`cols / 32` blocks, as bytes).
pub fn dot4_q4_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    let nb = cols / 32;
    assert!(y.len() >= nb * Q8_0_BLOCK && rows.iter().all(|r| r.len() >= nb * Q4_0_BLOCK));
    rows.map(|r| dot_q4_0(nb, r, y))
}

/// Dots of four Q8_0 rows (`cols` elements each) with the Q8_0 vector `y`.
pub fn dot4_q8_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    let nb = cols / 32;
    assert!(y.len() >= nb * Q8_0_BLOCK && rows.iter().all(|r| r.len() >= nb * Q8_0_BLOCK));
    rows.map(|r| dot_q8_0(nb, r, y))
}

/// Dots of the 8 rows of one Q4_0×8 group (`cols` elements per row; per
/// column block 8 f16 scales, then 8 × 16 nibble bytes) with the Q8_0
/// vector `y`. Row `r` gives the bits [`dot4_q4_0`] gives for it in the row
/// layout.
pub fn dot8_q4_0x8(cols: usize, group: &[u8], y: &[u8]) -> [f32; 8] {
    let nb = cols / 32;
    assert!(y.len() >= nb * Q8_0_BLOCK && group.len() >= nb * Q4_0X8_GROUP_BLOCK);
    let mut acc = [[0f32; 4]; 8];
    for b in 0..nb {
        let blk = &group[b * Q4_0X8_GROUP_BLOCK..(b + 1) * Q4_0X8_GROUP_BLOCK];
        let yb = &y[b * Q8_0_BLOCK..];
        let dy = f16_le(yb);
        for (r, a) in acc.iter_mut().enumerate() {
            let dx = f16_le(&blk[2 * r..]);
            let lanes = q4_0_lanes(&blk[16 + 16 * r..32 + 16 * r], &yb[2..34]);
            for (a, l) in a.iter_mut().zip(lanes) {
                *a = dx.mul_add(l as f32 * dy, *a);
            }
        }
    }
    acc.map(sum4)
}

/// `out += a · row` for one Q4_0 row (`out.len()` elements, a multiple of 32).
pub fn axpy_q4_0(row: &[u8], a: f32, out: &mut [f32]) {
    assert!(out.len().is_multiple_of(32) && row.len() >= out.len() / 32 * Q4_0_BLOCK);
    for (b, o) in row.chunks_exact(Q4_0_BLOCK).zip(out.chunks_exact_mut(32)) {
        let s = a * f16_le(b);
        let (lo, hi) = o.split_at_mut(16);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..18]) {
            *l = s.mul_add(((q & 0x0F) as i32 - 8) as f32, *l);
            *h = s.mul_add(((q >> 4) as i32 - 8) as f32, *h);
        }
    }
}

/// `out += a · row` for one Q8_0 row (`out.len()` elements, a multiple of 32).
pub fn axpy_q8_0(row: &[u8], a: f32, out: &mut [f32]) {
    assert!(out.len().is_multiple_of(32) && row.len() >= out.len() / 32 * Q8_0_BLOCK);
    for (b, o) in row.chunks_exact(Q8_0_BLOCK).zip(out.chunks_exact_mut(32)) {
        let s = a * f16_le(b);
        for (o, &q) in o.iter_mut().zip(&b[2..34]) {
            *o = s.mul_add((q as i8) as f32, *o);
        }
    }
}
