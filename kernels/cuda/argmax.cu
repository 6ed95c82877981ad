// Op `argmax`: greedy sampling on the device. One block per row of logits; the largest value
// wins, ties go to the lower index, NaN never wins. Writes the token id (int32) per row.

extern "C" __global__ void argmax_f32(const float* __restrict__ x, long long stride, int n,
                                      int* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* xr = x + (long long)blockIdx.x * stride;
    float v = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) argmax_step(v, idx, xr[i], i);
    block_argmax(v, idx, sv, si);
    // A row of only NaN still yields a valid id.
    if (threadIdx.x == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0 : idx;
}
