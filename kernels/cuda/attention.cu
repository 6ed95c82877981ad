// Op `attention`: softmax attention of one sequence over its cached keys, for decode and prefill.
// Covers absorbed MLA (one KV head of width kv_lora + rope = 576 for GLM-5, values = the first
// kv_lora columns of the same cache rows), unabsorbed MLA and GQA (n_kv_head groups).
//   score(s,h,t) = scale * q[s,h,:D] . k[t, g*D : (g+1)*D],  g = h / (H / Hkv)
//   o[s,h,:Dv]   = sum_t softmax_t(score) * v[t, g*Dv : (g+1)*Dv]
// Keys of query s: every t < T with t <= pos(s) (dense causal), or the DSA top-k list
// idx[s, 0..n_keys) (-1 = empty slot; listed keys stay causally masked). pos(s) = pos[s] when
// given, else pos0 + s.
//
// Three launches (the host chunks the queries so the buffers stay bounded):
//   attn_scores      one warp per key reads the key row once for all heads of its group;
//   attn_av_partial  flash-decoding split over keys: per (head, token, split) the local max,
//                    sum of exponentials and weighted value sum;
//   attn_combine     rescales and adds the splits in order.
// Every reduction has a fixed order, so results are run-to-run identical.

DEV long long attn_key(const int* idx, long long idx_stride, long long s, int j) {
    return idx ? (long long)idx[s * idx_stride + j] : (long long)j;
}

extern "C" __global__ void __launch_bounds__(256)
    attn_scores_f32(const float* __restrict__ q, long long q_tok_stride, long long q_head_stride,
                    const float* __restrict__ k, long long k_stride, int D, int H, int Hkv,
                    const int* __restrict__ pos, int pos0, const int* __restrict__ idx,
                    long long idx_stride, int n_keys, int T, float scale,
                    float* __restrict__ scores) {
    pdl_entry();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.x * 8 + warp;
    const long long s = blockIdx.y;
    if (j >= n_keys) return;
    const long long t = attn_key(idx, idx_stride, s, j);
    const long long ps = pos ? (long long)pos[s] : (long long)pos0 + s;
    float* out = scores + s * (long long)H * n_keys + j;
    if (t < 0 || t >= T || t > ps) {
        if (lane == 0)
            for (int h = 0; h < H; ++h) out[(long long)h * n_keys] = NEG_INF;
        return;
    }
    const int group = H / Hkv;
    const float* qs = q + s * q_tok_stride;
    for (int g = 0; g < Hkv; ++g) {
        const float* kr = k + t * k_stride + (long long)g * D;
        float kk[32];
#pragma unroll
        for (int m = 0; m < 32; ++m) kk[m] = lane + 32 * m < D ? kr[lane + 32 * m] : 0.0f;
        for (int hh = 0; hh < group; ++hh) {
            const int h = g * group + hh;
            const float* qh = qs + (long long)h * q_head_stride;
            float acc = 0.0f;
#pragma unroll
            for (int m = 0; m < 32; ++m)
                if (lane + 32 * m < D) acc += qh[lane + 32 * m] * kk[m];
            acc = warp_sum(acc);
            if (lane == 0) out[(long long)h * n_keys] = acc * scale;
        }
    }
}

// Grid (H, S, n_split), 256 threads; thread owns output dims d = tid + 256*m, m < 4 (Dv <= 1024).
// part[((s*H + h) * n_split + split) * (Dv + 2)] = {max, sum of exp, Dv weighted sums}.
extern "C" __global__ void __launch_bounds__(256)
    attn_av_partial_f32(const float* __restrict__ scores, int n_keys, int H, int Hkv,
                        const float* __restrict__ v, long long v_stride, int Dv,
                        const int* __restrict__ idx, long long idx_stride, int split_len,
                        float* __restrict__ part) {
    pdl_entry();
    __shared__ float scratch[32];
    const int h = blockIdx.x, sp = blockIdx.z, n_split = gridDim.z;
    const long long s = blockIdx.y;
    const int g = h / (H / Hkv);
    const float* sc = scores + (s * H + h) * (long long)n_keys;
    const int j0 = sp * split_len;
    const int j1 = min(n_keys, j0 + split_len);
    float m = NEG_INF;
    for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, scratch);
    float z = 0.0f;
    if (m != NEG_INF)
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) z += expf(sc[j] - m);
    z = block_sum(z, scratch);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (m != NEG_INF) {
        for (int j = j0; j < j1; ++j) {
            const float sv = sc[j];
            if (sv == NEG_INF) continue;  // masked: uniform across the block
            const float p = expf(sv - m);
            const float* vr = v + attn_key(idx, idx_stride, s, j) * v_stride + (long long)g * Dv;
#pragma unroll
            for (int mm = 0; mm < 4; ++mm) {
                const int d = threadIdx.x + 256 * mm;
                if (d < Dv) acc[mm] += p * vr[d];
            }
        }
    }
    float* pr = part + ((s * H + h) * (long long)n_split + sp) * (Dv + 2);
    if (threadIdx.x == 0) {
        pr[0] = m;
        pr[1] = z;
    }
#pragma unroll
    for (int mm = 0; mm < 4; ++mm) {
        const int d = threadIdx.x + 256 * mm;
        if (d < Dv) pr[2 + d] = acc[mm];
    }
}

// Grid (H, min(S, 65535)), 256 threads, tokens grid-strided over y:
// o = sum_p acc_p * e^(m_p - M) / sum_p z_p * e^(m_p - M).
// The split weights e^(m_p - M) are computed once per (token, head) into shared memory (threads
// over splits, block reductions in a fixed order), then each thread sums its output dims over
// the splits with independent loads: no serial chain of L2 reads per split. n_split <= 1024
// (checked by the host). A query with no visible key (impossible for causal attention) gets
// zeros.
// Optional fused q8 activations (the input format of gemvq.cu, for the per-head GEMV after MLA):
// if `qs` is non-null, every output value is also quantized exactly as quantize.cu's quantize_q8a
// does for rows = tokens * H of k = Dv (same helper, same arithmetic, same layout: codes
// qs[(s*H + h)*Dv + d], records qd[((s*H + h)*Dv + d) / 32]), which saves its launch. Needs Dv and
// blockDim.x multiples of 32 (a warp then holds one whole block per iteration: d < Dv is
// warp-uniform) and dense o (o_head_stride == Dv, o_tok_stride == H*Dv); the host checks both
// and passes null otherwise. The f32 output is the same with or without it.
#define COMBINE_MAX_SPLITS 1024
extern "C" __global__ void __launch_bounds__(256)
    attn_combine_f32(const float* __restrict__ part, int n_split, int H, int Dv,
                     float* __restrict__ o, long long o_tok_stride, long long o_head_stride,
                     long long tokens, int8_t* __restrict__ qs, float2* __restrict__ qd) {
    pdl_entry();
    __shared__ float wsplit[COMBINE_MAX_SPLITS];
    __shared__ float scratch[32];
    const int h = blockIdx.x;
    const long long row = Dv + 2;
    for (long long s = blockIdx.y; s < tokens; s += gridDim.y) {
        const float* pr = part + (s * H + h) * (long long)n_split * row;
        float m = NEG_INF;
        for (int p = threadIdx.x; p < n_split; p += blockDim.x) m = fmaxf(m, pr[p * row]);
        const float M = block_max(m, scratch);
        float z = 0.0f;
        for (int p = threadIdx.x; p < n_split; p += blockDim.x) {
            const float mp = pr[p * row];
            const float e = (mp == NEG_INF || M == NEG_INF) ? 0.0f : expf(mp - M);
            wsplit[p] = e;
            z += pr[p * row + 1] * e;
        }
        // The barriers inside block_sum also publish wsplit.
        const float Z = block_sum(z, scratch);
        const float inv = Z > 0.0f ? 1.0f / Z : 0.0f;
        float* orow = o + s * o_tok_stride + (long long)h * o_head_stride;
        const long long q_row = (s * H + h) * (long long)Dv;
        for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
            float acc = 0.0f;
#pragma unroll 8
            for (int p = 0; p < n_split; ++p) acc += pr[p * row + 2 + d] * wsplit[p];
            const float v = acc * inv;
            orow[d] = v;
            // Warp-uniform: qs is a parameter, and d < Dv holds for a whole warp or none of it.
            if (qs) q8a_store_block(v, q_row + d, qs, qd);
        }
        __syncthreads();  // wsplit is rewritten for the next token
    }
}
