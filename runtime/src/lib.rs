//! The gguftool runtime: model description from GGUF hyper-parameters, the CPU reference backend
//! (and CUDA backend), tokenizer, chat template, engine (KV cache, sampling, batching) and HTTP server.

pub mod backend;
pub mod cache;
pub mod chat;
pub mod cpu;
pub mod engine;
pub mod error;
pub mod glm;
pub mod lm;
pub mod sampler;
pub mod server;
pub mod spec;
pub mod tokenizer;
pub mod weights;

pub use error::RuntimeError;
pub use lm::{LanguageModel, SeqStep, SequenceState};
pub mod cuda;
pub mod device;
