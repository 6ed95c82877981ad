// Op `gemv`: y = W x for decode with f32 activations, reading every weight byte once in its
// device layout (GGUF blocks or the repacked layout, quant.cuh). This is the exact path: the
// weights are decoded by the same dec_chunk<> as the dequant op and multiplied in f32, so the
// result equals an f32 oracle up to summation order. The fast path for the main types is
// gemvq.cu (q8_1 activations, integer dot products).
//
// Mapping: a 128-thread block = 4 warps; a warp splits into 32/LPR groups of LPR lanes (LPR a
// power of two dividing K/32, chosen by the host so every lane has work: LPR = 2 at K = 192,
// 16 at K = 512, 32 from K = 1024 on). A group computes R consecutive rows; lane l of a group
// takes the 32-element chunks l, l + LPR, ... and reuses each activation chunk for its R rows.
// Partial sums: fixed-order xor-shuffle reduction inside the group, so results are bitwise
// run-to-run reproducible.
//
// Channels (grid.y, grid-strided, so any count fits) batch independent GEMVs in one launch: MoE
// experts (`ids[ch]` picks the expert slab), per-head matrices, or several tokens.
//   slab of channel ch    = ids ? ids[ch] : ch % n_slabs; row r of slab e is global row e*nrows+r
//   input of channel ch   = x + (ch / x_div) * x_stride                         (floats)
//   output of channel ch  = y + ch * y_stride                                   (floats)
// An expert id outside [0, n_slabs) writes NaN rows instead of reading out of bounds.

struct GemvF {
    WMat w;
    int nrows, K, n_slabs, lpr;
    const int* ids;
    const float* x;
    long long x_stride;
    int x_div, count;
    float* y;
    long long y_stride;
};

// KS > 1 (one row per group only): the 4 warps of a block split each of their row group's rows
// over K (warp wk takes chunks wk*lpr + gl, then every KS*lpr-th) and their partial sums meet in
// shared memory in warp order (fixed: bitwise reproducible). A matrix of few rows (the MoE
// router's 256 F32 rows of 6,144: 64 blocks of one row a warp) otherwise runs on half the SMs
// with one warp's loads in flight per row.
template <int QT, int R, int KS = 1>
DEV void gemv_impl(const GemvF& p, const QTables& t) {
    static_assert(KS == 1 || (R == 1 && (KS == 2 || KS == 4)), "k-split: one row, 2 or 4 warps");
    __shared__ float red[KS > 1 ? 4 * 32 : 1];
    pdl_entry();
    constexpr int NC = QTraits<QT>::QB / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int lpr = p.lpr, groups = 32 / lpr;
    const int gl = lane & (lpr - 1), grp = lane / lpr;
    const int wk = warp % KS;
    const int row0 = (blockIdx.x * (4 / KS) * groups + (warp / KS) * groups + grp) * R;
    const int nq = p.K >> 5;
    const long long bpr = p.K / QTraits<QT>::QB;
    for (long long ch = blockIdx.y; ch < p.count; ch += gridDim.y) {
        const long long e = p.ids ? (long long)p.ids[ch] : ch % p.n_slabs;
        float* yp = p.y + ch * p.y_stride;
        if (e < 0 || e >= p.n_slabs) {  // uniform across the block
            if (gl == 0)
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (row0 + r < p.nrows) yp[row0 + r] = __int_as_float(0x7fc00000);
            continue;
        }
        // Rows past the end repeat the last row (results discarded): no branch in the hot loop.
        const long long base = e * p.nrows;
        const float* xr = p.x + (ch / p.x_div) * p.x_stride;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        for (int q = wk * lpr + gl; q < nq; q += lpr * KS) {
            float xv[32];
            const float4* xp = (const float4*)(xr + q * 32);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float4 v = xp[i];
                xv[4 * i] = v.x;
                xv[4 * i + 1] = v.y;
                xv[4 * i + 2] = v.z;
                xv[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float w[32];
                dec_chunk<QT>(p.w, (base + min(row0 + r, p.nrows - 1)) * bpr + q / NC, q % NC, t, w);
                float a = acc[r];
#pragma unroll
                for (int i = 0; i < 32; ++i) a += w[i] * xv[i];
                acc[r] = a;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float s = acc[r];
            for (int o = lpr >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (KS > 1) {
                if (gl == 0) red[warp * 32 + grp] = s;
                __syncthreads();
                if (wk == 0) {
                    s = 0.0f;
                    for (int w = 0; w < KS; ++w) s += red[(warp + w) * 32 + grp];
                }
                __syncthreads();  // `red` is reused by the next channel
            }
            if (wk == 0 && gl == 0 && row0 + r < p.nrows) yp[row0 + r] = s;
        }
    }
}

#define GEMV_KERNEL(QT, name)                                                                     \
    extern "C" __global__ void __launch_bounds__(128, 1) gemv_##name(GemvF p, QTables t) { \
        gemv_impl<QT, 1>(p, t);                                                                   \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(128, 1) gemv4_##name(GemvF p, QTables t) { \
        gemv_impl<QT, 4>(p, t);                                                                   \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(128, 1) gemvs_##name(GemvF p, QTables t) { \
        gemv_impl<QT, 1, 4>(p, t);                                                                \
    }
FOR_EACH_QTYPE(GEMV_KERNEL)
FOR_EACH_RTYPE(GEMV_KERNEL)

// Plain F32 rows read coalesced (the MoE router: 256 F32 rows of 6,144 after the FFN norm).
// gemv_impl gives each lane a 32-element chunk (128 contiguous bytes), so a warp's 16-byte load
// touches 32 cache lines; here the block's threads take the row's float4s in turn (thread t:
// t, t + 128, ...), so each warp load is 512 contiguous bytes. One row per block, 4 loads of a
// thread in flight, each thread's products summed in its index order, then the warp's
// xor-shuffle tree and the 4 warps in order: bitwise run-to-run reproducible (H100: the
// router's 6.3 MB 10.6 -> 5.0 us a layer). Needs K % 4 == 0 and 16-byte aligned rows and
// input (the host checks).
extern "C" __global__ void __launch_bounds__(128) gemvc_f32(GemvF p, QTables) {
    __shared__ float red[4];
    pdl_entry();
    const int row = blockIdx.x;
    const long long rb = (long long)p.K * 4;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n4 = p.K >> 2;
    for (long long ch = blockIdx.y; ch < p.count; ch += gridDim.y) {
        const long long e = p.ids ? (long long)p.ids[ch] : ch % p.n_slabs;
        float* yp = p.y + ch * p.y_stride;
        if (row >= p.nrows) continue;
        if (e < 0 || e >= p.n_slabs) {  // uniform across the block
            if (threadIdx.x == 0) yp[row] = __int_as_float(0x7fc00000);
            continue;
        }
        const float4* w4 = (const float4*)(p.w.base + (e * p.nrows + row) * rb);
        const float4* x4 = (const float4*)(p.x + (ch / p.x_div) * p.x_stride);
        float acc = 0.0f;
        int i = threadIdx.x;
        for (; i + 3 * 128 < n4; i += 4 * 128) {
            float4 w[4], x[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                w[u] = __ldg(w4 + i + 128 * u);
                x[u] = x4[i + 128 * u];
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                acc = fmaf(w[u].x, x[u].x, acc);
                acc = fmaf(w[u].y, x[u].y, acc);
                acc = fmaf(w[u].z, x[u].z, acc);
                acc = fmaf(w[u].w, x[u].w, acc);
            }
        }
        for (; i < n4; i += 128) {
            const float4 w = __ldg(w4 + i), x = x4[i];
            acc = fmaf(w.x, x.x, acc);
            acc = fmaf(w.y, x.y, acc);
            acc = fmaf(w.z, x.z, acc);
            acc = fmaf(w.w, x.w, acc);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) red[warp] = acc;
        __syncthreads();
        if (threadIdx.x == 0) yp[row] = ((red[0] + red[1]) + red[2]) + red[3];
        __syncthreads();  // `red` is reused by the next channel
    }
}
