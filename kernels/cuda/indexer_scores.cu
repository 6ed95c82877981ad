// Op `indexer_scores`: the DSA lightning indexer's key scores (spec §1.7), in f32:
//   I[s,t] = sum_h w[s,h] * relu(scale * q[s,h,:D] . k[t,:D])   for t < T and t <= pos[s], else -inf.
// D <= 256 (8 values per lane). w already carries the 1/sqrt(H) factor (weights_proj(x) * H^-0.5); scale = D^-0.5.
// One warp per key (the key row is read once for all heads), 8 keys per 256-thread block;
// heads are summed in ascending order.

extern "C" __global__ void __launch_bounds__(256)
    indexer_scores_f32(const float* __restrict__ q, long long q_tok_stride, int H, int D,
                       const float* __restrict__ k, long long k_stride, const float* __restrict__ w,
                       long long w_stride, const int* __restrict__ pos, int T, float scale,
                       float* __restrict__ out, long long out_stride) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long t = (long long)blockIdx.x * 8 + warp;
    const long long s = blockIdx.y;
    if (t >= T) return;
    float* o = out + s * out_stride + t;
    if (t > pos[s]) {
        if (lane == 0) *o = NEG_INF;
        return;
    }
    float kk[8];
    const float* kr = k + t * k_stride;
#pragma unroll
    for (int m = 0; m < 8; ++m) kk[m] = lane + 32 * m < D ? kr[lane + 32 * m] : 0.0f;
    const float* qs = q + s * q_tok_stride;
    const float* ws = w + s * w_stride;
    float total = 0.0f;
    for (int h = 0; h < H; ++h) {
        const float* qh = qs + (long long)h * D;
        float acc = 0.0f;
#pragma unroll
        for (int m = 0; m < 8; ++m)
            if (lane + 32 * m < D) acc += qh[lane + 32 * m] * kk[m];
        acc = warp_sum(acc);
        total += ws[h] * fmaxf(acc * scale, 0.0f);
    }
    if (lane == 0) *o = total;
}
