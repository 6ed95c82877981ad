//! The engine: one scheduler thread owns the model and runs continuous batching.
//!
//! Requests wait in a bounded queue; between two forward passes the scheduler admits waiting
//! requests into the running batch, so every step shares one weight read among all running
//! sequences. Long prompts are prefilled in chunks so that they do not stall the decoding of
//! others for a whole prompt. Each request gets its tokens through a channel; dropping the
//! receiving [`Generation`] cancels the request at the next step.
//!
//! A step samples inside the model (`LanguageModel::forward_sample`: on a GPU only the ids come
//! back, the logits only with logprobs) unless a sequence in it needs its logits on the host:
//! prompt logprobs, or an adjustment the model's sampler cannot express (logit bias,
//! repeat / presence / frequency penalties, a grammar mask, `min_tokens`'s ban on stop tokens).
//! Then the whole step takes `forward` and samples on the host, by the same rules from the same
//! seeded stream, so a seed picks the same tokens either way.

pub mod metrics;

use crate::sampler::{
    self, ConstraintSource, RepeatWindow, Sampler, SamplingParams, TokenConstraint,
};
use crate::speculative::Drafter;
pub use metrics::Metrics;
use runtime::lm::{LanguageModel, SeqStep, SequenceState};
use runtime::sampling::{SampleParams, SampleRequest, Sampled};
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;
use tokio::sync::mpsc;

/// Most prompt tokens per step of a sequence that asked for prompt logprobs.
const LOGITS_CHUNK: usize = 64;

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Requests allowed to wait for a slot; one more is refused with [`SubmitError::QueueFull`].
    pub max_queue: usize,
    /// Sequences decoded together in one step.
    pub max_running: usize,
    /// Prompt tokens processed per step (summed over sequences); a longer prompt is prefilled in
    /// chunks over several steps.
    pub prefill_chunk: usize,
    /// Longest sequence (prompt + generated); at most the model's context length.
    pub context_length: usize,
    /// Speculative decoding with the model's NextN/MTP layer, this many drafts per round
    /// (`serve --draft mtp`); `None`: off. Requests whose logits are adjusted per token (logit
    /// bias, penalties, grammars, `min_tokens`) decode without drafts.
    pub draft: Option<usize>,
}

/// Makes the error of a request whose logits came out non-finite (NaN / infinity), given the
/// sequence's tokens (e.g. a re-run of the CPU reference naming the first bad layer:
/// `runtime::numerics`); see [`Engine::start_with_hook`]. Without one the error names only the
/// position. The request fails either way: nothing is ever sampled from such logits.
#[derive(Clone)]
pub struct NonFiniteHook(pub Arc<NonFiniteMessage>);

/// Sequence tokens -> the error message of [`NonFiniteHook`].
pub type NonFiniteMessage = dyn Fn(&[u32]) -> String + Send + Sync;

impl std::fmt::Debug for NonFiniteHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NonFiniteHook")
    }
}

impl EngineConfig {
    /// Defaults for a model: 128 waiting, 16 running, 512-token prefill chunks, full context.
    pub fn for_model(model: &dyn LanguageModel) -> Self {
        EngineConfig {
            max_queue: 128,
            max_running: 16,
            prefill_chunk: 512,
            context_length: model.context_length(),
            draft: None,
        }
    }
}

/// What to generate for one request.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (0 only scores the prompt).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end the generation (end-of-generation ids); not reported as output tokens.
    pub stop_tokens: Vec<u32>,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Report each prompt token's log-probability (after the first) and this many alternatives.
    pub prompt_logprobs: Option<usize>,
    /// Added to the logits before sampling (OpenAI `logit_bias`); `-inf` bans a token.
    pub logit_bias: Vec<(u32, f32)>,
    /// OpenAI presence / frequency penalties over the generated tokens.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// llama.cpp's `repeat_penalty` (1 disables) over the last `repeat_last_n` tokens of the
    /// sequence, prompt included.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    /// A grammar the generated tokens must follow (structured output, forced tool calls).
    pub constraint: Option<SharedConstraint>,
    /// `stop_tokens` are banned until this many tokens were generated (vLLM's `min_tokens`).
    pub min_tokens: usize,
}

/// A [`ConstraintSource`] shared by the choices of one request.
#[derive(Clone)]
pub struct SharedConstraint(pub Arc<dyn ConstraintSource>);

impl std::fmt::Debug for SharedConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedConstraint")
    }
}

impl GenerationRequest {
    /// A plain request: greedy unless `sampling` says otherwise, no logprobs, no penalties.
    pub fn new(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        GenerationRequest {
            prompt,
            max_tokens,
            sampling,
            stop_tokens: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            constraint: None,
            min_tokens: 0,
        }
    }
}

/// Log-probability of one token (natural log of the raw softmax) and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Generated tokens, the stop token included.
    pub completion_tokens: usize,
}

/// What the engine sends back for one request, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Logprobs of prompt tokens 1.. (token 0 has no prediction); only when asked for.
    PromptLogprobs(Vec<TokenLogprobs>),
    /// One generated token (stop tokens are not sent, they end the stream with `Finished`).
    Token {
        id: u32,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    /// The backend failed; the request is over.
    Failed(String),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is busy: {max} requests are already waiting; retry later")]
    QueueFull { max: usize },
    #[error("this model's maximum context length is {max} tokens, but {need} were requested ({prompt} in the prompt + {max_tokens} to generate)")]
    ContextExceeded {
        need: usize,
        max: usize,
        prompt: usize,
        max_tokens: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {id} is out of range (vocabulary size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("the engine has stopped")]
    Stopped,
}

/// The receiving end of one request. Dropping it cancels the request.
#[derive(Debug)]
pub struct Generation {
    rx: mpsc::UnboundedReceiver<Event>,
}

impl Generation {
    /// The next event; `None` after the last one.
    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// Blocking variant for synchronous callers (never call it inside an async task).
    pub fn blocking_recv(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }
}

struct Job {
    req: GenerationRequest,
    tx: mpsc::UnboundedSender<Event>,
    arrived: Instant,
}

struct Shared {
    queue: Mutex<VecDeque<Job>>,
    wake: Condvar,
    stop: AtomicBool,
}

/// Handle to the scheduler thread; cheap to clone. The thread ends when the last handle is dropped.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

struct EngineInner {
    shared: Arc<Shared>,
    config: EngineConfig,
    vocab: usize,
    metrics: Arc<Metrics>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        // Set under the queue lock: the scheduler checks `stop` holding it and releases it only
        // inside `wake.wait`, so it either sees the flag or is already waiting for this notify.
        // Set without the lock, the store and notify could fall between its check and its wait
        // and the join below would wait forever (seen once in CI, engine_batching).
        {
            let _q = lock(&self.shared.queue);
            self.shared.stop.store(true, Ordering::SeqCst);
        }
        self.shared.wake.notify_all();
        let handle = self
            .thread
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Engine {
    /// Start the scheduler thread over `model`.
    pub fn start(
        model: Arc<dyn LanguageModel>,
        config: EngineConfig,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Engine> {
        Self::start_with_hook(model, config, metrics, None)
    }

    /// [`start`](Self::start) with a [`NonFiniteHook`] for requests whose logits are NaN/inf.
    pub fn start_with_hook(
        model: Arc<dyn LanguageModel>,
        mut config: EngineConfig,
        metrics: Arc<Metrics>,
        on_non_finite: Option<NonFiniteHook>,
    ) -> std::io::Result<Engine> {
        config.context_length = config
            .context_length
            .clamp(1, model.context_length().max(1));
        config.max_running = config.max_running.max(1);
        config.prefill_chunk = config.prefill_chunk.max(1);
        // A model whose KV cache is one pool of device memory (tensor-parallel CUDA ranks):
        // no request may need more than the pool, and admission reserves from it (`admit`).
        let pool = model.cache_capacity_tokens();
        if let Some(cap) = pool {
            config.context_length = config.context_length.min(cap.max(1));
        }
        metrics.kv_cache_capacity_tokens.store(
            pool.unwrap_or(config.max_running * config.context_length) as u64,
            Ordering::Relaxed,
        );
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let vocab = model.vocab_size();
        let mut sched = Scheduler {
            model,
            shared: shared.clone(),
            config: config.clone(),
            on_non_finite,
            metrics: metrics.clone(),
            running: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || sched.run())?;
        Ok(Engine {
            inner: Arc::new(EngineInner {
                shared,
                config,
                vocab,
                metrics,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    pub fn context_length(&self) -> usize {
        self.inner.config.context_length
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.vocab
    }

    /// Check a request against the engine's limits without queueing it.
    pub fn check(&self, req: &GenerationRequest) -> Result<(), SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let vocab = self.inner.vocab;
        let bad = req
            .prompt
            .iter()
            .chain(&req.stop_tokens)
            .chain(req.logit_bias.iter().map(|(id, _)| id))
            .find(|&&id| id as usize >= vocab);
        if let Some(&id) = bad {
            return Err(SubmitError::TokenOutOfRange { id, vocab });
        }
        let max = self.inner.config.context_length;
        let need = req.prompt.len().saturating_add(req.max_tokens);
        if need > max {
            return Err(SubmitError::ContextExceeded {
                need,
                max,
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
            });
        }
        Ok(())
    }

    /// Queue a request. Fails at once when it cannot run or the queue is full.
    pub fn submit(&self, req: GenerationRequest) -> Result<Generation, SubmitError> {
        let m = &self.inner.metrics;
        if let Err(e) = self.check(&req) {
            m.record_rejected(match e {
                SubmitError::ContextExceeded { .. } => "context_exceeded",
                _ => "invalid",
            });
            return Err(e);
        }
        let shared = &self.inner.shared;
        if shared.stop.load(Ordering::SeqCst) {
            return Err(SubmitError::Stopped);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut q = lock(&shared.queue);
            // Requests whose client already left do not count against the limit.
            let before = q.len();
            q.retain(|j| !j.tx.is_closed());
            for _ in q.len()..before {
                m.record_finished("cancelled");
            }
            let max = self.inner.config.max_queue;
            if q.len() >= max {
                m.record_rejected("queue_full");
                return Err(SubmitError::QueueFull { max });
            }
            q.push_back(Job {
                req,
                tx,
                arrived: Instant::now(),
            });
            m.requests_waiting.store(q.len() as u64, Ordering::Relaxed);
        }
        shared.wake.notify_one();
        Ok(Generation { rx })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One running sequence.
struct Active {
    job: Job,
    state: Box<dyn SequenceState>,
    sampler: Sampler,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    /// The last sampled token, fed to the model in the next step.
    next: [u32; 1],
    generated: usize,
    prompt_lps: Vec<TokenLogprobs>,
    /// Generated-token counts for presence / frequency penalties.
    counts: HashMap<u32, u32>,
    repeat: Option<RepeatWindow>,
    constraint: Option<Box<dyn TokenConstraint>>,
    /// The raw logits of the last step, kept (in a reused buffer) only when logprobs are
    /// reported, since sampling adjusts the logits in place.
    raw: Vec<f32>,
    last_token: Option<Instant>,
    /// Speculative decoding state when this sequence drafts (its `state` is a drafting one).
    drafter: Option<Drafter>,
}

impl Active {
    fn prefill_left(&self) -> usize {
        self.job.req.prompt.len() - self.prefilled
    }

    /// Whether doing `w` samples a token (the last prompt chunk samples the first one).
    fn samples(&self, w: Work) -> bool {
        let req = &self.job.req;
        match w {
            Work::Decode => true,
            Work::Prefill { to, .. } => to == req.prompt.len() && req.max_tokens > 0,
            // A speculative round samples on its own, outside the batched step.
            Work::Speculate => false,
        }
    }

    /// Whether doing `w` needs this sequence's logits on the host (see the module doc).
    fn needs_logits(&self, w: Work) -> bool {
        let req = &self.job.req;
        if matches!(w, Work::Prefill { .. }) && req.prompt_logprobs.is_some() {
            return true;
        }
        self.samples(w)
            && (self.constraint.is_some()
                || self.repeat.is_some()
                || !req.logit_bias.is_empty()
                || req.presence_penalty != 0.0
                || req.frequency_penalty != 0.0
                || (self.generated < req.min_tokens && !req.stop_tokens.is_empty()))
    }
}

/// What a step returned for one sequence.
enum Out {
    /// `forward`'s logits (every prompt position with prompt logprobs, else the last).
    Logits(Vec<f32>),
    /// `forward_sample`'s token.
    Sampled(Sampled),
}

/// What one sequence does in the current step.
#[derive(Clone, Copy)]
enum Work {
    Prefill {
        from: usize,
        to: usize,
    },
    Decode,
    /// A drafting sequence's round (draft, verify, roll back), run on its own after the batch.
    Speculate,
}

struct Scheduler {
    model: Arc<dyn LanguageModel>,
    shared: Arc<Shared>,
    config: EngineConfig,
    on_non_finite: Option<NonFiniteHook>,
    metrics: Arc<Metrics>,
    running: Vec<Active>,
}

impl Scheduler {
    fn run(&mut self) {
        while let Some(()) = self.admit() {
            self.step();
        }
        // Engine dropped: tell whoever still listens.
        for a in self.running.drain(..) {
            let _ = a
                .job
                .tx
                .send(Event::Failed("the engine has stopped".into()));
        }
        for j in lock(&self.shared.queue).drain(..) {
            let _ = j.tx.send(Event::Failed("the engine has stopped".into()));
        }
    }

    /// Move waiting requests into the batch; block while there is nothing to do.
    /// `None` when the engine is shutting down.
    fn admit(&mut self) -> Option<()> {
        let mut q = lock(&self.shared.queue);
        loop {
            if self.shared.stop.load(Ordering::SeqCst) {
                return None;
            }
            while self.running.len() < self.config.max_running {
                let Some(job) = q.pop_front() else { break };
                if !self.fits_cache_pool(&job.req) {
                    // Waits until running sequences finish and return their share of the pool.
                    q.push_front(job);
                    break;
                }
                if job.tx.is_closed() {
                    self.metrics.record_finished("cancelled");
                    continue;
                }
                if job.req.max_tokens == 0 && job.req.prompt_logprobs.is_none() {
                    // Nothing to compute.
                    self.metrics
                        .queue_time
                        .observe(job.arrived.elapsed().as_secs_f64());
                    let usage = Usage {
                        prompt_tokens: job.req.prompt.len(),
                        completion_tokens: 0,
                    };
                    self.metrics.record_finished("length");
                    let _ = job.tx.send(Event::Finished {
                        reason: FinishReason::Length,
                        usage,
                    });
                    continue;
                }
                // The whole request's cache at once (what admission counted against the pool):
                // decoding then never reallocates or copies it.
                // Speculative decoding needs the model's own distribution unadjusted.
                let draftable = job.req.logit_bias.is_empty()
                    && job.req.presence_penalty == 0.0
                    && job.req.frequency_penalty == 0.0
                    && RepeatWindow::new(job.req.repeat_penalty, job.req.repeat_last_n).is_none()
                    && job.req.constraint.is_none()
                    && job.req.min_tokens == 0;
                let drafting = match self.config.draft {
                    Some(k) if draftable && self.model.draft_layers() > 0 => {
                        match (Drafter::new(k), self.model.new_draft_sequence()) {
                            (Ok(d), Ok(s)) => Some((d, s, k)),
                            _ => None,
                        }
                    }
                    _ => None,
                };
                // A verification step feeds up to `k` drafted tokens past the accepted ones.
                let (drafter, mut state, lookahead) = match drafting {
                    Some((d, s, k)) => (Some(d), s, k),
                    None => (None, self.model.new_sequence(), 0),
                };
                let need = job
                    .req
                    .prompt
                    .len()
                    .saturating_add(job.req.max_tokens)
                    .saturating_add(lookahead);
                if let Err(e) = state.reserve(need) {
                    drop(state);
                    if !self.running.is_empty() {
                        // Waits until running sequences finish and free their caches.
                        tracing::debug!("KV cache for {need} tokens not available yet: {e}");
                        q.push_front(job);
                        break;
                    }
                    self.metrics.record_finished("error");
                    let msg = format!("allocating the KV cache for {need} tokens: {e}");
                    tracing::error!("{msg}");
                    let _ = job.tx.send(Event::Failed(msg));
                    continue;
                }
                self.metrics
                    .queue_time
                    .observe(job.arrived.elapsed().as_secs_f64());
                let constraint = match job.req.constraint.as_ref().map(|c| c.0.start()) {
                    None => None,
                    Some(Ok(c)) => Some(c),
                    Some(Err(e)) => {
                        self.metrics.record_finished("error");
                        let _ = job.tx.send(Event::Failed(format!("grammar: {e}")));
                        continue;
                    }
                };
                let mut repeat = RepeatWindow::new(job.req.repeat_penalty, job.req.repeat_last_n);
                if let Some(w) = repeat.as_mut() {
                    let p = &job.req.prompt;
                    for &t in &p[p.len().saturating_sub(job.req.repeat_last_n)..] {
                        w.push(t);
                    }
                }
                self.running.push(Active {
                    drafter,
                    sampler: Sampler::new(job.req.sampling),
                    job,
                    state,
                    prefilled: 0,
                    next: [0],
                    generated: 0,
                    prompt_lps: Vec::new(),
                    counts: HashMap::new(),
                    repeat,
                    constraint,
                    raw: Vec::new(),
                    last_token: None,
                });
            }
            self.metrics
                .requests_waiting
                .store(q.len() as u64, Ordering::Relaxed);
            self.metrics
                .requests_running
                .store(self.running.len() as u64, Ordering::Relaxed);
            if !self.running.is_empty() {
                return Some(());
            }
            q = self.shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether the model's KV pool (if it has one) holds `req` on top of what the running
    /// sequences may still grow to (prompt + max_tokens each, reserved at admission).
    fn fits_cache_pool(&self, req: &GenerationRequest) -> bool {
        let Some(cap) = self.model.cache_capacity_tokens() else {
            return true;
        };
        let reserve = |r: &GenerationRequest| r.prompt.len().saturating_add(r.max_tokens);
        let held: usize = self.running.iter().map(|a| reserve(&a.job.req)).sum();
        self.running.is_empty() || held.saturating_add(reserve(req)) <= cap
    }

    fn step(&mut self) {
        // Cancelled requests leave before they cost a forward pass.
        let before = self.running.len();
        self.running.retain(|a| !a.job.tx.is_closed());
        for _ in self.running.len()..before {
            self.metrics.record_finished("cancelled");
        }
        if self.running.is_empty() {
            return;
        }

        // Decoding sequences always step; prompts share a token budget, oldest first, and the
        // first prompt always progresses so a prompt longer than the budget is not starved.
        let mut budget = self.config.prefill_chunk;
        let mut work: Vec<Option<Work>> = Vec::with_capacity(self.running.len());
        let mut any_prefill_started = false;
        for a in &self.running {
            let left = a.prefill_left();
            if left == 0 && a.drafter.is_some() {
                work.push(Some(Work::Speculate));
            } else if left == 0 {
                work.push(Some(Work::Decode));
            } else if budget > 0 || !any_prefill_started {
                // Prompt logprobs need a full logits row per token (vocab x 4 bytes: 600 KB for
                // GLM-5), so such prompts go through in small chunks.
                let cap = if a.job.req.prompt_logprobs.is_some() {
                    LOGITS_CHUNK
                } else {
                    usize::MAX
                };
                let n = left.min(budget.max(1)).min(cap);
                budget = budget.saturating_sub(n);
                any_prefill_started = true;
                work.push(Some(Work::Prefill {
                    from: a.prefilled,
                    to: a.prefilled + n,
                }));
            } else {
                work.push(None);
            }
        }

        let on_host = self
            .running
            .iter()
            .zip(&work)
            .any(|(a, w)| w.is_some_and(|w| a.needs_logits(w)));
        let mut steps: Vec<SeqStep<'_>> = Vec::with_capacity(self.running.len());
        let mut reqs: Vec<SampleRequest> = Vec::new();
        let mut constraints: Vec<&mut Box<dyn TokenConstraint>> = Vec::new();
        let mut n_tokens = 0;
        let mut prefill_only = true;
        for (a, w) in self.running.iter_mut().zip(&work) {
            let Some(w) = *w else { continue };
            if let Work::Speculate = w {
                continue;
            }
            let samples = a.samples(w);
            let Active {
                state,
                job,
                next,
                constraint,
                sampler,
                ..
            } = a;
            constraints.extend(constraint.as_mut());
            if !on_host {
                // A prompt chunk before the last samples nothing: a greedy pick that draws no
                // number from the stream (its id is dropped; its non-finite flag is not).
                reqs.push(if samples {
                    sampler.request(job.req.logprobs)
                } else {
                    SampleRequest {
                        params: SampleParams::GREEDY,
                        u: 0.0,
                        logprobs: None,
                    }
                });
            }
            let (tokens, all_logits): (&[u32], bool) = match w {
                Work::Prefill { from, to } => {
                    (&job.req.prompt[from..to], job.req.prompt_logprobs.is_some())
                }
                Work::Decode => {
                    prefill_only = false;
                    (&next[..], false)
                }
                Work::Speculate => continue,
            };
            n_tokens += tokens.len();
            steps.push(SeqStep {
                seq: state.as_mut(),
                tokens,
                all_logits,
            });
        }
        let expected: Vec<usize> = steps
            .iter()
            .map(|s| if s.all_logits { s.tokens.len() } else { 1 })
            .collect();

        let t0 = Instant::now();
        let model = &self.model;
        let batched = !steps.is_empty();
        let result = if batched {
            with_masks(constraints, || {
                if on_host {
                    model.forward(&mut steps).map(Rows::Logits)
                } else {
                    model.forward_sample(&mut steps, &reqs).map(Rows::Sampled)
                }
            })
        } else {
            Ok(Ok(Rows::Sampled(Vec::new())))
        };
        drop(steps);
        if batched {
            self.metrics
                .record_step(n_tokens, prefill_only, t0.elapsed().as_micros() as u64);
        }
        let vocab = self.model.vocab_size();
        let outputs: Vec<Out> = match result {
            Ok(Ok(Rows::Logits(out)))
                if out.len() == expected.len()
                    && out
                        .iter()
                        .zip(&expected)
                        .all(|(o, &e)| o.len() == e * vocab) =>
            {
                out.into_iter().map(Out::Logits).collect()
            }
            Ok(Ok(Rows::Sampled(out)))
                if out.len() == expected.len()
                    && out.iter().all(|s| s.non_finite || (s.id as usize) < vocab) =>
            {
                out.into_iter().map(Out::Sampled).collect()
            }
            Ok(Ok(Rows::Logits(_))) => {
                return self.fail_stepped(&work, "backend returned logits of the wrong shape")
            }
            Ok(Ok(Rows::Sampled(_))) => {
                return self.fail_stepped(&work, "backend returned a wrong number of samples")
            }
            Ok(Err(e)) => return self.fail_stepped(&work, &e.to_string()),
            Err(_) => return self.fail_stepped(&work, "backend panicked during a forward pass"),
        };

        let mut outputs = outputs.into_iter();
        let mut finished: Vec<usize> = Vec::new();
        for (i, (a, w)) in self.running.iter_mut().zip(&work).enumerate() {
            let Some(w) = *w else { continue };
            if let Work::Speculate = w {
                if speculate(a, self.model.as_ref(), &self.metrics) {
                    finished.push(i);
                }
                continue;
            }
            let Some(mut out) = outputs.next() else {
                break;
            };
            let non_finite = match &out {
                Out::Logits(l) => runtime::numerics::first_non_finite(l).is_some(),
                Out::Sampled(s) => s.non_finite,
            };
            if non_finite {
                let mut tokens = match w {
                    Work::Prefill { to, .. } => a.job.req.prompt[..to].to_vec(),
                    Work::Decode | Work::Speculate => a.job.req.prompt.clone(),
                };
                if let Work::Decode = w {
                    tokens.push(a.next[0]);
                }
                let msg = match &self.on_non_finite {
                    Some(h) => (h.0)(&tokens),
                    None => format!(
                        "the model produced non-finite logits (NaN or infinity) at token {}",
                        tokens.len().saturating_sub(1)
                    ),
                };
                tracing::error!("{msg}");
                self.metrics.record_finished("error");
                let _ = a.job.tx.send(Event::Failed(msg));
                finished.push(i);
                continue;
            }
            let done = match w {
                Work::Prefill { from, to } => {
                    self.metrics
                        .prompt_tokens
                        .fetch_add((to - from) as u64, Ordering::Relaxed);
                    a.prefilled = to;
                    if to == a.job.req.prompt.len() {
                        if let Some(d) = a.drafter.as_mut() {
                            d.prefilled(&a.job.req.prompt);
                        }
                    }
                    prefill_done(a, from, to, &mut out, vocab, &self.metrics)
                }
                Work::Decode => next_token(a, &mut out, vocab, &self.metrics),
                Work::Speculate => false,
            };
            if done {
                finished.push(i);
            }
        }
        for &i in finished.iter().rev() {
            self.running.swap_remove(i);
        }
        // swap_remove changes the order; keep arrival order so prefill budgets go oldest-first.
        self.running.sort_by_key(|a| a.job.arrived);

        let (mut tokens, mut bytes) = (0u64, 0u64);
        for a in &self.running {
            tokens += a.state.len() as u64;
            bytes += a.state.cache_bytes() as u64;
        }
        self.metrics.record_kv(tokens, bytes);
        self.metrics
            .requests_running
            .store(self.running.len() as u64, Ordering::Relaxed);
    }

    /// A failed forward pass ends every sequence that took part in it: their caches may be
    /// half-written.
    fn fail_stepped(&mut self, work: &[Option<Work>], msg: &str) {
        tracing::error!("forward pass failed: {msg}");
        // Metrics first: a client that gets the event may read them at once.
        for _ in work.iter().flatten() {
            self.metrics.record_finished("error");
        }
        let mut i = 0;
        self.running.retain(|a| {
            let stepped = work.get(i).copied().flatten().is_some();
            i += 1;
            if stepped {
                let _ = a.job.tx.send(Event::Failed(msg.to_string()));
            }
            !stepped
        });
    }
}

/// What the model returned for a whole step.
enum Rows {
    Logits(Vec<Vec<f32>>),
    Sampled(Vec<Sampled>),
}

/// The forward pass (panics caught), with the grammar masks of this step's samples computed on
/// another thread meanwhile: a mask depends only on the tokens sampled so far, so on a GPU its
/// cost hides behind the forward pass instead of adding to the step.
fn with_masks<T>(
    mut constraints: Vec<&mut Box<dyn TokenConstraint>>,
    forward: impl FnOnce() -> T,
) -> std::thread::Result<T> {
    let forward = || catch_unwind(AssertUnwindSafe(forward));
    if constraints.is_empty() {
        return forward();
    }
    std::thread::scope(|scope| {
        let masks = std::thread::Builder::new()
            .name("grammar-masks".into())
            .spawn_scoped(scope, move || {
                for c in constraints.iter_mut() {
                    c.prepare();
                }
            });
        let result = forward();
        // A panic in a grammar shows again (as an error) when its mask is asked for.
        if let Ok(h) = masks {
            let _ = h.join();
        }
        result
    })
}

/// Handle the output of a prompt chunk. Returns true when the request is finished.
fn prefill_done(
    a: &mut Active,
    from: usize,
    to: usize,
    out: &mut Out,
    vocab: usize,
    metrics: &Metrics,
) -> bool {
    let req = &a.job.req;
    if let (Some(k), Out::Logits(logits)) = (req.prompt_logprobs, &*out) {
        // Row j predicts prompt token from + j + 1.
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let Some(&target) = req.prompt.get(from + j + 1) else {
                break;
            };
            a.prompt_lps.push(TokenLogprobs {
                logprob: sampler::logprob(row, target),
                top: sampler::top_logprobs(row, k),
            });
        }
    }
    if to < req.prompt.len() {
        return false;
    }
    if req.prompt_logprobs.is_some() {
        let lps = std::mem::take(&mut a.prompt_lps);
        if a.job.tx.send(Event::PromptLogprobs(lps)).is_err() {
            metrics.record_finished("cancelled");
            return true;
        }
    }
    if req.max_tokens == 0 {
        finish(a, FinishReason::Length, metrics);
        return true;
    }
    next_token(a, out, vocab, metrics)
}

fn finish(a: &Active, reason: FinishReason, metrics: &Metrics) {
    let usage = Usage {
        prompt_tokens: a.job.req.prompt.len(),
        completion_tokens: a.generated,
    };
    metrics.record_finished(reason.as_str());
    metrics
        .request_latency
        .observe(a.job.arrived.elapsed().as_secs_f64());
    let _ = a.job.tx.send(Event::Finished { reason, usage });
}

/// The step's token for `a` (sampled by the model, or on the host from the last position's
/// logits), sent; returns whether the request ends.
fn next_token(a: &mut Active, out: &mut Out, vocab: usize, metrics: &Metrics) -> bool {
    let (id, lp) = match out {
        Out::Logits(logits) => {
            let Some(last) = logits.len().checked_sub(vocab) else {
                finish(a, FinishReason::Length, metrics);
                return true;
            };
            match sample_on_host(a, &mut logits[last..]) {
                Ok(s) => s,
                Err(e) => return fail(a, &e, metrics),
            }
        }
        Out::Sampled(s) => {
            let lp = a.job.req.logprobs.map(|_| TokenLogprobs {
                // `forward_sample` gives the log-probability of every id in the vocabulary.
                logprob: s.logprob.unwrap_or(f32::NEG_INFINITY),
                top: std::mem::take(&mut s.top),
            });
            (s.id, lp)
        }
    };
    emit(a, id, lp, metrics)
}

/// Sample a token from the last position's logits on the host. The logits are adjusted in place
/// (bias, penalties, grammar mask), in this order as llama.cpp's sampler chain does.
fn sample_on_host(
    a: &mut Active,
    logits: &mut [f32],
) -> Result<(u32, Option<TokenLogprobs>), String> {
    let req = &a.job.req;
    // Reported logprobs are those of the model's raw distribution (OpenAI semantics).
    if req.logprobs.is_some() {
        a.raw.clear();
        a.raw.extend_from_slice(logits);
    }
    for &(id, bias) in &req.logit_bias {
        if let Some(x) = logits.get_mut(id as usize) {
            *x += bias;
        }
    }
    if let Some(w) = &a.repeat {
        w.apply(logits);
    }
    if req.presence_penalty != 0.0 || req.frequency_penalty != 0.0 {
        for (&id, &c) in &a.counts {
            if let Some(x) = logits.get_mut(id as usize) {
                *x -= req.presence_penalty + req.frequency_penalty * c as f32;
            }
        }
    }
    if a.generated < req.min_tokens {
        for &id in &req.stop_tokens {
            if let Some(x) = logits.get_mut(id as usize) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    if let Some(c) = a.constraint.as_mut() {
        match c.allowed() {
            Ok(mask) => sampler::apply_mask(logits, mask),
            Err(e) => return Err(format!("grammar: {e}")),
        }
    }
    let id = a.sampler.sample(logits);
    let lp = req.logprobs.map(|k| TokenLogprobs {
        logprob: sampler::logprob(&a.raw, id),
        top: sampler::top_logprobs(&a.raw, k),
    });
    Ok((id, lp))
}

/// One speculative round of a drafting sequence (its last token was sent): the emitted tokens
/// go out one by one as if sampled singly (logprobs from the trunk logits each was chosen
/// from); stop tokens and `max_tokens` end it at once. Returns true when the request ended.
fn speculate(a: &mut Active, model: &dyn LanguageModel, metrics: &Metrics) -> bool {
    let Some(drafter) = a.drafter.as_mut() else {
        return fail(a, "speculative step without a drafter", metrics);
    };
    let t0 = Instant::now();
    let max_new = a.job.req.max_tokens.saturating_sub(a.generated);
    let before = drafter.stats.clone();
    let round = catch_unwind(AssertUnwindSafe(|| {
        drafter.round(
            model,
            a.state.as_mut(),
            &mut a.sampler,
            a.next[0],
            max_new,
            a.job.req.logprobs.is_some(),
        )
    }));
    let emitted = match round {
        Ok(Ok(e)) => e,
        Ok(Err(e)) => return fail(a, &format!("speculative decoding: {e}"), metrics),
        Err(_) => return fail(a, "backend panicked during a speculative round", metrics),
    };
    metrics.record_step(emitted.len(), false, t0.elapsed().as_micros() as u64);
    metrics.record_draft(&drafter.stats.since(&before));
    if emitted.iter().any(|e| e.non_finite) {
        return fail(
            a,
            "the model produced non-finite logits (NaN or infinity) in a verification step",
            metrics,
        );
    }
    for e in emitted {
        let lp = a.job.req.logprobs.map(|k| TokenLogprobs {
            logprob: sampler::logprob(&e.logits, e.id),
            top: sampler::top_logprobs(&e.logits, k),
        });
        if emit(a, e.id, lp, metrics) {
            return true;
        }
    }
    false
}

/// Send the sampled token `id` and decide whether the request ends.
fn emit(a: &mut Active, id: u32, lp: Option<TokenLogprobs>, metrics: &Metrics) -> bool {
    let req = &a.job.req;
    a.generated += 1;
    if req.presence_penalty != 0.0 || req.frequency_penalty != 0.0 {
        *a.counts.entry(id).or_default() += 1;
    }
    if let Some(w) = a.repeat.as_mut() {
        w.push(id);
    }
    let now = Instant::now();
    match a.last_token {
        None => metrics
            .time_to_first_token
            .observe((now - a.job.arrived).as_secs_f64()),
        Some(t) => metrics.inter_token_latency.observe((now - t).as_secs_f64()),
    }
    a.last_token = Some(now);
    metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
    if req.stop_tokens.contains(&id) {
        finish(a, FinishReason::Stop, metrics);
        return true;
    }
    if let Some(c) = a.constraint.as_mut() {
        if let Err(e) = c.commit(id) {
            return fail(a, &format!("grammar: {e}"), metrics);
        }
    }
    if a.job.tx.send(Event::Token { id, logprobs: lp }).is_err() {
        metrics.record_finished("cancelled");
        return true;
    }
    // A complete grammar allows nothing more: the answer is finished.
    if a.constraint.as_ref().is_some_and(|c| c.is_finished()) {
        finish(a, FinishReason::Stop, metrics);
        return true;
    }
    // `check` made prompt + max_tokens fit the context, so this also bounds the cache.
    if a.generated >= req.max_tokens {
        finish(a, FinishReason::Length, metrics);
        return true;
    }
    a.next = [id];
    false
}

/// The request failed on its own (not the backend's) account: tell the client, end it.
fn fail(a: &Active, msg: &str, metrics: &Metrics) -> bool {
    metrics.record_finished("error");
    let _ = a.job.tx.send(Event::Failed(msg.to_string()));
    true
}
