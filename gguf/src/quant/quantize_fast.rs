//! Bulk quantization: many rows at once over rayon's pool, each row by the scalar oracle
//! ([`super::quantize::quantize_row`]), so the result is bit-identical to quantizing the rows
//! one by one on one thread (rows are independent in every ggml quantizer). Work is split in
//! row chunks of at least [`super::TASK_ELEMS`] values so scheduling is noise even for the
//! 256-column tensors of small models.

use super::quantize::{check, quantize_row};
use super::QuantError;
use crate::GgmlType;
use rayon::prelude::*;

/// Quantize `src` (rows of `n_per_row`) into `out` in parallel. `imatrix(row)` gives the
/// importance weights of a row (its expert's slice), or `None`.
pub fn quantize_rows_par<'a>(
    ty: GgmlType,
    src: &[f32],
    n_per_row: usize,
    imatrix: &(dyn Fn(usize) -> Option<&'a [f32]> + Sync),
    out: &mut [u8],
) -> Result<(), QuantError> {
    check(ty, src, n_per_row, None, out)?;
    if n_per_row == 0 || src.is_empty() {
        return Ok(());
    }
    let row_bytes = n_per_row / ty.block_size() * ty.type_size();
    let rows_per_task = super::TASK_ELEMS.div_ceil(n_per_row).max(1);
    src.par_chunks(rows_per_task * n_per_row)
        .zip(out.par_chunks_mut(rows_per_task * row_bytes))
        .enumerate()
        .try_for_each(|(task, (x, y))| {
            for (r, (xr, yr)) in x
                .chunks_exact(n_per_row)
                .zip(y.chunks_exact_mut(row_bytes))
                .enumerate()
            {
                let qw = imatrix(task * rows_per_task + r);
                if let Some(w) = qw {
                    if w.len() != n_per_row {
                        return Err(QuantError::ImatrixLength {
                            ty,
                            n_per_row,
                            got: w.len(),
                        });
                    }
                }
                quantize_row(ty, xr, qw, yr)?;
            }
            Ok(())
        })
}

#[cfg(test)]
mod tests {
    use super::super::quantize::quantize_rows;
    use super::*;

    /// Deterministic pseudo-random values with a heavy-ish tail, some exact zeros and one
    /// all-zero block, so every branch of the searches runs.
    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
                if (256..288).contains(&i) || i % 97 == 0 {
                    0.0
                } else {
                    u * u * u * 8.0 + u * 0.1
                }
            })
            .collect()
    }

    #[test]
    fn parallel_equals_the_oracle_for_every_type() {
        let n_per_row = 512;
        let rows = 300; // > one task, last task partial
        let x = data(n_per_row * rows, 7);
        let w: Vec<f32> = data(n_per_row, 11).iter().map(|v| v.abs() + 0.01).collect();
        for ty in GgmlType::ALL {
            if !super::super::quantize::can_quantize(ty) {
                continue;
            }
            let bytes = rows * n_per_row / ty.block_size() * ty.type_size();
            for with_w in [false, true] {
                if !with_w && super::super::quantize::requires_imatrix(ty) {
                    continue;
                }
                let mut a = vec![0u8; bytes];
                let mut b = vec![0u8; bytes];
                let qw = with_w.then_some(w.as_slice());
                quantize_rows(ty, &x, n_per_row, qw, &mut a).unwrap_or_else(|e| panic!("{e}"));
                quantize_rows_par(ty, &x, n_per_row, &|_| qw, &mut b)
                    .unwrap_or_else(|e| panic!("{e}"));
                assert!(a == b, "{ty} (imatrix: {with_w})");
            }
        }
    }
}
