//! Matrix-vector products for decode with f32 activations (the exact path): every weight byte is
//! read once in its device layout and decoded in registers by the same decoders as the dequant
//! op, so the result equals an f32 oracle up to summation order (~1e-6 relative) and greedy
//! decoding follows the CPU reference token for token. Every GGUF type has it. The fast path for
//! the main types is [`crate::gemvq`] (q8 activations, integer dot products).

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, DeviceRepr};
use gguf::GgmlType;

use crate::dequant::check_aligned;
use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::ops::Op;
use crate::quant::{block_alignment, type_kernels, WMat};

/// The coalesced F32 kernel (gemv.cu; one entry, not one per type).
pub(crate) const GEMVC_F32: &str = "gemvc_f32";

/// From this many rows on, a lane computes 4 rows (activation reuse); below it 1 row per lane
/// keeps enough blocks in flight for small matrices (kv_a: 576 rows).
const MULTI_ROW_MIN: usize = 2048;

/// The f32-activation GEMV's kernel variant for a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GemvVariant {
    /// 4 rows per lane group (`gemv4_`).
    FourRows,
    /// One row per lane group, one warp's lanes over K (`gemv_`).
    OneRow,
    /// One row per lane group, the block's 4 warps over K (`gemvs_`).
    KSplit,
    /// Plain F32 rows, one per block, read coalesced by the block's threads (`gemvc_f32`).
    Coalesced,
}

/// Large matrices take 4 rows per lane group; one whose one-row blocks would not give every SM
/// a block (the MoE router's 256 F32 rows: 64 blocks on 132 SMs, 6.3 MB in 16.8 us, 13% of the
/// copy bandwidth, H100 timeline of 2026-12-07) splits K over the block's warps, 4x the blocks
/// and loads in flight; the rest one row per group.
/// `ksplit` false ([`Gpu::set_gemv_ksplit`], `GGUFTOOL_GEMV_KSPLIT=0`) keeps the one-row kernel
/// there.
/// `coalesced`: plain F32 rows that can be read as float4s take `gemvc_f32` there instead
/// ([`Gpu::set_gemv_coalesced`]).
fn gemv_variant(
    rows: usize,
    lpr: usize,
    count: usize,
    sms: usize,
    (ksplit, coalesced): (bool, bool),
) -> GemvVariant {
    if rows >= MULTI_ROW_MIN {
        GemvVariant::FourRows
    } else if ksplit && rows.div_ceil(4 * (32 / lpr)) * count.min(65_535) < sms {
        if coalesced {
            GemvVariant::Coalesced
        } else {
            GemvVariant::KSplit
        }
    } else {
        GemvVariant::OneRow
    }
}

/// A stack of `slabs` matrices of `rows x k` elements of type `ty`, stored back to back
/// (experts of `ffn_*_exps`, heads of `attn_k_b` / `attn_v_b`); `slabs = 1` for a plain matrix.
/// `packed`: the tensor is in the repacked device layout (`crate::repack`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatShape {
    pub ty: GgmlType,
    pub rows: usize,
    pub k: usize,
    pub slabs: usize,
    pub packed: bool,
}

impl MatShape {
    pub fn new(ty: GgmlType, rows: usize, k: usize) -> Self {
        MatShape {
            ty,
            rows,
            k,
            slabs: 1,
            packed: false,
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

    /// Decoder blocks of the whole stack.
    pub(crate) fn blocks(&self) -> usize {
        let qb = crate::quant::decoder_block(self.ty).0;
        self.rows * self.slabs * (self.k / qb)
    }

    /// The common checks of every GEMV: non-empty, whole blocks, `w` long enough.
    pub(crate) fn check(&self, op: &'static str, w_len: usize) -> Result<(), KernelError> {
        let bad = |msg: String| KernelError::BadShape { op, msg };
        if self.rows == 0 || self.k == 0 || self.slabs == 0 {
            return Err(bad(format!("empty shape {self:?}")));
        }
        if !self.k.is_multiple_of(32) || !self.k.is_multiple_of(self.ty.block_size()) {
            return Err(bad(format!(
                "row length {} is not a multiple of 32 and of the {} block ({})",
                self.k,
                self.ty,
                self.ty.block_size()
            )));
        }
        if self.packed && !crate::repack::is_packed(self.ty) {
            return Err(bad(format!("{} has no repacked layout", self.ty)));
        }
        let total = self
            .bytes()
            .ok_or_else(|| bad(format!("{self:?} overflows")))?;
        need_len(op, "w", w_len, total)
    }
}

/// Lanes per output row: the largest power of two <= 32 dividing the row's 32-element chunks,
/// so every lane has work for any K (K = 192: 2 lanes, 6 chunks, 3 each).
pub(crate) fn lanes_per_row(k: usize) -> usize {
    lanes_for_tasks(k / 32)
}

/// Lanes per output row for a row of `tasks` units of work: the largest power of two <= 32
/// dividing it.
pub(crate) fn lanes_for_tasks(tasks: usize) -> usize {
    let tasks = tasks.max(1);
    let mut l = 32;
    while l > 1 && !tasks.is_multiple_of(l) {
        l /= 2;
    }
    l
}

/// How the channels of a batched GEMV pick their inputs and weights.
#[derive(Debug, Clone, Copy)]
pub struct Channels<'a> {
    /// Number of independent GEMVs (grid.y, grid-strided: any count fits).
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

/// The `GemvF` kernel parameter (gemv.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GemvF {
    w: WMat,
    nrows: i32,
    k: i32,
    n_slabs: i32,
    lpr: i32,
    ids: u64,
    x: u64,
    x_stride: i64,
    x_div: i32,
    count: i32,
    y: u64,
    y_stride: i64,
}

// SAFETY: plain struct laid out exactly as `struct GemvF` in gemv.cu.
unsafe impl DeviceRepr for GemvF {}

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
    /// `e(ch) = ids[ch]` or `ch % slabs`. One launch covers all selected experts of a MoE layer
    /// (only their slabs are read) or all heads of an absorption matrix.
    pub fn gemv_batched(
        &self,
        shape: MatShape,
        w: &impl DevicePtr<u8>,
        ch: Channels<'_>,
        x: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "gemv";
        shape.check(OP, dlen(w))?;
        let bad = |msg: String| KernelError::BadShape { op: OP, msg };
        if ch.count == 0 {
            return Err(bad("no channels".into()));
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
        let MatShape { ty, rows, k, .. } = shape;
        let x_need = ((ch.count - 1) / ch.x_div) * ch.x_stride + k;
        need_len(OP, "x", dlen(x), x_need)?;
        let y_need = (ch.count - 1) * ch.y_stride + rows;
        need_len(OP, "y", dlen(y), y_need)?;
        if let Some(ids) = ch.ids {
            need_len(OP, "ids", ids.len(), ch.count)?;
        }
        let lpr = lanes_per_row(k);
        let kinds = type_kernels(ty, shape.packed);
        let sms = self.info().sm_count as usize;
        let stream = self.stream();
        let (wp, _gw) = w.device_ptr(stream);
        let (xp, _gx) = x.device_ptr(stream);
        let (yp, _gy) = y.device_ptr_mut(stream);
        // gemvc_f32 reads rows and input as float4s.
        let coalesced = self.gemv_coalesced()
            && ty == GgmlType::F32
            && !shape.packed
            && k.is_multiple_of(4)
            && wp.is_multiple_of(16)
            && xp.is_multiple_of(16);
        let variant = gemv_variant(rows, lpr, ch.count, sms, (self.gemv_ksplit(), coalesced));
        let (name, rows_per_block) = match variant {
            GemvVariant::FourRows => (kinds.gemv4, 4 * (32 / lpr) * 4),
            GemvVariant::OneRow => (kinds.gemv, 4 * (32 / lpr)),
            GemvVariant::KSplit => (kinds.gemvs, 32 / lpr),
            GemvVariant::Coalesced => (GEMVC_F32, 1),
        };
        let f = self.func(Op::Gemv, name)?;
        let tables = self.tables()?.params;
        let cfg = self.cfg_rows(OP, rows.div_ceil(rows_per_block) as u64, ch.count, 128)?;
        let ip = match ch.ids {
            Some(ids) => ids.device_ptr(stream).0,
            None => 0u64,
        };
        check_aligned(OP, "w", wp, block_alignment(ty, shape.packed))?;
        check_aligned(OP, "x", xp, 16)?;
        let p = GemvF {
            w: WMat {
                base: wp,
                nblk: shape.blocks() as i64,
            },
            nrows: to_i32(OP, "rows", rows)?,
            k: to_i32(OP, "k", k)?,
            n_slabs: to_i32(OP, "slabs", shape.slabs)?,
            lpr: lpr as i32,
            ids: ip,
            x: xp,
            x_stride: ch.x_stride as i64,
            x_div: to_i32(OP, "x_div", ch.x_div)?,
            count: to_i32(OP, "channels", ch.count)?,
            y: yp,
            y_stride: ch.y_stride as i64,
        };
        let mut b = self.args(&f);
        b.arg(&p).arg(&tables);
        // SAFETY: buffer extents checked above for every channel; expert ids are range-checked
        // in the kernel (out-of-range ids write NaN rows and read nothing).
        unsafe { self.launch(OP, b, cfg) }
    }
}

#[cfg(test)]
mod tests {
    use super::lanes_per_row;

    #[test]
    fn few_rows_split_k_over_the_warps() {
        use super::{gemv_variant, GemvVariant::*};
        // The router: 256 F32 rows of 6,144 (32 lanes a row): 64 one-row blocks < 132 SMs.
        assert_eq!(gemv_variant(256, 32, 1, 132, (true, false)), KSplit);
        assert_eq!(gemv_variant(256, 32, 1, 132, (true, true)), Coalesced);
        assert_eq!(gemv_variant(256, 32, 1, 132, (false, true)), OneRow);
        // kv_a (576 rows) in the exact path: 144 blocks fill the SMs.
        assert_eq!(gemv_variant(576, 32, 1, 132, (true, true)), OneRow);
        // Several channels (experts, heads) fill them too.
        assert_eq!(gemv_variant(256, 32, 8, 132, (true, true)), OneRow);
        assert_eq!(gemv_variant(2048, 32, 1, 132, (true, true)), FourRows);
    }

    #[test]
    fn every_lane_has_work() {
        for (k, l) in [
            (32, 1),
            (64, 2),
            (192, 2),
            (512, 16),
            (1024, 32),
            (2048, 32),
            (6144, 32),
            (16384, 32),
            (12288, 32),
            (96, 1),
        ] {
            assert_eq!(lanes_per_row(k), l, "K = {k}");
            assert!((k / 32).is_multiple_of(lanes_per_row(k)));
        }
    }
}
