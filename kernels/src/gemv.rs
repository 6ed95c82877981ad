//! Quantized matrix-vector products for decode, reading each weight byte once in its GGUF format.
//!
//! Choice: f32 activations with weights dequantized in registers (not llama.cpp's q8_1 + dp4a).
//! At batch 1 the kernel is bound by weight bytes, and unpack + scale + one FMA per weight fits
//! the ALU budget (~4 lane-instructions per Q4_K weight at full HBM rate, gpu-kernels.md §1.4),
//! so integer dot products buy no speed there; what f32 activations buy is exactness: the products
//! use the very values `gguf::quant::reference::dequantize` produces, so the GPU agrees with the
//! CPU oracle to f32 summation rounding (~1e-6 relative) instead of q8_1's ~1e-3..1e-2, and greedy
//! decoding on the GPU follows the CPU reference token for token. A q8_1/dp4a variant is the
//! planned path for batches of 2-8 tokens, where FMAs per weight multiply.

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut};
use gguf::GgmlType;

use crate::dequant::check_aligned;
use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::ops::Op;
use crate::quant::{block_alignment, type_kernels};

/// From this many rows on, a block computes 4 rows (activation reuse); below it 1 row per block
/// keeps enough blocks in flight for small matrices (kv_a: 576 rows).
const MULTI_ROW_MIN: usize = 2048;

/// A stack of `slabs` matrices of `rows x k` elements of type `ty`, stored back to back in GGUF
/// order (experts of `ffn_*_exps`, heads of `attn_k_b` / `attn_v_b`); `slabs = 1` for a plain matrix.
#[derive(Debug, Clone, Copy)]
pub struct MatShape {
    pub ty: GgmlType,
    pub rows: usize,
    pub k: usize,
    pub slabs: usize,
}

impl MatShape {
    pub fn new(ty: GgmlType, rows: usize, k: usize) -> Self {
        MatShape {
            ty,
            rows,
            k,
            slabs: 1,
        }
    }

    /// Bytes of one row, `None` when `k` is not a whole number of blocks.
    pub fn row_bytes(&self) -> Option<usize> {
        self.ty.row_bytes(self.k as u64).map(|b| b as usize)
    }

    /// Bytes of one slab.
    pub fn slab_bytes(&self) -> Option<usize> {
        self.row_bytes()?.checked_mul(self.rows)
    }

    /// Bytes of the whole stack.
    pub fn bytes(&self) -> Option<usize> {
        self.slab_bytes()?.checked_mul(self.slabs)
    }
}

/// How the channels of a batched GEMV pick their inputs and weights.
#[derive(Debug, Clone, Copy)]
pub struct Channels<'a> {
    /// Number of independent GEMVs (grid.y).
    pub count: usize,
    /// Expert id per channel (`ids[ch]` selects the slab); `None`: channel `ch` uses slab
    /// `ch % slabs` (per-head matrices for every token, or one matrix for several tokens).
    pub ids: Option<&'a CudaView<'a, i32>>,
    /// Channel `ch` reads its input at `x + (ch / x_div) * x_stride` (e.g. `x_div = top_k` lets
    /// all expert slots of a token share that token's input).
    pub x_stride: usize,
    pub x_div: usize,
    /// Channel `ch` writes `rows` outputs at `y + ch * y_stride`.
    pub y_stride: usize,
}

impl Gpu {
    /// `y[r] = sum_k W[r, k] * x[k]` for a single matrix.
    pub fn gemv(
        &self,
        shape: MatShape,
        w: &impl DevicePtr<u8>,
        x: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        let ch = Channels {
            count: 1,
            ids: None,
            x_stride: 0,
            x_div: 1,
            y_stride: 0,
        };
        self.gemv_batched(shape, w, ch, x, y)
    }

    /// Channel-batched GEMV: `y[ch][r] = sum_k W_{e(ch)}[r, k] * x_{ch / x_div}[k]` with
    /// `e(ch) = ids[ch]` or `ch`. One launch covers all selected experts of a MoE layer (only their
    /// slabs are read) or all heads of an absorption matrix.
    pub fn gemv_batched(
        &self,
        shape: MatShape,
        w: &impl DevicePtr<u8>,
        ch: Channels<'_>,
        x: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "gemv";
        let MatShape { ty, rows, k, slabs } = shape;
        let bad = |msg: String| KernelError::BadShape { op: OP, msg };
        if rows == 0 || k == 0 || slabs == 0 || ch.count == 0 {
            return Err(bad(format!(
                "empty shape {shape:?} x {} channels",
                ch.count
            )));
        }
        if !k.is_multiple_of(32) || !k.is_multiple_of(ty.block_size()) {
            return Err(bad(format!(
                "row length {k} is not a multiple of 32 and of the {ty} block ({})",
                ty.block_size()
            )));
        }
        if ch.x_div == 0 {
            return Err(bad("x_div must be at least 1".into()));
        }
        if !ch.x_stride.is_multiple_of(4) {
            return Err(bad(format!(
                "x stride {} is not a multiple of 4 floats",
                ch.x_stride
            )));
        }
        let row_bytes = shape
            .row_bytes()
            .ok_or_else(|| bad(format!("{shape:?} overflows")))?;
        let slab_bytes = shape
            .slab_bytes()
            .ok_or_else(|| bad(format!("{shape:?} overflows")))?;
        let total = shape
            .bytes()
            .ok_or_else(|| bad(format!("{shape:?} overflows")))?;
        need_len(OP, "w", dlen(w), total)?;
        let x_need = ((ch.count - 1) / ch.x_div) * ch.x_stride + k;
        need_len(OP, "x", dlen(x), x_need)?;
        let y_need = (ch.count - 1) * ch.y_stride + rows;
        need_len(OP, "y", dlen(y), y_need)?;
        if let Some(ids) = ch.ids {
            need_len(OP, "ids", ids.len(), ch.count)?;
        }
        let (name, rows_per_block) = if rows >= MULTI_ROW_MIN {
            (type_kernels(ty).gemv4, 4)
        } else {
            (type_kernels(ty).gemv, 1)
        };
        let f = self.func(Op::Gemv, name)?;
        let tables = self.tables()?.params;
        let grid = (rows.div_ceil(rows_per_block) as u64, ch.count as u64, 1u64);
        let cfg = self.cfg(OP, grid, 128)?;
        let stream = self.stream();
        let (wp, _gw) = w.device_ptr(stream);
        let (xp, _gx) = x.device_ptr(stream);
        let (yp, _gy) = y.device_ptr_mut(stream);
        let ip = match ch.ids {
            Some(ids) => ids.device_ptr(stream).0,
            None => 0u64,
        };
        check_aligned(OP, "w", wp, block_alignment(ty))?;
        check_aligned(OP, "x", xp, 16)?;
        let rb = row_bytes as i64;
        let nrows = to_i32(OP, "rows", rows)?;
        let k32 = to_i32(OP, "k", k)?;
        let ws = slab_bytes as i64;
        let nslabs = to_i32(OP, "slabs", slabs)?;
        let xs = ch.x_stride as i64;
        let xd = to_i32(OP, "x_div", ch.x_div)?;
        let ys = ch.y_stride as i64;
        let mut b = self.args(&f);
        b.arg(&wp)
            .arg(&rb)
            .arg(&nrows)
            .arg(&k32)
            .arg(&ws)
            .arg(&ip)
            .arg(&nslabs)
            .arg(&xp)
            .arg(&xs)
            .arg(&xd)
            .arg(&yp)
            .arg(&ys)
            .arg(&tables);
        // SAFETY: buffer extents checked above for every channel; expert ids are range-checked
        // in the kernel (out-of-range ids write NaN rows and read nothing).
        unsafe { self.launch(OP, b, cfg) }
    }
}
