//! Interleaved RoPE on the rope dims of every head (GLM-5 main attention and DSA indexer).

use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
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
        if l.tokens == 0 || l.heads == 0 {
            return Err(shape_err(OP, format!("empty layout {l:?}")));
        }
        if l.n_rot == 0 || !l.n_rot.is_multiple_of(2) || l.n_rot > 2048 {
            return Err(shape_err(
                OP,
                format!("n_rot {} must be even, 2..=2048", l.n_rot),
            ));
        }
        let need =
            (l.tokens - 1) * l.tok_stride + (l.heads - 1) * l.head_stride + l.offset + l.n_rot;
        need_len(OP, "x", dlen(x), need)?;
        need_len(OP, "pos", dlen(pos), l.tokens)?;
        need_len(OP, "inv_freq", dlen(inv_freq), l.n_rot / 2)?;
        let f = self.func(Op::Rope, "rope_f32")?;
        let block = (l.n_rot / 2).div_ceil(32) as u32 * 32;
        let cfg = self.cfg_rows(OP, l.heads as u64, l.tokens, block)?;
        let s = self.stream();
        let (xp, _gx) = x.device_ptr_mut(s);
        let (pp, _gp) = pos.device_ptr(s);
        let (fp, _gf) = inv_freq.device_ptr(s);
        let (ts, hs) = (l.tok_stride as i64, l.head_stride as i64);
        let off = to_i32(OP, "offset", l.offset)?;
        let nr = to_i32(OP, "n_rot", l.n_rot)?;
        let de: i32 = match style {
            RopeStyle::Interleaved => 0,
            RopeStyle::InterleavedHf => 1,
            RopeStyle::Neox => 2,
        };
        let t64 = l.tokens as i64;
        let mut b = self.args(&f);
        b.arg(&xp)
            .arg(&ts)
            .arg(&hs)
            .arg(&off)
            .arg(&nr)
            .arg(&pp)
            .arg(&fp)
            .arg(&de)
            .arg(&t64);
        // SAFETY: the furthest element touched is within x (checked above).
        unsafe { self.launch(OP, b, cfg) }
    }
}
