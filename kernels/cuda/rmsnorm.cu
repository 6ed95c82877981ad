// Op `rmsnorm`: y = w * (x / sqrt(mean(x^2) + eps)), one block per row (spec §1.3).
// The mean is taken in f32 with a fixed reduction order; 1/sqrt is the correctly rounded
// division and sqrt (no rsqrtf approximation), so rows agree with an f64 oracle to ~1e-6.
// Optional fused residual: if `res` is non-null, x = x + res is formed first and written to `xo`.
// Optional fused q8 activations (the input format of gemvq.cu): if `qs` is non-null, every block of
// 32 outputs is also quantized exactly as quantize.cu's quantize_q8a does (same arithmetic, same
// layout: codes qs[r*n + i], records qd[(r*n + i) / 32]), which saves its launch before a GEMV.
// Needs n and blockDim.x multiples of 32 (a warp then holds one whole block per iteration) and
// dense rows (y_stride == n).

// Rows of up to RMS_REGS * blockDim.x values keep them in registers between the two passes: every
// load of a pass is issued at once (one memory round trip per pass; a single-row decode norm is
// bound by that latency, not by bandwidth) and the second pass reads nothing back. Wider rows
// take the strided loops. Both visit a thread's elements in the same order (same sums).
#define RMS_REGS 8

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
    __shared__ float scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    const int bd = blockDim.x, t = threadIdx.x;
    if (n <= RMS_REGS * bd) {
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
                if (w) wv[j] = w[i];
            }
            xv[j] = v;
        }
#pragma unroll
        for (int j = 0; j < RMS_REGS; ++j) {
            const int i = t + j * bd;
            if (i < n) {
                if (res) xo[r * xo_stride + i] = xv[j];
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
            live[j] = i < n;
            const float h = xv[j] * inv;
            xv[j] = w ? wv[j] * h : h;
            if (live[j]) yr[i] = xv[j];
        }
        if (qs) q8a_store_blocks<RMS_REGS>(xv, live, r * (long long)n + t, bd, qs, qd);
        return;
    }
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
