//! Bodies of the serving fuzz targets (`tokenizer`, `chat_template`, `request`): properties every
//! input must satisfy, panicking when one does not. Depends on `gguf`, `serving` and
//! `serde_json` only, so `serving/tests/fuzz_smoke.rs` compiles this same file as a module and
//! runs it on stable over seeds and mutations.
//!
//! Properties:
//! - tokenizer: no input panics; plain-text encoding decodes back to the input; the bounded
//!   encoder agrees with the unbounded one; content escaped for a chat prompt never yields a
//!   control token and decodes back to itself;
//! - chat template: any template source with any messages either fails to compile, fails to
//!   render with an error, or renders within the output cap; never a panic or an abort;
//! - request: any JSON body through the completion and chat parsers gives a request or a 4xx
//!   error naming what is wrong.

// Each fuzz target uses one of the checks; the smoke test uses them all.
#![allow(dead_code)]

use serving::chat::{ChatLimits, ChatTemplate};
use serving::tokenizer::{Bounded, Tokenizer};
use std::sync::OnceLock;

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/gguf/tiny-glm5-Q4_K_M.gguf"
);

/// The fixture model's tokenizer (GLM-5 pre-tokenizer and special tokens), built once.
pub fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let m = gguf::Model::open(MODEL).expect("fixture model");
        Tokenizer::from_gguf(m.metadata()).expect("fixture tokenizer")
    })
}

/// Fuzz inputs arrive as bytes; text properties need UTF-8.
fn text(data: &[u8]) -> String {
    String::from_utf8_lossy(data).into_owned()
}

pub fn check_tokenizer(data: &[u8]) {
    let tok = tokenizer();
    let s = text(data);
    let plain = tok.encode(&s, false).expect("encoding never fails");
    assert_eq!(
        tok.decode(&plain, false)
            .expect("ids are in the vocabulary"),
        s,
        "plain text must round-trip"
    );
    let parsed = tok.encode(&s, true).expect("encoding never fails");
    let limit = data.first().map_or(0, |&b| b as usize);
    let want = if parsed.len() <= limit {
        Bounded::Complete(parsed.clone())
    } else {
        Bounded::Exceeds { limit }
    };
    assert_eq!(tok.encode_bounded(&s, true, limit).unwrap(), want);
    // As chat content: escaped, tokenized with special parsing, it stays text.
    let escaped = tok.escape_control_text(&s).unwrap_or_else(|| s.clone());
    match tok.encode_chat(&escaped, usize::MAX - 1).unwrap() {
        Bounded::Complete(ids) => {
            assert!(
                ids.iter().all(|&id| !tok.is_special(id)),
                "content became a control token: {ids:?}"
            );
            assert_eq!(tok.decode(&ids, false).unwrap(), s);
        }
        Bounded::Exceeds { .. } => panic!("no limit was given"),
    }
}

/// Limits small enough that a fuzzer iteration stays fast.
pub const FUZZ_LIMITS: ChatLimits = ChatLimits {
    fuel: 200_000,
    max_output_bytes: 1 << 20,
};

pub fn check_chat_template(data: &[u8]) {
    // Up to the first NUL: the template; then NUL-separated message contents.
    let s = text(data);
    let (src, rest) = s.split_once('\0').unwrap_or((s.as_str(), ""));
    let Ok(mut t) = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())) else {
        return;
    };
    t.set_limits(FUZZ_LIMITS);
    let tok = tokenizer();
    t.set_content_escaper(std::sync::Arc::new(|c: &str| tok.escape_control_text(c)));
    let messages: Vec<serde_json::Value> = rest
        .split('\0')
        .enumerate()
        .map(|(i, c)| {
            let role = ["system", "user", "assistant", "tool"][i % 4];
            serde_json::json!({"role": role, "content": c})
        })
        .collect();
    let msgs = serde_json::Value::Array(messages);
    let kwargs = serde_json::Map::new();
    if let Ok(out) = t.render_json(&msgs, true, &kwargs) {
        assert!(out.len() <= FUZZ_LIMITS.max_output_bytes);
        let _ = tok.encode_chat(&out, 4096);
    }
}

pub fn check_request(data: &[u8]) {
    let Ok(body) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    for r in [
        serving::server::params::parse_completion(&body).err(),
        serving::server::params::parse_chat(&body).err(),
    ]
    .into_iter()
    .flatten()
    {
        assert!(r.status.is_client_error(), "{r:?}");
        assert!(!r.message.is_empty());
    }
}
