//! Activation-by-weight products with the weight in its GGUF type: weight rows are dequantized
//! on the fly, one block of output rows per rayon task, and each dequantized row is dotted with
//! every activation row so that a batch of tokens shares one pass over the weight bytes.

use crate::weights::{dequantize, HostWeight};
use crate::RuntimeError;
use rayon::prelude::*;

/// Multiply-adds per rayon task at least: below this, scheduling costs more than the work
/// (a decode step of a small model would otherwise spend its time waking threads).
const MIN_TASK_WORK: usize = 1 << 16;
/// Weight rows per task at most, so that large matrices spread over every core.
const MAX_ROWS_PER_TASK: usize = 16;

/// f32 dot product with 8 independent accumulators (vectorizes; summation order differs from
/// a sequential sum by normal f32 rounding only).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

fn backend_err(w: &HostWeight, msg: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Backend(format!("{}: {msg}", w.name()))
}

/// `x` (`[n, k]`, row-major) times weight rows `row0 .. row0 + m` (each of length `k`)
/// transposed: returns `[n, m]`.
pub fn matmul_rows(
    x: &[f32],
    n: usize,
    w: &HostWeight,
    row0: usize,
    m: usize,
) -> Result<Vec<f32>, RuntimeError> {
    let k = w.row_len();
    if x.len() != n * k {
        return Err(backend_err(
            w,
            format!(
                "activation has {} values, expected {n} rows of {k}",
                x.len()
            ),
        ));
    }
    if row0 + m > w.n_rows() {
        return Err(backend_err(
            w,
            format!("rows {row0}..{} of {}", row0 + m, w.n_rows()),
        ));
    }
    let rb = w.row_bytes();
    let ty = w.ty();
    // out_t is [m, n]: each task owns whole weight rows.
    let rows_per_task = MAX_ROWS_PER_TASK.max(MIN_TASK_WORK / (k * n).max(1));
    let mut out_t = vec![0f32; m * n];
    out_t
        .par_chunks_mut(rows_per_task * n.max(1))
        .enumerate()
        .try_for_each_init(
            || vec![0f32; k],
            |buf, (c, chunk)| -> Result<(), RuntimeError> {
                let first = row0 + c * rows_per_task;
                for (r, out_row) in chunk.chunks_mut(n.max(1)).enumerate() {
                    let row = first + r;
                    let src = w.row_data(row);
                    if src.len() != rb {
                        return Err(backend_err(
                            w,
                            format!("row {row} outside the weight's bytes"),
                        ));
                    }
                    dequantize(ty, src, buf).map_err(|e| backend_err(w, e))?;
                    for (i, o) in out_row.iter_mut().enumerate().take(n) {
                        *o = dot(&x[i * k..(i + 1) * k], buf);
                    }
                }
                Ok(())
            },
        )?;
    if n == 1 {
        return Ok(out_t);
    }
    let mut out = vec![0f32; n * m];
    for j in 0..m {
        for i in 0..n {
            out[i * m + j] = out_t[j * n + i];
        }
    }
    Ok(out)
}

/// Dequantized rows `rows` of a weight, concatenated.
pub fn dequant_rows(w: &HostWeight, rows: &[usize]) -> Result<Vec<f32>, RuntimeError> {
    let k = w.row_len();
    let mut out = vec![0f32; rows.len() * k];
    for (o, &r) in out.chunks_mut(k.max(1)).zip(rows) {
        let src = w.row_data(r);
        if r >= w.n_rows() || src.len() != w.row_bytes() {
            return Err(backend_err(w, format!("row {r} of {}", w.n_rows())));
        }
        dequantize(w.ty(), src, o).map_err(|e| backend_err(w, e))?;
    }
    Ok(out)
}
