//! HTTP tests of the OpenAI-compatible server over the rule-based mock model (expected texts
//! follow from the mock's rules in `server_support`), on 127.0.0.1 with an OS-chosen port.

mod server_support;

use serde_json::{json, Value};
use server_support::http::{self, EventStream};
use server_support::{make_ready, peak_logprob, start, wait_until, Options};
use serving::engine::EngineConfig;
use serving::server::ServerConfig;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;

const ALPHABET_AFTER_A: &str = "bcdefghijklmnopqrstuvwxyz";

fn close(a: &Value, b: f64) -> bool {
    // f32 logits through an f64 log-sum-exp, reported as f32: 1e-5 is a few f32 ulps here.
    a.as_f64().is_some_and(|a| (a - b).abs() < 1e-5)
}

/// Exact texts need greedy decoding (the mock leaves other tokens ~1% of the mass at T = 1).
fn greedy(mut v: Value) -> Value {
    if v.get("temperature").is_none() {
        v["temperature"] = json!(0);
    }
    v
}

/// POSTs `body` to the completions endpoint with greedy decoding.
fn complete(addr: SocketAddr, body: Value) -> http::Response {
    http::post(addr, "/v1/completions", &greedy(body))
}

/// POSTs `body` to the chat completions endpoint with greedy decoding.
fn chat(addr: SocketAddr, body: Value) -> http::Response {
    http::post(addr, "/v1/chat/completions", &greedy(body))
}

/// The JSON events of a finished stream, after checking that it ends with `[DONE]`.
fn sse_chunks(r: &http::Response) -> Vec<Value> {
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn assert_openai_error(r: &http::Response, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert_eq!(e["code"], json!(status), "{v}");
    v
}

#[test]
fn health_is_503_while_loading_then_200() {
    let s = start(Options {
        ready: false,
        ..Options::default()
    });
    let r = http::get(s.addr, "/health");
    let v = assert_openai_error(&r, 503);
    assert_eq!(v["error"]["message"], "Loading model");
    assert_openai_error(
        &http::post(s.addr, "/v1/completions", &json!({"prompt": "a"})),
        503,
    );
    make_ready(&s.state, &s.model, &s.metrics, None);
    let r = http::get(s.addr, "/health");
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"status": "ok"}));
}

#[test]
fn completion_greedy_with_usage() {
    let s = start(Options::default());
    let r = http::post(
        s.addr,
        "/v1/completions",
        &json!({"model": "anything", "prompt": "abc", "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "mock");
    assert_eq!(v["choices"][0]["text"], "defgh");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    );
}

#[test]
fn completion_defaults_counting_stops_and_token_prompts() {
    let s = start(Options::default());
    let text = |body: Value| {
        let r = complete(s.addr, body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            v["choices"][0]["finish_reason"]
                .as_str()
                .unwrap()
                .to_string(),
        )
    };
    // OpenAI's default of 16 tokens.
    assert_eq!(text(json!({"prompt": "a"})).0, &ALPHABET_AFTER_A[..16]);
    assert_eq!(
        text(json!({"prompt": "1 2 3", "max_tokens": 6})),
        (" 4 5 6".into(), "length".into())
    );
    // End-of-generation token.
    assert_eq!(
        text(json!({"prompt": "xy", "max_tokens": 10})),
        ("z".into(), "stop".into())
    );
    // Stop string, across tokens, not included.
    assert_eq!(
        text(json!({"prompt": "a", "max_tokens": 20, "stop": ["fg", "zz"]})),
        ("bcde".into(), "stop".into())
    );
    assert_eq!(
        text(json!({"prompt": [97, 98], "max_tokens": 2})),
        ("cd".into(), "length".into())
    );
    assert_eq!(
        text(json!({"prompt": "abc", "max_tokens": 2, "echo": true})),
        ("abcde".into(), "length".into())
    );
    // ignore_eos: 'z' is followed by <eos> (no text) and then 'a' again.
    assert_eq!(
        text(json!({"prompt": "xy", "max_tokens": 3, "ignore_eos": true})),
        ("za".into(), "length".into())
    );
}

#[test]
fn completion_logprobs_and_echo() {
    let s = start(Options::default());
    let r = complete(
        s.addr,
        json!({"prompt": "abc", "max_tokens": 2, "logprobs": 2, "echo": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["a", "b", "c", "d", "e"]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3, 4]));
    assert!(lp["token_logprobs"][0].is_null());
    assert!(lp["top_logprobs"][0].is_null());
    for i in 1..5 {
        assert!(close(&lp["token_logprobs"][i], peak_logprob()), "{lp}");
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 2);
        let want = ["a", "b", "c", "d", "e"][i];
        assert!(close(&top[want], peak_logprob()));
    }
    // n_probs is llama-server's name for the same thing.
    let r = complete(
        s.addr,
        json!({"prompt": "abc", "max_tokens": 1, "n_probs": 3}),
    );
    let v = r.json();
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn completion_stream_with_usage() {
    let s = start(Options::default());
    let r = complete(
        s.addr,
        json!({"prompt": "abc", "max_tokens": 4, "stream": true,
               "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let chunks = sse_chunks(&r);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "defg");
    let finish: Vec<_> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(finish, ["length"]);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));
}

#[test]
fn chat_completion_plain_and_reasoning() {
    let s = start(Options::default());
    let r = chat(
        s.addr,
        json!({"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["role"], "assistant");
    // Template output "[user]hi[assistant]": the mock continues ']' with the alphabet; the
    // `</think>` after 't' is a control token and shows no text.
    assert_eq!(m["content"], format!("a{ALPHABET_AFTER_A}"));
    assert!(m.get("reasoning_content").is_none());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // 26 letters + </think> + <eos>; prompt = 19 bytes.
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 19, "completion_tokens": 28, "total_tokens": 47})
    );

    // A system message "think" makes the mock template open a <think> block.
    let r = chat(
        s.addr,
        json!({"messages": [{"role": "system", "content": "think"},
                            {"role": "user", "content": "hi"}]}),
    );
    let v = r.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "qrst");
    assert_eq!(m["content"], "uvwxyz");

    // chat_template_kwargs reach the template: thinking switched off, no reasoning.
    let r = chat(
        s.addr,
        json!({"messages": [{"role": "system", "content": "think"},
                            {"role": "user", "content": "hi"}],
               "chat_template_kwargs": {"enable_thinking": false}}),
    );
    let v = r.json();
    let m = &v["choices"][0]["message"];
    assert!(m.get("reasoning_content").is_none(), "{v}");
    assert_eq!(m["content"], format!("a{ALPHABET_AFTER_A}"));
}

#[test]
fn chat_stream_deltas_and_reasoning() {
    let s = start(Options::default());
    let r = chat(
        s.addr,
        json!({"messages": [{"role": "system", "content": "think"},
                            {"role": "user", "content": "hi"}],
               "stream": true, "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200);
    let chunks = sse_chunks(&r);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let cat = |field: &str| -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][field].as_str())
            .collect()
    };
    assert_eq!(cat("reasoning_content"), "qrst");
    assert_eq!(cat("content"), "uvwxyz");
    let last = chunks.last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 12);
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
}

#[test]
fn chat_logprobs() {
    let s = start(Options::default());
    let r = chat(
        s.addr,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
               "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    for (entry, tok) in content.iter().zip(["a", "b", "c"]) {
        assert_eq!(entry["token"], tok);
        assert_eq!(entry["bytes"], json!([tok.as_bytes()[0]]));
        assert!(close(&entry["logprob"], peak_logprob()));
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], tok);
    }
}

#[test]
fn bad_requests_get_openai_errors() {
    let s = start(Options {
        ctx: 64,
        server: ServerConfig {
            max_body_bytes: 4096,
            ..ServerConfig::default()
        },
        ..Options::default()
    });
    let cases = [
        ("/v1/completions", json!({"prompt": "x", "max_tokens": -1})),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
        ),
        ("/v1/completions", json!({"prompt": "x", "top_p": 5})),
        ("/v1/completions", json!({"prompt": "x", "n": 1000000000})),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": vec!["s"; 100]}),
        ),
        ("/v1/completions", json!({"model": "m"})),
        ("/v1/completions", json!({"prompt": [70000]})),
        (
            "/v1/completions",
            json!({"prompt": "x", "logit_bias": {"9999": 1}}),
        ),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 100})),
        ("/v1/completions", json!([1, 2])),
        ("/v1/chat/completions", json!({"messages": "hi"})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 5}),
        ),
        // The template's BOS/EOS texts are its own: a client's would be control tokens.
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"bos_token": "<|assistant|>"}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"eos_token": "<|assistant|>"}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "tool", "content": "x"}]}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user"}], "max_tokens": 0}),
        ),
    ];
    for (path, body) in cases {
        let r = http::post(s.addr, path, &body);
        assert_openai_error(&r, 400);
    }
    // Malformed JSON, not UTF-8, too large, wrong route, wrong method.
    let raw = |body: &[u8]| {
        http::request(
            s.addr,
            "POST",
            "/v1/completions",
            &[("Content-Type", "application/json")],
            body,
        )
    };
    assert_openai_error(&raw(b"{not json"), 400);
    assert_openai_error(&raw(b"{\"prompt\": \"\xff\xfe\"}"), 400);
    assert_openai_error(&raw(b""), 400);
    assert_openai_error(&raw(&vec![b' '; 5000]), 413);
    assert_openai_error(&http::get(s.addr, "/v1/nothing"), 404);
    assert_openai_error(&http::get(s.addr, "/v1/completions"), 405);
    // The server is still fine.
    assert_eq!(http::get(s.addr, "/health").status, 200);
}

#[test]
fn api_key_protects_all_but_health() {
    let s = start(Options {
        server: ServerConfig {
            api_key: Some("sekrit".into()),
            ..ServerConfig::default()
        },
        ..Options::default()
    });
    assert_eq!(http::get(s.addr, "/health").status, 200);
    assert_openai_error(&http::get(s.addr, "/v1/models"), 401);
    assert_openai_error(&http::get(s.addr, "/metrics"), 401);
    let wrong = http::request(
        s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer nope")],
        b"",
    );
    assert_openai_error(&wrong, 401);
    let ok = http::request(
        s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer sekrit")],
        b"",
    );
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["data"][0]["id"], "mock");
}

#[test]
fn tokenize_detokenize_models_metrics() {
    let s = start(Options::default());
    let r = http::post(s.addr, "/tokenize", &json!({"content": "ab<eos>"}));
    assert_eq!(r.json()["tokens"], json!([97, 98, 256]));
    let r = http::post(
        s.addr,
        "/tokenize",
        &json!({"content": "a<eos>", "parse_special": false, "with_pieces": true}),
    );
    let toks = r.json()["tokens"].as_array().unwrap().clone();
    assert_eq!(toks.len(), 6);
    assert_eq!(toks[0], json!({"id": 97, "piece": "a"}));
    let r = http::post(s.addr, "/detokenize", &json!({"tokens": [97, 98, 256]}));
    assert_eq!(r.json()["content"], "ab<eos>");
    assert_openai_error(
        &http::post(s.addr, "/detokenize", &json!({"tokens": [97, 9999]})),
        400,
    );
    assert_openai_error(&http::post(s.addr, "/tokenize", &json!({})), 400);

    let v = http::get(s.addr, "/v1/models").json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "mock");

    complete(s.addr, json!({"prompt": "abc", "max_tokens": 2}));
    let m = http::get(s.addr, "/metrics");
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let t = m.text();
    assert!(t.contains("# TYPE gguftool_prompt_tokens_total counter"));
    assert!(
        t.contains("\ngguftool_prompt_tokens_total{model_name=\"mock\"} 3\n"),
        "{t}"
    );
    assert!(t.contains("\ngguftool_generation_tokens_total{model_name=\"mock\"} 2\n"));
    assert!(t.contains("gguftool_http_requests_total{model_name=\"mock\",route=\"/v1/completions\",status=\"200\"} 1"));
    assert!(t.contains("# TYPE gguftool_time_to_first_token_seconds histogram"));
    assert!(t.contains("gguftool_inter_token_latency_seconds_count{model_name=\"mock\"} 1"));
    assert!(t.contains("gguftool_num_requests_waiting{model_name=\"mock\"} 0"));
    assert!(t.contains("gguftool_kv_cache_usage_ratio"));
}

#[test]
fn client_disconnect_cancels_the_stream() {
    let s = start(Options {
        ctx: 100_000,
        ..Options::default()
    });
    // The model is paced (8 passes, then one per poll below, at most one a millisecond), so
    // the 90,000 tokens cannot all be generated before the server sees the disconnect: an
    // unpaced mock on a loaded CI machine sometimes finished them first ("length").
    s.model.gate.allow(8);
    let mut st = EventStream::open(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 90000, "ignore_eos": true, "stream": true}),
    );
    assert_eq!(st.status, 200);
    for _ in 0..3 {
        assert!(st.next_data().is_some());
    }
    drop(st);
    wait_until("the cancellation", || {
        s.model.gate.allow(1);
        s.metrics.finished_count("cancelled") == 1
    });
    s.model.gate.set(true);
    wait_until("the sequence to be freed", || {
        s.model.live.load(Ordering::SeqCst) == 0
    });
    assert!(s.metrics.generation_tokens.load(Ordering::SeqCst) < 90000);
}

#[test]
fn client_disconnect_cancels_a_non_streaming_request() {
    use std::io::Write;
    let s = start(Options {
        ctx: 10_000_000,
        ..Options::default()
    });
    let body = json!({"prompt": "a", "max_tokens": 9_000_000, "ignore_eos": true,
                      "temperature": 0})
    .to_string();
    let mut c = std::net::TcpStream::connect(s.addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_until("the request to run", || {
        s.metrics.requests_running.load(Ordering::SeqCst) == 1
    });
    drop(c);
    wait_until("the cancellation", || {
        s.metrics.finished_count("cancelled") == 1
    });
    wait_until("the sequence to be freed", || {
        s.model.live.load(Ordering::SeqCst) == 0
    });
}

#[test]
fn backend_failure_inside_a_stream_is_a_json_event() {
    let s = start(Options::default());
    // The mock fails on byte 0x01.
    let r = http::post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "\u{1}", "stream": true}),
    );
    assert_eq!(r.status, 200);
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let err: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("mock failure"));
    let r = http::post(s.addr, "/v1/completions", &json!({"prompt": "\u{1}"}));
    assert_openai_error(&r, 500);
}

#[test]
fn concurrent_requests_are_batched() {
    let s = start(Options::default());
    s.model.gate.set(false);
    let addr = s.addr;
    let spawn = |p: char| {
        std::thread::spawn(move || {
            let r = complete(addr, json!({"prompt": p.to_string(), "max_tokens": 3}));
            (r.status, r.json()["choices"][0]["text"].clone())
        })
    };
    let first = spawn('a');
    wait_until("the first request to run", || {
        s.metrics.requests_running.load(Ordering::SeqCst) == 1
    });
    let rest: Vec<_> = "bcdefgh".chars().map(spawn).collect();
    wait_until("7 waiting requests", || {
        s.metrics.requests_waiting.load(Ordering::SeqCst) == 7
    });
    s.model.gate.set(true);
    assert_eq!(first.join().unwrap(), (200, json!("bcd")));
    for (p, h) in "bcdefgh".chars().zip(rest) {
        let want: String = (1..=3u8).map(|i| (p as u8 + i) as char).collect();
        assert_eq!(h.join().unwrap(), (200, json!(want)));
    }
    assert_eq!(s.model.max_batch.load(Ordering::SeqCst), 8);
}

#[test]
fn full_queue_answers_429() {
    let s = start(Options {
        engine: Some(EngineConfig {
            max_queue: 1,
            max_running: 1,
            prefill_chunk: 512,
            context_length: 512,
            draft: None,
        }),
        ..Options::default()
    });
    s.model.gate.set(false);
    let addr = s.addr;
    let spawn = |p: &'static str| {
        std::thread::spawn(move || {
            http::post(
                addr,
                "/v1/completions",
                &json!({"prompt": p, "max_tokens": 2}),
            )
            .status
        })
    };
    let a = spawn("a");
    wait_until("the first request to run", || {
        s.metrics.requests_running.load(Ordering::SeqCst) == 1
    });
    let b = spawn("b");
    wait_until("one waiting request", || {
        s.metrics.requests_waiting.load(Ordering::SeqCst) == 1
    });
    let r = http::post(addr, "/v1/completions", &json!({"prompt": "c"}));
    let v = assert_openai_error(&r, 429);
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(r.header("retry-after"), Some("1"));
    s.model.gate.set(true);
    assert_eq!(a.join().unwrap(), 200);
    assert_eq!(b.join().unwrap(), 200);
}
