//! Prefill matmul: weights dequantized to f32 in row tiles, then cuBLAS SGEMM.
//!
//! Why f32 and not bf16 tensor cores: the tiny fixtures and the CPU reference are f32, and
//! SGEMM (no TF32: cuBLAS' default math mode) keeps prefill logits within f32 summation error
//! of the CPU, so greedy continuations can be compared token for token. The bf16 path
//! (dequantize_bf16 + GemmEx) is the speed option for long prompts on large models.

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::gemv::MatShape;
use crate::launch::shape_err;

/// Scratch budget for one dequantized weight tile.
const TILE_BYTES: usize = 256 << 20;

impl Gpu {
    /// `y[n, r] = sum_k x[n, k] * W[r, k]` for `tokens` rows of x (`[tokens, k]`, dense) into y
    /// (`[tokens, rows]`, dense). `shape.slabs` must be 1.
    pub fn matmul(
        &self,
        shape: MatShape,
        w: &impl DevicePtr<u8>,
        x: &impl DevicePtr<f32>,
        tokens: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "matmul";
        let MatShape { ty, rows, k, slabs } = shape;
        if slabs != 1 || rows == 0 || k == 0 || tokens == 0 {
            return Err(shape_err(OP, format!("{shape:?} x {tokens} tokens")));
        }
        if !k.is_multiple_of(32) || !k.is_multiple_of(ty.block_size()) {
            return Err(shape_err(
                OP,
                format!("row length {k} is not a multiple of 32 and of the {ty} block"),
            ));
        }
        let row_bytes = shape
            .row_bytes()
            .ok_or_else(|| shape_err(OP, "row size overflows"))?;
        need_len(
            OP,
            "w",
            dlen(w),
            shape
                .bytes()
                .ok_or_else(|| shape_err(OP, "size overflows"))?,
        )?;
        need_len(OP, "x", dlen(x), tokens * k)?;
        need_len(OP, "y", dlen(y), tokens * rows)?;
        // Any row starts on a block boundary with the block alignment of the tensor base.
        let tile_rows = (TILE_BYTES / (k * 4)).clamp(1, rows);
        let mut scratch = self.zeros::<f32>(tile_rows * k)?;
        let blas_h = *self.blas()?.handle();
        let s = self.stream();
        let (wp, _g1) = w.device_ptr(s);
        let (xp, _g2) = x.device_ptr(s);
        let (yp, _g3) = y.device_ptr_mut(s);
        let (sp, _g4) = scratch.device_ptr_mut(s);
        let (n_tok, k32, ldc) = (
            to_i32(OP, "tokens", tokens)?,
            to_i32(OP, "k", k)?,
            to_i32(OP, "rows", rows)?,
        );
        let (alpha, beta) = (1.0f32, 0.0f32);
        let mut r0 = 0usize;
        while r0 < rows {
            let rt = tile_rows.min(rows - r0);
            // SAFETY: rows r0..r0+rt of W lie within w (checked), scratch holds tile_rows * k.
            unsafe { self.dequant_raw(ty, wp + (r0 * row_bytes) as u64, rt * k, sp)? };
            let m = to_i32(OP, "tile rows", rt)?;
            // Column-major view: C[rt x tokens] (ldc = rows, starting at column offset r0 of y's
            // rows) = A^T[rt x k] * B[k x tokens], A = the tile (row-major [rt, k]), B = x^T.
            // SAFETY: all pointers cover the extents named by m/n/k/ld (checked above).
            unsafe {
                blas::sgemm(
                    blas_h,
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n_tok,
                    k32,
                    &alpha,
                    sp as *const f32,
                    k32,
                    xp as *const f32,
                    k32,
                    &beta,
                    (yp + (r0 * 4) as u64) as *mut f32,
                    ldc,
                )
            }
            .map_err(|source| KernelError::Cublas {
                what: "cublasSgemm",
                source,
            })?;
            self.launched(OP, Ok::<(), cudarc::driver::DriverError>(()))?;
            r0 += rt;
        }
        Ok(())
    }
}
