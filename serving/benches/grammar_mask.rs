//! Per-token cost of constrained decoding at GLM-5's vocabulary size (154,880 entries):
//! computing the llguidance token mask, applying it to the logits, and committing the token.
//! Run: `cargo bench -p serving --bench grammar_mask`.
//!
//! The vocabulary is synthetic (the real GLM-5 tokenizer is not in the repository): the 256
//! byte tokens, 154,592 distinct word-like pieces and 32 control tokens. Pieces are letters
//! (frequent ones more often), digits, punctuation, JSON fragments and CJK characters (a fifth of
//! them, GLM's vocabulary is largely Chinese), half with a leading space, with the length
//! profile of byte-level BPE vocabularies (mode 4-5 characters, a tenth longer than 10). The
//! mask's cost depends on how many tokens a grammar state allows, on the lengths (llguidance
//! precomputes slices of JSON-string tokens of up to 10 and 30 characters) and on the trie's
//! shape, which this reproduces; the exact words do not matter.
//!
//! In the engine the mask is computed on another thread while the forward pass runs; what the
//! step waits for is applying the mask, sampling and committing the token.
//!
//! Baseline measured in the same run: greedy sampling (argmax) over the same 154,880 logits,
//! what every decode step pays anyway.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use serde_json::json;
use serving::grammar::{Grammar, Reasoning, VocabEntry, Vocabulary};
use serving::sampler::{apply_mask, argmax, ConstraintSource};
use std::collections::HashSet;
use std::hint::black_box;
use std::time::Duration;

const VOCAB: usize = 154_880;
const N_SPECIAL: usize = 32;

/// xorshift64*.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn vocabulary() -> (Vec<VocabEntry>, Vec<Vec<u8>>) {
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut seen: HashSet<Vec<u8>> = words.iter().cloned().collect();
    let fixed = ["{\"", "\":", "\": ", "\",", "\", \"", "\"}", "}", "{", "[", "]", "null", "true", "false", " \"", "\n", "\n  "];
    for f in fixed {
        if seen.insert(f.as_bytes().to_vec()) {
            words.push(f.as_bytes().to_vec());
        }
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    const LETTERS: &[u8] = b"etaoinshrdlcumwfgypbvkjxqz";
    const PUNCT: &[u8] = b".,;:!?-_()[]{}\"'/\\<>=+*&%$#@";
    // Percent of pieces by character count 1..=16 (byte-level BPE vocabularies peak at 4-5).
    const LENGTHS: [usize; 16] = [2, 8, 12, 14, 14, 12, 10, 8, 6, 4, 3, 2, 2, 1, 1, 1];
    let length = |rng: &mut Rng| {
        let mut r = rng.below(100);
        LENGTHS
            .iter()
            .position(|&p| {
                let hit = r < p;
                r = r.saturating_sub(p);
                hit
            })
            .unwrap_or(LENGTHS.len() - 1)
            + 1
    };
    while words.len() < VOCAB - N_SPECIAL {
        let mut w = Vec::new();
        if rng.below(2) == 0 {
            w.push(b' ');
        }
        let n = length(&mut rng).saturating_sub(w.len()).max(1);
        match rng.below(20) {
            0 | 1 => {
                w.extend((0..n.min(3)).map(|_| b'0' + rng.below(10) as u8));
            }
            2 | 3 => {
                w.extend((0..n.min(3)).map(|_| PUNCT[rng.below(PUNCT.len())]));
            }
            4..=7 => {
                // CJK ideographs, 3 bytes each.
                for _ in 0..n.min(4) {
                    let c = char::from_u32(0x4e00 + rng.below(0x5000) as u32).unwrap_or('中');
                    let mut buf = [0u8; 4];
                    w.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
            _ => {
                // Skewed towards frequent letters, like real text.
                for _ in 0..n {
                    let spread = rng.below(LETTERS.len()) + 1;
                    w.push(LETTERS[rng.below(spread)]);
                }
                if rng.below(8) == 0 {
                    let first = usize::from(w[0] == b' ');
                    w[first] = w[first].to_ascii_uppercase();
                }
            }
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
        let n = (1..=16.min(b.len() - i)).rev().find(|&n| by_bytes.contains_key(&b[i..i + n])).unwrap();
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
    let json = vocab.compile(&Grammar::JsonSchema(schema), Reasoning::None).unwrap();
    let any_json = vocab.compile(&Grammar::JsonSchema(json!({"type": "object"})), Reasoning::None).unwrap();
    let yes_no = vocab.compile(&Grammar::Gbnf("root ::= \"yes\" | \"no\"".into()), Reasoning::None).unwrap();

    let mut g = c.benchmark_group("mask_154880");
    g.measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1)).sample_size(30);

    let mut logits: Vec<f32> = (0..VOCAB).map(|i| ((i * 7919) % 1000) as f32 * 1e-3).collect();
    g.bench_function("baseline_argmax", |b| b.iter(|| argmax(black_box(&logits))));

    // A grammar state reached by feeding `prefix`; then one mask computation.
    let at = |src: &dyn ConstraintSource, prefix: &str| {
        let mut m = src.start().unwrap();
        for t in tokenize(&words, prefix) {
            m.commit(t).unwrap();
        }
        m
    };
    let states: [(&str, &dyn ConstraintSource, &str); 6] = [
        ("schema_start", &json, ""),
        ("schema_inside_string", &json, "{\"city\": \"Par"),
        ("schema_next_key", &json, "{\"city\": \"Paris\", "),
        ("schema_integer", &json, "{\"city\": \"Paris\", \"days\": "),
        ("json_object_inside_string", &any_json, "{\"note\": \"the weather in"),
        ("gbnf_yes_no", &yes_no, ""),
    ];
    for (name, src, prefix) in states {
        g.bench_function(format!("compute_mask/{name}"), |b| {
            b.iter_batched(|| at(src, prefix), |mut m| m.allowed().map(<[u32]>::len), BatchSize::SmallInput)
        });
    }

    // Applying a mask that allows a few tokens (the costly case: most words are zero) and one
    // that allows everything.
    let mut m = at(&json, "{\"city\": \"Paris\", \"days\": ");
    let narrow = m.allowed().unwrap().to_vec();
    g.bench_function("apply_mask/narrow", |b| b.iter(|| apply_mask(black_box(&mut logits), &narrow)));
    let wide = vec![u32::MAX; VOCAB.div_ceil(32)];
    g.bench_function("apply_mask/all_allowed", |b| b.iter(|| apply_mask(black_box(&mut logits), &wide)));
    // Committing a token (the lexer and parser advance).
    let quote = tokenize(&words, "P")[0];
    g.bench_function("commit/inside_string", |b| {
        b.iter_batched(|| at(&json, "{\"city\": \""), |mut m| m.commit(quote), BatchSize::SmallInput)
    });

    // A whole constrained answer token by token: every mask, apply and commit (the engine does
    // the mask part during the forward pass).
    let answer = tokenize(&words, "{\"city\": \"Paris\", \"days\": 12}");
    g.throughput(Throughput::Elements(answer.len() as u64));
    g.bench_function(format!("answer_{}_tokens/mask+apply+commit", answer.len()), |b| {
        b.iter_batched(
            || (json.start().unwrap(), logits.clone()),
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
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
