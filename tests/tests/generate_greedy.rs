//! What `gguftool generate -p TEXT --temp 0 --ignore-eos` does, through the library: the GGUF's
//! tokenizer (special tokens in the text parsed), the CPU model with its KV cache and the greedy
//! sampler reproduce transformers' token ids and greedy continuations for all six reference
//! prompts (three short, three longer than index_topk, one of them chat-formatted).

mod forward_util;

use gguftool_tests::fixture;
use runtime::{LanguageModel, SeqStep};
use serving::sampler::{Sampler, SamplingParams};
use serving::tokenizer::Tokenizer;
use std::sync::Arc;

#[test]
fn text_prompts_generate_the_transformers_greedy_ids() {
    let path = fixture("gguf/tiny-glm5-BF16.gguf");
    let model = Arc::new(gguf::Model::open(&path).unwrap());
    let tok = Tokenizer::from_gguf(model.metadata()).unwrap();
    let lm = runtime::glm::load_cpu(Arc::clone(&model)).unwrap();
    let mut n = 0;
    for rel in ["refs/hf-tiny-glm5.json", "refs/hf-tiny-glm5-long.json"] {
        let refs = fixture(rel);
        for p in forward_util::json(&refs)["prompts"].as_array().unwrap() {
            let id = p["id"].as_str().unwrap();
            let prompt = tok.encode(p["text"].as_str().unwrap(), true).unwrap();
            assert_eq!(
                prompt,
                forward_util::ids(&p["token_ids"]),
                "{id}: prompt ids"
            );
            let want = forward_util::ids(&p["greedy_16"]["ids"]);
            let mut sampler = Sampler::new(SamplingParams::greedy());
            let mut seq = lm.new_sequence();
            let mut tokens = prompt.clone();
            let mut got = Vec::new();
            for _ in 0..want.len() {
                let mut b = [SeqStep {
                    seq: seq.as_mut(),
                    tokens: &tokens,
                    all_logits: false,
                }];
                let logits = lm.forward(&mut b).unwrap().remove(0);
                let t = sampler.sample(&logits);
                got.push(t);
                tokens = vec![t];
            }
            // The reference's top-1/top-2 gaps are all well above f32 noise on these prompts
            // (forward_hf checks the tie rule); the ids must be identical.
            assert_eq!(got, want, "{id}");
            let text = tok.decode(&got, false).unwrap();
            assert_eq!(text, p["greedy_16"]["text"].as_str().unwrap(), "{id}: text");
            n += 1;
        }
    }
    println!("{n} prompts checked");
}
