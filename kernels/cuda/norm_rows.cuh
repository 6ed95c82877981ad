// Row bodies shared by the norm modules (rmsnorm.cu, layernorm.cu): each takes the block's row
// and its thread layout as arguments instead of reading blockIdx / blockDim, so a launch that
// runs several norms side by side (rmsnorm.cu's mla_norms_f32) executes the same code, with the
// same elements per thread and the same reductions, as the one-norm kernels: bitwise their
// outputs. A job's `bd` threads do its work; threads t >= bd of a wider block hold zeros in the
// reductions (block_sum then sums the same values: a zero warp adds 0 to no partial sum) and
// touch no memory. Every thread of the block must call a row body (they hold barriers).

// A cache row's value: f32 `cf` or bf16 `cb` (the one that is set).
DEV void cache_store(float v, long long at, float* __restrict__ cf, uint16_t* __restrict__ cb) {
    if (cf) cf[at] = v;
    else if (cb) cb[at] = f32_to_bf16(v);
}

// A row's (mean, 1 / sqrt(var + eps)) over threads t < bd, every thread getting them; two passes
// over xr in f32.
DEV float2 ln_stats(const float* xr, int n, float eps, float* scratch, int t, int bd) {
    float s = 0.0f;
    if (t < bd)
        for (int i = t; i < n; i += bd) s += xr[i];
    const float mean = block_sum(s, scratch) / (float)n;
    float v = 0.0f;
    if (t < bd)
        for (int i = t; i < n; i += bd) {
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

// The parameters of one fused norm + RoPE (+ cache append) job, as the host's
// `kernels::norm` NormRopeJob lays them out: rmsnorm_rope_f32's / layernorm_rope_f32's
// arguments, the rows and the job's threads.
struct NormRopeJob {
    float* x;
    long long x_stride;
    const float* w;
    const float* b;
    const int* pos;
    const float* inv_freq;
    float* cf;
    uint16_t* cb;
    long long c_stride;
    int cols;
    int n;
    float eps;
    int off;
    int n_rot;
    int style;
    int rows;
    int threads;
};

// The job of a one-norm launch (rmsnorm_rope_f32, layernorm_rope_f32): its arguments, a block
// of blockDim.x threads per row.
DEV NormRopeJob norm_rope_job(float* x, long long x_stride, int cols, const float* w,
                              const float* b, int n, float eps, int off, int n_rot,
                              const int* pos, const float* inv_freq, int style, float* cf,
                              uint16_t* cb, long long c_stride) {
    const NormRopeJob j = {x,   x_stride, w,     b,     pos,   inv_freq,       cf,
                           cb,  c_stride, cols,  n,     eps,   off,            n_rot,
                           style, (int)gridDim.x, (int)blockDim.x};
    return j;
}

// layernorm_rope_f32's row r (see there) by threads t < bd.
DEV void layernorm_rope_row(const NormRopeJob& j, long long r, int t, int bd, float* scratch) {
    float* xr = j.x + r * j.x_stride;
    const long long cr = r * j.c_stride;
    const int half = j.n_rot >> 1, off = j.off, n_rot = j.n_rot;
    const float2 st = ln_stats(xr, j.n, j.eps, scratch, t, bd);
    int i1 = 0, i2 = 0;
    float o1 = 0.0f, o2 = 0.0f;
    if (t < half) {
        rope_pair(j.style, t, half, i1, i2);
        const float h1 = ln_out(xr[off + i1], st, j.w, j.b, off + i1);
        const float h2 = ln_out(xr[off + i2], st, j.w, j.b, off + i2);
        rope_rotate(h1, h2, (float)j.pos[r] * j.inv_freq[t], o1, o2);
    }
    // Every read of the row before any write: a pair's elements belong to other threads' strided
    // elements.
    __syncthreads();
    if (t < bd)
        for (int i = t; i < j.n; i += bd) {
            if (i >= off && i < off + n_rot) continue;
            const float h = ln_out(xr[i], st, j.w, j.b, i);
            xr[i] = h;
            cache_store(h, cr + i, j.cf, j.cb);
        }
    if (t < half) {
        xr[off + i1] = o1;
        xr[off + i2] = o2;
        cache_store(o1, cr + off + i1, j.cf, j.cb);
        cache_store(o2, cr + off + i2, j.cf, j.cb);
    }
}
