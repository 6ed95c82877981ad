//! The gguftool runtime: model description from GGUF hyper-parameters, the one forward definition
//! written against the op-level `Backend` trait, the CPU reference backend and the CUDA backend.
//! Serving (tokenizer, sampler, engine, HTTP) lives in the `serving` crate.

pub mod backend;
pub mod cache;
pub mod cpu;
pub mod error;
pub mod glm;
pub mod lm;
pub mod numerics;
pub mod sampling;
pub mod spec;
pub mod tp;
pub mod weights;

pub use error::RuntimeError;
pub use lm::{LanguageModel, SeqStep, SequenceState, TopTokens};
pub mod cuda;
pub mod device;
