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
        let rows: Vec<Vec<u64>> =
            (0..4).map(|_| quantized(dt, &(0..cols).map(|_| rnd()).collect::<Vec<_>>())).collect();
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

/// Whatever kernel [`dot4`], [`dot8_q4_0x8`], [`axpy`] and [`axpy2`]
/// dispatch to on this CPU gives the bits of the portable reference.
#[test]
fn dispatched_kernels_match_portable_bit_for_bit() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut seed = 99u32;
    for cols in [32usize, 96, 576, 1536] {
        let x = rnd_vec(&mut seed, cols, 3.0);
        let mut y = vec![BlockQ8_0::zeros(); cols / 32];
        BlockQ8_0::from_float(&x, &mut y);
        let yb = q8_bytes(&y);
        for dt in [DType::Q4_0, DType::Q8_0] {
            let rows: Vec<Vec<u64>> = (0..8).map(|_| quantized(dt, &rnd_vec(&mut seed, cols, 1.0))).collect();
            let rb = dt.row_bytes(cols as u64).unwrap() as usize;
            let r: Vec<&[u8]> = rows.iter().map(|v| view(v, rb)).collect();
            let quad = [r[0], r[1], r[2], r[3]];
            let (got, want) = match dt {
                DType::Q4_0 => (dot4(dt, cols, quad, &y), portable::dot4_q4_0(cols, quad, yb)),
                _ => (dot4(dt, cols, quad, &y), portable::dot4_q8_0(cols, quad, yb)),
            };
            assert_eq!(bits(&got), bits(&want), "{} dot4 at {cols} columns", isa());
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
            if dt == DType::Q4_0 {
                let mut group: Vec<u8> = r.iter().flat_map(|row| row.iter().copied()).collect();
                nflash_format::interleave::interleave_q4_0(&mut group, cols, &mut Vec::new());
                let g = aligned(&group);
                let d8 = dot8_q4_0x8(cols, view(&g, group.len()), &y);
                assert_eq!(bits(&d8), bits(&portable::dot8_q4_0x8(cols, view(&g, group.len()), yb)), "dot8 at {cols}");
                // The interleaved group gives each row the bits of the row layout.
                assert_eq!(bits(&d8[..4]), bits(&want), "dot8 vs dot4 at {cols}");
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

/// The Q4_0×8 layout gives the same bits as the row layout in every
/// batch path: decode matvec (fused Q/K/V), small-batch matmul, and
/// dequantized rows (embedding lookups, prefill tiles).
#[test]
fn interleaved_q4_0_matches_the_row_layout_bit_for_bit() {
    let (rows, cols) = (40, 96);
    let mut seed = 5u32;
    let mut rnd = || {
        seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
        (seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
    };
    let mut bytes = Vec::new();
    for _ in 0..rows {
        let w: Vec<f32> = (0..cols).map(|_| rnd()).collect();
        quantize_row(DType::Q4_0, &w, &mut bytes);
    }
    let mut words = vec![0u64; bytes.len().div_ceil(8)];
    // SAFETY: `words` has at least `bytes.len()` bytes.
    let rowl = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, bytes.len()) };
    rowl.copy_from_slice(&bytes);
    let mut inter = bytes.clone();
    nflash_format::interleave::interleave_q4_0(&mut inter, cols, &mut Vec::new());
    let a = QMatrix::new(DType::Q4_0, rows, cols, rowl);
    let b = QMatrix::q4_0x8(rows, cols, &inter);
    let xs: Vec<DotInput> = (0..3)
        .map(|_| DotInput::from_slice(DType::Q4_0, &(0..cols).map(|_| rnd() * 3.0).collect::<Vec<_>>()))
        .collect();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let (mut oa, mut ob) = (vec![0f32; rows], vec![0f32; rows]);
    a.matvec(&xs[0], &mut oa);
    b.matvec(&xs[0], &mut ob);
    assert_eq!(bits(&oa), bits(&ob), "matvec");
    let (mut qa, mut ka, mut qb, mut kb) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
    matvec_many(&[&a, &a], &xs[1], &mut [&mut qa, &mut ka]);
    matvec_many(&[&b, &b], &xs[1], &mut [&mut qb, &mut kb]);
    assert_eq!((bits(&qa), bits(&ka)), (bits(&qb), bits(&kb)), "matvec_many");
    let (mut ma, mut mb) = (vec![0f32; 3 * rows], vec![0f32; 3 * rows]);
    a.matmul(&xs, &mut ma);
    b.matmul(&xs, &mut mb);
    assert_eq!(bits(&ma), bits(&mb), "matmul");
    let (mut da, mut db) = (vec![0f32; cols], vec![0f32; cols]);
    for r in [0, 7, 8, 21, 39] {
        // One row alone goes through candle-core's kernel in the row layout.
        let (p, q) = (a.row_dot(r, &xs[2]), b.row_dot(r, &xs[2]));
        assert!((p - q).abs() <= 1e-5 * p.abs().max(1.0), "row_dot {r}: {p} vs {q}");
        a.row_to_f32(r, &mut da);
        b.row_to_f32(r, &mut db);
        assert_eq!(bits(&da), bits(&db), "row_to_f32 {r}");
    }
    // And the AVX2 kernel agrees with the portable one (and candle-core) to rounding.
    let want = BlockQ4_0::vec_dot(cols, cast::<BlockQ4_0>(a.row(9)), q8_input(&xs[0]));
    assert!((ob[9] - want).abs() <= 1e-4 * want.abs().max(1.0), "{} vs {want}", ob[9]);
}
