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
//! the sums over blocks: per output |y - y_q| <= (K/32 + 3 + ks) * 2^-24 * sum_b |term_b|
//! (up to 3 roundings per block term, one per addition; y_q = the exact product with the
//! quantized activations). The tests use gemvq's `(K/32 + 16) * 4 * 2^-24` bound.

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

/// The kernels: `(name prefix, columns, GLU)`; the name is the prefix + the type's suffix.
pub(crate) const MMQ_VARIANTS: [(&str, usize, bool); 8] = [
    ("mmq8_", 8, false),
    ("mmq16_", 16, false),
    ("mmq32_", 32, false),
    ("mmq64_", 64, false),
    ("mmq_glu8_", 8, true),
    ("mmq_glu16_", 16, true),
    ("mmq_glu32_", 32, true),
    ("mmq_glu64_", 64, true),
];

/// The kernel entry for `ncols` columns (8, 16, 32 or 64) of type `qt`.
pub fn mmq_kernel_name(qt: QType, ncols: usize, glu: bool) -> Option<String> {
    MMQ_VARIANTS
        .iter()
        .find(|v| v.1 == ncols && v.2 == glu)
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
}

/// Resident blocks per SM the plan aims at: two blocks of 8 warps (16 warps of up to 128
/// registers) keep ~2 x 8 x D x 16 rows x 128 weights in flight per SM.
const BLOCKS_PER_SM: usize = 2;

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
    })
    .filter(|p| p.smem <= max_smem)
}

/// The launch of `channels` products of `rows x k` weights of type `qt` by `ncols` columns (8,
/// 16, 32, 64) on `sms` SMs (`max_grid_y`: the device's grid.y limit; `max_smem`: its shared
/// memory per block), `None` when no k-split fits the shared memory.
///
/// The k-split: a block holds `MMQ_WARPS / ks` row tiles; splitting K over more warps makes
/// more, shorter blocks. The smallest allowed `ks` ([`mmq_ks_allowed`]) that gives every SM
/// [`BLOCKS_PER_SM`] blocks wins (more splitting only adds the reduction and re-reads of the
/// activations per row tile); without one, the largest allowed. Grouped MoE launches (hundreds
/// of tiles) stay at 1; a 2,048-row dense matrix of <= 16 columns takes 8 (128 blocks).
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
) -> Option<MmqPlan> {
    let plan = |ks| mmq_plan_ks(qt, rows, k, ncols, channels, glu, max_grid_y, max_smem, ks);
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
        let name = mmq_kernel_name(qt, n, glu).ok_or_else(|| shape_err(OP, "no kernel variant"))?;
        let f = self.func(Op::Mmq(qt), &name)?;
        let info = self.info();
        let max_smem = self.max_smem_optin();
        let plan = match self.mmq_ksplit() {
            None => mmq_plan(
                qt,
                shape.rows,
                shape.k,
                n,
                ch.count,
                glu,
                info.sm_count as usize,
                info.max_grid.1 as usize,
                max_smem,
            ),
            Some(ks) => mmq_plan_ks(
                qt,
                shape.rows,
                shape.k,
                n,
                ch.count,
                glu,
                info.max_grid.1 as usize,
                max_smem,
                ks,
            ),
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
            nrows: to_i32(OP, "rows", shape.rows)?,
            k: to_i32(OP, "k", shape.k)?,
            n_slabs: to_i32(OP, "slabs", shape.slabs)?,
            count: to_i32(OP, "channels", ch.count)?,
            ncols: n as i32,
            x_div: to_i32(OP, "x_div", ch.x_div)?,
            ks: plan.ks as i32,
            accum,
            srow: mmq_stage_row_bytes(qt) as i32,
            pad: 0,
        };
        let mut b = self.args(&f);
        b.arg(&p);
        // SAFETY: weight, id, index and output extents checked above; the kernel range-checks
        // every id and row index it reads (bad ids give NaN outputs, bad rows are skipped), and
        // its shared memory is the plan's.
        unsafe { self.launch(kind, b, cfg) }
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

    fn plan(rows: usize, k: usize, nc: usize, ch: usize, glu: bool) -> MmqPlan {
        mmq_plan(QType::Q4K, rows, k, nc, ch, glu, SMS, GY, SMEM).expect("a plan")
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
        assert!(mmq_plan(QType::Q6K, 2048, 6144, 8, 1, true, SMS, GY, small).is_none());
        assert!(mmq_plan(QType::Q6K, 2048, 6144, 64, 1, false, SMS, GY, small).is_none());
        assert!(mmq_plan(QType::Q6K, 2048, 6144, 16, 1, false, SMS, GY, small).is_some());
    }

    #[test]
    fn plan_invariants() {
        for qt in QType::MMQ {
            for rows in [1usize, 15, 16, 17, 576, 2048, 6144] {
                for k in [128usize, 256, 384, 2048, 6144] {
                    for nc in [8usize, 16, 32, 64] {
                        for ch in [1usize, 3, 320] {
                            for glu in [false, true] {
                                let p = mmq_plan(qt, rows, k, nc, ch, glu, SMS, GY, SMEM)
                                    .expect("every width has a plan on an H100");
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
                    assert!(mmq_kernel_name(q, nc, glu).is_some());
                }
            }
            assert!(mmq_kernel_name(q, 12, false).is_none());
        }
    }
}
