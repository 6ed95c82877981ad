//! Greedy continuations of the CPU forward pass on the quantized fixture GGUFs against llama.cpp
//! on the very same files (`refs/llamacpp-tiny-glm5.json`, llama-server /completion, temperature
//! 0). llama.cpp multiplies quantized weights by quantized activations (Q8_K / Q8_0 dot
//! products) while we dequantize weights to f32, and it uses eps 1e-5 for the q_a/kv_a norms
//! where transformers (and we) use 1e-6, so a greedy choice may legitimately differ where its
//! top-2 gap is small: we compare steps up to the first one whose llama.cpp top-1/top-2 log-prob
//! gap is at most 0.01 (or unknown).

mod forward_util;

use forward_util::{greedy, ids, json, load};
use gguftool_tests::fixture;
use serde_json::Value;

const GAP: f64 = 0.01;

fn check(file: &str, gguf_rel: &str) {
    let refs = fixture("refs/llamacpp-tiny-glm5.json");
    let path = fixture(gguf_rel);
    let r = json(&refs);
    let entry = r["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["file"] == file)
        .unwrap_or_else(|| panic!("{file} not in the llama.cpp reference"));
    let model = load(&path);
    let mut failures = Vec::new();
    for p in entry["prompts"].as_array().unwrap() {
        let id = p["id"].as_str().unwrap();
        let prompt = ids(&p["prompt_ids_sent"]);
        let want = ids(&p["greedy_ids"]);
        let steps = p["per_step"].as_array().unwrap();
        let (got, _) = greedy(&model, &prompt, want.len());
        let mut compared = 0;
        for (k, step) in steps.iter().enumerate().take(want.len()) {
            if got[k] != want[k] {
                failures.push(format!(
                    "{file} {id}: step {k}: {:?} vs llama.cpp {:?}",
                    &got[..=k],
                    &want[..=k]
                ));
                break;
            }
            compared += 1;
            if gap(step).is_none_or(|g| g <= GAP) {
                break;
            }
        }
        println!(
            "{file} {id}: {compared} of {} steps equal llama.cpp",
            want.len()
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// llama.cpp's top-1 minus top-2 log-prob at one step (`None` when not recorded).
fn gap(step: &Value) -> Option<f64> {
    let t = step["top_logprobs"].as_array()?;
    Some(t.first()?["logprob"].as_f64()? - t.get(1)?["logprob"].as_f64()?)
}

#[test]
fn q8_0_greedy_matches_llamacpp() {
    check("tiny-glm5-Q8_0.gguf", "gguf/tiny-glm5-Q8_0.gguf");
}

#[test]
fn q6_k_greedy_matches_llamacpp() {
    check("tiny-glm5-Q6_K.gguf", "gguf/tiny-glm5-Q6_K.gguf");
}

#[test]
fn q4_k_m_greedy_matches_llamacpp() {
    check("tiny-glm5-Q4_K_M.gguf", "gguf/tiny-glm5-Q4_K_M.gguf");
}

#[test]
fn q4_k_m_split_greedy_matches_llamacpp() {
    check(
        "tiny-glm5-Q4_K_M-00001-of-00003.gguf",
        "gguf/split/tiny-glm5-Q4_K_M-00001-of-00003.gguf",
    );
}

#[test]
fn bf16_greedy_matches_llamacpp() {
    check("tiny-glm5-BF16.gguf", "gguf/tiny-glm5-BF16.gguf");
}
