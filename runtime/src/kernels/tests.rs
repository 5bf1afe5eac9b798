//! Kernel tests: every ISA kernel against [`super::portable`] bit for bit,
//! the portable kernels against candle-core's `vec_dot` (to rounding), and
//! [`QMatrix`] layouts against each other.

use super::*;
use crate::kernels::cast as as_blocks;
use crate::kernels::matrix::q8_input;
use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ8_0, GgmlType};

fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut v = vec![0u64; bytes.len().div_ceil(8)];
    // SAFETY: v has at least bytes.len() bytes.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, bytes.len()) }.copy_from_slice(bytes);
    v
}

/// `w` quantized to one row of `dt`, in 8-byte aligned storage.
fn quantized(dt: DType, w: &[f32]) -> Vec<u64> {
    let mut b = Vec::new();
    quantize_row(dt, w, &mut b);
    aligned(&b)
}

fn view(v: &[u64], len: usize) -> &[u8] {
    // SAFETY: v holds at least len bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, len) }
}

/// candle-core's quantized `vec_dot` of a Q4_0 / Q8_0 row with Q8_0 blocks,
/// the independent reference, where it can run: on aarch64 candle-core
/// 0.11.1 (`quantized/neon.rs`) issues `sdot` without checking that the CPU
/// has dotprod, so without it the comparison is skipped (`None`) and the
/// portable kernels remain the reference.
fn candle_dot(dt: DType, cols: usize, row: &[u8], y: &[BlockQ8_0]) -> Option<f32> {
    if cfg!(target_arch = "aarch64") && !super::has_dotprod() {
        return None;
    }
    Some(match dt {
        DType::Q4_0 => BlockQ4_0::vec_dot(cols, cast::<BlockQ4_0>(row), y),
        _ => BlockQ8_0::vec_dot(cols, cast::<BlockQ8_0>(row), y),
    })
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
        let yblocks: &[BlockQ8_0] = as_blocks(view(&yv, nb * 34));
        let y = Q8Vec::from_blocks(yblocks.to_vec());
        let got = dot4(DType::Q4_0, cols, [r[0], r[1], r[2], r[3]], &y);
        for i in 0..4 {
            let Some(want) = candle_dot(DType::Q4_0, cols, r[i], yblocks) else { continue };
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
    let y = Q8Vec::from_slice(&x);
    for dt in [DType::Q4_0, DType::Q8_0] {
        let rows: Vec<Vec<u64>> =
            (0..4).map(|_| quantized(dt, &(0..cols).map(|_| rnd()).collect::<Vec<_>>())).collect();
        let rb = dt.row_bytes(cols as u64).unwrap() as usize;
        let r: Vec<&[u8]> = rows.iter().map(|v| view(v, rb)).collect();
        let got = dot4(dt, cols, [r[0], r[1], r[2], r[3]], &y);
        for i in 0..4 {
            if let Some(want) = candle_dot(dt, cols, r[i], y.blocks()) {
                assert!((got[i] - want).abs() <= 1e-4 * want.abs().max(1.0), "{dt} row {i}: {} vs {want}", got[i]);
            }
        }
        let mut a = vec![0.5f32; cols];
        let mut b = vec![0.5f32; cols];
        axpy(dt, r[1], -1.25, &mut a);
        axpy_ref(dt, r[1], -1.25, &mut b);
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-5, "{dt} axpy");
        }
        axpy2(dt, [r[2], r[3]], [0.75, -2.0], &mut a);
        axpy_ref(dt, r[2], 0.75, &mut b);
        axpy_ref(dt, r[3], -2.0, &mut b);
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-5, "{dt} axpy2");
        }
    }
}

/// The portable axpy of `dt`.
fn axpy_ref(dt: DType, row: &[u8], a: f32, out: &mut [f32]) {
    match dt {
        DType::Q4_0 => portable::axpy_q4_0(row, a, out),
        _ => portable::axpy_q8_0(row, a, out),
    }
}

/// Random f32 values in [-scale, scale).
fn rnd_vec(seed: &mut u32, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            ((*seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The rows `r` as one ×8 group of `dt` (`cols` elements each; `None` rows are zeros).
fn x8_group(dt: DType, cols: usize, r: [Option<&[u8]>; 8]) -> Vec<u64> {
    let mut g = vec![0u8; 8 * dt.row_bytes(cols as u64).unwrap() as usize];
    nflash_format::interleave::pack_group(dt, cols, r, &mut g);
    aligned(&g)
}

/// The AVX-512 VNNI ×8 kernels give the AVX2 kernels' bits for 1 to 4
/// tokens, on random rows and on the extremes of the integer sums (Q4_0
/// nibbles of 15 and 0 against Q8_0 values of ±127, where AVX2's i16 sums
/// come closest to saturating). Skipped on CPUs without AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[test]
fn vnni_gemm_x8_gives_the_avx2_bits() {
    if !super::has_vnni() {
        eprintln!("skipped: no AVX-512 VNNI on this CPU");
        return;
    }
    let bits = |v: &[[f32; 8]]| v.iter().flatten().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut seed = 5u32;
    for cols in [32usize, 64, 576, 1536] {
        // Extremes: rows of 7 (one −8 sets the scale) and all-±127 inputs.
        let edge: Vec<f32> = (0..cols).map(|i| if i % 32 == 0 { -8.0 } else { 7.0 }).collect();
        let flip: Vec<f32> = (0..cols).map(|i| if i % 2 == 0 { -8.0 } else { 7.0 }).collect();
        let mut ys: Vec<Q8Vec> = (0..2).map(|_| Q8Vec::from_slice(&rnd_vec(&mut seed, cols, 3.0))).collect();
        ys.push(Q8Vec::from_slice(&vec![127.0; cols]));
        ys.push(Q8Vec::from_slice(&(0..cols).map(|i| if i % 3 == 0 { -127.0 } else { 127.0 }).collect::<Vec<_>>()));
        for dt in [DType::Q4_0, DType::Q8_0] {
            let rb = dt.row_bytes(cols as u64).unwrap() as usize;
            let mut rows: Vec<Vec<u64>> = (0..6).map(|_| quantized(dt, &rnd_vec(&mut seed, cols, 1.0))).collect();
            rows.push(quantized(dt, &edge));
            rows.push(quantized(dt, &flip));
            let g = x8_group(dt, cols, std::array::from_fn(|i| Some(view(&rows[i], rb))));
            let gv = view(&g, 8 * rb);
            let yb: Vec<&[u8]> = ys.iter().map(|y| y.bytes()).collect();
            let sm: Vec<&[i32]> = ys.iter().map(|y| &y.sums[..]).collect();
            // SAFETY: AVX2/FMA/F16C and AVX-512VL/VNNI checked above; lengths checked inside.
            let (a, v) = unsafe {
                match dt {
                    DType::Q4_0 => (
                        [
                            bits(&x86::gemm_x8_q4_0(cols, gv, [yb[0]], [sm[0]])),
                            bits(&x86::gemm_x8_q4_0(cols, gv, [yb[1], yb[2]], [sm[1], sm[2]])),
                            bits(&x86::gemm_x8_q4_0(cols, gv, [yb[0], yb[1], yb[3]], [sm[0], sm[1], sm[3]])),
                            bits(&x86::gemm_x8_q4_0(
                                cols,
                                gv,
                                [yb[0], yb[1], yb[2], yb[3]],
                                [sm[0], sm[1], sm[2], sm[3]],
                            )),
                        ],
                        [
                            bits(&x86::gemm_x8_q4_0_vnni(cols, gv, [yb[0]], [sm[0]])),
                            bits(&x86::gemm_x8_q4_0_vnni(cols, gv, [yb[1], yb[2]], [sm[1], sm[2]])),
                            bits(&x86::gemm_x8_q4_0_vnni(cols, gv, [yb[0], yb[1], yb[3]], [sm[0], sm[1], sm[3]])),
                            bits(&x86::gemm_x8_q4_0_vnni(
                                cols,
                                gv,
                                [yb[0], yb[1], yb[2], yb[3]],
                                [sm[0], sm[1], sm[2], sm[3]],
                            )),
                        ],
                    ),
                    _ => (
                        [
                            bits(&x86::gemm_x8_q8_0(cols, gv, [yb[0]])),
                            bits(&x86::gemm_x8_q8_0(cols, gv, [yb[1], yb[2]])),
                            bits(&x86::gemm_x8_q8_0(cols, gv, [yb[0], yb[1], yb[3]])),
                            bits(&x86::gemm_x8_q8_0(cols, gv, [yb[0], yb[1], yb[2], yb[3]])),
                        ],
                        [
                            bits(&x86::gemm_x8_q8_0_vnni(cols, gv, [yb[0]])),
                            bits(&x86::gemm_x8_q8_0_vnni(cols, gv, [yb[1], yb[2]])),
                            bits(&x86::gemm_x8_q8_0_vnni(cols, gv, [yb[0], yb[1], yb[3]])),
                            bits(&x86::gemm_x8_q8_0_vnni(cols, gv, [yb[0], yb[1], yb[2], yb[3]])),
                        ],
                    ),
                }
            };
            assert_eq!(a, v, "{dt} VNNI against AVX2 at {cols} columns");
            // The edge rows' sums are the extremes they were made for.
            let want = dot(dt, cols, view(&rows[6], rb), &ys[2]);
            assert!(want > 0.0 && want.is_finite(), "{dt} edge row dot {want}");
        }
    }
}

/// Whatever kernel [`dot`], [`dot4`], [`gemm_x8`], [`axpy`] and [`axpy2`]
/// dispatch to on this CPU gives the bits of the portable reference; and a
/// row gives the same bits alone, in a quad, and in a ×8 group with 1 to 4
/// tokens (the order `portable.rs` documents).
#[test]
fn dispatched_kernels_match_portable_bit_for_bit() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut seed = 99u32;
    for cols in [32usize, 96, 576, 1536] {
        let ys: Vec<Q8Vec> = (0..4).map(|_| Q8Vec::from_slice(&rnd_vec(&mut seed, cols, 3.0))).collect();
        let yb = ys[0].bytes();
        for dt in [DType::Q4_0, DType::Q8_0] {
            let rows: Vec<Vec<u64>> = (0..8).map(|_| quantized(dt, &rnd_vec(&mut seed, cols, 1.0))).collect();
            let rb = dt.row_bytes(cols as u64).unwrap() as usize;
            let r: Vec<&[u8]> = rows.iter().map(|v| view(v, rb)).collect();
            let quad = [r[0], r[1], r[2], r[3]];
            let (got, want) = match dt {
                DType::Q4_0 => (dot4(dt, cols, quad, &ys[0]), portable::dot4_q4_0(cols, quad, yb)),
                _ => (dot4(dt, cols, quad, &ys[0]), portable::dot4_q8_0(cols, quad, yb)),
            };
            assert_eq!(bits(&got), bits(&want), "{} {dt} dot4 at {cols} columns", isa());
            let one: Vec<f32> = quad.iter().map(|row| dot(dt, cols, row, &ys[0])).collect();
            assert_eq!(bits(&one), bits(&want), "{} {dt} dot at {cols} columns", isa());
            // ×8 groups: all 8 rows, and a tail group with rows 5..8 missing.
            for n_rows in [8, 5] {
                let g = x8_group(dt, cols, std::array::from_fn(|i| (i < n_rows).then(|| r[i])));
                let gv = view(&g, 8 * rb);
                let check = |d: &[[f32; 8]], t0: usize| {
                    for (t, row) in d.iter().enumerate() {
                        let yt = ys[t0 + t].bytes();
                        let p = match dt {
                            DType::Q4_0 => portable::gemm_x8_q4_0(cols, gv, [yt]),
                            _ => portable::gemm_x8_q8_0(cols, gv, [yt]),
                        };
                        assert_eq!(bits(row), bits(&p[0]), "{} {dt} gemm_x8 token {t} at {cols}", isa());
                        for i in 0..8 {
                            let want = if i < n_rows { dot(dt, cols, r[i], &ys[t0 + t]) } else { 0.0 };
                            assert_eq!(row[i].to_bits(), want.to_bits(), "{dt} ×8 row {i} vs dot at {cols}");
                        }
                    }
                };
                check(&gemm_x8(dt, cols, gv, [&ys[0]]), 0);
                check(&gemm_x8(dt, cols, gv, [&ys[1], &ys[2]]), 1);
                check(&gemm_x8(dt, cols, gv, [&ys[0], &ys[1], &ys[2]]), 0);
                check(&gemm_x8(dt, cols, gv, [&ys[0], &ys[1], &ys[2], &ys[3]]), 0);
            }
            let (mut a, mut b) = (rnd_vec(&mut seed, cols, 1.0), Vec::new());
            b.extend_from_slice(&a);
            axpy2(dt, [r[4], r[5]], [0.75, -2.5], &mut a);
            for (row, s) in [(r[4], 0.75), (r[5], -2.5)] {
                match dt {
                    DType::Q4_0 => portable::axpy_q4_0(row, s, &mut b),
                    _ => portable::axpy_q8_0(row, s, &mut b),
                }
            }
            assert_eq!(bits(&a), bits(&b), "{} axpy2 at {cols} columns", isa());
            // ×8 axpy: the rows set in the mask, each as the row axpy would add it.
            let g = x8_group(dt, cols, std::array::from_fn(|i| Some(r[i])));
            let gv = view(&g, 8 * rb);
            let s: [f32; 8] = std::array::from_fn(|i| 0.5 - 0.375 * i as f32);
            for mask in [0xFFu8, 0b1010_0110, 0x01, 0x80, 0] {
                let (mut a, mut b, mut c) = (rnd_vec(&mut seed, cols, 1.0), Vec::new(), Vec::new());
                b.extend_from_slice(&a);
                c.extend_from_slice(&a);
                axpy_x8(dt, gv, s, mask, &mut a);
                match dt {
                    DType::Q4_0 => portable::axpy_x8_q4_0(gv, s, mask, &mut c),
                    _ => portable::axpy_x8_q8_0(gv, s, mask, &mut c),
                }
                for i in (0..8).filter(|i| mask & (1 << i) != 0) {
                    axpy_ref(dt, r[i], s[i], &mut b);
                }
                assert_eq!(bits(&a), bits(&b), "{} {dt} axpy_x8 {mask:#x} at {cols} columns", isa());
                assert_eq!(bits(&c), bits(&b), "portable {dt} axpy_x8 {mask:#x} at {cols} columns");
            }
        }
    }
}

/// Q8_0 weights at the ends of their range (−128, 127) and Q4_0 nibbles 0
/// and 15 against activations ±127, in every kernel: where an i16 lane
/// would saturate or an offset be wrong, the exact integer sum shows it.
#[test]
fn kernels_are_exact_at_the_extremes() {
    let cols = 64;
    let nb = cols / 32;
    let f16b = |v: f32| f16::from_f32(v).to_le_bytes();
    let ys: Vec<Q8Vec> = [[127i8; 32], [-127i8; 32], std::array::from_fn(|j| if j % 3 == 0 { 127 } else { -127 })]
        .iter()
        .map(|q| {
            let mut yb = Vec::new();
            for _ in 0..nb {
                yb.extend_from_slice(&f16b(1.0));
                yb.extend(q.iter().map(|&v| v as u8));
            }
            Q8Vec::from_blocks(as_blocks::<BlockQ8_0>(view(&aligned(&yb), nb * 34)).to_vec())
        })
        .collect();
    for (dt, fills) in [(DType::Q4_0, [0x00u8, 0xFF, 0xF0, 0x0F]), (DType::Q8_0, [0x80u8, 0x7F, 0x81, 0x80])] {
        let block = dt.row_bytes(32).unwrap() as usize;
        let rows: Vec<Vec<u64>> = fills
            .iter()
            .map(|&fill| {
                let mut b = Vec::new();
                for _ in 0..nb {
                    b.extend_from_slice(&f16b(1.0));
                    b.extend(std::iter::repeat_n(fill, block - 2));
                }
                aligned(&b)
            })
            .collect();
        let r: Vec<&[u8]> = rows.iter().map(|v| view(v, nb * block)).collect();
        let g = x8_group(dt, cols, std::array::from_fn(|i| Some(r[i % 4])));
        for y in &ys {
            // Exact: every scale is 1, so the dot is the integer sum.
            let exact = |row: &[u8]| -> f32 {
                let mut w = vec![0f32; cols];
                row_to_f32(dt, row, &mut w);
                let mut yf = vec![0f32; cols];
                row_to_f32(DType::Q8_0, q8_bytes(y.blocks()), &mut yf);
                w.iter().zip(&yf).map(|(a, b)| a * b).sum()
            };
            let got4 = dot4(dt, cols, [r[0], r[1], r[2], r[3]], y);
            let [got8] = gemm_x8(dt, cols, view(&g, 8 * nb * block), [y]);
            for i in 0..4 {
                assert_eq!(got4[i], exact(r[i]), "{dt} dot4 row {i}");
                assert_eq!(got8[i], exact(r[i]), "{dt} gemm_x8 row {i}");
                assert_eq!(dot(dt, cols, r[i], y), exact(r[i]), "{dt} dot row {i}");
            }
        }
    }
}

/// The quantized GEMM against f32 arithmetic on the dequantized weights:
/// the only error is the activations' Q8_0 rounding, at most half a step
/// (`d = amax / 127` of the block) per element, so `|Σ w (x − x̂)|` is
/// bounded by `Σ_blocks d / 2 · Σ |w|`, plus f32 rounding.
#[test]
fn quantized_gemm_is_within_q8_0_rounding_of_f32() {
    let mut seed = 7u32;
    let (rows, cols, n) = (24, 160, 7);
    for dt in [DType::Q4_0, DType::Q8_0] {
        let mut bytes = Vec::new();
        for _ in 0..rows {
            quantize_row(dt, &rnd_vec(&mut seed, cols, 1.0), &mut bytes);
        }
        let mut inter = bytes.clone();
        nflash_format::interleave::interleave(dt, &mut inter, cols, &mut Vec::new());
        let inter = aligned(&inter);
        let m = QMatrix::x8(dt, rows, cols, view(&inter, bytes.len()));
        let x: Vec<f32> = rnd_vec(&mut seed, n * cols, 2.0);
        let xs: Vec<DotInput> = x.chunks_exact(cols).map(|r| DotInput::from_slice(dt, r)).collect();
        let mut out = vec![0f32; n * rows];
        m.matmul(&xs, &mut out);
        let rb = bytes.len() / rows;
        let mut w = vec![0f32; cols];
        for r in 0..rows {
            row_to_f32(
                dt,
                &aligned(&bytes[r * rb..(r + 1) * rb]).iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()[..rb],
                &mut w,
            );
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let exact: f64 = w.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
                let bound: f64 = (0..cols / 32)
                    .map(|b| {
                        let amax = xt[32 * b..32 * b + 32].iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                        let sw: f64 = w[32 * b..32 * b + 32].iter().map(|v| v.abs() as f64).sum();
                        // Half a step, with the step's own f16 rounding.
                        amax / 127.0 * (1.0 + 1e-3) / 2.0 * sw
                    })
                    .sum::<f64>()
                    + 1e-4 * exact.abs().max(1.0);
                let got = out[t * rows + r] as f64;
                assert!((got - exact).abs() <= bound, "{dt} row {r} token {t}: {got} vs {exact} (bound {bound})");
            }
        }
    }
}

fn approx_dot(dtype: DType) -> (f32, f32) {
    let n = 64;
    let w: Vec<f32> = (0..2 * n).map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0).collect();
    let x: Vec<f32> = (0..n).map(|i| ((i * 11 % 13) as f32 - 6.0) / 6.0).collect();
    let mut bytes = Vec::new();
    // 8-byte aligned copy so casts are valid
    quantize_row(dtype, &w[..n], &mut bytes);
    quantize_row(dtype, &w[n..], &mut bytes);
    let aligned: Vec<u64> = vec![0; bytes.len().div_ceil(8)];
    let mut aligned = aligned;
    // SAFETY: `aligned` has at least `bytes.len()` bytes.
    let buf = unsafe { std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, bytes.len()) };
    buf.copy_from_slice(&bytes);
    let m = QMatrix::new(dtype, 2, n, buf);
    let xin = DotInput::from_slice(dtype, &x);
    let exact: f32 = w[n..].iter().zip(&x).map(|(a, b)| a * b).sum();
    (m.row_dot(1, &xin), exact)
}

#[test]
fn axpy_matches_dequantize() {
    let x: Vec<f32> = (0..96).map(|i| ((i * 29 % 31) as f32 - 15.0) / 7.0).collect();
    for dt in [DType::F32, DType::F16, DType::Q8_0, DType::Q4_0] {
        let mut bytes = Vec::new();
        quantize_row(dt, &x, &mut bytes);
        let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `aligned` has at least `bytes.len()` bytes.
        let buf = unsafe { std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, bytes.len()) };
        buf.copy_from_slice(&bytes);
        let mut deq = vec![0f32; 96];
        row_to_f32(dt, buf, &mut deq);
        let mut out = vec![1f32; 96];
        axpy_row(dt, buf, -0.5, &mut out);
        for (o, d) in out.iter().zip(&deq) {
            assert!((o - (1.0 - 0.5 * d)).abs() < 1e-5, "{dt}");
        }
    }
}

#[test]
fn dots_match_f32_reference() {
    for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 1e-2), (DType::Q8_0, 0.1), (DType::Q4_0, 0.6)] {
        let (got, want) = approx_dot(dt);
        assert!((got - want).abs() <= tol, "{dt}: {got} vs {want}");
    }
}

/// The ×8 layout gives the same bits as the row layout in every batch
/// path, for both quantizations: decode matvec (fused Q/K/V), matmul with
/// token counts that are and are not multiples of the 4-token tile (each
/// token the bits of its own matvec), single rows, and dequantized rows
/// (embedding lookups).
#[test]
fn x8_layout_matches_the_row_layout_bit_for_bit() {
    let (rows, cols) = (40, 96);
    let mut seed = 5u32;
    for dt in [DType::Q4_0, DType::Q8_0] {
        let mut bytes = Vec::new();
        for _ in 0..rows {
            quantize_row(dt, &rnd_vec(&mut seed, cols, 1.0), &mut bytes);
        }
        let words = aligned(&bytes);
        let rowl = view(&words, bytes.len());
        let mut inter = bytes.clone();
        nflash_format::interleave::interleave(dt, &mut inter, cols, &mut Vec::new());
        let iw = aligned(&inter);
        let a = QMatrix::new(dt, rows, cols, rowl);
        let b = QMatrix::x8(dt, rows, cols, view(&iw, inter.len()));
        let xs: Vec<DotInput> = (0..9).map(|_| DotInput::from_slice(dt, &rnd_vec(&mut seed, cols, 3.0))).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let (mut oa, mut ob) = (vec![0f32; rows], vec![0f32; rows]);
        a.matvec(&xs[0], &mut oa);
        b.matvec(&xs[0], &mut ob);
        assert_eq!(bits(&oa), bits(&ob), "{dt} matvec");
        let (mut qa, mut ka, mut qb, mut kb) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
        matvec_many(&[&a, &a], &xs[1], &mut [&mut qa, &mut ka]);
        matvec_many(&[&b, &b], &xs[1], &mut [&mut qb, &mut kb]);
        assert_eq!((bits(&qa), bits(&ka)), (bits(&qb), bits(&kb)), "{dt} matvec_many");
        for n in [2, 3, 4, 5, 8, 9] {
            let (mut ma, mut mb) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            a.matmul(&xs[..n], &mut ma);
            b.matmul(&xs[..n], &mut mb);
            assert_eq!(bits(&ma), bits(&mb), "{dt} matmul of {n}");
            for (t, x) in xs[..n].iter().enumerate() {
                b.matvec(x, &mut ob);
                assert_eq!(bits(&mb[t * rows..(t + 1) * rows]), bits(&ob), "{dt} matmul of {n}, token {t}");
            }
        }
        // f32 activations: a short batch goes through gemm_x8_f32 in either
        // layout (the same bits), a long one through f32 panels (f32
        // rounding apart).
        for n in [1, 5, 9, matrix::DIRECT_F32_TOKENS + 3] {
            let x = rnd_vec(&mut seed, n * cols, 2.0);
            let (mut fa, mut fb) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            a.matmul_f32(&x, &mut fa);
            b.matmul_f32(&x, &mut fb);
            if n <= matrix::DIRECT_F32_TOKENS {
                assert_eq!(bits(&fa), bits(&fb), "{dt} matmul_f32 of {n}");
            }
            let mut want = vec![0f32; cols];
            for (i, (p, q)) in fa.iter().zip(&fb).enumerate() {
                a.row_to_f32(i % rows, &mut want);
                let xt = &x[i / rows * cols..][..cols];
                let norm: f32 = want.iter().zip(xt).map(|(w, v)| (w * v).abs()).sum();
                assert!((p - q).abs() <= 1e-5 * norm.max(1.0), "{dt} matmul_f32 of {n}: {p} vs {q}");
            }
        }
        let (mut da, mut db) = (vec![0f32; cols], vec![0f32; cols]);
        for r in [0, 7, 8, 21, 39] {
            assert_eq!(a.row_dot(r, &xs[2]).to_bits(), b.row_dot(r, &xs[2]).to_bits(), "{dt} row_dot {r}");
            a.row_to_f32(r, &mut da);
            b.row_to_f32(r, &mut db);
            assert_eq!(bits(&da), bits(&db), "{dt} row_to_f32 {r}");
        }
        // And candle-core's kernel agrees to rounding.
        b.matvec(&xs[0], &mut ob);
        if let Some(want) = candle_dot(dt, cols, a.row(9), q8_input(&xs[0]).blocks()) {
            assert!((ob[9] - want).abs() <= 1e-4 * want.abs().max(1.0), "{dt}: {} vs {want}", ob[9]);
        }
    }
}

/// The attention kernels (score dot and value axpy, f16 and f32 KV cache)
/// give the portable bits on this CPU, at head sizes with and without an
/// 8-element tail; the f16 cache agrees with f32 to f16 rounding.
#[test]
fn kv_kernels_match_portable_bit_for_bit() {
    let mut seed = 3u32;
    for hd in [1usize, 13, 20, 30, 47, 64, 72, 128] {
        let q = rnd_vec(&mut seed, hd, 2.0);
        let k = rnd_vec(&mut seed, hd, 2.0);
        let k16: Vec<f16> = k.iter().map(|&v| f16::from_f32(v)).collect();
        assert_eq!(
            dot_kv(&q, KvSlice::F32(&k)).to_bits(),
            portable::dot_kv(&q, &k).to_bits(),
            "{} dot f32 {hd}",
            isa()
        );
        assert_eq!(dot_kv(&q, KvSlice::F16(&k16)).to_bits(), portable::dot_kv(&q, &k16).to_bits(), "dot f16 {hd}");
        let exact: f32 = q.iter().zip(&k).map(|(a, b)| a * b).sum();
        let bound: f32 = q.iter().zip(&k).map(|(a, b)| (a * b).abs()).sum::<f32>() * 1e-3 + 1e-5;
        assert!((dot_kv(&q, KvSlice::F16(&k16)) - exact).abs() <= bound, "f16 dot {hd}");
        let (mut a, mut b) = (q.clone(), q.clone());
        axpy_kv(-0.75, KvSlice::F32(&k), &mut a);
        portable::axpy_kv(-0.75, &k, &mut b);
        assert_eq!(a, b, "axpy f32 {hd}");
        let (mut a, mut b) = (q.clone(), q.clone());
        axpy_kv(1.5, KvSlice::F16(&k16), &mut a);
        portable::axpy_kv(1.5, &k16, &mut b);
        assert_eq!(a, b, "axpy f16 {hd}");
    }
}

/// The whole-head attention kernels give, per position, the bits of the
/// single-row kernels (and so of `portable.rs`), for both cache types, head
/// sizes with and without an 8-element tail, position counts with and
/// without a 4-position tail, and a KV head at an offset inside the row.
#[test]
fn attention_kernels_match_the_row_kernels() {
    let mut seed = 11u32;
    for hd in [8usize, 20, 64, 128] {
        let (heads, n) = (3, 23);
        let stride = heads * hd;
        let k = rnd_vec(&mut seed, (n + 2) * stride, 1.0);
        let v = rnd_vec(&mut seed, (n + 2) * stride, 1.0);
        let (k16, v16): (Vec<f16>, Vec<f16>) =
            (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
        for (kc, vc) in [(KvSlice::F32(&k), KvSlice::F32(&v)), (KvSlice::F16(&k16), KvSlice::F16(&v16))] {
            // 1 to 7 query heads per KV head: passes of 4 heads and their tails.
            for nq in [1, 2, 3, 5, 7] {
                let q = rnd_vec(&mut seed, nq * hd, 1.0);
                let p = rnd_vec(&mut seed, nq * n, 1.0);
                for (start, len) in [(0, n), (2, 5), (1, 1), (3, 0)] {
                    let off = hd; // the second KV head
                    let mut s = vec![0f32; nq * len];
                    attn_scores(&q, hd, kc, stride, off, start, 0.125, &mut s);
                    for h in 0..nq {
                        for j in 0..len {
                            let want =
                                dot_kv(&q[h * hd..(h + 1) * hd], kc.range((start + j) * stride + off, hd)) * 0.125;
                            assert_eq!(
                                s[h * len + j].to_bits(),
                                want.to_bits(),
                                "head {h} score {j} of {len}, hd {hd}"
                            );
                        }
                    }
                    let ps: Vec<f32> = (0..nq).flat_map(|h| p[h * n..h * n + len].to_vec()).collect();
                    let (mut a, mut b) = (q.clone(), q.clone());
                    attn_values(&ps, hd, vc, stride, off, start, &mut a);
                    for h in 0..nq {
                        for j in 0..len {
                            axpy_kv(
                                ps[h * len + j],
                                vc.range((start + j) * stride + off, hd),
                                &mut b[h * hd..(h + 1) * hd],
                            );
                        }
                    }
                    assert_eq!(a, b, "{nq} heads, values of {len}, hd {hd}");
                }
            }
        }
    }
}

/// Dequantization on this CPU gives candle-core's bits (one f32 product per element).
#[test]
fn row_to_f32_matches_candle_bit_for_bit() {
    let mut seed = 21u32;
    for dt in [DType::Q4_0, DType::Q8_0] {
        let w = rnd_vec(&mut seed, 160, 3.0);
        let q = quantized(dt, &w);
        let rb = dt.row_bytes(160).unwrap() as usize;
        let row = view(&q, rb);
        let (mut got, mut want) = (vec![0f32; 160], vec![0f32; 160]);
        row_to_f32(dt, row, &mut got);
        match dt {
            DType::Q4_0 => BlockQ4_0::to_float(as_blocks(row), &mut want),
            _ => BlockQ8_0::to_float(as_blocks(row), &mut want),
        }
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{dt}"
        );
    }
}

/// A ×8 group dequantizes to the bits of its rows in the row layout,
/// through the dispatched and the portable kernel.
#[test]
fn group_to_f32_and_panel_match_row_to_f32_bit_for_bit() {
    let mut seed = 23u32;
    for dt in [DType::Q4_0, DType::Q8_0] {
        let cols = 160;
        let rb = dt.row_bytes(cols as u64).unwrap() as usize;
        let rows: Vec<Vec<u64>> = (0..8).map(|_| quantized(dt, &rnd_vec(&mut seed, cols, 3.0))).collect();
        let r: Vec<&[u8]> = rows.iter().map(|v| view(v, rb)).collect();
        let g = x8_group(dt, cols, std::array::from_fn(|i| Some(r[i])));
        let (mut got, mut port, mut want) = (vec![0f32; 8 * cols], vec![0f32; 8 * cols], vec![0f32; 8 * cols]);
        group_to_f32(dt, cols, view(&g, 8 * rb), &mut got);
        match dt {
            DType::Q4_0 => portable::dequant_x8_q4_0(view(&g, 8 * rb), cols, &mut port),
            _ => portable::dequant_x8_q8_0(view(&g, 8 * rb), cols, &mut port),
        }
        for (i, row) in r.iter().enumerate() {
            row_to_f32(dt, row, &mut want[i * cols..(i + 1) * cols]);
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{} {dt}", isa());
        assert_eq!(bits(&port), bits(&want), "portable {dt}");
        // The panel form: the same values transposed, at column offset 3 of stride 13.
        for which in ["dispatched", "portable"] {
            let mut panel = vec![-1f32; cols * 13];
            let out = &mut panel[3..];
            match (which, dt) {
                ("dispatched", _) => group_to_panel(dt, cols, view(&g, 8 * rb), out, 13),
                (_, DType::Q4_0) => portable::dequant_x8_panel_q4_0(view(&g, 8 * rb), cols, out, 13),
                _ => portable::dequant_x8_panel_q8_0(view(&g, 8 * rb), cols, out, 13),
            }
            for k in 0..cols {
                for c in 0..13 {
                    let v = panel[k * 13 + c];
                    let expect = if (3..11).contains(&c) { want[(c - 3) * cols + k] } else { -1.0 };
                    assert_eq!(v.to_bits(), expect.to_bits(), "{which} {} {dt} panel ({k}, {c})", isa());
                }
            }
        }
        // The rows form (the down projection's panels): columns c0 .. c0 + 16
        // of the 8 rows, row r at r · 19, both halves of a column block.
        for c0 in (0..cols).step_by(PANEL) {
            for which in ["dispatched", "portable"] {
                let mut panel = vec![-1f32; 8 * 19];
                let gv = view(&g, 8 * rb);
                match (which, dt) {
                    ("dispatched", _) => group_rows_to_panel(dt, cols, gv, c0, &mut panel, 19),
                    (_, DType::Q4_0) => portable::dequant_x8_rows_panel_q4_0(gv, cols, c0, &mut panel, 19),
                    _ => portable::dequant_x8_rows_panel_q8_0(gv, cols, c0, &mut panel, 19),
                }
                for r in 0..8 {
                    for c in 0..19 {
                        let expect = if c < PANEL { want[r * cols + c0 + c] } else { -1.0 };
                        let v = panel[r * 19 + c];
                        assert_eq!(
                            v.to_bits(),
                            expect.to_bits(),
                            "{which} {} {dt} rows panel c0 {c0} ({r}, {c})",
                            isa()
                        );
                    }
                }
            }
        }
    }
}

/// The f32-activation ×8 kernel gives the portable bits for 1, 2, 4 and 8
/// tokens (each token the bits it gets alone), Q4_0 and Q8_0, and agrees
/// with an f64 dot of the dequantized rows to f32 rounding.
#[test]
fn gemm_x8_f32_matches_portable_and_f64() {
    let mut seed = 31u32;
    for cols in [32usize, 96, 576] {
        let xs: Vec<Vec<f32>> = (0..8).map(|_| rnd_vec(&mut seed, cols, 2.0)).collect();
        for dt in [DType::Q4_0, DType::Q8_0] {
            let rb = dt.row_bytes(cols as u64).unwrap() as usize;
            let rows: Vec<Vec<u64>> = (0..8).map(|_| quantized(dt, &rnd_vec(&mut seed, cols, 1.0))).collect();
            let r: Vec<&[u8]> = rows.iter().map(|v| view(v, rb)).collect();
            let g = x8_group(dt, cols, std::array::from_fn(|i| Some(r[i])));
            let gv = view(&g, 8 * rb);
            let x: [&[f32]; 8] = std::array::from_fn(|t| &xs[t][..]);
            let port = |t: usize| match dt {
                DType::Q4_0 => portable::gemm_x8_f32_q4_0(cols, gv, [x[t]])[0],
                _ => portable::gemm_x8_f32_q8_0(cols, gv, [x[t]])[0],
            };
            let bits = |v: &[f32; 8]| v.map(f32::to_bits);
            let all8 = gemm_x8_f32(dt, cols, gv, x);
            let two = gemm_x8_f32(dt, cols, gv, [x[3], x[5]]);
            let four = gemm_x8_f32(dt, cols, gv, [x[0], x[1], x[2], x[3]]);
            for t in 0..8 {
                assert_eq!(bits(&all8[t]), bits(&port(t)), "{} {dt} token {t} of 8 at {cols}", isa());
                assert_eq!(bits(&gemm_x8_f32(dt, cols, gv, [x[t]])[0]), bits(&port(t)), "{dt} 1 token at {cols}");
            }
            assert_eq!((bits(&two[0]), bits(&two[1])), (bits(&port(3)), bits(&port(5))), "{dt} 2 tokens");
            assert_eq!(bits(&four[2]), bits(&port(2)), "{dt} 4 tokens");
            let mut w = vec![0f32; cols];
            for (i, row) in r.iter().enumerate() {
                row_to_f32(dt, row, &mut w);
                let want: f64 = w.iter().zip(&xs[6]).map(|(a, b)| *a as f64 * *b as f64).sum();
                let norm: f64 = w.iter().zip(&xs[6]).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                let got = all8[6][i] as f64;
                assert!((got - want).abs() <= 1e-5 * norm.max(1e-3), "{dt} row {i}: {got} vs {want}");
            }
        }
    }
}

#[test]
fn panel_tile_matches_portable_bit_for_bit_and_f64() {
    let mut seed = 77u32;
    for depth in [0usize, 1, 7, 64, 577] {
        for ws in [PANEL, PANEL + 3] {
            let xs = depth + 5;
            let x = rnd_vec(&mut seed, PANEL_TOKENS * xs, 2.0);
            let w = rnd_vec(&mut seed, depth.max(1) * ws, 1.0);
            let bits = |v: &[[f32; PANEL]]| v.iter().flat_map(|r| r.map(f32::to_bits)).collect::<Vec<u32>>();
            let want = portable::panel_tile::<PANEL_TOKENS>(depth, &x, xs, &w, ws);
            assert_eq!(
                bits(&panel_tile::<PANEL_TOKENS>(depth, &x, xs, &w, ws)),
                bits(&want),
                "{} depth {depth}",
                isa()
            );
            // Fewer tokens give each token the same bits.
            assert_eq!(bits(&panel_tile::<1>(depth, &x[3 * xs..], xs, &w, ws)), bits(&want[3..4]), "1 token");
            assert_eq!(bits(&panel_tile::<5>(depth, &x, xs, &w, ws)), bits(&want[..5]), "5 tokens");
            for (t, row) in want.iter().enumerate() {
                for (j, &got) in row.iter().enumerate() {
                    let terms = (0..depth).map(|i| x[t * xs + i] as f64 * w[i * ws + j] as f64);
                    let (sum, norm): (f64, f64) = terms.fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
                    assert!(
                        (got as f64 - sum).abs() <= 1e-6 * norm.max(1e-3),
                        "depth {depth} ({t}, {j}): {got} vs {sum}"
                    );
                }
            }
        }
    }
}

#[test]
fn f32_products_give_each_token_the_bits_of_its_own_tile() {
    // Column counts that leave a partial panel and a partial task, token
    // counts that leave a partial tile; each output must be the tile sum of
    // that token alone, whatever the batch and the thread count.
    let mut seed = 5u32;
    for (n, m, k) in [(1usize, 16usize, 32usize), (7, 37, 20), (13, 100, 3), (6, 192, 64)] {
        let x = rnd_vec(&mut seed, n * k, 1.5);
        let w = rnd_vec(&mut seed, m * k, 1.0); // [m, k]
        let mut out = vec![0.25f32; n * (m + 3)];
        gemm::xwt(&x, &w, (n, m, k), &mut out[1..], m + 3, false);
        let mut wt = vec![0f32; k * PANEL]; // one column's weights in panel order
        for j in 0..m {
            wt.iter_mut().for_each(|v| *v = 0.0);
            for i in 0..k {
                wt[i * PANEL] = w[j * k + i];
            }
            for t in 0..n {
                let alone = panel_tile::<1>(k, &x[t * k..], k, &wt, PANEL)[0][0];
                assert_eq!(out[t * (m + 3) + 1 + j].to_bits(), alone.to_bits(), "xwt ({n}, {m}, {k}) at ({t}, {j})");
            }
        }
        assert_eq!(out[0], 0.25, "the column before the product");
        // aw: a [n, m] · w [m, k] added to out [n, k].
        let a = rnd_vec(&mut seed, n * m, 1.0);
        let base = rnd_vec(&mut seed, n * k, 1.0);
        let mut o = base.clone();
        gemm::aw(&a, &w, (n, m, k), &mut o, true);
        let mut col = vec![0f32; m * PANEL];
        for c in 0..k {
            for i in 0..m {
                col[i * PANEL] = w[i * k + c];
            }
            for t in 0..n {
                let alone = panel_tile::<1>(m, &a[t * m..], m, &col, PANEL)[0][0];
                assert_eq!(
                    o[t * k + c].to_bits(),
                    (base[t * k + c] + alone).to_bits(),
                    "aw ({n}, {m}, {k}) at ({t}, {c})"
                );
            }
        }
    }
}

#[test]
fn exp_matches_portable_bit_for_bit_and_is_correctly_rounded() {
    let mut seed = 9u32;
    let mut xs = rnd_vec(&mut seed, 20_001, 90.0);
    xs.extend([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 88.0, 88.72, 88.73, 100.0, -87.0, -87.33, -87.34, -100.0]);
    xs.extend([-103.0, -104.5, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, f32::MIN]);
    let mut got = xs.clone();
    exp_slice(&mut got);
    let mut off = 0;
    for (&x, &g) in xs.iter().zip(&got) {
        let p = portable::exp(x);
        assert!(g.to_bits() == p.to_bits() || (g.is_nan() && p.is_nan()), "{} exp({x}): {g} vs {p}", isa());
        assert_eq!(exp(x).to_bits(), p.to_bits(), "scalar exp({x})");
        let want = (x as f64).exp() as f32; // f64 exp rounded once: correctly rounded but near ties
        if x.is_nan() {
            assert!(g.is_nan());
        } else if g != want {
            off += 1;
            assert!((g.to_bits() as i64 - want.to_bits() as i64).abs() <= 1, "exp({x}) = {g}, want {want}");
        }
    }
    assert!(off <= 2, "{off} of {} values not correctly rounded", xs.len());
}

/// Q8_0 quantization (every prefill token, every decode input): the
/// dispatched kernel against the portable one and candle-core's
/// `from_float` (GGML's reference), byte for byte, at rounding ties, zero
/// and subnormal blocks, non-finite values and random data.
#[test]
fn quantize_q8_0_matches_portable_and_candle_byte_for_byte() {
    let mut seed = 7u32;
    let mut blocks: Vec<Vec<f32>> = (0..64).map(|i| rnd_vec(&mut seed, 32, 0.01 + i as f32)).collect();
    // Ties: amax 127 makes 1/d = 1, so k + 0.5 lands exactly on a half.
    blocks.push((0..32).map(|i| if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 }).collect());
    blocks.push((0..32).map(|i| if i == 0 { -127.0 } else { -(i as f32) * 2.0 - 0.5 }).collect());
    blocks.push(vec![0.0; 32]);
    blocks.push((0..32).map(|i| f32::from_bits(i + 1) * if i % 2 == 0 { 1.0 } else { -1.0 }).collect());
    blocks.push((0..32).map(|i| if i == 3 { 1e-40 } else { 0.0 }).collect());
    blocks.push((0..32).map(|i| if i == 5 { f32::NAN } else { i as f32 }).collect());
    // A NaN in the lane that holds the largest value, and a block of NaNs:
    // the largest magnitude ignores NaN (as `f32::max` does), from 0.
    blocks.push((0..32).map(|i| if i == 27 { f32::NAN } else { i as f32 }).collect());
    blocks.push(vec![f32::NAN; 32]);
    blocks.push((0..32).map(|i| if i == 9 { f32::INFINITY } else { -(i as f32) }).collect());
    blocks.push((0..32).map(|i| if i == 1 { f32::MAX } else { -f32::MAX / (i as f32 + 1.0) }).collect());
    let x: Vec<f32> = blocks.concat();
    let nb = x.len() / 32;
    let (mut got, mut want) = (vec![0u8; nb * 34], vec![0u8; nb * 34]);
    let (mut gs, mut ws) = (vec![0i32; nb], vec![0i32; nb]);
    quantize_q8_0(&x, &mut got, &mut gs);
    portable::quantize_q8_0(&x, &mut want, &mut ws);
    assert_eq!(got, want, "dispatched vs portable");
    assert_eq!(gs, ws, "sums of quants");
    let mut c = vec![BlockQ8_0::zeros(); nb];
    BlockQ8_0::from_float(&x, &mut c);
    // candle's NEON path saturates NaN differently; compare the finite blocks there.
    for (b, (cb, wb)) in q8_bytes(&c).chunks_exact(34).zip(want.chunks_exact(34)).enumerate() {
        if cfg!(target_arch = "aarch64") && !x[32 * b..32 * b + 32].iter().all(|v| v.is_finite()) {
            continue;
        }
        assert_eq!(cb, wb, "block {b} vs candle");
    }
    for (b, s) in ws.iter().enumerate() {
        assert_eq!(*s, want[34 * b + 2..34 * b + 34].iter().map(|&q| q as i8 as i32).sum::<i32>());
    }
}

/// The multi-token ×8 axpy (short prefill's and verify's down projection)
/// gives each token the bits of the one-token kernel with that token's
/// mask (every row set, none, and mixed), for token counts around its
/// tiles of 8, 4, 2 and 1 and both quantizations.
#[test]
fn axpy_x8_tokens_gives_each_token_the_bits_of_axpy_x8() {
    let cols = 96;
    let mut seed = 11u32;
    for dt in [DType::Q4_0, DType::Q8_0] {
        let rows: Vec<Vec<u64>> = (0..8).map(|i| quantized(dt, &rnd_vec(&mut seed, cols, 0.5 + i as f32))).collect();
        let rb = dt.row_bytes(cols as u64).unwrap() as usize;
        let g = x8_group(dt, cols, std::array::from_fn(|i| Some(view(&rows[i], rb))));
        let group = view(&g, 8 * rb);
        for n in [1, 2, 3, 5, 8, 11, 16] {
            let a: Vec<[f32; 8]> = (0..n)
                .map(|t| {
                    let v = rnd_vec(&mut seed, 8, 2.0);
                    std::array::from_fn(|r| if (t + r) % 5 == 0 { 0.0 } else { v[r] })
                })
                .collect();
            let masks: Vec<u8> = (0..n).map(|t| [0xFF, 0x00, 0x5A, 0x81, 0x3C][t % 5] ^ (t / 5) as u8).collect();
            let init = rnd_vec(&mut seed, n * cols, 1.0);
            let mut got = init.clone();
            let mut outs: Vec<&mut [f32]> = got.chunks_mut(cols).collect();
            axpy_x8_tokens(dt, group, &a, &masks, &mut outs);
            // The last two column blocks alone, as a thread given them would.
            let mut part = init.clone();
            let mut pouts: Vec<&mut [f32]> = part.chunks_mut(cols).map(|r| &mut r[32..]).collect();
            axpy_x8_tokens(dt, &group[(8 * rb / 3)..], &a, &masks, &mut pouts);
            let mut want = init.clone();
            for (t, at) in a.iter().enumerate() {
                let o = &mut want[t * cols..(t + 1) * cols];
                match dt {
                    DType::Q4_0 => portable::axpy_x8_q4_0(group, *at, masks[t], o),
                    _ => portable::axpy_x8_q8_0(group, *at, masks[t], o),
                }
            }
            assert_eq!(got, want, "{dt}, {n} tokens");
            for t in 0..n {
                assert_eq!(
                    part[t * cols + 32..(t + 1) * cols],
                    want[t * cols + 32..(t + 1) * cols],
                    "{dt}, columns 32.."
                );
            }
        }
    }
}

/// [`gemm_x8_tokens`] (prefill's quantized GEMM: `smmla` over the group
/// rewritten once on CPUs with i8mm, `gemm_x8` by fours elsewhere) gives
/// every token, in every position of a batch of 1 to 9, 16 or 19, the bits of the
/// portable one-token product; at the extremes too (nibbles 0 and 15,
/// values ±127, where a wrong `q − 8` or a lane mix-up would show).
#[test]
fn gemm_x8_tokens_gives_each_token_the_bits_of_portable() {
    let mut seed = 5u32;
    for cols in [32usize, 64, 576] {
        for dt in [DType::Q4_0, DType::Q8_0] {
            let rb = dt.row_bytes(cols as u64).unwrap() as usize;
            let mut rows: Vec<Vec<u64>> =
                (0..8).map(|i| quantized(dt, &rnd_vec(&mut seed, cols, 0.5 + i as f32))).collect();
            if cols == 64 {
                // Rows 6 and 7: every quant at its smallest and largest.
                let ext = |fill: u8| {
                    let mut b = Vec::new();
                    for k in 0..cols / 32 {
                        b.extend_from_slice(&f16::from_f32(1.0 + k as f32).to_le_bytes());
                        b.extend(std::iter::repeat_n(fill, rb / (cols / 32) - 2));
                    }
                    aligned(&b)
                };
                let (lo, hi) = if dt == DType::Q4_0 { (0x00, 0xFF) } else { (0x81, 0x7F) };
                rows[6] = ext(lo);
                rows[7] = ext(hi);
            }
            let g = x8_group(dt, cols, std::array::from_fn(|i| Some(view(&rows[i], rb))));
            let group = view(&g, 8 * rb);
            let mut ys: Vec<Q8Vec> = (0..19).map(|_| Q8Vec::from_slice(&rnd_vec(&mut seed, cols, 3.0))).collect();
            ys[4] = Q8Vec::from_slice(&vec![-1.0; cols]);
            ys[5] = Q8Vec::from_slice(&vec![1.0; cols]);
            for n in (1..=9).chain([16, 19]) {
                let yr: Vec<&Q8Vec> = ys[..n].iter().collect();
                let mut got = vec![[0f32; 8]; n];
                let mut next = 0;
                gemm_x8_tokens(dt, cols, group, &Q8Batch::new(&yr), |t0, d| {
                    assert_eq!(t0, next, "tokens out of order");
                    got[t0..t0 + d.len()].copy_from_slice(d);
                    next = t0 + d.len();
                });
                assert_eq!(next, n, "{dt}: {next} of {n} tokens delivered");
                for (t, row) in got.iter().enumerate() {
                    let yt = ys[t].bytes();
                    let [want] = match dt {
                        DType::Q4_0 => portable::gemm_x8_q4_0(cols, group, [yt]),
                        _ => portable::gemm_x8_q8_0(cols, group, [yt]),
                    };
                    let bits = |v: &[f32; 8]| v.map(f32::to_bits);
                    assert_eq!(bits(row), bits(&want), "{} {dt} token {t} of {n} at {cols} columns", isa());
                }
            }
        }
    }
}
