//! Softmax attention over a sequence's cached keys (decode and prefill): absorbed MLA, unabsorbed
//! MLA and GQA, dense-causal or restricted to the DSA top-k key lists. See
//! `kernels/cuda/attention.cu` for the math and the launch structure.

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::launch::{check_query_span, shape_err};
use crate::ops::Op;

/// Budget for the score and partial-sum buffers of one launch group; longer prompts are
/// processed in query chunks.
const SCRATCH_BYTES: usize = 256 << 20;
/// Keys per split of the value pass (flash-decoding): enough blocks for a long decode.
const MIN_SPLIT: usize = 256;
const MAX_SPLITS: usize = 128;

/// Shapes and strides of one attention call (f32 elements).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query tokens S, query heads H, key/value heads Hkv (H a multiple of Hkv).
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Key width D (<= 1024; 576 for GLM-5's absorbed MLA) and value width Dv (<= 1024).
    pub d_k: usize,
    pub d_v: usize,
    /// q of token s, head h at `s * q_tok_stride + h * q_head_stride`.
    pub q_tok_stride: usize,
    pub q_head_stride: usize,
    /// Key row t, head g at `t * k_stride + g * d_k`; value row t, head g at `t * v_stride + g * d_v`.
    pub k_stride: usize,
    pub v_stride: usize,
    /// Valid cache rows T.
    pub kv_len: usize,
    /// Output of token s, head h at `s * o_tok_stride + h * o_head_stride`.
    pub o_tok_stride: usize,
    pub o_head_stride: usize,
    pub scale: f32,
    /// Position of query 0; query s sees keys `t <= pos0 + s`.
    pub pos0: usize,
}

/// DSA key lists: `idx[s * stride + j]`, `j < n_keys`; -1 marks an empty slot.
#[derive(Debug, Clone, Copy)]
pub struct KeyLists<'a> {
    pub idx: &'a CudaView<'a, i32>,
    pub n_keys: usize,
    pub stride: usize,
}

impl KeyLists<'_> {
    /// The key slots of `tokens` queries: the lists' length (non-empty, every token's row
    /// inside `idx`), or `dense` without lists.
    pub(crate) fn slots(
        keys: Option<Self>,
        op: &'static str,
        tokens: usize,
        dense: usize,
    ) -> Result<usize, KernelError> {
        let Some(kl) = keys else {
            return Ok(dense);
        };
        if kl.n_keys == 0 {
            return Err(shape_err(op, "empty key lists"));
        }
        need_len(
            op,
            "idx",
            kl.idx.len(),
            (tokens - 1) * kl.stride + kl.n_keys,
        )?;
        Ok(kl.n_keys)
    }
}

impl Gpu {
    /// `o[s,h] = sum_t softmax_t(scale * q[s,h] . k[t,g]) * v[t,g]` over the keys of query s:
    /// all `t <= pos0 + s` (dense causal), or the listed keys (sparse, still causal).
    pub fn attention(
        &self,
        q: &impl DevicePtr<f32>,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        keys: Option<KeyLists<'_>>,
        o: &mut impl DevicePtrMut<f32>,
        m: AttnShape,
    ) -> Result<(), KernelError> {
        const OP: &str = "attention";
        if m.tokens == 0 || m.heads == 0 || m.kv_heads == 0 || m.kv_len == 0 {
            return Err(shape_err(OP, format!("empty shape {m:?}")));
        }
        if !m.heads.is_multiple_of(m.kv_heads) {
            return Err(shape_err(
                OP,
                format!("{} heads over {} kv heads", m.heads, m.kv_heads),
            ));
        }
        if m.d_k == 0 || m.d_k > 1024 || m.d_v == 0 || m.d_v > 1024 {
            return Err(shape_err(
                OP,
                format!("widths d_k {} / d_v {} must be 1..=1024", m.d_k, m.d_v),
            ));
        }
        check_query_span(OP, m.pos0, m.tokens, m.kv_len)?;
        let q_need = (m.tokens - 1) * m.q_tok_stride + (m.heads - 1) * m.q_head_stride + m.d_k;
        need_len(OP, "q", dlen(q), q_need)?;
        need_len(
            OP,
            "k",
            dlen(k),
            (m.kv_len - 1) * m.k_stride + m.kv_heads * m.d_k,
        )?;
        need_len(
            OP,
            "v",
            dlen(v),
            (m.kv_len - 1) * m.v_stride + m.kv_heads * m.d_v,
        )?;
        let o_need = (m.tokens - 1) * m.o_tok_stride + (m.heads - 1) * m.o_head_stride + m.d_v;
        need_len(OP, "o", dlen(o), o_need)?;
        let n_keys = KeyLists::slots(keys, OP, m.tokens, m.kv_len)?;
        let split_len = n_keys.div_ceil(MAX_SPLITS).max(MIN_SPLIT);
        let n_split = n_keys.div_ceil(split_len);
        let f_scores = self.func(Op::Attention, "attn_scores_f32")?;
        let f_part = self.func(Op::Attention, "attn_av_partial_f32")?;
        let f_comb = self.func(Op::Attention, "attn_combine_f32")?;
        let per_token = 4 * m.heads * (n_keys + n_split * (m.d_v + 2));
        // Tokens per launch group: bounded scratch, and within the grid's y limit.
        let chunk = (SCRATCH_BYTES / per_token.max(1))
            .clamp(1, m.tokens)
            .min(self.info().max_grid.1 as usize);
        let s = self.stream();
        let mut scores = self.alloc::<f32>(chunk * m.heads * n_keys)?;
        let mut part = self.alloc::<f32>(chunk * m.heads * n_split * (m.d_v + 2))?;
        let (qp, _gq) = q.device_ptr(s);
        let (kp, _gk) = k.device_ptr(s);
        let (vp, _gv) = v.device_ptr(s);
        let (op, _go) = o.device_ptr_mut(s);
        let (ip, istride) = match keys {
            Some(kl) => (kl.idx.device_ptr(s).0, kl.stride as i64),
            None => (0u64, 0i64),
        };
        let (sp, _gs) = scores.device_ptr_mut(s);
        let (pp, _gp) = part.device_ptr_mut(s);
        let d = to_i32(OP, "d_k", m.d_k)?;
        let dv = to_i32(OP, "d_v", m.d_v)?;
        let h = to_i32(OP, "heads", m.heads)?;
        let hkv = to_i32(OP, "kv_heads", m.kv_heads)?;
        let nk = to_i32(OP, "n_keys", n_keys)?;
        let t = to_i32(OP, "kv_len", m.kv_len)?;
        let sl = to_i32(OP, "split", split_len)?;
        let ns = to_i32(OP, "splits", n_split)?;
        let (ks, vs) = (m.k_stride as i64, m.v_stride as i64);
        let (qts, qhs) = (m.q_tok_stride as i64, m.q_head_stride as i64);
        let (ots, ohs) = (m.o_tok_stride as i64, m.o_head_stride as i64);
        let null_pos = 0u64;
        // attn_combine_f32's optional q8 outputs (codes, records): not asked for here.
        let no_q8 = 0u64;
        let mut s0 = 0usize;
        while s0 < m.tokens {
            let cs = chunk.min(m.tokens - s0);
            // Per-chunk base addresses (f32 / i32 elements to bytes).
            let qp_c = qp + (s0 * m.q_tok_stride * 4) as u64;
            let ip_c = if ip == 0 {
                0
            } else {
                ip + (s0 as u64) * (istride as u64) * 4
            };
            let op_c = op + (s0 * m.o_tok_stride * 4) as u64;
            let pos0 = to_i32(OP, "pos0", m.pos0 + s0)?;
            let cfg1 = self.cfg(OP, ((n_keys as u64).div_ceil(8), cs as u64, 1), 256)?;
            let mut b1 = self.args(&f_scores);
            b1.arg(&qp_c)
                .arg(&qts)
                .arg(&qhs)
                .arg(&kp)
                .arg(&ks)
                .arg(&d)
                .arg(&h)
                .arg(&hkv);
            b1.arg(&null_pos)
                .arg(&pos0)
                .arg(&ip_c)
                .arg(&istride)
                .arg(&nk)
                .arg(&t);
            b1.arg(&m.scale).arg(&sp);
            // SAFETY: q/k/idx extents checked above for every token; scores holds `chunk` rows.
            unsafe { self.launch(OP, b1, cfg1) }?;
            let cfg2 = self.cfg(OP, (m.heads as u64, cs as u64, n_split as u64), 256)?;
            let mut b2 = self.args(&f_part);
            b2.arg(&sp)
                .arg(&nk)
                .arg(&h)
                .arg(&hkv)
                .arg(&vp)
                .arg(&vs)
                .arg(&dv);
            b2.arg(&ip_c).arg(&istride).arg(&sl).arg(&pp);
            // SAFETY: keys whose score is finite passed the range check of attn_scores.
            unsafe { self.launch(OP, b2, cfg2) }?;
            let cfg3 = self.cfg_rows(OP, m.heads as u64, cs, 256)?;
            let cs64 = cs as i64;
            let mut b3 = self.args(&f_comb);
            b3.arg(&pp)
                .arg(&ns)
                .arg(&h)
                .arg(&dv)
                .arg(&op_c)
                .arg(&ots)
                .arg(&ohs)
                .arg(&cs64)
                .arg(&no_q8)
                .arg(&no_q8);
            // SAFETY: o extent checked above; no q8 output (null codes and records).
            unsafe { self.launch(OP, b3, cfg3) }?;
            s0 += cs;
        }
        Ok(())
    }
}
