//! Absorbed MLA attention over the shared latent cache (GLM-5 / DeepSeek), reading each latent
//! row once per token for all query heads (kernels/cuda/mla.cu), then merging the key splits
//! with the attention op's combine kernel. Same math and masking as [`Gpu::attention`] with one
//! KV head whose values are the first `d_v` columns of the key rows; f32 arithmetic throughout
//! (the cache may be stored as bf16, widened on load).

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};

use crate::attention::KeyLists;
use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::gemvq::Q8Act;
use crate::launch::{check_query_span, shape_err};
use crate::ops::Op;

/// Keys per shared-memory tile (mla.cu's MLA_KT).
const KT: usize = 32;
/// Steps of up to this many query tokens stage their queries in shared memory (decode, MTP
/// verification).
const STAGE_Q_MAX_TOKENS: usize = 8;
/// attention.cu's COMBINE_MAX_SPLITS.
const COMBINE_MAX_SPLITS: usize = 1024;
/// Budget for the split partials of one launch group; more tokens are processed in groups.
const SCRATCH_BYTES: usize = 256 << 20;

/// Element type of a latent cache: f32, or bf16 stored as `u16` bit patterns.
pub trait CacheElem: DeviceRepr {
    const BF16: bool;
}
impl CacheElem for f32 {
    const BF16: bool = false;
}
impl CacheElem for u16 {
    const BF16: bool = true;
}

/// Shapes and strides of one MLA call (elements).
#[derive(Debug, Clone, Copy)]
pub struct MlaShape {
    /// Query tokens S and heads H.
    pub tokens: usize,
    pub heads: usize,
    /// Key width D (kv_lora + rope, 576 for GLM-5) and value width Dv (<= 512, <= D).
    pub d: usize,
    pub d_v: usize,
    /// q of token s, head h at `s * q_tok_stride + h * q_head_stride`.
    pub q_tok_stride: usize,
    pub q_head_stride: usize,
    /// Cache row t at `t * kv_stride`; T valid rows.
    pub kv_stride: usize,
    pub kv_len: usize,
    /// Output of token s, head h at `s * o_tok_stride + h * o_head_stride`.
    pub o_tok_stride: usize,
    pub o_head_stride: usize,
    pub scale: f32,
    /// Position of query 0 (query s sees keys `t <= pos0 + s`).
    pub pos0: usize,
}

/// The kernel parameter (`struct MlaP` in mla.cu), public for the CPU-emulation tests, which
/// launch the kernels with it (kernels/emu/tests). Pointers are device addresses; element
/// strides; `pos` (per-token positions, 0 = `pos0 + s`), `idx` (key lists, 0 = dense), `part`
/// (split partials) and `o` (direct output of a one-split launch) may be 0.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MlaParams {
    pub q: u64,
    pub q_tok: i64,
    pub q_head: i64,
    pub kv: u64,
    pub kv_stride: i64,
    pub d: i32,
    pub dv: i32,
    pub h: i32,
    pub t: i32,
    pub pos: u64,
    pub pos0: i32,
    pub idx: u64,
    pub idx_stride: i64,
    pub n_keys: i32,
    pub split_len: i32,
    pub scale: f32,
    pub n_split: i32,
    pub heads_per_block: i32,
    pub stage_q: i32,
    pub part: u64,
    pub o: u64,
    pub o_tok: i64,
    pub o_head: i64,
    /// Per-token [`MlaRow`]s of a batched step (0: every token reads `kv`, `t`, `idx`, `pos`).
    pub rows: u64,
}

// SAFETY: plain struct laid out exactly as `struct MlaP` in mla.cu.
unsafe impl DeviceRepr for MlaParams {}

/// What one query token of a batched step reads (`struct MlaRow` in mla.cu): its sequence's
/// cache (device address), key list (0 = dense causal), cache length and position.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MlaRow {
    pub kv: u64,
    pub idx: u64,
    pub t: i32,
    pub pos: i32,
}

// SAFETY: plain struct laid out exactly as `struct MlaRow` in mla.cu.
unsafe impl DeviceRepr for MlaRow {}

/// One sequence of a batched MLA call ([`Gpu::mla_attention_seqs`]): its next `tokens` query
/// rows (consecutive in q and o, sequences in order) at positions `pos0 ..`, its cache of
/// `kv_len` rows, its key lists (one row per query token) or dense causal keys.
pub struct MlaSeq<'a, C> {
    pub kv: cudarc::driver::CudaView<'a, C>,
    pub kv_len: usize,
    pub tokens: usize,
    pub pos0: usize,
    pub keys: Option<KeyLists<'a>>,
}

/// Where a call's q8 activations go (the device addresses of a [`Q8Act`]'s codes and records;
/// rows of `k` = d_v values, row `s * heads + h` for token s, head h, quantize.cu's layout).
#[derive(Debug, Clone, Copy)]
struct Q8Out {
    qs: u64,
    qd: u64,
    k: usize,
}

impl Q8Out {
    /// The outputs from row `r0` on (a token group's first row).
    fn at_row(self, r0: usize) -> Q8Out {
        let at = r0 * self.k;
        Q8Out {
            qs: self.qs + at as u64,
            qd: self.qd + (8 * (at / 32)) as u64,
            k: self.k,
        }
    }
}

/// attn_combine_f32's block size (a multiple of 32, as its q8 epilogue needs).
const COMBINE_THREADS: u32 = 256;
const _: () = assert!(COMBINE_THREADS.is_multiple_of(32));

/// Where a launch's tokens read keys: one cache and list block, or the per-token rows (whose
/// key lists are `n_keys` long; a launch's `n_eff` is then the longest token's key count).
#[derive(Debug, Clone, Copy)]
struct Src {
    kv: u64,
    idx: u64,
    istride: usize,
    rows: u64,
    n_keys: usize,
}

/// Heads per block, head groups and splits for `n_eff` keys: enough blocks to keep at least half
/// the SMs busy, each latent tile shared by as many heads as possible (64 heads of a decode
/// token over 2048 keys: 2 groups of 32 heads, 64 splits of one tile).
fn plan(heads: usize, tokens: usize, n_eff: usize, sm: usize) -> (usize, usize, usize) {
    let tiles = n_eff.div_ceil(KT).max(1);
    let target = 2 * sm.max(1);
    let mut best = (4, heads.div_ceil(4), tiles);
    for hc in [32usize, 16, 8, 4] {
        let hc = hc.min(heads.div_ceil(4) * 4);
        let hg = heads.div_ceil(hc);
        let splits = (target / (tokens * hg).max(1)).clamp(1, tiles);
        best = (hc, hg, splits);
        if 2 * tokens * hg * splits >= sm || hc <= 16 {
            break;
        }
    }
    best
}

impl MlaParams {
    /// The parameters of tokens `s0..` of a call, one split plan, no partials or output yet.
    #[allow(clippy::too_many_arguments)]
    fn of(
        m: &MlaShape,
        s0: usize,
        qp: u64,
        src: Src,
        n_eff: usize,
        (split_len, n_split): (usize, usize),
    ) -> Result<MlaParams, KernelError> {
        const OP: &str = "mla";
        let (ip, istride) = (src.idx, src.istride);
        Ok(MlaParams {
            q: qp + (s0 * m.q_tok_stride * 4) as u64,
            q_tok: m.q_tok_stride as i64,
            q_head: m.q_head_stride as i64,
            kv: src.kv,
            kv_stride: m.kv_stride as i64,
            d: to_i32(OP, "d", m.d)?,
            dv: to_i32(OP, "d_v", m.d_v)?,
            h: to_i32(OP, "heads", m.heads)?,
            t: to_i32(OP, "kv_len", m.kv_len)?,
            pos: 0,
            pos0: to_i32(OP, "pos0", m.pos0 + s0)?,
            idx: if ip == 0 {
                0
            } else {
                ip + (s0 * istride * 4) as u64
            },
            idx_stride: istride as i64,
            n_keys: to_i32(OP, "n_keys", if src.rows == 0 { n_eff } else { src.n_keys })?,
            split_len: to_i32(OP, "split", split_len)?,
            scale: m.scale,
            n_split: to_i32(OP, "splits", n_split)?,
            heads_per_block: 0,
            stage_q: 0,
            part: 0,
            o: 0,
            o_tok: m.o_tok_stride as i64,
            o_head: m.o_head_stride as i64,
            rows: if src.rows == 0 {
                0
            } else {
                src.rows + (s0 * std::mem::size_of::<MlaRow>()) as u64
            },
        })
    }
}

/// mla.cu's decode kernel: heads per block (MLA_DEC_WARPS x MLA_DEC_HPW), keys per step
/// (MLA_DEC_G), and the widest rows it holds in registers.
const DEC_HEADS_PER_BLOCK: usize = 8;
const DEC_G: usize = 2;
const DEC_MAX_D: usize = 640;
const DEC_MAX_DV: usize = 512;
/// Decode blocks aimed at per SM (H200 sweep, docs/BENCHMARKS.md): 4 of 4 warps each.
const DEC_BLOCKS_PER_SM: usize = 4;
/// A split holds at least this many keys; up to `DEC_DIRECT_KEYS` keys take one split whose
/// block writes the output itself (no combine launch). 4 and 0: a short decode step's blocks
/// walk their keys one latency-bound pair after another, so more splits of fewer keys beat
/// the combine launch they add (H100, same call, 2026-12-07, with the combine writing the q8
/// activations: tg128 919.9 -> 938.1 against 16 and 32; docs/BENCHMARKS.md, seventeenth
/// session). A split of at most 4 keys (a step over 1-4 keys) still writes the output itself.
const DEC_MIN_SPLIT: usize = 4;
const DEC_DIRECT_KEYS: usize = 0;

/// A kernel choice: by shape (0), never (1) or wherever the kernel applies (2); its environment
/// variable (`0` / `1`) sets it on first use, tests and A/B runs force it.
struct KernelSwitch {
    mode: std::sync::atomic::AtomicU8,
    env: &'static str,
}

impl KernelSwitch {
    const fn new(env: &'static str) -> Self {
        KernelSwitch {
            mode: std::sync::atomic::AtomicU8::new(u8::MAX),
            env,
        }
    }

    fn get(&self) -> u8 {
        use std::sync::atomic::Ordering;
        let v = self.mode.load(Ordering::Relaxed);
        if v != u8::MAX {
            return v;
        }
        let v = match std::env::var(self.env).as_deref() {
            Ok("0") => 1,
            Ok("1") => 2,
            _ => 0,
        };
        self.mode.store(v, Ordering::Relaxed);
        v
    }

    fn force(&self, on: Option<bool>) {
        let v = match on {
            Some(false) => 1,
            Some(true) => 2,
            None => 0,
        };
        self.mode.store(v, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The decode kernel against the tile kernel (`GGUFTOOL_MLA_DECODE=0|1`).
static DEC_SWITCH: KernelSwitch = KernelSwitch::new("GGUFTOOL_MLA_DECODE");

/// Force the MLA kernel choice for this process (tests and A/B runs): `Some(false)` the tile
/// kernel everywhere, `Some(true)` the decode kernel wherever its limits allow, `None` by shape.
pub fn force_mla_decode(on: Option<bool>) {
    DEC_SWITCH.force(on);
}

/// Whether a call takes the decode kernel: steps of up to 8 tokens that see few keys, where the
/// tile kernel is latency-bound (64 heads, one token, H200, `bench --kernels`: 16 keys 11.4 us
/// against 35.0, 128 keys 16.6 against 38.7). From ~2,048 keys on, the tile kernel's latent
/// tiles, read once per block instead of once per warp, win (62.1 against 66.9 us; 32,768 keys
/// 621 against 899), so longer ones and the DSA's 2,048 selected keys keep it.
fn use_decode(tokens: usize, n_eff: usize, d: usize, d_v: usize) -> bool {
    if d > DEC_MAX_D || d_v > DEC_MAX_DV || tokens > STAGE_Q_MAX_TOKENS {
        return false;
    }
    match DEC_SWITCH.get() {
        1 => false,
        2 => true,
        _ => n_eff <= if tokens == 1 { 1024 } else { 512 },
    }
}

/// The decode kernel's least keys per split and most keys of one direct split (the defaults
/// `DEC_MIN_SPLIT`, `DEC_DIRECT_KEYS`; `GGUFTOOL_MLA_DEC_SPLIT` / `GGUFTOOL_MLA_DEC_DIRECT`
/// set them for A/B runs: a short decode step's 8 blocks walk their keys one latency-bound
/// step after another, more splits shorten that walk and add the combine launch).
fn dec_limits() -> (usize, usize) {
    static L: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *L.get_or_init(|| {
        let var = |name: &str, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(default)
        };
        (
            var("GGUFTOOL_MLA_DEC_SPLIT", DEC_MIN_SPLIT).max(DEC_G),
            var("GGUFTOOL_MLA_DEC_DIRECT", DEC_DIRECT_KEYS),
        )
    })
}

/// Keys per split and splits of a decode-kernel launch (`limits`: [`dec_limits`]).
fn dec_plan(
    heads: usize,
    tokens: usize,
    n_eff: usize,
    sm: usize,
    (min_split, direct): (usize, usize),
) -> (usize, usize) {
    if n_eff <= direct {
        return (n_eff.max(1), 1);
    }
    let blocks = tokens.max(1) * heads.div_ceil(DEC_HEADS_PER_BLOCK);
    let want = (DEC_BLOCKS_PER_SM * sm.max(1)).div_ceil(blocks).max(1);
    let len = n_eff
        .div_ceil(want)
        .max(min_split)
        .max(n_eff.div_ceil(COMBINE_MAX_SPLITS))
        .next_multiple_of(DEC_G);
    (len, n_eff.div_ceil(len))
}

/// mla.cu's tensor-core kernel: keys per chunk (MLA_TC_KC) and row padding (MLA_TC_PAD); the
/// widest key row its shared-memory plan is made for; head tiles of 16 per warp pair, at most 4
/// tiles (64 heads) a block.
const TC_KC: usize = 32;
const TC_MAX_D: usize = 576;
const TC_PAD: usize = 8;
const TC_MAX_TILES: usize = 4;

/// One launch of the tensor-core kernel: head tiles per block (`2 * tiles` warps), head groups
/// (grid z), keys per split and splits (grid x), dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaTcPlan {
    pub tiles: usize,
    pub head_groups: usize,
    pub split_len: usize,
    pub n_split: usize,
    pub threads: u32,
    pub smem: usize,
}

/// Whether the tensor-core kernel can take keys `d` wide with values `d_v` wide.
fn mla_tc_fits(d: usize, d_v: usize) -> bool {
    d.is_multiple_of(16) && d <= TC_MAX_D && d_v.is_multiple_of(16) && d_v <= 512 && d_v <= d
}

/// The launch of `tokens` query tokens of `heads` heads over `n_eff` key slots on `sm` SMs with
/// `smem_max` bytes of shared memory a block: up to 64 heads a block (fewer where the staged
/// queries would not fit: 99 KB on sm_120 holds 3 tiles of 16 at D = 576), and key splits
/// (whole chunks) until about one block per SM, since a block of 8 warps fills an SM's
/// registers (decode: 64 heads over the DSA's 2,048 keys take 64 splits of one chunk; a
/// prefill's tokens alone fill the GPU and take one split). None if one tile does not fit.
pub fn mla_tc_plan(
    heads: usize,
    tokens: usize,
    n_eff: usize,
    d: usize,
    (sm, smem_max): (usize, usize),
) -> Option<MlaTcPlan> {
    let smem = |tiles: usize| 2 * (16 * tiles + TC_KC) * (d + TC_PAD) + 4 * TC_KC;
    let mut tiles = heads.div_ceil(16).clamp(1, TC_MAX_TILES);
    while smem(tiles) > smem_max {
        if tiles == 1 {
            return None;
        }
        tiles -= 1;
    }
    let head_groups = heads.div_ceil(16 * tiles).max(1);
    let chunks = n_eff.div_ceil(TC_KC).max(1);
    let blocks = (tokens * head_groups).max(1);
    let splits = sm
        .max(1)
        .div_ceil(blocks)
        .clamp(1, chunks)
        .max(chunks.div_ceil(COMBINE_MAX_SPLITS));
    let split_len = chunks.div_ceil(splits) * TC_KC;
    Some(MlaTcPlan {
        tiles,
        head_groups,
        split_len,
        n_split: n_eff.max(1).div_ceil(split_len),
        threads: 64 * tiles as u32,
        smem: smem(tiles),
    })
}

/// The tensor-core kernel for bf16-cache calls (`GGUFTOOL_MLA_TC=0|1`).
static TC_SWITCH: KernelSwitch = KernelSwitch::new("GGUFTOOL_MLA_TC");

/// Force the tensor-core kernel for this process (tests and A/B runs): `Some(false)` never,
/// `Some(true)` for every bf16-cache call it fits, `None` by shape.
pub fn force_mla_tc(on: Option<bool>) {
    TC_SWITCH.force(on);
}

/// Whether a bf16-cache call takes the tensor-core kernel: by default everything the decode
/// kernel does not take (prefill, long and sparse decode), where the tile kernel's CUDA-core
/// products bound the time.
fn use_tc(tokens: usize, n_eff: usize, d: usize, d_v: usize) -> bool {
    if !mla_tc_fits(d, d_v) {
        return false;
    }
    match TC_SWITCH.get() {
        1 => false,
        2 => true,
        _ => !use_decode(tokens, n_eff, d, d_v),
    }
}

impl Gpu {
    /// `o[s,h] = sum_t softmax_t(scale * q[s,h] . c[t]) * c[t, :d_v]` over the keys of query s:
    /// every `t <= pos0 + s` (dense causal), or the listed keys (sparse, still causal).
    pub fn mla_attention<C: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        kv: &impl DevicePtr<C>,
        keys: Option<KeyLists<'_>>,
        o: &mut impl DevicePtrMut<f32>,
        m: MlaShape,
    ) -> Result<(), KernelError> {
        self.mla_attention_impl(q, kv, keys, o, m, false)
            .map(|_| ())
    }

    /// [`Gpu::mla_attention`] that also returns `o` as q8 activations for the next GEMV:
    /// `tokens * heads` rows of `d_v` (row `s * heads + h`), bit for bit what
    /// [`Gpu::quantize_q8`]`(o, tokens * heads, d_v, d_v)` gives after [`Gpu::mla_attention`]
    /// (whose `o` it writes bit for bit too). Where the plan merges key splits, the combine
    /// launch writes them itself (no quantize launch); where the kernel writes `o` directly (one
    /// split), one quantize launch follows. Needs dense `o` (`o_head_stride == d_v`,
    /// `o_tok_stride == heads * d_v`) and `d_v` a multiple of 32; refused otherwise.
    pub fn mla_attention_q8<C: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        kv: &impl DevicePtr<C>,
        keys: Option<KeyLists<'_>>,
        o: &mut impl DevicePtrMut<f32>,
        m: MlaShape,
    ) -> Result<Q8Act, KernelError> {
        self.mla_attention_impl(q, kv, keys, o, m, true)?
            .ok_or_else(|| shape_err("mla", "no q8 output"))
    }

    fn mla_attention_impl<C: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        kv: &impl DevicePtr<C>,
        keys: Option<KeyLists<'_>>,
        o: &mut impl DevicePtrMut<f32>,
        m: MlaShape,
        want_q8: bool,
    ) -> Result<Option<Q8Act>, KernelError> {
        const OP: &str = "mla";
        self.mla_check(q, o, &m)?;
        if m.kv_len == 0 {
            return Err(shape_err(OP, format!("empty shape {m:?}")));
        }
        check_query_span(OP, m.pos0, m.tokens, m.kv_len)?;
        need_len(OP, "kv", dlen(kv), (m.kv_len - 1) * m.kv_stride + m.d)?;
        let n_eff = KeyLists::slots(keys, OP, m.tokens, m.kv_len)?;
        let (act, q8) = self.mla_q8_alloc(&m, want_q8)?;
        let s = self.stream();
        let (qp, _gq) = q.device_ptr(s);
        let (kp, _gk) = kv.device_ptr(s);
        let (op, _go) = o.device_ptr_mut(s);
        let (ip, istride) = match keys {
            Some(kl) => (kl.idx.device_ptr(s).0, kl.stride),
            None => (0u64, 0usize),
        };
        let src = Src {
            kv: kp,
            idx: ip,
            istride,
            rows: 0,
            n_keys: 0,
        };
        // SAFETY: q, kv, o and the key lists were checked above for every token, the q8
        // outputs sized for o's rows by mla_q8_alloc; the guards and `act` live until return.
        unsafe { self.mla_dispatch::<C>(qp, op, src, m, n_eff, m.tokens, q8) }?;
        Ok(act)
    }

    /// [`Gpu::mla_attention`] for a batched step of several sequences in one launch: the query
    /// rows of `seqs[i]` follow those of `seqs[i - 1]` in q and o (`m.tokens` rows in all) and
    /// attend to that sequence's own cache at its own positions. `m.kv_len` and `m.pos0` are
    /// not read (each sequence has its own); sparse sequences' lists must be equally long.
    /// Each token reads what the single-sequence call would give it: same masking, same
    /// arithmetic; the split plan is made for the longest sequence.
    pub fn mla_attention_seqs<C: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        seqs: &[MlaSeq<'_, C>],
        o: &mut impl DevicePtrMut<f32>,
        m: MlaShape,
    ) -> Result<(), KernelError> {
        self.mla_attention_seqs_impl(q, seqs, o, m, false)
            .map(|_| ())
    }

    /// [`Gpu::mla_attention_seqs`] that also returns `o` as q8 activations, `m.tokens * heads`
    /// rows of `d_v` in the order of o's rows, bit for bit what [`Gpu::quantize_q8`]`(o,
    /// m.tokens * heads, d_v, d_v)` gives after [`Gpu::mla_attention_seqs`]; as
    /// [`Gpu::mla_attention_q8`] (same launches, same requirements on o).
    pub fn mla_attention_seqs_q8<C: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        seqs: &[MlaSeq<'_, C>],
        o: &mut impl DevicePtrMut<f32>,
        m: MlaShape,
    ) -> Result<Q8Act, KernelError> {
        self.mla_attention_seqs_impl(q, seqs, o, m, true)?
            .ok_or_else(|| shape_err("mla", "no q8 output"))
    }

    fn mla_attention_seqs_impl<C: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        seqs: &[MlaSeq<'_, C>],
        o: &mut impl DevicePtrMut<f32>,
        m: MlaShape,
        want_q8: bool,
    ) -> Result<Option<Q8Act>, KernelError> {
        const OP: &str = "mla";
        self.mla_check(q, o, &m)?;
        let total: usize = seqs.iter().map(|q| q.tokens).sum();
        if total != m.tokens {
            return Err(shape_err(
                OP,
                format!(
                    "{total} query rows in the sequences, {} in the call",
                    m.tokens
                ),
            ));
        }
        let n_keys = seqs.iter().filter_map(|q| q.keys.map(|k| k.n_keys)).max();
        let s = self.stream();
        let mut rows = Vec::with_capacity(m.tokens);
        let mut guards = Vec::with_capacity(2 * seqs.len());
        let mut n_eff = 1usize;
        for (i, sq) in seqs.iter().enumerate() {
            if sq.tokens == 0 {
                continue;
            }
            if sq.kv_len == 0 || sq.pos0 + sq.tokens > sq.kv_len {
                return Err(shape_err(
                    OP,
                    format!(
                        "sequence {i}: queries at {}..{} but {} cached keys",
                        sq.pos0,
                        sq.pos0 + sq.tokens,
                        sq.kv_len
                    ),
                ));
            }
            need_len(OP, "kv", sq.kv.len(), (sq.kv_len - 1) * m.kv_stride + m.d)?;
            let t = to_i32(OP, "kv_len", sq.kv_len)?;
            to_i32(OP, "position", sq.pos0 + sq.tokens)?;
            let (kp, gk) = sq.kv.device_ptr(s);
            guards.push(gk);
            let list = match sq.keys {
                Some(kl) => {
                    if Some(kl.n_keys) != n_keys {
                        return Err(shape_err(
                            OP,
                            format!("sequence {i}: {} listed keys, others {n_keys:?}", kl.n_keys),
                        ));
                    }
                    KeyLists::slots(Some(kl), OP, sq.tokens, 0)?;
                    let (ip, gi) = kl.idx.device_ptr(s);
                    guards.push(gi);
                    Some((ip, kl.stride))
                }
                None => None,
            };
            for j in 0..sq.tokens {
                let pos = sq.pos0 + j;
                n_eff = n_eff.max(match list {
                    Some(_) => n_keys.unwrap_or(0),
                    None => pos + 1,
                });
                rows.push(MlaRow {
                    kv: kp,
                    idx: list.map_or(0, |(ip, st)| ip + (j * st * 4) as u64),
                    t,
                    pos: pos as i32,
                });
            }
        }
        let (act, q8) = self.mla_q8_alloc(&m, want_q8)?;
        let d_rows = self.upload_async(&rows)?;
        let (qp, _gq) = q.device_ptr(s);
        let (op, _go) = o.device_ptr_mut(s);
        let (rp, _gr) = d_rows.device_ptr(s);
        let src = Src {
            kv: 0,
            idx: 0,
            istride: 0,
            rows: rp,
            n_keys: n_keys.unwrap_or(0),
        };
        // Each token's work is that of a one-token call (its own keys): the kernel choice of one.
        // SAFETY: q and o were checked above, every row's cache and key list too, the q8
        // outputs sized for o's rows by mla_q8_alloc; the guards, the uploaded rows and `act`
        // live until return.
        let r = unsafe { self.mla_dispatch::<C>(qp, op, src, m, n_eff, 1, q8) };
        drop(guards);
        r.map(|()| act)
    }

    /// The q8 outputs of a checked call when asked for: storage for `tokens * heads` rows of
    /// `d_v` and its device addresses, after checking that o is dense and `d_v` a multiple of
    /// 32 (what quantize_q8 over o's rows and the combine's epilogue need).
    fn mla_q8_alloc(
        &self,
        m: &MlaShape,
        want_q8: bool,
    ) -> Result<(Option<Q8Act>, Option<Q8Out>), KernelError> {
        if !want_q8 {
            return Ok((None, None));
        }
        if !m.d_v.is_multiple_of(32)
            || m.o_head_stride != m.d_v
            || m.o_tok_stride != m.heads * m.d_v
        {
            return Err(shape_err(
                "mla",
                format!("q8 output needs dense o rows of a multiple of 32: {m:?}"),
            ));
        }
        let (act, qs, qd) = Q8Act::alloc(self, m.tokens * m.heads, m.d_v)?;
        Ok((Some(act), Some(Q8Out { qs, qd, k: m.d_v })))
    }

    /// The checks every MLA call shares: shape, widths, strides, q and o extents.
    fn mla_check(
        &self,
        q: &impl DevicePtr<f32>,
        o: &impl DevicePtrMut<f32>,
        m: &MlaShape,
    ) -> Result<(), KernelError> {
        const OP: &str = "mla";
        if m.tokens == 0 || m.heads == 0 {
            return Err(shape_err(OP, format!("empty shape {m:?}")));
        }
        if m.d == 0 || !m.d.is_multiple_of(4) || m.d_v == 0 || m.d_v > 512 || m.d_v > m.d {
            return Err(shape_err(
                OP,
                format!(
                    "widths d {} / d_v {} (d a multiple of 4, d_v <= min(512, d))",
                    m.d, m.d_v
                ),
            ));
        }
        if !m.d_v.is_multiple_of(4)
            || !m.q_head_stride.is_multiple_of(4)
            || !m.q_tok_stride.is_multiple_of(4)
            || !m.kv_stride.is_multiple_of(4)
        {
            return Err(shape_err(OP, format!("strides not multiples of 4: {m:?}")));
        }
        // The tensor-core kernel writes o in 8-byte pairs.
        if !m.o_tok_stride.is_multiple_of(2) || !m.o_head_stride.is_multiple_of(2) {
            return Err(shape_err(OP, format!("output strides not even: {m:?}")));
        }
        let smem = 4 * (KT * (m.d + 4) + 32 * KT + KT);
        if smem > self.max_smem_optin() {
            return Err(shape_err(
                OP,
                format!("key width {} needs {smem} B of shared memory", m.d),
            ));
        }
        need_len(
            OP,
            "q",
            dlen(q),
            (m.tokens - 1) * m.q_tok_stride + (m.heads - 1) * m.q_head_stride + m.d,
        )?;
        need_len(
            OP,
            "o",
            dlen(o),
            (m.tokens - 1) * m.o_tok_stride + (m.heads - 1) * m.o_head_stride + m.d_v,
        )
    }

    /// The launches of a checked call: the tensor-core, decode or tile kernel by shape
    /// (`choice_tokens`: the query tokens that share keys, 1 for a batch of sequences), and
    /// with `q8` o's q8 activations too (from the combine, or a quantize launch after a kernel
    /// that wrote o directly).
    ///
    /// # Safety
    /// q, o and what `src` points at hold every token's rows (checked by the callers) and
    /// outlive the call; with `q8`, o is dense, `d_v` a multiple of 32 and `q8` holds
    /// `tokens * heads` rows of `d_v` (mla_q8_alloc).
    #[allow(clippy::too_many_arguments)]
    unsafe fn mla_dispatch<C: CacheElem>(
        &self,
        qp: u64,
        op: u64,
        src: Src,
        m: MlaShape,
        n_eff: usize,
        choice_tokens: usize,
        q8: Option<Q8Out>,
    ) -> Result<(), KernelError> {
        const OP: &str = "mla";
        let sm = self.info().sm_count as usize;
        if C::BF16
            && use_tc(choice_tokens, n_eff, m.d, m.d_v)
            && mla_tc_plan(m.heads, 1, n_eff, m.d, (sm, self.max_smem_optin())).is_some()
        {
            // SAFETY: by the caller.
            return unsafe { self.mla_tc(qp, op, src, m, n_eff, q8) };
        }
        if use_decode(choice_tokens, n_eff, m.d, m.d_v) {
            // SAFETY: by the caller.
            return unsafe { self.mla_decode::<C>(qp, op, src, m, n_eff, q8) };
        }
        let smem = 4 * (KT * (m.d + 4) + 32 * KT + KT);
        // Decode-sized steps stage each block's queries (up to 32 heads) in shared memory; the
        // larger footprint would halve a long prefill's blocks per SM, so those read q from L1.
        let smem_staged = smem + 4 * 32 * m.d;
        let stage = m.tokens <= STAGE_Q_MAX_TOKENS && smem_staged <= self.max_smem_optin();
        let f_part = self.func(
            Op::Mla,
            if C::BF16 {
                "mla_partial_bf16"
            } else {
                "mla_partial_f32"
            },
        )?;
        self.allow_smem(&f_part, if stage { smem_staged } else { smem })?;
        // Token groups: partials bounded, grid.y within the device limit.
        let (_, _, splits0) = plan(m.heads, m.tokens, n_eff, sm);
        let per_token = 4 * m.heads * splits0 * (m.d_v + 2);
        let group = (SCRATCH_BYTES / per_token.max(1))
            .clamp(1, m.tokens)
            .min(self.info().max_grid.1 as usize);
        let mut s0 = 0usize;
        while s0 < m.tokens {
            let cs = group.min(m.tokens - s0);
            let (hc, hg, splits) = plan(m.heads, cs, n_eff, sm);
            let split_len = n_eff.div_ceil(KT).div_ceil(splits) * KT;
            let n_split = n_eff.div_ceil(split_len);
            // attn_combine_f32 holds the split weights in shared memory.
            if n_split > COMBINE_MAX_SPLITS {
                return Err(shape_err(
                    OP,
                    format!("{n_split} key splits > {COMBINE_MAX_SPLITS}"),
                ));
            }
            let mut part = self.alloc::<f32>(cs * m.heads * n_split * (m.d_v + 2))?;
            let p = MlaParams {
                heads_per_block: hc as i32,
                stage_q: i32::from(stage),
                part: part.ptr(),
                ..MlaParams::of(&m, s0, qp, src, n_eff, (split_len, n_split))?
            };
            let mut cfg = self.cfg(
                OP,
                (n_split as u64, cs as u64, hg as u64),
                32 * (hc / 4) as u32,
            )?;
            cfg.shared_mem_bytes = if stage {
                (smem + 4 * hc * m.d) as u32
            } else {
                smem as u32
            };
            let mut b = self.args(&f_part);
            b.arg(&p);
            // SAFETY: q/kv/idx extents checked above for every token; the kernel range-checks
            // every key index; `part` holds cs * heads * n_split rows of d_v + 2.
            unsafe { self.launch(OP, b, cfg) }?;
            let o_s0 = op + (s0 * m.o_tok_stride * 4) as u64;
            let q8_s0 = q8.map(|q| q.at_row(s0 * m.heads));
            // SAFETY: o extent checked above, the q8 outputs by the caller (rows from this
            // group's first on); part written by the launch before.
            unsafe { self.mla_combine(&p, o_s0, cs, q8_s0) }?;
            let _ = &mut part;
            s0 += cs;
        }
        Ok(())
    }

    /// The decode kernel (mla.cu `mla_decode_*`) on the device pointers of q and o and the
    /// tokens' key source; with `q8` also o's q8 activations.
    ///
    /// # Safety
    /// The extents were checked by the public calls and the buffers outlive the call (`q8`: as
    /// for [`Gpu::mla_dispatch`]).
    unsafe fn mla_decode<C: CacheElem>(
        &self,
        qp: u64,
        op: u64,
        src: Src,
        m: MlaShape,
        n_eff: usize,
        q8: Option<Q8Out>,
    ) -> Result<(), KernelError> {
        const OP: &str = "mla";
        let sm = self.info().sm_count as usize;
        let (split_len, n_split) = dec_plan(m.heads, m.tokens, n_eff, sm, dec_limits());
        let f = self.func(
            Op::Mla,
            if C::BF16 {
                "mla_decode_bf16"
            } else {
                "mla_decode_f32"
            },
        )?;
        // One split: the kernel writes o itself; more: partials for the combine.
        let mut part = if n_split > 1 {
            Some(self.alloc::<f32>(m.tokens * m.heads * n_split * (m.d_v + 2))?)
        } else {
            None
        };
        let part_ptr = part.as_mut().map_or(0, |b| b.ptr());
        let p = MlaParams {
            heads_per_block: DEC_HEADS_PER_BLOCK as i32,
            part: part_ptr,
            o: if n_split == 1 { op } else { 0 },
            ..MlaParams::of(&m, 0, qp, src, n_eff, (split_len, n_split))?
        };
        let cfg = self.cfg(
            OP,
            (
                n_split as u64,
                m.tokens as u64,
                m.heads.div_ceil(DEC_HEADS_PER_BLOCK) as u64,
            ),
            128,
        )?;
        let mut b = self.args(&f);
        b.arg(&p);
        // SAFETY: q/kv/o/idx extents checked by the caller for every token; the kernel
        // range-checks every key index; `part` holds tokens * heads * n_split rows of d_v + 2.
        unsafe { self.launch(OP, b, cfg) }?;
        if part.is_some() {
            // SAFETY: o extent checked by the caller, the q8 outputs too; part written by the
            // launch before.
            unsafe { self.mla_combine(&p, op, m.tokens, q8) }?;
        } else if let Some(q) = q8 {
            // SAFETY: the kernel wrote o's tokens * heads dense rows of d_v (checked by the
            // caller), which the q8 outputs hold (mla_q8_alloc).
            unsafe { self.mla_quantize_rows(op, m.tokens * m.heads, &m, q) }?;
        }
        Ok(())
    }

    /// The tensor-core kernel (mla.cu `mla_tc_bf16`, bf16 cache) on the device pointers of q
    /// and o and the tokens' key source; token groups keep grid.y within the device limit.
    /// With `q8` also o's q8 activations.
    ///
    /// # Safety
    /// The extents were checked by the public calls and the buffers outlive the call (`q8`: as
    /// for [`Gpu::mla_dispatch`]).
    unsafe fn mla_tc(
        &self,
        qp: u64,
        op: u64,
        src: Src,
        m: MlaShape,
        n_eff: usize,
        q8: Option<Q8Out>,
    ) -> Result<(), KernelError> {
        const OP: &str = "mla";
        let sm = self.info().sm_count as usize;
        let f = self.func(Op::Mla, "mla_tc_bf16")?;
        let group = m.tokens.min(self.info().max_grid.1 as usize).max(1);
        let mut s0 = 0usize;
        while s0 < m.tokens {
            let cs = group.min(m.tokens - s0);
            let plan = mla_tc_plan(m.heads, cs, n_eff, m.d, (sm, self.max_smem_optin()))
                .ok_or_else(|| shape_err(OP, "tensor-core plan does not fit shared memory"))?;
            self.allow_smem(&f, plan.smem)?;
            let direct = plan.n_split == 1;
            let mut part = if direct {
                None
            } else {
                Some(self.alloc::<f32>(cs * m.heads * plan.n_split * (m.d_v + 2))?)
            };
            let o_s0 = op + (s0 * m.o_tok_stride * 4) as u64;
            let p = MlaParams {
                heads_per_block: (16 * plan.tiles) as i32,
                part: part.as_mut().map_or(0, |b| b.ptr()),
                o: if direct { o_s0 } else { 0 },
                ..MlaParams::of(&m, s0, qp, src, n_eff, (plan.split_len, plan.n_split))?
            };
            let mut cfg = self.cfg(
                OP,
                (plan.n_split as u64, cs as u64, plan.head_groups as u64),
                plan.threads,
            )?;
            cfg.shared_mem_bytes = plan.smem as u32;
            let mut b = self.args(&f);
            b.arg(&p);
            // SAFETY: q/kv/o/idx extents checked by the caller for every token; the kernel
            // range-checks every key index; `part` holds cs * heads * n_split rows of d_v + 2.
            unsafe { self.launch(OP, b, cfg) }?;
            let q8_s0 = q8.map(|q| q.at_row(s0 * m.heads));
            if !direct {
                // SAFETY: o extent checked by the caller, the q8 outputs too (rows from this
                // group's first on); part written by the launch before.
                unsafe { self.mla_combine(&p, o_s0, cs, q8_s0) }?;
            } else if let Some(q) = q8_s0 {
                // SAFETY: the launch wrote this group's cs * heads dense rows of d_v at o_s0;
                // the q8 outputs hold them from the group's first row on.
                unsafe { self.mla_quantize_rows(o_s0, cs * m.heads, &m, q) }?;
            }
            s0 += cs;
        }
        Ok(())
    }

    /// attn_combine_f32 over the `p.n_split` partials at `p.part` of `tokens` query tokens, into
    /// the output at `o` (strides `p.o_tok` / `p.o_head`) and, with `q8`, its q8 activations
    /// from the same launch (dense o only: refused otherwise).
    ///
    /// # Safety
    /// `p.part` holds the partials of those tokens, `o` their outputs and `q8` (when set)
    /// `tokens * p.h` rows of `p.dv` codes and records.
    unsafe fn mla_combine(
        &self,
        p: &MlaParams,
        o: u64,
        tokens: usize,
        q8: Option<Q8Out>,
    ) -> Result<(), KernelError> {
        const OP: &str = "mla";
        // The epilogue's warps hold whole blocks of 32 (d_v and the block multiples of 32) of
        // rows laid out as quantize_q8's (dense o).
        let (qs, qd) = match q8 {
            None => (0u64, 0u64),
            Some(q) => {
                let dense = p.o_head == i64::from(p.dv)
                    && p.o_tok == i64::from(p.h) * i64::from(p.dv)
                    && q.k == p.dv as usize;
                if !dense || p.dv % 32 != 0 {
                    return Err(shape_err(
                        OP,
                        format!("q8 output needs dense o rows of a multiple of 32: {p:?}"),
                    ));
                }
                (q.qs, q.qd)
            }
        };
        let f_comb = self.func(Op::Attention, "attn_combine_f32")?;
        let cfg = self.cfg_rows(OP, u64::try_from(p.h).unwrap_or(0), tokens, COMBINE_THREADS)?;
        let t = tokens as i64;
        let mut b = self.args(&f_comb);
        b.arg(&p.part)
            .arg(&p.n_split)
            .arg(&p.h)
            .arg(&p.dv)
            .arg(&o)
            .arg(&p.o_tok)
            .arg(&p.o_head)
            .arg(&t)
            .arg(&qs)
            .arg(&qd);
        // SAFETY: by the caller.
        unsafe { self.launch(OP, b, cfg) }
    }

    /// quantize_q8 of `rows` dense rows of `m.d_v` at `o` (a kernel wrote them directly) into
    /// the q8 outputs `q` (from its first row on): what the combine's epilogue writes where
    /// there is one.
    ///
    /// # Safety
    /// `o` holds `rows` rows of `m.d_v`, `m.o_head_stride` apart (== d_v), and `q` at least
    /// `rows` rows of codes and records of `m.d_v` (a multiple of 32).
    unsafe fn mla_quantize_rows(
        &self,
        o: u64,
        rows: usize,
        m: &MlaShape,
        q: Q8Out,
    ) -> Result<(), KernelError> {
        if q.k != m.d_v || !m.d_v.is_multiple_of(32) || m.o_head_stride != m.d_v {
            return Err(shape_err(
                "mla",
                format!("q8 output needs dense o rows of a multiple of 32: {m:?}"),
            ));
        }
        // SAFETY: by the caller.
        unsafe { self.quantize_q8_into(o, m.o_head_stride, rows, m.d_v, q.qs, q.qd) }
    }
}

#[cfg(test)]
mod tests {
    use super::{dec_plan, plan, COMBINE_MAX_SPLITS, DEC_DIRECT_KEYS, DEC_MIN_SPLIT};
    const LIM: (usize, usize) = (DEC_MIN_SPLIT, DEC_DIRECT_KEYS);

    #[test]
    fn q8_outputs_of_a_token_group_start_at_its_first_row() {
        let q = super::Q8Out {
            qs: 1 << 20,
            qd: 1 << 30,
            k: 512,
        };
        // Token 3 of 64 heads: row 192, code 192 * 512, record 192 * 512 / 32 (8 bytes each).
        let at = q.at_row(3 * 64);
        assert_eq!(at.qs, (1 << 20) + 192 * 512);
        assert_eq!(at.qd, (1 << 30) + 8 * 192 * 16);
        assert_eq!(at.k, 512);
    }

    #[test]
    fn decode_plans_cover_every_key() {
        // The defaults and the limits before the seventeenth session.
        for lim in [LIM, (16, 32)] {
            for heads in [4usize, 8, 64] {
                for tokens in [1usize, 2, 8] {
                    for n in [
                        1usize,
                        3,
                        4,
                        5,
                        16,
                        31,
                        32,
                        33,
                        100,
                        2048,
                        4097,
                        32768,
                        1 << 20,
                    ] {
                        let (len, ns) = dec_plan(heads, tokens, n, 132, lim);
                        assert!(len * ns >= n && len * (ns - 1) < n, "{heads} {tokens} {n}");
                        assert!(ns <= COMBINE_MAX_SPLITS, "{n} keys: {ns} splits");
                        assert_eq!(ns == 1, n <= lim.1 || len >= n, "{lim:?} {n}");
                    }
                }
            }
        }
        // 64 heads over 2048 keys: 8 head blocks x 66 splits = ~4 blocks per SM.
        assert_eq!(dec_plan(64, 1, 2048, 132, LIM), (32, 64));
        // A short decode: splits of 4 keys, 20 keys in 5 splits; up to 4 keys one split.
        assert_eq!(dec_plan(64, 1, 20, 132, LIM), (4, 5));
        assert_eq!(dec_plan(64, 1, 3, 132, LIM), (4, 1));
        // The limits before the seventeenth session: 20 keys in one direct split.
        assert_eq!(dec_plan(64, 1, 20, 132, (16, 32)), (20, 1));
    }

    #[test]
    fn tensor_core_plans_cover_every_key_and_fit() {
        use super::{mla_tc_plan, TC_KC};
        for heads in [1usize, 4, 5, 16, 20, 64, 128] {
            for tokens in [1usize, 2, 9, 512, 70_000] {
                for n in [1usize, 31, 32, 33, 2048, 32768, 1 << 20] {
                    for (sm, smem_max) in
                        [(132usize, 227usize << 10), (188, 99 << 10), (1, 227 << 10)]
                    {
                        let p = mla_tc_plan(heads, tokens, n, 576, (sm, smem_max)).unwrap();
                        let what = format!("{heads} heads, {tokens} tokens, {n} keys, {sm} SMs");
                        assert!(p.split_len.is_multiple_of(TC_KC), "{what}");
                        assert!(p.split_len * p.n_split >= n, "{what}");
                        assert!(p.split_len * (p.n_split - 1) < n, "{what}");
                        assert!(p.n_split <= COMBINE_MAX_SPLITS, "{what}");
                        assert!(16 * p.tiles * p.head_groups >= heads, "{what}");
                        assert!(
                            p.smem <= smem_max && p.threads == 64 * p.tiles as u32,
                            "{what}"
                        );
                    }
                }
            }
        }
        // Decode over the DSA's 2,048 keys on 132 SMs: 64 heads a block, 64 one-chunk splits.
        let p = mla_tc_plan(64, 1, 2048, 576, (132, 227 << 10)).unwrap();
        assert_eq!(
            (p.tiles, p.head_groups, p.n_split, p.split_len),
            (4, 1, 64, 32)
        );
        // A 512-token prefill fills the GPU with tokens: one split, written directly.
        assert_eq!(
            mla_tc_plan(64, 512, 512, 576, (132, 227 << 10))
                .unwrap()
                .n_split,
            1
        );
        // sm_120's 99 KB: 3 tiles of 16 heads; nothing fits in 32 KB.
        assert_eq!(
            mla_tc_plan(64, 1, 2048, 576, (188, 99 << 10))
                .unwrap()
                .tiles,
            3
        );
        assert!(mla_tc_plan(64, 1, 2048, 576, (132, 32 << 10)).is_none());
    }

    #[test]
    fn plans_fill_the_gpu() {
        // Decode, 64 heads, 2048 keys, 132 SMs: one head group, enough splits.
        let (hc, hg, splits) = plan(64, 1, 2048, 132);
        assert_eq!((hc, hg, splits), (32, 2, 64));
        // Few keys: smaller head groups to create blocks.
        let (hc, hg, _) = plan(64, 1, 64, 132);
        assert!(hc <= 16 && hg >= 4);
        // TP8 rank: 8 heads.
        let (hc, hg, _) = plan(8, 1, 2048, 188);
        assert_eq!((hc, hg), (8, 1));
        // Prefill: many tokens, no split needed.
        assert_eq!(plan(64, 2048, 2048, 132).2, 1);
    }
}
