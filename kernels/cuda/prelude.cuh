// Shared prelude of every gguftool kernel module (prepended by kernels/src/nvrtc.rs).
// NVRTC 13.0 ships no standard or CUDA headers, so everything here is self-contained:
// fixed-width integer types, f16/bf16 as raw 16-bit words with PTX conversions, warp reductions.

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

#define DEV __device__ __forceinline__

// A kernel's dynamic shared memory (the launch's byte count) as `T* name`: the extern array on
// the device, the emulator's per-launch buffer in a host build (kernels/emu).
#ifdef GGUFTOOL_EMU
#define DYN_SHARED(T, name) T* const name = (T*)emu_dynamic_shared()
#else
#define DYN_SHARED(T, name) extern __shared__ T name[]
#endif

// Programmatic dependent launch (sm_90+; kernels/src/device.rs launches every kernel whose PTX
// holds griddepcontrol.wait with the stream-serialization attribute). `pdl_trigger` lets the
// next kernel of the stream be scheduled while this one still runs (its blocks then sit in their
// own `pdl_wait`, so launch latency and prologues overlap this kernel's tail); `pdl_wait` blocks
// until every earlier kernel of the stream has completed and its writes are visible. A kernel so
// launched must touch no memory another kernel writes or reads before its `pdl_wait`
// (tests/compile.rs checks the PTX order: parameter loads and L2 prefetches only). On
// older architectures, or launched without the attribute, both are no-ops / return at once.
DEV void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
DEV void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The first statement of every kernel that does nothing before its inputs are ready.
DEV void pdl_entry() {
    pdl_trigger();
    pdl_wait();
}
// Bring the 128-byte line holding `a` into L2 (no register, no wait; a no-op off the GPU). The
// one memory instruction allowed before `pdl_wait`: L2 is where every SM's writes meet, so a line
// fetched early is never a stale copy of one the previous kernel still writes.
DEV void prefetch_l2(const void* a) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
#endif
}

// Exact IEEE conversions (subnormals, inf and NaN included), matching the `half` crate.
#ifdef GGUFTOOL_EMU
// The CPU emulator's (kernels/emu): the same values bit for bit, NaN stays NaN (quiet, payload
// kept as the `half` crate keeps it; no caller depends on a NaN's bits).
DEV float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return __uint_as_float(sign | 0x7F800000u | (m ? 0x400000u | (m << 13) : 0u));
    if (e != 0u) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    // Subnormal (or zero): m * 2^-24 is exact in f32.
    const float v = (float)m * 5.9604644775390625e-8f;
    return __uint_as_float(sign | __float_as_uint(v));
}
#else
DEV float f16_to_f32(uint16_t h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
#endif
DEV float bf16_to_f32(uint16_t h) { return __uint_as_float(((uint32_t)h) << 16); }
// Round to nearest even, NaN kept quiet (same rule as `half::bf16::from_f32`).
DEV uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// D = A B + C, mma.m16n8k16.row.col.f32.bf16.bf16.f32. A (16 x 16) register i of lane 4g + t
// holds row g + 8 (i & 1), columns 2t + 8 (i >> 1) and +1 (low half first); B (16 x 8) register
// i holds rows 2t + 8i and +1 of column g; C / D element i is row g + 8 (i >> 1), column
// 2t + (i & 1). The emulator's model of the instruction under GGUFTOOL_EMU. Needs sm_80+ (mla.cu's
// tensor-core kernel, indexer_scores.cu's tensor-core scorer).
DEV void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef GGUFTOOL_EMU
    emu_mma_m16n8k16_bf16(d, a, b, d);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Two floats rounded to bf16 (f32_to_bf16) in one 32-bit word, the first in the low half.
DEV uint32_t pack_bf16x2(float lo, float hi) {
    return (uint32_t)f32_to_bf16(lo) | ((uint32_t)f32_to_bf16(hi) << 16);
}

DEV float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
DEV float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); `scratch` holds >= 32 floats.
// Every thread gets the result. The summation order is fixed, so results are run-to-run identical.
DEV float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    return t;
}
DEV float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : -__int_as_float(0x7f800000);
    t = warp_max(t);
    return t;
}

#define NEG_INF (-__int_as_float(0x7f800000))

// RoPE of one pair (x1, x2) by the f32 angle `ang` (position * inverse frequency): rope.cu's
// rotation, shared by the kernels that rotate as part of a fused launch so they round alike.
DEV void rope_rotate(float x1, float x2, float ang, float& o1, float& o2) {
    float sn, cs;
    sincosf(ang, &sn, &cs);
    o1 = x1 * cs - x2 * sn;
    o2 = x2 * cs + x1 * sn;
}
// The elements (i1, i2) of pair j: adjacent (styles 0, 1) or n_rot/2 apart (NeoX, style 2).
DEV void rope_pair(int style, int j, int half, int& i1, int& i2) {
    i1 = style == 2 ? j : 2 * j;
    i2 = style == 2 ? j + half : 2 * j + 1;
}

// The arg-max order, total: numbers by value, ties to the lower index, and below them NaNs by
// the lower index. `argmax_takes`: whether (ov, oi) ranks above (v, i); `argmax_step` keeps the
// higher. A NaN never wins over a number and a NaN holder is always replaced by a number, so the
// butterfly reduction is symmetric.
DEV bool argmax_takes(float v, int i, float ov, int oi) {
    const bool vn = v != v, on = ov != ov;
    if (vn || on) return vn && (!on || oi < i);
    return ov > v || (ov == v && oi < i);
}
DEV void argmax_step(float& v, int& i, float ov, int oi) {
    if (argmax_takes(v, i, ov, oi)) {
        v = ov;
        i = oi;
    }
}

// Exact float of a small unsigned integer without the quarter-rate I2F conversion:
// the bits 0x4B000000 | q are the float 2^23 + q, and subtracting 2^23 is exact for q < 2^23.
DEV float u2f_small(uint32_t q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }
// Same for a signed value given with its offset: q + off must lie in [0, 2^23).
// (2^23 + q + off) - (2^23 + off) is exact: both operands and the result are representable.
DEV float i2f_small(int q, int off) {
    return __uint_as_float(0x4B000000u | (uint32_t)(q + off)) - (8388608.0f + (float)off);
}
DEV void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        argmax_step(v, i, ov, oi);
    }
}
// Block arg-max (blockDim.x a multiple of 32); every thread gets the winner. Empty/all-NaN -> i = INT_MAX.
DEV void block_argmax(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < nw ? sv[lane] : NEG_INF;
    i = lane < nw ? si[lane] : 0x7fffffff;
    warp_argmax(v, i);
}

// Exclusive prefix count of `flag` over the block in thread order; `total` gets the block sum.
DEV int block_excl_scan(int flag, int* warp_tot, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const unsigned b = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(b & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) warp_tot[warp] = __popc(b);
    __syncthreads();
    int before = 0, tot = 0;
    for (int w = 0; w < nw; ++w) {
        const int c = warp_tot[w];
        if (w < warp) before += c;
        tot += c;
    }
    total = tot;
    return before + in_warp;
}

// Order-preserving 32-bit key of a float (a larger float has a larger key); NaN maps to 0 and,
// with NO_NEG_INF, so does -inf (the scorers' mask value): key 0 is never selected.
template <bool NO_NEG_INF>
DEV uint32_t select_key(float f) {
    if (f != f || (NO_NEG_INF && f == NEG_INF)) return 0u;
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Radix select over one row (a block of threads): the key of the k-th largest nonzero key and
// how many entries equal to it belong to the k largest (`remaining`), 8 bits per pass from the
// top. Histograms are per block in shared memory (`hist`, 256 ints); equal digits of a warp are
// counted with one atomic (__match_any_sync), since scores cluster in a few digits and plain
// per-element atomics on one bin serialize. 1 <= k <= number of nonzero keys.
template <bool NO_NEG_INF>
DEV void radix_select(const float* __restrict__ xr, int n, int k, int* hist, uint32_t* sh_prefix,
                      int* sh_rem, uint32_t& prefix, int& remaining) {
    const int lane = threadIdx.x & 31;
    prefix = 0;
    uint32_t mask = 0;
    remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += blockDim.x) {
            const int i = base + threadIdx.x;
            const uint32_t key = i < n ? select_key<NO_NEG_INF>(xr[i]) : 0u;
            const uint32_t bin = (key && (key & mask) == prefix) ? ((key >> shift) & 0xFF) : 256u;
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin < 256u && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int rem = remaining, b = 255;
            for (; b > 0; --b) {
                if (hist[b] >= rem) break;
                rem -= hist[b];
            }
            *sh_prefix = prefix | ((uint32_t)b << shift);
            *sh_rem = rem;
        }
        __syncthreads();
        prefix = *sh_prefix;
        remaining = *sh_rem;
        mask |= 0xFFu << shift;
        __syncthreads();
    }
}

// The selected entries in index order: every nonzero key above `prefix`, and the first
// `remaining` equal to it (all nonzero keys when !select). emit(position, index) for each;
// returns how many were selected. `warp_tot` is 32 ints of shared memory.
template <bool NO_NEG_INF, typename Emit>
DEV int compact_selected(const float* __restrict__ xr, int n, bool select, uint32_t prefix,
                         int remaining, int* warp_tot, Emit emit) {
    int written = 0, ties_seen = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const uint32_t key = i < n ? select_key<NO_NEG_INF>(xr[i]) : 0u;
        const int is_tie = select && key != 0u && key == prefix;
        int tie_tot;
        const int tie_rank = ties_seen + block_excl_scan(is_tie, warp_tot, tie_tot);
        const int take = key != 0u && (!select || key > prefix || (is_tie && tie_rank < remaining));
        int take_tot;
        const int at = written + block_excl_scan(take, warp_tot, take_tot);
        if (take) emit(at, i);
        written += take_tot;
        ties_seen += tie_tot;
    }
    return written;
}

// q8a quantization of one block of 32 values held one per lane of a full warp (the input format
// of gemvq.cu): d = max|x| / 127, q = round(x / d) (half away from zero; 0 when d = 0), the code
// at qs[at] and, from lane 0, the record {f32 d; i16 sum of codes 0..15; i16 of 16..31} at
// qd[at >> 5] (`at` = the lane's element index, block-aligned per warp). The division is the
// correctly rounded IEEE one, so a CPU emulation reproduces every code exactly. A block holding
// NaN or an infinity gets d = NaN (codes 0). The one rule for quantize.cu and every fused
// producer epilogue.
DEV void q8a_store_block(float v, long long at, int8_t* __restrict__ qs, float2* __restrict__ qd) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(v));
    // A NaN or infinity in the block poisons its scale, so it shows in every output it feeds
    // (fmaxf would skip a NaN; the float path propagates both).
    const bool bad = __any_sync(0xffffffffu, !(fabsf(v) <= 3.402823466e38f));
    const float dd = bad ? __int_as_float(0x7fc00000) : amax / 127.0f;
    const int q = (dd > 0.0f && !bad) ? (int)roundf(v / dd) : 0;
    qs[at] = (int8_t)q;
    int sum = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const int hi = __shfl_sync(0xffffffffu, sum, 16);
    if (lane == 0) qd[at >> 5] = make_float2(dd, __int_as_float((sum & 0xFFFF) | (hi << 16)));
}

// q8a_store_block for N blocks a warp holds at once (value j of this lane at element
// at0 + j * step; blocks with live[j] false, warp-uniform, store nothing). Same arithmetic per
// block, so the same codes and records bit for bit; the N blocks' shuffle chains are interleaved
// (a row of a decode norm: 6 blocks a warp, whose chains ran one after another).
template <int N>
DEV void q8a_store_blocks(const float (&v)[N], const bool (&live)[N], long long at0, long long step,
                          int8_t* __restrict__ qs, float2* __restrict__ qd) {
    const int lane = threadIdx.x & 31;
    float amax[N];
    int sum[N];
    // Dead blocks (warp-uniform) skip their shuffles: a 2,048-wide row over 512 threads holds
    // 4 live of 8.
#pragma unroll
    for (int j = 0; j < N; ++j) amax[j] = fabsf(v[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int j = 0; j < N; ++j)
            if (live[j]) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], o));
#pragma unroll
    for (int j = 0; j < N; ++j) {
        sum[j] = 0;
        if (!live[j]) continue;
        const bool bad = __any_sync(0xffffffffu, !(fabsf(v[j]) <= 3.402823466e38f));
        const float dd = bad ? __int_as_float(0x7fc00000) : amax[j] / 127.0f;
        amax[j] = dd;
        const int q = (dd > 0.0f && !bad) ? (int)roundf(v[j] / dd) : 0;
        qs[at0 + j * step] = (int8_t)q;
        sum[j] = q;
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1)
#pragma unroll
        for (int j = 0; j < N; ++j)
            if (live[j]) sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], o);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        if (!live[j]) continue;
        const int hi = __shfl_sync(0xffffffffu, sum[j], 16);
        if (lane == 0)
            qd[(at0 + j * step) >> 5] =
                make_float2(amax[j], __int_as_float((sum[j] & 0xFFFF) | (hi << 16)));
    }
}

// Arg-max of xr[i0, i1) by one block (argmax_step's order), with 16-byte loads when xr + i0 is
// aligned; every thread gets the winner (INT_MAX id when nothing qualifies). Returns whether
// the range holds a NaN or an infinity. The order is total (numbers by value then index, NaN
// never taken), so reducing a row in chunks and then the chunks' winners gives the same
// (value, id) as one pass over the row: the multi-block greedy paths rely on this.
DEV bool block_argmax_range(const float* __restrict__ xr, int i0, int i1, float& bv, int& bi,
                            float* sv, int* si) {
    float v = NEG_INF;
    int idx = 0x7fffffff;
    int bad = 0;
    int j0 = i0;
    if ((((unsigned long long)(xr + i0)) & 15) == 0) {
        const float4* x4 = (const float4*)(xr + i0);
        const int n4 = (i1 - i0) >> 2;
#pragma unroll 4
        for (int j = threadIdx.x; j < n4; j += blockDim.x) {
            const float4 q = x4[j];
            const int i = i0 + 4 * j;
            argmax_step(v, idx, q.x, i);
            argmax_step(v, idx, q.y, i + 1);
            argmax_step(v, idx, q.z, i + 2);
            argmax_step(v, idx, q.w, i + 3);
            bad |= !isfinite(q.x) | !isfinite(q.y) | !isfinite(q.z) | !isfinite(q.w);
        }
        j0 = i0 + (n4 << 2);
    }
    for (int i = j0 + threadIdx.x; i < i1; i += blockDim.x) {
        const float q = xr[i];
        argmax_step(v, idx, q, i);
        bad |= !isfinite(q);
    }
    block_argmax(v, idx, sv, si);
    bv = v;
    bi = idx;
    return __syncthreads_or(bad) != 0;
}

// Per-chunk record of the multi-block greedy paths: {value bits, id, non-finite seen, 0}.
DEV void argmax_part_store(int4* p, float v, int i, bool bad) {
    int4 q;
    q.x = __float_as_int(v);
    q.y = i;
    q.z = bad ? 1 : 0;
    q.w = 0;
    *p = q;
}

// Reduce `chunks` records of one row (the second stage of the multi-block greedy paths); every
// thread gets the winner; returns whether any chunk saw a non-finite value.
DEV bool argmax_merge_parts(const int4* __restrict__ part, int chunks, float& bv, int& bi,
                            float* sv, int* si) {
    float v = NEG_INF;
    int idx = 0x7fffffff;
    int bad = 0;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const int4 q = part[c];
        argmax_step(v, idx, __int_as_float(q.x), q.y);
        bad |= q.z;
    }
    block_argmax(v, idx, sv, si);
    bv = v;
    bi = idx;
    return __syncthreads_or(bad) != 0;
}
