//! Constrained decoding end to end without a model: grammars compiled by llguidance for a small
//! byte-level vocabulary (with multi-byte tokens and control tokens, like a real BPE vocabulary),
//! then "generated" by a seeded random walk over the allowed tokens. Whatever the walk picks,
//! the output must parse and satisfy the grammar; an adversarial walk that always prefers
//! whitespace must still end (JSON whitespace is bounded).

#[path = "server_support/rng.rs"]
mod rng;

use rng::Rng;
use serde_json::{json, Value};
use serving::grammar::{Grammar, Reasoning, VocabEntry, Vocabulary};
use serving::sampler::{ConstraintSource, TokenConstraint};
use serving::server::tools::{
    self, ToolChoice, ToolDef, ToolFormat, ToolOut, ToolParser, ToolSupport,
};

const EOS: u32 = 400;
const THINK: u32 = 401;
const END_THINK: u32 = 402;
const CALL: u32 = 403;
const END_CALL: u32 = 404;
const KEY: u32 = 405;
const END_KEY: u32 = 406;
const VAL: u32 = 407;
const END_VAL: u32 = 408;
const VOCAB: usize = 420;

/// Byte tokens 0..256, multi-byte pieces 256.., control tokens 400.., unused ids at the end.
fn vocab() -> (Vocabulary, Vec<Vec<u8>>) {
    let pieces = [
        "{\"",
        "\":",
        "\",",
        "\"}",
        "true",
        "false",
        "null",
        "  ",
        "\n",
        "\n  ",
        "city",
        "days",
        "Paris",
        "Rome",
        "name",
        "arguments",
        "get_weather",
        "yes",
        "no",
        " the",
        "123",
        "<tool",
    ];
    let mut entries: Vec<VocabEntry> = (0..=255u8).map(|b| VocabEntry::Text(vec![b])).collect();
    let mut text: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for p in pieces {
        entries.push(VocabEntry::Text(p.as_bytes().to_vec()));
        text.push(p.as_bytes().to_vec());
    }
    while entries.len() < EOS as usize {
        entries.push(VocabEntry::Unused);
        text.push(Vec::new());
    }
    for s in [
        "<eos>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
    ] {
        entries.push(VocabEntry::Special(s.into()));
        text.push(s.as_bytes().to_vec());
    }
    while entries.len() < VOCAB {
        entries.push(VocabEntry::Unused);
        text.push(Vec::new());
    }
    (Vocabulary::new(&entries, &[EOS]).unwrap(), text)
}

fn allowed(mask: &[u32]) -> Vec<u32> {
    (0..VOCAB as u32)
        .filter(|&i| {
            mask.get(i as usize / 32)
                .is_some_and(|w| w & (1 << (i % 32)) != 0)
        })
        .collect()
}

enum Walk {
    Random,
    /// Always a whitespace-only token when one is allowed, else random (but never EOS while
    /// anything else is allowed).
    Blanks,
}

/// Generate until the grammar finishes or allows only EOS; the text (control tokens written
/// out) and the number of tokens. Panics when a step has an empty mask.
fn walk(
    c: &mut dyn TokenConstraint,
    text: &[Vec<u8>],
    seed: u64,
    how: Walk,
    limit: usize,
) -> (String, usize) {
    let mut rng = Rng(seed);
    let mut out = Vec::new();
    for step in 0..limit {
        let mask = c.allowed().unwrap().to_vec();
        let ok = allowed(&mask);
        assert!(
            !ok.is_empty(),
            "empty mask after {:?}",
            String::from_utf8_lossy(&out)
        );
        let non_eos: Vec<u32> = ok.iter().copied().filter(|&t| t != EOS).collect();
        if non_eos.is_empty() {
            return (String::from_utf8(out).unwrap(), step);
        }
        let pick = match how {
            Walk::Blanks => non_eos
                .iter()
                .copied()
                .find(|&t| {
                    !text[t as usize].is_empty()
                        && text[t as usize].iter().all(|b| b" \n\t".contains(b))
                })
                .unwrap_or_else(|| non_eos[rng.below(non_eos.len())]),
            // Ending early is allowed when EOS is: take it now and then, so short outputs are
            // exercised too.
            Walk::Random if ok.contains(&EOS) && rng.below(4) == 0 => {
                return (String::from_utf8(out).unwrap(), step)
            }
            Walk::Random => non_eos[rng.below(non_eos.len())],
        };
        out.extend_from_slice(&text[pick as usize]);
        c.commit(pick).unwrap();
        if c.is_finished() {
            return (String::from_utf8(out).unwrap(), step + 1);
        }
    }
    panic!(
        "no end after {limit} tokens: {:?}",
        String::from_utf8_lossy(&out)
    );
}

fn run(
    g: &Grammar,
    reasoning: Reasoning,
    seeds: std::ops::Range<u64>,
    how: fn() -> Walk,
) -> Vec<String> {
    let (v, text) = vocab();
    let compiled = v.compile(g, reasoning).unwrap();
    seeds
        .map(|s| {
            let mut c = compiled.start().unwrap();
            walk(c.as_mut(), &text, s, how(), 4000).0
        })
        .collect()
}

const SCHEMA: &str = r#"{"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "days": {"type": "integer", "minimum": 1, "maximum": 30}},
    "required": ["city", "days"], "additionalProperties": false}"#;

fn valid(o: &Value) -> bool {
    let Some(m) = o.as_object() else { return false };
    m.len() == 2
        && m["city"].as_str().is_some_and(|c| c.chars().count() <= 16)
        && m["days"].as_i64().is_some_and(|d| (1..=30).contains(&d))
}

#[test]
fn json_schema_output_always_validates() {
    let schema: Value = serde_json::from_str(SCHEMA).unwrap();
    for out in run(
        &Grammar::JsonSchema(schema),
        Reasoning::None,
        0..200,
        || Walk::Random,
    ) {
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(valid(&v), "{out}");
    }
}

#[test]
fn no_free_whitespace_so_objects_close() {
    // An adversary that always takes whitespace still gets a complete object: outside strings
    // the only blanks are the one space after ',' and ':'.
    let schema: Value = serde_json::from_str(SCHEMA).unwrap();
    for out in run(&Grammar::JsonSchema(schema), Reasoning::None, 0..20, || {
        Walk::Blanks
    }) {
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(valid(&v), "{out}");
        assert!(out.starts_with("{\"city\": \""), "{out:?}");
        assert_eq!(gaps(&out), [" ", " ", " "], "{out:?}");
    }
}

/// Runs of whitespace between JSON tokens (not inside strings).
fn gaps(json: &str) -> Vec<String> {
    let (mut out, mut cur, mut in_str, mut esc) = (Vec::new(), String::new(), false, false);
    for c in json.chars() {
        if in_str {
            in_str = esc || c != '"';
            esc = !esc && c == '\\';
            continue;
        }
        if c.is_whitespace() {
            cur.push(c);
            continue;
        }
        if !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
        in_str = c == '"';
    }
    out
}

#[test]
fn gbnf_choice_regex_grammars() {
    for out in run(
        &Grammar::Gbnf("root ::= \"yes\" | \"no\"".into()),
        Reasoning::None,
        0..50,
        || Walk::Random,
    ) {
        assert!(out == "yes" || out == "no", "{out:?}");
    }
    let list = "root ::= item (\", \" item){0,3}\nitem ::= [a-c]+ | \"x\" [0-9]{2}\n";
    let re = regex_lite(r"^([a-c]+|x[0-9]{2})(, ([a-c]+|x[0-9]{2})){0,3}$");
    for out in run(&Grammar::Gbnf(list.into()), Reasoning::None, 0..100, || {
        Walk::Random
    }) {
        assert!(re(&out), "{out:?}");
    }
    for out in run(
        &Grammar::Choice(vec!["red".into(), "green".into()]),
        Reasoning::None,
        0..20,
        || Walk::Random,
    ) {
        assert!(out == "red" || out == "green", "{out:?}");
    }
    for out in run(
        &Grammar::Regex("[0-9]{3}-[a-z]{2}".into()),
        Reasoning::None,
        0..20,
        || Walk::Random,
    ) {
        let b = out.as_bytes();
        assert!(
            b.len() == 6 && b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-',
            "{out:?}"
        );
    }
}

/// A tiny matcher for the one regular language above (no regex crate in this test).
fn regex_lite(_pattern: &str) -> impl Fn(&str) -> bool {
    |s: &str| {
        s.split(", ").count() <= 4
            && s.split(", ").all(|item| {
                (!item.is_empty() && item.bytes().all(|b| (b'a'..=b'c').contains(&b)))
                    || (item.len() == 3
                        && item.starts_with('x')
                        && item[1..].bytes().all(|b| b.is_ascii_digit()))
            })
    }
}

#[test]
fn thinking_comes_before_the_constrained_answer() {
    let schema: Value = serde_json::from_str(SCHEMA).unwrap();
    let (v, text) = vocab();
    // Inside an open block: any text, then </think>, then the JSON.
    let g = v
        .compile(
            &Grammar::JsonSchema(schema.clone()),
            Reasoning::Open { close: END_THINK },
        )
        .unwrap();
    let mut c = g.start().unwrap();
    for t in " the".bytes().map(u32::from).chain([END_THINK]) {
        assert!(allowed(c.allowed().unwrap()).contains(&t));
        c.commit(t).unwrap();
    }
    let (rest, _) = walk(c.as_mut(), &text, 7, Walk::Random, 4000);
    assert!(valid(&serde_json::from_str(&rest).unwrap()), "{rest}");
    // Optional: the model may open a block, or answer at once.
    let g = v
        .compile(
            &Grammar::JsonSchema(schema),
            Reasoning::Optional {
                open: THINK,
                close: END_THINK,
            },
        )
        .unwrap();
    let mut c = g.start().unwrap();
    let first = allowed(c.allowed().unwrap());
    assert!(first.contains(&THINK) && first.contains(&('{' as u32)) && !first.contains(&END_THINK));
    c.commit(THINK).unwrap();
    assert!(allowed(c.allowed().unwrap()).contains(&END_THINK));
}

fn weather() -> ToolDef {
    ToolDef {
        name: "get_weather".into(),
        description: Some("Weather forecast".into()),
        parameters: serde_json::from_str(SCHEMA).unwrap(),
    }
}

fn support(format: ToolFormat) -> ToolSupport {
    ToolSupport {
        format,
        system_role: true,
        marker_ids: vec![
            ("<tool_call>", CALL),
            ("</tool_call>", END_CALL),
            ("<arg_key>", KEY),
            ("</arg_key>", END_KEY),
            ("<arg_value>", VAL),
            ("</arg_value>", END_VAL),
        ],
    }
}

#[test]
fn forced_calls_parse_and_validate_in_every_format() {
    let (v, text) = vocab();
    let other = ToolDef {
        name: "get_time".into(),
        description: None,
        parameters: json!({"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "additionalProperties": false}),
    };
    let tools_list = vec![weather(), other];
    for format in [ToolFormat::Generic, ToolFormat::Hermes, ToolFormat::Glm] {
        for (choice, parallel) in [
            (ToolChoice::Named("get_weather".into()), false),
            (ToolChoice::Required, true),
        ] {
            let (start, rules) =
                tools::forced_call_grammar(&tools_list, &choice, parallel, &support(format))
                    .unwrap()
                    .unwrap();
            let g = v
                .compile(&Grammar::Rules { start, rules }, Reasoning::None)
                .unwrap();
            for seed in 0..40 {
                let mut c = g.start().unwrap();
                let (out, _) = walk(c.as_mut(), &text, seed, Walk::Random, 4000);
                let mut p = ToolParser::new(format, tools_list.clone(), false);
                let mut outs = Vec::new();
                p.push(&out, &mut outs);
                p.finish(true, &mut outs);
                let calls: Vec<(String, Value)> = outs
                    .iter()
                    .filter_map(|o| match o {
                        ToolOut::Call { name, arguments } => {
                            Some((name.clone(), serde_json::from_str(arguments).unwrap()))
                        }
                        ToolOut::Text(t) => {
                            assert!(
                                t.trim().is_empty(),
                                "{format:?}: stray text {t:?} in {out:?}"
                            );
                            None
                        }
                    })
                    .collect();
                assert!(!calls.is_empty(), "{format:?} {out:?}");
                if !parallel {
                    assert_eq!(calls.len(), 1);
                }
                for (name, args) in calls {
                    match name.as_str() {
                        "get_weather" => assert!(valid(&args), "{format:?}: {args} from {out:?}"),
                        "get_time" => {
                            assert!(choice == ToolChoice::Required);
                            let m = args.as_object().unwrap();
                            assert!(m.keys().all(|k| k == "zone"), "{args}");
                            assert!(
                                m.get("zone").is_none_or(|z| z == "UTC" || z == "CET"),
                                "{args}"
                            );
                        }
                        n => panic!("unexpected function {n}"),
                    }
                }
            }
        }
    }
}

#[test]
fn glm_format_refuses_what_it_cannot_enforce() {
    let t = ToolDef {
        name: "f".into(),
        description: None,
        parameters: json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}),
    };
    let e = tools::forced_call_grammar(
        &[t],
        &ToolChoice::Required,
        false,
        &support(ToolFormat::Glm),
    )
    .unwrap_err();
    assert_eq!(e.status, 400);
    assert!(e.message.contains("pattern"), "{}", e.message);
}

#[test]
fn bad_grammars_are_errors() {
    let (v, _) = vocab();
    for g in [
        Grammar::Gbnf("root ::= \"a".into()),
        Grammar::JsonSchema(
            json!({"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}),
        ),
        Grammar::JsonSchema(json!(false)),
        Grammar::Lark("start: undefined_rule".into()),
        Grammar::Regex("(".into()),
    ] {
        assert!(v.compile(&g, Reasoning::None).is_err(), "{g:?}");
    }
}
