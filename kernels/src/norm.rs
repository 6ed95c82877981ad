//! RMSNorm (with an optional fused residual add) and LayerNorm, one block per row.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};

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
        check_rows(OP, dlen(x), dlen(y), l)?;
        if want_q8 && (!l.n.is_multiple_of(32) || l.y_stride != l.n) {
            return Err(shape_err(
                OP,
                format!("q8 output needs dense rows of a multiple of 32: {l:?}"),
            ));
        }
        let f = self.func(Op::RmsNorm, "rmsnorm_f32")?;
        let threads = rms_block(l.n);
        debug_assert!(threads.is_multiple_of(32));
        let (q8, qp, dp) = if want_q8 {
            let (q, qp, dp) = Q8Act::alloc(self, l.rows, l.n)?;
            (Some(q), qp, dp)
        } else {
            (None, 0u64, 0u64)
        };
        let s = self.stream();
        let wp = opt_ptr(OP, "w", w, l.n, s)?;
        let (xp, _gx) = x.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let need = span(l.rows, l.y_stride, l.n);
        // (residual in, residual out): the kernel reads res (stride ys) and writes the sum to
        // xo (stride ys); both 0 without a residual.
        let (ip, op, _gi, _go) = match res {
            Residual::None => (0u64, 0u64, None, None),
            Residual::InPlace(r) => {
                need_len(OP, "res", dlen(r), need)?;
                let (p, g) = r.device_ptr_mut(s);
                (p, p, None, Some(g))
            }
            Residual::Split(i, o) => {
                need_len(OP, "res", dlen(i), need)?;
                need_len(OP, "h", dlen(o), need)?;
                let (pi, gi) = i.device_ptr(s);
                let (po, go) = o.device_ptr_mut(s);
                (pi, po, Some(gi), Some(go))
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
            && slots <= RMS_REGS
            && [xr, rr].iter().all(|&a| apart(a, yr) && apart(a, hr))
        {
            slots
        } else {
            1
        };
        let cfg = self.cfg(OP, (l.rows as u64, parts as u64, 1), threads)?;
        let (xs, ys) = (l.x_stride as i64, l.y_stride as i64);
        let n = to_i32(OP, "n", l.n)?;
        let mut b = self.args(&f);
        b.arg(&xp).arg(&xs).arg(&ip).arg(&ys).arg(&op).arg(&ys);
        b.arg(&wp)
            .arg(&yp)
            .arg(&ys)
            .arg(&n)
            .arg(&eps)
            .arg(&qp)
            .arg(&dp);
        // SAFETY: extents of x, res, h, y and w checked above; the q8 regions were sized for
        // l.rows x l.n by Q8Act::alloc; parts only where no part's writes overlap another's
        // reads.
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
        const OP: &str = "rmsnorm_rope";
        let threads = block_for(l.n);
        if l.n > 8 * threads as usize || rope.offset < l.n || rope.offset + rope.n_rot > cols {
            return Err(shape_err(
                OP,
                format!("{l:?} in rows of {cols}, rope {rope:?}"),
            ));
        }
        let f = self.func(Op::RmsNorm, "rmsnorm_rope_f32")?;
        let w_need = l.n;
        self.norm_rope(
            OP, f, x, cols, w, None, w_need, l, eps, rope, cache, threads,
        )
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
        const OP: &str = "layernorm_rope";
        if rope.offset + rope.n_rot > l.n {
            return Err(shape_err(OP, format!("{l:?}, rope {rope:?}")));
        }
        let f = self.func(Op::LayerNorm, "layernorm_rope_f32")?;
        let threads = block_for(l.n);
        self.norm_rope(OP, f, x, l.n, w, bias, l.n, l, eps, rope, cache, threads)
    }

    /// The launch of the two fused norm + RoPE kernels (one parameter list: the RMS kernel
    /// takes no bias, the LayerNorm one normalises all `cols`).
    #[allow(clippy::too_many_arguments)]
    fn norm_rope(
        &self,
        op: &'static str,
        f: crate::device::Kernel,
        x: &mut impl DevicePtrMut<f32>,
        cols: usize,
        w: Option<&CudaView<'_, f32>>,
        bias: Option<&CudaView<'_, f32>>,
        w_need: usize,
        l: Rows,
        eps: f32,
        rope: RowRope<'_>,
        cache: Option<CacheRows<'_>>,
        threads: u32,
    ) -> Result<(), KernelError> {
        if l.x_stride != l.y_stride || l.x_stride < cols {
            return Err(shape_err(
                op,
                format!("in place with strides {l:?}, {cols} columns"),
            ));
        }
        check_rows(op, dlen(x), dlen(x), Rows { n: cols, ..l })?;
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
        let cfg = self.cfg(op, (l.rows as u64, 1, 1), threads)?;
        let s = self.stream();
        let wp = opt_ptr(op, "w", w, w_need, s)?;
        let bp = opt_ptr(op, "b", bias, w_need, s)?;
        let (pp, _gp) = rope.pos.device_ptr(s);
        let (fp, _gf) = rope.inv_freq.device_ptr(s);
        let need = l.rows * cols;
        let (cf, cb, _gc) = match &cache {
            None => (0u64, 0u64, None),
            Some(CacheRows::F32(c)) => {
                need_len(op, "cache", dlen(c), need)?;
                let (p, g) = c.device_ptr(s);
                (p, 0, Some(g))
            }
            Some(CacheRows::Bf16(c)) => {
                need_len(op, "cache", dlen(c), need)?;
                let (p, g) = c.device_ptr(s);
                (0, p, Some(g))
            }
        };
        let (xp, _gx) = x.device_ptr_mut(s);
        let xs = l.x_stride as i64;
        let (n, c32) = (to_i32(op, "n", l.n)?, to_i32(op, "cols", cols)?);
        let (off, nr) = (
            to_i32(op, "offset", rope.offset)?,
            to_i32(op, "n_rot", rope.n_rot)?,
        );
        let style: i32 = match rope.style {
            RopeStyle::Neox => 2,
            _ => 0,
        };
        let cs = cols as i64;
        let mut b = self.args(&f);
        b.arg(&xp).arg(&xs).arg(&c32).arg(&wp).arg(&bp);
        b.arg(&n).arg(&eps).arg(&off).arg(&nr).arg(&pp).arg(&fp);
        b.arg(&style).arg(&cf).arg(&cb).arg(&cs);
        // SAFETY: x, w, b, pos, inv_freq and the cache rows checked above against the rows the
        // kernel touches; the rope span lies inside each row (checked by the callers).
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
