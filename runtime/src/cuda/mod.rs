//! The CUDA backend: the [`Backend`] ops on one GPU through the `kernels` crate. Activations are
//! f32 device buffers, weights stay in their GGUF encoding on the device (dequantized inside
//! the GEMV / matmul kernels), KV caches grow in place with amortized doubling.
//!
//! Every op follows the CPU reference's definition (`crate::cpu`), so the GPU can be checked
//! against it op by op and end to end; the tests in `tests.rs` do that on the fixtures.

use std::sync::Arc;

use gguf::GgmlType;
use kernels::{
    AttnShape, Channels, CudaSlice, Gpu, IndexerShape, KernelError, KeyLists, MatShape, RopeLayout,
    RouterConfig, Rows, Rows3,
};

use crate::backend::{
    check_append_rows, check_attention, check_head_concat, check_head_slice, check_indexer,
    check_moe_ffn, check_rope, check_route, check_same, AttnParams, Backend, Gating, IndexerParams,
    RopeParams, RopeStyle, RouteParams, Shape,
};
use crate::weights::HostWeight;
use crate::RuntimeError;

pub mod check;
pub mod comm;
#[cfg(test)]
mod tests;

/// Up to this many activation rows a matmul runs as a channel-batched GEMV (weights read once
/// per row, in their GGUF encoding); above it, dequantize + cuBLAS SGEMM.
const GEMV_MAX_ROWS: usize = 8;
/// Grid-y limit of the channel-batched kernels (CUDA allows 65535 blocks in y).
const MAX_CHANNELS: usize = 65535;

/// A row-major `[rows, cols]` f32 matrix on the device; the buffer may hold spare rows
/// (capacity for KV-cache growth).
pub struct CudaTensor {
    rows: usize,
    cols: usize,
    buf: CudaSlice<f32>,
}

impl CudaTensor {
    fn shape(&self) -> Shape {
        (self.rows, self.cols)
    }
}

/// A weight in its GGUF type on the device; 1-D weights (norms, biases) also as f32 values.
pub struct CudaWeight {
    name: String,
    ty: GgmlType,
    dims: Vec<usize>,
    bytes: CudaSlice<u8>,
    values: Option<CudaSlice<f32>>,
}

/// A row-major `[rows, cols]` i32 matrix on the device; `-1` marks an empty slot.
pub struct CudaIndex {
    rows: usize,
    cols: usize,
    buf: CudaSlice<i32>,
}

/// One CUDA device. Cloning shares the device (and its compiled kernels).
#[derive(Clone)]
pub struct CudaBackend {
    gpu: Arc<Gpu>,
}

fn err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend(msg.into())
}

fn kerr(op: &str) -> impl FnOnce(KernelError) -> RuntimeError + '_ {
    move |e| RuntimeError::Backend(format!("{op}: {e}"))
}

impl CudaBackend {
    /// The backend on CUDA device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, RuntimeError> {
        let gpu = Gpu::get(ordinal).map_err(kerr("opening the CUDA device"))?;
        Ok(Self { gpu })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<CudaTensor, RuntimeError> {
        let buf = self.gpu.zeros::<f32>(rows * cols).map_err(kerr("alloc"))?;
        Ok(CudaTensor { rows, cols, buf })
    }

    fn len(t: &CudaTensor) -> usize {
        t.rows * t.cols
    }

    /// `src` (a dense run of `n` values) into `dst` at element offset `at`.
    fn copy_into(
        &self,
        src: &CudaSlice<f32>,
        n: usize,
        dst: &mut CudaSlice<f32>,
        at: usize,
    ) -> Result<(), RuntimeError> {
        if n == 0 {
            return Ok(());
        }
        let s = src.slice(0..n);
        let mut d = dst.slice_mut(at..at + n);
        self.gpu.copy(&s, &mut d).map_err(kerr("copy"))
    }

    fn vector<'w>(&self, w: &'w CudaWeight, op: &str) -> Result<&'w CudaSlice<f32>, RuntimeError> {
        w.values
            .as_ref()
            .ok_or_else(|| err(format!("{op}: {} {:?} is not a vector", w.name, w.dims)))
    }

    /// `x [rows, k]` times weight rows (ggml `{k, m}`): GEMV per row for decode-sized batches,
    /// dequantize + SGEMM otherwise.
    fn matmul_into(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &mut CudaTensor,
    ) -> Result<(), RuntimeError> {
        let (k, m) = (w.dims[0], w.dims[1]);
        let shape = MatShape::new(w.ty, m, k);
        let gemv_ok = k.is_multiple_of(32) && k.is_multiple_of(w.ty.block_size());
        if x.rows <= GEMV_MAX_ROWS && gemv_ok {
            let ch = Channels {
                count: x.rows,
                ids: None,
                x_stride: k,
                x_div: 1,
                y_stride: m,
            };
            self.gpu
                .gemv_batched(shape, &w.bytes, ch, &x.buf, &mut out.buf)
                .map_err(kerr("matmul"))
        } else {
            self.gpu
                .matmul(shape, &w.bytes, &x.buf, x.rows, &mut out.buf)
                .map_err(kerr("matmul"))
        }
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Index = CudaIndex;

    fn name(&self) -> String {
        let i = self.gpu.info();
        format!(
            "cuda:{} ({}, sm_{}{})",
            i.ordinal, i.name, i.compute_capability.0, i.compute_capability.1
        )
    }

    fn upload(&self, w: HostWeight) -> Result<CudaWeight, RuntimeError> {
        let bytes = self.gpu.upload(w.bytes()).map_err(kerr("upload"))?;
        let values = if w.dims().len() == 1 {
            Some(self.gpu.upload(&w.to_f32()?).map_err(kerr("upload"))?)
        } else {
            None
        };
        Ok(CudaWeight {
            name: w.name().to_string(),
            ty: w.ty(),
            dims: w.dims().to_vec(),
            bytes,
            values,
        })
    }

    fn new_tensor(
        &self,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<CudaTensor, RuntimeError> {
        if data.len() != rows * cols {
            return Err(err(format!(
                "new_tensor: {} values for [{rows}, {cols}]",
                data.len()
            )));
        }
        let buf = if data.is_empty() {
            self.gpu.zeros::<f32>(1)
        } else {
            self.gpu.upload(data)
        }
        .map_err(kerr("new_tensor"))?;
        Ok(CudaTensor { rows, cols, buf })
    }

    fn to_host(&self, t: &CudaTensor) -> Result<Vec<f32>, RuntimeError> {
        let n = Self::len(t);
        if n == 0 {
            return Ok(Vec::new());
        }
        self.gpu
            .download(&t.buf.slice(0..n))
            .map_err(kerr("to_host"))
    }

    fn index_to_host(&self, i: &CudaIndex) -> Result<(usize, usize, Vec<i64>), RuntimeError> {
        let n = i.rows * i.cols;
        let v = if n == 0 {
            Vec::new()
        } else {
            self.gpu
                .download(&i.buf.slice(0..n))
                .map_err(kerr("index_to_host"))?
        };
        Ok((i.rows, i.cols, v.into_iter().map(i64::from).collect()))
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn empty(&self, cols: usize) -> Result<CudaTensor, RuntimeError> {
        self.alloc(0, cols)
    }

    fn append_rows(&self, dst: &mut CudaTensor, src: &CudaTensor) -> Result<(), RuntimeError> {
        check_append_rows(dst.cols, src.cols)?;
        let (old, add) = (Self::len(dst), Self::len(src));
        if old + add > dst.buf.len() {
            // Amortized growth: at least double, and room for 256 rows.
            let cap = (old + add)
                .max(2 * dst.buf.len())
                .max(256 * dst.cols.max(1));
            let mut nb = self.gpu.zeros::<f32>(cap).map_err(kerr("append_rows"))?;
            self.copy_into(&dst.buf, old, &mut nb, 0)?;
            dst.buf = nb;
        }
        self.copy_into(&src.buf, add, &mut dst.buf, old)?;
        dst.rows += src.rows;
        Ok(())
    }

    fn truncate_rows(&self, t: &mut CudaTensor, rows: usize) -> Result<(), RuntimeError> {
        if rows > t.rows {
            return Err(err(format!("truncate_rows: {rows} of {}", t.rows)));
        }
        t.rows = rows;
        Ok(())
    }

    fn slice_rows(
        &self,
        x: &CudaTensor,
        start: usize,
        n: usize,
    ) -> Result<CudaTensor, RuntimeError> {
        if start + n > x.rows {
            return Err(err(format!("slice_rows {start}+{n} of {}", x.rows)));
        }
        let mut out = self.alloc(n, x.cols)?;
        if n * x.cols > 0 {
            let s = x.buf.slice(start * x.cols..(start + n) * x.cols);
            let mut d = out.buf.slice_mut(0..n * x.cols);
            self.gpu.copy(&s, &mut d).map_err(kerr("slice_rows"))?;
        }
        Ok(out)
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor, RuntimeError> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(err(format!("gather_rows: row {bad} of {}", x.rows)));
        }
        let mut out = self.alloc(rows.len(), x.cols)?;
        self.gpu
            .gather_rows(&x.buf, x.rows, x.cols, rows, &mut out.buf)
            .map_err(kerr("gather_rows"))?;
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&CudaTensor]) -> Result<CudaTensor, RuntimeError> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(err("concat_rows: column counts differ"));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let mut out = self.alloc(rows, cols)?;
        let mut at = 0;
        for p in parts {
            self.copy_into(&p.buf, Self::len(p), &mut out.buf, at)?;
            at += Self::len(p);
        }
        Ok(out)
    }

    fn slice_cols(
        &self,
        x: &CudaTensor,
        start: usize,
        n: usize,
    ) -> Result<CudaTensor, RuntimeError> {
        self.head_slice(x, 1, x.cols, start, n)
    }

    fn concat_cols(&self, parts: &[&CudaTensor]) -> Result<CudaTensor, RuntimeError> {
        let rows = parts.first().map_or(0, |p| p.rows);
        if parts.iter().any(|p| p.rows != rows) {
            return Err(err("concat_cols: row counts differ"));
        }
        let cols: usize = parts.iter().map(|p| p.cols).sum();
        let mut out = self.alloc(rows, cols)?;
        let mut off = 0;
        for p in parts {
            if rows > 0 && p.cols > 0 {
                let mut d = out.buf.slice_mut(off..);
                self.gpu
                    .copy_rows(&p.buf, p.cols, &mut d, cols, rows, p.cols)
                    .map_err(kerr("concat_cols"))?;
            }
            off += p.cols;
        }
        Ok(out)
    }

    fn head_slice(
        &self,
        x: &CudaTensor,
        n_head: usize,
        head_dim: usize,
        start: usize,
        n: usize,
    ) -> Result<CudaTensor, RuntimeError> {
        check_head_slice(x.shape(), n_head, head_dim, start, n)?;
        let mut out = self.alloc(x.rows, n_head * n)?;
        if x.rows > 0 && n > 0 {
            // Each (row, head) is one strided row of head_dim values in x.
            let src = x.buf.slice(start..);
            self.gpu
                .copy_rows(&src, head_dim, &mut out.buf, n, x.rows * n_head, n)
                .map_err(kerr("head_slice"))?;
        }
        Ok(out)
    }

    fn head_concat(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
        n_head: usize,
        b_shared: bool,
    ) -> Result<CudaTensor, RuntimeError> {
        let (ad, bd) = check_head_concat(a.shape(), b.shape(), n_head, b_shared)?;
        let w = ad + bd;
        let mut out = self.alloc(a.rows, n_head * w)?;
        let rows = a.rows;
        if rows == 0 {
            return Ok(out);
        }
        if ad > 0 {
            self.gpu
                .copy_rows(&a.buf, ad, &mut out.buf, w, rows * n_head, ad)
                .map_err(kerr("head_concat"))?;
        }
        if bd > 0 {
            if b_shared {
                for h in 0..n_head {
                    let mut d = out.buf.slice_mut(h * w + ad..);
                    self.gpu
                        .copy_rows(&b.buf, bd, &mut d, n_head * w, rows, bd)
                        .map_err(kerr("head_concat"))?;
                }
            } else {
                let mut d = out.buf.slice_mut(ad..);
                self.gpu
                    .copy_rows(&b.buf, bd, &mut d, w, rows * n_head, bd)
                    .map_err(kerr("head_concat"))?;
            }
        }
        Ok(out)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor, RuntimeError> {
        if w.dims.len() != 2 || w.dims[0] != x.cols {
            return Err(err(format!(
                "matmul: [{}, {}] by {} {:?}",
                x.rows, x.cols, w.name, w.dims
            )));
        }
        let mut out = self.alloc(x.rows, w.dims[1])?;
        if x.rows > 0 {
            self.matmul_into(x, w, &mut out)?;
        }
        Ok(out)
    }

    fn matmul_heads(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor, RuntimeError> {
        let d = &w.dims;
        if d.len() != 3 || d[0] * d[2] != x.cols {
            return Err(err(format!(
                "matmul_heads: [{}, {}] by {} {:?}",
                x.rows, x.cols, w.name, d
            )));
        }
        let (k, m, n_head) = (d[0], d[1], d[2]);
        let mut out = self.alloc(x.rows, n_head * m)?;
        let shape = MatShape {
            ty: w.ty,
            rows: m,
            k,
            slabs: n_head,
        };
        // Channel c = row * n_head + head reads x at c * k, uses slab c % n_head, writes at c * m.
        let rows_per_launch = (MAX_CHANNELS / n_head).max(1);
        let mut r0 = 0;
        while r0 < x.rows {
            let rn = rows_per_launch.min(x.rows - r0);
            let xs = x.buf.slice(r0 * x.cols..);
            let mut ys = out.buf.slice_mut(r0 * n_head * m..);
            let ch = Channels {
                count: rn * n_head,
                ids: None,
                x_stride: k,
                x_div: 1,
                y_stride: m,
            };
            self.gpu
                .gemv_batched(shape, &w.bytes, ch, &xs, &mut ys)
                .map_err(kerr("matmul_heads"))?;
            r0 += rn;
        }
        Ok(out)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor, RuntimeError> {
        if table.dims.len() != 2 {
            return Err(err(format!("embed: {} is not 2-D", table.name)));
        }
        let (d, vocab) = (table.dims[0], table.dims[1]);
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(err(format!(
                "token id {bad} out of range (vocabulary {vocab})"
            )));
        }
        let mut out = self.alloc(ids.len(), d)?;
        if ids.is_empty() {
            return Ok(out);
        }
        let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let dids = self.gpu.upload(&ids32).map_err(kerr("embed"))?;
        self.gpu
            .get_rows(table.ty, &table.bytes, d, &dids, &mut out.buf)
            .map_err(kerr("embed"))?;
        Ok(out)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, RuntimeError> {
        let wv = self.vector(w, "rms_norm")?;
        let g = w.dims[0];
        if g == 0 || !x.cols.is_multiple_of(g) {
            return Err(err(format!(
                "rms_norm: {} columns by {} of {g}",
                x.cols, w.name
            )));
        }
        let mut out = self.alloc(x.rows, x.cols)?;
        let groups = x.rows * (x.cols / g);
        if groups > 0 {
            let wv = wv.slice(0..g);
            self.gpu
                .rms_norm(&x.buf, Some(&wv), &mut out.buf, Rows::dense(groups, g), eps)
                .map_err(kerr("rms_norm"))?;
        }
        Ok(out)
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        b: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, RuntimeError> {
        let (wv, bv) = (self.vector(w, "layer_norm")?, self.vector(b, "layer_norm")?);
        if w.dims[0] != x.cols || b.dims[0] != x.cols {
            return Err(err(format!("layer_norm: {} columns by {}", x.cols, w.name)));
        }
        let mut out = self.alloc(x.rows, x.cols)?;
        if x.rows > 0 {
            let (wv, bv) = (wv.slice(0..x.cols), bv.slice(0..x.cols));
            self.gpu
                .layer_norm(
                    &x.buf,
                    Some(&wv),
                    Some(&bv),
                    &mut out.buf,
                    Rows::dense(x.rows, x.cols),
                    eps,
                )
                .map_err(kerr("layer_norm"))?;
        }
        Ok(out)
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor, RuntimeError> {
        check_same("add", a.shape(), b.shape())?;
        let mut out = self.alloc(a.rows, a.cols)?;
        self.gpu
            .add(&a.buf, &b.buf, &mut out.buf, Self::len(a))
            .map_err(kerr("add"))?;
        Ok(out)
    }

    fn add_bias(&self, x: &CudaTensor, b: &CudaWeight) -> Result<CudaTensor, RuntimeError> {
        let bv = self.vector(b, "add_bias")?;
        if b.dims[0] != x.cols {
            return Err(err(format!(
                "add_bias: {} columns, bias {}",
                x.cols, b.name
            )));
        }
        let mut out = self.alloc(x.rows, x.cols)?;
        self.gpu
            .add_bias(&x.buf, bv, &mut out.buf, x.rows, x.cols)
            .map_err(kerr("add_bias"))?;
        Ok(out)
    }

    fn scale(&self, x: &CudaTensor, s: f32) -> Result<CudaTensor, RuntimeError> {
        let mut out = self.alloc(x.rows, x.cols)?;
        self.gpu
            .scale(&x.buf, s, &mut out.buf, Self::len(x))
            .map_err(kerr("scale"))?;
        Ok(out)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor, RuntimeError> {
        check_same("silu_mul", gate.shape(), up.shape())?;
        let mut out = self.alloc(gate.rows, gate.cols)?;
        if Self::len(gate) > 0 {
            self.gpu
                .silu_mul(
                    &gate.buf,
                    &up.buf,
                    &mut out.buf,
                    Rows3::dense(1, Self::len(gate)),
                )
                .map_err(kerr("silu_mul"))?;
        }
        Ok(out)
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        positions: &[u32],
        p: &RopeParams,
    ) -> Result<(), RuntimeError> {
        check_rope(x.shape(), positions.len(), p)?;
        if x.rows == 0 || p.n_rot == 0 || p.n_groups == 0 {
            return Ok(());
        }
        let pos: Vec<i32> = positions
            .iter()
            .map(|&v| i32::try_from(v).map_err(|_| err(format!("rope: position {v} too large"))))
            .collect::<Result<_, _>>()?;
        let dpos = self.gpu.upload(&pos).map_err(kerr("rope"))?;
        let inv = kernels::rope_inv_freq(p.theta, p.n_rot);
        let dinv = self.gpu.upload(&inv).map_err(kerr("rope"))?;
        let layout = RopeLayout {
            tokens: x.rows,
            heads: p.n_groups,
            tok_stride: x.cols,
            head_stride: p.group_dim,
            offset: p.offset,
            n_rot: p.n_rot,
        };
        let style = match p.style {
            RopeStyle::Interleaved => kernels::RopeStyle::Interleaved,
            RopeStyle::Neox => kernels::RopeStyle::Neox,
        };
        self.gpu
            .rope(&mut x.buf, layout, &dpos, &dinv, style)
            .map_err(kerr("rope"))
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        p: &AttnParams,
        selected: Option<&CudaIndex>,
    ) -> Result<CudaTensor, RuntimeError> {
        check_attention(q.shape(), k.shape(), v.shape(), p, selected.map(|s| s.rows))?;
        let n = q.rows;
        let t = k.rows;
        let mut out = self.alloc(n, p.n_head * p.v_dim)?;
        if n == 0 {
            return Ok(out);
        }
        let shape = AttnShape {
            tokens: n,
            heads: p.n_head,
            kv_heads: p.n_kv_head,
            d_k: p.k_dim,
            d_v: p.v_dim,
            q_tok_stride: q.cols,
            q_head_stride: p.k_dim,
            k_stride: k.cols,
            v_stride: v.cols,
            kv_len: t,
            o_tok_stride: p.n_head * p.v_dim,
            o_head_stride: p.v_dim,
            scale: p.scale,
            pos0: p.pos0,
        };
        match selected {
            Some(sel) if sel.cols > 0 => {
                let view = sel.buf.slice(0..sel.rows * sel.cols);
                let keys = KeyLists {
                    idx: &view,
                    n_keys: sel.cols,
                    stride: sel.cols,
                };
                self.gpu
                    .attention(&q.buf, &k.buf, &v.buf, Some(keys), &mut out.buf, shape)
                    .map_err(kerr("attention"))?;
            }
            _ => {
                self.gpu
                    .attention(&q.buf, &k.buf, &v.buf, None, &mut out.buf, shape)
                    .map_err(kerr("attention"))?;
            }
        }
        Ok(out)
    }

    fn indexer_topk(
        &self,
        q: &CudaTensor,
        weights: &CudaTensor,
        keys: &CudaTensor,
        p: &IndexerParams,
    ) -> Result<CudaIndex, RuntimeError> {
        check_indexer(q.shape(), weights.shape(), keys.shape(), p)?;
        let n = q.rows;
        let t = keys.rows;
        let kk = p.top_k;
        let mut sel = self
            .gpu
            .zeros::<i32>(n * kk)
            .map_err(kerr("indexer_topk"))?;
        if n == 0 {
            return Ok(CudaIndex {
                rows: 0,
                cols: kk,
                buf: sel,
            });
        }
        let pos: Vec<i32> = (0..n)
            .map(|i| i32::try_from(p.pos0 + i).map_err(|_| err("indexer_topk: position too large")))
            .collect::<Result<_, _>>()?;
        let dpos = self.gpu.upload(&pos).map_err(kerr("indexer_topk"))?;
        let mut scores = self.gpu.zeros::<f32>(n * t).map_err(kerr("indexer_topk"))?;
        let sh = IndexerShape {
            tokens: n,
            heads: p.n_head,
            dim: p.head_dim,
            q_stride: q.cols,
            k_stride: keys.cols,
            kv_len: t,
            w_stride: weights.cols,
            out_stride: t,
            scale: p.scale,
        };
        self.gpu
            .indexer_scores(&q.buf, &keys.buf, &weights.buf, &dpos, &mut scores, sh)
            .map_err(kerr("indexer_topk"))?;
        self.gpu
            .topk(&scores, n, t, t, kk, &mut sel, None)
            .map_err(kerr("indexer_topk"))?;
        Ok(CudaIndex {
            rows: n,
            cols: kk,
            buf: sel,
        })
    }

    fn moe_route(
        &self,
        logits: &CudaTensor,
        bias: Option<&CudaWeight>,
        p: &RouteParams,
    ) -> Result<(CudaTensor, CudaIndex), RuntimeError> {
        let e = p.n_expert;
        let bias_v = bias.map(|b| self.vector(b, "moe_route")).transpose()?;
        check_route(logits.shape(), bias.map(|b| b.dims[0]), p)?;
        let k = p.n_used;
        let mut w = self.alloc(logits.rows, k)?;
        let mut ids = self
            .gpu
            .zeros::<i32>(logits.rows * k)
            .map_err(kerr("moe_route"))?;
        if logits.rows > 0 {
            let cfg = RouterConfig {
                gating: match p.gating {
                    Gating::Sigmoid => kernels::Gating::Sigmoid,
                    Gating::Softmax => kernels::Gating::Softmax,
                },
                n_experts: e,
                n_group: p.n_group,
                topk_group: p.n_group_used,
                top_k: k,
                norm: p.normalize,
                scale: p.scale,
            };
            let bview = bias_v.map(|b| b.slice(0..e));
            self.gpu
                .moe_route(
                    &logits.buf,
                    logits.rows,
                    e,
                    bview.as_ref(),
                    cfg,
                    &mut ids,
                    &mut w.buf,
                )
                .map_err(kerr("moe_route"))?;
        }
        Ok((
            w,
            CudaIndex {
                rows: logits.rows,
                cols: k,
                buf: ids,
            },
        ))
    }

    fn moe_ffn(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
        weights: &CudaTensor,
        experts: &CudaIndex,
    ) -> Result<CudaTensor, RuntimeError> {
        let (gd, ud, dd) = (&gate.dims, &up.dims, &down.dims);
        check_moe_ffn(
            x.shape(),
            gd,
            ud,
            dd,
            weights.shape(),
            (experts.rows, experts.cols),
        )?;
        let (d, ff, n_exp) = (x.cols, gd[1], gd[2]);
        let kk = experts.cols;
        let mut out = self.alloc(x.rows, d)?;
        if x.rows == 0 || kk == 0 {
            return Ok(out);
        }
        let g_shape = MatShape {
            ty: gate.ty,
            rows: ff,
            k: d,
            slabs: n_exp,
        };
        let u_shape = MatShape {
            ty: up.ty,
            ..g_shape
        };
        let d_shape = MatShape {
            ty: down.ty,
            rows: d,
            k: ff,
            slabs: n_exp,
        };
        // Tokens per launch so that tokens * top_k channels fit the grid; only the selected
        // experts' slabs are read (an id outside 0..n_exp gives NaN rows, -1 is skipped).
        let per = (MAX_CHANNELS / kk).max(1);
        let mut t0 = 0;
        while t0 < x.rows {
            let tn = per.min(x.rows - t0);
            let nch = tn * kk;
            let ids = experts.buf.slice(t0 * kk..(t0 + tn) * kk);
            let xs = x.buf.slice(t0 * d..);
            let mut g = self.gpu.zeros::<f32>(nch * ff).map_err(kerr("moe_ffn"))?;
            let mut u = self.gpu.zeros::<f32>(nch * ff).map_err(kerr("moe_ffn"))?;
            let ch_in = Channels {
                count: nch,
                ids: Some(&ids),
                x_stride: d,
                x_div: kk,
                y_stride: ff,
            };
            self.gpu
                .gemv_batched(g_shape, &gate.bytes, ch_in, &xs, &mut g)
                .map_err(kerr("moe_ffn gate"))?;
            self.gpu
                .gemv_batched(u_shape, &up.bytes, ch_in, &xs, &mut u)
                .map_err(kerr("moe_ffn up"))?;
            let mut a = self.gpu.zeros::<f32>(nch * ff).map_err(kerr("moe_ffn"))?;
            self.gpu
                .silu_mul(&g, &u, &mut a, Rows3::dense(nch, ff))
                .map_err(kerr("moe_ffn act"))?;
            let mut y = self.gpu.zeros::<f32>(nch * d).map_err(kerr("moe_ffn"))?;
            let ch_down = Channels {
                count: nch,
                ids: Some(&ids),
                x_stride: ff,
                x_div: 1,
                y_stride: d,
            };
            self.gpu
                .gemv_batched(d_shape, &down.bytes, ch_down, &a, &mut y)
                .map_err(kerr("moe_ffn down"))?;
            let ws = weights.buf.slice(t0 * kk..(t0 + tn) * kk);
            let mut os = out.buf.slice_mut(t0 * d..(t0 + tn) * d);
            self.gpu
                .moe_combine(&y, d, &ws, tn, kk, d, &mut os, d, false, Some(&ids))
                .map_err(kerr("moe_ffn combine"))?;
            t0 += tn;
        }
        Ok(out)
    }

    fn local_expert_ids(
        &self,
        ids: CudaIndex,
        first: usize,
        count: usize,
    ) -> Result<CudaIndex, RuntimeError> {
        comm::local_expert_ids(self, ids, first, count)
    }
}

/// Open a GGUF model of a supported architecture on CUDA device `ordinal`.
pub fn load_cuda(
    model: Arc<gguf::Model>,
    ordinal: usize,
) -> Result<crate::glm::GlmModel<CudaBackend>, RuntimeError> {
    crate::glm::GlmModel::load(CudaBackend::new(ordinal)?, model)
}
