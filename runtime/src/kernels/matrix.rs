//! [`QMatrix`]: a typed view `[rows, cols]` of packed weights, and the
//! matrix-vector and small-batch products over it, parallel over row
//! blocks (rayon) and four or eight rows per kernel call.

use nflash_format::interleave::X8_ROWS;
use nflash_format::DType;
use rayon::prelude::*;

use super::gemm::Dst;
use super::{DotInput, Q8Vec};

/// A matrix view `[rows, cols]` over packed bytes: row-major as in the pack
/// (SPEC §5), or for Q4_0 and Q8_0 in the ×8 layout (SPEC §5.1) that
/// [`nflash_format::Pack::interleave`] makes in memory.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    /// Storage type.
    pub dtype: DType,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features, elements per row).
    pub cols: usize,
    row_bytes: usize,
    /// Rows in groups of 8 (`nflash_format::interleave`).
    x8: bool,
    data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// A view of `rows × cols` elements of `dtype` in `data`
    /// (`data.len() == rows * row_bytes(cols)`, checked by the caller's shape validation).
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Self {
        let row_bytes = dtype.row_bytes(cols as u64).expect("validated row length") as usize;
        assert_eq!(data.len(), rows * row_bytes, "weight view size");
        QMatrix { dtype, rows, cols, row_bytes, x8: false, data }
    }

    /// A view of a Q4_0 or Q8_0 matrix `[rows, cols]` in the ×8 layout
    /// (`nflash_format::interleave`; rows a multiple of 8, same byte size).
    pub fn x8(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Self {
        assert!(
            nflash_format::interleave::can_interleave(dtype, rows as u64, cols as u64),
            "{dtype}×8 shape [{rows}, {cols}]"
        );
        QMatrix { x8: true, ..Self::new(dtype, rows, cols, data) }
    }

    /// Bytes of row `r` (row layout only).
    #[inline]
    pub(crate) fn row(&self, r: usize) -> &'a [u8] {
        debug_assert!(!self.x8);
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Bytes of the 8-row group holding row `r` (×8 layout only).
    #[inline]
    fn group(&self, r: usize) -> &'a [u8] {
        let g = r / X8_ROWS * X8_ROWS * self.row_bytes;
        &self.data[g..g + X8_ROWS * self.row_bytes]
    }

    /// Dot product of row `r` with a prepared input.
    #[inline]
    pub fn row_dot(&self, r: usize, x: &DotInput) -> f32 {
        if self.x8 {
            return super::gemm_x8(self.dtype, self.cols, self.group(r), [q8_input(x)])[0][r % X8_ROWS];
        }
        super::row_dot(self.dtype, self.cols, self.row(r), x)
    }

    /// `out[r] = row_r · x` for all rows, in parallel. `out`: `[rows]`.
    pub fn matvec(&self, x: &DotInput, out: &mut [f32]) {
        matvec_many(&[self], x, &mut [out]);
    }

    /// `out[i] = row_{r0+i} · x` for the rows `r0 .. r0 + out.len()`, four at
    /// a time for Q8 inputs, eight in the ×8 layout (`r0` and `out.len()`
    /// then multiples of 8).
    fn rows_into(&self, x: &DotInput, r0: usize, out: &mut [f32]) {
        if self.x8 {
            debug_assert!(r0.is_multiple_of(X8_ROWS) && out.len().is_multiple_of(X8_ROWS));
            let y = q8_input(x);
            for (gi, o) in out.chunks_exact_mut(X8_ROWS).enumerate() {
                let [d] = super::gemm_x8(self.dtype, self.cols, self.group(r0 + X8_ROWS * gi), [y]);
                o.copy_from_slice(&d);
            }
            return;
        }
        match x {
            DotInput::Q8(y) => {
                let done = out.len() / 4 * 4;
                let mut quads = out.chunks_exact_mut(4);
                for (qi, o) in (&mut quads).enumerate() {
                    let r = r0 + 4 * qi;
                    let rows = [self.row(r), self.row(r + 1), self.row(r + 2), self.row(r + 3)];
                    o.copy_from_slice(&super::dot4(self.dtype, self.cols, rows, y));
                }
                for (i, o) in quads.into_remainder().iter_mut().enumerate() {
                    *o = self.row_dot(r0 + done + i, x);
                }
            }
            _ => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = self.row_dot(r0 + i, x);
                }
            }
        }
    }

    /// `out[t, r] = row_r · xs[t]` for `n = xs.len()` inputs. `out`: `[n, rows]`.
    /// Parallel over row blocks; each weight row is read once for all inputs:
    /// in the ×8 layout, [`super::gemm_x8`] takes 8 rows × 4 tokens per call
    /// (the quantized GEMM of prefill), otherwise four rows at a time per
    /// token. Each token gets the bits [`Self::matvec`] gives it, whatever
    /// the batch.
    pub fn matmul(&self, xs: &[DotInput], out: &mut [f32]) {
        let n = xs.len();
        debug_assert_eq!(out.len(), n * self.rows);
        if n == 1 {
            return self.matvec(&xs[0], out);
        }
        if self.x8 {
            let ys: Vec<&Q8Vec> = xs.iter().map(q8_input).collect();
            return self.x8_products(Acts::Q8(&super::Q8Batch::new(&ys)), out);
        }
        let rb = par_chunk(self.rows, 16).next_multiple_of(X8_ROWS);
        let dst = Dst::new(out, n, self.rows, self.rows);
        (0..self.rows.div_ceil(rb)).into_par_iter().for_each(|ci| {
            let (r0, r1) = (ci * rb, (ci * rb + rb).min(self.rows));
            // Four rows at a time through the same kernel as `matvec`.
            let q8 = matches!(xs[0], DotInput::Q8(_));
            let mut r = r0;
            while q8 && r + 4 <= r1 {
                let rows = [self.row(r), self.row(r + 1), self.row(r + 2), self.row(r + 3)];
                for (t, x) in xs.iter().enumerate() {
                    let d = super::dot4(self.dtype, self.cols, rows, q8_input(x));
                    // SAFETY: this task alone writes rows r0 .. r1 (columns of `out`).
                    unsafe { dst.row(t, r, 4) }.copy_from_slice(&d);
                }
                r += 4;
            }
            for r in r..r1 {
                for (t, x) in xs.iter().enumerate() {
                    // SAFETY: as above.
                    let o = unsafe { dst.row(t, r, 1) };
                    o[0] = self.row_dot(r, x);
                }
            }
        });
    }

    /// `out[t, r] = row_r · x[t]` (`out`: `[n, rows]`) by the ×8 kernels:
    /// groups of 8 rows in parallel, each against every token
    /// ([`gemm_tokens`], writing its 8 columns of `out` in place); a matrix
    /// in the row layout (rows a multiple of 8) has each group packed on the
    /// fly, so both layouts give the same bits.
    fn x8_products(&self, acts: Acts, out: &mut [f32]) {
        let n = acts.len();
        let rb = par_chunk(self.rows, 16).next_multiple_of(X8_ROWS);
        let dst = Dst::new(out, n, self.rows, self.rows);
        (0..self.rows.div_ceil(rb)).into_par_iter().for_each_init(Vec::new, |buf, ci| {
            for r in (ci * rb..(ci * rb + rb).min(self.rows)).step_by(X8_ROWS) {
                let group = if self.x8 {
                    self.group(r)
                } else {
                    buf.resize(X8_ROWS * self.row_bytes, 0);
                    let rows = std::array::from_fn(|i| Some(self.row(r + i)));
                    nflash_format::interleave::pack_group(self.dtype, self.cols, rows, buf);
                    &buf[..]
                };
                // SAFETY: this task alone writes the columns of its rows.
                unsafe { gemm_tokens(self.dtype, self.cols, group, acts, &dst, r, X8_ROWS) };
            }
        });
    }

    /// `out[t, r] = row_r · x[t]` for `n` f32 inputs `x` (`[n, cols]`) into
    /// `out` (`[n, rows]`), by dequantizing the weights panel by panel into
    /// the f32 product of [`super::gemm`] (no copy of the whole matrix); up to
    /// [`DIRECT_F32_TOKENS`] tokens of a Q4_0/Q8_0 matrix with rows in
    /// groups of 8, by `gemm_x8_f32` on the quantized weights instead
    /// ([`direct_f32`]; the same bits in either layout). For f32/f16 weights
    /// and Q8_0 prefill (quantized GEMM otherwise: [`Self::matmul`]).
    pub fn matmul_f32(&self, x: &[f32], out: &mut [f32]) {
        let (n, cols) = (x.len() / self.cols, self.cols);
        if direct_f32(self.dtype, self.rows, cols, n) {
            let xs: Vec<&[f32]> = x.chunks_exact(cols).collect();
            return self.x8_products(Acts::F32(&xs), out);
        }
        // Weights dequantized straight into the product's panels: ×8 groups
        // two per panel, rows one column at a time.
        let fill = |j0: usize, width: usize, panel: &mut [f32]| {
            if self.x8 {
                for h in (0..width).step_by(X8_ROWS) {
                    super::group_to_panel(self.dtype, cols, self.group(j0 + h), &mut panel[h..], super::PANEL);
                }
                return;
            }
            let mut row = vec![0f32; cols];
            for c in 0..width {
                super::row_to_f32(self.dtype, self.row(j0 + c), &mut row);
                super::gemm::set_panel_column(panel, c, &row);
            }
        };
        super::gemm::x_fill(x, &fill, (n, self.rows, cols), out, self.rows, false)
    }

    /// Dequantizes row `r` into `out` (`[cols]`).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        if !self.x8 {
            return super::row_to_f32(self.dtype, self.row(r), out);
        }
        let mut buf = vec![0u8; self.row_bytes];
        nflash_format::interleave::x8_row(self.dtype, self.group(r), self.cols, r % X8_ROWS, &mut buf);
        super::row_to_f32(self.dtype, &buf, out)
    }
}

/// Prompts of at most this many tokens multiply f32 activations with ×8
/// weights directly (`kernels::gemm_x8_f32`); longer ones dequantize each
/// weight once into f32 panels for all tokens ([`super::gemm`]). Measured on
/// SmolLM2 q8_0, 2 threads: 16 tokens 100 → 146 tokens/s, 40 tokens the
/// same speed either way.
pub const DIRECT_F32_TOKENS: usize = 32;

/// Whether `n` f32 tokens against a `dtype` matrix `[rows, cols]` go
/// through `kernels::gemm_x8_f32` ([`DIRECT_F32_TOKENS`] at most, a shape
/// with ×8 groups) rather than through dequantized panels and
/// [`super::gemm`]. The two sum in different orders, so the choice depends
/// on the shape alone, never on the CPU: a row-layout matrix (a CPU without
/// the ×8 kernels, or `NFLASH_KERNELS=portable`) packs its groups on the
/// fly, and every CPU computes the same bits.
pub(crate) fn direct_f32(dtype: DType, rows: usize, cols: usize, n: usize) -> bool {
    n <= DIRECT_F32_TOKENS && nflash_format::interleave::can_interleave(dtype, rows as u64, cols as u64)
}

/// The tokens of a batch, as a ×8 kernel takes them.
#[derive(Clone, Copy)]
pub(crate) enum Acts<'a> {
    /// Quantized to Q8_0 (`kernels::gemm_x8_tokens`).
    Q8(&'a super::Q8Batch<'a>),
    /// Exact f32 rows `[cols]` (`kernels::gemm_x8_f32`).
    F32(&'a [&'a [f32]]),
}

impl Acts<'_> {
    /// Tokens.
    pub(crate) fn len(&self) -> usize {
        match self {
            Acts::Q8(y) => y.len(),
            Acts::F32(x) => x.len(),
        }
    }
}

/// One ×8 group (`cols` elements per row) against every token of `acts`,
/// into columns `c0 .. c0 + width` of `dst` (`[n, ·]`: row `i`'s dot with
/// token `t` at `dst[t, c0 + i]`, `width` ≤ 8 of the group's rows kept):
/// Q8_0 tokens by [`super::gemm_x8_tokens`], f32 tokens eight
/// per call, then 4, 2, 1.
///
/// Panics if the columns lie outside `dst` or `width` > 8 (caller bugs).
///
/// # Safety
/// No other task may write those columns of `dst` during the call
/// ([`Dst::row`]).
pub(crate) unsafe fn gemm_tokens(
    dtype: DType,
    cols: usize,
    group: &[u8],
    acts: Acts,
    dst: &Dst,
    c0: usize,
    width: usize,
) {
    assert!(width <= X8_ROWS, "×8 group output of {width} columns");
    let put = |t0: usize, d: &[[f32; X8_ROWS]]| {
        for (t, row) in d.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { dst.row(t0 + t, c0, width) }.copy_from_slice(&row[..width]);
        }
    };
    let n = acts.len();
    match acts {
        Acts::Q8(ys) => super::gemm_x8_tokens(dtype, cols, group, ys, put),
        Acts::F32(xs) => {
            let mut t0 = 0;
            while t0 < n {
                let x = &xs[t0..];
                let k = match n - t0 {
                    8.. => 8,
                    4..=7 => 4,
                    2 | 3 => 2,
                    _ => 1,
                };
                match k {
                    8 => put(t0, &super::gemm_x8_f32::<8>(dtype, cols, group, std::array::from_fn(|t| x[t]))),
                    4 => put(t0, &super::gemm_x8_f32::<4>(dtype, cols, group, std::array::from_fn(|t| x[t]))),
                    2 => put(t0, &super::gemm_x8_f32::<2>(dtype, cols, group, [x[0], x[1]])),
                    _ => put(t0, &super::gemm_x8_f32::<1>(dtype, cols, group, [x[0]])),
                }
                t0 += k;
            }
        }
    }
}

/// The Q8_0 vector of an input for Q4_0/Q8_0 rows.
pub(crate) fn q8_input(x: &DotInput) -> &Q8Vec {
    match x {
        DotInput::Q8(y) => y,
        _ => panic!("dot input prepared for another dtype than Q4_0/Q8_0"),
    }
}

/// `outs[i] = mats[i] · x` (`[mats[i].rows]` each) for matrices sharing one
/// prepared input, as a single parallel region (decode runs Q, K and V this
/// way: one fork–join instead of three).
pub fn matvec_many(mats: &[&QMatrix], x: &DotInput, outs: &mut [&mut [f32]]) {
    matvec_many_from(mats, 0, x, outs);
}

/// [`matvec_many`] over the rows `r0 ..` of each matrix only: `outs[i]` is
/// `[mats[i].rows - r0]`, `outs[i][j] = row_{r0+j} · x`. `r0`: a multiple of 8
/// (a whole ×8 group); panics otherwise (a caller bug).
pub fn matvec_many_from(mats: &[&QMatrix], r0: usize, x: &DotInput, outs: &mut [&mut [f32]]) {
    assert!(r0.is_multiple_of(X8_ROWS), "first row {r0} is not a multiple of {X8_ROWS}");
    let total: usize = mats.iter().map(|m| m.rows - r0).sum();
    // Multiples of 8: whole groups of the ×8 layout, whole quads otherwise.
    let chunk = par_chunk(total, 16).next_multiple_of(8);
    // Nested parallel iterators rather than a task list: no allocation per call.
    outs.par_iter_mut().enumerate().for_each(|(mi, out)| {
        debug_assert_eq!(out.len(), mats[mi].rows - r0);
        out.par_chunks_mut(chunk).enumerate().for_each(|(ci, c)| mats[mi].rows_into(x, r0 + ci * chunk, c));
    });
}

/// Rows per parallel task: about four tasks per thread, at least `min`,
/// so small matrices are not split into tasks that cost more than they do.
pub fn par_chunk(rows: usize, min: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads()).max(min)
}
