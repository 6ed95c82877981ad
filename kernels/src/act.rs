//! Element-wise ops of the forward pass: SwiGLU, residual adds, scaling, strided copies, bf16.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::launch::{shape_err, span};
use crate::ops::Op;
use crate::sample::{greedy_plan, Split};

const BLOCK: u32 = 256;

/// Launch grid of the one-thread-per-element kernels over `n` elements (x only).
fn elem_grid(n: usize, rows: usize) -> (u64, u64, u64) {
    ((n as u64).div_ceil(BLOCK as u64), rows as u64, 1)
}

/// Grid x of the row-wise kernels (rows grid-stride over y, see `Gpu::cfg_rows`).
fn elem_x(n: usize) -> u64 {
    (n as u64).div_ceil(BLOCK as u64)
}

/// `rows` rows of `n` values, each operand with its own row stride.
#[derive(Debug, Clone, Copy)]
pub struct Rows3 {
    pub rows: usize,
    pub n: usize,
    pub a_stride: usize,
    pub b_stride: usize,
    pub out_stride: usize,
}

impl Rows3 {
    pub fn dense(rows: usize, n: usize) -> Self {
        Rows3 {
            rows,
            n,
            a_stride: n,
            b_stride: n,
            out_stride: n,
        }
    }
}

impl Gpu {
    /// `out = silu(gate) * up` with `silu(g) = g / (1 + exp(-g))`.
    pub fn silu_mul(
        &self,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        l: Rows3,
    ) -> Result<(), KernelError> {
        const OP: &str = "silu_mul";
        if l.rows == 0 || l.n == 0 {
            return Err(shape_err(OP, format!("empty rows {l:?}")));
        }
        need_len(OP, "gate", dlen(gate), span(l.rows, l.a_stride, l.n))?;
        need_len(OP, "up", dlen(up), span(l.rows, l.b_stride, l.n))?;
        need_len(OP, "out", dlen(out), span(l.rows, l.out_stride, l.n))?;
        let f = self.func(Op::SiluMul, "silu_mul_f32")?;
        let cfg = self.cfg_rows(OP, elem_x(l.n), l.rows, BLOCK)?;
        let s = self.stream();
        let (gp, _g1) = gate.device_ptr(s);
        let (up_, _g2) = up.device_ptr(s);
        let (op, _g3) = out.device_ptr_mut(s);
        let (gs, us, os) = (l.a_stride as i64, l.b_stride as i64, l.out_stride as i64);
        let n = to_i32(OP, "n", l.n)?;
        let rows = l.rows as i64;
        let mut b = self.args(&f);
        b.arg(&gp)
            .arg(&gs)
            .arg(&up_)
            .arg(&us)
            .arg(&op)
            .arg(&os)
            .arg(&n)
            .arg(&rows);
        // SAFETY: extents checked above.
        unsafe { self.launch(OP, b, cfg) }
    }

    /// `y = a + b` over the first `n` elements (for in-place adds see [`Gpu::add_assign`]).
    pub fn add(
        &self,
        a: &impl DevicePtr<f32>,
        b: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "add";
        need_len(OP, "a", dlen(a), n)?;
        need_len(OP, "b", dlen(b), n)?;
        need_len(OP, "y", dlen(y), n)?;
        if n == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (ap, _ga) = a.device_ptr(s);
        let (bp, _gb) = b.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        // SAFETY: all three hold >= n elements.
        unsafe { self.add_raw(OP, ap, bp, yp, n) }
    }

    /// `y += b` over the first `n` elements (residual add).
    pub fn add_assign(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        b: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "add_assign";
        need_len(OP, "b", dlen(b), n)?;
        need_len(OP, "y", dlen(y), n)?;
        if n == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (bp, _gb) = b.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        // SAFETY: both hold >= n elements; the kernel reads y[i] before writing it.
        unsafe { self.add_raw(OP, yp, bp, yp, n) }
    }

    /// `add_f32` on raw device addresses, so [`Gpu::add`] and [`Gpu::add_assign`] (where `y`
    /// is also the first operand, which the borrow rules cannot express) share one launch.
    ///
    /// # Safety
    /// `ap`, `bp` and `yp` must each hold at least `n` f32 values, with `n > 0`.
    unsafe fn add_raw(
        &self,
        op: &'static str,
        ap: u64,
        bp: u64,
        yp: u64,
        n: usize,
    ) -> Result<(), KernelError> {
        let f = self.func(Op::Elementwise, "add_f32")?;
        let cfg = self.cfg(op, elem_grid(n, 1), BLOCK)?;
        let n64 = n as i64;
        let mut bl = self.args(&f);
        bl.arg(&ap).arg(&bp).arg(&yp).arg(&n64);
        // SAFETY: the caller's contract.
        unsafe { self.launch(op, bl, cfg) }
    }

    /// `y = a * scale` over the first `n` elements.
    pub fn scale(
        &self,
        a: &impl DevicePtr<f32>,
        scale: f32,
        y: &mut impl DevicePtrMut<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "scale";
        need_len(OP, "a", dlen(a), n)?;
        need_len(OP, "y", dlen(y), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(Op::Elementwise, "scale_f32")?;
        let cfg = self.cfg(OP, elem_grid(n, 1), BLOCK)?;
        let s = self.stream();
        let (ap, _ga) = a.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let n64 = n as i64;
        let mut bl = self.args(&f);
        bl.arg(&ap).arg(&scale).arg(&yp).arg(&n64);
        // SAFETY: both hold >= n elements.
        unsafe { self.launch(OP, bl, cfg) }
    }

    /// Strided row copy: `dst[r * dst_stride + i] = src[r * src_stride + i]`, `i < n`.
    pub fn copy_rows(
        &self,
        src: &impl DevicePtr<f32>,
        src_stride: usize,
        dst: &mut impl DevicePtrMut<f32>,
        dst_stride: usize,
        rows: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "copy_rows";
        if rows == 0 || n == 0 {
            return Ok(());
        }
        need_len(OP, "src", dlen(src), span(rows, src_stride, n))?;
        need_len(OP, "dst", dlen(dst), span(rows, dst_stride, n))?;
        let f = self.func(Op::Elementwise, "copy_rows_f32")?;
        let cfg = self.cfg_rows(OP, elem_x(n), rows, BLOCK)?;
        let s = self.stream();
        let (sp, _gs) = src.device_ptr(s);
        let (dp, _gd) = dst.device_ptr_mut(s);
        let (ss, ds) = (src_stride as i64, dst_stride as i64);
        let n32 = to_i32(OP, "n", n)?;
        let r64 = rows as i64;
        let mut bl = self.args(&f);
        bl.arg(&sp).arg(&ss).arg(&dp).arg(&ds).arg(&n32).arg(&r64);
        // SAFETY: extents checked above.
        unsafe { self.launch(OP, bl, cfg) }
    }

    /// `y[r, i] = x[r, i] + b[i]` for `rows` dense rows of `cols` (y may be x's buffer).
    pub fn add_bias(
        &self,
        x: &impl DevicePtr<f32>,
        b: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "add_bias";
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        need_len(OP, "x", dlen(x), rows * cols)?;
        need_len(OP, "b", dlen(b), cols)?;
        need_len(OP, "y", dlen(y), rows * cols)?;
        let f = self.func(Op::Elementwise, "add_bias_f32")?;
        let cfg = self.cfg_rows(OP, elem_x(cols), rows, BLOCK)?;
        let s = self.stream();
        let (xp, _g1) = x.device_ptr(s);
        let (bp, _g2) = b.device_ptr(s);
        let (yp, _g3) = y.device_ptr_mut(s);
        let c32 = to_i32(OP, "cols", cols)?;
        let r64 = rows as i64;
        let mut bl = self.args(&f);
        bl.arg(&xp).arg(&bp).arg(&yp).arg(&c32).arg(&r64);
        // SAFETY: extents checked above.
        unsafe { self.launch(OP, bl, cfg) }
    }

    /// `dst[r, :] = src[idx[r], :]` for rows of `cols`; `src_rows` bounds every index (checked on
    /// the host, where the indices come from).
    pub fn gather_rows(
        &self,
        src: &impl DevicePtr<f32>,
        src_rows: usize,
        cols: usize,
        idx: &[usize],
        dst: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "gather_rows";
        if idx.is_empty() || cols == 0 {
            return Ok(());
        }
        if let Some(bad) = idx.iter().find(|&&r| r >= src_rows) {
            return Err(shape_err(OP, format!("row {bad} of {src_rows}")));
        }
        need_len(OP, "src", dlen(src), src_rows * cols)?;
        need_len(OP, "dst", dlen(dst), idx.len() * cols)?;
        let ids: Vec<i32> = idx
            .iter()
            .map(|&r| to_i32(OP, "row", r))
            .collect::<Result<_, _>>()?;
        let dids = self.upload_async(&ids)?;
        let f = self.func(Op::Elementwise, "gather_rows_f32")?;
        let cfg = self.cfg_rows(OP, elem_x(cols), idx.len(), BLOCK)?;
        let s = self.stream();
        let (sp, _g1) = src.device_ptr(s);
        let (ip, _g2) = dids.device_ptr(s);
        let (dp, _g3) = dst.device_ptr_mut(s);
        let c32 = to_i32(OP, "cols", cols)?;
        let r64 = idx.len() as i64;
        let mut bl = self.args(&f);
        bl.arg(&sp).arg(&ip).arg(&dp).arg(&c32).arg(&r64);
        // SAFETY: every index checked against src_rows above.
        unsafe { self.launch(OP, bl, cfg) }
    }

    /// Rows of `src` (`cols` values each) to several destinations in one launch: the first
    /// `dsts[0].1` rows to the start of `dsts[0].0`, the next ones to `dsts[1].0`, and so on (a
    /// batched step's rows appended to each sequence's cache). A `u16` destination takes the
    /// rows rounded to bf16 (round to nearest even, as [`Gpu::to_bf16`]).
    pub fn scatter_rows<C: crate::mla::CacheElem>(
        &self,
        src: &impl DevicePtr<f32>,
        cols: usize,
        dsts: &mut [(impl DevicePtrMut<C>, usize)],
    ) -> Result<(), KernelError> {
        const OP: &str = "scatter_rows";
        let rows: usize = dsts.iter().map(|d| d.1).sum();
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        need_len(OP, "src", dlen(src), rows * cols)?;
        let s = self.stream();
        let mut addrs = Vec::with_capacity(rows);
        let mut guards = Vec::with_capacity(dsts.len());
        for (d, n) in dsts.iter_mut() {
            if *n == 0 {
                continue;
            }
            need_len(OP, "dst", dlen(d), *n * cols)?;
            let (p, g) = d.device_ptr_mut(s);
            guards.push(g);
            let row = (cols * std::mem::size_of::<C>()) as u64;
            addrs.extend((0..*n as u64).map(|r| p + r * row));
        }
        let d_addrs = self.upload_async(&addrs)?;
        let f = self.func(
            Op::Elementwise,
            if C::BF16 {
                "scatter_rows_bf16"
            } else {
                "scatter_rows_f32"
            },
        )?;
        let cfg = self.cfg_rows(OP, elem_x(cols), rows, BLOCK)?;
        let (sp, _g1) = src.device_ptr(s);
        let (ap, _g2) = d_addrs.device_ptr(s);
        let c32 = to_i32(OP, "cols", cols)?;
        let r64 = rows as i64;
        let mut bl = self.args(&f);
        bl.arg(&sp).arg(&ap).arg(&c32).arg(&r64);
        // SAFETY: src holds `rows` rows; every address starts a destination row of `cols`
        // elements inside its checked view.
        let r = unsafe { self.launch(OP, bl, cfg) };
        drop(guards);
        r
    }

    /// f32 -> bf16 bit patterns (round to nearest even), for bf16 cuBLAS operands.
    pub fn to_bf16(
        &self,
        src: &impl DevicePtr<f32>,
        dst: &mut impl DevicePtrMut<u16>,
        n: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "f32_to_bf16";
        need_len(OP, "src", dlen(src), n)?;
        need_len(OP, "dst", dlen(dst), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(Op::Elementwise, "f32_to_bf16")?;
        let cfg = self.cfg(OP, elem_grid(n, 1), BLOCK)?;
        let s = self.stream();
        let (sp, _gs) = src.device_ptr(s);
        let (dp, _gd) = dst.device_ptr_mut(s);
        let n64 = n as i64;
        let mut bl = self.args(&f);
        bl.arg(&sp).arg(&dp).arg(&n64);
        // SAFETY: both hold >= n elements.
        unsafe { self.launch(OP, bl, cfg) }
    }

    /// bf16 bit patterns -> f32 (exact), the first `n` elements.
    pub fn from_bf16(
        &self,
        src: &impl DevicePtr<u16>,
        dst: &mut impl DevicePtrMut<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "bf16_to_f32";
        need_len(OP, "src", dlen(src), n)?;
        need_len(OP, "dst", dlen(dst), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(Op::Elementwise, "bf16_to_f32")?;
        let cfg = self.cfg(OP, elem_grid(n, 1), BLOCK)?;
        let s = self.stream();
        let (sp, _gs) = src.device_ptr(s);
        let (dp, _gd) = dst.device_ptr_mut(s);
        let n64 = n as i64;
        let mut bl = self.args(&f);
        bl.arg(&sp).arg(&dp).arg(&n64);
        // SAFETY: both hold >= n elements.
        unsafe { self.launch(OP, bl, cfg) }
    }

    /// Greedy sampling: `out[r]` = index of the largest of row r (ties: lower index; NaN never
    /// wins). `x` holds `rows` rows of `n` logits, `stride` apart.
    pub fn argmax(
        &self,
        x: &impl DevicePtr<f32>,
        rows: usize,
        n: usize,
        stride: usize,
        out: &mut impl DevicePtrMut<i32>,
    ) -> Result<(), KernelError> {
        self.argmax_split(x, rows, n, stride, out, Split::Auto)
    }

    /// [`Gpu::argmax`] with the launch plan chosen by `split`: `argmax_f32` (one block per row)
    /// or `argmax_part_f32` (grid (chunks, rows)) + `argmax_final_f32` (one block per row), the
    /// plan and threshold of greedy sampling ([`crate::sample::GREEDY_SPLIT_MIN`]). Same ids.
    pub fn argmax_split(
        &self,
        x: &impl DevicePtr<f32>,
        rows: usize,
        n: usize,
        stride: usize,
        out: &mut impl DevicePtrMut<i32>,
        split: Split,
    ) -> Result<(), KernelError> {
        const OP: &str = "argmax";
        if rows == 0 || n == 0 {
            return Err(shape_err(OP, "empty logits"));
        }
        need_len(OP, "x", dlen(x), span(rows, stride, n))?;
        need_len(OP, "out", dlen(out), rows)?;
        let n32 = to_i32(OP, "n", n)?;
        let st = stride as i64;
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (op, _go) = out.device_ptr_mut(s);
        let Some((chunk, chunks)) = greedy_plan(split, n, rows, self.info().sm_count) else {
            let f = self.func(Op::Argmax, "argmax_f32")?;
            let cfg = self.cfg(OP, (rows as u64, 1, 1), 1024)?;
            let mut bl = self.args(&f);
            bl.arg(&xp).arg(&st).arg(&n32).arg(&op);
            // SAFETY: extents checked above.
            return unsafe { self.launch(OP, bl, cfg) };
        };
        let words = rows
            .checked_mul(chunks * 4)
            .ok_or_else(|| shape_err(OP, format!("{rows} rows x {chunks} chunks")))?;
        // Pool scratch, returned once both launches are queued (reused only by later work).
        let part = self.alloc::<i32>(words)?;
        let partp = part.ptr();
        let (chunk32, chunks32) = (to_i32(OP, "chunk", chunk)?, to_i32(OP, "chunks", chunks)?);
        let rows64 = rows as i64;
        let f = self.func(Op::Argmax, "argmax_part_f32")?;
        let cfg = self.cfg_rows(OP, chunks as u64, rows, 256)?;
        let mut bl = self.args(&f);
        bl.arg(&xp)
            .arg(&st)
            .arg(&n32)
            .arg(&chunk32)
            .arg(&rows64)
            .arg(&partp);
        // SAFETY: extents checked above; `part` holds rows x chunks records of 4 ints, and
        // block (c, r) writes record (r, c) only.
        unsafe { self.launch(OP, bl, cfg) }?;
        let f = self.func(Op::Argmax, "argmax_final_f32")?;
        let cfg = self.cfg(OP, (rows as u64, 1, 1), 256)?;
        let mut bl = self.args(&f);
        bl.arg(&partp).arg(&chunks32).arg(&rows64).arg(&op);
        // SAFETY: reads the records written above, writes out[r] for r < rows.
        unsafe { self.launch(OP, bl, cfg) }
    }
}
