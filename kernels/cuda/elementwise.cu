// Op `elementwise`: small vector helpers of the forward pass (residual adds, scaling, copies).
// Row-wise kernels take the row count and grid-stride over grid.y, so any number of rows fits
// the grid (grid.y is limited to 65535).

// y = a + b (y may alias a or b).
extern "C" __global__ void add_f32(const float* a, const float* b, float* y, long long n) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

// y = a * s.
extern "C" __global__ void scale_f32(const float* a, float s, float* y, long long n) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] * s;
}

// Strided row copy: dst[r*ds + i] = src[r*ss + i] for i < n (splitting q into nope/rope, cache writes).
extern "C" __global__ void copy_rows_f32(const float* __restrict__ src, long long ss,
                                         float* __restrict__ dst, long long ds, int n,
                                         long long rows) {
    pdl_entry();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) dst[r * ds + i] = src[r * ss + i];
}

// f32 -> bf16 (round to nearest even), for bf16 cuBLAS operands.
extern "C" __global__ void f32_to_bf16(const float* src, uint16_t* dst, long long n) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = f32_to_bf16(src[i]);
}

// bf16 -> f32 (exact widening), for reading bf16 caches with f32 kernels.
extern "C" __global__ void bf16_to_f32(const uint16_t* src, float* dst, long long n) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = bf16_to_f32(src[i]);
}

// y[r, i] = x[r, i] + b[i] (bias broadcast over rows). Grid (ceil(cols/256), rows).
extern "C" __global__ void add_bias_f32(const float* x, const float* __restrict__ b, float* y,
                                        int cols, long long rows) {
    pdl_entry();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= cols) return;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) y[r * cols + i] = x[r * cols + i] + b[i];
}

// dst[r, :] = src[idx[r], :] for rows of `cols` values; the host checks every index.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ src, const int* __restrict__ idx,
                                           float* __restrict__ dst, int cols, long long rows) {
    pdl_entry();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= cols) return;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y)
        dst[r * cols + i] = src[(long long)idx[r] * cols + i];
}

// Row r of src to the row at device address dst[r]: a batched step's rows appended to each
// sequence's own cache in one launch, as f32 or rounded to bf16 as f32_to_bf16 rounds. The host
// checks that every address holds a row of `cols`.
template <int BF16>
DEV void scatter_rows_impl(const float* __restrict__ src, const unsigned long long* __restrict__ dst,
                           int cols, long long rows) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= cols) return;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const float v = src[r * cols + i];
        if (BF16) ((uint16_t*)dst[r])[i] = f32_to_bf16(v);
        else ((float*)dst[r])[i] = v;
    }
}
extern "C" __global__ void scatter_rows_f32(const float* src, const unsigned long long* dst, int cols,
                                            long long rows) {
    pdl_entry();
    scatter_rows_impl<0>(src, dst, cols, rows);
}
extern "C" __global__ void scatter_rows_bf16(const float* src, const unsigned long long* dst, int cols,
                                             long long rows) {
    pdl_entry();
    scatter_rows_impl<1>(src, dst, cols, rows);
}
