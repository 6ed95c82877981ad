//! DSA lightning indexer on the device: per-key scores and the top-k key selection.

use cudarc::driver::{CudaViewMut, DevicePtr, DevicePtrMut};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::launch::{shape_err, span};
use crate::ops::Op;
use crate::sample::{split_chunks, Split, TOPK_SPLIT_MIN};

/// Shapes and strides of one indexer call (f32 elements).
#[derive(Debug, Clone, Copy)]
pub struct IndexerShape {
    /// Query tokens S, indexer heads H, head width D (<= 256).
    pub tokens: usize,
    pub heads: usize,
    pub dim: usize,
    /// q is `[S, H, D]` with token stride `q_stride` (>= H*D).
    pub q_stride: usize,
    /// Key cache rows (stride `k_stride`) and the number of valid rows T.
    pub k_stride: usize,
    pub kv_len: usize,
    /// Per-head weights `[S, H]` (already times H^-0.5), token stride `w_stride`.
    pub w_stride: usize,
    /// Output scores `[S, T]`, token stride `out_stride` (>= T).
    pub out_stride: usize,
    /// D^-0.5.
    pub scale: f32,
}

/// Threads per block of `indexer_scores_lanes_bf16` (one key each) and the widest key it
/// holds in registers (indexer_scores.cu's IXL_THREADS / IXL_DMAX).
pub const IXL_THREADS: u32 = 256;
pub const IXL_DMAX: usize = 128;
/// Blocks per SM the lane-per-key kernel's token split aims for (ptxas: 72 registers a thread
/// for sm_90, so three 256-thread blocks are resident per SM; four cover a short tail).
const IXL_BLOCKS_PER_SM: usize = 4;
/// Keys from which the lane-per-key kernel is the default. Measured on one H100 on 2026-12-05
/// (`bench --kernels`, one query token, 32 heads x 128, bf16 keys): warp per key 15.0 / 19.8 /
/// 69.2 us at 2,048 / 4,096 / 32,768 keys, lane per key 35.2 / 35.1 / 45.6 us (its grid is one
/// block per 256 keys, so short caches leave most SMs idle). Straight lines through those
/// points cross near 15,000 keys; decode at depth 32,768 went from 521.4 to 545.5 tok/s.
pub const IXL_MIN_KEYS: usize = 16_384;

/// 0 = by default, 1 = the warp-per-key kernel, 2 = the lane-per-key kernel where it fits
/// (`GGUFTOOL_INDEXER_LANES=0|1`, or [`force_indexer_lanes`]).
static LANES_MODE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(u8::MAX);

/// `None` when nothing was forced (the default applies: the lane-per-key kernel from
/// [`IXL_MIN_KEYS`] keys on, the warp-per-key kernel below).
fn lanes_mode() -> Option<bool> {
    use std::sync::atomic::Ordering;
    let mut v = LANES_MODE.load(Ordering::Relaxed);
    if v == u8::MAX {
        v = match std::env::var("GGUFTOOL_INDEXER_LANES").as_deref() {
            Ok("0") => 1,
            Ok("1") => 2,
            _ => 0,
        };
        LANES_MODE.store(v, Ordering::Relaxed);
    }
    match v {
        1 => Some(false),
        2 => Some(true),
        _ => None,
    }
}

/// Force the indexer scorer for this process (tests and A/B runs): `Some(true)` the
/// lane-per-key kernel wherever [`lanes_fit`] holds, `Some(false)` the warp-per-key kernel,
/// `None` the default.
pub fn force_indexer_lanes(on: Option<bool>) {
    let v = match on {
        Some(false) => 1,
        Some(true) => 2,
        None => 0,
    };
    LANES_MODE.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the lane-per-key kernel takes a call: bf16 keys (checked by the caller), rows of
/// whole 16-byte loads (width a multiple of 8 up to [`IXL_DMAX`], stride and base 16-byte
/// aligned).
pub fn lanes_fit(sh: &IndexerShape, k_ptr: u64) -> bool {
    sh.dim.is_multiple_of(8)
        && sh.dim <= IXL_DMAX
        && sh.k_stride.is_multiple_of(8)
        && k_ptr.is_multiple_of(16)
}

/// Grid of the lane-per-key kernel: one key per thread in x; query tokens grid-strided in y,
/// as many as bring the launch to about [`IXL_BLOCKS_PER_SM`] blocks per SM (each y block
/// re-loads its keys, so no more than that), at most the device's y limit.
pub fn lanes_grid(sh: &IndexerShape, sm_count: usize, max_y: u32) -> (u64, u64) {
    let gx = sh.kv_len.div_ceil(IXL_THREADS as usize).max(1);
    let want = (IXL_BLOCKS_PER_SM * sm_count.max(1)).div_ceil(gx);
    let gy = want.clamp(1, sh.tokens.max(1)).min(max_y.max(1) as usize);
    (gx as u64, gy as u64)
}

/// Keys per block and threads per block of the tensor-core scorer `indexer_scores_tc_bf16`
/// (indexer_scores.cu's IXT_KEYS, 32 * IXT_WARPS), and its widest head count and key.
pub const IXT_KEYS: usize = 128;
pub const IXT_THREADS: u32 = 128;
pub const IXT_MAX_HEADS: usize = 32;
pub const IXT_DMAX: usize = 128;
/// Blocks per SM its token split aims for (2 resident: launch bounds; 4 cover a short tail).
const IXT_BLOCKS_PER_SM: usize = 4;

/// 0 = by default (the tensor-core scorer wherever it fits), 1 = never
/// (`GGUFTOOL_INDEXER_TC=0`; forcing a lane or warp scorer, [`force_indexer_lanes`], also
/// keeps it out).
static TC_MODE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(u8::MAX);

fn tc_on() -> bool {
    use std::sync::atomic::Ordering;
    let mut v = TC_MODE.load(Ordering::Relaxed);
    if v == u8::MAX {
        v = u8::from(std::env::var("GGUFTOOL_INDEXER_TC").as_deref() == Ok("0"));
        TC_MODE.store(v, Ordering::Relaxed);
    }
    v == 0
}

/// Whether the tensor-core scorer takes a call: bf16 keys (checked by the caller) of a width
/// that is a multiple of 32 up to [`IXT_DMAX`], rows of whole 16-byte loads (stride and base
/// 16-byte aligned), at most [`IXT_MAX_HEADS`] heads.
pub fn tc_fit(sh: &IndexerShape, k_ptr: u64) -> bool {
    sh.dim.is_multiple_of(32)
        && sh.dim <= IXT_DMAX
        && sh.heads <= IXT_MAX_HEADS
        && sh.k_stride.is_multiple_of(8)
        && k_ptr.is_multiple_of(16)
}

/// Grid of the tensor-core scorer: [`IXT_KEYS`] keys per block in x; query tokens
/// grid-strided in y (each block's key rows stay in L1 for its next token), as many as bring
/// the launch to about [`IXT_BLOCKS_PER_SM`] blocks per SM, at most the device's y limit.
pub fn tc_grid(sh: &IndexerShape, sm_count: usize, max_y: u32) -> (u64, u64) {
    let gx = sh.kv_len.div_ceil(IXT_KEYS).max(1);
    let want = (IXT_BLOCKS_PER_SM * sm_count.max(1)).div_ceil(gx);
    let gy = want.clamp(1, sh.tokens.max(1)).min(max_y.max(1) as usize);
    (gx as u64, gy as u64)
}

impl Gpu {
    /// `out[s,t] = sum_h w[s,h] * relu(scale * q[s,h] . k[t])` for `t <= pos[s]`, -inf otherwise.
    /// Keys f32 or bf16 (`u16` bit patterns).
    pub fn indexer_scores<C: crate::mla::CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        k: &impl DevicePtr<C>,
        w: &impl DevicePtr<f32>,
        pos: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<f32>,
        sh: IndexerShape,
    ) -> Result<(), KernelError> {
        const OP: &str = "indexer_scores";
        if sh.tokens == 0 || sh.heads == 0 || sh.kv_len == 0 {
            return Err(shape_err(OP, format!("empty shape {sh:?}")));
        }
        if sh.dim == 0 || sh.dim > 256 {
            return Err(shape_err(
                OP,
                format!("head width {} must be 1..=256", sh.dim),
            ));
        }
        if sh.q_stride < sh.heads * sh.dim || sh.out_stride < sh.kv_len || sh.k_stride < sh.dim {
            return Err(shape_err(OP, format!("strides too small for {sh:?}")));
        }
        need_len(
            OP,
            "q",
            dlen(q),
            span(sh.tokens, sh.q_stride, sh.heads * sh.dim),
        )?;
        need_len(OP, "k", dlen(k), span(sh.kv_len, sh.k_stride, sh.dim))?;
        need_len(OP, "w", dlen(w), span(sh.tokens, sh.w_stride, sh.heads))?;
        need_len(OP, "pos", dlen(pos), sh.tokens)?;
        need_len(
            OP,
            "out",
            dlen(out),
            span(sh.tokens, sh.out_stride, sh.kv_len),
        )?;
        let s = self.stream();
        let (kp, _g2) = k.device_ptr(s);
        let tc = C::BF16 && tc_on() && lanes_mode().is_none() && tc_fit(&sh, kp);
        let lanes =
            C::BF16 && lanes_mode().unwrap_or(sh.kv_len >= IXL_MIN_KEYS) && lanes_fit(&sh, kp);
        let (f, cfg) = if tc {
            let f = self.func(Op::IndexerScores, "indexer_scores_tc_bf16")?;
            let (gx, gy) = tc_grid(&sh, self.info().sm_count as usize, self.info().max_grid.1);
            (f, self.cfg(OP, (gx, gy, 1), IXT_THREADS)?)
        } else if lanes {
            let f = self.func(Op::IndexerScores, "indexer_scores_lanes_bf16")?;
            let (gx, gy) = lanes_grid(&sh, self.info().sm_count as usize, self.info().max_grid.1);
            (f, self.cfg(OP, (gx, gy, 1), IXL_THREADS)?)
        } else {
            let f = self.func(
                Op::IndexerScores,
                if C::BF16 {
                    "indexer_scores_bf16"
                } else {
                    "indexer_scores_f32"
                },
            )?;
            let cfg = self.cfg_rows(OP, (sh.kv_len as u64).div_ceil(8), sh.tokens, 256)?;
            (f, cfg)
        };
        let (qp, _g1) = q.device_ptr(s);
        let (wp, _g3) = w.device_ptr(s);
        let (pp, _g4) = pos.device_ptr(s);
        let (op, _g5) = out.device_ptr_mut(s);
        let qs = sh.q_stride as i64;
        let h = to_i32(OP, "heads", sh.heads)?;
        let d = to_i32(OP, "dim", sh.dim)?;
        let ks = sh.k_stride as i64;
        let ws = sh.w_stride as i64;
        let t = to_i32(OP, "kv_len", sh.kv_len)?;
        let os = sh.out_stride as i64;
        let mut b = self.args(&f);
        b.arg(&qp)
            .arg(&qs)
            .arg(&h)
            .arg(&d)
            .arg(&kp)
            .arg(&ks)
            .arg(&wp)
            .arg(&ws);
        let n64 = sh.tokens as i64;
        b.arg(&pp)
            .arg(&t)
            .arg(&sh.scale)
            .arg(&op)
            .arg(&os)
            .arg(&n64);
        // SAFETY: extents checked above.
        unsafe { self.launch(OP, b, cfg) }
    }

    /// Per row of `scores` (`rows` rows of `n`, `stride` apart): the indices of the `k` largest
    /// entries (ties to the lower index) in ascending order, `-1` padded; entries that are -inf
    /// or NaN are never selected, and when at most `k` remain all of them are kept.
    /// `out` is `[rows, k]`; `count[r]` (optional) receives the number selected.
    #[allow(clippy::too_many_arguments)]
    pub fn topk(
        &self,
        scores: &impl DevicePtr<f32>,
        rows: usize,
        n: usize,
        stride: usize,
        k: usize,
        out: &mut impl DevicePtrMut<i32>,
        count: Option<&mut CudaViewMut<'_, i32>>,
    ) -> Result<(), KernelError> {
        self.topk_split(scores, rows, n, stride, k, out, count, Split::Auto)
    }

    /// [`Gpu::topk`] with the launch plan chosen by `split`. One block per row (`topk_f32`),
    /// or, for rows of at least [`TOPK_SPLIT_MIN`] keys that [`split_chunks`] gives at least 4
    /// blocks (decode and short steps: rows up to about SMs / 2), each row over a grid of
    /// (chunks, rows) blocks: a memset of the row's histograms, tickets and states, four
    /// `topk_mb_hist` digit passes and `topk_mb_gather` (topk.cu). Same output either way.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_split(
        &self,
        scores: &impl DevicePtr<f32>,
        rows: usize,
        n: usize,
        stride: usize,
        k: usize,
        out: &mut impl DevicePtrMut<i32>,
        count: Option<&mut CudaViewMut<'_, i32>>,
        split: Split,
    ) -> Result<(), KernelError> {
        const OP: &str = "topk";
        if rows == 0 || n == 0 || k == 0 {
            return Err(shape_err(OP, "empty top-k"));
        }
        if n >= 1 << 24 {
            return Err(shape_err(OP, format!("row length {n} >= 2^24")));
        }
        need_len(OP, "scores", dlen(scores), span(rows, stride, n))?;
        need_len(OP, "out", dlen(out), rows * k)?;
        let plan = split_chunks(n, rows, self.info().sm_count);
        let plan = match split {
            Split::OneBlock => None,
            Split::Blocks => Some(plan),
            Split::Auto => (n >= TOPK_SPLIT_MIN && plan.1 >= 4).then_some(plan),
        };
        let s = self.stream();
        let (sp, _g1) = scores.device_ptr(s);
        let (op, _g2) = out.device_ptr_mut(s);
        let cp = match count {
            Some(c) => {
                need_len(OP, "count", c.len(), rows)?;
                c.device_ptr_mut(s).0
            }
            None => 0u64,
        };
        let st = stride as i64;
        let n32 = to_i32(OP, "n", n)?;
        let k32 = to_i32(OP, "k", k)?;
        let os = k as i64;
        let Some((chunk, chunks)) = plan else {
            let f = self.func(Op::TopK, "topk_f32")?;
            let cfg = self.cfg(OP, (rows as u64, 1, 1), 1024)?;
            let mut b = self.args(&f);
            b.arg(&sp)
                .arg(&st)
                .arg(&n32)
                .arg(&k32)
                .arg(&op)
                .arg(&os)
                .arg(&cp);
            // SAFETY: extents checked above.
            return unsafe { self.launch(OP, b, cfg) };
        };
        // Grid y is the row (no grid-stride: the split is for few rows).
        let cfg = self.cfg(OP, (chunks as u64, rows as u64, 1), TKM_THREADS)?;
        let chunk32 = to_i32(OP, "chunk", chunk)?;
        // Scratch from the pool: per row TKM_ZR zeroed ints (histograms, tickets, states),
        // then per chunk one candidate count and TKM_G ints of the last pass's table.
        let zlen = rows * TKM_ZR;
        let vlen = rows * chunks;
        let len = rows
            .checked_mul(chunks * (TKM_G + 1))
            .and_then(|v| v.checked_add(zlen))
            .ok_or_else(|| shape_err(OP, format!("{rows} rows x {chunks} chunks")))?;
        let mut scratch = self.alloc::<i32>(len)?;
        let zp = scratch.ptr();
        let vp = zp + 4 * zlen as u64;
        let gp = vp + 4 * vlen as u64;
        let t0 = self.prof_start()?;
        let zeroed = s.memset_zeros(&mut scratch.slice_mut(0..zlen));
        self.prof_stop(OP, t0)?;
        zeroed.map_err(KernelError::driver("cuMemsetD8Async"))?;
        let f = self.func(Op::TopK, "topk_mb_hist")?;
        for pass in 0..4i32 {
            let mut b = self.args(&f);
            b.arg(&sp)
                .arg(&st)
                .arg(&n32)
                .arg(&k32)
                .arg(&chunk32)
                .arg(&pass)
                .arg(&zp)
                .arg(&vp)
                .arg(&gp);
            // SAFETY: extents checked above; block (c, r) reads keys [c * chunk, n) of row r
            // only, and writes the row's TKM_ZR ints and its chunk's records in `scratch`.
            unsafe { self.launch(OP, b, cfg) }?;
        }
        let f = self.func(Op::TopK, "topk_mb_gather")?;
        let mut b = self.args(&f);
        b.arg(&sp)
            .arg(&st)
            .arg(&n32)
            .arg(&k32)
            .arg(&chunk32)
            .arg(&zp)
            .arg(&vp)
            .arg(&gp)
            .arg(&op)
            .arg(&os)
            .arg(&cp);
        // SAFETY: as above; writes out[r * k + j] for j < k and count[r].
        unsafe { self.launch(OP, b, cfg) }
    }
}

/// Zeroed ints per row of the split top-k, threads per block and ints per chunk of its
/// last-pass table (topk.cu's TKM_ZR, TKM_THREADS, TKM_G).
const TKM_ZR: usize = 1056;
const TKM_THREADS: u32 = 256;
const TKM_G: usize = 257;
