// Op `mla_attention`: absorbed MLA attention over the latent cache (spec §1.6, §2.5), for decode
// and prefill alike. Per query token s and head h:
//   score(t) = scale * q[s,h,:D] . kv[t,:D]     (D = kv_lora + rope = 576 for GLM-5; q = [q_abs | q_rope],
//                                               kv row = [c_norm | k_rope])
//   o[s,h,:Dv] = sum_t softmax(score)(t) * kv[t,:Dv]   (Dv = kv_lora: the latent is the value)
// Keys: either every cached position t < T with t <= pos[s] (dense causal), or the DSA top-k list
// idx[s, 0..n_keys) (-1 = empty slot; a listed key is still masked when t > pos[s] or t >= T).
//
// Two launches with an [S, H, n_keys] f32 score buffer between them (the host chunks S so the
// buffer stays bounded): mla_scores reads each key row once for all heads (one warp per key);
// mla_softmax_av does softmax in f32 (max-subtracted, expf) and the weighted latent sum, one
// block per (head, token), two-pass and fixed-order, so results are run-to-run identical.

#define MLA_MAX_D 1024  // D <= 32 lanes x 32 registers

DEV long long mla_key(const int* idx, long long idx_stride, long long s, int j) {
    return idx ? (long long)idx[s * idx_stride + j] : (long long)j;
}

extern "C" __global__ void __launch_bounds__(256)
    mla_scores_f32(const float* __restrict__ q, long long q_tok_stride, long long q_head_stride,
                   const float* __restrict__ kv, long long kv_stride, int D, int H,
                   const int* __restrict__ pos, const int* __restrict__ idx, long long idx_stride,
                   int n_keys, int T, float scale, float* __restrict__ scores) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.x * 8 + warp;
    const long long s = blockIdx.y;
    if (j >= n_keys) return;
    const long long t = mla_key(idx, idx_stride, s, j);
    float* out = scores + s * (long long)H * n_keys + j;
    if (t < 0 || t >= T || t > pos[s]) {
        if (lane == 0)
            for (int h = 0; h < H; ++h) out[(long long)h * n_keys] = NEG_INF;
        return;
    }
    const int nm = D >> 5;
    float k[32];
    const float* kr = kv + t * kv_stride;
#pragma unroll
    for (int m = 0; m < 32; ++m) k[m] = m < nm ? kr[lane + 32 * m] : 0.0f;
    const float* qs = q + s * q_tok_stride;
    for (int h = 0; h < H; ++h) {
        const float* qh = qs + (long long)h * q_head_stride;
        float acc = 0.0f;
#pragma unroll
        for (int m = 0; m < 32; ++m)
            if (m < nm) acc += qh[lane + 32 * m] * k[m];
        acc = warp_sum(acc);
        if (lane == 0) out[(long long)h * n_keys] = acc * scale;
    }
}

// Block (256 threads) per (h, s); each thread owns output dims d = tid + 256*m, m < 4 (Dv <= 1024).
extern "C" __global__ void __launch_bounds__(256)
    mla_softmax_av_f32(const float* __restrict__ scores, int n_keys, int H,
                       const float* __restrict__ kv, long long kv_stride, int Dv,
                       const int* __restrict__ idx, long long idx_stride,
                       float* __restrict__ o, long long o_tok_stride, long long o_head_stride) {
    __shared__ float scratch[32];
    const int h = blockIdx.x;
    const long long s = blockIdx.y;
    const float* sc = scores + (s * H + h) * (long long)n_keys;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < n_keys; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, scratch);
    float z = 0.0f;
    if (m != NEG_INF)
        for (int j = threadIdx.x; j < n_keys; j += blockDim.x) z += expf(sc[j] - m);
    z = block_sum(z, scratch);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (m != NEG_INF) {
        for (int j = 0; j < n_keys; ++j) {
            const float v = sc[j];
            if (v == NEG_INF) continue;  // masked: uniform across the block
            const float p = expf(v - m);
            const float* kr = kv + mla_key(idx, idx_stride, s, j) * kv_stride;
#pragma unroll
            for (int mm = 0; mm < 4; ++mm) {
                const int d = threadIdx.x + 256 * mm;
                if (d < Dv) acc[mm] += p * kr[d];
            }
        }
    }
    const float inv = z > 0.0f ? 1.0f / z : 0.0f;
    float* orow = o + s * o_tok_stride + (long long)h * o_head_stride;
#pragma unroll
    for (int mm = 0; mm < 4; ++mm) {
        const int d = threadIdx.x + 256 * mm;
        if (d < Dv) orow[d] = acc[mm] * inv;
    }
}
