// Op `gemv`: y = W x for decode, reading every weight byte once in its GGUF format.
//
// Design (see kernels/src/gemv.rs for the why): f32 activations, weights dequantized in registers
// by the same deq32<> decoders as the dequant op, f32 FMAs. One warp per output row, 4 rows per
// 128-thread block; lane l takes the 32-element chunks l, l+32, ... of the row, then a fixed-order
// warp reduction (bitwise run-to-run reproducible).
//
// Channels (grid.y) batch independent GEMVs in one launch: MoE experts (`ids[ch]` picks the
// expert slab), per-head absorption matrices (slab = channel), or several tokens.
//   weight of channel ch  = W + e * w_ch_stride,  e = ids ? ids[ch] : ch % n_slabs   (bytes)
//   input of channel ch   = x + (ch / x_ch_div) * x_ch_stride               (floats)
//   output of channel ch  = y + ch * y_ch_stride                            (floats)
// An expert id outside [0, n_slabs) writes NaN rows instead of reading out of bounds.

template <int QT>
DEV void gemv_impl(const uint8_t* __restrict__ W, long long row_bytes, int nrows, int K,
                   long long w_ch_stride, const int* __restrict__ ids, int n_slabs,
                   const float* __restrict__ x, long long x_ch_stride, int x_ch_div,
                   float* __restrict__ y, long long y_ch_stride, const QTables& t) {
    constexpr int NC = QTraits<QT>::QB / 32, BB = QTraits<QT>::BB;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + warp;
    const int ch = blockIdx.y;
    if (row >= nrows) return;
    const long long e = ids ? (long long)ids[ch] : (long long)(ch % n_slabs);
    float* yp = y + (long long)ch * y_ch_stride + row;
    if (e < 0 || e >= n_slabs) {
        if (lane == 0) *yp = __int_as_float(0x7fc00000);
        return;
    }
    const uint8_t* wr = W + e * w_ch_stride + (long long)row * row_bytes;
    const float* xr = x + (long long)(ch / x_ch_div) * x_ch_stride;
    const int nq = K >> 5;
    // Two chunks per step, decoded in one basic block so both chunks' loads are in flight
    // together; two accumulators keep the FMA chains short. Fixed order: run-to-run identical.
    float acc0 = 0.0f, acc1 = 0.0f;
    int q = lane;
    for (; q + 32 < nq; q += 64) {
        float w0[32], w1[32];
        deq32<QT>(wr + (q / NC) * BB, q % NC, t, w0);
        deq32<QT>(wr + ((q + 32) / NC) * BB, (q + 32) % NC, t, w1);
        const float4* x0 = (const float4*)(xr + q * 32);
        const float4* x1 = (const float4*)(xr + (q + 32) * 32);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float4 a = x0[i], b = x1[i];
            acc0 += w0[4 * i] * a.x;
            acc1 += w1[4 * i] * b.x;
            acc0 += w0[4 * i + 1] * a.y;
            acc1 += w1[4 * i + 1] * b.y;
            acc0 += w0[4 * i + 2] * a.z;
            acc1 += w1[4 * i + 2] * b.z;
            acc0 += w0[4 * i + 3] * a.w;
            acc1 += w1[4 * i + 3] * b.w;
        }
    }
    if (q < nq) {
        float w0[32];
        deq32<QT>(wr + (q / NC) * BB, q % NC, t, w0);
        const float4* x0 = (const float4*)(xr + q * 32);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float4 a = x0[i];
            acc0 += w0[4 * i] * a.x;
            acc0 += w0[4 * i + 1] * a.y;
            acc0 += w0[4 * i + 2] * a.z;
            acc0 += w0[4 * i + 3] * a.w;
        }
    }
    float acc = acc0 + acc1;
    acc = warp_sum(acc);
    if (lane == 0) *yp = acc;
}

#define GEMV_KERNEL(QT, name)                                                                       \
    extern "C" __global__ void __launch_bounds__(128)                                               \
        gemv_##name(const uint8_t* W, long long row_bytes, int nrows, int K, long long w_ch_stride, \
                    const int* ids, int n_slabs, const float* x, long long x_ch_stride,             \
                    int x_ch_div, float* y, long long y_ch_stride, QTables t) {                     \
        gemv_impl<QT>(W, row_bytes, nrows, K, w_ch_stride, ids, n_slabs, x, x_ch_stride, x_ch_div, \
                      y, y_ch_stride, t);                                                          \
    }
FOR_EACH_QTYPE(GEMV_KERNEL)
