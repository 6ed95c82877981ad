//! [`TextCodec`] over a GGUF model's own tokenizer and chat template.

use super::text::{Message, TextCodec};
use crate::chat::ChatTemplate;
use crate::tokenizer::Tokenizer;
use crate::ServingError;

/// The tokenizer and (when the GGUF has one) the chat template of a model.
pub struct GgufText {
    tok: Tokenizer,
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
        let tok = Tokenizer::from_gguf(meta)?;
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
        Ok(GgufText {
            tok,
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
        self.tok
            .encode(text, parse_special)
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
        t.render_json(
            &serde_json::Value::Array(msgs),
            add_generation_prompt,
            kwargs,
        )
        .map_err(|e| e.to_string())
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
