//! Request bodies of the OpenAI endpoints, validated field by field.
//!
//! Bodies are read as `serde_json::Value` and every field is checked for type and range here,
//! so that each mistake gets its own 400 naming the field (CVE-2026-21869 came from a numeric
//! field nobody range-checked). Unknown fields are ignored, as OpenAI-compatible servers do,
//! because clients send many optional ones; known fields we cannot honour are refused.

use super::error::ApiError;
use super::text::Message;
use crate::sampler::{self, SamplingParams};
use serde_json::{Map, Value};

/// Most stop strings per request, and the longest one (bytes).
pub const MAX_STOP: usize = 16;
pub const MAX_STOP_LEN: usize = 1024;
/// Most alternatives per token in logprobs.
pub const MAX_TOP_LOGPROBS: usize = 20;
pub const MAX_LOGIT_BIAS: usize = 1024;
pub const MAX_MESSAGES: usize = 65536;
pub const MAX_TEMPLATE_KWARGS: usize = 64;

/// Fields shared by `/v1/completions` and `/v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct Common {
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub logit_bias: Vec<(u32, f32)>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub ignore_eos: bool,
    /// llama-server's `n_probs`: top alternatives per token.
    pub n_probs: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompt: Prompt,
    pub echo: bool,
    /// `logprobs: N`: the sampled token's logprob plus N alternatives.
    pub logprobs: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub common: Common,
    pub messages: Vec<Message>,
    /// `logprobs: true` with `top_logprobs: N` alternatives.
    pub logprobs: Option<usize>,
    pub add_generation_prompt: bool,
    /// Extra chat template variables (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`).
    pub template_kwargs: Map<String, Value>,
}

/// Typed access to a JSON object's optional fields; `null` counts as absent.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// The body as an object, or a 400.
    pub fn of(v: &'a Value) -> Result<Self, ApiError> {
        match v {
            Value::Object(m) => Ok(Fields(m)),
            _ => Err(ApiError::bad_request(
                "the request body must be a JSON object",
            )),
        }
    }

    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub fn number(&self, name: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let x = v.as_f64().filter(|_| v.is_number()).ok_or_else(|| {
            ApiError::invalid(name, format!("'{name}' must be a number, got {}", kind(v)))
        })?;
        if !(min..=max).contains(&x) {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' must be between {min} and {max}, got {x}"),
            ));
        }
        Ok(Some(x))
    }

    pub fn integer(&self, name: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let x = integer_value(v).ok_or_else(|| {
            ApiError::invalid(
                name,
                format!("'{name}' must be an integer, got {}", kind(v)),
            )
        })?;
        if x < min as i128 || x > max as i128 {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' must be between {min} and {max}, got {x}"),
            ));
        }
        Ok(Some(x as i64))
    }

    pub fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid(
                name,
                format!("'{name}' must be a boolean, got {}", kind(v)),
            )),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid(
                name,
                format!("'{name}' must be a string, got {}", kind(v)),
            )),
        }
    }
}

/// Integers, also written as floats with no fraction (`16.0`), as Python clients sometimes do.
/// i128 so that every u64 and i64 fits before the range check.
fn integer_value(v: &Value) -> Option<i128> {
    if let Some(i) = v.as_i64() {
        return Some(i as i128);
    }
    if let Some(u) = v.as_u64() {
        return Some(u as i128);
    }
    let f = v.as_f64()?;
    (f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e18).then_some(f as i128)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse_common(f: &Fields<'_>, min_max_tokens: i64) -> Result<Common, ApiError> {
    f.string("model")?;
    f.string("user")?;
    let max_tokens = match f.integer("max_completion_tokens", min_max_tokens, u32::MAX as i64)? {
        Some(n) => Some(n),
        None => f.integer("max_tokens", min_max_tokens, u32::MAX as i64)?,
    }
    .map(|n| n as usize);
    // llama-server's name for the same limit; -1 there means "no limit".
    let max_tokens = match (max_tokens, f.integer("n_predict", -1, u32::MAX as i64)?) {
        (Some(n), _) => Some(n),
        (None, Some(n)) if n >= 0 => Some(n as usize),
        _ => None,
    };
    // The ranges are the sampler's, shared with `generate` (SamplingParams::validate).
    let range = |r: sampler::SamplingRange| f.number(r.field, r.min, r.max);
    let temperature = range(sampler::TEMPERATURE)?.unwrap_or(1.0) as f32;
    let top_p = range(sampler::TOP_P)?.unwrap_or(1.0) as f32;
    let min_p = range(sampler::MIN_P)?.unwrap_or(0.0) as f32;
    let top_k = f.integer("top_k", -1, i32::MAX as i64)?.unwrap_or(0).max(0) as usize;
    // -1 asks for a random seed (llama-server); other values are taken bit for bit.
    let seed = match f.integer("seed", i64::MIN, i64::MAX)? {
        None | Some(-1) => None,
        Some(s) => Some(s as u64),
    };
    if let Some(n) = f.integer("n", 1, 128)? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                "only n = 1 is supported; send several requests instead",
            ));
        }
    }
    let stop = parse_stop(f)?;
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o)
            .boolean("include_usage")
            .map_err(|e| ApiError {
                param: Some("stream_options.include_usage".into()),
                ..e
            })?
            .unwrap_or(false),
        Some(v) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("'stream_options' must be an object, got {}", kind(v)),
            ))
        }
    };
    let presence_penalty = f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let frequency_penalty = f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let logit_bias = parse_logit_bias(f)?;
    let ignore_eos = f.boolean("ignore_eos")?.unwrap_or(false);
    let n_probs = f
        .integer("n_probs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize);
    if let Some(v) = f.get("response_format") {
        let ok = v
            .as_object()
            .and_then(|o| o.get("type"))
            .and_then(Value::as_str)
            == Some("text");
        if !ok {
            return Err(ApiError::invalid(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
    }
    Ok(Common {
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
        },
        stop,
        stream,
        include_usage,
        logit_bias,
        presence_penalty,
        frequency_penalty,
        ignore_eos,
        n_probs,
    })
}

fn parse_stop(f: &Fields<'_>) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Value> = match f.get("stop") {
        None => return Ok(Vec::new()),
        Some(v @ Value::String(_)) => vec![v],
        Some(Value::Array(a)) => a.iter().collect(),
        Some(v) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "'stop' must be a string or an array of strings, got {}",
                    kind(v)
                ),
            ))
        }
    };
    if list.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "at most {MAX_STOP} stop sequences are allowed, got {}",
                list.len()
            ),
        ));
    }
    list.into_iter()
        .map(|v| match v {
            Value::String(s) if s.is_empty() => Err(ApiError::invalid(
                "stop",
                "stop sequences must not be empty",
            )),
            Value::String(s) if s.len() > MAX_STOP_LEN => Err(ApiError::invalid(
                "stop",
                format!("stop sequences are limited to {MAX_STOP_LEN} bytes"),
            )),
            Value::String(s) => Ok(s.clone()),
            v => Err(ApiError::invalid(
                "stop",
                format!("stop sequences must be strings, got {}", kind(v)),
            )),
        })
        .collect()
}

fn parse_logit_bias(f: &Fields<'_>) -> Result<Vec<(u32, f32)>, ApiError> {
    let m = match f.get("logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(ApiError::invalid(
                "logit_bias",
                format!(
                    "'logit_bias' must be an object mapping token ids to numbers, got {}",
                    kind(v)
                ),
            ))
        }
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS} logit_bias entries are allowed"),
        ));
    }
    m.iter()
        .map(|(k, v)| {
            let id: u32 = k.parse().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias key {k:?} is not a token id"),
                )
            })?;
            let b = v
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!(
                            "logit_bias values must be numbers between -100 and 100 (token {k})"
                        ),
                    )
                })?;
            // OpenAI: -100 effectively bans the token.
            let b = if b <= -100.0 {
                f32::NEG_INFINITY
            } else {
                b as f32
            };
            Ok((id, b))
        })
        .collect()
}

/// Refuse fields that would change the answer in ways this server does not implement.
fn refuse_unsupported(f: &Fields<'_>) -> Result<(), ApiError> {
    if let Some(n) = f.integer("best_of", 1, 128)? {
        if n != 1 {
            return Err(ApiError::invalid(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "'suffix' is not supported"));
    }
    match f.get("tools") {
        None => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "tools",
                "tool calling is not supported by this server",
            ))
        }
    }
    Ok(())
}

pub fn parse_completion(body: &Value) -> Result<CompletionRequest, ApiError> {
    let f = Fields::of(body)?;
    refuse_unsupported(&f)?;
    let common = parse_common(&f, 0)?;
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(v) => parse_prompt(v)?,
    };
    let echo = f.boolean("echo")?.unwrap_or(false);
    let logprobs = f
        .integer("logprobs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize)
        .or(common.n_probs);
    Ok(CompletionRequest {
        common,
        prompt,
        echo,
        logprobs,
    })
}

fn parse_prompt(v: &Value) -> Result<Prompt, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "'prompt' must be a string, an array of token ids, or an array holding one of those",
        )
    };
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) if a.is_empty() => Err(ApiError::invalid("prompt", "'prompt' is empty")),
        Value::Array(a) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => {
            parse_prompt(&a[0])
        }
        Value::Array(a) if a.iter().all(Value::is_number) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        ApiError::invalid("prompt", format!("invalid token id {t} in 'prompt'"))
                    })
            })
            .collect::<Result<Vec<u32>, _>>()
            .map(Prompt::Tokens),
        Value::Array(a) if a.len() > 1 && a.iter().all(|x| x.is_string() || x.is_array()) => {
            Err(ApiError::invalid(
                "prompt",
                "several prompts in one request are not supported; send one request per prompt",
            ))
        }
        _ => Err(bad()),
    }
}

pub fn parse_chat(body: &Value) -> Result<ChatRequest, ApiError> {
    let f = Fields::of(body)?;
    refuse_unsupported(&f)?;
    let common = parse_common(&f, 1)?;
    let messages = match f.get("messages") {
        None => return Err(ApiError::invalid("messages", "'messages' is required")),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("'messages' must be an array of messages, got {}", kind(v)),
            ))
        }
    };
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must not be empty",
        ));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(
            "messages",
            format!("at most {MAX_MESSAGES} messages are allowed"),
        ));
    }
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let logprobs_on = f.boolean("logprobs")?.unwrap_or(false);
    let top = f
        .integer("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize);
    let logprobs = match (logprobs_on, top.or(common.n_probs)) {
        (true, k) => Some(k.unwrap_or(0)),
        // `top_logprobs` without `logprobs: true` is an error at OpenAI; asking for
        // alternatives clearly means wanting logprobs, so honour it.
        (false, Some(k)) => Some(k),
        (false, None) => None,
    };
    let add_generation_prompt = f.boolean("add_generation_prompt")?.unwrap_or(true);
    let template_kwargs = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(m)) if m.len() <= MAX_TEMPLATE_KWARGS => {
            // The template's own variables cannot be replaced this way.
            for k in ["messages", "add_generation_prompt"] {
                if m.contains_key(k) {
                    return Err(ApiError::invalid(
                        "chat_template_kwargs",
                        format!("chat_template_kwargs must not set '{k}'"),
                    ));
                }
            }
            m.clone()
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                format!("'chat_template_kwargs' must be an object with at most {MAX_TEMPLATE_KWARGS} entries"),
            ))
        }
    };
    Ok(ChatRequest {
        common,
        messages,
        logprobs,
        add_generation_prompt,
        template_kwargs,
    })
}

fn parse_message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let p = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(o) = m else {
        return Err(ApiError::invalid(
            &format!("messages[{i}]"),
            format!("messages[{i}] must be an object, got {}", kind(m)),
        ));
    };
    let role = match o.get("role") {
        Some(Value::String(r)) => r.as_str(),
        _ => {
            return Err(ApiError::invalid(
                &p("role"),
                format!("messages[{i}].role must be a string"),
            ))
        }
    };
    let role = match role {
        "system" | "user" | "assistant" | "tool" => role,
        // OpenAI's newer name for the system role; chat templates know only "system".
        "developer" => "system",
        _ => {
            return Err(ApiError::invalid(
                &p("role"),
                format!("messages[{i}].role {role:?} is not one of system, developer, user, assistant, tool"),
            ))
        }
    };
    let content = match o.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (j, part) in parts.iter().enumerate() {
                let text = part
                    .as_object()
                    .filter(|o| o.get("type").and_then(Value::as_str) == Some("text"))
                    .and_then(|o| o.get("text"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            &p(&format!("content[{j}]")),
                            format!("messages[{i}].content[{j}]: only {{\"type\": \"text\", \"text\": ...}} parts are supported"),
                        )
                    })?;
                s.push_str(text);
            }
            s
        }
        Some(v) => {
            return Err(ApiError::invalid(
                &p("content"),
                format!(
                    "messages[{i}].content must be a string or an array of text parts, got {}",
                    kind(v)
                ),
            ))
        }
    };
    Ok(Message {
        role: role.to_string(),
        content,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn completion(v: Value) -> Result<CompletionRequest, ApiError> {
        parse_completion(&v)
    }

    #[test]
    fn accepts_a_typical_request() {
        let r = completion(json!({"model": "x", "prompt": "hi", "max_tokens": 5,
            "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3,
            "stop": ["\n"], "stream": true, "stream_options": {"include_usage": true},
            "logprobs": 2, "echo": true, "some_unknown_field": [1, 2]}))
        .unwrap();
        assert_eq!(r.common.max_tokens, Some(5));
        assert_eq!(r.common.sampling.top_k, 40);
        assert_eq!(r.common.sampling.seed, Some(3));
        assert_eq!(r.common.stop, vec!["\n".to_string()]);
        assert!(r.common.stream && r.common.include_usage && r.echo);
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
    }

    #[test]
    fn rejects_bad_fields_naming_them() {
        let cases = [
            (json!({"prompt": "x", "max_tokens": -1}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 1.5}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 1e300}), "max_tokens"),
            (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
            (json!({"prompt": "x", "temperature": -0.1}), "temperature"),
            (json!({"prompt": "x", "top_p": 5}), "top_p"),
            (json!({"prompt": "x", "top_k": -2}), "top_k"),
            (json!({"prompt": "x", "min_p": 2}), "min_p"),
            (json!({"prompt": "x", "n": 1000000}), "n"),
            (json!({"prompt": "x", "n": 2}), "n"),
            (json!({"prompt": "x", "stop": vec!["a"; 17]}), "stop"),
            (json!({"prompt": "x", "stop": [""]}), "stop"),
            (json!({"prompt": "x", "stop": 3}), "stop"),
            (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (json!({"prompt": "x", "logit_bias": {"a": 1}}), "logit_bias"),
            (
                json!({"prompt": "x", "logit_bias": {"1": 500}}),
                "logit_bias",
            ),
            (json!({"prompt": "x", "seed": "1"}), "seed"),
            (
                json!({"prompt": "x", "presence_penalty": 3}),
                "presence_penalty",
            ),
            (json!({"prompt": "x", "best_of": 3}), "best_of"),
            (json!({"prompt": [-1]}), "prompt"),
            (json!({"prompt": ["a", "b"]}), "prompt"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": {"a": 1}}), "prompt"),
            (json!({}), "prompt"),
        ];
        for (body, field) in cases {
            let e = completion(body.clone()).expect_err(&body.to_string());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
        assert!(completion(json!("a string")).is_err());
    }

    #[test]
    fn prompt_forms() {
        let p = |v| completion(json!({"prompt": v})).unwrap().prompt;
        assert_eq!(p(json!([1, 2])), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!([[1, 2]])), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!(["ab"])), Prompt::Text("ab".into()));
    }

    #[test]
    fn chat_messages() {
        let r = parse_chat(&json!({"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ], "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 7}))
        .unwrap();
        assert_eq!(r.messages[0].role, "system");
        assert_eq!(r.messages[1].content, "ab");
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(r.common.max_tokens, Some(7));
        for bad in [
            json!({"messages": "hi"}),
            json!({"messages": []}),
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            json!({"messages": [{"content": "x"}]}),
            json!({"messages": [{"role": "user", "content": 5}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99}),
        ] {
            let e = parse_chat(&bad).expect_err(&bad.to_string());
            assert_eq!(e.status, 400);
        }
    }
}
