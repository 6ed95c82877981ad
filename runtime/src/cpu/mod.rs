//! The CPU reference backend: f32 activations, weights left in their GGUF type (dequantized row
//! by row inside the matmul), rayon parallelism. Every other backend is checked against it.

pub mod matmul;

use crate::backend::{
    check_append_rows, check_attention, check_head_concat, check_head_slice, check_indexer,
    check_moe_ffn, check_rope, check_route, check_same, AttnParams, Backend, Gating, IndexerParams,
    RopeParams, RopeStyle, RouteParams, Shape,
};
use crate::weights::HostWeight;
use crate::RuntimeError;
use matmul::{dequant_rows, dot, matmul_rows};
use rayon::prelude::*;

/// A row-major `[rows, cols]` f32 matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        Self { rows, cols, data }
    }
    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
    fn shape(&self) -> Shape {
        (self.rows, self.cols)
    }
}

/// A row-major `[rows, cols]` integer matrix; `-1` marks an empty slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuIndex {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<i32>,
}

/// The CPU backend (stateless; parallelism comes from rayon's global pool).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

fn err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend(msg.into())
}

/// Norm weights are small vectors; the op reads them as f32 each call.
fn vector(w: &HostWeight) -> Result<Vec<f32>, RuntimeError> {
    if w.dims().len() != 1 {
        return Err(err(format!(
            "{}: expected a vector, got {:?}",
            w.name(),
            w.dims()
        )));
    }
    w.to_f32()
}

/// Inverse frequencies as transformers computes them in f32:
/// `1 / theta ^ (float(2j) / n_rot)`.
fn inv_freq(theta: f32, n_rot: usize) -> Vec<f32> {
    (0..n_rot / 2)
        .map(|j| {
            let e = (2 * j) as f32 / n_rot as f32;
            1.0f32 / ((theta as f64).powf(e as f64) as f32)
        })
        .collect()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Indices of the `k` largest `scores`, larger first; ties go to the lower index.
fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    let cmp = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
    let k = k.min(idx.len());
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
    }
    idx.truncate(k);
    idx.sort_by(cmp);
    idx
}

/// The lightning indexer's scores of one query against keys `0 .. n_keys` (see
/// [`IndexerParams`]): `sum_h w[h] * relu(scale * q[h] . k[j])`. `keys` is row-major
/// `[>= n_keys, head_dim]`. The CPU's `indexer_topk` ranks exactly these; the forward's observer
/// recomputes them from host copies of the op's inputs (`blk.N.indexer.scores`), so both read
/// this one formula.
pub(crate) fn indexer_scores(
    q: &[f32],
    w: &[f32],
    keys: &[f32],
    n_keys: usize,
    p: &IndexerParams,
) -> Vec<f32> {
    let d = p.head_dim;
    keys.chunks_exact(d.max(1))
        .take(n_keys)
        .map(|kj| {
            let mut acc = 0f32;
            for (qh, wh) in q.chunks_exact(d.max(1)).zip(w).take(p.n_head) {
                acc += (dot(qh, kj) * p.scale).max(0.0) * wh;
            }
            acc
        })
        .collect()
}

/// Router probabilities from one row of logits (sigmoid or softmax gating).
fn route_probs(l: &[f32], gating: Gating) -> Vec<f32> {
    match gating {
        Gating::Sigmoid => l.iter().map(|&x| sigmoid(x)).collect(),
        Gating::Softmax => {
            let mx = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let ex: Vec<f32> = l.iter().map(|x| (x - mx).exp()).collect();
            let s: f32 = ex.iter().sum();
            ex.iter().map(|x| x / s).collect()
        }
    }
}

/// Whether routing first keeps `n_group_used` of `n_group` expert groups.
pub(crate) fn group_limited(p: &RouteParams) -> bool {
    p.n_group > 1 && p.n_group_used < p.n_group
}

/// Each expert group's score, the sum of its two best `keys` (`keys` = probabilities plus
/// bias, one row): the group-limited router keeps the `n_group_used` best groups.
pub(crate) fn route_group_scores(keys: &[f32], p: &RouteParams) -> Vec<f32> {
    let gs = (p.n_expert / p.n_group.max(1)).max(1);
    keys.chunks(gs)
        .map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum())
        .collect()
}

/// One row of routing: `(probs, choice)`, the gated probabilities (the chosen experts'
/// weights) and the values whose top `n_used` are the chosen experts: probabilities plus the
/// e_score_correction bias, with the experts of groups not kept set to -inf (group-limited
/// routing). The CPU's `moe_route` ranks exactly `choice`; the forward's observer emits it
/// (`blk.N.router.choice`) from host copies of the logits and the bias, so both read this one
/// definition. Shapes as [`crate::backend::check_route`] accepts them.
pub(crate) fn route_choice(
    l: &[f32],
    bias: Option<&[f32]>,
    p: &RouteParams,
) -> (Vec<f32>, Vec<f32>) {
    let probs = route_probs(l, p.gating);
    let mut choice: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(x, y)| x + y).collect(),
        None => probs.clone(),
    };
    if group_limited(p) {
        let gs = (p.n_expert / p.n_group).max(1);
        let keep = top_k(&route_group_scores(&choice, p), p.n_group_used);
        for (gi, g) in choice.chunks_mut(gs).enumerate() {
            if !keep.contains(&gi) {
                g.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            }
        }
    }
    (probs, choice)
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = HostWeight;
    type Index = CpuIndex;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn upload(&self, w: HostWeight) -> Result<HostWeight, RuntimeError> {
        Ok(w)
    }

    fn new_tensor(
        &self,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<CpuTensor, RuntimeError> {
        if data.len() != rows * cols {
            return Err(err(format!(
                "new_tensor: {} values for [{rows}, {cols}]",
                data.len()
            )));
        }
        Ok(CpuTensor::new(rows, cols, data.to_vec()))
    }

    fn to_host(&self, t: &CpuTensor) -> Result<Vec<f32>, RuntimeError> {
        Ok(t.data.clone())
    }

    fn index_to_host(&self, i: &CpuIndex) -> Result<(usize, usize, Vec<i64>), RuntimeError> {
        Ok((i.rows, i.cols, i.data.iter().map(|&v| v as i64).collect()))
    }

    fn vector_to_host(&self, w: &HostWeight) -> Result<Vec<f32>, RuntimeError> {
        vector(w)
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn empty(&self, cols: usize) -> Result<CpuTensor, RuntimeError> {
        Ok(CpuTensor::new(0, cols, Vec::new()))
    }

    fn append_rows(&self, dst: &mut CpuTensor, src: &CpuTensor) -> Result<(), RuntimeError> {
        check_append_rows(dst.cols, src.cols)?;
        dst.data.extend_from_slice(&src.data);
        dst.rows += src.rows;
        Ok(())
    }

    fn truncate_rows(&self, t: &mut CpuTensor, rows: usize) -> Result<(), RuntimeError> {
        if rows > t.rows {
            return Err(err(format!("truncate_rows: {rows} of {}", t.rows)));
        }
        t.rows = rows;
        t.data.truncate(rows * t.cols);
        Ok(())
    }

    fn slice_rows(&self, x: &CpuTensor, start: usize, n: usize) -> Result<CpuTensor, RuntimeError> {
        if start + n > x.rows {
            return Err(err(format!("slice_rows {start}+{n} of {}", x.rows)));
        }
        Ok(CpuTensor::new(
            n,
            x.cols,
            x.data[start * x.cols..(start + n) * x.cols].to_vec(),
        ))
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor, RuntimeError> {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            if r >= x.rows {
                return Err(err(format!("gather_rows: row {r} of {}", x.rows)));
            }
            data.extend_from_slice(x.row(r));
        }
        Ok(CpuTensor::new(rows.len(), x.cols, data))
    }

    fn concat_rows(&self, parts: &[&CpuTensor]) -> Result<CpuTensor, RuntimeError> {
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut data = Vec::new();
        let mut rows = 0;
        for p in parts {
            if p.cols != cols {
                return Err(err("concat_rows: column counts differ"));
            }
            data.extend_from_slice(&p.data);
            rows += p.rows;
        }
        Ok(CpuTensor::new(rows, cols, data))
    }

    fn slice_cols(&self, x: &CpuTensor, start: usize, n: usize) -> Result<CpuTensor, RuntimeError> {
        self.head_slice(x, 1, x.cols, start, n)
    }

    fn concat_cols(&self, parts: &[&CpuTensor]) -> Result<CpuTensor, RuntimeError> {
        let rows = parts.first().map_or(0, |p| p.rows);
        if parts.iter().any(|p| p.rows != rows) {
            return Err(err("concat_cols: row counts differ"));
        }
        let cols: usize = parts.iter().map(|p| p.cols).sum();
        let mut data = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for p in parts {
                data.extend_from_slice(p.row(r));
            }
        }
        Ok(CpuTensor::new(rows, cols, data))
    }

    fn head_slice(
        &self,
        x: &CpuTensor,
        n_head: usize,
        head_dim: usize,
        start: usize,
        n: usize,
    ) -> Result<CpuTensor, RuntimeError> {
        check_head_slice(x.shape(), n_head, head_dim, start, n)?;
        let mut data = Vec::with_capacity(x.rows * n_head * n);
        for r in 0..x.rows {
            let row = x.row(r);
            for h in 0..n_head {
                data.extend_from_slice(&row[h * head_dim + start..h * head_dim + start + n]);
            }
        }
        Ok(CpuTensor::new(x.rows, n_head * n, data))
    }

    fn head_concat(
        &self,
        a: &CpuTensor,
        b: &CpuTensor,
        n_head: usize,
        b_shared: bool,
    ) -> Result<CpuTensor, RuntimeError> {
        let (ad, bd) = check_head_concat(a.shape(), b.shape(), n_head, b_shared)?;
        let mut data = Vec::with_capacity(a.rows * n_head * (ad + bd));
        for r in 0..a.rows {
            let (ar, br) = (a.row(r), b.row(r));
            for h in 0..n_head {
                data.extend_from_slice(&ar[h * ad..(h + 1) * ad]);
                if b_shared {
                    data.extend_from_slice(br);
                } else {
                    data.extend_from_slice(&br[h * bd..(h + 1) * bd]);
                }
            }
        }
        Ok(CpuTensor::new(a.rows, n_head * (ad + bd), data))
    }

    fn matmul(&self, x: &CpuTensor, w: &HostWeight) -> Result<CpuTensor, RuntimeError> {
        if w.dims().len() != 2 || w.row_len() != x.cols {
            return Err(err(format!(
                "matmul: [{}, {}] by {} {:?}",
                x.rows,
                x.cols,
                w.name(),
                w.dims()
            )));
        }
        let m = w.n_rows();
        let out = matmul_rows(&x.data, x.rows, w, 0, m)?;
        Ok(CpuTensor::new(x.rows, m, out))
    }

    fn matmul_heads(&self, x: &CpuTensor, w: &HostWeight) -> Result<CpuTensor, RuntimeError> {
        let d = w.dims();
        if d.len() != 3 || d[0] * d[2] != x.cols {
            return Err(err(format!(
                "matmul_heads: [{}, {}] by {} {:?}",
                x.rows,
                x.cols,
                w.name(),
                d
            )));
        }
        let (k, m, n_head) = (d[0], d[1], d[2]);
        let mut out = vec![0f32; x.rows * n_head * m];
        for h in 0..n_head {
            let mut xh = Vec::with_capacity(x.rows * k);
            for r in 0..x.rows {
                xh.extend_from_slice(&x.row(r)[h * k..(h + 1) * k]);
            }
            let oh = matmul_rows(&xh, x.rows, w, h * m, m)?;
            for r in 0..x.rows {
                out[r * n_head * m + h * m..r * n_head * m + (h + 1) * m]
                    .copy_from_slice(&oh[r * m..(r + 1) * m]);
            }
        }
        Ok(CpuTensor::new(x.rows, n_head * m, out))
    }

    fn embed(&self, table: &HostWeight, ids: &[u32]) -> Result<CpuTensor, RuntimeError> {
        if table.dims().len() != 2 {
            return Err(err(format!("embed: {} is not 2-D", table.name())));
        }
        let rows: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
        if let Some(&bad) = rows.iter().find(|&&r| r >= table.n_rows()) {
            return Err(err(format!(
                "token id {bad} out of range (vocabulary {})",
                table.n_rows()
            )));
        }
        let data = dequant_rows(table, &rows)?;
        Ok(CpuTensor::new(ids.len(), table.row_len(), data))
    }

    fn rms_norm(&self, x: &CpuTensor, w: &HostWeight, eps: f32) -> Result<CpuTensor, RuntimeError> {
        let wv = vector(w)?;
        let g = wv.len();
        if g == 0 || !x.cols.is_multiple_of(g) {
            return Err(err(format!(
                "rms_norm: {} columns by {} of {g}",
                x.cols,
                w.name()
            )));
        }
        let mut out = x.data.clone();
        out.par_chunks_mut(g).with_min_len(64).for_each(|grp| {
            let ss: f64 = grp.iter().map(|&v| (v as f64) * (v as f64)).sum();
            let var = (ss / g as f64) as f32;
            let r = 1.0f32 / (var + eps).sqrt();
            for (v, wi) in grp.iter_mut().zip(&wv) {
                *v = wi * (*v * r);
            }
        });
        Ok(CpuTensor::new(x.rows, x.cols, out))
    }

    fn layer_norm(
        &self,
        x: &CpuTensor,
        w: &HostWeight,
        b: &HostWeight,
        eps: f32,
    ) -> Result<CpuTensor, RuntimeError> {
        let (wv, bv) = (vector(w)?, vector(b)?);
        if wv.len() != x.cols || bv.len() != x.cols {
            return Err(err(format!(
                "layer_norm: {} columns by {}",
                x.cols,
                w.name()
            )));
        }
        let mut out = x.data.clone();
        let n = x.cols.max(1);
        out.par_chunks_mut(n).with_min_len(64).for_each(|row| {
            let mean = (row.iter().map(|&v| v as f64).sum::<f64>() / n as f64) as f32;
            let var = (row
                .iter()
                .map(|&v| {
                    let d = (v - mean) as f64;
                    d * d
                })
                .sum::<f64>()
                / n as f64) as f32;
            let r = 1.0f32 / (var + eps).sqrt();
            for ((v, wi), bi) in row.iter_mut().zip(&wv).zip(&bv) {
                *v = (*v - mean) * r * wi + bi;
            }
        });
        Ok(CpuTensor::new(x.rows, x.cols, out))
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor, RuntimeError> {
        check_same("add", a.shape(), b.shape())?;
        let data = a.data.iter().zip(&b.data).map(|(x, y)| x + y).collect();
        Ok(CpuTensor::new(a.rows, a.cols, data))
    }

    fn add_bias(&self, x: &CpuTensor, b: &HostWeight) -> Result<CpuTensor, RuntimeError> {
        let bv = vector(b)?;
        if bv.len() != x.cols {
            return Err(err(format!(
                "add_bias: {} columns, bias {}",
                x.cols,
                b.name()
            )));
        }
        let mut out = x.data.clone();
        for row in out.chunks_mut(x.cols.max(1)) {
            for (v, bb) in row.iter_mut().zip(&bv) {
                *v += bb;
            }
        }
        Ok(CpuTensor::new(x.rows, x.cols, out))
    }

    fn scale(&self, x: &CpuTensor, s: f32) -> Result<CpuTensor, RuntimeError> {
        Ok(CpuTensor::new(
            x.rows,
            x.cols,
            x.data.iter().map(|v| v * s).collect(),
        ))
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor, RuntimeError> {
        check_same("silu_mul", gate.shape(), up.shape())?;
        let data = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        Ok(CpuTensor::new(gate.rows, gate.cols, data))
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        positions: &[u32],
        p: &RopeParams,
    ) -> Result<(), RuntimeError> {
        check_rope(x.shape(), positions.len(), p)?;
        let inv = inv_freq(p.theta, p.n_rot);
        let half = p.n_rot / 2;
        let cols = x.cols.max(1);
        x.data
            .par_chunks_mut(cols)
            .zip(positions.par_iter())
            .with_min_len(16)
            .for_each(|(row, &pos)| {
                let cs: Vec<(f32, f32)> = inv
                    .iter()
                    .map(|&f| {
                        let a = pos as f32 * f;
                        ((a as f64).cos() as f32, (a as f64).sin() as f32)
                    })
                    .collect();
                for g in 0..p.n_groups {
                    let s = &mut row[g * p.group_dim + p.offset..][..p.n_rot];
                    for (j, &(c, sn)) in cs.iter().enumerate() {
                        let (i0, i1) = match p.style {
                            RopeStyle::Interleaved => (2 * j, 2 * j + 1),
                            RopeStyle::Neox => (j, j + half),
                        };
                        let (x0, x1) = (s[i0], s[i1]);
                        s[i0] = x0 * c - x1 * sn;
                        s[i1] = x1 * c + x0 * sn;
                    }
                }
            });
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        p: &AttnParams,
        selected: Option<&CpuIndex>,
    ) -> Result<CpuTensor, RuntimeError> {
        check_attention(q.shape(), k.shape(), v.shape(), p, selected.map(|s| s.rows))?;
        let n = q.rows;
        let t = k.rows;
        let group = p.n_head / p.n_kv_head;
        let mut out = vec![0f32; n * p.n_head * p.v_dim];
        // At least ~64k multiply-adds per task (scores and weighted values over t keys).
        let per_job = (t * (p.k_dim + p.v_dim)).max(1);
        out.par_chunks_mut(p.v_dim.max(1))
            .enumerate()
            .with_min_len((1 << 16) / per_job)
            .for_each(|(job, o)| {
                let (i, h) = (job / p.n_head, job % p.n_head);
                let g = h / group;
                let last = p.pos0 + i;
                let qh = &q.row(i)[h * p.k_dim..(h + 1) * p.k_dim];
                let keys: Vec<usize> = match selected {
                    None => (0..=last).collect(),
                    Some(s) => s.data[i * s.cols..(i + 1) * s.cols]
                        .iter()
                        .filter(|&&j| j >= 0 && (j as usize) <= last)
                        .map(|&j| j as usize)
                        .collect(),
                };
                let scores: Vec<f32> = keys
                    .iter()
                    .map(|&j| dot(qh, &k.row(j)[g * p.k_dim..(g + 1) * p.k_dim]) * p.scale)
                    .collect();
                let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - mx).exp()).collect();
                let sum: f32 = e.iter().sum();
                for (&j, &ej) in keys.iter().zip(&e) {
                    let w = ej / sum;
                    let vr = &v.row(j)[g * p.v_dim..(g + 1) * p.v_dim];
                    for (oo, vv) in o.iter_mut().zip(vr) {
                        *oo += w * vv;
                    }
                }
            });
        Ok(CpuTensor::new(n, p.n_head * p.v_dim, out))
    }

    fn indexer_topk(
        &self,
        q: &CpuTensor,
        weights: &CpuTensor,
        keys: &CpuTensor,
        p: &IndexerParams,
    ) -> Result<CpuIndex, RuntimeError> {
        check_indexer(q.shape(), weights.shape(), keys.shape(), p)?;
        let n = q.rows;
        let kk = p.top_k;
        let mut data = vec![-1i32; n * kk];
        data.par_chunks_mut(kk)
            .enumerate()
            .with_min_len(4)
            .for_each(|(i, sel)| {
                let valid = p.pos0 + i + 1;
                let chosen: Vec<usize> = if valid <= kk {
                    (0..valid).collect()
                } else {
                    let scores = indexer_scores(q.row(i), weights.row(i), &keys.data, valid, p);
                    let mut c = top_k(&scores, kk);
                    c.sort_unstable();
                    c
                };
                for (s, c) in sel.iter_mut().zip(chosen) {
                    *s = c as i32;
                }
            });
        Ok(CpuIndex {
            rows: n,
            cols: kk,
            data,
        })
    }

    fn moe_route(
        &self,
        logits: &CpuTensor,
        bias: Option<&HostWeight>,
        p: &RouteParams,
    ) -> Result<(CpuTensor, CpuIndex), RuntimeError> {
        let bias = bias.map(vector).transpose()?;
        check_route(logits.shape(), bias.as_ref().map(Vec::len), p)?;
        let k = p.n_used;
        let mut w = vec![0f32; logits.rows * k];
        let mut ids = vec![-1i32; logits.rows * k];
        for r in 0..logits.rows {
            let (probs, choice) = route_choice(logits.row(r), bias.as_deref(), p);
            let chosen = top_k(&choice, k);
            let mut ws: Vec<f32> = chosen.iter().map(|&i| probs[i]).collect();
            if p.normalize {
                let s: f32 = ws.iter().sum::<f32>() + 1e-20;
                ws.iter_mut().for_each(|v| *v /= s);
            }
            for (j, (&c, wv)) in chosen.iter().zip(ws).enumerate() {
                ids[r * k + j] = c as i32;
                w[r * k + j] = wv * p.scale;
            }
        }
        Ok((
            CpuTensor::new(logits.rows, k, w),
            CpuIndex {
                rows: logits.rows,
                cols: k,
                data: ids,
            },
        ))
    }

    fn moe_ffn(
        &self,
        x: &CpuTensor,
        gate: &HostWeight,
        up: &HostWeight,
        down: &HostWeight,
        weights: &CpuTensor,
        experts: &CpuIndex,
    ) -> Result<CpuTensor, RuntimeError> {
        let (gd, ud, dd) = (gate.dims(), up.dims(), down.dims());
        check_moe_ffn(
            x.shape(),
            gd,
            ud,
            dd,
            weights.shape(),
            (experts.rows, experts.cols),
        )?;
        let (d, ff, n_exp) = (x.cols, gd[1], gd[2]);
        if experts.data.iter().any(|&e| e < -1 || e >= n_exp as i32) {
            return Err(err("moe_ffn: expert id out of range"));
        }
        let mut out = vec![0f32; x.rows * d];
        // Experts in ascending order, as transformers' loop over hit experts adds them.
        for e in 0..n_exp {
            let mut rows = Vec::new();
            let mut ws = Vec::new();
            for r in 0..x.rows {
                for s in 0..experts.cols {
                    if experts.data[r * experts.cols + s] == e as i32 {
                        rows.push(r);
                        ws.push(weights.data[r * weights.cols + s]);
                    }
                }
            }
            if rows.is_empty() {
                continue;
            }
            let xe = self.gather_rows(x, &rows)?;
            let g = matmul_rows(&xe.data, rows.len(), gate, e * ff, ff)?;
            let u = matmul_rows(&xe.data, rows.len(), up, e * ff, ff)?;
            let a: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let y = matmul_rows(&a, rows.len(), down, e * d, d)?;
            for (j, (&r, &wv)) in rows.iter().zip(&ws).enumerate() {
                for (o, yv) in out[r * d..(r + 1) * d]
                    .iter_mut()
                    .zip(&y[j * d..(j + 1) * d])
                {
                    *o += yv * wv;
                }
            }
        }
        Ok(CpuTensor::new(x.rows, d, out))
    }

    fn local_expert_ids(
        &self,
        mut ids: CpuIndex,
        first: usize,
        count: usize,
    ) -> Result<CpuIndex, RuntimeError> {
        let (lo, hi) = (first as i64, (first + count) as i64);
        for v in ids.data.iter_mut() {
            let e = *v as i64;
            *v = if (lo..hi).contains(&e) {
                (e - lo) as i32
            } else {
                -1
            };
        }
        Ok(ids)
    }
}
