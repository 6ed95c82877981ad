//! The forward pass of the GLM-5 family (`glm-dsa`; `deepseek2` and `glm4moe` share it), written
//! once against the [`Backend`] ops. Follows transformers' `GlmMoeDsaForCausalLM` (spec §1):
//! MLA attention with interleaved RoPE on the rope dims, the DSA lightning indexer choosing the
//! keys each query may attend to, dense FFN blocks then MoE blocks with a sigmoid router.
//!
//! Attention runs "absorbed" by default (queries mapped into the latent space by `attn_k_b`,
//! attention over the cached latents, outputs mapped back by `attn_v_b`), as llama.cpp does;
//! [`AttnMode::Naive`] expands keys and values through the reassembled `kv_b` like transformers.
//! Both give the same numbers up to f32 rounding (tested).
//!
//! Tensor parallelism is part of this one definition: a [`ShardView`] says which heads, FFN
//! columns, experts and vocabulary rows this rank holds; the loader reads each tensor's share
//! along the axis the mapping table gives it, and the forward pass calls the backend's
//! collectives where partial sums meet (after `attn_output`, after the FFN / MoE block) and
//! where the vocabulary-split head's logits are gathered. With one rank every collective is the
//! identity and every share is the whole tensor.

use crate::backend::{
    AttnParams, Backend, IndexerKeysArgs, IndexerParams, KvRowsArgs, RopeParams, RouteParams,
    SeqAttn,
};
use crate::cache::KvCache;
use crate::lm::{check_requests, LanguageModel, SeqStep, SequenceState};
use crate::sampling::{finish_rows, SampleRequest, Sampled};
use crate::spec::{AttentionSpec, FfnKind, GqaSpec, LayerSpec, MlaSpec, ModelSpec, TensorSpec};
use crate::tp::{Part, ShardView};
use crate::weights::HostWeight;
use crate::RuntimeError;
use mappings::kvb::{self, MlaDims};
use std::cell::RefCell;
use std::sync::Arc;

/// A named intermediate activation handed to an observer (host copies, rows = tokens).
#[derive(Debug, Clone, Copy)]
pub enum Activation<'a> {
    F32 {
        rows: usize,
        cols: usize,
        data: &'a [f32],
    },
    /// Integer results (selected key positions, chosen experts); `-1` = empty slot.
    Index {
        rows: usize,
        cols: usize,
        data: &'a [i64],
    },
}

/// Receives `(name, activation)` pairs such as `blk.3.attn_output.out` during a forward pass.
pub type Observer<'o> = &'o mut dyn FnMut(&str, Activation<'_>);

/// In an observed activation of ranking keys (`blk.N.indexer.scores`, `blk.N.router.choice`),
/// a key that cannot be selected (a causally masked key, an expert of a group not kept): below
/// every real key, like the -inf the ops rank it as, but finite, so that observers looking for
/// overflows (`numerics::locate_non_finite`) or differencing two models' activations (`gguftool
/// doctor`) do not read the mask as a NaN or an infinity.
pub const MASKED_KEY: f32 = f32::MIN;

/// The sequences' `(rows, cols, row-major data)` parts of one observation stacked into one
/// matrix as wide as the widest part, each shorter row padded with `pad`.
fn pad_rows<T: Copy>(parts: &[(usize, usize, Vec<T>)], pad: T) -> (usize, usize, Vec<T>) {
    let cols = parts.iter().map(|p| p.1).max().unwrap_or(0);
    let rows: usize = parts.iter().map(|p| p.0).sum();
    let mut data = Vec::with_capacity(rows * cols);
    for (r, c, d) in parts {
        for i in 0..*r {
            data.extend_from_slice(&d[i * c..(i + 1) * c]);
            data.extend(std::iter::repeat_n(pad, cols - c));
        }
    }
    (rows, cols, data)
}

/// A ranking key as observed: -inf (masked) becomes [`MASKED_KEY`].
fn masked(v: f32) -> f32 {
    if v == f32::NEG_INFINITY {
        MASKED_KEY
    } else {
        v
    }
}

/// The residual stream between decoder blocks: `h`, and the last block's output with the
/// block's index while its add waits for the next norm ([`Backend::residual_into_norm`]).
struct Residual<T> {
    h: T,
    pending: Option<(T, usize)>,
}

impl<T> Residual<T> {
    fn new(h: T) -> Self {
        Residual { h, pending: None }
    }
}

/// How MLA attention is evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnMode {
    /// Attention over the latent cache (`attn_k_b` / `attn_v_b`).
    Absorbed,
    /// Keys and values expanded from the latent through `kv_b`, as transformers does.
    Naive,
}

struct Mla<B: Backend> {
    /// `(attn_q_a, attn_q_a_norm)` when queries are low-rank.
    q_a: Option<(B::Weight, B::Weight)>,
    /// `attn_q_b`, or `attn_q` without q_lora.
    q_b: B::Weight,
    kv_a: B::Weight,
    kv_a_norm: B::Weight,
    k_b: B::Weight,
    v_b: B::Weight,
    /// Host copies (shared bytes) of k_b / v_b, to reassemble `kv_b` on demand.
    k_b_host: HostWeight,
    v_b_host: HostWeight,
    /// Reassembled `kv_b` for [`AttnMode::Naive`].
    kv_b: Option<B::Weight>,
    out: B::Weight,
}

struct Gqa<B: Backend> {
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    bias: Option<[B::Weight; 3]>,
    qk_norm: Option<[B::Weight; 2]>,
    out: B::Weight,
}

enum Attn<B: Backend> {
    Mla(Box<Mla<B>>),
    Gqa(Gqa<B>),
}

struct Indexer<B: Backend> {
    q_b: B::Weight,
    k: B::Weight,
    k_norm: B::Weight,
    k_norm_b: B::Weight,
    proj: B::Weight,
}

struct Mlp<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Moe {
        router: B::Weight,
        bias: Option<B::Weight>,
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
        shared: Option<Mlp<B>>,
    },
}

struct Layer<B: Backend> {
    spec: LayerSpec,
    attn_norm: B::Weight,
    ffn_norm: B::Weight,
    attn: Attn<B>,
    indexer: Option<Indexer<B>>,
    ffn: Ffn<B>,
}

/// NextN / multi-token-prediction block: a full decoder layer plus its input projection and
/// norms, run by [`GlmModel::forward_draft`] (spec §1.12). Its logits come from the main head
/// (`shared_head_head`, when a file carries one, is a copy of it in DeepSeek-V3 and is not
/// split for tensor parallelism, so the vocabulary-split main head is used instead).
pub struct MtpLayer<B: Backend> {
    layer: Layer<B>,
    pub eh_proj: B::Weight,
    pub enorm: B::Weight,
    pub hnorm: B::Weight,
    pub shared_head_norm: B::Weight,
    pub embed_tokens: Option<B::Weight>,
    pub shared_head_head: Option<B::Weight>,
}

/// A loaded model of the GLM-5 family on backend `B` (one tensor-parallel rank's share of it
/// when its view says so).
pub struct GlmModel<B: Backend> {
    spec: ModelSpec,
    /// The attention dimensions of this rank (its heads).
    attn: AttentionSpec,
    view: ShardView,
    stats: LoadStats,
    backend: B,
    token_embd: B::Weight,
    output_norm: B::Weight,
    /// `None`: tied to `token_embd`.
    output: Option<B::Weight>,
    layers: Vec<Layer<B>>,
    mtp: Vec<MtpLayer<B>>,
    mode: AttnMode,
    /// Blocks leave their residual add to the next norm (the backend's choice by default).
    residual_into_norm: bool,
}

fn model_err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Model(msg.into())
}

/// What loading put on one rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Bytes of the weights this rank holds (its shares, as stored).
    pub weight_bytes: u64,
    /// Tensors whose share would cut quant blocks inside the rows, held as exact F32 values
    /// instead (with the bytes that costs over the quantized share).
    pub reencoded: Vec<(String, u64)>,
}

/// The MLA layout dims of `m` (its heads: a rank's heads for a rank's spec).
fn mla_dims(m: &MlaSpec) -> MlaDims {
    MlaDims {
        n_head: m.n_head,
        qk_nope: m.qk_nope,
        v_head: m.v_head,
        kv_lora: m.kv_lora_rank,
    }
}

fn map_err(e: mappings::MappingError) -> RuntimeError {
    RuntimeError::Model(e.to_string())
}

/// Which part of the model a role's share is cut from: the forward pass's side of every split
/// (the mapping table gives the axis). Everything else is replicated.
pub fn part_of(role: &str) -> Part {
    match role {
        "attn_q" | "attn_q_b" | "attn_q_bias" | "attn_k_b" | "attn_v_b" | "attn_kv_b"
        | "attn_output" => Part::Heads,
        "attn_k" | "attn_v" | "attn_k_bias" | "attn_v_bias" => Part::KvHeads,
        "ffn_gate" | "ffn_up" | "ffn_down" => Part::Ff,
        "ffn_gate_shexp" | "ffn_up_shexp" | "ffn_down_shexp" => Part::SharedFf,
        "ffn_gate_exps" | "ffn_up_exps" | "ffn_down_exps" => Part::Experts,
        "output" => Part::Vocab,
        _ => Part::Whole,
    }
}

/// Weight source: `get(name)` = the whole tensor as stored, `Ok(None)` when absent.
pub type WeightSource<'a> = &'a dyn Fn(&str) -> Result<Option<HostWeight>, RuntimeError>;

/// Reads each tensor by its role through the mapping table's name and shape, cuts this rank's
/// share along the table's axis and uploads it.
struct Loader<'a, B: Backend> {
    backend: &'a B,
    spec: &'a ModelSpec,
    view: &'a ShardView,
    get: WeightSource<'a>,
    stats: RefCell<LoadStats>,
    progress: Option<&'a (dyn Fn(u64) + Sync)>,
}

impl<B: Backend> Loader<'_, B> {
    fn spec_of(&self, role: &str, block: Option<usize>) -> Result<&TensorSpec, RuntimeError> {
        self.spec.tensor(role, block).ok_or_else(|| {
            model_err(format!(
                "the {} mapping table lists no tensor for role {role}{}",
                self.spec.arch.name(),
                block.map(|b| format!(" in block {b}")).unwrap_or_default()
            ))
        })
    }

    /// This rank's share of tensor `t`, read from `name` (the tensor itself, or the one that
    /// stands in for it), `None` when the file lacks it.
    fn share_of(&self, t: &TensorSpec, name: &str) -> Result<Option<HostWeight>, RuntimeError> {
        let Some(w) = (self.get)(name)? else {
            return Ok(None);
        };
        if w.dims() != t.dims.as_slice() {
            return Err(model_err(format!(
                "{} model: tensor {name} has shape {:?}, expected {:?}",
                self.spec.arch.name(),
                w.dims(),
                t.dims
            )));
        }
        let Some((axis, range)) = self.view.share_of(t, part_of(&t.role))? else {
            return Ok(Some(w));
        };
        let (share, reencoded) = w.shard(axis, range)?;
        if reencoded {
            let quantized = w.n_bytes() / w.dims()[axis] * share.dims()[axis];
            self.stats.borrow_mut().reencoded.push((
                name.to_string(),
                (share.n_bytes() as u64).saturating_sub(quantized as u64),
            ));
        }
        Ok(Some(share))
    }

    fn host(&self, role: &str, block: Option<usize>) -> Result<Option<HostWeight>, RuntimeError> {
        let t = self.spec_of(role, block)?;
        self.share_of(t, &t.name)
    }

    fn upload(&self, w: HostWeight) -> Result<B::Weight, RuntimeError> {
        let n = w.n_bytes() as u64;
        let up = self.backend.upload(w)?;
        self.stats.borrow_mut().weight_bytes += n;
        if let Some(p) = self.progress {
            p(n);
        }
        Ok(up)
    }

    fn req_host(&self, role: &str, block: Option<usize>) -> Result<HostWeight, RuntimeError> {
        self.host(role, block)?.ok_or_else(|| {
            model_err(format!(
                "missing tensor {}",
                self.spec_of(role, block).map_or(role, |t| t.name.as_str())
            ))
        })
    }

    fn req(&self, role: &str, block: Option<usize>) -> Result<B::Weight, RuntimeError> {
        self.upload(self.req_host(role, block)?)
    }

    /// A tensor the forward can do without; an error only if the table has no such role.
    fn opt(&self, role: &str, block: Option<usize>) -> Result<Option<B::Weight>, RuntimeError> {
        match self.spec.tensor(role, block) {
            None => Ok(None),
            Some(t) => self
                .share_of(t, &t.name)?
                .map(|w| self.upload(w))
                .transpose(),
        }
    }
}

impl<B: Backend> GlmModel<B> {
    /// Load an open GGUF model onto `backend` (the spec checks every tensor first).
    pub fn load(backend: B, model: Arc<gguf::Model>) -> Result<Self, RuntimeError> {
        Self::load_view(backend, model, None, None)
    }

    /// Load one tensor-parallel rank's share of `model` (`None`: the whole model), every share
    /// read in place from the memory-mapped file. `progress` is told the bytes of each weight
    /// once it is uploaded.
    pub fn load_view(
        backend: B,
        model: Arc<gguf::Model>,
        view: Option<ShardView>,
        progress: Option<&(dyn Fn(u64) + Sync)>,
    ) -> Result<Self, RuntimeError> {
        let spec = ModelSpec::from_model(&model)?;
        let view = view.unwrap_or_else(|| ShardView::single(&spec));
        let get = |name: &str| -> Result<Option<HostWeight>, RuntimeError> {
            if model.tensor(name).is_none() {
                return Ok(None);
            }
            HostWeight::from_model(&model, name).map(Some)
        };
        Self::build(backend, spec, view, &get, progress)
    }

    /// Build from a spec and a weight source (`get(name)` = `Ok(None)` when absent).
    pub fn from_weights(
        backend: B,
        spec: ModelSpec,
        get: WeightSource<'_>,
    ) -> Result<Self, RuntimeError> {
        let view = ShardView::single(&spec);
        Self::build(backend, spec, view, get, None)
    }

    fn build(
        backend: B,
        spec: ModelSpec,
        view: ShardView,
        get: WeightSource<'_>,
        progress: Option<&(dyn Fn(u64) + Sync)>,
    ) -> Result<Self, RuntimeError> {
        let attn = view.local_attention(&spec.attention);
        let ld = Loader {
            backend: &backend,
            spec: &spec,
            view: &view,
            get,
            stats: RefCell::new(LoadStats::default()),
            progress,
        };
        let token_embd = ld.req("token_embd", None)?;
        let output_norm = ld.req("output_norm", None)?;
        // The head's vocabulary rows are split; a tied head is the embedding table, cut the
        // same way (the embedding itself stays whole for the lookup).
        let head_spec = ld.spec_of("output", None)?;
        let output = match ld.share_of(head_spec, &head_spec.name)? {
            Some(w) => Some(ld.upload(w)?),
            None => {
                let tied = head_spec
                    .tied_to
                    .as_deref()
                    .unwrap_or(head_spec.name.as_str());
                let w = ld
                    .share_of(head_spec, tied)?
                    .ok_or_else(|| model_err(format!("missing tensor {tied}")))?;
                (view.world > 1).then(|| ld.upload(w)).transpose()?
            }
        };
        let mut layers = Vec::with_capacity(spec.n_layer);
        let mut mtp = Vec::new();
        for ls in &spec.layers {
            let b = Some(ls.index);
            if ls.mtp && ld.host("nextn_eh_proj", b)?.is_none() {
                continue;
            }
            let layer = Self::load_layer(&ld, &spec, &attn, ls)?;
            if ls.mtp {
                mtp.push(MtpLayer {
                    layer,
                    eh_proj: ld.req("nextn_eh_proj", b)?,
                    enorm: ld.req("nextn_enorm", b)?,
                    hnorm: ld.req("nextn_hnorm", b)?,
                    shared_head_norm: ld.req("nextn_shared_head_norm", b)?,
                    embed_tokens: ld.opt("nextn_embed_tokens", b)?,
                    shared_head_head: ld.opt("nextn_shared_head_head", b)?,
                });
            } else {
                layers.push(layer);
            }
        }
        if layers.len() != spec.n_layer {
            return Err(model_err(format!(
                "{} trunk layers loaded, spec has {}",
                layers.len(),
                spec.n_layer
            )));
        }
        let stats = ld.stats.into_inner();
        let residual_into_norm = backend.residual_into_norm();
        Ok(Self {
            spec,
            attn,
            view,
            stats,
            backend,
            token_embd,
            output_norm,
            output,
            layers,
            mtp,
            mode: AttnMode::Absorbed,
            residual_into_norm,
        })
    }

    fn load_layer(
        ld: &Loader<'_, B>,
        spec: &ModelSpec,
        attn: &AttentionSpec,
        ls: &LayerSpec,
    ) -> Result<Layer<B>, RuntimeError> {
        let b = Some(ls.index);
        let attn = match attn {
            AttentionSpec::Mla(m) => {
                let q_a = match m.q_lora_rank {
                    Some(_) => Some((ld.req("attn_q_a", b)?, ld.req("attn_q_a_norm", b)?)),
                    None => None,
                };
                let q_b = if q_a.is_some() {
                    ld.req("attn_q_b", b)?
                } else {
                    ld.req("attn_q", b)?
                };
                let (k_b_host, v_b_host) = if spec.kv_b_unsplit {
                    let kv = ld.req_host("attn_kv_b", b)?;
                    let (k, v) = kvb::split(&kv.to_f32()?, mla_dims(m)).map_err(map_err)?;
                    (
                        HostWeight::from_f32(
                            format!("{} (attn_k_b)", kv.name()),
                            vec![m.qk_nope, m.kv_lora_rank, m.n_head],
                            &k,
                        )?,
                        HostWeight::from_f32(
                            format!("{} (attn_v_b)", kv.name()),
                            vec![m.kv_lora_rank, m.v_head, m.n_head],
                            &v,
                        )?,
                    )
                } else {
                    (ld.req_host("attn_k_b", b)?, ld.req_host("attn_v_b", b)?)
                };
                let k_b = ld.upload(k_b_host.clone())?;
                let v_b = ld.upload(v_b_host.clone())?;
                Attn::Mla(Box::new(Mla {
                    q_a,
                    q_b,
                    kv_a: ld.req("attn_kv_a", b)?,
                    kv_a_norm: ld.req("attn_kv_a_norm", b)?,
                    k_b,
                    v_b,
                    k_b_host,
                    v_b_host,
                    kv_b: None,
                    out: ld.req("attn_output", b)?,
                }))
            }
            AttentionSpec::Gqa(g) => Attn::Gqa(Gqa {
                q: ld.req("attn_q", b)?,
                k: ld.req("attn_k", b)?,
                v: ld.req("attn_v", b)?,
                bias: if g.bias {
                    Some([
                        ld.req("attn_q_bias", b)?,
                        ld.req("attn_k_bias", b)?,
                        ld.req("attn_v_bias", b)?,
                    ])
                } else {
                    None
                },
                qk_norm: if g.qk_norm {
                    Some([ld.req("attn_q_norm", b)?, ld.req("attn_k_norm", b)?])
                } else {
                    None
                },
                out: ld.req("attn_output", b)?,
            }),
        };
        let indexer = if ls.own_indexer {
            Some(Indexer {
                q_b: ld.req("indexer_q_b", b)?,
                k: ld.req("indexer_k", b)?,
                k_norm: ld.req("indexer_k_norm", b)?,
                k_norm_b: ld.req("indexer_k_norm_bias", b)?,
                proj: ld.req("indexer_proj", b)?,
            })
        } else {
            None
        };
        let ffn = match (ls.ffn, &spec.moe) {
            (FfnKind::Moe, Some(e)) => Ffn::Moe {
                router: ld.req("ffn_router", b)?,
                bias: ld.opt("ffn_router_bias", b)?,
                gate: ld.req("ffn_gate_exps", b)?,
                up: ld.req("ffn_up_exps", b)?,
                down: ld.req("ffn_down_exps", b)?,
                shared: if e.n_shared > 0 {
                    Some(Mlp {
                        gate: ld.req("ffn_gate_shexp", b)?,
                        up: ld.req("ffn_up_shexp", b)?,
                        down: ld.req("ffn_down_shexp", b)?,
                    })
                } else {
                    None
                },
            },
            _ => Ffn::Dense(Mlp {
                gate: ld.req("ffn_gate", b)?,
                up: ld.req("ffn_up", b)?,
                down: ld.req("ffn_down", b)?,
            }),
        };
        Ok(Layer {
            spec: ls.clone(),
            attn_norm: ld.req("attn_norm", b)?,
            ffn_norm: ld.req("ffn_norm", b)?,
            attn,
            indexer,
            ffn,
        })
    }

    /// The whole model's spec (every rank's is the same; see [`GlmModel::view`] for the share).
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    /// Which part of the model this rank holds.
    pub fn view(&self) -> &ShardView {
        &self.view
    }
    /// What loading put on this rank.
    pub fn load_stats(&self) -> &LoadStats {
        &self.stats
    }
    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The NextN blocks' weights (the first one drafts, [`GlmModel::forward_draft`]).
    pub fn mtp_layers(&self) -> &[MtpLayer<B>] {
        &self.mtp
    }
    pub fn attn_mode(&self) -> AttnMode {
        self.mode
    }

    /// Switch MLA evaluation; [`AttnMode::Naive`] reassembles `kv_b` per layer (host f32) from
    /// this rank's `attn_k_b` / `attn_v_b` heads.
    pub fn set_attn_mode(&mut self, mode: AttnMode) -> Result<(), RuntimeError> {
        if let (AttnMode::Naive, AttentionSpec::Mla(m)) = (mode, &self.attn) {
            for layer in self.layers.iter_mut() {
                if let Attn::Mla(a) = &mut layer.attn {
                    if a.kv_b.is_none() {
                        let w = kvb::reassemble(
                            &a.k_b_host.to_f32()?,
                            &a.v_b_host.to_f32()?,
                            mla_dims(m),
                        )
                        .map_err(map_err)?;
                        a.kv_b = Some(self.backend.upload(HostWeight::from_f32(
                            format!("blk.{}.kv_b (reassembled)", layer.spec.index),
                            vec![m.kv_lora_rank, m.n_head * (m.qk_nope + m.v_head)],
                            &w,
                        )?)?);
                    }
                }
            }
        }
        self.mode = mode;
        Ok(())
    }

    /// Whether a block's residual add runs in the next block's norm (`add_rms_norm`) or at once
    /// (`add`): the same values either way (the backend's [`Backend::residual_into_norm`] by
    /// default; to compare the two).
    pub fn set_residual_into_norm(&mut self, on: bool) {
        self.residual_into_norm = on;
    }

    /// One layer's (cache columns, separate value columns, indexer key columns).
    fn cache_width(&self, l: &Layer<B>) -> (usize, Option<usize>, Option<usize>) {
        match &self.attn {
            AttentionSpec::Mla(m) => (
                m.cache_width(),
                None,
                l.indexer
                    .as_ref()
                    .and(self.spec.indexer.map(|i| i.head_dim)),
            ),
            AttentionSpec::Gqa(g) => (
                g.n_head_kv * g.head_dim,
                Some(g.n_head_kv * g.head_dim),
                None,
            ),
        }
    }

    /// Per trunk layer: [`GlmModel::cache_width`].
    fn cache_widths(&self) -> Vec<(usize, Option<usize>, Option<usize>)> {
        self.layers.iter().map(|l| self.cache_width(l)).collect()
    }

    /// A fresh, empty cache for this model.
    pub fn new_cache(&self) -> Result<KvCache<B>, RuntimeError> {
        KvCache::new(&self.backend, &self.cache_widths())
    }

    /// A fresh cache that also keeps the draft layer's state (speculative decoding).
    pub fn new_draft_cache(&self) -> Result<KvCache<B>, RuntimeError> {
        let mtp = self.mtp.first().ok_or(RuntimeError::NoDraftLayer)?;
        self.new_cache()?.with_draft(self.cache_width(&mtp.layer))
    }

    /// Bytes each cached token takes on this rank (f32 rows of every trunk layer; the MLA latent
    /// is replicated on every rank, GQA keys/values are split by KV heads).
    pub fn cache_bytes_per_token(&self) -> usize {
        self.cache_widths()
            .iter()
            .map(|&(kv, v, ik)| kv + v.unwrap_or(0) + ik.unwrap_or(0))
            .sum::<usize>()
            * std::mem::size_of::<f32>()
    }

    /// The batched forward pass with an optional observer of named activations. With several
    /// sequences the observed rows are the batch's rows stacked in order.
    pub fn forward_observed(
        &self,
        batch: &mut [SeqStep<'_>],
        obs: Option<Observer<'_>>,
    ) -> Result<Vec<Vec<f32>>, RuntimeError> {
        self.forward_head(batch, HeadOutput::Gathered, obs)
    }

    /// The batched forward pass of one rank, with the head's logits returned as `head` says
    /// (every rank of a group must ask for the same gathering, or the collectives do not meet).
    pub fn forward_head(
        &self,
        batch: &mut [SeqStep<'_>],
        head: HeadOutput,
        obs: Option<Observer<'_>>,
    ) -> Result<Vec<Vec<f32>>, RuntimeError> {
        self.step(batch, head, obs, |m, logits, segs, all| {
            m.logits_to_host(logits, segs, all)
        })
    }

    /// One batched step; `finish` turns the head's logits (`None` for [`HeadOutput::GatherOnly`])
    /// into the result before the caches commit (its failure rolls them back too).
    fn step<R>(
        &self,
        batch: &mut [SeqStep<'_>],
        head: HeadOutput,
        mut obs: Option<Observer<'_>>,
        finish: impl FnOnce(&Self, Option<B::Tensor>, &[Seg], &[bool]) -> Result<R, RuntimeError>,
    ) -> Result<R, RuntimeError> {
        let mut caches: Vec<&mut KvCache<B>> = Vec::with_capacity(batch.len());
        let mut tokens: Vec<u32> = Vec::new();
        let mut segs: Vec<Seg> = Vec::with_capacity(batch.len());
        let mut all_logits = Vec::with_capacity(batch.len());
        for step in batch.iter_mut() {
            let cache = step
                .seq
                .as_any_mut()
                .downcast_mut::<KvCache<B>>()
                .ok_or_else(|| RuntimeError::Backend("sequence state of another model".into()))?;
            check_step(&self.spec, cache.len, step.tokens)?;
            let n = step.tokens.len();
            segs.push(Seg {
                row0: tokens.len(),
                n,
                pos0: cache.len,
            });
            tokens.extend_from_slice(step.tokens);
            all_logits.push(step.all_logits);
            caches.push(cache);
        }
        let lens: Vec<usize> = caches.iter().map(|c| c.len).collect();
        let result = self
            .run(&tokens, &segs, &all_logits, &mut caches, head, &mut obs)
            .and_then(|l| finish(self, l, &segs, &all_logits));
        match result {
            Ok(out) => {
                for (c, s) in caches.iter_mut().zip(&segs) {
                    c.len = s.pos0 + s.n;
                }
                Ok(out)
            }
            Err(e) => {
                for (c, &len) in caches.iter_mut().zip(&lens) {
                    // Best effort: the step failed anyway; keep the cache consistent.
                    let _ = c.rollback(len);
                }
                Err(e)
            }
        }
    }

    fn emit(
        &self,
        obs: &mut Option<Observer<'_>>,
        name: impl FnOnce() -> String,
        t: &B::Tensor,
    ) -> Result<(), RuntimeError> {
        if let Some(o) = obs.as_mut() {
            let (rows, cols) = self.backend.shape(t);
            let data = self.backend.to_host(t)?;
            o(
                &name(),
                Activation::F32 {
                    rows,
                    cols,
                    data: &data,
                },
            );
        }
        Ok(())
    }

    fn emit_index(
        &self,
        obs: &mut Option<Observer<'_>>,
        name: impl FnOnce() -> String,
        t: &B::Index,
    ) -> Result<(), RuntimeError> {
        if let Some(o) = obs.as_mut() {
            let (rows, cols, data) = self.backend.index_to_host(t)?;
            o(
                &name(),
                Activation::Index {
                    rows,
                    cols,
                    data: &data,
                },
            );
        }
        Ok(())
    }

    /// What the router's top-k ranks, for an observer judging a differing expert choice by it
    /// (`cuda::check`): `blk.N.router.logits` (the raw logits, whose error bounds the keys'),
    /// `blk.N.router.choice` (the ranked values: [`crate::cpu::route_choice`], the CPU
    /// router's own definition, on host copies of this backend's logits and bias; experts of
    /// groups not kept hold [`MASKED_KEY`]) and, with group-limited routing, `blk.N.router.keys`
    /// (the same values unmasked: the groups' scores are computed from them).
    fn emit_route_keys(
        &self,
        obs: &mut Option<Observer<'_>>,
        bi: usize,
        logits: &B::Tensor,
        bias: Option<&B::Weight>,
        p: &RouteParams,
    ) -> Result<(), RuntimeError> {
        let Some(o) = obs.as_mut() else {
            return Ok(());
        };
        let be = &self.backend;
        let (rows, cols) = be.shape(logits);
        let l = be.to_host(logits)?;
        let b = bias.map(|b| be.vector_to_host(b)).transpose()?;
        crate::backend::check_route((rows, cols), b.as_ref().map(Vec::len), p)?;
        let grouped = crate::cpu::group_limited(p);
        let mut choice = Vec::with_capacity(l.len());
        let mut keys = Vec::with_capacity(if grouped { l.len() } else { 0 });
        for row in l.chunks_exact(cols.max(1)) {
            let (_, c) = crate::cpu::route_choice(row, b.as_deref(), p);
            if grouped {
                let ungrouped = RouteParams {
                    n_group: 1,
                    n_group_used: 1,
                    ..*p
                };
                keys.extend(crate::cpu::route_choice(row, b.as_deref(), &ungrouped).1);
            }
            choice.extend(c.into_iter().map(masked));
        }
        let mut out = vec![("logits", &l), ("choice", &choice)];
        if grouped {
            out.push(("keys", &keys));
        }
        for (what, data) in out {
            o(
                &format!("blk.{bi}.router.{what}"),
                Activation::F32 { rows, cols, data },
            );
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        tokens: &[u32],
        segs: &[Seg],
        all_logits: &[bool],
        caches: &mut [&mut KvCache<B>],
        head: HeadOutput,
        obs: &mut Option<Observer<'_>>,
    ) -> Result<Option<B::Tensor>, RuntimeError> {
        let be = &self.backend;
        let positions: Vec<u32> = segs
            .iter()
            .flat_map(|s| (s.pos0..s.pos0 + s.n).map(|p| p as u32))
            .collect();
        be.stage_positions(&positions)?;
        let embd = be.embed(&self.token_embd, tokens)?;
        self.emit(obs, || "token_embd.out".into(), &embd)?;
        let mut h = Residual::new(embd);
        // Selection of the last layer with its own indexer, per sequence (shared layers reuse it).
        let mut prev_sel: Vec<Option<B::Index>> = segs.iter().map(|_| None).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            h = self.decoder_layer(li, layer, h, &positions, segs, caches, &mut prev_sel, obs)?;
        }
        // Only the rows whose logits are wanted go through the head.
        let mut rows = Vec::new();
        for (s, &all) in segs.iter().zip(all_logits) {
            if all {
                rows.extend(s.row0..s.row0 + s.n);
            } else {
                rows.push(s.row0 + s.n - 1);
            }
        }
        // Every row wanted (one decoded token, or all logits): no gather copy.
        let every = rows.len() == be.shape(&h.h).0;
        // Drafting sequences keep every position's post-norm hidden state for the draft layer;
        // then the whole step is normalised once and the head rows are taken from it.
        let drafting = caches.iter().any(|c| c.draft.is_some());
        let hn = if drafting || every {
            let (_, n) = self.add_norm(h, &self.output_norm, obs)?;
            if drafting {
                self.keep_pending(&n, segs, caches)?;
            }
            if every {
                n
            } else {
                be.gather_rows(&n, &rows)?
            }
        } else {
            let h = self.settle(h, obs)?;
            be.rms_norm(
                &be.gather_rows(&h, &rows)?,
                &self.output_norm,
                self.spec.rms_eps,
            )?
        };
        self.emit(obs, || "output_norm.out".into(), &hn)?;
        self.head(&hn, head, obs, "logits")
    }

    /// Each sequence's logits rows on the host (none for a rank that only took part in the
    /// gather).
    fn logits_to_host(
        &self,
        logits: Option<B::Tensor>,
        segs: &[Seg],
        all_logits: &[bool],
    ) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let be = &self.backend;
        let Some(logits) = logits else {
            return Ok(Vec::new());
        };
        let v = be.shape(&logits).1;
        let host = be.to_host(&logits)?;
        let mut out = Vec::with_capacity(segs.len());
        let mut r = 0;
        for (s, &all) in segs.iter().zip(all_logits) {
            let n = if all { s.n } else { 1 };
            out.push(host[r * v..(r + n) * v].to_vec());
            r += n;
        }
        Ok(out)
    }

    /// Hand each drafting sequence its rows of the step's post-norm hidden states.
    fn keep_pending(
        &self,
        n: &B::Tensor,
        segs: &[Seg],
        caches: &mut [&mut KvCache<B>],
    ) -> Result<(), RuntimeError> {
        for (s, c) in segs.iter().zip(caches.iter_mut()) {
            if let Some(d) = c.draft.as_mut() {
                d.push_pending(self.backend.slice_rows(n, s.row0, s.n)?)?;
            }
        }
        Ok(())
    }

    /// The output head on normalised rows `hn`: the logits as `head` says, `None` for a rank
    /// that only takes part in the gather.
    fn head(
        &self,
        hn: &B::Tensor,
        head: HeadOutput,
        obs: &mut Option<Observer<'_>>,
        name: &str,
    ) -> Result<Option<B::Tensor>, RuntimeError> {
        let be = &self.backend;
        let w = self.output.as_ref().unwrap_or(&self.token_embd);
        // This rank's vocabulary rows.
        let local = be.matmul(hn, w)?;
        let (logits, to_host) = match head {
            HeadOutput::Gathered => (be.all_gather_cols(local)?, true),
            HeadOutput::GatherOnly => (be.all_gather_cols(local)?, false),
            HeadOutput::Local => (local, true),
        };
        self.emit(obs, || name.to_string(), &logits)?;
        Ok(to_host.then_some(logits))
    }

    /// One step of the NextN / MTP draft layer on `cache` (a drafting sequence; see
    /// [`LanguageModel::draft_forward`] for what `tokens` must be):
    /// `h' = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])`, one full decoder layer over the
    /// draft layer's own cache (positions = the trunk positions `i`), `shared_head_norm`, the
    /// main head on the last row. The order inside the concatenation is DeepSeek-V3's (vLLM and
    /// SGLang: embedding first). `h_i` is the trunk's state after `output_norm` for committed
    /// rows and the draft layer's own output after `shared_head_norm` for recursive rows (as
    /// SGLang recycles it; the fixture's layer was trained on post-norm trunk states).
    /// Returns the last row's logits as `head` says; on failure the state is as before.
    pub fn forward_draft(
        &self,
        cache: &mut KvCache<B>,
        tokens: &[u32],
        head: HeadOutput,
        obs: Option<Observer<'_>>,
    ) -> Result<Vec<f32>, RuntimeError> {
        self.forward_draft_with(cache, tokens, head, obs, |m, l| match l {
            Some(l) => m.backend.to_host(&l),
            None => Ok(Vec::new()),
        })
    }

    /// [`GlmModel::forward_draft`] with `finish` turning the last row's logits (on the device;
    /// `None` for a rank that only took part in the gather) into the result before the draft
    /// state commits (its failure leaves the state as before).
    pub fn forward_draft_with<R>(
        &self,
        cache: &mut KvCache<B>,
        tokens: &[u32],
        head: HeadOutput,
        mut obs: Option<Observer<'_>>,
        finish: impl FnOnce(&Self, Option<B::Tensor>) -> Result<R, RuntimeError>,
    ) -> Result<R, RuntimeError> {
        let mtp = self.mtp.first().ok_or(RuntimeError::NoDraftLayer)?;
        let d = cache.draft.as_deref_mut().ok_or_else(|| {
            RuntimeError::Backend("draft step on a sequence made without a draft layer".into())
        })?;
        let pending = d.pending_rows();
        let commit = pending > 0;
        if commit {
            if tokens.len() != pending {
                return Err(RuntimeError::Backend(format!(
                    "draft step: {} tokens for {pending} pending trunk states",
                    tokens.len()
                )));
            }
            // Rows drafted since the last commit are superseded by real trunk states.
            d.cache.truncate(d.committed)?;
        } else if tokens.len() != 1 || d.own.is_none() {
            return Err(RuntimeError::Backend(
                "draft step: without pending trunk states only one token can follow a \
                 previous draft step"
                    .into(),
            ));
        }
        let pos0 = d.cache.len;
        check_step(&self.spec, pos0, tokens)?;
        let input = if commit {
            d.pending.take()
        } else {
            d.own.take()
        }
        .ok_or_else(|| model_err("draft state without hidden input"))?;
        let r = self
            .draft_rows(mtp, &mut d.cache, &input, tokens, pos0, head, &mut obs)
            .and_then(|(last, l)| Ok((last, finish(self, l)?)));
        match r {
            Ok((last, logits)) => {
                d.cache.len = pos0 + tokens.len();
                if commit {
                    d.committed = d.cache.len;
                }
                d.own = Some(last);
                Ok(logits)
            }
            Err(e) => {
                let _ = d.cache.truncate(pos0);
                if commit {
                    d.pending = Some(input);
                } else {
                    d.own = Some(input);
                }
                Err(e)
            }
        }
    }

    /// The draft layer's rows `pos0 ..` from hidden states `hidden` and next tokens `tokens`:
    /// its post-`shared_head_norm` last row and that row's logits (on the device).
    #[allow(clippy::too_many_arguments)]
    fn draft_rows(
        &self,
        mtp: &MtpLayer<B>,
        cache: &mut KvCache<B>,
        hidden: &B::Tensor,
        tokens: &[u32],
        pos0: usize,
        head: HeadOutput,
        obs: &mut Option<Observer<'_>>,
    ) -> Result<(B::Tensor, Option<B::Tensor>), RuntimeError> {
        let be = &self.backend;
        let eps = self.spec.rms_eps;
        let bi = mtp.layer.spec.index;
        let n = tokens.len();
        let table = mtp.embed_tokens.as_ref().unwrap_or(&self.token_embd);
        let positions: Vec<u32> = (pos0..pos0 + n).map(|p| p as u32).collect();
        be.stage_positions(&positions)?;
        let e = be.rms_norm(&be.embed(table, tokens)?, &mtp.enorm, eps)?;
        let hh = be.rms_norm(hidden, &mtp.hnorm, eps)?;
        self.emit(obs, || format!("blk.{bi}.nextn.enorm.out"), &e)?;
        self.emit(obs, || format!("blk.{bi}.nextn.hnorm.out"), &hh)?;
        let x = be.matmul(&be.concat_cols(&[&e, &hh])?, &mtp.eh_proj)?;
        self.emit(obs, || format!("blk.{bi}.nextn.eh_proj.out"), &x)?;
        let segs = [Seg { row0: 0, n, pos0 }];
        let mut prev_sel = [None];
        let h = self.decoder_layer(
            0,
            &mtp.layer,
            Residual::new(x),
            &positions,
            &segs,
            &mut [cache],
            &mut prev_sel,
            obs,
        )?;
        let last = if n == 1 {
            self.add_norm(h, &mtp.shared_head_norm, obs)?.1
        } else {
            let h = self.settle(h, obs)?;
            be.rms_norm(&be.slice_rows(&h, n - 1, 1)?, &mtp.shared_head_norm, eps)?
        };
        self.emit(
            obs,
            || format!("blk.{bi}.nextn.shared_head_norm.out"),
            &last,
        )?;
        let logits = self.head(&last, head, obs, "nextn.logits")?;
        Ok((last, logits))
    }

    /// `h`'s pending block output added and the sum normalised by `w` (`add_rms_norm`: one op
    /// where a backend fuses them), or `h` normalised when nothing is pending: `(h, norm)`.
    /// Emits the finished block's `blk.N.out`.
    fn add_norm(
        &self,
        h: Residual<B::Tensor>,
        w: &B::Weight,
        obs: &mut Option<Observer<'_>>,
    ) -> Result<(B::Tensor, B::Tensor), RuntimeError> {
        let (be, eps) = (&self.backend, self.spec.rms_eps);
        match h.pending {
            None => {
                let x = be.rms_norm(&h.h, w, eps)?;
                Ok((h.h, x))
            }
            Some((f, bi)) => {
                let (h, x) = be.add_rms_norm(&h.h, &f, w, eps)?;
                self.emit(obs, || format!("blk.{bi}.out"), &h)?;
                Ok((h, x))
            }
        }
    }

    /// `h` with its pending block output added (emitting that block's `blk.N.out`).
    fn settle(
        &self,
        h: Residual<B::Tensor>,
        obs: &mut Option<Observer<'_>>,
    ) -> Result<B::Tensor, RuntimeError> {
        match h.pending {
            None => Ok(h.h),
            Some((f, bi)) => {
                let h = self.backend.add(&h.h, &f)?;
                self.emit(obs, || format!("blk.{bi}.out"), &h)?;
                Ok(h)
            }
        }
    }

    /// One decoder block on the residual stream `h` (attention, then FFN / MoE, each added back
    /// after its partial sums are reduced over the ranks; the FFN's add is left to the next
    /// norm when `residual_into_norm`). NextN blocks are the same layer.
    #[allow(clippy::too_many_arguments)]
    fn decoder_layer(
        &self,
        li: usize,
        layer: &Layer<B>,
        h: Residual<B::Tensor>,
        positions: &[u32],
        segs: &[Seg],
        caches: &mut [&mut KvCache<B>],
        prev_sel: &mut [Option<B::Index>],
        obs: &mut Option<Observer<'_>>,
    ) -> Result<Residual<B::Tensor>, RuntimeError> {
        let be = &self.backend;
        // Activations are named by GGUF block (the draft layer is blk.{n_layer}); `li` is the
        // layer's slot in the caches passed in.
        let bi = layer.spec.index;
        let (h, x) = self.add_norm(h, &layer.attn_norm, obs)?;
        self.emit(obs, || format!("blk.{bi}.attn_norm.out"), &x)?;
        let mut a = match (&layer.attn, &self.attn) {
            (Attn::Mla(w), AttentionSpec::Mla(m)) => {
                self.mla(li, layer, w, m, &x, positions, segs, caches, prev_sel, obs)?
            }
            (Attn::Gqa(w), AttentionSpec::Gqa(g)) => {
                self.gqa(li, w, g, &x, positions, segs, caches)?
            }
            _ => return Err(model_err("attention weights do not match the spec")),
        };
        // attn_output's input columns are this rank's heads: partial sums.
        be.all_reduce_sum(&mut a)?;
        self.emit(obs, || format!("blk.{bi}.attn_output.out"), &a)?;
        let (h, x) = be.add_rms_norm(&h, &a, &layer.ffn_norm, self.spec.rms_eps)?;
        self.emit(obs, || format!("blk.{bi}.ffn_norm.out"), &x)?;
        let mut f = self.ffn(bi, &layer.ffn, &x, obs)?;
        // Dense down / routed experts + shared expert: one reduction for the whole block.
        be.all_reduce_sum(&mut f)?;
        self.emit(obs, || format!("blk.{bi}.ffn.out"), &f)?;
        // The sum over the ranks is added: every rank adds the same f.
        let h = Residual {
            h,
            pending: Some((f, bi)),
        };
        if self.residual_into_norm {
            return Ok(h);
        }
        Ok(Residual::new(self.settle(h, obs)?))
    }

    #[allow(clippy::too_many_arguments)]
    fn mla(
        &self,
        li: usize,
        layer: &Layer<B>,
        w: &Mla<B>,
        m: &MlaSpec,
        x: &B::Tensor,
        positions: &[u32],
        segs: &[Seg],
        caches: &mut [&mut KvCache<B>],
        prev_sel: &mut [Option<B::Index>],
        obs: &mut Option<Observer<'_>>,
    ) -> Result<B::Tensor, RuntimeError> {
        let be = &self.backend;
        let bi = layer.spec.index;
        let rope = self.spec.rope;
        let h_n = m.n_head;
        let rope_p = |groups: usize, dim: usize| RopeParams {
            n_groups: groups,
            group_dim: dim,
            offset: 0,
            n_rot: rope.n_rot,
            theta: rope.theta,
            style: rope.style,
        };
        // The projections of the layer's input: q_a, kv_a and the indexer's keys, one stacked
        // product where the backend can.
        let ix_w = match (&self.spec.indexer, &layer.indexer) {
            (Some(_), Some(iw)) => Some(iw),
            _ => None,
        };
        let mut stack: Vec<&B::Weight> = Vec::with_capacity(3);
        stack.extend(w.q_a.as_ref().map(|(qa, _)| qa));
        stack.push(&w.kv_a);
        stack.extend(ix_w.map(|iw| &iw.k));
        let mut outs = be.matmul_stacked(x, &stack)?.into_iter();
        let mut next = || {
            outs.next()
                .ok_or_else(|| model_err("matmul_stacked: output missing"))
        };
        let q_a_out = w.q_a.as_ref().map(|_| next()).transpose()?;
        let kv_a = next()?;
        let ix_k_out = ix_w.map(|_| next()).transpose()?;
        // The indexer's queries are needed only when some query sees more than top_k keys
        // (otherwise every causal key is selected: dense attention); then q_b and the
        // indexer's q_b, both of the normalised q_a, are one stacked product too.
        let ix_q_needed = match (&self.spec.indexer, ix_w) {
            (Some(ix), Some(_)) => segs.iter().any(|s| s.pos0 + s.n > ix.top_k),
            _ => false,
        };
        // Compressed keys/values: normalised in place below, so an observer gets a copy, emitted
        // after the queries (the order the activations always had: doctor's first divergence).
        let kv_a_seen = match obs {
            Some(_) => Some(be.slice_cols(&kv_a, 0, be.shape(&kv_a).1)?),
            None => None,
        };
        // The projections' norms, one op where the backend fuses them: q_a's; the cache rows in
        // place (latent normalised, the shared key part roped); the indexer's keys (always: they
        // are cached). A step of one sequence appends its rows to the caches in the same op
        // (batches per sequence below).
        let single = segs.len() == 1;
        let k_rope = RopeParams {
            offset: m.kv_lora_rank,
            ..rope_p(1, m.cache_width())
        };
        let ix_rope = self.spec.indexer.as_ref().map(|ix| rope_p(1, ix.head_dim));
        let (kv_cache, ix_cache) = if single {
            let lc = &mut caches[0].layers[li];
            (Some(&mut lc.kv), lc.index_keys.as_mut())
        } else {
            (None, None)
        };
        let q_norm = match (&w.q_a, &q_a_out) {
            (Some((_, qa_norm)), Some(r)) => Some((r, qa_norm, m.lora_norm_eps)),
            _ => None,
        };
        let ix_args = match (&self.spec.indexer, ix_w, ix_k_out, &ix_rope) {
            (Some(ix), Some(iw), Some(k), Some(p)) => Some(IndexerKeysArgs {
                k,
                w: &iw.k_norm,
                b: &iw.k_norm_b,
                eps: ix.norm_eps,
                p,
                cache: ix_cache,
            }),
            _ => None,
        };
        let kv_args = KvRowsArgs {
            kv_a,
            w: &w.kv_a_norm,
            n: m.kv_lora_rank,
            eps: m.lora_norm_eps,
            p: &k_rope,
            cache: kv_cache,
        };
        let (q_a_normed, kv_rows, ix_k) = be.mla_norms(q_norm, kv_args, ix_args, positions)?;
        // Queries.
        let mut ix_q_raw = None;
        let q = match q_a_normed {
            Some(r) => {
                self.emit(obs, || format!("blk.{bi}.attn_q_a_norm.out"), &r)?;
                match ix_w.filter(|_| ix_q_needed) {
                    Some(iw) => {
                        let mut o = be.matmul_stacked(&r, &[&w.q_b, &iw.q_b])?.into_iter();
                        let (q, qi) = o
                            .next()
                            .zip(o.next())
                            .ok_or_else(|| model_err("matmul_stacked: output missing"))?;
                        ix_q_raw = Some(qi);
                        q
                    }
                    None => be.matmul(&r, &w.q_b)?,
                }
            }
            None => be.matmul(x, &w.q_b)?,
        };
        self.emit(obs, || format!("blk.{bi}.attn_q_b.out"), &q)?;
        if let Some(k) = &kv_a_seen {
            self.emit(obs, || format!("blk.{bi}.attn_kv_a_mqa.out"), k)?;
        }
        if obs.is_some() {
            // RoPE leaves the latent columns as normalised.
            let lat = be.slice_cols(&kv_rows, 0, m.kv_lora_rank)?;
            self.emit(obs, || format!("blk.{bi}.attn_kv_a_norm.out"), &lat)?;
        }

        // Lightning indexer: queries only when some query sees more than top_k keys
        // (otherwise every causal key is selected: dense attention).
        let mut ix_q = None;
        let mut ix_keys = None;
        if let (Some(ix), Some(iw), Some(k)) = (&self.spec.indexer, ix_w, ix_k) {
            self.emit(obs, || format!("blk.{bi}.indexer.k.out"), &k)?;
            ix_keys = Some(k);
            if ix_q_needed {
                let mut qi = ix_q_raw
                    .take()
                    .ok_or_else(|| model_err("indexer without q_lora"))?;
                be.rope(&mut qi, positions, &rope_p(ix.n_head, ix.head_dim))?;
                // transformers: weights_proj(x) * n_heads^-0.5 (the softmax scale is applied to
                // the dot products, as there).
                let wts = be.scale(
                    &be.matmul(x, &iw.proj)?,
                    (ix.n_head as f64).powf(-0.5) as f32,
                )?;
                self.emit(obs, || format!("blk.{bi}.indexer.q.out"), &qi)?;
                self.emit(obs, || format!("blk.{bi}.indexer.weights.out"), &wts)?;
                ix_q = Some((qi, wts));
            }
        }

        // Queries against the latent cache (absorbed: their position-free part through k_b,
        // the rope part roped) or against keys expanded through kv_b (naive).
        let q_rope = rope_p(h_n, m.qk_rope);
        let q_abs = match self.mode {
            AttnMode::Absorbed => Some(be.mla_queries(&q, &w.k_b, m.qk_nope, positions, &q_rope)?),
            AttnMode::Naive => None,
        };
        let q_full = match self.mode {
            AttnMode::Naive => {
                let q_nope = be.head_slice(&q, h_n, m.qk_head(), 0, m.qk_nope)?;
                let mut q_rot = be.head_slice(&q, h_n, m.qk_head(), m.qk_nope, m.qk_rope)?;
                be.rope(&mut q_rot, positions, &q_rope)?;
                Some(be.head_concat(&q_nope, &q_rot, h_n, false)?)
            }
            AttnMode::Absorbed => None,
        };
        let mut outs = Vec::with_capacity(segs.len());
        let mut observed_sel: Vec<(usize, usize, Vec<i64>)> = Vec::new();
        // What the indexer ranks, for an observer judging a differing key selection by it
        // (`cuda::check`): recomputed on the host by the CPU's own formula
        // (`cpu::indexer_scores`) from host copies of this backend's indexer inputs (queries,
        // weights, cached keys). That reads the one definition of the scores the CPU op ranks
        // without a second backend op (and a CUDA kernel) that would return them; it costs a
        // host pass over the keys, observed forwards only.
        let mut observed_scores: Vec<(usize, usize, Vec<f32>)> = Vec::new();
        let ix_host = match (&ix_q, obs.is_some() && layer.spec.own_indexer) {
            (Some((qi, wts)), true) => Some((be.to_host(qi)?, be.to_host(wts)?)),
            _ => None,
        };
        let ix_params = |ix: &crate::spec::IndexerSpec, pos0: usize| IndexerParams {
            n_head: ix.n_head,
            head_dim: ix.head_dim,
            scale: (ix.head_dim as f64).powf(-0.5) as f32,
            top_k: ix.top_k,
            pos0,
        };
        if !single {
            // A batched step appends every sequence's rows in one op per cache kind.
            let counts: Vec<usize> = segs.iter().map(|s| s.n).collect();
            let mut kvs: Vec<&mut B::Tensor> =
                caches.iter_mut().map(|c| &mut c.layers[li].kv).collect();
            be.append_rows_seqs(&mut kvs, &kv_rows, &counts)?;
            if let Some(keys) = &ix_keys {
                let mut iks: Vec<&mut B::Tensor> = caches
                    .iter_mut()
                    .filter_map(|c| c.layers[li].index_keys.as_mut())
                    .collect();
                // Every sequence of a model caches them, or (a cache made without) none.
                if !iks.is_empty() {
                    if iks.len() != segs.len() {
                        return Err(model_err("indexer keys cached for some sequences only"));
                    }
                    be.append_rows_seqs(&mut iks, keys, &counts)?;
                }
            }
        }
        let mut sels: Vec<Option<B::Index>> = Vec::with_capacity(segs.len());
        for (si, s) in segs.iter().enumerate() {
            let cache = &mut caches[si].layers[li];
            let t = s.pos0 + s.n;
            let sel = match (&self.spec.indexer, layer.spec.own_indexer) {
                (Some(ix), true) => match (&ix_q, &cache.index_keys) {
                    (Some((qi, wts)), Some(keys)) if t > ix.top_k => Some(be.indexer_topk(
                        &*self.seg_rows(qi, s, segs)?,
                        &*self.seg_rows(wts, s, segs)?,
                        keys,
                        &ix_params(ix, s.pos0),
                    )?),
                    _ => None,
                },
                (Some(_), false) => prev_sel[si].take(),
                (None, _) => None,
            };
            if obs.is_some() {
                if let Some(ix) = &self.spec.indexer {
                    observed_sel.push(match &sel {
                        Some(sl) => be.index_to_host(sl)?,
                        None => dense_selection(s, ix.top_k.min(t)),
                    });
                    // A shared indexer's layer copies the previous layer's selection: the
                    // scores were that layer's (observed there).
                    if layer.spec.own_indexer {
                        observed_scores.push(match (&sel, &ix_host, &cache.index_keys) {
                            (Some(_), Some((qh, wh)), Some(keys)) => observed_index_scores(
                                qh,
                                wh,
                                &be.to_host(keys)?,
                                s,
                                t,
                                &ix_params(ix, s.pos0),
                            )?,
                            _ => dense_scores(s, t),
                        });
                    }
                }
            }
            if self.mode == AttnMode::Absorbed {
                // Absorbed attention runs once for the batch, below.
                sels.push(sel);
                continue;
            }
            let p = AttnParams {
                n_head: h_n,
                n_kv_head: 1,
                k_dim: m.cache_width(),
                v_dim: m.kv_lora_rank,
                scale: m.scale,
                pos0: s.pos0,
            };
            let o = match (self.mode, &q_full) {
                (AttnMode::Naive, Some(qf)) => {
                    let kv_b = w
                        .kv_b
                        .as_ref()
                        .ok_or_else(|| model_err("naive attention without kv_b"))?;
                    let latent = be.slice_cols(&cache.kv, 0, m.kv_lora_rank)?;
                    let kr = be.slice_cols(&cache.kv, m.kv_lora_rank, m.qk_rope)?;
                    let e = be.matmul(&latent, kv_b)?;
                    let kn = be.head_slice(&e, h_n, m.qk_nope + m.v_head, 0, m.qk_nope)?;
                    let vv = be.head_slice(&e, h_n, m.qk_nope + m.v_head, m.qk_nope, m.v_head)?;
                    let kk = be.head_concat(&kn, &kr, h_n, true)?;
                    let qs = self.seg_rows(qf, s, segs)?;
                    let p = AttnParams {
                        n_kv_head: h_n,
                        k_dim: m.qk_head(),
                        v_dim: m.v_head,
                        ..p
                    };
                    be.attention(&*qs, &kk, &vv, &p, sel.as_ref())?
                }
                _ => return Err(model_err("attention mode state")),
            };
            outs.push(o);
            prev_sel[si] = sel;
        }
        if let (AttnMode::Absorbed, Some(qa)) = (self.mode, &q_abs) {
            let p = AttnParams {
                n_head: h_n,
                n_kv_head: 1,
                k_dim: m.cache_width(),
                v_dim: m.kv_lora_rank,
                scale: m.scale,
                pos0: 0,
            };
            let seqs: Vec<SeqAttn<'_, B>> = segs
                .iter()
                .zip(caches.iter())
                .zip(&sels)
                .map(|((s, c), sel)| SeqAttn {
                    rows: s.n,
                    pos0: s.pos0,
                    k: &c.layers[li].kv,
                    v: &c.layers[li].kv,
                    selected: sel.as_ref(),
                })
                .collect();
            outs.push(be.attention_seqs(qa, &seqs, &p)?);
            drop(seqs);
            for (ps, sel) in prev_sel.iter_mut().zip(sels) {
                *ps = sel;
            }
        }
        if let Some(o) = obs.as_mut() {
            if !observed_scores.is_empty() {
                let (rows, cols, data) = pad_rows(&observed_scores, MASKED_KEY);
                o(
                    &format!("blk.{bi}.indexer.scores"),
                    Activation::F32 {
                        rows,
                        cols,
                        data: &data,
                    },
                );
            }
            if !observed_sel.is_empty() {
                let (rows, cols, data) = pad_rows(&observed_sel, -1);
                o(
                    &format!("blk.{bi}.indexer.topk_indices"),
                    Activation::Index {
                        rows,
                        cols,
                        data: &data,
                    },
                );
            }
        }
        let o = self.stack_rows(outs)?;
        let o = match self.mode {
            AttnMode::Absorbed => be.matmul_heads(&o, &w.v_b)?,
            AttnMode::Naive => o,
        };
        be.matmul(&o, &w.out)
    }

    #[allow(clippy::too_many_arguments)]
    fn gqa(
        &self,
        li: usize,
        w: &Gqa<B>,
        g: &GqaSpec,
        x: &B::Tensor,
        positions: &[u32],
        segs: &[Seg],
        caches: &mut [&mut KvCache<B>],
    ) -> Result<B::Tensor, RuntimeError> {
        let be = &self.backend;
        let mut q = be.matmul(x, &w.q)?;
        let mut k = be.matmul(x, &w.k)?;
        let mut v = be.matmul(x, &w.v)?;
        if let Some([qb, kb, vb]) = &w.bias {
            q = be.add_bias(&q, qb)?;
            k = be.add_bias(&k, kb)?;
            v = be.add_bias(&v, vb)?;
        }
        if let Some([qn, kn]) = &w.qk_norm {
            q = be.rms_norm(&q, qn, self.spec.rms_eps)?;
            k = be.rms_norm(&k, kn, self.spec.rms_eps)?;
        }
        let rp = |groups| RopeParams {
            n_groups: groups,
            group_dim: g.head_dim,
            offset: 0,
            n_rot: self.spec.rope.n_rot,
            theta: self.spec.rope.theta,
            style: self.spec.rope.style,
        };
        be.rope(&mut q, positions, &rp(g.n_head))?;
        be.rope(&mut k, positions, &rp(g.n_head_kv))?;
        let mut outs = Vec::with_capacity(segs.len());
        for (si, s) in segs.iter().enumerate() {
            let cache = &mut caches[si].layers[li];
            be.append_rows(&mut cache.kv, &*self.seg_rows(&k, s, segs)?)?;
            let cv = cache
                .v
                .as_mut()
                .ok_or_else(|| model_err("GQA cache without values"))?;
            be.append_rows(cv, &*self.seg_rows(&v, s, segs)?)?;
            let p = AttnParams {
                n_head: g.n_head,
                n_kv_head: g.n_head_kv,
                k_dim: g.head_dim,
                v_dim: g.head_dim,
                scale: g.scale,
                pos0: s.pos0,
            };
            let qs = self.seg_rows(&q, s, segs)?;
            outs.push(be.attention(&*qs, &cache.kv, cv, &p, None)?);
        }
        be.matmul(&self.stack_rows(outs)?, &w.out)
    }

    /// Rows of segment `s` of a batch-stacked tensor: the tensor itself when the batch is that
    /// one sequence (no copy on the decode path).
    fn seg_rows<'x>(
        &self,
        x: &'x B::Tensor,
        s: &Seg,
        segs: &[Seg],
    ) -> Result<SegRows<'x, B::Tensor>, RuntimeError> {
        if segs.len() == 1 {
            return Ok(SegRows::Whole(x));
        }
        Ok(SegRows::Part(self.backend.slice_rows(x, s.row0, s.n)?))
    }

    /// The per-sequence parts stacked in order (one part: itself).
    fn stack_rows(&self, mut parts: Vec<B::Tensor>) -> Result<B::Tensor, RuntimeError> {
        if parts.len() == 1 {
            if let Some(p) = parts.pop() {
                return Ok(p);
            }
        }
        let refs: Vec<&B::Tensor> = parts.iter().collect();
        self.backend.concat_rows(&refs)
    }

    fn mlp(&self, m: &Mlp<B>, x: &B::Tensor) -> Result<B::Tensor, RuntimeError> {
        let be = &self.backend;
        be.matmul(&be.glu(x, &m.gate, &m.up)?, &m.down)
    }

    fn ffn(
        &self,
        bi: usize,
        f: &Ffn<B>,
        x: &B::Tensor,
        obs: &mut Option<Observer<'_>>,
    ) -> Result<B::Tensor, RuntimeError> {
        let be = &self.backend;
        match f {
            Ffn::Dense(m) => self.mlp(m, x),
            Ffn::Moe {
                router,
                bias,
                gate,
                up,
                down,
                shared,
            } => {
                let e = self
                    .spec
                    .moe
                    .ok_or_else(|| model_err("MoE layer without expert parameters"))?;
                // The router runs in f32 on f32 weights (never quantised in GGUF).
                let logits = be.matmul(x, router)?;
                let rp = RouteParams {
                    n_expert: e.n_expert,
                    n_used: e.n_used,
                    n_group: e.n_group,
                    n_group_used: e.n_group_used,
                    gating: e.gating,
                    normalize: e.normalize,
                    scale: e.scale,
                };
                let (wts, ids) = be.moe_route(&logits, bias.as_ref(), &rp)?;
                if obs.is_some() {
                    self.emit_route_keys(obs, bi, &logits, bias.as_ref(), &rp)?;
                }
                self.emit(obs, || format!("blk.{bi}.router.weights"), &wts)?;
                self.emit_index(obs, || format!("blk.{bi}.router.experts"), &ids)?;
                // Expert parallelism: this rank computes only the chosen experts it holds.
                let ids = if self.view.whole_experts() {
                    let r = &self.view.experts;
                    be.local_expert_ids(ids, r.start, r.len())?
                } else {
                    ids
                };
                match shared {
                    // The shared expert's down projection adds onto the routed sum.
                    Some(m) => {
                        be.moe_ffn_shared(x, gate, up, down, &wts, &ids, (&m.gate, &m.up, &m.down))
                    }
                    None => be.moe_ffn(x, gate, up, down, &wts, &ids),
                }
            }
        }
    }
}

/// Refuse a step a model cannot take: no tokens, more than its context, an id outside its
/// vocabulary (`cached`: tokens already in the sequence's cache).
pub(crate) fn check_step(
    spec: &ModelSpec,
    cached: usize,
    tokens: &[u32],
) -> Result<(), RuntimeError> {
    if tokens.is_empty() {
        return Err(RuntimeError::Backend("a step without tokens".into()));
    }
    let need = cached + tokens.len();
    if need > spec.n_ctx_train {
        return Err(RuntimeError::ContextExceeded {
            need,
            max: spec.n_ctx_train,
        });
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= spec.n_vocab) {
        return Err(RuntimeError::Backend(format!(
            "token id {bad} out of range (vocabulary {})",
            spec.n_vocab
        )));
    }
    Ok(())
}

/// How a rank returns the head's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadOutput {
    /// The whole vocabulary (gathered over the ranks), copied to the host.
    Gathered,
    /// Take part in the gather but return nothing (ranks other than the one that reports).
    GatherOnly,
    /// This rank's vocabulary rows only (merged per token by the caller, e.g. greedy top-k).
    Local,
}

/// A segment's rows: borrowed when they are the whole tensor, else a copy.
enum SegRows<'x, T> {
    Whole(&'x T),
    Part(T),
}

impl<T> std::ops::Deref for SegRows<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            SegRows::Whole(t) => t,
            SegRows::Part(t) => t,
        }
    }
}

/// Rows of one sequence inside the stacked batch.
#[derive(Debug, Clone, Copy)]
struct Seg {
    row0: usize,
    n: usize,
    pos0: usize,
}

/// The indexer's scores of segment `s`'s queries (`q`, `w`: the whole batch's rows, host copies)
/// against its `t` cached keys (`keys`, `[t, head_dim]`): `[s.n, t]`, the keys past each query's
/// position [`MASKED_KEY`].
fn observed_index_scores(
    q: &[f32],
    w: &[f32],
    keys: &[f32],
    s: &Seg,
    t: usize,
    p: &IndexerParams,
) -> Result<(usize, usize, Vec<f32>), RuntimeError> {
    use rayon::prelude::*;
    let (qw, ww) = (p.n_head * p.head_dim, p.n_head);
    if q.len() < (s.row0 + s.n) * qw || w.len() < (s.row0 + s.n) * ww || keys.len() < t * p.head_dim
    {
        return Err(model_err(
            "observed indexer scores: inputs shorter than the step",
        ));
    }
    let mut d = vec![MASKED_KEY; s.n * t];
    d.par_chunks_mut(t.max(1)).enumerate().for_each(|(i, row)| {
        let r = s.row0 + i;
        let valid = (s.pos0 + i + 1).min(t);
        let sc = crate::cpu::indexer_scores(
            &q[r * qw..(r + 1) * qw],
            &w[r * ww..(r + 1) * ww],
            keys,
            valid,
            p,
        );
        row[..sc.len()].copy_from_slice(&sc);
    });
    Ok((s.n, t, d))
}

/// A dense step's "scores" in the form of [`observed_index_scores`]: every causal key is
/// selected without ranking (0), the later ones masked.
fn dense_scores(s: &Seg, t: usize) -> (usize, usize, Vec<f32>) {
    let mut d = vec![MASKED_KEY; s.n * t];
    for i in 0..s.n {
        for j in 0..(s.pos0 + i + 1).min(t) {
            d[i * t + j] = 0.0;
        }
    }
    (s.n, t, d)
}

/// What a dense step selects, in the indexer's output form: row `i` lists keys `0 ..= pos0 + i`.
fn dense_selection(s: &Seg, cols: usize) -> (usize, usize, Vec<i64>) {
    let mut d = vec![-1i64; s.n * cols];
    for i in 0..s.n {
        for j in 0..=(s.pos0 + i).min(cols.saturating_sub(1)) {
            d[i * cols + j] = j as i64;
        }
    }
    (s.n, cols, d)
}

impl<B: Backend> LanguageModel for GlmModel<B> {
    fn new_sequence(&self) -> Box<dyn SequenceState> {
        match self.new_cache() {
            Ok(c) => Box::new(c),
            // Creating empty tensors only fails on a broken device; the first forward call on
            // this placeholder then reports "sequence state of another model".
            Err(_) => Box::new(NoCache),
        }
    }
    fn vocab_size(&self) -> usize {
        self.spec.n_vocab
    }
    fn context_length(&self) -> usize {
        self.spec.n_ctx_train
    }
    fn forward(&self, batch: &mut [SeqStep<'_>]) -> Result<Vec<Vec<f32>>, RuntimeError> {
        self.forward_observed(batch, None)
    }
    fn draft_layers(&self) -> usize {
        self.mtp.len()
    }
    fn new_draft_sequence(&self) -> Result<Box<dyn SequenceState>, RuntimeError> {
        Ok(Box::new(self.new_draft_cache()?))
    }
    fn draft_forward(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
    ) -> Result<Vec<f32>, RuntimeError> {
        let cache = seq
            .as_any_mut()
            .downcast_mut::<KvCache<B>>()
            .ok_or_else(|| RuntimeError::Backend("sequence state of another model".into()))?;
        self.forward_draft(cache, tokens, HeadOutput::Gathered, None)
    }
    fn draft_forward_greedy(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
    ) -> Result<Sampled, RuntimeError> {
        let cache = seq
            .as_any_mut()
            .downcast_mut::<KvCache<B>>()
            .ok_or_else(|| RuntimeError::Backend("sequence state of another model".into()))?;
        self.forward_draft_with(cache, tokens, HeadOutput::Gathered, None, |m, l| {
            let l = l.ok_or_else(|| model_err("draft step: no logits"))?;
            let reqs = [SampleRequest::greedy()];
            let ids = m.backend.sample(&l, &reqs)?;
            finish_rows(&ids, &reqs, None, m.spec.n_vocab)
                .pop()
                .ok_or_else(|| model_err("draft step: no id"))
        })
    }
    /// Greedy ids of every row on the device (only the ids come back).
    fn forward_greedy_rows(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
    ) -> Result<Vec<Sampled>, RuntimeError> {
        let reqs = vec![SampleRequest::greedy(); tokens.len()];
        let mut batch = [SeqStep {
            seq,
            tokens,
            all_logits: true,
        }];
        self.step(&mut batch, HeadOutput::Gathered, None, |m, logits, _, _| {
            let logits = logits.ok_or_else(|| model_err("greedy rows: no logits"))?;
            let ids = m.backend.sample(&logits, &reqs)?;
            Ok(finish_rows(&ids, &reqs, None, m.spec.n_vocab))
        })
    }
    /// Samples with the backend's sampler on the gathered logits (on the GPU: only the ids
    /// and, for requests with log-probabilities, the logits come back).
    fn forward_sample(
        &self,
        batch: &mut [SeqStep<'_>],
        reqs: &[SampleRequest],
    ) -> Result<Vec<Sampled>, RuntimeError> {
        check_requests(batch, reqs)?;
        self.step(batch, HeadOutput::Gathered, None, |m, logits, _, _| {
            let be = &m.backend;
            let logits = logits.ok_or_else(|| model_err("forward_sample: no logits"))?;
            let ids = be.sample(&logits, reqs)?;
            let host = if reqs.iter().any(|r| r.logprobs.is_some()) {
                Some(be.to_host(&logits)?)
            } else {
                None
            };
            let v = be.shape(&logits).1;
            Ok(finish_rows(&ids, reqs, host.as_deref(), v))
        })
    }
}

struct NoCache;

impl SequenceState for NoCache {
    fn len(&self) -> usize {
        0
    }
    fn cache_bytes(&self) -> usize {
        0
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// Open a GGUF model of a supported architecture on the CPU backend.
pub fn load_cpu(model: Arc<gguf::Model>) -> Result<GlmModel<crate::cpu::CpuBackend>, RuntimeError> {
    GlmModel::load(crate::cpu::CpuBackend, model)
}
