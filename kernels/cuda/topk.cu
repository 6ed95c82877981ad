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
    pdl_entry();
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

// ---------------------------------------------------------------------------------------------
// The same selection with each row split over blocks, for few long rows (decode: one query row,
// up to 200k keys), where one block per row leaves all SMs but one idle. Grid (chunks, rows),
// TKM_THREADS threads, `chunk` (a multiple of 4 * TKM_THREADS) keys per block. Launches, in
// order on one stream, after the host zeroes TKM_ZR ints per row of `zs`:
//   topk_mb_hist, pass = 0..3: the 8-bit digit histogram (shift 24 - 8 * pass) of the chunk's
//     keys still matching the threshold prefix, added to the row's histogram with atomics.
//     The last block of the row to finish (ticket counter) picks the digit exactly as
//     radix_select does and writes the state {prefix, remaining, select, n_valid} the next
//     pass reads. Pass 0 also stores the chunk's candidate count (vc) and decides whether to
//     select at all (n_valid > k); pass 3 stores, per chunk, above + (keys of the last digit
//     >= b) for b = 0..256 (gc), above = keys whose upper 24 bits exceed the prefix's.
//   topk_mb_gather: from vc / gc every block knows how many entries above the threshold and
//     how many threshold ties precede its chunk, so it writes its selected indices at their
//     final positions in index order; then the -1 padding and count.
// Same histograms, same digit rule and the same tie order as topk_f32: identical output.

#define TKM_THREADS 256
#define TKM_ZR 1056        // zeroed ints per row: 4 histograms of 256, 4 tickets, 4 states of 4
#define TKM_TICKET 1024
#define TKM_STATE 1028     // state of pass p at TKM_STATE + 4 * p
#define TKM_G 257          // ints per chunk in gc

// Inclusive scan of v in thread order over a TKM_THREADS-thread block; `total` gets the sum.
// `ws` holds TKM_THREADS / 32 ints.
DEV int tk_scan(int v, int* ws, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
    }
    __syncthreads();
    if (lane == 31) ws[warp] = v;
    __syncthreads();
    int before = 0, tot = 0;
#pragma unroll
    for (int w = 0; w < TKM_THREADS / 32; ++w) {
        const int c = ws[w];
        if (w < warp) before += c;
        tot += c;
    }
    total = tot;
    return before + v;
}

extern "C" __global__ void __launch_bounds__(TKM_THREADS)
    topk_mb_hist(const float* __restrict__ x, long long x_stride, int n, int k, int chunk,
                 int pass, int* __restrict__ zs, int* __restrict__ vc, int* __restrict__ gc) {
    pdl_entry();
    __shared__ int h[256];
    __shared__ int ws[TKM_THREADS / 32];
    __shared__ int sh_last;
    const int t = threadIdx.x, lane = t & 31, c = blockIdx.x, chunks = gridDim.x;
    const long long r = blockIdx.y;
    int* z = zs + r * TKM_ZR;
    const float* xr = x + r * x_stride;
    const int shift = 24 - 8 * pass;
    uint32_t prefix = 0, mask = 0;
    int rem = k, n_valid = 0;
    if (pass > 0) {
        const int* st = z + TKM_STATE + 4 * (pass - 1);
        if (!st[2]) return;  // at most k candidates: all kept, nothing to narrow down
        prefix = (uint32_t)st[0];
        rem = st[1];
        n_valid = st[3];
        mask = 0xFFFFFFFFu << (shift + 8);
    }
    h[t] = 0;
    __syncthreads();
    const int i0 = c * chunk, i1 = min(n, i0 + chunk);
    int above = 0;
    for (int base = i0; base < i1; base += TKM_THREADS) {
        const int i = base + t;
        const uint32_t key = i < i1 ? select_key<true>(xr[i]) : 0u;
        above += (key != 0u && (key & mask) > prefix) ? 1 : 0;
        const uint32_t bin = (key != 0u && (key & mask) == prefix) ? ((key >> shift) & 0xFF) : 256u;
        // Scores cluster in a few digits: one shared atomic per distinct digit of a warp.
        const unsigned peers = __match_any_sync(0xffffffffu, bin);
        if (bin < 256u && lane == __ffs(peers) - 1) atomicAdd(&h[bin], __popc(peers));
    }
    __syncthreads();
    // Thread t owns digit 255 - t, so scans in thread order count digits from the top.
    const int cnt = h[255 - t];
    if (cnt) atomicAdd(&z[pass * 256 + 255 - t], cnt);
    int tot;
    const int incl = tk_scan(cnt, ws, tot);
    if (pass == 0 && t == 0) vc[r * chunks + c] = tot;
    if (pass == 3) {
        int a_tot;
        tk_scan(above, ws, a_tot);
        int* g = gc + (r * chunks + c) * TKM_G;
        g[255 - t] = a_tot + incl;
        if (t == 0) g[256] = a_tot;
    }
    // Last block done: every other block's histogram atomics are visible after its fence.
    __threadfence();
    __syncthreads();
    if (t == 0) sh_last = atomicAdd(&z[TKM_TICKET + pass], 1) == chunks - 1;
    __syncthreads();
    if (!sh_last) return;
    __threadfence();
    const int hb = ((volatile int*)z)[pass * 256 + 255 - t];
    int all;
    const int ge = tk_scan(hb, ws, all);  // row's keys in this pass with digit >= 255 - t
    int* st = z + TKM_STATE + 4 * pass;
    if (pass == 0) {
        n_valid = all;
        if (all <= k) {
            if (t == 0) st[3] = all;  // select = 0 (zeroed): every candidate is kept
            return;
        }
    }
    // radix_select's rule: the highest digit b with (keys of digits >= b) >= rem; the digits
    // above it are all taken. The scan is monotone in t, so exactly one thread writes.
    const int gt = ge - hb;
    if ((ge >= rem || t == 255) && gt < rem) {
        st[0] = (int)(prefix | ((uint32_t)(255 - t) << shift));
        st[1] = rem - gt;
        st[2] = 1;
        st[3] = n_valid;
    }
}

extern "C" __global__ void __launch_bounds__(TKM_THREADS)
    topk_mb_gather(const float* __restrict__ x, long long x_stride, int n, int k, int chunk,
                   const int* __restrict__ zs, const int* __restrict__ vc,
                   const int* __restrict__ gc, int* __restrict__ out, long long out_stride,
                   int* __restrict__ count) {
    pdl_entry();
    __shared__ int ws[TKM_THREADS / 32];
    const int t = threadIdx.x, c = blockIdx.x, chunks = gridDim.x;
    const long long r = blockIdx.y;
    const int* z = zs + r * TKM_ZR;
    const float* xr = x + r * x_stride;
    int* orow = out + r * out_stride;
    const bool select = z[TKM_STATE + 2] != 0;
    const int n_valid = z[TKM_STATE + 3];
    // Without selection every candidate (key > 0) is taken and there are no ties.
    const uint32_t thr = select ? (uint32_t)z[TKM_STATE + 12] : 0u;
    const int take_ties = select ? z[TKM_STATE + 13] : 0;
    const int d = (int)(thr & 0xFFu);
    int a = 0, e = 0;
    for (int j = t; j < c; j += TKM_THREADS) {
        if (select) {
            const int* g = gc + (r * chunks + j) * TKM_G;
            const int hi = g[d + 1];
            a += hi;
            e += g[d] - hi;
        } else {
            a += vc[r * chunks + j];
        }
    }
    int above_before, ties_before, unused;
    tk_scan(a, ws, above_before);
    tk_scan(e, ws, ties_before);
    // Each thread takes `per` consecutive keys, so thread order is index order.
    const int per = chunk / TKM_THREADS;
    const int j0 = c * chunk + t * per, j1 = min(n, j0 + per);
    int na = 0, ne = 0;
    for (int i = j0; i < j1; ++i) {
        const uint32_t key = select_key<true>(xr[i]);
        na += key > thr ? 1 : 0;
        ne += (select && key != 0u && key == thr) ? 1 : 0;
    }
    int pa = above_before + tk_scan(na, ws, unused) - na;
    int pe = ties_before + tk_scan(ne, ws, unused) - ne;
    // Position = entries above the threshold before it + threshold ties taken before it.
    for (int i = j0; i < j1; ++i) {
        const uint32_t key = select_key<true>(xr[i]);
        if (key > thr) {
            const int at = pa + min(pe, take_ties);
            if (at < k) orow[at] = i;
            ++pa;
        } else if (select && key != 0u && key == thr) {
            if (pe < take_ties && pa + pe < k) orow[pa + pe] = i;
            ++pe;
        }
    }
    const int sel = select ? k : n_valid;
    for (long long j = sel + (long long)c * TKM_THREADS + t; j < k;
         j += (long long)chunks * TKM_THREADS)
        orow[j] = -1;
    if (c == 0 && t == 0 && count) count[r] = sel;
}
