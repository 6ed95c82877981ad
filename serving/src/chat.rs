//! Chat templates: the model's own Jinja template (`tokenizer.chat_template` in the GGUF)
//! rendered with minijinja set up like transformers' `apply_chat_template` environment, so the
//! prompt text is what the model was trained on.
//!
//! Compatibility with jinja2 as transformers configures it: `trim_blocks` and `lstrip_blocks` on,
//! a trailing newline of the template dropped, `{% break %}`/`{% continue %}`, Python string,
//! dict and list methods (`minijinja-contrib` pycompat), `raise_exception(msg)`,
//! `strftime_now(fmt)`, transformers' `tojson` (plain `json.dumps`: `", "`/`": "` separators,
//! non-ASCII kept, no HTML escaping), and Python's printing of `None`, `True`, lists and dicts.
//! Variables: `messages`, `add_generation_prompt`, `tools` and `documents` (none unless given),
//! `bos_token`/`eos_token` (texts of the GGUF's BOS/EOS ids), plus caller kwargs such as
//! `enable_thinking`.
//! Not supported: transformers' `{% generation %}` tag (assistant-mask bookkeeping).
//!
//! Templates come from files users download, so rendering is bounded ([`ChatLimits`]): a fuel
//! limit on executed instructions (loops) and a cap on the output size, both reported as a
//! [`ServingError::Template`] for that one render instead of exhausting the process. minijinja
//! itself caps `range()` at 100,000 items and string repetition at 100 MB. Not bounded: memory
//! a template builds up without output, such as a string doubled in a loop of a few dozen
//! iterations (each concatenation is one instruction).
//!
//! With a content escaper ([`ChatTemplate::set_content_escaper`], the tokenizer's
//! `escape_control_text`), every string the caller supplies (messages, tools, kwargs) has its
//! control-token text neutralized before the template sees it, so the rendered prompt carries
//! control tokens only where the template text wrote them (see `Tokenizer::encode_chat`) — or
//! where the caller wrote them on purpose in a message it marks as escaped by itself
//! ([`ChatTemplate::render_json_with_escaped_content`]: the server's generic tool prompt).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};
use serde::{Deserialize, Serialize};

use crate::ServingError;
use std::sync::Arc;

const TEMPLATE_KEY: &str = "tokenizer.chat_template";
const NAME: &str = "chat_template";

/// Bounds of one render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatLimits {
    /// Template instructions one render may execute. A conversation of a thousand messages
    /// through a tool-aware template takes well under a million.
    pub fuel: u64,
    /// Largest rendered prompt in bytes. A prompt far beyond what any context holds is refused
    /// here, before it is tokenized.
    pub max_output_bytes: usize,
}

impl Default for ChatLimits {
    fn default() -> Self {
        ChatLimits {
            fuel: 20_000_000,
            max_output_bytes: 32 << 20,
        }
    }
}

/// Neutralizes special-token text in caller-supplied strings; `None` = unchanged.
pub type ContentEscaper = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    limits: ChatLimits,
    escaper: Option<ContentEscaper>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn template_err(what: &str, e: Error) -> ServingError {
    ServingError::Template(format!("{what}: {e}"))
}

impl ChatTemplate {
    /// The default template of a GGUF (`tokenizer.chat_template`). A model without one gives
    /// `ServingError::Template`, so callers can fall back (e.g. refuse chat, allow completions).
    pub fn from_gguf(meta: &gguf::Metadata) -> Result<Self, ServingError> {
        Self::from_gguf_key(meta, TEMPLATE_KEY)
    }

    /// A named template (`tokenizer.chat_template.<name>`, e.g. "tool_use").
    pub fn from_gguf_named(meta: &gguf::Metadata, name: &str) -> Result<Self, ServingError> {
        Self::from_gguf_key(meta, &format!("{TEMPLATE_KEY}.{name}"))
    }

    fn from_gguf_key(meta: &gguf::Metadata, key: &str) -> Result<Self, ServingError> {
        let source = match meta.get(key) {
            None => return Err(ServingError::Template(format!("the GGUF has no {key}"))),
            Some(v) => v.as_str().ok_or_else(|| {
                ServingError::Template(format!("{key} is a {}, not a string", v.value_type()))
            })?,
        };
        let token_text = |id_key: &str| -> Option<String> {
            let id = meta.get(id_key)?.as_u64()?;
            let tokens = meta.get("tokenizer.ggml.tokens")?.as_array()?;
            let idx = usize::try_from(id).ok()?;
            tokens.values.get(idx)?.as_str().map(str::to_string)
        };
        Self::new(
            source,
            token_text("tokenizer.ggml.bos_token_id"),
            token_text("tokenizer.ggml.eos_token_id"),
        )
    }

    /// Compiles `source`; syntax errors are reported here, not at render time.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ServingError> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.clone())
            .map_err(|e| template_err("cannot compile the chat template", e))?;
        let limits = ChatLimits::default();
        env.set_fuel(Some(limits.fuel));
        Ok(Self {
            env,
            source,
            bos_token,
            eos_token,
            limits,
            escaper: None,
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The top-level variables the template reads (`messages`, `tools`, `enable_thinking`, ...).
    pub fn variables(&self) -> std::collections::BTreeSet<String> {
        self.env
            .get_template(NAME)
            .map(|t| t.undeclared_variables(false).into_iter().collect())
            .unwrap_or_default()
    }

    pub fn limits(&self) -> ChatLimits {
        self.limits
    }

    /// Change the render bounds (tests; servers with unusual contexts).
    pub fn set_limits(&mut self, limits: ChatLimits) {
        self.limits = limits;
        self.env.set_fuel(Some(limits.fuel));
    }

    /// Neutralize special-token text in every caller-supplied string before rendering.
    pub fn set_content_escaper(&mut self, escaper: ContentEscaper) {
        self.escaper = Some(escaper);
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's reply
    /// begins.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ServingError> {
        let messages =
            serde_json::to_value(messages).map_err(|e| ServingError::Template(e.to_string()))?;
        self.render_json(&messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Renders arbitrary JSON messages (tool calls, content parts) with extra template variables
    /// (`tools`, `enable_thinking`, ...), which override the defaults (`add_generation_prompt`,
    /// `tools`, `documents`) but not `messages`, `bos_token` or `eos_token`.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ServingError> {
        self.render_json_with_escaped_content(messages.clone(), &[], add_generation_prompt, kwargs)
    }

    /// [`render_json`](Self::render_json) for a conversation in which the caller wrote some
    /// messages' `content` itself, with markup of its own (the server's generic tool prompt
    /// writes `<tool_call>` markers that must stay control tokens) around client text it has
    /// already escaped with the same escaper. `content_escaped[i]`: the `content` of message `i`
    /// reaches the template unchanged; every other string, those messages' other fields
    /// included, is escaped as usual. Missing entries count as `false`.
    pub fn render_json_with_escaped_content(
        &self,
        mut messages: serde_json::Value,
        content_escaped: &[bool],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ServingError> {
        if let Some(esc) = &self.escaper {
            match messages.as_array_mut() {
                Some(list) => {
                    for (i, m) in list.iter_mut().enumerate() {
                        match m.as_object_mut() {
                            Some(o) if content_escaped.get(i) == Some(&true) => o
                                .iter_mut()
                                .filter(|(k, _)| k.as_str() != "content")
                                .for_each(|(_, v)| escape_strings(v, esc.as_ref())),
                            _ => escape_strings(m, esc.as_ref()),
                        }
                    }
                }
                None => escape_strings(&mut messages, esc.as_ref()),
            }
        }
        let mut ctx = serde_json::Map::new();
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        // transformers always passes these two, as None when absent.
        ctx.insert("tools".into(), serde_json::Value::Null);
        ctx.insert("documents".into(), serde_json::Value::Null);
        for (k, v) in kwargs {
            let mut v = v.clone();
            if let Some(esc) = &self.escaper {
                escape_strings(&mut v, esc.as_ref());
            }
            ctx.insert(k.clone(), v);
        }
        // The BOS/EOS texts are the template's own, not the caller's: never escaped, and not
        // replaceable by a kwarg of the same name (which would then be unescaped text).
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), b.clone().into());
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), e.clone().into());
        }
        ctx.insert("messages".into(), messages);
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| template_err("chat template", e))?;
        let mut out = CappedOutput {
            buf: Vec::new(),
            cap: self.limits.max_output_bytes,
            exceeded: false,
        };
        match tmpl.render_captured_to(Value::from_serialize(&ctx), &mut out) {
            Ok(_) => String::from_utf8(out.buf)
                .map_err(|_| ServingError::Template("the rendered prompt is not UTF-8".into())),
            Err(_) if out.exceeded => Err(ServingError::Template(format!(
                "the rendered prompt exceeds {} bytes; refusing it",
                self.limits.max_output_bytes
            ))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(ServingError::Template(format!(
                "rendering needs more than {} template instructions; refusing it (a runaway loop in the template?)",
                self.limits.fuel
            ))),
            Err(e) => Err(template_err("rendering the chat template failed", e)),
        }
    }
}

/// Apply `esc` to every string inside `v` (object keys are left alone: they name fields).
fn escape_strings(v: &mut serde_json::Value, esc: &(dyn Fn(&str) -> Option<String> + Send + Sync)) {
    match v {
        serde_json::Value::String(s) => {
            if let Some(e) = esc(s) {
                *s = e;
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(|x| escape_strings(x, esc)),
        serde_json::Value::Object(o) => o.values_mut().for_each(|x| escape_strings(x, esc)),
        _ => {}
    }
}

/// The render's output, refusing to grow past `cap` bytes (the render then stops with an error).
struct CappedOutput {
    buf: Vec<u8>,
    cap: usize,
    exceeded: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.cap {
            self.exceeded = true;
            return Err(std::io::Error::other("output cap"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Prints values the way jinja2 does (Python `str()`): `None`, `True`, `['a', 1]`, `{'k': 'v'}`.
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(value, &mut s)?;
            out.write_str(&s).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn py_repr(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&py_number(value, false)?),
        ValueKind::String => py_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out)?;
                out.push_str(": ");
                py_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// Python `repr(str)`: single quotes unless the text has a single quote and no double quote.
fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// A number as Python prints it (`repr`), or as `json.dumps` writes it (`json`: NaN/Infinity).
fn py_number(value: &Value, json: bool) -> Result<String, Error> {
    if value.is_integer() {
        return Ok(value.to_string());
    }
    let x = f64::try_from(value.clone())?;
    Ok(py_float(x, json))
}

/// Python's shortest round-trip float repr: positional for exponents -4..16, else `d.ddde+XX`.
fn py_float(x: f64, json: bool) -> String {
    if x.is_nan() {
        return if json { "NaN" } else { "nan" }.into();
    }
    if x.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if x < 0.0 { format!("-{s}") } else { s.into() };
    }
    // Rust's `{:e}` gives the same shortest round-trip digits Python's repr uses.
    let sci = format!("{:e}", x.abs());
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    let body = if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                format!("{digits}{}.0", "0".repeat(int_len - digits.len()))
            } else {
                format!("{}.{}", &digits[..int_len], &digits[int_len..])
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let m = if digits.len() == 1 {
            digits.clone()
        } else {
            format!("{}.{}", &digits[..1], &digits[1..])
        };
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    };
    format!("{sign}{body}")
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// i.e. Python's `json.dumps` with those arguments.
fn tojson(value: Value, ensure_ascii: Option<bool>, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = match kwargs.get::<Option<bool>>("ensure_ascii")? {
        Some(v) => v,
        None => ensure_ascii.unwrap_or(false),
    };
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.is_integer() => Some(" ".repeat(v.as_usize().unwrap_or(0))),
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                ))
            }
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let opts = JsonOpts {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    json_dump(&value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn json_newline(opts: &JsonOpts, level: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn json_dump(value: &Value, opts: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&py_number(value, true)?),
        ValueKind::String => json_str(value.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                json_newline(opts, level + 1, out);
                json_dump(item, opts, level + 1, out)?;
            }
            json_newline(opts, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                json_newline(opts, level + 1, out);
                // JSON keys are strings; Python converts numbers, booleans and None.
                let k = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
                    _ => py_number(key, true).unwrap_or_else(|_| key.to_string()),
                };
                json_str(&k, opts.ensure_ascii, out);
                out.push_str(&opts.key_sep);
                json_dump(&value.get_item(key)?, opts, level + 1, out)?;
            }
            json_newline(opts, level, out);
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::UndefinedError,
                "tojson of an undefined value",
            ));
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {kind}"),
            ));
        }
    }
    Ok(())
}

/// Python `json.dumps` string escaping (lowercase `\uXXXX`, surrogate pairs when ASCII-only).
fn json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// transformers' `strftime_now(format)`: the current time, here in UTC (a server has no useful
/// local zone). Supports the directives chat templates use.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Proleptic Gregorian (year, month 1-12, day 1-31) from days since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, usize, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as usize, d)
}

fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (sod / 3600, sod % 3600 / 60, sod % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let wd = (days + 3).rem_euclid(7) as usize;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", if hh % 12 == 0 { 12 } else { hh % 12 })),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('B') => out.push_str(MONTHS[m - 1]),
            Some('b') => out.push_str(&MONTHS[m - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[wd]),
            Some('a') => out.push_str(&WEEKDAYS[wd][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        // Expected strings are CPython's repr() of the same values.
        for (x, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-0.0, "-0.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.0, "123456789012345.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (0.1 + 0.2, "0.30000000000000004"),
            (2.5e-300, "2.5e-300"),
        ] {
            assert_eq!(py_float(x, false), want, "{x:e}");
        }
        assert_eq!(py_float(f64::NAN, true), "NaN");
        assert_eq!(py_float(f64::NEG_INFINITY, true), "-Infinity");
    }

    #[test]
    fn strftime_known_instant() {
        // 2024-02-29T13:05:09Z (a Thursday) = 1709211909 s since the epoch.
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %B %y %I%p %%", 1_709_211_909),
            "29 Feb 2024 13:05:09 Thursday February 24 01PM %"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
    }
}
