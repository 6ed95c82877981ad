//! Small helpers shared by the op wrappers: optional buffers as kernel pointers, extent checks.

use cudarc::driver::{CudaStream, CudaView, DevicePtr};

use crate::device::need_len;
use crate::error::KernelError;

/// Device address of an optional input (0 = absent, which the kernels test for), after checking
/// that it holds at least `need` elements.
pub(crate) fn opt_ptr<T>(
    op: &'static str,
    arg: &'static str,
    v: Option<&CudaView<'_, T>>,
    need: usize,
    stream: &CudaStream,
) -> Result<u64, KernelError> {
    match v {
        None => Ok(0),
        Some(v) => {
            need_len(op, arg, v.len(), need)?;
            Ok(v.device_ptr(stream).0)
        }
    }
}

/// Elements spanned by `rows` rows of `n` values `stride` apart (0 for no rows).
pub(crate) fn span(rows: usize, stride: usize, n: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * stride + n
    }
}

pub(crate) fn shape_err(op: &'static str, msg: impl Into<String>) -> KernelError {
    KernelError::BadShape {
        op,
        msg: msg.into(),
    }
}
