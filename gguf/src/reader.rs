//! Parsing and validating the GGUF header (metadata and tensor infos), over a byte slice (mmap)
//! or a plain `Read` stream. Every count and length is checked against the bytes that remain
//! (when known) and against fixed caps before anything is allocated.

use crate::error::{Error, Location, Result};
use crate::metadata::Metadata;
use crate::types::GgmlType;
use crate::value::{Array, Value, ValueType};
use std::collections::HashSet;
use std::io::Read;
use std::path::{Path, PathBuf};

pub const MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// llama.cpp's caps (`GGUF_MAX_STRING_LENGTH`, `GGUF_MAX_ARRAY_ELEMENTS`).
pub const MAX_STRING_LENGTH: u64 = 1 << 30;
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 30;
/// gguf-py writes nested arrays; llama.cpp refuses them. We parse a few levels and stop there so
/// a hostile file cannot recurse without bound.
pub const MAX_ARRAY_DEPTH: usize = 4;
pub const MAX_DIMS: u32 = 4;
/// Cap on the heap the decoded metadata of one file may take (GLM-5's 154,880-token vocabulary
/// and merges take ~20 MiB).
pub const MAX_METADATA_HEAP: u64 = 1 << 30;
/// `GGML_MAX_NAME` is 64 including the NUL terminator.
pub const MAX_TENSOR_NAME: usize = 63;
/// Fewest bytes a key/value pair (key length, empty key, type, 1-byte value) or a tensor info
/// (name length, n_dims, no dims, type, offset) can take: bounds the counts in the header.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;
/// A stream is read in pieces of this size so an allocation never runs ahead of the data.
const STREAM_CHUNK: usize = 1 << 20;

/// One tensor's entry in the tensor-info table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order (`ne`): innermost (row) dimension first, exactly as many as stored.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Element count (validated not to overflow when read).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Stored bytes: `(ne0 / block) * type_size * ne1 * ne2 * ne3` (validated when read).
    pub fn n_bytes(&self) -> u64 {
        let bs = self.ty.block_size() as u64;
        let row = self.dims.first().copied().unwrap_or(1) / bs * self.ty.type_size() as u64;
        self.dims.iter().skip(1).fold(row, |acc, d| acc * d)
    }

    /// Shape in HF/numpy order (outermost first).
    pub fn shape_rowmajor(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Checked element and byte counts, `None` on overflow or block misfit.
    fn checked_sizes(dims: &[u64], ty: GgmlType) -> Option<(u64, u64)> {
        let mut n: u64 = 1;
        for &d in dims {
            n = n.checked_mul(d)?;
        }
        // ggml counts in int64_t: stay below i64::MAX like gguf.cpp does.
        if n > i64::MAX as u64 {
            return None;
        }
        let row = ty.row_bytes(dims.first().copied().unwrap_or(1))?;
        let mut bytes = row;
        for &d in dims.iter().skip(1) {
            bytes = bytes.checked_mul(d)?;
        }
        if bytes > i64::MAX as u64 {
            return None;
        }
        Some((n, bytes))
    }
}

/// The parsed header of one GGUF file: everything before the tensor data.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Byte offset where the tensor-info table ends (before alignment padding).
    pub infos_end: u64,
    /// Absolute offset of the data section (`infos_end` aligned up).
    pub data_offset: u64,
}

/// Where header bytes come from.
trait Input {
    fn offset(&self) -> u64;
    /// Bytes left, when known (always for slices, when given for streams).
    fn remaining(&self) -> Option<u64>;
    fn take(&mut self, n: u64, what: &str) -> Result<Vec<u8>>;
    fn loc(&self) -> Location;
    fn file(&self) -> &Path;
}

struct SliceInput<'a> {
    data: &'a [u8],
    pos: usize,
    file: PathBuf,
}

impl Input for SliceInput<'_> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }
    fn remaining(&self) -> Option<u64> {
        Some((self.data.len() - self.pos) as u64)
    }
    fn take(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        let have = (self.data.len() - self.pos) as u64;
        if n > have {
            return Err(Error::Truncated {
                at: self.loc(),
                what: what.to_string(),
                need: n,
                have,
            });
        }
        let n = n as usize;
        let out = self.data[self.pos..self.pos + n].to_vec();
        self.pos += n;
        Ok(out)
    }
    fn loc(&self) -> Location {
        Location {
            file: self.file.clone(),
            offset: self.pos as u64,
        }
    }
    fn file(&self) -> &Path {
        &self.file
    }
}

struct StreamInput<R: Read> {
    r: R,
    pos: u64,
    total: Option<u64>,
    file: PathBuf,
}

impl<R: Read> Input for StreamInput<R> {
    fn offset(&self) -> u64 {
        self.pos
    }
    fn remaining(&self) -> Option<u64> {
        self.total.map(|t| t.saturating_sub(self.pos))
    }
    fn take(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if let Some(have) = self.remaining() {
            if n > have {
                return Err(Error::Truncated {
                    at: self.loc(),
                    what: what.to_string(),
                    need: n,
                    have,
                });
            }
        }
        // Grow the buffer only as bytes arrive, so a lying length cannot make us allocate more
        // than one chunk past what the stream really holds.
        let mut out = Vec::with_capacity((n as usize).min(STREAM_CHUNK));
        let mut left = n;
        while left > 0 {
            let step = left.min(STREAM_CHUNK as u64) as usize;
            let start = out.len();
            out.resize(start + step, 0);
            let mut got = 0;
            while got < step {
                match self.r.read(&mut out[start + got..start + step]) {
                    Ok(0) => {
                        return Err(Error::Truncated {
                            at: self.loc(),
                            what: what.to_string(),
                            need: n,
                            have: n - left + got as u64,
                        })
                    }
                    Ok(k) => got += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(source) => {
                        return Err(Error::Io {
                            path: self.file.clone(),
                            source,
                        })
                    }
                }
            }
            left -= step as u64;
        }
        self.pos += n;
        Ok(out)
    }
    fn loc(&self) -> Location {
        Location {
            file: self.file.clone(),
            offset: self.pos,
        }
    }
    fn file(&self) -> &Path {
        &self.file
    }
}

fn u32_at<I: Input>(i: &mut I, what: &str) -> Result<u32> {
    let b = i.take(4, what)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn u64_at<I: Input>(i: &mut I, what: &str) -> Result<u64> {
    let b = i.take(8, what)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(&b);
    Ok(u64::from_le_bytes(a))
}

fn read_string<I: Input>(i: &mut I, what: &str) -> Result<String> {
    let at = i.loc();
    let len = u64_at(i, what)?;
    if len > MAX_STRING_LENGTH {
        return Err(Error::StringTooLong {
            at,
            len,
            max: MAX_STRING_LENGTH,
        });
    }
    let bytes = i.take(len, what)?;
    String::from_utf8(bytes).map_err(|_| Error::InvalidUtf8 { at })
}

fn check_count<I: Input>(
    i: &I,
    at: &Location,
    what: &'static str,
    count: u64,
    min_each: u64,
) -> Result<()> {
    if let Some(rem) = i.remaining() {
        if count.checked_mul(min_each).is_none_or(|need| need > rem) {
            return Err(Error::CountTooLarge {
                at: at.clone(),
                what,
                count,
                remaining: rem,
            });
        }
    }
    Ok(())
}

fn read_value<I: Input>(
    i: &mut I,
    key: &str,
    ty: ValueType,
    depth: usize,
    budget: &mut u64,
) -> Result<Value> {
    // Each decoded value costs a `Value` (plus its string bytes) on the heap: a file of 1 GiB of
    // U8 array elements would otherwise cost ~32 GiB. Real models need tens of MiB.
    let cost = std::mem::size_of::<Value>() as u64;
    if *budget < cost {
        return Err(Error::MetadataTooLarge {
            at: i.loc(),
            key: key.to_string(),
            max: MAX_METADATA_HEAP,
        });
    }
    *budget -= cost;
    let what = format!("value of {key:?}");
    Ok(match ty {
        ValueType::U8 => Value::U8(i.take(1, &what)?[0]),
        ValueType::I8 => Value::I8(i.take(1, &what)?[0] as i8),
        // gguf.cpp reads bools as int8 and treats any non-zero as true.
        ValueType::Bool => Value::Bool(i.take(1, &what)?[0] != 0),
        ValueType::U16 => {
            let b = i.take(2, &what)?;
            Value::U16(u16::from_le_bytes([b[0], b[1]]))
        }
        ValueType::I16 => {
            let b = i.take(2, &what)?;
            Value::I16(i16::from_le_bytes([b[0], b[1]]))
        }
        ValueType::U32 => Value::U32(u32_at(i, &what)?),
        ValueType::I32 => Value::I32(u32_at(i, &what)? as i32),
        ValueType::F32 => Value::F32(f32::from_bits(u32_at(i, &what)?)),
        ValueType::U64 => Value::U64(u64_at(i, &what)?),
        ValueType::I64 => Value::I64(u64_at(i, &what)? as i64),
        ValueType::F64 => Value::F64(f64::from_bits(u64_at(i, &what)?)),
        ValueType::String => {
            let s = read_string(i, &what)?;
            *budget = budget.saturating_sub(s.len() as u64);
            Value::String(s)
        }
        ValueType::Array => {
            let at = i.loc();
            if depth >= MAX_ARRAY_DEPTH {
                return Err(Error::ArrayTooDeep {
                    at,
                    key: key.to_string(),
                    max: MAX_ARRAY_DEPTH,
                });
            }
            let tid = u32_at(i, &what)?;
            let elem_type = ValueType::from_id(tid).ok_or_else(|| Error::UnknownValueType {
                at: at.clone(),
                key: key.to_string(),
                id: tid,
            })?;
            let count_at = i.loc();
            let count = u64_at(i, &what)?;
            if count > MAX_ARRAY_ELEMENTS {
                return Err(Error::ArrayTooLong {
                    at: count_at,
                    key: key.to_string(),
                    count,
                    max: MAX_ARRAY_ELEMENTS,
                });
            }
            check_count(i, &count_at, "array element", count, elem_type.min_size())?;
            let mut values = Vec::with_capacity((count as usize).min(1 << 16));
            for _ in 0..count {
                values.push(read_value(i, key, elem_type, depth + 1, budget)?);
            }
            Value::Array(Array { elem_type, values })
        }
    })
}

fn parse<I: Input>(i: &mut I) -> Result<Header> {
    let at = i.loc();
    let magic = i.take(4, "magic")?;
    if magic != MAGIC {
        let mut got = [0u8; 4];
        got.copy_from_slice(&magic);
        return Err(Error::BadMagic { at, got });
    }
    let at = i.loc();
    let version = u32_at(i, "version")?;
    if version != 0 && version & 0xFFFF == 0 {
        return Err(Error::BigEndian { at, raw: version });
    }
    if !(2..=3).contains(&version) {
        return Err(Error::UnsupportedVersion { at, version });
    }
    let at_nt = i.loc();
    let n_tensors = u64_at(i, "tensor count")?;
    let at_kv = i.loc();
    let n_kv = u64_at(i, "metadata count")?;
    // Bound both counts by the bytes left before trusting either.
    check_count(i, &at_kv, "metadata", n_kv, MIN_KV_BYTES)?;
    check_count(i, &at_nt, "tensor", n_tensors, MIN_TENSOR_INFO_BYTES)?;
    if let Some(rem) = i.remaining() {
        let need = n_kv
            .saturating_mul(MIN_KV_BYTES)
            .saturating_add(n_tensors.saturating_mul(MIN_TENSOR_INFO_BYTES));
        if need > rem {
            return Err(Error::CountTooLarge {
                at: at_nt,
                what: "tensor + metadata",
                count: n_tensors.saturating_add(n_kv),
                remaining: rem,
            });
        }
    }

    let mut entries: Vec<(String, Value)> = Vec::with_capacity((n_kv as usize).min(1 << 12));
    let mut keys = HashSet::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    let mut budget = MAX_METADATA_HEAP;
    for _ in 0..n_kv {
        let at = i.loc();
        let key = read_string(i, "metadata key")?;
        if key.is_empty() {
            return Err(Error::EmptyKey { at });
        }
        if !keys.insert(key.clone()) {
            return Err(Error::DuplicateKey { at, key });
        }
        let tat = i.loc();
        let tid = u32_at(i, "value type")?;
        let ty = ValueType::from_id(tid).ok_or_else(|| Error::UnknownValueType {
            at: tat,
            key: key.clone(),
            id: tid,
        })?;
        let value = read_value(i, &key, ty, 0, &mut budget)?;
        if key == "general.alignment" {
            match value {
                Value::U32(a) if a != 0 && a.is_power_of_two() => alignment = a as u64,
                ref other => {
                    return Err(Error::BadAlignment {
                        at,
                        value: format!("{} {}", other.value_type(), other.display_summary(4)),
                    })
                }
            }
        }
        entries.push((key, value));
    }

    let mut tensors: Vec<TensorInfo> = Vec::with_capacity((n_tensors as usize).min(1 << 16));
    let mut names = HashSet::new();
    for _ in 0..n_tensors {
        let at = i.loc();
        let name = read_string(i, "tensor name")?;
        if name.len() > MAX_TENSOR_NAME {
            return Err(Error::TensorNameTooLong {
                at,
                len: name.len(),
                tensor: name,
            });
        }
        if !names.insert(name.clone()) {
            return Err(Error::DuplicateTensor { at, tensor: name });
        }
        let dat = i.loc();
        let n_dims = u32_at(i, "tensor n_dims")?;
        if n_dims > MAX_DIMS {
            return Err(Error::TooManyDims {
                at: dat,
                tensor: name,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(u64_at(i, "tensor dimension")?);
        }
        let tat = i.loc();
        let tid = u32_at(i, "tensor type")?;
        let ty = GgmlType::from_id(tid).ok_or_else(|| Error::UnknownTensorType {
            at: tat.clone(),
            tensor: name.clone(),
            id: tid,
        })?;
        // ggml stores ne as int64: a dimension >= 2^63 is negative there.
        if dims.iter().any(|&d| d > i64::MAX as u64) {
            return Err(Error::ShapeOverflow {
                at: dat,
                tensor: name,
                dims,
            });
        }
        let ne0 = dims.first().copied().unwrap_or(1);
        if ne0 % ty.block_size() as u64 != 0 {
            return Err(Error::BlockMisaligned {
                at: dat,
                tensor: name,
                ty,
                ne0,
                block: ty.block_size(),
            });
        }
        if TensorInfo::checked_sizes(&dims, ty).is_none() {
            return Err(Error::ShapeOverflow {
                at: dat,
                tensor: name,
                dims,
            });
        }
        let oat = i.loc();
        let offset = u64_at(i, "tensor offset")?;
        if offset % alignment != 0 {
            return Err(Error::MisalignedOffset {
                at: oat,
                tensor: name,
                offset,
                alignment,
            });
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
        });
    }
    let infos_end = i.offset();
    let data_offset = infos_end.div_ceil(alignment) * alignment;
    Ok(Header {
        version,
        metadata: Metadata::from_entries(i.file().to_path_buf(), entries),
        tensors,
        alignment,
        infos_end,
        data_offset,
    })
}

impl Header {
    /// Parse and validate the header at the start of `data` (a whole file or its mapped prefix).
    /// Tensor extents are checked against the file by [`Header::check_data_layout`].
    pub fn parse_slice(data: &[u8], file: impl Into<PathBuf>) -> Result<Header> {
        let mut i = SliceInput {
            data,
            pos: 0,
            file: file.into(),
        };
        parse(&mut i)
    }

    /// Parse from a stream. `total_len`, when known (a file's size), bounds every count; without
    /// it, allocations still grow only as bytes actually arrive.
    pub fn parse_reader<R: Read>(
        r: R,
        total_len: Option<u64>,
        file: impl Into<PathBuf>,
    ) -> Result<Header> {
        let mut i = StreamInput {
            r,
            pos: 0,
            total: total_len,
            file: file.into(),
        };
        parse(&mut i)
    }

    /// Check every tensor's data lies inside a file of `file_size` bytes and no two overlap.
    /// Gaps between tensors are accepted (see [`Header::layout_findings`]).
    pub fn check_data_layout(&self, file_size: u64) -> Result<()> {
        let file = self.metadata.file().to_path_buf();
        let mut spans: Vec<(u64, u64, &str)> = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let start = self.data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.n_bytes()));
            match end {
                Some(end) if end <= file_size => {
                    spans.push((t.offset, t.offset + t.n_bytes(), &t.name))
                }
                _ => {
                    return Err(Error::TensorOutOfBounds {
                        at: Location {
                            file,
                            offset: self.data_offset.saturating_add(t.offset),
                        },
                        tensor: t.name.clone(),
                        end: end.unwrap_or(u64::MAX),
                        file_size,
                    })
                }
            }
        }
        spans.sort_unstable();
        // Compare each span with the furthest-reaching one before it, not just its neighbour:
        // a large tensor can cover several later ones. Zero-sized tensors occupy nothing.
        let mut reach: Option<(u64, &str)> = None;
        for &(start, end, name) in spans.iter().filter(|s| s.1 > s.0) {
            if let Some((reach_end, other)) = reach {
                if start < reach_end {
                    return Err(Error::OverlappingTensors {
                        at: Location {
                            file,
                            offset: self.data_offset + start,
                        },
                        tensor: name.to_string(),
                        other: other.to_string(),
                        start,
                        end,
                    });
                }
            }
            if reach.is_none_or(|(e, _)| end > e) {
                reach = Some((end, name));
            }
        }
        Ok(())
    }

    /// Deviations from the canonical layout llama.cpp requires (each tensor at the running sum of
    /// the previous ones' aligned sizes): valid to read, but worth reporting.
    pub fn layout_findings(&self) -> Vec<Error> {
        let mut expected = 0u64;
        let mut out = Vec::new();
        for t in &self.tensors {
            if t.offset != expected {
                out.push(Error::OffsetMismatch {
                    file: self.metadata.file().to_path_buf(),
                    tensor: t.name.clone(),
                    expected,
                    got: t.offset,
                });
            }
            expected = t
                .offset
                .saturating_add(align_up(t.n_bytes(), self.alignment));
        }
        out
    }

    /// End of the data section as the canonical writer lays it out (last tensor padded).
    pub fn data_end(&self) -> u64 {
        let end = self
            .tensors
            .iter()
            .map(|t| {
                t.offset
                    .saturating_add(align_up(t.n_bytes(), self.alignment))
            })
            .max()
            .unwrap_or(0);
        // Saturating: a header not yet checked against its file may hold any offset.
        self.data_offset.saturating_add(end)
    }

    /// Equal including float bit patterns in the metadata (NaN payloads, -0.0), which
    /// `PartialEq` cannot express: what "reads back the same" means for a rewrite.
    pub fn bit_eq(&self, other: &Header) -> bool {
        self.version == other.version
            && self.tensors == other.tensors
            && self.alignment == other.alignment
            && self.infos_end == other.infos_end
            && self.data_offset == other.data_offset
            && self.metadata.len() == other.metadata.len()
            && self
                .metadata
                .iter()
                .zip(other.metadata.iter())
                .all(|((ka, va), (kb, vb))| ka == kb && va.bit_eq(vb))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

pub fn align_up(n: u64, alignment: u64) -> u64 {
    n.div_ceil(alignment) * alignment
}
