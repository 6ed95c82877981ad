//! The tokenizer, built from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! Supported: byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with the pre-tokenizers listed in
//! [`pretok`] (GLM-4/GLM-5 `glm4` first), and SentencePiece-style BPE (`"llama"`, with scores and
//! `<0xXX>` byte fallback). Anything else is refused rather than approximated.
//!
//! Why hand-written instead of the `tokenizers` crate: GGUF semantics are llama.cpp's, not a
//! `tokenizer.json` pipeline. Special-token splitting (longest first, user-defined tokens always,
//! control tokens only with `parse_special`), token types (control / unused / byte), the
//! end-of-generation set and the space prefix after special tokens would all have to be rebuilt
//! around the crate anyway, and a SentencePiece vocabulary in GGUF carries scores, not merges, so
//! the crate's BPE model would need merges synthesised from them. The merge loops are ~100 lines
//! each; the rest is that glue. It also keeps the build small on 2-core CI: the only new
//! dependency is `aho-corasick`, already compiled for `regex`, where `tokenizers` brings a few
//! dozen crates (proc-macro `derive_builder`/`darling`, `monostate`, `esaxx`, ...). Token ids are
//! checked against HF `tokenizers`, `llama-tokenize` and the `sentencepiece` library in
//! `tests/tokenizer_fixture.rs`.
//!
//! Decoding returns the raw concatenation of token bytes (HF `clean_up_tokenization_spaces =
//! false`); llama.cpp's optional space clean-up is not applied since it breaks round trips.

mod bpe;
mod pretok;
mod special;
mod spm;
mod stream;

use std::collections::{BTreeSet, HashMap};

pub use stream::{DecodeStream, Detokenizer};

use crate::ServingError;
use special::{Fragment, SpecialMatcher};

/// `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    /// Unrecognised values behave as `Undefined` (rendered as nothing), like llama.cpp.
    pub fn from_gguf(v: i64) -> Self {
        match v {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }
}

/// Everything a tokenizer is built from: the `tokenizer.ggml.*` keys, already typed. Public so
/// tokenizers can also be built without a GGUF file (tests, converted `tokenizer.json`).
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: "gpt2" or "llama".
    pub model: String,
    /// `tokenizer.ggml.pre` (byte-level BPE only).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`; absent means every token is normal.
    pub token_types: Option<Vec<i64>>,
    /// `tokenizer.ggml.scores` (SentencePiece merge priorities).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.merges`, "left right" in rank order.
    pub merges: Vec<String>,
    pub bos_id: Option<u64>,
    pub eos_id: Option<u64>,
    pub eot_id: Option<u64>,
    pub eom_id: Option<u64>,
    pub unk_id: Option<u64>,
    pub pad_id: Option<u64>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

enum Kind {
    Bpe {
        pre: pretok::PreTokenizer,
        ignore_merges: bool,
        merges: bpe::MergeTable,
    },
    Spm {
        scores: Vec<f32>,
        mergeable: Vec<bool>,
    },
}

/// A loaded tokenizer. Cheap to share (`Send + Sync`, immutable).
pub struct Tokenizer {
    kind: Kind,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, u32>,
    /// Bytes each token renders to (special tokens as their text, unused ones as nothing).
    pieces: Vec<Vec<u8>>,
    special: SpecialMatcher,
    byte_tokens: [Option<u32>; 256],
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    eog: Vec<u32>,
    /// Most input bytes one token can stand for: `len / max_token_bytes` is a lower bound on
    /// the token count of any text, which refuses an over-long prompt before tokenizing it.
    max_token_bytes: usize,
}

/// Result of [`Tokenizer::encode_bounded`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bounded {
    /// The whole text, in at most `limit` tokens.
    Complete(Vec<u32>),
    /// More than `limit` tokens; tokenizing stopped at `limit + 1` (or never started: the text
    /// is longer than `limit + 1` tokens can be).
    Exceeds { limit: usize },
}

/// Token texts that end generation in llama.cpp's vocabulary loader (it matches by text because
/// converters do not record them); together with the eos/eot/eom ids they form `eog_ids()`.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// Texts taken as the end-of-turn token when `tokenizer.ggml.eot_token_id` is absent (first hit
/// in this order).
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
/// Fill-in-the-middle pad / repo / file-separator tokens, which llama.cpp also treats as EOG.
const FIM_EOG_TEXTS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Bpe { .. } => "byte-level BPE",
            Kind::Spm { .. } => "SentencePiece BPE",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

fn tok_err(msg: impl Into<String>) -> ServingError {
    ServingError::Tokenizer(msg.into())
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*`).
    pub fn from_gguf(meta: &gguf::Metadata) -> Result<Self, ServingError> {
        Self::from_spec(spec_from_gguf(meta)?)
    }

    /// Builds the tokenizer from already-extracted metadata.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self, ServingError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(tok_err("empty vocabulary (tokenizer.ggml.tokens)"));
        }
        let n_u32 = u32::try_from(n).map_err(|_| tok_err(format!("vocabulary of {n} tokens")))?;

        let mut tokens = spec.tokens;
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                // llama.cpp's substitute, so ids stay aligned and the entry is not matchable.
                *t = format!("[EMPTY_{i}]");
            }
            if let Some(prev) = token_to_id.insert(t.clone(), i as u32) {
                return Err(tok_err(format!(
                    "duplicate token {t:?} at ids {prev} and {i}"
                )));
            }
        }
        let mut types = match &spec.token_types {
            None => vec![TokenType::Normal; n],
            Some(tt) if tt.len() < n => {
                return Err(tok_err(format!(
                    "tokenizer.ggml.token_type has {} entries for {n} tokens",
                    tt.len()
                )))
            }
            Some(tt) => tt[..n].iter().map(|&v| TokenType::from_gguf(v)).collect(),
        };

        let checked = |key: &str, id: Option<u64>| -> Option<u32> {
            let id = id?;
            if id < n as u64 {
                Some(id as u32)
            } else {
                tracing::warn!("tokenizer: {key} = {id} is outside the vocabulary ({n}); ignored");
                None
            }
        };
        let is_spm = match spec.model.as_str() {
            "gpt2" => false,
            "llama" => true,
            other => {
                return Err(tok_err(format!(
                    "unsupported tokenizer.ggml.model {other:?} (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece)"
                )))
            }
        };
        let spm_default = |id: u32| (is_spm && id < n_u32).then_some(id);
        let bos = checked("bos_token_id", spec.bos_id).or_else(|| spm_default(1));
        let eos = checked("eos_token_id", spec.eos_id).or_else(|| spm_default(2));
        let unk = checked("unknown_token_id", spec.unk_id).or_else(|| spm_default(0));
        let pad = checked("padding_token_id", spec.pad_id);
        let find_text = |texts: &[&str]| texts.iter().find_map(|t| token_to_id.get(*t).copied());
        let eot_by_text = spec
            .eot_id
            .is_none()
            .then(|| find_text(EOT_TEXTS))
            .flatten();
        let eom_by_text = spec
            .eom_id
            .is_none()
            .then(|| find_text(&["<|eom_id|>"]))
            .flatten();
        let eot = checked("eot_token_id", spec.eot_id).or(eot_by_text);
        let eom = checked("eom_token_id", spec.eom_id).or(eom_by_text);

        // End-of-generation set, derived as llama.cpp does: stop tokens recognised by their text
        // (which must be control tokens: llama.cpp upgrades mis-typed ones, so they are skipped
        // by `skip_special` and only split out when parsing specials), then eos/eot/eom by id.
        let mut by_text: BTreeSet<u32> =
            FIM_EOG_TEXTS.iter().filter_map(|g| find_text(g)).collect();
        by_text.extend(
            EOG_TEXTS
                .iter()
                .filter_map(|t| token_to_id.get(*t).copied()),
        );
        by_text.extend(eot_by_text);
        by_text.extend(eom_by_text);
        for &id in &by_text {
            types[id as usize] = TokenType::Control;
        }
        let mut eog = by_text;
        eog.extend([eos, eot, eom].into_iter().flatten());
        let text_of = |id: &u32| tokens[*id as usize].as_str();
        let has = |eog: &BTreeSet<u32>, t: &str| eog.iter().find(|id| text_of(id) == t).copied();
        // gpt-oss / solar-open use <|end|> between messages, not as a stop.
        if let Some(end) = has(&eog, "<|end|>") {
            let (ret, call, calls, flush) = (
                has(&eog, "<|return|>"),
                has(&eog, "<|call|>"),
                has(&eog, "<|calls|>"),
                has(&eog, "<|flush|>"),
            );
            if (ret.is_some() && call.is_some()) || (calls.is_some() && flush.is_some()) {
                eog.remove(&end);
                types[end as usize] = TokenType::UserDefined;
            }
        }
        // Gemma-4 uses </s> inside tool responses.
        if has(&eog, "<|tool_response>").is_some() {
            if let Some(s) = has(&eog, "</s>") {
                eog.remove(&s);
                types[s as usize] = TokenType::Normal;
            }
        }
        // gpt-oss channel markers are always rendered.
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = token_to_id.get(t) {
                types[id as usize] = TokenType::UserDefined;
            }
        }
        let eog: Vec<u32> = eog.into_iter().collect();

        let (kind, add_bos_default, add_space_default) = if is_spm {
            let scores = match spec.scores {
                Some(s) if s.len() < n => {
                    return Err(tok_err(format!(
                        "tokenizer.ggml.scores has {} entries for {n} tokens",
                        s.len()
                    )))
                }
                Some(mut s) => {
                    s.truncate(n);
                    s
                }
                None => vec![0.0; n],
            };
            let mergeable = types
                .iter()
                .map(|t| {
                    !matches!(
                        t,
                        TokenType::Control | TokenType::Unknown | TokenType::Unused
                    )
                })
                .collect();
            (Kind::Spm { scores, mergeable }, true, true)
        } else {
            let pre_name = spec.pre.as_deref().ok_or_else(|| {
                tok_err("tokenizer.ggml.pre is missing; refusing to guess the pre-tokenizer")
            })?;
            let pre_spec = pretok::lookup(pre_name).ok_or_else(|| {
                tok_err(format!(
                    "unsupported pre-tokenizer {pre_name:?} (supported: {})",
                    pretok::KNOWN
                ))
            })?;
            let pre = pretok::PreTokenizer::new(pre_spec.regexes)?;
            let mut merges = bpe::MergeTable::with_capacity(spec.merges.len());
            let mut skipped = 0usize;
            for (rank, m) in spec.merges.iter().enumerate() {
                // The separator is the first space after the first byte, as llama.cpp splits (a
                // space byte is always a char boundary, unlike byte 1 of "Ġ s").
                let Some(sep) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                    skipped += 1;
                    continue;
                };
                let (l, r) = (&m[..sep], &m[sep + 1..]);
                let merged = format!("{l}{r}");
                match (
                    token_to_id.get(l),
                    token_to_id.get(r),
                    token_to_id.get(&merged),
                ) {
                    (Some(&a), Some(&b), Some(&c)) => {
                        merges
                            .entry(bpe::pair_key(a, b))
                            .or_insert((rank as u32, c));
                    }
                    _ => skipped += 1,
                }
            }
            if skipped > 0 {
                tracing::warn!(
                    "tokenizer: {skipped} merges refer to tokens outside the vocabulary; ignored"
                );
            }
            (
                Kind::Bpe {
                    pre,
                    ignore_merges: pre_spec.ignore_merges,
                    merges,
                },
                pre_spec.add_bos,
                false,
            )
        };

        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = match &kind {
                Kind::Bpe { .. } => token_to_id
                    .get(bpe::ALPHABET[b].to_string().as_str())
                    .copied(),
                Kind::Spm { .. } => token_to_id.get(format!("<0x{b:02X}>").as_str()).copied(),
            };
        }

        let char_map = bpe::char_to_byte_map();
        let pieces = tokens
            .iter()
            .zip(&types)
            .map(|(text, ty)| match ty {
                TokenType::Control | TokenType::Unknown | TokenType::UserDefined => {
                    text.as_bytes().to_vec()
                }
                TokenType::Unused | TokenType::Undefined => Vec::new(),
                TokenType::Byte => parse_byte_token(text)
                    .map(|b| vec![b])
                    .unwrap_or_else(|| text.as_bytes().to_vec()),
                TokenType::Normal => match kind {
                    Kind::Bpe { .. } => bpe::decode_byte_level(text, &char_map),
                    Kind::Spm { .. } => text.replace('\u{2581}', " ").into_bytes(),
                },
            })
            .collect();

        let special = SpecialMatcher::new(
            tokens
                .iter()
                .zip(&types)
                .enumerate()
                .filter_map(|(i, (t, ty))| match ty {
                    TokenType::Control | TokenType::Unknown => Some((i as u32, t.as_str(), true)),
                    TokenType::UserDefined => Some((i as u32, t.as_str(), false)),
                    _ => None,
                })
                .collect(),
        )?;

        let max_token_bytes = tokens
            .iter()
            .zip(&pieces)
            .map(|(t, p): (&String, &Vec<u8>)| t.len().max(p.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        let add_bos = spec.add_bos.unwrap_or(add_bos_default);
        let add_eos = spec.add_eos.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(tok_err(
                "tokenizer.ggml.add_bos_token is true but there is no BOS token",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(tok_err(
                "tokenizer.ggml.add_eos_token is true but there is no EOS token",
            ));
        }
        Ok(Self {
            kind,
            tokens,
            types,
            token_to_id,
            pieces,
            special,
            byte_tokens,
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix: spec.add_space_prefix.unwrap_or(add_space_default),
            eog,
            max_token_bytes,
        })
    }

    /// Tokenizes `text` as llama.cpp does with `add_special = true`: BOS (and EOS) are added only
    /// where the model asks for them (`add_bos()`; false for GLM). With `parse_special`, special
    /// tokens written in the text (`[gMASK]`, `<|user|>`, `<think>`) become their ids.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, ServingError> {
        self.tokenize(text, true, parse_special)
    }

    /// Like [`encode`](Self::encode) with explicit control over BOS/EOS insertion (use
    /// `add_special = false` for text that continues a prompt or already carries its BOS).
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, ServingError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        self.tokenize_into(
            text,
            add_special,
            parse_special,
            false,
            usize::MAX,
            &mut out,
        )?;
        Ok(out)
    }

    /// [`encode`](Self::encode) with the work bounded by `limit`: a text that cannot fit in
    /// `limit` tokens (longer than `(limit + 1) * max_token_bytes()` bytes) is refused without
    /// tokenizing, and tokenizing stops as soon as `limit + 1` tokens exist. This is what keeps
    /// an 8 MB prompt against a 4k context from costing seconds of CPU before its 400.
    pub fn encode_bounded(
        &self,
        text: &str,
        parse_special: bool,
        limit: usize,
    ) -> Result<Bounded, ServingError> {
        self.bounded(text, parse_special, false, limit)
    }

    /// Tokenizes a prompt rendered by a chat template whose message content was escaped with
    /// [`escape_control_text`](Self::escape_control_text): control tokens written by the template
    /// become their ids, control-token text inside content stays text. Bounded like
    /// [`encode_bounded`](Self::encode_bounded).
    pub fn encode_chat(&self, rendered: &str, limit: usize) -> Result<Bounded, ServingError> {
        self.bounded(rendered, true, true, limit)
    }

    /// Content (a chat message, a tool description) with control-token text neutralized for
    /// [`encode_chat`](Self::encode_chat); `None` when the text needs no change.
    pub fn escape_control_text(&self, text: &str) -> Option<String> {
        self.special.escape_control(text)
    }

    /// Most input bytes a single token can cover (see [`encode_bounded`](Self::encode_bounded)).
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    fn bounded(
        &self,
        text: &str,
        parse_special: bool,
        unescape: bool,
        limit: usize,
    ) -> Result<Bounded, ServingError> {
        let cap = limit.saturating_add(1);
        if text.len().div_ceil(self.max_token_bytes) > cap {
            return Ok(Bounded::Exceeds { limit });
        }
        let mut out = Vec::with_capacity((text.len() / 3 + 2).min(cap));
        let complete = self.tokenize_into(text, true, parse_special, unescape, cap, &mut out)?;
        if !complete || out.len() > limit {
            return Ok(Bounded::Exceeds { limit });
        }
        Ok(Bounded::Complete(out))
    }

    /// Appends the tokens of `text` to `out`, stopping once `out` holds `cap` tokens. Returns
    /// whether the whole text was tokenized.
    fn tokenize_into(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        unescape: bool,
        cap: usize,
        out: &mut Vec<u32>,
    ) -> Result<bool, ServingError> {
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut prev_special = true;
        for frag in self.special.partition(text, parse_special) {
            if out.len() >= cap {
                return Ok(false);
            }
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    let t = if unescape {
                        special::unescape(t)
                    } else {
                        std::borrow::Cow::Borrowed(t)
                    };
                    if !self.encode_text(&t, prev_special, cap, out)? {
                        return Ok(false);
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(true)
    }

    /// Returns false when it stopped at `cap` tokens before the end of `text`.
    fn encode_text(
        &self,
        text: &str,
        after_special: bool,
        cap: usize,
        out: &mut Vec<u32>,
    ) -> Result<bool, ServingError> {
        use std::ops::ControlFlow::{Break, Continue};
        match &self.kind {
            Kind::Bpe {
                pre,
                ignore_merges,
                merges,
            } => {
                let mut initial = Vec::new();
                let flow = pre.for_each_piece(text, &mut |piece| {
                    if out.len() >= cap {
                        return Break(());
                    }
                    if *ignore_merges {
                        let encoded: String =
                            piece.bytes().map(|b| bpe::ALPHABET[b as usize]).collect();
                        if let Some(&id) = self.token_to_id.get(&encoded) {
                            out.push(id);
                            return Continue(());
                        }
                    }
                    initial.clear();
                    initial.extend(piece.bytes().map(|b| self.byte_tokens[b as usize]));
                    bpe::merge(&initial, merges, out);
                    Continue(())
                })?;
                Ok(flow == Continue(()))
            }
            Kind::Spm { scores, mergeable } => {
                // SentencePiece marks word starts with U+2581; llama.cpp prefixes a space to the
                // first text run and to each run that follows a special token.
                let mut s = String::with_capacity(text.len() + 1);
                if self.add_space_prefix && after_special {
                    s.push(' ');
                }
                s.push_str(text);
                let escaped = s.replace(' ', "\u{2581}");
                let vocab = spm::SpmVocab {
                    token_to_id: &self.token_to_id,
                    scores,
                    mergeable,
                    byte_tokens: &self.byte_tokens,
                };
                spm::tokenize(&escaped, &vocab, out);
                Ok(true)
            }
        }
    }

    /// Text of `ids`, invalid UTF-8 replaced by U+FFFD. With `skip_special`, control and unknown
    /// tokens are dropped (user-defined tokens are kept, as in llama.cpp and HF). SentencePiece
    /// models with a space prefix lose the leading space of the first token again.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, ServingError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut first = true;
        for &id in ids {
            let piece = self.piece(id)?;
            if skip_special && self.is_special(id) {
                continue;
            }
            let strip = first
                && self.add_space_prefix
                && matches!(self.kind, Kind::Spm { .. })
                && self.types[id as usize] == TokenType::Normal
                && piece.first() == Some(&b' ');
            bytes.extend_from_slice(if strip { &piece[1..] } else { piece });
            first = false;
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Raw bytes one token renders to (special tokens as their text), or `None` for an unknown id.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.pieces.get(id as usize).cloned()
    }

    pub(crate) fn piece(&self, id: u32) -> Result<&[u8], ServingError> {
        self.pieces
            .get(id as usize)
            .map(Vec::as_slice)
            .ok_or_else(|| {
                tok_err(format!(
                    "token id {id} outside the vocabulary of {}",
                    self.pieces.len()
                ))
            })
    }

    /// A streaming decoder borrowing this tokenizer.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream::new(self, skip_special)
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }
    pub fn eom_id(&self) -> Option<u32> {
        self.eom
    }
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }
    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }
    /// Whether `encode` prepends BOS (`tokenizer.ggml.add_bos_token` or the model type's default).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Tokens that end generation, sorted: eos, eot, eom and the stop tokens llama.cpp
    /// recognises by text (`<|endoftext|>`, `<|eot_id|>`, `<|im_end|>`, ...).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Id of a vocabulary entry given its stored text (byte-level form for BPE, e.g. "Ġthe";
    /// special tokens as written, e.g. "<|user|>").
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.token_to_id.get(piece).copied()
    }
    /// Stored text of a token.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }
    /// Control or unknown token: what `skip_special` removes.
    pub fn is_special(&self, id: u32) -> bool {
        matches!(
            self.token_type(id),
            Some(TokenType::Control | TokenType::Unknown)
        )
    }
}

fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn spec_from_gguf(meta: &gguf::Metadata) -> Result<TokenizerSpec, ServingError> {
    const P: &str = "tokenizer.ggml.";
    let key = |k: &str| format!("{P}{k}");
    let present = |k: &str| meta.get(&key(k)).is_some();
    if !present("model") {
        return Err(tok_err(
            "the GGUF has no tokenizer (tokenizer.ggml.model is missing)",
        ));
    }
    let opt_u64 = |k: &str| -> Result<Option<u64>, ServingError> {
        if present(k) {
            Ok(Some(meta.get_u64(&key(k))?))
        } else {
            Ok(None)
        }
    };
    let opt_bool = |k: &str| -> Result<Option<bool>, ServingError> {
        if present(k) {
            Ok(Some(meta.get_bool(&key(k))?))
        } else {
            Ok(None)
        }
    };
    let model = meta.get_str(&key("model"))?.to_string();
    let pre = if present("pre") {
        Some(meta.get_str(&key("pre"))?.to_string())
    } else {
        None
    };
    let tokens = meta
        .get_str_array(&key("tokens"))?
        .into_iter()
        .map(str::to_string)
        .collect();
    let token_types = if present("token_type") {
        Some(meta.get_i64_array(&key("token_type"))?)
    } else {
        None
    };
    let scores = if present("scores") {
        Some(
            meta.get_f64_array(&key("scores"))?
                .into_iter()
                .map(|v| v as f32)
                .collect(),
        )
    } else {
        None
    };
    let merges = if present("merges") {
        meta.get_str_array(&key("merges"))?
            .into_iter()
            .map(str::to_string)
            .collect()
    } else if model == "gpt2" {
        return Err(tok_err("byte-level BPE without tokenizer.ggml.merges"));
    } else {
        Vec::new()
    };
    Ok(TokenizerSpec {
        model,
        pre,
        tokens,
        token_types,
        scores,
        merges,
        bos_id: opt_u64("bos_token_id")?,
        eos_id: opt_u64("eos_token_id")?,
        eot_id: opt_u64("eot_token_id")?,
        eom_id: opt_u64("eom_token_id")?,
        unk_id: opt_u64("unknown_token_id")?,
        pad_id: opt_u64("padding_token_id")?,
        add_bos: opt_bool("add_bos_token")?,
        add_eos: opt_bool("add_eos_token")?,
        add_space_prefix: opt_bool("add_space_prefix")?,
    })
}
