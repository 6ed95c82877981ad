//! `serve` over the real fixture model (tiny-glm5 Q4_K_M, CPU backend) against llama-server's
//! answers on the very same file (`refs/llamacpp-tiny-glm5.json`: `/completion`, temperature 0,
//! 16 tokens). Every step of those references has a top-1/top-2 log-prob gap above 0.2, far
//! more than the logit differences from llama.cpp's 8-bit activation quantization, so the
//! greedy texts must be equal (see forward_llamacpp.rs for the step-level comparison).

#[path = "../../serving/tests/server_support/http.rs"]
mod http;

use gguftool_tests::fixture;
use serde_json::{json, Value};
use serving::engine::Metrics;
use serving::server::{self, AppState, RunningServer, ServerConfig};
use std::sync::Arc;

const MODEL: &str = "gguf/tiny-glm5-Q4_K_M.gguf";
const REFS: &str = "refs/llamacpp-tiny-glm5.json";

fn start() -> Option<(RunningServer, Value)> {
    let path = fixture(MODEL);
    let refs = fixture(REFS);
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(refs).unwrap()).unwrap();
    let entry = refs["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["file"] == "tiny-glm5-Q4_K_M.gguf")
        .unwrap()
        .clone();
    let metrics = Arc::new(Metrics::default());
    let state = AppState::new(ServerConfig::default(), metrics.clone());
    let model = Arc::new(gguf::Model::open(&path).unwrap());
    let backend = server::cpu_backend(model, "tiny-glm5", metrics, |_| {}).unwrap();
    state.set_ready(backend);
    let srv = RunningServer::start("127.0.0.1:0".parse().unwrap(), state).unwrap();
    Some((srv, entry))
}

fn complete(srv: &RunningServer, body: Value) -> Value {
    let r = http::post(srv.addr(), "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn greedy_completions_equal_llama_server() {
    let Some((srv, refs)) = start() else {
        return;
    };
    for p in refs["prompts"].as_array().unwrap() {
        let v = complete(
            &srv,
            json!({"model": "x", "prompt": p["text"], "max_tokens": 16, "temperature": 0,
                   "logprobs": 1}),
        );
        let c = &v["choices"][0];
        assert_eq!(c["text"], p["greedy_text"], "prompt {}", p["id"]);
        assert_eq!(c["finish_reason"], "length");
        let prompt_len = p["prompt_ids_sent"].as_array().unwrap().len();
        assert_eq!(v["usage"]["prompt_tokens"], json!(prompt_len));
        assert_eq!(v["usage"]["completion_tokens"], 16);
        // Log-probs: within 0.05 of llama.cpp's. Its K-quant dot products quantize the
        // activations to 8 bits (relative error up to 1/254 per element), which moves logits
        // of this model by a few hundredths; we dequantize the weights to f32.
        let ours = c["logprobs"]["token_logprobs"].as_array().unwrap();
        for (k, step) in p["per_step"].as_array().unwrap().iter().enumerate() {
            let Some(want) = step["logprob"].as_f64() else {
                continue;
            };
            let got = ours[k].as_f64().unwrap();
            assert!(
                (got - want).abs() < 0.05,
                "prompt {} step {k}: logprob {got} vs llama.cpp {want}",
                p["id"]
            );
        }
    }
}

#[test]
fn concurrent_requests_give_the_solo_answers() {
    let Some((srv, refs)) = start() else {
        return;
    };
    let addr = srv.addr();
    // Three copies of each reference prompt at once: they share forward passes in the engine
    // and must still give exactly llama-server's single-request answers.
    let handles: Vec<_> = (0..3)
        .flat_map(|_| refs["prompts"].as_array().unwrap().clone())
        .map(|p| {
            std::thread::spawn(move || {
                let r = http::post(
                    addr,
                    "/v1/completions",
                    &json!({"prompt": p["text"], "max_tokens": 16, "temperature": 0}),
                );
                (
                    r.status,
                    r.json()["choices"][0]["text"].clone(),
                    p["greedy_text"].clone(),
                )
            })
        })
        .collect();
    for h in handles {
        let (status, got, want) = h.join().unwrap();
        assert_eq!(status, 200);
        assert_eq!(got, want);
    }
}

#[test]
fn streaming_equals_the_reference_and_tokenize_equals_llama_tokenize() {
    let Some((srv, refs)) = start() else {
        return;
    };
    for p in refs["prompts"].as_array().unwrap() {
        let r = http::post(
            srv.addr(),
            "/v1/completions",
            &json!({"prompt": p["text"], "max_tokens": 16, "temperature": 0, "stream": true}),
        );
        assert_eq!(r.status, 200);
        let data = r.sse_data();
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
        let text: String = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str::<Value>(d).unwrap())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(json!(text), p["greedy_text"]);

        let t = http::post(srv.addr(), "/tokenize", &json!({"content": p["text"]}));
        assert_eq!(t.json()["tokens"], p["llama_tokenize_ids"]);
    }
}

#[test]
fn readme_example_counts_on() {
    let Some((srv, _)) = start() else {
        return;
    };
    // The fixture model was trained on counting sequences (fixtures README).
    let v = complete(
        &srv,
        json!({"prompt": "1 2 3 4 5", "max_tokens": 8, "temperature": 0}),
    );
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(text.starts_with(" 6 7 8"), "{text:?}");
}

#[test]
fn chat_answers_through_the_template() {
    let Some((srv, _)) = start() else {
        return;
    };
    let body = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let r = http::post(srv.addr(), "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let m = &v["choices"][0]["message"];
    // The fixture's template closes <think> in the prompt, so the answer is content.
    assert!(m["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
    assert!(m.get("reasoning_content").is_none());
    let lps = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!lps.is_empty());
    for e in lps {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(e["token"], top[0]["token"]);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
    // The chat's end-of-turn token (`<|user|>` for GLM) ends it with "stop" or the limit is hit.
    let fr = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(fr == "stop" || fr == "length");
}
