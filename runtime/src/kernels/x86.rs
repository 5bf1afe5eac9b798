//! x86-64 kernels (AVX2, FMA, F16C), chosen at run time by [`super`] when
//! the CPU has all three. Each is tested bit for bit against its
//! [`super::portable`] twin: the integer sums are exact and the float steps
//! (conversion, multiply, fused multiply-add, lane sums) happen in the same
//! order. Block layouts: GGML Q4_0/Q8_0 (formats/SPEC.md §5) and Q4_0×8
//! (§5.1).
//!
//! Every function here is `unsafe`: the caller guarantees the CPU features
//! (checked once by [`super::has_avx2`]); slice lengths are asserted inside.

use std::arch::x86_64::*;

use nflash_format::interleave::Q4_0X8_GROUP_BLOCK as GROUP_BLOCK;

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
/// block in integers, exactly as `dot8_q4_0x8` does, and the float steps
/// are the same, so a row gives the same bits in either layout.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
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
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
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
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
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
    assert!(out.len().is_multiple_of(32) && rows.iter().all(|r| r.len() >= nb * block));
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
        // `k` picks the same 8-element part of every row and of `out`.
        #[allow(clippy::needless_range_loop)]
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
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_q4_0<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    axpy_blocks(rows, a, out, 18, q4_unpack)
}

/// `out += a[0]·rows[0] + … ` for Q8_0 rows.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`super::has_avx2`); slice lengths
/// are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_q8_0<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    axpy_blocks(rows, a, out, 34, q8_load)
}
