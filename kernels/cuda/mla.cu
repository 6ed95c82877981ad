// Op `mla`: absorbed MLA attention (one shared latent key/value head, GLM-5 / DeepSeek) for decode
// and prefill, reading each cached latent row once for all query heads of a token:
//   score(s,h,t) = scale * q[s,h,:D] . c[t,:D],   o[s,h,:Dv] = sum_t softmax_t(score) c[t,:Dv]
// (c = the cache row: normalised latent then roped key part, D = 576; values are its first
// Dv = 512 columns). Keys of query s: every t < T with t <= pos(s) (dense causal), or the DSA
// top-k list idx[s, 0..n_keys) (-1 = empty; listed keys stay causally masked).
//
// Grid (n_split, S, head groups); a block of W <= 8 warps, each owning 4 heads (up to 32 heads
// per block; more heads are further blocks along z, reading the same latent tiles from L2). Per tile of 32 keys the block loads the 32 latent rows into shared memory once
// (f32, or bf16 widened), then
//   scores:  lane = key, a warp computes its 4 heads' dot products (q from L1, broadcast);
//   softmax: online per head (running max and sum, fixed order over tiles and lanes);
//   values:  lane = 16 output dims, acc[4 heads][16] += p * c[key, dims] for the 32 keys.
// The block writes (max, sum, weighted value sums) per head and split; attn_combine_f32 of the
// attention op merges the splits in order. Every reduction has a fixed order: run-to-run
// identical results.

#define MLA_KT 32

struct MlaP {
    const float* q;
    long long q_tok, q_head;
    const void* kv;
    long long kv_stride;
    int D, Dv, H, T;
    const int* pos;
    int pos0;
    const int* idx;
    long long idx_stride;
    int n_keys, split_len;
    float scale;
    int n_split, heads_per_block;
    int stage_q;
    float* part;
};

template <int BF16>
DEV float4 mla_load4(const void* kv, long long off) {
    if (BF16) {
        const uint2 v = *(const uint2*)((const uint16_t*)kv + off);
        return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u),
                           __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xFFFF0000u));
    }
    return *(const float4*)((const float*)kv + off);
}

template <int BF16>
DEV void mla_impl(const MlaP& p) {
    extern __shared__ float sm[];
    const int DS = p.D + 4;  // row pitch: lanes' rows land on distinct bank groups
    float* ks = sm;
    float* ps = sm + MLA_KT * DS;
    int* kok = (int*)(ps + p.heads_per_block * MLA_KT);
    // With stage_q (a decode step's few tokens: a block then reads only a tile or two) the
    // block's queries are copied to shared memory first, all loads in flight together, instead
    // of the score loop waiting on an L2 round trip per step of q.
    float* qsm = (float*)(kok + MLA_KT);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int split = blockIdx.x;
    const long long s = blockIdx.y;
    const int h0 = blockIdx.z * p.heads_per_block + 4 * warp;
    const long long pos_s = p.pos ? (long long)p.pos[s] : (long long)p.pos0 + s;
    const int n_eff = p.idx ? p.n_keys : (int)min((long long)p.T, pos_s + 1);
    const int j0 = split * p.split_len;
    const int j1 = min(n_eff, j0 + p.split_len);
    const float* qs = p.q + s * p.q_tok;
    int hh4[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) hh4[i] = min(h0 + i, p.H - 1);
    const int hb0 = blockIdx.z * p.heads_per_block;
    if (p.stage_q) {
        const int nh = min(p.heads_per_block, p.H - hb0), d4q = p.D >> 2;
#pragma unroll 8
        for (int i = threadIdx.x; i < nh * d4q; i += blockDim.x) {
            const int hh = i / d4q, c = i - hh * d4q;
            *(float4*)(qsm + hh * p.D + 4 * c) =
                __ldg((const float4*)(qs + (hb0 + hh) * p.q_head + 4 * c));
        }
        // Read only after the tile loop's first barrier.
    }
    const float* qh[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        qh[i] = p.stage_q ? qsm + (hh4[i] - hb0) * p.D : qs + hh4[i] * p.q_head;
    float m[4], l[4], acc[4][16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; ++k) acc[i][k] = 0.0f;
    }
    const int d4 = p.D >> 2;
    for (int jt = j0; jt < j1; jt += MLA_KT) {
        if (threadIdx.x < MLA_KT) {
            const int jj = jt + threadIdx.x;
            long long t = -1;
            if (jj < j1) t = p.idx ? (long long)p.idx[s * p.idx_stride + jj] : (long long)jj;
            kok[threadIdx.x] = (t >= 0 && t < p.T && t <= pos_s) ? (int)t + 1 : 0;
        }
        __syncthreads();
        // Unrolled so that several rows' loads are in flight at once (latency, not bandwidth,
        // bounds a decode step's few tiles).
#pragma unroll 8
        for (int i = threadIdx.x; i < MLA_KT * d4; i += blockDim.x) {
            const int kk = i / d4, c4 = i - kk * d4;
            const int tt = kok[kk];
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (tt) v = mla_load4<BF16>(p.kv, (long long)(tt - 1) * p.kv_stride + 4 * c4);
            *(float4*)(ks + kk * DS + 4 * c4) = v;
        }
        __syncthreads();
        // Scores: lane = key of the tile, 4 heads per warp.
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float* kr = ks + lane * DS;
        // Unrolled: the q loads of 4 steps are issued together (8 spill on sm_120). Rolled,
        // each step waited for its own q load (an L2 round trip on the first tile), which made a
        // short-context decode step's attention latency-bound (~50 us a layer at 64 heads).
        // Same summation order.
#pragma unroll 4
        for (int d = 0; d < p.D; d += 4) {
            const float4 k4 = *(const float4*)(kr + d);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 q4 = *(const float4*)(qh[i] + d);
                sc[i] += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
            }
        }
        const bool ok = kok[lane] != 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float sv = ok ? sc[i] * p.scale : NEG_INF;
            const float mt = warp_max(sv);
            const float mn = fmaxf(m[i], mt);
            const float alpha = m[i] == NEG_INF ? 0.0f : expf(m[i] - mn);
            const float pv = sv == NEG_INF ? 0.0f : expf(sv - mn);
            l[i] = l[i] * alpha + warp_sum(pv);
            m[i] = mn;
            ps[(4 * warp + i) * MLA_KT + lane] = pv;
#pragma unroll
            for (int k = 0; k < 16; ++k) acc[i][k] *= alpha;
        }
        __syncwarp();
        // Values: lane owns dims 4*lane + 128*mm + c (mm < 4, c < 4).
        for (int kk = 0; kk < MLA_KT; ++kk) {
            const float* vr = ks + kk * DS;
            float pk[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) pk[i] = ps[(4 * warp + i) * MLA_KT + kk];
#pragma unroll
            for (int mm = 0; mm < 4; ++mm) {
                const int dd = 4 * lane + 128 * mm;
                if (dd < p.Dv) {
                    const float4 v4 = *(const float4*)(vr + dd);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[i][4 * mm] += pk[i] * v4.x;
                        acc[i][4 * mm + 1] += pk[i] * v4.y;
                        acc[i][4 * mm + 2] += pk[i] * v4.z;
                        acc[i][4 * mm + 3] += pk[i] * v4.w;
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int h = h0 + i;
        if (h >= p.H || h >= (int)(blockIdx.z + 1) * p.heads_per_block) continue;
        float* pr = p.part + ((s * p.H + h) * (long long)p.n_split + split) * (p.Dv + 2);
        if (lane == 0) {
            pr[0] = m[i];
            pr[1] = l[i];
        }
#pragma unroll
        for (int mm = 0; mm < 4; ++mm) {
            const int dd = 4 * lane + 128 * mm;
            if (dd < p.Dv) {
#pragma unroll
                for (int c = 0; c < 4; ++c) pr[2 + dd + c] = acc[i][4 * mm + c];
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) mla_partial_f32(MlaP p) { mla_impl<0>(p); }
extern "C" __global__ void __launch_bounds__(256, 1) mla_partial_bf16(MlaP p) { mla_impl<1>(p); }
