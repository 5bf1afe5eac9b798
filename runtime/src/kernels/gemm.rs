//! f32 matrix products of batches (prefill of Q8_0/f16/f32 weights and the
//! FFN's down projection) on borrowed row-major buffers, by nflash's own
//! tiles ([`super::panel_tile`]: [`PANEL`] output columns × up to
//! [`PANEL_TOKENS`] tokens per call). Weights are cut into panels of
//! [`PANEL`] output columns, each written once into `[depth, PANEL]` order
//! (copied, or dequantized there by the caller: [`x_fill`]);
//! activations are read in place, so nothing is packed per token. Rayon tasks take runs of panels, each against every
//! token. Quantized weights are dequantized tile by tile by the callers, so
//! the extra memory stays at one tile (about [`TILE_ELEMS`] × 4 bytes).
//!
//! It replaced the `gemm` crate here: that crate re-packed the activations
//! for every block of weight columns and its weights had already been
//! copied once by the dequantization (`pack_lhs` took 7.6% of a 512-token
//! Q8_0 prefill and zeroing its buffers 2.5%).

use rayon::prelude::*;

use super::{panel_tile, PANEL, PANEL_TOKENS};

/// Elements of one dequantized weight tile (4 MiB of f32).
pub const TILE_ELEMS: usize = 1 << 20;

/// Inputs from which batched (matmul) paths beat per-row dot products.
pub const MIN_BATCH: usize = 8;

/// Most panels one rayon task takes: 4 × 16 columns, whose activations
/// (up to [`PANEL_TOKENS`] rows) stay in L1 while each panel uses them.
const MAX_TASK_PANELS: usize = 4;

/// Writes the weights of output columns `j0 .. j0 + width` (`width` ≤
/// [`PANEL`]) into a panel: `w(i, j0 + c)` at `panel[i * PANEL + c]`.
pub type FillPanel<'a> = &'a (dyn Fn(usize, usize, &mut [f32]) + Sync);

/// Where the weight `w(i, j)` (depth `i`, output column `j`) of a product is.
#[derive(Clone, Copy)]
enum Weights<'a> {
    /// At `w[i * stride + j]`: rows run along the depth; copied panel by
    /// panel (read in place, each step of the depth touched a new cache line).
    Cols(&'a [f32], usize),
    /// Written panel by panel by the caller (dequantized, or copied
    /// from rows that are output features).
    Fill(FillPanel<'a>),
}

/// A row-major f32 destination `[rows, stride]` shared by parallel tasks
/// that each write their own columns: row `t` at `t * stride`, columns
/// `< cols` used.
#[derive(Clone, Copy)]
pub(crate) struct Dst {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    stride: usize,
}

impl Dst {
    /// The destination over `dst`: `rows` rows of `cols` used columns,
    /// `stride` elements apart.
    ///
    /// Panics if `dst` is too short or `cols > stride` (a caller bug).
    pub(crate) fn new(dst: &mut [f32], rows: usize, cols: usize, stride: usize) -> Self {
        assert!(cols <= stride, "destination: {cols} columns at stride {stride}");
        assert!(rows == 0 || dst.len() >= (rows - 1) * stride + cols, "destination too short");
        Dst { ptr: dst.as_mut_ptr(), rows, cols, stride }
    }

    /// Elements `j0 .. j0 + len` of row `t`.
    ///
    /// Panics if they lie outside the destination's `rows × cols`.
    ///
    /// # Safety
    /// No other live slice may cover them (tasks write disjoint columns),
    /// and the slice the destination was made from must outlive the result.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn row(&self, t: usize, j0: usize, len: usize) -> &mut [f32] {
        assert!(t < self.rows && j0 + len <= self.cols, "destination row {t} columns {j0}..{}", j0 + len);
        std::slice::from_raw_parts_mut(self.ptr.add(t * self.stride + j0), len)
    }
}

// SAFETY: every user hands each task a disjoint set of columns of `Dst`
// (`Dst::row`'s contract), and the exclusive borrow it was made from
// outlives the tasks.
unsafe impl Send for Dst {}
// SAFETY: as for Send: no two tasks touch the same element.
unsafe impl Sync for Dst {}

/// Panels per task: the largest of 1..=[`MAX_TASK_PANELS`] whose tasks
/// spread as evenly as the others over `threads` (the busiest thread's
/// panel count is what the product waits for).
fn task_panels(panels: usize, threads: usize) -> usize {
    (1..=MAX_TASK_PANELS).rev().min_by_key(|&p| panels.div_ceil(p).div_ceil(threads.max(1)) * p).unwrap_or(1)
}

/// `T` tokens of `x` (row `t` at `t * xs`) against one panel: `out[t][j]`.
fn tile(nt: usize, depth: usize, x: &[f32], xs: usize, w: &[f32], ws: usize) -> [[f32; PANEL]; PANEL_TOKENS] {
    let mut out = [[0f32; PANEL]; PANEL_TOKENS];
    match nt {
        1 => out[..1].copy_from_slice(&panel_tile::<1>(depth, x, xs, w, ws)),
        2 => out[..2].copy_from_slice(&panel_tile::<2>(depth, x, xs, w, ws)),
        3 => out[..3].copy_from_slice(&panel_tile::<3>(depth, x, xs, w, ws)),
        4 => out[..4].copy_from_slice(&panel_tile::<4>(depth, x, xs, w, ws)),
        5 => out[..5].copy_from_slice(&panel_tile::<5>(depth, x, xs, w, ws)),
        _ => out = panel_tile::<PANEL_TOKENS>(depth, x, xs, w, ws),
    }
    out
}

/// `dst[t, j] (+)= Σ_i x[t, i] · w(i, j)` for `t < n`, `j < cols`, `i <
/// depth`: `x` `[n, depth]` row-major, `dst` rows `dst_stride` apart. With
/// `accumulate` the product is added to `dst`, else it replaces it. Each
/// output is one [`panel_tile`] sum (the order of `portable::panel_tile`),
/// so a token's result does not depend on the batch or the thread count.
///
/// Panics if an addressed element lies outside its slice (a caller bug).
fn product(
    (n, cols, depth): (usize, usize, usize),
    dst: &mut [f32],
    dst_stride: usize,
    x: &[f32],
    w: Weights,
    accumulate: bool,
) {
    if n == 0 || cols == 0 {
        return;
    }
    assert!(x.len() >= n * depth, "product: activations too short");
    if let Weights::Cols(w, s) = w {
        assert!(s >= cols && (depth == 0 || w.len() >= (depth - 1) * s + cols), "product: weights too short");
    }
    let panels = cols.div_ceil(PANEL);
    let per_task = task_panels(panels, rayon::current_num_threads());
    let dst = Dst::new(dst, n, cols, dst_stride);
    let xs = depth.max(1);
    (0..panels.div_ceil(per_task)).into_par_iter().for_each_init(Vec::new, |buf: &mut Vec<f32>, task| {
        let p0 = task * per_task;
        let p1 = (p0 + per_task).min(panels);
        // The task's panels p0 .. p1, packed `[depth, PANEL]` one after another.
        let span = |p: usize| (p * PANEL, PANEL.min(cols - p * PANEL)); // (first column, width)
        buf.resize((p1 - p0) * depth * PANEL, 0.0);
        for (panel, p) in buf.chunks_exact_mut(depth * PANEL).zip(p0..p1) {
            let (j0, width) = span(p);
            // Columns past `width` are left as they are: no output reads them.
            match w {
                Weights::Cols(w, s) => {
                    for (i, row) in panel.chunks_exact_mut(PANEL).enumerate() {
                        copy_panel_row(&mut row[..width], &w[i * s + j0..i * s + j0 + width]);
                    }
                }
                Weights::Fill(fill) => fill(j0, width, panel),
            }
        }
        for t0 in (0..n).step_by(PANEL_TOKENS) {
            let nt = PANEL_TOKENS.min(n - t0);
            let xt = &x[t0 * depth..(t0 + nt) * depth];
            for (panel, p) in buf.chunks_exact(depth * PANEL).zip(p0..p1) {
                let (j0, width) = span(p);
                let r = tile(nt, depth, xt, xs, panel, PANEL);
                for (t, rt) in r[..nt].iter().enumerate() {
                    // SAFETY: this task alone writes the columns of panels
                    // p0 .. p1; `dst` borrows the caller's slice for the call.
                    let o = unsafe { dst.row(t0 + t, j0, width) };
                    if accumulate {
                        o.iter_mut().zip(rt).for_each(|(o, v)| *o += v);
                    } else {
                        copy_panel_row(o, &rt[..width]);
                    }
                }
            }
        }
    });
}

/// `dst.copy_from_slice(src)` for a panel row: a full one ([`PANEL`]
/// elements) as a fixed-size copy. A variable length made each 64-byte row
/// a `memcpy` call (12% of a 128-token prefill's GEMM time went to filling
/// panels and writing tiles out).
#[inline(always)]
fn copy_panel_row(dst: &mut [f32], src: &[f32]) {
    match (<&mut [f32; PANEL]>::try_from(&mut *dst), <&[f32; PANEL]>::try_from(src)) {
        (Ok(d), Ok(s)) => *d = *s,
        _ => dst.copy_from_slice(src),
    }
}

/// Writes `values` (`[depth]`: the weights of one output feature, such as a
/// dequantized row) as column `c` of a panel: `panel[i * PANEL + c]`.
///
/// Panics if the panel is shorter than `values` (a caller bug).
pub fn set_panel_column(panel: &mut [f32], c: usize, values: &[f32]) {
    assert!(c < PANEL, "panel column {c}");
    for (prow, &v) in panel.chunks_exact_mut(PANEL).zip(values) {
        prow[c] = v;
    }
}

/// `out[t, j] (+)= Σ_i x[t, i] · w(i, j)`: `x` `[n, k]`, `out` rows
/// `out_stride` elements apart, `j < m`, the weights written panel by
/// panel by `fill` (dequantized ×8 groups, [`super::group_to_panel`], or
/// rows that are output features, [`set_panel_column`]). With `accumulate`
/// the product is added to `out`, else it replaces it.
///
/// Panics if a slice is too short for its shape (a caller bug).
pub fn x_fill(
    x: &[f32],
    fill: FillPanel,
    (n, m, k): (usize, usize, usize),
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
) {
    product((n, m, k), out, out_stride, x, Weights::Fill(fill), accumulate);
}

/// `out[t, c] (+)= Σ_j a[t, j] · w[j, c]`: `a` `[n, m]`, `w` `[m, k]`, `out`
/// `[n, k]`; with `accumulate` the product is added to `out`.
///
/// Panics if a slice is too short for its shape (a caller bug).
pub fn aw(a: &[f32], w: &[f32], (n, m, k): (usize, usize, usize), out: &mut [f32], accumulate: bool) {
    product((n, k, m), out, k, a, Weights::Cols(w, k), accumulate);
}

/// `out[t, j] (+)= Σ_i x[t, i] · w[j, i]` for `w` `[m, k]` (rows are output
/// features), through [`x_fill`] and [`set_panel_column`]: the f32-weight
/// form the tests compare against naive loops and single tiles.
#[cfg(test)]
pub(crate) fn xwt(
    x: &[f32],
    w: &[f32],
    (n, m, k): (usize, usize, usize),
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
) {
    assert!(w.len() >= m * k, "xwt: weights too short");
    let rows = |j0: usize, width: usize, panel: &mut [f32]| {
        for c in 0..width {
            set_panel_column(panel, c, &w[(j0 + c) * k..(j0 + c + 1) * k]);
        }
    };
    x_fill(x, &rows, (n, m, k), out, out_stride, accumulate);
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
