//! Reading an HF checkpoint directory without loading weights: `config.json`, the shard index
//! `model.safetensors.index.json` and the safetensors headers (8-byte little-endian length + JSON).
//! Tensor bytes are read one tensor at a time, on request.

use crate::MappingError;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Headers larger than this are rejected before allocation (real ones are a few MB at most).
const MAX_HEADER: u64 = 256 << 20;

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfTensor {
    pub name: String,
    /// safetensors dtype name ("BF16", "F32", ...).
    pub dtype: String,
    pub shape: Vec<u64>,
    pub file: PathBuf,
    /// Absolute byte range in `file`.
    pub start: u64,
    pub end: u64,
}

/// Bytes per element of a safetensors dtype (`None` for sub-byte or unknown types).
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F8_E4M3" | "F8_E5M2" | "F8_E8M0" | "I8" | "U8" | "BOOL" => 1,
        _ => return None,
    })
}

/// An HF checkpoint directory (or a single .safetensors file).
#[derive(Debug, Clone)]
pub struct HfDir {
    pub dir: PathBuf,
    pub config: Option<Value>,
    /// Tensors in index order (or file order, then header order, without an index).
    pub tensors: Vec<HfTensor>,
}

fn ferr(path: &Path, msg: impl Into<String>) -> MappingError {
    MappingError::File {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

fn read_json(path: &Path) -> Result<Value, MappingError> {
    let s = std::fs::read_to_string(path).map_err(|e| ferr(path, e.to_string()))?;
    serde_json::from_str(&s).map_err(|e| ferr(path, format!("invalid JSON: {e}")))
}

/// Parses the header of one safetensors file: its tensors in header order.
pub fn read_header(path: &Path) -> Result<Vec<HfTensor>, MappingError> {
    let mut f = File::open(path).map_err(|e| ferr(path, e.to_string()))?;
    let size = f.metadata().map_err(|e| ferr(path, e.to_string()))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| ferr(path, "too short for a safetensors header"))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || n > size.saturating_sub(8) {
        return Err(ferr(
            path,
            format!("header length {n} exceeds the file ({size} bytes)"),
        ));
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)
        .map_err(|e| ferr(path, e.to_string()))?;
    let hdr: serde_json::Map<String, Value> = serde_json::from_slice(&buf)
        .map_err(|e| ferr(path, format!("header is not a JSON object: {e}")))?;
    let base = 8 + n;
    let mut out = Vec::new();
    for (name, v) in hdr {
        if name == "__metadata__" {
            continue;
        }
        let bad = |m: &str| ferr(path, format!("tensor {name:?}: {m}"));
        let dtype = v["dtype"]
            .as_str()
            .ok_or_else(|| bad("no dtype"))?
            .to_string();
        let shape = v["shape"]
            .as_array()
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad("shape is not a list of integers"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let offs = v["data_offsets"]
            .as_array()
            .ok_or_else(|| bad("no data_offsets"))?;
        let (Some(a), Some(b)) = (
            offs.first().and_then(Value::as_u64),
            offs.get(1).and_then(Value::as_u64),
        ) else {
            return Err(bad("data_offsets must be two integers"));
        };
        let (start, end) = (
            base.checked_add(a).ok_or_else(|| bad("offset overflows"))?,
            base.checked_add(b).ok_or_else(|| bad("offset overflows"))?,
        );
        if a > b || end > size {
            return Err(bad(&format!(
                "data [{start}, {end}) outside the file ({size} bytes)"
            )));
        }
        if let Some(es) = dtype_size(&dtype) {
            let n = shape
                .iter()
                .try_fold(es, |acc, d| acc.checked_mul(*d))
                .ok_or_else(|| bad("shape overflows"))?;
            if n != b - a {
                return Err(bad(&format!(
                    "{} bytes for {dtype} {shape:?} ({n} expected)",
                    b - a
                )));
            }
        }
        out.push(HfTensor {
            name,
            dtype,
            shape,
            file: path.to_path_buf(),
            start,
            end,
        });
    }
    out.sort_by_key(|t| t.start);
    Ok(out)
}

impl HfDir {
    /// Opens a directory (config.json, index, shards) or one `.safetensors` file.
    pub fn open(path: &Path) -> Result<HfDir, MappingError> {
        if path.is_file() {
            return Ok(HfDir {
                dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
                config: None,
                tensors: read_header(path)?,
            });
        }
        if !path.is_dir() {
            return Err(ferr(path, "not a directory or safetensors file"));
        }
        let cfg = path.join("config.json");
        let config = cfg.exists().then(|| read_json(&cfg)).transpose()?;
        let index = path.join("model.safetensors.index.json");
        let tensors = if index.exists() {
            let idx = read_json(&index)?;
            let map = idx["weight_map"]
                .as_object()
                .ok_or_else(|| ferr(&index, "no weight_map object"))?;
            let mut headers: BTreeMap<String, BTreeMap<String, HfTensor>> = BTreeMap::new();
            let mut out = Vec::new();
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| ferr(&index, format!("{name}: shard is not a string")))?;
                if file.contains('/') || file.contains('\\') || file == ".." {
                    return Err(ferr(
                        &index,
                        format!("{name}: shard {file:?} is not a plain file name"),
                    ));
                }
                if !headers.contains_key(file) {
                    let list = read_header(&path.join(file))?;
                    headers.insert(
                        file.to_string(),
                        list.into_iter().map(|t| (t.name.clone(), t)).collect(),
                    );
                }
                let t = headers[file].get(name).ok_or_else(|| {
                    ferr(
                        &path.join(file),
                        format!("index lists {name:?} but the shard lacks it"),
                    )
                })?;
                out.push(t.clone());
            }
            out
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| ferr(path, e.to_string()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(ferr(
                    path,
                    "no model.safetensors.index.json and no *.safetensors files",
                ));
            }
            let mut out = Vec::new();
            for f in files {
                out.extend(read_header(&f)?);
            }
            out
        };
        Ok(HfDir {
            dir: path.to_path_buf(),
            config,
            tensors,
        })
    }

    /// `config.json` `model_type`.
    pub fn model_type(&self) -> Option<&str> {
        self.config.as_ref()?.get("model_type")?.as_str()
    }

    pub fn tensor(&self, name: &str) -> Option<&HfTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw little-endian bytes of one tensor.
    pub fn read_raw(&self, t: &HfTensor) -> Result<Vec<u8>, MappingError> {
        let mut f = File::open(&t.file).map_err(|e| ferr(&t.file, e.to_string()))?;
        f.seek(SeekFrom::Start(t.start))
            .map_err(|e| ferr(&t.file, e.to_string()))?;
        let len =
            usize::try_from(t.end - t.start).map_err(|_| ferr(&t.file, "tensor too large"))?;
        let mut buf = vec![0u8; len];
        f.read_exact(&mut buf)
            .map_err(|e| ferr(&t.file, format!("tensor {}: {e}", t.name)))?;
        Ok(buf)
    }

    /// A tensor's values as f32 (F32, BF16 and F16 only).
    pub fn read_f32(&self, t: &HfTensor) -> Result<Vec<f32>, MappingError> {
        let raw = self.read_raw(t)?;
        crate::values::to_f32(&t.dtype, &raw).ok_or_else(|| MappingError::Tensor {
            tensor: t.name.clone(),
            msg: format!("dtype {} cannot be read as floats", t.dtype),
        })
    }
}
