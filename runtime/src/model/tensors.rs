//! Typed views of a pack's resident tensors, each checked by name and
//! shape (formats/SPEC.md §4.3): the lowest layer of the model, used by
//! `load.rs` (weights) and `predictor.rs` (predictors).

use nflash_format::{DType, Pack};

use crate::error::{Error, Result};
use crate::kernels::QMatrix;

/// Tensor `name` of `pack` with its dtype and bytes, its shape checked.
///
/// # Errors
/// [`Error::MissingTensor`], [`Error::Shape`].
fn tensor<'a>(pack: &'a Pack, name: &str, shape: &[u64]) -> Result<(DType, &'a [u8])> {
    let (t, bytes) = pack.tensor(name).map_err(|e| match e {
        nflash_format::Error::NotFound { .. } => Error::MissingTensor { name: name.to_string() },
        e => e.into(),
    })?;
    if t.shape != shape {
        return Err(Error::Shape {
            name: name.into(),
            expected: shape.to_vec(),
            found: t.shape.clone(),
            dtype: t.dtype,
        });
    }
    Ok((t.dtype, bytes))
}

/// A view of matrix `name` `[rows, cols]` (in the Q4_0×8 layout if the pack
/// reordered it in memory, formats/SPEC.md §5.1).
///
/// # Errors
/// As [`tensor`].
pub(crate) fn matrix<'a>(pack: &'a Pack, name: &str, rows: u64, cols: u64) -> Result<QMatrix<'a>> {
    let (dt, bytes) = tensor(pack, name, &[rows, cols])?;
    if pack.is_interleaved(name) {
        return Ok(QMatrix::x8(dt, rows as usize, cols as usize, bytes));
    }
    Ok(QMatrix::new(dt, rows as usize, cols as usize, bytes))
}

/// Vector `name` `[len]` as f32.
///
/// # Errors
/// As [`tensor`].
pub(crate) fn vector(pack: &Pack, name: &str, len: u64) -> Result<Vec<f32>> {
    let (dt, bytes) = tensor(pack, name, &[len])?;
    let mut out = vec![0f32; len as usize];
    crate::kernels::row_to_f32(dt, bytes, &mut out);
    Ok(out)
}

/// [`vector`] when `present`, else `None`.
pub(crate) fn opt_vector(pack: &Pack, name: &str, len: u64, present: bool) -> Result<Option<Vec<f32>>> {
    if present {
        vector(pack, name, len).map(Some)
    } else {
        Ok(None)
    }
}
