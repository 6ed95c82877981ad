//! Tokenizer built from the fixture GGUF's metadata, checked against token ids and pieces produced
//! by the HF tokenizer (tokenizers 0.23.3) and by llama.cpp's `llama-tokenize` / `llama-server`.

use serde_json::Value;
use serving::tokenizer::{Detokenizer, Tokenizer, TokenizerSpec};
use serving::ServingError;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

fn fixture(rel: &str) -> String {
    format!("{FIXTURES}/{rel}")
}

fn json(rel: &str) -> Value {
    let text = std::fs::read_to_string(fixture(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn metadata(rel: &str) -> gguf::Metadata {
    let model = gguf::Model::open(fixture(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    model.metadata().clone()
}

fn glm() -> Tokenizer {
    Tokenizer::from_gguf(&metadata("gguf/tiny-glm5-Q4_K_M.gguf")).expect("tokenizer from GGUF")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn hf_prompts() -> Vec<Value> {
    let mut all = Vec::new();
    for f in ["refs/hf-tiny-glm5.json", "refs/hf-tiny-glm5-long.json"] {
        all.extend(
            json(f)["prompts"]
                .as_array()
                .expect("prompts")
                .iter()
                .cloned(),
        );
    }
    all
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
    send_sync::<serving::chat::ChatTemplate>();
}

#[test]
fn encodes_every_hf_prompt_to_the_hf_ids() {
    let tok = glm();
    let prompts = hf_prompts();
    assert_eq!(prompts.len(), 6);
    for p in &prompts {
        let text = p["text"].as_str().expect("text");
        let want = ids(&p["token_ids"]);
        let got = tok.encode(text, true).expect("encode");
        assert_eq!(got, want, "prompt {}", p["id"]);
        // The recorded pieces are the vocabulary entries of those ids.
        for (id, piece) in want.iter().zip(p["tokens"].as_array().expect("tokens")) {
            assert_eq!(
                tok.token_text(*id),
                piece.as_str(),
                "prompt {} id {id}",
                p["id"]
            );
        }
    }
}

#[test]
fn special_tokens_stay_text_without_parse_special() {
    let tok = glm();
    let chat = hf_prompts()
        .into_iter()
        .find(|p| p["id"] == "long_chat")
        .expect("long_chat prompt");
    let text = chat["text"].as_str().expect("text");
    let plain = tok.encode(text, false).expect("encode");
    // The converter appended the 25 special tokens at ids 1975..2000 (fixture README).
    assert!(plain.iter().all(|&id| id < 1975), "{plain:?}");
    assert_eq!(tok.decode(&plain, false).expect("decode"), text);
    // Plain prompts tokenize the same either way.
    for p in hf_prompts().iter().filter(|p| p["messages"].is_null()) {
        let text = p["text"].as_str().expect("text");
        assert_eq!(
            tok.encode(text, false).expect("encode"),
            ids(&p["token_ids"])
        );
    }
}

/// 323 varied texts (prose, digits, whitespace runs, punctuation, code, scripts, emoji, control
/// characters, inline and near-miss special tokens) tokenized by HF `tokenizers` 0.23.3; made by
/// `tokenizer_hf_refs.py` next to this file. HF always splits added tokens out of the text, which
/// is `parse_special = true` here.
#[test]
fn matches_hf_tokenizers_on_varied_text() {
    let tok = glm();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/tokenizer_hf_refs.json"
    ))
    .expect("tokenizer_hf_refs.json");
    let refs: Value = serde_json::from_str(&text).expect("json");
    let cases = refs["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 323);
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let want = ids(&c["token_ids"]);
        assert_eq!(tok.encode(text, true).expect("encode"), want, "{text:?}");
        assert_eq!(
            tok.decode(&want, false).expect("decode"),
            c["decoded"].as_str().expect("decoded"),
            "{text:?}"
        );
        assert_eq!(
            tok.decode(&want, true).expect("decode"),
            c["decoded_skip_special"].as_str().expect("decoded"),
            "{text:?}"
        );
    }
}

#[test]
fn matches_llama_tokenize_on_every_gguf_and_the_first_shard() {
    let refs = json("refs/llamacpp-tiny-glm5.json");
    let files = refs["files"].as_array().expect("files");
    assert_eq!(files.len(), 5);
    for f in files {
        let name = f["file"].as_str().expect("file");
        let rel = if name.contains("-of-") {
            format!("gguf/split/{name}")
        } else {
            format!("gguf/{name}")
        };
        let tok = Tokenizer::from_gguf(&metadata(&rel)).expect("tokenizer");
        for p in f["prompts"].as_array().expect("prompts") {
            let text = p["text"].as_str().expect("text");
            assert_eq!(
                tok.encode(text, true).expect("encode"),
                ids(&p["llama_tokenize_ids"]),
                "{name} {}",
                p["id"]
            );
        }
    }
}

#[test]
fn decodes_llama_server_pieces_and_continuations() {
    let tok = glm();
    let refs = json("refs/llamacpp-tiny-glm5.json");
    let mut checked = 0;
    for f in refs["files"].as_array().expect("files") {
        for p in f["prompts"].as_array().expect("prompts") {
            let greedy = ids(&p["greedy_ids"]);
            assert_eq!(
                tok.decode(&greedy, true).expect("decode"),
                p["greedy_text"].as_str().expect("text")
            );
            // llama-server renders candidates with special = false: control tokens as "".
            for step in p["per_step"].as_array().expect("per_step") {
                for cand in step["top_logprobs"].as_array().expect("top") {
                    let id = cand["id"].as_u64().expect("id") as u32;
                    let want = cand["token"].as_str().expect("token");
                    assert_eq!(tok.decode(&[id], true).expect("decode"), want, "id {id}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 1000, "{checked}");
}

#[test]
fn decodes_hf_greedy_continuations_and_candidate_pieces() {
    let tok = glm();
    for p in hf_prompts() {
        let g = &p["greedy_16"];
        // transformers decoded these with special tokens kept.
        assert_eq!(
            tok.decode(&ids(&g["ids"]), false).expect("decode"),
            g["text"].as_str().expect("text"),
            "{}",
            p["id"]
        );
        for step in g["per_step_top5"].as_array().expect("steps") {
            for cand in step.as_array().expect("cands") {
                let id = cand["id"].as_u64().expect("id") as u32;
                let piece = cand["token"].as_str().expect("piece");
                assert_eq!(tok.token_id(piece), Some(id), "{piece:?}");
            }
        }
    }
}

#[test]
fn vocabulary_and_special_ids_agree_with_the_hf_tokenizer() {
    let tok = glm();
    let hf = json("hf/tokenizer.json");
    let vocab = hf["model"]["vocab"].as_object().expect("vocab");
    assert_eq!(vocab.len(), 1975);
    for (piece, id) in vocab {
        assert_eq!(
            tok.token_id(piece),
            Some(id.as_u64().expect("id") as u32),
            "{piece:?}"
        );
    }
    let added = hf["added_tokens"].as_array().expect("added_tokens");
    assert_eq!(added.len(), 25);
    for t in added {
        let id = t["id"].as_u64().expect("id") as u32;
        assert_eq!(
            tok.token_id(t["content"].as_str().expect("content")),
            Some(id)
        );
        assert_eq!(tok.is_special(id), t["special"].as_bool().expect("special"));
    }
    // Model vocab 2048: ids 2000.. are converter padding, decoded as nothing.
    assert_eq!(tok.vocab_size(), 2048);
    assert_eq!(tok.decode(&[2000, 2047], false).expect("decode"), "");
    assert!(tok.decode(&[2048], false).is_err());
    assert_eq!(tok.token_bytes(2048), None);
}

#[test]
fn special_ids_and_end_of_generation_set() {
    let tok = glm();
    // generation_config.json's eos_token_id list is the model's stop set.
    let gen = json("hf/generation_config.json");
    let mut stop = ids(&gen["eos_token_id"]);
    stop.sort_unstable();
    assert_eq!(tok.eog_ids(), stop.as_slice());
    assert!(tok.is_eog(1982) && !tok.is_eog(1983));
    // Ids the converter wrote (fixture README, "GGUF special ids written by the converter").
    assert_eq!(tok.bos_id(), Some(1977));
    assert_eq!(tok.eos_id(), Some(1975));
    assert_eq!(tok.eot_id(), Some(1982));
    assert_eq!(tok.eom_id(), Some(1984));
    assert_eq!(tok.pad_id(), Some(1975));
    // glm4: llama.cpp adds no BOS; `[gMASK]<sop>` comes from the chat template.
    assert!(!tok.add_bos());
    assert_eq!(tok.encode("a", true).expect("encode"), vec![64]);
    assert_eq!(tok.encode("", true).expect("encode"), Vec::<u32>::new());
}

const ROUND_TRIP: &[&str] = &[
    "",
    " ",
    "Hello, world!",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n\nend",
    "numbers 1234567 3.14159 -42",
    "I'm you're they'VE it'LL",
    "Grüße aus Köln, naïve café",
    "日本語のテキストと中文",
    "emoji 🌍🚀👩‍👩‍👧 flags 🇫🇷",
    "combining e\u{301} and zero\u{200d}width",
    "control \u{0}\u{1}\u{7f} bytes",
    "<|user|> [gMASK] look like specials",
    "ÿ\u{100}\u{ffff}\u{10ffff}",
];

#[test]
fn decode_inverts_encode() {
    let tok = glm();
    for s in ROUND_TRIP {
        for parse in [false, true] {
            let ids = tok.encode(s, parse).expect("encode");
            assert_eq!(
                tok.decode(&ids, false).expect("decode"),
                *s,
                "parse_special={parse}"
            );
        }
    }
    // With parse_special the special text became control tokens, which skip_special drops.
    let ids = tok.encode("<|user|>\nhi", true).expect("encode");
    assert_eq!(ids[0], 1982);
    assert_eq!(tok.decode(&ids, true).expect("decode"), "\nhi");
}

#[test]
fn streaming_detokenizer_emits_only_whole_characters() {
    let tok = glm();
    for s in ROUND_TRIP {
        let ids = tok.encode(s, false).expect("encode");
        let mut d = Detokenizer::new(false);
        let mut out = String::new();
        for &id in &ids {
            let chunk = d.push(&tok, id).expect("push");
            assert!(
                !chunk.contains('\u{FFFD}'),
                "{s:?}: partial character leaked"
            );
            out.push_str(&chunk);
        }
        assert!(!d.has_pending());
        out.push_str(&d.finish());
        assert_eq!(out, *s);
    }
    // An emoji is split across byte tokens: nothing comes out until its last byte.
    let ids = tok.encode("🌍", false).expect("encode");
    assert!(ids.len() > 1, "{ids:?}");
    let mut stream = tok.decode_stream(false);
    for &id in &ids[..ids.len() - 1] {
        assert_eq!(stream.step(id).expect("step"), None);
    }
    assert_eq!(
        stream.step(ids[ids.len() - 1]).expect("step").as_deref(),
        Some("🌍")
    );
    // A dangling partial character is flushed lossily at the end.
    let mut d = Detokenizer::new(false);
    assert_eq!(d.push(&tok, ids[0]).expect("push"), "");
    assert_eq!(d.finish(), "\u{FFFD}");
    // Invalid continuation: replaced as soon as it is known to be invalid.
    let a = tok.encode("a", false).expect("encode")[0];
    assert_eq!(d.push(&tok, ids[0]).expect("push"), "");
    assert_eq!(d.push(&tok, a).expect("push"), "\u{FFFD}a");
    assert!(matches!(
        d.push(&tok, 99_999),
        Err(ServingError::Tokenizer(_))
    ));
}

/// SentencePiece BPE (`tokenizer.ggml.model = "llama"`): a small model trained with the
/// `sentencepiece` library (Llama-2 options, byte fallback) and the ids that library produces;
/// made by `tokenizer_spm_refs.py` next to this file.
#[test]
fn sentencepiece_bpe_matches_the_sentencepiece_library() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/tokenizer_spm_refs.json"
    ))
    .expect("tokenizer_spm_refs.json");
    let refs: Value = serde_json::from_str(&text).expect("json");
    let strings = |k: &str| -> Vec<String> {
        refs[k]
            .as_array()
            .expect(k)
            .iter()
            .map(|v| v.as_str().expect(k).to_string())
            .collect()
    };
    let spec = TokenizerSpec {
        model: "llama".into(),
        tokens: strings("tokens"),
        scores: Some(
            refs["scores"]
                .as_array()
                .expect("scores")
                .iter()
                .map(|v| v.as_f64().expect("score") as f32)
                .collect(),
        ),
        token_types: Some(
            refs["token_types"]
                .as_array()
                .expect("types")
                .iter()
                .map(|v| v.as_i64().expect("type"))
                .collect(),
        ),
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        add_space_prefix: Some(true),
        ..TokenizerSpec::default()
    };
    let tok = Tokenizer::from_spec(spec).expect("spm tokenizer");
    assert!(tok.add_bos(), "llama-style vocabularies add BOS by default");
    let cases = refs["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 12);
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let want = ids(&c["token_ids"]);
        assert_eq!(
            tok.tokenize(text, false, false).expect("tokenize"),
            want,
            "{text:?}"
        );
        let mut with_bos = vec![1];
        with_bos.extend(&want);
        assert_eq!(
            tok.encode(text, false).expect("encode"),
            with_bos,
            "{text:?}"
        );
        assert_eq!(
            tok.decode(&with_bos, true).expect("decode"),
            c["decoded"].as_str().expect("decoded")
        );
    }
    // "<s>" written in the text is BOS only when parsing specials.
    assert_eq!(tok.tokenize("<s>", false, true).expect("tokenize"), vec![1]);
    assert!(!tok
        .tokenize("<s>", false, false)
        .expect("tokenize")
        .contains(&1));
    assert_eq!(tok.eog_ids(), &[2]);
}

#[test]
fn refuses_unknown_or_missing_tokenizer_kinds() {
    let base = metadata("gguf/tiny-glm5-Q4_K_M.gguf");
    let err = |m: &gguf::Metadata| match Tokenizer::from_gguf(m) {
        Err(ServingError::Tokenizer(msg)) => msg,
        Err(e) => panic!("unexpected error kind: {e}"),
        Ok(_) => panic!("accepted"),
    };
    let mut m = base.clone();
    m.set("tokenizer.ggml.pre", gguf::Value::String("made-up".into()));
    assert!(err(&m).contains("made-up"));
    let mut m = base.clone();
    m.remove("tokenizer.ggml.pre");
    assert!(err(&m).contains("tokenizer.ggml.pre"));
    let mut m = base.clone();
    m.set("tokenizer.ggml.model", gguf::Value::String("bert".into()));
    assert!(err(&m).contains("bert"));
    let mut m = base.clone();
    m.remove("tokenizer.ggml.model");
    assert!(err(&m).contains("tokenizer.ggml.model"));
    // A wrongly typed key is a gguf type error, not a panic.
    let mut m = base;
    m.set("tokenizer.ggml.tokens", gguf::Value::U32(3));
    assert!(Tokenizer::from_gguf(&m).is_err());
}

mod prop {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    fn tok() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(glm)
    }

    proptest! {
        #[test]
        fn round_trip_any_text(s in any::<String>()) {
            let ids = tok().encode(&s, false).expect("encode");
            prop_assert_eq!(tok().decode(&ids, false).expect("decode"), s);
        }

        #[test]
        fn stream_equals_decode_for_any_ids(ids in proptest::collection::vec(0u32..2048, 0..40)) {
            let mut d = Detokenizer::new(true);
            let mut out = String::new();
            for &id in &ids {
                out.push_str(&d.push(tok(), id).expect("push"));
            }
            out.push_str(&d.finish());
            prop_assert_eq!(out, tok().decode(&ids, true).expect("decode"));
        }
    }
}
