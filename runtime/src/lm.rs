//! The one interface between a loaded model (any backend) and its users: `generate`, the engine
//! and the server. Object-safe so the server can hold a CPU or a CUDA model alike.

use crate::RuntimeError;
use std::any::Any;

/// Per-sequence state owned by the model (KV cache: latent + rope part + indexer keys).
pub trait SequenceState: Send {
    /// Tokens already in the cache.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes of cache memory this sequence holds (for metrics).
    fn cache_bytes(&self) -> usize;
    /// Backends downcast to their own cache type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// One sequence's part of a batched forward step.
pub struct SeqStep<'a> {
    pub seq: &'a mut dyn SequenceState,
    /// Tokens appended to the sequence in this step (the whole prompt, or one decoded token).
    pub tokens: &'a [u32],
    /// Return logits for every appended token (prompt logprobs / echo) instead of the last only.
    pub all_logits: bool,
}

/// A loaded causal language model.
pub trait LanguageModel: Send + Sync {
    fn new_sequence(&self) -> Box<dyn SequenceState>;
    fn vocab_size(&self) -> usize;
    /// Longest sequence (prompt + generated) the model accepts.
    fn context_length(&self) -> usize;
    /// Append each step's tokens to its sequence and return its logits, row-major
    /// (`tokens.len() * vocab` values when `all_logits`, else `vocab` values for the last token).
    /// Sequences in one call share the weight reads (continuous batching).
    fn forward(&self, batch: &mut [SeqStep<'_>]) -> Result<Vec<Vec<f32>>, RuntimeError>;
}
