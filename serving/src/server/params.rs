//! Request bodies of the OpenAI endpoints, validated field by field.
//!
//! Bodies are read as `serde_json::Value` and every field is checked for type and range here,
//! so that each mistake gets its own 400 naming the field (CVE-2026-21869 came from a numeric
//! field nobody range-checked). No field is silently ignored: every field a request sends is
//! either implemented, accepted at a value where it has no effect (llama.cpp's sampler knobs at
//! their "off" value, see [`INERT`]), a harmless bookkeeping field from [`NO_OP_FIELDS`], or
//! refused with a 400 naming it. `null` counts as absent, as OpenAI treats it.

use super::error::ApiError;
use super::text::{Message, ToolCall};
use super::tools::{ToolChoice, ToolDef};
use crate::sampler::{self, SamplingParams};
use serde_json::{Map, Value};
use std::cell::RefCell;
use std::collections::BTreeSet;

/// Most stop strings per request, and the longest one (bytes).
pub const MAX_STOP: usize = 16;
pub const MAX_STOP_LEN: usize = 1024;
/// Most alternatives per token in logprobs.
pub const MAX_TOP_LOGPROBS: usize = 20;
pub const MAX_LOGIT_BIAS: usize = 1024;
pub const MAX_MESSAGES: usize = 65536;
pub const MAX_TEMPLATE_KWARGS: usize = 64;
/// Most choices per request (`n` times the number of prompts).
pub const MAX_CHOICES: usize = 128;
pub const MAX_TOOLS: usize = 256;
/// Most tokens in `stop_token_ids` / `allowed_token_ids`.
pub const MAX_TOKEN_LIST: usize = 65536;

/// Bookkeeping fields accepted and not acted on: they do not change the answer. `user`,
/// `store`, `metadata`, `service_tier`, `prompt_cache_key`, `safety_identifier` are OpenAI's;
/// `cache_prompt` and `id_slot` llama-server's (this server keeps no prompt cache, so reuse
/// could only change speed); `guided_decoding_backend` vLLM's (one grammar engine serves every
/// backend name, with the same meaning).
pub const NO_OP_FIELDS: [&str; 9] = [
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "cache_prompt",
    "id_slot",
    "guided_decoding_backend",
];

/// llama.cpp / vLLM sampler fields accepted only at the value where they do nothing (clients
/// such as llama.cpp's web UI send them all); any other value is refused. The `_tau`/`_eta`,
/// `xtc_threshold`, `dry_*` and `dynatemp_exponent` companions only act when their main knob is
/// on, and `n_keep`/`n_discard` only when the context is shifted, which this server never does
/// (a request that does not fit is refused).
pub const INERT: [(&str, &str); 20] = [
    ("mirostat", "0"),
    ("mirostat_tau", "any (mirostat is off)"),
    ("mirostat_eta", "any (mirostat is off)"),
    ("typical_p", "1"),
    ("tfs_z", "1"),
    ("top_n_sigma", "<= 0"),
    ("xtc_probability", "0"),
    ("xtc_threshold", "any (xtc is off)"),
    ("dry_multiplier", "0"),
    ("dry_base", "any (dry is off)"),
    ("dry_allowed_length", "any (dry is off)"),
    ("dry_penalty_last_n", "any (dry is off)"),
    ("dry_sequence_breakers", "any (dry is off)"),
    ("dynatemp_range", "0"),
    ("dynatemp_exponent", "any (dynatemp is off)"),
    ("min_keep", "0 or 1"),
    ("n_keep", "any"),
    ("n_discard", "any"),
    ("grammar_lazy", "false"),
    ("length_penalty", "1"),
];

/// A grammar the output must follow, and the field it came from (named in errors).
#[derive(Debug, Clone, PartialEq)]
pub struct ConstraintSpec {
    pub kind: ConstraintKind,
    pub field: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintKind {
    JsonSchema(Value),
    Gbnf(String),
    Lark(String),
    Regex(String),
    /// One of these strings exactly (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// Only these token ids (vLLM's `allowed_token_ids`).
    Tokens(Vec<u32>),
}

/// `repeat_last_n`: a window of tokens, or the whole context (llama.cpp's `-1`, and HF's
/// `repetition_penalty`, which looks at every previous token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepeatLen {
    Tokens(usize),
    Context,
}

/// Fields shared by `/v1/completions` and `/v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct Common {
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// vLLM's `include_stop_str_in_output`.
    pub include_stop: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub logit_bias: Vec<(u32, f32)>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: RepeatLen,
    /// vLLM's `min_tokens`: end-of-generation tokens are banned before this many tokens.
    pub min_tokens: usize,
    /// vLLM's `stop_token_ids`: more tokens that end the generation.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// llama-server's `n_probs`: top alternatives per token.
    pub n_probs: Option<usize>,
    /// Choices per prompt.
    pub n: usize,
    pub constraint: Option<ConstraintSpec>,
    /// vLLM's `skip_special_tokens: false`: control tokens are shown as text.
    pub show_special: bool,
}

impl Default for Common {
    /// What a request that sets nothing gets (OpenAI's defaults, llama.cpp's repeat window).
    fn default() -> Self {
        Common {
            max_tokens: None,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            include_stop: false,
            stream: false,
            include_usage: false,
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: RepeatLen::Tokens(64),
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            n_probs: None,
            n: 1,
            constraint: None,
            show_special: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub common: Common,
    /// One or more prompts (OpenAI accepts a list); each gets `n` choices.
    pub prompts: Vec<Prompt>,
    pub echo: bool,
    /// `logprobs: N`: the sampled token's logprob plus N alternatives.
    pub logprobs: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub common: Common,
    pub messages: Vec<Message>,
    /// `logprobs: true` with `top_logprobs: N` alternatives.
    pub logprobs: Option<usize>,
    pub add_generation_prompt: bool,
    /// Extra chat template variables (vLLM's `chat_template_kwargs`, `reasoning_effort`).
    pub template_kwargs: Map<String, Value>,
    pub tools: Vec<ToolDef>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
    /// The request used the legacy `functions` / `function_call` fields: answer in kind.
    pub legacy_functions: bool,
    /// GLM thinking control (`chat_template_kwargs.enable_thinking`, or `thinking.type`).
    pub enable_thinking: Option<bool>,
    /// llama-server's `reasoning_format: none`: thinking stays in the content.
    pub reasoning_inline: bool,
    /// Most tokens of thinking before `</think>` is forced (Anthropic's `budget_tokens`).
    pub thinking_budget: Option<usize>,
}

/// Typed access to a JSON object's optional fields; `null` counts as absent. Every field read
/// is remembered, so that [`Fields::finish`] can refuse the ones nobody read.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    seen: RefCell<BTreeSet<&'a str>>,
    /// Prefix of parameter names in errors (`stream_options.`).
    prefix: String,
}

impl<'a> Fields<'a> {
    /// The body as an object, or a 400.
    pub fn of(v: &'a Value) -> Result<Self, ApiError> {
        match v {
            Value::Object(m) => Ok(Fields::new(m, "")),
            _ => Err(ApiError::bad_request(
                "the request body must be a JSON object",
            )),
        }
    }

    pub fn new(map: &'a Map<String, Value>, prefix: &str) -> Self {
        Fields {
            map,
            seen: RefCell::new(BTreeSet::new()),
            prefix: prefix.to_string(),
        }
    }

    fn param(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn invalid(&self, name: &str, message: impl Into<String>) -> ApiError {
        ApiError::invalid(&self.param(name), message)
    }

    pub fn get(&self, name: &str) -> Option<&'a Value> {
        let (k, v) = self.map.get_key_value(name)?;
        self.seen.borrow_mut().insert(k.as_str());
        Some(v).filter(|v| !v.is_null())
    }

    pub fn number(&self, name: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let p = self.param(name);
        let x = v.as_f64().filter(|_| v.is_number()).ok_or_else(|| {
            self.invalid(name, format!("'{p}' must be a number, got {}", kind(v)))
        })?;
        if !(min..=max).contains(&x) {
            return Err(self.invalid(
                name,
                format!("'{p}' must be between {min} and {max}, got {x}"),
            ));
        }
        Ok(Some(x))
    }

    pub fn integer(&self, name: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let p = self.param(name);
        let x = integer_value(v).ok_or_else(|| {
            self.invalid(name, format!("'{p}' must be an integer, got {}", kind(v)))
        })?;
        if x < min as i128 || x > max as i128 {
            return Err(self.invalid(
                name,
                format!("'{p}' must be between {min} and {max}, got {x}"),
            ));
        }
        Ok(Some(x as i64))
    }

    pub fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.invalid(
                name,
                format!("'{}' must be a boolean, got {}", self.param(name), kind(v)),
            )),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.invalid(
                name,
                format!("'{}' must be a string, got {}", self.param(name), kind(v)),
            )),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<Fields<'a>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(Fields::new(o, &format!("{}.", self.param(name))))),
            Some(v) => Err(self.invalid(
                name,
                format!("'{}' must be an object, got {}", self.param(name), kind(v)),
            )),
        }
    }

    /// A field accepted only where it has no effect (`ok`), else refused.
    fn inert(&self, name: &str, ok: impl Fn(&Value) -> bool, effect: &str) -> Result<(), ApiError> {
        match self.get(name) {
            Some(v) if !ok(v) => Err(self.invalid(
                name,
                format!(
                    "'{}' is not supported by this server ({effect})",
                    self.param(name)
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Refuses every field that was not read, unless it is in `no_op`.
    pub fn finish(&self, no_op: &[&str]) -> Result<(), ApiError> {
        let seen = self.seen.borrow();
        for (k, v) in self.map {
            if v.is_null() || seen.contains(k.as_str()) || no_op.contains(&k.as_str()) {
                continue;
            }
            return Err(self.invalid(k, format!("unsupported field '{}'", self.param(k))));
        }
        Ok(())
    }
}

/// Integers, also written as floats with no fraction (`16.0`), as Python clients sometimes do.
/// i128 so that every u64 and i64 fits before the range check.
fn integer_value(v: &Value) -> Option<i128> {
    if let Some(i) = v.as_i64() {
        return Some(i as i128);
    }
    if let Some(u) = v.as_u64() {
        return Some(u as i128);
    }
    let f = v.as_f64()?;
    (f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e18).then_some(f as i128)
}

pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn num_is(v: &Value, pred: impl Fn(f64) -> bool) -> bool {
    v.as_f64().is_some_and(pred)
}

/// A field accepted only at the value that leaves sampling unchanged.
type Inert = (&'static str, fn(&Value) -> bool, &'static str);

/// llama.cpp/vLLM sampling fields this server does not implement: accepted at their "off"
/// value (clients send the defaults), refused otherwise.
const INERT_FIELDS: &[Inert] = &[
    (
        "mirostat",
        |v| num_is(v, |x| x == 0.0),
        "only mirostat 0 (off) is accepted",
    ),
    (
        "typical_p",
        |v| num_is(v, |x| x == 1.0),
        "only typical_p 1 (off) is accepted",
    ),
    (
        "tfs_z",
        |v| num_is(v, |x| x == 1.0),
        "only tfs_z 1 (off) is accepted",
    ),
    (
        "top_n_sigma",
        |v| num_is(v, |x| x <= 0.0),
        "only top_n_sigma <= 0 (off) is accepted",
    ),
    (
        "xtc_probability",
        |v| num_is(v, |x| x == 0.0),
        "only xtc_probability 0 (off) is accepted",
    ),
    (
        "dry_multiplier",
        |v| num_is(v, |x| x == 0.0),
        "only dry_multiplier 0 (off) is accepted",
    ),
    (
        "dynatemp_range",
        |v| num_is(v, |x| x == 0.0),
        "only dynatemp_range 0 (off) is accepted",
    ),
    (
        "min_keep",
        |v| num_is(v, |x| x == 0.0 || x == 1.0),
        "only min_keep 0 or 1 is accepted",
    ),
    (
        "length_penalty",
        |v| num_is(v, |x| x == 1.0),
        "beam search is not supported",
    ),
    (
        "grammar_lazy",
        |v| *v == Value::Bool(false),
        "lazy grammars are not supported",
    ),
    (
        "use_beam_search",
        |v| *v == Value::Bool(false),
        "beam search is not supported",
    ),
    (
        "spaces_between_special_tokens",
        |v| *v == Value::Bool(true),
        "only true is accepted",
    ),
    (
        "grammar_triggers",
        |v| v.as_array().is_some_and(Vec::is_empty),
        "lazy grammars are not supported",
    ),
    (
        "preserved_tokens",
        |v| v.as_array().is_some_and(Vec::is_empty),
        "lazy grammars are not supported",
    ),
    (
        "timings_per_token",
        |v| *v == Value::Bool(false),
        "per-token timings are not reported",
    ),
    (
        "t_max_predict_ms",
        |v| num_is(v, |x| x <= 0.0),
        "time limits are not supported",
    ),
    (
        "t_max_prompt_ms",
        |v| num_is(v, |x| x <= 0.0),
        "time limits are not supported",
    ),
    (
        "n_indent",
        |v| num_is(v, |x| x == 0.0),
        "only n_indent 0 is accepted",
    ),
];

/// Parameters of the inert samplers above: without their sampler they change nothing.
const INERT_COMPANIONS: &[&str] = &[
    "mirostat_tau",
    "mirostat_eta",
    "xtc_threshold",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "dynatemp_exponent",
    "n_keep",
    "n_discard",
];

fn refuse_inert_fields(f: &Fields<'_>) -> Result<(), ApiError> {
    for &(name, ok, effect) in INERT_FIELDS {
        f.inert(name, ok, effect)?;
    }
    for companion in INERT_COMPANIONS {
        f.inert(companion, |_| true, "")?;
    }
    if let Some(n) = f.integer("best_of", 1, 128)? {
        if n != 1 {
            return Err(f.invalid("best_of", "only best_of = 1 is supported"));
        }
    }
    Ok(())
}

fn parse_common(f: &Fields<'_>, min_max_tokens: i64, chat: bool) -> Result<Common, ApiError> {
    f.string("model")?;
    refuse_inert_fields(f)?;
    let max_tokens = match f.integer("max_completion_tokens", min_max_tokens, u32::MAX as i64)? {
        Some(n) => Some(n),
        None => f.integer("max_tokens", min_max_tokens, u32::MAX as i64)?,
    }
    .map(|n| n as usize);
    // llama-server's name for the same limit; -1 there means "no limit".
    let max_tokens = match (max_tokens, f.integer("n_predict", -1, u32::MAX as i64)?) {
        (Some(n), _) => Some(n),
        (None, Some(n)) if n >= 0 => Some(n as usize),
        _ => None,
    };
    // The ranges are the sampler's, shared with `generate` (SamplingParams::validate).
    let range = |r: sampler::SamplingRange| f.number(r.field, r.min, r.max);
    let temperature = range(sampler::TEMPERATURE)?.unwrap_or(1.0) as f32;
    let top_p = range(sampler::TOP_P)?.unwrap_or(1.0) as f32;
    let min_p = range(sampler::MIN_P)?.unwrap_or(0.0) as f32;
    let top_k = f.integer("top_k", -1, i32::MAX as i64)?.unwrap_or(0).max(0) as usize;
    // -1 asks for a random seed (llama-server); other values are taken bit for bit.
    let seed = match f.integer("seed", i64::MIN, i64::MAX)? {
        None | Some(-1) => None,
        Some(s) => Some(s as u64),
    };
    let n = f.integer("n", 1, MAX_CHOICES as i64)?.unwrap_or(1) as usize;
    let stop = parse_stop(f)?;
    let include_stop = f.boolean("include_stop_str_in_output")?.unwrap_or(false);
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        None => false,
        Some(o) => {
            let u = o.boolean("include_usage")?.unwrap_or(false);
            // Obfuscation padding only hides lengths on the wire; there is nothing to pad.
            o.boolean("include_obfuscation")?;
            o.finish(&[])?;
            u
        }
    };
    let presence_penalty = f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let frequency_penalty = f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let repeat = f.number("repeat_penalty", 0.01, 10.0)?;
    let repetition = f.number("repetition_penalty", 0.01, 10.0)?;
    let last_n = f.integer("repeat_last_n", -1, u32::MAX as i64)?;
    let (repeat_penalty, repeat_last_n) = match (repeat, repetition) {
        (Some(a), Some(b)) if a != 1.0 && b != 1.0 => {
            return Err(f.invalid(
                "repetition_penalty",
                "give either repeat_penalty (llama.cpp) or repetition_penalty (vLLM), not both",
            ))
        }
        // vLLM / transformers: every previous token, prompt included.
        (_, Some(b)) if b != 1.0 => (b as f32, RepeatLen::Context),
        (a, _) => (
            a.unwrap_or(1.0) as f32,
            match last_n {
                Some(-1) => RepeatLen::Context,
                Some(n) => RepeatLen::Tokens(n as usize),
                // llama.cpp's default window.
                None => RepeatLen::Tokens(64),
            },
        ),
    };
    let min_tokens = f.integer("min_tokens", 0, u32::MAX as i64)?.unwrap_or(0) as usize;
    let stop_token_ids = token_list(f, "stop_token_ids")?.unwrap_or_default();
    let logit_bias = parse_logit_bias(f)?;
    let ignore_eos = f.boolean("ignore_eos")?.unwrap_or(false);
    let n_probs = f
        .integer("n_probs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize);
    let show_special = !f.boolean("skip_special_tokens")?.unwrap_or(true);
    let constraint = parse_constraint(f, chat)?;
    Ok(Common {
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
        },
        stop,
        include_stop,
        stream,
        include_usage,
        logit_bias,
        presence_penalty,
        frequency_penalty,
        repeat_penalty,
        repeat_last_n,
        min_tokens,
        stop_token_ids,
        ignore_eos,
        n_probs,
        n,
        constraint,
        show_special,
    })
}

fn token_list(f: &Fields<'_>, name: &str) -> Result<Option<Vec<u32>>, ApiError> {
    let Some(v) = f.get(name) else {
        return Ok(None);
    };
    let bad = || f.invalid(name, format!("'{name}' must be an array of token ids"));
    let a = v.as_array().ok_or_else(bad)?;
    if a.len() > MAX_TOKEN_LIST {
        return Err(f.invalid(name, format!("at most {MAX_TOKEN_LIST} token ids")));
    }
    a.iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(bad)
        })
        .collect::<Result<Vec<u32>, _>>()
        .map(Some)
}

/// The one grammar of a request, from whichever field gives it. Two at once are refused.
fn parse_constraint(f: &Fields<'_>, chat: bool) -> Result<Option<ConstraintSpec>, ApiError> {
    let mut found: Vec<ConstraintSpec> = Vec::new();
    let mut add = |field: &str, kind: ConstraintKind| {
        found.push(ConstraintSpec {
            kind,
            field: field.to_string(),
        })
    };
    let schema = |field: &str, v: &Value| -> Result<Value, ApiError> {
        match v {
            Value::Object(_) | Value::Bool(true) => Ok(v.clone()),
            Value::String(s) => serde_json::from_str(s)
                .map_err(|e| f.invalid(field, format!("'{field}' is not valid JSON: {e}"))),
            _ => Err(f.invalid(field, format!("'{field}' must be a JSON schema object"))),
        }
    };
    if let Some(rf) = f.object("response_format")? {
        match rf.string("type")? {
            None | Some("text") => {}
            Some("json_object") => {
                // llama-server also takes a schema here.
                let s = match rf.get("schema") {
                    Some(s) => schema("response_format.schema", s)?,
                    None => serde_json::json!({"type": "object"}),
                };
                add("response_format", ConstraintKind::JsonSchema(s));
            }
            Some("json_schema") => {
                let js = rf.object("json_schema")?.ok_or_else(|| {
                    f.invalid("response_format", "response_format.json_schema is required")
                })?;
                js.string("name")?;
                js.string("description")?;
                // Strict or not, the output is constrained to the schema.
                js.boolean("strict")?;
                let s = js
                    .get("schema")
                    .map(|s| schema("response_format.json_schema.schema", s))
                    .transpose()?;
                js.finish(&[])?;
                add(
                    "response_format",
                    ConstraintKind::JsonSchema(s.unwrap_or(Value::Bool(true))),
                );
            }
            Some(t) => {
                return Err(f.invalid(
                    "response_format",
                    format!(
                        "response_format type {t:?} is not one of text, json_object, json_schema"
                    ),
                ))
            }
        }
        rf.finish(&[])?;
    }
    if let Some(g) = f.string("grammar")? {
        add("grammar", ConstraintKind::Gbnf(g.to_string()));
    }
    if let Some(v) = f.get("json_schema") {
        add(
            "json_schema",
            ConstraintKind::JsonSchema(schema("json_schema", v)?),
        );
    }
    if let Some(v) = f.get("guided_json") {
        add(
            "guided_json",
            ConstraintKind::JsonSchema(schema("guided_json", v)?),
        );
    }
    if let Some(r) = f.string("guided_regex")? {
        add("guided_regex", ConstraintKind::Regex(r.to_string()));
    }
    if let Some(v) = f.get("guided_choice") {
        add(
            "guided_choice",
            ConstraintKind::Choice(choices(f, "guided_choice", v)?),
        );
    }
    if let Some(g) = f.string("guided_grammar")? {
        add("guided_grammar", grammar_text(g));
    }
    if let Some(so) = f.object("structured_outputs")? {
        if let Some(v) = so.get("json") {
            add(
                "structured_outputs.json",
                ConstraintKind::JsonSchema(schema("structured_outputs.json", v)?),
            );
        }
        if let Some(r) = so.string("regex")? {
            add(
                "structured_outputs.regex",
                ConstraintKind::Regex(r.to_string()),
            );
        }
        if let Some(v) = so.get("choice") {
            add(
                "structured_outputs.choice",
                ConstraintKind::Choice(choices(f, "structured_outputs.choice", v)?),
            );
        }
        if let Some(g) = so.string("grammar")? {
            add("structured_outputs.grammar", grammar_text(g));
        }
        if so.boolean("json_object")? == Some(true) {
            add(
                "structured_outputs.json_object",
                ConstraintKind::JsonSchema(serde_json::json!({"type": "object"})),
            );
        }
        so.finish(&[])?;
    }
    if let Some(ids) = token_list(f, "allowed_token_ids")? {
        if ids.is_empty() {
            return Err(f.invalid("allowed_token_ids", "'allowed_token_ids' is empty"));
        }
        add("allowed_token_ids", ConstraintKind::Tokens(ids));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|c| c.field.as_str()).collect();
        return Err(f.invalid(
            &found[1].field,
            format!(
                "only one output constraint per request, got {}",
                names.join(" and ")
            ),
        ));
    }
    let _ = chat;
    Ok(found.pop())
}

/// vLLM's `guided_grammar` is EBNF/Lark or GBNF depending on the backend; `::=` tells GBNF.
fn grammar_text(g: &str) -> ConstraintKind {
    if g.contains("::=") {
        ConstraintKind::Gbnf(g.to_string())
    } else {
        ConstraintKind::Lark(g.to_string())
    }
}

fn choices(f: &Fields<'_>, field: &str, v: &Value) -> Result<Vec<String>, ApiError> {
    let bad = || {
        f.invalid(
            field,
            format!("'{field}' must be a non-empty array of strings"),
        )
    };
    let a = v.as_array().filter(|a| !a.is_empty()).ok_or_else(bad)?;
    a.iter()
        .map(|c| c.as_str().map(str::to_string).ok_or_else(bad))
        .collect()
}

fn parse_stop(f: &Fields<'_>) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Value> = match f.get("stop") {
        None => return Ok(Vec::new()),
        Some(v @ Value::String(_)) => vec![v],
        Some(Value::Array(a)) => a.iter().collect(),
        Some(v) => {
            return Err(f.invalid(
                "stop",
                format!(
                    "'stop' must be a string or an array of strings, got {}",
                    kind(v)
                ),
            ))
        }
    };
    stop_list(list.into_iter(), "stop")
}

/// Stop strings, bounded in number and length.
pub(crate) fn stop_list<'v>(
    list: impl ExactSizeIterator<Item = &'v Value>,
    field: &str,
) -> Result<Vec<String>, ApiError> {
    if list.len() > MAX_STOP {
        return Err(ApiError::invalid(
            field,
            format!(
                "at most {MAX_STOP} stop sequences are allowed, got {}",
                list.len()
            ),
        ));
    }
    list.map(|v| match v {
        Value::String(s) if s.is_empty() => {
            Err(ApiError::invalid(field, "stop sequences must not be empty"))
        }
        Value::String(s) if s.len() > MAX_STOP_LEN => Err(ApiError::invalid(
            field,
            format!("stop sequences are limited to {MAX_STOP_LEN} bytes"),
        )),
        Value::String(s) => Ok(s.clone()),
        v => Err(ApiError::invalid(
            field,
            format!("stop sequences must be strings, got {}", kind(v)),
        )),
    })
    .collect()
}

fn parse_logit_bias(f: &Fields<'_>) -> Result<Vec<(u32, f32)>, ApiError> {
    let m = match f.get("logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(f.invalid(
                "logit_bias",
                format!(
                    "'logit_bias' must be an object mapping token ids to numbers, got {}",
                    kind(v)
                ),
            ))
        }
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(f.invalid(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS} logit_bias entries are allowed"),
        ));
    }
    m.iter()
        .map(|(k, v)| {
            let id: u32 = k.parse().map_err(|_| {
                f.invalid(
                    "logit_bias",
                    format!("logit_bias key {k:?} is not a token id"),
                )
            })?;
            let b = v
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    f.invalid(
                        "logit_bias",
                        format!(
                            "logit_bias values must be numbers between -100 and 100 (token {k})"
                        ),
                    )
                })?;
            // OpenAI: -100 effectively bans the token.
            let b = if b <= -100.0 {
                f32::NEG_INFINITY
            } else {
                b as f32
            };
            Ok((id, b))
        })
        .collect()
}

pub fn parse_completion(body: &Value) -> Result<CompletionRequest, ApiError> {
    let f = Fields::of(body)?;
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(f.invalid("suffix", "'suffix' is not supported"));
    }
    let common = parse_common(&f, 0, false)?;
    let prompts = match f.get("prompt") {
        None => return Err(f.invalid("prompt", "'prompt' is required")),
        Some(v) => parse_prompts(v)?,
    };
    if prompts.len() * common.n > MAX_CHOICES {
        return Err(f.invalid(
            "n",
            format!("at most {MAX_CHOICES} choices per request (prompts x n)"),
        ));
    }
    let echo = f.boolean("echo")?.unwrap_or(false);
    let logprobs = f
        .integer("logprobs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize)
        .or(common.n_probs);
    f.finish(&NO_OP_FIELDS)?;
    Ok(CompletionRequest {
        common,
        prompts,
        echo,
        logprobs,
    })
}

/// A string, an array of token ids, or an array of those (several prompts).
fn parse_prompts(v: &Value) -> Result<Vec<Prompt>, ApiError> {
    match v {
        Value::Array(a) if a.is_empty() => Err(ApiError::invalid("prompt", "'prompt' is empty")),
        Value::Array(a) if a.iter().all(|x| x.is_string() || x.is_array()) => {
            if a.len() > MAX_CHOICES {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("at most {MAX_CHOICES} prompts per request"),
                ));
            }
            a.iter().map(parse_one_prompt).collect()
        }
        v => Ok(vec![parse_one_prompt(v)?]),
    }
}

fn parse_one_prompt(v: &Value) -> Result<Prompt, ApiError> {
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) if a.is_empty() => Err(ApiError::invalid("prompt", "'prompt' is empty")),
        Value::Array(a) if a.iter().all(Value::is_number) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        ApiError::invalid("prompt", format!("invalid token id {t} in 'prompt'"))
                    })
            })
            .collect::<Result<Vec<u32>, _>>()
            .map(Prompt::Tokens),
        _ => Err(ApiError::invalid(
            "prompt",
            "'prompt' must be a string, an array of token ids, or an array of those",
        )),
    }
}

pub fn parse_chat(body: &Value) -> Result<ChatRequest, ApiError> {
    let f = Fields::of(body)?;
    let r = parse_chat_fields(&f)?;
    f.finish(&NO_OP_FIELDS)?;
    Ok(r)
}

/// The chat fields of `f` (shared with `/apply-template` and vLLM's `/tokenize`, which read
/// the same conversation fields); the caller finishes `f`.
pub fn parse_chat_fields(f: &Fields<'_>) -> Result<ChatRequest, ApiError> {
    let common = parse_common(f, 1, true)?;
    let messages = match f.get("messages") {
        None => return Err(f.invalid("messages", "'messages' is required")),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(f.invalid(
                "messages",
                format!("'messages' must be an array of messages, got {}", kind(v)),
            ))
        }
    };
    if messages.is_empty() {
        return Err(f.invalid("messages", "'messages' must not be empty"));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(f.invalid(
            "messages",
            format!("at most {MAX_MESSAGES} messages are allowed"),
        ));
    }
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    if f.boolean("echo")? == Some(true) {
        return Err(f.invalid("echo", "'echo' is not supported for chat"));
    }
    if f.boolean("continue_final_message")? == Some(true) {
        return Err(f.invalid(
            "continue_final_message",
            "'continue_final_message' is not supported",
        ));
    }
    if let Some(m) = f.get("modalities") {
        let text_only = m
            .as_array()
            .is_some_and(|a| a.iter().all(|x| x.as_str() == Some("text")));
        if !text_only {
            return Err(f.invalid("modalities", "only the text modality is supported"));
        }
    }
    let logprobs_on = f.boolean("logprobs")?.unwrap_or(false);
    let top = f
        .integer("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize);
    let logprobs = match (logprobs_on, top.or(common.n_probs)) {
        (true, k) => Some(k.unwrap_or(0)),
        // `top_logprobs` without `logprobs: true` is an error at OpenAI; asking for
        // alternatives clearly means wanting logprobs, so honour it.
        (false, Some(k)) => Some(k),
        (false, None) => None,
    };
    let add_generation_prompt = f.boolean("add_generation_prompt")?.unwrap_or(true);
    let mut template_kwargs = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(m)) if m.len() <= MAX_TEMPLATE_KWARGS => {
            // The template's own variables cannot be replaced this way (the BOS/EOS texts would
            // reach the template unescaped, as control tokens).
            for k in [
                "messages",
                "add_generation_prompt",
                "tools",
                "bos_token",
                "eos_token",
            ] {
                if m.contains_key(k) {
                    return Err(f.invalid(
                        "chat_template_kwargs",
                        format!("chat_template_kwargs must not set '{k}'"),
                    ));
                }
            }
            m.clone()
        }
        Some(_) => {
            return Err(f.invalid(
                "chat_template_kwargs",
                format!("'chat_template_kwargs' must be an object with at most {MAX_TEMPLATE_KWARGS} entries"),
            ))
        }
    };
    if let Some(e) = f.string("reasoning_effort")? {
        template_kwargs.insert("reasoning_effort".into(), e.into());
    }
    if let Some(d) = f.get("documents") {
        template_kwargs.insert("documents".into(), d.clone());
    }
    let mut enable_thinking = match template_kwargs.get("enable_thinking") {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(f.invalid(
                "chat_template_kwargs",
                "chat_template_kwargs.enable_thinking must be a boolean",
            ))
        }
    };
    // Z.ai's own API: `"thinking": {"type": "enabled" | "disabled"}`.
    if let Some(t) = f.object("thinking")? {
        let on = match t.string("type")? {
            Some("enabled") => true,
            Some("disabled") => false,
            _ => {
                return Err(f.invalid(
                    "thinking",
                    "thinking.type must be \"enabled\" or \"disabled\"",
                ))
            }
        };
        t.finish(&[])?;
        if enable_thinking.is_some_and(|e| e != on) {
            return Err(f.invalid(
                "thinking",
                "thinking.type contradicts chat_template_kwargs.enable_thinking",
            ));
        }
        enable_thinking = Some(on);
        template_kwargs.insert("enable_thinking".into(), on.into());
    }
    let reasoning_inline = match f.string("reasoning_format")? {
        None | Some("auto") | Some("deepseek") => false,
        Some("none") => true,
        Some(o) => {
            return Err(f.invalid(
                "reasoning_format",
                format!("reasoning_format {o:?} is not one of auto, deepseek, none"),
            ))
        }
    };
    let (tools, tool_choice, parallel, legacy) = parse_tools(f)?;
    if let Some(c) = &common.constraint {
        if !tools.is_empty() && tool_choice != ToolChoice::None {
            return Err(f.invalid(
                &c.field,
                format!(
                    "'{}' cannot be combined with tools (a constrained answer could never call them)",
                    c.field
                ),
            ));
        }
    }
    Ok(ChatRequest {
        common,
        messages,
        logprobs,
        add_generation_prompt,
        template_kwargs,
        tools,
        tool_choice,
        parallel_tool_calls: parallel,
        legacy_functions: legacy,
        enable_thinking,
        reasoning_inline,
        thinking_budget: None,
    })
}

/// `tools` / `tool_choice` / `parallel_tool_calls`, or the legacy `functions` /
/// `function_call` (answered with `function_call`, one call at most).
fn parse_tools(f: &Fields<'_>) -> Result<(Vec<ToolDef>, ToolChoice, bool, bool), ApiError> {
    let tools_v = f.get("tools");
    let functions_v = f.get("functions");
    if tools_v.is_some() && functions_v.is_some() {
        return Err(f.invalid(
            "functions",
            "give either 'tools' or the legacy 'functions', not both",
        ));
    }
    let legacy = functions_v.is_some();
    let (list, field) = match (tools_v, functions_v) {
        (Some(t), _) => (t, "tools"),
        (_, Some(fv)) => (fv, "functions"),
        (None, None) => {
            for field in ["tool_choice", "function_call"] {
                match f.get(field) {
                    None => {}
                    Some(Value::String(s)) if s == "none" || s == "auto" => {}
                    Some(_) => return Err(f.invalid(field, format!("'{field}' needs 'tools'"))),
                }
            }
            f.boolean("parallel_tool_calls")?;
            return Ok((Vec::new(), ToolChoice::None, true, false));
        }
    };
    let arr = list
        .as_array()
        .ok_or_else(|| f.invalid(field, format!("'{field}' must be an array")))?;
    if arr.len() > MAX_TOOLS {
        return Err(f.invalid(field, format!("at most {MAX_TOOLS} tools are allowed")));
    }
    let mut tools: Vec<ToolDef> = Vec::with_capacity(arr.len());
    for (i, t) in arr.iter().enumerate() {
        let p = format!("{field}[{i}]");
        let func = if legacy {
            t
        } else {
            let o = t
                .as_object()
                .ok_or_else(|| ApiError::invalid(&p, format!("{p} must be an object")))?;
            let tf = Fields::new(o, &format!("{p}."));
            match tf.string("type")? {
                Some("function") => {}
                other => {
                    return Err(ApiError::invalid(
                        &format!("{p}.type"),
                        format!("{p}.type must be \"function\", got {other:?}"),
                    ))
                }
            }
            let func = tf.get("function").ok_or_else(|| {
                ApiError::invalid(
                    &format!("{p}.function"),
                    format!("{p}.function is required"),
                )
            })?;
            tf.finish(&[])?;
            func
        };
        let fp = if legacy {
            p.clone()
        } else {
            format!("{p}.function")
        };
        tools.push(parse_function(func, &fp)?);
        if tools[..i].iter().any(|o| o.name == tools[i].name) {
            return Err(ApiError::invalid(
                &fp,
                format!("{fp}: function {:?} is defined twice", tools[i].name),
            ));
        }
    }
    let choice_field = if legacy {
        "function_call"
    } else {
        "tool_choice"
    };
    if legacy && f.get("tool_choice").is_some() {
        return Err(f.invalid(
            "tool_choice",
            "use 'function_call' with the legacy 'functions'",
        ));
    }
    let choice = match f.get(choice_field) {
        None => {
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" if !legacy => ToolChoice::Required,
            _ => {
                return Err(f.invalid(
                    choice_field,
                    format!("'{choice_field}' {s:?} is not none, auto, required or a function"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = if legacy {
                o.get("name")
            } else {
                o.get("function").and_then(|fv| fv.get("name"))
            }
            .and_then(Value::as_str)
            .ok_or_else(|| {
                f.invalid(choice_field, format!("'{choice_field}' names no function"))
            })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(f.invalid(
                    choice_field,
                    format!("'{choice_field}' names {name:?}, which is not among the tools"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(v) => {
            return Err(f.invalid(
                choice_field,
                format!(
                    "'{choice_field}' must be a string or an object, got {}",
                    kind(v)
                ),
            ))
        }
    };
    if choice == ToolChoice::Required && tools.is_empty() {
        return Err(f.invalid(
            "tool_choice",
            "tool_choice \"required\" needs at least one tool",
        ));
    }
    let parallel = !legacy && f.boolean("parallel_tool_calls")?.unwrap_or(true);
    Ok((tools, choice, parallel, legacy))
}

fn parse_function(v: &Value, p: &str) -> Result<ToolDef, ApiError> {
    let o = v
        .as_object()
        .ok_or_else(|| ApiError::invalid(p, format!("{p} must be an object")))?;
    let ff = Fields::new(o, &format!("{p}."));
    let name = ff
        .string("name")?
        .filter(|n| {
            !n.is_empty()
                && n.len() <= 64
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        })
        .ok_or_else(|| {
            ApiError::invalid(
                &format!("{p}.name"),
                format!("{p}.name must be 1-64 letters, digits, '_', '-' or '.'"),
            )
        })?
        .to_string();
    let description = ff.string("description")?.map(str::to_string);
    // Forced calls are always constrained to the schema; `strict` asks for no less.
    ff.boolean("strict")?;
    let parameters = match ff.get("parameters") {
        None => serde_json::json!({"type": "object", "properties": {}}),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                &format!("{p}.parameters"),
                format!("{p}.parameters must be a JSON schema object"),
            ))
        }
    };
    ff.finish(&[])?;
    Ok(ToolDef {
        name,
        description,
        parameters,
    })
}

fn parse_message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let p = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(o) = m else {
        return Err(ApiError::invalid(
            &format!("messages[{i}]"),
            format!("messages[{i}] must be an object, got {}", kind(m)),
        ));
    };
    let mf = Fields::new(o, &format!("messages[{i}]."));
    let role = match mf.get("role") {
        Some(Value::String(r)) => r.as_str(),
        _ => {
            return Err(ApiError::invalid(
                &p("role"),
                format!("messages[{i}].role must be a string"),
            ))
        }
    };
    let role = match role {
        "system" | "user" | "assistant" | "tool" => role,
        // OpenAI's newer name for the system role; chat templates know only "system".
        "developer" => "system",
        // The legacy function result.
        "function" => "tool",
        _ => {
            return Err(ApiError::invalid(
                &p("role"),
                format!("messages[{i}].role {role:?} is not one of system, developer, user, assistant, tool, function"),
            ))
        }
    };
    let content = match mf.get("content") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (j, part) in parts.iter().enumerate() {
                let text = part
                    .as_object()
                    .filter(|o| {
                        o.get("type").and_then(Value::as_str) == Some("text")
                            && o.keys().all(|k| k == "type" || k == "text" || k == "cache_control")
                    })
                    .and_then(|o| o.get("text"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            &p(&format!("content[{j}]")),
                            format!("messages[{i}].content[{j}]: only {{\"type\": \"text\", \"text\": ...}} parts are supported"),
                        )
                    })?;
                s.push_str(text);
            }
            s
        }
        Some(v) => {
            return Err(ApiError::invalid(
                &p("content"),
                format!(
                    "messages[{i}].content must be a string or an array of text parts, got {}",
                    kind(v)
                ),
            ))
        }
    };
    let name = mf.string("name")?.map(str::to_string);
    let reasoning_content = mf
        .string("reasoning_content")?
        .or(mf.string("reasoning")?)
        .map(str::to_string);
    let mut tool_calls = Vec::new();
    if let Some(v) = mf.get("tool_calls") {
        let arr = v.as_array().ok_or_else(|| {
            ApiError::invalid(
                &p("tool_calls"),
                format!("{} must be an array", p("tool_calls")),
            )
        })?;
        for (j, c) in arr.iter().enumerate() {
            tool_calls.push(parse_call(c, &p(&format!("tool_calls[{j}]")), true)?);
        }
    }
    if let Some(fc) = mf.get("function_call") {
        tool_calls.push(parse_call(fc, &p("function_call"), false)?);
    }
    if !tool_calls.is_empty() && role != "assistant" {
        return Err(ApiError::invalid(
            &p("tool_calls"),
            "only assistant messages make tool calls",
        ));
    }
    let tool_call_id = mf.string("tool_call_id")?.map(str::to_string);
    if role == "tool" && tool_call_id.is_none() && name.is_none() {
        return Err(ApiError::invalid(
            &p("tool_call_id"),
            format!("{} is required for tool messages", p("tool_call_id")),
        ));
    }
    mf.finish(&["refusal", "annotations", "audio_placeholder"])?;
    Ok(Message {
        role: role.to_string(),
        content,
        reasoning_content,
        tool_calls,
        tool_call_id,
        name,
        content_escaped: false,
    })
}

/// One call of an assistant turn: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, or the legacy `function_call` `{"name", "arguments"}`.
fn parse_call(v: &Value, p: &str, wrapped: bool) -> Result<ToolCall, ApiError> {
    let bad = |what: &str| ApiError::invalid(p, format!("{p}: {what}"));
    let o = v.as_object().ok_or_else(|| bad("must be an object"))?;
    let (id, func) = if wrapped {
        let id = o
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        (
            id,
            o.get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("function is required"))?,
        )
    } else {
        (String::new(), o)
    };
    let name = func
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("function.name is required"))?
        .to_string();
    let arguments = match func.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        // Some clients send the object itself.
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return Err(bad("function.arguments must be a JSON string")),
    };
    Ok(ToolCall {
        id,
        name,
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn completion(v: Value) -> Result<CompletionRequest, ApiError> {
        parse_completion(&v)
    }

    #[test]
    fn accepts_a_typical_request() {
        let r = completion(json!({"model": "x", "prompt": "hi", "max_tokens": 5,
            "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3,
            "stop": ["\n"], "stream": true, "stream_options": {"include_usage": true},
            "logprobs": 2, "echo": true, "user": "u1", "cache_prompt": true,
            "mirostat": 0, "typical_p": 1.0, "frequency_penalty": null}))
        .unwrap();
        assert_eq!(r.common.max_tokens, Some(5));
        assert_eq!(r.common.sampling.top_k, 40);
        assert_eq!(r.common.sampling.seed, Some(3));
        assert_eq!(r.common.stop, vec!["\n".to_string()]);
        assert!(r.common.stream && r.common.include_usage && r.echo);
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(r.prompts, vec![Prompt::Text("hi".into())]);
    }

    #[test]
    fn rejects_bad_fields_naming_them() {
        let cases = [
            (json!({"prompt": "x", "max_tokens": -1}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 1.5}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 1e300}), "max_tokens"),
            (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
            (json!({"prompt": "x", "temperature": -0.1}), "temperature"),
            (json!({"prompt": "x", "top_p": 5}), "top_p"),
            (json!({"prompt": "x", "top_k": -2}), "top_k"),
            (json!({"prompt": "x", "min_p": 2}), "min_p"),
            (json!({"prompt": "x", "n": 1000000}), "n"),
            (json!({"prompt": vec!["a"; 65], "n": 2}), "n"),
            (json!({"prompt": "x", "stop": vec!["a"; 17]}), "stop"),
            (json!({"prompt": "x", "stop": [""]}), "stop"),
            (json!({"prompt": "x", "stop": 3}), "stop"),
            (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (json!({"prompt": "x", "logit_bias": {"a": 1}}), "logit_bias"),
            (
                json!({"prompt": "x", "logit_bias": {"1": 500}}),
                "logit_bias",
            ),
            (json!({"prompt": "x", "seed": "1"}), "seed"),
            (
                json!({"prompt": "x", "presence_penalty": 3}),
                "presence_penalty",
            ),
            (json!({"prompt": "x", "best_of": 3}), "best_of"),
            (json!({"prompt": [-1]}), "prompt"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": {"a": 1}}), "prompt"),
            (json!({}), "prompt"),
            // Never silently ignored: unknown fields and sampler knobs that are on.
            (
                json!({"prompt": "x", "some_unknown_field": [1, 2]}),
                "some_unknown_field",
            ),
            (json!({"prompt": "x", "mirostat": 2}), "mirostat"),
            (json!({"prompt": "x", "typical_p": 0.9}), "typical_p"),
            (
                json!({"prompt": "x", "dry_multiplier": 0.8}),
                "dry_multiplier",
            ),
            (json!({"prompt": "x", "samplers": ["top_k"]}), "samplers"),
            (
                json!({"prompt": "x", "stream_options": {"include_usage": true, "x": 1}}),
                "stream_options.x",
            ),
            (
                json!({"prompt": "x", "repeat_penalty": 1.1, "repetition_penalty": 1.2}),
                "repetition_penalty",
            ),
            (
                json!({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}),
                "json_schema",
            ),
            (
                json!({"prompt": "x", "response_format": {"type": "yaml"}}),
                "response_format",
            ),
            (json!({"prompt": "x", "guided_choice": []}), "guided_choice"),
        ];
        for (body, field) in cases {
            let e = completion(body.clone()).expect_err(&body.to_string());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
        assert!(completion(json!("a string")).is_err());
    }

    #[test]
    fn prompt_forms() {
        let p = |v| completion(json!({"prompt": v})).unwrap().prompts;
        assert_eq!(p(json!([1, 2])), vec![Prompt::Tokens(vec![1, 2])]);
        assert_eq!(p(json!([[1, 2]])), vec![Prompt::Tokens(vec![1, 2])]);
        assert_eq!(p(json!(["ab"])), vec![Prompt::Text("ab".into())]);
        assert_eq!(
            p(json!(["a", [3]])),
            vec![Prompt::Text("a".into()), Prompt::Tokens(vec![3])]
        );
    }

    #[test]
    fn penalties_and_constraints() {
        let r =
            completion(json!({"prompt": "x", "repeat_penalty": 1.3, "repeat_last_n": 8})).unwrap();
        assert_eq!(
            (r.common.repeat_penalty, r.common.repeat_last_n),
            (1.3, RepeatLen::Tokens(8))
        );
        let r = completion(json!({"prompt": "x", "repetition_penalty": 1.2})).unwrap();
        assert_eq!(r.common.repeat_last_n, RepeatLen::Context);
        let c = |v: Value| completion(v).unwrap().common.constraint.unwrap();
        assert_eq!(
            c(json!({"prompt": "x", "grammar": "root ::= \"a\""})).kind,
            ConstraintKind::Gbnf("root ::= \"a\"".into())
        );
        assert_eq!(
            c(json!({"prompt": "x", "response_format": {"type": "json_object"}})).kind,
            ConstraintKind::JsonSchema(json!({"type": "object"}))
        );
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for body in [
            json!({"prompt": "x", "json_schema": s}),
            json!({"prompt": "x", "guided_json": s.to_string()}),
            json!({"prompt": "x", "structured_outputs": {"json": s}}),
            json!({"prompt": "x", "response_format": {"type": "json_schema",
                "json_schema": {"name": "n", "strict": true, "schema": s}}}),
        ] {
            assert_eq!(c(body).kind, ConstraintKind::JsonSchema(s.clone()));
        }
        assert_eq!(
            c(json!({"prompt": "x", "guided_grammar": "start: \"a\""})).kind,
            ConstraintKind::Lark("start: \"a\"".into())
        );
    }

    #[test]
    fn chat_messages() {
        let r = parse_chat(&json!({"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ], "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 7}))
        .unwrap();
        assert_eq!(r.messages[0].role, "system");
        assert_eq!(r.messages[1].content, "ab");
        assert_eq!(r.messages[2].tool_calls[0].arguments, "{\"x\": 1}");
        assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(r.common.max_tokens, Some(7));
        for bad in [
            json!({"messages": "hi"}),
            json!({"messages": []}),
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            json!({"messages": [{"content": "x"}]}),
            json!({"messages": [{"role": "user", "content": 5}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            json!({"messages": [{"role": "user", "content": "x", "colour": "red"}]}),
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99}),
            json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
        ] {
            let e = parse_chat(&bad).expect_err(&bad.to_string());
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn tools_and_legacy_functions() {
        let f = json!({"name": "get_weather", "parameters": {"type": "object"}});
        let msgs = json!([{"role": "user", "content": "x"}]);
        let r = parse_chat(
            &json!({"messages": msgs, "tools": [{"type": "function", "function": f}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": false}),
        )
        .unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Named("get_weather".into()));
        assert!(!r.parallel_tool_calls && !r.legacy_functions);
        let r = parse_chat(&json!({"messages": msgs, "functions": [f],
            "function_call": {"name": "get_weather"}}))
        .unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Named("get_weather".into()));
        assert!(r.legacy_functions);
        let e = parse_chat(
            &json!({"messages": msgs, "functions": [f], "function_call": {"name": "nope"}}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("function_call"));
        let r =
            parse_chat(&json!({"messages": msgs, "tools": [{"type": "function", "function": f}]}))
                .unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Auto);
    }

    #[test]
    fn thinking_controls() {
        let msgs = json!([{"role": "user", "content": "x"}]);
        let r = parse_chat(
            &json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": false}}),
        )
        .unwrap();
        assert_eq!(r.enable_thinking, Some(false));
        let r = parse_chat(&json!({"messages": msgs, "thinking": {"type": "enabled"}})).unwrap();
        assert_eq!(r.enable_thinking, Some(true));
        assert_eq!(r.template_kwargs["enable_thinking"], json!(true));
        let r = parse_chat(&json!({"messages": msgs, "reasoning_format": "none"})).unwrap();
        assert!(r.reasoning_inline);
        assert!(
            parse_chat(&json!({"messages": msgs, "thinking": {"type": "enabled"},
            "chat_template_kwargs": {"enable_thinking": false}}))
            .is_err()
        );
    }
}
