// Op `layernorm`: y = (x - mean) / sqrt(var + eps) * w + b with the biased variance
// (the DSA indexer's k_norm, spec §1.7). Two-pass mean/variance in f32, one block per row.

extern "C" __global__ void layernorm_f32(const float* x, long long x_stride,
                                         const float* __restrict__ w, const float* __restrict__ b,
                                         float* y, long long y_stride, int n, float eps) {
    __shared__ float scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * x_stride;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, scratch) / (float)n;
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float d = xr[i] - mean;
        v += d * d;
    }
    const float var = block_sum(v, scratch) / (float)n;
    const float inv = 1.0f / sqrtf(var + eps);
    float* yr = y + r * y_stride;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float h = (xr[i] - mean) * inv;
        if (w) h = h * w[i];
        if (b) h = h + b[i];
        yr[i] = h;
    }
}
