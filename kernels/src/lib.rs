//! CUDA kernels for gguftool: CUDA C sources (one op per `.cu` file under `kernels/cuda/`),
//! compiled by NVRTC at first use for the device's own architecture and cached per device and op,
//! with Rust launch wrappers that check every argument against the shape before launching.
//!
//! Nothing here needs the CUDA toolkit at build time: cudarc loads `libcuda` / `libnvrtc` /
//! `libcublas` at run time. [`Gpu::get`] fails with [`KernelError::NoDriver`] /
//! [`KernelError::NoDevice`] on machines without a GPU; [`nvrtc::compile`] works on any machine
//! that has `libnvrtc` (the compile-check test uses it for sm_90 and sm_120).

pub mod act;
pub mod attention;
pub mod comm;
pub mod dequant;
pub mod device;
pub mod error;
pub mod gemm;
pub mod gemv;
pub mod gemvq;
pub mod indexer;
mod launch;
pub mod mla;
pub mod mmq;
pub mod moe;
pub mod norm;
pub mod nvrtc;
pub mod ops;
pub mod pool;
mod quant;
pub mod repack;
pub mod rope;
pub mod sample;
pub mod verify;

pub use act::Rows3;
pub use attention::{AttnShape, KeyLists};
pub use comm::{can_access_peer, OneShotHandles, OneShotRank};
pub use device::{
    device_count, driver_available, host_wait_ns, DeviceInfo, Gpu, KernelResources, KindTime,
    Profile,
};
pub use error::KernelError;
pub use gemv::{Channels, MatShape};
pub use gemvq::{
    gemvq_supported, Q8Act, QChannels, QMode, GEMVQ1_ROWS, GEMVQ_MAX_STACK, Q8_REL_ERR,
};
pub use indexer::{force_indexer_lanes, IndexerShape};
pub use mla::{
    force_mla_decode, force_mla_tc, mla_tc_plan, CacheElem, MlaParams, MlaRow, MlaSeq, MlaShape,
    MlaTcPlan,
};
pub use mmq::{
    mmq_kernel_name, mmq_ks_allowed, mmq_plan, mmq_plan_ks, mmq_sliceable, mmq_stage_row_bytes,
    mmq_supported, MmqParams, MmqPlan, MmqX, MMQ_STEP, MMQ_WARPS,
};
pub use moe::{
    moe_mmq_tile, ExpertGroups, Gating, RouterConfig, TileSet, MOE_TILE, MOE_TILE_WIDTHS,
};
pub use norm::{CacheRows, NormRope, QaNorm, RowRope, Rows};
pub use ops::{Op, QType};
pub use pool::{DevBuf, DevViewMut, PoolStats};
pub use rope::{rope_inv_freq, RopeLayout, RopeStyle};
pub use sample::{sampled_id, SampleParams, SAMPLE_NONFINITE};
pub use verify::{compare_tensor, GpuDiff};

/// Re-exported so callers can name buffer types without depending on cudarc themselves.
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
