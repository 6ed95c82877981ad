//! OpenAI-compatible HTTP server (axum): `/v1/completions`, `/v1/chat/completions` (streaming
//! with SSE, tool calls, structured output), `/v1/models[/{id}]`, Anthropic's `/v1/messages`,
//! llama-server's `/tokenize`, `/detokenize` (also in vLLM's body shapes), `/props` and
//! `/apply-template`, `/health`, Prometheus `/metrics`, and a chat page at `/`.
//!
//! The server only translates between HTTP and the [`Engine`]: it validates requests at the edge
//! ([`params`]), renders chat templates and tokenizes (through [`TextCodec`]), and turns the
//! engine's token events back into text ([`text`]). Every error is an OpenAI-shaped JSON object
//! ([`ApiError`]), including axum's own rejections (bad JSON, unknown route, wrong method).

mod anthropic;
pub mod choice;
mod cors;
pub mod error;
mod extra;
pub mod gguf_text;
mod listener;
mod openai;
mod page;
pub mod params;
mod prompt;
pub mod text;
pub mod tools;

use crate::engine::{Engine, EngineConfig, Metrics};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
pub use error::ApiError;
pub use gguf_text::GgufText;
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};
pub use text::{Message, TextCodec};

/// Settings of the HTTP layer. The worst-case memory of requests not yet admitted to the engine
/// is about `max_connections x max_body_bytes` of buffered bodies plus, per prompt being
/// rendered and tokenized, the chat template's output cap and ~10x the prompt's bytes (docs:
/// ARCHITECTURE.md, "Serving limits").
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Required as `Authorization: Bearer <key>` on every route but `/health` when set; an
    /// empty key is refused by [`ServerConfig::validate`].
    pub api_key: Option<String>,
    /// Largest request body accepted (bytes); larger ones get 413.
    pub max_body_bytes: usize,
    /// Origins browsers may call the API from (`*` for any); empty: no CORS headers.
    pub cors_origins: Vec<String>,
    /// Time a client has to send a request head, counted from the connection's start or the
    /// end of its previous response (so it also closes idle keep-alive connections).
    pub header_timeout: std::time::Duration,
    /// Time a client has to send a request body once its head is in (408 after it).
    pub body_timeout: std::time::Duration,
    /// Open connections at most (also capped by the descriptor limit); see `listener`.
    pub max_connections: usize,
    /// Largest request head (request line + headers); larger ones get 431.
    pub max_header_bytes: usize,
    /// On shutdown, how long responses in progress may take to finish.
    pub shutdown_grace: std::time::Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            max_body_bytes: 8 << 20,
            cors_origins: Vec::new(),
            header_timeout: std::time::Duration::from_secs(30),
            body_timeout: std::time::Duration::from_secs(60),
            max_connections: 512,
            max_header_bytes: 64 << 10,
            shutdown_grace: std::time::Duration::from_secs(5),
        }
    }
}

impl ServerConfig {
    /// Settings that cannot work: an empty API key (nobody could authenticate, yet the server
    /// would look protected), zero timeouts or a zero connection limit.
    pub fn validate(&self) -> Result<(), String> {
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return Err("the API key is empty: give a non-empty key or none".into());
        }
        if self.header_timeout.is_zero() || self.body_timeout.is_zero() {
            return Err("timeouts must be positive".into());
        }
        if self.max_connections == 0 {
            return Err("the connection limit must be at least 1".into());
        }
        Ok(())
    }
}

/// A loaded model ready to serve: the engine and the model's text side.
pub struct Backend {
    pub engine: Engine,
    pub codec: Arc<dyn TextCodec>,
    /// Reported by `/v1/models` and in every response's `model` field.
    pub model_name: String,
    /// Ids of `<think>` / `</think>` when the vocabulary has both (GLM reasoning split).
    think: Option<(u32, u32)>,
    eog: Vec<u32>,
    /// Chat-side facts learned once: tool format, template variables, grammar vocabulary.
    chat: extra::ChatSupport,
}

impl Backend {
    pub fn new(engine: Engine, codec: Arc<dyn TextCodec>, model_name: impl Into<String>) -> Self {
        let think = codec.token_id("<think>").zip(codec.token_id("</think>"));
        let eog = codec.eog_ids();
        let model_name = model_name.into();
        engine.metrics().set_model_name(&model_name);
        let chat = extra::ChatSupport::new(codec.as_ref());
        Backend {
            engine,
            codec,
            model_name,
            think,
            eog,
            chat,
        }
    }

    /// The GGUF the model came from, for `/props` and the model page.
    pub fn with_model(mut self, model: Arc<gguf::Model>) -> Self {
        self.chat.model = Some(model);
        self
    }
}

/// Load a GGUF model on the CPU backend with its tokenizer and chat template, and start the
/// engine over it. `configure` adjusts the engine limits (queue, slots, context).
pub fn cpu_backend(
    model: Arc<gguf::Model>,
    name: &str,
    metrics: Arc<Metrics>,
    configure: impl FnOnce(&mut EngineConfig),
) -> Result<Backend, crate::ServingError> {
    let lm: Arc<dyn runtime::LanguageModel> = Arc::new(runtime::glm::load_cpu(Arc::clone(&model))?);
    model_backend(&model, lm, name, metrics, configure)
}

/// A backend serving `lm` (any device), with the tokenizer and chat template of `model`. A
/// request whose logits come out non-finite fails with the first bad layer as located by the CPU
/// reference ([`runtime::numerics`]).
pub fn model_backend(
    model: &Arc<gguf::Model>,
    lm: Arc<dyn runtime::LanguageModel>,
    name: &str,
    metrics: Arc<Metrics>,
    configure: impl FnOnce(&mut EngineConfig),
) -> Result<Backend, crate::ServingError> {
    model_backend_with(model, lm, name, metrics, None, configure)
}

/// [`model_backend`] with `chat_template` (Jinja source) replacing the GGUF's own template.
pub fn model_backend_with(
    model: &Arc<gguf::Model>,
    lm: Arc<dyn runtime::LanguageModel>,
    name: &str,
    metrics: Arc<Metrics>,
    chat_template: Option<&str>,
    configure: impl FnOnce(&mut EngineConfig),
) -> Result<Backend, crate::ServingError> {
    let codec = GgufText::with_template(model.metadata(), chat_template)?;
    if let Some(e) = codec.template_error() {
        tracing::warn!("chat completions disabled: {e}");
    }
    let mut cfg = EngineConfig::for_model(lm.as_ref());
    configure(&mut cfg);
    let diag_model = Arc::clone(model);
    let hook = crate::engine::NonFiniteHook(Arc::new(move |tokens: &[u32]| {
        let d = runtime::numerics::locate_non_finite(Arc::clone(&diag_model), tokens)
            .unwrap_or(runtime::numerics::Diagnosis::TooLarge);
        runtime::numerics::non_finite_message(
            "the serving device",
            tokens.len().saturating_sub(1),
            &d,
        )
    }));
    let engine = Engine::start_with_hook(lm, cfg, metrics, Some(hook))
        .map_err(crate::ServingError::Thread)?;
    Ok(Backend::new(engine, Arc::new(codec), name).with_model(Arc::clone(model)))
}

/// Shared state of all handlers. The model may still be loading (`/health` answers 503 then).
pub struct AppState {
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    backend: OnceLock<Arc<Backend>>,
    created: u64,
}

impl AppState {
    /// State without a model yet; call [`AppState::set_ready`] once it is loaded. `metrics`
    /// should be the one given to the engine so that `/metrics` shows both layers.
    pub fn new(config: ServerConfig, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(AppState {
            config,
            metrics,
            backend: OnceLock::new(),
            created: unix_time(),
        })
    }

    /// The model is loaded; the API routes start answering.
    pub fn set_ready(&self, backend: Backend) {
        let _ = self.backend.set(Arc::new(backend));
    }

    pub fn is_ready(&self) -> bool {
        self.backend.get().is_some()
    }

    fn backend(&self) -> Result<Arc<Backend>, ApiError> {
        self.backend.get().cloned().ok_or_else(ApiError::loading)
    }
}

pub(crate) fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// All routes with authentication, JSON errors and request metrics.
pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(extra::model))
        .route("/props", get(extra::props))
        .route("/apply-template", post(extra::apply_template))
        .route("/verify", post(extra::verify))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .merge(page::routes())
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        // Outermost: a browser's preflight carries no credentials and must not reach the key check.
        .layer(middleware::from_fn_with_state(state.clone(), cors::cors))
        .with_state(state)
}

/// Bind-independent serving loop: run the router on `listener` until `shutdown` resolves, with
/// the timeouts and the connection limit of `state.config` (see [`listener`]). An invalid
/// configuration ([`ServerConfig::validate`]) is an `InvalidInput` error.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    state
        .config
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    listener::run(listener, state, shutdown).await
}

/// A server on its own thread with its own async runtime, for tests and for embedding in
/// synchronous programs. Dropping it stops the server and closes open connections.
pub struct RunningServer {
    addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RunningServer {
    /// Bind `addr` (port 0 picks a free port) and serve `state` until dropped.
    pub fn start(addr: std::net::SocketAddr, state: Arc<AppState>) -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let listener = rt.block_on(tokio::net::TcpListener::bind(addr))?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("http".into())
            .spawn(move || {
                rt.block_on(async move {
                    let _ = serve(listener, state, async {
                        let _ = rx.await;
                    })
                    .await;
                });
                // Connections still open (streams) are cut here.
                rt.shutdown_timeout(std::time::Duration::from_secs(1));
            })?;
        Ok(RunningServer {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    match s.backend() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no route {} {}", req.method(), req.uri().path()))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn require_api_key(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.config.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            // Anthropic clients send the key as `x-api-key`.
            .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Comparison whose time does not depend on where the strings differ (key guessing by timing).
/// Only the key's length can leak, not its bytes.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn count_requests(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    // Only known routes become labels, so random paths cannot blow up the series count.
    const ROUTES: [&str; 14] = [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/props",
        "/apply-template",
        "/verify",
        "/",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/metrics",
        "/health",
        "/v1/health",
    ];
    let path = req.uri().path();
    let route = ROUTES
        .iter()
        .find(|&&r| r == path)
        .copied()
        .unwrap_or("other");
    let resp = next.run(req).await;
    s.metrics.record_http(route, resp.status().as_u16());
    resp
}

/// Read and parse a JSON body within the size limit; every failure is a JSON 4xx.
pub(crate) async fn read_json(state: &AppState, req: Request) -> Result<Value, ApiError> {
    let limit = state.config.max_body_bytes;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body larger than {limit} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    // A body that trickles in is cut off: a slow client must not hold a task forever.
    let bytes = tokio::time::timeout(
        state.config.body_timeout,
        axum::body::to_bytes(req.into_body(), limit),
    )
    .await
    .map_err(|_| {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body did not arrive within {} s",
                state.config.body_timeout.as_secs()
            ),
        )
    })?
    .map_err(|_| too_large())?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}")))
}

async fn models(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let b = s.backend()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": b.model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "gguftool",
            "meta": {
                "n_ctx": b.engine.context_length(),
                "n_vocab": b.engine.vocab_size(),
            },
        }],
    })))
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

/// llama-server's `/tokenize`: `{"content", "parse_special"?, "with_pieces"?}` -> `{"tokens"}`;
/// also vLLM's `{"prompt"}` or `{"messages", ...}` (rendered with the chat template), answered
/// with vLLM's `count`, `max_model_len` and (with `return_token_strs`) `token_strs` as well.
async fn tokenize(State(s): State<Arc<AppState>>, req: Request) -> Result<Json<Value>, ApiError> {
    let b = s.backend()?;
    let body = read_json(&s, req).await?;
    let f = params::Fields::of(&body)?;
    let input = extra::tokenize_input(&f)?;
    // Models served here add no BOS of their own (GLM); the flag is accepted for compatibility.
    f.boolean("add_special")?;
    f.boolean("add_special_tokens")?;
    let return_strs = f.boolean("return_token_strs")?.unwrap_or(false);
    let parse_special = f.boolean("parse_special")?.unwrap_or(true);
    let with_pieces = f.boolean("with_pieces")?.unwrap_or(false);
    let ids = extra::tokenize_ids(&b, input, parse_special).await?;
    let tokens: Vec<Value> = if with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = b.codec.token_bytes(id).unwrap_or_default();
                let piece = match String::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(e) => json!(e.into_bytes()),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(Json(extra::tokenize_answer(&b, tokens, &ids, return_strs)))
}

/// llama-server's `/detokenize`: `{"tokens": [ids]}` -> `{"content"}`.
async fn detokenize(State(s): State<Arc<AppState>>, req: Request) -> Result<Json<Value>, ApiError> {
    let b = s.backend()?;
    let body = read_json(&s, req).await?;
    let f = params::Fields::of(&body)?;
    let vocab = b.engine.vocab_size();
    let ids = match f.get("tokens") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .filter(|&t| t < vocab as u64)
                    .map(|t| t as u32)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "tokens",
                            format!("{t} is not a token id (vocabulary size {vocab})"),
                        )
                    })
            })
            .collect::<Result<Vec<u32>, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "tokens",
                "'tokens' must be an array of token ids",
            ))
        }
    };
    let text = b.codec.decode(&ids, false);
    // llama-server's `content`, vLLM's `prompt`.
    Ok(Json(json!({ "content": text, "prompt": text })))
}

/// An SSE response over a stream of already formatted `data:` events.
pub(crate) fn sse_response(
    stream: impl futures::Stream<Item = Result<axum::body::Bytes, std::convert::Infallible>>
        + Send
        + 'static,
) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| ApiError::internal("could not build the response").into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_works() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
