//! Constrained decoding: grammars compiled by llguidance for the served model's vocabulary and
//! run as [`TokenConstraint`]s by the engine (a token mask before each sampling step).
//!
//! Inputs: JSON schemas (`response_format`, llama.cpp's `json_schema`, tool arguments), Lark
//! grammars (llguidance's dialect, which may embed `%json {schema}`), llama.cpp GBNF (translated
//! by [`gbnf`]) and regular expressions. JSON has no free whitespace between tokens, only one
//! space after `,` and `:` (`{"city": "Paris", "days": 3}`, Python's `json.dumps` layout):
//! with the unbounded whitespace of plain JSON a small model can fill its whole budget with
//! blanks and never close the object. llama.cpp bounds each gap instead
//! (`space ::= | " " | "\n"{1,2} [ \t]{0,20}`); that still lets a weak model spend 22 tokens per
//! gap, which the rule-based mock of the server tests does.

pub mod gbnf;

use crate::sampler::{ConstraintSource, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{
    InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv,
};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

/// Separators of constrained JSON (regexes, as llguidance takes them); no other whitespace.
pub const JSON_ITEM_SEPARATOR: &str = ", ";
pub const JSON_KEY_SEPARATOR: &str = ": ";

/// What a constraint is written in.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON schema; `true` or `{}` accepts any JSON value.
    JsonSchema(Value),
    /// A complete grammar in llguidance's Lark dialect, used as it is (it applies from the
    /// first generated token).
    Lark(String),
    /// llama.cpp's GBNF.
    Gbnf(String),
    /// A regular expression (Rust `regex` syntax) the whole output must match.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Lark rules and the expansion of their start rule (grammars the server writes).
    Rules { start: String, rules: String },
}

/// Where the answer begins with respect to GLM-style thinking (`<think>` ... `</think>`). The
/// grammar constrains the answer, not the thinking before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reasoning {
    /// No thinking: the grammar starts at the first token.
    None,
    /// The prompt ends inside a thinking block: free text until `close`, then the grammar.
    Open { close: u32 },
    /// The model may open a thinking block first.
    Optional { open: u32, close: u32 },
}

impl Reasoning {
    /// The Lark prefix of the start rule.
    fn lark_prefix(self) -> String {
        // Thinking text is anything but a control token; a newline may follow its end.
        const TEXT: &str = "/(?s:.*)/";
        match self {
            Reasoning::None => String::new(),
            Reasoning::Open { close } => format!("{TEXT} <[{close}]> (\"\\n\")? "),
            Reasoning::Optional { open, close } => {
                format!("(<[{open}]> {TEXT} <[{close}]> (\"\\n\")?)? ")
            }
        }
    }
}

/// Why a grammar cannot be used. The cause from llguidance is kept.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error(transparent)]
    Gbnf(#[from] gbnf::GbnfError),
    #[error("{0}")]
    Invalid(String),
    #[error("{context}: {source}")]
    Compile {
        context: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

fn compile_err(
    context: &'static str,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> GrammarError {
    GrammarError::Compile {
        context,
        source: e.into(),
    }
}

/// One vocabulary entry as the grammar engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VocabEntry {
    /// Text bytes the token stands for.
    Text(Vec<u8>),
    /// A control token (`<|user|>`, `<think>`): matched only by name or id, never as text.
    Special(String),
    /// An id the model has but the tokenizer never produces (padding): never allowed.
    Unused,
}

struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
    // Greedy tokenization is not the model's own: llguidance then never forces tokens.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// The model's vocabulary prepared for grammar compilation (token trie and llguidance's
/// per-vocabulary caches). Build once per model; building walks the whole vocabulary.
pub struct Vocabulary {
    factory: ParserFactory,
}

impl Vocabulary {
    /// `entries[id]` for every id of the model; `eog` are the ids that end a generation (a
    /// grammar that is complete allows exactly these).
    pub fn new(entries: &[VocabEntry], eog: &[u32]) -> Result<Self, GrammarError> {
        let Some(&first_eog) = eog.first() else {
            return Err(GrammarError::Invalid(
                "the model has no end-of-generation token, so a grammar could never end".into(),
            ));
        };
        if entries.len() > u32::MAX as usize || eog.iter().any(|&e| e as usize >= entries.len()) {
            return Err(GrammarError::Invalid(
                "end-of-generation token outside the vocabulary".into(),
            ));
        }
        let words: Vec<Vec<u8>> = entries
            .iter()
            .map(|e| match e {
                VocabEntry::Text(b) => b.clone(),
                VocabEntry::Special(name) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(name.as_bytes());
                    w
                }
                VocabEntry::Unused => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(entries.len() as u32, first_eog);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eog);
        let env: TokEnv = Arc::new(Env { trie });
        // llguidance's token slices (JSON string contents of up to 10, 30 and any characters).
        // Finer slices do not help a `maxLength` string: the tokens too long for the room left
        // are still walked, once per slice level.
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| compile_err("preparing the vocabulary", e))?;
        factory.quiet();
        Ok(Vocabulary { factory })
    }

    pub fn vocab_size(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// The Lark text of `g` with its thinking prefix.
    pub fn lark(&self, g: &Grammar, reasoning: Reasoning) -> Result<String, GrammarError> {
        let (start, rules) = match g {
            Grammar::Lark(l) => {
                if matches!(reasoning, Reasoning::Open { .. }) {
                    return Err(GrammarError::Invalid(
                        "a Lark grammar cannot start inside a thinking block; switch thinking off"
                            .into(),
                    ));
                }
                return Ok(l.clone());
            }
            Grammar::JsonSchema(s) => (format!("%json {}", with_json_options(s)?), String::new()),
            Grammar::Gbnf(g) => {
                let trie = self.factory.tok_env().tok_trie();
                let rules = gbnf::to_lark_rules(g, |text| {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(text.as_bytes());
                    trie.token_id(&w).or_else(|| trie.token_id(text.as_bytes()))
                })?;
                (gbnf::ROOT.to_string(), rules)
            }
            Grammar::Regex(r) => (
                format!("/{}/", llguidance::regex_to_lark(r, "")),
                String::new(),
            ),
            Grammar::Choice(c) => {
                let alts: Vec<String> = c
                    .iter()
                    .map(|s| Value::String(s.clone()).to_string())
                    .collect();
                (format!("({})", alts.join(" | ")), String::new())
            }
            Grammar::Rules { start, rules } => (start.clone(), rules.clone()),
        };
        Ok(format!(
            "start: {}{start}\n{rules}",
            reasoning.lark_prefix()
        ))
    }

    /// Compile `g`. Errors name what is wrong with the grammar (a 400 for the client).
    pub fn compile(
        &self,
        g: &Grammar,
        reasoning: Reasoning,
    ) -> Result<CompiledGrammar, GrammarError> {
        let top = TopLevelGrammar::from_lark(self.lark(g, reasoning)?);
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| compile_err("compiling the grammar", e))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher_error(&matcher) {
            return Err(GrammarError::Invalid(e));
        }
        Ok(CompiledGrammar {
            proto: Mutex::new(matcher),
        })
    }
}

fn matcher_error(m: &Matcher) -> Option<String> {
    m.is_error()
        .then(|| m.get_error().unwrap_or_else(|| "grammar error".into()))
}

/// The schema with the server's JSON options (fixed separators, no free whitespace, no
/// unknown keyword silently dropped) attached the way llguidance reads them (`x-guidance`).
/// Options a client put there are replaced.
pub fn with_json_options(schema: &Value) -> Result<Value, GrammarError> {
    let mut s = match schema {
        Value::Bool(true) => json!({}),
        Value::Bool(false) => {
            return Err(GrammarError::Invalid(
                "the schema `false` accepts nothing".into(),
            ))
        }
        Value::Object(_) => schema.clone(),
        _ => {
            return Err(GrammarError::Invalid(
                "a JSON schema must be an object (or true)".into(),
            ))
        }
    };
    s["x-guidance"] = json!({
        "whitespace_flexible": false,
        "item_separator": JSON_ITEM_SEPARATOR,
        "key_separator": JSON_KEY_SEPARATOR,
        "lenient": false,
    });
    Ok(s)
}

/// A grammar compiled for one request; each choice gets its own matcher from it.
pub struct CompiledGrammar {
    proto: Mutex<Matcher>,
}

impl CompiledGrammar {
    /// A fresh matcher at the start of the grammar.
    pub fn matcher(&self) -> Matcher {
        self.proto.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl ConstraintSource for CompiledGrammar {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        let matcher = self.matcher();
        if let Some(e) = matcher_error(&matcher) {
            return Err(e);
        }
        Ok(Box::new(Constraint::new(matcher)))
    }
}

/// A fixed set of allowed tokens (vLLM's `allowed_token_ids`): no grammar, never finished.
pub struct TokenSet {
    mask: Vec<u32>,
}

impl TokenSet {
    pub fn new(ids: &[u32], vocab: usize) -> Self {
        let mut mask = vec![0u32; vocab.div_ceil(32)];
        for &id in ids.iter().filter(|&&id| (id as usize) < vocab) {
            mask[id as usize / 32] |= 1 << (id % 32);
        }
        TokenSet { mask }
    }
}

impl ConstraintSource for TokenSet {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(TokenSet {
            mask: self.mask.clone(),
        }))
    }
}

impl TokenConstraint for TokenSet {
    fn allowed(&mut self) -> Result<&[u32], String> {
        Ok(&self.mask)
    }
    fn commit(&mut self, id: u32) -> Result<(), String> {
        match self.mask.get(id as usize / 32) {
            Some(w) if w & (1 << (id % 32)) != 0 => Ok(()),
            _ => Err(format!("token {id} is not allowed")),
        }
    }
    fn is_finished(&self) -> bool {
        false
    }
}

/// Ends thinking after `budget` tokens of it by allowing only the closing token then
/// (Anthropic's `thinking.budget_tokens`), on top of an optional grammar for the answer.
pub struct ThinkingBudget {
    pub inner: Option<Arc<dyn ConstraintSource>>,
    pub open: u32,
    pub close: u32,
    pub budget: usize,
    /// The prompt ends inside a thinking block.
    pub starts_open: bool,
    pub vocab: usize,
}

impl ConstraintSource for ThinkingBudget {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        let words = self.vocab.div_ceil(32);
        let mut only_close = vec![0u32; words];
        if let Some(w) = only_close.get_mut(self.close as usize / 32) {
            *w |= 1 << (self.close % 32);
        }
        Ok(Box::new(BudgetState {
            inner: self.inner.as_ref().map(|i| i.start()).transpose()?,
            open: self.open,
            close: self.close,
            budget: self.budget,
            in_think: self.starts_open,
            count: 0,
            all: vec![u32::MAX; words],
            only_close,
        }))
    }
}

struct BudgetState {
    inner: Option<Box<dyn TokenConstraint>>,
    open: u32,
    close: u32,
    budget: usize,
    in_think: bool,
    count: usize,
    all: Vec<u32>,
    only_close: Vec<u32>,
}

impl TokenConstraint for BudgetState {
    fn prepare(&mut self) {
        if let Some(i) = self.inner.as_mut() {
            i.prepare();
        }
    }
    fn allowed(&mut self) -> Result<&[u32], String> {
        if self.in_think && self.count >= self.budget {
            return Ok(&self.only_close);
        }
        match self.inner.as_mut() {
            Some(i) => i.allowed(),
            None => Ok(&self.all),
        }
    }
    fn commit(&mut self, id: u32) -> Result<(), String> {
        if id == self.open {
            self.in_think = true;
        } else if id == self.close {
            self.in_think = false;
        } else if self.in_think {
            self.count += 1;
        }
        match self.inner.as_mut() {
            Some(i) => i.commit(id),
            None => Ok(()),
        }
    }
    fn is_finished(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| i.is_finished())
    }
}

/// A running matcher: the engine's view of a grammar.
pub struct Constraint {
    matcher: Matcher,
    mask: SimpleVob,
    /// The mask for the next position is computed (by `prepare` or `allowed`).
    ready: Option<Result<(), String>>,
}

impl Constraint {
    pub fn new(matcher: Matcher) -> Self {
        Constraint {
            matcher,
            mask: SimpleVob::new(),
            ready: None,
        }
    }
}

impl TokenConstraint for Constraint {
    fn prepare(&mut self) {
        if self.ready.is_none() {
            self.ready = Some(match self.matcher.compute_mask_or_eos() {
                Ok(m) => {
                    self.mask = m;
                    Ok(())
                }
                Err(e) => Err(e.to_string()),
            });
        }
    }
    fn allowed(&mut self) -> Result<&[u32], String> {
        self.prepare();
        match &self.ready {
            Some(Err(e)) => Err(e.clone()),
            _ => Ok(self.mask.as_slice()),
        }
    }
    fn commit(&mut self, id: u32) -> Result<(), String> {
        self.ready = None;
        self.matcher.consume_token(id).map_err(|e| e.to_string())
    }
    fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
