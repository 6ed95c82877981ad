// Op `layernorm`: y = (x - mean) / sqrt(var + eps) * w + b with the biased variance
// (the DSA indexer's k_norm, spec §1.7). Two-pass mean/variance in f32, one block per row.

// ln_stats, ln_out, cache_store and the fused kernel's row body: norm_rows.cuh (shared with
// rmsnorm.cu's mla_norms_f32).

extern "C" __global__ void layernorm_f32(const float* x, long long x_stride,
                                         const float* __restrict__ w, const float* __restrict__ b,
                                         float* y, long long y_stride, int n, float eps) {
    pdl_entry();
    __shared__ float scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * x_stride;
    const float2 st = ln_stats(xr, n, eps, scratch, threadIdx.x, blockDim.x);
    float* yr = y + r * y_stride;
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = ln_out(xr[i], st, w, b, i);
}

// The DSA indexer's cached keys in one launch (layer_norm + RoPE + the cache append): per row,
// layernorm_f32's statistics and outputs (the same helpers, loops and block size: bitwise), the
// pairs of columns off..off+n_rot of the normalised row rotated as rope_f32 does (style 0 or 2).
// The row is written back in place and, when a cache pointer is set, to cache row r (`c_stride`
// apart). One block per row; n_rot / 2 <= blockDim.x (checked by the host). `cols` equals n
// (rmsnorm_rope_f32's parameters, so one host launch serves both).
extern "C" __global__ void layernorm_rope_f32(float* x, long long x_stride, int cols,
                                              const float* __restrict__ w,
                                              const float* __restrict__ b, int n, float eps,
                                              int off, int n_rot, const int* __restrict__ pos,
                                              const float* __restrict__ inv_freq, int style,
                                              float* __restrict__ cf, uint16_t* __restrict__ cb,
                                              long long c_stride) {
    pdl_entry();
    __shared__ float scratch[32];
    const NormRopeJob j = norm_rope_job(x, x_stride, cols, w, b, n, eps, off, n_rot, pos,
                                        inv_freq, style, cf, cb, c_stride);
    layernorm_rope_row(j, blockIdx.x, threadIdx.x, blockDim.x, scratch);
}
