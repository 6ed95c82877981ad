//! The fast decode GEMV: activations quantized to 8 bits per block of 32 (`q8a`, like ggml's
//! q8_1), weights read once in their device layout, dot products in integers (`dp4a`), scaled
//! once per weight block (kernels/cuda/gemvq.cu). Weight types: [`crate::QType`]; the others use
//! the f32 path ([`Gpu::gemv_batched`]).
//!
//! Error, from the math: the activation x_i of a block with max |x| = a is replaced by
//! d*q_i with d = a/127 and |x_i - d*q_i| <= d/2 = a/254, all integer sums are exact, and the
//! scaling is f32. So one output y = sum_i w_i x_i moves by at most sum_i |w_i| a_b(i) / 254
//! (a_b(i) = the max of x_i's block), and by about sqrt(sum_i w_i^2 a_b(i)^2 / 12) / 127 for
//! independent rounding errors: relative to |y| ~ ||w|| ||x|| / sqrt(K)... for random-sign
//! products that is (a_b / rms(x)) / (127 * sqrt(12)) ~= 0.2-1% of the output's scale
//! (a_b / rms in [1, sqrt(32)]). [`Q8_REL_ERR`] states the bound the tests use.

use std::sync::OnceLock;

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::dequant::check_aligned;
use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::gemv::{lanes_for_tasks, MatShape};
use crate::launch::shape_err;
use crate::ops::{Op, QType, GEMVQ_VARIANTS};
use crate::pool::DevBuf;

/// Worst-case relative error of one q8a GEMV output with respect to `sum_i |w_i| * rms_b(x)`
/// scaled outputs: a block's max is at most sqrt(32) times its rms, the rounding error at most
/// half a code, so |err| <= sum_i |w_i| * sqrt(32) * rms_b / 254 <= 0.0223 * sum_i |w_i| rms_b.
/// Tests compare against this times `sum_i |w_i| |x_i|`-style norms; the typical error is ~20x
/// smaller (independent roundings).
pub const Q8_REL_ERR: f64 = 0.0223;

/// Default most rows per lane group of one-column launches ([`crate::Gpu::set_gemvq1_rows`]).
pub const GEMVQ1_ROWS: usize = 2;

/// One-column launches take several rows per lane group only up to this many waves of their
/// blocks (see `gemv_q_impl`; [`crate::Gpu::set_gemvq1_waves`]).
pub(crate) const GEMVQ1_ROWS_MAX_WAVES: usize = 8;

/// Activations on the device in the q8a layout of quantize.cu: `rows` rows of `k` values; codes,
/// then one record {f32 d, i16 sum of the block's first 16 codes, i16 of the last 16} per block.
pub struct Q8Act {
    buf: DevBuf<u8>,
    pub rows: usize,
    pub k: usize,
    ds_off: usize,
}

/// Host copy of [`Q8Act`]: (codes, one scale per 32, one sum per 16).
pub type Q8Host = (Vec<i8>, Vec<f32>, Vec<i16>);

/// The `Q8A` kernel parameter.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Q8AParams {
    qs: u64,
    ds: u64,
    rows: i64,
}

impl Q8Act {
    /// Uninitialized storage for `rows` x `k` q8 activations (`k` a multiple of 32), for a
    /// producer kernel that writes them (quantize.cu, or a norm's fused epilogue): the codes' and
    /// the records' device addresses.
    pub(crate) fn alloc(g: &Gpu, rows: usize, k: usize) -> Result<(Q8Act, u64, u64), KernelError> {
        let n = rows * k;
        let ds_off = n.div_ceil(16) * 16;
        let total = ds_off + 8 * (n / 32);
        let buf = g.alloc::<u8>(total)?;
        let base = buf.ptr();
        Ok((
            Q8Act {
                buf,
                rows,
                k,
                ds_off,
            },
            base,
            base + ds_off as u64,
        ))
    }

    /// Device addresses of the codes and the records, and the row count.
    pub(crate) fn raw(&self) -> (u64, u64, i64) {
        let p = self.params();
        (p.qs, p.ds, p.rows)
    }

    fn params(&self) -> Q8AParams {
        let base = self.buf.ptr();
        Q8AParams {
            qs: base,
            ds: base + self.ds_off as u64,
            rows: self.rows as i64,
        }
    }

    /// Host copy of the codes, the block scales and the 16-sums, for tests.
    pub fn to_host(&self, g: &Gpu) -> Result<Q8Host, KernelError> {
        let all = g.download(&self.buf.view())?;
        let n = self.rows * self.k;
        let qs = all[..n].iter().map(|&b| b as i8).collect();
        let rec = &all[self.ds_off..self.ds_off + 8 * (n / 32)];
        let d = rec
            .chunks_exact(8)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let s = rec
            .chunks_exact(8)
            .flat_map(|c| {
                [
                    i16::from_le_bytes([c[4], c[5]]),
                    i16::from_le_bytes([c[6], c[7]]),
                ]
            })
            .collect();
        Ok((qs, d, s))
    }
}

/// How the channels of a [`Gpu::gemv_q`] launch pick weights, inputs and outputs.
#[derive(Debug, Clone, Copy)]
pub struct QChannels<'a> {
    /// Independent GEMVs (grid.y, grid-strided).
    pub count: usize,
    /// Activation columns per channel (1..=8) sharing each weight load.
    pub ncols: usize,
    /// Slab per channel; `None`: `ch % slabs`. An id of -1 skips the channel (writes nothing);
    /// other ids outside the slabs write NaN.
    pub ids: Option<&'a CudaView<'a, i32>>,
    /// Activation row of column j of channel ch: `xidx[ch * ncols + j]` (-1 ends the channel's
    /// columns), or without it `(ch / x_div) * ncols + j`.
    pub xidx: Option<&'a CudaView<'a, i32>>,
    pub x_div: usize,
    /// Output row of (ch, j): `yidx[ch * ncols + j]` (-1: not written), or `ch * ncols + j`;
    /// rows are `y_stride` apart and `y_rows` of them exist.
    pub yidx: Option<&'a CudaView<'a, i32>>,
    pub y_stride: usize,
    pub y_rows: usize,
}

impl QChannels<'_> {
    /// One matrix times `cols` dense activation rows (a small batch of tokens).
    pub fn dense(cols: usize, y_stride: usize) -> Self {
        QChannels {
            count: 1,
            ncols: cols,
            ids: None,
            xidx: None,
            x_div: 1,
            yidx: None,
            y_stride,
            y_rows: cols,
        }
    }
}

/// What the launch computes per output.
#[derive(Debug, Clone, Copy)]
pub enum QMode<'a, W> {
    /// `W x`.
    Plain,
    /// `y + W x`: the output's old values read first and the product added onto them in the
    /// epilogue (a second branch's output onto the first's, no add launch; one f32 add per
    /// output, the add kernel's).
    Accumulate,
    /// `silu(W x) * (W2 x)` with `W2` of the same shape and type (FFN gate and up).
    Glu(&'a W),
    /// Channel = token t: `sum_k weights[t*topk + k] * W_{ids[t*topk+k]} x_{t*topk + k}` (a MoE
    /// layer's down projection and weighted sum; slots with id -1 are skipped).
    Combine {
        weights: &'a CudaView<'a, f32>,
        topk: usize,
    },
}

/// The `GemvQ` kernel parameter (gemvq.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GemvQParams {
    w: u64,
    w2: u64,
    nblk: i64,
    nrows: i32,
    k: i32,
    n_slabs: i32,
    lpr: i32,
    count: i32,
    ncols: i32,
    ids: u64,
    xidx: u64,
    x_div: i32,
    ctopk: i32,
    x: Q8AParams,
    y: u64,
    yidx: u64,
    y_stride: i64,
    y_rows: i64,
    cw: u64,
    ksplit: i32,
    accum: i32,
    ws: u64,
    ws2: u64,
    ws_nblk: i64,
    nseg: i32,
    seg_row: [i32; 2],
    seg_w: [u64; 2],
    seg_y: [u64; 2],
    seg_nblk: [i64; 2],
}

/// The most matrices one stacked launch ([`Gpu::gemv_q_stacked`]) takes.
pub const GEMVQ_MAX_STACK: usize = 3;

/// The matrices after the first of a stacked launch, as the kernel reads them.
#[derive(Default)]
struct Stack {
    /// Rows of the first matrix (its output's extent).
    first_rows: usize,
    /// (first row in the stack, blocks, weights, output) of each further matrix.
    segs: Vec<(usize, i64, u64, u64)>,
}

// SAFETY: plain structs laid out exactly as `struct Q8A` / `struct GemvQ` in gemvq.cu.
unsafe impl DeviceRepr for Q8AParams {}
unsafe impl DeviceRepr for GemvQParams {}

/// Warps of a 4-warp block that share one row group in a one-column launch (1, 2 or 4; their
/// partial sums meet in shared memory in a fixed order). A launch's time is about the number of
/// waves it needs times the tasks one lane runs per row, and a wave started is a wave paid: the
/// attention output GEMV (6,144 rows, 1,536 blocks at 9 blocks per SM on 132 SMs, 1.29 waves)
/// ran its last 0.29 wave with a quarter of the GPU busy (Nsight Compute, H200, 2026-12-02).
/// Splitting a row's tasks (combine: its expert slots, `topk` > 0) over more warps makes more,
/// shorter blocks; ties keep fewer warps per row (no shared-memory reduction). A launch that
/// fills more than one wave unsplit is split only while every lane keeps >= 2 tasks: at one task
/// per lane the reduction costs what the tail did (Q6_K 6,144 x 2,048: 8.2 us unsplit, 10.1 us
/// in 2 warps per row, same H200 call; the attention output gained 26.8 -> 25.1 us).
/// [`Gpu::force_gemvq_ksplit`] (or `GGUFTOOL_GEMVQ_KSPLIT=1|2|4`) forces one.
fn k_split(
    rows: usize,
    groups: usize,
    channels: usize,
    tasks: usize,
    lpr: usize,
    topk: usize,
    slots: usize,
) -> usize {
    let blocks = |ks: usize| rows.div_ceil((4 / ks) * groups) * channels;
    let one_wave = blocks(1) <= slots;
    let mut best = (usize::MAX, 1);
    for ks in [1usize, 2, 4] {
        let waves = blocks(ks).div_ceil(slots.max(1));
        let per_lane = if topk > 0 {
            topk.div_ceil(ks) * tasks.div_ceil(lpr)
        } else {
            tasks.div_ceil(lpr * ks)
        };
        if ks > 1 && !one_wave && per_lane < 2 {
            continue;
        }
        let cost = waves * per_lane;
        if cost < best.0 {
            best = (cost, ks);
        }
    }
    best.1
}

/// Whether `shape` has an integer-dot-product GEMV (type, layout and row length).
pub fn gemvq_supported(shape: &MatShape) -> bool {
    match QType::of(shape.ty) {
        Some(_) => shape.packed == crate::repack::is_packed(shape.ty) && shape.k.is_multiple_of(32),
        None => false,
    }
}

/// A static name per (mode, type), for launch errors and profiles.
pub(crate) fn kind_name(mode: &str, qt: QType) -> &'static str {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static NAMES: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let key = format!("{mode} {}", qt.suffix());
    let mut m = NAMES
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // At most 8 modes (gemvq's and mmq's) x 10 types ever: leaking them is bounded.
    m.entry(key.clone())
        .or_insert_with(|| Box::leak(key.into_boxed_str()))
}

fn opt_ptr<T>(v: Option<&CudaView<'_, T>>, g: &Gpu) -> u64 {
    v.map_or(0, |v| v.device_ptr(g.stream()).0)
}

impl Gpu {
    /// Quantize `rows` rows of `k` f32 values (`x_stride` apart) to q8a.
    pub fn quantize_q8(
        &self,
        x: &impl DevicePtr<f32>,
        rows: usize,
        k: usize,
        x_stride: usize,
    ) -> Result<Q8Act, KernelError> {
        const OP: &str = "quantize";
        if rows == 0 || k == 0 || !k.is_multiple_of(32) {
            return Err(shape_err(
                OP,
                format!("{rows} rows of {k} (a multiple of 32)"),
            ));
        }
        need_len(OP, "x", dlen(x), (rows - 1) * x_stride + k)?;
        let (q, qp, dp) = Q8Act::alloc(self, rows, k)?;
        let (xp, _gx) = x.device_ptr(self.stream());
        // SAFETY: x extent checked; the output regions are `q`'s buffer, sized by alloc for
        // rows x k.
        unsafe { self.quantize_q8_into(xp, x_stride, rows, k, qp, dp) }?;
        Ok(q)
    }

    /// The quantize_q8a launch of [`Gpu::quantize_q8`] on device addresses: `rows` rows of `k`
    /// f32 values at `xp` (`x_stride` apart) into the codes at `qp` and the records at `dp`
    /// (both dense, row 0 first), for producers that fill part of a [`Q8Act`] themselves.
    ///
    /// # Safety
    /// `k` is a non-zero multiple of 32; `xp` holds `(rows - 1) * x_stride + k` values, `qp`
    /// `rows * k` codes and `dp` `rows * k / 32` 8-byte records; all outlive the launch.
    pub(crate) unsafe fn quantize_q8_into(
        &self,
        xp: u64,
        x_stride: usize,
        rows: usize,
        k: usize,
        qp: u64,
        dp: u64,
    ) -> Result<(), KernelError> {
        const OP: &str = "quantize";
        let n = rows * k;
        let f = self.func(Op::Quantize, "quantize_q8a")?;
        let blocks = (n / 32).div_ceil(8).clamp(1, 1 << 16) as u64;
        let cfg = self.cfg(OP, (blocks, 1, 1), 256)?;
        let (xs, r64, k32) = (x_stride as i64, rows as i64, to_i32(OP, "k", k)?);
        let mut b = self.args(&f);
        b.arg(&xp).arg(&xs).arg(&r64).arg(&k32).arg(&qp).arg(&dp);
        // SAFETY: by the caller.
        unsafe { self.launch(OP, b, cfg) }
    }

    /// Integer-dot-product GEMV over channels (see [`QChannels`], [`QMode`]): `y` rows get the
    /// `shape.rows` outputs of each (channel, column).
    pub fn gemv_q<W: DevicePtr<u8>>(
        &self,
        shape: MatShape,
        w: &W,
        mode: QMode<'_, W>,
        ch: QChannels<'_>,
        x: &Q8Act,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        self.gemv_q_shared(shape, w, mode, ch, x, y, None)
    }

    /// Several matrices of one type, layout and width over the same activation row (row 0 of
    /// `x`) in one plain one-column launch: their rows stacked, matrix i's products into
    /// `ys[i]` (`mats[i].rows` values). Each output is computed exactly as a launch of its
    /// matrix alone with the same k-split would compute it (bitwise then: tested); the small
    /// products of one input (a layer's q_a, kv_a and indexer keys) share one launch's waves
    /// instead of each paying a launch and a mostly idle GPU.
    pub fn gemv_q_stacked<W: DevicePtr<u8>, Y: DevicePtrMut<f32>>(
        &self,
        mats: &[(MatShape, &W)],
        x: &Q8Act,
        ys: &mut [&mut Y],
    ) -> Result<(), KernelError> {
        const OP: &str = "gemvq";
        if mats.is_empty() || mats.len() > GEMVQ_MAX_STACK || ys.len() != mats.len() {
            return Err(shape_err(
                OP,
                format!(
                    "{} matrices, {} outputs (1 ..= {GEMVQ_MAX_STACK} of each)",
                    mats.len(),
                    ys.len()
                ),
            ));
        }
        let first = mats[0].0;
        let mut stack = Stack {
            first_rows: first.rows,
            segs: Vec::with_capacity(mats.len() - 1),
        };
        let mut rows = first.rows;
        for (i, ((m, w), y)) in mats.iter().zip(ys.iter_mut()).enumerate() {
            let same = MatShape {
                rows: first.rows,
                ..*m
            } == first;
            if !same || m.slabs != 1 || m.rows == 0 {
                return Err(shape_err(
                    OP,
                    format!("stacked matrix {i}: {m:?} with {first:?}"),
                ));
            }
            m.check(OP, dlen(*w))?;
            need_len(OP, "y", dlen(&**y), m.rows)?;
            if i > 0 {
                let wp = w.device_ptr(self.stream()).0;
                check_aligned(OP, "w", wp, 16)?;
                let yp = y.device_ptr_mut(self.stream()).0;
                stack.segs.push((rows, m.blocks() as i64, wp, yp));
                rows += m.rows;
            }
        }
        let shape = MatShape { rows, ..first };
        let ch = QChannels {
            count: 1,
            ncols: 1,
            ids: None,
            xidx: None,
            x_div: 1,
            yidx: None,
            y_stride: first.rows,
            y_rows: 1,
        };
        self.gemv_q_impl(
            shape,
            mats[0].1,
            QMode::Plain,
            ch,
            x,
            &mut *ys[0],
            None,
            &stack,
        )
    }

    /// [`Gpu::gemv_q`] with a MoE layer's shared expert in the same launch: one matrix of
    /// `shape.rows x shape.k` (one slab) of `shape`'s type and layout. GLU mode (`shared` =
    /// (gate, Some(up))): the last channel computes it instead of an id's expert (ids are read
    /// for the others only; its input row is the channels' one, x_div = count). Combine mode
    /// (`shared` = (down, None)): every channel t adds `W_s x_{count * topk + t}` after its routed
    /// slots, with weight 1 (the shared expert's activations follow the routed ones).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_q_shared<W: DevicePtr<u8>>(
        &self,
        shape: MatShape,
        w: &W,
        mode: QMode<'_, W>,
        ch: QChannels<'_>,
        x: &Q8Act,
        y: &mut impl DevicePtrMut<f32>,
        shared: Option<(&W, Option<&W>)>,
    ) -> Result<(), KernelError> {
        self.gemv_q_impl(shape, w, mode, ch, x, y, shared, &Stack::default())
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv_q_impl<W: DevicePtr<u8>>(
        &self,
        shape: MatShape,
        w: &W,
        mode: QMode<'_, W>,
        ch: QChannels<'_>,
        x: &Q8Act,
        y: &mut impl DevicePtrMut<f32>,
        shared: Option<(&W, Option<&W>)>,
        stack: &Stack,
    ) -> Result<(), KernelError> {
        const OP: &str = "gemvq";
        // A stack's first matrix holds `first_rows` of the launch's rows (checked by the caller).
        let first = if stack.segs.is_empty() {
            shape
        } else {
            MatShape {
                rows: stack.first_rows,
                ..shape
            }
        };
        first.check(OP, dlen(w))?;
        let one = MatShape { slabs: 1, ..shape };
        let (wsp, ws2p) = match (shared, &mode) {
            (None, _) => (0, 0),
            (Some((ws, Some(ws2))), QMode::Glu(_)) => {
                one.check(OP, dlen(ws))?;
                one.check(OP, dlen(ws2))?;
                if ch.ids.is_none() || ch.count < 2 {
                    return Err(shape_err(
                        OP,
                        "a shared GLU channel needs routed channels by id",
                    ));
                }
                (
                    ws.device_ptr(self.stream()).0,
                    ws2.device_ptr(self.stream()).0,
                )
            }
            (Some((ws, None)), QMode::Combine { topk, .. }) => {
                one.check(OP, dlen(ws))?;
                need_len(OP, "x rows", x.rows, ch.count * (topk + 1))?;
                (ws.device_ptr(self.stream()).0, 0)
            }
            _ => {
                return Err(shape_err(
                    OP,
                    "a shared expert rides a GLU (gate and up) or a combine (down) launch",
                ))
            }
        };
        if wsp != 0 {
            check_aligned(OP, "shared w", wsp, 16)?;
        }
        let Some(qt) = QType::of(shape.ty).filter(|_| gemvq_supported(&shape)) else {
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
        if ch.count == 0 || ch.ncols == 0 || ch.ncols > 8 || ch.x_div == 0 {
            return Err(shape_err(OP, format!("channels {ch:?}")));
        }
        // The variant of `cols` columns and `mode`: the most rows per lane group up to the
        // setting (multi-column: the several-row kernel unless turned off; one column:
        // `gemvq1_rows`); a stack's segments start at multiples of its rows per group (a
        // group's rows then lie in one matrix).
        let want = match (ch.ncols, self.gemvq_multirow()) {
            (1, _) => self.gemvq1_rows(),
            (_, true) => usize::MAX,
            (_, false) => 1,
        };
        let variant = |cols: usize, mode: u8, most: usize| {
            GEMVQ_VARIANTS
                .iter()
                .filter(|v| {
                    v.1 == cols
                        && v.2 == mode
                        && v.3 <= most
                        && stack.segs.iter().all(|s| s.0 % v.3 == 0)
                })
                .max_by_key(|v| v.3)
                .map(|v| (v.0, v.3))
        };
        let (cols, vmode, ncols, ctopk, w2p, cwp) = match mode {
            QMode::Plain | QMode::Accumulate => {
                (ch.ncols.next_power_of_two(), 0, ch.ncols, 0, 0, 0)
            }
            QMode::Glu(w2) => {
                need_len(OP, "w2", dlen(w2), dlen(w))?;
                let nc = if ch.ncols == 1 { 1 } else { 8 };
                (nc, 1, ch.ncols, 0, w2.device_ptr(self.stream()).0, 0)
            }
            QMode::Combine { weights, topk } => {
                if topk == 0 || ch.ncols != 1 {
                    return Err(shape_err(OP, "combine needs topk >= 1 and one column"));
                }
                need_len(OP, "weights", weights.len(), ch.count * topk)?;
                need_len(OP, "x rows", x.rows, ch.count * topk)?;
                (1, 2, 1, topk, 0, weights.device_ptr(self.stream()).0)
            }
        };
        let tw = if ch.ncols == 1 { qt.task_weights() } else { 32 };
        if !shape.k.is_multiple_of(tw) {
            return Err(shape_err(OP, format!("K = {} in tasks of {tw}", shape.k)));
        }
        let tasks = shape.k / tw;
        let lpr = lanes_for_tasks(tasks);
        let (mut prefix, mut rows_per_group) =
            variant(cols, vmode, want).ok_or_else(|| shape_err(OP, "no kernel variant"))?;
        let mut f = self.func(Op::GemvQ(qt), &format!("{prefix}{}", qt.suffix()))?;
        // One column: several rows per group only for launches of a few waves, where they
        // shorten the ramp and tail; a long launch already streams at copy bandwidth with one
        // row, and the several-row kernels' registers cost it resident blocks (H100,
        // 2026-12-07: the 154,880-row output head 261.8 -> 280.5 us with 2 rows, the attention
        // output 26.0 -> 23.2, the MoE down + weighted sum 29.4 -> 24.6).
        let max_waves = self.gemvq1_waves();
        if ch.ncols == 1 && max_waves > 0 && rows_per_group > 1 {
            let slots = self.info().sm_count as usize * self.blocks_per_sm_128(&f)? as usize;
            let blocks =
                shape.rows.div_ceil(4 * (32 / lpr) * rows_per_group) * ch.count.min(65_535);
            if blocks > max_waves * slots {
                if let Some((p1, r1)) = variant(cols, vmode, 1) {
                    (prefix, rows_per_group) = (p1, r1);
                    f = self.func(Op::GemvQ(qt), &format!("{prefix}{}", qt.suffix()))?;
                }
            }
        }
        match (ch.ids, ctopk) {
            // The shared GLU channel (the last) reads no id.
            (Some(ids), 0) if wsp != 0 => need_len(OP, "ids", ids.len(), ch.count - 1)?,
            (Some(ids), 0) => need_len(OP, "ids", ids.len(), ch.count)?,
            (Some(ids), t) => need_len(OP, "ids", ids.len(), ch.count * t)?,
            (None, 0) => {}
            (None, _) => return Err(shape_err(OP, "combine needs expert ids")),
        }
        match ch.xidx {
            Some(v) => need_len(OP, "xidx", v.len(), ch.count * ncols)?,
            // The last channel may be partial: columns past x.rows are skipped by the kernel.
            None if ctopk == 0 => need_len(
                OP,
                "x rows",
                x.rows,
                ((ch.count - 1) / ch.x_div) * ncols + 1,
            )?,
            None => {}
        }
        let y_rows = if ctopk > 0 {
            ch.count.min(ch.y_rows)
        } else {
            ch.y_rows
        };
        match ch.yidx {
            Some(v) => need_len(OP, "yidx", v.len(), ch.count * ncols)?,
            None if ctopk == 0 => need_len(OP, "y rows", ch.y_rows, (ch.count - 1) * ncols + 1)?,
            None => need_len(OP, "y rows", ch.y_rows, ch.count)?,
        }
        if y_rows > 0 {
            need_len(OP, "y", dlen(y), (y_rows - 1) * ch.y_stride + first.rows)?;
        }
        // The profile kind names type and mode, e.g. "gemvq glu q4_k".
        let kind = kind_name(
            match mode {
                QMode::Plain => "gemvq",
                QMode::Accumulate => "gemvq add",
                QMode::Glu(_) => "gemvq glu",
                QMode::Combine { .. } => "gemvq combine",
            },
            qt,
        );
        let tables = self.tables()?.params;
        let ks = if ch.ncols == 1 {
            match self.gemvq_ksplit() {
                Some(k) => k,
                None => {
                    let slots =
                        self.info().sm_count as usize * self.blocks_per_sm_128(&f)? as usize;
                    k_split(
                        shape.rows,
                        32 / lpr * rows_per_group,
                        ch.count.min(65_535),
                        tasks,
                        lpr,
                        ctopk + usize::from(wsp != 0),
                        slots,
                    )
                }
            }
        } else {
            1
        };
        let rows_per_block = (4 / ks) * (32 / lpr) * rows_per_group;
        let cfg = self.cfg_rows(
            OP,
            shape.rows.div_ceil(rows_per_block) as u64,
            ch.count,
            128,
        )?;
        let (wp, _gw) = w.device_ptr(self.stream());
        let (yp, _gy) = y.device_ptr_mut(self.stream());
        check_aligned(OP, "w", wp, 16)?;
        let p = GemvQParams {
            w: wp,
            w2: w2p,
            nblk: first.blocks() as i64,
            nrows: to_i32(OP, "rows", shape.rows)?,
            k: to_i32(OP, "k", shape.k)?,
            n_slabs: to_i32(OP, "slabs", shape.slabs)?,
            lpr: lpr as i32,
            count: to_i32(OP, "channels", ch.count)?,
            ncols: ncols as i32,
            ids: opt_ptr(ch.ids, self),
            xidx: opt_ptr(ch.xidx, self),
            x_div: to_i32(OP, "x_div", ch.x_div)?,
            ctopk: ctopk as i32,
            x: x.params(),
            y: yp,
            yidx: opt_ptr(ch.yidx, self),
            y_stride: ch.y_stride as i64,
            y_rows: y_rows as i64,
            cw: cwp,
            ksplit: ks as i32,
            accum: i32::from(matches!(mode, QMode::Accumulate)),
            ws: wsp,
            ws2: ws2p,
            ws_nblk: one.blocks() as i64,
            nseg: 1 + stack.segs.len() as i32,
            seg_row: [0; 2],
            seg_w: [0; 2],
            seg_y: [0; 2],
            seg_nblk: [0; 2],
        };
        let mut p = p;
        for (i, &(row0, nblk, wp, yp)) in stack.segs.iter().enumerate() {
            p.seg_row[i] = to_i32(OP, "rows", row0)?;
            p.seg_nblk[i] = nblk;
            p.seg_w[i] = wp;
            p.seg_y[i] = yp;
        }
        let mut b = self.args(&f);
        b.arg(&p).arg(&tables);
        // SAFETY: weight, id, index and output extents checked above; the kernel range-checks
        // every id and index it reads (bad ids give NaN outputs, bad indices are skipped).
        unsafe { self.launch(kind, b, cfg) }
    }
}

#[cfg(test)]
mod tests {
    use super::k_split;

    /// 132 SMs x 9 resident blocks (54 registers at 128 threads: the H200's answer).
    const SLOTS: usize = 132 * 9;

    #[test]
    fn k_split_fills_the_last_wave_and_keeps_lanes_busy() {
        // attn_output, Q4_K in 64-weight tasks: 6,144 rows of 256 tasks, 1.29 waves unsplit.
        assert_eq!(k_split(6144, 1, 1, 256, 32, 0, SLOTS), 2);
        // q_b: 16,384 rows of 32 tasks: splitting would idle half the lanes.
        assert_eq!(k_split(16384, 1, 1, 32, 32, 0, SLOTS), 1);
        // kv_a: 576 rows, 0.12 waves: four warps per row.
        assert_eq!(k_split(576, 1, 1, 96, 32, 0, SLOTS), 4);
        // The MoE down projection + weighted sum, 8 expert slots per row: the slots split
        // (2 and 4 warps cost 3 x 4 and 6 x 2 task-waves: the tie keeps fewer).
        assert_eq!(k_split(6144, 1, 1, 32, 32, 8, SLOTS), 2);
        // Many channels (8 experts' gate+up): already 3.4 waves of full blocks.
        assert_eq!(k_split(2048, 1, 8, 96, 32, 0, SLOTS), 1);
        // The shared expert's Q6_K down (64 tasks, 8 blocks per SM): 1.45 waves, but split
        // lanes would hold one task each.
        assert_eq!(k_split(6144, 1, 1, 64, 32, 0, 132 * 8), 1);
        // q_a (Q4_K, 96 tasks): under one wave, two warps per row.
        assert_eq!(k_split(2048, 1, 1, 96, 32, 0, SLOTS), 2);
        // Any answer is one of the kernel's.
        for rows in [1, 7, 64, 1000, 154_880] {
            for tasks in [1, 6, 96, 512] {
                let lpr = crate::gemv::lanes_for_tasks(tasks);
                let ks = k_split(rows, 32 / lpr, 1, tasks, lpr, 0, SLOTS);
                assert!(matches!(ks, 1 | 2 | 4), "{rows} {tasks}: {ks}");
            }
        }
    }
}
