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

// Tensor cores: the same scores for bf16 keys of width D <= 128 (D % 32 == 0) and H <= 32 heads,
// as mma.m16n8k16 bf16 x bf16 -> f32 products with the heads as M (two tiles of 16) and 8 keys
// as N. The lane-per-key kernel above is bound by its shared-memory reads of the queries (two
// 16-byte reads per 8 multiply-adds: 38 us a layer at 32,768 keys on the H100 against ~3 us of
// key bytes). A block stages one token's queries (f32, rows past H zero) in shared memory and
// each warp splits them into two bf16 terms held as A fragments (q = hi + lo + r with
// hi = bf16(q), lo = bf16(q - hi), |r| <= 2^-16 |q|; the keys are exact in bf16, so every
// product is exact and both terms accumulate in f32 inside the mma). The dot products' dimension
// order is permuted within each 32 dimensions so that lane t's B fragments of two k-steps are
// one 16-byte load of its key row (dimensions 32j + 8t .. +7: k-step 2j + s takes +4s .. +3);
// the A fragments follow the same permutation (a sum is order-free up to rounding). Per warp
// IXT_TILES tiles of 8 keys, their rows loaded before any product; then per key the weighted
// relu of its heads: each lane its 4 heads, then a 3-level xor tree over the lanes of a key.
// Rounding: the tests' bound (kernels/tests/common/oracle.rs `indexer_tc_tol`).
#define IXT_WARPS 4
#define IXT_TILES 4
#define IXT_KEYS (IXT_WARPS * IXT_TILES * 8)

extern "C" __global__ void __launch_bounds__(32 * IXT_WARPS, 2)
    indexer_scores_tc_bf16(const float* __restrict__ q, long long q_tok_stride, int H, int D,
                           const void* __restrict__ k, long long k_stride,
                           const float* __restrict__ w, long long w_stride,
                           const int* __restrict__ pos, int T, float scale,
                           float* __restrict__ out, long long out_stride, long long tokens) {
    pdl_entry();
    __shared__ __align__(16) float qs[32 * 128];
    __shared__ float wsh[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long kb0 = (long long)blockIdx.x * IXT_KEYS;
    const int nks = D >> 4;  // k-steps
    const int mtiles = H > 16 ? 2 : 1;
    for (long long s = blockIdx.y; s < tokens; s += gridDim.y) {
        const int ps = pos[s];
        float* o = out + s * out_stride;
        // Every key of this block lies after the token's position: all masked (block-uniform).
        if (kb0 > ps) {
            for (int i = threadIdx.x; i < IXT_KEYS; i += blockDim.x)
                if (kb0 + i < T) o[kb0 + i] = NEG_INF;
            continue;
        }
        __syncthreads();  // the previous token's readers are done with qs
        const float* qt = q + s * q_tok_stride;
        for (int i = threadIdx.x; i < 32 * D; i += blockDim.x) {
            const int hh = i / D;
            qs[i] = hh < H ? qt[i] : 0.0f;
        }
        if (threadIdx.x < 32) wsh[threadIdx.x] = threadIdx.x < H ? w[s * w_stride + threadIdx.x] : 0.0f;
        __syncthreads();
        uint32_t ahi[2][8][4], alo[2][8][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int kk = 0; kk < 8; ++kk)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = 16 * m + g + 8 * (i & 1);
                    const int d0 = 32 * (kk >> 1) + 8 * t + 4 * (kk & 1) + 2 * (i >> 1);
                    float x0 = 0.0f, x1 = 0.0f;
                    if (kk < nks) {
                        x0 = qs[row * D + d0];
                        x1 = qs[row * D + d0 + 1];
                    }
                    const float h0 = bf16_to_f32(f32_to_bf16(x0)), h1 = bf16_to_f32(f32_to_bf16(x1));
                    ahi[m][kk][i] = pack_bf16x2(h0, h1);
                    alo[m][kk][i] = pack_bf16x2(x0 - h0, x1 - h1);
                }
        // This warp's key tiles: rows loaded first (past T: row 0, never written out).
        const long long kw0 = kb0 + warp * IXT_TILES * 8;
        uint4 kr[IXT_TILES][4];
#pragma unroll
        for (int n = 0; n < IXT_TILES; ++n) {
            const long long key = kw0 + 8 * n + g;
            const uint4* row = (const uint4*)((const uint16_t*)k + (key < T ? key : 0) * k_stride + 8 * t);
#pragma unroll
            for (int j = 0; j < 4; ++j) kr[n][j] = 2 * j < nks ? row[4 * j] : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int n = 0; n < IXT_TILES; ++n) {
            const long long kt = kw0 + 8 * n;
            if (kt >= T) break;  // warp-uniform
            float c[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                if (kk < nks) {
                    const uint4 v = kr[n][kk >> 1];
                    const uint32_t b[2] = {(kk & 1) ? v.z : v.x, (kk & 1) ? v.w : v.y};
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        if (m < mtiles) {
                            mma_bf16_16816(c[m], ahi[m][kk], b);
                            mma_bf16_16816(c[m], alo[m][kk], b);
                        }
                    }
                }
            }
            // c[m][i]: head 16m + g + 8 (i >> 1), key kt + 2t + (i & 1).
            float tot[2] = {0.0f, 0.0f};
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float wh = wsh[16 * m + g + 8 * (i >> 1)];
                    tot[i & 1] += wh * fmaxf(c[m][i] * scale, 0.0f);
                }
#pragma unroll
            for (int x = 4; x < 32; x <<= 1) {
                tot[0] += __shfl_xor_sync(0xffffffffu, tot[0], x);
                tot[1] += __shfl_xor_sync(0xffffffffu, tot[1], x);
            }
            if (g == 0) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const long long key = kt + 2 * t + e;
                    if (key < T) o[key] = key > ps ? NEG_INF : tot[e];
                }
            }
        }
    }
}
