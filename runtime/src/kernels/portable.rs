//! Plain-Rust kernels: the reference every ISA-specific kernel is tested
//! against, and what runs on CPUs without one.
//!
//! Every Q4_0/Q8_0 dot here and in the ISA files computes in one order, in
//! every layout (row, ×8) and for any number of tokens: per 32-element
//! block, the exact integer sum `s = Σ x_i · y_i`; then
//! `acc = (dx · dy).mul_add(s, acc)` (f32, blocks in order, one accumulator
//! per row and token; `dx`, `dy` the block scales). So a row gives the same
//! bits whichever kernel, layout, batch or thread computes it, and the ISA
//! files are checked bit for bit. The axpy kernels (`out += a · row`) use
//! `f32::mul_add` where the SIMD code uses a fused multiply-add. Block
//! layouts: GGML Q4_0 (18 bytes: f16 scale, 16 bytes of nibbles, element
//! `i` in the low nibble of byte `i`, element `16 + i` in its high nibble)
//! and Q8_0 (34 bytes: f16 scale, 32 × i8) — formats/SPEC.md §5; ×8 groups
//! — §5.1.

use half::f16;
use nflash_format::interleave::X8_ROWS;

/// Bytes of a Q4_0 block.
const Q4_0_BLOCK: usize = 18;
/// Bytes of a Q8_0 block.
const Q8_0_BLOCK: usize = 34;
/// Bytes of a Q4_0×8 column block (8 scales, 8 × 16 quant bytes).
const Q4_0_X8_BLOCK: usize = 144;
/// Bytes of a Q8_0×8 column block (8 scales, 8 × 32 quant bytes).
const Q8_0_X8_BLOCK: usize = 272;

/// The f16 at `b[0..2]` (little-endian) as f32.
#[inline]
fn f16_le(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Exact integer dot of one Q4_0 block's 16 nibble bytes `q` with 32 i8 `y`:
/// `Σ (nibble − 8) · y`.
#[inline]
fn block_q4_0(q: &[u8], y: &[u8]) -> i32 {
    (0..16)
        .map(|i| ((q[i] & 0x0F) as i32 - 8) * y[i] as i8 as i32 + ((q[i] >> 4) as i32 - 8) * y[16 + i] as i8 as i32)
        .sum()
}

/// Exact integer dot of one Q8_0 block's 32 quants `q` with 32 i8 `y`.
#[inline]
fn block_q8_0(q: &[u8], y: &[u8]) -> i32 {
    q[..32].iter().zip(&y[..32]).map(|(&a, &b)| a as i8 as i32 * b as i8 as i32).sum()
}

/// One row (`nb` blocks of `block` bytes) dotted with the Q8_0 vector `y`, in
/// the order of the module documentation; `dot` sums one block's quants.
#[inline]
fn dot_row(nb: usize, row: &[u8], y: &[u8], block: usize, dot: fn(&[u8], &[u8]) -> i32) -> f32 {
    let mut acc = 0f32;
    for b in 0..nb {
        let (x, yb) = (&row[b * block..], &y[b * Q8_0_BLOCK..]);
        let s = dot(&x[2..block], &yb[2..Q8_0_BLOCK]);
        acc = (f16_le(x) * f16_le(yb)).mul_add(s as f32, acc);
    }
    acc
}

/// Dot of one Q4_0 row (`cols` elements) with the Q8_0 vector `y` (`cols / 32` blocks, as bytes).
pub fn dot_q4_0(cols: usize, row: &[u8], y: &[u8]) -> f32 {
    let nb = cols / 32;
    assert!(y.len() >= nb * Q8_0_BLOCK && row.len() >= nb * Q4_0_BLOCK);
    dot_row(nb, row, y, Q4_0_BLOCK, block_q4_0)
}

/// Dot of one Q8_0 row (`cols` elements) with the Q8_0 vector `y`.
pub fn dot_q8_0(cols: usize, row: &[u8], y: &[u8]) -> f32 {
    let nb = cols / 32;
    assert!(y.len() >= nb * Q8_0_BLOCK && row.len() >= nb * Q8_0_BLOCK);
    dot_row(nb, row, y, Q8_0_BLOCK, block_q8_0)
}

/// Dots of four Q4_0 rows (`cols` elements each) with the Q8_0 vector `y`.
pub fn dot4_q4_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    rows.map(|r| dot_q4_0(cols, r, y))
}

/// Dots of four Q8_0 rows (`cols` elements each) with the Q8_0 vector `y`.
pub fn dot4_q8_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    rows.map(|r| dot_q8_0(cols, r, y))
}

/// The 8 rows of one ×8 group (`cols` elements per row, SPEC §5.1) dotted
/// with `T` Q8_0 vectors `ys`: `out[t][r]`. `qbytes`: quant bytes per row
/// and block (16 for Q4_0, 32 for Q8_0); `dot` sums one block.
fn gemm_x8<const T: usize>(
    cols: usize,
    group: &[u8],
    ys: [&[u8]; T],
    (gblock, qbytes): (usize, usize),
    dot: fn(&[u8], &[u8]) -> i32,
) -> [[f32; X8_ROWS]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * gblock && ys.iter().all(|y| y.len() >= nb * Q8_0_BLOCK));
    let mut acc = [[0f32; X8_ROWS]; T];
    let mut q = [0u8; 32];
    for b in 0..nb {
        let blk = &group[b * gblock..(b + 1) * gblock];
        for r in 0..X8_ROWS {
            // Row r's quant bytes, gathered from their 4-byte words.
            for j in 0..qbytes / 4 {
                q[4 * j..4 * j + 4].copy_from_slice(&blk[16 + 32 * j + 4 * r..][..4]);
            }
            let dx = f16_le(&blk[2 * r..]);
            for (a, y) in acc.iter_mut().zip(&ys) {
                let yb = &y[b * Q8_0_BLOCK..];
                a[r] = (dx * f16_le(yb)).mul_add(dot(&q, &yb[2..Q8_0_BLOCK]) as f32, a[r]);
            }
        }
    }
    acc
}

/// The 8 rows of one Q4_0×8 group with `T` Q8_0 vectors: `out[t][r]`, the
/// bits [`dot_q4_0`] gives for row `r` in the row layout.
pub fn gemm_x8_q4_0<const T: usize>(cols: usize, group: &[u8], ys: [&[u8]; T]) -> [[f32; X8_ROWS]; T] {
    gemm_x8(cols, group, ys, (Q4_0_X8_BLOCK, 16), block_q4_0)
}

/// The 8 rows of one Q8_0×8 group with `T` Q8_0 vectors: `out[t][r]`.
pub fn gemm_x8_q8_0<const T: usize>(cols: usize, group: &[u8], ys: [&[u8]; T]) -> [[f32; X8_ROWS]; T] {
    gemm_x8(cols, group, ys, (Q8_0_X8_BLOCK, 32), block_q8_0)
}

/// The 8 rows of one ×8 group (`cols` elements each) dotted with `T` f32
/// vectors `xs`: `out[t][r]`. Per column block: `s = Σ q · x`, one
/// `mul_add` per element in the order `order` gives (Q8_0: 0..32; Q4_0: 0,
/// 16, 1, 17, …), then `acc = d.mul_add(s, acc)`. The prefill of Q8_0 packs
/// with exact activations.
fn gemm_x8_f32<const T: usize>(
    cols: usize,
    group: &[u8],
    xs: [&[f32]; T],
    gblock: usize,
    value: fn(&[u8], usize, usize) -> i32,
    order: fn(usize) -> usize,
) -> [[f32; X8_ROWS]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * gblock && xs.iter().all(|x| x.len() >= nb * 32));
    let mut acc = [[0f32; X8_ROWS]; T];
    for (b, blk) in group.chunks_exact(gblock).take(nb).enumerate() {
        for r in 0..X8_ROWS {
            let d = f16_le(&blk[2 * r..]);
            for (a, x) in acc.iter_mut().zip(&xs) {
                let mut s = 0f32;
                for k in 0..32 {
                    let i = order(k);
                    s = (value(blk, r, i) as f32).mul_add(x[32 * b + i], s);
                }
                a[r] = d.mul_add(s, a[r]);
            }
        }
    }
    acc
}

/// The 8 rows of one Q4_0×8 group with `T` f32 vectors: `out[t][r]`.
pub fn gemm_x8_f32_q4_0<const T: usize>(cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; X8_ROWS]; T] {
    gemm_x8_f32(cols, group, xs, Q4_0_X8_BLOCK, q4_x8_value, |k| k / 2 + 16 * (k % 2))
}

/// The 8 rows of one Q8_0×8 group with `T` f32 vectors: `out[t][r]`.
pub fn gemm_x8_f32_q8_0<const T: usize>(cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; X8_ROWS]; T] {
    gemm_x8_f32(cols, group, xs, Q8_0_X8_BLOCK, q8_x8_value, |k| k)
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

/// `out += Σ a[r] · row r` over the rows `r` of one ×8 group (`out.len()`
/// columns) whose bit is set in `mask`, in ascending `r`: for each row the
/// bits of the row-layout axpy, row after row. `dequant(q, r, i)` is row
/// `r`'s element `i` of a column block `q` (as i32).
fn axpy_x8(
    group: &[u8],
    a: [f32; X8_ROWS],
    mask: u8,
    out: &mut [f32],
    gblock: usize,
    value: fn(&[u8], usize, usize) -> i32,
) {
    assert!(out.len().is_multiple_of(32) && group.len() >= out.len() / 32 * gblock);
    for (blk, o) in group.chunks_exact(gblock).zip(out.chunks_exact_mut(32)) {
        for r in (0..X8_ROWS).filter(|r| mask & (1 << r) != 0) {
            let s = a[r] * f16_le(&blk[2 * r..]);
            for (i, o) in o.iter_mut().enumerate() {
                *o = s.mul_add(value(blk, r, i) as f32, *o);
            }
        }
    }
}

/// Quant byte `k` of row `r` in a ×8 column block (word `k / 4` at `16 + 32 (k / 4) + 4 r`).
#[inline]
fn x8_byte(blk: &[u8], r: usize, k: usize) -> u8 {
    blk[16 + 32 * (k / 4) + 4 * r + k % 4]
}

/// Element `i` of row `r` in a Q4_0×8 column block.
fn q4_x8_value(blk: &[u8], r: usize, i: usize) -> i32 {
    let q = x8_byte(blk, r, i % 16);
    (if i < 16 { q & 0x0F } else { q >> 4 }) as i32 - 8
}

/// Element `i` of row `r` in a Q8_0×8 column block.
fn q8_x8_value(blk: &[u8], r: usize, i: usize) -> i32 {
    x8_byte(blk, r, i) as i8 as i32
}

/// `out += Σ a[r] · row r` over the rows of one Q4_0×8 group set in `mask`,
/// ascending: the bits of [`axpy_q4_0`] applied row by row.
pub fn axpy_x8_q4_0(group: &[u8], a: [f32; X8_ROWS], mask: u8, out: &mut [f32]) {
    axpy_x8(group, a, mask, out, Q4_0_X8_BLOCK, q4_x8_value)
}

/// `out += Σ a[r] · row r` over the rows of one Q8_0×8 group set in `mask`,
/// ascending: the bits of [`axpy_q8_0`] applied row by row.
pub fn axpy_x8_q8_0(group: &[u8], a: [f32; X8_ROWS], mask: u8, out: &mut [f32]) {
    axpy_x8(group, a, mask, out, Q8_0_X8_BLOCK, q8_x8_value)
}

/// One ×8 group (`cols` elements per row) → its 8 rows in f32 (`out`:
/// `[8, cols]`), element = `d · q` (one f32 product, as every dequantization).
fn dequant_x8(group: &[u8], cols: usize, out: &mut [f32], gblock: usize, value: fn(&[u8], usize, usize) -> i32) {
    assert!(cols.is_multiple_of(32) && out.len() >= X8_ROWS * cols && group.len() >= cols / 32 * gblock);
    for (b, blk) in group.chunks_exact(gblock).take(cols / 32).enumerate() {
        for r in 0..X8_ROWS {
            let d = f16_le(&blk[2 * r..]);
            for i in 0..32 {
                out[r * cols + 32 * b + i] = d * value(blk, r, i) as f32;
            }
        }
    }
}

/// Elements `c0 .. c0 + PANEL` of the 8 rows of one ×8 group into 8 panel
/// rows: `out[r · stride + c] = d · q` (the values of [`dequant_x8`]).
fn dequant_x8_rows_panel(
    group: &[u8],
    cols: usize,
    c0: usize,
    out: &mut [f32],
    stride: usize,
    gblock: usize,
    value: fn(&[u8], usize, usize) -> i32,
) {
    super::check_x8_rows_panel(group.len(), gblock, cols, c0, out.len(), stride);
    let blk = &group[c0 / 32 * gblock..][..gblock];
    for r in 0..X8_ROWS {
        let d = f16_le(&blk[2 * r..]);
        for c in 0..super::PANEL {
            out[r * stride + c] = d * value(blk, r, c0 % 32 + c) as f32;
        }
    }
}

/// [`dequant_x8_rows_panel`] for a Q4_0×8 group.
pub fn dequant_x8_rows_panel_q4_0(group: &[u8], cols: usize, c0: usize, out: &mut [f32], stride: usize) {
    dequant_x8_rows_panel(group, cols, c0, out, stride, Q4_0_X8_BLOCK, q4_x8_value)
}

/// [`dequant_x8_rows_panel`] for a Q8_0×8 group.
pub fn dequant_x8_rows_panel_q8_0(group: &[u8], cols: usize, c0: usize, out: &mut [f32], stride: usize) {
    dequant_x8_rows_panel(group, cols, c0, out, stride, Q8_0_X8_BLOCK, q8_x8_value)
}

/// One ×8 group into a weight panel: `out[k · stride + r] = d · q` for row
/// `r < 8` and element `k < cols` (the values of [`dequant_x8`], in the
/// `[cols, stride]` order of `super::panel_tile`'s weights).
fn dequant_x8_panel(
    group: &[u8],
    cols: usize,
    out: &mut [f32],
    stride: usize,
    gblock: usize,
    value: fn(&[u8], usize, usize) -> i32,
) {
    super::check_x8_panel(group.len(), gblock, cols, out.len(), stride);
    for (b, blk) in group.chunks_exact(gblock).take(cols / 32).enumerate() {
        for r in 0..X8_ROWS {
            let d = f16_le(&blk[2 * r..]);
            for i in 0..32 {
                out[(32 * b + i) * stride + r] = d * value(blk, r, i) as f32;
            }
        }
    }
}

/// One Q4_0×8 group into a weight panel (`out[k · stride + r]`).
pub fn dequant_x8_panel_q4_0(group: &[u8], cols: usize, out: &mut [f32], stride: usize) {
    dequant_x8_panel(group, cols, out, stride, Q4_0_X8_BLOCK, q4_x8_value)
}

/// One Q8_0×8 group into a weight panel (`out[k · stride + r]`).
pub fn dequant_x8_panel_q8_0(group: &[u8], cols: usize, out: &mut [f32], stride: usize) {
    dequant_x8_panel(group, cols, out, stride, Q8_0_X8_BLOCK, q8_x8_value)
}

/// One Q4_0×8 group → its 8 rows in f32 (`out`: `[8, cols]`).
pub fn dequant_x8_q4_0(group: &[u8], cols: usize, out: &mut [f32]) {
    dequant_x8(group, cols, out, Q4_0_X8_BLOCK, q4_x8_value)
}

/// One Q8_0×8 group → its 8 rows in f32 (`out`: `[8, cols]`).
pub fn dequant_x8_q8_0(group: &[u8], cols: usize, out: &mut [f32]) {
    dequant_x8(group, cols, out, Q8_0_X8_BLOCK, q8_x8_value)
}

/// Quantizes `x` (`[32 · nb]`) into `nb` Q8_0 blocks at `out` (34 bytes
/// each: f16 scale, 32 × i8) and each block's sum of quants into `sums`:
/// GGML's reference `quantize_row_q8_0` (candle-core's
/// `BlockQ8_0::from_float`): `d = amax / 127`, `q = round(x · (1/d))` half
/// away from zero, saturating (NaN → 0).
///
/// Panics if the lengths disagree (a caller bug).
pub fn quantize_q8_0(x: &[f32], out: &mut [u8], sums: &mut [i32]) {
    let nb = x.len() / 32;
    assert!(x.len() == nb * 32 && out.len() == nb * 34 && sums.len() == nb, "Q8_0 quantization lengths");
    for ((xb, ob), s) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)).zip(sums.iter_mut()) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        ob[..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        *s = 0;
        for (o, &v) in ob[2..].iter_mut().zip(xb) {
            let q = (v * id).round() as i8;
            *o = q as u8;
            *s += q as i32;
        }
    }
}

/// The 8-lane sum of the attention dot kernels: lanes `(0+4, 1+5, 2+6,
/// 3+7)`, then `(0+2, 1+3)`, then the two (the x86 `hsum8` order).
#[inline]
pub(crate) fn sum8(l: [f32; 8]) -> f32 {
    let a = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (a[0] + a[2]) + (a[1] + a[3])
}

/// `q · k` over f32 `q` and a key of `T` (f32 or f16, same length): element
/// `i` is added by a fused multiply-add into lane `i mod 8`, in order, then
/// [`sum8`].
pub fn dot_kv<T: Copy + Into<f32>>(q: &[f32], k: &[T]) -> f32 {
    assert_eq!(q.len(), k.len());
    let mut l = [0f32; 8];
    for (i, (a, b)) in q.iter().zip(k).enumerate() {
        l[i % 8] = a.mul_add((*b).into(), l[i % 8]);
    }
    sum8(l)
}

/// `out += a · v` over a value row of `T` (f32 or f16), element by element
/// with a fused multiply-add.
pub fn axpy_kv<T: Copy + Into<f32>>(a: f32, v: &[T], out: &mut [f32]) {
    assert_eq!(v.len(), out.len());
    for (o, x) in out.iter_mut().zip(v) {
        *o = a.mul_add((*x).into(), *o);
    }
}

/// One f32 GEMM tile: `out[t][j] = Σ_i x[t · xs + i] · w[i · ws + j]` for
/// `T` tokens (rows of `x`, `xs` elements apart, `depth` each) and the
/// [`super::PANEL`] columns of a weight panel (`w`: row `i` of the panel at
/// `i · ws`). One accumulator per output, `i` ascending, one `mul_add`
/// (`x · w + acc`) per term: the order the ISA files keep.
///
/// Panics if a slice is too short for the shape (a caller bug).
pub fn panel_tile<const T: usize>(
    depth: usize,
    x: &[f32],
    xs: usize,
    w: &[f32],
    ws: usize,
) -> [[f32; super::PANEL]; T] {
    super::check_panel_tile(T, depth, x.len(), xs, w.len(), ws);
    let mut acc = [[0f32; super::PANEL]; T];
    for i in 0..depth {
        let wr = &w[i * ws..i * ws + super::PANEL];
        for (t, a) in acc.iter_mut().enumerate() {
            let xv = x[t * xs + i];
            for (a, &wv) in a.iter_mut().zip(wr) {
                *a = xv.mul_add(wv, *a);
            }
        }
    }
    acc
}

/// Inputs are clamped to this range first (`e^x` rounds to 0 in f32 below
/// it and to `+inf` above it); NaN passes through.
pub(crate) const EXP_RANGE: (f64, f64) = (-104.0, 89.0);
/// log2(e).
pub(crate) const LOG2E: f64 = std::f64::consts::LOG2_E;
/// ln 2 in two parts, fdlibm's `ln2HI` (its low 21 mantissa bits zero, so
/// `n · LN2_HI` is exact) and `ln2LO`, by their bits.
pub(crate) const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
pub(crate) const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
/// `1/k!` for k = 10 down to 0: Taylor's polynomial of `e^r` on
/// |r| ≤ ln2/2, relative error below 3e-13.
pub(crate) const EXP_TAYLOR: [f64; 11] = [
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `e^x` for f32 computed in f64 and rounded once, so it is the correctly
/// rounded value except within about 1e-5 of a rounding tie (as glibc's
/// `expf`, which also works in double): `n = round(x · log2 e)`, `r = x −
/// n · ln 2` in two fused steps, Taylor's polynomial to degree 10 by fused
/// multiply-adds, times `2^n` (exact), then rounded to f32. The ISA files
/// compute the same operations lane by lane, so softmax and SiLU give the
/// same bits on every path.
#[inline]
pub fn exp(x: f32) -> f32 {
    // Comparisons that keep NaN, as the SIMD max/min with these operand orders.
    let x = x as f64;
    let x = if EXP_RANGE.0 > x { EXP_RANGE.0 } else { x };
    let x = if EXP_RANGE.1 < x { EXP_RANGE.1 } else { x };
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_TAYLOR[0];
    for c in &EXP_TAYLOR[1..] {
        p = p.mul_add(r, *c);
    }
    // 2^n from its bits (n in -150..=129 here); NaN: n = 0, p is NaN.
    let n = if n.is_nan() { 0 } else { n as i64 };
    (p * f64::from_bits(((n + 1023) as u64) << 52)) as f32
}

/// `x[i] = e^{x[i]}` by [`exp`].
pub fn exp_slice(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = exp(*v));
}
