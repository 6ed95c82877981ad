//! Tool (function) calling: how tools and tool results reach the model, the grammars that force
//! a call, and the parser that turns the model's output back into `tool_calls`.
//!
//! Three output formats, picked once per model by rendering a probe conversation through its
//! chat template ([`ToolSupport::detect`]):
//! - **GLM** (GLM-4.5 / 4.7 / 5 templates): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`,
//!   string values raw, other values JSON; newlines between the parts are allowed.
//! - **Hermes** (Qwen and others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
//! - **Generic**, for templates that do not render tools (the bundled model's): the server
//!   writes the tool schemas into the system text, earlier calls into the assistant text and tool
//!   results into a user turn, with the documented prompt of [`generic_tools_prompt`]; the model
//!   answers in the Hermes form. The markers in those turns are the server's and reach the model
//!   as its control tokens (`<tool_call>`, `<tool_response>` where the vocabulary has them); the
//!   client's parts (schemas, calls, results, its own text) are escaped by the fallback itself,
//!   so they never become control tokens.
//!
//! With GLM and Hermes the model's own template renders `tools`, `tool_calls` and `role: tool`.
//! `tool_choice: required` or a named function constrain the output to calls whose arguments
//! follow the function's parameter schema (compiled by llguidance, see [`crate::grammar`]).

use super::error::ApiError;
use super::text::{Message, TextCodec, ToolCall};
use serde_json::{json, Value};
use std::fmt::Write;

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";
const KEY_OPEN: &str = "<arg_key>";
const KEY_CLOSE: &str = "</arg_key>";
const VALUE_OPEN: &str = "<arg_value>";
const VALUE_CLOSE: &str = "</arg_value>";

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments (an object schema).
    pub parameters: Value,
}

impl ToolDef {
    /// OpenAI's `{"type": "function", "function": {...}}`, as chat templates expect it.
    pub fn to_json(&self) -> Value {
        let mut f = json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            f["description"] = d.clone().into();
        }
        json!({"type": "function", "function": f})
    }

    /// Whether argument `key` is declared exactly `{"type": "string"}` (GLM writes such
    /// values raw, everything else as JSON).
    fn is_string_param(&self, key: &str) -> bool {
        self.parameters
            .get("properties")
            .and_then(|p| p.get(key))
            .and_then(|p| p.get("type"))
            .and_then(Value::as_str)
            == Some("string")
    }
}

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls; the tools are left out of the prompt.
    None,
    Auto,
    /// At least one call, arguments constrained to the schemas.
    Required,
    /// Exactly one call of this function, arguments constrained to its schema.
    Named(String),
}

/// How the served model's chat template handles tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Glm,
    Hermes,
    Generic,
}

impl ToolFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolFormat::Glm => "glm",
            ToolFormat::Hermes => "hermes",
            ToolFormat::Generic => "generic",
        }
    }
}

/// What the server learned about the model's template and vocabulary for tool calling.
#[derive(Debug, Clone)]
pub struct ToolSupport {
    pub format: ToolFormat,
    /// The template renders `system` messages (else the generic prompt goes to the first user
    /// message).
    pub system_role: bool,
    /// Ids of the marker tokens the vocabulary has as single control tokens (`<tool_call>`,
    /// `</tool_call>`, `<arg_key>`, ...): shown as text so the parser sees them, and usable in
    /// grammars.
    pub marker_ids: Vec<(&'static str, u32)>,
}

const PROBE_FN: &str = "probe_tool_fn";
const PROBE_ARG: &str = "probe_arg";
const PROBE_VALUE: &str = "probe_arg_value";
const PROBE_RESULT: &str = "probe_tool_result";
const PROBE_SYSTEM: &str = "probe_system_text";

impl ToolSupport {
    /// Render a probe conversation (a tool, a call, its result) through the template and look
    /// at what comes out.
    pub fn detect(codec: &dyn TextCodec) -> ToolSupport {
        let probe_tool = ToolDef {
            name: PROBE_FN.into(),
            description: Some("probe".into()),
            parameters: json!({"type": "object", "properties": {PROBE_ARG: {"type": "string"}}}),
        };
        let messages = vec![
            Message::new("user", "probe question"),
            Message {
                tool_calls: vec![ToolCall {
                    id: "probe_call".into(),
                    name: PROBE_FN.into(),
                    arguments: json!({PROBE_ARG: PROBE_VALUE}).to_string(),
                }],
                ..Message::new("assistant", "")
            },
            Message {
                tool_call_id: Some("probe_call".into()),
                name: Some(PROBE_FN.into()),
                ..Message::new("tool", PROBE_RESULT)
            },
        ];
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("tools".into(), json!([probe_tool.to_json()]));
        let format = match codec.render_chat(&messages, true, &kwargs) {
            Ok(text) if text.contains(PROBE_RESULT) && text.matches(PROBE_FN).count() >= 2 => {
                call_format(&text)
            }
            _ => ToolFormat::Generic,
        };
        let system_role = codec
            .render_chat(
                &[
                    Message::new("system", PROBE_SYSTEM),
                    Message::new("user", "probe question"),
                ],
                true,
                &serde_json::Map::new(),
            )
            .is_ok_and(|t| t.contains(PROBE_SYSTEM));
        let marker_ids = [
            CALL_OPEN,
            CALL_CLOSE,
            KEY_OPEN,
            KEY_CLOSE,
            VALUE_OPEN,
            VALUE_CLOSE,
        ]
        .into_iter()
        .filter_map(|m| {
            let id = codec.token_id(m)?;
            codec.is_special(id).then_some((m, id))
        })
        .collect();
        ToolSupport {
            format,
            system_role,
            marker_ids,
        }
    }

    pub fn marker_id(&self, marker: &str) -> Option<u32> {
        self.marker_ids
            .iter()
            .find(|(m, _)| *m == marker)
            .map(|&(_, id)| id)
    }

    /// Token ids the text stream must show for the parser.
    pub fn visible_ids(&self) -> Vec<u32> {
        self.marker_ids.iter().map(|&(_, id)| id).collect()
    }

    /// A Lark expression for a marker: its text, or its control token when it is one.
    fn lark_marker(&self, marker: &str) -> String {
        let text = lark_string(marker);
        match self.marker_id(marker) {
            Some(id) => format!("({text} | <[{id}]>)"),
            None => text,
        }
    }
}

/// The call syntax in a probe rendering.
fn call_format(text: &str) -> ToolFormat {
    let Some(at) = text.find(&format!("{CALL_OPEN}{PROBE_FN}")).or_else(|| {
        text.find(CALL_OPEN).filter(|&i| {
            text[i + CALL_OPEN.len()..]
                .trim_start()
                .starts_with(PROBE_FN)
        })
    }) else {
        return hermes_or_generic(text);
    };
    let rest = &text[at..];
    let glm = rest.find(KEY_OPEN).is_some_and(|k| {
        rest[k + KEY_OPEN.len()..].starts_with(PROBE_ARG)
            && rest.contains(&format!("{VALUE_OPEN}{PROBE_VALUE}{VALUE_CLOSE}"))
    });
    if glm {
        ToolFormat::Glm
    } else {
        hermes_or_generic(text)
    }
}

fn hermes_or_generic(text: &str) -> ToolFormat {
    let hermes = text.match_indices(CALL_OPEN).any(|(i, _)| {
        let body = text[i + CALL_OPEN.len()..].trim_start();
        let end = body.find(CALL_CLOSE).unwrap_or(body.len());
        parse_json_call(&body[..end]).is_some_and(|(n, _)| n == PROBE_FN)
    });
    if hermes {
        ToolFormat::Hermes
    } else {
        ToolFormat::Generic
    }
}

/// The text the generic fallback adds to the system prompt (documented in the README). The
/// tool schemas and a named function come from the client: `esc` neutralizes their control-token
/// text, while the markers of the instruction are the server's own.
pub fn generic_tools_prompt(
    tools: &[ToolDef],
    choice: &ToolChoice,
    esc: &dyn Fn(&str) -> String,
) -> String {
    let mut s = String::from(
        "# Tools\n\nYou can call the following functions. Their parameters are JSON schemas:\n",
    );
    for t in tools {
        let _ = writeln!(s, "{}", esc(&t.to_json().to_string()));
    }
    s.push_str(
        "\nTo call functions, answer with one line per call, in exactly this form:\n\
         <tool_call>{\"name\": \"<function name>\", \"arguments\": {<arguments as JSON>}}</tool_call>\n\
         The results come back in <tool_response> blocks.",
    );
    match choice {
        ToolChoice::Required => s.push_str("\nYou must call at least one function now."),
        ToolChoice::Named(n) => {
            let _ = write!(s, "\nYou must call the function {} now.", esc(n));
        }
        ToolChoice::None | ToolChoice::Auto => {}
    }
    s
}

/// An earlier call as the generic fallback writes it into the assistant turn.
fn generic_call_text(c: &ToolCall, esc: &dyn Fn(&str) -> String) -> String {
    let args =
        serde_json::from_str::<Value>(&c.arguments).unwrap_or(Value::String(c.arguments.clone()));
    let call = json!({"name": c.name, "arguments": args}).to_string();
    format!("{CALL_OPEN}{}{CALL_CLOSE}", esc(&call))
}

/// A tool result as the generic fallback writes it into a user turn: a JSON line naming the
/// call it answers, then the result text.
fn generic_result_text(m: &Message, esc: &dyn Fn(&str) -> String) -> String {
    // Inserted in key order, so the line reads the same with serde_json's `preserve_order`.
    let mut head = serde_json::Map::new();
    if let Some(n) = &m.name {
        head.insert("name".into(), n.clone().into());
    }
    if let Some(id) = &m.tool_call_id {
        head.insert("tool_call_id".into(), id.clone().into());
    }
    format!(
        "{RESULT_OPEN}\n{}\n{}\n{RESULT_CLOSE}",
        esc(&Value::Object(head).to_string()),
        esc(&m.content)
    )
}

const RESULT_OPEN: &str = "<tool_response>";
const RESULT_CLOSE: &str = "</tool_response>";

/// The conversation and template variables to render. Native formats pass tools, calls and
/// results to the template as they are; the generic fallback writes them into plain turns so
/// they reach a model whose template would drop them. Those turns are the server's
/// ([`Message::content_escaped`]): their markers become the model's control tokens, while every
/// client part in them is escaped here through `codec` (a client's `<tool_call>` stays text).
pub fn prepare(
    messages: &[Message],
    tools: &[ToolDef],
    choice: &ToolChoice,
    support: &ToolSupport,
    codec: &dyn TextCodec,
) -> (Vec<Message>, Option<Value>) {
    let offered: &[ToolDef] = if *choice == ToolChoice::None {
        &[]
    } else {
        tools
    };
    if support.format != ToolFormat::Generic {
        let kw = (!offered.is_empty())
            .then(|| Value::Array(offered.iter().map(ToolDef::to_json).collect()));
        return (messages.to_vec(), kw);
    }
    let esc = |s: &str| codec.escape_content(s).into_owned();
    let server_turn = |m: &Message, content: String| Message {
        content,
        tool_calls: Vec::new(),
        content_escaped: true,
        ..m.clone()
    };
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    // Whether the last turn of `out` is one the fallback wrote for tool results.
    let mut results_turn = false;
    for m in messages {
        match m.role.as_str() {
            "tool" => {
                let block = generic_result_text(m, &esc);
                // Results of one round of calls go into one user turn.
                match out.last_mut() {
                    Some(prev) if results_turn => {
                        prev.content.push('\n');
                        prev.content.push_str(&block);
                    }
                    _ => out.push(server_turn(&Message::new("user", ""), block)),
                }
                results_turn = true;
                continue;
            }
            "assistant" if !m.tool_calls.is_empty() => {
                let mut content = esc(&m.content);
                for c in &m.tool_calls {
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&generic_call_text(c, &esc));
                }
                out.push(server_turn(m, content));
            }
            _ => out.push(m.clone()),
        }
        results_turn = false;
    }
    if !offered.is_empty() {
        let prompt = generic_tools_prompt(offered, choice, &esc);
        let role = if support.system_role {
            "system"
        } else {
            "user"
        };
        match out.iter().position(|m| m.role == role) {
            Some(i) => {
                let own = if out[i].content_escaped {
                    out[i].content.clone()
                } else {
                    esc(&out[i].content)
                };
                out[i] = server_turn(&out[i], format!("{prompt}\n\n{own}"));
            }
            None => out.insert(0, server_turn(&Message::new(role, ""), prompt)),
        }
    }
    (out, None)
}

/// Lark rules of a forced call: `(start expansion, rules)`. `None` when nothing is forced.
pub fn forced_call_grammar(
    tools: &[ToolDef],
    choice: &ToolChoice,
    parallel: bool,
    support: &ToolSupport,
) -> Result<Option<(String, String)>, ApiError> {
    let chosen: Vec<&ToolDef> = match choice {
        ToolChoice::None | ToolChoice::Auto => return Ok(None),
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
    };
    let mut rules = String::new();
    let mut alts = Vec::new();
    for (i, t) in chosen.iter().enumerate() {
        let rule = format!("call_{i}");
        let body = match support.format {
            ToolFormat::Glm => glm_call_rule(t, support, i, &mut rules)?,
            ToolFormat::Hermes | ToolFormat::Generic => {
                let schema = json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": closed(&t.parameters)},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                });
                let schema = crate::grammar::with_json_options(&schema)
                    .map_err(|e| ApiError::invalid("tools", format!("function {}: {e}", t.name)))?;
                let ws = if support.format == ToolFormat::Hermes {
                    "(\"\\n\")?"
                } else {
                    ""
                };
                format!(
                    "{} {ws} %json {schema} {ws} {}",
                    support.lark_marker(CALL_OPEN),
                    support.lark_marker(CALL_CLOSE)
                )
            }
        };
        let _ = writeln!(rules, "{rule}: {body}");
        alts.push(rule);
    }
    if alts.is_empty() {
        return Err(ApiError::invalid("tool_choice", "no function to call"));
    }
    let _ = writeln!(rules, "tool_call: {}", alts.join(" | "));
    let start = if parallel {
        "tool_call ((\"\\n\")? tool_call)*"
    } else {
        "tool_call"
    };
    Ok(Some((start.to_string(), rules)))
}

/// The parameter schema with undeclared arguments left out: a forced call generates only the
/// declared ones (still valid for an open schema, and a small model cannot wander off into
/// made-up keys). An explicit `additionalProperties` is kept.
fn closed(parameters: &Value) -> Value {
    let mut p = parameters.clone();
    if let Some(o) = p.as_object_mut() {
        if o.contains_key("properties") && !o.contains_key("additionalProperties") {
            o.insert("additionalProperties".into(), false.into());
        }
    }
    p
}

/// Keywords of a parameter object schema the GLM grammar honours; anything else would be
/// silently unenforced, so it is refused.
const GLM_OBJECT_KEYS: [&str; 8] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "description",
    "title",
    "$schema",
    "strict",
];
const GLM_STRING_KEYS: [&str; 8] = [
    "type",
    "description",
    "title",
    "maxLength",
    "minLength",
    "enum",
    "const",
    "examples",
];

fn glm_call_rule(
    t: &ToolDef,
    support: &ToolSupport,
    i: usize,
    rules: &mut String,
) -> Result<String, ApiError> {
    let bad = |msg: String| ApiError::invalid("tools", format!("function {}: {msg}", t.name));
    let p = match &t.parameters {
        Value::Object(o) => o,
        _ => return Err(bad("parameters must be an object schema".into())),
    };
    if let Some(k) = p.keys().find(|k| !GLM_OBJECT_KEYS.contains(&k.as_str())) {
        return Err(bad(format!(
            "the parameter schema keyword {k:?} cannot be enforced in GLM's tool format"
        )));
    }
    let props = p.get("properties").and_then(Value::as_object);
    let required: Vec<&str> = p
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let nl = "(\"\\n\")?";
    let mut body = format!(
        "{} {}",
        support.lark_marker(CALL_OPEN),
        lark_string(&t.name)
    );
    for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
        let value = glm_value(schema).map_err(|m| bad(format!("parameter {key:?}: {m}")))?;
        let rule = format!("arg_{i}_{j}");
        let _ = writeln!(
            rules,
            "{rule}: {nl} {} {} {} {nl} {} {value} {}",
            support.lark_marker(KEY_OPEN),
            lark_string(key),
            support.lark_marker(KEY_CLOSE),
            support.lark_marker(VALUE_OPEN),
            support.lark_marker(VALUE_CLOSE),
        );
        let opt = if required.contains(&key.as_str()) {
            ""
        } else {
            "?"
        };
        let _ = write!(body, " {rule}{opt}");
    }
    if let Some(missing) = required
        .iter()
        .find(|r| !props.is_some_and(|p| p.contains_key(**r)))
    {
        return Err(bad(format!("required parameter {missing:?} has no schema")));
    }
    let _ = write!(body, " {nl} {}", support.lark_marker(CALL_CLOSE));
    Ok(body)
}

/// The Lark expression of one GLM argument value: raw text for plain strings, JSON otherwise.
fn glm_value(schema: &Value) -> Result<String, String> {
    let is_string = schema.get("type").and_then(Value::as_str) == Some("string");
    if !is_string {
        let s = crate::grammar::with_json_options(schema).map_err(|e| e.to_string())?;
        return Ok(format!("%json {s}"));
    }
    let o = schema.as_object().ok_or("not an object schema")?;
    if let Some(k) = o.keys().find(|k| !GLM_STRING_KEYS.contains(&k.as_str())) {
        return Err(format!(
            "the string keyword {k:?} cannot be enforced in GLM's tool format"
        ));
    }
    let literals = |v: &Value| -> Result<String, String> {
        let items: Vec<String> = match v {
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().map(lark_string).ok_or("non-string enum value"))
                .collect::<Result<_, _>>()?,
            Value::String(s) => vec![lark_string(s)],
            _ => return Err("bad enum/const".into()),
        };
        if items.is_empty() {
            return Err("empty enum".into());
        }
        Ok(format!("({})", items.join(" | ")))
    };
    if let Some(c) = o.get("const") {
        return literals(c);
    }
    if let Some(e) = o.get("enum") {
        return literals(e);
    }
    let min = o.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    let max = o.get("maxLength").and_then(Value::as_u64);
    if max.is_some_and(|m| m < min) {
        return Err("maxLength below minLength".into());
    }
    // '<' would start a marker; values stay in plain text.
    Ok(match max {
        Some(m) => format!("/[^<]{{{min},{m}}}/"),
        None => format!("/[^<]{{{min},}}/"),
    })
}

fn lark_string(s: &str) -> String {
    // JSON string syntax is Lark's.
    Value::String(s.to_string()).to_string()
}

/// End (exclusive) of the JSON value at `i` of `s` (leading blanks skipped). Only the syntax is
/// checked, so numbers of any magnitude pass (serde_json refuses those beyond f64, which a
/// grammar-conforming answer may still contain); the arguments are passed on as written.
fn json_end(s: &[u8], mut i: usize, depth: usize) -> Option<usize> {
    let ws = |s: &[u8], mut i: usize| {
        while s.get(i).is_some_and(|c| b" \t\r\n".contains(c)) {
            i += 1;
        }
        i
    };
    i = ws(s, i);
    if depth > 256 {
        return None;
    }
    match *s.get(i)? {
        b'"' => {
            i += 1;
            loop {
                match *s.get(i)? {
                    b'"' => return Some(i + 1),
                    b'\\' => i += 2,
                    c if c < 0x20 => return None,
                    _ => i += 1,
                }
            }
        }
        open @ (b'{' | b'[') => {
            let close = if open == b'{' { b'}' } else { b']' };
            i = ws(s, i + 1);
            if s.get(i) == Some(&close) {
                return Some(i + 1);
            }
            loop {
                if open == b'{' {
                    if s.get(ws(s, i)) != Some(&b'"') {
                        return None;
                    }
                    i = ws(s, json_end(s, i, depth + 1)?);
                    if s.get(i) != Some(&b':') {
                        return None;
                    }
                    i += 1;
                }
                i = ws(s, json_end(s, i, depth + 1)?);
                match *s.get(i)? {
                    b',' => i += 1,
                    c if c == close => return Some(i + 1),
                    _ => return None,
                }
            }
        }
        b't' | b'f' | b'n' => ["true", "false", "null"]
            .iter()
            .find(|w| s[i..].starts_with(w.as_bytes()))
            .map(|w| i + w.len()),
        b'-' | b'0'..=b'9' => {
            let start = i;
            i += usize::from(s[i] == b'-');
            let int = i;
            while s.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            if i == int || (s[int] == b'0' && i > int + 1) {
                return None;
            }
            if s.get(i) == Some(&b'.') {
                i += 1;
                let f = i;
                while s.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
                if i == f {
                    return None;
                }
            }
            if s.get(i).is_some_and(|c| *c == b'e' || *c == b'E') {
                i += 1;
                if s.get(i).is_some_and(|c| *c == b'+' || *c == b'-') {
                    i += 1;
                }
                let e = i;
                while s.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
                if i == e {
                    return None;
                }
            }
            (i > start).then_some(i)
        }
        _ => None,
    }
}

/// `text` is exactly one JSON value (blanks around allowed).
fn is_json(text: &str) -> bool {
    let b = text.as_bytes();
    json_end(b, 0, 0).is_some_and(|e| b[e..].iter().all(|c| b" \t\r\n".contains(c)))
}

/// `{"name": ..., "arguments": {...}}` (or `"parameters"`, or the arguments as JSON text); the
/// arguments come back as the model wrote them.
fn parse_json_call(body: &str) -> Option<(String, String)> {
    let t = body.trim();
    if !t.starts_with('{') || !is_json(t) {
        return None;
    }
    let s = t.as_bytes();
    let (mut name, mut args) = (None, None);
    let mut i = 1;
    loop {
        while s.get(i).is_some_and(|c| b" \t\r\n,".contains(c)) {
            i += 1;
        }
        if s.get(i) == Some(&b'}') {
            break;
        }
        let key_end = json_end(s, i, 0)?;
        let key: String = serde_json::from_str(&t[i..key_end]).ok()?;
        let colon = t[key_end..].find(':')? + key_end;
        let v_end = json_end(s, colon + 1, 0)?;
        let raw = t[colon + 1..v_end].trim();
        match key.as_str() {
            "name" => name = Some(serde_json::from_str::<String>(raw).ok()?),
            "arguments" | "parameters" => {
                let a = if raw.starts_with('"') {
                    serde_json::from_str::<String>(raw).ok()?
                } else {
                    raw.to_string()
                };
                if !a.trim_start().starts_with('{') || !is_json(&a) {
                    return None;
                }
                args = Some(a.trim().to_string());
            }
            _ => {}
        }
        i = v_end;
    }
    Some((name?, args.unwrap_or_else(|| "{}".into())))
}

fn parse_glm_call(body: &str, tools: &[ToolDef]) -> Option<(String, String)> {
    let name_end = body.find(KEY_OPEN).unwrap_or(body.len());
    let name = body[..name_end].trim().to_string();
    if name.is_empty() || name.contains(['<', '>', '\n']) {
        return None;
    }
    let tool = tools.iter().find(|t| t.name == name);
    let mut args = String::from("{");
    let mut rest = &body[name_end..];
    while let Some(k) = rest.find(KEY_OPEN) {
        let after_k = &rest[k + KEY_OPEN.len()..];
        let ke = after_k.find(KEY_CLOSE)?;
        let key = after_k[..ke].trim();
        let after_key = &after_k[ke + KEY_CLOSE.len()..];
        let vs = after_key.find(VALUE_OPEN)?;
        if !after_key[..vs].trim().is_empty() {
            return None;
        }
        let after_v = &after_key[vs + VALUE_OPEN.len()..];
        let ve = after_v.find(VALUE_CLOSE)?;
        let raw = &after_v[..ve];
        if args.len() > 1 {
            args.push_str(", ");
        }
        args.push_str(&lark_string(key));
        args.push_str(": ");
        // Plain string parameters are written raw; anything else is JSON when it parses.
        if tool.is_none_or(|t| !t.is_string_param(key)) && is_json(raw) {
            args.push_str(raw.trim());
        } else {
            args.push_str(&lark_string(raw));
        }
        rest = &after_v[ve + VALUE_CLOSE.len()..];
    }
    if !rest.trim().is_empty() {
        return None;
    }
    args.push('}');
    Some((name, args))
}

/// What [`ToolParser`] makes of the model's content text.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolOut {
    Text(String),
    Call { name: String, arguments: String },
}

/// Splits streamed content into text and calls. Text that could be the start of a call marker
/// is held back until it is known not to be one; a call is reported when it closes. A call
/// that does not parse is given back as text, so nothing the model wrote is lost.
#[derive(Debug)]
pub struct ToolParser {
    format: ToolFormat,
    tools: Vec<ToolDef>,
    buf: String,
    in_call: bool,
    /// Calls reported so far; with `single`, text after the first call is dropped.
    pub calls: usize,
    single: bool,
}

impl ToolParser {
    pub fn new(format: ToolFormat, tools: Vec<ToolDef>, single: bool) -> Self {
        ToolParser {
            format,
            tools,
            buf: String::new(),
            in_call: false,
            calls: 0,
            single,
        }
    }

    /// Whether more output is wanted (after the one allowed call, it is not).
    pub fn done(&self) -> bool {
        self.single && self.calls > 0
    }

    pub fn push(&mut self, text: &str, out: &mut Vec<ToolOut>) {
        if self.done() {
            return;
        }
        self.buf.push_str(text);
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(CALL_CLOSE) else {
                    return;
                };
                let body: String = self.buf[..end].to_string();
                self.buf.drain(..end + CALL_CLOSE.len());
                self.in_call = false;
                self.emit_call(&body, out);
                if self.done() {
                    self.buf.clear();
                    return;
                }
            } else if let Some(start) = self.buf.find(CALL_OPEN) {
                if start > 0 {
                    out.push(ToolOut::Text(self.buf[..start].to_string()));
                }
                self.buf.drain(..start + CALL_OPEN.len());
                self.in_call = true;
            } else {
                let keep = partial_suffix(&self.buf, CALL_OPEN);
                let cut = self.buf.len() - keep;
                if cut > 0 {
                    out.push(ToolOut::Text(self.buf[..cut].to_string()));
                    self.buf.drain(..cut);
                }
                return;
            }
        }
    }

    /// End of output. `complete`: the model ended it (not the token budget), so an unclosed
    /// call at the very end is still parsed.
    pub fn finish(&mut self, complete: bool, out: &mut Vec<ToolOut>) {
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            if complete {
                self.emit_call(&rest, out);
            } else {
                out.push(ToolOut::Text(format!("{CALL_OPEN}{rest}")));
            }
        } else if !rest.is_empty() {
            out.push(ToolOut::Text(rest));
        }
    }

    fn emit_call(&mut self, body: &str, out: &mut Vec<ToolOut>) {
        let parsed = match self.format {
            ToolFormat::Glm => parse_glm_call(body, &self.tools).or_else(|| parse_json_call(body)),
            ToolFormat::Hermes | ToolFormat::Generic => parse_json_call(body),
        };
        match parsed {
            Some((name, arguments)) => {
                self.calls += 1;
                out.push(ToolOut::Call { name, arguments });
            }
            None => out.push(ToolOut::Text(format!("{CALL_OPEN}{body}{CALL_CLOSE}"))),
        }
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> ToolDef {
        ToolDef {
            name: "get_weather".into(),
            description: Some("Weather forecast".into()),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"]}),
        }
    }

    fn parse_all(format: ToolFormat, chunks: &[&str], complete: bool) -> Vec<ToolOut> {
        let mut p = ToolParser::new(format, vec![weather()], false);
        let mut out = Vec::new();
        for c in chunks {
            p.push(c, &mut out);
        }
        p.finish(complete, &mut out);
        // Adjacent text pieces merged, so the test does not depend on chunking; arguments
        // compared as JSON values.
        let mut merged: Vec<ToolOut> = Vec::new();
        for o in out {
            let o = match o {
                ToolOut::Call { name, arguments } => ToolOut::Call {
                    name,
                    arguments: serde_json::from_str::<Value>(&arguments)
                        .unwrap()
                        .to_string(),
                },
                t => t,
            };
            match (merged.last_mut(), o) {
                (Some(ToolOut::Text(a)), ToolOut::Text(b)) => a.push_str(&b),
                (_, o) => merged.push(o),
            }
        }
        merged
    }

    fn call(name: &str, args: Value) -> ToolOut {
        ToolOut::Call {
            name: name.into(),
            arguments: args.to_string(),
        }
    }

    #[test]
    fn glm_calls_parse_in_every_chunking() {
        // GLM-4.5's layout (newlines) and GLM-4.7/5's (none); values typed by the schema:
        // "city" is a string (kept raw, even "007"), "days" an integer (JSON).
        let outputs = [
            "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>007</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
            "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>007</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
        ];
        for text in outputs {
            let want = vec![
                ToolOut::Text("Let me check.".into()),
                call("get_weather", json!({"city": "007", "days": 3})),
            ];
            for n in 1..text.len() {
                let chunks: Vec<&str> = {
                    let mut v = Vec::new();
                    let mut i = 0;
                    while i < text.len() {
                        let mut j = (i + n).min(text.len());
                        while !text.is_char_boundary(j) {
                            j += 1;
                        }
                        v.push(&text[i..j]);
                        i = j;
                    }
                    v
                };
                assert_eq!(
                    parse_all(ToolFormat::Glm, &chunks, true),
                    want,
                    "chunk size {n}"
                );
            }
        }
    }

    #[test]
    fn json_calls_and_parallel_calls() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}</tool_call>";
        assert_eq!(
            parse_all(ToolFormat::Hermes, &[text], true),
            vec![
                call("get_weather", json!({"city": "Paris"})),
                ToolOut::Text("\n".into()),
                call("get_weather", json!({"city": "Rome"})),
            ]
        );
    }

    #[test]
    fn broken_or_cut_calls_come_back_as_text() {
        let broken = "a <tool_call>{not json}</tool_call> b";
        assert_eq!(
            parse_all(ToolFormat::Generic, &[broken], true),
            vec![ToolOut::Text(broken.into())]
        );
        let cut = "x <tool_call>{\"name\": \"get_weather\", \"argu";
        assert_eq!(
            parse_all(ToolFormat::Generic, &[cut], false),
            vec![ToolOut::Text(cut.into())]
        );
        // The model ended its answer inside an unclosed call: still a call.
        let unclosed = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>";
        assert_eq!(
            parse_all(ToolFormat::Glm, &[unclosed], true),
            vec![call("get_weather", json!({"city": "Oslo"}))]
        );
        // A lone '<' that is not a marker is released at the end.
        assert_eq!(
            parse_all(ToolFormat::Glm, &["1 <", "tool"], true),
            vec![ToolOut::Text("1 <tool".into())]
        );
    }

    #[test]
    fn single_call_mode_stops_after_the_first() {
        let mut p = ToolParser::new(ToolFormat::Generic, vec![weather()], true);
        let mut out = Vec::new();
        p.push(
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call> and more",
            &mut out,
        );
        p.finish(true, &mut out);
        assert_eq!(out, vec![call("get_weather", json!({}))]);
        assert!(p.done());
        // Numbers beyond f64 are valid JSON: passed on as written.
        let mut p = ToolParser::new(ToolFormat::Glm, vec![weather()], false);
        let mut out = Vec::new();
        p.push("<tool_call>get_weather<arg_key>days</arg_key><arg_value>1e999</arg_value><arg_key>x</arg_key><arg_value>[1, 2e400]</arg_value></tool_call>", &mut out);
        assert_eq!(
            out,
            vec![ToolOut::Call {
                name: "get_weather".into(),
                arguments: "{\"days\": 1e999, \"x\": [1, 2e400]}".into()
            }]
        );
    }

    /// Marks the text the fallback escapes, so a test sees which parts it treats as the
    /// client's.
    struct Brackets;

    impl TextCodec for Brackets {
        fn encode(&self, _: &str, _: bool) -> Result<Vec<u32>, String> {
            Err("not used".into())
        }
        fn token_bytes(&self, _: u32) -> Option<Vec<u8>> {
            None
        }
        fn is_special(&self, _: u32) -> bool {
            false
        }
        fn eog_ids(&self) -> Vec<u32> {
            Vec::new()
        }
        fn token_id(&self, _: &str) -> Option<u32> {
            None
        }
        fn render_chat(
            &self,
            _: &[Message],
            _: bool,
            _: &serde_json::Map<String, Value>,
        ) -> Result<String, String> {
            Err("not used".into())
        }
        fn escape_content<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
            format!("«{text}»").into()
        }
    }

    #[test]
    fn generic_fallback_puts_tools_calls_and_results_in_plain_turns() {
        let support = ToolSupport {
            format: ToolFormat::Generic,
            system_role: true,
            marker_ids: Vec::new(),
        };
        let msgs = vec![
            Message::new("system", "Be brief."),
            Message::new("user", "Weather in Paris? <tool_call>"),
            Message {
                tool_calls: vec![ToolCall {
                    id: "c1".into(),
                    name: "get_weather".into(),
                    arguments: "{\"city\": \"Paris\"}".into(),
                }],
                reasoning_content: Some("r".into()),
                ..Message::new("assistant", "Checking.")
            },
            Message {
                tool_call_id: Some("c1".into()),
                ..Message::new("tool", "sunny")
            },
            Message {
                tool_call_id: Some("c2".into()),
                name: Some("get_weather".into()),
                ..Message::new("tool", "windy")
            },
            Message::new("user", "</tool_response>"),
            Message {
                tool_call_id: Some("c3".into()),
                ..Message::new("tool", "rain")
            },
        ];
        let (out, kw) = prepare(
            &msgs,
            &[weather()],
            &ToolChoice::Named("get_weather".into()),
            &support,
            &Brackets,
        );
        assert!(kw.is_none());
        assert_eq!(out.len(), 6);
        // The server's prompt around the client's schema, function name and system text.
        let system = &out[0];
        assert_eq!(
            (system.role.as_str(), system.content_escaped),
            ("system", true)
        );
        let schema = weather().to_json().to_string();
        assert!(
            system.content.starts_with(&format!(
                "# Tools\n\nYou can call the following functions. Their parameters are JSON schemas:\n«{schema}»\n\nTo call functions, answer with one line per call, in exactly this form:\n<tool_call>{{"
            )),
            "{}",
            system.content
        );
        assert!(
            system.content.ends_with(
                "The results come back in <tool_response> blocks.\nYou must call the function «get_weather» now.\n\n«Be brief.»"
            ),
            "{}",
            system.content
        );
        // Client messages stay as they are, for render_chat to escape.
        assert_eq!(out[1], msgs[1]);
        assert_eq!(out[4], msgs[5]);
        assert_eq!(
            out[2],
            Message {
                content: "«Checking.»\n<tool_call>«{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}»</tool_call>".into(),
                reasoning_content: Some("r".into()),
                content_escaped: true,
                ..Message::new("assistant", "")
            }
        );
        // One user turn per round of results; a client message ending like a result block
        // does not take the next result.
        assert_eq!(
            out[3],
            Message {
                content_escaped: true,
                ..Message::new(
                    "user",
                    "<tool_response>\n«{\"tool_call_id\":\"c1\"}»\n«sunny»\n</tool_response>\n<tool_response>\n«{\"name\":\"get_weather\",\"tool_call_id\":\"c2\"}»\n«windy»\n</tool_response>"
                )
            }
        );
        assert_eq!(
            out[5].content,
            "<tool_response>\n«{\"tool_call_id\":\"c3\"}»\n«rain»\n</tool_response>"
        );
        // tool_choice none: no tools offered, the history still reaches the model.
        let (out, _) = prepare(&msgs, &[weather()], &ToolChoice::None, &support, &Brackets);
        assert_eq!(out[0], msgs[0]);
        assert_eq!(out.len(), 6);
    }

    #[test]
    fn json_syntax_check() {
        for ok in [
            "{}",
            " [1, -0.5e+7, \"a\\\"b\", {\"k\": null}] ",
            "true",
            "-0",
            "12e999",
        ] {
            assert!(is_json(ok), "{ok}");
        }
        for bad in [
            "{",
            "[1,]",
            "01",
            "1.",
            "\"a",
            "{\"a\" 1}",
            "tru",
            "1 2",
            "{1: 2}",
            "\"\n\"",
        ] {
            assert!(!is_json(bad), "{bad}");
        }
    }

    #[test]
    fn glm_value_grammars() {
        assert_eq!(
            glm_value(&json!({"type": "string", "maxLength": 16})).unwrap(),
            "/[^<]{0,16}/"
        );
        assert_eq!(
            glm_value(&json!({"type": "string", "enum": ["a", "b\""]})).unwrap(),
            "(\"a\" | \"b\\\"\")"
        );
        assert!(glm_value(&json!({"type": "string", "pattern": "^a"})).is_err());
        assert!(glm_value(&json!({"type": "integer", "minimum": 1}))
            .unwrap()
            .starts_with("%json {"));
    }
}
