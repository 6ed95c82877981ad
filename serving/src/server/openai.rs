//! `/v1/completions` and `/v1/chat/completions`: request -> engine -> OpenAI JSON or SSE.
//! Several prompts and `n > 1` give several choices, each its own sequence in the engine's
//! batch (a seeded request gives choice `i` the seed `seed + i`).

use super::choice::{self, ChoiceStream, Collected, Out};
use super::error::ApiError;
use super::params::{self, ChatRequest, Common, Prompt, RepeatLen};
use super::prompt::{self, ChatPrompt};
use super::text::{Channel, TextOptions, TextStream, TokenInfo, ToolCall};
use super::tools::ToolParser;
use super::{read_json, sse_response, unix_time, AppState, Backend};
use crate::engine::{GenerationRequest, SharedConstraint, SubmitError, TokenLogprobs, Usage};
use crate::grammar::Reasoning;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Map, Value};
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

pub(crate) fn request_id(prefix: &str) -> String {
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

/// How a text becomes tokens.
#[derive(Clone, Copy)]
pub(crate) enum Tokenize {
    /// A rendered chat prompt: special tokens only from the template's own text.
    Chat,
    /// Plain text, special-token text parsed as such when asked.
    Text { parse_special: bool },
}

/// Tokenization can take a while on long prompts: keep it off the async workers. The work is
/// bounded by the context length (a longer text is refused, naming `param`, before it is fully
/// tokenized).
pub(crate) async fn encode_as(
    b: &Backend,
    text: String,
    how: Tokenize,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    let codec = b.codec.clone();
    let limit = b.engine.context_length();
    let r = tokio::task::spawn_blocking(move || match how {
        Tokenize::Chat => codec.encode_chat(&text, limit),
        Tokenize::Text { parse_special } => codec.encode_bounded(&text, parse_special, limit),
    })
    .await
    .map_err(|_| ApiError::internal("tokenizer task failed"))?
    .map_err(|e| ApiError::invalid(param, format!("cannot tokenize the text: {e}")))?;
    match r {
        super::text::Bounded::Complete(ids) => Ok(ids),
        super::text::Bounded::Exceeds { limit } => Err(ApiError::invalid(
            param,
            format!("the prompt is longer than the context of {limit} tokens"),
        )),
    }
}

/// A prompt's tokens (`chat`: a rendered chat prompt, else a completion prompt).
pub(crate) async fn encode(b: &Backend, text: String, chat: bool) -> Result<Vec<u32>, ApiError> {
    if chat {
        encode_as(b, text, Tokenize::Chat, "messages").await
    } else {
        let how = Tokenize::Text {
            parse_special: true,
        };
        encode_as(b, text, how, "prompt").await
    }
}

pub(crate) fn submit_error(e: SubmitError) -> ApiError {
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

/// What a request reports besides the text: `top` alternatives per token (when set), and the
/// prompt's logprobs too (`echo`).
#[derive(Clone, Copy)]
pub(crate) struct LogprobsWanted {
    pub top: Option<usize>,
    pub prompt: bool,
}

/// What every choice of one prompt shares.
pub(crate) struct ChoiceRequest<'a> {
    pub common: &'a Common,
    pub prompt: &'a [u32],
    pub max_tokens: usize,
    pub logprobs: LogprobsWanted,
    pub constraint: &'a Option<SharedConstraint>,
}

/// The engine request of choice `choice` (its seed offset by the choice number).
fn generation_request(b: &Backend, r: &ChoiceRequest<'_>, choice: usize) -> GenerationRequest {
    let c = r.common;
    let mut sampling = c.sampling;
    sampling.seed = sampling.seed.map(|s| s.wrapping_add(choice as u64));
    let mut stop_tokens = if c.ignore_eos {
        Vec::new()
    } else {
        b.eog.clone()
    };
    stop_tokens.extend(&c.stop_token_ids);
    GenerationRequest {
        prompt: r.prompt.to_vec(),
        max_tokens: r.max_tokens,
        sampling,
        stop_tokens,
        logprobs: r.logprobs.top,
        prompt_logprobs: if r.logprobs.prompt {
            r.logprobs.top
        } else {
            None
        },
        logit_bias: c.logit_bias.clone(),
        presence_penalty: c.presence_penalty,
        frequency_penalty: c.frequency_penalty,
        repeat_penalty: c.repeat_penalty,
        repeat_last_n: match c.repeat_last_n {
            RepeatLen::Tokens(n) => n,
            RepeatLen::Context => b.engine.context_length(),
        },
        constraint: r.constraint.clone(),
        min_tokens: c.min_tokens,
    }
}

/// Queue choice `choice` and wrap its events into text, then into choice events (tool calls
/// parsed by `tools` when set, their ids prefixed by `call_prefix`).
fn submit_choice(
    b: &Backend,
    r: &ChoiceRequest<'_>,
    choice: usize,
    opts: TextOptions,
    tools: Option<ToolParser>,
    call_prefix: String,
) -> Result<ChoiceStream, ApiError> {
    let gen = b
        .engine
        .submit(generation_request(b, r, choice))
        .map_err(submit_error)?;
    let ts = TextStream::new(gen, b.codec.clone(), opts);
    Ok(ChoiceStream::new(
        ts,
        tools,
        r.common.include_stop,
        call_prefix,
    ))
}

/// Fields common to every response object of one request.
#[derive(Clone)]
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    pub fn new(b: &Backend, prefix: &str) -> Self {
        Meta {
            id: request_id(prefix),
            created: unix_time(),
            model: b.model_name.clone(),
        }
    }
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

/// Formats the outputs of several choices as one SSE stream.
pub(crate) trait SseFormat: Send + 'static {
    /// Events before any output (the chat role chunks).
    fn begin(&mut self, _choices: usize) -> String {
        String::new()
    }
    /// One output of choice `index`.
    fn event(&mut self, index: usize, out: Out) -> String;
    /// Every choice finished: usage and the end marker.
    fn end(&mut self, usage: Usage) -> String;
    /// A choice failed: the error event and the end marker.
    fn error(&mut self, message: &str) -> String;
}

/// Streams the choices through `fmt`. `prompt_tokens`: the usage's prompt count (each prompt
/// once, however many choices it has).
pub(crate) fn sse_choices(
    choices: Vec<ChoiceStream>,
    mut fmt: impl SseFormat,
    prompt_tokens: usize,
) -> Response {
    let n = choices.len();
    let first = fmt.begin(n);
    let state = (
        choice::merged(choices),
        fmt,
        Usage {
            prompt_tokens,
            completion_tokens: 0,
        },
        0usize,
        Some(first),
    );
    let stream = futures::stream::unfold(
        state,
        move |(mut merged, mut fmt, mut usage, mut finished, mut pending)| async move {
            if let Some(p) = pending.take() {
                if !p.is_empty() {
                    return Some((Ok(Bytes::from(p)), (merged, fmt, usage, finished, None)));
                }
            }
            if finished == usize::MAX {
                return None;
            }
            loop {
                let Some((i, out)) = merged.next().await else {
                    // Every choice ended (or one ended without a result: the engine went away).
                    let tail = if finished == n {
                        fmt.end(usage)
                    } else {
                        fmt.error("generation ended without a result")
                    };
                    return Some((
                        Ok(Bytes::from(tail)),
                        (merged, fmt, usage, usize::MAX, None),
                    ));
                };
                let text = match out {
                    Out::Error(e) => {
                        let t = fmt.error(&e);
                        return Some((Ok(Bytes::from(t)), (merged, fmt, usage, usize::MAX, None)));
                    }
                    Out::Finish { usage: u, .. } => {
                        finished += 1;
                        usage.completion_tokens += u.completion_tokens;
                        fmt.event(i, out)
                    }
                    o => fmt.event(i, o),
                };
                if !text.is_empty() {
                    return Some((Ok(Bytes::from(text)), (merged, fmt, usage, finished, None)));
                }
            }
        },
    );
    sse_response(stream)
}

pub(crate) fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// Sum of the choices' completion tokens and the prompt tokens; the first error, if any.
fn collected_usage(c: &[Collected], prompt_tokens: usize) -> Result<Usage, ApiError> {
    let mut u = Usage {
        prompt_tokens,
        completion_tokens: 0,
    };
    for x in c {
        if let Some(e) = &x.error {
            return Err(ApiError::internal(e.clone()));
        }
        match &x.finish {
            Some((_, cu, _)) => u.completion_tokens += cu.completion_tokens,
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    }
    Ok(u)
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
    let constraint =
        prompt::constraint(&b, r.common.constraint.as_ref(), None, Reasoning::None).await?;
    let vocab = b.engine.vocab_size();
    let mut prompts: Vec<(Vec<u32>, String)> = Vec::with_capacity(r.prompts.len());
    for p in &r.prompts {
        prompts.push(match p {
            Prompt::Text(t) => (encode(&b, t.clone(), false).await?, t.clone()),
            Prompt::Tokens(ids) => {
                // Ids are checked against the vocabulary before decoding (and again by the engine).
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(submit_error(SubmitError::TokenOutOfRange {
                        id: bad,
                        vocab,
                    }));
                }
                (ids.clone(), b.codec.decode(ids, false))
            }
        });
    }
    let max_tokens = r.common.max_tokens.unwrap_or(DEFAULT_COMPLETION_TOKENS);
    let echo_lps = r.echo && r.logprobs.is_some();
    let meta = Meta::new(&b, "cmpl");
    let mut streams = Vec::new();
    let mut echoes = Vec::new();
    for (ids, text) in &prompts {
        let cr = ChoiceRequest {
            common: &r.common,
            prompt: ids,
            max_tokens,
            logprobs: LogprobsWanted {
                top: r.logprobs,
                prompt: echo_lps,
            },
            constraint: &constraint,
        };
        for j in 0..r.common.n {
            let opts = TextOptions {
                stop: r.common.stop.clone(),
                prompt_tokens: ids.len(),
                visible_specials: show_special(&b, &r.common),
                ..TextOptions::default()
            };
            streams.push(submit_choice(&b, &cr, j, opts, None, String::new())?);
            echoes.push(r.echo.then(|| (text.clone(), ids.clone())));
        }
    }
    let prompt_tokens = prompts.iter().map(|(ids, _)| ids.len()).sum();
    let fmt = CompletionFormat {
        b: b.clone(),
        meta,
        logprobs: r.logprobs.is_some(),
        include_usage: r.common.include_usage,
        choices: echoes
            .into_iter()
            .map(|echo| CompletionChoice { echo, offset: 0 })
            .collect(),
    };
    if r.common.stream {
        return Ok(sse_choices(streams, fmt, prompt_tokens));
    }
    let collected = choice::collect_all(streams).await;
    let usage = collected_usage(&collected, prompt_tokens)?;
    Ok(Json(fmt.collect(collected, usage)).into_response())
}

/// Every control token shown as text (vLLM's `skip_special_tokens: false`).
fn show_special(b: &Backend, c: &Common) -> Vec<u32> {
    if !c.show_special {
        return Vec::new();
    }
    (0..b.engine.vocab_size() as u32)
        .filter(|&id| b.codec.is_special(id))
        .collect()
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

/// Per choice: the prompt still to echo, and the characters sent so far (`text_offset`).
struct CompletionChoice {
    echo: Option<(String, Vec<u32>)>,
    offset: usize,
}

struct CompletionFormat {
    b: Arc<Backend>,
    meta: Meta,
    logprobs: bool,
    include_usage: bool,
    choices: Vec<CompletionChoice>,
}

impl CompletionFormat {
    /// The echoed prompt (with its logprobs when asked): the first token has no prediction.
    fn echo(
        &mut self,
        i: usize,
        prompt_lps: Option<&[TokenLogprobs]>,
    ) -> Option<(String, Option<CompletionLogprobs>)> {
        let c = &mut self.choices[i];
        let (text, ids) = c.echo.take()?;
        let lps = prompt_lps.map(|lps| {
            let mut out = CompletionLogprobs::default();
            let mut off = c.offset;
            for (k, &id) in ids.iter().enumerate() {
                let lp = k.checked_sub(1).and_then(|j| lps.get(j));
                out.push(&self.b, id, lp, off);
                off += token_text(&self.b, id).0.chars().count();
            }
            out
        });
        c.offset += text.chars().count();
        Some((text, lps))
    }

    fn text_lps(
        &mut self,
        i: usize,
        text: &str,
        tokens: &[TokenInfo],
    ) -> Option<CompletionLogprobs> {
        let c = &mut self.choices[i];
        let lps = self.logprobs.then(|| {
            let mut out = CompletionLogprobs::default();
            for TokenInfo { id, logprobs } in tokens {
                out.push(&self.b, *id, logprobs.as_ref(), c.offset);
            }
            out
        });
        c.offset += text.chars().count();
        lps
    }

    fn chunk(&self, index: usize, text: &str, lps: Option<Value>, finish: Option<&str>) -> Value {
        let mut v = json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [{
                "index": index,
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

    fn collect(mut self, collected: Vec<Collected>, usage: Usage) -> Value {
        let mut choices = Vec::with_capacity(collected.len());
        for (i, c) in collected.into_iter().enumerate() {
            let mut text = String::new();
            let mut all = self.logprobs.then(CompletionLogprobs::default);
            let pl = if self.logprobs {
                c.prompt_lps.as_deref().or(Some(&[]))
            } else {
                None
            };
            if let Some((t, lps)) = self.echo(i, pl) {
                text.push_str(&t);
                if let (Some(all), Some(l)) = (all.as_mut(), lps) {
                    all.extend(l);
                }
            }
            for (piece, tokens) in &c.pieces {
                let lps = self.text_lps(i, piece, tokens);
                if let (Some(all), Some(l)) = (all.as_mut(), lps) {
                    all.extend(l);
                }
            }
            text.push_str(&c.content);
            let finish = c.finish.as_ref().map(|f| f.0.openai(false));
            choices.push(json!({
                "index": i,
                "text": text,
                "logprobs": all.map(CompletionLogprobs::json),
                "finish_reason": finish,
            }));
        }
        json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
            "usage": usage_json(usage),
        })
    }
}

impl CompletionLogprobs {
    fn extend(&mut self, o: CompletionLogprobs) {
        self.tokens.extend(o.tokens);
        self.token_logprobs.extend(o.token_logprobs);
        self.top_logprobs.extend(o.top_logprobs);
        self.text_offset.extend(o.text_offset);
    }
}

impl SseFormat for CompletionFormat {
    fn begin(&mut self, n: usize) -> String {
        // Without logprobs the echo does not wait for the engine.
        if self.logprobs {
            return String::new();
        }
        let mut s = String::new();
        for i in 0..n {
            if let Some((t, _)) = self.echo(i, None) {
                s.push_str(&sse(&self.chunk(i, &t, None, None)));
            }
        }
        s
    }

    fn event(&mut self, i: usize, out: Out) -> String {
        match out {
            Out::Prompt(lps) => match self.echo(i, Some(&lps)) {
                Some((t, l)) => sse(&self.chunk(i, &t, l.map(CompletionLogprobs::json), None)),
                None => String::new(),
            },
            Out::Text { text, tokens, .. } => {
                // A prompt echoed with logprobs comes before the first token.
                let mut s = match self.echo(i, self.logprobs.then_some(&[][..])) {
                    Some((t, l)) => sse(&self.chunk(i, &t, l.map(CompletionLogprobs::json), None)),
                    None => String::new(),
                };
                let lps = self.text_lps(i, &text, &tokens);
                if !text.is_empty() || lps.is_some() {
                    s.push_str(&sse(&self.chunk(
                        i,
                        &text,
                        lps.map(CompletionLogprobs::json),
                        None,
                    )));
                }
                s
            }
            Out::Finish { reason, .. } => sse(&self.chunk(i, "", None, Some(reason.openai(false)))),
            Out::Call(_) | Out::Error(_) => String::new(),
        }
    }

    fn end(&mut self, usage: Usage) -> String {
        let mut s = String::new();
        if self.include_usage {
            let mut u = self.chunk(0, "", None, None);
            u["choices"] = json!([]);
            u["usage"] = usage_json(usage);
            s.push_str(&sse(&u));
        }
        s + "data: [DONE]\n\n"
    }

    fn error(&mut self, message: &str) -> String {
        sse(&ApiError::internal(message).body()) + "data: [DONE]\n\n"
    }
}

// ---------------------------------------------------------------------------------------------
// /v1/chat/completions

pub(crate) async fn chat_completions(State(s): State<Arc<AppState>>, req: Request) -> Response {
    chat_inner(s, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Queue every choice of a chat request. Shared with the Anthropic endpoint.
pub(crate) async fn start_chat(
    b: &Arc<Backend>,
    r: &ChatRequest,
    p: &ChatPrompt,
    call_prefix: &str,
) -> Result<Vec<ChoiceStream>, ApiError> {
    let constraint = prompt::chat_constraint(b, r, p).await?;
    let ctx = b.engine.context_length();
    // Without a limit a chat answer may use the rest of the context (OpenAI has no default).
    let max_tokens = r
        .common
        .max_tokens
        .unwrap_or_else(|| ctx.saturating_sub(p.ids.len()).max(1));
    let mut visible = p.visible.clone();
    visible.extend(show_special(b, &r.common));
    let mut streams = Vec::with_capacity(r.common.n);
    let cr = ChoiceRequest {
        common: &r.common,
        prompt: &p.ids,
        max_tokens,
        logprobs: LogprobsWanted {
            top: r.logprobs,
            prompt: false,
        },
        constraint: &constraint,
    };
    for j in 0..r.common.n {
        let opts = TextOptions {
            stop: r.common.stop.clone(),
            think: b.think,
            start_in_reasoning: p.starts_in_reasoning(),
            prompt_tokens: p.ids.len(),
            visible_specials: visible.clone(),
            reasoning_inline: r.reasoning_inline,
        };
        let tools = prompt::tool_parser(b, r);
        streams.push(submit_choice(
            b,
            &cr,
            j,
            opts,
            tools,
            format!("{call_prefix}_{j}"),
        )?);
    }
    Ok(streams)
}

async fn chat_inner(s: Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let b = s.backend()?;
    let body = read_json(&s, req).await?;
    let r = params::parse_chat(&body)?;
    let p = prompt::prepare(&b, &r).await?;
    let meta = Meta::new(&b, "chatcmpl");
    let call_prefix = format!("call_{}", meta.id.trim_start_matches("chatcmpl-"));
    let streams = start_chat(&b, &r, &p, &call_prefix).await?;
    let fmt = ChatFormat {
        b: b.clone(),
        meta,
        logprobs: r.logprobs.is_some(),
        include_usage: r.common.include_usage,
        legacy: r.legacy_functions,
        calls: vec![0; streams.len()],
    };
    if r.common.stream {
        return Ok(sse_choices(streams, fmt, p.ids.len()));
    }
    let collected = choice::collect_all(streams).await;
    let usage = collected_usage(&collected, p.ids.len())?;
    Ok(Json(fmt.collect(collected, usage)).into_response())
}

struct ChatFormat {
    b: Arc<Backend>,
    meta: Meta,
    logprobs: bool,
    include_usage: bool,
    /// Answer tool calls as the legacy `function_call`.
    legacy: bool,
    /// Calls sent so far per choice (the `index` of streamed tool call deltas).
    calls: Vec<usize>,
}

impl ChatFormat {
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

    fn chunk(
        &self,
        index: usize,
        delta: Value,
        lps: Option<Vec<Value>>,
        finish: Option<&str>,
    ) -> Value {
        let mut v = json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [{
                "index": index,
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

    fn call_json(c: &ToolCall, index: usize) -> Value {
        json!({"index": index, "id": c.id, "type": "function",
               "function": {"name": c.name, "arguments": c.arguments}})
    }

    fn collect(self, collected: Vec<Collected>, usage: Usage) -> Value {
        let choices: Vec<Value> = collected
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let mut message = json!({"role": "assistant", "content": c.content});
                if c.content.is_empty() && !c.calls.is_empty() {
                    message["content"] = Value::Null;
                }
                if !c.reasoning.is_empty() {
                    message["reasoning_content"] = json!(c.reasoning);
                }
                if self.legacy {
                    if let Some(call) = c.calls.first() {
                        message["function_call"] = json!({"name": call.name, "arguments": call.arguments});
                    }
                } else if !c.calls.is_empty() {
                    message["tool_calls"] = c
                        .calls
                        .iter()
                        .map(|call| json!({"id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}))
                        .collect();
                }
                let finish = c.finish.as_ref().map(|f| f.0.openai(self.legacy));
                json!({
                    "index": i,
                    "message": message,
                    "logprobs": self.logprobs.then(|| json!({"content": self.lp_entries(&c.tokens)})),
                    "finish_reason": finish,
                })
            })
            .collect();
        json!({
            "id": self.meta.id,
            "object": "chat.completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
            "usage": usage_json(usage),
        })
    }
}

impl SseFormat for ChatFormat {
    fn begin(&mut self, n: usize) -> String {
        (0..n)
            .map(|i| sse(&self.chunk(i, json!({"role": "assistant", "content": ""}), None, None)))
            .collect()
    }

    fn event(&mut self, i: usize, out: Out) -> String {
        match out {
            Out::Text {
                channel,
                text,
                tokens,
            } => {
                let lps = self.logprobs.then(|| self.lp_entries(&tokens));
                if text.is_empty() && lps.as_ref().is_none_or(|l| l.is_empty()) {
                    return String::new();
                }
                let delta = match channel {
                    Channel::Content => json!({ "content": text }),
                    Channel::Reasoning => json!({ "reasoning_content": text }),
                };
                sse(&self.chunk(i, delta, lps, None))
            }
            Out::Call(c) => {
                let k = self.calls[i];
                self.calls[i] += 1;
                let delta = if self.legacy {
                    json!({"function_call": {"name": c.name, "arguments": c.arguments}})
                } else {
                    json!({"tool_calls": [Self::call_json(&c, k)]})
                };
                sse(&self.chunk(i, delta, None, None))
            }
            Out::Finish { reason, .. } => {
                sse(&self.chunk(i, json!({}), None, Some(reason.openai(self.legacy))))
            }
            Out::Prompt(_) | Out::Error(_) => String::new(),
        }
    }

    fn end(&mut self, usage: Usage) -> String {
        let mut s = String::new();
        if self.include_usage {
            let mut u = self.chunk(0, json!({}), None, None);
            u["choices"] = json!([]);
            u["usage"] = usage_json(usage);
            s.push_str(&sse(&u));
        }
        s + "data: [DONE]\n\n"
    }

    fn error(&mut self, message: &str) -> String {
        sse(&ApiError::internal(message).body()) + "data: [DONE]\n\n"
    }
}
