//! MoE on the device: sigmoid routing with group-limited top-k, and the weighted combination of
//! the selected experts' outputs. The expert GEMVs themselves are [`Gpu::gemv_batched`] with ids,
//! which read only the selected experts' slabs.

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::launch::{opt_ptr, shape_err, span};
use crate::ops::Op;
use crate::pool::DevBuf;

/// How router logits become expert probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    Sigmoid,
    Softmax,
}

/// Router hyper-parameters (spec §1.10).
#[derive(Debug, Clone, Copy)]
pub struct RouterConfig {
    pub gating: Gating,
    pub n_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub top_k: usize,
    /// `norm_topk_prob`: divide the selected weights by their sum (+1e-20).
    pub norm: bool,
    /// `routed_scaling_factor`.
    pub scale: f32,
}

impl Gpu {
    /// Route `tokens` rows of router logits (`[tokens, n_experts]`, row stride `stride`):
    /// `ids[t, k]` = chosen experts (descending by biased score, ties to the lower id),
    /// `weights[t, k]` = their normalized, scaled sigmoid scores.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        logits: &impl DevicePtr<f32>,
        tokens: usize,
        stride: usize,
        bias: Option<&CudaView<'_, f32>>,
        cfg: RouterConfig,
        ids: &mut impl DevicePtrMut<i32>,
        weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "moe_router";
        let e = cfg.n_experts;
        if tokens == 0 || e == 0 || e > 1024 {
            return Err(shape_err(
                OP,
                format!("{tokens} tokens, {e} experts (1..=1024)"),
            ));
        }
        if cfg.top_k == 0 || cfg.top_k > e || cfg.top_k > 64 {
            return Err(shape_err(
                OP,
                format!("top_k {} must be 1..=min(64, experts)", cfg.top_k),
            ));
        }
        if cfg.n_group == 0 || cfg.n_group > 64 || !e.is_multiple_of(cfg.n_group) {
            return Err(shape_err(
                OP,
                format!("n_group {} must divide {e} and be <= 64", cfg.n_group),
            ));
        }
        if cfg.topk_group == 0 || cfg.topk_group > cfg.n_group {
            return Err(shape_err(
                OP,
                format!("topk_group {} must be 1..=n_group", cfg.topk_group),
            ));
        }
        need_len(OP, "logits", dlen(logits), span(tokens, stride, e))?;
        need_len(OP, "ids", dlen(ids), tokens * cfg.top_k)?;
        need_len(OP, "weights", dlen(weights), tokens * cfg.top_k)?;
        let f = self.func(Op::MoeRouter, "moe_router_f32")?;
        let block = e.div_ceil(32) as u32 * 32;
        let lc = self.cfg(OP, (tokens as u64, 1, 1), block)?;
        let s = self.stream();
        let bp = opt_ptr(OP, "bias", bias, e, s)?;
        let (lp, _g1) = logits.device_ptr(s);
        let (ip, _g2) = ids.device_ptr_mut(s);
        let (wp, _g3) = weights.device_ptr_mut(s);
        let st = stride as i64;
        let e32 = to_i32(OP, "experts", e)?;
        let ng = to_i32(OP, "n_group", cfg.n_group)?;
        let tg = to_i32(OP, "topk_group", cfg.topk_group)?;
        let tk = to_i32(OP, "top_k", cfg.top_k)?;
        let norm = i32::from(cfg.norm);
        let mut b = self.args(&f);
        b.arg(&lp)
            .arg(&st)
            .arg(&e32)
            .arg(&bp)
            .arg(&ng)
            .arg(&tg)
            .arg(&tk);
        let gating: i32 = match cfg.gating {
            Gating::Sigmoid => 0,
            Gating::Softmax => 1,
        };
        b.arg(&norm).arg(&cfg.scale).arg(&ip).arg(&wp).arg(&gating);
        // SAFETY: extents checked above.
        unsafe { self.launch(OP, b, lc) }
    }

    /// Expert ids re-based in place to the experts `first .. first + count` this rank holds
    /// (expert parallelism): `e - first` for those, `-1` (an empty slot) for every other id.
    pub fn moe_local_ids(
        &self,
        ids: &mut impl DevicePtrMut<i32>,
        n: usize,
        first: usize,
        count: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "moe_router";
        if n == 0 {
            return Ok(());
        }
        need_len(OP, "ids", dlen(ids), n)?;
        let f = self.func(Op::MoeRouter, "moe_local_ids")?;
        let threads = 256u32;
        let blocks = n.div_ceil(threads as usize).min(1024) as u64;
        let lc = self.cfg(OP, (blocks, 1, 1), threads)?;
        let s = self.stream();
        let (ip, _g) = ids.device_ptr_mut(s);
        let n64 = n as i64;
        let (fi, ci) = (to_i32(OP, "first", first)?, to_i32(OP, "count", count)?);
        let mut b = self.args(&f);
        b.arg(&ip).arg(&n64).arg(&fi).arg(&ci);
        // SAFETY: ids holds n values (checked above); the kernel is grid-stride over n.
        unsafe { self.launch(OP, b, lc) }
    }

    /// `out[t] = sum_k w[t,k] * y[t*top_k + k]` (+ `out[t]` when `accumulate`), `d` values per
    /// row; `y` rows are `y_stride` apart, `out` rows `out_stride` apart. With `ids`, slots whose
    /// expert id is negative (empty) are skipped.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        y: &impl DevicePtr<f32>,
        y_stride: usize,
        w: &impl DevicePtr<f32>,
        tokens: usize,
        top_k: usize,
        d: usize,
        out: &mut impl DevicePtrMut<f32>,
        out_stride: usize,
        accumulate: bool,
        ids: Option<&CudaView<'_, i32>>,
    ) -> Result<(), KernelError> {
        const OP: &str = "moe_combine";
        if tokens == 0 || top_k == 0 || d == 0 {
            return Err(shape_err(OP, "empty combine"));
        }
        need_len(OP, "y", dlen(y), span(tokens * top_k, y_stride, d))?;
        need_len(OP, "w", dlen(w), tokens * top_k)?;
        need_len(OP, "out", dlen(out), span(tokens, out_stride, d))?;
        let f = self.func(Op::MoeCombine, "moe_combine_f32")?;
        let lc = self.cfg_rows(OP, (d as u64).div_ceil(256), tokens, 256)?;
        let s = self.stream();
        let (yp, _g1) = y.device_ptr(s);
        let (wp, _g2) = w.device_ptr(s);
        let (op, _g3) = out.device_ptr_mut(s);
        let ys = y_stride as i64;
        let k32 = to_i32(OP, "top_k", top_k)?;
        let d32 = to_i32(OP, "d", d)?;
        let os = out_stride as i64;
        let acc = i32::from(accumulate);
        let ip = opt_ptr(OP, "ids", ids, tokens * top_k, s)?;
        let mut b = self.args(&f);
        b.arg(&yp)
            .arg(&ys)
            .arg(&wp)
            .arg(&k32)
            .arg(&d32)
            .arg(&op)
            .arg(&os);
        let t64 = tokens as i64;
        b.arg(&acc).arg(&ip).arg(&t64);
        // SAFETY: extents checked above.
        unsafe { self.launch(OP, b, lc) }
    }
}

/// Columns (tokens) per tile of the grouped expert GEMVs (moe_sort.cu's MOE_TILE).
pub const MOE_TILE: usize = 8;

/// A batch's (token, slot) pairs grouped by expert (moe_sort.cu), as the maps the grouped
/// [`Gpu::gemv_q`] launches take: tile `i` of up to [`MOE_TILE`] pairs uses expert
/// `tile_expert[i]` (-1: unused tile); its column `j` (entry `i * MOE_TILE + j`, -1: unused)
/// is token `tok[..]`, sorted position `pos[..]` and pair `pair[..]` (= token * top_k + slot).
pub struct ExpertGroups {
    pub max_tiles: usize,
    pub tile_expert: DevBuf<i32>,
    pub tok: DevBuf<i32>,
    pub pos: DevBuf<i32>,
    pub pair: DevBuf<i32>,
    _work: [DevBuf<i32>; 3],
}

impl Gpu {
    /// Group `n_pairs` expert ids (`top_k` per token, -1 = none) by expert, on the device and
    /// without reading the routing back: the tile count is the worst case
    /// `ceil(n_pairs / MOE_TILE) + n_experts`.
    pub fn moe_group(
        &self,
        ids: &impl DevicePtr<i32>,
        n_pairs: usize,
        top_k: usize,
        n_experts: usize,
    ) -> Result<ExpertGroups, KernelError> {
        const OP: &str = "moe_sort";
        if n_pairs == 0 || top_k == 0 || n_experts == 0 || n_pairs >= 1 << 24 {
            return Err(shape_err(
                OP,
                format!("{n_pairs} pairs, top_k {top_k}, {n_experts} experts"),
            ));
        }
        need_len(OP, "ids", dlen(ids), n_pairs)?;
        let max_tiles = n_pairs.div_ceil(MOE_TILE) + n_experts;
        let mut counts = self.alloc::<i32>(n_experts)?;
        let mut offsets = self.alloc::<i32>(n_experts)?;
        let mut tile_base = self.alloc::<i32>(n_experts)?;
        let tile_expert = self.alloc::<i32>(max_tiles)?;
        let tok = self.alloc::<i32>(max_tiles * MOE_TILE)?;
        let pos = self.alloc::<i32>(max_tiles * MOE_TILE)?;
        let pair = self.alloc::<i32>(max_tiles * MOE_TILE)?;
        let (ip, _g) = ids.device_ptr(self.stream());
        let (n32, e32, k32, mt) = (
            to_i32(OP, "pairs", n_pairs)?,
            to_i32(OP, "experts", n_experts)?,
            to_i32(OP, "top_k", top_k)?,
            to_i32(OP, "tiles", max_tiles)?,
        );
        let (cp, op, bp) = (counts.ptr(), offsets.ptr(), tile_base.ptr());
        let (tp, kp, pp, rp) = (tile_expert.ptr(), tok.ptr(), pos.ptr(), pair.ptr());
        let f = self.func(Op::MoeSort, "moe_count")?;
        let mut b = self.args(&f);
        b.arg(&ip).arg(&n32).arg(&cp);
        // SAFETY: ids holds n_pairs values, counts n_experts.
        unsafe { self.launch(OP, b, self.cfg(OP, (n_experts as u64, 1, 1), 256)?) }?;
        let f = self.func(Op::MoeSort, "moe_plan")?;
        let mut b = self.args(&f);
        b.arg(&cp).arg(&e32).arg(&mt).arg(&k32).arg(&op).arg(&bp);
        b.arg(&tp).arg(&kp).arg(&pp).arg(&rp);
        // SAFETY: every buffer sized above for n_experts / max_tiles.
        unsafe { self.launch(OP, b, self.cfg(OP, (1, 1, 1), 1024)?) }?;
        let f = self.func(Op::MoeSort, "moe_scatter")?;
        let mut b = self.args(&f);
        b.arg(&ip).arg(&n32).arg(&k32).arg(&op).arg(&bp).arg(&mt);
        b.arg(&kp).arg(&pp).arg(&rp);
        // SAFETY: as above; tiles beyond max_tiles are never written (checked in the kernel).
        unsafe { self.launch(OP, b, self.cfg(OP, (n_experts as u64, 1, 1), 1024)?) }?;
        let _ = (&mut counts, &mut offsets, &mut tile_base);
        Ok(ExpertGroups {
            max_tiles,
            tile_expert,
            tok,
            pos,
            pair,
            _work: [counts, offsets, tile_base],
        })
    }
}
