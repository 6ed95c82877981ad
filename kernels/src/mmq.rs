//! The tensor-core matrix product for 8..64 activation columns (kernels/cuda/mmq.cu): quantized
//! weights read once per launch straight into int8 `mma.sync` fragments, q8a activations
//! ([`Q8Act`]) staged in shared memory once per block, the per-block f32 scaling of gemvq. The
//! interface mirrors [`Gpu::gemv_q`] (same [`QChannels`] maps, modes plain / accumulate / GLU),
//! so a caller switches per launch: prefill steps of 9-64 tokens (one channel, `ncols` >= the
//! token count) and the grouped MoE tiles of [`Gpu::moe_group`] (8 columns, and 16-64 for the
//! wide set of [`crate::moe_mmq_tile`]).
//!
//! Error: the integer block sums are exact, so as for gemvq the only approximation is the
//! activation rounding ([`crate::Q8_REL_ERR`]) plus f32 rounding of the per-block scaling and
//! the sums over blocks: per output |y - y_q| <= (K/32 + 3 + ks + kz) * 2^-24 * sum_b |term_b|
//! (up to 3 roundings per block term, one per addition, the k-split's and the k-slices' sums
//! one each; y_q = the exact product with the quantized activations). The tests use gemvq's
//! `(K/32 + 16) * 4 * 2^-24` bound, which covers it for every plan (ks + kz <= 8 + 64).

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};

use crate::dequant::check_aligned;
use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::gemv::MatShape;
use crate::gemvq::{kind_name, Q8Act, QChannels, QMode};
use crate::launch::shape_err;
use crate::ops::{Op, QType};

/// K per warp step (mmq.cu `MQ_STEP`): a step loads 128 weights of each of its 16 rows.
pub const MMQ_STEP: usize = 128;

/// Warps per block of every mmq launch.
pub const MMQ_WARPS: usize = 8;

/// Windows in the shared-memory ring (mmq.cu `MQ_STAGES`): while window w is computed, w + 2
/// and w + 3 are being copied.
pub const MMQ_STAGES: usize = 4;

/// Shared-memory bytes of one staged weight row of one 128-k step (mmq.cu `MqType::SROW`, which
/// the kernel checks against this at entry): Q4_K's header + 64 code bytes (80) padded to 96,
/// which puts the 8-byte code loads of a half-warp's four rows on distinct banks; Q5_K and Q6_K
/// 112 (header + qh + codes; ql + qh + scales + d); Q8_0 144 (4 blocks + their d).
pub fn mmq_stage_row_bytes(qt: QType) -> usize {
    match qt {
        QType::Q4K => 96,
        QType::Q5K | QType::Q6K => 112,
        _ => 144,
    }
}

/// The kernels: `(name prefix, columns, GLU, k-sliced)`; the name is the prefix + the type's
/// suffix.
pub(crate) const MMQ_VARIANTS: [(&str, usize, bool, bool); 16] = [
    ("mmq8_", 8, false, false),
    ("mmq16_", 16, false, false),
    ("mmq32_", 32, false, false),
    ("mmq64_", 64, false, false),
    ("mmq_glu8_", 8, true, false),
    ("mmq_glu16_", 16, true, false),
    ("mmq_glu32_", 32, true, false),
    ("mmq_glu64_", 64, true, false),
    ("mmq8s_", 8, false, true),
    ("mmq16s_", 16, false, true),
    ("mmq32s_", 32, false, true),
    ("mmq64s_", 64, false, true),
    ("mmq_glu8s_", 8, true, true),
    ("mmq_glu16s_", 16, true, true),
    ("mmq_glu32s_", 32, true, true),
    ("mmq_glu64s_", 64, true, true),
];

/// The kernel entry for `ncols` columns (8, 16, 32 or 64) of type `qt`, GLU or not, for a
/// k-sliced plan ([`MmqPlan::kz`] > 1) or not.
pub fn mmq_kernel_name(qt: QType, ncols: usize, glu: bool, sliced: bool) -> Option<String> {
    MMQ_VARIANTS
        .iter()
        .find(|v| v.1 == ncols && v.2 == glu && v.3 == sliced)
        .map(|v| format!("{}{}", v.0, qt.suffix()))
}

/// Whether `shape` has a tensor-core matrix product: Q4_K / Q5_K in GGUF blocks, Q6_K / Q8_0
/// repacked, K a whole number of 128-weight steps (and of Q4_K/Q5_K/Q6_K's 256 superblocks).
pub fn mmq_supported(shape: &MatShape) -> bool {
    match QType::of(shape.ty) {
        Some(q) if QType::MMQ.contains(&q) => {
            shape.packed == crate::repack::is_packed(shape.ty)
                && shape.k > 0
                && shape.k.is_multiple_of(MMQ_STEP)
                && shape.k.is_multiple_of(shape.ty.block_size())
        }
        _ => false,
    }
}

/// The launch of one mmq call: grid, block, dynamic shared memory and the k-split. The wrapper
/// and the CPU-emulation tests both launch with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmqPlan {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Warps per 16-row tile splitting K (1, 2, 4, 8); `MMQ_WARPS / ks` tiles per block.
    pub ks: usize,
    pub smem: usize,
    /// k-slices (`grid[2]`): slice z takes windows `z * wpz ..` of the `ks * 128`-k windows;
    /// with more than one, each slice writes its raw sums to a workspace ([`MmqPlan::ws_len`])
    /// and `mmq_reduce` adds them in slice order and writes the outputs.
    pub kz: usize,
    pub wpz: usize,
}

impl MmqPlan {
    /// f32 entries of the slices' partial sums: `kz x (2 with GLU) x ncols x rows`, none
    /// without slices.
    pub fn ws_len(&self, ncols: usize, rows: usize, glu: bool) -> usize {
        if self.kz > 1 {
            self.kz * if glu { 2 } else { 1 } * ncols * rows
        } else {
            0
        }
    }

    /// The same launch cut into at most `kz` k-slices of whole windows (no empty slice: the
    /// count is what `wpz` windows per slice need). Only single-channel launches without slab
    /// ids may be sliced (the workspace holds one channel).
    pub fn sliced(mut self, kz: usize) -> MmqPlan {
        let windows = self.kz * self.wpz; // the unsliced plan: kz 1, wpz = all windows
        debug_assert_eq!(self.kz, 1);
        self.wpz = windows.div_ceil(kz.clamp(1, windows.max(1))).max(1);
        self.kz = windows.div_ceil(self.wpz).max(1);
        self.grid[2] = self.kz as u32;
        self
    }
}

/// Whether a launch may be cut into k-slices: one channel (the workspace holds one), no slab
/// ids (no NaN channel), and one slice's partial sums (`(1 + GLU) x ncols x rows`) addressed in
/// 32 bits, as the sliced kernels' epilogue does.
pub fn mmq_sliceable(channels: usize, ids: bool, rows: usize, ncols: usize, glu: bool) -> bool {
    channels == 1
        && !ids
        && (1 + usize::from(glu))
            .checked_mul(ncols)
            .and_then(|v| v.checked_mul(rows))
            .is_some_and(|v| v <= i32::MAX as usize)
}

/// The most k-slices a plan makes of a dense product.
pub const MMQ_MAX_SLICES: usize = 8;

/// Resident blocks per SM the plan aims at: two blocks of 8 warps (16 warps of up to 128
/// registers) keep ~2 x 8 x D x 16 rows x 128 weights in flight per SM.
const BLOCKS_PER_SM: usize = 2;

/// Blocks of a sliced kernel an SM holds by registers (the only launches planned by
/// residency): mmq.cu's MQ_KERNEL list asks for two (`__launch_bounds__(256, 2)`) for the
/// 8-16-column plain kernels, one for the others (more accumulators, or spills at 128).
fn blocks_by_registers(ncols: usize, glu: bool) -> usize {
    if !glu && ncols <= 16 {
        BLOCKS_PER_SM
    } else {
        1
    }
}

/// Blocks of `plan` resident per SM: the registers' limit and the shared memory's (the driver
/// keeps 1 KiB per block; an SM has that much beside the opt-in maximum of one block).
fn resident(plan: &MmqPlan, ncols: usize, glu: bool, max_smem: usize) -> usize {
    let smem = (max_smem + 1024) / (plan.smem + 1024);
    blocks_by_registers(ncols, glu).min(smem).max(1)
}

/// Shared memory of a launch's ring (mmq.cu): per stage the window's codes (per column its
/// codes + 32 bytes), its raw records (8 bytes per 32-block and column) and every warp's staged
/// weight rows (16 per matrix); then two buffers of converted records.
fn ring_bytes(qt: QType, ncols: usize, ks: usize, glu: bool) -> usize {
    let wk = ks * MMQ_STEP;
    let recs = ncols * (wk / 32) * 8;
    let weights = MMQ_WARPS * if glu { 2 } else { 1 } * 16 * mmq_stage_row_bytes(qt);
    MMQ_STAGES * (ncols * (wk + 32) + recs + weights) + 2 * recs
}

/// Whether `ks` warps may split K for one 16-row tile: `ks` in 1, 2, 4, 8 and every warp has a
/// step (`ks <= k / 128`). (Whether the launch fits the device's shared memory is the plan's
/// question, [`mmq_plan_ks`].)
pub fn mmq_ks_allowed(ks: usize, k: usize) -> bool {
    ks == 1 || (matches!(ks, 2 | 4 | 8) && ks <= k / MMQ_STEP)
}

/// The launch of type `qt` with a given k-split (`None` when [`mmq_ks_allowed`] refuses it or
/// its shared memory exceeds `max_smem`): `MMQ_WARPS / ks` row tiles per block, one block row
/// per channel up to the grid's y limit (`max_grid_y`; more channels are grid-strided), shared
/// memory for the ring or, when `ks > 1`, the partial sums of every warp, whichever is larger.
#[allow(clippy::too_many_arguments)]
pub fn mmq_plan_ks(
    qt: QType,
    rows: usize,
    k: usize,
    ncols: usize,
    channels: usize,
    glu: bool,
    max_grid_y: usize,
    max_smem: usize,
    ks: usize,
) -> Option<MmqPlan> {
    if !mmq_ks_allowed(ks, k) {
        return None;
    }
    let windows = (k / MMQ_STEP).div_ceil(ks).max(1);
    let tiles = rows.div_ceil(16).max(1);
    let reduce = if ks > 1 {
        MMQ_WARPS * if glu { 2 } else { 1 } * (ncols / 2) * 32 * 4
    } else {
        0
    };
    Some(MmqPlan {
        grid: [
            tiles.div_ceil(MMQ_WARPS / ks) as u32,
            channels.clamp(1, max_grid_y.max(1)) as u32,
            1,
        ],
        block: [(32 * MMQ_WARPS) as u32, 1, 1],
        ks,
        smem: ring_bytes(qt, ncols, ks, glu).max(reduce),
        kz: 1,
        wpz: windows,
    })
    .filter(|p| p.smem <= max_smem)
}

/// The launch of `channels` products of `rows x k` weights of type `qt` by `ncols` columns (8,
/// 16, 32, 64) on `sms` SMs (`max_grid_y`: the device's grid.y limit; `max_smem`: its shared
/// memory per block), `None` when no k-split fits the shared memory. `sliceable`: one channel
/// without slab ids (a dense product), which may be cut into k-slices.
///
/// Dense products: 8 row tiles per block (`ks` 1: each window's activations staged once for
/// all of them, the smallest ring), cut into the k-slices (up to [`MMQ_MAX_SLICES`], each at
/// least 2 windows long) that take the fewest waves of resident blocks per unit of work (the
/// smallest count among equals). (Splitting K inside a block instead multiplies the ring by
/// `ks`: at 32-64 columns one block per SM, and the 64-column attn_output at ks 1 left 84 of
/// 132 SMs idle.)
///
/// Other launches: a block holds `MMQ_WARPS / ks` row tiles; splitting K over more warps makes
/// more, shorter blocks. The smallest allowed `ks` ([`mmq_ks_allowed`]) that gives every SM
/// [`BLOCKS_PER_SM`] blocks wins (more splitting only adds the reduction and re-reads of the
/// activations per row tile); without one, the largest allowed. Grouped MoE launches (hundreds
/// of tiles) stay at 1.
#[allow(clippy::too_many_arguments)]
pub fn mmq_plan(
    qt: QType,
    rows: usize,
    k: usize,
    ncols: usize,
    channels: usize,
    glu: bool,
    sms: usize,
    max_grid_y: usize,
    max_smem: usize,
    sliceable: bool,
) -> Option<MmqPlan> {
    let plan = |ks| mmq_plan_ks(qt, rows, k, ncols, channels, glu, max_grid_y, max_smem, ks);
    if sliceable && channels == 1 {
        if let Some(p) = plan(1) {
            // Waves of resident blocks per unit of work: slices shorten the blocks, so a
            // partial last wave costs less; up to MMQ_MAX_SLICES (each slice's partial sums
            // are written and read once more) of at least 2 windows each.
            let slots = (resident(&p, ncols, glu, max_smem) * sms.max(1)) as u64;
            let base = u64::from(p.grid[0]).max(1);
            let cost = |kz: u64| ((base * kz).div_ceil(slots) * 1_000_000) / kz;
            let most = (p.wpz / 2).clamp(1, MMQ_MAX_SLICES) as u64;
            let kz = (1..=most).min_by_key(|&kz| (cost(kz), kz)).unwrap_or(1);
            return Some(p.sliced(kz as usize));
        }
    }
    let target = (BLOCKS_PER_SM * sms.max(1)) as u64;
    let fills = |p: &MmqPlan| u64::from(p.grid[0]) * u64::from(p.grid[1]) >= target;
    let allowed: Vec<MmqPlan> = [1usize, 2, 4, 8].into_iter().filter_map(plan).collect();
    allowed
        .iter()
        .find(|p| fills(p))
        .or(allowed.last())
        .copied()
}

/// The q8a activations in the kernel parameter (`MqQ8A` in mmq.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MmqX {
    pub qs: u64,
    pub ds: u64,
    pub rows: i64,
}

/// The kernel parameter (`struct Mmq` in mmq.cu), public for the CPU-emulation tests, which
/// launch the kernels on host memory (addresses as u64).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MmqParams {
    pub w: u64,
    pub w2: u64,
    /// Decoder blocks of the whole tensor (all slabs): the repacked layouts' region offsets.
    pub nblk: i64,
    pub ids: u64,
    pub xidx: u64,
    pub x: MmqX,
    pub y: u64,
    pub yidx: u64,
    pub y_stride: i64,
    pub y_rows: i64,
    /// The k-slices' partial sums ([`MmqPlan::ws_len`] floats; 0 without slices).
    pub ws: u64,
    pub nrows: i32,
    pub k: i32,
    pub n_slabs: i32,
    pub count: i32,
    pub ncols: i32,
    pub x_div: i32,
    pub ks: i32,
    pub accum: i32,
    /// Shared-memory bytes per staged weight row ([`mmq_stage_row_bytes`]).
    pub srow: i32,
    pub kz: i32,
    pub wpz: i32,
    pub pad: i32,
}

// SAFETY: plain structs laid out exactly as `MqQ8A` / `Mmq` in mmq.cu.
unsafe impl DeviceRepr for MmqX {}
unsafe impl DeviceRepr for MmqParams {}

fn opt_ptr<T>(v: Option<&cudarc::driver::CudaView<'_, T>>, g: &Gpu) -> u64 {
    v.map_or(0, |v| v.device_ptr(g.stream()).0)
}

impl Gpu {
    /// Whether [`Gpu::mmq`] has a launch for `shape` at `ncols` columns (GLU or not) on this
    /// device: some k-split's ring fits its shared memory (ks = 1 needs the least).
    pub fn mmq_fits(&self, shape: &MatShape, ncols: usize, glu: bool) -> bool {
        self.mmq_fits_ks(shape, ncols, glu, 1)
    }

    /// Whether a launch with `ks` warps splitting K ([`Gpu::force_mmq_ksplit`]) fits this
    /// device's shared memory (and `ks` is allowed for the shape).
    pub fn mmq_fits_ks(&self, shape: &MatShape, ncols: usize, glu: bool, ks: usize) -> bool {
        QType::of(shape.ty)
            .filter(|_| mmq_supported(shape))
            .is_some_and(|qt| {
                let max = self.max_smem_optin();
                mmq_plan_ks(qt, shape.rows, shape.k, ncols, 1, glu, 1, max, ks).is_some()
            })
    }

    /// Tensor-core matrix product over channels ([`QChannels`] as for [`Gpu::gemv_q`], with
    /// `ncols` 8, 16, 32 or 64: every block computes all of them, so each channel's weights are
    /// read once). Columns without an input row (x map -1 or past `x.rows`) or output row (y map
    /// -1 or past `y_rows`) are neither computed nor written; a channel whose id is -1 writes
    /// nothing, one whose id lies outside the slabs writes NaN. Modes: plain, accumulate, GLU.
    pub fn mmq<W: DevicePtr<u8>>(
        &self,
        shape: MatShape,
        w: &W,
        mode: QMode<'_, W>,
        ch: QChannels<'_>,
        x: &Q8Act,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "mmq";
        shape.check(OP, dlen(w))?;
        let Some(qt) = QType::of(shape.ty).filter(|_| mmq_supported(&shape)) else {
            return Err(KernelError::UnsupportedType {
                op: OP,
                ty: shape.ty,
            });
        };
        if x.k != shape.k {
            return Err(shape_err(
                OP,
                format!("activations of {} for K = {}", x.k, shape.k),
            ));
        }
        if ch.count == 0 || !matches!(ch.ncols, 8 | 16 | 32 | 64) || ch.x_div == 0 {
            return Err(shape_err(
                OP,
                format!("channels {ch:?} (ncols 8, 16, 32 or 64)"),
            ));
        }
        let (glu, w2p, accum) = match mode {
            QMode::Plain => (false, 0, 0),
            QMode::Accumulate => (false, 0, 1),
            QMode::Glu(w2) => {
                need_len(OP, "w2", dlen(w2), dlen(w))?;
                let p = w2.device_ptr(self.stream()).0;
                check_aligned(OP, "w2", p, 16)?;
                (true, p, 0)
            }
            QMode::Combine { .. } => {
                return Err(shape_err(
                    OP,
                    "combine is a gemv_q mode (one column per channel)",
                ))
            }
        };
        let n = ch.ncols;
        if let Some(ids) = ch.ids {
            need_len(OP, "ids", ids.len(), ch.count)?;
        }
        match ch.xidx {
            Some(v) => need_len(OP, "xidx", v.len(), ch.count * n)?,
            // The last channel may be partial: columns past x.rows are skipped by the kernel.
            None => need_len(OP, "x rows", x.rows, ((ch.count - 1) / ch.x_div) * n + 1)?,
        }
        match ch.yidx {
            Some(v) => need_len(OP, "yidx", v.len(), ch.count * n)?,
            None => need_len(OP, "y rows", ch.y_rows, (ch.count - 1) * n + 1)?,
        }
        if ch.y_rows > 0 {
            need_len(OP, "y", dlen(y), (ch.y_rows - 1) * ch.y_stride + shape.rows)?;
        }
        // The kernel keeps row indices of x and y in 32 bits.
        to_i32(OP, "x rows", x.rows)?;
        to_i32(OP, "y rows", ch.y_rows)?;
        let info = self.info();
        let max_smem = self.max_smem_optin();
        let sliceable = mmq_sliceable(ch.count, ch.ids.is_some(), shape.rows, n, glu);
        let slices = if sliceable {
            self.mmq_slices()
        } else {
            Some(1)
        };
        let plan = |sliceable| {
            mmq_plan(
                qt,
                shape.rows,
                shape.k,
                n,
                ch.count,
                glu,
                info.sm_count as usize,
                info.max_grid.1 as usize,
                max_smem,
                sliceable,
            )
        };
        let plan = match (self.mmq_ksplit(), slices) {
            (None, None) => plan(true),
            (None, Some(1)) => plan(false),
            (ks, kz) => mmq_plan_ks(
                qt,
                shape.rows,
                shape.k,
                n,
                ch.count,
                glu,
                info.max_grid.1 as usize,
                max_smem,
                ks.unwrap_or(1),
            )
            .map(|p| match kz {
                Some(kz) if kz > 1 => p.sliced(kz),
                _ => p,
            }),
        }
        .ok_or_else(|| {
            shape_err(
                OP,
                format!(
                    "no k-split of K = {}, {n} columns fits {max_smem} bytes of shared memory \
                     (forced: {:?})",
                    shape.k,
                    self.mmq_ksplit()
                ),
            )
        })?;
        let name = mmq_kernel_name(qt, n, glu, plan.kz > 1)
            .ok_or_else(|| shape_err(OP, "no kernel variant"))?;
        let f = self.func(Op::Mmq(qt), &name)?;
        self.allow_smem(&f, plan.smem)?;
        let mut cfg = self.cfg(
            OP,
            (
                u64::from(plan.grid[0]),
                u64::from(plan.grid[1]),
                u64::from(plan.grid[2]),
            ),
            plan.block[0],
        )?;
        cfg.shared_mem_bytes = plan.smem as u32;
        let kind = kind_name(
            match mode {
                QMode::Accumulate => "mmq add",
                QMode::Glu(_) => "mmq glu",
                _ => "mmq",
            },
            qt,
        );
        let (wp, _gw) = w.device_ptr(self.stream());
        check_aligned(OP, "w", wp, 16)?;
        let (yp, _gy) = y.device_ptr_mut(self.stream());
        let (qs, ds, rows) = x.raw();
        // 16-byte cp.async of the codes, 8-byte record loads.
        check_aligned(OP, "x codes", qs, 16)?;
        check_aligned(OP, "x records", ds, 16)?;
        // The slices' partial sums: from the pool, returned when this call ends (stream order
        // keeps the reduce's reads before any later reuse).
        let ws = match plan.ws_len(n, shape.rows, glu) {
            0 => None,
            len => Some(self.alloc::<f32>(len)?),
        };
        let p = MmqParams {
            w: wp,
            w2: w2p,
            nblk: shape.blocks() as i64,
            ids: opt_ptr(ch.ids, self),
            xidx: opt_ptr(ch.xidx, self),
            x: MmqX { qs, ds, rows },
            y: yp,
            yidx: opt_ptr(ch.yidx, self),
            y_stride: ch.y_stride as i64,
            y_rows: ch.y_rows as i64,
            ws: ws.as_ref().map_or(0, |b| b.ptr()),
            nrows: to_i32(OP, "rows", shape.rows)?,
            k: to_i32(OP, "k", shape.k)?,
            n_slabs: to_i32(OP, "slabs", shape.slabs)?,
            count: to_i32(OP, "channels", ch.count)?,
            ncols: n as i32,
            x_div: to_i32(OP, "x_div", ch.x_div)?,
            ks: plan.ks as i32,
            accum,
            srow: mmq_stage_row_bytes(qt) as i32,
            kz: plan.kz as i32,
            wpz: plan.wpz as i32,
            pad: 0,
        };
        let mut b = self.args(&f);
        b.arg(&p);
        // SAFETY: weight, id, index and output extents checked above; the kernel range-checks
        // every id and row index it reads (bad ids give NaN outputs, bad rows are skipped), and
        // its shared memory is the plan's; a sliced launch writes `ws_len` floats of `ws`.
        unsafe { self.launch(kind, b, cfg) }?;
        if ws.is_none() {
            return Ok(());
        }
        let fr = self.func(Op::Mmq(qt), &format!("mmq_reduce_{}", qt.suffix()))?;
        let threads = 256u32;
        let blocks = (n * shape.rows)
            .div_ceil(threads as usize)
            .min(4 * info.sm_count as usize);
        let cfg = self.cfg(OP, (blocks.max(1) as u64, 1, 1), threads)?;
        let mut b = self.args(&fr);
        b.arg(&p);
        // SAFETY: reads the `ws_len` floats the product wrote and the maps checked above;
        // writes the outputs the product would have written unsliced.
        unsafe { self.launch(kind_name("mmq reduce", qt), b, cfg) }
    }

    /// One `mma.m16n8k32.s8` product by the instruction and by mmq.cu's shuffle emulation
    /// (`mma_s8_selftest`): `a` 16 x 32 row-major, `b` 8 columns of 32 (`b[32 n + k]`), `c`
    /// 16 x 8 row-major; returns both 16 x 8 results.
    pub fn mma_s8_selftest(
        &self,
        a: &[i8],
        b: &[i8],
        c: &[i32],
    ) -> Result<(Vec<i32>, Vec<i32>), KernelError> {
        const OP: &str = "mma_s8_selftest";
        need_len(OP, "a", a.len(), 512)?;
        need_len(OP, "b", b.len(), 256)?;
        need_len(OP, "c", c.len(), 128)?;
        let (da, db, dc) = (
            self.upload(&a[..512])?,
            self.upload(&b[..256])?,
            self.upload(&c[..128])?,
        );
        let mut d1 = self.upload(&[0i32; 128])?;
        let mut d2 = self.upload(&[0i32; 128])?;
        let f = self.func(Op::Mmq(QType::Q8_0), "mma_s8_selftest")?;
        let cfg = self.cfg(OP, (1, 1, 1), 32)?;
        let s = self.stream();
        {
            let (pa, _ga) = da.device_ptr(s);
            let (pb, _gb) = db.device_ptr(s);
            let (pc, _gc) = dc.device_ptr(s);
            let (p1, _g1) = d1.device_ptr_mut(s);
            let (p2, _g2) = d2.device_ptr_mut(s);
            let mut args = self.args(&f);
            args.arg(&pa).arg(&pb).arg(&pc).arg(&p1).arg(&p2);
            // SAFETY: one warp reads 512 + 256 bytes and 128 ints, writes 128 ints to each
            // output.
            unsafe { self.launch(OP, args, cfg) }?;
        }
        Ok((self.download(&d1)?, self.download(&d2)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMS: usize = 132;
    const GY: usize = 65_535;
    /// An H100's / H200's opt-in shared memory per block.
    const SMEM: usize = 232_448;

    /// A launch that may not be sliced (grouped tiles, or a dense one kept whole).
    fn plan(rows: usize, k: usize, nc: usize, ch: usize, glu: bool) -> MmqPlan {
        mmq_plan(QType::Q4K, rows, k, nc, ch, glu, SMS, GY, SMEM, false).expect("a plan")
    }

    /// A dense single-channel Q4_K launch, as `Gpu::mmq` plans it.
    fn dense(rows: usize, k: usize, nc: usize, glu: bool) -> MmqPlan {
        mmq_plan(QType::Q4K, rows, k, nc, 1, glu, SMS, GY, SMEM, true).expect("a plan")
    }

    #[test]
    fn dense_plans_slice_k_to_fill_the_sms() {
        // attn_output 6,144 x 16,384 at 64 columns: 48 blocks of 8 tiles, one resident per
        // SM; waves per unit of work 1, 1/2, 2/3, 2/4, 2/5, 3/6, 3/7, 3/8: 8 slices of 16
        // windows, 384 blocks.
        let p = dense(6144, 16384, 64, false);
        assert_eq!((p.ks, p.grid, p.kz, p.wpz), (1, [48, 1, 8], 8, 16));
        assert_eq!(p.ws_len(64, 6144, false), 8 * 64 * 6144);
        // At 16 columns two resident per SM (264): 5 slices (240 blocks, 1/5) beat 8 (2/8).
        let p = dense(6144, 16384, 16, false);
        assert_eq!((p.grid, p.wpz), ([48, 1, 5], 26));
        // q_a 2,048 x 6,144: 16 blocks -> 8 slices of 6 windows, one wave.
        let p = dense(2048, 6144, 64, false);
        assert_eq!((p.grid, p.wpz), ([16, 1, 8], 6));
        // q_b 16,384 x 2,048 at 32 columns: 128 blocks already make one wave.
        let p = dense(16384, 2048, 32, false);
        assert_eq!((p.grid, p.kz), ([128, 1, 1], 1));
        assert_eq!(p.ws_len(32, 16384, false), 0);
        // The dense FFN's gate + up (12,288 x 6,144, GLU, 64 columns): 96 blocks on 132 SMs;
        // 4 slices make 3 waves of quarter blocks (0.75 against 1).
        let p = dense(12288, 6144, 64, true);
        assert_eq!((p.grid, p.wpz), ([96, 1, 4], 12));
        // K of 3 windows: one slice (at least 2 windows each).
        let p = dense(64, 384, 8, false);
        assert_eq!(p.kz, 1);
        // One window: nothing to slice.
        let p = dense(64, 128, 8, false);
        assert_eq!((p.grid, p.kz, p.wpz), ([1, 1, 1], 1, 1));
        // A slice's sums past 32-bit offsets (the sliced epilogue's): never sliced.
        assert!(mmq_sliceable(1, false, 16_777_215, 64, true));
        assert!(!mmq_sliceable(1, false, 16_777_216, 64, true));
        assert!(!mmq_sliceable(2, false, 64, 8, false) && !mmq_sliceable(1, true, 64, 8, false));
        // Forced slices: whole windows, no empty slice (6 windows: 4 -> 3 slices of 2).
        let p = mmq_plan_ks(QType::Q4K, 40, 768, 8, 1, false, GY, SMEM, 1)
            .expect("fits")
            .sliced(4);
        assert_eq!((p.kz, p.wpz, p.grid[2]), (3, 2, 3));
        assert_eq!(p.ws_len(8, 40, true), 3 * 2 * 8 * 40);
    }

    #[test]
    fn plan_splits_k_only_for_few_row_tiles() {
        // Grouped MoE gate+up: 2,048 rows x 6,144, 320 tiles of 8 columns: no split.
        let p = plan(2048, 6144, 8, 320, true);
        assert_eq!((p.ks, p.grid), (1, [16, 320, 1]));
        // Dense 2,048 x 6,144 (q_a, the shared expert) at 16 tokens: 8 warps per tile.
        let p = plan(2048, 6144, 16, 1, false);
        assert_eq!((p.ks, p.grid), (8, [128, 1, 1]));
        // 64 columns, GLU: the ring caps the split at 2 (4 would need 4 x 66 KiB).
        let p = plan(2048, 6144, 64, 1, true);
        assert_eq!((p.ks, p.grid), (2, [32, 1, 1]));
        // attn_output (6,144 x 16,384) at 16 tokens: 48 blocks unsplit, 2 -> 96, 4 -> 192,
        // 8 -> 384 >= 264; at 32 tokens the ring caps it at 4.
        let p = plan(6144, 16384, 16, 1, false);
        assert_eq!(p.ks, 8);
        let p = plan(6144, 16384, 32, 1, false);
        assert_eq!(p.ks, 4);
        // q_b (16,384 x 2,048): 128 blocks unsplit, 256 with 2, 512 with 4.
        let p = plan(16384, 2048, 16, 1, false);
        assert_eq!(p.ks, 4);
        // K of one step: no split possible.
        let p = plan(64, 128, 8, 1, false);
        assert_eq!((p.ks, p.grid), (1, [1, 1, 1]));
        // Channels past the grid's y limit are grid-strided.
        assert_eq!(plan(16, 256, 8, 100_000, false).grid[1], 65_535);
        // A 99 KiB device (sm_120): no GLU launch of Q6_K at any width (4 stages of two
        // matrices' 8 x 16 staged rows), nor a plain one at 64 columns; plain 16 fits.
        let small = 101_376;
        for sliceable in [false, true] {
            let plan = |nc, glu| {
                mmq_plan(
                    QType::Q6K,
                    2048,
                    6144,
                    nc,
                    1,
                    glu,
                    SMS,
                    GY,
                    small,
                    sliceable,
                )
            };
            assert!(plan(8, true).is_none());
            assert!(plan(64, false).is_none());
            assert!(plan(16, false).is_some());
        }
    }

    #[test]
    fn plan_invariants() {
        for qt in QType::MMQ {
            for rows in [1usize, 15, 16, 17, 576, 2048, 6144] {
                for k in [128usize, 256, 384, 2048, 6144] {
                    for nc in [8usize, 16, 32, 64] {
                        for (ch, glu, sliceable) in [1usize, 3, 320]
                            .into_iter()
                            .flat_map(|c| [(c, false), (c, true)])
                            .flat_map(|(c, g)| [(c, g, false), (c, g, true)])
                        {
                            let p = mmq_plan(qt, rows, k, nc, ch, glu, SMS, GY, SMEM, sliceable)
                                .expect("every width has a plan on an H100");
                            // Slices: whole windows, none empty, only for one channel,
                            // never more waves per unit of work than none, at most the cap.
                            let windows = (k / MMQ_STEP).div_ceil(p.ks);
                            assert_eq!(p.grid[2] as usize, p.kz);
                            assert!(p.kz * p.wpz >= windows && (p.kz - 1) * p.wpz < windows);
                            if p.kz > 1 {
                                assert!(sliceable && ch == 1 && p.ks == 1);
                                assert!(p.wpz >= 2);
                                let slots = resident(&p, nc, glu, SMEM) * SMS;
                                let base = p.grid[0] as usize;
                                let waves = (base * p.kz).div_ceil(slots);
                                assert!(waves <= base.div_ceil(slots) * p.kz);
                                assert!(p.kz <= MMQ_MAX_SLICES);
                            }
                            let tiles_per_block = MMQ_WARPS / p.ks;
                            assert!(matches!(p.ks, 1 | 2 | 4 | 8));
                            assert_eq!(MMQ_WARPS % p.ks, 0);
                            assert!(p.ks == 1 || p.ks <= k / MMQ_STEP);
                            // Every row covered by exactly the grid's tiles.
                            let covered = p.grid[0] as usize * tiles_per_block * 16;
                            assert!(covered >= rows && covered < rows + tiles_per_block * 16);
                            assert_eq!(p.grid[1] as usize, ch);
                            assert_eq!(p.block, [256, 1, 1]);
                            assert!(p.smem <= SMEM, "{rows} {k} {nc}: {}", p.smem);
                            let red = MMQ_WARPS * (1 + usize::from(glu)) * nc / 2 * 32 * 4;
                            assert!(p.ks == 1 || p.smem >= red);
                            assert!(p.smem >= ring_bytes(qt, nc, p.ks, glu));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn supported_shapes() {
        use gguf::GgmlType::*;
        let s = |ty, k, packed| MatShape {
            ty,
            rows: 64,
            k,
            slabs: 1,
            packed,
        };
        assert!(mmq_supported(&s(Q4_K, 6144, false)));
        assert!(mmq_supported(&s(Q5_K, 256, false)));
        assert!(mmq_supported(&s(Q6_K, 2048, true)));
        assert!(mmq_supported(&s(Q8_0, 128, true)));
        assert!(!mmq_supported(&s(Q8_0, 192, true)), "K not a whole step");
        assert!(
            !mmq_supported(&s(Q6_K, 2048, false)),
            "Q6_K is read repacked"
        );
        assert!(
            !mmq_supported(&s(Q4_K, 6144, true)),
            "Q4_K has no repacked layout"
        );
        assert!(!mmq_supported(&s(Q4_0, 256, true)), "no Q4_0 kernel");
        assert!(!mmq_supported(&s(F32, 256, false)));
        for q in QType::MMQ {
            for nc in [8, 16, 32, 64] {
                for glu in [false, true] {
                    assert!(mmq_kernel_name(q, nc, glu, false).is_some());
                    assert!(mmq_kernel_name(q, nc, glu, true).is_some());
                }
            }
            assert!(mmq_kernel_name(q, 12, false, false).is_none());
        }
    }
}
