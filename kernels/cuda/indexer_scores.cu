// Op `indexer_scores`: the DSA lightning indexer's key scores (spec §1.7), in f32:
//   I[s,t] = sum_h w[s,h] * relu(scale * q[s,h,:D] . k[t,:D])   for t < T and t <= pos[s], else -inf.
// D <= 256 (8 values per lane). Keys f32 or bf16. w already carries the 1/sqrt(H) factor (weights_proj(x) * H^-0.5); scale = D^-0.5.
// One warp per key (the key row is read once for all heads), 8 keys per 256-thread block;
// heads are summed in ascending order.

// Keys in f32, or bf16 bit patterns (the bf16 key cache), widened exactly.
template <int BF16>
DEV float key_at(const void* k, long long i) {
    return BF16 ? bf16_to_f32(((const uint16_t*)k)[i]) : ((const float*)k)[i];
}

template <int BF16>
DEV void indexer_impl(const float* __restrict__ q, long long q_tok_stride, int H, int D,
                      const void* __restrict__ k, long long k_stride, const float* __restrict__ w,
                      long long w_stride, const int* __restrict__ pos, int T, float scale,
                      float* __restrict__ out, long long out_stride, long long tokens) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long t = (long long)blockIdx.x * 8 + warp;
    if (t >= T) return;
    float kk[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) kk[m] = lane + 32 * m < D ? key_at<BF16>(k, t * k_stride + lane + 32 * m) : 0.0f;
    // Query tokens grid-stride over grid.y (limited to 65535); the key row stays in registers.
    for (long long s = blockIdx.y; s < tokens; s += gridDim.y) {
        float* o = out + s * out_stride + t;
        if (t > pos[s]) {
            if (lane == 0) *o = NEG_INF;
            continue;
        }
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
}

#define INDEXER_KERNEL(name, BF16)                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                             \
        name(const float* q, long long q_tok_stride, int H, int D, const void* k, long long k_stride, \
             const float* w, long long w_stride, const int* pos, int T, float scale, float* out,  \
             long long out_stride, long long tokens) { pdl_entry();                               \
        indexer_impl<BF16>(q, q_tok_stride, H, D, k, k_stride, w, w_stride, pos, T, scale, out,  \
                           out_stride, tokens);                                                   \
    }
INDEXER_KERNEL(indexer_scores_f32, 0)
INDEXER_KERNEL(indexer_scores_bf16, 1)
