//! Dequantization on the device: whole tensors to f32 / bf16, and row gathers (embeddings).

use cudarc::driver::{DevicePtr, DevicePtrMut};
use gguf::GgmlType;

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::ops::Op;
use crate::quant::{block_alignment, decoder_block, type_kernels};

const BLOCK: u32 = 128;

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

impl Gpu {
    /// Dequantize `src` (whole blocks of `ty`, as stored in the GGUF file) into `dst` (f32).
    /// `dst` must hold at least as many values as `src` decodes to.
    pub fn dequantize(
        &self,
        ty: GgmlType,
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
        // SAFETY: src holds exactly the blocks of n elements, dst at least n floats.
        unsafe { self.dequant_raw(ty, sp, n, dp) }
    }

    /// Launch the f32 dequantizer on raw device addresses.
    ///
    /// # Safety
    /// `src` must hold the whole blocks of `n` elements of `ty` and `dst` room for `n` floats.
    pub(crate) unsafe fn dequant_raw(
        &self,
        ty: GgmlType,
        sp: u64,
        n: usize,
        dp: u64,
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        unsafe { self.dequant_launch("dequant", type_kernels(ty).dequant, ty, sp, n, dp) }
    }

    /// The whole-tensor dequantizers (f32 and bf16 output) take the same arguments and grid;
    /// `kernel` picks the output type.
    ///
    /// # Safety
    /// As [`Gpu::dequant_raw`], with `dst` room for `n` values of the kernel's output type.
    unsafe fn dequant_launch(
        &self,
        op: &'static str,
        kernel: &'static str,
        ty: GgmlType,
        sp: u64,
        n: usize,
        dp: u64,
    ) -> Result<(), KernelError> {
        let f = self.func(Op::Dequant, kernel)?;
        let tables = self.tables()?.params;
        let chunks = n.div_ceil(32) as u64;
        let cfg = self.cfg(op, (chunks.div_ceil(BLOCK as u64), 1, 1), BLOCK)?;
        check_aligned(op, "src", sp, block_alignment(ty))?;
        check_aligned(op, "dst", dp, 16)?;
        let n64 = n as i64;
        let mut b = self.args(&f);
        b.arg(&sp).arg(&dp).arg(&n64).arg(&tables);
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
        // SAFETY: src holds exactly the blocks of n elements, dst at least n bf16 values.
        unsafe { self.dequant_launch(OP, type_kernels(ty).dequant_bf16, ty, sp, n, dp) }
    }

    /// `dst[r, :] = row ids[r]` of the `[nrows, k]` matrix `src` of type `ty` (embedding lookup).
    /// Ids outside `0..nrows` produce NaN rows (never out-of-bounds reads).
    pub fn get_rows(
        &self,
        ty: GgmlType,
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
        let f = self.func(Op::Dequant, type_kernels(ty).get_rows)?;
        let tables = self.tables()?.params;
        let chunks = (k / 32) as u64;
        let cfg = self.cfg(OP, (chunks.div_ceil(BLOCK as u64), nids as u64, 1), BLOCK)?;
        let (sp, _gs) = src.device_ptr(self.stream());
        let (ip, _gi) = ids.device_ptr(self.stream());
        let (dp, _gd) = dst.device_ptr_mut(self.stream());
        check_aligned(OP, "src", sp, block_alignment(ty))?;
        check_aligned(OP, "dst", dp, 16)?;
        let rb = row_bytes as i64;
        let nr = nrows as i64;
        let k32 = to_i32(OP, "k", k)?;
        let mut b = self.args(&f);
        b.arg(&sp)
            .arg(&rb)
            .arg(&nr)
            .arg(&ip)
            .arg(&dp)
            .arg(&k32)
            .arg(&tables);
        // SAFETY: every id is bounds-checked in the kernel; dst holds nids * k floats.
        unsafe { self.launch(OP, b, cfg) }
    }
}
