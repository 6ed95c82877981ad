//! [`TextCodec`] over a GGUF model's own tokenizer and chat template.

use super::text::{Bounded, Message, TextCodec};
use crate::chat::ChatTemplate;
use crate::tokenizer::Tokenizer;
use crate::ServingError;
use std::sync::Arc;

/// The tokenizer and (when the GGUF has one) the chat template of a model. The template escapes
/// control-token text in everything the client sends, and chat prompts are tokenized with
/// [`Tokenizer::encode_chat`], so a message cannot smuggle in `<|assistant|>`. Messages the
/// server wrote ([`Message::content_escaped`]) keep their markers as control tokens; their
/// client parts went through [`TextCodec::escape_content`], the same escaper.
pub struct GgufText {
    tok: Arc<Tokenizer>,
    /// Renders and tokenizations running at once: their transient memory (tens of bytes per
    /// prompt byte for a long single "word") is what a flood of huge prompts would multiply.
    jobs: Jobs,
    template: Option<ChatTemplate>,
    /// Why there is no template, reported to chat requests.
    template_error: Option<String>,
}

impl GgufText {
    /// A model without a usable chat template still serves `/v1/completions`; chat requests
    /// then get a 400 naming the reason.
    pub fn from_gguf(meta: &gguf::Metadata) -> Result<Self, ServingError> {
        Self::with_template(meta, None)
    }

    /// Like [`GgufText::from_gguf`], with `template` (Jinja source, e.g. from
    /// `--chat-template FILE`) replacing the GGUF's own chat template. A template that does
    /// not compile is an error here, not a disabled chat endpoint.
    pub fn with_template(
        meta: &gguf::Metadata,
        template: Option<&str>,
    ) -> Result<Self, ServingError> {
        let tok = Arc::new(Tokenizer::from_gguf(meta)?);
        let (template, template_error) = match template {
            Some(src) => {
                let token_text =
                    |id: Option<u32>| id.and_then(|i| tok.token_text(i)).map(str::to_string);
                let t = ChatTemplate::new(src, token_text(tok.bos_id()), token_text(tok.eos_id()))?;
                (Some(t), None)
            }
            None => match ChatTemplate::from_gguf(meta) {
                Ok(t) => (Some(t), None),
                Err(e) => (None, Some(e.to_string())),
            },
        };
        // Whichever template it is, client strings reach it with control-token text escaped.
        let template = template.map(|mut t| {
            let esc = Arc::clone(&tok);
            t.set_content_escaper(Arc::new(move |s| esc.escape_control_text(s)));
            t
        });
        Ok(GgufText {
            tok,
            jobs: Jobs::new(
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(2)
                    .max(2),
            ),
            template,
            template_error,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// Why chat is unavailable, if it is.
    pub fn template_error(&self) -> Option<&str> {
        self.template_error.as_deref()
    }
}

impl TextCodec for GgufText {
    fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, String> {
        let _job = self.jobs.acquire();
        self.tok
            .encode(text, parse_special)
            .map_err(|e| e.to_string())
    }
    fn encode_bounded(
        &self,
        text: &str,
        parse_special: bool,
        limit: usize,
    ) -> Result<Bounded, String> {
        let _job = self.jobs.acquire();
        self.tok
            .encode_bounded(text, parse_special, limit)
            .map_err(|e| e.to_string())
    }
    fn encode_chat(&self, rendered: &str, limit: usize) -> Result<Bounded, String> {
        let _job = self.jobs.acquire();
        self.tok
            .encode_chat(rendered, limit)
            .map_err(|e| e.to_string())
    }
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.tok.token_bytes(id)
    }
    fn is_special(&self, id: u32) -> bool {
        self.tok.is_special(id)
    }
    fn eog_ids(&self) -> Vec<u32> {
        self.tok.eog_ids().to_vec()
    }
    fn token_id(&self, piece: &str) -> Option<u32> {
        self.tok.token_id(piece)
    }
    fn render_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, String> {
        let Some(t) = &self.template else {
            return Err(format!(
                "this model has no usable chat template ({}); use /v1/completions",
                self.template_error.as_deref().unwrap_or("absent")
            ));
        };
        let msgs: Vec<serde_json::Value> = messages.iter().map(Message::to_template_json).collect();
        let escaped: Vec<bool> = messages.iter().map(|m| m.content_escaped).collect();
        let _job = self.jobs.acquire();
        t.render_json_with_escaped_content(
            serde_json::Value::Array(msgs),
            &escaped,
            add_generation_prompt,
            kwargs,
        )
        .map_err(|e| e.to_string())
    }
    fn escape_content<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        match self.tok.escape_control_text(text) {
            Some(e) => std::borrow::Cow::Owned(e),
            None => std::borrow::Cow::Borrowed(text),
        }
    }
    fn chat_template(&self) -> Option<&str> {
        self.template.as_ref().map(ChatTemplate::source)
    }
    fn template_variables(&self) -> Option<std::collections::BTreeSet<String>> {
        self.template.as_ref().map(ChatTemplate::variables)
    }
    fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        // The tokenizer knows model-specific decoding rules (SentencePiece space prefix).
        self.tok
            .decode(ids, skip_special)
            .unwrap_or_else(|_| String::from_utf8_lossy(&ids_bytes(self, ids)).into_owned())
    }
}

fn ids_bytes(t: &GgufText, ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .filter_map(|&id| t.tok.token_bytes(id))
        .flatten()
        .collect()
}

/// A counting semaphore for blocking callers (the server runs these jobs on tokio's blocking
/// pool, which would otherwise run hundreds at once).
struct Jobs {
    free: std::sync::Mutex<usize>,
    wake: std::sync::Condvar,
}

struct Job<'a>(&'a Jobs);

impl Jobs {
    fn new(n: usize) -> Self {
        Jobs {
            free: std::sync::Mutex::new(n),
            wake: std::sync::Condvar::new(),
        }
    }

    fn acquire(&self) -> Job<'_> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        while *free == 0 {
            free = self.wake.wait(free).unwrap_or_else(|e| e.into_inner());
        }
        *free -= 1;
        Job(self)
    }
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.0.wake.notify_one();
    }
}
