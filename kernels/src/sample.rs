//! Token sampling on the device (kernels/cuda/sample.cu): greedy, temperature, top-k and top-p
//! in HF's order, returning one token id per row of logits, so decoding needs to copy back only
//! the ids (4 bytes per sequence) instead of the vocabulary-wide logits.
//!
//! Also the launch planning shared by the row reductions that can split a row over blocks
//! (greedy sampling, [`Gpu::argmax`], [`Gpu::topk`]): [`Split`] and [`split_chunks`].

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

impl SampleParams {
    /// Whether the row is greedy (sample.cu's `s_greedy`: the plan and the kernels agree).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0 || self.top_k == 1
    }
}

/// Launch plan of a reduction over rows (greedy sampling, arg-max, top-k).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Split {
    /// By the op's threshold ([`GREEDY_SPLIT_MIN`], [`TOPK_SPLIT_MIN`]).
    #[default]
    Auto,
    /// One block per row (the kernels used for many or short rows).
    OneBlock,
    /// Every row split over blocks as [`split_chunks`] plans it (whatever its length).
    Blocks,
}

/// Shortest row the greedy paths (sampling, arg-max) split over blocks: below it one
/// 1,024-thread block has every load of the row in flight at once, and the split's second
/// launch would cost more than it saves.
pub const GREEDY_SPLIT_MIN: usize = 32_768;

/// Shortest row [`Gpu::topk`] splits over blocks: its one-block kernel makes six passes over
/// the row with block-wide barriers every 1,024 keys, so even short rows gain.
pub const TOPK_SPLIT_MIN: usize = 16_384;

/// Keys per block of the split paths: a multiple of 1,024 (256 threads x 4), the number of
/// blocks being about 4 per SM over all `rows`. Returns `(chunk, chunks per row)`.
pub fn split_chunks(n: usize, rows: usize, sm_count: u32) -> (usize, usize) {
    let per_row = (4 * sm_count.max(1) as usize).div_ceil(rows.max(1));
    let chunk = n.max(1).div_ceil(per_row).next_multiple_of(1024);
    (chunk, n.max(1).div_ceil(chunk))
}

/// The split plan of a greedy reduction, or `None` for one block per row: split when the row
/// is at least [`GREEDY_SPLIT_MIN`] long and the plan gives a row at least 2 blocks (so
/// batches of hundreds of rows, which fill the GPU with one block each, stay as they are).
pub(crate) fn greedy_plan(
    split: Split,
    n: usize,
    rows: usize,
    sm_count: u32,
) -> Option<(usize, usize)> {
    let plan = split_chunks(n, rows, sm_count);
    match split {
        Split::OneBlock => None,
        Split::Blocks => Some(plan),
        Split::Auto => (n >= GREEDY_SPLIT_MIN && plan.1 >= 2).then_some(plan),
    }
}

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
        self.sample_split(logits, rows, n, stride, params, out, Split::Auto)
    }

    /// [`Gpu::sample`] with the greedy rows' launch plan chosen by `split`: with a split,
    /// `sample_greedy_part` (grid (chunks, rows)) and `sample_greedy_final` (one block per row)
    /// answer the greedy rows and `sample_rows` (one block per row) only the others, launched
    /// only when there are some. Every plan gives the same ids.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_split(
        &self,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        n: usize,
        stride: usize,
        params: &[SampleParams],
        out: &mut impl DevicePtrMut<i32>,
        split: Split,
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
        let greedy = params[..rows].iter().filter(|p| p.is_greedy()).count();
        let plan = if greedy > 0 {
            greedy_plan(split, n, greedy, self.info().sm_count)
        } else {
            None
        };
        let dp = self.upload_async(&params[..rows])?;
        let s = self.stream();
        let (lp, _g1) = logits.device_ptr(s);
        let (op, _g2) = out.device_ptr_mut(s);
        let (st, n32, pp) = (stride as i64, to_i32(OP, "n", n)?, dp.ptr());
        let rows64 = rows as i64;
        // Pool scratch: no driver call once the size has been seen; dropped after the launches
        // are queued (the pool reuses it only for later work on this stream).
        let part = match plan {
            Some((_, chunks)) => Some(
                self.alloc::<i32>(
                    rows.checked_mul(chunks * 4)
                        .ok_or_else(|| shape_err(OP, format!("{rows} rows x {chunks} chunks")))?,
                )?,
            ),
            None => None,
        };
        if let (Some((chunk, chunks)), Some(part)) = (plan, &part) {
            let partp = part.ptr();
            let (chunk32, chunks32) = (to_i32(OP, "chunk", chunk)?, to_i32(OP, "chunks", chunks)?);
            let f = self.func(Op::Sample, "sample_greedy_part")?;
            let cfg = self.cfg_rows(OP, chunks as u64, rows, 256)?;
            let mut b = self.args(&f);
            b.arg(&lp)
                .arg(&st)
                .arg(&n32)
                .arg(&chunk32)
                .arg(&pp)
                .arg(&rows64)
                .arg(&partp);
            // SAFETY: extents checked above; `part` holds rows x chunks records of 4 ints and
            // the kernel writes record (r, c) for c < chunks only (grid x = chunks).
            unsafe { self.launch(OP, b, cfg) }?;
            let f = self.func(Op::Sample, "sample_greedy_final")?;
            let cfg = self.cfg(OP, (rows as u64, 1, 1), 256)?;
            let mut b = self.args(&f);
            b.arg(&partp).arg(&chunks32).arg(&pp).arg(&rows64).arg(&op);
            // SAFETY: reads the records written above, writes out[r] for r < rows.
            unsafe { self.launch(OP, b, cfg) }?;
            if greedy == rows {
                return Ok(());
            }
        }
        let skip = i32::from(plan.is_some());
        let f = self.func(Op::Sample, "sample_rows")?;
        let cfg = self.cfg(OP, (rows as u64, 1, 1), 1024)?;
        let mut b = self.args(&f);
        b.arg(&lp).arg(&st).arg(&n32).arg(&pp).arg(&skip).arg(&op);
        // SAFETY: extents checked above; `dp` lives until the launch is queued, and the pool
        // only reuses it for work queued after this launch.
        unsafe { self.launch(OP, b, cfg) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_plans() {
        // GLM-5's vocabulary at decode on an H200 (132 SMs): 1,024 logits per block.
        assert_eq!(split_chunks(154_880, 1, 132), (1024, 152));
        assert_eq!(split_chunks(154_880, 8, 132), (3072, 51));
        assert_eq!(split_chunks(1, 1, 132), (1024, 1));
        assert_eq!(split_chunks(200_001, 1, 132), (1024, 196));
        for (n, rows, sms) in [
            (7usize, 3usize, 1u32),
            (1 << 24, 1, 188),
            (99_999, 1000, 132),
        ] {
            let (chunk, chunks) = split_chunks(n, rows, sms);
            assert_eq!(chunk % 1024, 0);
            assert!(chunk * chunks >= n && chunk * (chunks - 1) < n);
        }
        assert_eq!(greedy_plan(Split::Auto, 154_880, 1, 132), Some((1024, 152)));
        assert_eq!(greedy_plan(Split::Auto, 20_000, 1, 132), None);
        assert_eq!(greedy_plan(Split::Auto, 154_880, 600, 132), None);
        assert_eq!(greedy_plan(Split::OneBlock, 154_880, 1, 132), None);
        assert_eq!(greedy_plan(Split::Blocks, 31, 1, 132), Some((1024, 1)));
    }
}
