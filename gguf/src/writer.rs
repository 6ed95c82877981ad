//! Writing GGUF: serialize a header exactly (same key order, value types, dims, offsets), lay out
//! new files canonically, and stream tensor data with zero padding. Reading a valid file and
//! writing it back gives the same bytes.

use crate::error::{Error, Result};
use crate::metadata::Metadata;
use crate::reader::{align_up, Header, TensorInfo, DEFAULT_ALIGNMENT, MAGIC};
use crate::types::GgmlType;
use crate::value::{Value, ValueType};
use std::io::{self, Write};

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::Bool(b) => out.push(u8::from(*b)),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_bits().to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_bits().to_le_bytes()),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => {
            out.extend_from_slice(&a.elem_type.id().to_le_bytes());
            out.extend_from_slice(&(a.values.len() as u64).to_le_bytes());
            for e in &a.values {
                put_value(out, e);
            }
        }
    }
}

/// Check that every array's elements have its declared element type (a hand-built `Value`
/// could mix them; the file format cannot).
fn check_value(key: &str, v: &Value) -> Result<()> {
    if let Value::Array(a) = v {
        for e in &a.values {
            if e.value_type() != a.elem_type {
                return Err(Error::Write(format!(
                    "key {key:?}: array of {} holds a {}",
                    a.elem_type,
                    e.value_type()
                )));
            }
            check_value(key, e)?;
        }
    }
    Ok(())
}

/// Serialize everything before the data section, without the alignment padding.
pub fn header_bytes(version: u32, metadata: &Metadata, tensors: &[TensorInfo]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(4096);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata.iter() {
        check_value(k, v)?;
        put_string(&mut out, k);
        out.extend_from_slice(&v.value_type().id().to_le_bytes());
        put_value(&mut out, v);
    }
    for t in tensors {
        put_string(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&t.offset.to_le_bytes());
    }
    Ok(out)
}

/// Alignment declared by `general.alignment`, or the default.
pub fn alignment_of(metadata: &Metadata) -> Result<u64> {
    match metadata.get("general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => Ok(*a as u64),
        Some(other) => Err(Error::Write(format!(
            "general.alignment must be a UINT32 power of two, got {} {}",
            other.value_type(),
            other.display_summary(4)
        ))),
    }
}

/// Assign canonical offsets (each tensor at the running sum of the previous ones' aligned sizes).
pub fn canonical_offsets(tensors: &mut [TensorInfo], alignment: u64) {
    let mut off = 0u64;
    for t in tensors {
        t.offset = off;
        off += align_up(t.n_bytes(), alignment);
    }
}

/// A tensor's byte size padded to `alignment`, `None` when ne0 is not a multiple of the block
/// size or the size does not fit in u64.
fn padded_size(t: &TensorInfo, alignment: u64) -> Option<u64> {
    let row = t.ty.row_bytes(t.dims.first().copied().unwrap_or(1))?;
    let n = t
        .dims
        .iter()
        .skip(1)
        .try_fold(row, |acc, &d| acc.checked_mul(d))?;
    n.div_ceil(alignment).checked_mul(alignment)
}

fn bad_extent(t: &TensorInfo) -> Error {
    Error::Write(format!(
        "tensor {:?}: {} {:?} at offset {}: ne0 not a multiple of the block size, or the data would end past 2^64",
        t.name, t.ty, t.dims, t.offset
    ))
}

/// A header laid out for writing: serialized bytes and where the data section starts.
pub struct Layout {
    pub header: Vec<u8>,
    pub alignment: u64,
    pub data_offset: u64,
    /// Tensors with their final offsets, in table order.
    pub tensors: Vec<TensorInfo>,
}

impl Layout {
    /// Lay out a new file: canonical offsets in the given order.
    pub fn new(version: u32, metadata: &Metadata, mut tensors: Vec<TensorInfo>) -> Result<Layout> {
        let alignment = alignment_of(metadata)?;
        let mut total = 0u64;
        for t in &tensors {
            total = padded_size(t, alignment)
                .and_then(|n| total.checked_add(n))
                .ok_or_else(|| bad_extent(t))?;
        }
        canonical_offsets(&mut tensors, alignment);
        Self::with_offsets(version, metadata, tensors)
    }

    /// Lay out a header keeping the tensors' offsets as they are (byte-exact rewrite).
    pub fn with_offsets(
        version: u32,
        metadata: &Metadata,
        tensors: Vec<TensorInfo>,
    ) -> Result<Layout> {
        let alignment = alignment_of(metadata)?;
        let header = header_bytes(version, metadata, &tensors)?;
        let data_offset = align_up(header.len() as u64, alignment);
        // Offsets may come from a header never checked against its file: make sure every
        // extent computed below fits in u64.
        for t in &tensors {
            padded_size(t, alignment)
                .and_then(|n| t.offset.checked_add(n))
                .and_then(|end| data_offset.checked_add(end))
                .ok_or_else(|| bad_extent(t))?;
        }
        Ok(Layout {
            header,
            alignment,
            data_offset,
            tensors,
        })
    }

    /// Total file size: data section end with the last tensor padded.
    pub fn file_size(&self) -> u64 {
        let end = self
            .tensors
            .iter()
            .map(|t| t.offset + align_up(t.n_bytes(), self.alignment))
            .max()
            .unwrap_or(0);
        self.data_offset + end
    }

    /// Write the header and the padding up to the data section.
    pub fn write_header<W: Write>(&self, w: &mut W) -> io::Result<()> {
        w.write_all(&self.header)?;
        write_zeros(w, self.data_offset - self.header.len() as u64)
    }

    /// Tensors in the order their data appears in the file (offset order), with the zero
    /// padding to put before each and after the last.
    pub fn data_plan(&self) -> Vec<(usize, u64)> {
        let mut order: Vec<usize> = (0..self.tensors.len()).collect();
        order.sort_by_key(|&i| self.tensors[i].offset);
        let mut pos = 0u64;
        let mut plan = Vec::with_capacity(order.len());
        for i in order {
            let t = &self.tensors[i];
            plan.push((i, t.offset.saturating_sub(pos)));
            pos = pos.max(t.offset + t.n_bytes());
        }
        plan
    }

    /// Zero bytes after the last tensor's data, up to [`Layout::file_size`].
    pub fn trailing_padding(&self) -> u64 {
        let end = self
            .tensors
            .iter()
            .map(|t| t.offset + t.n_bytes())
            .max()
            .unwrap_or(0);
        self.file_size() - self.data_offset - end
    }
}

pub fn write_zeros<W: Write>(w: &mut W, mut n: u64) -> io::Result<()> {
    const Z: [u8; 4096] = [0; 4096];
    while n > 0 {
        let k = n.min(Z.len() as u64) as usize;
        w.write_all(&Z[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Write a complete file: header, then each tensor's bytes (given in table order) with padding.
/// `data(i)` returns the bytes of tensor `i`; each must be exactly its `n_bytes`.
pub fn write_file<'a, W: Write>(
    w: &mut W,
    layout: &Layout,
    mut data: impl FnMut(usize) -> &'a [u8],
) -> Result<()> {
    let io = |source| Error::Io {
        path: "<output>".into(),
        source,
    };
    layout.write_header(w).map_err(io)?;
    for (i, pad) in layout.data_plan() {
        let t = &layout.tensors[i];
        let bytes = data(i);
        if bytes.len() as u64 != t.n_bytes() {
            return Err(Error::Write(format!(
                "tensor {:?}: {} bytes given, {} expected for {} {:?}",
                t.name,
                bytes.len(),
                t.n_bytes(),
                t.ty,
                t.dims
            )));
        }
        write_zeros(w, pad).map_err(io)?;
        w.write_all(bytes).map_err(io)?;
    }
    write_zeros(w, layout.trailing_padding()).map_err(io)
}

/// Build a new GGUF v3 file in memory (tests, small tools).
pub fn build(metadata: &Metadata, tensors: &[(&str, &[u64], GgmlType, &[u8])]) -> Result<Vec<u8>> {
    let infos = tensors
        .iter()
        .map(|(name, dims, ty, _)| TensorInfo {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty: *ty,
            offset: 0,
        })
        .collect();
    let layout = Layout::new(3, metadata, infos)?;
    let mut out = Vec::with_capacity(layout.file_size() as usize);
    write_file(&mut out, &layout, |i| tensors[i].3)?;
    Ok(out)
}

impl Header {
    /// The layout that reproduces this header exactly.
    pub fn layout(&self) -> Result<Layout> {
        Layout::with_offsets(self.version, &self.metadata, self.tensors.clone())
    }
}

/// Exists so the value-type table stays in one place for callers building arrays.
pub fn array_of(elem_type: ValueType, values: Vec<Value>) -> Value {
    Value::Array(crate::value::Array { elem_type, values })
}
