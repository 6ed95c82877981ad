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

// Lane = key: the same scores for bf16 keys of width D <= 128 (D % 8 == 0), one thread per key.
// The warp-per-key kernel above spends, per key and head, a 5-shuffle tree on a 128-wide dot
// product: ~5M dependent shuffles a call at 32,768 keys (70 us a layer on the H200, docs/GPU.md).
// Here a block stages one token's queries of up to 32 heads in shared memory (every lane reads
// the same address: broadcast, no bank conflicts), a thread walks its key row 8 dimensions at a
// time (one 16-byte load, the next one in flight while the current is used; the row stays in
// L1 for the block's next token) and keeps one partial sum per head: an 8-term FMA chain per
// chunk added to it, chunks in ascending order (rounding depth D / 8 + 8 per head instead of
// D), then the heads summed in ascending order as above. No shuffles, ~1.4 instructions per
// multiply-add.
#define IXL_THREADS 256
#define IXL_HB 32
#define IXL_DMAX 128

extern "C" __global__ void __launch_bounds__(IXL_THREADS, 2)
    indexer_scores_lanes_bf16(const float* __restrict__ q, long long q_tok_stride, int H, int D,
                              const void* __restrict__ k, long long k_stride,
                              const float* __restrict__ w, long long w_stride,
                              const int* __restrict__ pos, int T, float scale,
                              float* __restrict__ out, long long out_stride, long long tokens) {
    pdl_entry();
    __shared__ __align__(16) float qs[IXL_HB * IXL_DMAX];
    __shared__ float wsh[IXL_HB];
    const long long t0 = (long long)blockIdx.x * IXL_THREADS;
    const long long t = t0 + threadIdx.x;
    const bool live = t < T;
    // Threads past the last key read row 0 (T >= 1) and store nothing: no divergent loads.
    // Rows are 16-byte aligned (checked by the host).
    const uint4* kr = (const uint4*)((const uint16_t*)k + (live ? t : 0) * k_stride);
    const int chunks = D >> 3;
    for (long long s = blockIdx.y; s < tokens; s += gridDim.y) {
        const int ps = pos[s];
        float* o = out + s * out_stride;
        // Every key of this block lies after the token's position (causal prefill): all masked.
        // Block-uniform, so the barriers below are skipped by the whole block or by none.
        if (t0 > ps) {
            if (live) o[t] = NEG_INF;
            continue;
        }
        const float* qt = q + s * q_tok_stride;
        float total = 0.0f;
        for (int h0 = 0; h0 < H; h0 += IXL_HB) {
            const int nh = min(IXL_HB, H - h0);
            __syncthreads();  // the previous head group's readers are done with qs
            for (int i = threadIdx.x; i < nh * D; i += IXL_THREADS) qs[i] = qt[(long long)h0 * D + i];
            if (threadIdx.x < nh) wsh[threadIdx.x] = w[s * w_stride + h0 + threadIdx.x];
            __syncthreads();
            float part[IXL_HB];
#pragma unroll
            for (int h = 0; h < IXL_HB; ++h) part[h] = 0.0f;
            uint4 next = kr[0];
#pragma unroll 1
            for (int c = 0; c < chunks; ++c) {
                const uint4 v = next;
                if (c + 1 < chunks) next = kr[c + 1];
                const uint32_t vw[4] = {v.x, v.y, v.z, v.w};
                float kk[8];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    kk[2 * j] = __uint_as_float(vw[j] << 16);
                    kk[2 * j + 1] = __uint_as_float(vw[j] & 0xffff0000u);
                }
                const float* qc = qs + c * 8;
#pragma unroll
                for (int h = 0; h < IXL_HB; ++h) {
                    if (h < nh) {
                        const float4 a = *(const float4*)(qc + h * D);
                        const float4 b = *(const float4*)(qc + h * D + 4);
                        float x = a.x * kk[0];
                        x = fmaf(a.y, kk[1], x);
                        x = fmaf(a.z, kk[2], x);
                        x = fmaf(a.w, kk[3], x);
                        x = fmaf(b.x, kk[4], x);
                        x = fmaf(b.y, kk[5], x);
                        x = fmaf(b.z, kk[6], x);
                        x = fmaf(b.w, kk[7], x);
                        part[h] += x;
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < IXL_HB; ++h)
                if (h < nh) total += wsh[h] * fmaxf(part[h] * scale, 0.0f);
        }
        if (live) o[t] = t > ps ? NEG_INF : total;
    }
}
