//! Per-token cost of constrained decoding at GLM-5's vocabulary size (154,880 entries):
//! computing the llguidance token mask, applying it to the logits, and committing the token.
//! Run: `cargo bench -p serving --bench grammar_mask`.
//!
//! The vocabulary is synthetic (the real GLM-5 tokenizer is not in the repository): the 256
//! byte tokens, a few JSON pieces, 154,592 pieces grown the way BPE merges grow them (each an
//! existing piece, frequent ones preferred, followed by a letter, digit, punctuation mark, CJK
//! character or short piece; a space only at the start; at most 16 characters) and 32 control
//! tokens. The mask's cost depends on how many tokens a grammar state allows, on their lengths
//! (llguidance precomputes slices of JSON-string tokens by length) and on how many distinct
//! prefixes the trie has, which merges keep realistic; the exact words do not matter. The length
//! histogram is printed when the benchmark starts.
//!
//! In the engine the mask is computed on another thread while the forward pass runs; what the
//! step waits for is applying the mask, sampling and committing the token.
//!
//! Baseline measured in the same run: greedy sampling (argmax) over the same 154,880 logits,
//! what every decode step pays anyway.

#[path = "../tests/server_support/rng.rs"]
mod rng;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use rng::Rng;
use serde_json::json;
use serving::grammar::{Grammar, Reasoning, VocabEntry, Vocabulary};
use serving::sampler::{apply_mask, argmax, ConstraintSource};
use std::collections::HashSet;
use std::hint::black_box;
use std::time::Duration;

const VOCAB: usize = 154_880;
const N_SPECIAL: usize = 32;

fn vocabulary() -> (Vec<VocabEntry>, Vec<Vec<u8>>) {
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut seen: HashSet<Vec<u8>> = words.iter().cloned().collect();
    let fixed = [
        "{\"", "\":", "\": ", "\",", "\", \"", "\"}", "null", "true", "false", " \"", "\n  ",
    ];
    for f in fixed {
        if seen.insert(f.as_bytes().to_vec()) {
            words.push(f.as_bytes().to_vec());
        }
    }
    // The units merges start from: letters (frequent ones weighted up), a space, digits,
    // punctuation and 2,000 CJK characters.
    let mut units: Vec<Vec<u8>> = Vec::new();
    for (i, c) in b"etaoinshrdlcumwfgypbvkjxqz".iter().enumerate() {
        for _ in 0..(26 - i) / 3 + 1 {
            units.push(vec![*c]);
        }
        units.push(vec![c.to_ascii_uppercase()]);
    }
    units.extend(std::iter::repeat_n(vec![b' '], 20));
    units.extend(b"0123456789.,;:!?-_()'/".iter().map(|&c| vec![c]));
    for k in 0..2000u32 {
        let c = char::from_u32(0x4e00 + k * 7).unwrap_or('中');
        units.push(c.to_string().into_bytes());
    }
    // BPE-like growth: every new piece is an existing piece (early, i.e. frequent, ones
    // preferred) followed by a unit or a short piece, so prefixes are shared the way merges
    // share them in a trained vocabulary.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let first_merge = words.len();
    while words.len() < VOCAB - N_SPECIAL {
        let n = words.len() - first_merge;
        let left = if n == 0 || rng.below(4) == 0 {
            units[rng.below(units.len())].clone()
        } else {
            // Cube of a uniform number: a Zipf-like preference for early pieces.
            let u = rng.unit();
            words[first_merge + ((u * u * u) * n as f64) as usize].clone()
        };
        let right = if n > 0 && rng.below(3) == 0 {
            let u = rng.unit();
            words[first_merge + ((u * u * u * u) * n as f64) as usize].clone()
        } else {
            units[rng.below(units.len())].clone()
        };
        let mut w = left;
        w.extend_from_slice(&right);
        // No piece spans words (a space only at the start), and none is longer than 16 chars.
        let chars = String::from_utf8_lossy(&w).chars().count();
        if chars > 16 || w[1..].contains(&b' ') {
            continue;
        }
        if seen.insert(w.clone()) {
            words.push(w);
        }
    }
    let mut entries: Vec<VocabEntry> = words.iter().cloned().map(VocabEntry::Text).collect();
    for i in 0..N_SPECIAL {
        let name = format!("<|special_{i}|>");
        words.push(name.clone().into_bytes());
        entries.push(VocabEntry::Special(name));
    }
    assert_eq!(entries.len(), VOCAB);
    let mut hist = [0usize; 17];
    for w in &words[256..VOCAB - N_SPECIAL] {
        hist[String::from_utf8_lossy(w).chars().count().min(16)] += 1;
    }
    eprintln!(
        "synthetic vocabulary: pieces by character count 1..=16: {:?}",
        &hist[1..]
    );
    (entries, words)
}

/// Greedy tokenization with the longest vocabulary entry at each point (enough to drive a
/// grammar through a given text).
fn tokenize(words: &[Vec<u8>], text: &str) -> Vec<u32> {
    let mut by_bytes: std::collections::HashMap<&[u8], u32> = std::collections::HashMap::new();
    for (i, w) in words.iter().enumerate() {
        by_bytes.entry(w.as_slice()).or_insert(i as u32);
    }
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let n = (1..=16.min(b.len() - i))
            .rev()
            .find(|&n| by_bytes.contains_key(&b[i..i + n]))
            .unwrap();
        out.push(by_bytes[&b[i..i + n]]);
        i += n;
    }
    out
}

const SCHEMA: &str = r#"{"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "days": {"type": "integer", "minimum": 1, "maximum": 30}},
    "required": ["city", "days"], "additionalProperties": false}"#;

fn bench(c: &mut Criterion) {
    let (entries, words) = vocabulary();
    let eos = (VOCAB - 1) as u32;
    let vocab = Vocabulary::new(&entries, &[eos]).unwrap();
    let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
    let json = vocab
        .compile(&Grammar::JsonSchema(schema), Reasoning::None)
        .unwrap();
    let any_json = vocab
        .compile(
            &Grammar::JsonSchema(json!({"type": "object"})),
            Reasoning::None,
        )
        .unwrap();
    let yes_no = vocab
        .compile(
            &Grammar::Gbnf("root ::= \"yes\" | \"no\"".into()),
            Reasoning::None,
        )
        .unwrap();

    let mut g = c.benchmark_group("mask_154880");
    g.measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(30);

    let mut logits: Vec<f32> = (0..VOCAB)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
        .collect();
    g.bench_function("baseline_argmax", |b| b.iter(|| argmax(black_box(&logits))));

    // A grammar state reached by feeding `prefix`; then one mask computation.
    let at = |src: &dyn ConstraintSource, prefix: &str| {
        let mut m = src.start().unwrap();
        for t in tokenize(&words, prefix) {
            m.commit(t).unwrap();
        }
        m
    };
    let states: [(&str, &dyn ConstraintSource, &str); 7] = [
        ("schema_start", &json, ""),
        ("schema_inside_string", &json, "{\"city\": \"Par"),
        (
            "schema_string_3_chars_left",
            &json,
            "{\"city\": \"Paris Texas u",
        ),
        ("schema_next_key", &json, "{\"city\": \"Paris\", "),
        ("schema_integer", &json, "{\"city\": \"Paris\", \"days\": "),
        (
            "json_object_inside_string",
            &any_json,
            "{\"note\": \"the weather in",
        ),
        ("gbnf_yes_no", &yes_no, ""),
    ];
    for (name, src, prefix) in states {
        g.bench_function(format!("compute_mask/{name}"), |b| {
            b.iter_batched(
                || at(src, prefix),
                |mut m| m.allowed().map(<[u32]>::len),
                BatchSize::SmallInput,
            )
        });
    }

    // Applying a mask that allows a few tokens (the costly case: most words are zero) and one
    // that allows everything.
    let mut m = at(&json, "{\"city\": \"Paris\", \"days\": ");
    let narrow = m.allowed().unwrap().to_vec();
    g.bench_function("apply_mask/narrow", |b| {
        b.iter(|| apply_mask(black_box(&mut logits), &narrow))
    });
    let wide = vec![u32::MAX; VOCAB.div_ceil(32)];
    g.bench_function("apply_mask/all_allowed", |b| {
        b.iter(|| apply_mask(black_box(&mut logits), &wide))
    });
    // Committing a token (the lexer and parser advance).
    let quote = tokenize(&words, "P")[0];
    g.bench_function("commit/inside_string", |b| {
        b.iter_batched(
            || at(&json, "{\"city\": \""),
            |mut m| m.commit(quote),
            BatchSize::SmallInput,
        )
    });

    // A whole constrained answer token by token: every mask, apply and commit (the engine does
    // the mask part during the forward pass). Once with the schema above, once with the same
    // schema without `maxLength` (bounded strings are the costly part).
    let free: serde_json::Value =
        serde_json::from_str(&SCHEMA.replace("\"maxLength\": 16", "\"minLength\": 0")).unwrap();
    let free = vocab
        .compile(&Grammar::JsonSchema(free), Reasoning::None)
        .unwrap();
    let answer = tokenize(&words, "{\"city\": \"Paris is far\", \"days\": 12}");
    g.throughput(Throughput::Elements(answer.len() as u64));
    for (name, src) in [("maxLength_16", &json), ("unbounded_string", &free)] {
        g.bench_function(format!("answer_{}_tokens/{name}", answer.len()), |b| {
            b.iter_batched(
                || (src.start().unwrap(), logits.clone()),
                |(mut m, mut l)| {
                    for &t in &answer {
                        let mask = m.allowed().unwrap();
                        apply_mask(&mut l, mask);
                        m.commit(t).unwrap();
                    }
                },
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
