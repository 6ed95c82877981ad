//! Serving a loaded model: the GGUF tokenizer, chat templates, sampling, the engine (KV-cache
//! ownership, continuous batching, bounded queue) and the OpenAI-compatible HTTP server. Knows
//! models only through `runtime::LanguageModel`.

pub mod chat;
pub mod engine;
pub mod error;
pub mod grammar;
pub mod sampler;
pub mod server;
pub mod speculative;
pub mod tokenizer;

pub use error::ServingError;
