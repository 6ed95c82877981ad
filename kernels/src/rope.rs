//! Interleaved RoPE on the rope dims of every head (GLM-5 main attention and DSA indexer), and
//! the absorbed MLA queries' fused q8a quantization + RoPE ([`Gpu::rope_q8_to`]).

use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::gemvq::Q8Act;
use crate::launch::shape_err;
use crate::ops::Op;

/// Where the rope dims sit: token s, head h starts at `s * tok_stride + h * head_stride`; the
/// `n_rot` rotated values start `offset` into the head (main attention: after the 192 nope dims;
/// indexer: at 0).
#[derive(Debug, Clone, Copy)]
pub struct RopeLayout {
    pub tokens: usize,
    pub heads: usize,
    pub tok_stride: usize,
    pub head_stride: usize,
    pub offset: usize,
    pub n_rot: usize,
}

/// Which pairs rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2j], x[2j+1])`, rotated in place (GPT-J, ggml NORM).
    Interleaved,
    /// Adjacent pairs, written in HF's de-interleaved order (rotated evens, then odds).
    InterleavedHf,
    /// Pairs `(x[j], x[j + n_rot/2])` (GPT-NeoX).
    Neox,
}

/// Most quantizing warps and most rotating warps of one `rope_q8_f32` block (each loops over
/// what is beyond them), so a block stays within 1,024 threads for any `nope` and `n_rot`.
const RQ_MAX_WARPS: usize = 16;

/// Block shape of `rope_q8_f32` (rope.cu) for `nope` quantized columns (a multiple of 32) and
/// `n_rot` rotated ones: `(quantizing warps, threads per block)`. One warp per block of 32
/// quantized values and one thread per rotated pair, each capped at [`RQ_MAX_WARPS`] warps: at
/// decode (GLM-5: nope 192, n_rot 64) 6 quantizing warps and 1 rotating warp, all busy at once.
/// The grid is one block per head in x and the tokens in y up to the device's limit
/// (grid-strided beyond it).
pub fn rope_q8_block(nope: usize, n_rot: usize) -> (u32, u32) {
    let qw = (nope / 32).clamp(1, RQ_MAX_WARPS);
    let rw = (n_rot / 2).div_ceil(32).clamp(1, RQ_MAX_WARPS);
    (qw as u32, ((qw + rw) * 32) as u32)
}

/// `inv_freq[j] = 1 / theta^(2j / n_rot)` as transformers computes it in f32 (the exponent in
/// f32, the power in f64 rounded to f32, as the CPU backend does).
pub fn rope_inv_freq(theta: f32, n_rot: usize) -> Vec<f32> {
    (0..n_rot / 2)
        .map(|j| {
            let e = (2 * j) as f32 / n_rot as f32;
            1.0f32 / ((theta as f64).powf(e as f64) as f32)
        })
        .collect()
}

impl Gpu {
    /// Rotate pair j of every head of token s by `pos[s] * inv_freq[j]`, in place.
    pub fn rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        l: RopeLayout,
        pos: &impl DevicePtr<i32>,
        inv_freq: &impl DevicePtr<f32>,
        style: RopeStyle,
    ) -> Result<(), KernelError> {
        const OP: &str = "rope";
        check_layout(OP, "x", dlen(x), &l)?;
        let (xp, _gx) = x.device_ptr_mut(self.stream());
        // SAFETY: x holds the layout (checked); reading and writing one buffer is the kernel's
        // in-place mode.
        unsafe { self.rope_raw(xp, &l, xp, &l, pos, inv_freq, style) }
    }

    /// [`Gpu::rope`] from `x` (layout `xl`) into `y` (layout `yl`: the same tokens, heads and
    /// rotated dims at its own strides and offset), `x` unchanged: the in-place rotation's
    /// arithmetic, so `y` gets bitwise what rotating a copy of `x` and copying it there gives.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_to(
        &self,
        x: &impl DevicePtr<f32>,
        xl: RopeLayout,
        y: &mut impl DevicePtrMut<f32>,
        yl: RopeLayout,
        pos: &impl DevicePtr<i32>,
        inv_freq: &impl DevicePtr<f32>,
        style: RopeStyle,
    ) -> Result<(), KernelError> {
        const OP: &str = "rope";
        if (xl.tokens, xl.heads, xl.n_rot) != (yl.tokens, yl.heads, yl.n_rot) {
            return Err(shape_err(OP, format!("layouts differ: {xl:?} -> {yl:?}")));
        }
        check_layout(OP, "x", dlen(x), &xl)?;
        check_layout(OP, "y", dlen(y), &yl)?;
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        // SAFETY: both layouts checked against their buffers; distinct buffers (a `&` and a
        // `&mut` borrow), so no element is read after another block wrote it.
        unsafe { self.rope_raw(xp, &xl, yp, &yl, pos, inv_freq, style) }
    }

    /// [`Gpu::quantize_q8`] of the first `nope` columns of every (token, head) group of `x` and
    /// [`Gpu::rope_to`] of its rope dims into `y`, in one launch. Returns the q8a activations of
    /// `xl.tokens * xl.heads` rows (row `s * heads + h`: the `nope` values from
    /// `x[s * tok_stride + h * head_stride]` on), bitwise what
    /// `quantize_q8(x, tokens * heads, nope, head_stride)` gives when
    /// `tok_stride == heads * head_stride` (the MLA queries: `head_stride = nope + rope`); `y`
    /// gets exactly what `rope_to(x, xl, y, yl, ..)` writes, nothing else, and `x` is unchanged.
    /// `nope` is a multiple of 32 at most `xl.offset` (the quantized columns lie before the
    /// rotated ones).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_q8_to(
        &self,
        x: &impl DevicePtr<f32>,
        xl: RopeLayout,
        nope: usize,
        y: &mut impl DevicePtrMut<f32>,
        yl: RopeLayout,
        pos: &impl DevicePtr<i32>,
        inv_freq: &impl DevicePtr<f32>,
        style: RopeStyle,
    ) -> Result<Q8Act, KernelError> {
        const OP: &str = "rope_q8";
        if (xl.tokens, xl.heads, xl.n_rot) != (yl.tokens, yl.heads, yl.n_rot) {
            return Err(shape_err(OP, format!("layouts differ: {xl:?} -> {yl:?}")));
        }
        if nope == 0 || !nope.is_multiple_of(32) || nope > xl.offset {
            return Err(shape_err(
                OP,
                format!(
                    "nope {nope} must be a multiple of 32 in 32..={} (the rope offset)",
                    xl.offset
                ),
            ));
        }
        // x's furthest element is a rotated one (nope <= offset), so this covers the quantized
        // columns too.
        check_layout(OP, "x", dlen(x), &xl)?;
        check_layout(OP, "y", dlen(y), &yl)?;
        need_len(OP, "pos", dlen(pos), xl.tokens)?;
        need_len(OP, "inv_freq", dlen(inv_freq), xl.n_rot / 2)?;
        let rows = xl.tokens * xl.heads;
        let f = self.func(Op::Rope, "rope_q8_f32")?;
        let (qw, block) = rope_q8_block(nope, xl.n_rot);
        let cfg = self.cfg_rows(OP, xl.heads as u64, xl.tokens, block)?;
        let (xts, xhs) = (xl.tok_stride as i64, xl.head_stride as i64);
        let (yts, yhs) = (yl.tok_stride as i64, yl.head_stride as i64);
        let xo = to_i32(OP, "offset", xl.offset)?;
        let yo = to_i32(OP, "offset", yl.offset)?;
        let nr = to_i32(OP, "n_rot", xl.n_rot)?;
        let np = to_i32(OP, "nope", nope)?;
        let qw = qw as i32;
        let de = style_code(style);
        let t64 = xl.tokens as i64;
        let (q, qp, dp) = Q8Act::alloc(self, rows, nope)?;
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let (pp, _gp) = pos.device_ptr(s);
        let (fp, _gf) = inv_freq.device_ptr(s);
        let mut b = self.args(&f);
        b.arg(&xp).arg(&xts).arg(&xhs).arg(&xo).arg(&np).arg(&qw);
        b.arg(&qp).arg(&dp);
        b.arg(&yp).arg(&yts).arg(&yhs).arg(&yo);
        b.arg(&nr).arg(&pp).arg(&fp).arg(&de).arg(&t64);
        // SAFETY: both layouts, pos and inv_freq checked against their buffers; the quantized
        // columns [0, nope) of every group lie within x (nope <= offset); `q` was sized by
        // `Q8Act::alloc` for the `tokens * heads` rows of `nope` the blocks write (grid.x =
        // heads, every token reached by the y grid-stride); x, y and `q` are distinct buffers
        // (a `&` and a `&mut` borrow and a fresh allocation), so nothing read is written.
        unsafe { self.launch(OP, b, cfg) }?;
        Ok(q)
    }

    /// # Safety
    /// `xp` / `yp` must hold layouts `xl` / `yl` ([`check_layout`]), equal in tokens, heads and
    /// n_rot; `yp` either is `xp` with `yl == xl` or shares no element with it.
    #[allow(clippy::too_many_arguments)]
    unsafe fn rope_raw(
        &self,
        xp: u64,
        xl: &RopeLayout,
        yp: u64,
        yl: &RopeLayout,
        pos: &impl DevicePtr<i32>,
        inv_freq: &impl DevicePtr<f32>,
        style: RopeStyle,
    ) -> Result<(), KernelError> {
        const OP: &str = "rope";
        need_len(OP, "pos", dlen(pos), xl.tokens)?;
        need_len(OP, "inv_freq", dlen(inv_freq), xl.n_rot / 2)?;
        let f = self.func(Op::Rope, "rope_f32")?;
        let block = (xl.n_rot / 2).div_ceil(32) as u32 * 32;
        let cfg = self.cfg_rows(OP, xl.heads as u64, xl.tokens, block)?;
        let s = self.stream();
        let (pp, _gp) = pos.device_ptr(s);
        let (fp, _gf) = inv_freq.device_ptr(s);
        let (xts, xhs) = (xl.tok_stride as i64, xl.head_stride as i64);
        let (yts, yhs) = (yl.tok_stride as i64, yl.head_stride as i64);
        let xo = to_i32(OP, "offset", xl.offset)?;
        let yo = to_i32(OP, "offset", yl.offset)?;
        let nr = to_i32(OP, "n_rot", xl.n_rot)?;
        let de = style_code(style);
        let t64 = xl.tokens as i64;
        let mut b = self.args(&f);
        b.arg(&xp).arg(&xts).arg(&xhs).arg(&xo);
        b.arg(&yp).arg(&yts).arg(&yhs).arg(&yo);
        b.arg(&nr).arg(&pp).arg(&fp).arg(&de).arg(&t64);
        // SAFETY: the caller's contract; pos and inv_freq extents checked above.
        unsafe { self.launch(OP, b, cfg) }
    }
}

/// The kernels' `style` argument (rope.cu).
fn style_code(style: RopeStyle) -> i32 {
    match style {
        RopeStyle::Interleaved => 0,
        RopeStyle::InterleavedHf => 1,
        RopeStyle::Neox => 2,
    }
}

/// A non-empty layout with an even `n_rot` in the kernel's range whose furthest element lies
/// within `len`.
fn check_layout(
    op: &'static str,
    what: &'static str,
    len: usize,
    l: &RopeLayout,
) -> Result<(), KernelError> {
    if l.tokens == 0 || l.heads == 0 {
        return Err(shape_err(op, format!("empty layout {l:?}")));
    }
    if l.n_rot == 0 || !l.n_rot.is_multiple_of(2) || l.n_rot > 2048 {
        return Err(shape_err(
            op,
            format!("n_rot {} must be even, 2..=2048", l.n_rot),
        ));
    }
    let need = (l.tokens - 1) * l.tok_stride + (l.heads - 1) * l.head_stride + l.offset + l.n_rot;
    need_len(op, what, len, need)
}
