//! Typed errors of the container layer. Every variant names the file and, where it applies, the key
//! or tensor and the byte offset, so a user can find the fault with a hex dump.

use std::path::PathBuf;

/// Where in which file a problem was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    pub offset: u64,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at byte {}", self.file.display(), self.offset)
    }
}

/// Errors reading, validating or writing GGUF files.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{at}: file truncated reading {what}: need {need} bytes, {have} left")]
    Truncated {
        at: Location,
        what: String,
        need: u64,
        have: u64,
    },
    #[error("{at}: not a GGUF file (starts with \"{}\", expected \"GGUF\")", got.escape_ascii())]
    BadMagic { at: Location, got: [u8; 4] },
    #[error("{at}: byte-swapped (big-endian) GGUF (version field {raw:#010x}); only little-endian files are supported, convert it with gguf-py")]
    BigEndian { at: Location, raw: u32 },
    #[error("{at}: unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedVersion { at: Location, version: u32 },
    #[error("{at}: {what} count {count} cannot fit in the {remaining} bytes left in the file")]
    CountTooLarge {
        at: Location,
        what: &'static str,
        count: u64,
        remaining: u64,
    },
    #[error("{at}: string of {len} bytes exceeds the limit of {max}")]
    StringTooLong { at: Location, len: u64, max: u64 },
    #[error("{at}: string is not valid UTF-8")]
    InvalidUtf8 { at: Location },
    #[error("{at}: key {key:?}: array of {count} elements exceeds the limit of {max}")]
    ArrayTooLong {
        at: Location,
        key: String,
        count: u64,
        max: u64,
    },
    #[error("{at}: key {key:?}: arrays nested deeper than {max}")]
    ArrayTooDeep {
        at: Location,
        key: String,
        max: usize,
    },
    #[error("{at}: key {key:?}: unknown value type id {id}")]
    UnknownValueType { at: Location, key: String, id: u32 },
    #[error("{at}: key {key:?}: decoded metadata would exceed {max} bytes of memory")]
    MetadataTooLarge { at: Location, key: String, max: u64 },
    #[error("{at}: empty metadata key")]
    EmptyKey { at: Location },
    #[error("{at}: duplicate metadata key {key:?}")]
    DuplicateKey { at: Location, key: String },
    #[error("{at}: general.alignment must be a UINT32 power of two, got {value}")]
    BadAlignment { at: Location, value: String },
    #[error("{at}: tensor {tensor:?}: name of {len} bytes exceeds the limit of 63")]
    TensorNameTooLong {
        at: Location,
        tensor: String,
        len: usize,
    },
    #[error("{at}: duplicate tensor name {tensor:?}")]
    DuplicateTensor { at: Location, tensor: String },
    #[error("{at}: tensor {tensor:?}: {n_dims} dimensions (at most 4)")]
    TooManyDims {
        at: Location,
        tensor: String,
        n_dims: u32,
    },
    #[error("{at}: tensor {tensor:?}: unknown ggml type id {id}")]
    UnknownTensorType {
        at: Location,
        tensor: String,
        id: u32,
    },
    #[error("{at}: tensor {tensor:?}: shape {dims:?} overflows the element or byte count")]
    ShapeOverflow {
        at: Location,
        tensor: String,
        dims: Vec<u64>,
    },
    #[error("{at}: tensor {tensor:?}: ne0 = {ne0} is not a multiple of {ty}'s block size {block}")]
    BlockMisaligned {
        at: Location,
        tensor: String,
        ty: crate::GgmlType,
        ne0: u64,
        block: usize,
    },
    #[error(
        "{at}: tensor {tensor:?}: offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedOffset {
        at: Location,
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error("{at}: tensor {tensor:?}: data [{start}, {end}) overlaps tensor {other:?}")]
    OverlappingTensors {
        at: Location,
        tensor: String,
        other: String,
        start: u64,
        end: u64,
    },
    #[error("{at}: tensor {tensor:?}: data ends at byte {end} but the file has {file_size} bytes")]
    TensorOutOfBounds {
        at: Location,
        tensor: String,
        end: u64,
        file_size: u64,
    },
    #[error("{file}: tensor {tensor:?}: offset {got}, expected {expected}")]
    OffsetMismatch {
        file: PathBuf,
        tensor: String,
        expected: u64,
        got: u64,
    },
    #[error("{file}: metadata key {key:?} is missing")]
    MissingKey { file: PathBuf, key: String },
    #[error("{file}: metadata key {key:?} has type {got}, expected {expected}")]
    WrongType {
        file: PathBuf,
        key: String,
        expected: &'static str,
        got: String,
    },
    #[error("{file}: no tensor named {tensor:?}")]
    NoSuchTensor { file: PathBuf, tensor: String },
    /// A set of split shards that does not form one model.
    #[error("{file}: split: {message}")]
    Split { file: PathBuf, message: String },
    /// An importance-matrix file that cannot be used.
    #[error("{file}: importance matrix: {message}")]
    Imatrix { file: PathBuf, message: String },
    /// The path is a directory, FIFO, socket or device: refused before anything is read.
    #[error("{path}: is {kind}, not a regular file")]
    NotRegularFile { path: PathBuf, kind: &'static str },
    /// Building a file to write from inconsistent parts.
    #[error("write: {0}")]
    Write(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
