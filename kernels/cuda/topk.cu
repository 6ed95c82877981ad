// Op `topk`: the DSA top-k key selection per query row (spec §1.7-1.8). One 1024-thread block
// per row. Candidates are entries that are not -inf and not NaN (the scorer writes -inf for
// causally masked keys). If at most k candidates exist, all are kept; otherwise the k largest,
// found by an 8-bit radix select on order-preserving keys, ties resolved to the lower index.
// Output: the selected indices in ascending order, then -1 up to k; count[s] = number selected.

#define TOPK_THREADS 1024

DEV uint32_t order_key(float f) {
    // NaN and -inf map to 0 (never selected: candidates need key > 0).
    if (f != f || f == NEG_INF) return 0u;
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

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
    for (int i = threadIdx.x; i < n; i += blockDim.x) nv += order_key(xr[i]) ? 1.0f : 0.0f;
    const int n_valid = (int)block_sum(nv, scratch);  // exact: n < 2^24 (checked by the host)

    uint32_t prefix = 0, mask = 0;
    int remaining = k;  // how many of the elements equal to the threshold are still to take
    if (n_valid > k) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const uint32_t key = order_key(xr[i]);
                if (key && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xFF], 1);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                int rem = remaining, b = 255;
                for (; b > 0; --b) {
                    if (hist[b] >= rem) break;
                    rem -= hist[b];
                }
                sh_prefix = prefix | ((uint32_t)b << shift);
                sh_remaining = rem;
            }
            __syncthreads();
            prefix = sh_prefix;
            remaining = sh_remaining;
            mask |= 0xFFu << shift;
            __syncthreads();
        }
    }
    // Compaction in index order. Without selection (n_valid <= k) every candidate is taken.
    const bool select = n_valid > k;
    int written = 0, ties_seen = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const uint32_t key = i < n ? order_key(xr[i]) : 0u;
        const int is_tie = select && key != 0u && key == prefix;
        int tie_tot;
        const int tie_rank = ties_seen + block_excl_scan(is_tie, warp_tot, tie_tot);
        const int take = key != 0u && (!select || key > prefix || (is_tie && tie_rank < remaining));
        int take_tot;
        const int at = written + block_excl_scan(take, warp_tot, take_tot);
        if (take && at < k) orow[at] = i;
        written += take_tot;
        ties_seen += tie_tot;
    }
    const int sel = written < k ? written : k;
    for (int j = sel + threadIdx.x; j < k; j += blockDim.x) orow[j] = -1;
    if (threadIdx.x == 0 && count) count[s] = sel;
}
