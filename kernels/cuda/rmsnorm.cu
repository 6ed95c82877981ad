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

// The parameters of one RMSNorm job, as the host's `kernels::norm` RmsJob lays them out:
// rmsnorm_f32's arguments, the rows, the parts a row is split into and the job's threads.
struct RmsJob {
    const float* x;
    long long x_stride;
    const float* res;
    long long res_stride;
    float* xo;
    long long xo_stride;
    const float* w;
    float* y;
    long long y_stride;
    int8_t* qs;
    float2* qd;
    int n;
    float eps;
    int rows;
    int parts;
    int threads;
};

// Output element i of row r: y = w * x * inv, and its q8 code when `qs` is set (the warp holds
// the whole 32-block of i: n and the job's threads are multiples of 32, so i < n is
// warp-uniform).
DEV void rms_out(float xv, float inv, const float* __restrict__ w, float* yr, long long r, int n,
                 int i, int8_t* __restrict__ qs, float2* __restrict__ qd) {
    const float h = xv * inv;
    const float v = w ? w[i] * h : h;
    yr[i] = v;
    if (qs) q8a_store_block(v, r * (long long)n + i, qs, qd);
}

// Row r, part `part` of job j by threads t < j.threads (norm_rows.cuh: wider blocks' other
// threads hold zeros in the reduction and touch no memory). No __restrict__ on x, res, xo, y:
// callers may normalize in place (y == x) and pass res == xo.
DEV void rmsnorm_row(const RmsJob& j, long long r, int part, int t, float* scratch) {
    const int bd = j.threads, n = j.n;
    const bool act = t < bd;
    const float* xr = j.x + r * j.x_stride;
    const float* res = j.res;
    const float* __restrict__ w = j.w;
    float* yr = j.y + r * j.y_stride;
    if (n <= RMS_REGS * bd) {
        const int parts = j.parts;
        // The weights are loaded with the row, before the reduction: after it they were a
        // second memory round trip (a 6,144-wide decode row: 9.1 -> 7.3 us, H200, cold caches).
        float xv[RMS_REGS], wv[RMS_REGS];
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < RMS_REGS; ++k) {
            const int i = t + k * bd;
            float v = 0.0f;
            wv[k] = 1.0f;
            if (act && i < n) {
                v = xr[i];
                if (res) v += res[r * j.res_stride + i];
                if (w && k % parts == part) wv[k] = w[i];
            }
            xv[k] = v;
        }
#pragma unroll
        for (int k = 0; k < RMS_REGS; ++k) {
            const int i = t + k * bd;
            if (act && i < n) {
                if (res && k % parts == part) j.xo[r * j.xo_stride + i] = xv[k];
                ss += xv[k] * xv[k];
            }
        }
        ss = block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)n + j.eps);
        // y = w * (x * inv) as rms_out; the q8 blocks of all RMS_REGS values in one interleaved
        // pass (i < n is warp-uniform: n and the job's threads are multiples of 32).
        bool live[RMS_REGS];
#pragma unroll
        for (int k = 0; k < RMS_REGS; ++k) {
            const int i = t + k * bd;
            live[k] = act && i < n && k % parts == part;
            const float h = xv[k] * inv;
            xv[k] = w ? wv[k] * h : h;
            if (live[k]) yr[i] = xv[k];
        }
        if (j.qs) q8a_store_blocks<RMS_REGS>(xv, live, r * (long long)n + t, bd, j.qs, j.qd);
        return;
    }
    if (part > 0) return;  // parts are the register path's (the host launches one)
    float ss = 0.0f;
    if (act)
        for (int i = t; i < n; i += bd) {
            float v = xr[i];
            if (res) {
                v += res[r * j.res_stride + i];
                j.xo[r * j.xo_stride + i] = v;
            }
            ss += v * v;
        }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + j.eps);
    const float* src = res ? j.xo + r * j.xo_stride : xr;
    // Each thread reads back only the elements it wrote itself, so no barrier is needed.
    if (act)
        for (int i = t; i < n; i += bd) rms_out(src[i], inv, w, yr, r, n, i, j.qs, j.qd);
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
    const RmsJob j = {x,  x_stride, res, res_stride, xo,        xo_stride,
                      w,  y,        y_stride, qs,    qd,        n,
                      eps, (int)gridDim.x, (int)gridDim.y, (int)blockDim.x};
    rmsnorm_row(j, blockIdx.x, blockIdx.y, threadIdx.x, scratch);
}

// The MLA cache rows of kv_a's output (rms_norm_lead + RoPE + the cache append), row r of job j
// by threads t < bd: columns 0..n RMS-normalised by w as rmsnorm_row's register path does it
// (the host runs it with block_for(n) threads: the same elements per thread, the same
// reduction, the same products, so bitwise its output), the pairs of columns off..off+n_rot
// (off >= n) rotated as rope_f32 does (style 0 or 2), the other columns kept. The row is written
// back in place and, when a cache pointer is set, to cache row r (`c_stride` apart).
// n <= RMS_REGS * bd and n_rot / 2 <= bd (checked by the host). `b` is unused (null).
DEV void rmsnorm_rope_row(const NormRopeJob& j, long long r, int t, int bd, float* scratch) {
    float* xr = j.x + r * j.x_stride;
    const long long cr = r * j.c_stride;
    const int n = j.n, off = j.off, n_rot = j.n_rot, half = n_rot >> 1;
    const bool act = t < bd;
    float xv[RMS_REGS];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_REGS; ++k) {
        const int i = t + k * bd;
        xv[k] = act && i < n ? xr[i] : 0.0f;
    }
    // The rotated pair, read before the reduction's barriers and written after them.
    int i1 = 0, i2 = 0;
    float o1 = 0.0f, o2 = 0.0f;
    if (t < half) {
        rope_pair(j.style, t, half, i1, i2);
        rope_rotate(xr[off + i1], xr[off + i2], (float)j.pos[r] * j.inv_freq[t], o1, o2);
    }
#pragma unroll
    for (int k = 0; k < RMS_REGS; ++k) {
        const int i = t + k * bd;
        if (act && i < n) ss += xv[k] * xv[k];
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + j.eps);
#pragma unroll
    for (int k = 0; k < RMS_REGS; ++k) {
        const int i = t + k * bd;
        if (act && i < n) {
            const float h = xv[k] * inv;
            const float v = j.w ? j.w[i] * h : h;
            xr[i] = v;
            cache_store(v, cr + i, j.cf, j.cb);
        }
    }
    if (act)
        for (int i = n + t; i < j.cols; i += bd)
            if (i < off || i >= off + n_rot) cache_store(xr[i], cr + i, j.cf, j.cb);
    if (t < half) {
        xr[off + i1] = o1;
        xr[off + i2] = o2;
        cache_store(o1, cr + off + i1, j.cf, j.cb);
        cache_store(o2, cr + off + i2, j.cf, j.cb);
    }
}

// One block per row (see rmsnorm_rope_row); the parameters are layernorm_rope_f32's, so one
// host launch serves both.
extern "C" __global__ void rmsnorm_rope_f32(float* x, long long x_stride, int cols,
                                            const float* __restrict__ w,
                                            const float* __restrict__ b, int n, float eps, int off,
                                            int n_rot, const int* __restrict__ pos,
                                            const float* __restrict__ inv_freq, int style,
                                            float* __restrict__ cf, uint16_t* __restrict__ cb,
                                            long long c_stride) {
    pdl_entry();
    __shared__ float scratch[32];
    const NormRopeJob j = norm_rope_job(x, x_stride, cols, w, b, n, eps, off, n_rot, pos,
                                        inv_freq, style, cf, cb, c_stride);
    rmsnorm_rope_row(j, blockIdx.x, threadIdx.x, blockDim.x, scratch);
}

// An MLA block's three norms after its stacked q_a / kv_a / indexer-key projection, side by side
// in one launch (they read and write disjoint rows): blocks [0, q.rows * q.parts) run
// rmsnorm_f32's rows and parts of q (q_a_norm, usually with its q8 activations), the next
// kv.rows blocks rmsnorm_rope_f32's rows of kv (the latent cache rows), the last ix.rows blocks
// layernorm_rope_f32's rows of ix (the indexer's cached keys). Each job runs on its own thread
// count (blockDim.x is the largest), so every output is bitwise what its own kernel writes.
// A job of 0 rows is absent. Three launches per layer -> one: each launch boundary on the
// decode step's chain cost ~3 us (H100 timeline: rmsnorm_rope_f32 3.1 us, layernorm_rope_f32
// 3.0 us a layer, each one block).
extern "C" __global__ void mla_norms_f32(RmsJob q, NormRopeJob kv, NormRopeJob ix) {
    pdl_entry();
    __shared__ float scratch[32];
    long long b = blockIdx.x;
    const int t = threadIdx.x;
    const long long nq = (long long)q.rows * q.parts;
    if (b < nq) {
        rmsnorm_row(q, b / q.parts, (int)(b % q.parts), t, scratch);
        return;
    }
    b -= nq;
    if (b < kv.rows) {
        rmsnorm_rope_row(kv, b, t, kv.threads, scratch);
        return;
    }
    b -= kv.rows;
    if (b < ix.rows) layernorm_rope_row(ix, b, t, ix.threads, scratch);
}
