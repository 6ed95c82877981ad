// Op `layernorm`: y = (x - mean) / sqrt(var + eps) * w + b with the biased variance
// (the DSA indexer's k_norm, spec §1.7). Two-pass mean/variance in f32, one block per row.

// A row's (mean, 1 / sqrt(var + eps)), every thread getting them; two passes over xr in f32.
DEV float2 ln_stats(const float* xr, int n, float eps, float* scratch) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, scratch) / (float)n;
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float d = xr[i] - mean;
        v += d * d;
    }
    const float var = block_sum(v, scratch) / (float)n;
    return make_float2(mean, 1.0f / sqrtf(var + eps));
}

// Output element i of a row from its statistics.
DEV float ln_out(float xi, float2 st, const float* __restrict__ w, const float* __restrict__ b,
                 int i) {
    float h = (xi - st.x) * st.y;
    if (w) h = h * w[i];
    if (b) h = h + b[i];
    return h;
}

extern "C" __global__ void layernorm_f32(const float* x, long long x_stride,
                                         const float* __restrict__ w, const float* __restrict__ b,
                                         float* y, long long y_stride, int n, float eps) {
    pdl_entry();
    __shared__ float scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * x_stride;
    const float2 st = ln_stats(xr, n, eps, scratch);
    float* yr = y + r * y_stride;
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = ln_out(xr[i], st, w, b, i);
}

// A cache row's value: f32 `cf` or bf16 `cb` (the one that is set).
DEV void cache_store(float v, long long at, float* __restrict__ cf, uint16_t* __restrict__ cb) {
    if (cf) cf[at] = v;
    else if (cb) cb[at] = f32_to_bf16(v);
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
    const long long r = blockIdx.x;
    float* xr = x + r * x_stride;
    const long long cr = r * c_stride;
    const int t = threadIdx.x, half = n_rot >> 1;
    const float2 st = ln_stats(xr, n, eps, scratch);
    int i1 = 0, i2 = 0;
    float o1 = 0.0f, o2 = 0.0f;
    if (t < half) {
        rope_pair(style, t, half, i1, i2);
        const float h1 = ln_out(xr[off + i1], st, w, b, off + i1);
        const float h2 = ln_out(xr[off + i2], st, w, b, off + i2);
        rope_rotate(h1, h2, (float)pos[r] * inv_freq[t], o1, o2);
    }
    // Every read of the row before any write: a pair's elements belong to other threads' strided
    // elements.
    __syncthreads();
    for (int i = t; i < n; i += blockDim.x) {
        if (i >= off && i < off + n_rot) continue;
        const float h = ln_out(xr[i], st, w, b, i);
        xr[i] = h;
        cache_store(h, cr + i, cf, cb);
    }
    if (t < half) {
        xr[off + i1] = o1;
        xr[off + i2] = o2;
        cache_store(o1, cr + off + i1, cf, cb);
        cache_store(o2, cr + off + i2, cf, cb);
    }
}
