//! The serving fuzz targets' bodies (`fuzz/src/serving_checks.rs`) on stable: seeds and a fixed
//! number of dictionary mutations, so every test run checks the properties the real fuzzer
//! (`cargo fuzz run tokenizer|chat_template|request`, README "Fuzzing") explores at length.

#[path = "../../fuzz/src/serving_checks.rs"]
mod checks;

/// Fragments the mutations splice in: special tokens, template syntax, JSON punctuation, and
/// the characters the pre-tokenizer treats specially.
const DICT: &[&str] = &[
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "[gMASK]",
    "<sop>",
    "<think>",
    "</think>",
    "\u{FDD0}",
    "{{",
    "}}",
    "{%",
    "%}",
    "{% for i in range(9) %}",
    "{% endfor %}",
    "{{ m.content }}",
    "{% if x %}",
    "{% endif %}",
    "{{ messages }}",
    "'x'*9",
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "\u{3000}",
    "'s",
    "123456",
    "é",
    "日本",
    "\"",
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "null",
    "true",
    "-1",
    "1e999",
    "\"messages\"",
    "\"prompt\"",
    "\"role\"",
    "\"content\"",
    "\"max_tokens\"",
    "\"temperature\"",
    "\"stop\"",
    "\"logit_bias\"",
    "\u{0}",
];

struct Rng(u64);

impl Rng {
    /// splitmix64: a fixed seed keeps the run reproducible.
    fn next(&mut self) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as usize
    }
}

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut m = seed.to_vec();
    for _ in 0..1 + rng.next() % 4 {
        let at = if m.is_empty() {
            0
        } else {
            rng.next() % m.len()
        };
        match rng.next() % 4 {
            0 => {
                let w = DICT[rng.next() % DICT.len()].as_bytes();
                m.splice(at..at, w.iter().copied());
            }
            1 if !m.is_empty() => {
                let end = (at + 1 + rng.next() % 8).min(m.len());
                m.drain(at..end);
            }
            2 if !m.is_empty() => m[at] = (rng.next() % 256) as u8,
            _ => m.truncate(at),
        }
    }
    m
}

fn run(name: &str, seeds: &[Vec<u8>], n: usize, check: fn(&[u8])) {
    for s in seeds {
        check(s);
    }
    let mut rng = Rng(0x5eed ^ name.len() as u64);
    for i in 0..n {
        let pick = rng.next() % seeds.len();
        let m = mutate(&mut rng, &seeds[pick]);
        if std::panic::catch_unwind(|| check(&m)).is_err() {
            let p = std::env::temp_dir().join(format!("serving-fuzz-{name}-{i}"));
            std::fs::write(&p, &m).unwrap();
            panic!(
                "{name}: mutation {i} broke a property; input saved to {}",
                p.display()
            );
        }
    }
}

fn b(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

#[test]
fn tokenizer_properties() {
    let seeds = vec![
        b(""),
        b("1 2 3 4 5 6 7 8 9 10"),
        b("The capital of France is Paris.\n\nA B C"),
        b("[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>\n"),
        b("a  b   c\t\td \u{3000}\u{3000}e"),
        b("I'M here, it's 12345 \u{FDD0}\u{FDD0} é日本"),
        vec![0xff, 0xfe, b'x', 0xc3],
    ];
    run("tokenizer", &seeds, 3000, checks::check_tokenizer);
}

#[test]
fn chat_template_properties() {
    let fixture = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/hf/chat_template.jinja"
    ))
    .unwrap();
    let seeds = vec![
        format!("{fixture}\0You are brief.\0hi<|assistant|>\0ok"),
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\0a\0b".into(),
        "{% set s='x'*1000 %}{% for i in range(1000) %}{{s}}{% endfor %}\0x".into(),
        "{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}".into(),
        "{{ bos_token }}{{ messages | tojson }}{{ raise_exception('no') }}\0q".into(),
    ];
    let seeds: Vec<Vec<u8>> = seeds.into_iter().map(String::into_bytes).collect();
    run("chat_template", &seeds, 1500, checks::check_chat_template);
}

#[test]
fn request_properties() {
    let seeds = vec![
        b(r#"{"prompt": "1 2 3", "max_tokens": 4, "temperature": 0}"#),
        b(r#"{"messages": [{"role": "user", "content": "hi"}], "stream": true}"#),
        b(r#"{"prompt": [1, 2, 3], "logprobs": 2, "echo": true, "stop": ["x"]}"#),
        b(r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}"#),
        b(r#"{"prompt": "x", "logit_bias": {"5": -100}, "top_p": 0.5, "seed": -1}"#),
        b(r#"{"messages": [], "n": 2, "response_format": {"type": "json"}}"#),
    ];
    run("request", &seeds, 5000, checks::check_request);
}
