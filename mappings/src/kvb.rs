//! MLA `kv_b_proj` <-> `attn_k_b` + `attn_v_b` (spec §2.5), and its tensor-parallel view.
//!
//! HF `kv_b_proj.weight` is `[n_head * (qk_nope + v_head), kv_lora]` row-major: per head, `qk_nope`
//! key rows then `v_head` value rows. The converter views it as `[n_head, qk_nope + v_head, kv_lora]`,
//! transposes the key part per head and stores
//! - `attn_k_b`, ggml ne `{qk_nope, kv_lora, n_head}`: `K(i, r, h)` at `i + qk_nope*r + qk_nope*kv_lora*h`
//! - `attn_v_b`, ggml ne `{kv_lora, v_head, n_head}`: `V(r, j, h)` at `r + kv_lora*j + kv_lora*v_head*h`
//!
//! so `W[h*(qk_nope+v_head) + i, r] = K(i, r, h)` and `W[h*(qk_nope+v_head) + qk_nope + j, r] = V(r, j, h)`.
//! Everything here is a pure permutation of elements, generic over the element type, so it is
//! bit-exact on raw bf16 (`u16`) as well as on f32. Quantized k_b/v_b must be dequantized first
//! (their quant blocks run along ne0, which the transpose crosses).

use crate::MappingError;
use std::ops::Range;

/// The MLA dimensions that fix the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    pub n_head: usize,
    pub qk_nope: usize,
    pub v_head: usize,
    pub kv_lora: usize,
}

fn shape_err(what: &str, msg: String) -> MappingError {
    MappingError::Shape {
        what: what.to_string(),
        msg,
    }
}

fn mul(a: usize, b: usize, what: &str) -> Result<usize, MappingError> {
    a.checked_mul(b)
        .ok_or_else(|| shape_err(what, format!("{a} * {b} overflows")))
}

/// A `[rows, cols]` matrix must hold exactly `rows * cols` elements before it is sliced.
fn check_matrix(len: usize, rows: usize, cols: usize, what: &str) -> Result<(), MappingError> {
    if len != mul(rows, cols, what)? {
        return Err(shape_err(
            what,
            format!("{len} elements for [{rows}, {cols}]"),
        ));
    }
    Ok(())
}

impl MlaDims {
    /// Rows per head in kv_b_proj.
    pub fn head_rows(&self) -> usize {
        // saturating: only `kv_b_len` (checked) decides whether the dimensions are usable
        self.qk_nope.saturating_add(self.v_head)
    }

    /// Elements of attn_k_b.
    pub fn k_b_len(&self) -> Result<usize, MappingError> {
        mul(
            mul(self.qk_nope, self.kv_lora, "attn_k_b")?,
            self.n_head,
            "attn_k_b",
        )
    }

    /// Elements of attn_v_b.
    pub fn v_b_len(&self) -> Result<usize, MappingError> {
        mul(
            mul(self.kv_lora, self.v_head, "attn_v_b")?,
            self.n_head,
            "attn_v_b",
        )
    }

    /// Elements of kv_b_proj.
    pub fn kv_b_len(&self) -> Result<usize, MappingError> {
        let rows = self
            .qk_nope
            .checked_add(self.v_head)
            .ok_or_else(|| shape_err("kv_b_proj", "qk_nope + v_head overflows".into()))?;
        mul(
            mul(self.n_head, rows, "kv_b_proj")?,
            self.kv_lora,
            "kv_b_proj",
        )
    }

    /// HF shape `[n_head * (qk_nope + v_head), kv_lora]`.
    pub fn kv_b_shape(&self) -> [usize; 2] {
        [self.n_head * self.head_rows(), self.kv_lora]
    }

    /// Dimensions from the ggml `ne` of attn_k_b and attn_v_b, checking they agree.
    pub fn from_ne(k_ne: &[u64], v_ne: &[u64]) -> Result<MlaDims, MappingError> {
        let us =
            |x: u64| usize::try_from(x).map_err(|_| shape_err("kv_b", format!("{x} too large")));
        if k_ne.len() != 3 || v_ne.len() != 3 {
            return Err(shape_err(
                "kv_b",
                format!("attn_k_b ne {k_ne:?} and attn_v_b ne {v_ne:?} must both be 3-D"),
            ));
        }
        if k_ne[1] != v_ne[0] || k_ne[2] != v_ne[2] {
            return Err(shape_err(
                "kv_b",
                format!(
                    "attn_k_b ne {k_ne:?} and attn_v_b ne {v_ne:?} disagree on kv_lora (k ne1 = v ne0) \
                     or n_head (ne2)"
                ),
            ));
        }
        let d = MlaDims {
            qk_nope: us(k_ne[0])?,
            kv_lora: us(k_ne[1])?,
            n_head: us(k_ne[2])?,
            v_head: us(v_ne[1])?,
        };
        d.kv_b_len()?;
        Ok(d)
    }

    fn check(&self, what: &str, got: usize, want: usize) -> Result<(), MappingError> {
        if got != want {
            return Err(shape_err(
                what,
                format!("{got} elements, expected {want} for {self:?}"),
            ));
        }
        Ok(())
    }
}

/// The heads tensor-parallel rank `rank` of `tp` owns: `rank*H/tp .. (rank+1)*H/tp`.
pub fn tp_heads(n_head: usize, tp: usize, rank: usize) -> Result<Range<usize>, MappingError> {
    if tp == 0 || rank >= tp {
        return Err(shape_err(
            "tp",
            format!("rank {rank} of {tp} ranks is not a valid rank"),
        ));
    }
    if !n_head.is_multiple_of(tp) {
        return Err(shape_err(
            "tp",
            format!("{n_head} heads do not split evenly over {tp} ranks"),
        ));
    }
    let per = n_head / tp;
    Ok(rank * per..(rank + 1) * per)
}

/// kv_b_proj rows of the heads in `heads`, built straight from the GGUF slabs. With `heads =
/// 0..n_head` this is the full HF tensor.
pub fn reassemble_heads<T: Copy>(
    k_b: &[T],
    v_b: &[T],
    d: MlaDims,
    heads: Range<usize>,
) -> Result<Vec<T>, MappingError> {
    d.kv_b_len()?;
    d.check("attn_k_b", k_b.len(), d.k_b_len()?)?;
    d.check("attn_v_b", v_b.len(), d.v_b_len()?)?;
    if heads.start > heads.end || heads.end > d.n_head {
        return Err(shape_err(
            "kv_b",
            format!("heads {heads:?} outside 0..{}", d.n_head),
        ));
    }
    let (nope, v, lora) = (d.qk_nope, d.v_head, d.kv_lora);
    let mut w = Vec::with_capacity(heads.len() * d.head_rows() * lora);
    for h in heads {
        let k_slab = &k_b[h * nope * lora..(h + 1) * nope * lora]; // [lora][nope]
        for i in 0..nope {
            w.extend((0..lora).map(|r| k_slab[i + nope * r]));
        }
        // the V slab [v][lora] already has the HF row layout
        w.extend_from_slice(&v_b[h * lora * v..(h + 1) * lora * v]);
    }
    Ok(w)
}

/// HF `kv_b_proj` `[n_head*(qk_nope+v_head), kv_lora]` from GGUF attn_k_b and attn_v_b.
pub fn reassemble<T: Copy>(k_b: &[T], v_b: &[T], d: MlaDims) -> Result<Vec<T>, MappingError> {
    reassemble_heads(k_b, v_b, d, 0..d.n_head)
}

/// The converter's split: (attn_k_b, attn_v_b) in ggml element order from HF kv_b_proj.
pub fn split<T: Copy>(kv_b: &[T], d: MlaDims) -> Result<(Vec<T>, Vec<T>), MappingError> {
    d.check("kv_b_proj", kv_b.len(), d.kv_b_len()?)?;
    let (nope, v, lora) = (d.qk_nope, d.v_head, d.kv_lora);
    let mut k_b = Vec::with_capacity(d.k_b_len()?);
    let mut v_b = Vec::with_capacity(d.v_b_len()?);
    for h in 0..d.n_head {
        let head = &kv_b[h * d.head_rows() * lora..(h + 1) * d.head_rows() * lora];
        // K(i, r, h) = W[h, i, r]: iterate r (ne1) outer, i (ne0) inner
        for r in 0..lora {
            k_b.extend((0..nope).map(|i| head[i * lora + r]));
        }
        v_b.extend_from_slice(&head[nope * lora..(nope + v) * lora]);
    }
    Ok((k_b, v_b))
}

/// The colwise tensor-parallel slice of a full kv_b_proj owned by `rank` of `tp`: the rows of heads
/// `tp_heads(n_head, tp, rank)`, `[n_head/tp * (qk_nope+v_head), kv_lora]`.
pub fn tp_slice<T: Copy>(
    kv_b: &[T],
    d: MlaDims,
    tp: usize,
    rank: usize,
) -> Result<Vec<T>, MappingError> {
    d.check("kv_b_proj", kv_b.len(), d.kv_b_len()?)?;
    let heads = tp_heads(d.n_head, tp, rank)?;
    let per_head = d.head_rows() * d.kv_lora;
    Ok(kv_b[heads.start * per_head..heads.end * per_head].to_vec())
}

/// Rows `rank*R/tp ..` of a row-major `[rows, cols]` matrix (HF "colwise": split output features).
pub fn colwise_slice<T: Copy>(
    w: &[T],
    rows: usize,
    cols: usize,
    tp: usize,
    rank: usize,
) -> Result<Vec<T>, MappingError> {
    check_matrix(w.len(), rows, cols, "colwise")?;
    let r = tp_heads(rows, tp, rank)?;
    Ok(w[r.start * cols..r.end * cols].to_vec())
}

/// Columns `rank*C/tp ..` of every row of a row-major `[rows, cols]` matrix (HF "rowwise": split
/// input features).
pub fn rowwise_slice<T: Copy>(
    w: &[T],
    rows: usize,
    cols: usize,
    tp: usize,
    rank: usize,
) -> Result<Vec<T>, MappingError> {
    check_matrix(w.len(), rows, cols, "rowwise")?;
    let c = tp_heads(cols, tp, rank)?;
    let mut out = Vec::with_capacity(rows * c.len());
    for row in w.chunks_exact(cols.max(1)) {
        out.extend_from_slice(&row[c.clone()]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Index-valued buffers make every element distinct, so a permutation error cannot hide.
    fn dims() -> MlaDims {
        MlaDims {
            n_head: 4,
            qk_nope: 3,
            v_head: 5,
            kv_lora: 7,
        }
    }

    #[test]
    fn split_then_reassemble_is_identity_and_follows_the_formula() {
        let d = dims();
        let w: Vec<u32> = (0..d.kv_b_len().unwrap() as u32).collect();
        let (k, v) = split(&w, d).unwrap();
        // spot-check the spec formula: K(i, r, h) = W[h*(nope+v) + i, r]
        let (i, r, h) = (2, 6, 3);
        assert_eq!(
            k[i + d.qk_nope * r + d.qk_nope * d.kv_lora * h],
            w[(h * d.head_rows() + i) * d.kv_lora + r]
        );
        let (r, j, h) = (1, 4, 2);
        assert_eq!(
            v[r + d.kv_lora * j + d.kv_lora * d.v_head * h],
            w[(h * d.head_rows() + d.qk_nope + j) * d.kv_lora + r]
        );
        assert_eq!(reassemble(&k, &v, d).unwrap(), w);
        for rank in 0..2 {
            let part = reassemble_heads(&k, &v, d, tp_heads(4, 2, rank).unwrap()).unwrap();
            assert_eq!(part, tp_slice(&w, d, 2, rank).unwrap());
            assert_eq!(part, colwise_slice(&w, 4 * 8, 7, 2, rank).unwrap());
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let d = dims();
        assert!(reassemble(&[0u8; 3], &[0u8; 140], d).is_err());
        assert!(split(&[0u8; 5], d).is_err());
        assert!(tp_heads(4, 3, 0).is_err());
        assert!(tp_heads(4, 2, 2).is_err());
        assert!(tp_heads(4, 0, 0).is_err());
        assert!(MlaDims::from_ne(&[3, 7, 4], &[7, 5, 2]).is_err());
        assert!(MlaDims::from_ne(&[u64::MAX, 7, 4], &[7, 5, 4]).is_err());
        assert_eq!(MlaDims::from_ne(&[3, 7, 4], &[7, 5, 4]).unwrap(), d);
        let m: Vec<u8> = (0..12).collect();
        assert_eq!(
            rowwise_slice(&m, 3, 4, 2, 1).unwrap(),
            vec![2, 3, 6, 7, 10, 11]
        );
    }
}
