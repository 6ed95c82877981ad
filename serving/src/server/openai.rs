//! `/v1/completions` and `/v1/chat/completions`: request -> engine -> OpenAI JSON or SSE.

use super::error::ApiError;
use super::params::{self, Common, Prompt};
use super::text::{Channel, Piece, TextOptions, TextStream, TokenInfo};
use super::{read_json, sse_response, unix_time, AppState, Backend};
use crate::engine::{FinishReason, GenerationRequest, SubmitError, TokenLogprobs, Usage};
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// OpenAI's default `max_tokens` for the legacy completions endpoint.
const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// JSON has no infinity; OpenAI reports impossible tokens as -9999.
fn lp_value(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

fn request_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}-{:08x}{:08x}",
        nanos,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Tokenization can take a while on long prompts: keep it off the async workers. The work is
/// bounded by the context length (a longer prompt is refused before it is fully tokenized), and
/// a chat prompt takes special tokens only from the template's own text.
async fn encode(b: &Backend, text: String, chat: bool) -> Result<Vec<u32>, ApiError> {
    let codec = b.codec.clone();
    let limit = b.engine.context_length();
    let r = tokio::task::spawn_blocking(move || {
        if chat {
            codec.encode_chat(&text, limit)
        } else {
            codec.encode_bounded(&text, true, limit)
        }
    })
    .await
    .map_err(|_| ApiError::internal("tokenizer task failed"))?
    .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))?;
    match r {
        super::text::Bounded::Complete(ids) => Ok(ids),
        super::text::Bounded::Exceeds { limit } => Err(ApiError::invalid(
            if chat { "messages" } else { "prompt" },
            format!("the prompt is longer than the context of {limit} tokens"),
        )),
    }
}

fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull { .. } => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            e.to_string(),
        ),
        SubmitError::Stopped => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            e.to_string(),
        ),
        SubmitError::ContextExceeded { .. } => ApiError::invalid("max_tokens", e.to_string()),
        SubmitError::EmptyPrompt | SubmitError::TokenOutOfRange { .. } => {
            ApiError::invalid("prompt", e.to_string())
        }
    }
}

fn generation_request(
    b: &Backend,
    c: &Common,
    prompt: Vec<u32>,
    max_tokens: usize,
    logprobs: Option<usize>,
    prompt_logprobs: bool,
) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_tokens,
        sampling: c.sampling,
        stop_tokens: if c.ignore_eos {
            Vec::new()
        } else {
            b.eog.clone()
        },
        logprobs,
        prompt_logprobs: if prompt_logprobs { logprobs } else { None },
        logit_bias: c.logit_bias.clone(),
        presence_penalty: c.presence_penalty,
        frequency_penalty: c.frequency_penalty,
    }
}

/// Fields common to every response object of one request.
#[derive(Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
}

fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

fn token_text(b: &Backend, id: u32) -> (String, Vec<u8>) {
    let bytes = b.codec.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

// ---------------------------------------------------------------------------------------------
// /v1/completions

pub(crate) async fn completions(State(s): State<Arc<AppState>>, req: Request) -> Response {
    completions_inner(s, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions_inner(s: Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let b = s.backend()?;
    let body = read_json(&s, req).await?;
    let r = params::parse_completion(&body)?;
    let (prompt_ids, prompt_text) = match r.prompt {
        Prompt::Text(t) => (encode(&b, t.clone(), false).await?, t),
        Prompt::Tokens(ids) => {
            // Ids are checked against the vocabulary before decoding (and again by the engine).
            let vocab = b.engine.vocab_size();
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(submit_error(SubmitError::TokenOutOfRange {
                    id: bad,
                    vocab,
                }));
            }
            let t = b.codec.decode(&ids, false);
            (ids, t)
        }
    };
    let max_tokens = r.common.max_tokens.unwrap_or(DEFAULT_COMPLETION_TOKENS);
    let echo_lps = r.echo && r.logprobs.is_some();
    let n_prompt = prompt_ids.len();
    let gen = b
        .engine
        .submit(generation_request(
            &b,
            &r.common,
            prompt_ids.clone(),
            max_tokens,
            r.logprobs,
            echo_lps,
        ))
        .map_err(submit_error)?;
    let ts = TextStream::new(
        gen,
        b.codec.clone(),
        TextOptions {
            stop: r.common.stop.clone(),
            think: None,
            start_in_reasoning: false,
            prompt_tokens: n_prompt,
        },
    );
    let meta = Meta {
        id: request_id("cmpl"),
        created: unix_time(),
        model: b.model_name.clone(),
    };
    let st = CompletionStream {
        b,
        ts,
        meta,
        logprobs: r.logprobs.is_some(),
        echo: r.echo.then_some((prompt_text, prompt_ids)),
        offset: 0,
        include_usage: r.common.include_usage,
        done: false,
    };
    respond(st, r.common.stream).await
}

/// OpenAI's legacy logprobs object: parallel arrays.
#[derive(Default)]
struct CompletionLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    fn push(&mut self, b: &Backend, id: u32, lp: Option<&TokenLogprobs>, offset: usize) {
        self.tokens.push(json!(token_text(b, id).0));
        self.text_offset.push(offset);
        match lp {
            None => {
                self.token_logprobs.push(Value::Null);
                self.top_logprobs.push(Value::Null);
            }
            Some(lp) => {
                self.token_logprobs.push(json!(lp_value(lp.logprob)));
                let mut top = Map::new();
                for &(t, l) in &lp.top {
                    top.entry(token_text(b, t).0)
                        .or_insert_with(|| json!(lp_value(l)));
                }
                self.top_logprobs.push(Value::Object(top));
            }
        }
    }

    fn json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

struct CompletionStream {
    b: Arc<Backend>,
    ts: TextStream,
    meta: Meta,
    logprobs: bool,
    /// Prompt text and ids when `echo` is set; taken when the echo is sent.
    echo: Option<(String, Vec<u32>)>,
    /// Characters of text sent so far (`text_offset`).
    offset: usize,
    include_usage: bool,
    done: bool,
}

/// What one step of a completion produced.
enum Step {
    Text {
        text: String,
        lps: Option<CompletionLogprobs>,
    },
    Finish(FinishReason, Usage),
    Error(String),
}

impl CompletionStream {
    /// Prompt echo (with its logprobs when asked): the first token has no prediction.
    fn echo_step(&mut self, prompt_lps: Option<Vec<TokenLogprobs>>) -> Option<Step> {
        let (text, ids) = self.echo.take()?;
        let lps = prompt_lps.map(|lps| {
            let mut out = CompletionLogprobs::default();
            let mut off = self.offset;
            for (i, &id) in ids.iter().enumerate() {
                let lp = i.checked_sub(1).and_then(|j| lps.get(j));
                out.push(&self.b, id, lp, off);
                off += token_text(&self.b, id).0.chars().count();
            }
            out
        });
        self.offset += text.chars().count();
        Some(Step::Text { text, lps })
    }

    async fn next_step(&mut self) -> Option<Step> {
        // Without logprobs the echo does not wait for the engine.
        if self.echo.is_some() && !self.logprobs {
            return self.echo_step(None);
        }
        loop {
            match self.ts.next().await? {
                Piece::Prompt(lps) => {
                    if let Some(s) = self.echo_step(Some(lps)) {
                        return Some(s);
                    }
                }
                Piece::Text { text, tokens, .. } => {
                    let lps = self.logprobs.then(|| {
                        let mut out = CompletionLogprobs::default();
                        for TokenInfo { id, logprobs } in &tokens {
                            out.push(&self.b, *id, logprobs.as_ref(), self.offset);
                        }
                        out
                    });
                    self.offset += text.chars().count();
                    if text.is_empty() && lps.is_none() {
                        continue;
                    }
                    return Some(Step::Text { text, lps });
                }
                Piece::Finish { reason, usage } => return Some(Step::Finish(reason, usage)),
                Piece::Error(e) => return Some(Step::Error(e)),
            }
        }
    }

    fn chunk(&self, text: &str, lps: Option<Value>, finish: Option<&str>) -> Value {
        let mut v = json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [{
                "index": 0,
                "text": text,
                "logprobs": lps,
                "finish_reason": finish,
            }],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

impl Generation for CompletionStream {
    async fn next_event(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let out = match self.next_step().await {
            Some(Step::Text { text, lps }) => sse(&self.chunk(&text, lps.map(|l| l.json()), None)),
            Some(Step::Finish(reason, usage)) => {
                self.done = true;
                let mut s = sse(&self.chunk("", None, Some(reason.as_str())));
                if self.include_usage {
                    let mut u = self.chunk("", None, None);
                    u["choices"] = json!([]);
                    u["usage"] = usage_json(usage);
                    s.push_str(&sse(&u));
                }
                s + "data: [DONE]\n\n"
            }
            Some(Step::Error(e)) => {
                self.done = true;
                sse(&ApiError::internal(e).body()) + "data: [DONE]\n\n"
            }
            None => {
                self.done = true;
                "data: [DONE]\n\n".to_string()
            }
        };
        Some(Bytes::from(out))
    }

    async fn collect(mut self) -> Result<Response, ApiError> {
        let mut text = String::new();
        let mut all = self.logprobs.then(CompletionLogprobs::default);
        loop {
            match self.next_step().await {
                Some(Step::Text { text: t, lps }) => {
                    text.push_str(&t);
                    if let (Some(all), Some(l)) = (all.as_mut(), lps) {
                        all.tokens.extend(l.tokens);
                        all.token_logprobs.extend(l.token_logprobs);
                        all.top_logprobs.extend(l.top_logprobs);
                        all.text_offset.extend(l.text_offset);
                    }
                }
                Some(Step::Finish(reason, usage)) => {
                    let mut v = self.chunk(&text, all.map(|a| a.json()), Some(reason.as_str()));
                    v["usage"] = usage_json(usage);
                    return Ok(Json(v).into_response());
                }
                Some(Step::Error(e)) => return Err(ApiError::internal(e)),
                None => return Err(ApiError::internal("generation ended without a result")),
            }
        }
    }
}

/// One generation, answered either as a single JSON body or as server-sent events.
trait Generation: Send + Sized + 'static {
    /// The next SSE bytes, ending with `data: [DONE]`; `None` once that has been sent.
    fn next_event(&mut self) -> impl Future<Output = Option<Bytes>> + Send;
    /// Runs the generation to its end and answers with one JSON body.
    fn collect(self) -> impl Future<Output = Result<Response, ApiError>> + Send;
}

/// Streams or collects `st`, as the request's `stream` flag asks: both endpoints share this.
async fn respond(st: impl Generation, stream: bool) -> Result<Response, ApiError> {
    if stream {
        Ok(sse_response(futures::stream::unfold(
            st,
            |mut st| async move {
                let bytes = st.next_event().await?;
                Some((Ok(bytes), st))
            },
        )))
    } else {
        st.collect().await
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

// ---------------------------------------------------------------------------------------------
// /v1/chat/completions

pub(crate) async fn chat_completions(State(s): State<Arc<AppState>>, req: Request) -> Response {
    chat_inner(s, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_inner(s: Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let b = s.backend()?;
    let body = read_json(&s, req).await?;
    let r = params::parse_chat(&body)?;
    let codec = b.codec.clone();
    let (messages, add_gen) = (r.messages.clone(), r.add_generation_prompt);
    let kwargs = r.template_kwargs.clone();
    let prompt =
        tokio::task::spawn_blocking(move || codec.render_chat(&messages, add_gen, &kwargs))
            .await
            .map_err(|_| ApiError::internal("chat template task failed"))?
            .map_err(|e| ApiError::invalid("messages", format!("chat template: {e}")))?;
    let ids = encode(&b, prompt, true).await?;
    let ctx = b.engine.context_length();
    // Without a limit a chat answer may use the rest of the context (OpenAI has no default).
    let max_tokens = r
        .common
        .max_tokens
        .unwrap_or_else(|| ctx.saturating_sub(ids.len()).max(1));
    let start_in_reasoning = b.think.is_some_and(|(open, close)| {
        ids.iter().rev().find(|&&t| t == open || t == close) == Some(&open)
    });
    let n_prompt = ids.len();
    let gen = b
        .engine
        .submit(generation_request(
            &b, &r.common, ids, max_tokens, r.logprobs, false,
        ))
        .map_err(submit_error)?;
    let ts = TextStream::new(
        gen,
        b.codec.clone(),
        TextOptions {
            stop: r.common.stop.clone(),
            think: b.think,
            start_in_reasoning,
            prompt_tokens: n_prompt,
        },
    );
    let st = ChatStream {
        meta: Meta {
            id: request_id("chatcmpl"),
            created: unix_time(),
            model: b.model_name.clone(),
        },
        b,
        ts,
        logprobs: r.logprobs.is_some(),
        include_usage: r.common.include_usage,
        started: false,
        done: false,
    };
    respond(st, r.common.stream).await
}

struct ChatStream {
    b: Arc<Backend>,
    ts: TextStream,
    meta: Meta,
    logprobs: bool,
    include_usage: bool,
    started: bool,
    done: bool,
}

impl ChatStream {
    fn lp_entries(&self, tokens: &[TokenInfo]) -> Vec<Value> {
        tokens
            .iter()
            .filter_map(|t| {
                let lp = t.logprobs.as_ref()?;
                let (tok, bytes) = token_text(&self.b, t.id);
                let top: Vec<Value> = lp
                    .top
                    .iter()
                    .map(|&(id, l)| {
                        let (tok, bytes) = token_text(&self.b, id);
                        json!({"token": tok, "logprob": lp_value(l), "bytes": bytes})
                    })
                    .collect();
                Some(json!({
                    "token": tok,
                    "logprob": lp_value(lp.logprob),
                    "bytes": bytes,
                    "top_logprobs": top,
                }))
            })
            .collect()
    }

    fn chunk(&self, delta: Value, lps: Option<Vec<Value>>, finish: Option<&str>) -> Value {
        let mut v = json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": lps.map(|c| json!({"content": c})),
                "finish_reason": finish,
            }],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

impl Generation for ChatStream {
    async fn next_event(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        if !self.started {
            self.started = true;
            let first = self.chunk(json!({"role": "assistant", "content": ""}), None, None);
            return Some(Bytes::from(sse(&first)));
        }
        let out = loop {
            match self.ts.next().await {
                Some(Piece::Text {
                    channel,
                    text,
                    tokens,
                }) => {
                    let lps = self.logprobs.then(|| self.lp_entries(&tokens));
                    if text.is_empty() && lps.as_ref().is_none_or(|l| l.is_empty()) {
                        continue;
                    }
                    let delta = match channel {
                        Channel::Content => json!({ "content": text }),
                        Channel::Reasoning => json!({ "reasoning_content": text }),
                    };
                    break sse(&self.chunk(delta, lps, None));
                }
                Some(Piece::Prompt(_)) => continue,
                Some(Piece::Finish { reason, usage }) => {
                    self.done = true;
                    let mut s = sse(&self.chunk(json!({}), None, Some(reason.as_str())));
                    if self.include_usage {
                        let mut u = self.chunk(json!({}), None, None);
                        u["choices"] = json!([]);
                        u["usage"] = usage_json(usage);
                        s.push_str(&sse(&u));
                    }
                    break s + "data: [DONE]\n\n";
                }
                Some(Piece::Error(e)) => {
                    self.done = true;
                    break sse(&ApiError::internal(e).body()) + "data: [DONE]\n\n";
                }
                None => {
                    self.done = true;
                    break "data: [DONE]\n\n".to_string();
                }
            }
        };
        Some(Bytes::from(out))
    }

    async fn collect(mut self) -> Result<Response, ApiError> {
        let (mut content, mut reasoning) = (String::new(), String::new());
        let mut lps: Vec<Value> = Vec::new();
        loop {
            match self.ts.next().await {
                Some(Piece::Text {
                    channel,
                    text,
                    tokens,
                }) => {
                    match channel {
                        Channel::Content => content.push_str(&text),
                        Channel::Reasoning => reasoning.push_str(&text),
                    }
                    if self.logprobs {
                        lps.extend(self.lp_entries(&tokens));
                    }
                }
                Some(Piece::Prompt(_)) => {}
                Some(Piece::Finish { reason, usage }) => {
                    let mut message = json!({"role": "assistant", "content": content});
                    if !reasoning.is_empty() {
                        message["reasoning_content"] = json!(reasoning);
                    }
                    let v = json!({
                        "id": self.meta.id,
                        "object": "chat.completion",
                        "created": self.meta.created,
                        "model": self.meta.model,
                        "choices": [{
                            "index": 0,
                            "message": message,
                            "logprobs": self.logprobs.then(|| json!({"content": lps})),
                            "finish_reason": reason.as_str(),
                        }],
                        "usage": usage_json(usage),
                    });
                    return Ok(Json(v).into_response());
                }
                Some(Piece::Error(e)) => return Err(ApiError::internal(e)),
                None => return Err(ApiError::internal("generation ended without a result")),
            }
        }
    }
}
