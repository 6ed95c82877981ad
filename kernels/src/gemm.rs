//! Prefill matmul: weights dequantized in row tiles, then cuBLAS.
//!
//! Two precisions. [`Gpu::matmul`]: f32 tiles + SGEMM (no TF32: cuBLAS' default math mode), so
//! prefill logits stay within f32 summation error of the CPU (the exact path). [`Gpu::matmul_bf16`]:
//! bf16 tiles and bf16 activations on the tensor cores with f32 accumulation and output (the
//! fast path): each operand is rounded once to bf16 (relative error <= 2^-9), so a product of
//! length K moves by at most 2^-8 * sum_k |w_k x_k| (both operands rounded), typically
//! 2^-8 / sqrt(3) * ||w|| ||x|| / sqrt(K)-scaled: ~1e-3..1e-2 relative (gpu-kernels.md §2).

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::dequant::RawWeight;
use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::gemv::MatShape;
use crate::launch::shape_err;

/// Scratch budget for one dequantized weight tile.
const TILE_BYTES: usize = 256 << 20;

/// The cuBLAS precision of a matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prec {
    F32,
    Bf16,
}

impl Gpu {
    /// `y[n, r] = sum_k x[n, k] * W[r, k]` for `tokens` rows of x (`[tokens, k]`, dense) into y
    /// (`[tokens, rows]`, dense), in f32. Multiplies by the first slab of a stack.
    pub fn matmul(
        &self,
        shape: MatShape,
        w: &impl DevicePtr<u8>,
        x: &impl DevicePtr<f32>,
        tokens: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        self.matmul_prec(shape, 0, w, x, tokens, y, Prec::F32)
    }

    /// As [`Gpu::matmul`] on the bf16 tensor cores (f32 accumulation and output).
    pub fn matmul_bf16(
        &self,
        shape: MatShape,
        w: &impl DevicePtr<u8>,
        x: &impl DevicePtr<f32>,
        tokens: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        self.matmul_prec(shape, 0, w, x, tokens, y, Prec::Bf16)
    }

    /// [`Gpu::matmul_bf16`] by slab `slab` of a stack of `shape.slabs` matrices (one expert of
    /// `ffn_*_exps`, in the GGUF or the repacked layout): the grouped expert GEMM of prefill,
    /// called once per expert with that expert's gathered tokens.
    pub fn matmul_bf16_slab(
        &self,
        shape: MatShape,
        slab: usize,
        w: &impl DevicePtr<u8>,
        x: &impl DevicePtr<f32>,
        tokens: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        self.matmul_prec(shape, slab, w, x, tokens, y, Prec::Bf16)
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_prec(
        &self,
        shape: MatShape,
        slab: usize,
        w: &impl DevicePtr<u8>,
        x: &impl DevicePtr<f32>,
        tokens: usize,
        y: &mut impl DevicePtrMut<f32>,
        prec: Prec,
    ) -> Result<(), KernelError> {
        const OP: &str = "matmul";
        shape.check(OP, dlen(w))?;
        let MatShape {
            ty,
            rows,
            k,
            slabs,
            packed,
        } = shape;
        if slab >= slabs || tokens == 0 {
            return Err(shape_err(
                OP,
                format!("{shape:?} slab {slab} x {tokens} tokens"),
            ));
        }
        need_len(OP, "x", dlen(x), tokens * k)?;
        need_len(OP, "y", dlen(y), tokens * rows)?;
        let esz = match prec {
            Prec::F32 => 4,
            Prec::Bf16 => 2,
        };
        let tile_rows = (TILE_BYTES / (k * esz)).clamp(1, rows);
        let blas_h = *self.blas()?.handle();
        let s = self.stream();
        let (wp, _g1) = w.device_ptr(s);
        let (xp, _g2) = x.device_ptr(s);
        let (yp, _g3) = y.device_ptr_mut(s);
        let mut scratch = self.alloc::<u8>(tile_rows * k * esz)?;
        let sp = scratch.ptr();
        // bf16: the activations converted once for all tiles.
        let xb = match prec {
            Prec::F32 => None,
            Prec::Bf16 => {
                let mut b = self.alloc::<u16>(tokens * k)?;
                self.to_bf16(x, &mut b, tokens * k)?;
                Some(b)
            }
        };
        let (n_tok, k32, ldc) = (
            to_i32(OP, "tokens", tokens)?,
            to_i32(OP, "k", k)?,
            to_i32(OP, "rows", rows)?,
        );
        let raw = RawWeight {
            ty,
            packed,
            base: wp,
            nblk: shape.blocks(),
        };
        let bpr = k / crate::quant::decoder_block(ty).0;
        // Blocks before this slab (slabs are `rows * bpr` blocks each, in either layout: the
        // repacked one addresses blocks by their index in the whole stack).
        let blk0 = slab * rows * bpr;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let mut r0 = 0usize;
        while r0 < rows {
            let rt = tile_rows.min(rows - r0);
            // SAFETY: rows r0..r0+rt of W lie within w (checked), scratch holds tile_rows * k.
            unsafe { self.dequant_raw(raw, blk0 + r0 * bpr, rt * k, sp, prec == Prec::Bf16)? };
            let m = to_i32(OP, "tile rows", rt)?;
            let yc = (yp + (r0 * 4) as u64) as *mut f32;
            let t0 = self.prof_start()?;
            // Column-major view: C[rt x tokens] (ldc = rows, starting at column offset r0 of y's
            // rows) = A^T[rt x k] * B[k x tokens], A = the tile (row-major [rt, k]), B = x^T.
            // SAFETY: all pointers cover the extents named by m/n/k/ld (checked above).
            let r = match &xb {
                None => unsafe {
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
                        yc,
                        ldc,
                    )
                },
                Some(xb) => unsafe {
                    gemm_bf16(
                        blas_h,
                        (m, n_tok, k32),
                        (sp, k32, 0),
                        (xb.ptr(), k32, 0),
                        (yc as u64, ldc, 0),
                        1,
                    )
                },
            };
            self.prof_stop("gemm", t0)?;
            r.map_err(|source| KernelError::Cublas {
                what: if xb.is_some() {
                    "cublasGemmEx"
                } else {
                    "cublasSgemm"
                },
                source,
            })?;
            self.launched(OP, Ok::<(), cudarc::driver::DriverError>(()))?;
            r0 += rt;
        }
        let _ = &mut scratch;
        Ok(())
    }

    /// Per-head matmul on the tensor cores: `y[t, h*m + r] = sum_j x[t, h*k + j] * W_h[r, j]`
    /// for the `shape.slabs` heads of a 3-D weight (`attn_k_b` / `attn_v_b` in prefill), x
    /// `[tokens, heads * k]`, y `[tokens, heads * m]`. The activations are converted to bf16
    /// once, the heads dequantized to bf16 together (tiled to the scratch budget) and multiplied
    /// by one strided-batched GEMM per tile (f32 accumulation): the same bf16 rounding as
    /// [`Gpu::matmul_bf16`], without one launch per (head, 8 tokens).
    pub fn matmul_heads_bf16(
        &self,
        shape: MatShape,
        w: &impl DevicePtr<u8>,
        x: &impl DevicePtr<f32>,
        tokens: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "matmul_heads";
        shape.check(OP, dlen(w))?;
        let MatShape {
            ty,
            rows: m,
            k,
            slabs: nh,
            packed,
        } = shape;
        if tokens == 0 {
            return Err(shape_err(OP, format!("{shape:?} x 0 tokens")));
        }
        need_len(OP, "x", dlen(x), tokens * nh * k)?;
        need_len(OP, "y", dlen(y), tokens * nh * m)?;
        let per_head = m * k * 2;
        let tile_heads = (TILE_BYTES / per_head).clamp(1, nh);
        let blas_h = *self.blas()?.handle();
        let s = self.stream();
        let (wp, _g1) = w.device_ptr(s);
        let (yp, _g3) = y.device_ptr_mut(s);
        let mut scratch = self.alloc::<u8>(tile_heads * per_head)?;
        let sp = scratch.ptr();
        let mut xb = self.alloc::<u16>(tokens * nh * k)?;
        self.to_bf16(x, &mut xb, tokens * nh * k)?;
        let (n_tok, m32, k32) = (
            to_i32(OP, "tokens", tokens)?,
            to_i32(OP, "rows", m)?,
            to_i32(OP, "k", k)?,
        );
        let (ldb, ldc) = (to_i32(OP, "x cols", nh * k)?, to_i32(OP, "y cols", nh * m)?);
        let raw = RawWeight {
            ty,
            packed,
            base: wp,
            nblk: shape.blocks(),
        };
        let bpr = k / crate::quant::decoder_block(ty).0;
        let mut h0 = 0usize;
        while h0 < nh {
            let ht = tile_heads.min(nh - h0);
            // SAFETY: heads h0..h0+ht lie within w (checked), scratch holds tile_heads heads.
            unsafe { self.dequant_raw(raw, h0 * m * bpr, ht * m * k, sp, true)? };
            let t0 = self.prof_start()?;
            // Batch h (column-major): C_h [m x tokens] at y + h*m, ldc = heads*m; A_h^T with
            // A_h the head's row-major [m, k] tile (lda = k, stride m*k); B_h = x_h^T at
            // x + h*k, ldb = heads*k.
            // SAFETY: every batch's extents lie within scratch, xb and y (checked above).
            let r = unsafe {
                gemm_bf16(
                    blas_h,
                    (m32, n_tok, k32),
                    (sp, k32, (m * k) as i64),
                    (xb.ptr() + (h0 * k * 2) as u64, ldb, k as i64),
                    (yp + (h0 * m * 4) as u64, ldc, m as i64),
                    to_i32(OP, "heads", ht)?,
                )
            };
            self.prof_stop("gemm", t0)?;
            r.map_err(|source| KernelError::Cublas {
                what: "cublasGemmStridedBatchedEx",
                source,
            })?;
            self.launched(OP, Ok::<(), cudarc::driver::DriverError>(()))?;
            h0 += ht;
        }
        let _ = &mut scratch;
        Ok(())
    }
}

/// `C = A^T B` on bf16 operands with f32 accumulation and output, cuBLAS' column-major view:
/// `(m, n, k)`, then `(pointer, leading dimension, batch stride)` of A (`[k x m]`), B
/// (`[k x n]`) and C (`[m x n]`, f32); `batch` > 1 runs the strided-batched form.
///
/// # Safety
/// Every batch's extents must lie within the buffers the pointers name.
unsafe fn gemm_bf16(
    h: blas_sys::cublasHandle_t,
    (m, n, k): (i32, i32, i32),
    (a, lda, sa): (u64, i32, i64),
    (b, ldb, sb): (u64, i32, i64),
    (c, ldc, sc): (u64, i32, i64),
    batch: i32,
) -> Result<(), cudarc::cublas::result::CublasError> {
    use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (al, be) = (
        &alpha as *const f32 as *const _,
        &beta as *const f32 as *const _,
    );
    let (ct, algo) = (
        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
    );
    let (a, b, c) = (a as *const _, b as *const _, c as *mut _);
    // SAFETY: the caller's contract.
    unsafe {
        if batch == 1 {
            blas::gemm_ex(
                h,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                m,
                n,
                k,
                al,
                a,
                CUDA_R_16BF,
                lda,
                b,
                CUDA_R_16BF,
                ldb,
                be,
                c,
                CUDA_R_32F,
                ldc,
                ct,
                algo,
            )
        } else {
            blas::gemm_strided_batched_ex(
                h,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                m,
                n,
                k,
                al,
                a,
                CUDA_R_16BF,
                lda,
                sa,
                b,
                CUDA_R_16BF,
                ldb,
                sb,
                be,
                c,
                CUDA_R_32F,
                ldc,
                sc,
                batch,
                ct,
                algo,
            )
        }
    }
}
