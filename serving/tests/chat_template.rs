//! The chat template from the fixture GGUF, checked against the prompt text transformers rendered
//! (hf-tiny-glm5-long.json `long_chat`), hand-derived renderings of the template text, and jinja2
//! behaviours as transformers configures them.

use serde_json::{json, Value};
use serving::chat::{ChatMessage, ChatTemplate};
use serving::ServingError;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

fn metadata() -> gguf::Metadata {
    let path = format!("{FIXTURES}/gguf/tiny-glm5-Q4_K_M.gguf");
    gguf::Model::open(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .metadata()
        .clone()
}

fn glm() -> ChatTemplate {
    ChatTemplate::from_gguf(&metadata()).expect("chat template")
}

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect()
}

#[test]
fn gguf_template_is_the_hf_template() {
    let hf = std::fs::read_to_string(format!("{FIXTURES}/hf/chat_template.jinja"))
        .expect("chat_template.jinja");
    assert_eq!(glm().source(), hf);
}

#[test]
fn renders_the_long_chat_prompt_exactly_as_transformers() {
    let path = format!("{FIXTURES}/refs/hf-tiny-glm5-long.json");
    let refs: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("refs")).expect("json");
    let chat = refs["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .find(|p| p["id"] == "long_chat")
        .expect("long_chat");
    let messages: Vec<ChatMessage> =
        serde_json::from_value(chat["messages"].clone()).expect("messages");
    assert_eq!(messages.len(), 2);
    let text = glm().render(&messages, true).expect("render");
    assert_eq!(text, chat["text"].as_str().expect("text"));
}

#[test]
fn hand_checked_renderings_of_the_glm_template() {
    // Read off the template text: "[gMASK]<sop>", then per message "<|role|>\n" + content
    // (assistant adds "<think></think>\n"), other roles produce nothing; the generation prompt is
    // "<|assistant|>\n<think></think>\n".
    let t = glm();
    assert_eq!(
        t.render(&msgs(&[("user", "Hi")]), false).unwrap(),
        "[gMASK]<sop><|user|>\nHi"
    );
    assert_eq!(
        t.render(&msgs(&[("user", "A"), ("assistant", "B"), ("user", "C")]), true).unwrap(),
        "[gMASK]<sop><|user|>\nA<|assistant|>\n<think></think>\nB<|user|>\nC<|assistant|>\n<think></think>\n"
    );
    assert_eq!(
        t.render(
            &msgs(&[("system", "S"), ("tool", "ignored"), ("user", "Q")]),
            false
        )
        .unwrap(),
        "[gMASK]<sop><|system|>\nS<|user|>\nQ"
    );
    assert_eq!(
        t.render(&[], true).unwrap(),
        "[gMASK]<sop><|assistant|>\n<think></think>\n"
    );
}

#[test]
fn missing_template_is_a_template_error() {
    let mut meta = metadata();
    meta.remove("tokenizer.chat_template");
    assert!(matches!(
        ChatTemplate::from_gguf(&meta),
        Err(ServingError::Template(_))
    ));
    assert!(matches!(
        ChatTemplate::from_gguf_named(&metadata(), "tool_use"),
        Err(ServingError::Template(_))
    ));
    assert!(matches!(
        ChatTemplate::new("{% if %}", None, None),
        Err(ServingError::Template(_))
    ));
}

#[test]
fn bos_and_eos_tokens_come_from_the_gguf_ids() {
    let mut meta = metadata();
    meta.set(
        "tokenizer.chat_template",
        gguf::Value::String("{{ bos_token }}|{{ eos_token }}".into()),
    );
    // Ids 1977 and 1975 of the fixture vocabulary (README special-token table).
    assert_eq!(
        ChatTemplate::from_gguf(&meta)
            .unwrap()
            .render(&[], false)
            .unwrap(),
        "[gMASK]|<|endoftext|>"
    );
}

fn render(src: &str, messages: Value, kwargs: Value) -> String {
    let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).expect("compile");
    let kwargs = kwargs.as_object().cloned().unwrap_or_default();
    t.render_json(&messages, true, &kwargs).expect("render")
}

// Expected strings below are what jinja2 3.1.6 renders with transformers' environment
// (ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loopcontrols) and its
// json.dumps-based tojson filter).

#[test]
fn whitespace_control_matches_transformers_jinja2() {
    let src = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[U] {{ m.content | trim }}\n  {% else %}\n[{{ m.role | upper }}] {{ m.content }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[A]{% endif %}\n";
    let m = json!([{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "yo"}]);
    assert_eq!(render(src, m, json!({})), "[U] hi\n[ASSISTANT] yo\n[A]");
}

#[test]
fn python_methods_printing_and_loop_controls() {
    let src = "{{ ' a '.strip() }}|{{ 'abc'.startswith('ab') }}|{{ 'a,b'.split(',') }}|{{ none }}|{{ {'k': [1, 2.0, none, 'it\\'s']} }}|{{ 'X'.lower() }}";
    assert_eq!(
        render(src, json!([]), json!({})),
        "a|True|['a', 'b']|None|{'k': [1, 2.0, None, \"it's\"]}|x"
    );
    let src = "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.get('z', 'dflt') }}|{{ d.keys() | list | length }}";
    assert_eq!(
        render(src, json!([]), json!({"d": {"x": 1, "y": "two"}})),
        "x=1;y=two;dflt|2"
    );
    let src = "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}";
    assert_eq!(render(src, json!([]), json!({})), "02");
    let src = "{{ messages[-1]['content'][::-1] }}|{{ messages | length }}|{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ bos_token }}|{{ tools is none }}";
    let m = json!([{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "yo"}]);
    assert_eq!(render(src, m, json!({})), "oy|2|2|<s>|True");
}

#[test]
fn tojson_is_transformers_json_dumps() {
    let v = json!({"b": 1, "a": [1.5, "x\"y", null, true, "é", "<a>&", "\u{1}"], "e": {}});
    let src = "{{ v | tojson }}|{{ v | tojson(indent=2, sort_keys=True) }}|{{ 'é🌍' | tojson(ensure_ascii=True) }}|{{ [] | tojson }}|{{ v | tojson(separators=(',', ':')) }}";
    let want = "{\"b\": 1, \"a\": [1.5, \"x\\\"y\", null, true, \"é\", \"<a>&\", \"\\u0001\"], \"e\": {}}|{\n  \"a\": [\n    1.5,\n    \"x\\\"y\",\n    null,\n    true,\n    \"é\",\n    \"<a>&\",\n    \"\\u0001\"\n  ],\n  \"b\": 1,\n  \"e\": {}\n}|\"\\u00e9\\ud83c\\udf0d\"|[]|{\"b\":1,\"a\":[1.5,\"x\\\"y\",null,true,\"é\",\"<a>&\",\"\\u0001\"],\"e\":{}}";
    assert_eq!(render(src, json!([]), json!({"v": v})), want);
}

#[test]
fn raise_exception_becomes_a_template_error() {
    let t = ChatTemplate::new(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok",
        None,
        None,
    )
    .expect("compile");
    assert_eq!(
        t.render(&[ChatMessage::new("user", "x")], false).unwrap(),
        "ok"
    );
    match t.render(&[ChatMessage::new("assistant", "x")], false) {
        Err(ServingError::Template(msg)) => {
            assert!(msg.contains("first message must be from the user"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn kwargs_reach_the_template() {
    let src = "{% if enable_thinking is defined and not enable_thinking %}/nothink{% endif %}{{ tools | length }}";
    assert_eq!(
        render(
            src,
            json!([]),
            json!({"enable_thinking": false, "tools": [{"name": "f"}]})
        ),
        "/nothink1"
    );
}
