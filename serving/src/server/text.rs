//! The text side of serving: what the server needs from a tokenizer and chat template
//! ([`TextCodec`]), and the conversion of the engine's token stream into text pieces — UTF-8
//! boundaries across tokens, stop strings, and the split of GLM thinking text into
//! `reasoning_content`.

use crate::engine::{Event, FinishReason, Generation, TokenLogprobs, Usage};
pub use crate::tokenizer::Bounded;
use std::sync::Arc;

/// One chat message as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's thinking text (GLM templates render it inside `<think>`).
    pub reasoning_content: Option<String>,
    /// Calls an assistant turn made.
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// The function a `tool` message comes from.
    pub name: Option<String>,
    /// `content` was written by the server (the generic tool prompt), its markers meant as the
    /// model's control tokens, with every client-supplied part already passed through
    /// [`TextCodec::escape_content`]; [`TextCodec::render_chat`] escapes the message's other
    /// fields but not this `content`. Never set for a client's message.
    pub content_escaped: bool,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            ..Message::default()
        }
    }

    /// The message as chat templates receive it (transformers' conventions: tool call
    /// arguments as an object, so templates can iterate them).
    pub fn to_template_json(&self) -> serde_json::Value {
        let mut m = serde_json::json!({"role": self.role, "content": self.content});
        if let Some(r) = &self.reasoning_content {
            m["reasoning_content"] = r.clone().into();
        }
        if !self.tool_calls.is_empty() {
            let calls: Vec<serde_json::Value> = self
                .tool_calls
                .iter()
                .map(|c| {
                    let args = serde_json::from_str::<serde_json::Value>(&c.arguments)
                        .unwrap_or_else(|_| c.arguments.clone().into());
                    serde_json::json!({"id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": args}})
                })
                .collect();
            m["tool_calls"] = calls.into();
        }
        if let Some(id) = &self.tool_call_id {
            m["tool_call_id"] = id.clone().into();
        }
        if let Some(n) = &self.name {
            m["name"] = n.clone().into();
        }
        m
    }
}

/// One function call: OpenAI's `tool_calls[i]` (`arguments` is JSON text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// Tokenizer and chat template of the served model. The real binary wraps the GGUF tokenizer;
/// tests use small mocks.
pub trait TextCodec: Send + Sync {
    /// Text to token ids; `parse_special` turns special-token text (`<|user|>`) into its id.
    fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, String>;
    /// The bytes a token stands for (a special token: its text). `None` for an unknown id.
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>>;
    /// Control tokens (`<|user|>`, `<think>`, ...) that are not shown in generated text.
    fn is_special(&self, id: u32) -> bool;
    /// Ids that end a generation.
    fn eog_ids(&self) -> Vec<u32>;
    /// The id of a token by its exact text, if the vocabulary has it.
    fn token_id(&self, piece: &str) -> Option<u32>;
    /// Render a conversation with the model's chat template; `kwargs` are extra template
    /// variables (`enable_thinking`, ...). Control-token text in client strings stays text (see
    /// [`encode_chat`](Self::encode_chat)), except in the `content` of messages marked
    /// [`Message::content_escaped`].
    fn render_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, String>;

    /// The chat template's source, when the model has one.
    fn chat_template(&self) -> Option<&str> {
        None
    }

    /// Top-level variables the chat template reads (`enable_thinking`, `tools`, ...), so that a
    /// template kwarg it never reads is refused instead of silently ignored. `None`: unknown.
    fn template_variables(&self) -> Option<std::collections::BTreeSet<String>> {
        None
    }

    /// [`encode`](Self::encode) with the work bounded: more than `limit` tokens is reported as
    /// `Exceeds` without tokenizing the rest (the GGUF codec stops at `limit + 1`).
    fn encode_bounded(
        &self,
        text: &str,
        parse_special: bool,
        limit: usize,
    ) -> Result<Bounded, String> {
        let ids = self.encode(text, parse_special)?;
        Ok(if ids.len() > limit {
            Bounded::Exceeds { limit }
        } else {
            Bounded::Complete(ids)
        })
    }

    /// Tokenize a prompt returned by [`render_chat`](Self::render_chat): special tokens the
    /// template wrote become their ids, special-token text from message content stays text.
    fn encode_chat(&self, rendered: &str, limit: usize) -> Result<Bounded, String> {
        self.encode_bounded(rendered, true, limit)
    }

    /// Client text for the `content` of a [`Message::content_escaped`] message: control-token
    /// text neutralized exactly as [`render_chat`](Self::render_chat) neutralizes a client's
    /// message. Unchanged by default (a codec whose template does not escape content).
    fn escape_content<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        std::borrow::Cow::Borrowed(text)
    }

    /// Text of a token sequence; `skip_special` leaves control tokens out.
    fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            if let Some(b) = self.token_bytes(id) {
                bytes.extend_from_slice(&b);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Turns a stream of byte chunks into text, holding back an incomplete UTF-8 sequence at the end
/// until the next token completes it (byte-level BPE splits characters across tokens).
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // Invalid bytes never become valid: replace them now.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + n;
                        }
                        // Incomplete sequence at the end: wait for more bytes.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// End of stream: whatever is left is shown as replacement characters.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Finds stop strings in streamed text. Text that could still become the start of a stop string
/// is held back, so a stop string is never sent even when it spans several tokens.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    matched: Option<String>,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// Add text; returns the text that is safe to send and whether a stop string was found
    /// (then the returned text ends right before it and the rest is dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s)))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, stop)) = first {
            self.matched = Some(stop.clone());
            let out = self.held[..pos].to_string();
            self.held.clear();
            return (out, true);
        }
        // Longest suffix of `held` that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.held.char_indices() {
                let suffix = &self.held[i..];
                if suffix.len() <= keep {
                    break;
                }
                if s.starts_with(suffix) {
                    keep = suffix.len();
                    break;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// End of generation: the held text was not a stop string after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }
}

/// Where a piece of generated chat text belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    Content,
    Reasoning,
}

/// One generated token as reported in `logprobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    pub id: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// What the server turns into response JSON.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Prompt logprobs (echo), one entry per prompt token after the first.
    Prompt(Vec<TokenLogprobs>),
    /// Text for one channel plus the tokens that produced it (possibly empty text while a
    /// character or a possible stop string is incomplete).
    Text {
        channel: Channel,
        text: String,
        tokens: Vec<TokenInfo>,
    },
    Finish {
        reason: FinishReason,
        usage: Usage,
        /// The stop string that ended the generation, if one did.
        stop: Option<String>,
    },
    Error(String),
}

/// Options of one generation's text conversion.
#[derive(Debug, Clone, Default)]
pub struct TextOptions {
    pub stop: Vec<String>,
    /// `(open, close)` ids of the thinking markers; `None` disables the reasoning split.
    pub think: Option<(u32, u32)>,
    /// The prompt ended inside an open thinking block.
    pub start_in_reasoning: bool,
    /// Reported in the usage of a generation cut by a stop string.
    pub prompt_tokens: usize,
    /// Control tokens whose text is shown anyway (tool-call markers a parser needs to see).
    pub visible_specials: Vec<u32>,
    /// Keep thinking text in the content, markers included (llama-server's
    /// `reasoning_format: none`).
    pub reasoning_inline: bool,
}

/// Converts a [`Generation`]'s events to [`Piece`]s. Dropping it cancels the generation.
pub struct TextStream {
    rx: Option<Generation>,
    codec: Arc<dyn TextCodec>,
    utf8: Utf8Stream,
    stop: StopMatcher,
    channel: Channel,
    think: Option<(u32, u32)>,
    generated: usize,
    prompt_tokens: usize,
    visible: Vec<u32>,
    queued: std::collections::VecDeque<Piece>,
}

impl TextStream {
    pub fn new(rx: Generation, codec: Arc<dyn TextCodec>, opts: TextOptions) -> Self {
        let mut visible = opts.visible_specials;
        let think = if opts.reasoning_inline {
            visible.extend(opts.think.iter().flat_map(|&(a, b)| [a, b]));
            None
        } else {
            opts.think
        };
        let channel = if think.is_some() && opts.start_in_reasoning {
            Channel::Reasoning
        } else {
            Channel::Content
        };
        TextStream {
            rx: Some(rx),
            codec,
            utf8: Utf8Stream::default(),
            stop: StopMatcher::new(opts.stop),
            channel,
            think,
            generated: 0,
            prompt_tokens: opts.prompt_tokens,
            visible,
            queued: Default::default(),
        }
    }

    /// The next piece; `None` after `Finish` or `Error`.
    pub async fn next(&mut self) -> Option<Piece> {
        loop {
            if let Some(p) = self.queued.pop_front() {
                return Some(p);
            }
            let rx = self.rx.as_mut()?;
            let ev = rx.recv().await;
            self.handle(ev);
        }
    }

    /// Stops the generation now (the engine cancels it when the receiver is gone) and returns
    /// the usage so far.
    pub fn cancel(&mut self) -> Usage {
        self.rx = None;
        self.queued.clear();
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.generated,
        }
    }

    /// Release held-back text at the end of a channel or of the generation. A stop string
    /// completed by the final bytes still cuts the text.
    fn flush(&mut self) -> String {
        let tail = self.utf8.finish();
        let (mut out, stopped) = self.stop.push(&tail);
        if !stopped {
            out.push_str(&self.stop.finish());
        }
        out
    }

    fn handle(&mut self, ev: Option<Event>) {
        match ev {
            Some(Event::PromptLogprobs(lps)) => self.queued.push_back(Piece::Prompt(lps)),
            Some(Event::Token { id, logprobs }) => {
                self.generated += 1;
                let info = TokenInfo { id, logprobs };
                if let Some((open, close)) = self.think {
                    let switch_to = if id == open {
                        Some(Channel::Reasoning)
                    } else if id == close {
                        Some(Channel::Content)
                    } else {
                        None
                    };
                    if let Some(ch) = switch_to {
                        // A stop string cannot span the marker; the text so far is final.
                        let text = self.flush();
                        self.queued.push_back(Piece::Text {
                            channel: self.channel,
                            text,
                            tokens: vec![info],
                        });
                        self.channel = ch;
                        return;
                    }
                }
                let bytes = if self.codec.is_special(id) && !self.visible.contains(&id) {
                    Vec::new()
                } else {
                    self.codec.token_bytes(id).unwrap_or_default()
                };
                let text = self.utf8.push(&bytes);
                let (text, stopped) = self.stop.push(&text);
                self.queued.push_back(Piece::Text {
                    channel: self.channel,
                    text,
                    tokens: vec![info],
                });
                if stopped {
                    // Dropping the receiver cancels the sequence in the engine.
                    self.rx = None;
                    self.queued.push_back(Piece::Finish {
                        reason: FinishReason::Stop,
                        usage: Usage {
                            prompt_tokens: self.prompt_tokens,
                            completion_tokens: self.generated,
                        },
                        stop: self.stop.matched().map(str::to_string),
                    });
                }
            }
            Some(Event::Finished { reason, usage }) => {
                let text = self.flush();
                if !text.is_empty() {
                    self.queued.push_back(Piece::Text {
                        channel: self.channel,
                        text,
                        tokens: Vec::new(),
                    });
                }
                self.queued.push_back(Piece::Finish {
                    reason,
                    usage,
                    stop: self.stop.matched().map(str::to_string),
                });
                self.rx = None;
            }
            Some(Event::Failed(msg)) => {
                self.queued.push_back(Piece::Error(msg));
                self.rx = None;
            }
            None => {
                self.queued
                    .push_back(Piece::Error("the engine ended the request".into()));
                self.rx = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_across_tokens() {
        let mut u = Utf8Stream::default();
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(u.push(&[b'a', euro[0]]), "a");
        assert_eq!(u.push(&euro[1..2]), "");
        assert_eq!(u.push(&euro[2..]), "€");
        assert_eq!(u.push(&[0xff, b'b']), "\u{fffd}b");
        assert_eq!(u.push(&[0xe2]), "");
        assert_eq!(u.finish(), "\u{fffd}");
    }

    #[test]
    fn stop_string_across_pieces() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abc E"), ("abc ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("Dzzz"), (String::new(), true));
    }

    #[test]
    fn stop_prefix_that_does_not_match_is_released() {
        let mut m = StopMatcher::new(vec!["END".into(), "xy".into()]);
        assert_eq!(m.push("EN"), (String::new(), false));
        assert_eq!(m.push("O"), ("ENO".to_string(), false));
        assert_eq!(m.push("x"), (String::new(), false));
        assert_eq!(m.finish(), "x");
    }

    #[test]
    fn earliest_stop_wins() {
        let mut m = StopMatcher::new(vec!["c".into(), "ab".into()]);
        assert_eq!(m.push("zabc"), ("z".to_string(), true));
        assert_eq!(m.matched(), Some("ab"));
    }

    #[test]
    fn stop_with_multibyte_text() {
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("aé"), ("a".to_string(), false));
        assert_eq!(m.push("b"), ("éb".to_string(), false));
        assert_eq!(m.push("é!"), (String::new(), true));
    }
}
