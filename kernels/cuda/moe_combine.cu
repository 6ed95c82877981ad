// Op `moe_combine`: out[n] = sum_k w[n,k] * y[n*K + k]  (+ out[n] when accumulate), k ascending.
// The expert outputs y come from the channel-batched GEMV (one channel per token x slot); slots
// whose expert id is negative (empty) are skipped when ids are given.

extern "C" __global__ void moe_combine_f32(const float* __restrict__ y, long long y_stride,
                                           const float* __restrict__ w, int K, int D,
                                           float* __restrict__ out, long long out_stride,
                                           int accumulate, const int* __restrict__ ids,
                                           long long tokens) {
    pdl_entry();
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    // Tokens grid-stride over grid.y (limited to 65535).
    for (long long n = blockIdx.y; n < tokens; n += gridDim.y) {
        float acc = 0.0f;
        for (int k = 0; k < K; ++k)
            if (!ids || ids[n * K + k] >= 0) acc += w[n * K + k] * y[(n * K + k) * y_stride + d];
        float* o = out + n * out_stride + d;
        *o = accumulate ? acc + *o : acc;
    }
}
