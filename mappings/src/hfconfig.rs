//! The non-tensor files of an HF checkpoint rebuilt from GGUF metadata: `config.json`,
//! `generation_config.json`, `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`.
//! glm-dsa gets the full `GlmMoeDsaConfig` key set (as transformers 5.24 writes it); the other
//! architectures get their common keys.

use crate::MappingError;
use gguf::{Metadata, Value};
use serde_json::{json, Map, Value as Json};
use std::collections::BTreeMap;

fn merr(meta: &Metadata, msg: String) -> MappingError {
    MappingError::File {
        path: meta.file().to_path_buf(),
        msg,
    }
}

fn int(meta: &Metadata, key: &str) -> Result<u64, MappingError> {
    meta.get_u64(key).map_err(|e| merr(meta, e.to_string()))
}

fn int_or(meta: &Metadata, key: &str, default: u64) -> Result<u64, MappingError> {
    if meta.contains(key) {
        int(meta, key)
    } else {
        Ok(default)
    }
}

/// A float as the shortest decimal that reads back as the stored f32: GGUF keeps these as f32
/// (1e-5 is stored as 9.99999974e-6) while the HF config held the decimal the f32 came from.
fn float_json(meta: &Metadata, key: &str) -> Result<Option<Json>, MappingError> {
    let Some(v) = meta.get(key) else {
        return Ok(None);
    };
    let x = match v {
        Value::F32(x) => format!("{x}").parse::<f64>().unwrap_or(f64::from(*x)),
        other => other
            .as_f64()
            .ok_or_else(|| merr(meta, format!("{key}: expected a number")))?,
    };
    Ok(serde_json::Number::from_f64(x).map(Json::Number))
}

fn tok_id(meta: &Metadata, key: &str) -> Option<u64> {
    meta.get(key).and_then(Value::as_u64)
}

/// `config.json` for a model of table `arch`. `tied`: the GGUF has no `output.weight`.
pub fn config_json(
    meta: &Metadata,
    arch: &str,
    tied: bool,
    dtype: &str,
) -> Result<Json, MappingError> {
    let k = |s: &str| format!("{arch}.{s}");
    let mut c: BTreeMap<&str, Json> = BTreeMap::new();
    let block_count = int(meta, &k("block_count"))?;
    let nextn = int_or(meta, &k("nextn_predict_layers"), 0)?;
    let n_layer = block_count
        .checked_sub(nextn)
        .ok_or_else(|| merr(meta, "nextn_predict_layers exceeds block_count".into()))?;
    let n_head = int(meta, &k("attention.head_count"))?;
    let vocab = match meta.get(&k("vocab_size")) {
        Some(_) => int(meta, &k("vocab_size"))?,
        None => meta
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .map(|a| a.len() as u64)
            .ok_or_else(|| merr(meta, "no vocab_size and no tokenizer.ggml.tokens".into()))?,
    };
    c.insert("hidden_size", json!(int(meta, &k("embedding_length"))?));
    c.insert("num_hidden_layers", json!(n_layer));
    c.insert("num_attention_heads", json!(n_head));
    c.insert(
        "max_position_embeddings",
        json!(int(meta, &k("context_length"))?),
    );
    c.insert("vocab_size", json!(vocab));
    c.insert("tie_word_embeddings", json!(tied));
    c.insert("dtype", json!(dtype));
    c.insert(
        "hidden_act",
        json!(if arch == "gemma3" {
            "gelu_pytorch_tanh"
        } else {
            "silu"
        }),
    );
    c.insert("attention_dropout", json!(0.0));
    c.insert("initializer_range", json!(0.02));
    c.insert("use_cache", json!(true));
    if let Some(eps) = float_json(meta, &k("attention.layer_norm_rms_epsilon"))? {
        c.insert("rms_norm_eps", eps);
    }
    if meta.contains(&k("feed_forward_length")) {
        c.insert(
            "intermediate_size",
            json!(int(meta, &k("feed_forward_length"))?),
        );
    }
    let theta = float_json(meta, &k("rope.freq_base"))?.unwrap_or(json!(10000.0));
    c.insert(
        "rope_parameters",
        json!({"rope_theta": theta, "rope_type": "default"}),
    );
    c.insert(
        "pad_token_id",
        json!(tok_id(meta, "tokenizer.ggml.padding_token_id")),
    );
    // the GGUF bos of GLM ([gMASK]) is a tokenizer choice of the converter, not the model config's
    c.insert(
        "bos_token_id",
        json!(if arch == "glm-dsa" {
            None
        } else {
            tok_id(meta, "tokenizer.ggml.bos_token_id")
        }),
    );
    c.insert("eos_token_id", eos_list(meta));

    match arch {
        "glm-dsa" => {
            let kv_lora = int(meta, &k("attention.kv_lora_rank"))?;
            let n_rot = int(meta, &k("rope.dimension_count"))?;
            let key_mla = int(meta, &k("attention.key_length_mla"))?;
            let v_mla = int(meta, &k("attention.value_length_mla"))?;
            let n_dense = int_or(meta, &k("leading_dense_block_count"), 0)?.min(n_layer);
            let idx_types: Vec<Json> = match meta
                .get(&k("attention.indexer.types"))
                .and_then(Value::as_array)
            {
                Some(a) => a
                    .values
                    .iter()
                    .map(|v| {
                        json!(if v.as_bool().unwrap_or(true) {
                            "full"
                        } else {
                            "shared"
                        })
                    })
                    .collect(),
                None => vec![json!("full"); n_layer as usize],
            };
            c.insert("architectures", json!(["GlmMoeDsaForCausalLM"]));
            c.insert("model_type", json!("glm_moe_dsa"));
            c.insert("attention_bias", json!(false));
            c.insert("mlp_bias", json!(false));
            c.insert("output_router_logits", json!(false));
            c.insert("first_k_dense_replace", json!(n_dense));
            c.insert("head_dim", json!(n_rot));
            c.insert("qk_rope_head_dim", json!(n_rot));
            c.insert("qk_head_dim", json!(key_mla));
            c.insert(
                "qk_nope_head_dim",
                json!(key_mla
                    .checked_sub(n_rot)
                    .ok_or_else(|| merr(meta, "key_length_mla < rope.dimension_count".into()))?),
            );
            c.insert("v_head_dim", json!(v_mla));
            c.insert("kv_lora_rank", json!(kv_lora));
            c.insert(
                "q_lora_rank",
                json!(int(meta, &k("attention.q_lora_rank"))?),
            );
            // MLA GGUFs store head_count_kv = 1 (MQA over the latent); HF keeps one per head
            c.insert("num_key_value_heads", json!(n_head));
            c.insert(
                "index_head_dim",
                json!(int(meta, &k("attention.indexer.key_length"))?),
            );
            c.insert(
                "index_n_heads",
                json!(int(meta, &k("attention.indexer.head_count"))?),
            );
            c.insert(
                "index_topk",
                json!(int(meta, &k("attention.indexer.top_k"))?),
            );
            c.insert("indexer_types", Json::Array(idx_types));
            c.insert(
                "layer_types",
                json!(vec!["indexed_attention"; n_layer as usize]),
            );
            let mut mlp = vec!["dense"; n_dense as usize];
            mlp.extend(vec!["sparse"; (n_layer - n_dense) as usize]);
            c.insert("mlp_layer_types", json!(mlp));
            c.insert(
                "moe_intermediate_size",
                json!(int(meta, &k("expert_feed_forward_length"))?),
            );
            c.insert("n_routed_experts", json!(int(meta, &k("expert_count"))?));
            c.insert(
                "n_shared_experts",
                json!(int(meta, &k("expert_shared_count"))?),
            );
            c.insert(
                "num_experts_per_tok",
                json!(int(meta, &k("expert_used_count"))?),
            );
            c.insert("n_group", json!(int_or(meta, &k("expert_group_count"), 1)?));
            c.insert(
                "topk_group",
                json!(int_or(meta, &k("expert_group_used_count"), 1)?),
            );
            c.insert(
                "norm_topk_prob",
                json!(meta
                    .get(&k("expert_weights_norm"))
                    .and_then(Value::as_bool)
                    .unwrap_or(false)),
            );
            c.insert(
                "routed_scaling_factor",
                float_json(meta, &k("expert_weights_scale"))?.unwrap_or(json!(1.0)),
            );
            c.insert("num_nextn_predict_layers", json!(nextn));
        }
        _ => {
            let (class, mt) = match arch {
                "llama" => ("LlamaForCausalLM", "llama"),
                "qwen2" => ("Qwen2ForCausalLM", "qwen2"),
                "qwen3" => ("Qwen3ForCausalLM", "qwen3"),
                "gemma3" => ("Gemma3ForCausalLM", "gemma3_text"),
                "deepseek2" => ("DeepseekV3ForCausalLM", "deepseek_v3"),
                "glm4moe" => ("Glm4MoeForCausalLM", "glm4_moe"),
                other => return Err(merr(meta, format!("no config.json recipe for {other}"))),
            };
            c.insert("architectures", json!([class]));
            c.insert("model_type", json!(mt));
            c.insert(
                "num_key_value_heads",
                json!(int_or(meta, &k("attention.head_count_kv"), n_head)?),
            );
            if meta.contains(&k("attention.key_length")) {
                c.insert("head_dim", json!(int(meta, &k("attention.key_length"))?));
            }
            if meta.contains(&k("expert_count")) {
                c.insert("num_local_experts", json!(int(meta, &k("expert_count"))?));
                c.insert(
                    "num_experts_per_tok",
                    json!(int_or(meta, &k("expert_used_count"), 0)?),
                );
            }
            if let Some(w) = meta
                .get(&k("attention.sliding_window"))
                .and_then(Value::as_u64)
            {
                c.insert("sliding_window", json!(w));
            }
        }
    }
    Ok(Json::Object(
        c.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
    ))
}

/// End-of-generation ids as HF lists them: eos, then eot and eom when distinct.
fn eos_list(meta: &Metadata) -> Json {
    let mut ids: Vec<u64> = vec![];
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(i) = tok_id(meta, key) {
            if !ids.contains(&i) {
                ids.push(i);
            }
        }
    }
    match ids.as_slice() {
        [] => Json::Null,
        [one] => json!(one),
        many => json!(many),
    }
}

/// `generation_config.json`: end-of-generation ids, pad id and the sampling defaults the GGUF
/// recommends (general.sampling.*).
pub fn generation_config_json(meta: &Metadata) -> Result<Json, MappingError> {
    let mut c = Map::new();
    let eos = eos_list(meta);
    if !eos.is_null() {
        c.insert("eos_token_id".into(), eos);
    }
    if let Some(p) = tok_id(meta, "tokenizer.ggml.padding_token_id") {
        c.insert("pad_token_id".into(), json!(p));
    }
    for (key, name) in [
        ("general.sampling.temp", "temperature"),
        ("general.sampling.top_p", "top_p"),
        ("general.sampling.min_p", "min_p"),
    ] {
        if let Some(v) = float_json(meta, key)? {
            c.insert(name.into(), v);
        }
    }
    if let Some(v) = meta.get("general.sampling.top_k").and_then(Value::as_u64) {
        c.insert("top_k".into(), json!(v));
    }
    Ok(Json::Object(c))
}

/// Pre-tokenizer regexes by `tokenizer.ggml.pre` (llama.cpp's names), with BPE `ignore_merges`.
fn pre_tokenizer(pre: &str) -> Option<(Option<&'static str>, bool)> {
    // GLM-4.5/5 and Llama 3 share one regex (digits in groups of up to 3); Qwen2 splits digits
    // one by one; plain GPT-2 uses ByteLevel's built-in regex.
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "glm4" | "chatglm-bpe" | "llama-bpe" | "llama3" => (Some(LLAMA3), true),
        "qwen2" => (Some(QWEN2), false),
        "gpt-2" | "gpt2" | "default" => (None, false),
        _ => return None,
    })
}

/// ggml token types (llama.cpp `llama_token_type`).
const TOKEN_NORMAL: i64 = 1;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// `tokenizer.json` and `tokenizer_config.json` for a byte-level BPE vocabulary
/// (`tokenizer.ggml.model == "gpt2"`). `Ok(None)` with a reason for vocabularies it cannot rebuild.
pub fn tokenizer_files(
    meta: &Metadata,
    arch: &str,
) -> Result<Result<(Json, Json), String>, MappingError> {
    let model = meta.get("tokenizer.ggml.model").and_then(Value::as_str);
    if model != Some("gpt2") {
        return Ok(Err(format!(
            "tokenizer model {model:?} is not byte-level BPE (gpt2)"
        )));
    }
    let pre_name = meta
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let Some((regex, ignore_merges)) = pre_tokenizer(pre_name) else {
        return Ok(Err(format!(
            "pre-tokenizer {pre_name:?} has no known tokenizer.json form"
        )));
    };
    let tokens = meta
        .get_str_array("tokenizer.ggml.tokens")
        .map_err(|e| merr(meta, e.to_string()))?;
    let types = match meta.get("tokenizer.ggml.token_type") {
        Some(_) => meta
            .get_i64_array("tokenizer.ggml.token_type")
            .map_err(|e| merr(meta, e.to_string()))?,
        None => vec![TOKEN_NORMAL; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(merr(
            meta,
            format!("{} token types for {} tokens", types.len(), tokens.len()),
        ));
    }
    let merges = match meta.get("tokenizer.ggml.merges") {
        Some(_) => meta
            .get_str_array("tokenizer.ggml.merges")
            .map_err(|e| merr(meta, e.to_string()))?,
        None => vec![],
    };
    let mut vocab = Map::new();
    let mut added = vec![];
    for (id, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
        match *ty {
            TOKEN_CONTROL | TOKEN_USER_DEFINED => added.push(json!({
                "id": id,
                "content": tok,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": *ty == TOKEN_USER_DEFINED,
                "special": *ty == TOKEN_CONTROL,
            })),
            // UNUSED padding ids ([PAD2000]...) were invented by the converter to fill the
            // model's vocab_size; the original tokenizer never had them
            5 => {}
            _ => {
                vocab.insert(tok.to_string(), json!(id));
            }
        }
    }
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok(json!([a, b])),
            None => Err(merr(meta, format!("merge {m:?} is not two tokens"))),
        })
        .collect::<Result<_, _>>()?;
    let byte_level = |prefix: bool, use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": !use_regex || prefix, "use_regex": use_regex});
    let pre_tok = match regex {
        Some(r) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        ]}),
        None => byte_level(false, true),
    };
    let bos = tok_id(meta, "tokenizer.ggml.bos_token_id");
    let add_bos = meta
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let name_of = |id: Option<u64>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|s| s.to_string())
    };
    let (single, pair, specials) = match (add_bos, name_of(bos)) {
        (true, Some(b)) => (
            json!([{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]),
            json!([{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}]),
            json!({ b.clone(): {"id": b, "ids": [bos], "tokens": [b]} }),
        ),
        _ => (
            json!([{"Sequence": {"id": "A", "type_id": 0}}]),
            json!([{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]),
            json!({}),
        ),
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tok,
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    });

    let mut cfg: BTreeMap<&str, Json> = BTreeMap::new();
    cfg.insert("backend", json!("tokenizers"));
    cfg.insert("tokenizer_class", json!("TokenizersBackend"));
    cfg.insert("clean_up_tokenization_spaces", json!(false));
    if let Ok(n) = int(meta, &format!("{arch}.context_length")) {
        cfg.insert("model_max_length", json!(n));
    }
    if let Some(e) = name_of(tok_id(meta, "tokenizer.ggml.eos_token_id")) {
        cfg.insert("eos_token", json!(e));
    }
    if let Some(p) = name_of(tok_id(meta, "tokenizer.ggml.padding_token_id")) {
        cfg.insert("pad_token", json!(p));
    }
    if add_bos {
        if let Some(b) = name_of(bos) {
            cfg.insert("bos_token", json!(b));
        }
    }
    if let Some(t) = meta.get("tokenizer.chat_template").and_then(Value::as_str) {
        cfg.insert("chat_template", json!(t));
    }
    let cfg = Json::Object(cfg.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
    Ok(Ok((tokenizer, cfg)))
}
