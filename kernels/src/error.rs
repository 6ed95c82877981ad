//! The error type of the kernels crate: every failure a caller may want to tell apart.

use gguf::GgmlType;

/// Everything that can go wrong between "is there a GPU" and "the kernel finished".
///
/// Launch wrappers validate their arguments before touching the device, so a
/// [`KernelError::BadLength`] / [`KernelError::BadShape`] never leaves a half-launched op behind.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// `libcuda` could not be loaded (no NVIDIA driver on this machine).
    #[error("no CUDA driver library (libcuda) could be loaded")]
    NoDriver,
    /// `libnvrtc` could not be loaded (CUDA runtime compiler missing; see docs/GPU.md).
    #[error("no NVRTC library (libnvrtc) could be loaded; put CUDA 13's lib directory on LD_LIBRARY_PATH")]
    NoNvrtc,
    /// The driver loaded but reports no device with this ordinal.
    #[error("no CUDA device with ordinal {ordinal} ({count} device(s) present)")]
    NoDevice { ordinal: usize, count: usize },
    /// A CUDA driver call failed.
    #[error("CUDA driver call `{what}` failed: {source}")]
    Driver {
        what: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// An NVRTC call other than the compilation itself failed.
    #[error("NVRTC call `{what}` failed: {source}")]
    Nvrtc {
        what: &'static str,
        #[source]
        source: cudarc::nvrtc::result::NvrtcError,
    },
    /// NVRTC rejected a kernel source: the compiler log is included.
    #[error("NVRTC could not compile `{op}` for {arch}:\n{log}")]
    Compile {
        op: &'static str,
        arch: String,
        log: String,
    },
    /// The device's compute capability is one this NVRTC cannot target.
    #[error("compute capability {major}.{minor} ({arch}) is not supported by NVRTC {nvrtc}")]
    UnsupportedArch {
        major: i32,
        minor: i32,
        arch: String,
        nvrtc: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS call `{what}` failed: {source}")]
    Cublas {
        what: &'static str,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    /// A buffer passed to an op is shorter (or longer) than the shape requires.
    #[error("{op}: argument `{arg}` has {got} elements, the shape needs {need}")]
    BadLength {
        op: &'static str,
        arg: &'static str,
        need: usize,
        got: usize,
    },
    /// The shape itself is invalid for the op (zero, not a block multiple, too large, ...).
    #[error("{op}: {msg}")]
    BadShape { op: &'static str, msg: String },
    /// A tensor type the op has no kernel for.
    #[error("{op}: tensor type {ty} is not supported on the GPU")]
    UnsupportedType { op: &'static str, ty: GgmlType },
    /// The launch configuration exceeds what the device allows.
    #[error("{op}: launch grid {grid:?} exceeds the device limit {limit:?}")]
    GridTooLarge {
        op: &'static str,
        grid: (u64, u64, u64),
        limit: (u32, u32, u32),
    },
    /// A kernel (or an earlier queued one) faulted; reported at the next synchronization.
    #[error("kernel `{op}` failed on the device: {source}")]
    Launch {
        op: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },
}

impl KernelError {
    pub(crate) fn driver(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        move |source| KernelError::Driver { what, source }
    }
}
