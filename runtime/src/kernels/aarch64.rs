//! NEON kernels for aarch64 (phones), chosen at run time by `super`: the
//! ARMv8.0 baseline (NEON: `smull` + `sadalp`) on every aarch64 CPU, and
//! `sdot` where the CPU has the dotprod extension (ARMv8.2+, Cortex-A55/A76
//! and later), as llama.cpp's `ggml-cpu/arch/arm/quants.c` does; the
//! quantized prefill GEMM by `smmla` where it has i8mm (ARMv8.6,
//! Cortex-A510/A710/X2 and later), as llama.cpp's `repack.cpp` GEMMs do.
//!
//! Every kernel follows the order of `portable.rs` (per 32-element block
//! the exact integer sum of products, then one fused multiply-add by the
//! product of the two scales), so it gives the portable bits; the tests in
//! `tests.rs` check that bit for bit on each CPU they run on.
//!
//! `sdot` and `smmla` are emitted by inline assembly: their intrinsics
//! (`vdotq_s32`, `vmmlaq_s32`) are not stable in Rust 1.95, plain NEON
//! intrinsics are.

use std::arch::aarch64::*;
use std::arch::asm;

/// `prfm pldl1keep` at `p`: a hint to load the line into L1 (`kernels::prefetch`).
///
/// # Safety
/// None needed beyond the asm block: `prfm` never faults.
#[inline(always)]
pub unsafe fn prefetch(p: *const u8) {
    // SAFETY: a prefetch hint reads nothing architecturally and cannot fault.
    unsafe { asm!("prfm pldl1keep, [{0}]", in(reg) p, options(nostack, preserves_flags, readonly)) };
}

/// Bytes of a Q8_0 block (f16 scale, 32 × i8).
const Q8_0_BLOCK: usize = 34;

/// Four f16 values (bit patterns) as f32, by one `fcvtl` (half-precision
/// conversion is part of the ARMv8.0 baseline; `half`'s conversion would
/// check CPU features on every call, and the `float16x4_t` intrinsics are
/// not stable in Rust 1.95).
#[inline(always)]
unsafe fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: a register-only conversion every aarch64 CPU implements.
    unsafe {
        asm!(
            "fcvtl {o:v}.4s, {h:v}.4h",
            o = lateout(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    out
}

/// The f16 at `p` (little-endian) as f32.
///
/// # Safety
/// Two bytes must be readable at `p`.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    vgetq_lane_f32::<0>(f16x4_to_f32(vdup_n_u16((p as *const u16).read_unaligned())))
}

/// The f16 scales at `p[0..4]` (each 2 bytes at its pointer) as four f32.
///
/// # Safety
/// Two bytes must be readable at each pointer.
#[inline(always)]
unsafe fn f16_at4(p: [*const u8; 4]) -> float32x4_t {
    // Spelled out: `array::map` stayed an out-of-line call in the block loop.
    let h = [
        (p[0] as *const u16).read_unaligned(),
        (p[1] as *const u16).read_unaligned(),
        (p[2] as *const u16).read_unaligned(),
        (p[3] as *const u16).read_unaligned(),
    ];
    f16x4_to_f32(vld1_u16(h.as_ptr()))
}

/// A row-layout block type (formats/SPEC.md §5).
trait RowBlock {
    /// Bytes of one block.
    const BYTES: usize;
    /// The block's 32 values as i8: elements `0..16` and `16..32`.
    ///
    /// # Safety
    /// The block's quant bytes must be readable at `q` (after the scale).
    unsafe fn values(q: *const u8) -> (int8x16_t, int8x16_t);
}

/// GGML Q4_0: element `i` in the low nibble of byte `i`, `16 + i` in its
/// high nibble, both stored as value + 8.
struct Q4Row;
impl RowBlock for Q4Row {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn values(q: *const u8) -> (int8x16_t, int8x16_t) {
        q4_values(vld1q_u8(q))
    }
}

/// A Q4_0 block's 16 quant bytes `b` as its 32 values in i8: elements
/// `0..16` (low nibbles − 8) and `16..32` (high nibbles − 8).
#[inline(always)]
unsafe fn q4_values(b: uint8x16_t) -> (int8x16_t, int8x16_t) {
    let eight = vdupq_n_s8(8);
    let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F))), eight);
    let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(b)), eight);
    (lo, hi)
}

/// GGML Q8_0: 32 × i8.
struct Q8Row;
impl RowBlock for Q8Row {
    const BYTES: usize = 34;
    #[inline(always)]
    unsafe fn values(q: *const u8) -> (int8x16_t, int8x16_t) {
        (vld1q_s8(q as *const i8), vld1q_s8(q.add(16) as *const i8))
    }
}

/// How a block's 32 products are summed into four i32 lanes (their total is
/// the block's exact integer dot).
trait Sum {
    /// `Σ a_i · b_i` over 32 i8 pairs, in four i32 lanes.
    ///
    /// # Safety
    /// The CPU must have what the implementation uses.
    unsafe fn lanes(a: (int8x16_t, int8x16_t), b: (int8x16_t, int8x16_t)) -> int32x4_t;
}

/// ARMv8.0 NEON: widening multiplies to i16 (|product| ≤ 127 · 128, no
/// overflow), pairwise-added into i32.
struct Neon;
impl Sum for Neon {
    #[inline(always)]
    unsafe fn lanes(a: (int8x16_t, int8x16_t), b: (int8x16_t, int8x16_t)) -> int32x4_t {
        let p0 = vmull_s8(vget_low_s8(a.0), vget_low_s8(b.0));
        let p1 = vmull_high_s8(a.0, b.0);
        let p2 = vmull_s8(vget_low_s8(a.1), vget_low_s8(b.1));
        let p3 = vmull_high_s8(a.1, b.1);
        let s = vpaddlq_s16(p0);
        let s = vpadalq_s16(s, p1);
        let s = vpadalq_s16(s, p2);
        vpadalq_s16(s, p3)
    }
}

/// `acc += sdot(a, b)`: each i32 lane adds the dot of four i8 pairs.
///
/// # Safety
/// The CPU must have the dotprod extension.
#[inline(always)]
unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: `sdot` reads and writes registers only; the caller guarantees
    // the CPU implements it (FEAT_DotProd).
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// ARMv8.2 dotprod: two `sdot`s per block.
struct Dot;
impl Sum for Dot {
    #[inline(always)]
    unsafe fn lanes(a: (int8x16_t, int8x16_t), b: (int8x16_t, int8x16_t)) -> int32x4_t {
        sdot(sdot(vdupq_n_s32(0), a.0, b.0), a.1, b.1)
    }
}

/// The Q8_0 block of `y` at block `b`: scale and values.
///
/// # Safety
/// Block `b` must be inside `y` (checked by the callers' asserts).
#[inline(always)]
unsafe fn y_block(y: &[u8], b: usize) -> (f32, (int8x16_t, int8x16_t)) {
    let p = y.as_ptr().add(b * Q8_0_BLOCK);
    (f16_at(p), Q8Row::values(p.add(2)))
}

/// Four rows of `B` blocks dotted with the Q8_0 vector `y`: per block the
/// four exact integer sums, gathered into one vector by pairwise adds, then
/// one fused multiply-add by the scale products (as `portable::dot_row`).
#[inline(always)]
unsafe fn dot4_rows<B: RowBlock, S: Sum>(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    let nb = cols / 32;
    assert!(y.len() >= nb * Q8_0_BLOCK && rows.iter().all(|r| r.len() >= nb * B::BYTES));
    let mut acc = vdupq_n_f32(0.0);
    for b in 0..nb {
        let (dy, yv) = y_block(y, b);
        // Spelled out: `[0, 1, 2, 3].map(..)` compiled to a call of
        // `array::try_map` in every block of the NEON-only kernels (seen by `make mca`).
        let o = b * B::BYTES;
        let p = [rows[0].as_ptr().add(o), rows[1].as_ptr().add(o), rows[2].as_ptr().add(o), rows[3].as_ptr().add(o)];
        let l0 = S::lanes(B::values(p[0].add(2)), yv);
        let l1 = S::lanes(B::values(p[1].add(2)), yv);
        let l2 = S::lanes(B::values(p[2].add(2)), yv);
        let l3 = S::lanes(B::values(p[3].add(2)), yv);
        let s = vpaddq_s32(vpaddq_s32(l0, l1), vpaddq_s32(l2, l3));
        let d = vmulq_n_f32(f16_at4(p), dy);
        acc = vfmaq_f32(acc, d, vcvtq_f32_s32(s));
    }
    let mut out = [0f32; 4];
    vst1q_f32(out.as_mut_ptr(), acc);
    out
}

/// One row of `B` blocks dotted with the Q8_0 vector `y`.
#[inline(always)]
unsafe fn dot_row<B: RowBlock, S: Sum>(cols: usize, row: &[u8], y: &[u8]) -> f32 {
    let nb = cols / 32;
    assert!(y.len() >= nb * Q8_0_BLOCK && row.len() >= nb * B::BYTES);
    let mut acc = 0f32;
    for b in 0..nb {
        let (dy, yv) = y_block(y, b);
        let p = row.as_ptr().add(b * B::BYTES);
        let s = vaddvq_s32(S::lanes(B::values(p.add(2)), yv));
        acc = (f16_at(p) * dy).mul_add(s as f32, acc);
    }
    acc
}

/// Four Q4_0 rows (`cols` elements each) dotted with the Q8_0 vector `y`
/// (`cols / 32` blocks, as bytes), NEON only.
///
/// # Safety
/// None beyond aarch64 (NEON is part of the baseline); lengths are asserted.
pub unsafe fn dot4_q4_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    dot4_rows::<Q4Row, Neon>(cols, rows, y)
}

/// Four Q8_0 rows dotted with the Q8_0 vector `y`, NEON only.
///
/// # Safety
/// As [`dot4_q4_0`].
pub unsafe fn dot4_q8_0(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    dot4_rows::<Q8Row, Neon>(cols, rows, y)
}

/// One Q4_0 row dotted with the Q8_0 vector `y`, NEON only.
///
/// # Safety
/// As [`dot4_q4_0`].
pub unsafe fn dot_q4_0(cols: usize, row: &[u8], y: &[u8]) -> f32 {
    dot_row::<Q4Row, Neon>(cols, row, y)
}

/// One Q8_0 row dotted with the Q8_0 vector `y`, NEON only.
///
/// # Safety
/// As [`dot4_q4_0`].
pub unsafe fn dot_q8_0(cols: usize, row: &[u8], y: &[u8]) -> f32 {
    dot_row::<Q8Row, Neon>(cols, row, y)
}

/// [`dot4_q4_0`] with `sdot`.
///
/// # Safety
/// The CPU must have dotprod (`is_aarch64_feature_detected!("dotprod")`).
#[target_feature(enable = "dotprod")]
pub unsafe fn dot4_q4_0_dot(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    dot4_rows::<Q4Row, Dot>(cols, rows, y)
}

/// [`dot4_q8_0`] with `sdot`.
///
/// # Safety
/// As [`dot4_q4_0_dot`].
#[target_feature(enable = "dotprod")]
pub unsafe fn dot4_q8_0_dot(cols: usize, rows: [&[u8]; 4], y: &[u8]) -> [f32; 4] {
    dot4_rows::<Q8Row, Dot>(cols, rows, y)
}

/// [`dot_q4_0`] with `sdot`.
///
/// # Safety
/// As [`dot4_q4_0_dot`].
#[target_feature(enable = "dotprod")]
pub unsafe fn dot_q4_0_dot(cols: usize, row: &[u8], y: &[u8]) -> f32 {
    dot_row::<Q4Row, Dot>(cols, row, y)
}

/// [`dot_q8_0`] with `sdot`.
///
/// # Safety
/// As [`dot4_q4_0_dot`].
#[target_feature(enable = "dotprod")]
pub unsafe fn dot_q8_0_dot(cols: usize, row: &[u8], y: &[u8]) -> f32 {
    dot_row::<Q8Row, Dot>(cols, row, y)
}

/// The 16 i8 values of `v` as four f32 vectors (lanes 0–3, 4–7, 8–11, 12–15).
#[inline(always)]
unsafe fn to_f32(v: int8x16_t) -> [float32x4_t; 4] {
    let (w0, w1) = (vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v));
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(w0))),
        vcvtq_f32_s32(vmovl_high_s16(w0)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(w1))),
        vcvtq_f32_s32(vmovl_high_s16(w1)),
    ]
}

/// `out += Σ a[r] · rows[r]`, row after row within each 32-element block:
/// per row `s = a · d`, then per element one fused multiply-add
/// `out = s · q + out` (the bits of `portable::axpy_q4_0` applied to each
/// row in turn, with one pass over `out`).
#[inline(always)]
unsafe fn axpy_rows<B: RowBlock, const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    assert!(out.len().is_multiple_of(32) && rows.iter().all(|r| r.len() >= out.len() / 32 * B::BYTES));
    for b in 0..out.len() / 32 {
        let o = out.as_mut_ptr().add(32 * b);
        let mut acc = load_block(o);
        for r in 0..N {
            let p = rows[r].as_ptr().add(b * B::BYTES);
            fma_row(&mut acc, a[r] * f16_at(p), B::values(p.add(2)));
        }
        store_block(o, &acc);
    }
}

/// The 32 f32 at `o` as eight 4-lane vectors.
///
/// # Safety
/// 32 elements must be readable at `o`.
#[inline(always)]
unsafe fn load_block(o: *const f32) -> [float32x4_t; 8] {
    let mut acc = [vdupq_n_f32(0.0); 8];
    for (j, v) in acc.iter_mut().enumerate() {
        *v = vld1q_f32(o.add(4 * j));
    }
    acc
}

/// Stores eight 4-lane vectors as the 32 f32 at `o`.
///
/// # Safety
/// 32 elements must be writable at `o`.
#[inline(always)]
unsafe fn store_block(o: *mut f32, acc: &[float32x4_t; 8]) {
    for (j, v) in acc.iter().enumerate() {
        vst1q_f32(o.add(4 * j), *v);
    }
}

/// `acc += s · row` for one row's 32 values (`lo`: elements 0..16, `hi`:
/// 16..32), one fused multiply-add per element (`s · q + acc`).
#[inline(always)]
unsafe fn fma_row(acc: &mut [float32x4_t; 8], s: f32, (lo, hi): (int8x16_t, int8x16_t)) {
    let (fl, fh) = (to_f32(lo), to_f32(hi));
    for j in 0..4 {
        acc[j] = vfmaq_n_f32(acc[j], fl[j], s);
        acc[4 + j] = vfmaq_n_f32(acc[4 + j], fh[j], s);
    }
}

/// `out += Σ a[r] · rows[r]` over `N` Q4_0 rows (`out.len()` elements, a
/// multiple of 32), NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn axpy_q4_0<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    axpy_rows::<Q4Row, N>(rows, a, out)
}

/// `out += Σ a[r] · rows[r]` over `N` Q8_0 rows, NEON.
///
/// # Safety
/// As [`axpy_q4_0`].
pub unsafe fn axpy_q8_0<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    axpy_rows::<Q8Row, N>(rows, a, out)
}

/// Bytes of a Q4_0×8 column block (formats/SPEC.md §5.1: 8 f16 scales, then
/// four 32-byte word runs of 8 rows × 4 quant bytes).
const Q4_0_X8_BLOCK: usize = 144;
/// Bytes of a Q8_0×8 column block (8 f16 scales, eight word runs).
const Q8_0_X8_BLOCK: usize = 272;

/// `acc += sdot(a, b.4b[L])`: i32 lane `r` adds the dot of the four i8 of
/// `a`'s lane `r` with the four i8 of `b`'s lane `L` (the indexed `sdot`
/// that llama.cpp's repacked `ggml_gemv_q4_0_4x4_q8_0` is built on).
///
/// # Safety
/// The CPU must have the dotprod extension.
#[inline(always)]
unsafe fn sdot_lane<const L: i32>(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: `sdot` (by element) reads and writes registers only; the
    // caller guarantees FEAT_DotProd.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.4b[{l}]",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            l = const L,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// The 16 bytes at `p + OFF` by one `ldr q`: never paired into an `ldp`,
/// which in-order cores (Cortex-A55) issue as a multi-cycle load that
/// stalls the next instruction.
///
/// # Safety
/// 16 bytes must be readable at `p + OFF`.
#[inline(always)]
unsafe fn ldr_q<const OFF: usize>(p: *const u8) -> int8x16_t {
    let v: int8x16_t;
    // SAFETY: the caller guarantees the 16 bytes are readable.
    unsafe {
        asm!(
            "ldr {v:q}, [{p}, #{off}]",
            v = lateout(vreg) v,
            p = in(reg) p,
            off = const OFF,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v
}

/// A ×8 column-block type (SPEC §5.1).
trait X8Block {
    /// Bytes of one column block.
    const BYTES: usize;
    /// Whether the quants are stored as value + 8 (Q4_0: the dot is
    /// corrected by `8 · Σy` per block).
    const OFFSET: bool;
    /// The block's quants as `[k][h]`: for word `k` (elements `4k .. 4k+4`
    /// in `h = 0, 1`; `16 + 4k ..` in `h = 2, 3`) the 4 bytes of rows 0–3
    /// (`h` even) or 4–7 (`h` odd), one row per 32-bit lane, as stored
    /// (Q4_0 nibbles unsigned 0..15).
    ///
    /// # Safety
    /// `BYTES` bytes must be readable at `p`.
    unsafe fn words(p: *const u8) -> [[int8x16_t; 4]; 4];
    /// Row `r` (0..8) of the block's 32 values as i8: elements `0..16`, `16..32`.
    ///
    /// # Safety
    /// `BYTES` bytes must be readable at `p`.
    unsafe fn rows(p: *const u8) -> [(int8x16_t, int8x16_t); 8];
}

/// Rows `4h .. 4h+4` of the four word runs at `p` (32 bytes apart), each
/// row's four words gathered into one vector (a 4 × 4 transpose of u32).
#[inline(always)]
unsafe fn gather_rows(p: *const u8, h: usize) -> [uint8x16_t; 4] {
    let run = |j: usize| vreinterpretq_u32_u8(vld1q_u8(p.add(32 * j + 16 * h)));
    let v = [run(0), run(1), run(2), run(3)];
    let (t0, t1) = (vtrn1q_u32(v[0], v[1]), vtrn2q_u32(v[0], v[1]));
    let (t2, t3) = (vtrn1q_u32(v[2], v[3]), vtrn2q_u32(v[2], v[3]));
    let (t0, t1, t2, t3) =
        (vreinterpretq_u64_u32(t0), vreinterpretq_u64_u32(t1), vreinterpretq_u64_u32(t2), vreinterpretq_u64_u32(t3));
    [
        vreinterpretq_u8_u64(vtrn1q_u64(t0, t2)),
        vreinterpretq_u8_u64(vtrn1q_u64(t1, t3)),
        vreinterpretq_u8_u64(vtrn2q_u64(t0, t2)),
        vreinterpretq_u8_u64(vtrn2q_u64(t1, t3)),
    ]
}

/// Q4_0×8: word `k` holds quant bytes `4k .. 4k+4`, whose low nibbles are
/// elements `4k ..` and high nibbles `16 + 4k ..`.
struct Q4X8;
impl X8Block for Q4X8 {
    const BYTES: usize = Q4_0_X8_BLOCK;
    const OFFSET: bool = true;
    #[inline(always)]
    unsafe fn words(p: *const u8) -> [[int8x16_t; 4]; 4] {
        let m = vdupq_n_u8(0x0F);
        let w = |k: usize, h: usize| vld1q_u8(p.add(16 + 32 * k + 16 * h));
        let one = |k: usize| {
            let (a, b) = (w(k, 0), w(k, 1));
            [
                vreinterpretq_s8_u8(vandq_u8(a, m)),
                vreinterpretq_s8_u8(vandq_u8(b, m)),
                vreinterpretq_s8_u8(vshrq_n_u8::<4>(a)),
                vreinterpretq_s8_u8(vshrq_n_u8::<4>(b)),
            ]
        };
        [one(0), one(1), one(2), one(3)]
    }
    #[inline(always)]
    unsafe fn rows(p: *const u8) -> [(int8x16_t, int8x16_t); 8] {
        // Each gathered row is its 16 quant bytes in order, as in the row layout.
        let (a, b) = (gather_rows(p.add(16), 0), gather_rows(p.add(16), 1));
        [
            q4_values(a[0]),
            q4_values(a[1]),
            q4_values(a[2]),
            q4_values(a[3]),
            q4_values(b[0]),
            q4_values(b[1]),
            q4_values(b[2]),
            q4_values(b[3]),
        ]
    }
}

/// Q8_0×8: words `0..4` (from byte 16) hold elements `0..16`, words `4..8`
/// (from byte 144) elements `16..32`.
struct Q8X8;
impl X8Block for Q8X8 {
    const BYTES: usize = Q8_0_X8_BLOCK;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn words(p: *const u8) -> [[int8x16_t; 4]; 4] {
        let w = |o: usize| vld1q_s8(p.add(o) as *const i8);
        let one = |k: usize| [w(16 + 32 * k), w(32 + 32 * k), w(144 + 32 * k), w(160 + 32 * k)];
        [one(0), one(1), one(2), one(3)]
    }
    #[inline(always)]
    unsafe fn rows(p: *const u8) -> [(int8x16_t, int8x16_t); 8] {
        let lo = [gather_rows(p.add(16), 0), gather_rows(p.add(16), 1)];
        let hi = [gather_rows(p.add(144), 0), gather_rows(p.add(144), 1)];
        let row = |r: usize| (vreinterpretq_s8_u8(lo[r / 4][r % 4]), vreinterpretq_s8_u8(hi[r / 4][r % 4]));
        [row(0), row(1), row(2), row(3), row(4), row(5), row(6), row(7)]
    }
}

/// `T` tokens' results over the 8 rows of a group, held as two 4-lane
/// vectors (rows 0–3, 4–7) each, as `out[t][r]`.
#[inline(always)]
unsafe fn store8<const T: usize>(acc: [[float32x4_t; 2]; T]) -> [[f32; 8]; T] {
    let mut out = [[0f32; 8]; T];
    for (o, a) in out.iter_mut().zip(acc) {
        vst1q_f32(o.as_mut_ptr(), a[0]);
        vst1q_f32(o.as_mut_ptr().add(4), a[1]);
    }
    out
}

/// The 8 rows of one ×8 group dotted with `T` Q8_0 vectors `ys` (`sums[t]`:
/// their per-block Σq, used for Q4_0's offset): `out[t][r]`. Rows 0–3 and
/// 4–7 are one i32 vector each; per block and token, eight indexed `sdot`s
/// (each word run against the token's 4 matching bytes), then one fused
/// multiply-add by the scale products, the order of `portable::gemm_x8`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `b` and `t` index several slices and registers at once
unsafe fn gemm_x8_rows<B: X8Block, const T: usize>(
    cols: usize,
    group: &[u8],
    ys: [&[u8]; T],
    sums: [&[i32]; T],
) -> [[f32; 8]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * B::BYTES && ys.iter().all(|y| y.len() >= nb * Q8_0_BLOCK));
    assert!(!B::OFFSET || sums.iter().all(|s| s.len() >= nb));
    let mut acc = [[vdupq_n_f32(0.0); 2]; T];
    for b in 0..nb {
        let p = group.as_ptr().add(b * B::BYTES);
        let h = vld1q_u16(p as *const u16);
        let (d0, d1) = (f16x4_to_f32(vget_low_u16(h)), f16x4_to_f32(vget_high_u16(h)));
        let w = B::words(p);
        for t in 0..T {
            let (dy, (y0, y1)) = y_block(ys[t], b);
            // Q4_0's offset `-8 · Σy` starts the sums (exact integers; one
            // `dup` where a subtraction per half would follow the dots).
            let start = vdupq_n_s32(if B::OFFSET { -8 * sums[t][b] } else { 0 });
            let (mut s0, mut s1) = (start, start);
            s0 = sdot_lane::<0>(sdot_lane::<0>(s0, w[0][0], y0), w[0][2], y1);
            s1 = sdot_lane::<0>(sdot_lane::<0>(s1, w[0][1], y0), w[0][3], y1);
            s0 = sdot_lane::<1>(sdot_lane::<1>(s0, w[1][0], y0), w[1][2], y1);
            s1 = sdot_lane::<1>(sdot_lane::<1>(s1, w[1][1], y0), w[1][3], y1);
            s0 = sdot_lane::<2>(sdot_lane::<2>(s0, w[2][0], y0), w[2][2], y1);
            s1 = sdot_lane::<2>(sdot_lane::<2>(s1, w[2][1], y0), w[2][3], y1);
            s0 = sdot_lane::<3>(sdot_lane::<3>(s0, w[3][0], y0), w[3][2], y1);
            s1 = sdot_lane::<3>(sdot_lane::<3>(s1, w[3][1], y0), w[3][3], y1);
            acc[t][0] = vfmaq_f32(acc[t][0], vmulq_n_f32(d0, dy), vcvtq_f32_s32(s0));
            acc[t][1] = vfmaq_f32(acc[t][1], vmulq_n_f32(d1, dy), vcvtq_f32_s32(s1));
        }
    }
    store8(acc)
}

/// The 8 rows of one Q4_0×8 group dotted with `T` Q8_0 vectors (`sums[t]`:
/// their per-block Σq), with `sdot`: `out[t][r]`, the bits of
/// `portable::gemm_x8_q4_0`.
///
/// # Safety
/// The CPU must have dotprod (`is_aarch64_feature_detected!("dotprod")`);
/// lengths are asserted.
#[target_feature(enable = "dotprod")]
pub unsafe fn gemm_x8_q4_0_dot<const T: usize>(
    cols: usize,
    group: &[u8],
    ys: [&[u8]; T],
    sums: [&[i32]; T],
) -> [[f32; 8]; T] {
    gemm_x8_rows::<Q4X8, T>(cols, group, ys, sums)
}

/// The 8 rows of one Q8_0×8 group dotted with `T` Q8_0 vectors, with `sdot`.
///
/// # Safety
/// As [`gemm_x8_q4_0_dot`].
#[target_feature(enable = "dotprod")]
pub unsafe fn gemm_x8_q8_0_dot<const T: usize>(cols: usize, group: &[u8], ys: [&[u8]; T]) -> [[f32; 8]; T] {
    gemm_x8_rows::<Q8X8, T>(cols, group, ys, [&[][..]; T])
}

/// `acc += A · Bᵀ` for two 2 × 8 i8 matrices (`a`: rows at bytes 0..8 and
/// 8..16, as `b`): i32 lane `2i + j` adds row `i` of `a` dotted with row
/// `j` of `b`, 32 multiply-accumulates in one `smmla` (FEAT_I8MM).
///
/// # Safety
/// The CPU must have the i8mm extension.
#[inline(always)]
unsafe fn smmla(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: `smmla` reads and writes registers only; the caller
    // guarantees FEAT_I8MM.
    unsafe {
        asm!(
            "smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// Bytes of one column block of a ×8 group in the `smmla` order that
/// [`mm_prepare`] writes: 16 operands of 16 bytes (row pair `p` = rows
/// `2p, 2p+1`, chunk `c` = elements `8c .. 8c+8` of both rows as i8, at
/// `16 · (4p + c)`), then 4 f32 vectors of scales (`d` of rows `2p, 2p,
/// 2p+1, 2p+1` at `256 + 16p`).
pub const MM_BLOCK: usize = 320;

/// One ×8 group (SPEC §5.1, `cols` elements per row; Q4_0 if `q4`, else
/// Q8_0) rewritten into `out` in the order `smmla` takes it ([`MM_BLOCK`]
/// bytes per 32 columns): two rows' 8 consecutive values per operand, Q4_0
/// nibbles as stored (0..15: the `−8` is in the token pairs' start
/// values, [`mm_pair`]), scales widened to f32. Prefill does
/// this once per group for all its tokens ([`gemm_x8_q4_0_mm`]); the layout in
/// memory stays the ×8 one, which decode's indexed `sdot` wants.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn mm_prepare(q4: bool, cols: usize, group: &[u8], out: &mut Vec<u8>) {
    let nb = cols / 32;
    let bytes = if q4 { Q4_0_X8_BLOCK } else { Q8_0_X8_BLOCK };
    assert!(group.len() >= nb * bytes);
    if out.len() < nb * MM_BLOCK {
        out.resize(nb * MM_BLOCK, 0);
    }
    let (p, o) = (group.as_ptr(), out.as_mut_ptr());
    // One loop per type, each block's work unrolled (`mm_block`).
    if q4 {
        for b in 0..nb {
            mm_block::<true>(p.add(b * bytes), o.add(b * MM_BLOCK));
        }
    } else {
        for b in 0..nb {
            mm_block::<false>(p.add(b * bytes), o.add(b * MM_BLOCK));
        }
    }
}

/// One column block of [`mm_prepare`]: the ×8 block at `p` (Q4_0 if `Q4`)
/// into the [`MM_BLOCK`] bytes at `o`.
///
/// # Safety
/// The block's bytes must be readable at `p`, `MM_BLOCK` writable at `o`.
#[inline(always)]
unsafe fn mm_block<const Q4: bool>(p: *const u8, o: *mut u8) {
    // Word run `j` (bytes `4j .. 4j+4` of each row), rows `4h .. 4h+4`.
    let run = |j: usize, h: usize| vld1q_u32(p.add(16 + 32 * j + 16 * h) as *const u32);
    let put = |pair: usize, c: usize, v: uint8x16_t| vst1q_u8(o.add(16 * (4 * pair + c)), v);
    let m = vdupq_n_u8(0x0F);
    for h in 0..2 {
        for c in 0..if Q4 { 2 } else { 4 } {
            // Words 2c and 2c+1 zipped: rows (4h, 4h+1), then (4h+2, 4h+3).
            let (a, z) = (run(2 * c, h), run(2 * c + 1, h));
            for (i, v) in [vzip1q_u32(a, z), vzip2q_u32(a, z)].into_iter().enumerate() {
                let v = vreinterpretq_u8_u32(v);
                if Q4 {
                    // Low nibbles are elements 8c.., high ones 16 + 8c...
                    put(2 * h + i, c, vandq_u8(v, m));
                    put(2 * h + i, c + 2, vshrq_n_u8::<4>(v));
                } else {
                    put(2 * h + i, c, v);
                }
            }
        }
    }
    let h = vld1q_u16(p as *const u16);
    let (d0, d1) = (f16x4_to_f32(vget_low_u16(h)), f16x4_to_f32(vget_high_u16(h)));
    let d = o.add(256) as *mut f32;
    vst1q_f32(d, vzip1q_f32(d0, d0));
    vst1q_f32(d.add(4), vzip2q_f32(d0, d0));
    vst1q_f32(d.add(8), vzip1q_f32(d1, d1));
    vst1q_f32(d.add(12), vzip2q_f32(d1, d1));
}

/// Bytes of one column block of a token pair in the order `smmla` takes
/// it ([`mm_pair`]): 4 operands (chunk `c` = values `8c .. 8c+8` of both
/// tokens), the f32 scales `(dy0, dy1, dy0, dy1)` and, four times (one
/// per row pair of a group: each accumulator loads its own, where one
/// copy cost a register move per use), the i32 start of a Q4_0 block's
/// sums, `−8 · (Σy0, Σy1, Σy0, Σy1)` (the offset of its nibbles, as the
/// `sdot` kernels start theirs).
pub const MM_PAIR_BLOCK: usize = 144;

/// Two Q8_0 vectors (`cols / 32` blocks each; `s0`, `s1` their per-block
/// sums of quants) rewritten into `out` in the order `smmla` takes them
/// ([`MM_PAIR_BLOCK`] bytes per block): done once per prefill batch, for
/// every group of every matrix that multiplies it.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn mm_pair(cols: usize, (y0, s0): (&[u8], &[i32]), (y1, s1): (&[u8], &[i32]), out: &mut [u8]) {
    let nb = cols / 32;
    assert!(y0.len() >= nb * Q8_0_BLOCK && y1.len() >= nb * Q8_0_BLOCK && out.len() >= nb * MM_PAIR_BLOCK);
    assert!(s0.len() >= nb && s1.len() >= nb);
    for b in 0..nb {
        let (p0, p1) = (y0.as_ptr().add(b * Q8_0_BLOCK), y1.as_ptr().add(b * Q8_0_BLOCK));
        let o = out.as_mut_ptr().add(b * MM_PAIR_BLOCK);
        let load = |p: *const u8, k: usize| vld1q_u64(p.add(2 + 16 * k) as *const u64);
        for k in 0..2 {
            let (a, z) = (load(p0, k), load(p1, k));
            vst1q_u64(o.add(32 * k) as *mut u64, vzip1q_u64(a, z));
            vst1q_u64(o.add(32 * k + 16) as *mut u64, vzip2q_u64(a, z));
        }
        let d = [f16_at(p0), f16_at(p1)];
        std::ptr::copy_nonoverlapping([d[0], d[1], d[0], d[1]].as_ptr(), o.add(64) as *mut f32, 4);
        let st = [-8 * s0[b], -8 * s1[b]];
        for rp in 0..4 {
            std::ptr::copy_nonoverlapping([st[0], st[1], st[0], st[1]].as_ptr(), o.add(80 + 16 * rp) as *mut i32, 4);
        }
    }
}

/// The 8 rows of one ×8 group prepared by [`mm_prepare`] dotted with `P`
/// token pairs prepared by [`mm_pair`]: `out[p][t][r]` for token `t` (0, 1)
/// of pair `p`. Per block and row pair, 4 `smmla`s per token pair (2 rows
/// × 2 tokens × 32 values), the exact integer sums converted and added by
/// one fused multiply-add by the scale products: the bits of
/// `portable::gemm_x8` (for Q4_0, `Q4`, the sums start at the pair's
/// `−8 · Σy`). The quantized prefill GEMM on CPUs with i8mm
/// (Cortex-A510/A710/X2 and later): 32 MACs per instruction where `sdot`
/// does 16.
///
/// # Safety
/// The CPU must have i8mm; lengths are asserted.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `p` and `rp` index several arrays and registers at once
unsafe fn gemm_x8_mm<const Q4: bool, const P: usize>(
    cols: usize,
    prep: &[u8],
    pairs: [&[u8]; P],
) -> [[[f32; 8]; 2]; P] {
    let nb = cols / 32;
    assert!(prep.len() >= nb * MM_BLOCK && pairs.iter().all(|y| y.len() >= nb * MM_PAIR_BLOCK));
    let mut acc = [[vdupq_n_f32(0.0); 4]; P];
    for b in 0..nb {
        let w = prep.as_ptr().add(b * MM_BLOCK);
        let q = pairs.map(|y| y.as_ptr().add(b * MM_PAIR_BLOCK));
        let y = q.map(|q| {
            let op = |c: usize| vld1q_s8(q.add(16 * c) as *const i8);
            ([op(0), op(1), op(2), op(3)], vld1q_f32(q.add(64) as *const f32))
        });
        for rp in 0..4 {
            let op = |c: usize| vld1q_s8(w.add(16 * (4 * rp + c)) as *const i8);
            let ops = [op(0), op(1), op(2), op(3)];
            let d = vld1q_f32(w.add(256 + 16 * rp) as *const f32);
            for p in 0..P {
                let (yk, dy) = y[p];
                // Q4_0's start, one copy per row pair: one load each, where
                // one copy took a register move (a vector pipe) per use.
                let mut s = if Q4 { vld1q_s32(q[p].add(80 + 16 * rp) as *const i32) } else { vdupq_n_s32(0) };
                s = smmla(s, ops[0], yk[0]);
                s = smmla(s, ops[1], yk[1]);
                s = smmla(s, ops[2], yk[2]);
                s = smmla(s, ops[3], yk[3]);
                acc[p][rp] = vfmaq_f32(acc[p][rp], vmulq_f32(d, dy), vcvtq_f32_s32(s));
            }
        }
    }
    let mut out = [[[0f32; 8]; 2]; P];
    for p in 0..P {
        for rp in 0..4 {
            // Lane 2i + j: row 2rp + i, token j.
            let mut l = [0f32; 4];
            vst1q_f32(l.as_mut_ptr(), acc[p][rp]);
            for i in 0..2 {
                for j in 0..2 {
                    out[p][j][2 * rp + i] = l[2 * i + j];
                }
            }
        }
    }
    out
}

/// The 8 rows of one Q4_0×8 group, prepared by [`mm_prepare`], dotted with
/// `P` token pairs prepared by [`mm_pair`], by `smmla`: `out[p][t][r]`.
///
/// # Safety
/// The CPU must have i8mm (`is_aarch64_feature_detected!("i8mm")`); lengths
/// are asserted.
#[target_feature(enable = "i8mm")]
pub unsafe fn gemm_x8_q4_0_mm<const P: usize>(cols: usize, prep: &[u8], pairs: [&[u8]; P]) -> [[[f32; 8]; 2]; P] {
    gemm_x8_mm::<true, P>(cols, prep, pairs)
}

/// As [`gemm_x8_q4_0_mm`] for a prepared Q8_0×8 group.
///
/// # Safety
/// As [`gemm_x8_q4_0_mm`].
#[target_feature(enable = "i8mm")]
pub unsafe fn gemm_x8_q8_0_mm<const P: usize>(cols: usize, prep: &[u8], pairs: [&[u8]; P]) -> [[[f32; 8]; 2]; P] {
    gemm_x8_mm::<false, P>(cols, prep, pairs)
}

/// Bytes per block of four tokens' [`half_quad`].
pub const HALF_QUAD: usize = 208;

/// Four Q8_0 vectors (`(bytes, per-block Σq)` each) as
/// [`gemm_x8_half_q4_0_dot`] reads them, written once per prefill batch
/// into `out` ([`HALF_QUAD`] bytes per block): each token's start of a
/// Q4_0 block's sums, `−8 · Σy` in 4 i32 lanes (bytes 0..64), the four
/// scales as f32, token `j` in lane `j` (64..80), then 8 vectors of their
/// values interleaved like llama.cpp's `block_q8_0x4`: vector `k` holds
/// bytes `4k .. 4k+4` of token `j` in lane `j` (80..208), so one indexed
/// `sdot` per token reads one register shared by four tokens.
///
/// Panics if a slice is shorter than the blocks of `ys[0]` need.
pub fn half_quad(ys: [(&[u8], &[i32]); 4], out: &mut [u8]) {
    let nb = ys[0].0.len() / Q8_0_BLOCK;
    assert!(ys.iter().all(|(y, s)| y.len() >= nb * Q8_0_BLOCK && s.len() >= nb) && out.len() >= nb * HALF_QUAD);
    for (b, o) in out.chunks_exact_mut(HALF_QUAD).take(nb).enumerate() {
        for (j, (y, sums)) in ys.iter().enumerate() {
            let blk = &y[b * Q8_0_BLOCK..(b + 1) * Q8_0_BLOCK];
            let dy = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            for l in 0..4 {
                o[16 * j + 4 * l..16 * j + 4 * l + 4].copy_from_slice(&(-8 * sums[b]).to_le_bytes());
            }
            o[64 + 4 * j..64 + 4 * j + 4].copy_from_slice(&dy.to_le_bytes());
            for k in 0..8 {
                o[80 + 16 * k + 4 * j..80 + 16 * k + 4 * j + 4].copy_from_slice(&blk[2 + 4 * k..6 + 4 * k]);
            }
        }
    }
}

/// The exact integer sums of one block for four tokens prepared by
/// [`half_quad`] (`base`: the quad's block) against the words `w` of four
/// rows (`[k][0]`: elements `4k ..`, `[k][1]`: `16 + 4k ..`, one row per
/// lane, from [`X8Block::words`]): lane `i` of token `j`'s vector is row
/// `i`'s sum, started at Q4_0's `−8 · Σy`. Word by word, each token takes
/// one indexed `sdot` from the interleaved values (llama.cpp's
/// `ggml_gemm_q4_0_4x4_q8_0` order: four independent chains); values and
/// starts are loaded by [`ldr_q`].
#[inline(always)]
unsafe fn quad_sums<B: X8Block>(base: *const u8, w: &[[int8x16_t; 2]; 4]) -> [int32x4_t; 4] {
    let mut s = if B::OFFSET {
        [ldr_q::<0>(base), ldr_q::<16>(base), ldr_q::<32>(base), ldr_q::<48>(base)].map(|v| vreinterpretq_s32_s8(v))
    } else {
        [vdupq_n_s32(0); 4]
    };
    let y = [
        (ldr_q::<80>(base), ldr_q::<144>(base)),
        (ldr_q::<96>(base), ldr_q::<160>(base)),
        (ldr_q::<112>(base), ldr_q::<176>(base)),
        (ldr_q::<128>(base), ldr_q::<192>(base)),
    ];
    for k in 0..4 {
        let (lo, hi) = y[k];
        s[0] = sdot_lane::<0>(sdot_lane::<0>(s[0], w[k][0], lo), w[k][1], hi);
        s[1] = sdot_lane::<1>(sdot_lane::<1>(s[1], w[k][0], lo), w[k][1], hi);
        s[2] = sdot_lane::<2>(sdot_lane::<2>(s[2], w[k][0], lo), w[k][1], hi);
        s[3] = sdot_lane::<3>(sdot_lane::<3>(s[3], w[k][0], lo), w[k][1], hi);
    }
    s
}

/// Rows `4h .. 4h+4` (one half of a ×8 group) dotted with 8 Q8_0 vectors
/// prepared by [`half_quad`] (tokens `4q .. 4q+4` in `quads[q]`):
/// `out[t][i]` for row `4h + i`. Per block the half's 8 word runs are read
/// and split once for the 8 tokens, the sums of each quad taken by
/// [`quad_sums`], then each token one fused multiply-add by the scale
/// products (`d` times the token's lane of the quad's scales): the bits of
/// `portable::gemm_x8` (the integer sums are exact in any order). `H`:
/// which half, a constant so that the other half's words are never split.
/// Every value and start is loaded by `ldr q`: paired `ldp q` loads made
/// the llvm-mca Cortex-A55 model stall 6 cycles after each (5.19 cycles
/// per block, llama.cpp's hand-scheduled `ldr q` kernel 4.22; now 3.97).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `k` and `t` index several arrays and registers at once
unsafe fn gemm_x8_half<B: X8Block, const H: usize>(cols: usize, group: &[u8], quads: [&[u8]; 2]) -> [[f32; 4]; 8] {
    let (nb, h) = (cols / 32, H);
    assert!(h < 2 && group.len() >= nb * B::BYTES && quads.iter().all(|q| q.len() >= nb * HALF_QUAD));
    // Raw pointers: the lengths are asserted above.
    let qp = quads.map(|q| q.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); 8];
    for b in 0..nb {
        let p = group.as_ptr().add(b * B::BYTES);
        let d = f16x4_to_f32(vld1_u16((p as *const u16).add(4 * h)));
        // Words [k][0] (elements 4k.., rows of this half) and [k][1] (16 + 4k..).
        let w = B::words(p);
        let w = [[w[0][h], w[0][2 + h]], [w[1][h], w[1][2 + h]], [w[2][h], w[2][2 + h]], [w[3][h], w[3][2 + h]]];
        // The two quads spelled out: a loop over them stayed a loop, with the sums on the stack.
        let s = [quad_sums::<B>(qp[0].add(b * HALF_QUAD), &w), quad_sums::<B>(qp[1].add(b * HALF_QUAD), &w)];
        for q in 0..2 {
            let dy = vld1q_f32(qp[q].add(b * HALF_QUAD + 64) as *const f32);
            let sf = s[q].map(|v| vcvtq_f32_s32(v));
            let a = &mut acc[4 * q..4 * q + 4];
            a[0] = vfmaq_f32(a[0], vmulq_laneq_f32::<0>(d, dy), sf[0]);
            a[1] = vfmaq_f32(a[1], vmulq_laneq_f32::<1>(d, dy), sf[1]);
            a[2] = vfmaq_f32(a[2], vmulq_laneq_f32::<2>(d, dy), sf[2]);
            a[3] = vfmaq_f32(a[3], vmulq_laneq_f32::<3>(d, dy), sf[3]);
        }
    }
    let mut out = [[0f32; 4]; 8];
    for (o, a) in out.iter_mut().zip(acc) {
        vst1q_f32(o.as_mut_ptr(), a);
    }
    out
}

/// Rows `4h .. 4h+4` of one Q4_0×8 group dotted with 8 Q8_0 vectors
/// prepared by [`half_quad`], with `sdot`: `out[t][i]`, the bits of
/// `portable::gemm_x8_q4_0`. Prefill's GEMM on CPUs with dotprod and no
/// i8mm, 8 tokens per call.
///
/// # Safety
/// The CPU must have dotprod; lengths are asserted.
#[target_feature(enable = "dotprod")]
pub unsafe fn gemm_x8_half_q4_0_dot(cols: usize, group: &[u8], h: usize, quads: [&[u8]; 2]) -> [[f32; 4]; 8] {
    if h == 0 {
        gemm_x8_half::<Q4X8, 0>(cols, group, quads)
    } else {
        gemm_x8_half::<Q4X8, 1>(cols, group, quads)
    }
}

/// As [`gemm_x8_half_q4_0_dot`] for a Q8_0×8 group.
///
/// # Safety
/// As [`gemm_x8_half_q4_0_dot`].
#[target_feature(enable = "dotprod")]
pub unsafe fn gemm_x8_half_q8_0_dot(cols: usize, group: &[u8], h: usize, quads: [&[u8]; 2]) -> [[f32; 4]; 8] {
    if h == 0 {
        gemm_x8_half::<Q8X8, 0>(cols, group, quads)
    } else {
        gemm_x8_half::<Q8X8, 1>(cols, group, quads)
    }
}

/// `x` (`[32 · nb]`) quantized to Q8_0 (`out`: `nb` blocks of 34 bytes)
/// with each block's Σq in `sums`: the bytes of `portable::quantize_q8_0`.
/// The block's largest magnitude by `fmaxnm` (NaN ignored, as `f32::max`
/// does, from 0), the scale and its inverse in scalar code as there, then
/// `q = round(x · id)` by `fcvtas` (to nearest, ties away from zero, as
/// `f32::round`) and saturating narrows (as `as i8`). Decode quantizes
/// every activation a Q4_0/Q8_0 matrix multiplies.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn quantize_q8_0(x: &[f32], out: &mut [u8], sums: &mut [i32]) {
    let nb = x.len() / 32;
    assert!(x.len() == nb * 32 && out.len() == nb * 34 && sums.len() == nb, "Q8_0 quantization lengths");
    for (b, s) in sums.iter_mut().enumerate() {
        let p = x.as_ptr().add(32 * b);
        let v: [float32x4_t; 8] = std::array::from_fn(|i| vld1q_f32(p.add(4 * i)));
        let m = v.iter().fold(vdupq_n_f32(0.0), |m, &v| vmaxnmq_f32(m, vabsq_f32(v)));
        let amax = vmaxnmvq_f32(m);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let o = out.as_mut_ptr().add(34 * b);
        std::ptr::copy_nonoverlapping(half::f16::from_f32(d).to_bits().to_le_bytes().as_ptr(), o, 2);
        let q: [int32x4_t; 8] = v.map(|v| vcvtaq_s32_f32(vmulq_n_f32(v, id)));
        let h = |i: usize| vcombine_s16(vqmovn_s32(q[2 * i]), vqmovn_s32(q[2 * i + 1]));
        let lo = vcombine_s8(vqmovn_s16(h(0)), vqmovn_s16(h(1)));
        let hi = vcombine_s8(vqmovn_s16(h(2)), vqmovn_s16(h(3)));
        vst1q_s8(o.add(2) as *mut i8, lo);
        vst1q_s8(o.add(18) as *mut i8, hi);
        // The sum of the stored (saturated) quants, as the portable code adds them.
        *s = vaddlvq_s8(lo) as i32 + vaddlvq_s8(hi) as i32;
    }
}

/// `out += Σ a[r] · row r` over the rows of one ×8 group whose bit is set
/// in `mask`, ascending `r`: each block's rows gathered by a 4 × 4
/// transpose per four word runs, then, row after row, the fused
/// multiply-adds of [`axpy_rows`] (the bits of `portable::axpy_x8`).
#[inline(always)]
unsafe fn axpy_x8_rows<B: X8Block>(group: &[u8], a: [f32; 8], mask: u8, out: &mut [f32]) {
    let nb = out.len() / 32;
    assert!(out.len().is_multiple_of(32) && group.len() >= nb * B::BYTES);
    for b in 0..nb {
        let p = group.as_ptr().add(b * B::BYTES);
        let o = out.as_mut_ptr().add(32 * b);
        let mut acc = load_block(o);
        for (r, &row) in B::rows(p).iter().enumerate() {
            if mask & (1 << r) != 0 {
                fma_row(&mut acc, a[r] * f16_at(p.add(2 * r)), row);
            }
        }
        store_block(o, &acc);
    }
}

/// `out += Σ a[r] · row r` over the rows of one Q4_0×8 group set in `mask`
/// (`out.len()` columns, a multiple of 32), NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn axpy_x8_q4_0(group: &[u8], a: [f32; 8], mask: u8, out: &mut [f32]) {
    axpy_x8_rows::<Q4X8>(group, a, mask, out)
}

/// `out += Σ a[r] · row r` over the rows of one Q8_0×8 group set in `mask`, NEON.
///
/// # Safety
/// As [`axpy_x8_q4_0`].
pub unsafe fn axpy_x8_q8_0(group: &[u8], a: [f32; 8], mask: u8, out: &mut [f32]) {
    axpy_x8_rows::<Q8X8>(group, a, mask, out)
}

/// `q · 2^24`: a Q8_0 byte moved to the top byte of a 32-bit lane with
/// zeros below reads as that; [`q8_x8_top`] makes such lanes, and the
/// callers take the factor out of the block scale (exact: a power of two).
const Q8_TOP_BYTE: f32 = 16_777_216.0;

/// Element `J` (0..4) of each of 4 rows from a 16-byte run of a Q8_0×8
/// group (row `r`'s elements `4k .. 4k + 4` at bytes `4r ..`), as
/// `q · 2^24` in f32 lane `r`: the byte moved to the top of its lane by
/// one `tbl` (out-of-range indices give zeros) and converted. As the x86
/// kernel does with `pshufb`: no widening chain, no transpose.
#[inline(always)]
unsafe fn q8_x8_top<const J: u8>(run: int8x16_t) -> float32x4_t {
    let idx: [u8; 16] = std::array::from_fn(|b| if b % 4 == 3 { (b - 3) as u8 + J } else { 0xFF });
    let t = vqtbl1q_s8(run, vld1q_u8(idx.as_ptr()));
    vcvtq_f32_s32(vreinterpretq_s32_s8(t))
}

/// A ×8 block type's per-block f32 sums for [`gemm_x8_f32`].
trait F32Block: X8Block {
    /// What each sum is times the portable one (a power of two, taken out
    /// of the block scale: exact).
    const SUM_SCALE: f32;
    /// `s[t][h] += q · x` over the block at `p` for rows `4h .. 4h+4` and
    /// `T` tokens (`x[t]`: the block's 32 activations), by fused
    /// multiply-adds in the element order of `portable::gemm_x8_f32`.
    ///
    /// # Safety
    /// `BYTES` bytes must be readable at `p` and 32 f32 at each `x[t]`.
    unsafe fn f32_sums<const T: usize>(p: *const u8, x: [*const f32; T], s: &mut [[float32x4_t; 2]; T]);
}

impl F32Block for Q8X8 {
    const SUM_SCALE: f32 = Q8_TOP_BYTE;
    /// Elements in order 0..32, each `q · 2^24` ([`q8_x8_top`]).
    #[inline(always)]
    unsafe fn f32_sums<const T: usize>(p: *const u8, x: [*const f32; T], s: &mut [[float32x4_t; 2]; T]) {
        for k in 0..8 {
            // Run k: elements 4k .. 4k + 4 of rows 0-3 (16 bytes), then of rows 4-7.
            let run = [vld1q_s8(p.add(16 + 32 * k) as *const i8), vld1q_s8(p.add(32 + 32 * k) as *const i8)];
            let xv: [float32x4_t; T] = std::array::from_fn(|t| vld1q_f32(x[t].add(4 * k)));
            for (half, &run) in run.iter().enumerate() {
                let q = [q8_x8_top::<0>(run), q8_x8_top::<1>(run), q8_x8_top::<2>(run), q8_x8_top::<3>(run)];
                for (st, &xt) in s.iter_mut().zip(&xv) {
                    let mut v = st[half];
                    v = vfmaq_laneq_f32::<0>(v, q[0], xt);
                    v = vfmaq_laneq_f32::<1>(v, q[1], xt);
                    v = vfmaq_laneq_f32::<2>(v, q[2], xt);
                    v = vfmaq_laneq_f32::<3>(v, q[3], xt);
                    st[half] = v;
                }
            }
        }
    }
}

impl F32Block for Q4X8 {
    const SUM_SCALE: f32 = 1.0;
    /// Elements in the order 0, 16, 1, 17, …, 15, 31 ([`q4_x8_values`]).
    #[inline(always)]
    unsafe fn f32_sums<const T: usize>(p: *const u8, x: [*const f32; T], s: &mut [[float32x4_t; 2]; T]) {
        for k in 0..4 {
            // Run k: bytes 4k .. 4k + 4 of rows 0-3 (16 bytes), then of rows 4-7.
            let xv: [[float32x4_t; 2]; T] =
                std::array::from_fn(|t| [vld1q_f32(x[t].add(4 * k)), vld1q_f32(x[t].add(16 + 4 * k))]);
            for half in 0..2 {
                let q = q4_x8_values(vld1q_u8(p.add(16 + 32 * k + 16 * half)));
                for (st, &[xl, xh]) in s.iter_mut().zip(&xv) {
                    let mut v = st[half];
                    v = vfmaq_laneq_f32::<0>(v, q[0].0, xl);
                    v = vfmaq_laneq_f32::<0>(v, q[0].1, xh);
                    v = vfmaq_laneq_f32::<1>(v, q[1].0, xl);
                    v = vfmaq_laneq_f32::<1>(v, q[1].1, xh);
                    v = vfmaq_laneq_f32::<2>(v, q[2].0, xl);
                    v = vfmaq_laneq_f32::<2>(v, q[2].1, xh);
                    v = vfmaq_laneq_f32::<3>(v, q[3].0, xl);
                    v = vfmaq_laneq_f32::<3>(v, q[3].1, xh);
                    st[half] = v;
                }
            }
        }
    }
}

/// The 8 rows of one ×8 group (`cols` elements each) dotted with `T` f32
/// vectors `xs`: `out[t][r]`, the bits of `portable::gemm_x8_f32_*` (per
/// block `s = Σ q · x` by fused multiply-adds, [`F32Block::f32_sums`], then
/// `acc = d · s + acc`; Q8_0's sums are `2^24 ×` the portable ones and its
/// `d` is `2^-24 ×`, exact scalings, so the products and sums round alike
/// unless a product is subnormal or a sum overflows). Short prefills with
/// exact activations.
#[inline(always)]
unsafe fn gemm_x8_f32<B: F32Block, const T: usize>(cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; 8]; T] {
    let nb = cols / 32;
    assert!(group.len() >= nb * B::BYTES && xs.iter().all(|x| x.len() >= nb * 32));
    let unit = vdupq_n_f32(1.0 / B::SUM_SCALE);
    let mut acc = [[vdupq_n_f32(0.0); 2]; T];
    for b in 0..nb {
        let p = group.as_ptr().add(b * B::BYTES);
        let h = vld1q_u16(p as *const u16);
        let d = [f16x4_to_f32(vget_low_u16(h)), f16x4_to_f32(vget_high_u16(h))];
        let d = if B::SUM_SCALE == 1.0 { d } else { d.map(|d| vmulq_f32(d, unit)) };
        let mut s = [[vdupq_n_f32(0.0); 2]; T];
        B::f32_sums(p, xs.map(|x| x.as_ptr().add(32 * b)), &mut s);
        for (a, s) in acc.iter_mut().zip(s) {
            a[0] = vfmaq_f32(a[0], d[0], s[0]);
            a[1] = vfmaq_f32(a[1], d[1], s[1]);
        }
    }
    store8(acc)
}

/// [`gemm_x8_f32`] for a Q8_0×8 group, NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn gemm_x8_f32_q8_0<const T: usize>(cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; 8]; T] {
    gemm_x8_f32::<Q8X8, T>(cols, group, xs)
}

/// [`gemm_x8_f32`] for a Q4_0×8 group, NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn gemm_x8_f32_q4_0<const T: usize>(cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; 8]; T] {
    gemm_x8_f32::<Q4X8, T>(cols, group, xs)
}

/// One Q8_0×8 group into a weight panel: `out[k · stride + r] = d · q`
/// for row `r < 8` and element `k < cols` (the bits of
/// `portable::dequant_x8_panel_q8_0`: `(d · 2^-24) · (q · 2^24)` is the
/// same product), one `tbl` per 4 values and no transpose.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn dequant_x8_panel_q8_0(group: &[u8], cols: usize, out: &mut [f32], stride: usize) {
    super::check_x8_panel(group.len(), Q8_0_X8_BLOCK, cols, out.len(), stride);
    let unit = vdupq_n_f32(1.0 / Q8_TOP_BYTE);
    let o = out.as_mut_ptr();
    for b in 0..cols / 32 {
        let p = group.as_ptr().add(b * Q8_0_X8_BLOCK);
        let h = vld1q_u16(p as *const u16);
        let d = [vmulq_f32(f16x4_to_f32(vget_low_u16(h)), unit), vmulq_f32(f16x4_to_f32(vget_high_u16(h)), unit)];
        for k in 0..8 {
            for (half, &dh) in d.iter().enumerate() {
                let run = vld1q_s8(p.add(16 + 32 * k + 16 * half) as *const i8);
                let q = [q8_x8_top::<0>(run), q8_x8_top::<1>(run), q8_x8_top::<2>(run), q8_x8_top::<3>(run)];
                for (j, q) in q.into_iter().enumerate() {
                    vst1q_f32(o.add((32 * b + 4 * k + j) * stride + 4 * half), vmulq_f32(dh, q));
                }
            }
        }
    }
}

/// Elements `c0 .. c0 + 16` of the 8 rows of one ×8 group into 8 panel
/// rows (`out[r · stride + c]` = `d · q`, the bits of
/// `portable::dequant_x8_rows_panel_*`): the down projection's panels of
/// long prefills.
#[inline(always)]
unsafe fn x8_rows_panel<B: X8Block>(group: &[u8], cols: usize, c0: usize, out: &mut [f32], stride: usize) {
    super::check_x8_rows_panel(group.len(), B::BYTES, cols, c0, out.len(), stride);
    let p = group.as_ptr().add(c0 / 32 * B::BYTES);
    let h = vld1q_u16(p as *const u16);
    let mut d = [0f32; 8];
    vst1q_f32(d.as_mut_ptr(), f16x4_to_f32(vget_low_u16(h)));
    vst1q_f32(d.as_mut_ptr().add(4), f16x4_to_f32(vget_high_u16(h)));
    let o = out.as_mut_ptr();
    for (r, (lo, hi)) in B::rows(p).into_iter().enumerate() {
        let v = if c0.is_multiple_of(32) { lo } else { hi };
        for (k, q) in to_f32(v).into_iter().enumerate() {
            vst1q_f32(o.add(r * stride + 4 * k), vmulq_n_f32(q, d[r]));
        }
    }
}

/// [`x8_rows_panel`] for a Q4_0×8 group, NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn dequant_x8_rows_panel_q4_0(group: &[u8], cols: usize, c0: usize, out: &mut [f32], stride: usize) {
    x8_rows_panel::<Q4X8>(group, cols, c0, out, stride)
}

/// [`x8_rows_panel`] for a Q8_0×8 group, NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn dequant_x8_rows_panel_q8_0(group: &[u8], cols: usize, c0: usize, out: &mut [f32], stride: usize) {
    x8_rows_panel::<Q8X8>(group, cols, c0, out, stride)
}

/// One f32 GEMM tile, `T` tokens × 16 panel columns, in the order of
/// `portable::panel_tile` (one fused multiply-add per term, `i`
/// ascending): four 4-lane accumulators per token, each weight row loaded
/// once for all `T` tokens. The prefill of Q8_0, f16 and f32 weights.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn panel_tile<const T: usize>(
    depth: usize,
    x: &[f32],
    xs: usize,
    w: &[f32],
    ws: usize,
) -> [[f32; super::PANEL]; T] {
    super::check_panel_tile(T, depth, x.len(), xs, w.len(), ws);
    let mut acc = [[vdupq_n_f32(0.0); 4]; T];
    for i in 0..depth {
        let wp = w.as_ptr().add(i * ws);
        let wv = [vld1q_f32(wp), vld1q_f32(wp.add(4)), vld1q_f32(wp.add(8)), vld1q_f32(wp.add(12))];
        for (t, a) in acc.iter_mut().enumerate() {
            let xv = *x.as_ptr().add(t * xs + i);
            for (a, &wj) in a.iter_mut().zip(&wv) {
                *a = vfmaq_n_f32(*a, wj, xv);
            }
        }
    }
    let mut out = [[0f32; super::PANEL]; T];
    for (o, a) in out.iter_mut().zip(acc) {
        for (j, v) in a.into_iter().enumerate() {
            vst1q_f32(o.as_mut_ptr().add(4 * j), v);
        }
    }
    out
}

/// A KV-cache element type, loaded four at a time as f32 (f16 by `fcvtl`,
/// exact as `Into<f32>`).
pub trait KvLoad: Copy + Into<f32> {
    /// Elements `p[0..4]` as f32.
    ///
    /// # Safety
    /// Four elements must be readable at `p`.
    unsafe fn load4(p: *const Self) -> float32x4_t;
}

impl KvLoad for f32 {
    #[inline(always)]
    unsafe fn load4(p: *const f32) -> float32x4_t {
        vld1q_f32(p)
    }
}

impl KvLoad for half::f16 {
    #[inline(always)]
    unsafe fn load4(p: *const half::f16) -> float32x4_t {
        f16x4_to_f32(vld1_u16(p as *const u16))
    }
}

/// `q · k` over f32 `q` and a cached key of `T`, in the order of
/// `portable::dot_kv`: element `i` fused-multiply-added into lane `i mod
/// 8` (two 4-lane accumulators), then `portable::sum8`.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn dot_kv<T: KvLoad>(q: &[f32], k: &[T]) -> f32 {
    assert_eq!(q.len(), k.len());
    let n8 = q.len() / 8 * 8;
    let (mut l0, mut l1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for i in (0..n8).step_by(8) {
        l0 = vfmaq_f32(l0, vld1q_f32(q.as_ptr().add(i)), T::load4(k.as_ptr().add(i)));
        l1 = vfmaq_f32(l1, vld1q_f32(q.as_ptr().add(i + 4)), T::load4(k.as_ptr().add(i + 4)));
    }
    let mut l = [0f32; 8];
    vst1q_f32(l.as_mut_ptr(), l0);
    vst1q_f32(l.as_mut_ptr().add(4), l1);
    for i in n8..q.len() {
        l[i % 8] = q[i].mul_add(k[i].into(), l[i % 8]);
    }
    super::portable::sum8(l)
}

/// `out += a · v` over a cached value row of `T`, one fused multiply-add
/// per element (the bits of `portable::axpy_kv`).
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn axpy_kv<T: KvLoad>(a: f32, v: &[T], out: &mut [f32]) {
    assert_eq!(v.len(), out.len());
    let n4 = v.len() / 4 * 4;
    let o = out.as_mut_ptr();
    for i in (0..n4).step_by(4) {
        vst1q_f32(o.add(i), vfmaq_n_f32(vld1q_f32(o.add(i)), T::load4(v.as_ptr().add(i)), a));
    }
    for i in n4..v.len() {
        out[i] = a.mul_add(v[i].into(), out[i]);
    }
}

/// `q · k` of 8 lanes folded as `portable::sum8` does: lanes `i` and `i +
/// 4` added (`l0 + l1`), then `(a0 + a2) + (a1 + a3)`.
#[inline(always)]
unsafe fn sum8(l0: float32x4_t, l1: float32x4_t) -> f32 {
    let a = vaddq_f32(l0, l1);
    let b = vadd_f32(vget_low_f32(a), vget_high_f32(a));
    vget_lane_f32::<0>(b) + vget_lane_f32::<1>(b)
}

/// Attention scores of `N` query heads `q` (`[N, hd]`) over `n` cached
/// positions, into `out` (`[N, n]`): `out[h][j] = scale · (q_h ·
/// k[(start + j) · stride + off ..][..hd])`, `P` positions at a time, each
/// key loaded (and converted from f16) once for the `N` heads; every score
/// in the order of [`dot_kv`] (lane `i mod 8` in two 4-lane accumulators,
/// then the `sum8` tree).
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // `u` and `h` index registers and rows at once
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
    while j < n {
        // `P` positions, then the tail one at a time.
        let m = if j + P <= n { P } else { 1 };
        let mut acc = [[[vdupq_n_f32(0.0); 2]; N]; P];
        let r: [*const T; P] = std::array::from_fn(|u| row(j + u.min(m - 1)));
        for c in (0..hd).step_by(8) {
            let kv: [[float32x4_t; 2]; P] = std::array::from_fn(|u| [T::load4(r[u].add(c)), T::load4(r[u].add(c + 4))]);
            for h in 0..N {
                let qv = [vld1q_f32(qp.add(h * hd + c)), vld1q_f32(qp.add(h * hd + c + 4))];
                for u in 0..P {
                    acc[u][h][0] = vfmaq_f32(acc[u][h][0], qv[0], kv[u][0]);
                    acc[u][h][1] = vfmaq_f32(acc[u][h][1], qv[1], kv[u][1]);
                }
            }
        }
        for u in 0..m {
            for h in 0..N {
                out[h * n + j + u] = sum8(acc[u][h][0], acc[u][h][1]) * scale;
            }
        }
        j += m;
    }
}

/// Attention scores of the query heads `q` (`[nq, hd]`, the heads sharing
/// one KV head) over `n` cached positions into `out` (`[nq, n]`), up to
/// four heads per pass over the keys (see [`scores_n`]).
///
/// # Safety
/// None beyond aarch64; `hd` must be a multiple of 8 and the rows inside
/// `k` (asserted).
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
/// multiply-add per position, positions in order (as [`axpy_kv`]
/// repeated), `W` 4-lane registers of each head's output held at a time
/// and each value row loaded (and converted) once for the `N` heads.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `h` and `u` index registers and rows at once
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
    for c0 in (0..hd).step_by(4 * W) {
        let w = (hd - c0).min(4 * W) / 4;
        let mut acc = [[vdupq_n_f32(0.0); W]; N];
        for h in 0..N {
            for u in 0..w {
                acc[h][u] = vld1q_f32(o.add(h * hd + c0 + 4 * u));
            }
        }
        for j in 0..n {
            let r = v.as_ptr().add((start + j) * stride + off + c0);
            let mut x = [vdupq_n_f32(0.0); W];
            for u in 0..w {
                x[u] = T::load4(r.add(4 * u));
            }
            for h in 0..N {
                let s = p[h * n + j];
                for u in 0..w {
                    acc[h][u] = vfmaq_n_f32(acc[h][u], x[u], s);
                }
            }
        }
        for h in 0..N {
            for u in 0..w {
                vst1q_f32(o.add(h * hd + c0 + 4 * u), acc[h][u]);
            }
        }
    }
}

/// `out_h += Σ_j p_h[j] · v_j` for the query heads sharing one KV head
/// (`p`: `[nq, n]` probabilities, `out`: `[nq, hd]`), up to four heads per
/// pass over the values (see [`values_n`]).
///
/// # Safety
/// None beyond aarch64; `hd` must be a multiple of 8 and the rows inside
/// `v` (asserted).
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
            2 => values_n::<T, 2, 8>(ps, v, stride, off, start, os),
            3 => values_n::<T, 3, 6>(ps, v, stride, off, start, os),
            _ => values_n::<T, 4, 4>(ps, v, stride, off, start, os),
        }
        h += m;
    }
}

/// [`super::portable::exp`] on 2 f64 lanes, operation for operation: the
/// clamp by compare-and-select (a NaN lane stays NaN, as the portable
/// comparisons keep it), `frintn` (ties to even), two fused steps for `r`,
/// Taylor's polynomial by fused multiply-adds, and `2^n` from its bits
/// (`fcvtzs` gives 0 for NaN, as the portable code does).
#[inline(always)]
unsafe fn exp2_pd(x: float64x2_t) -> float64x2_t {
    use super::portable::{EXP_RANGE, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2E};
    let (lo, hi) = (vdupq_n_f64(EXP_RANGE.0), vdupq_n_f64(EXP_RANGE.1));
    let x = vbslq_f64(vcgtq_f64(lo, x), lo, x);
    let x = vbslq_f64(vcltq_f64(hi, x), hi, x);
    let n = vrndnq_f64(vmulq_n_f64(x, LOG2E));
    let r = vfmsq_f64(x, n, vdupq_n_f64(LN2_HI));
    let r = vfmsq_f64(r, n, vdupq_n_f64(LN2_LO));
    let mut p = vdupq_n_f64(EXP_TAYLOR[0]);
    for c in &EXP_TAYLOR[1..] {
        p = vfmaq_f64(vdupq_n_f64(*c), p, r);
    }
    let e = vshlq_n_s64::<52>(vaddq_s64(vcvtq_s64_f64(n), vdupq_n_s64(1023)));
    vmulq_f64(p, vreinterpretq_f64_s64(e))
}

/// `x[i] = e^{x[i]}`, the bits of `portable::exp` lane by lane (softmax,
/// SiLU), four f32 at a time through two f64 pairs.
///
/// # Safety
/// None beyond aarch64.
pub unsafe fn exp_slice(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(4);
    for c in &mut chunks {
        let v = vld1q_f32(c.as_ptr());
        let lo = exp2_pd(vcvt_f64_f32(vget_low_f32(v)));
        let hi = exp2_pd(vcvt_high_f64_f32(v));
        vst1q_f32(c.as_mut_ptr(), vcvt_high_f32_f64(vcvt_f32_f64(lo), hi));
    }
    chunks.into_remainder().iter_mut().for_each(|v| *v = super::portable::exp(*v));
}

/// `d · q` of one 32-value block (`lo`: elements 0..16, `hi`: 16..32) into
/// the 32 f32 at `o`: one f32 product per element, the bits of every other
/// dequantization.
///
/// # Safety
/// 32 elements must be writable at `o`.
#[inline(always)]
unsafe fn store_scaled(o: *mut f32, d: f32, (lo, hi): (int8x16_t, int8x16_t)) {
    for (j, v) in to_f32(lo).into_iter().chain(to_f32(hi)).enumerate() {
        vst1q_f32(o.add(4 * j), vmulq_n_f32(v, d));
    }
}

/// Dequantizes row-layout blocks of `B` into `out` (`[blocks · 32]`).
#[inline(always)]
unsafe fn dequant<B: RowBlock>(row: &[u8], out: &mut [f32]) {
    let nb = out.len() / 32;
    assert!(out.len().is_multiple_of(32) && row.len() >= nb * B::BYTES);
    for b in 0..nb {
        let p = row.as_ptr().add(b * B::BYTES);
        store_scaled(out.as_mut_ptr().add(32 * b), f16_at(p), B::values(p.add(2)));
    }
}

/// Q4_0 blocks → f32 (`out.len()` elements, a multiple of 32), NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn dequant_q4_0(row: &[u8], out: &mut [f32]) {
    dequant::<Q4Row>(row, out)
}

/// Q8_0 blocks → f32 (`out.len()` elements, a multiple of 32), NEON.
///
/// # Safety
/// As [`dequant_q4_0`].
pub unsafe fn dequant_q8_0(row: &[u8], out: &mut [f32]) {
    dequant::<Q8Row>(row, out)
}

/// Dequantizes one ×8 group (`cols` elements per row) into its 8 rows
/// `out` (`[8, cols]`), element = `d · q` as in [`dequant`].
#[inline(always)]
unsafe fn dequant_x8<B: X8Block>(group: &[u8], cols: usize, out: &mut [f32]) {
    let nb = cols / 32;
    assert!(cols.is_multiple_of(32) && out.len() >= 8 * cols && group.len() >= nb * B::BYTES);
    for b in 0..nb {
        let p = group.as_ptr().add(b * B::BYTES);
        for (r, row) in B::rows(p).into_iter().enumerate() {
            store_scaled(out.as_mut_ptr().add(r * cols + 32 * b), f16_at(p.add(2 * r)), row);
        }
    }
}

/// One Q4_0×8 group → its 8 rows in f32 (`out`: `[8, cols]`), NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn dequant_x8_q4_0(group: &[u8], cols: usize, out: &mut [f32]) {
    dequant_x8::<Q4X8>(group, cols, out)
}

/// One Q8_0×8 group → its 8 rows in f32 (`out`: `[8, cols]`), NEON.
///
/// # Safety
/// As [`dequant_x8_q4_0`].
pub unsafe fn dequant_x8_q8_0(group: &[u8], cols: usize, out: &mut [f32]) {
    dequant_x8::<Q8X8>(group, cols, out)
}

/// `outs[t] += Σ_r a[t][r] · row r` over the 8 rows of one ×8 group for
/// each token: per column block the rows are unpacked to f32 once (`w`,
/// `[8][32]`) for all the tokens, then each token's 32 outputs take, row
/// after row, `s = a · d` and one fused multiply-add per element (the bits
/// of [`axpy_x8_rows`] with every row set). Short prefills' down projection.
#[inline(always)]
unsafe fn axpy_x8_tokens_blocks<B: X8Block>(group: &[u8], a: &[[f32; 8]], masks: &[u8], outs: &mut [&mut [f32]]) {
    let cols = outs.first().map_or(0, |o| o.len());
    let nb = cols / 32;
    assert!(cols.is_multiple_of(32) && group.len() >= nb * B::BYTES && a.len() == outs.len());
    assert_eq!(masks.len(), a.len(), "×8 token axpy: masks");
    assert!(outs.iter().all(|o| o.len() == cols), "×8 token axpy: output rows of different lengths");
    let mut w = [[vdupq_n_f32(0.0); 8]; 8];
    for b in 0..nb {
        let p = group.as_ptr().add(b * B::BYTES);
        let mut d = [0f32; 8];
        for (r, (row, dr)) in B::rows(p).into_iter().zip(d.iter_mut()).enumerate() {
            let (fl, fh) = (to_f32(row.0), to_f32(row.1));
            w[r] = [fl[0], fl[1], fl[2], fl[3], fh[0], fh[1], fh[2], fh[3]];
            *dr = f16_at(p.add(2 * r));
        }
        for ((at, &mask), out) in a.iter().zip(masks).zip(outs.iter_mut()) {
            let o = out.as_mut_ptr().add(32 * b);
            let mut acc = load_block(o);
            for r in (0..8).filter(|r| mask & (1 << r) != 0) {
                let s = at[r] * d[r];
                for (acc, &wv) in acc.iter_mut().zip(&w[r]) {
                    *acc = vfmaq_n_f32(*acc, wv, s);
                }
            }
            store_block(o, &acc);
        }
    }
}

/// [`axpy_x8_tokens_blocks`] for Q4_0×8 groups, NEON.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn axpy_x8_tokens_q4_0(group: &[u8], a: &[[f32; 8]], masks: &[u8], outs: &mut [&mut [f32]]) {
    axpy_x8_tokens_blocks::<Q4X8>(group, a, masks, outs)
}

/// [`axpy_x8_tokens_blocks`] for Q8_0×8 groups, NEON.
///
/// # Safety
/// As [`axpy_x8_tokens_q4_0`].
pub unsafe fn axpy_x8_tokens_q8_0(group: &[u8], a: &[[f32; 8]], masks: &[u8], outs: &mut [&mut [f32]]) {
    axpy_x8_tokens_blocks::<Q8X8>(group, a, masks, outs)
}

/// Elements `4k + j` and `16 + 4k + j` (quant byte `4k + j`'s low and
/// high nibble), `j = 0..4`, of 4 rows from one 16-byte run `k` of a
/// Q4_0×8 block, as `q − 8` in f32 lane `r` (row): the run is XORed with
/// `0x88` once, so each nibble reads as the signed 4-bit `q − 8`; each is
/// shifted to the top of its 32-bit lane and arithmetically back down, then
/// converted (exact). Two shifts per 4 values, no widening chain, no
/// transpose, as the x86 kernel's shifts and masks.
#[inline(always)]
unsafe fn q4_x8_values(run: uint8x16_t) -> [(float32x4_t, float32x4_t); 4] {
    let w = vreinterpretq_s32_u8(veorq_u8(run, vdupq_n_u8(0x88)));
    let f = |v: int32x4_t| vcvtq_f32_s32(vshrq_n_s32::<28>(v));
    [
        (f(vshlq_n_s32::<28>(w)), f(vshlq_n_s32::<24>(w))),
        (f(vshlq_n_s32::<20>(w)), f(vshlq_n_s32::<16>(w))),
        (f(vshlq_n_s32::<12>(w)), f(vshlq_n_s32::<8>(w))),
        (f(vshlq_n_s32::<4>(w)), f(w)),
    ]
}

/// One Q4_0×8 group into a weight panel: `out[k · stride + r] = d · q`
/// for row `r < 8` and element `k < cols` (the bits of
/// `portable::dequant_x8_panel_q4_0`), by [`q4_x8_values`]: two shifts per
/// 4 values and no transpose.
///
/// # Safety
/// None beyond aarch64; lengths are asserted.
pub unsafe fn dequant_x8_panel_q4_0(group: &[u8], cols: usize, out: &mut [f32], stride: usize) {
    super::check_x8_panel(group.len(), Q4_0_X8_BLOCK, cols, out.len(), stride);
    let o = out.as_mut_ptr();
    for b in 0..cols / 32 {
        let p = group.as_ptr().add(b * Q4_0_X8_BLOCK);
        let h = vld1q_u16(p as *const u16);
        let d = [f16x4_to_f32(vget_low_u16(h)), f16x4_to_f32(vget_high_u16(h))];
        for k in 0..4 {
            for (half, &dh) in d.iter().enumerate() {
                let q = q4_x8_values(vld1q_u8(p.add(16 + 32 * k + 16 * half)));
                for (j, (lo, hi)) in q.into_iter().enumerate() {
                    let i = 32 * b + 4 * k + j;
                    vst1q_f32(o.add(i * stride + 4 * half), vmulq_f32(dh, lo));
                    vst1q_f32(o.add((i + 16) * stride + 4 * half), vmulq_f32(dh, hi));
                }
            }
        }
    }
}
