//! The CUDA backend: the [`Backend`] ops on one GPU through the `kernels` crate.
//!
//! - Activations are f32 device buffers from the device's caching pool (no allocation driver
//!   call, no memset per op; a decode step that repeats the last one's sizes gets the same
//!   addresses). Every op writes its whole output.
//! - Weights stay in their GGUF encoding on the device; the types whose blocks are not 16-byte
//!   aligned are stored in the lossless repacked layout (`kernels::repack`).
//! - Matmuls of up to [`GEMVQ_MAX_ROWS`] rows run as integer-dot GEMVs on q8 activations (the
//!   quantized copy of an activation is made once and kept with the tensor, so the several
//!   matmuls that share an input quantize it once); longer ones dequantize to bf16 tiles for the
//!   tensor cores. MoE layers run fused gate+up+SiLU and down+weighted-sum launches with the
//!   expert ids on the device, grouped by expert for batches.
//! - MLA attention runs the latent kernel (each cached latent row read once for all heads).
//! - KV caches grow with amortized capacity outside the pool and are stored in bf16 by default.
//! - Step inputs (token ids, positions) go through pinned staging buffers; RoPE frequencies and
//!   the last positions are cached on the device.
//!
//! [`CudaOptions::exact`] selects the f32 path everywhere instead (f32 activations into the
//! GEMVs, f32 SGEMM, f32 caches): it agrees with the CPU reference to f32 summation order. The
//! fast path's errors are derived in `check.rs`. Both are tested against the CPU reference
//! (`tests.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use gguf::GgmlType;
use kernels::{
    AttnShape, CacheElem, Channels, DevBuf, DeviceSlice, Gpu, IndexerShape, KernelError, KeyLists,
    MatShape, MlaSeq, MlaShape, Q8Act, QChannels, QMode, RopeLayout, RouterConfig, Rows, Rows3,
};

use crate::backend::{
    append_rows_seqs_composed, attention_seqs_composed, check_append_rows, check_attention,
    check_head_concat, check_head_slice, check_indexer, check_moe_ffn, check_rope, check_route,
    check_same, check_sample, check_seq_rows, indexer_keys_composed, mla_kv_rows_composed,
    mla_norms_composed, mla_queries_composed, AttnParams, Backend, Gating, IndexerKeysArgs,
    IndexerParams, KvRowsArgs, MlaNormed, RopeParams, RopeStyle, RouteParams, SeqAttn, Shape,
};
use crate::sampling::SampleRequest;
use crate::weights::HostWeight;
use crate::RuntimeError;

pub mod check;
pub mod comm;
#[cfg(test)]
mod tests;

/// Up to this many activation rows a matmul runs as a GEMV (weights read once per 8 rows, in
/// their own encoding); above it, dequantize to tiles + cuBLAS. 8: on the H200 (2026-12-02,
/// GLM-5-shaped file, `GGUFTOOL_GEMVQ_MAX_ROWS` swept over 8/16/32/64) the tensor-core path is
/// faster from 12 rows on (pp12 2,181 against 1,987 tok/s, pp32 5,770 against 2,758, pp64 10,667
/// against 3,056), while decode, MTP verification (<= 5 rows) and batches of up to 8 sequences
/// keep the GEMVs, which read each weight once for all their rows.
pub const GEMVQ_MAX_ROWS: usize = 8;
/// The exact path's GEMV limit (f32 activations, one weight read per row).
const GEMV_MAX_ROWS: usize = 8;
/// Smallest capacity a KV cache grows to (rows), then doubling.
const CACHE_MIN_ROWS: usize = 1024;

/// Numerical choices of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// f32 activations into the GEMVs, f32 SGEMM for prefill (agrees with the CPU reference to
    /// f32 summation order). Otherwise q8 activations + integer dot products, bf16 tensor cores.
    pub exact: bool,
    /// Store KV caches as bf16 (half the cache bytes; each cached value rounded to 8 mantissa
    /// bits). f32 otherwise.
    pub kv_bf16: bool,
}

impl Default for CudaOptions {
    /// The fast path with a bf16 cache, unless `GGUFTOOL_CUDA_EXACT=1` (exact, f32 cache) or
    /// `GGUFTOOL_KV_CACHE=f32|bf16` says otherwise.
    fn default() -> Self {
        let exact = std::env::var("GGUFTOOL_CUDA_EXACT").is_ok_and(|v| v == "1");
        let kv_bf16 = match std::env::var("GGUFTOOL_KV_CACHE").as_deref() {
            Ok("f32") => false,
            Ok("bf16") => true,
            _ => !exact,
        };
        CudaOptions { exact, kv_bf16 }
    }
}

/// The fused launches of the fast path, each with an environment switch that restores the
/// launches it replaces (to A/B them in one build; docs/GPU.md). All on by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fusions {
    /// `Backend::glu` as one GEMV launch over gate and up (gemvq's GLU mode, as the routed
    /// experts run) instead of two GEMVs and `silu_mul` (`GGUFTOOL_FUSE_GLU=0`).
    pub glu: bool,
    /// The end of an FFN block without `add_f32` launches (`GGUFTOOL_FUSE_ADD=0`: both adds
    /// back): the shared expert's down GEMV adds onto the routed experts' sum in its epilogue
    /// (`Backend::matmul_add`), and the block's residual add runs in the next block's RMSNorm
    /// launch (`Backend::residual_into_norm`, `add_rms_norm`).
    pub add: bool,
    /// `Backend::mla_queries` in three launches instead of seven, no copies
    /// (`GGUFTOOL_FUSE_QROPE=0`: two head slices, RoPE, quantize + per-head GEMV, two concat
    /// copies).
    pub qrope: bool,
    /// `Backend::mla_kv_rows` / `Backend::indexer_keys` of a one-sequence step as one launch
    /// each, norm + RoPE in place and the rows written into the cache (`GGUFTOOL_FUSE_KV=0`:
    /// the norm, RoPE and cache-append launches).
    pub kv: bool,
    /// `Backend::moe_ffn_shared` of a one-token step: the shared expert rides the routed
    /// experts' launches (its gate + up as the GLU launch's last channel, its down as one more
    /// slot of the down + weighted-sum launch, its activations quantized with theirs): 3 launches
    /// fewer per MoE layer (`GGUFTOOL_FUSE_SHARED=0`: the shared expert's own GLU, quantize and
    /// accumulating down GEMV). Needs the shared expert in the routed experts' type and shapes.
    pub shared: bool,
    /// A batched step of several sequences appends their cache rows and runs their absorbed
    /// MLA attention as one launch each over all sequences (`Backend::append_rows_seqs`,
    /// `Backend::attention_seqs`; `GGUFTOOL_FUSE_SEQS=0`: per sequence a row slice, an append,
    /// a query slice and an attention launch, then the stacking copies).
    pub seqs: bool,
    /// `Backend::matmul_stacked` of a one-row step as one GEMV launch over the matrices'
    /// stacked rows where they share a type, layout and width (`GGUFTOOL_FUSE_STACK=0`: a
    /// launch each). A layer's q_a, kv_a and indexer keys: 2 launches fewer per layer, and
    /// kv_a's 576 rows and the keys' 128 no longer run alone on a mostly idle GPU.
    pub stack: bool,
    /// The fused MLA queries' quantize (q_nope to q8 for the per-head k_b GEMV) and RoPE (the
    /// rope columns into the query rows) as one launch, `kernels::Gpu::rope_q8_to`, bitwise
    /// the two launches: 1 launch fewer per layer (`GGUFTOOL_FUSE_ROPE_Q8=0`: both launches).
    pub rope_q8: bool,
    /// The absorbed MLA attention's output handed to the per-head v_b GEMV already quantized:
    /// where the launch has key splits, the combine launch writes the q8 activations with its
    /// f32 output (`kernels::Gpu::mla_attention_q8`), bitwise the quantize launch it saves: 1
    /// launch fewer per layer on a split decode step (`GGUFTOOL_FUSE_ATTN_Q8=0`: the GEMV
    /// quantizes).
    pub attn_q8: bool,
    /// `Backend::mla_norms` as one launch: an MLA block's q_a norm (with its q8 activations),
    /// latent cache rows and indexer keys side by side, `kernels::Gpu::mla_norms`, bitwise the
    /// three launches: 2 launches fewer per layer (`GGUFTOOL_FUSE_MLA_NORMS=0`: one each).
    pub norms: bool,
}

impl Fusions {
    pub const ALL: Fusions = Fusions {
        glu: true,
        add: true,
        qrope: true,
        kv: true,
        shared: true,
        seqs: true,
        stack: true,
        rope_q8: true,
        attn_q8: true,
        norms: true,
    };
    pub const NONE: Fusions = Fusions {
        glu: false,
        add: false,
        qrope: false,
        kv: false,
        shared: false,
        seqs: false,
        stack: false,
        rope_q8: false,
        attn_q8: false,
        norms: false,
    };

    /// [`Fusions::ALL`] less the ones switched off by their variable set to `0`.
    pub fn from_env() -> Self {
        let on = |var: &str| std::env::var(var).map_or(true, |v| v != "0");
        Fusions {
            glu: on("GGUFTOOL_FUSE_GLU"),
            add: on("GGUFTOOL_FUSE_ADD"),
            qrope: on("GGUFTOOL_FUSE_QROPE"),
            kv: on("GGUFTOOL_FUSE_KV"),
            shared: on("GGUFTOOL_FUSE_SHARED"),
            seqs: on("GGUFTOOL_FUSE_SEQS"),
            stack: on("GGUFTOOL_FUSE_STACK"),
            rope_q8: on("GGUFTOOL_FUSE_ROPE_Q8"),
            attn_q8: on("GGUFTOOL_FUSE_ATTN_Q8"),
            norms: on("GGUFTOOL_FUSE_MLA_NORMS"),
        }
    }
}

/// Device storage of a tensor.
enum Store {
    F32(DevBuf<f32>),
    /// bf16 bit patterns (KV caches).
    Bf16(DevBuf<u16>),
}

/// A row-major `[rows, cols]` matrix on the device; the buffer may hold spare rows (capacity of
/// a KV cache). Activations are f32; caches made by [`Backend::empty`] may be bf16.
pub struct CudaTensor {
    rows: usize,
    cols: usize,
    store: Store,
    /// The q8 activations of this tensor, made on first use by an integer-dot GEMV.
    q8: OnceLock<Q8Act>,
}

impl CudaTensor {
    fn shape(&self) -> Shape {
        (self.rows, self.cols)
    }

    fn f32(&self) -> Option<&DevBuf<f32>> {
        match &self.store {
            Store::F32(b) => Some(b),
            Store::Bf16(_) => None,
        }
    }

    fn f32_mut(&mut self) -> Option<&mut DevBuf<f32>> {
        self.q8.take();
        match &mut self.store {
            Store::F32(b) => Some(b),
            Store::Bf16(_) => None,
        }
    }

    fn capacity(&self) -> usize {
        match &self.store {
            Store::F32(b) => b.len(),
            Store::Bf16(b) => b.len(),
        }
    }
}

/// A weight in its device layout; 1-D weights (norms, biases) also as f32 values.
pub struct CudaWeight {
    name: String,
    ty: GgmlType,
    dims: Vec<usize>,
    /// Stored in the repacked layout (`kernels::repack`).
    packed: bool,
    bytes: kernels::CudaSlice<u8>,
    values: Option<kernels::CudaSlice<f32>>,
}

/// The q8 activations of a tensor: its cached copy, or one made for another view of it.
enum Q8Ref<'t> {
    Cached(&'t Q8Act),
    Owned(Q8Act),
}

impl std::ops::Deref for Q8Ref<'_> {
    type Target = Q8Act;
    fn deref(&self) -> &Q8Act {
        match self {
            Q8Ref::Cached(q) => q,
            Q8Ref::Owned(q) => q,
        }
    }
}

/// A row-major `[rows, cols]` i32 matrix on the device; `-1` marks an empty slot.
pub struct CudaIndex {
    rows: usize,
    cols: usize,
    buf: DevBuf<i32>,
}

/// Device-resident inputs reused across ops and steps.
#[derive(Default)]
struct Inputs {
    /// RoPE inverse frequencies by (theta bits, n_rot).
    inv_freq: HashMap<(u32, usize), Arc<DevBuf<f32>>>,
    /// The last uploaded position lists (the layers of a step share them).
    positions: Vec<(Vec<i32>, Arc<DevBuf<i32>>)>,
    /// (x, y) index maps of the per-head batched GEMV by (rows, heads).
    head_maps: HashMap<(usize, usize), Arc<DevBuf<i32>>>,
    /// One-entry activation-row maps `[r]` by r (a launch reading one row of a q8 block).
    row_maps: HashMap<usize, Arc<DevBuf<i32>>>,
}

/// One CUDA device. Cloning shares the device (and its compiled kernels and caches).
#[derive(Clone)]
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    opts: CudaOptions,
    inputs: Arc<Mutex<Inputs>>,
    /// Prefill (> [`GEMVQ_MAX_ROWS`] rows, fast path) on the tensor cores where it used
    /// multi-column GEMVs: MoE as one bf16 GEMM per expert over its gathered tokens, the
    /// per-head `attn_k_b` / `attn_v_b` as one strided-batched bf16 GEMM
    /// (default since the H200 run of 2026-12-02: pp512 26,273 tok/s against 5,128 with the
    /// GEMVs, within the derived tolerance on the 64-head model; `GGUFTOOL_PREFILL_GEMM=0` for
    /// the multi-column GEMVs).
    prefill_gemm: bool,
    /// Sample on the device (sample.cu); `GGUFTOOL_DEVICE_SAMPLING=0` copies the logits and
    /// samples on the host with the same rules instead (a fallback, and a comparison).
    device_sampling: bool,
    /// Norms feeding integer-dot GEMVs write the q8 copy in their own launch
    /// (`GGUFTOOL_NORM_Q8=0`: a separate quantize launch, as before).
    norm_q8: bool,
    /// Steps of up to this many rows take the integer-dot GEMVs, longer ones the tensor-core
    /// prefill path ([`GEMVQ_MAX_ROWS`]; `GGUFTOOL_GEMVQ_MAX_ROWS`, 8 ..= 1024, to measure
    /// where one overtakes the other).
    gemvq_max_rows: usize,
    /// Steps whose row count lies in this range take the int8 tensor-core product
    /// (`kernels::mmq`: quantized weights read once per step straight into `mma` fragments)
    /// wherever its types and shapes allow: dense matmuls, GLU and accumulating matmuls, and the
    /// grouped MoE experts (moe_sort's tiles, no routing read back). On by default for
    /// [`MMQ_ROWS`] (`GGUFTOOL_MMQ=0` turns it off, `GGUFTOOL_MMQ_ROWS=lo-hi` picks the range);
    /// its error model is the integer GEMVs'
    /// (q8 activations, exact integer block sums), already in `check::logit_tolerance`.
    mmq_rows: Option<(usize, usize)>,
    /// The grouped MoE experts' own upper end of that range (`GGUFTOOL_MMQ_MOE_MAX_ROWS`,
    /// 1 ..= 4096; unset: the range's). Their wide tiles hold up to 64 of an expert's tokens
    /// ([`kernels::moe_mmq_tile`]), so past 64 rows an expert is read once per 64 of its
    /// tokens where a dense matmul is read once per 64 rows; unset by default all the same:
    /// at 256-1,024 tokens the bf16 GEMMs measured faster (pp512 23,788-23,829 against
    /// 19,715-19,720 tok/s, H100, 2026-12-06).
    mmq_moe_hi: Option<usize>,
    /// Width of the grouped MoE launches' wide tiles on the tensor cores (`GGUFTOOL_MOE_TILE`
    /// = 16, 32 or 64, or 8 for none: 8-column tiles only, to measure; unset:
    /// [`kernels::moe_mmq_tile`] of the step's rows).
    moe_tile: Option<usize>,
    fuse: Fusions,
}

/// The step sizes the tensor-core product takes by default: from two rows (batched
/// decode, where the grouped GEMV re-reads every column's activations per weight task) to the
/// widest kernel variant (64 columns; beyond it each 64-column channel re-reads the weights).
/// Measured on one H100 on 2026-12-05 (`bench -p 8,16,32,64,512 -n 32 -r 2 --npl 1,8,32`,
/// off / on alternating twice): pp8 1,766-1,783 -> 3,573-3,587 tok/s, pp32 4,790-5,048 ->
/// 7,948-8,062, pp64 8,842-9,158 -> 9,194-9,221, 8 sequences 1,318-1,338 -> 2,524-2,540, 32
/// sequences 2,384-2,423 -> 4,190-4,223; one-row decode through it 569 against 813 (GEMV), and
/// 512-row prefill 11,893 against 23,496 (bf16 GEMM): hence 2..=64.
pub const MMQ_ROWS: (usize, usize) = (2, 64);

/// A measuring switch holding a number: `None` when unset; a value `ok` refuses is reported
/// and ignored, not silently replaced.
fn env_usize(name: &str, ok: impl Fn(usize) -> bool) -> Option<usize> {
    let v = std::env::var(name).ok()?;
    let n = v.trim().parse::<usize>().ok().filter(|&n| ok(n));
    if n.is_none() {
        tracing::warn!("{name}={v:?} is not an accepted value; ignored");
    }
    n
}

/// `GGUFTOOL_MMQ` (`0` = off) / `GGUFTOOL_MMQ_ROWS` (`lo-hi`, 1 <= lo <= hi <= 4096) as a
/// row range.
fn mmq_rows_from_env() -> Option<(usize, usize)> {
    if std::env::var("GGUFTOOL_MMQ").is_ok_and(|v| v == "0") {
        return None;
    }
    let Ok(v) = std::env::var("GGUFTOOL_MMQ_ROWS") else {
        return Some(MMQ_ROWS);
    };
    let range = v.split_once('-').and_then(|(a, b)| {
        let (a, b) = (
            a.trim().parse::<usize>().ok()?,
            b.trim().parse::<usize>().ok()?,
        );
        (1 <= a && a <= b && b <= 4096).then_some((a, b))
    });
    if range.is_none() {
        tracing::warn!(
            "GGUFTOOL_MMQ_ROWS={v:?} is not lo-hi with 1 <= lo <= hi <= 4096; using {}-{}",
            MMQ_ROWS.0,
            MMQ_ROWS.1
        );
    }
    Some(range.unwrap_or(MMQ_ROWS))
}

/// Channels of the tensor-core product over `rows` dense activation rows into `[rows, m]`: the
/// narrowest kernel width (8, 16, 32, 64 columns) holding them, several 64-column channels
/// beyond (columns past the last row are skipped by the kernel).
fn mmq_dense_channels(rows: usize, m: usize) -> QChannels<'static> {
    let ncols = [8usize, 16, 32, 64]
        .into_iter()
        .find(|&c| c >= rows)
        .unwrap_or(64);
    dense_channels(rows, m, ncols)
}

fn err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend(msg.into())
}

fn kerr(op: &'static str) -> impl FnOnce(KernelError) -> RuntimeError {
    move |source| RuntimeError::Kernel { op, source }
}

/// The absorbed MLA call of `tokens` query rows (`q_cols` wide, heads `p.k_dim` apart) over a
/// latent cache of `kv_len` rows `kv_cols` apart, output rows `[tokens, n_head * v_dim]`.
fn mla_shape(
    p: &AttnParams,
    tokens: usize,
    q_cols: usize,
    kv_cols: usize,
    kv_len: usize,
) -> MlaShape {
    MlaShape {
        tokens,
        heads: p.n_head,
        d: p.k_dim,
        d_v: p.v_dim,
        q_tok_stride: q_cols,
        q_head_stride: p.k_dim,
        kv_stride: kv_cols,
        kv_len,
        o_tok_stride: p.n_head * p.v_dim,
        o_head_stride: p.v_dim,
        scale: p.scale,
        pos0: p.pos0,
    }
}

fn not_f32(op: &str) -> RuntimeError {
    err(format!("{op}: expects an f32 activation tensor"))
}

/// RoPE's device inputs: (positions, inverse frequencies, the kernel's style).
type RopeInputs = (Arc<DevBuf<i32>>, Arc<DevBuf<f32>>, kernels::RopeStyle);

/// Position lists kept on the device (the layers of a step and the indexer share them).
const POSITION_SLOTS: usize = 4;

/// RoPE of the fused norm + RoPE launches: `p`'s rotated columns, the step's device inputs.
fn row_rope<'a>(
    pos: &'a cudarc::driver::CudaView<'a, i32>,
    inv_freq: &'a cudarc::driver::CudaView<'a, f32>,
    style: kernels::RopeStyle,
    p: &RopeParams,
) -> kernels::RowRope<'a> {
    kernels::RowRope {
        offset: p.offset,
        n_rot: p.n_rot,
        pos,
        inv_freq,
        style,
    }
}

/// Channels of an integer-dot GEMV over `rows` dense activation rows into `[rows, m]`: up to 8
/// rows share each weight load.
fn dense_q_channels(rows: usize, m: usize) -> QChannels<'static> {
    dense_channels(rows, m, rows.min(8))
}

/// `rows` dense activation rows into `[rows, m]` as channels of `ncols` columns each.
fn dense_channels(rows: usize, m: usize, ncols: usize) -> QChannels<'static> {
    QChannels {
        count: rows.div_ceil(ncols),
        ncols,
        ids: None,
        xidx: None,
        x_div: 1,
        yidx: None,
        y_stride: m,
        y_rows: rows,
    }
}

impl CudaBackend {
    /// The backend on CUDA device `ordinal`, with [`CudaOptions::default`].
    pub fn new(ordinal: usize) -> Result<Self, RuntimeError> {
        Self::with_options(ordinal, CudaOptions::default())
    }

    pub fn with_options(ordinal: usize, opts: CudaOptions) -> Result<Self, RuntimeError> {
        let gpu = Gpu::get(ordinal).map_err(kerr("opening the CUDA device"))?;
        Ok(Self::on(gpu, opts))
    }

    /// A backend on an already opened device (a tensor-parallel rank's own context).
    pub fn on(gpu: Arc<Gpu>, opts: CudaOptions) -> Self {
        Self {
            gpu,
            opts,
            inputs: Arc::new(Mutex::new(Inputs::default())),
            prefill_gemm: std::env::var("GGUFTOOL_PREFILL_GEMM").map_or(true, |v| v != "0"),
            device_sampling: std::env::var("GGUFTOOL_DEVICE_SAMPLING").map_or(true, |v| v != "0"),
            norm_q8: std::env::var("GGUFTOOL_NORM_Q8").map_or(true, |v| v != "0"),
            gemvq_max_rows: std::env::var("GGUFTOOL_GEMVQ_MAX_ROWS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .map_or(GEMVQ_MAX_ROWS, |v| v.clamp(GEMV_MAX_ROWS, 1024)),
            mmq_rows: mmq_rows_from_env(),
            mmq_moe_hi: env_usize("GGUFTOOL_MMQ_MOE_MAX_ROWS", |v| (1..=4096).contains(&v)),
            moe_tile: env_usize("GGUFTOOL_MOE_TILE", |w| {
                w == kernels::MOE_TILE || kernels::MOE_TILE_WIDTHS.contains(&w)
            }),
            fuse: Fusions::from_env(),
        }
    }

    /// Choose the tensor-core product's row range (see the `mmq_rows` field; `None`: off)
    /// regardless of the environment.
    pub fn with_mmq(mut self, rows: Option<(usize, usize)>) -> Self {
        self.mmq_rows = rows;
        self
    }

    /// Choose the grouped MoE experts' upper end of the tensor-core range (see the
    /// `mmq_moe_hi` field; `None`: the range's own) regardless of the environment.
    pub fn with_mmq_moe_hi(mut self, hi: Option<usize>) -> Self {
        self.mmq_moe_hi = hi;
        self
    }

    /// Choose the fused launches regardless of the environment (tests compare both).
    pub fn with_fusions(mut self, fuse: Fusions) -> Self {
        self.fuse = fuse;
        self
    }

    pub fn fusions(&self) -> Fusions {
        self.fuse
    }

    /// Choose the prefill path (see the `prefill_gemm` field) regardless of the environment.
    pub fn with_prefill_gemm(mut self, on: bool) -> Self {
        self.prefill_gemm = on;
        self
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub fn options(&self) -> CudaOptions {
        self.opts
    }

    fn inputs(&self) -> std::sync::MutexGuard<'_, Inputs> {
        self.inputs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn tensor(&self, rows: usize, cols: usize, buf: DevBuf<f32>) -> CudaTensor {
        CudaTensor {
            rows,
            cols,
            store: Store::F32(buf),
            q8: OnceLock::new(),
        }
    }

    /// An f32 tensor whose contents the caller writes completely.
    fn alloc(&self, rows: usize, cols: usize) -> Result<CudaTensor, RuntimeError> {
        let buf = self.gpu.alloc::<f32>(rows * cols).map_err(kerr("alloc"))?;
        Ok(self.tensor(rows, cols, buf))
    }

    fn index(&self, rows: usize, cols: usize) -> Result<CudaIndex, RuntimeError> {
        let buf = self.gpu.alloc::<i32>(rows * cols).map_err(kerr("alloc"))?;
        Ok(CudaIndex { rows, cols, buf })
    }

    fn len(t: &CudaTensor) -> usize {
        t.rows * t.cols
    }

    /// `f(values)` with the tensor's values as f32 (a bf16 cache is widened into a temporary).
    fn with_f32<R>(
        &self,
        t: &CudaTensor,
        f: impl FnOnce(&DevBuf<f32>) -> Result<R, RuntimeError>,
    ) -> Result<R, RuntimeError> {
        match &t.store {
            Store::F32(b) => f(b),
            Store::Bf16(b) => {
                let n = Self::len(t);
                let mut w = self.gpu.alloc::<f32>(n).map_err(kerr("bf16_to_f32"))?;
                self.gpu
                    .from_bf16(&b.slice(0..n.max(1).min(b.len())), &mut w, n)
                    .map_err(kerr("bf16_to_f32"))?;
                f(&w)
            }
        }
    }

    /// The q8 activations of `x` viewed as `rows x k` (made once per tensor and view; a second
    /// view of the same tensor is quantized without caching).
    fn q8<'t>(&self, x: &'t CudaTensor, rows: usize, k: usize) -> Result<Q8Ref<'t>, RuntimeError> {
        if let Some(q) = x.q8.get() {
            if q.rows == rows && q.k == k {
                return Ok(Q8Ref::Cached(q));
            }
        }
        let b = x.f32().ok_or_else(|| not_f32("quantize"))?;
        let q = self
            .gpu
            .quantize_q8(b, rows, k, k)
            .map_err(kerr("quantize"))?;
        if x.q8.get().is_some() {
            return Ok(Q8Ref::Owned(q));
        }
        Ok(Q8Ref::Cached(x.q8.get_or_init(|| q)))
    }

    /// Upload small i32 inputs through pinned memory, reusing the device copy of a recent
    /// identical list (the rope positions of every layer of a step).
    fn positions(&self, pos: &[i32]) -> Result<Arc<DevBuf<i32>>, RuntimeError> {
        let mut inp = self.inputs();
        if let Some(i) = inp.positions.iter().position(|(p, _)| p == pos) {
            let e = inp.positions.remove(i);
            let d = e.1.clone();
            inp.positions.push(e);
            return Ok(d);
        }
        let d = Arc::new(self.gpu.upload_async(pos).map_err(kerr("upload"))?);
        inp.positions.push((pos.to_vec(), d.clone()));
        if inp.positions.len() > POSITION_SLOTS {
            inp.positions.remove(0);
        }
        Ok(d)
    }

    fn inv_freq(&self, theta: f32, n_rot: usize) -> Result<Arc<DevBuf<f32>>, RuntimeError> {
        let mut inp = self.inputs();
        let key = (theta.to_bits(), n_rot);
        if let Some(b) = inp.inv_freq.get(&key) {
            return Ok(b.clone());
        }
        let d = Arc::new(
            self.gpu
                .upload_async(&kernels::rope_inv_freq(theta, n_rot))
                .map_err(kerr("rope"))?,
        );
        inp.inv_freq.insert(key, d.clone());
        Ok(d)
    }

    fn vector<'w>(
        &self,
        w: &'w CudaWeight,
        op: &str,
    ) -> Result<&'w kernels::CudaSlice<f32>, RuntimeError> {
        w.values
            .as_ref()
            .ok_or_else(|| err(format!("{op}: {} {:?} is not a vector", w.name, w.dims)))
    }

    fn shape_of(w: &CudaWeight, rows: usize, k: usize, slabs: usize) -> MatShape {
        MatShape {
            ty: w.ty,
            rows,
            k,
            slabs,
            packed: w.packed,
        }
    }

    /// Whether the fast integer-dot path takes `shape`.
    /// Whether a norm's output of `rows` x `k` should carry its q8 copy from the norm's own
    /// launch: on the fast path, when the integer-dot GEMVs that follow a norm would quantize
    /// it anyway (decode and short steps; longer ones go to the tensor cores in bf16). Saves one
    /// quantize launch per norm (bitwise the same codes, tested in kernels' GPU tests).
    fn q8_epilogue(&self, rows: usize, k: usize) -> bool {
        !self.opts.exact
            && k.is_multiple_of(32)
            && (rows <= self.gemvq_max_rows || !self.prefill_gemm || self.mmq_range(rows))
            && self.norm_q8
    }

    /// Whether an absorbed MLA attention of `rows` query rows should hand back its output's q8
    /// copy (rows x heads by v_dim, the view the per-head v_b GEMV quantizes): on the fast
    /// path's GEMV steps with the fusion on; the combine launch of a split plan writes it, a
    /// one-split plan quantizes in a launch of its own (the one the GEMV would have made).
    fn attn_q8(&self, rows: usize, p: &AttnParams) -> bool {
        self.fuse.attn_q8
            && !self.opts.exact
            && p.v_dim.is_multiple_of(32)
            && (1..=self.gemvq_max_rows).contains(&rows)
    }

    fn fast(&self, shape: &MatShape) -> bool {
        !self.opts.exact && kernels::gemvq_supported(shape)
    }

    fn mmq_range(&self, rows: usize) -> bool {
        self.mmq_rows
            .is_some_and(|(lo, hi)| (lo..=hi).contains(&rows))
    }

    /// Whether a fast-path product of `rows` rows on `shape` takes the tensor-core kernel: in
    /// range, and the device's shared memory holds the ring of that width's GLU launch (the
    /// larger one; a 99 KiB device holds none and keeps the GEMV / bf16 paths).
    fn mmq(&self, shape: &MatShape, rows: usize) -> bool {
        !self.opts.exact
            && self.mmq_range(rows)
            && self
                .gpu
                .mmq_fits(shape, mmq_dense_channels(rows, 1).ncols, true)
    }

    /// [`Self::mmq`] for the grouped MoE experts of a `rows`-row step (their own upper end).
    fn mmq_moe(&self, shape: &MatShape, rows: usize) -> bool {
        let in_range = self.mmq_rows.is_some_and(|(lo, hi)| {
            let hi = self.mmq_moe_hi.unwrap_or(hi);
            (lo..=hi).contains(&rows)
        });
        // The grouped tiles reach 64 columns (`kernels::moe_mmq_tile`).
        !self.opts.exact && in_range && self.gpu.mmq_fits(shape, 64, true)
    }

    /// The integer-dot product of `x` (`rows` dense rows) with `w` in `mode` into `out`
    /// (`[rows, m]`): the tensor-core kernel where [`Self::mmq`] says so, else the GEMV with up
    /// to 8 rows per weight load.
    #[allow(clippy::too_many_arguments)]
    fn dense_q(
        &self,
        shape: MatShape,
        w: &CudaWeight,
        mode: QMode<'_, kernels::CudaSlice<u8>>,
        q: &Q8Act,
        rows: usize,
        m: usize,
        out: &mut DevBuf<f32>,
        op: &'static str,
    ) -> Result<(), RuntimeError> {
        let mmq = self.mmq(&shape, rows);
        let ch = if mmq {
            mmq_dense_channels(rows, m)
        } else {
            dense_q_channels(rows, m)
        };
        self.int_dot(mmq, shape, &w.bytes, mode, ch, q, out)
            .map_err(kerr(op))
    }

    /// One integer-dot launch over `ch`: the tensor-core product or the GEMV (same maps, modes
    /// and error model; `ch.ncols` must suit the one chosen).
    #[allow(clippy::too_many_arguments)]
    fn int_dot(
        &self,
        mmq: bool,
        shape: MatShape,
        w: &kernels::CudaSlice<u8>,
        mode: QMode<'_, kernels::CudaSlice<u8>>,
        ch: QChannels<'_>,
        q: &Q8Act,
        out: &mut DevBuf<f32>,
    ) -> Result<(), KernelError> {
        if mmq {
            self.gpu.mmq(shape, w, mode, ch, q, out)
        } else {
            self.gpu.gemv_q(shape, w, mode, ch, q, out)
        }
    }

    /// `x [rows, k]` times weight rows (ggml `{k, m}`) into `out [rows, m]`.
    fn matmul_into(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &mut DevBuf<f32>,
    ) -> Result<(), RuntimeError> {
        let (k, m) = (w.dims[0], w.dims[1]);
        let shape = Self::shape_of(w, m, k, 1);
        let xb = x.f32().ok_or_else(|| not_f32("matmul"))?;
        let gemv_ok = k.is_multiple_of(32) && k.is_multiple_of(w.ty.block_size());
        if self.fast(&shape) && (x.rows <= self.gemvq_max_rows || self.mmq(&shape, x.rows)) {
            let q = self.q8(x, x.rows, k)?;
            return self.dense_q(shape, w, QMode::Plain, &q, x.rows, m, out, "matmul");
        }
        if x.rows <= GEMV_MAX_ROWS && gemv_ok {
            let ch = Channels {
                count: x.rows,
                ids: None,
                x_stride: k,
                x_div: 1,
                y_stride: m,
            };
            return self
                .gpu
                .gemv_batched(shape, &w.bytes, ch, xb, out)
                .map_err(kerr("matmul"));
        }
        // F32 weights (router, indexer weights) keep f32 products on either path: their
        // outputs decide expert and key selection, where a rounding can flip a near tie.
        if self.opts.exact || w.ty == GgmlType::F32 {
            self.gpu
                .matmul(shape, &w.bytes, xb, x.rows, out)
                .map_err(kerr("matmul"))
        } else {
            self.gpu
                .matmul_bf16(shape, &w.bytes, xb, x.rows, out)
                .map_err(kerr("matmul"))
        }
    }

    /// The x/y row maps of a per-head batched GEMV over `rows` tokens: channel
    /// `tg * heads + h` takes tokens `8 tg .. 8 tg + 8` of head h, i.e. rows
    /// `(8 tg + j) * heads + h` of the `[rows * heads, k]` view (-1 past the last token).
    fn head_map(&self, rows: usize, heads: usize) -> Result<Arc<DevBuf<i32>>, RuntimeError> {
        let mut inp = self.inputs();
        if let Some(b) = inp.head_maps.get(&(rows, heads)) {
            return Ok(b.clone());
        }
        let groups = rows.div_ceil(8);
        let mut v = vec![-1i32; groups * heads * 8];
        for tg in 0..groups {
            for h in 0..heads {
                for j in 0..8 {
                    let t = tg * 8 + j;
                    if t < rows {
                        v[(tg * heads + h) * 8 + j] = (t * heads + h) as i32;
                    }
                }
            }
        }
        let d = Arc::new(self.gpu.upload_async(&v).map_err(kerr("matmul_heads"))?);
        inp.head_maps.insert((rows, heads), d.clone());
        Ok(d)
    }

    /// The device list `[r]`: a one-channel GEMV's `xidx` reading activation row r.
    fn row_map(&self, r: usize) -> Result<Arc<DevBuf<i32>>, RuntimeError> {
        let mut inp = self.inputs();
        if let Some(b) = inp.row_maps.get(&r) {
            return Ok(b.clone());
        }
        let v = [i32::try_from(r).map_err(|_| err(format!("row map: row {r} past i32")))?];
        let d = Arc::new(self.gpu.upload_async(&v).map_err(kerr("row_map"))?);
        inp.row_maps.insert(r, d.clone());
        Ok(d)
    }

    /// The per-head integer-dot GEMV of `matmul_heads` on q8 rows `q` (`rows * heads` of them,
    /// token-major): head h's output row of token t goes to row `t * heads + h` of `o`, rows
    /// `y_stride` apart (`m` for dense outputs, wider to leave room after each head's `m`
    /// values).
    fn heads_gemv_q(
        &self,
        shape: MatShape,
        w: &CudaWeight,
        q: &Q8Act,
        rows: usize,
        y_stride: usize,
        o: &mut DevBuf<f32>,
    ) -> Result<(), RuntimeError> {
        let n_head = shape.slabs;
        if rows == 1 {
            let ch = QChannels {
                count: n_head,
                ncols: 1,
                ids: None,
                xidx: None,
                x_div: 1,
                yidx: None,
                y_stride,
                y_rows: n_head,
            };
            return self
                .gpu
                .gemv_q(shape, &w.bytes, QMode::Plain, ch, q, o)
                .map_err(kerr("matmul_heads"));
        }
        // Batches: 8 tokens of one head per channel, so each head's matrix is read once per 8
        // tokens.
        let map = self.head_map(rows, n_head)?;
        let idx = map.view();
        let ch = QChannels {
            count: rows.div_ceil(8) * n_head,
            ncols: 8,
            ids: None,
            xidx: Some(&idx),
            x_div: 1,
            yidx: Some(&idx),
            y_stride,
            y_rows: rows * n_head,
        };
        self.gpu
            .gemv_q(shape, &w.bytes, QMode::Plain, ch, q, o)
            .map_err(kerr("matmul_heads"))
    }

    /// Whether the one-launch norm + RoPE (+ append) kernels take `x` (`rows` x `cols`, rope
    /// `p` at `positions`, optionally appended to `cache`): the rope span one group of whole
    /// rows, past the `lead` normalised columns unless `inside` (LayerNorm rotates normalised
    /// values), and a cache as wide as the rows.
    fn norm_rope_fits(
        &self,
        x: &CudaTensor,
        lead: usize,
        inside: bool,
        positions: &[u32],
        p: &RopeParams,
        cache: Option<&CudaTensor>,
    ) -> bool {
        self.fuse.kv
            && x.rows > 0
            && x.f32().is_some()
            && positions.len() == x.rows
            && (p.n_groups, p.group_dim) == (1, x.cols)
            && p.n_rot > 0
            && p.n_rot.is_multiple_of(2)
            && p.offset + p.n_rot <= x.cols
            && (inside || p.offset >= lead)
            && cache.is_none_or(|c| c.cols == x.cols)
    }

    /// `cache`'s next `rows` rows (room made as `append_rows` does), counted as written: the
    /// caller's launch fills them (a failed step rolls the cache back to its length before).
    fn cache_rows<'c>(
        &self,
        cache: &'c mut CudaTensor,
        rows: usize,
    ) -> Result<kernels::CacheRows<'c>, RuntimeError> {
        self.reserve(cache, cache.rows + rows)?;
        cache.q8.take();
        let (old, add) = (Self::len(cache), rows * cache.cols);
        cache.rows += rows;
        Ok(match &mut cache.store {
            Store::F32(b) => kernels::CacheRows::F32(b.slice_mut(old..old + add)),
            Store::Bf16(b) => kernels::CacheRows::Bf16(b.slice_mut(old..old + add)),
        })
    }

    /// The device copy of a step's positions (the kernels take i32).
    fn positions_u32(&self, positions: &[u32]) -> Result<Arc<DevBuf<i32>>, RuntimeError> {
        let pos: Vec<i32> = positions
            .iter()
            .map(|&v| i32::try_from(v).map_err(|_| err(format!("rope: position {v} too large"))))
            .collect::<Result<_, _>>()?;
        self.positions(&pos)
    }

    /// RoPE's device inputs: the positions, the inverse frequencies, the kernel's style.
    fn rope_inputs(&self, positions: &[u32], p: &RopeParams) -> Result<RopeInputs, RuntimeError> {
        let style = match p.style {
            RopeStyle::Interleaved => kernels::RopeStyle::Interleaved,
            RopeStyle::Neox => kernels::RopeStyle::Neox,
        };
        Ok((
            self.positions_u32(positions)?,
            self.inv_freq(p.theta, p.n_rot)?,
            style,
        ))
    }

    /// Grow a cache tensor to hold `need` rows (amortized doubling, at least
    /// [`CACHE_MIN_ROWS`]), keeping its rows.
    fn reserve(&self, t: &mut CudaTensor, need: usize) -> Result<(), RuntimeError> {
        let cols = t.cols.max(1);
        if need * t.cols <= t.capacity() {
            return Ok(());
        }
        let cap_rows = need.max(2 * (t.capacity() / cols)).max(CACHE_MIN_ROWS);
        let n_old = Self::len(t);
        let g = &self.gpu;
        t.store = match &t.store {
            Store::F32(b) => {
                let mut nb = g
                    .alloc_persistent::<f32>(cap_rows * cols)
                    .map_err(kerr("append_rows"))?;
                if n_old > 0 {
                    g.copy(&b.slice(0..n_old), &mut nb.slice_mut(0..n_old))
                        .map_err(kerr("append_rows"))?;
                }
                Store::F32(nb)
            }
            Store::Bf16(b) => {
                let mut nb = g
                    .alloc_persistent::<u16>(cap_rows * cols)
                    .map_err(kerr("append_rows"))?;
                if n_old > 0 {
                    g.copy(&b.slice(0..n_old), &mut nb.slice_mut(0..n_old))
                        .map_err(kerr("append_rows"))?;
                }
                Store::Bf16(nb)
            }
        };
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Index = CudaIndex;

    fn name(&self) -> String {
        let i = self.gpu.info();
        format!(
            "cuda:{} ({}, sm_{}{})",
            i.ordinal, i.name, i.compute_capability.0, i.compute_capability.1
        )
    }

    fn upload(&self, w: HostWeight) -> Result<CudaWeight, RuntimeError> {
        use kernels::pool::StagedError;
        let ty = w.ty();
        let dims = w.dims().to_vec();
        // Matrices of the unaligned block types go to the device repacked (same bytes).
        let packed = dims.len() >= 2
            && kernels::repack::is_packed(ty)
            && dims[0].is_multiple_of(ty.block_size());
        // Through pinned staging slots, filled straight from the mmap (a share run by run), so
        // the disk read of one chunk overlaps the copy of the one before and no host copy of a
        // weight stored as is is made.
        let staged = |r: Result<_, StagedError<RuntimeError>>| {
            r.map_err(|e| match e {
                StagedError::Fill { source, .. } => source,
                StagedError::Kernel(k) => kerr("upload")(k),
            })
        };
        let bytes = if packed {
            // The device layout regroups block fields over the whole tensor: permuted on the
            // host first (a share gathered for it, not kept).
            let r = kernels::repack::repack(ty, &w.gathered()?)
                .ok_or_else(|| err(format!("upload: {} is not whole {ty} blocks", w.name())))?;
            staged(self.gpu.upload_staged(r.len(), |at, chunk| {
                chunk.copy_from_slice(&r[at..at + chunk.len()]);
                Ok(())
            }))?
        } else {
            staged(
                self.gpu
                    .upload_staged(w.n_bytes(), |at, chunk| w.read_into(at, chunk)),
            )?
        };
        let values = if dims.len() == 1 {
            Some(self.gpu.upload(&w.to_f32()?).map_err(kerr("upload"))?)
        } else {
            None
        };
        Ok(CudaWeight {
            name: w.name().to_string(),
            ty,
            dims,
            packed,
            bytes,
            values,
        })
    }

    fn new_tensor(
        &self,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<CudaTensor, RuntimeError> {
        if data.len() != rows * cols {
            return Err(err(format!(
                "new_tensor: {} values for [{rows}, {cols}]",
                data.len()
            )));
        }
        let buf = self.gpu.upload_async(data).map_err(kerr("new_tensor"))?;
        Ok(self.tensor(rows, cols, buf))
    }

    fn to_host(&self, t: &CudaTensor) -> Result<Vec<f32>, RuntimeError> {
        let n = Self::len(t);
        if n == 0 {
            return Ok(Vec::new());
        }
        self.with_f32(t, |b| {
            self.gpu.download(&b.slice(0..n)).map_err(kerr("to_host"))
        })
    }

    fn index_to_host(&self, i: &CudaIndex) -> Result<(usize, usize, Vec<i64>), RuntimeError> {
        let n = i.rows * i.cols;
        let v = if n == 0 {
            Vec::new()
        } else {
            self.gpu
                .download(&i.buf.slice(0..n))
                .map_err(kerr("index_to_host"))?
        };
        Ok((i.rows, i.cols, v.into_iter().map(i64::from).collect()))
    }

    fn vector_to_host(&self, w: &CudaWeight) -> Result<Vec<f32>, RuntimeError> {
        // 1-D weights carry their f32 values (the copy the vector ops read).
        let v = self.vector(w, "vector_to_host")?;
        self.gpu.download(v).map_err(kerr("vector_to_host"))
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn empty(&self, cols: usize) -> Result<CudaTensor, RuntimeError> {
        // Caches start empty; `append_rows` reserves their capacity.
        let store = if self.opts.kv_bf16 {
            Store::Bf16(self.gpu.alloc_persistent::<u16>(1).map_err(kerr("empty"))?)
        } else {
            Store::F32(self.gpu.alloc_persistent::<f32>(1).map_err(kerr("empty"))?)
        };
        Ok(CudaTensor {
            rows: 0,
            cols,
            store,
            q8: OnceLock::new(),
        })
    }

    fn append_rows(&self, dst: &mut CudaTensor, src: &CudaTensor) -> Result<(), RuntimeError> {
        check_append_rows(dst.cols, src.cols)?;
        let (old, add) = (Self::len(dst), Self::len(src));
        self.reserve(dst, dst.rows + src.rows)?;
        dst.q8.take();
        if add > 0 {
            let sb = src.f32().ok_or_else(|| not_f32("append_rows"))?;
            let s = sb.slice(0..add);
            match &mut dst.store {
                Store::F32(b) => self
                    .gpu
                    .copy(&s, &mut b.slice_mut(old..old + add))
                    .map_err(kerr("append_rows"))?,
                Store::Bf16(b) => self
                    .gpu
                    .to_bf16(&s, &mut b.slice_mut(old..old + add), add)
                    .map_err(kerr("append_rows"))?,
            }
        }
        dst.rows += src.rows;
        Ok(())
    }

    fn append_rows_seqs(
        &self,
        dsts: &mut [&mut CudaTensor],
        src: &CudaTensor,
        counts: &[usize],
    ) -> Result<(), RuntimeError> {
        check_seq_rows("append_rows_seqs", src.rows, counts, dsts.len())?;
        let bf16 = dsts.iter().all(|d| matches!(d.store, Store::Bf16(_)));
        let f32 = dsts.iter().all(|d| matches!(d.store, Store::F32(_)));
        if dsts.len() == 1 || !(bf16 || f32) || !self.fusions().seqs {
            return append_rows_seqs_composed(self, dsts, src, counts);
        }
        for (d, &n) in dsts.iter_mut().zip(counts) {
            check_append_rows(d.cols, src.cols)?;
            self.reserve(d, d.rows + n)?;
            d.q8.take();
        }
        // One launch writes every sequence's rows (a slice and an append each cost a copy and
        // a conversion launch per sequence and layer).
        let sb = src.f32().ok_or_else(|| not_f32("append_rows_seqs"))?;
        let cols = src.cols;
        fn views<'a, C: CacheElem>(
            dsts: &'a mut [&mut CudaTensor],
            counts: &[usize],
            cols: usize,
            pick: impl Fn(&mut Store) -> Option<&mut DevBuf<C>>,
        ) -> Vec<(kernels::DevViewMut<'a, C>, usize)> {
            dsts.iter_mut()
                .zip(counts)
                .filter_map(|(d, &n)| {
                    let old = d.rows * d.cols;
                    pick(&mut d.store).map(|b| (b.slice_mut(old..old + n * cols), n))
                })
                .collect()
        }
        if bf16 {
            let mut v = views(dsts, counts, cols, |s| match s {
                Store::Bf16(b) => Some(b),
                Store::F32(_) => None,
            });
            self.gpu.scatter_rows(sb, cols, &mut v)
        } else {
            let mut v = views(dsts, counts, cols, |s| match s {
                Store::F32(b) => Some(b),
                Store::Bf16(_) => None,
            });
            self.gpu.scatter_rows(sb, cols, &mut v)
        }
        .map_err(kerr("append_rows_seqs"))?;
        for (d, &n) in dsts.iter_mut().zip(counts) {
            d.rows += n;
        }
        Ok(())
    }

    fn reserve_rows(&self, t: &mut CudaTensor, rows: usize) -> Result<(), RuntimeError> {
        self.reserve(t, rows)
    }

    fn truncate_rows(&self, t: &mut CudaTensor, rows: usize) -> Result<(), RuntimeError> {
        if rows > t.rows {
            return Err(err(format!("truncate_rows: {rows} of {}", t.rows)));
        }
        t.q8.take();
        t.rows = rows;
        Ok(())
    }

    fn slice_rows(
        &self,
        x: &CudaTensor,
        start: usize,
        n: usize,
    ) -> Result<CudaTensor, RuntimeError> {
        if start + n > x.rows {
            return Err(err(format!("slice_rows {start}+{n} of {}", x.rows)));
        }
        let mut out = self.alloc(n, x.cols)?;
        if n * x.cols > 0 {
            self.with_f32(x, |b| {
                let s = b.slice(start * x.cols..(start + n) * x.cols);
                let o = out.f32_mut().ok_or_else(|| not_f32("slice_rows"))?;
                self.gpu.copy(&s, o).map_err(kerr("slice_rows"))
            })?;
        }
        Ok(out)
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor, RuntimeError> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(err(format!("gather_rows: row {bad} of {}", x.rows)));
        }
        let mut out = self.alloc(rows.len(), x.cols)?;
        self.with_f32(x, |b| {
            let o = out.f32_mut().ok_or_else(|| not_f32("gather_rows"))?;
            self.gpu
                .gather_rows(b, x.rows, x.cols, rows, o)
                .map_err(kerr("gather_rows"))
        })?;
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&CudaTensor]) -> Result<CudaTensor, RuntimeError> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(err("concat_rows: column counts differ"));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        if parts.len() == 1 {
            return self.slice_rows(parts[0], 0, rows);
        }
        let mut out = self.alloc(rows, cols)?;
        let mut at = 0;
        for p in parts {
            let n = Self::len(p);
            if n > 0 {
                self.with_f32(p, |b| {
                    let o = out.f32_mut().ok_or_else(|| not_f32("concat_rows"))?;
                    self.gpu
                        .copy(&b.slice(0..n), &mut o.slice_mut(at..at + n))
                        .map_err(kerr("concat_rows"))
                })?;
            }
            at += n;
        }
        Ok(out)
    }

    fn slice_cols(
        &self,
        x: &CudaTensor,
        start: usize,
        n: usize,
    ) -> Result<CudaTensor, RuntimeError> {
        self.head_slice(x, 1, x.cols, start, n)
    }

    fn concat_cols(&self, parts: &[&CudaTensor]) -> Result<CudaTensor, RuntimeError> {
        let rows = parts.first().map_or(0, |p| p.rows);
        if parts.iter().any(|p| p.rows != rows) {
            return Err(err("concat_cols: row counts differ"));
        }
        let cols: usize = parts.iter().map(|p| p.cols).sum();
        let mut out = self.alloc(rows, cols)?;
        let mut off = 0;
        for p in parts {
            if rows > 0 && p.cols > 0 {
                self.with_f32(p, |b| {
                    let o = out.f32_mut().ok_or_else(|| not_f32("concat_cols"))?;
                    let len = o.len();
                    self.gpu
                        .copy_rows(b, p.cols, &mut o.slice_mut(off..len), cols, rows, p.cols)
                        .map_err(kerr("concat_cols"))
                })?;
            }
            off += p.cols;
        }
        Ok(out)
    }

    fn head_slice(
        &self,
        x: &CudaTensor,
        n_head: usize,
        head_dim: usize,
        start: usize,
        n: usize,
    ) -> Result<CudaTensor, RuntimeError> {
        check_head_slice(x.shape(), n_head, head_dim, start, n)?;
        let mut out = self.alloc(x.rows, n_head * n)?;
        if x.rows > 0 && n > 0 {
            // Each (row, head) is one strided row of head_dim values in x.
            self.with_f32(x, |b| {
                let src = b.slice(start..Self::len(x));
                let o = out.f32_mut().ok_or_else(|| not_f32("head_slice"))?;
                self.gpu
                    .copy_rows(&src, head_dim, o, n, x.rows * n_head, n)
                    .map_err(kerr("head_slice"))
            })?;
        }
        Ok(out)
    }

    fn head_concat(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
        n_head: usize,
        b_shared: bool,
    ) -> Result<CudaTensor, RuntimeError> {
        let (ad, bd) = check_head_concat(a.shape(), b.shape(), n_head, b_shared)?;
        let w = ad + bd;
        let mut out = self.alloc(a.rows, n_head * w)?;
        let rows = a.rows;
        if rows == 0 {
            return Ok(out);
        }
        let ab = a.f32().ok_or_else(|| not_f32("head_concat"))?;
        let bb = b.f32().ok_or_else(|| not_f32("head_concat"))?;
        let o = out.f32_mut().ok_or_else(|| not_f32("head_concat"))?;
        let len = o.len();
        if ad > 0 {
            self.gpu
                .copy_rows(ab, ad, o, w, rows * n_head, ad)
                .map_err(kerr("head_concat"))?;
        }
        if bd > 0 {
            if b_shared {
                for h in 0..n_head {
                    self.gpu
                        .copy_rows(
                            bb,
                            bd,
                            &mut o.slice_mut(h * w + ad..len),
                            n_head * w,
                            rows,
                            bd,
                        )
                        .map_err(kerr("head_concat"))?;
                }
            } else {
                self.gpu
                    .copy_rows(bb, bd, &mut o.slice_mut(ad..len), w, rows * n_head, bd)
                    .map_err(kerr("head_concat"))?;
            }
        }
        Ok(out)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor, RuntimeError> {
        if w.dims.len() != 2 || w.dims[0] != x.cols {
            return Err(err(format!(
                "matmul: [{}, {}] by {} {:?}",
                x.rows, x.cols, w.name, w.dims
            )));
        }
        let mut out = self.alloc(x.rows, w.dims[1])?;
        if x.rows > 0 {
            let o = out.f32_mut().ok_or_else(|| not_f32("matmul"))?;
            self.matmul_into(x, w, o)?;
        }
        Ok(out)
    }

    fn matmul_heads(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor, RuntimeError> {
        let d = &w.dims;
        if d.len() != 3 || d[0] * d[2] != x.cols {
            return Err(err(format!(
                "matmul_heads: [{}, {}] by {} {:?}",
                x.rows, x.cols, w.name, d
            )));
        }
        let (k, m, n_head) = (d[0], d[1], d[2]);
        let mut out = self.alloc(x.rows, n_head * m)?;
        if x.rows == 0 {
            return Ok(out);
        }
        let shape = Self::shape_of(w, m, k, n_head);
        let xb = x.f32().ok_or_else(|| not_f32("matmul_heads"))?;
        let o = out.f32_mut().ok_or_else(|| not_f32("matmul_heads"))?;
        // View x as [rows * n_head, k]: row c = token c / n_head, head c % n_head (its slab).
        if self.fast(&shape) && self.prefill_gemm && x.rows > self.gemvq_max_rows {
            return self
                .gpu
                .matmul_heads_bf16(shape, &w.bytes, xb, x.rows, o)
                .map_err(kerr("matmul_heads"))
                .map(|()| out);
        }
        if self.fast(&shape) {
            let q = self.q8(x, x.rows * n_head, k)?;
            self.heads_gemv_q(shape, w, &q, x.rows, m, o)?;
            return Ok(out);
        }
        let ch = Channels {
            count: x.rows * n_head,
            ids: None,
            x_stride: k,
            x_div: 1,
            y_stride: m,
        };
        self.gpu
            .gemv_batched(shape, &w.bytes, ch, xb, o)
            .map_err(kerr("matmul_heads"))?;
        Ok(out)
    }

    /// On the fast path, steps of up to `gemvq_max_rows` rows take one launch: gemvq's GLU mode
    /// reads gate and up in one pass over the shared q8 activations, the SiLU product formed
    /// in registers. Each output sums the same tasks in the same order as the plain GEMVs when
    /// both split a row over the same warps (bitwise equal then, tested); the GLU kernel's own
    /// register count may make the automatic split differ (f32 summation order only).
    fn glu(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
    ) -> Result<CudaTensor, RuntimeError> {
        let d = &gate.dims;
        let shape = Self::shape_of(gate, d.get(1).copied().unwrap_or(0), x.cols, 1);
        let fused = self.fuse.glu
            && d.len() == 2
            && d[0] == x.cols
            && up.dims == *d
            && (up.ty, up.packed) == (gate.ty, gate.packed)
            && self.fast(&shape)
            && ((1..=self.gemvq_max_rows).contains(&x.rows) || self.mmq(&shape, x.rows));
        if !fused {
            // Also every shape error, reported by the ops as on the CPU.
            let g = self.matmul(x, gate)?;
            let u = self.matmul(x, up)?;
            return self.silu_mul(&g, &u);
        }
        let (k, m) = (d[0], d[1]);
        let q = self.q8(x, x.rows, k)?;
        let mut out = self.alloc(x.rows, m)?;
        let o = out.f32_mut().ok_or_else(|| not_f32("glu"))?;
        // The launch `matmul_into` would take for gate alone, over both matrices.
        self.dense_q(shape, gate, QMode::Glu(&up.bytes), &q, x.rows, m, o, "glu")?;
        Ok(out)
    }

    /// One-row steps on the fast path: one stacked GEMV launch (`Gpu::gemv_q_stacked`) where
    /// the matrices share type, layout and width; each output bitwise what its own launch
    /// gives at the same k-split (the split is chosen for the stack's rows, so summation order
    /// may differ from a lone launch's: f32 order only, within the GEMV's tolerance).
    fn matmul_stacked(
        &self,
        x: &CudaTensor,
        ws: &[&CudaWeight],
    ) -> Result<Vec<CudaTensor>, RuntimeError> {
        let shapes: Vec<MatShape> = ws
            .iter()
            .map(|w| Self::shape_of(w, w.dims.get(1).copied().unwrap_or(0), x.cols, 1))
            .collect();
        let stacked = self.fuse.stack
            && x.rows == 1
            && (2..=kernels::GEMVQ_MAX_STACK).contains(&ws.len())
            && ws.iter().all(|w| w.dims.len() == 2 && w.dims[0] == x.cols)
            && shapes.iter().all(|s| {
                MatShape {
                    rows: shapes[0].rows,
                    ..*s
                } == shapes[0]
                    && self.fast(s)
                    && !self.mmq(s, 1)
            });
        if !stacked {
            return ws.iter().map(|w| self.matmul(x, w)).collect();
        }
        let q = self.q8(x, 1, x.cols)?;
        let mut outs = ws
            .iter()
            .map(|w| self.alloc(1, w.dims[1]))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ys = outs
            .iter_mut()
            .map(|o| o.f32_mut().ok_or_else(|| not_f32("matmul_stacked")))
            .collect::<Result<Vec<_>, _>>()?;
        let mats: Vec<(MatShape, &kernels::CudaSlice<u8>)> =
            shapes.iter().zip(ws).map(|(s, w)| (*s, &w.bytes)).collect();
        self.gpu
            .gemv_q_stacked(&mats, &q, &mut ys)
            .map_err(kerr("matmul_stacked"))?;
        Ok(outs)
    }

    /// On the fast path, steps of up to `gemvq_max_rows` rows add in the GEMV's epilogue
    /// (gemvq's accumulate mode: the plain GEMV's outputs, then one f32 add each; bitwise
    /// `add(acc, matmul(x, w))`, tested).
    fn matmul_add(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        mut acc: CudaTensor,
    ) -> Result<CudaTensor, RuntimeError> {
        let d = &w.dims;
        let shape = Self::shape_of(w, d.get(1).copied().unwrap_or(0), x.cols, 1);
        let fused = self.fuse.add
            && d.len() == 2
            && d[0] == x.cols
            && acc.shape() == (x.rows, d[1])
            && acc.f32().is_some()
            && self.fast(&shape)
            && ((1..=self.gemvq_max_rows).contains(&x.rows) || self.mmq(&shape, x.rows));
        if !fused {
            let y = self.matmul(x, w)?;
            return self.add(&acc, &y);
        }
        let (k, m) = (d[0], d[1]);
        let q = self.q8(x, x.rows, k)?;
        let o = acc.f32_mut().ok_or_else(|| not_f32("matmul_add"))?;
        self.dense_q(shape, w, QMode::Accumulate, &q, x.rows, m, o, "matmul_add")?;
        Ok(acc)
    }

    fn residual_into_norm(&self) -> bool {
        self.fuse.add
    }

    /// One launch (rmsnorm_rope_f32): the latent normalised in place by `rms_norm_lead`'s
    /// code, the key part roped by `rope`'s, the rows written to the cache (f32, or bf16
    /// rounded as `append_rows` rounds): bitwise the composition (tested).
    fn mla_kv_rows(
        &self,
        mut kv_a: CudaTensor,
        w: &CudaWeight,
        n: usize,
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
        cache: Option<&mut CudaTensor>,
    ) -> Result<CudaTensor, RuntimeError> {
        let fits = w.dims == [n]
            && n > 0
            && n <= kv_a.cols
            && self.norm_rope_fits(&kv_a, n, false, positions, p, cache.as_deref());
        if !fits {
            return mla_kv_rows_composed(self, kv_a, w, n, eps, positions, p, cache);
        }
        let wv = self.vector(w, "rms_norm")?.slice(0..n);
        let (dpos, inv, style) = self.rope_inputs(positions, p)?;
        let (pos, freq) = (dpos.view(), inv.view());
        let rope = row_rope(&pos, &freq, style, p);
        let (rows, cols) = (kv_a.rows, kv_a.cols);
        let out = cache.map(|c| self.cache_rows(c, rows)).transpose()?;
        let l = Rows {
            rows,
            n,
            x_stride: cols,
            y_stride: cols,
        };
        let xb = kv_a.f32_mut().ok_or_else(|| not_f32("mla_kv_rows"))?;
        self.gpu
            .rms_norm_rope(xb, cols, Some(&wv), l, eps, rope, out)
            .map_err(kerr("mla_kv_rows"))?;
        Ok(kv_a)
    }

    /// One launch (`kernels::Gpu::mla_norms`) where every job takes its fused path alone
    /// (`rms_norm` with its q8 epilogue as `rms_norm` decides it, `mla_kv_rows`,
    /// `indexer_keys`): bitwise those launches (tested); otherwise the three ops.
    fn mla_norms(
        &self,
        q: Option<(&CudaTensor, &CudaWeight, f32)>,
        kv: KvRowsArgs<'_, CudaTensor, CudaWeight>,
        ix: Option<IndexerKeysArgs<'_, CudaTensor, CudaWeight>>,
        positions: &[u32],
    ) -> Result<MlaNormed<CudaTensor>, RuntimeError> {
        let rows = kv.kv_a.rows;
        let q_fits = q.is_none_or(|(x, w, _)| {
            w.dims == [x.cols] && x.cols > 0 && x.rows == rows && x.f32().is_some()
        });
        let kv_fits = kv.w.dims == [kv.n]
            && kv.n > 0
            && kv.n <= kv.kv_a.cols
            && self.norm_rope_fits(&kv.kv_a, kv.n, false, positions, kv.p, kv.cache.as_deref());
        let ix_fits = ix.as_ref().is_none_or(|a| {
            a.w.dims == [a.k.cols]
                && a.b.dims == [a.k.cols]
                && a.k.rows == rows
                && self.norm_rope_fits(&a.k, 0, true, positions, a.p, a.cache.as_deref())
        });
        if !(self.fuse.norms && q_fits && kv_fits && ix_fits && (q.is_some() || ix.is_some())) {
            return mla_norms_composed(self, q, kv, ix, positions);
        }
        // The q_a norm's operands and output (q8 where `rms_norm` would make it).
        let q_in = match q {
            Some((x, w, eps)) => Some((x, self.vector(w, "rms_norm")?.slice(0..x.cols), eps)),
            None => None,
        };
        let mut q_out = q_in
            .as_ref()
            .map(|(x, _, _)| self.alloc(x.rows, x.cols))
            .transpose()?;
        // The kv rows' operands.
        let KvRowsArgs {
            kv_a: mut kv_t,
            w: kv_w,
            n: kv_n,
            eps: kv_eps,
            p: kv_p,
            cache: kv_cache,
        } = kv;
        let kv_wv = self.vector(kv_w, "rms_norm")?.slice(0..kv_n);
        let (kv_pos, kv_inv, kv_style) = self.rope_inputs(positions, kv_p)?;
        let (kv_pv, kv_fv) = (kv_pos.view(), kv_inv.view());
        let kv_cols = kv_t.cols;
        let kv_rows = kv_cache.map(|c| self.cache_rows(c, rows)).transpose()?;
        // The indexer keys' operands.
        let ix_ri = ix
            .as_ref()
            .map(|a| self.rope_inputs(positions, a.p))
            .transpose()?;
        let ix_views = ix_ri.as_ref().map(|(pos, inv, _)| (pos.view(), inv.view()));
        let mut ix_parts = None;
        if let Some(a) = ix {
            let wv = self.vector(a.w, "layer_norm")?.slice(0..a.k.cols);
            let bv = self.vector(a.b, "layer_norm")?.slice(0..a.k.cols);
            let cache = a.cache.map(|c| self.cache_rows(c, rows)).transpose()?;
            ix_parts = Some((a.k, wv, bv, a.eps, a.p, cache));
        }
        let q8 = {
            let qa = match (&q_in, q_out.as_mut()) {
                (Some((x, wv, eps)), Some(o)) => Some(kernels::QaNorm {
                    x: x.f32().ok_or_else(|| not_f32("mla_norms"))?,
                    w: Some(wv),
                    y: o.f32_mut().ok_or_else(|| not_f32("mla_norms"))?,
                    l: Rows::dense(x.rows, x.cols),
                    eps: *eps,
                    q8: self.q8_epilogue(x.rows, x.cols),
                }),
                _ => None,
            };
            let kvj = kernels::NormRope {
                x: kv_t.f32_mut().ok_or_else(|| not_f32("mla_norms"))?,
                cols: kv_cols,
                w: Some(&kv_wv),
                bias: None,
                l: Rows {
                    rows,
                    n: kv_n,
                    x_stride: kv_cols,
                    y_stride: kv_cols,
                },
                eps: kv_eps,
                rope: row_rope(&kv_pv, &kv_fv, kv_style, kv_p),
                cache: kv_rows,
            };
            let ixj = match (ix_parts.as_mut(), ix_views.as_ref(), ix_ri.as_ref()) {
                (Some((k, wv, bv, eps, p, cache)), Some((pv, fv)), Some((_, _, style))) => {
                    let cols = k.cols;
                    Some(kernels::NormRope {
                        x: k.f32_mut().ok_or_else(|| not_f32("mla_norms"))?,
                        cols,
                        w: Some(&*wv),
                        bias: Some(&*bv),
                        l: Rows::dense(rows, cols),
                        eps: *eps,
                        rope: row_rope(pv, fv, *style, p),
                        cache: cache.take(),
                    })
                }
                _ => None,
            };
            self.gpu
                .mla_norms(qa, kvj, ixj)
                .map_err(kerr("mla_norms"))?
        };
        if let (Some(o), Some(q8)) = (q_out.as_ref(), q8) {
            let _ = o.q8.set(q8);
        }
        Ok((q_out, kv_t, ix_parts.map(|(k, ..)| k)))
    }

    /// One launch (layernorm_rope_f32): `layer_norm`'s code in place, `rope`'s on the normalised
    /// values, the rows written to the cache: bitwise the composition (tested).
    fn indexer_keys(
        &self,
        mut k: CudaTensor,
        w: &CudaWeight,
        b: &CudaWeight,
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
        cache: Option<&mut CudaTensor>,
    ) -> Result<CudaTensor, RuntimeError> {
        let fits = w.dims == [k.cols]
            && b.dims == [k.cols]
            && self.norm_rope_fits(&k, 0, true, positions, p, cache.as_deref());
        if !fits {
            return indexer_keys_composed(self, k, w, b, eps, positions, p, cache);
        }
        let cols = k.cols;
        let wv = self.vector(w, "layer_norm")?.slice(0..cols);
        let bv = self.vector(b, "layer_norm")?.slice(0..cols);
        let (dpos, inv, style) = self.rope_inputs(positions, p)?;
        let (pos, freq) = (dpos.view(), inv.view());
        let rope = row_rope(&pos, &freq, style, p);
        let out = cache.map(|c| self.cache_rows(c, k.rows)).transpose()?;
        let l = Rows::dense(k.rows, cols);
        let xb = k.f32_mut().ok_or_else(|| not_f32("indexer_keys"))?;
        self.gpu
            .layer_norm_rope(xb, Some(&wv), Some(&bv), l, eps, rope, out)
            .map_err(kerr("indexer_keys"))?;
        Ok(k)
    }

    /// On the fast path, steps of up to `gemvq_max_rows` rows take three launches and no
    /// copies: the position-free columns quantized where they lie in `q` (rows of `nope` values
    /// one head width apart), the per-head GEMV writing each head's latent query into its
    /// `kv_lora + rope`-wide output row, the rope columns rotated out of `q` into the rest of
    /// that row (`rope_to`). Bitwise the composition: the same q8 codes, the same GEMV launch,
    /// the in-place rotation's arithmetic (tested).
    fn mla_queries(
        &self,
        q: &CudaTensor,
        k_b: &CudaWeight,
        nope: usize,
        positions: &[u32],
        p: &RopeParams,
    ) -> Result<CudaTensor, RuntimeError> {
        let d = &k_b.dims;
        let (heads, rope) = (p.n_groups, p.group_dim);
        let shape = Self::shape_of(k_b, d.get(1).copied().unwrap_or(0), nope, heads);
        // The whole rope part rotated: the composition copies unrotated columns, this does not.
        let fused = self.fuse.qrope
            && d.len() == 3
            && (d[0], d[2]) == (nope, heads)
            && heads > 0
            && q.cols == heads * (nope + rope)
            && positions.len() == q.rows
            && p.offset == 0
            && p.n_rot == rope
            && rope.is_multiple_of(2)
            && q.f32().is_some()
            && self.fast(&shape)
            && (1..=self.gemvq_max_rows).contains(&q.rows);
        if !fused {
            return mla_queries_composed(self, q, k_b, nope, positions, p);
        }
        let (rows, lat) = (q.rows, d[1]);
        let w = lat + rope;
        let mut out = self.alloc(rows, heads * w)?;
        let qb = q.f32().ok_or_else(|| not_f32("mla_queries"))?;
        let (dpos, inv, style) = self.rope_inputs(positions, p)?;
        let layout = |head: usize, offset: usize| RopeLayout {
            tokens: rows,
            heads,
            tok_stride: heads * head,
            head_stride: head,
            offset,
            n_rot: rope,
        };
        let o = out.f32_mut().ok_or_else(|| not_f32("mla_queries"))?;
        if self.fuse.rope_q8 && nope.is_multiple_of(32) {
            // The rotation writes columns lat.., the GEMV after it columns ..lat.
            let x8 = self
                .gpu
                .rope_q8_to(
                    qb,
                    layout(nope + rope, nope),
                    nope,
                    o,
                    layout(w, lat),
                    &dpos.view(),
                    &inv.view(),
                    style,
                )
                .map_err(kerr("mla_queries"))?;
            self.heads_gemv_q(shape, k_b, &x8, rows, w, o)?;
            return Ok(out);
        }
        let x8 = self
            .gpu
            .quantize_q8(qb, rows * heads, nope, nope + rope)
            .map_err(kerr("mla_queries"))?;
        self.heads_gemv_q(shape, k_b, &x8, rows, w, o)?;
        self.gpu
            .rope_to(
                qb,
                layout(nope + rope, nope),
                o,
                layout(w, lat),
                &dpos.view(),
                &inv.view(),
                style,
            )
            .map_err(kerr("mla_queries"))?;
        Ok(out)
    }

    fn stage_positions(&self, positions: &[u32]) -> Result<(), RuntimeError> {
        // Uploaded now (the cache of recent position lists hands this copy to the step's RoPE
        // launches), so no copy sits between the first layer's kernels.
        if !positions.is_empty() {
            self.positions_u32(positions)?;
        }
        Ok(())
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor, RuntimeError> {
        if table.dims.len() != 2 {
            return Err(err(format!("embed: {} is not 2-D", table.name)));
        }
        let (d, vocab) = (table.dims[0], table.dims[1]);
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(err(format!(
                "token id {bad} out of range (vocabulary {vocab})"
            )));
        }
        let mut out = self.alloc(ids.len(), d)?;
        if ids.is_empty() {
            return Ok(out);
        }
        let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let dids = self.gpu.upload_async(&ids32).map_err(kerr("embed"))?;
        let o = out.f32_mut().ok_or_else(|| not_f32("embed"))?;
        self.gpu
            .get_rows(table.ty, table.packed, &table.bytes, d, &dids, o)
            .map_err(kerr("embed"))?;
        Ok(out)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, RuntimeError> {
        let wv = self.vector(w, "rms_norm")?;
        let g = w.dims[0];
        if g == 0 || !x.cols.is_multiple_of(g) {
            return Err(err(format!(
                "rms_norm: {} columns by {} of {g}",
                x.cols, w.name
            )));
        }
        let mut out = self.alloc(x.rows, x.cols)?;
        let groups = x.rows * (x.cols / g);
        if groups > 0 {
            let wv = wv.slice(0..g);
            let xb = x.f32().ok_or_else(|| not_f32("rms_norm"))?;
            let fuse = g == x.cols && self.q8_epilogue(x.rows, g);
            let o = out.f32_mut().ok_or_else(|| not_f32("rms_norm"))?;
            if fuse {
                let q = self
                    .gpu
                    .rms_norm_q8(xb, Some(&wv), o, Rows::dense(groups, g), eps)
                    .map_err(kerr("rms_norm"))?;
                let _ = out.q8.set(q);
            } else {
                self.gpu
                    .rms_norm(xb, Some(&wv), o, Rows::dense(groups, g), eps)
                    .map_err(kerr("rms_norm"))?;
            }
        }
        Ok(out)
    }

    /// One launch: the sum goes to a new residual tensor, its norm to another.
    fn add_rms_norm(
        &self,
        res: &CudaTensor,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
    ) -> Result<(CudaTensor, CudaTensor), RuntimeError> {
        check_same("add", res.shape(), x.shape())?;
        let wv = self.vector(w, "rms_norm")?;
        let g = w.dims[0];
        if g != x.cols {
            // Grouped norms (several groups per row) keep the two-op form.
            let h = self.add(res, x)?;
            let y = self.rms_norm(&h, w, eps)?;
            return Ok((h, y));
        }
        let mut h = self.alloc(x.rows, x.cols)?;
        let mut y = self.alloc(x.rows, x.cols)?;
        if x.rows > 0 {
            let wv = wv.slice(0..g);
            let xb = x.f32().ok_or_else(|| not_f32("add_rms_norm"))?;
            let rb = res.f32().ok_or_else(|| not_f32("add_rms_norm"))?;
            let hb = h.f32_mut().ok_or_else(|| not_f32("add_rms_norm"))?;
            let fuse = self.q8_epilogue(x.rows, g);
            let yb = y.f32_mut().ok_or_else(|| not_f32("add_rms_norm"))?;
            // The kernel forms x + res; f32 addition commutes, so this is bitwise `add`.
            let l = Rows::dense(x.rows, g);
            if fuse {
                let q = self
                    .gpu
                    .add_rms_norm_to_q8(xb, rb, hb, Some(&wv), yb, l, eps)
                    .map_err(kerr("add_rms_norm"))?;
                let _ = y.q8.set(q);
            } else {
                self.gpu
                    .add_rms_norm_to(xb, rb, hb, Some(&wv), yb, l, eps)
                    .map_err(kerr("add_rms_norm"))?;
            }
        }
        Ok((h, y))
    }

    /// In place (one launch, no copies).
    fn rms_norm_lead(
        &self,
        mut x: CudaTensor,
        w: &CudaWeight,
        n: usize,
        eps: f32,
    ) -> Result<CudaTensor, RuntimeError> {
        let wv = self.vector(w, "rms_norm")?;
        if w.dims[0] != n || n > x.cols || n == 0 {
            return Err(err(format!(
                "rms_norm_lead: {n} of {} columns by {} {:?}",
                x.cols, w.name, w.dims
            )));
        }
        if x.rows > 0 {
            let wv = wv.slice(0..n);
            let l = Rows {
                rows: x.rows,
                n,
                x_stride: x.cols,
                y_stride: x.cols,
            };
            let xb = x.f32_mut().ok_or_else(|| not_f32("rms_norm_lead"))?;
            self.gpu
                .rms_norm_in_place(xb, Some(&wv), l, eps)
                .map_err(kerr("rms_norm"))?;
        }
        Ok(x)
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        b: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, RuntimeError> {
        let (wv, bv) = (self.vector(w, "layer_norm")?, self.vector(b, "layer_norm")?);
        if w.dims[0] != x.cols || b.dims[0] != x.cols {
            return Err(err(format!("layer_norm: {} columns by {}", x.cols, w.name)));
        }
        let mut out = self.alloc(x.rows, x.cols)?;
        if x.rows > 0 {
            let (wv, bv) = (wv.slice(0..x.cols), bv.slice(0..x.cols));
            let xb = x.f32().ok_or_else(|| not_f32("layer_norm"))?;
            let o = out.f32_mut().ok_or_else(|| not_f32("layer_norm"))?;
            self.gpu
                .layer_norm(
                    xb,
                    Some(&wv),
                    Some(&bv),
                    o,
                    Rows::dense(x.rows, x.cols),
                    eps,
                )
                .map_err(kerr("layer_norm"))?;
        }
        Ok(out)
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor, RuntimeError> {
        check_same("add", a.shape(), b.shape())?;
        let mut out = self.alloc(a.rows, a.cols)?;
        let (ab, bb) = (
            a.f32().ok_or_else(|| not_f32("add"))?,
            b.f32().ok_or_else(|| not_f32("add"))?,
        );
        let o = out.f32_mut().ok_or_else(|| not_f32("add"))?;
        self.gpu.add(ab, bb, o, Self::len(a)).map_err(kerr("add"))?;
        Ok(out)
    }

    fn add_bias(&self, x: &CudaTensor, b: &CudaWeight) -> Result<CudaTensor, RuntimeError> {
        let bv = self.vector(b, "add_bias")?;
        if b.dims[0] != x.cols {
            return Err(err(format!(
                "add_bias: {} columns, bias {}",
                x.cols, b.name
            )));
        }
        let mut out = self.alloc(x.rows, x.cols)?;
        let xb = x.f32().ok_or_else(|| not_f32("add_bias"))?;
        let o = out.f32_mut().ok_or_else(|| not_f32("add_bias"))?;
        self.gpu
            .add_bias(xb, bv, o, x.rows, x.cols)
            .map_err(kerr("add_bias"))?;
        Ok(out)
    }

    fn scale(&self, x: &CudaTensor, s: f32) -> Result<CudaTensor, RuntimeError> {
        let mut out = self.alloc(x.rows, x.cols)?;
        let xb = x.f32().ok_or_else(|| not_f32("scale"))?;
        let o = out.f32_mut().ok_or_else(|| not_f32("scale"))?;
        self.gpu
            .scale(xb, s, o, Self::len(x))
            .map_err(kerr("scale"))?;
        Ok(out)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor, RuntimeError> {
        check_same("silu_mul", gate.shape(), up.shape())?;
        let mut out = self.alloc(gate.rows, gate.cols)?;
        if Self::len(gate) > 0 {
            let (gb, ub) = (
                gate.f32().ok_or_else(|| not_f32("silu_mul"))?,
                up.f32().ok_or_else(|| not_f32("silu_mul"))?,
            );
            let o = out.f32_mut().ok_or_else(|| not_f32("silu_mul"))?;
            self.gpu
                .silu_mul(gb, ub, o, Rows3::dense(1, Self::len(gate)))
                .map_err(kerr("silu_mul"))?;
        }
        Ok(out)
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        positions: &[u32],
        p: &RopeParams,
    ) -> Result<(), RuntimeError> {
        check_rope(x.shape(), positions.len(), p)?;
        if x.rows == 0 || p.n_rot == 0 || p.n_groups == 0 {
            return Ok(());
        }
        let (dpos, inv, style) = self.rope_inputs(positions, p)?;
        let layout = RopeLayout {
            tokens: x.rows,
            heads: p.n_groups,
            tok_stride: x.cols,
            head_stride: p.group_dim,
            offset: p.offset,
            n_rot: p.n_rot,
        };
        let xb = x.f32_mut().ok_or_else(|| not_f32("rope"))?;
        self.gpu
            .rope(xb, layout, &dpos.view(), &inv.view(), style)
            .map_err(kerr("rope"))
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        p: &AttnParams,
        selected: Option<&CudaIndex>,
    ) -> Result<CudaTensor, RuntimeError> {
        check_attention(q.shape(), k.shape(), v.shape(), p, selected.map(|s| s.rows))?;
        let n = q.rows;
        let t = k.rows;
        let mut out = self.alloc(n, p.n_head * p.v_dim)?;
        if n == 0 {
            return Ok(out);
        }
        let qb = q.f32().ok_or_else(|| not_f32("attention"))?;
        let sel_view = selected
            .filter(|s| s.cols > 0)
            .map(|s| s.buf.slice(0..s.rows * s.cols));
        let keys = selected.filter(|s| s.cols > 0).map(|s| KeyLists {
            idx: sel_view.as_ref().expect("set with keys"),
            n_keys: s.cols,
            stride: s.cols,
        });
        // Absorbed MLA: one latent head whose values are its first v_dim columns.
        let mla = p.n_kv_head == 1 && std::ptr::eq(k, v) && p.v_dim <= 512 && p.v_dim <= p.k_dim;
        if mla {
            let m = mla_shape(p, n, q.cols, k.cols, t);
            let o = out.f32_mut().ok_or_else(|| not_f32("attention"))?;
            if self.attn_q8(n, p) {
                let q8 = match &k.store {
                    Store::F32(kb) => self.gpu.mla_attention_q8(qb, kb, keys, o, m),
                    Store::Bf16(kb) => self.gpu.mla_attention_q8(qb, kb, keys, o, m),
                }
                .map_err(kerr("attention"))?;
                let _ = out.q8.set(q8);
                return Ok(out);
            }
            match &k.store {
                Store::F32(kb) => self.gpu.mla_attention(qb, kb, keys, o, m),
                Store::Bf16(kb) => self.gpu.mla_attention(qb, kb, keys, o, m),
            }
            .map_err(kerr("attention"))?;
            return Ok(out);
        }
        let shape = AttnShape {
            tokens: n,
            heads: p.n_head,
            kv_heads: p.n_kv_head,
            d_k: p.k_dim,
            d_v: p.v_dim,
            q_tok_stride: q.cols,
            q_head_stride: p.k_dim,
            k_stride: k.cols,
            v_stride: v.cols,
            kv_len: t,
            o_tok_stride: p.n_head * p.v_dim,
            o_head_stride: p.v_dim,
            scale: p.scale,
            pos0: p.pos0,
        };
        self.with_f32(k, |kb| {
            self.with_f32(v, |vb| {
                let o = out.f32_mut().ok_or_else(|| not_f32("attention"))?;
                self.gpu
                    .attention(qb, kb, vb, keys, o, shape)
                    .map_err(kerr("attention"))
            })
        })?;
        Ok(out)
    }

    fn attention_seqs(
        &self,
        q: &CudaTensor,
        seqs: &[SeqAttn<'_, Self>],
        p: &AttnParams,
    ) -> Result<CudaTensor, RuntimeError> {
        let counts: Vec<usize> = seqs.iter().map(|s| s.rows).collect();
        check_seq_rows("attention_seqs", q.rows, &counts, seqs.len())?;
        let first = seqs[0].k;
        let bf16 = seqs.iter().all(|s| matches!(s.k.store, Store::Bf16(_)));
        let f32 = seqs.iter().all(|s| matches!(s.k.store, Store::F32(_)));
        let widths: Vec<usize> = seqs
            .iter()
            .filter_map(|s| s.selected.filter(|x| x.cols > 0).map(|x| x.cols))
            .collect();
        // Absorbed MLA (one latent head whose values are its first v_dim columns), every cache
        // of one width and element type, key lists of one length: one launch for the batch.
        let mla = seqs.len() > 1
            && self.fusions().seqs
            && p.n_kv_head == 1
            && p.v_dim <= 512
            && p.v_dim <= p.k_dim
            && (bf16 || f32)
            && widths.windows(2).all(|w| w[0] == w[1])
            && seqs
                .iter()
                .all(|s| std::ptr::eq(s.k, s.v) && s.k.cols == first.cols && s.rows > 0);
        if !mla {
            return attention_seqs_composed(self, q, seqs, p);
        }
        for s in seqs {
            let ps = AttnParams { pos0: s.pos0, ..*p };
            check_attention(
                (s.rows, q.cols),
                s.k.shape(),
                s.v.shape(),
                &ps,
                s.selected.map(|x| x.rows),
            )?;
        }
        let n = q.rows;
        let mut out = self.alloc(n, p.n_head * p.v_dim)?;
        // Each sequence brings its own cache length and position (`Gpu::mla_attention_seqs`).
        let m = mla_shape(&AttnParams { pos0: 0, ..*p }, n, q.cols, first.cols, 0);
        let lists: Vec<Option<(kernels::CudaView<'_, i32>, usize)>> = seqs
            .iter()
            .map(|s| {
                s.selected
                    .filter(|x| x.cols > 0)
                    .map(|x| (x.buf.slice(0..x.rows * x.cols), x.cols))
            })
            .collect();
        fn mla_seqs<'a, C: CacheElem>(
            seqs: &'a [SeqAttn<'_, CudaBackend>],
            lists: &'a [Option<(kernels::CudaView<'_, i32>, usize)>],
            pick: impl Fn(&'a Store) -> Option<&'a DevBuf<C>>,
        ) -> Vec<MlaSeq<'a, C>> {
            seqs.iter()
                .zip(lists)
                .filter_map(|(s, l)| {
                    pick(&s.k.store).map(|b| MlaSeq {
                        kv: b.slice(0..CudaBackend::len(s.k)),
                        kv_len: s.k.rows,
                        tokens: s.rows,
                        pos0: s.pos0,
                        keys: l.as_ref().map(|(v, w)| KeyLists {
                            idx: v,
                            n_keys: *w,
                            stride: *w,
                        }),
                    })
                })
                .collect()
        }
        let qb = q.f32().ok_or_else(|| not_f32("attention_seqs"))?;
        let o = out.f32_mut().ok_or_else(|| not_f32("attention_seqs"))?;
        let with_q8 = self.attn_q8(n, p);
        let q8 = if bf16 {
            let ms = mla_seqs(seqs, &lists, |s| match s {
                Store::Bf16(b) => Some(b),
                Store::F32(_) => None,
            });
            if with_q8 {
                self.gpu.mla_attention_seqs_q8(qb, &ms, o, m).map(Some)
            } else {
                self.gpu.mla_attention_seqs(qb, &ms, o, m).map(|()| None)
            }
        } else {
            let ms = mla_seqs(seqs, &lists, |s| match s {
                Store::F32(b) => Some(b),
                Store::Bf16(_) => None,
            });
            if with_q8 {
                self.gpu.mla_attention_seqs_q8(qb, &ms, o, m).map(Some)
            } else {
                self.gpu.mla_attention_seqs(qb, &ms, o, m).map(|()| None)
            }
        }
        .map_err(kerr("attention_seqs"))?;
        if let Some(q8) = q8 {
            let _ = out.q8.set(q8);
        }
        Ok(out)
    }

    fn indexer_topk(
        &self,
        q: &CudaTensor,
        weights: &CudaTensor,
        keys: &CudaTensor,
        p: &IndexerParams,
    ) -> Result<CudaIndex, RuntimeError> {
        check_indexer(q.shape(), weights.shape(), keys.shape(), p)?;
        let n = q.rows;
        let t = keys.rows;
        let kk = p.top_k;
        let mut sel = self.index(n, kk)?;
        if n == 0 {
            return Ok(sel);
        }
        let pos: Vec<i32> = (0..n)
            .map(|i| i32::try_from(p.pos0 + i).map_err(|_| err("indexer_topk: position too large")))
            .collect::<Result<_, _>>()?;
        let dpos = self.positions(&pos)?;
        let mut scores = self.gpu.alloc::<f32>(n * t).map_err(kerr("indexer_topk"))?;
        let sh = IndexerShape {
            tokens: n,
            heads: p.n_head,
            dim: p.head_dim,
            q_stride: q.cols,
            k_stride: keys.cols,
            kv_len: t,
            w_stride: weights.cols,
            out_stride: t,
            scale: p.scale,
        };
        let (qb, wb) = (
            q.f32().ok_or_else(|| not_f32("indexer_topk"))?,
            weights.f32().ok_or_else(|| not_f32("indexer_topk"))?,
        );
        let pos_v = dpos.view();
        match &keys.store {
            Store::F32(kb) => self.gpu.indexer_scores(qb, kb, wb, &pos_v, &mut scores, sh),
            Store::Bf16(kb) => self.gpu.indexer_scores(qb, kb, wb, &pos_v, &mut scores, sh),
        }
        .map_err(kerr("indexer_topk"))?;
        self.gpu
            .topk(&scores, n, t, t, kk, &mut sel.buf, None)
            .map_err(kerr("indexer_topk"))?;
        Ok(sel)
    }

    fn moe_route(
        &self,
        logits: &CudaTensor,
        bias: Option<&CudaWeight>,
        p: &RouteParams,
    ) -> Result<(CudaTensor, CudaIndex), RuntimeError> {
        let e = p.n_expert;
        let bias_v = bias.map(|b| self.vector(b, "moe_route")).transpose()?;
        check_route(logits.shape(), bias.map(|b| b.dims[0]), p)?;
        let k = p.n_used;
        let mut w = self.alloc(logits.rows, k)?;
        let mut ids = self.index(logits.rows, k)?;
        if logits.rows > 0 {
            let cfg = RouterConfig {
                gating: match p.gating {
                    Gating::Sigmoid => kernels::Gating::Sigmoid,
                    Gating::Softmax => kernels::Gating::Softmax,
                },
                n_experts: e,
                n_group: p.n_group,
                topk_group: p.n_group_used,
                top_k: k,
                norm: p.normalize,
                scale: p.scale,
            };
            let bview = bias_v.map(|b| b.slice(0..e));
            let lb = logits.f32().ok_or_else(|| not_f32("moe_route"))?;
            let wo = w.f32_mut().ok_or_else(|| not_f32("moe_route"))?;
            self.gpu
                .moe_route(lb, logits.rows, e, bview.as_ref(), cfg, &mut ids.buf, wo)
                .map_err(kerr("moe_route"))?;
        }
        Ok((w, ids))
    }

    /// One token on the fast path with the shared expert in the routed experts' type and
    /// shapes: 3 launches (GLU over the routed and the shared expert, one quantize, down +
    /// weighted sum + shared down); otherwise the routed MoE then the shared expert.
    fn moe_ffn_shared(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
        weights: &CudaTensor,
        experts: &CudaIndex,
        shared: (&CudaWeight, &CudaWeight, &CudaWeight),
    ) -> Result<CudaTensor, RuntimeError> {
        let (sg, su, sd) = shared;
        let same = |s: &CudaWeight, r: &CudaWeight| {
            s.ty == r.ty && s.packed == r.packed && s.dims.len() == 2 && s.dims[..] == r.dims[..2]
        };
        let (d, ff, n_exp) = (x.cols, gate.dims.get(1).copied(), gate.dims.get(2).copied());
        let fused = self.fusions().shared
            && x.rows == 1
            && experts.rows == 1
            && experts.cols > 0
            && gate.dims.len() == 3
            && gate.ty == up.ty
            && gate.packed == up.packed
            && same(sg, gate)
            && same(su, up);
        if let (true, Some(ff), Some(n_exp)) = (fused, ff, n_exp) {
            let g_shape = Self::shape_of(gate, ff, d, n_exp);
            let d_shape = Self::shape_of(down, d, ff, n_exp);
            // A shared down projection of another type (GLM-5's files: Q6_K against the
            // routed Q4_K) cannot ride the down + weighted-sum launch; its gate and up still
            // ride the GLU launch, and it reads its activations' q8 row from theirs.
            let down_alone = !same(sd, down);
            let sd_ok =
                !down_alone || (sd.dims[..] == [ff, d] && self.fast(&Self::shape_of(sd, d, ff, 1)));
            if self.fast(&g_shape) && self.fast(&d_shape) && sd_ok {
                check_moe_ffn(
                    x.shape(),
                    &gate.dims,
                    &up.dims,
                    &down.dims,
                    weights.shape(),
                    (experts.rows, experts.cols),
                )?;
                let mut out = self.alloc(1, d)?;
                self.moe_one_token(
                    x,
                    (gate, up, down),
                    Some((sg, su, sd, down_alone)),
                    weights,
                    experts,
                    &mut out,
                )?;
                return Ok(out);
            }
        }
        let y = self.moe_ffn(x, gate, up, down, weights, experts)?;
        self.matmul_add(&self.glu(x, sg, su)?, sd, y)
    }

    fn moe_ffn(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
        weights: &CudaTensor,
        experts: &CudaIndex,
    ) -> Result<CudaTensor, RuntimeError> {
        let (gd, ud, dd) = (&gate.dims, &up.dims, &down.dims);
        check_moe_ffn(
            x.shape(),
            gd,
            ud,
            dd,
            weights.shape(),
            (experts.rows, experts.cols),
        )?;
        let (d, ff, n_exp) = (x.cols, gd[1], gd[2]);
        let kk = experts.cols;
        let mut out = self.alloc(x.rows, d)?;
        if x.rows == 0 || kk == 0 {
            return Ok(out);
        }
        let g_shape = Self::shape_of(gate, ff, d, n_exp);
        let u_shape = Self::shape_of(up, ff, d, n_exp);
        let d_shape = Self::shape_of(down, d, ff, n_exp);
        let fast = self.fast(&g_shape)
            && self.fast(&d_shape)
            && gate.ty == up.ty
            && gate.packed == up.packed;
        let mmq = fast && self.mmq_moe(&g_shape, x.rows) && self.mmq_moe(&d_shape, x.rows);
        if fast && !mmq && self.prefill_gemm && x.rows > self.gemvq_max_rows {
            self.moe_ffn_gemm(x, gate, up, down, weights, experts, &mut out)?;
        } else if fast {
            self.moe_ffn_fast(x, gate, up, down, weights, experts, &mut out, mmq)?;
        } else {
            self.moe_ffn_exact(
                x,
                (gate, g_shape),
                (up, u_shape),
                (down, d_shape),
                weights,
                experts,
                &mut out,
            )?;
        }
        Ok(out)
    }

    /// On the device (kernels/cuda/sample.cu); only the ids are copied back.
    fn sample(
        &self,
        logits: &CudaTensor,
        reqs: &[SampleRequest],
    ) -> Result<Vec<(u32, bool)>, RuntimeError> {
        check_sample(logits.rows, logits.cols, reqs.len())?;
        if !self.device_sampling {
            let host = self.to_host(logits)?;
            return Ok(crate::sampling::sample_host(&host, logits.cols, reqs));
        }
        let lb = logits.f32().ok_or_else(|| not_f32("sample"))?;
        let params: Vec<kernels::SampleParams> = reqs.iter().map(device_sample_params).collect();
        let mut ids = self.gpu.alloc::<i32>(reqs.len()).map_err(kerr("sample"))?;
        self.gpu
            .sample(lb, logits.rows, logits.cols, logits.cols, &params, &mut ids)
            .map_err(kerr("sample"))?;
        let raw = self.gpu.download(&ids).map_err(kerr("sample"))?;
        Ok(raw.into_iter().map(kernels::sampled_id).collect())
    }

    fn local_expert_ids(
        &self,
        ids: CudaIndex,
        first: usize,
        count: usize,
    ) -> Result<CudaIndex, RuntimeError> {
        comm::local_expert_ids(self, ids, first, count)
    }
}

impl CudaBackend {
    /// One token's MoE on the fast path, into `out`: gate + up + SiLU over its selected experts
    /// (with `shared`, the shared expert as the launch's last channel: same type and shapes,
    /// checked by the caller), one quantize, then down + weighted sum (+ the shared down) in
    /// one launch. `shared`'s flag: its down projection is of another type than the routed
    /// ones' (shapes checked by the caller), so it runs as its own accumulating GEMV after the
    /// weighted sum, on the q8 row the quantize launch made of its activations.
    #[allow(clippy::too_many_arguments)]
    fn moe_one_token(
        &self,
        x: &CudaTensor,
        (gate, up, down): (&CudaWeight, &CudaWeight, &CudaWeight),
        shared: Option<(&CudaWeight, &CudaWeight, &CudaWeight, bool)>,
        weights: &CudaTensor,
        experts: &CudaIndex,
        out: &mut CudaTensor,
    ) -> Result<(), RuntimeError> {
        let (d, ff, n_exp) = (x.cols, gate.dims[1], gate.dims[2]);
        let kk = experts.cols;
        let g_shape = Self::shape_of(gate, ff, d, n_exp);
        let d_shape = Self::shape_of(down, d, ff, n_exp);
        let q = self.q8(x, 1, d)?;
        let wb = weights.f32().ok_or_else(|| not_f32("moe_ffn"))?;
        let wv = wb.slice(0..kk);
        let ids = experts.buf.slice(0..kk);
        // Rows 0..kk: the routed experts' activations in slot order, row kk: the shared one's.
        let rows = kk + usize::from(shared.is_some());
        let mut act = self.gpu.alloc::<f32>(rows * ff).map_err(kerr("moe_ffn"))?;
        let ch = QChannels {
            count: rows,
            ncols: 1,
            ids: Some(&ids),
            xidx: None,
            x_div: rows,
            yidx: None,
            y_stride: ff,
            y_rows: rows,
        };
        self.gpu
            .gemv_q_shared(
                g_shape,
                &gate.bytes,
                QMode::Glu(&up.bytes),
                ch,
                &q,
                &mut act,
                shared.map(|(sg, su, _, _)| (&sg.bytes, Some(&su.bytes))),
            )
            .map_err(kerr("moe_ffn gate+up"))?;
        let qa = self
            .gpu
            .quantize_q8(&act, rows, ff, ff)
            .map_err(kerr("moe_ffn"))?;
        let ch = QChannels {
            count: 1,
            ncols: 1,
            ids: Some(&ids),
            xidx: None,
            x_div: 1,
            yidx: None,
            y_stride: d,
            y_rows: 1,
        };
        let mode = QMode::Combine {
            weights: &wv,
            topk: kk,
        };
        let o = out.f32_mut().ok_or_else(|| not_f32("moe_ffn"))?;
        self.gpu
            .gemv_q_shared(
                d_shape,
                &down.bytes,
                mode,
                ch,
                &qa,
                o,
                shared
                    .filter(|s| !s.3)
                    .map(|(_, _, sd, _)| (&sd.bytes, None)),
            )
            .map_err(kerr("moe_ffn down"))?;
        let Some((_, _, sd, true)) = shared else {
            return Ok(());
        };
        // The shared expert's activations are q8 row kk: `matmul_add`'s launch, that row read.
        let row = self.row_map(kk)?;
        let rv = row.view();
        let ch = QChannels {
            count: 1,
            ncols: 1,
            ids: None,
            xidx: Some(&rv),
            x_div: 1,
            yidx: None,
            y_stride: d,
            y_rows: 1,
        };
        let shape = Self::shape_of(sd, d, ff, 1);
        self.gpu
            .gemv_q(shape, &sd.bytes, QMode::Accumulate, ch, &qa, o)
            .map_err(kerr("moe_ffn shared down"))
    }

    /// The fast MoE: one token: fused gate+up+SiLU over its selected experts, then down +
    /// weighted sum in one launch. Several tokens: (token, slot) pairs grouped by expert on
    /// the device, grouped GLU and down launches (each expert's weights read once per tile of
    /// its tokens), then the weighted sum in slot order. Without `mmq` the tiles are the
    /// 8-column GEMVs'; with it the tensor-core product takes 8-column tiles for the experts
    /// with few tokens and tiles up to 64 columns wide for the others
    /// ([`kernels::moe_mmq_tile`]): two launches per matrix.
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn_fast(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
        weights: &CudaTensor,
        experts: &CudaIndex,
        out: &mut CudaTensor,
        mmq: bool,
    ) -> Result<(), RuntimeError> {
        let (d, ff, n_exp) = (x.cols, gate.dims[1], gate.dims[2]);
        let (n, kk) = (x.rows, experts.cols);
        if n == 1 {
            return self.moe_one_token(x, (gate, up, down), None, weights, experts, out);
        }
        let g_shape = Self::shape_of(gate, ff, d, n_exp);
        let d_shape = Self::shape_of(down, d, ff, n_exp);
        let q = self.q8(x, n, d)?;
        let wb = weights.f32().ok_or_else(|| not_f32("moe_ffn"))?;
        let wv = wb.slice(0..n * kk);
        let ids = experts.buf.slice(0..n * kk);
        let mut act = self
            .gpu
            .alloc::<f32>(n * kk * ff)
            .map_err(kerr("moe_ffn"))?;
        let o = out.f32_mut().ok_or_else(|| not_f32("moe_ffn"))?;
        // The wide tile set only on the tensor cores (the GEMVs take at most 8 columns).
        let wide = if mmq {
            match self.moe_tile {
                Some(w) => (w > kernels::MOE_TILE).then_some(w),
                None => kernels::moe_mmq_tile(n),
            }
        } else {
            None
        };
        let g = self
            .gpu
            .moe_group(&ids, n * kk, kk, n_exp, wide)
            .map_err(kerr("moe_ffn group"))?;
        // One launch per tile set and matrix: the sets write disjoint sorted rows.
        for set in &g.sets {
            let (te, tok, pos) = (set.tile_expert.view(), set.tok.view(), set.pos.view());
            let ch = QChannels {
                count: set.max_tiles,
                ncols: set.width,
                ids: Some(&te),
                xidx: Some(&tok),
                x_div: 1,
                yidx: Some(&pos),
                y_stride: ff,
                y_rows: n * kk,
            };
            self.int_dot(
                mmq,
                g_shape,
                &gate.bytes,
                QMode::Glu(&up.bytes),
                ch,
                &q,
                &mut act,
            )
            .map_err(kerr("moe_ffn gate+up"))?;
        }
        let qa = self
            .gpu
            .quantize_q8(&act, n * kk, ff, ff)
            .map_err(kerr("moe_ffn"))?;
        let mut y = self.gpu.alloc::<f32>(n * kk * d).map_err(kerr("moe_ffn"))?;
        for set in &g.sets {
            let (te, pos, pair) = (set.tile_expert.view(), set.pos.view(), set.pair.view());
            let ch = QChannels {
                count: set.max_tiles,
                ncols: set.width,
                ids: Some(&te),
                xidx: Some(&pos),
                x_div: 1,
                yidx: Some(&pair),
                y_stride: d,
                y_rows: n * kk,
            };
            self.int_dot(mmq, d_shape, &down.bytes, QMode::Plain, ch, &qa, &mut y)
                .map_err(kerr("moe_ffn down"))?;
        }
        self.gpu
            .moe_combine(&y, d, &wv, n, kk, d, o, d, false, Some(&ids))
            .map_err(kerr("moe_ffn combine"))
    }

    /// Prefill MoE on the tensor cores: the routing read back once (a prefill step syncs
    /// anyway), then per expert in id order its (token, slot) pairs in pair order: gather the
    /// tokens, gate and up as bf16 GEMMs on the expert's dequantized slab, SiLU * up, down GEMM
    /// into that expert's run of a pair-sorted buffer; the rows put back in pair order and the
    /// weighted sum in slot order (moe_combine, skipping `-1` slots). Deterministic: fixed
    /// order, no atomics. Its error is one bf16 GEMM per matmul, within check.rs's budget.
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn_gemm(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
        weights: &CudaTensor,
        experts: &CudaIndex,
        out: &mut CudaTensor,
    ) -> Result<(), RuntimeError> {
        let (d, ff, n_exp) = (x.cols, gate.dims[1], gate.dims[2]);
        let (n, kk) = (x.rows, experts.cols);
        let (g_shape, u_shape, d_shape) = (
            Self::shape_of(gate, ff, d, n_exp),
            Self::shape_of(up, ff, d, n_exp),
            Self::shape_of(down, d, ff, n_exp),
        );
        let (_, _, ids) = self.index_to_host(experts)?;
        let mut by_e: Vec<Vec<usize>> = vec![Vec::new(); n_exp];
        for (p, &e) in ids.iter().enumerate() {
            if let Some(v) = usize::try_from(e).ok().and_then(|e| by_e.get_mut(e)) {
                v.push(p);
            }
        }
        let xb = x.f32().ok_or_else(|| not_f32("moe_ffn"))?;
        let g = &self.gpu;
        let most = by_e.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut xe = g.alloc::<f32>(most * d).map_err(kerr("moe_ffn"))?;
        let mut ge = g.alloc::<f32>(most * ff).map_err(kerr("moe_ffn"))?;
        let mut ue = g.alloc::<f32>(most * ff).map_err(kerr("moe_ffn"))?;
        // Expert outputs in (expert, pair) order; `at[p]` = the row of pair p.
        let mut ys = g
            .alloc::<f32>((n * kk).max(1) * d)
            .map_err(kerr("moe_ffn"))?;
        let mut at = vec![0usize; n * kk];
        let mut row0 = 0usize;
        for (e, pairs) in by_e.iter().enumerate() {
            let m = pairs.len();
            if m == 0 {
                continue;
            }
            let toks: Vec<usize> = pairs.iter().map(|p| p / kk).collect();
            g.gather_rows(xb, n, d, &toks, &mut xe)
                .map_err(kerr("moe_ffn gather"))?;
            g.matmul_bf16_slab(g_shape, e, &gate.bytes, &xe, m, &mut ge)
                .map_err(kerr("moe_ffn gate"))?;
            g.matmul_bf16_slab(u_shape, e, &up.bytes, &xe, m, &mut ue)
                .map_err(kerr("moe_ffn up"))?;
            let mut act = g.alloc::<f32>(m * ff).map_err(kerr("moe_ffn"))?;
            g.silu_mul(&ge, &ue, &mut act, Rows3::dense(m, ff))
                .map_err(kerr("moe_ffn act"))?;
            let mut ye = ys.slice_mut(row0 * d..(row0 + m) * d);
            g.matmul_bf16_slab(d_shape, e, &down.bytes, &act, m, &mut ye)
                .map_err(kerr("moe_ffn down"))?;
            for (j, &p) in pairs.iter().enumerate() {
                at[p] = row0 + j;
            }
            row0 += m;
        }
        // Pairs of other ranks' experts (-1) point at row 0 and are skipped by moe_combine
        // (which writes zeros where a token has no pair at all).
        let y = if row0 == 0 {
            ys
        } else {
            let mut y = g.alloc::<f32>(n * kk * d).map_err(kerr("moe_ffn"))?;
            g.gather_rows(&ys, row0, d, &at, &mut y)
                .map_err(kerr("moe_ffn gather"))?;
            y
        };
        let wb = weights.f32().ok_or_else(|| not_f32("moe_ffn"))?;
        let (wv, idv) = (wb.slice(0..n * kk), experts.buf.slice(0..n * kk));
        let o = out.f32_mut().ok_or_else(|| not_f32("moe_ffn"))?;
        g.moe_combine(&y, d, &wv, n, kk, d, o, d, false, Some(&idv))
            .map_err(kerr("moe_ffn combine"))
    }

    /// The exact MoE: f32 channel-batched GEMVs per (token, slot), SiLU, weighted sum.
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn_exact(
        &self,
        x: &CudaTensor,
        (gate, g_shape): (&CudaWeight, MatShape),
        (up, u_shape): (&CudaWeight, MatShape),
        (down, d_shape): (&CudaWeight, MatShape),
        weights: &CudaTensor,
        experts: &CudaIndex,
        out: &mut CudaTensor,
    ) -> Result<(), RuntimeError> {
        let (d, ff) = (x.cols, g_shape.rows);
        let (n, kk) = (x.rows, experts.cols);
        let nch = n * kk;
        let xb = x.f32().ok_or_else(|| not_f32("moe_ffn"))?;
        let wb = weights.f32().ok_or_else(|| not_f32("moe_ffn"))?;
        let ids = experts.buf.slice(0..nch);
        let mut g = self.gpu.alloc::<f32>(nch * ff).map_err(kerr("moe_ffn"))?;
        let mut u = self.gpu.alloc::<f32>(nch * ff).map_err(kerr("moe_ffn"))?;
        let ch_in = Channels {
            count: nch,
            ids: Some(&ids),
            x_stride: d,
            x_div: kk,
            y_stride: ff,
        };
        self.gpu
            .gemv_batched(g_shape, &gate.bytes, ch_in, xb, &mut g)
            .map_err(kerr("moe_ffn gate"))?;
        self.gpu
            .gemv_batched(u_shape, &up.bytes, ch_in, xb, &mut u)
            .map_err(kerr("moe_ffn up"))?;
        let mut a = self.gpu.alloc::<f32>(nch * ff).map_err(kerr("moe_ffn"))?;
        self.gpu
            .silu_mul(&g, &u, &mut a, Rows3::dense(nch, ff))
            .map_err(kerr("moe_ffn act"))?;
        let mut y = self.gpu.alloc::<f32>(nch * d).map_err(kerr("moe_ffn"))?;
        let ch_down = Channels {
            count: nch,
            ids: Some(&ids),
            x_stride: ff,
            x_div: 1,
            y_stride: d,
        };
        self.gpu
            .gemv_batched(d_shape, &down.bytes, ch_down, &a, &mut y)
            .map_err(kerr("moe_ffn down"))?;
        let ws = wb.slice(0..nch);
        let o = out.f32_mut().ok_or_else(|| not_f32("moe_ffn"))?;
        self.gpu
            .moe_combine(&y, d, &ws, n, kk, d, o, d, false, Some(&ids))
            .map_err(kerr("moe_ffn combine"))
    }
}

/// Open a GGUF model of a supported architecture on CUDA device `ordinal`.
/// A request in the kernel's form: NaN temperature is greedy (as on the host), `u` rounded into
/// [0, 1) in f32, a top-k beyond i32 means no cut, NaN min-p none.
fn device_sample_params(r: &SampleRequest) -> kernels::SampleParams {
    let p = &r.params;
    kernels::SampleParams {
        temperature: if p.temperature.is_nan() {
            0.0
        } else {
            p.temperature
        },
        top_k: i32::try_from(p.top_k).unwrap_or(0),
        top_p: if p.top_p.is_nan() { 1.0 } else { p.top_p },
        u: (r.u.clamp(0.0, 1.0) as f32).min(1.0 - f32::EPSILON / 2.0),
        min_p: if p.min_p.is_nan() { 0.0 } else { p.min_p },
    }
}

pub fn load_cuda(
    model: Arc<gguf::Model>,
    ordinal: usize,
) -> Result<crate::glm::GlmModel<CudaBackend>, RuntimeError> {
    crate::glm::GlmModel::load(CudaBackend::new(ordinal)?, model)
}

/// As [`load_cuda`] with explicit numerical options.
pub fn load_cuda_with(
    model: Arc<gguf::Model>,
    ordinal: usize,
    opts: CudaOptions,
) -> Result<crate::glm::GlmModel<CudaBackend>, RuntimeError> {
    crate::glm::GlmModel::load(CudaBackend::with_options(ordinal, opts)?, model)
}
