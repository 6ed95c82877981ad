//! Importance matrices in llama.cpp's GGUF format (`llama-imatrix` output): per weight tensor
//! `NAME.in_sum2` (F32, `ne0 * n_expert` sums of squared activations) and `NAME.counts` (F32,
//! one count per expert), plus `imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`.
//! Turned into per-column weights the way llama-quantize does (sum / count, 1 where a count is
//! zero). The pre-GGUF `.dat` format is not read.

use crate::error::{Error, Result};
use crate::model::GgufFile;
use crate::GgmlType;
use std::collections::BTreeMap;
use std::path::Path;

/// A loaded importance matrix.
#[derive(Debug, Clone, Default)]
pub struct Imatrix {
    /// Weights per tensor name: `ne0 * n_expert` values, expert-major.
    pub entries: BTreeMap<String, Vec<f32>>,
    pub datasets: Vec<String>,
    pub chunk_count: u32,
    pub chunk_size: u32,
}

fn bad(path: &Path, message: String) -> Error {
    Error::Imatrix {
        file: path.to_path_buf(),
        message,
    }
}

impl Imatrix {
    pub fn open(path: &Path) -> Result<Imatrix> {
        let f = GgufFile::open(path)?;
        let m = f.metadata();
        let datasets = m
            .get("imatrix.datasets")
            .and_then(|v| v.as_array())
            .and_then(|a| a.as_strings())
            .map(|v| v.into_iter().map(str::to_string).collect());
        let u32_key = |k: &str| m.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
        let (chunk_count, chunk_size) = (
            u32_key("imatrix.chunk_count"),
            u32_key("imatrix.chunk_size"),
        );
        let (Some(datasets), Some(chunk_count), Some(chunk_size)) =
            (datasets, chunk_count, chunk_size)
        else {
            return Err(bad(
                path,
                "missing imatrix.datasets / imatrix.chunk_count / imatrix.chunk_size (not a llama-imatrix GGUF file?)".into(),
            ));
        };
        if f.tensors().is_empty() {
            return Err(bad(path, "no data".into()));
        }
        let mut pairs: BTreeMap<String, (Option<usize>, Option<usize>)> = BTreeMap::new();
        for (i, t) in f.tensors().iter().enumerate() {
            if let Some(n) = t.name.strip_suffix(".in_sum2") {
                pairs.entry(n.to_string()).or_default().0 = Some(i);
            } else if let Some(n) = t.name.strip_suffix(".counts") {
                pairs.entry(n.to_string()).or_default().1 = Some(i);
            }
        }
        let f32s = |i: usize| -> Result<Vec<f32>> {
            let t = &f.tensors()[i];
            if t.ty != GgmlType::F32 {
                return Err(bad(
                    path,
                    format!("tensor {:?} is {}, not F32", t.name, t.ty),
                ));
            }
            Ok(f.tensor_data(t)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect())
        };
        let mut entries = BTreeMap::new();
        for (name, (s, c)) in pairs {
            let (Some(s), Some(c)) = (s, c) else {
                return Err(bad(
                    path,
                    format!("{name}: sums without counts or counts without sums"),
                ));
            };
            let sums = f32s(s)?;
            // llama.cpp rounds the stored counts to integers (lround) before dividing.
            let counts: Vec<i64> = f32s(c)?.iter().map(|v| v.round() as i64).collect();
            if counts.is_empty() || sums.len() % counts.len() != 0 {
                return Err(bad(
                    path,
                    format!(
                        "{name}: {} sums do not split over {} counts",
                        sums.len(),
                        counts.len()
                    ),
                ));
            }
            let ne0 = sums.len() / counts.len();
            let mut e = vec![0.0f32; sums.len()];
            for (j, &cnt) in counts.iter().enumerate() {
                let count = cnt as f32;
                for i in 0..ne0 {
                    e[j * ne0 + i] = if count > 0.0 {
                        sums[j * ne0 + i] / count
                    } else {
                        1.0
                    };
                }
            }
            if let Some(v) = e.iter().find(|v| !v.is_finite()) {
                return Err(bad(path, format!("{name}: non-finite value {v}")));
            }
            entries.insert(name, e);
        }
        Ok(Imatrix {
            entries,
            datasets,
            chunk_count,
            chunk_size,
        })
    }
}
