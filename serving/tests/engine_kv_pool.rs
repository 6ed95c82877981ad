//! A model whose KV cache is one pool of device memory (`LanguageModel::cache_capacity_tokens`,
//! tensor-parallel CUDA ranks): the engine admits a request only while the running ones'
//! `prompt + max_tokens` and its own fit the pool, and caps the context at the pool.

mod server_support;

use runtime::{LanguageModel, RuntimeError, SeqStep, SequenceState};
use server_support::{MockModel, EOS, USER};
use serving::engine::{Engine, EngineConfig, Event, GenerationRequest, Metrics, SubmitError};
use serving::sampler::SamplingParams;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The mock model with a cache pool of `cap` tokens.
struct Pooled {
    inner: Arc<MockModel>,
    cap: usize,
}

impl LanguageModel for Pooled {
    fn new_sequence(&self) -> Box<dyn SequenceState> {
        self.inner.new_sequence()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn context_length(&self) -> usize {
        self.inner.context_length()
    }
    fn forward(&self, batch: &mut [SeqStep<'_>]) -> Result<Vec<Vec<f32>>, RuntimeError> {
        self.inner.forward(batch)
    }
    fn cache_capacity_tokens(&self) -> Option<usize> {
        Some(self.cap)
    }
}

fn req(prompt: &str, max_tokens: usize) -> GenerationRequest {
    let mut r = GenerationRequest::new(
        prompt.bytes().map(u32::from).collect(),
        max_tokens,
        SamplingParams::greedy(),
    );
    r.stop_tokens = vec![EOS, USER];
    r
}

#[test]
fn admission_reserves_prompt_plus_max_tokens_from_the_pool() {
    let inner = MockModel::new(512);
    let m: Arc<dyn LanguageModel> = Arc::new(Pooled {
        inner: Arc::clone(&inner),
        cap: 25,
    });
    let mut cfg = EngineConfig::for_model(m.as_ref());
    cfg.max_running = 8;
    let metrics = Arc::new(Metrics::default());
    let e = Engine::start(m, cfg, metrics.clone()).unwrap();
    assert_eq!(e.context_length(), 25, "the context is capped at the pool");
    assert_eq!(metrics.kv_cache_capacity_tokens.load(Ordering::Relaxed), 25);
    // 30 tokens can never fit: refused up front like any context overflow.
    assert!(matches!(
        e.check(&req("abcdefghij", 20)),
        Err(SubmitError::ContextExceeded { .. })
    ));
    // Each needs 4 + 8 = 12: two fit the pool of 25 at a time, the third waits for a slot.
    inner.gate.set(false);
    let gens: Vec<_> = ["abcd", "bcde", "cdef"]
        .iter()
        .map(|p| e.submit(req(p, 8)).unwrap())
        .collect();
    inner.gate.set(true);
    for mut g in gens {
        let mut n = 0;
        while let Some(ev) = g.blocking_recv() {
            match ev {
                Event::Token { .. } => n += 1,
                Event::Finished { .. } => break,
                Event::Failed(f) => panic!("{f}"),
                _ => {}
            }
        }
        assert_eq!(n, 8);
    }
    assert_eq!(inner.max_batch.load(Ordering::SeqCst), 2);
}
