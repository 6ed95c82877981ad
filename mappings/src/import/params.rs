//! config.json -> `{arch}.*` hyper-parameter keys, in the order and with the value types llama.cpp's
//! converter writes them (`TextModel.set_gguf_parameters` and the per-family overrides: DeepSeek-V2
//! MLA, GLM-DSA indexer, GLM-4 MoE, Llama, Gemma 3). Keys written twice keep their first position
//! and their last value, as in the converter's writer.

use super::kv::Kv;
use super::{ierr, FileType};
use crate::MappingError;
use gguf::value::ValueType;
use gguf::Value;
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// config.json as the converter sees it (`text_config` merged over the root).
#[derive(Debug, Clone)]
pub struct HParams {
    pub map: Map<String, Json>,
    /// The file as written (gguf-py's name heuristics read it unmerged).
    pub raw: Json,
    pub path: PathBuf,
}

impl HParams {
    pub fn load(dir: &Path) -> Result<HParams, MappingError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ierr(&path, e.to_string()))?;
        let raw: Json =
            serde_json::from_str(&text).map_err(|e| ierr(&path, format!("invalid JSON: {e}")))?;
        let mut map = raw
            .as_object()
            .cloned()
            .ok_or_else(|| ierr(&path, "not a JSON object"))?;
        if let Some(Json::Object(tc)) = map.get("text_config").cloned() {
            for (k, v) in tc {
                map.insert(k, v);
            }
        }
        Ok(HParams { map, raw, path })
    }

    /// Fills the keys transformers' config class would fill (data/import.yaml
    /// `config_defaults`): literals first, then the derived ones, which may read them.
    pub fn apply_defaults(&mut self, defaults: &BTreeMap<String, BTreeMap<String, Json>>) {
        let Some(mt) = self.map.get("model_type").and_then(Json::as_str) else {
            return;
        };
        let Some(d) = defaults.get(mt) else {
            return;
        };
        let derived = |v: &Json| v.is_object();
        let order = d
            .iter()
            .filter(|(_, v)| !derived(v))
            .chain(d.iter().filter(|(_, v)| derived(v)));
        for (k, v) in order {
            if self.map.get(k).is_some_and(|x| !x.is_null()) {
                continue;
            }
            let val = match v {
                Json::Object(o) if o.contains_key("from") => {
                    o["from"].as_str().and_then(|f| self.map.get(f)).cloned()
                }
                Json::Object(o) if o.contains_key("div") => {
                    let arg = |i: usize| {
                        o["div"]
                            .get(i)
                            .and_then(Json::as_str)
                            .and_then(|f| self.map.get(f))
                            .and_then(Json::as_u64)
                    };
                    match (arg(0), arg(1)) {
                        (Some(a), Some(b)) if b > 0 => Some(Json::from(a / b)),
                        _ => None,
                    }
                }
                other => Some(other.clone()),
            };
            if let Some(val) = val {
                self.map.insert(k.clone(), val);
            }
        }
    }

    /// A present, non-null value.
    pub fn get(&self, k: &str) -> Option<&Json> {
        self.map.get(k).filter(|v| !v.is_null())
    }

    /// The converter's `find_hparam`: the first key present (even when null) decides.
    pub fn find(&self, keys: &[&str]) -> Option<&Json> {
        keys.iter()
            .find_map(|k| self.map.get(*k))
            .filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, want: &str, v: &Json) -> MappingError {
        ierr(&self.path, format!("{key}: expected {want}, found {v}"))
    }

    pub fn int_of(&self, key: &str, v: &Json) -> Result<u64, MappingError> {
        v.as_u64()
            .filter(|x| *x <= u64::from(u32::MAX))
            .ok_or_else(|| self.bad(key, "an integer in 0..=4294967295", v))
    }

    pub fn float_of(&self, key: &str, v: &Json) -> Result<f64, MappingError> {
        match v {
            Json::Bool(b) => Ok(f64::from(u8::from(*b))),
            v => v.as_f64().ok_or_else(|| self.bad(key, "a number", v)),
        }
    }

    pub fn int(&self, key: &str) -> Result<Option<u64>, MappingError> {
        self.get(key).map(|v| self.int_of(key, v)).transpose()
    }

    pub fn req_int(&self, key: &str) -> Result<u64, MappingError> {
        self.int(key)?
            .ok_or_else(|| ierr(&self.path, format!("missing required key {key:?}")))
    }

    pub fn float(&self, key: &str) -> Result<Option<f64>, MappingError> {
        self.get(key).map(|v| self.float_of(key, v)).transpose()
    }

    /// Python truthiness of a value.
    pub fn truthy(&self, key: &str) -> bool {
        match self.get(key) {
            None => false,
            Some(Json::Bool(b)) => *b,
            Some(Json::Number(n)) => n.as_f64() != Some(0.0),
            Some(Json::String(s)) => !s.is_empty(),
            Some(Json::Array(a)) => !a.is_empty(),
            Some(Json::Object(o)) => !o.is_empty(),
            Some(Json::Null) => false,
        }
    }

    /// `TextModel.rope_parameters`: rope_parameters (or rope_scaling) with the global rope
    /// fields mirrored into it.
    pub fn rope_parameters(&self) -> Map<String, Json> {
        let mut rp = self
            .map
            .get("rope_parameters")
            .or_else(|| self.map.get("rope_scaling"))
            .and_then(Json::as_object)
            .cloned()
            .unwrap_or_default();
        let find = |ks: &[&str]| self.find(ks).cloned();
        let theta = find(&[
            "global_rope_theta",
            "rope_global_theta",
            "rope_theta_global",
            "rope_theta",
            "rotary_emb_base",
        ]);
        let local = find(&[
            "local_rope_theta",
            "rope_local_theta",
            "rope_theta_local",
            "swa_rope_theta",
            "rope_local_base_freq",
        ]);
        let prf = find(&["partial_rotary_factor", "rope_pct", "rope_percent"]);
        let orig = find(&["original_max_position_embeddings"]);
        if !rp.contains_key("full_attention") && !rp.contains_key("sliding_attention") {
            if let Some(l) = local {
                rp.insert(
                    "sliding_attention".into(),
                    serde_json::json!({ "rope_theta": l }),
                );
            }
            let ty = rp.get("type").cloned();
            for (k, v) in [
                ("rope_theta", theta),
                ("rope_type", ty),
                ("partial_rotary_factor", prf),
                ("original_max_position_embeddings", orig),
            ] {
                if let (false, Some(v)) = (rp.contains_key(k), v) {
                    rp.insert(k.into(), v);
                }
            }
        }
        rp
    }
}

/// The converter recipe of an architecture (see data/import.yaml).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    Text,
    Llama,
    Gemma3,
    Deepseek2,
    Deepseek2Nextn,
    GlmDsa,
    Glm4Moe,
}

impl Recipe {
    pub fn parse(s: &str) -> Option<Recipe> {
        Some(match s {
            "text" => Recipe::Text,
            "llama" => Recipe::Llama,
            "gemma3" => Recipe::Gemma3,
            "deepseek2" => Recipe::Deepseek2,
            "deepseek2-nextn" => Recipe::Deepseek2Nextn,
            "glm-dsa" => Recipe::GlmDsa,
            "glm4moe" => Recipe::Glm4Moe,
            _ => return None,
        })
    }

    fn mla(self) -> bool {
        matches!(
            self,
            Recipe::Deepseek2 | Recipe::Deepseek2Nextn | Recipe::GlmDsa
        )
    }
}

/// Notes for the user (the converter's warnings).
pub type Notes = Vec<String>;

struct W<'a> {
    kv: &'a mut Kv,
    hp: &'a HParams,
    arch: &'a str,
}

impl W<'_> {
    fn k(&self, s: &str) -> String {
        format!("{}.{s}", self.arch)
    }
    fn u32(&mut self, s: &str, v: u64) {
        let k = self.k(s);
        self.kv.u32(&k, v);
    }
    fn f32(&mut self, s: &str, v: f64) {
        let k = self.k(s);
        self.kv.f32(&k, v);
    }
    fn bool(&mut self, s: &str, v: bool) {
        let k = self.k(s);
        self.kv.bool(&k, v);
    }
    /// Writes an integer found under any of `keys`, when present.
    fn int_from(&mut self, s: &str, keys: &[&str]) -> Result<Option<u64>, MappingError> {
        match self.hp.find(keys) {
            Some(v) => {
                let x = self.hp.int_of(keys[0], v)?;
                self.u32(s, x);
                Ok(Some(x))
            }
            None => Ok(None),
        }
    }
    fn float_from(&mut self, s: &str, keys: &[&str]) -> Result<(), MappingError> {
        if let Some(v) = self.hp.find(keys) {
            let x = self.hp.float_of(keys[0], v)?;
            self.f32(s, x);
        }
        Ok(())
    }
}

/// Everything `set_gguf_parameters` writes for one recipe. `block_count` includes kept MTP blocks.
pub fn write_params(
    kv: &mut Kv,
    hp: &HParams,
    arch: &str,
    recipe: Recipe,
    block_count: u64,
    ftype: FileType,
    notes: &mut Notes,
) -> Result<(), MappingError> {
    let mut hp = hp.clone();
    if recipe.mla() {
        // MLA is stored as MQA over the latent (one KV head); the tensors were split with the
        // original head count before this override, as in the converter
        hp.map.insert("num_key_value_heads".into(), Json::from(1));
        if hp.get("rms_norm_eps").is_none() {
            hp.map.insert("rms_norm_eps".into(), Json::from(1e-6));
        }
    }
    let mut w = W { kv, hp: &hp, arch };
    text_params(&mut w, block_count, ftype, notes)?;
    let hp = &hp;
    match recipe {
        Recipe::Text => {}
        Recipe::Llama => {
            w.u32("vocab_size", hp.req_int("vocab_size")?);
            let rope = match hp.int("head_dim")? {
                Some(d) => d,
                None => hp.req_int("hidden_size")? / hp.req_int("num_attention_heads")?.max(1),
            };
            w.u32("rope.dimension_count", rope);
        }
        Recipe::Gemma3 => {
            let or_int = |k: &str, d: u64| hp.int(k).map(|v| v.unwrap_or(d));
            w.u32("context_length", or_int("max_position_embeddings", 131072)?);
            w.u32("attention.head_count", or_int("num_attention_heads", 8)?);
            w.f32(
                "attention.layer_norm_rms_epsilon",
                hp.float("rms_norm_eps")?.unwrap_or(1e-6),
            );
            let hd = or_int("head_dim", 256)?;
            w.u32("attention.key_length", hd);
            w.u32("attention.value_length", hd);
            let rp = hp.rope_parameters();
            let full = rp
                .get("full_attention")
                .and_then(Json::as_object)
                .unwrap_or(&rp);
            let theta = full
                .get("rope_theta")
                .map(|v| hp.float_of("rope_theta", v))
                .transpose()?
                .unwrap_or(1_000_000.0);
            w.f32("rope.freq_base", theta);
            if hp.truthy("final_logit_softcapping") {
                w.f32(
                    "final_logit_softcapping",
                    hp.float("final_logit_softcapping")?.unwrap_or(0.0),
                );
            }
            if hp.map.get("sliding_window_pattern") != Some(&Json::from(1)) {
                w.u32("attention.sliding_window", hp.req_int("sliding_window")?);
            }
            w.u32("attention.head_count_kv", or_int("num_key_value_heads", 4)?);
        }
        Recipe::Deepseek2 | Recipe::Deepseek2Nextn | Recipe::GlmDsa => {
            deepseek2_params(&mut w)?;
            if recipe == Recipe::Deepseek2Nextn {
                let n = hp.int("num_nextn_predict_layers")?.unwrap_or(0);
                if n > 0 {
                    w.u32("nextn_predict_layers", n);
                }
            }
            if recipe == Recipe::GlmDsa {
                let rope = hp.req_int("qk_rope_head_dim")?;
                let prf = partial_rotary(hp, 1.0)?;
                w.u32("rope.dimension_count", (rope as f64 * prf) as u64);
                w.int_from("nextn_predict_layers", &["num_nextn_predict_layers"])?;
                w.u32("attention.indexer.head_count", hp.req_int("index_n_heads")?);
                w.u32(
                    "attention.indexer.key_length",
                    hp.req_int("index_head_dim")?,
                );
                w.u32("attention.indexer.top_k", hp.req_int("index_topk")?);
                if let Some(types) = hp.get("indexer_types").and_then(Json::as_array) {
                    let vals = types
                        .iter()
                        .map(|t| Value::Bool(t.as_str() == Some("full")))
                        .collect();
                    let k = w.k("attention.indexer.types");
                    w.kv.array(&k, ValueType::Bool, vals);
                }
            }
        }
        Recipe::Glm4Moe => {
            let rope = match hp.int("head_dim")? {
                Some(d) => d,
                None => hp.req_int("hidden_size")? / hp.req_int("num_attention_heads")?.max(1),
            };
            let prf = partial_rotary(hp, 0.5)?;
            w.u32("rope.dimension_count", (rope as f64 * prf) as u64);
            w.int_from("expert_count", &["n_routed_experts"])?;
            w.int_from("expert_feed_forward_length", &["moe_intermediate_size"])?;
            w.int_from("expert_shared_count", &["n_shared_experts"])?;
            w.int_from("leading_dense_block_count", &["first_k_dense_replace"])?;
            w.u32("expert_gating_func", GATING_SIGMOID);
            w.float_from("expert_weights_scale", &["routed_scaling_factor"])?;
            if let Some(v) = hp.get("norm_topk_prob") {
                w.bool("expert_weights_norm", v.as_bool().unwrap_or(false));
            }
            w.int_from("nextn_predict_layers", &["num_nextn_predict_layers"])?;
        }
    }
    Ok(())
}

const GATING_SOFTMAX: u64 = 1;
const GATING_SIGMOID: u64 = 2;
const GATING_SQRTSOFTPLUS: u64 = 4;

fn partial_rotary(hp: &HParams, default: f64) -> Result<f64, MappingError> {
    match hp.rope_parameters().get("partial_rotary_factor") {
        Some(v) if !v.is_null() => hp.float_of("partial_rotary_factor", v),
        _ => Ok(default),
    }
}

/// `TextModel.set_gguf_parameters`.
fn text_params(
    w: &mut W,
    block_count: u64,
    ftype: FileType,
    notes: &mut Notes,
) -> Result<(), MappingError> {
    let hp = w.hp;
    w.u32("block_count", block_count);
    w.int_from(
        "context_length",
        &[
            "max_position_embeddings",
            "n_ctx",
            "n_positions",
            "max_length",
            "max_sequence_length",
            "model_max_length",
        ],
    )?;
    w.int_from("embedding_length", &["hidden_size", "n_embd", "dim"])?;
    w.int_from(
        "feed_forward_length",
        &[
            "prefix_dense_intermediate_size",
            "dense_intermediate_size",
            "intermediate_size",
            "n_inner",
            "hidden_dim",
        ],
    )?;
    w.int_from(
        "attention.head_count",
        &["num_attention_heads", "n_head", "n_heads"],
    )?;
    w.int_from(
        "attention.head_count_kv",
        &["num_key_value_heads", "n_kv_heads"],
    )?;
    if hp.map.get("is_causal") == Some(&Json::Bool(false)) {
        w.bool("attention.causal", false);
    }
    let rp = hp.rope_parameters();
    let params = rp
        .get("full_attention")
        .and_then(Json::as_object)
        .unwrap_or(&rp)
        .clone();
    let num = |k: &str| -> Result<Option<f64>, MappingError> {
        params
            .get(k)
            .filter(|v| !v.is_null())
            .map(|v| hp.float_of(k, v))
            .transpose()
    };
    if let Some(ty) = params.get("rope_type").and_then(Json::as_str) {
        let factor = num("factor")?;
        let key = w.k("rope.scaling.type");
        match (ty, factor) {
            ("linear", Some(f)) => {
                w.kv.string(&key, "linear");
                w.f32("rope.scaling.factor", f);
            }
            ("yarn", Some(f)) => {
                w.kv.string(&key, "yarn");
                w.f32("rope.scaling.factor", f);
                let orig = params
                    .get("original_max_position_embeddings")
                    .ok_or_else(|| {
                        ierr(&hp.path, "yarn rope needs original_max_position_embeddings")
                    })?;
                w.u32(
                    "rope.scaling.original_context_length",
                    hp.int_of("original_max_position_embeddings", orig)?,
                );
                for (k, names) in [
                    (
                        "rope.scaling.yarn_ext_factor",
                        &["extrapolation_factor"][..],
                    ),
                    (
                        "rope.scaling.yarn_attn_factor",
                        &["attention_factor", "attn_factor"],
                    ),
                    ("rope.scaling.yarn_beta_fast", &["beta_fast"]),
                    ("rope.scaling.yarn_beta_slow", &["beta_slow"]),
                ] {
                    if let Some(v) = names.iter().find_map(|n| num(n).transpose()) {
                        w.f32(k, v?);
                    }
                }
            }
            ("su" | "longrope", _) => w.kv.string(&key, "longrope"),
            ("linear" | "yarn" | "dynamic", _) => {}
            (t, _) if t.eq_ignore_ascii_case("llama3") => {}
            (t, _) => notes.push(format!("Unknown RoPE type: {t}")),
        }
    }
    if let Some(sec) = rp.get("mrope_section").and_then(Json::as_array) {
        let mut v: Vec<Value> = sec
            .iter()
            .map(|x| x.as_i64().map(|i| Value::I32(i as i32)))
            .collect::<Option<_>>()
            .ok_or_else(|| ierr(&hp.path, "mrope_section must be integers"))?;
        v.resize(4.max(v.len()), Value::I32(0));
        v.truncate(4);
        let k = w.k("rope.dimension_sections");
        w.kv.array(&k, ValueType::I32, v);
    }
    if let Some(t) = num("rope_theta")? {
        w.f32("rope.freq_base", t);
    }
    if let Some(t) = rp
        .get("sliding_attention")
        .and_then(|s| s.get("rope_theta"))
        .filter(|v| !v.is_null())
    {
        let t = hp.float_of("rope_theta", t)?;
        w.f32("rope.freq_base_swa", t);
    }
    w.float_from(
        "attention.layer_norm_rms_epsilon",
        &["rms_norm_eps", "norm_eps"],
    )?;
    w.float_from(
        "attention.layer_norm_epsilon",
        &["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"],
    )?;
    w.int_from(
        "expert_count",
        &["num_local_experts", "num_experts", "n_routed_experts"],
    )?;
    w.int_from(
        "expert_used_count",
        &[
            "num_experts_per_tok",
            "num_experts_per_token",
            "top_k_experts",
        ],
    )?;
    w.int_from("expert_group_count", &["n_group"])?;
    w.int_from("expert_group_used_count", &["topk_group"])?;
    if let Some(f) = hp.find(&[
        "score_function",
        "scoring_func",
        "score_func",
        "moe_router_activation",
        "moe_router_activation_func",
        "expert_selection_fn",
    ]) {
        let v = match f.as_str() {
            Some("sigmoid") => GATING_SIGMOID,
            Some("softmax") => GATING_SOFTMAX,
            Some("sqrtsoftplus") => GATING_SQRTSOFTPLUS,
            _ => {
                return Err(ierr(
                    &hp.path,
                    format!("unsupported expert score gating function {f}"),
                ))
            }
        };
        w.u32("expert_gating_func", v);
    }
    if let Some(hd) = hp.get("head_dim") {
        let hd = hp.int_of("head_dim", hd)?;
        w.u32("attention.key_length", hd);
        w.u32("attention.value_length", hd);
    }
    w.kv.u32("general.file_type", ftype.id());
    Ok(())
}

/// `DeepseekV2Model.set_gguf_parameters` after the text parameters.
fn deepseek2_params(w: &mut W) -> Result<(), MappingError> {
    let hp = w.hp;
    let has_moe = hp.get("n_routed_experts").is_some();
    let dense = match hp.int("first_k_dense_replace")? {
        Some(d) => d,
        None if has_moe => 0,
        None => hp.req_int("num_hidden_layers")?,
    };
    w.u32("leading_dense_block_count", dense);
    let kv_lora = hp.int("kv_lora_rank")?.unwrap_or(512);
    w.u32("vocab_size", hp.req_int("vocab_size")?);
    if let Some(q) = hp.int("q_lora_rank")? {
        w.u32("attention.q_lora_rank", q);
    }
    let rope = hp.req_int("qk_rope_head_dim")?;
    w.u32("attention.kv_lora_rank", kv_lora);
    w.u32("attention.key_length", kv_lora + rope);
    w.u32("attention.value_length", kv_lora);
    w.u32(
        "attention.key_length_mla",
        hp.req_int("qk_nope_head_dim")? + rope,
    );
    w.u32("attention.value_length_mla", hp.req_int("v_head_dim")?);
    let ff =
        w.hp.find(&["moe_intermediate_size", "intermediate_size"])
            .ok_or_else(|| ierr(&hp.path, "missing moe_intermediate_size"))?;
    let ff = hp.int_of("moe_intermediate_size", ff)?;
    w.u32("expert_feed_forward_length", ff);
    if let Some(n) = hp.int("n_routed_experts")? {
        w.u32("expert_count", n);
    }
    w.u32(
        "expert_shared_count",
        hp.int("n_shared_experts")?.unwrap_or(0),
    );
    if let Some(s) = hp.float("routed_scaling_factor")? {
        w.f32("expert_weights_scale", s);
    }
    if hp.truthy("norm_topk_prob") {
        w.bool("expert_weights_norm", true);
    }
    w.u32("rope.dimension_count", rope);
    if let Some(m) = hp
        .rope_parameters()
        .get("mscale_all_dim")
        .filter(|v| !v.is_null())
    {
        let m = hp.float_of("mscale_all_dim", m)?;
        w.f32("rope.scaling.yarn_log_multiplier", 0.1 * m);
    }
    Ok(())
}
