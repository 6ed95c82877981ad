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

/// Queries at positions `pos0 .. pos0 + tokens` need that many cached keys.
pub(crate) fn check_query_span(
    op: &'static str,
    pos0: usize,
    tokens: usize,
    kv_len: usize,
) -> Result<(), KernelError> {
    if pos0 + tokens > kv_len {
        return Err(shape_err(
            op,
            format!(
                "queries at {pos0}..{} but only {kv_len} cached keys",
                pos0 + tokens
            ),
        ));
    }
    Ok(())
}

pub(crate) fn shape_err(op: &'static str, msg: impl Into<String>) -> KernelError {
    KernelError::BadShape {
        op,
        msg: msg.into(),
    }
}
