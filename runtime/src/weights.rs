//! Weights as stored in a GGUF file, handed to a backend's `upload`: name, ggml type, dims and
//! the raw bytes (borrowed from the model's mmap, or owned for derived/synthetic weights), or a
//! tensor-parallel rank's share of them (a strided view of the same bytes).

use crate::RuntimeError;
use gguf::GgmlType;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

/// Where a weight's bytes live.
#[derive(Clone)]
enum Bytes {
    Owned(Arc<Vec<u8>>),
    /// A tensor of an open model; the `Arc` keeps the mmap alive while the weight exists.
    Gguf {
        model: Arc<gguf::Model>,
        name: Arc<str>,
    },
}

impl Bytes {
    fn all(&self) -> &[u8] {
        match self {
            Bytes::Owned(b) => b,
            Bytes::Gguf { model, name } => match model.tensor(name) {
                Some(t) => model.data(&t),
                // Resolved at construction; a model's tensor table never changes.
                None => &[],
            },
        }
    }
}

/// A tensor-parallel share of the bytes: `count` runs of `len` bytes, `stride` apart, from
/// `first` (see `mappings::shard::TensorSlice`). Reads go straight to the underlying bytes;
/// only a caller that needs one contiguous buffer (a device upload) gets a copy of the share.
#[derive(Clone)]
struct Strided {
    first: usize,
    len: usize,
    stride: usize,
    count: usize,
    contiguous: Arc<OnceLock<Vec<u8>>>,
}

/// One weight tensor in its GGUF type, or a tensor-parallel share of one. Cloning is cheap (the
/// bytes are shared).
#[derive(Clone)]
pub struct HostWeight {
    name: String,
    ty: GgmlType,
    /// ggml order: `dims[0]` is the row length.
    dims: Vec<usize>,
    n_bytes: usize,
    bytes: Bytes,
    view: Option<Strided>,
}

impl std::fmt::Debug for HostWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ty, self.dims)
    }
}

fn expected_bytes(name: &str, ty: GgmlType, dims: &[usize]) -> Result<usize, RuntimeError> {
    let bad = || {
        RuntimeError::Model(format!(
            "tensor {name}: shape {dims:?} does not fit type {ty} (row length must be a multiple of {})",
            ty.block_size()
        ))
    };
    let row = *dims.first().ok_or_else(bad)?;
    let rows = dims[1..]
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(bad)?;
    let rb = ty.row_bytes(row as u64).ok_or_else(bad)?;
    usize::try_from(rb)
        .ok()
        .and_then(|rb| rb.checked_mul(rows))
        .ok_or_else(bad)
}

fn to_usize(name: &str, v: u64) -> Result<usize, RuntimeError> {
    usize::try_from(v).map_err(|_| RuntimeError::Model(format!("tensor {name}: {v} too large")))
}

impl HostWeight {
    /// A weight from owned bytes; the byte count must match type and dims.
    pub fn from_bytes(
        name: impl Into<String>,
        ty: GgmlType,
        dims: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Result<Self, RuntimeError> {
        let name = name.into();
        let need = expected_bytes(&name, ty, &dims)?;
        if bytes.len() != need {
            return Err(RuntimeError::Model(format!(
                "tensor {name}: {} bytes, {ty} {dims:?} needs {need}",
                bytes.len()
            )));
        }
        Ok(Self {
            name,
            ty,
            dims,
            n_bytes: need,
            bytes: Bytes::Owned(Arc::new(bytes)),
            view: None,
        })
    }

    /// An F32 weight from values (derived weights such as the reassembled `kv_b`, tests).
    pub fn from_f32(
        name: impl Into<String>,
        dims: Vec<usize>,
        values: &[f32],
    ) -> Result<Self, RuntimeError> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_bytes(name, GgmlType::F32, dims, bytes)
    }

    /// Tensor `name` of `model`, without copying its bytes.
    pub fn from_model(model: &Arc<gguf::Model>, name: &str) -> Result<Self, RuntimeError> {
        let t = model
            .tensor(name)
            .ok_or_else(|| RuntimeError::Model(format!("missing tensor {name}")))?;
        let dims = t
            .info
            .dims
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| RuntimeError::Model(format!("tensor {name}: dims too large")))?;
        let ty = t.info.ty;
        let need = expected_bytes(name, ty, &dims)?;
        let have = model.data(&t).len();
        if have != need {
            return Err(RuntimeError::Model(format!(
                "tensor {name}: {have} bytes, {ty} {dims:?} needs {need}"
            )));
        }
        Ok(Self {
            name: name.to_string(),
            ty,
            dims,
            n_bytes: need,
            bytes: Bytes::Gguf {
                model: Arc::clone(model),
                name: Arc::from(name),
            },
            view: None,
        })
    }

    /// The share holding indices `range` along ggml `axis` (a tensor-parallel rank's part), read
    /// in place. Where the split would cut quant blocks inside the rows, the share is re-encoded
    /// as F32 (its exact dequantized values, one row at a time) and the second value is true.
    pub fn shard(
        &self,
        axis: usize,
        range: Range<usize>,
    ) -> Result<(HostWeight, bool), RuntimeError> {
        if self.view.is_some() {
            return Err(RuntimeError::Model(format!(
                "tensor {}: a share cannot be split again",
                self.name
            )));
        }
        let ne: Vec<u64> = self.dims.iter().map(|&d| d as u64).collect();
        let r = range.start as u64..range.end as u64;
        match mappings::shard::slice(self.ty, &ne, axis, r) {
            Ok(s) => {
                let dims =
                    s.ne.iter()
                        .map(|&d| to_usize(&self.name, d))
                        .collect::<Result<Vec<_>, _>>()?;
                let n_bytes = to_usize(&self.name, s.n_bytes())?;
                let view = (s.n_bytes() != self.n_bytes as u64 || s.first != 0).then(|| Strided {
                    first: s.first as usize,
                    len: s.len as usize,
                    stride: s.stride as usize,
                    count: s.count as usize,
                    contiguous: Arc::new(OnceLock::new()),
                });
                Ok((
                    HostWeight {
                        name: self.name.clone(),
                        ty: self.ty,
                        dims,
                        n_bytes,
                        bytes: self.bytes.clone(),
                        view,
                    },
                    false,
                ))
            }
            Err(mappings::MappingError::SplitCutsBlock { .. }) if axis == 0 => {
                let k = self.row_len();
                let mut row = vec![0f32; k];
                let mut vals = Vec::with_capacity(range.len() * self.n_rows());
                for r in 0..self.n_rows() {
                    dequantize(self.ty, self.row_data(r), &mut row)
                        .map_err(|e| RuntimeError::Model(format!("tensor {}: {e}", self.name)))?;
                    vals.extend_from_slice(&row[range.clone()]);
                }
                let mut dims = self.dims.clone();
                dims[0] = range.len();
                Ok((HostWeight::from_f32(self.name.clone(), dims, &vals)?, true))
            }
            Err(e) => Err(RuntimeError::Model(format!("tensor {}: {e}", self.name))),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }
    /// Elements per row (`dims[0]`).
    pub fn row_len(&self) -> usize {
        self.dims[0]
    }
    /// Number of rows over all outer dims.
    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product()
    }
    pub fn row_bytes(&self) -> usize {
        // Checked in the constructors.
        self.n_bytes / self.n_rows().max(1)
    }
    /// Bytes of the weight (of the share, for a tensor-parallel share).
    pub fn n_bytes(&self) -> usize {
        self.n_bytes
    }

    /// The raw bytes of row `r` in the GGUF type (read in place, also for a strided share).
    pub fn row_data(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        let all = self.bytes.all();
        let off = match &self.view {
            None => r * rb,
            Some(v) => {
                let per_run = (v.len / rb.max(1)).max(1);
                v.first + (r / per_run) * v.stride + (r % per_run) * rb
            }
        };
        all.get(off..off + rb).unwrap_or(&[])
    }

    /// The raw bytes in the GGUF type, contiguous. For a strided share this is a copy of the
    /// share (made once, on first use: device uploads), never of the whole tensor.
    pub fn bytes(&self) -> &[u8] {
        let all = self.bytes.all();
        match &self.view {
            None => all,
            Some(v) if v.count <= 1 => all.get(v.first..v.first + v.len).unwrap_or(&[]),
            Some(v) => v.contiguous.get_or_init(|| {
                let mut out = Vec::with_capacity(v.len * v.count);
                for i in 0..v.count {
                    let s = v.first + i * v.stride;
                    out.extend_from_slice(all.get(s..s + v.len).unwrap_or(&[]));
                }
                out
            }),
        }
    }

    /// All values as f32.
    pub fn to_f32(&self) -> Result<Vec<f32>, RuntimeError> {
        let k = self.row_len();
        let mut out = vec![0f32; self.n_rows() * k];
        for (r, o) in out.chunks_mut(k.max(1)).enumerate() {
            dequantize(self.ty, self.row_data(r), o)
                .map_err(|e| RuntimeError::Model(format!("tensor {}: {e}", self.name)))?;
        }
        Ok(out)
    }
}

/// Dequantize `bytes` of type `ty` into `out` (whose length fixes the element count).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let need = ty
        .row_bytes(out.len() as u64)
        .ok_or_else(|| format!("{} values are not whole {ty} blocks", out.len()))?;
    if bytes.len() as u64 != need {
        return Err(format!(
            "{} bytes for {} {ty} values",
            bytes.len(),
            out.len()
        ));
    }
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                // bf16 is the top half of an f32: exact.
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        _ => gguf::quant::dequantize_row(ty, bytes, out).map_err(|e| e.to_string())?,
    }
    Ok(())
}
