//! The GGUF container and everything about tensors as stored: reading (mmap or streaming) with
//! llama.cpp's validation rules, byte-exact writing, split shards, ggml quant block formats with
//! scalar reference dequantizers, and per-tensor statistics. Knows nothing about models.
//!
//! Byte order: only little-endian files are read. A byte-swapped (big-endian, gguf-py
//! `--bigendian`) file is detected by its version field and refused with [`Error::BigEndian`].

pub mod copy;
pub mod edit;
pub mod error;
pub mod metadata;
pub mod model;
pub mod quant;
pub mod reader;
pub mod split;
pub mod stats;
pub mod types;
pub mod value;
pub mod writer;

pub use error::{Error, Location, Result};
pub use metadata::Metadata;
pub use model::{GgufFile, Model, SplitInfo, TensorRef};
pub use reader::{Header, TensorInfo, DEFAULT_ALIGNMENT};
pub use types::{GgmlType, QK_K};
pub use value::{Array, Value, ValueType};
