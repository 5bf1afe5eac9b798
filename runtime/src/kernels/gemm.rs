//! Batched f32 matrix products for prefill, through candle-core's CPU matmul
//! (the `gemm` crate). Quantized weights are dequantized tile by tile, so
//! the extra memory stays at one tile (about [`TILE_ELEMS`] × 4 bytes).

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// Elements of one dequantized weight tile (4 MiB of f32).
pub const TILE_ELEMS: usize = 1 << 20;

/// Inputs from which batched (matmul) paths beat per-row dot products.
pub const MIN_BATCH: usize = 8;

fn tensor(data: Vec<f32>, rows: usize, cols: usize) -> Result<Tensor> {
    Tensor::from_vec(data, (rows, cols), &Device::Cpu).map_err(candle_err)
}

fn candle_err(e: candle_core::Error) -> Error {
    Error::Internal(format!("matmul: {e}"))
}

/// `x · wᵀ`: `x` `[n, k]`, `w` `[m, k]` (rows are output features) → `[n, m]`.
pub fn matmul_xwt(x: &Tensor, w: Vec<f32>, m: usize, k: usize) -> Result<Vec<f32>> {
    let w = tensor(w, m, k)?;
    let y = x.matmul(&w.t().map_err(candle_err)?).map_err(candle_err)?;
    y.flatten_all().and_then(|t| t.to_vec1()).map_err(candle_err)
}

/// `a · w`: `a` `[n, m]`, `w` `[m, k]` → `[n, k]`.
pub fn matmul_aw(a: Vec<f32>, n: usize, w: Vec<f32>, m: usize, k: usize) -> Result<Vec<f32>> {
    let a = tensor(a, n, m)?;
    let w = tensor(w, m, k)?;
    let y = a.matmul(&w).map_err(candle_err)?;
    y.flatten_all().and_then(|t| t.to_vec1()).map_err(candle_err)
}

/// Wraps `x` `[n, k]` as a tensor (one copy).
pub fn input(x: &[f32], n: usize, k: usize) -> Result<Tensor> {
    tensor(x.to_vec(), n, k)
}
