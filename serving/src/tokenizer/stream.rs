//! Incremental detokenization for streaming: tokens may end in the middle of a UTF-8 character
//! (byte-level BPE splits emoji and CJK across tokens), so bytes are held back until complete.

use super::Tokenizer;
use crate::ServingError;

/// Streaming decoder state. It holds no reference to the tokenizer, so an engine can keep one
/// per sequence next to an `Arc<Tokenizer>`; [`Tokenizer::decode_stream`] bundles both.
///
/// Concatenating every `push` result and the final `finish` gives exactly
/// `Tokenizer::decode(ids, skip_special)` for byte-level BPE models. For SentencePiece models the
/// stream keeps the leading space of the first token (it continues earlier text), while `decode`
/// drops it as the SentencePiece decoder does.
#[derive(Debug, Clone, Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
    skip_special: bool,
}

impl Detokenizer {
    pub fn new(skip_special: bool) -> Self {
        Self {
            pending: Vec::new(),
            skip_special,
        }
    }

    /// Feeds one token; returns the text completed by it (possibly empty). Invalid UTF-8 becomes
    /// U+FFFD as soon as it is known to be invalid, as in `String::from_utf8_lossy`.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, ServingError> {
        let bytes = tok.piece(id)?;
        if self.skip_special && tok.is_special(id) {
            return Ok(String::new());
        }
        self.pending.extend_from_slice(bytes);
        Ok(self.drain_complete())
    }

    /// Whether bytes of an unfinished character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: whatever is held back is flushed lossily.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 by definition, so this never substitutes.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }
}

/// A [`Detokenizer`] bound to its tokenizer (HF's `decode_stream` shape).
pub struct DecodeStream<'a> {
    tok: &'a Tokenizer,
    state: Detokenizer,
}

impl<'a> DecodeStream<'a> {
    pub(crate) fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        Self {
            tok,
            state: Detokenizer::new(skip_special),
        }
    }

    /// Feeds one token; `None` until some complete text is available.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, ServingError> {
        let s = self.state.push(self.tok, id)?;
        Ok((!s.is_empty()).then_some(s))
    }

    /// Flushes held-back bytes lossily.
    pub fn finish(&mut self) -> String {
        self.state.finish()
    }
}
