//! Test support shared by the engine and server tests: a mock model whose next token follows
//! fixed rules (so expected outputs come from the rules, not from the code under test), a mock
//! tokenizer / chat template, a server started on 127.0.0.1:0, and a minimal HTTP/1.1 client.
#![allow(dead_code)]

pub mod http;

use runtime::{LanguageModel, RuntimeError, SeqStep, SequenceState};
use serving::engine::{Engine, EngineConfig, Metrics};
use serving::server::{AppState, Backend, Message, RunningServer, ServerConfig, TextCodec};
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

pub const EOS: u32 = 256;
pub const THINK: u32 = 257;
pub const END_THINK: u32 = 258;
pub const USER: u32 = 259;
pub const VOCAB: usize = 260;
const SPECIALS: [(&str, u32); 4] = [
    ("<eos>", EOS),
    ("<think>", THINK),
    ("</think>", END_THINK),
    ("<|user|>", USER),
];

/// The logit of the predicted token; every other token has logit 0.
pub const PEAK: f32 = 10.0;

/// Natural-log probability of the predicted token: PEAK - ln(e^PEAK + VOCAB - 1).
pub fn peak_logprob() -> f64 {
    PEAK as f64 - ((PEAK as f64).exp() + (VOCAB - 1) as f64).ln()
}

/// Natural-log probability of any other token: -ln(e^PEAK + VOCAB - 1).
pub fn other_logprob() -> f64 {
    -((PEAK as f64).exp() + (VOCAB - 1) as f64).ln()
}

/// The mock's rule: token ids are bytes (0..256) plus four specials. After a letter comes the
/// next letter ('t' is followed by `</think>`, `</think>` by 'u', 'z' by `<eos>`); after a digit
/// a space, after a space the previous digit plus one; after `]` or `<eos>` an 'a'; after
/// `<think>` a 'q'; after anything else `<eos>`.
pub fn next_token(history: &[u32]) -> u32 {
    let last = *history.last().unwrap_or(&EOS);
    match last {
        t if t == b't' as u32 => END_THINK,
        END_THINK => b'u' as u32,
        t if t == b'z' as u32 => EOS,
        t if (b'a' as u32..b'z' as u32).contains(&t) => t + 1,
        t if (b'0' as u32..=b'9' as u32).contains(&t) => b' ' as u32,
        t if t == b' ' as u32 => {
            let prev = history.len().checked_sub(2).map(|i| history[i]);
            match prev {
                Some(d) if (b'0' as u32..b'9' as u32).contains(&d) => d + 1,
                _ => EOS,
            }
        }
        t if t == b']' as u32 || t == EOS => b'a' as u32,
        THINK => b'q' as u32,
        _ => EOS,
    }
}

struct MockSeq {
    tokens: Vec<u32>,
}

impl SequenceState for MockSeq {
    fn len(&self) -> usize {
        self.tokens.len()
    }
    fn cache_bytes(&self) -> usize {
        self.tokens.len() * 4
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// A gate the test can close to hold the model inside `forward`, or open for a number of steps.
#[derive(Default)]
pub struct Gate {
    /// `None`: open; `Some(n)`: n more forward passes may start.
    permits: Mutex<Option<usize>>,
    cv: Condvar,
}

impl Gate {
    pub fn set(&self, open: bool) {
        *self.permits.lock().unwrap() = if open { None } else { Some(0) };
        self.cv.notify_all();
    }
    /// Let exactly `n` more forward passes run, then hold.
    pub fn allow(&self, n: usize) {
        *self.permits.lock().unwrap() = Some(n);
        self.cv.notify_all();
    }
    fn wait(&self) {
        let mut g = self.permits.lock().unwrap();
        loop {
            match *g {
                None => return,
                Some(n) if n > 0 => {
                    *g = Some(n - 1);
                    return;
                }
                Some(_) => g = self.cv.wait(g).unwrap(),
            }
        }
    }
}

pub struct MockModel {
    pub ctx: usize,
    pub gate: Gate,
    pub forwards: AtomicUsize,
    pub max_batch: AtomicUsize,
    /// Sequences created and not yet dropped (cache leaks show here).
    pub live: Arc<AtomicUsize>,
}

impl MockModel {
    pub fn new(ctx: usize) -> Arc<Self> {
        let m = MockModel {
            ctx,
            gate: Gate::default(),
            forwards: AtomicUsize::new(0),
            max_batch: AtomicUsize::new(0),
            live: Arc::new(AtomicUsize::new(0)),
        };
        m.gate.set(true);
        Arc::new(m)
    }
}

struct Counted {
    inner: MockSeq,
    live: Arc<AtomicUsize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl SequenceState for Counted {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn cache_bytes(&self) -> usize {
        self.inner.cache_bytes()
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl LanguageModel for MockModel {
    fn new_sequence(&self) -> Box<dyn SequenceState> {
        self.live.fetch_add(1, Ordering::SeqCst);
        Box::new(Counted {
            inner: MockSeq { tokens: Vec::new() },
            live: self.live.clone(),
        })
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn context_length(&self) -> usize {
        self.ctx
    }
    fn forward(&self, batch: &mut [SeqStep<'_>]) -> Result<Vec<Vec<f32>>, RuntimeError> {
        self.gate.wait();
        self.forwards.fetch_add(1, Ordering::SeqCst);
        self.max_batch.fetch_max(batch.len(), Ordering::SeqCst);
        let mut out = Vec::new();
        for step in batch.iter_mut() {
            // The byte 0x01 makes the backend fail, 0x02 makes it panic.
            if step.tokens.contains(&1) {
                return Err(RuntimeError::Backend("mock failure".into()));
            }
            if step.tokens.contains(&2) {
                panic!("mock panic");
            }
            let seq = step
                .seq
                .as_any_mut()
                .downcast_mut::<Counted>()
                .expect("a MockModel sequence");
            let mut logits = Vec::new();
            for (i, &t) in step.tokens.iter().enumerate() {
                seq.inner.tokens.push(t);
                if step.all_logits || i + 1 == step.tokens.len() {
                    let mut row = vec![0.0f32; VOCAB];
                    row[next_token(&seq.inner.tokens) as usize] = PEAK;
                    logits.extend(row);
                }
            }
            if seq.inner.tokens.len() > self.ctx {
                return Err(RuntimeError::ContextExceeded {
                    need: seq.inner.tokens.len(),
                    max: self.ctx,
                });
            }
            out.push(logits);
        }
        Ok(out)
    }
}

/// Byte tokenizer with four special tokens; chat template `[role]content...[assistant]`, with a
/// `<think>` appended when a system message says exactly "think".
pub struct MockCodec;

impl TextCodec for MockCodec {
    fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, String> {
        let mut out = Vec::new();
        let mut rest = text;
        'outer: while !rest.is_empty() {
            if parse_special {
                for (s, id) in SPECIALS {
                    if let Some(r) = rest.strip_prefix(s) {
                        out.push(id);
                        rest = r;
                        continue 'outer;
                    }
                }
            }
            let c = rest.chars().next().unwrap();
            out.extend(c.to_string().bytes().map(u32::from));
            rest = &rest[c.len_utf8()..];
        }
        Ok(out)
    }
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if id < 256 {
            return Some(vec![id as u8]);
        }
        SPECIALS
            .iter()
            .find(|s| s.1 == id)
            .map(|s| s.0.as_bytes().to_vec())
    }
    fn is_special(&self, id: u32) -> bool {
        id >= 256
    }
    fn eog_ids(&self) -> Vec<u32> {
        vec![EOS, USER]
    }
    fn token_id(&self, piece: &str) -> Option<u32> {
        SPECIALS.iter().find(|s| s.0 == piece).map(|s| s.1)
    }
    fn render_chat(
        &self,
        messages: &[Message],
        add_gen: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, String> {
        let mut s = String::new();
        for m in messages {
            if m.role == "tool" {
                return Err("this template has no tool role".into());
            }
            s += &format!("[{}]{}", m.role, m.content);
        }
        if add_gen {
            s += "[assistant]";
            let think = messages
                .iter()
                .any(|m| m.role == "system" && m.content == "think");
            if think && kwargs.get("enable_thinking") != Some(&serde_json::Value::Bool(false)) {
                s += "<think>";
            }
        }
        Ok(s)
    }
    fn template_variables(&self) -> Option<std::collections::BTreeSet<String>> {
        Some(["enable_thinking".to_string()].into())
    }
}

/// The mock's byte tokenizer with a real Jinja chat template (GLM-style tool rendering).
pub struct TemplateCodec(pub serving::chat::ChatTemplate);

impl TextCodec for TemplateCodec {
    fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, String> {
        MockCodec.encode(text, parse_special)
    }
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        MockCodec.token_bytes(id)
    }
    fn is_special(&self, id: u32) -> bool {
        MockCodec.is_special(id)
    }
    fn eog_ids(&self) -> Vec<u32> {
        MockCodec.eog_ids()
    }
    fn token_id(&self, piece: &str) -> Option<u32> {
        MockCodec.token_id(piece)
    }
    fn render_chat(
        &self,
        messages: &[Message],
        add_gen: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, String> {
        let msgs: Vec<serde_json::Value> = messages.iter().map(Message::to_template_json).collect();
        self.0
            .render_json(&serde_json::Value::Array(msgs), add_gen, kwargs)
            .map_err(|e| e.to_string())
    }
    fn chat_template(&self) -> Option<&str> {
        Some(self.0.source())
    }
    fn template_variables(&self) -> Option<std::collections::BTreeSet<String>> {
        Some(self.0.variables())
    }
}

pub struct TestServer {
    pub addr: std::net::SocketAddr,
    pub state: Arc<AppState>,
    pub model: Arc<MockModel>,
    pub metrics: Arc<Metrics>,
    _server: RunningServer,
}

pub struct Options {
    pub ctx: usize,
    pub engine: Option<EngineConfig>,
    pub server: ServerConfig,
    /// Start without a model (health 503) and load it only when the test says so.
    pub ready: bool,
    /// Tokenizer and template; the byte-level [`MockCodec`] when `None`.
    pub codec: Option<Arc<dyn TextCodec>>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ctx: 512,
            engine: None,
            server: ServerConfig::default(),
            ready: true,
            codec: None,
        }
    }
}

/// Serve the mock model on 127.0.0.1 with an OS-chosen port.
pub fn start(opts: Options) -> TestServer {
    let model = MockModel::new(opts.ctx);
    let metrics = Arc::new(Metrics::default());
    let state = AppState::new(opts.server, metrics.clone());
    if opts.ready {
        let codec = opts.codec.unwrap_or_else(|| Arc::new(MockCodec));
        make_ready_with(&state, &model, &metrics, opts.engine, codec);
    }
    let server = RunningServer::start("127.0.0.1:0".parse().unwrap(), state.clone()).unwrap();
    TestServer {
        addr: server.addr(),
        state,
        model,
        metrics,
        _server: server,
    }
}

pub fn make_ready(
    state: &AppState,
    model: &Arc<MockModel>,
    metrics: &Arc<Metrics>,
    cfg: Option<EngineConfig>,
) {
    make_ready_with(state, model, metrics, cfg, Arc::new(MockCodec));
}

pub fn make_ready_with(
    state: &AppState,
    model: &Arc<MockModel>,
    metrics: &Arc<Metrics>,
    cfg: Option<EngineConfig>,
    codec: Arc<dyn TextCodec>,
) {
    let m: Arc<dyn LanguageModel> = model.clone();
    let cfg = cfg.unwrap_or_else(|| EngineConfig::for_model(m.as_ref()));
    let engine = Engine::start(m, cfg, metrics.clone()).unwrap();
    state.set_ready(Backend::new(engine, codec, "mock"));
}

/// Poll `cond` every millisecond for at most 10 s (a bound on a hang, not a timing assertion).
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
