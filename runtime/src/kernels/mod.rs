//! All quantized and SIMD arithmetic of nflash, behind one portable API.
//!
//! - [`portable`]: plain Rust, the reference every other kernel is tested
//!   against (bit for bit where the arithmetic allows, which it does for
//!   every kernel here) and what runs on CPUs without a faster one;
//! - [`x86`] (x86-64): AVX2 + FMA + F16C kernels;
//! - [`aarch64`]: NEON kernels, with `sdot` where the CPU has dotprod;
//! - [`matrix`]: [`QMatrix`], a typed view of packed weights, the parallel
//!   matrix-vector products over it and the quantized GEMM of prefill;
//! - [`gemm`]: f32 matrix products of batches (prefill of Q8_0/f16/f32
//!   weights and the FFN down projection) over weight panels, by
//!   [`panel_tile`].
//!
//! The functions in this file pick a kernel at run time from the CPU's
//! features (`is_x86_feature_detected!`, `is_aarch64_feature_detected!`,
//! cached by std), as candle's
//! `k_quants` and llama.cpp's `ggml-cpu/arch/` do. Row layouts are GGML's
//! (formats/SPEC.md §5) or the in-memory ×8 groups (§5.1); candle-core's
//! `BlockQ8_0` / `BlockQ4_0` quantize activations and weights (GGML's
//! rounding) and serve the f32/f16 dots and the portable dequantization.

#[cfg(target_arch = "aarch64")]
pub mod aarch64;
pub mod gemm;
pub mod matrix;
pub mod portable;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ8_0, GgmlType};
use half::f16;
use nflash_format::DType;

pub use matrix::{matvec_many, matvec_many_from, par_chunk, QMatrix};

/// The environment variable that forces the portable kernels:
/// `NFLASH_KERNELS=portable` runs every kernel from [`portable`] (no SIMD
/// kernel is dispatched, and matrices stay in the row layout);
/// `NFLASH_KERNELS=avx2` keeps x86-64 to the AVX2 kernels (no AVX-512
/// VNNI); unset or `auto` dispatches by the CPU's features. Read once per process. Results
/// are the same bits either way (`kernels/tests.rs`, and the tests'
/// `kernel_paths` module runs whole models both ways); the switch exists to
/// check that on whatever CPU the tests run on, and to rule the SIMD
/// kernels out when chasing a wrong result.
pub const KERNELS_ENV: &str = "NFLASH_KERNELS";

/// [`KERNELS_ENV`]'s value, trimmed and lowercased (`""` when unset), read once.
#[inline]
fn kernels_env() -> &'static str {
    static VALUE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VALUE.get_or_init(|| std::env::var(KERNELS_ENV).map(|v| v.trim().to_ascii_lowercase()).unwrap_or_default())
}

/// Whether [`KERNELS_ENV`] asks for the portable kernels.
#[inline]
fn portable_forced() -> bool {
    kernels_env() == "portable"
}

/// Whether the AVX2 kernels can run on this CPU (checked once, then cached
/// by std) and are not turned off by [`KERNELS_ENV`].
#[inline]
fn has_avx2() -> bool {
    if portable_forced() {
        return false;
    }
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

/// Whether the AVX-512 VNNI forms of the ×8 GEMM (`x86::gemm_x8_*_vnni`)
/// can run: [`has_avx2`] and AVX-512VL with AVX-512 VNNI (Intel since Ice
/// Lake and Cascade Lake, AMD since Zen 4), unless [`KERNELS_ENV`] is
/// `avx2`. They give the AVX2 kernels' bits.
#[inline]
fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        kernels_env() != "avx2"
            && has_avx2()
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this aarch64 CPU has NEON (Advanced SIMD: every aarch64 CPU
/// that runs Linux or Android) and the NEON kernels are not turned off by
/// [`KERNELS_ENV`]. Always false elsewhere.
#[inline]
fn has_neon() -> bool {
    if portable_forced() {
        return false;
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("neon")
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        false
    }
}

/// Whether this aarch64 CPU has the dotprod extension (`sdot`; checked
/// once, then cached by std). Always false elsewhere.
#[inline]
fn has_dotprod() -> bool {
    if portable_forced() {
        return false;
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("dotprod")
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        false
    }
}

/// Whether this aarch64 CPU has dotprod and the i8mm extension (`smmla`;
/// ARMv8.6, checked once, then cached by std). Always false elsewhere.
#[inline]
fn has_i8mm() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        has_dotprod() && std::arch::is_aarch64_feature_detected!("i8mm")
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        false
    }
}

/// The name of the kernel set [`dot4`], [`gemm_x8`] and [`axpy`] use on
/// this CPU: `"avx2"` (x86-64), `"i8mm"` (aarch64 with dotprod and i8mm:
/// the dotprod kernels and the `smmla` prefill GEMM of
/// [`gemm_x8_tokens`]), `"dotprod"` or `"neon"` (aarch64), or `"portable"`
/// (for `nflash probe` and `--stats`).
pub fn isa() -> &'static str {
    if has_vnni() {
        "avx512vnni"
    } else if has_avx2() {
        "avx2"
    } else if has_neon() {
        if has_i8mm() {
            "i8mm"
        } else if has_dotprod() {
            "dotprod"
        } else {
            "neon"
        }
    } else {
        "portable"
    }
}

/// The bytes of Q8_0 blocks (34 each: f16 scale, 32 × i8).
fn q8_bytes(y: &[BlockQ8_0]) -> &[u8] {
    // SAFETY: BlockQ8_0 is repr(C), 34 bytes with no padding (asserted by candle-core).
    unsafe { std::slice::from_raw_parts(y.as_ptr() as *const u8, std::mem::size_of_val(y)) }
}

/// The bytes of Q8_0 blocks, writable: any bytes are a valid block (an f16
/// and 32 × i8).
fn q8_bytes_mut(y: &mut [BlockQ8_0]) -> &mut [u8] {
    // SAFETY: as `q8_bytes`; every bit pattern is a valid BlockQ8_0.
    unsafe { std::slice::from_raw_parts_mut(y.as_mut_ptr() as *mut u8, std::mem::size_of_val(y)) }
}

/// Quantizes `x` (`[32 · nb]`) into `nb` Q8_0 blocks `out` (34 bytes each)
/// and their sums of quants `sums` (`[nb]`), with the bits of GGML's
/// reference rounding (`portable::quantize_q8_0`) on every path.
///
/// Panics if the lengths disagree (a caller bug).
pub fn quantize_q8_0(x: &[f32], out: &mut [u8], sums: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths asserted inside.
        return unsafe { x86::quantize_q8_0(x, out, sums) };
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked above; lengths asserted inside.
        return unsafe { aarch64::quantize_q8_0(x, out, sums) };
    }
    portable::quantize_q8_0(x, out, sums)
}

/// Each Q8_0 block's sum of quants.
#[cfg(test)]
fn block_sums(blocks: &[BlockQ8_0]) -> impl Iterator<Item = i32> + '_ {
    q8_bytes(blocks).chunks_exact(34).map(|b| b[2..].iter().map(|&q| q as i8 as i32).sum())
}

/// A vector quantized to Q8_0, the right-hand side of Q4_0 and Q8_0 dots:
/// `[n / 32]` blocks (candle-core's `BlockQ8_0`, GGML's rounding) and each
/// block's sum of quants (for the Q4_0 kernels' `8·Σy` offset).
#[derive(Clone, Default)]
pub struct Q8Vec {
    blocks: Vec<BlockQ8_0>,
    sums: Vec<i32>,
}

impl Q8Vec {
    /// Quantizes `x` (`[n]`, n a multiple of 32), reusing the buffers.
    pub fn set(&mut self, x: &[f32]) {
        let nb = x.len() / 32;
        self.blocks.resize(nb, BlockQ8_0::zeros());
        self.sums.resize(nb, 0);
        quantize_q8_0(&x[..nb * 32], q8_bytes_mut(&mut self.blocks), &mut self.sums);
    }

    /// `x` quantized (`[n]`, n a multiple of 32).
    pub fn from_slice(x: &[f32]) -> Self {
        let mut v = Self::default();
        v.set(x);
        v
    }

    /// A vector from its blocks (tests build extreme activations this way).
    #[cfg(test)]
    pub(crate) fn from_blocks(blocks: Vec<BlockQ8_0>) -> Self {
        let sums = block_sums(&blocks).collect();
        Q8Vec { blocks, sums }
    }

    /// The blocks `[n / 32]`.
    pub fn blocks(&self) -> &[BlockQ8_0] {
        &self.blocks
    }

    /// The blocks as bytes (34 per block).
    fn bytes(&self) -> &[u8] {
        q8_bytes(&self.blocks)
    }
}

/// Dots of four rows of `dtype` (Q4_0 or Q8_0; `cols` elements each) with a
/// Q8_0 vector `y` (`cols / 32` blocks). Four rows per pass share the
/// activation loads, which is what decode (one token, many rows) needs.
/// Each row gives the bits of [`dot`] (the order of `portable.rs`).
///
/// Panics on another dtype or on rows shorter than `cols` (caller bugs).
#[inline]
pub fn dot4(dtype: DType, cols: usize, rows: [&[u8]; 4], y: &Q8Vec) -> [f32; 4] {
    let yb = y.bytes();
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; row and vector lengths
        // are checked inside against `cols`.
        return unsafe {
            match dtype {
                DType::Q4_0 => x86::dot4_q4_0(cols, rows, yb, &y.sums),
                DType::Q8_0 => x86::dot4_q8_0(cols, rows, yb),
                _ => unreachable!("dot4 on {dtype}"),
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON and dotprod are checked; lengths are checked inside
        // against `cols`.
        return unsafe {
            match (dtype, has_dotprod()) {
                (DType::Q4_0, true) => aarch64::dot4_q4_0_dot(cols, rows, yb),
                (DType::Q8_0, true) => aarch64::dot4_q8_0_dot(cols, rows, yb),
                (DType::Q4_0, false) => aarch64::dot4_q4_0(cols, rows, yb),
                (DType::Q8_0, false) => aarch64::dot4_q8_0(cols, rows, yb),
                _ => unreachable!("dot4 on {dtype}"),
            }
        };
    }
    match dtype {
        DType::Q4_0 => portable::dot4_q4_0(cols, rows, yb),
        DType::Q8_0 => portable::dot4_q8_0(cols, rows, yb),
        _ => unreachable!("dot4 on {dtype}"),
    }
}

/// Dot of one Q4_0 or Q8_0 row (`cols` elements) with a Q8_0 vector `y`.
///
/// Panics on another dtype or on a row shorter than `cols` (caller bugs).
#[inline]
pub fn dot(dtype: DType, cols: usize, row: &[u8], y: &Q8Vec) -> f32 {
    let yb = y.bytes();
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: features checked above; lengths checked inside.
        return unsafe {
            match dtype {
                DType::Q4_0 => x86::dot_q4_0(cols, row, yb, &y.sums),
                DType::Q8_0 => x86::dot_q8_0(cols, row, yb),
                _ => unreachable!("dot on {dtype}"),
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: as in `dot4`.
        return unsafe {
            match (dtype, has_dotprod()) {
                (DType::Q4_0, true) => aarch64::dot_q4_0_dot(cols, row, yb),
                (DType::Q8_0, true) => aarch64::dot_q8_0_dot(cols, row, yb),
                (DType::Q4_0, false) => aarch64::dot_q4_0(cols, row, yb),
                (DType::Q8_0, false) => aarch64::dot_q8_0(cols, row, yb),
                _ => unreachable!("dot on {dtype}"),
            }
        };
    }
    match dtype {
        DType::Q4_0 => portable::dot_q4_0(cols, row, yb),
        DType::Q8_0 => portable::dot_q8_0(cols, row, yb),
        _ => unreachable!("dot on {dtype}"),
    }
}

/// Whether [`gemm_x8`] has a fast kernel on this CPU (x86-64 with AVX2,
/// FMA and F16C; aarch64 with dotprod, whose indexed `sdot` takes a word
/// run of 4 rows at a time): only then are Q4_0 and Q8_0 matrices worth
/// reordering to the ×8 layout (elsewhere the row layout keeps four-row
/// kernels). Either layout gives the same bits.
pub fn x8_available() -> bool {
    has_avx2() || (has_neon() && has_dotprod())
}

/// Whether prefill multiplies weights of `dtype` by the quantized GEMM
/// (activations quantized to Q8_0, [`gemm_x8`]) rather than by f32 matmuls
/// over dequantized tiles (exact activations, [`gemm`]). Only Q4_0: for
/// Q8_0 weights the activations' Q8_0 rounding is as large as the weights'
/// own, and on SmolLM2-135M it raised WikiText-2 perplexity by 0.5% (27.69
/// → 27.83, 4 088 tokens; Q4_0: 33.69 → 33.72) and turned the demo's
/// greedy answer into French (llama.cpp, which quantizes activations the
/// same way, gives the same French answer). Decode quantizes activations for
/// both, as before.
pub fn quantized_prefill(dtype: DType) -> bool {
    dtype == DType::Q4_0
}

/// The 8 rows of one ×8 group of `dtype` (Q4_0 or Q8_0, `cols` elements per
/// row, `nflash_format::interleave`) dotted with `T` (1 to 4) Q8_0 vectors:
/// `out[t][r]`. Row `r` gets the bits [`dot`] gives it in the row layout.
/// Decode calls it with one token, prefill with four at a time.
///
/// Panics on another dtype or short slices (caller bugs).
#[inline]
pub fn gemm_x8<const T: usize>(dtype: DType, cols: usize, group: &[u8], ys: [&Q8Vec; T]) -> [[f32; 8]; T] {
    let yb = ys.map(|y| y.bytes());
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        // SAFETY: AVX2/FMA/F16C/AVX-512VL/VNNI presence checked above; lengths checked inside.
        return unsafe {
            match dtype {
                DType::Q4_0 => x86::gemm_x8_q4_0_vnni(cols, group, yb, ys.map(|y| &y.sums[..])),
                DType::Q8_0 => x86::gemm_x8_q8_0_vnni(cols, group, yb),
                _ => unreachable!("gemm_x8 on {dtype}"),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths checked inside.
        return unsafe {
            match dtype {
                DType::Q4_0 => x86::gemm_x8_q4_0(cols, group, yb, ys.map(|y| &y.sums[..])),
                DType::Q8_0 => x86::gemm_x8_q8_0(cols, group, yb),
                _ => unreachable!("gemm_x8 on {dtype}"),
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() && has_dotprod() {
        // SAFETY: dotprod presence checked above; lengths checked inside.
        return unsafe {
            match dtype {
                DType::Q4_0 => aarch64::gemm_x8_q4_0_dot(cols, group, yb, ys.map(|y| &y.sums[..])),
                DType::Q8_0 => aarch64::gemm_x8_q8_0_dot(cols, group, yb),
                _ => unreachable!("gemm_x8 on {dtype}"),
            }
        };
    }
    match dtype {
        DType::Q4_0 => portable::gemm_x8_q4_0(cols, group, yb),
        DType::Q8_0 => portable::gemm_x8_q8_0(cols, group, yb),
        _ => unreachable!("gemm_x8 on {dtype}"),
    }
}

/// A prefill batch of activations quantized to Q8_0, as prefill's quantized
/// GEMM ([`gemm_x8_tokens`]) takes it: the vectors (`[cols / 32]` blocks
/// each) and, on CPUs with i8mm, their token pairs rewritten once for
/// `smmla` (`aarch64::mm_pair`; 144 bytes per pair and 32 columns), used by
/// every group of every matrix the batch multiplies.
pub struct Q8Batch<'a> {
    ys: &'a [&'a Q8Vec],
    /// Pairs `(2p, 2p + 1)`, `pair_bytes` each (empty without i8mm).
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    pairs: Vec<u8>,
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    pair_bytes: usize,
    /// Per 4 tokens, `aarch64::half_quad` (`aux_bytes` each; CPUs with
    /// dotprod and no i8mm, the whole eights of batches of at least 8
    /// tokens; empty otherwise).
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    aux: Vec<u8>,
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    aux_bytes: usize,
}

impl<'a> Q8Batch<'a> {
    /// The batch of `ys` (all of one length).
    ///
    /// Panics if the vectors differ in length (a caller bug).
    pub fn new(ys: &'a [&'a Q8Vec]) -> Self {
        let nb = ys.first().map_or(0, |y| y.blocks.len());
        assert!(ys.iter().all(|y| y.blocks.len() == nb), "Q8Batch of vectors of different lengths");
        #[allow(unused_mut)] // written on aarch64 only
        let mut batch = Q8Batch { ys, pairs: Vec::new(), pair_bytes: 0, aux: Vec::new(), aux_bytes: 0 };
        #[cfg(target_arch = "aarch64")]
        if ys.len() >= 2 && has_i8mm() {
            batch.pair_bytes = nb * aarch64::MM_PAIR_BLOCK;
            batch.pairs = vec![0u8; ys.len() / 2 * batch.pair_bytes];
            for (p, out) in batch.pairs.chunks_exact_mut(batch.pair_bytes).enumerate() {
                // SAFETY: NEON is part of the aarch64 baseline; lengths checked inside.
                let (a, b) = (ys[2 * p], ys[2 * p + 1]);
                unsafe { aarch64::mm_pair(32 * nb, (a.bytes(), &a.sums), (b.bytes(), &b.sums), out) };
            }
        } else if ys.len() >= 8 && has_dotprod() {
            batch.aux_bytes = nb * aarch64::HALF_QUAD;
            batch.aux = vec![0u8; ys.len() / 8 * 2 * batch.aux_bytes];
            for (q, out) in batch.aux.chunks_exact_mut(batch.aux_bytes).enumerate() {
                aarch64::half_quad(std::array::from_fn(|j| (ys[4 * q + j].bytes(), &ys[4 * q + j].sums[..])), out);
            }
        }
        batch
    }

    /// Tokens.
    pub fn len(&self) -> usize {
        self.ys.len()
    }

    /// Whether the batch has no tokens.
    pub fn is_empty(&self) -> bool {
        self.ys.is_empty()
    }
}

#[cfg(target_arch = "aarch64")]
thread_local! {
    /// The ×8 group [`gemm_x8_tokens`] last rewrote for `smmla`
    /// (`aarch64::mm_prepare`; `cols / 32 · 320` bytes, one per thread).
    static MM_GROUP: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One ×8 group of `dtype` (Q4_0 or Q8_0, `cols` elements per row) dotted
/// with every token of `batch`: `put(t0, out)` receives `out[t][r]` for
/// tokens `t0 ..`, in order, each token the bits [`gemm_x8`] gives it.
/// Prefill's quantized GEMM: [`gemm_x8`] four tokens per call (a tail of
/// 1 to 3); on aarch64 CPUs with dotprod and no i8mm, batches of 8 or more
/// first go 8 tokens per call through `aarch64::gemm_x8_half_*` (rows 0–3,
/// then 4–7); on CPUs with i8mm the group is first rewritten once into the
/// order `smmla` takes (`aarch64::mm_prepare`, 2.2× the Q4_0 group's
/// bytes in a per-thread buffer) and the batch's prepared pairs go two per
/// `aarch64::gemm_x8_q4_0_mm` (or `_q8_0_`) call, an odd last token through [`gemm_x8`].
///
/// Panics on another dtype or short slices (caller bugs).
pub fn gemm_x8_tokens(dtype: DType, cols: usize, group: &[u8], batch: &Q8Batch, put: impl FnMut(usize, &[[f32; 8]])) {
    let ys = batch.ys;
    #[cfg(target_arch = "aarch64")]
    let mut put = put;
    #[cfg(target_arch = "aarch64")]
    if !batch.pairs.is_empty() {
        assert!(matches!(dtype, DType::Q4_0 | DType::Q8_0), "gemm_x8_tokens on {dtype}");
        assert_eq!(batch.pair_bytes, cols / 32 * aarch64::MM_PAIR_BLOCK, "a batch of another width");
        let q4 = dtype == DType::Q4_0;
        MM_GROUP.with_borrow_mut(|prep| {
            // SAFETY (each call): i8mm presence was checked when the pairs
            // were made; lengths are checked inside.
            unsafe { aarch64::mm_prepare(q4, cols, group, prep) };
            let mut pairs = batch.pairs.chunks_exact(batch.pair_bytes);
            let mut t0 = 0;
            while let Some(a) = pairs.next() {
                if let Some(b) = pairs.next() {
                    let [x, y] = unsafe { gemm_x8_mm(q4, cols, prep, [a, b]) };
                    put(t0, &[x[0], x[1], y[0], y[1]]);
                    t0 += 4;
                } else {
                    let [x] = unsafe { gemm_x8_mm(q4, cols, prep, [a]) };
                    put(t0, &x);
                    t0 += 2;
                }
            }
            if t0 < ys.len() {
                put(t0, &gemm_x8(dtype, cols, group, [ys[t0]]));
            }
        });
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if !batch.aux.is_empty() {
        // Eight tokens per call, rows 0–3 then 4–7 (`aarch64::gemm_x8_half_*`);
        // a tail of 1 to 7 tokens by the quads below.
        let mut t0 = 0;
        while ys.len() - t0 >= 8 {
            let q: [&[u8]; 2] =
                std::array::from_fn(|i| &batch.aux[(t0 / 4 + i) * batch.aux_bytes..][..batch.aux_bytes]);
            let half = |h: usize| {
                // SAFETY: dotprod presence was checked when the aux data
                // was made; lengths are checked inside.
                unsafe {
                    match dtype {
                        DType::Q4_0 => aarch64::gemm_x8_half_q4_0_dot(cols, group, h, q),
                        DType::Q8_0 => aarch64::gemm_x8_half_q8_0_dot(cols, group, h, q),
                        _ => unreachable!("gemm_x8_tokens on {dtype}"),
                    }
                }
            };
            let (lo, hi) = (half(0), half(1));
            let out: [[f32; 8]; 8] =
                std::array::from_fn(|t| std::array::from_fn(|r| if r < 4 { lo[t][r] } else { hi[t][r - 4] }));
            put(t0, &out);
            t0 += 8;
        }
        gemm_x8_quads(dtype, cols, group, &ys[t0..], |t, d| put(t0 + t, d));
        return;
    }
    gemm_x8_quads(dtype, cols, group, ys, put);
}

/// `aarch64::gemm_x8_q4_0_mm` (`q4`) or `gemm_x8_q8_0_mm`: a group prepared
/// by `aarch64::mm_prepare` against `P` prepared token pairs.
///
/// # Safety
/// The CPU must have i8mm.
#[cfg(target_arch = "aarch64")]
unsafe fn gemm_x8_mm<const P: usize>(q4: bool, cols: usize, prep: &[u8], pairs: [&[u8]; P]) -> [[[f32; 8]; 2]; P] {
    // SAFETY: the caller's contract; lengths are checked inside.
    unsafe {
        if q4 {
            aarch64::gemm_x8_q4_0_mm(cols, prep, pairs)
        } else {
            aarch64::gemm_x8_q8_0_mm(cols, prep, pairs)
        }
    }
}

/// [`gemm_x8`] over `ys`, four tokens per call and a tail of 1 to 3:
/// `put(t0, out)` as [`gemm_x8_tokens`] (a verify pass's FFN calls it
/// with the tokens that select in one group).
pub(crate) fn gemm_x8_quads(
    dtype: DType,
    cols: usize,
    group: &[u8],
    ys: &[&Q8Vec],
    mut put: impl FnMut(usize, &[[f32; 8]]),
) {
    let mut quads = ys.chunks_exact(4);
    let mut t0 = 0;
    for q in &mut quads {
        put(t0, &gemm_x8(dtype, cols, group, [q[0], q[1], q[2], q[3]]));
        t0 += 4;
    }
    match *quads.remainder() {
        [] => {}
        [a] => put(t0, &gemm_x8(dtype, cols, group, [a])),
        [a, b] => put(t0, &gemm_x8(dtype, cols, group, [a, b])),
        [a, b, c] => put(t0, &gemm_x8(dtype, cols, group, [a, b, c])),
        _ => unreachable!("a remainder of chunks_exact(4)"),
    }
}

/// The 8 rows of one ×8 group of `dtype` (Q4_0 or Q8_0, `cols` elements per
/// row) dotted with `T` (1 to 8) f32 vectors `xs` (`[cols]` each):
/// `out[t][r]`, in the order of `portable::gemm_x8_f32` (per block an f32
/// sum of `q · x`, then one fused multiply-add by the row's scale). Prefill
/// with exact activations (Q8_0 packs, [`quantized_prefill`]) for short
/// prompts, where dequantizing every weight to memory costs more than the
/// products.
///
/// Panics on another dtype or short slices (caller bugs).
#[inline]
pub fn gemm_x8_f32<const T: usize>(dtype: DType, cols: usize, group: &[u8], xs: [&[f32]; T]) -> [[f32; 8]; T] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths checked inside.
        return unsafe {
            match dtype {
                DType::Q4_0 => x86::gemm_x8_f32_q4_0(cols, group, xs),
                DType::Q8_0 => x86::gemm_x8_f32_q8_0(cols, group, xs),
                _ => unreachable!("gemm_x8_f32 on {dtype}"),
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths asserted inside.
        return unsafe {
            match dtype {
                DType::Q4_0 => aarch64::gemm_x8_f32_q4_0(cols, group, xs),
                DType::Q8_0 => aarch64::gemm_x8_f32_q8_0(cols, group, xs),
                _ => unreachable!("gemm_x8_f32 on {dtype}"),
            }
        };
    }
    match dtype {
        DType::Q4_0 => portable::gemm_x8_f32_q4_0(cols, group, xs),
        DType::Q8_0 => portable::gemm_x8_f32_q8_0(cols, group, xs),
        _ => unreachable!("gemm_x8_f32 on {dtype}"),
    }
}

/// Output columns of one f32 GEMM tile ([`panel_tile`]): two AVX2 registers.
pub const PANEL: usize = 16;

/// Tokens of the largest f32 GEMM tile: 2 × 6 accumulators, two weight
/// registers and a broadcast fill 15 of AVX2's 16 registers.
pub const PANEL_TOKENS: usize = 6;

/// Asserts that `T` rows of `x` (`xs` apart, `depth` used each) and `depth`
/// panel rows of `w` (`ws` apart, [`PANEL`] used each) lie inside their slices.
fn check_panel_tile(t: usize, depth: usize, x_len: usize, xs: usize, w_len: usize, ws: usize) {
    assert!(t >= 1 && ws >= PANEL, "panel tile: {t} tokens, weight stride {ws}");
    if depth > 0 {
        assert!(xs >= depth && x_len >= (t - 1) * xs + depth, "panel tile: x has {x_len} elements");
        assert!(w_len >= (depth - 1) * ws + PANEL, "panel tile: w has {w_len} elements");
    }
}

/// One tile of an f32 matrix product: `out[t][j] = Σ_i x[t · xs + i] ·
/// w[i · ws + j]` for `T` (1 to [`PANEL_TOKENS`]) tokens, rows of `x`
/// (`[T, depth]` with row stride `xs`), and the [`PANEL`] columns of a
/// weight panel (`w`: `[depth, PANEL]` with row stride `ws`), in the order
/// of `portable::panel_tile` (bit for bit in every ISA). The prefill of
/// Q8_0, f16 and f32 weights (exact activations), through [`gemm`].
///
/// Panics if a slice is too short for the shape (a caller bug).
#[inline]
pub fn panel_tile<const T: usize>(depth: usize, x: &[f32], xs: usize, w: &[f32], ws: usize) -> [[f32; PANEL]; T] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths asserted inside.
        return unsafe { x86::panel_tile::<T>(depth, x, xs, w, ws) };
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths asserted inside.
        return unsafe { aarch64::panel_tile::<T>(depth, x, xs, w, ws) };
    }
    portable::panel_tile::<T>(depth, x, xs, w, ws)
}

/// Hints the CPU to bring `bytes` into cache (one prefetch per 64-byte
/// line; x86 `prefetcht0`, aarch64 `prfm pldl1keep`; nothing elsewhere).
/// A hint only: no effect on results, no fault on any address. For a
/// stream the hardware prefetcher does not follow, such as the next ×8
/// group's column range in a down projection split among threads (each
/// reads a piece of every group, pieces a group apart).
#[inline]
pub fn prefetch(bytes: &[u8]) {
    for line in bytes.chunks(64) {
        let _p = line.as_ptr();
        // SAFETY: a prefetch hint for an address inside the slice (SSE is in
        // the x86-64 baseline, `prfm` in ARMv8.0); neither ever faults.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(_p as *const i8)
        };
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        unsafe {
            aarch64::prefetch(_p)
        };
    }
}

/// `e^x` in f32: [`portable::exp`] (computed in f64 and rounded once: the
/// correctly rounded value but within about 1e-5 of a tie, as glibc's
/// `expf`; NaN for NaN). One formula on every path, scalar here and 8 lanes
/// at a time in [`exp_slice`], so the SiLU of a neuron and a softmax give
/// the same bits in decode and prefill.
#[inline]
pub fn exp(x: f32) -> f32 {
    portable::exp(x)
}

/// `x[i] = e^{x[i]}` with the bits of [`exp`] for each element.
pub fn exp_slice(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above.
        return unsafe { x86::exp_slice(x) };
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked.
        return unsafe { aarch64::exp_slice(x) };
    }
    portable::exp_slice(x)
}

/// Attention score `q · k` for a query and one cached key, both `[head_dim]`,
/// the key in the KV cache's type (`portable::dot_kv` gives the order).
#[inline]
pub fn dot_kv(q: &[f32], k: KvSlice) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths asserted inside.
        return unsafe {
            match k {
                KvSlice::F16(k) => x86::dot_kv(q, k),
                KvSlice::F32(k) => x86::dot_kv(q, k),
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths asserted inside.
        return unsafe {
            match k {
                KvSlice::F16(k) => aarch64::dot_kv(q, k),
                KvSlice::F32(k) => aarch64::dot_kv(q, k),
            }
        };
    }
    match k {
        KvSlice::F16(k) => portable::dot_kv(q, k),
        KvSlice::F32(k) => portable::dot_kv(q, k),
    }
}

/// `out += a · v` for one cached value row `v` (`[head_dim]`, the KV cache's
/// type) into `out` (`[head_dim]`).
#[inline]
pub fn axpy_kv(a: f32, v: KvSlice, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths asserted inside.
        unsafe {
            match v {
                KvSlice::F16(v) => x86::axpy_kv(a, v, out),
                KvSlice::F32(v) => x86::axpy_kv(a, v, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths asserted inside.
        unsafe {
            match v {
                KvSlice::F16(v) => aarch64::axpy_kv(a, v, out),
                KvSlice::F32(v) => aarch64::axpy_kv(a, v, out),
            }
        }
        return;
    }
    match v {
        KvSlice::F16(v) => portable::axpy_kv(a, v, out),
        KvSlice::F32(v) => portable::axpy_kv(a, v, out),
    }
}

/// Attention scores of the query heads `q` (`[nq, head_dim]`: the heads
/// that share one KV head under GQA) over cached keys, into `out` (`[nq,
/// n]`): `out[h][j] = scale · (q_h · k_j)` for positions `start .. start +
/// n`, where key `j` is `k[j · stride + off ..][..head_dim]` (`stride`: the
/// cache's row, `n_kv_heads · head_dim`; `off`: the KV head's offset). Each
/// key is read once for all `nq` heads; each score has the bits of
/// [`dot_kv`] times `scale`.
///
/// Panics if a row lies outside `k` or the shapes disagree (caller bugs).
#[allow(clippy::too_many_arguments)]
pub fn attn_scores(
    q: &[f32],
    head_dim: usize,
    k: KvSlice,
    stride: usize,
    off: usize,
    start: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(head_dim > 0 && q.len().is_multiple_of(head_dim) && out.len().is_multiple_of(q.len() / head_dim));
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && head_dim.is_multiple_of(8) {
        // SAFETY: AVX2/FMA/F16C presence and the head size checked above; rows asserted inside.
        unsafe {
            match k {
                KvSlice::F16(k) => x86::attn_scores(q, head_dim, k, stride, off, start, scale, out),
                KvSlice::F32(k) => x86::attn_scores(q, head_dim, k, stride, off, start, scale, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() && head_dim.is_multiple_of(8) {
        // SAFETY: NEON and the head size checked above; rows asserted inside.
        unsafe {
            match k {
                KvSlice::F16(k) => aarch64::attn_scores(q, head_dim, k, stride, off, start, scale, out),
                KvSlice::F32(k) => aarch64::attn_scores(q, head_dim, k, stride, off, start, scale, out),
            }
        }
        return;
    }
    let n = out.len() / (q.len() / head_dim);
    for (qh, oh) in q.chunks_exact(head_dim).zip(out.chunks_exact_mut(n.max(1))) {
        for (j, o) in oh.iter_mut().enumerate() {
            *o = dot_kv(qh, k.range((start + j) * stride + off, head_dim)) * scale;
        }
    }
}

/// `out_h += Σ_j p_h[j] · v_j` for the query heads sharing one KV head
/// (`p`: `[nq, n]`, `out`: `[nq, head_dim]`) over cached values `v_j =
/// v[(start + j) · stride + off ..][..head_dim]`, positions in order: the
/// bits of [`axpy_kv`] applied for each head and position; each value row
/// is read once for all `nq` heads.
///
/// Panics if a row lies outside `v` or the shapes disagree (caller bugs).
pub fn attn_values(p: &[f32], head_dim: usize, v: KvSlice, stride: usize, off: usize, start: usize, out: &mut [f32]) {
    assert!(head_dim > 0 && out.len().is_multiple_of(head_dim) && p.len().is_multiple_of(out.len() / head_dim));
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && head_dim.is_multiple_of(8) {
        // SAFETY: AVX2/FMA/F16C presence and the head size checked above; rows asserted inside.
        unsafe {
            match v {
                KvSlice::F16(v) => x86::attn_values(p, head_dim, v, stride, off, start, out),
                KvSlice::F32(v) => x86::attn_values(p, head_dim, v, stride, off, start, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() && head_dim.is_multiple_of(8) {
        // SAFETY: NEON and the head size checked above; rows asserted inside.
        unsafe {
            match v {
                KvSlice::F16(v) => aarch64::attn_values(p, head_dim, v, stride, off, start, out),
                KvSlice::F32(v) => aarch64::attn_values(p, head_dim, v, stride, off, start, out),
            }
        }
        return;
    }
    let n = p.len() / (out.len() / head_dim);
    for (ph, oh) in p.chunks_exact(n.max(1)).zip(out.chunks_exact_mut(head_dim)) {
        for (j, &pj) in ph.iter().enumerate() {
            axpy_kv(pj, v.range((start + j) * stride + off, head_dim), oh);
        }
    }
}

/// A slice of KV-cache elements in either type.
#[derive(Clone, Copy)]
pub enum KvSlice<'a> {
    /// f16 elements (the default KV cache).
    F16(&'a [f16]),
    /// f32 elements (`--kv f32`).
    F32(&'a [f32]),
}

impl<'a> KvSlice<'a> {
    /// Elements `start .. start + len`.
    #[inline]
    pub fn range(self, start: usize, len: usize) -> KvSlice<'a> {
        match self {
            KvSlice::F16(c) => KvSlice::F16(&c[start..start + len]),
            KvSlice::F32(c) => KvSlice::F32(&c[start..start + len]),
        }
    }
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
                DType::Q4_0 => x86::axpy_q4_0(rows, a, out),
                DType::Q8_0 => x86::axpy_q8_0(rows, a, out),
                _ => unreachable!("axpy on {dtype}"),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths checked inside.
        unsafe {
            match dtype {
                DType::Q4_0 => aarch64::axpy_q4_0(rows, a, out),
                DType::Q8_0 => aarch64::axpy_q8_0(rows, a, out),
                _ => unreachable!("axpy on {dtype}"),
            }
        }
        return;
    }
    for (r, a) in rows.into_iter().zip(a) {
        match dtype {
            DType::Q4_0 => portable::axpy_q4_0(r, a, out),
            DType::Q8_0 => portable::axpy_q8_0(r, a, out),
            _ => unreachable!("axpy on {dtype}"),
        }
    }
}

/// `out += Σ a[r] · row r` over the rows `r` of one ×8 group of `dtype`
/// (Q4_0 or Q8_0, `out.len()` columns, `nflash_format::interleave`) whose
/// bit is set in `mask`, in ascending `r`: the bits of [`axpy`] applied to
/// each of those rows in turn, with one pass over `out`. The sparse FFN's
/// down projection over 8 neurons of a ×8 bundle group.
///
/// Panics on another dtype or a short group (caller bugs).
#[inline]
pub fn axpy_x8(dtype: DType, group: &[u8], a: [f32; 8], mask: u8, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: features checked above; lengths checked inside.
        unsafe {
            match dtype {
                DType::Q4_0 => x86::axpy_x8_q4_0(group, a, mask, out),
                DType::Q8_0 => x86::axpy_x8_q8_0(group, a, mask, out),
                _ => unreachable!("axpy_x8 on {dtype}"),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths checked inside.
        unsafe {
            match dtype {
                DType::Q4_0 => aarch64::axpy_x8_q4_0(group, a, mask, out),
                DType::Q8_0 => aarch64::axpy_x8_q8_0(group, a, mask, out),
                _ => unreachable!("axpy_x8 on {dtype}"),
            }
        }
        return;
    }
    match dtype {
        DType::Q4_0 => portable::axpy_x8_q4_0(group, a, mask, out),
        DType::Q8_0 => portable::axpy_x8_q8_0(group, a, mask, out),
        _ => unreachable!("axpy_x8 on {dtype}"),
    }
}

/// `outs[t] += Σ_r a[t][r] · row r` over the rows `r` of one ×8 group of
/// `dtype` (Q4_0 or Q8_0) set in `masks[t]`, for the tokens of `a`: each
/// `outs[t]` is `[cols]`, the group's first `cols / 32` column blocks (so a
/// caller can split the columns among threads). Each token gets the bits
/// of [`axpy_x8`] with its mask; the tokens share each block's unpacked
/// weights. The down projection of a short prefill (every row set) without
/// dequantizing the matrix, and of a verify pass (each token its neurons).
///
/// Panics on another dtype or on slices too short for the shape (caller bugs).
pub fn axpy_x8_tokens(dtype: DType, group: &[u8], a: &[[f32; 8]], masks: &[u8], outs: &mut [&mut [f32]]) {
    assert_eq!(a.len(), outs.len(), "×8 token axpy: tokens");
    assert_eq!(a.len(), masks.len(), "×8 token axpy: masks");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: features checked above; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => x86::axpy_x8_tokens_q4_0(group, a, masks, outs),
                DType::Q8_0 => x86::axpy_x8_tokens_q8_0(group, a, masks, outs),
                _ => unreachable!("axpy_x8_tokens on {dtype}"),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => aarch64::axpy_x8_tokens_q4_0(group, a, masks, outs),
                DType::Q8_0 => aarch64::axpy_x8_tokens_q8_0(group, a, masks, outs),
                _ => unreachable!("axpy_x8_tokens on {dtype}"),
            }
        }
        return;
    }
    for ((at, &m), o) in a.iter().zip(masks).zip(outs.iter_mut()) {
        axpy_x8(dtype, group, *at, m, o);
    }
}

/// Reinterprets `bytes` as a slice of `T`.
///
/// Panics if `bytes` is misaligned for `T` or not a whole number of `T`s;
/// pack offsets are aligned by construction (SPEC §3–4), so this is a bug.
pub(crate) fn cast<T>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) && bytes.len().is_multiple_of(size),
        "misaligned weight view"
    );
    // SAFETY: alignment and length were checked above; T is one of f32, f16,
    // BlockQ8_0, BlockQ4_0, all plain-old-data `repr(C)` types for which every
    // bit pattern is valid, and the borrow keeps the bytes alive.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) }
}

/// A vector prepared as the right-hand side of a dot with rows of one dtype:
/// f32 rows dot f32, f16 rows dot f16, Q8_0/Q4_0 rows dot Q8_0 blocks.
pub enum DotInput {
    /// For f32 rows: the values `[n]`.
    F32(Vec<f32>),
    /// For f16 rows: the values rounded to f16 `[n]`.
    F16(Vec<f16>),
    /// For Q4_0 and Q8_0 rows: Q8_0 blocks `[n / 32]` and their sums.
    Q8(Q8Vec),
}

impl DotInput {
    /// An empty input for rows of `dtype`, to be filled by [`Self::set`].
    pub fn new(dtype: DType) -> Self {
        match dtype {
            DType::F32 => DotInput::F32(Vec::new()),
            DType::F16 => DotInput::F16(Vec::new()),
            DType::Q8_0 | DType::Q4_0 => DotInput::Q8(Q8Vec::default()),
        }
    }

    /// Prepares `x` (`[n]`, n a multiple of 32 for quantized rows), reusing the buffer.
    pub fn set(&mut self, x: &[f32]) {
        match self {
            DotInput::F32(v) => {
                v.clear();
                v.extend_from_slice(x);
            }
            DotInput::F16(v) => {
                v.clear();
                v.extend(x.iter().map(|&a| f16::from_f32(a)));
            }
            DotInput::Q8(v) => v.set(x),
        }
    }

    /// Each row of `x` (`[n, cols]`) prepared for rows of `dtype`: `[n]` inputs.
    pub fn rows(dtype: DType, x: &[f32], cols: usize) -> Vec<Self> {
        use rayon::prelude::*;
        x.par_chunks_exact(cols).map(|r| Self::from_slice(dtype, r)).collect()
    }

    /// Convenience: a new input for `dtype` holding `x`.
    pub fn from_slice(dtype: DType, x: &[f32]) -> Self {
        let mut d = Self::new(dtype);
        d.set(x);
        d
    }
}

/// Dot of one packed row (`cols` elements of `dtype`) with a prepared input.
#[inline]
pub fn row_dot(dtype: DType, cols: usize, row: &[u8], x: &DotInput) -> f32 {
    match (dtype, x) {
        (DType::F32, DotInput::F32(v)) => f32::vec_dot(cols, cast::<f32>(row), v),
        (DType::F16, DotInput::F16(v)) => f16::vec_dot(cols, cast::<f16>(row), v),
        (DType::Q8_0 | DType::Q4_0, DotInput::Q8(v)) => dot(dtype, cols, row, v),
        _ => panic!("dot input prepared for another dtype than {dtype}"),
    }
}

/// Dequantizes one packed row into `out` (`[cols]`; element = `d · q`, the
/// same bits on every path).
pub fn row_to_f32(dtype: DType, row: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && dtype.is_quantized() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => x86::dequant_q4_0(row, out),
                _ => x86::dequant_q8_0(row, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() && dtype.is_quantized() {
        // SAFETY: NEON checked; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => aarch64::dequant_q4_0(row, out),
                _ => aarch64::dequant_q8_0(row, out),
            }
        }
        return;
    }
    match dtype {
        DType::F32 => out.copy_from_slice(cast::<f32>(row)),
        DType::F16 => f16::to_float(cast::<f16>(row), out),
        DType::Q8_0 => BlockQ8_0::to_float(cast::<BlockQ8_0>(row), out),
        DType::Q4_0 => BlockQ4_0::to_float(cast::<BlockQ4_0>(row), out),
    }
}

/// Dequantizes one ×8 group of `dtype` (Q4_0 or Q8_0, `cols` elements per
/// row, `nflash_format::interleave`) into its 8 rows `out` (`[8, cols]`),
/// the bits [`row_to_f32`] gives each row in the row layout.
///
/// Panics on another dtype or short slices (caller bugs).
pub fn group_to_f32(dtype: DType, cols: usize, group: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => x86::dequant_x8_q4_0(group, cols, out),
                DType::Q8_0 => x86::dequant_x8_q8_0(group, cols, out),
                _ => unreachable!("group_to_f32 on {dtype}"),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => aarch64::dequant_x8_q4_0(group, cols, out),
                DType::Q8_0 => aarch64::dequant_x8_q8_0(group, cols, out),
                _ => unreachable!("group_to_f32 on {dtype}"),
            }
        }
        return;
    }
    match dtype {
        DType::Q4_0 => portable::dequant_x8_q4_0(group, cols, out),
        DType::Q8_0 => portable::dequant_x8_q8_0(group, cols, out),
        _ => unreachable!("group_to_f32 on {dtype}"),
    }
}

/// Elements `c0 .. c0 + PANEL` (`c0` a multiple of [`PANEL`]) of the 8 rows
/// of one ×8 group of `dtype` (Q4_0 or Q8_0, `cols` elements per row) into 8
/// rows of a weight panel: `out[r · stride + c]` = element `c0 + c` of row
/// `r` (`d · q`, the bits of [`group_to_f32`]). The down projection's
/// panels, whose rows are neurons (`[neurons, PANEL]` of hidden columns),
/// straight from the ×8 groups: no `[neurons, hidden]` f32 copy.
///
/// Panics on another dtype or short slices (caller bugs).
pub fn group_rows_to_panel(dtype: DType, cols: usize, group: &[u8], c0: usize, out: &mut [f32], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => x86::dequant_x8_rows_panel_q4_0(group, cols, c0, out, stride),
                DType::Q8_0 => x86::dequant_x8_rows_panel_q8_0(group, cols, c0, out, stride),
                _ => unreachable!("group_rows_to_panel on {dtype}"),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => aarch64::dequant_x8_rows_panel_q4_0(group, cols, c0, out, stride),
                DType::Q8_0 => aarch64::dequant_x8_rows_panel_q8_0(group, cols, c0, out, stride),
                _ => unreachable!("group_rows_to_panel on {dtype}"),
            }
        }
        return;
    }
    match dtype {
        DType::Q4_0 => portable::dequant_x8_rows_panel_q4_0(group, cols, c0, out, stride),
        DType::Q8_0 => portable::dequant_x8_rows_panel_q8_0(group, cols, c0, out, stride),
        _ => unreachable!("group_rows_to_panel on {dtype}"),
    }
}

/// Asserts that a ×8 group of `cols` elements per row (`gblock` bytes per
/// block) holds the column block of `c0 .. c0 + PANEL`, and that 8 panel
/// rows of [`PANEL`] elements, `stride` apart, fit in `out_len`.
fn check_x8_rows_panel(group_len: usize, gblock: usize, cols: usize, c0: usize, out_len: usize, stride: usize) {
    assert!(cols.is_multiple_of(32) && group_len >= cols / 32 * gblock, "×8 rows panel: group of {group_len} bytes");
    assert!(c0.is_multiple_of(PANEL) && c0 + PANEL <= cols, "×8 rows panel: columns {c0}.. of {cols}");
    let rows = nflash_format::interleave::X8_ROWS;
    assert!(stride >= PANEL && out_len >= (rows - 1) * stride + PANEL, "×8 rows panel: out");
}

/// Asserts that a ×8 group of `cols` elements per row (`gblock` bytes per
/// column block) and its panel (`out[k · stride + r]`, `k < cols`, `r < 8`)
/// lie inside their slices.
fn check_x8_panel(group_len: usize, gblock: usize, cols: usize, out_len: usize, stride: usize) {
    assert!(cols.is_multiple_of(32) && group_len >= cols / 32 * gblock, "×8 panel: group of {group_len} bytes");
    let rows = nflash_format::interleave::X8_ROWS;
    assert!(stride >= rows && (cols == 0 || out_len >= (cols - 1) * stride + rows), "×8 panel: out");
}

/// Dequantizes one ×8 group of `dtype` (Q4_0 or Q8_0, `cols` elements per
/// row) into 8 columns of a weight panel: `out[k · stride + r]` = element
/// `k` of row `r` (`d · q`, the bits of [`group_to_f32`]). Two groups side
/// by side make a [`PANEL`] of [`panel_tile`] (`stride` = [`PANEL`]), so
/// the prefill of a ×8 matrix needs no `[rows, cols]` copy.
///
/// Panics on another dtype or short slices (caller bugs).
pub fn group_to_panel(dtype: DType, cols: usize, group: &[u8], out: &mut [f32], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C presence checked above; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => x86::dequant_x8_panel_q4_0(group, cols, out, stride),
                DType::Q8_0 => x86::dequant_x8_panel_q8_0(group, cols, out, stride),
                _ => unreachable!("group_to_panel on {dtype}"),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        // SAFETY: NEON checked; lengths asserted inside.
        unsafe {
            match dtype {
                DType::Q4_0 => aarch64::dequant_x8_panel_q4_0(group, cols, out, stride),
                DType::Q8_0 => aarch64::dequant_x8_panel_q8_0(group, cols, out, stride),
                _ => unreachable!("group_to_panel on {dtype}"),
            }
        }
        return;
    }
    match dtype {
        DType::Q4_0 => portable::dequant_x8_panel_q4_0(group, cols, out, stride),
        DType::Q8_0 => portable::dequant_x8_panel_q8_0(group, cols, out, stride),
        _ => unreachable!("group_to_panel on {dtype}"),
    }
}

/// `out += a · row`, dequantizing one packed row block by block.
/// `row`: `cols` elements of `dtype`; `out`: `[cols]`.
#[inline]
pub fn axpy_row(dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, w) in out.iter_mut().zip(cast::<f32>(row)) {
                *o += a * w;
            }
        }
        DType::F16 => {
            for (o, w) in out.iter_mut().zip(cast::<f16>(row)) {
                *o += a * w.to_f32();
            }
        }
        DType::Q8_0 | DType::Q4_0 => axpy(dtype, row, a, out),
    }
}

/// Quantizes `x` (`[n]`) into packed row bytes of `dtype` (used by `prep` and tests).
/// `n` must be a multiple of 32 for quantized types.
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    fn push<T: GgmlType>(x: &[f32], out: &mut Vec<u8>) {
        let mut blocks = vec![T::zeros(); x.len() / T::BLCK_SIZE];
        T::from_float(x, &mut blocks);
        // SAFETY: T is a plain-old-data repr(C) type; viewing its memory as
        // bytes for `len * size_of::<T>()` bytes is valid.
        let bytes = unsafe {
            std::slice::from_raw_parts(blocks.as_ptr() as *const u8, blocks.len() * std::mem::size_of::<T>())
        };
        out.extend_from_slice(bytes);
    }
    match dtype {
        DType::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => x.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::Q8_0 => push::<BlockQ8_0>(x, out),
        DType::Q4_0 => push::<BlockQ4_0>(x, out),
    }
}

#[cfg(test)]
mod tests;
