//! Tensor-parallel slicing of GGUF tensors, written once: which axis of a tensor a rank's share
//! runs along (from the table's `tp` plan and entry kind) and where that share lies inside the
//! tensor's bytes, on quant-block boundaries. The runtime reads each rank's share straight from
//! the memory-mapped file through [`TensorSlice`]; nothing here copies a whole tensor.
//!
//! ggml order throughout: `ne[0]` is the row length (the quant blocks run along it), `ne[1]` the
//! rows of a matrix, `ne[2]` the heads of `attn_k_b`/`attn_v_b` or the experts of a stack.

use crate::table::{Entry, Kind, Tp};
use crate::MappingError;
use gguf::GgmlType;
use std::ops::Range;

/// How a tensor is divided over tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardRole {
    /// Every rank holds the whole tensor (norms, router, latent projections, indexer).
    Replicated,
    /// HF colwise: output features split. A matrix's rows (ggml axis 1); a vector's elements.
    Rows,
    /// HF rowwise: input features split inside every row (ggml axis 0); the products are partial
    /// sums that meet in an all-reduce.
    Cols,
    /// MLA `attn_k_b` / `attn_v_b`: whole heads (ggml axis 2).
    Heads,
    /// Stacked experts whose own matrices are colwise (gate/up, axis 1), or whole experts (axis
    /// 2) under expert parallelism.
    ExpertRows,
    /// Stacked experts whose own matrices are rowwise (down, axis 0), or whole experts (axis 2).
    ExpertCols,
}

impl ShardRole {
    /// The role of a table entry (its `tp` plan interpreted for the entry's kind).
    pub fn of(entry: &Entry) -> ShardRole {
        match (entry.kind, entry.tp) {
            (_, None) => ShardRole::Replicated,
            (Kind::KvB, Some(_)) => ShardRole::Heads,
            (Kind::Experts, Some(Tp::Colwise)) => ShardRole::ExpertRows,
            (Kind::Experts, Some(Tp::Rowwise)) => ShardRole::ExpertCols,
            (_, Some(Tp::Colwise)) => ShardRole::Rows,
            (_, Some(Tp::Rowwise)) => ShardRole::Cols,
        }
    }

    /// The ggml axis a share runs along for a tensor of `n_dims` dimensions (`None`: whole).
    /// `whole_experts` selects expert parallelism for stacked experts.
    pub fn axis(self, n_dims: usize, whole_experts: bool) -> Option<usize> {
        match self {
            ShardRole::Replicated => None,
            ShardRole::Rows => Some(usize::from(n_dims >= 2)),
            ShardRole::Cols => Some(0),
            ShardRole::Heads => Some(2),
            ShardRole::ExpertRows | ShardRole::ExpertCols if whole_experts => Some(2),
            ShardRole::ExpertRows => Some(1),
            ShardRole::ExpertCols => Some(0),
        }
    }

    /// Whether the products of this tensor are partial sums over ranks.
    pub fn is_partial_sum(self) -> bool {
        matches!(self, ShardRole::Cols | ShardRole::ExpertCols)
    }
}

/// One rank's share of a tensor: `count` runs of `len` bytes, `stride` bytes apart, the first at
/// byte `first` of the tensor's data. A single run (`count == 1`) is a contiguous share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSlice {
    /// ggml dims of the share.
    pub ne: Vec<u64>,
    pub first: u64,
    pub len: u64,
    pub stride: u64,
    pub count: u64,
}

impl TensorSlice {
    pub fn n_bytes(&self) -> u64 {
        self.len * self.count
    }

    /// Byte ranges of the share inside the tensor's data, in order.
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        (0..self.count).map(|i| {
            let s = self.first + i * self.stride;
            s..s + self.len
        })
    }

    /// The share's bytes out of the whole tensor's `data` (a copy of the share only).
    pub fn gather(&self, data: &[u8]) -> Result<Vec<u8>, MappingError> {
        let mut out = Vec::with_capacity(usize::try_from(self.n_bytes()).unwrap_or(0));
        for r in self.ranges() {
            let bad = || MappingError::Shape {
                what: "tensor slice".into(),
                msg: format!("bytes {r:?} outside {} bytes of data", data.len()),
            };
            let (s, e) = (
                usize::try_from(r.start).map_err(|_| bad())?,
                usize::try_from(r.end).map_err(|_| bad())?,
            );
            out.extend_from_slice(data.get(s..e).ok_or_else(bad)?);
        }
        Ok(out)
    }
}

fn shape_err(msg: String) -> MappingError {
    MappingError::Shape {
        what: "tensor slice".into(),
        msg,
    }
}

/// The share of a `ty` tensor of ggml dims `ne` that holds indices `range` along `axis`.
/// A split inside the rows (axis 0) must fall on `ty`'s block boundaries, otherwise the error is
/// [`MappingError::SplitCutsBlock`] (callers may then re-encode the share, see the runtime).
pub fn slice(
    ty: GgmlType,
    ne: &[u64],
    axis: usize,
    range: Range<u64>,
) -> Result<TensorSlice, MappingError> {
    if axis >= ne.len() || range.start > range.end || range.end > ne[axis] {
        return Err(shape_err(format!(
            "{range:?} along axis {axis} of ne {ne:?}"
        )));
    }
    let block = ty.block_size() as u64;
    let row_bytes = ty
        .row_bytes(ne[0])
        .ok_or_else(|| shape_err(format!("ne0 {} is not whole {} blocks", ne[0], ty.name())))?;
    let mut local = ne.to_vec();
    local[axis] = range.end - range.start;
    let overflow = || shape_err(format!("ne {ne:?} overflows"));
    if axis == 0 {
        if !range.start.is_multiple_of(block) || !range.end.is_multiple_of(block) {
            return Err(MappingError::SplitCutsBlock {
                ty,
                block,
                range,
                ne0: ne[0],
            });
        }
        let rows = ne[1..]
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(overflow)?;
        let bb = ty.type_size() as u64;
        if range.end - range.start == ne[0] {
            let all = row_bytes.checked_mul(rows).ok_or_else(overflow)?;
            return Ok(TensorSlice {
                ne: local,
                first: 0,
                len: all,
                stride: all,
                count: 1,
            });
        }
        return Ok(TensorSlice {
            ne: local,
            first: range.start / block * bb,
            len: (range.end - range.start) / block * bb,
            stride: row_bytes,
            count: rows,
        });
    }
    // Axis a >= 1: one run per index of the axes above a, each `range.len()` slabs long.
    let slab = ne[1..axis]
        .iter()
        .try_fold(row_bytes, |a, &d| a.checked_mul(d))
        .ok_or_else(overflow)?;
    let outer = ne[axis + 1..]
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(overflow)?;
    let stride = slab.checked_mul(ne[axis]).ok_or_else(overflow)?;
    let n = range.end - range.start;
    let (first, len, count) = if n == ne[axis] {
        (0, stride.checked_mul(outer).ok_or_else(overflow)?, 1)
    } else if outer == 1 {
        (slab * range.start, slab * n, 1)
    } else {
        (slab * range.start, slab * n, outer)
    };
    Ok(TensorSlice {
        ne: local,
        first,
        len,
        stride,
        count,
    })
}

/// Rank `rank`'s part of `len` items split evenly over `world` ranks; an error when `len` does not
/// divide (the caller names what is being split).
pub fn even_part(len: u64, world: u64, rank: u64) -> Option<Range<u64>> {
    if world == 0 || rank >= world || !len.is_multiple_of(world) {
        return None;
    }
    let per = len / world;
    Some(rank * per..(rank + 1) * per)
}

/// Rank `rank`'s contiguous part of `len` items over `world` ranks when they need not divide:
/// the first `len % world` ranks get one more (6 experts over 4 ranks: 2, 2, 1, 1).
pub fn balanced_part(len: u64, world: u64, rank: u64) -> Range<u64> {
    let world = world.max(1);
    let (per, extra) = (len / world, len % world);
    let start = rank * per + rank.min(extra);
    start..start + per + u64::from(rank < extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_axis_in_order() {
        assert_eq!(even_part(8, 4, 3), Some(6..8));
        assert_eq!(even_part(6, 4, 0), None);
        let b: Vec<_> = (0..4).map(|r| balanced_part(6, 4, r)).collect();
        assert_eq!(b, vec![0..2, 2..4, 4..5, 5..6]);
        assert_eq!(balanced_part(2, 4, 3), 2..2);
    }

    #[test]
    fn slices_of_each_axis_are_the_expected_bytes() {
        // F32 {4, 3, 2}: element (i0, i1, i2) at byte 4 * (i0 + 4 * i1 + 12 * i2).
        let ne = [4u64, 3, 2];
        let s = slice(GgmlType::F32, &ne, 0, 2..4).unwrap();
        assert_eq!((s.first, s.len, s.stride, s.count), (8, 8, 16, 6));
        let s = slice(GgmlType::F32, &ne, 1, 1..2).unwrap();
        assert_eq!((s.first, s.len, s.stride, s.count), (16, 16, 48, 2));
        assert_eq!(s.ne, vec![4, 1, 2]);
        let s = slice(GgmlType::F32, &ne, 2, 1..2).unwrap();
        assert_eq!((s.first, s.n_bytes()), (48, 48));
        assert_eq!(s.count, 1);
        let s = slice(GgmlType::F32, &ne, 1, 0..3).unwrap();
        assert_eq!((s.first, s.n_bytes(), s.count), (0, 96, 1));
        assert!(matches!(
            slice(GgmlType::Q8_0, &[64, 2], 0, 0..16),
            Err(MappingError::SplitCutsBlock { block: 32, .. })
        ));
        assert!(slice(GgmlType::F32, &ne, 3, 0..1).is_err());
        assert!(slice(GgmlType::F32, &ne, 1, 2..4).is_err());
    }
}
