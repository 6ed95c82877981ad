//! `ModelSpec`: the typed description of a model built from its GGUF hyper-parameters. This is the
//! only place that interprets metadata keys; backends and forward passes read the spec. Building a
//! spec also checks every tensor the architecture needs (name and ggml shape) and refuses a model
//! that does not fit, naming the tensor and both shapes.
//!
//! Supported families: `glm-dsa` (GLM-5: MLA + DSA lightning indexer + MoE), `deepseek2`
//! (MLA + MoE, no indexer) and `glm4moe` (GLM-4.5: grouped-query attention + MoE).

use crate::backend::{Gating, RopeStyle};
use crate::RuntimeError;
use gguf::{Metadata, Value};
use mappings::shard::ShardRole;

/// Model families this runtime understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    GlmDsa,
    Deepseek2,
    Glm4Moe,
}

impl Arch {
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "glm-dsa" => Some(Self::GlmDsa),
            "deepseek2" => Some(Self::Deepseek2),
            "glm4moe" => Some(Self::Glm4Moe),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::GlmDsa => "glm-dsa",
            Self::Deepseek2 => "deepseek2",
            Self::Glm4Moe => "glm4moe",
        }
    }
}

/// Rotary embedding of the rotated dims.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    pub theta: f32,
    pub n_rot: usize,
    pub style: RopeStyle,
}

/// Multi-head latent attention (DeepSeek-V2/V3, GLM-5).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaSpec {
    pub n_head: usize,
    /// `None`: queries come straight from `attn_q` (DeepSeek-V2-Lite).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
    /// Softmax scale `qk_head_dim^-0.5`.
    pub scale: f32,
    /// Epsilon of the q_a / kv_a RMSNorms: transformers builds them with the class default 1e-6,
    /// not `rms_norm_eps` (spec §1.3; llama.cpp uses the file's 1e-5).
    pub lora_norm_eps: f32,
}

impl MlaSpec {
    pub fn qk_head(&self) -> usize {
        self.qk_nope + self.qk_rope
    }
    /// Width of one cached token: normalised latent then roped key part.
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope
    }
}

/// Grouped-query attention (GLM-4.5 family).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GqaSpec {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub bias: bool,
    pub qk_norm: bool,
    pub scale: f32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttentionSpec {
    Mla(MlaSpec),
    Gqa(GqaSpec),
}

/// DSA lightning indexer (GLM-5, DeepSeek-V3.2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexerSpec {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// `k_norm` is `nn.LayerNorm(head_dim, eps=1e-6)` in transformers; GGUF stores no epsilon.
    pub norm_eps: f32,
}

/// Routed experts (+ shared experts).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    pub n_expert: usize,
    pub n_used: usize,
    pub n_ff: usize,
    pub n_shared: usize,
    pub n_group: usize,
    pub n_group_used: usize,
    pub gating: Gating,
    pub normalize: bool,
    pub scale: f32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Moe,
}

/// One decoder block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpec {
    /// GGUF block number (`blk.N`).
    pub index: usize,
    pub ffn: FfnKind,
    /// Whether this block has its own indexer ("full"); otherwise it reuses the previous
    /// full block's selection ("shared", GLM-5.2 IndexShare). Always false without an indexer.
    pub own_indexer: bool,
    /// A NextN / multi-token-prediction block (after the trunk; not part of the forward pass).
    pub mtp: bool,
}

/// A tensor of the model as its architecture's mapping table (`mappings/data/<arch>.yaml`) lists
/// it, resolved over this model's metadata: names, shapes and shard roles all come from there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The forward pass's name for the tensor (the table's `role`, e.g. `attn_q_b`).
    pub role: String,
    /// GGUF block (`blk.N`); `None` for global tensors.
    pub block: Option<usize>,
    pub name: String,
    /// ggml order.
    pub dims: Vec<usize>,
    /// Not optional in the table. The forward may still require an optional one (the indexer
    /// of a full layer) or do without a required one (a NextN block left out as a whole).
    pub required: bool,
    /// How tensor parallelism divides it.
    pub shard: ShardRole,
    /// The tensor that stands in when this one is absent (a tied output head).
    pub tied_to: Option<String>,
}

/// Everything a forward pass needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    /// Trunk decoder blocks (excludes NextN blocks).
    pub n_layer: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    /// Dense FFN width.
    pub n_ff: usize,
    pub rope: RopeSpec,
    pub attention: AttentionSpec,
    pub indexer: Option<IndexerSpec>,
    pub moe: Option<MoeSpec>,
    /// Trunk blocks then NextN blocks.
    pub layers: Vec<LayerSpec>,
    /// `output.weight` absent: the head reuses `token_embd`.
    pub tied_output: bool,
    /// Legacy DeepSeek GGUFs store `attn_kv_b` unsplit instead of `attn_k_b` / `attn_v_b`.
    pub kv_b_unsplit: bool,
    /// Every tensor the mapping table lists for this model (all blocks, NextN included).
    pub tensors: Vec<TensorSpec>,
}

fn model_err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Model(msg.into())
}

/// Hyper-parameter reader for one architecture prefix.
struct Hp<'a> {
    md: &'a Metadata,
    arch: &'static str,
}

impl Hp<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn usize(&self, k: &str) -> Result<usize, RuntimeError> {
        let v = self.md.get_u64(&self.key(k))?;
        let v = usize::try_from(v)
            .map_err(|_| model_err(format!("{}: {v} is too large", self.key(k))))?;
        // Sizes beyond this are not a model any machine runs: treat them as corrupt metadata
        // before they turn into allocations.
        if v > (1 << 31) {
            return Err(model_err(format!(
                "{}: {v} is implausibly large",
                self.key(k)
            )));
        }
        Ok(v)
    }
    fn usize_or(&self, k: &str, d: usize) -> Result<usize, RuntimeError> {
        if self.md.contains(&self.key(k)) {
            self.usize(k)
        } else {
            Ok(d)
        }
    }
    fn opt_usize(&self, k: &str) -> Result<Option<usize>, RuntimeError> {
        if self.md.contains(&self.key(k)) {
            self.usize(k).map(Some)
        } else {
            Ok(None)
        }
    }
    fn f32_or(&self, k: &str, d: f32) -> Result<f32, RuntimeError> {
        if self.md.contains(&self.key(k)) {
            let v = self.md.get_f64(&self.key(k))? as f32;
            if !v.is_finite() {
                return Err(model_err(format!("{}: {v} is not finite", self.key(k))));
            }
            Ok(v)
        } else {
            Ok(d)
        }
    }
    fn bool_or(&self, k: &str, d: bool) -> Result<bool, RuntimeError> {
        if self.md.contains(&self.key(k)) {
            Ok(self.md.get_bool(&self.key(k))?)
        } else {
            Ok(d)
        }
    }
    fn positive(&self, k: &str) -> Result<usize, RuntimeError> {
        let v = self.usize(k)?;
        if v == 0 {
            return Err(model_err(format!("{} is 0", self.key(k))));
        }
        Ok(v)
    }
}

/// A routed-expert weight scale: the experts' sum is multiplied by it, so it must be a positive
/// finite number (0 silences the routed experts, a negative one flips them).
fn positive_scale(hp: &Hp<'_>, k: &str) -> Result<f32, RuntimeError> {
    let v = hp.f32_or(k, 1.0)?;
    if v <= 0.0 {
        return Err(model_err(format!("{}: {v} must be positive", hp.key(k))));
    }
    Ok(v)
}

/// Per-layer booleans stored as a BOOL or integer array (`attention.indexer.types`).
fn bool_array(v: &Value) -> Option<Vec<bool>> {
    v.as_array()?
        .values
        .iter()
        .map(|x| x.as_bool().or_else(|| x.as_i64().map(|i| i != 0)))
        .collect()
}

impl ModelSpec {
    /// Build the spec of an open model and check its tensors.
    pub fn from_model(model: &gguf::Model) -> Result<Self, RuntimeError> {
        let mut spec = Self::from_metadata(model.metadata())?;
        spec.check_tensors(|name| {
            model.tensor(name).map(|t| {
                t.info
                    .dims
                    .iter()
                    .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
                    .collect()
            })
        })?;
        Ok(spec)
    }

    /// Interpret the hyper-parameters (no tensor checks; see [`ModelSpec::check_tensors`]).
    /// `tokenizer.ggml.tokens` gives the vocabulary when `<arch>.vocab_size` is absent.
    pub fn from_metadata(md: &Metadata) -> Result<Self, RuntimeError> {
        let arch_name = md
            .architecture()
            .ok_or_else(|| model_err("general.architecture is missing"))?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| {
            model_err(format!(
                "architecture {arch_name:?} is not supported (supported: glm-dsa, deepseek2, glm4moe)"
            ))
        })?;
        let hp = Hp {
            md,
            arch: arch.name(),
        };
        let n_block = hp.positive("block_count")?;
        let n_nextn = hp.usize_or("nextn_predict_layers", 0)?;
        if n_nextn >= n_block {
            return Err(model_err(format!(
                "{}: {n_nextn} NextN blocks of {n_block} leaves no trunk",
                hp.key("nextn_predict_layers")
            )));
        }
        let n_layer = n_block - n_nextn;
        let n_embd = hp.positive("embedding_length")?;
        let n_vocab = match hp.opt_usize("vocab_size")? {
            Some(v) => v,
            None => md
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(|a| a.len())
                .ok_or_else(|| model_err("neither vocab_size nor tokenizer.ggml.tokens given"))?,
        };
        if n_vocab == 0 {
            return Err(model_err("vocabulary size is 0"));
        }
        let n_ctx_train = hp.positive("context_length")?;
        let rms_eps = hp.f32_or("attention.layer_norm_rms_epsilon", 1e-6)?;
        // RMSNorm divides by sqrt(mean(x^2) + eps): eps must be a positive normal f32 so an
        // all-zero row stays finite, and at most 1 or it swamps unit-scale activations.
        if !(f32::MIN_POSITIVE..=1.0).contains(&rms_eps) {
            return Err(model_err(format!(
                "{}: {rms_eps:e} is outside (0, 1]: RMS normalization would divide by zero or drown the activations",
                hp.key("attention.layer_norm_rms_epsilon")
            )));
        }
        let n_ff = hp.usize_or("feed_forward_length", 0)?;
        let n_head = hp.positive("attention.head_count")?;
        if let Some(t) = md.get(&hp.key("rope.scaling.type")).and_then(Value::as_str) {
            if t != "none" {
                return Err(model_err(format!(
                    "{}: rope scaling {t:?} is not supported",
                    hp.key("rope.scaling.type")
                )));
            }
        }
        let theta = hp.f32_or("rope.freq_base", 10000.0)?;
        // RoPE rotates pair i by position * theta^(-2i/d): theta <= 0 gives NaN or infinite
        // angles, and theta must exceed 1 for the frequencies to fall with i.
        if theta.is_nan() || theta <= 1.0 {
            return Err(model_err(format!(
                "{}: {theta} must be greater than 1 (RoPE frequencies theta^(-2i/d) must decrease)",
                hp.key("rope.freq_base")
            )));
        }
        let n_rot = hp.usize("rope.dimension_count")?;
        if n_rot == 0 || !n_rot.is_multiple_of(2) {
            return Err(model_err(format!(
                "{}: {n_rot} is not even",
                hp.key("rope.dimension_count")
            )));
        }

        let attention = match arch {
            Arch::GlmDsa | Arch::Deepseek2 => {
                let kv_lora_rank = hp.positive("attention.kv_lora_rank")?;
                let q_lora_rank = hp.opt_usize("attention.q_lora_rank")?.filter(|&r| r > 0);
                // Newer converters store the MLA head sizes under *_mla and the MQA view
                // (kv_lora + rope, kv_lora) under key_length/value_length; older ones only the
                // former under key_length/value_length.
                let (qk_head, v_head) = match hp.opt_usize("attention.key_length_mla")? {
                    Some(k) => (k, hp.usize("attention.value_length_mla")?),
                    None => (
                        hp.usize("attention.key_length")?,
                        hp.usize("attention.value_length")?,
                    ),
                };
                if qk_head <= n_rot || v_head == 0 {
                    return Err(model_err(format!(
                        "MLA head sizes: key {qk_head} (rope {n_rot}), value {v_head}"
                    )));
                }
                AttentionSpec::Mla(MlaSpec {
                    n_head,
                    q_lora_rank,
                    kv_lora_rank,
                    qk_nope: qk_head - n_rot,
                    qk_rope: n_rot,
                    v_head,
                    // transformers: qk_head_dim ** -0.5 in Python floats, rounded to f32 once.
                    scale: (qk_head as f64).powf(-0.5) as f32,
                    lora_norm_eps: 1e-6,
                })
            }
            Arch::Glm4Moe => {
                let n_head_kv = hp.positive("attention.head_count_kv")?;
                let head_dim = hp.positive("attention.key_length")?;
                if !n_head.is_multiple_of(n_head_kv) || n_rot > head_dim {
                    return Err(model_err(format!(
                        "attention: {n_head} heads / {n_head_kv} kv heads, head {head_dim}, rope {n_rot}"
                    )));
                }
                AttentionSpec::Gqa(GqaSpec {
                    n_head,
                    n_head_kv,
                    head_dim,
                    bias: true,
                    qk_norm: false,
                    scale: (head_dim as f64).powf(-0.5) as f32,
                })
            }
        };
        let style = match arch {
            // transformers' GLM-5 uses interleaved pairs for attention and indexer; llama.cpp
            // builds the DeepSeek2 family with ROPE_TYPE_NORM (adjacent pairs) too.
            Arch::GlmDsa | Arch::Deepseek2 => RopeStyle::Interleaved,
            Arch::Glm4Moe => RopeStyle::Neox,
        };

        let indexer = match arch {
            Arch::GlmDsa => Some(IndexerSpec {
                n_head: hp.positive("attention.indexer.head_count")?,
                head_dim: hp.positive("attention.indexer.key_length")?,
                top_k: hp.positive("attention.indexer.top_k")?,
                norm_eps: 1e-6,
            }),
            _ => None,
        };
        if let (Some(ix), AttentionSpec::Mla(m)) = (&indexer, &attention) {
            if ix.head_dim < n_rot || m.q_lora_rank.is_none() {
                return Err(model_err(format!(
                    "indexer: key length {} < rope {n_rot}, or no q_lora_rank",
                    ix.head_dim
                )));
            }
        }
        let own_indexer: Vec<bool> = match md.get(&hp.key("attention.indexer.types")) {
            Some(v) if indexer.is_some() => {
                let t = bool_array(v).ok_or_else(|| {
                    model_err(format!(
                        "{} is not a BOOL array",
                        hp.key("attention.indexer.types")
                    ))
                })?;
                if t.len() < n_layer || !t[0] {
                    return Err(model_err(format!(
                        "{}: {} entries for {n_layer} layers, first must be a full layer",
                        hp.key("attention.indexer.types"),
                        t.len()
                    )));
                }
                t
            }
            _ => vec![indexer.is_some(); n_block],
        };

        let moe = match hp.opt_usize("expert_count")? {
            Some(n_expert) if n_expert > 0 => {
                let n_used = hp.positive("expert_used_count")?;
                let n_group = hp.usize_or("expert_group_count", 1)?.max(1);
                let n_group_used = hp.usize_or("expert_group_used_count", n_group)?.max(1);
                let gating = match hp.usize_or("expert_gating_func", 0)? {
                    0 => match arch {
                        Arch::Deepseek2 => Gating::Softmax,
                        _ => Gating::Sigmoid,
                    },
                    1 => Gating::Softmax,
                    2 => Gating::Sigmoid,
                    g => {
                        return Err(model_err(format!(
                            "{}: gating function {g} is not supported",
                            hp.key("expert_gating_func")
                        )))
                    }
                };
                if n_used > n_expert || !n_expert.is_multiple_of(n_group) || n_group_used > n_group
                {
                    return Err(model_err(format!(
                        "experts: {n_used} of {n_expert} in {n_group} groups ({n_group_used} used)"
                    )));
                }
                Some(MoeSpec {
                    n_expert,
                    n_used,
                    n_ff: hp.positive("expert_feed_forward_length")?,
                    n_shared: hp.usize_or("expert_shared_count", 0)?,
                    n_group,
                    n_group_used,
                    gating,
                    normalize: hp.bool_or("expert_weights_norm", false)?,
                    scale: positive_scale(&hp, "expert_weights_scale")?,
                })
            }
            _ => None,
        };
        let n_dense = if moe.is_some() {
            hp.usize_or("leading_dense_block_count", 0)?
        } else {
            n_block
        };
        if n_dense > 0 && n_ff == 0 {
            return Err(model_err(format!(
                "{} is missing",
                hp.key("feed_forward_length")
            )));
        }
        let layers = (0..n_block)
            .map(|i| LayerSpec {
                index: i,
                ffn: if i < n_dense {
                    FfnKind::Dense
                } else {
                    FfnKind::Moe
                },
                own_indexer: indexer.is_some() && own_indexer.get(i).copied().unwrap_or(true),
                mtp: i >= n_layer,
            })
            .collect();
        let tensors = resolve_tensors(md, arch, n_block)?;
        let kv_b_unsplit = tensors.iter().any(|t| t.role == "attn_kv_b");
        Ok(Self {
            arch,
            n_vocab,
            n_embd,
            n_layer,
            n_ctx_train,
            rms_eps,
            n_ff,
            rope: RopeSpec {
                theta,
                n_rot,
                style,
            },
            attention,
            indexer,
            moe,
            layers,
            tied_output: false,
            kv_b_unsplit,
            tensors,
        })
    }

    /// Check the tensor table (`dims_of(name)` gives a tensor's ggml dims, `None` if absent)
    /// against the mapping table, settling the optional layouts (tied output, GQA biases and
    /// q/k norms). A NextN block may be absent as a whole, but is checked once present.
    pub fn check_tensors(
        &mut self,
        dims_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<(), RuntimeError> {
        let present = |role: &str, block: Option<usize>| {
            self.tensor(role, block)
                .is_some_and(|t| dims_of(&t.name).is_some())
        };
        self.tied_output = !present("output", None);
        if let AttentionSpec::Gqa(g) = &mut self.attention {
            let first = self.layers.first().map(|l| l.index);
            g.qk_norm = self
                .tensors
                .iter()
                .any(|t| t.role == "attn_q_norm" && t.block == first && dims_of(&t.name).is_some());
            g.bias = self
                .tensors
                .iter()
                .any(|t| t.role == "attn_q_bias" && t.block == first && dims_of(&t.name).is_some());
        }
        let mtp_present = self
            .tensors
            .iter()
            .any(|t| t.role == "nextn_eh_proj" && dims_of(&t.name).is_some());
        for t in &self.tensors {
            let is_mtp = t
                .block
                .is_some_and(|b| self.layers.get(b).is_some_and(|l| l.mtp));
            let stood_in = t.tied_to.as_ref().is_some_and(|n| dims_of(n).is_some());
            let required = t.required && (!is_mtp || mtp_present) && !stood_in;
            match dims_of(&t.name) {
                None if required => {
                    return Err(model_err(format!(
                        "{} model: tensor {} {:?} is missing",
                        self.arch.name(),
                        t.name,
                        t.dims
                    )))
                }
                Some(d) if d != t.dims => {
                    return Err(model_err(format!(
                        "{} model: tensor {} has shape {d:?}, expected {:?}",
                        self.arch.name(),
                        t.name,
                        t.dims
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether the NextN blocks' weights are part of the file.
    pub fn n_nextn(&self) -> usize {
        self.layers.len() - self.n_layer
    }

    /// Every tensor the mapping table lists for this model.
    pub fn tensor_specs(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The tensor playing `role` in block `block` (`None`: a global tensor), if the table lists
    /// one for this model.
    pub fn tensor(&self, role: &str, block: Option<usize>) -> Option<&TensorSpec> {
        self.tensors
            .iter()
            .find(|t| t.block == block && t.role == role)
    }
}

/// The tensors of the architecture's mapping table that apply to this model's blocks, with their
/// shapes evaluated over its metadata. Entries without a role are not used by the forward pass.
fn resolve_tensors(
    md: &Metadata,
    arch: Arch,
    n_block: usize,
) -> Result<Vec<TensorSpec>, RuntimeError> {
    let table = mappings::table(arch.name())
        .map_err(|e| model_err(format!("mapping table of {}: {e}", arch.name())))?;
    let env = mappings::table::Env::new(table, md);
    let mut out = Vec::new();
    for e in table.entries.iter().filter(|e| !e.roles.is_empty()) {
        let blocks: Vec<Option<usize>> = if e.layers.is_some() {
            (0..n_block).map(Some).collect()
        } else {
            vec![None]
        };
        for b in blocks {
            let bid = b.map(|b| b as u64);
            let applies = env
                .entry_applies(e, bid)
                .map_err(|x| model_err(format!("{}: {x}", e.label())))?;
            if !applies {
                continue;
            }
            for (part, (role, name)) in e.roles.iter().zip(e.gguf_names(bid)).enumerate() {
                let dims = env
                    .shape(e, part, bid)
                    .map_err(|x| model_err(format!("tensor {name}: {x}")))?
                    .into_iter()
                    .map(|d| {
                        usize::try_from(d)
                            .ok()
                            .filter(|&d| d <= 1 << 40)
                            .ok_or_else(|| {
                                model_err(format!("tensor {name}: dimension {d} is implausible"))
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                out.push(TensorSpec {
                    role: role.clone(),
                    block: b,
                    name,
                    dims,
                    required: !e.optional,
                    shard: ShardRole::of(e),
                    tied_to: e.tied_to.clone(),
                });
            }
        }
    }
    Ok(out)
}
