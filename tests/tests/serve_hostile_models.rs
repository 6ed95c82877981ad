//! `serve` over broken fixture models (issue 14 items 5, 7 and 8): a hostile chat template fails
//! only the chat requests (health and completions keep working), NaN weights fail the request
//! with the first bad layer named instead of streaming garbage, and a prompt far beyond the
//! context is refused.

#[path = "../../serving/tests/server_support/http.rs"]
mod http;

use gguftool_tests::{fixture, hostile_template_model, nan_weights_model};
use serde_json::json;
use serving::engine::Metrics;
use serving::server::{self, AppState, RunningServer, ServerConfig};
use std::path::Path;
use std::sync::Arc;

fn serve(path: &Path) -> RunningServer {
    let metrics = Arc::new(Metrics::default());
    let state = AppState::new(ServerConfig::default(), metrics.clone());
    let model = Arc::new(gguf::Model::open(path).unwrap());
    state.set_ready(server::cpu_backend(model, "m", metrics, |_| {}).unwrap());
    RunningServer::start("127.0.0.1:0".parse().unwrap(), state).unwrap()
}

#[test]
fn a_hostile_template_fails_chat_requests_only() {
    let d = tempfile::tempdir().unwrap();
    let m = hostile_template_model(d.path());
    let srv = serve(&m);
    let r = http::post(
        srv.addr(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("exceeds"), "{msg}");
    assert_eq!(http::get(srv.addr(), "/health").status, 200);
    let r = http::post(
        srv.addr(),
        "/v1/completions",
        &json!({"prompt": "1 2 3", "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn nan_weights_fail_the_request_with_the_first_bad_layer() {
    let d = tempfile::tempdir().unwrap();
    let m = nan_weights_model(d.path());
    let srv = serve(&m);
    let r = http::post(
        srv.addr(),
        "/v1/completions",
        &json!({"prompt": "1 2 3", "max_tokens": 4, "temperature": 0}),
    );
    assert!(r.status >= 500, "{} {}", r.status, r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("non-finite logits"), "{msg}");
    assert!(msg.contains("layer 1 (blk.1.attn_q_b.out)"), "{msg}");
    // Streaming: an error event, never a token.
    let mut s = http::EventStream::open(
        srv.addr(),
        "/v1/completions",
        &json!({"prompt": "1 2 3", "max_tokens": 4, "stream": true}),
    );
    let first = s.next_data().unwrap();
    assert!(first.contains("non-finite"), "{first}");
}

#[test]
fn a_prompt_far_beyond_the_context_is_refused() {
    let srv = serve(&fixture("gguf/tiny-glm5-Q4_K_M.gguf"));
    // 6 MB: more tokens than the 2048-token context by three orders of magnitude.
    let prompt = "7 ".repeat(3 << 20);
    let r = http::post(
        srv.addr(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["param"], "prompt");
    assert!(v["error"]["message"].as_str().unwrap().contains("context"));
    let r = http::post(
        srv.addr(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "messages");
}
