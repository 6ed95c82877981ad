//! The server's model-side facts and the small routes built on them: `GET /v1/models/{id}`,
//! llama-server's `GET /props` and `POST /apply-template`, `POST /verify` (the model page's
//! numeric check), and the vLLM body shapes of `/tokenize`.

use super::error::ApiError;
use super::params::{self, Fields};
use super::text::TextCodec;
use super::tools::ToolSupport;
use super::{read_json, AppState, Backend};
use crate::grammar::{VocabEntry, Vocabulary};
use axum::extract::{Path, Request, State};
use axum::Json;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

/// What the chat side learned about the model once.
pub(crate) struct ChatSupport {
    pub tools: ToolSupport,
    /// Variables the chat template reads (`None`: unknown, everything is passed).
    pub template_vars: Option<std::collections::BTreeSet<String>>,
    /// The vocabulary prepared for grammars, built at the first constrained request.
    vocab: OnceLock<Result<Arc<Vocabulary>, String>>,
    pub model: Option<Arc<gguf::Model>>,
    /// The last `/verify` result.
    verified: Mutex<Option<Value>>,
}

impl ChatSupport {
    pub fn new(codec: &dyn TextCodec) -> Self {
        ChatSupport {
            tools: ToolSupport::detect(codec),
            template_vars: codec.template_variables(),
            vocab: OnceLock::new(),
            model: None,
            verified: Mutex::new(None),
        }
    }

    /// The grammar vocabulary (built on first use; that walks the whole vocabulary, so call
    /// it off the async workers).
    pub fn vocabulary(&self, b: &Backend) -> Result<Arc<Vocabulary>, String> {
        self.vocab
            .get_or_init(|| {
                let entries: Vec<VocabEntry> = (0..b.engine.vocab_size() as u32)
                    .map(|id| match b.codec.token_bytes(id) {
                        None => VocabEntry::Unused,
                        Some(bytes) if b.codec.is_special(id) => {
                            VocabEntry::Special(String::from_utf8_lossy(&bytes).into_owned())
                        }
                        Some(bytes) if bytes.is_empty() => VocabEntry::Unused,
                        Some(bytes) => VocabEntry::Text(bytes),
                    })
                    .collect();
                Vocabulary::new(&entries, &b.eog)
                    .map(Arc::new)
                    .map_err(|e| format!("constrained decoding is unavailable for this model: {e}"))
            })
            .clone()
    }
}

/// `GET /v1/models/{id}`: the model object, or 404 for another id.
pub(crate) async fn model(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let b = s.backend()?;
    if id != b.model_name {
        return Err(ApiError::not_found(format!(
            "the model '{id}' does not exist"
        )));
    }
    Ok(Json(json!({
        "id": b.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "gguftool",
    })))
}

/// Architecture, quantization mix, tensor counts and memory of a GGUF model (the model page).
fn model_info(m: &gguf::Model, b: &Backend) -> Value {
    let md = m.metadata();
    let s = |k: &str| md.get(k).and_then(|v| v.as_str()).map(str::to_string);
    let mut types: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    let mut roles: BTreeMap<&'static str, u64> = BTreeMap::new();
    let (mut params, mut weight_bytes, mut blocks) =
        (0u64, 0u64, std::collections::BTreeSet::new());
    for t in m.tensors() {
        let e = types.entry(t.info.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.info.n_bytes();
        params += t.info.n_elements();
        weight_bytes += t.info.n_bytes();
        let name = t.info.name.as_str();
        if let Some(n) = name.strip_prefix("blk.").and_then(|r| r.split('.').next()) {
            blocks.insert(n.to_string());
        }
        *roles.entry(tensor_role(name)).or_default() += 1;
    }
    let cfg = b.engine.config();
    let metrics = b.engine.metrics();
    let per_token = metrics.kv_bytes_per_token();
    json!({
        "architecture": m.architecture(),
        "name": s("general.name"),
        "file_type": md.get("general.file_type").and_then(|v| v.as_u64()),
        "parameters": params,
        "n_tensors": m.n_tensors(),
        "blocks": blocks.len(),
        "shards": m.shards().len(),
        "file_bytes": m.total_file_size(),
        "tensor_types": types.iter().map(|(t, (n, by))| (t.to_string(), json!({"count": n, "bytes": by}))).collect::<Map<_, _>>(),
        "tensor_roles": roles.iter().map(|(r, n)| (r.to_string(), json!(n))).collect::<Map<_, _>>(),
        "context_length": b.engine.context_length(),
        "vocab_size": b.engine.vocab_size(),
        "memory": {
            "weight_bytes": weight_bytes,
            "kv_slots": cfg.max_running,
            "kv_capacity_tokens": cfg.max_running * cfg.context_length,
            // Measured on running sequences (null until one has run).
            "kv_bytes_per_token": per_token,
            "kv_bytes_at_capacity": per_token.map(|p| p * (cfg.max_running * cfg.context_length) as f64),
        },
        "verify": b.chat.verified.lock().unwrap_or_else(|e| e.into_inner()).clone(),
    })
}

fn tensor_role(name: &str) -> &'static str {
    if name.contains("_exps") {
        "routed experts"
    } else if name.contains("_shexp") {
        "shared expert"
    } else if name.contains(".indexer.") {
        "DSA indexer"
    } else if name.contains(".nextn.") {
        "MTP (NextN)"
    } else if name.contains("norm") {
        "norms"
    } else if name.contains(".attn_") {
        "attention"
    } else if name.contains(".ffn_") || name.contains("exp_probs") {
        "dense FFN / router"
    } else {
        "embedding / output"
    }
}

/// llama-server's `GET /props`, plus this server's chat and model facts.
pub(crate) async fn props(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let b = s.backend()?;
    let cfg = b.engine.config();
    Ok(Json(json!({
        "model_alias": b.model_name,
        "model_path": b.chat.model.as_ref().map(|m| m.path().display().to_string()),
        "total_slots": cfg.max_running,
        "default_generation_settings": {
            "n_ctx": b.engine.context_length(),
            "params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                       "repeat_penalty": 1.0, "repeat_last_n": 64, "n_predict": -1},
        },
        "chat_template": b.codec.chat_template(),
        "chat_template_caps": {
            "tool_format": b.chat.tools.format.as_str(),
            "supports_tools": b.chat.tools.format != super::tools::ToolFormat::Generic,
            "supports_system_role": b.chat.tools.system_role,
            "thinking_tokens": b.think.is_some(),
        },
        "modalities": {"vision": false, "audio": false},
        "build_info": concat!("gguftool ", env!("CARGO_PKG_VERSION")),
        "model": b.chat.model.as_ref().map(|m| model_info(m, &b)),
    })))
}

/// llama-server's `POST /apply-template`: the chat request's prompt text, tools and tool results
/// included, without generating.
pub(crate) async fn apply_template(
    State(s): State<Arc<AppState>>,
    req: Request,
) -> Result<Json<Value>, ApiError> {
    let b = s.backend()?;
    let body = read_json(&s, req).await?;
    let f = Fields::of(&body)?;
    let r = params::parse_chat_fields(&f)?;
    f.finish(&params::NO_OP_FIELDS)?;
    let p = super::prompt::prepare(&b, &r).await?;
    Ok(Json(json!({ "prompt": p.text })))
}

/// `POST /verify`: every tensor dequantized and checked for NaN, infinities and all-zero
/// contents (what `gguftool verify` reports), summarised for the model page. Reads every weight
/// once: minutes on a large model, and it shares the CPU with serving.
pub(crate) async fn verify(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let b = s.backend()?;
    let Some(model) = b.chat.model.clone() else {
        return Err(ApiError::not_found(
            "this backend has no GGUF file to verify",
        ));
    };
    let summary = tokio::task::spawn_blocking(move || {
        let t0 = std::time::Instant::now();
        let (mut n_nan, mut n_inf, mut bytes) = (0u64, 0u64, 0u64);
        let mut findings: Vec<Value> = Vec::new();
        for t in model.tensors() {
            let data = model.data(&t);
            bytes += data.len() as u64;
            match gguf::stats::tensor_stats(t.info.ty, data) {
                Ok(st) => {
                    n_nan += st.n_nan;
                    n_inf += st.n_inf;
                    if st.n_nan + st.n_inf > 0 {
                        findings.push(json!({"tensor": t.info.name, "kind": "nan_inf",
                            "message": format!("{} NaN, {} infinite values", st.n_nan, st.n_inf)}));
                    } else if st.count > 0 && st.zero_fraction == 1.0 {
                        findings.push(json!({"tensor": t.info.name, "kind": "all_zero",
                            "message": "every value is zero"}));
                    }
                }
                Err(e) => findings.push(json!({"tensor": t.info.name, "kind": "error",
                    "message": e.to_string()})),
            }
        }
        json!({
            "tensors": model.n_tensors(),
            "bytes": bytes,
            "seconds": t0.elapsed().as_secs_f64(),
            "n_nan": n_nan,
            "n_inf": n_inf,
            "findings": findings,
            "layout": "tensor table checked against the architecture when the model loaded",
        })
    })
    .await
    .map_err(|_| ApiError::internal("verify task failed"))?;
    *b.chat.verified.lock().unwrap_or_else(|e| e.into_inner()) = Some(summary.clone());
    Ok(Json(summary))
}

/// What `/tokenize` tokenizes: llama-server's `content`, vLLM's `prompt`, or vLLM's chat form
/// (`messages`, rendered like a chat request).
pub(crate) enum TokenizeInput {
    Text(String),
    Chat(Box<params::ChatRequest>),
}

pub(crate) fn tokenize_input(f: &Fields<'_>) -> Result<TokenizeInput, ApiError> {
    if let Some(c) = f.string("content")?.or(f.string("prompt")?) {
        return Ok(TokenizeInput::Text(c.to_string()));
    }
    if f.get("messages").is_some() {
        return Ok(TokenizeInput::Chat(Box::new(params::parse_chat_fields(f)?)));
    }
    Err(ApiError::invalid(
        "content",
        "'content' (or vLLM's 'prompt' or 'messages') is required",
    ))
}

/// The tokens of a `/tokenize` input: a chat is tokenized exactly as a chat request would be
/// (client text never becomes control tokens); plain text with `parse_special` as asked, bounded
/// like prompts.
pub(crate) async fn tokenize_ids(
    b: &Arc<Backend>,
    input: TokenizeInput,
    parse_special: bool,
) -> Result<Vec<u32>, ApiError> {
    match input {
        TokenizeInput::Text(t) => {
            let how = super::openai::Tokenize::Text { parse_special };
            super::openai::encode_as(b, t, how, "content").await
        }
        TokenizeInput::Chat(r) => Ok(super::prompt::prepare(b, &r).await?.ids),
    }
}

/// The `/tokenize` answer in both servers' shapes.
pub(crate) fn tokenize_answer(b: &Backend, tokens: Vec<Value>, ids: &[u32], strs: bool) -> Value {
    let mut v = json!({
        "tokens": tokens,
        "count": ids.len(),
        "max_model_len": b.engine.context_length(),
    });
    if strs {
        v["token_strs"] = ids
            .iter()
            .map(|&id| {
                json!(String::from_utf8_lossy(
                    &b.codec.token_bytes(id).unwrap_or_default()
                ))
            })
            .collect();
    }
    v
}
