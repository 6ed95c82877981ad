//! Anthropic's Messages API (`POST /v1/messages`, streaming and tool use, and
//! `POST /v1/messages/count_tokens`), for Claude Code and other Anthropic clients. Requests
//! become the same [`ChatRequest`] the OpenAI endpoint runs; answers are Anthropic's content
//! blocks (`thinking`, `text`, `tool_use`) and its event stream. Errors are Anthropic-shaped
//! (`{"type": "error", "error": {"type", "message"}}`).

use super::choice::{self, Collected, Finish, Out};
use super::error::ApiError;
use super::openai::{self, Meta, SseFormat};
use super::params::{self, kind, ChatRequest, Common, Fields};
use super::prompt;
use super::text::{Channel, Message, ToolCall};
use super::tools::{ToolChoice, ToolDef};
use super::{read_json, AppState};
use crate::engine::Usage;
use crate::sampler::SamplingParams;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// Bookkeeping fields with no effect on the answer.
const NO_OP: [&str; 2] = ["metadata", "service_tier"];

fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

fn error_body(e: &ApiError) -> Value {
    let message = match &e.param {
        Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
        _ => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": error_type(e.status), "message": message}})
}

fn error_response(e: ApiError) -> Response {
    let mut r = (e.status, Json(error_body(&e))).into_response();
    if let Some(v) = e.clone().into_response().headers().get("retry-after") {
        r.headers_mut().insert("retry-after", v.clone());
    }
    r
}

pub(crate) async fn messages(State(s): State<Arc<AppState>>, req: Request) -> Response {
    messages_inner(s, req).await.unwrap_or_else(error_response)
}

pub(crate) async fn count_tokens(State(s): State<Arc<AppState>>, req: Request) -> Response {
    async {
        let b = s.backend()?;
        let body = read_json(&s, req).await?;
        let r = parse(&body, false)?;
        let p = prompt::prepare(&b, &r).await?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": p.ids.len()})).into_response())
    }
    .await
    .unwrap_or_else(error_response)
}

async fn messages_inner(s: Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let b = s.backend()?;
    let body = read_json(&s, req).await?;
    let r = parse(&body, true)?;
    let p = prompt::prepare(&b, &r).await?;
    let meta = Meta::new(&b, "msg");
    let prefix = format!("toolu_{}", meta.id.trim_start_matches("msg-"));
    let streams = openai::start_chat(&b, &r, &p, &prefix).await?;
    let fmt = MessageFormat {
        meta,
        input_tokens: p.ids.len(),
        block: None,
        next_index: 0,
    };
    if r.common.stream {
        return Ok(openai::sse_choices(streams, fmt, p.ids.len()));
    }
    let mut collected = choice::collect_all(streams).await;
    let c = collected.pop().unwrap_or_default();
    if let Some(e) = c.error {
        return Err(ApiError::internal(e));
    }
    Ok(Json(fmt.message(&c)).into_response())
}

/// An Anthropic request as a chat request. `generate`: `/v1/messages` (needs `max_tokens`),
/// else `count_tokens`.
fn parse(body: &Value, generate: bool) -> Result<ChatRequest, ApiError> {
    let f = Fields::of(body)?;
    f.string("model")?;
    let max_tokens = match f.integer("max_tokens", 1, u32::MAX as i64)? {
        Some(n) => Some(n as usize),
        None if generate => {
            return Err(ApiError::invalid("max_tokens", "'max_tokens' is required"))
        }
        None => None,
    };
    let sampling = SamplingParams {
        // Anthropic's temperature range is 0..1.
        temperature: f.number("temperature", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_p: f.number("top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_k: f.integer("top_k", 0, i32::MAX as i64)?.unwrap_or(0) as usize,
        ..SamplingParams::default()
    };
    let stream = f.boolean("stream")?.unwrap_or(false);
    let stop = match f.get("stop_sequences") {
        None => Vec::new(),
        Some(v) => {
            let a = v.as_array().ok_or_else(|| {
                ApiError::invalid(
                    "stop_sequences",
                    "'stop_sequences' must be an array of strings",
                )
            })?;
            params::stop_list(a.iter(), "stop_sequences")?
        }
    };
    let common = Common {
        max_tokens,
        sampling,
        stream,
        stop,
        ..Common::default()
    };
    let mut messages = Vec::new();
    match f.get("system") {
        None => {}
        Some(Value::String(s)) => messages.push(Message::new("system", s.clone())),
        Some(Value::Array(blocks)) => {
            let text = text_blocks(blocks, "system")?;
            messages.push(Message::new("system", text));
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "system",
                format!("'system' must be a string or text blocks, got {}", kind(v)),
            ))
        }
    }
    let list = match f.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => {
            return Err(ApiError::invalid(
                "messages",
                "'messages' must be a non-empty array",
            ))
        }
    };
    if list.len() > params::MAX_MESSAGES {
        return Err(ApiError::invalid("messages", "too many messages"));
    }
    for (i, m) in list.iter().enumerate() {
        push_message(&mut messages, m, i)?;
    }
    let (tools, tool_choice, parallel) = parse_tools(&f)?;
    let (enable_thinking, thinking_budget) = match f.object("thinking")? {
        None => (None, None),
        Some(t) => {
            let r = match t.string("type")? {
                Some("enabled") => {
                    let budget =
                        t.integer("budget_tokens", 1, u32::MAX as i64)?
                            .ok_or_else(|| {
                                ApiError::invalid(
                                    "thinking.budget_tokens",
                                    "'thinking.budget_tokens' is required",
                                )
                            })?;
                    (Some(true), Some(budget as usize))
                }
                Some("disabled") => (Some(false), None),
                _ => {
                    return Err(ApiError::invalid(
                        "thinking.type",
                        "thinking.type must be \"enabled\" or \"disabled\"",
                    ))
                }
            };
            t.finish(&[])?;
            r
        }
    };
    f.finish(&NO_OP)?;
    let mut template_kwargs = Map::new();
    if let Some(e) = enable_thinking {
        template_kwargs.insert("enable_thinking".into(), e.into());
    }
    Ok(ChatRequest {
        common,
        messages,
        logprobs: None,
        add_generation_prompt: true,
        template_kwargs,
        tools,
        tool_choice,
        parallel_tool_calls: parallel,
        legacy_functions: false,
        enable_thinking,
        reasoning_inline: false,
        thinking_budget,
    })
}

fn text_blocks(blocks: &[Value], p: &str) -> Result<String, ApiError> {
    let mut s = String::new();
    for (j, b) in blocks.iter().enumerate() {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => s.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            other => {
                return Err(ApiError::invalid(
                    &format!("{p}[{j}]"),
                    format!("{p}[{j}]: block type {other:?} is not supported here (only text)"),
                ))
            }
        }
    }
    Ok(s)
}

/// One Anthropic message: `tool_result` blocks become `tool` turns, `tool_use` blocks calls,
/// `thinking` blocks the turn's reasoning.
fn push_message(out: &mut Vec<Message>, m: &Value, i: usize) -> Result<(), ApiError> {
    let p = format!("messages[{i}]");
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(ApiError::invalid(
                &format!("{p}.role"),
                format!("{p}.role must be user or assistant"),
            ))
        }
    };
    let blocks: Vec<Value> = match m.get("content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(a)) => a.clone(),
        _ => {
            return Err(ApiError::invalid(
                &format!("{p}.content"),
                format!("{p}.content must be a string or blocks"),
            ))
        }
    };
    let mut msg = Message::new(role, "");
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{p}.content[{j}]");
        let bad = |what: &str| ApiError::invalid(&bp, format!("{bp}: {what}"));
        match (role, b.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => msg.content.push_str(
                b.get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("text is required"))?,
            ),
            ("user", Some("tool_result")) => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("tool_use_id is required"))?;
                let mut content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(a)) => text_blocks(a, &format!("{bp}.content"))?,
                    Some(_) => return Err(bad("content must be a string or text blocks")),
                };
                if b.get("is_error") == Some(&Value::Bool(true)) {
                    content = format!("Error: {content}");
                }
                out.push(Message {
                    tool_call_id: Some(id.to_string()),
                    ..Message::new("tool", content)
                });
            }
            ("assistant", Some("tool_use")) => {
                let id = b
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("id is required"))?;
                let name = b
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("name is required"))?;
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                msg.tool_calls.push(ToolCall {
                    id: id.to_string(),
                    name: name.to_string(),
                    arguments: input.to_string(),
                });
            }
            ("assistant", Some("thinking")) => {
                let t = b.get("thinking").and_then(Value::as_str).unwrap_or("");
                msg.reasoning_content
                    .get_or_insert_with(String::new)
                    .push_str(t);
            }
            (_, other) => return Err(bad(&format!("block type {other:?} is not supported"))),
        }
    }
    // A user turn made only of tool results adds no empty user message.
    if !(role == "user"
        && msg.content.is_empty()
        && blocks
            .iter()
            .all(|b| b.get("type").and_then(Value::as_str) == Some("tool_result")))
    {
        out.push(msg);
    }
    Ok(())
}

fn parse_tools(f: &Fields<'_>) -> Result<(Vec<ToolDef>, ToolChoice, bool), ApiError> {
    let mut tools = Vec::new();
    if let Some(v) = f.get("tools") {
        let a = v
            .as_array()
            .ok_or_else(|| ApiError::invalid("tools", "'tools' must be an array"))?;
        if a.len() > params::MAX_TOOLS {
            return Err(ApiError::invalid("tools", "too many tools"));
        }
        for (i, t) in a.iter().enumerate() {
            let p = format!("tools[{i}]");
            let o = t
                .as_object()
                .ok_or_else(|| ApiError::invalid(&p, format!("{p} must be an object")))?;
            let tf = Fields::new(o, &format!("{p}."));
            if let Some(ty) = tf.string("type")? {
                if ty != "custom" {
                    return Err(ApiError::invalid(
                        &format!("{p}.type"),
                        format!("server tool {ty:?} is not supported"),
                    ));
                }
            }
            let name = tf
                .string("name")?
                .ok_or_else(|| ApiError::invalid(&format!("{p}.name"), "name is required"))?;
            let description = tf.string("description")?.map(str::to_string);
            let parameters = match tf.get("input_schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{p}.input_schema"),
                        "input_schema must be a JSON schema object",
                    ))
                }
            };
            tf.get("cache_control");
            tf.finish(&[])?;
            tools.push(ToolDef {
                name: name.to_string(),
                description,
                parameters,
            });
        }
    }
    let (choice, parallel) = match f.object("tool_choice")? {
        None => (
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            },
            true,
        ),
        Some(tc) => {
            let parallel = !tc.boolean("disable_parallel_tool_use")?.unwrap_or(false);
            let c = match tc.string("type")? {
                Some("auto") => ToolChoice::Auto,
                Some("any") => ToolChoice::Required,
                Some("none") => ToolChoice::None,
                Some("tool") => {
                    let n = tc.string("name")?.ok_or_else(|| {
                        ApiError::invalid("tool_choice.name", "tool_choice.name is required")
                    })?;
                    if !tools.iter().any(|t| t.name == n) {
                        return Err(ApiError::invalid(
                            "tool_choice.name",
                            format!("no tool named {n:?}"),
                        ));
                    }
                    ToolChoice::Named(n.to_string())
                }
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice.type",
                        "tool_choice.type must be auto, any, tool or none",
                    ))
                }
            };
            tc.finish(&[])?;
            if c != ToolChoice::None && tools.is_empty() {
                return Err(ApiError::invalid("tool_choice", "tool_choice needs tools"));
            }
            (c, parallel)
        }
    };
    Ok((tools, choice, parallel))
}

/// Anthropic's event stream for one answer: content blocks opened and closed as the answer
/// moves from thinking to text to tool calls.
struct MessageFormat {
    meta: Meta,
    input_tokens: usize,
    /// The open block: its kind.
    block: Option<Channel>,
    next_index: usize,
}

fn event(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn stop_reason(f: Finish, stop: &Option<String>) -> &'static str {
    match f {
        Finish::Stop if stop.is_some() => "stop_sequence",
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
    }
}

fn tool_use(c: &ToolCall) -> Value {
    let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input})
}

impl MessageFormat {
    fn close(&mut self) -> String {
        match self.block.take() {
            Some(_) => event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.next_index - 1}),
            ),
            None => String::new(),
        }
    }

    fn open(&mut self, block: Value) -> String {
        let i = self.next_index;
        self.next_index += 1;
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": block}),
        )
    }

    fn message(&self, c: &Collected) -> Value {
        let mut content = Vec::new();
        if !c.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": c.reasoning, "signature": ""}));
        }
        if !c.content.is_empty() || (c.calls.is_empty() && content.is_empty()) {
            content.push(json!({"type": "text", "text": c.content}));
        }
        content.extend(c.calls.iter().map(tool_use));
        let (reason, usage, stop) =
            c.finish
                .clone()
                .unwrap_or((Finish::Stop, Usage::default(), None));
        json!({
            "id": self.meta.id,
            "type": "message",
            "role": "assistant",
            "model": self.meta.model,
            "content": content,
            "stop_reason": stop_reason(reason, &stop),
            "stop_sequence": stop,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": usage.completion_tokens},
        })
    }
}

impl SseFormat for MessageFormat {
    fn begin(&mut self, _n: usize) -> String {
        event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": self.meta.id, "type": "message", "role": "assistant", "model": self.meta.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}),
        )
    }

    fn event(&mut self, _i: usize, out: Out) -> String {
        match out {
            Out::Text { channel, text, .. } if !text.is_empty() => {
                let mut s = String::new();
                if self.block != Some(channel) {
                    s.push_str(&self.close());
                    s.push_str(&self.open(match channel {
                        Channel::Reasoning => {
                            json!({"type": "thinking", "thinking": "", "signature": ""})
                        }
                        Channel::Content => json!({"type": "text", "text": ""}),
                    }));
                    self.block = Some(channel);
                }
                let delta = match channel {
                    Channel::Reasoning => json!({"type": "thinking_delta", "thinking": text}),
                    Channel::Content => json!({"type": "text_delta", "text": text}),
                };
                s + &event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": self.next_index - 1, "delta": delta}),
                )
            }
            Out::Call(c) => {
                let mut s = self.close();
                let mut block = tool_use(&c);
                block["input"] = json!({});
                s.push_str(&self.open(block));
                s.push_str(&event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": self.next_index - 1,
                           "delta": {"type": "input_json_delta", "partial_json": c.arguments}}),
                ));
                s.push_str(&event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": self.next_index - 1}),
                ));
                s
            }
            Out::Finish {
                reason,
                usage,
                stop,
            } => {
                let mut s = self.close();
                if self.next_index == 0 {
                    // Anthropic answers always have a block.
                    s.push_str(&self.open(json!({"type": "text", "text": ""})));
                    self.block = Some(Channel::Content);
                    s.push_str(&self.close());
                }
                s + &event(
                    "message_delta",
                    json!({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason(reason, &stop), "stop_sequence": stop},
                           "usage": {"output_tokens": usage.completion_tokens}}),
                )
            }
            _ => String::new(),
        }
    }

    fn end(&mut self, _usage: Usage) -> String {
        event("message_stop", json!({"type": "message_stop"}))
    }

    fn error(&mut self, message: &str) -> String {
        event(
            "error",
            json!({"type": "error", "error": {"type": "api_error", "message": message}}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_become_chat_requests() {
        let r = parse(
            &json!({"model": "m", "max_tokens": 20, "system": [{"type": "text", "text": "be brief"}],
                "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
                ],
                "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "metadata": {"user_id": "u"}, "stop_sequences": ["END"]}),
            true,
        )
        .unwrap();
        let roles: Vec<&str> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!(r.messages[2].reasoning_content.as_deref(), Some("hmm"));
        assert_eq!(
            r.messages[2].tool_calls[0].arguments,
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("t1"));
        assert_eq!(r.tool_choice, ToolChoice::Required);
        assert!(!r.parallel_tool_calls);
        assert_eq!(
            (r.enable_thinking, r.thinking_budget),
            (Some(true), Some(1024))
        );
        assert_eq!(r.common.stop, ["END"]);
        for bad in [
            json!({"messages": [{"role": "user", "content": "x"}]}),
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}),
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_z": 1}),
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                   "tools": [{"type": "web_search_20250305", "name": "w"}]}),
        ] {
            assert_eq!(parse(&bad, true).unwrap_err().status, 400, "{bad}");
        }
    }

    #[test]
    fn errors_are_anthropic_shaped() {
        let v = error_body(&ApiError::invalid("max_tokens", "'max_tokens' is required"));
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(
            error_type(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error"
        );
    }
}
