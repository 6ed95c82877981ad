//! The serving engine samples inside the model (`LanguageModel::forward_sample`) for plain
//! requests and keeps `forward` + host sampling where a request needs the logits on the host
//! (logit bias, penalties, grammar, `min_tokens`, prompt logprobs). Both paths pick, for a
//! seed, the tokens a plain `forward` + `Sampler::sample` loop picks on the CPU fixture: what
//! the engine sampled before it used `forward_sample`.

use gguftool_tests::fixture;
use runtime::sampling::{SampleRequest, Sampled};
use runtime::{LanguageModel, RuntimeError, SeqStep, SequenceState};
use serving::engine::{
    Engine, EngineConfig, Event, GenerationRequest, Metrics, SharedConstraint, TokenLogprobs,
};
use serving::sampler::{ConstraintSource, Sampler, SamplingParams, TokenConstraint};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The CPU fixture model, counting which entry point each step took.
struct Counting {
    inner: Box<dyn LanguageModel>,
    forwards: AtomicUsize,
    sampled: AtomicUsize,
}

impl LanguageModel for Counting {
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
        self.forwards.fetch_add(1, Ordering::SeqCst);
        self.inner.forward(batch)
    }
    fn forward_sample(
        &self,
        batch: &mut [SeqStep<'_>],
        reqs: &[SampleRequest],
    ) -> Result<Vec<Sampled>, RuntimeError> {
        self.sampled.fetch_add(1, Ordering::SeqCst);
        self.inner.forward_sample(batch, reqs)
    }
}

fn model() -> Arc<Counting> {
    let m = Arc::new(gguf::Model::open(fixture("gguf/tiny-glm5-Q8_0.gguf")).unwrap());
    Arc::new(Counting {
        inner: Box::new(runtime::glm::load_cpu(m).unwrap()),
        forwards: AtomicUsize::new(0),
        sampled: AtomicUsize::new(0),
    })
}

const PROMPT: [u32; 5] = [3, 44, 91, 7, 300];
const N: usize = 10;

/// (tokens, their logprobs) of one request, run alone; and (forward, forward_sample) calls.
fn run(lm: &Arc<Counting>, req: GenerationRequest) -> (Vec<u32>, Vec<TokenLogprobs>, [usize; 2]) {
    let before = [
        lm.forwards.load(Ordering::SeqCst),
        lm.sampled.load(Ordering::SeqCst),
    ];
    let dynlm: Arc<dyn LanguageModel> = lm.clone();
    let mut cfg = EngineConfig::for_model(dynlm.as_ref());
    // A prompt in two chunks: the first samples nothing and must draw no random number.
    cfg.prefill_chunk = 3;
    let engine = Engine::start(dynlm, cfg, Arc::new(Metrics::default())).unwrap();
    let mut g = engine.submit(req).unwrap();
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    while let Some(ev) = g.blocking_recv() {
        match ev {
            Event::Token { id, logprobs } => {
                ids.push(id);
                lps.extend(logprobs);
            }
            Event::Failed(e) => panic!("{e}"),
            Event::Finished { .. } => break,
            Event::PromptLogprobs(_) => {}
        }
    }
    drop(g);
    drop(engine);
    let calls = [
        lm.forwards.load(Ordering::SeqCst) - before[0],
        lm.sampled.load(Ordering::SeqCst) - before[1],
    ];
    (ids, lps, calls)
}

/// The engine's sampling before `forward_sample`: `forward`, then `Sampler::sample` on the host.
fn reference(lm: &dyn LanguageModel, sp: SamplingParams) -> Vec<u32> {
    let mut s = Sampler::new(sp);
    let mut seq = lm.new_sequence();
    let mut toks = PROMPT.to_vec();
    (0..N)
        .map(|_| {
            let logits = lm
                .forward(&mut [SeqStep {
                    seq: seq.as_mut(),
                    tokens: &toks,
                    all_logits: false,
                }])
                .unwrap()
                .remove(0);
            let id = s.sample(&logits);
            toks = vec![id];
            id
        })
        .collect()
}

/// Allows every token, forever: forces the host path without changing any logit.
struct Open(usize);

impl ConstraintSource for Open {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(OpenMask(vec![u32::MAX; self.0.div_ceil(32)])))
    }
}

struct OpenMask(Vec<u32>);

impl TokenConstraint for OpenMask {
    fn allowed(&mut self) -> Result<&[u32], String> {
        Ok(&self.0)
    }
    fn commit(&mut self, _id: u32) -> Result<(), String> {
        Ok(())
    }
    fn is_finished(&self) -> bool {
        false
    }
}

#[test]
fn device_and_host_paths_sample_the_same_tokens_for_a_seed() {
    let lm = model();
    let vocab = lm.vocab_size();
    let settings = [
        (0.0, 0, 1.0, 0.0), // greedy
        (1.0, 0, 0.9, 0.0), // temperature + top-p
        (0.8, 40, 0.95, 0.05),
        (1.3, 0, 1.0, 0.0),
    ];
    for (temperature, top_k, top_p, min_p) in settings {
        for seed in [1u64, 77, 4242] {
            let sp = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: Some(seed),
            };
            let want = reference(lm.inner.as_ref(), sp);
            let plain = || {
                let mut r = GenerationRequest::new(PROMPT.to_vec(), N, sp);
                r.logprobs = Some(3);
                r
            };
            let (fast, fast_lps, calls) = run(&lm, plain());
            assert_eq!(fast, want, "forward_sample path, {sp:?}");
            // Two prompt chunks and N - 1 decode steps, all inside the model.
            assert_eq!(calls, [0, N + 1], "{sp:?}");

            // Each feature that needs the logits on the host, set so it changes no logit, with
            // the (forward, forward_sample) calls it makes: the N steps that sample on the host
            // (the first prompt chunk samples nothing and stays in the model), but prompt
            // logprobs both prompt chunks only.
            let host = [N, 1];
            let mut host_variants: Vec<(&str, GenerationRequest, [usize; 2])> = vec![
                (
                    "logit_bias",
                    {
                        let mut r = plain();
                        r.logit_bias = vec![(5, 0.0)];
                        r
                    },
                    host,
                ),
                (
                    "frequency_penalty",
                    {
                        // Below half an ulp of every logit larger than 1e-22 in magnitude.
                        let mut r = plain();
                        r.frequency_penalty = 1e-30;
                        r
                    },
                    host,
                ),
                (
                    "grammar",
                    {
                        let mut r = plain();
                        r.constraint = Some(SharedConstraint(Arc::new(Open(vocab))));
                        r
                    },
                    host,
                ),
                (
                    "prompt_logprobs",
                    {
                        let mut r = plain();
                        r.prompt_logprobs = Some(1);
                        r
                    },
                    [2, N - 1],
                ),
            ];
            let last = u32::try_from(vocab - 1).unwrap();
            if temperature == 0.0 && !want.contains(&last) {
                // Banning a token greedy decoding never picks changes nothing.
                let mut r = plain();
                r.stop_tokens = vec![last];
                r.min_tokens = N;
                host_variants.push(("min_tokens", r, host));
            }
            for (what, req, want_calls) in host_variants {
                let (got, host_lps, calls) = run(&lm, req);
                assert_eq!(got, want, "host path ({what}), {sp:?}");
                assert_eq!(calls, want_calls, "{what}, {sp:?}");
                assert_eq!(host_lps.len(), N);
                for (a, b) in fast_lps.iter().zip(&host_lps) {
                    // Both are `logit - lse` in f64 of the same f32 logits, rounded to f32; 1e-5
                    // leaves room for a backend summing the exponentials in another order (a
                    // few f32 ulps of log-probabilities below ~20 in magnitude).
                    assert!((a.logprob - b.logprob).abs() <= 1e-5, "{what}: {a:?} {b:?}");
                    assert_eq!(a.top.len(), 3);
                    let ids = |t: &TokenLogprobs| t.top.iter().map(|x| x.0).collect::<Vec<_>>();
                    assert_eq!(ids(a), ids(b), "{what}");
                }
            }
            if temperature >= 1.0 {
                // The draws matter: the tokens are not one repeated argmax.
                assert!(fast.iter().any(|&t| t != fast[0]), "{sp:?}: {fast:?}");
            }
        }
    }
}
