//! Dequantization on the device: whole tensors or block ranges to f32 / bf16, and row gathers
//! (embeddings), from GGUF blocks or the repacked device layout (`crate::repack`).

use cudarc::driver::{DevicePtr, DevicePtrMut};
use gguf::GgmlType;

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::ops::Op;
use crate::quant::{block_alignment, decoder_block, type_kernels, WMat};

const BLOCK: u32 = 128;
/// Grid-x cap of the grid-strided dequantizer (enough blocks to fill any GPU many times).
const MAX_BLOCKS: u64 = 1 << 16;

/// Elements `n_bytes` of `ty` decode to, checking for whole blocks.
pub fn elements_of(op: &'static str, ty: GgmlType, n_bytes: usize) -> Result<usize, KernelError> {
    gguf::quant::n_elements(ty, n_bytes).map_err(|e| KernelError::BadShape {
        op,
        msg: e.to_string(),
    })
}

pub(crate) fn check_aligned(
    op: &'static str,
    arg: &str,
    ptr: u64,
    align: usize,
) -> Result<(), KernelError> {
    if !ptr.is_multiple_of(align as u64) {
        return Err(KernelError::BadShape {
            op,
            msg: format!("`{arg}` at device address {ptr:#x} is not {align}-byte aligned"),
        });
    }
    Ok(())
}

/// A weight tensor on the device for the raw launchers: its type, layout and block count.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawWeight {
    pub ty: GgmlType,
    pub packed: bool,
    pub base: u64,
    /// Blocks of the whole tensor (decoder blocks: 32 values for plain types).
    pub nblk: usize,
}

impl RawWeight {
    pub(crate) fn wmat(&self) -> WMat {
        WMat {
            base: self.base,
            nblk: self.nblk as i64,
        }
    }
}

impl Gpu {
    /// Dequantize `src` (whole blocks of `ty`, as stored in the GGUF file) into `dst` (f32).
    /// `dst` must hold at least as many values as `src` decodes to.
    pub fn dequantize(
        &self,
        ty: GgmlType,
        src: &impl DevicePtr<u8>,
        dst: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        self.dequantize_layout(ty, false, src, dst)
    }

    /// As [`Gpu::dequantize`], for a tensor in the GGUF layout or (`packed`) the repacked one.
    pub fn dequantize_layout(
        &self,
        ty: GgmlType,
        packed: bool,
        src: &impl DevicePtr<u8>,
        dst: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "dequant";
        let n = elements_of(OP, ty, dlen(src))?;
        need_len(OP, "dst", dlen(dst), n)?;
        if n == 0 {
            return Ok(());
        }
        let (sp, _gs) = src.device_ptr(self.stream());
        let (dp, _gd) = dst.device_ptr_mut(self.stream());
        let w = RawWeight {
            ty,
            packed,
            base: sp,
            nblk: n / decoder_block(ty).0,
        };
        // SAFETY: src holds exactly the blocks of n elements, dst at least n floats.
        unsafe { self.dequant_raw(w, 0, n, dp, false) }
    }

    /// Launch a dequantizer on raw device addresses: `n` values starting at block `g0` of `w`,
    /// to f32 (`bf16 = false`) or bf16 bit patterns.
    ///
    /// # Safety
    /// Blocks `g0 ..` covering `n` values must lie within `w`, and `dst` must have room for `n`
    /// values of the output type.
    pub(crate) unsafe fn dequant_raw(
        &self,
        w: RawWeight,
        g0: usize,
        n: usize,
        dp: u64,
        bf16: bool,
    ) -> Result<(), KernelError> {
        let op = if bf16 { "dequant_bf16" } else { "dequant" };
        let k = type_kernels(w.ty, w.packed);
        let f = self.func(Op::Dequant, if bf16 { k.dequant_bf16 } else { k.dequant })?;
        let tables = self.tables()?.params;
        let chunks = n.div_ceil(32) as u64;
        let cfg = self.cfg(
            op,
            (chunks.div_ceil(BLOCK as u64).min(MAX_BLOCKS), 1, 1),
            BLOCK,
        )?;
        check_aligned(op, "src", w.base, block_alignment(w.ty, w.packed))?;
        check_aligned(op, "dst", dp, 16)?;
        let (m, g0, n64) = (w.wmat(), g0 as i64, n as i64);
        let mut b = self.args(&f);
        b.arg(&m).arg(&g0).arg(&dp).arg(&n64).arg(&tables);
        // SAFETY: extents are the caller's contract; alignment checked above.
        unsafe { self.launch(op, b, cfg) }
    }

    /// Like [`Gpu::dequantize`], writing bf16 bit patterns (round to nearest even).
    pub fn dequantize_bf16(
        &self,
        ty: GgmlType,
        src: &impl DevicePtr<u8>,
        dst: &mut impl DevicePtrMut<u16>,
    ) -> Result<(), KernelError> {
        const OP: &str = "dequant_bf16";
        let n = elements_of(OP, ty, dlen(src))?;
        need_len(OP, "dst", dlen(dst), n)?;
        if n == 0 {
            return Ok(());
        }
        let (sp, _gs) = src.device_ptr(self.stream());
        let (dp, _gd) = dst.device_ptr_mut(self.stream());
        let w = RawWeight {
            ty,
            packed: false,
            base: sp,
            nblk: n / decoder_block(ty).0,
        };
        // SAFETY: src holds exactly the blocks of n elements, dst at least n bf16 values.
        unsafe { self.dequant_raw(w, 0, n, dp, true) }
    }

    /// `dst[r, :] = row ids[r]` of the `[nrows, k]` matrix `src` of type `ty` (embedding lookup),
    /// in the GGUF layout or (`packed`) the repacked one. Ids outside `0..nrows` produce NaN rows
    /// (never out-of-bounds reads).
    pub fn get_rows(
        &self,
        ty: GgmlType,
        packed: bool,
        src: &impl DevicePtr<u8>,
        k: usize,
        ids: &impl DevicePtr<i32>,
        dst: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "get_rows";
        let (qb, _) = decoder_block(ty);
        if k == 0 || !k.is_multiple_of(qb) || !k.is_multiple_of(32) {
            return Err(KernelError::BadShape {
                op: OP,
                msg: format!("row length {k} is not a multiple of the {ty} block ({qb})"),
            });
        }
        let row_bytes = ty
            .row_bytes(k as u64)
            .ok_or_else(|| KernelError::BadShape {
                op: OP,
                msg: format!("row length {k} does not fit {ty} blocks"),
            })? as usize;
        let nrows = dlen(src) / row_bytes;
        if nrows * row_bytes != dlen(src) {
            return Err(KernelError::BadShape {
                op: OP,
                msg: format!(
                    "{} bytes is not a whole number of {row_bytes}-byte rows",
                    dlen(src)
                ),
            });
        }
        let nids = dlen(ids);
        if nids == 0 {
            return Ok(());
        }
        need_len(OP, "dst", dlen(dst), nids * k)?;
        let f = self.func(Op::Dequant, type_kernels(ty, packed).get_rows)?;
        let tables = self.tables()?.params;
        let chunks = (k / 32) as u64;
        let cfg = self.cfg_rows(OP, chunks.div_ceil(BLOCK as u64), nids, BLOCK)?;
        let (sp, _gs) = src.device_ptr(self.stream());
        let (ip, _gi) = ids.device_ptr(self.stream());
        let (dp, _gd) = dst.device_ptr_mut(self.stream());
        check_aligned(OP, "src", sp, block_alignment(ty, packed))?;
        check_aligned(OP, "dst", dp, 16)?;
        let m = WMat {
            base: sp,
            nblk: (nrows * (k / qb)) as i64,
        };
        let nr = nrows as i64;
        let ni = nids as i64;
        let k32 = to_i32(OP, "k", k)?;
        let mut b = self.args(&f);
        b.arg(&m)
            .arg(&nr)
            .arg(&ip)
            .arg(&ni)
            .arg(&dp)
            .arg(&k32)
            .arg(&tables);
        // SAFETY: every id is bounds-checked in the kernel; dst holds nids * k floats.
        unsafe { self.launch(OP, b, cfg) }
    }
}
