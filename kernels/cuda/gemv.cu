// Op `gemv`: y = W x for decode, reading every weight byte once in its GGUF format.
//
// Design (see kernels/src/gemv.rs for the why): f32 activations, weights dequantized in registers
// by the same deq32<> decoders as the dequant op, f32 FMAs.
// A 128-thread block computes R consecutive output rows; its 4 warps split the row length
// (lane l of warp w takes the 32-element chunks w*32 + l, + 128, ...). Each lane loads its
// activation chunk once and uses it for all R rows, so activation traffic per weight is
// 4/R bytes instead of 4 (at R = 1 the activations, not the weights, dominated L1/L2 traffic).
// Partial sums: fixed-order warp reduction, then the 4 warps in order through shared memory,
// so results are bitwise run-to-run reproducible.
//
// Channels (grid.y) batch independent GEMVs in one launch: MoE experts (`ids[ch]` picks the
// expert slab), per-head absorption matrices, or several tokens of one matrix.
//   weight of channel ch  = W + e * w_ch_stride,  e = ids ? ids[ch] : ch % n_slabs   (bytes)
//   input of channel ch   = x + (ch / x_ch_div) * x_ch_stride                         (floats)
//   output of channel ch  = y + ch * y_ch_stride                                      (floats)
// An expert id outside [0, n_slabs) writes NaN rows instead of reading out of bounds.

#define GEMV_WARPS 4

template <int QT, int R>
DEV void gemv_impl(const uint8_t* __restrict__ W, long long row_bytes, int nrows, int K,
                   long long w_ch_stride, const int* __restrict__ ids, int n_slabs,
                   const float* __restrict__ x, long long x_ch_stride, int x_ch_div,
                   float* __restrict__ y, long long y_ch_stride, const QTables& t) {
    constexpr int NC = QTraits<QT>::QB / 32, BB = QTraits<QT>::BB;
    __shared__ float red[GEMV_WARPS][R];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * R;
    const int ch = blockIdx.y;
    const long long e = ids ? (long long)ids[ch] : (long long)(ch % n_slabs);
    float* yp = y + (long long)ch * y_ch_stride + row0;
    if (e < 0 || e >= n_slabs) {  // uniform across the block: no barrier is skipped
        if (threadIdx.x < R && row0 + (int)threadIdx.x < nrows) yp[threadIdx.x] = __int_as_float(0x7fc00000);
        return;
    }
    const uint8_t* wbase = W + e * w_ch_stride;
    // Rows past the end repeat the last row (results discarded): no branch in the hot loop.
    const uint8_t* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = wbase + (long long)min(row0 + r, nrows - 1) * row_bytes;
    const float* xr = x + (long long)(ch / x_ch_div) * x_ch_stride;
    const int nq = K >> 5;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int q = warp * 32 + lane; q < nq; q += GEMV_WARPS * 32) {
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
            deq32<QT>(wr[r] + (q / NC) * BB, q % NC, t, w);
            float a = acc[r];
#pragma unroll
            for (int i = 0; i < 32; ++i) a += w[i] * xv[i];
            acc[r] = a;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = warp_sum(acc[r]);
        if (lane == 0) red[warp][r] = s;
    }
    __syncthreads();
    if (threadIdx.x < R) {
        const int r = threadIdx.x;
        float s = red[0][r];
#pragma unroll
        for (int w = 1; w < GEMV_WARPS; ++w) s += red[w][r];
        if (row0 + r < nrows) yp[r] = s;
    }
}

#define GEMV_KERNEL(QT, name)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                                   \
        gemv_##name(const uint8_t* W, long long row_bytes, int nrows, int K, long long w_ch_stride, \
                    const int* ids, int n_slabs, const float* x, long long x_ch_stride,             \
                    int x_ch_div, float* y, long long y_ch_stride, QTables t) {                     \
        gemv_impl<QT, 1>(W, row_bytes, nrows, K, w_ch_stride, ids, n_slabs, x, x_ch_stride,         \
                         x_ch_div, y, y_ch_stride, t);                                              \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                                   \
        gemv4_##name(const uint8_t* W, long long row_bytes, int nrows, int K,                       \
                     long long w_ch_stride, const int* ids, int n_slabs, const float* x,            \
                     long long x_ch_stride, int x_ch_div, float* y, long long y_ch_stride,          \
                     QTables t) {                                                                   \
        gemv_impl<QT, 4>(W, row_bytes, nrows, K, w_ch_stride, ids, n_slabs, x, x_ch_stride,         \
                         x_ch_div, y, y_ch_stride, t);                                              \
    }
FOR_EACH_QTYPE(GEMV_KERNEL)
