// Op `sample`: token sampling on the device, one 1024-thread block per row of logits, returning
// token ids (the logits never leave the GPU). Order: temperature, then top-k, min-p, top-p
// (runtime::sampling's rules; min-p keeps x >= max + temp * ln(min_p), i.e. tempered
// probabilities of at least min_p times the best one's, and lowers K to their count).
// A row holding a non-finite logit gets SAMPLE_NONFINITE added to its id (so the caller can
// locate the fault without copying the logits).
//   temp <= 0 or top_k == 1: greedy (largest logit, ties to the lower id, NaN never wins).
//   Otherwise, with l = x / temp and u in [0, 1) given per row (the host's RNG):
//   1. radix-select the C = min(K, 1024) largest logits (K = top_k, or V when top_k = 0; ties
//      in index order) and sort them (value descending, index ascending);
//   2. the distribution is the sorted candidates, cut at the first prefix whose mass reaches
//      top_p of the top-K's mass (no cut without top-p), whenever that prefix lies among them
//      (always for top_k <= 1024);
//   3. otherwise (K > 1024, or top_k = 0, with a nucleus wider than the 1024 largest) every
//      token with x >= tau, in index order: tau = the K-th largest (no top-p) or the largest
//      threshold whose mass reaches top_p of the top-K's (32-step bisection over the
//      order-preserving keys; ties at tau are all kept);
//   4. inverse CDF at u * (the distribution's mass), in the stated order.
// Every reduction and scan runs in a fixed order, so a row and u always give the same id.
// Greedy rows of a long vocabulary may instead go through sample_greedy_part (grid (chunks,
// rows), one record per chunk) and sample_greedy_final (one block per row): one 1024-thread
// block reading a 620 KB row is latency-bound on one SM. Same id and flag as sample_rows
// (argmax_step's order is total); sample_rows then skips those rows (skip_greedy).

#define SAMPLE_THREADS 1024
#define SAMPLE_CAND 1024

struct SampleP {
    float temp;
    int top_k;
    float top_p;
    float u;
    float min_p;
};

#define SAMPLE_NONFINITE (1 << 30)

DEV uint32_t s_key(float f) { return select_key<false>(f); }

// The rows the host also sees as greedy (it picks the launch plan from the same test).
DEV bool s_greedy(const SampleP& p) { return !(p.temp > 0.0f) || p.top_k == 1; }

// Block-wide exclusive prefix sum of a float in thread order (fixed order: warp shuffles, then
// the warps' totals summed sequentially); `total` gets the block sum.
DEV float block_excl_fsum(float v, float* wsum, float& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    float excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0.0f;
    __syncthreads();
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    float before = 0.0f, tot = 0.0f;
    for (int w = 0; w < nw; ++w) {
        if (w < warp) before += wsum[w];
        tot += wsum[w];
    }
    total = tot;
    return before + excl;
}

// Inverse CDF over the entries with key >= kmin in index order; weights exp((x - mx) / temp).
DEV int s_invcdf(const float* xr, int n, uint32_t kmin, float mx, float temp, float target,
                 float* wsum, int* sh_id) {
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int i0 = threadIdx.x * per, i1 = min(n, i0 + per);
    float m = 0.0f;
    for (int i = i0; i < i1; ++i)
        if (s_key(xr[i]) >= kmin) m += expf((xr[i] - mx) / temp);
    float total;
    const float before = block_excl_fsum(m, wsum, total);
    if (threadIdx.x == 0) *sh_id = -1;
    __syncthreads();
    if (m > 0.0f && target >= before && (target < before + m || threadIdx.x == blockDim.x - 1 ||
                                         before + m >= total)) {
        float c = before;
        int pick = -1;
        for (int i = i0; i < i1; ++i) {
            if (s_key(xr[i]) < kmin) continue;
            pick = i;
            c += expf((xr[i] - mx) / temp);
            if (c > target) break;
        }
        atomicMax(sh_id, pick);  // one thread normally; the largest id on a rounding overlap
    }
    __syncthreads();
    return *sh_id;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* __restrict__ logits, long long stride, int V,
                const SampleP* __restrict__ params, int skip_greedy, int* __restrict__ out) {
    pdl_entry();
    __shared__ float cv[SAMPLE_CAND];
    __shared__ int ci[SAMPLE_CAND];
    __shared__ int hist[256];
    __shared__ int warp_tot[32];
    __shared__ float wsum[32];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ uint32_t sh_prefix;
    __shared__ int sh_rem, sh_id, sh_cut;
    const long long r = blockIdx.x;
    const float* xr = logits + r * stride;
    const SampleP p = params[r];
    if (skip_greedy && s_greedy(p)) return;  // sample_greedy_part/final own this row
    // The maximum (and the greedy answer): one block reads the whole row, 16-byte loads when
    // it is aligned.
    float bv;
    int bi;
    const int flag = block_argmax_range(xr, 0, V, bv, bi, sv, si) ? SAMPLE_NONFINITE : 0;
    if (s_greedy(p) || bi == 0x7fffffff || bv == NEG_INF) {
        if (threadIdx.x == 0) out[r] = (bi == 0x7fffffff ? 0 : bi) + flag;
        return;
    }
    const float mx = bv, temp = p.temp;
    float nv = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) nv += s_key(xr[i]) ? 1.0f : 0.0f;
    const int n_valid = (int)block_sum(nv, wsum);  // exact: V < 2^24 (host check)
    int K = (p.top_k > 0 && p.top_k < n_valid) ? p.top_k : n_valid;
    if (p.min_p > 0.0f && p.min_p <= 1.0f) {
        // Every entry >= the floor outranks every entry below it: the top-K after min-p is the
        // top min(K, count) (the maximum itself always passes).
        const uint32_t kf = s_key(mx + temp * logf(p.min_p));
        float nf = 0.0f;
        for (int i = threadIdx.x; i < V; i += blockDim.x) nf += s_key(xr[i]) >= kf ? 1.0f : 0.0f;
        K = min(K, max(1, (int)block_sum(nf, wsum)));
    }
    const int C = min(K, SAMPLE_CAND);
    // 1. The C largest, compacted in index order, then sorted.
    uint32_t prefix;
    int remaining;
    radix_select<false>(xr, V, C, hist, &sh_prefix, &sh_rem, prefix, remaining);
    compact_selected<false>(xr, V, true, prefix, remaining, warp_tot, [&](int at, int i) {
        if (at < SAMPLE_CAND) {
            cv[at] = xr[i];
            ci[at] = i;
        }
    });
    for (int j = C + threadIdx.x; j < SAMPLE_CAND; j += blockDim.x) {
        cv[j] = NEG_INF;
        ci[j] = 0x7fffffff;
    }
    __syncthreads();
    // Bitonic sort: value descending, index ascending.
    for (int size = 2; size <= SAMPLE_CAND; size <<= 1) {
        for (int stride2 = size >> 1; stride2 > 0; stride2 >>= 1) {
            const int j = threadIdx.x, partner = j ^ stride2;
            if (partner > j) {
                const bool desc = (j & size) == 0;
                const float a = cv[j], b = cv[partner];
                const int ia = ci[j], ib = ci[partner];
                const bool a_first = a > b || (a == b && ia < ib);
                if (a_first != desc) {
                    cv[j] = b;
                    cv[partner] = a;
                    ci[j] = ib;
                    ci[partner] = ia;
                }
            }
            __syncthreads();
        }
    }
    // 2. Masses: the candidates' (sorted order) and the top-K's (K > C: one more select).
    const float e = threadIdx.x < C ? expf((cv[threadIdx.x] - mx) / temp) : 0.0f;
    float zc;
    const float before = block_excl_fsum(e, wsum, zc);
    uint32_t kth = prefix;  // C = K: the K-th largest
    float zref = zc;
    if (K > C) {
        kth = 1u;  // every valid entry
        if (K < n_valid) {
            int rk;
            radix_select<false>(xr, V, K, hist, &sh_prefix, &sh_rem, kth, rk);
        }
        float m = 0.0f;
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            if (s_key(xr[i]) >= kth) m += expf((xr[i] - mx) / temp);
        zref = block_sum(m, wsum);
    }
    const bool nucleus = p.top_p < 1.0f;
    int id;
    if (nucleus ? zc >= p.top_p * zref : K <= C) {
        // The nucleus lies within the sorted candidates (or they are the whole top-K): cut at
        // the first prefix reaching top_p of the reference mass (all C without a nucleus).
        if (threadIdx.x == 0) sh_cut = C - 1;
        __syncthreads();
        if (nucleus && threadIdx.x < C) {
            const float lim = p.top_p * zref;
            // The first crossing (rounding could let two neighbours both look like one).
            if (before < lim && before + e >= lim) atomicMin(&sh_cut, (int)threadIdx.x);
        }
        __syncthreads();
        const int cut = sh_cut;
        // The mass up to the cut is the cut entry's inclusive prefix.
        if (threadIdx.x == cut) sh_id = __float_as_int(before + e);
        __syncthreads();
        const float target = p.u * __int_as_float(sh_id);
        __syncthreads();
        if (threadIdx.x == 0) sh_id = cut;
        __syncthreads();
        if (threadIdx.x <= cut && before <= target && target < before + e)
            atomicMin(&sh_id, (int)threadIdx.x);  // the first interval holding the target
        __syncthreads();
        id = ci[sh_id];
    } else {
        // 3. Index order over key >= kmin: the top-K (no nucleus), or the largest threshold
        //    whose mass reaches top_p of the top-K's (32-step bisection over the keys).
        uint32_t kmin = kth;
        if (nucleus) {
            uint32_t lo = kth, hi = s_key(mx);
            for (int it = 0; it < 32 && lo < hi; ++it) {
                const uint32_t mid = lo + (hi - lo + 1) / 2;
                float m = 0.0f;
                for (int i = threadIdx.x; i < V; i += blockDim.x)
                    if (s_key(xr[i]) >= mid) m += expf((xr[i] - mx) / temp);
                m = block_sum(m, wsum);
                if (m >= p.top_p * zref) lo = mid;
                else hi = mid - 1;
            }
            kmin = lo;
        }
        float m = 0.0f;
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            if (s_key(xr[i]) >= kmin) m += expf((xr[i] - mx) / temp);
        m = block_sum(m, wsum);
        id = s_invcdf(xr, V, kmin, mx, temp, p.u * m, wsum, &sh_id);
    }
    if (threadIdx.x == 0) out[r] = (id < 0 ? bi : id) + flag;
}

#define GREEDY_THREADS 256

// Chunk blockIdx.x (`chunk` logits) of every greedy row: its (value, id, non-finite) record at
// part[r * gridDim.x + blockIdx.x]. Non-greedy rows are left to sample_rows.
extern "C" __global__ void __launch_bounds__(GREEDY_THREADS)
    sample_greedy_part(const float* __restrict__ logits, long long stride, int V, int chunk,
                       const SampleP* __restrict__ params, long long rows,
                       int4* __restrict__ part) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int i0 = blockIdx.x * chunk, i1 = min(V, i0 + chunk);
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        if (!s_greedy(params[r])) continue;
        float v;
        int idx;
        const bool bad = block_argmax_range(logits + r * stride, i0, i1, v, idx, sv, si);
        if (threadIdx.x == 0) argmax_part_store(part + r * gridDim.x + blockIdx.x, v, idx, bad);
    }
}

// The greedy rows' ids from their `chunks` records, as sample_rows writes them.
extern "C" __global__ void __launch_bounds__(GREEDY_THREADS)
    sample_greedy_final(const int4* __restrict__ part, int chunks,
                        const SampleP* __restrict__ params, long long rows,
                        int* __restrict__ out) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ int si[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        if (!s_greedy(params[r])) continue;
        float v;
        int idx;
        const bool bad = argmax_merge_parts(part + r * chunks, chunks, v, idx, sv, si);
        if (threadIdx.x == 0)
            out[r] = (idx == 0x7fffffff ? 0 : idx) + (bad ? SAMPLE_NONFINITE : 0);
    }
}
