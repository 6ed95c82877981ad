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

/// Columns (tokens) per tile of the grouped expert GEMVs (8 activation columns per weight load),
/// and of the narrow tile set of the tensor-core launches.
pub const MOE_TILE: usize = 8;

/// Widths of the wide tile set [`Gpu::moe_group`] takes: the column counts of the tensor-core
/// kernel (mmq.cu). An expert chosen by `c` tokens has its weights read `ceil(c / width)` times.
pub const MOE_TILE_WIDTHS: [usize; 3] = [16, 32, 64];

/// The wide tile width for a batch of `tokens` tokens on the tensor cores: none up to 8 tokens
/// (no expert can have more than the narrow tile holds), else the narrowest of
/// [`MOE_TILE_WIDTHS`] that holds them all, at most 64, so an expert every token chose is read
/// once per 64 tokens, not once per 8 (a prompt may route most of its tokens to the same
/// experts: with 8-column tiles only, pp64 cost twice pp32 per token on the GLM-5-shaped bench
/// model; with the wide set pp64 went from 9,130-9,206 to 10,027-10,159 tok/s, H100).
pub fn moe_mmq_tile(tokens: usize) -> Option<usize> {
    (tokens > MOE_TILE).then(|| {
        MOE_TILE_WIDTHS
            .into_iter()
            .find(|&w| w >= tokens)
            .unwrap_or(64)
    })
}

/// One set of tiles of [`ExpertGroups`], as the maps the grouped [`Gpu::gemv_q`] / [`Gpu::mmq`]
/// launches take (`QChannels` with `count = max_tiles`, `ncols = width`): tile `i` uses expert
/// `tile_expert[i]` (-1: unused tile); its column `j` (entry `i * width + j`, -1: unused) is
/// token `tok[..]`, sorted position `pos[..]` and pair `pair[..]` (= token * top_k + slot).
pub struct TileSet {
    pub width: usize,
    pub max_tiles: usize,
    pub tile_expert: DevBuf<i32>,
    pub tok: DevBuf<i32>,
    pub pos: DevBuf<i32>,
    pub pair: DevBuf<i32>,
}

/// A batch's (token, slot) pairs grouped by expert (moe_sort.cu). `sets[0]`: tiles of
/// [`MOE_TILE`] columns: every expert's pairs, or with a wide set only the experts with at most
/// [`MOE_TILE`] pairs (one tile each); `sets[1]`, if asked for: tiles of the wide width for the
/// experts with more. Sorted positions run over all experts in id order, whichever set holds
/// them, so the sets' launches write disjoint rows of one buffer.
pub struct ExpertGroups {
    pub sets: Vec<TileSet>,
    _work: [DevBuf<i32>; 3],
}

/// moe_sort.cu's `MoeTiles` (no padding: pointers first).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MoeTiles {
    tile_expert: u64,
    tok: u64,
    pos: u64,
    pair: u64,
    max_tiles: i32,
    width: i32,
}
const _: () = assert!(std::mem::size_of::<MoeTiles>() == 40);
// SAFETY: plain integers, laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for MoeTiles {}

impl Gpu {
    fn tile_set(&self, width: usize, max_tiles: usize) -> Result<TileSet, KernelError> {
        Ok(TileSet {
            width,
            max_tiles,
            tile_expert: self.alloc::<i32>(max_tiles.max(1))?,
            tok: self.alloc::<i32>((max_tiles * width).max(1))?,
            pos: self.alloc::<i32>((max_tiles * width).max(1))?,
            pair: self.alloc::<i32>((max_tiles * width).max(1))?,
        })
    }

    fn tiles_arg(&self, t: &TileSet) -> Result<MoeTiles, KernelError> {
        const OP: &str = "moe_sort";
        // The maps' entries are ints.
        to_i32(OP, "map entries", t.max_tiles * t.width)?;
        Ok(MoeTiles {
            tile_expert: t.tile_expert.ptr(),
            tok: t.tok.ptr(),
            pos: t.pos.ptr(),
            pair: t.pair.ptr(),
            max_tiles: to_i32(OP, "tiles", t.max_tiles)?,
            width: to_i32(OP, "tile width", t.width)?,
        })
    }

    /// Group `n_pairs` expert ids (`top_k` per token, -1 = none) by expert, on the device and
    /// without reading the routing back: tiles of [`MOE_TILE`] columns, and with `wide` (one
    /// of [`MOE_TILE_WIDTHS`]) a second set of that width for the experts with more than
    /// [`MOE_TILE`] pairs. Tile counts are the worst cases: `ceil(n / 8) + E` for one set;
    /// `min(E, n)` narrow and `ceil(n / wide) + min(E, n / 9)` wide for two.
    pub fn moe_group(
        &self,
        ids: &impl DevicePtr<i32>,
        n_pairs: usize,
        top_k: usize,
        n_experts: usize,
        wide: Option<usize>,
    ) -> Result<ExpertGroups, KernelError> {
        const OP: &str = "moe_sort";
        if n_pairs == 0
            || top_k == 0
            || n_experts == 0
            || n_pairs >= 1 << 24
            || wide.is_some_and(|w| !MOE_TILE_WIDTHS.contains(&w))
        {
            return Err(shape_err(
                OP,
                format!("{n_pairs} pairs, top_k {top_k}, {n_experts} experts, wide tiles {wide:?}"),
            ));
        }
        need_len(OP, "ids", dlen(ids), n_pairs)?;
        let sets = match wide {
            None => vec![self.tile_set(MOE_TILE, n_pairs.div_ceil(MOE_TILE) + n_experts)?],
            Some(w) => {
                let big = n_pairs / (MOE_TILE + 1);
                vec![
                    self.tile_set(MOE_TILE, n_experts.min(n_pairs))?,
                    self.tile_set(w, n_pairs.div_ceil(w) + n_experts.min(big))?,
                ]
            }
        };
        let small = self.tiles_arg(&sets[0])?;
        let big = match sets.get(1) {
            Some(t) => self.tiles_arg(t)?,
            None => MoeTiles::default(),
        };
        let mut counts = self.alloc::<i32>(n_experts)?;
        let mut offsets = self.alloc::<i32>(n_experts)?;
        let mut tile_base = self.alloc::<i32>(n_experts)?;
        let (ip, _g) = ids.device_ptr(self.stream());
        let (n32, e32, k32) = (
            to_i32(OP, "pairs", n_pairs)?,
            to_i32(OP, "experts", n_experts)?,
            to_i32(OP, "top_k", top_k)?,
        );
        let (cp, op, bp) = (counts.ptr(), offsets.ptr(), tile_base.ptr());
        let f = self.func(Op::MoeSort, "moe_count")?;
        let mut b = self.args(&f);
        b.arg(&ip).arg(&n32).arg(&cp);
        // SAFETY: ids holds n_pairs values, counts n_experts.
        unsafe { self.launch(OP, b, self.cfg(OP, (n_experts as u64, 1, 1), 256)?) }?;
        let f = self.func(Op::MoeSort, "moe_plan")?;
        let mut b = self.args(&f);
        b.arg(&cp).arg(&e32).arg(&small).arg(&big).arg(&op).arg(&bp);
        // SAFETY: every buffer sized above for n_experts / its set's tiles; an absent wide set
        // has no tiles and is never written.
        unsafe { self.launch(OP, b, self.cfg(OP, (1, 1, 1), 1024)?) }?;
        let f = self.func(Op::MoeSort, "moe_scatter")?;
        let mut b = self.args(&f);
        b.arg(&ip).arg(&n32).arg(&k32).arg(&op).arg(&bp);
        b.arg(&small).arg(&big);
        // SAFETY: as above; tiles beyond a set's max_tiles are never written (checked in the
        // kernel).
        unsafe { self.launch(OP, b, self.cfg(OP, (n_experts as u64, 1, 1), 1024)?) }?;
        let _ = (&mut counts, &mut offsets, &mut tile_base);
        Ok(ExpertGroups {
            sets,
            _work: [counts, offsets, tile_base],
        })
    }
}
