// Op `argmax`: greedy sampling on the device. The largest value wins, ties go to the lower
// index, NaN never wins. Writes the token id (int32) per row (0 for a row of only NaN).
//   argmax_f32: one block per row (many rows, or short ones).
//   argmax_part_f32 + argmax_final_f32: a row split over blocks, grid (chunks, rows), each
//   block reducing `chunk` values to one record, then one block per row reducing the records.
//   One block cannot keep enough loads in flight to read a 620 KB vocabulary row quickly; the
//   order of argmax_step is total, so the split gives the same id as argmax_f32.

#define ARGMAX_SPLIT_THREADS 256

extern "C" __global__ void argmax_f32(const float* __restrict__ x, long long stride, int n,
                                      int* __restrict__ out) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* xr = x + (long long)blockIdx.x * stride;
    float v;
    int idx;
    block_argmax_range(xr, 0, n, v, idx, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0 : idx;
}

extern "C" __global__ void __launch_bounds__(ARGMAX_SPLIT_THREADS)
    argmax_part_f32(const float* __restrict__ x, long long stride, int n, int chunk,
                    long long rows, int4* __restrict__ part) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int i0 = blockIdx.x * chunk, i1 = min(n, i0 + chunk);
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        float v;
        int idx;
        const bool bad = block_argmax_range(x + r * stride, i0, i1, v, idx, sv, si);
        if (threadIdx.x == 0) argmax_part_store(part + r * gridDim.x + blockIdx.x, v, idx, bad);
    }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_SPLIT_THREADS)
    argmax_final_f32(const int4* __restrict__ part, int chunks, long long rows,
                     int* __restrict__ out) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ int si[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        float v;
        int idx;
        argmax_merge_parts(part + r * chunks, chunks, v, idx, sv, si);
        if (threadIdx.x == 0) out[r] = idx == 0x7fffffff ? 0 : idx;
    }
}
