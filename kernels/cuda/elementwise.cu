// Op `elementwise`: small vector helpers of the forward pass (residual adds, scaling, copies).

// y = a + b (y may alias a or b).
extern "C" __global__ void add_f32(const float* a, const float* b, float* y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

// y = a * s.
extern "C" __global__ void scale_f32(const float* a, float s, float* y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] * s;
}

// Strided row copy: dst[r*ds + i] = src[r*ss + i] for i < n (splitting q into nope/rope, cache writes).
extern "C" __global__ void copy_rows_f32(const float* __restrict__ src, long long ss,
                                         float* __restrict__ dst, long long ds, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = blockIdx.y;
    if (i < n) dst[r * ds + i] = src[r * ss + i];
}

// f32 -> bf16 (round to nearest even), for bf16 cuBLAS operands.
extern "C" __global__ void f32_to_bf16(const float* src, uint16_t* dst, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = f32_to_bf16(src[i]);
}
