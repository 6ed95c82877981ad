//! The serving crate's error type.

use runtime::RuntimeError;

/// Errors from tokenizing, rendering a chat template or running the model behind the server.
#[derive(Debug, thiserror::Error)]
pub enum ServingError {
    /// The model (loading or a forward pass).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Gguf(#[from] gguf::Error),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    /// The engine's scheduler thread could not be started.
    #[error("cannot start the engine thread: {0}")]
    Thread(#[source] std::io::Error),
}
