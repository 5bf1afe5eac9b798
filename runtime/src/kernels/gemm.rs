//! f32 matrix products of batches (prefill of Q8_0/f16/f32 weights and the
//! FFN's down projection), through the `gemm` crate (candle-core's matmul)
//! on borrowed row-major buffers: no tensor, no copy, and the product can
//! be written into a strided destination or added to it. Quantized weights
//! are dequantized tile by tile by the callers, so the extra memory stays at
//! one tile (about [`TILE_ELEMS`] × 4 bytes).

use gemm::Parallelism;

/// Elements of one dequantized weight tile (4 MiB of f32).
pub const TILE_ELEMS: usize = 1 << 20;

/// Inputs from which batched (matmul) paths beat per-row dot products.
pub const MIN_BATCH: usize = 8;

/// The thread pool the products split over: rayon's, as the rest of nflash.
fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// A row-major operand: its elements, and the distance between consecutive
/// elements along `(columns, rows)` of the matrix it plays.
type Operand<'a> = (&'a [f32], (isize, isize));

/// `dst (+)= lhs · rhs` with `dst` `[rows, cols]` (row stride `dst_rs`),
/// `lhs` `[rows, depth]`, `rhs` `[depth, cols]`, strides as given.
///
/// Panics if an addressed element lies outside its slice (a caller bug).
fn product(
    (rows, cols, depth): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    lhs: Operand,
    rhs: Operand,
    accumulate: bool,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    // The last element each operand addresses, from its strides (all ≥ 0 here).
    let last = |(cs, rs): (isize, isize), r: usize, c: usize| (r - 1) * rs as usize + (c - 1) * cs as usize;
    assert!(dst.len() > last((1, dst_rs as isize), rows, cols));
    assert!(depth == 0 || (lhs.0.len() > last(lhs.1, rows, depth) && rhs.0.len() > last(rhs.1, depth, cols)));
    // SAFETY: the asserts keep every element the strides address inside
    // `dst`, `lhs` and `rhs`; `dst` is an exclusive borrow, so it aliases
    // neither operand.
    unsafe {
        gemm::gemm(
            rows,
            cols,
            depth,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.0.as_ptr(),
            lhs.1 .0,
            lhs.1 .1,
            rhs.0.as_ptr(),
            rhs.1 .0,
            rhs.1 .1,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        )
    }
}

/// `out[t, j] (+)= Σ_i x[t, i] · w[j, i]`: `x` `[n, k]`, `w` `[m, k]` (rows
/// are output features), `out` rows `out_stride` elements apart, `m` used
/// (`out[t * out_stride + j]`, `j < m`). With `accumulate` the product is
/// added to `out`, else it replaces it.
///
/// Panics if a slice is too short for its shape (a caller bug).
pub fn xwt(
    x: &[f32],
    w: &[f32],
    (n, m, k): (usize, usize, usize),
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
) {
    assert!(out_stride >= m);
    // wᵀ [k, m]: element (i, j) at w[j * k + i].
    product((n, m, k), out, out_stride, (x, (1, k as isize)), (w, (k as isize, 1)), accumulate);
}

/// `out[t, c] (+)= Σ_j a[t, j] · w[j, c]`: `a` `[n, m]`, `w` `[m, k]`, `out`
/// `[n, k]`; with `accumulate` the product is added to `out`.
///
/// Panics if a slice is too short for its shape (a caller bug).
pub fn aw(a: &[f32], w: &[f32], (n, m, k): (usize, usize, usize), out: &mut [f32], accumulate: bool) {
    product((n, k, m), out, k, (a, (1, m as isize)), (w, (1, k as isize)), accumulate);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], n: usize, m: usize, k: usize, bt: bool) -> Vec<f32> {
        // a [n, k]; b [m, k] (bt) or [k, m].
        (0..n)
            .flat_map(|t| {
                (0..m).map(move |j| (0..k).map(|i| a[t * k + i] * if bt { b[j * k + i] } else { b[i * m + j] }).sum())
            })
            .collect()
    }

    #[test]
    fn products_match_a_naive_loop_with_strides_and_accumulation() {
        let v = |n: usize, s: f32| (0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) * s).collect::<Vec<f32>>();
        let (n, m, k) = (5, 7, 9);
        let (x, w) = (v(n * k, 0.1), v(m * k, 0.2));
        // xwt into columns 2..2+m of a [n, 12] buffer, then accumulated again.
        let mut out = vec![1f32; n * 12];
        xwt(&x, &w, (n, m, k), &mut out[2..], 12, false);
        let want = naive(&x, &w, n, m, k, true);
        for t in 0..n {
            assert_eq!(out[t * 12], 1.0);
            for j in 0..m {
                assert!((out[t * 12 + 2 + j] - want[t * m + j]).abs() < 1e-4);
            }
        }
        xwt(&x, &w, (n, m, k), &mut out[2..], 12, true);
        assert!((out[12 + 3] - 2.0 * want[m + 1]).abs() < 1e-4);
        // aw: a [n, m] · w [m, k].
        let (a, w2) = (v(n * m, 0.3), v(m * k, 0.1));
        let mut o = vec![0.5f32; n * k];
        aw(&a, &w2, (n, m, k), &mut o, true);
        let want = naive(&a, &w2, n, k, m, false);
        for (g, w) in o.iter().zip(&want) {
            assert!((g - 0.5 - w).abs() < 1e-4, "{g} vs {w}");
        }
    }

    #[test]
    #[should_panic]
    fn a_short_output_is_refused_before_the_product() {
        let (x, w) = (vec![1f32; 2 * 3], vec![1f32; 4 * 3]);
        // [2, 4] needs 8 elements at stride 4.
        xwt(&x, &w, (2, 4, 3), &mut [0f32; 7], 4, false);
    }
}
