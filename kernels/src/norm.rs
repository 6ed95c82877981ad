//! RMSNorm (with an optional fused residual add) and LayerNorm, one block per row.

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::launch::{opt_ptr, shape_err, span};
use crate::ops::Op;

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

fn block_for(n: usize) -> u32 {
    if n >= 2048 {
        512
    } else if n >= 256 {
        256
    } else {
        64
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
        self.rms_norm_impl(x, None::<&mut cudarc::driver::CudaSlice<f32>>, w, y, l, eps)
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
        self.rms_norm_impl(x, Some(res), w, y, l, eps)
    }

    fn rms_norm_impl<R: DevicePtrMut<f32>>(
        &self,
        x: &impl DevicePtr<f32>,
        res: Option<&mut R>,
        w: Option<&CudaView<'_, f32>>,
        y: &mut impl DevicePtrMut<f32>,
        l: Rows,
        eps: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "rmsnorm";
        check_rows(OP, dlen(x), dlen(y), l)?;
        let f = self.func(Op::RmsNorm, "rmsnorm_f32")?;
        let cfg = self.cfg(OP, (l.rows as u64, 1, 1), block_for(l.n))?;
        let s = self.stream();
        let wp = opt_ptr(OP, "w", w, l.n, s)?;
        let (xp, _gx) = x.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let (rp, _gr) = match res {
            Some(r) => {
                need_len(OP, "res", dlen(r), span(l.rows, l.y_stride, l.n))?;
                let (p, g) = r.device_ptr_mut(s);
                (p, Some(g))
            }
            None => (0u64, None),
        };
        let (xs, ys) = (l.x_stride as i64, l.y_stride as i64);
        let n = to_i32(OP, "n", l.n)?;
        let mut b = self.args(&f);
        // With a residual, the kernel reads res (stride ys), writes the sum back into res (xo).
        b.arg(&xp).arg(&xs).arg(&rp).arg(&ys).arg(&rp).arg(&ys);
        b.arg(&wp).arg(&yp).arg(&ys).arg(&n).arg(&eps);
        // SAFETY: extents of x, res, y and w checked above.
        unsafe { self.launch(OP, b, cfg) }
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
