//! Weights as stored in a GGUF file, handed to a backend's `upload`: name, ggml type, dims and
//! the raw bytes (borrowed from the model's mmap, or owned for derived/synthetic weights), or a
//! tensor-parallel rank's share of them (a strided view of the same bytes).

use crate::RuntimeError;
use gguf::GgmlType;
use std::borrow::Cow;
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
/// `first` (see `mappings::shard::TensorSlice`). Reads go straight to the underlying bytes
/// (rows, or any byte range with [`HostWeight::read_into`]); only a caller of
/// [`HostWeight::bytes`] gets a contiguous copy of the share.
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
    /// share (made once, on first use, kept with the share), never of the whole tensor; device
    /// uploads read shares with [`HostWeight::read_into`] instead.
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

    /// Copy bytes `offset .. offset + out.len()` of [`HostWeight::bytes`] into `out`, read in
    /// place (for a strided share, run by run): no contiguous copy of the share is made, so a
    /// device upload can gather a share chunk by chunk into its staging buffers.
    pub fn read_into(&self, offset: usize, out: &mut [u8]) -> Result<(), RuntimeError> {
        let want = out.len();
        let end = offset.checked_add(want).filter(|&e| e <= self.n_bytes);
        let short = || {
            RuntimeError::Model(format!(
                "tensor {}: bytes {offset}..{} of its {} are not in the file",
                self.name,
                offset.saturating_add(want),
                self.n_bytes
            ))
        };
        if end.is_none() {
            return Err(short());
        }
        let all = self.bytes.all();
        let Some(v) = &self.view else {
            let src = all.get(offset..offset + out.len()).ok_or_else(short)?;
            out.copy_from_slice(src);
            return Ok(());
        };
        let (mut pos, mut done) = (offset, 0);
        while done < out.len() {
            // `pos` < n_bytes = len * count, so len > 0 here.
            let (run, within) = (pos / v.len, pos % v.len);
            let n = (v.len - within).min(out.len() - done);
            let src = v.first + run * v.stride + within;
            let src = all.get(src..src + n).ok_or_else(short)?;
            out[done..done + n].copy_from_slice(src);
            pos += n;
            done += n;
        }
        Ok(())
    }

    /// The bytes of [`HostWeight::bytes`], borrowed where they lie contiguous in place, else a
    /// gathered copy that is not kept (unlike `bytes`, whose copy lives as long as the share).
    pub fn gathered(&self) -> Result<Cow<'_, [u8]>, RuntimeError> {
        match &self.view {
            Some(v) if v.count > 1 => {
                let mut out = vec![0u8; self.n_bytes];
                self.read_into(0, &mut out)?;
                Ok(Cow::Owned(out))
            }
            _ => {
                let b = self.bytes();
                if b.len() != self.n_bytes {
                    return Err(RuntimeError::Model(format!(
                        "tensor {}: {} of its {} bytes are in the file",
                        self.name,
                        b.len(),
                        self.n_bytes
                    )));
                }
                Ok(Cow::Borrowed(b))
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A weight of `ty` and `dims` whose bytes are a position-dependent pattern (types are not
    /// decoded here, so any bytes do).
    fn patterned(ty: GgmlType, dims: Vec<usize>, seed: u8) -> HostWeight {
        let n = expected_bytes("w", ty, &dims).expect("whole blocks");
        let bytes = (0..n)
            .map(|i| (i.wrapping_mul(131) ^ (i >> 8)) as u8 ^ seed)
            .collect();
        HostWeight::from_bytes("w", ty, dims, bytes).expect("weight")
    }

    /// `w`'s bytes gathered in chunks of `chunk` bytes through `read_into`.
    fn chunked(w: &HostWeight, chunk: usize) -> Vec<u8> {
        let mut out = vec![0xA5u8; w.n_bytes()];
        for (i, c) in out.chunks_mut(chunk.max(1)).enumerate() {
            w.read_into(i * chunk.max(1), c).expect("in range");
        }
        out
    }

    fn contiguous_unused(w: &HostWeight) -> bool {
        w.view.as_ref().is_none_or(|v| v.contiguous.get().is_none())
    }

    #[test]
    fn chunked_reads_of_a_strided_share_equal_its_bytes() {
        // Columns 64..160 of a Q8_0 [256, 3, 5] tensor: 15 runs of 3 blocks, 8 blocks apart.
        let w = patterned(GgmlType::Q8_0, vec![256, 3, 5], 7);
        let (share, reencoded) = w.shard(0, 64..160).expect("share");
        assert!(!reencoded);
        assert!(share.view.as_ref().is_some_and(|v| v.count == 15));
        let sizes = [1, 7, 33, 102, 4096, share.n_bytes()];
        let got: Vec<Vec<u8>> = sizes.iter().map(|&c| chunked(&share, c)).collect();
        let g = share.gathered().expect("gathered");
        assert!(matches!(g, Cow::Owned(_)));
        assert!(
            contiguous_unused(&share),
            "read_into built the contiguous copy"
        );
        for (c, got) in sizes.iter().zip(&got) {
            assert_eq!(got, share.bytes(), "chunk {c}");
        }
        assert_eq!(&*g, share.bytes());
    }

    #[test]
    fn reads_past_the_end_are_errors() {
        let w = patterned(GgmlType::F32, vec![8, 4], 1);
        let (share, _) = w.shard(1, 1..3).expect("share");
        let n = share.n_bytes();
        let mut buf = vec![0u8; 5];
        assert!(share.read_into(n - 4, &mut buf).is_err());
        assert!(share.read_into(usize::MAX, &mut buf).is_err());
        assert!(share.read_into(n - 5, &mut buf).is_ok());
        assert!(share.read_into(n, &mut []).is_ok());
        assert!(w.read_into(w.n_bytes() - 1, &mut buf).is_err());
    }

    #[test]
    fn whole_weights_and_single_runs_are_borrowed() {
        let w = patterned(GgmlType::F16, vec![16, 6], 3);
        assert!(matches!(w.gathered().expect("whole"), Cow::Borrowed(_)));
        assert_eq!(chunked(&w, 7), w.bytes());
        // Rows 2..5 are one contiguous run.
        let (rows, _) = w.shard(1, 2..5).expect("share");
        let g = rows.gathered().expect("rows");
        assert!(matches!(g, Cow::Borrowed(_)));
        assert_eq!(&*g, &w.bytes()[2 * 32..5 * 32]);
        assert_eq!(chunked(&rows, 5), &*g);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any share along any axis, read in chunks of any size (one byte up to past the
        /// whole), equals `bytes()` of that share, without building its contiguous copy.
        #[test]
        fn gathered_chunks_equal_bytes(
            ty in prop::sample::select(vec![GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_K]),
            blocks0 in 1usize..4,
            d1 in 1usize..6,
            d2 in 1usize..5,
            axis in 0usize..3,
            a in 0usize..64,
            b in 0usize..64,
            chunk in 1usize..600,
            seed in any::<u8>(),
        ) {
            let bs = ty.block_size();
            let dims = vec![blocks0 * bs, d1, d2];
            let w = patterned(ty, dims.clone(), seed);
            // A non-empty range along `axis`, on block boundaries for the rows.
            let unit = if axis == 0 { bs } else { 1 };
            let n = dims[axis] / unit;
            let (lo, hi) = (a % n, b % n);
            let range = lo.min(hi) * unit..(lo.max(hi) + 1) * unit;
            let (share, reencoded) = w.shard(axis, range).expect("share");
            prop_assert!(!reencoded);
            let sizes = [1, 7, chunk, 4096, share.n_bytes()];
            let got: Vec<Vec<u8>> = sizes.iter().map(|&c| chunked(&share, c)).collect();
            let g = share.gathered().expect("gathered").into_owned();
            prop_assert!(contiguous_unused(&share));
            for (c, got) in sizes.iter().zip(&got) {
                prop_assert_eq!(&got[..], share.bytes(), "chunk {}", c);
            }
            prop_assert_eq!(&g[..], share.bytes());
        }
    }
}
