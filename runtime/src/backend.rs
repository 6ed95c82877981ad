//! The op-level interface every compute backend implements (CPU reference, CUDA).
//!
//! The forward pass of each architecture is written once against [`Backend`]; backends implement
//! ops, not models, so "GPU matches CPU" is a property of individual ops. Activations are 2-D
//! row-major f32 tensors `[rows, cols]` with one row per token; weights keep their GGUF type and
//! are uploaded once.

use crate::sampling::{sample_host, SampleRequest};
use crate::weights::HostWeight;
use crate::RuntimeError;

/// Rotation convention of rotary position embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2j], x[2j+1])` rotate by angle `j` (GPT-J, ggml `ROPE_TYPE_NORM`;
    /// transformers' `apply_rotary_pos_emb_interleave`).
    Interleaved,
    /// Pairs `(x[j], x[j + n_rot/2])` (GPT-NeoX, ggml `ROPE_TYPE_NEOX`).
    Neox,
}

/// Where RoPE applies inside each row: `n_groups` groups of `group_dim` columns, the rotated
/// span being columns `offset .. offset + n_rot` of every group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub n_groups: usize,
    pub group_dim: usize,
    pub offset: usize,
    pub n_rot: usize,
    pub theta: f32,
    pub style: RopeStyle,
}

/// One sequence's attention: queries `[n, n_head * k_dim]` at positions `pos0 .. pos0 + n`
/// against keys `[t, n_kv_head * k_dim]` and values whose head `g` is columns
/// `g * v_dim .. (g + 1) * v_dim` of each value row (so the value tensor may be wider, e.g.
/// the 576-wide MLA latent cache read as 512-wide values). Causal: query `i` sees keys
/// `0 ..= pos0 + i`. Output `[n, n_head * v_dim]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParams {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub scale: f32,
    pub pos0: usize,
}

/// One sequence of [`Backend::attention_seqs`].
pub struct SeqAttn<'a, B: Backend> {
    /// Its query rows in the batch and the position of the first.
    pub rows: usize,
    pub pos0: usize,
    /// Its cached keys and values (the same tensor for absorbed MLA).
    pub k: &'a B::Tensor,
    pub v: &'a B::Tensor,
    /// Its DSA key selection, one row per query (`None`: dense causal).
    pub selected: Option<&'a B::Index>,
}

/// The DSA lightning indexer's selection for one sequence: queries `[n, n_head * head_dim]`,
/// per-head weights `[n, n_head]` (all scaling folded in), keys `[t, head_dim]`.
/// `score[i, t] = sum_h w[i, h] * relu(scale * q[i, h] . k[t])` over causal keys, then the
/// `top_k` best keys per query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexerParams {
    pub n_head: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub top_k: usize,
    pub pos0: usize,
}

/// How router logits become expert probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// Expert routing (DeepSeek-V3 / GLM "noaux_tc" family).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteParams {
    pub n_expert: usize,
    pub n_used: usize,
    pub n_group: usize,
    pub n_group_used: usize,
    pub gating: Gating,
    /// Divide the chosen experts' weights by their sum.
    pub normalize: bool,
    /// Multiply the final weights (routed_scaling_factor).
    pub scale: f32,
}

/// The ops the forward passes need. Every op checks the shapes it is given and reports a
/// mismatch as [`RuntimeError::Backend`] rather than panicking.
pub trait Backend: Clone + Send + Sync + 'static {
    /// Activation tensor, 2-D row-major f32.
    type Tensor: Send + Sync + 'static;
    /// A weight in its GGUF type (ggml dims, innermost first).
    type Weight: Send + Sync + 'static;
    /// Integer tensor `[rows, cols]` (selected key positions, chosen experts); `-1` = empty slot.
    type Index: Send + Sync + 'static;

    fn name(&self) -> String;

    // --- data movement ---
    fn upload(&self, w: HostWeight) -> Result<Self::Weight, RuntimeError>;
    fn new_tensor(
        &self,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<Self::Tensor, RuntimeError>;
    fn to_host(&self, t: &Self::Tensor) -> Result<Vec<f32>, RuntimeError>;
    fn index_to_host(&self, i: &Self::Index) -> Result<(usize, usize, Vec<i64>), RuntimeError>;
    /// The f32 values of a 1-D weight (a norm, a bias): what the ops that read it as a vector
    /// see. The forward's observer recomputes the router's ranking keys with it.
    fn vector_to_host(&self, w: &Self::Weight) -> Result<Vec<f32>, RuntimeError>;
    /// `(rows, cols)`.
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);
    /// A `[0, cols]` tensor to grow with [`Backend::append_rows`] (KV caches).
    fn empty(&self, cols: usize) -> Result<Self::Tensor, RuntimeError>;
    fn append_rows(&self, dst: &mut Self::Tensor, src: &Self::Tensor) -> Result<(), RuntimeError>;
    /// Rows of `src` appended to several tensors, in order: the first `counts[0]` rows to
    /// `dsts[0]`, the next `counts[1]` to `dsts[1]`, ... (a batched step's cache rows, one
    /// sequence each). The default appends slice by slice.
    fn append_rows_seqs(
        &self,
        dsts: &mut [&mut Self::Tensor],
        src: &Self::Tensor,
        counts: &[usize],
    ) -> Result<(), RuntimeError> {
        append_rows_seqs_composed(self, dsts, src, counts)
    }
    /// Make room for `rows` rows in a tensor grown by [`Backend::append_rows`], so appends up to
    /// it neither reallocate nor copy (a KV cache sized up front). The default grows as it goes.
    fn reserve_rows(&self, _t: &mut Self::Tensor, _rows: usize) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// Keep the first `rows` rows (rolls a cache back after a failed step).
    fn truncate_rows(&self, t: &mut Self::Tensor, rows: usize) -> Result<(), RuntimeError>;
    fn slice_rows(
        &self,
        x: &Self::Tensor,
        start: usize,
        n: usize,
    ) -> Result<Self::Tensor, RuntimeError>;
    /// Rows `rows[i]` of `x`, in that order.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor, RuntimeError>;
    fn concat_rows(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor, RuntimeError>;
    /// Columns `start .. start + n` of every row.
    fn slice_cols(
        &self,
        x: &Self::Tensor,
        start: usize,
        n: usize,
    ) -> Result<Self::Tensor, RuntimeError>;
    /// Row-wise concatenation of equally tall tensors.
    fn concat_cols(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor, RuntimeError>;
    /// Columns `start .. start + n` of each of the `n_head` groups of `head_dim` columns:
    /// `[rows, n_head * head_dim]` -> `[rows, n_head * n]`.
    fn head_slice(
        &self,
        x: &Self::Tensor,
        n_head: usize,
        head_dim: usize,
        start: usize,
        n: usize,
    ) -> Result<Self::Tensor, RuntimeError>;
    /// Per head `h`: `cat(a_h, b_h)`. `a` is `[rows, n_head * a_dim]`; `b` is
    /// `[rows, n_head * b_dim]`, or with `b_shared` one `[rows, b_dim]` block for every head.
    fn head_concat(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        n_head: usize,
        b_shared: bool,
    ) -> Result<Self::Tensor, RuntimeError>;

    // --- dense math ---
    /// `[rows, k]` by a weight of ggml dims `{k, m}` -> `[rows, m]` (`x . W^T` in torch terms).
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor, RuntimeError>;
    /// Per-head matmul by a 3-D weight `{k, m, n_head}`: `[rows, n_head * k]` -> `[rows, n_head * m]`.
    fn matmul_heads(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
    ) -> Result<Self::Tensor, RuntimeError>;
    /// Token embedding rows of a `{d, vocab}` table.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor, RuntimeError>;
    /// A step's token positions (row r's position), given before the step's first op. A
    /// backend that copies them to a device does it here, ahead of the step's kernels, rather
    /// than at the first RoPE, between two kernels of the first layer (where the copy breaks
    /// the chain of early-launched kernels). The positions the later ops receive are the same
    /// values; nothing depends on this call having been made.
    fn stage_positions(&self, _positions: &[u32]) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// RMSNorm over every group of `len(w)` columns (f32 statistics), then times `w`.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor, RuntimeError>;
    /// LayerNorm (biased variance) over each row, times `w` plus `b`.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor, RuntimeError>;
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, RuntimeError>;
    /// Adds a bias vector to every row.
    fn add_bias(&self, x: &Self::Tensor, b: &Self::Weight) -> Result<Self::Tensor, RuntimeError>;
    fn scale(&self, x: &Self::Tensor, s: f32) -> Result<Self::Tensor, RuntimeError>;
    /// `silu(gate) * up`.
    fn silu_mul(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
    ) -> Result<Self::Tensor, RuntimeError>;
    /// RoPE in place; `positions[r]` is row `r`'s position.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        positions: &[u32],
        p: &RopeParams,
    ) -> Result<(), RuntimeError>;

    // --- attention ---
    /// Softmax attention; `selected` (one row per query, key positions, `-1` = empty) limits
    /// each query to those keys (sparse attention), `None` = dense causal.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        p: &AttnParams,
        selected: Option<&Self::Index>,
    ) -> Result<Self::Tensor, RuntimeError>;
    /// The attention of a batched step: sequence `i`'s query rows (`seqs[i].rows` rows after
    /// those of the sequences before it) against its own keys, values and selection from its
    /// own position `seqs[i].pos0` (`p.pos0` is not read); output rows in the same order. Each
    /// sequence's rows equal what [`Backend::attention`] gives them up to summation order. The
    /// default runs one attention per sequence.
    fn attention_seqs(
        &self,
        q: &Self::Tensor,
        seqs: &[SeqAttn<'_, Self>],
        p: &AttnParams,
    ) -> Result<Self::Tensor, RuntimeError> {
        attention_seqs_composed(self, q, seqs, p)
    }
    /// Lightning-indexer top-k key selection, `[n, top_k]` ascending positions, `-1` padded.
    fn indexer_topk(
        &self,
        q: &Self::Tensor,
        weights: &Self::Tensor,
        keys: &Self::Tensor,
        p: &IndexerParams,
    ) -> Result<Self::Index, RuntimeError>;

    // --- mixture of experts ---
    /// Router logits `[n, n_expert]` -> (weights `[n, n_used]`, experts `[n, n_used]`).
    /// `bias` (e_score_correction) only influences which experts are chosen.
    fn moe_route(
        &self,
        logits: &Self::Tensor,
        bias: Option<&Self::Weight>,
        p: &RouteParams,
    ) -> Result<(Self::Tensor, Self::Index), RuntimeError>;
    /// `sum_k w[i,k] * down_e(silu(gate_e x_i) * up_e x_i)` with `e = experts[i,k]`; the expert
    /// weights are 3-D `{k, m, n_expert}`.
    fn moe_ffn(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
        weights: &Self::Tensor,
        experts: &Self::Index,
    ) -> Result<Self::Tensor, RuntimeError>;

    // --- fused ops (defaults: the op sequence they replace, so the CPU reference is unchanged) ---

    /// `silu(x . gate^T) * (x . up^T)`: an FFN's gate and up projections and SwiGLU (the dense
    /// MLP, the shared expert); `gate` and `up` are 2-D weights of equal dims `{k, ff}`.
    fn glu(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
    ) -> Result<Self::Tensor, RuntimeError> {
        let g = self.matmul(x, gate)?;
        let u = self.matmul(x, up)?;
        self.silu_mul(&g, &u)
    }

    /// `[x . w^T for w in ws]`: several projections of one input (a layer's q_a, kv_a and
    /// indexer keys), which a backend may run as one product over their stacked rows.
    fn matmul_stacked(
        &self,
        x: &Self::Tensor,
        ws: &[&Self::Weight],
    ) -> Result<Vec<Self::Tensor>, RuntimeError> {
        ws.iter().map(|w| self.matmul(x, w)).collect()
    }

    /// `acc + x . w^T`: a second branch's output added onto the first's (the shared expert's
    /// down projection onto the routed experts' sum).
    fn matmul_add(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        acc: Self::Tensor,
    ) -> Result<Self::Tensor, RuntimeError> {
        let y = self.matmul(x, w)?;
        self.add(&acc, &y)
    }

    /// A MoE layer with a shared expert: the routed sum ([`Backend::moe_ffn`]) plus the shared
    /// expert `down_s(silu(gate_s x) * up_s x)` (2-D weights of the routed experts' `{k, m}`).
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn_shared(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
        weights: &Self::Tensor,
        experts: &Self::Index,
        shared: (&Self::Weight, &Self::Weight, &Self::Weight),
    ) -> Result<Self::Tensor, RuntimeError> {
        let y = self.moe_ffn(x, gate, up, down, weights, experts)?;
        let (sg, su, sd) = shared;
        self.matmul_add(&self.glu(x, sg, su)?, sd, y)
    }

    /// The absorbed MLA queries: `q` is `[rows, n_head * (nope + rope)]`, each head's `nope`
    /// position-free columns then its rope columns; per head, the position-free part times
    /// slab h of `k_b` (`{nope, kv_lora, n_head}`) followed by the rope part rotated by `p`
    /// (`n_groups` = heads, `group_dim` = the rope width): `[rows, n_head * (kv_lora + rope)]`.
    fn mla_queries(
        &self,
        q: &Self::Tensor,
        k_b: &Self::Weight,
        nope: usize,
        positions: &[u32],
        p: &RopeParams,
    ) -> Result<Self::Tensor, RuntimeError> {
        mla_queries_composed(self, q, k_b, nope, positions, p)
    }

    /// The MLA cache rows of `kv_a`'s output: the first `n` columns (the latent) RMS-normalised
    /// by `w`, RoPE `p` on the others (the shared key part); with `cache` (a step of one
    /// sequence) the rows are also appended to it.
    #[allow(clippy::too_many_arguments)]
    fn mla_kv_rows(
        &self,
        kv_a: Self::Tensor,
        w: &Self::Weight,
        n: usize,
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
        cache: Option<&mut Self::Tensor>,
    ) -> Result<Self::Tensor, RuntimeError> {
        mla_kv_rows_composed(self, kv_a, w, n, eps, positions, p, cache)
    }

    /// The DSA indexer's keys: LayerNorm of `k` (times `w` plus `b`), then RoPE `p`; with
    /// `cache` (a step of one sequence) also appended to it.
    #[allow(clippy::too_many_arguments)]
    fn indexer_keys(
        &self,
        k: Self::Tensor,
        w: &Self::Weight,
        b: &Self::Weight,
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
        cache: Option<&mut Self::Tensor>,
    ) -> Result<Self::Tensor, RuntimeError> {
        indexer_keys_composed(self, k, w, b, eps, positions, p, cache)
    }

    /// An MLA block's norms after its stacked projection, at `positions`: `q` = (q_a, its norm
    /// weight, eps) by [`Backend::rms_norm`], `kv` by [`Backend::mla_kv_rows`], `ix` by
    /// [`Backend::indexer_keys`]. They are independent of each other, so a backend that pays
    /// per launch may run them as one; the default composes the three ops.
    fn mla_norms(
        &self,
        q: Option<(&Self::Tensor, &Self::Weight, f32)>,
        kv: KvRowsArgs<'_, Self::Tensor, Self::Weight>,
        ix: Option<IndexerKeysArgs<'_, Self::Tensor, Self::Weight>>,
        positions: &[u32],
    ) -> Result<MlaNormed<Self::Tensor>, RuntimeError> {
        mla_norms_composed(self, q, kv, ix, positions)
    }

    /// Whether the forward adds a block's output to the residual stream in the next block's
    /// norm ([`Backend::add_rms_norm`], whose sum is [`Backend::add`]'s: the same values) instead
    /// of at once, so a backend that pays per launch saves the add's. The default composition
    /// runs the same two ops either way.
    fn residual_into_norm(&self) -> bool {
        true
    }

    /// `h = res + x`, then `(h, rms_norm(h, w))`: the residual add before a block's norm.
    fn add_rms_norm(
        &self,
        res: &Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
    ) -> Result<(Self::Tensor, Self::Tensor), RuntimeError> {
        let h = self.add(res, x)?;
        let y = self.rms_norm(&h, w, eps)?;
        Ok((h, y))
    }

    /// RMSNorm (times `w`) of the first `len(w)` columns of every row, the other columns kept:
    /// the MLA latent of `kv_a`'s output, whose rope columns follow it.
    fn rms_norm_lead(
        &self,
        x: Self::Tensor,
        w: &Self::Weight,
        n: usize,
        eps: f32,
    ) -> Result<Self::Tensor, RuntimeError> {
        let cols = self.shape(&x).1;
        if n > cols {
            return Err(shape_err(format!("rms_norm_lead: {n} of {cols} columns")));
        }
        let lead = self.rms_norm(&self.slice_cols(&x, 0, n)?, w, eps)?;
        if n == cols {
            return Ok(lead);
        }
        let rest = self.slice_cols(&x, n, cols - n)?;
        self.concat_cols(&[&lead, &rest])
    }

    // --- sampling ---

    /// One token per row of `logits` (`[rows, vocab]`, one row per request) by the rules of
    /// [`crate::sampling`], with whether the row held a non-finite logit. The default copies
    /// the logits to the host; a GPU backend samples on the device and copies the ids only.
    fn sample(
        &self,
        logits: &Self::Tensor,
        reqs: &[SampleRequest],
    ) -> Result<Vec<(u32, bool)>, RuntimeError> {
        let (rows, vocab) = self.shape(logits);
        check_sample(rows, vocab, reqs.len())?;
        Ok(sample_host(&self.to_host(logits)?, vocab, reqs))
    }

    // --- tensor-parallel collectives ---
    //
    // The forward pass calls these where a rank's partial results meet. A single-device backend
    // is a group of one: the defaults are the identity. A tensor-parallel rank
    // (`crate::tp::Ranked`) overrides them with its group's communicator.

    /// `(rank, world)` of this backend's tensor-parallel group.
    fn rank(&self) -> (usize, usize) {
        (0, 1)
    }
    /// Sum `x` over the ranks, in place. Every rank adds the ranks' values in rank order, so
    /// every rank gets bitwise the same result.
    fn all_reduce_sum(&self, _x: &mut Self::Tensor) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// Every rank's rows of equal count side by side, in rank order (the vocabulary-split head).
    fn all_gather_cols(&self, x: Self::Tensor) -> Result<Self::Tensor, RuntimeError> {
        Ok(x)
    }
    /// Expert ids `[n, k]` re-based to this rank's experts `first .. first + count` (expert
    /// parallelism); ids of other ranks' experts become `-1` (skipped by `moe_ffn`).
    fn local_expert_ids(
        &self,
        _ids: Self::Index,
        first: usize,
        count: usize,
    ) -> Result<Self::Index, RuntimeError> {
        Err(RuntimeError::Backend(format!(
            "experts {first}..{}: expert parallelism needs a tensor-parallel backend",
            first + count
        )))
    }
}

/// [`Backend::mla_queries`] by the layout ops: head slices of the two parts, RoPE on the rope
/// part, the per-head matmul, the per-head concatenation.
pub(crate) fn mla_queries_composed<B: Backend>(
    be: &B,
    q: &B::Tensor,
    k_b: &B::Weight,
    nope: usize,
    positions: &[u32],
    p: &RopeParams,
) -> Result<B::Tensor, RuntimeError> {
    let (heads, rope) = (p.n_groups, p.group_dim);
    let q_nope = be.head_slice(q, heads, nope + rope, 0, nope)?;
    let mut q_rot = be.head_slice(q, heads, nope + rope, nope, rope)?;
    be.rope(&mut q_rot, positions, p)?;
    let qa = be.matmul_heads(&q_nope, k_b)?;
    be.head_concat(&qa, &q_rot, heads, false)
}

/// [`Backend::append_rows_seqs`] by the ops: one slice and append per tensor.
pub(crate) fn append_rows_seqs_composed<B: Backend>(
    be: &B,
    dsts: &mut [&mut B::Tensor],
    src: &B::Tensor,
    counts: &[usize],
) -> Result<(), RuntimeError> {
    check_seq_rows("append_rows_seqs", be.shape(src).0, counts, dsts.len())?;
    if let [d] = dsts {
        return be.append_rows(d, src);
    }
    let mut r0 = 0;
    for (d, &n) in dsts.iter_mut().zip(counts) {
        be.append_rows(d, &be.slice_rows(src, r0, n)?)?;
        r0 += n;
    }
    Ok(())
}

/// [`Backend::attention_seqs`] by the ops: one attention per sequence, the rows stacked.
pub(crate) fn attention_seqs_composed<B: Backend>(
    be: &B,
    q: &B::Tensor,
    seqs: &[SeqAttn<'_, B>],
    p: &AttnParams,
) -> Result<B::Tensor, RuntimeError> {
    let counts: Vec<usize> = seqs.iter().map(|s| s.rows).collect();
    check_seq_rows("attention_seqs", be.shape(q).0, &counts, seqs.len())?;
    let one = |s: &SeqAttn<'_, B>, q: &B::Tensor| {
        let ps = AttnParams { pos0: s.pos0, ..*p };
        be.attention(q, s.k, s.v, &ps, s.selected)
    };
    if let [s] = seqs {
        return one(s, q);
    }
    let mut outs = Vec::with_capacity(seqs.len());
    let mut r0 = 0;
    for s in seqs {
        outs.push(one(s, &be.slice_rows(q, r0, s.rows)?)?);
        r0 += s.rows;
    }
    be.concat_rows(&outs.iter().collect::<Vec<_>>())
}

/// A batched op's per-sequence row counts cover the batch's rows, one count per sequence.
pub(crate) fn check_seq_rows(
    op: &str,
    rows: usize,
    counts: &[usize],
    seqs: usize,
) -> Result<(), RuntimeError> {
    let total: usize = counts.iter().sum();
    if counts.len() != seqs || seqs == 0 || total != rows {
        return Err(shape_err(format!(
            "{op}: {seqs} sequences with {total} rows ({} counts) for {rows} rows",
            counts.len()
        )));
    }
    Ok(())
}

/// [`Backend::mla_kv_rows`]'s operands but the positions (one job of [`Backend::mla_norms`]).
pub struct KvRowsArgs<'a, T, W> {
    pub kv_a: T,
    pub w: &'a W,
    pub n: usize,
    pub eps: f32,
    pub p: &'a RopeParams,
    pub cache: Option<&'a mut T>,
}

/// [`Backend::indexer_keys`]'s operands but the positions (one job of [`Backend::mla_norms`]).
pub struct IndexerKeysArgs<'a, T, W> {
    pub k: T,
    pub w: &'a W,
    pub b: &'a W,
    pub eps: f32,
    pub p: &'a RopeParams,
    pub cache: Option<&'a mut T>,
}

/// [`Backend::mla_norms`]'s outputs: the normalised q_a (when asked), the kv rows, the
/// indexer's keys (when asked).
pub type MlaNormed<T> = (Option<T>, T, Option<T>);

/// [`Backend::mla_norms`] by the ops, in the forward's order: q_a's norm, the kv rows, the keys.
pub(crate) fn mla_norms_composed<B: Backend>(
    be: &B,
    q: Option<(&B::Tensor, &B::Weight, f32)>,
    kv: KvRowsArgs<'_, B::Tensor, B::Weight>,
    ix: Option<IndexerKeysArgs<'_, B::Tensor, B::Weight>>,
    positions: &[u32],
) -> Result<MlaNormed<B::Tensor>, RuntimeError> {
    let q = q.map(|(x, w, eps)| be.rms_norm(x, w, eps)).transpose()?;
    let kv = be.mla_kv_rows(kv.kv_a, kv.w, kv.n, kv.eps, positions, kv.p, kv.cache)?;
    let ix = ix
        .map(|a| be.indexer_keys(a.k, a.w, a.b, a.eps, positions, a.p, a.cache))
        .transpose()?;
    Ok((q, kv, ix))
}

/// [`Backend::mla_kv_rows`] by the ops: the latent norm in place, RoPE, the append.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mla_kv_rows_composed<B: Backend>(
    be: &B,
    kv_a: B::Tensor,
    w: &B::Weight,
    n: usize,
    eps: f32,
    positions: &[u32],
    p: &RopeParams,
    cache: Option<&mut B::Tensor>,
) -> Result<B::Tensor, RuntimeError> {
    let mut rows = be.rms_norm_lead(kv_a, w, n, eps)?;
    be.rope(&mut rows, positions, p)?;
    if let Some(c) = cache {
        be.append_rows(c, &rows)?;
    }
    Ok(rows)
}

/// [`Backend::indexer_keys`] by the ops: LayerNorm, RoPE, the append.
#[allow(clippy::too_many_arguments)]
pub(crate) fn indexer_keys_composed<B: Backend>(
    be: &B,
    k: B::Tensor,
    w: &B::Weight,
    b: &B::Weight,
    eps: f32,
    positions: &[u32],
    p: &RopeParams,
    cache: Option<&mut B::Tensor>,
) -> Result<B::Tensor, RuntimeError> {
    let mut k = be.layer_norm(&k, w, b, eps)?;
    be.rope(&mut k, positions, p)?;
    if let Some(c) = cache {
        be.append_rows(c, &k)?;
    }
    Ok(k)
}

// --- shape checks shared by the backends ---
//
// Every backend must accept and reject exactly the same inputs, with the same messages, or a
// "GPU matches CPU" test could pass while one of them silently computes on a wrong shape. The
// checks therefore live here once, on plain `(rows, cols)` shapes, and each backend calls them
// before touching data.

/// `(rows, cols)` of an activation or index tensor.
pub(crate) type Shape = (usize, usize);

fn shape_err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend(msg.into())
}

/// Element-wise binary ops need equal shapes.
pub(crate) fn check_same(op: &str, a: Shape, b: Shape) -> Result<(), RuntimeError> {
    if a != b {
        return Err(shape_err(format!(
            "{op}: shapes [{}, {}] and [{}, {}] differ",
            a.0, a.1, b.0, b.1
        )));
    }
    Ok(())
}

pub(crate) fn check_sample(rows: usize, vocab: usize, reqs: usize) -> Result<(), RuntimeError> {
    if rows != reqs || vocab == 0 {
        return Err(shape_err(format!(
            "sample: [{rows}, {vocab}] logits for {reqs} requests"
        )));
    }
    Ok(())
}

pub(crate) fn check_append_rows(dst_cols: usize, src_cols: usize) -> Result<(), RuntimeError> {
    if dst_cols != src_cols {
        return Err(shape_err(format!(
            "append_rows: {src_cols} columns onto {dst_cols}"
        )));
    }
    Ok(())
}

pub(crate) fn check_head_slice(
    x: Shape,
    n_head: usize,
    head_dim: usize,
    start: usize,
    n: usize,
) -> Result<(), RuntimeError> {
    if n_head * head_dim != x.1 || start + n > head_dim {
        return Err(shape_err(format!(
            "head_slice: [{}, {}] as {n_head} x {head_dim}, columns {start}+{n}",
            x.0, x.1
        )));
    }
    Ok(())
}

/// Returns the per-head widths `(a_dim, b_dim)` of [`Backend::head_concat`]'s operands.
pub(crate) fn check_head_concat(
    a: Shape,
    b: Shape,
    n_head: usize,
    b_shared: bool,
) -> Result<(usize, usize), RuntimeError> {
    if a.0 != b.0
        || n_head == 0
        || !a.1.is_multiple_of(n_head)
        || (!b_shared && !b.1.is_multiple_of(n_head))
    {
        return Err(shape_err(format!(
            "head_concat: [{}, {}] and [{}, {}] over {n_head} heads",
            a.0, a.1, b.0, b.1
        )));
    }
    let bd = if b_shared { b.1 } else { b.1 / n_head };
    Ok((a.1 / n_head, bd))
}

pub(crate) fn check_rope(x: Shape, n_positions: usize, p: &RopeParams) -> Result<(), RuntimeError> {
    if n_positions != x.0
        || p.n_groups * p.group_dim != x.1
        || p.offset + p.n_rot > p.group_dim
        || !p.n_rot.is_multiple_of(2)
    {
        return Err(shape_err(format!(
            "rope: [{}, {}] with {n_positions} positions, {p:?}",
            x.0, x.1
        )));
    }
    Ok(())
}

/// `selected_rows`: rows of the sparse key selection, if any.
pub(crate) fn check_attention(
    q: Shape,
    k: Shape,
    v: Shape,
    p: &AttnParams,
    selected_rows: Option<usize>,
) -> Result<(), RuntimeError> {
    let (n, t) = (q.0, k.0);
    if p.n_kv_head == 0
        || !p.n_head.is_multiple_of(p.n_kv_head)
        || q.1 != p.n_head * p.k_dim
        || k.1 != p.n_kv_head * p.k_dim
        || v.0 != t
        || v.1 < p.n_kv_head * p.v_dim
        || t < p.pos0 + n
        || selected_rows.is_some_and(|r| r != n)
    {
        return Err(shape_err(format!(
            "attention: q [{n}, {}], k [{t}, {}], v [{}, {}], {p:?}",
            q.1, k.1, v.0, v.1
        )));
    }
    Ok(())
}

pub(crate) fn check_indexer(
    q: Shape,
    weights: Shape,
    keys: Shape,
    p: &IndexerParams,
) -> Result<(), RuntimeError> {
    let (n, t) = (q.0, keys.0);
    if q.1 != p.n_head * p.head_dim
        || weights.0 != n
        || weights.1 != p.n_head
        || keys.1 != p.head_dim
        || t < p.pos0 + n
        || p.top_k == 0
    {
        return Err(shape_err(format!(
            "indexer_topk: q [{n}, {}], weights [{}, {}], keys [{t}, {}], {p:?}",
            q.1, weights.0, weights.1, keys.1
        )));
    }
    Ok(())
}

/// `bias_len`: length of the e_score_correction bias, if any.
pub(crate) fn check_route(
    logits: Shape,
    bias_len: Option<usize>,
    p: &RouteParams,
) -> Result<(), RuntimeError> {
    let e = p.n_expert;
    if logits.1 != e
        || bias_len.is_some_and(|b| b != e)
        || p.n_used == 0
        || p.n_used > e
        || p.n_group == 0
        || !e.is_multiple_of(p.n_group)
        || p.n_group_used == 0
        || p.n_group_used > p.n_group
    {
        return Err(shape_err(format!(
            "moe_route: logits [{}, {}], {p:?}",
            logits.0, logits.1
        )));
    }
    Ok(())
}

/// Expert weights are ggml dims `gate = up = {d, ff, n_expert}`, `down = {ff, d, n_expert}`.
pub(crate) fn check_moe_ffn(
    x: Shape,
    gd: &[usize],
    ud: &[usize],
    dd: &[usize],
    weights: Shape,
    experts: Shape,
) -> Result<(), RuntimeError> {
    let ok = gd.len() == 3
        && gd == ud
        && dd.len() == 3
        && gd[0] == x.1
        && dd[0] == gd[1]
        && dd[1] == x.1
        && dd[2] == gd[2]
        && weights.0 == x.0
        && experts.0 == x.0
        && weights.1 == experts.1;
    if !ok {
        return Err(shape_err(format!(
            "moe_ffn: x [{}, {}], {gd:?} {ud:?} {dd:?}, routes [{}, {}]",
            x.0, x.1, experts.0, experts.1
        )));
    }
    Ok(())
}
