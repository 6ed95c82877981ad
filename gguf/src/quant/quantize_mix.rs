//! Which ggml type each tensor gets when a model is quantized to a llama.cpp file type
//! (`Q4_K_M`, `IQ3_M`, ...): llama.cpp's `llama-quant.cpp` rules, ported so that a plan made
//! here equals the one llama-quantize makes for the same model — the tensor order it writes
//! (layer, then name), which tensors stay as they are, the `_S`/`_M`/`_L` mixes, the
//! importance-matrix requirements, and the fallbacks for rows that do not hold a whole number of
//! blocks (GLM-5's `attn_k_b`).
//!
//! The rules look at tensor names by substring, exactly as llama.cpp does, and at a handful of
//! generic hyper-parameters (block, head, expert counts) — read here, not through a model spec,
//! because llama.cpp reads them generically for every architecture.

// The rule chains keep llama.cpp's branch order (some branches give the same type) so they can
// be compared with llama-quant.cpp line by line.
#![allow(clippy::if_same_then_else)]

use crate::metadata::Metadata;
use crate::value::Value;
use crate::GgmlType;
use std::cmp::Ordering;

/// llama.cpp's `llama_ftype`: what `general.file_type` records and what a user asks for.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q1_0,
    Q2_K,
    Q2_K_S,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    IQ2_XXS,
    IQ2_XS,
    IQ2_S,
    IQ2_M,
    IQ3_XS,
    IQ3_XXS,
    IQ3_S,
    IQ3_M,
    IQ1_S,
    IQ1_M,
    IQ4_NL,
    IQ4_XS,
    TQ1_0,
    TQ2_0,
    MXFP4_MOE,
}

/// (name as llama-quantize spells it, type, llama_ftype id); aliases after the canonical names.
const FILE_TYPES: &[(&str, FileType, u32)] = &[
    ("F32", FileType::F32, 0),
    ("F16", FileType::F16, 1),
    ("Q4_0", FileType::Q4_0, 2),
    ("Q4_1", FileType::Q4_1, 3),
    ("Q8_0", FileType::Q8_0, 7),
    ("Q5_0", FileType::Q5_0, 8),
    ("Q5_1", FileType::Q5_1, 9),
    ("Q2_K", FileType::Q2_K, 10),
    ("Q3_K_S", FileType::Q3_K_S, 11),
    ("Q3_K_M", FileType::Q3_K_M, 12),
    ("Q3_K_L", FileType::Q3_K_L, 13),
    ("Q4_K_S", FileType::Q4_K_S, 14),
    ("Q4_K_M", FileType::Q4_K_M, 15),
    ("Q5_K_S", FileType::Q5_K_S, 16),
    ("Q5_K_M", FileType::Q5_K_M, 17),
    ("Q6_K", FileType::Q6_K, 18),
    ("IQ2_XXS", FileType::IQ2_XXS, 19),
    ("IQ2_XS", FileType::IQ2_XS, 20),
    ("Q2_K_S", FileType::Q2_K_S, 21),
    ("IQ3_XS", FileType::IQ3_XS, 22),
    ("IQ3_XXS", FileType::IQ3_XXS, 23),
    ("IQ1_S", FileType::IQ1_S, 24),
    ("IQ4_NL", FileType::IQ4_NL, 25),
    ("IQ3_S", FileType::IQ3_S, 26),
    ("IQ3_M", FileType::IQ3_M, 27),
    ("IQ2_S", FileType::IQ2_S, 28),
    ("IQ2_M", FileType::IQ2_M, 29),
    ("IQ4_XS", FileType::IQ4_XS, 30),
    ("IQ1_M", FileType::IQ1_M, 31),
    ("BF16", FileType::BF16, 32),
    ("TQ1_0", FileType::TQ1_0, 36),
    ("TQ2_0", FileType::TQ2_0, 37),
    ("MXFP4_MOE", FileType::MXFP4_MOE, 38),
    ("Q1_0", FileType::Q1_0, 40),
    // llama-quantize's aliases.
    ("Q3_K", FileType::Q3_K_M, 12),
    ("Q4_K", FileType::Q4_K_M, 15),
    ("Q5_K", FileType::Q5_K_M, 17),
];

impl FileType {
    /// Every file type (canonical names only).
    pub fn all() -> impl Iterator<Item = FileType> {
        FILE_TYPES.iter().take(34).map(|e| e.1)
    }

    /// Parse a name (case-insensitive, llama-quantize's aliases accepted) or a numeric id.
    pub fn parse(s: &str) -> Option<FileType> {
        if let Some(e) = FILE_TYPES.iter().find(|e| e.0.eq_ignore_ascii_case(s)) {
            return Some(e.1);
        }
        let id: u32 = s.parse().ok()?;
        FILE_TYPES.iter().find(|e| e.2 == id).map(|e| e.1)
    }

    pub fn name(self) -> &'static str {
        FILE_TYPES.iter().find(|e| e.1 == self).map_or("?", |e| e.0)
    }

    /// The `general.file_type` value.
    pub fn id(self) -> u32 {
        FILE_TYPES.iter().find(|e| e.1 == self).map_or(0, |e| e.2)
    }

    /// The type most tensors get (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        use FileType as F;
        use GgmlType as T;
        match self {
            F::F32 => T::F32,
            F::F16 => T::F16,
            F::BF16 => T::BF16,
            F::Q4_0 => T::Q4_0,
            F::Q4_1 => T::Q4_1,
            F::Q5_0 => T::Q5_0,
            F::Q5_1 => T::Q5_1,
            F::Q8_0 => T::Q8_0,
            F::Q1_0 => T::Q1_0,
            F::MXFP4_MOE => T::MXFP4,
            F::Q2_K | F::Q2_K_S => T::Q2_K,
            F::IQ3_XS => T::IQ3_S,
            F::Q3_K_S | F::Q3_K_M | F::Q3_K_L => T::Q3_K,
            F::Q4_K_S | F::Q4_K_M => T::Q4_K,
            F::Q5_K_S | F::Q5_K_M => T::Q5_K,
            F::Q6_K => T::Q6_K,
            F::TQ1_0 => T::TQ1_0,
            F::TQ2_0 => T::TQ2_0,
            F::IQ2_XXS => T::IQ2_XXS,
            F::IQ2_XS | F::IQ2_S => T::IQ2_XS,
            F::IQ2_M => T::IQ2_S,
            F::IQ3_XXS => T::IQ3_XXS,
            F::IQ1_S => T::IQ1_S,
            F::IQ1_M => T::IQ1_M,
            F::IQ4_NL => T::IQ4_NL,
            F::IQ4_XS => T::IQ4_XS,
            F::IQ3_S | F::IQ3_M => T::IQ3_S,
        }
    }
}

impl std::fmt::Display for FileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MixError {
    #[error(
        "tensor {tensor:?}: {ncols} columns fit no block of {ty}, and {ty} has no fallback type"
    )]
    NoFallback {
        tensor: String,
        ty: GgmlType,
        ncols: u64,
    },
    #[error(
        "tensor {tensor:?}: cannot tell its layer (needed for {ftype} with {n_expert} experts)"
    )]
    NoLayer {
        tensor: String,
        ftype: FileType,
        n_expert: u32,
    },
    #[error("tensor {tensor:?}: layer {layer} is outside the {n_layer} blocks of the model")]
    BadLayer {
        tensor: String,
        layer: i64,
        n_layer: u32,
    },
    #[error("metadata key {key:?}: {problem}")]
    Metadata { key: String, problem: String },
}

/// What the user asked for besides the file type (llama-quantize's flags).
#[derive(Debug, Clone, Default)]
pub struct MixOptions {
    pub output_tensor_type: Option<GgmlType>,
    pub token_embedding_type: Option<GgmlType>,
    /// `--pure`: the default type everywhere quantization is allowed (fallbacks still apply).
    pub pure: bool,
    /// `--leave-output-tensor`.
    pub leave_output_tensor: bool,
    /// `--tensor-type PATTERN=TYPE`, first match wins; the matcher is the caller's (llama.cpp
    /// uses ECMAScript `regex_search` on the name).
    pub tensor_types: Vec<(String, GgmlType)>,
    /// Whether an importance matrix will be used (changes a few rules).
    pub has_imatrix: bool,
}

/// The generic hyper-parameters the rules look at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MixHparams {
    pub arch: String,
    pub n_layer: u32,
    pub n_expert: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
}

impl MixHparams {
    /// From a model's metadata as llama.cpp's loader reads it (head counts may be per-layer
    /// arrays: layer 0's value counts; `head_count_kv` defaults to `head_count`).
    pub fn from_metadata(m: &Metadata) -> Result<MixHparams, MixError> {
        let arch = m
            .architecture()
            .ok_or_else(|| MixError::Metadata {
                key: "general.architecture".into(),
                problem: "missing or not a string".into(),
            })?
            .to_string();
        let first_u32 = |key: &str| -> Result<Option<u32>, MixError> {
            let bad = |p: &str| MixError::Metadata {
                key: key.to_string(),
                problem: p.to_string(),
            };
            match m.get(key) {
                None => Ok(None),
                Some(Value::Array(a)) => match a.values.first() {
                    Some(v) => v
                        .as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .map(Some)
                        .ok_or_else(|| bad("not a non-negative 32-bit integer")),
                    None => Ok(Some(0)),
                },
                Some(v) => v
                    .as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .map(Some)
                    .ok_or_else(|| bad("not a non-negative 32-bit integer")),
            }
        };
        let n_layer =
            first_u32(&format!("{arch}.block_count"))?.ok_or_else(|| MixError::Metadata {
                key: format!("{arch}.block_count"),
                problem: "missing".into(),
            })?;
        let n_head = first_u32(&format!("{arch}.attention.head_count"))?.unwrap_or(0);
        let n_head_kv = first_u32(&format!("{arch}.attention.head_count_kv"))?.unwrap_or(n_head);
        let n_expert = first_u32(&format!("{arch}.expert_count"))?.unwrap_or(0);
        Ok(MixHparams {
            arch,
            n_layer,
            n_expert,
            n_head,
            n_head_kv,
        })
    }

    fn n_gqa(&self) -> u32 {
        self.n_head.checked_div(self.n_head_kv).unwrap_or(0)
    }

    /// llama.cpp's LLM_TYPE_70B: a llama with 80 layers and grouped-query attention.
    fn is_70b(&self) -> bool {
        self.arch == "llama" && self.n_layer == 80 && self.n_head != self.n_head_kv
    }
}

/// A tensor to plan for: name, ggml dims, current type.
#[derive(Debug, Clone)]
pub struct MixTensor<'a> {
    pub name: &'a str,
    pub dims: &'a [u64],
    pub ty: GgmlType,
}

/// One planned tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedTensor {
    /// Index into the input list.
    pub index: usize,
    pub target: GgmlType,
    /// Whether quantization is allowed at all for this tensor (else it is copied).
    pub allows_quantization: bool,
    /// The target came from a fallback because rows do not fit its blocks.
    pub fell_back: bool,
    pub requires_imatrix: bool,
}

/// The layer in `blk.N.`-style names as C's `sscanf("blk.%d.")` reads it; -1 if none.
fn layer_of(name: &str) -> i64 {
    parse_layer(name).unwrap_or(-1)
}

/// `sscanf(name, "blk.%d.", &l) == 1`: `Some(l)`.
fn parse_layer(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("blk.")?;
    let rest = rest.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (neg, digits) = match rest.as_bytes().first() {
        Some(b'-') => (true, &rest[1..]),
        Some(b'+') => (false, &rest[1..]),
        _ => (false, rest),
    };
    let end = digits
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(digits.len());
    if end == 0 {
        return None;
    }
    // Saturate where C's %d would be undefined.
    let v: i64 = digits[..end].parse().unwrap_or(i64::from(i32::MAX));
    let v = v.min(i64::from(i32::MAX));
    Some(if neg { -v } else { v })
}

/// llama-quantize's output order: by layer (names without one first), then by name bytes.
pub fn output_order(names: &[&str]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..names.len()).collect();
    idx.sort_by(|&a, &b| {
        let (la, lb) = (layer_of(names[a]), layer_of(names[b]));
        match la.cmp(&lb) {
            Ordering::Equal => names[a].as_bytes().cmp(names[b].as_bytes()),
            o => o,
        }
    });
    idx
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttnQ,
    AttnV,
    AttnK,
    AttnQkv,
    AttnKvB,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

fn is_token_embd(name: &str) -> bool {
    name == "token_embd.weight" || name == "per_layer_token_embd.weight"
}

fn category(name: &str) -> Category {
    use Category::*;
    if name == "output.weight" {
        return Output;
    }
    if is_token_embd(name) {
        return TokenEmbd;
    }
    let table: [(&str, Category); 9] = [
        ("attn_qkv.weight", AttnQkv),
        ("attn_kv_b.weight", AttnKvB),
        ("attn_v.weight", AttnV),
        ("attn_k.weight", AttnK),
        ("attn_q.weight", AttnQ),
        ("attn_output.weight", AttnOutput),
        ("ffn_up", FfnUp),
        ("ffn_gate", FfnGate),
        ("ffn_down", FfnDown),
    ];
    table
        .iter()
        .find(|(s, _)| name.contains(s))
        .map_or(Other, |e| e.1)
}

fn is_attn_v_like(c: Category) -> bool {
    matches!(c, Category::AttnV | Category::AttnQkv | Category::AttnKvB)
}

/// Names llama.cpp never quantizes (by substring unless noted).
const NEVER_QUANTIZED: &[&str] = &[
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
];

const NEVER_QUANTIZED_GLM5_NEXT: &[&str] = &[
    "hc_",
    "indexer.attn_q_b",
    "indexer.attn_k",
    "indexer.proj",
    "indexer_compressor_gate",
    "indexer_compressor_ape",
    "ssm_f_a.weight",
    "ssm_f_b.weight",
    "ssm_g_a.weight",
    "ssm_g_b.weight",
    "ssm_beta.weight",
    "attn_kv_a_mqa.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
];

/// `tensor_allows_quantization`: 2-D+ tensors whose name ends in `weight`, minus llama.cpp's
/// exclusion list.
fn allows_quantization(opts: &MixOptions, arch: &str, t: &MixTensor<'_>) -> bool {
    // ggml_n_dims: trailing dimensions of 1 do not count.
    let n_dims = t.dims.iter().rposition(|&d| d != 1).map_or(1, |p| p + 1);
    if n_dims < 2 {
        return false;
    }
    let name = t.name;
    // C: name.rfind("weight") == name.size() - 6, which for names shorter than 6 compares
    // npos with a wrapped size_t and is false.
    let mut q = name.len() >= 6 && name.rfind("weight") == Some(name.len() - 6);
    q &= !opts.leave_output_tensor || name != "output.weight";
    q &= !NEVER_QUANTIZED.iter().any(|s| name.contains(s));
    q &= name != "position_embd.weight" && name != "token_types.weight";
    if arch == "glm5-next" {
        q &= !NEVER_QUANTIZED_GLM5_NEXT.iter().any(|s| name.contains(s));
    }
    q
}

/// `tensor_type_fallback`: a type whose blocks fit `ncols`, or F16.
fn fallback(name: &str, ncols: u64, target: GgmlType) -> Result<(GgmlType, bool), MixError> {
    use GgmlType as T;
    let bs = target.block_size() as u64;
    if ncols.is_multiple_of(bs) {
        return Ok((target, false));
    }
    let mut ret = match target {
        T::IQ1_S
        | T::IQ1_M
        | T::IQ2_XXS
        | T::IQ2_XS
        | T::IQ2_S
        | T::IQ3_XXS
        | T::IQ3_S
        | T::IQ4_XS => T::IQ4_NL,
        T::Q2_K | T::Q3_K | T::TQ1_0 | T::TQ2_0 => T::Q4_0,
        T::Q4_K => T::Q5_0,
        T::Q5_K => T::Q5_1,
        T::Q6_K => T::Q8_0,
        _ if bs <= 32 => target,
        _ => {
            return Err(MixError::NoFallback {
                tensor: name.to_string(),
                ty: target,
                ncols,
            })
        }
    };
    if !ncols.is_multiple_of(ret.block_size() as u64) {
        ret = T::F16;
    }
    Ok((ret, true))
}

/// Counters llama.cpp keeps while it walks the tensors.
struct State<'h> {
    hp: &'h MixHparams,
    ftype: FileType,
    opts: &'h MixOptions,
    has_tied_embeddings: bool,
    n_attention_wv: i64,
    i_attention_wv: i64,
    i_ffn_down: i64,
    i_ffn_gate: i64,
    i_ffn_up: i64,
}

fn use_more_bits(i_layer: i64, n_layers: i64) -> bool {
    i_layer < n_layers / 8 || i_layer >= 7 * n_layers / 8 || (i_layer - n_layers / 8) % 3 == 2
}

impl State<'_> {
    /// The layer a tensor belongs to: parsed from its name for MoE models (experts are not
    /// necessarily consecutive), else the running counter.
    fn layer_info(&self, counter: i64, name: &str) -> Result<(i64, i64), MixError> {
        let n_layer = i64::from(self.hp.n_layer);
        if self.hp.n_expert.max(1) > 1 {
            let l = parse_layer(name).ok_or_else(|| MixError::NoLayer {
                tensor: name.to_string(),
                ftype: self.ftype,
                n_expert: self.hp.n_expert,
            })?;
            if l < 0 || l >= n_layer {
                return Err(MixError::BadLayer {
                    tensor: name.to_string(),
                    layer: l,
                    n_layer: self.hp.n_layer,
                });
            }
            return Ok((l, n_layer));
        }
        Ok((counter, n_layer))
    }

    /// `llama_tensor_get_type_impl`: the mix rules.
    fn mix_type(
        &mut self,
        mut new_type: GgmlType,
        t: &MixTensor<'_>,
        cat: Category,
    ) -> Result<GgmlType, MixError> {
        use Category as C;
        use FileType as F;
        use GgmlType as T;
        let name = t.name;
        let ftype = self.ftype;
        let arch = self.hp.arch.as_str();
        let n_expert = self.hp.n_expert;
        let n_gqa = self.hp.n_gqa();
        if arch == "glm5-next"
            && (name.contains("attn_q_a")
                || name.contains("attn_q_b")
                || name.contains("nextn.eh_proj"))
            && !matches!(new_type, T::F32 | T::BF16 | T::F16)
        {
            return Ok(T::Q8_0);
        }
        let iq_low = |f: F| {
            matches!(
                f,
                F::IQ2_XXS | F::IQ2_XS | F::IQ1_S | F::IQ2_S | F::IQ2_M | F::IQ1_M
            )
        };
        if cat == C::Output || (self.has_tied_embeddings && cat == C::TokenEmbd) {
            if let Some(o) = self.opts.output_tensor_type {
                new_type = o;
            } else {
                let nx = t.dims.first().copied().unwrap_or(1);
                let qk = new_type.block_size() as u64;
                if ftype == F::MXFP4_MOE || arch == "falcon" || nx % qk != 0 {
                    new_type = T::Q8_0;
                } else if iq_low(ftype) || ftype == F::IQ3_XXS {
                    new_type = T::Q5_K;
                } else if new_type != T::Q8_0 {
                    new_type = T::Q6_K;
                }
            }
        } else if ftype == F::MXFP4_MOE {
            let expert_role = matches!(cat, C::FfnUp | C::FfnGate | C::FfnDown);
            let ne2 = t.dims.get(2).copied().unwrap_or(1);
            new_type = if ne2 > 1 && (arch != "bailingmoe3" || expert_role) {
                T::MXFP4
            } else {
                T::Q8_0
            };
        } else if cat == C::TokenEmbd {
            if let Some(e) = self.opts.token_embedding_type {
                new_type = e;
            } else if matches!(ftype, F::IQ2_XXS | F::IQ2_XS | F::IQ1_S | F::IQ1_M) {
                new_type = T::Q2_K;
            } else if matches!(ftype, F::IQ2_S | F::IQ2_M | F::IQ3_XXS) {
                new_type = T::IQ3_S;
            } else if matches!(ftype, F::TQ1_0 | F::TQ2_0) {
                new_type = T::Q4_K;
            }
        } else if iq_low(ftype) {
            let iq2sm = matches!(ftype, F::IQ2_S | F::IQ2_M);
            if is_attn_v_like(cat) {
                new_type = if n_gqa >= 4 || n_expert >= 4 {
                    T::Q4_K
                } else if iq2sm {
                    T::IQ3_S
                } else {
                    T::Q2_K
                };
                self.i_attention_wv += 1;
            } else if n_expert == 8 && cat == C::AttnK {
                new_type = T::Q4_K;
            } else if cat == C::FfnDown {
                // n_ffn_down = block_count (llama.cpp's init_quantize_state_counters).
                if self.i_ffn_down < i64::from(self.hp.n_layer) / 8 {
                    new_type = if iq2sm { T::IQ3_S } else { T::Q2_K };
                }
                self.i_ffn_down += 1;
            } else if cat == C::AttnOutput {
                if n_expert == 8 {
                    new_type = T::Q5_K;
                } else if matches!(ftype, F::IQ1_S | F::IQ1_M) {
                    new_type = T::IQ2_XXS;
                } else if iq2sm {
                    new_type = T::IQ3_S;
                }
            }
        } else if is_attn_v_like(cat) {
            let (i, n) = (self.i_attention_wv, self.n_attention_wv);
            if ftype == F::Q2_K {
                new_type = if n_gqa >= 4 { T::Q4_K } else { T::Q3_K };
            } else if ftype == F::Q2_K_S && n_gqa >= 4 {
                new_type = T::Q4_K;
            } else if ftype == F::IQ3_XXS {
                new_type = if n_gqa >= 4 {
                    T::Q4_K
                } else if !self.opts.has_imatrix {
                    T::IQ3_S
                } else {
                    T::IQ3_XXS
                };
            } else if matches!(ftype, F::IQ3_XS | F::IQ3_S) && n_gqa >= 4 {
                new_type = T::Q4_K;
            } else if ftype == F::IQ3_M {
                new_type = T::Q4_K;
            } else if ftype == F::Q3_K_M {
                new_type = if i < 2 { T::Q5_K } else { T::Q4_K };
            } else if ftype == F::Q3_K_L {
                new_type = T::Q5_K;
            } else if matches!(ftype, F::IQ4_NL | F::IQ4_XS) && n_gqa >= 4 {
                new_type = T::Q5_K;
            } else if matches!(ftype, F::Q4_K_M | F::Q5_K_M) && use_more_bits(i, n) {
                new_type = T::Q6_K;
            } else if ftype == F::Q4_K_S && i < 4 {
                new_type = T::Q5_K;
            }
            if self.hp.is_70b() && matches!(new_type, T::Q3_K | T::Q4_K) {
                new_type = T::Q5_K;
            }
            if n_expert == 8 {
                new_type = T::Q8_0;
            }
            self.i_attention_wv += 1;
        } else if cat == C::AttnK {
            if n_expert == 8 {
                new_type = T::Q8_0;
            } else if ftype == F::IQ3_XS {
                new_type = T::IQ3_XXS;
            } else if ftype == F::IQ3_XXS {
                new_type = T::IQ2_S;
            }
        } else if cat == C::AttnQ {
            if ftype == F::IQ3_XS {
                new_type = T::IQ3_XXS;
            } else if ftype == F::IQ3_XXS {
                new_type = T::IQ2_S;
            }
        } else if cat == C::FfnDown {
            let (i_layer, n_layer) = self.layer_info(self.i_ffn_down, name)?;
            let falcon = arch == "falcon";
            let imat = self.opts.has_imatrix;
            if ftype == F::Q2_K {
                new_type = T::Q3_K;
            } else if ftype == F::Q2_K_S {
                if i_layer < n_layer / 8 {
                    new_type = T::Q4_K;
                }
            } else if ftype == F::IQ3_XXS && !imat {
                new_type = if i_layer < n_layer / 8 {
                    T::Q4_K
                } else {
                    T::Q3_K
                };
            } else if ftype == F::Q3_K_M {
                new_type = if i_layer < n_layer / 16 {
                    T::Q5_K
                } else if !falcon || use_more_bits(i_layer, n_layer) {
                    T::Q4_K
                } else {
                    T::Q3_K
                };
            } else if ftype == F::IQ3_M
                && (i_layer < n_layer / 8 || (n_expert == 8 && use_more_bits(i_layer, n_layer)))
            {
                new_type = T::Q4_K;
            } else if ftype == F::Q3_K_L {
                new_type = if falcon { T::Q4_K } else { T::Q5_K };
            } else if ftype == F::Q4_K_M {
                if falcon {
                    new_type = if i_layer < n_layer / 16 {
                        T::Q6_K
                    } else if use_more_bits(i_layer, n_layer) {
                        T::Q5_K
                    } else {
                        T::Q4_K
                    };
                } else if use_more_bits(i_layer, n_layer) {
                    new_type = T::Q6_K;
                }
            } else if i_layer < n_layer / 8 && matches!(ftype, F::IQ4_NL | F::IQ4_XS) && !imat {
                new_type = T::Q5_K;
            } else if ftype == F::Q5_K_M && use_more_bits(i_layer, n_layer) {
                new_type = T::Q6_K;
            } else if ftype == F::Q4_K_S && !falcon && i_layer < n_layer / 8 {
                new_type = T::Q5_K;
            } else if matches!(ftype, F::Q4_0 | F::Q5_0) && imat && i_layer < n_layer / 8 {
                new_type = if ftype == F::Q4_0 { T::Q4_1 } else { T::Q5_1 };
            }
            self.i_ffn_down += 1;
        } else if cat == C::AttnOutput {
            if arch != "falcon" {
                if n_expert == 8 {
                    if matches!(
                        ftype,
                        F::Q2_K
                            | F::IQ3_XS
                            | F::IQ3_XXS
                            | F::Q3_K_S
                            | F::Q3_K_M
                            | F::IQ4_NL
                            | F::Q4_K_S
                            | F::Q4_K_M
                            | F::IQ3_S
                            | F::IQ3_M
                            | F::IQ4_XS
                    ) {
                        new_type = T::Q5_K;
                    }
                } else {
                    match ftype {
                        F::Q2_K => new_type = T::Q3_K,
                        F::IQ3_XXS => new_type = T::IQ3_S,
                        F::Q3_K_M | F::IQ3_M => new_type = T::Q4_K,
                        F::Q3_K_L => new_type = T::Q5_K,
                        _ => {}
                    }
                }
            } else if ftype == F::Q3_K_L {
                new_type = T::Q4_K;
            }
        } else if cat == C::AttnQkv {
            // Unreachable in llama.cpp too (attn_qkv is attn_v-like and handled above); kept
            // for the same reason they keep it: the rule set reads as one table.
            match ftype {
                F::Q3_K_M | F::Q3_K_L | F::IQ3_M => new_type = T::Q4_K,
                F::Q4_K_M => new_type = T::Q5_K,
                F::Q5_K_M => new_type = T::Q6_K,
                _ => {}
            }
        } else if cat == C::FfnGate || cat == C::FfnUp {
            let counter = if cat == C::FfnGate {
                self.i_ffn_gate
            } else {
                self.i_ffn_up
            };
            let (i_layer, n_layer) = self.layer_info(counter, name)?;
            if ftype == F::IQ3_XS && i_layer >= n_layer / 8 && i_layer < 7 * n_layer / 8 {
                new_type = T::IQ3_XXS;
            }
            if cat == C::FfnGate {
                self.i_ffn_gate += 1;
            } else {
                self.i_ffn_up += 1;
            }
        }
        Ok(new_type)
    }
}

/// `tensor_requires_imatrix`.
fn requires_imatrix(name: &str, ty: GgmlType, ftype: FileType) -> bool {
    if is_token_embd(name) || name == "output.weight" {
        return false;
    }
    match ty {
        GgmlType::IQ3_XXS
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ1_M
        | GgmlType::IQ1_S => true,
        GgmlType::Q2_K => ftype == FileType::Q2_K_S,
        _ => false,
    }
}

/// Plan every tensor, in llama-quantize's output order. `matches(pattern, name)` decides the
/// `--tensor-type` patterns.
pub fn plan(
    tensors: &[MixTensor<'_>],
    hp: &MixHparams,
    ftype: FileType,
    opts: &MixOptions,
    matches: &dyn Fn(&str, &str) -> bool,
) -> Result<Vec<PlannedTensor>, MixError> {
    let names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
    let order = output_order(&names);
    let cats: Vec<Category> = order.iter().map(|&i| category(names[i])).collect();
    let mut st = State {
        hp,
        ftype,
        opts,
        has_tied_embeddings: !cats.contains(&Category::Output),
        n_attention_wv: cats.iter().filter(|c| is_attn_v_like(**c)).count() as i64,
        i_attention_wv: 0,
        i_ffn_down: 0,
        i_ffn_gate: 0,
        i_ffn_up: 0,
    };
    let default_type = ftype.default_type();
    let mut out = Vec::with_capacity(order.len());
    for (&i, &cat) in order.iter().zip(&cats) {
        let t = &tensors[i];
        let allowed = allows_quantization(opts, &hp.arch, t);
        let (target, fell_back) = if !allowed {
            (t.ty, false)
        } else {
            tensor_type(&mut st, t, cat, default_type, matches)?
        };
        out.push(PlannedTensor {
            index: i,
            target,
            allows_quantization: allowed,
            fell_back,
            requires_imatrix: requires_imatrix(t.name, target, ftype),
        });
    }
    Ok(out)
}

/// `llama_tensor_get_type` for a tensor that may be quantized.
fn tensor_type(
    st: &mut State<'_>,
    t: &MixTensor<'_>,
    cat: Category,
    default_type: GgmlType,
    matches: &dyn Fn(&str, &str) -> bool,
) -> Result<(GgmlType, bool), MixError> {
    let opts = st.opts;
    if let (Some(e), Category::TokenEmbd) = (opts.token_embedding_type, cat) {
        // per_layer_token_embd follows --token-embedding-type unless a --tensor-type names it.
        let named = t.name == "per_layer_token_embd.weight"
            && opts.tensor_types.iter().any(|(p, _)| matches(p, t.name));
        if !named {
            return Ok((e, false));
        }
    }
    if let (Some(o), Category::Output) = (opts.output_tensor_type, cat) {
        return Ok((o, false));
    }
    if !default_type.is_quantized() {
        return Ok((default_type, false));
    }
    let mut new_type = default_type;
    let manual = opts.tensor_types.iter().find(|(p, _)| matches(p, t.name));
    if let Some((_, ty)) = manual {
        new_type = *ty;
    }
    if manual.is_none() && !opts.pure {
        new_type = st.mix_type(new_type, t, cat)?;
    }
    fallback(t.name, t.dims.first().copied().unwrap_or(1), new_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_layer_then_name() {
        let names = [
            "blk.10.a",
            "output.weight",
            "blk.2.b",
            "blk.2.a",
            "token_embd.weight",
        ];
        let o = output_order(&names);
        let sorted: Vec<&str> = o.iter().map(|&i| names[i]).collect();
        assert_eq!(
            sorted,
            [
                "output.weight",
                "token_embd.weight",
                "blk.2.a",
                "blk.2.b",
                "blk.10.a"
            ]
        );
    }

    #[test]
    fn fallbacks_follow_llama_cpp() {
        let f = |ty, n| fallback("t", n, ty).map(|r| r.0).ok();
        assert_eq!(f(GgmlType::Q4_K, 64), Some(GgmlType::Q5_0));
        assert_eq!(f(GgmlType::Q6_K, 192), Some(GgmlType::Q8_0));
        assert_eq!(f(GgmlType::Q5_K, 192), Some(GgmlType::Q5_1));
        assert_eq!(f(GgmlType::IQ3_S, 64), Some(GgmlType::IQ4_NL));
        assert_eq!(f(GgmlType::Q2_K, 48), Some(GgmlType::F16));
        assert_eq!(f(GgmlType::Q4_K, 256), Some(GgmlType::Q4_K));
        assert_eq!(f(GgmlType::Q1_0, 64), None);
    }

    #[test]
    fn file_type_names_round_trip() {
        for ft in FileType::all() {
            assert_eq!(FileType::parse(ft.name()), Some(ft));
            assert_eq!(FileType::parse(&ft.id().to_string()), Some(ft));
        }
        assert_eq!(FileType::parse("q4_k"), Some(FileType::Q4_K_M));
        assert_eq!(FileType::parse("nope"), None);
    }

    #[test]
    fn use_more_bits_pattern() {
        // 4 layers: n/8 = 0, 7n/8 = 3: layers 3 and those with (i - 0) % 3 == 2.
        let v: Vec<bool> = (0..4).map(|i| use_more_bits(i, 4)).collect();
        assert_eq!(v, [false, false, true, true]);
    }
}
