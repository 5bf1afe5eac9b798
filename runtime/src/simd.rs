//! Multi-row quantized kernels for decode: the dot products of 4 weight rows
//! with one Q8_0 activation vector, and a dequantize-and-accumulate (axpy) of
//! one Q4_0/Q8_0 row. Block layouts are GGML's (SPEC §5).
//!
//! candle-core's `vec_dot` handles one row with one accumulator chain; doing
//! four rows per pass shares the activation loads and keeps four independent
//! FMA chains in flight, which is what decode (one token, many rows) needs.
//! On CPUs without AVX2/FMA/F16C, and on other architectures, the kernels
//! fall back to candle-core's `vec_dot` and a portable axpy.

use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ8_0, GgmlType};
use half::f16;
use nflash_format::interleave::Q4_0X8_GROUP_BLOCK;
use nflash_format::DType;

/// Whether the AVX2 kernels can run on this CPU (checked once, then cached by std).
#[inline]
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

use crate::weights::cast as as_blocks;

fn q8_bytes(y: &[BlockQ8_0]) -> &[u8] {
    // SAFETY: BlockQ8_0 is repr(C), 34 bytes with no padding (asserted by candle-core).
    unsafe { std::slice::from_raw_parts(y.as_ptr() as *const u8, std::mem::size_of_val(y)) }
}

/// Dots of four rows of `dtype` (Q4_0 or Q8_0; `cols` elements each) with a
/// Q8_0 activation vector `y` (`cols / 32` blocks).
#[inline]
pub fn dot4(dtype: DType, cols: usize, rows: [&[u8]; 4], y: &[BlockQ8_0]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        let yb = q8_bytes(y);
        // SAFETY: AVX2/FMA/F16C presence checked above; row and vector lengths
        // are checked inside against `cols`.
        return unsafe {
            match dtype {
                DType::Q4_0 => avx2::dot4_q4_0(cols, rows, yb),
                DType::Q8_0 => avx2::dot4_q8_0(cols, rows, yb),
                _ => unreachable!("dot4 on {dtype}"),
            }
        };
    }
    let one = |r: &[u8]| match dtype {
        DType::Q4_0 => BlockQ4_0::vec_dot(cols, as_blocks::<BlockQ4_0>(r), y),
        DType::Q8_0 => BlockQ8_0::vec_dot(cols, as_blocks::<BlockQ8_0>(r), y),
        _ => unreachable!("dot4 on {dtype}"),
    };
    [one(rows[0]), one(rows[1]), one(rows[2]), one(rows[3])]
}

/// Whether [`dot8_q4_0x8`] has a fast kernel on this CPU (AVX2, FMA, F16C):
/// only then are Q4_0 matrices worth reordering to the Q4_0×8 layout
/// (elsewhere, e.g. on ARM, the row layout keeps candle-core's kernels).
pub fn q4_0x8_available() -> bool {
    has_avx2()
}

/// Dots of the 8 rows of one Q4_0×8 group (`cols` elements per row; `group`
/// is `8 · cols / 32 · 18` bytes in the layout of `nflash_format::interleave`)
/// with a Q8_0 activation vector `y` (`cols / 32` blocks). Bit-identical to
/// [`dot4`] on the same rows in the row layout.
#[inline]
pub fn dot8_q4_0x8(cols: usize, group: &[u8], y: &[BlockQ8_0]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths checked inside.
        return unsafe { avx2::dot8_q4_0x8(cols, group, q8_bytes(y)) };
    }
    // Portable: per block, d_x · d_y · Σ (q − 8) · y over the 32 elements.
    let mut out = [0f32; 8];
    for (b, yb) in q8_bytes(y).chunks_exact(34).enumerate().take(cols / 32) {
        let blk = &group[b * Q4_0X8_GROUP_BLOCK..(b + 1) * Q4_0X8_GROUP_BLOCK];
        let dy = f16::from_le_bytes([yb[0], yb[1]]).to_f32();
        let ys = &yb[2..34];
        for (r, o) in out.iter_mut().enumerate() {
            let dx = f16::from_le_bytes([blk[2 * r], blk[2 * r + 1]]).to_f32();
            let q = &blk[16 + 16 * r..32 + 16 * r];
            let sum: i32 = (0..16)
                .map(|i| ((q[i] & 0x0F) as i32 - 8) * ys[i] as i8 as i32 + ((q[i] >> 4) as i32 - 8) * ys[i + 16] as i8 as i32)
                .sum();
            *o += dx * dy * sum as f32;
        }
    }
    out
}

/// `out += a · row` for one Q4_0 or Q8_0 row (`out.len()` elements).
#[inline]
pub fn axpy(dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
    axpy_n(dtype, [row], [a], out)
}

/// `out += a[0] · rows[0] + a[1] · rows[1]`: two neurons' down columns with
/// one pass over `out`.
#[inline]
pub fn axpy2(dtype: DType, rows: [&[u8]; 2], a: [f32; 2], out: &mut [f32]) {
    axpy_n(dtype, rows, a, out)
}

#[inline]
fn axpy_n<const N: usize>(dtype: DType, rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: features checked above; lengths checked inside.
        unsafe {
            match dtype {
                DType::Q4_0 => avx2::axpy_q4_0(rows, a, out),
                DType::Q8_0 => avx2::axpy_q8_0(rows, a, out),
                _ => unreachable!("axpy on {dtype}"),
            }
        }
        return;
    }
    for (r, a) in rows.into_iter().zip(a) {
        portable_axpy(dtype, r, a, out)
    }
}

/// Portable `out += a · row` for Q4_0/Q8_0 (SPEC §5 layouts).
pub fn portable_axpy(dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
    match dtype {
        DType::Q8_0 => {
            for (b, o) in row.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
                let s = a * f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (o, &q) in o.iter_mut().zip(&b[2..34]) {
                    *o += s * (q as i8) as f32;
                }
            }
        }
        DType::Q4_0 => {
            for (b, o) in row.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
                let s = a * f16::from_le_bytes([b[0], b[1]]).to_f32();
                let (lo, hi) = o.split_at_mut(16);
                for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..18]) {
                    *l += s * ((q & 0x0F) as i32 - 8) as f32;
                    *h += s * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        _ => unreachable!("portable_axpy on {dtype}"),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use nflash_format::interleave::Q4_0X8_GROUP_BLOCK as GROUP_BLOCK;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const u16) as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Signed i8 × i8 dot of 32 lanes, as 8 f32 partial sums.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256 {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        let dot = _mm256_maddubs_epi16(ax, sy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)))
    }

    /// 32 Q4_0 values of the block at `p` (after its scale) as i8 in −8..7.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_unpack(p: *const u8) -> __m256i {
        let q = _mm_loadu_si128(p as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(q, m);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
        _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8))
    }

    /// 32 Q8_0 values of the block at `p` (after its scale).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_load(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// Software prefetch distance of `dot4_q4_0`, bytes ahead in each row
    /// (~35 blocks). Decode reads weights far larger than the caches; on the
    /// dev host this gave +10–20% Q4_0 matvec speed over hardware prefetch alone
    /// (interleaved A/B runs on a 65 536 × 4 096 matrix; distances from 256 to
    /// 1 024 bytes were all within the host's noise).
    const PF: usize = 640;

    /// The two 128-bit halves of `v` added lane by lane (lane `j` + lane `j + 4`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn halves(v: __m256i) -> __m128i {
        _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))
    }

    /// Sum of the 4 lanes as `(l0 + l2) + (l1 + l3)`: the one order both
    /// Q4_0 kernels use, so that their results are bit-identical.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum4(v: __m128) -> f32 {
        let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Four Q4_0 rows dotted with the Q8_0 vector `y`. The nibbles stay
    /// unsigned (0..15) for `maddubs` and the −8 offset is applied once per
    /// block as `8·Σy`, shared by the four rows; each row's scale is
    /// broadcast and converted in the vector unit (no scalar round trip).
    /// Lane `j` of a row sums elements `4j..4j+4` and `16+4j..16+4j+4` of each
    /// block in integers, exactly as [`dot8_q4_0x8`] does, and the float steps
    /// are the same, so a row gives the same bits in either layout.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot4_q4_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
        let nb = cols / 32;
        assert!(y.len() >= nb * 34 && rows.iter().all(|r| r.len() >= nb * 18));
        let ones = _mm256_set1_epi16(1);
        let eights = _mm256_set1_epi8(8);
        let m4 = _mm_set1_epi8(0x0F);
        let mut acc = [_mm_setzero_ps(); 4];
        for b in 0..nb {
            let yp = y.as_ptr().add(b * 34);
            let dy = _mm_cvtph_ps(_mm_set1_epi16(std::ptr::read_unaligned(yp as *const i16)));
            let yq = _mm256_loadu_si256(yp.add(2) as *const __m256i);
            // 8·Σy per group of eight lanes, as i32: the correction for x − 8.
            let corr = halves(_mm256_madd_epi16(_mm256_maddubs_epi16(eights, yq), ones));
            for r in 0..4 {
                let xp = rows[r].as_ptr().add(b * 18);
                _mm_prefetch::<_MM_HINT_T0>(xp.wrapping_add(PF) as *const i8);
                let dx = _mm_cvtph_ps(_mm_set1_epi16(std::ptr::read_unaligned(xp as *const i16)));
                let q = _mm_loadu_si128(xp.add(2) as *const __m128i);
                let lo = _mm_and_si128(q, m4);
                let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
                let xu = _mm256_set_m128i(hi, lo);
                let dot = _mm_sub_epi32(halves(_mm256_madd_epi16(_mm256_maddubs_epi16(xu, yq), ones)), corr);
                let f = _mm_mul_ps(_mm_cvtepi32_ps(dot), dy);
                acc[r] = _mm_fmadd_ps(dx, f, acc[r]);
            }
        }
        [hsum4(acc[0]), hsum4(acc[1]), hsum4(acc[2]), hsum4(acc[3])]
    }

    /// The 8 rows of one Q4_0×8 group (`nflash_format::interleave`: per
    /// column block, 8 f16 scales then 8 × 16 nibble bytes) dotted with the
    /// Q8_0 vector `y`. The group is one sequential stream, and each 256-bit
    /// register holds two rows' nibbles: the low nibbles of both against
    /// `y[0..16]` twice, the high ones against `y[16..32]` twice.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot8_q4_0x8(cols: usize, group: &[u8], y: &[u8]) -> [f32; 8] {
        let nb = cols / 32;
        assert!(y.len() >= nb * 34 && group.len() >= nb * GROUP_BLOCK);
        let ones = _mm256_set1_epi16(1);
        let eights = _mm256_set1_epi8(8);
        let m4 = _mm256_set1_epi8(0x0F);
        // Lanes 0–3 take row 2k's scale, lanes 4–7 row 2k+1's.
        let pick = [
            _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
            _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
            _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
            _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7),
        ];
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut p = group.as_ptr();
        for b in 0..nb {
            let yp = y.as_ptr().add(b * 34);
            let dy = _mm256_cvtph_ps(_mm_set1_epi16(std::ptr::read_unaligned(yp as *const i16)));
            let ylo = _mm256_broadcastsi128_si256(_mm_loadu_si128(yp.add(2) as *const __m128i));
            let yhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(yp.add(18) as *const __m128i));
            let corr = _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(eights, ylo), _mm256_maddubs_epi16(eights, yhi)),
                ones,
            );
            let dx = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            for k in 0..4 {
                let q = _mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i);
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                // i16 sums stay within ±2·2·15·128 = ±7 680.
                let s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
                let dot = _mm256_sub_epi32(_mm256_madd_epi16(s, ones), corr);
                let f = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), dy);
                acc[k] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dx, pick[k]), f, acc[k]);
            }
            p = p.add(GROUP_BLOCK);
        }
        let mut out = [0f32; 8];
        for k in 0..4 {
            out[2 * k] = hsum4(_mm256_castps256_ps128(acc[k]));
            out[2 * k + 1] = hsum4(_mm256_extractf128_ps(acc[k], 1));
        }
        out
    }

    /// Four Q8_0 rows dotted with the Q8_0 vector `y`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot4_q8_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
        let nb = cols / 32;
        assert!(y.len() >= nb * 34 && rows.iter().all(|r| r.len() >= nb * 34));
        let mut acc = [_mm256_setzero_ps(); 4];
        for b in 0..nb {
            let yp = y.as_ptr().add(b * 34);
            let dy = f16_at(yp);
            let yq = _mm256_loadu_si256(yp.add(2) as *const __m256i);
            for r in 0..4 {
                let xp = rows[r].as_ptr().add(b * 34);
                let d = _mm256_set1_ps(f16_at(xp) * dy);
                acc[r] = _mm256_fmadd_ps(d, mul_sum_i8(q8_load(xp.add(2)), yq), acc[r]);
            }
        }
        [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
    }

    /// `out += Σ a[i] · rows[i]` over `N` rows of `block`-byte blocks whose
    /// 32 values `load` unpacks to i8; `out` is read and written once per block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_blocks<const N: usize>(
        rows: [&[u8]; N],
        a: [f32; N],
        out: &mut [f32],
        block: usize,
        load: unsafe fn(*const u8) -> __m256i,
    ) {
        let nb = out.len() / 32;
        assert!(out.len() % 32 == 0 && rows.iter().all(|r| r.len() >= nb * block));
        let o = out.as_mut_ptr();
        for b in 0..nb {
            let mut parts = [[_mm_setzero_si128(); 4]; N];
            let mut s = [_mm256_setzero_ps(); N];
            for i in 0..N {
                let xp = rows[i].as_ptr().add(b * block);
                s[i] = _mm256_set1_ps(a[i] * f16_at(xp));
                let v = load(xp.add(2));
                let lo = _mm256_castsi256_si128(v);
                let hi = _mm256_extracti128_si256(v, 1);
                parts[i] = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
            }
            for k in 0..4 {
                let dst = o.add(b * 32 + k * 8);
                let mut acc = _mm256_loadu_ps(dst);
                for i in 0..N {
                    let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i][k]));
                    acc = _mm256_fmadd_ps(s[i], f, acc);
                }
                _mm256_storeu_ps(dst, acc);
            }
        }
    }

    /// `out += a[0]·rows[0] + … ` for Q4_0 rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_q4_0<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
        axpy_blocks(rows, a, out, 18, q4_unpack)
    }

    /// `out += a[0]·rows[0] + … ` for Q8_0 rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_q8_0<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
        axpy_blocks(rows, a, out, 34, q8_load)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::quantize_row;

    fn aligned(bytes: &[u8]) -> Vec<u64> {
        let mut v = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: v has at least bytes.len() bytes.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, bytes.len()) }.copy_from_slice(bytes);
        v
    }

    fn view(v: &[u64], len: usize) -> &[u8] {
        // SAFETY: v holds at least len bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, len) }
    }

    /// The Q4_0 kernel keeps nibbles unsigned and subtracts 8·Σy per block:
    /// check it at the extremes (nibbles 0 and 15, activations ±127) where an
    /// i16 overflow or a wrong correction would show.
    #[test]
    fn dot4_q4_0_extremes_match_candle() {
        let cols = 64;
        let nb = cols / 32;
        let f16b = |v: f32| f16::from_f32(v).to_le_bytes();
        // Rows: all nibbles 0 (−8), all 15 (+7), alternating 0/15 bytes, mixed.
        let fills = [0x00u8, 0xFF, 0xF0, 0x5A];
        let rows: Vec<Vec<u64>> = fills
            .iter()
            .enumerate()
            .map(|(i, &fill)| {
                let mut b = Vec::new();
                for k in 0..nb {
                    b.extend_from_slice(&f16b(0.5 + i as f32 + k as f32 * 0.25));
                    b.extend(std::iter::repeat_n(fill, 16));
                }
                aligned(&b)
            })
            .collect();
        let r: Vec<&[u8]> = rows.iter().map(|v| view(v, nb * 18)).collect();
        for ys in [[127i8; 32], [-127i8; 32], std::array::from_fn(|j| if j % 2 == 0 { 127 } else { -127 })] {
            let mut yb = Vec::new();
            for k in 0..nb {
                yb.extend_from_slice(&f16b(0.01 * (k + 1) as f32));
                yb.extend(ys.iter().map(|&v| v as u8));
            }
            let yv = aligned(&yb);
            let y: &[BlockQ8_0] = as_blocks(view(&yv, nb * 34));
            let got = dot4(DType::Q4_0, cols, [r[0], r[1], r[2], r[3]], y);
            for i in 0..4 {
                let want = BlockQ4_0::vec_dot(cols, as_blocks(r[i]), y);
                assert!((got[i] - want).abs() <= 1e-5 * want.abs().max(1.0), "row {i}: {} vs {want}", got[i]);
            }
        }
    }

    #[test]
    fn dot4_and_axpy_match_candle_and_portable() {
        let cols = 96;
        let mut seed = 17u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
        };
        let x: Vec<f32> = (0..cols).map(|_| rnd()).collect();
        let mut y = vec![BlockQ8_0::zeros(); cols / 32];
        BlockQ8_0::from_float(&x, &mut y);
        for dt in [DType::Q4_0, DType::Q8_0] {
            let rows: Vec<Vec<u64>> = (0..4)
                .map(|_| {
                    let w: Vec<f32> = (0..cols).map(|_| rnd()).collect();
                    let mut b = Vec::new();
                    quantize_row(dt, &w, &mut b);
                    aligned(&b)
                })
                .collect();
            let rb = dt.row_bytes(cols as u64).unwrap() as usize;
            let r: Vec<&[u8]> = rows.iter().map(|v| view(v, rb)).collect();
            let got = dot4(dt, cols, [r[0], r[1], r[2], r[3]], &y);
            for i in 0..4 {
                let want = match dt {
                    DType::Q4_0 => BlockQ4_0::vec_dot(cols, as_blocks(r[i]), &y),
                    _ => BlockQ8_0::vec_dot(cols, as_blocks(r[i]), &y),
                };
                assert!((got[i] - want).abs() <= 1e-4 * want.abs().max(1.0), "{dt} row {i}: {} vs {want}", got[i]);
            }
            let mut a = vec![0.5f32; cols];
            let mut b = vec![0.5f32; cols];
            axpy(dt, r[1], -1.25, &mut a);
            portable_axpy(dt, r[1], -1.25, &mut b);
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() < 1e-5, "{dt} axpy");
            }
            axpy2(dt, [r[2], r[3]], [0.75, -2.0], &mut a);
            portable_axpy(dt, r[2], 0.75, &mut b);
            portable_axpy(dt, r[3], -2.0, &mut b);
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() < 1e-5, "{dt} axpy2");
            }
        }
    }
}
