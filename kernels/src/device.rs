//! One CUDA device: context, stream, lazily compiled modules (per op, in memory), uploaded
//! quant tables, and the launch checks every op wrapper goes through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, DeviceSlice,
    LaunchArgs, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::error::KernelError;
use crate::nvrtc;
use crate::ops::Op;
use crate::pool::{Bulk, DevBuf, Pool, PoolStats, StagedError, Staging, BULK_SLOT, STAGING_SLOT};
use crate::quant::DeviceTables;

/// Whether the CUDA driver library can be loaded (cudarc would panic on first use otherwise).
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen candidate library names.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices, 0 when there is no driver or no device.
pub fn device_count() -> usize {
    if !driver_available() {
        return 0;
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

/// What we know about the device, read once at open.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// The NVRTC target for this device, e.g. `sm_90`.
    pub arch: String,
    pub sm_count: u32,
    pub max_grid: (u32, u32, u32),
    pub l2_bytes: u64,
    pub total_mem: u64,
}

/// Resource usage of one loaded kernel (for spill checks and reports).
#[derive(Debug, Clone)]
pub struct KernelResources {
    pub kernel: String,
    pub registers: i32,
    pub local_bytes: i32,
}

/// A loaded kernel with its parameter sizes (from the PTX of the same compilation), so every
/// launch is checked against the kernel's real signature before it runs.
#[derive(Clone)]
pub(crate) struct Kernel {
    pub f: CudaFunction,
    pub name: Arc<str>,
    pub params: Arc<Vec<usize>>,
    /// The dynamic shared memory limit last set on the function (0: the default), so a launch
    /// wrapper's opt-in is one driver call per kernel, not one per launch.
    pub smem_limit: Arc<std::sync::atomic::AtomicUsize>,
    /// Resident blocks per SM at 128 threads and no dynamic shared memory (0: not asked yet).
    pub blocks_per_sm_128: Arc<std::sync::atomic::AtomicU32>,
    /// The entry waits on the previous kernel (`griddepcontrol.wait` in its PTX, prelude.cuh's
    /// `pdl_wait`), so it may be launched as a programmatic dependent of it.
    pub pdl: bool,
}

/// Kernel arguments being collected, with their sizes for the signature check.
pub(crate) struct Args<'a> {
    inner: LaunchArgs<'a>,
    sizes: Vec<usize>,
    /// The same arguments as `cuLaunchKernelEx` takes them (pointers to the values, which the
    /// `'a` borrow keeps alive until the launch).
    params: Vec<*mut std::ffi::c_void>,
    kernel: &'a Kernel,
}

impl<'a> Args<'a> {
    pub(crate) fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.inner.arg(v);
        self.sizes.push(std::mem::size_of::<T>());
        self.params.push(v as *const T as *mut std::ffi::c_void);
        self
    }
}

/// A default-on switch: off only when the variable is `0`.
fn env_on(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| v != "0")
}

/// Entries of a PTX module whose body holds `griddepcontrol.wait` (prelude.cuh's `pdl_wait`).
pub(crate) fn ptx_pdl_entries(ptx: &str) -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    for part in ptx.split(".entry ").skip(1) {
        let Some(open) = part.find('(') else { continue };
        // The body runs to the next symbol (device functions are inlined: DEV is forceinline).
        let body = part.split(".visible").next().unwrap_or(part);
        if body.contains("griddepcontrol.wait") {
            out.insert(part[..open].trim().to_string());
        }
    }
    out
}

/// Parameter byte sizes of every `.entry` in a PTX module.
pub(crate) fn ptx_signatures(ptx: &str) -> HashMap<String, Vec<usize>> {
    let mut out = HashMap::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        let after = &rest[at + 7..];
        let Some(open) = after.find('(') else { break };
        let name = after[..open].trim().to_string();
        let Some(close) = after.find(')') else { break };
        let sizes = after[open + 1..close]
            .split(',')
            .filter(|p| p.contains(".param"))
            .map(|p| {
                // `.param .u64 name`, `.param .f32 name` or `.param .align 8 .b8 name[64]`.
                let ty = p
                    .split_whitespace()
                    .skip_while(|t| *t != ".param")
                    .nth(1)
                    .unwrap_or("");
                if ty == ".align" {
                    match (p.find('['), p.find(']')) {
                        (Some(l), Some(r)) => p[l + 1..r].trim().parse().unwrap_or(0),
                        _ => 0,
                    }
                } else {
                    let bits: usize = ty
                        .trim_start_matches(|c: char| !c.is_ascii_digit())
                        .parse()
                        .unwrap_or(0);
                    bits / 8
                }
            })
            .collect();
        out.insert(name, sizes);
        rest = &after[close..];
    }
    out
}

/// A CUDA device with its own stream; every op of this crate runs on that one stream, in order.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    modules: Mutex<HashMap<Op, Arc<CudaModule>>>,
    funcs: Mutex<HashMap<String, Kernel>>,
    signatures: Mutex<HashMap<String, Arc<Vec<usize>>>>,
    /// Entries that wait on their predecessor (see [`ptx_pdl_entries`]).
    pdl_entries: Mutex<std::collections::HashSet<String>>,
    /// Launch such entries as programmatic dependents (`GGUFTOOL_PDL=0` turns it off).
    pdl: AtomicBool,
    /// Multi-column integer GEMVs with several rows per lane group (`GGUFTOOL_GEMVQ_ROWS=1`
    /// turns it off).
    gemvq_multirow: AtomicBool,
    /// The f32-activation GEMV splits K over a block's warps for matrices of few rows
    /// (`GGUFTOOL_GEMV_KSPLIT=0` turns it off).
    gemv_ksplit: AtomicBool,
    /// A one-row RMSNorm spreads its outputs over several blocks (`GGUFTOOL_RMS_PARTS=0` turns
    /// it off).
    rms_parts: AtomicBool,
    /// Few-row F32 GEMVs read their rows coalesced (`GGUFTOOL_GEMV_COALESCED=0` turns it off).
    gemv_coalesced: AtomicBool,
    resources: Mutex<Vec<KernelResources>>,
    tables: OnceLock<DeviceTables>,
    blas: OnceLock<cudarc::cublas::CudaBlas>,
    sync_each: AtomicBool,
    /// Warps per row group of one-column integer GEMVs: 0 = chosen per launch, else 1, 2 or 4.
    gemvq_ksplit: std::sync::atomic::AtomicUsize,
    /// Most rows per lane group of one-column integer GEMVs (1, 2 or 4).
    gemvq1_rows: std::sync::atomic::AtomicUsize,
    /// Several rows per group only for launches of at most this many one-row waves (0: any).
    gemvq1_waves: std::sync::atomic::AtomicUsize,
    /// mmq's forced k-split (0: the plan's choice).
    mmq_ksplit: std::sync::atomic::AtomicUsize,
    /// Forced k-slices of single-channel mmq launches (0: the plan's choice).
    mmq_slices: std::sync::atomic::AtomicUsize,
    /// The opt-in shared memory per block, asked of the driver once (every mmq / MLA launch
    /// and the runtime's per-product mmq choice read it).
    max_smem: OnceLock<usize>,
    pool: Arc<Pool>,
    staging: Mutex<Staging>,
    /// Pinned slots of bulk uploads (weights), apart from `staging`'s step-input ring.
    bulk: Mutex<Bulk>,
    profiling: AtomicBool,
    profile: Mutex<
        Vec<(
            &'static str,
            cudarc::driver::CudaEvent,
            cudarc::driver::CudaEvent,
        )>,
    >,
}

/// Device time of one kind of kernel (the op name its wrapper launches under).
#[derive(Debug, Clone, PartialEq)]
pub struct KindTime {
    pub kind: String,
    /// Microseconds (total, or per unit after [`Profile::per`]).
    pub us: f64,
    pub launches: f64,
}

/// Device time by kernel kind over a profiled region, largest first.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Profile {
    pub kinds: Vec<KindTime>,
}

impl Profile {
    /// Divide every figure by `n` (e.g. tokens), for per-token costs.
    pub fn per(mut self, n: usize) -> Profile {
        let n = n.max(1) as f64;
        for k in &mut self.kinds {
            k.us /= n;
            k.launches /= n;
        }
        self
    }
}

static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();

/// Nanoseconds host threads have spent blocked on a device (stream synchronizations and
/// downloads), summed over every thread and device of the process.
static WAIT_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn note_wait(t0: std::time::Instant) {
    let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    WAIT_NS.fetch_add(ns, Ordering::Relaxed);
}

/// Total time host threads have waited for devices so far (see [`Gpu::synchronize`] and
/// [`Gpu::download`]): over a timed region, wall time minus this is the host's own work
/// (building and launching kernels), which shows whether a decode step is bound by the host
/// or by the device.
pub fn host_wait_ns() -> u64 {
    WAIT_NS.load(Ordering::Relaxed)
}

impl Gpu {
    /// The process-wide handle for device `ordinal` (created on first call), so compiled modules
    /// are shared by every user of that device.
    pub fn get(ordinal: usize) -> Result<Arc<Gpu>, KernelError> {
        let map = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(g) = map.get(&ordinal) {
            return Ok(g.clone());
        }
        let g = Arc::new(Gpu::open(ordinal)?);
        map.insert(ordinal, g.clone());
        Ok(g)
    }

    /// A handle of its own for device `ordinal`: a separate stream (and module cache) on the
    /// same context, for a tensor-parallel rank sharing the GPU with other ranks.
    pub fn open_private(ordinal: usize) -> Result<Arc<Gpu>, KernelError> {
        Gpu::open(ordinal).map(Arc::new)
    }

    fn open(ordinal: usize) -> Result<Gpu, KernelError> {
        if !driver_available() {
            return Err(KernelError::NoDriver);
        }
        let count = CudaContext::device_count().map_err(KernelError::driver("cuDeviceGetCount"))?;
        let count = count.max(0) as usize;
        if ordinal >= count {
            return Err(KernelError::NoDevice { ordinal, count });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(KernelError::driver("cuDevicePrimaryCtxRetain"))?;
        // One stream per device and strictly ordered work: cudarc's per-slice event tracking
        // would only add an event record/wait to every launch.
        // SAFETY: no CudaSlice exists yet in this context, and all use is on `stream`.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(KernelError::driver("cuStreamCreate"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(KernelError::driver("cuDeviceGetAttribute"))?;
        let attr = |a: sys::CUdevice_attribute| -> Result<i32, KernelError> {
            ctx.attribute(a)
                .map_err(KernelError::driver("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute as A;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(KernelError::driver("cuDeviceGetName"))?,
            compute_capability: (major, minor),
            arch: nvrtc::arch_name(major, minor),
            sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(0) as u32,
            max_grid: (
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?.max(0) as u32,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?.max(0) as u32,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?.max(0) as u32,
            ),
            l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as u64,
            total_mem: ctx
                .total_mem()
                .map_err(KernelError::driver("cuDeviceTotalMem"))? as u64,
        };
        let sync_each = std::env::var("GGUFTOOL_CUDA_SYNC").is_ok_and(|v| v == "1");
        let gemvq_ksplit = std::env::var("GGUFTOOL_GEMVQ_KSPLIT")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|k| matches!(k, 1 | 2 | 4))
            .unwrap_or(0);
        let gemvq1_rows = std::env::var("GGUFTOOL_GEMVQ1_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|r| matches!(r, 1 | 2 | 4))
            .unwrap_or(crate::gemvq::GEMVQ1_ROWS);
        let gemvq1_waves = std::env::var("GGUFTOOL_GEMVQ1_WAVES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(crate::gemvq::GEMVQ1_ROWS_MAX_WAVES);
        // K-slices of dense mmq launches: the plan's choice (0) unless `GGUFTOOL_MMQ_SLICES=N`
        // forces N in 1..=64 (1: none, the launches before 2026-12-07; for A/B runs).
        let mmq_slices = std::env::var("GGUFTOOL_MMQ_SLICES")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n <= 64)
            .unwrap_or(0);
        // Cached free memory: enough for every activation of a long prefill chunk to recur
        // without cuMemAlloc, bounded so idle caches never crowd out weights and KV caches.
        let pool_cap = (info.total_mem as usize / 16).clamp(256 << 20, 8 << 30);
        let pool = Pool::new(stream.clone(), pool_cap);
        let staging = Mutex::new(Staging::new(ctx.clone()));
        let bulk = Mutex::new(Bulk::new(ctx.clone()));
        Ok(Gpu {
            ctx,
            stream,
            info,
            modules: Mutex::new(HashMap::new()),
            funcs: Mutex::new(HashMap::new()),
            signatures: Mutex::new(HashMap::new()),
            pdl_entries: Mutex::new(std::collections::HashSet::new()),
            // Programmatic dependent launch needs compute capability 9.0.
            pdl: AtomicBool::new(major >= 9 && env_on("GGUFTOOL_PDL")),
            gemvq_multirow: AtomicBool::new(
                std::env::var("GGUFTOOL_GEMVQ_ROWS").map_or(true, |v| v != "1"),
            ),
            gemv_ksplit: AtomicBool::new(env_on("GGUFTOOL_GEMV_KSPLIT")),
            rms_parts: AtomicBool::new(env_on("GGUFTOOL_RMS_PARTS")),
            gemv_coalesced: AtomicBool::new(env_on("GGUFTOOL_GEMV_COALESCED")),
            resources: Mutex::new(Vec::new()),
            tables: OnceLock::new(),
            blas: OnceLock::new(),
            sync_each: AtomicBool::new(sync_each),
            gemvq_ksplit: std::sync::atomic::AtomicUsize::new(gemvq_ksplit),
            gemvq1_rows: std::sync::atomic::AtomicUsize::new(gemvq1_rows),
            gemvq1_waves: std::sync::atomic::AtomicUsize::new(gemvq1_waves),
            mmq_ksplit: std::sync::atomic::AtomicUsize::new(0),
            mmq_slices: std::sync::atomic::AtomicUsize::new(mmq_slices),
            max_smem: OnceLock::new(),
            pool,
            staging,
            bulk,
            profiling: AtomicBool::new(false),
            profile: Mutex::new(Vec::new()),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Synchronize after every launch (also with `GGUFTOOL_CUDA_SYNC=1`): a fault is then
    /// reported by the op that caused it instead of a later one.
    pub fn set_sync_each(&self, on: bool) {
        self.sync_each.store(on, Ordering::Relaxed);
    }

    /// Force the number of warps that share a row group in one-column integer GEMVs (1, 2 or 4;
    /// `None`: chosen per launch, the default; also `GGUFTOOL_GEMVQ_KSPLIT`). For tests and
    /// measurements: every choice computes the same sums in another order.
    pub fn force_gemvq_ksplit(&self, ks: Option<usize>) -> Result<(), KernelError> {
        let v = match ks {
            None => 0,
            Some(k @ (1 | 2 | 4)) => k,
            Some(k) => {
                return Err(KernelError::BadShape {
                    op: "gemvq",
                    msg: format!("k-split {k} (1, 2 or 4)"),
                })
            }
        };
        self.gemvq_ksplit.store(v, Ordering::Relaxed);
        Ok(())
    }

    /// The most rows a lane group of a one-column integer GEMV computes (1, 2 or 4; default
    /// [`crate::GEMVQ1_ROWS`], also `GGUFTOOL_GEMVQ1_ROWS`): the activation loads of a task then serve
    /// that many rows. GLU and combine launches take at most 2, a stacked launch the most that
    /// divides its segment boundaries. Every choice sums the same products in the same order
    /// per output (bitwise equal).
    pub fn set_gemvq1_rows(&self, rows: usize) -> Result<(), KernelError> {
        if !matches!(rows, 1 | 2 | 4) {
            return Err(KernelError::BadShape {
                op: "gemvq",
                msg: format!("{rows} rows per lane group (1, 2 or 4)"),
            });
        }
        self.gemvq1_rows.store(rows, Ordering::Relaxed);
        Ok(())
    }
    pub(crate) fn gemvq1_rows(&self) -> usize {
        self.gemvq1_rows.load(Ordering::Relaxed)
    }
    /// The most waves of blocks a one-column launch may have and still take several rows per
    /// group (default [`crate::gemvq::GEMVQ1_ROWS_MAX_WAVES`], also
    /// `GGUFTOOL_GEMVQ1_WAVES`; 0: no limit).
    pub fn set_gemvq1_waves(&self, waves: usize) {
        self.gemvq1_waves.store(waves, Ordering::Relaxed);
    }
    pub(crate) fn gemvq1_waves(&self) -> usize {
        self.gemvq1_waves.load(Ordering::Relaxed)
    }

    /// Force the number of warps that split K for one 16-row tile in [`Gpu::mmq`] (1, 2, 4 or
    /// 8; `None`: the plan's choice, the default). For tests and measurements: every choice
    /// computes the same block sums, added in another order; a launch whose shape does not
    /// allow the forced split fails (`kernels::mmq::mmq_ks_allowed`).
    pub fn force_mmq_ksplit(&self, ks: Option<usize>) -> Result<(), KernelError> {
        let v = match ks {
            None => 0,
            Some(k @ (1 | 2 | 4 | 8)) => k,
            Some(k) => {
                return Err(KernelError::BadShape {
                    op: "mmq",
                    msg: format!("k-split {k} (1, 2, 4 or 8)"),
                })
            }
        };
        self.mmq_ksplit.store(v, Ordering::Relaxed);
        Ok(())
    }
    pub(crate) fn mmq_ksplit(&self) -> Option<usize> {
        Some(self.mmq_ksplit.load(Ordering::Relaxed)).filter(|&k| k > 0)
    }

    /// Force the k-slices of single-channel [`Gpu::mmq`] launches (1..=64: 1 never slices; a
    /// shape with fewer windows takes one slice per window; `None`: the plan's choice,
    /// [`crate::mmq_plan`], the default unless `GGUFTOOL_MMQ_SLICES` says otherwise). For tests
    /// and measurements: the slices' sums are added in slice order, so a choice changes only
    /// the order of the f32 additions.
    pub fn force_mmq_slices(&self, kz: Option<usize>) -> Result<(), KernelError> {
        let v = match kz {
            None => 0,
            Some(n @ 1..=64) => n,
            Some(n) => {
                return Err(KernelError::BadShape {
                    op: "mmq",
                    msg: format!("k-slices {n} (1 to 64)"),
                })
            }
        };
        self.mmq_slices.store(v, Ordering::Relaxed);
        Ok(())
    }
    /// The forced k-slices ([`Gpu::force_mmq_slices`]; `None`: the plan's choice).
    pub fn mmq_slices(&self) -> Option<usize> {
        Some(self.mmq_slices.load(Ordering::Relaxed)).filter(|&k| k > 0)
    }

    /// Launch kernels that wait on their predecessor as programmatic dependents (default on
    /// compute capability >= 9.0 unless `GGUFTOOL_PDL=0`); off, every launch waits for the
    /// previous kernel to finish before it starts. For A/B runs and tests.
    pub fn set_pdl(&self, on: bool) {
        let (major, _) = self.info.compute_capability;
        self.pdl.store(on && major >= 9, Ordering::Relaxed);
    }
    pub fn pdl(&self) -> bool {
        self.pdl.load(Ordering::Relaxed)
    }

    /// Multi-column integer GEMVs with several rows per lane group (default) or one (`false`,
    /// also `GGUFTOOL_GEMVQ_ROWS=1`): same products, summed in the same order per output.
    pub fn set_gemvq_multirow(&self, on: bool) {
        self.gemvq_multirow.store(on, Ordering::Relaxed);
    }
    pub(crate) fn gemvq_multirow(&self) -> bool {
        self.gemvq_multirow.load(Ordering::Relaxed)
    }

    /// The f32-activation GEMV's k-split over a block's warps for matrices whose one-row
    /// blocks would not give every SM one (`gemvs_` kernels; the MoE router): on (the default
    /// since the H200 A/B of 2026-12-07: tg128 890 -> 911 tok/s; `GGUFTOOL_GEMV_KSPLIT=0`
    /// starts a device with it off) or off.
    pub fn set_gemv_ksplit(&self, on: bool) {
        self.gemv_ksplit.store(on, Ordering::Relaxed);
    }
    pub(crate) fn gemv_ksplit(&self) -> bool {
        self.gemv_ksplit.load(Ordering::Relaxed)
    }

    /// One-row RMSNorms (a decode step's) in parts: one block per register slot of the row,
    /// each forming the whole row's sum of squares and writing its slot's outputs (rmsnorm.cu;
    /// bitwise the one-block kernel). On by default since the H100 A/B of 2026-12-07 (tg128
    /// 892.9 -> 910.9 tok/s, same call; `GGUFTOOL_RMS_PARTS=0` starts a device with it off).
    pub fn set_rms_parts(&self, on: bool) {
        self.rms_parts.store(on, Ordering::Relaxed);
    }
    pub(crate) fn rms_parts(&self) -> bool {
        self.rms_parts.load(Ordering::Relaxed)
    }

    /// Few-row F32 GEMVs (the MoE router) with one row per block read coalesced
    /// (gemv.cu `gemvc_f32`: each warp load 512 contiguous bytes, where the k-split kernel's
    /// lanes each read their own 128-byte chunk) instead of the k-split kernel. On by default
    /// since the H100 A/B of 2026-12-07 (the router 10.6 -> 5.0 us a layer, tg128 892.9 ->
    /// 898.8 tok/s, same call; `GGUFTOOL_GEMV_COALESCED=0` starts a device with it off).
    pub fn set_gemv_coalesced(&self, on: bool) {
        self.gemv_coalesced.store(on, Ordering::Relaxed);
    }
    pub(crate) fn gemv_coalesced(&self) -> bool {
        self.gemv_coalesced.load(Ordering::Relaxed)
    }

    pub(crate) fn gemvq_ksplit(&self) -> Option<usize> {
        Some(self.gemvq_ksplit.load(Ordering::Relaxed)).filter(|&k| k > 0)
    }

    /// Wait for all queued work; a kernel fault surfaces here.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        let t0 = std::time::Instant::now();
        let r = self
            .stream
            .synchronize()
            .map_err(|source| KernelError::Launch {
                op: "synchronize",
                source,
            });
        note_wait(t0);
        r
    }

    /// Registers and local memory of every kernel loaded so far.
    pub fn kernel_resources(&self) -> Vec<KernelResources> {
        self.resources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Largest dynamic shared memory a block may opt in to on this device.
    pub(crate) fn max_smem_optin(&self) -> usize {
        *self.max_smem.get_or_init(|| {
            self.ctx
                .attribute(
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map(|v| v.max(0) as usize)
                .unwrap_or(48 << 10)
        })
    }

    fn module(&self, op: Op) -> Result<Arc<CudaModule>, KernelError> {
        let mut mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = mods.get(&op) {
            return Ok(m.clone());
        }
        let archs = nvrtc::supported_archs()?;
        let (major, minor) = self.info.compute_capability;
        if !archs.contains(&(major * 10 + minor)) {
            let (vmaj, vmin) = nvrtc::version()?;
            return Err(KernelError::UnsupportedArch {
                major,
                minor,
                arch: self.info.arch.clone(),
                nvrtc: format!("{vmaj}.{vmin}"),
            });
        }
        let compiled = nvrtc::compile_cached(op, &self.info.arch)?;
        {
            let mut sigs = self.signatures.lock().unwrap_or_else(|p| p.into_inner());
            for (name, sizes) in ptx_signatures(&compiled.ptx) {
                sigs.insert(name, Arc::new(sizes));
            }
            self.pdl_entries
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(ptx_pdl_entries(&compiled.ptx));
        }
        let m = self
            .ctx
            .load_module(Ptx::from_binary(compiled.cubin))
            .map_err(KernelError::driver("cuModuleLoadData"))?;
        mods.insert(op, m.clone());
        Ok(m)
    }

    /// The kernel `name` of `op`, compiling and loading the module on first use.
    pub(crate) fn func(&self, op: Op, name: &str) -> Result<Kernel, KernelError> {
        if let Some(k) = self
            .funcs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
        {
            return Ok(k.clone());
        }
        let m = self.module(op)?;
        let f = m
            .load_function(name)
            .map_err(KernelError::driver("cuModuleGetFunction"))?;
        let params = self
            .signatures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| KernelError::BadShape {
                op: op.name(),
                msg: format!("kernel `{name}` has no PTX signature"),
            })?;
        let registers = f.num_regs().unwrap_or(-1);
        let local_bytes = f.local_size_bytes().unwrap_or(-1);
        self.resources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(KernelResources {
                kernel: name.to_string(),
                registers,
                local_bytes,
            });
        let pdl = self
            .pdl_entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(name);
        let k = Kernel {
            f,
            name: name.into(),
            params,
            pdl,
            smem_limit: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            blocks_per_sm_128: Arc::new(std::sync::atomic::AtomicU32::new(0)),
        };
        self.funcs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), k.clone());
        Ok(k)
    }

    /// Allow `bytes` of dynamic shared memory for `k` (needed above 48 KiB).
    pub(crate) fn allow_smem(&self, k: &Kernel, bytes: usize) -> Result<(), KernelError> {
        if bytes <= k.smem_limit.load(Ordering::Relaxed) {
            return Ok(());
        }
        k.f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(KernelError::driver("cuFuncSetAttribute"))?;
        k.smem_limit.fetch_max(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// How many 128-thread blocks of `k` (no dynamic shared memory) one SM holds at once: the
    /// driver's occupancy answer, asked once per kernel.
    pub(crate) fn blocks_per_sm_128(&self, k: &Kernel) -> Result<u32, KernelError> {
        let known = k.blocks_per_sm_128.load(Ordering::Relaxed);
        if known > 0 {
            return Ok(known);
        }
        let n =
            k.f.occupancy_max_active_blocks_per_multiprocessor(128, 0, None)
                .map_err(KernelError::driver(
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                ))?
                .max(1);
        k.blocks_per_sm_128.store(n, Ordering::Relaxed);
        Ok(n)
    }

    /// Start collecting the arguments of a launch of `k` on this device's stream.
    pub(crate) fn args<'a>(&'a self, k: &'a Kernel) -> Args<'a> {
        Args {
            inner: self.stream.launch_builder(&k.f),
            sizes: Vec::with_capacity(k.params.len()),
            params: Vec::with_capacity(k.params.len()),
            kernel: k,
        }
    }

    /// Launch after checking the collected arguments against the kernel's signature (count and
    /// byte size of each), then map the result as [`Gpu::launched`] does.
    ///
    /// # Safety
    /// The arguments must describe buffers valid for everything the kernel reads and writes.
    pub(crate) unsafe fn launch(
        &self,
        op: &'static str,
        mut a: Args<'_>,
        cfg: LaunchConfig,
    ) -> Result<(), KernelError> {
        if a.sizes != *a.kernel.params {
            return Err(KernelError::BadShape {
                op,
                msg: format!(
                    "launch of `{}` passes argument sizes {:?}, the kernel takes {:?}",
                    a.kernel.name, a.sizes, a.kernel.params
                ),
            });
        }
        let t0 = self.prof_start()?;
        let r = if a.kernel.pdl && self.pdl() {
            // SAFETY: the caller's contract; the signature matches and `a.params` points at the
            // argument values, borrowed for the call.
            unsafe { self.launch_pdl(&a.kernel.f, &mut a.params, cfg) }
        } else {
            // SAFETY: the caller's contract; the signature matches.
            unsafe { a.inner.launch(cfg) }.map(|_| ())
        };
        self.prof_stop(op, t0)?;
        self.launched(op, r)
    }

    /// `cuLaunchKernelEx` with programmatic stream serialization: the kernel may start while the
    /// stream's previous kernel still runs (once all of that one's blocks called `pdl_trigger`
    /// or exited) and meets its results in `pdl_wait`.
    ///
    /// # Safety
    /// `params` must point at live values matching the kernel's signature; the kernel must not
    /// touch memory other kernels use before its `pdl_wait`.
    unsafe fn launch_pdl(
        &self,
        f: &cudarc::driver::CudaFunction,
        params: &mut [*mut std::ffi::c_void],
        cfg: LaunchConfig,
    ) -> Result<(), cudarc::driver::DriverError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a zeroed attribute is a valid value of the plain C union.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: the caller's contract; `lc` and `attr` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &lc,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }

    /// Start attributing device time to kernel kinds: every launch is bracketed by events.
    pub fn profile_begin(&self) {
        self.profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.profiling.store(true, Ordering::Relaxed);
    }

    /// Stop profiling; waits for the device and sums the bracketed times per kind.
    pub fn profile_end(&self) -> Result<Profile, KernelError> {
        self.profiling.store(false, Ordering::Relaxed);
        self.synchronize()?;
        let recs = std::mem::take(&mut *self.profile.lock().unwrap_or_else(|p| p.into_inner()));
        let mut by: Vec<KindTime> = Vec::new();
        for (kind, a, b) in &recs {
            let ms = a
                .elapsed_ms(b)
                .map_err(KernelError::driver("cuEventElapsedTime"))?;
            match by.iter_mut().find(|k| k.kind == *kind) {
                Some(k) => {
                    k.us += f64::from(ms) * 1e3;
                    k.launches += 1.0;
                }
                None => by.push(KindTime {
                    kind: kind.to_string(),
                    us: f64::from(ms) * 1e3,
                    launches: 1.0,
                }),
            }
        }
        by.sort_by(|a, b| b.us.total_cmp(&a.us));
        Ok(Profile { kinds: by })
    }

    /// With profiling on, an event recorded before a launch.
    pub(crate) fn prof_start(&self) -> Result<Option<cudarc::driver::CudaEvent>, KernelError> {
        if !self.profiling.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let e = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(KernelError::driver("cuEventCreate"))?;
        e.record(&self.stream)
            .map_err(KernelError::driver("cuEventRecord"))?;
        Ok(Some(e))
    }

    /// Close the bracket opened by [`Gpu::prof_start`].
    pub(crate) fn prof_stop(
        &self,
        op: &'static str,
        start: Option<cudarc::driver::CudaEvent>,
    ) -> Result<(), KernelError> {
        let Some(start) = start else { return Ok(()) };
        let e = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(KernelError::driver("cuEventCreate"))?;
        e.record(&self.stream)
            .map_err(KernelError::driver("cuEventRecord"))?;
        self.profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((op, start, e));
        Ok(())
    }

    /// Fails unless `grid` fits the device's limits.
    pub(crate) fn check_grid(
        &self,
        op: &'static str,
        grid: (u64, u64, u64),
    ) -> Result<(u32, u32, u32), KernelError> {
        let (mx, my, mz) = self.info.max_grid;
        let err = || KernelError::GridTooLarge {
            op,
            grid,
            limit: self.info.max_grid,
        };
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Err(KernelError::BadShape {
                op,
                msg: format!("empty launch grid {grid:?}"),
            });
        }
        if grid.0 > mx as u64 || grid.1 > my as u64 || grid.2 > mz as u64 {
            return Err(err());
        }
        Ok((grid.0 as u32, grid.1 as u32, grid.2 as u32))
    }

    pub(crate) fn cfg(
        &self,
        op: &'static str,
        grid: (u64, u64, u64),
        block: u32,
    ) -> Result<LaunchConfig, KernelError> {
        Ok(LaunchConfig {
            grid_dim: self.check_grid(op, grid)?,
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Grid for a kernel that grid-strides over rows in y: `(x, min(rows, device y limit), 1)`.
    pub(crate) fn cfg_rows(
        &self,
        op: &'static str,
        x: u64,
        rows: usize,
        block: u32,
    ) -> Result<LaunchConfig, KernelError> {
        let y = (rows as u64).clamp(1, u64::from(self.info.max_grid.1));
        self.cfg(op, (x, y, 1), block)
    }

    /// Map a launch result and, in sync mode, wait for the kernel and report its fault.
    pub(crate) fn launched<T>(
        &self,
        op: &'static str,
        r: Result<T, cudarc::driver::DriverError>,
    ) -> Result<(), KernelError> {
        r.map_err(|source| KernelError::Launch { op, source })?;
        if self.sync_each.load(Ordering::Relaxed) {
            self.stream
                .synchronize()
                .map_err(|source| KernelError::Launch { op, source })?;
        }
        Ok(())
    }

    pub(crate) fn tables(&self) -> Result<&DeviceTables, KernelError> {
        if let Some(t) = self.tables.get() {
            return Ok(t);
        }
        let t = DeviceTables::upload(&self.stream)?;
        Ok(self.tables.get_or_init(|| t))
    }

    pub(crate) fn blas(&self) -> Result<&cudarc::cublas::CudaBlas, KernelError> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        let b = cudarc::cublas::CudaBlas::new(self.stream.clone()).map_err(|source| {
            KernelError::Cublas {
                what: "cublasCreate",
                source,
            }
        })?;
        Ok(self.blas.get_or_init(|| b))
    }

    /// Device time of the work `f` queues, in milliseconds, measured with CUDA events on the
    /// stream (waits for it to finish).
    pub fn time_ms(
        &self,
        mut f: impl FnMut() -> Result<(), KernelError>,
    ) -> Result<f32, KernelError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .ctx
            .new_event(flags)
            .map_err(KernelError::driver("cuEventCreate"))?;
        let end = self
            .ctx
            .new_event(flags)
            .map_err(KernelError::driver("cuEventCreate"))?;
        start
            .record(&self.stream)
            .map_err(KernelError::driver("cuEventRecord"))?;
        f()?;
        end.record(&self.stream)
            .map_err(KernelError::driver("cuEventRecord"))?;
        end.synchronize().map_err(|source| KernelError::Launch {
            op: "timed work",
            source,
        })?;
        start
            .elapsed_ms(&end)
            .map_err(KernelError::driver("cuEventElapsedTime"))
    }

    /// Device-to-device copy of `n` elements (for bandwidth baselines and buffer moves).
    pub fn copy<T>(
        &self,
        src: &impl cudarc::driver::DevicePtr<T>,
        dst: &mut impl cudarc::driver::DevicePtrMut<T>,
    ) -> Result<(), KernelError> {
        need_len("copy", "dst", dst.len(), src.len())?;
        let t0 = self.prof_start()?;
        let r = self.stream.memcpy_dtod(src, dst);
        self.prof_stop("copy", t0)?;
        r.map_err(|source| KernelError::Launch { op: "copy", source })
    }

    // ---- buffers -------------------------------------------------------------------------

    /// Copy host data into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, KernelError> {
        self.stream
            .clone_htod(host)
            .map_err(KernelError::driver("cuMemcpyHtoD"))
    }

    /// A new device buffer of `len` bytes filled through pinned staging slots, one chunk of at
    /// most [`BULK_SLOT`] bytes at a time: `fill(offset, chunk)` writes bytes `offset ..
    /// offset + chunk.len()` of the data into `chunk` (pinned host memory), whose copy is then
    /// queued on this device's stream. Filling one chunk overlaps the copies of the ones
    /// before it, so a `fill` that reads a memory-mapped file keeps the disk and the copy
    /// engine busy together, and no host copy of the whole data is ever made. The slots are
    /// allocated on first use and reused by every later call. On return the copies may still be
    /// in flight: work queued on this stream afterwards sees the data (stream order); other
    /// streams must synchronize first. An error (from `fill`, or the device) returns only after
    /// every copy queued by the call has completed, the buffer freed. `fill` runs with this
    /// device's bulk slots locked: it must not upload through them itself.
    pub fn upload_staged<E>(
        &self,
        len: usize,
        fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Result<CudaSlice<u8>, StagedError<E>> {
        self.upload_staged_chunks(len, BULK_SLOT, fill)
    }

    /// [`Gpu::upload_staged`] in chunks of `chunk` bytes (clamped to 1 ..= [`BULK_SLOT`]).
    pub fn upload_staged_chunks<E>(
        &self,
        len: usize,
        chunk: usize,
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Result<CudaSlice<u8>, StagedError<E>> {
        // SAFETY: every byte is written by the copies queued below before later work on the
        // stream reads it; on an error the buffer is dropped unread.
        let dst = unsafe { self.stream.alloc::<u8>(len) }
            .map_err(KernelError::driver("cuMemAllocAsync"))?;
        if len == 0 {
            return Ok(dst);
        }
        let ptr = {
            let (p, _g) = cudarc::driver::DevicePtr::device_ptr(&dst, &self.stream);
            p
        };
        self.bulk.lock().unwrap_or_else(|p| p.into_inner()).upload(
            &self.stream,
            ptr,
            len,
            chunk,
            &mut fill,
        )?;
        Ok(dst)
    }

    /// A zero-filled device buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        self.stream
            .alloc_zeros(n.max(1))
            .map_err(KernelError::driver("cuMemAlloc"))
    }

    /// An uninitialized device buffer of `n` elements from the caching pool (no driver call
    /// when a buffer of its size class was returned before). The caller must write every
    /// element before reading it.
    pub fn alloc<T: DeviceRepr>(&self, n: usize) -> Result<DevBuf<T>, KernelError> {
        self.pool.alloc::<T>(n.max(1), true)
    }

    /// An uninitialized buffer outside the pool's free lists (freed on drop): for long-lived,
    /// growing buffers such as KV caches.
    pub fn alloc_persistent<T: DeviceRepr>(&self, n: usize) -> Result<DevBuf<T>, KernelError> {
        self.pool.alloc::<T>(n.max(1), false)
    }

    /// Pool statistics (cached, live and peak bytes).
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Release the pool's cached buffers.
    pub fn pool_trim(&self) {
        self.pool.trim()
    }

    /// Queue an upload of `host` into a new pooled buffer: through pinned memory (truly
    /// asynchronous) for inputs up to 1 MiB, else a pageable copy.
    pub fn upload_async<T: DeviceRepr>(&self, host: &[T]) -> Result<DevBuf<T>, KernelError> {
        let mut d = self.alloc::<T>(host.len())?;
        if host.is_empty() {
            return Ok(d);
        }
        if std::mem::size_of_val(host) <= STAGING_SLOT {
            let dst = d.ptr();
            self.staging
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .upload(&self.stream, host, dst)?;
        } else {
            self.stream
                .memcpy_htod(host, &mut d)
                .map_err(KernelError::driver("cuMemcpyHtoD"))?;
        }
        Ok(d)
    }

    /// Copy a device buffer back (waits for the stream; through pinned memory when it fits).
    pub fn download<T: DeviceRepr + Clone + Default>(
        &self,
        dev: &impl cudarc::driver::DevicePtr<T>,
    ) -> Result<Vec<T>, KernelError> {
        let t0 = std::time::Instant::now();
        let r = self.download_inner(dev);
        note_wait(t0);
        r
    }

    /// Copy one small value at raw device address `src` back through the pinned staging
    /// buffer, in order on this device's stream (waits for it): no pageable copy.
    pub(crate) fn download_word(&self, src: u64) -> Result<u32, KernelError> {
        let t0 = std::time::Instant::now();
        let mut out = [0u32];
        let staged = self
            .staging
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .download(&self.stream, src, &mut out);
        note_wait(t0);
        match staged {
            Ok(true) => Ok(out[0]),
            Ok(false) => Err(KernelError::BadShape {
                op: "download",
                msg: "4 bytes did not fit the staging buffer".into(),
            }),
            Err(e) => Err(e),
        }
    }

    fn download_inner<T: DeviceRepr + Clone + Default>(
        &self,
        dev: &impl cudarc::driver::DevicePtr<T>,
    ) -> Result<Vec<T>, KernelError> {
        let mut out = vec![T::default(); dev.len()];
        if out.is_empty() {
            return Ok(out);
        }
        {
            let (src, _g) = dev.device_ptr(&self.stream);
            let staged = self
                .staging
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .download(&self.stream, src, &mut out)?;
            if staged {
                return Ok(out);
            }
        }
        self.stream
            .memcpy_dtoh(dev, &mut out)
            .map_err(|source| KernelError::Launch {
                op: "download",
                source,
            })?;
        // The caller counts the wait (not `self.synchronize`, which would count it twice).
        self.stream
            .synchronize()
            .map_err(|source| KernelError::Launch {
                op: "download",
                source,
            })?;
        Ok(out)
    }
}

/// Fail with [`KernelError::BadLength`] unless `got >= need`.
pub(crate) fn need_len(
    op: &'static str,
    arg: &'static str,
    got: usize,
    need: usize,
) -> Result<(), KernelError> {
    if got < need {
        return Err(KernelError::BadLength { op, arg, need, got });
    }
    Ok(())
}

/// The length of a device buffer (slice or view).
pub(crate) fn dlen<T>(s: &impl DeviceSlice<T>) -> usize {
    s.len()
}

/// Checked conversion of a shape value to the `int` a kernel takes.
pub(crate) fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::BadShape {
        op,
        msg: format!("{what} = {v} exceeds the kernel's 32-bit range"),
    })
}

#[cfg(test)]
mod tests {
    use super::{ptx_pdl_entries, ptx_signatures};

    #[test]
    fn pdl_entries_are_the_ones_that_wait() {
        let ptx = ".visible .entry a(\n.param .u64 a_p\n)\n{\ngriddepcontrol.wait;\n}\n.visible .entry b(\n.param .u64 b_p\n)\n{\nret;\n}\n";
        let s = ptx_pdl_entries(ptx);
        assert!(s.contains("a"));
        assert!(!s.contains("b"));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn ptx_signature_sizes() {
        let ptx = ".visible .entry get_rows_f16(\n\t.param .u64 get_rows_f16_param_0,\n\t.param .u32 get_rows_f16_param_1,\n\t.param .f32 get_rows_f16_param_2,\n\t.param .align 8 .b8 get_rows_f16_param_3[64]\n)\n{\n}\n.visible .entry k2(\n\t.param .u64 k2_param_0\n)\n";
        let s = ptx_signatures(ptx);
        assert_eq!(s["get_rows_f16"], vec![8, 4, 4, 64]);
        assert_eq!(s["k2"], vec![8]);
    }
}
