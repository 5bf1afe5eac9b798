//! x86-64 kernels (AVX2, FMA, F16C), chosen at run time by [`super`] when
//! the CPU has all three. Each is tested bit for bit against its
//! [`super::portable`] twin: the integer block sums are exact and the float
//! steps happen in the order `portable.rs` documents (one fused
//! multiply-add per row, token and block). Block layouts: GGML Q4_0/Q8_0
//! (formats/SPEC.md §5) and ×8 groups (§5.1).
//!
//! Q4_0 nibbles stay unsigned (0..15) for `maddubs` and the −8 offset is
//! applied once per block as `8·Σy` (the `sums` of the Q8_0 vector); Q8_0
//! quants go through `maddubs(|x|, sign(y, x))`. Neither can saturate the
//! i16 lanes: Q4_0 pairs are at most 2·15·127 and eight of them 30 480,
//! Q8_0 pairs at most 2·128·127 = 32 512 (activations are in −127..127).
//!
//! Every function here is `unsafe`: the caller guarantees the CPU features
//! (checked once by [`super::has_avx2`]); slice lengths are asserted inside.

// Block, row and token indices address several slices and registers at once.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use nflash_format::interleave::X8_ROWS;

/// Bytes of a Q4_0×8 column block (8 scales, 8 × 16 quant bytes).
const Q4_0_X8_BLOCK: usize = 144;
/// Bytes of a Q8_0×8 column block (8 scales, 8 × 32 quant bytes).
const Q8_0_X8_BLOCK: usize = 272;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const u16) as i32)))
}

/// The f16 scales at `p[0]`, …, `p[3]` (pointers to blocks) as 4 f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales4(p: [*const u8; 4]) -> __m128 {
    let (a, b) = (std::ptr::read_unaligned(p[0] as *const i16), std::ptr::read_unaligned(p[1] as *const i16));
    let (c, d) = (std::ptr::read_unaligned(p[2] as *const i16), std::ptr::read_unaligned(p[3] as *const i16));
    _mm_cvtph_ps(_mm_setr_epi16(a, b, c, d, 0, 0, 0, 0))
}

/// Lane `r` = the sum of the 8 i32 lanes of `d[r]`: four rows' block sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce4(d: [__m256i; 4]) -> __m128i {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
}

/// The sum of the 8 i32 lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The 32 nibbles of the Q4_0 block at `p` (its 16 quant bytes) as u8 0..15,
/// in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_nibbles(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p as *const __m128i);
    let m = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m))
}

/// Software prefetch distance of the row-layout kernels, bytes ahead in
/// each row (~35 Q4_0 blocks). Decode reads weights far larger than the
/// caches; on the dev host this gave +10–20% Q4_0 matvec speed over
/// hardware prefetch alone (interleaved A/B runs on a 65 536 × 4 096
/// matrix; distances from 256 to 1 024 bytes were all within the noise).
const PF: usize = 640;

/// What the row-layout dot kernels need of a block type: its size in
/// bytes, the offset its quants carry (Q4_0 nibbles stay unsigned, so
/// `OFFSET · Σy` is subtracted per block; 0 for Q8_0), and the 8 i32 lanes
/// of its quants (at `p`, after the scale) against 32 activations. A type
/// parameter, not a function pointer, so each kernel is compiled with its
/// lanes inlined.
trait RowBlock {
    const BYTES: usize;
    const OFFSET: i32;
    /// Bytes of a ×8 column block (SPEC §5.1).
    const X8_BLOCK: usize;
    /// # Safety
    /// 32 bytes must be readable at `p`; the CPU must have AVX2.
    unsafe fn lanes(p: *const u8, y: __m256i) -> __m256i;
    /// The 8 rows of the ×8 column block at `p` as i8 values, four 8-value
    /// parts each (elements `8k .. 8k+8` in part `k`).
    /// # Safety
    /// `X8_BLOCK` bytes must be readable at `p`; the CPU must have AVX2.
    unsafe fn x8_rows(p: *const u8) -> [[__m128i; 4]; X8_ROWS];
    /// The 32 values of the row-layout block whose quants start at `p`, as i8.
    /// # Safety
    /// The block's quants must be readable at `p`; the CPU must have AVX2.
    unsafe fn unpack(p: *const u8) -> __m256i;
    /// `s[t] += Σ q_i · x[t][i]` over the 32 elements of the ×8 column
    /// block at `p` (lane = row), one fused multiply-add per element in the
    /// order of `portable::gemm_x8_f32`.
    /// # Safety
    /// `X8_BLOCK` bytes at `p` and 32 f32 at each `x[t]` must be readable;
    /// the CPU must have AVX2 and FMA.
    unsafe fn f32_block<const T: usize>(p: *const u8, x: [*const f32; T], s: &mut [__m256; T]);
    /// The factor by which `f32_block`'s sums exceed `Σ q · x`: a power of
    /// two (exact), which [`gemm_x8_f32`] divides out of the block scale.
    const F32_BLOCK_SCALE: f32 = 1.0;
}

/// Q4_0 blocks: unsigned nibbles, offset 8.
struct Q4Row;
/// Q8_0 blocks.
struct Q8Row;

impl RowBlock for Q4Row {
    const BYTES: usize = 18;
    const OFFSET: i32 = 8;
    const X8_BLOCK: usize = Q4_0_X8_BLOCK;
    #[inline(always)]
    unsafe fn lanes(p: *const u8, y: __m256i) -> __m256i {
        q4_lanes(p, y)
    }
    #[inline(always)]
    unsafe fn x8_rows(p: *const u8) -> [[__m128i; 4]; X8_ROWS] {
        q4_x8_rows(p)
    }
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> __m256i {
        q4_unpack(p)
    }
    #[inline(always)]
    unsafe fn f32_block<const T: usize>(p: *const u8, x: [*const f32; T], s: &mut [__m256; T]) {
        q4_x8_f32_block(p, x, s)
    }
}

impl RowBlock for Q8Row {
    const BYTES: usize = 34;
    const OFFSET: i32 = 0;
    const X8_BLOCK: usize = Q8_0_X8_BLOCK;
    const F32_BLOCK_SCALE: f32 = Q8_TOP_BYTE;
    #[inline(always)]
    unsafe fn lanes(p: *const u8, y: __m256i) -> __m256i {
        q8_lanes(p, y)
    }
    #[inline(always)]
    unsafe fn x8_rows(p: *const u8) -> [[__m128i; 4]; X8_ROWS] {
        q8_x8_rows(p)
    }
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> __m256i {
        q8_load(p)
    }
    #[inline(always)]
    unsafe fn f32_block<const T: usize>(p: *const u8, x: [*const f32; T], s: &mut [__m256; T]) {
        q8_x8_f32_block(p, x, s)
    }
}

/// 8 i32 lanes of `Σ nibble · y` over the Q4_0 quants at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_lanes(p: *const u8, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q4_nibbles(p), y), _mm256_set1_epi16(1))
}

/// 8 i32 lanes of `Σ x · y` over the Q8_0 quants at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_lanes(p: *const u8, y: __m256i) -> __m256i {
    let x = _mm256_loadu_si256(p as *const __m256i);
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(y, x)), _mm256_set1_epi16(1))
}

/// Four rows of `B` blocks dotted with the Q8_0 vector `y` (`sums`: its
/// per-block Σq, read only when `B::OFFSET` is not 0). Plain loops, no
/// closures: a closure's body does not get this function's target
/// features, and its intrinsics would become calls.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_rows<B: RowBlock>(cols: usize, rows: [&[u8]; 4], y: &[u8], sums: &[i32]) -> [f32; 4] {
    let nb = cols / 32;
    assert!(y.len() >= nb * 34 && (B::OFFSET == 0 || sums.len() >= nb));
    assert!(rows.iter().all(|r| r.len() >= nb * B::BYTES));
    let mut acc = _mm_setzero_ps();
    for b in 0..nb {
        let yp = y.as_ptr().add(b * 34);
        let yq = _mm256_loadu_si256(yp.add(2) as *const __m256i);
        let mut xp = [std::ptr::null::<u8>(); 4];
        let mut d = [_mm256_setzero_si256(); 4];
        for r in 0..4 {
            xp[r] = rows[r].as_ptr().add(b * B::BYTES);
            _mm_prefetch::<_MM_HINT_T0>(xp[r].wrapping_add(PF) as *const i8);
            d[r] = B::lanes(xp[r].add(2), yq);
        }
        let mut dot = reduce4(d);
        if B::OFFSET != 0 {
            dot = _mm_sub_epi32(dot, _mm_set1_epi32(B::OFFSET * sums[b]));
        }
        let d4 = _mm_mul_ps(scales4(xp), _mm_set1_ps(f16_at(yp)));
        acc = _mm_fmadd_ps(d4, _mm_cvtepi32_ps(dot), acc);
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// One row of `B` blocks dotted with the Q8_0 vector `y` (as [`dot4_rows`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_row<B: RowBlock>(cols: usize, row: &[u8], y: &[u8], sums: &[i32]) -> f32 {
    let nb = cols / 32;
    assert!(y.len() >= nb * 34 && (B::OFFSET == 0 || sums.len() >= nb) && row.len() >= nb * B::BYTES);
    let mut acc = 0f32;
    for b in 0..nb {
        let (yp, xp) = (y.as_ptr().add(b * 34), row.as_ptr().add(b * B::BYTES));
        let mut s = hsum_i32(B::lanes(xp.add(2), _mm256_loadu_si256(yp.add(2) as *const __m256i)));
        if B::OFFSET != 0 {
            s -= B::OFFSET * sums[b];
        }
        acc = (f16_at(xp) * f16_at(yp)).mul_add(s as f32, acc);
    }
    acc
}

/// Four Q4_0 rows dotted with the Q8_0 vector `y` (`sums`: its per-block Σq).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot4_q4_0(cols: usize, rows: [&[u8]; 4], y: &[u8], sums: &[i32]) -> [f32; 4] {
    dot4_rows::<Q4Row>(cols, rows, y, sums)
}

/// Four Q8_0 rows dotted with the Q8_0 vector `y`.
///
/// # Safety
/// As [`dot4_q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot4_q8_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    dot4_rows::<Q8Row>(cols, rows, y, &[])
}

/// One Q4_0 row dotted with the Q8_0 vector `y` (`sums`: its per-block Σq).
///
/// # Safety
/// As [`dot4_q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0(cols: usize, row: &[u8], y: &[u8], sums: &[i32]) -> f32 {
    dot_row::<Q4Row>(cols, row, y, sums)
}

/// One Q8_0 row dotted with the Q8_0 vector `y`.
///
/// # Safety
/// As [`dot4_q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0(cols: usize, row: &[u8], y: &[u8]) -> f32 {
    dot_row::<Q8Row>(cols, row, y, &[])
}

/// Software prefetch distance of the ×8 kernels, bytes ahead in a group's
/// column-block stream (28 Q4_0×8 or 15 Q8_0×8 column blocks). A decode
/// token streams every weight once, far more than the caches hold, and
/// consecutive groups of a matrix or a cluster are adjacent, so the stream
/// runs on past a group's end into the next one. On the dev host a
/// 64 MiB Q4_0×8 matrix-vector product went from ~7 to ~11 GB/s on one
/// thread (distances of 0, 576, 2 304, 4 608 and 9 216 bytes alternated:
/// 6.5–7.8, 7.6–8.7, 9.3–12.3, 9.1–12.7, 10.6–11.9 GB/s).
const X8_PF: usize = 4096;

/// Prefetch the cache lines of the `len`-byte column block that starts
/// [`X8_PF`] bytes past `p` (a hint: addresses past the slice are fine).
#[inline(always)]
unsafe fn prefetch_x8(p: *const u8, len: usize) {
    let mut o = 0;
    while o < len {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(X8_PF + o) as *const i8);
        o += 64;
    }
}

/// The 4 bytes at `p` broadcast to every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bcast4(p: *const u8) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

/// The 8 accumulators (one row per lane) of `T` tokens as `out[t][r]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store8<const T: usize>(acc: [__m256; T]) -> [[f32; X8_ROWS]; T] {
    let mut out = [[0f32; X8_ROWS]; T];
    for (o, a) in out.iter_mut().zip(acc) {
        _mm256_storeu_ps(o.as_mut_ptr(), a);
    }
    out
}

/// One block's f32 step of the ×8 GEMMs, the same for every kernel that
/// sums the block's integer dots (AVX2 and VNNI, whose bits are the same
/// for that): `acc + (dx · dy) · dot`, with `dx` the 8 rows' scales, `dy`
/// the Q8_0 input block's f16 scale (at `yp − 2`, `yp` its values) and
/// `dot` the 8 rows' exact integer dots, in one fused multiply-add.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_fma(acc: __m256, dx: __m256, yp: *const u8, dot: __m256i) -> __m256 {
    let d = _mm256_mul_ps(dx, _mm256_set1_ps(f16_at(yp.sub(2))));
    _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), acc)
}

/// One Q4_0×8 block at `p` (SPEC §5.1; its next blocks prefetched): the 8
/// rows' scales as f32 lanes and, per word run k, the low nibbles (elements
/// 4k..4k+4 of each row) and the high ones (16+4k..) as bytes 0..15.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_x8_block(p: *const u8) -> (__m256, [__m256i; 4], [__m256i; 4]) {
    prefetch_x8(p, Q4_0_X8_BLOCK);
    let m4 = _mm256_set1_epi8(0x0F);
    let dx = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
    let (mut lo, mut hi) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
    for k in 0..4 {
        let q = _mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i);
        lo[k] = _mm256_and_si256(q, m4);
        hi[k] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
    (dx, lo, hi)
}

/// One Q8_0×8 block at `p` (its next blocks prefetched): the 8 rows'
/// scales as f32 lanes, the 8 word runs and their absolute values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_x8_block(p: *const u8) -> (__m256, [__m256i; 8], [__m256i; 8]) {
    prefetch_x8(p, Q8_0_X8_BLOCK);
    let dx = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
    let (mut x, mut ax) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
    for k in 0..8 {
        x[k] = _mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i);
        ax[k] = _mm256_abs_epi8(x[k]);
    }
    (dx, x, ax)
}

/// The 8 rows of one Q4_0×8 group (SPEC §5.1) dotted with `T` Q8_0 vectors
/// `ys` (`sums[t]`: their per-block Σq): `out[t][r]`. Each 32-bit lane is
/// one row: a 32-byte word run of the group against a broadcast 4 bytes of
/// the token, eight `maddubs` summed in i16, one `madd` per block and token.
/// `T = 1` is the decode matrix-vector product; prefill runs up to 4 tokens
/// per call, sharing the unpacked weights.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemm_x8_q4_0<const T: usize>(
    cols: usize,
    group: &[u8],
    ys: [&[u8]; T],
    sums: [&[i32]; T],
) -> [[f32; X8_ROWS]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * Q4_0_X8_BLOCK);
    assert!(ys.iter().all(|y| y.len() >= nb * 34) && sums.iter().all(|s| s.len() >= nb));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let mut p = group.as_ptr();
    for b in 0..nb {
        let (dx, lo, hi) = q4_0_x8_block(p);
        for t in 0..T {
            let yp = ys[t].as_ptr().add(b * 34 + 2);
            let mut s = _mm256_maddubs_epi16(lo[0], bcast4(yp));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[0], bcast4(yp.add(16))));
            for k in 1..4 {
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[k], bcast4(yp.add(4 * k))));
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[k], bcast4(yp.add(16 + 4 * k))));
            }
            let dot = _mm256_sub_epi32(_mm256_madd_epi16(s, ones), _mm256_set1_epi32(8 * sums[t][b]));
            acc[t] = block_fma(acc[t], dx, yp, dot);
        }
        p = p.add(Q4_0_X8_BLOCK);
    }
    store8(acc)
}

/// The 8 rows of one Q8_0×8 group dotted with `T` Q8_0 vectors: `out[t][r]`
/// (as [`gemm_x8_q4_0`], with `maddubs(|x|, sign(y, x))` and one `madd` per
/// word run, since Q8_0 pairs use most of the i16 range).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemm_x8_q8_0<const T: usize>(cols: usize, group: &[u8], ys: [&[u8]; T]) -> [[f32; X8_ROWS]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * Q8_0_X8_BLOCK && ys.iter().all(|y| y.len() >= nb * 34));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let mut p = group.as_ptr();
    for b in 0..nb {
        let (dx, x, ax) = q8_0_x8_block(p);
        for t in 0..T {
            let yp = ys[t].as_ptr().add(b * 34 + 2);
            let mut s = _mm256_setzero_si256();
            for k in 0..8 {
                let p16 = _mm256_maddubs_epi16(ax[k], _mm256_sign_epi8(bcast4(yp.add(4 * k)), x[k]));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p16, ones));
            }
            acc[t] = block_fma(acc[t], dx, yp, s);
        }
        p = p.add(Q8_0_X8_BLOCK);
    }
    store8(acc)
}

/// [`gemm_x8_q4_0`] with AVX-512 VNNI: each word run's 4-byte dots are
/// summed into 32-bit lanes by `vpdpbusd` (one instruction where AVX2
/// takes `maddubs`, an i16 add and, per block, a `madd`). The integer
/// block dots are exact in both (AVX2's i16 sums stay below 8 × 2 × 15 ×
/// 127 = 30 480), and the f32 steps are the same, so the bits are
/// [`gemm_x8_q4_0`]'s (`kernels/tests.rs`). Two partial sums per block
/// halve the dependency chain.
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI
/// (`super::has_vnni`); slice lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn gemm_x8_q4_0_vnni<const T: usize>(
    cols: usize,
    group: &[u8],
    ys: [&[u8]; T],
    sums: [&[i32]; T],
) -> [[f32; X8_ROWS]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * Q4_0_X8_BLOCK);
    assert!(ys.iter().all(|y| y.len() >= nb * 34) && sums.iter().all(|s| s.len() >= nb));
    let zero = _mm256_setzero_si256();
    let mut acc = [_mm256_setzero_ps(); T];
    let mut p = group.as_ptr();
    for b in 0..nb {
        let (dx, lo, hi) = q4_0_x8_block(p);
        for t in 0..T {
            let yp = ys[t].as_ptr().add(b * 34 + 2);
            let mut s0 = _mm256_dpbusd_epi32(zero, lo[0], bcast4(yp));
            let mut s1 = _mm256_dpbusd_epi32(zero, hi[0], bcast4(yp.add(16)));
            for k in 1..4 {
                s0 = _mm256_dpbusd_epi32(s0, lo[k], bcast4(yp.add(4 * k)));
                s1 = _mm256_dpbusd_epi32(s1, hi[k], bcast4(yp.add(16 + 4 * k)));
            }
            let dot = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), _mm256_set1_epi32(8 * sums[t][b]));
            acc[t] = block_fma(acc[t], dx, yp, dot);
        }
        p = p.add(Q4_0_X8_BLOCK);
    }
    store8(acc)
}

/// [`gemm_x8_q8_0`] with AVX-512 VNNI: `vpdpbusd(|x|, sign(y, x))` per
/// word run, the same exact integer block dots, so the same bits
/// (`kernels/tests.rs`).
///
/// # Safety
/// As [`gemm_x8_q4_0_vnni`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn gemm_x8_q8_0_vnni<const T: usize>(cols: usize, group: &[u8], ys: [&[u8]; T]) -> [[f32; X8_ROWS]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * Q8_0_X8_BLOCK && ys.iter().all(|y| y.len() >= nb * 34));
    let zero = _mm256_setzero_si256();
    let mut acc = [_mm256_setzero_ps(); T];
    let mut p = group.as_ptr();
    for b in 0..nb {
        let (dx, x, ax) = q8_0_x8_block(p);
        for t in 0..T {
            let yp = ys[t].as_ptr().add(b * 34 + 2);
            let (mut s0, mut s1) = (zero, zero);
            for k in (0..8).step_by(2) {
                s0 = _mm256_dpbusd_epi32(s0, ax[k], _mm256_sign_epi8(bcast4(yp.add(4 * k)), x[k]));
                s1 = _mm256_dpbusd_epi32(s1, ax[k + 1], _mm256_sign_epi8(bcast4(yp.add(4 * k + 4)), x[k + 1]));
            }
            acc[t] = block_fma(acc[t], dx, yp, _mm256_add_epi32(s0, s1));
        }
        p = p.add(Q8_0_X8_BLOCK);
    }
    store8(acc)
}

/// 32 Q4_0 values of the block at `p` (after its scale) as i8 in −8..7.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_unpack(p: *const u8) -> __m256i {
    _mm256_sub_epi8(q4_nibbles(p), _mm256_set1_epi8(8))
}

/// 32 Q8_0 values of the block at `p` (after its scale).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// The 32 i8 values `lo` (elements 0..16) and `hi` (16..32) as four
/// 8-value parts (elements `8k .. 8k+8` in part `k`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn parts(lo: __m128i, hi: __m128i) -> [__m128i; 4] {
    [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
}

/// The 8 i8 values of `part` (its low 8 bytes) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn part_f32(part: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part))
}

/// `out += Σ a[i] · rows[i]` over `N` rows of `B` blocks (their 32 values
/// unpacked to i8 by `B::unpack`); `out` is read and written once per block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_blocks<B: RowBlock, const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    let (nb, block) = (out.len() / 32, B::BYTES);
    assert!(out.len().is_multiple_of(32) && rows.iter().all(|r| r.len() >= nb * block));
    let o = out.as_mut_ptr();
    for b in 0..nb {
        let mut part = [[_mm_setzero_si128(); 4]; N];
        let mut s = [_mm256_setzero_ps(); N];
        for i in 0..N {
            let xp = rows[i].as_ptr().add(b * block);
            s[i] = _mm256_set1_ps(a[i] * f16_at(xp));
            let v = B::unpack(xp.add(2));
            part[i] = parts(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        }
        // `k` picks the same 8-element part of every row and of `out`.
        for k in 0..4 {
            let dst = o.add(b * 32 + k * 8);
            let mut acc = _mm256_loadu_ps(dst);
            for i in 0..N {
                acc = _mm256_fmadd_ps(s[i], part_f32(part[i][k]), acc);
            }
            _mm256_storeu_ps(dst, acc);
        }
    }
}

/// `out += a[0]·rows[0] + … ` for Q4_0 rows.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_q4_0<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    axpy_blocks::<Q4Row, N>(rows, a, out)
}

/// `out += a[0]·rows[0] + … ` for Q8_0 rows.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_q8_0<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    axpy_blocks::<Q8Row, N>(rows, a, out)
}

/// Row `r` and row `r + 4` of a ×8 column block's four 32-byte word runs
/// `w` (each lane one row's word `j`), as 16 bytes each: the low 128 bits
/// of element `r` hold row `r`'s words 0..3, the high 128 bits row `r + 4`'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose_words(w: [__m256i; 4]) -> [__m256i; 4] {
    let (t0, t1) = (_mm256_unpacklo_epi32(w[0], w[1]), _mm256_unpackhi_epi32(w[0], w[1]));
    let (t2, t3) = (_mm256_unpacklo_epi32(w[2], w[3]), _mm256_unpackhi_epi32(w[2], w[3]));
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// Half `h` (0 = low, 1 = high 128 bits) of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half(v: __m256i, h: usize) -> __m128i {
    if h == 0 {
        _mm256_castsi256_si128(v)
    } else {
        _mm256_extracti128_si256(v, 1)
    }
}

/// `out += Σ a[r] · row r` over the rows of one ×8 column-block stream
/// whose bit is set in `mask`, ascending `r` (`B::x8_rows` unpacks each
/// column block). `out` is read and written once per block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_x8_blocks<B: RowBlock>(group: &[u8], a: [f32; X8_ROWS], mask: u8, out: &mut [f32]) {
    let gblock = B::X8_BLOCK;
    let nb = out.len() / 32;
    assert!(out.len().is_multiple_of(32) && group.len() >= nb * gblock);
    let av = _mm256_loadu_ps(a.as_ptr());
    let o = out.as_mut_ptr();
    let mut p = group.as_ptr();
    for b in 0..nb {
        prefetch_x8(p, gblock);
        let mut s = [0f32; X8_ROWS];
        _mm256_storeu_ps(s.as_mut_ptr(), _mm256_mul_ps(av, _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))));
        let parts = B::x8_rows(p);
        let mut acc = [_mm256_setzero_ps(); 4];
        for k in 0..4 {
            acc[k] = _mm256_loadu_ps(o.add(b * 32 + 8 * k));
        }
        for r in 0..X8_ROWS {
            if mask & (1 << r) == 0 {
                continue;
            }
            let sr = _mm256_set1_ps(s[r]);
            for k in 0..4 {
                acc[k] = _mm256_fmadd_ps(sr, part_f32(parts[r][k]), acc[k]);
            }
        }
        for k in 0..4 {
            _mm256_storeu_ps(o.add(b * 32 + 8 * k), acc[k]);
        }
        p = p.add(gblock);
    }
}

/// The 8 rows of the Q4_0×8 column block at `p` as i8 values −8..7, four
/// 8-value parts each (low nibbles are elements 0..15, high 16..31).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_x8_rows(p: *const u8) -> [[__m128i; 4]; X8_ROWS] {
    let w = std::array::from_fn(|j| _mm256_loadu_si256(p.add(16 + 32 * j) as *const __m256i));
    let (m4, eight) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(8));
    let mut out = [[_mm_setzero_si128(); 4]; X8_ROWS];
    for (i, v) in transpose_words(w).into_iter().enumerate() {
        let lo = _mm256_sub_epi8(_mm256_and_si256(v, m4), eight);
        let hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), eight);
        for h in 0..2 {
            out[i + 4 * h] = parts(half(lo, h), half(hi, h));
        }
    }
    out
}

/// The 8 rows of the Q8_0×8 column block at `p`, four 8-value parts each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_x8_rows(p: *const u8) -> [[__m128i; 4]; X8_ROWS] {
    let lo = transpose_words(std::array::from_fn(|j| _mm256_loadu_si256(p.add(16 + 32 * j) as *const __m256i)));
    let hi = transpose_words(std::array::from_fn(|j| _mm256_loadu_si256(p.add(144 + 32 * j) as *const __m256i)));
    let mut out = [[_mm_setzero_si128(); 4]; X8_ROWS];
    for i in 0..4 {
        for h in 0..2 {
            out[i + 4 * h] = parts(half(lo[i], h), half(hi[i], h));
        }
    }
    out
}

/// `out += Σ a[r] · row r` over the rows of one Q4_0×8 group (SPEC §5.1)
/// set in `mask`, ascending: the bits of [`axpy_q4_0`] row by row.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_x8_q4_0(group: &[u8], a: [f32; X8_ROWS], mask: u8, out: &mut [f32]) {
    axpy_x8_blocks::<Q4Row>(group, a, mask, out)
}

/// `out += Σ a[r] · row r` over the rows of one Q8_0×8 group set in `mask`,
/// ascending: the bits of [`axpy_q8_0`] row by row.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_x8_q8_0(group: &[u8], a: [f32; X8_ROWS], mask: u8, out: &mut [f32]) {
    axpy_x8_blocks::<Q8Row>(group, a, mask, out)
}

/// `outs[t] += Σ_r a[t][r] · row r` for the tokens `t` of `a` over the
/// rows `r` of one ×8 group set in `masks[t]` (each `outs[t]`: `[cols]`,
/// the group's first `cols / 32` column blocks): for each token, the bits
/// of [`axpy_x8_blocks`] with its mask. Each column block's rows are
/// unpacked to f32 once for all the tokens (the down projection of a short
/// prefill, straight from the quantized weights).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_x8_tokens_blocks<B: RowBlock>(
    group: &[u8],
    a: &[[f32; X8_ROWS]],
    masks: &[u8],
    outs: &mut [&mut [f32]],
) {
    let cols = outs.first().map_or(0, |o| o.len());
    let (nb, gblock) = (cols / 32, B::X8_BLOCK);
    assert!(cols.is_multiple_of(32) && group.len() >= nb * gblock && a.len() == outs.len());
    assert_eq!(masks.len(), a.len(), "×8 token axpy: masks");
    assert!(outs.iter().all(|o| o.len() == cols), "×8 token axpy: output rows of different lengths");
    let mut p = group.as_ptr();
    // The block's 8 rows as f32, [row][32].
    let mut w = [[0f32; 32]; X8_ROWS];
    for b in 0..nb {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        let parts = B::x8_rows(p);
        for r in 0..X8_ROWS {
            for k in 0..4 {
                _mm256_storeu_ps(w[r].as_mut_ptr().add(8 * k), part_f32(parts[r][k]));
            }
        }
        for ((at, &mask), out) in a.iter().zip(masks).zip(outs.iter_mut()) {
            let mut s = [0f32; X8_ROWS];
            _mm256_storeu_ps(s.as_mut_ptr(), _mm256_mul_ps(_mm256_loadu_ps(at.as_ptr()), d));
            let dst = out.as_mut_ptr().add(32 * b);
            let mut acc: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(dst.add(8 * k)));
            for r in (0..X8_ROWS).filter(|r| mask & (1 << r) != 0) {
                let sr = _mm256_set1_ps(s[r]);
                for k in 0..4 {
                    acc[k] = _mm256_fmadd_ps(sr, _mm256_loadu_ps(w[r].as_ptr().add(8 * k)), acc[k]);
                }
            }
            for k in 0..4 {
                _mm256_storeu_ps(dst.add(8 * k), acc[k]);
            }
        }
        p = p.add(gblock);
    }
}

/// [`axpy_x8_tokens_blocks`] for Q4_0×8 groups.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_x8_tokens_q4_0(group: &[u8], a: &[[f32; X8_ROWS]], masks: &[u8], outs: &mut [&mut [f32]]) {
    axpy_x8_tokens_blocks::<Q4Row>(group, a, masks, outs)
}

/// [`axpy_x8_tokens_blocks`] for Q8_0×8 groups.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_x8_tokens_q8_0(group: &[u8], a: &[[f32; X8_ROWS]], masks: &[u8], outs: &mut [&mut [f32]]) {
    axpy_x8_tokens_blocks::<Q8Row>(group, a, masks, outs)
}

/// `q · 2^24` is what a byte `q` placed in the top byte of a 32-bit lane
/// (zeros below) reads as: [`q8_x8_f32_block`] converts that lane to f32
/// directly, and [`gemm_x8_f32`] takes the factor out of the block scale.
const Q8_TOP_BYTE: f32 = 16_777_216.0;

/// Elements `4k .. 4k + 4` of the 8 rows from the 32-byte run `k` of a
/// Q8_0×8 block at `p` (lane = row), as `q · 2^24` in f32: byte `j` of
/// each lane moved to the lane's top byte, zeros below, by one shuffle
/// (port 5; an `and` for byte 3), then converted (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_x8_top(p: *const u8, k: usize) -> [__m256; 4] {
    // Shuffle masks: byte j of each lane to the lane's top byte, zeros below (0x80).
    let top = |j: i8| {
        let m: [i8; 16] = std::array::from_fn(|b| if b % 4 == 3 { (b - 3) as i8 + j } else { -128 });
        _mm256_broadcastsi128_si256(_mm_loadu_si128(m.as_ptr() as *const __m128i))
    };
    let w = _mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i);
    [
        _mm256_cvtepi32_ps(_mm256_shuffle_epi8(w, top(0))),
        _mm256_cvtepi32_ps(_mm256_shuffle_epi8(w, top(1))),
        _mm256_cvtepi32_ps(_mm256_shuffle_epi8(w, top(2))),
        _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xFF00_0000u32 as i32))),
    ]
}

/// [`RowBlock::f32_block`] for Q8_0×8: elements in order 0..32, each sum
/// `2^24 ·` the portable one. Byte `j` of each row's 4-byte run is moved to
/// the top of its lane by one shuffle (port 5; `and` for byte 3) and
/// converted as `q · 2^24`, which is exact, as is every sum scaled by a
/// power of two: the bits are the portable ones unless a product is
/// subnormal or a sum overflows (|x| beyond ~2^96), neither of which
/// hidden states come near. Before: sign-extending shifts, 2.75 ALU
/// operations per column on the ports the multiply-adds need.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_x8_f32_block<const T: usize>(p: *const u8, x: [*const f32; T], s: &mut [__m256; T]) {
    for k in 0..8 {
        for (j, qf) in q8_x8_top(p, k).into_iter().enumerate() {
            for t in 0..T {
                s[t] = _mm256_fmadd_ps(qf, _mm256_broadcast_ss(&*x[t].add(4 * k + j)), s[t]);
            }
        }
    }
}

/// [`RowBlock::f32_block`] for Q4_0×8: elements in order 0, 16, 1, 17, …,
/// 15, 31 (byte `i`'s low nibble, then its high nibble).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_x8_f32_block<const T: usize>(p: *const u8, x: [*const f32; T], s: &mut [__m256; T]) {
    let (m4, eight) = (_mm256_set1_epi32(0x0F), _mm256_set1_epi32(8));
    let nib = |v: __m256i| _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, m4), eight));
    for k in 0..4 {
        let w = _mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i);
        let q = [
            (nib(w), nib(_mm256_srli_epi32::<4>(w))),
            (nib(_mm256_srli_epi32::<8>(w)), nib(_mm256_srli_epi32::<12>(w))),
            (nib(_mm256_srli_epi32::<16>(w)), nib(_mm256_srli_epi32::<20>(w))),
            (nib(_mm256_srli_epi32::<24>(w)), nib(_mm256_srli_epi32::<28>(w))),
        ];
        for j in 0..4 {
            let i = 4 * k + j;
            for t in 0..T {
                s[t] = _mm256_fmadd_ps(q[j].0, _mm256_broadcast_ss(&*x[t].add(i)), s[t]);
                s[t] = _mm256_fmadd_ps(q[j].1, _mm256_broadcast_ss(&*x[t].add(16 + i)), s[t]);
            }
        }
    }
}

/// The 8 rows of one ×8 group (`cols` elements each) dotted with `T` f32
/// vectors `xs`: `out[t][r]`. Per column block, `s = Σ q · x` by fused
/// multiply-adds (`B::f32_block`), then `acc = d · s + acc`: the order of
/// `portable::gemm_x8_f32`. Exact activations for prefill of Q8_0 packs
/// without dequantizing the weights to memory.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_x8_f32<B: RowBlock, const T: usize>(cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; X8_ROWS]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * B::X8_BLOCK && xs.iter().all(|x| x.len() >= nb * 32));
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        let p = group.as_ptr().add(b * B::X8_BLOCK);
        prefetch_x8(p, B::X8_BLOCK);
        let dx = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        let dx =
            if B::F32_BLOCK_SCALE == 1.0 { dx } else { _mm256_mul_ps(dx, _mm256_set1_ps(1.0 / B::F32_BLOCK_SCALE)) };
        let mut s = [_mm256_setzero_ps(); T];
        B::f32_block(p, xs.map(|x| x.as_ptr().add(32 * b)), &mut s);
        for t in 0..T {
            acc[t] = _mm256_fmadd_ps(dx, s[t], acc[t]);
        }
    }
    store8(acc)
}

/// [`gemm_x8_f32`] for a Q4_0×8 group.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemm_x8_f32_q4_0<const T: usize>(cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; X8_ROWS]; T] {
    gemm_x8_f32::<Q4Row, T>(cols, group, xs)
}

/// [`gemm_x8_f32`] for a Q8_0×8 group.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemm_x8_f32_q8_0<const T: usize>(cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; X8_ROWS]; T] {
    gemm_x8_f32::<Q8Row, T>(cols, group, xs)
}

/// Quantizes `x` (`[32 · nb]`) into `nb` Q8_0 blocks at `out` (34 bytes
/// each: f16 scale, 32 × i8) and each block's sum of quants into `sums`,
/// with the bits of `portable::quantize_q8_0` (GGML's reference rounding:
/// `d = amax / 127`, `q = round(x · (1/d))` half away from zero). A block
/// holding a NaN or an infinity, or whose `1/d` overflows, goes through the
/// portable code, whose saturating float-to-int casts it must match.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_q8_0(x: &[f32], out: &mut [u8], sums: &mut [i32]) {
    let nb = x.len() / 32;
    assert!(x.len() == nb * 32 && out.len() == nb * 34 && sums.len() == nb, "Q8_0 quantization lengths");
    let sign = _mm256_set1_ps(-0.0);
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let inf = _mm256_set1_ps(f32::INFINITY);
    for b in 0..nb {
        let xp = x.as_ptr().add(32 * b);
        let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(xp.add(8 * k)));
        let a = v.map(|v| _mm256_andnot_ps(sign, v));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let finite = a.iter().all(|&a| _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a, inf)) == 0xFF);
        if !finite || !id.is_finite() {
            // Non-finite inputs, or a scale so small that 1/d overflows.
            super::portable::quantize_q8_0(&x[32 * b..32 * b + 32], &mut out[34 * b..34 * b + 34], &mut sums[b..b + 1]);
            continue;
        }
        let dh = half::f16::from_f32(d).to_bits();
        std::ptr::copy_nonoverlapping(dh.to_le_bytes().as_ptr(), out.as_mut_ptr().add(34 * b), 2);
        let idv = _mm256_set1_ps(id);
        // round half away from zero: truncate, then step away by one where
        // the exact remainder |x - trunc x| is at least a half.
        let q = v.map(|v| {
            let y = _mm256_mul_ps(v, idv);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let away = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_andnot_ps(sign, _mm256_sub_ps(y, t)), half);
            let step = _mm256_or_ps(_mm256_and_ps(y, sign), one);
            _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(away, step)))
        });
        // i32 → i16 → i8; packs interleave 128-bit lanes, the permute restores order.
        let w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out.as_mut_ptr().add(34 * b + 2) as *mut __m256i, w);
        let s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), w);
        sums[b] = hsum_i32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
    }
}

/// The sum of 8 f32 lanes in the order of `portable::sum8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum8(v: __m256) -> f32 {
    let a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let b = _mm_add_ps(a, _mm_movehl_ps(a, a)); // (0+2, 1+3)
    _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)))
}

/// `q · k` (an attention score) for one cached key of `T` (f32, or f16
/// converted by F16C); see `portable::dot_kv` for the order.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_kv<T: KvLoad>(q: &[f32], k: &[T]) -> f32 {
    assert_eq!(q.len(), k.len());
    let n8 = q.len() / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    for i in (0..n8).step_by(8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), T::load8(k.as_ptr().add(i)), acc);
    }
    let mut l = [0f32; 8];
    _mm256_storeu_ps(l.as_mut_ptr(), acc);
    for i in n8..q.len() {
        l[i % 8] = q[i].mul_add(k[i].into(), l[i % 8]);
    }
    hsum8(_mm256_loadu_ps(l.as_ptr()))
}

/// `out += a · v` for one cached value row of `T`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_kv<T: KvLoad>(a: f32, v: &[T], out: &mut [f32]) {
    assert_eq!(v.len(), out.len());
    let n8 = v.len() / 8 * 8;
    let av = _mm256_set1_ps(a);
    let o = out.as_mut_ptr();
    for i in (0..n8).step_by(8) {
        _mm256_storeu_ps(o.add(i), _mm256_fmadd_ps(av, T::load8(v.as_ptr().add(i)), _mm256_loadu_ps(o.add(i))));
    }
    for i in n8..v.len() {
        out[i] = a.mul_add(v[i].into(), out[i]);
    }
}

/// A KV-cache element type whose 8 elements at `p` load as f32 (f16 converted by F16C).
pub trait KvLoad: Copy + Into<f32> {
    /// # Safety
    /// 8 elements must be readable at `p`; the CPU must have F16C.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl KvLoad for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl KvLoad for half::f16 {
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// Attention scores of `N` query heads `q` (`[N, hd]`) over `n` cached
/// positions, into `out` (`[N, n]`): `out[h][j] = scale · (q_h ·
/// k[(start + j) · stride + off ..][..hd])`, `P` positions at a time, each
/// key loaded (and converted from f16) once for the `N` heads; every score
/// in the order of `portable::dot_kv` (lane `i mod 8`, then the `sum8`
/// tree).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_n<T: KvLoad, const N: usize, const P: usize>(
    q: &[f32],
    hd: usize,
    k: &[T],
    stride: usize,
    off: usize,
    start: usize,
    scale: f32,
    out: &mut [f32],
) {
    let n = out.len() / N;
    assert!(hd.is_multiple_of(8) && q.len() == N * hd && out.len() == N * n);
    assert!(n == 0 || (start + n - 1) * stride + off + hd <= k.len());
    let row = |j: usize| k.as_ptr().add((start + j) * stride + off);
    let qp = q.as_ptr();
    let mut j = 0;
    while j + P <= n {
        let mut acc = [[_mm256_setzero_ps(); N]; P];
        let r: [*const T; P] = std::array::from_fn(|u| row(j + u));
        for c in (0..hd).step_by(8) {
            let kv: [__m256; P] = std::array::from_fn(|u| T::load8(r[u].add(c)));
            for h in 0..N {
                let qv = _mm256_loadu_ps(qp.add(h * hd + c));
                for u in 0..P {
                    acc[u][h] = _mm256_fmadd_ps(qv, kv[u], acc[u][h]);
                }
            }
        }
        for u in 0..P {
            for h in 0..N {
                out[h * n + j + u] = hsum8(acc[u][h]) * scale;
            }
        }
        j += P;
    }
    for j in j..n {
        let r = row(j);
        let mut acc = [_mm256_setzero_ps(); N];
        for c in (0..hd).step_by(8) {
            let kv = T::load8(r.add(c));
            for h in 0..N {
                acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(h * hd + c)), kv, acc[h]);
            }
        }
        for h in 0..N {
            out[h * n + j] = hsum8(acc[h]) * scale;
        }
    }
}

/// Attention scores of the query heads `q` (`[nq, hd]`, the heads sharing
/// one KV head) over `n` cached positions into `out` (`[nq, n]`), up to
/// four heads per pass over the keys (see [`scores_n`]).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `hd` must be a multiple of 8; the
/// rows must lie inside `k` (asserted).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attn_scores<T: KvLoad>(
    q: &[f32],
    hd: usize,
    k: &[T],
    stride: usize,
    off: usize,
    start: usize,
    scale: f32,
    out: &mut [f32],
) {
    let nq = q.len() / hd;
    let n = out.len() / nq;
    let (mut h, mut oh) = (0, 0);
    while h < nq {
        let m = (nq - h).min(4);
        let (qs, os) = (&q[h * hd..(h + m) * hd], &mut out[oh..oh + m * n]);
        match m {
            1 => scores_n::<T, 1, 4>(qs, hd, k, stride, off, start, scale, os),
            2 => scores_n::<T, 2, 4>(qs, hd, k, stride, off, start, scale, os),
            3 => scores_n::<T, 3, 2>(qs, hd, k, stride, off, start, scale, os),
            _ => scores_n::<T, 4, 2>(qs, hd, k, stride, off, start, scale, os),
        }
        h += m;
        oh += m * n;
    }
}

/// `out_h += Σ_j p_h[j] · v[(start + j) · stride + off ..][..hd]` for `N`
/// heads (`p`: `[N, n]`, `out`: `[N, hd]`): each element takes one fused
/// multiply-add per position, positions in order (as `portable::axpy_kv`
/// repeated), `W` registers of each head's output held at a time and each
/// value row loaded (and converted) once for the `N` heads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_n<T: KvLoad, const N: usize, const W: usize>(
    p: &[f32],
    v: &[T],
    stride: usize,
    off: usize,
    start: usize,
    out: &mut [f32],
) {
    let (hd, n) = (out.len() / N, p.len() / N);
    assert!(hd.is_multiple_of(8) && out.len() == N * hd && p.len() == N * n);
    assert!(n == 0 || (start + n - 1) * stride + off + hd <= v.len());
    let o = out.as_mut_ptr();
    for c0 in (0..hd).step_by(8 * W) {
        let w = (hd - c0).min(8 * W) / 8;
        let mut acc = [[_mm256_setzero_ps(); W]; N];
        for h in 0..N {
            for u in 0..w {
                acc[h][u] = _mm256_loadu_ps(o.add(h * hd + c0 + 8 * u));
            }
        }
        for j in 0..n {
            let r = v.as_ptr().add((start + j) * stride + off + c0);
            let mut x = [_mm256_setzero_ps(); W];
            for u in 0..w {
                x[u] = T::load8(r.add(8 * u));
            }
            for h in 0..N {
                let s = _mm256_set1_ps(p[h * n + j]);
                for u in 0..w {
                    acc[h][u] = _mm256_fmadd_ps(s, x[u], acc[h][u]);
                }
            }
        }
        for h in 0..N {
            for u in 0..w {
                _mm256_storeu_ps(o.add(h * hd + c0 + 8 * u), acc[h][u]);
            }
        }
    }
}

/// `out_h += Σ_j p_h[j] · v_j` for the query heads sharing one KV head
/// (`p`: `[nq, n]` probabilities, `out`: `[nq, hd]`), up to four heads per
/// pass over the values (see [`values_n`]).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `hd` must be a multiple of 8; the
/// rows must lie inside `v` (asserted).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attn_values<T: KvLoad>(
    p: &[f32],
    hd: usize,
    v: &[T],
    stride: usize,
    off: usize,
    start: usize,
    out: &mut [f32],
) {
    let nq = out.len() / hd;
    let n = p.len() / nq;
    let mut h = 0;
    while h < nq {
        let m = (nq - h).min(4);
        let (ps, os) = (&p[h * n..(h + m) * n], &mut out[h * hd..(h + m) * hd]);
        match m {
            1 => values_n::<T, 1, 8>(ps, v, stride, off, start, os),
            2 => values_n::<T, 2, 4>(ps, v, stride, off, start, os),
            3 => values_n::<T, 3, 2>(ps, v, stride, off, start, os),
            _ => values_n::<T, 4, 2>(ps, v, stride, off, start, os),
        }
        h += m;
    }
}

/// Dequantizes Q4_0 or Q8_0 blocks (`B::BYTES` each: f16 scale, quants
/// `B::unpack` unpacks to i8) into `out` (`[blocks · 32]`): element = `d · q`,
/// one f32 product each, so the bits equal any other dequantization.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant<B: RowBlock>(row: &[u8], out: &mut [f32]) {
    let nb = out.len() / 32;
    assert!(out.len().is_multiple_of(32) && row.len() >= nb * B::BYTES);
    for b in 0..nb {
        let p = row.as_ptr().add(b * B::BYTES);
        let d = _mm256_set1_ps(f16_at(p));
        let q = B::unpack(p.add(2));
        let part = parts(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        for k in 0..4 {
            _mm256_storeu_ps(out.as_mut_ptr().add(32 * b + 8 * k), _mm256_mul_ps(d, part_f32(part[k])));
        }
    }
}

/// Q4_0 blocks → f32 (`out.len()` elements, a multiple of 32).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_q4_0(row: &[u8], out: &mut [f32]) {
    dequant::<Q4Row>(row, out)
}

/// Q8_0 blocks → f32 (`out.len()` elements, a multiple of 32).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_q8_0(row: &[u8], out: &mut [f32]) {
    dequant::<Q8Row>(row, out)
}

/// Dequantizes one ×8 group (`cols` elements per row) into its 8 rows
/// `out` (`[8, cols]`), element = `d · q` as in [`dequant`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_x8<B: RowBlock>(group: &[u8], cols: usize, out: &mut [f32]) {
    let nb = cols / 32;
    assert!(cols.is_multiple_of(32) && out.len() >= X8_ROWS * cols && group.len() >= nb * B::X8_BLOCK);
    let o = out.as_mut_ptr();
    for b in 0..nb {
        let p = group.as_ptr().add(b * B::X8_BLOCK);
        let mut d = [0f32; X8_ROWS];
        _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)));
        let parts = B::x8_rows(p);
        for r in 0..X8_ROWS {
            let dr = _mm256_set1_ps(d[r]);
            for k in 0..4 {
                _mm256_storeu_ps(o.add(r * cols + 32 * b + 8 * k), _mm256_mul_ps(dr, part_f32(parts[r][k])));
            }
        }
    }
}

/// One Q4_0×8 group → its 8 rows in f32 (`out`: `[8, cols]`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_x8_q4_0(group: &[u8], cols: usize, out: &mut [f32]) {
    dequant_x8::<Q4Row>(group, cols, out)
}

/// One Q8_0×8 group → its 8 rows in f32 (`out`: `[8, cols]`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_x8_q8_0(group: &[u8], cols: usize, out: &mut [f32]) {
    dequant_x8::<Q8Row>(group, cols, out)
}

/// One f32 GEMM tile, `T` tokens × 16 panel columns (the order of
/// `portable::panel_tile`: a fused multiply-add per term, `i` ascending):
/// two 8-column accumulators per token, each weight row loaded once for
/// all `T` tokens and each activation broadcast once for both halves.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_tile<const T: usize>(
    depth: usize,
    x: &[f32],
    xs: usize,
    w: &[f32],
    ws: usize,
) -> [[f32; super::PANEL]; T] {
    super::check_panel_tile(T, depth, x.len(), xs, w.len(), ws);
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    let xp: [*const f32; T] = std::array::from_fn(|t| x.as_ptr().add(t * xs));
    for i in 0..depth {
        let wp = w.as_ptr().add(i * ws);
        let (w0, w1) = (_mm256_loadu_ps(wp), _mm256_loadu_ps(wp.add(8)));
        for t in 0..T {
            let b = _mm256_broadcast_ss(&*xp[t].add(i));
            acc[t][0] = _mm256_fmadd_ps(b, w0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(b, w1, acc[t][1]);
        }
    }
    let mut out = [[0f32; super::PANEL]; T];
    for (o, a) in out.iter_mut().zip(acc) {
        _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
        _mm256_storeu_ps(o.as_mut_ptr().add(8), a[1]);
    }
    out
}

/// The 8 × 8 transpose of `r` (`out[j]` lane `i` = `r[i]` lane `j`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let s = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(s[0], s[4]),
        _mm256_permute2f128_ps::<0x20>(s[1], s[5]),
        _mm256_permute2f128_ps::<0x20>(s[2], s[6]),
        _mm256_permute2f128_ps::<0x20>(s[3], s[7]),
        _mm256_permute2f128_ps::<0x31>(s[0], s[4]),
        _mm256_permute2f128_ps::<0x31>(s[1], s[5]),
        _mm256_permute2f128_ps::<0x31>(s[2], s[6]),
        _mm256_permute2f128_ps::<0x31>(s[3], s[7]),
    ]
}

/// Dequantizes one ×8 group into a weight panel: `out[k · stride + r]` =
/// element `k` of row `r` (the values of [`dequant_x8`], 8 × 8 transposed).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_x8_panel<B: RowBlock>(group: &[u8], cols: usize, out: &mut [f32], stride: usize) {
    super::check_x8_panel(group.len(), B::X8_BLOCK, cols, out.len(), stride);
    let o = out.as_mut_ptr();
    for b in 0..cols / 32 {
        let p = group.as_ptr().add(b * B::X8_BLOCK);
        let mut d = [0f32; X8_ROWS];
        _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)));
        let parts = B::x8_rows(p);
        for k in 0..4 {
            let rows: [__m256; X8_ROWS] =
                std::array::from_fn(|r| _mm256_mul_ps(_mm256_set1_ps(d[r]), part_f32(parts[r][k])));
            for (j, v) in transpose8(rows).into_iter().enumerate() {
                _mm256_storeu_ps(o.add((32 * b + 8 * k + j) * stride), v);
            }
        }
    }
}

/// Elements `c0 .. c0 + 16` of the 8 rows of one ×8 group into 8 panel
/// rows (`out[r · stride + c]`): the bits of [`dequant_x8`] for one half
/// of a column block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_x8_rows_panel<B: RowBlock>(group: &[u8], cols: usize, c0: usize, out: &mut [f32], stride: usize) {
    super::check_x8_rows_panel(group.len(), B::X8_BLOCK, cols, c0, out.len(), stride);
    let p = group.as_ptr().add(c0 / 32 * B::X8_BLOCK);
    let half = c0 % 32 / 16;
    let mut d = [0f32; X8_ROWS];
    _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)));
    let parts = B::x8_rows(p);
    let o = out.as_mut_ptr();
    for r in 0..X8_ROWS {
        let dr = _mm256_set1_ps(d[r]);
        for k in 0..2 {
            _mm256_storeu_ps(o.add(r * stride + 8 * k), _mm256_mul_ps(dr, part_f32(parts[r][2 * half + k])));
        }
    }
}

/// [`dequant_x8_rows_panel`] for a Q4_0×8 group.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_x8_rows_panel_q4_0(group: &[u8], cols: usize, c0: usize, out: &mut [f32], stride: usize) {
    dequant_x8_rows_panel::<Q4Row>(group, cols, c0, out, stride)
}

/// [`dequant_x8_rows_panel`] for a Q8_0×8 group.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_x8_rows_panel_q8_0(group: &[u8], cols: usize, c0: usize, out: &mut [f32], stride: usize) {
    dequant_x8_rows_panel::<Q8Row>(group, cols, c0, out, stride)
}

/// One Q4_0×8 group into a weight panel (`out[k · stride + r]`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_x8_panel_q4_0(group: &[u8], cols: usize, out: &mut [f32], stride: usize) {
    dequant_x8_panel::<Q4Row>(group, cols, out, stride)
}

/// One Q8_0×8 group into a weight panel (`out[k · stride + r]`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_x8_panel_q8_0(group: &[u8], cols: usize, out: &mut [f32], stride: usize) {
    super::check_x8_panel(group.len(), Q8_0_X8_BLOCK, cols, out.len(), stride);
    // A 32-byte run of the group holds 4 consecutive elements of each of
    // the 8 rows (lane = row): element `j`'s 8 values go to the top bytes of
    // the lanes by one shuffle ([`q8_x8_top`]), read as `q · 2^24`,
    // and times `d · 2^-24` (exact: a power of two) they are the panel row
    // `d · q` in row order. No transpose: the bits of `d · q` with 3 shuffles
    // per 32 values where the row-wise unpack and an 8 × 8 transpose took
    // about 18.
    let unit = _mm256_set1_ps(1.0 / Q8_TOP_BYTE);
    let o = out.as_mut_ptr();
    for b in 0..cols / 32 {
        let p = group.as_ptr().add(b * Q8_0_X8_BLOCK);
        let d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), unit);
        for k in 0..8 {
            for (j, q) in q8_x8_top(p, k).into_iter().enumerate() {
                _mm256_storeu_ps(o.add((32 * b + 4 * k + j) * stride), _mm256_mul_ps(d, q));
            }
        }
    }
}

/// [`super::portable::exp`] on 4 f64 lanes, operation for operation.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp4_pd(x: __m256d) -> __m256d {
    use super::portable::{EXP_RANGE, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2E};
    // max/min return their second operand when either is NaN: NaN stays.
    let x = _mm256_min_pd(_mm256_set1_pd(EXP_RANGE.1), _mm256_max_pd(_mm256_set1_pd(EXP_RANGE.0), x));
    let n =
        _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_pd(x, _mm256_set1_pd(LOG2E)));
    let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_HI), x);
    let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_LO), r);
    let mut p = _mm256_set1_pd(EXP_TAYLOR[0]);
    for c in &EXP_TAYLOR[1..] {
        p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(*c));
    }
    // 2^n: n + 1.5·2^52 holds 2^51 + n in its low mantissa bits; add
    // 1023 − 2^51 and shift the result into the exponent field. (A NaN lane
    // gives some power of two; p is NaN there.)
    let magic = _mm256_castpd_si256(_mm256_add_pd(n, _mm256_set1_pd(6_755_399_441_055_744.0)));
    let e = _mm256_slli_epi64::<52>(_mm256_add_epi64(magic, _mm256_set1_epi64x(1023 - (1 << 51))));
    _mm256_mul_pd(p, _mm256_castsi256_pd(e))
}

/// [`super::portable::exp`] on 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp8(x: __m256) -> __m256 {
    let lo = _mm256_cvtpd_ps(exp4_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
    let hi = _mm256_cvtpd_ps(exp4_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x))));
    _mm256_set_m128(hi, lo)
}

/// `x[i] = e^{x[i]}`, the bits of `portable::exp` lane by lane.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn exp_slice(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr())));
    }
    chunks.into_remainder().iter_mut().for_each(|v| *v = super::portable::exp(*v));
}
