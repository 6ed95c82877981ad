// Op `mla`: absorbed MLA attention (one shared latent key/value head, GLM-5 / DeepSeek) for decode
// and prefill, reading each cached latent row once for all query heads of a token:
//   score(s,h,t) = scale * q[s,h,:D] . c[t,:D],   o[s,h,:Dv] = sum_t softmax_t(score) c[t,:Dv]
// (c = the cache row: normalised latent then roped key part, D = 576; values are its first
// Dv = 512 columns). Keys of query s: every t < T with t <= pos(s) (dense causal), or the DSA
// top-k list idx[s, 0..n_keys) (-1 = empty; listed keys stay causally masked). A batched step of
// several sequences gives each query token its own cache, list, length and position (MlaRow).
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

// A batched step of several sequences: query token s attends to its own sequence's cache, key
// list (null = dense causal), cache length and position.
struct MlaRow {
    const void* kv;
    const int* idx;
    int T;
    int pos;
};

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
    // Decode kernel with one split: the output itself (else null).
    float* o;
    long long o_tok, o_head;
    // Per-token sources of a batched step (null: every token reads kv / T, idx rows, pos or
    // pos0 + s above).
    const MlaRow* rows;
};

// What query token s reads: its cache, key list, length, position and key slots.
struct MlaTok {
    const void* kv;
    const int* idx;
    int T;
    long long pos;
    int n_eff;
};

DEV MlaTok mla_tok(const MlaP& p, long long s) {
    MlaTok k;
    if (p.rows) {
        const MlaRow r = p.rows[s];
        k.kv = r.kv;
        k.idx = r.idx;
        k.T = r.T;
        k.pos = r.pos;
    } else {
        k.kv = p.kv;
        k.idx = p.idx ? p.idx + s * p.idx_stride : nullptr;
        k.T = p.T;
        k.pos = p.pos ? (long long)p.pos[s] : (long long)p.pos0 + s;
    }
    k.n_eff = k.idx ? p.n_keys : (int)min((long long)k.T, k.pos + 1);
    return k;
}

// Key row index of slot jj of a token, or -1 when the slot is empty or masked.
DEV long long mla_dec_key(const MlaTok& k, int jj, int c1) {
    if (jj >= c1) return -1;
    const long long t = k.idx ? (long long)k.idx[jj] : (long long)jj;
    return (t >= 0 && t < k.T && t <= k.pos) ? t : -1;
}

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
    DYN_SHARED(float, sm);
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
    const MlaTok tk = mla_tok(p, s);
    const int j0 = split * p.split_len;
    const int j1 = min(tk.n_eff, j0 + p.split_len);
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
        if (threadIdx.x < MLA_KT) kok[threadIdx.x] = (int)mla_dec_key(tk, jt + threadIdx.x, j1) + 1;
        __syncthreads();
        // Unrolled so that several rows' loads are in flight at once (latency, not bandwidth,
        // bounds a decode step's few tiles).
#pragma unroll 8
        for (int i = threadIdx.x; i < MLA_KT * d4; i += blockDim.x) {
            const int kk = i / d4, c4 = i - kk * d4;
            const int tt = kok[kk];
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (tt) v = mla_load4<BF16>(tk.kv, (long long)(tt - 1) * p.kv_stride + 4 * c4);
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

extern "C" __global__ void __launch_bounds__(256, 1) mla_partial_f32(MlaP p) {
    pdl_entry();
    mla_impl<0>(p);
}
extern "C" __global__ void __launch_bounds__(256, 1) mla_partial_bf16(MlaP p) {
    pdl_entry();
    mla_impl<1>(p);
}

// ---- Decode steps (up to a few query tokens): one warp per MLA_DEC_HPW heads, lane = dims. ----
// The tile kernel above makes each warp walk 576-wide dot products serially with one block per
// SM (186 registers, 150 KB of shared memory): a decode step's 1-2 tiles were latency-bound at
// ~35 us a layer whatever T. Here lane l holds dims 4(l + 32j) .. +3 of its heads' queries in
// registers; per key a warp loads the row once (5 x 8 bytes a lane), the partial dot products
// meet in an xor butterfly (every lane ends with the same sum: each step adds the same two
// values), and the same registers give the weighted values. A block's warps share the rows
// through L1. Keys go in chunks of MLA_DEC_KC: pass 1 scores the chunk (lane r % 32 keeps key
// r's score), one rescale per chunk, pass 2 re-reads the rows' first Dv columns (L1/L2) for the
// weighted sum: no running-max rescale per key. Grid (n_split, S, ceil(H / heads per block));
// with one split the block writes the normalised output itself (what attn_combine_f32 would
// write for one split: acc * 1 / l), else (m, l, acc) partials for the combine.
// Needs D <= 640 and Dv <= 512 (checked by the host). Launch bounds of 3 blocks per SM: without
// them ptxas held 128 registers and spilled; with them 137-156, no spill (tests/compile.rs).
#define MLA_DEC_WARPS 4
#define MLA_DEC_HPW 2
#define MLA_DEC_G 2
#define MLA_DEC_KC 64

// Keys a..b of a token (its key list when `tok` is set, else rows a..b themselves) fetched into
// L2, the block's threads taking the rows' 128-byte lines in turn. A decode step's cache rows were
// written steps ago and have since been evicted by the weights streamed through L2, so every
// key's first load went to DRAM, and a warp's key loop waited for that latency once per key pair
// (H100 timeline: 18 us a layer at 1-64 keys, ~1 us of it bandwidth). Fetched together, the rows
// cost one DRAM latency; the loop's loads then hit L2.
template <int BF16>
DEV void mla_dec_prefetch(const MlaP& p, const void* kv, const MlaTok* tok, int a, int b) {
    const long long bytes = (long long)p.D * (BF16 ? 2 : 4);
    const int lines = (int)(bytes >> 7) + 2;  // an unaligned row spans at most this many
    const int n = (b - a) * lines;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int jj = a + i / lines;
        const long long t = tok ? mla_dec_key(*tok, jj, b) : (long long)jj;
        if (t < 0) continue;
        const char* row = (const char*)kv + t * p.kv_stride * (BF16 ? 2 : 4);
        const unsigned long long first = (unsigned long long)row & ~127ull;
        const unsigned long long last = ((unsigned long long)row + bytes - 1) & ~127ull;
        const unsigned long long line = first + 128ull * (unsigned long long)(i % lines);
        if (line <= last) prefetch_l2((const void*)line);
    }
}

// Before the wait: a one-sequence dense step's block reads rows j0.. of its split, all of them
// below T (a parameter), so their first chunk is fetched while the previous kernel still runs.
// Returns whether it did (a key list or per-sequence rows are only readable after the wait).
template <int BF16>
DEV bool mla_dec_prefetch_early(const MlaP& p) {
    if (p.rows || p.idx) return false;
    const int j0 = blockIdx.x * p.split_len;
    const int j1 = min(p.T, j0 + min(p.split_len, MLA_DEC_KC));
    if (j0 < j1) mla_dec_prefetch<BF16>(p, p.kv, nullptr, j0, j1);
    return true;
}

template <int BF16, int HPW, int G>
DEV void mla_dec_impl(const MlaP& p, bool early) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int split = blockIdx.x;
    const long long s = blockIdx.y;
    const int h0 = (blockIdx.z * (blockDim.x >> 5) + warp) * HPW;
    if (h0 >= p.H) return;
    const MlaTok tok = mla_tok(p, s);
    const int j0 = split * p.split_len;
    const int j1 = min(tok.n_eff, j0 + p.split_len);
    const int nc = p.D >> 2, nvc = p.Dv >> 2;
    float4 q[HPW][5];
#pragma unroll
    for (int h = 0; h < HPW; ++h) {
        const float* qh = p.q + s * p.q_tok + (long long)min(h0 + h, p.H - 1) * p.q_head;
#pragma unroll
        for (int j = 0; j < 5; ++j) {
            const int c = lane + 32 * j;
            q[h][j] = c < nc ? __ldg((const float4*)(qh + 4 * c)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    float m[HPW], l[HPW];
    float4 acc[HPW][4];
#pragma unroll
    for (int h = 0; h < HPW; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[h][j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int c0 = j0; c0 < j1; c0 += MLA_DEC_KC) {
        const int c1 = min(j1, c0 + MLA_DEC_KC);
        if (!(early && c0 == j0)) mla_dec_prefetch<BF16>(p, tok.kv, &tok, c0, c1);
        // Pass 1: scores of this chunk's keys; key c0 + r's score is kept by lane r % 32.
        float sreg[HPW][2], cm[HPW];
#pragma unroll
        for (int h = 0; h < HPW; ++h) {
            sreg[h][0] = sreg[h][1] = NEG_INF;
            cm[h] = NEG_INF;
        }
        for (int jt = c0; jt < c1; jt += G) {
            long long tk[G];
            float sc[HPW][G];
#pragma unroll
            for (int g = 0; g < G; ++g) tk[g] = mla_dec_key(tok, jt + g, c1);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float4 kr[5];
#pragma unroll
                for (int j = 0; j < 5; ++j) {
                    const int c = lane + 32 * j;
                    kr[j] = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (tk[g] >= 0 && c < nc) {
                        kr[j] = mla_load4<BF16>(tok.kv, tk[g] * p.kv_stride + 4 * c);
                    }
                }
#pragma unroll
                for (int h = 0; h < HPW; ++h) {
                    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
                    for (int j = 0; j < 5; ++j) {
                        float& a = (j & 1) ? a1 : a0;
                        a = fmaf(q[h][j].x, kr[j].x, a);
                        a = fmaf(q[h][j].y, kr[j].y, a);
                        a = fmaf(q[h][j].z, kr[j].z, a);
                        a = fmaf(q[h][j].w, kr[j].w, a);
                    }
                    sc[h][g] = a0 + a1;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int h = 0; h < HPW; ++h)
#pragma unroll
                    for (int g = 0; g < G; ++g) sc[h][g] += __shfl_xor_sync(0xffffffffu, sc[h][g], o);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const int r = jt + g - c0;
#pragma unroll
                for (int h = 0; h < HPW; ++h) {
                    const float v = tk[g] >= 0 ? sc[h][g] * p.scale : NEG_INF;
                    cm[h] = fmaxf(cm[h], v);
                    if ((r & 31) == lane) {
                        if (r < 32) sreg[h][0] = v;
                        else sreg[h][1] = v;
                    }
                }
            }
        }
        // One rescale per chunk of 64 keys.
#pragma unroll
        for (int h = 0; h < HPW; ++h) {
            const float mn = fmaxf(m[h], cm[h]);
            if (mn != m[h]) {
                const float alpha = m[h] == NEG_INF ? 0.0f : expf(m[h] - mn);
                l[h] *= alpha;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[h][j].x *= alpha; acc[h][j].y *= alpha; acc[h][j].z *= alpha; acc[h][j].w *= alpha;
                }
                m[h] = mn;
            }
        }
        // Pass 2: weighted values (the first Dv columns of the rows, read again from L1/L2).
        for (int jt = c0; jt < c1; jt += G) {
            long long tk[G];
#pragma unroll
            for (int g = 0; g < G; ++g) tk[g] = mla_dec_key(tok, jt + g, c1);
            float pw[HPW][G];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const int r = jt + g - c0;
#pragma unroll
                for (int h = 0; h < HPW; ++h) {
                    const float v = __shfl_sync(0xffffffffu, r < 32 ? sreg[h][0] : sreg[h][1], r & 31);
                    pw[h][g] = (v == NEG_INF) ? 0.0f : expf(v - m[h]);
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float4 vr[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int c = lane + 32 * j;
                    vr[j] = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (tk[g] >= 0 && c < nvc) {
                        vr[j] = mla_load4<BF16>(tok.kv, tk[g] * p.kv_stride + 4 * c);
                    }
                }
#pragma unroll
                for (int h = 0; h < HPW; ++h) {
                    const float w = pw[h][g];
                    l[h] += w;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        acc[h][j].x = fmaf(w, vr[j].x, acc[h][j].x);
                        acc[h][j].y = fmaf(w, vr[j].y, acc[h][j].y);
                        acc[h][j].z = fmaf(w, vr[j].z, acc[h][j].z);
                        acc[h][j].w = fmaf(w, vr[j].w, acc[h][j].w);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int h = 0; h < HPW; ++h) {
        const int hh = h0 + h;
        if (hh >= p.H) continue;
        if (p.n_split == 1 && p.o) {
            const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
            float* orow = p.o + s * p.o_tok + (long long)hh * p.o_head;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = lane + 32 * j;
                if (c < nvc) {
                    orow[4 * c] = acc[h][j].x * inv;
                    orow[4 * c + 1] = acc[h][j].y * inv;
                    orow[4 * c + 2] = acc[h][j].z * inv;
                    orow[4 * c + 3] = acc[h][j].w * inv;
                }
            }
        } else {
            float* pr = p.part + ((s * p.H + hh) * (long long)p.n_split + split) * (p.Dv + 2);
            if (lane == 0) {
                pr[0] = m[h];
                pr[1] = l[h];
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = lane + 32 * j;
                if (c < nvc) {
                    pr[2 + 4 * c] = acc[h][j].x;
                    pr[3 + 4 * c] = acc[h][j].y;
                    pr[4 + 4 * c] = acc[h][j].z;
                    pr[5 + 4 * c] = acc[h][j].w;
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * MLA_DEC_WARPS, 3) mla_decode_f32(MlaP p) {
    pdl_trigger();
    const bool early = mla_dec_prefetch_early<0>(p);
    pdl_wait();
    mla_dec_impl<0, MLA_DEC_HPW, MLA_DEC_G>(p, early);
}
extern "C" __global__ void __launch_bounds__(32 * MLA_DEC_WARPS, 3) mla_decode_bf16(MlaP p) {
    pdl_trigger();
    const bool early = mla_dec_prefetch_early<1>(p);
    pdl_wait();
    mla_dec_impl<1, MLA_DEC_HPW, MLA_DEC_G>(p, early);
}

// ---- Tensor-core kernel (bf16 cache): a block's heads as the M side of bf16 mma.sync. ----
// The tile kernel above computes 64 heads x keys x 576 dot products on CUDA cores (prefill of 512
// tokens ~2.4 ms a layer, the DSA's 2,048 selected keys ~61 us: both bound by instruction issue,
// not by memory). Here the products run on the tensor cores, mma.m16n8k16 bf16 x bf16 -> f32:
//   S (16 heads x 32 keys) = Q (16 x D) K^T,   O (16 heads x Dv) += P (16 x 32) V (32 x Dv).
// Grid (n_split, S, head groups of 16 * MT); a block of 2 * MT warps: warp w takes heads
// 16 (w >> 1) .. +15 of its group and value columns (w & 1) * Dv/2 .. +Dv/2. Both warps of a
// head tile compute the same scores (the score product is 576 deep, the value product 32 keys:
// recomputing costs less than exchanging them through shared memory and a barrier). The
// block's queries are rounded to bf16 once into shared memory; per chunk of 32 keys the rows
// (bf16, as cached) are copied to shared memory, then S, an online softmax per row (running max
// and sum, one rescale per chunk), and P rounded to bf16 straight from the score registers
// (the accumulator layout of S is the A-operand layout of P, no shared memory) times V read from
// the same rows. Rounding beyond the bf16 cache: q and p to bf16 (relative 2^-8 each), f32
// accumulation inside the mma (the tests' bound: kernels/tests/common/oracle.rs `mla_tc_expect`). Same
// partials (m, l, acc) as the other kernels, or with one split the normalised output itself.
// Needs D % 16 == 0, D <= 576, Dv % 16 == 0, Dv <= 512 (checked by the host: kernels/src/mla.rs
// `mla_tc_fits`; shared memory is sized there too).
#define MLA_TC_KC 32
#define MLA_TC_PAD 8
// Global loads a thread keeps in flight while staging the queries / a chunk's rows.
#define MLA_TC_QB 12
#define MLA_TC_KB 9

// A warp's value n-tiles (8 columns each): Dv / 16 <= 32, held in acc[32][4].
extern "C" __global__ void __launch_bounds__(256, 1) mla_tc_bf16(MlaP p) {
    pdl_entry();
    DYN_SHARED(float, tcsm);  // float: extern shared arrays of a module must agree in type
    const int DP = p.D + MLA_TC_PAD;  // row pitch: lane (g, t)'s words on bank 4g + t
    const int nwarp = blockDim.x >> 5, mt_n = nwarp >> 1;
    uint16_t* qsm = (uint16_t*)tcsm;
    uint16_t* ksm = qsm + 16 * mt_n * DP;
    int* kok = (int*)(ksm + MLA_TC_KC * DP);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int mt = warp >> 1, vh = warp & 1;
    const int split = blockIdx.x;
    const long long s = blockIdx.y;
    const int hb0 = blockIdx.z * 16 * mt_n;
    const MlaTok tok = mla_tok(p, s);
    const int j0 = split * p.split_len;
    const int j1 = min(tok.n_eff, j0 + p.split_len);
    // Queries to bf16 (rows past the last head: zeros, never written out). A thread's loads are
    // issued MLA_TC_QB at a time before any is used: one at a time, the 36 loads of a 64-head
    // block were 36 dependent round trips (a one-block launch, 64 heads over 16 keys, H100:
    // 29.5 us with them, 23.4 us batched).
    {
        const int d4 = p.D >> 2, n = 16 * mt_n * d4;
        const float* qs = p.q + s * p.q_tok;
        for (int i0 = threadIdx.x; i0 < n; i0 += MLA_TC_QB * blockDim.x) {
            float4 v[MLA_TC_QB];
#pragma unroll
            for (int u = 0; u < MLA_TC_QB; ++u) {
                const int i = i0 + u * blockDim.x, r = i / d4, c = i - r * d4;
                v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (i < n && hb0 + r < p.H) v[u] = __ldg((const float4*)(qs + (hb0 + r) * p.q_head + 4 * c));
            }
#pragma unroll
            for (int u = 0; u < MLA_TC_QB; ++u) {
                const int i = i0 + u * blockDim.x, r = i / d4, c = i - r * d4;
                if (i < n) {
                    uint2 w;
                    w.x = pack_bf16x2(v[u].x, v[u].y);
                    w.y = pack_bf16x2(v[u].z, v[u].w);
                    *(uint2*)(qsm + r * DP + 4 * c) = w;
                }
            }
        }
    }
    const int nk16 = p.D >> 4;
    const int nv = p.Dv >> 4;  // this warp's value n-tiles
    const int v0 = vh * (p.Dv >> 1);
    float acc[32][4];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    // Running max and this lane's share of the running sum, rows g and g + 8.
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const uint16_t* qa = qsm + (16 * mt + g) * DP + 2 * t;
    const int d4 = p.D >> 2;
    for (int jt = j0; jt < j1; jt += MLA_TC_KC) {
        if (threadIdx.x < MLA_TC_KC) kok[threadIdx.x] = (int)mla_dec_key(tok, jt + threadIdx.x, j1) + 1;
        __syncthreads();
        // The chunk's rows, MLA_TC_KB loads of a thread in flight together (as for q above).
        for (int i0 = threadIdx.x; i0 < MLA_TC_KC * d4; i0 += MLA_TC_KB * blockDim.x) {
            uint2 v[MLA_TC_KB];
#pragma unroll
            for (int u = 0; u < MLA_TC_KB; ++u) {
                const int i = i0 + u * blockDim.x, kk = i / d4, c = i - kk * d4;
                const int tt = i < MLA_TC_KC * d4 ? kok[kk] : 0;
                v[u] = make_uint2(0u, 0u);
                if (tt) v[u] = *(const uint2*)((const uint16_t*)tok.kv + (long long)(tt - 1) * p.kv_stride + 4 * c);
            }
#pragma unroll
            for (int u = 0; u < MLA_TC_KB; ++u) {
                const int i = i0 + u * blockDim.x, kk = i / d4, c = i - kk * d4;
                if (i < MLA_TC_KC * d4) *(uint2*)(ksm + kk * DP + 4 * c) = v[u];
            }
        }
        __syncthreads();
        // Scores of rows g, g + 8 against keys 8n + 2t, +1 (n < 4).
        float sc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
        const uint16_t* kb = ksm + g * DP + 2 * t;
#pragma unroll 4
        for (int k = 0; k < nk16; ++k) {
            uint32_t a[4];
            a[0] = *(const uint32_t*)(qa + 16 * k);
            a[1] = *(const uint32_t*)(qa + 8 * DP + 16 * k);
            a[2] = *(const uint32_t*)(qa + 16 * k + 8);
            a[3] = *(const uint32_t*)(qa + 8 * DP + 16 * k + 8);
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                uint32_t b[2];
                b[0] = *(const uint32_t*)(kb + 8 * n * DP + 16 * k);
                b[1] = *(const uint32_t*)(kb + 8 * n * DP + 16 * k + 8);
                mma_bf16_16816(sc[n], a, b);
            }
        }
        // Online softmax: scale, mask, chunk max per row (the quad of lanes holding the row).
        float c0 = NEG_INF, c1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const bool ok = kok[8 * n + 2 * t + (i & 1)] != 0;
                sc[n][i] = ok ? sc[n][i] * p.scale : NEG_INF;
            }
            c0 = fmaxf(c0, fmaxf(sc[n][0], sc[n][1]));
            c1 = fmaxf(c1, fmaxf(sc[n][2], sc[n][3]));
        }
        c0 = fmaxf(c0, __shfl_xor_sync(0xffffffffu, c0, 1));
        c0 = fmaxf(c0, __shfl_xor_sync(0xffffffffu, c0, 2));
        c1 = fmaxf(c1, __shfl_xor_sync(0xffffffffu, c1, 1));
        c1 = fmaxf(c1, __shfl_xor_sync(0xffffffffu, c1, 2));
        const float n0 = fmaxf(m0, c0), n1 = fmaxf(m1, c1);
        const float a0 = (m0 == NEG_INF) ? 0.0f : expf(m0 - n0);
        const float a1 = (m1 == NEG_INF) ? 0.0f : expf(m1 - n1);
        m0 = n0;
        m1 = n1;
        l0 *= a0;
        l1 *= a1;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            acc[i][0] *= a0;
            acc[i][1] *= a0;
            acc[i][2] *= a1;
            acc[i][3] *= a1;
        }
        // P in bf16 as the A operand of the value product: k-step k16 = keys 16 k16 .. +15 are
        // the score tiles 2 k16 (columns 2t, 2t + 1) and 2 k16 + 1 (columns 2t + 8, + 9).
        uint32_t pa[2][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            float pv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float mm = (i < 2) ? n0 : n1;
                pv[i] = sc[n][i] == NEG_INF ? 0.0f : expf(sc[n][i] - mm);
            }
            l0 += pv[0] + pv[1];
            l1 += pv[2] + pv[3];
            pa[n >> 1][2 * (n & 1)] = pack_bf16x2(pv[0], pv[1]);
            pa[n >> 1][2 * (n & 1) + 1] = pack_bf16x2(pv[2], pv[3]);
        }
        // Values: column v0 + 8 i + g of keys 16 k16 + 2t (+1, +8, +9).
        const uint16_t* vb = ksm + 2 * t * DP + v0 + g;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            if (i < nv) {
#pragma unroll
                for (int k16 = 0; k16 < 2; ++k16) {
                    const uint16_t* r = vb + 16 * k16 * DP + 8 * i;
                    uint32_t b[2];
                    b[0] = (uint32_t)r[0] | ((uint32_t)r[DP] << 16);
                    b[1] = (uint32_t)r[8 * DP] | ((uint32_t)r[9 * DP] << 16);
                    mma_bf16_16816(acc[i], pa[k16], b);
                }
            }
        }
        __syncthreads();
    }
    // The row sums: each lane of the quad summed its own columns.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    // The accumulators leave through shared memory, a warp's 8 rows of a half at a time: stored
    // straight from the fragments, each warp store would touch 8 rows (heads) x 4 lanes' 8 bytes,
    // scattered (the one-chunk blocks of a decode launch spent as long on those stores as on the
    // whole chunk: in-kernel clock64 timing, H100, docs/BENCHMARKS.md tenth session); from
    // shared memory each store writes 256 contiguous bytes of one row. Every warp first passes
    // the barrier below: a split without chunks passed none, and the queries' staging writes
    // the same shared memory.
    __syncthreads();
    const int ep_pitch = (p.Dv >> 1) + 4;  // float2 stores of lanes (g, t): banks 4g + 2t
    float* ep = (float*)tcsm + warp * 8 * ep_pitch;
    const bool direct = p.n_split == 1 && p.o;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float mh = half ? m1 : m0, lh = half ? l1 : l0;
        // One split: the normalised output (what attn_combine_f32 writes for one split).
        const float f = direct ? (lh > 0.0f ? 1.0f / lh : 0.0f) : 1.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            if (i < nv) {
                *(float2*)(ep + g * ep_pitch + 8 * i + 2 * t) =
                    make_float2(acc[i][2 * half] * f, acc[i][2 * half + 1] * f);
            }
        }
        const int hg = hb0 + 16 * mt + g + 8 * half;
        if (!direct && hg < p.H && vh == 0 && t == 0) {
            float* pr = p.part + ((s * p.H + hg) * (long long)p.n_split + split) * (p.Dv + 2);
            pr[0] = mh;
            pr[1] = lh;
        }
        __syncwarp();
        for (int r = 0; r < 8; ++r) {
            const int h = hb0 + 16 * mt + r + 8 * half;
            if (h >= p.H) break;  // warp-uniform: the rows ascend
            float* dst = direct
                ? p.o + s * p.o_tok + (long long)h * p.o_head + v0
                : p.part + ((s * p.H + h) * (long long)p.n_split + split) * (p.Dv + 2) + 2 + v0;
            for (int c = 2 * lane; c < (p.Dv >> 1); c += 64)
                *(float2*)(dst + c) = *(const float2*)(ep + r * ep_pitch + c);
        }
        __syncwarp();
    }
}
