//! RMSNorm (with an optional fused residual add) and LayerNorm, one block per row.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::gemvq::Q8Act;
use crate::launch::{opt_ptr, shape_err, span};
use crate::ops::Op;
use crate::pool::DevViewMut;
use crate::rope::RopeStyle;

/// RoPE inside a fused norm launch ([`Gpu::rms_norm_rope`], [`Gpu::layer_norm_rope`]): the pairs
/// of columns `offset .. offset + n_rot` of row r rotated by `pos[r] * inv_freq[j]`, with
/// rope.cu's arithmetic.
#[derive(Debug, Clone, Copy)]
pub struct RowRope<'a> {
    pub offset: usize,
    pub n_rot: usize,
    pub pos: &'a CudaView<'a, i32>,
    pub inv_freq: &'a CudaView<'a, f32>,
    pub style: RopeStyle,
}

/// Where a fused norm launch also writes its rows: the next rows of a KV cache, dense, f32 or
/// bf16 (rounded to nearest even, as `Gpu::to_bf16`).
pub enum CacheRows<'a> {
    F32(DevViewMut<'a, f32>),
    Bf16(DevViewMut<'a, u16>),
}

/// `rows` rows of `n` values; row r of x starts at `r * x_stride`, of y at `r * y_stride`.
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    pub rows: usize,
    pub n: usize,
    pub x_stride: usize,
    pub y_stride: usize,
}

impl Rows {
    /// Contiguous rows.
    pub fn dense(rows: usize, n: usize) -> Self {
        Rows {
            rows,
            n,
            x_stride: n,
            y_stride: n,
        }
    }
}

/// Values a thread of rmsnorm.cu holds in registers (`RMS_REGS`, prepended to its source by
/// `Op::sections`): rows up to this many times the block take the register path, the only one
/// with parts.
pub(crate) const RMS_REGS: usize = 8;

/// The most parts a one-row RMSNorm takes: one per register slot unless `GGUFTOOL_RMS_PARTS_MAX`
/// names 2 or more (an A/B knob: each part reads the whole row for its sum of squares, and 12 or
/// 24 parts of a 6,144-wide row were 4.5% and 16% slower end to end than 6, H100 2026-12-08; a
/// part then writes the slots `k` with `k % parts == part`, the same values).
fn rms_parts_max() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("GGUFTOOL_RMS_PARTS_MAX")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&p: &usize| p >= 2)
            .unwrap_or(usize::MAX)
    })
}

/// [`RMS_REGS`], or the 12, 16 or 24 that `GGUFTOOL_RMS_REGS` names: an A/B knob for the decode
/// step's 6,144-wide norms (H100 timeline: 9.3 us a launch against 4.9 for the 2,048-wide one),
/// which with `GGUFTOOL_RMS_WIDE=512` / `256` then run as 12 / 24 parts of fewer threads.
pub(crate) fn rms_regs() -> usize {
    static REGS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *REGS.get_or_init(|| {
        std::env::var("GGUFTOOL_RMS_REGS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|r| matches!(r, 12 | 16 | 24))
            .unwrap_or(RMS_REGS)
    })
}

fn block_for(n: usize) -> u32 {
    // Wide rows get the most threads: a single row (decode) is one block, bound by how many
    // loads are in flight, not by the SM's arithmetic.
    if n >= 4096 {
        1024
    } else if n >= 2048 {
        512
    } else if n >= 256 {
        256
    } else {
        64
    }
}

/// Threads of an RMSNorm block: [`block_for`], except that rows of 4,096 and more take
/// `GGUFTOOL_RMS_WIDE` threads when it names 128, 256, 512 or 1024 (an A/B knob for the decode
/// step's single-row norms, which the timeline shows latency-bound at 7.6 us a launch; wider than
/// 8 values a thread they take the strided loops, the same sums in another order).
fn rms_block(n: usize) -> u32 {
    static WIDE: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let wide = WIDE.get_or_init(|| {
        let t: u32 = std::env::var("GGUFTOOL_RMS_WIDE").ok()?.parse().ok()?;
        matches!(t, 128 | 256 | 512 | 1024).then_some(t)
    });
    match *wide {
        Some(t) if n >= 4096 => t,
        _ => block_for(n),
    }
}

/// The extent checks both norms start with: non-empty rows, `x` and `y` long enough.
fn check_rows(op: &'static str, x_len: usize, y_len: usize, l: Rows) -> Result<(), KernelError> {
    if l.rows == 0 || l.n == 0 {
        return Err(shape_err(op, format!("empty rows {l:?}")));
    }
    need_len(op, "x", x_len, span(l.rows, l.x_stride, l.n))?;
    need_len(op, "y", y_len, span(l.rows, l.y_stride, l.n))
}

/// The residual operand of the fused RMSNorm.
enum Residual<'a, I, R> {
    None,
    /// Read and overwritten with the sum.
    InPlace(&'a mut R),
    /// Read from the first, the sum written to the second.
    Split(&'a I, &'a mut R),
}

/// rmsnorm.cu's `struct RmsJob`: one RMSNorm's operands, rows, parts and threads.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RmsJob {
    x: u64,
    x_stride: i64,
    res: u64,
    res_stride: i64,
    xo: u64,
    xo_stride: i64,
    w: u64,
    y: u64,
    y_stride: i64,
    qs: u64,
    qd: u64,
    n: i32,
    eps: f32,
    rows: i32,
    parts: i32,
    threads: i32,
}

impl RmsJob {
    /// The job of no rows (an absent norm of [`Gpu::mla_norms`]).
    const NONE: RmsJob = RmsJob {
        x: 0,
        x_stride: 0,
        res: 0,
        res_stride: 0,
        xo: 0,
        xo_stride: 0,
        w: 0,
        y: 0,
        y_stride: 0,
        qs: 0,
        qd: 0,
        n: 0,
        eps: 0.0,
        rows: 0,
        parts: 1,
        threads: 32,
    };
}

/// norm_rows.cuh's `struct NormRopeJob`: one fused norm + RoPE (+ cache rows).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct NormRopeJob {
    x: u64,
    x_stride: i64,
    w: u64,
    b: u64,
    pos: u64,
    inv_freq: u64,
    cf: u64,
    cb: u64,
    c_stride: i64,
    cols: i32,
    n: i32,
    eps: f32,
    off: i32,
    n_rot: i32,
    style: i32,
    rows: i32,
    threads: i32,
}

impl NormRopeJob {
    const NONE: NormRopeJob = NormRopeJob {
        x: 0,
        x_stride: 0,
        w: 0,
        b: 0,
        pos: 0,
        inv_freq: 0,
        cf: 0,
        cb: 0,
        c_stride: 0,
        cols: 0,
        n: 0,
        eps: 0.0,
        off: 0,
        n_rot: 0,
        style: 0,
        rows: 0,
        threads: 32,
    };
}

/// A device byte range a job touches and whether it writes it.
type Touch = ((u64, u64), bool);

/// `[p, p + bytes)` (empty where p is 0: an absent operand).
fn touch(p: u64, bytes: usize, write: bool) -> Touch {
    let end = if p == 0 { 0 } else { p + bytes as u64 };
    ((p, end), write)
}

impl RmsJob {
    /// What the launch reads and writes of x, res, xo and y (the q8 output is a fresh buffer).
    fn ranges(&self) -> [Touch; 4] {
        let rows = self.rows.max(0) as usize;
        let n = self.n.max(0) as usize;
        let b = |stride: i64| 4 * span(rows, stride.max(0) as usize, n);
        [
            touch(self.x, b(self.x_stride), false),
            touch(self.res, b(self.res_stride), false),
            touch(self.xo, b(self.xo_stride), true),
            touch(self.y, b(self.y_stride), true),
        ]
    }
}

impl NormRopeJob {
    /// What the launch reads and writes of its rows (in place) and cache rows.
    fn ranges(&self) -> [Touch; 3] {
        let rows = self.rows.max(0) as usize;
        let cols = self.cols.max(0) as usize;
        [
            touch(
                self.x,
                4 * span(rows, self.x_stride.max(0) as usize, cols),
                true,
            ),
            touch(self.cf, 4 * rows * cols, true),
            touch(self.cb, 2 * rows * cols, true),
        ]
    }
}

/// The first pair of ranges of two different jobs that overlap where either writes.
fn first_overlap(jobs: &[&[Touch]]) -> Option<((u64, u64), (u64, u64))> {
    for (a, ra) in jobs.iter().enumerate() {
        for rb in &jobs[a + 1..] {
            for &(x, xw) in ra.iter() {
                for &(y, yw) in rb.iter() {
                    if (xw || yw) && x.0 < y.1 && y.0 < x.1 {
                        return Some((x, y));
                    }
                }
            }
        }
    }
    None
}

// SAFETY: plain structs laid out exactly as rmsnorm.cu's `struct RmsJob` and norm_rows.cuh's
// `struct NormRopeJob` (the launch checks their sizes against the kernel's parameters).
unsafe impl DeviceRepr for RmsJob {}
unsafe impl DeviceRepr for NormRopeJob {}

/// The q_a norm of [`Gpu::mla_norms`]: [`Gpu::rms_norm_q8`]'s operands (`q8: false`:
/// [`Gpu::rms_norm`]'s).
pub struct QaNorm<'a, X, Y> {
    pub x: &'a X,
    pub w: Option<&'a CudaView<'a, f32>>,
    pub y: &'a mut Y,
    pub l: Rows,
    pub eps: f32,
    pub q8: bool,
}

/// A fused norm + RoPE of [`Gpu::mla_norms`]: [`Gpu::rms_norm_rope`]'s operands (`bias`
/// unused) or [`Gpu::layer_norm_rope`]'s (`cols` = `l.n`).
pub struct NormRope<'a, X> {
    pub x: &'a mut X,
    pub cols: usize,
    pub w: Option<&'a CudaView<'a, f32>>,
    pub bias: Option<&'a CudaView<'a, f32>>,
    pub l: Rows,
    pub eps: f32,
    pub rope: RowRope<'a>,
    pub cache: Option<CacheRows<'a>>,
}

impl Gpu {
    /// `y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps)` (`w = None`: no weight).
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        w: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
    ) -> Result<(), KernelError> {
        self.rms_norm_impl(
            x,
            Residual::<CudaSlice<f32>, CudaSlice<f32>>::None,
            w,
            y,
            l,
            eps,
            false,
        )
        .map(|_| ())
    }

    /// [`Gpu::rms_norm`] on dense rows that also returns `y` as q8 activations, bit for bit what
    /// [`Gpu::quantize_q8`] of `y` gives, from the same launch (`l.n` a multiple of 32).
    pub fn rms_norm_q8(
        &self,
        x: &impl DevicePtr<f32>,
        w: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
    ) -> Result<Q8Act, KernelError> {
        self.rms_norm_impl(
            x,
            Residual::<CudaSlice<f32>, CudaSlice<f32>>::None,
            w,
            y,
            l,
            eps,
            true,
        )?
        .ok_or_else(|| shape_err("rmsnorm", "no q8 output"))
    }

    /// [`Gpu::rms_norm`] in place on `x` (`l.x_stride` must equal `l.y_stride`): normalizes the
    /// first `l.n` columns of rows `l.y_stride` apart, leaving the others as they are.
    pub fn rms_norm_in_place(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        w: Option<&CudaView<'_, f32>>,
        l: Rows,
        eps: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "rmsnorm";
        if l.x_stride != l.y_stride {
            return Err(shape_err(OP, format!("in place with strides {l:?}")));
        }
        check_rows(OP, dlen(x), dlen(x), l)?;
        let f = self.func(Op::RmsNorm, "rmsnorm_f32")?;
        let cfg = self.cfg(OP, (l.rows as u64, 1, 1), rms_block(l.n))?;
        let s = self.stream();
        let wp = opt_ptr(OP, "w", w, l.n, s)?;
        let (xp, _gx) = x.device_ptr_mut(s);
        let (xs, none) = (l.x_stride as i64, 0u64);
        let n = to_i32(OP, "n", l.n)?;
        let mut b = self.args(&f);
        b.arg(&xp).arg(&xs).arg(&none).arg(&xs).arg(&none).arg(&xs);
        b.arg(&wp)
            .arg(&xp)
            .arg(&xs)
            .arg(&n)
            .arg(&eps)
            .arg(&none)
            .arg(&none);
        // SAFETY: extents checked above; the kernel allows y == x (each thread rewrites only
        // the elements it read, after the row's reduction).
        unsafe { self.launch(OP, b, cfg) }
    }

    /// Fused residual: `h[r] = x[r] + res[r]` is written back into `res` (the residual stream),
    /// then `y[r] = rms_norm(h[r])`. Strides: x uses `x_stride`, res and y use `y_stride`.
    pub fn add_rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        res: &mut impl DevicePtrMut<f32>,
        w: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
    ) -> Result<(), KernelError> {
        self.rms_norm_impl(
            x,
            Residual::<CudaSlice<f32>, _>::InPlace(res),
            w,
            y,
            l,
            eps,
            false,
        )
        .map(|_| ())
    }

    /// [`Gpu::add_rms_norm`] keeping the residual input: `h[r] = x[r] + res[r]` goes to `h`
    /// (stride `y_stride`, like res and y).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_to(
        &self,
        x: &impl DevicePtr<f32>,
        res: &impl DevicePtr<f32>,
        h: &mut impl DevicePtrMut<f32>,
        w: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
    ) -> Result<(), KernelError> {
        self.rms_norm_impl(x, Residual::Split(res, h), w, y, l, eps, false)
            .map(|_| ())
    }

    /// [`Gpu::add_rms_norm_to`] that also returns `y` as q8 activations (see
    /// [`Gpu::rms_norm_q8`]).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_to_q8(
        &self,
        x: &impl DevicePtr<f32>,
        res: &impl DevicePtr<f32>,
        h: &mut impl DevicePtrMut<f32>,
        w: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
    ) -> Result<Q8Act, KernelError> {
        self.rms_norm_impl(x, Residual::Split(res, h), w, y, l, eps, true)?
            .ok_or_else(|| shape_err("rmsnorm", "no q8 output"))
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_impl<I: DevicePtr<f32>, R: DevicePtrMut<f32>>(
        &self,
        x: &impl DevicePtr<f32>,
        res: Residual<'_, I, R>,
        w: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
        want_q8: bool,
    ) -> Result<Option<Q8Act>, KernelError> {
        const OP: &str = "rmsnorm";
        let (j, q8) = self.rms_job(x, res, w, y, l, eps, want_q8)?;
        let f = self.func(Op::RmsNorm, "rmsnorm_f32")?;
        let cfg = self.cfg(OP, (j.rows as u64, j.parts as u64, 1), j.threads as u32)?;
        let mut b = self.args(&f);
        b.arg(&j.x)
            .arg(&j.x_stride)
            .arg(&j.res)
            .arg(&j.res_stride)
            .arg(&j.xo)
            .arg(&j.xo_stride);
        b.arg(&j.w)
            .arg(&j.y)
            .arg(&j.y_stride)
            .arg(&j.n)
            .arg(&j.eps)
            .arg(&j.qs)
            .arg(&j.qd);
        // SAFETY: extents of x, res, h, y and w checked by rms_job; the q8 regions were sized
        // for l.rows x l.n by Q8Act::alloc; parts only where no part's writes overlap another's
        // reads.
        unsafe { self.launch(OP, b, cfg) }?;
        Ok(q8)
    }

    /// The checked operands of one RMSNorm launch ([`Gpu::rms_norm_impl`], one job of
    /// [`Gpu::mla_norms`]) and its q8 output, allocated when `want_q8`. The device-pointer
    /// guards carry nothing: the context runs without cudarc's event tracking (`Gpu::open`).
    #[allow(clippy::too_many_arguments)]
    fn rms_job<I: DevicePtr<f32>, R: DevicePtrMut<f32>>(
        &self,
        x: &impl DevicePtr<f32>,
        res: Residual<'_, I, R>,
        w: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
        want_q8: bool,
    ) -> Result<(RmsJob, Option<Q8Act>), KernelError> {
        const OP: &str = "rmsnorm";
        check_rows(OP, dlen(x), dlen(y), l)?;
        if want_q8 && (!l.n.is_multiple_of(32) || l.y_stride != l.n) {
            return Err(shape_err(
                OP,
                format!("q8 output needs dense rows of a multiple of 32: {l:?}"),
            ));
        }
        let threads = rms_block(l.n);
        debug_assert!(threads.is_multiple_of(32));
        let s = self.stream();
        let wp = opt_ptr(OP, "w", w, l.n, s)?;
        let xp = x.device_ptr(s).0;
        let yp = y.device_ptr_mut(s).0;
        let need = span(l.rows, l.y_stride, l.n);
        // (residual in, residual out): the kernel reads res (stride ys) and writes the sum to
        // xo (stride ys); both 0 without a residual.
        let (ip, op) = match res {
            Residual::None => (0u64, 0u64),
            Residual::InPlace(r) => {
                need_len(OP, "res", dlen(r), need)?;
                let p = r.device_ptr_mut(s).0;
                (p, p)
            }
            Residual::Split(i, o) => {
                need_len(OP, "res", dlen(i), need)?;
                need_len(OP, "h", dlen(o), need)?;
                (i.device_ptr(s).0, o.device_ptr_mut(s).0)
            }
        };
        // A single row in parts (one block per register slot) where nothing a part writes
        // (y, the residual sum) overlaps what the others read (x, res).
        let bytes = |p: u64, stride: usize| (p, p + 4 * span(l.rows, stride, l.n) as u64);
        let apart = |a: (u64, u64), b: (u64, u64)| a.0 == 0 || b.0 == 0 || a.1 <= b.0 || b.1 <= a.0;
        let (xr, rr) = (bytes(xp, l.x_stride), bytes(ip, l.y_stride));
        let (yr, hr) = (bytes(yp, l.y_stride), bytes(op, l.y_stride));
        let slots = l.n.div_ceil(threads as usize);
        let parts = if l.rows == 1
            && self.rms_parts()
            && slots <= rms_regs()
            && [xr, rr].iter().all(|&a| apart(a, yr) && apart(a, hr))
        {
            slots.min(rms_parts_max())
        } else {
            1
        };
        let (q8, qs, qd) = if want_q8 {
            let (q, qp, dp) = Q8Act::alloc(self, l.rows, l.n)?;
            (Some(q), qp, dp)
        } else {
            (None, 0u64, 0u64)
        };
        let (xs, ys) = (l.x_stride as i64, l.y_stride as i64);
        let job = RmsJob {
            x: xp,
            x_stride: xs,
            res: ip,
            res_stride: ys,
            xo: op,
            xo_stride: ys,
            w: wp,
            y: yp,
            y_stride: ys,
            qs,
            qd,
            n: to_i32(OP, "n", l.n)?,
            eps,
            rows: to_i32(OP, "rows", l.rows)?,
            parts: parts as i32,
            threads: threads as i32,
        };
        Ok((job, q8))
    }

    /// An MLA block's three norms after its stacked projection as one launch (rmsnorm.cu's
    /// `mla_norms_f32`): `q` ([`Gpu::rms_norm`] or, with `q.q8`, [`Gpu::rms_norm_q8`]),
    /// `kv` ([`Gpu::rms_norm_rope`]) and `ix` ([`Gpu::layer_norm_rope`]), each with the
    /// operands, checks, thread count and parts its own launch takes, so every output is
    /// bitwise what that launch writes. Returns `q`'s q8 activations when asked. The jobs must
    /// touch disjoint memory (the runtime's are separate projection outputs and caches).
    pub fn mla_norms<X, Y, K, I>(
        &self,
        q: Option<QaNorm<'_, X, Y>>,
        kv: NormRope<'_, K>,
        ix: Option<NormRope<'_, I>>,
    ) -> Result<Option<Q8Act>, KernelError>
    where
        X: DevicePtr<f32>,
        Y: DevicePtrMut<f32>,
        K: DevicePtrMut<f32>,
        I: DevicePtrMut<f32>,
    {
        const OP: &str = "mla_norms";
        let (qj, q8) = match q {
            None => (RmsJob::NONE, None),
            Some(q) => self.rms_job(
                q.x,
                Residual::<CudaSlice<f32>, CudaSlice<f32>>::None,
                q.w,
                q.y,
                q.l,
                q.eps,
                q.q8,
            )?,
        };
        let kj = self.rms_rope_job(kv)?;
        let ij = match ix {
            None => NormRopeJob::NONE,
            Some(ix) => self.ln_rope_job(ix)?,
        };
        // No job may write what another reads or writes: they run side by side.
        if let Some((a, b)) = first_overlap(&[&qj.ranges(), &kj.ranges(), &ij.ranges()]) {
            return Err(shape_err(OP, format!("jobs overlap: {a:x?} and {b:x?}")));
        }
        let blocks = qj.rows as u64 * qj.parts as u64 + kj.rows as u64 + ij.rows as u64;
        let threads = qj.threads.max(kj.threads).max(ij.threads) as u32;
        let f = self.func(Op::RmsNorm, "mla_norms_f32")?;
        let cfg = self.cfg(OP, (blocks, 1, 1), threads)?;
        let mut b = self.args(&f);
        b.arg(&qj).arg(&kj).arg(&ij);
        // SAFETY: each job's operands checked as its own launch checks them (rms_job,
        // rms_rope_job, ln_rope_job); the jobs write disjoint memory (the caller's contract).
        unsafe { self.launch(OP, b, cfg) }?;
        Ok(q8)
    }

    /// The MLA cache rows in one launch: per row of `cols` values (`l.x_stride` apart), the
    /// first `l.n` normalised in place exactly as [`Gpu::rms_norm_in_place`] does (the same
    /// kernel code and block size: bitwise), RoPE `rope` on columns past them as [`Gpu::rope`]
    /// does, and with `cache` every row also written to the cache's rows (`cols` apart).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        cols: usize,
        w: Option<&CudaView<'_, f32>>,
        l: Rows,
        eps: f32,
        rope: RowRope<'_>,
        cache: Option<CacheRows<'_>>,
    ) -> Result<(), KernelError> {
        let j = self.rms_rope_job(NormRope {
            x,
            cols,
            w,
            bias: None,
            l,
            eps,
            rope,
            cache,
        })?;
        let f = self.func(Op::RmsNorm, "rmsnorm_rope_f32")?;
        self.norm_rope_launch("rmsnorm_rope", f, &j)
    }

    /// The DSA indexer's cached keys in one launch: per row of `l.n` values, LayerNorm in
    /// place exactly as [`Gpu::layer_norm`] computes it (the same kernel code and block size:
    /// bitwise), then RoPE `rope` on the normalised values as [`Gpu::rope`] does, and with
    /// `cache` every row also written to the cache's rows.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        w: Option<&CudaView<'_, f32>>,
        bias: Option<&CudaView<'_, f32>>,
        l: Rows,
        eps: f32,
        rope: RowRope<'_>,
        cache: Option<CacheRows<'_>>,
    ) -> Result<(), KernelError> {
        let j = self.ln_rope_job(NormRope {
            x,
            cols: l.n,
            w,
            bias,
            l,
            eps,
            rope,
            cache,
        })?;
        let f = self.func(Op::LayerNorm, "layernorm_rope_f32")?;
        self.norm_rope_launch("layernorm_rope", f, &j)
    }

    /// [`Gpu::rms_norm_rope`]'s checked job (its `bias` must be absent).
    fn rms_rope_job<X: DevicePtrMut<f32>>(
        &self,
        a: NormRope<'_, X>,
    ) -> Result<NormRopeJob, KernelError> {
        const OP: &str = "rmsnorm_rope";
        let threads = block_for(a.l.n);
        let (l, rope, cols) = (a.l, a.rope, a.cols);
        if a.bias.is_some()
            || l.n > rms_regs() * threads as usize
            || rope.offset < l.n
            || rope.offset + rope.n_rot > cols
        {
            return Err(shape_err(
                OP,
                format!("{l:?} in rows of {cols}, rope {rope:?}"),
            ));
        }
        self.norm_rope_job(OP, a, l.n, threads)
    }

    /// [`Gpu::layer_norm_rope`]'s checked job (`cols` must equal `l.n`).
    fn ln_rope_job<X: DevicePtrMut<f32>>(
        &self,
        a: NormRope<'_, X>,
    ) -> Result<NormRopeJob, KernelError> {
        const OP: &str = "layernorm_rope";
        let (l, rope) = (a.l, a.rope);
        if a.cols != l.n || rope.offset + rope.n_rot > l.n {
            return Err(shape_err(
                OP,
                format!("{l:?} in rows of {}, rope {rope:?}", a.cols),
            ));
        }
        self.norm_rope_job(OP, a, l.n, block_for(l.n))
    }

    /// The checked job of the two fused norm + RoPE kernels (one parameter list: the RMS kernel
    /// takes no bias, the LayerNorm one normalises all `cols`); `w_need` weights (and bias
    /// values) are read. Guards as in [`Gpu::rms_job`].
    fn norm_rope_job<X: DevicePtrMut<f32>>(
        &self,
        op: &'static str,
        a: NormRope<'_, X>,
        w_need: usize,
        threads: u32,
    ) -> Result<NormRopeJob, KernelError> {
        let (l, cols, rope) = (a.l, a.cols, a.rope);
        if l.x_stride != l.y_stride || l.x_stride < cols {
            return Err(shape_err(
                op,
                format!("in place with strides {l:?}, {cols} columns"),
            ));
        }
        check_rows(op, dlen(a.x), dlen(a.x), Rows { n: cols, ..l })?;
        let half = rope.n_rot / 2;
        if rope.n_rot == 0
            || !rope.n_rot.is_multiple_of(2)
            || half > threads as usize
            || rope.style == RopeStyle::InterleavedHf
        {
            return Err(shape_err(
                op,
                format!("rope {rope:?} in blocks of {threads}"),
            ));
        }
        need_len(op, "pos", rope.pos.len(), l.rows)?;
        need_len(op, "inv_freq", rope.inv_freq.len(), half)?;
        let s = self.stream();
        let w = opt_ptr(op, "w", a.w, w_need, s)?;
        let b = opt_ptr(op, "b", a.bias, w_need, s)?;
        let need = l.rows * cols;
        let (cf, cb) = match &a.cache {
            None => (0u64, 0u64),
            Some(CacheRows::F32(c)) => {
                need_len(op, "cache", dlen(c), need)?;
                (c.device_ptr(s).0, 0)
            }
            Some(CacheRows::Bf16(c)) => {
                need_len(op, "cache", dlen(c), need)?;
                (0, c.device_ptr(s).0)
            }
        };
        Ok(NormRopeJob {
            x: a.x.device_ptr_mut(s).0,
            x_stride: l.x_stride as i64,
            w,
            b,
            pos: rope.pos.device_ptr(s).0,
            inv_freq: rope.inv_freq.device_ptr(s).0,
            cf,
            cb,
            c_stride: cols as i64,
            cols: to_i32(op, "cols", cols)?,
            n: to_i32(op, "n", l.n)?,
            eps: a.eps,
            off: to_i32(op, "offset", rope.offset)?,
            n_rot: to_i32(op, "n_rot", rope.n_rot)?,
            style: match rope.style {
                RopeStyle::Neox => 2,
                _ => 0,
            },
            rows: to_i32(op, "rows", l.rows)?,
            threads: threads as i32,
        })
    }

    /// The launch of one fused norm + RoPE kernel on its job: a block of `j.threads` per row.
    fn norm_rope_launch(
        &self,
        op: &'static str,
        f: crate::device::Kernel,
        j: &NormRopeJob,
    ) -> Result<(), KernelError> {
        let cfg = self.cfg(op, (j.rows as u64, 1, 1), j.threads as u32)?;
        let mut b = self.args(&f);
        b.arg(&j.x)
            .arg(&j.x_stride)
            .arg(&j.cols)
            .arg(&j.w)
            .arg(&j.b);
        b.arg(&j.n)
            .arg(&j.eps)
            .arg(&j.off)
            .arg(&j.n_rot)
            .arg(&j.pos)
            .arg(&j.inv_freq);
        b.arg(&j.style).arg(&j.cf).arg(&j.cb).arg(&j.c_stride);
        // SAFETY: x, w, b, pos, inv_freq and the cache rows checked by norm_rope_job against
        // the rows the kernel touches; the rope span lies inside each row (rms_rope_job,
        // ln_rope_job).
        unsafe { self.launch(op, b, cfg) }
    }

    /// `y[r] = (x[r] - mean) / sqrt(var + eps) * w + b` with the biased variance.
    pub fn layer_norm(
        &self,
        x: &impl DevicePtr<f32>,
        w: Option<&CudaView<'_, f32>>,
        bias: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "layernorm";
        check_rows(OP, dlen(x), dlen(y), l)?;
        let f = self.func(Op::LayerNorm, "layernorm_f32")?;
        let cfg = self.cfg(OP, (l.rows as u64, 1, 1), block_for(l.n))?;
        let s = self.stream();
        let wp = opt_ptr(OP, "w", w, l.n, s)?;
        let bp = opt_ptr(OP, "b", bias, l.n, s)?;
        let (xp, _gx) = x.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let (xs, ys) = (l.x_stride as i64, l.y_stride as i64);
        let n = to_i32(OP, "n", l.n)?;
        let mut b = self.args(&f);
        b.arg(&xp)
            .arg(&xs)
            .arg(&wp)
            .arg(&bp)
            .arg(&yp)
            .arg(&ys)
            .arg(&n)
            .arg(&eps);
        // SAFETY: extents checked above.
        unsafe { self.launch(OP, b, cfg) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A q_a job reading 2,048 floats at `x` and writing them at `y`.
    fn q_job(x: u64, y: u64) -> RmsJob {
        RmsJob {
            x,
            y,
            n: 2048,
            rows: 1,
            x_stride: 2048,
            y_stride: 2048,
            ..RmsJob::NONE
        }
    }

    /// A kv job rewriting one 576-float row at `x` and its f32 cache row at `c`.
    fn kv_job(x: u64, c: u64) -> NormRopeJob {
        NormRopeJob {
            x,
            cf: c,
            cols: 576,
            n: 512,
            rows: 1,
            x_stride: 576,
            ..NormRopeJob::NONE
        }
    }

    #[test]
    fn side_by_side_jobs_must_not_overlap_where_one_writes() {
        let (q, kv) = (q_job(0x10000, 0x20000), kv_job(0x30000, 0x40000));
        let none = NormRopeJob::NONE;
        assert_eq!(
            first_overlap(&[&q.ranges(), &kv.ranges(), &none.ranges()]),
            None
        );
        // kv's rows start inside q's output (8,192 bytes from 0x20000).
        let kv_in_y = kv_job(0x20000 + 8188, 0x40000);
        assert!(first_overlap(&[&q.ranges(), &kv_in_y.ranges()]).is_some());
        // The first byte past q's input is free; the last one is not.
        assert!(first_overlap(&[&q.ranges(), &kv_job(0x10000 + 8192, 0x40000).ranges()]).is_none());
        assert!(first_overlap(&[&q.ranges(), &kv_job(0x10000 + 8188, 0x40000).ranges()]).is_some());
        // Two jobs' caches on one row.
        let ix = NormRopeJob {
            cols: 128,
            n: 128,
            x_stride: 128,
            ..kv_job(0x50000, 0x40000 + 4 * 575)
        };
        assert!(first_overlap(&[&kv.ranges(), &ix.ranges()]).is_some());
        // Reads alone may share memory: two q jobs reading one input, writing apart.
        let q2 = q_job(0x10000, 0x60000);
        assert!(first_overlap(&[&q.ranges(), &q2.ranges()]).is_none());
    }
}
