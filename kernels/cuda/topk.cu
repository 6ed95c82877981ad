// Op `topk`: the DSA top-k key selection per query row (spec §1.7-1.8). One 1024-thread block
// per row. Candidates are entries that are not -inf and not NaN (the scorer writes -inf for
// causally masked keys). If at most k candidates exist, all are kept; otherwise the k largest,
// found by an 8-bit radix select on order-preserving keys (prelude.cuh), ties resolved to the
// lower index.
// Output: the selected indices in ascending order, then -1 up to k; count[s] = number selected.

#define TOPK_THREADS 1024

extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    topk_f32(const float* __restrict__ x, long long x_stride, int n, int k, int* __restrict__ out,
             long long out_stride, int* __restrict__ count) {
    __shared__ int hist[256];
    __shared__ int warp_tot[32];
    __shared__ uint32_t sh_prefix;
    __shared__ int sh_remaining;
    __shared__ float scratch[32];
    const long long s = blockIdx.x;
    const float* xr = x + s * x_stride;
    int* orow = out + s * out_stride;

    float nv = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) nv += select_key<true>(xr[i]) ? 1.0f : 0.0f;
    const int n_valid = (int)block_sum(nv, scratch);  // exact: n < 2^24 (checked by the host)

    // How many of the elements equal to the threshold are still to take.
    uint32_t prefix = 0;
    int remaining = k;
    const bool select = n_valid > k;
    if (select) radix_select<true>(xr, n, k, hist, &sh_prefix, &sh_remaining, prefix, remaining);
    // Compaction in index order. Without selection (n_valid <= k) every candidate is taken.
    const int written = compact_selected<true>(xr, n, select, prefix, remaining, warp_tot,
                                               [&](int at, int i) {
                                                   if (at < k) orow[at] = i;
                                               });
    const int sel = written < k ? written : k;
    for (int j = sel + threadIdx.x; j < k; j += blockDim.x) orow[j] = -1;
    if (threadIdx.x == 0 && count) count[s] = sel;
}
