//! `LanguageModel::forward_sample` (what `generate` now calls per step) picks, on the CPU, the
//! same tokens as `serving::sampler::Sampler` on `forward`'s logits with the same seed: the
//! rules of `runtime::sampling` are the serving sampler's (temperature, top-k, min-p, top-p,
//! inverse CDF in sorted order) and the uniform numbers come from the same stream. Also: greedy
//! requests go through `forward_top_k`'s candidates and agree with the argmax.

use gguftool_tests::fixture;
use runtime::sampling::{SampleParams, SampleRequest};
use runtime::{LanguageModel, SeqStep};
use serving::sampler::{Sampler, SamplingParams};
use std::sync::Arc;

fn step(lm: &dyn LanguageModel, seq: &mut dyn runtime::SequenceState, toks: &[u32]) -> Vec<f32> {
    lm.forward(&mut [SeqStep {
        seq,
        tokens: toks,
        all_logits: false,
    }])
    .unwrap()
    .remove(0)
}

#[test]
fn forward_sample_draws_like_the_serving_sampler() {
    let model = Arc::new(gguf::Model::open(fixture("gguf/tiny-glm5-Q8_0.gguf")).unwrap());
    let lm = runtime::glm::load_cpu(model).unwrap();
    let prompt = [3u32, 44, 91, 7, 300];
    let settings = [
        (0.8, 40, 0.95, 0.05), // generate's defaults
        (1.0, 0, 1.0, 0.0),
        (1.3, 0, 0.9, 0.0),
        (0.7, 5, 1.0, 0.2),
        (0.0, 0, 1.0, 0.0), // greedy
    ];
    for (t, k, p, m) in settings {
        let sp = SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            min_p: m,
            seed: Some(1234),
        };
        let params = SampleParams {
            temperature: t,
            top_k: k,
            top_p: p,
            min_p: m,
        };
        let (mut host, mut dev) = (Sampler::new(sp), Sampler::new(sp));
        let (mut sa, mut sb) = (lm.new_sequence(), lm.new_sequence());
        let (mut ta, mut tb) = (prompt.to_vec(), prompt.to_vec());
        let (mut want, mut got) = (Vec::new(), Vec::new());
        for _ in 0..12 {
            let logits = step(&lm, sa.as_mut(), &ta);
            let id = host.sample(&logits);
            want.push(id);
            ta = vec![id];
            let req = SampleRequest {
                params,
                u: if params.is_greedy() {
                    0.0
                } else {
                    dev.next_uniform()
                },
                logprobs: Some(2),
            };
            let s = lm
                .forward_sample(
                    &mut [SeqStep {
                        seq: sb.as_mut(),
                        tokens: &tb,
                        all_logits: false,
                    }],
                    &[req],
                )
                .unwrap()
                .remove(0);
            assert!(!s.non_finite);
            let lp = serving::sampler::logprob(&logits, s.id);
            assert!(
                (s.logprob.unwrap() - lp).abs() <= 1e-5,
                "{:?} vs {lp}",
                s.logprob
            );
            assert_eq!(s.top, serving::sampler::top_logprobs(&logits, 2));
            got.push(s.id);
            tb = vec![s.id];
        }
        assert_eq!(got, want, "settings {sp:?}");
        // The sequences did not all collapse onto one token (the test would not see the draws).
        if !params.is_greedy() && t >= 1.0 {
            assert!(got.iter().any(|&x| x != got[0]), "{sp:?}: {got:?}");
        }
    }
}
