//! Token sampling on the device (kernels/cuda/sample.cu): greedy, temperature, top-k and top-p
//! in HF's order, returning one token id per row of logits, so decoding needs to copy back only
//! the ids (4 bytes per sequence) instead of the vocabulary-wide logits.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::launch::{shape_err, span};
use crate::ops::Op;

/// Sampling parameters of one row.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    /// <= 0: greedy.
    pub temperature: f32,
    /// 0: no top-k; 1: greedy.
    pub top_k: i32,
    /// >= 1: no nucleus cut.
    pub top_p: f32,
    /// The row's uniform random number in [0, 1) (the caller's RNG, so runs are reproducible).
    pub u: f32,
    /// Keep tokens whose tempered probability is at least `min_p` times the best one's
    /// (applied after top-k, before top-p); outside (0, 1]: no cut.
    pub min_p: f32,
}

/// Added to a row's sampled id when the row holds a NaN or infinite logit (ids are < 2^24).
pub const SAMPLE_NONFINITE: i32 = 1 << 30;

/// A raw output of [`Gpu::sample`] as (token id, whether the row held a non-finite logit).
pub fn sampled_id(raw: i32) -> (u32, bool) {
    let bad = raw >= SAMPLE_NONFINITE;
    (
        (raw - if bad { SAMPLE_NONFINITE } else { 0 }).max(0) as u32,
        bad,
    )
}

// SAFETY: plain struct laid out exactly as `struct SampleP` in sample.cu.
unsafe impl DeviceRepr for SampleParams {}

impl Gpu {
    /// `out[r]` = the token sampled from row r of `logits` (`rows` rows of `n`, `stride` apart)
    /// with `params[r]`, plus [`SAMPLE_NONFINITE`] when the row holds a non-finite logit
    /// (decode with [`sampled_id`]).
    pub fn sample(
        &self,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        n: usize,
        stride: usize,
        params: &[SampleParams],
        out: &mut impl DevicePtrMut<i32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "sample";
        if rows == 0 || n == 0 || n >= 1 << 24 {
            return Err(shape_err(OP, format!("{rows} rows of {n} logits")));
        }
        if let Some(p) = params.iter().find(|p| {
            !(0.0..1.0).contains(&p.u)
                || p.top_k < 0
                || p.top_p.is_nan()
                || p.temperature.is_nan()
                || p.min_p.is_nan()
        }) {
            return Err(shape_err(OP, format!("bad parameters {p:?}")));
        }
        need_len(OP, "logits", dlen(logits), span(rows, stride, n))?;
        need_len(OP, "params", params.len(), rows)?;
        need_len(OP, "out", dlen(out), rows)?;
        let dp = self.upload_async(&params[..rows])?;
        let f = self.func(Op::Sample, "sample_rows")?;
        let cfg = self.cfg(OP, (rows as u64, 1, 1), 1024)?;
        let s = self.stream();
        let (lp, _g1) = logits.device_ptr(s);
        let (op, _g2) = out.device_ptr_mut(s);
        let (st, n32, pp) = (stride as i64, to_i32(OP, "n", n)?, dp.ptr());
        let mut b = self.args(&f);
        b.arg(&lp).arg(&st).arg(&n32).arg(&pp).arg(&op);
        // SAFETY: extents checked above; `dp` lives until the launch is queued, and the pool
        // only reuses it for work queued after this launch.
        unsafe { self.launch(OP, b, cfg) }
    }
}
