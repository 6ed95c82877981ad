//! HF <-> GGUF tensor-name mapping: one YAML table per architecture (the single source of truth),
//! both directions derived from it, composite transforms (expert stacking, kv_b split/reassembly)
//! and tensor-parallel slicing (shard roles from the tables, byte ranges of each rank's share).

pub mod arch_check;
pub mod export;
pub mod expr;
pub mod hf;
pub mod hfconfig;
pub mod import;
pub mod kvb;
pub mod names;
pub mod shard;
pub mod table;
pub mod values;

pub use arch_check::{check_architecture, ArchReport};
pub use names::{map_gguf_names, map_hf_names, Direction, GgufName, MapRow, NameMap};
pub use table::{architectures, table, table_for_model_type, Kind, Table};

use std::path::PathBuf;

/// Errors of the mapping layer. Each names the architecture, tensor or file involved.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MappingError {
    /// An embedded YAML table is malformed (a bug caught by the crate's tests).
    #[error("mapping table {arch}: {msg}")]
    BadTable { arch: String, msg: String },
    #[error("no mapping table for architecture {arch:?} (known: {known})")]
    UnknownArch { arch: String, known: String },
    #[error("no mapping table for HF model_type {model_type:?}")]
    UnknownModelType { model_type: String },
    /// A buffer or shape that does not fit the operation.
    #[error("{what}: {msg}")]
    Shape { what: String, msg: String },
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("tensor {tensor:?}: {msg}")]
    Tensor { tensor: String, msg: String },
    /// A tensor-parallel split inside the rows that would cut a quant block.
    #[error("a split at elements {range:?} of {ne0}-element rows cuts {ty} blocks of {block}")]
    SplitCutsBlock {
        ty: gguf::GgmlType,
        block: u64,
        range: std::ops::Range<u64>,
        ne0: u64,
    },
    /// The caller asked to stop (Ctrl-C).
    #[error("interrupted")]
    Interrupted,
}
