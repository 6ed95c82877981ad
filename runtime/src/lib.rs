//! The gguftool runtime: model description from GGUF hyper-parameters, the CPU reference backend
//! (and CUDA backend), tokenizer, chat template, engine (KV cache, sampling, batching) and HTTP server.

pub mod chat;
pub mod engine;
pub mod error;
pub mod lm;
pub mod sampler;
pub mod server;
pub mod tokenizer;

pub use error::RuntimeError;
pub use lm::{LanguageModel, SeqStep, SequenceState};
pub mod backend;
pub mod cpu;
pub mod weights;
pub mod spec;
pub mod cache;
pub mod glm;
