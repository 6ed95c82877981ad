// Op `rmsnorm`: y = w * (x / sqrt(mean(x^2) + eps)), one block per row (spec §1.3).
// The mean is taken in f32 with a fixed reduction order; 1/sqrt is the correctly rounded
// division and sqrt (no rsqrtf approximation), so rows agree with an f64 oracle to ~1e-6.
// Optional fused residual: if `res` is non-null, x = x + res is formed first and written to `xo`.
// Optional fused q8 activations (the input format of gemvq.cu): if `qs` is non-null, every block of
// 32 outputs is also quantized exactly as quantize.cu's quantize_q8a does (same arithmetic, same
// layout: codes qs[r*n + i], records qd[(r*n + i) / 32]), which saves its launch before a GEMV.
// Needs n and blockDim.x multiples of 32 (a warp then holds one whole block per iteration) and
// dense rows (y_stride == n).

// Rows of up to RMS_REGS (the host's kernels::norm::RMS_REGS, defined before this file)
// * blockDim.x values keep them in registers between the two passes: every
// load of a pass is issued at once (one memory round trip per pass; a single-row decode norm is
// bound by that latency, not by bandwidth) and the second pass reads nothing back. Wider rows
// take the strided loops. Both visit a thread's elements in the same order (same sums).
//
// Parts (register path only): gridDim.y blocks share a row. Every part loads the whole row and
// forms its sum of squares exactly as one block does (the same elements per thread, the same
// reduction: the same inverse norm, bit for bit), but writes, and reads the weights of, only
// its register slots j with j % gridDim.y == blockIdx.y. A decode step's one-row norm ran on one
// SM, and its time grew with the row (H100 timeline: 5.0 us at 2,048 values over 512 threads,
// 8.7 us at 6,144 over 1,024): the per-slot epilogue (scaling, the q8 blocks' shuffles and
// divisions) of 32 warps on one SM's issue slots; parts spread it over as many SMs. Nothing a
// part writes is read by another (the host refuses parts where x, res, xo or y overlap).

// Output element i of row r: y = w * x * inv, and its q8 code when `qs` is set (the warp holds
// the whole 32-block of i: n and blockDim.x are multiples of 32, so i < n is warp-uniform).
DEV void rms_out(float xv, float inv, const float* __restrict__ w, float* yr, long long r, int n,
                 int i, int8_t* __restrict__ qs, float2* __restrict__ qd) {
    const float h = xv * inv;
    const float v = w ? w[i] * h : h;
    yr[i] = v;
    if (qs) q8a_store_block(v, r * (long long)n + i, qs, qd);
}

// No __restrict__: callers may normalize in place (y == x) and pass res == xo.
extern "C" __global__ void rmsnorm_f32(const float* x, long long x_stride,
                                       const float* res, long long res_stride,
                                       float* xo, long long xo_stride,
                                       const float* __restrict__ w, float* y,
                                       long long y_stride, int n, float eps,
                                       int8_t* __restrict__ qs, float2* __restrict__ qd) {
    pdl_entry();
    __shared__ float scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    const int bd = blockDim.x, t = threadIdx.x;
    if (n <= RMS_REGS * bd) {
        const int parts = gridDim.y, part = blockIdx.y;
        // The weights are loaded with the row, before the reduction: after it they were a
        // second memory round trip (a 6,144-wide decode row: 9.1 -> 7.3 us, H200, cold caches).
        float xv[RMS_REGS], wv[RMS_REGS];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < RMS_REGS; ++j) {
            const int i = t + j * bd;
            float v = 0.0f;
            wv[j] = 1.0f;
            if (i < n) {
                v = xr[i];
                if (res) v += res[r * res_stride + i];
                if (w && j % parts == part) wv[j] = w[i];
            }
            xv[j] = v;
        }
#pragma unroll
        for (int j = 0; j < RMS_REGS; ++j) {
            const int i = t + j * bd;
            if (i < n) {
                if (res && j % parts == part) xo[r * xo_stride + i] = xv[j];
                ss += xv[j] * xv[j];
            }
        }
        ss = block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        // y = w * (x * inv) as rms_out; the q8 blocks of all RMS_REGS values in one interleaved
        // pass (i < n is warp-uniform: n and blockDim.x are multiples of 32).
        bool live[RMS_REGS];
#pragma unroll
        for (int j = 0; j < RMS_REGS; ++j) {
            const int i = t + j * bd;
            live[j] = i < n && j % parts == part;
            const float h = xv[j] * inv;
            xv[j] = w ? wv[j] * h : h;
            if (live[j]) yr[i] = xv[j];
        }
        if (qs) q8a_store_blocks<RMS_REGS>(xv, live, r * (long long)n + t, bd, qs, qd);
        return;
    }
    if (blockIdx.y > 0) return;  // parts are the register path's (the host launches one)
    float ss = 0.0f;
    for (int i = t; i < n; i += bd) {
        float v = xr[i];
        if (res) {
            v += res[r * res_stride + i];
            xo[r * xo_stride + i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    const float* src = res ? xo + r * xo_stride : xr;
    // Each thread reads back only the elements it wrote itself, so no barrier is needed.
    for (int i = t; i < n; i += bd) rms_out(src[i], inv, w, yr, r, n, i, qs, qd);
}

// A cache row's value: f32 `cf` or bf16 `cb` (the one that is set).
DEV void cache_store(float v, long long at, float* __restrict__ cf, uint16_t* __restrict__ cb) {
    if (cf) cf[at] = v;
    else if (cb) cb[at] = f32_to_bf16(v);
}

// The MLA cache rows of kv_a's output in one launch (rms_norm_lead + RoPE + the cache append):
// per row of `cols`, columns 0..n RMS-normalised by w as rmsnorm_f32's register path does it (the
// host launches block_for(n) threads: the same elements per thread, the same reduction, the same
// products, so bitwise its output), the pairs of columns off..off+n_rot (off >= n) rotated as
// rope_f32 does (style 0 or 2), the other columns kept. The row is written back in place and, when
// a cache pointer is set, to cache row r (`c_stride` apart). One block per row; n <= RMS_REGS *
// blockDim.x and n_rot / 2 <= blockDim.x (checked by the host). `b` is unused (null): the
// parameters are layernorm_rope_f32's, so one host launch serves both.
extern "C" __global__ void rmsnorm_rope_f32(float* x, long long x_stride, int cols,
                                            const float* __restrict__ w,
                                            const float* __restrict__ b, int n, float eps, int off,
                                            int n_rot, const int* __restrict__ pos,
                                            const float* __restrict__ inv_freq, int style,
                                            float* __restrict__ cf, uint16_t* __restrict__ cb,
                                            long long c_stride) {
    pdl_entry();
    __shared__ float scratch[32];
    const long long r = blockIdx.x;
    float* xr = x + r * x_stride;
    const long long cr = r * c_stride;
    const int bd = blockDim.x, t = threadIdx.x, half = n_rot >> 1;
    float xv[RMS_REGS];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < RMS_REGS; ++j) {
        const int i = t + j * bd;
        xv[j] = i < n ? xr[i] : 0.0f;
    }
    // The rotated pair, read before the reduction's barriers and written after them.
    int i1 = 0, i2 = 0;
    float o1 = 0.0f, o2 = 0.0f;
    if (t < half) {
        rope_pair(style, t, half, i1, i2);
        rope_rotate(xr[off + i1], xr[off + i2], (float)pos[r] * inv_freq[t], o1, o2);
    }
#pragma unroll
    for (int j = 0; j < RMS_REGS; ++j) {
        const int i = t + j * bd;
        if (i < n) ss += xv[j] * xv[j];
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int j = 0; j < RMS_REGS; ++j) {
        const int i = t + j * bd;
        if (i < n) {
            const float h = xv[j] * inv;
            const float v = w ? w[i] * h : h;
            xr[i] = v;
            cache_store(v, cr + i, cf, cb);
        }
    }
    for (int i = n + t; i < cols; i += bd)
        if (i < off || i >= off + n_rot) cache_store(xr[i], cr + i, cf, cb);
    if (t < half) {
        xr[off + i1] = o1;
        xr[off + i2] = o2;
        cache_store(o1, cr + off + i1, cf, cb);
        cache_store(o2, cr + off + i2, cf, cb);
    }
}
