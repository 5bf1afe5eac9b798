//! Typed views of packed weight rows and the dot products over them.
//!
//! Rows are stored exactly as GGML lays them out (SPEC §5), so the mapped
//! bytes are reinterpreted as candle-core's `BlockQ4_0`/`BlockQ8_0` and fed
//! to its SIMD `vec_dot` kernels.

use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ8_0, GgmlType};
use half::f16;
use nflash_format::interleave::{Q4_0X8_GROUP_BLOCK, Q4_0X8_ROWS};
use nflash_format::DType;
use rayon::prelude::*;

/// Reinterprets `bytes` as a slice of `T`.
///
/// Panics if `bytes` is misaligned for `T` or not a whole number of `T`s;
/// pack offsets are aligned by construction (SPEC §3–4), so this is a bug.
pub(crate) fn cast<T>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert!(
        bytes.as_ptr() as usize % std::mem::align_of::<T>() == 0 && bytes.len() % size == 0,
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
    F32(Vec<f32>),
    F16(Vec<f16>),
    Q8(Vec<BlockQ8_0>),
}

impl DotInput {
    /// An empty input for rows of `dtype`, to be filled by [`Self::set`].
    pub fn new(dtype: DType) -> Self {
        match dtype {
            DType::F32 => DotInput::F32(Vec::new()),
            DType::F16 => DotInput::F16(Vec::new()),
            DType::Q8_0 | DType::Q4_0 => DotInput::Q8(Vec::new()),
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
            DotInput::Q8(v) => {
                v.resize(x.len() / 32, BlockQ8_0::zeros());
                BlockQ8_0::from_float(x, v);
            }
        }
    }

    /// Convenience: a new input for `dtype` holding `x`.
    pub fn from_slice(dtype: DType, x: &[f32]) -> Self {
        let mut d = Self::new(dtype);
        d.set(x);
        d
    }
}

/// A matrix view `[rows, cols]` over packed bytes: row-major as in the pack
/// (SPEC §5), or for Q4_0 in the Q4_0×8 layout (SPEC §5.1) that
/// [`nflash_format::Pack::interleave_q4_0`] makes in memory.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    /// Storage type.
    pub dtype: DType,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features, elements per row).
    pub cols: usize,
    row_bytes: usize,
    /// Q4_0 rows in groups of 8 (`nflash_format::interleave`).
    interleaved: bool,
    data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// A view of `rows × cols` elements of `dtype` in `data`
    /// (`data.len() == rows * row_bytes(cols)`, checked by the caller's shape validation).
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Self {
        let row_bytes = dtype.row_bytes(cols as u64).expect("validated row length") as usize;
        assert_eq!(data.len(), rows * row_bytes, "weight view size");
        QMatrix {
            dtype,
            rows,
            cols,
            row_bytes,
            interleaved: false,
            data,
        }
    }

    /// A view of a Q4_0 matrix `[rows, cols]` in the Q4_0×8 layout
    /// (`nflash_format::interleave`; rows a multiple of 8, same byte size).
    pub fn q4_0x8(rows: usize, cols: usize, data: &'a [u8]) -> Self {
        assert!(nflash_format::interleave::can_interleave(rows as u64, cols as u64), "Q4_0×8 shape [{rows}, {cols}]");
        QMatrix {
            interleaved: true,
            ..Self::new(DType::Q4_0, rows, cols, data)
        }
    }

    /// Bytes of row `r` (row layout only).
    #[inline]
    fn row(&self, r: usize) -> &'a [u8] {
        debug_assert!(!self.interleaved);
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Bytes of the 8-row group holding row `r` (Q4_0×8 layout only).
    #[inline]
    fn group(&self, r: usize) -> &'a [u8] {
        let g = r / Q4_0X8_ROWS * Q4_0X8_ROWS * self.row_bytes;
        &self.data[g..g + Q4_0X8_ROWS * self.row_bytes]
    }

    /// Dot product of row `r` with a prepared input.
    #[inline]
    pub fn row_dot(&self, r: usize, x: &DotInput) -> f32 {
        if self.interleaved {
            return crate::simd::dot8_q4_0x8(self.cols, self.group(r), q8_input(x))[r % 8];
        }
        row_dot(self.dtype, self.cols, self.row(r), x)
    }

    /// `out[r] = row_r · x` for all rows, in parallel. `out`: `[rows]`.
    pub fn matvec(&self, x: &DotInput, out: &mut [f32]) {
        matvec_many(&[self], x, &mut [out]);
    }

    /// `out[i] = row_{r0+i} · x` for the rows `r0 .. r0 + out.len()`, four at
    /// a time for Q8 inputs, eight in the Q4_0×8 layout (`r0` and `out.len()`
    /// then multiples of 8).
    fn rows_into(&self, x: &DotInput, r0: usize, out: &mut [f32]) {
        if self.interleaved {
            debug_assert!(r0 % 8 == 0 && out.len() % 8 == 0);
            let y = q8_input(x);
            for (gi, o) in out.chunks_exact_mut(8).enumerate() {
                o.copy_from_slice(&crate::simd::dot8_q4_0x8(self.cols, self.group(r0 + 8 * gi), y));
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
                    o.copy_from_slice(&crate::simd::dot4(self.dtype, self.cols, rows, y));
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
    /// Rows are the outer loop so each weight row is read once for all inputs.
    pub fn matmul(&self, xs: &[DotInput], out: &mut [f32]) {
        let n = xs.len();
        debug_assert_eq!(out.len(), n * self.rows);
        if n == 1 {
            return self.matvec(&xs[0], out);
        }
        let rb = par_chunk(self.rows, 16).next_multiple_of(8);
        let mut tmp = vec![0f32; n * self.rows]; // [rows, n]
        tmp.par_chunks_mut(rb * n).enumerate().for_each(|(ci, chunk)| {
            if self.interleaved {
                // One 8-row group at a time, for every input while it is in cache.
                for (gi, g_out) in chunk.chunks_mut(8 * n).enumerate() {
                    let group = self.group(ci * rb + 8 * gi);
                    for (t, x) in xs.iter().enumerate() {
                        let d = crate::simd::dot8_q4_0x8(self.cols, group, q8_input(x));
                        for (i, v) in d.into_iter().enumerate() {
                            g_out[i * n + t] = v;
                        }
                    }
                }
                return;
            }
            // Four rows at a time through the same kernel as `matvec`, so a
            // token's result does not depend on the batch it is in.
            let quads = if matches!(xs[0], DotInput::Q8(_)) { chunk.len() / n / 4 } else { 0 };
            for (qi, q_out) in chunk.chunks_mut(4 * n).take(quads).enumerate() {
                let r = ci * rb + 4 * qi;
                let rows = [self.row(r), self.row(r + 1), self.row(r + 2), self.row(r + 3)];
                for (t, x) in xs.iter().enumerate() {
                    let d = crate::simd::dot4(self.dtype, self.cols, rows, q8_input(x));
                    for (i, v) in d.into_iter().enumerate() {
                        q_out[i * n + t] = v;
                    }
                }
            }
            for (i, row_out) in chunk.chunks_mut(n).enumerate().skip(4 * quads) {
                let r = ci * rb + i;
                for (t, o) in row_out.iter_mut().enumerate() {
                    *o = self.row_dot(r, &xs[t]);
                }
            }
        });
        for r in 0..self.rows {
            for t in 0..n {
                out[t * self.rows + r] = tmp[r * n + t];
            }
        }
    }

    /// `out[t, r] = row_r · x[t]` for `n` f32 inputs `x` (`[n, cols]`), by
    /// dequantizing row tiles and multiplying with candle-core's matmul.
    /// `out`: `[n, rows]`. Used for batches of at least [`crate::matmul::MIN_BATCH`].
    pub fn matmul_f32(&self, x: &[f32], out: &mut [f32]) -> crate::error::Result<()> {
        let n = x.len() / self.cols;
        let xt = crate::matmul::input(x, n, self.cols)?;
        let tile = (crate::matmul::TILE_ELEMS / self.cols).clamp(1, self.rows);
        for r0 in (0..self.rows).step_by(tile) {
            let m = tile.min(self.rows - r0);
            let mut w = vec![0f32; m * self.cols];
            w.par_chunks_mut(self.cols)
                .enumerate()
                .for_each(|(i, row)| self.row_to_f32(r0 + i, row));
            let y = crate::matmul::matmul_xwt(&xt, w, m, self.cols)?; // [n, m]
            for t in 0..n {
                out[t * self.rows + r0..t * self.rows + r0 + m].copy_from_slice(&y[t * m..(t + 1) * m]);
            }
        }
        Ok(())
    }

    /// Dequantizes row `r` into `out` (`[cols]`).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        if !self.interleaved {
            return row_to_f32(self.dtype, self.row(r), out);
        }
        let (g, i) = (self.group(r), r % 8);
        for (blk, o) in g.chunks_exact(Q4_0X8_GROUP_BLOCK).zip(out.chunks_exact_mut(32)) {
            let d = f16::from_le_bytes([blk[2 * i], blk[2 * i + 1]]).to_f32();
            let (lo, hi) = o.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&blk[16 + 16 * i..32 + 16 * i]) {
                *l = d * ((q & 0x0F) as i32 - 8) as f32;
                *h = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
    }
}

/// The Q8_0 blocks of an input for Q4_0 rows.
fn q8_input(x: &DotInput) -> &[BlockQ8_0] {
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
/// (a whole Q4_0×8 group); panics otherwise (a caller bug).
pub fn matvec_many_from(mats: &[&QMatrix], r0: usize, x: &DotInput, outs: &mut [&mut [f32]]) {
    assert!(r0 % Q4_0X8_ROWS == 0, "first row {r0} is not a multiple of {Q4_0X8_ROWS}");
    let total: usize = mats.iter().map(|m| m.rows - r0).sum();
    // Multiples of 8: whole groups of the Q4_0×8 layout, whole quads otherwise.
    let chunk = par_chunk(total, 16).next_multiple_of(8);
    // Nested parallel iterators rather than a task list: no allocation per call.
    outs.par_iter_mut().enumerate().for_each(|(mi, out)| {
        debug_assert_eq!(out.len(), mats[mi].rows - r0);
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(ci, c)| mats[mi].rows_into(x, r0 + ci * chunk, c));
    });
}

/// Rows per parallel task: about four tasks per thread, at least `min`,
/// so small matrices are not split into tasks that cost more than they do.
pub fn par_chunk(rows: usize, min: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads()).max(min)
}

/// Dot of one packed row (`cols` elements of `dtype`) with a prepared input.
#[inline]
pub fn row_dot(dtype: DType, cols: usize, row: &[u8], x: &DotInput) -> f32 {
    match (dtype, x) {
        (DType::F32, DotInput::F32(v)) => f32::vec_dot(cols, cast::<f32>(row), v),
        (DType::F16, DotInput::F16(v)) => f16::vec_dot(cols, cast::<f16>(row), v),
        (DType::Q8_0, DotInput::Q8(v)) => BlockQ8_0::vec_dot(cols, cast::<BlockQ8_0>(row), v),
        (DType::Q4_0, DotInput::Q8(v)) => BlockQ4_0::vec_dot(cols, cast::<BlockQ4_0>(row), v),
        _ => panic!("dot input prepared for another dtype than {dtype}"),
    }
}

/// Dequantizes one packed row into `out`.
pub fn row_to_f32(dtype: DType, row: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => out.copy_from_slice(cast::<f32>(row)),
        DType::F16 => f16::to_float(cast::<f16>(row), out),
        DType::Q8_0 => BlockQ8_0::to_float(cast::<BlockQ8_0>(row), out),
        DType::Q4_0 => BlockQ4_0::to_float(cast::<BlockQ4_0>(row), out),
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
        DType::Q8_0 | DType::Q4_0 => crate::simd::axpy(dtype, row, a, out),
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
            std::slice::from_raw_parts(
                blocks.as_ptr() as *const u8,
                blocks.len() * std::mem::size_of::<T>(),
            )
        };
        out.extend_from_slice(bytes);
    }
    match dtype {
        DType::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::Q8_0 => push::<BlockQ8_0>(x, out),
        DType::Q4_0 => push::<BlockQ4_0>(x, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
