//! Absorbed MLA attention over the latent cache (decode and prefill), dense-causal or restricted
//! to the DSA top-k key lists. See `kernels/cuda/mla_attention.cu` for the math.

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, PushKernelArg};

use crate::device::{dlen, need_len, to_i32, Gpu};
use crate::error::KernelError;
use crate::launch::shape_err;
use crate::ops::Op;

/// Score buffer budget per launch pair; longer prompts are processed in query chunks.
const SCORE_BYTES: usize = 256 << 20;

/// Shapes and strides of one MLA attention call (all in f32 elements).
#[derive(Debug, Clone, Copy)]
pub struct MlaShape {
    /// Query tokens S.
    pub tokens: usize,
    pub heads: usize,
    /// Query/key width: kv_lora + rope (576 for GLM-5); q = [q_abs | q_rope].
    pub d_qk: usize,
    /// Value width = kv_lora (512): the first d_v values of each cache row.
    pub d_v: usize,
    pub q_tok_stride: usize,
    pub q_head_stride: usize,
    /// Cache row stride (>= d_qk) and the number of valid cache rows T.
    pub kv_stride: usize,
    pub kv_len: usize,
    pub o_tok_stride: usize,
    pub o_head_stride: usize,
    pub scale: f32,
}

/// DSA key lists: `idx[s * stride + j]`, `j < n_keys`; -1 marks an empty slot.
#[derive(Debug, Clone, Copy)]
pub struct KeyLists<'a> {
    pub idx: &'a CudaView<'a, i32>,
    pub n_keys: usize,
    pub stride: usize,
}

impl Gpu {
    /// `o[s,h] = sum_t softmax_t(scale * q[s,h] . kv[t]) * kv[t, :d_v]` over the keys of query s:
    /// all `t <= pos[s]` (dense causal), or the listed keys (sparse, still causal).
    pub fn mla_attention(
        &self,
        q: &impl DevicePtr<f32>,
        kv: &impl DevicePtr<f32>,
        pos: &impl DevicePtr<i32>,
        keys: Option<KeyLists<'_>>,
        o: &mut impl DevicePtrMut<f32>,
        m: MlaShape,
    ) -> Result<(), KernelError> {
        const OP: &str = "mla_attention";
        if m.tokens == 0 || m.heads == 0 || m.kv_len == 0 {
            return Err(shape_err(OP, format!("empty shape {m:?}")));
        }
        if m.d_qk == 0
            || !m.d_qk.is_multiple_of(32)
            || m.d_qk > 1024
            || m.d_v == 0
            || m.d_v > m.d_qk
        {
            return Err(shape_err(
                OP,
                format!(
                    "d_qk {} must be a multiple of 32 <= 1024 and d_v {} <= d_qk",
                    m.d_qk, m.d_v
                ),
            ));
        }
        if m.kv_stride < m.d_qk {
            return Err(shape_err(OP, "kv_stride < d_qk"));
        }
        let q_need = (m.tokens - 1) * m.q_tok_stride + (m.heads - 1) * m.q_head_stride + m.d_qk;
        need_len(OP, "q", dlen(q), q_need)?;
        need_len(OP, "kv", dlen(kv), (m.kv_len - 1) * m.kv_stride + m.d_qk)?;
        need_len(OP, "pos", dlen(pos), m.tokens)?;
        let o_need = (m.tokens - 1) * m.o_tok_stride + (m.heads - 1) * m.o_head_stride + m.d_v;
        need_len(OP, "o", dlen(o), o_need)?;
        let n_keys = match keys {
            Some(k) => {
                if k.n_keys == 0 {
                    return Err(shape_err(OP, "empty key lists"));
                }
                need_len(OP, "idx", k.idx.len(), (m.tokens - 1) * k.stride + k.n_keys)?;
                k.n_keys
            }
            None => m.kv_len,
        };
        let f_scores = self.func(Op::MlaAttention, "mla_scores_f32")?;
        let f_av = self.func(Op::MlaAttention, "mla_softmax_av_f32")?;
        let per_token = m.heads * n_keys * 4;
        let chunk = (SCORE_BYTES / per_token.max(1)).clamp(1, m.tokens);
        let s = self.stream();
        let mut scores = self.zeros::<f32>(chunk * m.heads * n_keys)?;
        let (qp, _gq) = q.device_ptr(s);
        let (kp, _gk) = kv.device_ptr(s);
        let (pp, _gp) = pos.device_ptr(s);
        let (op, _go) = o.device_ptr_mut(s);
        let (ip, istride) = match keys {
            Some(k) => (k.idx.device_ptr(s).0, k.stride as i64),
            None => (0u64, 0i64),
        };
        let (sp, _gs) = scores.device_ptr_mut(s);
        let d = to_i32(OP, "d_qk", m.d_qk)?;
        let dv = to_i32(OP, "d_v", m.d_v)?;
        let h = to_i32(OP, "heads", m.heads)?;
        let nk = to_i32(OP, "n_keys", n_keys)?;
        let t = to_i32(OP, "kv_len", m.kv_len)?;
        let (kvs, qts, qhs) = (
            m.kv_stride as i64,
            m.q_tok_stride as i64,
            m.q_head_stride as i64,
        );
        let (ots, ohs) = (m.o_tok_stride as i64, m.o_head_stride as i64);
        let mut s0 = 0usize;
        while s0 < m.tokens {
            let cs = chunk.min(m.tokens - s0);
            // Per-chunk base pointers (element offsets to bytes); pos and idx shift by s0 rows.
            let qp_c = qp + (s0 * m.q_tok_stride * 4) as u64;
            let pp_c = pp + (s0 * 4) as u64;
            let ip_c = if ip == 0 {
                0
            } else {
                ip + (s0 as u64) * (istride as u64) * 4
            };
            let op_c = op + (s0 * m.o_tok_stride * 4) as u64;
            let cfg1 = self.cfg(OP, ((n_keys as u64).div_ceil(8), cs as u64, 1), 256)?;
            let mut b1 = s.launch_builder(&f_scores);
            b1.arg(&qp_c)
                .arg(&qts)
                .arg(&qhs)
                .arg(&kp)
                .arg(&kvs)
                .arg(&d)
                .arg(&h);
            b1.arg(&pp_c)
                .arg(&ip_c)
                .arg(&istride)
                .arg(&nk)
                .arg(&t)
                .arg(&m.scale)
                .arg(&sp);
            // SAFETY: q/kv/pos/idx extents checked above for all tokens; scores holds chunk rows.
            self.launched(OP, unsafe { b1.launch(cfg1) })?;
            let cfg2 = self.cfg(OP, (m.heads as u64, cs as u64, 1), 256)?;
            let mut b2 = s.launch_builder(&f_av);
            b2.arg(&sp).arg(&nk).arg(&h).arg(&kp).arg(&kvs).arg(&dv);
            b2.arg(&ip_c).arg(&istride).arg(&op_c).arg(&ots).arg(&ohs);
            // SAFETY: as above; every listed key index is range-checked by mla_scores (-inf).
            self.launched(OP, unsafe { b2.launch(cfg2) })?;
            s0 += cs;
        }
        Ok(())
    }
}
